"""Strategy: the default strategy (its `extended.max_steps_in_flight`, `run`'s argument checks), a process
that holds none of the strategy's replicas."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import tpustrat

# -- the default strategy's extended.max_steps_in_flight ----------------------------------------------


BAD_BOUND = r"^strategy\.extended: `max_steps_in_flight` must be an int >= 1, got "


def test_default_strategy_reports_and_accepts_max_steps_in_flight_like_tpu_strategy(strategy):
  default = tpustrat.get_strategy()
  assert not tpustrat.has_strategy()
  for s in (default, strategy):
    ext = s.extended
    before = ext.max_steps_in_flight
    assert before == 2
    try:
      ext.max_steps_in_flight = 5
      assert ext.max_steps_in_flight == 5
      for bad in (0, -1):
        with pytest.raises(ValueError, match=BAD_BOUND):
          ext.max_steps_in_flight = bad
      for bad in (1.5, True, "3", None):
        with pytest.raises(TypeError, match=BAD_BOUND):
          ext.max_steps_in_flight = bad
      assert ext.max_steps_in_flight == 5  # a rejected value leaves the bound as it was
    finally:
      ext.max_steps_in_flight = before
  # The default strategy's run calls fn directly: the bound changes nothing there.
  assert default.run(lambda x: x + 1, (1,)) == 2


# -- a process that holds none of the strategy's replicas ---------------------------------------------
# The whole behaviour (a global value without shards, then run / reduce) needs two processes:
# tests/test_multiprocess.py::test_a_process_that_holds_no_replica_builds_values_from_function_too.


def test_a_process_without_replicas_names_the_situation_when_value_fn_fails(strategy, monkeypatch):
  # As process 1 of a job whose strategy lives on process 0's devices: value_fn is called for replica 0
  # only to learn the value's structure; if it cannot do that here, the error says why it was called.
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
  seen = []

  def value_fn(ctx):
    seen.append(ctx.replica_id_in_sync_group)
    raise KeyError("replica 0's data lives on another host")

  with pytest.raises(KeyError, match="replica 0's data") as info:
    strategy.experimental_distribute_values_from_function(value_fn)
  assert seen == [0]
  assert "process 1 holds none of the strategy's 8 replicas" in "\n".join(info.value.__notes__)


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


def test_repr_of_values_whose_leaves_are_not_arrays():
  """`jax.tree.map(lambda x: x.shape, state)` keeps the wrappers around shapes: printing it must work."""
  per_replica = tpustrat.PerReplica([np.zeros(3, np.float32)] * 8)
  mirrored = tpustrat.Mirrored(np.zeros(3, np.float32))
  shapes = jax.tree.map(lambda x: x.shape, {"p": per_replica, "m": mirrored})
  text = repr(shapes)
  assert "PerReplica(" in text and "Mirrored(" in text and "(8, 3)" in text and "(3,)" in text
  assert repr(per_replica) == "PerReplica(num_replicas=8, component=float32[3])"
  assert repr(mirrored) == "Mirrored(float32[3])"


# -- 64-bit host integers without jax_enable_x64, and PerReplica dtypes -------------------------------

BIG = 3_000_000_000


def test_values_from_function_raises_on_int64_beyond_int32_naming_the_replica(strategy):
  assert not jax.config.jax_enable_x64

  def value_fn(ctx):
    r = ctx.replica_id_in_sync_group
    return {"ids": np.array([r, BIG if r == 5 else r], np.int64), "w": np.float32(r)}

  with pytest.raises(OverflowError, match=(
      r"^experimental_distribute_values_from_function: value_fn's value for replica 5 at \['ids'\] is int64 and "
      rf"holds {BIG} at index \(1,\), outside the int32 range")):
    strategy.experimental_distribute_values_from_function(value_fn)
  ok = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.array([2**31 - 1 - ctx.replica_id_in_sync_group], np.int64))
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in ok.values]),
                                (2**31 - 1 - np.arange(8))[:, None].astype(np.int32))


def test_experimental_mirror_and_run_steps_raise_on_int64_beyond_int32(strategy):
  with pytest.raises(OverflowError, match=r"the value given to experimental_mirror .* at \['step'\] is int64 and holds 3000000000"):
    strategy.experimental_mirror({"w": np.ones(2, np.float32), "step": np.int64(BIG)})
  stacked = {"ids": np.full((3, 8, 2), BIG, np.int64)}  # 3 steps, stacked host batches
  with pytest.raises(OverflowError, match=r"^experimental_run_steps: the stacked batches at \['ids'\] is int64"):
    strategy.experimental_run_steps(lambda c, b: (c, b["ids"]), stacked, init=np.float32(0))


def test_per_replica_components_of_different_dtypes_raise(strategy):
  with pytest.raises(ValueError, match=(
      r"^PerReplica components must share one dtype .* the leaf at \['b'\] is float32 in components 0, 1, 2, 3, "
      r"5, 6, 7; int32 in component 4\.")):
    tpustrat.PerReplica([{"a": np.zeros(2, np.int32), "b": np.float32(1) if r != 4 else np.int32(1)} for r in range(8)])
  with pytest.raises(ValueError, match=r"is float32 in components 0, 1, 2, 3; bfloat16 in components 4, 5, 6, 7\."):
    tpustrat.PerReplica([jax.numpy.zeros(2, jax.numpy.float32)] * 4 + [jax.numpy.zeros(2, jax.numpy.bfloat16)] * 4)
  with pytest.raises(OverflowError, match=rf"^PerReplica: component 3, the leaf at <root>, is int64 and holds {BIG}"):
    tpustrat.PerReplica([np.int64(BIG if r == 3 else r) for r in range(8)])
  # float64 is float32 on the devices without x64 (as in JAX): those components agree there.
  mixed = tpustrat.PerReplica([np.float64(r / 3) if r % 2 else np.float32(r / 3) for r in range(8)])
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in mixed.values]), (np.arange(8) / 3).astype(np.float32))
  out = strategy.run(lambda v: v * 2, args=(mixed,))
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in out.values]), (np.arange(8) / 3).astype(np.float32) * 2)
