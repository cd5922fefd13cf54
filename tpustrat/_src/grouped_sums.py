"""Grouped sums: the sum of a value over each replica's group, its two mechanisms, and the probe that picks one.

`grouped_sum` is what `tpustrat.ops.cross_replica_sum` and `ReplicaContext.all_reduce` with a
`group_assignment` compute. One group of all replicas is the ordinary `lax.psum` (invariant: `Mirrored`).
With several groups the result is typed varying whatever the input (`PerReplica`):

* a value already the same on every replica (invariant) is ``group_size * x``, cast to varying, with no
  collective (`_grouped_sum_of_invariant` shows the gradient is the one of the grouped sum);
* a varying value runs the native grouped `psum` in a nested unchecked `shard_map`, as a
  `jax.custom_vjp` whose backward pass is the same grouped sum; where the installed JAX rejects that (a
  probe program traced once per process decides), it is a reduce-scatter followed by an all-gather within
  the groups.

`docs/benchmarks_collectives.md` records the mechanisms considered and their measured cost.
"""

from __future__ import annotations

import functools
import logging
import threading

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from tpustrat._src.groups import Groups
from tpustrat._src.jax_compat import to_varying, varying_axes

__all__ = ["grouped_sum"]

_log = logging.getLogger(__name__)

# How a grouped sum of varying values is computed: "auto" asks `_native_grouped_sum_supported` (a probe
# traced once per process); tests force "native" or "scatter_gather". Only read, never written, here.
_GROUPED_SUM_IMPL = "auto"


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


def grouped_sum(x: jax.Array, axis: str, groups: Groups | None) -> jax.Array:
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
