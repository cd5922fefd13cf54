"""Logical devices: model parallelism inside a replica, as sharding annotations on the mesh's core axes.

TF runs a replica on several TPU cores ("logical devices") when its `DeviceAssignment` has more than
one core per replica; inside `strategy.run` three annotations say how a tensor is laid out on them:
`experimental_split_to_logical_devices` (XLA tile sharding), `experimental_replicate_to_logical_devices`
(replicated sharding) and `experimental_assign_to_logical_device` (maximal sharding: one core). XLA's
SPMD partitioner then compiles one program for all cores.

tpustrat's strategy mesh is replicas x logical cores. The ``C`` logical cores of a replica are the axes
``core_0, core_1, ...`` of the mesh, one per prime factor of ``C`` in increasing order (8 cores:
three axes of size 2), so that logical core ``l`` is the row-major index over those axes. `run` is a
`jax.shard_map` that is manual over ``'replica'`` only (``axis_names={'replica'}``): inside the step,
every value is one replica's value, and how it is laid out on the replica's cores is left to XLA,
steered by these annotations:

* **split**: `jax.lax.with_sharding_constraint` with a `PartitionSpec` that gives each tensor dimension
  ``d`` the core axes whose sizes multiply to ``partition_dimensions[d]``, consecutive and in order.
  This is TF's tile assignment ``arange(C).reshape(partition_dimensions)``: the tile at position ``t``
  lives on logical core ``arange(C).reshape(partition_dimensions)[t]``. (Only when ``C`` has a prime
  factor twice *and* another prime, e.g. 12, can a partition need non-consecutive axes; the tiles then
  still go one per core, in a different order; values are unaffected.)
* **replicate**: `with_sharding_constraint` with ``P()``: every core holds the whole tensor.
* **assign**: XLA's maximal sharding is not expressible in JAX inside a multi-device program (a
  single-device sharding is rejected, and a maximal annotation inside `shard_map` is dropped). XLA
  implements a maximal sharding as a conditional on the partition id that computes the op on one
  device; tpustrat builds exactly that. The annotation marks the tensor; `run` traces the step once to
  a jaxpr and evaluates the *computation of the tensor* (the operation that produced it, and every
  operation before it whose results are used only on the way to it) inside a nested `jax.shard_map`
  over the core axes, under ``lax.cond(core == logical_device_id, ...)``: only that core computes; the
  others skip it. The result is then broadcast to the replica's other cores (an all-reduce of its bit
  patterns to which the other cores contribute zeros: exact, signed zeros and NaN payloads included),
  because later operations read it wherever they run. What is different from TF:

  - later operations that use the tensor are not moved (XLA would propagate the maximal sharding to
    them); annotate their results too to place them;
  - a tensor that the step did not compute (an argument of the step) has nothing to place: it already
    entered the step whole on every core of the replica, and the annotation returns it unchanged;
  - operations with side effects (callbacks, prints) and sharding annotations stay outside the placed
    computation, as do its inputs: values split across cores are gathered to every core first;
  - the annotation may be at the top level of the step function (plain Python, `jax.grad` and
    `jax.vmap` are fine), inside a nested `jax.jit`, `jax.checkpoint` or custom-derivative call (the
    call is evaluated inline, its body placed like the step's own; a checkpoint's rematerialisation is
    not kept for it), or inside a `lax.scan` body (the scan is re-emitted with each iteration's body
    placed). Inside `lax.cond`, `lax.while_loop` or another sub-program, compiling the step raises an
    error that says so;
  - gradients: only the forward computation is placed (tangents and cotangents pass unannotated).

With one core per replica the mesh has no core axes, `run` is manual over every axis as before, split
and replicate accept only the trivial partition, and assign accepts only logical device 0.

One replica of several cores (``num_replicas=1``): the ``'replica'`` axis then has size 1, and XLA's SPMD
partitioner rejects a collective over a manual axis of size 1 once sharding propagation has split its
operand over the core axes ("Cross-partition allreduce must be in (partial) manual partitioning mode";
it happens to the gradient sums JAX adds for replicated parameters). `run` keeps the operands and
results of such collectives at the top level of the step replicated over the cores, which moves no data
between replicas (there is one) and avoids the error; a collective over ``'replica'`` inside a nested
`jax.jit` of the step is not rewritten.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src import jax_compat as compat

if TYPE_CHECKING:
  from tpustrat._src.strategy import Strategy

__all__ = [
    "assign_to_logical_device",
    "core_axis_sizes",
    "place_on_logical_devices",
    "replica_core_mesh",
    "replicate_to_logical_devices",
    "split_to_logical_devices",
]

REPLICA_AXIS = "replica"
CORE_AXIS_PREFIX = "core_"


# -- the mesh -----------------------------------------------------------------------------------------


def core_axis_sizes(num_cores: int) -> list[int]:
  """The prime factors of `num_cores`, in increasing order: the sizes of the mesh's core axes.

  >>> core_axis_sizes(8), core_axis_sizes(12), core_axis_sizes(1)
  ([2, 2, 2], [2, 2, 3], [])
  """
  sizes, n, p = [], int(num_cores), 2
  while n > 1:
    while n % p == 0:
      sizes.append(p)
      n //= p
    p += 1
  return sizes


def replica_core_mesh(grid: np.ndarray) -> Mesh:
  """The strategy mesh for a ``[num_replicas, cores_per_replica]`` array of devices.

  Axes: ``'replica'``, then one ``core_i`` axis per prime factor of the cores per replica (none for
  one core per replica: the mesh is then the 1-D replica mesh).

  >>> devices = np.asarray(jax.devices(), dtype=object).reshape(4, 2)
  >>> dict(replica_core_mesh(devices).shape)
  {'replica': 4, 'core_0': 2}
  >>> replica_core_mesh(devices.reshape(1, 8)).axis_names
  ('replica', 'core_0', 'core_1', 'core_2')
  """
  grid = np.asarray(grid, dtype=object)
  if grid.ndim != 2 or grid.size == 0:
    raise ValueError(f"Expected a non-empty [num_replicas, cores_per_replica] array of devices, got shape {grid.shape}.")
  sizes = core_axis_sizes(grid.shape[1])
  names = (REPLICA_AXIS,) + tuple(f"{CORE_AXIS_PREFIX}{i}" for i in range(len(sizes)))
  return Mesh(grid.reshape([grid.shape[0]] + sizes), names)


def _core_axes(strategy: Strategy) -> tuple[tuple[str, ...], tuple[int, ...]]:
  mesh = strategy.mesh
  names = tuple(a for a in mesh.axis_names if a != REPLICA_AXIS)
  return names, tuple(mesh.shape[a] for a in names)


def _check_in_run(strategy: Strategy, api: str) -> None:
  ctx = context_lib._STATE.replica_context  # pylint: disable=protected-access
  if ctx is None or ctx._axis_name is None or ctx.strategy is not strategy:  # pylint: disable=protected-access
    raise RuntimeError(
        f"strategy.{api} annotates a tensor inside a replica and must be called in the function given to "
        f"strategy.run of the same strategy ({strategy!r}).")


def _check_int(value: Any, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise ValueError(f"{what} must be an int, got {value!r}.")
  return int(value)


# -- split / replicate --------------------------------------------------------------------------------


def partition_spec(partition_dimensions: Sequence[int], names: Sequence[str], sizes: Sequence[int]) -> P:
  """The `PartitionSpec` over core axes (`names`, of `sizes`) that tiles a tensor like TF's tile
  assignment ``arange(prod(partition_dimensions)).reshape(partition_dimensions)``.

  >>> partition_spec([1, 2, 4, 1], ["core_0", "core_1", "core_2"], [2, 2, 2])
  P(None, 'core_0', ('core_1', 'core_2'), None)
  """
  spec: list[Any] = []
  pos = 0
  for d in partition_dimensions:  # consecutive axes in order: exactly TF's tile assignment
    group, prod = [], 1
    while prod < d and pos < len(sizes):
      group.append(names[pos])
      prod *= sizes[pos]
      pos += 1
    if prod != d:
      break
    spec.append(None if not group else group[0] if len(group) == 1 else tuple(group))
  else:
    return P(*spec)
  # Not expressible with consecutive axes (cores like 12 = 2*2*3 split [3, 4]): give each dimension
  # axes of its prime factors; tiles still go one per core, in another order.
  free = list(range(len(sizes)))
  spec = []
  for d in partition_dimensions:
    group = []
    for f in core_axis_sizes(d):
      i = next(i for i in free if sizes[i] == f)
      free.remove(i)
      group.append(names[i])
    spec.append(None if not group else group[0] if len(group) == 1 else tuple(group))
  return P(*spec)


def split_to_logical_devices(strategy: Strategy, tensor: Any, partition_dimensions: Sequence[int]) -> Any:
  """`TPUStrategy.experimental_split_to_logical_devices` (see that method)."""
  _check_in_run(strategy, "experimental_split_to_logical_devices")
  names, sizes = _core_axes(strategy)
  num_cores = int(np.prod(sizes, dtype=np.int64))
  if isinstance(partition_dimensions, (str, bytes)) or not isinstance(partition_dimensions, (Sequence, np.ndarray)):
    raise ValueError(
        f"`partition_dimensions` must be a list of ints, one per dimension of the tensor; got {partition_dimensions!r}.")
  dims = [_check_int(d, "Every entry of `partition_dimensions`") for d in partition_dimensions]
  if any(d < 1 for d in dims):
    raise ValueError(f"`partition_dimensions` must be positive; got {dims}.")
  x = jnp.asarray(tensor)
  if x.ndim != len(dims):
    raise ValueError(
        f"Length of `partition_dimensions` ({len(dims)}) must be equal to the rank of `tensor` ({x.ndim}); "
        f"got partition_dimensions={dims} for a tensor of shape {x.shape}.")
  for i, (size, d) in enumerate(zip(x.shape, dims)):
    if size % d:
      raise ValueError(
          f"Tensor shape at dimension ({i}) must be divisible by corresponding value specified by "
          f"`partition_dimensions` ({d}); got shape {x.shape} and partition_dimensions={dims}.")
  if int(np.prod(dims, dtype=np.int64)) != num_cores:
    raise ValueError(
        f"Number of logical devices ({num_cores}) does not match the number of partition splits specified "
        f"({int(np.prod(dims, dtype=np.int64))}): partition_dimensions={dims} must multiply to the number of "
        "logical devices per replica (num_cores_per_replica of the strategy's DeviceAssignment).")
  if not names:
    return x
  return lax.with_sharding_constraint(x, partition_spec(dims, names, sizes))


def replicate_to_logical_devices(strategy: Strategy, tensor: Any) -> Any:
  """`TPUStrategy.experimental_replicate_to_logical_devices` (see that method)."""
  _check_in_run(strategy, "experimental_replicate_to_logical_devices")
  names, _ = _core_axes(strategy)
  if not names:
    return jax.tree.map(jnp.asarray, tensor)
  return jax.tree.map(lambda x: lax.with_sharding_constraint(jnp.asarray(x), P()), tensor)


# -- assign: a marker, then the step's jaxpr is rewritten by `place_on_logical_devices` ---------------

def _assign_lowering_error(*, logical_device_id: int) -> Exception:
  return NotImplementedError(
      f"strategy.experimental_assign_to_logical_device(..., {logical_device_id}) was used inside lax.cond, "
      "lax.while_loop, or another transformation with its own sub-program, within the step function. "
      "tpustrat places the tensor's computation on one logical device by rewriting the step function's "
      "operations: call the annotation at the top level of the function given to strategy.run, inside a "
      "nested jax.jit or jax.checkpoint, or inside a lax.scan body (jax.grad and jax.vmap are fine).")


# An identity on its operand, found by `place_on_logical_devices`; compiling one it did not remove (inside
# lax.cond, while_loop, ...) raises `_assign_lowering_error`.
_assign_p = compat.identity_primitive("tpustrat_assign_to_logical_device", _assign_lowering_error)


def assign_to_logical_device(strategy: Strategy, tensor: Any, logical_device_id: int) -> Any:
  """`TPUStrategy.experimental_assign_to_logical_device` (see that method)."""
  _check_in_run(strategy, "experimental_assign_to_logical_device")
  names, sizes = _core_axes(strategy)
  num_cores = int(np.prod(sizes, dtype=np.int64))
  k = _check_int(logical_device_id, "`logical_device_id`")
  if not 0 <= k < num_cores:
    raise ValueError(
        f"`logical_core_id` to assign must be lower then total number of logical devices per replica. "
        f"Received logical device id {k} but there are only total of {num_cores} logical devices in replica.")
  if not names:
    return jax.tree.map(jnp.asarray, tensor)
  return jax.tree.map(lambda x: _assign_p.bind(jnp.asarray(x), logical_device_id=k), tensor)


def _varying(aval: Any) -> tuple[str, ...]:
  """The manual mesh axes a value of type `aval` varies over (JAX's vma), sorted."""
  return tuple(sorted(compat.aval_varying_axes(aval)))


def _has_assign(eqn: Any) -> bool:
  """Whether `eqn` is, or contains in a sub-program, an `assign_to_logical_device` marker."""
  if eqn.primitive is _assign_p:
    return True
  return any(_has_assign(e) for sub in compat.sub_jaxprs(eqn) for e in sub.eqns)


def _has_annotations(eqn: Any) -> bool:
  """Whether `eqn` is (or contains) a sharding annotation or a placement marker."""
  if eqn.primitive is _assign_p or compat.is_sharding_constraint(eqn):
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
    if eqn.primitive is not _assign_p:
      continue
    k = eqn.params["logical_device_id"]
    x = eqn.invars[0]
    p = producer.get(x) if compat.is_var(x) else None
    if p is None or eqns[p].primitive is _assign_p:
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
    elif eqn.primitive is _assign_p:
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
        body, consts = compat.call_body(eqn)
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


def place_on_logical_devices(fn: Callable[..., Any], core_axes: tuple[str, ...], num_replicas: int) -> Callable[..., Any]:
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
