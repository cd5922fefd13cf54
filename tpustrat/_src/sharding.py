"""Placing state split over the replicas: `strategy.experimental_shard` and its partitioners.

TF shards variables with a partitioner (`tf.distribute.experimental.partitioners`) given to
`ParameterServerStrategy`; a `ShardedVariable` then holds one block per parameter server. tpustrat splits a
leaf over the replicas of the strategy instead (ZeRO / FSDP): each replica keeps one block of the
parameter and, since optax's state is made from the parameters inside `run`, of the optimizer state too.

`experimental_shard(tree, partitioner)` asks the partitioner for each leaf: an axis to split along, or
None to keep the leaf `Mirrored` (small leaves are not worth a collective). The default is
`MinSizePartitioner()`: leaves of at least 256 KiB, along axis 0.

`experimental_shard(tree, partitioner, groups=...)` is hybrid sharding (PyTorch FSDP's ``HYBRID_SHARD``,
MaxText's DCN data parallelism x ICI FSDP): each leaf is split within each group of replicas (a process,
a TPU slice, or explicit lists: `sharding_groups`) and replicated across the groups, so the parameters
are gathered within a group and only ``1/S`` of each gradient (``S`` replicas per group) is all-reduced
across the groups. The blocks keep the ``[N, ...block]`` layout (`place_blocks`); a checkpoint saves one
group's ``S`` blocks (`canonical_blocks`), which restore as any ``S``-block value does.

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
from tpustrat._src.groups import normalize_group_assignment
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import Groups, LocalShard, ShardedVariable, block_size, group_position
from tpustrat._src.validation import check_int, normalize_axis, tree_path
from tpustrat._src.values import Mirrored, PerReplica, is_distributed

__all__ = ["MinSizePartitioner", "canonical_blocks", "clip_by_global_norm", "from_canonical_blocks", "global_norm",
           "place_blocks", "resolve_groups", "shard", "sharding_groups"]

GROUP_AXES = ("groups", "blocks")
"""The axes of the mesh a hybrid-sharded value's saved blocks lie on (`canonical_blocks`): one row of
devices per group, the blocks split along the second axis and replicated along the first."""


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


def _replica_devices(mesh: Any, where: str) -> list[Any]:
  """The device of each replica of a strategy's mesh; hybrid sharding is for one device per replica."""
  if mesh is None:
    raise ValueError(f"{where}: groups need a strategy with a mesh (TPUStrategy, MirroredStrategy): the default "
                     "strategy has one replica.")
  if mesh.devices.ndim != 1:
    raise ValueError(f"{where}: groups (hybrid sharding) are for strategies with one device per replica; this "
                     f"strategy's replicas have {mesh.devices.size // mesh.devices.shape[0]} logical cores each.")
  return list(mesh.devices.reshape(-1))


def _by_attribute(devices: list[Any], attribute: str, where: str, spec: str) -> list[list[int]]:
  """Replica ids grouped by a device attribute (``process_index``, ``slice_index``), groups in the
  attribute's order, each in replica order; unequal groups are an error naming the counts."""
  found: dict[int, list[int]] = {}
  for r, d in enumerate(devices):
    found.setdefault(int(getattr(d, attribute)), []).append(r)
  groups = [found[k] for k in sorted(found)]
  if len({len(g) for g in groups}) > 1:
    counts = {k: len(found[k]) for k in sorted(found)}
    raise ValueError(
        f"{where}: groups={spec!r} makes groups of unequal sizes (replicas per {attribute}: {counts}); hybrid "
        "sharding splits each value into the same number of blocks in every group. Name the groups "
        "explicitly (lists of replica ids of equal length).")
  return groups


