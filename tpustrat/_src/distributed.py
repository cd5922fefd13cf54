"""Starting JAX's distributed runtime for a multi-process job, with clear errors and bounded failures.

`tpustrat.experimental_connect_to_cluster` calls `initialize` here, which wraps
`jax.distributed.initialize`. tpustrat never runs its own distributed runtime; it adds the checks JAX
leaves out. Measured with jax 0.10.2 (2 processes x 4 CPU devices on loopback):

* A process that cannot reach the coordinator is killed by a C++ fatal error after JAX's
  `initialization_timeout` ("DEADLINE_EXCEEDED ... RegisterTask"), without naming the address. Here,
  processes other than 0 first wait (at most that long) for the coordinator's port to accept a
  connection, and raise a `RuntimeError` naming the address and the timeout if it never does.
* On a port already taken by another coordinator, process 0's service starts anyway (gRPC reuses ports)
  and every process then waits until the timeout. Here process 0 raises a `RuntimeError`
  (`CoordinatorPortTaken`) at once; uncaught, with the exception hook below, it ends the process with
  status 75 (`names.EXIT_START_FAILED`), which tells `python -m tpustrat.launch` to try another port.
* Any process that reaches the coordinator's port can register with it: a process of a second job
  started on the same address registers as a task the first job already has, and the coordinator aborts
  the first job ("unexpectedly tried to connect with a different incarnation"). Here a job with an
  identity (`job_identity`: ``TPUSTRAT_JOB_ID``, which `python -m tpustrat.launch` sets to a fresh random
  token at each start, else ``slurm-<SLURM_JOB_ID>.<SLURM_STEP_ID>`` inside Slurm) is checked before
  anything registers: process 0 binds the next port (the coordinator's + 1, the job check port) before
  starting the coordinator, keeps it for its whole life and answers every connection there with the job
  identity; every other process reads it there first, and registers only when it is its own. Another
  job's answer raises `CoordinatorOfAnotherJob` naming the address, at once, and the running job is left
  alone; another job's process 0 finds the job check port taken (`CoordinatorPortTaken`). This is a guard
  against accidents, not authentication: the identity travels in clear text. A process without an
  identity is not checked (nor protected), as before; a process with one whose process 0 has none finds
  no job check answering and stops at the initialization timeout with an error that says so.
* Timeouts beyond what JAX takes (int32 seconds) used to fail inside JAX with a `TypeError`, after the
  processes had waited for each other; here they are checked first: whole seconds in [1, 2**31 - 1]
  (`names.MAX_TIMEOUT_SECONDS`), a `ValueError` naming the setting otherwise.
* If not every process connects in time (one missing, or two with one id), JAX kills the processes with
  the same cryptic message. Here a watchdog prints what is wrong and exits with status 1 just before.
* A process id beyond the coordinator's process count is rejected by JAX itself, which kills that process
  ("Unexpected task registered with task=2"); the others are stopped by the watchdog.
* JAX does not compare the processes' views of the job: processes told different process counts connect,
  then wait forever while assembling the device topology; processes with different device counts form
  one job with an uneven number of devices per process. Here every process publishes its process count
  in the coordinator's key-value store and compares it with process 0's, and the device counts are
  compared once the backends are up: a `ValueError` in every process.
* A process that dies, or hangs so that it stops sending heartbeats, is noticed by JAX's coordination
  service within `heartbeat_timeout`; it stops every other process with an error naming it ("The
  following tasks are unhealthy (stopped sending heartbeats)"). If process 0 dies, the others lose the
  coordinator and stop the same way.
* A process that ends with an uncaught exception would wait at JAX's shutdown barrier (for
  `shutdown_timeout`) while the others wait for it inside a collective. If asked (see below), once
  connected, it exits at once with status 1 after printing the traceback, so the others stop within the
  heartbeat timeout and a launcher sees which process failed first.

What this module does to the process as a whole:

* The exception hook (opt-in). `sys.excepthook` is process-global, so it is replaced only when asked:
  ``initialize(..., exit_on_uncaught=True)``, or, with the argument left at None (as
  `tpustrat.experimental_connect_to_cluster` leaves it), when the environment variable
  ``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION`` is ``1`` (``true``, ``yes``, ``on``; ``0``, ``false``, ``no``,
  ``off`` or unset: not installed). `python -m tpustrat.launch` sets it to ``1`` for the processes it
  starts, unless it is set already (``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION=0 python -m tpustrat.launch
  ...`` turns the hook off); on a cluster, set it in each process's environment to turn it on. Installed
  once the process has connected, once per process. On an uncaught exception it first calls the hook
  it replaced (Python's prints the traceback; a hook of your own installed before runs as usual), then
  prints one line saying why the process ends and calls ``os._exit(1)`` (130 after a
  `KeyboardInterrupt`): `atexit` handlers do not run, and files other than `sys.stdout` / `sys.stderr`
  are not flushed. Interactive sessions (``python -i``, the REPL) keep running. Without the hook, a
  process ending with an uncaught exception waits at the shutdown barrier for up to `shutdown_timeout`
  while the others wait for it in their next collective, until JAX's own timeouts end the job.
* The watchdog (always). While connecting, and while the connected processes compare their views of the
  job and start JAX's backends, a timer thread ends the process with ``os._exit(1)`` and a message
  saying what is missing if that does not finish within `initialization_timeout`. Where it fires the job
  cannot start anyway: the main thread is blocked inside JAX and cannot raise, and while connecting JAX
  would end the process itself, 15 s later, with a C++ fatal error (``DEADLINE_EXCEEDED``) that names
  neither the address nor the cause. The timer is cancelled as each phase completes; nothing of it is
  left once `initialize` returns.
"""

