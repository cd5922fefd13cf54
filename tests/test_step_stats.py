"""Step statistics (`strategy.experimental_step_stats()`), the input-bound warning and the retracing warning.

The slow sources sleep per element: the data source is the thing under test (a pipeline slower than the
step). Nothing here sleeps to make a test pass; the counters are compared with what was measured around
the sleeps, not with hard-coded times.
"""

from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat
from tpustrat._src import step_stats

SLEEP = 0.025  # seconds per element of the slow source: input-bound while the host's own work per step
# (dispatch) stays under SLEEP, 1.4 ms on a quiet machine and 4.7 ms with both cores busy with other work
WINDOW = 25  # steps per window of the input-bound check in these tests: > 0.5 s each with SLEEP
STEPS = 60  # > 2 windows


class SlowSource:
  """`n` batches of 16 rows; each element takes `SLEEP` seconds to make (a slow decoder), measured."""

  def __init__(self, n: int = STEPS, sleep: float = SLEEP) -> None:
    self.n, self.sleep, self.slept = n, sleep, 0.0

  def __iter__(self):
    for i in range(self.n):
      start = time.perf_counter()
      time.sleep(self.sleep)
      self.slept += time.perf_counter() - start
      yield np.full((16, 4), i, np.float32)


def step(x):
  return tpustrat.get_replica_context().all_reduce("sum", jnp.sum(x))


def heavy_step(w, x):
  h = x
  for _ in range(6):
    h = jnp.tanh(h @ w)
  return tpustrat.get_replica_context().all_reduce("sum", jnp.sum(h))


def _windowed(strategy):
  strategy.extended.experimental_input_bound_window = WINDOW
  return strategy


def _loop(strategy, source, fn=step, extra=()):
  for batch in strategy.experimental_distribute_dataset(source):
    strategy.run(fn, args=(*extra, batch))
  strategy.experimental_run_wait()


@pytest.fixture
def fresh():
  """A strategy of its own: the warnings are given once per strategy, and its counters start at zero."""
  return tpustrat.TPUStrategy()


def _check_counts(stats, source, steps):
  assert stats.steps == steps
  assert sum(r.steps for r in stats.history) == steps
  # The iterator's wait contains each element's making, so at least what the source measured around its
  # sleeps; the parts add up to at most the wall time.
  assert stats.input_seconds >= source.slept
  assert stats.input_seconds + stats.device_seconds <= stats.wall_seconds
  assert 0 <= stats.input_share <= 1 and abs(stats.input_share + stats.device_share + stats.host_share - 1) < 1e-9
  # The history holds the waits before each dispatch: all but the last call, which found the end of the data.
  assert sum(r.input_seconds for r in stats.history) <= stats.input_seconds + 1e-9
  assert sum(r.input_seconds for r in stats.history) >= source.slept
  assert all(r.seconds >= r.input_seconds + r.device_seconds for r in stats.history)


def test_a_slow_source_warns_once_naming_the_share_and_the_remedies(fresh):
  source = SlowSource()
  with pytest.warns(tpustrat.InputBoundWarning) as record:
    _loop(_windowed(fresh), source)
  assert len(record) == 1  # once, although both windows are input-bound
  message = str(record[0].message)
  assert "waited for input" in message and "%" in message
  for remedy in ("experimental_per_replica_buffer_size", "experimental_run_steps",
                 "experimental_distribute_datasets_from_function", "experimental_step_stats"):
    assert remedy in message
  assert record[0].filename == __file__  # points at the user's loop
  stats = fresh.experimental_step_stats()
  _check_counts(stats, source, STEPS)
  assert len(stats.history) == STEPS
  assert stats.input_share > 0.5
  assert str(stats).startswith(f"{STEPS} steps in ")
  with warnings.catch_warnings():  # given once per strategy: a second slow loop is quiet
    warnings.simplefilter("error", tpustrat.InputBoundWarning)
    _loop(fresh, SlowSource(WINDOW + 5))


def test_a_fast_source_does_not_warn(fresh):
  rng = np.random.default_rng(0)
  data = [rng.standard_normal((64, 128)).astype(np.float32) for _ in range(150)]
  w = rng.standard_normal((128, 128)).astype(np.float32) / 12
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _loop(fresh, data, heavy_step, (w,))
  stats = fresh.experimental_step_stats()
  assert stats.steps == 150 and len(stats.history) == 150
  assert stats.input_share < 0.5


