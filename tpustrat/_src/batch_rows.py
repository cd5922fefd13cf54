"""Which outputs of a step keep a padded batch's rows on their leading axis: read from the step's program.

A partial batch reaches each replica padded to the usual per-replica size ``k``. An output of `run` whose
axis 0 holds that batch's rows, one for one (per-example logits, a per-example loss), must skip the same
padding rows when the caller reduces or gathers it along ``axis=0``; an output that merely happens to
have ``k`` rows (a per-replica statistic of size 2 on a step with ``k = 2``) must not. The shape alone
cannot tell the two apart, so `leading_rows` follows each batch's rows through the step's jaxpr.

Each value gets a `Rows`:

* ``Rows.of({b}, axis)``: axis `axis` of the value is row for row axis 0 of batch ``b``. Rows are
  followed wherever an operation moves them whole: elementwise arithmetic, transposes, reshapes that keep
  the axis, reductions and contractions over other axes, the batch dimensions of matmuls, convolutions
  and gathers, pooling windows over other axes, calls, ``lax.cond`` and ``lax.scan`` carries;
* ``Rows.of({b}, axis, part=True)``: axis `axis` holds a part of batch ``b``'s rows, consecutive ones
  (a micro-batch): the rows reshaped into ``[k, rows / k, ...]`` (on the second of the two axes), and,
  in the body of a ``lax.scan`` over the first, one micro-batch. Which part is not known (inside the loop
  it is the step counter's), so a part is never taken for the batch's rows: a sum over it is still a sum
  over the batch's rows, padding included unless masked;
* ``Rows.NONE``: no batch's rows (never came from a batch, or were summed away: a reduction over the rows,
  a contraction over them, a collective mixing replicas);
* ``Rows.unknown(primitive)``: rows went through an operation that moves, reorders or merges them in a
  way not followed here (a sort, flip or shift along the rows (a running sum keeps them in place), a reshape merging them with another axis,
  a gather by computed indices, a ``while`` loop, two batches combined row by row). Unknown is never
  NONE: where the rows went is not known, so nothing is concluded from it.

An output whose `Rows` is ``of({b}, 0)`` has batch ``b``'s rows on axis 0; anything unknown is reported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
from jax import lax

from tpustrat._src import jax_compat as compat
from tpustrat._src.losses import BatchRowsWarning

__all__ = ["BatchRowsWarning", "Rows", "equation_rows", "leading_rows", "same_rows"]


@dataclasses.dataclass(frozen=True)
class Rows:
  """Where a value holds batch rows: the batches in `batches` on axis `axis`, none, or unknown."""

  batches: frozenset[int] = frozenset()
  axis: int = 0
  unknown_via: str | None = None  # the primitive that lost track of them
  item: bool = False  # one row's data (inside a scan over the rows): no rows axis of its own
  part: bool = False  # some of the rows (a micro-batch of them), not all

  NONE: ClassVar[Rows]  # no batch's rows (set below)

  @staticmethod
  def of(batches: Any, axis: int = 0, part: bool = False) -> Rows:
    return Rows(frozenset(batches), axis, part=part)

  @staticmethod
  def unknown(via: str) -> Rows:
    return Rows(frozenset(), 0, via)

  @staticmethod
  def one_row(batches: Any, part: bool = False) -> Rows:
    """Inside a loop over the rows of `batches` (or over a `part` of them): one row's values, whatever their
    shape."""
    return Rows(frozenset(batches), 0, None, True, part)

  @property
  def is_unknown(self) -> bool:
    return self.unknown_via is not None

  @property
  def carries_rows(self) -> bool:
    return self.is_unknown or bool(self.batches)

  def at(self, axis: int | None, via: str) -> Rows:
    """These rows moved to `axis` (None: gone from the value, summed away)."""
    if not self.batches:
      return self
    return Rows.NONE if axis is None else Rows(self.batches, axis, part=self.part)

  def join(self, other: Rows, via: str) -> Rows:
    """Rows of a value computed position by position from both (elementwise, say)."""
    if self.is_unknown:
      return self
    if other.is_unknown:
      return other
    if not other.batches:
      return self
    if not self.batches:
      return other
    if self.axis != other.axis or self.part != other.part:
      return Rows.unknown(via)
    return Rows(self.batches | other.batches, self.axis, part=self.part)


Rows.NONE = Rows()

_ACROSS_REPLICAS = ("psum", "pmax", "pmin", "pmean", "all_gather", "reduce_scatter", "psum_scatter", "pbroadcast",
                    "pgather", "all_reduce")
_MOVING_BETWEEN_REPLICAS = ("all_to_all", "ppermute")
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "reduce_xor", "argmax", "argmin"})
# Primitives whose output position i reads only input position i (elementwise), or that pass values
# through (identities, casts, annotations). Anything not listed and not given a rule below is unknown.
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "bessel_i0e",
    "bessel_i1e", "cbrt", "ceil", "clamp", "clz", "complex", "conj", "convert_element_type", "copy", "copy_p",
    "cos", "cosh", "device_put", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1",
    "floor", "ge", "gt", "igamma", "igamma_grad_a", "igammac", "imag", "integer_pow", "is_finite", "le",
    "lgamma", "log", "log1p", "logistic", "lt", "lt_to", "le_to", "max", "mesh_cast", "min", "mul", "name", "ne", "neg",
    "nextafter", "not", "optimization_barrier", "or", "pcast", "polygamma", "population_count", "pow",
    "pvary", "random_gamma_grad", "real", "reduce_precision", "regularized_incomplete_beta", "rem", "reshard",
    "round", "rsqrt", "select_n", "sharding_constraint", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh",
    "tie_in", "tpustrat_assign_to_logical_device", "xor", "zeta",
})
# No inputs that could carry rows into their result.
_SOURCES = frozenset({"iota", "rng_bit_generator", "random_seed", "random_wrap", "random_unwrap", "random_bits",
                      "axis_index", "threefry2x32", "random_fold_in", "random_split"})


def _tpustrat_same_rows(x: Any, like: Any) -> Any:
  del like
  return x


_same_rows = jax.jit(_tpustrat_same_rows)
_SAME_ROWS = _tpustrat_same_rows.__name__


def same_rows(x: Any, like: Any) -> Any:
  """`x` (an array, or a pytree of arrays), with its axis 0 declared to hold the rows of array `like` on
  its axis 0: for library code that sends rows away and brings them back in order (an embedding lookup
  over `all_to_all`), which `leading_rows` cannot follow. A call that XLA inlines; `like` gets no
  gradient."""
  return jax.tree.map(lambda leaf: _same_rows(leaf, lax.stop_gradient(like)), x)


def _shape(v: Any) -> tuple[int, ...]:
  return tuple(getattr(v.aval, "shape", ()))


def leading_rows(jaxpr: Any, inputs: Sequence[Rows]) -> list[Rows]:
  """The `Rows` of each result of the open `jaxpr`, given those of its inputs (consts: `Rows.NONE`)."""
  env: dict[Any, Rows] = {}

  def read(atom: Any) -> Rows:
    if compat.is_literal(atom):
      return Rows.NONE
    return env.get(atom, Rows.NONE)

  for v, r in zip(jaxpr.invars, inputs):
    env[v] = r
  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    if not any(r.carries_rows for r in ins):
      outs = [Rows.NONE] * len(eqn.outvars)
    else:
      outs = _equation(eqn, ins)
    for v, r in zip(eqn.outvars, outs):
      if not compat.is_drop_var(v):
        env[v] = r if _shape(v) or r.item else Rows.NONE  # a scalar holds no rows
  return [read(v) for v in jaxpr.outvars]


def equation_rows(eqn: Any, ins: list[Rows]) -> list[Rows]:
  """The `Rows` of `eqn`'s results given those of its inputs (one equation of `leading_rows`), for
  analyses that follow the rows alongside something else (`padding_reads`)."""
  if not any(r.carries_rows for r in ins):
    return [Rows.NONE] * len(eqn.outvars)
  return [r if _shape(v) or r.item else Rows.NONE for v, r in zip(eqn.outvars, _equation(eqn, ins))]


def _join_all(rows: Sequence[Rows], via: str) -> Rows:
  out = Rows.NONE
  for r in rows:
    out = out.join(r, via)
  return out


def _equation(eqn: Any, ins: list[Rows]) -> list[Rows]:
  """Rows of `eqn`'s results, at least one input carrying rows."""
  name = eqn.primitive.name
  params = eqn.params
  n_out = len(eqn.outvars)
  unknown = Rows.unknown(name)
  if any(r.is_unknown for r in ins) and params.get("name") != _SAME_ROWS:  # unknown rows stay unknown
    return [next(r for r in ins if r.is_unknown)] * n_out
  items = [r for r in ins if r.item]
  if items:
    # One row's values (a scan over the rows): whatever is computed from them is that row's, unless it
    # is combined with whole rows, or with other replicas.
    if any(r.batches and not r.item for r in ins) or len({r.batches for r in items}) > 1:
      return [unknown] * n_out
    if name.startswith(_MOVING_BETWEEN_REPLICAS) or compat.collective_axes(eqn) is not None:
      return [unknown] * n_out
    return [items[0]] * n_out

  if params.get("name") == _SAME_ROWS and len(ins) == 2:  # `same_rows`: the rows of `like`
    return [ins[1] if ins[1].axis == 0 else unknown]
  body = compat.call_body(eqn)
  if body is not None:  # jit, checkpoint, custom_jvp / custom_vjp: the body computes the results
    sub, _ = body
    return leading_rows(sub, ins) if len(sub.invars) == len(ins) else [unknown] * n_out
  if compat.is_scan(eqn):
    return _scan(eqn, ins)
  if name == "cond":
    branches = params.get("branches", ())
    if ins[0].carries_rows or not branches:
      return [unknown] * n_out  # the branch taken depends on rows
    per_branch = [leading_rows(compat.open_jaxpr(b)[0], ins[1:]) for b in branches]
    return [rs[0] if all(r == rs[0] for r in rs) else unknown for rs in zip(*per_branch)]
  if name.startswith(_MOVING_BETWEEN_REPLICAS):
    return [unknown] * n_out  # rows sent to other replicas (and perhaps back): not followed
  if compat.collective_axes(eqn) is not None or name.startswith(_ACROSS_REPLICAS):
    # Sums or gathers over replicas: values of other replicas (with their own padding) in every row.
    return [Rows.NONE] * n_out
  if name in _SOURCES:
    return [Rows.NONE] * n_out
  if name in _ELEMENTWISE:
    if n_out > 1:  # pass-throughs with several results (optimization_barrier): result i is input i
      return list(ins) if len(ins) == n_out else [unknown] * n_out
    return [_elementwise(eqn, ins)]
  rule = _RULES.get(name)
  if rule is None:
    for prefix, r in _PREFIX_RULES:
      if name.startswith(prefix):
        rule = r
        break
  if rule is None:
    return [unknown] * n_out
  out = rule(eqn, ins)
  return out if isinstance(out, list) else [out] * n_out


