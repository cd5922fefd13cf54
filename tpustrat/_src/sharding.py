"""Placing state split over the replicas: `strategy.experimental_shard` and its partitioners.

TF shards variables with a partitioner (`tf.distribute.experimental.partitioners`) given to
`ParameterServerStrategy`; a `ShardedVariable` then holds one block per parameter server. tpustrat splits a
leaf over the replicas of the strategy instead (ZeRO / FSDP): each replica keeps one block of the
parameter and, since optax's state is made from the parameters inside `run`, of the optimizer state too.

`experimental_shard(tree, partitioner)` asks the partitioner for each leaf: an axis to split along, or
None to keep the leaf `Mirrored` (small leaves are not worth a collective). The default is
`MinSizePartitioner()`: leaves of at least 256 KiB, along axis 0.

`experimental_shard(tree, layout_map=...)` (a `logical.LayoutMap`) splits the leaves it matches over the
logical cores of each replica instead (tensor parallelism): they stay `Mirrored` (the same on every
replica), each a global array whose sharding is replicated over ``'replica'`` and split over the core
axes. `run` passes such arrays as they are (`engine._same_over_replicas`), and with
`RunOptions(experimental_layout_map=...)` constrains the results the map matches to the same layout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import logical
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.validation import check_int, normalize_axis, tree_path
from tpustrat._src.values import LocalShard, Mirrored, PerReplica, ShardedVariable, block_size, is_distributed

__all__ = ["MinSizePartitioner", "clip_by_global_norm", "global_norm", "place_blocks", "shard"]


@dataclasses.dataclass(frozen=True)
class MinSizePartitioner:
  """Splits a leaf along `axis` over every replica when it holds at least `min_shard_bytes` bytes; smaller
  leaves (and scalars) stay `Mirrored` (TF's `MinSizePartitioner`, along axis 0 like TF's).

  TF's `max_shards` limits how many parameter servers a variable spans; here a leaf spans every replica or
  none, so `max_shards` is accepted only as None or at least the number of replicas.

  >>> p = MinSizePartitioner(min_shard_bytes=1024)
  >>> p(("w",), (512, 4), np.dtype("float32")), p(("b",), (4,), np.dtype("float32"))
  (0, None)
  """

  min_shard_bytes: int = 256 << 10
  max_shards: int | None = None
  axis: int = 0

  def __post_init__(self) -> None:
    check_int(self.min_shard_bytes, "MinSizePartitioner", "min_shard_bytes", minimum=0)
    check_int(self.max_shards, "MinSizePartitioner", "max_shards", minimum=1, allow_none=True)
    check_int(self.axis, "MinSizePartitioner", "axis")

  def __call__(self, path: tuple[Any, ...], shape: tuple[int, ...], dtype: Any) -> int | None:
    del path
    if not shape:
      return None
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return self.axis if size >= self.min_shard_bytes else None


Partitioner = Callable[[tuple[Any, ...], tuple[int, ...], Any], Any]


def shard(strategy: Any, tree: Any, partitioner: Partitioner | None = None,
          layout_map: logical.LayoutMap | None = None) -> Any:
  """`Strategy.experimental_shard`: `tree` with the leaves `partitioner` splits as `ShardedVariable`s, the
  leaves `layout_map` matches `Mirrored` and split over each replica's logical cores, and the others
  `Mirrored` (as `experimental_mirror` gives them)."""
  mesh = strategy.mesh
  if mesh is None:
    raise ValueError("experimental_shard needs a strategy with a mesh (TPUStrategy, MirroredStrategy): the "
                     "default strategy has one replica and nothing to split over.")
  layouts = _layouts(strategy, tree, layout_map) if layout_map is not None else {}
  explicit = partitioner is not None  # the default partitioner is not asked about leaves the map lays out
  partitioner = MinSizePartitioner() if partitioner is None else partitioner
  if not callable(partitioner):
    raise TypeError(f"experimental_shard: partitioner must be callable (path, shape, dtype) -> axis or None, "
                    f"got {partitioner!r:.100}.")
  n = strategy.num_replicas_in_sync
  if isinstance(partitioner, MinSizePartitioner) and partitioner.max_shards is not None and (
      partitioner.max_shards < n):
    raise ValueError(
        f"experimental_shard: MinSizePartitioner(max_shards={partitioner.max_shards}) would split leaves "
        f"over fewer than the {n} replicas; tpustrat splits a leaf over every replica or keeps it whole.")
  split = NamedSharding(mesh, P(REPLICA_AXIS))
  replicated = NamedSharding(mesh, P())

  def one(path: tuple[Any, ...], x: Any) -> Any:
    where = tree_path(path) or "<root>"
    if isinstance(x, ShardedVariable):
      if x.num_replicas == n and x.tree.sharding == split:
        return x
      return ShardedVariable.from_blocks(place_blocks(np.asarray(x), x.axis, n, split), x.shape, x.axis)
    if isinstance(x, PerReplica):
      raise ValueError(f"experimental_shard: the value at {where} is a PerReplica (one value per replica); "
                       "only values that are the same on every replica can be split over them.")
    if isinstance(x, Mirrored):
      x = x.tree
    value = np.asarray(jax.device_get(x))
    if where in layouts and not explicit:
      axis = None
    else:
      axis = partitioner(tuple(path), tuple(value.shape), value.dtype)
    if where in layouts:
      if axis is not None:
        raise ValueError(
            f"experimental_shard: the leaf at {where} is split over the replicas by the partitioner (axis "
            f"{axis!r}) and laid out on the logical cores by the LayoutMap pattern {layouts[where][0]!r}: a "
            "leaf may have one of the two. Have the partitioner return None for it, or drop it from the map.")
      return Mirrored.from_global(jax.device_put(value, NamedSharding(mesh, layouts[where][1])))
    if axis is None:
      return Mirrored.from_global(jax.device_put(value, replicated))
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
      raise TypeError(f"experimental_shard: the partitioner returned {axis!r} for the leaf at {where}; "
                      "expected an axis (int) or None.")
    if value.ndim == 0:
      raise ValueError(f"experimental_shard: the partitioner split the scalar at {where}; a scalar has no axis "
                       "to split along (return None to keep it Mirrored).")
    axis = normalize_axis(int(axis), value.ndim, f"experimental_shard (the leaf at {where})")
    if value.shape[axis] == 0:
      raise ValueError(f"experimental_shard: the leaf at {where} has size 0 along axis {axis} {value.shape}: "
                       "there is nothing to split (return None to keep it Mirrored).")
    return ShardedVariable.from_blocks(place_blocks(value, axis, n, split), value.shape, axis)

  def leaves_of(x: Any) -> Any:  # a Mirrored of a pytree (a restored state, say): its leaves, each Mirrored
    if isinstance(x, Mirrored) and jax.tree.structure(x.tree).num_nodes != 1:
      return jax.tree.map(Mirrored.from_global, x.tree)
    return x

  tree = jax.tree.map(leaves_of, tree, is_leaf=is_distributed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: one(path, x), tree, is_leaf=lambda x: is_distributed(x))


def _layouts(strategy: Any, tree: Any, layout_map: Any) -> dict[str, tuple[str, P]]:
  """For each leaf of `tree` that `layout_map` matches, by path: (its pattern, its sharding's spec, split
  over the core axes and replicated over ``'replica'``). Everything is checked before anything is placed:
  a pattern that matches no leaf, a leaf two patterns match, a layout that does not fit its leaf, a
  `ShardedVariable` or `PerReplica` matched."""
  where_ = "experimental_shard"
  logical.check_layout_map(strategy, layout_map, where_)
  found: dict[str, tuple[str, P]] = {}
  for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)[0]:
    where = tree_path(path) or "<root>"
    hit = layout_map.match(where, where_)
    if hit is None:
      continue
    if isinstance(x, (ShardedVariable, PerReplica)):
      raise ValueError(
          f"experimental_shard: the leaf at {where} is a {type(x).__name__} and matches the LayoutMap pattern "
          f"{hit[0]!r}; only values that are the same on every replica (arrays, Mirrored) can be laid out on "
          "the logical cores" + (" (a ShardedVariable is already split over the replicas)."
                                 if isinstance(x, ShardedVariable) else "."))
    shape = np.shape(x.tree if isinstance(x, Mirrored) else x)
    found[where] = (hit[0], logical.layout_spec(strategy, where, hit[0], hit[1], shape, where_))
  used = {pattern for pattern, _ in found.values()}
  unused = [p for p in layout_map if p not in used]
  if unused:
    paths = [tree_path(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)[0]]
    shown = ", ".join(paths[:8]) + (f", ... ({len(paths)} leaves)" if len(paths) > 8 else "")
    raise ValueError(
        f"experimental_shard: the LayoutMap pattern{'s' if len(unused) > 1 else ''} "
        f"{', '.join(repr(p) for p in unused)} match{'' if len(unused) > 1 else 'es'} no leaf of the tree "
        f"(leaves: {shown}); a pattern that matches nothing would leave its leaves replicated. Patterns are "
        "searched (re.search) in paths written like ['dense1']['kernel'].")
  return found


def place_blocks(value: np.ndarray, axis: int, n: int, split: NamedSharding) -> jax.Array:
  """`value` as `n` blocks along `axis` (zero-padded to ``n * ceil(d / n)``), stacked ``[n, ...block]``
  and split over the replicas; each process builds only its own blocks."""
  b = block_size(value.shape[axis], n)
  pad = [(0, 0)] * value.ndim
  pad[axis] = (0, n * b - value.shape[axis])
  padded = np.pad(value, pad)
  block_shape = list(value.shape)
  block_shape[axis] = b

  def blocks(index: tuple[slice, ...] | None) -> np.ndarray:
    assert index is not None  # JAX's type allows None, but it never passes None (it asserts so itself)
    rows = range(n)[index[0]]
    return np.stack([np.take(padded, np.arange(r * b, (r + 1) * b), axis=axis) for r in rows])

  return jax.make_array_from_callback((n, *block_shape), split, blocks)


def global_norm(tree: Any) -> jax.Array:
  """The L2 norm of a whole pytree whose sharded leaves are blocks (`LocalShard`, inside `strategy.run`):
  the blocks' squares are summed over the replicas (without their padding rows, whatever they hold), the other leaves' counted once.
  Outside `run`, or without blocks, it is `optax.tree.norm`.

  >>> float(global_norm({"a": np.array([3.0]), "b": np.array([4.0])}))
  5.0
  """
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LocalShard))
  blocks = [x.real_block() for x in leaves if isinstance(x, LocalShard)]  # padding counts for nothing
  whole = [x for x in leaves if not isinstance(x, LocalShard)]
  total = sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in whole), jnp.float32(0))
  if blocks:
    local = sum(jnp.sum(jnp.square(b.astype(jnp.float32))) for b in blocks)
    total = total + jax.lax.psum(local, REPLICA_AXIS)
  return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` for updates with sharded leaves: scales every leaf (blocks included) by
  ``min(1, max_norm / global_norm(updates))``, the norm of the whole gradient (`global_norm`), so every
  replica clips its block by the same factor. `optax.clip_by_global_norm` itself would use each replica's
  own blocks' norm."""

  def init(params: Any) -> optax.EmptyState:
    del params
    return optax.EmptyState()

  def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    del params
    norm = global_norm(updates)
    scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
    return jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates), state

  return optax.GradientTransformation(init, update)
