"""CrossDeviceOps, gradient packing and MirroredStrategy: TF's documented semantics against numpy, the
collectives each implementation compiles to, TF's errors for bad input, and regression tests for defects
found in review (reduce_to of nested values, ReductionToOneDevice's reduce_to_device in and out of run)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat import (
  AllReduceCrossDeviceOps,
  CommunicationImplementation,
  CommunicationOptions,
  CrossDeviceOps,
  HierarchicalCopyAllReduce,
  NcclAllReduce,
  ReductionToOneDevice,
)
from tpustrat._src import all_reduce, cross_device, engine
from tpustrat._src.cross_device import ops as ops_lib
from tpustrat._src.gradient_semantics import AlreadyReplicatedWarning
from tpustrat._src.mirrored_strategy import MirroredStrategy

N = 8
RING = CommunicationOptions(implementation=CommunicationImplementation.RING)

# One instance per configuration for the whole module: compiled programs are cached on the instance.
IMPLS = {
    "one_device": ReductionToOneDevice(),
    "one_device@cpu3": ReductionToOneDevice(reduce_to_device="/cpu:3"),
    "one_device_custom_acc": ReductionToOneDevice(accumulation_fn=lambda xs: functools.reduce(jnp.add, xs[::-1])),
    "nccl_per_tensor": NcclAllReduce(num_packs=0),
    "nccl": NcclAllReduce(),
    "nccl_3_packs": NcclAllReduce(num_packs=3),
    "hierarchical": HierarchicalCopyAllReduce(),
    "hierarchical_per_tensor": HierarchicalCopyAllReduce(num_packs=0),
    "agg_small": AllReduceCrossDeviceOps(num_packs=0, agg_small_grads_max_bytes=64, agg_small_grads_max_group=2),
    "hierarchical_agg_small": AllReduceCrossDeviceOps("hierarchical_copy", 0, 64, 3),
}


def values_of(result):
  """(devices, components) of a reduce/broadcast result: a Mirrored or a one-device array."""
  if isinstance(result, tpustrat.Mirrored):
    arr = jax.tree.leaves(result.tree)[0]
    return set(arr.sharding.device_set), [np.asarray(v) for v in result.values]
  assert isinstance(result, jax.Array), type(result)
  return set(result.sharding.device_set), [np.asarray(result)]


def per_replica(strategy, fn):
  return strategy.experimental_distribute_values_from_function(lambda ctx: fn(ctx.replica_id_in_sync_group))


@pytest.fixture(scope="module")
def d(strategy):
  return per_replica(strategy, lambda r: np.float32(r))


@pytest.fixture(scope="module")
def e(strategy):
  return per_replica(strategy, lambda r: np.float32(r + 1))


@pytest.fixture(scope="module")
def destinations(strategy, d):
  devices = jax.devices()
  replicated = NamedSharding(strategy.mesh, P())
  subset = Mesh(np.array([devices[1], devices[4]], dtype=object), ("replica",))
  return {
      "the_value": (d, set(devices)),
      "mirrored_all": (tpustrat.Mirrored.from_global(jax.device_put(jnp.zeros(3), replicated)), set(devices)),
      "mirrored_two": (tpustrat.Mirrored.from_global(jax.device_put(jnp.zeros(()), NamedSharding(subset, P()))),
                       {devices[1], devices[4]}),
      "string": ("/job:localhost/replica:0/task:0/device:CPU:5", {devices[5]}),
      "short_string": ("/cpu:0", {devices[0]}),
      "device": (devices[6], {devices[6]}),
      "array_one_device": (jax.device_put(jnp.zeros(2), devices[2]), {devices[2]}),
      "mesh": (strategy.mesh, set(devices)),
      "sharding": (replicated, set(devices)),
  }


DEST_NAMES = ["the_value", "mirrored_all", "mirrored_two", "string", "short_string", "device",
              "array_one_device", "mesh", "sharding"]


# -- TF's semantics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dest", DEST_NAMES)
def test_reduce_d_and_d_plus_1_on_every_destination(impl, dest, d, e, destinations):
  # TF's cross_device_ops_test: replica r holds r (and r + 1); MEAN is (n-1)/2 (and (n+1)/2), SUM n times that.
  ops = IMPLS[impl]
  target, devices = destinations[dest]
  mean = (N - 1) / 2
  for value, op, want in [(d, "MEAN", mean), (e, tpustrat.ReduceOp.MEAN, mean + 1),
                          (d, "sum", mean * N), (e, tpustrat.ReduceOp.SUM, (mean + 1) * N)]:
    got_devices, components = values_of(ops.reduce(op, value, destinations=target))
    assert got_devices == devices
    assert len(components) == len(devices)
    for c in components:
      assert c.dtype == np.float32 and c.shape == ()
      assert float(c) == want, (impl, dest, op)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dests", [("the_value", "the_value"), ("string", "mesh"), ("mirrored_two", "device")])
def test_batch_reduce_of_both(impl, dests, d, e, destinations):
  ops = IMPLS[impl]
  (t1, dev1), (t2, dev2) = destinations[dests[0]], destinations[dests[1]]
  out = ops.batch_reduce("mean", [(d, t1), (e, t2)])
  assert isinstance(out, list) and len(out) == 2
  for result, devices, want in [(out[0], dev1, (N - 1) / 2), (out[1], dev2, (N + 1) / 2)]:
    got_devices, components = values_of(result)
    assert got_devices == devices
    assert all(float(c) == want for c in components)


@pytest.mark.parametrize("impl", ["one_device", "nccl", "hierarchical"])
@pytest.mark.parametrize("dest", DEST_NAMES)
def test_broadcast_one(impl, dest, destinations):
  target, devices = destinations[dest]
  got_devices, components = values_of(IMPLS[impl].broadcast(jnp.float32(1.0), target))
  assert got_devices == devices
  assert [float(c) for c in components] == [1.0] * len(devices)
  # Python numbers and numpy arrays broadcast too.
  assert values_of(IMPLS[impl].broadcast(1.0, target))[1][0] == 1.0


def test_reduce_of_mirrored_counts_every_replica(strategy):
  value = strategy.run(lambda: jnp.float32(2.5))
  assert isinstance(value, tpustrat.Mirrored)
  for ops in (IMPLS["nccl"], IMPLS["hierarchical"], IMPLS["one_device"]):
    assert values_of(ops.reduce("sum", value, value))[1] == [N * 2.5] * N
    assert values_of(ops.reduce("mean", value, "/cpu:1"))[1] == [2.5]


def test_reduce_of_a_tensor_on_one_device():
  # TF turns a tensor with a device into a PerReplica with one component.
  x = jax.device_put(jnp.arange(3.0), jax.devices()[2])
  for ops in (IMPLS["nccl"], IMPLS["one_device"]):
    got = ops.reduce("sum", x, destinations=jax.devices()[2])
    assert got.devices() == {jax.devices()[2]}
    np.testing.assert_array_equal(got, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(ops.reduce("mean", x, "/cpu:7"), [0.0, 1.0, 2.0])


def test_reduce_of_pytree_components(strategy):
  value = per_replica(strategy, lambda r: {"w": np.full((2, 3), r, np.float32), "n": np.int32(r)})
  for ops in (IMPLS["nccl"], IMPLS["hierarchical"], IMPLS["one_device"], IMPLS["agg_small"]):
    out = ops.reduce("sum", value, value)
    assert isinstance(out, tpustrat.Mirrored)
    got = out.values[3]
    np.testing.assert_array_equal(got["w"], np.full((2, 3), 28.0))
    assert got["n"].dtype == np.int32 and int(got["n"]) == 28
    mean = ops.reduce("mean", value, value).values[0]
    assert mean["n"].dtype == np.float32 and float(mean["n"]) == 3.5


def test_host_built_per_replica_goes_to_the_current_strategy(strategy):
  value = tpustrat.PerReplica([np.float32(r) for r in range(N)])
  with strategy.scope():
    out = IMPLS["nccl"].reduce("sum", value, strategy.mesh)
  assert values_of(out)[1] == [28.0] * N


def test_reduce_to_device_outside_the_value_devices(strategy):
  # A 4-replica value reduced on a device it does not use: components are copied there and added.
  four = tpustrat.TPUStrategy(device_assignment=jax.devices()[:4])
  value = per_replica(four, lambda r: np.float32(r))
  ops = ReductionToOneDevice(reduce_to_device=jax.devices()[6])
  out = ops.reduce("sum", value, value)
  assert values_of(out) == (set(jax.devices()[:4]), [6.0] * 4)
  # NcclAllReduce to devices other than the value's: TF falls back to ReductionToOneDevice.
  assert values_of(IMPLS["nccl"].reduce("mean", value, jax.devices()[7])) == ({jax.devices()[7]}, [1.5])
  assert values_of(IMPLS["nccl"].reduce("sum", value, strategy.mesh))[1] == [6.0] * N


@pytest.mark.parametrize("num_devices", [1, 2, 3, 5])
@pytest.mark.parametrize("impl", ["one_device", "nccl", "hierarchical", "hierarchical_per_tensor", "ring"])
def test_other_replica_counts(num_devices, impl):
  # Uneven hierarchical halves ([0], [1, 2] for 3 replicas), rings of any length, a single replica.
  small = tpustrat.TPUStrategy(device_assignment=jax.devices()[:num_devices])
  ops, options = (NcclAllReduce(1), RING) if impl == "ring" else (IMPLS[impl], None)
  value = per_replica(small, lambda r: np.arange(5, dtype=np.float32) + r)
  want = np.arange(5) * num_devices + num_devices * (num_devices - 1) / 2
  for dest in (value, small.mesh):
    devices, components = values_of(ops.reduce("sum", value, dest, options))
    assert devices == set(jax.devices()[:num_devices])
    for c in components:
      np.testing.assert_array_equal(c, want)
  in_run = small.run(lambda v: ops.all_reduce_in_replica_context("mean", v, options), args=(value,))
  assert isinstance(in_run, tpustrat.Mirrored)
  np.testing.assert_allclose(np.asarray(in_run.values[0]), want / num_devices, rtol=1e-6)


# -- packing ------------------------------------------------------------------------------------------


GRAD_SPECS = [((3, 3, 4, 8), np.float32), ((8,), np.float32), ((8,), np.float32), ((), np.float32),
              ((6,), jnp.bfloat16), ((100,), np.float32), ((0,), np.float32), ((4,), np.int32),
              ((5,), np.float32), ((3, 2), np.float16), ((7, 7), np.float32), ((2,), np.float32)]


@pytest.fixture(scope="module")
def grads(strategy):
  rng = np.random.default_rng(1)
  host = []
  for shape, dtype in GRAD_SPECS:
    if np.dtype(dtype) == np.int32:
      host.append(rng.integers(-50, 50, size=(N,) + shape).astype(np.int32))
    else:
      host.append(rng.normal(size=(N,) + shape).astype(np.float32).astype(dtype))
  dist = [per_replica(strategy, lambda r, h=h: h[r]) for h in host]
  return host, dist


def batch_sum(ops, dist, options=None):
  out = ops.batch_reduce("sum", [(g, g) for g in dist], options)
  return [np.asarray(o.values[0]) for o in out]


PACKINGS = {
    "num_packs_1": (NcclAllReduce(1), None),
    "num_packs_3": (NcclAllReduce(3), None),
    "num_packs_1000": (NcclAllReduce(1000), None),
    "bytes_per_pack_64": (NcclAllReduce(0), CommunicationOptions(bytes_per_pack=64)),
    "bytes_per_pack_1k": (NcclAllReduce(1), CommunicationOptions(bytes_per_pack=1024)),
    "agg_small": (IMPLS["agg_small"], None),
    "agg_small_big_groups": (AllReduceCrossDeviceOps(num_packs=0, agg_small_grads_max_bytes=1 << 20,
                                                     agg_small_grads_max_group=100), None),
}


@pytest.mark.parametrize("packing", list(PACKINGS))
def test_packing_is_bit_identical_for_xla_all_reduce(packing, grads):
  host, dist = grads
  reference = batch_sum(IMPLS["nccl_per_tensor"], dist)
  ops, options = PACKINGS[packing]
  packed = batch_sum(ops, dist, options)
  for (shape, dtype), ref, got, h in zip(GRAD_SPECS, reference, packed, host):
    assert got.shape == shape and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, ref)  # same order of addition per element: the same bits
    if np.dtype(dtype) == np.int32:
      np.testing.assert_array_equal(got, h.sum(0))
    else:
      # N terms rounded to `dtype` (bf16, f16 too) in XLA's order: within (N - 1) eps / 2 of sum |h|.
      assert_close(got, h.astype(np.float64).sum(0), rtol=max(1e-5, N * float(jnp.finfo(dtype).eps) / 2),
                   scale=np.abs(h.astype(np.float64)).sum(0))


def test_reduction_to_one_device_packed_or_not_adds_in_replica_order(grads):
  host, dist = grads
  plain = batch_sum(IMPLS["one_device"], dist)
  packed = batch_sum(IMPLS["one_device"], dist, CommunicationOptions(bytes_per_pack=256))
  for (shape, dtype), a, b, h in zip(GRAD_SPECS, plain, packed, host):
    assert a.shape == b.shape == shape and a.dtype == b.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(a, b)
    if np.dtype(dtype) in (np.float32, np.int32):  # add_n in replica order: numpy's left fold, bit for bit
      np.testing.assert_array_equal(a, functools.reduce(np.add, list(h)))


@pytest.mark.parametrize("ops,options", [
    (HierarchicalCopyAllReduce(0), None), (HierarchicalCopyAllReduce(2), None),
    (IMPLS["hierarchical_agg_small"], None), (NcclAllReduce(0), RING), (NcclAllReduce(2), RING),
    (ReductionToOneDevice(), CommunicationOptions(bytes_per_pack=100)),
], ids=["hier_per_tensor", "hier_2_packs", "hier_agg_small", "ring_per_tensor", "ring_2_packs", "one_device_bytes"])
def test_other_algorithms_match_numpy_with_shapes_and_dtypes(ops, options, grads):
  host, dist = grads
  for (shape, dtype), got, h in zip(GRAD_SPECS, batch_sum(ops, dist, options), host):
    assert got.shape == shape and got.dtype == np.dtype(dtype)
    if np.dtype(dtype) == np.int32:
      np.testing.assert_array_equal(got, h.sum(0))
    else:
      # Each algorithm adds the N terms in its own order, rounding to `dtype` (bf16, f16 too).
      assert_close(got, h.astype(np.float64).sum(0), rtol=max(1e-5, N * float(jnp.finfo(dtype).eps) / 2),
                   scale=np.abs(h.astype(np.float64)).sum(0))


def test_plan_rules():
  f32, i32 = np.dtype("float32"), np.dtype("int32")
  avals = [((2,), f32), ((3,), f32), ((1000,), f32), ((4,), f32), ((1,), i32), ((5,), f32), ((6,), f32),
           ((7,), f32)]
  plan = all_reduce.plan
  # num_packs: per dtype, everything concatenated then cut into k slices (the last takes the remainder).
  assert [(b.indices, b.num_splits) for b in plan(avals, ("split", 2))] == [((0, 1, 2, 3, 5, 6, 7), 2), ((4,), 2)]
  assert all_reduce.split_sizes(1027, 2) == [513, 514]
  assert all_reduce.split_sizes(1, 2) == [1]
  # Small tensors: runs of consecutive small tensors of one dtype, at most max_group per group; a run of
  # one stays alone, a large tensor or a new dtype ends a run.
  assert [b.indices for b in plan(avals, ("small", 64, 2))] == [(0, 1), (2,), (3,), (4,), (5, 6), (7,)]
  assert [b.indices for b in plan(avals, ("small", 64, 10))] == [(0, 1), (2,), (3,), (4,), (5, 6, 7)]
  # bytes_per_pack (TF's group_by_size): in order, a new pack once the current one holds more than b bytes.
  four = [((1,), f32)] * 4
  assert [b.indices for b in plan(four, ("bytes", 5))] == [(0, 1), (2, 3)]
  assert [b.indices for b in plan(four, ("bytes", 3))] == [(0,), (1,), (2,), (3,)]
  assert [b.indices for b in plan(avals, ("bytes", 1 << 20))] == [(0, 1, 2, 3, 5, 6, 7), (4,)]
  assert [b.indices for b in plan(avals, ("tensor",))] == [(i,) for i in range(8)]


def test_repacking_rules_in_tf_order_of_precedence():
  both = AllReduceCrossDeviceOps(num_packs=2, agg_small_grads_max_bytes=100, agg_small_grads_max_group=3)
  assert both._packing(CommunicationOptions()) == ("split", 2)  # 1) num_packs
  agg = AllReduceCrossDeviceOps(num_packs=0, agg_small_grads_max_bytes=100, agg_small_grads_max_group=3)
  assert agg._packing(CommunicationOptions()) == ("small", 100, 3)  # 2) small-tensor aggregation
  assert AllReduceCrossDeviceOps(num_packs=0)._packing(CommunicationOptions()) == ("tensor",)  # 3) none
  assert both._packing(CommunicationOptions(bytes_per_pack=7)) == ("bytes", 7)  # a per-call option wins
  assert ReductionToOneDevice()._packing(CommunicationOptions()) == ("tensor",)


# -- the collectives each implementation compiles to --------------------------------------------------


def lowered_collectives(strategy, ops, options=None, shapes=((3, 3, 4, 8), (8,), (8,), (100,), (5,), (7, 7), ())):
  def body(*xs):
    return tuple(ops.all_reduce_in_replica_context("sum", [x[0] for x in xs], options))

  args = [jax.ShapeDtypeStruct((N,) + s, jnp.float32, sharding=NamedSharding(strategy.mesh, P("replica")))
          for s in shapes]
  fn = jax.jit(jax.shard_map(body, mesh=strategy.mesh, in_specs=P("replica"), out_specs=P()))
  text = fn.lower(*args).as_text()
  return {k: text.count(f"stablehlo.{k}") for k in ("all_reduce", "collective_permute", "all_gather", "case")}


@pytest.mark.parametrize("name,options,want", [
    ("nccl_per_tensor", None, {"all_reduce": 7}),
    ("nccl", None, {"all_reduce": 1}),
    ("nccl_3_packs", None, {"all_reduce": 3}),
    # <= 64 bytes: (8,), (8,), (5,), (); the large (3,3,4,8), (100,), (7,7) break the runs: 1 group of 2
    ("agg_small", None, {"all_reduce": 6}),
    ("hierarchical", None, {"collective_permute": 7}),  # 3 copies in, 1 swap, 3 copies out
    ("hierarchical_per_tensor", None, {"collective_permute": 49}),
    ("nccl", RING, {"collective_permute": 14}),  # 7 reduce-scatter + 7 all-gather steps
    ("one_device", None, {"collective_permute": 70, "case": 7}),  # per tensor: 7 copies in, 3 tree rounds
    # packs of > 600 bytes, in order: [1152 B], [32 + 32 + 400 + 20 + 196 B], [4 B]
    ("nccl_per_tensor", CommunicationOptions(bytes_per_pack=600), {"all_reduce": 3}),
])
def test_each_implementation_compiles_to_its_own_collectives(strategy, name, options, want):
  got = lowered_collectives(strategy, IMPLS[name], options)
  assert got == {"all_reduce": 0, "collective_permute": 0, "all_gather": 0, "case": 0, **want}


# -- inside strategy.run ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["one_device", "one_device@cpu3", "nccl", "nccl_per_tensor", "hierarchical",
                                  "agg_small", "ring"])
def test_all_reduce_in_run_matches_psum_with_gradients(strategy, impl):
  ops, options = (NcclAllReduce(1), RING) if impl == "ring" else (IMPLS[impl], None)
  x = per_replica(strategy, lambda r: {"a": np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1),
                                       "b": np.float32(r), "i": np.int32(r)})

  def step(v):
    reduced = ops.all_reduce_in_replica_context("sum", v, options)
    mean = ops.all_reduce_in_replica_context("mean", v["a"], options)
    invariant = ops.all_reduce_in_replica_context("sum", jnp.float32(1.5), options)
    loss = lambda t: jnp.sum(ops.all_reduce_in_replica_context("sum", t, options) ** 2)
    grad = jax.grad(loss)(v["a"])
    want_grad = jax.grad(lambda t: jnp.sum(lax.psum(t, "replica") ** 2))(v["a"])
    return reduced, mean, invariant, grad, want_grad

  # `invariant` deliberately sums a value that is the same on every replica: N times it, with a warning.
  with pytest.warns(AlreadyReplicatedWarning, match=r"all_reduce_in_replica_context\(SUM\): the value"):
    reduced, mean, invariant, grad, want_grad = strategy.run(step, args=(x,))
  for out in (reduced["a"], reduced["b"], reduced["i"], mean, invariant):
    assert isinstance(out, tpustrat.Mirrored)
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  np.testing.assert_array_equal(reduced["a"].values[2], a * 36)
  assert float(reduced["b"].values[0]) == 28.0
  assert reduced["i"].values[0].dtype == np.int32 and int(reduced["i"].values[5]) == 28
  np.testing.assert_array_equal(mean.values[7], a * 4.5)
  assert float(invariant.values[0]) == N * 1.5
  np.testing.assert_array_equal(np.asarray(grad.tree), np.asarray(want_grad.tree))


def test_in_run_result_is_one_value(strategy):
  # The permute-based algorithms leave bit-identical copies, so declaring the result replicated is true.
  x = per_replica(strategy, lambda r: np.random.default_rng(r).normal(size=(1000,)).astype(np.float32))
  for ops in (IMPLS["hierarchical"], IMPLS["one_device"]):
    for opts in (None, RING):
      out = strategy.run(lambda v, ops=ops, opts=opts: (ops.all_reduce_in_replica_context("sum", v, opts),
                                                        ops.all_reduce_in_replica_context("sum", v, opts) * 1.0
                                                        + 0.0 * lax.axis_index("replica")), args=(x,))
      copies = np.asarray(out[1].tree)
      assert all((c == copies[0]).all() for c in copies)


# -- bad input: TF's errors ---------------------------------------------------------------------------


def test_constructor_errors():
  with pytest.raises(ValueError, match=r"NCCL all-reduce requires num_packs >= 0, but -1 is specified"):
    NcclAllReduce(num_packs=-1)
  with pytest.raises(ValueError, match=r"HierarchicalCopy requires num_packs >= 0, but -2 is specified"):
    HierarchicalCopyAllReduce(num_packs=-2)
  with pytest.raises(ValueError, match=r"requires num_packs >= 0"):
    AllReduceCrossDeviceOps(num_packs=-1)
  with pytest.raises(TypeError, match="NCCL all-reduce: `num_packs` must be an int, got float 1.5"):
    NcclAllReduce(num_packs=1.5)
  for alg in ("ring", "NCCLX", None):
    with pytest.raises(ValueError, match=r"Unknown all_reduce_alg .*'nccl' or 'hierarchical_copy'"):
      AllReduceCrossDeviceOps(all_reduce_alg=alg)
  for max_bytes, max_group in ((100, 0), (100, -3), (-5, 10)):
    with pytest.raises(ValueError, match="should both be greater than zero"):
      AllReduceCrossDeviceOps(num_packs=0, agg_small_grads_max_bytes=max_bytes, agg_small_grads_max_group=max_group)
  AllReduceCrossDeviceOps(num_packs=1, agg_small_grads_max_bytes=100, agg_small_grads_max_group=0)  # num_packs wins
  AllReduceCrossDeviceOps(num_packs=0, agg_small_grads_max_bytes=0, agg_small_grads_max_group=0)  # not asked for
  with pytest.raises(TypeError, match="reduce_to_device"):
    ReductionToOneDevice(reduce_to_device=3)
  with pytest.raises(TypeError, match="accumulation_fn must be callable"):
    ReductionToOneDevice(accumulation_fn="add")


def test_options_errors():
  with pytest.raises(ValueError, match=r"CommunicationOptions: `bytes_per_pack` must be an int >= 0, got int -1\."):
    CommunicationOptions(bytes_per_pack=-1)
  with pytest.raises(ValueError, match="`bytes_per_pack` must be an int >= 0, got float 1.5"):
    CommunicationOptions(bytes_per_pack=1.5)
  with pytest.raises(ValueError, match="timeout_seconds"):
    CommunicationOptions(timeout_seconds=0)
  with pytest.raises(ValueError, match="implementation must be"):
    CommunicationOptions(implementation="fast")
  assert CommunicationOptions(implementation="nccl").implementation is CommunicationImplementation.NCCL
  merged = CommunicationOptions(bytes_per_pack=10).merge(CommunicationOptions(implementation="ring"))
  assert merged == CommunicationOptions(bytes_per_pack=10, implementation=CommunicationImplementation.RING)


def test_value_destination_pairs_errors(d):
  ops = IMPLS["nccl"]
  for bad in (d, {"a": (d, d)}, (p for p in [(d, d)]), "dd"):
    with pytest.raises(ValueError, match="should be a list or tuple"):
      ops.batch_reduce("sum", bad)
  with pytest.raises(ValueError, match="should be a tuple"):
    ops.batch_reduce("sum", [d, d])
  with pytest.raises(ValueError, match="tuple of size 2"):
    ops.batch_reduce("sum", [(d, d, d)])
  with pytest.raises(ValueError, match="Cannot convert the value of pair 1"):
    ops.batch_reduce("sum", [(d, d), (np.ones(3), d)])
  assert ops.batch_reduce("sum", []) == []


@pytest.mark.parametrize("bad", [np.ones(3), 3.0, "x", None, [1.0, 2.0]])
def test_value_that_cannot_be_distributed(bad, d):
  with pytest.raises(ValueError, match="Cannot convert per_replica_value to a DistributedValues"):
    IMPLS["nccl"].reduce("sum", bad, destinations=d)


def test_sharded_array_is_not_a_distributed_value(strategy, d):
  x = jax.device_put(jnp.zeros((N, 2)), NamedSharding(strategy.mesh, P("replica")))
  with pytest.raises(ValueError, match="neither one tensor on one device nor replicated"):
    IMPLS["one_device"].reduce("sum", x, destinations=d)


@pytest.mark.parametrize("bad,match", [
    (None, "destinations must be one of"), (3, "destinations must be one of"), ([0, 1], "destinations must be one of"),
    ("", "destinations can not be empty"), ("/gpu:0", "has 0 GPU"), ("/cpu:99", "has 8 CPU"),
    ("bogus", "cannot parse the device string"),
])
def test_bad_destinations(bad, match, d):
  with pytest.raises(ValueError, match=match):
    IMPLS["nccl"].reduce("sum", d, destinations=bad)
  with pytest.raises(ValueError, match=match):
    IMPLS["nccl"].broadcast(1.0, bad)
  with pytest.raises(ValueError, match=match):
    IMPLS["nccl"].batch_reduce("sum", [(d, d), (d, bad)])


def test_other_bad_input(strategy, d):
  with pytest.raises(ValueError, match="Unknown reduce op 'max'"):
    IMPLS["nccl"].reduce("max", d, d)
  with pytest.raises(TypeError, match="options"):
    IMPLS["nccl"].reduce("sum", d, d, options={"bytes_per_pack": 4})
  with pytest.raises(ValueError, match="broadcast expects one tensor"):
    IMPLS["nccl"].broadcast(d, d)
  wrong = ReductionToOneDevice(accumulation_fn=lambda xs: jnp.stack(xs))
  with pytest.raises(ValueError, match="accumulation_fn must return one tensor"):
    wrong.reduce("sum", d, d)
  with pytest.raises(RuntimeError, match="cross-replica context"):
    strategy.run(lambda: IMPLS["nccl"].reduce("sum", d, d))


def test_base_class_hooks_are_abstract(d):
  with pytest.raises(NotImplementedError):
    CrossDeviceOps().reduce("sum", d, d)
  with pytest.raises(NotImplementedError):
    CrossDeviceOps().batch_reduce("sum", [(d, d)])
  assert values_of(CrossDeviceOps().broadcast(2.0, "/cpu:1"))[1] == [2.0]


# -- MirroredStrategy ---------------------------------------------------------------------------------


class SpyOps(NcclAllReduce):
  """Counts what the strategy calls."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.calls = []

  def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
    self.calls.append(("reduce", reduce_op, options))
    return super().reduce_implementation(reduce_op, per_replica_value, destinations, options)

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
    self.calls.append(("batch_reduce", reduce_op, len(value_destination_pairs)))
    return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)

  def broadcast_implementation(self, tensor, destinations):
    self.calls.append(("broadcast",))
    return super().broadcast_implementation(tensor, destinations)

  def all_reduce_in_replica_context(self, reduce_op, value, options=None, *, axis_name="replica"):
    self.calls.append(("all_reduce", options))
    return super().all_reduce_in_replica_context(reduce_op, value, options, axis_name=axis_name)


