"""`experimental_assign_to_logical_device`, honoured: the step's jaxpr evaluated with each assigned
computation on its logical core (see `tpustrat._src.logical` for the annotations and what differs from TF).

`assign_to_logical_device` marks a tensor with `assign_p`, an identity. `run` (on a mesh with core axes)
wraps the step in `place_on_logical_devices`, which traces it once to a jaxpr and evaluates it in the
current trace: the computation of each marked tensor (its producer and every earlier equation whose
results are used only on the way to it) runs inside a nested `jax.shard_map` over the core axes, under
``lax.cond(core == logical_device_id, ...)``, and its results are broadcast to the replica's other cores.
Plain calls (jit, checkpoint, custom derivatives) holding a marker are evaluated inline, and a `lax.scan`
holding one is re-emitted with its body placed. A marker left inside another sub-program fails to compile
with an error that says so.

With one replica of several cores, collectives over ``'replica'`` at the top level of the step keep their
operands and results replicated over the cores (XLA's SPMD partitioner rejects them otherwise).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tpustrat._src import jax_compat as compat
from tpustrat._src.names import REPLICA_AXIS

__all__ = ["assign_p", "place_on_logical_devices"]


# -- the marker ---------------------------------------------------------------------------------------


def _assign_lowering_error(*, logical_device_id: int) -> Exception:
  return NotImplementedError(
      f"strategy.experimental_assign_to_logical_device(..., {logical_device_id}) was used inside lax.cond, "
      "lax.while_loop, or another transformation with its own sub-program, within the step function. "
      "tpustrat places the tensor's computation on one logical device by rewriting the step function's "
      "operations: call the annotation at the top level of the function given to strategy.run, inside a "
      "nested jax.jit or jax.checkpoint, or inside a lax.scan body (jax.grad and jax.vmap are fine).")


# An identity on its operand, found by `place_on_logical_devices`; compiling one it did not remove (inside
# lax.cond, while_loop, ...) raises `_assign_lowering_error`.
assign_p = compat.identity_primitive("tpustrat_assign_to_logical_device", _assign_lowering_error)


# -- the interpreter ----------------------------------------------------------------------------------


def _varying(aval: Any) -> tuple[str, ...]:
  """The manual mesh axes a value of type `aval` varies over (JAX's vma), sorted."""
  return tuple(sorted(compat.aval_varying_axes(aval)))


def _has_assign(eqn: Any) -> bool:
  """Whether `eqn` is, or contains in a sub-program, an `assign_to_logical_device` marker."""
  if eqn.primitive is assign_p:
    return True
  return any(_has_assign(e) for sub in compat.sub_jaxprs(eqn) for e in sub.eqns)


def _has_annotations(eqn: Any) -> bool:
  """Whether `eqn` is (or contains) a sharding annotation or a placement marker."""
  if eqn.primitive is assign_p or compat.is_sharding_constraint(eqn):
    return True
  for sub in compat.sub_jaxprs(eqn):
    if any(_has_annotations(e) for e in sub.eqns):
      return True
  return False


# Plain calls (`compat.call_body`: jit, checkpoint, custom_jvp / custom_vjp) are re-bound inline when
# placed (see `_bind_jaxpr`), or evaluated inline when they hold a placement (`_evaluate`); other primitives
# with sub-programs (lax.cond / while_loop / scan, nested shard_map, ...) cannot be placed on one core (a
# scan body with placements is re-emitted, `_placed_scan`).


def _placeable(eqn: Any) -> bool:
  """Whether `eqn` can be evaluated on one logical core: no side effects, no sharding annotations, and
  no sub-program other than a plain call (jit, custom_jvp / custom_vjp, checkpoint) of placeable ones."""
  if eqn.effects or _has_annotations(eqn):
    return False
  if not compat.sub_jaxprs(eqn):
    return True
  body = compat.call_body(eqn)
  return body is not None and len(body[0].invars) == len(eqn.invars) and all(_placeable(e) for e in body[0].eqns)


def _bind_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
  """Evaluates `jaxpr` in the current trace, binding each primitive afresh.

  Unlike `compat.eval_jaxpr` it does not re-enter each equation's recorded context (which pins the
  abstract mesh the step was traced under: inside the nested `shard_map` the core axes are manual), and
  it inlines plain calls, whose recorded bodies and context mesh would be stale there too. Only for
  equations that `_placeable` accepts.
  """
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v: Any) -> Any:
    if compat.is_literal(v):  # a plain array: the literal's recorded type names the old mesh
      return np.asarray(compat.literal_value(v), dtype=v.aval.dtype)
    return env[v]

  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    body = compat.call_body(eqn)
    if body is not None:
      outs = _bind_jaxpr(body[0], body[1], invals)
    else:
      outs = compat.bind_equation(eqn, invals)
    for v, x in zip(eqn.outvars, outs):
      if not compat.is_drop_var(v):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _groups(jaxpr: Any) -> dict[int, tuple[list[int], int]]:
  """For each marker of a computed tensor: the equations that compute it (the tensor's producer and
  every earlier equation whose results are used only by those), keyed by the producer's index."""
  eqns = jaxpr.eqns
  producer: dict[Any, int] = {}
  users: dict[Any, list[int]] = {}
  for i, eqn in enumerate(eqns):
    for v in eqn.outvars:
      producer[v] = i
    for v in eqn.invars:
      if compat.is_var(v):
        users.setdefault(v, []).append(i)
  outputs = {v for v in jaxpr.outvars if compat.is_var(v)}
  groups: dict[int, tuple[list[int], int]] = {}
  owner: dict[int, int] = {}  # equation -> anchor of the group it belongs to
  for eqn in eqns:
    if eqn.primitive is not assign_p:
      continue
    k = eqn.params["logical_device_id"]
    x = eqn.invars[0]
    p = producer.get(x) if compat.is_var(x) else None
    if p is None or eqns[p].primitive is assign_p:
      continue  # an argument, a constant, or an already annotated tensor: nothing to place
    if p in owner:
      if groups[owner[p]][1] != k:
        raise ValueError(
            f"strategy.experimental_assign_to_logical_device: one computation was assigned to logical devices "
            f"{groups[owner[p]][1]} and {k}; assign each tensor to one logical device.")
      continue
    if not _placeable(eqns[p]):
      raise ValueError(
          f"strategy.experimental_assign_to_logical_device: the tensor assigned to logical device {k} is "
          f"produced by `{eqns[p].primitive.name}`, which cannot run on one logical device: it has side "
          "effects, contains sharding annotations, or is a control-flow primitive (lax.cond, while_loop, "
          "scan) or nested shard_map. Assign a tensor computed from it instead.")
    members = {p}
    heap = [-q for q in {producer[v] for v in eqns[p].invars if compat.is_var(v) and v in producer}]
    heapq.heapify(heap)
    seen: set[int] = set()
    while heap:  # latest equation first: all of its users have been decided
      q = -heapq.heappop(heap)
      if q in seen:
        continue
      seen.add(q)
      e = eqns[q]
      if q in owner or not _placeable(e) or any(v in outputs for v in e.outvars):
        continue
      if all(u in members for v in e.outvars for u in users.get(v, ())):
        members.add(q)
        for v in e.invars:
          if compat.is_var(v) and v in producer:
            heapq.heappush(heap, -producer[v])
    for q in members:
      owner[q] = p
    groups[p] = (sorted(members), k)
  return groups


