"""Cross-replica `reduce`, `gather` and `experimental_local_results` (cross-replica context).

A `PerReplica` leaf is a global array with a leading replica axis, so reducing across replicas is a
reduction over axis 0 of that array, executed on the devices; only the result leaves them. Every leaf of
one call goes into one compiled program (one per set of devices the leaves lie on), compiled once per
structure and shapes: a tree of many leaves is one compilation and one dispatch, not one per leaf. With
`axis` set, the reduction also runs over that axis of each component, and
`MEAN` divides by the true number of elements (replicas x the size of that axis), as TF documents.

Padding rows of a padded batch are skipped where the value's rows are known to be the batch's (see
`tpustrat._src.values`): along every axis for a batch from the input pipeline or an output of `run`
marked with `tpustrat.per_example` (`reduce` masks the padding out of sums and divides `MEAN` by the
number of real elements, `gather` along the batch axis returns only the real rows, local results are
trimmed), and along axis 0 only for an unmarked output whose axis 0 the step's program shows to hold a
padded batch's rows (``reduce(op, v, axis=0)``, ``gather(v, axis=0)``, and local results trimmed to each
replica's real rows, as TF's replicas held only those). ``axis=None`` on an unmarked value never drops
data: it combines the components element by element, which TF cannot do with components of different
sizes, so nothing of TF's says which rows to leave out.

TF's rules for values that are not `PerReplica` are kept: a `Mirrored` value counts once per replica
(`SUM` of `Mirrored` ``v`` over ``n`` replicas is ``n * v``, `MEAN` is ``v``), and a plain array cannot be
`SUM`-reduced across replicas with ``axis=None`` (TF raises `ValueError`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import watchdog
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.sharded_variable import ShardedVariable
from tpustrat._src.validation import normalize_axis
from tpustrat._src.values import Mirrored, PerReplica, as_array, check_components, is_distributed

__all__ = ["reduce", "gather", "local_results"]


_CHUNK = 1 << 15  # int32 sums of this many 16-bit halves cannot overflow


def _wide_sum(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
  """The sum of integer `x` over `axes` as float32, without the wrap-around of an int32 sum.

  Without ``jax_enable_x64`` there is no 64-bit integer to sum in, so each value is split into 16-bit
  halves; the halves are summed exactly in int32, in chunks of `_CHUNK` values, and only the chunk sums
  are added in float32 (the result is float32 anyway: one rounding per chunk, not a wrapped sum).
  """
  x = jnp.moveaxis(x, axes, tuple(range(len(axes))))
  m = int(np.prod(x.shape[:len(axes)], dtype=np.int64))
  x = x.reshape((m,) + x.shape[len(axes):])
  chunks = -(-m // _CHUNK) if m else 1
  if chunks * _CHUNK != m and chunks > 1:
    x = jnp.concatenate([x, jnp.zeros((chunks * _CHUNK - m,) + x.shape[1:], x.dtype)])
  x = x.reshape((chunks, -1) + x.shape[1:])
  if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
    x = x.astype(jnp.uint32)
    lo, hi = (x & 0xFFFF).astype(jnp.int32), (x >> 16).astype(jnp.int32)
  else:
    x = x.astype(jnp.int32)
    lo, hi = x & 0xFFFF, x >> 16  # hi: arithmetic shift, so hi * 65536 + lo == x
  lo, hi = jnp.sum(lo, axis=1), jnp.sum(hi, axis=1)
  return jnp.sum(hi.astype(jnp.float32), axis=0) * 65536.0 + jnp.sum(lo.astype(jnp.float32), axis=0)


def _narrow_int(x: jax.Array) -> bool:
  """Whether `x` is an integer type of at most 32 bits (summed with `_wide_sum` for MEAN)."""
  return jnp.issubdtype(x.dtype, jnp.integer) and jnp.dtype(x.dtype).itemsize <= 4


def _reduce_leaf(x: jax.Array, *, op: ReduceOp, axis: int | None, stacked: bool, copies: int) -> jax.Array:
  """Reduces one leaf. `stacked`: x has a leading replica axis; else x is one value held `copies` times."""
  wide = op is ReduceOp.MEAN and _narrow_int(x)  # a MEAN of ints: summed without wrapping around
  if stacked:
    axes = (0,) if axis is None else (0, axis + 1)
    total = _wide_sum(x, axes) if wide else jnp.sum(x, axis=axes)
    count = x.shape[0] * (1 if axis is None else x.shape[axis + 1])
  else:
    total = x if axis is None else (_wide_sum(x, (axis,)) if wide else jnp.sum(x, axis=axis))
    count = 1 if axis is None else x.shape[axis]
    if op is ReduceOp.MEAN:  # the same value `copies` times: its mean is its own
      return total / count if jnp.issubdtype(total.dtype, jnp.inexact) else total / jnp.float32(count)
    total = total * copies
    count *= copies
  if op is ReduceOp.SUM:
    return total
  return total / count if jnp.issubdtype(total.dtype, jnp.inexact) else total / jnp.float32(count)


def _reduce_padded_leaf(x: jax.Array, valid: jax.Array, *, op: ReduceOp, axis: int | None) -> jax.Array:
  """Reduces a stacked leaf ``[n, k, ...]`` whose component ``r`` has ``valid[r]`` real rows of ``k``.

  Padding rows count for nothing: `SUM` leaves them out and `MEAN` divides every output element by the
  number of real input elements that reach it (0/0 gives NaN where no replica has a real row).
  """
  n, k = x.shape[:2]
  mask = (jnp.arange(k)[None, :] < jnp.asarray(valid).astype(jnp.int32)[:, None])
  mask = mask.reshape((n, k) + (1,) * (x.ndim - 2))
  axes = (0,) if axis is None else (0, axis + 1)
  kept = jnp.where(mask, x, jnp.zeros((), x.dtype))
  if op is ReduceOp.SUM:
    return jnp.sum(kept, axis=axes)
  total = _wide_sum(kept, axes) if _narrow_int(x) else jnp.sum(kept, axis=axes)  # no int32 wrap-around
  count = jnp.sum(jnp.broadcast_to(mask, x.shape), axis=axes)
  if not jnp.issubdtype(total.dtype, jnp.inexact):
    total = total.astype(jnp.float32)
  return total / count.astype(total.dtype)


def _take_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
  """Rows `rows` of the stacked leaf ``[n, k, ...]`` seen as one ``[n * k, ...]`` batch."""
  return jnp.take(x.reshape((-1,) + x.shape[2:]), rows, axis=0)


def _gather_leaf(x: jax.Array, *, axis: int, copies: int) -> jax.Array:
  if copies:  # one value held by every replica: concatenate `copies` of it
    return jnp.concatenate([x] * copies, axis=axis)
  moved = jnp.moveaxis(x, 0, axis)  # [..., n, d_axis, ...]
  shape = moved.shape[:axis] + (moved.shape[axis] * moved.shape[axis + 1],) + moved.shape[axis + 2:]
  return moved.reshape(shape)


# One leaf's work in the program `_leaves_program` compiles: (kind, static arguments). Every leaf of one
# `reduce` or `gather` call goes into one program, so a call compiles once per structure and shapes, not
# once per leaf (a tree of many leaves was as many compilations and dispatches).
_KINDS: dict[str, Callable[..., jax.Array]] = {
    "reduce": _reduce_leaf, "reduce_padded": _reduce_padded_leaf, "take_rows": _take_rows, "gather": _gather_leaf}


@functools.partial(jax.jit, static_argnames=("specs",))
def _leaves_program(leaves: tuple[jax.Array, ...], extras: tuple[Any, ...], *,
                    specs: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]) -> tuple[jax.Array, ...]:
  """Every leaf's reduction or gather (`specs[i]` for ``leaves[i]``, with ``extras[i]``: the real-row
  counts or the rows to take, or None) in one compiled program."""
  return tuple(_KINDS[kind](x, **dict(kwargs)) if extra is None else _KINDS[kind](x, extra, **dict(kwargs))
               for x, extra, (kind, kwargs) in zip(leaves, extras, specs))


class _Leaves:
  """The leaves of one `reduce` or `gather` call, checked and collected before anything is compiled."""

  def __init__(self) -> None:
    self.leaves: list[jax.Array] = []
    self.extras: list[Any] = []
    self.specs: list[tuple[str, tuple[tuple[str, Any], ...]]] = []

  def add(self, x: jax.Array, kind: str, extra: Any = None, **kwargs: Any) -> int:
    self.leaves.append(x)
    self.extras.append(extra)
    self.specs.append((kind, tuple(sorted(kwargs.items()))))
    return len(self.leaves) - 1

  def run(self, mesh: jax.sharding.Mesh | None) -> list[jax.Array]:
    """The results, in the order added: one program per set of devices the leaves are committed to (one
    for the values of one strategy; leaves not committed anywhere join the first), placed on every device
    of `mesh`."""
    groups: dict[Any, list[int]] = {}
    loose = []
    for i, x in enumerate(self.leaves):
      if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or not x.committed:
        loose.append(i)
      else:
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    if not groups:
      groups[None] = []
    groups[next(iter(groups))] += loose
    results: list[Any] = [None] * len(self.leaves)
    for indices in groups.values():
      indices.sort()
      outs = _leaves_program(tuple(self.leaves[i] for i in indices), tuple(self.extras[i] for i in indices),
                             specs=tuple(self.specs[i] for i in indices))
      for i, out in zip(indices, outs):
        results[i] = out
    if not results or isinstance(results[0], jax.core.Tracer):  # inside the user's own jit: nothing to place
      return results
    watchdog.note(results[-1], steps=0)  # a cross-replica reduction waits for every replica, like a step
    if mesh is None:
      return results
    return jax.device_put(results, NamedSharding(mesh, P()))


def _refuse_sharded(node: Any, what: str) -> None:
  if isinstance(node, ShardedVariable):
    raise ValueError(
        f"strategy.{what}: {node!r} is one value split over the replicas, not one value per replica: there "
        f"is nothing to {what} across them. np.asarray(v) gives the whole value, "
        "strategy.experimental_local_results(v) its blocks.")


def _map_leaves(value: Any, one: Callable[[Any, Any, PerReplica | None, bool], int], leaves: _Leaves,
                mesh: jax.sharding.Mesh | None) -> Any:
  """`value` with each leaf replaced by its result: `one(leaf, stacked, per_replica, plain)` adds it to
  `leaves` (checking it first); then one program computes them all."""

  def node_slots(node: Any) -> Any:
    if isinstance(node, PerReplica):
      return jax.tree.map(lambda x: one(x, True, node, False), node.tree)
    if isinstance(node, Mirrored):
      return jax.tree.map(lambda x: one(x, False, None, False), node.tree)
    return one(node, False, None, True)

  structure = jax.tree.map(node_slots, value, is_leaf=is_distributed)
  slots = jax.tree.leaves(structure)
  results = leaves.run(mesh)
  return jax.tree.unflatten(jax.tree.structure(structure), [results[i] for i in slots])


def reduce(reduce_op: ReduceOp | str, value: Any, axis: int | None, *, num_replicas: int,
           mesh: jax.sharding.Mesh | None) -> Any:
  """Host-side `Strategy.reduce` over every distributed (or plain) leaf of `value`, in one program."""
  op = ReduceOp.from_value(reduce_op)
  leaves = _Leaves()

  def one(x: Any, stacked: bool, per_replica: PerReplica | None, plain: bool) -> int:
    if plain:
      _refuse_sharded(x, "reduce")
    x = as_array(x)
    if stacked:
      check_components(x, num_replicas, "strategy.reduce: a PerReplica value")
    rank = x.ndim - 1 if stacked else x.ndim
    ax = None if axis is None else normalize_axis(axis, rank, "strategy.reduce")
    valid = None if per_replica is None else per_replica.real_rows(ax)
    if valid is not None:
      return leaves.add(x, "reduce_padded", valid, op=op, axis=ax)
    if plain and op is ReduceOp.SUM and ax is None and num_replicas > 1:
      raise ValueError(
          f"A non-distributed value (shape {x.shape}) cannot be reduced with reduce op SUM across "
          f"{num_replicas} replicas: it is not known how many replicas hold it. Pass a PerReplica or "
          "Mirrored value (as returned by strategy.run), or use MEAN.")
    return leaves.add(x, "reduce", op=op, axis=ax, stacked=stacked, copies=num_replicas)

  return _map_leaves(value, one, leaves, mesh)


def gather(value: Any, axis: int, *, num_replicas: int, mesh: jax.sharding.Mesh | None) -> Any:
  """Host-side `Strategy.gather`: concatenates every replica's component along `axis`, in one program."""
  leaves = _Leaves()

  def one(x: Any, stacked: bool, padded: PerReplica | None, plain: bool) -> int:
    if plain:
      _refuse_sharded(x, "gather")
    x = as_array(x)
    if stacked:
      check_components(x, num_replicas, "strategy.gather: a PerReplica value")
    rank = x.ndim - 1 if stacked else x.ndim
    if rank == 0:
      raise ValueError(
          "gather needs components of rank >= 1 to concatenate along `axis`, got scalars. "
          "Return values with a batch dimension from strategy.run, or reshape them to [1].")
    ax = normalize_axis(axis, rank, "strategy.gather")
    if padded is not None and padded.real_rows(ax) is not None:
      counts = padded.host_real_rows()
      k = x.shape[1]
      if (counts != k).any():
        if ax != 0:
          raise ValueError(
              f"gather along axis {axis} of a padded batch whose replicas hold different numbers of real "
              f"rows ({counts.tolist()} of {k}): the components cannot be concatenated along a non-batch "
              "axis. Gather along axis 0, or drop the partial batch (InputOptions(drop_remainder=True)).")
        rows = np.concatenate([r * k + np.arange(c) for r, c in enumerate(counts)]).astype(np.int32)
        return leaves.add(x, "take_rows", rows)
    return leaves.add(x, "gather", axis=ax, copies=0 if stacked else num_replicas)

  return _map_leaves(value, one, leaves, mesh)


def local_results(value: Any) -> tuple[Any, ...]:
  """`experimental_local_results`: the tuple of this process's per-replica components of `value`.

  A single distributed value gives its components; a pytree holding distributed values gives one pytree
  per replica (each distributed value replaced by that replica's component); anything else gives
  ``(value,)``. A component whose axis 0 holds a padded batch's rows holds only its replica's real rows
  (`PerReplica.values`).
  """
  if is_distributed(value):
    return value.values
  nodes, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
  if not any(is_distributed(n) for n in nodes):
    return (value,)
  components = [n.values if is_distributed(n) else None for n in nodes]
  count = max(len(c) for c in components if c is not None)  # a value held once serves every replica
  return tuple(
      jax.tree.unflatten(treedef, [n if not c else c[r] if len(c) > 1 else c[0]
                                   for n, c in zip(nodes, components)])
      for r in range(count))
