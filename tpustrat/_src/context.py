"""Which strategy is current, and whether code runs in cross-replica or replica context.

TF keeps a per-thread stack of strategies: `strategy.scope()` pushes one and enters its *cross-replica
context*; `strategy.run(fn)` calls `fn` in a *replica context*. With no strategy current there is a
default strategy with a single replica, and code is in its replica context. tpustrat keeps the same
model; inside `run` the replica context is live while JAX traces `fn`.

This module holds that thread-local state only. It knows strategies by what they offer, not by their
class: the default strategy is made by the factory `tpustrat._src.strategy` registers with
`set_default_strategy_factory`, and `ReplicaContext.all_reduce` / `all_gather` hand their collectives to
the strategy's `extended` object (``replica_all_reduce`` / ``replica_all_gather``), as TF's do.

Use: `get_strategy()`, `get_replica_context()`, `in_cross_replica_context()` from anywhere; strategies
enter `strategy_scope(strategy)`, and the engine enters `enter_replica_context(ctx)` while it traces `fn`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from tpustrat._src.jax_compat import primal_value, same_trace
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.sharded_variable import LocalShard
from tpustrat._src.validation import normalize_axis

__all__ = [
    "ReplicaContext",
    "ValueContext",
    "active_replica_context",
    "check_active",
    "enter_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "in_replica_context_of_a_run",
    "replica_axis",
    "set_default_strategy_factory",
    "strategy_scope",
]

# A strategy is any object with `num_replicas_in_sync` and `extended` (see `tpustrat._src.strategy`).
Strategy = Any


class _State(threading.local):
  def __init__(self) -> None:
    self.strategy_stack: list[Strategy] = []
    self.replica_context: ReplicaContext | None = None


_STATE = _State()


def thread_state() -> _State:
  """The per-thread state (``replica_context``: the `ReplicaContext` of the `run` being traced in this thread,
  or None), for a caller that reads it on every step without a call (`engine.Engine.run`'s fast path)."""
  return _STATE

_DEFAULT: list[tuple[Strategy, ReplicaContext]] = []  # the default strategy and its context, made when first used
_DEFAULT_FACTORY: list[Callable[[], Strategy]] = []


def set_default_strategy_factory(factory: Callable[[], Strategy]) -> None:
  """Registers how the default strategy is made (`tpustrat._src.strategy` does, when it is imported)."""
  _DEFAULT_FACTORY[:] = [factory]


def _default() -> tuple[Strategy, ReplicaContext]:
  if not _DEFAULT:
    if not _DEFAULT_FACTORY:
      raise RuntimeError("tpustrat: no default strategy is registered; `import tpustrat` first.")
    strategy = _DEFAULT_FACTORY[0]()
    _DEFAULT.append((strategy, ReplicaContext(strategy)))
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
  return _default()[0]


def has_strategy() -> bool:
  """Whether a strategy other than the default one is current.

  >>> has_strategy()
  False
  """
  return get_strategy() is not _default()[0]


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
  return _default()[1]


@contextlib.contextmanager
def strategy_scope(strategy: Strategy) -> Iterator[Strategy]:
  """`strategy.scope()`: makes `strategy` current (cross-replica context) in this thread."""
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
def enter_replica_context(ctx: ReplicaContext) -> Iterator[None]:
  """Makes `ctx` the live replica context of this thread (while `run` traces the replica function)."""
  previous = _STATE.replica_context
  _STATE.replica_context = ctx
  try:
    with ctx.activated():
      yield
  finally:
    _STATE.replica_context = previous


def in_replica_context_of_a_run() -> bool:
  """Whether this thread is inside the replica function of a `strategy.run` (being traced)."""
  return _STATE.replica_context is not None


def active_replica_context() -> ReplicaContext | None:
  """The replica context of the `strategy.run` being traced in this thread, or None (the default
  strategy's context is never active in this sense)."""
  return _STATE.replica_context


def replica_axis(ctx: ReplicaContext | None) -> str | None:
  """The mesh axis over which `ctx`'s collectives run: `names.REPLICA_AXIS` inside `run`; None for the
  default strategy's context (one replica, no axis) and for no context."""
  return None if ctx is None else ctx.axis_name


def check_active(ctx: ReplicaContext, what: str) -> None:
  """Raises RuntimeError unless `ctx` is usable now (inside the `run` that made it, or the default one)."""
  ctx.check_active(what)


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
    """(padded size ``k``, this replica's real rows) of each padded batch among `run`'s arguments (one
    entry per batch: the arguments that carry the same real-row counts, the leaves of one dataset
    element, are one batch)."""
    self.batch_names: tuple[str, ...] = ()
    """Where each padded batch of `real_rows` is among `run`'s arguments (for messages)."""
    self.per_example_marks: list[tuple[Any, int | None]] = []
    """(array, index into `real_rows`, or None where the rows must be traced) for each array
    `tpustrat.per_example` marked in this step."""
    self._batch_of: dict[int, tuple[Any, int]] = {}
    self.row_queries: list[tuple[Any, str]] = []
    """(array, what it is) for each array whose padded batch library code asked for (`padding_count`) and
    that is not one of the step's batch arrays: `run` traces its rows to a batch (`batch_rows`) and traces
    the step again with the answers in `row_answers`."""
    self.row_answers: list[tuple[int, ...] | None] | None = None
    self._asked = 0
    self.step_probe: Any = None
    """A value of the trace of the step's own program (set by `run` where it reads that program): values
    of a trace nested in it (a jit, a checkpoint, a cond, vmap or scan body) cannot be followed there."""
    self.unresolved: list[str] = []
    """What `padding_count` was asked about and could not tell (for `run` to warn)."""

  def note_batch_leaves(self, leaves: Any, index: int) -> None:
    """Records that the arrays `leaves` (as the step function receives them) are rows of padded batch
    `index` of `real_rows`, so that `batch_index` finds a batch by its arrays, not by their size."""
    for x in leaves:
      self._batch_of[id(x)] = (x, index)  # the array is kept: its id stays its own while the step traces

  def batch_index(self, x: Any) -> int | None:
    """The index into `real_rows` of the padded batch that array `x` is (one of the arrays the step
    function received), or None."""
    hit = self._batch_of.get(id(x))
    return hit[1] if hit is not None and hit[0] is x else None

  def padding_count(self, x: Any, what: str) -> Any:
    """This replica's real rows of the padded batch whose rows array `x` holds on axis 0, or None where
    it holds no padded batch's rows (every row of it is real).

    The batch is found by the array itself (one the step received as part of a padded batch) or, for an
    array computed in the step, by following its rows through the step's program: the first trace asks
    (`row_queries`, and answers None), and `run` traces the step a second time with the answers
    (`row_answers`), so that what the answer decides (a mask) is in the program that runs. An array of a
    trace nested in the step's (computed inside a `jax.jit`, `jax.checkpoint`, `lax.cond` / `scan` body,
    `vmap` or `accumulate_gradients`' micro-batches), whose rows the step's program does not show, is
    found as `valid_mask` finds it: the one padded batch of its size (inside `accumulate_gradients`, the
    micro-batch); with several of that size it is left whole and `run` warns. `what` names `x` in the
    warnings."""
    b = self.batch_index(x)
    if b is not None:
      return self.real_rows[b][1]
    sizes = [k for k, _ in self.real_rows]
    if not sizes or getattr(x, "ndim", 0) == 0 or x.shape[0] not in sizes:
      return None
    if self.step_probe is None or not same_trace(primal_value(x), self.step_probe):
      matching = [i for i, k in enumerate(sizes) if k == x.shape[0]]
      if len(matching) == 1:
        return self.real_rows[matching[0]][1]
      self.unresolved.append(what)
      return None
    if self.row_answers is None:
      self.row_queries.append((primal_value(x), what))  # under jax.grad: the forward value
      return None
    answer = self.row_answers[self._asked] if self._asked < len(self.row_answers) else None
    self._asked += 1
    if answer is None:
      return None
    counts = [self.real_rows[b][1] for b in answer]  # several batches combined: real where all are
    real = counts[0]
    for c in counts[1:]:
      real = jnp.minimum(real, c)
    return real

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
    self.check_active("replica_id_in_sync_group")
    return lax.axis_index(self._axis_name)

  @property
  def axis_name(self) -> str | None:
    """The mesh axis its collectives run over: `names.REPLICA_AXIS` inside `run`; None for the default
    strategy's context (one replica, no axis)."""
    return self._axis_name

  @contextlib.contextmanager
  def activated(self) -> Iterator[None]:
    """This context usable (`check_active` passes) while the body runs: `run` activates its contexts
    while it traces the replica function (`enter_replica_context`)."""
    self._active = True
    try:
      yield
    finally:
      self._active = False

  def check_active(self, what: str) -> None:
    """Raises RuntimeError unless this context is usable now: inside the `run` that made it, while that
    traces the replica function (the default strategy's context always is). `what`: the caller's name."""
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
    self.check_active("all_reduce")
    _refuse_blocks(value, "all_reduce")
    return self._strategy.extended.replica_all_reduce(op, value, options, self._axis_name, group_assignment)

  def all_gather(self, value: Any, axis: int, options: Any = None, *, group_assignment: Any = None) -> Any:
    """Concatenates every replica's `value` along `axis` (TF's `ReplicaContext.all_gather`).

    Each leaf must have rank >= 1; with components of shape `[b, ...]` and `axis=0` the result has
    shape `[num_replicas * b, ...]` in replica order, identical on every replica. With a
    `group_assignment` (as for `tpustrat.ops.all_gather`) each replica gathers its own group's values,
    in group order: shape `[num_replicas_per_group * b, ...]`.
    """
    self.check_active("all_gather")
    _refuse_blocks(value, "all_gather")
    for x in jax.tree.leaves(value):
      ndim = jnp.ndim(x)
      if ndim == 0:
        raise ValueError(
            "all_gather needs tensors of rank >= 1 to concatenate along `axis`; got a scalar. "
            "Reshape it to [1] first.")
      normalize_axis(axis, ndim, "ReplicaContext.all_gather")  # the errors of `strategy.reduce`
    return self._strategy.extended.replica_all_gather(value, axis, options, self._axis_name, group_assignment)

  def __repr__(self) -> str:
    return f"ReplicaContext(strategy={self._strategy!r})"


def _refuse_blocks(value: Any, what: str) -> None:
  """A sharded value's blocks differ between replicas by design: reducing them adds different rows."""
  leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=lambda x: isinstance(x, LocalShard))[0]
  for path, x in leaves:
    if isinstance(x, LocalShard):
      raise ValueError(
          f"ReplicaContext.{what}: the value at {jax.tree_util.keystr(path) or '<root>'} is a sharded value "
          f"({x!r}): each replica holds a different block of it, so a cross-replica {what} would combine "
          "different rows. Read it whole first (x.read_value(), tpustrat.read_values(tree)), or reduce the "
          "block itself (x.block).")


@dataclasses.dataclass(frozen=True)
class ValueContext:
  """What `experimental_distribute_values_from_function` tells `value_fn` about the replica it serves."""

  replica_id_in_sync_group: int = 0
  num_replicas_in_sync: int = 1