def _free_and_defined(eqns: list[Any]) -> tuple[list[Any], list[Any]]:
  """Variables `eqns` read but do not define (in first-use order), and the variables they define."""
  defined: list[Any] = []
  defined_set: set[Any] = set()
  free: dict[Any, None] = {}
  for e in eqns:
    for v in e.invars:
      if compat.is_var(v) and v not in defined_set:
        free.setdefault(v, None)
    for v in e.outvars:
      if compat.is_var(v) and not compat.is_drop_var(v):
        defined.append(v)
        defined_set.add(v)
  return list(free), defined


def _sum_bits(x: Any, axes: tuple[str, ...]) -> Any:
  """`psum` of the bit patterns of `x` over `axes`: exact when every other member contributes zero bits
  (signed zeros and NaN payloads survive, which a float sum starting from +0.0 would not keep)."""
  dtype = x.dtype
  if dtype == np.bool_:
    return lax.psum(x.astype(jnp.uint8), axes).astype(jnp.bool_)
  if jnp.issubdtype(dtype, jnp.integer):
    return lax.psum(x, axes)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return lax.complex(_sum_bits(jnp.real(x), axes), _sum_bits(jnp.imag(x), axes))
  if jnp.issubdtype(dtype, jnp.floating):
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dtype).itemsize]
    return lax.bitcast_convert_type(lax.psum(lax.bitcast_convert_type(x, bits), axes), dtype)
  raise AssertionError(dtype)  # excluded by `_on_logical_device`


