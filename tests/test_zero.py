"""ZeRO-1/2 for `Mirrored` parameters: `tpustrat.sharded_optimizer`.

References are plain optax on one device with the whole batch (never tpustrat): Adam and AdamW with
clipping through the wrapper give the one-device numbers on 1, 2, 4 and 8 replicas, from per-replica
gradients (w.r.t. `local_copy(params)`) and from already-summed ones (w.r.t. the `Mirrored` parameters);
the state is ``1/N`` per device; the compiled step reduce-scatters the gradients and all-gathers the
updates once each.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close

import tpustrat
from tpustrat import Mirrored, ShardedVariable

N = 8
K = 4  # rows per replica per step
STEPS = 3
# Split every leaf of at least 64 bytes: w1 (13 x 37), b1 (37) and w2 (37 x 5); b2 (5) and the scalar stay whole.
SPLIT = tpustrat.MinSizePartitioner(min_shard_bytes=64)


def replica_counts():
  return [pytest.param(n, id=f"{n}-replicas") for n in (1, 2, 4, 8) if n <= len(jax.devices())]


@functools.cache
def strategy_of(n):
  return tpustrat.TPUStrategy(device_assignment=jax.devices()[:n])


def init_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w1": rng.normal(size=(13, 37)).astype(np.float32) * 0.5, "b1": rng.normal(size=(37,)).astype(np.float32),
          "w2": rng.normal(size=(37, 5)).astype(np.float32) * 0.3, "b2": rng.normal(size=(5,)).astype(np.float32),
          "s": np.float32(0.7)}


def batches(n, seed=1):
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=(K * n, 13)).astype(np.float32), rng.normal(size=(K * n, 5)).astype(np.float32))
          for _ in range(STEPS)]


def loss_fn(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.sum((p["s"] * (h @ p["w2"]) + p["b2"] - y) ** 2)


def one_device(tx, params, data):
  """Plain optax on one device, the whole batch each step."""
  params = jax.tree.map(jnp.asarray, params)
  state = tx.init(params)
  for x, y in data:
    g = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def distribute(strategy, data):
  n = strategy.num_replicas_in_sync
  out = []
  for x, y in data:
    xs = strategy.experimental_distribute_values_from_function(lambda c, x=x: x[K * c.replica_id_in_sync_group:][:K])
    ys = strategy.experimental_distribute_values_from_function(lambda c, y=y: y[K * c.replica_id_in_sync_group:][:K])
    out.append((xs, ys))
  assert len(out[0][0].values) == n
  return out


def make_step(zopt, per_replica):
  def step(params, opt_state, x, y):
    wrt = tpustrat.local_copy(params) if per_replica else params  # TF's gradients, or JAX's already summed
    grads = jax.grad(loss_fn)(wrt, x, y)
    updates, opt_state = zopt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def check_params(got, want):
  for name in want:
    assert isinstance(got[name], Mirrored), name
    w = np.asarray(want[name])
    # Adam's step is lr * m / sqrt(v): its rounding follows the gradients' (summed in another order), not
    # the parameters' size; atol is 1e-5 of the parameters' scale.
    assert_close(got[name].values[0], w, rtol=1e-5, scale=np.abs(w).max() + 1.0, err_msg=name)
    for r in got[name].values[1:]:
      np.testing.assert_array_equal(r, got[name].values[0])  # the same on every replica


# Adam's step and a clipped gradient hardly depend on the gradient's scale; SGD with momentum does, so it
# tells a sum over the replicas from a mean, or from a sum counted twice.
TXS = {
    "adam": (lambda: optax.adam(1e-2), lambda: optax.adam(1e-2)),
    "momentum": (lambda: optax.sgd(1e-3, momentum=0.9), lambda: optax.sgd(1e-3, momentum=0.9)),
    "adamw-clip": (lambda: optax.chain(tpustrat.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)),
                   lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))),
}


@pytest.mark.parametrize("n", replica_counts())
@pytest.mark.parametrize("name", sorted(TXS))
def test_equals_one_device_optax_with_per_replica_gradients(n, name):
  ours, reference = TXS[name]
  params0, data = init_params(), batches(n)
  want, want_state = one_device(reference(), params0, data)
  if name == "adamw-clip":  # the clip is active on every step's gradient of the whole batch
    assert float(optax.tree.norm(jax.grad(loss_fn)(jax.tree.map(jnp.asarray, params0), *data[0]))) > 1.0

  strategy = strategy_of(n)
  zopt = tpustrat.sharded_optimizer(ours(), SPLIT)
  params = strategy.experimental_mirror(params0)
  opt_state = strategy.run(zopt.init, args=(params,))
  step = make_step(zopt, per_replica=True)
  for x, y in distribute(strategy, data):
    params, opt_state = strategy.run(step, args=(params, opt_state, x, y))
  check_params(params, want)
  if name == "momentum":
    trace = opt_state[0].trace
    assert isinstance(trace["w1"], ShardedVariable) and isinstance(trace["b2"], Mirrored)
    for leaf in ("w1", "b1", "w2"):
      t = np.asarray(want_state[0].trace[leaf]).ravel()
      assert_close(np.asarray(trace[leaf]), t, rtol=1e-5, scale=t)
    return
  # The state holds Adam's moments of the flattened leaves, split; it equals optax's, flattened.
  adam_state = opt_state[-1][0] if name == "adamw-clip" else opt_state[0]
  want_adam = want_state[-1][0] if name == "adamw-clip" else want_state[0]
  for leaf in ("w1", "b1", "w2"):
    assert isinstance(adam_state.nu[leaf], ShardedVariable) and adam_state.nu[leaf].shape == (params0[leaf].size,)
    nu = np.asarray(want_adam.nu[leaf]).ravel()
    assert_close(np.asarray(adam_state.nu[leaf]), nu, rtol=1e-5, scale=nu)
  assert isinstance(adam_state.nu["b2"], Mirrored) and isinstance(adam_state.count, Mirrored)
  assert int(adam_state.count.values[0]) == STEPS


@pytest.mark.parametrize("n", replica_counts())
@pytest.mark.parametrize("name", ["momentum", "adamw-clip"])
def test_already_summed_gradients_give_the_same_numbers(n, name):
  ours, reference = TXS[name]
  params0, data = init_params(2), batches(n, seed=3)
  want, _ = one_device(reference(), params0, data)
  strategy = strategy_of(n)
  zopt = tpustrat.sharded_optimizer(ours(), SPLIT)
  params = strategy.experimental_mirror(params0)
  opt_state = strategy.run(zopt.init, args=(params,))
  step = make_step(zopt, per_replica=False)
  for x, y in distribute(strategy, data):
    params, opt_state = strategy.run(step, args=(params, opt_state, x, y))
  check_params(params, want)


def test_state_is_one_nth_per_device():
  params0 = init_params()
  plain = sum(np.asarray(x).nbytes for x in jax.tree.leaves(optax.adam(1e-2).init(params0)))
  whole = sum(np.asarray(params0[k]).nbytes for k in ("b2", "s")) * 2 + 4  # mu, nu of the small leaves; count
  for n in (2, 4, 8):
    strategy = strategy_of(n)
    opt_state = strategy.run(tpustrat.sharded_optimizer(optax.adam(1e-2), SPLIT).init,
                             args=(strategy.experimental_mirror(params0),))
    per_device = 0
    for x in jax.tree.leaves(opt_state, is_leaf=lambda v: isinstance(v, (Mirrored, ShardedVariable))):
      if isinstance(x, ShardedVariable):
        size = int(np.prod(x.shape))
        shards = x.tree.addressable_shards
        assert len(shards) == n and {s.data.shape for s in shards} == {(1, -(-size // n))}
        assert [b.shape for b in x.values] == [(-(-size // n),)] * n
        per_device += shards[0].data.nbytes
      else:
        per_device += x.tree.addressable_shards[0].data.nbytes
    padding = 3 * 2 * (n - 1) * 4  # at most n - 1 padded elements per split leaf and moment
    assert per_device <= (plain - whole) / n + whole + padding, (n, per_device, plain)
    assert per_device < plain / n * 1.2 + whole


def compiled_hlo(strategy, fn, args):
  """The optimized HLO of the program `strategy.run(fn, args)` ran (as tests/test_sharding.py reads it)."""
  engine = strategy._engine
  leaves, in_tree = jax.tree.flatten((tuple(args), {}))
  (program, targets), = [e for (k, t), e in engine._entries.items() if t == in_tree and (
      k() if callable(k) else k) is fn]
  return program._flat.lower(*[engine._place(v, t) for v, t in zip(leaves, targets)]).compile().as_text()


def collective_lines(hlo, op):
  return [line.strip() for line in hlo.splitlines() if f" {op}(" in line and "=" in line]


@pytest.mark.parametrize("per_replica", [True, False], ids=["per-replica-grads", "summed-grads"])
def test_one_reduce_scatter_and_one_all_gather(strategy, per_replica):
  params0 = init_params()
  zopt = tpustrat.sharded_optimizer(optax.adam(1e-2), SPLIT)
  params = strategy.experimental_mirror(params0)
  opt_state = strategy.run(zopt.init, args=(params,))
  (x, y), = distribute(strategy, batches(N)[:1])
  step = make_step(zopt, per_replica)
  strategy.run(step, args=(params, opt_state, x, y))
  hlo = compiled_hlo(strategy, step, (params, opt_state, x, y))
  scatters, gathers = collective_lines(hlo, "reduce-scatter"), collective_lines(hlo, "all-gather")
  reduces = collective_lines(hlo, "all-reduce")
  # Measured on XLA:CPU (jax 0.10.2): psum_scatter stays one reduce-scatter over the 3 split leaves' blocks
  # (61 + 5 + 24 = 90 float32 per replica), the updates come back in one all-gather of 8 x 90.
  assert len(gathers) == 1 and "f32[720]" in gathers[0], gathers
  if per_replica:
    assert len(scatters) == 1 and "f32[90]" in scatters[0], scatters
    # One all-reduce: the small leaves' gradients (b2: 5, s: a scalar), never the split ones'.
    assert len(reduces) == 1 and "f32[5]" in reduces[0] and "f32[]" in reduces[0], reduces
  else:
    # Already summed by JAX: the gradient's transpose all-reduces every leaf whole (ZeRO-1), one all-reduce
    # XLA combines; the optimizer adds no reduce-scatter and no other all-reduce (each replica takes its block).
    assert not scatters, scatters
    assert len(reduces) == 1 and "f32[13,37]" in reduces[0] and "psum_invariant" in reduces[0], reduces


def test_one_reduce_scatter_and_one_all_gather_per_dtype(strategy):
  params0 = dict(init_params(), w2=init_params()["w2"].astype(jnp.bfloat16))
  zopt = tpustrat.sharded_optimizer(optax.sgd(1e-3), SPLIT)
  params = strategy.experimental_mirror(params0)
  opt_state = strategy.run(zopt.init, args=(params,))
  (x, y), = distribute(strategy, batches(N)[:1])
  step = make_step(zopt, per_replica=True)
  new, _ = strategy.run(step, args=(params, opt_state, x, y))
  assert new["w2"].values[0].dtype == jnp.bfloat16 and isinstance(new["w1"], Mirrored)
  hlo = compiled_hlo(strategy, step, (params, opt_state, x, y))
  scatters, gathers = collective_lines(hlo, "reduce-scatter"), collective_lines(hlo, "all-gather")
  # float32: w1 and b1 (61 + 5 per replica); bfloat16: w2 (24). (XLA:CPU runs the bfloat16 one in float32,
  # measured with jax 0.10.2: a convert before and after; still a collective of its own.)
  shape = lambda line: line.split(" = ")[1].split(" ")[0].split("[")[1]
  assert sorted(shape(line) for line in scatters) == ["24]{0}", "66]{0}"], scatters
  assert sorted(shape(line) for line in gathers) == ["192]{0}", "528]{0}"], gathers


def test_inside_run_steps_with_a_donated_carry():
  n = 4
  strategy = strategy_of(n)
  params0 = init_params(4)
  data = [np.concatenate([x, y], axis=1) for x, y in batches(n, seed=5)]
  want, _ = one_device(optax.adam(1e-2), params0, [(d[:, :13], d[:, 13:]) for d in data])
  zopt = tpustrat.sharded_optimizer(optax.adam(1e-2), SPLIT)
  params = strategy.experimental_mirror(params0)
  opt_state = strategy.run(zopt.init, args=(params,))

  def step(carry, batch):
    params, opt_state = carry
    grads = jax.grad(loss_fn)(tpustrat.local_copy(params), batch[:, :13], batch[:, 13:])
    updates, opt_state = zopt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), jnp.zeros(())

  it = iter(strategy.experimental_distribute_dataset(data))
  (params, opt_state), _ = strategy.experimental_run_steps(
      step, it, steps=2, init=(params, opt_state), options=tpustrat.RunOptions(donate_argnums=0))
  assert isinstance(opt_state[0].mu["w1"], ShardedVariable)
  # The rest through run, donating the state.
  run_step = lambda state, batch: step(state, batch)[0]
  state = (params, opt_state)
  for batch in it:
    state = strategy.run(run_step, args=(state, batch), options=tpustrat.RunOptions(donate_argnums=0))
  check_params(state[0], want)
  assert isinstance(state[1][0].nu["w2"], ShardedVariable)


def test_without_a_replica_axis_it_is_tx_itself():
  params = jax.tree.map(jnp.asarray, init_params())
  x, y = batches(1)[0]
  tx = optax.adam(1e-2)
  zopt = tpustrat.sharded_optimizer(tx, SPLIT)
  g = jax.grad(loss_fn)(params, x, y)
  got, _ = zopt.update(g, zopt.init(params), params)
  want, _ = tx.update(g, tx.init(params), params)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_bad_inputs_are_errors_naming_the_leaf(strategy):
  params0 = init_params()
  zopt = tpustrat.sharded_optimizer(optax.adam(1e-2), SPLIT)
  params = strategy.experimental_mirror(params0)
  opt_state = strategy.run(zopt.init, args=(params,))
  (x, y), = distribute(strategy, batches(N)[:1])

  # Parameters already split (FSDP): the other path.
  sharded = strategy.experimental_shard(params0, SPLIT)
  with pytest.raises(ValueError, match=r"parameter at \['b1'\] is already split.*experimental_shard \(FSDP\)"):
    strategy.run(zopt.init, args=(sharded,))
  # Distributed values outside run.
  with pytest.raises(ValueError, match=r"parameter at \['b1'\] is a Mirrored value: call the optimizer inside"):
    zopt.init(params)
  # Integer leaves.
  with pytest.raises(TypeError, match=r"parameter at \['step'\] has dtype int32.*differentiable"):
    strategy.run(zopt.init, args=(dict(params0, step=np.int32(3)),))
  # Gradients whose structure is not the parameters'.
  def missing(params, opt_state):
    grads = {k: v for k, v in params.items() if k != "b2"}
    return zopt.update(grads, opt_state, params)
  with pytest.raises(ValueError, match=r"gradients do not have the structure of the parameters \(missing \['b2'\]\)"):
    strategy.run(missing, args=(params, opt_state))
  # A gradient of another shape.
  def reshaped(params, opt_state):
    return zopt.update(dict(params, w2=params["w2"].T), opt_state, params)
  with pytest.raises(ValueError, match=r"gradient at \['w2'\] has shape \[5, 37\], the parameter \[37, 5\]"):
    strategy.run(reshaped, args=(params, opt_state))
  # A state not made by zopt.init inside run (optax's own, whole).
  with pytest.raises(ValueError, match=r"optimizer state is not one this optimizer's init made"):
    strategy.run(make_step(zopt, True), args=(params, optax.adam(1e-2).init(params0), x, y))
  # Per-replica parameters.
  with pytest.raises(ValueError, match=r"parameter at \['b1'\] differs between replicas"):
    strategy.run(lambda p: zopt.init(tpustrat.local_copy(p)), args=(params,))
  # A whole-tree statistic of this replica's blocks only (optax's clip): the whole leaves' updates would differ.
  wrong = tpustrat.sharded_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), SPLIT)
  with pytest.raises(ValueError, match=r"combines the elements of a split leaf's block without summing over the "
                                       r"replicas \(`reduce_sum` in optax .*clip_by_global_norm.*tpustrat.clip_by_global_norm"):
    strategy.run(make_step(wrong, True), args=(params, strategy.run(wrong.init, args=(params,)), x, y))
  # The partitioner's answers.
  with pytest.raises(ValueError, match=r"split the scalar at \['s'\]"):
    strategy.run(tpustrat.sharded_optimizer(optax.sgd(1.0), lambda *_: 0).init, args=(params,))
  with pytest.raises(ValueError, match=r"the leaf at \['b1'\]\): `axis` = 1 out of range"):
    strategy.run(tpustrat.sharded_optimizer(optax.sgd(1.0), lambda p, s, d: 1 if s else None).init, args=(params,))
  with pytest.raises(TypeError, match=r"returned 'rows' for the leaf at \['b1'\]"):
    strategy.run(tpustrat.sharded_optimizer(optax.sgd(1.0), lambda p, s, d: "rows" if s else None).init,
                 args=(params,))
  with pytest.raises(TypeError, match="partitioner must be callable"):
    tpustrat.sharded_optimizer(optax.sgd(1.0), 3)


EVERY_LEAF = lambda path, shape, dtype: 0 if shape else None  # noqa: E731  (split every leaf but the scalar)

# Transforms wrong on flat blocks, each refused while the step is traced, naming the transform: a statistic of
# this replica's block (a norm, an RMS, a finite check) or a choice made from a leaf's shape (a mask by rank).
WRONG_ON_BLOCKS = {
    "optax-clip-every-leaf": (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
                              r"block without summing over the replicas \(`reduce_sum` in optax .*clip_by_global_norm"),
    "clip-by-block-rms": (lambda: optax.chain(optax.clip_by_block_rms(0.1), optax.sgd(0.1)),
                          r"block without summing over the replicas \(`reduce_sum` in optax clip_by_block_rms"),
    "adamw-mask-by-rank": (lambda: optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
                           r"other operations on the flattened blocks than on the parameters' own shapes "
                           r"\(`\w+` in optax add_decayed_weights"),
    "apply-if-finite": (lambda: optax.apply_if_finite(optax.sgd(0.1), 3),
                        r"block without summing over the replicas \(`reduce_and` in optax apply_if_finite"),
}


@pytest.mark.parametrize("name", sorted(WRONG_ON_BLOCKS))
def test_transforms_wrong_on_flat_blocks_are_refused_before_the_first_step(strategy, name):
  make, message = WRONG_ON_BLOCKS[name]
  zopt = tpustrat.sharded_optimizer(make(), EVERY_LEAF)
  params0, data = init_params(), batches(strategy.num_replicas_in_sync)
  params = strategy.experimental_mirror(params0)
  opt_state = strategy.run(zopt.init, args=(params,))
  x, y = distribute(strategy, data)[0]
  with pytest.raises(ValueError, match=message):
    strategy.run(make_step(zopt, True), args=(params, opt_state, x, y))
  # Nothing ran: the parameters are as they were.
  np.testing.assert_array_equal(params["w1"].values[0], params0["w1"])


# Elementwise transforms, masks chosen by path, and transforms whose statistics are of the step count only
# are right on flat blocks, every leaf split: the same numbers as one-device optax.
RIGHT_ON_BLOCKS = {
    "tpustrat-clip-every-leaf": (lambda: optax.chain(tpustrat.clip_by_global_norm(1.0), optax.sgd(1e-3)),
                                 lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-3))),
    "adamw-mask-by-path": (lambda: optax.adamw(1e-2, weight_decay=0.5, mask={"w1": True, "b1": False, "w2": True,
                                                                             "b2": False, "s": False}),) * 2,
    "nesterov-schedule": (lambda: optax.sgd(optax.exponential_decay(1e-3, 2, 0.5), momentum=0.9, nesterov=True),) * 2,
    "multi-steps": (lambda: optax.MultiSteps(optax.adam(1e-2), 2),) * 2,
}


@pytest.mark.parametrize("name", sorted(RIGHT_ON_BLOCKS))
def test_transforms_right_on_flat_blocks_equal_one_device(name):
  ours, reference = RIGHT_ON_BLOCKS[name]
  strategy = strategy_of(len(jax.devices()))
  params0, data = init_params(), batches(strategy.num_replicas_in_sync)
  want, _ = one_device(reference(), params0, data)
  zopt = tpustrat.sharded_optimizer(ours(), EVERY_LEAF)
  params = strategy.experimental_mirror(params0)
  opt_state = strategy.run(zopt.init, args=(params,))
  for x, y in distribute(strategy, data):
    params, opt_state = strategy.run(make_step(zopt, True), args=(params, opt_state, x, y))
  check_params(params, want)
