"""Every use of JAX internals in tpustrat, behind small functions.

tpustrat needs a few things JAX has no public API for: the mesh axes a value traced inside `shard_map`
varies over, a primitive of its own (the `assign_to_logical_device` marker), reading and re-evaluating
a traced jaxpr equation by equation (`tpustrat._src.logical` places computations on logical cores by
rewriting the step's jaxpr), and, for the step watchdog, when the process compiles and which host
callbacks are running. Those uses live here and nowhere else, so that a new JAX version is a change
to this module only.

Written for, and tested with, JAX 0.10.2 (Python 3.11) and JAX 0.12.0.1 (Python 3.12); see
`TESTED_JAX_VERSIONS`. Between those two versions JAX merged `ClosedJaxpr` into `Jaxpr` (a jaxpr now
carries its constants) and replaced the `lax.scan` primitive's ``num_consts`` / ``num_carry`` parameters
by flat trees (``ft_in`` / ``ft_out``); each function says which layouts it reads.

What is *not* wrapped: the documented structure of a jaxpr (``jaxpr.eqns``, ``jaxpr.invars``,
``jaxpr.outvars``, ``jaxpr.constvars``; an equation's ``primitive``, ``invars``, ``outvars``, ``params`` and
``effects``; a variable's ``aval``; see https://docs.jax.dev/en/latest/jaxpr.html), which callers read
directly, and public APIs (`jax.make_jaxpr`, `jax.typeof`, `jax.lax`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

__all__ = [
    "MIN_JAX_VERSION",
    "TESTED_JAX_VERSIONS",
    "ScanSignature",
    "aval_varying_axes",
    "bind_equation",
    "call_body",
    "close_jaxpr",
    "collective_axes",
    "forget_failed_programs",
    "primal_value",
    "same_trace",
    "staging",
    "coordination_client",
    "coordinator_address",
    "eval_jaxpr",
    "host_callback_frames",
    "identity_primitive",
    "is_drop_var",
    "is_literal",
    "is_scan",
    "is_sharding_constraint",
    "is_var",
    "jaxpr_from_equations",
    "literal_value",
    "new_equation",
    "new_var",
    "rewrite_equations",
    "open_jaxpr",
    "profiler_collecting",
    "reset_compilation_cache",
    "scan_signature",
    "sharded_put",
    "transpose_equation",
    "sub_jaxprs",
    "to_varying",
    "unnamed_debug_info",
    "varying_axes",
    "watch_compiles",
]

# The JAX versions this module was written for and tested with. The lower bound is also `pyproject.toml`'s;
# there is no upper bound: a newer JAX is expected to need changes here only.
MIN_JAX_VERSION = (0, 10, 2)
TESTED_JAX_VERSIONS = ("0.10.2", "0.12.0.1")


# -- varying axes (shard_map's "vma" type system) --------------------------------------------------------


def aval_varying_axes(aval: Any) -> frozenset[str]:
  """The manual mesh axes a value of abstract type `aval` varies over (inside `shard_map`).

  JAX 0.10.2 and 0.12.0.1 keep them in ``aval.mat.varying`` (``mat`` is a `ManualAxisType`, also reachable
  as ``aval.manual_axis_type``); earlier versions (0.7 to 0.9) had a frozenset ``aval.vma``. JAX has no
  public accessor: `jax.typeof` gives the aval, but what it records about manual axes is private. Outside
  `shard_map` the answer is the empty set.
  """
  mat = getattr(aval, "mat", None) or getattr(aval, "manual_axis_type", None)
  if mat is not None and hasattr(mat, "varying"):
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))  # jax versions that name it `vma`


def varying_axes(x: Any) -> frozenset[str]:
  """The mesh axes over which a value traced inside `shard_map` varies (JAX's `vma`).

  `x` is a value (tracer or array); see `aval_varying_axes` for the versions this reads.
  """
  return aval_varying_axes(jax.typeof(x))


def to_varying(x: Any, axis: str) -> jax.Array:
  """`x` typed as varying over the manual mesh axis `axis` (the same numbers; no communication).

  A value already varying over `axis` is returned as it is. The cast's transpose is a sum over `axis`, so
  a gradient flowing back through it is summed over the replicas, which is what makes a value given whole
  to every replica (invariant) count once per replica. JAX 0.10.2 and 0.12.0.1 spell the cast
  ``lax.pcast(x, axis, to="varying")``; JAX 0.7 to 0.9 spelled it ``lax.pvary(x, axis)``.
  """
  x = jax.numpy.asarray(x)
  if axis in varying_axes(x):
    return x
  pcast = getattr(jax.lax, "pcast", None)
  if pcast is not None:
    return pcast(x, axis, to="varying")
  pvary: Any = getattr(jax.lax, "pvary", None)  # JAX 0.7 to 0.9 (by name: the JAX tpustrat is typed against has none)
  return pvary(x, axis)


# -- a primitive of our own ----------------------------------------------------------------------------


def identity_primitive(name: str, lowering_error: Callable[..., Exception]) -> Any:
  """A new primitive of one operand that returns it unchanged: a marker a jaxpr interpreter looks for.

  It is transparent to `jax.jvp` / `jax.grad` (the tangent passes through unmarked) and to `jax.vmap`
  (the batched operand is marked); its parameters are whatever `bind` is given. It cannot be compiled:
  lowering it raises ``lowering_error(**params)``, so a marker that no interpreter removed is an error,
  never a silent no-op. Returns the primitive; mark a value with ``primitive.bind(x, **params)`` and
  find it with ``eqn.primitive is primitive``.

  Defining primitives is `jax.extend` (public, but without stability guarantees) plus the rule tables
  of `jax.interpreters` (``ad.primitive_jvps``, ``batching.primitive_batchers``, ``mlir.register_lowering``),
  unchanged from JAX 0.10.2 to 0.12.0.1.
  """
  prim = jex_core.Primitive(name)
  prim.def_impl(lambda x, **params: x)
  prim.def_abstract_eval(lambda x, **params: x)

  def jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> tuple[Any, Any]:
    return prim.bind(primals[0], **params), tangents[0]

  def batch(args: Sequence[Any], dims: Sequence[Any], **params: Any) -> tuple[Any, Any]:
    return prim.bind(args[0], **params), dims[0]

  def lowering(ctx: Any, x: Any, **params: Any) -> Any:
    del ctx, x
    raise lowering_error(**params)

  ad.primitive_jvps[prim] = jvp
  batching.primitive_batchers[prim] = batch
  mlir.register_lowering(prim, lowering)
  return prim


# -- jaxpr atoms -----------------------------------------------------------------------------------------


def is_var(atom: Any) -> bool:
  """Whether a jaxpr atom is a variable (not a literal). `DropVar` (an unused result) counts as one."""
  return isinstance(atom, jex_core.Var)


def is_drop_var(atom: Any) -> bool:
  """Whether an equation's output variable is `_` (a result nothing reads)."""
  return isinstance(atom, jex_core.DropVar)


def is_literal(atom: Any) -> bool:
  """Whether a jaxpr atom is a literal (a constant written into the equation)."""
  return isinstance(atom, jex_core.Literal)


def literal_value(atom: Any) -> Any:
  """The value of a literal atom (a Python or NumPy scalar; its dtype is ``atom.aval.dtype``)."""
  return atom.val


# -- jaxprs ----------------------------------------------------------------------------------------------


def sub_jaxprs(eqn: Any) -> list[Any]:
  """The jaxprs in an equation's parameters (bodies of calls, branches, loop bodies), each as an open
  jaxpr with ``.eqns``. `jax.extend.core.jaxprs_in_params`, same in JAX 0.10.2 and 0.12.0.1."""
  return list(jex_core.jaxprs_in_params(eqn.params))


def close_jaxpr(jaxpr: Any, consts: Sequence[Any]) -> Any:
  """A closed jaxpr: `jaxpr` with the values `consts` of its constvars (``.jaxpr`` and ``.consts``).

  JAX 0.10.2 has a separate `ClosedJaxpr` class wrapping a `Jaxpr`; in 0.12.0.1 a `Jaxpr` carries its
  constants (`jax.extend.core.ClosedJaxpr` is an alias of `Jaxpr`, `Jaxpr.with_consts` attaches them).
  """
  if hasattr(jex_core.Jaxpr, "with_consts"):  # JAX 0.12
    return jaxpr.with_consts(list(consts))
  return jex_core.ClosedJaxpr(jaxpr, list(consts))


def open_jaxpr(closed: Any) -> tuple[Any, list[Any]]:
  """(jaxpr, consts) of a closed jaxpr (the inverse of `close_jaxpr`); an open jaxpr has no consts.

  In JAX 0.10.2 a `ClosedJaxpr` has ``.jaxpr`` and ``.consts`` and a `Jaxpr` neither; in 0.12.0.1 every
  `Jaxpr` has ``.consts`` (possibly empty) and ``.jaxpr`` is itself.
  """
  if hasattr(closed, "consts"):
    return closed.jaxpr, list(closed.consts)
  return closed, []


def jaxpr_from_equations(eqns: Sequence[Any], invars: Sequence[Any], outvars: Sequence[Any],
                         debug_info: Any) -> Any:
  """An open jaxpr (no constvars) of some equations of another: it reads `invars` and returns `outvars`.

  `debug_info` must describe ``len(invars)`` arguments and ``len(outvars)`` results, or name none
  (`unnamed_debug_info`). The `Jaxpr` constructor has the same positional form in JAX 0.10.2 and
  0.12.0.1 (``constvars, invars, outvars, eqns, effects, debug_info``).
  """
  effects = set().union(*(e.effects for e in eqns)) if eqns else set()
  return jex_core.Jaxpr([], list(invars), list(outvars), list(eqns), effects, debug_info)


def unnamed_debug_info(jaxpr: Any) -> Any:
  """`jaxpr`'s debug info with argument and result names dropped, for jaxprs built from part of it."""
  return jaxpr.debug_info.with_unknown_names()


def eval_jaxpr(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
  """Evaluates an open jaxpr (`jaxpr_from_equations`) on `args` in the current trace.

  `jax.core.eval_jaxpr` (not deprecated in JAX 0.10.2 or 0.12.0.1): each equation is re-bound inside the
  context (abstract mesh, name stack) recorded when it was traced.
  """
  return jax.core.eval_jaxpr(jaxpr, [], *args)


def eval_closed_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """Evaluates `jaxpr` (with `consts` for its constvars, as `open_jaxpr` gives them) on `args` in the
  current trace: `jax.core.eval_jaxpr`, as `eval_jaxpr`."""
  return jax.core.eval_jaxpr(jaxpr, list(consts), *args)


def bind_equation(eqn: Any, args: Sequence[Any]) -> list[Any]:
  """Binds `eqn`'s primitive afresh on `args` in the current trace (not inside the equation's recorded
  context, unlike `eval_jaxpr`); returns the list of its results.

  ``primitive.get_bind_params`` turns an equation's parameters back into `bind`'s; before JAX 0.10 it
  returned ``(sub-functions, params)``, from 0.10.2 to 0.12.0.1 the params alone.
  """
  params = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(params, tuple):  # JAX < 0.10: (sub-functions, params)
    subfuns, params = params
    args = [*subfuns, *args]
  ans = eqn.primitive.bind(*args, **params)
  return list(ans) if eqn.primitive.multiple_results else [ans]


def new_var(aval: Any) -> Any:
  """A fresh jaxpr variable of abstract value `aval` (`jax.extend.core.Var(aval)`, JAX 0.10.2 and 0.12.0.1)."""
  return jex_core.Var(aval)


def new_equation(invars: Sequence[Any], outvars: Sequence[Any], primitive: Any, params: dict[str, Any],
                 like: Any) -> Any:
  """A new equation binding `primitive` with `params`, with no effects, placed where the equation `like`
  is (its source information and context: name stack, abstract mesh). `jax.extend.core.new_jaxpr_eqn`,
  the same signature in JAX 0.10.2 and 0.12.0.1."""
  return jex_core.new_jaxpr_eqn(list(invars), list(outvars), primitive, params, set(), like.source_info, like.ctx)


# `lax.transpose`'s equation parameters (JAX 0.10.2 and 0.12.0.1: the permutation alone), checked once
# against a traced transpose, so that a JAX version that changes them fails here, loudly, not in XLA.
_TRANSPOSE_PARAMS: tuple[str, ...] = ("permutation",)
_TRANSPOSE_CHECKED: list[bool] = []


def transpose_equation(x: Any, permutation: tuple[int, ...], out: Any, like: Any) -> Any:
  """A `lax.transpose` equation from the variable `x` to the variable `out` (its abstract value `x`'s,
  permuted), placed where the equation `like` is (`new_equation`)."""
  if not _TRANSPOSE_CHECKED:
    traced = jax.make_jaxpr(lambda v: jax.lax.transpose(v, (1, 0)))(jax.ShapeDtypeStruct((2, 3), np.float32))
    eqn = traced.eqns[0]
    if eqn.primitive is not jax.lax.transpose_p or tuple(sorted(eqn.params)) != _TRANSPOSE_PARAMS:
      raise NotImplementedError(
          f"tpustrat: this JAX version ({jax.__version__}) traces lax.transpose as {eqn.primitive} with "
          f"parameters {sorted(eqn.params)} (expected {list(_TRANSPOSE_PARAMS)}); "
          "tpustrat._src.jax_compat.transpose_equation needs updating.")
    _TRANSPOSE_CHECKED.append(True)
  return new_equation([x], [out], jax.lax.transpose_p, {"permutation": tuple(permutation)}, like)


def _with_equations(jaxpr: Any, eqns: list[Any]) -> Any:
  # `Jaxpr.replace` keeps the constvars, invars and outvars (and, in JAX 0.12, the consts).
  return jaxpr.replace(eqns=eqns)


def rewrite_equations(jaxpr: Any, rewrite: Callable[[Any], list[Any] | None]) -> Any:
  """`jaxpr` (open or closed) with each equation, at any depth (the bodies of calls, loops, branches and
  `shard_map`s in the equations' parameters), replaced by ``rewrite(eqn)`` where that is not None: a list of
  equations that reads the equation's inputs and defines its outputs, with the same types. The same
  object where nothing changed; a sub-jaxpr met twice is rewritten once (and stays shared).

  The parameters that hold jaxprs are found by type: a `Jaxpr`, a `ClosedJaxpr` (JAX 0.10.2's own class,
  one class with `Jaxpr` in 0.12.0.1) or a tuple of them (`cond`'s branches). Equations and jaxprs are
  rebuilt with their ``replace`` method (both versions)."""
  memo: dict[int, tuple[Any, Any]] = {}
  closed_class: Any = getattr(jex_core, "ClosedJaxpr", jex_core.Jaxpr)

  def value(v: Any) -> Any:
    if closed_class is not jex_core.Jaxpr and isinstance(v, closed_class):  # JAX 0.10: jaxpr + consts
      new = walk(v.jaxpr)
      return v if new is v.jaxpr else v.replace(jaxpr=new)
    if isinstance(v, jex_core.Jaxpr):
      return walk(v)
    if isinstance(v, tuple) and any(isinstance(x, _JAXPR_TYPES) for x in v):
      new_items = tuple(value(x) for x in v)
      return v if all(a is b for a, b in zip(new_items, v)) else new_items
    return v

  def walk(j: Any) -> Any:
    known = memo.get(id(j))
    if known is not None:
      return known[1]
    eqns, changed = [], False
    for eqn in j.eqns:
      params = {k: value(v) for k, v in eqn.params.items()}
      if any(params[k] is not eqn.params[k] for k in params):
        eqn, changed = eqn.replace(params=params), True
      replaced = rewrite(eqn)
      if replaced is None:
        eqns.append(eqn)
      else:
        eqns.extend(replaced)
        changed = True
    new = _with_equations(j, eqns) if changed else j
    memo[id(j)] = (j, new)  # `j` kept alive: its id is not reused while the walk runs
    return new

  return value(jaxpr)


# -- primitives by name ------------------------------------------------------------------------------------

# Plain calls: their body computes the equation's results from the equation's inputs, so it can be
# evaluated inline (JAX 0.10.2 and 0.12.0.1 name them `jit`, `remat2`, `custom_jvp_call`, `custom_vjp_call`;
# the other names are those of earlier versions).
_INLINE_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                           "custom_vjp_call_jaxpr", "checkpoint", "remat", "remat2"})
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
_JAXPR_TYPES = (jex_core.Jaxpr, getattr(jex_core, "ClosedJaxpr", jex_core.Jaxpr))  # one class in JAX 0.12


