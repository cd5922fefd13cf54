"""`TPUClusterResolver`: TF's `tf.distribute.cluster_resolver.TPUClusterResolver` on JAX.

TF finds its TPUs through this resolver. JAX runs on TPU VMs, so it describes the processes of a job: one
process (a laptop, a GPU box, a single TPU VM) needs nothing; several take a coordinator address, a
process count and a process id (arguments, or the environment variables ``TPUSTRAT_COORDINATOR_ADDRESS``,
``TPUSTRAT_NUM_PROCESSES``, ``TPUSTRAT_PROCESS_ID``, ``TPUSTRAT_LOCAL_DEVICE_IDS``, read through
`tpustrat._src.cluster_environment`); on a multi-host Cloud TPU slice it asks JAX's own TPU cluster
detection. It is the default resolver of `experimental_connect_to_cluster` and of the strategies
(`tpustrat._src.connect_to_cluster`).

>>> resolver = tpustrat.cluster_resolver.TPUClusterResolver()
>>> resolver.num_processes, resolver.process_id
(1, 0)
>>> tpustrat.initialize_tpu_system(resolver).mesh_shape.tolist()
[2, 2, 2]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax

from tpustrat._src import cluster_connection, cluster_environment, names, validation
from tpustrat._src.cluster_environment import check_address, check_device_ids, env_device_ids, env_int
from tpustrat._src.cluster_resolver import ClusterResolver
from tpustrat._src.cluster_spec import ClusterSpec, spec_of_processes
from tpustrat._src.topology import topology_of_devices

__all__ = ["TPUClusterResolver", "resolver_of_running_job"]

_WHERE = "TPUClusterResolver"  # where argument errors say they come from


class TPUClusterResolver(ClusterResolver):
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

  A process that is alive but stuck keeps its heartbeats going; the step watchdog catches it:

  * ``step_timeout`` / ``TPUSTRAT_STEP_TIMEOUT`` (``python -m tpustrat.launch --step-timeout``) [off]:
    when a step (`run`, `experimental_run_steps`, or a cross-replica `reduce`) has waited this long for
    its peers, every process of the job exits with status 124, and the output names the processes that
    are behind and the last step each reached (`tpustrat._src.watchdog`). Started by
    `experimental_connect_to_cluster` (and so by ``TPUStrategy(resolver)``), one process jobs included.

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
    coordinator_bind_address, initialization_timeout, heartbeat_timeout, shutdown_timeout, step_timeout:
      see above (keyword-only).

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
               heartbeat_timeout: int | None = None, shutdown_timeout: int | None = None,
               step_timeout: float | None = None) -> None:
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
        None if coordinator_address is None else check_address(coordinator_address, "coordinator_address", _WHERE),
        None if num_processes is None else validation.check_int(num_processes, _WHERE, "num_processes",
                                                                minimum=1),
        None if process_id is None else validation.check_int(process_id, _WHERE, "process_id", minimum=0),
        None if local_device_ids is None else check_device_ids(local_device_ids, _WHERE),
    )
    self._resolved: tuple[str | None, int, int, list[int] | None] | None = None
    super().__init__(coordinator_bind_address=coordinator_bind_address,
                     initialization_timeout=initialization_timeout, heartbeat_timeout=heartbeat_timeout,
                     shutdown_timeout=shutdown_timeout, step_timeout=step_timeout)
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
      coordinator = (os.environ.get(names.ENV_COORDINATOR_ADDRESS, "").strip()
                     or os.environ.get("JAX_COORDINATOR_ADDRESS", "").strip() or None)
    if count is None:
      count = env_int(names.ENV_NUM_PROCESSES, 1, _WHERE)
    if index is None:
      index = env_int(names.ENV_PROCESS_ID, 0, _WHERE)
    if local is None:
      local = env_device_ids(names.ENV_LOCAL_DEVICE_IDS, _WHERE)
    if count is None and index is None and self._tpu != "local":
      detected = cluster_environment.detect_cluster()
      if detected is not None:
        found, count, index = detected
        coordinator = coordinator or found
    count = 1 if count is None else count
    index = 0 if index is None else index
    if not 0 <= index < count:
      raise ValueError(
          f"TPUClusterResolver: process id {index} is out of range for {count} processes; expected "
          f"0 <= process_id < num_processes (set num_processes / {names.ENV_NUM_PROCESSES}).")
    if count > 1 and not coordinator:
      raise ValueError(
          f"TPUClusterResolver: {count} processes need a coordinator address ('host:port' of process "
          f"0): pass coordinator_address=... or set {names.ENV_COORDINATOR_ADDRESS}.")
    self._resolved = (coordinator, count, index, local)
    return self._resolved

  @property
  def tpu(self) -> str | None:
    """The `tpu` argument."""
    return self._tpu

  @property
  def task_type(self) -> str:
    """TF's task type: the `job_name` given to the constructor (``'worker'``)."""
    return self._job_name

  @property
  def task_id(self) -> int:
    """TF's task id: this process's index."""
    return self.process_id

  def cluster_spec(self) -> ClusterSpec:
    """TF's `cluster_spec`: empty for one process (TF's answer for a local TPU); for several,
    ``{task_type: one task per process}``, task ``i`` being process ``i``. Only task 0's address is known
    (the coordinator's): the others' are None, since nothing in the job tells one process where the others
    are (see `ClusterSpec`). So TF's checks read as in TF: ``cluster_spec.num_tasks('worker')`` is the
    process count and ``'chief' not in cluster_spec.as_dict()``.

    >>> TPUClusterResolver(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1).cluster_spec()
    ClusterSpec({'worker': ['10.0.0.1:1234', None]})
    """
    coordinator, count, _, _ = self._resolve()
    if count == 1:
      return ClusterSpec({})
    return spec_of_processes(self._job_name, coordinator, count)

  def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
    """The coordinator's ``host:port`` for a multi-process job, ``''`` for one process (TF: local TPU)."""
    del task_type, task_id, rpc_layer
    coordinator, count, _, _ = self._resolve()
    return coordinator if count > 1 and coordinator is not None else ""

  get_master = master

  @staticmethod
  def connect(tpu: str | None = None, zone: str | None = None, project: str | None = None) -> TPUClusterResolver:
    """TF 2.3's shortcut: builds a resolver, connects to the cluster, initialises the system, returns it."""
    resolver = TPUClusterResolver(tpu, zone, project)
    # `initialize_tpu_system(resolver)`, which lives above this module (it defaults to a TPUClusterResolver):
    cluster_connection.connect(resolver)
    topology_of_devices(jax.devices())
    return resolver

  def __repr__(self) -> str:
    if self._resolved is None:
      return f"TPUClusterResolver(tpu={self._tpu!r})"
    coordinator, count, index, _ = self._resolved
    return (f"TPUClusterResolver(tpu={self._tpu!r}, coordinator_address={coordinator!r}, "
            f"num_processes={count}, process_id={index})")


def resolver_of_running_job(coordinator: str | None, count: int, index: int) -> TPUClusterResolver:
  """A `TPUClusterResolver` of a job already running (JAX's distributed runtime started directly), as it
  is: process `index` of `count`, with the coordinator at `coordinator`; nothing read or checked again."""
  resolver = TPUClusterResolver(tpu="local")
  resolver._resolved = (coordinator, count, index, None)
  return resolver
