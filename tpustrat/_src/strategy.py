"""`Strategy`, `TPUStrategy` and the default strategy: TF's distribution API over a JAX device mesh.

A strategy owns a `jax.sharding.Mesh` whose first axis is ``'replica'``, followed by the logical-core
axes of a replica when a `DeviceAssignment` gives each replica several cores (`tpustrat._src.logical`;
none with one device per replica). `run` compiles the step into one SPMD program
(`tpustrat._src.engine`); `reduce`, `gather` and `experimental_local_results` work on the global arrays
that hold distributed values (`tpustrat._src.reduce`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import cluster_resolver as cluster_resolver_lib
from tpustrat._src import collectives, gradient_semantics, host_memory, multistep, profiler
from tpustrat._src import context as context_lib
from tpustrat._src import input as input_lib
from tpustrat._src import logical as logical_lib
from tpustrat._src import reduce as reduce_lib
from tpustrat._src import sharding as sharding_lib
from tpustrat._src import step_stats as step_stats_lib
from tpustrat._src.cluster_resolver import ClusterResolver, experimental_connect_to_cluster
from tpustrat._src.cross_device import CrossDeviceExtendedMixin
from tpustrat._src.engine import DEFAULT_STEPS_IN_FLIGHT, Engine, RunOptions, check_run_call
from tpustrat._src.jax_compat import all_gather_invariant
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.topology import DeviceAssignment, device_grid
from tpustrat._src.validation import check_int, check_tree_fits_32_bits
from tpustrat._src.values import PerReplica

__all__ = ["Strategy", "StrategyExtended", "TPUStrategy"]


class StrategyExtended(CrossDeviceExtendedMixin):
  """Additional strategy APIs (TF's `tf.distribute.StrategyExtended`)."""

  def __init__(self, strategy: Strategy, devices: Sequence[Any], engine: Engine | None = None) -> None:
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


class Strategy:
  """Base class: a way to run one step function on several replicas in sync (TF's `tf.distribute.Strategy`)."""

  def __init__(self, devices: Sequence[Any] | np.ndarray) -> None:
    # `devices`: one device per replica, or a [num_replicas, cores_per_replica] array (logical cores).
    grid = np.asarray(list(devices) if not isinstance(devices, np.ndarray) else devices, dtype=object)
    if grid.size == 0:
      raise ValueError("A strategy needs at least one device.")
    grid = grid.reshape(grid.shape[0], -1)
    self._mesh = logical_lib.replica_core_mesh(grid)
    self._engine = Engine(self._mesh, self._mesh.shape[REPLICA_AXIS], make_context=self._replica_context)
    self._extended = StrategyExtended(self, list(grid[:, 0]), self._engine)  # replicas' logical core 0, as TF
    self._cluster_resolver: ClusterResolver | None = None  # a subclass's given resolver; else the job's
    profiler.start_from_environment()  # `launch --profile DIR`: the first strategy starts the process's profile

  def _replica_context(self, real_rows: Sequence[tuple[int, Any]]) -> context_lib.ReplicaContext:
    """The context `fn` sees while `run` traces it (`real_rows`: see `ReplicaContext.real_rows`)."""
    return context_lib.ReplicaContext(self, axis_name=REPLICA_AXIS, real_rows=tuple(real_rows))

  # -- properties -----------------------------------------------------------------------------------

  @property
  def num_replicas_in_sync(self) -> int:
    """Number of replicas over which gradients are aggregated."""
    return self._mesh.shape[REPLICA_AXIS]

  @property
  def extended(self) -> StrategyExtended:
    """`StrategyExtended` with additional methods (`worker_devices`, ...)."""
    return self._extended

  @property
  def mesh(self) -> Mesh | None:
    """The `jax.sharding.Mesh` the strategy runs on: axis ``'replica'``, then the logical-core axes; None
    for the default strategy (one replica on JAX's default device, no mesh)."""
    return self._mesh

  @property
  def cluster_resolver(self) -> ClusterResolver:
    """The `tpustrat.cluster_resolver.ClusterResolver` of this process's job; never None.

    The resolver given to the strategy (`TPUStrategy(resolver)`, `MultiWorkerMirroredStrategy(resolver)`),
    else the one the job was connected with (`experimental_connect_to_cluster`, `python -m tpustrat.launch`'s
    variables, ``TF_CONFIG`` for `MultiWorkerMirroredStrategy`), else one describing this process alone
    (task ``'worker'`` 0 of one, an empty `cluster_spec()`). TF's multi-worker code reads it as in TF:
    ``task_type``, ``task_id``, ``cluster_spec()``, ``num_accelerators()``. (TF returns None for strategies
    without a resolver, such as `MirroredStrategy`; here every strategy describes where it runs.)

    >>> r = tpustrat.MirroredStrategy().cluster_resolver
    >>> r.task_type, r.task_id, r.cluster_spec().as_dict(), r.num_accelerators()
    ('worker', 0, {}, {'CPU': 8})
    """
    resolver = getattr(self, "_cluster_resolver", None)  # the default strategy sets none
    return resolver if resolver is not None else cluster_resolver_lib.current_resolver()

  # -- context --------------------------------------------------------------------------------------

  def scope(self):
    """Returns a context manager that makes this strategy current (cross-replica context).

    >>> strategy = tpustrat.TPUStrategy()
    >>> with strategy.scope():
    ...   print(tpustrat.get_strategy() is strategy, tpustrat.in_cross_replica_context())
    True True
    """
    return context_lib.strategy_scope(self)

  # -- running --------------------------------------------------------------------------------------

  def run(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
          options: RunOptions | None = None) -> Any:
    """Runs `fn` once per replica, as one compiled SPMD program over the strategy's devices.

    Args:
      fn: the step function. It is traced once per argument signature (structure, shapes, dtypes) and
        the compiled program is reused; keep the same function object across steps.
      args: positional arguments (a tuple or list). `PerReplica` leaves give each replica its own
        component; `Mirrored` values, arrays and Python scalars are given whole to every replica. A numpy
        array is captured when `run` is called, as in TF: `run` returns after its transfer has completed
        (on XLA:CPU, where the transfer of a 64-byte-aligned array would alias it, after a copy), so the
        caller may write into the array as soon as `run` returns.
      kwargs: keyword arguments, treated like `args`.
      options: a `RunOptions`.

    Returns:
      `fn`'s result structure with every leaf wrapped: `Mirrored` if JAX proves it identical on every
      replica (for example after `all_reduce`), else `PerReplica`.

    >>> strategy = tpustrat.TPUStrategy()
    >>> def step(x):
    ...   ctx = tpustrat.get_replica_context()
    ...   mine = x * ctx.replica_id_in_sync_group
    ...   return mine, ctx.all_reduce("sum", mine)
    >>> per_replica, total = strategy.run(step, args=(1.0,))
    >>> print(np.asarray(per_replica.values))
    [0. 1. 2. 3. 4. 5. 6. 7.]
    >>> total
    Mirrored(float32[])
    >>> print(strategy.experimental_local_results(total)[0])
    28.0
    """
    return self._engine.run(fn, args, kwargs, options)

  def experimental_run_wait(self) -> None:
    """Blocks until every step dispatched with `run` (or `experimental_run_steps`) has finished.

    With `RunOptions(check_numerics=True)` it raises `tpustrat.NumericsError` for a step that produced
    NaN / Inf and was not reported yet: a dispatched step's, or, for a `run` traced inside the caller's own
    `jax.jit` / `lax.scan`, one recorded by that program's host callback (it first waits for every
    dispatched program's callbacks, `jax.effects_barrier`). Every process raises the same error here."""
    self._engine.wait()

  def experimental_step_stats(self, reset: bool = False) -> step_stats_lib.StepStats:
    """Where this process's training loop spent its time, since the first step (or the last reset).

    Counted always, at the cost of two clock reads per step: the time the host waited in this strategy's
    distributed iterators for the next batch (`input_seconds`), the time it waited on the devices for an
    older step to finish, because of the steps-in-flight bound or in `experimental_run_wait`
    (`device_seconds`), the steps that `run` and `experimental_run_steps` dispatched, and the wall time;
    the rest is the host's own work (the step's Python, dispatch, compiling, reading results). The last
    4096 dispatches are kept one by one (`history`). When the input share of a window of 50 steps exceeds
    one half, `tpustrat.InputBoundWarning` says so, once (`strategy.extended.experimental_input_bound_threshold`).

    >>> strategy = tpustrat.TPUStrategy()
    >>> dist = strategy.experimental_distribute_dataset([np.ones(8, np.float32)] * 3)
    >>> _ = strategy.experimental_step_stats(reset=True)
    >>> for batch in dist:
    ...   out = strategy.run(lambda x: x * 2, args=(batch,))
    >>> stats = strategy.experimental_step_stats()
    >>> stats.steps, len(stats.history), stats.wall_seconds >= stats.input_seconds + stats.device_seconds
    (3, 3, True)

    Args:
      reset: start counting again from zero after taking the summary.

    Returns:
      A `tpustrat.StepStats`; `print` it for a one-line summary.
    """
    counters = self._extended.step_counters
    now = time.perf_counter()
    stats = counters.summary(now)
    if reset:
      counters.reset(now)
    return stats

  def experimental_run_steps(self, fn: Callable[..., Any], iterator: Any, steps: int | None = None,
                             init: Any = None, options: RunOptions | None = None) -> tuple[Any, Any]:
    """Runs `steps` steps of `fn` as one compiled program (TF's multi-step loop in one `tf.function`).

    Each step takes the next batch of `iterator` and runs ``carry, output = fn(carry, batch)`` once per
    replica, exactly as ``strategy.run(fn, args=(carry, batch))`` would; the steps are a `jax.lax.scan`
    inside one `jax.jit`, so the host launches one program per `steps` steps instead of one per step.
    The program is compiled once per `fn` and argument signature (the shorter group at the end of the
    data is one more). Programs in flight are bounded as for `run` (`RunOptions.max_steps_in_flight`).

    >>> strategy = tpustrat.TPUStrategy()
    >>> dist = strategy.experimental_distribute_dataset([np.full(16, i, np.float32) for i in range(5)])
    >>> def step(total, x):
    ...   s = tpustrat.get_replica_context().all_reduce("sum", jnp.sum(x))
    ...   return total + s, s
    >>> it = iter(dist)
    >>> total, sums = strategy.experimental_run_steps(step, it, 3, init=0.0)
    >>> total, sums
    (Mirrored(float32[]), Mirrored(float32[3]))
    >>> print(sums.values[0], total.values[0])
    [ 0. 16. 32.] 48.0
    >>> total, sums = strategy.experimental_run_steps(step, it, 3, init=total)  # the 2 batches left
    >>> print(sums.values[0], total.values[0])
    [48. 64.] 160.0

    Args:
      fn: the step, ``fn(carry, batch) -> (new_carry, output)`` like the body of `jax.lax.scan`, run in a
        replica context (collectives, `tpustrat.valid_mask` work as in `run`). The carry must keep its
        structure, shapes and dtypes; a carry that enters replicated (`Mirrored`) must come back
        replicated (for example gradients of a loss w.r.t. replicated parameters), one that enters
        per replica (`PerReplica`) stays per replica.
      iterator: where the batches come from: a `DistributedIterator` (``iter(dist)``; each call continues
        where the last stopped) or any iterator of batches; or batches already stacked on a leading steps
        axis (`DistributedIterator.take_steps`, `tpustrat.stack_steps`).
      steps: how many batches to take from `iterator` (an int >= 1); fewer run at the end of the data.
        Optional with stacked batches (all of them run).
      init: the initial carry (for example the training state), a pytree of arrays, `Mirrored` or
        `PerReplica` values. Arrays are given whole to every replica, as by `run`.
      options: a `RunOptions`.

    Returns:
      ``(carry, outputs)``: the carry after the last step, laid out as `run` returns values (`Mirrored`
      leaves for replicated values, `PerReplica` for per-replica ones), and `fn`'s outputs of every step
      stacked on a leading steps axis (`Mirrored` ``[steps, ...]``, `PerReplica`
      ``[steps, num_replicas, ...]``; `tpustrat.unstack_steps(outputs)[i]` is step ``i`` as `run` returns
      it).

    Raises:
      StopIteration: if `iterator` has no batch left.
      ValueError: `steps` < 1, stacked batches whose leaves differ in their number of steps, a carry that
        changes shape or dtype or becomes per-replica.
      TypeError: `fn` does not return a pair, or returns values that cannot be stacked (not arrays).
    """
    # TF captures numpy values when they are handed over, as `run` does its arguments: the program reads
    # `init` and stacked batches after this returns (on XLA:CPU, in place), so they are copied first.
    if not isinstance(iterator, Iterator):
      iterator = host_memory.owned_copies(iterator)
    return multistep.run_steps(self, fn, iterator, steps, host_memory.owned_copies(init), options)

  def experimental_mirror(self, value: Any) -> Any:
    """Returns `value` laid out as `run` returns replicated values: every array a `Mirrored` on every device.

    `run` wraps each replicated output leaf in `Mirrored`; a `jax.lax.scan` whose body calls `run` needs
    its initial carry in that form too (``lax.scan`` requires the carry to keep its pytree type).
    `PerReplica` values inside `value` stay per replica; Python numbers become arrays.

    >>> strategy = tpustrat.TPUStrategy()
    >>> strategy.experimental_mirror({"w": np.zeros(3, np.float32), "step": 0})
    {'step': Mirrored(int32[]), 'w': Mirrored(float32[3])}
    """
    return multistep.as_carry(self, value)

  def experimental_shard(self, value: Any, partitioner: Any = None, layout_map: Any = None,
                         groups: Any = None) -> Any:
    """Returns `value` with its large leaves split over the replicas (`tpustrat.ShardedVariable`) and the
    others `Mirrored`: parameters and, through them, optimizer state at 1/N per device (ZeRO / FSDP).

    Args:
      value: a pytree of arrays (host or device), `Mirrored` values or `ShardedVariable` values.
      partitioner: ``(path, shape, dtype) -> axis or None`` for each leaf (None: keep it `Mirrored`), or a
        `tpustrat.MinSizePartitioner` (the default: leaves of at least 256 KiB, along axis 0).
      layout_map: a `tpustrat.LayoutMap` (needs logical cores: a `DeviceAssignment` with
        ``num_cores_per_replica > 1``): the leaves it matches stay `Mirrored` and are split over each
        replica's logical cores (tensor parallelism); inside `run` the step sees them whole, and XLA splits
        their computation over the cores. Pass it to `RunOptions(experimental_layout_map=...)` too, so the
        step's results keep that layout. The default partitioner is not asked about matched leaves; a
        partitioner given here that splits one is an error, as are a pattern that matches no leaf, a leaf
        two patterns match and a layout that does not fit its leaf.
      groups: hybrid sharding (PyTorch FSDP's ``HYBRID_SHARD``): split each leaf within each group of
        replicas and replicate it across the groups. ``"process"`` (one group per process, a host),
        ``"slice"`` (one per TPU slice), or lists of replica ids (``[[0, 1, 2, 3], [4, 5, 6, 7]]``); None
        (the default) splits over every replica. The parameters are then gathered within a group and only
        ``1/S`` of each gradient (``S`` replicas per group) is all-reduced across the groups. See
        `tpustrat.sharding_groups`.

    Inside `run` a step sees each `ShardedVariable` as its block (`tpustrat.LocalShard`): read it whole with
    ``v.read_value()`` or ``tpustrat.read_values(tree)``; gradients w.r.t. the blocks are blocks of the
    gradient summed over replicas, optax works on the blocks, and `run` returns the new blocks as
    `ShardedVariable` values.

    >>> strategy = tpustrat.TPUStrategy()
    >>> state = strategy.experimental_shard({"w": np.zeros((10, 4), np.float32), "b": np.zeros(4)},
    ...                                     tpustrat.MinSizePartitioner(min_shard_bytes=64))
    >>> state["w"], state["b"]
    (ShardedVariable(shape=[10, 4], dtype=float32, axis=0, num_replicas=8), Mirrored(float32[4]))
    """
    return sharding_lib.shard(self, value, partitioner, layout_map, groups)

  # -- cross-replica reductions ---------------------------------------------------------------------

  def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None) -> Any:
    """Reduces `value` across replicas, and along `axis` of each component if `axis` is not None.

    With a global batch of 8 split over 2 replicas, examples ``[0, 1, 2, 3]`` live on replica 0 and
    ``[4, 5, 6, 7]`` on replica 1. ``axis=None`` adds the components (``[0+4, 1+5, 2+6, 3+7]``);
    ``axis=0`` also reduces over the batch (``0+1+...+7``), and `MEAN` then divides by the true number
    of elements.

    >>> strategy = tpustrat.TPUStrategy()
    >>> value = tpustrat.PerReplica([np.array([2.0 * r, 2.0 * r + 1]) for r in range(8)])
    >>> print(strategy.reduce("SUM", value, axis=None))
    [56. 64.]
    >>> print(strategy.reduce("MEAN", value, axis=0))
    7.5

    Args:
      reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN`, or one of "sum", "SUM", "mean", "MEAN".
      value: a `PerReplica` or `Mirrored` value (or a pytree of them) as returned by `run`.
      axis: the dimension of each component to reduce as well, or None.

    Returns:
      A `jax.Array` (or pytree of them) replicated on the strategy's devices.
    """
    multistep.check_not_stacked(value, "strategy.reduce")
    return reduce_lib.reduce(reduce_op, value, axis, num_replicas=self.num_replicas_in_sync,
                             mesh=self._mesh)

  def gather(self, value: Any, axis: int) -> Any:
    """Concatenates every replica's component of `value` along `axis` (TF's `Strategy.gather`).

    >>> strategy = tpustrat.TPUStrategy()
    >>> value = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([[1], [2]]))
    >>> strategy.gather(value, axis=0).shape
    (16, 1)
    >>> strategy.gather(value, axis=1).shape
    (2, 8)
    """
    multistep.check_not_stacked(value, "strategy.gather")
    return reduce_lib.gather(value, axis, num_replicas=self.num_replicas_in_sync, mesh=self._mesh)

  def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
    """Returns the tuple of per-replica values of `value` held by this process.

    A single (non-distributed) value gives ``(value,)``.

    >>> strategy = tpustrat.TPUStrategy()
    >>> len(strategy.experimental_local_results(strategy.run(lambda: 1.0)))
    8
    >>> strategy.experimental_local_results(3.0)
    (3.0,)
    """
    return reduce_lib.local_results(value)

  def experimental_distribute_values_from_function(self, value_fn: Callable[[context_lib.ValueContext], Any]) -> Any:
    """Builds a `PerReplica` value by calling `value_fn(ValueContext)` once for each replica of this process.

    Each component is placed directly on its replica's device (on every logical core of the replica). In a
    multi-process job each process calls `value_fn` for its own replicas only, and the result is one
    global value. A process that holds none of the strategy's replicas (a strategy on some of the job's
    devices) contributes no data, but it still needs the value's structure, shapes and dtypes to follow
    the others into `run`, `reduce`, ...: it calls `value_fn` once, for replica 0, under
    `jax.eval_shape` (JAX operations in it are not computed), keeps only those, and returns the same
    global value with no shards of its own.

    >>> strategy = tpustrat.TPUStrategy()
    >>> array_value = np.array([3., 2., 1., 0., -1., -2., -3., -4.], np.float32)
    >>> values = strategy.experimental_distribute_values_from_function(
    ...     lambda ctx: array_value[ctx.replica_id_in_sync_group])
    >>> print(np.asarray(strategy.experimental_local_results(values)[0]))
    3.0
    """
    n = self.num_replicas_in_sync
    cores = self._mesh.devices.reshape(n, -1)  # [replica, logical core]
    me = jax.process_index()
    mine = [r for r in range(n) if any(d.process_index == me for d in cores[r])]
    if not mine:
      return self._values_from_function_elsewhere(value_fn, n)
    components = {r: value_fn(context_lib.ValueContext(r, n)) for r in mine}
    for r in mine:  # before any transfer: a 64-bit integer JAX would wrap into 32 bits raises
      def describe(path: str, r: int = r) -> str:
        return (f"experimental_distribute_values_from_function: value_fn's value for replica {r}"
                + (f" at {path}" if path else ""))

      check_tree_fits_32_bits(components[r], describe)
    treedef = jax.tree.structure(components[mine[0]])
    leaves0 = [jax.numpy.asarray(x) for x in jax.tree.leaves(components[mine[0]])]
    per_leaf: list[list[Any]] = [[] for _ in leaves0]
    for r in mine:
      if jax.tree.structure(components[r]) != treedef:
        raise ValueError(
            f"value_fn returned {jax.tree.structure(components[r])} for replica {r} but {treedef} for "
            f"replica {mine[0]}; every replica's value must have the same structure.")
      for i, x in enumerate(jax.tree.leaves(components[r])):
        x = jax.numpy.asarray(x)
        if x.shape != leaves0[i].shape:
          raise ValueError(
              f"value_fn returned shape {x.shape} for replica {r} but {leaves0[i].shape} for replica "
              f"{mine[0]} (leaf {i}); XLA needs the same shape on every replica.")
        if x.dtype != leaves0[i].dtype:
          raise ValueError(
              f"value_fn returned dtype {x.dtype} for replica {r} but {leaves0[i].dtype} for replica "
              f"{mine[0]} (leaf {i}); every replica's value must have the same dtype.")
        per_leaf[i].extend(jax.device_put(x[None], d) for d in cores[r] if d.process_index == me)
    sharding = NamedSharding(self._mesh, P(REPLICA_AXIS))
    stacked = [jax.make_array_from_single_device_arrays((n,) + first.shape, sharding, parts)
               for first, parts in zip(leaves0, per_leaf)]
    jax.block_until_ready(stacked)  # TF captures the values now: value_fn's arrays may change after the call
    return PerReplica.from_stacked(jax.tree.unflatten(treedef, stacked))

  def _values_from_function_elsewhere(self, value_fn: Callable[[context_lib.ValueContext], Any],
                                      n: int) -> Any:
    """`experimental_distribute_values_from_function` in a process that holds none of the replicas: the
    global value, with no shards here; `value_fn` is evaluated abstractly, for replica 0, for its shapes."""
    try:
      spec = jax.eval_shape(lambda: jax.tree.map(jax.numpy.asarray, value_fn(context_lib.ValueContext(0, n))))
    except Exception as e:
      e.add_note(
          f"tpustrat: process {jax.process_index()} holds none of the strategy's {n} replicas (its devices "
          "are all in other processes), so experimental_distribute_values_from_function called value_fn "
          "for replica 0 (under jax.eval_shape) only to learn the value's structure, shapes and dtypes.")
      raise
    sharding = NamedSharding(self._mesh, P(REPLICA_AXIS))
    nothing_here = [jax.make_array_from_single_device_arrays((n,) + s.shape, sharding, [], dtype=s.dtype)
                    for s in jax.tree.leaves(spec)]
    value = jax.tree.unflatten(jax.tree.structure(spec), nothing_here)
    return PerReplica.from_stacked(value)

  # -- input ----------------------------------------------------------------------------------------

  def experimental_distribute_dataset(self, dataset: Any,
                                      options: input_lib.InputOptions | None = None) -> input_lib.DistributedDataset:
    """Distributes a dataset of global batches: each batch is split across the replicas, in order.

    `dataset` is any iterable of global batches, each a pytree of arrays with the batch on the leading
    axis: a grain `MapDataset` / `IterDataset` (the documented default), a list, a generator, a
    PyTorch-style loader, or a `tf.data.Dataset` if TensorFlow is installed. With ``B`` rows and ``N``
    replicas, replica ``r`` gets rows ``[r*k, (r+1)*k)``, ``k = ceil(B / N)``.

    Every batch keeps the first batch's per-replica size ``k``: a partial batch (the last one, say) is
    padded, and the step function can tell real rows from padding with `tpustrat.valid_mask(x)`.
    `reduce(op, out, axis=0)` and `gather(out, axis=0)` skip the padding rows of a step's outputs
    (axis 0 is the batch: the caller says so); outputs the step marks with `tpustrat.per_example` skip
    them everywhere, `experimental_local_results` included. Full and partial batches share one compiled
    program. `InputOptions(drop_remainder=True)` drops partial batches instead.

    In a multi-process job every process must iterate the same global batches; each transfers only the
    rows of its own replicas.

    >>> strategy = tpustrat.TPUStrategy()
    >>> ds = strategy.experimental_make_numpy_dataset(np.arange(28.0)).batch(16)   # batches of 16 and 12
    >>> for batch in strategy.experimental_distribute_dataset(ds):
    ...   out, marked = strategy.run(lambda x: (x * 10, tpustrat.per_example(x * 10)), args=(batch,))
    ...   print([len(v) for v in strategy.experimental_local_results(marked)],
    ...         float(strategy.reduce("MEAN", out, axis=0)), strategy.gather(out, axis=0).shape)
    [2, 2, 2, 2, 2, 2, 2, 2] 75.0 (16,)
    [2, 2, 2, 2, 2, 2, 0, 0] 215.0 (12,)

    Args:
      dataset: an iterable of global batches (see above).
      options: a `tpustrat.InputOptions`.

    Returns:
      A `DistributedDataset`: iterate it (once per epoch) for batches whose leaves are `PerReplica`.
    """
    return input_lib.distribute_dataset(self, dataset, options)

  def experimental_distribute_datasets_from_function(
      self, dataset_fn: Callable[[input_lib.InputContext], Any],
      options: input_lib.InputOptions | None = None) -> input_lib.DistributedDataset:
    """Distributes the dataset that `dataset_fn(input_context)` returns: one input pipeline per process.

    `dataset_fn` is called once per process with a `tpustrat.InputContext` and returns a dataset (any
    iterable, as for `experimental_distribute_dataset`) of *per-replica* batches; each replica of the
    process dequeues one batch per step. Shard the data with ``input_context.input_pipeline_id`` and
    size batches with ``input_context.get_per_replica_batch_size(global_batch_size)``. Batches with fewer
    rows than the first one, and replicas left without a batch when the dataset ends mid-step, are
    padded as in `experimental_distribute_dataset`.

    >>> strategy = tpustrat.TPUStrategy()
    >>> def dataset_fn(ctx):
    ...   b = ctx.get_per_replica_batch_size(16)
    ...   data = np.arange(32.0)[ctx.input_pipeline_id::ctx.num_input_pipelines]
    ...   return [data[i:i + b] for i in range(0, len(data), b)]
    >>> dist = strategy.experimental_distribute_datasets_from_function(dataset_fn)
    >>> [float(strategy.reduce("SUM", b, axis=0)) for b in dist]
    [120.0, 376.0]

    Args:
      dataset_fn: a function from `InputContext` to a dataset of per-replica batches.
      options: a `tpustrat.InputOptions`.

    Returns:
      A `DistributedDataset` yielding batches whose leaves are `PerReplica`.
    """
    return input_lib.distribute_datasets_from_function(self, dataset_fn, options)

  distribute_datasets_from_function = experimental_distribute_datasets_from_function

  def experimental_make_numpy_dataset(self, numpy_input: Any) -> Any:
    """A grain `MapDataset` over the first axis of `numpy_input` (an array or a nest of arrays).

    Lists of arrays are stacked, as in `tf.data`. Batch the result and distribute it:

    >>> strategy = tpustrat.TPUStrategy()
    >>> ds = strategy.experimental_make_numpy_dataset(np.ones([10], np.float32))
    >>> dist = strategy.experimental_distribute_dataset(ds.batch(8))
    >>> [float(strategy.reduce("SUM", b, axis=0)) for b in dist]
    [8.0, 2.0]
    """
    return input_lib.make_numpy_dataset(numpy_input)

  def __repr__(self) -> str:
    return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync})"


