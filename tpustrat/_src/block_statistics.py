"""Which results of a step depend on a statistic of one replica's block of a split value: read from a jaxpr.

A value split over the replicas (`experimental_shard`'s blocks, `sharded_optimizer`'s flat blocks) is right
under an operation that treats its elements one by one (Adam, weight decay, a learning rate): each replica
computes its block of the whole value's result. An operation that combines the elements of a block along
the split axis (a norm, a mean, an RMS, a trust ratio: `optax.clip_by_global_norm`, `clip_by_block_rms`,
`scale_by_trust_ratio`, `adafactor`'s update clipping) computes a statistic of this replica's block, not of
the value: the result then depends on how the value was split, and is wrong, silently. A statistic summed
over the replicas (`tpustrat.global_norm`: a `psum` of the blocks' partial sums) is the value's, and right.

`mixed_results(jaxpr, split)` follows each split input through the equations, as `batch_rows` follows a
batch's rows: each value is

* free: computed from no split input, or from a statistic summed over every block (a collective over all
  the replicas ends a block statistic: its result is the whole value's);
* ``Split(axis, groups)``: element for element a block, split along `axis` within `groups` (a
  `psum_scatter` over the replicas makes one; with ``axis_index_groups``, a block of a value split within
  those groups: hybrid sharding);
* ``Mixed(via)``: computed from a combination of a block's elements along its split axis (a reduction or
  contraction over it, a cumulative sum, a sort), by the equation `via` names (its primitive and the first
  frame of the caller's code that made it: ``optax clip_by_global_norm``);
* unknown: moved in a way not followed here (a reshape merging the split axis with another, a gather);
  never reported.

A collective with ``axis_index_groups`` is followed by its groups against the value's (hybrid sharding:
split within groups of ``S`` replicas, the ``G`` replicas at one position holding equal blocks). One whose
groups each hold every position equally often (the value's own groups) sees every block: free. Any other
leaves a block's statistic `Mixed`, a reduce-scatter's included: across the value's groups it sums ``G``
copies of one block's statistic, over some of the positions a few blocks'. A sum across the value's groups
leaves a block a block (a hybrid gradient's all-reduce of its reduce-scattered block); any other grouped
collective makes a block unknown. Where the value's groups are not known (a split input: the callers give
its axis only), a grouped collective leaves a statistic `Mixed` and a block unknown.

A result that is `Mixed` is reported. Loops (`scan`, `while`) are followed through one iteration of their
body; `cond` through every branch; the nested `shard_map` region that only opts out of JAX's varying-axis
checks (no new manual axes: tpustrat's grouped collectives) through its body.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

from tpustrat._src import jax_compat as compat
from tpustrat._src.groups import Groups
from tpustrat._src.names import REPLICA_AXIS

__all__ = ["Mixed", "Split", "UNKNOWN", "caller", "mixed_results"]


@dataclasses.dataclass(frozen=True)
class Split:
  """Element for element a block of a split value, split along `axis`, within `groups` (replica ids, each
  group in block order: one group of every replica without hybrid sharding); None where not known."""

  axis: int
  groups: Groups | None = None

  def at(self, axis: int) -> Split:
    """The same block, its split axis moved to `axis`."""
    return Split(axis, self.groups)


@dataclasses.dataclass(frozen=True, eq=False)
class Mixed:
  """Computed from a statistic of one replica's block, by equation `eqn`; `via` says where (its primitive
  and its caller), read from the equation's traceback only when asked for. `enclosing`: the call
  equations around it, innermost first (a `jnp` function is a `jit` whose body's tracebacks stop at it).
  `groups`: those of the block's value (`Split.groups`), which decide which collectives complete it."""

  eqn: Any
  enclosing: tuple[Any, ...] = ()
  groups: Groups | None = None

  @property
  def via(self) -> str:
    for e in (self.eqn, *self.enclosing):
      who = caller(e)
      if who != _UNNAMED:
        return f"`{self.eqn.primitive.name}` in {who}"
    return f"`{self.eqn.primitive.name}` in {_UNNAMED}"


class _Unknown:
  def __repr__(self) -> str:
    return "UNKNOWN"


UNKNOWN: Any = _Unknown()
State = Any  # None (free) | Split | Mixed | UNKNOWN

# Primitives whose result position i reads input position i only (or that pass values through).
_ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "complex", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh", "device_put", "digamma",
    "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow",
    "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "lt_to", "le_to", "max", "min", "mul", "name", "ne", "neg",
    "nextafter", "not", "optimization_barrier", "or", "pcast", "pow", "pvary", "real", "reduce_precision",
    "rem", "round", "rsqrt", "select_n", "sharding_constraint", "sign", "sin", "sinh", "sqrt", "square",
    "stop_gradient", "sub", "tan", "tanh", "xor", "mesh_cast", "reshard", "polygamma", "igamma", "igammac",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "population_count", "clz",
})
_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax",
               "argmin", "reduce_xor")
