"""Which outputs of a step keep a padded batch's rows on their leading axis: read from the step's program.

A partial batch reaches each replica padded to the usual per-replica size ``k``. An output of `run` whose
axis 0 holds that batch's rows, one for one (per-example logits, a per-example loss), must skip the same
padding rows when the caller reduces or gathers it along ``axis=0``; an output that merely happens to
have ``k`` rows (a per-replica statistic of size 2 on a step with ``k = 2``) must not. The shape alone
cannot tell the two apart, so `leading_rows` follows the batch's rows through the step's jaxpr.

The answer for each output is a `Rows`:

* ``Rows.of({b})``: axis 0 of the output is row for row axis 0 of batch ``b`` (every equation on the way
  keeps rows in place: elementwise arithmetic, matmuls and convolutions over the other axes, reductions
  over other axes, reshapes that keep the leading size, transposes that keep axis 0, calls and
  ``lax.scan`` carries, ...);
* ``Rows.NONE``: axis 0 is not a batch's rows (it was reduced, moved, gathered, exchanged between
  replicas, or never came from a batch);
* ``Rows.of({a, b})``: rows of two batches combined row by row: no single batch's padding applies;
* ``Rows.unknown(primitive)``: rows went through an operation whose effect on axis 0 is not modelled.

Rules are written per primitive; an unlisted primitive that receives rows gives `unknown` (never a guess).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from tpustrat._src import jax_compat as compat

__all__ = ["BatchRowsWarning", "Rows", "leading_rows"]


class BatchRowsWarning(UserWarning):
  """An output of `strategy.run` has a padded batch's per-replica size on axis 0, but its rows could not
  be traced to one batch: mark it with `tpustrat.per_example` to say whose rows it holds."""


@dataclasses.dataclass(frozen=True)
class Rows:
  """What axis 0 of a value is: rows of the batches in `batches`, no batch's rows, or unknown."""

  batches: frozenset[int] = frozenset()
  unknown_via: str | None = None  # the primitive that made it unknown

  NONE: ClassVar[Rows]  # no batch's rows (set below)

  @staticmethod
  def of(batches: Any) -> Rows:
    return Rows(frozenset(batches))

  @staticmethod
  def unknown(via: str) -> Rows:
    return Rows(frozenset(), via)

  @property
  def is_unknown(self) -> bool:
    return self.unknown_via is not None

  def join(self, other: Rows) -> Rows:
    """Rows of a value computed row by row from both (elementwise, say)."""
    if self.is_unknown:
      return self
    if other.is_unknown:
      return other
    return Rows(self.batches | other.batches)

  @property
  def carries_rows(self) -> bool:
    return self.is_unknown or bool(self.batches)


Rows.NONE = Rows()

# Same shape in and out, but values move between positions along some axis (or between replicas): rows
# are kept only where the moving axis is not 0 (see `_cumulative` / `_sort`) or not at all.
_ACROSS_REPLICAS = ("psum", "pmax", "pmin", "pmean", "all_gather", "all_to_all", "ppermute", "reduce_scatter",
                    "psum_scatter", "pbroadcast", "pgather", "all_reduce")
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                         "reduce_xor", "argmax", "argmin", "reduce_precision_sum"})
# Shape-preserving primitives whose output position i reads only input position i (elementwise), or that
# pass values through (identities, casts, annotations). Anything else that keeps the shape is not assumed
# to keep rows.
_ELEMENTWISE = frozenset({
    "add_any", "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "complex", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div",
    "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma", "igammac",
    "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "population_count", "pow", "real", "reduce_precision",
    "rem", "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "bessel_i0e",
    "bessel_i1e", "random_gamma_grad", "regularized_incomplete_beta", "polygamma", "zeta", "clz",
    "device_put", "pvary", "pcast", "sharding_constraint", "optimization_barrier", "name", "tie_in",
    "tpustrat_assign_to_logical_device", "mesh_cast", "reshard", "axis_index_groups_check",
})


def _shape(v: Any) -> tuple[int, ...]:
  return tuple(getattr(v.aval, "shape", ()))


def _leading_same(a: Any, b: Any) -> bool:
  sa, sb = _shape(a), _shape(b)
  return bool(sa) and bool(sb) and sa[0] == sb[0]


def leading_rows(jaxpr: Any, inputs: Sequence[Rows]) -> list[Rows]:
  """The `Rows` of each result of the open `jaxpr`, given those of its inputs (consts: `Rows.NONE`)."""
  env: dict[Any, Rows] = {}

  def read(atom: Any) -> Rows:
    if compat.is_literal(atom):
      return Rows.NONE
    return env.get(atom, Rows.NONE)

  for v in jaxpr.constvars:
    env[v] = Rows.NONE
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
        env[v] = r
  return [read(v) for v in jaxpr.outvars]


