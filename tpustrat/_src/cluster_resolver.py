"""The cluster and the connection to it: TF's `TPUClusterResolver`, `tf.config.experimental_connect_to_cluster`
and `tf.tpu.experimental.initialize_tpu_system` on JAX.

TF finds its TPUs through a cluster resolver, connects to them (`tf.config.experimental_connect_to_cluster`)
and initialises the TPU system, which returns a `Topology` (`tpustrat._src.topology`). tpustrat keeps those
names and meanings:

* `ClusterResolver` is the base of every resolver (TF's `tf.distribute.cluster_resolver.ClusterResolver`):
  what `experimental_connect_to_cluster` reads from one (`coordinator_address`, `num_processes`,
  `process_id`, `local_device_ids`, the timeouts of JAX's distributed runtime and the step timeout),
  whatever the resolver reads it from. `ClusterSpec` is TF's job-name-to-addresses map, without protos.
* `TPUClusterResolver` describes the processes of a job. One process (a laptop, a GPU box, a single TPU
  VM) needs nothing. For several processes it takes a coordinator address, a process count and a process
  id (arguments, or the environment variables ``TPUSTRAT_COORDINATOR_ADDRESS``,
  ``TPUSTRAT_NUM_PROCESSES``, ``TPUSTRAT_PROCESS_ID``, ``TPUSTRAT_LOCAL_DEVICE_IDS``); on a multi-host
  Cloud TPU slice it asks JAX's own TPU cluster detection.
* `SlurmClusterResolver` (`tpustrat._src.slurm_cluster_resolver`) and `TFConfigClusterResolver`
  (`tpustrat._src.tfconfig_cluster_resolver`) read a Slurm job step's variables and ``TF_CONFIG``; they
  are opt-in, as in TF: nothing detects Slurm or ``TF_CONFIG`` unless one of them is constructed.
* `experimental_connect_to_cluster` starts JAX's distributed runtime (`jax.distributed.initialize`) when
  more than one process is involved; for one process it does nothing. Calling it again is a no-op.
* `initialize_tpu_system` returns the `Topology` of every device of the job. On TPU it is built from the
  devices' physical coordinates (``device.coords`` and ``device.core_on_chip``); elsewhere from a
  synthetic layout (see `Topology`).

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
import numpy as np

from tpustrat._src import distributed as distributed_lib
from tpustrat._src import jax_compat, names, validation, watchdog
from tpustrat._src.topology import Topology, topology_of_devices

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "TPUClusterResolver",
    "connect_from_environment",
    "current_resolver",
    "experimental_connect_to_cluster",
    "initialize_tpu_system",
]

_WHERE = "TPUClusterResolver"  # where argument errors say they come from
# JAX's own defaults (`jax.distributed.initialize`), in seconds.
_DEFAULT_TIMEOUTS = {"initialization_timeout": 300, "heartbeat_timeout": 100, "shutdown_timeout": 300}

# -- cluster resolver ---------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
  host = host.strip("[]")
  return host == "localhost" or host == "::1" or host.startswith("127.")


def _check_address(value: Any, what: str, where: str = _WHERE) -> str:
  if not is_address(value):
    raise ValueError(f"{where}: {what} must be a 'host:port' string, got {value!r}.")
  return value


def is_address(value: Any) -> bool:
  """Whether `value` is a ``host:port`` string: a non-empty host without white space or control characters
  (an IPv6 host in brackets, ``[::1]:80``), and a port of ASCII digits in [0, 65535].

  >>> is_address("10.0.0.1:8476"), is_address("[::1]:80"), is_address("h 1:1"), is_address("h:port")
  (True, True, False, False)
  """
  if not isinstance(value, str):
    return False
  host, sep, port = value.rpartition(":")
  if not (sep and port.isascii() and port.isdigit() and int(port) <= 65535):
    return False
  if host.startswith("[") or host.endswith("]"):  # an IPv6 address: [::1]
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
  return bool(host) and host.isprintable() and not any(ch.isspace() or ch in "[]" for ch in host)


def _check_ids(value: Any) -> list[int]:
  if validation.is_int(value):
    return [validation.check_int(value, _WHERE, "local_device_ids", minimum=0)]
  if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
    raise ValueError(
        f"TPUClusterResolver: local_device_ids must be an int or a sequence of ints >= 0, got {value!r}.")
  return [validation.check_int(v, _WHERE, f"local_device_ids[{i}]", minimum=0) for i, v in enumerate(value)]


def _env_int(name: str, minimum: int, where: str = _WHERE) -> int | None:
  text = os.environ.get(name, "").strip()
  if not text:
    return None
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value < minimum:
    raise ValueError(f"{where}: environment variable {name}={text!r} must be an int >= {minimum}.")
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


class ClusterSpec:
  """Job names and their tasks' ``host:port`` addresses: TF's `tf.train.ClusterSpec`, without protos.

  `SlurmClusterResolver.cluster_spec` and `TFConfigClusterResolver.cluster_spec` return one. It has TF's
  read-only queries (`jobs`, `num_tasks`, `task_indices`, `task_address`, `job_tasks`, `as_dict`) and
  compares equal to another `ClusterSpec` with the same jobs and tasks. It has no `as_cluster_def`: there
  is no TF server to give a proto to. tpustrat's connection never reads it: `experimental_connect_to_cluster`
  uses the resolver's `coordinator_address` (the first task's address), `num_processes` and `process_id`.

  A job described only by its coordinator, its process count and a process id (`TPUClusterResolver`'s
  arguments or ``TPUSTRAT_*`` variables, as the launcher sets them) has tasks whose addresses no process
  knows: JAX's runtime reaches every process through the coordinator. `TPUClusterResolver.cluster_spec`
  lists such tasks with the address None (task 0's is the coordinator's); `task_address` of one raises.

  Args:
    cluster: ``{job name: [address, ...]}`` (task ``i`` at position ``i``) or ``{job name: {index:
      address}}`` (sparse, as TF allows; indices may be ints or decimal strings, as JSON writes them), or
      a `ClusterSpec`.

  >>> spec = ClusterSpec({"worker": ["w0:2222", "w1:2222"], "chief": ["c:2222"]})
  >>> spec.jobs, spec.num_tasks("worker"), spec.task_address("worker", 1)
  (['chief', 'worker'], 2, 'w1:2222')
  >>> spec.as_dict()
  {'chief': ['c:2222'], 'worker': ['w0:2222', 'w1:2222']}
  """

  def __init__(self, cluster: Any) -> None:
    if isinstance(cluster, ClusterSpec):
      self._jobs: dict[str, dict[int, str | None]] = {job: dict(tasks) for job, tasks in cluster._jobs.items()}
      return
    if not isinstance(cluster, dict):
      raise TypeError(f"ClusterSpec: expected a dict {{job name: [address, ...]}}, got {cluster!r:.200}.")
    self._jobs = {}
    for job, tasks in cluster.items():
      if not isinstance(job, str) or not job:
        raise ValueError(f"ClusterSpec: job names must be non-empty strings, got {job!r}.")
      if isinstance(tasks, dict):
        items = []
        for index, address in tasks.items():
          if isinstance(index, str) and index.isdigit():
            index = int(index)
          if not validation.is_int(index) or index < 0:
            raise ValueError(f"ClusterSpec: job {job!r} has a task index {index!r}; expected an int >= 0.")
          items.append((int(index), address))
      elif isinstance(tasks, (list, tuple)):
        items = list(enumerate(tasks))
      else:
        raise ValueError(
            f"ClusterSpec: job {job!r} must map to a list of 'host:port' addresses (or a dict "
            f"{{task index: address}}), got {tasks!r:.200}.")
      for index, address in items:
        if not is_address(address):
          raise ValueError(
              f"ClusterSpec: task {index} of job {job!r} must be a 'host:port' address, got {address!r}.")
      if len({index for index, _ in items}) != len(items):
        raise ValueError(f"ClusterSpec: job {job!r} names a task index twice: {tasks!r:.200}.")
      self._jobs[job] = dict(sorted(items))

  @classmethod
  def _of_processes(cls, job: str, coordinator: str | None, count: int) -> ClusterSpec:
    """`count` tasks of `job` whose addresses are unknown, but task 0's: the coordinator's (internal)."""
    spec = cls({})
    spec._jobs = {job: {i: coordinator if i == 0 else None for i in range(count)}}
    return spec

  @property
  def jobs(self) -> list[str]:
    """The job names, sorted (as TF's `ClusterSpec.jobs`)."""
    return sorted(self._jobs)

  def _job(self, job_name: str) -> dict[int, str | None]:
    try:
      return self._jobs[job_name]
    except KeyError:
      raise ValueError(f"No such job in cluster: {job_name!r}") from None

  def num_tasks(self, job_name: str) -> int:
    """The number of tasks of `job_name`."""
    return len(self._job(job_name))

  def task_indices(self, job_name: str) -> list[int]:
    """The task indices of `job_name`, sorted."""
    return list(self._job(job_name))

  def task_address(self, job_name: str, task_index: int) -> str:
    """The ``host:port`` of task `task_index` of `job_name` (a `ValueError` if there is no such task, or if
    its address is not known: see the class docstring)."""
    try:
      address = self._job(job_name)[task_index]
    except KeyError:
      raise ValueError(f"No task with index {task_index!r} in job {job_name!r}") from None
    if address is None:
      raise ValueError(
          f"The address of task {task_index} of job {job_name!r} is not known to this process: the job was "
          "described by its coordinator, process count and process id only (TPUSTRAT_* variables or "
          "TPUClusterResolver's arguments), and JAX's runtime reaches every process through the coordinator.")
    return address

  def job_tasks(self, job_name: str) -> list[str | None]:
    """The addresses of `job_name`'s tasks, by index, with None where a sparse job has no task (or where
    the task's address is not known)."""
    tasks = self._job(job_name)
    if not tasks:
      return []
    return [tasks.get(i) for i in range(max(tasks) + 1)]

  def as_dict(self) -> dict[str, list[str | None] | dict[int, str | None]]:
    """``{job: [addresses]}``, or ``{job: {index: address}}`` for a sparse job (as TF's `as_dict`); an
    address not known is None."""
    out: dict[str, list[str | None] | dict[int, str | None]] = {}
    for job in self.jobs:
      tasks = self._jobs[job]
      out[job] = list(tasks.values()) if list(tasks) == list(range(len(tasks))) else dict(tasks)
    return out

  def __bool__(self) -> bool:
    return bool(self._jobs)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ClusterSpec) and self._jobs == other._jobs

  def __hash__(self) -> int:
    return hash(tuple((job, tuple(tasks.items())) for job, tasks in sorted(self._jobs.items())))

  def __repr__(self) -> str:
    return f"ClusterSpec({self.as_dict()!r})"


