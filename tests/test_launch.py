"""`python -m tpustrat.launch`'s restarts (``--max-restarts``) and ``--step-timeout``, on tiny jobs.

The jobs are small Python programs that do not import JAX: each start of a job takes a fraction of a
second. Each process prints one ``START {...}`` line with what the launcher gave it; the tests read them
from the launcher's prefixed output. (Jobs that do run JAX: tests/test_multiprocess.py.)
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from tpustrat import launch
from tpustrat._src import names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Prints what the launcher told this process, as one line: "START {json}".
_REPORT = """\
import json, os, signal, sys, time
ENV = {k: os.environ.get(k) for k in ("TPUSTRAT_PROCESS_ID", "TPUSTRAT_RESTART_COUNT",
                                      "TPUSTRAT_COORDINATOR_ADDRESS", "TPUSTRAT_STEP_TIMEOUT", "TPUSTRAT_JOB_ID")}
print("START " + json.dumps(ENV), flush=True)
ID, RESTART = int(ENV["TPUSTRAT_PROCESS_ID"]), int(ENV["TPUSTRAT_RESTART_COUNT"])
"""


@pytest.fixture
def run(monkeypatch, tmp_path):
  """Writes `body` (after `_REPORT`) to a script and launches it in this process, output captured:
  run(body, **launch_kwargs) -> (status, starts, stderr), `starts` being every process's START record
  in the order they were printed."""
  for name in list(os.environ):
    if name.startswith("TPUSTRAT_") or name in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_COORDINATOR_ADDRESS",
                                                "JAX_COORDINATOR_BIND_ADDRESS"):
      monkeypatch.delenv(name)

  def call(body: str, **kwargs):
    script = tmp_path / "job.py"
    script.write_text(_REPORT + textwrap.dedent(body))
    out, err = io.BytesIO(), io.BytesIO()
    kwargs = dict(num_processes=2, heartbeat_timeout=5, initialization_timeout=30, grace_period=5.0,
                  timeout=60) | kwargs
    status = launch.launch([sys.executable, str(script)], stdout=out, stderr=err, **kwargs)
    starts = [json.loads(line.split(" START ", 1)[1]) for line in out.getvalue().decode().splitlines()
              if " START " in line]
    return status, starts, err.getvalue().decode()

  return call


def _by_start(starts: list[dict]) -> dict[int, list[dict]]:
  """{restart count: the START records of that start}."""
  grouped: dict[int, list[dict]] = {}
  for s in starts:
    grouped.setdefault(int(s["TPUSTRAT_RESTART_COUNT"]), []).append(s)
  return grouped


def _restart_lines(err: str) -> list[str]:
  return [line for line in err.splitlines() if line.startswith("tpustrat.launch: restarting the job")]


# -- restarts ----------------------------------------------------------------------------------------------


@pytest.mark.processes
def test_a_restart_request_restarts_the_whole_job_on_a_fresh_port(run):
  # Process 1 asks to be restarted (as the preemption handler does) on the first start only.
  status, starts, err = run(f"""
      if ID == 1 and RESTART == 0:
        sys.exit({names.EXIT_RESTART})
      """, max_restarts=1)
  assert status == 0, err[-3000:]
  assert _restart_lines(err) == [
      "tpustrat.launch: restarting the job (restart 1 of 1): process 1 exited with status 42 (the preemption "
      "handler saved a checkpoint and asked to be restarted)"], err[-3000:]
  assert err.count("tpustrat.launch: starting 2 processes") == 2
  # Before restarting, the failure was reported as without restarts.
  assert "process 1 failed first: it exited with status 42" in err
  grouped = _by_start(starts)
  assert sorted(grouped) == [0, 1], starts
  for records in grouped.values():  # every process of every start, each once
    assert sorted(r["TPUSTRAT_PROCESS_ID"] for r in records) == ["0", "1"], starts
    assert len({r["TPUSTRAT_COORDINATOR_ADDRESS"] for r in records}) == 1, starts
  first, second = (grouped[i][0]["TPUSTRAT_COORDINATOR_ADDRESS"] for i in (0, 1))
  assert first != second and first.startswith("127.0.0.1:") and second.startswith("127.0.0.1:")
  assert f"coordinator {second}" in err


@pytest.mark.processes
def test_a_port_given_is_kept_across_restarts(run):
  port = launch._free_port()
  status, starts, err = run("""
      if ID == 0 and RESTART == 0:
        sys.exit(5)
      """, max_restarts=1, port=port)
  assert status == 0, err[-3000:]
  assert {s["TPUSTRAT_COORDINATOR_ADDRESS"] for s in starts} == {f"127.0.0.1:{port}"}
  assert sorted(_by_start(starts)) == [0, 1]
  assert _restart_lines(err) == [
      "tpustrat.launch: restarting the job (restart 1 of 1): process 0 exited with status 5"]


@pytest.mark.parametrize("max_restarts", [1, 2])
@pytest.mark.processes
def test_a_job_that_keeps_failing_is_started_max_restarts_plus_one_times(run, max_restarts):
  status, starts, err = run("sys.exit(3)\n", max_restarts=max_restarts)
  assert status == 3, err[-3000:]
  assert sorted(_by_start(starts)) == list(range(max_restarts + 1)) and len(starts) == 2 * (max_restarts + 1)
  assert err.count("tpustrat.launch: starting 2 processes") == max_restarts + 1
  restarts = _restart_lines(err)
  assert [line.split(":")[1] for line in restarts] == [
      f" restarting the job (restart {i} of {max_restarts})" for i in range(1, max_restarts + 1)], err[-3000:]
  assert all(line.endswith("exited with status 3") for line in restarts), restarts
  assert (f"tpustrat.launch: not restarting: the job failed {max_restarts + 1} times "
          f"(--max-restarts {max_restarts}).") in err


@pytest.mark.processes
def test_without_max_restarts_a_failure_ends_the_job(run):
  status, starts, err = run(f"""
      if ID == 1:
        sys.exit({names.EXIT_RESTART})
      """)  # max_restarts=0: the default
  assert status == names.EXIT_RESTART, err[-3000:]
  assert sorted(_by_start(starts)) == [0] and len(starts) == 2
  assert not _restart_lines(err) and "not restarting" not in err
  assert err.count("tpustrat.launch: starting 2 processes") == 1
  assert ("process 1 failed first: it exited with status 42 (the preemption handler saved a checkpoint and "
          "asked to be restarted)") in err, err[-3000:]
  # Success is never restarted either.
  status, starts, err = run("", max_restarts=3)
  assert status == 0 and len(starts) == 2 and not _restart_lines(err), err[-3000:]


@pytest.mark.processes
def test_a_process_killed_by_a_signal_restarts_the_job(run):
  status, starts, err = run("""
      if ID == 1 and RESTART == 0:
        os.kill(os.getpid(), signal.SIGKILL)
      """, max_restarts=2)
  assert status == 0, err[-3000:]
  assert sorted(_by_start(starts)) == [0, 1]
  assert _restart_lines(err) == [
      "tpustrat.launch: restarting the job (restart 1 of 2): process 1 was killed by SIGKILL"], err[-3000:]


@pytest.mark.processes
def test_taken_port_retries_are_not_restarts(run, monkeypatch):
  # On the first port the launcher chooses, process 0 finds the coordinator's port taken (status 75): the
  # launcher starts the job again on another port, which is no restart. That start fails: restarted once.
  taken = launch._free_port()
  ports = [taken]
  free = launch._free_port
  monkeypatch.setattr(launch, "_free_port", lambda: ports.pop(0) if ports else free())
  status, starts, err = run(f"""
      if ENV["TPUSTRAT_COORDINATOR_ADDRESS"] == "127.0.0.1:{taken}":
        if ID == 0:
          sys.exit({names.EXIT_START_FAILED})
        time.sleep(60)  # killed by the launcher
      if ID == 1 and RESTART == 0:
        sys.exit(7)
      """, max_restarts=1)
  assert status == 0, err[-3000:]
  assert "(attempt 2 of 3)" in err and err.count("tpustrat.launch: starting 2 processes") == 3, err[-3000:]
  assert _restart_lines(err) == [
      "tpustrat.launch: restarting the job (restart 1 of 1): process 1 exited with status 7"], err[-3000:]
  # Two starts numbered 0 (process 1 of the first may be killed before it prints), then one numbered 1.
  counts = {}
  for s in starts:
    counts.setdefault(s["TPUSTRAT_COORDINATOR_ADDRESS"], set()).add(s["TPUSTRAT_RESTART_COUNT"])
  assert list(counts.values()) == [{"0"}, {"0"}, {"1"}], starts
  assert list(counts)[0] == f"127.0.0.1:{taken}"
  assert sorted(_by_start(starts)) == [0, 1] and len(_by_start(starts)[1]) == 2, starts


@pytest.mark.processes
def test_timeout_ends_the_job_without_restarting(run):
  # Every process hangs: --timeout kills them and the launcher exits with 124.
  begin = time.monotonic()
  status, starts, err = run("time.sleep(60)\n", max_restarts=3, timeout=1.0)
  assert status == 124, err[-3000:]
  assert {s["TPUSTRAT_RESTART_COUNT"] for s in starts} <= {"0"} and not _restart_lines(err), err[-3000:]
  assert err.count("tpustrat.launch: starting 2 processes") == 1
  assert "timeout: still running after 1 s (--timeout)" in err
  # A process failed, and the timeout runs out while the others get their grace period: no restart either.
  status, starts, err = run("""
      if ID == 1:
        sys.exit(3)
      time.sleep(60)
      """, max_restarts=3, timeout=1.0, grace_period=30.0)
  assert status == 3 and not _restart_lines(err), err[-3000:]
  assert err.count("tpustrat.launch: starting 2 processes") == 1
  assert "timeout: still running after 1 s (--timeout)" in err
  assert time.monotonic() - begin < 15


@pytest.mark.processes
def test_no_restart_is_made_past_the_deadline(run, monkeypatch):
  # The --timeout deadline runs out between a failure and the restart that would follow it: here, the
  # launcher's clock jumps two hours ahead once the first start has been reported.
  report, clock = launch._report, time.monotonic

  def report_then_jump(*args, **kwargs):
    monkeypatch.setattr(launch, "time", types.SimpleNamespace(monotonic=lambda: clock() + 7200.0,
                                                              sleep=time.sleep))
    return report(*args, **kwargs)

  monkeypatch.setattr(launch, "_report", report_then_jump)
  status, starts, err = run("sys.exit(3)\n", max_restarts=3, timeout=3600.0)
  assert status == 3 and len(starts) == 2 and not _restart_lines(err), err[-3000:]
  assert "tpustrat.launch: not restarting: the 3600 s of --timeout have run out." in err


@pytest.mark.processes
def test_a_stopped_launcher_does_not_restart(tmp_path):
  script = tmp_path / "job.py"
  script.write_text("import os, time\nprint('ready pid=%d' % os.getpid(), flush=True)\ntime.sleep(120)\n")
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_")}
  launcher = subprocess.Popen([sys.executable, "-m", "tpustrat.launch", "-n", "2", "--max-restarts", "3",
                               str(script)], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
  try:
    ready = 0
    for line in launcher.stdout:
      ready += " ready pid=" in line
      if ready == 2:
        break
    assert ready == 2, launcher.stderr.read()[-3000:]
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
  finally:
    launcher.kill()
    launcher.wait()
  assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert "restarting" not in err and err.count("tpustrat.launch: starting 2 processes") == 1, err[-3000:]


# -- the environment of each process -------------------------------------------------------------------------------


@pytest.mark.processes
def test_step_timeout_is_set_in_every_process_only_when_given(run, monkeypatch):
  status, starts, err = run("", step_timeout=2.5)
  assert status == 0, err[-3000:]
  assert [s["TPUSTRAT_STEP_TIMEOUT"] for s in starts] == ["2.5", "2.5"]
  # Not given: the launcher does not set it ...
  status, starts, err = run("")
  assert status == 0 and [s["TPUSTRAT_STEP_TIMEOUT"] for s in starts] == [None, None], err[-3000:]
  # ... nor removes what its own environment has.
  monkeypatch.setenv(names.ENV_STEP_TIMEOUT, "7")
  status, starts, err = run("")
  assert status == 0 and [s["TPUSTRAT_STEP_TIMEOUT"] for s in starts] == ["7", "7"], err[-3000:]
  status, starts, err = run("", step_timeout=30)
  assert status == 0 and [s["TPUSTRAT_STEP_TIMEOUT"] for s in starts] == ["30", "30"], err[-3000:]


def test_process_env_sets_the_restart_count_and_the_step_timeout():
  common = dict(process_id=0, num_processes=2, devices_per_process=1, address="127.0.0.1:1",
                heartbeat_timeout=5, initialization_timeout=6, shutdown_timeout=7)
  env = launch.process_env({names.ENV_RESTART_COUNT: "9", names.ENV_STEP_TIMEOUT: "4"}, **common)
  assert env[names.ENV_RESTART_COUNT] == "0" and env[names.ENV_STEP_TIMEOUT] == "4"
  env = launch.process_env({}, step_timeout=0.25, restart_count=2, **common)
  assert env[names.ENV_RESTART_COUNT] == "2" and env[names.ENV_STEP_TIMEOUT] == "0.25"
  assert names.ENV_STEP_TIMEOUT not in launch.process_env({}, **common)


@pytest.mark.processes
def test_a_step_watchdog_exit_is_described(run):
  status, _, err = run(f"""
      if ID == 0:
        sys.exit({names.EXIT_STEP_TIMEOUT})
      """, max_restarts=1)
  assert status == names.EXIT_STEP_TIMEOUT, err[-3000:]
  watchdog = ("exited with status 124 (its step watchdog or checkpoint deadline fired: a step, save or restore "
              "waited longer than its timeout)")
  assert f"process 0 failed first: it {watchdog}" in err, err[-3000:]
  assert _restart_lines(err) == [f"tpustrat.launch: restarting the job (restart 1 of 1): process 0 {watchdog}"]


def test_the_cause_names_the_process_that_hangs():
  def proc(index, returncode, ended, lines=(), killed=False):
    p = launch._Proc(index, None, 0.0, returncode=returncode, ended=ended, killed=killed)
    for line in lines:
      p.note(line)
    return p

  procs = [proc(0, -6, 3.0, ["The following tasks are unhealthy (stopped sending heartbeats):", "1"]),
           proc(1, -9, 9.0, killed=True)]
  assert launch._cause(procs, procs[0]) == (
      "process 1 stopped responding to heartbeats (JAX declared it dead; process 0 then was killed by SIGABRT)")
  plain = [proc(0, 0, 1.0), proc(1, 3, 2.0)]
  assert launch._cause(plain, plain[1]) == "process 1 exited with status 3"
  assert launch._describe(names.EXIT_START_FAILED).startswith("exited with status 75 (it could not start: the "
                                                              "coordinator's address is in use")


def test_a_peer_killed_in_a_save_is_named_even_when_its_end_is_reported_second():
  # Under load the kernel reported a SIGKILLed process's end after its peer's, which had seen the connections
  # close and stopped the save with 69 ("another process stopped in the middle of the save"): the launcher
  # named the victim, and exited with its 69 (a flaky CI run of test_checkpoint.py's 2 x 4 job).
  def proc(index, returncode, ended, order, killed=False):
    return launch._Proc(index, None, 0.0, returncode=returncode, ended=ended, order=order, killed=killed)

  peer = launch._describe(names.EXIT_CHECKPOINT_PEER_LOST)
  procs = [proc(0, names.EXIT_CHECKPOINT_PEER_LOST, 2.0, 0), proc(1, -9, 2.1, 1)]
  procs[0].tail.append("tpustrat: checkpoint save failed: another process of the job stopped ...")
  assert launch._culprit(procs, procs[0]) == (procs[1], "peer")
  assert launch._cause(procs, procs[0]) == f"process 1 was killed by SIGKILL (process 0 then {peer})"
  text = launch._report(procs, procs[0], 0.0, 20.0)
  assert text.startswith("process 1 failed first: it was killed by SIGKILL after 2.1 s."), text
  assert f"process 0 stopped on its own: it {peer} -0.1 s after the failure." in text, text
  assert "the launcher exits with 137, the status of process 1." in text, text
  assert text.endswith("last output of process 0:\n    tpustrat: checkpoint save failed: another process of the "
                       "job stopped ..."), text  # the evidence: the output of the first process to end
  # Not when the other process ended well, or was killed by the launcher after the failure: 69 is then first.
  for other in (proc(1, 0, 2.1, 1), proc(1, -9, 22.0, 1, killed=True)):
    assert launch._culprit([procs[0], other], procs[0]) == (procs[0], "")
  # A process JAX aborted because it lost the coordinator (process 0, whose failed save ended it) is a victim
  # too, even when its end is reported before the SIGKILLed one's.
  aborted = proc(2, -6, 2.05, 1)
  aborted.note("Terminating process because the JAX distributed service detected fatal errors. absl::Status: "
               "UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
               "preempted/died/restarted unexpectedly or this task is experiencing network issues.")
  killed = proc(1, -9, 2.1, 2)
  assert launch._culprit([procs[0], killed, aborted], procs[0]) == (killed, "peer")


def test_a_save_a_peer_died_in_is_not_reported_as_a_storage_error():
  # Issue 43 item 10, 4 processes: process 2 is SIGKILLed during a save; processes 0 and 3 stop the failed
  # save with 69 (a barrier across the processes failed), and process 0's end takes the coordinator with it,
  # so process 1, still running, prints JAX's "leader" error and is aborted. The launcher names process 2
  # (not process 0 as a hung coordinator), and says of the others that the storage refused nothing.
  def proc(index, returncode, ended, lines=()):
    p = launch._Proc(index, None, 0.0, returncode=returncode, ended=ended)
    for line in lines:
      p.note(line)
    return p

  leader_lost = ("Terminating process because the JAX distributed service detected fatal errors. absl::Status: "
                 "UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was "
                 "preempted/died/restarted unexpectedly or this task is experiencing network issues.")
  procs = [proc(0, names.EXIT_CHECKPOINT_PEER_LOST, 2.1), proc(1, -6, 2.4, [leader_lost]), proc(2, -9, 2.0),
           proc(3, names.EXIT_CHECKPOINT_PEER_LOST, 2.1)]
  assert launch._culprit(procs, procs[2]) == (procs[2], "")
  assert launch._cause(procs, procs[2]) == "process 2 was killed by SIGKILL"
  peer = launch._describe(names.EXIT_CHECKPOINT_PEER_LOST)
  assert peer == ("exited with status 69 (it failed to save a checkpoint because another process stopped in the "
                  "middle of the save (a barrier or collective across the processes failed: a peer died, hung or "
                  "lost its connection); the storage refused nothing, and the previous checkpoints are intact)")
  text = launch._report(procs, procs[2], 0.0, 20.0)
  assert text.startswith("process 2 failed first: it was killed by SIGKILL after 2.0 s."), text
  for i in (0, 3):
    assert f"process {i} stopped on its own: it {peer} +0.1 s after the failure." in text, text
  assert "the launcher exits with 137, the status of process 2." in text
  assert "storage refused a write" not in text
  assert launch._describe(names.EXIT_CHECKPOINT_FAILED) == (
      "exited with status 74 (it failed to save a checkpoint: the storage refused a write (disk full, read-only "
      "file system, I/O error); the previous checkpoints are intact)")
  # A coordinator that hangs is still named by the others' "leader" errors.
  hung = [proc(0, -9, 9.0), proc(1, -6, 2.4, [leader_lost])]
  hung[0].killed = True
  assert launch._culprit(hung, hung[1]) == (hung[0], "heartbeats")


# -- arguments ---------------------------------------------------------------------------------------------------


@pytest.fixture
def main():
  """`launch.main`; the signal handlers it installs (SIGTERM, SIGHUP) are undone afterwards."""
  signums = [getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
  previous = {signum: signal.getsignal(signum) for signum in signums}
  yield launch.main
  for signum, handler in previous.items():
    signal.signal(signum, handler)


@pytest.mark.parametrize("args, message", [
    (["--max-restarts", "-1"], "--max-restarts must be a non-negative int, got '-1'"),
    (["--max-restarts", "two"], "--max-restarts must be a non-negative int, got 'two'"),
    (["--step-timeout", "0"], "--step-timeout must be a number of seconds in [1, 2147483647], got '0'."),
    (["--step-timeout", "-3"], "--step-timeout must be a number of seconds in [1, 2147483647], got '-3'."),
    (["--step-timeout", "nan"], "--step-timeout must be a number of seconds in [1, 2147483647], got 'nan'."),
    (["--step-timeout", "inf"], "--step-timeout must be a number of seconds in [1, 2147483647], got 'inf'."),
    # Out-of-range timeouts (issue 21 item 15): beyond JAX's int32 seconds, and absurdly small.
    (["--step-timeout", "1e-300"], "--step-timeout must be a number of seconds in [1, 2147483647], got '1e-300'."),
    (["--step-timeout", "0.5"], "--step-timeout must be a number of seconds in [1, 2147483647], got '0.5'."),
    (["--step-timeout", "3e9"], "--step-timeout must be a number of seconds in [1, 2147483647], got '3e9'."),
    (["--heartbeat-timeout", "2147483648"], "--heartbeat-timeout must be a whole number of seconds in "
     "[1, 2147483647], got '2147483648' (JAX's distributed runtime takes int32 seconds)."),
    (["--initialization-timeout", "3000000000"], "--initialization-timeout must be a whole number of seconds "
     "in [1, 2147483647], got '3000000000' (JAX's distributed runtime takes int32 seconds)."),
    (["--shutdown-timeout", "0"], "--shutdown-timeout must be a whole number of seconds in [1, 2147483647], "
     "got '0'"),
    (["--heartbeat-timeout", "1.5"], "--heartbeat-timeout must be a whole number of seconds in [1, 2147483647], "
     "got '1.5'"),
    (["--timeout", "1e-300"], "--timeout must be a number of seconds in [1, 2147483647], got '1e-300'."),
    (["--timeout", "1e10"], "--timeout must be a number of seconds in [1, 2147483647], got '1e10'."),
    (["--grace-period", "-1"], "--grace-period must be a number of seconds in [0, 2147483647], got '-1'."),
    (["--termination-grace-period", "1e12"],
     "--termination-grace-period must be a number of seconds in [0, 2147483647], got '1e12'."),
    (["--port", "65535"], "--port must be in [0, 65534] (the next port is the job check's), got 65535"),
])
def test_bad_arguments_are_rejected(main, capsys, args, message):
  with pytest.raises(SystemExit) as e:
    main(args + ["job.py"])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_launch_rejects_bad_values():
  for kwargs in (dict(max_restarts=-1), dict(max_restarts=1.5), dict(step_timeout=0), dict(step_timeout=-1.0)):
    with pytest.raises(ValueError, match="max_restarts|step_timeout"):
      launch.launch([sys.executable, "-c", "pass"], **kwargs)
  for kwargs, message in (
      (dict(heartbeat_timeout=2**31), "launch: heartbeat_timeout must be a whole number of seconds in "
                                      "[1, 2147483647], got 2147483648 (JAX's distributed runtime takes int32 "
                                      "seconds)."),
      (dict(initialization_timeout=0), "launch: initialization_timeout must be a whole number of seconds"),
      (dict(shutdown_timeout=10**12), "launch: shutdown_timeout must be a whole number of seconds"),
      (dict(step_timeout=1e-300), "launch: step_timeout must be a number of seconds in [1, 2147483647], got "
                                  "1e-300."),
      (dict(timeout=float("inf")), "launch: timeout must be a number of seconds in [1, 2147483647], got inf."),
      (dict(grace_period=-0.5), "launch: grace_period must be a number of seconds in [0, 2147483647]"),
      (dict(termination_grace_period=float("nan")), "launch: termination_grace_period must be a number"),
      (dict(port=65535), "launch: port must be an int in [0, 65534]"),
  ):
    with pytest.raises(ValueError) as e:
      launch.launch([sys.executable, "-c", "pass"], **kwargs)
    assert message in str(e.value), (kwargs, str(e.value))


def test_the_range_bounds_themselves_are_accepted(main, monkeypatch):
  calls = []
  monkeypatch.setattr(launch, "launch", lambda *a, **kw: calls.append(kw) or 0)
  assert main(["--heartbeat-timeout", "2147483647", "--initialization-timeout", "1", "--shutdown-timeout",
               "2147483647", "--step-timeout", "1", "--timeout", "2147483647", "--grace-period", "0",
               "--termination-grace-period", "0", "--port", "65534", "job.py"]) == 0
  assert {k: calls[0][k] for k in ("heartbeat_timeout", "initialization_timeout", "shutdown_timeout",
                                   "step_timeout", "timeout", "grace_period", "termination_grace_period",
                                   "port")} == dict(
      heartbeat_timeout=2147483647, initialization_timeout=1, shutdown_timeout=2147483647, step_timeout=1.0,
      timeout=2147483647.0, grace_period=0.0, termination_grace_period=0.0, port=65534)
  assert calls[0]["termination_grace_period"] == 0.0


def test_a_step_timeout_in_the_launchers_environment_is_checked_too(main, monkeypatch, capsys):
  # Without --step-timeout the variable is passed on to every process as it is: checked first, too.
  monkeypatch.setenv(names.ENV_STEP_TIMEOUT, "1e-300")
  with pytest.raises(SystemExit) as e:
    main(["job.py"])
  assert e.value.code == 2
  assert ("TPUSTRAT_STEP_TIMEOUT (in the launcher's environment) must be a number of seconds in "
          "[1, 2147483647], got '1e-300'.") in capsys.readouterr().err
  with pytest.raises(ValueError, match=r"TPUSTRAT_STEP_TIMEOUT \(in the launcher's environment\) must be"):
    launch.launch([sys.executable, "-c", "pass"])
  monkeypatch.setenv(names.ENV_STEP_TIMEOUT, "9")  # in range: fine (the flag would replace it)
  monkeypatch.setattr(launch, "launch", lambda *a, **kw: 0)
  assert main(["job.py"]) == 0


@pytest.mark.processes
def test_main_restarts_and_sets_the_step_timeout(main, monkeypatch, tmp_path):
  for name in list(os.environ):
    if name.startswith("TPUSTRAT_") or name in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES"):
      monkeypatch.delenv(name)
  script = tmp_path / "job.py"
  script.write_text(_REPORT + f"if ID == 1 and RESTART == 0:\n  sys.exit({names.EXIT_RESTART})\n")
  calls = []
  real = launch.launch
  monkeypatch.setattr(launch, "launch", lambda *a, **kw: calls.append(kw) or real(
      *a, **(kw | dict(stdout=out, stderr=err))))
  out, err = io.BytesIO(), io.BytesIO()
  status = main(["-n", "2", "--max-restarts", "1", "--step-timeout", "1.5", "--grace-period", "5", str(script)])
  assert status == 0, err.getvalue().decode()[-3000:]
  assert calls[0]["max_restarts"] == 1 and calls[0]["step_timeout"] == 1.5
  starts = [json.loads(line.split(" START ", 1)[1]) for line in out.getvalue().decode().splitlines()
            if " START " in line]
  assert sorted(s["TPUSTRAT_RESTART_COUNT"] for s in starts) == ["0", "0", "1", "1"]
  assert {s["TPUSTRAT_STEP_TIMEOUT"] for s in starts} == {"1.5"}
  assert "restarting the job (restart 1 of 1): process 1 exited with status 42" in err.getvalue().decode()
  # The defaults: no restart, no step timeout.
  calls.clear()
  with monkeypatch.context() as m:
    m.setattr(launch, "launch", lambda *a, **kw: calls.append(kw) or 0)
    assert main([str(script)]) == 0
  assert calls[0]["max_restarts"] == 0 and calls[0]["step_timeout"] is None


# -- launchers in their own processes ----------------------------------------------------------------------

SCRIPTS = os.path.join(ROOT, "tests", "_mp_scripts")


def _env() -> dict[str, str]:
  """This environment without the job's variables and this process's 8 devices."""
  return {k: v for k, v in os.environ.items()
          if not k.startswith(("TPUSTRAT_", "SLURM_")) and k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}


# `python -m tpustrat.launch` as a terminal starts it, with Ctrl-C (SIGINT) handled. A process started from a
# background job of a non-interactive shell (`make test-processes &`, `(pytest ...) &` in a script) has SIGINT
# ignored, its children inherit that, and the launcher rightly leaves an ignored SIGINT ignored: the Ctrl-C
# tests below then failed for the way the suite was started (seen: every SIGINT-first test timed out).
_LAUNCH_AS_FROM_A_TERMINAL = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                              "runpy.run_module('tpustrat.launch', run_name='__main__', alter_sys=True)")


def _start_launcher(*args: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", _LAUNCH_AS_FROM_A_TERMINAL, *args], env=_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_lines(launcher: subprocess.Popen, word: str, count: int) -> list[str]:
  """Reads the launcher's stdout until `count` lines contain `word`; those lines."""
  found = []
  for line in launcher.stdout:
    if word in line:
      found.append(line.rstrip("\n"))
      if len(found) == count:
        return found
  raise AssertionError(f"the job ended before printing {count} x {word!r}: {launcher.stderr.read()[-3000:]}")


