"""Padding of partial batches: which rows are real.

XLA compiles static shapes, so every batch of a distributed dataset keeps the per-replica size ``k`` of
the first one; a partial batch is padded at the end, and its `PerReplica` carries how many rows of each
component are real (see `tpustrat._src.values`).

* On the host, the dataset pads with `pad_rows`, `pad_rows_per_replica`, `stack_padded` and `take_rows`
  (into library memory, see `tpustrat._src.host_memory`).
* Inside `strategy.run`, `valid_mask(x)` / `num_valid_examples(x)` say which rows of this replica's part
  of batch `x` are real, and `per_example(tree)` marks outputs whose rows are the batch's examples, so
  that `reduce`, `gather` and `experimental_local_results` skip their padding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpustrat._src import context as context_lib
from tpustrat._src.host_memory import host_empty
from tpustrat._src.jax_compat import varying_axes

__all__ = [
    "batch_of", "fill_rows", "num_valid_examples", "pad_rows", "pad_rows_per_replica", "per_example", "stack_padded", "take_rows",
    "valid_mask",
]


# -- which rows are real (inside `run`) -----------------------------------------------------------


def _first_leaf_rows(x: Any, fn: str) -> int:
  leaves = jax.tree.leaves(x)
  if not leaves or jnp.ndim(leaves[0]) == 0:
    raise ValueError(f"tpustrat.{fn}(x) needs `x` with a batch axis (an array or a batch pytree), got {x!r:.100}.")
  return jnp.shape(leaves[0])[0]


def batch_of(ctx: Any, x: Any, fn: str) -> int | None:
  """The index into ``ctx.real_rows`` of the padded batch that `x` belongs to, or None when `x` is no
  padded batch of this step.

  An array the step received as part of a padded batch is that batch's, whatever its size. Any other
  array (one computed in the step) is the batch's whose per-replica size ``k`` its leading axis has, if
  exactly one padded batch of the step has that size; with several, which batch it came from cannot be
  told from its shape, and `fn` raises instead of guessing.
  """
  leaves = jax.tree.leaves(x)
  found = {ctx.batch_index(leaf) for leaf in leaves} - {None}
  if len(found) > 1:
    names = ", ".join(ctx.batch_names[i] for i in sorted(found))
    raise ValueError(f"tpustrat.{fn}(x): `x` holds arrays of several padded batches ({names}), which may "
                     "have different numbers of real rows; pass one batch (or one of its arrays).")
  if found:
    return found.pop()
  k = _first_leaf_rows(x, fn)
  candidates = [i for i, (size, _) in enumerate(ctx.real_rows) if size == k]
  if len(candidates) > 1:
    names = ", ".join(ctx.batch_names[i] for i in candidates)
    raise ValueError(
        f"tpustrat.{fn}(x): `x` (leading size {k}) is not one of the arrays the step received, and "
        f"several padded batches of this step have per-replica size {k} ({names}), with their own numbers "
        f"of real rows; which one `x` belongs to cannot be told from its size. Pass the batch itself (or "
        f"one of its arrays) to tpustrat.{fn}.")
  return candidates[0] if candidates else None


def _replica_context(fn: str) -> context_lib.ReplicaContext:
  """The current replica context (the default strategy's with no strategy); raises in the cross-replica
  context, where there is no replica and no batch."""
  ctx = context_lib.get_replica_context()
  if ctx is None:
    raise RuntimeError(
        f"tpustrat.{fn} was called in the cross-replica context of {context_lib.get_strategy()!r} (inside "
        "strategy.scope(), outside strategy.run), where there is no replica's batch. Call it inside the "
        "function given to strategy.run.")
  return ctx


def _real_rows(x: Any, fn: str) -> tuple[int, Any]:
  """(padded batch size, this replica's number of real rows) for batch `x` in the current replica."""
  ctx = _replica_context(fn)
  known = ctx.real_rows
  if x is None:
    if len(known) != 1:
      names = ", ".join(ctx.batch_names) if known else "none"
      raise ValueError(
          f"tpustrat.{fn}() without an argument needs exactly one padded batch among the arguments of "
          f"strategy.run, found {len(known)} ({names}); pass the batch (or one of its arrays) to "
          f"tpustrat.{fn}(x).")
    return known[0]
  index = batch_of(ctx, x, fn)
  if index is None:  # not a padded batch of this step: every row is real
    k = _first_leaf_rows(x, fn)
    return k, k
  return known[index]


def num_valid_examples(x: Any = None) -> jax.Array:
  """The number of real (not padding) rows of this replica's part of a batch, inside `strategy.run`.

  Batches from a distributed dataset always have the same per-replica size ``k``; the last, partial
  batch is padded at the end. This returns an int32 scalar (traced inside `run`, different on each
  replica): ``k`` for full batches, fewer (possibly 0) for padding.

  Args:
    x: the batch, or any array of it with the batch on its leading axis. May be omitted when `run`
      received exactly one padded batch size. An `x` whose leading size is not that of a padded
      batch of this step counts as all real.

  Outside `run` (or with the default strategy) every row is real:

  >>> int(num_valid_examples(np.zeros((5, 3))))
  5
  """
  k, count = _real_rows(x, "num_valid_examples")
  return jnp.asarray(count, jnp.int32)


def valid_mask(x: Any = None) -> jax.Array:
  """A bool ``[k]`` mask, True for the real rows of this replica's part of a batch (inside `run`).

  Use it to keep padding out of losses and metrics on partial batches, for example
  ``jnp.sum(jnp.where(tpustrat.valid_mask(x), per_example_loss, 0)) / global_batch_size``. The
  library's own `strategy.reduce` / `gather` skip padding along ``axis=0`` of `run`'s outputs, and
  everywhere in outputs marked with `per_example`.

  Args:
    x: as for `num_valid_examples`.

  >>> print(valid_mask(np.zeros((3, 2))))
  [ True  True  True]
  """
  k, count = _real_rows(x, "valid_mask")
  return jnp.arange(k) < count


def per_example(tree: Any, *, batch: Any = None) -> Any:
  """Marks arrays returned by a `strategy.run` step as per-example: their rows are the batch's rows.

  A partial global batch reaches the replicas padded to the usual per-replica size ``k``. Returning
  ``tpustrat.per_example(x)`` says that the rows of ``x`` are that batch's examples, so its padding rows
  are skipped wherever the value goes: `experimental_local_results` shows only the real rows,
  `strategy.reduce` leaves padding out along every ``axis`` (``None`` included), `strategy.gather`
  returns only the real rows, and the value enters the next `run` as a padded batch (`valid_mask`
  works on it). An unmarked output whose axis 0 the step's program shows to hold one padded batch's rows
  skips the padding where axis 0 is the batch (``reduce(op, v, axis=0)``, ``gather(v, axis=0)``) and in
  `experimental_local_results` (TF's replicas held only their real rows); other unmarked outputs are
  kept whole, as the replicas returned them (see `strategy.run`).

  Which batch's padding: the batch given as `batch`; else the batch whose rows the array's axis 0 holds,
  traced through the step's program (per-example logits of batch ``b`` are ``b``'s, whatever other
  batches of the same size the step received); else the only padded batch of the step with that size.

  Args:
    tree: an array or a pytree of arrays computed inside the step; every leaf has the padded batch's
      per-replica size ``k`` on its leading axis and differs between replicas. Mark the arrays that the
      step returns (the mark belongs to the array object: an array computed from a marked one is not
      marked).
    batch: optional: the padded batch (as the step received it, or one of its arrays) whose rows
      `tree`'s rows are. Needed only when the step received several padded batches of one size and the
      rows cannot be traced to one of them.

  Returns:
    `tree` itself. Outside `run`, and in a step with no padded batch among its arguments, nothing is
    marked (every row is real there).

  Raises:
    ValueError: a leaf is a scalar, has another leading size than its batch (or than every padded batch
      of the step), or is the same on every replica (it cannot hold one replica's examples); `batch` is
      not a padded batch of the step; or (when `run` finishes tracing the step) the rows of a leaf cannot
      be traced to one batch among several of its size and `batch` was not given.

  >>> tree = {"logits": np.zeros((4, 10))}
  >>> tpustrat.per_example(tree) is tree   # outside run: nothing to mark
  True
  """
  ctx = _replica_context("per_example")
  known = ctx.real_rows
  if not known:
    return tree
  sizes = [k for k, _ in known]
  given = None
  if batch is not None:
    found = {i for leaf in jax.tree.leaves(batch) if (i := ctx.batch_index(leaf)) is not None}
    if len(found) > 1:
      raise ValueError("tpustrat.per_example(tree, batch=...): `batch` holds arrays of several padded batches "
                       f"({', '.join(ctx.batch_names[i] for i in sorted(found))}); pass one.")
    given = found.pop() if found else None
    if given is None:
      raise ValueError(
          "tpustrat.per_example(tree, batch=...): `batch` is not one of the padded batches this step "
          f"received ({', '.join(ctx.batch_names)}); pass the batch argument itself, or one of its arrays.")
  axis = context_lib.replica_axis(ctx)
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    where = jax.tree_util.keystr(path) or "<root>"
    if jnp.ndim(x) == 0:
      raise ValueError(f"tpustrat.per_example: the value at {where} is a scalar; a per-example array has the "
                       f"batch on its leading axis (per-replica size {sizes[0]}).")
    k = jnp.shape(x)[0]
    if given is not None and k != sizes[given]:
      raise ValueError(
          f"tpustrat.per_example: the array at {where} has leading size {k}, but the batch given as `batch` "
          f"({ctx.batch_names[given]}) has per-replica size {sizes[given]}.")
    if k not in sizes:
      raise ValueError(
          f"tpustrat.per_example: the array at {where} has leading size {k}, but the padded batches of this "
          f"step have per-replica sizes {sorted(set(sizes))}; only arrays whose rows are a batch's rows "
          "can be marked.")
    if axis is not None and axis not in varying_axes(x):
      raise ValueError(
          f"tpustrat.per_example: the array at {where} is the same on every replica (it does not vary over "
          f"the replica axis {axis!r}), so its rows cannot be one replica's examples. Mark the per-replica "
          "array before it is combined across replicas.")
    index = given if given is not None else ctx.batch_index(x)
    if index is None and sizes.count(k) == 1:
      index = sizes.index(k)
    ctx.per_example_marks.append((x, index))  # None: `run` traces the rows to their batch
  return tree


# -- padding on the host --------------------------------------------------------------------------


def pad_rows(x: np.ndarray, rows: int, first_row: bool) -> np.ndarray:
  """`x` with rows added up to `rows`: zeros, or (`first_row`, when `x` has a row) copies of its first row."""
  if x.shape[0] == rows:
    return x
  out = host_empty((rows,) + x.shape[1:], x.dtype)
  out[:x.shape[0]] = x
  out[x.shape[0]:] = x[0] if first_row and x.shape[0] else 0
  return out


def pad_rows_per_replica(x: np.ndarray, k: int) -> np.ndarray:
  """``[n, k, ...]`` from ``[n, k0, ...]`` (k0 <= k), zero-padded."""
  out = host_empty((x.shape[0], k) + x.shape[2:], x.dtype)
  out[:, :x.shape[1]] = x
  out[:, x.shape[1]:] = 0
  return out


def fill_rows(x: np.ndarray, counts: np.ndarray, row: np.ndarray | None = None) -> np.ndarray:
  """Sets, in place, the padding rows of ``[n, k, ...]`` per-replica parts (replica `j` has ``counts[j]`` real
  rows) to a real row (`InputOptions.experimental_padding`): `row` (a global batch's first row) for every
  replica; or, without it (per-replica batches), replica `j`'s own first row, and for a replica without
  rows the first row of the first replica that has one (rows stay zero when none has)."""
  own = row is None
  if own:
    donor = next((j for j, c in enumerate(counts) if c > 0), None)
    if donor is None:
      return x
    row = x[donor, 0]
  for j, c in enumerate(counts):
    if c < x.shape[1]:
      x[j, c:] = x[j, 0] if own and c > 0 else row
  return x


def take_rows(x: np.ndarray, rows: list[int]) -> np.ndarray:
  """``x[rows]``, into library memory."""
  out = host_empty((len(rows),) + x.shape[1:], x.dtype)
  np.take(x, rows, axis=0, out=out)
  return out


def stack_padded(parts: list[np.ndarray], n: int, k: int) -> np.ndarray:
  """``[n, k, ...]`` from up to `n` per-replica batches of at most `k` rows, zero-padded."""
  out = host_empty((n, k) + parts[0].shape[1:], parts[0].dtype)
  for i, p in enumerate(parts):
    out[i, :p.shape[0]] = p
    out[i, p.shape[0]:] = 0
  out[len(parts):] = 0
  return out