def call_body(eqn: Any) -> tuple[Any, list[Any]] | None:
  """(jaxpr, consts) of a plain call's body (`open_jaxpr`): the jaxpr's invars are the equation's inputs,
  its constvars take `consts`. None if `eqn` is not a plain call.

  Bodies are in the parameter ``jaxpr`` (jit, checkpoint) or ``call_jaxpr`` (custom_jvp / custom_vjp);
  a `ClosedJaxpr` in JAX 0.10.2 (a `Jaxpr` for checkpoint), always a `Jaxpr` (with its consts) in 0.12.0.1.
  """
  if eqn.primitive.name not in _INLINE_CALLS:
    return None
  for key in _BODY_PARAMS:
    body = eqn.params.get(key)
    if isinstance(body, _JAXPR_TYPES):
      return open_jaxpr(body)
  return None


def is_sharding_constraint(eqn: Any) -> bool:
  """Whether `eqn` is a `jax.lax.with_sharding_constraint` (primitive `sharding_constraint`)."""
  return eqn.primitive.name == "sharding_constraint"


_COLLECTIVES = ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute", "reduce_scatter",
                "pbroadcast")


def collective_axes(eqn: Any) -> tuple[Any, ...] | None:
  """The mesh axis names a collective equation (`psum`, `all_gather`, `ppermute`, ...: also their
  `_invariant` variants) communicates over; None if `eqn` is not a collective.

  The axes are the parameter ``axes`` (psum, pmax, pmin) or ``axis_name`` (the others), in JAX 0.10.2 and
  0.12.0.1; either a name or a tuple of names.
  """
  if not eqn.primitive.name.startswith(_COLLECTIVES):
    return None
  axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
  return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


