"""The context: scope(), get_strategy(), has_strategy(), in_cross_replica_context(), get_replica_context(),
and the argument checks of `ReplicaContext.all_reduce` / `all_gather`."""

import jax
import jax.numpy as jnp
import pytest

import tpustrat

N = 8


def test_default_strategy_outside_any_scope():
  default = tpustrat.get_strategy()
  assert not tpustrat.has_strategy()
  assert not tpustrat.in_cross_replica_context()
  ctx = tpustrat.get_replica_context()
  assert ctx is not None and ctx.num_replicas_in_sync == 1 and ctx.strategy is default
  assert ctx.replica_id_in_sync_group == 0
  assert ctx.all_reduce("sum", 3.0) == 3.0  # one replica
  assert default.run(lambda x: x + 1, args=(1,)) == 2
  assert default.experimental_local_results(4) == (4,)
  assert float(default.reduce("sum", 2.0, axis=None)) == 2.0


def test_scope_makes_strategy_current_in_cross_replica_context(strategy):
  with strategy.scope() as s:
    assert s is strategy
    assert tpustrat.get_strategy() is strategy
    assert tpustrat.has_strategy()
    assert tpustrat.in_cross_replica_context()
    assert tpustrat.get_replica_context() is None
    with strategy.scope():  # re-entering the same strategy is fine
      assert tpustrat.get_strategy() is strategy
  assert not tpustrat.has_strategy()


def test_replica_context_inside_run_within_scope(strategy):
  seen = {}

  def fn():
    seen["cross"] = tpustrat.in_cross_replica_context()
    seen["strategy"] = tpustrat.get_strategy()
    seen["ctx"] = tpustrat.get_replica_context()
    return 0.0

  with strategy.scope():
    strategy.run(fn)
    assert tpustrat.in_cross_replica_context()
  assert seen["cross"] is False and seen["strategy"] is strategy
  assert seen["ctx"].num_replicas_in_sync == 8


def test_mixing_strategies_is_an_error(strategy):
  other = tpustrat.TPUStrategy(device_assignment=jax.devices()[:2])
  with strategy.scope():
    with pytest.raises(ValueError, match="Mixing different tpustrat strategies"):
      with other.scope():
        pass


def test_strategy_attributes(strategy):
  assert strategy.num_replicas_in_sync == 8
  assert strategy.extended.worker_devices == tuple(jax.devices())
  assert (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id) == ("worker", 0)  # never None
  assert strategy.mesh.axis_names == ("replica",)
  with pytest.raises(TypeError, match="device_assignment"):
    tpustrat.TPUStrategy(device_assignment="tpu:0")
  with pytest.raises(ValueError, match="twice"):
    tpustrat.TPUStrategy(device_assignment=[jax.devices()[0]] * 2)


@pytest.mark.parametrize("axis", ["0", 0.0, True])
def test_all_gather_rejects_a_non_int_axis_like_reduce(strategy, axis):
  def fn():
    return tpustrat.get_replica_context().all_gather(jnp.ones(2), axis=axis)

  got = rf"got {type(axis).__name__} " + repr(axis).replace(".", r"\.") + r"\."
  with pytest.raises(TypeError, match=r"^ReplicaContext\.all_gather: `axis` must be an int or None, " + got):
    strategy.run(fn)
  with pytest.raises(TypeError, match=r"^strategy\.reduce: `axis` must be an int or None, " + got):
    strategy.reduce("SUM", strategy.run(lambda: jnp.ones(2)), axis=axis)


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
