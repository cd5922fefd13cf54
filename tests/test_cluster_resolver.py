"""The cluster resolver, `experimental_connect_to_cluster` and `initialize_tpu_system`: TF's semantics on 8 CPU
devices (`tpustrat._src.tpu_cluster_resolver`, `tpustrat._src.cluster_resolver`,
`tpustrat._src.cluster_connection`, `tpustrat._src.connect_to_cluster`)."""


import jax
import numpy as np
import pytest

import tpustrat
from tpustrat._src import cluster_connection, cluster_environment, names
from tpustrat._src.cluster_resolver import runtime_options
from tpustrat.cluster_resolver import TPUClusterResolver

ENV = (names.ENV_COORDINATOR_ADDRESS, names.ENV_NUM_PROCESSES, names.ENV_PROCESS_ID,
       names.ENV_LOCAL_DEVICE_IDS, "JAX_COORDINATOR_ADDRESS", names.ENV_COORDINATOR_BIND_ADDRESS,
       names.ENV_INITIALIZATION_TIMEOUT, names.ENV_HEARTBEAT_TIMEOUT, names.ENV_SHUTDOWN_TIMEOUT,
       "JAX_COORDINATOR_BIND_ADDRESS")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
  for name in ENV:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(cluster_environment, "detect_cluster", lambda: None)  # no TPU slice detection here


# -- resolver -----------------------------------------------------------------------------------------


def test_resolver_defaults_to_one_process():
  r = TPUClusterResolver()
  assert (r.num_processes, r.process_id, r.coordinator_address, r.local_device_ids) == (1, 0, None, None)
  assert r.master() == "" and r.task_type == "worker" and r.task_id == 0 and r.environment == ""
  assert r.num_accelerators() == {"CPU": 8}


def test_resolver_explicit_arguments():
  r = TPUClusterResolver(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2,
                         local_device_ids=[0, 1])
  assert (r.coordinator_address, r.num_processes, r.process_id, r.local_device_ids) == (
      "10.0.0.1:1234", 4, 2, [0, 1])
  assert r.master() == "10.0.0.1:1234" and r.task_id == 2


def test_resolver_environment_variables(monkeypatch):
  monkeypatch.setenv(names.ENV_COORDINATOR_ADDRESS, "127.0.0.1:5555")
  monkeypatch.setenv(names.ENV_NUM_PROCESSES, "2")
  monkeypatch.setenv(names.ENV_PROCESS_ID, "1")
  monkeypatch.setenv(names.ENV_LOCAL_DEVICE_IDS, "4,5,6,7")
  r = TPUClusterResolver()
  assert (r.coordinator_address, r.num_processes, r.process_id, r.local_device_ids) == (
      "127.0.0.1:5555", 2, 1, [4, 5, 6, 7])
  # Arguments win over the environment.
  assert TPUClusterResolver(num_processes=3, process_id=0).num_processes == 3


def test_resolver_uses_cluster_detection_unless_local(monkeypatch):
  monkeypatch.setattr(cluster_environment, "detect_cluster", lambda: ("10.1.1.1:8476", 4, 3))
  r = TPUClusterResolver(tpu="")
  assert (r.coordinator_address, r.num_processes, r.process_id) == ("10.1.1.1:8476", 4, 3)
  assert TPUClusterResolver(tpu="local").num_processes == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(tpu="grpc://10.240.1.2:8470"), "remote TPU Node"),
    (dict(tpu=["a", "b"]), "must be None or a string"),
    (dict(num_processes=0), "`num_processes` must be an int >= 1, got 0"),
    (dict(process_id=-1), "`process_id` must be an int >= 0, got -1"),
    (dict(num_processes=2, process_id=2), "out of range"),
    (dict(coordinator_address="nohost"), "host:port"),
    (dict(coordinator_address="h 1:1"), "coordinator_address must be a 'host:port' string, got 'h 1:1'"),
])
def test_resolver_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    TPUClusterResolver(**kwargs)


def test_resolver_bad_environment(monkeypatch):
  monkeypatch.setenv(names.ENV_NUM_PROCESSES, "two")
  with pytest.raises(ValueError, match="TPUSTRAT_NUM_PROCESSES='two'"):
    _ = TPUClusterResolver().num_processes
  monkeypatch.setenv(names.ENV_NUM_PROCESSES, "2")
  with pytest.raises(ValueError, match="need a coordinator address"):
    _ = TPUClusterResolver().num_processes


