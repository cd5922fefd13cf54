"""Padding on a step's outputs: which outputs carry a padded batch's rows, and the padding-read warning.

A padded batch (from the input pipeline, or an output marked with `tpustrat.per_example`) enters `run`
with its per-replica real-row counts. On the way out, `output_padding` says for each output leaf whether
it is a padded batch again: ``(batch, True)`` for an output `fn` marked `per_example` (its padding is
skipped everywhere), ``(batch, False)`` for an unmarked varying output whose axis 0 the step's jaxpr shows
to hold that batch's rows (`batch_rows`: traced, never read off a size; its counts are used along axis 0
only: ``reduce(op, v, axis=0)``, ``gather(v, axis=0)`` and the per-replica view, `experimental_local_results`
/ `PerReplica.values`, which holds each replica's real rows as TF's replicas did), None for the rest. An
output that only has a padded batch's size, its rows not traced, is warned about (`BatchRowsWarning`).

The padding-read warning (`PaddingReadWarning`: an output is a sum over a padded batch's rows that no mask
removed, `padding_reads`) is found when the step is traced (`step_jaxpr.StepJaxpr.padding_reads_message`)
and said at the first call whose batch is partial (`warn_padding_reads`): a dataset whose batches are all
full never pads. A `run` traced inside `experimental_run_steps` leaves it to the enclosing program,
which keeps it per signature of its own (`inner_padding_notes`, `note_stacked_padding_reads`,
`warn_padding_reads_stacked`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from tpustrat._src.batch_rows import BatchRowsWarning, Rows
from tpustrat._src.padding_reads import PaddingReadWarning
from tpustrat._src.step_stats import jax_dirs, user_stacklevel
from tpustrat._src.values import PerReplica, is_distributed

__all__ = ["inner_padding_notes", "note_stacked_padding_reads", "output_padding", "stacked_signature",
           "warn_padding_reads", "warn_padding_reads_stacked"]


def output_padding(out_leaves: list[Any], paths: list[str], is_varying: list[bool],
                    marked: dict[int, int | None], sizes: list[int], names: tuple[str, ...],
                    rows: list[Rows] | Callable[[], list[Rows]], guessed: set[int] | None = None) -> list[Any]:
  """For each output leaf: None (whole), ``(batch, True)`` (marked per-example: its padding skipped
  everywhere) or ``(batch, False)`` (axis 0 holds that batch's rows: skipped along ``axis=0`` and in the
  local results).
  `rows`: the `Rows` of every output, or a function that traces them when first needed. The positions of
  outputs whose batch is only assumed from their size (their rows were not traced) go into `guessed`."""
  traced: list[list[Rows]] = []  # the rows, once known

  def rows_of(i: int) -> Rows:
    if not traced:
      traced.append(rows() if callable(rows) else rows)
    return traced[0][i]

  def describe(r: Rows) -> str:
    if r.is_unknown:
      return f"they pass through `{r.unknown_via}`, whose effect on axis 0 is not traced"
    return "it combines, row by row, the rows of " + " and ".join(names[b] for b in sorted(r.batches))

  result: list[Any] = []
  for i, (x, v) in enumerate(zip(out_leaves, is_varying)):
    k = x.shape[0] if x.ndim else None
    if i in marked:
      b = marked[i]
      if b is None:
        r = rows_of(i)
        if r.is_unknown or len(r.batches) != 1 or r.axis != 0 or sizes[next(iter(r.batches))] != k:
          candidates = ", ".join(names[j] for j, size in enumerate(sizes) if size == k)
          why = describe(r) if r.carries_rows else "its axis 0 does not hold any batch's rows"
          raise ValueError(
              f"tpustrat.per_example: the output at {paths[i]} has leading size {k}, like several padded "
              f"batches of this step ({candidates}), and its rows cannot be traced to one of them ({why}). "
              "Say which with tpustrat.per_example(x, batch=the_batch).")
        b = next(iter(r.batches))
      result.append((b, True))
      continue
    if not v or k is None or k not in sizes:
      result.append(None)
      continue
    r = rows_of(i)
    matching = [j for j, size in enumerate(sizes) if size == k]
    if not r.is_unknown and r.batches and r.axis != 0:
      result.append(None)  # the rows are on another axis: axis 0 is something else, kept whole
    elif not r.is_unknown and len(r.batches) == 1 and sizes[next(iter(r.batches))] == k:
      result.append((next(iter(r.batches)), False))
    elif r.carries_rows:
      chosen = matching[0] if r.is_unknown and len(matching) == 1 else None
      effect = (f"skip the padding of {names[chosen]}" if chosen is not None
                else "keep every row, padding included")
      warnings.warn(
          f"strategy.run: the output at {paths[i]} ({x.dtype}{list(x.shape)}) has the per-replica size of "
          f"the padded batch {' / '.join(names[j] for j in matching)} on axis 0, but its rows cannot be "
          f"traced to one batch: {describe(r)}. strategy.reduce(..., axis=0), gather(..., axis=0) and "
          f"experimental_local_results will {effect}. Mark it with tpustrat.per_example(x, batch=...) to "
          "say whose rows it holds.",
          BatchRowsWarning, stacklevel=2)
      result.append(None if chosen is None else (chosen, False))
      if chosen is not None and guessed is not None:
        guessed.add(i)
    else:
      result.append(None)  # its axis 0 is not a batch's rows, whatever its size
  return result


_INNER_NOTES = threading.local()
_INNER_NOTES.stack = []


@contextlib.contextmanager
def inner_padding_notes() -> Iterator[list[tuple[dict[str, Any], Any]]]:
  """While a program that runs `run` inside it is traced (`experimental_run_steps`), collects, for each
  inner `run` call, its program's notes and the call's argument signature (`arguments_signature`, of the
  tracers: the signature the inner program was traced for); the enclosing program keeps what they say for
  its own signature (`note_stacked_padding_reads`) and says it at its first call with a partial batch of
  that signature (`warn_padding_reads_stacked`)."""
  if not hasattr(_INNER_NOTES, "stack"):
    _INNER_NOTES.stack = []
  found: list[tuple[dict[str, Any], Any]] = []
  _INNER_NOTES.stack.append(found)
  try:
    yield found
  finally:
    _INNER_NOTES.stack.pop()


def note_stacked_padding_reads(notes: dict[str, Any], signature: Any,
                               found: list[tuple[dict[str, Any], Any]]) -> None:
  """At the trace of a program of stacked steps for arguments of `signature` (`stacked_signature`): keeps in
  `notes` (`note_padding_reads`) what the inner `run` calls its trace made say of their padding reads
  (`found`, from `inner_padding_notes`: each the message of the inner trace for that call's signature)."""
  messages: list[str] = []
  for inner, inner_signature in found:
    message = _message_of(inner, inner_signature)
    if message and message not in messages:
      messages.append(message)
  note_padding_reads(notes, signature, "\n".join(messages) or None)


def stacked_signature(carry: Any, batches: Any) -> Any:
  """The key of a program of stacked steps' padding-read warnings: one `jax.jit` over every structure of its
  arguments (a padded batch's kind of padding is in its structure), so the structure too."""
  return jax.tree.structure((carry, batches)), arguments_signature(carry, batches)


def warn_padding_reads_stacked(notes: dict[str, Any], carry: Any, batches: Any) -> None:
  """`warn_padding_reads` for a program of stacked steps (batches ``[steps, num_replicas, rows, ...]``)
  called with `carry` and `batches`: the warning of its trace for this call's signature
  (`note_stacked_padding_reads`, `stacked_signature`), once, at the first call of that signature whose
  batches hold a partial one. Called inside a program the user traces (counts not on the host), nothing."""
  if notes.get("padding_reads") and _partial(batches, rows_axis=2) is True:
    _say(notes, stacked_signature(carry, batches))


def _partial(tree: Any, rows_axis: int) -> bool | None:
  """Whether the first padded batch in `tree` (its rows on `rows_axis` of each leaf: 1 for one step's,
  2 for stacked steps) holds a partial batch; False with none; None when its counts are traced (inside a
  program being traced: not known on the host)."""
  for node in jax.tree.leaves(tree, is_leaf=is_distributed):
    if isinstance(node, PerReplica) and node.padding_is_marked:
      if isinstance(node.real_rows_array, jax.core.Tracer):
        return None
      leaves = jax.tree.leaves(node.tree)
      rows = leaves[0].shape[rows_axis] if leaves and leaves[0].ndim > rows_axis else None
      return rows is not None and bool((np.asarray(node.host_real_rows()) < rows).any())
  return False


def arguments_signature(args: Any, kwargs: Any) -> Any:
  """A key of `run`'s arguments that tells `jax.jit`'s executables apart where a step's padding reads may
  differ: each leaf's shape and dtype, as the program sees it (a numpy array or a Python number after its
  placement; the same at trace time, from the tracers: `_leaf_dtype`)."""
  return tuple((np.shape(x), _leaf_dtype(x)) for x in jax.tree.leaves((args, kwargs)))


def _leaf_dtype(x: Any) -> Any:
  """A leaf's dtype as the program sees it: an array's own (a typed PRNG key's included), canonical; a
  Python number's as JAX types it; for anything else, its type."""
  dtype = getattr(x, "dtype", None)
  try:
    return jax.dtypes.canonicalize_dtype(dtype if dtype is not None else jax.numpy.result_type(x))
  except Exception:  # pylint: disable=broad-except  # an extended dtype canonicalization refuses, or no dtype
    return str(dtype) if dtype is not None else type(x).__name__


def note_padding_reads(notes: dict[str, Any], signature: Any, message: str | None) -> None:
  """At trace time: what this trace of the program (for arguments of `signature`) says of its padding reads
  (`message`, None: none). `jax.jit` keeps one executable per signature, so the warning of one trace waits for
  a partial batch of that signature, whatever later traces find. ``notes["padding_reads"]``: a message still
  to say for some signature (what a call checks first)."""
  pending = notes.setdefault("signatures", {})
  pending[signature] = message
  notes["padding_reads"] = message or next((m for m in list(pending.values()) if m), None)


def warn_padding_reads(notes: dict[str, Any], args: Any, kwargs: Any) -> None:
  """Says the program's padding-read warning (`step_jaxpr.StepJaxpr.padding_reads_message`) once, at the first call
  whose padded batch is partial: a dataset whose batches are all full never pads, and is not warned. The
  warning is that of the trace for this call's signature (`note_padding_reads`); for a signature no trace
  noted, that of any trace."""
  partial = _partial((args, kwargs), rows_axis=1)
  if partial is None:  # a run traced inside another program (run_steps): its counts are not known on the
    # host here: the enclosing program says it (`inner_padding_notes`)
    stack = getattr(_INNER_NOTES, "stack", None)  # set in the threads that enter `inner_padding_notes`
    if stack:
      stack[-1].append((notes, arguments_signature(args, kwargs)))
  elif partial:
    _say(notes, arguments_signature(args, kwargs))


def _say(notes: dict[str, Any], signature: Any) -> None:
  """Says the padding-read warning of the trace for arguments of `signature` (`note_padding_reads`), if not
  said yet; for a signature no trace noted, that of any trace, and then none again."""
  pending = notes.get("signatures", {})
  message = _message_of(notes, signature)
  if message:
    if signature in pending:
      pending[signature] = None
    else:  # which trace ran is not known: said once for all
      pending.clear()
    notes["padding_reads"] = next((m for m in list(pending.values()) if m), None)  # another thread may trace
    warnings.warn(message, PaddingReadWarning, stacklevel=user_stacklevel(jax_dirs()))  # the caller's line


def _message_of(notes: dict[str, Any], signature: Any) -> str | None:
  """The padding-read warning still to say of the trace for arguments of `signature` (`note_padding_reads`);
  for a signature no trace noted, that of any trace."""
  pending = notes.get("signatures", {})
  return pending.get(signature) if signature in pending else notes.get("padding_reads")
