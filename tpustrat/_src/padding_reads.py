"""Which results of a step read a padded batch's padding rows: read from its jaxpr.

A partial batch reaches each replica padded (with copies of a real row, or zero rows:
`InputOptions.experimental_padding`). TF hands each replica fewer rows instead, so TF code never masks:
ported literally, its loss (``compute_average_loss`` aside) sums the padding examples' losses and trains on
them, silently. This module finds such reads in the step's program, so that `run` can warn
(`PaddingReadWarning`), once per program, naming the output and the fix.

Each value is followed with its `Rows` (`batch_rows`) and these facts:

* ``zero``: its padding rows are zero. A zero-padded batch's arrays are; the property survives operations
  that map zeros to zeros (products, linear maps, ``tanh``, layout changes, a comparison ``w > 0``) and is
  lost by those that do not (adding a bias, ``exp``, ``log``), and by a reduction over the rows (a value
  without rows is zero only if it is 0);
* ``mask``: computed from the step's real-row counts by comparisons, logic, casts, layout changes and
  arithmetic with values that hold no batch's rows (`tpustrat.valid_mask`, `compute_average_loss`, the
  embedding's padding, ``min`` of two batches' counts): a product with, or a selection by, such a value
  zeroes the padding rows (a sum of one with a batch's values does not);
* ``read``: what read the padding rows, ``(equation, batches, how)``: a sum over a batch's rows (a
  ``reduce_sum`` or a contraction over the rows' axis, also inside ``lax.cond`` branches and ``lax.scan``
  bodies, and a scan's carry adding up one row after another) whose operand's padding rows were not zero
  (``"sum"``); a masked sum over the rows divided by the rows' per-replica count, a per-replica mean whose
  denominator counts the padding (``"mean"``, with more than one replica); a running sum along the rows
  (``cumsum``) taken out of the rows (``"running"``); a reduction along an axis that pairs the rows with
  the rows (``z @ z.T``, ``"cross"``);
* ``row_sum``, ``partial``, ``cross``, ``const``: what those rules need (see `Value`).

A result whose ``read`` is set includes padding examples. A maximum, a median or a top-k over the rows is
not followed; a sum over values whose rows were lost (`batch_rows`: a merge with another axis, a
``while_loop``) is named in the warning as not checked. Where nothing is certain the analysis stays quiet:
a warning must not be a false alarm.
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
  # (the `reduce_sum`, its batches, the rows' per-replica size): a sum over a batch's rows, masked: divided
  # by that size it is a per-replica mean, whose denominator counts the padding rows.
  row_sum: Any = None
  # (the `cumsum`, its batches): running sums along a batch's rows, padding included past the real rows;
  # read when one of them leaves the rows (``jnp.cumsum(x)[-1]``).
  partial: Any = None
  # (the `dot_general`, its batches, the axis): a batch's rows on one more axis than `rows.axis`, from a
  # product of the rows with themselves (``z @ z.T``): a reduction over that axis reads the padding.
  cross: Any = None
  const: float | None = None  # a scalar constant (a literal, cast or made varying)


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


def padding_reads(jaxpr: Any, inputs: Sequence[Value], replicas: int = 1,
                  unfollowed: set[str] | None = None) -> list[Value]:
  """The `Value` of each result of the open `jaxpr`, given those of its inputs. `replicas`: the number of
  replicas (with one, a per-replica mean is the global batch's). `unfollowed` collects the primitives
  whose rows the analysis lost before a sum over them (named in the warning)."""
  env: dict[Any, Value] = {}

  def read(atom: Any) -> Value:
    if compat.is_literal(atom):
      value = np.asarray(compat.literal_value(atom))
      return Value(zero=_literal_zero(atom), const=float(value) if value.ndim == 0 and value.dtype.kind in "biuf"
                   else None)
    return env.get(atom, Value())

  for v, x in zip(jaxpr.invars, inputs):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    outs = _equation(eqn, ins, replicas, unfollowed)
    for v, x in zip(eqn.outvars, outs):
      if not compat.is_drop_var(v):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, ins: list[Value], replicas: int, unfollowed: set[str] | None) -> list[Value]:
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
      return padding_reads(sub, ins, replicas, unfollowed)
  rows = equation_rows(eqn, [x.rows for x in ins])
  if len(rows) != n_out:
    rows = [Rows.NONE] * n_out
  if name == "cond" and eqn.params.get("branches"):
    return _cond(eqn, ins, rows, replicas, unfollowed, earlier)
  if compat.is_scan(eqn):
    return _scan(eqn, ins, rows, replicas, unfollowed, earlier)
  if body is not None or name == "while":  # not entered: its results keep what its inputs read
    return [Value(r, False, any(x.mask for x in ins), earlier) for r in rows]
  if name == "sort" and ins and _on_rows(ins[0], eqn.params.get("dimension")):
    rows = [x.rows for x in ins]  # sorted along the rows: the same rows (as a set) for a sum over them
  cross = _cross(eqn, ins)
  if cross is not None:  # ``z @ z.T``: the rows on the result's first axis, followed
    rows = [Rows.of(cross[1], 0)]
  found = earlier if earlier is not None else _sums_padding(eqn, ins, replicas, unfollowed)
  if name == "mul" and any(x.const == 0 for x in ins):  # ``sum(x) * 0.0``: nothing of it is left
    found = None
  clears = _clears_padding(name, ins)
  if name == "select_n":
    zero = ins[0].mask or (ins[1].zero if ins[0].zero else all(x.zero for x in ins[1:]))
  elif name in ("gt", "lt", "ne"):  # false where both sides are 0 (``batch["w"] > 0``)
    zero = all(x.zero for x in ins)
  elif name in _ANY_ZERO:
    zero = any(x.zero or x.mask for x in ins)
  elif name == "div":
    zero = ins[0].zero
  elif name in _ALL_ZERO:
    zero = all(x.zero for x in ins)
  elif name == "integer_pow":
    zero = ins[0].zero and int(eqn.params.get("y", 0)) > 0
  elif name in _CUMULATIVE and ins and _on_rows(ins[0], eqn.params.get("axis")):
    zero = False  # a running sum's padding rows hold the real rows' total
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
  row_sum = _row_sum(eqn, ins)
  partial = None if clears else next((x.partial for x in ins if x.partial is not None), None)
  if name in _CUMULATIVE and ins and _on_rows(ins[0], eqn.params.get("axis")) and not (ins[0].zero or ins[0].mask):
    partial = (eqn, ins[0].rows.batches)
  carried = any(x.rows.carries_rows for x in ins)
  outs = []
  for r, v in zip(rows, eqn.outvars):
    out_found = found
    if out_found is None and partial is not None and carried and not r.carries_rows:
      out_found = (partial[0], partial[1], "running")  # a running sum past the real rows, taken out of them
    # A value summed over a batch's rows has no padding rows: it is zero on them only if it is zero.
    out_zero = zero and (r.carries_rows or not carried)
    out_cross = cross if cross is not None else None if clears else _kept_cross(ins, v)
    const = ins[0].const if name in _SAME_CONSTANT and len(ins) == 1 else None
    outs.append(Value(r, out_zero, mask, out_found, row_sum, partial if r.carries_rows else None, out_cross, const))
  return outs


_SAME_CONSTANT = frozenset({"pvary", "pcast", "convert_element_type", "copy", "copy_p", "reshape", "squeeze",
                            "expand_dims", "broadcast_in_dim"})


_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
# Operations that lose a batch's rows which the warning names when a sum follows them: those that merge or
# move rows as a step's own code does (a reshape merging them with another axis, a loop, an exchange
# between replicas). A gather or scatter is left unnamed: JAX's gradients of label lookups
# (``take_along_axis``) are made of them, and naming them would warn every classifier.
_NOTED = frozenset({"reshape", "while", "all_to_all", "ppermute", "rev"})


def _on_rows(x: Value, axis: Any) -> bool:
  """Whether `x` holds a batch's rows, known, on `axis`."""
  return bool(x.rows.batches) and not x.rows.is_unknown and not x.rows.item and x.rows.axis == axis


def _clears_padding(name: str, ins: list[Value]) -> bool:
  """Whether the equation zeroes what a mask or a zero-padded value says is padding (a selection by one,
  a product with one)."""
  if name == "select_n":
    return bool(ins) and (ins[0].mask or ins[0].zero)
  return name in ("mul", "and") and any(x.mask or (x.zero and x.rows.carries_rows) for x in ins)


def _cross(eqn: Any, ins: list[Value]) -> Any:
  """(`eqn`, batches, the result's axis of the right operand's rows) for a product of a batch's rows with
  the same batch's rows (``z @ z.T``: every row paired with every row, padding included), neither masked."""
  if eqn.primitive.name != "dot_general" or len(ins) != 2:
    return None
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = ins
  if lb or rb or not (lhs.rows.batches and rhs.rows.batches) or lhs.rows.is_unknown or rhs.rows.is_unknown:
    return None
  if lhs.rows.axis in lc or rhs.rows.axis in rc or lhs.mask or rhs.mask:  # (zero rows pair to 0, not -inf)
    return None
  if not lhs.rows.batches & rhs.rows.batches:
    return None
  lhs_free = [d for d in range(len(eqn.invars[0].aval.shape)) if d not in lc]
  rhs_free = [d for d in range(len(eqn.invars[1].aval.shape)) if d not in rc]
  if lhs_free.index(lhs.rows.axis) != 0:
    return None
  return eqn, lhs.rows.batches & rhs.rows.batches, len(lhs_free) + rhs_free.index(rhs.rows.axis)


def _kept_cross(ins: list[Value], out: Any) -> Any:
  """An input's `cross` when the result has its shape (elementwise); else the pairing is not followed."""
  shape = getattr(getattr(out, "aval", None), "shape", None)
  for x in ins:
    if x.cross is not None and shape is not None and x.cross[0].outvars[0].aval.shape == shape:
      return x.cross
  return None


def _row_sum(eqn: Any, ins: list[Value]) -> Any:
  """`Value.row_sum` of the result: a masked sum over a batch's rows, kept through casts."""
  name = eqn.primitive.name
  if name == "reduce_sum" and ins:
    x = ins[0]
    if _on_rows(x, x.rows.axis) and x.rows.axis in tuple(eqn.params.get("axes", ())) and (x.zero or x.mask):
      return eqn, x.rows.batches, eqn.invars[0].aval.shape[x.rows.axis]
  if name == "convert_element_type" and ins:
    return ins[0].row_sum
  return None


def _cond(eqn: Any, ins: list[Value], rows: list[Rows], replicas: int, unfollowed: set[str] | None,
          earlier: Any) -> list[Value]:
  """A `lax.cond`: each branch read, the results merged (a sum in either branch counts)."""
  per_branch = [padding_reads(compat.open_jaxpr(b)[0], ins[1:], replicas, unfollowed)
                for b in eqn.params["branches"]]
  outs = []
  for r, vs in zip(rows, zip(*per_branch)):
    found = earlier if earlier is not None else next((v.read for v in vs if v.read is not None), None)
    outs.append(Value(r, all(v.zero for v in vs), all(v.mask for v in vs), found))
  return outs


def _scan(eqn: Any, ins: list[Value], rows: list[Rows], replicas: int, unfollowed: set[str] | None,
          earlier: Any) -> list[Value]:
  """A `lax.scan`: its body read with the carries to a fixed point; a carry that adds up one row's values
  after another (a loop over the rows) sums them, padding included unless they are masked."""
  sig = compat.scan_signature(eqn)
  body, _ = compat.open_jaxpr(sig.body)
  nc, nk = sig.num_consts, sig.num_carry
  consts, carry, xs = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
  sliced = []
  for x in xs:  # as `batch_rows` slices them: a loop over the rows sees one row's values
    r = x.rows
    if r.item:
      r = Rows.unknown("scan")
    elif r.batches and not r.is_unknown and r.axis == 0:
      r = Rows.one_row(r.batches)
    elif r.batches:
      r = r.at(r.axis - 1, "scan")
    sliced.append(dataclasses.replace(x, rows=r, row_sum=None, partial=None, cross=None))
  outs: list[Value] = []
  for _ in range(3):  # each pass can only add reads and take zeros away: a fixed point is near
    outs = padding_reads(body, [*consts, *carry, *sliced], replicas, unfollowed)
    new = []
    for c, o in zip(carry, outs[:nk]):
      found = c.read or o.read
      if found is None and o.rows.item and not c.rows.item and not (o.zero or o.mask):
        found = (eqn, o.rows.batches, "sum")  # ``total + loss(row)`` over the rows
      new.append(Value(c.rows, c.zero and o.zero, c.mask and o.mask, found))
    if new == carry:
      break
    carry = new
  ys = [Value(r, o.zero, o.mask, o.read if o.read is not None else earlier) for r, o in zip(rows[nk:], outs[nk:])]
  carry = [dataclasses.replace(c, rows=r, read=c.read if c.read is not None else earlier)
           for c, r in zip(carry, rows[:nk])]
  return [*carry, *ys]


def _sums_padding(eqn: Any, ins: list[Value], replicas: int, unfollowed: set[str] | None) -> Any:
  """(`eqn`, the batches, how) if it reads a batch's padding rows: a sum over the rows of an operand whose
  padding rows may be nonzero (``"sum"``), a masked sum over them divided by their per-replica count, a
  per-replica mean (``"mean"``), or a reduction along the rows paired with the rows (``"cross"``); else
  None. A sum over rows it lost track of is noted in `unfollowed`."""
  name = eqn.primitive.name
  if name in ("reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin") and ins:
    x = ins[0]
    axes = tuple(eqn.params.get("axes", ()))
    if x.cross is not None and x.cross[2] in axes:
      return x.cross[0], x.cross[1], "cross"
    if name != "reduce_sum":
      return None
    if x.rows.is_unknown and not (x.zero or x.mask):
      if unfollowed is not None and x.rows.unknown_via in _NOTED:
        unfollowed.add(x.rows.unknown_via)
      return None
    if x.rows.batches and not x.rows.item and x.rows.axis in axes and not (x.zero or x.mask):
      return eqn, x.rows.batches, "sum"
    return None
  if name == "div" and replicas > 1 and len(ins) == 2 and ins[0].row_sum is not None:
    _, batches, size = ins[0].row_sum
    return (eqn, batches, "mean") if ins[1].const == size else None
  if name == "dot_general":
    (lc, rc), _ = eqn.params["dimension_numbers"]
    contracted = [x for x, dims in zip(ins, (lc, rc))
                  if x.rows.batches and not x.rows.is_unknown and not x.rows.item and x.rows.axis in tuple(dims)]
    if contracted and not any(x.zero or x.mask for x in ins):
      return eqn, frozenset().union(*(x.rows.batches for x in contracted)), "sum"
  return None