from __future__ import annotations

import collections
import errno
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax

from tpustrat._src import jax_compat, names, termination_notice, validation
from tpustrat._src import watchdog as step_watchdog

__all__ = ["CoordinatorOfAnotherJob", "CoordinatorPortTaken", "initialize", "job_check_address", "job_identity"]

# JAX's own deadline is set this much later than ours, so that the watchdog explains a timeout first.
_JAX_TIMEOUT_MARGIN = 15
_KEY = "tpustrat/connect/process_{}"


def _split(address: str) -> tuple[str, int]:
  host, _, port = address.rpartition(":")
  try:
    return host.strip("[]"), int(port)
  except ValueError:
    raise ValueError(f"experimental_connect_to_cluster: the address {address!r} must be 'host:port' with a "
                     "numeric port.") from None


class CoordinatorPortTaken(RuntimeError):
  """Process 0 cannot start the coordinator: another process already listens on its port (or on the job
  check port next to it).

  Uncaught, with the exception hook installed (see the module docstring), it ends the process with status
  `names.EXIT_START_FAILED`, from which `python -m tpustrat.launch` learns to start the job again on
  another port.
  """


class CoordinatorOfAnotherJob(CoordinatorPortTaken):
  """A process other than 0 found the coordinator's address held by another job (its job check answered
  with another job identity); the process did not register with that coordinator.

  Uncaught, with the exception hook installed, it ends the process with status `names.EXIT_START_FAILED`,
  as `CoordinatorPortTaken` does.
  """


# -- the job check ------------------------------------------------------------------------------------------
#
# JAX's coordination service has no notion of a job: any process that reaches the coordinator's port may
# register with it as task `process_id`, and a stranger registering as a task the job already has makes
# the coordinator abort the job ("unexpectedly tried to connect with a different incarnation"). So, before
# registering, a process of a job with an identity reads the identity of the job that holds the address,
# from process 0, on the next port (`names.JOB_CHECK_PORT_OFFSET`), and joins only its own job.
# Process 0 binds that port before it checks the coordinator's port and keeps it for its whole life: while
# one job runs, no other job's process 0 can start a coordinator on the same address either.

_GREETING = b"tpustrat-job-check 1 "
_MAX_JOB_ID = 256  # characters
_MAX_ANSWER = 4096  # bytes


