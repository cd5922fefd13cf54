"""Connecting to the cluster, TF's way: `experimental_connect_to_cluster` (TF's
`tf.config.experimental_connect_to_cluster`) and `initialize_tpu_system` (TF's
`tf.tpu.experimental.initialize_tpu_system`), with a `TPUClusterResolver` when given no resolver; and how
the strategies connect and name their job (`connect_from_environment`, `current_resolver`).

* `experimental_connect_to_cluster` starts JAX's distributed runtime (`jax.distributed.initialize`) when
  more than one process is involved; for one process it does nothing. Calling it again is a no-op. The
  connection itself, started once per process, is `tpustrat._src.cluster_connection`.
* `initialize_tpu_system` returns the `Topology` (`tpustrat._src.topology`) of every device of the job.
  On TPU it is built from the devices' physical coordinates (``device.coords`` and
  ``device.core_on_chip``); elsewhere from a synthetic layout (see `Topology`).

>>> tpustrat.initialize_tpu_system(tpustrat.cluster_resolver.TPUClusterResolver()).mesh_shape.tolist()
[2, 2, 2]
"""

from __future__ import annotations

import os
from typing import Any

import jax

from tpustrat._src import cluster_connection, jax_compat, names, watchdog
from tpustrat._src.cluster_resolver import ClusterResolver
from tpustrat._src.topology import Topology, topology_of_devices
from tpustrat._src.tpu_cluster_resolver import TPUClusterResolver, resolver_of_running_job

__all__ = [
    "connect_from_environment",
    "current_resolver",
    "experimental_connect_to_cluster",
    "initialize_tpu_system",
]


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
  cluster_connection.connect(resolver)


def connect_from_environment() -> None:
  """`TPUStrategy()` without a resolver joins the multi-process job that the environment describes
  (``TPUSTRAT_NUM_PROCESSES`` > 1, as `python -m tpustrat.launch` sets), unless already connected."""
  text = os.environ.get(names.ENV_NUM_PROCESSES, "").strip()
  if cluster_connection.is_connected() or jax.distributed.is_initialized():
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
  connected = cluster_connection.connected_resolver()
  if connected is not None and connected.num_processes == count:
    return connected
  coordinator = jax_compat.coordinator_address() if count > 1 else None
  return resolver_of_running_job(coordinator, count, jax.process_index())  # the running job, as it is


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
