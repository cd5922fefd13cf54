"""TPU collectives with group assignments: TF's `CrossReplicaSum`, `AllToAll` and siblings on JAX.

TF's TPU programs call raw collectives with a `group_assignment`: an int matrix of shape
``[num_groups, num_replicas_per_group]`` whose row ``g`` lists the replica ids of group ``g``. Each
replica then communicates with the members of its own group only. In JAX these are named collectives
over the strategy mesh's replica axis with ``axis_index_groups``:

====================================  ======================================================================
TF                                    JAX, inside `strategy.run`
====================================  ======================================================================
`CrossReplicaSum`                     grouped all-reduce (see "Grouped sums" below); `lax.psum` for one group
`AllToAll`                            `lax.all_to_all(..., axis_index_groups=groups, tiled=True)`
all-gather                            `lax.all_gather(..., axis_index_groups=groups, tiled=True)`
`XlaReduceScatter`                    `lax.psum_scatter(..., axis_index_groups=groups, tiled=True)`
`CollectivePermute`                   `lax.ppermute(x, axis, source_target_pairs)`
====================================  ======================================================================

Every argument is checked in Python, on the host, before any collective is emitted: a bad group
assignment, `split_count` or dimension is a `ValueError` that quotes the offending value.

Result types follow JAX's varying-axis analysis, which `strategy.run` uses to pick `Mirrored` or
`PerReplica`: a sum or gather over one group of all replicas is the same everywhere (invariant,
`Mirrored`); grouped sums and gathers differ between groups (varying, `PerReplica`), and so do
scatters, all-to-alls and permutes. A grouped result is varying even when the input is the same on every
replica (a `Mirrored` value: the grouped sum is then ``group_size * x``, still typed varying), so that
its type, and its gradient, do not depend on the input's type: the gradient w.r.t. a `Mirrored` input of
a loss computed from a grouped result is summed over the replicas, the same as w.r.t.
`local_copy(input)`. This holds for grouped SUM and MEAN alike, and matches the grouped `all_gather`,
`all_to_all`, `reduce_scatter` and `collective_permute`, whose JAX collectives cast an invariant input
to varying themselves.

Grouped sums
------------
A grouped sum of varying values runs the native grouped `psum` in a nested unchecked `shard_map`, as a
`jax.custom_vjp` whose backward pass is the same grouped sum; where the installed JAX rejects that (a
probe program traced once per process decides), it is a reduce-scatter followed by an all-gather within
the groups. `docs/benchmarks_collectives.md` records the mechanisms considered and their measured cost.

Sums of values that are already the same on every replica
----------------------------------------------------------
A value JAX knows to be invariant over the replica axis (the same on every replica) is multiplied by
the number of replicas summed over (``N`` for `cross_replica_sum` over all replicas and for
``ReplicaContext.all_reduce(SUM, ...)``, the group size with a `group_assignment`). That is TF's answer
for such a value, but in JAX it is also what happens to the most common value of that kind: gradients
taken with `jax.grad` w.r.t. `Mirrored` (replicated) parameters inside `strategy.run` come back already
summed over replicas (the transpose of the parameter's implicit broadcast is a sum), so TF's loop
``grads = ctx.all_reduce("sum", grads)`` gives ``N`` times the gradient. Every SUM over the replica axis
(`ReplicaContext.all_reduce`, `cross_replica_sum`, `reduce_scatter`,
`CrossDeviceOps.all_reduce_in_replica_context`) therefore emits an `AlreadyReplicatedWarning` while the
program is traced (once per call in the traced function, counting the invariant leaves) when it gets
such a traced value. Python numbers and concrete arrays closed over as constants do not warn (they
cannot be gradients, and ``all_reduce("sum", 1)`` is TF's idiom to count replicas). `MEAN` of an
invariant value returns it unchanged and does not warn. The fixes: drop the `all_reduce` (the gradients
are already the sum over replicas), or differentiate w.r.t. `tpustrat.local_copy(params)` to get TF's
per-replica gradients and keep TF's loop as it is; for a deliberate ``N * x`` write the product.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src.jax_compat import all_gather_invariant, to_varying, varying_axes
from tpustrat._src.reduce_op import ReduceOp

__all__ = ["AlreadyReplicatedWarning", "all_gather", "all_to_all", "collective_permute", "cross_replica_sum",
           "local_copy", "reduce_scatter"]

_log = logging.getLogger(__name__)

Groups = tuple[tuple[int, ...], ...]

# TF's CrossReplicaSum accepts bfloat16, float32, int32 and uint32; float16 and float64 are added where
# JAX has them (float64 needs `jax_enable_x64`).
_SUM_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, np.float16, np.float32, np.float64, np.int32,
                                          np.uint32))

# How a grouped sum of varying values is computed: "auto" asks `_native_grouped_sum_supported` (a probe
# traced once per process); tests force "native" or "scatter_gather". Only read, never written, here.
_GROUPED_SUM_IMPL = "auto"


# -- sums of values that are already the same on every replica ----------------------------------------


class AlreadyReplicatedWarning(UserWarning):
  """A SUM over replicas got a value that is already the same on every replica (invariant over the replica
  axis), so the result is ``N`` times it.

  Emitted at trace time by `ReplicaContext.all_reduce` (SUM), `tpustrat.ops.cross_replica_sum`,
  `tpustrat.ops.reduce_scatter` (SUM) and `CrossDeviceOps.all_reduce_in_replica_context` (SUM), once per
  call, when a traced leaf of the value is invariant over the replica axis. The usual cause is TF's loop
  ``grads = ctx.all_reduce("sum", grads)`` after `jax.grad` w.r.t. `Mirrored` parameters inside
  `strategy.run`: JAX has already summed those gradients over replicas. Drop the `all_reduce`, or
  differentiate w.r.t. `tpustrat.local_copy(params)` to get TF's per-replica gradients. A deliberate
  ``N * x`` is better written as the product (``x * ctx.num_replicas_in_sync``); the warning can also be
  silenced with ``warnings.filterwarnings("ignore", category=tpustrat.AlreadyReplicatedWarning)``.
  """


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../tpustrat/
_REPORTED_AS = threading.local()  # `name`: the API the user called, while it dispatches to the ones below


@contextlib.contextmanager
def reported_as(api: str) -> Iterator[None]:
  """Inside, `warn_if_already_replicated` names `api` (the method the user called, for example
  ``ReplicaContext.all_reduce`` routing to cross-device ops) instead of the function that sums."""
  outer = getattr(_REPORTED_AS, "name", None)
  _REPORTED_AS.name = outer or api
  try:
    yield
  finally:
    _REPORTED_AS.name = outer


def warn_if_already_replicated(api: str, leaves: Sequence[Any], axis: str, factor: int, scope: str,
                               reduce_op: str = "SUM") -> None:
  """Warns once if a SUM or MEAN over `axis` gets traced leaves that are invariant over it (see the module
  docstring). SUM multiplies such a value by `factor`; MEAN returns it unchanged, which for a gradient
  w.r.t. Mirrored parameters (already the sum over replicas) is `factor` times TF's mean.

  Args:
    api: the name the user called, e.g. ``"tpustrat.ops.cross_replica_sum"`` (an enclosing `reported_as`
      takes precedence). Call this after the arguments are validated, where the sum is made, so that
      each call warns at most once and errors come first.
    leaves: the leaves of the value as the user passed them (before any conversion: a Python number or
      concrete array is a constant, never a traced gradient, and does not warn).
    axis: the replica axis.
    factor: how many times SUM counts each invariant value (`N` or the group size); 1 never warns.
    scope: what `factor` is, for the message: ``"num_replicas_in_sync"`` or ``"the group size"``.
  """
  if factor <= 1:
    return
  count = sum(1 for x in leaves if isinstance(x, jax.core.Tracer) and axis not in varying_axes(x))
  if not count:
    return
  api = getattr(_REPORTED_AS, "name", None) or api
  which = "the value" if len(leaves) == 1 else f"{count} of the {len(leaves)} leaves of the value"
  short = api.rsplit(".", 1)[-1]
  if reduce_op == "MEAN":
    message = (
        f"{api}(MEAN): {which} is already the same on every replica (invariant over the replica axis "
        f"{axis!r}), so MEAN returns it unchanged. Gradients taken with jax.grad w.r.t. Mirrored (replicated) "
        "parameters inside strategy.run are such values: JAX has already summed them over replicas, so "
        f"this 'mean' is the SUM, N={factor} ({scope}) times the mean TF's loop computes. Fix: divide by "
        f"N (or scale the loss by 1/global_batch_size and drop the {short}); or, to keep TF's loop "
        "unchanged (per-replica gradients, then all_reduce MEAN), differentiate w.r.t. "
        "tpustrat.local_copy(params). If the value is meant to pass unchanged, drop the call.")
  else:
    message = (
        f"{api}(SUM): {which} is already the same on every replica (invariant over the replica axis "
        f"{axis!r}), so SUM multiplies it by N={factor} ({scope}). Gradients taken with jax.grad w.r.t. "
        "Mirrored (replicated) parameters inside strategy.run are such values: JAX has already summed them "
        f"over replicas, and summing them again gives N times the gradient. Fix: drop the {short} and use "
        "the gradients as they are (they are the sum over replicas; MEAN would return them unchanged, still "
        "the sum); or, to keep TF's loop unchanged (per-replica gradients, then all_reduce SUM), "
        "differentiate w.r.t. tpustrat.local_copy(params). If N times the value is what you mean, write "
        "the product (x * N).")
  frame, level = sys._getframe(1), 2  # point at the user's line that called into tpustrat
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, AlreadyReplicatedWarning, stacklevel=level)


# -- where we are: the replica axis of the current `strategy.run` -------------------------------------


def _replica_axis(op: str) -> tuple[str | None, int]:
  """Returns ``(axis_name, num_replicas)`` of the live replica context, or ``(None, 1)`` with no strategy."""
  ctx = context_lib.get_replica_context()
  if ctx is None:
    raise RuntimeError(
        f"tpustrat.ops.{op} was called in the cross-replica context of {context_lib.get_strategy()!r} "
        "(inside strategy.scope(), outside strategy.run). Collectives need a replica context: call "
        "it inside the function given to strategy.run.")
  axis = context_lib.replica_axis(ctx)
  if axis is None:
    # The default strategy: one replica, every collective is an identity. Inside someone else's
    # shard_map or pmap (manual mesh axes, but no run) an identity would silently be wrong.
    manual = sorted(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
    if manual:
      raise RuntimeError(
          f"tpustrat.ops.{op} was called inside a jax.shard_map or jax.pmap over axes {manual} but "
          "outside strategy.run, so there is no replica context. Call it inside the function given to "
          "strategy.run (or use jax.lax collectives directly).")
    return None, 1
  context_lib.check_active(ctx, op)
  return axis, ctx.num_replicas_in_sync


# -- this replica's own copy of a value -----------------------------------------------------------------


def local_copy(value: Any) -> Any:
  """This replica's own copy of `value` (an array or pytree): gradients w.r.t. it are per replica, as in TF.

  Inside `strategy.run` a `Mirrored` parameter (or any value given whole to every replica) is one value
  shared by all replicas, so `jax.grad` w.r.t. it is the gradient of the *sum* of the replicas' losses:
  already summed over replicas and the same on every replica. TF's ``tape.gradient`` instead gives each
  replica the gradient of its own loss, and TF's loops add them with ``ctx.all_reduce("sum", grads)``
  (which, on JAX's already summed gradients, would give ``N`` times the gradient). Differentiating w.r.t.
  ``local_copy(params)`` gives TF's semantics, so TF's loop ports unchanged::

    grads = jax.grad(loss_fn)(tpustrat.local_copy(params), batch)   # this replica's own gradients
    grads = ctx.all_reduce("sum", grads)                            # TF's numbers, Mirrored again

  The copy holds the same numbers (no communication, no copy in the compiled program); JAX types it as
  varying over the replica axis (``lax.pcast(x, 'replica', to='varying')``), so what is computed from it
  is per replica (`PerReplica` if returned) until it is all-reduced. Leaves that already vary are
  returned as they are; Python numbers become arrays. With no strategy (one replica) `value` is returned
  unchanged. The name follows TF: inside a replica function a mirrored variable reads as this replica's
  local copy, and that copy is what ``tape.gradient`` differentiates.

  Raises:
    RuntimeError: in the cross-replica context (inside `strategy.scope()`, outside `run`).

  >>> strategy = tpustrat.TPUStrategy()
  >>> def step(w):
  ...   ctx = tpustrat.get_replica_context()
  ...   loss = lambda w: w * ctx.replica_id_in_sync_group   # replica r's loss: r * w
  ...   local = jax.grad(loss)(local_copy(w))               # r on replica r, as TF's tape.gradient
  ...   return local, ctx.all_reduce("sum", local), jax.grad(loss)(w)
  >>> local, total, summed = strategy.run(step, args=(np.float32(2.0),))
  >>> print(np.asarray(local.values), total.values[0], summed.values[0])
  [0. 1. 2. 3. 4. 5. 6. 7.] 28.0 28.0
  """
  ctx = context_lib.get_replica_context()
  if ctx is None:
    raise RuntimeError(
        f"tpustrat.local_copy was called in the cross-replica context of {context_lib.get_strategy()!r} "
        "(inside strategy.scope(), outside strategy.run): there is no replica to copy to. Call it inside the "
        "function given to strategy.run.")
  axis = context_lib.replica_axis(ctx)
  if axis is None:
    return value  # one replica: every gradient is already its own

  return jax.tree.map(lambda x: to_varying(x, axis), value)


# -- validation ---------------------------------------------------------------------------------------


def _label(op: str) -> str:
  """How errors name the API: ``tpustrat.ops.<op>``, or a qualified name such as ``ReplicaContext.all_reduce``."""
  return op if "." in op else f"tpustrat.ops.{op}"


def _quote(value: Any) -> str:
  """The user's value for an error message: nested lists for arrays, truncated if long."""
  if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer):
    value = np.asarray(value).tolist()
  text = repr(value)
  return text if len(text) <= 300 else text[:297] + "..."


