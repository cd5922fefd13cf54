"""tpustrat.ops: grouped TPU collectives against numpy, with gradients, jit, result types and bad input."""

import logging
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import tpustrat
import tpustrat.ops as ops
from tpustrat._src import grouped_sums

N = 8
SPEC = [[0, 2, 4, 6], [1, 3, 5, 7]]
GROUPS = {
    "spec": SPEC,
    "pairs": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "quads": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "shuffled": [[7, 0], [3, 5], [1, 6], [2, 4]],
    "singletons": [[r] for r in range(N)],
    "all": None,
    "all_reversed": [list(range(N))[::-1]],
}


# -- numpy references ---------------------------------------------------------------------------------


def groups_of(groups, n=N):
  return [list(range(n))] if groups is None else [list(g) for g in groups]


def np_group_sum(x, groups):
  out = np.empty_like(x)
  for g in groups_of(groups, len(x)):
    out[g] = x[g].sum(0)
  return out


def np_all_to_all(x, groups, concat, split, count):
  out = {}
  for g in groups_of(groups, len(x)):
    for i, r in enumerate(g):
      out[r] = np.concatenate([np.split(x[m], count, axis=split)[i] for m in g], axis=concat)
  return np.stack([out[r] for r in range(len(x))])


def np_all_gather(x, groups, axis):
  out = {}
  for g in groups_of(groups, len(x)):
    for r in g:
      out[r] = np.concatenate([x[m] for m in g], axis=axis)
  return np.stack([out[r] for r in range(len(x))])


def np_reduce_scatter(x, groups, dim):
  out = {}
  for g in groups_of(groups, len(x)):
    for i, r in enumerate(g):
      out[r] = np.split(x[g].sum(0), len(g), axis=dim)[i]
  return np.stack([out[r] for r in range(len(x))])


def np_permute(x, pairs):
  out = np.zeros_like(x)
  for s, t in pairs:
    out[t] = x[s]
  return out


def np_transpose(linear, x, ct):
  """The adjoint of a linear numpy op at cotangent `ct`: d/dx of sum(ct * linear(x))."""
  grad = np.zeros(x.size)
  for k in range(x.size):
    basis = np.zeros(x.size)
    basis[k] = 1.0
    grad[k] = np.sum(ct * linear(basis.reshape(x.shape)))
  return grad.reshape(x.shape)


# -- helpers ------------------------------------------------------------------------------------------


def distribute(strategy, x):
  return strategy.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group])


def stacked(value):
  return np.stack([np.asarray(v, dtype=np.float64) if v.dtype == jnp.bfloat16 else np.asarray(v)
                   for v in value.values])


def local(value):
  return np.asarray(value.values[0])


@pytest.fixture(scope="module")
def strategy2():
  return tpustrat.TPUStrategy(device_assignment=jax.devices()[:2])


# -- cross_replica_sum --------------------------------------------------------------------------------


def test_cross_replica_sum_spec_example(strategy):
  # A..H are 1, 10, ..., 1e7: every partial sum is readable digit by digit.
  x = np.array([10.0 ** r for r in range(N)], np.float32)
  out = strategy.run(lambda v: ops.cross_replica_sum(v, SPEC), args=(distribute(strategy, x),))
  a_c_e_g, b_d_f_h = 1 + 100 + 10_000 + 1_000_000, 10 + 1_000 + 100_000 + 10_000_000
  np.testing.assert_array_equal(stacked(out), [a_c_e_g, b_d_f_h] * 4)
  assert isinstance(out, tpustrat.PerReplica)


@pytest.mark.parametrize("name", GROUPS)
@pytest.mark.parametrize("shape", [(), (3, 2)])
def test_cross_replica_sum_matches_numpy(strategy, rng, name, shape):
  groups = GROUPS[name]
  x = rng.normal(size=(N,) + shape).astype(np.float32)
  out = strategy.run(lambda v: ops.cross_replica_sum(v, groups), args=(distribute(strategy, x),))
  assert_close(stacked(out), np_group_sum(x.astype(np.float64), groups),
               scale=np_group_sum(np.abs(x), groups))
  one_group = groups is None or len(groups) == 1
  assert isinstance(out, tpustrat.Mirrored if one_group else tpustrat.PerReplica)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.float16, np.float32, np.int32, np.uint32])