def resolve_groups(mesh: Any, groups: Any, where: str) -> Groups | None:
  """The replica groups `groups` names on a strategy's `mesh`, checked, as a tuple of tuples of replica ids
  (each group in block order); None for one group of every replica (plain sharding over all of them).

  `groups`: None (every replica), ``"process"`` (one group per process: a host), ``"slice"`` (one group per
  TPU slice, `jax.Device.slice_index`), or a sequence of sequences of replica ids. Errors (`ValueError`)
  name the value and what was expected: unequal groups, a replica in two groups or in none, an id out of
  range, a group size that does not divide the replicas, devices without a ``slice_index``.
  """
  if groups is None:
    return None
  n = None if mesh is None else int(mesh.shape[REPLICA_AXIS])
  if isinstance(groups, str):
    devices = _replica_devices(mesh, where)
    if groups == "process":
      found = _by_attribute(devices, "process_index", where, groups)
    elif groups == "slice":
      lacking = [d for d in devices if getattr(d, "slice_index", None) is None]
      if lacking:
        raise ValueError(
            f"{where}: groups='slice' needs each device's slice_index, which JAX sets on TPU jobs of several "
            f"slices (multi-slice); the device {lacking[0]} has none. Use groups='process' (one group per "
            "host), or name the groups as lists of replica ids.")
      found = _by_attribute(devices, "slice_index", where, groups)
    else:
      raise ValueError(f"{where}: groups={groups!r} is not a kind of group: expected 'process', 'slice', a list of "
                       "lists of replica ids, or None.")
  else:
    _replica_devices(mesh, where)
    if isinstance(groups, (bytes, dict)) or not hasattr(groups, "__iter__"):
      raise TypeError(f"{where}: groups={groups!r:.100} must be 'process', 'slice', a list of lists of replica ids, "
                      "or None.")
    found = [list(g) if hasattr(g, "__iter__") and not isinstance(g, (str, bytes)) else g for g in groups]
    if not found or any(not isinstance(g, list) for g in found):
      raise ValueError(f"{where}: groups={groups!r:.200} must be a non-empty list of lists of replica ids, such "
                       "as [[0, 1, 2, 3], [4, 5, 6, 7]].")
    sizes = {len(g) for g in found}
    assert n is not None
    if len(sizes) == 1 and sizes != {0} and n % len(found[0]) and len(found) * len(found[0]) != n:
      raise ValueError(f"{where}: groups={groups!r:.200} has groups of {len(found[0])} replicas, which do not "
                       f"divide the {n} replicas (num_replicas_in_sync) into groups of equal size.")
    try:
      normalize_group_assignment(found, n, where)
    except (ValueError, TypeError) as e:
      raise type(e)(str(e).replace("group_assignment=", "groups=")) from None
  resolved = tuple(tuple(int(r) for r in g) for g in found)
  return None if len(resolved) == 1 else resolved


def sharding_groups(strategy: Any, groups: Any) -> Groups | None:
  """The groups of replica ids that ``groups=`` names on `strategy` (hybrid sharding), as
  `experimental_shard` and `sharded_optimizer` resolve them: ``"process"`` (one group per process),
  ``"slice"`` (per TPU slice), explicit lists (checked), or None; None also where one group holds every
  replica (that is plain sharding).

  >>> sharding_groups(tpustrat.TPUStrategy(), [[0, 1, 2, 3], [4, 5, 6, 7]])
  ((0, 1, 2, 3), (4, 5, 6, 7))
  >>> sharding_groups(tpustrat.TPUStrategy(), "process") is None   # one process: one group
  True
  """
  return resolve_groups(strategy.mesh, groups, "sharding_groups")


def shard(strategy: Any, tree: Any, partitioner: Partitioner | None = None,
          layout_map: logical.LayoutMap | None = None, groups: Any = None) -> Any:
  """`Strategy.experimental_shard`: `tree` with the leaves `partitioner` splits as `ShardedVariable`s, the
  leaves `layout_map` matches `Mirrored` and split over each replica's logical cores, and the others
  `Mirrored` (as `experimental_mirror` gives them). With `groups` (see `resolve_groups`) the leaves are
  split within each group and replicated across the groups (hybrid sharding)."""
  mesh = strategy.mesh
  if mesh is None:
    raise ValueError("experimental_shard needs a strategy with a mesh (TPUStrategy, MirroredStrategy): the "
                     "default strategy has one replica and nothing to split over.")
  hybrid = resolve_groups(mesh, groups, "experimental_shard")
  if hybrid is not None and layout_map is not None:
    raise ValueError("experimental_shard: groups (hybrid sharding over the replicas) and layout_map (tensor "
                     "parallelism over logical cores) do not combine; give one of them.")
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
      if x.num_replicas == n and x.tree.sharding == split and x.groups == hybrid:
        return x
      return ShardedVariable.from_blocks(place_blocks(np.asarray(x), x.axis, n, split, hybrid), x.shape, x.axis,
                                         hybrid)
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
    return ShardedVariable.from_blocks(place_blocks(value, axis, n, split, hybrid), value.shape, axis, hybrid)

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