_ALONG_ONE_AXIS = {"cumsum": "axis", "cumprod": "axis", "cummax": "axis", "cummin": "axis",
                   "cumlogsumexp": "axis", "sort": "dimension"}
_SCATTERS = ("psum_scatter", "reduce_scatter")
_LIBRARY_DIRS = tuple(os.path.dirname(p) for p in (compat.__file__,))  # tpustrat/_src: not a caller


def _shape(v: Any) -> tuple[int, ...]:
  return tuple(getattr(v.aval, "shape", ()))


def caller(eqn: Any) -> str:
  """The code that made `eqn`, outside JAX and this library: the package (or file) and its functions,
  innermost first, up to the caller's own (optax's ``clip_by_global_norm.<locals>.update_fn``, through
  its helpers, is written ``optax tree_sum < tree_norm < clip_by_global_norm < chain``)."""
  traceback = getattr(eqn.source_info, "traceback", None)
  where, names = None, []
  for frame in getattr(traceback, "frames", ()) or ():
    path = frame.file_name
    parts = path.replace("\\", "/").split("/")
    if "jax" in parts or "jaxlib" in parts or path.startswith(_LIBRARY_DIRS):
      continue
    package = next((parts[i + 1] for i in range(len(parts) - 1) if parts[i] == "site-packages"), None)
    here = package if package is not None else f"{os.path.basename(path)}:{getattr(frame, 'start_line', getattr(frame, 'line_num', '?'))}"
    if where is not None and here != where:
      break
    where = here
    # A package's closures are named for the function that made them (optax's `update_fn` of
    # `clip_by_global_norm`); the user's own code by the innermost function (`loss` in `step`).
    parts_of_name = frame.function_name.split(".<locals>.")
    names.append(parts_of_name[0] if package is not None else parts_of_name[-1])
    if package is None or len(names) == 4:
      break
  return _UNNAMED if where is None else f"{where} {' < '.join(dict.fromkeys(names))}"


_UNNAMED = "an unnamed caller"
_STATE = threading.local()  # `.enclosing`: the call equations being followed in this thread, outermost first


def _enclosing() -> list[Any]:
  if not hasattr(_STATE, "enclosing"):
    _STATE.enclosing = []
  return _STATE.enclosing


def _mixed(eqn: Any, block: Split) -> Mixed:
  """A statistic of `block` along its split axis, made by `eqn`."""
  return Mixed(eqn, tuple(reversed(_enclosing())), block.groups)


def _scattered(eqn: Any) -> Split:
  """A reduce-scatter's result: this replica's block of the sum, split within its ``axis_index_groups``
  (or within one group of every replica); groups not known where it runs over other axes too."""
  groups = eqn.params.get("axis_index_groups")
  if tuple(compat.collective_axes(eqn) or ()) != (REPLICA_AXIS,):
    groups = None
  elif groups is None:
    size = eqn.params.get("axis_size")
    groups = None if size is None else [range(int(size))]
  return Split(int(eqn.params.get("scatter_dimension", 0)),
               None if groups is None else tuple(tuple(int(r) for r in g) for g in groups))


def _join(states: Sequence[State]) -> State:
  """The state of a value computed position by position from values in `states`."""
  for s in states:
    if isinstance(s, Mixed):
      return s
  if any(s is UNKNOWN for s in states):
    return UNKNOWN
  splits = [s for s in states if isinstance(s, Split)]
  if not splits:
    return None
  known = {s.groups for s in splits if s.groups is not None}
  if len({s.axis for s in splits}) > 1 or len(known) > 1:
    return UNKNOWN  # blocks of two splits combined element for element
  return Split(splits[0].axis, known.pop() if known else None)


def _positions(groups: Groups) -> dict[int, int]:
  """Each replica id's position in its group: the block of the value it holds."""
  return {r: p for g in groups for p, r in enumerate(g)}


