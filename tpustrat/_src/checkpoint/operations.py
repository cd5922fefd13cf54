"""The bounded operations of one `CheckpointManager`: their numbering, what each process publishes about
them (its progress, its part done), the exchange of verdicts, and the report when one runs past its timeout.

Every process of a job makes the same calls on its manager, so its operations get the same numbers
(`seq`) in every process. While an operation runs, each process publishes in the shared store what it is
doing (``<prefix>/progress/<process>``) and, once its own part is finished, a mark under
``<prefix>/done/<done_key>/<process>``. When an operation runs past its timeout, the deadline thread
(`deadlines`) asks `Operations.report` which processes have not finished their part and what each is
doing.

`operations_of(manager)` gives a manager's `Operations` to work that is not the manager's own (the
preemption handler's save, through `bounded_operation`): it then runs under the manager's timeout and
report.
"""

from __future__ import annotations

import contextlib
import json
import time
import types
import weakref
from collections.abc import Iterator
from typing import Any

from tpustrat._src import names
from tpustrat._src.checkpoint.deadlines import DEADLINES, DEFAULT_TIMEOUT, Operation, Store, step_timeout

__all__ = ["Operations", "bounded_operation", "operations_of"]

POLL_SECONDS = 0.02  # how often a process looks for the others' verdicts

_BY_OWNER: weakref.WeakKeyDictionary[Any, Operations] = weakref.WeakKeyDictionary()


class Operations:
  """The bounded operations of one manager (`owner`) on `directory`; `prefix` names its keys in `store`,
  the same in every process. `timeout` is the manager's own (None: the step timeout, read at each
  operation, else `DEFAULT_TIMEOUT`)."""

  def __init__(self, owner: Any, store: Store, prefix: str, directory: str, timeout: float | None) -> None:
    self.store, self.prefix, self.directory = store, prefix, directory
    self._timeout = timeout
    self._seq = 0
    _BY_OWNER[owner] = self

  def timeout_and_source(self) -> tuple[float, str]:
    """The timeout of an operation starting now, and where it comes from (for the report)."""
    if self._timeout is not None:
      return self._timeout, "CheckpointManager(timeout=...)"
    seconds = step_timeout()
    if seconds is not None:
      return seconds, "the step timeout; CheckpointManager(timeout=...) sets another"
    return DEFAULT_TIMEOUT, "the default; CheckpointManager(timeout=...) sets another"

  @contextlib.contextmanager
  def operation(self, what: str, done_key: str | None = None) -> Iterator[Operation]:
    """Runs the body as one bounded operation (registered with `deadlines.DEADLINES` while it runs)."""
    self._seq += 1
    timeout, source = self.timeout_and_source()
    op = Operation(self, self.store, self._seq, what, done_key or f"{self._seq}.0", timeout, source, self.report)
    self.progress(op, f"starting the {what}")
    DEADLINES.add(op)
    try:
      yield op
    finally:
      DEADLINES.remove(op)

  def progress(self, op: Operation, phase: str) -> None:
    """Publishes what this process is doing in `op` (the report's "is ..." part)."""
    op.stage += 1
    self.store.set(f"{self.prefix}/progress/{self.store.index}", json.dumps(
        {"seq": op.seq, "stage": op.stage, "what": op.what, "phase": phase, "since": time.time()}))

  def mark_done(self, done_key: str, value: str) -> None:
    """Publishes that this process has finished its part of the operation (or save) `done_key` names."""
    self.store.set(f"{self.prefix}/done/{done_key}/{self.store.index}", value)

  def agree(self, op: Operation, problem: str | None) -> dict[int, str]:
    """Publishes this process's outcome of its part of `op` (`problem`, or None); waits (within the
    operation's deadline) for every process's; returns the problems, by process."""
    self.mark_done(op.done_key, json.dumps({"problem": problem}))
    store = self.store
    if store.count == 1:
      return {0: problem} if problem is not None else {}
    self.progress(op, f"waiting for the other processes' reading of {op.what.removeprefix('restore of ')}")
    found: dict[int, str | None] = {}
    while len(found) < store.count:
      for p in range(store.count):
        if p not in found:
          text = store.get(f"{self.prefix}/done/{op.done_key}/{p}")
          if text is not None:
            found[p] = json.loads(text)["problem"]
      if len(found) < store.count:
        time.sleep(POLL_SECONDS)
    return {p: text for p, text in found.items() if text is not None}

  def report(self, expired: Operation, waited: float, op: Operation) -> str:
    """The message when `expired` runs past its deadline: which processes have not finished their part of
    `op` (the innermost operation in flight), the ones behind the others first, and what each is doing."""
    store, me = self.store, self.store.index
    lines = [f"tpustrat: checkpoint timeout: process {me} has waited {waited:.1f} s for the {expired.what} in "
             f"{self.directory} (checkpoint timeout {expired.timeout:g} s: {expired.source})."]
    target = int(op.done_key.split(".")[0])
    now = time.time()
    where: dict[int, tuple[int, int]] = {}
    said: dict[int, str] = {}
    for p in range(store.count):
      if store.get(f"{self.prefix}/done/{op.done_key}/{p}") is not None:
        continue
      who = f"process {p}"
      text = store.get(f"{self.prefix}/progress/{p}")
      if text is None:
        where[p], said[p] = (-1, 0), f"{who} has started no checkpoint operation on this directory"
        continue
      progress = json.loads(text)
      where[p] = (progress["seq"], progress["stage"])
      doing = f"{progress['phase']} (for {now - progress['since']:.1f} s)"
      if progress["seq"] < target:
        said[p] = f"{who} has not reached the {op.what} (its last checkpoint operation: the {progress['what']}, {doing})"
      else:
        said[p] = f"{who} is {doing}"
    if not where:
      lines.append(f"every process has finished its own part of the {op.what}; the commit did not finish (orbax's "
                   "barriers, or process 0 renaming the temporary directory): check the storage.")
    else:
      low = min(where.values())
      behind = [p for p in sorted(where) if where[p] == low]
      waiting = [p for p in sorted(where) if where[p] != low]
      finished = [p for p in range(store.count) if p not in where]
      lines.append("stuck: " + "; ".join(said[p] for p in behind) + ".")
      if waiting:
        lines.append("waiting for them: " + "; ".join(said[p] for p in waiting) + ".")
      if finished:
        lines.append(f"finished their part of the {op.what}: " + ", ".join(f"process {p}" for p in finished) + ".")
    lines.append(f"Every process of the job stops with status {names.EXIT_STEP_TIMEOUT}.")
    return "\n".join(lines)


def operations_of(manager: Any) -> Operations:
  """The `Operations` of `manager` (a `CheckpointManager`)."""
  try:
    return _BY_OWNER[manager]
  except (KeyError, TypeError):
    raise TypeError(f"not a tpustrat CheckpointManager: {type(manager).__name__}") from None


@contextlib.contextmanager
def bounded_operation(manager: Any, what: str) -> Iterator[Any]:
  """A bounded operation of `manager` (its timeout, its report) around work that is not the manager's own
  (the preemption handler's save, through its `save_fn`). The body gets an object with ``progress(phase)``
  (what this process is doing, for the report) and ``finished()`` (this process's part is done)."""
  ops = operations_of(manager)
  with ops.operation(what) as op:
    ops.progress(op, f"in the {what}")
    yield types.SimpleNamespace(finished=lambda: ops.mark_done(op.done_key, "done"),
                                progress=lambda phase: ops.progress(op, phase))