class TPUStrategy(Strategy):
  """Synchronous training on TPU cores, GPUs or CPU devices (TF's `tf.distribute.experimental.TPUStrategy`).

  With no arguments it uses every device of JAX's default backend: the TPU cores of a TPU VM, else the
  GPUs, else the CPU devices (emulate several with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8``). There is one replica per device.

  With a `tpustrat.DeviceAssignment` each replica runs on ``num_cores_per_replica`` logical devices:
  the mesh is replicas x logical cores (`strategy.extended.logical_core_axes`), `run` is manual over
  the replicas only, and inside it `experimental_split_to_logical_devices`,
  `experimental_replicate_to_logical_devices` and `experimental_assign_to_logical_device` tell XLA how
  to lay tensors out on a replica's cores (`tpustrat._src.logical`).

  Args:
    tpu_cluster_resolver: optional `tpustrat.cluster_resolver.TPUClusterResolver` (or another
      `tpustrat.cluster_resolver.ClusterResolver`: `SlurmClusterResolver`, `TFConfigClusterResolver`); kept
      as `cluster_resolver`. It is connected (`tpustrat.experimental_connect_to_cluster`, a no-op for one
      process) before the devices are listed. Without one, the strategy joins the multi-process job
      that the ``TPUSTRAT_*`` environment variables describe (as `python -m tpustrat.launch` sets
      them), if any.
    device_assignment: optional placement of replicas on devices: a `tpustrat.DeviceAssignment`, or a
      sequence of `jax.Device` objects, one per replica, in replica order.

  >>> strategy = tpustrat.TPUStrategy()
  >>> strategy.num_replicas_in_sync
  8

  TF's model-parallel set-up, 4 replicas of 2 logical devices on 8 devices:

  >>> resolver = tpustrat.cluster_resolver.TPUClusterResolver(tpu="")
  >>> tpustrat.experimental_connect_to_cluster(resolver)
  >>> topology = tpustrat.initialize_tpu_system(resolver)
  >>> device_assignment = tpustrat.DeviceAssignment.build(topology, computation_shape=[1, 1, 2], num_replicas=4)
  >>> strategy = tpustrat.TPUStrategy(resolver, device_assignment=device_assignment)
  >>> strategy.num_replicas_in_sync, strategy.extended.num_logical_cores_per_replica
  (4, 2)
  >>> dict(strategy.mesh.shape)
  {'replica': 4, 'core_0': 2}
  """

  def __init__(self, tpu_cluster_resolver: Any = None, device_assignment: Any = None) -> None:
    if tpu_cluster_resolver is not None:
      if not isinstance(tpu_cluster_resolver, ClusterResolver):
        raise TypeError(
            "tpu_cluster_resolver must be None or a tpustrat.cluster_resolver resolver (TPUClusterResolver, "
            f"SlurmClusterResolver, TFConfigClusterResolver), got {type(tpu_cluster_resolver).__name__}: "
            f"{tpu_cluster_resolver!r:.100}.")
      experimental_connect_to_cluster(tpu_cluster_resolver)
    else:
      cluster_resolver_lib.connect_from_environment()  # the launcher's job
    devices: Sequence[Any] | np.ndarray  # one device per replica, or the [replica, logical core] grid
    if device_assignment is None:
      devices = jax.devices()
    elif isinstance(device_assignment, DeviceAssignment):
      devices = device_grid(device_assignment)
    elif isinstance(device_assignment, Sequence) and all(isinstance(d, jax.Device) for d in device_assignment):
      devices = list(device_assignment)
      if len(set(devices)) != len(devices):
        raise ValueError(f"device_assignment names a device twice: {devices}.")
    else:
      raise TypeError(
          "device_assignment must be None, a tpustrat.DeviceAssignment or a sequence of jax.Device objects "
          f"(one per replica), got {device_assignment!r:.200}.")
    super().__init__(devices)
    self._cluster_resolver = tpu_cluster_resolver  # None: the job's (`Strategy.cluster_resolver`)
    self._device_assignment = device_assignment if isinstance(device_assignment, DeviceAssignment) else None

  @property
  def mesh(self) -> Mesh:
    """The `jax.sharding.Mesh` the strategy runs on: axis ``'replica'``, then the logical-core axes."""
    return self._mesh

  # -- logical devices (model parallelism inside a replica) -----------------------------------------

  def experimental_split_to_logical_devices(self, tensor: Any, partition_dimensions: Sequence[int]) -> Any:
    """Annotates `tensor` to be split across the replica's logical devices (inside `run`).

    Dimension ``d`` of `tensor` is cut into ``partition_dimensions[d]`` equal pieces; the tiles go to
    the logical devices as TF's tile assignment ``arange(C).reshape(partition_dimensions)``. XLA then
    computes the operations on `tensor` (and, by propagation, around it) split the same way. With 8
    logical devices and images ``[batch, height, width, channels]``, ``[1, 2, 4, 1]`` splits the
    height 2 ways and the width 4 ways:

    >>> topology = tpustrat.initialize_tpu_system()
    >>> da = tpustrat.DeviceAssignment.build(topology, computation_shape=[2, 2, 2], num_replicas=1)
    >>> strategy = tpustrat.TPUStrategy(device_assignment=da)
    >>> def step(images):
    ...   return strategy.experimental_split_to_logical_devices(images * 2.0, [1, 2, 4, 1])
    >>> out = strategy.run(step, args=(np.ones([2, 8, 8, 3], np.float32),))
    >>> array = jax.tree.leaves(out)[0]                   # the result, [2, 8, 8, 3]
    >>> {s.data.shape for s in array.addressable_shards}  # each logical device holds 1/8 of it
    {(2, 4, 2, 3)}

    Args:
      tensor: an array inside the function given to `run`.
      partition_dimensions: one positive int per dimension of `tensor`, multiplying to the number of
        logical devices per replica; each divides its dimension.

    Returns:
      `tensor`, annotated (same value).

    Raises:
      ValueError: the length of `partition_dimensions` is not the rank of `tensor`, a dimension is not
        divisible by its entry, or the entries do not multiply to the logical devices per replica.
      RuntimeError: called outside `run` of this strategy.
    """
    return logical_lib.split_to_logical_devices(self, tensor, partition_dimensions)

  def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
    """Annotates `tensor` (or a pytree) to be replicated on every logical device of the replica (inside `run`).

    Typically for values that every logical device needs whole: labels, and logits before the loss.

    Returns:
      `tensor`, annotated (same value).
    """
    return logical_lib.replicate_to_logical_devices(self, tensor)

  def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
    """Places the computation of `tensor` (or of each leaf of a pytree) on one logical device (inside `run`).

    The operation that produced `tensor`, and the operations before it whose results serve only to
    compute it, run on logical device `logical_device_id` of each replica only (under a conditional on
    the core index, as XLA runs an operation with a maximal sharding); the result is then broadcast to
    the replica's other logical devices. Operations that use the result afterwards are not moved, and a
    tensor the step did not compute (an argument) is returned unchanged. See `tpustrat._src.logical`
    for exactly what is placed.

    Args:
      tensor: an array (or pytree) computed inside the function given to `run`: at its top level, or
        inside a nested `jax.jit` or `jax.checkpoint` (evaluated inline) or a `lax.scan` body (placed in
        every iteration); not inside `lax.cond` or `lax.while_loop` (a compile-time error).
      logical_device_id: which logical device, ``0 <= id < num_cores_per_replica``.

    Returns:
      `tensor`, with the same value.

    Raises:
      ValueError: `logical_device_id` out of range.
      RuntimeError: called outside `run` of this strategy.
    """
    return logical_lib.assign_to_logical_device(self, tensor, logical_device_id)