def _state(pid: int) -> str:
  """The process state letter in /proc (Z: ended, not yet reaped); 'gone' once reaped."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0]
  except FileNotFoundError:
    return "gone"


def _wait_until(predicate, seconds: float, what: str) -> None:
  deadline = time.monotonic() + seconds
  while not predicate():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.01)


def _stop_and_reap(launcher: subprocess.Popen) -> None:
  """Whatever happened, leaves no launcher behind (it kills its processes when it dies)."""
  try:
    launcher.send_signal(signal.SIGCONT)
  except ProcessLookupError:
    pass
  launcher.kill()
  launcher.communicate()


# -- a second job on the same port (issue 21 item 7) -------------------------------------------------------


@pytest.mark.processes
def test_a_second_job_on_the_same_port_fails_and_leaves_the_running_job_alone(tmp_path):
  # Job A (2 processes x 2 devices) connects on a port and waits; job B is started with the same --port.
  # B's process 1 used to pass the TCP check and register with A's coordinator, which then aborted A
  # ("different incarnation", exit 134). Now B's process 1 reads A's job identity at the job check port
  # first and stops with a clear error; B's process 0 finds the port taken. A goes on and finishes.
  port = launch._free_port()
  go = tmp_path / "go"
  a = _start_launcher("-n", "2", "-d", "2", "--port", str(port), "--heartbeat-timeout", "10", "--timeout", "150",
                      os.path.join(SCRIPTS, "wait_then_sum.py"), str(go))
  try:
    _wait_for_lines(a, " connected", 2)
    b = subprocess.run([sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "2", "--port", str(port),
                        "--grace-period", "30", "--timeout", "90", os.path.join(SCRIPTS, "wait_then_sum.py"),
                        str(tmp_path / "never")], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    go.touch()
    out, err = a.communicate(timeout=120)
  finally:
    _stop_and_reap(a)
  # A finished normally, with the right numbers: the sum over its 4 replicas of (replica id + 1).
  assert a.returncode == 0, err[-3000:]
  results = [json.loads(line.split(" RESULT ", 1)[1]) for line in out.splitlines() if " RESULT " in line]
  assert results == [{"sum": float(sum(range(1, 5))), "replicas": 4}] * 2, out[-3000:]
  assert "incarnation" not in err
  # B failed, at once, with the start-failed status and an error naming the address and the other job.
  assert b.returncode == names.EXIT_START_FAILED, b.stderr[-3000:]
  assert ("[proc 1] tpustrat._src.distributed.CoordinatorOfAnotherJob: experimental_connect_to_cluster: "
          "process 1 of 2 of job 'launch-") in b.stderr, b.stderr[-3000:]
  assert (f"will not join the coordinator at 127.0.0.1:{port}: another job holds that address (its process 0 "
          f"answered the job check at 127.0.0.1:{port + 1} with job 'launch-") in b.stderr, b.stderr[-3000:]
  assert "This process did not register with it" in b.stderr
  assert f"process 0 runs the coordinator, but 127.0.0.1:{port} is already in use" in b.stderr, b.stderr[-3000:]
  assert "RESULT" not in b.stdout


@pytest.mark.processes
def test_each_start_has_its_own_job_identity(run, monkeypatch):
  monkeypatch.setenv(names.ENV_JOB_ID, "from-the-launchers-environment")  # replaced: a start is a job
  status, starts, err = run("""
      if ID == 1 and RESTART == 0:
        sys.exit(3)
      """, max_restarts=1)
  assert status == 0, err[-3000:]
  ids = {}
  for s in starts:
    ids.setdefault(s["TPUSTRAT_RESTART_COUNT"], set()).add(s["TPUSTRAT_JOB_ID"])
  assert sorted(ids) == ["0", "1"] and all(len(v) == 1 for v in ids.values()), starts
  first, second = ids["0"].pop(), ids["1"].pop()
  assert first != second and first.startswith("launch-") and second.startswith("launch-"), (first, second)
  common = dict(process_id=0, num_processes=2, devices_per_process=1, address="127.0.0.1:1",
                heartbeat_timeout=5, initialization_timeout=6, shutdown_timeout=7)
  assert launch.process_env({}, job_id="j", **common)[names.ENV_JOB_ID] == "j"
  assert names.ENV_JOB_ID not in launch.process_env({}, **common)


def test_the_launcher_chooses_a_port_whose_next_port_is_free_too():
  import socket  # pylint: disable=import-outside-toplevel

  for _ in range(20):
    port = launch._free_port()
    for p in (port, port + 1):
      with socket.socket() as s:
        s.bind(("127.0.0.1", p))  # raises if taken


@pytest.mark.processes
def test_the_largest_timeouts_reach_jax():
  # 2**31 - 1 s is the most JAX takes (int32); the initialization timeout is given to JAX with a margin
  # of 15 s, which used to overflow: a TypeError inside jax.distributed.initialize.
  big = str(names.MAX_TIMEOUT_SECONDS)
  out = subprocess.run([sys.executable, "-m", "tpustrat.launch", "-n", "2", "--heartbeat-timeout", big,
                        "--initialization-timeout", big, "--shutdown-timeout", big, "--timeout", "120", "--", "-c",
                        "import tpustrat; s = tpustrat.TPUStrategy(); print('connected', s.num_replicas_in_sync)"],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
  assert out.returncode == 0, out.stderr[-3000:]
  assert sorted(line for line in out.stdout.splitlines() if " connected " in line) == [
      "[proc 0] connected 2", "[proc 1] connected 2"], out.stdout[-3000:]


# -- SIGTERM to the launcher (issue 21 item 9) --------------------------------------------------------------

# Each process (and a helper it starts, in its process group) saves on SIGTERM, slowly, then exits with 42.
_SAVES_ON_SIGTERM = """\
import os, signal, subprocess, sys, time
out = sys.argv[1]
me = os.environ["TPUSTRAT_PROCESS_ID"]
mode = sys.argv[2]
helper = subprocess.Popen([sys.executable, "-c", (
    "import os, signal, sys, time\\n"
    "def done(*_):\\n"
    f"  open(os.path.join({out!r}, 'helper{me}'), 'w').write('terminated')\\n"
    "  sys.exit(0)\\n"
    "signal.signal(signal.SIGTERM, done)\\n"
    "print('helper up', flush=True)\\n"
    "time.sleep(120)\\n")], stdout=subprocess.PIPE, text=True)
