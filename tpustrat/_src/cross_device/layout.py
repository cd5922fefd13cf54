"""Where cross-device values live and where results go.

A distributed value is seen as global arrays on one mesh (`Layout`, from `layout_of`): stacked over the
replica axis (`PerReplica`) or replicated (`Mirrored`); a value built on the host is placed on the current
strategy's devices, else on the first local devices. `destinations` (a `DistributedValues`, a `jax.Array`,
a `jax.Device` or device string, a `Mesh` or a `Sharding`) become a `Destination` (`resolve_destinations`),
and `deliver` puts a reduced result there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src.cross_device.devices import device_from_string, mesh_for
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.values import DistributedValues, Mirrored, PerReplica

__all__ = ["Destination", "Layout", "components", "deliver", "layout_of", "resolve_destinations", "shard_on",
           "to_distributed"]


@dataclasses.dataclass(frozen=True)
class Destination:
  """Where a result goes: `sharding` (its exact layout) over `devices`; `single`: a plain one-device array."""

  devices: tuple[Any, ...]
  sharding: jax.sharding.Sharding
  single: bool


def resolve_destinations(destinations: Any) -> Destination:
  """Validates `destinations` (TF's `validate_destinations`) and says where results go."""
  if isinstance(destinations, str):
    if not destinations.strip():
      raise ValueError("destinations can not be empty")
    device = device_from_string(destinations)
    return Destination((device,), jax.sharding.SingleDeviceSharding(device), True)
  if isinstance(destinations, jax.Device):
    return Destination((destinations,), jax.sharding.SingleDeviceSharding(destinations), True)
  if isinstance(destinations, DistributedValues):
    layout = layout_of(destinations, what="destinations")
    return Destination(tuple(layout.mesh.devices.flat), NamedSharding(layout.mesh, P()), False)
  if isinstance(destinations, Mesh):
    return Destination(tuple(destinations.devices.flat), NamedSharding(destinations, P()), False)
  if isinstance(destinations, jax.Array) and not isinstance(destinations, jax.core.Tracer):
    sharding = destinations.sharding
    if len(sharding.device_set) == 1:
      (device,) = sharding.device_set
      return Destination((device,), jax.sharding.SingleDeviceSharding(device), True)
    if isinstance(sharding, NamedSharding):
      return Destination(tuple(sharding.mesh.devices.flat), NamedSharding(sharding.mesh, P()), False)
    devices = tuple(sorted(sharding.device_set, key=lambda d: d.id))
    return Destination(devices, NamedSharding(mesh_for(devices), P()), False)
  if isinstance(destinations, jax.sharding.Sharding):
    if isinstance(destinations, jax.sharding.SingleDeviceSharding):
      (device,) = destinations.device_set
      return Destination((device,), destinations, True)
    devices = tuple(getattr(destinations, "_device_assignment", None)
                    or sorted(destinations.device_set, key=lambda d: d.id))
    return Destination(devices, destinations, False)
  raise ValueError(
      "destinations must be one of a `DistributedValues` object, a `jax.Array` (its devices), a "
      "`jax.Device` or device string, a `jax.sharding.Mesh` or a `jax.sharding.Sharding`; got "
      f"{type(destinations).__name__}: {destinations!r:.100}.")


class Layout(NamedTuple):
  """A distributed value as global arrays: stacked over `axis` of `mesh` (PerReplica) or replicated."""

  mesh: Mesh
  axis: str
  kind: str  # "stacked" | "mirrored"
  leaves: list[jax.Array]
  treedef: Any

  @property
  def num_components(self) -> int:
    return self.mesh.shape[self.axis]


def _mesh_axis(x: Any, kind: str) -> tuple[Mesh, str] | None:
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return None
  sharding = x.sharding
  if not isinstance(sharding, NamedSharding):
    return None
  mesh, spec = sharding.mesh, tuple(sharding.spec)
  if not isinstance(mesh, Mesh):  # an abstract mesh: no devices (a concrete array never has one)
    return None
  if kind == "stacked":
    if (x.ndim >= 1 and spec and isinstance(spec[0], str) and all(s is None for s in spec[1:])
        and mesh.shape[spec[0]] == x.shape[0]):
      return mesh, spec[0]
    return None
  if sharding.is_fully_replicated:
    return mesh, REPLICA_AXIS if REPLICA_AXIS in mesh.axis_names else mesh.axis_names[0]
  return None


def _default_mesh(n: int, what: str) -> tuple[Mesh, str]:
  strategy = context_lib.get_strategy()
  mesh = getattr(strategy, "mesh", None)
  if mesh is not None and strategy.num_replicas_in_sync == n:
    return mesh, REPLICA_AXIS
  local = jax.local_devices()
  if n <= len(local):
    return mesh_for(tuple(local[:n])), REPLICA_AXIS
  raise ValueError(f"{what}: a value with {n} components needs {n} devices, but this process has {len(local)}.")


def layout_of(value: DistributedValues, what: str = "per_replica_value") -> Layout:
  """The global arrays of a distributed value, placed on a mesh (a value built on the host is placed
  on the current strategy's devices, else on the first local devices)."""
  leaves, treedef = jax.tree.flatten(value.tree)
  if not leaves:
    raise ValueError(f"{what}: {value!r} holds no arrays.")
  if isinstance(value, PerReplica) and value.padding_is_marked:
    raise ValueError(
        f"{what}: a padded PerReplica batch (from the input pipeline) cannot go through CrossDeviceOps, "
        "whose reductions are over replicas: use strategy.reduce, which leaves padding rows out.")
  kind = "stacked" if isinstance(value, PerReplica) else "mirrored"
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in leaves]
  found = {_mesh_axis(x, kind) for x in leaves}
  if len(found) == 1:
    (only,) = found
    if only is not None:
      return Layout(only[0], only[1], kind, leaves, treedef)
  if kind == "stacked":
    counts = {x.shape[0] if x.ndim else None for x in leaves}
    count = counts.pop() if len(counts) == 1 else None
    if count is None:
      raise ValueError(f"{what}: the leaves of {value!r} disagree on the number of components.")
    mesh, axis = _default_mesh(count, what)
    target = NamedSharding(mesh, P(axis))
  else:
    devices = {d for x in leaves if isinstance(x, jax.Array) for d in x.devices()}
    if len(devices) == 1 and all(getattr(x, "committed", False) for x in leaves):
      mesh, axis = mesh_for(tuple(devices)), REPLICA_AXIS
    else:
      strategy = context_lib.get_strategy()
      if getattr(strategy, "mesh", None) is None:
        raise ValueError(
            f"{what}: {value!r} is not placed on devices and no strategy is current; build Mirrored values "
            "with strategy.run, or reduce inside `with strategy.scope():`.")
      mesh = strategy.mesh
      axis = REPLICA_AXIS
    target = NamedSharding(mesh, P())
  return Layout(mesh, axis, kind, [jax.device_put(x, target) for x in leaves], treedef)


