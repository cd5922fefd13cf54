"""The model, data and steps that tests/test_hybrid_sharding.py and `hybrid_mp.py` share: an MLP, its
per-replica batches, the FSDP step with Adam, and plain JAX on one device (the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tpustrat
from tpustrat import ShardedVariable

K = 2  # rows per replica
STEPS = 3


def init_params(seed=0, scalar=True):
  rng = np.random.default_rng(seed)
  p = {"w1": rng.normal(size=(13, 37)).astype(np.float32) * 0.5, "b1": rng.normal(size=(37,)).astype(np.float32),
       "w2": rng.normal(size=(37, 5)).astype(np.float32) * 0.3, "b2": rng.normal(size=(5,)).astype(np.float32)}
  if scalar:
    p["s"] = np.float32(0.7)
  return p


def split_all(path, shape, dtype):
  """Every leaf with an axis split along axis 0 (the scalar stays Mirrored)."""
  del path, dtype
  return 0 if shape else None


def batches(n=8, seed=1):
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=(K * n, 13)).astype(np.float32), rng.normal(size=(K * n, 5)).astype(np.float32))
          for _ in range(STEPS)]


def loss_fn(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return jnp.sum((p.get("s", 1.0) * (h @ p["w2"]) + p["b2"] - y) ** 2)


def one_device(tx, params, data):
  """Plain optax on one device, the whole batch each step: the independent reference."""
  device = jax.local_devices()[0]
  params = jax.device_put(jax.tree.map(jnp.asarray, params), device)
  state = tx.init(params)
  for x, y in data:
    g = jax.grad(loss_fn)(params, jax.device_put(x, device), jax.device_put(y, device))
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return jax.tree.map(np.asarray, params)


def distribute(strategy, data):
  out = []
  for x, y in data:
    xs = strategy.experimental_distribute_values_from_function(lambda c, x=x: x[K * c.replica_id_in_sync_group:][:K])
    ys = strategy.experimental_distribute_values_from_function(lambda c, y=y: y[K * c.replica_id_in_sync_group:][:K])
    out.append((xs, ys))
  return out


def fsdp_step(tx):
  def step(state, x, y):
    params, opt = state
    grads = jax.grad(lambda p: loss_fn(tpustrat.read_values(p), x, y))(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt
  return step


def whole(v):
  return np.asarray(v) if isinstance(v, ShardedVariable) else np.asarray(v.values[0])


def adam_state(strategy, params, groups=None, sharded=True):
  tx = optax.adam(1e-2)
  p = strategy.experimental_shard(params, split_all, groups=groups) if sharded else strategy.experimental_mirror(params)
  return {"params": p, "opt": strategy.run(tx.init, args=(p,))}


def as_numpy(state):
  leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))[0]
  return {jax.tree_util.keystr(p): whole(v) if isinstance(v, tpustrat.DistributedValues) else np.asarray(v)
          for p, v in leaves}


def train(strategy, state, data):
  """Adam steps of `fsdp_step` on `state` ({"params", "opt"}) over `data` (host batches)."""
  s = (state["params"], state["opt"])
  step = fsdp_step(optax.adam(1e-2))
  for x, y in distribute(strategy, data):
    s = strategy.run(step, args=(s, x, y), options=tpustrat.RunOptions(donate_argnums=0))
  return {"params": s[0], "opt": s[1]}