class _DefaultStrategy(Strategy):
  """The strategy in effect when none is: one replica on JAX's default device, `run` calls `fn`."""

  def __init__(self) -> None:
    # No mesh and no engine: every method that would use them is overridden below.
    self._extended = StrategyExtended(self, jax.devices()[:1])

  @property
  def mesh(self) -> None:  # noqa: D102
    return None

  @property
  def num_replicas_in_sync(self) -> int:
    return 1

  def run(self, fn, args=(), kwargs=None, options=None):  # noqa: D102
    kwargs = check_run_call(fn, args, kwargs)
    self._extended.step_counters.note_steps(1, time.perf_counter())
    return fn(*args, **kwargs)

  def experimental_run_wait(self) -> None:
    return None

  def reduce(self, reduce_op, value, axis):  # noqa: D102
    return reduce_lib.reduce(reduce_op, value, axis, num_replicas=1, mesh=None)

  def gather(self, value, axis):  # noqa: D102
    return reduce_lib.gather(value, axis, num_replicas=1, mesh=None)

  def experimental_distribute_values_from_function(self, value_fn):  # noqa: D102
    return value_fn(context_lib.ValueContext(0, 1))

  def __repr__(self) -> str:
    return "DefaultStrategy()"


context_lib.set_default_strategy_factory(_DefaultStrategy)
