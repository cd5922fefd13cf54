"""Summed gradients: the warning for a SUM of a value already the same on every replica, and `local_copy`.

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
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

import jax

from tpustrat._src import context as context_lib
from tpustrat._src.jax_compat import to_varying, varying_axes

__all__ = ["AlreadyReplicatedWarning", "local_copy", "reported_as", "warn_if_already_replicated"]


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
  frame: FrameType | None = sys._getframe(1)  # point at the user's line that called into tpustrat
  level = 2
  while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, AlreadyReplicatedWarning, stacklevel=level)


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
