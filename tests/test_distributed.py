"""Starting a multi-process job (`tpustrat._src.distributed`): the exception hook, the job check, the timeouts.

The exception hook of a multi-process job: opt-in, on under the launcher.

A library that replaced the process-global `sys.excepthook` whenever it connected would surprise a
program with hooks of its own; a multi-process job without it hangs when one process ends with an
uncaught exception (the others wait for it inside a collective, it waits at JAX's shutdown barrier).
`initialize(..., exit_on_uncaught=...)` decides, else ``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION``, which
`python -m tpustrat.launch` sets for the processes it starts.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tpustrat import launch
from tpustrat._src import distributed, names

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = "TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION"


def _env(**extra: str) -> dict[str, str]:
  """This environment without the job's variables and this process's 8 devices, plus `extra`."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}
  return env | {"JAX_PLATFORMS": "cpu"} | extra


def test_the_variable_decides_only_when_the_argument_does_not(monkeypatch):
  monkeypatch.delenv(ENV, raising=False)
  assert names.ENV_EXIT_ON_UNCAUGHT == ENV
  assert distributed._exit_on_uncaught_wanted(None) is False  # off by default
  for text, want in (("1", True), ("true", True), (" Yes ", True), ("on", True), ("0", False),
                     ("false", False), ("no", False), ("OFF", False), ("", False)):
    monkeypatch.setenv(ENV, text)
    assert distributed._exit_on_uncaught_wanted(None) is want, text
  monkeypatch.setenv(ENV, "1")
  assert distributed._exit_on_uncaught_wanted(False) is False  # the argument wins
  monkeypatch.setenv(ENV, "0")
  assert distributed._exit_on_uncaught_wanted(True) is True
  monkeypatch.setenv(ENV, "sometimes")
  with pytest.raises(ValueError, match=r"TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION='sometimes' must be one of 1, "):
    distributed._exit_on_uncaught_wanted(None)
  with pytest.raises(TypeError, match=r"exit_on_uncaught must be True, False or None, got 1\."):
    distributed._exit_on_uncaught_wanted(1)


def test_the_launcher_turns_it_on_for_its_processes_unless_told_otherwise():
  kw = dict(process_id=0, num_processes=2, devices_per_process=1, address="127.0.0.1:1", heartbeat_timeout=1,
            initialization_timeout=1, shutdown_timeout=1)
  assert launch.process_env({}, **kw)[ENV] == "1"
  assert launch.process_env({ENV: ""}, **kw)[ENV] == "1"
  # TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION=0 python -m tpustrat.launch ...: no hook
  assert launch.process_env({ENV: "0"}, **kw)[ENV] == "0"


