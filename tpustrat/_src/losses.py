"""TF's loss scaling for a replica's part of the batch: `compute_average_loss`, `scale_regularization_loss`.

TF's `tf.nn.compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None)` sums this
replica's per-example losses (weighted) and divides by the global batch size, so that the gradients that
`strategy.run` (or TF's optimizer) sums over the replicas are the gradient of the mean loss of the global
batch. `tf.nn.scale_regularization_loss(loss)` divides a regularization loss, computed whole on every
replica, by the number of replicas, so that the sum over replicas counts it once.

The one difference from TF is the partial batch. TF hands each replica fewer rows; tpustrat keeps static
shapes and pads the batch with zero rows (`tpustrat.valid_mask`). The padding rows weigh nothing here:
the rows of `per_example_loss` are followed through the step's program to the batch they came from
(`ReplicaContext.padding_count`, never a size alone), and the rows past this replica's real ones are left
out. The default denominator is TF's on a full batch (``k * N`` for ``k`` rows per replica) and the number
of real examples of the global batch on a partial one (see `compute_average_loss`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpustrat._src import context as context_lib

__all__ = ["compute_average_loss", "scale_regularization_loss"]


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
      ``GLOBAL_BATCH_SIZE``: a partial batch then weighs less, in TF and here alike).

  Padding rows weigh nothing: a partial batch from a distributed dataset is padded with zero rows, and
  the rows of `per_example_loss` are followed through the step's program to that batch, so the rows past
  this replica's real ones are left out (TF's batch has no padding rows; TF code never masks). A
  `per_example_loss` whose rows cannot be followed to one batch (sorted, gathered) is taken whole, with a
  `BatchRowsWarning`; mask it with `tpustrat.valid_mask(batch)` there.

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
      axis = context_lib.replica_axis(ctx)
      global_batch_size = real if axis is None else lax.psum(real, axis)
  if global_batch_size is None:
    global_batch_size = rows * _num_replicas("compute_average_loss")
  total = jnp.sum(losses)
  denominator = jnp.asarray(global_batch_size).astype(dtype)
  return jnp.where(denominator == 0, jnp.zeros((), dtype), total / jnp.where(denominator == 0, 1, denominator))


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
