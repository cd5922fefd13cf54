"""The per-step seam (`tpustrat._src.step_hooks`): every dispatch calls the registered hooks, once each, in
order, with one immutable record of the step; a hook that raises stops the dispatch (before) or surfaces
after the others ran (after)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat
from tpustrat._src import engine, numerics, profiler, step_stats, watchdog
from tpustrat._src.step_hooks import Step, StepHook, StepHooks


class Recorder(StepHook):
  """Appends ``(label, phase, step, ...)`` to a shared list for every call."""

  __slots__ = ("label", "events")

  def __init__(self, label, events):
    self.label, self.events = label, events

  def before(self, step):
    self.events.append((self.label, "before", step))
    return f"state of {self.label}"

  def after(self, step, state, token, now):
    self.events.append((self.label, "after", step, state, token, now))

  def abort(self, step, state):
    self.events.append((self.label, "abort", step, state))


class Raising(StepHook):
  __slots__ = ("phase",)

  def __init__(self, phase):
    self.phase = phase

  def before(self, step):
    if self.phase == "before":
      raise RuntimeError("hook failed before")

  def after(self, step, state, token, now):
    if self.phase == "after":
      raise RuntimeError("hook failed after")


@pytest.fixture
def registered():
  """Registers hooks on the engine's registry for one test."""
  removers = []

  def register(*hooks):
    for hook in hooks:
      removers.append(engine.STEP_HOOKS.register(hook))

  yield register
  for remove in reversed(removers):
    remove()


def test_the_engine_registers_each_concern_once_in_order():
  kinds = [type(h) for h in engine.STEP_HOOKS.hooks]
  assert kinds == [numerics.StepChecks, profiler.StepMarks, step_stats.StepCounting, watchdog.Heartbeat]


def test_run_calls_every_hook_once_per_dispatch_in_order_with_the_step(strategy, registered):
  events = []
  registered(Recorder("a", events), Recorder("b", events))
  eng = strategy.extended.engine

  def train_step(x):
    return x * 2.0

  x = jnp.ones(())
  strategy.run(train_step, args=(x,))  # compiled outside the record
  eng.wait()
  events.clear()
  steps_before = profiler.steps_dispatched()
  counted = eng.step_stats.steps
  out = strategy.run(train_step, args=(x,))
  assert [(e[0], e[1]) for e in events] == [("a", "before"), ("b", "before"), ("a", "after"), ("b", "after")]
  step = events[0][2]
  assert all(e[2] is step for e in events)  # one record per dispatch, handed to every hook
  assert isinstance(step, Step)
  assert step.name == "run_train_step" and step.steps == 1
  assert step.in_flight is eng.in_flight and step.traced is eng.traced_numerics
  assert step.numerics is None and len(step.args) == 1  # the program's one argument: the flat leaves
  (leaf,) = step.args[0]
  assert isinstance(leaf, jax.Array) and float(leaf) == 1.0  # `x`, placed on the mesh
  with pytest.raises(AttributeError):
    step.steps = 2  # immutable
  _, _, _, state, token, now = events[2]
  assert state == "state of a" and events[3][3] == "state of b"  # each hook gets its own state back
  assert isinstance(token, jax.Array) and token.size * token.dtype.itemsize <= 64 * 1024  # the wait token
  assert isinstance(now, float)  # the counters are on: the clock reading at the end of the in-flight wait
  # The built-in hooks ran too: the profiler counted the step, the counters noted it.
  assert profiler.steps_dispatched() == steps_before + 1
  assert eng.step_stats.steps == counted + 1
  np.testing.assert_allclose(out.values[0], 2.0)


def test_run_steps_and_check_numerics_are_in_the_record(strategy, registered):
  events = []
  registered(Recorder("a", events))

  def add(carry, batch):
    return carry + batch["x"], carry

  carry, _ = strategy.experimental_run_steps(add, {"x": jnp.ones((3,))}, None, jnp.zeros(()))  # 3 steps, stacked
  np.testing.assert_allclose(carry.values[0], 3.0)
  # The first call traces the scan while it is called: the `run` inside is a dispatch of its own, only traced
  # (a tracer token, no clock), nested in the program's.
  assert [e[1] for e in events] == ["before", "before", "after", "after"]
  (_, _, step), (_, _, same, _, token, now) = events[0], events[3]
  assert step is same and step.name == "run_steps_add" and step.steps == 3
  assert step.numerics is None and isinstance(token, jax.Array) and not isinstance(token, jax.core.Tracer)
  assert isinstance(now, float)
  inner = events[2]
  assert inner[2] is events[1][2] and inner[2].steps == 1 and isinstance(inner[4], jax.core.Tracer)
  assert inner[5] is None
  events.clear()
  strategy.experimental_run_steps(add, {"x": jnp.ones((3,))}, None, carry)  # compiled: one dispatch
  assert [(e[0], e[1], e[2].steps) for e in events] == [("a", "before", 3), ("a", "after", 3)]
  events.clear()
  strategy.run(lambda x: x + 1.0, args=(jnp.ones(()),), options=tpustrat.RunOptions(check_numerics=True))
  step = events[0][2]
  assert step.steps == 1 and callable(step.numerics)
  strategy.experimental_run_wait()


