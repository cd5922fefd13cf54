"""ZeRO stage 1/2 for `Mirrored` parameters: `tpustrat.sharded_optimizer(tx)`.

`strategy.experimental_shard` (FSDP, ZeRO-3) splits the parameters themselves over the replicas. Many
models fit on one device whole and only their optimizer state (two float32 moments per parameter for
Adam: 8 of the 16 bytes per parameter) does not fit many times over. `sharded_optimizer(tx)` wraps an
optax `GradientTransformation` so that the parameters stay `Mirrored` (whole on every device, no gather
in the forward pass) and only the optimizer state, and the optimizer's arithmetic, are split (DeepSpeed's
ZeRO stage 1; with the gradient reduce-scattered rather than all-reduced, stage 2):

* ``init`` (inside `strategy.run`): every leaf the partitioner splits is flattened and padded to ``N *
  ceil(size / N)`` elements; replica ``r`` takes elements ``[r*b, (r+1)*b)`` and `tx.init` sees it as a
  `LocalShard` of a 1-D value of ``size`` elements. The state comes back from `run` as `ShardedVariable`s
  (``1/N`` per device) and, for the leaves left whole, `Mirrored` values.
* ``update`` (inside the step): per-replica gradients (w.r.t. `tpustrat.local_copy(params)`, TF's) are
  summed and scattered in one `lax.psum_scatter` per dtype for every split leaf together (a reduce-scatter;
  SUM, like TF's optimizers' all-reduce; 16-bit gradients are added in float32 and rounded back once), the
  others summed by one `psum`; gradients already summed over
  the replicas (w.r.t. the `Mirrored` parameters themselves, JAX's) need no communication here: each
  replica takes its block. (JAX's backward pass has all-reduced those whole already: that is ZeRO-1, the
  state split but not the gradient; differentiate w.r.t. `local_copy(params)` for stage 2's
  reduce-scatter.) `tx.update` runs on the blocks, and the updates are all-gathered whole in one
  all-gather per dtype, the same on every replica, for `optax.apply_updates` on the `Mirrored` parameters.

Which of the two kinds a gradient is, is read from JAX's varying-axes type (`jax_compat.varying_axes`),
never from shapes or values.

With ``groups=`` (hybrid: one group per process, per slice, or lists) the state is split within each
group of ``S`` replicas and replicated across the groups: replica ``r`` holds block ``p`` of ``S`` (its
position in its group), per-replica gradients are reduce-scattered within the group and their blocks
all-reduced across the groups (``1/S`` of the bytes cross them), and the updates are all-gathered within
the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tpustrat._src import context as context_lib
from tpustrat._src import jax_compat as compat
from tpustrat._src.block_statistics import Mixed, caller, mixed_results
from tpustrat._src.jax_compat import all_gather_invariant, to_varying, varying_axes
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import (
  Groups,
  LocalShard,
  ShardedVariable,
  block_size,
  gather_within_groups,
  group_position,
  scatter_sum,
)
from tpustrat._src.sharding import MinSizePartitioner, resolve_groups
from tpustrat._src.validation import normalize_axis, tree_path
from tpustrat._src.values import DistributedValues

__all__ = ["sharded_optimizer"]

_NAME = "sharded_optimizer"


class _Leaf(NamedTuple):
  """One parameter leaf: where it is, its shape and whether it is split (flattened to ``size`` elements,
  ``block`` per replica)."""

  where: str
  shape: tuple[int, ...]
  size: int
  split: bool


def _is_node(x: Any) -> bool:
  return isinstance(x, (LocalShard, DistributedValues))


def _flatten(tree: Any) -> tuple[list[tuple[Any, Any]], Any]:
  """(path, leaf) pairs and the structure of `tree`, with sharded and distributed values as leaves."""
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_node)


def _where(path: Any) -> str:
  return tree_path(path) or "<root>"


def _check_not_sharded(where: str, x: Any, what: str) -> None:
  if isinstance(x, (LocalShard, ShardedVariable)):
    raise ValueError(
        f"{_NAME}: the {what} at {where} is already split over the replicas ({x!r}); {_NAME} is ZeRO-1/2 for "
        "Mirrored parameters, which stay whole on every device. For parameters split with "
        "strategy.experimental_shard (FSDP) use the optimizer itself on the blocks: grads = "
        "jax.grad(lambda p: loss(tpustrat.read_values(p)))(params); tx.update(grads, opt_state, params).")
  if isinstance(x, DistributedValues):
    raise ValueError(
        f"{_NAME}: the {what} at {where} is a {type(x).__name__} value: call the optimizer inside the step "
        f"(opt_state = strategy.run(zopt.init, args=(params,)); zopt.update(grads, opt_state, params) in the "
        "step), where Mirrored parameters are plain arrays.")


def _plan(tree: Any, partitioner: Callable[..., Any], what: str) -> tuple[list[_Leaf], Any]:
  """Which leaves of `tree` (the parameters, or the gradients when no parameters are given) are split."""
  pairs, treedef = _flatten(tree)
  plan = []
  for path, x in pairs:
    where = _where(path)
    _check_not_sharded(where, x, what)
    dtype = jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype
    if dtype == jax.dtypes.float0 or not jnp.issubdtype(dtype, jnp.inexact):
      raise TypeError(
          f"{_NAME}: the {what} at {where} has dtype {dtype}; only floating-point (or complex) leaves are "
          "differentiable and can be optimized. Keep integer state (step counters, masks, ...) out of the "
          "tree given to the optimizer.")
    shape = tuple(int(d) for d in jnp.shape(x))
    axis = partitioner(tuple(path), shape, np.dtype(dtype))
    if axis is None:
      plan.append(_Leaf(where, shape, int(np.prod(shape, dtype=np.int64)), False))
      continue
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
      raise TypeError(f"{_NAME}: the partitioner returned {axis!r:.60} for the leaf at {where}; expected an "
                      "axis (int) or None.")
    if not shape:
      raise ValueError(f"{_NAME}: the partitioner split the scalar at {where}; a scalar has no axis to split "
                       "along (return None to keep it whole).")
    normalize_axis(int(axis), len(shape), f"{_NAME} (the leaf at {where})")
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0:
      raise ValueError(f"{_NAME}: the leaf at {where} has no elements {list(shape)}: there is nothing to split "
                       "(return None to keep it whole).")
    plan.append(_Leaf(where, shape, size, True))
  return plan, treedef


class _Split(NamedTuple):
  """How the state is split in this step: ``n`` blocks, this replica's index ``r`` among them (traced), and
  the groups of replicas that split it (hybrid: ``n`` is the group size, ``r`` the position in the group)."""

  n: int
  r: Any
  groups: Groups | None


def _replica_axis(groups: Any = None) -> _Split | None:
  """How the state is split inside `strategy.run` (`groups` resolved on the running strategy's mesh); None
  where no replica axis is bound (the default strategy, whose `run` calls the step itself, or a call
  outside any step)."""
  try:
    n = jax.lax.axis_size(REPLICA_AXIS)
  except NameError:
    return None
  r = jax.lax.axis_index(REPLICA_AXIS)
  if groups is None:
    return _Split(int(n), r, None)
  ctx = context_lib.get_replica_context()
  mesh = None if ctx is None else ctx.strategy.mesh
  if mesh is None or int(mesh.shape[REPLICA_AXIS]) != int(n):
    raise ValueError(f"{_NAME}: groups={groups!r:.100} is resolved on the strategy running the step; call init "
                     "and update inside strategy.run (or experimental_run_steps).")
  resolved = resolve_groups(mesh, groups, _NAME)
  if resolved is None:
    return _Split(int(n), r, None)
  return _Split(len(resolved[0]), jnp.asarray(group_position(resolved), jnp.int32)[r], resolved)


def _rows(x: Any, leaf: _Leaf, n: int) -> jax.Array:
  """`x` flattened and zero-padded to ``[n, b]``: row ``r`` is replica ``r``'s block."""
  b = block_size(leaf.size, n)
  flat = jnp.ravel(x)
  return jnp.pad(flat, (0, n * b - leaf.size)).reshape(n, b)


def _local_block(x: Any, leaf: _Leaf, n: int, r: Any, groups: Groups | None = None) -> LocalShard:
  """This replica's block of a value the same on every replica (no communication)."""
  b = block_size(leaf.size, n)
  flat = jnp.pad(jnp.ravel(x), (0, n * b - leaf.size))
  return LocalShard(jax.lax.dynamic_slice_in_dim(flat, r * b, b), (leaf.size,), 0, groups)


def _by_dtype(indices: list[int], values: list[Any]) -> dict[Any, list[int]]:
  groups: dict[Any, list[int]] = {}
  for i in indices:
    groups.setdefault(jnp.result_type(values[i]), []).append(i)
  return groups


def _widened(x: Any) -> Any:
  """`x` in float32 if it is a 16-bit float (bfloat16, float16): what a sum over replicas adds in."""
  dtype = jnp.result_type(x)
  return x.astype(jnp.float32) if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32 else x


def _scatter_sum(grads: list[Any], plan: list[_Leaf], indices: list[int], n: int,
                 groups: Groups | None = None) -> dict[int, LocalShard]:
  """This replica's block of the sum over replicas of each per-replica gradient in `indices`: one
  reduce-scatter per dtype, over the leaves' padded rows laid side by side (``[n, sum b_i]``); with
  `groups` (``n`` the group size) within the group, then one all-reduce of the block across the groups."""
  out = {}
  for group in _by_dtype(indices, grads).values():
    widths = [block_size(plan[i].size, n) for i in group]
    rows = jnp.concatenate([_rows(grads[i], plan[i], n) for i in group], axis=1)  # [n, B], replica-major
    dtype = rows.dtype
    # 16-bit gradients are summed in float32 (as `mixed_precision.all_reduce_gradients` and
    # `accumulate_gradients` do), then their blocks rounded back once.
    blocks = scatter_sum(_widened(rows).reshape(-1), 0, groups).astype(dtype)  # [B]
    for i, start, width in zip(group, np.cumsum([0] + widths[:-1]), widths):
      out[i] = LocalShard(jax.lax.slice_in_dim(blocks, int(start), int(start) + width), (plan[i].size,), 0, groups)
  return out


def _gather(blocks: list[Any], plan: list[_Leaf], indices: list[int], n: int,
            groups: Groups | None = None) -> dict[int, jax.Array]:
  """Each split leaf's whole value from every replica's block: one all-gather per dtype (typed invariant:
  the same on every replica; with `groups` within the group, whose blocks every group holds alike),
  padding stripped and the leaf's shape restored."""
  out = {}
  for group in _by_dtype(indices, blocks).values():
    widths = [block_size(plan[i].size, n) for i in group]
    local = jnp.concatenate([jnp.ravel(blocks[i]) for i in group])  # [B]
    if groups is None:
      whole = all_gather_invariant(to_varying(local, REPLICA_AXIS), REPLICA_AXIS, axis=0, tiled=True)
    else:
      whole = gather_within_groups(to_varying(local, REPLICA_AXIS), 0, groups)
    whole = whole.reshape(n, -1)  # [n, B]
    for i, start, width in zip(group, np.cumsum([0] + widths[:-1]), widths):
      flat = whole[:, int(start):int(start) + width].reshape(-1)[:plan[i].size]
      out[i] = flat.reshape(plan[i].shape)
  return out


def _check_structure(tree: Any, treedef: Any, what: str, reference: str) -> list[tuple[Any, Any]]:
  pairs, got = _flatten(tree)
  if got != treedef:
    want_paths = [_where(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(treedef, [0] * treedef.num_leaves))[0]]
    got_paths = [_where(p) for p, _ in pairs]
    missing = [p for p in want_paths if p not in got_paths]
    extra = [p for p in got_paths if p not in want_paths]
    detail = "; ".join(([f"missing {', '.join(missing[:5])}"] if missing else []) +
                       ([f"not in the {reference}: {', '.join(extra[:5])}"] if extra else []))
    raise ValueError(
        f"{_NAME}: the {what} do not have the structure of the {reference}"
        f"{' (' + detail + ')' if detail else ''}: {got} vs {treedef}.")
  return pairs


_LAYOUT = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "convert_element_type",
                     "copy", "copy_p", "pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call"})


