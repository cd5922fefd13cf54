"""The stacked-steps layout: ``k`` steps of values as one pytree, every array with a leading steps axis.

This is JAX's usual stacked-pytree convention, which `lax.scan` slices and stacks. A `PerReplica` leaf
``[num_replicas, ...]`` becomes ``[k, num_replicas, ...]``, split over its *second* axis
(``P(None, 'replica')``), so that step ``i`` is the ordinary `PerReplica` that `lax.scan` hands to its
body without moving data between devices; the real-row counts of padded batches become
``[k, num_replicas]``, so partial batches stay exact. A `Mirrored` leaf becomes a replicated ``[k, ...]``
array.

* `stack_steps` / `unstack_steps` (public) convert between a list of per-step values and the layout.
* `concat_chunks` / `cut_chunk` join and split groups of steps (the input pipeline's `take_steps`).
* `num_steps` and `check_not_stacked` check values against the layout; `named_leaves` names the arrays
  of a value for error messages.

Arrays on the host are joined and split with numpy, those on the devices with one jitted call.
"""

from __future__ import annotations

import collections.abc
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpustrat._src.values import PerReplica, is_distributed, name_replica_axis, stacked_steps

__all__ = ["check_not_stacked", "concat_chunks", "cut_chunk", "named_leaves", "num_steps", "stack_steps",
           "unstack_steps"]


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
  """(readable path, array) for every array of `tree`; a padded batch's counts are named as such."""
  out = []
  for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)[0]:
    name = jax.tree_util.keystr(path) or "<root>"
    if not is_distributed(node):
      out.append((name, node))
      continue
    inner = jax.tree_util.tree_flatten_with_path(node.tree)[0]
    out.extend((name + jax.tree_util.keystr(p), x) for p, x in inner)
    if isinstance(node, PerReplica) and node.real_rows_array is not None:
      out.append((f"{name} (real-row counts)", node.real_rows_array))
  return out


def num_steps(stacked: Any, what: str) -> int:
  """The common leading (steps) size of every array of `stacked`, or a clear error."""
  sizes0 = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(stacked)}
  if len(sizes0) == 1:
    (size0,) = sizes0
    if size0 is not None:
      return size0
  named = named_leaves(stacked)
  if not named:
    raise ValueError(f"{what}: the stacked batches hold no arrays ({stacked!r:.100}).")
  sizes = {}
  for name, x in named:
    shape = np.shape(x)
    if not shape:
      raise ValueError(
          f"{what}: the leaf at {name} is a scalar; stacked batches carry the steps on the leading axis "
          "of every array.")
    sizes[name] = shape[0]
  if len(set(sizes.values())) != 1:
    detail = ", ".join(f"{name}: {size}" for name, size in sizes.items())
    raise ValueError(
        f"{what}: a stacked batch must have the same number of steps on the leading axis of every leaf, "
        f"got {detail}. Stack whole steps (tpustrat.stack_steps, DistributedIterator.take_steps).")
  return next(iter(sizes.values()))


def check_not_stacked(value: Any, what: str) -> None:
  """Raises if `value` holds a `PerReplica` laid out as stacked steps (for host-side reduce/gather)."""
  for node in jax.tree.leaves(value, is_leaf=is_distributed):
    if isinstance(node, PerReplica):
      leaves = jax.tree.leaves(node.tree)
      k = stacked_steps(leaves[0]) if leaves else None
      if k is not None:
        raise ValueError(
            f"{what}: the PerReplica value {node!r} holds {k} stacked steps ([steps, num_replicas, ...]), "
            "as experimental_run_steps and take_steps return them. Take the steps apart first: "
            "tpustrat.unstack_steps(value)[i] is step i as strategy.run returns it.")


# -- stacking and unstacking steps -----------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=1)
def _concat_device(columns: list[list[Any]], singles: tuple[bool, ...]) -> list[Any]:
  """Per leaf, the parts concatenated on a leading steps axis (single steps get a new axis)."""
  return [jnp.concatenate([x[None] if s else x for x, s in zip(col, singles)]) for col in columns]


@jax.jit
def _split_device(leaves: list[Any]) -> list[list[Any]]:
  return [list(x) for x in leaves]


@functools.partial(jax.jit, static_argnums=1)
def _cut_device(leaves: list[Any], m: int) -> tuple[list[Any], list[Any]]:
  return [x[:m] for x in leaves], [x[m:] for x in leaves]


def _per_place(items: list[Any], host: Callable[[Any], Any], device: Callable[[list[Any]], Sequence[Any]]) -> list[Any]:
  """`host(item)` for the items on the host (numpy arrays, or lists of them), one jitted `device(items)`
  call for all the others."""
  out = list(items)
  moved = []
  for j, x in enumerate(items):
    if all(isinstance(y, (np.ndarray, np.generic)) for y in (x if isinstance(x, list) else [x])):
      out[j] = host(x)
    else:
      moved.append(j)
  if moved:
    for j, y in zip(moved, device([items[j] for j in moved])):
      out[j] = y
  return out


