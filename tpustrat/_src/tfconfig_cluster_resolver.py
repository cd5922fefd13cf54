"""`TFConfigClusterResolver`: TF's `tf.distribute.cluster_resolver.TFConfigClusterResolver` on `jax.distributed`.

``TF_CONFIG`` is the JSON that Kubernetes operators, Vertex AI and hand-written scripts give each task of
a TF multi-worker job::

  {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
   "task": {"type": "worker", "index": 1}}

Opt-in, as in TF: constructed, it reads the variable once and gives `tpustrat.experimental_connect_to_cluster`
(or ``TPUStrategy(resolver)``) one JAX job of the training tasks, in TF's order (the multi-worker
strategy's): the chief first (process 0), then the workers by index. The coordinator of
`jax.distributed` is the first of them's address (its port is the coordinator's; no TF server uses it).
An ``evaluator`` task (at most one; it may be missing from ``cluster``, as in TF) is not part of the
training job: it resolves to a job of its own, one process. Parameter servers (``ps``) have no counterpart in JAX: a cluster with them is an error, as is
any other job name. No ``TF_CONFIG`` (or no ``cluster`` in it) is a one-process job.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tpustrat._src import validation
from tpustrat._src.cluster_environment import is_address
from tpustrat._src.cluster_resolver import ClusterResolver
from tpustrat._src.cluster_spec import ClusterSpec

__all__ = ["TFConfigClusterResolver"]

_WHERE = "TFConfigClusterResolver"
_ENV = "TF_CONFIG"
_TRAINING = ("chief", "worker")  # the processes of the JAX job, in this order
_KNOWN = ("chief", "worker", "evaluator", "ps")


def _bad(field: str, message: str) -> ValueError:
  return ValueError(f"{_WHERE}: {field} {message}")


def _load() -> dict[str, Any]:
  text = os.environ.get(_ENV, "")
  if not text.strip():
    return {}
  try:
    config = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{_WHERE}: {_ENV} is not valid JSON ({e}): {text!r:.300}") from None
  if not isinstance(config, dict):
    raise _bad(_ENV, f"must be a JSON object with 'cluster' and 'task', got {type(config).__name__}: "
               f"{text!r:.300}")
  return config


def _cluster(config: dict[str, Any]) -> ClusterSpec:
  """``TF_CONFIG['cluster']`` checked field by field (each error names the field)."""
  cluster = config.get("cluster", {})
  if cluster is None:
    cluster = {}
  if not isinstance(cluster, dict):
    raise _bad(f"{_ENV}['cluster']", f"must be an object {{job: [\"host:port\", ...]}}, got {cluster!r:.200}.")
  for job, tasks in cluster.items():
    field = f"{_ENV}['cluster'][{job!r}]"
    if not job:
      raise _bad(f"{_ENV}['cluster']", "has a job with an empty name.")
    if isinstance(tasks, dict):
      items = list(tasks.items())
      for index, _ in items:
        if not (validation.is_int(index) and index >= 0) and not (isinstance(index, str) and index.isdigit()):
          raise _bad(field, f"has the task index {index!r}; expected an int >= 0.")
    elif isinstance(tasks, list):
      items = list(enumerate(tasks))
    else:
      raise _bad(field, f"must be a list of \"host:port\" addresses, got {tasks!r:.200}.")
    for index, address in items:
      if not is_address(address):
        raise _bad(f"{field}[{index!r}]", f"must be a \"host:port\" address, got {address!r:.200}.")
  return ClusterSpec(cluster)


def _task(config: dict[str, Any]) -> tuple[str | None, int | None]:
  task = config.get("task", {})
  if task is None:
    task = {}
  if not isinstance(task, dict):
    raise _bad(f"{_ENV}['task']", f"must be an object {{\"type\": ..., \"index\": ...}}, got {task!r:.200}.")
  kind = task.get("type")
  if kind is not None and (not isinstance(kind, str) or not kind):
    raise _bad(f"{_ENV}['task']['type']", f"must be a job name such as 'worker', got {kind!r:.100}.")
  index = task.get("index")
  if isinstance(index, str) and index.strip().isdigit():
    index = int(index)
  if index is not None and not (validation.is_int(index) and index >= 0):
    raise _bad(f"{_ENV}['task']['index']", f"must be an int >= 0, got {index!r:.100}.")
  return kind, index


def _optional_string(config: dict[str, Any], key: str) -> str | None:
  value = config.get(key)
  if value is not None and not isinstance(value, str):
    raise _bad(f"{_ENV}[{key!r}]", f"must be a string, got {value!r:.100}.")
  return value


class TFConfigClusterResolver(ClusterResolver):
  """The processes of a job described by ``TF_CONFIG`` (TF's `tf.distribute.cluster_resolver.TFConfigClusterResolver`).

  Construct it in every task and pass it to `tpustrat.experimental_connect_to_cluster` or
  ``tpustrat.TPUStrategy(resolver)``. The module docstring says how the cluster becomes one JAX job:
  `num_processes` is the number of chief and worker tasks, `process_id` this task's place among them
  (chief, then workers by index), `coordinator_address` the first one's address. Each task uses every
  device its process sees; tasks sharing a host must each be given their own (``CUDA_VISIBLE_DEVICES``).

  TF's arguments keep their meaning: each overrides the corresponding part of ``TF_CONFIG``.

  Differences from TF: ``TF_CONFIG`` is read once, here, and checked field by field (TF reads it again on
  every call, and fails later, or not at all, on a malformed one); the overrides are read-only
  properties; `cluster_spec` is a tpustrat `ClusterSpec`; `environment` falls back to ``TF_CONFIG``'s
  ``environment`` field, then ``''`` (TF: None unless passed).

  Args:
    task_type: overrides ``TF_CONFIG['task']['type']``: ``'chief'``, ``'worker'`` or ``'evaluator'``.
    task_id: overrides ``TF_CONFIG['task']['index']``.
    rpc_layer: overrides ``TF_CONFIG['rpc_layer']``: the scheme `master` puts before an address.
    environment: overrides ``TF_CONFIG['environment']``.
    coordinator_bind_address, initialization_timeout, heartbeat_timeout, shutdown_timeout, step_timeout:
      as for `TPUClusterResolver` (keyword-only; default: the ``TPUSTRAT_*`` variables, else JAX's).

  Raises:
    ValueError: malformed ``TF_CONFIG`` (not JSON, or a field of the wrong kind: the message names it),
      a ``ps`` or unknown job, more than one chief, a task type that is not a job of the cluster, a task
      index out of range, workers not numbered ``0 .. n-1``, or two training tasks at one address.

  For example, with the ``TF_CONFIG`` of the module docstring this task is process 2 of 3, and the
  coordinator is ``host0:2222``::

    resolver = tpustrat.cluster_resolver.TFConfigClusterResolver()
    strategy = tpustrat.TPUStrategy(resolver)
  """

  def __init__(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None,
               environment: str | None = None, *, coordinator_bind_address: str | None = None,
               initialization_timeout: int | None = None, heartbeat_timeout: int | None = None,
               shutdown_timeout: int | None = None, step_timeout: float | None = None) -> None:
    super().__init__(coordinator_bind_address=coordinator_bind_address,
                     initialization_timeout=initialization_timeout, heartbeat_timeout=heartbeat_timeout,
                     shutdown_timeout=shutdown_timeout, step_timeout=step_timeout)
    if task_type is not None and (not isinstance(task_type, str) or not task_type):
      raise ValueError(f"{_WHERE}: `task_type` must be a job name such as 'worker' or None, got {task_type!r}.")
    task_id = validation.check_int(task_id, _WHERE, "task_id", minimum=0, allow_none=True)
    for name, value in (("rpc_layer", rpc_layer), ("environment", environment)):
      if value is not None and not isinstance(value, str):
        raise TypeError(f"{_WHERE}: `{name}` must be a string or None, got {value!r}.")
    config = _load()
    self._spec = _cluster(config)
    env_type, env_index = _task(config)
    self._rpc_layer = rpc_layer if rpc_layer is not None else _optional_string(config, "rpc_layer")
    self._environment = environment if environment is not None else _optional_string(config, "environment")
    self._session_master = _optional_string(config, "session_master")
    self._task_type = task_type if task_type is not None else env_type
    self._task_id = task_id if task_id is not None else env_index
    type_field = "task_type" if task_type is not None else f"{_ENV}['task']['type']"
    index_field = "task_id" if task_id is not None else f"{_ENV}['task']['index']"
    self._resolved = self._resolve_job(type_field, index_field)

  def _resolve_job(self, type_field: str, index_field: str) -> tuple[str | None, int, int, None]:
    spec, kind, index = self._spec, self._task_type, self._task_id
    if not spec:
      return None, 1, 0, None
    for job in spec.jobs:
      if job == "ps":
        raise _bad(f"{_ENV}['cluster']['ps']", "names parameter servers: JAX has no parameter-server training "
                   "(TF's ParameterServerStrategy); every task of a tpustrat job runs the same program. Describe "
                   "the job with 'chief' and 'worker' tasks only.")
      if job not in _KNOWN:
        raise _bad(f"{_ENV}['cluster'][{job!r}]", f"is not a job tpustrat knows: {', '.join(_KNOWN[:3])} "
                   "('evaluator': a separate one-process job).")
    for job in ("chief", "evaluator"):
      if job in spec.jobs and spec.num_tasks(job) > 1:
        raise _bad(f"{_ENV}['cluster'][{job!r}]", f"has {spec.num_tasks(job)} tasks; there is at most one {job} "
                   "(as in TF).")
    order: list[tuple[str, int]] = []
    for job in _TRAINING:
      if job in spec.jobs:
        tasks = spec.job_tasks(job)
        if None in tasks:
          raise _bad(f"{_ENV}['cluster'][{job!r}]", f"has no task {tasks.index(None)}; its tasks must be "
                     f"numbered 0 .. n-1 (it has {spec.task_indices(job)}).")
        order.extend((job, i) for i in range(len(tasks)))
    seen: dict[str, tuple[str, int]] = {}
    for job, i in order:
      address = spec.task_address(job, i)
      if address in seen:
        raise _bad(f"{_ENV}['cluster']", f"gives {job} {i} the address {address!r} of {seen[address][0]} "
                   f"{seen[address][1]}; every task needs its own.")
      seen[address] = (job, i)
    if kind is None:
      raise _bad(type_field, f"is not set, but {_ENV} describes a cluster ({', '.join(spec.jobs)}): say which "
                 "task this is ({\"task\": {\"type\": \"worker\", \"index\": 0}}, or task_type=... and task_id=...).")
    if kind not in spec.jobs and kind != "evaluator":  # TF lets the evaluator be missing from the cluster
      raise _bad(type_field, f"is {kind!r}, which is not a job of {_ENV}['cluster'] (jobs: {spec.jobs}).")
    if index is None:
      raise _bad(index_field, f"is not set: say which {kind} task this is.")
    if kind in spec.jobs and index not in spec.task_indices(kind):
      raise _bad(index_field, f"is {index}, out of range: {_ENV}['cluster'][{kind!r}] has the tasks "
                 f"{spec.task_indices(kind)}.")
    if kind == "evaluator":
      return None, 1, 0, None  # evaluates on its own, outside the training job (as in TF)
    if not order:  # pragma: no cover - kind is a training job of the spec, so order is not empty
      raise AssertionError("unreachable")
    return spec.task_address(*order[0]), len(order), order.index((kind, index)), None

  def _resolve(self) -> tuple[str | None, int, int, list[int] | None]:
    return self._resolved

  @property
  def task_type(self) -> str | None:
    """This task's type: the `task_type` argument, else ``TF_CONFIG['task']['type']`` (None without one)."""
    return self._task_type

  @property
  def task_id(self) -> int | None:
    """This task's index: the `task_id` argument, else ``TF_CONFIG['task']['index']`` (None without one)."""
    return self._task_id

  @property
  def rpc_layer(self) -> str | None:
    """The `rpc_layer` argument, else ``TF_CONFIG['rpc_layer']``, else None."""
    return self._rpc_layer

  @property
  def environment(self) -> str:
    """The `environment` argument, else ``TF_CONFIG['environment']``, else ``''``."""
    return self._environment or ""

  def cluster_spec(self) -> ClusterSpec:
    """The whole ``TF_CONFIG['cluster']`` (evaluator included), empty without one."""
    return ClusterSpec(self._spec)

  def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
    """TF's `master`: ``TF_CONFIG['session_master']`` if set; ``''`` for a cluster of at most one task;
    else the address of a task (default: this one) as ``rpc_layer://host:port``."""
    if self._session_master is not None:
      return self._session_master
    spec = self._spec
    if not spec.jobs or (len(spec.jobs) == 1 and spec.num_tasks(spec.jobs[0]) == 1):
      return ""
    task_type = self._task_type if task_type is None else task_type
    task_id = self._task_id if task_id is None else task_id
    if task_type is None or task_id is None:  # no task given, and TF_CONFIG names none
      raise ValueError(f"No task with index {task_id!r} in job {task_type!r}")
    address = spec.task_address(task_type, task_id)
    layer = self._rpc_layer if rpc_layer is None else rpc_layer
    return f"{layer}://{address}" if layer else address

  def __repr__(self) -> str:
    coordinator, count, index, _ = self._resolved
    return (f"TFConfigClusterResolver(task_type={self._task_type!r}, task_id={self._task_id!r}, "
            f"coordinator_address={coordinator!r}, num_processes={count}, process_id={index})")