# -- lax.scan ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScanSignature:
  """How a `lax.scan` equation's inputs and results are laid out, and how to re-emit it.

  Inputs are ``num_consts`` constants, ``num_carry`` carries, then the scanned-over arrays; results are the
  ``num_carry`` final carries, then the stacked per-iteration outputs. `body` is a closed jaxpr (``.jaxpr``,
  ``.consts``) from (consts, carry, x) to (carry, y). ``length``, ``reverse`` and ``unroll`` are
  `jax.lax.scan`'s arguments.
  """

  num_consts: int
  num_carry: int
  body: Any
  length: int
  reverse: bool
  unroll: int | bool


def is_scan(eqn: Any) -> bool:
  """Whether `eqn` is a `lax.scan` (also `lax.map`, `fori_loop` with static trip count, ...)."""
  return eqn.primitive.name == "scan"


def scan_signature(eqn: Any) -> ScanSignature:
  """The `ScanSignature` of a `lax.scan` equation.

  JAX 0.10.2 gives ``num_consts`` and ``num_carry`` as parameters and the body as a `ClosedJaxpr`; JAX
  0.12.0.1 gives flat trees instead: ``ft_in`` is ``(consts, carry, xs)``, whose parts' lengths are the
  counts, and ``ft_out`` is ``(carry, ys)`` (some ys may be filtered out, but the body's results and the
  equation's match), and the body is a `Jaxpr` that carries its consts. There is no public way to take a
  traced scan apart.
  """
  params = eqn.params
  if "num_consts" in params:  # JAX <= 0.10.2
    num_consts, num_carry = int(params["num_consts"]), int(params["num_carry"])
  elif "ft_in" in params:  # JAX 0.12
    consts, carry, _ = params["ft_in"].unpack()
    num_consts, num_carry = len(consts), len(carry)
  else:
    raise NotImplementedError(
        f"tpustrat does not know how this JAX version ({jax.__version__}) lays out a lax.scan equation "
        f"(parameters {sorted(params)}); tpustrat._src.jax_compat.scan_signature needs updating.")
  body = close_jaxpr(*open_jaxpr(params["jaxpr"]))
  return ScanSignature(num_consts=num_consts, num_carry=num_carry, body=body, length=int(params["length"]),
                       reverse=bool(params["reverse"]), unroll=params["unroll"])