def test_resolver_timeouts_and_bind_address(monkeypatch):
  resolver = TPUClusterResolver(coordinator_address="127.0.0.1:5000", num_processes=2, process_id=1)
  options = runtime_options(resolver)
  # JAX's defaults; a loopback coordinator listens on loopback only (JAX's default is every interface).
  assert options == dict(coordinator_bind_address="127.0.0.1:5000", initialization_timeout=300,
                         heartbeat_timeout=100, shutdown_timeout=300)
  remote = runtime_options(TPUClusterResolver(coordinator_address="10.0.0.1:5000", num_processes=2, process_id=1,
                                              heartbeat_timeout=7))
  assert remote["coordinator_bind_address"] is None and remote["heartbeat_timeout"] == 7  # JAX's default bind
  monkeypatch.setenv("TPUSTRAT_INITIALIZATION_TIMEOUT", "12")
  monkeypatch.setenv("TPUSTRAT_COORDINATOR_BIND_ADDRESS", "0.0.0.0:5000")
  from_env = runtime_options(TPUClusterResolver(coordinator_address="127.0.0.1:5000", num_processes=2, process_id=0,
                                                shutdown_timeout=9))
  assert from_env == dict(coordinator_bind_address="0.0.0.0:5000", initialization_timeout=12,
                          heartbeat_timeout=100, shutdown_timeout=9)
  with pytest.raises(ValueError, match="`heartbeat_timeout` must be an int >= 1, got 0"):
    TPUClusterResolver(heartbeat_timeout=0)
  with pytest.raises(ValueError, match="coordinator_bind_address must be a 'host:port' string"):
    TPUClusterResolver(coordinator_bind_address="nowhere")
  monkeypatch.setenv("TPUSTRAT_HEARTBEAT_TIMEOUT", "soon")
  with pytest.raises(ValueError, match="TPUSTRAT_HEARTBEAT_TIMEOUT='soon' must be an int >= 1"):
    runtime_options(TPUClusterResolver())


# -- connect ------------------------------------------------------------------------------------------


def test_connect_is_a_noop_for_one_process(monkeypatch):
  calls = []
  monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
  resolver = TPUClusterResolver()
  assert tpustrat.experimental_connect_to_cluster(resolver) is None
  tpustrat.experimental_connect_to_cluster(resolver)
  tpustrat.experimental_connect_to_cluster()
  assert calls == [] and not jax.distributed.is_initialized()


def test_connect_starts_jax_distributed_once_for_several_processes(monkeypatch):
  """No real second process here (the multi-process launcher tests that): jax.distributed is stubbed."""
  calls = []
  monkeypatch.setattr(cluster_connection.distributed_lib, "initialize", lambda *a, **kw: calls.append((a, kw)))
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
  monkeypatch.setattr(cluster_connection, "_backends_initialized", lambda: False)
  monkeypatch.setattr(cluster_connection, "_CONNECTED", [])
  resolver = TPUClusterResolver(coordinator_address="127.0.0.1:4321", num_processes=2, process_id=1)
  tpustrat.experimental_connect_to_cluster(resolver)
  tpustrat.experimental_connect_to_cluster(resolver)  # idempotent
  tpustrat.experimental_connect_to_cluster(
      TPUClusterResolver(coordinator_address="127.0.0.1:4321", num_processes=2, process_id=1))
  assert calls == [(("127.0.0.1:4321", 2, 1, None), dict(
      coordinator_bind_address="127.0.0.1:4321",  # a loopback coordinator listens on loopback only
      initialization_timeout=300, heartbeat_timeout=100, shutdown_timeout=300))]
  with pytest.raises(ValueError, match="already connected"):
    tpustrat.experimental_connect_to_cluster(
        TPUClusterResolver(coordinator_address="127.0.0.1:4321", num_processes=2, process_id=0))


def test_connect_after_backends_started_is_an_error(monkeypatch):
  monkeypatch.setattr(cluster_connection, "_CONNECTED", [])
  resolver = TPUClusterResolver(coordinator_address="127.0.0.1:4321", num_processes=2, process_id=0)
  with pytest.raises(RuntimeError, match="already initialised"):  # this process's backends are up
    tpustrat.experimental_connect_to_cluster(resolver)
  with pytest.raises(TypeError, match="TPUClusterResolver"):
    tpustrat.experimental_connect_to_cluster("grpc://host:8470")


def test_resolver_local_device_ids_forms():
  # One device id, as `jax.distributed.initialize(local_device_ids=3)` takes it (one GPU per process).
  assert TPUClusterResolver(local_device_ids=3).local_device_ids == [3]
  assert TPUClusterResolver(local_device_ids=np.int64(2)).local_device_ids == [2]
  assert TPUClusterResolver(local_device_ids=(0, 1)).local_device_ids == [0, 1]
  with pytest.raises(ValueError, match=r"local_device_ids must be an int or a sequence of ints >= 0, got '0,1'"):
    TPUClusterResolver(local_device_ids="0,1")
  with pytest.raises(ValueError, match=r"`local_device_ids\[1\]` must be an int >= 0, got -1"):
    TPUClusterResolver(local_device_ids=[0, -1])
