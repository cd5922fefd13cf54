"""`StrategyExtended`: the additional strategy APIs of `strategy.extended` (TF's
`tf.distribute.StrategyExtended`).

The devices and the logical cores of the replicas, the bound on steps in flight and the input-bound check
(settings of the strategy's engine and step counters), which process writes checkpoints and summaries
(`should_checkpoint`, `should_save_summary`), the cross-device ops (`CrossDeviceExtendedMixin`:
`reduce_to`, `batch_reduce_to`, ...), and the collectives a `ReplicaContext` delegates to
(`replica_all_reduce`, `replica_all_gather`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from tpustrat._src import collectives, gradient_semantics
from tpustrat._src import step_stats as step_stats_lib
from tpustrat._src.cross_device import CrossDeviceExtendedMixin
from tpustrat._src.engine import DEFAULT_STEPS_IN_FLIGHT, Engine
from tpustrat._src.jax_compat import all_gather_invariant
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.validation import check_int

__all__ = ["StrategyExtended"]


class StrategyExtended(CrossDeviceExtendedMixin):
  """Additional strategy APIs (TF's `tf.distribute.StrategyExtended`)."""

  def __init__(self, strategy: Any, devices: Sequence[Any], engine: Engine | None = None) -> None:
    # `strategy`: the `Strategy` this extends (typed Any: `strategy` imports this module).
    self._strategy = strategy
    self._devices = tuple(devices)
    self._engine = engine  # the strategy's `run` engine; None for the default strategy
    self._max_steps_in_flight = DEFAULT_STEPS_IN_FLIGHT  # used only without an engine (default strategy)
    # The engine's step counters (`experimental_step_stats`); the default strategy keeps its own.
    self._step_counters = step_stats_lib.StepCounters() if engine is None else engine.step_stats

  @property
  def engine(self) -> Engine | None:
    """The engine that compiles and dispatches this strategy's programs (internal API; None for the default
    strategy, whose `run` calls the function directly): `experimental_run_steps` dispatches through it."""
    return self._engine

  @property
  def worker_devices(self) -> tuple[Any, ...]:
    """The devices of this process that run replicas, in replica order (`jax.Device` objects)."""
    return tuple(d for d in self._devices if d.process_index == jax.process_index())

  @property
  def parameter_devices(self) -> tuple[Any, ...]:
    """The devices that hold copies of `Mirrored` values (every replica's device)."""
    return self.worker_devices

  @property
  def num_logical_cores_per_replica(self) -> int:
    """Number of logical devices (cores) of each replica: ``num_cores_per_replica`` of the device assignment."""
    mesh = self._strategy.mesh
    return 1 if mesh is None else mesh.size // mesh.shape[REPLICA_AXIS]

  @property
  def logical_core_axes(self) -> tuple[str, ...]:
    """The mesh axes of a replica's logical cores (``()`` with one core per replica), for your own
    `jax.sharding.PartitionSpec` annotations inside `run`; logical core ``l`` is the row-major index over
    them."""
    mesh = self._strategy.mesh
    return () if mesh is None else tuple(a for a in mesh.axis_names if a != REPLICA_AXIS)

  @property
  def max_steps_in_flight(self) -> int:
    """Default bound on `run` steps queued on the devices (`RunOptions.max_steps_in_flight`); 2 unless set.

    Settable to an int >= 1 (a `TypeError` for a non-int, a `ValueError` for a smaller int). The default
    strategy (outside any `strategy.scope()`) reports and keeps the bound as well, but its `run` calls the
    function directly, so nothing is queued there.
    """
    engine = self._engine
    return self._max_steps_in_flight if engine is None else engine.max_steps_in_flight

  @max_steps_in_flight.setter
  def max_steps_in_flight(self, value: int) -> None:
    # RunOptions accepts None ("the strategy's default"); the strategy's default itself needs a number.
    value = check_int(value, "strategy.extended", "max_steps_in_flight", minimum=1)
    engine = self._engine
    if engine is None:  # the default strategy: no engine, nothing in flight
      self._max_steps_in_flight = value
    else:
      engine.max_steps_in_flight = value

  @property
  def step_counters(self) -> step_stats_lib.StepCounters:
    """The counters behind `strategy.experimental_step_stats()` (internal API): the strategy's `run` and
    `experimental_run_steps` and its distributed datasets' iterators add to them."""
    return self._step_counters

  @property
  def experimental_input_bound_threshold(self) -> float | None:
    """Above which share of a window's time spent waiting for input `tpustrat.InputBoundWarning` is given
    (once per strategy); 0.5 unless set. A float in ``(0, 1]``, or None: no warning."""
    return self._step_counters.threshold

  @experimental_input_bound_threshold.setter
  def experimental_input_bound_threshold(self, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value <= 1):
      raise ValueError(f"strategy.extended.experimental_input_bound_threshold must be a number in (0, 1] or None, "
                       f"got {value!r:.100}.")
    self._step_counters.threshold = None if value is None else float(value)

  @property
  def experimental_input_bound_window(self) -> int:
    """How many steps make one window of the input-bound check (`experimental_input_bound_threshold`); 50
    unless set. An int >= 1; a window also needs half a second of wall time to be judged."""
    return self._step_counters.window

  @experimental_input_bound_window.setter
  def experimental_input_bound_window(self, value: int) -> None:
    counters = self._step_counters
    counters.window = check_int(value, "strategy.extended", "experimental_input_bound_window", minimum=1)
    counters.reset_window()

  # -- which process writes (TF's chief rule) ----------------------------------------------------------

  @property
  def should_checkpoint(self) -> bool:
    """Whether this process should write checkpoints (TF's `StrategyExtended.should_checkpoint`).

    TF's rule: True for `MirroredStrategy`, `TPUStrategy` and the default strategy (one client drives
    every device), True only on the chief for `MultiWorkerMirroredStrategy` (each worker runs the loop).
    Here every process of a job runs the training loop, `TPUStrategy`'s included, so the multi-worker
    rule holds for every strategy that spans processes: True on the first process holding a replica,
    process 0 (TF's chief: `TFConfigClusterResolver` makes the chief process 0), False on the others.
    True in a one-process job, and always for the default strategy (no distribution: TF's True).

    It does not decide who calls `tpustrat.checkpoint.CheckpointManager.save`: every process calls it,
    on the same directory, since each writes its part of the arrays (the manager has process 0 write what
    is written once). TF code that saves into a temporary directory on the other workers (Model Garden's
    `_save_checkpoint`) becomes one ``manager.save(step, state)`` on every process. Guard with it what
    one process writes by itself: an exported model, a file of results.
    """
    return self._first_process()

  @property
  def should_save_summary(self) -> bool:
    """Whether this process should write summaries (TF's `StrategyExtended.should_save_summary`): the rule
    of `should_checkpoint`, True on process 0 only in a job of several processes.

    Compute the values on every process (`strategy.reduce` and the step are programs every process runs),
    and write them only where this is True: TF's other workers write into a temporary directory because
    reading a variable synchronises them; here the write itself is a host-side call with no collective.
    """
    return self._first_process()

  @property
  def experimental_should_init(self) -> bool:
    """Whether this process should initialise the variables (TF's
    `StrategyExtended.experimental_should_init`): True on every process, as in TF's `MirroredStrategy`,
    `TPUStrategy` and `MultiWorkerMirroredStrategy`: each process builds the initial state, its part of
    the global arrays."""
    return True

  def _first_process(self) -> bool:
    """Whether this process is the first process holding one of the strategy's replicas (process 0 for a
    strategy over every process; this process for one over its own devices); True for the default strategy
    (`engine` None), whose `run` is per process."""
    if self._engine is None:
      return True
    return jax.process_index() == min(d.process_index for d in self._devices)

  # -- the collectives of `ReplicaContext` (TF's `extended._replica_ctx_all_reduce`, ...) ----------------

  def replica_all_reduce(self, reduce_op: ReduceOp, value: Any, options: Any, axis_name: str | None,
                         group_assignment: Any = None) -> Any:
    """`ReplicaContext.all_reduce` (internal API): over `axis_name` (None: one replica, no axis), through
    the strategy's cross-device ops, or within replica groups with a `group_assignment`."""
    if group_assignment is not None:
      if options is not None:
        raise ValueError(
            "all_reduce: `options` cannot be combined with `group_assignment`: grouped reductions use "
            "the XLA collective directly, not the strategy's cross-device ops that honour "
            f"CommunicationOptions. Drop `options` (got {options!r:.100}).")
      return collectives.all_reduce_in_groups(
          reduce_op, value, group_assignment, axis_name=axis_name,
          num_replicas=self._strategy.num_replicas_in_sync)
    if axis_name is None:
      return value  # the default strategy has one replica
    # The strategy's CrossDeviceOps (a plain psum when none is configured and no options); they warn under
    # the name the user called.
    with gradient_semantics.reported_as("ReplicaContext.all_reduce"):
      return self._replica_all_reduce(reduce_op, value, options, axis_name)

  def replica_all_gather(self, value: Any, axis: int, options: Any, axis_name: str | None,
                         group_assignment: Any = None) -> Any:
    """`ReplicaContext.all_gather` (internal API), its arguments already checked: every replica's `value`
    concatenated along `axis`, typed identical on every replica (within groups with a `group_assignment`)."""
    del options
    if group_assignment is not None:
      return collectives.all_gather_in_groups(
          value, axis, group_assignment, axis_name=axis_name,
          num_replicas=self._strategy.num_replicas_in_sync)
    if axis_name is None:
      return value

    def gather(x: Any) -> jax.Array:
      x = jax.numpy.asarray(x)
      return all_gather_invariant(x, axis_name, axis=axis % x.ndim, tiled=True)

    return jax.tree.map(gather, value)