def place_blocks(value: np.ndarray, axis: int, n: int, split: NamedSharding, groups: Groups | None = None) -> jax.Array:
  """`value` as `n` blocks along `axis` (zero-padded to ``n * ceil(d / n)``), stacked ``[n, ...block]``
  and split over the replicas; each process builds only its own blocks. With `groups` (hybrid), as ``S =
  len(groups[0])`` blocks, replica ``r`` holding the block of its position in its group (`n` rows still)."""
  s = n if groups is None else len(groups[0])
  block_of = range(n) if groups is None else group_position(groups)
  b = block_size(value.shape[axis], s)
  pad = [(0, 0)] * value.ndim
  pad[axis] = (0, s * b - value.shape[axis])
  padded = np.pad(value, pad)
  block_shape = list(value.shape)
  block_shape[axis] = b

  def blocks(index: tuple[slice, ...] | None) -> np.ndarray:
    assert index is not None  # JAX's type allows None, but it never passes None (it asserts so itself)
    rows = range(n)[index[0]]
    return np.stack([np.take(padded, np.arange(block_of[r] * b, (block_of[r] + 1) * b), axis=axis) for r in rows])

  return jax.make_array_from_callback((n, *block_shape), split, blocks)


def group_mesh(mesh: Any, groups: Groups) -> jax.sharding.Mesh:
  """The strategy's devices as a ``[G, S]`` mesh over `GROUP_AXES`: row ``g`` is group ``g``'s devices in
  block order."""
  devices = mesh.devices.reshape(-1)
  return jax.sharding.Mesh(np.array([[devices[r] for r in g] for g in groups]), GROUP_AXES)


def canonical_blocks(v: ShardedVariable) -> jax.Array:
  """The ``S`` distinct blocks of a hybrid-sharded value as ``[S, ...block]`` (what a checkpoint saves: the
  layout of a value split over ``S`` replicas), on the group mesh (`group_mesh`): split along its blocks
  axis, replicated across the groups. The same buffers as `v`'s: nothing is copied."""
  assert v.groups is not None
  x = v.tree
  mesh = group_mesh(x.sharding.mesh, v.groups)
  target = NamedSharding(mesh, P(GROUP_AXES[1]))
  return jax.make_array_from_single_device_arrays((len(v.groups[0]), *x.shape[1:]), target,
                                                  [s.data for s in x.addressable_shards])


def from_canonical_blocks(blocks: jax.Array, shape: tuple[int, ...], axis: int, groups: Groups,
                          split: NamedSharding) -> ShardedVariable:
  """The hybrid-sharded value over `blocks` (``[S, ...block]`` on the group mesh, as `canonical_blocks`
  makes it) in the ``[N, ...block]`` layout of `split` (the strategy's per-replica sharding): the same
  buffers, each device's block is its own."""
  n = sum(len(g) for g in groups)
  mine = {s.device: s.data for s in blocks.addressable_shards}
  devices = split.mesh.devices.reshape(-1)
  arrays = [mine[devices[r]] for r in range(n) if devices[r] in mine]
  return ShardedVariable.from_blocks(
      jax.make_array_from_single_device_arrays((n, *blocks.shape[1:]), split, arrays), shape, axis, groups)


def global_norm(tree: Any) -> jax.Array:
  """The L2 norm of a whole pytree whose sharded leaves are blocks (`LocalShard`, inside `strategy.run`):
  the blocks' squares are summed over the replicas (without their padding rows, whatever they hold), the other leaves' counted once.
  Outside `run`, or without blocks, it is `optax.tree.norm`.

  >>> float(global_norm({"a": np.array([3.0]), "b": np.array([4.0])}))
  5.0
  """
  leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, LocalShard))
  # padding counts for nothing; a hybrid block is held once per group: each copy counts 1/G
  blocks = [(x.real_block(), 1 if x.groups is None else len(x.groups)) for x in leaves if isinstance(x, LocalShard)]
  whole = [x for x in leaves if not isinstance(x, LocalShard)]
  total = sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in whole), jnp.float32(0))
  if blocks:
    local = sum(jnp.sum(jnp.square(b.astype(jnp.float32))) / copies for b, copies in blocks)
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
