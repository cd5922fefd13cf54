"""Parameters and optimizer state split over the replicas (`ShardedVariable`, `experimental_shard`).

References are one-device optax / numpy on the same inputs: Adam on sharded parameters gives the numbers
of Adam on one device with the whole batch, and the compiled step gathers and reduce-scatters the sharded
parameter instead of all-reducing its gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close

import tpustrat
from tpustrat import Mirrored, ShardedVariable

N = 8


def strategies():
  devices = jax.devices()
  return [pytest.param(n, id=f"{n}-replicas") for n in (1, 2, 4, 8) if n <= len(devices)]


def make_strategy(n):
  return tpustrat.MirroredStrategy(jax.devices()[:n]) if n < N else tpustrat.TPUStrategy()


def test_experimental_shard_layout_and_conversions(strategy):
  w = np.arange(37 * 3, dtype=np.float32).reshape(37, 3)  # 37 rows over 8 replicas: blocks of 5, padded
  state = strategy.experimental_shard({"w": w, "b": np.ones(3, np.float32)},
                                      tpustrat.MinSizePartitioner(min_shard_bytes=64))
  v = state["w"]
  assert isinstance(v, ShardedVariable) and isinstance(state["b"], Mirrored)
  assert v.shape == (37, 3) and v.axis == 0 and v.num_replicas == N
  assert repr(v) == "ShardedVariable(shape=[37, 3], dtype=float32, axis=0, num_replicas=8)"
  np.testing.assert_array_equal(np.asarray(v), w)
  blocks = [np.asarray(b) for b in strategy.experimental_local_results(v)]
  assert [b.shape for b in blocks] == [(5, 3)] * N
  padded = np.zeros((40, 3), np.float32)
  padded[:37] = w
  for r, b in enumerate(blocks):
    np.testing.assert_array_equal(b, padded[5 * r:5 * r + 5])
  # Along another axis, and by a callable partitioner naming the leaf.
  x = np.arange(4 * 10, dtype=np.float32).reshape(4, 10)
  seen = []
  s = strategy.experimental_shard({"x": x}, lambda path, shape, dtype: seen.append(path) or 1)
  assert s["x"].axis == 1 and [b.shape for b in s["x"].values] == [(4, 2)] * N
  np.testing.assert_array_equal(np.asarray(s["x"]), x)
  assert len(seen) == 1


def test_bad_partitions_are_errors_naming_the_leaf(strategy):
  with pytest.raises(ValueError, match=r"experimental_shard \(the leaf at \[.w.\]\): `axis` = 2 out of range"):
    strategy.experimental_shard({"w": np.zeros((4, 4))}, lambda *_: 2)
  with pytest.raises(ValueError, match=r"scalar at \['s'\]"):
    strategy.experimental_shard({"s": np.float32(1)}, lambda *_: 0)
  with pytest.raises(TypeError, match=r"returned 'rows' for the leaf at \['w'\]"):
    strategy.experimental_shard({"w": np.zeros((4, 4))}, lambda *_: "rows")
  per_replica = strategy.experimental_distribute_values_from_function(lambda c: np.zeros(2, np.float32))
  with pytest.raises(ValueError, match=r"at \['p'\] is a PerReplica"):
    strategy.experimental_shard({"p": per_replica})
  with pytest.raises(ValueError, match="max_shards=2"):
    strategy.experimental_shard({"w": np.zeros((64, 64))}, tpustrat.MinSizePartitioner(max_shards=2))


def test_a_block_is_not_an_array_and_is_not_all_reduced(strategy):
  state = strategy.experimental_shard({"w": np.ones((16, 2), np.float32)}, lambda *_: 0)
  with pytest.raises(TypeError, match=r"holds only this replica's block: read the whole value first"):
    strategy.run(lambda s: s["w"] * 2.0, args=(state,))
  with pytest.raises(ValueError, match=r"all_reduce: the value at \['w'\] is a sharded value"):
    strategy.run(lambda s: tpustrat.get_replica_context().all_reduce("sum", s), args=(state,))
  for what in ("reduce", "gather"):
    with pytest.raises(ValueError, match=rf"strategy.{what}: ShardedVariable.*split over the replicas"):
      strategy.reduce("sum", state["w"], axis=None) if what == "reduce" else strategy.gather(state["w"], axis=0)


def test_read_value_and_its_gradient(strategy):
  rng = np.random.default_rng(0)
  w = rng.normal(size=(13, 3)).astype(np.float32)
  c = rng.normal(size=(N, 13, 3)).astype(np.float32)  # each replica's own weights in the loss
  v = strategy.experimental_shard(w, lambda *_: 0)
  cs = tpustrat.PerReplica(list(c))

  def step(v, c):
    loss = lambda blocks: jnp.sum(blocks.read_value() ** 2 * c)
    g = jax.grad(loss)(v)
    return v.read_value(), g

  full, grad = strategy.run(step, args=(v, cs))
  np.testing.assert_array_equal(full.values[0], w)
  assert isinstance(grad, ShardedVariable) and grad.shape == (13, 3)
  # d/dw sum_r sum(w^2 * c_r) = 2 w * sum_r c_r: the gradient summed over replicas, each holding its block.
  assert_close(np.asarray(grad), 2 * w * c.sum(0), scale=2 * np.abs(w) * np.abs(c).sum(0))


@pytest.mark.parametrize("n", strategies())
def test_adam_on_sharded_parameters_equals_one_device(n):
  strategy = make_strategy(n)
  rng = np.random.default_rng(1)
  w0 = rng.normal(size=(37, 5)).astype(np.float32)
  b0 = rng.normal(size=(5,)).astype(np.float32)
  batches = [(rng.normal(size=(8 * n, 37)).astype(np.float32), rng.normal(size=(8 * n, 5)).astype(np.float32))
             for _ in range(4)]
  tx = optax.adam(1e-2)

  def loss_fn(p, x, y):
    return jnp.sum((x @ p["w"] + p["b"] - y) ** 2)

  # One device: the whole batch, plain optax.
  params, opt = {"w": jnp.asarray(w0), "b": jnp.asarray(b0)}, None
  opt = tx.init(params)
  for x, y in batches:
    g = jax.grad(loss_fn)(params, x, y)
    updates, opt = tx.update(g, opt, params)
    params = optax.apply_updates(params, updates)

  # n replicas, w sharded (b mirrored): the optimizer state made inside run is sharded like w.
  state = {"params": strategy.experimental_shard({"w": w0, "b": b0}, tpustrat.MinSizePartitioner(min_shard_bytes=64))}
  state["opt"] = strategy.run(tx.init, args=(state["params"],))
  assert isinstance(state["opt"][0].mu["w"], ShardedVariable) and isinstance(state["opt"][0].mu["b"], Mirrored)

  def step(state, x, y):
    loss, g = jax.value_and_grad(lambda p: loss_fn(tpustrat.read_values(p), x, y))(state["params"])
    updates, opt = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

  for x, y in batches:
    xs = strategy.experimental_distribute_values_from_function(
        lambda c, x=x: x[8 * c.replica_id_in_sync_group:][:8])
    ys = strategy.experimental_distribute_values_from_function(
        lambda c, y=y: y[8 * c.replica_id_in_sync_group:][:8])
    state, _ = strategy.run(step, args=(state, xs, ys), options=tpustrat.RunOptions(donate_argnums=0))
  assert isinstance(state["params"]["w"], ShardedVariable)
  assert_close(np.asarray(state["params"]["w"]), params["w"], rtol=1e-4, scale=np.abs(params["w"]).max() + 1)
  assert_close(state["params"]["b"].values[0], params["b"], rtol=1e-4, scale=np.abs(params["b"]).max() + 1)
  assert_close(np.asarray(state["opt"][0].nu["w"]), opt[0].nu["w"], rtol=1e-4, scale=np.abs(opt[0].nu["w"]).max())


def test_the_step_gathers_and_reduce_scatters_the_sharded_parameter(strategy):
  w = strategy.experimental_shard(np.ones((64, 32), np.float32), lambda *_: 0)
  x = strategy.experimental_distribute_values_from_function(lambda c: np.ones((4, 64), np.float32))

  def step(w, x):
    g = jax.grad(lambda v: jnp.sum((x @ v.read_value()) ** 2))(w)
    return jax.tree.map(lambda a, b: a - 1e-4 * b, w, g)

  new = strategy.run(step, args=(w, x))
  # d/dW sum((x W)^2) = 2 x^T x W, x all ones [4, 64] on 8 replicas, W all ones: 2 * 4 * 64 * 8 per entry.
  np.testing.assert_allclose(np.asarray(new), 1.0 - 1e-4 * 2 * 4 * 64 * N, rtol=1e-5)
  engine = strategy._engine
  leaves, in_tree = jax.tree.flatten(((w, x), {}))
  (program, targets), = [e for (k, t), e in engine._entries.items() if t == in_tree and (
      k() if callable(k) else k) is step]
  hlo = program._flat.lower(*[engine._place(v, t) for v, t in zip(leaves, targets)]).compile().as_text()
  assert hlo.count("all-gather(") >= 1 and hlo.count("reduce-scatter(") >= 1
  assert "all-reduce(" not in hlo  # the gradient is never all-reduced whole
  memory = program._flat.lower(*[engine._place(v, t) for v, t in zip(leaves, targets)]).compile().memory_analysis()
  assert memory.argument_size_in_bytes < 64 * 32 * 4  # 1/8 of the parameter (+ the batch) per device


@pytest.mark.parametrize("saved_on, restored_on", [(8, 8), (8, 4), (4, 8), (8, 1), (2, 8)])
def test_sharded_state_restores_onto_another_replica_count_bit_for_bit(tmp_path, saved_on, restored_on):
  from tpustrat.checkpoint import CheckpointManager

  rng = np.random.default_rng(3)
  w = rng.normal(size=(37, 3)).astype(np.float32)  # padded differently on each replica count
  u = rng.normal(size=(2, 11)).astype(np.float32)  # split along axis 1
  saver = make_strategy(saved_on)
  state = {"w": saver.experimental_shard(w, lambda *_: 0), "u": saver.experimental_shard(u, lambda *_: 1),
           "step": saver.experimental_mirror(np.int32(5))}
  with CheckpointManager(tmp_path, saver) as manager:
    manager.save(5, state)
  loader = make_strategy(restored_on)
  target = {"w": loader.experimental_shard(np.zeros_like(w), lambda *_: 0),
            "u": loader.experimental_shard(np.zeros_like(u), lambda *_: 1),
            "step": loader.experimental_mirror(np.int32(0))}
  with CheckpointManager(tmp_path, loader) as manager:
    got = manager.restore(5, target=target)
  for name, want in (("w", w), ("u", u)):
    assert isinstance(got[name], ShardedVariable) and got[name].num_replicas == restored_on
    np.testing.assert_array_equal(np.asarray(got[name]), want)
  assert int(got["step"].values[0]) == 5
  # Restored blocks are where run wants them: a step runs on them at once.
  out = loader.run(lambda s: s["w"].read_value().sum(), args=(got,))
  assert_close(out.values[0], w.sum(), scale=np.abs(w).sum())


def test_clipping_by_the_whole_gradients_norm_equals_one_device(strategy):
  rng = np.random.default_rng(4)
  w0 = rng.normal(size=(21, 4)).astype(np.float32) * 3
  b0 = rng.normal(size=(4,)).astype(np.float32)
  x = rng.normal(size=(8 * N, 21)).astype(np.float32)
  y = rng.normal(size=(8 * N, 4)).astype(np.float32)

  def loss_fn(p, x, y):
    return jnp.sum((x @ p["w"] + p["b"] - y) ** 2)

  one = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
  params = {"w": jnp.asarray(w0), "b": jnp.asarray(b0)}
  g = jax.grad(loss_fn)(params, x, y)
  assert float(optax.tree.norm(g)) > 1.0  # the clip is active
  updates, _ = one.update(g, one.init(params), params)
  want = optax.apply_updates(params, updates)

  tx = optax.chain(tpustrat.clip_by_global_norm(1.0), optax.sgd(0.1))
  params = strategy.experimental_shard({"w": w0, "b": b0}, tpustrat.MinSizePartitioner(min_shard_bytes=64))
  xs = strategy.experimental_distribute_values_from_function(lambda c: x[8 * c.replica_id_in_sync_group:][:8])
  ys = strategy.experimental_distribute_values_from_function(lambda c: y[8 * c.replica_id_in_sync_group:][:8])

  def step(p, x, y):
    g = jax.grad(lambda q: loss_fn(tpustrat.read_values(q), x, y))(p)
    updates, _ = tx.update(g, tx.init(p), p)
    return optax.apply_updates(p, updates), tpustrat.global_norm(g)

  new, norm = strategy.run(step, args=(params, xs, ys))
  assert_close(norm.values[0], float(optax.tree.norm(jax.grad(loss_fn)({"w": w0, "b": b0}, x, y))), rtol=1e-4)
  assert_close(np.asarray(new["w"]), want["w"], rtol=1e-5, scale=np.abs(want["w"]).max())
  assert_close(new["b"].values[0], want["b"], rtol=1e-5, scale=np.abs(want["b"]).max())


@pytest.mark.parametrize("tx, message", [
    (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), r"`reduce_sum` in optax .*clip_by_global_norm"),
    (optax.chain(optax.clip_by_block_rms(0.1), optax.sgd(0.1)), r"`reduce_sum` in optax clip_by_block_rms"),
], ids=["optax-clip-by-global-norm", "clip-by-block-rms"])
def test_a_statistic_of_one_replicas_block_is_refused_before_the_step_runs(strategy, tx, message):
  # optax's own clip on the blocks of sharded parameters clips each replica's block by that block's norm.
  rng = np.random.default_rng(5)
  w0 = rng.normal(size=(21, 4)).astype(np.float32) * 3
  params = strategy.experimental_shard({"w": w0, "b": np.ones(4, np.float32)},
                                       tpustrat.MinSizePartitioner(min_shard_bytes=64))

  def step(p):
    g = jax.grad(lambda q: jnp.sum(tpustrat.read_values(q)["w"] ** 2) + jnp.sum(q["b"]))(p)
    updates, _ = tx.update(g, tx.init(p), p)
    return optax.apply_updates(p, updates)

  with pytest.raises(ValueError, match=r"sharded output at \['w'\] is computed from a statistic of this "
                                       r"replica's block alone \(" + message + r".*tpustrat.clip_by_global_norm"):
    strategy.run(step, args=(params,))
  np.testing.assert_array_equal(np.asarray(params["w"]), w0)


HIDDEN_BLOCK_STATISTICS = {
    "inside lax.scan": lambda t: jax.lax.scan(lambda c, _: (c, jnp.sum(c ** 2)), t, None, length=1)[1][0],
    "inside fori_loop": lambda t: jax.lax.fori_loop(0, 1, lambda i, a: a + jnp.sum(t ** 2), jnp.sum(t) * 0.0),
    "vdot": lambda t: jnp.vdot(t, t),
    "of the raveled block": lambda t: jnp.sum(jnp.ravel(t) ** 2),
    "top_k": lambda t: jax.lax.top_k(jnp.ravel(t), 1)[0][0],
    "of a slice": lambda t: jnp.sum(t.reshape(-1)[:-1] ** 2),
    "of a concatenation": lambda t: jnp.sum(jnp.concatenate([t.ravel(), t.ravel()]) ** 2),
}


@pytest.mark.parametrize("name", sorted(HIDDEN_BLOCK_STATISTICS))
def test_a_block_statistic_behind_a_loop_or_a_reshape_is_refused(strategy, name):
  stat = HIDDEN_BLOCK_STATISTICS[name]
  params = strategy.experimental_shard({"w": np.ones((21, 4), np.float32)}, tpustrat.MinSizePartitioner(min_shard_bytes=64))

  def step(p):
    g = jax.grad(lambda q: jnp.sum(tpustrat.read_values(q)["w"] ** 2))(p)
    return optax.apply_updates(p, jax.tree.map(lambda t: -0.1 * t / (stat(t) + 1.0), g))

  with pytest.raises(ValueError, match=r"computed from a statistic of this replica's block alone"):
    strategy.run(step, args=(params,))


def test_a_block_statistic_carried_through_a_scan_and_summed_over_the_replicas_is_right(strategy):
  w0 = np.random.default_rng(7).normal(size=(21, 4)).astype(np.float32)
  params = strategy.experimental_shard({"w": w0}, tpustrat.MinSizePartitioner(min_shard_bytes=64))

  def step(p):
    b = p["w"]
    local = jnp.sum(b.real_block() ** 2)
    (u, s), _ = jax.lax.scan(lambda c, _: ((c[0] * 0.5, c[1]), None), (b.block, local), None, length=2)
    total = tpustrat.get_replica_context().all_reduce("sum", s)  # the whole value's: right
    return {"w": tpustrat.LocalShard(u / jnp.sqrt(total), b.shape, b.axis)}

  out = strategy.run(step, args=(params,))
  want = w0 * 0.25 / np.sqrt((w0.astype(np.float64) ** 2).sum())
  assert_close(np.asarray(out["w"]), want, rtol=1e-5, scale=np.abs(want).max())


def test_a_statistic_along_an_axis_that_is_not_split_is_right(strategy):
  # Each row's norm, of a value split by rows: every replica holds its rows whole, so no error and numpy's numbers.
  rng = np.random.default_rng(6)
  w0 = rng.normal(size=(21, 4)).astype(np.float32)
  params = strategy.experimental_shard({"w": w0}, tpustrat.MinSizePartitioner(min_shard_bytes=64))

  def step(p):
    b = p["w"]
    rows = b.block / jnp.sqrt(jnp.sum(b.block ** 2, axis=1, keepdims=True) + 1.0)
    return {"w": tpustrat.LocalShard(rows, b.shape, b.axis)}

  new = strategy.run(step, args=(params,))
  want = w0 / np.sqrt(np.sum(w0.astype(np.float64) ** 2, axis=1, keepdims=True) + 1.0)
  assert_close(np.asarray(new["w"]), want, rtol=1e-5, scale=1.0)


def test_sharded_carry_in_run_steps_and_in_experimental_mirror(strategy):
  rng = np.random.default_rng(5)
  w0 = rng.normal(size=(19, 3)).astype(np.float32)
  w = strategy.experimental_shard(w0, lambda *_: 0)
  mirrored = strategy.experimental_mirror({"w": w, "s": np.float32(1)})
  assert isinstance(mirrored["w"], ShardedVariable) and isinstance(mirrored["s"], Mirrored)

  def step(carry, x):
    g = jax.grad(lambda v: jnp.sum((x @ v.read_value()) ** 2))(carry)
    return jax.tree.map(lambda a, b: a - 1e-3 * b, carry, g), jnp.zeros(())

  xs = [rng.normal(size=(16, 19)).astype(np.float32) for _ in range(3)]
  carry, _ = strategy.experimental_run_steps(step, iter(strategy.experimental_distribute_dataset(xs)), steps=3,
                                             init=w, options=tpustrat.RunOptions(donate_argnums=0))
  want = w0.astype(np.float64)
  for x in xs:
    want = want - 1e-3 * 2 * x.T @ (x @ want)
  assert isinstance(carry, ShardedVariable)
  assert_close(np.asarray(carry), want, rtol=1e-4, scale=np.abs(want).max())


def test_sharded_value_errors(strategy, tmp_path):
  from tpustrat.checkpoint import CheckpointManager

  with pytest.raises(ValueError, match=r"size 0 along axis 0"):
    strategy.experimental_shard({"e": np.zeros((0, 4))}, lambda *_: 0)
  v = strategy.experimental_shard({"w": np.ones((13, 3), np.float32)}, lambda *_: 0)
  with pytest.raises(ValueError, match=r"sharded value at \['w'\] comes back with a block of shape \[1, 3\].*\[2, 3\]"):
    strategy.run(lambda s: jax.tree.map(lambda b: b[:1], s), args=(v,))
  # A checkpoint restored into a target of another axis or shape is an error, not garbage.
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(1, v)
    with pytest.raises(ValueError, match=r"sharded variable at \['w'\] was saved as 8 blocks of shape \[2, 3\]"):
      manager.restore(1, target=strategy.experimental_shard({"w": np.zeros((3, 13), np.float32)}, lambda *_: 1))
  # A value sharded on another replica count is split anew for this one.
  four = make_strategy(4).experimental_shard(np.arange(10.0, dtype=np.float32), lambda *_: 0)
  again = strategy.experimental_shard(four)
  assert again.num_replicas == N
  np.testing.assert_array_equal(np.asarray(again), np.arange(10.0))


# ---------------------------------------------------------------------------------------------------
# Per-layer gathering: stacked layers scanned over, read one layer at a time
# ---------------------------------------------------------------------------------------------------


def _stacked_mlp_loss(read, policy=None):
  """``loss(w, x)`` of L tanh layers ``x <- tanh(x @ w[l])`` scanned over the leading axis of `w`
  (``[L, d, d]``); `read` turns the scanned slice into the layer's weights; with a `policy` the layer is
  rematerialised (`jax.checkpoint`)."""

  def loss(w, x):
    def layer(h, wl):
      return jnp.tanh(h @ read(wl)), None

    h, _ = jax.lax.scan(layer if policy is None else jax.checkpoint(layer, policy=policy), x, w)
    return jnp.sum(h ** 2)

  return loss


def _numpy_stacked_mlp_grad(w, xs):
  """The gradient of sum over replicas r of sum(tanh(...tanh(x_r @ w0)... @ w[L-1])^2) w.r.t. w, by hand."""
  grad = np.zeros_like(w, np.float64)
  for x in xs:
    hs = [x.astype(np.float64)]
    for wl in w:
      hs.append(np.tanh(hs[-1] @ wl))
    upstream = 2 * hs[-1]
    for l in reversed(range(len(w))):
      pre = upstream * (1 - hs[l + 1] ** 2)
      grad[l] += hs[l].T @ pre
      upstream = pre @ w[l].T
  return grad


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_scanned_layers_read_one_layer_and_their_gradient_is_one_devices(n, remat):
  # A value of shape [L, d, d] split along axis 1 (odd d: padded); a scan over its layers hands the body
  # [d/N, d] blocks, and read_value gathers that layer only. The gradient is the block of the gradient
  # summed over replicas, as numpy computes it on one device.
  strategy = make_strategy(n)
  rng = np.random.default_rng(1)
  L, d = 3, 11
  w = (rng.normal(size=(L, d, d)) / np.sqrt(d)).astype(np.float32)
  xs = rng.normal(size=(n, 2, d)).astype(np.float32)
  v = strategy.experimental_shard(w, lambda *_: 1)
  policy = tpustrat.gather_again_policy() if remat else None
  loss = _stacked_mlp_loss(lambda wl: wl.read_value(), policy)

  def step(v, x):
    return jax.grad(loss)(v, x)

  x = strategy.experimental_distribute_values_from_function(lambda ctx: xs[ctx.replica_id_in_sync_group])
  grad = strategy.run(step, args=(v, x))
  assert isinstance(grad, ShardedVariable) and grad.shape == (L, d, d) and grad.axis == 1
  want = _numpy_stacked_mlp_grad(w.astype(np.float64), xs)
  assert_close(np.asarray(grad), want, scale=np.abs(want).max() * d)


def test_scanning_over_the_split_axis_is_an_error(strategy):
  v = strategy.experimental_shard(np.ones((16, 4), np.float32), lambda *_: 0)

  def step(v):
    return jax.lax.scan(lambda c, row: (c + jnp.sum(row.read_value()), None), 0.0, v)[0]

  with pytest.raises(ValueError, match=r"only leading axes before the split axis may be indexed away"):
    strategy.run(step, args=(v,))


def _compiled(strategy, step, args):
  engine = strategy._engine
  leaves, in_tree = jax.tree.flatten((tuple(args), {}))
  (program, targets), = [e for (k, t), e in engine._entries.items() if t == in_tree and (
      k() if callable(k) else k) is step]
  return program._flat.lower(*[engine._place(v, t) for v, t in zip(leaves, targets)]).compile()


def test_remat_keeps_one_gathered_layer_not_the_models(strategy):
  # 8 layers of [256, 256] float32 (256 KiB each, 2 MiB in all), split along axis 1, a batch of 2 rows
  # per replica (activations are small): without remat the backward pass keeps every gathered layer
  # (temporaries >= the whole model); with `gather_again_policy` it gathers each layer again, so the
  # temporaries hold about one layer's weights and its gradient.
  L, d = 8, 256
  layer_bytes = d * d * 4
  w = strategy.experimental_shard(np.full((L, d, d), 0.01, np.float32), lambda *_: 1)
  x = strategy.experimental_distribute_values_from_function(lambda c: np.ones((2, d), np.float32))

  def make(policy):
    def layer(h, wl):
      return jnp.tanh(h @ wl.read_value()), None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy)

    def step(w, x):
      g = jax.grad(lambda w: jnp.sum(jax.lax.scan(body, x, w)[0] ** 2))(w)
      return jax.tree.map(lambda a, b: a - 0.1 * b, w, g)

    return step

  figures = {}
  for name, policy in [("plain", None), ("remat", tpustrat.gather_again_policy())]:
    step = make(policy)
    strategy.run(step, args=(w, x))
    compiled = _compiled(strategy, step, (w, x))
    hlo = compiled.as_text()
    figures[name] = (compiled.memory_analysis().temp_size_in_bytes, hlo.count("all-gather("),
                     hlo.count("reduce-scatter("))
  (plain_temp, plain_gathers, plain_scatters), (remat_temp, remat_gathers, remat_scatters) = (
      figures["plain"], figures["remat"])
  assert plain_temp >= L * layer_bytes, figures  # every gathered layer kept for the backward pass
  assert remat_temp <= 3 * layer_bytes, figures  # about one layer (+ its gradient), not the model's 8
  # One all-gather in the forward scan's body, one more in the backward's (gathered again); one
  # reduce-scatter per layer in the backward's body.
  assert (plain_gathers, plain_scatters) == (1, 1) and (remat_gathers, remat_scatters) == (2, 1), figures


def _sgd_reference(w, xs, lr, steps):
  """``steps`` SGD steps of sum_r sum((x_r @ w)^2) on one device, float64 numpy."""
  w = w.astype(np.float64)
  for _ in range(steps):
    w = w - lr * sum(2 * x.T.astype(np.float64) @ (x.astype(np.float64) @ w) for x in xs)
  return w


def test_sharded_state_through_run_in_a_users_jit_and_scan(strategy):
  # `run` inside the user's `jax.jit`, and inside a `lax.scan` there, carrying a ShardedVariable (odd rows:
  # padded): the carry keeps its type, and the numbers are one device's.
  rng = np.random.default_rng(3)
  w0 = rng.normal(size=(13, 6)).astype(np.float32)
  xs = rng.normal(size=(N, 2, 13)).astype(np.float32)
  x = strategy.experimental_distribute_values_from_function(lambda c: xs[c.replica_id_in_sync_group])
  lr = 1e-3

  def step(w, x):
    g = jax.grad(lambda v: jnp.sum((x @ v.read_value()) ** 2))(w)
    return jax.tree.map(lambda a, b: a - lr * b, w, g)

  @jax.jit
  def once(w, x):
    return strategy.run(step, args=(w, x))

  @jax.jit
  def many(w, x):
    return jax.lax.scan(lambda w, _: (strategy.run(step, args=(w, x)), None), w, None, length=3)[0]

  w = strategy.experimental_shard(w0, lambda *_: 0)
  one = once(w, x)
  assert isinstance(one, ShardedVariable) and one.shape == (13, 6)
  want = _sgd_reference(w0, xs, lr, 1)
  assert_close(np.asarray(one), want, scale=np.abs(want).max() + 1)
  three = many(w, x)
  assert isinstance(three, ShardedVariable) and three.shape == (13, 6)
  want = _sgd_reference(w0, xs, lr, 3)
  assert_close(np.asarray(three), want, scale=np.abs(want).max() + 1)


@pytest.mark.parametrize("n", [2, 8])
def test_bfloat16_sharded_parameters_with_adam(n):
  # bfloat16 parameters split over the replicas (odd size), Adam's state made from them inside `run`:
  # the same as optax on one device in bfloat16, to bfloat16's resolution; blocks stay bfloat16.
  strategy = make_strategy(n)
  rng = np.random.default_rng(4)
  w0 = rng.normal(size=(29, 3)).astype(jnp.bfloat16)
  xs = rng.normal(size=(n, 4, 29)).astype(np.float32)
  tx = optax.adam(1e-2)

  def loss_fn(w, x):
    return jnp.sum((x @ w.astype(jnp.float32)) ** 2)

  w_one, opt_one = jnp.asarray(w0), tx.init(jnp.asarray(w0))
  for _ in range(3):
    g = sum(jax.grad(loss_fn)(w_one, x) for x in xs)
    u, opt_one = tx.update(g, opt_one, w_one)
    w_one = optax.apply_updates(w_one, u)

  w = strategy.experimental_shard(w0, lambda *_: 0)
  assert w.dtype == jnp.bfloat16
  opt = strategy.run(tx.init, args=(w,))
  x = strategy.experimental_distribute_values_from_function(lambda c: xs[c.replica_id_in_sync_group])

  def step(w, opt, x):
    g = jax.grad(lambda v: loss_fn(v.read_value(), x))(w)
    u, opt = tx.update(g, opt, w)
    return optax.apply_updates(w, u), opt

  for _ in range(3):
    w, opt = strategy.run(step, args=(w, opt, x), options=tpustrat.RunOptions(donate_argnums=(0, 1)))
  assert isinstance(w, ShardedVariable) and w.dtype == jnp.bfloat16
  got, want = np.asarray(w).astype(np.float32), np.asarray(w_one).astype(np.float32)
  # Adam moved each entry by about lr per step (3e-2 in all); the two runs may differ by one bfloat16 step
  # of the value (2^-7 of it at most) where the float32 gradient sums round differently.
  assert np.abs(want - w0.astype(np.float32)).max() > 2e-2
  np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3)


def test_global_norm_and_clipping_leave_out_padding_whatever_it_holds(strategy):
  # [3, 2] on 8 replicas: 5 blocks of padding only. An elementwise update (+1) also changes the padding;
  # the norm is still the value's: sqrt(6) for ones, and clipping to 1 gives a value of norm 1.
  v = strategy.experimental_shard({"w": np.zeros((3, 2), np.float32)}, lambda *_: 0)
  v = strategy.run(lambda p: jax.tree.map(lambda b: b + 1.0, p), args=(v,))
  padding = np.asarray(strategy.experimental_local_results(v["w"])[5])
  assert np.all(padding == 1.0)  # the padding rows were changed too
  norm = strategy.run(tpustrat.global_norm, args=(v,))
  assert_close(norm.values[0], np.sqrt(6.0))
  tx = tpustrat.clip_by_global_norm(1.0)
  clipped = strategy.run(lambda p: tx.update(p, tx.init(p))[0], args=(v,))
  assert_close(np.linalg.norm(np.asarray(clipped["w"])), 1.0)
