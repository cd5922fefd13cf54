"""Try multi-host on one machine: ``python -m tpustrat.launch --num-processes N --devices-per-process M script.py``.

The launcher starts ``N`` copies of a Python program on this machine, each with ``M`` emulated CPU
devices, joined into one job by JAX's distributed runtime (`jax.distributed`):

* it picks a free port and sets the variables `tpustrat.cluster_resolver.TPUClusterResolver` reads
  (``TPUSTRAT_COORDINATOR_ADDRESS=127.0.0.1:<port>``, ``TPUSTRAT_NUM_PROCESSES``,
  ``TPUSTRAT_PROCESS_ID``, the timeouts below), so the program needs no arguments: ``TPUStrategy()``
  (or ``TPUStrategy(TPUClusterResolver())``) spans all ``N * M`` devices. Process 0 runs the
  coordinator service, bound to 127.0.0.1 only. The port is free when chosen, but process 0 binds it
  seconds later, once it has imported JAX; if another program took it in between (process 0 then says
  the address is in use and exits with status 75, ``tpustrat._src.names.EXIT_START_FAILED``), the
  launcher stops the job and starts it again on a fresh port, up to 3 attempts in all. A port given
  with ``--port`` is never replaced;
* each start gets a fresh random job identity (``TPUSTRAT_JOB_ID``). Process 0 serves it on the next
  port (the coordinator's + 1, the job check port, which must be free too) and every other process reads
  it there before it registers with the coordinator: a second job started on the same ``--port`` fails
  (status 75, naming the address and saying another job holds it) and never joins, so never stops, the
  job that runs there (`tpustrat._src.distributed`);
* each process gets ``JAX_PLATFORMS=cpu``, ``M`` CPU devices (``JAX_NUM_CPU_DEVICES`` and
  ``XLA_FLAGS=--xla_force_host_platform_device_count``) and gloo CPU collectives
  (``JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo``), so `psum` and friends cross process boundaries over
  loopback TCP, as they would cross hosts;
* their output is streamed line by line with a ``[proc i]`` prefix (stdout to stdout, stderr to stderr);
* the launcher exits with 0 if every process does, else with the status of the process its report names
  as the one that failed first (in the last start, with ``--max-restarts``): the first to end with an
  error, unless JAX's errors name a process that stopped heartbeating, or the step watchdog names one
  holding the job up (below). Processes are taken in the order they really ended: on Linux
  the kernel's order (a pidfd per process in an epoll set), even when they ended within microseconds of
  each other or while the launcher was not scheduled, so a process killed by SIGKILL (137) or stopped by
  its step watchdog (124) just before another exits with 1 is the one named, and its status is the
  launcher's. Whatever the processes started and left running is killed when the job ends; on Linux, the
  processes are also killed if the launcher itself is killed (even by SIGKILL).

Stopping the launcher. SIGTERM (a VM shutting down, ``docker stop``, a scheduler; the launcher may be
PID 1) is forwarded to every process, to its whole process group, and the processes get
``--termination-grace-period`` seconds (default 30) to save and exit: under
`tpustrat.PreemptionCheckpointHandler` every process saves at one agreed step and exits with 42. Then
whatever still runs is killed (SIGKILL). The launcher exits with the processes' status, as above (42 when
they saved: a supervisor restarts the job), 0 if they all exited with 0, 143 (128 + SIGTERM) if none
failed but some had to be killed, and never restarts the job. Ctrl-C (SIGINT) is the same: each process
runs in a session of its own, so a terminal's Ctrl-C reaches the launcher only, and the first one is
forwarded as SIGTERM, so that the processes save (130 instead of 143 if some had to be killed). A second
SIGTERM or Ctrl-C, or a SIGHUP, kills every process at once and exits with 128 + the signal.

Timeouts are checked before anything starts, with an error naming the flag, the value and the range:
``--heartbeat-timeout``, ``--initialization-timeout`` and ``--shutdown-timeout`` are whole seconds in
[1, 2**31 - 1] (JAX takes them as C int32 seconds), ``--timeout`` in [1, 2**31 - 1], ``--step-timeout`` (and
``TPUSTRAT_STEP_TIMEOUT`` in the launcher's environment) in [1, 2**31 - 1], ``--grace-period`` and
``--termination-grace-period`` in [0, 2**31 - 1].

Faults. Processes watch each other through JAX's distributed runtime: every process sends heartbeats to
the coordinator, and when one stops (it died, or hangs so hard that it stopped heartbeating) for
``--heartbeat-timeout`` seconds, the coordinator stops the others with an error naming it; if the
coordinator's process dies or hangs, the others lose its heartbeat replies and stop the same way. A
process that ends with an uncaught exception exits at once rather than waiting at JAX's shutdown barrier:
the launcher sets ``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION=1`` for its processes, so that
`tpustrat.experimental_connect_to_cluster` installs a `sys.excepthook` that prints the traceback and ends
the process with status 1 (`tpustrat._src.distributed`); set the variable to ``0`` in the launcher's
environment to leave `sys.excepthook` alone. The launcher is the last line of defence:
once a process has failed, the others get ``--grace-period`` seconds (default: the heartbeat timeout
plus 10 s) to stop on their own, then are killed (SIGKILL), and the launcher reports which process
failed first and how, and exits with that process's status; a process that hangs is named from JAX's
errors, since it is not the first to exit, and a process that a firing step watchdog names as holding
the job up (its line ``names.WATCHDOG_BLAMES``, which every process prints) is named too, whichever
process's watchdog fired. ``--timeout`` bounds the whole run (for hangs that keep every heartbeat alive,
such as a deadlock in Python code).

Restarts. With ``--max-restarts N``, a job that failed (a process exited with a non-zero status, such as
42, ``tpustrat._src.names.EXIT_RESTART``, with which `tpustrat.PreemptionCheckpointHandler` asks to be
restarted once it saved a checkpoint, or was killed by a signal) is stopped as above, then started again
whole, with the same command and arguments, on a fresh port (a port given with ``--port`` is kept), at
most ``N`` times; the launcher says why before each restart and exits with the status of the last start.
Each process reads which start it belongs to in ``TPUSTRAT_RESTART_COUNT`` (``0`` on the first, then
``1``, ``2``, ...), to resume from its last checkpoint. The retries of a taken port are not restarts;
the launcher does not restart once ``--timeout`` ran out (it covers every start), nor when it was
stopped itself.

``--step-timeout S`` sets ``TPUSTRAT_STEP_TIMEOUT=S`` in every process (without it, the variable is left as
the launcher's environment has it): the library then starts a step watchdog in each process, which ends
the process with status 124 (``tpustrat._src.names.EXIT_STEP_TIMEOUT``) when a step waits more than
``S`` seconds for its peers (a peer hangs without stopping its heartbeats), so that the job fails, and is
restarted with ``--max-restarts``, rather than hangs until ``--timeout``.

Profiles and the compilation cache (off by default). ``--profile DIR`` sets ``TPUSTRAT_PROFILE_DIR`` in every
process: each profiles itself (JAX's profiler, with the library's step marks) into ``DIR/process_<i>/`` from
the first strategy it creates until it exits, or for ``--profile-steps N`` training steps
(`tpustrat.experimental.profile`; ``tensorboard --logdir DIR`` shows one run per process).
``--compilation-cache DIR`` sets ``TPUSTRAT_COMPILATION_CACHE_DIR``, which ``import tpustrat`` reads
(`tpustrat.experimental.enable_compilation_cache`): JAX's persistent compilation cache in ``DIR``, the same
for every start, so a restart loads the programs the first start compiled instead of compiling them.

Usage::

    python -m tpustrat.launch --num-processes 2 --devices-per-process 4 examples/classifier.py --epochs 3
    python -m tpustrat.launch -n 4 -d 2 -m mypackage.train --flag value
    python -m tpustrat.launch -n 2 -d 4 --max-restarts 3 --step-timeout 300 train.py --resume
    python -m tpustrat.launch --version    # tpustrat 0.1.0 (jax ..., jaxlib ..., python ...)

Only for one machine: on several hosts, start one process per host with the cluster's own tools (a
Cloud TPU slice: ``gcloud compute tpus tpu-vm ssh ... --worker=all --command=...``; Slurm: ``srun``) and
describe the job with `TPUClusterResolver` (see docs/guides/multi_process.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from tpustrat._src import names, validation
from tpustrat._src.launch.processes import Exits as _Exits
from tpustrat._src.launch.processes import Interrupted as _Interrupted
from tpustrat._src.launch.processes import Output as _Output
from tpustrat._src.launch.processes import Proc as _Proc
from tpustrat._src.launch.processes import Termination as _Termination
from tpustrat._src.launch.processes import bootstrapped as _bootstrapped
from tpustrat._src.launch.processes import kill as _kill
from tpustrat._src.launch.processes import kill_group as _kill_group
from tpustrat._src.launch.processes import process_env as process_env
from tpustrat._src.launch.processes import signal_group as _signal_group
from tpustrat._src.launch.reports import cause as _cause
from tpustrat._src.launch.reports import describe as _describe
from tpustrat._src.launch.reports import exit_status as _exit_status
from tpustrat._src.launch.reports import first_failure as _culprit
from tpustrat._src.launch.reports import report as _report
from tpustrat._src.launch.reports import report_terminated as _report_terminated

__all__ = ["main", "launch"]

# How many times a job is started when the port the launcher chose is taken before process 0 binds it.
_PORT_ATTEMPTS = 3


def _positive(kind: type, what: str, *, zero: bool = False):
  """An argparse type: a `kind` above 0 (at least 0 with `zero`)."""
  adjective = "non-negative" if zero else "positive"

  def parse(text: str) -> Any:
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"{what} must be a {adjective} {kind.__name__}, got {text!r}") from None
    if not (value >= 0 if zero else value > 0):
      raise argparse.ArgumentTypeError(f"{what} must be a {adjective} {kind.__name__}, got {text!r}")
    return value
  return parse


# The accepted range of each timeout, in seconds: (minimum, whole seconds only). The maximum is
# names.MAX_TIMEOUT_SECONDS (2**31 - 1: JAX takes its timeouts as C int32 seconds) for all of them.
_TIMEOUTS = {
    "heartbeat_timeout": (1, True),
    "initialization_timeout": (1, True),
    "shutdown_timeout": (1, True),
    "grace_period": (0, False),
    "termination_grace_period": (0, False),
    "timeout": (1, False),
    "step_timeout": (names.MIN_STEP_TIMEOUT_SECONDS, False),
}
_JAX_NOTE = "JAX's distributed runtime takes int32 seconds"


def _check_timeout(name: str, value: Any, what: str | None = None) -> Any:
  """`value` of the timeout `name` in its range (`_TIMEOUTS`); ValueError naming `what` (default: the
  argument of `launch`) otherwise."""
  minimum, integer = _TIMEOUTS[name]
  return validation.check_seconds(value, what or f"launch: {name}", minimum=minimum,
                                  maximum=names.MAX_TIMEOUT_SECONDS, integer=integer,
                                  note=_JAX_NOTE if integer else "")


def _seconds(name: str):
  """An argparse type for the timeout `name`: its flag's value, checked against its range."""
  flag = "--" + name.replace("_", "-")

  def parse(text: str) -> Any:
    try:
      return _check_timeout(name, text, flag)
    except ValueError as e:
      raise argparse.ArgumentTypeError(str(e)) from None
  return parse


