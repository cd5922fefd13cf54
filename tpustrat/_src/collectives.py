"""TPU collectives with group assignments: TF's `CrossReplicaSum`, `AllToAll` and siblings on JAX.

TF's TPU programs call raw collectives with a `group_assignment`: an int matrix of shape
``[num_groups, num_replicas_per_group]`` whose row ``g`` lists the replica ids of group ``g``. Each
replica then communicates with the members of its own group only. In JAX these are named collectives
over the strategy mesh's replica axis with ``axis_index_groups``:

====================================  ======================================================================
TF                                    JAX, inside `strategy.run`
====================================  ======================================================================
`CrossReplicaSum`                     grouped all-reduce (`grouped_sums`); `lax.psum` for one group
`AllToAll`                            `lax.all_to_all(..., axis_index_groups=groups, tiled=True)`
all-gather                            `lax.all_gather(..., axis_index_groups=groups, tiled=True)`
`XlaReduceScatter`                    `lax.psum_scatter(..., axis_index_groups=groups, tiled=True)`
`CollectivePermute`                   `lax.ppermute(x, axis, source_target_pairs)`
====================================  ======================================================================

Every argument is checked in Python, on the host, before any collective is emitted: a bad group
assignment, `split_count` or dimension is a `ValueError` that quotes the offending value.

Result types follow JAX's varying-axis analysis, which `strategy.run` uses to pick `Mirrored` or
`PerReplica`: a sum or gather over one group of all replicas is the same everywhere (invariant,
`Mirrored`); grouped sums and gathers differ between groups (varying, `PerReplica`), and so do
scatters, all-to-alls and permutes. A grouped result is varying even when the input is the same on every
replica (a `Mirrored` value: the grouped sum is then ``group_size * x``, still typed varying), so that
its type, and its gradient, do not depend on the input's type: the gradient w.r.t. a `Mirrored` input of
a loss computed from a grouped result is summed over the replicas, the same as w.r.t.
`local_copy(input)`. This holds for grouped SUM and MEAN alike, and matches the grouped `all_gather`,
`all_to_all`, `reduce_scatter` and `collective_permute`, whose JAX collectives cast an invariant input
to varying themselves.

Grouped sums are computed by `tpustrat._src.grouped_sums` (one `psum` for one group; with several, the
native grouped all-reduce or, where the installed JAX rejects it, a reduce-scatter and an all-gather).
A SUM of a traced value that is already the same on every replica warns (`AlreadyReplicatedWarning`, see
`tpustrat._src.gradient_semantics`); group assignments are checked by `tpustrat._src.groups`.
"""

from __future__ import annotations

import operator
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpustrat._src import context as context_lib
from tpustrat._src.gradient_semantics import warn_if_already_replicated
from tpustrat._src.grouped_sums import grouped_sum
from tpustrat._src.groups import (
  Groups,
  group_size,
  label,
  lax_groups,
  normalize_group_assignment,
  normalize_source_target_pairs,
  quote,
)
from tpustrat._src.jax_compat import all_gather_invariant
from tpustrat._src.reduce_op import ReduceOp

__all__ = ["all_gather", "all_gather_in_groups", "all_reduce_in_groups", "all_to_all", "collective_permute",
           "cross_replica_sum", "reduce_scatter"]

# TF's CrossReplicaSum accepts bfloat16, float32, int32 and uint32; float16 and float64 are added where
# JAX has them (float64 needs `jax_enable_x64`).
_SUM_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, np.float16, np.float32, np.float64, np.int32,
                                          np.uint32))


# -- where we are: the replica axis of the current `strategy.run` -------------------------------------


