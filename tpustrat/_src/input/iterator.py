"""The iterator over a distributed dataset, and its position in the data.

`DistributedIterator` hands out one batch per `next` (or ``k`` stacked batches per `take_steps(k)`, in
the layout of `tpustrat._src.steps`), taking elements from its dataset's producer, in a `Prefetcher`
thread by default. `get_state` / `set_state` save and restore the position after the batches handed
out: a small JSON-serialisable dict (``{"format": "tpustrat.DistributedIterator/1", "batches": ...,
"elements": ..., "source": ..., "source_encoding": ...}``) that `tpustrat.checkpoint` stores.

`ProduceState` is what the producer keeps between elements; it is shared by the iterator and the
producer, which holds no reference to the iterator (so dropping the iterator stops its thread).
"""

from __future__ import annotations

import collections
import collections.abc
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from tpustrat._src import profiler
from tpustrat._src import steps as steps_lib
from tpustrat._src.input.encoding import bytes_to_text, text_to_bytes
from tpustrat._src.input.prefetch import ERROR, ITEM, Prefetcher
from tpustrat._src.jax_compat import staging
from tpustrat._src.validation import check_int

__all__ = ["DistributedIterator", "Feed", "Live", "ProduceState"]


class Feed(NamedTuple):
  """What a `DistributedIterator` needs of its dataset, which makes it (`DistributedDataset.__iter__`)."""

  produce: Callable[[Iterator[Any], ProduceState], tuple[Any, int | None]]  # the next chunk (prefetch thread)
  spec_known: Callable[[], bool]  # whether the dataset's element_spec is known without reading a batch
  one_shot: bool  # the source is a one-shot iterator (a generator): one open iterator at a time
  opened: Callable[[Live], None]  # a one-shot source's new iterator is the open one
  # For set_state: the source positioned after `elements` raw elements (`source`: its saved state, or
  # None); on a one-shot source the iterator becomes the open one (RuntimeError if another is open).
  reopen: Callable[[Live, int, Any], Iterator[Any]]
  # Elements a prefetch thread keeps ready (the options' buffer size, or the platform's default); 0: no
  # thread, each element is produced when it is asked for. Unused without fetch_to_device (no thread).
  buffer_size: int
  # The strategy's `step_stats.StepCounters`: the time `next` / `take_steps` wait for a batch is added.
  stats: Any = None


class Live(NamedTuple):
  """What a one-shot dataset keeps of its open iterator."""

  iterator: DistributedIterator
  closed: Callable[[], bool]  # whether close() was called
  stop_prefetch: Callable[[str], None]  # stops the prefetch thread and waits for it (see `close`)


