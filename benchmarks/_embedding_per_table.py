"""The embedding exchange as it was before issue 25, kept for `bench_embedding.py`'s side-by-side figures.

`PerTableEmbedding` is `tpustrat.embedding.TPUEmbedding` with the old `lookup` and `apply_gradients`:
each table exchanges its ids and rows on its own (two `all_to_all`s per table and direction), buckets of
``[N, M]`` ids sized for the worst case, every occurrence of an id sent (no deduplication), and the
owner builds a dense ``[ceil(V/N), D]`` gradient and touched mask and updates its whole block. The state
(`build`, tables, slots) is the library's, so both run from the same state. Not part of the library:
a benchmark-only copy of the old code path (non-sequence features only).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tpustrat import embedding
from tpustrat._src.batch_rows import same_rows
from tpustrat._src.embedding import _block
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import LocalShard


class PerTableEmbedding(embedding.TPUEmbedding):
  """`TPUEmbedding` with the exchange and update of before issue 25 (see the module docstring)."""

  def _route_old(self, ids: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    n = self._n
    valid = (ids >= 0) & (ids < n * rows)
    owner = jnp.where(valid, ids // rows, n)
    onehot = owner[:, None] == jnp.arange(n)[None, :]
    slot = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    local = jnp.where(valid, ids % rows, -1)
    m = ids.shape[0]
    send = jnp.full((n, m), -1, jnp.int32).at[owner, slot].set(local.astype(jnp.int32), mode="drop")
    return owner, slot, valid, send

  def _exchange_old(self, x: jax.Array) -> jax.Array:
    return x if self._n == 1 else lax.all_to_all(x, REPLICA_AXIS, 0, 0, tiled=True)

  def lookup(self, state, features, weights=None):
    activations = []
    for f, name, ids, coef in self._prepare(state, features, weights, "lookup"):
      block = _block(state["tables"][name], f"table {name!r}", "lookup")
      rows = block.shape[0]
      owner, slot, valid, send = self._route_old(ids.reshape(-1), rows)
      asked = self._exchange_old(send)
      found = jnp.where((asked >= 0)[..., None], block[jnp.maximum(asked, 0)], 0.0)
      back = self._exchange_old(found)
      got = back[jnp.minimum(owner, self._n - 1), jnp.maximum(slot, 0)]
      got = jnp.where(valid[:, None], got, 0.0).reshape(ids.shape + (f.table.dim,))
      activations.append(same_rows(lax.stop_gradient(jnp.einsum("bl,bld->bd", coef, got)), ids))
    return self._treedef.unflatten(activations)

  def apply_gradients(self, state, features, gradients, weights=None) -> dict[str, Any]:
    grad_list = self._treedef.flatten_up_to(gradients)
    per_table: dict[str, tuple[jax.Array, jax.Array]] = {}
    for (_f, name, ids, coef), g in zip(self._prepare(state, features, weights, "apply_gradients"), grad_list):
      block = _block(state["tables"][name], f"table {name!r}", "apply_gradients")
      rows, dim = block.shape
      g = jnp.asarray(g, jnp.float32)
      flat = ids.reshape(-1)
      owner, slot, valid, send = self._route_old(flat, rows)
      per_id = (coef[:, :, None] * g[:, None, :]).reshape(-1, dim)
      out = jnp.zeros((self._n, flat.shape[0], dim), jnp.float32).at[owner, slot].set(per_id, mode="drop")
      asked = self._exchange_old(send)
      received = self._exchange_old(out)
      target = jnp.where(asked >= 0, asked, rows).reshape(-1)
      summed = jnp.zeros((rows, dim), jnp.float32).at[target].add(received.reshape(-1, dim), mode="drop")
      touched = jnp.zeros((rows,), bool).at[target].set(True, mode="drop")
      if name in per_table:
        prev_g, prev_t = per_table[name]
        summed, touched = prev_g + summed, prev_t | touched
      per_table[name] = (summed, touched)
    step = state["step"] + 1
    tables, slots = dict(state["tables"]), dict(state["slots"])
    for t, name in zip(self._tables, self._names):
      if name not in per_table:
        continue
      summed, touched = per_table[name]
      table = state["tables"][name]
      old_slots = {k: _block(v, f"slot {k!r} of table {name!r}", "apply_gradients")
                   for k, v in state["slots"][name].items()}
      new_rows, new_slots = self._opt(t).update(_block(table, f"table {name!r}", "apply_gradients"), old_slots,
                                                summed, touched, step)
      tables[name] = LocalShard(new_rows, table.shape, 0)
      slots[name] = {k: LocalShard(v, table.shape, 0) for k, v in new_slots.items()}
    return {"tables": tables, "slots": slots, "step": step}
