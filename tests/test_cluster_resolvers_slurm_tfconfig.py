"""`SlurmClusterResolver` and `TFConfigClusterResolver` (`tpustrat._src.slurm_cluster_resolver`,
`tpustrat._src.tfconfig_cluster_resolver`): environments made in the test, and one real 2-process job
on loopback that connects through a Slurm environment alone."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import launched_results

import tpustrat
from tpustrat._src import cluster_connection
from tpustrat._src import slurm_cluster_resolver as slurm_lib
from tpustrat.cluster_resolver import (
  ClusterResolver,
  ClusterSpec,
  SlurmClusterResolver,
  TFConfigClusterResolver,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
  """No Slurm, TF_CONFIG, CUDA or TPUSTRAT_* variable of the machine running the tests leaks in; no nvidia-smi."""
  for name in list(os.environ):
    if (name.startswith(("SLURM", "TPUSTRAT_")) or name in ("TF_CONFIG", "CUDA_VISIBLE_DEVICES")
        or name.startswith("JAX_COORDINATOR")):
      monkeypatch.delenv(name)
  monkeypatch.setattr(slurm_lib, "_count_nvidia_gpus", lambda: 0)


def slurm(monkeypatch, *, procid, nodelist="node[001-002]", tasks="4(x2)", ntasks=8, localid=None, node=None,
          **extra):
  """A Slurm job step's variables, as srun sets them for task `procid`."""
  env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": procid, "SLURM_STEP_NODELIST": nodelist,
         "SLURM_STEP_TASKS_PER_NODE": tasks, "SLURM_STEP_NUM_TASKS": ntasks, "SLURM_LOCALID": localid,
         "SLURMD_NODENAME": node, **extra}
  for name, value in env.items():
    if value is not None:
      monkeypatch.setenv(name, str(value))


def block_layout(counts):
  """[(node index, local id)] of each task under Slurm's default (block) distribution."""
  return [(n, i) for n, c in enumerate(counts) for i in range(c)]


# -- host lists ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, hosts", [
    ("node[001-003,007],gpu-a[1-2]", ["node001", "node002", "node003", "node007", "gpu-a1", "gpu-a2"]),
    ("n1", ["n1"]),
    ("127.0.0.1", ["127.0.0.1"]),
    ("n[1-2],m5,o[3-4,6]", ["n1", "n2", "m5", "o3", "o4", "o6"]),
    ("a[08-10]", ["a08", "a09", "a10"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("[1-2]x", ["1x", "2x"]),
])
def test_expand_hostlist(text, hosts):
  assert slurm_lib.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, match", [
    ("", "is empty"),
    ("n[1-", "not closed"),
    ("n]1", r"'\]' without '\['"),
    ("n[1[2]]", r"nested '\['"),
    ("n[1-x]", "'1-x' in '\\[1-x\\]' is not a number"),
    ("n[3-1]", "ends before it starts"),
    ("a,,b", "an empty entry"),
    ("a,", "an empty entry"),
    ("n[]", r"an empty '\[\]'"),
    ("n1 n2", "white space"),
    ("n[0-99999999]", "more than"),
    # A host named twice is an error (issue 31 item 12), in one entry or across entries.
    ("node[1,1]", r"SLURM_STEP_NODELIST='node\[1,1\]' names \['node1'\] more than once"),
    ("n[1-2],n[2-3]", r"SLURM_STEP_NODELIST='n\[1-2\],n\[2-3\]' names \['n2'\] more than once"),
])
def test_expand_hostlist_errors(text, match):
  with pytest.raises(ValueError, match=match):
    slurm_lib.expand_hostlist(text, "SLURM_STEP_NODELIST")


def test_expand_tasks_per_node():
  assert slurm_lib.expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
  assert slurm_lib.expand_tasks_per_node("8") == [8]
  for bad in ("", "2(x0)", "0", "2x3", "2(x3", "a"):
    with pytest.raises(ValueError, match="is not 'N' or 'N\\(xM\\)'"):
      slurm_lib.expand_tasks_per_node(bad)


# -- Slurm: processes and GPUs ------------------------------------------------------------------------