class DistributedIterator:
  """An iterator over a `DistributedDataset` (TF's distributed iterator).

  `next(it)` returns the next batch (a pytree of `PerReplica` values) and raises `StopIteration` at the
  end, every time it is called after that. `take_steps(k)` returns the next ``k`` batches at once,
  stacked for a multi-step program. With `InputOptions.experimental_fetch_to_device` (the default)
  batches are put on the devices; with a buffer size >= 1 (the default on GPU and TPU) by a background
  thread (started by the first request), at most `experimental_per_replica_buffer_size` elements ahead
  (the prefetch depth: their transfers are in flight while the current step runs; with `take_steps(k)`,
  an element is a group of ``k`` batches); with 0 (the default on XLA:CPU) in the caller's thread, when
  asked for. `close()` stops that thread early (it also stops when the iterator
  is garbage-collected).

  `get_state()` / `set_state(state)` save and restore the position in the data (as grain's iterators
  do; `tpustrat.checkpoint.CheckpointManager` stores it with the model): the position after the last
  batch *handed out*, whatever the prefetch thread has read ahead.
  """

  def __init__(self, dataset: Any, it: Iterator[Any], feed: Feed) -> None:
    self._dataset = dataset
    self._feed = feed
    self._done = False
    self._closed = False  # close() was called (a one-shot dataset may then open a new iterator)
    self._error: BaseException | None = None  # raised by the next call (met while filling a group)
    # Elements handed back or read ahead: (batch, None) for one step, (stacked, n) for n stacked steps.
    self._chunks: collections.deque[tuple[Any, int | None]] = collections.deque()
    self._state = ProduceState(it)  # shared with the producer: it holds no reference to the iterator
    self._handed = 0  # batches handed out so far
    # The source after the batches handed out (see _advance), and the drop_remainder reference then.
    self._position: tuple[int, Any, Any] = (0, None, None)
    self._produce = functools.partial(feed.produce, it, self._state)
    # The prefetch thread starts with the first request, once it is known whether the consumer takes one
    # batch or groups of k at a time (so that groups are stacked on the host from the start).
    self._prefetcher: Prefetcher | None = None
    if feed.one_shot:
      feed.opened(self._live())

  def _live(self) -> Live:
    return Live(self, lambda: self._closed, self._stop_prefetch)

  def __iter__(self) -> DistributedIterator:
    return self

  def _next_chunk(self) -> tuple[Any, int | None]:
    if self._chunks:
      return self._chunks.popleft()
    if self._error is not None:
      error, self._error = self._error, None
      raise error
    if self._done:
      raise StopIteration
    if not self._feed.buffer_size or not self._dataset.options.experimental_fetch_to_device:
      try:  # no thread: produced here, now
        return self._produce()
      except BaseException:
        self._done = True
        raise
    if self._prefetcher is None:
      self._prefetcher = Prefetcher(self._produce, self._feed.buffer_size)
    kind, value = self._prefetcher.get()
    if kind == ITEM:
      return value
    self._done = True
    self._prefetcher.close()
    if kind == ERROR:
      raise value
    raise StopIteration

  def _refuse_while_staging(self, what: str) -> None:
    """Reading a batch while JAX stages a program bakes that batch into it: every call would reuse it."""
    if staging():
      raise RuntimeError(
          f"DistributedIterator: {what} was called while JAX traces a program (inside jax.jit, a lax.scan body "
          "or the function given to strategy.run). The batch read now would become a constant of the compiled "
          "program, and every call of it would train on that same batch. TF's `@tf.function def "
          "train_step(iterator): strategy.run(step_fn, args=(next(iterator),))` reads the iterator on each "
          "call; in JAX read it outside the traced function and pass the batch in: `batch = next(iterator); "
          "train_step(batch)` with `@jax.jit def train_step(batch): return strategy.run(step_fn, "
          "args=(batch,))`, or run k steps per call with strategy.experimental_run_steps(step_fn, iterator, "
          "steps=k) (TF's `for _ in tf.range(k)` loop).")

  def __next__(self) -> Any:
    self._refuse_while_staging("next(iterator)")
    state = self._state
    state.grid = (1, 0)
    start = time.perf_counter()  # the wait is counted in the strategy's step statistics (`step_stats`)
    on_devices = state.device_seconds
    try:
      with profiler.input_wait():  # the host's wait for input, marked in a profile (`profiler.py`)
        batch, n = self._next_chunk()
    finally:
      if self._feed.stats is not None:  # transfers made while a step ran are device time
        self._feed.stats.note_input(start, state.device_seconds - on_devices)
    if n is not None:  # after take_steps: a group read ahead
      batch, *rest = steps_lib.unstack_steps(batch)
      self._chunks.extendleft((b, None) for b in reversed(rest))
    self._advance(1)
    return batch

  def _advance(self, n: int) -> None:
    """Counts `n` more batches handed out; the source position moves past them."""
    self._handed += n
    for _ in range(n):  # the producer recorded one position per batch, before handing it over
      self._position = self._state.positions.popleft()

  def get_next(self) -> Any:
    """Returns the next element, like `next(iterator)` (TF's `get_next`).

    Raises:
      RuntimeError: called while JAX traces a program (inside `jax.jit`, a `lax.scan` body, or the
        function given to `strategy.run`), where the batch would become a constant of the program and be
        reused by every call; the message shows the pattern that works (read outside, pass the batch in).
      StopIteration: no batch is left."""
    return next(self)

  def take_steps(self, k: int) -> Any:
    """The next `k` batches, stacked on a new leading steps axis, for a multi-step program.

    The result has the structure of one batch; every `PerReplica` array is ``[steps, num_replicas, ...]``,
    split over the replicas on its second axis, and padded batches keep their real-row counts per step
    (``[steps, num_replicas]``), so partial batches are counted exactly inside the program. A `lax.scan`
    over it gives the body one ordinary batch per step; `strategy.experimental_run_steps` calls this.
    With prefetching, the background thread stacks the next `k` batches on the host and transfers them
    at once, while earlier steps run.

    Near the end of the data the group holds fewer than `k` batches (a new shape: one more compilation
    of a scanned program). A batch with other shapes than the group's (a larger later batch; under the
    default strategy, the unpadded partial batch) ends the group early and starts the next one.

    >>> strategy = tpustrat.TPUStrategy()
    >>> batches = [np.ones(16, np.float32)] * 4 + [np.ones(4, np.float32)]
    >>> it = iter(strategy.experimental_distribute_dataset(batches))
    >>> it.take_steps(3)
    PerReplica(steps=3, num_replicas=8, component=float32[2], padded)
    >>> last = it.take_steps(3)   # the two batches left, the second one partial
    >>> [float(strategy.reduce("SUM", b, axis=0)) for b in tpustrat.unstack_steps(last)]
    [16.0, 4.0]

    Args:
      k: the number of batches (steps), an int >= 1.

    Returns:
      The stacked batches.

    Raises:
      StopIteration: if no batch is left.
      TypeError: if `k` is not an int.
      ValueError: if `k` < 1.
    """
    k = check_int(k, "take_steps", "k", minimum=1)
    self._refuse_while_staging("take_steps")
    self._state.grid = (k, self._handed)  # the producer stacks the next batches k at a time
    parts: list[tuple[Any, int | None]] = []
    have = 0
    state = self._state
    while have < k:
      start = time.perf_counter()
      on_devices = state.device_seconds
      try:
        with profiler.input_wait():
          chunk = self._next_chunk()
      except StopIteration:
        break
      except Exception as e:  # pylint: disable=broad-except
        if not parts:
          raise
        self._error = e  # hand out the steps read so far; raise on the next call
        break
      finally:
        if self._feed.stats is not None:  # transfers made while a step ran are device time
          self._feed.stats.note_input(start, state.device_seconds - on_devices)
      steps = 1 if chunk[1] is None else chunk[1]
      if parts and not _same_step(parts[0], chunk):
        self._chunks.appendleft(chunk)
        break
      if have + steps > k:  # read ahead with another group size: keep the rest for later
        first, rest = steps_lib.cut_chunk(chunk[0], k - have)
        self._chunks.appendleft((rest, steps - (k - have)))
        chunk, steps = (first, k - have), k - have
      parts.append(chunk)
      have += steps
    if not parts:
      raise StopIteration
    self._advance(have)
    if len(parts) == 1 and parts[0][1] is not None:
      return parts[0][0]
    return steps_lib.concat_chunks(parts, "take_steps")

  @property
  def element_spec(self) -> Any:
    """The type of the elements (see `DistributedDataset.element_spec`)."""
    if not self._feed.spec_known() and not self._done:
      try:
        position = self._position
        self._chunks.appendleft((next(self), None))
        self._state.positions.appendleft(self._position)  # not handed out after all
        self._position = position
        self._handed -= 1
      except StopIteration:
        pass
    return self._dataset.element_spec

  def get_state(self) -> dict[str, Any]:
    """The position in the data: what `set_state` needs to continue after the batches handed out.

    Batches read ahead by the prefetch thread (or by `take_steps`) but not yet returned do not count:
    after `set_state`, the next batch is the one `next` would have returned. The state is a small
    JSON-serialisable dict: the number of batches handed out, of elements read from the dataset, and
    the dataset iterator's own state when it has one (grain's iterators: ``{"next_index": ...}``).

    >>> strategy = tpustrat.TPUStrategy()
    >>> dist = strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(5)])
    >>> it = iter(dist)
    >>> _ = next(it), next(it)
    >>> state = it.get_state()
    >>> state["batches"], state["elements"]
    (2, 2)
    >>> again = iter(dist)
    >>> again.set_state(state)
    >>> print(strategy.experimental_local_results(next(again))[0])
    [2.]
    """
    elements, source, reference = self._position
    encoding = None
    if isinstance(source, bytes):  # grain's DataLoader iterators give bytes
      source, encoding = bytes_to_text(source), "base64"
    state = {"format": _STATE_FORMAT, "batches": self._handed, "elements": elements, "source": source,
             "source_encoding": encoding}
    if reference is not None:  # the batch sizes seen so far in this pass (for drop_remainder)
      state["largest_batch"] = reference
    return state

  def set_state(self, state: collections.abc.Mapping[str, Any]) -> None:
    """Moves to the position `state` (from `get_state`, possibly of another iterator, strategy or process).

    The next batch is the one that followed the batches handed out when `state` was taken; batches read
    ahead are dropped and the prefetch thread restarts from there. The dataset iterator goes to its
    position with its own `set_state` when it has one (grain), else a new pass over the dataset skips
    the elements already read (the dataset must then yield the same elements in the same order on
    every pass). The position is counted in elements of the dataset, so it carries over to another
    number of replicas as long as the dataset itself is the same.

    Raises:
      ValueError: if `state` is not an iterator state, or the dataset cannot be repositioned (a one-shot
        iterator without `set_state`, or fewer elements than `state` has read).
    """
    batches, elements, source = _check_state(state)
    reference = _check_reference(state.get("largest_batch"))
    self._stop_prefetch("set_state")  # stop reading ahead from the old position
    it = self._feed.reopen(self._live(), elements, source)
    self._chunks.clear()
    self._error = None
    self._done = False
    self._closed = False
    self._state = ProduceState(it, produced=batches, read=elements, reference=reference)
    self._handed = batches
    self._position = (elements, source, reference)
    self._produce = functools.partial(self._feed.produce, it, self._state)

  def _stop_prefetch(self, what: str) -> None:
    """Stops the prefetch thread (if any) and waits for it, so that it no longer reads the source, and for
    the transfer out of the source's memory that the producer may have left (the batch handed out last,
    which it would have waited for before reading on): the source may be read again after this."""
    if self._prefetcher is not None:
      self._prefetcher.close()
      self._prefetcher.join(30.0)
      if self._feed.one_shot and self._prefetcher.is_alive():
        raise RuntimeError(f"{what}: the prefetch thread is still reading from the (one-shot) dataset.")
      self._prefetcher = None
    pending, self._state.pending = self._state.pending, None
    if pending is not None:
      jax.block_until_ready(pending)

  def close(self) -> None:
    """Stops the background prefetch thread; later `next` calls raise `StopIteration`.

    Batches read ahead and not yet returned are discarded. On a one-shot source (a generator), a later
    `iter()` of the dataset starts a new iterator on the elements the source has not given yet.
    """
    self._closed = True
    self._done = True
    self._chunks.clear()
    self._error = None
    if self._prefetcher is not None:
      self._prefetcher.close()

  def __del__(self) -> None:
    prefetcher = getattr(self, "_prefetcher", None)
    if prefetcher is not None:
      prefetcher.close()