def _operations(jaxpr: Any) -> dict[tuple[str, str], int]:
  """How many equations of each primitive each caller made in `jaxpr` (calls' bodies included), the
  layout-only primitives left out."""
  found: dict[tuple[str, str], int] = {}

  def walk(j: Any) -> None:
    for eqn in j.eqns:
      body = compat.call_body(eqn)
      if body is not None:
        walk(body[0])
      if eqn.primitive.name not in _LAYOUT:
        key = (eqn.primitive.name, caller(eqn))
        found[key] = found.get(key, 0) + 1

  walk(compat.open_jaxpr(jaxpr)[0])
  return found


def _check_elementwise(tx: Any, g_tree: Any, state: Any, p_tree: Any, plan: list[_Leaf], treedef: Any) -> None:
  """Refuses, before the step runs, a `tx` that is wrong on flat blocks (raised while the step is traced):

  * one that combines a split leaf's elements (a norm, an RMS, a trust ratio: `optax.clip_by_global_norm`,
    `clip_by_block_rms`, ...) without summing over the replicas: its update of a block, or a block of its
    state, is a statistic of this replica's block (`block_statistics`, on the jaxpr of `tx.update`);
  * one whose computation depends on a leaf's shape (a mask ``x.ndim > 1``, factored moments): traced on
    the parameters' own shapes and on the same leaves flattened, it must run the same operations.
  """
  is_block = lambda x: isinstance(x, LocalShard)  # noqa: E731
  nodes = jax.tree.leaves((g_tree, state, p_tree), is_leaf=is_block)
  split = [x.axis if is_block(x) else None for x in nodes]
  flat_args = [x.block if is_block(x) else x for x in nodes]
  tree = jax.tree.structure((g_tree, state, p_tree), is_leaf=is_block)

  def call(*leaves: Any) -> Any:
    g, s, p = jax.tree.unflatten(tree, [LocalShard(v, x.shape, x.axis) if is_block(x) else v
                                        for v, x in zip(leaves, nodes)])
    return jax.tree.leaves(tx.update(g, s, p))

  jaxpr = jax.make_jaxpr(call)(*flat_args)
  mixed = [s for s in mixed_results(compat.open_jaxpr(jaxpr)[0], split) if isinstance(s, Mixed)]
  if mixed:
    raise ValueError(
        f"{_NAME}: tx combines the elements of a split leaf's block without summing over the replicas "
        f"({mixed[0].via}): on this replica's 1/N of the flattened leaf it computes a statistic of the block, "
        "not of the gradient, and each replica would update with its own. For a global-norm clip use "
        "tpustrat.clip_by_global_norm (tpustrat.global_norm sums the blocks' squares over the replicas); keep "
        "leaves whose transform reads a per-leaf statistic (clip_by_block_rms, adafactor, lamb / lars trust "
        "ratios, ...) whole with the partitioner (return None for them); for a finite check (apply_if_finite) "
        "use tpustrat.mixed_precision.all_finite (or LossScaleOptimizer), which agrees it over the replicas; "
        f"see {_NAME}'s docstring.")
  # The same transform on the parameters' own shapes, and on the same values flattened as the blocks are.
  sds = lambda shape, like: jax.ShapeDtypeStruct(shape, jnp.result_type(like))  # noqa: E731
  g_leaves = jax.tree.leaves(g_tree, is_leaf=is_block)
  p_leaves = None if p_tree is None else jax.tree.leaves(p_tree, is_leaf=is_block)
  shaped = [sds(leaf.shape, x.block if is_block(x) else x) for leaf, x in zip(plan, g_leaves)]
  flat = [sds((leaf.size,) if leaf.split else leaf.shape, x.block if is_block(x) else x)
          for leaf, x in zip(plan, g_leaves)]

  def whole_update(leaves: list[Any]) -> Any:
    g = jax.tree.unflatten(treedef, leaves)
    p = None if p_leaves is None else g
    return jax.tree.leaves(tx.update(g, tx.init(g), p))

  on_shapes = _operations(jax.make_jaxpr(whole_update)(shaped))
  on_flat = _operations(jax.make_jaxpr(whole_update)(flat))
  differ = sorted(k for k in set(on_shapes) | set(on_flat) if on_shapes.get(k, 0) != on_flat.get(k, 0))
  if differ:
    (prim, who) = differ[0]
    raise ValueError(
        f"{_NAME}: tx runs other operations on the flattened blocks than on the parameters' own shapes "
        f"(`{prim}` in {who}: {on_shapes.get(differ[0], 0)} on the shapes, {on_flat.get(differ[0], 0)} "
        f"flattened): something in tx is chosen from a leaf's shape or rank, such as a mask "
        "`lambda p: jax.tree.map(lambda x: x.ndim > 1, p)` or factored moments, and a split leaf reaches tx "
        "as a 1-D block. Choose masks from the path (a tree of bools, or "
        "jax.tree_util.tree_map_with_path on the parameters outside the step), or keep those leaves whole "
        f"with the partitioner (return None for them); see {_NAME}'s docstring.")


