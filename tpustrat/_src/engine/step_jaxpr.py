"""`StepJaxpr`: the step function traced once to a jaxpr, read, and evaluated into `run`'s program.

A step on padded batches or sharded values (`LocalShard` blocks) is traced to a jaxpr on the arguments it
sees in the body of `run`'s `shard_map`, in a replica context of its own, and then evaluated into the
body: `fn` is still traced once. Read off the jaxpr:

* `rows`: which outputs hold which padded batch's rows on which axis (`batch_rows.leading_rows`), used by
  `output_padding` and by `ReplicaContext.padding_count`'s questions (answered in a second trace);
* `check_block_statistics`: an error if a block the step returns was computed from a statistic of one
  replica's block alone (`block_statistics`: `optax.clip_by_global_norm` on the blocks);
* `padding_reads_message`: the `PaddingReadWarning` for an output summed over a batch's padding rows.

Also here, shared with `program`: what a step may return (`is_output_node`, `as_output_array`), the
readable paths of a result's leaves (`leaf_paths`), and the warning for an array whose padded batch could
not be told inside a nested trace (`warn_unresolved`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tpustrat._src import context as context_lib
from tpustrat._src.batch_rows import BatchRowsWarning, Rows, leading_rows
from tpustrat._src.block_statistics import Mixed, caller, mixed_results
from tpustrat._src.jax_compat import eval_closed_jaxpr, open_jaxpr, same_trace
from tpustrat._src.padding_reads import Value, padding_reads
from tpustrat._src.sharded_variable import LocalShard
from tpustrat._src.values import is_distributed

__all__ = ["StepJaxpr", "as_output_array", "is_output_node", "leaf_paths", "warn_unresolved"]


def is_output_node(x: Any) -> bool:
  """What a step's result is flattened down to: distributed values (an error) and sharded blocks stay whole."""
  return is_distributed(x) or isinstance(x, LocalShard)


def as_output_array(x: Any, path: str) -> Any:
  """A leaf of the step's result as an output of the program: a sharded block stays one, arrays and Python
  numbers become arrays; a distributed value or anything else is a TypeError naming its `path`."""
  if isinstance(x, LocalShard):
    return x
  if is_distributed(x):
    raise TypeError(
        f"strategy.run: the function returned a {type(x).__name__} at {path}; distributed values "
        "(PerReplica, Mirrored) are cross-replica objects that cannot be returned from the replica "
        "function: return the arrays instead (run wraps its results as PerReplica or Mirrored).")
  if isinstance(x, (jax.Array, int, float, complex, bool)) or hasattr(x, "__jax_array__") or (
      hasattr(x, "dtype") and hasattr(x, "shape")):
    return jnp.asarray(x)
  raise TypeError(
      f"strategy.run: the function returned {type(x).__name__} {x!r:.100} at {path}; results must be "
      "arrays, Python numbers or pytrees of them.")