def test_reset_and_the_warning_settings(fresh):
  source = SlowSource(30)
  fresh.extended.experimental_input_bound_threshold = None  # no warning
  assert fresh.extended.experimental_input_bound_threshold is None
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _loop(fresh, source)
  stats = fresh.experimental_step_stats(reset=True)
  _check_counts(stats, source, 30)
  after = fresh.experimental_step_stats()
  assert after.steps == 0 and after.input_seconds == 0 and after.history == ()
  # A smaller window and threshold: the warning names the window's steps.
  fresh.extended.experimental_input_bound_threshold = 0.3
  fresh.extended.experimental_input_bound_window = 27
  assert fresh.extended.experimental_input_bound_window == 27
  with pytest.warns(tpustrat.InputBoundWarning, match="over its last 27 steps"):
    _loop(fresh, SlowSource(30))
  with pytest.raises(ValueError, match="experimental_input_bound_threshold"):
    fresh.extended.experimental_input_bound_threshold = 1.5
  with pytest.raises(ValueError, match="experimental_input_bound_window"):
    fresh.extended.experimental_input_bound_window = 0


def test_run_steps_counts_k_steps_per_program_and_warns(fresh):
  source = SlowSource()
  it = iter(_windowed(fresh).experimental_distribute_dataset(source))

  def scan_step(total, x):
    return total + step(x), step(x)

  total = 0.0
  with pytest.warns(tpustrat.InputBoundWarning):
    while True:
      try:
        total, _ = fresh.experimental_run_steps(scan_step, it, 10, init=total)
      except StopIteration:
        break
  fresh.experimental_run_wait()
  stats = fresh.experimental_step_stats()
  _check_counts(stats, source, STEPS)
  assert [r.steps for r in stats.history] == [10] * (STEPS // 10)


def test_mirrored_strategy():
  strategy = _windowed(tpustrat.MirroredStrategy())
  source = SlowSource()
  with pytest.warns(tpustrat.InputBoundWarning):
    _loop(strategy, source)
  _check_counts(strategy.experimental_step_stats(), source, STEPS)


def test_device_waits_are_counted(fresh):
  """A step that keeps the devices busy: the host waits on the in-flight bound, and for the last steps in
  experimental_run_wait."""
  w = np.eye(512, dtype=np.float32)
  x = fresh.experimental_distribute_values_from_function(lambda ctx: np.ones((256, 512), np.float32))
  fresh.run(heavy_step, args=(w, x))
  fresh.experimental_run_wait()
  fresh.experimental_step_stats(reset=True)
  for _ in range(10):
    fresh.run(heavy_step, args=(w, x))
  fresh.experimental_run_wait()
  stats = fresh.experimental_step_stats()
  assert stats.steps == 10 and stats.input_seconds == 0
  assert stats.device_seconds > 0 and stats.device_seconds <= stats.wall_seconds


class _Token:
  """A program's wait token whose program has ended once `ready` is set."""

  def __init__(self, ready=False):
    self.ready = ready

  def is_ready(self):
    return self.ready

  def is_deleted(self):
    return False


class _Failed(_Token):
  """The wait token of a program that failed: asking whether it is ready raises."""

  def is_ready(self):
    raise RuntimeError("the program failed")


def test_a_transfer_made_while_a_step_runs_is_device_time():
  """The rule, on fake programs: a transfer made while a step was running is device time, whether the step
  ended during it (on XLA:CPU a large transfer is queued behind the step) or only after it (the devices
  were busy all along; and the step's token can turn ready milliseconds after a queued transfer returned,
  so its end is no witness); a transfer made while nothing ran is input."""
  counters = step_stats.StepCounters()
  running, done = _Token(), _Token(ready=True)
  counters.programs = [done, running]
  assert counters.running() == (running,)

  def blocked():  # the transfer returns when the running step ends
    running.ready = True
    return "batch"

  since = time.perf_counter()
  result, on_devices = counters.time_transfer(blocked)
  assert result == "batch" and on_devices > 0
  counters.note_input(since, on_devices)
  assert counters.device_seconds == on_devices
  assert counters.input_seconds >= 0 and counters.input_seconds + counters.device_seconds <= time.perf_counter() - since

  # A step still running when the transfer returns (its token late, or the step longer): device time too.
  late = _Token()
  counters.programs = [late]
  before = time.perf_counter()
  result, on_devices = counters.time_transfer(lambda: time.sleep(0.01) or 2)
  assert result == 2 and 0.01 <= on_devices <= time.perf_counter() - before
  assert counters.running() == (late,)  # it was never ready
  # Nothing running: input.
  counters.programs = [done]
  assert counters.time_transfer(lambda: 1) == (1, 0.0)
  counters.programs = []
  assert counters.time_transfer(lambda: 1) == (1, 0.0)
  counters.programs = None  # the default strategy: no engine
  assert counters.running() == () and counters.time_transfer(lambda: 3) == (3, 0.0)
  # A deleted or failed token counts as ended: nothing running.
  counters.programs = [_Failed()]
  assert counters.running() == () and counters.time_transfer(lambda: 4) == (4, 0.0)
  # The device part of a wait is at most the wait.
  counters.reset()
  counters.note_input(time.perf_counter(), on_devices=1e6)
  assert counters.input_seconds == 0 and 0 <= counters.device_seconds < 1


def test_a_device_bound_run_steps_loop_is_not_input_bound(fresh):
  """Issue 32: a step whose device time dominates by construction (a convolution over 512 images of 28 x 28
  per step: about 50 ms on 8 emulated devices of 2 cores) fed by an in-memory source (stacking 10 batches and
  transferring them: about 15 ms) is not input-bound. On XLA:CPU the transfer of the next 10 batches, made
  while the program before runs, waits until that program ends; that wait was counted as input (about 80%
  of the loop's time) and warned InputBoundWarning. It is device time now."""
  rng = np.random.default_rng(0)
  images = [rng.standard_normal((512, 28, 28, 1)).astype(np.float32) for _ in range(4)]
  kernel = rng.standard_normal((3, 3, 1, 8)).astype(np.float32) / 3

  def conv_step(total, x):
    h = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return total + tpustrat.get_replica_context().all_reduce("sum", jnp.sum(jnp.tanh(h))), ()

  it = iter(fresh.experimental_distribute_dataset(images * 20))
  total, _ = fresh.experimental_run_steps(conv_step, it, 10, np.float32(0))  # compiles
  fresh.experimental_run_wait()
  fresh.experimental_step_stats(reset=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error", tpustrat.InputBoundWarning)
    for _ in range(5):  # one window of 50 steps
      total, _ = fresh.experimental_run_steps(conv_step, it, 10, total)
    fresh.experimental_run_wait()
  stats = fresh.experimental_step_stats()
  assert stats.steps == 50 and [r.steps for r in stats.history] == [10] * 5
  assert stats.input_share < 0.5 and stats.input_seconds < stats.device_seconds


def test_the_summary_keeps_the_last_dispatches_only():
  counters = step_stats.StepCounters(threshold=None)
  t = 100.0
  counters.reset(t)
  for _ in range(step_stats.HISTORY + 10):
    t += 1.0
    counters.input_seconds += 0.25
    counters.note_steps(1, t)
  stats = counters.summary(t + 1.0)
  assert stats.steps == step_stats.HISTORY + 10
  assert len(stats.history) == step_stats.HISTORY
  assert all(r.seconds == 1.0 and r.input_seconds == 0.25 and r.steps == 1 for r in stats.history)
  assert stats.wall_seconds == step_stats.HISTORY + 11


# -- retracing ------------------------------------------------------------------------------------------


def test_the_sixth_compile_of_a_function_warns_naming_the_argument(fresh):
  def double(state, batch):
    return state * 2, batch["x"] + 1

  state = np.float32(1.0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for n in range(1, 6):  # five programs: quiet
      fresh.run(double, args=(state, {"x": np.ones((8, n), np.float32)}))
    fresh.run(double, args=(state, {"x": np.ones((8, 5), np.float32)}))  # no new program
  with pytest.warns(tpustrat.RetracingWarning) as record:
    fresh.run(double, args=(state, {"x": np.ones((8, 6), np.float32)}))
  assert len(record) == 1
  message = str(record[0].message)
  assert "`test_the_sixth_compile_of_a_function_warns_naming_the_argument.<locals>.double` for the 6th time" in message
  assert "the argument at args[1]['x'] changed from float32[8,5] to float32[8,6]" in message
  assert record[0].filename == __file__
  with warnings.catch_warnings():  # once per function
    warnings.simplefilter("error")
    fresh.run(double, args=(state, {"x": np.ones((8, 7), np.float32)}))


def test_the_retracing_warning_names_a_changed_structure_or_python_number(fresh):
  def add(a, b=None):
    return a + (0 if b is None else b["y"])

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for n in range(1, 6):
      fresh.run(add, args=(np.ones(n, np.float32),))
  with pytest.warns(tpustrat.RetracingWarning, match=r"the arguments changed from 1 positional and keywords \[\] "
                    r"to 1 positional and keywords \['b'\]"):
    fresh.run(add, args=(np.ones(5, np.float32),), kwargs={"b": {"y": np.float32(1)}})

  def scale(a, s):
    return a * s

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for n in range(1, 6):
      fresh.run(scale, args=(np.ones(n, np.float32), np.float32(2.0)))
  with pytest.warns(tpustrat.RetracingWarning, match=r"args\[1\] changed from float32\[\] to float32\[\] "
                    r"\(weakly typed: a Python number\)"):
    fresh.run(scale, args=(np.ones(5, np.float32), 2.0))


def test_retracing_warning_on_mirrored_strategy():
  strategy = tpustrat.MirroredStrategy()

  def f(x):
    return x * 2

  with pytest.warns(tpustrat.RetracingWarning, match=r"args\[0\] changed from float32\[5\] to float32\[6\]"):
    for n in range(1, 7):
      strategy.run(f, args=(np.ones(n, np.float32),))


# -- repeated placement ----------------------------------------------------------------------------------


def _accumulate(w, t):
  return w + jnp.sum(t)


def _double(t):
  return t * 2


def test_an_array_placed_at_every_call_warns_once_on_the_third_naming_it(fresh):
  table = np.arange(6, dtype=np.float32)
  plain = jax.device_put(table, jax.devices()[-1])  # committed to one device: copied onto all 8 per call
  w = fresh.experimental_mirror(np.float32(0.0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(2):
      w = fresh.run(_accumulate, args=(w, plain))
  with pytest.warns(tpustrat.RepeatedPlacementWarning) as record:
    w = fresh.run(_accumulate, args=(w, plain))
  assert len(record) == 1
  message = str(record[0].message)
  assert message.startswith("strategy.run(_accumulate) placed the jax.Array at args[1] (float32[6], laid out as "
                            f"{plain.sharding!r}) onto the strategy's devices (")
  assert f"over devices {[d.id for d in fresh.mesh.devices.ravel()]}) for the 3rd time" in message, message
  assert "copies it there (a jax.device_put)" in message and "strategy.experimental_mirror(x)" in message
  assert record[0].filename == __file__
  with warnings.catch_warnings():  # once per function; the placed copies still compute what numpy does
    warnings.simplefilter("error")
    w = fresh.run(_accumulate, args=(w, plain))
  np.testing.assert_allclose(np.asarray(w.values[0]),
                             4 * table.sum(), rtol=1e-6)


def test_fresh_arrays_host_arrays_and_placed_values_never_warn(fresh):
  table = np.arange(6, dtype=np.float32)
  mirrored = fresh.experimental_mirror(table)
  w = fresh.experimental_mirror(np.float32(0.0))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(5):
      w = fresh.run(_accumulate, args=(w, jax.device_put(table, jax.devices()[-1])))  # a new array each call
      w = fresh.run(_accumulate, args=(w, table))  # the same numpy array: its contents may change
      w = fresh.run(_accumulate, args=(w, mirrored))  # placed once
  np.testing.assert_allclose(np.asarray(w.values[0]), 15 * table.sum(), rtol=1e-6)


def test_an_array_renamed_on_one_device_at_every_call_warns_saying_so():
  strategy = tpustrat.MirroredStrategy(devices=jax.devices()[:1])
  plain = jnp.ones((2, 3), jnp.float32)  # on that device: its buffers renamed, not copied, per call
  with pytest.warns(tpustrat.RepeatedPlacementWarning,
                    match=r"args\[0\] \(float32\[2,3\].*renames its buffers \(they are on the right devices"):
    for _ in range(3):
      out = strategy.run(_double, args=(plain,))
  np.testing.assert_array_equal(np.asarray(out.values[0]), np.full((2, 3), 2.0, np.float32))


def test_a_per_replica_component_laid_out_by_another_mesh_is_renamed_and_warned_with_its_fix(fresh):
  mine = jax.sharding.Mesh(np.array(jax.devices()), ("data",))  # the same devices, another axis name
  stacked = np.arange(16, dtype=np.float32).reshape(8, 2)
  value = tpustrat.PerReplica.from_stacked(
      jax.device_put(stacked, jax.sharding.NamedSharding(mine, jax.sharding.PartitionSpec("data"))))
  with pytest.warns(tpustrat.RepeatedPlacementWarning) as record:
    for _ in range(3):
      out = fresh.run(_double, args=(value,))
  message = str(record[0].message)
  assert "split over the replicas" in message and "renames its buffers" in message, message
  assert "NamedSharding(strategy.mesh, PartitionSpec('replica'))" in message, message
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in out.values]), 2 * stacked)

  def triple(x):  # a function of its own: `_double` was warned for already
    return x * 3

  laid_out = tpustrat.PerReplica.from_stacked(jax.device_put(  # laid out once, as the warning says
      value.tree, jax.sharding.NamedSharding(fresh.mesh, jax.sharding.PartitionSpec("replica"))))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(4):
      out = fresh.run(triple, args=(laid_out,))
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in out.values]), 3 * stacked)
  with pytest.warns(tpustrat.RepeatedPlacementWarning):  # and as given, it would have warned
    for _ in range(3):
      fresh.run(triple, args=(value,))


