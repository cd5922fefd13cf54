"""`SlurmClusterResolver`: TF's `tf.distribute.cluster_resolver.SlurmClusterResolver` on `jax.distributed`.

Opt-in, as in TF: constructed inside a Slurm job step (one process per task, ``srun``), it reads the
step's variables and gives `tpustrat.experimental_connect_to_cluster` (or ``TPUStrategy(resolver)``)
what `jax.distributed.initialize` needs:

* the process count: the step's tasks (``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS``), which must
  equal the sum of TF's ``jobs`` when given, and the tasks per node;
* the process id: ``SLURM_PROCID``;
* the coordinator: the first node of the step's node list (``SLURM_STEP_NODELIST``, else
  ``SLURM_JOB_NODELIST``), port ``port_base``, where Slurm starts task 0 (a process 0 on another node is
  an error; ``SLURMD_NODENAME`` says where each task runs);
* this task's GPUs (``local_device_ids``): this task's share of the GPUs its process sees. When several
  tasks share a node, task ``SLURM_LOCALID`` takes GPUs ``[local_id * gpus_per_task, (local_id + 1) *
  gpus_per_task)`` of ``CUDA_VISIBLE_DEVICES`` (by position, so GPUs 2,3 of a half node, or UUIDs, work);
  when Slurm already bound each task to its own GPUs (``--gpus-per-task``, ``--gpu-bind``: the process
  sees exactly ``gpus_per_task`` of them), it uses all it sees. JAX's own Slurm detection gives task
  ``i`` of a node device ``i`` of those it sees, which fails when Slurm bound each task to its own GPUs
  and when a task has more than one GPU (jax issue #23452).

Host lists (``node[001-003,007],gpu-a[1-2]``) and task counts (``2(x3),1``) are expanded here
(`expand_hostlist`, `expand_tasks_per_node`); nothing calls ``scontrol``.

>>> expand_hostlist("node[001-003,007],gpu-a[1-2]")
['node001', 'node002', 'node003', 'node007', 'gpu-a1', 'gpu-a2']
>>> expand_tasks_per_node("2(x3),1")
[2, 2, 2, 1]
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import shutil
import subprocess
from typing import Any

from tpustrat._src import validation
from tpustrat._src.cluster_resolver import ClusterResolver
from tpustrat._src.cluster_spec import ClusterSpec

__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]

_WHERE = "SlurmClusterResolver"
_MAX_HOSTS = 1 << 20  # a host list longer than this is a typo, not a cluster


def _split_top_level(text: str, what: str) -> list[str]:
  """`text` split at the commas outside brackets; errors name `what` and the position."""
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch == "[":
      if depth:
        raise ValueError(f"{_WHERE}: cannot parse the host list {what}={text!r}: nested '[' at position {i}.")
      depth = 1
    elif ch == "]":
      if not depth:
        raise ValueError(f"{_WHERE}: cannot parse the host list {what}={text!r}: ']' without '[' at position "
                         f"{i}.")
      depth = 0
    elif ch == "," and not depth:
      parts.append(text[start:i])
      start = i + 1
  if depth:
    raise ValueError(f"{_WHERE}: cannot parse the host list {what}={text!r}: a '[' is not closed.")
  parts.append(text[start:])
  return parts


def _expand_range(body: str, text: str, what: str) -> list[str]:
  """``001-003,007`` -> ['001', '002', '003', '007']: Slurm pads to the width of each range's start."""
  out: list[str] = []
  for item in body.split(","):
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
    if m is None:
      raise ValueError(f"{_WHERE}: cannot parse the host list {what}={text!r}: {item!r} in '[{body}]' is not "
                       "a number or a range 'a-b' of numbers.")
    lo, hi = m.group(1), m.group(2) or m.group(1)
    if int(hi) < int(lo):
      raise ValueError(f"{_WHERE}: cannot parse the host list {what}={text!r}: the range {item!r} ends before "
                       "it starts.")
    if len(out) + int(hi) - int(lo) + 1 > _MAX_HOSTS:
      raise ValueError(f"{_WHERE}: the host list {what}={text!r} names more than {_MAX_HOSTS} hosts.")
    out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
  return out