def _replica_axis(op: str) -> tuple[str | None, int]:
  """Returns ``(axis_name, num_replicas)`` of the live replica context, or ``(None, 1)`` with no strategy."""
  ctx = context_lib.get_replica_context()
  if ctx is None:
    raise RuntimeError(
        f"tpustrat.ops.{op} was called in the cross-replica context of {context_lib.get_strategy()!r} "
        "(inside strategy.scope(), outside strategy.run). Collectives need a replica context: call "
        "it inside the function given to strategy.run.")
  axis = context_lib.replica_axis(ctx)
  if axis is None:
    # The default strategy: one replica, every collective is an identity. Inside someone else's
    # shard_map or pmap (manual mesh axes, but no run) an identity would silently be wrong.
    manual = sorted(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
    if manual:
      raise RuntimeError(
          f"tpustrat.ops.{op} was called inside a jax.shard_map or jax.pmap over axes {manual} but "
          "outside strategy.run, so there is no replica context. Call it inside the function given to "
          "strategy.run (or use jax.lax collectives directly).")
    return None, 1
  context_lib.check_active(ctx, op)
  return axis, ctx.num_replicas_in_sync


# -- argument checks ------------------------------------------------------------------------------


def _dimension(dim: Any, ndim: int, op: str, arg: str, shape: tuple[int, ...]) -> int:
  try:
    d = operator.index(dim)
  except TypeError:
    raise TypeError(f"{label(op)}: `{arg}` must be an int, got {dim!r}.") from None
  if not -ndim <= d < ndim:
    raise ValueError(
        f"{label(op)}: {arg}={d} is out of range for an input of shape {shape} (rank {ndim}); "
        f"expected a value in [{-ndim}, {ndim}) (negative values count from the end).")
  return d % ndim


def _named(op: str, name: Any) -> AbstractContextManager[None]:
  if name is not None and not isinstance(name, str):
    raise TypeError(f"tpustrat.ops.{op}: `name` must be a string or None, got {name!r}.")
  return jax.named_scope(name or op)


def _check_sum_dtype(x: jax.Array, op: str) -> None:
  dtype = np.dtype(x.dtype)
  if dtype not in _SUM_DTYPES:
    allowed = ", ".join(d.name for d in _SUM_DTYPES)
    raise TypeError(f"tpustrat.ops.{op}: input dtype {dtype.name} is not supported; allowed dtypes: {allowed}.")


def all_reduce_in_groups(reduce_op: ReduceOp | str, value: Any, group_assignment: Any, *,
                         axis_name: str | None, num_replicas: int, op: str = "ReplicaContext.all_reduce") -> Any:
  """Sums or averages every leaf of `value` within its replica group (`ReplicaContext.all_reduce`).

  A SUM of traced leaves that are already the same on every replica warns (`AlreadyReplicatedWarning`).
  """
  reduce_op = ReduceOp.from_value(reduce_op)
  groups = normalize_group_assignment(group_assignment, num_replicas, op)
  size = group_size(groups, num_replicas)
  if axis_name is not None:
    warn_if_already_replicated(op, jax.tree.leaves(value), axis_name, size,
                               "num_replicas_in_sync" if size == num_replicas else "the group size", reduce_op.name)

  def one(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    total = x if axis_name is None else grouped_sum(x, axis_name, groups)
    return total / size if reduce_op is ReduceOp.MEAN else total

  return jax.tree.map(one, value)


# -- the public ops -----------------------------------------------------------------------------------


def cross_replica_sum(input: jax.typing.ArrayLike, group_assignment: Any = None,
                      name: str | None = None) -> jax.Array:
  """Sums `input` over the replicas of each group; every replica gets its group's sum (TF's `CrossReplicaSum`).

  With 8 replicas holding ``[A, B, C, D, E, F, G, H]``, ``group_assignment=[[0, 2, 4, 6], [1, 3, 5, 7]]``
  gives ``[A+C+E+G, B+D+F+H, A+C+E+G, B+D+F+H, ...]``.

  Args:
    input: the local value; dtype bfloat16, float16, float32, float64 (with ``jax_enable_x64``), int32
      or uint32.
    group_assignment: an integer array-like of shape ``[num_groups, num_replicas_per_group]`` whose
      rows partition the replica ids; ``None`` sums over all replicas.
    name: a name for the operation (an XLA name scope).

  Returns:
    An array like `input`. With one group it is the same on every replica (`strategy.run` returns it
    as `Mirrored`); with several groups it differs between groups and is typed so (`PerReplica`), even
    for an `input` that is the same on every replica. Such an `input` is multiplied by the group size;
    when it is traced (for example a gradient w.r.t. `Mirrored` parameters, already summed over
    replicas by `jax.grad`) an `AlreadyReplicatedWarning` is emitted at trace time. Differentiable in
    reverse mode to any order (`jax.grad`, `jax.vjp`): the gradient of a grouped sum is the grouped
    sum of the cotangents, and w.r.t. a `Mirrored` `input` (one value given to every replica) that is
    further summed over the replicas, the same as w.r.t. ``tpustrat.local_copy(input)``. Forward mode (`jax.jvp`, `jax.jacfwd`) through a grouped sum of values
    that differ between replicas is not supported (JAX raises a `TypeError` for `custom_vjp`).

  Raises:
    TypeError: for an unsupported dtype.
    ValueError: for a malformed group assignment.
    RuntimeError: outside `strategy.run`, in the cross-replica context. With no strategy at all there
      is one replica and the op returns `input`.

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy()
  >>> x = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  >>> out = strategy.run(lambda x: ops.cross_replica_sum(x, [[0, 2, 4, 6], [1, 3, 5, 7]]), args=(x,))
  >>> print(np.asarray(out.values))
  [12. 16. 12. 16. 12. 16. 12. 16.]
  >>> strategy.run(lambda x: ops.cross_replica_sum(x), args=(x,))
  Mirrored(float32[])
  """
  x = jnp.asarray(input)
  _check_sum_dtype(x, "cross_replica_sum")
  axis, n = _replica_axis("cross_replica_sum")
  groups = normalize_group_assignment(group_assignment, n, "cross_replica_sum")
  if axis is None:
    return x
  size = group_size(groups, n)
  with _named("cross_replica_sum", name):
    warn_if_already_replicated("tpustrat.ops.cross_replica_sum", [input], axis, size,
                               "num_replicas_in_sync" if size == n else "the group size")
    return grouped_sum(x, axis, groups)


def all_to_all(input: jax.typing.ArrayLike, group_assignment: Any, concat_dimension: int,
               split_dimension: int, split_count: int, name: str | None = None) -> jax.Array:
  """Exchanges blocks of `input` between the replicas of each group (TF's `AllToAll`).

  Each replica splits `input` into `split_count` blocks along `split_dimension`, sends block ``i`` to
  the ``i``-th member of its group, and concatenates the blocks it receives, in group order, along
  `concat_dimension`: that dimension grows ``split_count`` times and `split_dimension` shrinks as much.

  With 2 replicas holding ``[[A, B]]`` and ``[[C, D]]``, ``group_assignment=[[0, 1]]``,
  ``concat_dimension=0``, ``split_dimension=1`` and ``split_count=2`` give ``[[A], [C]]`` and
  ``[[B], [D]]``.

  Args:
    input: the local value, of any dtype.
    group_assignment: ``[num_groups, num_replicas_per_group]`` replica ids (``None``: one group of all
      replicas in replica order).
    concat_dimension: the dimension to concatenate along (negative values count from the end).
    split_dimension: the dimension to split (negative values count from the end).
    split_count: the number of blocks; must equal the number of replicas per group.
    name: a name for the operation (an XLA name scope).

  Returns:
    The exchanged array (varying over replicas: `PerReplica` from `run`).

  Raises:
    ValueError: for a malformed group assignment, `split_count` different from the group size,
      dimensions out of range, or a split dimension not divisible by `split_count`.
    RuntimeError: in the cross-replica context.

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy(device_assignment=jax.devices()[:2])
  >>> x = tpustrat.PerReplica([np.array([[1, 2]]), np.array([[3, 4]])])
  >>> out = strategy.run(lambda x: ops.all_to_all(x, [[0, 1]], 0, 1, 2), args=(x,))
  >>> print(np.asarray(out.values).tolist())
  [[[1], [3]], [[2], [4]]]
  """
  x = jnp.asarray(input)
  axis, n = _replica_axis("all_to_all")
  groups = normalize_group_assignment(group_assignment, n, "all_to_all")
  size = group_size(groups, n)
  try:
    count = operator.index(split_count)
  except TypeError:
    raise TypeError(f"tpustrat.ops.all_to_all: `split_count` must be an int, got {split_count!r}.") from None
  if count != size:
    raise ValueError(
        f"tpustrat.ops.all_to_all: split_count={count} must equal the number of replicas per group, "
        f"{size}, of group_assignment={quote(group_assignment)}.")
  if x.ndim == 0:
    raise ValueError("tpustrat.ops.all_to_all needs an input of rank >= 1 to split; got a scalar.")
  concat = _dimension(concat_dimension, x.ndim, "all_to_all", "concat_dimension", x.shape)
  split = _dimension(split_dimension, x.ndim, "all_to_all", "split_dimension", x.shape)
  if x.shape[split] % count:
    raise ValueError(
        f"tpustrat.ops.all_to_all: dimension {split} (split_dimension={split_dimension}) of the input of "
        f"shape {x.shape} has size {x.shape[split]}, not divisible by split_count={count}.")
  if axis is None or size == 1:
    return x
  with _named("all_to_all", name):
    return lax.all_to_all(x, axis, split, concat, axis_index_groups=lax_groups(groups, n), tiled=True)


def all_gather(input: jax.typing.ArrayLike, group_assignment: Any = None, axis: int = 0,
               name: str | None = None) -> jax.Array:
  """Concatenates the `input` of every member of the replica's group along `axis`, in group order.

  Args:
    input: the local value, of rank >= 1 and any dtype.
    group_assignment: ``[num_groups, num_replicas_per_group]`` replica ids, or ``None`` for all
      replicas in replica order.
    axis: the dimension to concatenate along (negative values count from the end); it grows
      ``num_replicas_per_group`` times.
    name: a name for the operation (an XLA name scope).

  Returns:
    The gathered array. With one group it is the same on every replica (`Mirrored` from `run`, as
    for `ReplicaContext.all_gather`); with several groups it differs between groups (`PerReplica`).

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy()
  >>> x = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: np.array([ctx.replica_id_in_sync_group]))
  >>> out = strategy.run(lambda x: ops.all_gather(x, [[0, 1, 2, 3], [7, 6, 5, 4]]), args=(x,))
  >>> print(np.asarray(out.values[0]), np.asarray(out.values[7]))
  [0 1 2 3] [7 6 5 4]
  """
  x = jnp.asarray(input)
  axis_name, n = _replica_axis("all_gather")
  groups = normalize_group_assignment(group_assignment, n, "all_gather")
  with _named("all_gather", name):
    return _all_gather(x, groups, axis, axis_name=axis_name, num_replicas=n)


def all_gather_in_groups(value: Any, axis: int, group_assignment: Any, *, axis_name: str | None,
                         num_replicas: int) -> Any:
  """`all_gather` of every leaf of `value` within its replica group (`ReplicaContext.all_gather`)."""
  groups = normalize_group_assignment(group_assignment, num_replicas, "ReplicaContext.all_gather")
  return jax.tree.map(
      lambda x: _all_gather(jnp.asarray(x), groups, axis, axis_name=axis_name, num_replicas=num_replicas),
      value)


def _all_gather(x: jax.Array, groups: Groups | None, axis: int, *, axis_name: str | None,
                num_replicas: int) -> jax.Array:
  if x.ndim == 0:
    raise ValueError("tpustrat.ops.all_gather needs an input of rank >= 1 to concatenate; got a scalar. "
                     "Reshape it to [1] first.")
  dim = _dimension(axis, x.ndim, "all_gather", "axis", x.shape)
  if axis_name is None:
    return x
  if groups is None or len(groups) == 1:
    # One group: every replica gets the same array, typed invariant as `ReplicaContext.all_gather`'s.
    out = all_gather_invariant(x, axis_name, axis=dim, tiled=True)
    if groups is None or groups[0] == tuple(range(num_replicas)):
      return out
    blocks = jnp.split(out, num_replicas, axis=dim)
    return jnp.concatenate([blocks[r] for r in groups[0]], axis=dim)
  return lax.all_gather(x, axis_name, axis=dim, axis_index_groups=lax_groups(groups, num_replicas),
                        tiled=True)


def reduce_scatter(input: jax.typing.ArrayLike, group_assignment: Any = None,
                   scatter_dimension: int = 0, reduce_op: ReduceOp | str = ReduceOp.SUM,
                   name: str | None = None) -> jax.Array:
  """Reduces `input` within each group and gives each member one block of the result (TF's `XlaReduceScatter`).

  The group's sum (or mean) is split into ``num_replicas_per_group`` blocks along `scatter_dimension`;
  the ``i``-th member of the group gets block ``i``.

  Args:
    input: the local value; the same dtypes as `cross_replica_sum`.
    group_assignment: ``[num_groups, num_replicas_per_group]`` replica ids, or ``None`` for all.
    scatter_dimension: the dimension to split (negative values count from the end); its size must be
      divisible by the group size.
    reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or "sum", "mean", and TF's "Add", "Mean").
    name: a name for the operation (an XLA name scope).

  Returns:
    This replica's block (varying over replicas: `PerReplica` from `run`). A SUM of a traced `input`
    that is already the same on every replica warns (`AlreadyReplicatedWarning`), as for
    `cross_replica_sum`.

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy()
  >>> out = strategy.run(lambda: ops.reduce_scatter(np.arange(4.0), [[0, 1, 2, 3], [4, 5, 6, 7]]))
  >>> print(np.asarray(out.values).ravel())
  [ 0.  4.  8. 12.  0.  4.  8. 12.]
  """
  x = jnp.asarray(input)
  _check_sum_dtype(x, "reduce_scatter")
  if isinstance(reduce_op, str) and reduce_op.lower() == "add":
    reduce_op = ReduceOp.SUM
  op = ReduceOp.from_value(reduce_op)
  axis, n = _replica_axis("reduce_scatter")
  groups = normalize_group_assignment(group_assignment, n, "reduce_scatter")
  size = group_size(groups, n)
  if x.ndim == 0:
    raise ValueError("tpustrat.ops.reduce_scatter needs an input of rank >= 1 to scatter; got a scalar.")
  dim = _dimension(scatter_dimension, x.ndim, "reduce_scatter", "scatter_dimension", x.shape)
  if x.shape[dim] % size:
    raise ValueError(
        f"tpustrat.ops.reduce_scatter: dimension {dim} of the input of shape {x.shape} has size "
        f"{x.shape[dim]}, not divisible by the number of replicas per group ({size}).")
  if axis is None:
    return x
  with _named("reduce_scatter", name):
    if op is ReduceOp.SUM:
      warn_if_already_replicated("tpustrat.ops.reduce_scatter", [input], axis, size,
                                 "num_replicas_in_sync" if size == n else "the group size")
    out = lax.psum_scatter(x, axis, scatter_dimension=dim, axis_index_groups=lax_groups(groups, n),
                           tiled=True)
    return out / size if op is ReduceOp.MEAN else out


def collective_permute(input: jax.typing.ArrayLike, source_target_pairs: Any,
                       name: str | None = None) -> jax.Array:
  """Sends `input` from each source replica to its target replica (TF's `CollectivePermute`).

  Args:
    input: the local value, of any dtype.
    source_target_pairs: an integer array-like of shape ``[num_pairs, 2]``: replica ``source`` sends
      its value to replica ``target``. Each replica is a source at most once and a target at most once;
      replicas that are nobody's target receive zeros.
    name: a name for the operation (an XLA name scope).

  Returns:
    The received value (varying over replicas: `PerReplica` from `run`).

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy()
  >>> x = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: np.int32(ctx.replica_id_in_sync_group))
  >>> ring = [[r, (r + 1) % 8] for r in range(8)]
  >>> print(np.asarray(strategy.run(lambda x: ops.collective_permute(x, ring), args=(x,)).values))
  [7 0 1 2 3 4 5 6]
  """
  x = jnp.asarray(input)
  axis, n = _replica_axis("collective_permute")
  perm = normalize_source_target_pairs(source_target_pairs, n, "collective_permute")
  if axis is None:
    return x if perm else jnp.zeros_like(x)
  with _named("collective_permute", name):
    return lax.ppermute(x, axis, perm)
