"""`MirroredStrategy` and `MultiWorkerMirroredStrategy`: synchronous data parallelism on the devices of one
process (TF's `tf.distribute.MirroredStrategy`) and of every process of a job (TF's
`tf.distribute.MultiWorkerMirroredStrategy`).

TF's MirroredStrategy keeps one copy of every variable per GPU and combines gradients with a configurable
`CrossDeviceOps`. tpustrat's shares `TPUStrategy`'s engine: `run` is one `jax.jit(jax.shard_map(...))`
program over a one-axis mesh of the chosen devices, and values are the same `PerReplica` / `Mirrored`
global arrays. What it adds is the choice of cross-device ops: `strategy.extended.reduce_to`,
`batch_reduce_to`, `broadcast_to` and (inside `run`) `ReplicaContext.all_reduce(..., options)` go
through `cross_device_ops`.

TF's MirroredStrategy is single-worker, and so is this one: in a multi-process job (`jax.distributed`
connected, or ``TPUSTRAT_NUM_PROCESSES`` > 1 as `python -m tpustrat.launch` sets it) it raises, naming
`MultiWorkerMirroredStrategy` and `TPUStrategy`, even with explicit devices of this process. Each process
would otherwise be a job of its own, training on its own, and the first collective operation that spans
processes (a checkpoint) fails far from the cause. A program that wants this process's devices alone in a
multi-process job says so with ``TPUStrategy(device_assignment=jax.local_devices())``.

`MultiWorkerMirroredStrategy` is the same engine over every device of every process, connected as
`TPUStrategy` connects (through the given resolver; else the running job, ``TF_CONFIG`` as in TF, or the
launcher's variables), with TF's `communication_options` as the defaults of its cross-device calls.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from tpustrat._src import names
from tpustrat._src.cluster_resolver import ClusterResolver
from tpustrat._src.connect_to_cluster import connect_from_environment, experimental_connect_to_cluster
from tpustrat._src.cross_device import (
    CommunicationOptions,
    CrossDeviceExtendedMixin,
    CrossDeviceOps,
    device_from_string,
)
from tpustrat._src.engine import Engine
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.strategy import Strategy
from tpustrat._src.strategy_extended import StrategyExtended
from tpustrat._src.tfconfig_cluster_resolver import TFConfigClusterResolver

__all__ = ["MirroredExtended", "MirroredStrategy", "MultiWorkerMirroredExtended", "MultiWorkerMirroredStrategy"]

_ALTERNATIVES = (
    "Use tpustrat.MultiWorkerMirroredStrategy() (TF's multi-worker strategy: one job over every process's "
    "devices) or tpustrat.TPUStrategy(); to run on this process's devices alone on purpose, "
    "tpustrat.TPUStrategy(device_assignment=jax.local_devices()).")


def _launched_processes() -> int:
  """The process count ``TPUSTRAT_NUM_PROCESSES`` gives (1 when unset or not a number: the resolver that
  reads it says what is wrong with it)."""
  text = os.environ.get(names.ENV_NUM_PROCESSES, "").strip()
  return int(text) if text.isascii() and text.isdigit() else 1


def _check_one_process() -> None:
  """MirroredStrategy is single-worker (TF's): refuse a multi-process job, connected or described by the
  launcher's variables, before JAX's backends start (so that the program can still connect)."""
  if jax.distributed.is_initialized() and jax.process_count() > 1:
    raise ValueError(
        f"MirroredStrategy runs on the devices of one process, but this is process {jax.process_index()} of "
        f"{jax.process_count()} of a connected multi-process job (jax.distributed): each process would be a "
        f"job of its own, training separately, and collectives that span processes (checkpoints) fail. "
        + _ALTERNATIVES)
  launched = _launched_processes()
  if launched > 1:
    raise ValueError(
        f"MirroredStrategy runs on the devices of one process, but {names.ENV_NUM_PROCESSES}={launched} says "
        "this process is one of a multi-process job (python -m tpustrat.launch sets it): each process would "
        "be a job of its own, training separately, and collectives that span processes (checkpoints) fail. "
        + _ALTERNATIVES)


def _resolve_devices(devices: Any) -> list[Any]:
  """`jax.Device` objects for TF's `devices` argument (device strings or devices of this process)."""
  if devices is None:
    return list(jax.local_devices())
  if isinstance(devices, (str, jax.Device)) or not isinstance(devices, Sequence):
    raise TypeError(
        "MirroredStrategy(devices=...) expects a list of device strings (e.g. ['/gpu:0', '/gpu:1']) or "
        f"jax.Device objects, got {type(devices).__name__}: {devices!r:.100}.")
  if not devices:
    raise ValueError("Got an empty `devices` list. Please make sure the `devices` you pass in is not empty.")
  resolved = []
  for d in devices:
    if isinstance(d, str):
      d = device_from_string(d)
    elif not isinstance(d, jax.Device):
      raise TypeError(f"MirroredStrategy: devices must be device strings or jax.Device objects, got {d!r}.")
    resolved.append(d)
  if len(set(resolved)) != len(resolved):
    raise ValueError(f"No duplicates allowed in `devices` argument: {list(devices)}.")
  if any(d.process_index != jax.process_index() for d in resolved):
    raise ValueError(
        f"MirroredStrategy runs on the devices of this process (one host); {resolved} includes devices of "
        "other processes. Use TPUStrategy for a mesh across processes.")
  if len({d.platform for d in resolved}) != 1:
    raise ValueError(f"MirroredStrategy: all devices must be of one platform, got {resolved}.")
  return resolved


class MirroredExtended(StrategyExtended, CrossDeviceExtendedMixin):
  """`StrategyExtended` of `MirroredStrategy`: reductions and broadcasts go through its `CrossDeviceOps`."""

  def __init__(self, strategy: Strategy, devices: Sequence[Any], cross_device_ops: CrossDeviceOps | None,
               engine: Engine | None = None) -> None:
    super().__init__(strategy, devices, engine)
    self._cross_device_ops = cross_device_ops

  @property
  def cross_device_ops(self) -> CrossDeviceOps:
    """The `CrossDeviceOps` in use (the one given to the strategy, else `default_cross_device_ops()`)."""
    return self._get_cross_device_ops()


class MirroredStrategy(Strategy):
  """Synchronous training on the devices of one machine (TF's `tf.distribute.MirroredStrategy`).

  One replica per device; `run`, `reduce`, `gather`, `experimental_local_results` and
  `experimental_distribute_values_from_function` behave as on `TPUStrategy` (the same engine).

  Single-process only, as TF's: in a multi-process job it raises a `ValueError` naming
  `MultiWorkerMirroredStrategy` and `TPUStrategy` (see the module docstring).

  Args:
    devices: the devices to use, as device strings (``"/gpu:0"``, ``"/device:CPU:3"``) or `jax.Device`
      objects of this process; default: every local device of JAX's default backend.
    cross_device_ops: a `CrossDeviceOps` used by `extended.reduce_to`, `extended.batch_reduce_to`,
      `extended.broadcast_to` and `ReplicaContext.all_reduce`; default: `default_cross_device_ops()`
      (XLA all-reduce, tensors of up to 32 KiB aggregated in groups of 10: the fastest setting measured).

  >>> from tpustrat._src.cross_device import HierarchicalCopyAllReduce
  >>> strategy = MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())
  >>> strategy.num_replicas_in_sync
  8
  >>> v = strategy.run(lambda: tpustrat.get_replica_context().replica_id_in_sync_group * 1.0)
  >>> total = strategy.extended.reduce_to("sum", v, destinations=v)
  >>> total, float(total.values[7])
  (Mirrored(float32[]), 28.0)
  >>> MirroredStrategy(["/cpu:0", "/cpu:1"]).num_replicas_in_sync
  2
  """

  _extended: MirroredExtended

  def __init__(self, devices: Sequence[Any] | None = None, cross_device_ops: CrossDeviceOps | None = None) -> None:
    if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
      raise TypeError(
          f"cross_device_ops must be a tpustrat.CrossDeviceOps (e.g. NcclAllReduce()) or None, got "
          f"{cross_device_ops!r:.100}.")
    _check_one_process()
    resolved = _resolve_devices(devices)
    super().__init__(resolved)
    self._extended = MirroredExtended(self, resolved, cross_device_ops, self._engine)

  @property
  def extended(self) -> MirroredExtended:
    """`MirroredExtended`: `reduce_to`, `batch_reduce_to`, `broadcast_to`, `cross_device_ops`, ..."""
    return self._extended

  @property
  def mesh(self) -> Mesh:
    """The `jax.sharding.Mesh` the strategy runs on: axis ``'replica'``, then the logical-core axes."""
    return self._mesh



class MultiWorkerMirroredExtended(MirroredExtended):
  """`StrategyExtended` of `MultiWorkerMirroredStrategy`: its `communication_options` are the defaults of
  `reduce_to`, `batch_reduce_to` and `ReplicaContext.all_reduce`, merged with each call's (TF's rule)."""

  def __init__(self, strategy: Strategy, devices: Sequence[Any], communication_options: CommunicationOptions,
               engine: Engine | None = None) -> None:
    super().__init__(strategy, devices, None, engine)
    self._communication_options = communication_options

  @property
  def communication_options(self) -> CommunicationOptions:
    """The strategy's default `CommunicationOptions`."""
    return self._communication_options

  def _merged(self, options: Any) -> CommunicationOptions:
    return self._communication_options.merge(options)

  def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                options: CommunicationOptions | None = None) -> Any:
    """`MirroredExtended.reduce_to` with the strategy's options merged under `options`."""
    return super().reduce_to(reduce_op, value, destinations, self._merged(options))

  def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]],
                      options: CommunicationOptions | None = None) -> list[Any]:
    """`MirroredExtended.batch_reduce_to` with the strategy's options merged under `options`."""
    return super().batch_reduce_to(reduce_op, value_destination_pairs, self._merged(options))

  def _replica_all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any, axis_name: str) -> Any:
    if options is None and self._communication_options == CommunicationOptions():
      return super()._replica_all_reduce(reduce_op, value, None, axis_name)  # one psum per leaf
    return super()._replica_all_reduce(reduce_op, value, self._merged(options), axis_name)