def expand_hostlist(hostlist: str, what: str = "hostlist") -> list[str]:
  """Slurm's compressed host list as a list of distinct host names, in order (nothing sorted).

  Each comma-separated entry is literal text and bracketed number sets (``[1-3,7]``); several bracket
  sets give every combination, the first varying slowest (``rack[1-2]-n[1-2]``: rack1-n1, rack1-n2,
  rack2-n1, rack2-n2). Numbers keep the width of their range's start (``[08-10]``: 08, 09, 10).

  Args:
    hostlist: e.g. the value of ``SLURM_STEP_NODELIST``.
    what: how errors name the list (e.g. the variable it came from).

  Returns:
    The host names.

  Raises:
    ValueError: an empty list or entry, an unbalanced or nested bracket, a bracket item that is not a
      number or a range of numbers, a range that ends before it starts, white space, or a host named more
      than once (``node[1,1]``, ``n[1-2],n2``: Slurm lists each node of a step once).

  >>> expand_hostlist("n[1-2],m5,o[3-4,6]")
  ['n1', 'n2', 'm5', 'o3', 'o4', 'o6']
  >>> expand_hostlist("rack[1-2]-n[08-09]")
  ['rack1-n08', 'rack1-n09', 'rack2-n08', 'rack2-n09']
  """
  if not isinstance(hostlist, str):
    raise TypeError(f"{_WHERE}: the host list {what} must be a string, got {hostlist!r:.100}.")
  if not hostlist.strip():
    raise ValueError(f"{_WHERE}: the host list {what} is empty.")
  if any(ch.isspace() for ch in hostlist.strip()):
    raise ValueError(f"{_WHERE}: cannot parse the host list {what}={hostlist!r}: it contains white space.")
  text = hostlist.strip()
  hosts: list[str] = []
  for entry in _split_top_level(text, what):
    if not entry:
      raise ValueError(f"{_WHERE}: cannot parse the host list {what}={text!r}: an empty entry (',,' or a "
                       "leading or trailing ',').")
    pieces: list[list[str]] = []
    for literal, body in re.findall(r"([^\[\]]*)(?:\[([^\]]*)\])?", entry):
      if literal:
        pieces.append([literal])
      if body:
        pieces.append(_expand_range(body, text, what))
    if "[]" in entry:
      raise ValueError(f"{_WHERE}: cannot parse the host list {what}={text!r}: an empty '[]'.")
    for combination in itertools.product(*pieces):
      hosts.append("".join(combination))
      if len(hosts) > _MAX_HOSTS:
        raise ValueError(f"{_WHERE}: the host list {what}={text!r} names more than {_MAX_HOSTS} hosts.")
  if len(set(hosts)) != len(hosts):
    twice = [h for h, n in collections.Counter(hosts).items() if n > 1]
    raise ValueError(f"{_WHERE}: the host list {what}={text!r} names {twice} more than once; each host must "
                     "appear once.")
  return hosts


def expand_tasks_per_node(tasks_per_node: str, what: str = "tasks_per_node") -> list[int]:
  """Slurm's tasks-per-node list (``SLURM_STEP_TASKS_PER_NODE``) as one count per node, in node order.

  Args:
    tasks_per_node: e.g. ``'3(x2),2,1'``: 3 tasks on each of two nodes, then 2, then 1.
    what: how errors name the list.

  Returns:
    One count (>= 1) per node.

  Raises:
    ValueError: an entry that is not ``N`` or ``N(xM)`` with N, M >= 1.

  >>> expand_tasks_per_node("3(x2),2,1")
  [3, 3, 2, 1]
  """
  if not isinstance(tasks_per_node, str):
    raise TypeError(f"{_WHERE}: {what} must be a string, got {tasks_per_node!r:.100}.")
  result: list[int] = []
  for part in tasks_per_node.strip().split(","):
    m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
    if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
      raise ValueError(f"{_WHERE}: cannot parse {what}={tasks_per_node!r}: {part!r} is not 'N' or 'N(xM)' "
                       "with N, M >= 1 (e.g. '2(x3),1').")
    result.extend([int(m.group(1))] * int(m.group(2) or 1))
  return result