def _version_line() -> str:
  """``tpustrat 0.1.0 (jax 0.10.2, jaxlib 0.10.2, python 3.11.7)``: what ``--version`` prints."""
  from importlib import metadata

  from tpustrat._version import __version__

  def installed(distribution: str) -> str:
    try:
      return metadata.version(distribution)
    except metadata.PackageNotFoundError:
      return "not installed"

  return (f"tpustrat {__version__} (jax {installed('jax')}, jaxlib {installed('jaxlib')}, "
          f"python {platform.python_version()})")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m tpustrat.launch",
      description="Runs N processes of a Python program on this machine as one multi-process JAX job "
                  "(CPU devices, gloo collectives, coordinator on 127.0.0.1).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--version", action="version", version=_version_line(),
                      help="print tpustrat's version and the JAX, jaxlib and Python it runs with, and exit")
  parser.add_argument("-n", "--num-processes", type=_positive(int, "--num-processes"), default=2,
                      help="number of processes")
  parser.add_argument("-d", "--devices-per-process", type=_positive(int, "--devices-per-process"), default=1,
                      help="emulated CPU devices in each process")
  parser.add_argument("--port", type=int, default=0,
                      help="coordinator port on 127.0.0.1, at most 65534: the next port is the job check's (0: "
                           "a free pair, replaced by another if it is taken before process 0 binds it)")
  parser.add_argument("--heartbeat-timeout", type=_seconds("heartbeat_timeout"), default=10,
                      help="seconds without heartbeats after which JAX declares a process dead and stops "
                           "the others (whole seconds, 1 to 2147483647)")
  parser.add_argument("--initialization-timeout", type=_seconds("initialization_timeout"), default=60,
                      help="seconds a process waits for the coordinator and the other processes to connect "
                           "(whole seconds, 1 to 2147483647)")
  parser.add_argument("--shutdown-timeout", type=_seconds("shutdown_timeout"), default=30,
                      help="seconds a finishing process waits for the others to finish too (whole seconds, "
                           "1 to 2147483647)")
  parser.add_argument("--grace-period", type=_seconds("grace_period"), default=None,
                      help="seconds the other processes get to stop on their own after one failed, before "
                           "the launcher kills them (0 to 2147483647; default: heartbeat timeout + 10)")
  parser.add_argument("--termination-grace-period", type=_seconds("termination_grace_period"), default=30.0,
                      help="when the launcher gets SIGTERM or Ctrl-C, it forwards SIGTERM to every process "
                           "(group) and gives them this many seconds to save and exit before it kills them (0 "
                           "to 2147483647; a second SIGTERM or Ctrl-C kills at once)")
  parser.add_argument("--timeout", type=_seconds("timeout"), default=None,
                      help="kill every process after this many seconds, start-up attempts and restarts "
                           "included (1 to 2147483647; default: no limit)")
  parser.add_argument("--max-restarts", type=_positive(int, "--max-restarts", zero=True), default=0,
                      help="when a process fails (non-zero status, e.g. 42: the preemption handler asks "
                           "to be restarted; or a signal), stop the job and start it whole again, at most "
                           "this many times; each process reads its start's number in TPUSTRAT_RESTART_COUNT")
  parser.add_argument("--step-timeout", type=_seconds("step_timeout"), default=None,
                      help="set TPUSTRAT_STEP_TIMEOUT: a process whose step waits longer than this many "
                           "seconds for its peers exits with status 124 (1 to 2147483647; default: leave the "
                           "variable as is)")
  parser.add_argument("--profile", metavar="DIR", default=None,
                      help="profile every process (JAX's profiler, the library's step marks) into "
                           "DIR/process_<i>/, from its first strategy until it exits (or --profile-steps): sets "
                           "TPUSTRAT_PROFILE_DIR; view with tensorboard --logdir DIR")
  parser.add_argument("--profile-steps", type=_positive(int, "--profile-steps"), default=None,
                      help="with --profile: stop each process's profile after this many training steps")
  parser.add_argument("--compilation-cache", metavar="DIR", default=None,
                      help="JAX's persistent compilation cache in DIR for every process and every restart "
                           "(sets TPUSTRAT_COMPILATION_CACHE_DIR): a restart reads the programs the first "
                           "start compiled")
  parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, default=None, metavar="MODULE [ARGS]",
                      help="run a module (as python -m does) instead of a script")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args...] (or the module's args)")
  return parser


def _free_port() -> int:
  """A free port P of 127.0.0.1 whose next port (P + 1, the job check's) is free too."""
  for _ in range(100):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
      if port + names.JOB_CHECK_PORT_OFFSET > 65535:
        continue
      with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
        try:
          t.bind(("127.0.0.1", port + names.JOB_CHECK_PORT_OFFSET))
        except OSError:
          continue
    return port
  raise RuntimeError("tpustrat.launch: found no two free consecutive ports on 127.0.0.1 in 100 tries.")


def _fresh_port(used: set[int]) -> int:
  """A free port of 127.0.0.1 that this launch has not given the coordinator yet (added to `used`)."""
  for _ in range(10):
    port = _free_port()
    if port not in used:
      break
  used.add(port)
  return port


def launch(command: Sequence[str], *, num_processes: int = 2, devices_per_process: int = 1, port: int = 0,
           heartbeat_timeout: int = 10, initialization_timeout: int = 60, shutdown_timeout: int = 30,
           grace_period: float | None = None, timeout: float | None = None, max_restarts: int = 0,
           step_timeout: float | None = None, termination_grace_period: float = 30.0,
           profile: str | os.PathLike | None = None, profile_steps: int | None = None,
           compilation_cache: str | os.PathLike | None = None,
           stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None) -> int:
  """Runs `command` (an argv list, e.g. ``[sys.executable, "train.py"]``) as `num_processes` processes.

  With ``port=0`` the coordinator gets a free port of 127.0.0.1 (with the next port free too, for the job
  check); if another program takes it before process 0 binds it (process 0 exits with status 75,
  `names.EXIT_START_FAILED`: the address is already in use), the job is stopped and started again on a
  fresh port, at most 3 attempts in all. Other failures, and a taken `port` given here, end the job, or
  restart it with `max_restarts`. Each start gets a fresh random job identity (``TPUSTRAT_JOB_ID``): no
  process of it joins another job's coordinator, even on the same port (see `tpustrat._src.distributed`).

  Called from the main thread, it handles SIGTERM and SIGINT while it runs (the previous handlers are put
  back when it returns; a SIGINT ignored stays ignored): the first SIGTERM or SIGINT (Ctrl-C) is forwarded
  as SIGTERM to every process's process group, and the processes get `termination_grace_period` seconds
  to save and exit (`tpustrat.PreemptionCheckpointHandler` saves and exits with 42) before they are
  killed; the launch then returns their status (42 when they all saved) and does not restart. A second
  one of either kills them at once (``128 +`` that signal).

  Args:
    command: the program and its arguments, as `subprocess.Popen` takes them.
    num_processes: how many processes the job has.
    devices_per_process: emulated CPU devices in each process.
    port: the coordinator's port on 127.0.0.1 (at most 65534: the next port is the job check's); 0 for a
      free one (a fresh one at each start).
    heartbeat_timeout: seconds without heartbeats after which JAX declares a process dead.
    initialization_timeout: seconds a process waits for the others to connect.
    shutdown_timeout: seconds a finishing process waits for the others to finish too.
    grace_period: seconds the other processes get to stop on their own once one failed, before they are
      killed (default: `heartbeat_timeout` + 10).
    timeout: seconds after which every process is killed and the launch ends with 124, whatever start it
      is at (None: no limit).
    max_restarts: how many times the whole job is started again after a process failed (a non-zero
      status, e.g. 42, `names.EXIT_RESTART`, or a signal); each process reads the number of its start
      (0 on the first) in ``TPUSTRAT_RESTART_COUNT``. Never after `timeout` ran out, nor when the
      launcher was stopped (SIGTERM, SIGHUP, Ctrl-C). Taken-port retries are not restarts.
    step_timeout: if not None, ``TPUSTRAT_STEP_TIMEOUT`` in every process's environment: seconds after
      which the step watchdog ends a process whose step still waits for its peers (status 124,
      `names.EXIT_STEP_TIMEOUT`). None leaves the variable as this process's environment has it (checked
      here too).
    termination_grace_period: seconds the processes get to exit after the launcher forwarded SIGTERM to
      them, before they are killed.
    profile: a directory: every process profiles itself into ``<profile>/process_<i>/`` (JAX's profiler
      with the library's step marks, `tpustrat.experimental.profile`), from the first strategy it creates
      until it exits, or for `profile_steps` training steps (``TPUSTRAT_PROFILE_DIR``,
      ``TPUSTRAT_PROFILE_STEPS``). Off (None) by default: a profile costs time and disk.
    profile_steps: with `profile`, how many training steps each process's profile records (None: all).
    compilation_cache: a directory for JAX's persistent compilation cache, the same for every process and
      every start (``TPUSTRAT_COMPILATION_CACHE_DIR``, read by ``import tpustrat``:
      `tpustrat.experimental.enable_compilation_cache`), so a restart loads what the first start
      compiled. Off (None) by default.
    stdout: where the processes' standard output goes, each line prefixed (default: ours).
    stderr: where their standard error and the launcher's messages go (default: ours).

  Every timeout is checked first: the three that JAX takes (`heartbeat_timeout`,
  `initialization_timeout`, `shutdown_timeout`) are whole seconds in [1, 2**31 - 1]; `timeout` is in
  [1, 2**31 - 1]; `step_timeout` in [1, 2**31 - 1] (`names.MIN_STEP_TIMEOUT_SECONDS`,
  `names.MAX_TIMEOUT_SECONDS`); the grace periods in [0, 2**31 - 1].

  Returns:
    The launcher's exit status, of the last start when the job was restarted: 0 if every process
    succeeded; else the status of the process the report names as the one that failed first (the
    first to end with an error, in the order the processes really ended, unless JAX's errors or a step
    watchdog name another; ``128 + signal`` for a signal), 124 when `timeout` ran out, or ``128 +
    signal`` when the launcher itself was killed by a second signal (130 for Ctrl-C); after a forwarded
    SIGTERM or Ctrl-C, the processes' status as above, or 143 (130 after Ctrl-C) if none failed but some
    had to be killed. Whatever the processes started and left
    running is killed when the job ends, and on Linux the processes die with the launcher if it is
    killed. Safe to call from a program with threads (no `preexec_fn`).

  Raises:
    FileNotFoundError: if the program ``command[0]`` cannot be found.
    ValueError: if `max_restarts` is negative, `port` is outside [0, 65534], or a timeout (or
      ``TPUSTRAT_STEP_TIMEOUT`` in this process's environment, when `step_timeout` is None) is outside
      its range; the message names it, the value and the range.
  """
  if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
    raise ValueError(f"max_restarts must be a non-negative int, got {max_restarts!r}")
  if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535 - names.JOB_CHECK_PORT_OFFSET:
    raise ValueError(f"launch: port must be an int in [0, {65535 - names.JOB_CHECK_PORT_OFFSET}] (the next port "
                     f"is the job check's), got {port!r}")
  heartbeat_timeout = _check_timeout("heartbeat_timeout", heartbeat_timeout)
  initialization_timeout = _check_timeout("initialization_timeout", initialization_timeout)
  shutdown_timeout = _check_timeout("shutdown_timeout", shutdown_timeout)
  termination_grace_period = _check_timeout("termination_grace_period", termination_grace_period)
  if grace_period is not None:
    grace_period = _check_timeout("grace_period", grace_period)
  if timeout is not None:
    timeout = _check_timeout("timeout", timeout)
  if step_timeout is not None:
    _check_timeout("step_timeout", step_timeout)  # passed on as given: 30 stays "30"
  elif os.environ.get(names.ENV_STEP_TIMEOUT, "").strip():  # passed on to every process as it is
    _check_timeout("step_timeout", os.environ[names.ENV_STEP_TIMEOUT],
                   f"{names.ENV_STEP_TIMEOUT} (in the launcher's environment)")
  if grace_period is None:
    grace_period = heartbeat_timeout + 10.0
  if profile_steps is not None and (isinstance(profile_steps, bool) or not isinstance(profile_steps, int)
                                    or profile_steps < 1):
    raise ValueError(f"launch: profile_steps must be a positive int or None, got {profile_steps!r}")
  if profile_steps is not None and profile is None:
    raise ValueError("launch: profile_steps needs profile (the directory the profiles go to)")
  if compilation_cache is not None:
    os.makedirs(compilation_cache, exist_ok=True)
  argv = _bootstrapped(command)
  output = _Output(stdout or sys.stdout.buffer, stderr or sys.stderr.buffer)
  deadline = None if timeout is None else time.monotonic() + timeout
  attempts = 1 if port else _PORT_ATTEMPTS
  used_ports: set[int] = set()
  termination = _Termination()
  handles_sigterm = threading.current_thread() is threading.main_thread()  # Python sets handlers only there
  if handles_sigterm:  # Ctrl-C too: the processes run in sessions of their own, only the launcher gets it
    previous_handler = signal.signal(signal.SIGTERM, termination.handler)
    previous_sigint = signal.getsignal(signal.SIGINT)
    if previous_sigint is not signal.SIG_IGN:  # ignored (a background job of a script): left ignored
      signal.signal(signal.SIGINT, termination.handler)
  try:
    for restart in range(max_restarts + 1):
      address = f"127.0.0.1:{port or _fresh_port(used_ports)}"
      for attempt in range(1, attempts + 1):
        output.say(f"starting {num_processes} processes x {devices_per_process} CPU devices, coordinator "
                   f"{address} (heartbeat timeout {heartbeat_timeout} s): {' '.join(command)}")
        job_id = f"launch-{secrets.token_hex(8)}"  # a fresh identity for each start
        envs = [process_env(os.environ, process_id=i, num_processes=num_processes,
                            devices_per_process=devices_per_process, address=address,
                            heartbeat_timeout=heartbeat_timeout,
                            initialization_timeout=initialization_timeout, shutdown_timeout=shutdown_timeout,
                            step_timeout=step_timeout, restart_count=restart, job_id=job_id,
                            profile_dir=None if profile is None else os.fspath(profile),
                            profile_steps=profile_steps,
                            compilation_cache=None if compilation_cache is None else os.fspath(compilation_cache))
                for i in range(num_processes)]
        ending = _run(argv, envs, output, grace_period=grace_period, timeout=timeout, deadline=deadline,
                      retry_taken_port=attempt < attempts, termination=termination,
                      termination_grace_period=termination_grace_period)
        if ending is not None:
          break
        taken, address = address, f"127.0.0.1:{_fresh_port(used_ports)}"
        output.say(f"the coordinator port {taken} was taken before process 0 could bind it; starting again "
                   f"on {address} (attempt {attempt + 1} of {attempts}).")
      assert ending is not None  # the last attempt does not retry a taken port: `_run` returned its ending
      status, cause = ending
      if cause is None:  # success, --timeout, or stopped
        return status
      if termination.at is not None:
        output.say(f"not restarting: the launcher was stopped ({termination.name}).")
        return status
      if restart == max_restarts:
        if max_restarts:
          output.say(f"not restarting: the job failed {max_restarts + 1} times "
                     f"(--max-restarts {max_restarts}).")
        return status
      if deadline is not None and time.monotonic() >= deadline:
        output.say(f"not restarting: the {timeout:g} s of --timeout have run out.")
        return status
      output.say(f"restarting the job (restart {restart + 1} of {max_restarts}): {cause}")
  except KeyboardInterrupt as e:  # between two starts (`_run` handles those during one)
    output.say("interrupted.")
    return 128 + getattr(e, "signum", signal.SIGINT)
  finally:
    if handles_sigterm:  # None: a handler set outside Python, which Python cannot put back
      signal.signal(signal.SIGTERM, signal.SIG_DFL if previous_handler is None else previous_handler)
      if previous_sigint is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous_sigint is None else previous_sigint)
  raise AssertionError("unreachable: the last start returns a status")