def all_gather_invariant(x: jax.Array, axis_name: str, *, axis: int, tiled: bool) -> jax.Array:
  """`all_gather` whose result JAX types as identical on every replica (so `run` returns `Mirrored`).

  `lax.all_gather` is typed varying -> varying; JAX has an invariant variant that is not public
  (`jax._src.lax.parallel.all_gather_invariant` in 0.10, `_all_gather_invariant` in 0.12, both
  ``(x, axis_name, *, axis, tiled)``). Without it, fall back to a sum of zero-padded slots, which is
  invariant by construction (an all-reduce of N times the bytes: slower, the same values).
  """
  lax, jnp = jax.lax, jax.numpy
  gather = getattr(lax, "all_gather_invariant", None)
  if gather is None:
    from jax._src.lax import parallel  # pylint: disable=import-outside-toplevel
    gather = getattr(parallel, "all_gather_invariant", None) or getattr(parallel, "_all_gather_invariant", None)
  if gather is not None:
    return gather(x, axis_name, axis=axis, tiled=tiled)
  n = lax.axis_size(axis_name)
  slots = jnp.zeros((n,) + x.shape, x.dtype).at[lax.axis_index(axis_name)].set(x)
  out = jnp.moveaxis(lax.psum(slots, axis_name), 0, axis)
  return out.reshape(x.shape[:axis] + (n * x.shape[axis],) + x.shape[axis + 1:]) if tiled else out