def _check_group_lists(groups: Any) -> None:
  """Checks explicit groups as far as they can be without a strategy: a list of equal-sized lists of
  distinct replica ids (the rest is checked where the step runs, on its strategy)."""
  try:
    found = [list(g) for g in groups]
    ids = [r for g in found for r in g]
  except TypeError:
    raise TypeError(f"{_NAME}: groups={groups!r:.100} must be 'process', 'slice', a list of lists of replica ids, "
                    "or None.") from None
  if not found or not found[0]:
    raise ValueError(f"{_NAME}: groups={groups!r:.100} must be a non-empty list of non-empty lists of replica ids.")
  if len({len(g) for g in found}) > 1:
    raise ValueError(f"{_NAME}: groups={groups!r:.200} has groups of unequal sizes {[len(g) for g in found]}; every "
                     "group must have the same number of replicas.")
  bad = [r for r in ids if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0]
  if bad:
    raise ValueError(f"{_NAME}: groups={groups!r:.200} holds {bad[0]!r}, not a replica id (an int >= 0).")
  twice = sorted({r for r in ids if ids.count(r) > 1})
  if twice:
    raise ValueError(f"{_NAME}: groups={groups!r:.200} puts replica {twice[0]} in more than one group; each "
                     "replica must be in exactly one group.")