def to_distributed(value: Any, what: str = "per_replica_value") -> DistributedValues:
  """TF's `_make_tensor_into_per_replica`: a `DistributedValues`, or a tensor with a device."""
  if isinstance(value, DistributedValues):
    return value
  if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
    devices = value.sharding.device_set
    if len(devices) == 1:  # one component, reduced on its own device
      one = NamedSharding(mesh_for(tuple(devices)), P(REPLICA_AXIS))
      return PerReplica.from_stacked(jax.device_put(jnp.expand_dims(value, 0), one))
    if value.sharding.is_fully_replicated:
      return Mirrored.from_global(value)
    raise ValueError(
        f"Cannot convert {what} to a DistributedValues: a jax.Array sharded over {len(devices)} devices "
        "is neither one tensor on one device nor replicated. Wrap stacked components in "
        "tpustrat.PerReplica, or pass the value returned by strategy.run.")
  raise ValueError(
      f"Cannot convert {what} to a DistributedValues because it doesn't have a device set: got "
      f"{type(value).__name__} {value!r:.100}. Pass a PerReplica or Mirrored value (as returned by "
      "strategy.run) or a jax.Array placed on a device.")


def deliver(tree: Any, dest: Destination) -> Any:
  """Puts a reduced pytree of arrays where `dest` says and wraps it: `Mirrored` if replicated."""

  def place(x: jax.Array) -> jax.Array:
    if isinstance(x, jax.core.Tracer):
      return x
    if dest.single:
      device = dest.devices[0]
      for shard in x.addressable_shards:  # the copy already on that device, if there is one
        if shard.device == device and shard.data.shape == x.shape:
          return shard.data
      return jax.device_put(x, device)
    if x.sharding.is_equivalent_to(dest.sharding, x.ndim):
      return x
    return jax.device_put(x, dest.sharding)

  out = jax.tree.map(place, tree)
  if dest.single or not dest.sharding.is_fully_replicated:
    return out
  return Mirrored.from_global(out)


def components(x: jax.Array, layout: Layout) -> list[jax.Array]:
  """The replica components of a stacked leaf, one per replica index, each on a device that holds it."""
  by_index: dict[int, jax.Array] = {}
  for shard in x.addressable_shards:
    start = shard.index[0].start or 0
    by_index.setdefault(start, shard.data[0])
  if len(by_index) != layout.num_components:
    return [x[r] for r in range(layout.num_components)]
  return [by_index[r] for r in range(layout.num_components)]


def shard_on(x: jax.Array, device: Any) -> jax.Array:
  """Row ``r`` of a stacked result, taken from `device`'s shard (where it was computed)."""
  for shard in x.addressable_shards:
    if shard.device == device:
      return shard.data[0]
  raise AssertionError(f"no shard of the result on {device}")
