"""`ClusterResolver`: the base of every cluster resolver (TF's `tf.distribute.cluster_resolver.ClusterResolver`).

A resolver says what the connection (`tpustrat._src.cluster_connection`, through
`experimental_connect_to_cluster`) hands to `jax.distributed.initialize`: the coordinator's address, the
process count, this process's id and its devices (`coordinator_address`, `num_processes`, `process_id`,
`local_device_ids`), the timeouts of JAX's distributed runtime (`runtime_options`) and the step timeout,
whatever the resolver reads them from. Its subclasses: `TPUClusterResolver`
(`tpustrat._src.tpu_cluster_resolver`: arguments, ``TPUSTRAT_*`` variables or a Cloud TPU slice) and the
opt-in `SlurmClusterResolver` (`tpustrat._src.slurm_cluster_resolver`) and `TFConfigClusterResolver`
(`tpustrat._src.tfconfig_cluster_resolver`), which read a Slurm job step's variables and ``TF_CONFIG``:
nothing detects Slurm or ``TF_CONFIG`` unless one of them is constructed, as in TF.

>>> tpustrat.cluster_resolver.TPUClusterResolver().num_processes
1
"""

from __future__ import annotations

import os
from typing import Any

import jax

from tpustrat._src import names, validation, watchdog
from tpustrat._src.cluster_environment import check_address, env_int, is_loopback
from tpustrat._src.cluster_spec import ClusterSpec

__all__ = ["ClusterResolver", "runtime_options"]

# JAX's own defaults (`jax.distributed.initialize`), in seconds.
_DEFAULT_TIMEOUTS = {"initialization_timeout": 300, "heartbeat_timeout": 100, "shutdown_timeout": 300}


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
                          else check_address(coordinator_bind_address, "coordinator_bind_address", where))
    timeouts = (("initialization_timeout", initialization_timeout), ("heartbeat_timeout", heartbeat_timeout),
                ("shutdown_timeout", shutdown_timeout))
    self._timeouts = {name: None if value is None else validation.check_int(value, where, name, minimum=1)
                      for name, value in timeouts}
    self._step_timeout = None if step_timeout is None else watchdog.check_timeout(step_timeout, where)

  def _resolve(self) -> tuple[str | None, int, int, list[int] | None]:
    """(coordinator address, process count, process id, local device ids); each subclass says how."""
    raise NotImplementedError(f"{type(self).__name__} does not implement _resolve.")

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


def runtime_options(resolver: ClusterResolver) -> dict[str, Any]:
  """Keyword arguments of `jax.distributed.initialize` beyond the cluster's shape: `resolver`'s timeouts
  and the coordinator's bind address (the argument, else the environment, else a default)."""
  where = type(resolver).__name__
  timeouts = {}
  for name, env in (("initialization_timeout", names.ENV_INITIALIZATION_TIMEOUT),
                    ("heartbeat_timeout", names.ENV_HEARTBEAT_TIMEOUT),
                    ("shutdown_timeout", names.ENV_SHUTDOWN_TIMEOUT)):
    value = resolver._timeouts[name]
    if value is None:
      value = env_int(env, 1, where)
    timeouts[name] = _DEFAULT_TIMEOUTS[name] if value is None else value
  bind = (resolver._bind_address or os.environ.get(names.ENV_COORDINATOR_BIND_ADDRESS, "").strip()
          or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").strip() or None)
  if bind is None:
    coordinator = resolver._resolve()[0]
    if coordinator and is_loopback(coordinator.rsplit(":", 1)[0]):
      bind = coordinator
  else:
    check_address(bind, f"the coordinator bind address (from {names.ENV_COORDINATOR_BIND_ADDRESS} or "
                  "JAX_COORDINATOR_BIND_ADDRESS)", where)
  return {"coordinator_bind_address": bind, **timeouts}