@pytest.fixture(scope="module")
def spy():
  return SpyOps(num_packs=2)


@pytest.fixture(scope="module")
def mirrored(spy):
  return MirroredStrategy(cross_device_ops=spy)


def test_mirrored_strategy_shares_the_run_engine(mirrored):
  assert isinstance(mirrored, tpustrat.Strategy) and mirrored.num_replicas_in_sync == N
  assert mirrored.extended.worker_devices == tuple(jax.devices())
  with pytest.warns(AlreadyReplicatedWarning, match=r"ReplicaContext.all_reduce\(SUM\).*N=8"):  # x: the same everywhere
    total, local = mirrored.run(lambda x: (tpustrat.get_replica_context().all_reduce("sum", x),
                                           x * tpustrat.get_replica_context().replica_id_in_sync_group),
                                args=(2.0,))
  assert isinstance(total, tpustrat.Mirrored) and float(total.values[0]) == 16.0
  assert isinstance(local, tpustrat.PerReplica)
  assert float(mirrored.reduce("sum", local, axis=None)) == 56.0


def test_mirrored_strategy_devices_and_default_ops():
  two = MirroredStrategy(["/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:3"])
  assert two.num_replicas_in_sync == 2
  assert list(two.mesh.devices.flat) == [jax.devices()[0], jax.devices()[3]]
  assert list(MirroredStrategy(jax.devices()[4:7]).mesh.devices.flat) == jax.devices()[4:7]
  ops = two.extended.cross_device_ops
  assert repr(ops) == repr(cross_device.default_cross_device_ops()) == (
      "AllReduceCrossDeviceOps(all_reduce_alg='nccl', num_packs=0, agg_small_grads_max_bytes=32768, "
      "agg_small_grads_max_group=10)")
  value = per_replica(two, lambda r: np.float32(r + 1))
  assert values_of(two.extended.reduce_to("sum", value, value)) == ({jax.devices()[0], jax.devices()[3]}, [3.0, 3.0])


