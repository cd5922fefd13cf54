"""`CheckpointManager`: orbax's manager with tpustrat's items, checksums, fallback and bounded operations.

See the package docstring (`tpustrat._src.checkpoint`) for what is saved and guaranteed. The state pytree
(unwrapping on save, the restore plan) is `state`; the bounded operations' bookkeeping is `operations`;
the deadline thread is `deadlines`; the items' orbax handlers are `handlers`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import threading
import time
import warnings
from typing import Any

import jax

from tpustrat._src import context as context_lib
from tpustrat._src import names, step_stats
from tpustrat._src.checkpoint import checksums
from tpustrat._src.checkpoint.deadlines import KEY, Operation, Store, abort, check_timeout
from tpustrat._src.checkpoint.handlers import (
  CHECKSUMS,
  ITERATOR,
  STATE,
  STEP_METADATA,
  CheckpointSaveError,
  DamagedCheckpointError,
  DamagedCheckpointWarning,
  NotRestorableHere,
  SaveTracker,
  api,
  read_json,
)
from tpustrat._src.checkpoint.operations import POLL_SECONDS, Operations
from tpustrat._src.checkpoint.state import RestorePlan, check_alive, check_shapes, shardings, unwrap
from tpustrat._src.input.encoding import bytes_to_text, text_to_bytes

__all__ = ["CheckpointManager"]

_TMP_MARK = ".orbax-checkpoint-tmp"  # in the name of the directory orbax writes a step into before its commit
_REPLACED_MARK = ".replaced"  # in the name a replaced step's previous checkpoint has until the new one commits

_INSTANCES: collections.Counter[str] = collections.Counter()  # managers per directory in this process
_OPEN: collections.Counter[str] = collections.Counter()  # of them, those not closed yet
_INSTANCES_LOCK = threading.Lock()


# -- iterator states ------------------------------------------------------------------------------


def _iterator_state(iterator: Any) -> Any:
  get_state = getattr(iterator, "get_state", None)
  if not callable(get_state):
    raise TypeError(
        f"CheckpointManager.save: `iterator` must have get_state() (a tpustrat DistributedIterator or a "
        f"grain iterator), got {type(iterator).__name__}.")
  state = get_state()
  if isinstance(state, bytes):  # grain's DataLoader iterators (the encoding of DistributedIterator's `source`)
    return {"bytes_base64": bytes_to_text(state)}
  return state


def _set_iterator_state(iterator: Any, state: Any) -> None:
  set_state = getattr(iterator, "set_state", None)
  if not callable(set_state):
    raise TypeError(
        f"CheckpointManager.restore: `iterator` must have set_state() (a tpustrat DistributedIterator or a "
        f"grain iterator), got {type(iterator).__name__}.")
  if isinstance(state, dict) and set(state) == {"bytes_base64"}:
    state = text_to_bytes(state["bytes_base64"])
  set_state(state)


# -- the manager ----------------------------------------------------------------------------------


class CheckpointManager:
  """Saves and restores training state and the input position (TF's `tf.train.CheckpointManager`).

  A thin layer over `orbax.checkpoint.CheckpointManager`: each `save` writes the ``state`` pytree (arrays
  with `Mirrored` / `PerReplica` wrappers unwrapped to their global arrays), the checksums of its arrays
  and, optionally, a `DistributedIterator`'s position under one step number. `restore` reads them back
  onto the shardings of a strategy, which may have another layout than the one that saved (8 replicas
  saved, 4 replicas x 2 logical cores or 2 processes x 4 devices restored), checks every array against
  its checksum, and moves the iterator to the saved position. Every process of a multi-process job must
  make the same calls; the directory must be shared by them.

  >>> import tempfile
  >>> strategy = tpustrat.TPUStrategy()
  >>> dist = strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(4)])
  >>> it = iter(dist)
  >>> state = {"w": tpustrat.Mirrored(jnp.arange(3.0)), "step": jnp.int32(1)}
  >>> batch = next(it)
  >>> with tempfile.TemporaryDirectory() as d, CheckpointManager(d, strategy) as manager:
  ...   manager.save(1, state, iterator=it)
  ...   new_it = iter(dist)
  ...   restored = manager.restore(target=state, iterator=new_it)
  ...   manager.latest_step()
  True
  1
  >>> restored["w"], int(restored["step"])
  (Mirrored(float32[3]), 1)
  >>> print(strategy.experimental_local_results(next(new_it))[0])  # the batch after the saved one
  [1.]

  Args:
    directory: where the checkpoints go, one subdirectory per step (a local path, or any path orbax
      supports such as ``gs://...``). Created if missing.
    strategy: the strategy whose shardings `restore` places arrays on; default: the current strategy
      when `restore` is called (`tpustrat.get_strategy()`).
    max_to_keep: keep at most this many checkpoints (the oldest are deleted); None keeps them all.
    save_interval_steps: `save` writes only steps that are multiples of this (unless ``force=True``).
    enable_async_checkpointing: if True (orbax's default), `save` returns once the arrays are copied to
      the host and writes them in the background; `wait_until_finished` waits for the write.
    options: an `orbax.checkpoint.CheckpointManagerOptions` for everything else; when given, leave
      `max_to_keep`, `save_interval_steps` and `enable_async_checkpointing` unset.
    timeout: seconds that any one `save`, `restore`, `wait_until_finished` or `close` may take, barriers
      and waits for the other processes included, before the job is stopped with status 124 and a
      message naming the processes that have not finished their part (see the module docstring). None:
      the step timeout when one is set (``--step-timeout``, ``TPUSTRAT_STEP_TIMEOUT``,
      ``TPUClusterResolver(step_timeout=...)``), read at each operation, else 1200 s. Give it when a save
      of the state legitimately takes longer than the step timeout.

  Steps only grow. A `save` of the newest step replaces it, as TF's ``CheckpointManager.save(
  checkpoint_number=...)`` overwrites (a resumed job saving the step it resumed from; a finished job
  started again, whose final save repeats the last one): the previous checkpoint is set aside to
  ``<step>.replaced`` and removed only once the new one is committed; a save that fails puts it back, and
  so does the next start after a process stopped in the middle of it. A save of a step older than the
  newest raises a `ValueError` naming both: `restore` would never take it, and a job whose step count
  restarted at 0 after a restore would otherwise train on without a checkpoint. orbax's own manager skips
  both without a word.

  A save the storage refuses (disk full, read-only file system) ends at once: `CheckpointSaveError` with one
  process, status 74 for every process of a multi-process job; a save that another process left in the
  middle (it died: a barrier or collective of the save failed) ends every process with status 69 instead
  (see the module docstring). The first
  manager of a directory opened by process 0 removes the temporary directories of saves that never
  committed (``<step>.orbax-checkpoint-tmp``), with a `DamagedCheckpointWarning` naming each.

  Raises:
    ValueError: `timeout` is not a number of seconds in [1, 2**31 - 1] (the step timeout's range), or
      `options` is given with the arguments it replaces.
  """

  def __init__(self, directory: str | os.PathLike[str], strategy: Any = None, *, max_to_keep: int | None = None,
               save_interval_steps: int = 1, enable_async_checkpointing: bool = True, options: Any = None,
               timeout: float | None = None) -> None:
    orbax = api()
    ocp = orbax.ocp
    checked_timeout = check_timeout(timeout)
    if options is None:
      options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, save_interval_steps=save_interval_steps,
                                             enable_async_checkpointing=enable_async_checkpointing)
    elif (max_to_keep, save_interval_steps, enable_async_checkpointing) != (None, 1, True):
      raise ValueError(
          "CheckpointManager: give either `options` or max_to_keep / save_interval_steps / "
          "enable_async_checkpointing, not both (set them in the CheckpointManagerOptions).")
    # The temporary directories of a save are created in the calling thread: created in orbax's background
    # thread, a failure there (a read-only or full disk) is only logged, and every process then waits for
    # the signal that the directories exist until the deadline.
    async_options = options.async_options or ocp.AsyncOptions()
    options = dataclasses.replace(
        options, async_options=dataclasses.replace(async_options, create_directories_asynchronously=False))
    path = os.fspath(directory)
    if "://" not in path:
      path = os.path.abspath(path)
    self._directory = path
    self._strategy = strategy
    self._name_format = options.step_name_format or ocp.step.standard_name_format(
        step_prefix=options.step_prefix, step_format_fixed_length=options.step_format_fixed_length)
    self._state_handler = orbax.StateHandler()
    self._iterator_handler = orbax.IteratorHandler()
    self._checksum_handler = orbax.ChecksumHandler()
    self._store = Store()
    with _INSTANCES_LOCK:
      _INSTANCES[path] += 1
      instance = _INSTANCES[path]
      _OPEN[path] += 1
      alone = _OPEN[path] == 1
    self._closed = False
    self._read_only = bool(options.read_only)
    if alone and self._store.index == 0 and not self._read_only:
      self._remove_unfinished_saves()
    self._manager = ocp.CheckpointManager(
        path, options=options,
        item_handlers={STATE: self._state_handler, ITERATOR: self._iterator_handler,
                       CHECKSUMS: self._checksum_handler})
    # The same name in every process (the processes create their managers in the same order).
    self._ops = Operations(self, self._store, f"{KEY}/{hashlib.sha1(path.encode()).hexdigest()[:12]}-{instance}",
                           path, checked_timeout)
    self._pending: tuple[int, int] | None = None  # (seq, step) of a save whose writing may still run
    # (step, where its previous checkpoint waits) while a save replaces the newest step, until it commits
    self._replacing: tuple[int, Any] | None = None
    self._last_restored_step: int | None = None

  @property
  def directory(self) -> str:
    """The checkpoint directory."""
    return self._directory

  @property
  def orbax_manager(self) -> Any:
    """The underlying `orbax.checkpoint.CheckpointManager`."""
    return self._manager

  @property
  def timeout(self) -> float:
    """Seconds a blocking operation may take now (the `timeout` argument, else the step timeout, else
    1200 s)."""
    return self._ops.timeout_and_source()[0]

  @property
  def last_restored_step(self) -> int | None:
    """The step the last successful `restore` restored (None before any): with ``step=None``, the newest
    intact step, which is older than the newest step when that one was damaged."""
    return self._last_restored_step

  def step_path(self, step: int) -> str:
    """The directory of checkpoint `step` (whether or not it exists)."""
    return os.fspath(self._step_epath(step))

  def _step_epath(self, step: int) -> Any:
    """`step_path` as orbax's path object (local or remote storage)."""
    return api().ocp.step.build_step_path(self._directory, self._name_format, int(step))

  def _remove_unfinished_saves(self) -> None:
    """Removes the temporary directories of saves that never committed (``<step>.orbax-checkpoint-tmp``, left
    by a process killed or failed while saving), with a warning naming each: they hold partial data, and
    space. Then settles the replacements such a save left (`_settle_replacement`). Process 0 only, and
    only when no other manager of the directory is open in this process (it may be writing); a directory
    is written by one job at a time (another job's save in flight would be removed)."""
    directory = self._step_epath(0).parent
    try:
      entries = sorted(directory.iterdir(), key=lambda p: p.name)
    except FileNotFoundError:
      return
    for leftover in (p for p in entries if _TMP_MARK in p.name):
      name = leftover.name.split(_TMP_MARK)[0]
      try:
        leftover.rmtree()
      except Exception as e:  # noqa: BLE001  # read-only storage: it stays, and the warning says so
        warnings.warn(f"CheckpointManager: could not remove the unfinished save of step {name} at {leftover} "
                      f"({type(e).__name__}: {e}).", DamagedCheckpointWarning, stacklevel=3)
        continue
      warnings.warn(f"CheckpointManager: removed the unfinished save of step {name} at {leftover} (a process "
                    "stopped while saving it, or its write failed); the committed steps are untouched.",
                    DamagedCheckpointWarning, stacklevel=3)
    asides = [p for p in entries if _REPLACED_MARK in p.name]
    if asides:
      committed = {metadata.path.name for metadata in self._name_format.find_all(self._directory)}
      for aside in asides:
        self._settle_replacement(aside, committed)

  def _settle_replacement(self, aside: Any, committed: set[str]) -> None:
    """`aside` (``<step>.replaced``) is the previous checkpoint of a step whose replacement (`save` of the
    newest step) was not seen through by its job: removed when the replacement was committed (the job
    stopped before removing it), else put back in place, with a warning, since the replacement never
    committed. `committed`: the names of the committed steps."""
    name = aside.name.split(_REPLACED_MARK)[0]
    target = aside.parent / name
    try:
      if name in committed:
        aside.rmtree()
        return
      if target.exists():  # not a committed step: the storage holds something orbax does not list there
        raise FileExistsError(f"{target} exists, but is not a committed checkpoint")
      aside.rename(target)
    except Exception as e:  # noqa: BLE001  # read-only storage, or something in the way: it stays, and is named
      warnings.warn(f"CheckpointManager: the previous checkpoint of step {name}, set aside at {aside} while a save "
                    f"was replacing it, could not be {'removed' if name in committed else 'put back'} "
                    f"({type(e).__name__}: {e}).", DamagedCheckpointWarning, stacklevel=4)
      return
    warnings.warn(f"CheckpointManager: the save that was replacing step {name} never committed (a process stopped "
                  f"while writing it); the previous checkpoint {name} was put back in place from {aside}.",
                  DamagedCheckpointWarning, stacklevel=4)

  def _committed_steps(self) -> list[int]:
    """The steps committed in the directory, read from the storage (orbax's own list also holds a save
    still being written)."""
    return sorted(metadata.step for metadata in self._name_format.find_all(self._directory))

  def _save_failed(self, op: Operation, step: int, error: BaseException) -> None:
    """Ends a save that failed: raises `CheckpointSaveError` in a one-process job; in a multi-process job
    ends the job (`deadlines.abort`), since the other processes wait for this one inside orbax, where no
    exception reaches them: with status 69 (`names.EXIT_CHECKPOINT_PEER_LOST`) when another process
    stopped in the middle of the save (a barrier or collective across the processes failed:
    `_peer_failure`), else with 74 (`names.EXIT_CHECKPOINT_FAILED`: the storage refused a write)."""
    runtime = _peer_failure(error) if self._store.count > 1 else None
    replaced = self._undo_replacement(step)
    if runtime is not None:
      text, status = self._peer_lost(step, error, runtime) + replaced, names.EXIT_CHECKPOINT_PEER_LOST
    else:
      text, status = self._refused(step, error) + replaced, names.EXIT_CHECKPOINT_FAILED
    if self._store.count > 1:
      abort(self._store, f"tpustrat: checkpoint save failed: {text}\nEvery process of the job stops with status "
                         f"{status}.", op.what, status)
    raise CheckpointSaveError(f"CheckpointManager.save: {text}") from error

  def _refused(self, step: int, error: BaseException) -> str:
    """What `_save_failed` says of a save of `step` whose write `error` failed (the storage refused it)."""
    try:
      steps = [s for s in self.all_steps() if s != step]
    except Exception:  # noqa: BLE001  # the listing fails too: say nothing about it
      steps = None
    return (f"process {self._store.index} could not write checkpoint {step} at {self.step_path(step)} "
            f"({type(error).__name__}: {error}). The previous checkpoints are intact"
            f"{f' (steps {steps})' if steps is not None else ''}; what was written of step {step} stays in its "
            f"temporary directory ({self.step_path(step)}{_TMP_MARK}), which the next start removes.")

  def _peer_lost(self, step: int, error: BaseException, runtime: BaseException) -> str:
    """What `_save_failed` says of a save of `step` that failed in a barrier or collective across the
    processes (`runtime`, JAX's error, raised as or under `error`): another process stopped in the middle
    of it. Says what the storage holds: whether `step` was committed, and the last committed step."""
    cause = f"{type(error).__name__}: {error}"
    if runtime is not error:
      cause += f"; from {type(runtime).__name__}: {runtime}"
    try:
      committed = self._committed_steps()
    except Exception as e:  # noqa: BLE001  # the listing fails: say so, and nothing else about the steps
      held = f"The committed steps could not be listed ({type(e).__name__}: {e})."
    else:
      before = [s for s in committed if s != step]
      last = (f"the last committed step is {before[-1]} (committed steps: {before}), intact" if before else
              "no earlier step is committed")
      partial = self._step_epath(step).parent / f"{self._step_epath(step).name}{_TMP_MARK}"
      if step in committed:
        held = f"Step {step} was committed before the failure; {last}."
      elif partial.exists():
        held = (f"Step {step} was not committed (what was written of it stays in {partial}, which the next start "
                f"removes); {last}.")
      else:
        held = f"Step {step} was not committed; {last}."
    index = self._store.index
    return (f"another process of the job stopped in the middle of the save of step {step} to {self._directory}: "
            f"a barrier or collective of the save across the processes failed in JAX's distributed runtime on "
            f"process {index} ({cause}). The peer died, hung or lost its connection (its own output, or "
            f"tpustrat.launch's report, names it). No write of process {index} failed: the storage is not the "
            f"cause. {held}")

  def _background_failure(self, op: Operation, step: int, error: BaseException) -> None:
    """A write of `step` failed in orbax's background thread. With several processes the job ends now
    (`_save_failed`): the others would wait for this one at orbax's barriers; with one, orbax raises the
    error at the next wait, where `_wait_pending` turns it into a `CheckpointSaveError`."""
    if self._store.count > 1:
      self._save_failed(op, step, error)

  def save(self, step: int, state: Any, *, iterator: Any = None, force: bool = False) -> bool:
    """Saves `state` (and `iterator`'s position) as checkpoint `step`, with the checksums of its arrays.

    Args:
      step: the step number (an int >= 0), the checkpoint's name.
      state: a pytree of arrays and Python numbers: parameters, optimizer state, step counter, ...
        `Mirrored` and `PerReplica` values are saved as their global arrays.
      iterator: a `DistributedIterator` (or any iterator with `get_state`, such as grain's) whose
        position is saved: after the batches it has handed out, whatever it has read ahead. Its state is
        taken now, so training may go on while an asynchronous save writes.
      force: save even if `step` is not a multiple of `save_interval_steps`.

    A `step` equal to the newest checkpoint's replaces it (TF's ``CheckpointManager.save(checkpoint_number=
    ...)`` overwrites), whatever `save_interval_steps` says: the new checkpoint is written while the
    previous one waits at ``<step>.replaced``, which is removed once the new one is committed (at the
    next `save`, `wait_until_finished`, `restore` or `close`). Until then a failed save puts the previous
    one back, and so does the next start after a process stopped in the middle of it.

    Returns:
      Whether a checkpoint was saved (False when orbax's policy skips `step`).

    Raises:
      ValueError: `step` is older than the newest checkpoint (nothing is written; the message names both):
        `restore` takes the newest step, so it would never restore this one. A job resumed from a
        checkpoint continues its step count from the restored step.
      CheckpointSaveError: the storage refused a write (one process; see the class docstring), or the
        newest checkpoint could not be set aside to be replaced (every process; nothing was written).
    """
    orbax = api()
    step = int(step)
    latest = None if self._read_only else self._manager.latest_step()
    if latest is not None and step < latest:
      raise ValueError(self._older_than_newest(step, latest))
    replace = latest is not None and step == latest
    if not replace and not force and not self._manager.should_save(step):
      return False
    self._wait_pending()  # orbax waits for the previous save too; here within the deadline
    with self._ops.operation(f"save of step {step}") as op:
      unwrapped = unwrap(state)
      check_alive(unwrapped)
      items = {STATE: orbax.StateSave(unwrapped)}
      if iterator is not None:
        self._ops.progress(op, f"taking the iterator's position for step {step}")
        items[ITERATOR] = orbax.IteratorSave(_iterator_state(iterator))
      self._ops.progress(op, f"computing the checksums of step {step}")
      items[CHECKSUMS] = orbax.ChecksumSave({"algorithm": checksums.ALGORITHM,
                                              "arrays": checksums.compute(checksums.flat_arrays(unwrapped))})
      if replace:  # only now: a state or iterator that cannot be saved leaves the checkpoint in place
        self._replacing = (step, self._set_aside_to_replace(op, step))
      tracker = SaveTracker(set(items), lambda: self._ops.mark_done(op.done_key, "written"),
                            lambda item, error: self._background_failure(op, step, error))
      self._ops.progress(op, f"in orbax's save of step {step} (writing its part, or waiting at orbax's barriers)")
      for handler in (self._state_handler, self._iterator_handler, self._checksum_handler):
        handler.tracker = tracker
      try:
        saved = self._manager.save(step, args=orbax.ocp.args.Composite(**items), force=force or replace)
      except orbax.ocp.checkpoint_manager.StepAlreadyExistsError:
        raise
      except Exception as e:  # noqa: BLE001  # the storage refused a write: the save ends now
        self._save_failed(op, step, e)
        raise  # not reached: _save_failed raises or ends the process
      finally:
        for handler in (self._state_handler, self._iterator_handler, self._checksum_handler):
          handler.tracker = None
      if not saved:
        self._ops.mark_done(op.done_key, "skipped")
        self._ops.progress(op, f"skipped step {step} (orbax's interval policy)")
      else:
        self._pending = (op.seq, step)
        self._ops.progress(op, f"writing its part of step {step} in the background")
      return saved

  def restore(self, step: int | None = None, *, target: Any = None, iterator: Any = None) -> Any:
    """Restores checkpoint `step` (default: the newest intact one), placing arrays on the strategy's
    shardings, and checks every array against the checksum saved with it.

    Args:
      step: which checkpoint; None for the newest intact one. A damaged newest step (see the module
        docstring) is skipped and the next older step tried; once one restores, the damaged ones are moved
        aside to ``<step>.damaged``, each with a `DamagedCheckpointWarning` naming it, its directory, the
        step restored instead and where it was moved. When every step is damaged nothing is moved.
        `last_restored_step` says which step was restored. Every process of the job restores the same
        step.
      target: the structure to restore into, usually the freshly initialised state (or the result of
        `run`). Its `Mirrored` values come back `Mirrored`, replicated over the strategy's mesh;
        `PerReplica` values come back `PerReplica`, one component per replica (the replica count must
        be the saved one); plain arrays come back as arrays replicated over the mesh, or with their own
        sharding when it is on the strategy's mesh; `jax.ShapeDtypeStruct`s with a sharding get that
        sharding. `ShardedVariable`s (embedding tables included) come back split over this
        strategy's replicas, whatever the saved replica count. The layout may change between sharded and
        whole: a `ShardedVariable` saved where the target has a `Mirrored` value (or a plain array) comes
        back whole (padding stripped), and a value saved `Mirrored` where the target has a
        `ShardedVariable` comes back split. Every array is read onto the target's sharding, so a device
        gets only its block of a sharded value; a value that changes layout (another replica count, or
        sharded <-> whole) is read into host memory on every process and placed from there (see
        `state.RestorePlan`). Shapes must be the saved ones (logical shapes for sharded values); dtypes are the
        target's (an array restored with another dtype than it was saved with is not compared with its
        checksum). With no target, the saved tree comes back as nested dicts and lists of replicated
        arrays (a sharded value as ``{"blocks": [N, ...block], "shape": its logical shape}``).
      iterator: a `DistributedIterator` (or grain iterator) to move to the saved position.

    Returns:
      The restored state, with the structure of `target`. Its arrays are the program's own, on the
      shardings `strategy.run` expects: a step may donate them (``RunOptions(donate_argnums=0)``).

    Raises:
      FileNotFoundError: if there is no checkpoint (or no checkpoint `step`).
      DamagedCheckpointError: checkpoint `step` is damaged, or, with ``step=None``, every checkpoint is
        (the message names each step, its directory and what is wrong).
      ValueError: if a shape in `target` differs from the checkpoint's, or the checkpoint has no
        iterator state but `iterator` is given.
    """
    self._wait_pending()  # a save of this manager still being written
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"CheckpointManager.restore: no checkpoint in {self._directory}.")
      candidates = steps[::-1]
    else:
      step = int(step)
      if step not in steps:
        raise FileNotFoundError(
            f"CheckpointManager.restore: no checkpoint for step {step} in {self._directory} (steps: {steps}).")
      candidates = [step]
    strategy = self._strategy if self._strategy is not None else context_lib.get_strategy()
    problems: list[tuple[int, str]] = []
    with self._ops.operation(f"restore of step {candidates[0]}") as op:
      for attempt, candidate in enumerate(candidates):
        op.what, op.done_key = f"restore of step {candidate}", f"{op.seq}.{attempt}"
        restored, problem = self._restore_step(op, candidate, target, iterator, strategy)
        if problem is None:
          if problems:
            moved = self._set_aside(op, [s for s, _ in problems])
            for s, text in problems:  # said once the outcome is known: what was restored, what was moved
              where = f"checkpoint {s} at {self.step_path(s)}"
              dest, failure = moved[s]
              fate = (f"the damaged step was moved aside to {dest}." if dest is not None else
                      f"it could not be moved aside ({failure}); saving step {s} again will fail until it is "
                      "removed.")
              warnings.warn(f"CheckpointManager.restore: {where} is damaged: {text}. Restored checkpoint "
                            f"{candidate} instead; {fate}", DamagedCheckpointWarning, stacklevel=2)
          if iterator is not None:
            _set_iterator_state(iterator, restored[ITERATOR])
          self._last_restored_step = candidate
          step_stats.RESTORES[0] += 1  # `tpustrat.keras`: Keras objects a restored state moved past
          self._ops.progress(op, f"restored step {candidate}")
          return restored[STATE]
        problems.append((candidate, problem))
        where = f"checkpoint {candidate} at {self.step_path(candidate)}"
        if step is not None:
          raise DamagedCheckpointError(f"CheckpointManager.restore: {where} is damaged: {problem}")
    listed = "; ".join(f"checkpoint {s} at {self.step_path(s)}: {p}" for s, p in problems)
    raise DamagedCheckpointError(
        f"CheckpointManager.restore: every checkpoint in {self._directory} is damaged ({listed}); none was "
        "moved aside.")

  def latest_step(self) -> int | None:
    """The newest checkpoint's step, or None. Includes a save of this manager still being written (see
    `wait_until_finished`); checkpoints found on disk count only once complete. A damaged step counts
    until `restore` finds it damaged."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of the checkpoints, oldest first (as for `latest_step`)."""
    return sorted(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    """Whether `step` is due under orbax's interval policy: False also for a step at or below the newest
    checkpoint, which `save` replaces (the newest) or refuses (an older one) instead."""
    return self._manager.should_save(step)

  def wait_until_finished(self) -> None:
    """Blocks until an asynchronous save has been written and committed (within `timeout`)."""
    self._wait_pending()

  def close(self) -> None:
    """Waits for pending saves (within `timeout`), then releases orbax's resources."""
    try:
      self._wait_pending()
    finally:
      self._manager.close()
      with _INSTANCES_LOCK:
        if not self._closed:
          self._closed = True
          _OPEN[self._directory] -= 1

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"CheckpointManager({self._directory!r}, steps={self.all_steps()})"

  # -- restoring one step ---------------------------------------------------------------------------

  def _restore_step(self, op: Operation, step: int, target: Any, iterator: Any,
                    strategy: Any) -> tuple[Any, str | None]:
    """(the restored items, None), or (None, what is wrong with `step` on some process). Every process
    returns the same verdict: they exchange their reading's outcome before the checksums (a program over
    the global arrays) are computed."""
    self._ops.progress(op, f"reading step {step}")
    problem: str | None = None
    restored: Any = None
    metadata: Any = None
    plan: RestorePlan | None = None
    try:
      metadata = self._manager.item_metadata(step)
      saved = metadata[STATE] if STATE in metadata else None
      if saved is None:
        problem = f"it has no {STATE!r} item ({_describe_contents(self._step_epath(step))})"
    except Exception as e:  # noqa: BLE001  # unreadable metadata: damaged
      problem = f"its metadata cannot be read ({type(e).__name__}: {e})"
    if problem is None:
      # The items the save wrote (orbax's step metadata): one of them missing is damage, not a step saved
      # without it (a step without its checksums would restore unverified).
      try:
        written = set(read_json(self._step_epath(step) / STEP_METADATA)["item_handlers"])
      except Exception as e:  # noqa: BLE001  # missing or unreadable: damaged
        problem = f"its metadata cannot be read ({type(e).__name__}: {e})"
      else:
        for item in (ITERATOR, CHECKSUMS):
          if item in written and item not in metadata and (item != ITERATOR or iterator is not None):
            problem = f"its {item!r} item is missing (it was saved with one)"
            break
    if problem is None:
      saved = getattr(saved, "tree", saved)
      if target is None:
        _, replicated, _ = shardings(strategy)
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated), saved,
                                is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"))
      else:
        plan = RestorePlan(target, saved, strategy)
        abstract = plan.abstract
        check_shapes(abstract, saved, self._directory, step)
      if iterator is not None and ITERATOR not in metadata:
        raise ValueError(
            f"CheckpointManager.restore: checkpoint {step} in {self._directory} has no iterator state (it "
            "was saved without `iterator=`).")
      # The items are read through their handlers, not through orbax's manager: its restore ends with a
      # barrier that is a device collective, where the other processes would wait forever for one whose
      # reading failed. Here no process waits in a collective before all have said how their reading went.
      directory = self._step_epath(step)
      try:
        restored = {STATE: self._state_handler.restore(directory / STATE, args=api().StateRestore(abstract))}
        if iterator is not None:
          restored[ITERATOR] = self._iterator_handler.restore(directory / ITERATOR)
        if CHECKSUMS in metadata:
          restored[CHECKSUMS] = self._checksum_handler.restore(directory / CHECKSUMS)
      except NotRestorableHere:
        raise
      except Exception as e:  # noqa: BLE001  # a file that is missing or does not decode: damaged
        problem = f"{type(e).__name__}: {e}"
    failures = self._ops.agree(op, problem)
    if failures:
      if self._store.count == 1:
        return None, failures[0]
      return None, "; ".join(f"process {p}: {text}" for p, text in sorted(failures.items()))
    if restored is not None and CHECKSUMS in restored:
      self._ops.progress(op, f"verifying the checksums of step {step}")
      saved_sums = restored[CHECKSUMS]
      if not isinstance(saved_sums, dict) or saved_sums.get("algorithm") != checksums.ALGORITHM:
        return None, f"its checksums file has an unknown format ({str(saved_sums)[:100]})"
      bad = checksums.mismatches(saved_sums["arrays"], restored[STATE])
      if bad:
        return None, ("the content of " + ", ".join(bad) + " differs from what was saved (a data file was "
                      "changed after the save)")
    if plan is not None:  # verified as read: now the target's values, re-laid out where they must be
      restored[STATE] = plan.finish(restored[STATE])
    return restored, None

  def _aside_path(self, step: int, mark: str) -> Any:
    """Where `step` is moved aside: ``<step><mark>``, or ``<step><mark>-<k>`` when that is taken (a damaged
    step: ``.damaged``; the previous checkpoint of a step being replaced: ``.replaced``)."""
    source = self._step_epath(step)
    path, k = source.parent / f"{source.name}{mark}", 1
    while path.exists():
      k += 1
      path = source.parent / f"{source.name}{mark}-{k}"
    return path

  def _set_aside(self, op: Operation, steps: list[int]) -> dict[int, tuple[str | None, str | None]]:
    """Process 0 renames the damaged `steps` to ``<step>.damaged`` and publishes what it did; every process
    then forgets them. Returns, per step, (where it was moved, None) or (None, why it could not be)."""
    store = self._store
    key = f"{self._ops.prefix}/aside/{op.seq}"
    text: str | None
    if store.index == 0:
      outcome: dict[str, list[str | None]] = {}
      for s in steps:
        source, dest = self._step_epath(s), self._aside_path(s, ".damaged")
        try:
          source.rename(dest)
          outcome[str(s)] = [os.fspath(dest), None]
        except Exception as e:  # noqa: BLE001  # read-only storage: the step stays, and the warning says so
          outcome[str(s)] = [None, f"{type(e).__name__}: {e}"]
      text = json.dumps(outcome)
      store.set(key, text)
    else:
      self._ops.progress(op, "waiting for process 0 to move the damaged steps aside")
      while (text := store.get(key)) is None:
        time.sleep(POLL_SECONDS)
    self._manager.reload()
    return {int(s): (dest, failure) for s, (dest, failure) in json.loads(text).items()}

  # -- replacing the newest step ---------------------------------------------------------------------

  def _older_than_newest(self, step: int, latest: int) -> str:
    """The message of a `save` of `step`, older than the newest checkpoint `latest`."""
    steps = self.all_steps()
    held = f"checkpoint {step} exists" if step in steps else f"there is no checkpoint {step}"
    return (f"CheckpointManager.save: step {step} is older than the newest checkpoint, step {latest}, in "
            f"{self._directory} (steps {steps}; {held}). Nothing was written: restore() takes the newest step, "
            f"so a checkpoint {step} saved now would never be restored. A job resumed from a checkpoint "
            "continues its step count from the restored step (manager.last_restored_step, or the step counter "
            "of the restored state), not from 0. To train again from an older step, delete the newer "
            "checkpoints first (manager.orbax_manager.delete(step), on every process), or save into another "
            f"directory; saving step {latest} again replaces it.")

  def _set_aside_to_replace(self, op: Operation, step: int) -> Any:
    """Before a save of the newest `step`: process 0 renames its checkpoint to ``<step>.replaced`` and
    publishes the outcome; every process then forgets the step (orbax refuses to save a step it lists).
    Returns where the previous checkpoint waits. Every process raises `CheckpointSaveError` when the
    rename failed, before any of them has entered orbax's save."""
    store = self._store
    key = f"{self._ops.prefix}/replace/{op.seq}"
    self._ops.progress(op, f"setting the previous checkpoint {step} aside")
    text: str | None
    if store.index == 0:
      source, dest = self._step_epath(step), self._aside_path(step, _REPLACED_MARK)
      try:
        source.rename(dest)
        text = json.dumps([dest.name, None])
      except Exception as e:  # noqa: BLE001  # read-only storage: every process is told
        text = json.dumps([None, f"{type(e).__name__}: {e}"])
      store.set(key, text)
    else:
      while (text := store.get(key)) is None:
        time.sleep(POLL_SECONDS)
    name, failure = json.loads(text)
    if failure is not None:
      raise CheckpointSaveError(
          f"CheckpointManager.save: step {step} is the newest checkpoint, and a save of it replaces it, but "
          f"{self.step_path(step)} could not be set aside ({failure}). Nothing was written; checkpoint {step} "
          "is unchanged.")
    self._manager.reload()
    while step in self._manager.all_steps():  # this process's listing of shared storage lags behind the rename
      time.sleep(POLL_SECONDS)
      self._manager.reload()
    return self._step_epath(step).parent / name

  def _finish_replacement(self) -> None:
    """Once the save replacing a step is committed: process 0 removes the step's previous checkpoint."""
    replacing, self._replacing = self._replacing, None
    if replacing is None or self._store.index != 0:
      return
    step, aside = replacing
    try:
      aside.rmtree()
    except Exception as e:  # noqa: BLE001  # it stays, and the next start removes it
      warnings.warn(f"CheckpointManager: checkpoint {step} was replaced, but its previous checkpoint at {aside} "
                    f"could not be removed ({type(e).__name__}: {e}); the next start removes it.",
                    DamagedCheckpointWarning, stacklevel=4)

  def _undo_replacement(self, step: int) -> str:
    """After the failed save of `step`: what became of the previous checkpoint it was replacing (if it
    was), for `_save_failed`'s message. With one process it is put back in place now, unless the new step
    was committed after all; with several, the job ends, and the next start settles it
    (`_settle_replacement`)."""
    replacing = self._replacing
    if replacing is None or replacing[0] != step:
      return ""
    self._replacing = None
    aside = replacing[1]
    if self._store.count > 1 or self._step_epath(step).exists():
      return (f" The previous checkpoint {step}, which this save was replacing, is kept at {aside}: the next "
              f"start puts it back in place, or removes it if the new step {step} was committed.")
    try:
      aside.rename(self._step_epath(step))
    except Exception as e:  # noqa: BLE001  # it stays aside, and the message says where
      return (f" The previous checkpoint {step}, which this save was replacing, could not be put back "
              f"({type(e).__name__}: {e}); it is kept at {aside}.")
    self._manager.reload()
    return f" The previous checkpoint {step}, which this save was replacing, is back in place, intact."

  # -- bounded operations ---------------------------------------------------------------------------

  def _wait_pending(self) -> None:
    """Waits for this manager's save still being written, if any, as a bounded operation."""
    pending, self._pending = self._pending, None
    if pending is None:
      self._manager.wait_until_finished()
      return
    seq, step = pending
    with self._ops.operation(f"wait for the save of step {step}", done_key=f"{seq}.0") as op:
      self._ops.progress(op, f"waiting for its save of step {step} to be written and committed")
      try:
        self._manager.wait_until_finished()
      except Exception as e:  # noqa: BLE001  # its writing failed in orbax's background thread
        self._save_failed(op, step, e)
    self._finish_replacement()


def _peer_failure(error: BaseException) -> BaseException | None:
  """The error of JAX's distributed runtime behind a failed save of a multi-process job, or None when the
  save failed otherwise.

  The save's barriers and collectives across the processes (orbax's ``sync_global_processes``, a device
  all-gather; its commit thread's barrier in the coordination service) fail when another process dies,
  hangs or loses its connection in the middle of the save, and JAX raises `jax.errors.JaxRuntimeError`,
  directly or under orbax's own error (a `TimeoutError` raised from the failed barrier). The storage's
  errors are never JAX's runtime's: an `OSError` with an errno (Python's file operations), a `ValueError`
  (tensorstore's writes). The chain (``__cause__``, ``__context__``) is followed; an `OSError` with an errno
  anywhere in it makes the failure the storage's."""
  runtime: BaseException | None = None
  seen: set[int] = set()
  link: BaseException | None = error
  while link is not None and id(link) not in seen:
    seen.add(id(link))
    if isinstance(link, OSError) and link.errno is not None:
      return None
    if runtime is None and isinstance(link, jax.errors.JaxRuntimeError):
      runtime = link
    link = link.__cause__ or link.__context__
  return runtime


def _describe_contents(path: Any) -> str:
  try:
    entries = sorted(p.name for p in path.iterdir())
  except Exception as e:  # noqa: BLE001
    return f"the directory cannot be listed: {e}"
  if not entries:
    return "the directory is empty"
  return f"the directory holds {', '.join(entries[:8])}{' ...' if len(entries) > 8 else ''}"
