"""The processes of `tpustrat.launch`: how each is started (its environment, the bootstrap that ties its
life to the launcher's), what the launcher remembers of it (`Proc`: its last lines, the processes JAX's
errors and the step watchdog name), its output copied with a ``[proc i]`` prefix, the order in which the
processes end (`Exits`: pidfds in an epoll set on Linux), the signals the launcher receives and sends.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from tpustrat._src import names

_PREFIX = "tpustrat.launch"  # of the launcher's own messages
_TAIL_LINES = 15
_UNHEALTHY = "stopped sending heartbeats"
# The coordinator (process 0) is gone, or does not answer heartbeats (it hangs).
_LEADER_LOST = ("the leader task was preempted", "RPC: /xla.coordination.CoordinationService/Heartbeat")
_IDS = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*,?\s*$")
# The line a firing step watchdog names the processes holding the job up with (every process prints it).
_WATCHDOG_BLAMES = re.compile(re.escape(names.WATCHDOG_BLAMES).replace(re.escape("{firing}"), r"(\d+)").replace(
    re.escape("{stuck}"), r"process(?:es)? (\d+(?:, \d+)*)") + r"\s*$")

# Each process starts as this small program, which asks Linux to SIGKILL it when the launcher dies (even
# by SIGKILL; PR_SET_PDEATHSIG survives exec), exits if the launcher is already gone, then exec()s the
# command (same pid). Not subprocess's `preexec_fn`: it runs Python between fork and exec, which can
# deadlock when the program calling `launch` has threads.
_BOOTSTRAP = f"""\
import os, sys
try:
  import ctypes
  ctypes.CDLL(None).prctl(1, {int(signal.SIGKILL)})  # PR_SET_PDEATHSIG
except Exception:  # not Linux: the launcher's own handlers have to do
  pass
if os.getppid() != int(sys.argv[1]):
  os._exit(1)