class ClusterResolver:
  """The base of tpustrat's cluster resolvers (TF's `tf.distribute.cluster_resolver.ClusterResolver`).

  A resolver says what `experimental_connect_to_cluster` (and so ``TPUStrategy(resolver)``) hands to
  `jax.distributed.initialize`: the coordinator's ``host:port`` (process 0 runs it), the number of
  processes, this process's id and, optionally, the devices this process uses. Each subclass reads them
  from somewhere else (`TPUClusterResolver`: arguments, ``TPUSTRAT_*`` variables or a Cloud TPU slice;
  `SlurmClusterResolver`: a Slurm job step; `TFConfigClusterResolver`: ``TF_CONFIG``) and implements
  `_resolve`; the connection code reads only the properties below, so it treats every resolver alike.

  The keyword-only arguments set how the processes watch each other (seconds; when an argument is None,
  the variable in brackets, else JAX's default): ``initialization_timeout``
  [``TPUSTRAT_INITIALIZATION_TIMEOUT``; 300], ``heartbeat_timeout`` [``TPUSTRAT_HEARTBEAT_TIMEOUT``; 100],
  ``shutdown_timeout`` [``TPUSTRAT_SHUTDOWN_TIMEOUT``; 300], ``coordinator_bind_address``
  [``TPUSTRAT_COORDINATOR_BIND_ADDRESS`` or ``JAX_COORDINATOR_BIND_ADDRESS``; the coordinator address
  itself when it is a loopback address, else every interface] and ``step_timeout``
  [``TPUSTRAT_STEP_TIMEOUT``; off]; `TPUClusterResolver` describes each.
  """

  def __init__(self, *, coordinator_bind_address: str | None = None, initialization_timeout: int | None = None,
               heartbeat_timeout: int | None = None, shutdown_timeout: int | None = None,
               step_timeout: float | None = None) -> None:
    where = type(self).__name__
    self._bind_address = (None if coordinator_bind_address is None
                          else _check_address(coordinator_bind_address, "coordinator_bind_address", where))
    timeouts = (("initialization_timeout", initialization_timeout), ("heartbeat_timeout", heartbeat_timeout),
                ("shutdown_timeout", shutdown_timeout))
    self._timeouts = {name: None if value is None else validation.check_int(value, where, name, minimum=1)
                      for name, value in timeouts}
    self._step_timeout = None if step_timeout is None else watchdog.check_timeout(step_timeout, where)

  def _resolve(self) -> tuple[str | None, int, int, list[int] | None]:
    """(coordinator address, process count, process id, local device ids); each subclass says how."""
    raise NotImplementedError(f"{type(self).__name__} does not implement _resolve.")

  def _runtime_options(self) -> dict[str, Any]:
    """Keyword arguments of `jax.distributed.initialize` beyond the cluster's shape: timeouts, bind address."""
    where = type(self).__name__
    timeouts = {}
    for name, env in (("initialization_timeout", names.ENV_INITIALIZATION_TIMEOUT),
                      ("heartbeat_timeout", names.ENV_HEARTBEAT_TIMEOUT),
                      ("shutdown_timeout", names.ENV_SHUTDOWN_TIMEOUT)):
      value = self._timeouts[name]
      if value is None:
        value = _env_int(env, 1, where)
      timeouts[name] = _DEFAULT_TIMEOUTS[name] if value is None else value
    bind = (self._bind_address or os.environ.get(names.ENV_COORDINATOR_BIND_ADDRESS, "").strip()
            or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").strip() or None)
    if bind is None:
      coordinator = self._resolve()[0]
      if coordinator and _is_loopback(coordinator.rsplit(":", 1)[0]):
        bind = coordinator
    else:
      _check_address(bind, f"the coordinator bind address (from {names.ENV_COORDINATOR_BIND_ADDRESS} or "
                     "JAX_COORDINATOR_BIND_ADDRESS)", where)
    return {"coordinator_bind_address": bind, **timeouts}

  @property
  def step_timeout(self) -> float | None:
    """Seconds a step may wait for its peers before the job is stopped (None: no step watchdog); the
    argument, else ``TPUSTRAT_STEP_TIMEOUT``."""
    if self._step_timeout is not None:
      return self._step_timeout
    return watchdog.timeout_from_environment()

  @property
  def coordinator_address(self) -> str | None:
    """``host:port`` of the coordinator (process 0 runs it), or None for a one-process job without one."""
    return self._resolve()[0]

  @property
  def num_processes(self) -> int:
    """Number of processes in the job."""
    return self._resolve()[1]

  @property
  def process_id(self) -> int:
    """This process's index in the job, ``0 <= process_id < num_processes``."""
    return self._resolve()[2]

  @property
  def local_device_ids(self) -> list[int] | None:
    """The devices this process uses (ids as `jax.distributed.initialize` takes them), or None for all."""
    return self._resolve()[3]

  @property
  def environment(self) -> str:
    """TF's environment string: ``''`` (not a Google-internal environment)."""
    return ""

  @property
  def task_type(self) -> str | None:
    """TF's task type of this process (``'worker'`` unless the resolver says otherwise)."""
    return "worker"

  @property
  def task_id(self) -> int | None:
    """TF's task id of this process: its index in the job, unless the resolver says otherwise."""
    return self.process_id

  def cluster_spec(self) -> ClusterSpec:
    """TF's `cluster_spec`: the job's tasks by job name (`ClusterSpec`); each resolver says how."""
    raise NotImplementedError(f"{type(self).__name__} does not implement cluster_spec.")

  def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                       config_proto: Any = None) -> dict[str, int]:
    """``{'TPU' | 'GPU' | 'CPU': number of devices of this process}`` (starts JAX's backends)."""
    del task_type, task_id, config_proto
    devices = jax.local_devices()
    kind = {"tpu": "TPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU"}.get(devices[0].platform, "CPU")
    return {kind: len(devices)}


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
        None if coordinator_address is None else _check_address(coordinator_address, "coordinator_address"),
        None if num_processes is None else validation.check_int(num_processes, _WHERE, "num_processes",
                                                                minimum=1),
        None if process_id is None else validation.check_int(process_id, _WHERE, "process_id", minimum=0),
        None if local_device_ids is None else _check_ids(local_device_ids),
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
      count = _env_int(names.ENV_NUM_PROCESSES, 1)
    if index is None:
      index = _env_int(names.ENV_PROCESS_ID, 0)
    if local is None:
      local = _env_ids(names.ENV_LOCAL_DEVICE_IDS)
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
    return ClusterSpec._of_processes(self._job_name, coordinator, count)  # pylint: disable=protected-access

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
    initialize_tpu_system(resolver)
    return resolver

  def __repr__(self) -> str:
    if self._resolved is None:
      return f"TPUClusterResolver(tpu={self._tpu!r})"
    coordinator, count, index, _ = self._resolved
    return (f"TPUClusterResolver(tpu={self._tpu!r}, coordinator_address={coordinator!r}, "
            f"num_processes={count}, process_id={index})")


