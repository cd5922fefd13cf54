"""Step statistics: where a training loop's time goes, and the warnings that come from them.

Every strategy keeps `StepCounters`, always on (their cost is measured in ``benchmarks/bench_run.py
--step-stats``: two clock reads and a few additions per step):

* *input*: the time the host waited in its distributed iterators for the next batch (`next`,
  `take_steps`, so `experimental_run_steps` too); without a prefetch thread (XLA:CPU's default) that is
  reading the source and putting the batch on the devices, with one, waiting for the thread;
* *devices*: the time `run` / `experimental_run_steps` waited on the steps-in-flight bound (for an older
  step to finish on the devices; `engine.InFlight`), and `experimental_run_wait`; and, out of the
  iterators' waits, the transfers of batches made while a step was running (`time_transfer`: the devices
  were busy; on XLA:CPU such a transfer can wait until that step ends, which was counted as input before);
* *steps*: training steps dispatched (``k`` for an `experimental_run_steps` program of ``k`` steps);
* the wall time since the first of these events (or since `reset`). What is left of it is the host's
  own work: the step's Python, dispatching, compiling, and waits outside tpustrat (reading a result).

`StepCounters.summary()` returns a `StepStats` (`strategy.experimental_step_stats()`), with the last
`HISTORY` dispatches one by one (a ring buffer). Every ``window`` steps the input share of the window's
time is compared with ``threshold``: above it, one `InputBoundWarning` per strategy names the share and
the remedies. `Retraces` counts the programs `run` compiles per function: the sixth gives one
`RetracingWarning`, naming the argument whose structure, shape or dtype changed (as TF's retracing
warning does).

This module knows no JAX: the engine and the iterators note times, the engine hands `Retraces` the
argument signatures it traced, and its queue of programs in flight (`StepCounters.programs`, their wait
tokens, of which only ``is_ready()`` / ``is_deleted()`` are called).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from tpustrat._src.step_hooks import Step, StepHook

__all__ = ["InputBoundWarning", "StepCounting", "RetracingWarning", "RepeatedPlacementWarning", "StepCounters",
           "StepRecord", "StepStats", "Retraces", "Placements", "DEFAULT_WINDOW", "DEFAULT_THRESHOLD", "HISTORY",
           "RETRACE_LIMIT", "PLACEMENT_LIMIT"]

DEFAULT_WINDOW = 50  # steps per window of the input-bound check
DEFAULT_THRESHOLD = 0.5  # share of a window's time spent waiting for input above which it warns
MIN_WINDOW_SECONDS = 0.5  # shorter windows (a few fast steps) are not judged: too little time to tell
HISTORY = 4096  # dispatches kept one by one
RETRACE_LIMIT = 5  # compiles of one function before the next one warns
PLACEMENT_LIMIT = 3  # times one array is placed at one argument position: the last of them warns

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../tpustrat

# Checkpoints this process has restored (`CheckpointManager.restore` counts them): `keras_models` tells a
# Keras object that a restored state has moved past (`tpustrat.keras.StaleVariableError`). Kept here, below
# both, with the other per-process counts of the loop.
RESTORES = [0]


class InputBoundWarning(UserWarning):
  """The training loop spends most of its time waiting for input: the devices are idle between steps."""


class RetracingWarning(UserWarning):
  """`strategy.run` compiles a function again and again (its arguments' shapes, dtypes or structure change)."""


class RepeatedPlacementWarning(UserWarning):
  """`strategy.run` places one and the same array onto the strategy's devices at call after call: it is not
  laid out as the program wants it, so each call copies it there (and takes `run`'s checked path)."""


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """One dispatch (`run`: 1 step; `experimental_run_steps`: ``steps``), timed from the one before it.

  Attributes:
    steps: training steps the dispatched program runs.
    seconds: wall time since the previous dispatch (or since the start, for the first).
    input_seconds: of which waiting for the batch (the iterator).
    device_seconds: of which waiting for an older step to finish on the devices (the in-flight bound, or
      a batch's transfer queued behind it).
  """

  steps: int
  seconds: float
  input_seconds: float
  device_seconds: float

  @property
  def host_seconds(self) -> float:
    """The rest: the host's own work (Python, dispatch, compiling, waits outside tpustrat)."""
    return max(0.0, self.seconds - self.input_seconds - self.device_seconds)


@dataclasses.dataclass(frozen=True)
class StepStats:
  """Where the time of a training loop went: `strategy.experimental_step_stats()`.

  Attributes:
    steps: training steps dispatched (by `run` and `experimental_run_steps`) since the start.
    wall_seconds: wall time from the start (the first step or input wait, or the last reset) to the call.
    input_seconds: time the host waited for the next batch in distributed iterators (less the transfers
      made while a step was running, which are device time).
    device_seconds: time the host waited on the devices: the steps-in-flight bound,
      `experimental_run_wait`, and the iterators' transfers made while a step was running (the devices
      were busy, or the transfer waited for the step to end).
    history: the last dispatches, oldest first (at most `HISTORY`), one `StepRecord` each.

  The counters are this process's; every process of a job has its own.

  >>> s = StepStats(steps=100, wall_seconds=2.0, input_seconds=1.5, device_seconds=0.3, history=())
  >>> print(s)
  100 steps in 2.00 s (20.0 ms/step): waiting for input 1.50 s (75%), on the devices 0.30 s (15%), other host work 0.20 s (10%)
  """

  steps: int
  wall_seconds: float
  input_seconds: float
  device_seconds: float
  history: tuple[StepRecord, ...] = ()

  @property
  def host_seconds(self) -> float:
    """The rest of the wall time: the host's own work (the step's Python, dispatching, compiling, and
    waits outside tpustrat, such as reading a result)."""
    return max(0.0, self.wall_seconds - self.input_seconds - self.device_seconds)

  @property
  def input_share(self) -> float:
    """`input_seconds` / `wall_seconds` (0 before any time has passed)."""
    return self.input_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

  @property
  def device_share(self) -> float:
    """`device_seconds` / `wall_seconds`."""
    return self.device_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

  @property
  def host_share(self) -> float:
    """`host_seconds` / `wall_seconds`."""
    return self.host_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

  def __str__(self) -> str:
    per_step = f" ({1e3 * self.wall_seconds / self.steps:.1f} ms/step)" if self.steps else ""
    return (f"{self.steps} steps in {self.wall_seconds:.2f} s{per_step}: waiting for input "
            f"{self.input_seconds:.2f} s ({self.input_share:.0%}), on the devices {self.device_seconds:.2f} s "
            f"({self.device_share:.0%}), other host work {self.host_seconds:.2f} s ({self.host_share:.0%})")


class StepCounters:
  """The counters behind `StepStats`, kept by a strategy (its engine's `InFlight` and its iterators add to
  them) and checked for an input-bound loop every `window` steps.

  Hot path: `note_input` (the iterator, around its wait), `time_transfer` (the producer of batches, around
  each transfer) and `note_steps` (the engine's per-step hook, `StepCounting`, with the clock reading at
  the end of the in-flight wait).
  """

  __slots__ = ("steps", "input_seconds", "device_seconds", "start", "window", "threshold", "warned",
               "_window_end", "_window_start", "_window_input", "_window_device", "_history", "_first",
               "warn_to", "programs")

  def __init__(self, window: int = DEFAULT_WINDOW, threshold: float | None = DEFAULT_THRESHOLD) -> None:
    self.window = window
    self.threshold = threshold  # None: no input-bound warning
    self.warned = False  # the input-bound warning is given once
    self.warn_to: Callable[[str], None] | None = None  # tests: where the warning goes instead
    # The wait tokens of the programs in flight, oldest first: the engine's queue (`engine.InFlight`,
    # which sets it), read by `time_transfer`; None without an engine (the default strategy).
    self.programs: Sequence[Any] | None = None
    self.reset()

  def reset(self, now: float | None = None) -> None:
    """Starts counting again from zero (`now`, default the current time, is the start). The input-bound
    warning, once given, stays given."""
    self.steps = 0
    self.input_seconds = 0.0
    self.device_seconds = 0.0
    self.start: float | None = now  # None: set by the first event
    self._window_end = self.window
    self._window_start: float | None = now  # None until the first event, as `start`
    self._window_input = 0.0
    self._window_device = 0.0
    # (time, steps, input, device) after each dispatch; one more than HISTORY, for the first difference
    self._history: collections.deque[tuple[float, int, float, float]] = collections.deque(maxlen=HISTORY + 1)
    self._first: tuple[float, int, float, float] | None = None if now is None else (now, 0, 0.0, 0.0)

  def reset_window(self) -> None:
    """A new window (of the current `window` steps) starts now; the counters are kept."""
    self._window_end = self.steps + self.window
    if self.start is not None:
      self._window_start = time.perf_counter()
    self._window_input, self._window_device = self.input_seconds, self.device_seconds

  def started(self, now: float) -> None:
    """The first event since the start: the clock starts at `now`."""
    self.start = self._window_start = now
    self._first = (now, 0, 0.0, 0.0)

  def note_input(self, since: float, on_devices: float = 0.0) -> None:
    """The host waited for a batch from `since` (a `time.perf_counter()` reading) until now; `on_devices`
    seconds of it were transfers made while a step was running (`time_transfer`): device time."""
    now = time.perf_counter()
    if self.start is None:
      self.started(since)
    waited = now - since
    on_devices = min(max(on_devices, 0.0), waited)
    self.input_seconds += waited - on_devices
    self.device_seconds += on_devices

  def running(self) -> tuple[Any, ...]:
    """The wait tokens of the dispatched programs that have not finished now (none without an engine)."""
    programs = self.programs
    if not programs:
      return ()
    return tuple(t for t in tuple(programs) if not _finished(t))  # tuple(): one C call, safe across threads

  def time_transfer(self, transfer: Callable[[], Any]) -> tuple[Any, float]:
    """Calls `transfer()` (a batch's host-to-device transfer, or a wait for one) and returns its result and
    the seconds of it that count as device time: all of them if a step was running when it started, else
    0.

    A step running at a transfer's start either ran through all of it (the devices were busy: the transfer
    was hidden behind the step, not a time the devices waited for input), or ended during it. On XLA:CPU
    the transfer of a large batch made while a step runs on the same cores waits for that step: the call
    returned when the step ended (a convnet's 10 stacked batches of 512 images: 9.6 s of a 10 s
    `experimental_run_steps` program, while reading and transferring them alone took milliseconds).
    Counted as input, that made a device-bound loop look input-bound (issue 32). The step's wait token is
    not a witness of that end: it can turn ready milliseconds after the transfer returned (1.6-17 ms
    measured with the 2 cores busy with other work), so a rule that asked whether the step had ended by
    the transfer's end counted some of those waits as input, and a device-bound loop was warned 50%
    input-bound on a busy machine. Only the transfers made while no step ran, when the devices were idle,
    are input. Not told apart: a step that ended early in a transfer that is itself slow (a batch far
    larger than a step's work) -- the rest of that transfer is device time too. On GPU and TPU a transfer
    is asynchronous and short."""
    running = self.running()
    if not running:
      return transfer(), 0.0
    start = time.perf_counter()
    result = transfer()
    return result, time.perf_counter() - start

  def note_steps(self, steps: int, now: float) -> None:
    """`steps` training steps are dispatched at `now` (after the in-flight wait)."""
    if self.start is None:
      self.started(now)
    self.steps += steps
    self._history.append((now, self.steps, self.input_seconds, self.device_seconds))
    if self.steps >= self._window_end:
      self._end_window(now)

  def _end_window(self, now: float) -> None:
    assert self._window_start is not None  # `note_steps` started the clock
    seconds = now - self._window_start
    waited = self.input_seconds - self._window_input
    on_devices = self.device_seconds - self._window_device
    steps = self.steps - (self._window_end - self.window)
    self._window_end = self.steps + self.window
    self._window_start, self._window_input, self._window_device = now, self.input_seconds, self.device_seconds
    threshold = self.threshold
    if (threshold is None or self.warned or seconds < MIN_WINDOW_SECONDS or waited <= threshold * seconds):
      return
    self.warned = True
    message = input_bound_message(steps, seconds, waited, on_devices, threshold)
    if self.warn_to is not None:
      self.warn_to(message)
    else:
      warnings.warn(message, InputBoundWarning, stacklevel=user_stacklevel())

  def summary(self, now: float | None = None) -> StepStats:
    """The counters as a `StepStats`, the wall time up to `now` (default: the current time)."""
    if now is None:
      now = time.perf_counter()
    start = self.start
    rows = list(self._history)
    if self._first is not None and len(rows) < (self._history.maxlen or 0):
      rows.insert(0, self._first)
    history = tuple(StepRecord(b[1] - a[1], b[0] - a[0], b[2] - a[2], b[3] - a[3]) for a, b in zip(rows, rows[1:]))
    return StepStats(steps=self.steps, wall_seconds=0.0 if start is None else max(0.0, now - start),
                     input_seconds=self.input_seconds, device_seconds=self.device_seconds, history=history)


class StepCounting(StepHook):
  """The per-step hook of the step counters (`step_hooks`; registered by the engine,
  `engine.in_flight.STEP_HOOKS`): the steps of each program dispatched are noted in the dispatching
  engine's counters (``step.in_flight.stats``) at the end of its in-flight wait (`note_steps`). The wait
  itself is added to the device time by the bound that waits (`engine.InFlight`)."""

  __slots__ = ()

  def after(self, step: Step, state: Any, token: Any, now: float | None) -> None:
    if now is not None:  # counters kept, steps run, dispatched: the clock reading of the wait's end
      stats = step.in_flight.stats
      if stats is not None:
        stats.note_steps(step.steps, now)


def _finished(token: Any) -> bool:
  """Whether the program `token` belongs to has ended (a deleted or failed token counts as ended)."""
  try:
    return bool(token.is_deleted() or token.is_ready())
  except Exception:  # pylint: disable=broad-except  # a failed program: it has ended
    return True


def input_bound_message(steps: int, seconds: float, waited: float, on_devices: float, threshold: float) -> str:
  """The `InputBoundWarning`'s text for a window of `steps` steps in `seconds`."""
  return (
      f"The training loop waited for input {waited / seconds:.0%} of its time over its last {steps} steps "
      f"({waited:.2f} s of {seconds:.2f} s; waiting on the devices: {on_devices / seconds:.0%}): the devices "
      "sit idle while the host prepares batches. Remedies: read further ahead (the prefetch depth, "
      "InputOptions(experimental_per_replica_buffer_size=2) or more: on a GPU or TPU the next batches' "
      "transfers then run beside the step; on XLA:CPU a transfer is a copy on the cores that run the steps, "
      "which no depth hides, and its default is 0); run several "
      "steps per program (strategy.experimental_run_steps(fn, iterator, steps=k)), so that the host hands "
      "over k batches at once; in a multi-process job, let each process read only its own replicas' data "
      "(strategy.experimental_distribute_datasets_from_function, or a batched grain MapDataset); and make "
      "the source faster (grain's worker processes, decoding once ahead of training). If the transfer to "
      "the devices itself is the bottleneck (a batch's transfer takes longer than a step, so no depth hides "
      "it), send fewer bytes (uint8 images or bfloat16 features, cast and normalised inside the step) or move "
      "the work that makes the batch (decoding, augmentation, normalisation) onto the devices. "
      "strategy.experimental_step_stats() gives the split of the time. This warning is given once per "
      f"strategy, above an input share of {threshold:.0%} "
      "(strategy.extended.experimental_input_bound_threshold; None turns it off).")


def user_stacklevel(skip: Sequence[str] = ()) -> int:
  """The `warnings.warn` stacklevel of the first frame outside tpustrat (and outside the packages whose
  directories start with one of `skip`), seen from the caller of this function."""
  frame: FrameType | None = sys._getframe(2)
  level = 2
  prefixes = (_PACKAGE_DIR, *skip)
  while frame is not None and frame.f_code.co_filename.startswith(prefixes):
    frame, level = frame.f_back, level + 1
  return level


# -- retracing ------------------------------------------------------------------------------------------

# An argument signature: (paths of the leaves, their (shape, dtype, weak) types, the top-level arguments'
# structures as strings, the number of positional arguments and the keyword names).
Signature = tuple[tuple[str, ...], tuple[tuple[tuple[int, ...], str, bool], ...], tuple[str, ...], int,
                  tuple[str, ...]]


class Retraces:
  """How many programs `run` compiled per function; the compile after `RETRACE_LIMIT` warns once per
  function, naming what changed since the compile before it. Keyed by the engine's weak function key, so it
  keeps no function alive; at most `limit` functions are remembered (the oldest forgotten)."""

  def __init__(self, limit: int = 1024) -> None:
    self._seen: collections.OrderedDict[Any, list[Any]] = collections.OrderedDict()  # key -> [count, sig, warned]
    self._limit = limit

  def traced(self, key: Any, name: str, signature: Callable[[], Signature]) -> None:
    """`run` traced `key`'s function (called `name`) for a new program; `signature()` describes its
    arguments."""
    sig = signature()
    try:
      entry = self._seen.get(key)
    except TypeError:  # unhashable: not counted
      return
    if entry is None:
      self._seen[key] = [1, sig, False]
      if len(self._seen) > self._limit:
        self._seen.popitem(last=False)
      return
    entry[0] += 1
    previous, entry[1] = entry[1], sig
    if entry[0] <= RETRACE_LIMIT or entry[2]:
      return
    entry[2] = True
    warnings.warn(retrace_message(name, entry[0], previous, sig), RetracingWarning,
                  stacklevel=user_stacklevel(jax_dirs()))


class Placements:
  """The arrays `run` had to place onto the strategy's devices (given whole, not laid out as the program
  wants them), per function, argument structure and leaf position: the `PLACEMENT_LIMIT`-th time one and
  the same array object is placed at one position warns (`RepeatedPlacementWarning`), once per function.
  Counting per position keeps the count as large as the arguments (a model of thousands of plain arrays is
  counted whole) and apart per function; calls that place nothing there do not reset it. Arrays are held
  weakly (an entry whose array is gone, or that another array took over, starts again: `id` values are
  reused); at most `limit` functions and structures are remembered, the least recently placed forgotten
  first. Thread-safe; a function warned for is no longer counted (`counts`)."""

  def __init__(self, limit: int = 256) -> None:
    # (function, structure) -> {leaf position: [the array placed there last, held weakly; times placed]}
    self._seen: collections.OrderedDict[Any, dict[int, list[Any]]] = collections.OrderedDict()
    self._warned: collections.OrderedDict[Any, None] = collections.OrderedDict()  # function keys warned for
    self._limit = limit
    self._lock = threading.Lock()

  def counts(self, function: Any) -> bool:
    """Whether placements by `function` are still counted (it has not been warned for)."""
    try:
      return function not in self._warned
    except TypeError:  # an unhashable key: not counted
      return False

  def placed(self, function: Any, structure: Any, position: int, value: Any,
             message: Callable[[int], str]) -> None:
    """`run` of the function keyed `function`, called with arguments of `structure`, placed `value` at leaf
    `position`; `message(count)` is the warning's text."""
    try:
      ref = weakref.ref(value)
      key = (function, structure)
      hash(key)
    except TypeError:  # not referable weakly, or an unhashable key: not counted
      return
    with self._lock:
      seen = self._seen
      positions = seen.get(key)
      if positions is None:
        positions = seen[key] = {}
        if len(seen) > self._limit:
          seen.popitem(last=False)
      else:
        seen.move_to_end(key)
      entry = positions.get(position)
      if entry is None or entry[0]() is not value:
        entry = positions[position] = [ref, 0]
      entry[1] += 1
      if entry[1] != PLACEMENT_LIMIT or function in self._warned:
        return
      self._warned[function] = None
      if len(self._warned) > self._limit:
        self._warned.popitem(last=False)
    warnings.warn(message(entry[1]), RepeatedPlacementWarning, stacklevel=user_stacklevel(jax_dirs()))


def jax_dirs() -> tuple[str, ...]:
  """The directories of the imported jax and jaxlib packages (frames `user_stacklevel` skips too)."""
  dirs = []
  for name in ("jax", "jaxlib"):
    file = getattr(sys.modules.get(name), "__file__", None)
    if file:
      dirs.append(os.path.dirname(file))
  return tuple(dirs)


def _type_str(t: tuple[tuple[int, ...], str, bool]) -> str:
  shape, dtype, weak = t
  return f"{dtype}[{','.join(map(str, shape))}]" + (" (weakly typed: a Python number)" if weak else "")


def describe_change(old: Signature, new: Signature) -> str:
  """Which argument differs between two signatures, in words."""
  old_paths, old_types, old_tops, old_nargs, old_kw = old
  new_paths, new_types, new_tops, new_nargs, new_kw = new
  if old_nargs != new_nargs or old_kw != new_kw:
    return (f"the arguments changed from {old_nargs} positional and keywords {list(old_kw)} to {new_nargs} "
            f"positional and keywords {list(new_kw)}")
  if old_tops != new_tops:
    names = [f"args[{i}]" for i in range(new_nargs)] + [f"kwargs[{k!r}]" for k in new_kw]
    tops = [(n, a, b) for n, a, b in zip(names, old_tops, new_tops) if a != b]
    n, old_top, new_top = tops[0]
    more = f" (and {len(tops) - 1} more arguments)" if len(tops) > 1 else ""
    return f"the structure of the argument {n} changed from {old_top:.200} to {new_top:.200}{more}"
  changed = [(p, a, b) for p, a, b in zip(new_paths, old_types, new_types) if a != b]
  if not changed:
    return ("no argument's structure, shape or dtype changed since the compile before (another RunOptions: "
            "donate_argnums, check_numerics or a layout map; or arguments laid out differently on the devices)")
  p, a, b = changed[0]
  more = f" (and {len(changed) - 1} more leaves)" if len(changed) > 1 else ""
  return f"the argument at {p} changed from {_type_str(a)} to {_type_str(b)}{more}"


def retrace_message(name: str, count: int, old: Signature, new: Signature) -> str:
  """The `RetracingWarning`'s text for the `count`-th compile of function `name`."""
  return (
      f"strategy.run compiled a program for `{name}` for the {count}th time: {describe_change(old, new)} since "
      f"the compile before. Compiling is expensive, and `run` compiles a program for each new structure, "
      "shape or dtype of its arguments, so frequent compiles could be due to (1) arrays whose shapes change "
      "from step to step: pad them to a few fixed sizes (distributed datasets pad a partial batch to the "
      "first batch's size; InputOptions(drop_remainder=True) drops it), (2) Python numbers passed where "
      "arrays were passed before, or the other way round (pass jnp.asarray(x) every time), or (3) pytrees "
      "whose structure changes (None for a missing value, dicts with other keys, a list that grows). "
      "This warning is given once per function.")