def test_mirrored_strategy_errors():
  with pytest.raises(ValueError, match="empty `devices` list"):
    MirroredStrategy([])
  with pytest.raises(ValueError, match="No duplicates allowed"):
    MirroredStrategy(["/cpu:0", "/device:CPU:0"])
  with pytest.raises(ValueError, match="has 0 GPU"):
    MirroredStrategy(["/gpu:0"])
  with pytest.raises(TypeError, match="list of device strings"):
    MirroredStrategy("/cpu:0")
  with pytest.raises(TypeError, match="device strings or jax.Device"):
    MirroredStrategy([0, 1])
  with pytest.raises(TypeError, match="cross_device_ops must be a tpustrat.CrossDeviceOps"):
    MirroredStrategy(cross_device_ops="nccl")


def test_extended_methods_go_through_the_configured_ops(mirrored, spy):
  d = per_replica(mirrored, lambda r: np.float32(r))
  e = per_replica(mirrored, lambda r: np.float32(r + 1))
  spy.calls.clear()
  opts = CommunicationOptions(bytes_per_pack=64)
  assert values_of(mirrored.extended.reduce_to("mean", d, d, opts))[1] == [3.5] * N
  assert values_of(mirrored.extended.reduce_to(tpustrat.ReduceOp.SUM, e, "/cpu:2"))[1] == [36.0]
  out = mirrored.extended.batch_reduce_to("sum", [(d, d), (e, e)])
  assert [values_of(o)[1][0] for o in out] == [28.0, 36.0]
  tree = mirrored.extended.reduce_to("sum", {"d": d, "e": e, "zero": 0}, d)  # a pytree: one batch
  assert float(tree["d"].values[0]) == 28.0 and float(tree["e"].values[0]) == 36.0 and tree["zero"] == 0
  assert values_of(mirrored.extended.broadcast_to(jnp.float32(1.0), d))[1] == [1.0] * N
  assert spy.calls == [("reduce", tpustrat.ReduceOp.MEAN, opts), ("reduce", tpustrat.ReduceOp.SUM, CommunicationOptions()),
                       ("batch_reduce", tpustrat.ReduceOp.SUM, 2), ("batch_reduce", tpustrat.ReduceOp.SUM, 2),
                       ("broadcast",)]