_CONNECTED: list[tuple[str | None, int, int, Any]] = []  # what experimental_connect_to_cluster started
_RESOLVER: list[ClusterResolver] = []  # the resolver this process connected with (the newest, for one process)
_CONNECTED_ONE: list[list[int]] = []  # the local devices a one-process job was restricted to, if any


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # pragma: no cover - private API moved
    return False


def _restrict_local_devices(local: list[int]) -> None:
  """A one-process job's `local_device_ids`: what `jax.distributed.initialize` does with them for several
  (JAX's ``jax_cuda_visible_devices`` / ``jax_rocm_visible_devices``; no effect on CPU and TPU)."""
  if _backends_initialized():
    raise RuntimeError(
        f"experimental_connect_to_cluster: the resolver gives this process the devices {local} "
        "(local_device_ids), which must be chosen before JAX initialises its backends, but they are "
        "already initialised (something called jax.devices() or ran a computation). Connect first, at the "
        "top of the program.")
  visible = ",".join(str(i) for i in local)
  jax.config.update("jax_cuda_visible_devices", visible)
  jax.config.update("jax_rocm_visible_devices", visible)


def experimental_connect_to_cluster(cluster_spec_or_resolver: ClusterResolver | None = None,
                                    job_name: str = "localhost", task_index: int = 0, protocol: Any = None,
                                    make_master_device_default: bool = True,
                                    cluster_device_filters: Any = None) -> None:
  """Connects this process to the other processes of the job (TF's `tf.config.experimental_connect_to_cluster`).

  With more than one process this calls `jax.distributed.initialize` with the resolver's coordinator
  address, process count, process id, local device ids and timeouts; it must then run before JAX starts
  its backends (before the first `jax.devices()` or computation). With one process it starts nothing,
  but a resolver that names this process's devices (`local_device_ids`, e.g. a one-task Slurm step with
  ``gpus_per_task`` of the node's GPUs) restricts JAX's GPUs to them as `jax.distributed.initialize`
  would (then it too must run before the backends start). Calling it again with the same cluster is a
  no-op; with a different one, a `ValueError`. Any `ClusterResolver` will do (`TPUClusterResolver`,
  `SlurmClusterResolver`, `TFConfigClusterResolver`): only its `coordinator_address`, `num_processes`,
  `process_id`, `local_device_ids`, timeouts and `step_timeout` are read.

  It returns once every process has connected and JAX's backends are up (with all the job's devices),
  and checks the job on the way (`tpustrat._src.distributed`): a coordinator that cannot be reached
  within the initialization timeout (`RuntimeError` naming the address), processes told different
  process counts or bringing different numbers of devices (`ValueError`, in every process). From then
  on a process that dies or hangs stops the others within the heartbeat timeout, and, when
  ``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION=1`` (the launcher sets it for its processes), an uncaught
  exception ends this process at once (status 1; 75 when process 0 finds the coordinator's port taken,
  `names.EXIT_START_FAILED`, from which the launcher knows to try another port) instead of at JAX's
  shutdown barrier. With a step timeout (the resolver's `step_timeout`, ``TPUSTRAT_STEP_TIMEOUT``) it
  starts the step watchdog, one-process jobs included.

  Args:
    cluster_spec_or_resolver: a `ClusterResolver` (None: ``TPUClusterResolver()``).
    job_name, task_index, protocol, make_master_device_default, cluster_device_filters: accepted for TF
      compatibility; unused (JAX has no remote eager devices).

  >>> tpustrat.experimental_connect_to_cluster(tpustrat.cluster_resolver.TPUClusterResolver())  # one process: no-op
  """
  del job_name, task_index, protocol, make_master_device_default, cluster_device_filters
  resolver = cluster_spec_or_resolver if cluster_spec_or_resolver is not None else TPUClusterResolver()
  if not isinstance(resolver, ClusterResolver):
    raise TypeError(
        "experimental_connect_to_cluster expects a tpustrat.cluster_resolver resolver (TPUClusterResolver, "
        f"SlurmClusterResolver, TFConfigClusterResolver), got {type(resolver).__name__}: {resolver!r:.100}.")
  coordinator, count, index, local = (resolver.coordinator_address, resolver.num_processes, resolver.process_id,
                                      resolver.local_device_ids)
  step_timeout = resolver.step_timeout
  if count == 1:
    if local is not None and _CONNECTED_ONE != [local]:
      _restrict_local_devices(local)
      _CONNECTED_ONE[:] = [local]
    if step_timeout is not None:
      watchdog.start(step_timeout, process_index=0, process_count=1)
    if not _CONNECTED:
      _RESOLVER[:] = [resolver]
    return
  assert coordinator is not None  # a resolver gives every multi-process job a coordinator
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
    _RESOLVER[:] = [resolver]
    if step_timeout is not None:
      watchdog.start(step_timeout, process_index=index, process_count=count)
    return
  if _backends_initialized():
    raise RuntimeError(
        f"experimental_connect_to_cluster: {count} processes need JAX's distributed runtime, which must "
        "start before JAX initialises its backends, but they are already initialised (something called "
        "jax.devices() or ran a computation). Connect first, at the top of the program.")
  distributed_lib.initialize(coordinator, count, index, local, **resolver._runtime_options())  # pylint: disable=protected-access
  _CONNECTED.append(wanted)
  _RESOLVER[:] = [resolver]
  if step_timeout is not None:
    watchdog.start(step_timeout, process_index=index, process_count=count)