def test_slurm_one_task_per_gpu_without_cuda_visible_devices(monkeypatch):
  """2 nodes x 4 tasks, 4 GPUs per node, every task sees every GPU: local task i takes GPU i."""
  counts = [4, 4]
  hosts = ["node001", "node002"]
  for rank, (node, local) in enumerate(block_layout(counts)):
    slurm(monkeypatch, procid=rank, localid=local, node=hosts[node], SLURM_GPUS_ON_NODE=4)
    r = SlurmClusterResolver()
    assert isinstance(r, ClusterResolver)
    assert (r.coordinator_address, r.num_processes, r.process_id, r.local_device_ids) == (
        "node001:8888", 8, rank, [local])
    assert (r.task_type, r.task_id, r.get_task_info()) == ("worker", rank, ("worker", rank))
    assert r.num_accelerators() == {"GPU": 1} and r.environment == ""
    assert r.master() == f"grpc://{hosts[node]}:{8888 + local}"
  assert r.cluster_spec() == ClusterSpec({"worker": [f"{h}:{8888 + i}" for h in hosts for i in range(4)]})
  assert r.master("worker", 0) == "grpc://node001:8888" == "grpc://" + r.coordinator_address


@pytest.mark.parametrize("visible", ["4,5,6,7", "GPU-a,GPU-b,GPU-c,GPU-d"])
def test_slurm_shared_node_picks_by_position_in_cuda_visible_devices(monkeypatch, visible):
  """The job has GPUs 4-7 of a node (or UUIDs); 2 tasks per node share them, 2 GPUs each. JAX's ids are
  positions among the visible GPUs: local task 1 gets [2, 3] (its GPUs 6, 7), never ids 6, 7."""
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
  for rank, (node, local) in enumerate(block_layout([2, 2])):
    slurm(monkeypatch, procid=rank, tasks="2(x2)", ntasks=4, localid=local, node=f"node00{node + 1}",
          SLURM_GPUS_ON_NODE=4)
    r = SlurmClusterResolver()
    assert r.local_device_ids == list(range(2 * local, 2 * local + 2))
    assert r.num_accelerators() == {"GPU": 2}
  # Without SLURM_GPUS_ON_NODE the node's GPUs are counted from CUDA_VISIBLE_DEVICES (TF's rule).
  monkeypatch.delenv("SLURM_GPUS_ON_NODE")
  assert SlurmClusterResolver().local_device_ids == [2, 3]


def test_slurm_tasks_bound_to_their_own_gpus_by_slurm(monkeypatch):
  """--gpus-per-task=1 with binding: task 3 of a node sees only its GPU, as CUDA_VISIBLE_DEVICES=3 (or 0
  with device cgroups). It must use what it sees; JAX's own Slurm detection would ask for device 3."""
  for visible in ("3", "0"):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    slurm(monkeypatch, procid=3, localid=3, node="node001", SLURM_GPUS_ON_NODE=4, SLURM_GPUS_PER_TASK=1)
    r = SlurmClusterResolver()
    assert (r.process_id, r.local_device_ids, r.num_accelerators()) == (3, None, {"GPU": 1})
  # The same with only SLURM_GPUS_PER_TASK (typed) known.
  monkeypatch.delenv("SLURM_GPUS_ON_NODE")
  monkeypatch.setenv("SLURM_GPUS_PER_TASK", "a100:1")
  assert SlurmClusterResolver().local_device_ids is None


def test_slurm_gpus_per_task(monkeypatch):
  slurm(monkeypatch, procid=1, tasks="2", ntasks=2, nodelist="gpu01", localid=1, node="gpu01")
  assert SlurmClusterResolver(gpus_per_node=8, gpus_per_task=2).local_device_ids == [2, 3]
  assert SlurmClusterResolver(gpus_per_node=8).local_device_ids == [4, 5, 6, 7]  # 8 GPUs over 2 tasks
  assert SlurmClusterResolver(gpus_per_node=8, auto_set_gpu=False).local_device_ids is None  # every GPU
  # One task per node with fewer GPUs than the node has: the first ones.
  slurm(monkeypatch, procid=0, tasks="1", ntasks=1, nodelist="gpu01", localid=0, node="gpu01")
  assert SlurmClusterResolver(gpus_per_node=4, gpus_per_task=2).local_device_ids == [0, 1]
  assert SlurmClusterResolver(gpus_per_node=4).local_device_ids is None
  # nvidia-smi's count is TF's default for gpus_per_node.
  monkeypatch.setattr(slurm_lib, "_count_nvidia_gpus", lambda: 2)
  assert SlurmClusterResolver().num_accelerators() == {"GPU": 2}