def coordination_client() -> Any | None:
  """The client of the coordination service of `jax.distributed` (its key-value store), or None when this
  process has not started JAX's distributed runtime.

  JAX uses the store itself (`jax.experimental.multihost_utils`) but does not export the client; it is
  ``jax._src.distributed.global_state.client`` in JAX 0.10.2 and 0.12, a ``DistributedRuntimeClient`` with
  ``key_value_set(key, value, allow_overwrite=False)``, ``key_value_try_get``, ``blocking_key_value_get(key,
  timeout_in_ms)``, ``key_value_dir_get(prefix)`` and ``key_value_delete``.
  """
  try:
    from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover - private module moved
    return None
  return getattr(jax_distributed.global_state, "client", None)


def coordinator_address() -> str | None:
  """The ``host:port`` of the coordinator this process's `jax.distributed` runtime was started with, or
  None (not started, or the attribute moved). ``jax._src.distributed.global_state.coordinator_address`` in
  JAX 0.10.2 and 0.12; read only to describe a job that the user started with `jax.distributed.initialize`.
  """
  try:
    from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover - private module moved
    return None
  address = getattr(jax_distributed.global_state, "coordinator_address", None)
  return address if isinstance(address, str) and address else None


# -- what this process is doing: compiling, or running a host callback (the step watchdog's view) -------