def _through(eqn: Any, s: State) -> State:
  """The state of `s` after the collective `eqn` over the replica axis. Without groups it sees every
  replica: its result is the whole value's (a gather of every block, a sum of every block's statistic).
  With ``axis_index_groups`` it depends on the value's groups (the module's docstring)."""
  groups = eqn.params.get("axis_index_groups")
  if s is None or groups is None:
    return None
  position = _positions(s.groups) if isinstance(s, (Split, Mixed)) and s.groups is not None else {}
  if (tuple(compat.collective_axes(eqn) or ()) != (REPLICA_AXIS,)
      or any(int(r) not in position for g in groups for r in g)):
    # Summed over replicas that may not hold every block: a statistic is still not the value's.
    return s if isinstance(s, Mixed) else UNKNOWN
  held = [sorted(position[int(r)] for r in g) for g in groups]
  everyone = list(range(len(s.groups[0])))
  if all(h == sorted(everyone * (len(h) // len(everyone))) for h in held):
    return None  # every block, each as often: the whole value (or its statistic, a whole multiple)
  if isinstance(s, Mixed):
    return s  # one block's statistic (copies of it, across the value's groups), or some blocks'
  if all(len(set(h)) == 1 for h in held) and eqn.primitive.name.startswith(("psum", "pmax", "pmin")):
    return s  # copies of one block summed across the value's groups: still that block
  return UNKNOWN


def _collective(eqn: Any, ins: list[State]) -> list[State]:
  """The results of a collective over the replica axis (`_through`). A reduce-scatter makes a block of
  whatever it scatters, unless what it sums is a block's statistic still (`_through`)."""
  n_out = len(eqn.outvars)
  if eqn.primitive.name.startswith(_SCATTERS):
    still = [m for m in (_through(eqn, s) for s in ins if isinstance(s, Mixed)) if m is not None]
    return [still[0] if still else _scattered(eqn)] * n_out
  if len(ins) == n_out:
    return [_through(eqn, s) for s in ins]
  return [_through(eqn, _join(ins))] * n_out


def _checks_only_region(eqn: Any) -> Any:
  """The body of a nested `shard_map` that adds no manual axes (it only opts out of varying-axis checks, as
  tpustrat's grouped collectives do): its inputs are the equation's, as they are. None for any other."""
  added = eqn.params.get("newly_manual_axes")
  if eqn.primitive.name != "shard_map" or added is None or len(added):
    return None
  body = compat.open_jaxpr(eqn.params.get("jaxpr"))[0]
  return body if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars) else None


def mixed_results(jaxpr: Any, split: Sequence[int | None]) -> list[State]:
  """The state of each result of the open `jaxpr`, given each input's split axis (None: not split); the
  inputs' groups are not known (the module's docstring: what a grouped collective then does)."""
  return _run(jaxpr, [None if a is None else Split(a) for a in split])


def _run(jaxpr: Any, inputs: Sequence[State]) -> list[State]:
  env: dict[Any, State] = {}

  def read(atom: Any) -> State:
    return None if compat.is_literal(atom) else env.get(atom)

  for v, s in zip(jaxpr.invars, inputs):
    env[v] = s
  for eqn in jaxpr.eqns:
    ins = [read(a) for a in eqn.invars]
    # A reduce-scatter over the replicas makes a block whatever it scatters.
    free = all(s is None for s in ins) and not eqn.primitive.name.startswith(_SCATTERS)
    outs = [None] * len(eqn.outvars) if free else _equation(eqn, ins)
    for v, s in zip(eqn.outvars, outs):
      if not compat.is_drop_var(v):
        env[v] = s
  return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, ins: list[State]) -> list[State]:
  name = eqn.primitive.name
  params = eqn.params
  n_out = len(eqn.outvars)
  axes = compat.collective_axes(eqn)
  if axes is not None and REPLICA_AXIS in axes:
    return _collective(eqn, ins)
  body = compat.call_body(eqn)
  if body is not None:
    sub, _ = body
    if len(sub.invars) != len(ins):
      return [_join(ins)] * n_out
    _enclosing().append(eqn)
    try:
      return _run(sub, ins)
    finally:
      _enclosing().pop()
  region = _checks_only_region(eqn)
  if region is not None:
    return _run(region, ins)
  if name == "cond":
    if isinstance(ins[0], Mixed):
      return [ins[0]] * n_out
    branches = [_run(compat.open_jaxpr(b)[0], ins[1:]) for b in params.get("branches", ())]
    return [_join(list(rs)) for rs in zip(*branches)] if branches else [_join(ins)] * n_out
  if compat.is_scan(eqn):
    return _scan(eqn, ins)
  if name == "while":
    # The body followed once with its carries' states (a statistic made in it is found); the results
    # are what the carries may hold after any number of iterations: their states joined.
    nc = int(params.get("body_nconsts", 0))
    cond_nc = int(params.get("cond_nconsts", 0))
    consts, carry = ins[cond_nc:cond_nc + nc], ins[cond_nc + nc:]
    body = compat.open_jaxpr(params["body_jaxpr"])[0]
    for _ in range(2):
      carry = [_join([c, o]) for c, o in zip(carry, _run(body, [*consts, *carry]))]
    return carry if len(carry) == n_out else [_join(ins)] * n_out
  if name in _ELEMENTWISE:
    if n_out > 1:
      return list(ins) if len(ins) == n_out else [_join(ins)] * n_out
    return [_join(ins)]
  if any(isinstance(s, Mixed) for s in ins):
    return [next(s for s in ins if isinstance(s, Mixed))] * n_out
  if any(s is UNKNOWN for s in ins):
    return [UNKNOWN] * n_out
  x = ins[0]
  if name.startswith(_REDUCTIONS):
    reduced = tuple(params.get("axes", ()))
    if not isinstance(x, Split):
      return [UNKNOWN] * n_out
    if x.axis in reduced:
      return [_mixed(eqn, x)] * n_out
    return [x.at(x.axis - sum(1 for a in reduced if a < x.axis))] * n_out
  if name in _ALONG_ONE_AXIS:
    ndim = len(_shape(eqn.invars[0]))
    dim = int(params.get(_ALONG_ONE_AXIS[name], 0)) % max(ndim, 1)
    along = [s for s in ins if isinstance(s, Split) and s.axis == dim]
    if along:
      return [_mixed(eqn, along[0])] * n_out
    return [_join(ins)] * n_out
  if name == "dot_general":
    return [_dot_general(eqn, ins)]
  if name == "broadcast_in_dim" and isinstance(x, Split):
    dims = tuple(params.get("broadcast_dimensions", ()))
    return [x.at(dims[x.axis])] if x.axis < len(dims) else [UNKNOWN]
  if name == "transpose" and isinstance(x, Split):
    return [x.at(tuple(params["permutation"]).index(x.axis))]
  if name == "reshape" and isinstance(x, Split) and params.get("dimensions") is None:
    # Row-major: the split axis's elements land on the output axis whose extent first reaches past the
    # axes before it (merged with others where the shapes differ: a ravel puts them on axis 0).
    op, out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    before = math.prod(op[:x.axis])
    for j in range(len(out)):
      if math.prod(out[:j + 1]) > before:
        return [x.at(j)]
    return [UNKNOWN]
  if name in ("slice", "dynamic_slice", "rev", "pad", "concatenate", "dynamic_update_slice") and isinstance(x, Split):
    # Some of a block's elements (or a block beside others), in place: still a block's elements.
    return [_join([s for s in ins if s is not None])]
  if name == "split" and isinstance(x, Split):
    return [x] * n_out  # pieces of a block (a packed gradient cut back into its leaves), in place
  if name == "top_k" and isinstance(x, Split):
    last = len(_shape(eqn.invars[0])) - 1
    return [_mixed(eqn, x) if x.axis == last else x] * n_out
  if name == "squeeze" and isinstance(x, Split):
    dims = tuple(params.get("dimensions", ()))
    return [UNKNOWN] if x.axis in dims else [x.at(x.axis - sum(1 for d in dims if d < x.axis))]
  return [UNKNOWN if any(s is not None for s in ins) else None] * n_out


def _scan(eqn: Any, ins: list[State]) -> list[State]:
  """A `lax.scan`: the body is followed with the states of its constants, carries and sliced inputs
  (a block scanned along its split axis: unknown), the carries to a fixed point (two passes); the stacked
  outputs gain a leading axis."""
  sig = compat.scan_signature(eqn)
  body, _ = compat.open_jaxpr(sig.body)
  nc, nk = sig.num_consts, sig.num_carry
  consts, carry, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
  sliced = [UNKNOWN if isinstance(s, Split) and s.axis == 0 else s.at(s.axis - 1) if isinstance(s, Split) else s
            for s in xs]
  outs = _run(body, [*consts, *carry, *sliced])
  for _ in range(2):
    carry = [_join([c, o]) for c, o in zip(carry, outs[:nk])]
    outs = _run(body, [*consts, *carry, *sliced])
  ys = [s.at(s.axis + 1) if isinstance(s, Split) else s for s in outs[nk:]]
  return [*carry, *ys]


def _dot_general(eqn: Any, ins: list[State]) -> State:
  """Result axes: the batch dimensions, then lhs's free dimensions, then rhs's."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs_free = [d for d in range(len(_shape(eqn.invars[0]))) if d not in lc and d not in lb]
  rhs_free = [d for d in range(len(_shape(eqn.invars[1]))) if d not in rc and d not in rb]

  def place(s: State, contract: Sequence[int], batch: Sequence[int], free: list[int], offset: int) -> State:
    if not isinstance(s, Split):
      return s
    if s.axis in contract:
      return _mixed(eqn, s)
    if s.axis in batch:
      return s.at(list(batch).index(s.axis))
    return s.at(len(lb) + offset + free.index(s.axis))

  return _join([place(ins[0], lc, lb, lhs_free, 0), place(ins[1], rc, rb, rhs_free, len(lhs_free))])