assert helper.stdout.readline() == "helper up\\n"
def save(*_):
  time.sleep(0.5)  # a save takes a while: the launcher must wait for it
  open(os.path.join(out, f"saved{me}"), "w").write(f"process {me} saved")
  helper.wait(timeout=30)
  os._exit(42)
if mode == "save" or me == "0":
  signal.signal(signal.SIGTERM, save)
else:  # "ignore": process 1 does not react to SIGTERM at all
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(f"ready pid={os.getpid()}", flush=True)
time.sleep(120)
sys.exit(5)
"""


def _terminated_job(tmp_path, mode: str, *args: str) -> subprocess.Popen:
  script = tmp_path / "job.py"
  script.write_text(_SAVES_ON_SIGTERM)
  launcher = _start_launcher("-n", "2", "--timeout", "100", *args, str(script), str(tmp_path), mode)
  _wait_for_lines(launcher, " ready pid=", 2)
  return launcher


def _sigterm(launcher: subprocess.Popen) -> tuple[str, float]:
  """Sends the launcher SIGTERM and waits for it to end: (its stderr, the seconds it took)."""
  try:
    start = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    return err, time.monotonic() - start
  finally:
    _stop_and_reap(launcher)


@pytest.mark.processes
def test_sigterm_is_forwarded_and_the_processes_save_and_their_status_is_the_launchers(tmp_path):
  launcher = _terminated_job(tmp_path, "save", "--termination-grace-period", "60")
  err, elapsed = _sigterm(launcher)
  # Every process saved (and so did the helper each started, in its process group), then exited with 42:
  # the launcher exits with 42 too, for a supervisor to restart the job.
  assert launcher.returncode == names.EXIT_RESTART, err[-3000:]
  for i in (0, 1):
    assert (tmp_path / f"saved{i}").read_text() == f"process {i} saved"
    assert (tmp_path / f"helper{i}").read_text() == "terminated"
  assert ("received SIGTERM: forwarding it to the 2 running processes (each with its process group); they get "
          "60 s to save and exit") in err, err[-3000:]
  for i in (0, 1):
    assert f"tpustrat.launch: process {i} exited with status 42 (the preemption handler saved" in err, err[-3000:]
  assert "stopped by SIGTERM, forwarded to every process; the launcher exits with 42" in err, err[-3000:]
  assert "restarting" not in err and "killed by the launcher" not in err
  assert elapsed < 30, f"{elapsed:.1f} s"


@pytest.mark.processes
def test_after_the_termination_grace_period_the_rest_is_killed(tmp_path):
  # Process 1 ignores SIGTERM: it is killed once the grace period is over; process 0 saved and exited 42,
  # the first status of the job, which is the launcher's.
  launcher = _terminated_job(tmp_path, "ignore", "--termination-grace-period", "2")
  err, elapsed = _sigterm(launcher)
  assert launcher.returncode == names.EXIT_RESTART, err[-3000:]
  assert (tmp_path / "saved0").exists() and not (tmp_path / "saved1").exists()
  assert "process 1 was still running 2 s after the SIGTERM and was killed by the launcher" in err, err[-3000:]
  assert 2 <= elapsed < 30, f"{elapsed:.1f} s"


@pytest.mark.processes
def test_a_second_sigterm_kills_at_once(tmp_path):
  launcher = _terminated_job(tmp_path, "ignore", "--termination-grace-period", "600")
  try:
    launcher.send_signal(signal.SIGTERM)
    # Process 0 saves (0.5 s) and exits; process 1 ignores the notice. The second SIGTERM ends the wait.
    _wait_until(lambda: (tmp_path / "saved0").exists(), 30, "process 0's save")
    start = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    elapsed = time.monotonic() - start
  finally:
    _stop_and_reap(launcher)
  assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert "interrupted; killing every process." in err, err[-3000:]
  assert elapsed < 15, f"{elapsed:.1f} s"


@pytest.mark.processes
def test_ctrl_c_is_forwarded_as_sigterm_and_the_processes_save(tmp_path):
  # A terminal's Ctrl-C reaches the launcher only (each process runs in a session of its own). It used to
  # kill every process at once (130), losing the steps since the last save; now the first one is the
  # SIGTERM path (issue 31 item 7): every process (and its group) gets SIGTERM and the grace period to save.
  launcher = _terminated_job(tmp_path, "save", "--termination-grace-period", "60")
  try:
    start = time.monotonic()
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    elapsed = time.monotonic() - start
  finally:
    _stop_and_reap(launcher)
  assert launcher.returncode == names.EXIT_RESTART, err[-3000:]
  for i in (0, 1):
    assert (tmp_path / f"saved{i}").read_text() == f"process {i} saved"
    assert (tmp_path / f"helper{i}").read_text() == "terminated"
  assert ("received SIGINT (Ctrl-C): forwarding SIGTERM to the 2 running processes (each with its process "
          "group); they get 60 s to save and exit") in err, err[-3000:]
  assert "stopped by SIGINT (Ctrl-C), forwarded as SIGTERM to every process; the launcher exits with 42" in err, (
      err[-3000:])
  assert "interrupted" not in err and "killed by the launcher" not in err, err[-3000:]
  assert elapsed < 30, f"{elapsed:.1f} s"


@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGINT, signal.SIGTERM),
                                           (signal.SIGTERM, signal.SIGINT)])
@pytest.mark.processes
def test_a_second_ctrl_c_kills_at_once(tmp_path, first, second):
  launcher = _terminated_job(tmp_path, "ignore", "--termination-grace-period", "600")
  try:
    launcher.send_signal(first)
    # Process 0 saves (0.5 s) and exits; process 1 ignores the notice. The second signal ends the wait.
    _wait_until(lambda: (tmp_path / "saved0").exists(), 30, "process 0's save")
    start = time.monotonic()
    launcher.send_signal(second)
    _, err = launcher.communicate(timeout=60)
    elapsed = time.monotonic() - start
  finally:
    _stop_and_reap(launcher)
  assert launcher.returncode == 128 + second, err[-3000:]
  assert "interrupted; killing every process." in err, err[-3000:]
  assert elapsed < 15, f"{elapsed:.1f} s"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
@pytest.mark.processes
def test_sigterm_or_ctrl_c_to_the_launcher_makes_the_preemption_handler_save_and_exit_42(tmp_path, strategy, signum):
  # The real handler, 2 processes x 2 devices: SIGTERM (or Ctrl-C, forwarded as SIGTERM: issue 31 item 7) to
  # the launcher reaches both processes, which agree on one call, save it, and exit with 42. The checkpoint
  # holds the count of that call.
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  import tpustrat  # pylint: disable=import-outside-toplevel

  ckpt = tmp_path / "ckpt"
  launcher = _start_launcher("-n", "2", "-d", "2", "--termination-grace-period", "60", "--timeout", "150",
                             os.path.join(SCRIPTS, "preempted_by_sigterm.py"), str(ckpt))
  try:
    _wait_for_lines(launcher, " ready", 2)
    launcher.send_signal(signum)
    out, err = launcher.communicate(timeout=120)
  finally:
    _stop_and_reap(launcher)
  assert launcher.returncode == names.EXIT_RESTART, err[-3000:]
  saved = {}
  for line in err.splitlines():
    if " saved checkpoint " in line and "after a termination notice" in line:
      saved[line.split("]", 1)[0]] = int(line.split(" saved checkpoint ", 1)[1].split()[0])
  assert sorted(saved) == ["[proc 0", "[proc 1"] and len(set(saved.values())) == 1, err[-3000:]
  step = saved["[proc 0"]
  assert step >= 3
  manager = tpustrat.checkpoint.CheckpointManager(ckpt, strategy)
  try:
    assert manager.latest_step() == step
    restored = manager.restore(target={"count": tpustrat.Mirrored(jnp.zeros((), jnp.float32))})
  finally:
    manager.close()
  assert float(strategy.experimental_local_results(restored["count"])[0]) == float(step)


@pytest.mark.processes
def test_launch_forwards_sigterm_in_a_program_of_its_own_and_puts_the_handler_back(run, tmp_path):
  # `launch()` called by a program (here, this test's process): a SIGTERM to that program is forwarded
  # too, and the program's own SIGTERM handler is back once `launch()` returns.
  def mine(signum, frame):
    raise AssertionError("the program's handler ran during launch()")

  def terminate_when_ready():
    _wait_until(lambda: all((tmp_path / f"ready{i}").exists() for i in (0, 1)), 30, "both processes")
    os.kill(os.getpid(), signal.SIGTERM)

  previous = signal.signal(signal.SIGTERM, mine)
  try:
    sender = threading.Thread(target=terminate_when_ready, daemon=True)
    sender.start()
    status, starts, err = run(f"""
        def save(*_):
          open(os.path.join({str(tmp_path)!r}, f"saved{{ID}}"), "w").write("saved")
          os._exit(42)
        signal.signal(signal.SIGTERM, save)
        open(os.path.join({str(tmp_path)!r}, f"ready{{ID}}"), "w").close()
        time.sleep(60)
        """, max_restarts=2)
    sender.join()
    assert signal.getsignal(signal.SIGTERM) is mine
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert status == names.EXIT_RESTART and len(starts) == 2, err[-3000:]  # not restarted after a SIGTERM
  assert all((tmp_path / f"saved{i}").read_text() == "saved" for i in (0, 1))
  assert "stopped by SIGTERM, forwarded to every process; the launcher exits with 42" in err, err[-3000:]


# -- the order in which processes end (issue 21 item 13) ---------------------------------------------------

# Process 1 ends first (SIGKILL, or status 124 as the step watchdog ends a process); process 0 waits until
# process 1 has ended, then exits with 1 at once.
_ENDS_IN_ORDER = """\
import os, signal, sys, time
directory, how = sys.argv[1], sys.argv[2]
me = os.environ["TPUSTRAT_PROCESS_ID"]
open(os.path.join(directory, f"pid{me}.tmp"), "w").write(str(os.getpid()))
os.rename(os.path.join(directory, f"pid{me}.tmp"), os.path.join(directory, f"pid{me}"))
while not os.path.exists(os.path.join(directory, "go")):
  time.sleep(0.005)