# The phases of turning a `jax.jit` call into an executable, as JAX names them in `jax.monitoring`
# (`jax._src.dispatch.JAXPR_TRACE_EVENT`, `JAXPR_TO_MLIR_MODULE_EVENT`, `BACKEND_COMPILE_EVENT`).
_COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_trace_duration",
                             "/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"})


def watch_compiles(begin: Callable[[], None], end: Callable[[], None]) -> Callable[[], None]:
  """Calls `begin()` when this process starts a phase of compiling a program, and `end()` when the phase
  is over; returns a function that stops the calls.

  The phases are JAX's: the trace of a top-level `jax.jit` call (the user's Python function runs here),
  its lowering to MLIR, and the XLA compilation (or the load from the persistent compilation cache). They
  follow one another, so `begin` and `end` alternate, on the thread that compiles (any thread).

  `jax.monitoring` is public, the event names and when they are recorded are not: JAX 0.10.2's
  ``jax._src.dispatch.log_elapsed_time`` records each phase as a scalar event (its start time) when the
  phase starts and as a duration event when it ends, exception or not. A JAX version that records no
  start event never calls `begin` (tests/test_watchdog.py checks that this one does).
  """
  from jax import monitoring  # pylint: disable=import-outside-toplevel

  def on_start(event: str, value: float | int, **kwargs: str | int) -> None:
    del value, kwargs
    if event in _COMPILE_EVENTS:
      begin()

  def on_end(event: str, duration_secs: float, **kwargs: str | int) -> None:
    del duration_secs, kwargs
    if event in _COMPILE_EVENTS:
      end()

  monitoring.register_scalar_listener(on_start)
  monitoring.register_event_duration_secs_listener(on_end)

  def unwatch() -> None:
    unregisters: list[Callable[[], None]] = [lambda: monitoring.unregister_scalar_listener(on_start),
                                             lambda: monitoring.unregister_event_duration_listener(on_end)]
    for unregister in unregisters:
      try:
        unregister()
      except (AssertionError, ValueError):  # already gone (`jax.monitoring.clear_event_listeners`)
        pass

  return unwatch