def _run(argv: list[str], envs: list[dict[str, str]], output: _Output, *, grace_period: float,
         timeout: float | None, deadline: float | None, retry_taken_port: bool,
         termination: _Termination | None = None,
         termination_grace_period: float = 30.0) -> tuple[int, str | None] | None:
  """One start of the job, once every process has stopped: (its exit status, why it failed when a process
  failed and the job may be restarted, else None), or None when process 0 found the coordinator's port
  taken (its first failure, with status `names.EXIT_START_FAILED`) and `retry_taken_port`.

  Processes are taken in the order they really ended (`_Exits`), so the first to fail is the one named
  (unless JAX's errors or a step watchdog name another, `_culprit`), and its status is the launch's. Once
  `termination` says the launcher got SIGTERM or SIGINT, SIGTERM is forwarded to every running process's
  group, and they get `termination_grace_period` seconds before they are killed.
  """
  termination = termination or _Termination()
  procs: list[_Proc] = []
  exits = _Exits()
  start = time.monotonic()
  first: _Proc | None = None
  timed_out = False
  forwarded: float | None = None  # when the launcher received the SIGTERM (or SIGINT) it forwarded
  ends = 0
  try:
    for i, env in enumerate(envs):
      if termination.at is not None:  # stopped while starting: start no more
        break
      # A session of its own: the launcher kills a process with everything it started (os.killpg), and
      # a Ctrl-C in the terminal reaches the launcher only, which forwards it as SIGTERM (`_Termination`).
      popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
      procs.append(_Proc(i, popen, time.monotonic()))
      exits.watch(procs[-1])
      output.follow(procs[-1])
    while any(p.returncode is None for p in procs):
      if termination.at is not None and forwarded is None:
        forwarded = termination.at
        running = [p for p in procs if p.returncode is None]
        received = ("SIGTERM: forwarding it" if termination.signum == signal.SIGTERM
                    else "SIGINT (Ctrl-C): forwarding SIGTERM")
        output.say(f"received {received} to the {len(running)} running processes (each with its process "
                   f"group); they get {termination_grace_period:g} s to save and exit before they are killed "
                   "(a second SIGTERM or Ctrl-C kills them at once).")
        for p in running:
          _signal_group(p, signal.SIGTERM)
      for p in exits.ended(0.05):  # first to end first
        rc = p.popen.wait()  # ended: reaps at once
        now = time.monotonic()
        p.returncode, p.ended, p.order = rc, now, ends
        ends += 1
        if rc != 0 and first is None and not p.killed:
          first = p
          if retry_taken_port and p.index == 0 and rc == names.EXIT_START_FAILED and forwarded is None:
            _stop(procs)
            return None
          if forwarded is None:
            output.say(f"process {p.index} {_describe(rc)} after {now - start:.1f} s; the other "
                       f"processes get {grace_period:g} s to stop before they are killed.")
        if forwarded is not None and not p.killed:
          output.say(f"process {p.index} {_describe(rc) if rc else 'exited normally'} "
                     f"{now - forwarded:.1f} s after the {termination.name}.")
      now = time.monotonic()
      if forwarded is not None:
        kill_at: float | None = forwarded + termination_grace_period
      else:
        kill_at = None if first is None else first.end_time + grace_period
      if kill_at is not None and now > kill_at:
        for p in procs:
          if p.returncode is None and not p.killed:
            _kill(p)
      if deadline is not None and now > deadline and not timed_out:
        timed_out = True
        output.say(f"timeout: still running after {timeout:g} s (--timeout); killing every process.")
        for p in procs:
          if p.returncode is None:
            _kill(p)
  except KeyboardInterrupt as e:
    output.say("interrupted; killing every process.")
    _stop(procs)
    return 128 + getattr(e, "signum", signal.SIGINT), None
  finally:
    for p in procs:  # what the processes started and left running (it would also keep their pipes open)
      _kill_group(p)
    exits.close()
    output.join(5.0)

  if timed_out and first is None:
    return 124, None
  if forwarded is None and termination.at is not None and len(procs) < len(envs):
    forwarded = termination.at  # stopped before the job was started whole
  if forwarded is not None:
    if first is not None:
      status = _exit_status(first.code)
    elif any(p.killed for p in procs) or len(procs) < len(envs):
      status = 128 + termination.signum
    else:
      status = 0
    output.say(_report_terminated(procs, first, forwarded, termination_grace_period, status, termination.name))
    return status, None
  if first is None:
    return 0, None
  output.say(_report(procs, first, start, grace_period))
  # The status of the process the report names first, which is not the first to exit when that one is a
  # victim (JAX declared a hung peer dead, or its step watchdog named a stuck peer).
  return _exit_status(_culprit(procs, first)[0].code), None if timed_out else _cause(procs, first)