def _env(*names: str) -> tuple[str, str] | None:
  """(name, value) of the first of `names` set to a non-empty value, or None."""
  for name in names:
    value = os.environ.get(name, "").strip()
    if value:
      return name, value
  return None


def _env_count(*names: str, minimum: int = 0) -> tuple[str, int] | None:
  """(name, int value) of the first of `names` that is set; a clear error if it is not an int."""
  found = _env(*names)
  if found is None:
    return None
  name, text = found
  if not re.fullmatch(r"\d+", text) or int(text) < minimum:
    raise ValueError(f"{_WHERE}: the environment variable {name}={text!r} must be an int >= {minimum}.")
  return name, int(text)


def _gpus_per_task_from_env() -> tuple[str, int] | None:
  """``SLURM_GPUS_PER_TASK`` (``2``, or typed: ``a100:2``, ``a100:1,v100:1``) as a count."""
  found = _env("SLURM_GPUS_PER_TASK")
  if found is None:
    return None
  name, text = found
  total = 0
  for part in text.split(","):
    m = re.fullmatch(r"(?:[^:,]+:)?(\d+)", part.strip())
    if m is None:
      raise ValueError(f"{_WHERE}: cannot parse {name}={text!r}: expected a count ('2') or typed counts "
                       "('a100:2').")
    total += int(m.group(1))
  return name, total


def _cuda_visible_devices() -> list[str] | None:
  """The entries of ``CUDA_VISIBLE_DEVICES`` that CUDA enumerates (it stops at the first invalid one:
  ``-1`` hides every GPU), or None when the variable is unset (every GPU of the node is visible)."""
  text = os.environ.get("CUDA_VISIBLE_DEVICES")
  if text is None:
    return None
  entries = [t.strip() for t in text.split(",")]
  if text.strip() in ("", "NoDevFiles"):
    return []
  visible = []
  for entry in entries:
    if not entry or entry.startswith("-"):
      break
    visible.append(entry)
  return visible