if me == "1":
  if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
  os._exit(124)
other = int(open(os.path.join(directory, "pid1")).read())
def ended(pid):
  try:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
  except FileNotFoundError:
    return True
while not ended(other):
  pass
os._exit(1)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's order of ends: Linux pidfds")
@pytest.mark.parametrize("how, status, described", [
    ("kill", 128 + signal.SIGKILL, "was killed by SIGKILL"),
    ("watchdog", names.EXIT_STEP_TIMEOUT, "exited with status 124 (its step watchdog or checkpoint deadline fired"),
])
@pytest.mark.processes
def test_the_first_process_to_end_is_blamed_even_when_both_end_between_two_looks(tmp_path, how, status, described):
  # Process 1 ends, then process 0 exits with 1 an instant later, while the launcher is stopped (SIGSTOP):
  # both have ended when it looks again, as when two processes end within one of its polls. The launcher
  # used to take them in index order and blame process 0 (status 1); the kernel's order names process 1.
  script = tmp_path / "job.py"
  script.write_text(_ENDS_IN_ORDER)
  launcher = _start_launcher("-n", "2", "--grace-period", "5", "--timeout", "60", str(script), str(tmp_path), how)
  try:
    _wait_until(lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid1").exists(), 30, "the pid files")
    pids = [int((tmp_path / f"pid{i}").read_text()) for i in (0, 1)]
    launcher.send_signal(signal.SIGSTOP)
    try:
      (tmp_path / "go").touch()
      # Zombies until the stopped launcher reaps them; process 0 waited for process 1's end.
      _wait_until(lambda: all(_state(p) == "Z" for p in pids), 30, "both processes to end")
    finally:
      launcher.send_signal(signal.SIGCONT)
    out, err = launcher.communicate(timeout=60)
  finally:
    _stop_and_reap(launcher)
  assert launcher.returncode == status, err[-3000:]
  assert f"process 1 failed first: it {described}" in err, err[-3000:]
  assert "process 0 stopped on its own: it exited with status 1" in err, err[-3000:]


@pytest.mark.processes
def test_without_pidfds_the_ends_are_still_seen(run, monkeypatch):
  # Where pidfds are missing (not Linux, an old kernel), a thread per process waits for it.
  monkeypatch.delattr(launch.os, "pidfd_open", raising=False)
  assert launch._Exits()._epoll is None
  status, starts, err = run("""
      if ID == 1:
        sys.exit(3)
      """)
  assert status == 3 and len(starts) == 2, err[-3000:]
  assert "process 1 failed first: it exited with status 3" in err, err[-3000:]