def test_cross_replica_sum_dtypes(strategy, dtype):
  x = (np.arange(N * 3).reshape(N, 3) % 7).astype(dtype)
  out = strategy.run(lambda v: ops.cross_replica_sum(v, SPEC), args=(distribute(strategy, x),))
  assert out.values[0].dtype == dtype
  np.testing.assert_array_equal(stacked(out), np_group_sum(x.astype(np.float64), SPEC))


def test_cross_replica_sum_float64_with_x64():
  with jax.enable_x64(True):
    strategy = tpustrat.TPUStrategy()
    x = np.arange(N, dtype=np.float64) / 3
    out = strategy.run(lambda v: ops.cross_replica_sum(v, SPEC), args=(distribute(strategy, x),))
    assert out.values[0].dtype == np.float64
    np.testing.assert_allclose(stacked(out), np_group_sum(x, SPEC), rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int16, np.complex64])
def test_cross_replica_sum_rejects_other_dtypes(strategy, dtype):
  name = np.dtype(dtype).name
  with pytest.raises(TypeError, match=rf"dtype {name} is not supported; allowed dtypes: bfloat16, .*uint32"):
    strategy.run(lambda: ops.cross_replica_sum(np.ones(2, dtype), SPEC))


def test_grouped_sum_of_identical_values_is_per_replica(strategy):
  # Deliberately sums a value that is the same on every replica: group size times it, and a warning. The
  # result is typed as a grouped result (PerReplica), as the README says, although here its groups agree.
  with pytest.warns(tpustrat.AlreadyReplicatedWarning, match=r"multiplies it by N=4 \(the group size\)"):
    out = strategy.run(lambda: ops.cross_replica_sum(jnp.array([1.0, 2.0]), SPEC))
  assert isinstance(out, tpustrat.PerReplica)
  np.testing.assert_array_equal(stacked(out), np_group_sum(np.tile([1.0, 2.0], (N, 1)), SPEC))


# Every op with a group assignment: (the op, its numpy reference on stacked inputs, whether its result is
# the same on every replica, which holds only for one group of all replicas).
RESULT_TYPE_CASES = {
    "cross_replica_sum_spec": (lambda v: ops.cross_replica_sum(v, SPEC), lambda x: np_group_sum(x, SPEC), False),
    "cross_replica_sum_singletons": (lambda v: ops.cross_replica_sum(v, GROUPS["singletons"]), lambda x: x, False),
    "cross_replica_sum_all": (lambda v: ops.cross_replica_sum(v), lambda x: np_group_sum(x, None), True),
    "cross_replica_sum_all_reversed": (lambda v: ops.cross_replica_sum(v, GROUPS["all_reversed"]),
                                       lambda x: np_group_sum(x, None), True),
    "all_reduce_sum_shuffled": (
        lambda v: tpustrat.get_replica_context().all_reduce("sum", v, group_assignment=GROUPS["shuffled"]),
        lambda x: np_group_sum(x, GROUPS["shuffled"]), False),
    "all_reduce_mean_quads": (
        lambda v: tpustrat.get_replica_context().all_reduce("mean", v, group_assignment=GROUPS["quads"]),
        lambda x: np_group_sum(x, GROUPS["quads"]) / 4, False),
    "all_reduce_sum": (lambda v: tpustrat.get_replica_context().all_reduce("sum", v),
                       lambda x: np_group_sum(x, None), True),
    "all_gather_spec": (lambda v: ops.all_gather(v, SPEC), lambda x: np_all_gather(x, SPEC, 0), False),
    "all_gather_all": (lambda v: ops.all_gather(v), lambda x: np_all_gather(x, None, 0), True),
    "all_to_all_pairs": (lambda v: ops.all_to_all(v, GROUPS["pairs"], 0, 0, 2),
                         lambda x: np_all_to_all(x, GROUPS["pairs"], 0, 0, 2), False),
    "reduce_scatter_pairs": (lambda v: ops.reduce_scatter(v, GROUPS["pairs"]),
                             lambda x: np_reduce_scatter(x, GROUPS["pairs"], 0), False),
    "collective_permute": (lambda v: ops.collective_permute(v, [[0, 3], [3, 0]]),
                           lambda x: np_permute(x, [[0, 3], [3, 0]]), False),
}


