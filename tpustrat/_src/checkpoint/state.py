"""The state pytree of a checkpoint: what `CheckpointManager.save` writes for the distributed values, and
how `CheckpointManager.restore` reads them back onto a strategy's shardings (`RestorePlan`).

Saving unwraps (`unwrap`): a `Mirrored` or `PerReplica` value becomes the global arrays it holds, a
`ShardedVariable` (an embedding table among them) its ``[N, ...block]`` blocks and its logical shape.
Restoring plans (`RestorePlan`) each value of the target: read onto the target's own sharding where the
layout is the saved one, else read into host memory and re-laid out (another replica count, sharded <->
whole). The shapes are checked against the saved ones, with messages naming the value (`check_shapes`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src.checkpoint.handlers import api
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import ShardedVariable, block_size
from tpustrat._src.sharding import (
  GROUP_AXES,
  canonical_blocks,
  from_canonical_blocks,
  group_mesh,
  place_blocks,
)
from tpustrat._src.values import Mirrored, PerReplica, is_distributed

__all__ = ["RestorePlan", "check_alive", "check_shapes", "shardings", "unwrap"]


def _check_saveable(v: Any, where: str) -> None:
  if isinstance(v, PerReplica) and v.padding_is_marked:
    raise ValueError(
        f"CheckpointManager.{where}: the state holds a padded batch from the input pipeline ({v!r}); save "
        "the iterator's position (`iterator=`) instead of batches.")


def _is_node(v: Any) -> bool:
  return is_distributed(v)  # PerReplica, Mirrored and ShardedVariable (embedding tables included)


def unwrap(tree: Any) -> Any:
  """`tree` with every `Mirrored` / `PerReplica` replaced by the pytree of global arrays it holds, and every
  `ShardedVariable` (an embedding table among them) by ``{"blocks": [N, ...block] array, "shape": its
  logical shape}``; a hybrid-sharded one (split within groups of ``S`` replicas) by its ``S`` distinct
  blocks, as a value split over ``S`` replicas is saved (`canonical_blocks`: the same buffers)."""

  def one(v: Any) -> Any:
    if isinstance(v, ShardedVariable) and v.groups is not None:
      return {"blocks": canonical_blocks(v), "shape": np.asarray(v.shape, np.int32)}
    if isinstance(v, ShardedVariable):
      # [N, ...block]: re-split on restore when N differs; the logical shape, to check the target's against
      return {"blocks": v.tree, "shape": np.asarray(v.shape, np.int32)}
    if is_distributed(v):
      _check_saveable(v, "save")
      return v.tree
    return v

  return jax.tree.map(one, tree, is_leaf=_is_node)


def check_alive(tree: Any) -> None:
  """Raises unless every array of the (unwrapped) state still has its buffers: one donated to a step is
  deleted, and the state to save is the one that step returned."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
      raise RuntimeError(
          f"CheckpointManager.save: the array at {jax.tree_util.keystr(path) or '<root>'} of the state has been "
          "deleted: it was donated to a step (RunOptions(donate_argnums=...)) or deleted. Save the state that "
          "step returned.")


def _saved_at(saved: Any, path: tuple[Any, ...]) -> Any:
  """The node of the saved metadata tree at a target's key path (dict keys and sequence indices)."""
  node = saved
  for key in path:
    name = getattr(key, "key", getattr(key, "idx", getattr(key, "name", None)))
    try:
      node = node[name] if isinstance(node, dict) or not isinstance(name, str) else node[name]
    except (KeyError, IndexError, TypeError):
      return None
  return node


def _blocks_meta(node: Any) -> Any:
  """The metadata of the saved blocks when the saved node is a sharded value (``{"blocks": array, "shape":
  its logical shape}``; checkpoints written before the shape was saved have ``{"blocks": array}`` only)."""
  if isinstance(node, dict) and set(node) in ({"blocks"}, {"blocks", "shape"}) and hasattr(node["blocks"], "shape"):
    return node["blocks"]
  return None


def _with_shape(item: dict[str, Any], node: Any) -> dict[str, Any]:
  """`item` (a sharded value's restore item) with the saved logical shape read too, where it was saved."""
  if isinstance(node, dict) and "shape" in node and hasattr(node["shape"], "shape"):
    return {**item, "shape": _host_item(node["shape"])}
  return item


