"""`RunOptions(check_numerics=True)`: NaN / Inf in a step's floating outputs, found in the compiled program
and raised on the host as `tpustrat.NumericsError`, naming the step, the output's path and the replicas (and
processes) that produced it.

The error of step ``t`` is raised by the call that waits for it: with the default bound of 2 steps in
flight, the `run` call ``t + 2`` (before it dispatches), or `experimental_run_wait`. A `run` traced inside
the caller's own `jax.jit` / `lax.scan` records its flags by a host callback per execution; the error is
raised by `experimental_run_wait` (or, in one process, the next eager `run`). The launched tests run
`tests/_mp_scripts/numerics_nan.py` and `numerics_traced.py` as 2 processes x 4 CPU devices on loopback, the
NaN made on a replica of process 1: both processes raise the same error at the same call.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import launched_results

import tpustrat
from tpustrat import PerReplica, ShardedVariable
from tpustrat._src import numerics as numerics_lib

N = 8
CHECK = tpustrat.RunOptions(check_numerics=True)
SCRIPT = pathlib.Path(__file__).resolve().parent / "_mp_scripts" / "numerics_nan.py"


def per_replica(strategy, values):
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: np.asarray(values[ctx.replica_id_in_sync_group], np.float32))


def log_step(w, x):
  """`log(x)` per replica, and `w` plus its sum over replicas (Mirrored)."""
  y = jnp.log(x)
  return {"w": w + tpustrat.get_replica_context().all_reduce("sum", jnp.sum(y)), "y": y}


def _nan_at_step_2_on_replica_3(e):
  """Checks the error's fields for `log_step`'s NaN (step 2, replica 3: `y` per replica, `w` everywhere);
  returns its message."""
  assert e.step == 2 and e.inner_step is None
  assert e.replicas == (3,) and e.processes == (0,)
  assert ("['y']", "PerReplica", (3,), True, False) in e.outputs
  assert ("['w']", "Mirrored", tuple(range(N)), True, False) in e.outputs
  return str(e)


@pytest.mark.filterwarnings("ignore::tpustrat.RepeatedPlacementWarning")  # plain arrays: the checked path
def test_nan_on_replica_3_of_8_names_the_replica_the_path_and_the_step(strategy):
  good = per_replica(strategy, [np.full(4, 2.0)] * N)
  bad = per_replica(strategy, [np.full(4, -1.0) if r == 3 else np.full(4, 2.0) for r in range(N)])
  w = jnp.zeros(())
  out = strategy.run(log_step, args=(w, good), options=CHECK)  # step 1: fine
  out = strategy.run(log_step, args=(w, bad), options=CHECK)  # step 2: NaN on replica 3
  assert isinstance(out["y"], PerReplica)  # its results are returned; the check comes later
  # Steps 1 .. GROUP are read together once step GROUP has finished: the call that waits for it (2 steps
  # in flight: call GROUP + 2) raises and dispatches nothing; the calls before it return their results.
  for _ in range(numerics_lib.GROUP - 1):  # steps 3 .. GROUP + 1
    strategy.run(log_step, args=(w, good), options=CHECK)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.run(log_step, args=(w, good), options=CHECK)  # waits for step GROUP: raises
  e = info.value
  assert isinstance(e, FloatingPointError)
  message = _nan_at_step_2_on_replica_3(e)
  assert "step 2 (call 2 of strategy.run(log_step)" in message
  assert "['y']: NaN in a PerReplica value, on replica 3 (process 0)" in message
  assert "['w']: NaN in a Mirrored value (the same on every replica)" in message
  # steps 3 .. GROUP + 1 ran on its results: their checks are dropped
  assert f"{numerics_lib.GROUP - 1} step(s) dispatched after it" in message
  strategy.experimental_run_wait()  # nothing left to report
  strategy.run(log_step, args=(w, good), options=CHECK)
  strategy.experimental_run_wait()


@pytest.mark.filterwarnings("ignore::tpustrat.RepeatedPlacementWarning")  # plain arrays: the checked path
def test_inf_is_named_and_experimental_run_wait_raises_it(strategy):
  def step(x):
    return 1.0 / x, x * 2.0  # Inf where x is 0

  x = per_replica(strategy, [0.0 if r == 5 else 1.0 for r in range(N)])
  strategy.run(step, args=(x,), options=CHECK)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  e = info.value
  assert e.step == 1 and e.replicas == (5,)
  assert e.outputs == [("[0]", "PerReplica", (5,), False, True)]
  assert "[0]: Inf in a PerReplica value, on replica 5 (process 0)" in str(e)


def test_nan_and_inf_in_one_output(strategy):
  x = per_replica(strategy, [np.array([0.0, -1.0]) if r == 1 else np.ones(2) for r in range(N)])
  strategy.run(lambda v: jnp.log(v), args=(x,), options=CHECK)  # log(0) = -inf, log(-1) = nan
  with pytest.raises(tpustrat.NumericsError, match=r"<root>: NaN and Inf in a PerReplica value, on replica 1 "):
    strategy.experimental_run_wait()


def test_a_complex_element_that_is_nan_and_inf_reports_both(strategy):
  """A complex element can be NaN in one part and Inf in the other: both are reported, as numpy finds
  them, in a small output and in one large enough to be checked a part per replica."""
  for size in (2, 5000):
    z = np.ones(size, np.complex64)
    z[size - 1] = complex(np.nan, np.inf)
    strategy.run(lambda p: p * 1.0, args=(z,), options=CHECK)
    with pytest.raises(tpustrat.NumericsError) as info:
      strategy.experimental_run_wait()
    assert info.value.outputs == [("<root>", "Mirrored", tuple(range(N)), bool(np.isnan(z).any()),
                                   bool(np.isinf(z).any()))]


def test_a_mirrored_output_names_every_replica(strategy):
  big = np.ones(5000, np.float32)  # large enough that each replica checks a 1/8 slice
  big[4999] = np.inf  # in the last replica's slice only

  def step(p, s):
    return {"p": p * 1.0, "s": s + 0.0}

  strategy.run(step, args=(big, np.float32(np.nan)), options=CHECK)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  e = info.value
  assert e.replicas == () and e.processes == (0,)
  assert sorted(e.outputs) == [("['p']", "Mirrored", tuple(range(N)), False, True),
                               ("['s']", "Mirrored", tuple(range(N)), True, False)]
  big[4999] = 1.0
  big[0] = np.nan  # in the first replica's slice
  strategy.run(step, args=(big, np.float32(1)), options=CHECK)
  with pytest.raises(tpustrat.NumericsError, match=r"\['p'\]: NaN in a Mirrored value"):
    strategy.experimental_run_wait()


@pytest.mark.parametrize("shape", [(1000, 7), (3, 2000), (4100,)])
def test_every_element_of_a_large_mirrored_output_is_checked(strategy, shape):
  """A `Mirrored` output large enough that each replica checks a part (split by rows where there are at
  least as many as replicas, else flattened): a NaN or Inf anywhere (first and last element, each side of
  a part's edge) is found, named as numpy finds it."""
  size = int(np.prod(shape))
  chunk = -(-(shape[0] if shape[0] >= N else size) // N)
  stride = size // shape[0] if shape[0] >= N else 1  # elements per part's unit (a row, or one element)
  for flat_index in sorted({0, chunk * stride - 1, chunk * stride, size // 2, size - 1}):
    big = np.ones(size, np.float32)
    big[flat_index] = np.inf if flat_index % 2 else np.nan
    big = big.reshape(shape)
    strategy.run(lambda p: p * 1.0, args=(big,), options=CHECK)
    with pytest.raises(tpustrat.NumericsError) as info:
      strategy.experimental_run_wait()
    nan, inf = bool(np.isnan(big).any()), bool(np.isinf(big).any())
    assert info.value.outputs == [("<root>", "Mirrored", tuple(range(N)), nan, inf)], (shape, flat_index)
  strategy.run(lambda p: p * 1.0, args=(np.ones(shape, np.float32),), options=CHECK)
  strategy.experimental_run_wait()  # nothing set: nothing raised


def test_a_sharded_variable_output_names_the_replica_of_the_bad_block(strategy):
  state = strategy.experimental_shard({"w": np.ones((16, 4), np.float32)},
                                      tpustrat.MinSizePartitioner(min_shard_bytes=64))
  assert isinstance(state["w"], ShardedVariable)

  def step(s):
    w = s["w"]
    rid = tpustrat.get_replica_context().replica_id_in_sync_group
    block = jnp.where(rid == 6, jnp.sqrt(-w.block), w.block)  # NaN in replica 6's block (rows 12..13)
    return {"w": tpustrat.LocalShard(block, w.shape, w.axis)}

  out = strategy.run(step, args=(state,), options=CHECK)
  assert isinstance(out["w"], ShardedVariable)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  assert info.value.outputs == [("['w']", "ShardedVariable", (6,), True, False)]
  assert "['w']: NaN in a ShardedVariable value, on replica 6 (process 0)" in str(info.value)


def test_a_sharded_variables_padding_rows_are_not_checked(strategy):
  # [3, 2] on 8 replicas: replicas 3..7 hold only padding rows (zeros as placed); log() makes them -inf,
  # but the value (log 2 everywhere) is finite: no error. A real Inf in the value is still found.
  state = strategy.experimental_shard({"w": np.full((3, 2), 2.0, np.float32)}, lambda *_: 0)
  out = strategy.run(lambda s: jax.tree.map(jnp.log, s), args=(state,), options=CHECK)
  strategy.experimental_run_wait()
  np.testing.assert_allclose(np.asarray(out["w"]), np.log(np.full((3, 2), 2.0)), rtol=1e-6)
  zero = strategy.experimental_shard({"w": np.array([[2.0, 0.0], [2.0, 2.0], [2.0, 2.0]], np.float32)},
                                     lambda *_: 0)
  strategy.run(lambda s: jax.tree.map(jnp.log, s), args=(zero,), options=CHECK)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  assert info.value.outputs == [("['w']", "ShardedVariable", (0,), False, True)]


def test_experimental_run_steps_names_the_inner_step(strategy):
  def step(total, x):
    y = jnp.log(x)
    return total + tpustrat.get_replica_context().all_reduce("sum", jnp.sum(y)), y

  xs = np.ones((8, N, 2), np.float32)
  batches = tpustrat.stack_steps([per_replica(strategy, xs[i]) for i in range(8)])
  total, outs = strategy.experimental_run_steps(step, batches, init=0.0, options=CHECK)  # call 1: fine
  xs[4, 3] = -1.0  # inner step 5 of 8, replica 3
  bad = tpustrat.stack_steps([per_replica(strategy, xs[i]) for i in range(8)])
  strategy.experimental_run_steps(step, bad, init=total, options=CHECK)  # call 2
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  e = info.value
  assert e.step == 13 and e.inner_step == 5 and e.replicas == (3,)
  assert ("output", "PerReplica", (3,), True, False) in e.outputs
  assert ("carry", "Mirrored", tuple(range(N)), True, False) in e.outputs
  assert "step 13 (inner step 5 of 8 of experimental_run_steps(step)'s call 2" in str(e)
  # Unchecked, the same program without the option runs on.
  strategy.experimental_run_steps(step, bad, init=total)
  strategy.experimental_run_wait()


def test_run_inside_a_users_jit_raises_at_experimental_run_wait(strategy):
  good = per_replica(strategy, [np.full(4, 2.0)] * N)
  bad = per_replica(strategy, [np.full(4, -1.0) if r == 3 else np.full(4, 2.0) for r in range(N)])
  outer = jax.jit(lambda s, b: strategy.run(log_step, args=(s, b), options=CHECK))
  w = strategy.experimental_mirror(jnp.zeros(()))
  outer(w, good)
  strategy.experimental_run_wait()  # execution 1: clean, nothing raised
  out = outer(w, bad)  # execution 2: NaN on replica 3
  assert isinstance(out["y"], PerReplica)  # the outer program's results come back; the check comes later
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()  # waits for the program's host callback, then raises
  e = info.value
  message = _nan_at_step_2_on_replica_3(e)
  assert "strategy.run(log_step) with RunOptions(check_numerics=True), traced inside another program" in message
  assert "its 2nd execution produced non-finite values" in message
  assert "['y']: NaN in a PerReplica value, on replica 3 (process 0)" in message
  assert "The outer program's results were already returned" in message
  strategy.experimental_run_wait()  # reported once
  outer(w, good)
  strategy.experimental_run_wait()


def test_run_inside_a_users_scan_names_the_execution(strategy):
  x = per_replica(strategy, [np.full(2, 2.0)] * N)

  def step(total, v, i, bad_at):
    rid = tpustrat.get_replica_context().replica_id_in_sync_group
    y = jnp.log(jnp.where((i == bad_at) & (rid == 3), -1.0, v))  # NaN on replica 3 at iteration bad_at
    return total + 1.0, y

  @jax.jit
  def loop(total, v, bad_at):
    def body(t, i):
      return strategy.run(step, args=(t, v, i, bad_at), options=CHECK)

    return jax.lax.scan(body, total, jnp.arange(1, 6))  # 5 iterations, i = 1..5

  total = strategy.experimental_mirror(jnp.zeros(()))
  total, ys = loop(total, x, 3)  # executions 1..5: the 3rd is bad
  assert len(tpustrat.unstack_steps(ys)) == 5  # the scan's results come back
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  e = info.value
  assert e.step == 3 and e.replicas == (3,)
  assert e.outputs == [("[1]", "PerReplica", (3,), True, False)]  # the total (Mirrored) stays finite
  assert "its 3rd execution produced non-finite values" in str(e)
  assert "later bad execution" not in str(e)
  total, _ = loop(total, x, 0)  # executions 6..10: clean
  strategy.experimental_run_wait()
  loop(total, x, 2)  # executions 11..15: the 12th is bad
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  assert info.value.step == 12 and "its 12th execution" in str(info.value)


def test_a_recorded_error_is_raised_by_the_next_eager_run(strategy):
  bad = per_replica(strategy, [np.nan if r == 1 else 1.0 for r in range(N)])

  def double(v):
    return v * 2.0

  jax.jit(lambda v: strategy.run(double, args=(v,), options=CHECK))(bad)
  jax.effects_barrier()  # the outer program's callback has run: the error is recorded
  with pytest.raises(tpustrat.NumericsError, match=r"its 1st execution produced .*\n  <root>: NaN in a PerReplica "
                     r"value, on replica 1 \(process 0\)"):
    strategy.run(double, args=(per_replica(strategy, [1.0] * N),))  # one process: the next step dispatch raises it
  strategy.experimental_run_wait()  # reported once


def test_experimental_run_steps_inside_a_users_jit_names_the_inner_step(strategy):
  def step(total, x):
    return total + 1.0, jnp.sqrt(x)

  xs = np.ones((4, N), np.float32)
  xs[2, 5] = -1.0  # inner step 3 of 4, replica 5
  batches = tpustrat.stack_steps([per_replica(strategy, xs[i]) for i in range(4)])
  outer = jax.jit(lambda c, b: strategy.experimental_run_steps(step, b, init=c, options=CHECK))
  outer(strategy.experimental_mirror(jnp.zeros(())), batches)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  e = info.value
  assert e.step == 3 and e.inner_step == 3 and e.replicas == (5,)
  assert e.outputs == [("output", "PerReplica", (5,), True, False)]
  assert "inner step 3 of 4 of its 1st execution" in str(e)


def test_mirrored_strategy_inside_a_users_jit(strategy):
  del strategy
  mirrored = tpustrat.MirroredStrategy(jax.devices()[:4])
  x = mirrored.experimental_distribute_values_from_function(
      lambda ctx: np.float32(-1.0 if ctx.replica_id_in_sync_group == 2 else 1.0))
  jax.jit(lambda v: mirrored.run(jnp.sqrt, args=(v,), options=CHECK))(x)
  with pytest.raises(tpustrat.NumericsError, match=r"<root>: NaN in a PerReplica value, on replica 2 \(process 0\)"):
    mirrored.experimental_run_wait()
  mirrored.experimental_run_wait()


def test_mirrored_strategy(strategy):
  del strategy
  mirrored = tpustrat.MirroredStrategy(jax.devices()[:4])
  x = mirrored.experimental_distribute_values_from_function(
      lambda ctx: np.float32(-1.0 if ctx.replica_id_in_sync_group == 2 else 1.0))
  mirrored.run(lambda v: jnp.sqrt(v), args=(x,), options=CHECK)
  with pytest.raises(tpustrat.NumericsError, match=r"<root>: NaN in a PerReplica value, on replica 2 \(process 0\)"):
    mirrored.experimental_run_wait()


def test_padding_rows_of_a_partial_batch_are_not_checked(strategy):
  data = np.ones((20, 3), np.float32)  # 20 rows over 8 replicas: a padded batch of 3 rows per replica
  dist = strategy.experimental_distribute_dataset([data])
  batch = next(iter(dist))

  def step(x):
    return tpustrat.per_example(jnp.log(jnp.sum(x, axis=1)))  # padding rows are 0: log 0 = -inf

  out = strategy.run(step, args=(batch,), options=CHECK)
  strategy.experimental_run_wait()
  assert np.all(np.isfinite(np.concatenate([np.asarray(c) for c in strategy.experimental_local_results(
      strategy.gather(out, axis=0))])))


@pytest.mark.parametrize("move", [
    pytest.param(lambda x: jnp.flip(x, 0), id="flip"),
    pytest.param(lambda x: jnp.roll(x, 1, axis=0), id="roll"),
    pytest.param(lambda x: jnp.take(x, jnp.array([1, 0]), axis=0), id="take"),
    pytest.param(lambda x: jnp.sort(x, axis=0), id="sort"),
])
def test_a_nan_the_step_moved_into_a_padding_slot_is_found(strategy, move):
  # 13 rows over 8 replicas, 2 per replica: replica 6 holds row 12 and one padding row, replica 7 only padding.
  data = np.ones((13, 2), np.float32)
  data[12, 1] = np.nan  # replica 6's first (and only real) row
  batch = next(iter(strategy.experimental_distribute_dataset([data])))
  with pytest.warns(tpustrat.BatchRowsWarning, match="cannot be traced"):
    out = strategy.run(lambda x: move(x), args=(batch,), options=CHECK)  # moves replica 6's row 0 to row 1
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  e = info.value
  assert e.replicas == (6,) and e.outputs == [("<root>", "PerReplica", (6,), True, False)]
  message = str(e)
  assert "could not be traced to the argument at [0][0]" in message
  assert "only in rows past the real rows" in message and "tpustrat.per_example(x, batch=...)" in message
  del out


def test_padding_rows_are_skipped_where_the_rows_are_traced_in_place(strategy):
  # The same batch, rows kept in place (elementwise): the padding row's log(0) = -inf is not reported.
  data = np.ones((13, 2), np.float32)
  zeros = tpustrat.InputOptions(experimental_padding="zeros")  # padding rows of zeros: log(0) = -inf there
  batch = next(iter(strategy.experimental_distribute_dataset([data], zeros)))
  out = strategy.run(lambda x: jnp.log(x), args=(batch,), options=CHECK)
  strategy.experimental_run_wait()
  held = np.asarray(out.tree)[7]  # replica 7's component as it holds it (its local result has no real row)
  assert held.shape == (2, 2) and np.isneginf(held).all()


@pytest.mark.filterwarnings("ignore::tpustrat.RepeatedPlacementWarning")  # plain arrays: the checked path
def test_off_is_the_same_program_and_cache_entry(strategy):
  engine = strategy.extended.engine
  x = per_replica(strategy, [1.0] * N)
  w = jnp.zeros(())

  def step(w, x):
    return log_step(w, x)

  def new_entries(options):
    before = set(engine._entries)  # pylint: disable=protected-access
    strategy.run(step, args=(w, x), options=options)
    strategy.experimental_run_wait()
    return set(engine._entries) - before  # pylint: disable=protected-access

  new_none = new_entries(None)
  assert len(new_none) == 1
  (key,) = new_none
  program = engine._entries[key][0]  # pylint: disable=protected-access
  assert not new_entries(tpustrat.RunOptions(check_numerics=False))  # the same cache entry
  assert not new_entries(tpustrat.RunOptions())
  new_on = new_entries(CHECK)
  assert len(new_on) == 1  # a program of its own
  checked = engine._entries[next(iter(new_on))][0]  # pylint: disable=protected-access
  leaves = jax.tree.leaves(((w, x), {}))
  placed = [engine._place(v, t) for v, t in zip(leaves, engine._entries[key][1])]  # pylint: disable=protected-access
  off_text = program._flat.lower(*placed).as_text()  # pylint: disable=protected-access
  on_text = checked._flat.lower(*placed).as_text()  # pylint: disable=protected-access
  assert "is_finite" not in off_text and "all_gather" not in off_text
  assert "all_gather" in on_text
  assert off_text.count("all_reduce") == on_text.count("all_reduce")


@pytest.mark.parametrize("replicas", [1, N])
def test_a_program_traced_for_another_signature_names_the_output_of_the_signature_that_ran(replicas):
  """jax.jit keeps an executable per argument signature: after a trace for int32 `x` (where only `b` is
  floating, so checked), a call with float32 `x` runs the float32 executable, whose flags are [a, b]. The
  error names the output that holds the NaN (`a`, numpy: 1 * NaN), not what the latest trace checked."""
  strategy = tpustrat.MirroredStrategy(jax.devices()[:replicas])
  checked = tpustrat.RunOptions(check_numerics=True, max_steps_in_flight=1)

  def step(x, scale):
    return {"a": x * scale, "b": jnp.ones(x.shape, jnp.float32)}

  xf, xi = jnp.ones((3,), jnp.float32), jnp.ones((3,), jnp.int32)
  strategy.run(step, args=(xf, jnp.float32(1.0)), options=checked)
  strategy.run(step, args=(xi, jnp.int32(1)), options=checked)  # traced again: only 'b' is checked there
  strategy.experimental_run_wait()
  assert np.isnan(np.float32(1.0) * np.float32(np.nan))
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.run(step, args=(xf, jnp.float32(np.nan)), options=checked)
    strategy.experimental_run_wait()
  assert info.value.step == 3
  assert info.value.outputs == [("['a']", "Mirrored", tuple(range(replicas)), True, False)]


def test_experimental_run_steps_traced_for_another_signature_names_the_carry_that_ran(strategy):
  """The same for `experimental_run_steps`: a carry whose `a` is float32, then int32, then float32 with a
  NaN (numpy: 1 * NaN) in `a` at the second inner step of the third call names ``carry['a']``."""
  checked = tpustrat.RunOptions(check_numerics=True, max_steps_in_flight=1)

  def step(carry, x):
    scale = tpustrat.get_replica_context().all_reduce("mean", jnp.mean(x))
    return {"a": carry["a"] * scale.astype(carry["a"].dtype), "b": carry["b"] + 1.0}, ()

  def run(a, xs):
    batches = tpustrat.stack_steps([per_replica(strategy, [np.full(2, v)] * N) for v in xs])
    return strategy.experimental_run_steps(step, batches, init={"a": a, "b": np.float32(0.0)}, options=checked)

  run(np.float32(1.0), [1.0, 1.0])
  run(np.int32(1), [1.0, 1.0])
  strategy.experimental_run_wait()
  with pytest.raises(tpustrat.NumericsError) as info:
    run(np.float32(1.0), [1.0, np.nan])
    strategy.experimental_run_wait()
  assert (info.value.step, info.value.inner_step) == (6, 2)
  assert info.value.outputs == [("carry['a']", "Mirrored", tuple(range(N)), True, False)]


def test_check_numerics_must_be_a_bool():
  for bad in (1, "yes", None, np.float32(1)):
    with pytest.raises(TypeError, match=r"RunOptions: check_numerics must be a bool \(True or False\), got"):
      tpustrat.RunOptions(check_numerics=bad)
  assert tpustrat.RunOptions(check_numerics=np.bool_(True)).check_numerics is True
  assert tpustrat.RunOptions().check_numerics is False


def test_steps_are_counted_per_program_and_results_still_come_back(strategy):
  x = per_replica(strategy, [1.0] * N)

  def fine(v):
    return v * 2.0

  for _ in range(3):
    out = strategy.run(fine, args=(x,), options=CHECK)
  strategy.experimental_run_wait()
  np.testing.assert_array_equal(np.asarray(out.values), np.full(N, 2.0))
  bad = per_replica(strategy, [np.nan] * N)
  strategy.run(fine, args=(bad,), options=CHECK)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.experimental_run_wait()
  assert info.value.step == 4 and info.value.replicas == tuple(range(N))


@pytest.mark.filterwarnings("ignore::tpustrat.RepeatedPlacementWarning")  # plain arrays: the checked path
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("bad_step", [2, numerics_lib.GROUP, numerics_lib.GROUP + 3])
def test_the_error_comes_at_the_wait_for_the_last_step_of_its_group(strategy, k, bad_step):
  """The documented latency: the flags of steps ``GROUP * g + 1 .. GROUP * (g + 1)`` are read together once
  the last of them has finished, so step ``t``'s error is raised by call ``GROUP * ceil(t / GROUP) + k``
  (``k = max_steps_in_flight``; with ``k = 1`` the bound waits for each newest step, which is read then:
  call ``t + 1``), which dispatches nothing; the calls in between return their results. The error names
  step ``t`` (not its group's last) and counts every later dispatched step as not checked."""
  options = tpustrat.RunOptions(check_numerics=True, max_steps_in_flight=k)
  good = per_replica(strategy, [np.full(4, 2.0)] * N)
  bad = per_replica(strategy, [np.full(4, -1.0) if r == 3 else np.full(4, 2.0) for r in range(N)])
  w = jnp.zeros(())
  group = numerics_lib.GROUP

  def step(w, x):  # a program of its own: steps counted from 1
    return log_step(w, x)

  raising_call = group * -(-bad_step // group) + k if k > 1 else bad_step + 1
  for call in range(1, raising_call):  # dispatched, results returned
    out = strategy.run(step, args=(w, bad if call == bad_step else good), options=options)
    if call != bad_step:
      np.testing.assert_allclose(np.asarray(out["y"].values), np.full((N, 4), np.log(2.0)), rtol=1e-6)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.run(step, args=(w, good), options=options)
  e = info.value
  assert e.step == bad_step and e.replicas == (3,)
  assert f"step {bad_step} (call {bad_step} of strategy.run(step)" in str(e)
  later = raising_call - 1 - bad_step
  assert (f"{later} step(s) dispatched after it" in str(e)) == (later > 0)
  strategy.experimental_run_wait()  # nothing left to report


@pytest.mark.filterwarnings("ignore::tpustrat.RepeatedPlacementWarning")  # plain arrays: the checked path
def test_the_flags_copy_to_the_host_starts_at_dispatch_on_a_device_with_its_own_memory(strategy, monkeypatch):
  """On a GPU / TPU each dispatch starts its flags' copy to the host at once, so that the bound, which reads
  them `max_steps_in_flight` calls later, finds them there; on the CPU (host memory already) none is started.
  The CPU stands in for a device here by forcing that decision; the error is the same."""
  from tpustrat._src import numerics as numerics_lib  # noqa: PLC0415 (the decision forced below)

  array_type = type(jnp.zeros(()))
  started = []
  copy = array_type.copy_to_host_async

  def spy(self):
    started.append(self)
    return copy(self)

  monkeypatch.setattr(array_type, "copy_to_host_async", spy)
  good = per_replica(strategy, [np.full(4, 2.0)] * N)
  bad = per_replica(strategy, [np.full(4, -1.0) if r == 3 else np.full(4, 2.0) for r in range(N)])
  w = jnp.zeros(())
  strategy.run(log_step, args=(w, good), options=CHECK)
  strategy.experimental_run_wait()
  assert started == []  # the CPU: nothing to copy

  def log_step_2(w, x):  # a program of its own, so the decision is taken afresh
    return log_step(w, x)

  monkeypatch.setattr(numerics_lib, "copy_ahead", lambda flags: True)
  calls = numerics_lib.GROUP + 1  # the group of steps 1 .. GROUP is read by call GROUP + 2
  for call in range(1, calls + 1):
    strategy.run(log_step_2, args=(w, bad if call == 2 else good), options=CHECK)
    assert len(started) == call  # started by this call's dispatch, before any later call reads it
    # every replica's flags, 2 outputs, and the id of the trace they describe
    assert started[-1].shape == (N, 2 + numerics_lib.TRACE_BYTES) and started[-1].dtype == np.uint8
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.run(log_step_2, args=(w, good), options=CHECK)
  _nan_at_step_2_on_replica_3(info.value)
  assert len(started) == calls  # the raising call dispatched nothing
  strategy.experimental_run_wait()


# -- 2 processes x 4 devices -------------------------------------------------------------------------------


def _env() -> dict[str, str]:
  return {k: v for k, v in os.environ.items()
          if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}


@pytest.mark.processes
def test_two_processes_both_raise_the_same_error_at_the_same_call():
  """The NaN is made on replica 6 (process 1's devices) at step 3 of GROUP + 4; with 2 steps in flight, both
  processes raise at call GROUP + 2 (the wait for the last step of its group), name step 3, replica 6 and
  process 1, and exit with status 3: no hang."""
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--heartbeat-timeout", "10",
             "--timeout", "120", str(SCRIPT), str(numerics_lib.GROUP + 4), "3", "6"]
  start = time.monotonic()
  done = subprocess.run(command, env=_env(), cwd=SCRIPT.parents[2], capture_output=True, text=True, timeout=180)
  elapsed = time.monotonic() - start
  assert done.returncode == 3, done.stderr[-4000:]
  results = launched_results(done.stdout)
  for index, result in results.items():
    assert result["process"] == index
    assert result["error"] == {"call": numerics_lib.GROUP + 2, "step": 3, "replicas": [6], "processes": [1],
                               "paths": ["[0]['total']", "[1]"]}, result
    assert "[1]: NaN in a PerReplica value, on replica 6 (process 1)" in result["message"]
  assert results[0]["message"] == results[1]["message"]
  assert elapsed < 90, f"{elapsed:.1f} s"


@pytest.mark.processes
def test_two_processes_raise_the_same_error_of_a_run_inside_a_users_jit_and_scan():
  """A jitted scan of 5 steps with the NaN on replica 6 (process 1) at iteration 3: the scan's result
  comes back, both processes raise the same error in experimental_run_wait (the callback runs on one device
  of each process), then both run one more collective: no hang."""
  script = SCRIPT.parent / "numerics_traced.py"
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--heartbeat-timeout", "10",
             "--timeout", "120", str(script), "5", "3", "6"]
  done = subprocess.run(command, env=_env(), cwd=SCRIPT.parents[2], capture_output=True, text=True, timeout=180)
  assert done.returncode == 3, done.stderr[-4000:]
  results = launched_results(done.stdout)
  for index, result in results.items():
    assert result["process"] == index and result["returned_nan"]
    error = result["error"]
    assert (error["step"], error["replicas"], error["processes"], error["paths"]) == (3, [6], [1], ["[0]", "[1]"])
    assert "its 3rd execution" in error["message"]
    assert "[1]: NaN in a PerReplica value, on replica 6 (process 1)" in error["message"]
  assert results[0]["error"]["message"] == results[1]["error"]["message"]


def test_with_donated_state(strategy):
  options = tpustrat.RunOptions(check_numerics=True, donate_argnums=0)
  x = per_replica(strategy, [1.0 if r != 7 else -1.0 for r in range(N)])

  def step(state, v):
    return {"w": state["w"] + 1.0}, jnp.sqrt(v)

  state = strategy.experimental_mirror({"w": np.zeros(4, np.float32)})
  for _ in range(numerics_lib.GROUP + 1):  # step 1's group is read by call GROUP + 2
    state, _ = strategy.run(step, args=(state, x), options=options)
  with pytest.raises(tpustrat.NumericsError) as info:
    strategy.run(step, args=(state, x), options=options)
  assert info.value.step == 1 and info.value.outputs == [("[1]", "PerReplica", (7,), True, False)]
  strategy.experimental_run_wait()
  np.testing.assert_array_equal(np.asarray(strategy.experimental_local_results(state["w"])[0]),
                                np.full(4, numerics_lib.GROUP + 1.0))


def test_checks_of_two_programs_interleaved_report_the_first_bad_step_once(strategy):
  """A checked `train` step makes a NaN at its step 3, which a checked `evaluate` step reads right after:
  the error names train's step 3 (the cause, dispatched first), not evaluate's, and comes by the wait for
  it (a group of `run` steps ends where another program's checked step is dispatched between them); the
  steps after it are reported as not checked and never raise again, and later steps are checked afresh."""
  options = tpustrat.RunOptions(check_numerics=True, max_steps_in_flight=3)
  x = per_replica(strategy, [np.ones(4)] * N)

  def train(v, b):
    return v * b

  def evaluate(y):
    return jnp.sum(y)

  errors = []
  for t in range(1, 25):
    try:
      y = strategy.run(train, args=(x, jnp.float32(np.nan if t == 3 else 1.0)), options=options)
      if t == 3:
        strategy.run(evaluate, args=(y,), options=options)
    except tpustrat.NumericsError as e:
      errors.append((t, e))
  strategy.experimental_run_wait()  # nothing revived
  assert [t for t, _ in errors] == [5], errors  # train 1, 2, 3, evaluate 1, train 4 in flight; call 5 waits
  e = errors[0][1]
  assert e.step == 3 and "strategy.run(train)" in str(e) and e.replicas == tuple(range(N))
  assert "2 step(s) dispatched after it" in str(e)  # evaluate's step 1 and train's step 4, not before it
  bad = per_replica(strategy, [np.full(4, np.inf)] * N)
  strategy.run(train, args=(bad, jnp.float32(1.0)), options=options)  # a later step: checked afresh
  # calls 1-24, the one at 5 not dispatched: this is train's step 24
  with pytest.raises(tpustrat.NumericsError, match=r"step 24 \(call 24 of strategy.run\(train\)"):
    strategy.experimental_run_wait()


def test_consecutive_checked_dispatches_share_one_open_check(strategy):
  """The fast path of a checked `run`: up to GROUP consecutive dispatches of one program are one open
  `Check` on the bound (a list append each, no check made per dispatch); the GROUP + 1-th opens a new one,
  and the full group waits, closed, under its newest token until the bound has waited for that step. A
  second checked program's dispatch ends the first program's group (errors stay in dispatch order)."""
  good = per_replica(strategy, [np.full(4, 2.0)] * N)
  bound = strategy.extended.engine.in_flight
  strategy.experimental_run_wait()
  w = jnp.zeros(())
  group = numerics_lib.GROUP
  for call in range(1, group + 2):
    w = strategy.run(log_step, args=(w, good), options=CHECK)["w"]
    assert type(bound._open) is numerics_lib.Check
    assert len(bound._open.flags) == (call - 1) % group + 1
  closed = list(bound._checks.values())
  assert len(closed) == 1 and len(closed[0].flags) == group and not closed[0].ran
  first_group = closed[0]
  # Another program: its dispatch waits for step GROUP (2 in flight), which runs the full group, and closes
  # the group of step GROUP + 1.
  strategy.run(lambda w, x: {"w": w + jnp.sum(x)}, args=(w, good), options=CHECK)
  assert first_group.ran and len(bound._open.flags) == 1
  assert [len(c.flags) for c in bound._checks.values()] == [1] and bound._open.outputs is not first_group.outputs
  strategy.experimental_run_wait()
  assert bound._open is None and not bound._checks
  np.testing.assert_allclose(np.asarray(w.values[0]), (group + 1) * N * 4 * np.log(2.0), rtol=1e-5)
