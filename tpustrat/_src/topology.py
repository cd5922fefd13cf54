"""Cluster, topology and device assignment: TF's `TPUClusterResolver`, `Topology` and `DeviceAssignment` on JAX.

TF finds its TPUs through a cluster resolver, connects to them (`tf.config.experimental_connect_to_cluster`),
initialises the TPU system (which returns a `Topology`: the physical mesh of cores and where each TPU
device sits in it) and places replicas with a `DeviceAssignment` (which physical core runs logical core
``l`` of replica ``r``). tpustrat keeps those names and meanings:

* `TPUClusterResolver` describes the processes of a job. One process (a laptop, a GPU box, a single TPU
  VM) needs nothing. For several processes it takes a coordinator address, a process count and a process
  id (arguments, or the environment variables ``TPUSTRAT_COORDINATOR_ADDRESS``,
  ``TPUSTRAT_NUM_PROCESSES``, ``TPUSTRAT_PROCESS_ID``, ``TPUSTRAT_LOCAL_DEVICE_IDS``); on a multi-host
  Cloud TPU slice it asks JAX's own TPU cluster detection.
* `experimental_connect_to_cluster` starts JAX's distributed runtime (`jax.distributed.initialize`) when
  more than one process is involved; for one process it does nothing. Calling it again is a no-op.
* `initialize_tpu_system` returns the `Topology` of every device of the job. On TPU it is built from the
  devices' physical coordinates (``device.coords`` and ``device.core_on_chip``); elsewhere from a
  synthetic layout (see `Topology`).
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
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tpustrat._src import distributed as distributed_lib

__all__ = [
    "DeviceAssignment",
    "TPUClusterResolver",
    "Topology",
    "experimental_connect_to_cluster",
    "initialize_tpu_system",
]

ENV_COORDINATOR_ADDRESS = "TPUSTRAT_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "TPUSTRAT_NUM_PROCESSES"
ENV_PROCESS_ID = "TPUSTRAT_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "TPUSTRAT_LOCAL_DEVICE_IDS"
ENV_COORDINATOR_BIND_ADDRESS = "TPUSTRAT_COORDINATOR_BIND_ADDRESS"
ENV_INITIALIZATION_TIMEOUT = "TPUSTRAT_INITIALIZATION_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "TPUSTRAT_HEARTBEAT_TIMEOUT"
ENV_SHUTDOWN_TIMEOUT = "TPUSTRAT_SHUTDOWN_TIMEOUT"
# JAX's own defaults (`jax.distributed.initialize`), in seconds.
_DEFAULT_TIMEOUTS = {"initialization_timeout": 300, "heartbeat_timeout": 100, "shutdown_timeout": 300}

# -- cluster resolver ---------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
  host = host.strip("[]")
  return host == "localhost" or host == "::1" or host.startswith("127.")


def _check_int(value: Any, what: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"TPUClusterResolver: {what} must be an int >= {minimum}, got {value!r}.")
  return int(value)


def _check_address(value: Any, what: str) -> str:
  if not isinstance(value, str) or ":" not in value:
    raise ValueError(f"TPUClusterResolver: {what} must be a 'host:port' string, got {value!r}.")
  return value


def _check_ids(value: Any) -> list[int]:
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return [_check_int(value, "local_device_ids", 0)]
  if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
    raise ValueError(
        f"TPUClusterResolver: local_device_ids must be an int or a sequence of ints >= 0, got {value!r}.")
  return [_check_int(v, f"local_device_ids[{i}]", 0) for i, v in enumerate(value)]


def _env_int(name: str, minimum: int) -> int | None:
  text = os.environ.get(name, "").strip()
  if not text:
    return None
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value < minimum:
    raise ValueError(f"TPUClusterResolver: environment variable {name}={text!r} must be an int >= {minimum}.")
  return value


def _env_ids(name: str) -> list[int] | None:
  text = os.environ.get(name, "").strip()
  if not text:
    return None
  try:
    return [int(t) for t in text.split(",")]
  except ValueError:
    raise ValueError(
        f"TPUClusterResolver: environment variable {name}={text!r} must be a comma-separated list of "
        "device ids, e.g. '0,1,2,3'.") from None


def _detect_cluster() -> tuple[str | None, int, int] | None:
  """(coordinator, process count, process id) of a Cloud TPU slice (GCE or GKE), from JAX's detection.

  Only TPU environments are detected: a Slurm or MPI allocation says how many tasks *may* run, not that
  this program was started once per task, so GPU clusters are described explicitly (arguments or
  environment variables). JAX keeps the detectors private (`jax._src.clusters`); if they move, detection
  is skipped and the job is one process unless told otherwise.
  """
  try:
    from jax._src import clusters  # pylint: disable=import-outside-toplevel
    envs = [env for env in clusters.ClusterEnv._cluster_types  # pylint: disable=protected-access
            if "tpu" in env.__name__.lower() and not env.opt_in_only_method and env.is_env_present()]
    if not envs:
      return None
    env = envs[0]
    count, index = int(env.get_process_count()), int(env.get_process_id())
    coordinator = env.get_coordinator_address(timeout_secs=None, override_coordinator_port=None) if count > 1 else None
    return coordinator, count, index
  except Exception:  # noqa: BLE001  # a detector that fails means: no cluster we can use
    return None


class TPUClusterResolver:
  """Where the job's devices are: this host's, a Cloud TPU slice's, or a multi-process cluster's.

  TF's `tf.distribute.cluster_resolver.TPUClusterResolver`. JAX runs on TPU VMs (the accelerators are
  attached to the process), so there is no TPU name to look up: ``tpu=None`` (or ``''`` / a slice name)
  means the devices of this host, and of the whole slice on a multi-host Cloud TPU slice (found by JAX's
  TPU cluster detection). ``tpu='local'`` means this host only, without looking for a slice. For a GPU
  cluster (Slurm, MPI, ...) or local multi-process runs, give the coordinator address, process count and
  process id, as arguments or environment variables:

  * ``coordinator_address`` / ``TPUSTRAT_COORDINATOR_ADDRESS`` (or JAX's ``JAX_COORDINATOR_ADDRESS``):
    ``host:port`` of the coordinator service that process 0 starts;
  * ``num_processes`` / ``TPUSTRAT_NUM_PROCESSES``: how many processes take part;
  * ``process_id`` / ``TPUSTRAT_PROCESS_ID``: this process's index, ``0 <= process_id < num_processes``;
  * ``local_device_ids`` / ``TPUSTRAT_LOCAL_DEVICE_IDS``: this process's devices (``"0,1"``), optional.

  How the processes watch each other (JAX's distributed runtime; seconds, JAX's defaults in brackets):

  * ``initialization_timeout`` / ``TPUSTRAT_INITIALIZATION_TIMEOUT`` [300]: how long
    `experimental_connect_to_cluster` waits for the coordinator and for every process to connect;
  * ``heartbeat_timeout`` / ``TPUSTRAT_HEARTBEAT_TIMEOUT`` [100]: a process that sends no heartbeat for
    this long (it died, or hangs) is declared dead, and every other process stops with an error naming it;
  * ``shutdown_timeout`` / ``TPUSTRAT_SHUTDOWN_TIMEOUT`` [300]: how long a finishing process waits for
    the others at JAX's shutdown barrier;
  * ``coordinator_bind_address`` / ``TPUSTRAT_COORDINATOR_BIND_ADDRESS`` (or JAX's
    ``JAX_COORDINATOR_BIND_ADDRESS``): where process 0's coordinator listens. Default: the coordinator address itself when it is a loopback address (``127.0.0.1``,
    ``localhost``: nothing listens on other interfaces), else JAX's default, every interface.

  Arguments win over environment variables. The constructor does not touch JAX's backends, so
  `experimental_connect_to_cluster` can still start the distributed runtime afterwards.

  Args:
    tpu: None, ``''``, ``'local'`` or the name of the slice this process runs on (see above). A
      ``grpc://`` address (TF's TPU Node architecture) is rejected: JAX needs the TPUs on this host.
    zone, project, credentials, service, discovery_url, coordinator_name: accepted for TF
      compatibility; unused (they address Google Cloud APIs that a TPU VM does not need).
    job_name: TF's job name; reported as `task_type`.
    coordinator_address: ``host:port`` of the coordinator (process 0 listens there).
    num_processes: number of processes in the job (keyword-only).
    process_id: this process's index (keyword-only).
    local_device_ids: id or ids of the devices this process uses (keyword-only), as for
      `jax.distributed.initialize`.
    coordinator_bind_address, initialization_timeout, heartbeat_timeout, shutdown_timeout: see above
      (keyword-only).

  >>> resolver = tpustrat.cluster_resolver.TPUClusterResolver()
  >>> resolver.num_processes, resolver.process_id, resolver.master()
  (1, 0, '')
  >>> TPUClusterResolver(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1).task_id
  1
  """

  def __init__(self, tpu: str | None = None, zone: str | None = None, project: str | None = None,
               job_name: str = "worker", coordinator_name: str | None = None,
               coordinator_address: str | None = None, credentials: Any = "default", service: Any = None,
               discovery_url: str | None = None, *, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
               coordinator_bind_address: str | None = None, initialization_timeout: int | None = None,
               heartbeat_timeout: int | None = None, shutdown_timeout: int | None = None) -> None:
    del zone, project, coordinator_name, credentials, service, discovery_url
    if tpu is not None and not isinstance(tpu, str):
      raise ValueError(
          f"TPUClusterResolver: `tpu` must be None or a string; got {tpu!r}. A list of TPU addresses "
          "describes TF's TPU Node architecture, which JAX does not use.")
    if tpu is not None and tpu.startswith("grpc://"):
      raise ValueError(
          f"TPUClusterResolver: tpu={tpu!r} is the address of a remote TPU Node; JAX runs on TPU VMs, "
          "with the TPUs attached to this host. Use tpu=None (or 'local') on the TPU VM, and "
          "coordinator_address / num_processes / process_id for a multi-process job.")
    self._tpu = tpu
    self._job_name = job_name
    self._args = (
        None if coordinator_address is None else _check_address(coordinator_address, "coordinator_address"),
        None if num_processes is None else _check_int(num_processes, "num_processes", 1),
        None if process_id is None else _check_int(process_id, "process_id", 0),
        None if local_device_ids is None else _check_ids(local_device_ids),
    )
    self._resolved: tuple[str | None, int, int, list[int] | None] | None = None
    self._bind_address = (None if coordinator_bind_address is None
                          else _check_address(coordinator_bind_address, "coordinator_bind_address"))
    self._timeouts = {name: None if value is None else _check_int(value, name, 1) for name, value in (
        ("initialization_timeout", initialization_timeout), ("heartbeat_timeout", heartbeat_timeout),
        ("shutdown_timeout", shutdown_timeout))}
    if self._args[1] is not None and self._args[2] is not None and self._args[2] >= self._args[1]:
      raise ValueError(
          f"TPUClusterResolver: process_id={self._args[2]} is out of range for num_processes="
          f"{self._args[1]}; expected 0 <= process_id < num_processes.")

  def _resolve(self) -> tuple[str | None, int, int, list[int] | None]:
    """(coordinator address, process count, process id, local device ids), resolved once."""
    if self._resolved is not None:
      return self._resolved
    coordinator, count, index, local = self._args
    if coordinator is None:
      coordinator = (os.environ.get(ENV_COORDINATOR_ADDRESS, "").strip()
                     or os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip() or None)
    if count is None:
      count = _env_int(ENV_NUM_PROCESSES, 1)
    if index is None:
      index = _env_int(ENV_PROCESS_ID, 0)
    if local is None:
      local = _env_ids(ENV_LOCAL_DEVICE_IDS)
    if count is None and index is None and self._tpu != "local":
      detected = _detect_cluster()
      if detected is not None:
        found, count, index = detected
        coordinator = coordinator or found
    count = 1 if count is None else count
    index = 0 if index is None else index
    if not 0 <= index < count:
      raise ValueError(
          f"TPUClusterResolver: process id {index} is out of range for {count} processes; expected "
          f"0 <= process_id < num_processes (set num_processes / {ENV_NUM_PROCESSES}).")
    if count > 1 and not coordinator:
      raise ValueError(
          f"TPUClusterResolver: {count} processes need a coordinator address ('host:port' of process "
          f"0): pass coordinator_address=... or set {ENV_COORDINATOR_ADDRESS}.")
    self._resolved = (coordinator, count, index, local)
    return self._resolved

  def _runtime_options(self) -> dict[str, Any]:
    """Keyword arguments of `jax.distributed.initialize` beyond the cluster's shape: timeouts, bind address."""
    timeouts = {}
    for name, env in (("initialization_timeout", ENV_INITIALIZATION_TIMEOUT),
                      ("heartbeat_timeout", ENV_HEARTBEAT_TIMEOUT), ("shutdown_timeout", ENV_SHUTDOWN_TIMEOUT)):
      value = self._timeouts[name]
      if value is None:
        value = _env_int(env, 1)
      timeouts[name] = _DEFAULT_TIMEOUTS[name] if value is None else value
    bind = (self._bind_address or os.environ.get(ENV_COORDINATOR_BIND_ADDRESS, "").strip()
            or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").strip() or None)
    if bind is None:
      coordinator = self._resolve()[0]
      if coordinator and _is_loopback(coordinator.rsplit(":", 1)[0]):
        bind = coordinator
    else:
      _check_address(bind, f"the coordinator bind address (from {ENV_COORDINATOR_BIND_ADDRESS} or "
                     "JAX_COORDINATOR_BIND_ADDRESS)")
    return {"coordinator_bind_address": bind, **timeouts}

  @property
  def tpu(self) -> str | None:
    """The `tpu` argument."""
    return self._tpu

  @property
  def coordinator_address(self) -> str | None:
    """``host:port`` of the coordinator, or None for a one-process job without one."""
    return self._resolve()[0]

  @property
  def num_processes(self) -> int:
    """Number of processes in the job (1 unless configured or detected)."""
    return self._resolve()[1]

  @property
  def process_id(self) -> int:
    """This process's index in the job."""
    return self._resolve()[2]

  @property
  def local_device_ids(self) -> list[int] | None:
    """The devices this process was told to use, or None for all of them."""
    return self._resolve()[3]

  @property
  def task_type(self) -> str:
    """TF's task type: the `job_name` given to the constructor (``'worker'``)."""
    return self._job_name

  @property
  def task_id(self) -> int:
    """TF's task id: this process's index."""
    return self.process_id

  @property
  def environment(self) -> str:
    """TF's environment string: always ``''`` (not a Google-internal environment)."""
    return ""

  def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
    """The coordinator's ``host:port`` for a multi-process job, ``''`` for one process (TF: local TPU)."""
    del task_type, task_id, rpc_layer
    coordinator, count, _, _ = self._resolve()
    return coordinator if count > 1 else ""

  get_master = master

  def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                       config_proto: Any = None) -> dict[str, int]:
    """``{'TPU' | 'GPU' | 'CPU': number of devices of this process}`` (starts JAX's backends)."""
    del task_type, task_id, config_proto
    devices = jax.local_devices()
    kind = {"tpu": "TPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU"}.get(devices[0].platform, "CPU")
    return {kind: len(devices)}

  @staticmethod
  def connect(tpu: str | None = None, zone: str | None = None, project: str | None = None) -> TPUClusterResolver:
    """TF 2.3's shortcut: builds a resolver, connects to the cluster, initialises the system, returns it."""
    resolver = TPUClusterResolver(tpu, zone, project)
    initialize_tpu_system(resolver)
    return resolver

  def __repr__(self) -> str:
    if self._resolved is None:
      return f"TPUClusterResolver(tpu={self._tpu!r})"
    coordinator, count, index, _ = self._resolved
    return (f"TPUClusterResolver(tpu={self._tpu!r}, coordinator_address={coordinator!r}, "
            f"num_processes={count}, process_id={index})")


