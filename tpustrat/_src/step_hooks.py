"""The per-step seam: what happens around each dispatch of a compiled program, in one place.

Every program that `strategy.run`, `experimental_run_steps` or a cross-device op runs goes through one
dispatch (`engine.dispatch`, `engine.in_flight`): wait for the bound on programs in flight, call the program.
Around that, per-step concerns of their own (a profile's step marks, the step counters, the step watchdog's
heartbeat, the NaN / Inf checks) each want a word. They are *hooks* here, and dispatch calls this seam only:

* `Step`: what a hook is told of one dispatch, made once per dispatch and never changed (the program's
  name, its number of training steps, the bound it counts against, ...).
* `StepHook`: one concern, with up to three methods: `before` (before the in-flight wait; what it returns
  is handed back to it), `after` (the program was dispatched: its wait token) and `abort` (it was not).
* `StepHooks`: the registry, an ordered list of hooks: `before` in order, `after` in order, `abort` in the
  reverse order. A hook that raises in `before` stops the dispatch (the hooks before it are aborted) and its
  error reaches the caller; one that raises in `after` does not stop the others, and the first error is
  raised once every hook has run.

Each concern defines its hook in its own module (`profiler.StepMarks`, `step_stats.StepCounting`,
`watchdog.Heartbeat`, `numerics.StepChecks`); the engine registers them, in that order after the checks
(`engine.in_flight.STEP_HOOKS`). This module knows no JAX and imports nothing of tpustrat: every layer can
use it.

Cost per dispatch: one `Step` (a named tuple) and one call per method a hook overrides. Against the direct
calls it replaced, a dispatch of a program that does nothing took 1.6 to 2.5 us more on a loaded 2-core
machine (5-10 us in all); `benchmarks/bench_run.py --only tiny` (a 450-1,700 us step there) did not tell
the two apart beyond its noise.

>>> class Count(StepHook):
...   def __init__(self):
...     self.seen = []
...   def after(self, step, state, token, now):
...     self.seen.append((step.name, step.steps))
>>> hooks, count = StepHooks(), Count()
>>> remove = hooks.register(count)
>>> step = Step("run_train", 1, None, None, None, ())
>>> hooks.after(step, hooks.before(step), "token", None)
>>> count.seen
[('run_train', 1)]
>>> remove(); hooks.hooks
()
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

__all__ = ["Step", "StepHook", "StepHooks"]


class Step(NamedTuple):
  """One dispatch of a compiled program, as the hooks see it (immutable; one per dispatch)."""

  name: str
  """The program's name: ``run_<fn>``, ``run_steps_<fn>``, a cross-device op's."""
  steps: int
  """The training steps it runs: 1 for `run`, ``k`` for `experimental_run_steps`, 0 for a reduction."""
  in_flight: Any
  """The bound on programs in flight it counts against (`engine.InFlight`); its ``stats`` are the
  dispatching engine's step counters (`step_stats.StepCounters`), or None."""
  numerics: Callable[[Any], Callable[..., None] | None] | None
  """`RunOptions(check_numerics=True)`: given the program's token (its flags), the check to run once it has
  finished (`numerics.make_check`); None without the option."""
  traced: Any
  """The dispatching engine's `numerics.TracedChecks` (the checks of its programs traced inside a user's
  own `jax.jit` / `lax.scan`), or None for a dispatch without an engine."""
  args: tuple[Any, ...]
  """The program's arguments (the caller's; a hook reads them and does not keep them)."""


class StepHook:
  """One per-step concern. The base class does nothing: a hook overrides the methods it needs (the
  registry calls only those)."""

  __slots__ = ()

  def __repr__(self) -> str:
    return f"{type(self).__module__}.{type(self).__qualname__}()"

  def before(self, step: Step) -> Any:
    """Before the wait for the in-flight bound. Returns the hook's state for this dispatch, handed to its
    `after` or `abort`. Raising stops the dispatch: the error reaches the caller."""
    return None

  def after(self, step: Step, state: Any, token: Any, now: float | None) -> None:
    """The program was called. `token`: its output to wait on (a tracer when it was only traced, inside
    another program's trace; None when it has none); `now`: the clock reading (`time.perf_counter`) at the
    end of the in-flight wait when the bound keeps step counters, the program runs steps and was dispatched
    (not only traced), else None."""

  def abort(self, step: Step, state: Any) -> None:
    """The program was not dispatched: a later hook's `before`, the in-flight wait (an earlier program
    failed) or the program's call raised. Called for the hooks whose `before` had run, newest first."""