def test_slurm_cpu_only_tasks(monkeypatch):
  slurm(monkeypatch, procid=1, tasks="2", ntasks=2, nodelist="cpu1")  # no SLURM_LOCALID needed
  r = SlurmClusterResolver()
  assert (r.num_processes, r.process_id, r.local_device_ids, r.num_accelerators()) == (2, 1, None, {"GPU": 0})


def test_slurm_jobs_heterogeneous_nodes_and_arguments(monkeypatch):
  """TF's `jobs`: sorted names take consecutive tasks; 3 tasks on a node, then 1."""
  slurm(monkeypatch, procid=2, nodelist="a[1-2]", tasks="3,1", ntasks=4, localid=2, node="a1")
  r = SlurmClusterResolver(jobs={"worker": 3, "chief": 1}, port_base=20000, rpc_layer=None)
  assert (r.task_type, r.task_id, r.process_id, r.num_processes) == ("worker", 1, 2, 4)
  assert r.cluster_spec().as_dict() == {"chief": ["a1:20000"], "worker": ["a1:20001", "a1:20002", "a2:20000"]}
  assert r.master() == "a1:20002" and r.master("chief", 0, "grpc") == "grpc://a1:20000"
  assert r.coordinator_address == "a1:20000"
  # tasks_per_node as an int and as a dict override the step's variable (with 2 per node, task 2 is the
  # first task of a2).
  monkeypatch.setenv("SLURM_LOCALID", "0")
  monkeypatch.setenv("SLURMD_NODENAME", "a2")
  assert SlurmClusterResolver(tasks_per_node=2).cluster_spec().as_dict() == {
      "worker": ["a1:8888", "a1:8889", "a2:8888", "a2:8889"]}
  monkeypatch.setenv("SLURMD_NODENAME", "a1")
  assert SlurmClusterResolver(tasks_per_node={"a2": 1, "a1": 3}).cluster_spec().as_dict() == {
      "worker": ["a1:8888", "a1:8889", "a1:8890", "a2:8888"]}  # the step's node order, not the dict's