def test_a_large_state_placed_at_every_call_warns_and_counts_stay_per_function(fresh):
  state = {f"w{i}": jax.device_put(np.full(2, i, np.float32), jax.devices()[-1]) for i in range(300)}

  def total(s):  # 300 plain leaves: more than any count of recent arrays would keep
    return sum(jnp.sum(v) for v in s.values())

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(2):
      fresh.run(total, args=(state,))
  with pytest.warns(tpustrat.RepeatedPlacementWarning, match=r"the jax.Array at args\[0\]\['w0'\] .* for the 3rd time"):
    out = fresh.run(total, args=(state,))
  np.testing.assert_allclose(np.asarray(out.values[0]), 2 * np.arange(300).sum(), rtol=1e-6)

  # One array given once to each of three functions: no function placed it three times.
  table = jax.device_put(np.ones(3, np.float32), jax.devices()[-1])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for f in (lambda t: t * 1, lambda t: t * 2, lambda t: t * 3):
      fresh.run(f, args=(table,))

  # One array at two positions of one call: each position counts its own calls.
  def pair(a, b):
    return a + b

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(2):
      fresh.run(pair, args=(table, table))
  with pytest.warns(tpustrat.RepeatedPlacementWarning, match=r"args\[0\] .* for the 3rd time") as record:
    fresh.run(pair, args=(table, table))
  assert len(record) == 1