def _join_all(rows: Sequence[Rows]) -> Rows:
  out = Rows.NONE
  for r in rows:
    out = out.join(r)
  return out


def _equation(eqn: Any, ins: list[Rows]) -> list[Rows]:
  """Rows of `eqn`'s results, at least one input carrying rows."""
  name = eqn.primitive.name
  params = eqn.params
  n_out = len(eqn.outvars)
  unknown = [Rows.unknown(name)] * n_out

  def keep_if(cond: bool, r: Rows) -> Rows:
    # `r` is the input the result's axis 0 comes from: kept if `cond`, else the rows are gone from axis 0
    # (unless they were unknown to begin with: then where they went is unknown too).
    return r if cond or r.is_unknown else Rows.NONE

  body = compat.call_body(eqn)
  if body is not None:  # jit, checkpoint, custom_jvp / custom_vjp: the body computes the results
    sub, _ = body
    if len(sub.invars) != len(ins):
      return unknown
    return leading_rows(sub, ins)
  if compat.is_scan(eqn):
    return _scan(eqn, ins)
  if name == "cond":
    branches = params.get("branches", ())
    per_branch = [leading_rows(compat.open_jaxpr(b)[0], ins[1:]) for b in branches]
    if not per_branch:
      return unknown
    index = ins[0]
    joined = [_join_all(rs) for rs in zip(*per_branch)]
    return [r.join(Rows.unknown(name)) if index.carries_rows and r.carries_rows else r for r in joined]
  if compat.collective_axes(eqn) is not None or name.startswith(_ACROSS_REPLICAS):
    # Values from other replicas (their own padding) land in every row: no single replica's rows.
    return [Rows.NONE if not any(r.is_unknown for r in ins) else Rows.unknown(name)] * n_out

  out0 = eqn.outvars[0]
  if name in _ELEMENTWISE:
    if n_out > 1:  # pass-throughs with several results (optimization_barrier): result i is input i
      return list(ins) if len(ins) == n_out else unknown
    shape = _shape(out0)
    # Operands of the result's rank and leading size keep their rows in place (other axes of size 1 may
    # be broadcast); an operand broadcast along axis 0 with rows of its own is not modelled.
    aligned = [r for a, r in zip(eqn.invars, ins)
               if len(_shape(a)) == len(shape) and shape and _shape(a)[0] == shape[0]]
    if any(r.carries_rows for a, r in zip(eqn.invars, ins)
           if not (len(_shape(a)) == len(shape) and shape and _shape(a)[0] == shape[0])):
      return unknown
    return [_join_all(aligned)]
  if name in _REDUCTIONS:
    axes = tuple(params.get("axes", ()))
    return [keep_if(0 not in axes, ins[0])] * n_out
  if name in _CUMULATIVE:
    return [keep_if(int(params.get("axis", 0)) != 0, ins[0])]
  if name == "sort":
    dim = int(params.get("dimension", 0))
    joined = _join_all(ins)
    return [keep_if(dim != 0, joined)] * n_out
  if name == "split":
    return [keep_if(int(params.get("axis", 0)) != 0, ins[0])] * n_out
  if name == "rev":
    return [keep_if(0 not in tuple(params.get("dimensions", ())), ins[0])]
  if name == "broadcast_in_dim":
    dims = tuple(params.get("broadcast_dimensions", ()))
    op = eqn.invars[0]
    return [keep_if(bool(dims) and dims[0] == 0 and _leading_same(op, out0), ins[0])]
  if name == "reshape":
    if params.get("dimensions") is not None:
      return unknown
    return [keep_if(_leading_same(eqn.invars[0], out0), ins[0])]
  if name == "squeeze":
    return [keep_if(0 not in tuple(params.get("dimensions", ())), ins[0])]
  if name == "expand_dims":
    return [keep_if(0 not in tuple(params.get("dimensions", ())), ins[0])]
  if name == "transpose":
    perm = tuple(params.get("permutation", ()))
    return [keep_if(bool(perm) and perm[0] == 0, ins[0])]
  if name == "dot_general":
    return [_dot_general(eqn, ins)]
  if name == "conv_general_dilated":
    dn = params.get("dimension_numbers")
    lhs_spec, _, out_spec = (getattr(dn, "lhs_spec", None), None, getattr(dn, "out_spec", None))
    ok = (lhs_spec is not None and out_spec is not None and lhs_spec[0] == 0 and out_spec[0] == 0
          and int(params.get("batch_group_count", 1)) == 1)
    if ins[1].carries_rows:  # rows in the kernel: not modelled
      return unknown
    return [keep_if(ok, ins[0])]
  if name == "concatenate":
    dim = int(params.get("dimension", 0))
    return [keep_if(dim != 0, _join_all(ins))]
  if name == "slice":
    start, limit = params.get("start_indices", ()), params.get("limit_indices", ())
    strides = params.get("strides") or (1,) * len(start)
    op = eqn.invars[0]
    whole = bool(start) and start[0] == 0 and limit[0] == _shape(op)[0] and strides[0] == 1
    return [keep_if(whole, ins[0])]
  if name == "dynamic_slice":
    sizes = tuple(params.get("slice_sizes", ()))
    op = eqn.invars[0]
    if any(r.carries_rows for r in ins[1:]):
      return unknown
    return [keep_if(bool(sizes) and sizes[0] == _shape(op)[0], ins[0])]
  if name == "gather":
    # ``table[ids]``: the result's axes that are not slice (offset) axes are the indices' batch axes, in
    # order; axis 0 of the result is then axis 0 of the indices (rows of ids: rows of the result).
    # With batching dimensions (``take_along_axis``), axis 0 of the operand and of the indices may be
    # one batch axis: row i reads only row i.
    operand, indices = ins
    dn = params.get("dimension_numbers")
    offset = tuple(getattr(dn, "offset_dims", ()))
    index_vector = len(_shape(eqn.invars[1])) - 1  # jax's gather keeps the index vector last
    from_indices = 0 not in offset and index_vector != 0
    batched = tuple(getattr(dn, "operand_batching_dims", ()))
    if operand.carries_rows:
      indices_batched = tuple(getattr(dn, "start_indices_batching_dims", ()))
      if from_indices and 0 in batched and indices_batched[batched.index(0)] == 0:
        return [operand.join(indices)]
      return unknown
    return [keep_if(from_indices, indices)]
  if name.startswith("scatter"):
    # Updates land at positions the indices choose: the result's rows are the operand's, if any.
    operand = ins[0]
    if operand.carries_rows:
      return unknown
    return [Rows.NONE]
  if name == "dynamic_update_slice":
    operand, update = ins[0], ins[1]
    if any(r.carries_rows for r in ins[2:]):
      return unknown
    if _leading_same(eqn.invars[0], eqn.invars[1]):  # the update spans axis 0: row i stays row i
      return [operand.join(update)]
    return [unknown[0] if update.carries_rows else operand]
  if name == "pad":
    config = params.get("padding_config", ())
    if ins[1].carries_rows:
      return unknown
    return [keep_if(bool(config) and tuple(config[0]) == (0, 0, 0), ins[0])]
  if name in ("iota", "rng_bit_generator", "random_seed", "random_wrap", "random_unwrap", "random_bits",
              "axis_index"):
    return [Rows.NONE] * n_out if not any(r.is_unknown for r in ins) else unknown
  return unknown