def test_slurm_connects_through_the_common_interface(monkeypatch):
  """experimental_connect_to_cluster hands the Slurm resolver's values to jax.distributed (stubbed here)."""
  calls = []
  monkeypatch.setattr(cluster_connection.distributed_lib, "initialize", lambda *a, **kw: calls.append((a, kw)))
  monkeypatch.setattr(cluster_connection.jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(cluster_connection, "_backends_initialized", lambda: False)
  monkeypatch.setattr(cluster_connection, "_CONNECTED", [])
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
  slurm(monkeypatch, procid=5, localid=1, node="node002", SLURM_GPUS_ON_NODE=4)
  tpustrat.experimental_connect_to_cluster(SlurmClusterResolver(heartbeat_timeout=7))
  assert calls == [(("node001:8888", 8, 5, [1]), dict(
      coordinator_bind_address=None, initialization_timeout=300, heartbeat_timeout=7, shutdown_timeout=300))]


def test_slurm_one_task_restricts_its_gpus_without_starting_jax_distributed(monkeypatch):
  """A one-task step with 2 of the node's 4 GPUs: no jax.distributed, but JAX's GPUs are restricted."""
  updates = []
  monkeypatch.setattr(cluster_connection.jax.config, "update", lambda *a: updates.append(a))
  monkeypatch.setattr(cluster_connection, "_CONNECTED_ONE", [])
  slurm(monkeypatch, procid=0, tasks="1", ntasks=1, nodelist="g1", localid=0, node="g1")
  resolver = SlurmClusterResolver(gpus_per_node=4, gpus_per_task=2)
  monkeypatch.setattr(cluster_connection, "_backends_initialized", lambda: True)
  with pytest.raises(RuntimeError, match=r"devices \[0, 1\].*already initialised"):
    tpustrat.experimental_connect_to_cluster(resolver)
  monkeypatch.setattr(cluster_connection, "_backends_initialized", lambda: False)
  tpustrat.experimental_connect_to_cluster(resolver)
  tpustrat.experimental_connect_to_cluster(resolver)  # once
  assert updates == [("jax_cuda_visible_devices", "0,1"), ("jax_rocm_visible_devices", "0,1")]


def test_tpu_strategy_takes_a_slurm_resolver(monkeypatch):
  slurm(monkeypatch, procid=0, tasks="1", ntasks=1, nodelist="n1", localid=0, node="n1")
  resolver = SlurmClusterResolver(gpus_per_node=0)
  strategy = tpustrat.TPUStrategy(resolver)
  assert strategy.cluster_resolver is resolver and strategy.num_replicas_in_sync == 8


@pytest.mark.parametrize("env, kwargs, error, match", [
    (dict(SLURM_PROCID=None), {}, RuntimeError, "SLURM_PROCID is not set"),
    (dict(SLURM_PROCID="x"), {}, ValueError, "SLURM_PROCID='x' must be an int >= 0"),
    (dict(SLURM_STEP_NODELIST=None), {}, RuntimeError, "SLURM_STEP_NODELIST .* is not set"),
    (dict(SLURM_STEP_NODELIST="node[1-"), {}, ValueError, "SLURM_STEP_NODELIST='node\\[1-'"),
    (dict(SLURM_STEP_NODELIST="n[1-2],n1"), {}, ValueError, "names \\['n1'\\] more than once"),
    (dict(SLURM_STEP_TASKS_PER_NODE=None), {}, RuntimeError, "SLURM_STEP_TASKS_PER_NODE is not set"),
    (dict(SLURM_STEP_TASKS_PER_NODE="4(x3)"), {}, ValueError, "task counts for 3 nodes, but .* names 2"),
    (dict(SLURM_STEP_NUM_TASKS="6"), {}, RuntimeError, "add up to 8 tasks, but SLURM_STEP_NUM_TASKS=6"),
    ({}, dict(jobs={"worker": 7}), RuntimeError, "request 7 tasks, but the step has 8"),
    ({}, dict(jobs={"worker": -1}), ValueError, "must be an int >= 0, got -1"),
    ({}, dict(jobs=[8]), ValueError, "`jobs` must be a non-empty dict"),
    (dict(SLURM_PROCID="8"), {}, RuntimeError, "SLURM_PROCID=8 is out of range for the step's 8 tasks"),
    (dict(SLURM_LOCALID="4"), {}, RuntimeError, "SLURM_LOCALID=4 is out of range for the 4 tasks"),
    (dict(SLURMD_NODENAME="elsewhere"), {}, RuntimeError, "SLURMD_NODENAME='elsewhere', which is not one"),
    (dict(SLURM_PROCID="0", SLURMD_NODENAME="node002"), {}, RuntimeError, "task 0 runs on 'node002'"),
    # Every task is checked against the node the block distribution puts it on (issue 31 item 12).
    (dict(SLURMD_NODENAME="node001"), {}, RuntimeError,
     "task 5 runs on 'node001', not on 'node002', the node of tasks 4-7 under Slurm's default"),
    (dict(SLURM_PROCID="3", SLURM_LOCALID="3", SLURMD_NODENAME="node002"), {}, RuntimeError,
     "task 3 runs on 'node002', not on 'node001', the node of tasks 0-3 under Slurm's default"),
    (dict(SLURM_GPUS_ON_NODE="2"), {}, RuntimeError, "2 GPUs per node .* cannot be shared by 4 tasks"),
    ({}, dict(gpus_per_node=4, gpus_per_task=2), RuntimeError, "more GPUs per node than available: 4 tasks x 2"),
    (dict(CUDA_VISIBLE_DEVICES="0,1,2"), dict(gpus_per_task=1), RuntimeError,
     "sees 3 GPUs \\(CUDA_VISIBLE_DEVICES='0,1,2'\\): neither only its own 1 .* nor enough for the 4 tasks"),
    (dict(SLURM_LOCALID=None), {}, RuntimeError, "SLURM_LOCALID is not set"),
    ({}, dict(gpus_per_task=0), RuntimeError, "gpus_per_task=0, but this task sees 4 GPUs, which JAX would use"),
    (dict(SLURM_GPUS_PER_TASK="many"), {}, ValueError, "SLURM_GPUS_PER_TASK='many'"),
    ({}, dict(port_base=0), ValueError, "`port_base` must be an int >= 1 <= 65535, got 0"),
    ({}, dict(port_base=65534), ValueError, "no port for the 4 tasks of a node"),
    ({}, dict(gpus_per_task=-1), ValueError, "`gpus_per_task` must be an int >= 0"),
    ({}, dict(auto_set_gpu="yes"), TypeError, "`auto_set_gpu` must be True or False"),
    ({}, dict(tasks_per_node={"node001": 4}), ValueError, "names the hosts \\['node001'\\], but the step runs"),
    ({}, dict(tasks_per_node=0), ValueError, "`tasks_per_node` must be an int >= 1"),
])
def test_slurm_bad_environments_and_arguments(monkeypatch, env, kwargs, error, match):
  """Task 5 (node002, local 1) of 2 nodes x 4 tasks with 4 GPUs per node, then one thing wrong."""
  base = dict(SLURM_PROCID="5", SLURM_LOCALID="1", SLURMD_NODENAME="node002", SLURM_GPUS_ON_NODE="4")
  slurm(monkeypatch, procid=None, localid=None)
  for name, value in {**base, **env}.items():
    if value is None:
      monkeypatch.delenv(name, raising=False)
    else:
      monkeypatch.setenv(name, value)
  with pytest.raises(error, match=match):
    SlurmClusterResolver(**kwargs)


def test_slurm_job_level_variables_are_the_fallback(monkeypatch):
  """Outside a step's own variables (an older Slurm), the job's: SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE."""
  for name, value in dict(SLURM_PROCID="1", SLURM_JOB_NODELIST="c[7-8]", SLURM_TASKS_PER_NODE="1(x2)",
                          SLURM_NTASKS="2").items():
    monkeypatch.setenv(name, value)
  r = SlurmClusterResolver()
  assert (r.coordinator_address, r.num_processes, r.process_id) == ("c7:8888", 2, 1)


# -- TF_CONFIG ----------------------------------------------------------------------------------------

CLUSTER = {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], "evaluator": ["host3:2222"]}


