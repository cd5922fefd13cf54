"""The exception hook of a multi-process job (`tpustrat._src.distributed`): opt-in, on under the launcher.

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
import time

import pytest

from tpustrat import launch
from tpustrat._src import distributed, names

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = "TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION"


def _env(**extra: str) -> dict[str, str]:
  """This environment without the job's variables and this process's 8 devices, plus `extra`."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("TPUSTRAT_") and k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
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


def test_initialize_leaves_sys_excepthook_alone_by_default():
  out = _one_process_job("")
  assert "hook replaced: False" in out.stdout, out.stderr[-3000:]
  assert out.returncode == 1 and "ValueError: boom" in out.stderr, out.stderr[-3000:]
  assert "exits at once" not in out.stderr


def test_initialize_installs_the_hook_when_asked():
  out = _one_process_job(", exit_on_uncaught=True", **{ENV: "0"})  # the argument wins over the variable
  assert "hook replaced: True" in out.stdout, out.stderr[-3000:]
  assert out.returncode == 1 and "ValueError: boom" in out.stderr, out.stderr[-3000:]
  assert "process 0 of 1 exits at once after an uncaught ValueError" in out.stderr, out.stderr[-3000:]


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


def test_uncaught_exception_hook_spares_an_interactive_session():
  # In the REPL (python -i, or plain `python` on a terminal) every mistyped line is an "uncaught"
  # exception: it must print the traceback and go on, not end the interpreter.
  out = subprocess.run([sys.executable, "-i", "-c", _HOOK], input="undefined_name\nprint('alive')\n",
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert "NameError" in out.stderr, out.stderr
  assert "alive" in out.stdout and out.returncode == 0, (out.returncode, out.stdout, out.stderr)


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
