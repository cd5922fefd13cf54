"""Gradients w.r.t. Mirrored parameters inside `run`: JAX's already summed ones, TF's per-replica ones
(`tpustrat.local_copy`), and the `AlreadyReplicatedWarning` of a SUM of a value that is the same on every
replica (TF's ``grads = ctx.all_reduce("sum", grads)`` ported as it is)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat
import tpustrat.ops as ops
from tpustrat._src.collectives import AlreadyReplicatedWarning, local_copy
from tpustrat._src.cross_device import HierarchicalCopyAllReduce, NcclAllReduce
from tpustrat._src.mirrored_strategy import MirroredStrategy

N = 8
B, D = 4, 3  # examples per replica, features
FIX = r"tpustrat\.local_copy\(params\)"  # the fix the warning names


@pytest.fixture(scope="module", params=["tpu", "mirrored_nccl", "mirrored_hierarchical"])
def any_strategy(request):
  """`run` with plain psums (TPUStrategy) and through cross-device ops (MirroredStrategy)."""
  return {"tpu": lambda: tpustrat.TPUStrategy(),
          "mirrored_nccl": lambda: MirroredStrategy(cross_device_ops=NcclAllReduce()),
          "mirrored_hierarchical": lambda: MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())}[request.param]()


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(D,)).astype(np.float32), "b": np.float32(0.5)}
  x = rng.normal(size=(N, B, D)).astype(np.float32)
  y = rng.normal(size=(N, B)).astype(np.float32)
  return params, x, y


def loss_fn(params, x, y):
  """One replica's loss: the mean squared error over its own batch."""
  return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def np_local_grads(params, x, y):
  """Each replica's gradient of its own loss (TF's ``tape.gradient``), shape [N, ...] per parameter."""
  err = np.einsum("rbd,d->rb", x.astype(np.float64), params["w"]) + params["b"] - y  # [N, B]
  return {"w": 2 / B * np.einsum("rb,rbd->rd", err, x), "b": 2 / B * err.sum(1)}


def batches(strategy, x, y):
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: (x[ctx.replica_id_in_sync_group], y[ctx.replica_id_in_sync_group]))


def first(value):
  return np.asarray(value.values[0])


def already_replicated(caught):
  return [w for w in caught if issubclass(w.category, AlreadyReplicatedWarning)]


# -- TF's loop ----------------------------------------------------------------------------------------


