"""Strategy.reduce / gather / experimental_local_results / values_from_function, against numpy and TF's docs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, backend_compiles, compiled_programs

import tpustrat

N = 8


@pytest.fixture(scope="module")
def two():
  return tpustrat.TPUStrategy(device_assignment=jax.devices()[:2])


@pytest.fixture(scope="module")
def one():
  return tpustrat.TPUStrategy(device_assignment=jax.devices()[:1])


def distribute(strategy, arr):
  return strategy.experimental_distribute_values_from_function(lambda ctx: arr[ctx.replica_id_in_sync_group])


def test_tf_doc_example_global_batch_of_8_on_2_replicas(two):
  # TF: examples [0, 1, 2, 3] on replica 0 and [4, 5, 6, 7] on replica 1.
  value = distribute(two, np.arange(8, dtype=np.float32).reshape(2, 4))
  np.testing.assert_array_equal(two.reduce("SUM", value, axis=None), [0 + 4, 1 + 5, 2 + 6, 3 + 7])
  assert float(two.reduce(tpustrat.ReduceOp.SUM, value, axis=0)) == sum(range(8))
  assert float(two.reduce("mean", value, axis=0)) == np.mean(np.arange(8))


@pytest.mark.parametrize("op", ["sum", "SUM", "mean", "MEAN", tpustrat.ReduceOp.SUM, tpustrat.ReduceOp.MEAN])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, -2])
def test_reduce_per_replica_matches_numpy(strategy, rng, op, axis):
  x = rng.normal(size=(N, 3, 5)).astype(np.float32)
  got = strategy.reduce(op, distribute(strategy, x), axis=axis)
  is_sum = str(getattr(op, "value", op)).upper() == "SUM"
  axes = (0,) if axis is None else (0, axis % 2 + 1)
  x64 = x.astype(np.float64)
  want, scale = (x64.sum(axes), np.abs(x).sum(axes)) if is_sum else (x64.mean(axes), np.abs(x).mean(axes))
  assert_close(got, want, scale=scale)  # up to 40 terms
  assert got.sharding.is_fully_replicated


def test_mean_with_axis_divides_by_true_number_of_elements(strategy):
  # Components of 3 examples on each of 8 replicas: MEAN over axis 0 divides by 24, not by 8.
  x = np.arange(N * 3, dtype=np.float32).reshape(N, 3)
  got = strategy.reduce("MEAN", distribute(strategy, x), axis=0)
  assert float(got) == pytest.approx(x.sum() / 24)
  # The mean of per-replica means weighs replicas, not examples; equal here, so compare to numpy too.
  assert float(got) == pytest.approx(x.mean())


def test_reduce_of_run_results_pytree(strategy, rng):
  x = rng.normal(size=(N, 4)).astype(np.float32)

  def fn(v):
    return {"per_example": v * 2, "total": tpustrat.get_replica_context().all_reduce("sum", v.sum())}

  out = strategy.run(fn, args=(distribute(strategy, x),))
  got = strategy.reduce("sum", out, axis=None)
  x64 = x.astype(np.float64)
  assert_close(got["per_example"], (x64 * 2).sum(0), scale=2 * np.abs(x).sum(0))
  # A Mirrored value counts once per replica, as in TF's TPUStrategy (add_n over the replicas' copies).
  assert_close(got["total"], N * x64.sum(), scale=N * np.abs(x).sum())
  mean = strategy.reduce("mean", out["total"], axis=None)
  assert_close(mean, x64.sum(), scale=np.abs(x).sum())


def test_reduce_plain_values_follow_tf(strategy):
  assert float(strategy.reduce("mean", jnp.float32(3.0), axis=None)) == 3.0
  with pytest.raises(ValueError, match="cannot be reduced with reduce op SUM"):
    strategy.reduce("sum", jnp.float32(3.0), axis=None)


def test_reduce_bad_input(strategy):
  value = distribute(strategy, np.ones((N, 3), np.float32))
  with pytest.raises(ValueError, match=r"Unknown reduce op 'max'"):
    strategy.reduce("max", value, axis=None)
  with pytest.raises(ValueError, match=r"`axis` = 1 out of range for `value` with rank 1"):
    strategy.reduce("sum", value, axis=1)
  with pytest.raises(ValueError, match=r"`axis` = -2 out of range"):
    strategy.reduce("mean", value, axis=-2)
  scalar = distribute(strategy, np.ones((N,), np.float32))
  with pytest.raises(ValueError, match=r"`axis` = 0 out of range for `value` with rank 0"):
    strategy.reduce("sum", scalar, axis=0)


def test_gather_tf_doc_examples(two):
  # TF: a component of shape (2, 1) on each of 2 replicas.
  value = two.experimental_distribute_values_from_function(lambda _: np.array([[1], [2]], np.int32))
  np.testing.assert_array_equal(two.gather(value, axis=0), [[1], [2], [1], [2]])
  np.testing.assert_array_equal(two.gather(value, axis=1), [[1, 1], [2, 2]])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_matches_numpy_concatenate(strategy, rng, axis):
  x = rng.normal(size=(N, 2, 3)).astype(np.float32)
  got = strategy.gather(distribute(strategy, x), axis=axis)
  np.testing.assert_array_equal(got, np.concatenate(list(x), axis=axis))
  mirrored = strategy.run(lambda: jnp.asarray(x[0]))
  np.testing.assert_array_equal(strategy.gather(mirrored, axis=axis), np.concatenate([x[0]] * N, axis=axis))


def test_gather_rejects_scalars_and_bad_axis(strategy):
  with pytest.raises(ValueError, match="rank >= 1"):
    strategy.gather(distribute(strategy, np.ones(N, np.float32)), axis=0)
  with pytest.raises(ValueError, match=r"`axis` = 2 out of range"):
    strategy.gather(distribute(strategy, np.ones((N, 3), np.float32)), axis=2)


def test_local_results(strategy, rng):
  x = rng.normal(size=(N, 3)).astype(np.float32)
  value = distribute(strategy, x)
  results = strategy.experimental_local_results(value)
  assert isinstance(results, tuple) and len(results) == N
  for r, component in enumerate(results):
    np.testing.assert_array_equal(component, x[r])
    assert component.devices() == {strategy.extended.worker_devices[r]}  # stays on its replica's device
  assert strategy.experimental_local_results(5.0) == (5.0,)
  pair = strategy.experimental_local_results({"a": value, "b": 1})
  assert len(pair) == N and pair[2]["b"] == 1
  np.testing.assert_array_equal(pair[2]["a"], x[2])


@pytest.mark.parametrize("dtype, tail", [(np.float32, (13, 7, 3)), (np.int8, (11,)), (np.bool_, (2, 9)),
                                         (jnp.bfloat16, (17,)), (np.float32, (0, 3))])
def test_local_results_come_out_of_one_program_for_every_replica(strategy, rng, dtype, tail):
  # Components of at least one axis: one program splits the value into them for all the replicas (it was one
  # reshape compiled per device: N programs for every new shape), each on its replica's device, bit for bit.
  x = (rng.normal(size=(N, *tail)) * 4).astype(dtype)
  value = distribute(strategy, x)
  results, compiles = backend_compiles(lambda: strategy.experimental_local_results(value))
  assert compiles <= 1  # a shape no other test uses: one program, not one per device (N before)
  assert len(results) == N
  for r, component in enumerate(results):
    assert component.shape == tail and component.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(component), x[r])
    assert component.devices() == {strategy.extended.worker_devices[r]}
  _, compiles = backend_compiles(lambda: strategy.experimental_local_results(distribute(strategy, x + x)))
  assert compiles == 0  # the same shape again: nothing compiled


def test_local_results_of_scalars_and_keys(strategy):
  # A scalar component cannot be a block of a split axis: each device reshapes its own (cached per dtype).
  # PRNG keys (an extended dtype) go the same way.
  scalars = strategy.experimental_local_results(distribute(strategy, np.arange(N, dtype=np.int32) * 3))
  assert [(s.shape, int(s)) for s in scalars] == [((), 3 * r) for r in range(N)]
  assert [s.devices() for s in scalars] == [{d} for d in strategy.extended.worker_devices]
  keys = strategy.experimental_distribute_values_from_function(lambda ctx: jax.random.key(ctx.replica_id_in_sync_group))
  got = strategy.experimental_local_results(keys)
  for r, key in enumerate(got):
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(jax.random.key(r)))


def test_values_from_function_tf_doc_examples(one, strategy):
  # 1. A constant per replica.
  local = one.experimental_local_results(one.experimental_distribute_values_from_function(lambda ctx: 1.0))
  assert len(local) == 1 and float(local[0]) == 1.0
  # 2. Values from an array, by replica id.
  array_value = np.array([3.0, 2.0, 1.0], np.float32)
  local = one.experimental_local_results(one.experimental_distribute_values_from_function(
      lambda ctx: array_value[ctx.replica_id_in_sync_group]))
  assert [float(v) for v in local] == [3.0]
  # 3. num_replicas_in_sync.
  local = one.experimental_local_results(one.experimental_distribute_values_from_function(
      lambda ctx: ctx.num_replicas_in_sync))
  assert [int(v) for v in local] == [1]
  local = strategy.experimental_local_results(strategy.experimental_distribute_values_from_function(
      lambda ctx: ctx.num_replicas_in_sync))
  assert [int(v) for v in local] == [N] * N
  # 4. Values already placed on the workers' devices.
  placed = [jax.device_put(jnp.float32(r), d) for r, d in enumerate(strategy.extended.worker_devices)]
  value = strategy.experimental_distribute_values_from_function(lambda ctx: placed[ctx.replica_id_in_sync_group])
  assert [float(v) for v in strategy.experimental_local_results(value)] == list(range(N))


def test_values_from_function_rejects_mismatched_components(strategy):
  with pytest.raises(ValueError, match=r"shape \(2,\) for replica 1 but \(1,\) for replica 0"):
    strategy.experimental_distribute_values_from_function(lambda ctx: np.zeros(ctx.replica_id_in_sync_group + 1))
  with pytest.raises(ValueError, match="same structure"):
    strategy.experimental_distribute_values_from_function(
        lambda ctx: (1.0,) if ctx.replica_id_in_sync_group else [1.0])


def test_per_replica_constructor(strategy, rng):
  x = rng.normal(size=(N, 2)).astype(np.float32)
  value = tpustrat.PerReplica(list(x))
  out = strategy.run(lambda v: v + 1, args=(value,))
  np.testing.assert_allclose(np.stack(out.values), x + 1)
  with pytest.raises(ValueError, match="same shape"):
    tpustrat.PerReplica([np.zeros(2), np.zeros(3)])
  with pytest.raises(TypeError, match="non-empty sequence"):
    tpustrat.PerReplica(np.zeros(3))


def test_local_results_broadcasts_a_mirrored_held_once(strategy):
  # A Mirrored over a host value has one copy; it must not cut the other PerReplica components off.
  x = np.arange(N, dtype=np.float32)
  results = strategy.experimental_local_results(
      {"a": distribute(strategy, x), "b": tpustrat.Mirrored(np.float32(2))})
  assert len(results) == N
  np.testing.assert_array_equal([float(r["a"]) for r in results], x)
  assert [float(r["b"]) for r in results] == [2.0] * N


def test_mirrored_values_with_a_host_leaf_keep_every_replica(strategy):
  on_devices = strategy.run(lambda: jnp.arange(3.0))  # Mirrored: one copy per device
  value = tpustrat.Mirrored({"a": on_devices.tree, "b": 3.0})
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


# -- integer MEAN: summed without wrapping around ---------------------------------------------------------


@pytest.mark.parametrize("dtype,values", [
    (np.int32, [2**28] * 8),  # the int32 sum is 2**31: it used to wrap to -2**31
    (np.int32, [2**30 + r for r in range(8)]),
    (np.int32, [-(2**31) + r for r in range(8)]),
    (np.uint32, [2**32 - 1 - r for r in range(8)]),
    (np.int16, [2**14 + r for r in range(8)]),
])
def test_integer_mean_does_not_overflow(strategy, dtype, values):
  v = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.full((3,), values[ctx.replica_id_in_sync_group], dtype))
  want = np.mean(np.asarray(values, np.float64))
  for axis in (None, 0):
    got = np.asarray(strategy.reduce("MEAN", v, axis=axis), np.float64)
    np.testing.assert_allclose(got, want, rtol=2 * np.finfo(np.float32).eps)


def test_integer_mean_of_a_padded_batch_does_not_overflow(strategy):
  rows = np.full((12,), 2**29, np.int32) + np.arange(12, dtype=np.int32)
  batch = next(iter(strategy.experimental_distribute_dataset([rows])))
  want = np.mean(rows.astype(np.float64))
  for axis in (None, 0):
    got = np.asarray(strategy.reduce("MEAN", batch, axis=axis), np.float64)
    np.testing.assert_allclose(got, want, rtol=2 * np.finfo(np.float32).eps)


def test_integer_mean_of_a_mirrored_value_is_the_value(strategy):
  ctx = tpustrat.get_replica_context
  m = strategy.run(lambda: ctx().all_reduce("sum", jnp.int32(2**27) + 0 * ctx().replica_id_in_sync_group))
  assert isinstance(m, tpustrat.Mirrored)
  np.testing.assert_allclose(np.asarray(strategy.reduce("MEAN", m, axis=None), np.float64), 2**30,
                             rtol=2 * np.finfo(np.float32).eps)


def test_integer_mean_over_many_elements_is_exact_to_float32(strategy):
  # More elements than one exact int32 chunk of 16-bit halves holds (2**15): chunks are added in float32.
  n = 3 * 2**15 + 5
  v = strategy.experimental_distribute_values_from_function(
      lambda ctx: (np.arange(n, dtype=np.int64) * 7919 % 2**31).astype(np.int32) - ctx.replica_id_in_sync_group)
  host = np.stack([(np.arange(n, dtype=np.int64) * 7919 % 2**31) - r for r in range(8)]).astype(np.float64)
  np.testing.assert_allclose(np.asarray(strategy.reduce("MEAN", v, axis=0), np.float64), host.mean(),
                             rtol=4 * np.finfo(np.float32).eps)


def test_reduce_and_gather_of_a_tree_are_one_program_each(strategy, rng):
  # 7 leaves of 7 shapes and 3 kinds (PerReplica, Mirrored, a plain array): one compiled program per call,
  # not one per leaf, and each result as numpy computes it.
  shapes = [(N, 3), (N, 5, 2), (N, 7), (N, 1, 4), (N, 6)]
  xs = [rng.normal(size=s).astype(np.float32) for s in shapes]
  per_replica = [distribute(strategy, x) for x in xs]
  ctx = tpustrat.get_replica_context
  mirrored = strategy.run(lambda: ctx().all_reduce("sum", jnp.arange(9.0) + ctx().replica_id_in_sync_group))
  tree = {"p": per_replica, "m": mirrored, "plain": np.arange(4, dtype=np.float32) + 0.5}
  got, names = compiled_programs(lambda: strategy.reduce("mean", tree, axis=None))
  assert names == ["jit(_leaves_program)"], names
  for g, x in zip(got["p"], xs):
    assert_close(g, x.astype(np.float64).mean(0), scale=np.abs(x).max())
  # A Mirrored counts once per replica: MEAN is its value, the sum over replicas of arange(9) + r.
  np.testing.assert_allclose(np.asarray(got["m"]), N * np.arange(9.0) + N * (N - 1) / 2, rtol=1e-6)
  np.testing.assert_array_equal(got["plain"], np.arange(4) + 0.5)
  # Every result lies on every device of the strategy, as before.
  assert all(g.sharding.device_set == set(strategy.extended.worker_devices) for g in jax.tree.leaves(got))

  gathered, names = compiled_programs(lambda: strategy.gather(per_replica, axis=0))
  assert names == ["jit(_leaves_program)"], names
  for g, x in zip(gathered, xs):
    np.testing.assert_array_equal(g, x.reshape((-1,) + x.shape[2:]))
  _, names = compiled_programs(lambda: strategy.reduce("mean", tree, axis=None))
  assert names == []  # the same structure and shapes again: nothing compiled


def test_reduce_of_leaves_committed_to_other_devices(strategy, rng):
  # A plain array the user placed on one device beside the strategy's values: both reduce, each where it
  # lies (one program for the strategy's devices, one for the other device).
  x = rng.normal(size=(N, 3)).astype(np.float32)
  lone = jax.device_put(np.float32(2.5), jax.devices()[3])
  got = strategy.reduce("mean", {"x": distribute(strategy, x), "lone": lone}, axis=None)
  assert_close(got["x"], x.astype(np.float64).mean(0), scale=np.abs(x).max())
  assert float(got["lone"]) == 2.5


def test_values_from_function_of_numpy_compiles_nothing_and_keeps_jax_types(strategy):
  # numpy components go to their devices without a compiled program (jnp.asarray compiles one per new
  # shape); each component is value_fn's value as jnp.asarray gives it: float64 as float32, int64 as int32
  # (within int32's range); later changes to value_fn's arrays do not show.
  host = np.arange(8 * 13 * 3, dtype=np.float64).reshape(8, 13, 3) / 7
  ints = np.arange(8 * 11, dtype=np.int64).reshape(8, 11) - 40
  flags = np.arange(8 * 5).reshape(8, 5) % 3 == 0

  def value_fn(ctx):
    r = ctx.replica_id_in_sync_group
    return {"f": host[r], "i": ints[r], "b": flags[r], "np_scalar": np.float64(r) / 3}

  value, names = compiled_programs(lambda: strategy.experimental_distribute_values_from_function(value_fn))
  assert names == [], names
  host[:] = -1  # after the call: TF has already captured the values
  for r, component in enumerate(strategy.experimental_local_results(value)):
    want = {"f": (np.arange(13 * 3).reshape(13, 3) + r * 39) / 7, "i": np.arange(11) - 40 + 11 * r,
            "b": (np.arange(5) + 5 * r) % 3 == 0, "np_scalar": r / 3}
    for key, want_value in want.items():
      like = jnp.asarray(np.asarray(want_value, {"f": np.float64, "i": np.int64, "b": bool,
                                                 "np_scalar": np.float64}[key]))
      assert component[key].dtype == like.dtype and not component[key].weak_type, key
      np.testing.assert_allclose(np.asarray(component[key]), want_value, rtol=1e-6, err_msg=key)

  # Python numbers: float32 / int32 / bool components, as TF's tensors of them; an int beyond int32 is
  # refused (jnp.asarray's OverflowError), never wrapped.
  scalars = strategy.experimental_distribute_values_from_function(
      lambda ctx: (0.5 * ctx.replica_id_in_sync_group, ctx.replica_id_in_sync_group - 3, True))
  for r, (f, i, b) in enumerate(strategy.experimental_local_results(scalars)):
    assert (f.dtype, float(f)) == (jnp.float32, 0.5 * r)
    assert (i.dtype, int(i)) == (jnp.int32, r - 3)
    assert (b.dtype, bool(b)) == (jnp.bool_, True)
  with pytest.raises(OverflowError, match="1099511627776"):
    strategy.experimental_distribute_values_from_function(lambda ctx: 2 ** 40)