def tf_config(monkeypatch, config):
  monkeypatch.setenv("TF_CONFIG", config if isinstance(config, str) else json.dumps(config))


def test_tf_config_chief_then_workers(monkeypatch):
  for (kind, index), process in {("chief", 0): 0, ("worker", 0): 1, ("worker", 1): 2}.items():
    tf_config(monkeypatch, {"cluster": CLUSTER, "task": {"type": kind, "index": index}, "rpc_layer": "grpc"})
    r = TFConfigClusterResolver()
    assert isinstance(r, ClusterResolver)
    assert (r.coordinator_address, r.num_processes, r.process_id, r.local_device_ids) == (
        "host0:2222", 3, process, None)
    assert (r.task_type, r.task_id, r.rpc_layer, r.environment) == (kind, index, "grpc", "")
    assert r.master() == f"grpc://{CLUSTER[kind][index]}"
  assert r.cluster_spec() == ClusterSpec(CLUSTER) and r.cluster_spec().as_dict() == CLUSTER
  assert r.master("chief", 0, rpc_layer="") == "host0:2222"


def test_tf_config_workers_only_overrides_and_evaluator(monkeypatch):
  tf_config(monkeypatch, {"cluster": {"worker": ["w0:1", "w1:1", "w2:1"]}, "task": {"type": "worker", "index": "2"},
                          "environment": "cloud"})
  r = TFConfigClusterResolver()
  assert (r.coordinator_address, r.num_processes, r.process_id, r.environment) == ("w0:1", 3, 2, "cloud")
  # The arguments override TF_CONFIG's task, rpc layer and environment.
  r = TFConfigClusterResolver(task_type="worker", task_id=0, rpc_layer="grpc+verbs", environment="google")
  assert (r.process_id, r.master(), r.environment) == (0, "grpc+verbs://w0:1", "google")
  # An evaluator is a job of its own (one process), as in TF.
  for cluster in (CLUSTER, {"chief": CLUSTER["chief"], "worker": CLUSTER["worker"]}):  # it may be left out
    tf_config(monkeypatch, {"cluster": cluster, "task": {"type": "evaluator", "index": 0}})
    r = TFConfigClusterResolver()
    assert (r.coordinator_address, r.num_processes, r.process_id, r.task_type) == (None, 1, 0, "evaluator")