def _one_process_job(call: str, **env: str) -> subprocess.CompletedProcess:
  """A job of one process that connects with `call`, then ends with an uncaught ValueError."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  script = textwrap.dedent(f"""
      import sys
      from tpustrat._src import distributed
      before = sys.excepthook
      distributed.initialize({address!r}, 1, 0, None, coordinator_bind_address={address!r},
                             initialization_timeout=30, heartbeat_timeout=10, shutdown_timeout=10{call})
      print("hook replaced:", sys.excepthook is not before, flush=True)
      raise ValueError("boom")
      """)
  return subprocess.run([sys.executable, "-c", script], env=_env(**env), cwd=ROOT, capture_output=True,
                        text=True, timeout=120)


@pytest.mark.processes
def test_initialize_leaves_sys_excepthook_alone_by_default():
  out = _one_process_job("")
  assert "hook replaced: False" in out.stdout, out.stderr[-3000:]
  assert out.returncode == 1 and "ValueError: boom" in out.stderr, out.stderr[-3000:]
  assert "exits at once" not in out.stderr


@pytest.mark.processes
def test_initialize_installs_the_hook_when_asked():
  out = _one_process_job(", exit_on_uncaught=True", **{ENV: "0"})  # the argument wins over the variable
  assert "hook replaced: True" in out.stdout, out.stderr[-3000:]
  assert out.returncode == 1 and "ValueError: boom" in out.stderr, out.stderr[-3000:]
  assert "process 0 of 1 exits at once after an uncaught ValueError" in out.stderr, out.stderr[-3000:]


@pytest.mark.processes
def test_under_the_launcher_an_uncaught_exception_still_ends_the_job_at_once():
  # The launcher's behaviour is unchanged: process 1 raises, exits at once, and process 0 (waiting for
  # it) is stopped by JAX's heartbeat check instead of waiting for the shutdown barrier.
  script = textwrap.dedent("""
      import time, jax, tpustrat
      tpustrat.TPUStrategy()
      if jax.process_index() == 1:
        raise RuntimeError("process 1 fails")
      time.sleep(60)
      """)
  start = time.monotonic()
  out = subprocess.run([sys.executable, "-m", "tpustrat.launch", "-n", "2", "--heartbeat-timeout", "3",
                        "--grace-period", "20", "--timeout", "90", "--", "-c", script], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 1, out.stderr[-3000:]
  assert "process 1 of 2 exits at once after an uncaught RuntimeError" in out.stderr, out.stderr[-3000:]
  assert "process 1 failed first: it exited with status 1" in out.stderr, out.stderr[-3000:]
  assert "process 0 stopped on its own" in out.stderr, out.stderr[-3000:]
  assert time.monotonic() - start < 40


# -- the exception hook of a multi-process job --------------------------------------------------------

_HOOK = ("from tpustrat._src import distributed; distributed._exit_on_uncaught_exception(0, 2, 10)")


@pytest.mark.processes
def test_uncaught_exception_hook_spares_an_interactive_session():
  # In the REPL (python -i, or plain `python` on a terminal) every mistyped line is an "uncaught"
  # exception: it must print the traceback and go on, not end the interpreter.
  out = subprocess.run([sys.executable, "-i", "-c", _HOOK], input="undefined_name\nprint('alive')\n",
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert "NameError" in out.stderr, out.stderr
  assert "alive" in out.stdout and out.returncode == 0, (out.returncode, out.stdout, out.stderr)


@pytest.mark.processes
def test_uncaught_exception_hook_exits_at_once_and_chains_the_users_hook():
  script = textwrap.dedent(f"""
      import sys
      def mine(kind, value, tb):
        print("user hook saw", kind.__name__, flush=True)
      sys.excepthook = mine
      {_HOOK}
      {_HOOK}
      raise ValueError("boom")
      """)
  out = subprocess.run([sys.executable, "-c", script], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
  assert out.returncode == 1, out.stderr
  assert out.stdout.count("user hook saw ValueError") == 1  # installed once, the user's hook kept
  assert "process 0 of 2 exits at once after an uncaught ValueError" in out.stderr


# -- the job check: no process joins another job's coordinator ---------------------------------------------


def test_the_job_identity_is_the_variable_else_slurms_else_none(monkeypatch):
  for name in (names.ENV_JOB_ID, "SLURM_JOB_ID", "SLURM_STEP_ID"):
    monkeypatch.delenv(name, raising=False)
  assert distributed.job_identity() is None
  monkeypatch.setenv("SLURM_JOB_ID", "4242")
  assert distributed.job_identity() == "slurm-4242"
  monkeypatch.setenv("SLURM_STEP_ID", "3")
  assert distributed.job_identity() == "slurm-4242.3"
  monkeypatch.setenv(names.ENV_JOB_ID, "  my-run-7 ")
  assert distributed.job_identity() == "my-run-7"  # the variable wins
  for bad in ("a\nb", "x" * 257):
    monkeypatch.setenv(names.ENV_JOB_ID, bad)
    with pytest.raises(ValueError, match="TPUSTRAT_JOB_ID=.* must be at most 256 printable characters"):
      distributed.job_identity()


def test_the_job_check_lets_only_the_same_job_through(monkeypatch):
  port = launch._free_port()  # the coordinator's port; nothing listens there: only port + 1 is read
  address, check = f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"
  server = distributed._bind_job_check(address, 0, "job-A")
  server.start()
  try:
    distributed._check_job(address, "job-A", 1, 2, time.monotonic() + 10, 10)  # its own job: returns
    start = time.monotonic()
    with pytest.raises(distributed.CoordinatorOfAnotherJob) as e:
      distributed._check_job(address, "job-B", 1, 2, time.monotonic() + 30, 30)
    assert time.monotonic() - start < 10  # at once, not at the deadline
    assert str(e.value) == (
        f"experimental_connect_to_cluster: process 1 of 2 of job 'job-B' will not join the coordinator at "
        f"{address}: another job holds that address (its process 0 answered the job check at {check} with job "
        "'job-A'). This process did not register with it, so that job goes on undisturbed. Give this job a "
        "free port (python -m tpustrat.launch --port, or the coordinator address), or wait until the other "
        "job has ended.")
    assert isinstance(e.value, distributed.CoordinatorPortTaken)  # exits with the start-failed status
    # A second process 0 (of any job) cannot take the job check port while the first holds it.
    with pytest.raises(distributed.CoordinatorPortTaken, match=f"but {check} is already in use: that is the "
                       f"job check port of the coordinator at {address}"):
      distributed._bind_job_check(address, 0, "job-B")
  finally:
    server.close()
  # Nobody answers any more: the process waits until the deadline, then names the address.
  with pytest.raises(RuntimeError, match=rf"process 1 of 2 of job 'job-A' could not check the job of the "
                     rf"coordinator at {address} within 1 s \(initialization_timeout\): process 0 of this job "
                     rf"answers the job check at {check}"):
    distributed._check_job(address, "job-A", 1, 2, time.monotonic() + 1, 1)


def test_the_job_check_does_not_take_another_programs_answer_for_a_job():
  # Something else listens on the job check port and answers garbage: not a job, so no decision; the
  # process keeps asking until the deadline, then says what it got.
  port = launch._free_port()
  with socket.socket() as other:
    other.bind(("127.0.0.1", port + 1))
    other.listen()
    stop = threading.Event()

    def answer():
      other.settimeout(0.1)
      while not stop.is_set():
        try:
          conn, _ = other.accept()
        except OSError:
          continue
        with conn:
          conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
      with pytest.raises(RuntimeError, match=r"last error: the answer was not a job check's: b'HTTP/1.1 400"):
        distributed._check_job(f"127.0.0.1:{port}", "job-A", 1, 2, time.monotonic() + 1.5, 1.5)
    finally:
      stop.set()
      thread.join()


def test_the_job_check_names_another_programs_answer_after_it_stops_answering():
  # Another program answers once, then its port refuses: the error still names its answer, the likeliest
  # cause, and then the error that came after it.
  port = launch._free_port()
  other = socket.socket()
  other.bind(("127.0.0.1", port + 1))
  other.listen()

  def answer_once():
    conn, _ = other.accept()
    with conn:
      conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    other.close()  # nothing listens any more: the next attempts are refused

  thread = threading.Thread(target=answer_once, daemon=True)
  thread.start()
  try:
    with pytest.raises(RuntimeError) as raised:
      distributed._check_job(f"127.0.0.1:{port}", "job-A", 1, 2, time.monotonic() + 1.0, 1.0)
  finally:
    thread.join(10)
  assert "last error: the answer was not a job check's: b'HTTP/1.1 400 Bad Request" in str(raised.value)
  assert "(then: " in str(raised.value) and "refused" in str(raised.value).lower()


def test_the_last_port_leaves_no_room_for_the_job_check():
  assert distributed.job_check_address("10.0.0.1:8476") == ("10.0.0.1", 8477, "10.0.0.1:8477")
  assert distributed.job_check_address("[::1]:9000") == ("::1", 9001, "[::1]:9001")
  with pytest.raises(ValueError, match=r"the coordinator's port 65535 \(h:65535\) leaves no port for the job "
                     r"check"):
    distributed.job_check_address("h:65535")


# -- timeouts: checked before connecting ---------------------------------------------------------------------


@pytest.mark.parametrize("name, value", [
    ("initialization_timeout", 2**31), ("heartbeat_timeout", 3_000_000_000), ("shutdown_timeout", 0),
    ("heartbeat_timeout", 1.5),
])
def test_out_of_range_timeouts_fail_before_connecting(name, value, monkeypatch):
  def connects(*args, **kwargs):
    raise AssertionError("tried to connect")

  # Nothing may be tried with these timeouts (in this test process: nothing at all).
  monkeypatch.setattr(distributed, "_wait_for_coordinator", connects)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", connects)
  timeouts = dict(initialization_timeout=30, heartbeat_timeout=10, shutdown_timeout=10) | {name: value}
  env = {"initialization_timeout": "TPUSTRAT_INITIALIZATION_TIMEOUT", "heartbeat_timeout":
         "TPUSTRAT_HEARTBEAT_TIMEOUT", "shutdown_timeout": "TPUSTRAT_SHUTDOWN_TIMEOUT"}[name]
  start = time.monotonic()
  with pytest.raises(ValueError) as e:
    distributed.initialize("127.0.0.1:1", 2, 1, None, coordinator_bind_address=None, **timeouts)
  assert str(e.value) == (
      f"experimental_connect_to_cluster: {name} (the resolver's argument, or {env}) must be a whole number of "
      f"seconds in [1, 2147483647], got {value!r} (JAX's distributed runtime takes int32 seconds).")
  assert time.monotonic() - start < 1


@pytest.mark.processes
def test_an_out_of_range_timeout_variable_fails_at_once_naming_it():
  # It used to pass, then fail 22-62 s later inside JAX with a pybind TypeError (here: after the 5 s of
  # waiting for a coordinator that does not exist).
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{s.getsockname()[1]}"
  env = _env() | {"TPUSTRAT_COORDINATOR_ADDRESS": address, "TPUSTRAT_NUM_PROCESSES": "2",
                  "TPUSTRAT_PROCESS_ID": "1", "TPUSTRAT_INITIALIZATION_TIMEOUT": "5",
                  "TPUSTRAT_HEARTBEAT_TIMEOUT": "3000000000"}
  start = time.monotonic()
  out = subprocess.run([sys.executable, "-c", "import tpustrat; tpustrat.TPUStrategy()"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
  elapsed = time.monotonic() - start
  assert out.returncode == 1
  assert "ValueError" in out.stderr and "TPUSTRAT_HEARTBEAT_TIMEOUT" in out.stderr, out.stderr[-3000:]
  assert "3000000000" in out.stderr and "[1, 2147483647]" in out.stderr, out.stderr[-3000:]
  assert "could not reach the coordinator" not in out.stderr and "TypeError" not in out.stderr
  assert elapsed < 5 + 20, f"{elapsed:.1f} s"
