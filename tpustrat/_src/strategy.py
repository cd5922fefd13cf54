"""`Strategy` and the default strategy: TF's distribution API over a JAX device mesh.

A strategy owns a `jax.sharding.Mesh` whose first axis is ``'replica'``, followed by the logical-core
axes of a replica when a `DeviceAssignment` gives each replica several cores (`tpustrat._src.logical`;
none with one device per replica). `run` compiles the step into one SPMD program
(`tpustrat._src.engine`); `reduce`, `gather` and `experimental_local_results` work on the global arrays
that hold distributed values (`tpustrat._src.reduce`). `strategy.extended` is a `StrategyExtended`
(`tpustrat._src.strategy_extended`); `TPUStrategy` is in `tpustrat._src.tpu_strategy`, as in TF.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src import host_memory, keras_fit, multistep, profiler
from tpustrat._src import input as input_lib
from tpustrat._src import logical as logical_lib
from tpustrat._src import reduce as reduce_lib
from tpustrat._src import sharding as sharding_lib
from tpustrat._src import step_stats as step_stats_lib
from tpustrat._src.cluster_resolver import ClusterResolver
from tpustrat._src.connect_to_cluster import current_resolver
from tpustrat._src.engine import Engine, RunOptions, check_run_call
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.strategy_extended import StrategyExtended
from tpustrat._src.validation import check_tree_fits_32_bits
from tpustrat._src.values import PerReplica, as_array

__all__ = ["Strategy"]


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
    return resolver if resolver is not None else current_resolver()

  # -- context --------------------------------------------------------------------------------------

  def scope(self):
    """Returns a context manager that makes this strategy current (cross-replica context).

    >>> strategy = tpustrat.TPUStrategy()
    >>> with strategy.scope():
    ...   print(tpustrat.get_strategy() is strategy, tpustrat.in_cross_replica_context())
    True True
    """
    return self._scope()

  @contextlib.contextmanager
  def _scope(self) -> Iterator[Strategy]:
    # Keras models built in the scope: their variables on this strategy's devices (`keras_fit`).
    with context_lib.strategy_scope(self), keras_fit.scope_distribution(self):
      yield self

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
    fast = multistep.run_steps_fast(getattr(self, "_engine", None), fn, iterator, steps, init, options)
    if fast is not multistep.MISS:
      return fast
    if not isinstance(iterator, Iterator):
      iterator = host_memory.owned_copies(iterator)
    return multistep.run_steps(self, fn, iterator, steps, host_memory.owned_copies(init), options)

  def experimental_mirror(self, value: Any) -> Any:
    """Returns `value` laid out as `run` returns replicated values: every array a `Mirrored` on every device.

    `run` wraps each replicated output leaf in `Mirrored`; a `jax.lax.scan` whose body calls `run` needs
    its initial carry in that form too (``lax.scan`` requires the carry to keep its pytree type).
    `PerReplica` values inside `value` stay per replica (a padded batch keeps its real-row counts, so its
    padding is still skipped); Python numbers become arrays.

    >>> strategy = tpustrat.TPUStrategy()
    >>> strategy.experimental_mirror({"w": np.zeros(3, np.float32), "step": 0})
    {'step': Mirrored(int32[]), 'w': Mirrored(float32[3])}
    """
    return multistep.as_carry(self, value, keep_counts=True)

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
      A `jax.Array` (or pytree of them) replicated on the strategy's devices. Every leaf of `value` is
      reduced by one compiled program, compiled the first time a structure and its shapes are seen.
    """
    multistep.check_not_stacked(value, "strategy.reduce")
    return reduce_lib.reduce(reduce_op, value, axis, num_replicas=self.num_replicas_in_sync,
                             mesh=self._mesh)

  def gather(self, value: Any, axis: int) -> Any:
    """Concatenates every replica's component of `value` along `axis` (TF's `Strategy.gather`): every
    leaf of `value` in one compiled program, as `reduce`.

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

    A single (non-distributed) value gives ``(value,)``; a pytree holding distributed values gives one
    pytree per replica.

    On a partial batch each replica's result holds only its real rows, as TF's replicas held only those,
    wherever axis 0 holds the batch's rows: the batch itself, an output marked `tpustrat.per_example`,
    and an unmarked output whose axis 0 the step's program shows to hold that batch's rows (the labels
    passed through, logits computed row by row). A replica with no real row gives ``[0, ...]``. Host-side
    evaluation that concatenates the local results (TF Model Garden's) counts the real examples.
    Everything else (a per-replica statistic that merely has as many rows) is whole, as returned.

    >>> strategy = tpustrat.TPUStrategy()
    >>> len(strategy.experimental_local_results(strategy.run(lambda: 1.0)))
    8
    >>> strategy.experimental_local_results(3.0)
    (3.0,)
    >>> ds = strategy.experimental_make_numpy_dataset(np.arange(12.0)).batch(12)   # k = 2 rows per replica
    >>> batch = next(iter(strategy.experimental_distribute_dataset(ds)))
    >>> doubled, stat = strategy.run(lambda x: (x * 2.0, jnp.stack([x.min(), x.max()])), args=(batch,))
    >>> [len(c) for c in strategy.experimental_local_results(doubled)]
    [2, 2, 2, 2, 2, 2, 0, 0]
    >>> [len(c) for c in strategy.experimental_local_results(stat)]
    [2, 2, 2, 2, 2, 2, 2, 2]
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
    leaves0 = [as_array(x) for x in jax.tree.leaves(components[mine[0]])]
    per_leaf: list[list[Any]] = [[] for _ in leaves0]
    for r in mine:
      if jax.tree.structure(components[r]) != treedef:
        raise ValueError(
            f"value_fn returned {jax.tree.structure(components[r])} for replica {r} but {treedef} for "
            f"replica {mine[0]}; every replica's value must have the same structure.")
      for i, x in enumerate(jax.tree.leaves(components[r])):
        x = as_array(x)
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