def _elementwise(eqn: Any, ins: list[Rows]) -> Rows:
  """Operands of the result's shape (or broadcast along axes of size 1 that are not the rows) keep their
  rows in place."""
  shape = _shape(eqn.outvars[0])
  for a, r in zip(eqn.invars, ins):
    if r.batches:
      s = _shape(a)
      if len(s) != len(shape) or s[r.axis] != shape[r.axis]:
        return Rows.unknown(eqn.primitive.name)
  return _join_all(ins, eqn.primitive.name)


def _reduction(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  axes = tuple(eqn.params.get("axes", ()))
  if r.axis in axes:
    return Rows.NONE  # summed (or maxed, ...) over the rows
  return r.at(r.axis - sum(1 for a in axes if a < r.axis), eqn.primitive.name)


def _along(dim_param: str, default: int = 0):
  """Operations that move values along one axis (cumulative sums, sorts): rows along it are reordered."""
  def rule(eqn: Any, ins: list[Rows]) -> Any:
    dim = int(eqn.params.get(dim_param, default))
    rows = _join_all(ins, eqn.primitive.name)
    ndim = len(_shape(eqn.invars[0]))
    if rows.batches and dim % max(ndim, 1) == rows.axis:
      return Rows.unknown(eqn.primitive.name)
    return rows
  return rule


def _rev(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  return Rows.unknown("rev") if r.axis in tuple(eqn.params.get("dimensions", ())) else r


def _broadcast_in_dim(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  dims = tuple(eqn.params.get("broadcast_dimensions", ()))
  op, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  if r.axis >= len(dims) or op[r.axis] != out[dims[r.axis]]:
    return Rows.unknown("broadcast_in_dim")  # rows of size 1 broadcast to many: not rows any more
  return r.at(dims[r.axis], "broadcast_in_dim")


def _reshape(eqn: Any, ins: list[Rows]) -> Rows:
  """Row-major reshape: the rows' axis survives where the sizes before it multiply to the same and the
  axis keeps its size; split into two axes ``[k, rows / k]`` (micro-batches), the second holds a part of
  the rows."""
  r = ins[0]
  if eqn.params.get("dimensions") is not None:
    return Rows.unknown("reshape")
  op, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  before = math.prod(op[:r.axis])
  for j in range(len(out)):
    if math.prod(out[:j]) == before and out[j] == op[r.axis]:
      return r.at(j, "reshape")
  for j in range(len(out) - 1):
    if not r.part and math.prod(out[:j]) == before and out[j] * out[j + 1] == op[r.axis]:
      return Rows.of(r.batches, j + 1, part=True)
  return Rows.unknown("reshape")  # merged with other axes, or split into more than two


def _squeeze(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  dims = tuple(eqn.params.get("dimensions", ()))
  if r.axis in dims:
    return Rows.unknown("squeeze")
  return r.at(r.axis - sum(1 for d in dims if d < r.axis), "squeeze")


def _expand_dims(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  out_ndim = len(_shape(eqn.outvars[0]))
  dims = sorted(d % out_ndim for d in eqn.params.get("dimensions", ()))
  axis = r.axis
  for d in dims:
    if d <= axis:
      axis += 1
  return r.at(axis, "expand_dims")


def _transpose(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  return r.at(tuple(eqn.params["permutation"]).index(r.axis), "transpose")


def _dot_general(eqn: Any, ins: list[Rows]) -> Rows:
  """Result axes: the batch dimensions, then lhs's free dimensions, then rhs's."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs_free = [d for d in range(len(_shape(eqn.invars[0]))) if d not in lc and d not in lb]
  rhs_free = [d for d in range(len(_shape(eqn.invars[1]))) if d not in rc and d not in rb]

  def place(r: Rows, contract: Sequence[int], batch: Sequence[int], free: list[int], offset: int) -> Rows:
    if not r.batches:
      return r
    if r.axis in contract:
      return Rows.NONE  # summed over the rows
    if r.axis in batch:
      return r.at(list(batch).index(r.axis), "dot_general")
    return r.at(len(lb) + offset + free.index(r.axis), "dot_general")

  lhs = place(ins[0], lc, lb, lhs_free, 0)
  rhs = place(ins[1], rc, rb, rhs_free, len(lhs_free))
  return lhs.join(rhs, "dot_general")


def _conv(eqn: Any, ins: list[Rows]) -> Rows:
  dn = eqn.params.get("dimension_numbers")
  lhs_spec, out_spec = getattr(dn, "lhs_spec", None), getattr(dn, "out_spec", None)
  lhs, rhs = ins
  if rhs.batches or lhs_spec is None or out_spec is None or int(eqn.params.get("batch_group_count", 1)) != 1:
    return Rows.unknown("conv_general_dilated")
  if lhs.axis != lhs_spec[0]:
    return Rows.unknown("conv_general_dilated")  # rows on a spatial or feature axis
  return lhs.at(out_spec[0], "conv_general_dilated")


def _concatenate(eqn: Any, ins: list[Rows]) -> Rows:
  dim = int(eqn.params.get("dimension", 0))
  rows = _join_all(ins, "concatenate")
  if rows.is_unknown:
    return rows
  if rows.batches and dim == rows.axis:
    return Rows.unknown("concatenate")
  for a, r in zip(eqn.invars, ins):  # an operand without rows must not sit where the rows are
    if not r.batches and rows.batches and _shape(a)[rows.axis] != _shape(eqn.outvars[0])[rows.axis]:
      return Rows.unknown("concatenate")
  return rows


def _slice(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  start, limit = eqn.params.get("start_indices", ()), eqn.params.get("limit_indices", ())
  strides = eqn.params.get("strides") or (1,) * len(start)
  whole = start[r.axis] == 0 and limit[r.axis] == _shape(eqn.invars[0])[r.axis] and strides[r.axis] == 1
  return r if whole else Rows.unknown("slice")


def _dynamic_slice(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  if any(x.batches for x in ins[1:]):
    return Rows.unknown("dynamic_slice")
  whole = tuple(eqn.params.get("slice_sizes", ()))[r.axis] == _shape(eqn.invars[0])[r.axis]
  return r if whole or not r.batches else Rows.unknown("dynamic_slice")


def _dynamic_update_slice(eqn: Any, ins: list[Rows]) -> Rows:
  operand, update = ins[0], ins[1]
  if any(x.batches for x in ins[2:]):
    return Rows.unknown("dynamic_update_slice")
  rows = operand.join(update, "dynamic_update_slice")
  if rows.batches and _shape(eqn.invars[1])[rows.axis] != _shape(eqn.invars[0])[rows.axis]:
    return Rows.unknown("dynamic_update_slice")  # only some rows replaced
  return rows


def _pad(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  if ins[1].batches:
    return Rows.unknown("pad")
  config = eqn.params.get("padding_config", ())
  return r if tuple(config[r.axis]) == (0, 0, 0) else Rows.unknown("pad")


def _gather(eqn: Any, ins: list[Rows]) -> Rows:
  """``operand[indices]``: the result's non-offset axes are the indices' axes (but the index vector, kept
  last by JAX), in order; its offset axes are the operand's axes that are neither collapsed nor batching,
  in order. Batching axes pair an operand axis with an indices axis (``take_along_axis``)."""
  operand, indices = ins
  dn = eqn.params.get("dimension_numbers")
  offset = tuple(getattr(dn, "offset_dims", ()))
  collapsed = tuple(getattr(dn, "collapsed_slice_dims", ()))
  op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
  op_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  idx_ndim = len(_shape(eqn.invars[1]))
  sizes = eqn.params.get("slice_sizes")
  non_offset = [d for d in range(len(out_shape)) if d not in offset]
  idx_axes = list(range(idx_ndim - 1))  # the index vector is the last axis

  def from_indices(axis: int) -> int | None:
    return non_offset[idx_axes.index(axis)] if axis in idx_axes else None

  out = Rows.NONE
  if indices.batches:
    axis = from_indices(indices.axis)
    if axis is None:
      return Rows.unknown("gather")
    out = indices.at(axis, "gather")
  if operand.batches and op_shape[operand.axis] == 1 and indices.batches:
    return out  # one row per replica: the only row is read, in the indices' rows
  if operand.batches:
    a = operand.axis
    if a in op_batch:  # paired with an indices axis: row i reads row i
      axis = from_indices(idx_batch[op_batch.index(a)])
    elif a not in collapsed and sizes is not None and sizes[a] == op_shape[a]:
      kept = [d for d in range(len(op_shape)) if d not in collapsed and d not in op_batch]
      axis = offset[kept.index(a)]  # the whole axis taken in every slice
    else:
      axis = None  # rows chosen by the indices
    if axis is None:
      return Rows.unknown("gather")
    out = out.join(operand.at(axis, "gather"), "gather")
  return out


def _scatter(eqn: Any, ins: list[Rows]) -> Rows:
  """Updates land where the indices say: the result keeps the operand's rows only if none arrive."""
  if any(r.batches for r in ins[1:]):
    return Rows.unknown(eqn.primitive.name)
  return ins[0]


def _reduce_window(eqn: Any, ins: list[Rows]) -> Any:
  """Pooling: rows stay where the window along them is one row, stride one, no padding."""
  r = _join_all(ins, eqn.primitive.name)
  dims = eqn.params.get("window_dimensions", ())
  strides = eqn.params.get("window_strides", ())
  padding = eqn.params.get("padding", ())
  dilation = eqn.params.get("window_dilation") or (1,) * len(dims)
  if not r.batches:
    return [r] * len(eqn.outvars)
  a = r.axis
  if a < len(dims) and dims[a] == 1 and strides[a] == 1 and tuple(padding[a]) == (0, 0) and dilation[a] == 1:
    return [r] * len(eqn.outvars)
  return [Rows.unknown(eqn.primitive.name)] * len(eqn.outvars)


def _last_axis(eqn: Any, ins: list[Rows]) -> Any:
  """top_k and friends act along the last axis."""
  r = ins[0]
  ndim = len(_shape(eqn.invars[0]))
  out = Rows.unknown(eqn.primitive.name) if r.batches and r.axis == ndim - 1 else r
  return [out] * len(eqn.outvars)


def _bitcast(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  op, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  return r if r.axis < min(len(op), len(out)) and op[r.axis] == out[r.axis] else Rows.unknown("bitcast")


def _split(eqn: Any, ins: list[Rows]) -> Any:
  r = ins[0]
  out = Rows.unknown("split") if r.batches and int(eqn.params.get("axis", 0)) == r.axis else r
  return [out] * len(eqn.outvars)


def _stack(eqn: Any, ins: list[Rows]) -> Rows:
  rows = _join_all(ins, "stack")
  if rows.is_unknown or not rows.batches:
    return rows
  ndim = len(_shape(eqn.outvars[0]))
  axis = int(eqn.params.get("axis", 0)) % ndim
  return rows.at(rows.axis + 1 if axis <= rows.axis else rows.axis, "stack")


def _tile(eqn: Any, ins: list[Rows]) -> Rows:
  r = ins[0]
  reps = tuple(eqn.params.get("reps", ()))
  ndim = len(_shape(eqn.invars[0]))
  offset = len(reps) - ndim  # reps may be longer: new leading axes
  if offset < 0 or reps[offset + r.axis] != 1:
    return Rows.unknown("tile")
  return r.at(r.axis + offset, "tile")


_RULES = {
    "stack": _stack, "tile": _tile,
    "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape, "squeeze": _squeeze,
    "expand_dims": _expand_dims, "transpose": _transpose, "dot_general": _dot_general,
    "conv_general_dilated": _conv, "concatenate": _concatenate, "slice": _slice,
    "dynamic_slice": _dynamic_slice, "dynamic_update_slice": _dynamic_update_slice, "pad": _pad,
    "gather": _gather, "rev": _rev, "sort": _along("dimension"), "top_k": _last_axis,
    "approx_top_k": _last_axis, "bitcast_convert_type": _bitcast, "split": _split,
    **{name: _reduction for name in _REDUCTIONS},
    # A running sum along the rows keeps row i at position i (what it adds up is the step's business).
    **{name: (lambda eqn, ins: _join_all(ins, eqn.primitive.name)) for name in _CUMULATIVE},
}
_PREFIX_RULES = (("scatter", _scatter), ("reduce_window", _reduce_window), ("select_and_", _reduce_window))


def _scan(eqn: Any, ins: list[Rows]) -> list[Rows]:
  """A `lax.scan`: carries iterate to a fixed point; a scanned-over input loses its axis 0 (the steps) in
  the body, and the stacked outputs gain one."""
  sig = compat.scan_signature(eqn)
  body, _ = compat.open_jaxpr(sig.body)
  nc, nk = sig.num_consts, sig.num_carry
  consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  sliced = []
  for r in xs:
    if r.item:
      sliced.append(Rows.unknown("scan"))  # a loop inside a loop over rows, over one row's values
    elif r.batches and r.axis == 0:
      sliced.append(Rows.one_row(r.batches, r.part))  # a loop over the rows themselves (lax.map per example)
    else:  # a loop over another axis: each step holds the rows (over ``[k, rows / k]``: a part of them)
      sliced.append(r.at(r.axis - 1, "scan") if r.batches else r)
  for _ in range(len(carry) + 2):  # each pass can only widen a carry's rows: a fixed point is near
    outs = leading_rows(body, [*consts, *carry, *sliced])
    # A carry that gathers one row after another adds the rows up (no row of its own); one whose rows
    # the body drops (or moves) is not known to hold them at the end.
    outs_carry = [Rows.NONE if o.item else o for o in outs[:nk]]
    new = [c if c == o else o if not c.carries_rows else c.join(o, "scan") if o.carries_rows
           else Rows.unknown("scan") for c, o in zip(carry, outs_carry)]
    if new == carry:
      break
    carry = new
  else:
    return [Rows.unknown("scan")] * len(eqn.outvars)
  # Stacked outputs: one row's values stacked over the rows are rows on axis 0 again.
  ys = [Rows.of(y.batches, 0, y.part) if y.item else y.at(y.axis + 1, "scan") if y.batches else y for y in outs[nk:]]
  return [*carry, *ys]