def _on_logical_device(jaxpr: Any, outs: list[Any], k: int, core_axes: tuple[str, ...]) -> Callable[..., Any]:
  """`jaxpr` computed on logical core `k` only, its results then broadcast to the replica's cores."""
  for v in outs:
    if not (v.aval.dtype == np.bool_ or jnp.issubdtype(v.aval.dtype, jnp.number)):
      raise ValueError(
          f"strategy.experimental_assign_to_logical_device: the computation placed on logical device {k} "
          f"returns a {v.aval.dtype} value, which cannot be sent to the replica's other logical devices; "
          "assign numeric or boolean tensors (for PRNG keys, assign what is computed from them).")

  def off_core() -> list[Any]:
    zeros = []
    for v in outs:
      z = jnp.zeros(v.aval.shape, v.aval.dtype)  # all bits 0
      vary = _varying(v.aval)
      zeros.append(lax.pcast(z, vary, to="varying") if vary else z)
    return zeros

  def broadcast(x: Any) -> Any:
    missing = tuple(a for a in core_axes if a not in _varying(jax.typeof(x)))
    if missing:
      x = lax.pcast(x, missing, to="varying")
    return _sum_bits(x, core_axes)

  def per_core(*args: Any) -> list[Any]:
    here = lax.axis_index(core_axes) == k
    on = lax.cond(here, lambda: _bind_jaxpr(jaxpr, [], args), off_core)
    return [broadcast(x) for x in on]

  return jax.shard_map(per_core, in_specs=P(), out_specs=P(), axis_names=frozenset(core_axes))


def _is_replica_collective(eqn: Any) -> bool:
  return REPLICA_AXIS in (compat.collective_axes(eqn) or ())


