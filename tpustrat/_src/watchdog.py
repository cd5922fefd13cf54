"""The step watchdog: a process whose step waits too long for its peers ends the job, naming who is behind.

JAX's distributed runtime notices a process that dies, or that hangs so hard it stops sending heartbeats.
A process that is alive but stuck (a bug, a data loader that blocks, a ``time.sleep``, a host callback
that never returns) keeps sending heartbeats, and every other process then waits forever inside the next
collective: the step it dispatched never finishes. The watchdog catches that case.

Turned on with a timeout ``S`` (seconds): ``python -m tpustrat.launch --step-timeout S``, the variable
``TPUSTRAT_STEP_TIMEOUT``, or ``TPUClusterResolver(step_timeout=S)``; `start` is called when the process
connects (`tpustrat.experimental_connect_to_cluster`, or `TPUStrategy()`). Off, nothing changes: `note`
is one global read per dispatch.

On, each program that `strategy.run`, `experimental_run_steps`, the cross-device ops and the
cross-replica `reduce` / `gather` dispatch is noted: the process's step counter (steps of `run` and
`experimental_run_steps`; reductions count no steps), the time, and the program's wait token (a small
output, ready when the program has finished on this process's devices). JAX tells the watchdog when this
process traces, lowers or compiles a program (`jax_compat.watch_compiles`; any `jax.jit`, not only
tpustrat's). A daemon thread wakes every ``min(1, S / 10)`` seconds (a *tick*) and

* publishes the step counter under ``tpustrat/watchdog/steps/<process>`` in the coordination service's
  key-value store (multi-process jobs; nothing to publish with one process);
* publishes what this process is busy with under ``tpustrat/watchdog/busy/<process>`` while it is
  compiling, or while its newest program has waited more than ``S / 2``, and deletes it after: the steps
  it dispatched, the newest step it saw finish on its own devices, how long it has compiled, and the host
  callbacks of its programs (`jax.debug.callback`, `jax.pure_callback`, `io_callback`) that have been
  running for more than a tick, with the function's name and line (`jax_compat.host_callback_frames`);
* counts, for the newest noted program that has not finished (or, when every noted program has finished,
  for a dispatch that has not returned: XLA:CPU runs a program of one device in the calling thread, so with
  one device per process a step whose peer never joins its collectives never returns from its dispatch),
  the time it has waited, *except* the ticks
  in which some process of the job was compiling (this one, or a peer that published it: while its newest
  program has waited more than a tick, the thread reads ``busy/`` at each tick). A peer's compile is not
  a hang: a cold compilation cache beside a warm one, or a slow trace on one process, makes the others
  wait inside the first collective of the new program for as long as the compile takes. Compile time is
  not counted up to the *compile bound* (``TPUSTRAT_COMPILE_TIMEOUT`` seconds; default the larger of
  1800 s and ``10 * S``) per program; beyond it, it counts again;
* fires when the counted time exceeds ``S``: it reads every process's counter and ``busy/`` entry, prints
  which processes are behind and the last step each reached (counted from 1: the number of steps it
  dispatched), then what each process reported (a host callback that has not returned names the stuck
  process even when every counter is equal; else the newest step each finished says whose devices are
  behind), ends it with the line ``tpustrat: step watchdog of process P: holding the job up: process Q.``
  (`names.WATCHDOG_BLAMES`: the processes in a callback, else those behind, else those behind on their
  devices or compiling; the launcher reads it to blame Q, whichever process ended first), publishes the
  message under ``tpustrat/watchdog/abort``, and ends the process with status 124
  (`names.EXIT_STEP_TIMEOUT`);
* fires too when this process has spent longer than the compile bound in one phase of a compile (a trace
  that never returns, a compiler that hangs): a compile that never ends is caught, later than a hang;
* ends the process the same way, with the firing process's message, when another process has published
  ``tpustrat/watchdog/abort``, so that the whole job stops within ``S`` plus a few seconds, the stuck
  process included. Each process says so under ``tpustrat/watchdog/stopping/<process>`` before it ends,
  and process 0, whose end takes JAX's coordination service with it (JAX then aborts the others with
  SIGABRT before they read the abort), waits for the others' word first, at most two ticks and a second.

It ends the process (``os._exit``) rather than raising: the main thread is blocked inside XLA, waiting
for a collective that cannot finish, where no exception can reach it. A legitimate program slower than
``S`` (a long `experimental_run_steps` scan counts as one program) fires it too: choose ``S`` above the
longest program plus the steps in flight before it. Time is read at ticks: what is counted or excused
is exact to about two ticks (a peer's compile is seen at its own next tick). Only the noted programs are
timed: a wait outside them is not (`jax.device_put` of a numpy value onto a sharding that spans processes
first checks, across processes, that every process passes the same value).

Cost when on: a counter, two clock reads, two tuples and a deque append per dispatch on the main thread
(measured in ``benchmarks/bench_run.py``); the thread does the rest. While a program waits longer than a
tick, the thread makes one key-value read per tick (multi-process jobs) and looks at the threads' Python
frames (``sys._current_frames``).
"""