def test_tf_config_absent_or_single_task(monkeypatch):
  r = TFConfigClusterResolver()
  assert (r.num_processes, r.process_id, r.task_type, r.task_id, r.master()) == (1, 0, None, None, "")
  assert not r.cluster_spec()
  tf_config(monkeypatch, {"cluster": {"worker": ["w:1"]}, "task": {"type": "worker", "index": 0}})
  assert (TFConfigClusterResolver().num_processes, TFConfigClusterResolver().master()) == (1, "")
  tf_config(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 1}, "session_master": "s:9"})
  assert TFConfigClusterResolver().master() == "s:9"  # TF's session_master wins


def test_tf_config_connects_through_the_common_interface(monkeypatch):
  calls = []
  monkeypatch.setattr(cluster_connection.distributed_lib, "initialize", lambda *a, **kw: calls.append((a, kw)))
  monkeypatch.setattr(cluster_connection.jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(cluster_connection, "_backends_initialized", lambda: False)
  monkeypatch.setattr(cluster_connection, "_CONNECTED", [])
  tf_config(monkeypatch, {"cluster": {"chief": ["127.0.0.1:5000"], "worker": ["127.0.0.1:5001"]},
                          "task": {"type": "worker", "index": 0}})
  tpustrat.experimental_connect_to_cluster(TFConfigClusterResolver())
  assert calls == [(("127.0.0.1:5000", 2, 1, None), dict(
      coordinator_bind_address="127.0.0.1:5000", initialization_timeout=300, heartbeat_timeout=100,
      shutdown_timeout=300))]


@pytest.mark.parametrize("config, kwargs, match", [
    ("{not json", {}, "TF_CONFIG is not valid JSON"),
    ("[1, 2]", {}, "TF_CONFIG must be a JSON object"),
    ({"cluster": ["w:1"]}, {}, r"TF_CONFIG\['cluster'\] must be an object"),
    ({"cluster": {"worker": "w:1"}}, {}, r"TF_CONFIG\['cluster'\]\['worker'\] must be a list"),
    ({"cluster": {"worker": ["w:1", "w2"]}}, {}, r"TF_CONFIG\['cluster'\]\['worker'\]\[1\] must be a \"host:port\""),
    ({"cluster": {"worker": ["w:1", 5]}}, {}, r"\['worker'\]\[1\] must be a \"host:port\" address, got 5"),
    ({"cluster": {"worker": ["w:port"]}}, {}, r"\['worker'\]\[0\] must be a \"host:port\""),
    # White space, an empty host, a port that is not plain ASCII digits (issue 31 item 12).
    ({"cluster": {"worker": ["h 1:1"]}}, {}, r"\['worker'\]\[0\] must be a \"host:port\" address, got 'h 1:1'"),
    ({"cluster": {"worker": ["w:1", "w:2 "]}}, {}, r"\['worker'\]\[1\] must be a \"host:port\" address"),
    ({"cluster": {"worker": ["\tw:1"]}}, {}, r"\['worker'\]\[0\] must be a \"host:port\" address"),
    ({"cluster": {"worker": ["w:\u0661\u0662"]}}, {}, r"\['worker'\]\[0\] must be a \"host:port\" address"),
    ({"cluster": {"worker": ["[]:1"]}}, {}, r"\['worker'\]\[0\] must be a \"host:port\" address"),
    ({"cluster": {"worker": {"x": "w:1"}}}, {}, r"\['worker'\] has the task index 'x'"),
    ({"cluster": CLUSTER, "task": "worker"}, {}, r"TF_CONFIG\['task'\] must be an object"),
    ({"cluster": CLUSTER, "task": {"type": 3, "index": 0}}, {}, r"TF_CONFIG\['task'\]\['type'\] must be a job"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": -1}}, {}, r"\['index'\] must be an int >= 0, got -1"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": True}}, {}, r"\['index'\] must be an int >= 0"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": 0}, "rpc_layer": 1}, {},
     r"TF_CONFIG\['rpc_layer'\] must be a string"),
    ({"cluster": {**CLUSTER, "ps": ["p:1"]}, "task": {"type": "worker", "index": 0}}, {},
     r"TF_CONFIG\['cluster'\]\['ps'\] names parameter servers"),
    ({"cluster": {"trainer": ["t:1"]}, "task": {"type": "trainer", "index": 0}}, {},
     r"TF_CONFIG\['cluster'\]\['trainer'\] is not a job tpustrat knows"),
    ({"cluster": {"chief": ["c:1", "c:2"]}, "task": {"type": "chief", "index": 0}}, {},
     r"\['chief'\] has 2 tasks; there is at most one chief"),
    ({"cluster": {"evaluator": ["e:1", "e:2"]}, "task": {"type": "evaluator", "index": 0}}, {},
     r"\['evaluator'\] has 2 tasks; there is at most one evaluator"),
    ({"cluster": {"worker": {"0": "w:1", "2": "w:3"}}, "task": {"type": "worker", "index": 0}}, {},
     r"\['worker'\] has no task 1"),
    ({"cluster": {"chief": ["h:1"], "worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}, {},
     "gives worker 0 the address 'h:1' of chief 0"),
    ({"cluster": CLUSTER}, {}, r"TF_CONFIG\['task'\]\['type'\] is not set"),
    ({"cluster": CLUSTER, "task": {"type": "worker"}}, {}, r"TF_CONFIG\['task'\]\['index'\] is not set"),
    ({"cluster": CLUSTER, "task": {"type": "master", "index": 0}}, {}, r"\['type'\] is 'master', which is not a job"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": 2}}, {}, r"\['index'\] is 2, out of range"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": 0}}, dict(task_id=5), "task_id is 5, out of range"),
    ({"cluster": CLUSTER, "task": {"type": "worker", "index": 0}}, dict(task_type="ps"), "task_type is 'ps'"),
    ({}, dict(task_id=-1), "`task_id` must be an int >= 0"),
])
def test_tf_config_errors_name_the_bad_field(monkeypatch, config, kwargs, match):
  tf_config(monkeypatch, config)
  with pytest.raises(ValueError, match=match):
    TFConfigClusterResolver(**kwargs)