def concat_chunks(chunks: Sequence[tuple[Any, int | None]], what: str) -> Any:
  """Concatenates chunks on a new leading steps axis: ``(tree, None)`` is one step, ``(tree, n)`` n stacked
  steps. Every chunk must have one step's structure, shapes and dtypes."""
  tree0, n0 = chunks[0]
  leaves0, treedef = jax.tree.flatten(tree0)
  names = [name for name, _ in named_leaves(tree0)]
  step_shapes = [(np.shape(x) if n0 is None else np.shape(x)[1:], jnp.result_type(x)) for x in leaves0]
  columns: list[list[Any]] = [[] for _ in leaves0]
  for i, (tree, n) in enumerate(chunks):
    leaves, tdef = jax.tree.flatten(tree)
    if tdef != treedef:
      raise ValueError(
          f"{what}: step {i} has tree structure {tdef}, but step 0 has {treedef}; stacked steps must share "
          "one structure (including which PerReplica values are padded batches).")
    for j, x in enumerate(leaves):
      got = (np.shape(x) if n is None else np.shape(x)[1:], jnp.result_type(x))
      if got != step_shapes[j]:
        name = names[j] if len(names) == len(leaves0) else f"leaf {j}"
        raise ValueError(
            f"{what}: steps must have the same shapes and dtypes to be stacked, but the leaf at {name} is "
            f"{got[1]}{list(got[0])} in step {i} and {step_shapes[j][1]}{list(step_shapes[j][0])} in step 0.")
      columns[j].append(x)
  singles = tuple(n is None for _, n in chunks)
  out = _per_place(columns,
                   lambda col: np.concatenate([np.asarray(x)[None] if s else x for x, s in zip(col, singles)]),
                   lambda cols: _concat_device(cols, singles))
  # One replica: the program returns the steps without 'replica' on their second axis (see stacked_steps).
  return name_replica_axis(jax.tree.unflatten(treedef, out), steps=True)


def cut_chunk(tree: Any, m: int) -> tuple[Any, Any]:
  """Splits stacked steps into the first `m` steps and the rest (both stacked)."""
  leaves, treedef = jax.tree.flatten(tree)
  cut = _per_place(leaves, lambda x: (x[:m], x[m:]),
                   lambda xs: list(zip(*_cut_device(xs, m))))
  first, rest = [a for a, _ in cut], [b for _, b in cut]
  return (name_replica_axis(jax.tree.unflatten(treedef, first), steps=True),
          name_replica_axis(jax.tree.unflatten(treedef, rest), steps=True))


def stack_steps(values: Sequence[Any]) -> Any:
  """Stacks per-step values (batches, or results of `strategy.run`) on a new leading steps axis.

  The result is what `DistributedIterator.take_steps` returns and what a `lax.scan` over
  `strategy.run` takes (and gives back): the pytree of one step, every array with a leading steps axis.
  A `PerReplica` leaf ``[num_replicas, ...]`` becomes ``[steps, num_replicas, ...]``, still split over
  the replicas (on its second axis); real-row counts of padded batches are stacked too.

  >>> strategy = tpustrat.TPUStrategy()
  >>> one = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(3, np.float32))
  >>> stacked = stack_steps([one, one, one, one])
  >>> stacked
  PerReplica(steps=4, num_replicas=8, component=float32[3])
  >>> len(unstack_steps(stacked)), unstack_steps(stacked)[0]
  (4, PerReplica(num_replicas=8, component=float32[3]))

  Args:
    values: a non-empty sequence of pytrees with one structure, shapes and dtypes.

  Returns:
    The stacked pytree, on the devices where the steps were.

  Raises:
    ValueError: if the steps differ in structure, shape or dtype.
  """
  what = "tpustrat.stack_steps"
  if isinstance(values, (str, bytes)) or not isinstance(values, collections.abc.Sequence) or not values:
    raise TypeError(f"{what} expects a non-empty list of per-step values, got {type(values).__name__}: "
                    f"{values!r:.100}.")
  return concat_chunks([(v, None) for v in values], what)


def unstack_steps(stacked: Any) -> tuple[Any, ...]:
  """Splits stacked steps into a tuple of per-step values, each as `strategy.run` returns (or takes) it.

  The inverse of `stack_steps`: step ``i`` of the per-step outputs of `experimental_run_steps` (or of a
  `lax.scan` over `strategy.run`) is ``unstack_steps(outputs)[i]``, ready for `strategy.reduce`,
  `strategy.gather` and `experimental_local_results` (padding rows of partial batches still excluded).

  >>> strategy = tpustrat.TPUStrategy()
  >>> steps = unstack_steps({"loss": tpustrat.Mirrored(jnp.arange(3.0))})
  >>> [float(s["loss"].values[0]) for s in steps]
  [0.0, 1.0, 2.0]

  Raises:
    ValueError: if the arrays do not all have the same leading (steps) size.
  """
  k = num_steps(stacked, "tpustrat.unstack_steps")
  leaves, treedef = jax.tree.flatten(stacked)
  parts = _per_place(leaves, lambda x: [x[i] for i in range(k)], _split_device)
  return tuple(name_replica_axis(jax.tree.unflatten(treedef, [p[i] for p in parts]), steps=False)
               for i in range(k))