def test_a_program_dispatched_without_an_engine_counts_no_steps(registered):
  events = []
  registered(Recorder("a", events))

  def reduction(x):
    y = x + 1
    return y, y

  out = engine.dispatch(reduction, jnp.ones(()))
  np.testing.assert_allclose(out, 2.0)
  (_, _, step), (_, _, _, _, token, now) = events
  assert step.name == "reduction" and step.steps == 0 and step.traced is None
  assert isinstance(step.in_flight, engine.InFlight) and step.in_flight is not None
  assert now is None  # no steps: nothing for the counters
  assert token is out


def test_a_run_traced_inside_jit_hands_the_hooks_a_tracer_and_no_clock(strategy, registered):
  events = []
  registered(Recorder("a", events))
  counted = strategy.extended.engine.step_stats.steps

  @jax.jit
  def outer(x):
    return strategy.run(lambda v: v * 3.0, args=(x,)).values[0]

  outer(jnp.ones(()))
  (_, _, step), (_, _, _, _, token, now) = events
  assert step.steps == 1 and isinstance(token, jax.core.Tracer) and now is None
  assert strategy.extended.engine.step_stats.steps == counted  # traced, not dispatched: not a step


def test_a_hook_that_raises_before_stops_the_dispatch_and_aborts_the_hooks_before_it(strategy, registered):
  events = []
  registered(Recorder("a", events), Raising("before"), Recorder("c", events))
  calls = []

  def fn(x):
    calls.append(1)
    return x

  steps_before = profiler.steps_dispatched()
  with pytest.raises(RuntimeError, match="hook failed before"):
    strategy.run(fn, args=(jnp.ones(()),))
  assert [(e[0], e[1]) for e in events] == [("a", "before"), ("a", "abort")]  # c never began
  assert events[1][3] == "state of a"
  assert calls == []  # not even traced: the program was not called
  # The profiler's mark was closed by its abort: the next step counts and marks as usual.
  assert profiler.steps_dispatched() == steps_before + 1  # counted when it began, as a wait that raised
  events.clear()


def test_a_hook_that_raises_after_surfaces_once_every_hook_ran(strategy, registered):
  events = []
  registered(Raising("after"), Recorder("b", events))
  with pytest.raises(RuntimeError, match="hook failed after"):
    strategy.run(lambda x: x + 1.0, args=(jnp.ones(()),))
  assert [(e[0], e[1]) for e in events] == [("b", "before"), ("b", "after")]  # b's after ran anyway
  strategy.experimental_run_wait()  # the program was dispatched and is waited for as usual


def test_a_program_that_raises_aborts_every_hook_newest_first(registered):
  events = []
  registered(Recorder("a", events), Recorder("b", events))

  def failing():
    raise ValueError("the program failed")

  with pytest.raises(ValueError, match="the program failed"):
    engine.dispatch(failing)
  assert [(e[0], e[1]) for e in events] == [("a", "before"), ("b", "before"), ("b", "abort"), ("a", "abort")]


# -- the registry alone (no JAX) ----------------------------------------------------------------------


def test_registry_order_removal_and_errors():
  events = []
  hooks = StepHooks([Recorder("a", events)])
  remove_b = hooks.register(Recorder("b", events))
  step = Step("p", 2, None, None, None, ())
  began = hooks.before(step)
  hooks.after(step, began, "t", 1.5)
  assert [(e[0], e[1]) for e in events] == [("a", "before"), ("b", "before"), ("a", "after"), ("b", "after")]
  assert events[2][3:] == ("state of a", "t", 1.5)
  remove_b()
  assert [h.label for h in hooks.hooks] == ["a"]
  with pytest.raises(TypeError, match="expects a StepHook"):
    hooks.register(lambda step: None)

  class FailingAbort(StepHook):
    def abort(self, step, state):
      raise KeyError("abort broke")

  hooks.register(FailingAbort())
  error = RuntimeError("dispatch failed")
  events.clear()
  hooks.abort(step, hooks.before(step), error)
  assert [(e[0], e[1]) for e in events] == [("a", "before"), ("a", "abort")]  # a still aborted
  assert any("abort broke" in note for note in error.__notes__)


def test_hooks_without_before_or_after_are_not_called():
  calls = []

  class AfterOnly(StepHook):
    def after(self, step, state, token, now):
      calls.append(("after", state))

  hooks = StepHooks([AfterOnly()])
  step = Step("p", 1, None, None, None, ())
  began = hooks.before(step)
  assert began[1] == [None]
  hooks.after(step, began, None, None)
  hooks.abort(step, began, RuntimeError())
  assert calls == [("after", None)]


class _Nothing(StepHook):
  """Registered, it changes the registry, so dispatch calls each hook (a hook that does nothing itself)."""

  __slots__ = ()

  def after(self, step, state, token, now):
    return None


