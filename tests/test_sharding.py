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