os.execv(sys.argv[2], sys.argv[3:])
"""

def bootstrapped(command: Sequence[str]) -> list[str]:
  """The argv that runs `command` through `_BOOTSTRAP`; FileNotFoundError (as `subprocess.Popen` raises)
  if its program cannot be found."""
  program = shutil.which(command[0])
  if program is None:
    raise FileNotFoundError(errno.ENOENT, f"No such file or directory: {command[0]!r}", command[0])
  if not sys.executable:  # an embedding interpreter that cannot start another one
    return list(command)
  return [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(os.getpid()), program, *command]


def _with_device_count(xla_flags: str, count: int) -> str:
  flags = [f for f in xla_flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
  return " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])


def process_env(base: Mapping[str, str], *, process_id: int, num_processes: int, devices_per_process: int,
                address: str, heartbeat_timeout: int, initialization_timeout: int, shutdown_timeout: int,
                step_timeout: float | None = None, restart_count: int = 0,
                job_id: str | None = None, profile_dir: str | None = None, profile_steps: int | None = None,
                compilation_cache: str | None = None) -> dict[str, str]:
  """The environment of process `process_id`: `base` plus what the resolver and JAX read,
  ``TPUSTRAT_RESTART_COUNT=restart_count``, ``TPUSTRAT_STEP_TIMEOUT=step_timeout`` unless `step_timeout`
  is None (then `base`'s, if any), ``TPUSTRAT_JOB_ID=job_id`` unless `job_id` is None (then `base`'s, if
  any), ``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION=1`` unless `base` sets it (to ``0``: no exception
  hook), and, where given, ``TPUSTRAT_PROFILE_DIR`` / ``TPUSTRAT_PROFILE_STEPS`` (`profile_dir`,
  `profile_steps`) and ``TPUSTRAT_COMPILATION_CACHE_DIR`` (`compilation_cache`), as absolute paths."""
  env = dict(base)
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "JAX_LOCAL_DEVICE_IDS",
               names.ENV_LOCAL_DEVICE_IDS):
    env.pop(name, None)
  env.update({
      names.ENV_COORDINATOR_ADDRESS: address,
      names.ENV_COORDINATOR_BIND_ADDRESS: address,
      names.ENV_NUM_PROCESSES: str(num_processes),
      names.ENV_PROCESS_ID: str(process_id),
      names.ENV_HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
      names.ENV_INITIALIZATION_TIMEOUT: str(initialization_timeout),
      names.ENV_SHUTDOWN_TIMEOUT: str(shutdown_timeout),
      "JAX_PLATFORMS": "cpu",
      "JAX_NUM_CPU_DEVICES": str(devices_per_process),
      "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
      "XLA_FLAGS": _with_device_count(env.get("XLA_FLAGS", ""), devices_per_process),
      "PYTHONUNBUFFERED": "1",
      names.ENV_RESTART_COUNT: str(restart_count),
  })
  if step_timeout is not None:
    env[names.ENV_STEP_TIMEOUT] = str(step_timeout)
  if job_id is not None:
    env[names.ENV_JOB_ID] = job_id
  if profile_dir is not None:
    env[names.ENV_PROFILE_DIR] = os.path.abspath(profile_dir)
    if profile_steps is not None:
      env[names.ENV_PROFILE_STEPS] = str(profile_steps)
  if compilation_cache is not None:
    env[names.ENV_COMPILATION_CACHE_DIR] = os.path.abspath(compilation_cache)
  if not env.get(names.ENV_EXIT_ON_UNCAUGHT, "").strip():
    env[names.ENV_EXIT_ON_UNCAUGHT] = "1"
  return env


@dataclasses.dataclass
class Proc:
  index: int
  popen: subprocess.Popen
  started: float
  tail: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
  returncode: int | None = None
  ended: float | None = None  # when the launcher learned of the end
  order: int | None = None  # 0 for the first process of the start to end, then 1, 2, ... (the kernel's order)
  killed: bool = False  # by the launcher
  unhealthy: set = dataclasses.field(default_factory=set)  # processes JAX's errors say are dead
  blamed: set = dataclasses.field(default_factory=set)  # processes a step watchdog says hold the job up
  blamed_by: int | None = None  # the process whose step watchdog said so
  _reading_unhealthy: bool = False

  @property
  def code(self) -> int:
    """`returncode`, for a process that has ended."""
    assert self.returncode is not None, f"process {self.index} is still running"
    return self.returncode

  @property
  def end_time(self) -> float:
    """`ended`, for a process that has ended."""
    assert self.ended is not None, f"process {self.index} is still running"
    return self.ended

  def note(self, line: str) -> None:
    """Remembers the processes that JAX's errors report as dead: those listed on the lines after "The
    following tasks are unhealthy (stopped sending heartbeats):", and process 0 (the coordinator) when the
    other processes lose it; and the processes a firing step watchdog names as holding the job up (its
    line, `names.WATCHDOG_BLAMES`)."""
    blames = _WATCHDOG_BLAMES.match(line)
    if blames:
      self.blamed_by = int(blames.group(1))
      self.blamed = {int(t) for t in re.findall(r"\d+", blames.group(2))}
    if any(marker in line for marker in _LEADER_LOST):
      self.unhealthy.add(0)
    if _UNHEALTHY in line:
      self._reading_unhealthy = True
    elif self._reading_unhealthy and _IDS.match(line):
      self.unhealthy.update(int(t) for t in re.findall(r"\d+", line))
    else:
      self._reading_unhealthy = False


class Output:
  """Copies the processes' output to ours, one whole line at a time, each with a ``[proc i]`` prefix."""

  def __init__(self, stdout: IO[bytes], stderr: IO[bytes]) -> None:
    self._out = {"stdout": stdout, "stderr": stderr}
    self._lock = threading.Lock()
    self._threads: list[threading.Thread] = []

  def follow(self, proc: Proc) -> None:
    for name, pipe in (("stdout", proc.popen.stdout), ("stderr", proc.popen.stderr)):
      thread = threading.Thread(target=self._copy, args=(proc, pipe, self._out[name]), daemon=True,
                                name=f"tpustrat-launch-{name}-{proc.index}")
      thread.start()
      self._threads.append(thread)

  def _copy(self, proc: Proc, pipe: IO[bytes], out: IO[bytes]) -> None:
    prefix = f"[proc {proc.index}] ".encode()
    for line in iter(pipe.readline, b""):
      if not line.endswith(b"\n"):
        line += b"\n"
      text = line.decode(errors="replace").rstrip()
      proc.note(text)
      if not text.lstrip().startswith("@ "):  # C++ stack frames of a fatal error say little
        proc.tail.append(text)
      with self._lock:
        out.write(prefix + line)
        out.flush()
    pipe.close()

  def say(self, message: str) -> None:
    with self._lock:
      self._out["stderr"].write(f"{_PREFIX}: {message}\n".encode())
      self._out["stderr"].flush()

  def join(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for t in self._threads:
      t.join(max(0.0, deadline - time.monotonic()))


def signal_group(proc: Proc, signum: int) -> bool:
  """Sends `signum` to the session the process leads (it and what it started); False if nothing was left."""
  try:
    os.killpg(proc.popen.pid, signum)
    return True
  except (ProcessLookupError, PermissionError):
    return False


def kill_group(proc: Proc) -> bool:
  """SIGKILL the session the process leads (it and what it started); False if nothing was left in it."""
  return signal_group(proc, signal.SIGKILL)


def kill(proc: Proc) -> None:
  """SIGKILL the process and everything it started. (SIGTERM is not enough: JAX's distributed runtime
  treats it as a preemption notice.)"""
  if not kill_group(proc):
    try:
      proc.popen.kill()
    except ProcessLookupError:
      pass
  proc.killed = True


class Interrupted(KeyboardInterrupt):
  """The launcher received `signum` (SIGHUP, or a second SIGTERM or SIGINT): it kills the job at once and
  exits with 128 + signum."""

  def __init__(self, signum: int) -> None:
    super().__init__(signum)
    self.signum = signum


class Exits:
  """Tells which processes of a start ended, in the order they ended.

  On Linux 5.3 and later: a pidfd per process, in one epoll set. The kernel makes a pidfd readable when
  its process has ended (it is then a zombie, not yet reaped), and epoll hands ready file descriptors back
  in the order they became ready; so the order holds even when several processes ended since the
  launcher last looked (it was busy, or not scheduled at all). Elsewhere, a thread per process blocks in
  `wait` and notes the time it returned: processes that end within a thread's wake-up latency of each
  other may then be reported in the wrong order.
  """

  def __init__(self) -> None:
    self._epoll: Any = None
    self._fds: dict[int, Proc] = {}
    self._queue: queue.Queue = queue.Queue()
    if hasattr(os, "pidfd_open") and hasattr(select, "epoll"):
      try:
        os.close(os.pidfd_open(os.getpid()))  # ENOSYS before Linux 5.3 (or in some sandboxes)
        self._epoll = select.epoll()
      except OSError:
        self._epoll = None

  def watch(self, proc: Proc) -> None:
    """Starts watching a process the launcher started (and has not reaped)."""
    if self._epoll is not None:
      fd = os.pidfd_open(proc.popen.pid)
      self._fds[fd] = proc
      self._epoll.register(fd, select.EPOLLIN)
      return
    thread = threading.Thread(target=self._wait, args=(proc,), daemon=True,
                              name=f"tpustrat-launch-wait-{proc.index}")
    thread.start()

  def _wait(self, proc: Proc) -> None:
    proc.popen.wait()
    self._queue.put((time.monotonic(), proc.index, proc))

  def ended(self, timeout: float) -> list[Proc]:
    """The processes that ended since the last call, first to end first; waits up to `timeout` seconds
    for one if none has."""
    if self._epoll is not None:
      found = []
      for fd, _ in self._epoll.poll(timeout):
        found.append(self._fds.pop(fd))
        self._epoll.unregister(fd)
        os.close(fd)
      return found
    items = []
    try:
      items.append(self._queue.get(timeout=timeout))
      while True:
        items.append(self._queue.get_nowait())
    except queue.Empty:
      pass
    return [proc for _, _, proc in sorted(items, key=lambda item: item[:2])]

  def close(self) -> None:
    for fd in self._fds:
      os.close(fd)
    self._fds.clear()
    if self._epoll is not None:
      self._epoll.close()


class Termination:
  """Whether and when the launcher received SIGTERM or SIGINT (Ctrl-C), and which (set by its signal
  handler, read by `_run`)."""

  def __init__(self) -> None:
    self.at: float | None = None
    self.signum: int = signal.SIGTERM

  def handler(self, signum: int, frame: Any) -> None:
    """The first SIGTERM or SIGINT is noted (`_run` forwards SIGTERM); a second one of either kills the job
    at once."""
    del frame
    if self.at is not None:
      raise Interrupted(signum)
    self.at, self.signum = time.monotonic(), signum

  @property
  def name(self) -> str:
    """The signal as the launcher's messages name it."""
    return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name
