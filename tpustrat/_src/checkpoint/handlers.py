"""The items of a checkpoint and their orbax handlers: the state, the iterator's position, the checksums.

orbax finds an item's handler by the exact class of its save and restore arguments, so each handler has
its own argument classes. The state's handler is orbax's `StandardCheckpointHandler`, which also tells a
`SaveTracker` when this process's writes of the item are done (its commit futures have completed); the
other two are small JSON handlers of tpustrat's. orbax is imported on first use (`api`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
import types
from collections.abc import Callable
from typing import Any

import jax

from tpustrat._src.checkpoint import event_loops

__all__ = ["CHECKSUMS", "ITERATOR", "STATE", "STEP_METADATA", "CheckpointSaveError", "DamagedCheckpointError",
           "DamagedCheckpointWarning", "NotRestorableHere", "SaveTracker", "api", "read_json"]

STATE, ITERATOR, CHECKSUMS = "state", "iterator", "checksums"
CHECKSUM_FILE = "checksums.json"
# orbax's metadata file of a committed step (JSON): its "item_handlers" name every item the save wrote.
STEP_METADATA = "_CHECKPOINT_METADATA"


class CheckpointSaveError(RuntimeError):
  """A save could not be written (the storage refused a write: disk full, read-only file system, an I/O
  error). The message names the step, its directory and the error (the cause); the previous checkpoints
  are intact. Raised in a one-process job; a multi-process job stops with status 74 instead
  (`tpustrat._src.names.EXIT_CHECKPOINT_FAILED`), since the other processes wait for this one inside
  orbax, where no exception reaches them, or with status 69 (`names.EXIT_CHECKPOINT_PEER_LOST`) when the
  save failed because another process stopped in the middle of it.
  """


class DamagedCheckpointError(ValueError):
  """A checkpoint step cannot be restored because its files were changed or lost after it was saved.

  The message names the step, its directory and what is wrong (on which process, in a multi-process
  job).
  """


class DamagedCheckpointWarning(UserWarning):
  """`CheckpointManager.restore()` found the newest step damaged and falls back to an older one."""


class NotRestorableHere(ValueError):
  """The checkpoint is intact but cannot be restored by this job (a user error, not damage)."""


def read_json(path: Any) -> Any:
  """The JSON value of the file at `path`; a ValueError naming the file when it does not decode."""
  text = path.read_text()
  try:
    return json.loads(text)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON ({type(e).__name__}: {e})") from None


@functools.cache
def api() -> types.SimpleNamespace:
  """orbax, and the handlers of the items (defined once, on first use). orbax's event loops then finish
  the tasks left on them before they are closed (`event_loops`)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  event_loops.install()

  class _Plain(ocp.CheckpointHandler):
    """A handler with no metadata, finalize step or resources of its own."""

    def metadata(self, directory: Any) -> None:
      del directory

    def finalize(self, directory: Any) -> None:
      del directory

    def close(self) -> None:
      pass

  class IteratorHandler(_Plain):
    """Saves an iterator state (a JSON-serialisable value) as ``process_<i>-of-<n>.json``, one per process.

    grain's own handler does the same but needs a grain iterator. Restoring onto another number of
    processes works when every process saved the same state (a dataset distributed with
    `experimental_distribute_dataset`: every process reads the same global batches).
    """

    def __init__(self) -> None:
      self.tracker: SaveTracker | None = None  # set by the manager before each save

    def save(self, directory: Any, args: Any = None) -> None:
      tracker = self.tracker
      name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
      (directory / name).write_text(json.dumps(args.state))
      if tracker is not None:
        tracker.done(ITERATOR)

    def restore(self, directory: Any, args: Any = None) -> Any:
      del args
      count = jax.process_count()
      mine = directory / f"process_{jax.process_index()}-of-{count}.json"
      if mine.exists():
        return read_json(mine)
      files = sorted(directory.glob("process_*-of-*.json"), key=lambda f: f.name)
      if not files:
        raise FileNotFoundError(f"No iterator state in {directory}.")
      if any(f.name.endswith(f"-of-{count}.json") for f in files):  # saved by as many processes: one is lost
        raise FileNotFoundError(f"The iterator state of this process ({mine.name}) is missing from {directory}.")
      states = [read_json(f) for f in files]
      if any(s != states[0] for s in states[1:]):
        raise NotRestorableHere(
            f"The checkpoint in {directory.parent} holds a different iterator state for each of its "
            f"{len(files)} processes (per-process input pipelines, from "
            "experimental_distribute_datasets_from_function), so it can only be restored by as many "
            f"processes, not by {count}.")
      return states[0]


  class ChecksumHandler(_Plain):
    """Saves the fingerprints of the state's arrays as ``checksums.json`` (process 0 writes it; every
    process computed the same values)."""

    def __init__(self) -> None:
      self.tracker: SaveTracker | None = None

    def save(self, directory: Any, args: Any = None) -> None:
      tracker = self.tracker
      if jax.process_index() == 0:
        (directory / CHECKSUM_FILE).write_text(json.dumps(args.checksums, sort_keys=True))
      if tracker is not None:
        tracker.done(CHECKSUMS)

    def restore(self, directory: Any, args: Any = None) -> Any:
      del args
      path = directory / CHECKSUM_FILE
      if not path.exists():
        raise FileNotFoundError(f"The checksums of the state ({path}) are missing.")
      return read_json(path)


  class StateHandler(ocp.StandardCheckpointHandler):
    """orbax's `StandardCheckpointHandler`, telling the manager when this process's writes are done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
      super().__init__(*args, **kwargs)
      self.tracker: SaveTracker | None = None

    async def async_save(self, directory: Any, *args: Any, **kwargs: Any) -> Any:
      tracker = self.tracker
      futures = await super().async_save(directory, *args, **kwargs)
      if tracker is None:
        return futures
      if not futures:
        tracker.done(STATE)
        return futures
      countdown = _Countdown(len(futures), lambda: tracker.done(STATE))
      return [_CountedFuture(f, countdown, tracker) for f in futures]

  @ocp.args.register_with_handler(StateHandler, for_save=True)
  class StateSave(ocp.args.StandardSave):
    """`StandardSave` for `StateHandler` (orbax finds an item's handler by the exact class of its args)."""

  @ocp.args.register_with_handler(StateHandler, for_restore=True)
  class StateRestore(ocp.args.StandardRestore):
    """`StandardRestore` for `StateHandler`."""

  @ocp.args.register_with_handler(IteratorHandler, for_save=True)
  @dataclasses.dataclass
  class IteratorSave(ocp.args.CheckpointArgs):
    state: Any

  @ocp.args.register_with_handler(IteratorHandler, for_restore=True)
  @dataclasses.dataclass
  class IteratorRestore(ocp.args.CheckpointArgs):
    pass

  @ocp.args.register_with_handler(ChecksumHandler, for_save=True)
  @dataclasses.dataclass
  class ChecksumSave(ocp.args.CheckpointArgs):
    checksums: Any

  @ocp.args.register_with_handler(ChecksumHandler, for_restore=True)
  @dataclasses.dataclass
  class ChecksumRestore(ocp.args.CheckpointArgs):
    pass

  return types.SimpleNamespace(ocp=ocp, IteratorHandler=IteratorHandler, IteratorSave=IteratorSave,
                               IteratorRestore=IteratorRestore, ChecksumHandler=ChecksumHandler,
                               ChecksumSave=ChecksumSave, ChecksumRestore=ChecksumRestore,
                               StateHandler=StateHandler, StateSave=StateSave, StateRestore=StateRestore)


class _Countdown:
  """Calls `fn` once, when `count` calls of `tick` have been made (from any threads)."""

  def __init__(self, count: int, fn: Callable[[], None]) -> None:
    self._left, self._fn, self._lock = count, fn, threading.Lock()

  def tick(self) -> None:
    with self._lock:
      self._left -= 1
      last = self._left == 0
    if last:
      self._fn()


class _CountedFuture:
  """One of orbax's commit futures of the state item; ticks its countdown once it has completed, and tells
  the tracker when it failed (a write the storage refused, in orbax's background thread)."""

  def __init__(self, inner: Any, countdown: _Countdown, tracker: SaveTracker) -> None:
    self._inner, self._countdown, self._tracker, self._ticked = inner, countdown, tracker, False

  def result(self, timeout: float | None = None) -> Any:
    try:
      out = self._inner.result(timeout=timeout)
    except TimeoutError:
      raise
    except Exception as e:
      self._tracker.failed(STATE, e)
      raise
    if not self._ticked:
      self._ticked = True
      self._countdown.tick()
    return out

  def __getattr__(self, name: str) -> Any:
    return getattr(self._inner, name)


class SaveTracker:
  """The items of one save that this process has still to write; `on_written` runs when none is left,
  `on_failed(item, error)` when the write of an item failed in a background thread."""

  def __init__(self, items: set[str], on_written: Callable[[], None],
               on_failed: Callable[[str, BaseException], None] | None = None) -> None:
    self._pending, self._on_written, self._lock = set(items), on_written, threading.Lock()
    self._on_failed = on_failed

  def failed(self, item: str, error: BaseException) -> None:
    if self._on_failed is not None:
      self._on_failed(item, error)

  def done(self, item: str) -> None:
    with self._lock:
      if item not in self._pending:
        return
      self._pending.discard(item)
      last = not self._pending
    if last:
      self._on_written()