def job_identity() -> str | None:
  """This process's job identity: ``TPUSTRAT_JOB_ID`` (set by `python -m tpustrat.launch`, a fresh
  random one for each start, or by hand), else ``slurm-<SLURM_JOB_ID>[.<SLURM_STEP_ID>]`` inside a Slurm
  job, else None (no job check).

  Raises:
    ValueError: ``TPUSTRAT_JOB_ID`` is longer than 256 characters or holds a control character.
  """
  text = os.environ.get(names.ENV_JOB_ID, "").strip()
  if text:
    if len(text) > _MAX_JOB_ID or any(ord(c) < 32 or ord(c) == 127 for c in text):
      raise ValueError(f"{names.ENV_JOB_ID}={text[:300]!r} must be at most {_MAX_JOB_ID} printable characters.")
    return text
  slurm_job = os.environ.get("SLURM_JOB_ID", "").strip()
  if slurm_job:
    step = os.environ.get("SLURM_STEP_ID", "").strip()
    return f"slurm-{slurm_job}" + (f".{step}" if step else "")
  return None


def job_check_address(address: str) -> tuple[str, int, str]:
  """(host, port, ``host:port`` as text) of the job check that goes with the coordinator at `address`:
  the same host, the next port.

  Raises:
    ValueError: `address` is not ``host:port``, or its port is the last one (65535).
  """
  host, port = _split(address)
  check = port + names.JOB_CHECK_PORT_OFFSET
  if not 0 < check < 65536:
    raise ValueError(
        f"experimental_connect_to_cluster: the coordinator's port {port} ({address}) leaves no port for the "
        f"job check, which uses the coordinator's port + {names.JOB_CHECK_PORT_OFFSET}; pick a port below "
        "65535.")
  return host, check, f"{address.rpartition(':')[0]}:{check}"


def _listen(host: str, port: int) -> socket.socket:
  """A TCP socket listening on (`host`, `port`); every interface (IPv6 and IPv4) for ``""``, ``*``, ``::``."""
  everywhere = host in ("", "*", "::", "0.0.0.0")
  attempts = [(socket.AF_INET6, "::"), (socket.AF_INET, "")] if everywhere and host != "0.0.0.0" else (
      [(socket.AF_INET, "")] if everywhere else [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)])
  for i, (family, name) in enumerate(attempts):
    try:
      sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
      if i + 1 < len(attempts):  # no IPv6 on this host
        continue
      raise
    try:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
      if family == socket.AF_INET6 and everywhere:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
      sock.bind((name, port))
      sock.listen(64)
      return sock
    except OSError:
      sock.close()
      raise
  raise AssertionError("unreachable")


class _JobCheckServer:
  """Process 0's side of the job check: answers every connection with the job identity, then closes it."""

  def __init__(self, sock: socket.socket, job_id: str) -> None:
    self._sock = sock
    self._answer = _GREETING + json.dumps({"job_id": job_id}).encode() + b"\n"
    self._thread = threading.Thread(target=self._serve, name="tpustrat-job-check", daemon=True)

  def start(self) -> None:
    self._thread.start()

  def _serve(self) -> None:
    while True:
      try:
        conn, _ = self._sock.accept()
      except OSError:  # closed
        return
      with conn:
        try:
          conn.settimeout(2.0)
          conn.sendall(self._answer)
        except OSError:
          pass

  def close(self) -> None:
    try:
      self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
    except OSError:
      pass
    self._sock.close()


_job_check_server: _JobCheckServer | None = None  # process 0's, for the life of the process


def _bind_job_check(bind_address: str, index: int, job_id: str) -> _JobCheckServer:
  """Process 0: binds the job check port (not serving yet); CoordinatorPortTaken if it is in use."""
  host, port, shown = job_check_address(bind_address)
  try:
    sock = _listen(host.strip("[]"), port)
  except OSError as e:
    if e.errno == errno.EADDRINUSE:
      raise CoordinatorPortTaken(
          f"experimental_connect_to_cluster: process {index} runs the coordinator, but {shown} is already in "
          f"use: that is the job check port of the coordinator at {bind_address} (its port + "
          f"{names.JOB_CHECK_PORT_OFFSET}), where process 0 tells the others which job it runs (job "
          f"{job_id!r}). Another job (or another process started as process 0) holds it. Pick another port, "
          "with the next one free too, and give exactly one process process_id=0.") from None
    raise
  return _JobCheckServer(sock, job_id)