def _static_int_matrix(value: Any, op: str, arg: str) -> np.ndarray:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{_label(op)}: `{arg}` must be known when the step is traced (a nested list, numpy "
        f"array or concrete jax array), but it is a traced value {value}. Build it from Python "
        "constants, not from arguments of strategy.run or a jitted function.")
  if isinstance(value, (list, tuple)) and value and all(isinstance(r, (list, tuple)) for r in value):
    if len({len(r) for r in value}) > 1:  # ragged nested lists: numpy refuses them
      return np.array([None])  # sentinel, reported by the caller as unequal groups
  try:
    array = np.asarray(value)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{_label(op)}: {arg}={_quote(value)} is not an integer matrix: {e}") from None
  if array.size and (array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer)):
    raise TypeError(
        f"{_label(op)}: {arg}={_quote(value)} must hold integer replica ids, got dtype {array.dtype}.")
  return array.astype(np.int64)


def normalize_group_assignment(group_assignment: Any, num_replicas: int, op: str = "collective") -> Groups | None:
  """Validates a TF group assignment and returns it as a tuple of tuples (`None` stays `None`).

  Args:
    group_assignment: ``None`` (one group of every replica) or an integer array-like of shape
      ``[num_groups, num_replicas_per_group]``: nested lists, a numpy array or a concrete jax array.
    num_replicas: the number of replicas the groups must partition.
    op: the API's name for error messages: an op of `tpustrat.ops` or a qualified name.

  Returns:
    ``None`` or the groups as a tuple of tuples of Python ints, in the given order.

  Raises:
    ValueError: quoting the assignment, if it is not rank 2, its groups differ in size, an index is out
      of ``[0, num_replicas)`` or used twice, or the groups do not cover every replica.

  >>> normalize_group_assignment([[0, 2], [1, 3]], 4)
  ((0, 2), (1, 3))
  >>> normalize_group_assignment([[0, 1], [1, 2]], 4)
  Traceback (most recent call last):
  ...
  ValueError: tpustrat.ops.collective: group_assignment=[[0, 1], [1, 2]] uses replica 1 more than once; each replica must be in exactly one group.
  """
  if group_assignment is None:
    return None
  where = f"{_label(op)}: group_assignment={_quote(group_assignment)}"
  array = _static_int_matrix(group_assignment, op, "group_assignment")
  if array.dtype == object:
    sizes = [len(g) for g in group_assignment]
    raise ValueError(
        f"{where} has groups of unequal sizes {sizes}; every group must have the same number of replicas.")
  if array.ndim != 2:
    raise ValueError(
        f"{where} has rank {array.ndim} (shape {array.shape}); it must have rank 2, shape "
        "[num_groups, num_replicas_per_group], for example [[0, 2, 4, 6], [1, 3, 5, 7]].")
  if array.shape[1] == 0:
    raise ValueError(f"{where} has empty groups; every group needs at least one replica.")
  ids = array.reshape(-1)
  bad = [int(i) for i in ids if not 0 <= i < num_replicas]
  if bad:
    raise ValueError(
        f"{where} names replica {bad[0]}, out of range: replica ids go from 0 to {num_replicas - 1} "
        f"(num_replicas_in_sync={num_replicas}).")
  seen: set[int] = set()
  twice = []
  for i in ids.tolist():
    if i in seen:
      twice.append(i)
    seen.add(i)
  if twice:
    raise ValueError(
        f"{where} uses replica {twice[0]} more than once; each replica must be in exactly one group.")
  if len(seen) != num_replicas:
    missing = sorted(set(range(num_replicas)) - seen)
    raise ValueError(
        f"{where} does not cover every replica (missing {missing}); the groups must partition all "
        f"{num_replicas} replicas (num_replicas_in_sync).")
  return tuple(tuple(int(i) for i in g) for g in array)


