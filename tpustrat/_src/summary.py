"""TensorBoard scalars from a custom loop: TF's ``tf.summary`` (file writers, a default writer and step per
thread, `scalar`, `record_if`), written through tensorboardX, by process 0 only.

TF's training loops (Model Garden's ``run_customized_training_loop``, orbit) write their losses, metrics and
learning rate as ``tf.summary.scalar(name, value, step=step)`` inside ``writer.as_default()``, from the chief
only. This module has the same names and the same rules (a thread's default writer and step, ``record_if``,
a no-op writer, ``flush``), with TensorFlow never imported: the event files are written with tensorboardX
(``pip install 'tpustrat[tensorboard]'``), and TensorBoard reads them (``tensorboard --logdir <logdir>``).

Where it differs from TF, and why:

* **Host values only.** TF writes a summary from inside a ``tf.function`` (the step); here a step is one
  compiled XLA program with no writer in it, so `scalar` takes host values (Python and numpy numbers, 0-d
  arrays, a `Mirrored`) and refuses to be called while `strategy.run` (or ``jax.jit``) traces: return the
  value from the step and write it after ``run`` returns. A `PerReplica` value is refused too: reduce it
  first (`strategy.reduce`), as TF's host code does with ``experimental_local_results``.
* **Process 0 writes.** `create_file_writer` opens an event file on process 0 only (TF's chief; Model
  Garden gives the other workers a no-op writer). On every other process it returns a writer that checks
  everything the same way (so a mistake raises on every process, not only on process 0) and writes
  nothing: `scalar` returns False there. `should_record_summaries` is the same on every process, so a
  collective computing a summary's value (a `strategy.reduce`) runs on all of them.
* **Writes are synchronous.** Each event goes to the file as `scalar` is called, and ``flush`` puts every
  event written so far on disk. tensorboardX's own ``SummaryWriter`` queues events for a thread and its
  ``flush`` does not wait for that queue (events written just before a flush were missing from the file
  after it, 20 times out of 20 with tensorboardX 2.6.5), so this module writes with tensorboardX's
  ``RecordWriter`` (TFRecord framing) and its ``Event`` protocol buffer instead. TF's ``max_queue`` and
  ``flush_millis`` keep their meaning, checked when an event is written (TF also flushes on a timer).
* **Tags are the names given**, as in TF (tensorboardX's ``add_scalar`` would replace characters outside
  ``[-/\\w.]``); there are no name scopes, so a tag is never prefixed.
* Values are written as float32 (TF casts a scalar summary to float32 too; TensorBoard's ``simple_value``
  is float32), so a float32 value reads back exactly.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpustrat._src import context as context_lib
from tpustrat._src.validation import check_int
from tpustrat._src.values import Mirrored, PerReplica

__all__ = ["EventFile", "SummaryWriter", "create_file_writer", "create_noop_writer", "flush",
           "import_tensorboardx", "record_if", "scalar", "should_record_summaries"]

# TF's defaults for `create_file_writer`.
_MAX_QUEUE = 10
_FLUSH_MILLIS = 120_000
_FILENAME_SUFFIX = ".v2"

_FILE_IDS = itertools.count()  # this process's event files: two opened in one second differ (TF's uid)


def import_tensorboardx(user: str) -> types.SimpleNamespace:
  """tensorboardX's pieces this module writes with, or an ImportError naming `user` and the extra.

  Args:
    user: what needs tensorboardX, as the user knows it (``"tpustrat.summary.create_file_writer"``,
      ``"tpustrat.keras.TensorBoard"``).
  """
  try:
    # pylint: disable=import-outside-toplevel
    from tensorboardX import record_writer  # type: ignore[import-untyped]
    from tensorboardX.proto import event_pb2, summary_pb2  # type: ignore[import-untyped]
  except ImportError as e:
    raise ImportError(f"{user} writes TensorBoard's event files with tensorboardX: "
                      "pip install 'tpustrat[tensorboard]' (or pip install tensorboardX).") from e
  return types.SimpleNamespace(record_writer=record_writer, Event=event_pb2.Event,
                               Summary=summary_pb2.Summary, SummaryMetadata=summary_pb2.SummaryMetadata)


class EventFile:
  """One TensorBoard event file, written synchronously (the writer of `SummaryWriter` and of
  ``tpustrat.keras.TensorBoard``).

  The file is ``<logdir>/events.out.tfevents.<seconds>.<host>.<pid>.<n><suffix>``, TF's name (the process id
  and a count make files opened in the same second differ). It begins with the file-version event
  TensorBoard expects. Events are written as they come; the file is flushed once `max_queue` events are
  pending or `flush_secs` have passed since the last flush (checked at each write), on `flush`, on `close`
  and when the interpreter exits. A flush syncs the file to disk (tensorboardX's ``RecordWriter.flush``;
  TF's event writer syncs too): 3.6 ms on the 2-core test machine, so one `scalar` a step with the default
  ``max_queue`` of 10 costs about 0.4 ms a step there.

  Args:
    logdir: the folder (created if missing; tensorboardX's ``s3://`` and ``gs://`` writers where installed).
    user: who writes, for the ImportError when tensorboardX is missing.
    max_queue: pending events that trigger a flush.
    flush_secs: seconds between flushes while events are written.
    filename_suffix: the end of the file's name.
  """

  def __init__(self, logdir: str, *, user: str, max_queue: int = _MAX_QUEUE,
               flush_secs: float = _FLUSH_MILLIS / 1000, filename_suffix: str = _FILENAME_SUFFIX) -> None:
    tbx = import_tensorboardx(user)
    self._event, self._summary, self._metadata = tbx.Event, tbx.Summary, tbx.SummaryMetadata
    self.logdir = logdir
    tbx.record_writer.directory_check(logdir)
    name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
            f"{next(_FILE_IDS)}{filename_suffix}")
    self.path = os.path.join(logdir, name)
    self._file = tbx.record_writer.RecordWriter(self.path)
    self._finalizer = weakref.finalize(self, self._file.close)  # flushed and closed at exit if still open
    self._lock = threading.Lock()
    self._max_queue, self._flush_secs = max_queue, flush_secs
    self._pending, self._last_flush = 0, time.monotonic()
    self._add(self._event(wall_time=time.time(), file_version="brain.Event:2"))

  def _add(self, event: Any) -> None:
    with self._lock:
      if not self._finalizer.alive:
        raise RuntimeError(f"tpustrat.summary: the event file {self.path} is closed.")
      self._file.write(event.SerializeToString())
      self._pending += 1
      if self._pending >= self._max_queue or time.monotonic() - self._last_flush >= self._flush_secs:
        self._flush_locked()

  def _flush_locked(self) -> None:
    self._file.flush()
    self._pending, self._last_flush = 0, time.monotonic()

  def add_scalar(self, tag: str, value: float, step: int, description: str | None = None) -> None:
    """Writes one scalar event: `value` as float32 (``simple_value``) under `tag` at `step`."""
    metadata = self._metadata(summary_description=description) if description else None
    summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value, metadata=metadata)])
    self._add(self._event(wall_time=time.time(), step=step, summary=summary))

  def flush(self) -> None:
    """Puts every event written so far on disk (a no-op once closed)."""
    with self._lock:
      if self._finalizer.alive:
        self._flush_locked()

  def close(self) -> None:
    """Flushes and closes the file; writing to it afterwards raises RuntimeError. Closing twice is fine."""
    with self._lock:
      self._finalizer()


# -- TF's tf.summary ---------------------------------------------------------------------------------------


class _State(threading.local):
  """TF's ``_summary_state``: the default writer, the default step and the recording condition of a thread."""

  def __init__(self) -> None:
    self.writer: SummaryWriter | None = None
    self.step: int | None = None
    self.recording: Any = True


_STATE = _State()


class SummaryWriter:
  """TF's ``tf.summary.SummaryWriter``: where `scalar` writes while it is the default writer.

  Made by `create_file_writer` (an event file in its `logdir` on process 0; elsewhere a writer that checks
  and writes nothing) or `create_noop_writer`; not constructed directly.
  """

  def __init__(self, logdir: str | None, events: EventFile | None) -> None:
    self._logdir = logdir
    self._events = events
    self._closed = False

  @property
  def logdir(self) -> str | None:
    """The folder of the event files (None for a no-op writer)."""
    return self._logdir

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise RuntimeError(f"tpustrat.summary: {what} on {self!r}, which is closed (as TF: a closed writer is "
                         "not used again; create a new one with tpustrat.summary.create_file_writer).")

  def set_as_default(self, step: Any = None) -> None:
    """Makes this the default writer of this thread (and `step`, if given, the default step), for good.

    Raises:
      RuntimeError: the writer is closed.
      TypeError: `step` is not an integer (a Python int, a numpy integer or a 0-d integer array).
    """
    self._check_open("set_as_default")
    checked = None if step is None else _host_step(step, "SummaryWriter.set_as_default")
    _STATE.writer = self
    if checked is not None:
      _STATE.step = checked

  def as_default(self, step: Any = None) -> contextlib.AbstractContextManager[SummaryWriter]:
    """Makes this the default writer of this thread inside the ``with`` block, as TF's.

    If `step` is given it is the default step of `scalar` inside the block (the one before comes back at
    its end); if not, the default step is left as it is. The writer is flushed at the end of the block.
    Blocks nest: the inner writer and step hold inside the inner block.

    Raises:
      RuntimeError: the writer is closed (raised by the call, as TF's, not at the ``with``).
      TypeError: `step` is not an integer (a Python int, a numpy integer or a 0-d integer array).
    """
    self._check_open("as_default")
    return self._default(None if step is None else _host_step(step, "SummaryWriter.as_default"))

  @contextlib.contextmanager
  def _default(self, checked: int | None) -> Iterator[SummaryWriter]:
    writer, default_step = _STATE.writer, _STATE.step
    _STATE.writer = self
    if checked is not None:
      _STATE.step = checked
    try:
      yield self
    finally:
      self.flush()
      _STATE.writer = writer
      if checked is not None:
        _STATE.step = default_step

  def flush(self) -> None:
    """Puts every summary this writer has written on disk (nothing to do on processes other than 0)."""
    if self._events is not None and not self._closed:
      self._events.flush()

  def close(self) -> None:
    """Flushes and closes the writer; it cannot be used again. Closing twice is fine."""
    if self._events is not None and not self._closed:
      self._events.close()
    self._closed = True

  def _write(self, tag: str, value: Any, step: int, description: str | None) -> bool:
    self._check_open("a write")
    if self._events is None:
      return False
    self._events.add_scalar(tag, float(np.float32(np.asarray(value))), step, description)
    return True

  def __repr__(self) -> str:
    where = "writes nothing on this process" if self._events is None else "writes here"
    return f"SummaryWriter(logdir={self._logdir!r}, {where})"


class _NoopSummaryWriter(SummaryWriter):
  """TF's ``create_noop_writer()``: as TF's, ``as_default`` and ``set_as_default`` change nothing (the writer
  before stays the default one), so `scalar` inside them writes where it would have written outside."""

  def set_as_default(self, step: Any = None) -> None:
    if step is not None:
      _host_step(step, "SummaryWriter.set_as_default")

  def as_default(self, step: Any = None) -> contextlib.AbstractContextManager[SummaryWriter]:
    if step is not None:
      _host_step(step, "SummaryWriter.as_default")
    return contextlib.nullcontext(self)

  def __repr__(self) -> str:
    return "SummaryWriter(no-op)"


def create_file_writer(logdir: str | os.PathLike[str], max_queue: int | None = None,
                       flush_millis: int | None = None, filename_suffix: str | None = None) -> SummaryWriter:
  """TF's ``tf.summary.create_file_writer``: a writer of TensorBoard event files into `logdir`.

  On process 0 it opens an event file in `logdir` (TF's chief writes); on every other process it returns a
  writer that writes nothing (Model Garden gives the other workers a no-op writer) but checks every call
  as process 0's does. tensorboardX must be installed on every process, so that a missing one fails
  everywhere.

  Args:
    logdir: the folder of the event files (created if missing).
    max_queue: events written before the file is flushed (TF's default, 10).
    flush_millis: the longest time between flushes while events are written, in milliseconds (TF's
      default, 120000; checked at each write: no timer thread).
    filename_suffix: the end of the event file's name (TF's default, ``.v2``).

  Raises:
    ImportError: tensorboardX is not installed (``pip install 'tpustrat[tensorboard]'``).
    TypeError, ValueError: an argument is of the wrong type or out of range.
  """
  where = "tpustrat.summary.create_file_writer"
  if not isinstance(logdir, (str, os.PathLike)) or not os.fspath(logdir):
    raise (ValueError if logdir == "" else TypeError)(
        f"{where}: `logdir` must be a non-empty path (str or os.PathLike), got {type(logdir).__name__} "
        f"{logdir!r:.60}.")
  queue = check_int(max_queue, where, "max_queue", minimum=1, allow_none=True)
  millis = check_int(flush_millis, where, "flush_millis", minimum=1, allow_none=True)
  if filename_suffix is not None and not isinstance(filename_suffix, str):
    raise TypeError(f"{where}: `filename_suffix` must be a str or None, got {type(filename_suffix).__name__} "
                    f"{filename_suffix!r:.60}.")
  path = os.fspath(logdir)
  import_tensorboardx(where)  # on every process: a missing tensorboardX fails the same way everywhere
  if jax.process_index() != 0:
    return SummaryWriter(path, None)
  events = EventFile(path, user=where, max_queue=_MAX_QUEUE if queue is None else queue,
                     flush_secs=(_FLUSH_MILLIS if millis is None else millis) / 1000,
                     filename_suffix=_FILENAME_SUFFIX if filename_suffix is None else filename_suffix)
  return SummaryWriter(path, events)


def create_noop_writer() -> SummaryWriter:
  """TF's ``tf.summary.create_noop_writer``: a writer that writes nothing; its ``as_default`` leaves the
  default writer as it is (TF's rule), so `scalar` inside it returns False when no other writer is the
  default."""
  return _NoopSummaryWriter(None, None)


@contextlib.contextmanager
def record_if(condition: bool | Callable[[], Any]) -> Iterator[None]:
  """TF's ``tf.summary.record_if``: inside the block `scalar` writes only while `condition` holds.

  Args:
    condition: a bool (a numpy bool or a 0-d bool array too), or a function of no arguments returning one,
      called at each `scalar` (e.g. ``lambda: step % 100 == 0``). Blocks nest; the inner condition holds
      inside the inner block, as in TF.

  Raises:
    TypeError: `condition` (or what the function returns, at `scalar`) is not a bool.
  """
  if not callable(condition):
    _host_bool(condition, "condition")
  recording = _STATE.recording
  _STATE.recording = condition
  try:
    yield
  finally:
    _STATE.recording = recording


def _recording() -> bool:
  condition = _STATE.recording
  if callable(condition):
    return _host_bool(condition(), "condition()")
  return _host_bool(condition, "condition")


def should_record_summaries() -> bool:
  """TF's ``tf.summary.should_record_summaries``: whether a writer is the default and `record_if`'s condition
  holds. The same on every process (process 0 is the one that writes), so that the values of summaries,
  collectives included, are computed on all of them or on none."""
  return _STATE.writer is not None and _recording()


def flush(writer: SummaryWriter | None = None) -> None:
  """TF's ``tf.summary.flush``: flushes `writer`, else the default writer, if there is one."""
  if writer is not None and not isinstance(writer, SummaryWriter):
    raise TypeError(f"tpustrat.summary.flush: `writer` must be a tpustrat.summary.SummaryWriter or None, got "
                    f"{type(writer).__name__} {writer!r:.60}.")
  writer = writer if writer is not None else _STATE.writer
  if writer is not None:
    writer.flush()


def scalar(name: str, data: Any, step: Any = None, description: str | None = None) -> bool:
  """TF's ``tf.summary.scalar``: writes `data` under the tag `name` at `step` into the default writer.

  Unlike TF, it is called on the host, never inside the step: ``strategy.run`` compiles the step into one
  XLA program, and there is no writer in it. Return the value from the step (reduced to one number) and
  write it after ``run`` returns; a call while `strategy.run` (or ``jax.jit``) traces raises.

  Args:
    name: the tag (TensorBoard's series), as given.
    data: one real number on the host: a Python or numpy number, a 0-d numpy or jax array (read from the
      device here), or a `Mirrored` of one; written as float32, as TF does. A `PerReplica` is refused:
      reduce it first (``strategy.reduce("MEAN", v, axis=None)``).
    step: the step (an integer: a Python int, a numpy integer, a 0-d integer array or a `Mirrored` of one);
      by default, the one given to the default writer's ``as_default(step=...)``.
    description: a description TensorBoard shows with the series.

  Returns:
    True if it wrote; False when no writer is the default, when `record_if`'s condition does not hold, and
    on processes other than 0 (which never write).

  Raises:
    RuntimeError: called while a step is traced (inside ``strategy.run``, ``experimental_run_steps`` or
      ``jax.jit``), or the default writer is closed.
    TypeError: `data` is a `PerReplica`, not a real number, or `step` not an integer.
    ValueError: `data` is not a scalar (shape ``()``), or no step is given and none is the default.

  >>> scalar("loss", 0.5, step=1)  # no default writer: nothing written
  False
  """
  if not isinstance(name, str) or not name:
    raise TypeError(f"tpustrat.summary.scalar: `name` must be a non-empty str, got {type(name).__name__} "
                    f"{name!r:.60}.")
  where = f"tpustrat.summary.scalar({name!r})"
  if context_lib.in_replica_context_of_a_run():
    raise _traced(where)
  value = _host_value(data, where, "data")
  if not jnp.issubdtype(value.dtype, jnp.floating) and not jnp.issubdtype(value.dtype, jnp.integer) and (
      value.dtype != np.bool_):
    raise TypeError(f"{where}: `data` must be a real number, got dtype {value.dtype} ({_describe(data)}).")
  if value.shape != ():
    raise ValueError(f"{where}: `data` must be a scalar (shape ()), as for tf.summary.scalar, got shape "
                     f"{tuple(value.shape)}; write one element (x[0]) or a reduction of it (x.mean()).")
  if description is not None and not isinstance(description, str):
    raise TypeError(f"{where}: `description` must be a str or None, got {type(description).__name__}.")
  checked = None if step is None else _host_step(step, where)
  writer = _STATE.writer
  if writer is None or not _recording():
    return False
  if checked is None:
    if _STATE.step is None:
      raise ValueError(f"{where}: no step: pass step= to tpustrat.summary.scalar, or to the writer's "
                       "as_default(step=...) or set_as_default(step=...).")
    checked = _STATE.step
  return writer._write(name, value.array, checked, description)  # pylint: disable=protected-access


# -- host values -------------------------------------------------------------------------------------------


class _HostValue:
  """A value `scalar` may write, not yet read from its device: the array, its shape and its dtype."""

  __slots__ = ("array", "dtype", "shape")

  def __init__(self, array: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
    self.array, self.shape, self.dtype = array, shape, dtype


def _describe(value: Any) -> str:
  return f"{type(value).__name__} {value!r:.60}"


def _traced(where: str) -> RuntimeError:
  return RuntimeError(
      f"{where}: called while a step is traced (inside strategy.run, experimental_run_steps or jax.jit). "
      "TF writes summaries from inside a tf.function; here the step is one compiled XLA program with no "
      "writer in it, so summaries are written on the host: return the value from the step and call "
      "tpustrat.summary.scalar after run returns (a PerReplica one reduced with strategy.reduce first).")


def _host_value(value: Any, where: str, what: str) -> _HostValue:
  """`value` (a summary's data or step, `record_if`'s condition) as one host value, or the error that says
  why it is not one."""
  if isinstance(value, jax.core.Tracer):
    raise _traced(where)
  if isinstance(value, PerReplica):
    raise TypeError(
        f"{where}: `{what}` is a PerReplica value (one component per replica), not one host value: combine "
        "the components first, e.g. strategy.reduce('MEAN', value, axis=None) (or 'SUM'), and write "
        "what it returns.")
  source = value
  if isinstance(value, Mirrored):
    leaves = jax.tree.leaves(value.tree)
    if len(leaves) != 1 or jax.tree.structure(value.tree).num_nodes != 1:
      raise TypeError(f"{where}: `{what}` is a Mirrored pytree ({jax.tree.structure(value.tree)}); expected "
                      "a Mirrored of one number.")
    value = value.values[0]  # this process's first copy: a local read, in a job of several processes too
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is None or dtype is None:  # Python numbers (and what numpy makes of anything else)
    value = np.asarray(value)
    shape, dtype = value.shape, value.dtype
  try:
    dtype = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"{where}: `{what}` has dtype {dtype!r}, not a number's ({_describe(source)}).") from e
  return _HostValue(value, tuple(shape), dtype)


def _host_step(step: Any, where: str) -> int:
  """`step` as a Python int, or an error naming it: a summary's step is an integer, as TF's int64."""
  value = _host_value(step, where, "step")
  if isinstance(step, bool) or value.dtype == np.bool_ or not jnp.issubdtype(value.dtype, jnp.integer) or (
      value.shape != ()):
    raise TypeError(f"{where}: `step` must be an integer (a Python int, a numpy integer, a 0-d integer "
                    f"array or a Mirrored of one), got {_describe(step)}.")
  return int(np.asarray(value.array))


def _host_bool(condition: Any, what: str) -> bool:
  """`condition` as a Python bool, or an error naming it (`what`): TF's ``record_if`` takes a boolean."""
  where = "tpustrat.summary.record_if"
  value = _host_value(condition, where, what)
  if value.dtype != np.bool_ or value.shape != ():
    raise TypeError(f"{where}: `{what}` must be a bool (or a 0-d bool array), or `condition` a function "
                    f"returning one; got {_describe(condition)}.")
  return bool(np.asarray(value.array))
