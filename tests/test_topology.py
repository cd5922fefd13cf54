"""Topology and DeviceAssignment (`tpustrat._src.topology`): TF's semantics on 8 CPU devices and on
described TPU devices; `DeviceAssignment.build` against a transcription of TF's algorithm."""

import itertools
import math
import types

import jax
import numpy as np
import pytest

import tpustrat
from tpustrat._src import topology as topology_lib
from tpustrat.cluster_resolver import TPUClusterResolver


@pytest.fixture(scope="module")
def topology():
  return tpustrat.initialize_tpu_system(TPUClusterResolver())


# -- topology -----------------------------------------------------------------------------------------


def test_topology_of_8_cpu_devices_is_a_v3_8_like_synthetic_layout(topology):
  assert topology.mesh_shape.tolist() == [2, 2, 2] and topology.mesh_rank == 3
  assert (topology.num_tasks, topology.num_tpus_per_task) == (1, 8)
  assert topology.device_coordinates.shape == (1, 8, 3) and topology.missing_devices.size == 0
  devices = sorted(jax.devices(), key=lambda d: d.id)
  for i, coords in enumerate(topology.device_coordinates[0].tolist()):
    assert coords == [(i // 2) % 2, i // 4, i % 2]  # core i % 2 of chip i // 2, chips x-fastest
    assert topology.task_ordinal_at_coordinates(coords) == 0
    assert topology.tpu_device_ordinal_at_coordinates(coords) == i
    assert topology.device_at_coordinates(coords) == devices[i]


@pytest.mark.parametrize("n, shape", [(1, [1, 1, 1]), (2, [1, 1, 2]), (4, [2, 1, 2]), (6, [3, 1, 2]),
                                      (8, [2, 2, 2]), (16, [4, 2, 2]), (32, [4, 4, 2]), (5, [5, 1, 1])])
def test_synthetic_layouts(n, shape):
  mesh_shape, coords = topology_lib.synthetic_layout(n)
  assert mesh_shape == shape
  assert len(set(coords)) == n and all(0 <= c < s for xyz in coords for c, s in zip(xyz, shape))


def _tpu(i, coords, core, process=0):
  return types.SimpleNamespace(id=i, process_index=process, platform="tpu", coords=coords, core_on_chip=core)


def test_topology_from_tpu_coordinates():
  # A v3-8 host: 4 chips in a 2x2 grid, 2 cores each; z is 0 -> TF 2.2's (x, y, core).
  v3 = [_tpu(2 * c + k, [c % 2, c // 2, 0], k) for c in range(4) for k in range(2)]
  t = topology_lib.topology_of_devices(v3[::-1])  # order does not matter: (process, id)
  assert t.mesh_shape.tolist() == [2, 2, 2]
  assert t.device_coordinates[0].tolist() == [[c % 2, c // 2, k] for c in range(4) for k in range(2)]
  # A v4-16 slice over 2 hosts: 2x2x2 chips of one core; 3-D -> (x, y, z, core).
  v4 = [_tpu(i, [i % 2, (i // 2) % 2, i // 4], 0, process=i // 4) for i in range(8)]
  t = topology_lib.topology_of_devices(v4)
  assert t.mesh_shape.tolist() == [2, 2, 2, 1]
  assert (t.num_tasks, t.num_tpus_per_task) == (2, 4)
  assert t.task_ordinal_at_coordinates([1, 1, 1, 0]) == 1 and t.tpu_device_ordinal_at_coordinates([1, 1, 1, 0]) == 3
  assert t.device_at_coordinates([0, 1, 1, 0]) is v4[6]


@pytest.mark.parametrize("kwargs, match", [
    (dict(serialized=b"\x00"), "serialized TopologyProto"),
    (dict(mesh_shape=[2, 0], device_coordinates=[[[0, 0]]]), "positive"),
    (dict(mesh_shape=[2, 2], device_coordinates=[[0, 0]]), "rank 3"),
    (dict(mesh_shape=[2, 2], device_coordinates=[[[0, 2]]]), "inside mesh_shape"),
    (dict(mesh_shape=[2, 2], device_coordinates=[[[0, 1], [0, 1]]]), "two devices"),
])
def test_topology_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tpustrat.Topology(**kwargs)


# -- device assignment --------------------------------------------------------------------------------


def test_spec_example_4_replicas_of_2_cores(topology):
  da = tpustrat.DeviceAssignment.build(topology, computation_shape=[1, 1, 2], num_replicas=4)
  assert (da.num_replicas, da.num_cores_per_replica) == (4, 2)
  # TF's algorithm: replica grid [2, 2, 1] over (x, y, core), x first; a replica is the 2 cores of a chip.
  assert da.core_assignment.tolist() == [[[0, 0, 0], [0, 0, 1]], [[1, 0, 0], [1, 0, 1]],
                                         [[0, 1, 0], [0, 1, 1]], [[1, 1, 0], [1, 1, 1]]]
  assert da.coordinates(2, 1) == (0, 1, 1)
  assert [[da.tpu_ordinal(r, l) for l in range(2)] for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert da.lookup_replicas(0, 0) == [0, 1, 2, 3]
  assert da.tpu_device(3, 1) == sorted(jax.devices(), key=lambda d: d.id)[7]
  with pytest.raises(ValueError, match="Can not find any replica in task: 1"):
    da.lookup_replicas(1, 0)


def test_spec_example_1_replica_of_8_cores(topology):
  da = tpustrat.DeviceAssignment.build(topology, computation_shape=[2, 2, 2], num_replicas=1)
  assert (da.num_replicas, da.num_cores_per_replica) == (1, 8)
  # Logical cores are the block's cores in row-major (x, y, core) order.
  assert da.core_assignment[0].tolist() == [[x, y, c] for x in range(2) for y in range(2) for c in range(2)]
  assert [da.tpu_ordinal(0, l) for l in range(8)] == [0, 1, 4, 5, 2, 3, 6, 7]


@pytest.mark.parametrize("shape, stride, replicas, want", [
    (None, None, 8, [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1], [0, 1, 0], [0, 1, 1], [1, 1, 0], [1, 1, 1]]),
    (None, None, 2, [[0, 0, 0], [0, 0, 1]]),
    ([2, 1, 1], None, 4, [[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]),
    ([1, 1, 1], [2, 1, 1], 4, [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]),
])
def test_build_matches_tf(topology, shape, stride, replicas, want):
  """Expected values worked out by hand from TF's `device_assignment` (first logical core of each replica)."""
  da = tpustrat.DeviceAssignment.build(topology, shape, stride, replicas)
  assert da.core_assignment[:, 0].tolist() == want


def test_build_on_a_topology_with_missing_devices():
  t = tpustrat.Topology(mesh_shape=[2, 2, 1], device_coordinates=[[[0, 0, 0], [1, 0, 0], [1, 1, 0]]])
  da = tpustrat.DeviceAssignment.build(t, computation_shape=[1, 1, 1], num_replicas=3)
  assert da.core_assignment[:, 0].tolist() == [[0, 0, 0], [1, 0, 0], [1, 1, 0]]  # task order


@pytest.mark.parametrize("kwargs, match", [
    (dict(computation_shape=[1, 2]), r"computation_shape must have shape \[3\]; got \[2\]"),
    (dict(computation_shape=[1, 1, 1, 2]), r"computation_shape must have shape \[3\]; got \[4\]"),
    (dict(computation_stride=[1, 1]), r"computation_stride must have shape \[3\]"),
    (dict(computation_shape=[1, 0, 1]), "computation_shape must be positive"),
    (dict(computation_shape=[1.5, 1, 1]), "must hold integers"),
    (dict(computation_shape=[4, 1, 1]), r"computation footprint \[4, 1, 1\] does not fit in TPU topology shape \[2, 2, 2\]"),
    (dict(computation_shape=[1, 1, 2], num_replicas=5), "requested 5 replicas but only 4 replicas"),
    (dict(num_replicas=9), "requested 9 replicas but only 8 replicas"),
    (dict(num_replicas=0), "`num_replicas` must be an int >= 1, got 0"),
])
def test_build_errors(topology, kwargs, match):
  with pytest.raises(ValueError, match=match):
    tpustrat.DeviceAssignment.build(topology, **kwargs)


def test_device_assignment_errors(topology):
  with pytest.raises(ValueError, match="must be a Topology"):
    tpustrat.DeviceAssignment("topology", [[[0, 0, 0]]])
  with pytest.raises(ValueError, match="rank 3"):
    tpustrat.DeviceAssignment(topology, [[0, 0, 0]])
  with pytest.raises(ValueError, match="topology rank"):
    tpustrat.DeviceAssignment(topology, [[[0, 0]]])
  with pytest.raises(ValueError, match="needs more devices than exist"):
    tpustrat.DeviceAssignment(topology, [[[0, 0, 0], [2, 0, 0]]])
  with pytest.raises(ValueError, match="same device"):
    tpustrat.DeviceAssignment(topology, [[[0, 0, 0]], [[0, 0, 0]]])


# -- the strategy's mesh --------------------------------------------------------------------------------


def test_strategy_mesh_is_replicas_by_logical_cores(topology):
  resolver = TPUClusterResolver(tpu="")
  da = tpustrat.DeviceAssignment.build(topology, computation_shape=[1, 1, 2], num_replicas=4)
  s = tpustrat.TPUStrategy(resolver, device_assignment=da)
  assert s.cluster_resolver is resolver and s.num_replicas_in_sync == 4
  assert dict(s.mesh.shape) == {"replica": 4, "core_0": 2}
  assert s.extended.num_logical_cores_per_replica == 2 and s.extended.logical_core_axes == ("core_0",)
  grid = s.mesh.devices.reshape(4, 2)
  assert [[grid[r, l] for l in range(2)] for r in range(4)] == [[da.tpu_device(r, l) for l in range(2)] for r in range(4)]
  assert s.extended.worker_devices == tuple(grid[:, 0])  # logical core 0 of each replica, as TF

  da8 = tpustrat.DeviceAssignment.build(topology, computation_shape=[2, 2, 2], num_replicas=1)
  s8 = tpustrat.TPUStrategy(resolver, device_assignment=da8)
  assert dict(s8.mesh.shape) == {"replica": 1, "core_0": 2, "core_1": 2, "core_2": 2}
  assert list(s8.mesh.devices.reshape(-1)) == [da8.tpu_device(0, l) for l in range(8)]


def test_strategy_with_fewer_replicas_than_devices(topology):
  da = tpustrat.DeviceAssignment.build(topology, num_replicas=4)
  s = tpustrat.TPUStrategy(device_assignment=da)
  assert dict(s.mesh.shape) == {"replica": 4} and s.extended.logical_core_axes == ()
  out = s.run(lambda: tpustrat.get_replica_context().replica_id_in_sync_group)
  assert np.asarray(out.values).tolist() == [0, 1, 2, 3]


def test_strategy_device_assignment_forms(topology):
  devices = jax.devices()[:3]
  assert tpustrat.TPUStrategy(device_assignment=devices).mesh.devices.tolist() == devices  # still accepted
  with pytest.raises(TypeError, match="DeviceAssignment"):
    tpustrat.TPUStrategy(device_assignment="all")
  with pytest.raises(TypeError, match="TPUClusterResolver"):
    tpustrat.TPUStrategy("grpc://host:8470")
  # A hand-built topology larger than the machine: the assignment needs devices that do not exist.
  big = tpustrat.Topology(mesh_shape=[4, 2, 2], device_coordinates=np.asarray(
      [[x, y, c] for y in range(2) for x in range(4) for c in range(2)]).reshape(1, 16, 3))
  da = tpustrat.DeviceAssignment.build(big, computation_shape=[1, 1, 2], num_replicas=8)
  with pytest.raises(ValueError, match="process 0 has only 8 devices"):
    tpustrat.TPUStrategy(device_assignment=da)


# -- topology of TPU devices ---------------------------------------------------------------------------


def _tpu_of_kind(i, coords, core, kind, process=0):
  return types.SimpleNamespace(id=i, process_index=process, platform="tpu", coords=coords, core_on_chip=core,
                               device_kind=kind)


@pytest.mark.parametrize("kind, chips, cores, want", [
    # 3-D chip generations keep (x, y, z, core) whatever the slice's size, as TF does on them:
    # a v4-8 or v5p-8 (2x2x1 chips) has the same rank as a v4-32 (2x2x4).
    ("TPU v4", (2, 2, 1), 1, [2, 2, 1, 1]),
    ("TPU v5", (2, 2, 1), 1, [2, 2, 1, 1]),
    ("TPU v4", (2, 2, 2), 1, [2, 2, 2, 1]),
    # 2-D generations: TF 2.2's (x, y, core).
    ("TPU v3", (2, 2, 1), 2, [2, 2, 2]),
    ("TPU v2", (2, 2, 1), 2, [2, 2, 2]),
    ("TPU v5 lite", (2, 4, 1), 1, [2, 4, 1]),
    ("TPU v6 lite", (2, 2, 1), 1, [2, 2, 1]),
])
def test_topology_rank_follows_the_chip_generation_not_the_slice_size(kind, chips, cores, want):
  X, Y, Z = chips
  devices = [_tpu_of_kind(i, [x, y, z], k, kind)
             for i, (z, y, x, k) in enumerate(itertools.product(range(Z), range(Y), range(X), range(cores)))]
  t = topology_lib.topology_of_devices(devices)
  assert t.mesh_shape.tolist() == want
  assert t.missing_devices.size == 0


# -- DeviceAssignment.build against a transcription of TF's algorithm ----------------------------------


def _tf_device_assignment(mesh_shape, computation_shape, computation_stride, num_replicas):
  """TF's `device_assignment` (tensorflow/python/tpu/device_assignment.py, complete topology, no 3-D
  ring tiling), transcribed: the reference the implementation is compared with."""
  topology_rank = len(mesh_shape)
  mesh_shape = np.asarray(mesh_shape)
  computation_shape = np.asarray(computation_shape, np.int32)
  computation_stride = np.asarray(computation_stride, np.int32)
  computation_footprint = computation_shape * computation_stride
  block_counts = mesh_shape // computation_footprint
  replica_counts = block_counts * computation_stride
  replica_shape = [0] * topology_rank
  remaining_replicas = num_replicas
  remaining_dims = topology_rank
  for x, ni in sorted((x, ((i + 1) % topology_rank)) for (i, x) in enumerate(replica_counts)):
    i = (ni + topology_rank - 1) % topology_rank
    target_size = int(math.ceil(remaining_replicas ** (1.0 / remaining_dims)))
    replica_shape[i] = min(target_size, x)
    remaining_replicas = (remaining_replicas + replica_shape[i] - 1) // replica_shape[i]
    remaining_dims -= 1
  assert remaining_replicas == 1 and remaining_dims == 0
  replica_offsets = np.full([num_replicas, topology_rank], -1, dtype=np.int32)
  for replica in range(num_replicas):
    t = replica
    pos = []
    for dim in np.concatenate([[replica_shape[-1]], replica_shape[:-1]]):
      pos.append(t % dim)
      t //= dim
    replica_pos = np.concatenate([pos[1:], [pos[0]]])
    outer = replica_pos // computation_stride
    inner = replica_pos % computation_stride
    replica_offsets[replica, :] = outer * computation_footprint + inner
  indices = [np.arange(0, computation_shape[i] * computation_stride[i], computation_stride[i])
             for i in range(topology_rank)]
  indices = np.concatenate([i[..., np.newaxis] for i in np.meshgrid(*indices, indexing="ij")], axis=-1)
  indices = indices.reshape((-1, topology_rank))
  return indices + replica_offsets[:, np.newaxis, :]


def _cases():
  for mesh in ([2, 2, 2], [4, 2, 2], [4, 4, 2], [3, 1, 2], [4, 2, 1]):
    for shape in itertools.product(*[[1, 2] if m % 2 == 0 else [1] for m in mesh]):
      for stride in ([1] * len(mesh), [2 if m >= 4 else 1 for m in mesh]):
        footprint = np.asarray(shape) * np.asarray(stride)
        if (footprint > np.asarray(mesh)).any():
          continue
        most = int(np.prod((np.asarray(mesh) // footprint) * np.asarray(stride)))
        for replicas in sorted({1, 2, 3, most // 2 or 1, most}):
          if replicas <= most:
            yield mesh, list(shape), stride, replicas


def test_build_agrees_with_tfs_algorithm():
  n = 0
  for mesh, shape, stride, replicas in _cases():
    coords = np.stack(np.meshgrid(*[np.arange(m) for m in mesh], indexing="ij"), -1).reshape(1, -1, len(mesh))
    topology = tpustrat.Topology(mesh_shape=mesh, device_coordinates=coords)
    got = tpustrat.DeviceAssignment.build(topology, shape, stride, replicas).core_assignment
    want = _tf_device_assignment(mesh, shape, stride, replicas)
    assert got.tolist() == want.tolist(), (mesh, shape, stride, replicas)
    n += 1
  assert n > 50