@pytest.mark.parametrize("given", ["mirrored", "constant", "per_replica"])
@pytest.mark.parametrize("name", list(RESULT_TYPE_CASES))
def test_result_types_follow_the_groups_not_the_input(strategy, name, given):
  # A grouped result is PerReplica whether the input is Mirrored (a run argument given whole), a constant
  # of the step, or PerReplica; only one group of every replica gives Mirrored.
  fn, np_fn, same_everywhere = RESULT_TYPE_CASES[name]
  x = np.arange(N * 4, dtype=np.float32).reshape(N, 4) - 5.0
  if given == "per_replica":
    args, stacked_in = (distribute(strategy, x),), x
  elif given == "mirrored":
    args, stacked_in = (strategy.experimental_mirror(x[3]),), np.tile(x[3], (N, 1))
  else:
    args, stacked_in = (), np.tile(x[3], (N, 1))
  step = (lambda v: fn(v)) if args else (lambda: fn(jnp.asarray(x[3])))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", tpustrat.AlreadyReplicatedWarning)  # a SUM of a Mirrored value
    out = strategy.run(step, args=args)
  want = np_fn(stacked_in.astype(np.float64))
  if same_everywhere:
    assert isinstance(out, tpustrat.Mirrored), type(out)
    np.testing.assert_array_equal(local(out), want[0])
  else:
    assert isinstance(out, tpustrat.PerReplica), type(out)
    np.testing.assert_array_equal(stacked(out), want)


@pytest.mark.parametrize("as_type", [np.array, jnp.array, lambda g: tuple(map(tuple, g))])
def test_group_assignment_formats(strategy, as_type):
  groups = as_type(SPEC)
  out = strategy.run(lambda: ops.cross_replica_sum(lax.axis_index("replica").astype(jnp.float32), groups))
  np.testing.assert_array_equal(stacked(out), np_group_sum(np.arange(N), SPEC))


# -- gradients ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["spec", "shuffled", "all"])
def test_cross_replica_sum_gradient(strategy, rng, name):
  groups = GROUPS[name]
  x = rng.normal(size=(N, 3)).astype(np.float32)
  w = rng.normal(size=(N, 3)).astype(np.float32)

  def step(x, w):
    loss = lambda x: jnp.sum(w * jnp.sin(ops.cross_replica_sum(x, groups)))  # this replica's loss
    return jax.grad(loss)(x)

  grad = strategy.run(step, args=(distribute(strategy, x), distribute(strategy, w)))
  # d(sum_r loss_r)/dx_s = sum over the replicas r in s's group of w_r * cos(y_r).
  expected = np_group_sum(w * np.cos(np_group_sum(x.astype(np.float64), groups)), groups)
  assert_close(stacked(grad), expected, scale=np_group_sum(np.abs(w), groups))


def test_second_order_gradient_through_grouped_sum(strategy, rng):
  x = rng.normal(size=(N,)).astype(np.float32)

  def step(x):
    inner = lambda x: jnp.sum(jnp.sin(ops.cross_replica_sum(x, SPEC)))
    outer = lambda x: jnp.sum(jax.grad(inner)(x) ** 2)
    return jax.grad(outer)(x)

  out = stacked(strategy.run(step, args=(distribute(strategy, x),)))
  # g = S cos(Sx); d(sum g^2)/dx = S^T(-2 g sin(Sx) ... ) with S the (symmetric) group-sum matrix.
  y = np_group_sum(x.astype(np.float64), SPEC)
  g = np_group_sum(np.cos(y), SPEC)
  expected = np_group_sum(-np.sin(y) * np_group_sum(2 * g, SPEC), SPEC)
  assert_close(out, expected, rtol=1e-4)  # y's rounding, amplified by the second derivative


