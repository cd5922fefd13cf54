"""Training that survives preemption: `PreemptionCheckpointHandler` and `TerminationConfig`.

TF's `tf.distribute.experimental.PreemptionCheckpointHandler`, for a functional JAX training loop. On a
termination notice (SIGTERM to any process of the job, or a `TerminationConfig.termination_watcher_fn`
that returns True), every process agrees on one call of `PreemptionCheckpointHandler.run`, saves the
state that call returned and the input position under step `total_run_calls`, then calls
`TerminationConfig.exit_fn` (default: end the process with status 42, `names.EXIT_RESTART`, which
``python -m tpustrat.launch --max-restarts N`` answers by restarting the job). The restarted job calls
`restore`, which returns the saved state, moves the iterator to the saved position and sets
`total_run_calls`, so the loop resumes with the next step: no example skipped or repeated.

How the processes agree (the coordination service of `jax.distributed`; with one process, the same
protocol on a local table). Call ``c`` of the handler is "checked" once the function has returned and
`total_run_calls` has become ``c``; a save point ``c`` is still possible for a process until it has
checked call ``c``.

1. A process that gets a notice publishes ``tpustrat/preemption/<round>/notice``. If the notice came
   before its check of call ``c`` (the SIGTERM handler and the watcher function set a flag that the
   check reads), it can still save at ``c`` and publishes ``earliest = c``.
2. The process that wrote the notice first also writes ``tpustrat/preemption/<round>/wake/<p>`` for every
   process ``p`` (P requests, once per notice). Every process has a listener thread blocked on its own wake
   key (one long-poll request, held by the coordination service until the key is written: no request per
   poll interval, so the coordinator's work while nothing happens does not grow with the process count;
   measured in ``benchmarks/bench_processes.py``; `close` writes its own key to end it). When it wakes,
   the thread publishes, under the lock that the checks take, ``earliest = checks done + 1``: the first
   call this process has not checked yet. The thread never waits for the main thread, so a process whose
   main thread is blocked in a collective (waiting for a peer) still answers.
3. At its next check, each process reads every process's ``earliest`` (one directory read of the
   round's answers per poll, with a timeout) and saves at call ``T = max(earliest)``. No process has
   checked ``T`` yet, so each reaches it; the slowest process is at most `max_steps_in_flight` calls behind the fastest (the steps are collectives), so the
   save comes within that many calls of the notice. A process never waits in a collective that another
   has left: the waits of the protocol are on the key-value store, and every process stops after the
   same call.

With ``grace_period > 0`` (TF's meaning: the time between the notice and the actual termination), the
first agreed save does not exit: training goes on, and the process that got the notice starts a second
round when ``grace_period`` minus twice the first save's duration (plus a second) has passed since the
notice; the second save exits.

SIGTERM: the handler installs a Python SIGTERM handler (main thread only) while it watches, in place of
the one JAX's distributed runtime installs for its own preemption notifier (JAX's notifier listens to the
same signal, which is how Cloud TPU VMs and GCE announce a preemption or maintenance); `close` puts the
previous Python-level handler back (the default action if there was none). A SIGTERM that reaches a
connected process before its handler exists (while it builds the model or restores) is kept by
`termination_notice`, installed when the process connects; the handler takes it when created, as a notice
that came before its first check, so the save comes at the first call the processes agree on.

A process answers a peer's notice only once it counts calls: after `restore` (which sets
`total_run_calls` to the restored step) or its first check, so that its answer is never a call it has
already passed. The save (the default one or `save_fn`) is a bounded operation of the checkpoint manager:
it must finish within the manager's timeout on every process (`CheckpointManager`), or the job stops
with a message naming the processes that have not finished it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from tpustrat._src import jax_compat, names, termination_notice, validation
from tpustrat._src.checkpoint import CheckpointManager, bounded_operation

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig"]

_PREFIX = "tpustrat/preemption"
_POLL_SECONDS = 0.05  # how often the watcher thread wakes (watcher function, grace period, local notice)
_LISTEN_MS = 2**31 - 1  # the listener's long-poll (JAX's int32 milliseconds): a timed-out one leaves a
# callback with the coordination service until the key is written, so it is not renewed often
_WATCHER_FN_SECONDS = 1.0  # how often it calls a termination_watcher_fn (as TF does)
_AGREE_TIMEOUT_SECONDS = 120.0  # how long a check waits for every process's `earliest`


class TerminationConfig:
  """How a `PreemptionCheckpointHandler` learns of a termination, saves and exits (TF's
  `tf.distribute.experimental.TerminationConfig`).

  Args:
    termination_watcher_fn: a function returning True once a termination notice is available, False
      before; called about once a second from a thread, so it must be quick and must not block. None:
      the notice is SIGTERM to any process of the job.
    exit_fn: called after the checkpoint is written. None: end the process with status 42
      (`names.EXIT_RESTART`), which ``python -m tpustrat.launch --max-restarts N`` treats as "restart
      me" (TF's ``sys.exit(42)``, here with JAX's distributed runtime shut down first and ``os._exit``:
      `atexit` handlers do not run). If it returns, training goes on (the notice is consumed).
    grace_period: seconds between the notice and the actual termination (default 0), in
      ``[0, 2**31 - 1]`` (`names.MAX_TIMEOUT_SECONDS`, the bound of every timeout; a `ValueError` names the
      value otherwise, a `TypeError` a value that is not a number). When positive, the handler saves once
      at the first agreed call, keeps training, and saves again and exits when the period is nearly over
      (see the module docstring).
    save_fn: ``save_fn(step, state, iterator)`` saves in place of the default
      ``checkpoint_manager.save(step, state, iterator=iterator, force=True)`` (TF's `save_fn` takes the
      arguments of the save; here those are the step, the state and the iterator, or None). It must be
      done reading `state`'s arrays when it returns: the next call of `run` may donate them.
  """

  def __init__(self, termination_watcher_fn: Callable[[], bool] | None = None,
               exit_fn: Callable[[], Any] | None = None, grace_period: float | None = None,
               save_fn: Callable[[int, Any, Any], Any] | None = None) -> None:
    for name, fn in (("termination_watcher_fn", termination_watcher_fn), ("exit_fn", exit_fn),
                     ("save_fn", save_fn)):
      if fn is not None and not callable(fn):
        raise TypeError(f"TerminationConfig: {name} must be callable or None, got {fn!r:.100}.")
    if grace_period is not None:
      # Every timeout's rule (`validation.check_seconds`): [0, 2**31 - 1] s, the bound of every timeout of
      # the job; inf, NaN or 2**40 would never end the first save's round.
      what = "TerminationConfig: grace_period"
      if isinstance(grace_period, str):
        raise TypeError(f"{what} must be a number of seconds in [0, {names.MAX_TIMEOUT_SECONDS}], got str "
                        f"{grace_period!r:.60}.")
      grace_period = validation.check_seconds(grace_period, what, minimum=0, maximum=names.MAX_TIMEOUT_SECONDS)
    self.termination_watcher_fn = termination_watcher_fn
    self.exit_fn = exit_fn
    self.grace_period = 0.0 if grace_period is None else float(grace_period)
    self.save_fn = save_fn

  def __repr__(self) -> str:
    return (f"TerminationConfig(termination_watcher_fn={self.termination_watcher_fn!r}, exit_fn={self.exit_fn!r}, "
            f"grace_period={self.grace_period:g}, save_fn={self.save_fn!r})")


def _exit_restart() -> None:
  """The default `exit_fn`: ends the process with status 42 ("restart me") once the checkpoint is written.

  Not ``sys.exit``: Python's shutdown then stops the daemon threads still inside native code (the input
  pipeline's prefetch thread in a transfer, say), which aborts the process now and then (SIGABRT,
  "FATAL: exception not rethrown"; measured: 1 run in 6). Here the output is flushed, JAX's distributed
  runtime is shut down (every process of the job stops at this same call, so its shutdown barrier
  passes), and the process ends with ``os._exit``: `atexit` handlers do not run.
  """
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001  # a closed stream must not stop the exit
      pass
  if jax.distributed.is_initialized():
    try:
      jax.distributed.shutdown()
    except Exception:  # noqa: BLE001  # the others are gone already: exit anyway
      pass
  _hard_exit(names.EXIT_RESTART)


def _hard_exit(status: int) -> None:
  os._exit(status)


_OPEN: weakref.WeakSet[PreemptionCheckpointHandler] = weakref.WeakSet()  # handlers whose listener may run


@atexit.register  # registered after JAX's own shutdown (tpustrat imports JAX first): runs before it
def _end_listeners() -> None:
  """At exit, ends the listener threads of handlers never closed (see `PreemptionCheckpointHandler.close`)."""
  for handler in list(_OPEN):
    handler._end_listener()  # pylint: disable=protected-access


class _LocalStore:
  """The key-value store of a one-process job."""

  def __init__(self) -> None:
    self._values: dict[str, str] = {}

  def set_once(self, key: str, value: str) -> bool:
    """Writes `key` unless it exists; True when this call wrote it."""
    return self._values.setdefault(key, value) is value  # one dict operation: atomic under the GIL

  def delete(self, key: str) -> None:
    self._values.pop(key, None)

  def try_get(self, key: str) -> str | None:
    return self._values.get(key)

  def dir_get(self, prefix: str) -> list[tuple[str, str]]:
    return [(k, v) for k, v in self._values.copy().items() if k.startswith(prefix)]

  def wait(self, key: str, stop: threading.Event) -> str | None:
    """The value of `key` once it is written, or None once `stop` is set (a local table: polled)."""
    while not stop.wait(_POLL_SECONDS):
      value = self._values.get(key)
      if value is not None:
        return value
    return None


class _CoordinationStore:
  """The coordination service's key-value store (`jax.distributed`)."""

  def __init__(self, client: Any) -> None:
    self._client = client

  def set_once(self, key: str, value: str) -> bool:
    """Writes `key` unless it exists; True when this call wrote it."""
    try:
      self._client.key_value_set(key, value)
    except Exception:  # noqa: BLE001  # ALREADY_EXISTS: another process (or this one) wrote it first
      return False
    return True

  def delete(self, key: str) -> None:
    try:
      self._client.key_value_delete(key)
    except Exception:  # noqa: BLE001  # the service is gone
      pass

  def try_get(self, key: str) -> str | None:
    try:
      return self._client.key_value_try_get(key)
    except Exception:  # noqa: BLE001  # NOT_FOUND
      return None

  def dir_get(self, prefix: str) -> list[tuple[str, str]]:
    try:
      return list(self._client.key_value_dir_get(prefix))
    except Exception:  # noqa: BLE001  # the service is going away: nothing known
      return []

  def wait(self, key: str, stop: threading.Event) -> str | None:
    """The value of `key` once it is written (one long-poll request), or None: the request timed out, or
    failed (the runtime shut down: it cancels the request), after a short pause so that a failing service
    is not asked in a tight loop. `stop` is not seen while the request waits: a closed handler's listener
    stays blocked until the key is written (`close` writes it) or the runtime shuts down."""
    try:
      return self._client.blocking_key_value_get(key, _LISTEN_MS)
    except Exception:  # noqa: BLE001  # DEADLINE_EXCEEDED, CANCELLED at shutdown, UNAVAILABLE
      stop.wait(_POLL_SECONDS)
      return None