def test_extended_non_distributed_values_follow_tf(mirrored, spy):
  d = per_replica(mirrored, lambda r: np.float32(r))
  m = mirrored.run(lambda: jnp.float32(3.0))
  assert mirrored.extended.reduce_to("mean", m, d) is m
  assert mirrored.extended.reduce_to("sum", 0, d) == 0
  assert values_of(mirrored.extended.reduce_to("mean", jnp.float32(2.0), d))[1] == [2.0] * N
  with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
    mirrored.extended.reduce_to("sum", jnp.float32(2.0), d)
  assert mirrored.extended.broadcast_to(1.0, d) == 1.0  # Python numbers are returned as they are
  with pytest.raises(RuntimeError, match="cross-replica context"):
    mirrored.run(lambda: mirrored.extended.reduce_to("sum", d, d))


def test_replica_all_reduce_hook_uses_the_configured_ops(mirrored, spy, strategy):
  spy.calls.clear()
  opts = CommunicationOptions(implementation="ring")

  def step():
    r = tpustrat.get_replica_context().replica_id_in_sync_group.astype(jnp.float32)
    return mirrored.extended._replica_all_reduce("sum", {"r": r}, opts, "replica")

  out = mirrored.run(step)
  assert isinstance(out["r"], tpustrat.Mirrored) and float(out["r"].values[3]) == 28.0
  assert spy.calls == [("all_reduce", opts)]
  # An extended without configured ops (TPUStrategy's, once it has the mixin) and no options: plain psum.
  class Plain(cross_device.CrossDeviceExtendedMixin):
    _strategy = strategy

  plain = strategy.run(lambda: Plain()._replica_all_reduce(
      "mean", tpustrat.get_replica_context().replica_id_in_sync_group * 1.0, None, "replica"))
  assert float(plain.values[0]) == 3.5


