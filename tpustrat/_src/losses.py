"""TF's loss scaling for a replica's part of the batch: `compute_average_loss`, `scale_regularization_loss`.

TF's `tf.nn.compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None)` sums this
replica's per-example losses (weighted) and divides by the global batch size, so that the gradients that
`strategy.run` (or TF's optimizer) sums over the replicas are the gradient of the mean loss of the global
batch. `tf.nn.scale_regularization_loss(loss)` divides a regularization loss, computed whole on every
replica, by the number of replicas, so that the sum over replicas counts it once.

The one difference from TF is the partial batch. TF hands each replica fewer rows; tpustrat keeps static
shapes and pads the batch (with copies of a real row, or zeros: `InputOptions.experimental_padding`;
`tpustrat.valid_mask`). The padding rows weigh nothing here:
the rows of `per_example_loss` are followed through the step's program to the batch they came from
(`ReplicaContext.padding_count`, never a size alone), and the rows past this replica's real ones are left
out. The default denominator is TF's on a full batch (``k * N`` for ``k`` rows per replica) and the number
of real examples of the global batch on a partial one (see `compute_average_loss`).

Inside `accumulate_gradients` the per-example loss is one micro-batch's, a part of the step's batch: the
accumulation says so (`micro_batches`), so that the default denominator stays the whole global batch's
and the micro-batches' losses add up to the big batch's. A micro-batch of the user's own loop over the
batch cannot be told from inside the loop (which one it is is the loop counter's): its padding rows are
`PaddingReadWarning`'s (the rows are followed into the loop), and the default denominator, TF's rule on
its own rows, is warned about (`BatchRowsWarning`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpustrat._src import context as context_lib

__all__ = ["BatchRowsWarning", "compute_average_loss", "global_examples", "micro_batches", "scale_regularization_loss"]


class BatchRowsWarning(UserWarning):
  """An array's rows could not be traced to one padded batch (an output of `strategy.run` with a padded
  batch's per-replica size on axis 0, or a per-example loss given to `compute_average_loss`), so none of
  them is left out as padding: mark it with `tpustrat.per_example`, or mask it with
  `tpustrat.valid_mask(batch)`. (Defined here, the lowest module that warns with it; `batch_rows`, which
  traces the rows, re-exports it.)"""


@dataclasses.dataclass(frozen=True, eq=False)
class _MicroBatches:
  """While `accumulate_gradients` traces its loss on one micro-batch of replica context `ctx`'s batch: `k`
  micro-batches per batch (the product over nested accumulations), and `totals`, pairs of a micro-batch's
  real-row count (the object ``ctx.real_rows`` holds) and the real examples of the global batch it is a
  part of."""

  ctx: Any
  k: int
  totals: tuple[tuple[Any, Any], ...]


_SCOPES = threading.local()  # .stack: the `_MicroBatches` entered in this thread, innermost last


def _scope(ctx: Any) -> _MicroBatches | None:
  for scope in reversed(getattr(_SCOPES, "stack", ())):
    if scope.ctx is ctx:
      return scope
  return None


def global_examples(ctx: Any, count: Any) -> Any:
  """The real examples of the global batch whose per-replica real-row count on this replica is `count`
  (one of ``ctx.real_rows``' counts): its sum over the replicas (one scalar `psum`), or, for a micro-batch
  of an enclosing `micro_batches`, the whole batch's."""
  scope = _scope(ctx)
  for micro, total in (scope.totals if scope is not None else ()):
    if micro is count:  # the count object the accumulation put in `real_rows`, not an equal number
      return total
  axis = context_lib.replica_axis(ctx)
  return count if axis is None else lax.psum(count, axis)


@contextlib.contextmanager
def micro_batches(ctx: Any, k: int, totals: Sequence[tuple[Any, Any]]) -> Iterator[None]:
  """While the body runs, per-example losses of replica context `ctx` are one of `k` micro-batches of its
  batch (`accumulate_gradients`): `compute_average_loss`'s default denominator is the whole global batch's,
  ``rows * k * N`` or, for a loss of a padded batch's rows, the total that `totals` pairs with the
  micro-batch's count in ``ctx.real_rows`` (computed before the loop by `global_examples`, so the loop
  holds no collective)."""
  outer = _scope(ctx)
  scope = _MicroBatches(ctx, k * (outer.k if outer is not None else 1), tuple(totals))
  stack = getattr(_SCOPES, "stack", None)
  if stack is None:
    stack = _SCOPES.stack = []
  stack.append(scope)
  try:
    yield
  finally:
    stack.remove(scope)


def _num_replicas(what: str) -> int:
  """The number of replicas in sync where `what` is called: 1 with no strategy; a RuntimeError (TF's) in
  a strategy's cross-replica context, where there is no replica's part of a batch to scale."""
  if context_lib.in_cross_replica_context():
    raise RuntimeError(f"You are calling `{what}` in cross replica context, while it was expected to be called in "
                       "replica context (inside strategy.run).")
  ctx = context_lib.get_replica_context()
  return 1 if ctx is None else int(ctx.num_replicas_in_sync)


def _check_global_batch_size(value: Any) -> Any:
  """TF's checks, made on the host where the value is concrete: a scalar, an integer, not negative."""
  if isinstance(value, bool) or isinstance(value, (float, np.floating)):
    raise TypeError(f"compute_average_loss: global_batch_size must be an integer, got {value!r}.")
  if isinstance(value, jax.core.Tracer):
    if jnp.ndim(value) != 0 or not jnp.issubdtype(jnp.result_type(value), jnp.integer):
      raise TypeError(f"compute_average_loss: global_batch_size must be an integer scalar, got "
                      f"{jnp.result_type(value)}{list(jnp.shape(value))}.")
    return value
  array = np.asarray(value)
  if array.ndim != 0 or not np.issubdtype(array.dtype, np.integer):
    raise TypeError(f"compute_average_loss: global_batch_size must be an integer scalar, got {value!r}.")
  if int(array) < 0:
    raise ValueError(f"compute_average_loss: global_batch_size must be non-negative, got {int(array)}.")
  return int(array)


def _weighted(losses: jax.Array, sample_weight: Any) -> jax.Array:
  """`losses` times `sample_weight`, matched as TF's `scale_losses_by_sample_weight` matches them: a
  weight of one rank less gets a trailing axis, one of one rank more with a trailing 1 loses it, then
  they broadcast."""
  w = jnp.asarray(sample_weight)
  if w.ndim == losses.ndim - 1:
    w = w[..., None]
  elif w.ndim == losses.ndim + 1 and w.shape[-1] == 1:
    w = w[..., 0]
  try:
    shape = jnp.broadcast_shapes(w.shape, losses.shape)
  except ValueError:
    shape = None
  if shape != losses.shape:
    raise ValueError(f"compute_average_loss: sample_weight of shape {list(jnp.shape(sample_weight))} does not "
                     f"broadcast to per_example_loss of shape {list(losses.shape)}; give one weight per example "
                     "(the leading axis) or per loss element.")
  return (losses * w).astype(losses.dtype)


def compute_average_loss(per_example_loss: Any, sample_weight: Any = None, global_batch_size: Any = None) -> jax.Array:
  """This replica's share of the mean loss of the global batch (TF's `tf.nn.compute_average_loss`).

  ``sum(per_example_loss * sample_weight) / global_batch_size`` over this replica's examples, the padding
  examples of a partial batch left out; zero where `global_batch_size` is zero. Summed over the replicas
  (the gradients `strategy.run` gives w.r.t. `Mirrored` parameters, or `ReplicaContext.all_reduce`), it is
  the mean loss of the global batch.

  Args:
    per_example_loss: this replica's per-example losses, the examples on the leading axis (rank >= 1).
    sample_weight: optional weights: a scalar, one per example (``[b]``), or one per loss element, as in TF.
    global_batch_size: the global batch size (an integer >= 0). By default TF's, the replica's rows
      times the number of replicas, for a full batch: ``k * N``. On a partial batch (padded), the number
      of real examples in the whole global batch (this replica's real rows summed over the replicas: one
      scalar all-reduce), so the result is the mean over the real examples, as on one device. TF divides
      by this replica's own rows times ``N``, which is that same number when TF splits the partial batch
      evenly; tpustrat fills the replicas in order (``k`` rows each, the rest on the next), so TF's
      per-replica rule would weigh the replicas unevenly here, an artifact of the split, not a meaning.
      Pass ``global_batch_size`` to divide every batch by the same number (TF's tutorials pass
      ``GLOBAL_BATCH_SIZE``: a partial batch then weighs less, in TF and here alike). Inside
      `accumulate_gradients`, whose `loss_fn` sees one of ``k`` micro-batches, the default is the whole
      global batch's (``k * rows * N``, or its real examples), so that the micro-batches' losses add up to
      the big batch's, as TF's default on the big batch.

  Padding rows weigh nothing: a partial batch from a distributed dataset is padded, and the rows of
  `per_example_loss` are followed through the step's program to that batch, so the rows past this
  replica's real ones are left out (TF's batch has no padding rows; TF code never masks). A
  `per_example_loss` whose rows cannot be followed to one batch (sorted, gathered) is taken whole, with a
  `BatchRowsWarning`; mask it with `tpustrat.valid_mask(batch)` there.

  Micro-batches of your own loop over the batch (a `lax.scan` over ``batch.reshape(k, -1, ...)``) are
  not told apart inside the loop, where which micro-batch it is is the loop counter's: their padding rows
  are kept (on a partial batch `run` warns, `PaddingReadWarning`) and the default denominator is TF's
  rule on the micro-batch's rows, ``k`` times too small for the batch (warned when the step is traced,
  `BatchRowsWarning`). Use `accumulate_gradients`, or scan over this replica's
  ``tpustrat.valid_mask(batch).reshape(k, -1)`` beside the micro-batches and pass its row as
  `sample_weight`, with `global_batch_size`.

  Raises:
    ValueError: `per_example_loss` is a scalar (TF: rank >= 1 expected); `sample_weight` does not broadcast;
      `global_batch_size` is negative.
    TypeError: `global_batch_size` is not an integer scalar.
    RuntimeError: called in a strategy's cross-replica context with no `global_batch_size` (TF's).

  >>> float(compute_average_loss(np.array([1.0, 2.0, 3.0, 6.0]), global_batch_size=8))
  1.5
  >>> float(compute_average_loss(np.array([1.0, 3.0]), sample_weight=np.array([2.0, 0.0])))
  1.0
  """
  losses = jnp.asarray(per_example_loss)
  if losses.ndim == 0:
    raise ValueError("compute_average_loss: per_example_loss must have at least rank 1 (the examples on the leading "
                     f"axis), got a scalar {per_example_loss!r:.60}.")
  if global_batch_size is not None:
    global_batch_size = _check_global_batch_size(global_batch_size)
  dtype = losses.dtype
  if sample_weight is not None:
    losses = _weighted(losses, sample_weight)
  rows = losses.shape[0]
  ctx = context_lib.get_replica_context()
  real = None
  if ctx is not None and context_lib.in_replica_context_of_a_run():
    real = ctx.padding_count(per_example_loss, "compute_average_loss: per_example_loss")
  if real is not None:
    keep = lax.broadcasted_iota(jnp.int32, losses.shape, 0) < real
    losses = jnp.where(keep, losses, jnp.zeros((), dtype))
    if global_batch_size is None:  # the real examples of the whole global batch (k * N when it is full)
      global_batch_size = global_examples(ctx, real)
  if global_batch_size is None:  # TF's rule on the whole batch: a micro-batch's rows are 1/k of it
    scope = _scope(ctx) if ctx is not None else None
    global_batch_size = rows * (scope.k if scope is not None else 1) * _num_replicas("compute_average_loss")
    if ctx is not None and context_lib.in_replica_context_of_a_run():
      _warn_if_a_part_of_a_batch(ctx, losses, global_batch_size)
  total = jnp.sum(losses)
  denominator = jnp.asarray(global_batch_size).astype(dtype)
  return jnp.where(denominator == 0, jnp.zeros((), dtype), total / jnp.where(denominator == 0, 1, denominator))


def _warn_if_a_part_of_a_batch(ctx: Any, losses: jax.Array, denominator: int) -> None:
  """A `BatchRowsWarning` when `losses`, whose rows no padded batch was found for, has fewer rows than a
  padded batch, a divisor of its size, and the default `denominator` (TF's rule on its own rows) is used:
  what a micro-batch of the user's own loop over the batch (or a slice of it) looks like. Inside a
  `lax.scan` body, which micro-batch it is is not a value of the trace, so its rows cannot be tied to the
  batch's, and TF's rule divides each micro-batch by its own rows: ``k`` times the batch's mean, on every
  batch. (Its padding rows, on a partial batch, are the `PaddingReadWarning`'s: the rows are followed
  into the loop, `batch_rows`.)"""
  rows = losses.shape[0]
  parts = [(i, size) for i, (size, _) in enumerate(ctx.real_rows) if rows < size and size % rows == 0]
  if not parts:
    return
  i, size = parts[0]
  name = ctx.batch_names[i] if i < len(ctx.batch_names) else "of the step"
  warnings.warn(
      f"compute_average_loss: per_example_loss ({losses.dtype}{list(losses.shape)}) has {rows} row"
      f"{'s' if rows > 1 else ''} per replica, fewer than the {size} of the padded batch {name}, so its rows "
      f"cannot be tied to that batch's, and the default denominator is {denominator}, TF's rule on its own rows. "
      f"If it is one of the {size // rows} micro-batches of your own loop over the batch (or a slice of it), the "
      f"losses add up to {size // rows} times the batch's mean. Use tpustrat.accumulate_gradients (each micro-batch's "
      "default denominator is the whole batch's), or pass global_batch_size= (and, for a partial batch's "
      "padding rows, this micro-batch's rows of tpustrat.valid_mask(batch), computed outside the loop and "
      "scanned over beside the micro-batches, as sample_weight=).", BatchRowsWarning, stacklevel=3)


def scale_regularization_loss(regularization_loss: Any) -> jax.Array:
  """A regularization loss computed whole on every replica, divided by the number of replicas (TF's
  `tf.nn.scale_regularization_loss`), so that the sum over the replicas counts it once.

  Args:
    regularization_loss: a regularization loss (summed if it is not a scalar, as in TF).

  Raises:
    RuntimeError: called in a strategy's cross-replica context (TF's).

  >>> float(scale_regularization_loss(np.array([1.0, 2.0])))   # no strategy: one replica
  3.0
  """
  n = _num_replicas("scale_regularization_loss")
  return jnp.sum(jnp.asarray(regularization_loss)) / n