from __future__ import annotations

import atexit
import collections
import json
import math
import os
import sys
import threading
import time
from typing import Any

import jax

from tpustrat._src import jax_compat, names
from tpustrat._src.step_hooks import Step, StepHook

__all__ = ["Heartbeat", "Watchdog", "activate", "active", "blames_line", "compile_timeout_from_environment",
           "end_if_aborted", "exit_now", "default_compile_timeout", "note", "start", "stop",
           "timeout_from_environment"]

_STEPS_KEY = "tpustrat/watchdog/steps/"
_BUSY_KEY = "tpustrat/watchdog/busy/"
_ABORT_KEY = "tpustrat/watchdog/abort"
_STOPPING_KEY = "tpustrat/watchdog/stopping/"  # a process whose watchdog ends it says so here first
_RECENT = 4  # noted programs whose tokens the thread checks to find the newest finished step
_LISTED = 32  # processes listed one per line in a firing watchdog's message


def _positive_seconds_from_environment(name: str, what: str) -> float | None:
  text = os.environ.get(name, "").strip()
  if not text:
    return None
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not names.MIN_STEP_TIMEOUT_SECONDS <= value <= names.MAX_TIMEOUT_SECONDS:  # NaN fails too
    raise ValueError(f"{name}={text!r} must be a positive number of seconds ({what}) in "
                     f"[{names.MIN_STEP_TIMEOUT_SECONDS:g}, {names.MAX_TIMEOUT_SECONDS}], or unset.")
  return value


def timeout_from_environment() -> float | None:
  """``TPUSTRAT_STEP_TIMEOUT`` as seconds (None when unset or empty); ValueError naming the value if it
  is not a positive number."""
  return _positive_seconds_from_environment(names.ENV_STEP_TIMEOUT, "the step watchdog's timeout")


def compile_timeout_from_environment() -> float | None:
  """``TPUSTRAT_COMPILE_TIMEOUT`` as seconds (None when unset or empty); ValueError naming the value if
  it is not a positive number."""
  return _positive_seconds_from_environment(names.ENV_COMPILE_TIMEOUT, "the step watchdog's compile bound")


def default_compile_timeout(timeout: float) -> float:
  """The compile bound when ``TPUSTRAT_COMPILE_TIMEOUT`` is unset: the larger of 1800 s and 10 x `timeout`."""
  return max(1800.0, 10.0 * timeout)