def test_replica_context_all_reduce_routes_through_cross_device_ops(mirrored, spy):
  spy.calls.clear()
  opts = CommunicationOptions(bytes_per_pack=16)
  out = mirrored.run(lambda: tpustrat.get_replica_context().all_reduce(
      "sum", jnp.float32(1.0) * tpustrat.get_replica_context().replica_id_in_sync_group, opts))
  assert float(out.values[0]) == 28.0
  assert spy.calls == [("all_reduce", opts)]


# -- reductions in flight -----------------------------------------------------------------------------


def test_wait_on_picks_the_smallest_output_else_the_token():
  big, mid, small = jnp.zeros((64, 1024)), jnp.zeros((16,)), jnp.zeros((), jnp.int32)
  assert ops_lib._wait_on([big, mid, small], (), []) is small
  assert ops_lib._wait_on([big, mid, small], (), [small]) is mid  # an input returned as is is ready already
  token = jnp.zeros((), jnp.int8)
  assert ops_lib._wait_on([big], (token,), []) is token


def test_reductions_in_flight_wait_on_the_smallest_output(strategy, monkeypatch):
  # A 256 KiB result first, a scalar second: the next reductions wait for the scalar, not for the large
  # buffer (which waiting would keep alive two reductions longer). With only large results, a token.
  big = per_replica(strategy, lambda r: np.full((64, 1024), r, np.float32))
  small = per_replica(strategy, lambda r: np.float32(r))
  ops = NcclAllReduce(num_packs=0)
  dispatch, tokens = engine.dispatch, []

  def spy(program, *args, **kwargs):
    assert kwargs == {}  # the process-wide bound, engine.DEFAULT_STEPS_IN_FLIGHT in flight

    def recording(*xs):
      result, token = program(*xs)
      tokens.append(token)
      return result, token

    return dispatch(recording, *args, **kwargs)

  monkeypatch.setattr(engine, "dispatch", spy)
  total_big, total_small = ops.batch_reduce("sum", [(big, big), (small, small)])
  waited = tokens[-1]
  assert waited.shape == () and waited.dtype == np.float32 and float(waited) == 28.0
  np.testing.assert_array_equal(total_big.values[0], np.full((64, 1024), 28.0))
  ops.reduce("sum", big, big)
  token = tokens[-1]
  assert token.shape == () and token.dtype == np.int8
  assert len(tokens) == 2