def test_cluster_spec():
  spec = ClusterSpec({"worker": ["w0:1", "w1:1"], "evaluator": {"3": "e:1"}})
  assert spec.jobs == ["evaluator", "worker"] and spec.num_tasks("evaluator") == 1
  assert spec.task_indices("evaluator") == [3] and spec.job_tasks("evaluator") == [None, None, None, "e:1"]
  assert spec.as_dict() == {"evaluator": {3: "e:1"}, "worker": ["w0:1", "w1:1"]}
  assert spec == ClusterSpec(spec) and spec != ClusterSpec({"worker": ["w0:1"]}) and not ClusterSpec({})
  with pytest.raises(ValueError, match="No such job in cluster: 'ps'"):
    spec.task_address("ps", 0)
  with pytest.raises(ValueError, match="No task with index 2 in job 'worker'"):
    spec.task_address("worker", 2)
  with pytest.raises(ValueError, match="names a task index twice"):
    ClusterSpec({"worker": {"1": "a:1", 1: "b:1"}})


# -- a real job ---------------------------------------------------------------------------------------


@pytest.mark.processes
def test_two_processes_connect_through_a_slurm_environment():
  """2 processes x 4 CPU devices on loopback, each given only a Slurm step's variables (one node
  '127.0.0.1', two tasks): SlurmClusterResolver -> experimental_connect_to_cluster -> TPUStrategy, then an
  all-reduce over the 8 replicas of both processes, checked against numpy."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("TPUSTRAT_", "SLURM")) and k not in ("JAX_NUM_CPU_DEVICES", "TF_CONFIG")}
  out = subprocess.run(
      [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--timeout", "120",
       str(ROOT / "tests" / "_mp_scripts" / "slurm_job.py")],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
  assert out.returncode == 0, out.stderr[-4000:] + out.stdout[-4000:]
  results = launched_results(out.stdout)
  want = sum(np.arange(3, dtype=np.float32) + 10 * r for r in range(8))
  coordinators = {results[p]["resolver"][0] for p in (0, 1)}
  assert len(coordinators) == 1 and coordinators.pop().startswith("127.0.0.1:")
  for p in (0, 1):
    assert results[p]["resolver"][1:] == [2, p, "worker", p]
    assert results[p]["jax"] == [p, 2, 8, 4] and results[p]["replicas"] == 8
    np.testing.assert_array_equal(np.asarray(results[p]["local_sums"]), np.stack([want] * 4))