def test_check_numerics_on_and_off_is_one_function_for_the_placement_warning(fresh):
  table = jax.device_put(np.ones(3, np.float32), jax.devices()[-1])
  checked = tpustrat.RunOptions(check_numerics=True)
  with pytest.warns(tpustrat.RepeatedPlacementWarning) as record:
    for options in (None, checked, None, checked, None, checked):
      fresh.run(_accumulate, args=(np.float32(0), table), options=options)
  fresh.experimental_run_wait()
  assert len([w for w in record if w.category is tpustrat.RepeatedPlacementWarning]) == 1


def test_an_array_closed_over_by_a_users_jit_is_placed_once_per_trace_and_not_warned(fresh):
  table = jax.device_put(np.ones(3, np.float32), jax.devices()[-1])
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for n in range(4):  # four traces of the user's jit (another shape each time), each placing `table`
      out = jax.jit(lambda w: fresh.run(_accumulate, args=(w, table)))(np.zeros(n + 1, np.float32))
  np.testing.assert_allclose(np.asarray(out.values[0]), np.full(4, 3.0, np.float32))


def test_placements_count_one_array_object_per_position_held_weakly():
  class Value:  # referable weakly, like a jax.Array
    pass

  placements = step_stats.Placements(limit=4)
  a, b = Value(), Value()
  said = lambda n: f"placed {n}"  # noqa: E731
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for v in (a, b, a, b):  # at position 0: another array each call, never twice in a row
      placements.placed("f", "tree", 0, v, said)
    for _ in range(2):
      placements.placed("f", "tree", 1, a, said)
    placements.placed("g", "tree", 1, a, said)  # another function: its own count
    assert not caught
    placements.placed("f", "tree", 1, a, said)  # the third time `a` is placed at position 1 by f
    placements.placed("f", "tree", 2, b, said)
    for _ in range(3):
      placements.placed("f", "tree", 3, b, said)  # f warned already
  assert [str(w.message) for w in caught] == ["placed 3"]
  assert caught[0].category is tpustrat.RepeatedPlacementWarning
  # an entry whose array is gone does not count for a new object that got its id
  c = Value()
  placements._seen[("h", "tree")] = {0: [lambda: None, 2]}  # pylint: disable=protected-access
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    placements.placed("h", "tree", 0, c, said)
    placements.placed("h", "tree", 0, c, said)


def test_describe_change_of_structures():
  a = (("args[0]['x']",), (((2,), "float32", False),), ("PyTreeDef({'x': *})",), 1, ())
  b = (("args[0]['x']", "args[0]['y']"), (((2,), "float32", False),) * 2, ("PyTreeDef({'x': *, 'y': *})",), 1, ())
  assert step_stats.describe_change(a, b) == (
      "the structure of the argument args[0] changed from PyTreeDef({'x': *}) to PyTreeDef({'x': *, 'y': *})")
  assert "no argument's structure" in step_stats.describe_change(a, a)