# -- review regressions: reduce_to of nested values ----------------------------------------------------


class _CountingOps(AllReduceCrossDeviceOps):
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
def counting_mirrored(counting):
  return MirroredStrategy(cross_device_ops=counting)


def test_reduce_to_mean_of_a_nested_mirrored_is_the_value_itself(counting_mirrored):
  # TF (and `reduce_to` on a Mirrored itself) return a Mirrored value unchanged for MEAN; inside a pytree
  # it went through sum-of-n-copies / n, which is not exact in floating point.
  vals = np.random.default_rng(0).normal(size=1000).astype(np.float32)
  m = counting_mirrored.run(lambda: jnp.asarray(vals))
  d = counting_mirrored.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  out = counting_mirrored.extended.reduce_to("mean", {"m": m, "d": d}, d)
  assert out["m"] is m
  np.testing.assert_array_equal(np.asarray(out["m"].values[0]), vals)
  assert float(out["d"].values[0]) == np.mean(np.arange(N, dtype=np.float64))


def test_reduce_to_rejects_a_bad_leaf_before_reducing_anything(counting_mirrored, counting):
  d = counting_mirrored.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  counting.batches = 0
  with pytest.raises(ValueError, match="cannot be reduced with the given reduce op"):
    counting_mirrored.extended.reduce_to("sum", {"d": d, "plain": jnp.ones(3)}, d)
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
  ops = ReductionToOneDevice(reduce_to_device=device)
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
        "mean", jnp.float32(1.0), CommunicationOptions(bytes_per_pack=4)))


