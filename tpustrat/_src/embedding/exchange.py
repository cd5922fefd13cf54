"""The embedding's exchange: the layouts rows travel on, the routing of ids into the owners' buckets
(sorted and deduplicated), one collective for all the tables of a layout, the owners' updates of their
blocks, and the check of the tables' bounds inside a step. `TPUEmbedding` (`tpu_embedding.py`) drives them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpustrat._src.embedding.config import TableConfig
from tpustrat._src.embedding.optimizers import updates_untouched_rows
from tpustrat._src.names import REPLICA_AXIS

ALL_TO_ALL, ALL_GATHER_TABLE, ALL_GATHER_IDS = "all_to_all", "all_gather_table", "all_gather_ids"
EMPTY = "empty"  # a table whose features hold no ids in a step
GATHER_TABLE_UP_TO = 2  # a table is all-gathered whole when its block has at most this many rows per id
_DENSE_BLOCKS_UP_TO = 2  # dense updates of blocks of at most this many times the received slots (tests: 0)


@dataclasses.dataclass
class Route:
  """A table's share of one exchange: its features (`members`, indexes into `TPUEmbedding._prepare`'s
  list) and their flat id counts (`sizes`), and where each of its flat ids went (`owner`, `slot`,
  `send`)."""

  table: TableConfig
  name: str
  block: jax.Array
  members: list[int]
  sizes: list[int]
  owner: jax.Array
  slot: jax.Array
  send: jax.Array
  counts: jax.Array  # [2, N]: the ids and the distinct ids this replica sends each owner
  check: jax.Array  # float32 zero that fails the step when a bound is exceeded: added to the results,
  # not to the ids sent, so that the exchanges of ids of `lookup` and `apply_gradients` stay one


@dataclasses.dataclass
class Gathered:
  """The share of a step of a table on one of the all-gather layouts: its features (`members`, `sizes`
  as in `Route`) and their flat ids (`ids` [M], -1: padding)."""

  table: TableConfig
  name: str
  block: jax.Array
  members: list[int]
  sizes: list[int]
  ids: jax.Array


def one_collective(parts: list[jax.Array], collective: Callable[[jax.Array], jax.Array]) -> list[jax.Array]:
  """`collective` applied once to `parts` (same leading axes) concatenated along their last axis, and
  its result split back along its last axis into pieces of the parts' sizes: one collective for every
  table of a layout."""
  sizes = [p.shape[-1] for p in parts]
  out = collective(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1))
  return jnp.split(out, np.cumsum(sizes)[:-1].tolist(), axis=-1) if len(parts) > 1 else [out]


def route(ids: jax.Array, n: int, rows: int, cap: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(owner [M], slot [M], send [N, cap], counts [2, N]) for a table's flat ids [M] (-1: padding) on `n`
  replicas holding blocks of `rows` rows: `send[o]` holds the distinct local rows this replica asks
  replica `o` for (-1: empty), id `i` finds its row at ``[owner[i], slot[i]]`` of what comes back (owner
  N: padding). Duplicates travel once.
  `counts`: the ids, and the distinct ids, this replica sends each owner (for `check_bounds`)."""
  m = ids.shape[0]
  sentinel = n * rows  # sorts after every id
  uniq, inverse = _unique(jnp.where(ids >= 0, ids, sentinel), sentinel, m)
  u_owner = jnp.minimum(uniq // rows, n)  # n: padding
  per_owner = jnp.zeros((n + 1,), jnp.int32).at[u_owner].add(1)
  # uniq is sorted, so the distinct ids of each owner are consecutive: a slot is the rank among them
  u_slot = jnp.arange(m, dtype=jnp.int32) - (jnp.cumsum(per_owner) - per_owner)[u_owner]
  send = jnp.full((n, cap), -1, jnp.int32).at[u_owner, u_slot].set(uniq % rows, mode="drop")
  owner = u_owner[inverse]
  raw = jnp.zeros((n + 1,), jnp.int32).at[owner].add(1)[:n]
  return owner, u_slot[inverse], send, jnp.stack([raw, per_owner[:n]])


def _unique(keys: jax.Array, sentinel: int, size: int) -> tuple[jax.Array, jax.Array]:
  """(uniq [size], inverse [len(keys)]): the distinct `keys` sorted (then `sentinel`), and each key's
  index in them: ``uniq[inverse] == keys``. Static shapes (`jnp.unique(size=...)` by a sort); `size`
  must be at least the number of distinct keys, and ``0 <= keys <= sentinel``."""
  ordered, order = _sort_with_order(keys, sentinel)
  first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
  rank = (jnp.cumsum(first) - 1).astype(jnp.int32)
  inverse = jnp.zeros(keys.shape, jnp.int32).at[order].set(rank)
  uniq = jnp.full((size,), sentinel, keys.dtype).at[rank].set(ordered, mode="drop")
  return uniq, inverse


def _sort_with_order(keys: jax.Array, largest: int) -> tuple[jax.Array, jax.Array]:
  """(`keys` sorted, the permutation that sorts them) for int32 ``0 <= keys <= largest``. One sort of
  one int32 operand, each key packed with its position in the low bits (``key << b | i``) where that fits
  in int32: a sort of (key, position) pairs, what `jnp.argsort` does, costs about ten times as much on
  XLA:CPU (measured: 2.6 ms against 0.3 ms for 4096 keys on 8 emulated devices), and shifts and masks
  unpack what integer division would (slow there too). Ties are broken by position, as in a stable
  sort; keys too large to pack: `jnp.argsort`."""
  n = keys.shape[0]
  bits = max(n - 1, 1).bit_length()
  if (largest << bits) | ((1 << bits) - 1) > np.iinfo(np.int32).max:
    order = jnp.argsort(keys).astype(jnp.int32)
    return keys[order], order
  packed = jnp.sort(lax.shift_left(keys.astype(jnp.int32), jnp.int32(bits)) | jnp.arange(n, dtype=jnp.int32))
  return lax.shift_right_logical(packed, jnp.int32(bits)), packed & jnp.int32((1 << bits) - 1)


def update_rows(opt: Any, block: jax.Array, slots: dict[str, jax.Array], asked: jax.Array, grads: jax.Array,
            step: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The owner's update of its block from the gradients it received: `asked` [K] local rows (-1: empty
  slot; a row asked by several replicas appears several times), `grads` [K, D].

  Sparse (every optimizer but non-lazy Adam): the distinct touched rows are found by a sort, their
  gradients summed, their rows and slots gathered, updated by `opt.update` on ``[K', D]`` and scattered
  back with ``.at[rows].set(mode="drop")``: XLA writes them into the (donated) block in place, and
  nothing of the size of the block is built. Dense (non-lazy Adam: TF's rule on every row; or a block
  of no more rows than the `K` received slots, where the sort costs more than the block): a ``[rows, D]``
  gradient and touched mask, and `opt.update` on the whole block."""
  rows, dim = block.shape
  if updates_untouched_rows(opt) or rows <= asked.shape[0] * _DENSE_BLOCKS_UP_TO:
    target = jnp.where(asked >= 0, asked, rows)
    summed = jnp.zeros((rows, dim), jnp.float32).at[target].add(grads, mode="drop")
    touched = jnp.zeros((rows,), bool).at[target].set(True, mode="drop")
    return opt.update(block, slots, summed, touched, step)
  size = min(asked.shape[0], rows + 1)  # distinct rows, plus the empty slots' key
  uniq, inverse = _unique(jnp.where(asked >= 0, asked, rows), rows, size)
  summed = jnp.zeros((size, dim), jnp.float32).at[inverse].add(grads)
  touched = uniq < rows  # the rest is the empty slots' key `rows`: out of bounds, dropped below
  at = jnp.minimum(uniq, rows - 1)
  new_rows, new_slots = opt.update(block[at], {k: v[at] for k, v in slots.items()}, summed, touched, step)
  return (block.at[uniq].set(new_rows, mode="drop"),
          {k: slots[k].at[uniq].set(v, mode="drop") for k, v in new_slots.items()})


def check_bounds(tables: list[tuple[str, list[tuple[int, str]], int]], counts: jax.Array) -> jax.Array:
  """An int32 zero for the step's results to add, computed by a host callback that raises a ValueError
  naming the table, the bound and the replica when a replica sends one owner more ids than a bound allows
  (the bucket would drop some: the step fails instead). `tables`: (name, bounds, bucket size) of each
  routed table; `counts` [T, 2, N]: the ids and the distinct ids this replica sends each owner, per
  table. Every replica's counts, of all tables, are all-gathered first (one `all_gather`), so every
  replica sees the same excess and fails together (one replica failing alone would leave the others
  waiting in the exchange). Evaluated only when a bound is exceeded; JAX hands the ValueError to the
  caller inside a `jax.errors.JaxRuntimeError`."""
  everyone = lax.all_gather(counts, REPLICA_AXIS)  # [N, T, 2, N]: sender x table x count x owner
  limits = []
  for t, (_, bounds, cap) in enumerate(tables):
    for bound, what in bounds + [(cap, "bucket size")]:
      limits.append((t, 0 if what == "max_ids_per_partition" else 1, bound, what))
  bad = functools.reduce(jnp.logical_or, [jnp.any(everyone[:, t, k] > bound) for t, k, bound, _ in limits])

  def fail(everyone):
    values = np.asarray(everyone)
    for t, k, bound, what in limits:
      over = np.argwhere(values[:, t, k] > bound)
      if over.size:
        sender, o = (int(v) for v in over[0])
        kind = "ids" if k == 0 else "distinct ids"
        raise ValueError(
            f"TPUEmbedding: table {tables[t][0]!r}: replica {sender} sends {int(values[sender, t, k, o])} {kind} to "
            f"replica {o} in one step, more than its {what}={bound}. No id is dropped: the step fails. Raise "
            f"TableConfig({what}=...) or spread the ids (check batches on the host with TPUEmbedding.check_ids).")
    return np.zeros((), np.int32)

  zero = jax.ShapeDtypeStruct((), jnp.int32)
  return lax.cond(bad, lambda: jax.pure_callback(fail, zero, everyone), lambda: jnp.zeros((), jnp.int32))
