"""Sharded values: `ShardedVariable`, one array split over the replicas along one axis (TF's
`tf.distribute.experimental.ShardedVariable`, `sharded_variable.py`), and `LocalShard`, the block a step
of `strategy.run` sees of it.

No device holds the whole value: the global array stacks the blocks on a leading replica axis
(``[N, ...block]``, sharded like a `PerReplica`), and a step reads the whole value with
`LocalShard.read_value` (an all-gather, whose gradient is a reduce-scatter). Hybrid sharding splits a value
within groups of replicas and replicates it across them (`Groups`); the collectives within and across the
groups are here too (`scatter_sum`, `gather_within_groups`). `block_size` is the rows of one block.
`gather_again_policy` is the `jax.checkpoint` policy that gathers a layer again in the backward pass.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.values import DistributedValues, replicated, unstack_replicas

__all__ = ["GATHERED", "Groups", "LocalShard", "ShardedVariable", "block_size", "gather_again_policy",
           "gather_within_groups", "group_position", "read_values", "scatter_sum"]

Groups = tuple[tuple[int, ...], ...]
"""Groups of replica ids that split a sharded value among them (hybrid sharding): equal sizes, every
replica in one group, each group in block order."""


@jax.tree_util.register_pytree_node_class
class ShardedVariable(DistributedValues):
  """One array split over the replicas along one axis (TF's `tf.distribute.experimental.ShardedVariable`):
  each replica holds one block, and no device holds the whole value.

  The global array holds the blocks stacked on a leading replica axis (``[N, ...block]``, the layout of a
  `PerReplica`, sharded over the replicas): block ``r`` is rows ``[r*b, (r+1)*b)`` of `axis`, ``b = ceil(d /
  N)`` for ``d`` the logical size there, zero-padded at the end; `shape` is the logical shape. Made by `strategy.experimental_shard`, and by
  `strategy.run` for every sharded value a step returns (a block, as `LocalShard`).

  * ``strategy.experimental_local_results(v)`` / ``v.values``: the blocks, one per replica of this process
    (the last ones padded with zeros; where ``d < N`` the blocks past row ``d`` are all padding).
  * ``np.asarray(v)``: the whole value, padding stripped (TF's conversion to the concatenated tensor).
  * Inside `strategy.run` a step sees its block as a `LocalShard`; ``read_value()`` all-gathers the value.

  Hybrid sharding (`groups`, ``experimental_shard(..., groups=...)``): the value is split within each group
  of replicas and replicated across the groups. Replica ``r`` at position ``p`` of its group holds block
  ``p`` of ``S`` (the group size; ``b = ceil(d / S)``), so the stacked global array is still ``[N,
  ...block]``, each device holding its own block, and the ``G`` replicas at one position hold equal blocks.
  """

  __slots__ = ("_shape", "_axis", "_groups")
  _shape: tuple[int, ...]
  _axis: int
  _groups: Groups | None

  @classmethod
  def from_blocks(cls, blocks: Any, shape: Sequence[int], axis: int, groups: Groups | None = None) -> ShardedVariable:
    """Internal constructor: a `ShardedVariable` over `blocks`, a global array of the blocks stacked on a
    leading replica axis (``[N, ...block]``, placed by the caller), of logical `shape`, split on `axis`
    (within each of `groups`, checked by the caller: see `group_position`; None: over every replica).

    Used by the modules that place blocks (`experimental_shard`, checkpoint restores, embedding tables,
    the engine's outputs); users make one with ``strategy.experimental_shard``.
    """
    return cls._wrap(blocks, tuple(shape), axis, groups)

  @classmethod
  def _wrap(cls, value: Any, shape: tuple[int, ...] = (), axis: int = 0,
            groups: Groups | None = None) -> ShardedVariable:
    obj = object.__new__(cls)
    obj._value = value
    obj._shape = tuple(shape)
    obj._axis = axis
    obj._groups = groups
    return obj

  def __init__(self, *args: Any, **kwargs: Any) -> None:
    raise TypeError("ShardedVariable values are made by strategy.experimental_shard(tree) or returned by "
                    "strategy.run; they are not built directly.")

  def tree_flatten(self):
    return (self._value,), (self._shape, self._axis, self._groups)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls._wrap(children[0], *aux)

  def map_global(self, fn: Any) -> ShardedVariable:
    return ShardedVariable._wrap(fn(self._value), self._shape, self._axis, self._groups)

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical (unpadded) shape."""
    return self._shape

  @property
  def axis(self) -> int:
    """The axis the value is split along."""
    return self._axis

  @property
  def dtype(self) -> Any:
    return self._value.dtype

  @property
  def groups(self) -> Groups | None:
    """The groups of replica ids the value is split within (hybrid sharding), each ordered by block; None
    when it is split over every replica."""
    return self._groups

  @property
  def num_replicas(self) -> int:
    """How many blocks the value is stacked as: one per replica (with `groups`, ``len(groups)`` copies of
    each of the ``len(groups[0])`` distinct blocks)."""
    return _replica_count(self._value)

  @property
  def values(self) -> tuple[Any, ...]:
    """This process's blocks, in replica order (padded ones included: each block has the same shape)."""
    return tuple(unstack_replicas(self._value))

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    del copy
    stacked = np.asarray(jax.device_get(_fully_replicated(self._value)))
    if self._groups is not None:
      stacked = stacked[list(self._groups[0])]  # one group's blocks, in block order
    full = np.concatenate(list(stacked), axis=self._axis)
    full = np.take(full, np.arange(self._shape[self._axis]), axis=self._axis)
    return full if dtype is None else full.astype(dtype)

  def __repr__(self) -> str:
    within = "" if self._groups is None else f", groups={len(self._groups)}x{len(self._groups[0])}"
    return (f"ShardedVariable(shape={list(self._shape)}, dtype={self._value.dtype}, axis={self._axis}, "
            f"num_replicas={_replica_count(self._value)}{within})")


def group_position(groups: Groups) -> tuple[int, ...]:
  """For each replica id, its position in its group: the block of a hybrid-sharded value it holds."""
  position = [0] * sum(len(g) for g in groups)
  for group in groups:
    for p, r in enumerate(group):
      position[r] = p
  return tuple(position)


def _across(groups: Groups) -> list[list[int]]:
  """The groups across `groups`: the replicas at each position, one from each group (``G`` of them)."""
  return [list(column) for column in zip(*groups)]


def _psum_across_groups(x: jax.Array, groups: Groups) -> jax.Array:
  """The sum of `x` (varying) over the replicas at this replica's position in every group: the all-reduce
  across the groups of a hybrid-sharded block (``1/S`` of the value). JAX's typed collectives take no
  groups for `psum`: it runs in a nested region that opts out of varying-axis checks (its result differs
  between positions, so it is cast back to varying), as `grouped_sums` does for grouped all-reduces."""
  if len(groups) == 1:
    return x
  region = jax.shard_map(functools.partial(jax.lax.psum, axis_name=REPLICA_AXIS, axis_index_groups=_across(groups)),
                         in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                         axis_names=frozenset(), check_vma=False)
  return jax.lax.pcast(region(x), REPLICA_AXIS, to="varying")


def scatter_sum(x: jax.Array, axis: int, groups: Groups | None) -> jax.Array:
  """This replica's block of the sum over every replica of `x` (typed per replica), cut along `axis` into
  as many blocks as replicas (or, with `groups`, as replicas per group: ``x.shape[axis]`` must divide):
  one tiled reduce-scatter (with `groups`, within the group, then one all-reduce of the block across the
  groups: the only communication between groups, ``1/S`` of `x`)."""
  if groups is None:
    return jax.lax.psum_scatter(x, REPLICA_AXIS, scatter_dimension=axis, tiled=True)
  within = jax.lax.psum_scatter(x, REPLICA_AXIS, scatter_dimension=axis, tiled=True,
                                axis_index_groups=[list(g) for g in groups])
  return _psum_across_groups(within, groups)


def gather_within_groups(x: jax.Array, axis: int, groups: Groups) -> jax.Array:
  """The blocks of this replica's group, `x` from each (typed per replica), concatenated along `axis` in
  block order, typed invariant: for values whose groups hold equal blocks (a hybrid-sharded value's
  updates), so that the result is the same on every replica. Runs in a nested region that opts out of
  varying-axis checks (JAX types a grouped all-gather varying)."""
  region = jax.shard_map(functools.partial(jax.lax.all_gather, axis_name=REPLICA_AXIS, axis=axis, tiled=True,
                                           axis_index_groups=[list(g) for g in groups]),
                         in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                         axis_names=frozenset(), check_vma=False)
  return region(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _summed_across_groups(block: jax.Array, groups: Groups) -> jax.Array:
  """`block` itself; its cotangent is summed across the groups (`_psum_across_groups`). Read through the
  grouped all-gather, whose transpose sums a gradient within the group, a hybrid block's gradient is then
  the sum over every replica: the block is one value, held once per group."""
  del groups
  return block


def _summed_across_groups_fwd(block: jax.Array, groups: Groups) -> tuple[jax.Array, None]:
  del groups
  return block, None


def _summed_across_groups_bwd(groups: Groups, _: None, ct: jax.Array) -> tuple[jax.Array]:
  return (_psum_across_groups(ct, groups),)


_summed_across_groups.defvjp(_summed_across_groups_fwd, _summed_across_groups_bwd)


def block_size(size: int, num_replicas: int) -> int:
  """Rows of each replica's block of an axis of `size` split over `num_replicas`: ``ceil(size / n)``."""
  return -(-size // num_replicas)


def _replica_count(x: Any) -> int:
  return int(x.shape[0])  # blocks stacked on a leading replica axis


def _fully_replicated(x: Any) -> Any:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return replicated(x)
  return x


@jax.tree_util.register_pytree_node_class
class LocalShard:
  """A `ShardedVariable` as a step of `strategy.run` sees it: this replica's block.

  A pytree node over the block, so `jax.grad`, optax and `jax.tree.map` work on blocks (an optimizer's
  state made from it is sharded the same way, and `run` returns every `LocalShard` as a
  `ShardedVariable`). Arithmetic on it is an error: read the whole value first with `read_value()` (or
  `tpustrat.read_values(tree)`), whose gradient is this replica's block of the gradient summed over the
  replicas (the all-gather's transpose is a reduce-scatter).

  With `groups` (hybrid sharding) the block is this replica's block of the value split within its group:
  ``read_value`` gathers within the group, and the gradient is reduce-scattered within the group and then
  summed across the groups (``1/S`` of the value crosses them).
  """

  __slots__ = ("block", "shape", "axis", "groups")

  def __init__(self, block: Any, shape: tuple[int, ...], axis: int, groups: Groups | None = None) -> None:
    self.block = block
    self.shape = tuple(shape)
    self.axis = axis
    self.groups = groups

  def tree_flatten(self):
    return (self.block,), (self.shape, self.axis, self.groups)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  @property
  def dtype(self) -> Any:
    return self.block.dtype

  def num_blocks(self, num_replicas: int) -> int:
    """How many distinct blocks the value is split into: the group size, or `num_replicas` (no groups)."""
    return num_replicas if self.groups is None else len(self.groups[0])

  def block_index(self) -> Any:
    """Which block of the value this replica holds (inside `strategy.run`): its replica id, or with
    `groups` its position in its group."""
    r = jax.lax.axis_index(REPLICA_AXIS)
    return r if self.groups is None else jnp.asarray(group_position(self.groups), jnp.int32)[r]

  def _slice_axis(self) -> tuple[int, tuple[int, ...]]:
    """(the split axis of `block`, the logical shape of what `block` is a block of): `block` may be a slice
    of its leading axes (a scan over stacked layers); the split axis must not be one of them."""
    lead = len(self.shape) - jnp.ndim(self.block)
    if lead < 0 or (lead and self.axis < lead):
      raise ValueError(
          f"{self!r}: a block of rank {jnp.ndim(self.block)} is not a block of a value of shape {list(self.shape)} "
          f"split along axis {self.axis}; only leading axes before the split axis may be indexed away (a scan "
          "over stacked layers), not the split axis itself.")
    return self.axis - lead, self.shape[lead:]

  def _checked_block(self) -> tuple[int, tuple[int, ...], int]:
    """(the split axis of `block`, the logical shape it is a block of, the number of blocks): `_slice_axis`,
    with the block's shape checked against them (inside `strategy.run`)."""
    axis, shape = self._slice_axis()
    n = self.num_blocks(jax.lax.axis_size(REPLICA_AXIS))
    want = list(shape)
    want[axis] = block_size(shape[axis], n)
    if list(jnp.shape(self.block)) != want:
      raise ValueError(f"{self!r}: the block has shape {list(jnp.shape(self.block))}, but a value of shape {list(shape)} "
                       f"split along axis {axis} over {n} replicas has blocks of shape {want}.")
    return axis, shape, n

  def real_block(self) -> jax.Array:
    """The block with its padding (the rows past the logical size, zeros as placed, but whatever an
    elementwise update made of them since) set to zero: for statistics over the whole value
    (`tpustrat.global_norm`, the numerics check)."""
    axis, shape = self._slice_axis()
    rows = jnp.shape(self.block)[axis]
    index = jax.lax.broadcasted_iota(jnp.int32, tuple(rows if i == axis else 1 for i in range(jnp.ndim(self.block))),
                                     axis) + self.block_index() * rows
    return jnp.where(index < shape[axis], self.block, jnp.zeros((), self.block.dtype))

  def read_value(self) -> jax.Array:
    """The whole value (logical shape), all-gathered from every replica's block.

    A block indexed along leading axes, as `lax.scan` and `jax.vmap` over a stacked layer axis hand it to
    their body, reads the matching slice only: for a value of shape ``[L, d, f]`` split along axis 1, a
    scan over its layers reads one ``[d, f]`` layer per iteration (per-layer gathering, FSDP). The
    leading axes must not include the split axis. The result is named `GATHERED` for `jax.checkpoint`
    policies (`gather_again_policy`): a rematerialised layer gathers again in the backward pass instead
    of keeping every gathered layer alive.

    With `groups` the all-gather runs within this replica's group, and the gradient w.r.t. the block is
    reduce-scattered within the group, then all-reduced across the groups (the block's ``1/S`` of the
    value): the sum over every replica, as without groups.
    """
    block = self.block
    axis, shape, _ = self._checked_block()
    if self.groups is None:
      full = jax.lax.all_gather(block, REPLICA_AXIS, axis=axis, tiled=True)
    else:
      full = jax.lax.all_gather(_summed_across_groups(block, self.groups), REPLICA_AXIS, axis=axis, tiled=True,
                                axis_index_groups=[list(g) for g in self.groups])
    full = jax.lax.slice_in_dim(full, 0, shape[axis], axis=axis)
    return checkpoint_name(full, GATHERED)

  def _refuse(self, *args: Any) -> Any:
    raise TypeError(
        f"A sharded value ({self!r}) holds only this replica's block: read the whole value first, "
        "x.read_value() (or tpustrat.read_values(tree)), or update the block itself with jax.tree.map.")

  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
  __matmul__ = __rmatmul__ = __neg__ = __getitem__ = __pow__ = _refuse

  def __jax_array__(self) -> Any:
    self._refuse()

  def sum_to_block(self, whole: jax.Array) -> jax.Array:
    """This replica's block of the sum over every replica of `whole` (a value of the logical shape, typed
    per replica: a local gradient), zero-padded to whole blocks: what `jax.grad` through `read_value` gives
    (one reduce-scatter; with `groups` within the group, then one all-reduce of the block across them)."""
    n = self.num_blocks(jax.lax.axis_size(REPLICA_AXIS))
    rows = block_size(self.shape[self.axis], n) * n
    pad = [(0, 0)] * jnp.ndim(whole)
    pad[self.axis] = (0, rows - jnp.shape(whole)[self.axis])
    if rows != jnp.shape(whole)[self.axis]:
      whole = jnp.pad(whole, pad)
    return scatter_sum(whole, self.axis, self.groups)

  def __repr__(self) -> str:
    within = "" if self.groups is None else f", groups={len(self.groups)}x{len(self.groups[0])}"
    return (f"LocalShard(shape={list(self.shape)}, axis={self.axis}, block={getattr(self.block, 'shape', '?')}"
            f"{within})")


GATHERED = "tpustrat_gathered"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of every value `LocalShard.read_value` gathers."""


def gather_again_policy() -> Any:
  """A `jax.checkpoint` policy for FSDP layers: the backward pass all-gathers each layer's weights again
  instead of keeping every gathered layer alive from the forward pass. It saves the outputs of matrix
  products without batch dimensions (activations times weights: activation-sized) and recomputes the rest,
  the gathers and the weights' casts included. Use it on the body of a scan over stacked layers::

      body = jax.checkpoint(layer, policy=tpustrat.gather_again_policy())
      x, _ = jax.lax.scan(body, x, stacked_params)   # reads (gathers) one layer per iteration

  It is `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`, the usual transformer policy.
  `jax.checkpoint_policies.nothing_saveable` recomputes everything (less memory, more compute). A policy
  that saves everything but names does not do: it saves the all-gather's output itself. Custom policies
  that save by name can leave the gathered values out by their name, `GATHERED`.
  """
  return jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def read_values(tree: Any) -> Any:
  """`tree` with every sharded value (`LocalShard`, inside `strategy.run`) read whole (all-gathered); other
  leaves as they are. The gradient w.r.t. the blocks is the block of the gradient summed over replicas.

  The sharded leaves are read together: those of one dtype and one split (the same `groups`) go through
  one all-gather of their blocks, flattened and concatenated (PyTorch FSDP's flat parameter), so that the
  gradient is one reduce-scatter of them too (with `groups`, and one all-reduce across the groups), not one
  collective per leaf. The values are those of ``x.read_value()`` for each leaf.

  >>> read_values({"b": np.ones(2)})["b"]
  array([1., 1.])
  """
  is_shard = lambda x: isinstance(x, LocalShard)  # noqa: E731
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_shard)
  together: dict[Any, list[int]] = {}  # (groups, dtype) -> positions of those leaves
  for i, x in enumerate(leaves):
    if is_shard(x):
      together.setdefault((x.groups, jnp.result_type(x.block)), []).append(i)
  for (groups, _), positions in together.items():
    if len(positions) == 1:
      leaves[positions[0]] = leaves[positions[0]].read_value()
      continue
    for i, full in zip(positions, _read_together([leaves[i] for i in positions], groups)):
      leaves[i] = full
  return jax.tree.unflatten(treedef, leaves)


def _read_together(shards: Sequence[LocalShard], groups: Groups | None) -> list[jax.Array]:
  """The whole values of `shards` (one dtype, split the same way), as ``read_value`` reads each, from one
  all-gather: every block with its split axis moved first, flattened, concatenated; gathered (``[n,
  total]``, block order), each value cut back out of the ``n`` rows, its blocks' rows end to end along the
  split axis, the padding sliced off. Its transpose is one reduce-scatter (with `groups`, within the group,
  then one all-reduce of the blocks across the groups)."""
  parts, layouts = [], []
  n = 0
  for x in shards:
    axis, shape, n = x._checked_block()  # pylint: disable=protected-access
    moved = jnp.moveaxis(x.block, axis, 0)  # [b, ...]: the rows of the block along the split axis first
    parts.append(jnp.reshape(moved, (-1,)))
    layouts.append((axis, shape, jnp.shape(moved)))
  flat = jnp.concatenate(parts)
  if groups is None:
    gathered = jax.lax.all_gather(flat, REPLICA_AXIS, axis=0)
  else:
    gathered = jax.lax.all_gather(_summed_across_groups(flat, groups), REPLICA_AXIS, axis=0,
                                  axis_index_groups=[list(g) for g in groups])
  out, start = [], 0  # gathered: [n, total], row p block p of every value
  for axis, shape, moved_shape in layouts:
    size = int(np.prod(moved_shape, dtype=np.int64))
    rows = jax.lax.slice_in_dim(gathered, start, start + size, axis=1)  # [n, size]
    start += size
    whole = jnp.reshape(rows, (n * moved_shape[0], *moved_shape[1:]))  # the n blocks end to end
    whole = jax.lax.slice_in_dim(jnp.moveaxis(whole, 0, axis), 0, shape[axis], axis=axis)
    out.append(checkpoint_name(whole, GATHERED))
  return out