def _check_logical_shape(took: dict[str, Any], where: str, shape: tuple[int, ...]) -> None:
  """Raises unless the saved logical shape (where saved) is `shape`, the target's: blocks alone cannot tell
  a value of 15 rows from one of 16 on 8 replicas (both blocks of 2)."""
  if "shape" in took and tuple(int(d) for d in np.asarray(took["shape"])) != tuple(shape):
    raise ValueError(
        f"CheckpointManager.restore: the sharded value at {where} was saved with shape "
        f"{[int(d) for d in np.asarray(took['shape'])]}, but the target's is {list(shape)}: another shape.")


def _split_axis(blocks_shape: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
  """The axis along which ``[N, ...block]`` blocks (`blocks_shape`) are blocks of a value of `shape`, or
  None when they are not. Where several axes fit (size 1 along each), they all give the same value."""
  if len(blocks_shape) != len(shape) + 1 or not blocks_shape:
    return None
  n, block = blocks_shape[0], blocks_shape[1:]
  for axis in range(len(shape)):
    want = list(shape)
    want[axis] = block_size(shape[axis], n) if n else 0
    if list(block) == want:
      return axis
  return None


def _host_item(meta: Any) -> np.ndarray:
  """The restore item of a saved array read into host memory (orbax reads a numpy leaf as numpy): a
  zero-byte broadcast view of the saved shape and dtype."""
  return np.broadcast_to(np.zeros((), meta.dtype), tuple(meta.shape))


def _whole_from_blocks(blocks: np.ndarray, axis: int, size: int) -> np.ndarray:
  """The value of `size` rows along `axis` whose ``[N, ...block]`` blocks are `blocks` (padding stripped)."""
  full = np.concatenate(list(blocks), axis=axis) if blocks.shape[0] else blocks.reshape(blocks.shape[1:])
  return np.take(full, np.arange(size), axis=axis)


def _place_whole(value: np.ndarray, sharding: Any) -> jax.Array:
  """A host value as a global array of `sharding`: each device gets its own shard of it (the whole value
  only where the sharding replicates it), and each process builds only its own devices' shards."""
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


class RestorePlan:
  """How the target's values are restored: the restore item handed to orbax (`abstract`: the saved
  tree's structure, each array as a `jax.ShapeDtypeStruct` on the sharding it gets, or as a host numpy
  leaf where it is re-laid out) and how each restored piece becomes the target's value (`finish`).

  Every array orbax places on the devices carries the target's own sharding, so each device reads only
  its shard: a `ShardedVariable` (an embedding table too) restored onto as many replicas as saved, its block;
  a `Mirrored` or plain array, the whole value it holds anyway. A value that changes layout (sharded
  saved onto another replica count, sharded onto `Mirrored` or back) is read into host memory by every
  process, once, and placed from there: each device then receives only its block (`place_blocks`), or
  the whole value where the target replicates it. No device holds a whole copy of a sharded value.
  """

  def __init__(self, target: Any, saved: Any, strategy: Any) -> None:
    self._n = strategy.num_replicas_in_sync
    mesh, self._replicated, self._split = shardings(strategy)
    self._mesh = mesh
    flat, self._outer = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_node)
    self._slots: list[tuple[Any, Any]] = []  # per outer node: (its restore item, its finisher)
    for path, v in flat:
      self._slots.append(self._node(tuple(path), v, saved))
    self.abstract = self._outer.unflatten([item for item, _ in self._slots])

  def finish(self, restored: Any) -> Any:
    """The target's structure over the restored pieces (read back in the order of `abstract`'s leaves)."""
    leaves = iter(jax.tree.leaves(restored))

    def take(item: Any) -> Any:
      treedef = jax.tree.structure(item)
      return treedef.unflatten([next(leaves) for _ in range(treedef.num_leaves)])

    return self._outer.unflatten([finisher(take) for _, finisher in self._slots])

  # -- one node of the target -----------------------------------------------------------------------

  def _node(self, path: tuple[Any, ...], v: Any, saved: Any) -> tuple[Any, Any]:
    if isinstance(v, ShardedVariable):
      return self._sharded(path, v, _saved_at(saved, path))
    if isinstance(v, PerReplica):
      _check_saveable(v, "restore")
      item = jax.tree.map(lambda x: _leaf(x, self._split, self._mesh, self._replicated), v.tree)
      return item, lambda take: PerReplica.from_stacked(take(item))
    if isinstance(v, Mirrored):
      inner, treedef = jax.tree_util.tree_flatten_with_path(v.tree)
      slots = [self._whole(path + tuple(p), x, _saved_at(saved, path + tuple(p)), self._replicated)
               for p, x in inner]
      item = treedef.unflatten([s[0] for s in slots])
      return item, lambda take: Mirrored.from_global(treedef.unflatten([f(take) for _, f in slots]))
    return self._whole(path, v, _saved_at(saved, path), self._replicated)

  def _whole(self, path: tuple[Any, ...], x: Any, node: Any, sharding: Any) -> tuple[Any, Any]:
    """A leaf of a `Mirrored` value or a plain leaf: restored onto `sharding` (or its own, see `_leaf`);
    saved as a sharded value, its blocks are read on the host and joined."""
    item = _leaf(x, sharding, self._mesh, self._replicated)
    meta = _blocks_meta(node)
    if meta is None or not isinstance(item, jax.ShapeDtypeStruct):
      return item, lambda take: take(item)
    axis = _split_axis(tuple(meta.shape), item.shape)
    if axis is None:
      raise ValueError(
          f"CheckpointManager.restore: the value at {jax.tree_util.keystr(path)} was saved as a sharded value "
          f"of {meta.shape[0] if meta.shape else 0} blocks of shape {list(meta.shape[1:])}, which are not "
          f"blocks of the target's {list(item.shape)} along any axis: another shape.")
    host = _with_shape({"blocks": _host_item(meta)}, node)

    def finish(take: Any) -> Any:
      took = take(host)
      _check_logical_shape(took, jax.tree_util.keystr(path), tuple(item.shape))
      whole = _whole_from_blocks(np.asarray(took["blocks"]), axis, item.shape[axis])
      return _place_whole(whole.astype(item.dtype, copy=False), item.sharding)

    return host, finish

  def _sharded(self, path: tuple[Any, ...], v: ShardedVariable, node: Any) -> tuple[Any, Any]:
    where = jax.tree_util.keystr(path)
    meta = _blocks_meta(node)
    if meta is None:
      if node is not None and hasattr(node, "shape") and hasattr(node, "dtype"):  # saved whole (Mirrored)
        if tuple(node.shape) != tuple(v.shape):
          raise ValueError(
              f"CheckpointManager.restore: the value at {where} was saved whole with shape {list(node.shape)}, "
              f"but the target is a sharded variable of shape {list(v.shape)}.")
        whole = _host_item(node)
        return whole, lambda take: self._place_sharded(np.asarray(take(whole)), v)
      raise ValueError(f"CheckpointManager.restore: the checkpoint has no sharded variable blocks at {where} "
                       "(it was saved from another structure).")
    shape = tuple(meta.shape)
    want = list(v.shape)
    want[v.axis] = block_size(v.shape[v.axis], shape[0]) if shape and shape[0] else 0
    if len(shape) != len(v.shape) + 1 or list(shape[1:]) != want:
      saved_axis = _split_axis(shape, tuple(v.shape))
      if saved_axis is not None:  # split along another axis: the whole value on the host, re-split
        across = _with_shape({"blocks": _host_item(meta)}, node)

        def finish_across(take: Any) -> ShardedVariable:
          took = take(across)
          _check_logical_shape(took, where, v.shape)
          whole = _whole_from_blocks(np.asarray(took["blocks"]), saved_axis, v.shape[saved_axis])
          return self._place_sharded(whole, v)

        return across, finish_across
      raise ValueError(
          f"CheckpointManager.restore: the sharded variable at {where} was saved as "
          f"{shape[0] if shape else 0} blocks of shape {list(shape[1:])}, which are not blocks of the target's "
          f"{list(v.shape)} split along axis {v.axis} ({want} each): another shape or axis.")
    if v.groups is not None and shape[0] == len(v.groups[0]):  # hybrid, as many blocks: each device its own
      groups = v.groups
      canonical = NamedSharding(group_mesh(self._mesh, groups), P(GROUP_AXES[1]))
      blocks = _with_shape({"blocks": jax.ShapeDtypeStruct(shape, v.dtype, sharding=canonical)}, node)

      def finish_groups(take: Any) -> ShardedVariable:
        took = take(blocks)
        _check_logical_shape(took, where, v.shape)
        return from_canonical_blocks(took["blocks"], v.shape, v.axis, groups, self._split)

      return blocks, finish_groups
    if v.groups is None and shape[0] == self._n:  # as many replicas: each device reads its own block
      own = _with_shape({"blocks": jax.ShapeDtypeStruct(shape, v.dtype, sharding=self._split)}, node)

      def finish_own(take: Any) -> ShardedVariable:
        took = take(own)
        _check_logical_shape(took, where, v.shape)
        return ShardedVariable.from_blocks(took["blocks"], v.shape, v.axis)

      return own, finish_own
    # Another replica count: the whole value on the host, re-split.
    on_host = _with_shape({"blocks": _host_item(meta)}, node)

    def finish_host(take: Any) -> ShardedVariable:
      took = take(on_host)
      _check_logical_shape(took, where, v.shape)
      return self._place_sharded(_whole_from_blocks(np.asarray(took["blocks"]), v.axis, v.shape[v.axis]), v)

    return on_host, finish_host

  def _place_sharded(self, whole: np.ndarray, v: ShardedVariable) -> ShardedVariable:
    blocks = place_blocks(whole.astype(v.dtype, copy=False), v.axis, self._n, self._split, v.groups)
    return ShardedVariable.from_blocks(blocks, v.shape, v.axis, v.groups)


