"""Regression tests for defects found reviewing values / reduce / strategy (each checked against numpy)."""

import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat

N = 8


def distribute(strategy, arr):
  return strategy.experimental_distribute_values_from_function(lambda ctx: arr[ctx.replica_id_in_sync_group])


def test_local_results_broadcasts_a_mirrored_held_once(strategy):
  # A Mirrored over a host value has one copy; it must not cut the other PerReplica components off.
  x = np.arange(N, dtype=np.float32)
  results = strategy.experimental_local_results({"a": distribute(strategy, x), "b": tpustrat.Mirrored(np.float32(2))})
  assert len(results) == N
  np.testing.assert_array_equal([float(r["a"]) for r in results], x)
  assert [float(r["b"]) for r in results] == [2.0] * N


def test_mirrored_values_with_a_host_leaf_keep_every_replica(strategy):
  on_devices = strategy.run(lambda: jnp.arange(3.0))  # Mirrored: one copy per device
  value = tpustrat.Mirrored({"a": on_devices._value, "b": 3.0})  # pylint: disable=protected-access
  values = value.values
  assert len(values) == N
  for v in values:
    np.testing.assert_array_equal(v["a"], np.arange(3.0))
    assert float(v["b"]) == 3.0


@pytest.mark.parametrize("method", ["reduce", "gather"])
def test_reduce_and_gather_reject_a_per_replica_of_another_replica_count(strategy, method):
  value = tpustrat.PerReplica([np.ones(2, np.float32)] * 3)  # 3 components, 8 replicas
  with pytest.raises(ValueError, match="3 components, but the strategy has 8 replicas"):
    if method == "reduce":
      strategy.reduce("SUM", value, axis=None)
    else:
      strategy.gather(value, axis=0)


def test_values_from_function_rejects_mismatched_dtypes(strategy):
  with pytest.raises(ValueError, match="dtype int32 for replica 1 but float32 for replica 0"):
    strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(1) if ctx.replica_id_in_sync_group == 0 else np.int32(1))


@pytest.mark.parametrize("wrap", [tpustrat.PerReplica, tpustrat.Mirrored])
def test_run_rejects_a_distributed_value_returned_by_the_replica_function(strategy, wrap):
  inner = wrap([np.ones(2, np.float32)] * N) if wrap is tpustrat.PerReplica else wrap(np.ones(2, np.float32))

  def fn(x):
    return {"loss": x.sum(), "bad": inner}

  with pytest.raises(TypeError) as info:
    strategy.run(fn, (jnp.ones(3),))
  message = str(info.value)
  assert f"returned a {wrap.__name__} at ['bad']" in message
  assert "cross-replica" in message and "return the arrays instead" in message


@pytest.mark.parametrize("axis", ["0", 0.0, True])
def test_all_gather_rejects_a_non_int_axis_like_reduce(strategy, axis):
  def fn():
    return tpustrat.get_replica_context().all_gather(jnp.ones(2), axis=axis)

  with pytest.raises(TypeError, match=r"^`axis` must be an int or None, got " + repr(axis).replace(".", r"\.") + r"\."):
    strategy.run(fn)
  with pytest.raises(TypeError, match="`axis` must be an int"):
    strategy.reduce("SUM", strategy.run(lambda: jnp.ones(2)), axis=axis)


def test_default_strategy_run_validates_fn_and_kwargs_like_tpu_strategy(strategy):
  default = tpustrat.get_strategy()
  assert not tpustrat.has_strategy()
  for s in (default, strategy):
    with pytest.raises(TypeError, match=r"^strategy.run expects `kwargs` to be a dict or None, got list\.$"):
      s.run(lambda x: x, (1.0,), [("x", 1.0)])
    with pytest.raises(TypeError, match=r"^strategy.run expects a callable `fn`, got int: 3\.$"):
      s.run(3, (1.0,))
  assert default.run(lambda x, y: x + y, (1.0,), {"y": 2.0}) == 3.0
  assert default.run(lambda x: x * 2, (4.0,), None) == 8.0


def test_grouped_all_reduce_rejects_options(strategy):
  def fn():
    return tpustrat.get_replica_context().all_reduce(
        "SUM", jnp.ones(()), options=tpustrat.CommunicationOptions(),
        group_assignment=[[0, 1, 2, 3], [4, 5, 6, 7]])

  with pytest.raises(ValueError, match="grouped reductions use the XLA collective directly"):
    strategy.run(fn)
  grouped = strategy.run(
      lambda: tpustrat.get_replica_context().all_reduce("SUM", 1.0, group_assignment=[[0, 1, 2, 3], [4, 5, 6, 7]]))
  assert [float(v) for v in strategy.experimental_local_results(grouped)] == [4.0] * N


def test_a_passed_through_output_is_a_fresh_buffer_written_by_the_step(strategy):
  # jax 0.10.2 does not forward a shard_map pass-through to the input's buffer: XLA copies it inside the
  # program, so waiting on it (as `_wait_leaf` may choose it) waits for the step.
  w = strategy.run(lambda: jnp.arange(4.0))
  x = distribute(strategy, np.arange(N * 3, dtype=np.float32).reshape(N, 3))
  out_w, total = strategy.run(lambda w, x: (w, x.sum()), (w, x))
  assert isinstance(out_w, tpustrat.Mirrored)
  np.testing.assert_array_equal(out_w.values[0], np.arange(4.0))
  in_ptrs = {s.data.unsafe_buffer_pointer() for s in w._value.addressable_shards}  # pylint: disable=protected-access
  out_ptrs = {s.data.unsafe_buffer_pointer() for s in out_w._value.addressable_shards}  # pylint: disable=protected-access
  assert not in_ptrs & out_ptrs
  np.testing.assert_array_equal(
      [float(v) for v in strategy.experimental_local_results(total)], np.arange(N * 3).reshape(N, 3).sum(1))
