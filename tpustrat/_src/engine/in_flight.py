"""The bound on programs in flight, and `dispatch`: the one way a compiled program is run.

Before dispatching step ``i``, the caller waits for step ``i - k`` (``k`` = `RunOptions.max_steps_in_flight`,
`DEFAULT_STEPS_IN_FLIGHT` by default), on the smallest output the program computes (`wait_leaf`: chosen when
it is traced; a one-byte token output is added only when there is none of at most 64 KiB). Unbounded
asynchronous dispatch of collective programs can deadlock XLA:CPU's rendezvous on small machines, and buys
nothing once the device is busy. `InFlight` is one such bound: each `Engine` has its own; programs dispatched
without an engine (cross-replica reductions) share a process-wide one.

`dispatch` calls a program that returns ``(result, token)`` under a bound, and around it the per-step seam
(`tpustrat._src.step_hooks`) and nothing else: `STEP_HOOKS` holds, in order, the NaN / Inf checks
(`numerics.StepChecks`), the profile's step marks (`profiler.StepMarks`), the step counters
(`step_stats.StepCounting`) and the step watchdog's heartbeat (`watchdog.Heartbeat`). One dispatch::

  hooks' before (Step)  ->  wait for the bound  ->  program(*args)  ->  record the token  ->  hooks' after
                                       (raised: hooks' abort, newest first)

The bound times its own wait (device time, into its step counters) and runs, once a token is ready, the
check a hook attached to it (`add_check`).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from tpustrat._src import numerics as numerics_lib
from tpustrat._src import profiler, watchdog
from tpustrat._src import step_stats as step_stats_lib
from tpustrat._src.jax_compat import forget_failed_programs
from tpustrat._src.step_hooks import Step, StepHooks

__all__ = ["DEFAULT_STEPS_IN_FLIGHT", "InFlight", "STEP_HOOKS", "default_hooks_apply", "dispatch",
           "dispatch_default_hooks", "dispatch_flat", "wait_leaf"]

DEFAULT_STEPS_IN_FLIGHT = 2
_MAX_WAIT_BYTES = 64 * 1024  # waiting on an output keeps it alive two steps longer: only small ones
_Tracer = jax.core.Tracer
_make_step = tuple.__new__
_perf_counter = time.perf_counter
_collecting = profiler._collecting  # pylint: disable=protected-access
_PROFILE_STEPS, _MARK_OPEN, _PROFILE = profiler.STEPS, profiler.OPEN, profiler.SESSION
_Check, _GROUP = numerics_lib.Check, numerics_lib.GROUP

# The per-step hooks of every dispatch, in order (`step_hooks.StepHooks`; `STEP_HOOKS.register` adds one).
STEP_HOOKS = StepHooks((numerics_lib.StepChecks(), profiler.StepMarks(), step_stats_lib.StepCounting(),
                        watchdog.Heartbeat()))


class InFlight:
  """Bounds the number of dispatched-but-unfinished programs: before a dispatch, waits for the oldest
  until fewer than `limit` are pending; after it, records the output to wait on (the token).

  `Engine.dispatch` uses the engine's own; the module-level `dispatch` a process-wide one. With `stats`
  (the engine's `step_stats.StepCounters`), the time spent waiting is added to its device wait, and
  `before_dispatch` returns the clock reading the steps are noted at (by the step counters' hook,
  `step_stats.StepCounting`): two clock reads per dispatch that waits, one per dispatch that does not.
  """

  def __init__(self, stats: step_stats_lib.StepCounters | None = None) -> None:
    self._pending: collections.deque[jax.Array] = collections.deque()
    # id(token) -> the check to run once it is ready (`RunOptions.check_numerics`; empty without it): the
    # checks closed, each kept under its newest dispatch's token
    self._checks: dict[int, Callable[..., None]] = {}
    # The check registered last (`add_check`, `add_flags`), open: it may take the next dispatch in. It runs
    # once the program of token `_open_key` (its newest dispatch: `id(token)`; 0 when none) has finished.
    self._open: Any = None
    self._open_key = 0
    self.stats = stats
    if stats is not None:  # an iterator's transfer that waits for a running step is device time (`step_stats`)
      stats.programs = self._pending

  def before_dispatch(self, limit: int, steps: int = 0) -> float | None:
    """Waits until fewer than `limit` programs are pending. A program of `steps` training steps follows:
    with `stats`, returns the time (`time.perf_counter`) to note its steps at (by the step counters' hook,
    `step_stats.StepCounting`, or `after_dispatch`)."""
    pending = self._pending
    stats = self.stats
    if len(pending) < limit:
      return time.perf_counter() if stats is not None and steps else None
    start = time.perf_counter()
    while len(pending) >= limit:
      try:
        oldest = pending.popleft()
      except IndexError:  # another thread took it
        break
      try:
        if not oldest.is_deleted():  # `_wait`, written out: one frame less per step
          oldest.block_until_ready()
      except Exception as e:
        # An earlier step failed (its outputs raise the same error wherever they are read). It is out of
        # the queue now, so the next call dispatches; this one raises, naming what happened.
        forget_failed_programs()
        check = self._take_check(id(oldest))
        if check is not None:  # the steps it covers that did finish are still checked (`numerics.Check`)
          try:
            check()
          except Exception as found:  # pylint: disable=broad-except  # told with the error raised here
            e.add_note(f"tpustrat: an earlier step's check found this too: {found}")
        e.add_note("tpustrat: this error is a step's dispatched before this call, raised while the call waited "
                   f"for it (at most {limit} steps in flight); the step of this call was not dispatched.")
        raise
      if self._checks or self._open_key == id(oldest):
        self._check(oldest)
    if stats is None:
      return None
    now = time.perf_counter()
    stats.device_seconds += now - start
    return now if steps else None

  def _check(self, token: Any) -> None:
    """Runs the check of `token`'s program (it has finished). When it raises, the checks of the programs
    dispatched after it are dropped: they ran on its results, and the error names the first bad step."""
    check = self._take_check(id(token))
    if check is None:
      return
    try:
      check()
    except Exception:
      later = list(self._checks.values()) + ([self._open] if self._open is not None else [])
      dropped = sum(getattr(c, "size", 1) for c in later)  # dispatches each covers
      self._drop_checks()
      if dropped:
        check(dropped)  # the same error, saying how many later steps are not checked
      raise

  def _drop_checks(self) -> None:
    """Drops every check kept (they ran on a failed step's results), marked as run: none takes more
    dispatches (`numerics.Check.absorb`)."""
    for dropped in [*self._checks.values(), self._open]:
      if hasattr(dropped, "ran"):
        dropped.ran = True
    self._checks.clear()
    self._open, self._open_key = None, 0

  def _take_check(self, key: int) -> Any:
    """The check to run now that the program of token ``id == key`` has finished (None: none), out of the
    bound's keeping."""
    if key == self._open_key:
      check = self._open
      self._open, self._open_key = None, 0
      return check
    return self._checks.pop(key, None) if self._checks else None

  def after_dispatch(self, token: Any, check: Callable[..., None] | None = None, steps: int = 0,
                     now: float | None = None) -> bool:
    """Records `token`, the output of the program just dispatched to wait on (None: nothing to wait on), and
    `check`, run once it is ready. Returns False when the token is a tracer: the program was only traced,
    inside another program's trace (`experimental_run_steps`, a user's jit), and is not a program in flight.
    `steps` / `now`: `steps` training steps dispatched at `now` (`before_dispatch`'s clock reading), noted in
    `stats`; `dispatch` leaves that to the step counters' hook, this is for a caller that drives the bound
    by hand (`benchmarks/bench_run.py`)."""
    # The token is a small output of the step's program (at most 64 KiB, often a scalar loss), ready when
    # the program has finished. Holding large outputs alive would stop XLA from reusing their buffers
    # (measured: +340 us per 1 MiB step on XLA:CPU); an extra output costs every step (measured: +6.5 us
    # on a 90 us step on XLA:CPU with 8 devices), so a one-byte token is added only when nothing small
    # is computed.
    if isinstance(token, _Tracer):
      return False  # a `run` traced inside another program (`experimental_run_steps`, a user's jit)
    if token is not None:
      self._pending.append(token)
      if check is not None:
        self._checks[id(token)] = check
    if now is not None:
      assert self.stats is not None  # `before_dispatch` returns a clock reading only with `stats`
      self.stats.note_steps(steps, now)
    return True

  def add_check(self, token: Any, check: Callable[..., None]) -> None:
    """Runs `check` once the program of `token` (recorded by `after_dispatch`) has finished: when the bound
    waits for it, or `drain` (`RunOptions.check_numerics`: `numerics.StepChecks`). When the check registered
    last on this bound takes this one in (its ``absorb``: `numerics.Check`, one `run` program's consecutive
    dispatches), that one runs instead once this program has finished; checks of other programs in between
    end such a group, so checks run in dispatch order."""
    last = self._open
    if last is not None:
      absorb = getattr(last, "absorb", None)
      if absorb is not None and absorb(check):
        self._open_key = id(token)
        return
      self._checks[self._open_key] = last  # closed: it takes no more in
    self._open, self._open_key = check, id(token)

  def add_flags(self, flags: Any, checker: Any) -> None:
    """``add_check(flags, checker(flags))`` for a dispatched (not traced) checked program, its flags its
    token (`numerics.Checker`), without making a check when the open one takes the dispatch in: the same
    `run` program's next dispatch, the open check not run and holding fewer than `numerics.GROUP`."""
    outputs = checker.outputs
    if checker.copy is not False:  # `numerics.Checker.started`, written out (one call less per step)
      first = checker.started(flags)
    else:
      first = outputs.steps + 1
      outputs.calls += 1
      outputs.steps += checker.steps
    last = self._open
    if (last is not None and type(last) is _Check and last.outputs is outputs and not checker.stacked
        and not last.ran and len(last.flags) < _GROUP):
      last.flags.append(flags)
      self._open_key = id(flags)
      return
    self.add_check(flags, _Check(flags, outputs, first, outputs.calls if checker.stacked else None))

  def drain(self) -> None:
    start = time.perf_counter()
    try:
      while self._pending:
        try:
          oldest = self._pending.popleft()
        except IndexError:
          break
        _wait(oldest)
        if self._checks or self._open_key == id(oldest):
          self._check(oldest)
    finally:
      if self.stats is not None:
        self.stats.device_seconds += time.perf_counter() - start

  def forget(self, arrays: list[Any]) -> None:
    """Stops waiting on any of `arrays` (by identity): arguments about to be donated to a program
    (`RunOptions.donate_argnums`). That program cannot finish before the one that computed them, and
    its own output is waited on instead, so the bound still holds."""
    ids = {id(x) for x in arrays}
    if any(id(t) in ids for t in self._pending):
      kept = [t for t in self._pending if id(t) not in ids]
      self._pending.clear()
      self._pending.extend(kept)


def _wait(token: jax.Array) -> None:
  """Waits for a program's output (skipped if it was deleted). When the program failed, its error is
  raised here, to the caller: JAX's own record of the failure, which it would report again at exit, is
  dropped (`jax_compat.forget_failed_programs`)."""
  if not token.is_deleted():
    try:
      token.block_until_ready()
    except Exception:
      forget_failed_programs()
      raise


_PROCESS_IN_FLIGHT = InFlight()  # for programs dispatched without an engine (cross-replica reductions)


def dispatch(program: Callable[..., tuple[Any, Any]], *args: Any, in_flight: InFlight | None = None,
             limit: int | None = None, steps: int = 0,
             numerics: Callable[[Any], Callable[..., None] | None] | None = None, traced: Any = None) -> Any:
  """Calls ``program(*args)``, which returns ``(result, token)``, with at most `limit` (default
  `DEFAULT_STEPS_IN_FLIGHT`) programs in flight in `in_flight` (default: one process-wide bound);
  returns `result`. `token` is the output to wait on (see `wait_leaf`), or None for nothing. The program
  runs `steps` training steps (0 for a reduction). `numerics` (`RunOptions.check_numerics`): the token is
  the program's numerics flags, and ``numerics(token)`` the check to run once the program has finished
  (`numerics.make_check`); `traced`: the dispatching engine's `numerics.TracedChecks`. Every per-step
  concern is a hook of `STEP_HOOKS`, told of this dispatch by one `step_hooks.Step`."""
  bound = _PROCESS_IN_FLIGHT if in_flight is None else in_flight
  if default_hooks_apply():
    return dispatch_default_hooks(program, args, bound, DEFAULT_STEPS_IN_FLIGHT if limit is None else limit,
                                  steps, numerics, traced)
  # `Step(...)` without the named tuple's Python-level `__new__` (one frame less per dispatch).
  step = _make_step(Step, (getattr(program, "__name__", "step"), steps, bound, numerics, traced, args))
  hooks = STEP_HOOKS
  began = hooks.before(step)
  try:
    now = bound.before_dispatch(DEFAULT_STEPS_IN_FLIGHT if limit is None else limit, steps)
    result, token = program(*args)
  except BaseException as e:
    hooks.abort(step, began, e)
    raise
  if not bound.after_dispatch(token):
    now = None  # only traced inside another program: no steps on the devices to note
  hooks.after(step, began, token, now)
  return result


def default_hooks_apply() -> bool:
  """Whether `dispatch_default_hooks` may stand for the registry now: `STEP_HOOKS` holds the hooks it was
  made with, and no profile step mark is to be made (no profile session, nothing collecting, no mark open).
  `Engine.run`'s fast path tests the same, written out (one call less per step)."""
  return STEP_HOOKS.unchanged and not _MARK_OPEN[0] and _PROFILE[0] is None and not _collecting()


def dispatch_default_hooks(program: Callable[..., tuple[Any, Any]], args: Sequence[Any], bound: InFlight,
                           limit: int, steps: int, numerics: Callable[[Any], Callable[..., None] | None] | None,
                           traced: Any) -> Any:
  """`dispatch` with the hooks `STEP_HOOKS` was made with (none registered or removed since) and no profile
  step mark to make (no profile session, nothing collecting, no mark open): what those hooks do, written out
  in one frame, in their order. A hook's method call, the `Step` and the registry's loops cost more than the
  work itself on a dispatch-bound step (11 us of a 40 us `run` on one CPU device, against 10 us for the
  `jax.jit` call it wraps). The callers check the condition (`dispatch`, `Engine.run`); any change to the
  default hooks (`numerics.StepChecks`, `profiler.StepMarks`, `step_stats.StepCounting`,
  `watchdog.Heartbeat`) must be made here too: tests/test_step_hooks.py checks that both paths leave the same
  effects (step counters, profile step numbers, watchdog notes, checks)."""
  # numerics.StepChecks.before: errors recorded by checked programs traced inside a user's jit / scan
  if traced is not None and steps and traced.recorded and traced.one_process and not any(
      isinstance(x, _Tracer) for x in jax.tree.leaves(args)):
    traced.raise_recorded()
  # profiler.StepMarks.before, with no mark to make: count the steps
  if steps:
    _PROFILE_STEPS[0] += steps
    _MARK_OPEN[0] = True
  # watchdog.Heartbeat.before
  dog: Any = watchdog._ACTIVE  # pylint: disable=protected-access  # rebound by the watchdog: read each dispatch
  began = dog is not None and dog.dispatch_begins(steps)
  try:
    if len(bound._pending) < limit:  # pylint: disable=protected-access  # `before_dispatch`, nothing to wait for
      now = _perf_counter() if steps and bound.stats is not None else None
    else:
      now = bound.before_dispatch(limit, steps)
    result, token = program(*args)
  except BaseException:
    # the aborts, newest first: watchdog.Heartbeat, profiler.StepMarks (`step_end` of no mark and no token)
    if began:
      dog.dispatch_ends()
    if steps:
      _MARK_OPEN[0] = False
    raise
  only_traced = isinstance(token, _Tracer)  # a `run` traced inside another program: nothing dispatched
  try:
    if only_traced:
      now = None
    elif token is not None:
      bound._pending.append(token)  # pylint: disable=protected-access  # `InFlight.after_dispatch`
    # numerics.StepChecks.after
    if numerics is not None:
      if only_traced:
        numerics(token)  # hands the flags on (`numerics.collect`)
      else:
        bound.add_flags(token, numerics)
    # step_stats.StepCounting.after
    if now is not None and bound.stats is not None:
      bound.stats.note_steps(steps, now)
  finally:
    # What follows runs even when the above raised (the registry runs every hook's `after`).
    # profiler.StepMarks.after (`step_end`): the mark closes; a program only traced does not count
    if steps:
      _MARK_OPEN[0] = False
      if only_traced:
        _PROFILE_STEPS[0] -= steps
    # watchdog.Heartbeat.after
    if began and not only_traced and watchdog._ACTIVE is dog:  # pylint: disable=protected-access
      heartbeat: Any = dog  # the one that began, still the running one
      heartbeat.dispatched(token, steps)
    else:
      if began:
        dog.dispatch_ends()
      now_active = watchdog._ACTIVE  # pylint: disable=protected-access
      if now_active is not None and not only_traced:
        now_active.note(token, steps)
  return result


def dispatch_flat(program: Any, leaves: list[Any], bound: InFlight, limit: int,
                  numerics: Callable[[Any], Callable[..., None] | None] | None, traced: Any) -> Any:
  """`dispatch_default_hooks` of one training step of `program`, a `flat_program.FlatProgram`, called with
  `leaves`, arrays already placed (no tracer): `Engine.run`'s fast path. The same hooks' work in the same
  order, with the program's own call written out too (its compiled `jax.jit` over the leaves, the result
  rebuilt from the structure its trace recorded: `FlatProgram.flat`): on a dispatch-bound step each Python
  frame between the caller and `jax.jit` costs about a microsecond. tests/test_step_hooks.py checks that this
  path leaves the effects the registry leaves (its steps past the first take this path)."""
  flat = program.flat
  if flat is None:  # not traced yet, or its results fell back to `jax.jit`'s own pytrees
    return dispatch_default_hooks(program, (leaves,), bound, limit, 1, numerics, traced)
  # numerics.StepChecks.before: errors recorded by checked programs traced inside a user's jit / scan
  if traced is not None and traced.recorded and traced.one_process:
    traced.raise_recorded()
  # profiler.StepMarks.before, with no mark to make: count the step
  _PROFILE_STEPS[0] += 1
  _MARK_OPEN[0] = True
  # watchdog.Heartbeat.before
  dog: Any = watchdog._ACTIVE  # pylint: disable=protected-access  # rebound by the watchdog: read each dispatch
  began = dog is not None and dog.dispatch_begins(1)
  pending = bound._pending  # pylint: disable=protected-access
  try:
    if len(pending) < limit:  # `before_dispatch`, nothing to wait for
      now = _perf_counter() if bound.stats is not None else None
    else:
      now = bound.before_dispatch(limit, 1)
    traces = program.traces
    out = flat[0](*leaves)
    if program.traces == traces:
      _, out_tree, wait, count, reorder = flat
      if reorder is not None:  # one device: the outputs named (replicated, per-replica), back in order
        out = out[0] + out[1] if reorder is True else reorder(out[0] + out[1])
    else:  # traced meanwhile (other shapes: by this call, or another thread's)
      out_tree, wait, count, position = program.structure_after(traces, None)
      if position is not None:
        out = program.in_order(out, position)
    result = out_tree.unflatten(out if count is None else out[:count])
  except BaseException:
    # the aborts, newest first: watchdog.Heartbeat, profiler.StepMarks
    if began:
      dog.dispatch_ends()
    _MARK_OPEN[0] = False
    raise
  token = out[wait]
  pending.append(token)  # `InFlight.after_dispatch`
  try:
    # numerics.StepChecks.after
    if numerics is not None:
      bound.add_flags(token, numerics)
    # step_stats.StepCounting.after
    if now is not None:
      stats: Any = bound.stats  # a clock reading is taken only with stats
      stats.note_steps(1, now)
  finally:
    # profiler.StepMarks.after (`step_end`): the mark closes
    _MARK_OPEN[0] = False
    # watchdog.Heartbeat.after
    if began and watchdog._ACTIVE is dog:  # pylint: disable=protected-access
      heartbeat: Any = dog  # the one that began, still the running one
      heartbeat.dispatched(token, 1)
    else:
      if began:
        dog.dispatch_ends()
      now_active = watchdog._ACTIVE  # pylint: disable=protected-access
      if now_active is not None:
        now_active.note(token, 1)
  return result


def wait_leaf(out: list[Any], inputs: Sequence[Any]) -> int | None:
  """Index of the smallest output (at most `_MAX_WAIT_BYTES`) the program computes, or None.

  `out` are the outputs of the `shard_map` of the step, so an argument `fn` returns unchanged is a new
  tracer here, not one of `inputs`: on jax 0.10.2 it is not forwarded to the input's buffer either
  (the pass-through is copied into a fresh output buffer by the compiled program, which becomes ready
  when the program finishes, like every output), so choosing it is correct. The `inputs` check only
  skips a jit argument returned as is, should a future jax forward shard_map pass-throughs to the outer
  jaxpr; such an output would be the argument's own buffer, ready before the step runs.
  """
  passed = {id(x) for x in inputs}
  best, best_size = None, _MAX_WAIT_BYTES + 1
  for i, x in enumerate(out):
    if id(x) in passed:
      continue
    # math.prod, not np.prod (10 us a leaf, per dispatch); a typed PRNG key's dtype is no numpy dtype
    size = math.prod(np.shape(x)) * x.dtype.itemsize
    if size < best_size:
      best, best_size = i, size
  return best
