"""Regression tests for defects found in review of the collectives and cross-device ops (values from numpy)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat._src import cross_device_ops as cdo_lib
from tpustrat._src.mirrored_strategy import MirroredStrategy

N = 8


class _CountingOps(cdo_lib.AllReduceCrossDeviceOps):
  """The default cross-device ops, counting batch reductions."""

  def __init__(self):
    super().__init__("nccl", num_packs=0)
    self.batches = 0

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
    self.batches += 1
    return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


@pytest.fixture(scope="module")
def counting():
  return _CountingOps()


@pytest.fixture(scope="module")
def mirrored(counting):
  return MirroredStrategy(cross_device_ops=counting)


def test_reduce_to_mean_of_a_nested_mirrored_is_the_value_itself(mirrored):
  # TF (and `reduce_to` on a Mirrored itself) return a Mirrored value unchanged for MEAN; inside a pytree
  # it went through sum-of-n-copies / n, which is not exact in floating point.
  vals = np.random.default_rng(0).normal(size=1000).astype(np.float32)
  m = mirrored.run(lambda: jnp.asarray(vals))
  d = mirrored.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  out = mirrored.extended.reduce_to("mean", {"m": m, "d": d}, d)
  assert out["m"] is m
  np.testing.assert_array_equal(np.asarray(out["m"].values[0]), vals)
  assert float(out["d"].values[0]) == np.mean(np.arange(N, dtype=np.float64))


def test_reduce_to_rejects_a_bad_leaf_before_reducing_anything(mirrored, counting):
  d = mirrored.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  counting.batches = 0
  with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
    mirrored.extended.reduce_to("sum", {"d": d, "plain": jnp.ones(3)}, d)
  assert counting.batches == 0


# -- ReductionToOneDevice(reduce_to_device=...) inside and outside strategy.run ----------------------


def _four(ops, order=(5, 1, 6, 2)):
  """A 4-replica MirroredStrategy on the devices `order` (in that replica order)."""
  return MirroredStrategy([jax.devices()[i] for i in order], cross_device_ops=ops)


@pytest.mark.parametrize("device", [7, "/cpu:7", "/job:localhost/replica:0/task:0/device:CPU:3"])
def test_reduce_to_device_outside_the_mesh_raises_in_run(device):
  # The strategy runs on CPU 5, 1, 6, 2; CPU 7 (or 3) is not one of them. Inside `run` the reduction is one
  # program over those four devices, so it used to sum on replica 0 instead, silently.
  device = jax.devices()[device] if isinstance(device, int) else device
  ops = cdo_lib.ReductionToOneDevice(reduce_to_device=device)
  strategy = _four(ops)
  calls = []

  def step():
    calls.append(1)
    return tpustrat.get_replica_context().all_reduce("sum", jnp.float32(1.0))

  with pytest.raises(ValueError) as info:
    strategy.run(step)
  message = str(info.value)
  assert "reduce_to_device" in message and repr(device) in message
  for i in (5, 1, 6, 2):  # the mesh's devices, listed
    assert str(jax.devices()[i]) in message
  # The same error straight from the CrossDeviceOps API, and with options.
  with pytest.raises(ValueError, match="reduce_to_device"):
    strategy.run(lambda: ops.all_reduce_in_replica_context(
        "mean", jnp.float32(1.0), cdo_lib.CommunicationOptions(bytes_per_pack=4)))


def test_reduce_to_device_outside_the_mesh_still_works_cross_replica(monkeypatch):
  # TF's ReductionToOneDevice copies the components to any device in the cross-replica context: kept.
  ops = cdo_lib.ReductionToOneDevice(reduce_to_device=jax.devices()[7])
  strategy = _four(ops)
  seen = []
  accumulate = cdo_lib.all_reduce.accumulate_on_device
  monkeypatch.setattr(cdo_lib.all_reduce, "accumulate_on_device",
                      lambda parts, fn: seen.append([p.devices() for p in parts]) or accumulate(parts, fn))
  rows = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
  v = strategy.experimental_distribute_values_from_function(lambda ctx: rows[ctx.replica_id_in_sync_group])
  total = strategy.extended.reduce_to("sum", v, destinations=v)
  assert seen == [[{jax.devices()[7]}] * 4]  # the four components were added on CPU 7
  want = rows.astype(np.float64).sum(axis=0)
  assert isinstance(total, tpustrat.Mirrored) and len(total.values) == 4
  for r in range(4):
    assert_close(np.asarray(total.values[r]), want, rtol=1e-6, scale=np.abs(rows).sum(axis=0))
  one = strategy.extended.reduce_to("mean", v, destinations="/cpu:1")
  assert one.devices() == {jax.devices()[1]}
  assert_close(np.asarray(one), want / 4, rtol=1e-6, scale=np.abs(rows).sum(axis=0) / 4)


def test_reduce_to_device_in_the_mesh_is_the_root_in_run():
  # CPU 6 is replica 2 of the mesh [5, 1, 6, 2]: the components are permuted to replica 2, nowhere else.
  strategy = _four(cdo_lib.ReductionToOneDevice(reduce_to_device="/cpu:6"))
  x = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))

  def step(v):
    return tpustrat.get_replica_context().all_reduce("sum", v)

  out = strategy.run(step, args=(x,))
  assert [float(c) for c in out.values] == [10.0] * 4
  text = jax.jit(lambda v: strategy.run(step, args=(v,))).lower(x).as_text()
  pairs = [tuple(int(t) for t in re.findall(r"\d+", p))
           for p in re.findall(r"source_target_pairs = dense<(\[\[[\d, \[\]]*\]\])>", text)]
  gathered = [p for p in pairs if len(p) == 2 and p[1] == 2]
  assert sorted(p[0] for p in gathered) == [0, 1, 3], pairs


def test_reduce_to_device_that_names_no_device_says_so():
  ops = cdo_lib.ReductionToOneDevice(reduce_to_device="/cpu:99")
  strategy = _four(ops)
  v = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1.0))
  for call in (lambda: strategy.extended.reduce_to("sum", v, destinations=v),
               lambda: strategy.run(lambda: tpustrat.get_replica_context().all_reduce("sum", 1.0))):
    with pytest.raises(ValueError, match=r"reduce_to_device='/cpu:99'.*CPU:99"):
      call()


def test_reduce_to_device_in_a_shard_map_outside_run_raises():
  # A plain shard_map gives no way to find which replica holds the device; it used to be replica 0.
  mesh = Mesh(np.asarray(jax.devices()), ("replica",))
  x = jax.device_put(jnp.arange(N, dtype=jnp.float32), NamedSharding(mesh, P("replica")))
  for device in ("/cpu:3", jax.devices()[3]):
    ops = cdo_lib.ReductionToOneDevice(reduce_to_device=device)
    fn = jax.jit(jax.shard_map(lambda v, ops=ops: ops.all_reduce_in_replica_context("sum", v[0]), mesh=mesh,
                               in_specs=P("replica"), out_specs=P()))
    with pytest.raises(ValueError, match=r"no current strategy has a mesh with the axis 'replica' of size 8"):
      fn(x)
  # Without reduce_to_device the first replica sums, as before.
  ops = cdo_lib.ReductionToOneDevice()
  fn = jax.jit(jax.shard_map(lambda v: ops.all_reduce_in_replica_context("sum", v[0]), mesh=mesh,
                             in_specs=P("replica"), out_specs=P()))
  assert float(fn(x)) == sum(range(N))
