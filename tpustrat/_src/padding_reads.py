"""Which results of a step sum a padded batch's padding rows that no mask removed: read from its jaxpr.

A partial batch reaches each replica padded with zero rows. TF hands each replica fewer rows instead, so
TF code never masks: ported literally, its loss (``compute_average_loss`` aside) sums the padding
examples' losses, which are not zero (a bias, a label of 0), and trains on them, silently. This module
finds such sums in the step's program, so that `run` can warn (`PaddingReadWarning`), once per program,
naming the output and the fix.

Each value is followed with its `Rows` (`batch_rows`) and three facts:

* ``zero``: its padding rows are zero. A padded batch's arrays are (the dataset pads with zeros); the
  property survives operations that map zeros to zeros (products, linear maps, ``tanh``, layout changes)
  and is lost by those that do not (adding a bias, ``exp``, ``log``);
* ``mask``: computed from the step's real-row counts by comparisons, logic, casts, layout changes and
  arithmetic with values that hold no batch's rows (`tpustrat.valid_mask`, `compute_average_loss`, the
  embedding's padding, ``min`` of two batches' counts): a product with, or a selection by, such a value
  zeroes the padding rows (a sum of one with a batch's values does not);
* ``read``: computed from a sum over a batch's rows (a ``reduce_sum`` or a contraction over the rows'
  axis) whose operand's padding rows were not zero: the equation that read them.

A result whose ``read`` is set includes padding examples. Sums are what losses, gradients and metrics
are made of; a maximum or a sort over the rows is not followed. Loop bodies (``scan``, ``while``) and
``cond`` branches are not entered (a sum there is not reported, their results keep what their inputs
read). Where nothing is certain the analysis stays quiet: a warning must not be a false alarm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpustrat._src import jax_compat as compat
from tpustrat._src.batch_rows import Rows, equation_rows

__all__ = ["PaddingReadWarning", "Value", "padding_reads"]


class PaddingReadWarning(UserWarning):
  """An output of `strategy.run` sums over a padded batch's rows, padding rows included: on a partial batch
  it counts the padding examples (TF hands a replica only its real rows, so TF code never masks). Use
  `tpustrat.compute_average_loss`, or mask with `tpustrat.valid_mask(batch)`."""


@dataclasses.dataclass(frozen=True)
class Value:
  rows: Rows = Rows.NONE
  zero: bool = False
  mask: bool = False
  read: Any = None  # (the equation that summed unmasked padding rows, the batches whose rows it summed)


_ZERO_TO_ZERO = frozenset({
    "neg", "convert_element_type", "copy", "copy_p", "sin", "tan", "tanh", "sqrt", "cbrt", "abs", "sign", "square",
    "real", "imag", "reduce_precision", "stop_gradient", "pvary", "pcast", "name", "optimization_barrier", "expm1",
    "log1p", "asin", "atan", "sinh", "asinh", "atanh", "erf", "erf_inv", "round", "floor", "ceil", "mesh_cast",
    "reshard", "sharding_constraint", "device_put", "broadcast_in_dim", "reshape", "transpose", "squeeze",
    "expand_dims", "slice", "rev", "dynamic_slice", "psum", "psum_invariant", "pmax", "pmin", "all_gather",
    "all_gather_invariant", "reduce_scatter", "psum_scatter", "ppermute", "all_to_all", "reduce_sum",
    "reduce_max", "reduce_min", "cumsum", "cummax", "cummin",
})
_ALL_ZERO = frozenset({"add", "add_any", "sub", "max", "min", "concatenate", "clamp"})
# What a mask stays a mask through: comparisons and logic (``iota < count``), casts and layout changes.
# Anything else computed from a mask (a sum with it, a product with other values) is not a mask any more:
# a product zeroes the padding rows (``zero``), a sum does not.
_KEEP_MASK = frozenset({
    "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "xor", "convert_element_type", "broadcast_in_dim",
    "reshape", "squeeze", "expand_dims", "transpose", "slice", "dynamic_slice", "copy", "copy_p", "pvary", "pcast",
    "select_n", "name", "stop_gradient", "lt_to", "le_to",
})
_ANY_ZERO = frozenset({"mul", "dot_general", "and"})


def _literal_zero(atom: Any) -> bool:
  try:
    return bool(np.all(np.asarray(compat.literal_value(atom)) == 0))
  except (TypeError, ValueError):
    return False


def padding_reads(jaxpr: Any, inputs: Sequence[Value]) -> list[Value]:
  """The `Value` of each result of the open `jaxpr`, given those of its inputs."""
  env: dict[Any, Value] = {}

  def read(atom: Any) -> Value:
    if compat.is_literal(atom):
      return Value(zero=_literal_zero(atom))
    return env.get(atom, Value())

  for v, x in zip(jaxpr.invars, inputs):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    outs = _equation(eqn, ins)
    for v, x in zip(eqn.outvars, outs):
      if not compat.is_drop_var(v):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, ins: list[Value]) -> list[Value]:
  name = eqn.primitive.name
  n_out = len(eqn.outvars)
  earlier = next((x.read for x in ins if x.read is not None), None)
  # A mask stays one through comparisons, logic, casts and layout, and through arithmetic with values
  # that hold no batch's rows (``min(count_a, count_b)``, ``count - i * m``); arithmetic with a batch's
  # rows (``loss + 0 * mask``) makes a value, not a mask.
  mask = any(x.mask for x in ins) and (name in _KEEP_MASK or all(x.mask or not x.rows.carries_rows for x in ins))
  body = compat.call_body(eqn)
  if body is not None:  # jit, checkpoint, custom_jvp / custom_vjp: the body computes the results
    sub, _ = body
    if len(sub.invars) == len(ins):
      return padding_reads(sub, ins)
  rows = equation_rows(eqn, [x.rows for x in ins])
  if len(rows) != n_out:
    rows = [Rows.NONE] * n_out
  if body is not None or name in ("cond", "while") or compat.is_scan(eqn):
    return [Value(r, False, any(x.mask for x in ins), earlier) for r in rows]
  found = earlier if earlier is not None else _sums_padding(eqn, ins)
  if name == "select_n":
    zero = ins[0].mask or all(x.zero for x in ins[1:])
  elif name in _ANY_ZERO:
    zero = any(x.zero or x.mask for x in ins)
  elif name == "div":
    zero = ins[0].zero
  elif name in _ALL_ZERO:
    zero = all(x.zero for x in ins)
  elif name == "integer_pow":
    zero = ins[0].zero and int(eqn.params.get("y", 0)) > 0
  elif name in _ZERO_TO_ZERO or name.startswith("conv_general"):
    zero = bool(ins) and ins[0].zero or (name.startswith("conv_general") and any(x.zero for x in ins))
  elif name == "pad":
    zero = ins[0].zero and ins[1].zero
  elif name.startswith("scatter"):  # (operand, indices, updates): zeros scattered into zeros
    zero = len(ins) >= 3 and ins[0].zero and ins[2].zero
  elif name == "gather":  # values read from a zero operand
    zero = ins[0].zero
  else:
    zero = False
  return [Value(r, zero, mask, found) for r in rows]


def _sums_padding(eqn: Any, ins: list[Value]) -> Any:
  """(`eqn`, the batches) if it sums over a batch's rows operands whose padding rows may be nonzero, else
  None."""
  name = eqn.primitive.name
  if name == "reduce_sum":
    x = ins[0]
    axes = tuple(eqn.params.get("axes", ()))
    if x.rows.batches and not x.rows.is_unknown and x.rows.axis in axes and not (x.zero or x.mask):
      return eqn, x.rows.batches
    return None
  if name == "dot_general":
    (lc, rc), _ = eqn.params["dimension_numbers"]
    contracted = [x for x, dims in zip(ins, (lc, rc))
                  if x.rows.batches and not x.rows.is_unknown and x.rows.axis in tuple(dims)]
    if contracted and not any(x.zero or x.mask for x in ins):
      return eqn, frozenset().union(*(x.rows.batches for x in contracted))
  return None