def test_tf_loop_with_local_copy_gives_tf_numbers(any_strategy, problem):
  params, x, y = problem
  want = {k: v.sum(0) for k, v in np_local_grads(params, x, y).items()}  # TF: the sum of local gradients

  def step(params, batch):
    ctx = tpustrat.get_replica_context()
    local = jax.grad(loss_fn)(local_copy(params), *batch)  # this replica's own gradients
    grads = ctx.all_reduce("sum", local)  # TF's docstring loop, unchanged
    return local, grads, ctx.all_reduce("mean", local)

  # filterwarnings=error: any AlreadyReplicatedWarning would fail here.
  local, grads, mean = any_strategy.run(step, args=(any_strategy.experimental_mirror(params), batches(any_strategy, x, y)))
  assert isinstance(local["w"], tpustrat.PerReplica) and isinstance(grads["w"], tpustrat.Mirrored)
  per_replica = np_local_grads(params, x, y)
  for k in ("w", "b"):
    np.testing.assert_allclose(np.stack([np.asarray(v) for v in local[k].values]), per_replica[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(first(grads[k]), want[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(first(mean[k]), want[k] / N, rtol=1e-5, atol=1e-6)


def test_tf_loop_on_jax_gradients_warns_and_is_n_times_too_large(any_strategy, problem):
  params, x, y = problem
  want = {k: v.sum(0) for k, v in np_local_grads(params, x, y).items()}

  def step(params, batch):
    grads = jax.grad(loss_fn)(params, *batch)  # JAX: already summed over replicas, Mirrored
    return grads, tpustrat.get_replica_context().all_reduce("sum", grads)

  with pytest.warns(AlreadyReplicatedWarning, match=FIX) as caught:
    grads, twice = any_strategy.run(step, args=(any_strategy.experimental_mirror(params), batches(any_strategy, x, y)))
  assert len(already_replicated(caught)) == 1  # one warning for the call, not one per leaf
  message = str(caught[0].message)
  for words in ("ReplicaContext.all_reduce(SUM)", "2 of the 2 leaves", "already the same on every replica",
                "invariant over the replica axis", "multiplies it by N=8", "already summed them over replicas",
                "drop the all_reduce", "jax.grad w.r.t. Mirrored"):
    assert words in message, words
  assert caught[0].filename == __file__  # points at the user's call, not into tpustrat
  for k in ("w", "b"):
    assert isinstance(grads[k], tpustrat.Mirrored)
    np.testing.assert_allclose(first(grads[k]), want[k], rtol=1e-5, atol=1e-6)  # the fix: no all_reduce
    np.testing.assert_allclose(first(twice[k]), N * want[k], rtol=1e-5, atol=1e-5)  # the trap


def test_full_tf_training_step_with_local_copy(problem):
  strategy = tpustrat.TPUStrategy()
  params, x, y = problem
  lr = 0.1

  def train_step(params, batch):
    ctx = tpustrat.get_replica_context()
    grads = jax.grad(loss_fn)(local_copy(params), *batch)
    grads = ctx.all_reduce("sum", grads)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)

  state = strategy.experimental_mirror(params)
  expected = {k: np.asarray(v, np.float64) for k, v in params.items()}
  for _ in range(3):
    state = strategy.run(train_step, args=(state, batches(strategy, x, y)))
    grads = np_local_grads(expected, x, y)
    expected = {k: expected[k] - lr * grads[k].sum(0) for k in expected}
  for k in ("w", "b"):
    assert isinstance(state[k], tpustrat.Mirrored)
    np.testing.assert_allclose(first(state[k]), expected[k], rtol=1e-5, atol=1e-5)


# -- when the warning fires ---------------------------------------------------------------------------


def test_a_varying_value_does_not_warn(strategy):
  def step():
    r = tpustrat.get_replica_context().replica_id_in_sync_group.astype(jnp.float32)
    return tpustrat.get_replica_context().all_reduce("sum", {"a": r, "b": r * 2}), ops.cross_replica_sum(r, [[0, 1, 2, 3], [4, 5, 6, 7]])

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    total, grouped = strategy.run(step)
  assert not already_replicated(caught)
  assert float(first(total["a"])) == 28.0 and float(first(total["b"])) == 56.0
  np.testing.assert_array_equal([float(v) for v in grouped.values], [6.0] * 4 + [22.0] * 4)


def test_python_numbers_and_constants_do_not_warn(strategy):
  # TF's idiom to count replicas: a constant cannot be a gradient.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    count, ones = strategy.run(lambda: (tpustrat.get_replica_context().all_reduce("sum", 1),
                                        tpustrat.get_replica_context().all_reduce("sum", np.ones(2, np.float32))))
  assert not already_replicated(caught)
  assert int(first(count)) == N
  np.testing.assert_array_equal(first(ones), [8.0, 8.0])


def test_mean_of_summed_gradients_warns_and_local_copy_gives_tfs_mean(strategy, problem):
  # TF's loop with MEAN: tpustrat's gradients are already the sum, so MEAN returns the sum (N times TF's
  # mean) unchanged. That is silent in numbers, so it warns; local_copy gives TF's mean.
  params, x, y = problem

  def step(params, batch):
    grads = jax.grad(loss_fn)(params, *batch)
    ctx = tpustrat.get_replica_context()
    return grads, ctx.all_reduce("mean", grads), ctx.all_reduce("mean", grads, group_assignment=[[0, 1], [2, 3], [4, 5], [6, 7]])

  with pytest.warns(tpustrat.AlreadyReplicatedWarning, match=r"all_reduce\(MEAN\).*local_copy"):
    grads, mean, grouped = strategy.run(step, args=(params, batches(strategy, x, y)))
  for k in ("w", "b"):  # MEAN of a value that is the same everywhere is that value
    np.testing.assert_allclose(first(mean[k]), first(grads[k]), rtol=1e-6)
    np.testing.assert_allclose(first(grouped[k]), first(grads[k]), rtol=1e-6)

  def tf_step(params, batch):
    grads = jax.grad(loss_fn)(tpustrat.local_copy(params), *batch)
    return tpustrat.get_replica_context().all_reduce("mean", grads)

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tf_mean = strategy.run(tf_step, args=(params, batches(strategy, x, y)))
  assert not already_replicated(caught)
  for k in ("w", "b"):  # TF's mean of the replicas' own gradients is the summed gradient / N
    np.testing.assert_allclose(first(tf_mean[k]), first(grads[k]) / N, rtol=1e-5,
                               atol=1e-6 * np.abs(first(grads[k])).max())


def test_mean_of_a_varying_value_does_not_warn(strategy):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = strategy.run(lambda: tpustrat.get_replica_context().all_reduce(
        "mean", tpustrat.get_replica_context().replica_id_in_sync_group.astype(jnp.float32)))
  assert not already_replicated(caught)
  assert float(first(out)) == 3.5


def test_the_warning_fires_once_per_trace(strategy):
  def step(w, x):
    ctx = tpustrat.get_replica_context()
    return ctx.all_reduce("sum", {"w": w, "x": x, "w2": w * 2})

  x = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    strategy.run(step, args=(np.ones(3, np.float32), x))
    first_trace = already_replicated(caught)
    strategy.run(step, args=(np.ones(3, np.float32), x))  # the cached program: not traced, no warning
    strategy.run(step, args=(np.ones(3, np.float32), x))
    cached = already_replicated(caught)
    strategy.run(step, args=(np.ones(5, np.float32), x))  # a new shape: traced again, warned again
    retraced = already_replicated(caught)
  assert len(first_trace) == 1 and len(cached) == 1 and len(retraced) == 2
  assert "2 of the 3 leaves of the value" in str(first_trace[0].message)


def test_cross_replica_sum_of_an_invariant_value_warns(strategy):
  def step(w):
    return ops.cross_replica_sum(w), ops.cross_replica_sum(w, [[0, 1, 2, 3], [4, 5, 6, 7]])

  w = np.arange(3, dtype=np.float32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    total, grouped = strategy.run(step, args=(w,))
  got = [str(w.message) for w in already_replicated(caught)]
  assert len(got) == 2
  assert got[0].startswith("tpustrat.ops.cross_replica_sum(SUM): the value is already the same on every replica")
  assert "N=8 (num_replicas_in_sync)" in got[0] and "N=4 (the group size)" in got[1]
  assert "drop the cross_replica_sum" in got[0] and "tpustrat.local_copy(params)" in got[0]
  np.testing.assert_array_equal(first(total), 8 * w)
  np.testing.assert_array_equal(first(grouped), 4 * w)


def test_grouped_sums_warn_with_the_group_size_and_singletons_do_not(strategy):
  def step(w):
    ctx = tpustrat.get_replica_context()
    return (ctx.all_reduce("sum", w, group_assignment=[[0, 2, 4, 6], [1, 3, 5, 7]]),
            ops.cross_replica_sum(w, [[r] for r in range(N)]),  # groups of one: the value itself
            ops.reduce_scatter(w, [[0, 1], [2, 3], [4, 5], [6, 7]]),
            ops.reduce_scatter(w, [[0, 1], [2, 3], [4, 5], [6, 7]], reduce_op="mean"))

  w = np.arange(4, dtype=np.float32)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    grouped, single, scattered, scattered_mean = strategy.run(step, args=(w,))
  got = [str(w.message) for w in already_replicated(caught)]
  assert len(got) == 2
  assert got[0].startswith("ReplicaContext.all_reduce(SUM)") and "N=4 (the group size)" in got[0]
  assert got[1].startswith("tpustrat.ops.reduce_scatter(SUM)") and "N=2 (the group size)" in got[1]
  np.testing.assert_array_equal(first(grouped), 4 * w)
  np.testing.assert_array_equal(first(single), w)
  np.testing.assert_array_equal(np.asarray(scattered.values[1]), 2 * w[2:])
  np.testing.assert_array_equal(np.asarray(scattered_mean.values[1]), w[2:])


def test_cross_device_ops_in_replica_context_warn_once(problem):
  params, x, y = problem
  strategy = MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())
  nccl = NcclAllReduce()

  def step(params, batch):
    grads = jax.grad(loss_fn)(params, *batch)
    return nccl.all_reduce_in_replica_context("sum", grads)  # called directly

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    strategy.run(step, args=(params, batches(strategy, x, y)))
  got = [str(w.message) for w in already_replicated(caught)]
  assert len(got) == 1 and got[0].startswith("NcclAllReduce.all_reduce_in_replica_context(SUM)")


def test_cross_replica_reduce_of_mirrored_values_does_not_warn(strategy):
  # Outside `run` nothing is traced: TF's `reduce(SUM, mirrored)` counts the value once per replica.
  m = strategy.run(lambda x: x, args=(jnp.float32(2.0),))
  assert isinstance(m, tpustrat.Mirrored)
  assert float(strategy.reduce("sum", m, axis=None)) == 16.0


# -- local_copy ---------------------------------------------------------------------------------------


def test_local_copy_types_values_as_varying(strategy):
  def step(w, v):
    copy = local_copy({"w": w, "v": v, "n": 3.0})
    return copy, jax.tree.map(lambda a: a * 1, copy)

  v = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  copy, same = strategy.run(step, args=(np.ones(2, np.float32), v))
  for k in ("w", "v", "n"):
    assert isinstance(copy[k], tpustrat.PerReplica), k
  np.testing.assert_array_equal(np.asarray(copy["w"].values[5]), [1.0, 1.0])
  assert float(copy["v"].values[5]) == 5.0 and float(copy["n"].values[2]) == 3.0


def test_local_copy_outside_run(strategy):
  value = {"w": np.ones(2)}
  assert local_copy(value) is value  # no strategy: one replica, nothing to do
  with strategy.scope(), pytest.raises(RuntimeError, match="cross-replica context.*inside the function given to strategy.run"):
    local_copy(value)


@pytest.mark.skipif(not hasattr(tpustrat, "local_copy"), reason="tpustrat/__init__.py export pending")
def test_public_names():
  assert tpustrat.local_copy is local_copy
  assert tpustrat.AlreadyReplicatedWarning is AlreadyReplicatedWarning
  assert issubclass(tpustrat.AlreadyReplicatedWarning, UserWarning)