def _read_answer(conn: socket.socket) -> bytes:
  data = b""
  while not data.endswith(b"\n") and len(data) < _MAX_ANSWER:
    chunk = conn.recv(_MAX_ANSWER - len(data))
    if not chunk:
      break
    data += chunk
  return data


def _job_of_answer(data: bytes) -> str | None:
  """The job identity in process 0's answer, or None if `data` is not a job check's answer."""
  if not data.startswith(_GREETING) or not data.endswith(b"\n"):
    return None
  try:
    job = json.loads(data[len(_GREETING):])["job_id"]
  except (ValueError, KeyError, TypeError):
    return None
  return job if isinstance(job, str) else None


def _check_job(address: str, job_id: str, index: int, count: int, deadline: float, timeout: float) -> None:
  """A process other than 0: returns once process 0 of this job answers the job check next to `address`
  with `job_id`; raises `CoordinatorOfAnotherJob` at once if another job answers, or a RuntimeError naming
  the address if no job check answers by `deadline`. Registers with nothing."""
  host, port, shown = job_check_address(address)
  host = host.strip("[]")
  last = "no answer yet"
  answered = None  # another program's answer, once one came: the likeliest cause, kept over later errors
  while True:
    remaining = deadline - time.monotonic()
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(2.0, remaining))) as conn:
        data = _read_answer(conn)
    except OSError as e:
      error = str(e) or type(e).__name__
      last = error if answered is None else f"{answered} (then: {error})"
    else:
      theirs = _job_of_answer(data)
      if theirs == job_id:
        return
      if theirs is not None:
        raise CoordinatorOfAnotherJob(
            f"experimental_connect_to_cluster: process {index} of {count} of job {job_id!r} will not join the "
            f"coordinator at {address}: another job holds that address (its process 0 answered the job check "
            f"at {shown} with job {theirs!r}). This process did not register with it, so that job goes on "
            f"undisturbed. Give this job a free port (python -m tpustrat.launch --port, or the coordinator "
            f"address), or wait until the other job has ended.")
      last = answered = f"the answer was not a job check's: {data[:80]!r}"
    if time.monotonic() >= deadline:
      raise RuntimeError(
          f"experimental_connect_to_cluster: process {index} of {count} of job {job_id!r} could not check the "
          f"job of the coordinator at {address} within {timeout:g} s (initialization_timeout): process 0 of "
          f"this job answers the job check at {shown} (the coordinator's port + "
          f"{names.JOB_CHECK_PORT_OFFSET}) once it starts (last error: {last}). Check that process 0 is "
          f"running with the same coordinator address and the same job identity ({names.ENV_JOB_ID}, or "
          "SLURM_JOB_ID and SLURM_STEP_ID), that this host can reach that port too, or raise the timeout "
          f"({names.ENV_INITIALIZATION_TIMEOUT}).")
    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _check_port_free(bind_address: str, index: int) -> None:
  """Raises if another process already listens on the coordinator's port (process 0 only)."""
  host, port = _split(bind_address)
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    sock = socket.socket(family, socket.SOCK_STREAM)
  except OSError:  # e.g. no IPv6 on this host: leave it to JAX
    return
  with sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
    try:
      sock.bind((host if host not in ("", "*") else "", port))
    except OSError as e:
      if e.errno == errno.EADDRINUSE:
        raise CoordinatorPortTaken(
            f"experimental_connect_to_cluster: process {index} runs the coordinator, but {bind_address} is "
            "already in use: another job (or another process started as process 0) is listening there. "
            "Pick another port, and give exactly one process process_id=0.") from None


