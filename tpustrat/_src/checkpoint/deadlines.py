"""Bounded checkpoint operations: the deadline thread that ends a process stuck in one, and the shared store.

Each blocking operation of a `CheckpointManager` is an `Operation` with a timeout, registered in
`DEADLINES` while it runs. A daemon thread wakes every ``min(1, timeout / 10)`` seconds; when an
operation has run past its timeout it asks the operation for its report (who has not finished their
part, doing what), publishes it under ``tpustrat/checkpoint/abort`` in the coordination service's
key-value store, prints it and ends the process with status 124 (`names.EXIT_STEP_TIMEOUT`). While an
operation runs, a process that finds that key published ends the same way, so the whole job stops. The
process is ended (``os._exit``) rather than raised into: its main thread is then blocked in orbax, in a
barrier that is a device collective, where no exception reaches it.

A save that fails (`abort`, from `CheckpointManager`) ends the job the same way, at once and with its own
status: 74 (`names.EXIT_CHECKPOINT_FAILED`) when the storage refused a write, 69
(`names.EXIT_CHECKPOINT_PEER_LOST`) when another process stopped in the middle of the save. The abort key
holds the status with the message, so that every process ends with the first failure's.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from tpustrat._src import jax_compat, names, watchdog

__all__ = ["DEADLINES", "DEFAULT_TIMEOUT", "KEY", "Operation", "Store", "abort", "check_timeout", "step_timeout"]

DEFAULT_TIMEOUT = 1200.0  # seconds, when neither `timeout` nor a step timeout is set (orbax's own async limit)
KEY = "tpustrat/checkpoint"
_ABORT_KEY = f"{KEY}/abort"


class Store:
  """The key-value store the processes share: the coordination service's, or a local table with one
  process."""

  def __init__(self) -> None:
    self.index, self.count = jax.process_index(), jax.process_count()
    self.client = jax_compat.coordination_client() if self.count > 1 else None
    self._local: dict[str, str] = {}

  def set(self, key: str, value: str) -> None:
    if self.client is None:
      self._local[key] = value
      return
    try:
      self.client.key_value_set(key, value, allow_overwrite=True)
    except Exception:  # noqa: BLE001  # the service is shutting down: nothing left to tell
      pass

  def get(self, key: str) -> str | None:
    if self.client is None:
      return self._local.get(key)
    try:
      return self.client.key_value_try_get(key)
    except Exception:  # noqa: BLE001  # NOT_FOUND
      return None

  def set_once(self, key: str, value: str) -> bool:
    """Sets `key` unless it exists; whether this call set it."""
    if self.client is None:
      if key in self._local:
        return False
      self._local[key] = value
      return True
    try:
      self.client.key_value_set(key, value)
      return True
    except Exception:  # noqa: BLE001  # ALREADY_EXISTS
      return False


class Operation:
  """One blocking operation of a manager (or of the preemption handler through it), with its deadline.

  `done_key` names the marks that say a process has finished its own part (the operation's, or, for a
  wait, the save's). `report(expired, waited, innermost)` makes the message when `expired` runs past its
  deadline, from the innermost operation of the same `owner` (a manager's `operations.Operations`) in
  flight (a save inside the preemption handler's, say), which knows most.
  """

  def __init__(self, owner: Any, store: Store, seq: int, what: str, done_key: str, timeout: float, source: str,
               report: Callable[[Operation, float, Operation], str]) -> None:
    self.owner, self.store, self.seq, self.what, self.done_key = owner, store, seq, what, done_key
    self.timeout, self.source, self.report = timeout, source, report
    self.start = time.monotonic()
    self.stage = 0  # the phases this process has entered (every process goes through the same ones)


class _Deadlines:
  """The operations in flight in this process and the thread that ends the process when one of them runs
  past its timeout, or when another process has published that one did."""

  def __init__(self) -> None:
    self._ops: dict[int, Operation] = {}
    self._cond = threading.Condition()
    self._thread: threading.Thread | None = None

  def add(self, op: Operation) -> None:
    with self._cond:
      self._ops[id(op)] = op
      if self._thread is None or not self._thread.is_alive():
        self._thread = threading.Thread(target=self._watch, name="tpustrat-checkpoint-deadline", daemon=True)
        self._thread.start()
      self._cond.notify_all()

  def remove(self, op: Operation) -> None:
    with self._cond:
      self._ops.pop(id(op), None)

  def _watch(self) -> None:
    while True:
      with self._cond:
        while not self._ops:
          self._cond.wait()
        ops = list(self._ops.values())
        interval = min(1.0, min(op.timeout for op in ops) / 10)
        self._cond.wait(max(0.01, interval))
        ops = [op for op in self._ops.values()]
      if not ops:
        continue
      try:
        self._tick(ops)
      except Exception as e:  # noqa: BLE001  # a report that cannot be made must not stop the watching
        sys.stderr.write(f"tpustrat: checkpoint deadline thread: {type(e).__name__}: {e}\n")

  def _tick(self, ops: list[Operation]) -> None:
    store = ops[0].store
    if store.client is not None:
      published = store.get(_ABORT_KEY)
      if published is not None:
        message, status = _decode(published)
        self._end(ops, f"{message}\ntpustrat: checkpoint {_WHAT.get(status, 'abort')}: process {store.index} (in the "
                       f"{ops[0].what}) stops too.", status)
        return
    now = time.monotonic()
    for op in ops:
      waited = now - op.start
      if waited > op.timeout:
        # The innermost operation in flight (a save inside the preemption handler's) says most.
        detail = max((o for o in ops if o.owner is op.owner), key=lambda o: o.start)
        message, status = _publish(store, op.report(op, waited, detail), names.EXIT_STEP_TIMEOUT, op.what)
        self._end(ops, message, status)
        return

  def _end(self, ops: list[Operation], message: str, status: int) -> None:
    with self._cond:
      for op in ops:
        self._ops.pop(id(op), None)
    _exit_process(message, status)

  def clear(self) -> None:
    """Forgets every operation in flight (the process is about to end)."""
    with self._cond:
      self._ops.clear()


_WHAT = {names.EXIT_STEP_TIMEOUT: "timeout", names.EXIT_CHECKPOINT_FAILED: "save failed",
         names.EXIT_CHECKPOINT_PEER_LOST: "save failed"}


def _decode(published: str) -> tuple[str, int]:
  """(message, status) of a published abort."""
  try:
    value = json.loads(published)
    return str(value["message"]), int(value["status"])
  except (ValueError, KeyError, TypeError):
    return published, names.EXIT_STEP_TIMEOUT


def _publish(store: Store, message: str, status: int, what: str) -> tuple[str, int]:
  """Publishes this process's abort unless another process's came first; the (message, status) to end
  with: ours, or the first one's with a line saying that this process stops too."""
  if store.set_once(_ABORT_KEY, json.dumps({"message": message, "status": status})):
    return message, status
  first, first_status = _decode(store.get(_ABORT_KEY) or json.dumps({"message": message, "status": status}))
  return (f"{first}\ntpustrat: checkpoint {_WHAT.get(first_status, 'abort')}: process {store.index} (in the "
          f"{what}) stops too."), first_status


DEADLINES = _Deadlines()


def abort(store: Store, message: str, what: str, status: int) -> None:
  """Ends this process, and through the published key the job, after a failed save: with `status`
  (`names.EXIT_CHECKPOINT_FAILED` or `names.EXIT_CHECKPOINT_PEER_LOST`), or with the status of another
  process's abort published first (a process whose write failed publishes before it ends, so the peers
  whose barriers then fail stop with its status, not with the peer-lost one)."""
  message, status = _publish(store, message, status, what)
  DEADLINES.clear()
  _exit_process(message, status)


def _exit_process(message: str, status: int) -> None:
  """Ends the process with `status` after printing `message` (patched by tests)."""
  if status == names.EXIT_STEP_TIMEOUT:
    watchdog.exit_step_timeout(message)
    return
  watchdog.exit_now(message, status)


def step_timeout() -> float | None:
  """The step timeout of this process, if one is set (the running step watchdog's, else the variable's)."""
  dog = watchdog.active()
  if dog is not None:
    return dog.timeout
  return watchdog.timeout_from_environment()


def check_timeout(value: Any) -> float | None:
  """`value` (the manager's `timeout`) as a float, or None; the step timeout's range and error
  (`watchdog.check_timeout`: ``[1, 2**31 - 1]`` seconds), since it bounds the same waits."""
  if value is None:
    return None
  return watchdog.check_timeout(value, "CheckpointManager", "timeout")