def _group_size(groups: Groups | None, num_replicas: int) -> int:
  return num_replicas if groups is None else len(groups[0])


def _lax_groups(groups: Groups | None, num_replicas: int) -> list[list[int]] | None:
  """``axis_index_groups`` for `jax.lax`: `None` when the one group is every replica in order."""
  if groups is None or groups == (tuple(range(num_replicas)),):
    return None
  return [list(g) for g in groups]


def _dimension(dim: Any, ndim: int, op: str, arg: str, shape: tuple[int, ...]) -> int:
  try:
    d = operator.index(dim)
  except TypeError:
    raise TypeError(f"{_label(op)}: `{arg}` must be an int, got {dim!r}.") from None
  if not -ndim <= d < ndim:
    raise ValueError(
        f"{_label(op)}: {arg}={d} is out of range for an input of shape {shape} (rank {ndim}); "
        f"expected a value in [{-ndim}, {ndim}) (negative values count from the end).")
  return d % ndim


def _named(op: str, name: Any):
  if name is not None and not isinstance(name, str):
    raise TypeError(f"tpustrat.ops.{op}: `name` must be a string or None, got {name!r}.")
  return jax.named_scope(name or op)


# -- grouped sums -------------------------------------------------------------------------------------


def _unchecked_grouped_psum(x: jax.Array, axis: str, groups: Groups) -> jax.Array:
  """The native grouped all-reduce, in a nested region that opts out of varying-axis checks."""
  region = jax.shard_map(
      functools.partial(lax.psum, axis_name=axis, axis_index_groups=[list(g) for g in groups]),
      in_specs=P(), out_specs=P(), axis_names=frozenset(), check_vma=False)
  # The region's result is typed invariant, but it differs between groups.
  return lax.pcast(region(x), axis, to="varying")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _grouped_psum_native(x: jax.Array, axis: str, groups: Groups) -> jax.Array:
  return _unchecked_grouped_psum(x, axis, groups)