_CONNECTED: list[tuple[str | None, int, int, Any]] = []  # what experimental_connect_to_cluster started


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # pragma: no cover - private API moved
    return False


def experimental_connect_to_cluster(cluster_spec_or_resolver: TPUClusterResolver | None = None,
                                    job_name: str = "localhost", task_index: int = 0, protocol: Any = None,
                                    make_master_device_default: bool = True,
                                    cluster_device_filters: Any = None) -> None:
  """Connects this process to the other processes of the job (TF's `tf.config.experimental_connect_to_cluster`).

  With more than one process this calls `jax.distributed.initialize` with the resolver's coordinator
  address, process count, process id, local device ids and timeouts; it must then run before JAX starts
  its backends (before the first `jax.devices()` or computation). With one process it does nothing.
  Calling it again with the same cluster is a no-op; with a different one, a `ValueError`.

  It returns once every process has connected and JAX's backends are up (with all the job's devices),
  and checks the job on the way (`tpustrat._src.distributed`): a coordinator that cannot be reached
  within the initialization timeout (`RuntimeError` naming the address), processes told different
  process counts or bringing different numbers of devices (`ValueError`, in every process). From then
  on a process that dies or hangs stops the others within the heartbeat timeout, and, when
  ``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION=1`` (the launcher sets it for its processes), an uncaught
  exception ends this process at once (status 1) instead of at JAX's shutdown barrier.

  Args:
    cluster_spec_or_resolver: a `TPUClusterResolver` (None: ``TPUClusterResolver()``).
    job_name, task_index, protocol, make_master_device_default, cluster_device_filters: accepted for TF
      compatibility; unused (JAX has no remote eager devices).

  >>> tpustrat.experimental_connect_to_cluster(tpustrat.cluster_resolver.TPUClusterResolver())  # one process: no-op
  """
  del job_name, task_index, protocol, make_master_device_default, cluster_device_filters
  resolver = cluster_spec_or_resolver if cluster_spec_or_resolver is not None else TPUClusterResolver()
  if not isinstance(resolver, TPUClusterResolver):
    raise TypeError(
        "experimental_connect_to_cluster expects a tpustrat.cluster_resolver.TPUClusterResolver, got "
        f"{type(resolver).__name__}: {resolver!r:.100}.")
  coordinator, count, index, local = resolver._resolve()  # pylint: disable=protected-access
  if count == 1:
    return
  wanted = (coordinator, count, index, None if local is None else tuple(local))
  if _CONNECTED:
    if _CONNECTED[0] != wanted:
      raise ValueError(
          f"experimental_connect_to_cluster: already connected to coordinator {_CONNECTED[0][0]!r} as "
          f"process {_CONNECTED[0][2]} of {_CONNECTED[0][1]}; cannot connect again as process {index} of "
          f"{count} at {coordinator!r}. JAX's distributed runtime is started once per process.")
    return
  if jax.distributed.is_initialized():  # started by the user's own jax.distributed.initialize
    if (jax.process_count(), jax.process_index()) != (count, index):
      raise ValueError(
          f"experimental_connect_to_cluster: JAX's distributed runtime is already running as process "
          f"{jax.process_index()} of {jax.process_count()}, but the resolver describes process {index} "
          f"of {count}.")
    _CONNECTED.append(wanted)
    return
  if _backends_initialized():
    raise RuntimeError(
        f"experimental_connect_to_cluster: {count} processes need JAX's distributed runtime, which must "
        "start before JAX initialises its backends, but they are already initialised (something called "
        "jax.devices() or ran a computation). Connect first, at the top of the program.")
  distributed_lib.initialize(coordinator, count, index, local, **resolver._runtime_options())  # pylint: disable=protected-access
  _CONNECTED.append(wanted)