def _wait_for_coordinator(address: str, index: int, count: int, deadline: float, timeout: int) -> None:
  """Waits until the coordinator's port accepts a TCP connection; raises naming it at the deadline."""
  host, port = _split(address)
  last: OSError | None = None
  while True:
    remaining = deadline - time.monotonic()
    try:
      with socket.create_connection((host, port), timeout=max(0.1, min(2.0, remaining))):
        return
    except OSError as e:
      last = e
    if time.monotonic() >= deadline:
      raise RuntimeError(
          f"experimental_connect_to_cluster: process {index} of {count} could not reach the coordinator at "
          f"{address} within {timeout} s (initialization_timeout; last error: {last}). Process 0 starts "
          "the coordinator: check that it is running with the same coordinator address, that this host "
          "can reach that address and port, or raise the timeout (TPUSTRAT_INITIALIZATION_TIMEOUT).")
    time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


class _Watchdog:
  """Ends the process with a clear message if the connection is not complete by `deadline`.

  JAX would kill it a little later with a C++ fatal error that names neither the address nor the cause;
  an exception cannot be raised in the main thread, which is blocked inside JAX.
  """

  def __init__(self, seconds: float, message: str) -> None:
    self._message = message
    self._timer = threading.Timer(max(0.0, seconds), self._fire)
    self._timer.daemon = True
    self._timer.name = "tpustrat-connect-watchdog"
    self._timer.start()

  def _fire(self) -> None:
    _flush()
    sys.stderr.write(f"tpustrat: {self._message}\n")
    _flush()
    os._exit(1)

  def cancel(self) -> None:
    self._timer.cancel()


def _flush() -> None:
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001  # a closed stream must not stop the exit
      pass


def _check_process_counts(coordinator: str, count: int, index: int, deadline: float) -> None:
  """Every process publishes how many processes it was told about; all must agree with process 0."""
  client = jax_compat.coordination_client()
  if client is None or not hasattr(client, "key_value_set"):  # pragma: no cover - private API moved
    return
  client.key_value_set(_KEY.format(index), json.dumps({"num_processes": count}))
  others = range(1, count) if index == 0 else [0]
  for other in others:
    timeout_ms = max(1000, int((deadline - time.monotonic()) * 1000))
    theirs = json.loads(client.blocking_key_value_get(_KEY.format(other), timeout_ms))["num_processes"]
    if theirs != count:
      who = "the coordinator" if other == 0 else f"process {other}"
      raise ValueError(
          f"experimental_connect_to_cluster: this process (process {index}) was started for a job of "
          f"{count} processes, but {who} for {theirs}; the coordinator at {coordinator} runs a job of "
          f"{count if index == 0 else theirs}. Give every process the same num_processes "
          "(TPUSTRAT_NUM_PROCESSES) and a distinct process_id in [0, num_processes).")


def _check_device_counts(count: int) -> None:
  """Every process must bring the same number of devices (the strategy's replicas are spread evenly)."""
  per_process = collections.Counter(d.process_index for d in jax.devices())
  if len(per_process) != count or len(set(per_process.values())) != 1:
    described = ", ".join(f"process {p}: {n}" for p, n in sorted(per_process.items()))
    raise ValueError(
        f"experimental_connect_to_cluster: the processes of the job have different numbers of devices "
        f"({described}); every process must have the same number. Check JAX_NUM_CPU_DEVICES / "
        "--xla_force_host_platform_device_count (the launcher's --devices-per-process) or local_device_ids.")


# `names.ENV_EXIT_ON_UNCAUGHT` says whether `initialize` installs the exception hook, when its
# `exit_on_uncaught` argument is None. tpustrat.launch sets it to "1".
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

_hooked = False