def _grouped_psum_fwd(x: jax.Array, axis: str, groups: Groups) -> tuple[jax.Array, None]:
  return _grouped_psum_native(x, axis, groups), None


def _grouped_psum_bwd(axis: str, groups: Groups, _: None, ct: jax.Array) -> tuple[jax.Array]:
  # d(sum over my group)/d(x of replica s) is 1 for every member of s's group: the adjoint of a
  # grouped sum is the same grouped sum.
  return (_grouped_psum_native(ct, axis, groups),)


_grouped_psum_native.defvjp(_grouped_psum_fwd, _grouped_psum_bwd)


def _grouped_psum_scatter_gather(x: jax.Array, axis: str, groups: Groups) -> jax.Array:
  """Reduce-scatter then all-gather within the groups: typed collectives only, two of them."""
  g = len(groups[0])
  shape, size = x.shape, x.size
  flat = x.reshape(-1)
  pad = -size % g
  if pad:
    flat = jnp.pad(flat, (0, pad))
  lax_groups = [list(grp) for grp in groups]
  part = lax.psum_scatter(flat.reshape(g, -1), axis, scatter_dimension=0, axis_index_groups=lax_groups,
                          tiled=True)
  full = lax.all_gather(part, axis, axis=0, axis_index_groups=lax_groups, tiled=True).reshape(-1)
  return (full[:size] if pad else full).reshape(shape)