def host_callback_frames() -> list[tuple[int, Any, Any]]:
  """``(thread id, entry, frame)`` for each thread of this process that is running a host callback of a
  compiled program now (`jax.debug.callback`, `jax.pure_callback`, `jax.experimental.io_callback`).
  `entry` is the frame of JAX's callback entry, the same for the whole call; `frame` is the callback's
  own: the outermost frame outside JAX inside the entry (`entry` itself while the call has not reached
  the callback yet, or for a callback written in C).

  Found from `sys._current_frames()`. In JAX 0.10.2 every host callback enters Python through
  ``jax._src.callback`` (``_wrapped_callback``), on a thread of the runtime (or on the thread that runs
  the program); a JAX that enters elsewhere makes this list empty (tests/test_watchdog.py checks it).
  """
  import os  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  try:
    from jax._src import callback as jax_callback  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover - private module moved
    return []
  entry_file = jax_callback.__file__
  jax_dir = os.path.dirname(jax.__file__) + os.sep
  found: list[tuple[int, Any, Any]] = []
  for ident, innermost in sys._current_frames().items():  # pylint: disable=protected-access
    stack = []  # innermost first
    frame: FrameType | None = innermost
    while frame is not None:
      stack.append(frame)
      frame = frame.f_back
    entry = next((i for i in range(len(stack) - 1, -1, -1) if stack[i].f_code.co_filename == entry_file), None)
    if entry is None:
      continue
    inner = stack[entry::-1]  # from the entry inwards
    own = next((f for f in inner if not f.f_code.co_filename.startswith(jax_dir)), stack[entry])
    found.append((ident, stack[entry], own))
  return found


def staging() -> bool:
  """Whether JAX is staging a program now (inside `jax.jit`, `make_jaxpr`, a `lax.scan` / `while` body, or
  a transformation of them): a Python value read now is baked into the program as a constant, read once
  per compilation. Eager `jax.grad` / `jax.vmap` are not staging. Read from the current trace and its
  parents (``jax._src.core.trace_ctx.trace``, ``parent_trace``; JAX 0.10.2 and 0.12.0.1): one is a
  `DynamicJaxprTrace`."""
  from jax._src import core as jax_core  # pylint: disable=import-outside-toplevel
  trace = getattr(getattr(jax_core, "trace_ctx", None), "trace", None)
  while trace is not None:
    if type(trace).__name__ == "DynamicJaxprTrace":
      return True
    trace = getattr(trace, "parent_trace", None)
  return False


def primal_value(x: Any) -> Any:
  """`x` with the tracers of `jax.grad` / `jax.jvp` taken off (``.primal`` of JAX's `JVPTracer` and
  `LinearizeTracer`, JAX 0.10.2 and 0.12.0.1): the value in the trace that encloses the differentiation,
  whose program holds the forward computation. Anything else is returned as it is."""
  while type(x).__name__ in ("JVPTracer", "LinearizeTracer") and hasattr(x, "primal"):
    x = x.primal
  return x


def same_trace(x: Any, y: Any) -> bool:
  """Whether tracers `x` and `y` belong to one trace (``_trace``, JAX 0.10.2 and 0.12.0.1): a value traced
  inside a loop body or a `vmap` is not in the trace of the program around it."""
  trace = getattr(x, "_trace", None)
  return trace is not None and trace is getattr(y, "_trace", None)


def forget_failed_programs() -> None:
  """Forgets JAX's record of the programs with host callbacks that failed, once their error has been
  raised to the caller.

  JAX keeps the runtime token of the last program with host callbacks on each device
  (``jax._src.dispatch.runtime_tokens.output_runtime_tokens``, JAX 0.10.2 and 0.12.0.1) and waits on them
  at exit, twice (its ``clean_up`` and ``wait_for_tokens`` exit handlers): a program whose callback raised
  (an embedding bound check) prints its error again there, as two "Exception ignored in atexit"
  tracebacks, after the caller has handled it. The tokens of the failed programs are dropped here; the
  others are waited for (their programs were dispatched before this call), and kept if they finish. A
  JAX without that record is left alone.
  """
  try:
    from jax._src import dispatch as jax_dispatch  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover - private module moved
    return
  tokens = getattr(getattr(jax_dispatch, "runtime_tokens", None), "output_runtime_tokens", None)
  if not isinstance(tokens, dict):
    return
  for device, token in list(tokens.items()):
    try:
      token.block_until_ready()
    except Exception:  # noqa: BLE001 - the program failed: its error has been raised where it was waited for
      tokens.pop(device, None)


# -- host arrays onto a sharding ---------------------------------------------------------------------------

