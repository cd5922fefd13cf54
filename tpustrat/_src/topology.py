"""Topology and device assignment: TF's `Topology` and `DeviceAssignment` on JAX.

`initialize_tpu_system` (`tpustrat._src.connect_to_cluster`) returns a `Topology`: the physical mesh of
cores and where each TPU device sits in it. A `DeviceAssignment` places replicas on it (which physical
core runs logical core ``l`` of replica ``r``). tpustrat keeps TF's names and meanings:

* `Topology` is built, on TPU, from the devices' physical coordinates (``device.coords`` and
  ``device.core_on_chip``); elsewhere from a synthetic layout (see `Topology`).
* `DeviceAssignment.build` is TF's algorithm: replicas are blocks of ``computation_shape`` cores packed
  into the topology. `TPUStrategy(resolver, device_assignment=...)` turns it into its device mesh:
  replicas x logical cores (`tpustrat._src.logical`).

Example, the two device assignments of TF's documentation on 8 devices:

>>> topology = tpustrat.initialize_tpu_system(tpustrat.cluster_resolver.TPUClusterResolver())
>>> topology.mesh_shape.tolist()
[2, 2, 2]
>>> da = tpustrat.DeviceAssignment.build(topology, computation_shape=[1, 1, 2], num_replicas=4)
>>> da.num_replicas, da.num_cores_per_replica
(4, 2)
>>> tpustrat.DeviceAssignment.build(topology, computation_shape=[2, 2, 2]).num_cores_per_replica
8
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tpustrat._src import validation

__all__ = [
    "DeviceAssignment",
    "Topology",
    "device_grid",
    "synthetic_layout",
    "topology_of_devices",
]


# -- topology -----------------------------------------------------------------------------------------


def _is_3d_generation(device: Any) -> bool:
  """Whether the TPU chip generation is wired as a 3-D torus (v4, v5p: `device_kind` ``'TPU v4'``,
  ``'TPU v5'``; later ones unless ``lite``), so that its topology has a ``z`` axis even when a slice is
  one chip deep (a v4-8). v2, v3 and the "lite" generations (v5e, v6e) are 2-D."""
  match = re.search(r"v?(\d+)\s*(\w*)", str(getattr(device, "device_kind", "")).lower().removeprefix("tpu"))
  return match is not None and int(match.group(1)) >= 4 and match.group(2) not in ("lite", "e")


def synthetic_layout(num_devices: int) -> tuple[list[int], list[tuple[int, ...]]]:
  """The mesh shape and per-device coordinates used where devices have no physical coordinates.

  Devices (in `(process_index, id)` order) are paired into "chips" of 2 cores (1 core when their count
  is odd); the chips form an ``X x Y`` grid, ``X >= Y``, as square as possible. Device ``i`` is core
  ``i % cores`` of chip ``c = i // cores``, at ``x = c % X, y = c // X``: how a TPU v3-8 host numbers
  its 8 cores. The coordinates are ``(x, y, core)``, TF's 3-axis TPU topology.

  >>> synthetic_layout(8)
  ([2, 2, 2], [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1), (0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)])
  >>> synthetic_layout(6)[0], synthetic_layout(1)[0], synthetic_layout(16)[0]
  ([3, 1, 2], [1, 1, 1], [4, 2, 2])
  """
  cores = 2 if num_devices % 2 == 0 else 1
  chips = num_devices // cores
  y = max(d for d in range(1, math.isqrt(chips) + 1) if chips % d == 0)
  x = chips // y
  coords: list[tuple[int, ...]] = [((i // cores) % x, (i // cores) // x, i % cores) for i in range(num_devices)]
  return [x, y, cores], coords


class Topology:
  """The physical mesh of a job's TPU cores, and where each device sits in it (TF's
  `tf.tpu.experimental.Topology`).

  Obtain it from `initialize_tpu_system`. Coordinates have one entry per mesh axis:

  * TPU, 2-D chip generations (v2, v3, v5e, v6e): ``(x, y, core)`` as in TF 2.2, from ``device.coords``
    (its ``z`` is 0) and ``device.core_on_chip``; a v3-8 host is ``mesh_shape = [2, 2, 2]``.
  * TPU, 3-D generations (v4, v5p): ``(x, y, z, core)`` as in later TF versions, whatever the slice's
    depth (a v4-8 is ``[2, 2, 1, 1]``).
  * CPU and GPU: the synthetic layout of `synthetic_layout` (``(x, y, core)``; 8 devices give
    ``[2, 2, 2]``, like a TPU v3-8).

  A task is a process: ``device_coordinates[t, i]`` are the coordinates of process ``t``'s ``i``-th
  device (by device id), and the "TPU ordinal" of a device is that ``i``.

  Args:
    serialized: TF's serialized `TopologyProto`; not supported (`ValueError`).
    mesh_shape: the number of cores along each axis of the mesh.
    device_coordinates: int array ``[num_tasks, num_tpus_per_task, len(mesh_shape)]``.

  >>> t = Topology(mesh_shape=[2, 1, 2], device_coordinates=[[[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]])
  >>> t.num_tasks, t.num_tpus_per_task, t.tpu_device_ordinal_at_coordinates([1, 0, 0])
  (1, 4, 2)
  """

  def __init__(self, serialized: bytes | None = None, mesh_shape: Sequence[int] | None = None,
               device_coordinates: Any = None) -> None:
    if serialized is not None:
      raise ValueError(
          "Topology: a serialized TopologyProto is a TF runtime object and is not supported; use "
          "tpustrat.initialize_tpu_system() or pass mesh_shape and device_coordinates.")
    if mesh_shape is None or device_coordinates is None:
      raise ValueError("Topology needs mesh_shape and device_coordinates (or use tpustrat.initialize_tpu_system()).")
    shape = np.asarray(mesh_shape)
    if shape.ndim != 1 or shape.size == 0 or not np.issubdtype(shape.dtype, np.integer) or (shape < 1).any():
      raise ValueError(f"`mesh_shape` must be a sequence of positive integers; got {mesh_shape!r}.")
    coords = np.asarray(device_coordinates)
    if coords.ndim != 3 or coords.shape[2] != shape.size or (coords.size and not np.issubdtype(coords.dtype, np.integer)):
      raise ValueError(
          "`device_coordinates` must be a rank 3 int array [num_tasks, num_tpus_per_task, mesh rank] with "
          f"minor dimension equal to the mesh shape rank ({shape.size}); got shape {coords.shape}.")
    self._mesh_shape = shape.astype(np.int32)
    self._device_coordinates = coords.astype(np.int32)
    if ((self._device_coordinates < 0) | (self._device_coordinates >= self._mesh_shape)).any():
      raise ValueError(
          f"`device_coordinates` must lie inside mesh_shape {self._mesh_shape.tolist()}; got "
          f"{self._device_coordinates.tolist()}.")
    self._tasks = np.full(self._mesh_shape, -1, np.int32)
    self._ordinals = np.full(self._mesh_shape, -1, np.int32)
    for task in range(coords.shape[0]):
      for ordinal in range(coords.shape[1]):
        where = tuple(self._device_coordinates[task, ordinal])
        if self._tasks[where] >= 0:
          raise ValueError(f"`device_coordinates` places two devices at coordinates {list(where)}.")
        self._tasks[where], self._ordinals[where] = task, ordinal
    self._missing = np.argwhere(self._tasks < 0)
    self._devices: np.ndarray | None = None  # [num_tasks, num_tpus_per_task] jax.Device, when known

  @property
  def mesh_shape(self) -> np.ndarray:
    """A rank 1 int32 array: the number of cores along each axis of the mesh."""
    return self._mesh_shape

  @property
  def mesh_rank(self) -> int:
    """Number of axes of the mesh."""
    return len(self._mesh_shape)

  @property
  def device_coordinates(self) -> np.ndarray:
    """int32 array ``[num_tasks, num_tpus_per_task, mesh_rank]``: the coordinates of each task's devices."""
    return self._device_coordinates

  @property
  def missing_devices(self) -> np.ndarray:
    """Coordinates of the mesh positions without a device, ``[k, mesh_rank]``."""
    return self._missing

  @property
  def num_tasks(self) -> int:
    """Number of tasks (processes) in the job."""
    return self._device_coordinates.shape[0]

  @property
  def num_tpus_per_task(self) -> int:
    """Number of devices per task (process)."""
    return self._device_coordinates.shape[1]

  def _check_coordinates(self, device_coordinates: Sequence[int]) -> tuple[int, ...]:
    where = tuple(int(c) for c in device_coordinates)
    if len(where) != self.mesh_rank or any(not 0 <= c < s for c, s in zip(where, self._mesh_shape)):
      raise ValueError(f"Coordinates {list(where)} are outside the topology's mesh {self._mesh_shape.tolist()}.")
    if self._tasks[where] < 0:
      raise ValueError(f"No device at coordinates {list(where)} of the topology (missing devices: "
                       f"{self._missing.tolist()}).")
    return where

  def task_ordinal_at_coordinates(self, device_coordinates: Sequence[int]) -> int:
    """The task (process index) of the device at `device_coordinates`."""
    return int(self._tasks[self._check_coordinates(device_coordinates)])

  def tpu_device_ordinal_at_coordinates(self, device_coordinates: Sequence[int]) -> int:
    """The index, among its task's devices, of the device at `device_coordinates`."""
    return int(self._ordinals[self._check_coordinates(device_coordinates)])

  def device_at_coordinates(self, device_coordinates: Sequence[int]) -> Any:
    """The `jax.Device` at `device_coordinates` (tpustrat's addition; TF names devices with strings).

    For a topology built by hand, task ``t``'s ``i``-th device is the ``i``-th device (by id) of process ``t``.
    """
    where = self._check_coordinates(device_coordinates)
    task, ordinal = int(self._tasks[where]), int(self._ordinals[where])
    if self._devices is not None:
      return self._devices[task, ordinal]
    devices = sorted((d for d in jax.devices() if d.process_index == task), key=lambda d: d.id)
    if ordinal >= len(devices):
      raise ValueError(
          f"The topology has a device at coordinates {list(where)} (task {task}, ordinal {ordinal}), but "
          f"process {task} has only {len(devices)} devices.")
    return devices[ordinal]

  def __repr__(self) -> str:
    return (f"Topology(mesh_shape={self._mesh_shape.tolist()}, num_tasks={self.num_tasks}, "
            f"num_tpus_per_task={self.num_tpus_per_task})")


def topology_of_devices(devices: Sequence[Any]) -> Topology:
  """The topology of `devices` (all devices of the job), remembering which device sits where."""
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  tasks = sorted({d.process_index for d in devices})
  per_task = [[d for d in devices if d.process_index == t] for t in tasks]
  if len({len(p) for p in per_task}) != 1:
    raise ValueError(
        f"Topology: every process must have the same number of devices; got "
        f"{ {t: len(p) for t, p in zip(tasks, per_task)} }.")
  if all(d.platform == "tpu" and getattr(d, "coords", None) is not None for d in devices):
    coords = [tuple(int(c) for c in d.coords) + (int(getattr(d, "core_on_chip", 0)),) for d in devices]
    if all(len(c) == 4 and c[2] == 0 for c in coords) and not _is_3d_generation(devices[0]):
      coords = [(c[0], c[1], c[3]) for c in coords]  # a 2-D chip generation: TF 2.2's (x, y, core)
    shape = list(np.max(np.asarray(coords), axis=0) + 1)
  else:
    shape, coords = synthetic_layout(len(devices))
  n = len(per_task[0])
  return _DeviceTopology(shape, np.asarray(coords).reshape(len(tasks), n, len(shape)),
                         np.asarray(devices, dtype=object).reshape(len(tasks), n))


class _DeviceTopology(Topology):
  """A `Topology` that knows which `jax.Device` sits where (what `topology_of_devices` builds):
  `device_at_coordinates` answers from `devices`, ``[num_tasks, num_tpus_per_task]``."""

  def __init__(self, mesh_shape: Sequence[int], device_coordinates: Any, devices: np.ndarray) -> None:
    super().__init__(mesh_shape=mesh_shape, device_coordinates=device_coordinates)
    self._devices = devices


# -- device assignment --------------------------------------------------------------------------------


class DeviceAssignment:
  """Which physical core runs each logical core of each replica (TF's `tf.tpu.experimental.DeviceAssignment`).

  Prefer `DeviceAssignment.build`. `TPUStrategy(resolver, device_assignment=da)` runs ``da.num_replicas``
  replicas of ``da.num_cores_per_replica`` logical cores each; logical core ``l`` of replica ``r`` is
  the device at ``da.coordinates(r, l)``.

  Args:
    topology: the `Topology` the coordinates refer to.
    core_assignment: int array ``[num_replicas, num_cores_per_replica, topology.mesh_rank]`` of
      physical coordinates.

  >>> topology = tpustrat.initialize_tpu_system()
  >>> da = DeviceAssignment.build(topology, computation_shape=[1, 1, 2], num_replicas=4)
  >>> da.coordinates(1, 0), da.tpu_ordinal(replica=1, logical_core=1), da.lookup_replicas(0, 1)
  ((1, 0, 0), 3, [0, 1, 2, 3])
  """

  def __init__(self, topology: Topology, core_assignment: Any) -> None:
    if not isinstance(topology, Topology):
      raise ValueError(f"topology must be a Topology object, got {type(topology)}.")
    assignment = np.asarray(core_assignment)
    if assignment.ndim != 3:
      raise ValueError(f"core_assignment must be a rank 3 numpy array, got shape {assignment.shape}.")
    if assignment.shape[-1] != topology.mesh_rank:
      raise ValueError(
          f"minor dimension of core_assignment must have size equal to topology rank "
          f"({topology.mesh_rank}), got shape {assignment.shape}.")
    if assignment.shape[0] < 1 or assignment.shape[1] < 1:
      raise ValueError(f"core_assignment needs at least one replica and one core, got shape {assignment.shape}.")
    self._topology = topology
    self._core_assignment = assignment.astype(np.int32)
    seen: dict[tuple[int, ...], tuple[int, int]] = {}
    self._replicas_by_task: dict[int, dict[int, list[int]]] = {}
    for r in range(assignment.shape[0]):
      for l in range(assignment.shape[1]):
        where = tuple(int(c) for c in self._core_assignment[r, l])
        try:
          task = topology.task_ordinal_at_coordinates(where)
        except ValueError as e:
          raise ValueError(
              f"The device assignment puts logical core {l} of replica {r} at coordinates {list(where)}, "
              f"but the topology has no device there: it needs more devices than exist. {e}") from None
        if where in seen:
          raise ValueError(
              f"The device assignment puts logical core {l} of replica {r} and logical core {seen[where][1]} "
              f"of replica {seen[where][0]} on the same device (coordinates {list(where)}).")
        seen[where] = (r, l)
        self._replicas_by_task.setdefault(task, {}).setdefault(l, []).append(r)

  @property
  def topology(self) -> Topology:
    """The `Topology` the coordinates refer to."""
    return self._topology

  @property
  def num_replicas(self) -> int:
    """Number of replicas of the computation."""
    return self._core_assignment.shape[0]

  @property
  def num_cores_per_replica(self) -> int:
    """Number of logical cores of each replica."""
    return self._core_assignment.shape[1]

  @property
  def core_assignment(self) -> np.ndarray:
    """int32 ``[num_replicas, num_cores_per_replica, topology_rank]``: physical coordinates of each
    (replica, logical core)."""
    return self._core_assignment

  def coordinates(self, replica: int, logical_core: int) -> tuple[int, ...]:
    """The physical topology coordinates of `logical_core` of `replica`."""
    return tuple(int(c) for c in self._core_assignment[replica, logical_core])

  def lookup_replicas(self, task_id: int, logical_core: int) -> list[int]:
    """The sorted replica ids whose `logical_core` is on a device of task (process) `task_id`.

    Raises:
      ValueError: if no replica of that task contains the logical core.
    """
    try:
      return sorted(self._replicas_by_task[task_id][logical_core])
    except KeyError:
      raise ValueError(f"Can not find any replica in task: {task_id} contains logical_core: {logical_core}") from None

  def tpu_ordinal(self, replica: int = 0, logical_core: int = 0) -> int:
    """The ordinal (index among its process's devices) of the device of `logical_core` of `replica`."""
    return self._topology.tpu_device_ordinal_at_coordinates(self.coordinates(replica, logical_core))

  def tpu_device(self, replica: int = 0, logical_core: int = 0, job: str | None = None) -> Any:
    """The `jax.Device` of `logical_core` of `replica` (TF returns a device name string)."""
    del job
    return self._topology.device_at_coordinates(self.coordinates(replica, logical_core))

  @staticmethod
  def build(topology: Topology, computation_shape: Sequence[int] | None = None,
            computation_stride: Sequence[int] | None = None, num_replicas: int = 1) -> DeviceAssignment:
    """TF's `device_assignment`: packs `num_replicas` blocks of `computation_shape` cores into `topology`.

    Each replica is a block of ``computation_shape`` cores (spaced by ``computation_stride``); its
    logical cores are the block's cores in row-major order of the mesh axes (for ``(x, y, core)``: core
    fastest). Replicas are laid out as a grid chosen as close to a cube as possible, core axis first, as
    TF does. On a topology with missing devices the replicas take devices in task order, as TF does.
    Not reproduced: the 3-D ring order that TF 2.4+ uses on rank-4 topologies (v4, v5p) when the replicas
    fill the whole mesh without stride; each replica still gets one block of ``computation_shape``
    cores, but which block, and the order of its cores, can differ from TF's there.

    Args:
      topology: a `Topology`.
      computation_shape: cores per replica along each mesh axis; default all ones.
      computation_stride: spacing of those cores; default all ones.
      num_replicas: number of replicas.

    Raises:
      ValueError: a shape or stride of the wrong rank or not positive, or replicas that do not fit in
        the topology.
    """
    if not isinstance(topology, Topology):
      raise ValueError(f"`topology` is not a Topology object; got {type(topology)}")
    rank = topology.mesh_rank
    mesh_shape = topology.mesh_shape
    shape = np.asarray([1] * rank if computation_shape is None else computation_shape)
    stride = np.asarray([1] * rank if computation_stride is None else computation_stride)
    if shape.shape != (rank,):
      raise ValueError(f"computation_shape must have shape [{rank}]; got {list(shape.shape)}: "
                       f"{shape.tolist()} for a topology of rank {rank} (mesh_shape {mesh_shape.tolist()}).")
    if stride.shape != (rank,):
      raise ValueError(f"computation_stride must have shape [{rank}]; got {list(stride.shape)}: {stride.tolist()}.")
    for name, value in (("computation_shape", shape), ("computation_stride", stride)):
      if not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"{name} must hold integers; got {value.tolist()}.")
    shape, stride = shape.astype(np.int64), stride.astype(np.int64)
    if (shape < 1).any():
      raise ValueError(f"computation_shape must be positive; got computation_shape={shape.tolist()}")
    if (stride < 1).any():
      raise ValueError(f"computation_stride must be positive; got computation_stride={stride.tolist()}")
    num_replicas = validation.check_int(num_replicas, "DeviceAssignment.build", "num_replicas", minimum=1)
    footprint = shape * stride
    if (footprint > mesh_shape).any():
      raise ValueError(f"computation footprint {footprint.tolist()} does not fit in TPU topology shape "
                       f"{mesh_shape.tolist()}")
    replica_counts = (mesh_shape // footprint) * stride
    max_replicas = int(np.prod(replica_counts))
    if num_replicas > max_replicas:
      raise ValueError(
          f"requested {num_replicas} replicas but only {max_replicas} replicas with shape "
          f"{shape.tolist()} and computation_stride {stride.tolist()} fit in a TPU mesh of shape "
          f"{mesh_shape.tolist()}")
    if topology.missing_devices.size == 0:
      assignment = _packed_assignment(shape, stride, replica_counts, num_replicas)
    else:
      assignment = _task_order_assignment(topology, shape, stride, num_replicas)
    return DeviceAssignment(topology, assignment)

  def __repr__(self) -> str:
    return (f"DeviceAssignment(num_replicas={self.num_replicas}, "
            f"num_cores_per_replica={self.num_cores_per_replica}, topology={self._topology!r})")


def device_grid(assignment: DeviceAssignment) -> np.ndarray:
  """``[num_replicas, num_cores_per_replica]`` object array of the `jax.Device` of each logical core."""
  grid = np.empty(assignment.core_assignment.shape[:2], dtype=object)
  for r, l in np.ndindex(*grid.shape):  # distinct: the constructor rejects two cores at one coordinate
    grid[r, l] = assignment.tpu_device(r, l)
  return grid


def _packed_assignment(shape: np.ndarray, stride: np.ndarray, replica_counts: np.ndarray,
                       num_replicas: int) -> np.ndarray:
  """TF's assignment on a complete topology: replicas on a near-cubic grid, core axis visited first."""
  rank = len(shape)
  replica_shape = [0] * rank
  remaining, dims = num_replicas, rank
  # Visit axes by increasing size (the most constrained first); among equal sizes the core axis (last)
  # first, then x, y, ... so that replicas prefer the cores of one chip, then neighbouring chips.
  for size, key in sorted((int(s), (i + 1) % rank) for i, s in enumerate(replica_counts)):
    i = (key + rank - 1) % rank
    target = int(math.ceil(remaining ** (1.0 / dims)))
    replica_shape[i] = min(target, size)
    remaining = -(-remaining // replica_shape[i])
    dims -= 1
  offsets = np.zeros((num_replicas, rank), np.int64)
  footprint = shape * stride
  order = [replica_shape[-1]] + replica_shape[:-1]
  for replica in range(num_replicas):
    t, pos = replica, []
    for dim in order:  # the core axis first
      pos.append(t % dim)
      t //= dim
    replica_pos = np.asarray(pos[1:] + pos[:1])
    offsets[replica] = (replica_pos // stride) * footprint + replica_pos % stride
  axes = [np.arange(0, shape[i] * stride[i], stride[i]) for i in range(rank)]
  cores = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, rank)
  return cores[None, :, :] + offsets[:, None, :]


def _task_order_assignment(topology: Topology, shape: np.ndarray, stride: np.ndarray,
                           num_replicas: int) -> np.ndarray:
  """TF's assignment on a topology with missing devices: logical cores take devices in task order."""
  per_replica = int(np.prod(shape))
  available = topology.num_tasks * topology.num_tpus_per_task
  if (stride != 1).any():
    raise ValueError(f"computation_stride must be all ones on a topology with missing devices; got {stride.tolist()}.")
  if num_replicas * per_replica > available:
    raise ValueError(
        f"requested {num_replicas} replicas of {per_replica} cores, but the topology has only {available} devices.")
  coords = topology.device_coordinates.reshape(-1, topology.mesh_rank)
  return coords[:num_replicas * per_replica].reshape(num_replicas, per_replica, topology.mesh_rank)
