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
from tpustrat._src.cross_device import HierarchicalCopyAllReduce, NcclAllReduce
from tpustrat._src.gradient_semantics import AlreadyReplicatedWarning, local_copy
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


# -- grouped collectives: the gradient does not depend on the input's type ---------------------------
#
# A loss computed from a grouped result differs between groups, so `jax.grad` w.r.t. a Mirrored `w` (one
# value given to every replica) is the gradient of the sum of every replica's loss, the same as w.r.t.
# `local_copy(w)`. A result of one all-replica group is the same everywhere (Mirrored): its loss counts once.

SPEC = [[0, 2, 4, 6], [1, 3, 5, 7]]
QUADS = [[0, 1, 2, 3], [4, 5, 6, 7]]
RING = [[r, (r + 1) % N] for r in range(N)]


def np_groups(groups):
  return [list(range(N))] if groups is None else [list(g) for g in groups]


def np_group_sum(x, groups):
  out = np.empty_like(x)
  for g in np_groups(groups):
    out[g] = x[g].sum(0)
  return out


def np_all_gather(x, groups):
  out = np.empty((N, len(np_groups(groups)[0]) * x.shape[1]), x.dtype)
  for g in np_groups(groups):
    out[g] = np.concatenate([x[m] for m in g])
  return out


def np_all_to_all(x, groups):  # split axis 0 into len(g) blocks, concatenate along axis 0, in group order
  out = np.empty_like(x)
  for g in np_groups(groups):
    for i, r in enumerate(g):
      out[r] = np.concatenate([np.split(x[m], len(g))[i] for m in g])
  return out