_STATE_FORMAT = "tpustrat.DistributedIterator/1"


def _check_state(state: Any) -> tuple[int, int, Any]:
  """(batches, elements, source state) of a `DistributedIterator.get_state()` dict, validated."""
  if not isinstance(state, collections.abc.Mapping) or state.get("format") != _STATE_FORMAT:
    raise ValueError(
        f"DistributedIterator.set_state expects a state from DistributedIterator.get_state() (a dict with "
        f"format {_STATE_FORMAT!r}), got {state!r:.200}.")
  batches, elements = state.get("batches"), state.get("elements")
  counts = [batches, elements]
  if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
    raise ValueError(f"DistributedIterator.set_state: `batches` and `elements` must be ints >= 0, got {counts}.")
  assert isinstance(batches, int) and isinstance(elements, int)  # checked just above
  source = state.get("source")
  if state.get("source_encoding") == "base64":
    if not isinstance(source, str):
      raise ValueError(f"DistributedIterator.set_state: a base64 `source` must be a str, got {source!r:.100}.")
    source = text_to_bytes(source)
  return batches, elements, source


def _check_reference(reference: Any) -> Any:
  """The ``largest_batch`` of a state: ``[largest global batch, [largest batch of each local replica]]``
  (ints >= 0), or None (a state without it: nothing seen before in the pass)."""
  if reference is None:
    return None
  ok = (isinstance(reference, (list, tuple)) and len(reference) == 2 and isinstance(reference[0], int)
        and isinstance(reference[1], (list, tuple)) and all(isinstance(r, int) and r >= 0 for r in reference[1])
        and reference[0] >= 0)
  if not ok:
    raise ValueError("DistributedIterator.set_state: `largest_batch` must be [int >= 0, [int >= 0, ...]] as "
                     f"get_state() gives it, got {reference!r:.200}.")
  return [reference[0], list(reference[1])]