def _count_nvidia_gpus() -> int:
  """The node's NVIDIA GPUs as ``nvidia-smi --list-gpus`` lists them (TF's default); 0 without nvidia-smi."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return 0
  try:
    listing = subprocess.run([exe, "--list-gpus"], capture_output=True, text=True, timeout=60, check=True).stdout
  except (OSError, subprocess.SubprocessError) as e:
    raise RuntimeError(
        f"{_WHERE}: could not count this node's GPUs with `nvidia-smi --list-gpus` ({e}). Pass "
        "gpus_per_node=... (0 for none).") from None
  return sum(line.startswith("GPU ") for line in listing.splitlines())


def _check_counts(value: Any, name: str, minimum: int) -> dict[str, int]:
  if not isinstance(value, dict) or not value:
    raise ValueError(f"{_WHERE}: `{name}` must be a non-empty dict {{name: count}}, got {value!r:.200}.")
  out = {}
  for key, count in value.items():
    if not isinstance(key, str) or not key:
      raise ValueError(f"{_WHERE}: the keys of `{name}` must be non-empty strings, got {key!r}.")
    out[key] = validation.check_int(count, _WHERE, f"{name}[{key!r}]", minimum=minimum)
  return out


class SlurmClusterResolver(ClusterResolver):
  """The processes of a Slurm job step, one per task (TF's `tf.distribute.cluster_resolver.SlurmClusterResolver`).

  Construct it in every task of the step (``srun python train.py``) and pass it to
  `tpustrat.experimental_connect_to_cluster` or ``tpustrat.TPUStrategy(resolver)``: the step's tasks
  become the processes of one JAX job (`jax.distributed.initialize`, never a runtime of tpustrat's own).
  The module docstring says which variables are read and how; they are read once, here, and a missing or
  inconsistent one is an error naming it.

  TF's arguments keep their meaning:

  * ``jobs``: ``{job name: number of tasks}``; default ``{'worker': <tasks of the step>}``. The counts must
    add up to the step's tasks. Jobs take consecutive tasks in the order of their sorted names (TF's
    rule), which gives each task its `task_type` and `task_id`; every task of every job is a process of
    the one JAX job (a name is only a label: there are no parameter servers in JAX).
  * ``port_base``: the port of the first task of each node; the next tasks of a node take the next
    ports (`cluster_spec`). The coordinator of `jax.distributed` is task 0's address: the first node,
    ``port_base``. Give each job of a shared node its own (``port_base=20000 + $SLURM_JOB_ID % 10000``).
  * ``gpus_per_node``: GPUs per node; default ``SLURM_GPUS_ON_NODE``, else the number of entries of
    ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi --list-gpus`` (TF's default), else 0 (no nvidia-smi: a
    CPU node). For other accelerators, pass it.
  * ``gpus_per_task``: GPUs per task; default ``SLURM_GPUS_PER_TASK``, else ``gpus_per_node`` divided by
    the largest number of tasks on a node (TF's default). More GPUs per node than there are is an error.
  * ``tasks_per_node``: an int (every node), a dict ``{host: tasks}``, or None for the step's
    ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``).
  * ``auto_set_gpu``: TF sets ``CUDA_VISIBLE_DEVICES`` to the task's GPUs. Here the same choice (see the
    module docstring) becomes `local_device_ids`, positions among the GPUs this process sees, which
    `jax.distributed.initialize` applies; the environment of this process and its children is left
    alone. False: the task uses every GPU its process sees.
  * ``rpc_layer``: the scheme `master` puts before an address (``'grpc'``); JAX's coordination service
    does not use it.

  Differences from TF: task 0 runs the coordinator, so the nodes keep the step's node list order (Slurm's
  own order, in which it places tasks) instead of being sorted by name; `cluster_spec` is a tpustrat
  `ClusterSpec`; `task_type`, `task_id` and `rpc_layer` are known from the constructor on (TF: after
  `cluster_spec`); nothing is read again later; the GPU choice is `local_device_ids`. Task ``i`` of
  `cluster_spec` is Slurm's task ``i`` with Slurm's default (block) distribution, as in TF; the
  connection itself needs only that task 0 runs on the first node.

  Args:
    jobs, port_base, gpus_per_node, gpus_per_task, tasks_per_node, auto_set_gpu, rpc_layer: see above.
    coordinator_bind_address, initialization_timeout, heartbeat_timeout, shutdown_timeout, step_timeout:
      as for `TPUClusterResolver` (keyword-only; default: the ``TPUSTRAT_*`` variables, else JAX's).

  Raises:
    RuntimeError: not inside a Slurm job step (``SLURM_PROCID`` or the node list missing), the jobs' task
      counts do not add up to the step's, more GPUs per node requested than there are, or this task's
      GPUs cannot be told apart (see the module docstring).
    ValueError: a malformed argument or variable (named in the message).

  For example, in ``srun --ntasks-per-node=4 --gpus-per-node=4 python train.py`` on 2 nodes, task 5 (the
  second task of the second node) is process 5 of 8, coordinator ``<first node>:8888``, and uses GPU 1 of
  the 4 its process sees::

    resolver = tpustrat.cluster_resolver.SlurmClusterResolver()
    strategy = tpustrat.TPUStrategy(resolver)
  """

  def __init__(self, jobs: dict[str, int] | None = None, port_base: int = 8888, gpus_per_node: int | None = None,
               gpus_per_task: int | None = None, tasks_per_node: int | dict[str, int] | None = None,
               auto_set_gpu: bool = True, rpc_layer: str | None = "grpc", *,
               coordinator_bind_address: str | None = None, initialization_timeout: int | None = None,
               heartbeat_timeout: int | None = None, shutdown_timeout: int | None = None,
               step_timeout: float | None = None) -> None:
    super().__init__(coordinator_bind_address=coordinator_bind_address,
                     initialization_timeout=initialization_timeout, heartbeat_timeout=heartbeat_timeout,
                     shutdown_timeout=shutdown_timeout, step_timeout=step_timeout)
    self._port_base = validation.check_int(port_base, _WHERE, "port_base", minimum=1, maximum=65535)
    gpus_per_node = validation.check_int(gpus_per_node, _WHERE, "gpus_per_node", minimum=0, allow_none=True)
    gpus_per_task = validation.check_int(gpus_per_task, _WHERE, "gpus_per_task", minimum=0, allow_none=True)
    if not isinstance(auto_set_gpu, bool):
      raise TypeError(f"{_WHERE}: `auto_set_gpu` must be True or False, got {auto_set_gpu!r}.")
    if rpc_layer is not None and not isinstance(rpc_layer, str):
      raise TypeError(f"{_WHERE}: `rpc_layer` must be a string or None, got {rpc_layer!r}.")
    self.rpc_layer = rpc_layer
    jobs = None if jobs is None else _check_counts(jobs, "jobs", minimum=0)

    rank_env = _env_count("SLURM_PROCID")
    if rank_env is None:
      raise RuntimeError(f"{_WHERE}: SLURM_PROCID is not set: not running inside a Slurm job step. Start one "
                         "process per task with srun (in an sbatch script or an salloc session).")
    rank = rank_env[1]
    self._hosts, counts = self._task_configuration(tasks_per_node)
    num_tasks = sum(counts)
    step = _env_count("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", minimum=1)
    if step is not None and step[1] != num_tasks:
      raise RuntimeError(
          f"{_WHERE}: the tasks per node ({self._describe(counts)}) add up to {num_tasks} tasks, but "
          f"{step[0]}={step[1]}. Check tasks_per_node / SLURM_STEP_TASKS_PER_NODE.")
    if jobs is None:
      jobs = {"worker": num_tasks}
    if sum(jobs.values()) != num_tasks:
      raise RuntimeError(
          f"{_WHERE}: jobs={jobs} request {sum(jobs.values())} tasks, but the step has {num_tasks}; the jobs' "
          "counts must add up to the step's tasks.")
    if rank >= num_tasks:
      raise RuntimeError(f"{_WHERE}: SLURM_PROCID={rank} is out of range for the step's {num_tasks} tasks.")
    max_tasks = max(counts)
    if self._port_base + max_tasks - 1 > 65535:
      raise ValueError(f"{_WHERE}: port_base={self._port_base} leaves no port for the {max_tasks} tasks of a "
                       "node (ports port_base .. port_base + tasks - 1 must be <= 65535).")
    self._counts = counts
    self._jobs = dict(sorted(jobs.items()))
    self._rank = rank

    # Which node this task runs on, and which of the node's tasks it is.
    node = _env("SLURMD_NODENAME")
    if node is not None and node[1] not in self._hosts:
      raise RuntimeError(f"{_WHERE}: this task runs on SLURMD_NODENAME={node[1]!r}, which is not one of the "
                         f"step's nodes {self._hosts[:8]}{' ...' if len(self._hosts) > 8 else ''}.")
    # Slurm's default (block) distribution puts tasks sum(counts[:k]) .. sum(counts[:k + 1]) - 1 on node k:
    # task 0 on the first node, where the other tasks look for the coordinator, and task i where
    # `cluster_spec` says it is. Every task checks its own node.
    starts = list(itertools.accumulate(counts, initial=0))  # the first task of each node
    k = next(k for k in range(len(counts)) if rank < starts[k + 1])  # rank < num_tasks: there is one
    if node is not None and node[1] != self._hosts[k]:
      first, last = starts[k], starts[k + 1] - 1
      tasks = f"tasks {first}-{last}" if last > first else f"task {first}"
      raise RuntimeError(
          f"{_WHERE}: task {rank} runs on {node[1]!r}, not on {self._hosts[k]!r}, the node of {tasks} under "
          f"Slurm's default task distribution (block) (SLURMD_NODENAME={node[1]!r}, SLURM_PROCID={rank}), which "
          "the coordinator (task 0, on the first node) and `cluster_spec` assume. Use the block distribution "
          "(srun's default; not --distribution=cyclic or arbitrary).")
    tasks_here = counts[self._hosts.index(node[1])] if node is not None else max_tasks
    local = _env_count("SLURM_LOCALID")
    if local is not None and local[1] >= tasks_here:
      raise RuntimeError(f"{_WHERE}: SLURM_LOCALID={local[1]} is out of range for the {tasks_here} tasks on "
                         "this node.")
    self._gpus_per_task, self._local_device_ids = self._choose_gpus(
        gpus_per_node, gpus_per_task, auto_set_gpu, max_tasks, tasks_here, None if local is None else local[1])
    self._resolved = (f"{self._hosts[0]}:{self._port_base}", num_tasks, rank, self._local_device_ids)

  # -- reading the environment ------------------------------------------------------------------------

  @staticmethod
  def _describe(counts: list[int]) -> str:
    return ",".join(str(c) for c in counts) if len(counts) <= 8 else f"{counts[:8]} ... ({len(counts)} nodes)"

  def _task_configuration(self, tasks_per_node: Any) -> tuple[list[str], list[int]]:
    """(the step's hosts in Slurm's order, the tasks on each)."""
    nodelist = _env("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    hosts = None if nodelist is None else expand_hostlist(nodelist[1], nodelist[0])
    nodes = "" if nodelist is None else f"{nodelist[0]}={nodelist[1]!r}"  # for messages
    if isinstance(tasks_per_node, dict):
      config = _check_counts(tasks_per_node, "tasks_per_node", minimum=1)
      if hosts is None:
        return list(config), list(config.values())
      if set(config) != set(hosts):
        raise ValueError(
            f"{_WHERE}: tasks_per_node names the hosts {sorted(config)}, but the step runs on {nodes} "
            f"({hosts}).")
      return hosts, [config[h] for h in hosts]
    if hosts is None:
      raise RuntimeError(f"{_WHERE}: SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) is not set: not running "
                         "inside a Slurm job step?")
    if tasks_per_node is not None:
      count = validation.check_int(tasks_per_node, _WHERE, "tasks_per_node", minimum=1)
      return hosts, [count] * len(hosts)
    found = _env("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if found is None:
      raise RuntimeError(f"{_WHERE}: SLURM_STEP_TASKS_PER_NODE is not set; pass tasks_per_node=... .")
    counts = expand_tasks_per_node(found[1], found[0])
    if len(counts) != len(hosts):
      raise ValueError(
          f"{_WHERE}: {found[0]}={found[1]!r} gives task counts for {len(counts)} nodes, but {nodes} "
          f"names {len(hosts)}.")
    return hosts, counts

  def _choose_gpus(self, gpus_per_node: int | None, gpus_per_task: int | None, auto_set_gpu: bool,
                   max_tasks: int, tasks_here: int, local: int | None) -> tuple[int, list[int] | None]:
    """(GPUs per task, this task's `local_device_ids`); see the module docstring."""
    visible = _cuda_visible_devices()
    if gpus_per_node is not None:
      per_node, source = gpus_per_node, f"gpus_per_node={gpus_per_node}"
    elif (found := _env_count("SLURM_GPUS_ON_NODE")) is not None:
      per_node, source = found[1], f"SLURM_GPUS_ON_NODE={found[1]}"
    elif visible is not None:
      per_node, source = len(visible), f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}"
    else:
      per_node = _count_nvidia_gpus()
      source = f"nvidia-smi lists {per_node}"
    if gpus_per_task is not None:
      per_task = gpus_per_task
    elif (found := _gpus_per_task_from_env()) is not None:
      per_task = found[1]
    else:
      per_task = per_node // max_tasks
      if per_node and not per_task:
        raise RuntimeError(
            f"{_WHERE}: {per_node} GPUs per node ({source}) cannot be shared by {max_tasks} tasks per node; pass "
            "gpus_per_task=... (0 for none), or start at most one task per GPU.")
    if not source.startswith("CUDA_VISIBLE_DEVICES"):
      # A per-node count (what a process that sees only its own GPUs sees says nothing about the node).
      if per_task * max_tasks > per_node:
        raise RuntimeError(
            f"{_WHERE}: requested more GPUs per node than available: {max_tasks} tasks x {per_task} GPUs per "
            f"task, but {per_node} GPUs per node ({source}).")
    if not auto_set_gpu:
      return per_task, None
    seen = visible if visible is not None else [str(i) for i in range(per_node)]
    if per_task == 0:
      if seen:  # TF hides them (CUDA_VISIBLE_DEVICES=''); JAX's local_device_ids cannot say "none"
        raise RuntimeError(
            f"{_WHERE}: gpus_per_task=0, but this task sees {len(seen)} GPUs, which JAX would use. Hide them "
            "(CUDA_VISIBLE_DEVICES=), or pass auto_set_gpu=False (the task then uses every GPU it sees, none "
            "with JAX_PLATFORMS=cpu).")
      return per_task, None
    if len(seen) == per_task:
      return per_task, None  # this process sees exactly its own GPUs (Slurm bound them, or one task per node)
    described = (f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}" if visible is not None
                 else f"{per_node} GPUs per node ({source})")
    if local is None:
      raise RuntimeError(
          f"{_WHERE}: SLURM_LOCALID is not set, so this task cannot tell which {per_task} of the {len(seen)} "
          f"GPUs it sees ({described}) are its own.")
    if len(seen) < tasks_here * per_task:
      raise RuntimeError(
          f"{_WHERE}: this task sees {len(seen)} GPUs ({described}): neither only its own {per_task} "
          f"(gpus_per_task) nor enough for the {tasks_here} tasks on this node ({tasks_here} x {per_task}). "
          "Check --gpus-per-task / --gpus-per-node / --gres, or pass gpus_per_task=... .")
    return per_task, list(range(local * per_task, (local + 1) * per_task))

  # -- the resolver -----------------------------------------------------------------------------------

  def _resolve(self) -> tuple[str | None, int, int, list[int] | None]:
    return self._resolved

  def _task_addresses(self) -> list[str]:
    return [f"{host}:{self._port_base + offset}" for host, count in zip(self._hosts, self._counts)
            for offset in range(count)]

  def _task_of(self, rank: int) -> tuple[str, int]:
    start = 0
    for job, count in self._jobs.items():
      if rank < start + count:
        return job, rank - start
      start += count
    raise AssertionError("unreachable: the jobs' counts add up to the step's tasks")

  @property
  def task_type(self) -> str:
    """This task's job name (``'worker'`` unless `jobs` says otherwise)."""
    return self._task_of(self._rank)[0]

  @property
  def task_id(self) -> int:
    """This task's index in its job."""
    return self._task_of(self._rank)[1]

  def get_task_info(self) -> tuple[str, int]:
    """``(task_type, task_id)``, as TF's."""
    return self._task_of(self._rank)

  def cluster_spec(self) -> ClusterSpec:
    """``{job: [host:port, ...]}``: each node's tasks on ``port_base``, ``port_base + 1``, ..., nodes in the
    step's order, jobs taking consecutive tasks in the order of their sorted names."""
    addresses, spec, start = self._task_addresses(), {}, 0
    for job, count in self._jobs.items():
      spec[job] = addresses[start:start + count]
      start += count
    return ClusterSpec(spec)

  def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
    """The address of a task (default: this one), as ``rpc_layer://host:port`` (TF's `master`)."""
    task_type = self.task_type if task_type is None else task_type
    task_id = self.task_id if task_id is None else task_id
    address = self.cluster_spec().task_address(task_type, task_id)
    layer = rpc_layer or self.rpc_layer
    return f"{layer}://{address}" if layer else address

  def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                       config_proto: Any = None) -> dict[str, int]:
    """``{'GPU': gpus_per_task}``, as TF's (nothing is started)."""
    del task_type, task_id, config_proto
    return {"GPU": self._gpus_per_task}

  def __repr__(self) -> str:
    coordinator, count, index, local = self._resolved
    return (f"SlurmClusterResolver(coordinator_address={coordinator!r}, num_processes={count}, "
            f"process_id={index}, local_device_ids={local})")