# `jax._src.interpreters.pxla.batched_device_put`'s parameters, the same in JAX 0.10.2 and 0.12.0.1; it is
# what `jax.make_array_from_callback` ends in.
_BATCHED_PUT_PARAMS = ("aval", "sharding", "xs", "devices", "committed", "enable_x64")
_BATCHED_PUT: list[Any] = []  # [found function or None], looked up once


def _batched_put() -> Any:
  if not _BATCHED_PUT:
    import inspect  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    found = None
    try:
      from jax._src import core as jax_core  # noqa: PLC0415
      from jax._src.interpreters import pxla  # noqa: PLC0415
      put = pxla.batched_device_put
      if (tuple(inspect.signature(put).parameters) == _BATCHED_PUT_PARAMS
          and callable(getattr(jax_core, "update_aval_with_sharding", None))):
        found = (put, jax_core)
    except (ImportError, AttributeError, TypeError, ValueError):
      pass
    if found is None:
      warnings.warn(
          f"tpustrat: this JAX version ({jax.__version__}) has no `pxla.batched_device_put` of the form "
          "tpustrat._src.jax_compat.sharded_put was written for; batches are transferred through "
          "jax.make_array_from_callback (slower per batch; the same arrays).", RuntimeWarning, stacklevel=3)
    _BATCHED_PUT.append(found)
  return _BATCHED_PUT[0]


def sharded_put(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> Callable[[Any], jax.Array]:
  """A transfer of host numpy arrays of `shape` and `dtype` onto `sharding`: the array
  ``jax.make_array_from_callback(shape, sharding, x.__getitem__)`` makes (each addressable device's slice,
  one batched transfer, committed), with everything that depends only on (shape, dtype, sharding) done
  here once: the devices' slices and the array type. Per call only the slicing and JAX's own batched
  transfer (`pxla.batched_device_put`, private, the same function and signature in JAX 0.10.2 and 0.12.0.1)
  run: 14 us a leaf instead of 60 on a 2-core XLA:CPU machine. For a 64-bit dtype (which
  ``jax_enable_x64``, read at each call, may narrow), a dtype JAX narrows or cannot hold, or on a JAX whose
  private function differs (a `RuntimeWarning`, once), the transfer is `jax.make_array_from_callback`
  itself."""
  found = _batched_put()
  dtype = np.dtype(dtype)
  if found is None or dtype.kind in "OSUMmV" or (dtype.itemsize == 8 and dtype.kind in "iuf") or (
      dtype == np.complex128) or jax.dtypes.canonicalize_dtype(dtype) != dtype:
    return lambda x: jax.make_array_from_callback(shape, sharding, x.__getitem__)
  put, jax_core = found
  index_map = sharding.addressable_devices_indices_map(shape)
  devices = list(index_map)
  indices = [index_map[d] for d in devices]
  aval = jax_core.update_aval_with_sharding(jax_core.ShapedArray(shape, dtype), sharding)

  def transfer(x: Any) -> jax.Array:
    return put(aval, sharding, [x[i] for i in indices], devices)

  return transfer


# -- the profiler and the persistent compilation cache ------------------------------------------------------


def _profiler_collecting_fallback() -> bool:
  return True


def _find_profiler_collecting() -> Callable[[], bool]:
  """`jax.profiler.TraceAnnotation.is_enabled`: whether a profiler session (any: `jax.profiler.start_trace`,
  a profiler server's capture, TensorBoard's) records trace annotations now. JAX 0.10.2 and 0.12 inherit
  it, undocumented, from their C++ ``TraceMe`` (one C call, about 0.03 us). Without it, annotations are
  always made (0.7 us a step)."""
  found = getattr(jax.profiler.TraceAnnotation, "is_enabled", None)
  return found if callable(found) else _profiler_collecting_fallback


profiler_collecting: Callable[[], bool] = _find_profiler_collecting()


def reset_compilation_cache() -> None:
  """Makes JAX read ``jax_compilation_cache_dir`` again at its next compilation.

  JAX decides once per process, at its first compilation, whether the persistent cache is used; a cache
  directory set after that is ignored until ``jax.experimental.compilation_cache.compilation_cache.
  reset_cache()`` (JAX 0.10.2 and 0.12).
  """
  from jax.experimental.compilation_cache import compilation_cache  # pylint: disable=import-outside-toplevel
  compilation_cache.reset_cache()
