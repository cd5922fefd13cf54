"""The items of a checkpoint and their orbax handlers: the state, the iterator's position, the checksums.

orbax finds an item's handler by the exact class of its save and restore arguments, so each handler has
its own argument classes. The state's handler is orbax's `StandardCheckpointHandler`, which also tells a
`SaveTracker` when this process's writes of the item are done (its commit futures have completed), and
writes each replicated shard from one device (`_SingleReplicaArrays`); the other two are small JSON
handlers of tpustrat's. orbax is imported on first use (`api`).

The one use of orbax's private API is `_single_replica`: it checks what it relies on and raises
`RuntimeError` naming the orbax version where that changed.
"""

from __future__ import annotations

import copy
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
    """orbax's `StandardCheckpointHandler`, telling the manager when this process's writes are done, with
    its jax.Array handler writing each replicated shard from one device (`_SingleReplicaArrays`)."""

    def __init__(self) -> None:
      super().__init__()
      _single_replica(ocp, self)
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


class _SingleReplicaArrays:
  """orbax's global type handler registry (`ocp.type_handlers.TypeHandlerRegistry`: ``add``, ``get``,
  ``has``), except that its `ArrayHandler` is a copy with replica-parallel saving off.

  Replica-parallel saving (orbax's default off GPUs) has each of the R replicas of a shard write 1/R of it:
  every device slices its copy with a program of its own, compiled per (shard shape, device), 97
  compilations and 7.9 s at the first save of the char transformer's `Mirrored` state on 8 CPU devices.
  Without it the device holding replica 0 of each shard writes the whole shard (orbax's ``replica_id=0``
  rule: in a multi-process job exactly one process writes each shard, the one holding replica 0), and a
  save runs no program at all. The bytes copied to the host are the same in a one-process job; in a
  multi-process job a replicated value is written by one process instead of split among them.
  Registrations made later in the global registry are seen (it is read at every lookup).
  """

  def __init__(self, ocp: Any) -> None:
    self._ocp = ocp
    self._source: Any = None
    self._copy: Any = None

  def _swap(self, handler: Any) -> Any:
    if not isinstance(handler, self._ocp.type_handlers.ArrayHandler):
      return handler  # a handler of the user's own class for jax.Array: used as it is
    if handler is not self._source:
      mine = copy.copy(handler)
      _set_replica_parallel_off(self._ocp, mine)
      self._source, self._copy = handler, mine
    return self._copy

  def add(self, *args: Any, **kwargs: Any) -> None:
    self._ocp.type_handlers.register_type_handler(*args, **kwargs)

  def get(self, ty: Any) -> Any:
    return self._swap(self._ocp.type_handlers.get_type_handler(ty))

  def has(self, ty: Any) -> bool:
    return self._ocp.type_handlers.has_type_handler(ty)


def _set_replica_parallel_off(ocp: Any, handler: Any) -> None:
  """Turns replica-parallel saving off in `handler` (a copy of an orbax `ArrayHandler`): orbax has the
  option only as a constructor argument, stored in a private attribute."""
  if not isinstance(getattr(handler, "_use_replica_parallel", None), bool):
    raise RuntimeError(
        f"tpustrat: orbax-checkpoint {ocp.__version__}'s ArrayHandler has no boolean `_use_replica_parallel` "
        "(tpustrat turns replica-parallel saving off there: tpustrat/_src/checkpoint/handlers.py); this "
        "orbax version changed it. Install the orbax-checkpoint version tpustrat's requirements name.")
  handler._use_replica_parallel = False  # pylint: disable=protected-access


def _single_replica(ocp: Any, handler: Any) -> None:
  """Makes `handler` (a `StandardCheckpointHandler`, just built with the default arguments) save through
  `_SingleReplicaArrays`. `StandardCheckpointHandler` takes no type handler registry; the
  `PyTreeCheckpointHandler` it delegates to (``_impl``) does, so that one is rebuilt with it (and
  `StandardCheckpointHandler`'s defaults)."""
  impl: Any = getattr(handler, "_impl", None)
  if type(impl) is not ocp.PyTreeCheckpointHandler:  # pylint: disable=unidiomatic-typecheck
    raise RuntimeError(
        f"tpustrat: orbax-checkpoint {ocp.__version__}'s StandardCheckpointHandler no longer delegates to a "
        f"PyTreeCheckpointHandler in `_impl` (found {type(impl).__name__}); tpustrat gives that handler its "
        "type handler registry (tpustrat/_src/checkpoint/handlers.py). Install the orbax-checkpoint version "
        "tpustrat's requirements name.")
  impl.close()
  handler._impl = ocp.PyTreeCheckpointHandler(  # pylint: disable=protected-access
      save_concurrent_gb=96, restore_concurrent_gb=96, use_ocdbt=True, type_handler_registry=_SingleReplicaArrays(ocp))


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