def _same_step(a: tuple[Any, int | None], b: tuple[Any, int | None]) -> bool:
  """Whether two chunks hold steps of one structure and shape (so that they can be stacked)."""
  (ta, na), (tb, nb) = a, b
  la, da = jax.tree.flatten(ta)
  lb, db = jax.tree.flatten(tb)
  if da != db:
    return False
  return all(np.shape(x)[0 if na is None else 1:] == np.shape(y)[0 if nb is None else 1:] for x, y in zip(la, lb))


class ProduceState:
  """What the producer of a `DistributedIterator` keeps between elements."""

  __slots__ = ("grid", "produced", "held", "error", "read", "positions", "source_state", "pending", "largest",
               "replica_largest", "ended", "device_seconds")

  def __init__(self, it: Iterator[Any], produced: int = 0, read: int = 0, reference: Any = None) -> None:
    # Set by the consumer: (1, 0) for one batch at a time, (k, i) for groups of k from batch i on.
    self.grid = (1, produced)
    self.produced = produced  # batches placed so far
    self.held: Any = None  # a prepared batch that did not fit the last group
    self.error: Exception | None = None  # raised after the group that was being filled
    self.read = read  # raw elements read from the source so far
    # Where the source stood after each batch kept, in order: (elements read, source state or None).
    # The consumer pops one per batch it hands out (`DistributedIterator.get_state`).
    self.positions: collections.deque[tuple[int, Any, Any]] = collections.deque()
    get_state = getattr(it, "get_state", None)  # grain iterators: their own, exact, cheap position
    self.source_state: Callable[[], Any] | None = get_state if callable(get_state) else None
    # Device arrays still being copied out of the source's memory: waited for before the next read.
    self.pending: Any = None
    # drop_remainder's reference, per pass: the largest batch so far (global rows), and each local
    # replica's largest batch (datasets_from_function); `ended`: a pipeline ran out (from_function).
    self.largest = 0 if reference is None else reference[0]
    self.replica_largest: list[int] = [] if reference is None else list(reference[1])
    self.ended = False
    # Seconds of the producer's transfers made while a step ran (`StepCounters.time_transfer`): the
    # consumer counts them as device time, not input.
    self.device_seconds = 0.0