def _dot_general(eqn: Any, ins: list[Rows]) -> Rows:
  """Axis 0 of ``dot_general``'s result: the first batch dimension, else lhs's first free dimension,
  else rhs's first free dimension."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = ins
  if any(r.is_unknown for r in ins):
    return lhs if lhs.is_unknown else rhs
  if lb:
    return (lhs if lb[0] == 0 else Rows.NONE).join(rhs if rb[0] == 0 else Rows.NONE)
  lhs_free = [d for d in range(len(_shape(eqn.invars[0]))) if d not in lc]
  if lhs_free:
    return lhs if lhs_free[0] == 0 else Rows.NONE
  rhs_free = [d for d in range(len(_shape(eqn.invars[1]))) if d not in rc]
  return rhs if rhs_free and rhs_free[0] == 0 else Rows.NONE


def _scan(eqn: Any, ins: list[Rows]) -> list[Rows]:
  """A `lax.scan`: carries iterate to a fixed point; a scanned-over input loses axis 0 (its steps) in
  the body, and stacked outputs get the steps as axis 0."""
  sig = compat.scan_signature(eqn)
  body, _ = compat.open_jaxpr(sig.body)
  nc, nk = sig.num_consts, sig.num_carry
  consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  sliced = [Rows.unknown("scan") if r.is_unknown else Rows.NONE for r in xs]
  for _ in range(len(carry) + 2):  # each pass can only widen a carry's batches: a fixed point is near
    outs = leading_rows(body, [*consts, *carry, *sliced])
    new = [c.join(o) for c, o in zip(carry, outs[:nk])]
    if new == carry:
      break
    carry = new
  else:
    return [Rows.unknown("scan")] * len(eqn.outvars)
  ys = [Rows.unknown("scan") if r.is_unknown else Rows.NONE for r in outs[nk:]]
  return [*carry, *ys]