def test_reduce_to_device_outside_the_mesh_still_works_cross_replica(monkeypatch):
  # TF's ReductionToOneDevice copies the components to any device in the cross-replica context: kept.
  ops = ReductionToOneDevice(reduce_to_device=jax.devices()[7])
  strategy = _four(ops)
  seen = []
  accumulate = all_reduce.accumulate_on_device
  monkeypatch.setattr(all_reduce, "accumulate_on_device",
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
  strategy = _four(ReductionToOneDevice(reduce_to_device="/cpu:6"))
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
  ops = ReductionToOneDevice(reduce_to_device="/cpu:99")
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
    ops = ReductionToOneDevice(reduce_to_device=device)
    fn = jax.jit(jax.shard_map(lambda v, ops=ops: ops.all_reduce_in_replica_context("sum", v[0]), mesh=mesh,
                               in_specs=P("replica"), out_specs=P()))
    with pytest.raises(ValueError, match=r"no current strategy has a mesh with the axis 'replica' of size 8"):
      fn(x)
  # Without reduce_to_device the first replica sums, as before.
  ops = ReductionToOneDevice()
  fn = jax.jit(jax.shard_map(lambda v: ops.all_reduce_in_replica_context("sum", v[0]), mesh=mesh,
                             in_specs=P("replica"), out_specs=P()))
  assert float(fn(x)) == sum(range(N))