def _probe_native_grouped_sum() -> BaseException | None:
  """Traces the native grouped sum and its gradient in a checked `shard_map` over an abstract 4-replica
  mesh; returns the exception if this JAX rejects it. Runs on a fresh thread (see `_native_grouped_sum_supported`)."""
  # Auto axes, as the strategy's meshes have: newer JAX (0.12) defaults an AbstractMesh to Explicit axes,
  # whose in_specs assert the input's sharding and reject this abstract input.
  mesh = jax.sharding.AbstractMesh((4,), ("probe",), axis_types=(jax.sharding.AxisType.Auto,))

  def body(x: jax.Array) -> jax.Array:
    y, vjp = jax.vjp(lambda v: _grouped_psum_native(v, "probe", ((0, 1), (2, 3))), x)
    return y + vjp(y)[0]

  program = jax.shard_map(body, mesh=mesh, in_specs=P("probe"), out_specs=P("probe"), check_vma=True)
  try:
    jax.make_jaxpr(program)(jax.ShapeDtypeStruct((4, 3), jnp.float32))
  except Exception as e:  # pylint: disable=broad-exception-caught  # any failure: not usable here
    return e
  return None


_PROBE_LOCK = threading.Lock()


@functools.cache
def _probe_result() -> bool:
  # On a fresh thread: the caller is usually tracing a user's program, whose trace and mesh context
  # (for example the manual replica mesh of `strategy.run`) must not leak into the probe.
  failure: list[BaseException | None] = []
  thread = threading.Thread(target=lambda: failure.append(_probe_native_grouped_sum()),
                            name="tpustrat-grouped-sum-probe")
  thread.start()
  thread.join()
  error = failure[0] if failure else RuntimeError("the probe thread did not finish")
  if error is not None:
    _log.warning("tpustrat: this JAX rejects the native grouped sum (%s: %s); grouped sums use "
                 "reduce-scatter + all-gather.", type(error).__name__, error)
  return error is None


def _native_grouped_sum_supported() -> bool:
  """Whether this JAX accepts the native grouped sum (probed once per process, thread-safely)."""
  with _PROBE_LOCK:  # one probe, even when several threads trace grouped sums at once
    return _probe_result()


def _grouped_psum_varying(x: jax.Array, axis: str, groups: Groups) -> jax.Array:
  impl = _GROUPED_SUM_IMPL
  if impl == "auto":
    impl = "native" if _native_grouped_sum_supported() else "scatter_gather"
  if impl == "native":
    return _grouped_psum_native(x, axis, groups)
  return _grouped_psum_scatter_gather(x, axis, groups)


def _grouped_sum(x: jax.Array, axis: str, groups: Groups | None) -> jax.Array:
  """The sum of `x` over each replica's group: invariant for one group of all replicas, else varying.

  A grouped result is typed varying whatever the input (`run` returns it as `PerReplica`), as JAX types
  `lax.all_gather` with groups, so its gradient is the same for a value given whole to every replica as
  for `local_copy` of it: summed over the replicas (see `_grouped_sum_of_invariant`).
  """
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.int32)  # as lax.psum does
  if groups is None or len(groups) == 1:
    return lax.psum(x, axis)  # one group: the ordinary, invariant all-reduce
  if axis not in varying_axes(x):
    return _grouped_sum_of_invariant(x, axis, len(groups[0]))
  if len(groups[0]) == 1:
    return x
  return _grouped_psum_varying(x, axis, groups)


def _grouped_sum_of_invariant(x: jax.Array, axis: str, g: int) -> jax.Array:
  """The grouped sum of a value that is the same on every replica: ``g * x``, typed varying; no collective.

  Equal to casting `x` to varying and summing it within the groups, gradient included: the grouped sum's
  adjoint gives replica ``s`` the sum of its group's cotangents, and the cast's adjoint sums that over
  every replica, ``sum_s sum_{r in group(s)} ct_r = g * sum_r ct_r``, which is the adjoint of this product.
  Typing it invariant instead (the value is the same everywhere) would make the gradient w.r.t. a
  `Mirrored` `x` count one replica's loss only, differing from `local_copy(x)`'s and from the grouped
  `all_gather`'s.
  """
  x = to_varying(x, axis)
  return x if g == 1 else x * jnp.asarray(g, x.dtype)


def _check_sum_dtype(x: jax.Array, op: str) -> None:
  dtype = np.dtype(x.dtype)
  if dtype not in _SUM_DTYPES:
    allowed = ", ".join(d.name for d in _SUM_DTYPES)
    raise TypeError(f"tpustrat.ops.{op}: input dtype {dtype.name} is not supported; allowed dtypes: {allowed}.")