def test_forward_mode_through_a_grouped_sum_is_refused(strategy):
  # A documented limitation of the custom_vjp mechanism (see tpustrat._src.grouped_sums).
  def step(x):
    return jax.jvp(lambda x: ops.cross_replica_sum(x, SPEC), (x,), (jnp.ones_like(x),))[1]

  with pytest.raises(TypeError, match=r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"):
    strategy.run(step, args=(distribute(strategy, np.arange(N, dtype=np.float32)),))


@pytest.mark.parametrize("op", ["all_to_all", "all_gather", "reduce_scatter", "collective_permute"])
def test_gradients_of_the_siblings(strategy, rng, op):
  groups = [[0, 1, 2, 3], [7, 6, 5, 4]]
  pairs = [[r, (r + 3) % N] for r in range(0, N, 2)]
  x = rng.normal(size=(N, 4, 2)).astype(np.float32)
  fns = {
      "all_to_all": (lambda v: ops.all_to_all(v, groups, 1, 0, 4),
                     lambda a: np_all_to_all(a, groups, 1, 0, 4)),
      "all_gather": (lambda v: ops.all_gather(v, groups, axis=-1), lambda a: np_all_gather(a, groups, -1)),
      "reduce_scatter": (lambda v: ops.reduce_scatter(v, groups, 0), lambda a: np_reduce_scatter(a, groups, 0)),
      "collective_permute": (lambda v: ops.collective_permute(v, pairs), lambda a: np_permute(a, pairs)),
  }
  fn, np_fn = fns[op]
  y = np_fn(x.astype(np.float64))
  w = rng.normal(size=y.shape).astype(np.float32)

  def step(x, w):
    return jax.grad(lambda x: jnp.sum(w * jnp.tanh(fn(x))))(x)

  grad = strategy.run(step, args=(distribute(strategy, x), distribute(strategy, w)))
  expected = np_transpose(np_fn, x, w * (1 - np.tanh(y) ** 2))
  assert_close(stacked(grad), expected, rtol=1e-4)  # float32 1 - tanh**2 cancels for large |y|


# -- mechanisms of the grouped sum --------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["native", "scatter_gather"])
def test_each_grouped_sum_mechanism(strategy, rng, monkeypatch, impl):
  monkeypatch.setattr(grouped_sums, "_GROUPED_SUM_IMPL", impl)
  groups = GROUPS["shuffled"]
  x = rng.normal(size=(N, 5)).astype(np.float32)  # 5 is not a multiple of the group size

  def step(x):
    y, vjp = jax.vjp(lambda x: ops.cross_replica_sum(x, groups), x)
    return y, vjp(jnp.cos(y))[0]

  y, grad = strategy.run(step, args=(distribute(strategy, x),))
  want = np_group_sum(x.astype(np.float64), groups)
  assert_close(stacked(y), want, scale=np_group_sum(np.abs(x), groups))
  assert_close(stacked(grad), np_group_sum(np.cos(want), groups),
               scale=np_group_sum(np.abs(np.cos(want)), groups))


@pytest.fixture
def fresh_probe():
  """Forgets the process's probe of the native grouped sum, before and after the test."""
  grouped_sums._probe_result.cache_clear()
  yield
  grouped_sums._probe_result.cache_clear()


def test_falls_back_when_jax_rejects_the_unchecked_region(strategy, monkeypatch, caplog, fresh_probe):
  def reject(*args):
    raise NotImplementedError("simulated")

  monkeypatch.setattr(grouped_sums, "_GROUPED_SUM_IMPL", "auto")
  monkeypatch.setattr(grouped_sums, "_unchecked_grouped_psum", reject)
  with caplog.at_level(logging.WARNING, logger=grouped_sums.__name__):
    out = strategy.run(lambda: ops.cross_replica_sum(lax.axis_index("replica").astype(jnp.float32), SPEC))
  np.testing.assert_array_equal(stacked(out), np_group_sum(np.arange(N), SPEC))
  assert "grouped sums use reduce-scatter + all-gather" in caplog.text
  assert not grouped_sums._native_grouped_sum_supported()
  assert grouped_sums._GROUPED_SUM_IMPL == "auto"  # decided by the probe, no switch flipped


def test_a_user_error_in_one_program_does_not_change_later_grouped_sums(strategy, monkeypatch):
  rid = lambda: lax.axis_index("replica").astype(jnp.float32)
  # jax.hessian is forward mode over reverse mode, refused through the native grouped sum (a
  # custom_vjp). The error is the user's: it used to switch every later grouped sum to the fallback.
  with pytest.raises(TypeError, match=r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"):
    strategy.run(lambda: jax.hessian(lambda v: ops.cross_replica_sum(v, SPEC))(rid()))
  fallback = []
  real = grouped_sums._grouped_psum_scatter_gather
  monkeypatch.setattr(grouped_sums, "_grouped_psum_scatter_gather", lambda *a: fallback.append(a) or real(*a))
  out = strategy.run(lambda: ops.cross_replica_sum(rid() + 1, SPEC))
  np.testing.assert_array_equal(stacked(out), [16, 20] * 4)
  assert grouped_sums._native_grouped_sum_supported() and not fallback


def test_the_grouped_sum_probe_runs_once_across_threads(monkeypatch, fresh_probe):
  calls = []
  real = grouped_sums._probe_native_grouped_sum

  def slow_probe():
    calls.append(threading.get_ident())
    time.sleep(0.05)
    return real()

  monkeypatch.setattr(grouped_sums, "_probe_native_grouped_sum", slow_probe)
  results = []
  threads = [threading.Thread(target=lambda: results.append(grouped_sums._native_grouped_sum_supported()))
             for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert results == [True] * 4 and len(calls) == 1


# -- all_to_all ---------------------------------------------------------------------------------------


def test_all_to_all_spec_example(strategy2):
  a, b, c, d = 1, 2, 3, 4
  x = tpustrat.PerReplica([np.array([[a, b]]), np.array([[c, d]])])
  out = strategy2.run(
      lambda v: ops.all_to_all(v, group_assignment=[[0, 1]], concat_dimension=0, split_dimension=1, split_count=2),
      args=(x,))
  np.testing.assert_array_equal(out.values[0], [[a], [c]])
  np.testing.assert_array_equal(out.values[1], [[b], [d]])


@pytest.mark.parametrize("name", ["spec", "pairs", "shuffled", "all", "all_reversed"])
@pytest.mark.parametrize("concat,split", [(0, 1), (1, 0), (-1, -2), (1, 1)])
def test_all_to_all_matches_numpy(strategy, name, concat, split):
  groups = GROUPS[name]
  count = len(groups_of(groups)[0])
  x = np.arange(N * 8 * 8, dtype=np.int32).reshape(N, 8, 8)
  out = strategy.run(lambda v: ops.all_to_all(v, groups, concat, split, count), args=(distribute(strategy, x),))
  expected = np_all_to_all(x, groups, concat, split, count)
  shape = [8, 8]
  shape[split] //= count
  shape[concat] *= count  # TF's shape rule
  assert out.values[0].shape == expected.shape[1:] == tuple(shape)
  np.testing.assert_array_equal(stacked(out), expected)
  assert isinstance(out, tpustrat.PerReplica)


# -- all_gather, reduce_scatter, collective_permute ---------------------------------------------------


@pytest.mark.parametrize("name", ["spec", "shuffled", "singletons", "all", "all_reversed"])
def test_all_gather_matches_numpy(strategy, rng, name):
  groups = GROUPS[name]
  x = rng.normal(size=(N, 2, 3)).astype(np.float32)
  out = strategy.run(lambda v: ops.all_gather(v, groups, axis=1), args=(distribute(strategy, x),))
  np.testing.assert_array_equal(stacked(out), np_all_gather(x, groups, 1))
  one_group = groups is None or len(groups) == 1
  assert isinstance(out, tpustrat.Mirrored if one_group else tpustrat.PerReplica)


@pytest.mark.parametrize("name", ["spec", "pairs", "all"])
@pytest.mark.parametrize("reduce_op", ["sum", "mean", "Add"])
def test_reduce_scatter_matches_numpy(strategy, rng, name, reduce_op):
  groups = GROUPS[name]
  x = rng.normal(size=(N, 3, 8)).astype(np.float32)
  out = strategy.run(lambda v: ops.reduce_scatter(v, groups, scatter_dimension=-1, reduce_op=reduce_op),
                     args=(distribute(strategy, x),))
  expected = np_reduce_scatter(x.astype(np.float64), groups, -1)
  scale = np_reduce_scatter(np.abs(x), groups, -1)
  if reduce_op == "mean":
    expected, scale = expected / len(groups_of(groups)[0]), scale / len(groups_of(groups)[0])
  assert_close(stacked(out), expected, scale=scale)


@pytest.mark.parametrize("pairs", [[[r, (r + 1) % N] for r in range(N)], [[0, 5], [5, 0], [3, 3]], []])
def test_collective_permute_matches_numpy(strategy, pairs):
  x = np.arange(N * 2, dtype=np.float32).reshape(N, 2) + 1
  out = strategy.run(lambda v: ops.collective_permute(v, pairs), args=(distribute(strategy, x),))
  np.testing.assert_array_equal(stacked(out), np_permute(x, pairs))


# -- ReplicaContext methods ---------------------------------------------------------------------------


def test_replica_context_all_reduce_with_groups(strategy, rng):
  x = rng.normal(size=(N, 2)).astype(np.float32)

  def step(v):
    ctx = tpustrat.get_replica_context()
    return (ctx.all_reduce("sum", {"a": v, "b": 1.0}, group_assignment=SPEC),
            ctx.all_reduce(tpustrat.ReduceOp.MEAN, v, group_assignment=SPEC),
            ctx.all_reduce("sum", v, group_assignment=[list(range(N))]))

  sums, means, full = strategy.run(step, args=(distribute(strategy, x),))
  want, scale = np_group_sum(x.astype(np.float64), SPEC), np_group_sum(np.abs(x), SPEC)
  assert_close(stacked(sums["a"]), want, scale=scale)
  # A grouped result is PerReplica even for a constant (here the same in every group: the group size).
  assert isinstance(sums["b"], tpustrat.PerReplica)
  np.testing.assert_array_equal(stacked(sums["b"]), [4.0] * N)
  assert_close(stacked(means), want / 4, scale=scale / 4)
  assert isinstance(full, tpustrat.Mirrored)
  assert_close(local(full), x.astype(np.float64).sum(0), scale=np.abs(x).sum(0))


def test_replica_context_all_gather_with_groups(strategy, rng):
  x = rng.normal(size=(N, 2)).astype(np.float32)

  def step(v):
    ctx = tpustrat.get_replica_context()
    return ctx.all_gather(v, 0, group_assignment=SPEC), ctx.all_gather(v, 0)

  grouped, full = strategy.run(step, args=(distribute(strategy, x),))
  np.testing.assert_array_equal(stacked(grouped), np_all_gather(x, SPEC, 0))
  np.testing.assert_array_equal(local(full), x.reshape(-1))


def test_replica_context_rejects_bad_groups(strategy):
  with pytest.raises(ValueError, match=r"ReplicaContext.all_reduce: group_assignment=\[\[0, 1\], \[2\]\]"):
    strategy.run(lambda: tpustrat.get_replica_context().all_reduce("sum", 1.0, group_assignment=[[0, 1], [2]]))


# -- jit, training steps, loops -----------------------------------------------------------------------


def test_under_an_outer_jit(strategy, rng):
  x = rng.normal(size=(N, 4)).astype(np.float32)

  def step(v):
    return ops.cross_replica_sum(v, SPEC), ops.cross_replica_sum(v)

  grouped, total = jax.jit(lambda v: strategy.run(step, args=(v,)))(distribute(strategy, x))
  assert isinstance(grouped, tpustrat.PerReplica) and isinstance(total, tpustrat.Mirrored)
  assert_close(stacked(grouped), np_group_sum(x.astype(np.float64), SPEC),
               scale=np_group_sum(np.abs(x), SPEC))
  assert_close(local(total), x.astype(np.float64).sum(0), scale=np.abs(x).sum(0))


def test_inside_scan(strategy):
  def step(v):
    return lax.scan(lambda c, _: (ops.cross_replica_sum(c, SPEC) / 4 + 1, None), v, None, length=3)[0]

  out = strategy.run(step, args=(distribute(strategy, np.arange(N, dtype=np.float32)),))
  expected = np.arange(N, dtype=np.float64)
  for _ in range(3):
    expected = np_group_sum(expected, SPEC) / 4 + 1
  np.testing.assert_allclose(stacked(out), expected, rtol=1e-6)


def _group_batch_norm_loss(params, x, y, stats):
  h = (x - stats[0]) / jnp.sqrt(stats[1] + 1e-5) * params["gamma"] + params["beta"]
  return jnp.mean((h @ params["w"] - y) ** 2)


def test_training_step_with_batch_norm_statistics_summed_in_groups(strategy, rng):
  """Sync batch norm within groups of replicas: statistics over the group's examples only."""
  groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
  params = {"gamma": np.ones(3, np.float32) * 1.5, "beta": np.full(3, 0.1, np.float32),
            "w": rng.normal(size=(3, 1)).astype(np.float32)}
  x = rng.normal(size=(N, 4, 3)).astype(np.float32) * np.arange(1, N + 1, dtype=np.float32)[:, None, None]
  y = rng.normal(size=(N, 4, 1)).astype(np.float32)

  def step(params, x, y):
    def loss_fn(params):
      moments = jnp.stack([x.sum(0), (x * x).sum(0), jnp.full(3, x.shape[0], x.dtype)])
      s, ss, count = ops.cross_replica_sum(moments, groups)
      mean = s / count
      return _group_batch_norm_loss(params, x, y, (mean, ss / count - mean * mean))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return loss, grads

  loss, grads = strategy.run(step, args=(params, distribute(strategy, x), distribute(strategy, y)))
  assert isinstance(loss, tpustrat.PerReplica)
  assert all(isinstance(g, tpustrat.Mirrored) for g in grads.values())

  # Reference on one device: each group's statistics over the concatenation of its replicas' batches.
  def reference(params):
    losses = []
    for g in groups:
      xs = jnp.asarray(x[g]).reshape(-1, 3)
      stats = (xs.mean(0), xs.var(0))
      losses += [_group_batch_norm_loss(params, x[r], y[r], stats) for r in g]
    return jnp.stack(losses)

  np.testing.assert_allclose(stacked(loss), reference(params), rtol=1e-4)
  expected = jax.grad(lambda p: reference(p).sum())(params)  # Mirrored gradients are summed over replicas
  for k in params:
    assert_close(local(grads[k]), expected[k], rtol=1e-4, err_msg=k)


# -- bad input ----------------------------------------------------------------------------------------

BAD_GROUPS = [
    ([0, 1, 2, 3, 4, 5, 6, 7], r"group_assignment=\[0, 1, 2, 3, 4, 5, 6, 7\] has rank 1"),
    ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], r"has rank 3"),
    ([[0, 1, 2], [3, 4], [5, 6, 7]], r"group_assignment=\[\[0, 1, 2\], \[3, 4\], \[5, 6, 7\]\] has groups of unequal sizes \[3, 2, 3\]"),
    ([[0, 1, 2, 3], [4, 5, 6, 8]], r"names replica 8, out of range: replica ids go from 0 to 7"),
    ([[0, 1, 2, 3], [4, 5, 6, -1]], r"names replica -1, out of range"),
    ([[0, 1, 2, 3], [4, 5, 6, 3]], r"\[\[0, 1, 2, 3\], \[4, 5, 6, 3\]\] uses replica 3 more than once"),
    ([[0, 1], [2, 3]], r"\[\[0, 1\], \[2, 3\]\] does not cover every replica \(missing \[4, 5, 6, 7\]\)"),
    ([[]], r"has empty groups"),
]


@pytest.mark.parametrize("groups,match", BAD_GROUPS)
@pytest.mark.parametrize("op", ["cross_replica_sum", "all_to_all", "all_gather", "reduce_scatter"])
def test_bad_group_assignment(strategy, groups, match, op):
  calls = {
      "cross_replica_sum": lambda: ops.cross_replica_sum(jnp.ones(8), groups),
      "all_to_all": lambda: ops.all_to_all(jnp.ones(8), groups, 0, 0, 4),
      "all_gather": lambda: ops.all_gather(jnp.ones(8), groups),
      "reduce_scatter": lambda: ops.reduce_scatter(jnp.ones(8), groups),
  }
  with pytest.raises(ValueError, match=rf"tpustrat.ops.{op}: .*{match}"):
    strategy.run(calls[op])


def test_group_assignment_must_hold_integers_known_at_trace_time(strategy):
  with pytest.raises(TypeError, match=r"must hold integer replica ids, got dtype float64"):
    strategy.run(lambda: ops.cross_replica_sum(1.0, [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]))
  with pytest.raises(TypeError, match=r"must be known when the step is traced"):
    strategy.run(lambda g: ops.cross_replica_sum(1.0, g), args=(jnp.array(SPEC),))


@pytest.mark.parametrize("args,match", [
    ((SPEC, 0, 1, 2), r"split_count=2 must equal the number of replicas per group, 4, of group_assignment=\[\[0, 2, 4, 6\], \[1, 3, 5, 7\]\]"),
    ((None, 0, 1, 4), r"split_count=4 must equal the number of replicas per group, 8"),
    ((SPEC, 0, 0, 4), r"dimension 0 \(split_dimension=0\) of the input of shape \(6, 8\) has size 6, not divisible by split_count=4"),
    ((SPEC, 2, 1, 4), r"concat_dimension=2 is out of range for an input of shape \(6, 8\) \(rank 2\); expected a value in \[-2, 2\)"),
    ((SPEC, 0, -3, 4), r"split_dimension=-3 is out of range"),
])
def test_all_to_all_bad_arguments(strategy, args, match):
  with pytest.raises(ValueError, match=match):
    strategy.run(lambda: ops.all_to_all(jnp.ones((6, 8)), *args))


def test_all_to_all_negative_dimensions_count_from_the_end(strategy):
  out = strategy.run(lambda: ops.all_to_all(jnp.ones((6, 8)), SPEC, -2, -1, 4))
  assert out.values[0].shape == (24, 2)


@pytest.mark.parametrize("call,error,match", [
    (lambda: ops.reduce_scatter(jnp.ones((3, 6)), SPEC, 1), ValueError, r"dimension 1 of the input of shape \(3, 6\) has size 6, not divisible by the number of replicas per group \(4\)"),
    (lambda: ops.reduce_scatter(jnp.ones(8), SPEC, 1), ValueError, r"scatter_dimension=1 is out of range"),
    (lambda: ops.reduce_scatter(jnp.ones(8), SPEC, reduce_op="max"), ValueError, r"Unknown reduce op 'max'"),
    (lambda: ops.all_gather(jnp.ones(()), SPEC), ValueError, r"rank >= 1"),
    (lambda: ops.all_gather(jnp.ones(3), SPEC, axis=1), ValueError, r"axis=1 is out of range"),
    (lambda: ops.collective_permute(jnp.ones(3), [[0, 1, 2]]), ValueError, r"source_target_pairs=\[\[0, 1, 2\]\] must have shape \[num_pairs, 2\]"),
    (lambda: ops.collective_permute(jnp.ones(3), [[0, 8]]), ValueError, r"names replica 8, out of range"),
    (lambda: ops.collective_permute(jnp.ones(3), [[0, 1], [0, 2]]), ValueError, r"uses replica 0 as a source more than once"),
    (lambda: ops.collective_permute(jnp.ones(3), [[0, 2], [1, 2]]), ValueError, r"uses replica 2 as a target more than once"),
    (lambda: ops.cross_replica_sum(jnp.ones(3), SPEC, name=3), TypeError, r"`name` must be a string or None"),
])
def test_sibling_bad_arguments(strategy, call, error, match):
  with pytest.raises(error, match=match):
    strategy.run(call)


def test_name_is_accepted(strategy):
  with pytest.warns(tpustrat.AlreadyReplicatedWarning):  # jnp.ones(2) is the same on every replica
    out = strategy.run(lambda: ops.cross_replica_sum(jnp.ones(2), SPEC, name="bn_stats"))
  np.testing.assert_array_equal(local(out), [4.0, 4.0])


# -- where the ops may be called ----------------------------------------------------------------------

ALL_OPS = [
    lambda: ops.cross_replica_sum(jnp.ones(2)),
    lambda: ops.all_to_all(jnp.ones(8), None, 0, 0, 8),
    lambda: ops.all_gather(jnp.ones(2)),
    lambda: ops.reduce_scatter(jnp.ones(8)),
    lambda: ops.collective_permute(jnp.ones(2), [[0, 1]]),
]


@pytest.mark.parametrize("call", ALL_OPS)
def test_ops_in_cross_replica_context_raise(strategy, call):
  with strategy.scope(), pytest.raises(RuntimeError, match=r"cross-replica context .* inside the function given to strategy.run"):
    call()


def test_ops_with_no_strategy_act_on_one_replica():
  x = jnp.arange(2.0)
  np.testing.assert_array_equal(ops.cross_replica_sum(x, [[0]]), x)
  np.testing.assert_array_equal(ops.all_to_all(x, [[0]], 0, 0, 1), x)
  np.testing.assert_array_equal(ops.all_gather(x), x)
  np.testing.assert_array_equal(ops.reduce_scatter(x, reduce_op="mean"), x)
  np.testing.assert_array_equal(ops.collective_permute(x, [[0, 0]]), x)
  np.testing.assert_array_equal(ops.collective_permute(x, []), [0.0, 0.0])
  np.testing.assert_array_equal(tpustrat.get_replica_context().all_reduce("mean", x, group_assignment=[[0]]), x)
  with pytest.raises(ValueError, match=r"names replica 1, out of range: replica ids go from 0 to 0"):
    ops.cross_replica_sum(x, [[0, 1]])


@pytest.mark.parametrize("wrapper", ["shard_map", "pmap"])
def test_ops_inside_a_foreign_shard_map_or_pmap_raise(wrapper):
  fn = lambda x: ops.cross_replica_sum(x)
  if wrapper == "pmap":
    f = jax.pmap(fn, axis_name="i")
  else:
    f = jax.shard_map(fn, mesh=Mesh(np.array(jax.devices()), ("i",)), in_specs=P("i"), out_specs=P("i"))
  with pytest.raises(RuntimeError, match=r"inside a jax.shard_map or jax.pmap over axes \['i'\] but outside strategy.run"):
    f(jnp.arange(8.0))
