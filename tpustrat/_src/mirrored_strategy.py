"""`MirroredStrategy`: synchronous data parallelism on the devices of one host (TF's `tf.distribute.MirroredStrategy`).

TF's MirroredStrategy keeps one copy of every variable per GPU and combines gradients with a configurable
`CrossDeviceOps`. tpustrat's shares `TPUStrategy`'s engine: `run` is one `jax.jit(jax.shard_map(...))`
program over a one-axis mesh of the chosen devices, and values are the same `PerReplica` / `Mirrored`
global arrays. What it adds is the choice of cross-device ops: `strategy.extended.reduce_to`,
`batch_reduce_to`, `broadcast_to` and (inside `run`) `ReplicaContext.all_reduce(..., options)` go
through `cross_device_ops`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from tpustrat._src.cross_device import (
    CrossDeviceExtendedMixin,
    CrossDeviceOps,
    device_from_string,
)
from tpustrat._src.engine import Engine
from tpustrat._src.strategy import Strategy, StrategyExtended

__all__ = ["MirroredExtended", "MirroredStrategy"]


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