def _exit_on_uncaught_wanted(exit_on_uncaught: bool | None) -> bool:
  """`initialize`'s `exit_on_uncaught`: the argument if given, else what the variable says."""
  if exit_on_uncaught is not None:
    if not isinstance(exit_on_uncaught, bool):
      raise TypeError(f"exit_on_uncaught must be True, False or None, got {exit_on_uncaught!r}.")
    return exit_on_uncaught
  text = os.environ.get(names.ENV_EXIT_ON_UNCAUGHT, "")
  if text.strip().lower() in _TRUE:
    return True
  if text.strip().lower() in _FALSE:
    return False
  raise ValueError(
      f"{names.ENV_EXIT_ON_UNCAUGHT}={text!r} must be one of {', '.join(_TRUE)} (exit at once after an "
      f"uncaught exception) or {', '.join(v for v in _FALSE if v)} (do not), or unset.")


def _exit_on_uncaught_exception(index: int, count: int, heartbeat_timeout: int) -> None:
  """After an uncaught exception, exit at once instead of waiting at JAX's shutdown barrier.

  The status is 1 (130 after a `KeyboardInterrupt`; `names.EXIT_START_FAILED` after a
  `CoordinatorPortTaken`, for the launcher). Installed once per process, chaining to the hook it
  replaces. Interactive sessions (``python -i``, the REPL, where every mistyped line reaches
  `sys.excepthook`) are left running.
  """
  global _hooked
  if _hooked:
    return
  _hooked = True
  previous = sys.excepthook

  def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    if sys.flags.interactive or hasattr(sys, "ps1"):
      previous(kind, value, tb)
      return
    status = 130 if issubclass(kind, KeyboardInterrupt) else 1
    try:
      previous(kind, value, tb)
      step_watchdog.end_if_aborted(kind.__name__)  # a step watchdog stops the job: end as it does (124)
      if issubclass(kind, CoordinatorOfAnotherJob):
        status = names.EXIT_START_FAILED
        sys.stderr.write(f"tpustrat: process {index} of {count} found the coordinator's address held by "
                         f"another job and did not join it; it exits at once with status {status}.\n")
      elif issubclass(kind, CoordinatorPortTaken):
        status = names.EXIT_START_FAILED
        sys.stderr.write(f"tpustrat: process {index} of {count} could not start the job's coordinator; it "
                         f"exits at once with status {status}.\n")
      else:
        sys.stderr.write(
            f"tpustrat: process {index} of {count} exits at once after an uncaught {kind.__name__}, without "
            f"waiting at JAX's shutdown barrier; the other processes stop within the heartbeat timeout "
            f"({heartbeat_timeout} s).\n")
    finally:
      _flush()
      os._exit(status)

  sys.excepthook = hook


def _check_timeouts(**timeouts: Any) -> None:
  """The three timeouts JAX takes, as whole seconds in [1, `names.MAX_TIMEOUT_SECONDS`]."""
  for name, value in timeouts.items():
    env = {"initialization_timeout": names.ENV_INITIALIZATION_TIMEOUT,
           "heartbeat_timeout": names.ENV_HEARTBEAT_TIMEOUT, "shutdown_timeout": names.ENV_SHUTDOWN_TIMEOUT}[name]
    validation.check_seconds(
        value, f"experimental_connect_to_cluster: {name} (the resolver's argument, or {env})", minimum=1,
        maximum=names.MAX_TIMEOUT_SECONDS, integer=True, note="JAX's distributed runtime takes int32 seconds")


