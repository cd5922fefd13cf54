"""Multi-process jobs on this machine through `python -m tpustrat.launch`: 2 processes x 4 CPU devices, gloo.

Few and small jobs, as the box has 2 cores: one runs the whole API and the flagship example (compared with
the same code on this process's 8 devices), two check faults (a process killed, a process stopped), and
the bad-input cases are jobs that fail within a second or a few. The scripts live in `tests/_mp_scripts`.
"""

from __future__ import annotations

import importlib.util
import io
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import launched_results

from tpustrat._src import names

SCRIPTS = pathlib.Path(__file__).resolve().parent / "_mp_scripts"
ROOT = SCRIPTS.parents[1]
LAUNCH = [sys.executable, "-m", "tpustrat.launch", "--num-processes", "2", "--devices-per-process", "4"]


def _env() -> dict[str, str]:
  """This environment without what the launcher sets per process (and without this process's 8 devices)."""
  return {k: v for k, v in os.environ.items()
          if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}


def _launch(*args: str, timeout: float) -> subprocess.CompletedProcess:
  return subprocess.run(LAUNCH + list(args), env=_env(), cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def _load(name: str, path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the example sets it on import: restore it
    spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def across():
  return _load("across_processes", SCRIPTS / "across_processes.py")


def _results(out):
  """{process index: its RESULT} from the launcher's prefixed output of a 2-process job."""
  return launched_results(out.stdout)


@pytest.fixture(scope="module")
def job():
  """One launch of tests/_mp_scripts/across_processes.py: {process index: its RESULT}."""
  out = _launch("--timeout", "240", str(SCRIPTS / "across_processes.py"), timeout=300)
  assert out.returncode == 0, out.stderr[-4000:]
  return _results(out)


def _assert_close(got, want, path="result"):
  if isinstance(want, dict):
    assert sorted(got) == sorted(want), path
    for k in want:
      _assert_close(got[k], want[k], f"{path}[{k!r}]")
  elif isinstance(want, list) and any(isinstance(w, (list, dict)) for w in want):
    assert len(got) == len(want), path
    for i, (g, w) in enumerate(zip(got, want)):
      _assert_close(g, w, f"{path}[{i}]")
  else:
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-6,
                               err_msg=path)


# -- everything works across processes ------------------------------------------------------------


@pytest.mark.processes
def test_api_gives_the_one_process_answers_in_every_process(job, across, strategy):
  # run, reduce, gather, ReplicaContext collectives, reduce_to, tpustrat.ops with groups, distributed
  # datasets (padded partial batch), datasets_from_function (one shard per process), run_steps: every
  # process holds the complete host-side answers, equal to those of one process with 8 devices.
  want = across.check_api(strategy)
  for p in (0, 1):
    _assert_close(job[p]["api"], want, f"process {p}")


@pytest.mark.processes
def test_each_process_holds_its_own_replicas_and_reads_its_own_shard(job):
  for p in (0, 1):
    local = job[p]["local"]
    assert local["process"] == [p, 2]
    assert local["local_replica_ids"] == [4 * p + r for r in range(4)]  # 4 of the 8, not all 8
    assert local["local_mirrored"] == 4 and local["worker_devices"] == 4
    assert local["input_context"] == [2, p, 8]  # num_input_pipelines = process count
  # A batch of 12 rows on 8 replicas: 2 rows each for replicas 0-5, padding for 6-7 (left out).
  assert job[0]["local"]["local_batch_rows"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert job[1]["local"]["local_batch_rows"] == [[8, 9], [10, 11], [], []]


@pytest.mark.processes
def test_classifier_on_two_processes_gives_the_losses_of_one_process(job, across):
  # examples/classifier.py, same arguments, 2 processes x 4 devices vs this process's 8 devices
  # (measured: bit-identical).
  want = across.classifier_losses()
  for p in (0, 1):
    np.testing.assert_allclose(job[p]["losses"], want, rtol=1e-6)
  assert want[-1] < want[0]


_NO_REPLICA = """
import json
import jax
import numpy as np
import tpustrat

tpustrat.experimental_connect_to_cluster()  # before jax.devices()
me = jax.process_index()
strategy = tpustrat.TPUStrategy(device_assignment=[d for d in jax.devices() if d.process_index == 0])
calls = []

def value_fn(ctx):
  calls.append(ctx.replica_id_in_sync_group)
  return {"x": np.full([2], ctx.replica_id_in_sync_group, np.float32), "n": ctx.replica_id_in_sync_group}

v = strategy.experimental_distribute_values_from_function(value_fn)
doubled = strategy.run(lambda v: v["x"] * 2 + v["n"], args=(v,))
total = strategy.reduce("SUM", doubled, axis=None)
print("RESULT", json.dumps(dict(
    calls=calls, workers=len(strategy.extended.worker_devices),
    shapes=[list(a.shape) for a in jax.tree.leaves(v.tree)],
    dtypes=[str(a.dtype) for a in jax.tree.leaves(v.tree)],
    shards=[len(a.addressable_shards) for a in jax.tree.leaves(v.tree)],
    total=np.asarray(total).tolist() if me == 0 else None)), flush=True)
"""


@pytest.mark.processes
def test_each_process_counts_its_steps_and_warns_of_slow_input_and_retracing(job):
  """tests/_mp_scripts/across_processes.py `step_stats`: 40 steps over a source that sleeps per element,
  windows of 20 steps, then one function compiled for 6 shapes; every process counts its own."""
  for p in (0, 1):
    got = job[p]["step_stats"]
    assert got["steps"] == 40 and got["history"] == [1] * 40
    assert got["input_seconds"] >= got["slept"]  # the waits hold the source's sleeps
    assert got["input_seconds"] + got["device_seconds"] <= got["wall_seconds"]
    kinds = [kind for kind, _ in got["warnings"]]
    assert kinds == ["InputBoundWarning", "RetracingWarning"], got["warnings"]
    assert "over its last 20 steps" in got["warnings"][0][1]
    assert "the argument at args[0] changed from float32[5] to float32[6]" in got["warnings"][1][1]


@pytest.mark.processes
def test_a_process_that_holds_no_replica_builds_values_from_function_too():
  # A strategy on process 0's 4 devices only: process 1 holds none of its replicas. It contributes no
  # data, but gets the same global value (no shards of its own) and follows run / reduce like process 0;
  # value_fn ran there once, for replica 0, only for the value's structure, shapes and dtypes.
  out = _launch("--timeout", "90", "--", "-c", _NO_REPLICA, timeout=120)
  assert out.returncode == 0, out.stderr[-4000:]
  results = _results(out)
  want = dict(shapes=[[4], [4, 2]], dtypes=["int32", "float32"])  # leaves in key order: n, x
  # total: the sum over replicas r = 0..3 of 2 * r + r
  assert results[0] == dict(want, calls=[0, 1, 2, 3], workers=4, shards=[4, 4], total=[18.0, 18.0])
  assert results[1] == dict(want, calls=[0], workers=0, shards=[0, 0], total=None)


# -- faults -----------------------------------------------------------------------------------------


def _start_training(*launcher_args: str):
  """Starts tests/_mp_scripts/train_until_killed.py; returns (launcher, {process: pid}, stderr lines)."""
  launcher = subprocess.Popen(
      LAUNCH + list(launcher_args) + ["--timeout", "120", str(SCRIPTS / "train_until_killed.py")],
      env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  lines: queue.Queue[str] = queue.Queue()
  errors: list[str] = []
  readers = [threading.Thread(target=lambda: [lines.put(l) for l in launcher.stdout], daemon=True),
             threading.Thread(target=lambda: errors.extend(launcher.stderr), daemon=True)]
  for t in readers:
    t.start()
  launcher.readers, launcher.errors = readers, errors
  pids: dict[int, int] = {}
  deadline = time.monotonic() + 90
  while len(pids) < 2:
    try:
      line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
    except queue.Empty:
      _finish(launcher, pids, timeout=0.1)
      pytest.fail("the training job did not start: " + "".join(errors)[-3000:])
    if " ready pid=" in line:
      pids[int(line[len("[proc "):line.index("]")])] = int(line.rsplit("=", 1)[1])
  return launcher, pids


def _finish(launcher, pids, timeout):
  """Waits for the launcher; returns (seconds waited, its stderr). Past `timeout`, kills the launcher and
  the training processes (which run in sessions of their own) and fails."""
  start = time.monotonic()
  try:
    launcher.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    pass
  finally:
    elapsed = time.monotonic() - start
    if launcher.returncode is None:
      launcher.kill()
      launcher.wait()
      for pid in pids.values():
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    for t in launcher.readers:
      t.join(10)
    launcher.stdout.close()
    launcher.stderr.close()
  if elapsed >= timeout:
    pytest.fail(f"the launcher did not stop within {timeout} s: " + "".join(launcher.errors)[-3000:])
  return elapsed, "".join(launcher.errors)


@pytest.mark.processes
def test_a_killed_process_stops_the_others_and_is_reported():
  launcher, pids = _start_training("--heartbeat-timeout", "5", "--grace-period", "20")
  os.kill(pids[1], signal.SIGKILL)
  elapsed, err = _finish(launcher, pids, timeout=60)
  assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
  assert "process 1 failed first: it was killed by SIGKILL" in err, err[-3000:]
  # Process 0 was stopped by JAX's distributed runtime (heartbeats, or its collectives failing), not
  # by the launcher, within the heartbeat timeout (5 s) plus start-up noise.
  assert "process 0 stopped on its own" in err, err[-3000:]
  assert elapsed < 20, f"{elapsed:.1f} s"


@pytest.mark.processes
def test_a_hung_process_is_declared_dead_and_killed():
  launcher, pids = _start_training("--heartbeat-timeout", "5", "--grace-period", "2")
  os.kill(pids[1], signal.SIGSTOP)  # hangs: no progress, no heartbeats, no exit
  elapsed, err = _finish(launcher, pids, timeout=60)
  # The status is the blamed process's (killed by the launcher: 137), not that of process 0, which JAX
  # aborted (134) when it declared process 1 dead (issue 31 item 9).
  assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
  assert "the launcher exits with 137, the status of process 1." in err, err[-3000:]
  # JAX's coordinator (in process 0) declares process 1 dead and stops process 0; the launcher names
  # process 1 as the culprit and kills it.
  assert "process 1 failed first: it stopped responding to heartbeats" in err, err[-3000:]
  assert "Process 1 was still running 2 s after the failure and was killed by the launcher" in err, err[-3000:]
  assert elapsed < 25, f"{elapsed:.1f} s"


# -- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, message", [
    # process 1 is told 3 processes, the others 2; whichever process compares first says so
    ("count", r"process \d\) was started for a job of (2 processes, but process 1 for 3|3 processes, but "
              r"the coordinator for 2)"),
    # process 1 has 3 CPU devices, process 0 has 4
    ("devices", r"different numbers of devices \(process 0: 4, process 1: 3\)"),
    # process 1 says it is process 0 too: the second to start its coordinator finds the port taken,
    # and the other one waits for a process 1 that never comes, until the initialization timeout
    ("id", r"process 0 runs the coordinator, but 127\.0\.0\.1:\d+ is already in use(.|\n)*process 0 of 2 gave "
           r"up after 8 s \(initialization_timeout\): not every process"),
    # jax.devices() before TPUStrategy() joins the job
    ("late", r"must start before JAX initialises its backends, but they are already initialised"),
])
@pytest.mark.processes
def test_a_badly_started_job_fails_with_a_clear_error(mode, message):
  out = _launch("--initialization-timeout", "8" if mode == "id" else "60", "--heartbeat-timeout", "5",
                "--timeout", "90", str(SCRIPTS / "bad_cluster.py"), mode, timeout=120)
  # The second "process 0" cannot start its coordinator: it exits with EXIT_START_FAILED (75), first.
  status = names.EXIT_START_FAILED if mode == "id" else 1
  assert out.returncode == status, out.stderr[-3000:]
  assert re.search(message, out.stderr), out.stderr[-3000:]
  assert re.search(rf"tpustrat.launch: process [01] failed first: it exited with status {status}", out.stderr), \
      out.stderr[-3000:]


@pytest.mark.processes
def test_an_unreachable_coordinator_is_named_within_the_timeout():
  with socket.socket() as s:  # a port nobody listens on
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  env = _env() | {"TPUSTRAT_COORDINATOR_ADDRESS": address, "TPUSTRAT_NUM_PROCESSES": "2",
                  "TPUSTRAT_PROCESS_ID": "1", "TPUSTRAT_INITIALIZATION_TIMEOUT": "2"}
  start = time.monotonic()
  out = subprocess.run([sys.executable, "-c", "import tpustrat; tpustrat.TPUStrategy()"], env=env,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 1
  assert f"process 1 of 2 could not reach the coordinator at {address} within 2 s" in out.stderr, out.stderr
  assert time.monotonic() - start < 20


# -- pieces, in this process ---------------------------------------------------------------------------


@pytest.fixture
def no_cluster_env(monkeypatch):
  for name in list(os.environ):
    if name.startswith("TPUSTRAT_") or name in ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_BIND_ADDRESS"):
      monkeypatch.delenv(name)
  return monkeypatch


def test_launcher_names_the_process_that_hangs_not_the_first_to_exit():
  from tpustrat import launch

  def proc(index, returncode, ended, lines=(), killed=False):
    p = launch._Proc(index, None, 0.0, returncode=returncode, ended=ended, killed=killed)
    for line in lines:
      p.note(line)
      p.tail.append(line)
    return p

  died = [proc(0, -6, 3.0, ["E... The following tasks are unhealthy (stopped sending heartbeats):", "2",
                            "The tasks have crashed."]),
          proc(1, -6, 3.1), proc(2, -9, 9.0, killed=True)]
  report = launch._report(died, died[0], 0.0, 5.0)
  assert report.startswith("process 2 failed first: it stopped responding to heartbeats"), report
  assert "process 0 then was killed by SIGABRT after 3.0 s" in report
  assert "Process 2 was still running 5 s after the failure and was killed by the launcher" in report
  assert "process 1 stopped on its own: it was killed by SIGABRT +0.1 s after the failure" in report
  # The coordinator hangs: the others lose its heartbeat replies.
  lost = [proc(0, -9, 8.0, killed=True),
          proc(1, -6, 3.0, ["absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded", "",
                            "RPC: /xla.coordination.CoordinationService/Heartbeat"])]
  assert launch._report(lost, lost[1], 0.0, 5.0).startswith("process 0 failed first: it stopped responding")
  # A plain failure: the first process to exit.
  plain = [proc(0, 0, 4.0), proc(1, 1, 2.0, ["Traceback ...", "ValueError: boom"])]
  report = launch._report(plain, plain[1], 0.0, 5.0)
  assert report.startswith("process 1 failed first: it exited with status 1 after 2.0 s.")
  assert "process 0 exited normally" in report and "ValueError: boom" in report
  assert launch._exit_status(-9) == 137 and launch._exit_status(75) == 75


@pytest.mark.processes
def test_launcher_arguments():
  bad = subprocess.run(LAUNCH[:3] + ["--num-processes", "0", "x.py"], env=_env(), capture_output=True, text=True,
                       timeout=30)
  assert bad.returncode == 2 and "--num-processes must be a positive int" in bad.stderr
  missing = subprocess.run(LAUNCH, env=_env(), capture_output=True, text=True, timeout=30)
  assert missing.returncode == 2 and "give the script to run" in missing.stderr
  # The environment each process gets: what TPUClusterResolver() reads, M CPU devices, gloo.
  from tpustrat import launch  # not imported by `import tpustrat`

  env = launch.process_env({"XLA_FLAGS": "--xla_foo --xla_force_host_platform_device_count=8",
                            "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1"}, process_id=1, num_processes=3,
                           devices_per_process=4, address="127.0.0.1:1234", heartbeat_timeout=7,
                           initialization_timeout=8, shutdown_timeout=9)
  assert env["XLA_FLAGS"] == "--xla_foo --xla_force_host_platform_device_count=4"
  assert "JAX_COORDINATOR_ADDRESS" not in env
  assert {k: env[k] for k in ("TPUSTRAT_COORDINATOR_ADDRESS", "TPUSTRAT_COORDINATOR_BIND_ADDRESS",
                              "TPUSTRAT_NUM_PROCESSES", "TPUSTRAT_PROCESS_ID", "TPUSTRAT_HEARTBEAT_TIMEOUT",
                              "JAX_NUM_CPU_DEVICES", "JAX_CPU_COLLECTIVES_IMPLEMENTATION", "JAX_PLATFORMS")} == {
      "TPUSTRAT_COORDINATOR_ADDRESS": "127.0.0.1:1234", "TPUSTRAT_COORDINATOR_BIND_ADDRESS": "127.0.0.1:1234",
      "TPUSTRAT_NUM_PROCESSES": "3", "TPUSTRAT_PROCESS_ID": "1", "TPUSTRAT_HEARTBEAT_TIMEOUT": "7",
      "JAX_NUM_CPU_DEVICES": "4", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo", "JAX_PLATFORMS": "cpu"}


# -- the launcher: a coordinator port taken before process 0 binds it, processes started safely ----------


@pytest.fixture
def in_process_launch(no_cluster_env):
  """`launch.launch` in this process, its output captured: call(command, **kw) -> (status, stdout, stderr)."""
  from tpustrat import launch

  for name in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"):
    no_cluster_env.delenv(name, raising=False)

  def call(command, **kwargs):
    out, err = io.BytesIO(), io.BytesIO()
    kwargs = dict(num_processes=2, heartbeat_timeout=5, initialization_timeout=30, timeout=60) | kwargs
    status = launch.launch(command, stdout=out, stderr=err, **kwargs)
    return status, out.getvalue().decode(), err.getvalue().decode()

  return call


def _ports(monkeypatch, *first):
  """Makes the launcher's port chooser return `first`, then free ports; returns the list of ports given."""
  from tpustrat import launch

  given, free, queued = [], launch._free_port, list(first)
  monkeypatch.setattr(launch, "_free_port", lambda: given.append(queued.pop(0) if queued else free()) or given[-1])
  return given


_CONNECT = ("import os, tpustrat; s = tpustrat.TPUStrategy(); "
            "print('connected', os.environ['TPUSTRAT_COORDINATOR_ADDRESS'], s.num_replicas_in_sync, flush=True)")


@pytest.mark.processes
def test_launcher_retries_on_a_fresh_port_when_the_coordinator_port_is_taken(in_process_launch, monkeypatch):
  # Another program takes the free port the launcher chose before process 0 binds it (here: before the
  # launcher even starts). The job used to fail; the launcher now starts it again on a fresh port.
  with socket.socket() as thief:
    thief.bind(("127.0.0.1", 0))
    thief.listen()
    taken = thief.getsockname()[1]
    given = _ports(monkeypatch, taken)
    status, out, err = in_process_launch([sys.executable, "-c", _CONNECT])
  assert status == 0, err[-3000:]
  assert len(given) == 2 and given[0] == taken and given[1] != taken, given
  connected = sorted(line for line in out.splitlines() if " connected " in line)
  assert connected == [f"[proc {i}] connected 127.0.0.1:{given[1]} 2" for i in (0, 1)], out[-3000:]
  assert f"process 0 runs the coordinator, but 127.0.0.1:{taken} is already in use" in err, err[-3000:]
  assert (f"tpustrat.launch: the coordinator port 127.0.0.1:{taken} was taken before process 0 could bind "
          f"it; starting again on 127.0.0.1:{given[1]} (attempt 2 of 3)") in err, err[-3000:]


def _fake_taken(who: int) -> str:
  """A program whose process `who` fails as process 0 does when the coordinator's port is taken: it says
  so and exits with `names.EXIT_START_FAILED`."""
  return ("import os, sys, time\n"
          f"if os.environ['TPUSTRAT_PROCESS_ID'] == '{who}':\n"
          "  address = os.environ['TPUSTRAT_COORDINATOR_ADDRESS']\n"
          "  print(f'CoordinatorPortTaken: experimental_connect_to_cluster: process 0 runs the coordinator, '\n"
          "        f'but {address} is already in use: another job is listening there.', file=sys.stderr)\n"
          f"  sys.exit({names.EXIT_START_FAILED})\n"
          "time.sleep(30)\n")


@pytest.mark.processes
def test_launcher_retries_a_taken_port_a_bounded_number_of_times_and_nothing_else(in_process_launch, monkeypatch):
  from tpustrat import launch

  # Taken every time: 3 attempts, then the failure is reported as usual.
  given = _ports(monkeypatch)
  status, _, err = in_process_launch([sys.executable, "-c", _fake_taken(0)], grace_period=0.5)
  assert status == names.EXIT_START_FAILED and len(given) == launch._PORT_ATTEMPTS == 3, (given, err[-3000:])
  assert err.count("tpustrat.launch: starting 2 processes") == 3
  assert f"process 0 failed first: it exited with status {names.EXIT_START_FAILED}" in err and "is already in use" in err
  # Not retried: a port given by the user; the same status from a process that does not run the
  # coordinator; any other failure of process 0.
  for command, kwargs, want in (
      (_fake_taken(0), dict(port=given[0]), names.EXIT_START_FAILED),
      (_fake_taken(1), {}, names.EXIT_START_FAILED),
      ("import sys; sys.exit(4)", {}, 4),
  ):
    given = _ports(monkeypatch)
    status, _, err = in_process_launch([sys.executable, "-c", command], grace_period=0.5, **kwargs)
    assert status == want and err.count("tpustrat.launch: starting 2 processes") == 1, err[-3000:]
    assert len(given) == (0 if "port" in kwargs else 1)


@pytest.mark.processes
def test_a_taken_coordinator_port_ends_the_process_with_the_start_failed_status():
  # The launcher learns of it from the exit status alone (names.EXIT_START_FAILED), not from the message.
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    s.listen()
    address = f"127.0.0.1:{s.getsockname()[1]}"
    script = ("from tpustrat._src import distributed\n"
              f"distributed.initialize({address!r}, 2, 0, None, coordinator_bind_address={address!r}, "
              "initialization_timeout=5, heartbeat_timeout=5, shutdown_timeout=5, exit_on_uncaught=True)\n")
    out = subprocess.run([sys.executable, "-c", script], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
  assert out.returncode == names.EXIT_START_FAILED, out.stderr[-3000:]
  taken = f"CoordinatorPortTaken: experimental_connect_to_cluster: process 0 runs the coordinator, but {address} is"
  assert f"{taken} already in use" in out.stderr, out.stderr[-3000:]
  assert f"process 0 of 2 could not start the job's coordinator; it exits at once with status {names.EXIT_START_FAILED}" in out.stderr


@pytest.mark.processes
def test_launcher_starts_processes_without_preexec_fn(in_process_launch, monkeypatch):
  # `preexec_fn` runs Python code between fork and exec, which can deadlock when the program calling
  # launch() has threads (Python's subprocess docs); setting the parent-death signal moved into the child.
  from tpustrat import launch

  calls = []
  popen = subprocess.Popen
  monkeypatch.setattr(launch.subprocess, "Popen", lambda *a, **kw: calls.append(kw) or popen(*a, **kw))
  status, out, err = in_process_launch([sys.executable, "-c", "import sys; print(sys.argv[1:])", "a b", "c"])
  assert status == 0, err
  assert len(calls) == 2 and all(kw.get("preexec_fn") is None and kw["start_new_session"] for kw in calls)
  assert sorted(out.splitlines()) == ["[proc 0] ['a b', 'c']", "[proc 1] ['a b', 'c']"]
  with pytest.raises(FileNotFoundError):
    in_process_launch(["/nonexistent/program"])


def _gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie nobody reaped yet is gone too
  except FileNotFoundError:
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.processes
def test_processes_die_with_a_launcher_killed_by_sigkill():
  # Nothing of the launcher runs then: each process asked Linux for SIGKILL when the launcher dies.
  # (SIGTERM and the processes' leftover children: the tests above.)
  script = "import os, time; print('ready pid=%d' % os.getpid(), flush=True); time.sleep(60)"
  launcher = subprocess.Popen(LAUNCH[:3] + ["-n", "2", "--", "-c", script], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
  pids = []
  try:
    for line in launcher.stdout:
      if " ready pid=" in line:
        pids.append(int(line.rsplit("=", 1)[1]))
        if len(pids) == 2:
          break
    assert len(pids) == 2, "the launcher ended before its processes reported"
    launcher.kill()
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10  # the kernel delivers the signals asynchronously
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
  finally:
    launcher.kill()
    launcher.wait()
    launcher.stdout.close()
    for p in pids:
      try:
        os.kill(p, signal.SIGKILL)
      except ProcessLookupError:
        pass


# -- the launcher: stopped, and the processes' children -------------------------------------------------------------------------------------


def _start(tmp_path, body: str, *args: str) -> subprocess.Popen:
  script = tmp_path / "job.py"
  script.write_text(textwrap.dedent(body))
  launcher = subprocess.Popen([sys.executable, "-m", "tpustrat.launch", "-n", "2", *args, str(script)],
                              env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  return launcher


def _read_pids(launcher: subprocess.Popen, word: str, count: int) -> list[int]:
  pids = []
  for line in launcher.stdout:
    if f" {word}=" in line:
      pids.append(int(line.rsplit("=", 1)[1]))
      if len(pids) == count:
        return pids
  raise AssertionError(f"the job ended before printing {count} {word}: {launcher.stderr.read()[-3000:]}")


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
  deadline = time.monotonic() + seconds  # the kernel delivers SIGKILL asynchronously
  while not _gone(pid):
    if time.monotonic() > deadline:
      os.kill(pid, signal.SIGKILL)
      return False
    time.sleep(0.02)
  return True


@pytest.mark.processes
def test_launcher_stopped_by_sigterm_kills_the_job_and_reports_sigterm(tmp_path):
  launcher = _start(tmp_path, """
      import os, time
      print("ready pid=%d" % os.getpid(), flush=True)
      time.sleep(120)
      """)
  try:
    pids = _read_pids(launcher, "pid", 2)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM  # 143, as for any program ended by SIGTERM
  finally:
    launcher.kill()
    launcher.communicate()
  assert all(_wait_gone(pid) for pid in pids)


@pytest.mark.processes
def test_launcher_leaves_no_orphaned_children_behind(tmp_path):
  # A process that starts a helper and ends without stopping it: the helper must not outlive the job
  # (it would hold the output pipes open and the launcher would wait for them).
  launcher = _start(tmp_path, """
      import subprocess, sys
      helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
      print("helper pid=%d" % helper.pid, flush=True)
      """)
  try:
    helpers = _read_pids(launcher, "pid", 2)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, err
  finally:
    launcher.kill()
  assert all(_wait_gone(pid) for pid in helpers)


def test_launch_reports_a_signal_exit_status():
  from tpustrat import launch

  assert launch._exit_status(-signal.SIGTERM) == 143


# -- MultiWorkerMirroredStrategy; MirroredStrategy refused in a multi-process job (issue 32) --------------


@pytest.mark.processes
def test_multi_worker_mirrored_strategy_spans_the_job_and_mirrored_strategy_is_refused():
  out = _launch("--timeout", "120", str(SCRIPTS / "multi_worker_mirrored.py"), timeout=180)
  assert out.returncode == 0, out.stderr[-4000:]
  job = _results(out)
  x = np.arange(8 * 5, dtype=np.float64).reshape(8, 5) ** 1.5
  for p in (0, 1):
    got = job[p]
    # Before: each process made a 4-replica job of its own, silently. Now both paths raise, naming the
    # strategies that span processes, whether or not the job is connected yet, explicit devices included.
    assert "TPUSTRAT_NUM_PROCESSES=2" in got["before_connecting"]
    assert f"process {p} of 2 of a connected multi-process job" in got["connected"]
    for message in (got["before_connecting"], got["connected"], got["local_devices"]):
      assert "MultiWorkerMirroredStrategy()" in message and "TPUStrategy" in message
    assert got["replicas"] == [8, 4]
    coordinator = got["resolver"]["spec"]["worker"][0]
    assert got["resolver"] == {"type": "TPUClusterResolver", "task": ["worker", p],
                               "spec": {"worker": [coordinator, None]}, "accelerators": {"CPU": 4},
                               "processes": [2, p]}
    assert coordinator.startswith("127.0.0.1:")
    for sums in got["sums"]:  # ring (the strategy's options), NCCL (the call's), reduce_to
      np.testing.assert_allclose(sums, x.sum(0), rtol=1e-6)
    assert got["ring_lowered"]