def check_timeout(value: Any, where: str, what: str = "step_timeout") -> float:
  """`value` as a float in ``[names.MIN_STEP_TIMEOUT_SECONDS, names.MAX_TIMEOUT_SECONDS]`` (the launcher's
  range for ``--step-timeout``: a step timeout below a second fires on a healthy step), or a ValueError
  naming it."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      names.MIN_STEP_TIMEOUT_SECONDS <= value <= names.MAX_TIMEOUT_SECONDS):
    raise ValueError(f"{where}: {what} must be a positive number of seconds in "
                     f"[{names.MIN_STEP_TIMEOUT_SECONDS:g}, {names.MAX_TIMEOUT_SECONDS}], got {value!r}.")
  return float(value)


class Watchdog:
  """Watches the programs this process dispatches and compiles; see the module docstring. One per process
  (`start`).

  Args:
    timeout: the step timeout ``S``, seconds.
    process_index, process_count: this process and the job's size.
    client: the coordination service's client (None: one process, nothing published).
    exit_fn: called with the message when the watchdog fires (default: print it, exit with status 124).
    compile_timeout: the compile bound, seconds (default `default_compile_timeout`).
  """

  def __init__(self, timeout: float, *, process_index: int = 0, process_count: int = 1, client: Any = None,
               exit_fn: Any = None, compile_timeout: float | None = None) -> None:
    self.timeout = timeout
    self.compile_timeout = default_compile_timeout(timeout) if compile_timeout is None else compile_timeout
    self.process_index = process_index
    self.process_count = process_count
    self._client = client
    self._exit = exit_fn if exit_fn is not None else exit_step_timeout
    self.steps = 0  # steps dispatched by this process (main thread)
    self._last: tuple[int, float, Any] | None = None  # (steps, dispatch time, wait token) of the newest program
    self._dispatching: tuple[int, float, Any] | None = None  # a dispatch under way: `dispatch_begins`
    self._recent: collections.deque[tuple[int, float, Any]] = collections.deque(maxlen=_RECENT)
    self.finished = 0  # the step counter of the newest program the thread saw finished here
    self._compile_lock = threading.Lock()
    self._compiling = 0  # compile phases in progress (any thread)
    self._compiling_since: float | None = None  # when the current run of compile phases began
    # The thread's own state.
    self._published = -1
    self._busy_published = False
    self._program: tuple[int, float, Any] | None = None  # the program being timed
    self._counted = 0.0  # its waiting time that counts against the timeout
    self._excused = 0.0  # its waiting time while a process compiled
    self._clock = 0.0  # when the thread last accounted for it
    self._callbacks: dict[Any, tuple[float, Any]] = {}  # see `_see_callbacks`
    self._stopping = threading.Event()
    self._ending: str | None = None  # the message this watchdog ends the process with, once it does
    self.interval = min(1.0, timeout / 10)
    self._thread = threading.Thread(target=self._watch, name="tpustrat-step-watchdog", daemon=True)
    self._thread.start()

  # -- the main thread (and any thread that compiles) ------------------------------------------------

  def note(self, token: Any, steps: int) -> None:
    """Records a dispatched program: `steps` steps (0 for a reduction) and its wait token."""
    self.steps += steps
    self._last = last = (self.steps, time.monotonic(), token)
    self._recent.append(last)

  def dispatch_begins(self, steps: int) -> bool:
    """A dispatch of a program of `steps` steps begins; False (nothing noted) inside another one (a `run`
    traced in `experimental_run_steps`' program). Until `dispatch_ends`, once every noted program has
    finished, the thread times the dispatch itself, and this process counts as having reached its steps:
    XLA:CPU runs a program of one device in the calling thread, so with one device per process the call
    returns only when its collectives have, and a peer that never joins them holds it forever."""
    if self._dispatching is not None:
      return False
    self._dispatching = (self.steps + steps, time.monotonic(), _UNDER_WAY)
    return True

  def dispatch_ends(self) -> None:
    """The dispatch `dispatch_begins` noted has returned (noted, or failed)."""
    self._dispatching = None

  def dispatched(self, token: Any, steps: int) -> None:
    """`dispatch_ends`, then `note` (the dispatch path's one call: `engine.in_flight.dispatch_default_hooks`)."""
    self._dispatching = None
    self.steps += steps
    self._last = last = (self.steps, time.monotonic(), token)
    self._recent.append(last)

  def reached(self) -> int:
    """The steps this process has dispatched, and the one it is dispatching when every noted program has
    finished (the dispatch itself waits, as the thread times it; while a noted program waits, the dispatch
    waits for the in-flight bound: it is not counted)."""
    dispatching, last = self._dispatching, self._last
    if dispatching is None or (last is not None and last[2] is not None and not _is_ready(last[2])):
      return self.steps
    return dispatching[0]

  def compile_begin(self) -> None:
    """This process starts a phase of compiling a program (called by JAX's monitoring events)."""
    with self._compile_lock:
      self._compiling += 1
      if self._compiling == 1:
        self._compiling_since = time.monotonic()

  def compile_end(self) -> None:
    """A phase of compiling a program is over."""
    with self._compile_lock:
      if self._compiling > 0:  # an end without a begin: the watchdog started in the middle of a phase
        self._compiling -= 1
      if self._compiling == 0:
        self._compiling_since = None

  def stop(self) -> None:
    """Stops the thread (and waits a few ticks for it)."""
    self._stopping.set()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout=5 * self.interval + 1)

  # -- the thread --------------------------------------------------------------------------------------

  def _watch(self) -> None:
    while not self._stopping.wait(self.interval):
      try:
        self._tick()
      except Exception:  # noqa: BLE001  # the runtime is shutting down: nothing left to watch
        if self._stopping.is_set():
          return
        raise

  def _tick(self) -> None:
    now = time.monotonic()
    client = self._client
    if client is not None:
      steps = self.reached()
      if steps != self._published:
        client.key_value_set(f"{_STEPS_KEY}{self.process_index}", str(steps), allow_overwrite=True)
        self._published = steps
      message = _try_get(client, _ABORT_KEY)
      if message is not None:
        doing = _describe(self._status(now), with_steps=False)
        self._end(f"{message}\ntpustrat: step watchdog: process {self.process_index} (last step reached: "
                  f"{self.reached()}{'; ' + doing if doing else ''}) stops too.")
        return
    since = self._compiling_since
    if since is not None and now - since > self.compile_timeout:
      self._end(self._compile_report(now - since), publish=True)
      return
    self._update_finished()
    last = self._last
    if last is None or last[2] is None or _is_ready(last[2]):
      last = self._dispatching  # every noted program has finished: a dispatch that has not returned waits
    if last is None:
      self._program = None
      self._callbacks.clear()
      self._publish_busy(now, waited=None)
      return
    steps, dispatched, _ = last
    if self._program is not last:  # a new program: its own clock
      self._program, self._counted, self._excused, self._clock = last, 0.0, 0.0, dispatched
    elapsed, self._clock = max(0.0, now - self._clock), now
    waited = now - dispatched
    busy = self._read_busy() if client is not None and waited > self.interval else {}
    compiling = since is not None or any("compiling" in entry for p, entry in busy.items()
                                         if p != self.process_index)
    if compiling and self._excused + elapsed <= self.compile_timeout:
      self._excused += elapsed
    else:
      self._counted += elapsed
    if waited > self.interval:
      self._see_callbacks(now)
    self._publish_busy(now, waited=waited)
    if self._counted > self.timeout:
      self._end(self.report(steps, waited, busy), publish=True)

  def _update_finished(self) -> None:
    """Drops the noted programs that have finished (oldest first, as they finish), so that their tokens
    are not held longer than a tick, and keeps the newest one's step counter as `finished`."""
    recent = self._recent
    while recent:
      try:
        steps, _, token = recent[0]
      except IndexError:  # the main thread's append pushed it out meanwhile
        break
      if token is not None and not _is_ready(token):
        break
      self.finished = max(self.finished, steps)
      try:
        recent.popleft()
      except IndexError:
        break

  def _see_callbacks(self, now: float) -> None:
    """Which host callbacks run now: each call's entry frame -> (when the thread first saw the call, the
    callback's own frame). Frames are held, so that a new call never takes an old one's identity."""
    seen = self._callbacks
    self._callbacks = {entry: (seen[entry][0] if entry in seen else now, frame)
                       for _, entry, frame in jax_compat.host_callback_frames()}

  def _status(self, now: float, waited: float | None = None) -> dict[str, Any]:
    """What this process is busy with, as published under ``busy/``."""
    status: dict[str, Any] = {"steps": self.reached(), "finished": self.finished}
    if waited is not None:
      status["waited"] = round(waited, 1)
    since = self._compiling_since
    if since is not None:
      status["compiling"] = round(now - since, 1)
    running = [(first, frame) for first, frame in self._callbacks.values() if now - first >= self.interval]
    if running:
      first, frame = min(running, key=lambda item: item[0])
      code = frame.f_code
      status["callback"] = {"function": code.co_name, "file": code.co_filename, "line": frame.f_lineno,
                            "seconds": round(now - first, 1), "threads": len(running)}
    return status

  def _publish_busy(self, now: float, waited: float | None) -> None:
    if self._client is None:
      return
    key = f"{_BUSY_KEY}{self.process_index}"
    if self._compiling_since is not None or (waited is not None and waited > self.timeout / 2):
      self._client.key_value_set(key, json.dumps(self._status(now, waited)), allow_overwrite=True)
      self._busy_published = True
    elif self._busy_published:
      self._client.key_value_delete(key)
      self._busy_published = False

  def _read_busy(self) -> dict[int, dict[str, Any]]:
    """Every process's ``busy/`` entry (this process's own included, as last published)."""
    found: dict[int, dict[str, Any]] = {}
    try:
      entries = self._client.key_value_dir_get(_BUSY_KEY)
    except Exception:  # noqa: BLE001  # the coordination service is going away: nothing known
      return found
    for key, value in entries:
      try:
        entry = json.loads(value)
        found[int(key.rsplit("/", 1)[-1])] = entry if isinstance(entry, dict) else {}
      except ValueError:
        continue
    return found

  def counters(self) -> dict[int, int]:
    """Every process's published step counter (this process's own, current, included)."""
    found: dict[int, int] = {}
    if self._client is not None:
      for key, value in self._client.key_value_dir_get(_STEPS_KEY):
        try:
          found[int(key.rsplit("/", 1)[-1])] = int(value)
        except ValueError:
          continue
    found[self.process_index] = self.reached()
    return found

  def report(self, steps: int, waited: float, busy: dict[int, dict[str, Any]] | None = None) -> str:
    """The message of a firing watchdog: who waits, since when, who is behind, and what each busy process
    reported."""
    me = self.process_index
    now = time.monotonic()
    try:
      counters = self.counters()
      busy = self._read_busy() if self._client is not None else {}
    except Exception as e:  # noqa: BLE001  # the coordination service is gone too: say what we know
      counters, busy = {me: self.steps}, dict(busy or {})
      unknown = f" (the other processes' counters could not be read: {e})"
    else:
      unknown = ""
    busy[me] = self._status(now, waited)
    excused = (f"; {self._excused:.1f} s of it while a process was compiling, not counted"
               if self._excused >= 0.05 else "")
    behind = sorted((p, n) for p, n in counters.items() if n < steps and p != me)
    silent = sorted(set(range(self.process_count)) - set(counters))
    lines = [f"tpustrat: step watchdog: process {me} has waited {waited:.1f} s for step {steps} to finish "
             f"(step timeout {self.timeout:g} s{excused}){unknown}."]
    if behind:
      lines.append("processes behind: " + ", ".join(f"process {p} (last step reached: {n})" for p, n in behind)
                   + ".")
    if silent:
      lines.append("processes that never reported a step: " + ", ".join(f"process {p}" for p in silent) + ".")
    reported, stuck = self._what_each_reported(steps, counters, busy, everyone=not behind and not silent)
    lines.extend(reported)
    if not stuck:  # a process in a callback says more than a counter behind (it may be behind because of it)
      stuck = [p for p, _ in behind] + silent
    if stuck:
      lines.append(blames_line(me, stuck))
    lines.append(f"Every process of the job stops with status {names.EXIT_STEP_TIMEOUT}.")
    return "\n".join(lines)

  def _what_each_reported(self, steps: int, counters: dict[int, int], busy: dict[int, dict[str, Any]],
                          everyone: bool) -> tuple[list[str], list[int]]:
    """What each process published about itself, and what follows from it (`everyone`: every process
    has dispatched step `steps`): (the lines, the processes they find holding the job up: inside a host
    callback; else, when every process dispatched the step, behind on its devices, or compiling)."""
    processes = sorted(counters, key=lambda p: ("callback" not in busy.get(p, {}), p not in busy, p))
    lines = [f"every process has dispatched step {steps}; what each one reported:" if everyone
             else "what each process reported:"]
    for p in processes[:_LISTED]:
      entry = busy.get(p)
      lines.append(f"  process {p}: " + (_describe(entry) if entry is not None else
                                         f"dispatched step {counters[p]}; no program of its own waiting "
                                         f"longer than {self.timeout / 2:g} s, not compiling"))
    if len(processes) > _LISTED:
      lines.append(f"  ... {len(processes) - _LISTED} more processes, not listed.")
    in_callback = sorted(p for p in processes if "callback" in busy.get(p, {}))
    finished = {p: busy[p]["finished"] for p in processes if isinstance(busy.get(p, {}).get("finished"), int)}
    ahead = max(finished.values(), default=None)
    late = sorted(p for p, f in finished.items() if ahead is not None and f < ahead)
    compiling = sorted(p for p in processes if "compiling" in busy.get(p, {}))
    stuck: list[int] = []
    if in_callback:
      stuck = in_callback
      lines.append(f"{_processes(in_callback)} inside a host callback that has not returned: the step cannot "
                   "finish before it returns (or, if it waits for the step, never).")
    elif not everyone:
      pass  # the processes behind are named above
    elif late:
      stuck = late
      lines.append(f"{_processes(late)} behind on its devices: it has finished fewer steps than process "
                   f"{min(p for p, f in finished.items() if f == ahead)} (step {ahead}).")
    elif compiling:
      stuck = compiling
      lines.append(f"{_processes(compiling)} compiling beyond what the compile bound "
                   f"({self.compile_timeout:g} s) lets the step wait.")
    else:
      lines.append("no process is inside a host callback or compiling, and none is behind: the program "
                   "itself ran longer than the timeout (raise it if the step is slow), or a device or a "
                   "collective is stuck.")
    return lines, stuck

  def _compile_report(self, seconds: float) -> str:
    return (f"tpustrat: step watchdog: process {self.process_index} has been tracing, lowering or compiling a "
            f"program for {seconds:.1f} s, longer than the compile bound ({self.compile_timeout:g} s; "
            f"{names.ENV_COMPILE_TIMEOUT}, default the larger of 1800 s and 10 x the step timeout).\n"
            f"{blames_line(self.process_index, [self.process_index])}\n"
            f"Every process of the job stops with status {names.EXIT_STEP_TIMEOUT}.")

  def end_if_aborted(self, error: str) -> None:
    """Ends this process as a watchdog that read the abort does (status 124, the firing watchdog's message)
    when the job is being stopped by a step watchdog: this one is ending it, or another published the abort.
    Else returns. Called for an uncaught exception (`error`: its type) by the hook `distributed` installs:
    with one device per process a step runs in the main thread (`dispatch_begins`), and a peer whose
    watchdog ended it fails the step's collective there (gloo: "Connection closed by peer"), before this
    process's thread reads the abort at its next tick; as a crash, process 0 would end the coordination
    service, and the job, at once."""
    message = self._ending
    if message is None and self._client is not None:
      message = _try_get(self._client, _ABORT_KEY)
    if message is None:
      return
    self._end(f"{message}\ntpustrat: step watchdog: process {self.process_index} (last step reached: "
              f"{self.reached()}; its step failed with {error} as a peer stopped) stops too.")

  def _end(self, message: str, publish: bool = False) -> None:
    if self._ending is None:
      self._ending = message
    client = self._client
    if client is not None:
      if publish:
        try:
          client.key_value_set(_ABORT_KEY, message)
        except Exception:  # noqa: BLE001  # another process fired first, or the service is gone
          pass
      try:
        client.key_value_set(f"{_STOPPING_KEY}{self.process_index}", "1", allow_overwrite=True)
      except Exception:  # noqa: BLE001  # the service is gone
        pass
      if self.process_index == 0:
        self._outlive_the_others()
    self._stopping.set()
    self._exit(message)

  def _outlive_the_others(self) -> None:
    """Process 0 runs the coordination service: when it ends, JAX aborts every other process (SIGABRT,
    134) within a fraction of a second, before their watchdogs read the abort at their next tick. So it
    waits until every other process has said it stops (``stopping/<process>``), at most two ticks and a
    second: each process then ends with the watchdog's status and message, and the process the message
    blames keeps its own status (a process too stuck to answer is not waited for longer)."""
    others = set(range(self.process_count)) - {self.process_index}
    deadline = time.monotonic() + 2 * self.interval + 1.0
    while others and time.monotonic() < deadline:
      try:
        others -= {int(key.rsplit("/", 1)[-1]) for key, _ in self._client.key_value_dir_get(_STOPPING_KEY)}
      except Exception:  # noqa: BLE001  # the service is gone: nothing to wait for
        return
      time.sleep(min(0.05, self.interval))


def _describe(entry: dict[str, Any], with_steps: bool = True) -> str:
  """One process's ``busy/`` entry in words."""
  parts = []
  if with_steps:
    parts.append(f"dispatched step {entry.get('steps')}, finished step {entry.get('finished')} on its devices")
  if "waited" in entry:
    parts.append(f"its newest program has waited {entry['waited']:.1f} s")
  if "compiling" in entry:
    parts.append(f"compiling for {entry['compiling']:.1f} s")
  callback = entry.get("callback")
  if isinstance(callback, dict):
    threads = callback.get("threads", 1)
    parts.append(f"inside a host callback for {callback.get('seconds', 0):.1f} s: {callback.get('function')} "
                 f"({callback.get('file')}:{callback.get('line')})"
                 + (f", on {threads} threads" if threads != 1 else ""))
  return "; ".join(parts)


def blames_line(firing: int, processes: list[int]) -> str:
  """The line naming the processes the watchdog of process `firing` finds holding the job up, as the
  launcher reads it (`names.WATCHDOG_BLAMES`): ``tpustrat: step watchdog of process 0: holding the job up:
  process 1.``"""
  ordered = sorted(set(processes))
  stuck = ("process " if len(ordered) == 1 else "processes ") + ", ".join(str(p) for p in ordered)
  return names.WATCHDOG_BLAMES.format(firing=firing, stuck=stuck)


def _processes(indices: list[int]) -> str:
  if len(indices) == 1:
    return f"process {indices[0]} is"
  shown = ", ".join(str(p) for p in indices[:_LISTED]) + (f" and {len(indices) - _LISTED} more"
                                                           if len(indices) > _LISTED else "")
  return f"processes {shown} are"


def _try_get(client: Any, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except Exception:  # noqa: BLE001  # NOT_FOUND (an XlaRuntimeError in JAX 0.10 and 0.12)
    return None


def _is_ready(token: Any) -> bool:
  try:
    return bool(token.is_ready())
  except Exception:  # noqa: BLE001  # deleted or donated: it finished
    return True


def exit_step_timeout(message: str) -> None:
  """Prints `message` and ends the process at once with the step-timeout status (124), as the watchdog and
  the checkpoint deadlines do: the waiting main thread is inside XLA or a barrier, where nothing reaches it."""
  exit_now(message, names.EXIT_STEP_TIMEOUT)


def exit_now(message: str, status: int) -> None:
  """Flushes the output, prints `message` to stderr and ends the process at once with `status` (no
  interpreter teardown: another thread may be inside XLA or a barrier)."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001
      pass
  sys.stderr.write(message + "\n")
  sys.stderr.flush()
  os._exit(status)


_ACTIVE: Watchdog | None = None
_LOCK = threading.Lock()
_UNWATCH: Any = None  # stops JAX's compile events reaching `_compile_begin` / `_compile_end`


def note(token: Any, steps: int = 1) -> None:
  """Records a dispatched program with the running watchdog, if any (one global read when off). A call
  while tracing (`run` inside a scan body, say) dispatches nothing: its tracer token is not counted."""
  watchdog = _ACTIVE
  if watchdog is not None and not isinstance(token, jax.core.Tracer):
    watchdog.note(token, steps)


class _UnderWay:
  """The wait token of a dispatch that has not returned (`Watchdog.dispatch_begins`): never ready."""

  __slots__ = ()

  def is_ready(self) -> bool:
    return False


_UNDER_WAY = _UnderWay()


class Heartbeat(StepHook):
  """The per-step hook of the step watchdog (`step_hooks`; registered by the engine,
  `engine.in_flight.STEP_HOOKS`): every dispatch is marked while under way (`Watchdog.dispatch_begins`) and
  every dispatched program noted (`note`); one global read per method when off."""

  __slots__ = ()

  def before(self, step: Step) -> Any:
    watchdog = _ACTIVE
    return watchdog if watchdog is not None and watchdog.dispatch_begins(step.steps) else None

  def after(self, step: Step, state: Any, token: Any, now: float | None) -> None:
    if state is not None:
      state.dispatch_ends()
    watchdog = _ACTIVE  # `note`, written out: one call less per dispatch
    if watchdog is not None and not isinstance(token, jax.core.Tracer):
      watchdog.note(token, step.steps)

  def abort(self, step: Step, state: Any) -> None:
    if state is not None:
      state.dispatch_ends()


def _compile_begin() -> None:
  watchdog = _ACTIVE
  if watchdog is not None:
    watchdog.compile_begin()


def _compile_end() -> None:
  watchdog = _ACTIVE
  if watchdog is not None:
    watchdog.compile_end()


def end_if_aborted(error: str) -> None:
  """`Watchdog.end_if_aborted` of the running watchdog, if any: ends the process when a step watchdog is
  stopping the job (for the uncaught-exception hook); returns otherwise."""
  watchdog = _ACTIVE
  if watchdog is not None:
    watchdog.end_if_aborted(error)


def active() -> Watchdog | None:
  """The running watchdog, or None."""
  return _ACTIVE


def activate(watchdog: Watchdog | None) -> Watchdog | None:
  """Makes `watchdog` the one that `note` (and JAX's compile events, once `start` has run) feed (None:
  none); returns the previous one. For benchmarks and tests that switch a running watchdog on and off
  without starting and joining its thread."""
  global _ACTIVE
  with _LOCK:
    previous, _ACTIVE = _ACTIVE, watchdog
  return previous


def start(timeout: float, *, process_index: int | None = None, process_count: int | None = None,
          compile_timeout: float | None = None) -> Watchdog:
  """Starts this process's watchdog with `timeout` seconds (once; a second call with the same timeout
  returns the running one, with another a ValueError). Publishes through the coordination service when
  `jax.distributed` runs. `compile_timeout`: the compile bound (default ``TPUSTRAT_COMPILE_TIMEOUT``, or
  `default_compile_timeout`)."""
  global _ACTIVE, _UNWATCH
  timeout = check_timeout(timeout, "the step watchdog")
  if compile_timeout is None:
    compile_timeout = compile_timeout_from_environment()
  else:
    compile_timeout = check_timeout(compile_timeout, "the step watchdog", "compile_timeout")
  with _LOCK:
    if _ACTIVE is not None:
      if _ACTIVE.timeout != timeout:
        raise ValueError(f"the step watchdog already runs with a timeout of {_ACTIVE.timeout:g} s; cannot "
                         f"start another with {timeout:g} s.")
      return _ACTIVE
    client = jax_compat.coordination_client()
    if process_index is None or process_count is None:
      process_index, process_count = jax.process_index(), jax.process_count()
    _ACTIVE = Watchdog(timeout, process_index=process_index, process_count=process_count, client=client,
                       compile_timeout=compile_timeout)
    if _UNWATCH is None:
      _UNWATCH = jax_compat.watch_compiles(_compile_begin, _compile_end)
    atexit.register(stop)  # runs before jax.distributed's own atexit shutdown (registered earlier)
    return _ACTIVE


def stop() -> None:
  """Stops the running watchdog, if any."""
  global _ACTIVE, _UNWATCH
  with _LOCK:
    watchdog, _ACTIVE = _ACTIVE, None
    unwatch, _UNWATCH = _UNWATCH, None
  if unwatch is not None:
    unwatch()
  if watchdog is not None:
    watchdog.stop()