def _evaluate(closed: Any, args: Sequence[Any], core_axes: tuple[str, ...], num_replicas: int) -> list[Any]:
  """Evaluates the step's jaxpr in the current trace, each assigned computation on its logical core."""
  jaxpr = closed.jaxpr
  debug_info = compat.unnamed_debug_info(jaxpr)
  groups = _groups(jaxpr)
  members = {q for group, _ in groups.values() for q in group}
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))

  def read(v: Any) -> Any:
    return compat.literal_value(v) if compat.is_literal(v) else env[v]

  segment: list[Any] = []

  def flush() -> None:
    if segment:
      free, defined = _free_and_defined(segment)
      sub = compat.jaxpr_from_equations(list(segment), free, defined, debug_info)
      values = compat.eval_jaxpr(sub, [read(v) for v in free])
      env.update(zip(defined, values))
      segment.clear()

  for i, eqn in enumerate(jaxpr.eqns):
    if i in groups:
      flush()
      group, k = groups[i]
      group_eqns = [jaxpr.eqns[q] for q in group]
      free, defined = _free_and_defined(group_eqns)
      inside = set(group)
      used_outside = {v for j, e in enumerate(jaxpr.eqns) if j not in inside for v in e.invars
                      if compat.is_var(v)} | set(jaxpr.outvars)
      outs = [v for v in defined if v in used_outside]
      sub = compat.jaxpr_from_equations(group_eqns, free, outs, debug_info)
      env.update(zip(outs, _on_logical_device(sub, outs, k, core_axes)(*[read(v) for v in free])))
    elif i in members:
      continue  # evaluated with its group, at the tensor's producer
    elif eqn.primitive is assign_p:
      flush()
      env[eqn.outvars[0]] = read(eqn.invars[0])
    elif _has_assign(eqn) and (compat.is_scan(eqn) or compat.call_body(eqn) is not None):
      flush()
      args = [read(v) for v in eqn.invars]
      if compat.is_scan(eqn):
        outs = _placed_scan(eqn, args, core_axes, num_replicas)
      else:
        # A nested jit / checkpoint / custom-derivative call with a placement inside: evaluated inline,
        # its body placed like the step's own (a checkpoint's rematerialisation is not kept).
        call = compat.call_body(eqn)
        assert call is not None  # the branch's condition
        body, consts = call
        outs = _evaluate(compat.close_jaxpr(body, consts), args, core_axes, num_replicas)
      env.update(zip(eqn.outvars, outs))
    elif num_replicas == 1 and _is_replica_collective(eqn):
      # XLA's SPMD partitioner rejects a collective over a manual axis of size 1 once sharding propagation
      # has split it over the core axes ("Cross-partition allreduce must be in (partial) manual
      # partitioning mode"); with one replica such a collective moves nothing: keep it replicated.
      flush()
      free, defined = _free_and_defined([eqn])
      replicated = [lax.with_sharding_constraint(read(v), P()) for v in free]
      outs = compat.eval_jaxpr(compat.jaxpr_from_equations([eqn], free, defined, debug_info), replicated)
      env.update((v, lax.with_sharding_constraint(x, P())) for v, x in zip(defined, outs))
    else:
      segment.append(eqn)
  flush()
  return [read(v) for v in jaxpr.outvars]


def _placed_scan(eqn: Any, args: list[Any], core_axes: tuple[str, ...], num_replicas: int) -> list[Any]:
  """A `lax.scan` equation whose body places computations on logical cores: the same scan, with each
  iteration's body evaluated by `_evaluate`."""
  sig = compat.scan_signature(eqn)
  num_consts, num_carry = sig.num_consts, sig.num_carry
  consts, init, xs = args[:num_consts], args[num_consts:num_consts + num_carry], args[num_consts + num_carry:]

  def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
    outs = _evaluate(sig.body, [*consts, *carry, *x], core_axes, num_replicas)
    return outs[:num_carry], outs[num_carry:]

  carry, ys = lax.scan(body, list(init), list(xs), length=sig.length, reverse=sig.reverse, unroll=sig.unroll)
  return [*carry, *ys]


def _is_array_like(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)) or hasattr(x, "__jax_array__")


def place_on_logical_devices(fn: Callable[..., Any], core_axes: tuple[str, ...],
                             num_replicas: int) -> Callable[..., Any]:
  """`fn` traced once to a jaxpr and evaluated with every `assign_to_logical_device` honoured.

  Used by `run` on meshes with core axes, inside the replica's `shard_map`. Results that are not arrays
  are handed back as they are (`run` reports them).
  """

  def placed(*args: Any, **kwargs: Any) -> Any:
    leaves, in_tree = jax.tree.flatten((args, kwargs))
    record: dict[str, Any] = {}

    def flat_fn(*flat: Any) -> list[Any]:
      a, kw = jax.tree.unflatten(in_tree, list(flat))
      out_leaves, record["tree"] = jax.tree.flatten(fn(*a, **kw))
      record["other"] = {i: x for i, x in enumerate(out_leaves) if not _is_array_like(x)}
      return [x for x in out_leaves if _is_array_like(x)]

    closed = jax.make_jaxpr(flat_fn)(*leaves)
    values = iter(_evaluate(closed, leaves, core_axes, num_replicas))
    tree, other = record["tree"], record["other"]
    out = [other[i] if i in other else next(values) for i in range(tree.num_leaves)]
    return jax.tree.unflatten(tree, out)

  return placed
