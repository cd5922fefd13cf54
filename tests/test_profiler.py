"""Profiles (`tpustrat.experimental.profile`, ``launch --profile``): one trace per process, steps marked.

The traces are read back as JAX's profiler writes them: ``<dir>/plugins/profile/<run>/<host>.trace.json.gz``
(the trace viewer's JSON, which TensorBoard's profile plugin and Perfetto read) is parsed with gzip + json,
and the step marks are found as events with their names and ``step_num`` arguments.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat
from tpustrat import launch
from tpustrat._src import names, profiler

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_mp_scripts" / "profile_steps.py"


def trace_events(directory: str | os.PathLike) -> list[dict]:
  """Every event of the one trace under `directory` (a process's profile directory)."""
  files = sorted(pathlib.Path(directory).glob("plugins/profile/*/*.trace.json.gz"))
  assert len(files) == 1, files
  with gzip.open(files[0]) as f:
    return json.load(f)["traceEvents"]


def step_marks(events: list[dict]) -> list[tuple[str, int, int]]:
  """(name, step_num, steps) of each step mark, in time order."""
  marks = [e for e in events if e.get("ph") == "X" and "step_num" in e.get("args", {})]
  return [(e["name"], int(e["args"]["step_num"]), int(e["args"]["steps"])) for e in sorted(marks, key=lambda e: e["ts"])]


def input_waits(events: list[dict]) -> int:
  return sum(1 for e in events if e.get("name") == "tpustrat/input_wait")


def _train_step(w, x):
  loss = tpustrat.get_replica_context().all_reduce("sum", jnp.sum(x * w))
  return w - 0.01 * loss, loss


def _loop(strategy, runs=3, k=4):
  n = strategy.num_replicas_in_sync
  it = iter(strategy.experimental_distribute_dataset([np.ones(2 * n, np.float32)] * 16))
  w = jnp.float32(1.0)
  for _ in range(runs):
    w, _ = strategy.run(_train_step, args=(w, next(it)))
  w, losses = strategy.experimental_run_steps(_train_step, it, k, init=w)
  jax.block_until_ready((w, losses))


@pytest.mark.parametrize("kind", ["tpu", "mirrored"])
def test_profile_marks_steps_and_input_waits(strategy, tmp_path, kind):
  strat = strategy if kind == "tpu" else tpustrat.MirroredStrategy()
  _loop(strat)  # compiled outside the profile
  first = profiler.steps_dispatched()
  with tpustrat.experimental.profile(tmp_path, create_perfetto_trace=True) as directory:
    _loop(strat)
  assert directory == str(tmp_path / "process_0")
  assert profiler.steps_dispatched() == first + 7  # a run traced inside the scan is no step of its own
  events = trace_events(directory)
  assert step_marks(events) == [("run__train_step", first, 1), ("run__train_step", first + 1, 1),
                                ("run__train_step", first + 2, 1), ("run_steps__train_step", first + 3, 4)]
  assert input_waits(events) >= 4  # 3 next() and one take_steps (which may read in several chunks)
  assert list(pathlib.Path(directory).glob("plugins/profile/*/perfetto_trace.json.gz"))


def test_profile_stops_after_steps(strategy, tmp_path):
  _loop(strategy)
  with tpustrat.experimental.profile(tmp_path, steps=2) as directory:
    _loop(strategy)  # the profile ends once the second step has finished
    assert profiler._SESSION[0] is None
  assert [m[2] for m in step_marks(trace_events(directory))] == [1, 1]


def test_start_stop_and_errors(strategy, tmp_path):
  directory = tpustrat.experimental.start_profile(tmp_path / "a")
  try:
    with pytest.raises(RuntimeError, match="already running"):
      tpustrat.experimental.start_profile(tmp_path / "b")
    strategy.run(lambda: tpustrat.get_replica_context().replica_id_in_sync_group)
  finally:
    assert tpustrat.experimental.stop_profile() == directory
  assert tpustrat.experimental.stop_profile() is None
  assert len(step_marks(trace_events(directory))) == 1
  with pytest.raises(ValueError, match="steps must be a positive int"):
    tpustrat.experimental.start_profile(tmp_path, steps=0)


def test_no_marks_without_a_profiler(strategy):
  # Off the profile, a step costs a counter update and one C call: the marks are not made at all.
  assert not jax.profiler.TraceAnnotation.is_enabled()
  assert profiler.input_wait() is profiler._NO_MARK
  before = profiler.steps_dispatched()
  strategy.run(lambda: tpustrat.get_replica_context().replica_id_in_sync_group)
  assert profiler.steps_dispatched() == before + 1


def test_launcher_sets_the_profile_environment(tmp_path):
  env = launch.process_env({}, process_id=1, num_processes=2, devices_per_process=4, address="127.0.0.1:1",
                           heartbeat_timeout=10, initialization_timeout=60, shutdown_timeout=30,
                           profile_dir=str(tmp_path / "p"), profile_steps=5, compilation_cache="cache")
  assert env[names.ENV_PROFILE_DIR] == str(tmp_path / "p")
  assert env[names.ENV_PROFILE_STEPS] == "5"
  assert env[names.ENV_COMPILATION_CACHE_DIR] == os.path.abspath("cache")
  plain = launch.process_env({}, process_id=1, num_processes=2, devices_per_process=4, address="127.0.0.1:1",
                             heartbeat_timeout=10, initialization_timeout=60, shutdown_timeout=30)
  assert not {names.ENV_PROFILE_DIR, names.ENV_PROFILE_STEPS, names.ENV_COMPILATION_CACHE_DIR} & set(plain)
  with pytest.raises(ValueError, match="profile_steps needs profile"):
    launch.launch([sys.executable, "-c", "pass"], profile_steps=3)


def _env() -> dict[str, str]:
  return {k: v for k, v in os.environ.items()
          if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}


def _launch(*args: str) -> list[dict]:
  out = subprocess.run([sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", *args], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  results = [json.loads(line.split("RESULT ", 1)[1]) for line in out.stdout.splitlines() if "RESULT " in line]
  assert sorted(r["process"] for r in results) == [0, 1], out.stdout
  return results


@pytest.mark.processes
def test_two_by_four_job_writes_one_trace_per_process(tmp_path):
  # TPUStrategy over the job's 8 devices, each process profiling itself with the context manager.
  results = _launch(str(SCRIPT), "tpu", str(tmp_path / "ctx"))
  for r in results:
    assert r["directory"] == str(tmp_path / "ctx" / f"process_{r['process']}")
    assert step_marks(trace_events(r["directory"])) == [
        ("run_train_step", 0, 1), ("run_train_step", 1, 1), ("run_train_step", 2, 1), ("run_steps_train_step", 3, 4)]
  # A strategy over each process's own 4 devices, profiled by the launcher (--profile, --profile-steps).
  _launch("--profile", str(tmp_path / "launcher"), "--profile-steps", "4", str(SCRIPT), "mirrored")
  for i in (0, 1):
    events = trace_events(tmp_path / "launcher" / f"process_{i}")
    assert step_marks(events) == [("run_train_step", 0, 1), ("run_train_step", 1, 1), ("run_train_step", 2, 1),
                                  ("run_steps_train_step", 3, 4)]
    assert input_waits(events) >= 4
