"""What tests/test_checkpoint_layouts.py and its multi-process script share: a small model whose parameters
are split over the replicas (`ShardedVariable`, odd sizes, two split axes), Adam, data, and a float64
numpy reference of the same training.

Parameters ``{"w": [37, 5] split along axis 0, "u": [5, 11] split along axis 1, "b": [11] mirrored}``;
prediction ``(x @ w) @ u + b``, loss the sum of squared errors over the global batch of 16 rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import tpustrat

GLOBAL_BATCH = 16
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8
TX = optax.adam(LR, b1=B1, b2=B2, eps=EPS)
AXES = {"w": 0, "u": 1}  # the split leaves and their axes; "b" stays Mirrored


def partitioner(path: tuple[Any, ...], shape: tuple[int, ...], dtype: Any) -> int | None:
  del shape, dtype
  return AXES.get(getattr(path[-1], "key", None))


def initial_params(seed: int = 11) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {"w": rng.normal(size=(37, 5)).astype(np.float32), "u": rng.normal(size=(5, 11)).astype(np.float32),
          "b": rng.normal(size=(11,)).astype(np.float32)}


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
  """The global batch of `step` (0-based): x [16, 37], y [16, 11]."""
  rng = np.random.default_rng(100 + step)
  return (rng.normal(size=(GLOBAL_BATCH, 37)).astype(np.float32),
          rng.normal(size=(GLOBAL_BATCH, 11)).astype(np.float32))


def make_state(strategy: Any, params: dict[str, np.ndarray], sharded: bool = True) -> dict[str, Any]:
  """``{"params", "opt"}`` on `strategy`: sharded (FSDP) or mirrored (data parallel); Adam's state is made
  inside `run` from the parameters, so it has their layout."""
  placed = (strategy.experimental_shard(params, partitioner) if sharded
            else strategy.experimental_mirror(params))
  return {"params": placed, "opt": strategy.run(TX.init, args=(placed,))}


def loss_fn(p: Any, x: Any, y: Any) -> Any:
  return jnp.sum(((x @ p["w"]) @ p["u"] + p["b"] - y) ** 2)


def step(state: Any, x: Any, y: Any) -> Any:
  """One Adam step on this replica's rows; the gradients are summed over the replicas (whole blocks of
  sharded leaves: reduce-scattered)."""
  g = jax.grad(lambda p: loss_fn(tpustrat.read_values(p), x, y))(state["params"])
  updates, opt = TX.update(g, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def distribute(strategy: Any, step_index: int) -> tuple[Any, Any]:
  """Batch `step_index` split over the replicas (rows ``[r * k, (r + 1) * k)`` on replica r)."""
  x, y = batch(step_index)
  k = GLOBAL_BATCH // strategy.num_replicas_in_sync

  def rows(a: np.ndarray) -> Any:
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: a[k * ctx.replica_id_in_sync_group:k * (ctx.replica_id_in_sync_group + 1)])

  return rows(x), rows(y)


def train(strategy: Any, state: Any, steps: range, donate: bool = True) -> Any:
  options = tpustrat.RunOptions(donate_argnums=0) if donate else None
  for i in steps:
    x, y = distribute(strategy, i)
    state = strategy.run(step, args=(state, x, y), options=options)
  return state


def to_numpy(state: Any) -> dict[str, np.ndarray]:
  """``{"params/w": ..., "opt/mu/w": ..., "opt/count": ...}``: the whole values on the host, whatever
  their layout (this process's copy of mirrored ones)."""

  def whole(v: Any) -> np.ndarray:
    if isinstance(v, tpustrat.ShardedVariable):
      return np.asarray(v)
    x = v.tree if isinstance(v, tpustrat.Mirrored) else v
    return np.asarray(x.addressable_data(0))

  adam = state["opt"][0]
  out = {f"params/{k}": whole(v) for k, v in state["params"].items()}
  out.update({f"opt/mu/{k}": whole(v) for k, v in adam.mu.items()})
  out.update({f"opt/nu/{k}": whole(v) for k, v in adam.nu.items()})
  out["opt/count"] = whole(adam.count)
  return out


def numpy_train(steps: int, params: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
  """Adam in float64 numpy from `initial_params` for `steps` steps on the whole global batches, in the
  layout of `to_numpy`."""
  p = {k: v.astype(np.float64) for k, v in (params or initial_params()).items()}
  mu = {k: np.zeros_like(v) for k, v in p.items()}
  nu = {k: np.zeros_like(v) for k, v in p.items()}
  for t in range(1, steps + 1):
    x, y = (a.astype(np.float64) for a in batch(t - 1))
    h = x @ p["w"]
    e = 2 * (h @ p["u"] + p["b"] - y)
    g = {"b": e.sum(0), "u": h.T @ e, "w": x.T @ (e @ p["u"].T)}
    for k in p:
      mu[k] = B1 * mu[k] + (1 - B1) * g[k]
      nu[k] = B2 * nu[k] + (1 - B2) * g[k] ** 2
      p[k] = p[k] - LR * (mu[k] / (1 - B1 ** t)) / (np.sqrt(nu[k] / (1 - B2 ** t)) + EPS)
  out = {f"params/{k}": v for k, v in p.items()}
  out.update({f"opt/mu/{k}": v for k, v in mu.items()})
  out.update({f"opt/nu/{k}": v for k, v in nu.items()})
  out["opt/count"] = np.int32(steps)
  return out
