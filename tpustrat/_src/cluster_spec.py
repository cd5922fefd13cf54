"""`ClusterSpec`: TF's `tf.train.ClusterSpec`, job names and their tasks' ``host:port`` addresses.

A resolver's `cluster_spec()` returns one (`tpustrat._src.cluster_resolver`). tpustrat's connection never
reads it: `experimental_connect_to_cluster` uses the resolver's coordinator, process count and process id.
`spec_of_processes` is the spec of a job known only by those three (`TPUClusterResolver`'s).

>>> spec_of_processes("worker", "10.0.0.1:1234", 2)
ClusterSpec({'worker': ['10.0.0.1:1234', None]})
"""

from __future__ import annotations

from typing import Any

from tpustrat._src import validation
from tpustrat._src.cluster_environment import is_address

__all__ = ["ClusterSpec", "spec_of_processes"]


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


def spec_of_processes(job: str, coordinator: str | None, count: int) -> ClusterSpec:
  """`count` tasks of `job` whose addresses are not known, but task 0's: the coordinator's (see
  `ClusterSpec`)."""
  spec = ClusterSpec({})
  spec._jobs = {job: {i: coordinator if i == 0 else None for i in range(count)}}
  return spec