def connect_from_environment() -> None:
  """`TPUStrategy()` without a resolver joins the multi-process job that the environment describes
  (``TPUSTRAT_NUM_PROCESSES`` > 1, as `python -m tpustrat.launch` sets), unless already connected."""
  text = os.environ.get(names.ENV_NUM_PROCESSES, "").strip()
  if _CONNECTED or jax.distributed.is_initialized():
    return
  if not text or text == "1":
    step_timeout = watchdog.timeout_from_environment()
    if step_timeout is not None:  # one process: only the step watchdog to start
      watchdog.start(step_timeout, process_index=0, process_count=1)
    return
  experimental_connect_to_cluster(TPUClusterResolver())


def current_resolver() -> ClusterResolver:
  """The resolver that describes this process's job, for `Strategy.cluster_resolver` when a strategy was
  given none: the one `experimental_connect_to_cluster` connected with (every strategy connects through
  it); else, when JAX's distributed runtime was started directly (`jax.distributed.initialize`), a
  `TPUClusterResolver` of that job; else a `TPUClusterResolver` of this one process. Never None.

  >>> current_resolver().task_type, current_resolver().task_id, current_resolver().num_processes
  ('worker', 0, 1)
  """
  count = jax.process_count()
  if _RESOLVER and _RESOLVER[0].num_processes == count:
    return _RESOLVER[0]
  resolver = TPUClusterResolver(tpu="local")
  coordinator = jax_compat.coordinator_address() if count > 1 else None
  resolver._resolved = (coordinator, count, jax.process_index(), None)  # the running job, as it is
  return resolver


def initialize_tpu_system(cluster_resolver: ClusterResolver | None = None) -> Topology:
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
  return topology_of_devices(jax.devices())
