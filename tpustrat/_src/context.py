"""Which strategy is current, and whether code runs in cross-replica or replica context.

TF keeps a per-thread stack of strategies: `strategy.scope()` pushes one and enters its *cross-replica
context*; `strategy.run(fn)` calls `fn` in a *replica context*. With no strategy current there is a
default strategy with a single replica, and code is in its replica context. tpustrat keeps the same
model; inside `run` the replica context is live while JAX traces `fn`, and its collectives become named
JAX collectives over the mesh's ``'replica'`` axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax

from tpustrat._src.reduce import _normalize_axis
from tpustrat._src.reduce_op import ReduceOp

if TYPE_CHECKING:
  from tpustrat._src.strategy import Strategy

__all__ = [
    "ReplicaContext",
    "ValueContext",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "local_copy",
]


class _State(threading.local):
  def __init__(self) -> None:
    self.strategy_stack: list[Strategy] = []
    self.replica_context: ReplicaContext | None = None


_STATE = _State()
_DEFAULT: list[Any] = []  # the default strategy, created on first use


def _default_strategy() -> Strategy:
  if not _DEFAULT:
    from tpustrat._src.strategy import _DefaultStrategy  # pylint: disable=import-outside-toplevel

    _DEFAULT.append(_DefaultStrategy())
  return _DEFAULT[0]


def get_strategy() -> Strategy:
  """Returns the current strategy: the one whose `scope()` or `run` we are in, else the default one.

  >>> get_strategy().num_replicas_in_sync
  1
  """
  ctx = _STATE.replica_context
  if ctx is not None:
    return ctx.strategy
  if _STATE.strategy_stack:
    return _STATE.strategy_stack[-1]
  return _default_strategy()


def has_strategy() -> bool:
  """Whether a strategy other than the default one is current.

  >>> has_strategy()
  False
  """
  return get_strategy() is not _default_strategy()


def in_cross_replica_context() -> bool:
  """True inside `strategy.scope()` (outside `run`); False in a replica context or with no strategy.

  >>> in_cross_replica_context()
  False
  """
  return _STATE.replica_context is None and bool(_STATE.strategy_stack)


def get_replica_context() -> ReplicaContext | None:
  """The current `ReplicaContext`: inside `strategy.run`, that replica's context; in cross-replica
  context (inside `scope()`), `None`; with no strategy, the default strategy's single-replica context.

  >>> get_replica_context().num_replicas_in_sync
  1
  """
  if _STATE.replica_context is not None:
    return _STATE.replica_context
  if _STATE.strategy_stack:
    return None
  return _default_strategy()._default_replica_context  # pylint: disable=protected-access


@contextlib.contextmanager
def _strategy_scope(strategy: Strategy) -> Iterator[Strategy]:
  stack = _STATE.strategy_stack
  if _STATE.replica_context is not None:
    raise RuntimeError(
        "strategy.scope() cannot be entered inside strategy.run (replica context); enter it outside.")
  if stack and stack[-1] is not strategy:
    raise ValueError(
        f"Mixing different tpustrat strategies: {strategy!r} cannot be entered inside the scope of "
        f"{stack[-1]!r}. Leave the outer scope first.")
  stack.append(strategy)
  try:
    yield strategy
  finally:
    stack.pop()


@contextlib.contextmanager
def _enter_replica_context(ctx: ReplicaContext) -> Iterator[None]:
  previous = _STATE.replica_context
  _STATE.replica_context = ctx
  ctx._active = True  # pylint: disable=protected-access
  try:
    yield
  finally:
    ctx._active = False  # pylint: disable=protected-access
    _STATE.replica_context = previous


def _in_replica_context_of_a_run() -> bool:
  return _STATE.replica_context is not None


class ReplicaContext:
  """A replica's view inside `strategy.run`: its id and the collectives over all replicas.

  Obtained with `tpustrat.get_replica_context()` inside the function given to `run`. Its collectives are
  JAX collectives over the strategy mesh's replica axis, so they are differentiable and compile into the
  one SPMD program of the step.

  Differentiation follows JAX's `shard_map`: an `all_reduce` result is one value (identical on every
  replica), and gradients with respect to `Mirrored` inputs come back already summed over replicas (the
  aggregation TF's `optimizer.apply_gradients` performs). Do not `all_reduce` such gradients again: a SUM
  of them is ``N`` times the gradient, and `all_reduce` warns (`AlreadyReplicatedWarning`) when it sums
  a traced value that is already the same on every replica. To get TF's per-replica gradients (and keep
  TF's ``grads = ctx.all_reduce("sum", grads)``), differentiate w.r.t. `tpustrat.local_copy(params)`.
  """

  def __init__(self, strategy: Strategy, replica_id_in_sync_group: Any = 0, *,
               axis_name: str | None = None, real_rows: tuple[tuple[int, Any], ...] = ()) -> None:
    self._strategy = strategy
    self._replica_id = replica_id_in_sync_group
    self._axis_name = axis_name
    self._active = axis_name is None  # the default context is always usable
    self.real_rows = tuple(real_rows)
    """(padded size ``k``, this replica's real rows) of each padded batch among `run`'s arguments."""
    self.per_example_marks: list[tuple[Any, int]] = []
    """(array, index into `real_rows`) for each array `tpustrat.per_example` marked in this step."""

  @property
  def strategy(self) -> Strategy:
    """The strategy this replica belongs to."""
    return self._strategy

  @property
  def num_replicas_in_sync(self) -> int:
    """Number of replicas that take part in each collective."""
    return self._strategy.num_replicas_in_sync

  @property
  def replica_id_in_sync_group(self) -> Any:
    """This replica's index in `[0, num_replicas_in_sync)`: an int32 scalar traced inside `run`."""
    if self._axis_name is None:
      return self._replica_id
    self._check_active("replica_id_in_sync_group")
    return lax.axis_index(self._axis_name)

  def _check_active(self, what: str) -> None:
    if not self._active:
      raise RuntimeError(
          f"ReplicaContext.{what} was called outside strategy.run: a ReplicaContext is only valid "
          "inside the function given to strategy.run while it runs. Call "
          "tpustrat.get_replica_context() inside that function.")

  def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None, *,
                 group_assignment: Any = None) -> Any:
    """Reduces `value` (an array or a pytree of arrays) across replicas; every replica gets the result.

    Args:
      reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or their names as strings).
      value: an array, Python scalar or pytree of them.
      options: accepted for TF compatibility; `CommunicationOptions` are honoured by strategies whose
        cross-device ops use them. Not allowed together with `group_assignment`.
      group_assignment: optional ``[num_groups, num_replicas_per_group]`` replica ids (as for
        `tpustrat.ops.cross_replica_sum`): each replica then reduces over its own group only. Grouped
        reductions use the XLA collective directly, so passing `options` with them raises ValueError.

    Returns:
      A pytree like `value`, identical on every replica (so `run` returns it as `Mirrored`). With
      several groups the result differs between groups and `run` returns it as `PerReplica`.

    Warns:
      AlreadyReplicatedWarning: at trace time, once per call, when a SUM gets traced leaves that are
        already the same on every replica (invariant over the replica axis): SUM multiplies them by
        ``N`` (the group size with `group_assignment`). Typically gradients from `jax.grad` w.r.t.
        `Mirrored` parameters, which JAX has already summed over replicas: drop the `all_reduce`, or
        differentiate w.r.t. `tpustrat.local_copy(params)` for TF's per-replica gradients. `MEAN` of
        such a value returns it unchanged and does not warn.
    """
    op = ReduceOp.from_value(reduce_op)
    self._check_active("all_reduce")
    if group_assignment is not None:
      if options is not None:
        raise ValueError(
            "all_reduce: `options` cannot be combined with `group_assignment`: grouped reductions use "
            "the XLA collective directly, not the strategy's cross-device ops that honour "
            f"CommunicationOptions. Drop `options` (got {options!r:.100}).")
      from tpustrat._src import collectives  # pylint: disable=import-outside-toplevel

      return collectives.all_reduce_in_groups(
          op, value, group_assignment, axis_name=self._axis_name, num_replicas=self.num_replicas_in_sync)
    if self._axis_name is None:
      return value  # the default strategy has one replica
    from tpustrat._src import collectives  # pylint: disable=import-outside-toplevel

    route = getattr(self._strategy.extended, "_replica_all_reduce", None)
    if route is not None:  # the strategy's CrossDeviceOps (a plain psum when none is configured and no options)
      with collectives.reported_as("ReplicaContext.all_reduce"):  # they warn under this name
        return route(op, value, options, self._axis_name)
    collectives.warn_if_already_replicated("ReplicaContext.all_reduce", jax.tree.leaves(value), self._axis_name,
                                           self.num_replicas_in_sync, "num_replicas_in_sync", op.name)
    reducer = lax.psum if op is ReduceOp.SUM else lax.pmean
    return jax.tree.map(lambda x: reducer(jnp.asarray(x), self._axis_name), value)

  def all_gather(self, value: Any, axis: int, options: Any = None, *, group_assignment: Any = None) -> Any:
    """Concatenates every replica's `value` along `axis` (TF's `ReplicaContext.all_gather`).

    Each leaf must have rank >= 1; with components of shape `[b, ...]` and `axis=0` the result has
    shape `[num_replicas * b, ...]` in replica order, identical on every replica. With a
    `group_assignment` (as for `tpustrat.ops.all_gather`) each replica gathers its own group's values,
    in group order: shape `[num_replicas_per_group * b, ...]`.
    """
    del options
    self._check_active("all_gather")
    leaves = jax.tree.leaves(value)
    for x in leaves:
      ndim = jnp.ndim(x)
      if ndim == 0:
        raise ValueError(
            "all_gather needs tensors of rank >= 1 to concatenate along `axis`; got a scalar. "
            "Reshape it to [1] first.")
      _normalize_axis(axis, ndim)  # TypeError / ValueError as for `strategy.reduce`
    if group_assignment is not None:
      from tpustrat._src import collectives  # pylint: disable=import-outside-toplevel

      return collectives.all_gather_in_groups(
          value, axis, group_assignment, axis_name=self._axis_name, num_replicas=self.num_replicas_in_sync)
    if self._axis_name is None:
      return value
    return jax.tree.map(
        lambda x: _all_gather_invariant(jnp.asarray(x), self._axis_name, axis=axis % jnp.ndim(x), tiled=True),
        value)

  def __repr__(self) -> str:
    return f"ReplicaContext(strategy={self._strategy!r})"


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
  ctx = get_replica_context()
  if ctx is None:
    raise RuntimeError(
        f"tpustrat.local_copy was called in the cross-replica context of {get_strategy()!r} (inside "
        "strategy.scope(), outside strategy.run): there is no replica to copy to. Call it inside the "
        "function given to strategy.run.")
  axis = ctx._axis_name  # pylint: disable=protected-access
  if axis is None:
    return value  # one replica: every gradient is already its own
  from tpustrat._src.jax_compat import varying_axes  # pylint: disable=import-outside-toplevel

  def one(x: Any) -> jax.Array:
    x = jnp.asarray(x)
    return x if axis in varying_axes(x) else lax.pcast(x, axis, to="varying")

  return jax.tree.map(one, value)


def _all_gather_invariant(x: jax.Array, axis_name: str, *, axis: int, tiled: bool) -> jax.Array:
  """`all_gather` whose result JAX types as identical on every replica (so `run` returns `Mirrored`).

  `lax.all_gather` is typed varying -> varying; JAX has an invariant variant that is not public in
  0.10 (`jax._src.lax.parallel.all_gather_invariant`). Without it, fall back to a sum of zero-padded
  slots, which is invariant by construction.
  """
  gather = getattr(lax, "all_gather_invariant", None)
  if gather is None:
    try:
      from jax._src.lax.parallel import all_gather_invariant as gather  # pylint: disable=import-outside-toplevel
    except ImportError:
      gather = None
  if gather is not None:
    return gather(x, axis_name, axis=axis, tiled=tiled)
  n = lax.axis_size(axis_name)
  slots = jnp.zeros((n,) + x.shape, x.dtype).at[lax.axis_index(axis_name)].set(x)
  out = jnp.moveaxis(lax.psum(slots, axis_name), 0, axis)
  return out.reshape(x.shape[:axis] + (n * x.shape[axis],) + x.shape[axis + 1:]) if tiled else out


@dataclasses.dataclass(frozen=True)
class ValueContext:
  """What `experimental_distribute_values_from_function` tells `value_fn` about the replica it serves."""

  replica_id_in_sync_group: int = 0
  num_replicas_in_sync: int = 1