def all_reduce_in_groups(reduce_op: ReduceOp | str, value: Any, group_assignment: Any, *,
                         axis_name: str | None, num_replicas: int, op: str = "ReplicaContext.all_reduce") -> Any:
  """Sums or averages every leaf of `value` within its replica group (`ReplicaContext.all_reduce`).

  A SUM of traced leaves that are already the same on every replica warns (`AlreadyReplicatedWarning`).
  """
  reduce_op = ReduceOp.from_value(reduce_op)
  groups = normalize_group_assignment(group_assignment, num_replicas, op)
  size = _group_size(groups, num_replicas)
  if axis_name is not None:
    warn_if_already_replicated(op, jax.tree.leaves(value), axis_name, size,
                               "num_replicas_in_sync" if size == num_replicas else "the group size", reduce_op.name)

  def one(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    total = x if axis_name is None else _grouped_sum(x, axis_name, groups)
    return total / size if reduce_op is ReduceOp.MEAN else total

  return jax.tree.map(one, value)


# -- the public ops -----------------------------------------------------------------------------------


def cross_replica_sum(input: jax.typing.ArrayLike, group_assignment: Any = None,
                      name: str | None = None) -> jax.Array:
  """Sums `input` over the replicas of each group; every replica gets its group's sum (TF's `CrossReplicaSum`).

  With 8 replicas holding ``[A, B, C, D, E, F, G, H]``, ``group_assignment=[[0, 2, 4, 6], [1, 3, 5, 7]]``
  gives ``[A+C+E+G, B+D+F+H, A+C+E+G, B+D+F+H, ...]``.

  Args:
    input: the local value; dtype bfloat16, float16, float32, float64 (with ``jax_enable_x64``), int32
      or uint32.
    group_assignment: an integer array-like of shape ``[num_groups, num_replicas_per_group]`` whose
      rows partition the replica ids; ``None`` sums over all replicas.
    name: a name for the operation (an XLA name scope).

  Returns:
    An array like `input`. With one group it is the same on every replica (`strategy.run` returns it
    as `Mirrored`); with several groups it differs between groups and is typed so (`PerReplica`), even
    for an `input` that is the same on every replica. Such an `input` is multiplied by the group size;
    when it is traced (for example a gradient w.r.t. `Mirrored` parameters, already summed over
    replicas by `jax.grad`) an `AlreadyReplicatedWarning` is emitted at trace time. Differentiable in
    reverse mode to any order (`jax.grad`, `jax.vjp`): the gradient of a grouped sum is the grouped
    sum of the cotangents, and w.r.t. a `Mirrored` `input` (one value given to every replica) that is
    further summed over the replicas, the same as w.r.t. ``tpustrat.local_copy(input)``. Forward mode (`jax.jvp`, `jax.jacfwd`) through a grouped sum of values
    that differ between replicas is not supported (JAX raises a `TypeError` for `custom_vjp`).

  Raises:
    TypeError: for an unsupported dtype.
    ValueError: for a malformed group assignment.
    RuntimeError: outside `strategy.run`, in the cross-replica context. With no strategy at all there
      is one replica and the op returns `input`.

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy()
  >>> x = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  >>> out = strategy.run(lambda x: ops.cross_replica_sum(x, [[0, 2, 4, 6], [1, 3, 5, 7]]), args=(x,))
  >>> print(np.asarray(out.values))
  [12. 16. 12. 16. 12. 16. 12. 16.]
  >>> strategy.run(lambda x: ops.cross_replica_sum(x), args=(x,))
  Mirrored(float32[])
  """
  x = jnp.asarray(input)
  _check_sum_dtype(x, "cross_replica_sum")
  axis, n = _replica_axis("cross_replica_sum")
  groups = normalize_group_assignment(group_assignment, n, "cross_replica_sum")
  if axis is None:
    return x
  size = _group_size(groups, n)
  with _named("cross_replica_sum", name):
    warn_if_already_replicated("tpustrat.ops.cross_replica_sum", [input], axis, size,
                               "num_replicas_in_sync" if size == n else "the group size")
    return _grouped_sum(x, axis, groups)


def all_to_all(input: jax.typing.ArrayLike, group_assignment: Any, concat_dimension: int,
               split_dimension: int, split_count: int, name: str | None = None) -> jax.Array:
  """Exchanges blocks of `input` between the replicas of each group (TF's `AllToAll`).

  Each replica splits `input` into `split_count` blocks along `split_dimension`, sends block ``i`` to
  the ``i``-th member of its group, and concatenates the blocks it receives, in group order, along
  `concat_dimension`: that dimension grows ``split_count`` times and `split_dimension` shrinks as much.

  With 2 replicas holding ``[[A, B]]`` and ``[[C, D]]``, ``group_assignment=[[0, 1]]``,
  ``concat_dimension=0``, ``split_dimension=1`` and ``split_count=2`` give ``[[A], [C]]`` and
  ``[[B], [D]]``.

  Args:
    input: the local value, of any dtype.
    group_assignment: ``[num_groups, num_replicas_per_group]`` replica ids (``None``: one group of all
      replicas in replica order).
    concat_dimension: the dimension to concatenate along (negative values count from the end).
    split_dimension: the dimension to split (negative values count from the end).
    split_count: the number of blocks; must equal the number of replicas per group.
    name: a name for the operation (an XLA name scope).

  Returns:
    The exchanged array (varying over replicas: `PerReplica` from `run`).

  Raises:
    ValueError: for a malformed group assignment, `split_count` different from the group size,
      dimensions out of range, or a split dimension not divisible by `split_count`.
    RuntimeError: in the cross-replica context.

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy(device_assignment=jax.devices()[:2])
  >>> x = tpustrat.PerReplica([np.array([[1, 2]]), np.array([[3, 4]])])
  >>> out = strategy.run(lambda x: ops.all_to_all(x, [[0, 1]], 0, 1, 2), args=(x,))
  >>> print(np.asarray(out.values).tolist())
  [[[1], [3]], [[2], [4]]]
  """
  x = jnp.asarray(input)
  axis, n = _replica_axis("all_to_all")
  groups = normalize_group_assignment(group_assignment, n, "all_to_all")
  size = _group_size(groups, n)
  try:
    count = operator.index(split_count)
  except TypeError:
    raise TypeError(f"tpustrat.ops.all_to_all: `split_count` must be an int, got {split_count!r}.") from None
  if count != size:
    raise ValueError(
        f"tpustrat.ops.all_to_all: split_count={count} must equal the number of replicas per group, "
        f"{size}, of group_assignment={_quote(group_assignment)}.")
  if x.ndim == 0:
    raise ValueError("tpustrat.ops.all_to_all needs an input of rank >= 1 to split; got a scalar.")
  concat = _dimension(concat_dimension, x.ndim, "all_to_all", "concat_dimension", x.shape)
  split = _dimension(split_dimension, x.ndim, "all_to_all", "split_dimension", x.shape)
  if x.shape[split] % count:
    raise ValueError(
        f"tpustrat.ops.all_to_all: dimension {split} (split_dimension={split_dimension}) of the input of "
        f"shape {x.shape} has size {x.shape[split]}, not divisible by split_count={count}.")
  if axis is None or size == 1:
    return x
  with _named("all_to_all", name):
    return lax.all_to_all(x, axis, split, concat, axis_index_groups=_lax_groups(groups, n), tiled=True)


def all_gather(input: jax.typing.ArrayLike, group_assignment: Any = None, axis: int = 0,
               name: str | None = None) -> jax.Array:
  """Concatenates the `input` of every member of the replica's group along `axis`, in group order.

  Args:
    input: the local value, of rank >= 1 and any dtype.
    group_assignment: ``[num_groups, num_replicas_per_group]`` replica ids, or ``None`` for all
      replicas in replica order.
    axis: the dimension to concatenate along (negative values count from the end); it grows
      ``num_replicas_per_group`` times.
    name: a name for the operation (an XLA name scope).

  Returns:
    The gathered array. With one group it is the same on every replica (`Mirrored` from `run`, as
    for `ReplicaContext.all_gather`); with several groups it differs between groups (`PerReplica`).

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy()
  >>> x = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: np.array([ctx.replica_id_in_sync_group]))
  >>> out = strategy.run(lambda x: ops.all_gather(x, [[0, 1, 2, 3], [7, 6, 5, 4]]), args=(x,))
  >>> print(np.asarray(out.values[0]), np.asarray(out.values[7]))
  [0 1 2 3] [7 6 5 4]
  """
  x = jnp.asarray(input)
  axis_name, n = _replica_axis("all_gather")
  groups = normalize_group_assignment(group_assignment, n, "all_gather")
  with _named("all_gather", name):
    return _all_gather(x, groups, axis, axis_name=axis_name, num_replicas=n)


def all_gather_in_groups(value: Any, axis: int, group_assignment: Any, *, axis_name: str | None,
                         num_replicas: int) -> Any:
  """`all_gather` of every leaf of `value` within its replica group (`ReplicaContext.all_gather`)."""
  groups = normalize_group_assignment(group_assignment, num_replicas, "ReplicaContext.all_gather")
  return jax.tree.map(
      lambda x: _all_gather(jnp.asarray(x), groups, axis, axis_name=axis_name, num_replicas=num_replicas),
      value)


def _all_gather(x: jax.Array, groups: Groups | None, axis: int, *, axis_name: str | None,
                num_replicas: int) -> jax.Array:
  if x.ndim == 0:
    raise ValueError("tpustrat.ops.all_gather needs an input of rank >= 1 to concatenate; got a scalar. "
                     "Reshape it to [1] first.")
  dim = _dimension(axis, x.ndim, "all_gather", "axis", x.shape)
  if axis_name is None:
    return x
  if groups is None or len(groups) == 1:
    # One group: every replica gets the same array, typed invariant as `ReplicaContext.all_gather`'s.
    out = all_gather_invariant(x, axis_name, axis=dim, tiled=True)
    if groups is None or groups[0] == tuple(range(num_replicas)):
      return out
    blocks = jnp.split(out, num_replicas, axis=dim)
    return jnp.concatenate([blocks[r] for r in groups[0]], axis=dim)
  return lax.all_gather(x, axis_name, axis=dim, axis_index_groups=_lax_groups(groups, num_replicas),
                        tiled=True)


def reduce_scatter(input: jax.typing.ArrayLike, group_assignment: Any = None,
                   scatter_dimension: int = 0, reduce_op: ReduceOp | str = ReduceOp.SUM,
                   name: str | None = None) -> jax.Array:
  """Reduces `input` within each group and gives each member one block of the result (TF's `XlaReduceScatter`).

  The group's sum (or mean) is split into ``num_replicas_per_group`` blocks along `scatter_dimension`;
  the ``i``-th member of the group gets block ``i``.

  Args:
    input: the local value; the same dtypes as `cross_replica_sum`.
    group_assignment: ``[num_groups, num_replicas_per_group]`` replica ids, or ``None`` for all.
    scatter_dimension: the dimension to split (negative values count from the end); its size must be
      divisible by the group size.
    reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or "sum", "mean", and TF's "Add", "Mean").
    name: a name for the operation (an XLA name scope).

  Returns:
    This replica's block (varying over replicas: `PerReplica` from `run`). A SUM of a traced `input`
    that is already the same on every replica warns (`AlreadyReplicatedWarning`), as for
    `cross_replica_sum`.

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy()
  >>> out = strategy.run(lambda: ops.reduce_scatter(np.arange(4.0), [[0, 1, 2, 3], [4, 5, 6, 7]]))
  >>> print(np.asarray(out.values).ravel())
  [ 0.  4.  8. 12.  0.  4.  8. 12.]
  """
  x = jnp.asarray(input)
  _check_sum_dtype(x, "reduce_scatter")
  if isinstance(reduce_op, str) and reduce_op.lower() == "add":
    reduce_op = ReduceOp.SUM
  op = ReduceOp.from_value(reduce_op)
  axis, n = _replica_axis("reduce_scatter")
  groups = normalize_group_assignment(group_assignment, n, "reduce_scatter")
  size = _group_size(groups, n)
  if x.ndim == 0:
    raise ValueError("tpustrat.ops.reduce_scatter needs an input of rank >= 1 to scatter; got a scalar.")
  dim = _dimension(scatter_dimension, x.ndim, "reduce_scatter", "scatter_dimension", x.shape)
  if x.shape[dim] % size:
    raise ValueError(
        f"tpustrat.ops.reduce_scatter: dimension {dim} of the input of shape {x.shape} has size "
        f"{x.shape[dim]}, not divisible by the number of replicas per group ({size}).")
  if axis is None:
    return x
  with _named("reduce_scatter", name):
    if op is ReduceOp.SUM:
      warn_if_already_replicated("tpustrat.ops.reduce_scatter", [input], axis, size,
                                 "num_replicas_in_sync" if size == n else "the group size")
    out = lax.psum_scatter(x, axis, scatter_dimension=dim, axis_index_groups=_lax_groups(groups, n),
                           tiled=True)
    return out / size if op is ReduceOp.MEAN else out


def collective_permute(input: jax.typing.ArrayLike, source_target_pairs: Any,
                       name: str | None = None) -> jax.Array:
  """Sends `input` from each source replica to its target replica (TF's `CollectivePermute`).

  Args:
    input: the local value, of any dtype.
    source_target_pairs: an integer array-like of shape ``[num_pairs, 2]``: replica ``source`` sends
      its value to replica ``target``. Each replica is a source at most once and a target at most once;
      replicas that are nobody's target receive zeros.
    name: a name for the operation (an XLA name scope).

  Returns:
    The received value (varying over replicas: `PerReplica` from `run`).

  >>> from tpustrat import ops
  >>> strategy = tpustrat.TPUStrategy()
  >>> x = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: np.int32(ctx.replica_id_in_sync_group))
  >>> ring = [[r, (r + 1) % 8] for r in range(8)]
  >>> print(np.asarray(strategy.run(lambda x: ops.collective_permute(x, ring), args=(x,)).values))
  [7 0 1 2 3 4 5 6]
  """
  x = jnp.asarray(input)
  axis, n = _replica_axis("collective_permute")
  where = f"tpustrat.ops.collective_permute: source_target_pairs={_quote(source_target_pairs)}"
  if isinstance(source_target_pairs, (list, tuple)) and len(source_target_pairs) == 0:
    pairs = np.zeros((0, 2), np.int64)
  else:
    pairs = _static_int_matrix(source_target_pairs, "collective_permute", "source_target_pairs")
  if pairs.dtype == object or pairs.ndim != 2 or pairs.shape[1] != 2:
    raise ValueError(f"{where} must have shape [num_pairs, 2] (rows of [source, target]).")
  bad = [int(i) for i in pairs.reshape(-1) if not 0 <= i < n]
  if bad:
    raise ValueError(f"{where} names replica {bad[0]}, out of range: replica ids go from 0 to {n - 1}.")
  for column, role in ((0, "source"), (1, "target")):
    ids = pairs[:, column].tolist()
    twice = [i for i in set(ids) if ids.count(i) > 1]
    if twice:
      raise ValueError(f"{where} uses replica {min(twice)} as a {role} more than once.")
  perm = [(int(s), int(t)) for s, t in pairs]
  if axis is None:
    return x if perm else jnp.zeros_like(x)
  with _named("collective_permute", name):
    return lax.ppermute(x, axis, perm)