def shardings(strategy: Any) -> tuple[Any, Any, Any]:
  """(mesh, sharding of replicated values, sharding of per-replica stacks) of `strategy`."""
  mesh = strategy.mesh
  if mesh is None:  # the default strategy: one replica on JAX's default device
    device = SingleDeviceSharding(jax.local_devices()[0])
    return None, device, device
  return mesh, NamedSharding(mesh, P()), NamedSharding(mesh, P(REPLICA_AXIS))


def _leaf(x: Any, sharding: Any, mesh: Any, replicated: Any) -> Any:
  """The restore item of one target leaf: a `jax.ShapeDtypeStruct` on `sharding` (a plain array already
  laid out on the strategy's mesh keeps its own sharding), or a Python number as it is."""
  if isinstance(x, (bool, int, float, complex)):
    return x  # saved as a Python scalar by orbax; restored as one
  if isinstance(x, jax.ShapeDtypeStruct):
    return x if x.sharding is not None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(
        f"CheckpointManager.restore: `target` must be a pytree of arrays, jax.ShapeDtypeStructs or "
        f"Python numbers (like the saved state), got a {type(x).__name__}: {x!r:.100}.")
  if (sharding is replicated and isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
      and x.sharding.mesh == mesh):
    sharding = x.sharding  # a plain array already laid out on this strategy's mesh keeps its layout
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def check_shapes(abstract: Any, saved: Any, directory: str, step: int) -> None:
  """Raises a readable ValueError where the target's shapes differ from the checkpoint's."""
  ocp = api().ocp
  try:
    want = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract))
    have = ocp.tree.to_flat_dict(saved)
  except Exception:  # pylint: disable=broad-except  # unusual trees: leave the checks to orbax
    return
  for key, x in want.items():
    m = have.get(key)
    if m is None or not isinstance(x, jax.ShapeDtypeStruct) or tuple(getattr(m, "shape", ())) == x.shape:
      continue
    name = "/".join(str(k) for k in key)
    hint = ""
    if x.sharding is not None and getattr(x.sharding, "spec", None) == P(REPLICA_AXIS):
      hint = (" A PerReplica value keeps one component per replica and can only be restored onto as many "
              "replicas; save replicated (Mirrored) state to change the number of replicas.")
    raise ValueError(
        f"CheckpointManager.restore: the array at {name!r} of step {step} in {directory} has shape "
        f"{tuple(m.shape)}, but `target` expects {x.shape}.{hint}")
