"""Gradient accumulation in one program: `tpustrat.accumulate_gradients`.

A step that cannot hold the activations of its whole per-replica batch splits it into ``k`` micro-batches
(Keras 3's ``gradient_accumulation_steps``), runs forward and backward on one at a time inside a
`lax.scan`, and adds the gradients up in local accumulators. Only then does it communicate, once: one
all-reduce of the gradients w.r.t. `Mirrored` parameters (through the strategy's `CrossDeviceOps`, a plain
`psum` by default) and one reduce-scatter per sharded parameter (`LocalShard`). The result is that of
`jax.value_and_grad` on the whole batch; only the activations' memory shrinks, to about one micro-batch's.

How each kind of parameter is handled (read from JAX's varying-axes type and the pytree, never from
shapes):

* invariant leaves (`Mirrored` parameters): differentiated w.r.t. `local_copy` of them, so that no
  micro-batch's backward pass all-reduces; the local sums are all-reduced once after the scan. The result
  is the gradient summed over replicas, as `jax.grad` w.r.t. the `Mirrored` value gives it.
* `LocalShard` leaves (`ShardedVariable` parameters): read whole once, before the scan (one all-gather
  each); the local gradient of the whole value is summed over the micro-batches and reduce-scattered once
  to this replica's block (padded rows zero), as `jax.grad` w.r.t. the `LocalShard` gives it.
* varying leaves (values that already differ per replica): summed locally, no communication, as
  `jax.grad` gives them.

Padding: while the loss runs on a micro-batch, the micro-batch's arrays are the padded batch's arrays for
`valid_mask` / `num_valid_examples` (the batch's real rows that fall in that micro-batch; padding is at
the end of each replica's rows, so it lands in the last micro-batches).

The micro-batches are parts of one global batch: while the loss runs on one, `compute_average_loss`'s
default denominator is the whole global batch's (`losses.micro_batches`; its real examples, summed over
the replicas once before the loop), as TF's on the big batch, so the micro-batches' losses add up to the
big batch's mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tpustrat._src import context as context_lib
from tpustrat._src import conv_layouts
from tpustrat._src.input.padding import batch_of
from tpustrat._src.jax_compat import to_varying, varying_axes
from tpustrat._src.losses import global_examples, micro_batches
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.sharded_variable import LocalShard
from tpustrat._src.validation import check_int, tree_path

__all__ = ["accumulate_gradients"]

_NAME = "tpustrat.accumulate_gradients"

_MIRRORED, _SHARDED, _LOCAL = "mirrored", "sharded", "local"


def accumulate_gradients(loss_fn: Callable[..., Any], params: Any, batch: Any, *,
                         gradient_accumulation_steps: int, has_aux: bool = False) -> Any:
  """`jax.value_and_grad(loss_fn)(params, batch)` computed over `k` micro-batches, communicating once.

  Call it inside the step given to `strategy.run` (or `experimental_run_steps`): it splits every leaf of
  this replica's `batch` along axis 0 into ``k = gradient_accumulation_steps`` micro-batches of ``rows / k``
  consecutive rows, runs forward and backward on one micro-batch at a time in a `lax.scan`, adds the
  gradients up locally (float32 accumulators for 16-bit floats), and then communicates once: one
  all-reduce for the gradients w.r.t. `Mirrored` parameters (through the strategy's cross-device ops, a
  plain `psum` by default; never one per micro-batch) and one reduce-scatter per sharded parameter. Peak
  activation memory is that of one micro-batch.

  ::

    def step(state, batch):
      loss, grads = tpustrat.accumulate_gradients(loss_fn, state["params"], batch,
                                                  gradient_accumulation_steps=4)
      updates, opt = tx.update(grads, state["opt"], state["params"])
      return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

  Same numbers as the one-big-batch step, ``jax.value_and_grad(loss_fn)(params, batch)`` (f32: rtol 1e-5,
  tested on 1, 2, 4 and 8 replicas with k = 1, 2, 4), provided that the loss is a sum over the batch's
  examples with a normaliser that does not depend on the micro-batch it is given: TF's
  ``compute_average_loss(per_example_loss)``, whose default denominator here is the whole global batch's
  (its examples, or its real ones on a partial batch: the micro-batches are told they are parts of it), or
  ``compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)``, i.e.
  ``jnp.sum(per_example_loss) / GLOBAL_BATCH`` with a constant. Such a loss is linear in the examples, so
  the big batch's loss and gradients are the sums of the micro-batches'. (A loss divided by its own batch's
  size, ``jnp.mean``, would be ``k`` times too large; batch statistics such as batch normalisation see one
  micro-batch at a time.)

  Args:
    loss_fn: ``loss_fn(params, micro_batch) -> loss`` (a scalar; ``(loss, aux)`` with `has_aux`), this
      replica's loss on the rows it is given. It gets `params` with every `LocalShard` already read whole
      (a plain array: `tpustrat.read_values` and the like leave it as it is) and a micro-batch: `batch` with
      ``rows / k`` rows per leaf. Padding: `tpustrat.valid_mask(micro_batch)` /
      `num_valid_examples(micro_batch)` (or without an argument, as in the big-batch step) give the rows of
      the micro-batch that are real, so a loss that masks with them on the whole batch masks the same rows
      here and padding rows count for nothing; `tpustrat.compute_average_loss` leaves them out too, and its
      default denominator is the whole global batch's.
    params: the pytree to differentiate: `Mirrored` parameters as the step receives them (arrays the same
      on every replica), the `LocalShard` blocks of `ShardedVariable` values, or per-replica values.
    batch: this replica's batch: a pytree whose every leaf has the batch on axis 0, with a number of rows
      that `gradient_accumulation_steps` divides.
    gradient_accumulation_steps: ``k``, the number of micro-batches (an int >= 1; Keras 3's name). With 1
      there is no scan: one forward and backward pass on the whole batch, the same single communication.
    has_aux: as for `jax.value_and_grad`: `loss_fn` returns ``(loss, aux)``.

  Returns:
    ``(loss, grads)``, or ``((loss, aux), grads)`` with `has_aux`, as `jax.value_and_grad` on the whole
    batch would return them:

    * ``loss``: the sum of the ``k`` micro-batches' losses (of the loss's dtype; added in float32 for
      16-bit floats), this replica's loss on its whole batch. Typed as the micro-batches' losses are (per
      replica when computed from the batch; `PerReplica` if `run` returns it).
    * ``grads``: like `params`. W.r.t. an invariant (`Mirrored`) leaf: the gradient summed over replicas,
      the same on every replica; w.r.t. a `LocalShard`: a `LocalShard` holding this replica's block of the
      gradient summed over replicas; w.r.t. a per-replica leaf: this replica's own gradient. Each in its
      parameter's dtype: 16-bit gradients are added up in float32 and rounded once, before the
      communication, which carries as many bytes as the big-batch step's.
    * ``aux``: each micro-batch's `aux`, stacked on a new leading axis of size ``k`` (a `lax.scan`'s
      outputs); per-example rows of micro-batch ``i`` are rows ``[i*rows/k, (i+1)*rows/k)`` of the batch.

  Raises:
    TypeError: `gradient_accumulation_steps` is not an int (a bool, a float), or `loss_fn` is not callable.
    ValueError: `gradient_accumulation_steps` < 1; a leaf of `batch` is a scalar or its rows are not a
      multiple of ``k`` (the message names the leaf's path, its rows and ``k``); with ``k > 1``, leaves of
      `batch` with different numbers of rows (naming two), or no leaves at all; `loss_fn` calls
      `tpustrat.per_example` (raised when the loss is traced: mark per-example results outside, on the
      stacked `aux`).
    TypeError (when the loss is traced): `loss_fn` returns a loss that is not a scalar (the message gives
      its shape and the micro-batch's rows), or, with `has_aux`, not a pair.
    RuntimeError: called in the cross-replica context (inside `strategy.scope()`, outside `run`).
    All but the `per_example` one and the loss's own are raised before `loss_fn` is traced.

  Memory: the accumulators hold one float32 (or parameter-dtype) copy of the local gradient, whole for
  sharded parameters, which are also read whole once for the whole step: a `LocalShard` parameter costs
  two whole copies per device while the step runs. Where sharded parameters do not fit whole on a device,
  take `jax.grad` w.r.t. the `LocalShard`s inside your own `lax.scan` over micro-batches instead: that
  reduce-scatters once per micro-batch, with block-sized accumulators.

  How it differs from `optax.MultiSteps` (and Keras 3's optimizer option of the same name): MultiSteps
  wraps the optimizer, keeps the accumulated gradients as optimizer *state* (persistent, replicated on every
  device under data parallelism, a parameter-sized buffer for the whole run) and applies the update every
  ``k``-th call, so one update takes ``k`` programs, each with its own gradient all-reduce (``k`` times the
  communication) unless the user restructures the step. Here the ``k`` micro-batches are one program: the
  accumulators are temporaries of the step, local to each device and freed when it ends; the gradients are
  communicated once per step; the optimizer is untouched and updates every step; and loss and gradients
  are those of the one big batch (up to float rounding), so learning-rate schedules, step counts and
  checkpoints mean what they mean without accumulation. The whole batch must be on the device for the
  step (it is an argument of the program), unlike MultiSteps, which receives one micro-batch per call.

  >>> loss_fn = lambda w, x: jnp.sum(w * x) / 4.0
  >>> loss, grad = accumulate_gradients(loss_fn, 2.0, jnp.arange(4.0), gradient_accumulation_steps=2)
  >>> print(loss, grad)
  3.0 1.5
  """
  k = check_int(gradient_accumulation_steps, _NAME, "gradient_accumulation_steps", minimum=1)
  if not callable(loss_fn):
    raise TypeError(f"{_NAME}: `loss_fn` must be callable (loss_fn(params, micro_batch) -> loss), got "
                    f"{type(loss_fn).__name__} {loss_fn!r:.60}.")
  ctx = context_lib.get_replica_context()
  if ctx is None:
    raise RuntimeError(
        f"{_NAME} was called in the cross-replica context of {context_lib.get_strategy()!r} (inside "
        "strategy.scope(), outside strategy.run). Call it inside the function given to strategy.run.")
  axis = context_lib.replica_axis(ctx)

  batch_leaves, batch_tree = jax.tree_util.tree_flatten_with_path(batch)
  if not batch_leaves and k > 1:
    raise ValueError(f"{_NAME}: `batch` has no arrays to split into gradient_accumulation_steps={k} "
                     "micro-batches.")
  for path, x in batch_leaves:
    where = tree_path(path) or "<root>"
    if not hasattr(x, "shape") and not isinstance(x, (int, float, complex)):
      raise TypeError(f"{_NAME}: the leaf of `batch` at {where} is a {type(x).__name__}, not an array.")
    if jnp.ndim(x) == 0:
      raise ValueError(f"{_NAME}: the leaf of `batch` at {where} is a scalar; every leaf needs the batch on "
                       f"axis 0 to be split into gradient_accumulation_steps={k} micro-batches (close over "
                       "values that are not per example in `loss_fn`).")
    rows = jnp.shape(x)[0]
    if rows % k:
      raise ValueError(
          f"{_NAME}: the leaf of `batch` at {where} has {rows} rows per replica, which "
          f"gradient_accumulation_steps={k} does not divide; choose a k that divides the per-replica batch "
          f"(global batch / num_replicas_in_sync), or a batch size that k divides.")
  if k > 1:
    first_path, first = batch_leaves[0]
    for path, x in batch_leaves[1:]:
      if jnp.shape(x)[0] != jnp.shape(first)[0]:
        raise ValueError(
            f"{_NAME}: the leaves of `batch` hold different numbers of rows: "
            f"{tree_path(first_path) or '<root>'} has {jnp.shape(first)[0]} per replica, {tree_path(path)} "
            f"{jnp.shape(x)[0]}; every leaf must hold the same examples on axis 0 to be split into "
            f"gradient_accumulation_steps={k} micro-batches (close over values that are not per example in "
            "`loss_fn`).")
  flat_batch = [x for _, x in batch_leaves]

  kinds, diff_params, params_tree = _prepare_params(params, axis)
  value_and_grad = jax.value_and_grad(_checked_loss(loss_fn, has_aux, k), has_aux=has_aux)

  if k == 1:
    out, local = value_and_grad(diff_params, batch)
    loss, aux = (out if has_aux else (out, None))
    aux = None if aux is None else jax.tree.map(lambda a: jnp.expand_dims(a, 0), aux)
    local = jax.tree.leaves(local)
  else:
    padded = _padded_batches(ctx, flat_batch)
    # The real examples of each padded global batch the micro-batches are parts of, summed over the replicas
    # here, outside the loop: `compute_average_loss`'s default denominator inside it.
    totals = {j: global_examples(ctx, ctx.real_rows[j][1]) for j in sorted({j for j in padded if j is not None})}
    micro = [jnp.reshape(x, (k, jnp.shape(x)[0] // k) + tuple(jnp.shape(x)[1:])) for x in flat_batch]
    param_leaves = jax.tree.leaves(diff_params)
    acc0 = [_zeros_like_accumulator(p, axis) for p in param_leaves]

    def body(acc, xs):
      i, micro_leaves = xs
      micro_batch = jax.tree.unflatten(batch_tree, micro_leaves)
      with _micro_batch_rows(ctx, padded, totals, micro_leaves, i, k):
        out, g = value_and_grad(diff_params, micro_batch)
      acc = [a + gi.astype(a.dtype) for a, gi in zip(acc, jax.tree.leaves(g))]
      return acc, out

    mesh = ctx.strategy.mesh
    if conv_layouts.on_cpu(None if mesh is None else mesh.devices):  # convolutions in a loop on XLA:CPU
      body = conv_layouts.canonical_convolutions(body)
    acc, outs = lax.scan(body, acc0, (jnp.arange(k, dtype=jnp.int32), micro))
    losses, aux = (outs if has_aux else (outs, None))
    loss = jnp.sum(losses.astype(_accumulator_dtype(losses.dtype)), axis=0).astype(losses.dtype)
    local = [a.astype(p.dtype) for a, p in zip(acc, param_leaves)]

  grads = _communicate(ctx, axis, kinds, local)
  grads = jax.tree.unflatten(params_tree, grads)
  return ((loss, aux), grads) if has_aux else (loss, grads)


def _checked_loss(loss_fn: Callable[..., Any], has_aux: bool, k: int) -> Callable[..., Any]:
  """`loss_fn`, raising a `TypeError` in tpustrat's words (naming the micro-batch) when its result is not
  a scalar loss (or ``(loss, aux)`` with `has_aux`), rather than JAX's message from inside the scan."""

  def checked(params: Any, micro_batch: Any) -> Any:
    out = loss_fn(params, micro_batch)
    if has_aux and not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(f"{_NAME}: with has_aux=True, `loss_fn` must return (loss, aux), got "
                      f"{type(out).__name__}.")
    loss = out[0] if has_aux else out
    if jnp.ndim(loss) != 0:
      rows = [jnp.shape(x)[0] for x in jax.tree.leaves(micro_batch) if jnp.ndim(x)]
      on = f" on a micro-batch of {rows[0]} rows (1/{k} of this replica's batch)" if rows and k > 1 else ""
      raise TypeError(
          f"{_NAME}: `loss_fn` must return a scalar loss, got shape {tuple(jnp.shape(loss))}{on}. Sum the "
          "per-example losses and divide by the global batch size (TF's compute_average_loss: "
          "jnp.sum(per_example_loss) / GLOBAL_BATCH); return per-example values as `aux` (has_aux=True).")
    return out

  return checked


# -- parameters -----------------------------------------------------------------------------------------


class _Sharded:
  """What a `LocalShard` parameter needs after the scan: its logical shape, split axis and block rows."""

  def __init__(self, shard: LocalShard) -> None:
    self.shape, self.axis, self.block_rows = shard.shape, shard.axis, jnp.shape(shard.block)[shard.axis]
    self.groups = shard.groups  # hybrid sharding: split within these groups of replicas


def _prepare_params(params: Any, axis: str | None) -> tuple[list[Any], Any, Any]:
  """(kind of each leaf, the pytree `loss_fn` is differentiated w.r.t., the treedef of `params` with each
  `LocalShard` one leaf).

  Invariant leaves become `local_copy`s (typed per replica: no all-reduce in the backward pass), each
  `LocalShard` its value read whole (one all-gather, typed per replica), other leaves stay as they are.
  """
  leaves, tree = jax.tree.flatten(params, is_leaf=lambda x: isinstance(x, LocalShard))
  kinds: list[str | _Sharded] = []
  diff: list[Any] = []
  for x in leaves:
    if isinstance(x, LocalShard):
      if jnp.ndim(x.block) != len(x.shape):
        raise ValueError(f"{_NAME}: {x!r} is a slice of a sharded value's block (a scan over its leading axes "
                         "handed it out); pass the sharded parameter as the step received it.")
      full = x.read_value()
      kinds.append(_Sharded(x))
      diff.append(full if axis is None else to_varying(full, axis))
    elif axis is not None and axis not in varying_axes(x):
      kinds.append(_MIRRORED)
      diff.append(to_varying(x, axis))  # `tpustrat.local_copy`: the same numbers, typed per replica
    else:
      kinds.append(_LOCAL)
      diff.append(jnp.asarray(x))
  return kinds, jax.tree.unflatten(tree, diff), tree


def _accumulator_dtype(dtype: Any) -> Any:
  """float32 for floats narrower than 32 bits (bfloat16, float16), else the dtype itself."""
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 else dtype


def _zeros_like_accumulator(p: Any, axis: str | None) -> jax.Array:
  zeros = jnp.zeros(jnp.shape(p), _accumulator_dtype(jnp.result_type(p)))
  return zeros if axis is None else to_varying(zeros, axis)  # the gradients w.r.t. local copies vary


def _communicate(ctx: Any, axis: str | None, kinds: list[Any], local: list[Any]) -> list[Any]:
  """The gradients as `jax.grad` w.r.t. `params` gives them, from this replica's local sums: one
  all-reduce of every invariant leaf's together, one reduce-scatter per sharded leaf."""
  out = list(local)
  mirrored = [i for i, kind in enumerate(kinds) if kind == _MIRRORED]
  if mirrored:
    summed = ctx.all_reduce(ReduceOp.SUM, [local[i] for i in mirrored])
    for i, g in zip(mirrored, summed):
      out[i] = g
  for i, kind in enumerate(kinds):
    if isinstance(kind, _Sharded):
      out[i] = LocalShard(_reduce_scatter(local[i], kind, axis), kind.shape, kind.axis, kind.groups)
  return out


def _reduce_scatter(g: jax.Array, kind: _Sharded, axis: str | None) -> jax.Array:
  """This replica's block of `g` (a whole value's local gradient) summed over replicas: zero rows up to ``N``
  blocks along the split axis, then one tiled `psum_scatter` (the transpose of `LocalShard.read_value`; with
  groups, within the group and then one all-reduce of the block across them: `LocalShard.sum_to_block`)."""
  if axis is None:
    return g
  return LocalShard(g, kind.shape, kind.axis, kind.groups).sum_to_block(g)


# -- padding --------------------------------------------------------------------------------------------


def _padded_batches(ctx: Any, leaves: list[Any]) -> list[int | None]:
  """For each leaf of the batch, the index into ``ctx.real_rows`` of the padded batch it belongs to (by
  identity, else by size, as `valid_mask` finds it), or None."""
  if not ctx.real_rows:
    return [None] * len(leaves)
  return [batch_of(ctx, x, "accumulate_gradients") for x in leaves]


@contextlib.contextmanager
def _micro_batch_rows(ctx: Any, padded: list[int | None], totals: dict[int, Any], micro_leaves: list[Any], i: Any,
                      k: int) -> Iterator[None]:
  """While the loss runs on micro-batch `i`, its arrays are the padded batches' arrays for `valid_mask` and
  `num_valid_examples`: each padded batch of ``size`` rows and ``count`` real ones (on this replica)
  becomes one of ``size / k`` rows and ``clip(count - i * size / k, 0, size / k)`` real ones; and its
  per-example losses are one of `k` parts of the global batch for `compute_average_loss` (`micro_batches`:
  the default denominator is the whole batch's, `totals[j]` real examples for padded batch `j`)."""
  saved_rows, saved_marks = ctx.real_rows, len(ctx.per_example_marks)
  rows = list(saved_rows)
  for j in totals:
    size, count = saved_rows[j]
    m = size // k
    rows[j] = (m, jnp.clip(count - i * m, 0, m).astype(jnp.int32))
  ctx.real_rows = tuple(rows)
  for j in totals:
    ctx.note_batch_leaves([x for x, b in zip(micro_leaves, padded) if b == j], j)
  try:
    with micro_batches(ctx, k, [(rows[j][1], totals[j]) for j in totals]):
      yield
  finally:
    ctx.real_rows = saved_rows
  if len(ctx.per_example_marks) != saved_marks:
    del ctx.per_example_marks[saved_marks:]
    raise ValueError(
        f"{_NAME}: `loss_fn` called tpustrat.per_example; its rows are one micro-batch's, inside the "
        "accumulation's scan. Return them as `aux` (has_aux=True: stacked [k, rows / k, ...]) and mark the "
        "reshaped result in the step.")