def sharded_optimizer(tx: optax.GradientTransformation,
                      partitioner: Callable[[tuple[Any, ...], tuple[int, ...], Any], Any] | None = None,
                      groups: Any = None) -> optax.GradientTransformation:
  """`tx` with its state and arithmetic split over the replicas, for `Mirrored` parameters (ZeRO-1/2).

  The parameters stay whole on every device (unlike `strategy.experimental_shard`, FSDP / ZeRO-3, where
  each device keeps a block of them and gathers them in every step); the optimizer state of every leaf the
  partitioner splits is held ``1/N`` per device, and each replica runs `tx` on its ``1/N`` of the flattened
  leaf::

    zopt = tpustrat.sharded_optimizer(optax.adamw(1e-3))
    params = strategy.experimental_mirror(params)
    opt_state = strategy.run(zopt.init, args=(params,))   # ShardedVariables (1/N each) and Mirrored

    def step(params, opt_state, batch):
      grads = jax.grad(loss)(tpustrat.local_copy(params), batch)    # per replica, as TF's
      updates, opt_state = zopt.update(grads, opt_state, params)    # summed: one reduce-scatter
      return optax.apply_updates(params, updates), opt_state          # params Mirrored again

  Args:
    tx: the optax transformation to run on the blocks.
    partitioner: which parameter leaves to split, a callable ``(path, shape, dtype) -> axis or None`` as
      for `experimental_shard`; by default `MinSizePartitioner()` (leaves of at least 256 KiB). A leaf
      split here is flattened and cut into ``N`` contiguous blocks of ``ceil(size / N)`` elements, the
      last zero-padded, whatever axis the partitioner names: the axis only means "split" (it is still
      checked to be an axis of the leaf). Leaves it returns None for are optimized whole on every replica.
    groups: hybrid sharding: split the state within each group of replicas and replicate it across the
      groups (``"process"``: one group per process; ``"slice"``: per TPU slice; or lists of replica ids,
      as for `experimental_shard`); None (the default) splits over every replica. Per-replica gradients
      are then reduce-scattered within the group and ``1/S`` of them all-reduced across the groups, and
      the updates all-gathered within the group. Resolved on the strategy that runs the step (an error
      naming the value where the groups are unequal, overlap, miss a replica or do not divide them).

  Returns:
    An `optax.GradientTransformation` whose ``init(params)`` and ``update(grads, state, params=None)`` are
    called inside `strategy.run` (or `experimental_run_steps`):

    * ``init``: `tx.init` on a tree whose split leaves are `LocalShard` s of 1-D values of the leaves'
      sizes (this replica's block) and whose other leaves are whole; `run` returns the state's blocks as
      `ShardedVariable` s of shape ``[size]``, the rest `Mirrored`. Checkpoints save it as any sharded
      state (and re-split it onto another replica count).
    * ``update``: `grads` may be per replica (w.r.t. `tpustrat.local_copy(params)`: TF's gradients;
      summed over the replicas here, SUM as TF's optimizers do) or already summed (w.r.t. the `Mirrored`
      parameters: JAX's gradients, which JAX's backward pass has all-reduced whole; then each replica takes
      its block, no more communication: ZeRO-1 rather than 2), leaf by leaf, as
      JAX types them; never both summing (a per-replica gradient must not be all-reduced first, or it is
      summed twice: differentiate w.r.t. ``local_copy(params)`` *or* all-reduce, not both). Per-replica
      gradients of the split leaves are summed and scattered by one reduce-scatter per dtype, the other
      leaves' by one `psum`. `tx.update` runs on the blocks (and the block of `params`), and the updates
      of the split leaves are all-gathered in one all-gather per dtype: the updates come back whole and
      the same on every replica (typed so: `run` returns what `optax.apply_updates(params, updates)` makes
      of `Mirrored` parameters as `Mirrored`).

    Outside a replica axis (the default strategy, whose `run` calls the step itself) there is one replica
    and nothing to split: `init` and `update` are `tx`'s own.

  Which transforms are right on flat blocks: elementwise ones, whose result for an element depends on that
  element (and on scalars) only: `optax.sgd`, momentum and Nesterov, `adam`, `adamw` (weight decay),
  `adagrad`, `rmsprop`, `lion`, `adabelief`, learning-rate schedules, `optax.masked` / `multi_transform`
  with masks or labels chosen by path (a mask computed from a leaf's shape sees a 1-D block: use the
  path, or the `LocalShard`'s logical ``shape``). Whole-tree statistics must be summed over the replicas:
  use `tpustrat.clip_by_global_norm` (and `tpustrat.global_norm`), not `optax.clip_by_global_norm`, which
  would clip each replica's blocks by their own norm. Not right: transforms that read a leaf's shape or a
  per-leaf statistic, e.g. `adafactor`'s factored second moments, `lamb` / `lars` / `optax.contrib` trust
  ratios (per-leaf norms), `clip` by per-leaf norm, `scale_by_trust_ratio`, Shampoo-like preconditioners.
  These are refused while the step is traced, before it runs (a ValueError naming the operation and the
  optax function that made it): `tx.update` is traced on the blocks and each block followed through it
  (`block_statistics`: a reduction along a block that is not summed over the replicas), and traced again
  on the parameters' own shapes and on the same leaves flattened, which must run the same operations (a
  mask or a choice made from a leaf's shape or rank differs).

  Raises:
    ValueError: `tx` is wrong on flat blocks (above); a parameter (or gradient) is already split (`ShardedVariable` / `LocalShard`: use the
      FSDP path of `experimental_shard` instead) or is a distributed value outside `run`; the gradients'
      structure is not the parameters'; the partitioner splits a scalar, an empty leaf, or names an axis
      the leaf does not have; the state is not the one ``init`` made.
    TypeError: an integer (non-differentiable) leaf; a partitioner answer that is neither an int nor None.

  >>> import optax
  >>> strategy = tpustrat.TPUStrategy()
  >>> zopt = sharded_optimizer(optax.adam(0.1), lambda path, shape, dtype: 0 if len(shape) == 2 else None)
  >>> params = strategy.experimental_mirror({"w": np.ones((5, 3), np.float32), "b": np.zeros(3, np.float32)})
  >>> opt_state = strategy.run(zopt.init, args=(params,))
  >>> opt_state[0].mu["w"], opt_state[0].mu["b"]
  (ShardedVariable(shape=[15], dtype=float32, axis=0, num_replicas=8), Mirrored(...))
  >>> def step(params, opt_state):
  ...   grads = jax.grad(lambda p: jnp.sum(p["w"]) + jnp.sum(p["b"]))(tpustrat.local_copy(params))
  ...   updates, opt_state = zopt.update(grads, opt_state, params)
  ...   return optax.apply_updates(params, updates), opt_state
  >>> params, opt_state = strategy.run(step, args=(params, opt_state))
  >>> print(np.asarray(params["w"].values[0])[0].round(4))   # Adam's first step: -0.1 * sign(grad)
  [0.9 0.9 0.9]
  """
  if not isinstance(tx, optax.GradientTransformation) and not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise TypeError(f"{_NAME}: tx must be an optax.GradientTransformation, got {type(tx).__name__}.")
  partitioner = MinSizePartitioner() if partitioner is None else partitioner
  if not callable(partitioner):
    raise TypeError(f"{_NAME}: partitioner must be callable (path, shape, dtype) -> axis or None, got "
                    f"{partitioner!r:.100}.")
  if groups is not None and not isinstance(groups, str):
    _check_group_lists(groups)

  def blocks_of(params: Any, plan: list[_Leaf], treedef: Any, n: int, r: Any, grouped: Groups | None) -> Any:
    leaves = [x for _, x in _flatten(params)[0]]
    return jax.tree.unflatten(treedef, [_local_block(x, leaf, n, r, grouped) if leaf.split else x
                                        for x, leaf in zip(leaves, plan)])

  def init(params: Any) -> Any:
    plan, treedef = _plan(params, partitioner, "parameter")
    axis = _replica_axis(groups)
    if axis is None:
      return tx.init(params)
    n, r, grouped = axis
    for (_, x), leaf in zip(_flatten(params)[0], plan):
      if REPLICA_AXIS in varying_axes(x):
        raise ValueError(
            f"{_NAME}.init: the parameter at {leaf.where} differs between replicas (a PerReplica value, or "
            "tpustrat.local_copy of one): give init the Mirrored parameters, the same on every replica.")
    return tx.init(blocks_of(params, plan, treedef, n, r, grouped))

  def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    plan, treedef = _plan(grads if params is None else params, partitioner,
                          "gradient" if params is None else "parameter")
    if params is not None:
      grad_pairs = _check_structure(grads, treedef, "gradients", "parameters")
      for (_, g), leaf in zip(grad_pairs, plan):
        _check_not_sharded(leaf.where, g, "gradient")
        dtype = jnp.result_type(g)
        if dtype == jax.dtypes.float0 or not jnp.issubdtype(dtype, jnp.inexact):
          raise TypeError(f"{_NAME}.update: the gradient at {leaf.where} has dtype {dtype}; gradients must be "
                          "floating-point (an integer parameter has no gradient: keep it out of the tree).")
        if tuple(jnp.shape(g)) != leaf.shape:
          raise ValueError(f"{_NAME}.update: the gradient at {leaf.where} has shape {list(jnp.shape(g))}, the "
                           f"parameter {list(leaf.shape)}.")
    axis = _replica_axis(groups)
    if axis is None:
      return tx.update(grads, state, params)
    n, r, grouped = axis
    g_leaves = [x for _, x in _flatten(grads)[0]]
    if params is not None:
      for (_, x), leaf in zip(_flatten(params)[0], plan):
        if REPLICA_AXIS in varying_axes(x):
          raise ValueError(
              f"{_NAME}.update: the parameter at {leaf.where} differs between replicas (a PerReplica value, "
              "or tpustrat.local_copy of one): give update the Mirrored parameters themselves.")
    split = [i for i, leaf in enumerate(plan) if leaf.split]
    per_replica = [i for i in range(len(plan)) if REPLICA_AXIS in varying_axes(g_leaves[i])]
    # Gradients: per-replica ones summed (split leaves reduce-scattered, the others all-reduced in one psum),
    # already-summed ones as they are (split leaves: this replica's block, no communication).
    g_blocks: list[Any] = list(g_leaves)
    scattered = _scatter_sum(g_leaves, plan, [i for i in split if i in per_replica], n, grouped)
    for i in split:
      g_blocks[i] = scattered[i] if i in scattered else _local_block(g_leaves[i], plan[i], n, r, grouped)
    small = [i for i in per_replica if not plan[i].split]
    if small:
      for i, s in zip(small, jax.lax.psum([_widened(g_leaves[i]) for i in small], REPLICA_AXIS)):
        g_blocks[i] = s.astype(jnp.result_type(g_leaves[i]))
    g_tree = jax.tree.unflatten(treedef, g_blocks)
    p_tree = None if params is None else blocks_of(params, plan, treedef, n, r, grouped)
    # The state must be init's for these blocks (a LocalShard's node holds its logical shape): a state made
    # outside run, or for other parameters, would otherwise fail inside tx with a shape error.
    want = jax.tree.structure(jax.eval_shape(tx.init, g_tree if p_tree is None else p_tree))
    got = jax.tree.structure(state)
    if want != got:
      raise ValueError(
          f"{_NAME}.update: the optimizer state is not one this optimizer's init made for these parameters "
          f"(make it with opt_state = strategy.run(zopt.init, args=(params,)) on the same parameters and "
          f"replica count): its structure is {got}, expected {want}.")
    _check_elementwise(tx, g_tree, state, p_tree, plan, treedef)
    updates, state = tx.update(g_tree, state, p_tree)
    u_pairs = _check_structure(updates, treedef, "updates tx returned", "parameters")
    u_leaves = [x for _, x in u_pairs]
    blocks = []
    for i in split:
      u = u_leaves[i]
      b = block_size(plan[i].size, n)
      if not isinstance(u, LocalShard) or tuple(jnp.shape(u.block)) != (b,):
        raise ValueError(
            f"{_NAME}.update: tx returned {u!r:.80} as the update of the split leaf at {plan[i].where}, not a "
            f"block of {b} elements: tx must update the blocks elementwise (see {_NAME}'s docstring).")
      blocks.append(u.block)
    for i, leaf in enumerate(plan):
      if not leaf.split and REPLICA_AXIS in varying_axes(u_leaves[i]):
        raise ValueError(
            f"{_NAME}.update: tx's update of the leaf at {leaf.where} (kept whole) differs between replicas, "
            "although its gradient, state and parameter are the same on every replica: a transform in tx "
            "computed it from a statistic of this replica's blocks only. Use tpustrat.clip_by_global_norm "
            "(tpustrat.global_norm) instead of optax.clip_by_global_norm (optax.tree.norm), and only "
            f"elementwise transforms on split leaves (see {_NAME}'s docstring).")
    whole = dict(zip(split, blocks))
    gathered = _gather([whole.get(i) for i in range(len(plan))], plan, split, n, grouped)
    out = [gathered[i] if i in gathered else u_leaves[i] for i in range(len(plan))]
    return jax.tree.unflatten(treedef, out), state

  return optax.GradientTransformation(init, update)