def np_reduce_scatter(x, groups):
  out = np.empty((N, x.shape[1] // len(np_groups(groups)[0])), x.dtype)
  for g in np_groups(groups):
    for i, r in enumerate(g):
      out[r] = np.split(x[g].sum(0), len(g))[i]
  return out


def np_permute(x, pairs):
  out = np.zeros_like(x)
  for s, t in pairs:
    out[t] = x[s]
  return out


def ctx():
  return tpustrat.get_replica_context()


# name: (the op inside run, its numpy reference on stacked [N, ...] inputs, whether the result is Mirrored)
GROUPED_CASES = {
    "cross_replica_sum_spec": (lambda v: ops.cross_replica_sum(v, SPEC), lambda x: np_group_sum(x, SPEC), False),
    "cross_replica_sum_singletons": (lambda v: ops.cross_replica_sum(v, [[r] for r in range(N)]), lambda x: x, False),
    "cross_replica_sum_all": (lambda v: ops.cross_replica_sum(v), lambda x: np_group_sum(x, None), True),
    "cross_replica_sum_one_reversed_group": (lambda v: ops.cross_replica_sum(v, [list(range(N))[::-1]]),
                                             lambda x: np_group_sum(x, None), True),
    "all_reduce_sum_spec": (lambda v: ctx().all_reduce("sum", v, group_assignment=SPEC),
                            lambda x: np_group_sum(x, SPEC), False),
    "all_reduce_mean_spec": (lambda v: ctx().all_reduce("mean", v, group_assignment=SPEC),
                             lambda x: np_group_sum(x, SPEC) / 4, False),
    "all_reduce_sum_quads": (lambda v: ctx().all_reduce("sum", v, group_assignment=QUADS),
                             lambda x: np_group_sum(x, QUADS), False),
    "all_reduce_sum": (lambda v: ctx().all_reduce("sum", v), lambda x: np_group_sum(x, None), True),
    "all_reduce_mean": (lambda v: ctx().all_reduce("mean", v), lambda x: np_group_sum(x, None) / N, True),
    "all_gather_spec": (lambda v: ops.all_gather(v, SPEC), lambda x: np_all_gather(x, SPEC), False),
    "all_gather_all": (lambda v: ops.all_gather(v), lambda x: np_all_gather(x, None), True),
    "replica_context_all_gather_spec": (lambda v: ctx().all_gather(v, 0, group_assignment=SPEC),
                                        lambda x: np_all_gather(x, SPEC), False),
    "replica_context_all_gather": (lambda v: ctx().all_gather(v, 0), lambda x: np_all_gather(x, None), True),
    "all_to_all_quads": (lambda v: ops.all_to_all(v, QUADS, 0, 0, 4), lambda x: np_all_to_all(x, QUADS), False),
    "reduce_scatter_quads": (lambda v: ops.reduce_scatter(v, QUADS), lambda x: np_reduce_scatter(x, QUADS), False),
    "reduce_scatter_all": (lambda v: ops.reduce_scatter(v), lambda x: np_reduce_scatter(x, None), False),
    "reduce_scatter_mean_spec": (lambda v: ops.reduce_scatter(v, SPEC, reduce_op="mean"),
                                 lambda x: np_reduce_scatter(x, SPEC) / 4, False),
    "collective_permute_ring": (lambda v: ops.collective_permute(v, RING), lambda x: np_permute(x, RING), False),
    "collective_permute_one_pair": (lambda v: ops.collective_permute(v, [[0, 5]]),
                                    lambda x: np_permute(x, [[0, 5]]), False),
}


def np_shared_gradient(np_fn, w, c, mirrored_result):
  """d/dw of the loss `sum(c * tanh(y_r))` of replica r's result y_r, where every replica's input is `w`:
  summed over the replicas' losses when the result differs between replicas; one replica's loss when the
  result is Mirrored (an invariant loss counts once). The ops are linear, so the adjoint is built column by
  column from `np_fn`."""
  x = np.broadcast_to(w.astype(np.float64), (N,) + w.shape)
  y = np_fn(x)
  ct = c * (1 - np.tanh(y) ** 2)
  if mirrored_result:
    ct[1:] = 0.0
  grad = np.zeros(x.size)
  for k in range(x.size):
    basis = np.zeros(x.size)
    basis[k] = 1.0
    grad[k] = np.sum(ct * np_fn(basis.reshape(x.shape)))
  return y, grad.reshape(x.shape).sum(0)  # every replica's input is w: the chain rule sums over them


@pytest.mark.parametrize("how", ["mirrored", "local_copy"])
@pytest.mark.parametrize("name", list(GROUPED_CASES))
def test_gradient_through_a_collective_of_a_mirrored_value(strategy, name, how):
  fn, np_fn, mirrored_result = GROUPED_CASES[name]
  rng = np.random.default_rng(1)
  w = rng.normal(size=(8,)).astype(np.float32)
  out_shape = np_fn(np.zeros((N,) + w.shape)).shape[1:]
  c = rng.normal(size=out_shape).astype(np.float32)  # a constant weighting, the same everywhere
  want_y, want_grad = np_shared_gradient(np_fn, w, c, mirrored_result)

  def step(w):
    loss = lambda w: jnp.sum(c * jnp.tanh(fn(local_copy(w) if how == "local_copy" else w)))
    return fn(w), jax.grad(loss)(w)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", AlreadyReplicatedWarning)  # SUMs of a Mirrored w: tested above
    y, grad = strategy.run(step, args=(strategy.experimental_mirror(w),))
  assert isinstance(y, tpustrat.Mirrored if mirrored_result else tpustrat.PerReplica), type(y)
  assert isinstance(grad, tpustrat.Mirrored), type(grad)  # w.r.t. a shared w: the same everywhere
  got_y = np.stack([np.asarray(v) for v in y.values]) if isinstance(y, tpustrat.PerReplica) else first(y)[None]
  np.testing.assert_allclose(got_y, want_y if not mirrored_result else want_y[:1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(first(grad), want_grad, rtol=1e-4, atol=1e-5)


def test_grouped_sum_gradient_of_a_mirrored_value_is_summed_over_replicas(strategy):
  # The plain repro: d/dw of the sum over every replica of sum(cross_replica_sum(w, SPEC)). Each replica's
  # result holds its group's 4 copies of w, and there are 8 replicas: 32 per element, Mirrored or not.
  w = np.array([1.0, -2.0, 0.5], np.float32)
  _, want = np_shared_gradient(lambda x: np_group_sum(x, SPEC), w, 1.0, mirrored_result=False)
  want = want / (1 - np.tanh(4 * w.astype(np.float64)) ** 2)  # undo tanh: plain sum
  np.testing.assert_allclose(want, [32.0] * 3)

  def step(w):
    plain = jax.grad(lambda w: jnp.sum(ops.cross_replica_sum(w, SPEC)))(w)
    copied = jax.grad(lambda w: jnp.sum(ops.cross_replica_sum(local_copy(w), SPEC)))(w)
    via_ctx = jax.grad(lambda w: jnp.sum(ctx().all_reduce("sum", w, group_assignment=SPEC)))(w)
    return plain, copied, via_ctx

  with pytest.warns(AlreadyReplicatedWarning):
    plain, copied, via_ctx = strategy.run(step, args=(strategy.experimental_mirror(w),))
  for got in (plain, copied, via_ctx):
    np.testing.assert_array_equal(first(got), want)


def test_grouped_all_reduce_of_a_mirrored_value_on_mirrored_strategy():
  # MirroredStrategy's ReplicaContext.all_reduce with groups takes the same path as TPUStrategy's.
  strategy = MirroredStrategy(cross_device_ops=NcclAllReduce())
  w = np.array([1.0, 2.0], np.float32)

  def step(w):
    out = ctx().all_reduce("sum", w, group_assignment=QUADS)
    return out, jax.grad(lambda w: jnp.sum(ctx().all_reduce("sum", w, group_assignment=QUADS)))(w)

  with pytest.warns(AlreadyReplicatedWarning):
    out, grad = strategy.run(step, args=(strategy.experimental_mirror(w),))
  assert isinstance(out, tpustrat.PerReplica)
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in out.values]), np_group_sum(np.tile(w, (N, 1)), QUADS))
  np.testing.assert_array_equal(first(grad), [4.0 * N] * 2)


def test_to_varying_keeps_the_numbers_and_its_transpose_sums_over_replicas():
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from tpustrat._src import jax_compat

  mesh = Mesh(np.array(jax.devices()), ("replica",))
  w = np.array([1.0, -2.0], np.float32)

  def body(w, v):
    cast = jax_compat.to_varying(w, "replica")
    again = jax_compat.to_varying(cast, "replica")  # already varying: returned as it is
    assert "replica" in jax_compat.varying_axes(cast) and "replica" not in jax_compat.varying_axes(w)
    assert again is cast
    grad = jax.grad(lambda w: jnp.sum(v * jax_compat.to_varying(w, "replica")))(w)
    return cast[None], grad

  v = np.arange(N, dtype=np.float32)[:, None] * np.ones(2, np.float32)
  cast, grad = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("replica")),
                                     out_specs=(P("replica"), P())))(w, v)
  np.testing.assert_array_equal(np.asarray(cast), np.tile(w, (N, 1)))
  np.testing.assert_array_equal(np.asarray(grad), v.sum(0))  # d/dw sum_r v_r * w = sum_r v_r