def _stop(procs: Sequence[_Proc]) -> None:
  """Kills every process still running and waits for them."""
  for p in procs:
    if p.returncode is None:
      _kill(p)
  for p in procs:
    p.popen.wait()


def main(argv: Sequence[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  command = list(args.command)
  if command and command[0] == "--":
    command = command[1:]
  if args.module is not None:
    if not args.module:
      parser.error("-m needs a module name")
    command = [sys.executable, "-m"] + args.module
  elif not command:
    parser.error("give the script to run (script.py [args...]) or -m module [args...]")
  else:
    command = [sys.executable] + command
  if not 0 <= args.port <= 65535 - names.JOB_CHECK_PORT_OFFSET:
    parser.error(f"--port must be in [0, {65535 - names.JOB_CHECK_PORT_OFFSET}] (the next port is the job "
                 f"check's), got {args.port}")
  if args.profile_steps is not None and args.profile is None:
    parser.error("--profile-steps needs --profile DIR")
  if args.step_timeout is None and os.environ.get(names.ENV_STEP_TIMEOUT, "").strip():
    try:
      _check_timeout("step_timeout", os.environ[names.ENV_STEP_TIMEOUT],
                     f"{names.ENV_STEP_TIMEOUT} (in the launcher's environment)")
    except ValueError as e:
      parser.error(str(e))

  def stop(signum: int, frame: Any) -> None:
    raise _Interrupted(signum)  # the processes are killed on the way out

  if hasattr(signal, "SIGHUP"):  # SIGTERM: `launch` forwards it to the processes
    signal.signal(signal.SIGHUP, stop)
  return launch(command, num_processes=args.num_processes, devices_per_process=args.devices_per_process,
                port=args.port, heartbeat_timeout=args.heartbeat_timeout,
                initialization_timeout=args.initialization_timeout, shutdown_timeout=args.shutdown_timeout,
                grace_period=args.grace_period, timeout=args.timeout, max_restarts=args.max_restarts,
                step_timeout=args.step_timeout, termination_grace_period=args.termination_grace_period,
                profile=args.profile, profile_steps=args.profile_steps, compilation_cache=args.compilation_cache)


if __name__ == "__main__":
  sys.exit(main())