class PreemptionCheckpointHandler:
  """Saves a checkpoint at the same step on every process when one of them is told it will terminate
  (TF's `tf.distribute.experimental.PreemptionCheckpointHandler`, with functional state).

  The handler holds no training state: `restore` returns it, `run` passes it through, and a save writes
  the state that `run`'s function returned. `total_run_calls` counts the calls of `run` (and of
  `save_checkpoint_if_preempted`); checkpoints are numbered by it, so a periodic save by the loop writes
  ``manager.save(handler.total_run_calls, state, iterator=it)``.

  Donation. The function given to `run` may donate the state it gets
  (``strategy.run(step, args=(state, batch), options=tpustrat.RunOptions(donate_argnums=0))``): the
  handler keeps no reference to the state passed in and never reads it. It saves only the state the
  function *returned*, after the function has returned and before `run` returns, and waits until that
  save is written; so the arrays it saves are the newest ones, alive, and the next call may donate them.
  A termination notice (SIGTERM, the watcher function) only sets a flag: nothing is saved from the signal
  handler, so no donated (deleted) buffer is ever read. The rules for the loop: pass `run` the state the
  previous call returned; do not return the donated input from the function (it is deleted: saving it
  raises a `RuntimeError` naming the array); call `save_checkpoint_if_preempted` with a step's result
  before the next step donates it; a periodic ``manager.save(...)`` may be followed by a donating step at
  once (the save has copied the arrays to the host when it returns); a `TerminationConfig.save_fn` must be
  done reading the state's arrays when it returns. `restore` returns a donatable state.

  >>> import tempfile
  >>> strategy = tpustrat.TPUStrategy()
  >>> it = iter(strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(6)]))
  >>> def train(w, batch):
  ...   new_w = strategy.run(lambda w, x: w + tpustrat.get_replica_context().all_reduce("sum", x.sum()),
  ...                        args=(w, batch))
  ...   return new_w, None
  >>> with tempfile.TemporaryDirectory() as d:
  ...   handler = tpustrat.PreemptionCheckpointHandler(None, d)
  ...   w = handler.restore(tpustrat.Mirrored(jnp.float32(0)), iterator=it)
  ...   for _ in range(handler.total_run_calls, 3):
  ...     w, _ = handler.run(train, w, next(it))
  ...   handler.close()
  >>> handler.total_run_calls, float(strategy.experimental_local_results(w)[0])
  (3, 24.0)

  Args:
    cluster_resolver: the job's `tpustrat.cluster_resolver.TPUClusterResolver` (None: the running job,
      as `jax.process_count()` describes it). Its process count must be JAX's.
    checkpoint_manager: a `tpustrat.checkpoint.CheckpointManager`, or a directory to create one in.
    checkpoint_dir: TF's argument for a directory when `checkpoint_manager` is not a manager; with a
      manager it must be None or the manager's directory.
    termination_config: a `TerminationConfig` (None: the defaults).

  Raises:
    TypeError: `checkpoint_manager` is neither a manager nor a path.
    ValueError: the resolver describes another job than the running one, or `checkpoint_dir` differs
      from the manager's directory.
  """

  def __init__(self, cluster_resolver: Any, checkpoint_manager: Any, checkpoint_dir: str | os.PathLike[str] | None = None,
               termination_config: TerminationConfig | None = None) -> None:
    if termination_config is None:
      termination_config = TerminationConfig()
    if not isinstance(termination_config, TerminationConfig):
      raise TypeError(f"PreemptionCheckpointHandler: termination_config must be a tpustrat.TerminationConfig or "
                      f"None, got {type(termination_config).__name__}.")
    if isinstance(checkpoint_manager, CheckpointManager):
      if checkpoint_dir is not None and os.path.abspath(os.fspath(checkpoint_dir)) != checkpoint_manager.directory:
        raise ValueError(
            f"PreemptionCheckpointHandler: checkpoint_dir={os.fspath(checkpoint_dir)!r} differs from the "
            f"directory of checkpoint_manager ({checkpoint_manager.directory!r}); give one of them.")
      manager = checkpoint_manager
    elif isinstance(checkpoint_manager, (str, os.PathLike)):
      manager = CheckpointManager(checkpoint_manager)
    elif checkpoint_manager is None and checkpoint_dir is not None:
      manager = CheckpointManager(checkpoint_dir)
    else:
      raise TypeError(
          "PreemptionCheckpointHandler: checkpoint_manager must be a tpustrat.checkpoint.CheckpointManager or a "
          f"directory, got {type(checkpoint_manager).__name__}: {checkpoint_manager!r:.100}.")
    count, index = jax.process_count(), jax.process_index()
    if cluster_resolver is not None:
      theirs = getattr(cluster_resolver, "num_processes", None)
      if theirs != count:
        raise ValueError(
            f"PreemptionCheckpointHandler: the cluster resolver describes a job of {theirs} processes, but this "
            f"process runs in a job of {count} (connect first: tpustrat.experimental_connect_to_cluster).")
    self._cluster_resolver = cluster_resolver
    self._manager = manager
    self._config = termination_config
    self._exit_fn = termination_config.exit_fn or _exit_restart
    self._index, self._count = index, count
    client = jax_compat.coordination_client() if count > 1 else None
    self._store = _CoordinationStore(client) if client is not None else _LocalStore()
    self._iterator: Any = None
    self._lock = threading.Lock()
    self._calls = 0  # total_run_calls: calls checked
    self._round = 0
    self._noticed = False  # a notice of this round reached this process (and its `earliest` is published)
    self._target: int | None = None
    self._local_notice = False  # SIGTERM or the watcher function, not yet acted on
    self._notice_time: float | None = None  # when this process got the notice that started the countdown
    self._countdown: float | None = None  # grace period: when the origin starts the final round
    self._cycle_round = 0  # the round the current notice cycle started in (the watcher function's)
    self._closed = False
    self._previous_sigterm: Any = None
    self._counting = False  # restore or a check has set total_run_calls: the watcher may answer notices
    self._notice_sent = -1  # the round whose notice the watcher thread published
    if termination_config.termination_watcher_fn is None:
      if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("PreemptionCheckpointHandler: create it on the main thread (it installs a SIGTERM "
                           "handler), or give TerminationConfig(termination_watcher_fn=...).")
      self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
      early = termination_notice.take()  # a SIGTERM after connecting, before this handler existed
      if early is not None:
        self._local_notice = True
        self._notice_time = early
        sys.stderr.write(f"tpustrat: process {index}: a SIGTERM received {time.monotonic() - early:.1f} s before "
                         "this PreemptionCheckpointHandler existed counts as a termination notice.\n")
        sys.stderr.flush()
    self._stop = threading.Event()
    self._listener: threading.Thread | None = None
    self._thread = self._start_watcher()
    _OPEN.add(self)

  def _start_watcher(self) -> threading.Thread:
    self._stop = threading.Event()
    thread = threading.Thread(target=self._watch, args=(self._stop,), name="tpustrat-preemption-watcher",
                              daemon=True)
    thread.start()
    self._listener = threading.Thread(target=self._listen, args=(self._stop,),
                                      name="tpustrat-preemption-listener", daemon=True)
    self._listener.start()
    return thread

  # -- public API ---------------------------------------------------------------------------------------

  @property
  def total_run_calls(self) -> int:
    """The number of calls of `run` (and `save_checkpoint_if_preempted`) so far, restored by `restore`."""
    return self._calls

  @property
  def checkpoint_manager(self) -> CheckpointManager:
    """The `CheckpointManager` the handler saves with."""
    return self._manager

  @property
  def cluster_resolver(self) -> Any:
    return self._cluster_resolver

  def restore(self, init_state: Any, iterator: Any = None) -> Any:
    """The latest checkpoint's state (or `init_state` when there is none), with `iterator` moved to its
    saved position and `total_run_calls` set to its step.

    `init_state` is also the target the checkpoint is restored into (its structure and shardings; see
    `CheckpointManager.restore`). `iterator` (a `DistributedIterator`, or any iterator with
    ``get_state`` / ``set_state``) is the one whose position the handler saves from now on.
    """
    if iterator is not None and not (callable(getattr(iterator, "get_state", None))
                                     and callable(getattr(iterator, "set_state", None))):
      raise TypeError(
          "PreemptionCheckpointHandler.restore: `iterator` must have get_state() and set_state() (a tpustrat "
          f"DistributedIterator or a grain iterator), got {type(iterator).__name__}.")
    self._iterator = iterator
    if self._manager.latest_step() is None:
      state, step = init_state, 0
    else:  # the newest intact checkpoint: a damaged newest one is moved aside, with a warning
      state = self._manager.restore(target=init_state, iterator=iterator)
      restored = self._manager.last_restored_step
      assert restored is not None  # set by the restore just made
      step = int(restored)
    with self._lock:
      self._calls = step
      self._counting = True
    return state

  def run(self, distributed_train_fn: Callable[..., Any], state: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """Calls ``distributed_train_fn(state, *args, **kwargs)`` and counts the call; at the call the
    processes agreed on after a termination notice, saves what it returned and calls `exit_fn`.

    `distributed_train_fn` returns a tuple ``(new_state, *outputs)`` (``(new_state,)`` when there is
    nothing else); `run` returns it unchanged, so ``new_state, *outputs = handler.run(...)``. It may
    donate `state` (``RunOptions(donate_argnums=0)`` in its `strategy.run`): a save writes ``new_state``,
    which is alive then, and is written before `run` returns (see the class docstring).
    """
    if not callable(distributed_train_fn):
      raise TypeError(f"PreemptionCheckpointHandler.run: distributed_train_fn must be callable, got "
                      f"{distributed_train_fn!r:.100}.")
    result = distributed_train_fn(state, *args, **kwargs)
    if type(result) is not tuple or not result:  # pylint: disable=unidiomatic-typecheck
      raise TypeError(
          "PreemptionCheckpointHandler.run: distributed_train_fn must return a tuple (new_state, *outputs) "
          f"(return (new_state,) when there are no outputs), got {type(result).__name__}. The handler saves "
          "the tuple's first element; a state that is itself a tuple is returned as ((...), ...).")
    self._check(result[0])
    return result

  def save_checkpoint_if_preempted(self, state: Any) -> None:
    """Counts one call, like `run`, and saves `state` (then calls `exit_fn`) if this is the call the
    processes agreed on after a termination notice. For loops that call their step function themselves:
    call it after each step with the state that step returned, before the next step donates it."""
    self._check(state)

  @contextlib.contextmanager
  def watch_preemption_scope(self) -> Iterator[None]:
    """A scope for the training loop (TF's TPU usage). An exception leaving it after a termination notice
    reached this process (a peer that already stopped, say) ends the process through `exit_fn`, as a
    preemption, instead of as a crash; any other exception propagates."""
    try:
      yield
    except Exception:
      if self._noticed or self._local_notice:
        sys.stderr.write(f"tpustrat: process {self._index}: an error after a termination notice; exiting as "
                         "preempted.\n")
        self._stop_watcher()
        self._exit_fn()
      raise

  def close(self) -> None:
    """Stops watching: ends the watcher thread and puts the previous SIGTERM handler back."""
    if self._closed:
      return
    self._closed = True
    self._stop_watcher()
    self._end_listener()
    # A peer that gets a notice after this process has stopped calling `run` counts it as able to save
    # only after a call it will never make: it finishes its loop without waiting for this one.
    self._store.set_once(f"{_PREFIX}/closed/{self._index}", str(self._calls))
    if self._config.termination_watcher_fn is None and threading.current_thread() is threading.main_thread():
      previous = self._previous_sigterm
      signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

  def __enter__(self) -> PreemptionCheckpointHandler:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"PreemptionCheckpointHandler({self._manager.directory!r}, total_run_calls={self._calls}, "
            f"process {self._index} of {self._count})")

  # -- the protocol -----------------------------------------------------------------------------------

  def _key(self, what: str, round_: int | None = None) -> str:
    return f"{_PREFIX}/{self._round if round_ is None else round_}/{what}"

  def _wake_key(self, round_: int, process: int) -> str:
    return f"{_PREFIX}/{round_}/wake/{process}"

  def _announce(self) -> None:
    """Writes this round's notice; the process that wrote it first wakes every process's listener."""
    round_ = self._round
    if self._store.set_once(self._key("notice", round_), str(self._index)):
      for p in range(self._count):
        self._store.set_once(self._wake_key(round_, p), "notice")

  def _on_sigterm(self, signum: int, frame: Any) -> None:
    del signum, frame
    self._note_local_notice()  # a flag only: a signal handler must not take locks or do I/O

  def _note_local_notice(self) -> None:
    if not self._local_notice:
      self._local_notice = True
      if self._notice_time is None:
        self._notice_time = time.monotonic()

  def _check(self, state: Any) -> None:
    """The check of one call: count it, and save (and exit) if it is the agreed call."""
    with self._lock:
      self._calls += 1
      self._counting = True
      c = self._calls
      if not self._noticed and self._local_notice:
        self._publish_notice(earliest=c)  # this call is still a possible save point for this process
    if not self._noticed:
      return
    if self._target is None:
      self._target = self._agree()
    if c < self._target:
      return
    if c > self._target:  # cannot happen: the protocol holds every process at or before T
      raise AssertionError(f"preemption protocol: call {c} is past the agreed save point {self._target}")
    final = self._config.grace_period <= 0 or self._round > 0
    start = time.monotonic()
    self._save(c, state)
    if final:
      if self._config.exit_fn is None:
        self.close()  # the default exit ends the process: stop watching, put SIGTERM's handler back
      else:
        self._stop_watcher()
      sys.stderr.write(f"tpustrat: process {self._index}: saved checkpoint {c} after a termination notice; "
                       "exiting.\n")
      sys.stderr.flush()
      self._exit_fn()
      with self._lock:  # exit_fn returned: go on training and watching, the notice consumed
        self._next_round()
        self._cycle_round = self._round
        self._notice_time = None
      self._thread = self._start_watcher()
      return
    seconds = time.monotonic() - start
    with self._lock:
      if self._notice_time is not None:  # this process got the notice: it starts the final round
        self._countdown = self._notice_time + self._config.grace_period - (2 * seconds + 1.0)
      self._next_round()

  def _publish_notice(self, earliest: int) -> None:
    """Under the lock: this process has noticed this round; `earliest` is its first possible save point."""
    self._noticed = True
    self._announce()
    self._store.set_once(self._key(f"earliest/{self._index}"), str(earliest))

  def _next_round(self) -> None:
    self._round += 1
    self._noticed = False
    self._target = None
    self._local_notice = False

  def _agree(self) -> int:
    """Waits for every process's `earliest` of this round; the agreed call is their maximum. A process
    that has closed its handler counts with the call after its last one."""
    deadline = time.monotonic() + _AGREE_TIMEOUT_SECONDS
    values: dict[int, int] = {}
    delay = _POLL_SECONDS / 25
    while True:
      # Two directory reads per poll, whatever the process count (a read per process made the agreement
      # P^2 requests at the coordinator); a process's value, once found, is kept.
      for source, offset in ((self._key("earliest/"), 0), (f"{_PREFIX}/closed/", 1)):
        if len(values) == self._count:
          break
        for key, text in self._store.dir_get(source):
          p = int(key.rsplit("/", 1)[-1])
          if p not in values:
            values[p] = int(text) + offset
      missing = [p for p in range(self._count) if p not in values]
      if not missing or time.monotonic() > deadline:
        break
      time.sleep(delay)
      delay = min(2 * delay, _POLL_SECONDS)
    if missing:
      raise RuntimeError(
          f"PreemptionCheckpointHandler: process {self._index} waited {_AGREE_TIMEOUT_SECONDS:g} s for processes "
          f"{missing} to answer a termination notice; they are stuck, or do not run a "
          "PreemptionCheckpointHandler. No checkpoint was saved.")
    return max(values.values())

  def _save(self, step: int, state: Any) -> None:
    with bounded_operation(self._manager, f"save of step {step} after a termination notice") as op:
      if step not in self._manager.all_steps():  # else saved already (by the loop, or a grace period's first save)
        if self._config.save_fn is not None:
          op.progress(f"running save_fn for step {step} after a termination notice")
          self._config.save_fn(step, state, self._iterator)
        else:
          self._manager.save(step, state, iterator=self._iterator, force=True)
        self._manager.wait_until_finished()
      op.finished()

  def _stop_watcher(self) -> None:
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout=5.0)
    # The listener is not waited for here: it may be blocked in its long-poll until `_end_listener`.

  def _end_listener(self) -> None:
    """Wakes the listener (its wake key, unless a notice wrote it) and waits for it to end: a thread left
    inside the long-poll's native call at interpreter exit aborts the process ("FATAL: exception not
    rethrown"). The key written is removed again, for a later handler of this process."""
    _OPEN.discard(self)
    self._stop.set()
    listener = self._listener
    if listener is None or listener is threading.current_thread():
      return
    key = self._wake_key(self._round, self._index)
    wrote = self._store.set_once(key, "closed")
    listener.join(timeout=5.0)
    if wrote:
      self._store.delete(key)

  def _listen(self, stop: threading.Event) -> None:
    """The listener thread: waits for each round's notice (blocked in the store) and answers it with this
    process's first possible save point, once this process counts calls; then waits (locally) for the
    next round."""
    while not stop.is_set():
      round_ = self._round
      if self._store.wait(self._wake_key(round_, self._index), stop) is None or stop.is_set():
        continue
      while not stop.is_set():
        with self._lock:
          if self._round != round_:
            break
          if not self._noticed and self._counting:
            self._publish_notice(earliest=self._calls + 1)
        stop.wait(_POLL_SECONDS)

  def _watch(self, stop: threading.Event) -> None:
    """The watcher thread: calls the watcher function, starts the final round of a grace period, and
    publishes a notice this process got (a SIGTERM while its main thread waits in a collective, say). No
    request to the store while nothing happens: the listener thread answers the peers' notices."""
    watcher_fn = self._config.termination_watcher_fn
    next_call = 0.0
    while not stop.wait(_POLL_SECONDS):
      now = time.monotonic()
      if (watcher_fn is not None and not self._local_notice and self._round == self._cycle_round
          and now >= next_call):
        next_call = now + _WATCHER_FN_SECONDS
        if watcher_fn():
          self._note_local_notice()
      with self._lock:
        if self._countdown is not None and now >= self._countdown:
          self._countdown = None
          self._local_notice = True  # the final round of the grace period
        if self._local_notice and not self._noticed and self._notice_sent != self._round:
          self._announce()
          self._notice_sent = self._round  # once per round (the main thread's check publishes it too)