def initialize(coordinator_address: str, num_processes: int, process_id: int,
               local_device_ids: Sequence[int] | None, *, coordinator_bind_address: str | None,
               initialization_timeout: int, heartbeat_timeout: int, shutdown_timeout: int,
               exit_on_uncaught: bool | None = None, job_id: str | None = None) -> None:
  """`jax.distributed.initialize` with the checks described in the module docstring; starts the backends.

  Args:
    coordinator_address, num_processes, process_id, local_device_ids, coordinator_bind_address,
      initialization_timeout, heartbeat_timeout, shutdown_timeout: as for `jax.distributed.initialize`
      (the timeouts in seconds).
    exit_on_uncaught: whether to replace `sys.excepthook`, once connected, with a hook that ends the
      process at once (``os._exit(1)``, after printing the traceback) on an uncaught exception, so that
      the other processes of the job stop within the heartbeat timeout instead of waiting for it (see the
      module docstring). None (the default): as ``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION`` says, which
      `python -m tpustrat.launch` sets to ``1``; unset, the hook is not installed.
    job_id: the job's identity (see the job check in the module docstring); None (the default):
      `job_identity()`, from ``TPUSTRAT_JOB_ID`` or Slurm's variables; without one, no job check.

  Raises:
    ValueError: a timeout outside [1, 2**31 - 1] whole seconds, ``TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION``
      neither a true nor a false word, a bad ``TPUSTRAT_JOB_ID`` (all before connecting), or processes that
      disagree about the job (see the module docstring).
    TypeError: `exit_on_uncaught` is not a bool or None.
    CoordinatorPortTaken: process 0 finds the coordinator's port, or the job check port, in use.
    CoordinatorOfAnotherJob: another job holds the coordinator's address (processes other than 0).
  """
  _check_timeouts(initialization_timeout=initialization_timeout, heartbeat_timeout=heartbeat_timeout,
                  shutdown_timeout=shutdown_timeout)
  exit_at_once = _exit_on_uncaught_wanted(exit_on_uncaught)
  if job_id is None:
    job_id = job_identity()
  index, count, timeout = process_id, num_processes, initialization_timeout
  start = time.monotonic()
  deadline = start + timeout
  global _job_check_server
  try:
    if index == 0:
      bind_address = coordinator_bind_address or f"[::]:{_split(coordinator_address)[1]}"
      _check_port_free(bind_address, index)
      if job_id is not None and _job_check_server is None:
        # Bound before serving: the coordinator's port was free, and no other job can start a coordinator
        # there while this process holds the port next to it.
        server = _bind_job_check(bind_address, index, job_id)
        try:
          _check_port_free(bind_address, index)  # still free now that the job check port is held
        except CoordinatorPortTaken:
          server.close()
          raise
        _job_check_server = server
        server.start()
    else:
      if job_id is not None:
        _check_job(coordinator_address, job_id, index, count, deadline, timeout)
      _wait_for_coordinator(coordinator_address, index, count, deadline, timeout)
  except CoordinatorPortTaken:
    if exit_at_once:  # uncaught, it ends the process with names.EXIT_START_FAILED
      _exit_on_uncaught_exception(index, count, heartbeat_timeout)
    raise
  watchdog = _Watchdog(deadline - time.monotonic(), (
      f"experimental_connect_to_cluster: process {index} of {count} gave up after {timeout} s "
      f"(initialization_timeout): not every process of the job connected to the coordinator at "
      f"{coordinator_address}. Check that all {count} processes were started, each with the same "
      f"num_processes ({count}) and its own process_id in [0, {count}), and that each can reach "
      f"{coordinator_address}. Exiting."))
  try:
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=count, process_id=index,
        local_device_ids=local_device_ids,
        initialization_timeout=min(timeout + _JAX_TIMEOUT_MARGIN, names.MAX_TIMEOUT_SECONDS),
        heartbeat_timeout_seconds=heartbeat_timeout, shutdown_timeout_seconds=shutdown_timeout,
        coordinator_bind_address=coordinator_bind_address)
  finally:
    watchdog.cancel()
  # JAX's preemption notifier now has SIGTERM; a notice before a PreemptionCheckpointHandler exists is
  # kept for it instead (termination_notice's docstring).
  termination_notice.install(index)
  if exit_at_once:
    _exit_on_uncaught_exception(index, count, heartbeat_timeout)
  # Connected. The checks and the backends' start (which exchanges every process's devices) get a
  # window of their own: the last process may have connected just before the deadline.
  deadline = time.monotonic() + timeout
  watchdog = _Watchdog(timeout, (
      f"experimental_connect_to_cluster: process {index} of {count} gave up after {timeout} s "
      f"(initialization_timeout): connected to the coordinator at {coordinator_address}, but the "
      "processes did not all finish starting JAX's backends. Exiting."))
  try:
    _check_process_counts(coordinator_address, count, index, deadline)
    _check_device_counts(count)
  finally:
    watchdog.cancel()