def _overrides(hook: StepHook, name: str) -> bool:
  return getattr(type(hook), name) is not getattr(StepHook, name)


class StepHooks:
  """The registry of per-step hooks, in order. Registering copies the lists (rare); a dispatch reads them
  without a lock."""

  def __init__(self, hooks: Iterable[StepHook] = ()) -> None:
    self._lock = threading.Lock()
    self._initial = tuple(hooks)
    self._set(self._initial)

  def _set(self, hooks: tuple[StepHook, ...]) -> None:
    # Whether the hooks are the ones this registry was made with (none added, none removed): a dispatch
    # that knows what those do may do it written out (`engine.in_flight.dispatch_default_hooks`).
    self.unchanged = hooks == self._initial
    # One plan per change: (index, method) of the hooks that override each method. Read as one attribute by
    # each call below, so a dispatch sees one list from its `before` to its `after`.
    self._plan = (hooks,
                  tuple((i, h.before) for i, h in enumerate(hooks) if _overrides(h, "before")),
                  tuple((i, h.after) for i, h in enumerate(hooks) if _overrides(h, "after")),
                  tuple((i, h.abort) for i, h in enumerate(hooks) if _overrides(h, "abort")))

  @property
  def hooks(self) -> tuple[StepHook, ...]:
    """The registered hooks, in the order they are called."""
    return self._plan[0]

  def register(self, hook: StepHook) -> Callable[[], None]:
    """Adds `hook` after the others; returns the function that removes it."""
    if not isinstance(hook, StepHook):
      raise TypeError(f"StepHooks.register expects a StepHook, got {type(hook).__name__}: {hook!r:.100}.")
    with self._lock:
      self._set((*self._plan[0], hook))

    def remove() -> None:
      with self._lock:
        self._set(tuple(h for h in self._plan[0] if h is not hook))

    return remove

  def before(self, step: Step) -> tuple[Any, list[Any]]:
    """Calls each hook's `before`; returns what `after` / `abort` need (the hooks called, their states).
    When one raises, the hooks before it are aborted and the error propagates."""
    plan = self._plan
    states: list[Any] = [None] * len(plan[0])
    i = 0
    try:
      for i, before in plan[1]:
        states[i] = before(step)
    except BaseException as e:
      self._abort(plan, step, states, i, e)  # the hooks before the one that raised
      raise
    return plan, states

  def after(self, step: Step, began: tuple[Any, list[Any]], token: Any, now: float | None) -> None:
    """Calls each hook's `after` (`began`: what `before` returned). Every hook runs; the first error is
    raised after the last."""
    plan, states = began
    error = None
    for i, after in plan[2]:
      try:
        after(step, states[i], token, now)
      except BaseException as e:  # pylint: disable=broad-except  # raised below, once all have run
        if error is None:
          error = e
    if error is not None:
      raise error

  def abort(self, step: Step, began: tuple[Any, list[Any]], error: BaseException) -> None:
    """Calls the `abort` of every hook (`began`: what `before` returned), newest first, while `error`
    propagates; an error of an `abort` is added to `error`'s notes."""
    plan, states = began
    self._abort(plan, step, states, len(plan[0]), error)

  @staticmethod
  def _abort(plan: Any, step: Step, states: list[Any], stop: int, error: BaseException) -> None:
    for i, abort in reversed(plan[3]):
      if i >= stop:  # its `before` did not run
        continue
      try:
        abort(step, states[i])
      except Exception as e:  # pylint: disable=broad-except  # the dispatch's own error goes on
        error.add_note(f"tpustrat: the step hook {plan[0][i]!r} failed too, while the dispatch was stopped: "
                       f"{e!r}")