def leaf_paths(treedef: Any) -> list[str]:
  """Human-readable paths of the leaves of `treedef`, for error messages."""
  dummy = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
  return [jax.tree_util.keystr(p) or "<root>"
          for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def warn_unresolved(unresolved: list[str]) -> None:
  """A `BatchRowsWarning` for each array whose padded batch `ReplicaContext.padding_count` could not tell:
  one of a nested trace with the size of several padded batches."""
  for what in dict.fromkeys(unresolved):
    warnings.warn(
        f"strategy.run: {what}, computed inside a nested trace of the step (a jax.jit, jax.checkpoint, cond, "
        "scan or vmap), has the per-replica size of several padded batches, so which padding rows are its "
        "own cannot be told; none is left out: mask them yourself (tpustrat.valid_mask(batch)).",
        BatchRowsWarning, stacklevel=4)


class StepJaxpr:
  """`fn` traced to a jaxpr on the arguments it sees in the body of `run`'s `shard_map` (`nodes`; the
  arrays of each padded batch in `batch_leaves`, with its per-replica size and this replica's real rows),
  in a replica context of its own: `rows` says which outputs hold which batch's rows (`batch_rows`),
  `evaluate()` emits the step into the current trace."""

  def __init__(self, fn: Callable[..., Any], nodes: list[Any], outer: Any,
               batch_leaves: list[tuple[int, list[Any]]], sizes: list[int], counts: list[Any],
               names: tuple[str, ...], make_context: Callable[..., Any], *, quiet: bool = False) -> None:
    leaves, treedef = jax.tree.flatten(nodes)
    batch_at = {id(x): b for b, xs in batch_leaves for x in xs}
    labels = [Rows.of({batch_at[id(x)]}) if id(x) in batch_at else Rows.NONE for x in leaves]
    where = [(i, batch_at[id(x)]) for i, x in enumerate(leaves) if id(x) in batch_at]
    num = len(leaves)

    queries: list[tuple[Any, str, bool]] = []
    unresolved: list[str] = []

    def flat_fn(*flat: Any, answers: list[tuple[int, ...] | None] | None = None) -> list[Any]:
      ctx = make_context(list(zip(sizes, flat[num:])))
      ctx.batch_names = names
      ctx.row_answers = answers
      ctx.step_probe = flat[0] if flat else None
      for i, b in where:
        ctx.note_batch_leaves([flat[i]], b)
      args, kwargs = jax.tree.unflatten(outer, jax.tree.unflatten(treedef, list(flat[:num])))
      with context_lib.enter_replica_context(ctx), warnings.catch_warnings():
        if quiet:  # a second trace: the step's own has said what it had to say
          warnings.simplefilter("ignore")
        out = fn(*args, **kwargs)
      # Distributed values stay whole here, so that returning one is reported by name.
      out_leaves, self.tree = jax.tree.flatten(out, is_leaf=is_output_node)
      self.paths = leaf_paths(self.tree)
      self.shards = [(x.shape, x.axis, x.groups) if isinstance(x, LocalShard) else None for x in out_leaves]
      # `tpustrat.per_example` marks arrays by identity: resolved to output positions here.
      self.marked = {i: j for i, x in enumerate(out_leaves) for m, j in ctx.per_example_marks if x is m}
      results = [x.block if isinstance(x, LocalShard) else as_output_array(x, p)
                 for x, p in zip(out_leaves, self.paths)]
      if answers is None:
        unresolved.extend(ctx.unresolved)
      if answers is None and ctx.row_queries:  # traced once more to follow them (`ReplicaContext.padding_count`)
        # Only values of this program can be followed (not one traced inside a loop body or a vmap).
        queries[:] = [(x, what, bool(flat) and same_trace(x, flat[0])) for x, what in ctx.row_queries]
        results += [jnp.asarray(x) for x, _, here in queries if here]
      return results

    self._args = [*leaves, *counts]
    self._unresolved = unresolved
    in_rows = labels + [Rows.NONE] * len(counts)
    self._batch_labels, self._names = labels, names
    self._jaxpr, self._consts = open_jaxpr(jax.make_jaxpr(flat_fn)(*self._args))
    self.rows = leading_rows(self._jaxpr, in_rows)
    if not quiet:
      warn_unresolved(unresolved)
    if queries and not quiet:
      # Arrays computed in the step whose padded batch library code asked for: their rows, traced here,
      # answer the question in a second trace, whose program is the one that runs.
      followed = iter(self.rows[len(self.rows) - sum(here for *_, here in queries):])
      answers = [self._answer(next(followed) if here else Rows.unknown("a loop or vmap around it"), x, what, sizes,
                              names) for x, what, here in queries]
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first trace has said what it had to say
        self._jaxpr, self._consts = open_jaxpr(jax.make_jaxpr(functools.partial(flat_fn, answers=answers))(*self._args))
      self.rows = leading_rows(self._jaxpr, in_rows)
    # The split axis of each input leaf that is a block of a sharded value (`LocalShard`).
    self._split = [x.axis if isinstance(x, LocalShard) else None
                   for x in jax.tree.leaves(nodes, is_leaf=lambda x: isinstance(x, LocalShard))]
    self._split += [None] * len(counts)

  def padding_reads_message(self, zero_padded: set[int], replicas: int) -> str | None:
    """The `PaddingReadWarning` message naming the outputs that read a padded batch's padding rows (a sum
    over its rows that no mask cleared, a per-replica mean, a reduction over the rows paired with the
    rows: `padding_reads`), and the fix, and the operations the analysis could not follow before a sum;
    None where there is nothing to say. `zero_padded`: the batches whose padding rows are zeros
    (`InputOptions.experimental_padding`); the others' are copies of real rows, or a step's outputs."""
    if not self._batch_labels or not any(r.batches for r in self._batch_labels):
      return None
    inputs = [Value(rows=r, zero=r.batches <= zero_padded) if r.batches else Value() for r in self._batch_labels]
    inputs += [Value(mask=True)] * (len(self._split) - len(self._batch_labels))
    unfollowed: set[str] = set()
    found = [(p, v.read) for p, v in zip(self.paths, padding_reads(self._jaxpr, inputs, replicas, unfollowed))
             if v.read is not None]
    lost = (f" Sums over values whose rows passed through {', '.join(f'`{u}`' for u in sorted(unfollowed))} "
            "were not checked (the analysis does not follow the rows through them): if they sum a batch's rows, "
            "mask them the same way.") if unfollowed else ""
    if not found:
      return f"strategy.run: on a partial batch this step's padding rows were not checked everywhere.{lost}" \
          if lost else None
    eqn, batches, how = found[0][1]
    zeros = ("" if batches <= zero_padded else " A step that masks with a column of the dataset (a mask or a weight "
             "that is 0 on the padding rows) needs tpustrat.InputOptions(experimental_padding=\"zeros\"): by "
             "default the padding rows are copies of the batch's first row.")
    where = ", ".join(p for p, _ in found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
    what = {
        "sum": "a sum over the rows of the padded batch {b} that includes its padding rows",
        "running": "a running sum along the rows of the padded batch {b}, taken past its real rows",
        "mean": "a mean over the rows of the padded batch {b} whose denominator counts its padding rows (TF's "
                "per-replica mean divides by the replica's real rows)",
        "cross": "a reduction over the rows of the padded batch {b} paired with its rows (`z @ z.T`), padding "
                 "rows included",
    }[how].format(b=" and ".join(self._names[b] for b in sorted(batches)))
    return (
        f"strategy.run: the output{'s' if len(found) > 1 else ''} at {where} "
        f"{'are' if len(found) > 1 else 'is'} computed from {what} (`{eqn.primitive.name}` in {caller(eqn)}): "
        "on a partial batch the padding examples (the rows the dataset adds; TF hands a replica only its real "
        "rows, so TF code never masks) count as examples and are trained on. Scale the per-example loss with "
        "tpustrat.compute_average_loss(per_example_loss, global_batch_size=...), which leaves them out, or "
        "mask it with jnp.where(tpustrat.valid_mask(batch), per_example_loss, 0) and divide by the global "
        f"batch size.{lost}{zeros}")

  @staticmethod
  def _answer(r: Rows, x: Any, what: str, sizes: list[int], names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The padded batches whose rows `x` (asked about by `what`) holds on axis 0, row for row, from its
    traced rows: one batch, or several combined row by row (features and labels passed apart), whose
    rows are real where they are real in all of them."""
    if (not r.is_unknown and r.batches and r.axis == 0
        and all(sizes[b] == x.shape[0] for b in r.batches)):
      return tuple(sorted(r.batches))
    if r.carries_rows:
      how = (f"they pass through `{r.unknown_via}`, whose effect on axis 0 is not traced" if r.is_unknown
             else f"they are on its axis {r.axis}, or have another batch's size")
      warnings.warn(
          f"strategy.run: {what} ({x.dtype}{list(x.shape)}): axis 0 has the per-replica size of a padded batch, "
          f"but its rows cannot be traced to one batch: {how}. Its padding rows cannot be told from real ones, "
          "so none is left out: mask them yourself (tpustrat.valid_mask(batch)).", BatchRowsWarning, stacklevel=4)
    return None

  def check_block_statistics(self) -> None:
    """A ValueError, while the step is traced, if a block the step returns (a `LocalShard`: new sharded
    parameters or optimizer state) was computed from a statistic of one replica's block of a split input
    (`block_statistics`): e.g. `optax.clip_by_global_norm` on the blocks of `experimental_shard`'s
    parameters, which would clip each replica's block by its own norm."""
    if not any(a is not None for a in self._split) or not any(sh is not None for sh in self.shards):
      return
    states = mixed_results(self._jaxpr, self._split)
    bad = [(p, s) for p, s, sh in zip(self.paths, states, self.shards) if sh is not None and isinstance(s, Mixed)]
    if bad:
      where = ", ".join(p for p, _ in bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")
      raise ValueError(
          f"strategy.run: the sharded output{'s' if len(bad) > 1 else ''} at {where} "
          f"{'are' if len(bad) > 1 else 'is'} computed from a statistic of this replica's block alone "
          f"({bad[0][1].via}), not of the whole value: each replica would use its own, and the result would "
          "depend on how the value is split. A norm over sharded leaves is tpustrat.global_norm (and "
          "optax.clip_by_global_norm's replacement tpustrat.clip_by_global_norm), which sums the blocks' "
          "squares over the replicas; a statistic of one leaf (clip_by_block_rms, trust ratios, adafactor) "
          "needs the leaf whole: read it with read_value(), or keep it out of experimental_shard's partitioner; a "
          "finite check (optax.apply_if_finite) is tpustrat.mixed_precision.all_finite, agreed over the replicas.")

  def evaluate(self) -> list[Any]:
    """The step's output leaves, emitted into the current trace (blocks as `LocalShard`s again)."""
    out = eval_closed_jaxpr(self._jaxpr, self._consts, self._args)
    return [jnp.asarray(x) if sh is None else LocalShard(x, *sh) for x, sh in zip(out, self.shards)]