def _effects(strategy, run_steps, x, nan_at):
  """Runs `run_steps` checked steps of a step that turns NaN at step `nan_at` under a fresh watchdog; returns
  what the default hooks leave: the step counters, the profile's step count, the watchdog's notes, and the
  NumericsError's text."""
  dog = watchdog.Watchdog(3600.0)
  previous = watchdog.activate(dog)
  counters = strategy.extended.step_counters
  steps_before, profile_before = counters.steps, profiler.steps_dispatched()
  options = tpustrat.RunOptions(check_numerics=True)
  error = None

  def step(w, v, poison):  # a function of its own: its checked program counts steps from 1
    ctx = tpustrat.get_replica_context()
    return w * 0.5 + poison, ctx.all_reduce("sum", v * w)

  from tpustrat._src.engine import engine as engine_lib  # noqa: PLC0415
  real, fast = engine_lib.dispatch_flat, []

  def counted(*args, **kwargs):
    fast.append(1)
    return real(*args, **kwargs)

  engine_lib.dispatch_flat = counted
  try:
    w = jnp.float32(1.0)
    for i in range(run_steps):
      # A Python float (no array to place): from the second step on, `run`'s fast path can take the call
      w, _ = strategy.run(step, args=(w, x, float(np.nan) if i == nan_at else 0.0), options=options)
    strategy.experimental_run_wait()
  except tpustrat.NumericsError as e:
    error = str(e)
  finally:
    engine_lib.dispatch_flat = real
    watchdog.activate(previous)
    dog.stop()
  return (counters.steps - steps_before, profiler.steps_dispatched() - profile_before, dog.steps,
          None if dog._last is None else dog._last[0], len(dog._recent), error), len(fast)


def test_the_default_hooks_written_out_leave_what_the_registry_leaves(strategy, registered):
  """`engine.in_flight.dispatch_default_hooks` (taken while the registry holds the engine's own hooks only)
  does what those hooks do: the same step counters, profile step numbers, watchdog notes and NaN report as
  a dispatch through the registry (taken once any other hook is registered)."""
  x = strategy.experimental_distribute_values_from_function(lambda c: jnp.float32(c.replica_id_in_sync_group))
  steps = numerics.GROUP + 4  # step 5's group (steps 1 .. GROUP) is read by call GROUP + 2, which raises
  written_out, fast = _effects(strategy, steps, x, nan_at=4)
  assert fast >= numerics.GROUP - 1  # the written-out calls past the second took `run`'s fast path (`dispatch_flat`)
  assert engine.STEP_HOOKS.unchanged
  registered(_Nothing())
  assert not engine.STEP_HOOKS.unchanged
  through_registry, fast = _effects(strategy, steps, x, nan_at=4)
  assert fast == 0  # a hook registered: every call through the registry
  assert written_out == through_registry
  error = written_out[-1]
  # Steps 1 .. GROUP + 1 dispatched; the bound's wait before step GROUP + 2 ran the check of steps 1 .. GROUP,
  # which raised: that step was begun (the profile counts it, as `StepMarks` does) and not dispatched (not
  # counted, not noted).
  group = numerics.GROUP
  assert written_out[:4] == (group + 1, group + 2, group + 1, group + 1)
  assert "step 5" in error, error  # the fifth step (index 4) made the NaN


def test_a_dispatch_of_the_default_hooks_that_fails_leaves_no_mark_open(strategy):
  """A program that raises on the written-out path aborts as the hooks do: no profile mark left open, the
  watchdog's dispatch ended, nothing pending; the next step is counted again."""
  dog = watchdog.Watchdog(3600.0)
  previous = watchdog.activate(dog)
  try:
    def bad(v):
      raise ValueError("the step's own error")

    with pytest.raises(ValueError, match="the step's own error"):
      strategy.run(bad, args=(jnp.float32(1.0),))
    assert profiler.OPEN == [False] and dog._dispatching is None
    before = profiler.steps_dispatched()
    out = strategy.run(lambda v: v + 1.0, args=(jnp.float32(2.0),))
    assert profiler.steps_dispatched() == before + 1
    assert np.asarray(strategy.experimental_local_results(out)[0]) == np.float32(3.0)

    # On `run`'s fast path (`dispatch_flat`): placed arguments, then other shapes whose trace raises.
    def wide_only(v):
      if v.shape[-1] != 2:
        raise ValueError("the step's own error, traced on the fast path")
      return v * 2.0

    x2, x3 = (strategy.experimental_mirror(np.ones(w, np.float32)) for w in (2, 3))
    strategy.run(wide_only, args=(x2,))
    strategy.run(wide_only, args=(x2,))
    with pytest.raises(ValueError, match="traced on the fast path"):
      strategy.run(wide_only, args=(x3,))
    assert profiler.OPEN == [False] and dog._dispatching is None
    out = strategy.run(wide_only, args=(x2,))
    np.testing.assert_array_equal(np.asarray(strategy.experimental_local_results(out)[0]), [2.0, 2.0])
  finally:
    watchdog.activate(previous)
    dog.stop()