def _connect_default() -> ClusterResolver | None:
  """`MultiWorkerMirroredStrategy()`'s connection: the running job if connected; else ``TF_CONFIG``'s
  cluster (TF's default for this strategy); else the launcher's variables (or one process). Returns the
  resolver it connected with, None where `Strategy.cluster_resolver` finds it."""
  if jax.distributed.is_initialized():
    return None
  if os.environ.get("TF_CONFIG", "").strip():
    resolver = TFConfigClusterResolver()
    if resolver.cluster_spec():
      if _launched_processes() > 1:
        raise ValueError(
            f"MultiWorkerMirroredStrategy: both TF_CONFIG (a cluster of {resolver.num_processes} training "
            f"tasks) and {names.ENV_NUM_PROCESSES}={_launched_processes()} (python -m tpustrat.launch) describe "
            "this job. Unset one, or pass the resolver to use: MultiWorkerMirroredStrategy("
            "tpustrat.cluster_resolver.TFConfigClusterResolver()) or (TPUClusterResolver()).")
      experimental_connect_to_cluster(resolver)
      return resolver
  connect_from_environment()
  return None


class MultiWorkerMirroredStrategy(Strategy):
  """Synchronous training on every device of every process of a job (TF's
  `tf.distribute.MultiWorkerMirroredStrategy`).

  One replica per device, over all processes: with 2 processes of 4 devices, 8 replicas. `run`, `reduce`,
  `gather` and the datasets behave as on `TPUStrategy` (the same engine: one SPMD program over the job's
  mesh); `distribute_datasets_from_function` calls `dataset_fn` once per process, with
  ``InputContext(num_input_pipelines=process count, input_pipeline_id=process index)`` (TF's one pipeline
  per worker). Every process runs the same program.

  Args:
    cluster_resolver: a `tpustrat.cluster_resolver.ClusterResolver` (`TFConfigClusterResolver`,
      `TPUClusterResolver`, `SlurmClusterResolver`), connected (`tpustrat.experimental_connect_to_cluster`)
      before the devices are listed. None: the job this process is already connected to; else, as in TF,
      the cluster ``TF_CONFIG`` describes (`TFConfigClusterResolver`); else the job of
      `python -m tpustrat.launch`'s ``TPUSTRAT_*`` variables; else this process alone. ``TF_CONFIG`` and
      the launcher's variables both describing a job is a `ValueError`.
    communication_options: a `tpustrat.CommunicationOptions` (TF's
      `tf.distribute.experimental.CommunicationOptions`), the defaults of `extended.reduce_to`,
      `extended.batch_reduce_to` and `ReplicaContext.all_reduce`; each call's options override its
      non-default fields (TF's `merge`). ``bytes_per_pack`` and ``implementation`` (``RING``: a ring of
      collective-permutes; ``NCCL`` / ``AUTO``: XLA's all-reduce, over gloo between CPU processes) are
      honoured; ``timeout_seconds`` is accepted only: XLA collectives have no per-operation timeout (the
      step watchdog, ``step_timeout``, stops a job whose step waits too long). `strategy.reduce` and
      `strategy.gather` are compiled reductions of their own and do not read them.

  Raises:
    TypeError: `cluster_resolver` is not a resolver, or `communication_options` not a `CommunicationOptions`.
    ValueError: both ``TF_CONFIG`` and ``TPUSTRAT_NUM_PROCESSES`` describe the job; a resolver's errors.

  >>> strategy = tpustrat.MultiWorkerMirroredStrategy()
  >>> strategy.num_replicas_in_sync, strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
  (8, 'worker', 0)
  """

  _extended: MultiWorkerMirroredExtended

  def __init__(self, cluster_resolver: ClusterResolver | None = None,
               communication_options: CommunicationOptions | None = None) -> None:
    if communication_options is None:
      communication_options = CommunicationOptions()
    elif not isinstance(communication_options, CommunicationOptions):
      raise TypeError(
          "MultiWorkerMirroredStrategy: communication_options must be a tpustrat.CommunicationOptions or None, "
          f"got {type(communication_options).__name__}: {communication_options!r:.100}.")
    if cluster_resolver is not None:
      if not isinstance(cluster_resolver, ClusterResolver):
        raise TypeError(
            "MultiWorkerMirroredStrategy: cluster_resolver must be None or a tpustrat.cluster_resolver resolver "
            "(TFConfigClusterResolver, TPUClusterResolver, SlurmClusterResolver), got "
            f"{type(cluster_resolver).__name__}: {cluster_resolver!r:.100}.")
      experimental_connect_to_cluster(cluster_resolver)
      resolver: ClusterResolver | None = cluster_resolver
    else:
      resolver = _connect_default()
    devices = jax.devices()
    super().__init__(devices)
    self._cluster_resolver = resolver
    self._extended = MultiWorkerMirroredExtended(self, devices, communication_options, self._engine)

  @property
  def extended(self) -> MultiWorkerMirroredExtended:
    """`MultiWorkerMirroredExtended`: `reduce_to`, `batch_reduce_to`, `communication_options`, ..."""
    return self._extended

  @property
  def mesh(self) -> Mesh:
    """The `jax.sharding.Mesh` the strategy runs on: axis ``'replica'`` over every process's devices."""
    return self._mesh