def _connect_from_environment() -> None:
  """`TPUStrategy()` without a resolver joins the multi-process job that the environment describes
  (``TPUSTRAT_NUM_PROCESSES`` > 1, as `python -m tpustrat.launch` sets), unless already connected."""
  text = os.environ.get(ENV_NUM_PROCESSES, "").strip()
  if not text or text == "1" or _CONNECTED or jax.distributed.is_initialized():
    return
  experimental_connect_to_cluster(TPUClusterResolver())


def initialize_tpu_system(cluster_resolver: TPUClusterResolver | None = None) -> Topology:
  """Connects to the cluster if needed and returns the `Topology` of all its devices (TF's
  `tf.tpu.experimental.initialize_tpu_system`).

  JAX initialises devices itself when its backends start; there is no TPU system to reset. On TPU the
  topology comes from the devices' physical coordinates, elsewhere from the synthetic layout described
  in `Topology`.

  >>> topology = tpustrat.initialize_tpu_system()
  >>> topology.num_tasks, topology.num_tpus_per_task
  (1, 8)
  """
  experimental_connect_to_cluster(cluster_resolver)
  return Topology._from_devices(jax.devices())  # pylint: disable=protected-access


# -- topology -----------------------------------------------------------------------------------------


def _is_3d_generation(device: Any) -> bool:
  """Whether the TPU chip generation is wired as a 3-D torus (v4, v5p: `device_kind` ``'TPU v4'``,
  ``'TPU v5'``; later ones unless ``lite``), so that its topology has a ``z`` axis even when a slice is
  one chip deep (a v4-8). v2, v3 and the "lite" generations (v5e, v6e) are 2-D."""
  match = re.search(r"v?(\d+)\s*(\w*)", str(getattr(device, "device_kind", "")).lower().removeprefix("tpu"))
  return bool(match) and int(match.group(1)) >= 4 and match.group(2) not in ("lite", "e")


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
  coords = [((i // cores) % x, (i // cores) // x, i % cores) for i in range(num_devices)]
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

  @classmethod
  def _from_devices(cls, devices: Sequence[Any]) -> Topology:
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
    topology = cls(mesh_shape=shape, device_coordinates=np.asarray(coords).reshape(len(tasks), n, len(shape)))
    topology._devices = np.asarray(devices, dtype=object).reshape(len(tasks), n)
    return topology

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

  def _device_grid(self) -> np.ndarray:
    """``[num_replicas, num_cores_per_replica]`` object array of `jax.Device`."""
    grid = np.empty(self._core_assignment.shape[:2], dtype=object)
    for r, l in np.ndindex(*grid.shape):  # distinct: the constructor rejects two cores at one coordinate
      grid[r, l] = self.tpu_device(r, l)
    return grid

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
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
      raise ValueError(f"num_replicas must be an int >= 1; got {num_replicas!r}.")
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
      assignment = _packed_assignment(shape, stride, replica_counts, int(num_replicas))
    else:
      assignment = _task_order_assignment(topology, shape, stride, int(num_replicas))
    return DeviceAssignment(topology, assignment)

  def __repr__(self) -> str:
    return (f"DeviceAssignment(num_replicas={self.num_replicas}, "
            f"num_cores_per_replica={self.num_cores_per_replica}, topology={self._topology!r})")


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
