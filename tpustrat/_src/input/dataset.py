"""Distributed datasets: a source of global (or per-replica) batches turned into `PerReplica` batches.

`distribute_dataset(strategy, dataset, options)` (`strategy.experimental_distribute_dataset`) and
`distribute_datasets_from_function(strategy, dataset_fn, options)` make a `DistributedDataset`; each
`iter()` of it is a `DistributedIterator` (`tpustrat._src.input.iterator`) that asks the dataset for the
next element, in the prefetch thread or (without one: the default on XLA:CPU) in the caller's.

For one step the dataset reads the raw batch(es) from the source (`sources`), checks and pads them into
``[N, k, ...]`` host arrays with their real-row counts (`padding`), and places them: one transfer per leaf
onto ``NamedSharding(mesh, P('replica'))`` (stacked steps: ``P(None, 'replica')``; `staging.put_split`),
each leaf a `PerReplica`. The source is read again only once nothing still needs its memory (see
`tpustrat._src.host_memory`).

What depends only on a global batch's signature (its tree structure and each numpy leaf's shape, dtype and
strides) is checked and computed once per signature (`BatchSignature`): `flatten_batch`'s checks, the
real-row counts and their device copy, the padded shapes, the leaves' element tags and the layout half of
the aliasing test. Each batch still gets what depends on its values: the int64 range check, its padding,
the aliasing test on its address, and its transfer.

In a multi-process job each process needs only its own replicas' rows. From a grain ``MapDataset`` batched
with ``.batch(B)`` (random access over examples, see `sources.batched_examples`) a process reads only the
examples of those rows, in grain's reader threads, and stacks them itself (`_read_local`); the global batch
is never materialised anywhere, and every example is read by exactly one process. Other sources (an
IterDataset, a list, a generator, tf.data, a grain MapDataset transformed after ``batch``) are read whole
by every process, which keeps its replicas' rows. `experimental_distribute_datasets_from_function` gives
each process its own pipeline in any case.
"""

from __future__ import annotations

import collections.abc
import functools
import itertools
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import host_memory
from tpustrat._src.host_memory import host_empty
from tpustrat._src.input.iterator import DistributedIterator, Feed, Live, ProduceState
from tpustrat._src.input.options import InputContext, InputOptions, buffer_size
from tpustrat._src.input.padding import fill_rows, pad_rows, pad_rows_per_replica, stack_padded, take_rows
from tpustrat._src.input.sources import (
  ACCEPTED,
  BatchedExamples,
  batched_examples,
  check_narrowing,
  detached_copy,
  flatten_batch,
  index_iterator,
  iterable,
  wide_leaves,
)
from tpustrat._src.input.staging import StagingBuffers, alias_residues, put_split
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.values import ElementTag, PerReplica

__all__ = ["DistributedDataset", "distribute_dataset", "distribute_datasets_from_function"]

# Staging buffers kept per shape beyond the prefetch depth: the batch being read, the one the loop holds, and
# the batches of the steps in flight (`engine.DEFAULT_STEPS_IN_FLIGHT`, 2), which alias theirs on XLA:CPU.
STAGING_SPARE = 4
# A leaf of the source's memory of at most this many bytes is copied into a staging buffer on a backend that
# aliases host memory (XLA:CPU) even where its transfer would copy it: a copy of a small batch takes
# microseconds, while a transfer out of the source's memory must have completed before the source is read
# again, and on XLA:CPU it waits for the step that runs meanwhile (a wait each step, longer than a small
# model's step on one device). The staged copy is aliased by the devices: no transfer to wait for.
STAGE_BYTES = 1 << 20


class StrategyLike(Protocol):
  """What a distributed dataset needs of its strategy."""

  @property
  def mesh(self) -> jax.sharding.Mesh | None: ...

  @property
  def num_replicas_in_sync(self) -> int: ...


class DistributedDataset:
  """A dataset whose elements are `PerReplica` batches, one component per replica (TF's "distributed
  dataset").

  Created by `strategy.experimental_distribute_dataset` or
  `strategy.experimental_distribute_datasets_from_function`. Iterate it once per epoch
  (``for batch in dist``); each `iter()` starts a new pass over the underlying dataset.

  A one-shot source (a generator, or any iterator that is not re-iterable) gives one pass, and has one
  iterator at a time, like a Python generator: `iter()` returns the iterator already open on it, so a
  loop that stops early (``break``) and a later loop continue where the first stopped, with the batches
  its prefetch thread had read ahead; no example is lost and no two threads read the source. Only
  after that iterator's `close()` (which discards what it had read ahead) does `iter()` start a new
  iterator on the rest of the source.

  In a multi-process job every process iterates the dataset; from a grain ``MapDataset.batch(B)`` each
  reads only the examples of its own replicas' rows (others: the whole batch, keeping its rows).

  >>> strategy = tpustrat.TPUStrategy()
  >>> batches = [{"x": np.arange(32.0).reshape(16, 2)}, {"x": np.arange(24.0).reshape(12, 2)}]
  >>> dist = strategy.experimental_distribute_dataset(batches)
  >>> dist.element_spec["x"]
  PerReplica(num_replicas=8, component=float32[2, 2], padded)
  >>> totals = [float(strategy.reduce("SUM", strategy.run(lambda b: b["x"][:, 0], args=(b,)), axis=0))
  ...           for b in dist]
  >>> totals == [float(np.arange(0, 32, 2).sum()), float(np.arange(0, 24, 2).sum())]
  True
  """

  def __init__(self, strategy: StrategyLike, source: Any, options: InputOptions | None, *,
               per_replica: bool, what: str) -> None:
    if options is None:
      options = InputOptions()
    elif not isinstance(options, InputOptions):
      raise TypeError(f"{what}: `options` must be a tpustrat.InputOptions or None, got {options!r:.100}.")
    self._what = what
    self._batch_what = f"{what}: batch"  # for flatten_batch's messages
    self._options = options
    # Padding rows of a partial batch: copies of a real row (the default), or zeros (`InputOptions`).
    self._pad_first = options.experimental_padding == "first_row"
    self._source = source
    self._per_replica = per_replica  # from_function: the source yields per-replica batches
    self._one_shot = isinstance(source, collections.abc.Iterator)
    self._stash: list[Any] = []  # elements read ahead from a one-shot source (by element_spec)
    self._live: Live | None = None  # a one-shot source's iterator, until it is closed
    mesh = strategy.mesh
    self._mesh = mesh
    self._num_replicas = strategy.num_replicas_in_sync
    if mesh is None:  # the default strategy: one replica, batches pass through
      self._local = [0]
      self._splits: tuple[NamedSharding, NamedSharding] | None = None
    else:
      devices = list(mesh.devices.reshape(mesh.devices.shape[0], -1)[:, 0])  # each replica's logical core 0
      me = jax.process_index()
      self._local = [r for r, d in enumerate(devices) if d.process_index == me]
      # One batch [N, ...] split over its leading axis; stacked steps [steps, N, ...] over the second.
      self._splits = (NamedSharding(mesh, P(REPLICA_AXIS)), NamedSharding(mesh, P(None, REPLICA_AXIS)))
    self._multi_process = len(self._local) != self._num_replicas
    # The strategy's step statistics: its iterators add the time they wait for batches (`step_stats`).
    self._stats = getattr(getattr(strategy, "extended", None), "step_counters", None)
    # Batches read ahead by a prefetch thread: the option, or the default of the devices' platform.
    platform = (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform
    self._buffer_size = buffer_size(options, platform)
    # Several processes and a batched grain MapDataset: each reads only its replicas' rows (`_read_local`).
    self._examples: BatchedExamples | None = (
        batched_examples(source) if self._multi_process and not per_replica else None)
    self._layout: tuple[Any, list[np.ndarray]] | None = None  # (treedef, 0-row leaves) of a local part
    # XLA:CPU aliases aligned host memory on transfer (see "host memory"): None where it always copies.
    self._alias_align = host_memory.mesh_alias_alignment(mesh)
    # Where those copies go: enough buffers for every batch that can use one at a time (those read ahead,
    # the one being read, the one the loop holds, and the steps in flight's), so that none is allocated anew.
    self._staging = StagingBuffers(per_shape=self._buffer_size + STAGING_SPARE)
    self._local_index = {r: i for i, r in enumerate(self._local)}  # replica -> its row in local arrays
    self._k = 0  # padded rows per replica (the first batch's); only grows
    self._batch_rows = 0  # rows of a full batch (global, or per replica for from_function)
    self._spec: Any = None
    self._spec_tree: Any = None
    self._valid_cache: dict[Any, tuple[jax.Array, np.ndarray]] = {}  # counts -> on the devices, int64 host
    self._counts_cache: dict[tuple[int, int], np.ndarray] = {}  # (rows, k) -> this process's counts
    self._signatures: dict[Any, BatchSignature] = {}  # global batches' signatures seen (`_flatten_global`)
    self._lock = threading.Lock()

  @property
  def options(self) -> InputOptions:
    """The `InputOptions` of this dataset."""
    return self._options

  @property
  def element_spec(self) -> Any:
    """The type of the elements: a pytree like a batch whose leaves are `PerReplica` values over
    `jax.ShapeDtypeStruct` leaves of the global ``[num_replicas, per_replica_batch, ...]`` shape.

    Known after the first batch has been read; before that, the first batch is read (and kept for the
    next iteration if the source is a one-shot iterator).
    """
    if self._spec is None:
      live = self._open_iterator()
      if live is not None:  # it reads the source (maybe in its prefetch thread): ask it, not the source
        return live.element_spec
      if self._one_shot:  # kept for the iteration; the source may reuse the memory of what it gave
        first = self._read_ahead(self._source, detach=True)
        self._stash.extend(first)
      else:
        first = self._read_ahead(self._iter_source())
      if not first:
        raise ValueError(f"{self._what}: the dataset is empty, so its element_spec is unknown.")
      self._prepare(first, 0, count_only=True)
    return self._spec

  def _read_ahead(self, it: Iterator[Any], detach: bool = False) -> list[Any]:
    """The first step's raw element(s); with `detach`, each copied before the next is read (a per-replica
    source may write the next replica's batch where the last one was)."""
    n = len(self._local) if self._per_replica else 1
    return [detached_copy(e) if detach else e for e in itertools.islice(it, n)]

  def __iter__(self) -> DistributedIterator:
    live = self._open_iterator()
    if live is not None:  # one-shot source: continue the open iterator (see the class docstring)
      return live
    it: Iterator[Any] = self._iter_source()
    if self._stash:
      it = itertools.chain(self._stash, it)
      self._stash = []
    return DistributedIterator(self, it, self._feed())

  def _feed(self) -> Feed:
    """What an iterator of this dataset needs of it."""
    return Feed(produce=self._produce, spec_known=lambda: self._spec is not None, one_shot=self._one_shot,
                opened=self._opened, reopen=self._reopen, buffer_size=self._buffer_size, stats=self._stats)

  def _opened(self, live: Live) -> None:
    self._live = live

  def _reopen(self, live: Live, elements: int, source: Any) -> Iterator[Any]:
    """`DistributedIterator.set_state`'s part: the source positioned after `elements` raw elements."""
    if (self._one_shot and (self._live is None or self._live.iterator is not live.iterator)
        and self._open_iterator() is not None):
      raise RuntimeError(
          "set_state: another iterator is open on this one-shot dataset; call set_state on it (iter() "
          "returns it) or close() it first.")
    it = self._resume(elements, source)
    if self._one_shot:
      self._live = live
    return it

  def _open_iterator(self) -> DistributedIterator | None:
    """A one-shot source's iterator while it is open (not closed); None otherwise, once the thread of a
    closed one has stopped reading the source."""
    live = self._live
    if live is None:
      return None
    if not live.closed():
      return live.iterator
    live.stop_prefetch("iter()")
    self._live = None
    return None

  def _resume(self, elements: int, source: Any) -> Iterator[Any]:
    """An iterator over the source positioned after `elements` raw elements (`source`: the source
    iterator's own saved state, or None)."""
    if self._one_shot:
      it = self._source
      if not callable(getattr(it, "set_state", None)) or source is None:
        why = ("it has no set_state" if not callable(getattr(it, "set_state", None)) else
               "its state was not recorded there (the dataset's element_spec read it ahead)")
        raise ValueError(
            f"{self._what}: cannot move a one-shot {type(it).__name__} to a saved position: {why}. Distribute "
            "a re-iterable dataset (a grain MapDataset or IterDataset, a list, ...) or an iterator with "
            "get_state/set_state (grain's DatasetIterator).")
      it.set_state(source)
      self._stash = []
      return it
    if self._examples is not None:  # grain's position, or (a state of another source kind) the count
      start = source.get("next_index") if isinstance(source, collections.abc.Mapping) else None
      return self._iter_source(start if isinstance(start, int) and not isinstance(start, bool) else elements)
    it = iter(self._source)
    if source is not None and callable(getattr(it, "set_state", None)):
      it.set_state(source)
      return it
    skipped = sum(1 for _ in itertools.islice(it, elements))  # replay: sources without a state of their own
    if skipped < elements:
      raise ValueError(
          f"{self._what}: the saved position is {elements} elements into the dataset, but a new pass over it "
          f"ends after {skipped}; restore the iterator over the same dataset.")
    return it

  def __repr__(self) -> str:
    return f"DistributedDataset(num_replicas={self._num_replicas}, source={type(self._source).__name__})"

  def global_source(self, what: str) -> Any:
    """The dataset of global batches this one distributes (for Keras's ``fit``, which distributes it again
    with its own data adapters); raises for a dataset made per replica by a function, which has none."""
    if self._per_replica:
      raise ValueError(
          f"{what}: a dataset made by experimental_distribute_datasets_from_function yields each replica's "
          "batch, not global batches; give model.fit the dataset of global batches (or "
          "strategy.experimental_distribute_dataset(dataset)).")
    if self._stash:  # element_spec read a one-shot source ahead
      return itertools.chain(self._stash, self._source)
    return self._source

  def _iter_source(self, start: int = 0) -> Iterator[Any]:
    """A new pass over the source from element `start` (a batched grain MapDataset read per process: this
    process's parts of the batches, see `_read_local`; `start` > 0 only then)."""
    if self._examples is None:
      return iter(self._source)
    # The per-replica size the batches from `start` on get: a MapDataset's batches are full but the last,
    # so it is fixed by the largest batch read before and the first one read now (as `_prepare` would set).
    with self._lock:
      full = max(self._batch_rows, self._examples.rows(start))
    read = functools.partial(self._read_local, k=math.ceil(full / self._num_replicas),
                             drop_below=full if self._options.drop_remainder else 0)
    it = index_iterator(self._examples.num_batches, read)
    if start:
      it.set_state({"next_index": start})  # grain checks the range
    return it

  def _read_local(self, index: int, *, k: int, drop_below: int = 0) -> LocalRows:
    """This process's replicas' rows of batch `index` of a batched grain MapDataset, read as one batch per
    replica with real rows (replica ``r`` holds rows ``[r*k, (r+1)*k)``): only their examples are read.
    A batch of fewer than `drop_below` rows (dropped by `drop_remainder`) is not read. Runs in grain's
    reader threads."""
    examples = self._examples
    assert examples is not None  # only a batched grain MapDataset read per process is read in parts
    rows = examples.rows(index)
    if rows < drop_below:
      return LocalRows(index, rows, k, None)
    parts = []
    for r in self._local:  # in replica order: those with real rows come first
      start, stop = r * k, min((r + 1) * k, rows)
      if start >= stop:
        break
      parts.append(examples.read(index, start, stop))
    return LocalRows(index, rows, k, parts)

  def _prepare_local(self, part: LocalRows, count_only: bool) -> Prepared | None:
    """`_prepare` for this process's part of a batch (`_read_local`): ``[N_local, k, ...]`` leaves, padded
    past each replica's real rows (with the global batch's first row, read here when this process holds
    it not, or zeros: `InputOptions.experimental_padding`), and the local real-row counts."""
    with self._lock:
      if part.rows > self._batch_rows:
        self._batch_rows = part.rows
        self._k = math.ceil(part.rows / self._num_replicas)
      k, full = self._k, self._batch_rows
    if part.rows < full and self._options.drop_remainder and not count_only:
      return None
    if part.parts is None or part.k != k:  # read with another per-replica size (another iterator grew it)
      part = self._read_local(part.index, k=k)
    assert part.parts is not None  # read without `drop_below`: never left unread
    what = f"{self._what}: batch"
    parts = [flatten_batch(b, part.index, what) for b in part.parts]
    if parts:
      treedef, first = parts[0][1], parts[0][0]
      for leaves, tdef, _ in parts[1:]:
        if tdef != treedef or any(a.shape[1:] != b.shape[1:] or a.dtype != b.dtype for a, b in zip(leaves, first)):
          raise ValueError(
              f"{what} {part.index}: its examples differ in structure, shape or dtype; every example of a "
              "batch must have the same.")
      self._layout = (treedef, [np.zeros((0,) + x.shape[1:], x.dtype) for x in first])
    elif self._layout is not None:  # no real rows here: the layout of earlier batches
      treedef, first = self._layout
    else:  # nothing read yet: one example of the batch says its layout (read by another process too)
      assert self._examples is not None  # local parts come from `_read_local`, which needs it
      first, treedef, _ = flatten_batch(self._examples.read(part.index, 0, 1), part.index, what)
      self._layout = (treedef, [np.zeros((0,) + x.shape[1:], x.dtype) for x in first])
    with self._lock:
      if self._spec is not None and treedef != self._spec_tree:
        raise ValueError(
            f"{self._what}: a batch has structure {treedef}, but earlier batches had {self._spec_tree}; "
            "every batch of a dataset must have the same structure.")
      if self._spec is None or count_only:
        self._set_spec(treedef, first, k)
    if count_only:
      return None
    n_local = len(self._local)
    counts = self._counts(part.rows, k)
    if parts:
      leaves = [stack_padded([p[0][i] for p in parts], n_local, k) for i in range(len(first))]
    else:
      leaves = [np.zeros((n_local, k) + x.shape[1:], x.dtype) for x in first]
    if self._pad_first and part.rows and (counts < k).any():  # padding: the global batch's first row
      assert self._examples is not None
      row = (parts[0][0] if self._local[0] == 0 and parts else
             flatten_batch(self._examples.read(part.index, 0, 1), part.index, what)[0])
      for x, r in zip(leaves, row):
        fill_rows(x, counts, r[0])
    return Prepared(treedef, leaves, counts, True)

  # -- one step's batch: host arrays -> padded [N, k, ...] -> devices

  def _next_raw(self, it: Iterator[Any], index: int) -> tuple[list[Any], tuple[int, list[np.ndarray]] | None]:
    """The raw element(s) of the next step, element `index` of the dataset first: one global batch, or
    one batch per local replica (see `_read_replicas`) with their stacked copy ``(k, leaves)``."""
    if not self._per_replica:
      return [next(it)], None
    raw, stacked = self._read_replicas(it, index)
    if not raw:
      raise StopIteration
    return raw, stacked

  def _read_replicas(self, it: Iterator[Any], index: int) -> tuple[list[Any], tuple[int, list[np.ndarray]] | None]:
    """Reads one step's per-replica batches one at a time, copying each into zero-padded
    ``[N_local, k, ...]`` arrays before the next is read (a source may write the next batch into the
    same buffer). Batches that cannot be stacked (other structure, shapes or dtypes) stop the copying
    and are left to `_prepare`'s checks, which raise."""
    n = len(self._local)
    what = f"{self._what}: per-replica batch"
    raw: list[Any] = []
    stack: list[np.ndarray] | None = None
    ok, k = True, self._k
    first_tree, first = None, []
    for j, element in enumerate(itertools.islice(it, n)):
      raw.append(element)
      if not ok:
        continue
      try:
        leaves, treedef, rows = flatten_batch(element, index + j, what)
      except Exception:  # pylint: disable=broad-except  # raised again by _prepare, with its context
        ok = False
        continue
      if stack is None:
        first_tree, first, k = treedef, leaves, max(k, rows)
        stack = [host_empty((n, k) + x.shape[1:], x.dtype) for x in leaves]
      elif treedef != first_tree or any(a.shape[1:] != b.shape[1:] or a.dtype != b.dtype
                                        for a, b in zip(leaves, first)):
        ok = False
        continue
      elif rows > k:  # a larger batch than the step's first: grow the stack
        stack, k = [pad_rows_per_replica(s, rows) for s in stack], rows
      for s, x in zip(stack, leaves):
        s[j, :rows] = x
        s[j, rows:] = 0
    if not ok or stack is None:
      return raw, None
    for s in stack:
      s[len(raw):] = 0
    return raw, (k, stack)

  def _prepare(self, raw: list[Any], index: int, count_only: bool = False,
               stacked: tuple[int, list[np.ndarray]] | None = None,
               state: ProduceState | None = None) -> Prepared | None:
    """Validates and pads one step's raw batch(es), the first being element `index` of the dataset
    (`stacked`: the per-replica batches already stacked by `_read_replicas`). Returns the
    `Prepared` batch, or None if the batch is partial and `drop_remainder` is set. Sets the element
    spec."""
    if self._examples is not None:
      return self._prepare_local(raw[0], count_only)
    signature = None
    if self._per_replica:
      what = f"{self._what}: per-replica batch"
      parts = [flatten_batch(b, index + i, what) for i, b in enumerate(raw)]
    else:
      part, signature = self._flatten_global(raw[0], index)
      parts = [part]
    treedef = parts[0][1]
    for i, (leaves, tdef, _) in enumerate(parts[1:], 1):
      if tdef != treedef:
        raise ValueError(
            f"{self._what}: per-replica batches of one step differ in structure: {tdef} for replica "
            f"{self._local[i]} but {treedef} for replica {self._local[0]}.")
      for a, b in zip(leaves, parts[0][0]):
        if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
          raise ValueError(
              f"{self._what}: per-replica batches of one step must agree on everything but their number "
              f"of rows; got {a.dtype}{list(a.shape)} for replica {self._local[i]} and "
              f"{b.dtype}{list(b.shape)} for replica {self._local[0]}.")
    with self._lock:
      if self._spec is not None and treedef != self._spec_tree:
        raise ValueError(
            f"{self._what}: a batch has structure {treedef}, but earlier batches had {self._spec_tree}; "
            "every batch of a dataset must have the same structure.")
      rows = max(p[2] for p in parts)
      if rows > self._batch_rows:
        self._batch_rows = rows
        self._k = rows if self._per_replica else math.ceil(rows / self._num_replicas)
      k = self._k
      if self._spec is None or count_only:
        self._set_spec(treedef, parts[0][0], k)
    if count_only:
      return None
    if state is not None and self._options.drop_remainder and self._dropped(parts, state):
      return None
    n_local = len(self._local)
    if self._per_replica:
      counts = np.zeros(n_local, np.int32)
      counts[:len(parts)] = [p[2] for p in parts]
      if stacked is not None:  # another iterator of this dataset may have grown k meanwhile: pad to it
        # (not from `raw`: the source may have written later batches where the earlier ones were)
        leaves = stacked[1] if stacked[0] == k else [pad_rows_per_replica(x, k) for x in stacked[1]]
      else:
        leaves = [stack_padded([p[0][i] for p in parts], n_local, k) for i in range(len(parts[0][0]))]
      if self._pad_first:
        for x in leaves:
          fill_rows(x, counts)
      return Prepared(treedef, leaves, counts, True)
    rows = parts[0][2]
    n = self._num_replicas
    layout = None if signature is None else signature.layout
    if layout is not None and layout.k == k:
      leaves = [pad_rows(x, n * k, self._pad_first).reshape(shape)
                for x, shape in zip(parts[0][0], layout.shapes)]
      counts, owned = layout.counts, layout.owned
    else:
      counts = self._counts(rows, k)
      owned = rows != n * k  # padded: a copy; else the source's memory
      leaves = [pad_rows(x, n * k, self._pad_first).reshape((n, k) + x.shape[1:]) for x in parts[0][0]]
      if signature is not None:
        layout = signature.layout = self._new_layout(treedef, leaves, counts, owned, k)
    if self._multi_process:
      leaves = [take_rows(x, self._local) for x in leaves]
      owned = True
    return Prepared(treedef, leaves, counts, owned, layout)

  def _flatten_global(self, batch: Any,
                      index: int) -> tuple[tuple[list[np.ndarray], Any, int], BatchSignature | None]:
    """`flatten_batch` of global batch `index`, its checks run once per signature: a batch of numpy leaves
    with the tree structure and the leaves' shapes, dtypes and strides of one seen before has only its
    int64 / uint64 values checked (`sources.check_narrowing`). Returns ``(leaves, treedef, rows)`` and the
    batch's `BatchSignature` (None for a batch with other leaves than numpy arrays: checked in full)."""
    leaves, treedef = jax.tree.flatten(batch)
    try:
      key: Any = (treedef, *[(type(x), x.shape, x.dtype, x.strides) for x in leaves])
      signature = self._signatures.get(key)
    except (AttributeError, TypeError):  # a leaf without them (a jax.Array, a scalar, ...): checked in full
      key = signature = None
    if signature is not None:
      if signature.wide:
        check_narrowing(leaves, batch, index, self._batch_what, signature.wide)
      return (leaves, treedef, signature.rows), signature
    part = flatten_batch(batch, index, self._batch_what)
    if key is not None and all(type(x) is np.ndarray for x in leaves):  # flatten_batch took them as they are
      signature = BatchSignature(part[2], wide_leaves(part[0]))
      if len(self._signatures) >= 16:
        self._signatures.clear()
      self._signatures[key] = signature
    return part, signature

  def _new_layout(self, treedef: Any, leaves: list[np.ndarray], counts: np.ndarray, owned: bool,
                  k: int) -> Layout:
    """The `Layout` of one signature's batches padded to per-replica size `k`, from such a batch's `leaves`
    (``[N, k, ...]``, before `take_rows`)."""
    align = self._alias_align
    residues = None if align is None else [_staged_residues(x, self._num_replicas, align) for x in leaves]
    valid = None if self._mesh is None or self._multi_process else self._valid_array(counts)
    return Layout(k, counts, [x.shape for x in leaves], owned, residues, valid,
                  element_tags(treedef, not self._pad_first))

  def _dropped(self, parts: list[Any], state: ProduceState) -> bool:
    """`drop_remainder`: whether this step's batch is a remainder, against the batches before it in this
    pass (`state`); updates the pass's reference.

    A global batch is one when it has fewer rows than the largest before it. With datasets_from_function
    the rule is TF's, per pipeline: a replica's batch is a remainder when it is smaller than the batches
    that replica got before in the pass, or when it got none (its pipeline ended); the pass then ends,
    as TF's iterator stops where a pipeline runs out."""
    if not self._per_replica:
      rows = parts[0][2]
      partial = rows < state.largest
      state.largest = max(state.largest, rows)
      return partial
    largest = state.replica_largest
    largest.extend([0] * (len(self._local) - len(largest)))
    short = any(p[2] < largest[i] for i, p in enumerate(parts))
    for i, p in enumerate(parts):
      largest[i] = max(largest[i], p[2])
    if short or len(parts) < len(self._local):
      state.ended = True
      return True
    return False

  def _counts(self, rows: int, k: int) -> np.ndarray:
    """The real rows of this process's replicas (read-only int32 ``[N_local]``) for a global batch of
    `rows` rows split `k` per replica; cached (the same every full batch)."""
    counts = self._counts_cache.get((rows, k))
    if counts is None:
      counts = np.clip(rows - k * np.arange(self._num_replicas), 0, k).astype(np.int32)
      if self._multi_process:
        counts = counts[self._local]
      counts.flags.writeable = False
      if len(self._counts_cache) > 16:
        self._counts_cache.clear()
      self._counts_cache[(rows, k)] = counts
    return counts

  def _set_spec(self, treedef: Any, leaves: list[np.ndarray], k: int) -> None:
    self._spec_tree = treedef
    splits = self._splits
    if splits is None:  # the default strategy (no mesh)
      self._spec = jax.tree.unflatten(
          treedef, [jax.ShapeDtypeStruct(x.shape, device_dtype(x)) for x in leaves])
      return
    n, split = self._num_replicas, splits[0]
    valid = jax.ShapeDtypeStruct((n,), np.int32, sharding=split)
    self._spec = jax.tree.unflatten(treedef, [
        PerReplica.from_stacked(
            jax.ShapeDtypeStruct((n, k) + x.shape[1:], device_dtype(x), sharding=split), valid, tag=tag)
        for x, tag in zip(leaves, element_tags(treedef, not self._pad_first))])

  def _produce(self, it: Iterator[Any], state: ProduceState) -> tuple[Any, int | None]:
    """The next chunk: ``(batch, None)``, one element ready for `run`, while the consumer takes one batch
    at a time, else ``(stacked, n)``: up to ``k`` batches stacked on a leading steps axis, ending where
    the consumer's groups of ``k`` end (fewer at the end, or when the next batch has other shapes: it
    starts the next chunk). Raises StopIteration at the end. Runs in the prefetch thread (or the
    consumer's, without one).

    The source is read again only once nothing still needs its memory (see "host memory" above): the
    transfers out of it have completed, and batches of a group are copied into the group's stacked
    arrays as they are read."""
    group, anchor = state.grid
    single = group == 1
    if not single:  # end groups where the consumer's next groups end, even after a change of group size
      group -= (state.produced - anchor) % group
    prepared: list[Prepared] = []
    stacks: list[np.ndarray] = []  # a group's stacked leaves [group, ...], filled as batches come
    while len(prepared) < group:
      if state.held is not None:
        p, state.held = state.held, None
      else:
        if state.error is not None:  # raised while a group was being filled: after that group
          error, state.error = state.error, None
          raise error
        try:
          if state.pending is not None:
            self._transfer(state, jax.block_until_ready, state.pending)
            state.pending = None
          if state.ended:  # datasets_from_function: a pipeline ran out (drop_remainder)
            raise StopIteration
          first = state.read
          raw, stacked = self._next_raw(it, first)
          state.read += len(raw)
          p = self._prepare(raw, first, stacked=stacked, state=state)
        except StopIteration:
          if prepared:
            break
          self._staging.clear()  # the end of a pass: no more copies to reuse the buffers for
          raise
        except Exception as e:  # pylint: disable=broad-except
          if not prepared:
            raise
          state.error = e
          break
        if p is None:
          continue
        reference = [state.largest, list(state.replica_largest)] if self._options.drop_remainder else None
        state.positions.append((state.read, None if state.source_state is None else state.source_state(),
                                reference))
      if prepared and not self._stackable(prepared[0], p):
        state.held = p  # taken first by the next call, before the source is read again
        break
      if not single:
        if not stacks:
          stacks = [host_empty((group,) + x.shape, x.dtype) for x in p.leaves]
        for i, x in enumerate(p.leaves):
          if x.dtype != stacks[i].dtype:  # promoted, as np.stack would: no batch's values are cast away
            promoted = host_empty(stacks[i].shape, np.result_type(stacks[i].dtype, x.dtype))
            promoted[:len(prepared)] = stacks[i][:len(prepared)]
            stacks[i] = promoted
          stacks[i][len(prepared)] = x
      prepared.append(p)
    state.produced += len(prepared)
    if single:
      return self._place(prepared, None, state), None
    return self._place(prepared, [s[:len(prepared)] for s in stacks], state), len(prepared)

  def _stackable(self, a: Prepared, b: Prepared) -> bool:
    """Whether two prepared batches have one element shape (a larger later batch grows ``k``; the default
    strategy does not pad partial batches)."""
    if [x.shape for x in a.leaves] != [x.shape for x in b.leaves]:
      return False
    return self._mesh is not None or a.counts[0] == b.counts[0]

  def _place(self, prepared: list[Prepared], stacks: list[np.ndarray] | None, state: ProduceState) -> Any:
    """Prepared batches as one element: the only batch, ready for `run`, or (with `stacks`, the batches'
    leaves stacked on a leading steps axis) every array ``[steps, num_replicas, k, ...]`` split over the
    replicas (its second axis) and the real-row counts ``[steps, num_replicas]``. One transfer per leaf;
    a transfer out of the source's memory is left in `state.pending`."""
    steps = stacks is not None
    treedef = prepared[0].treedef
    layout = None
    if stacks is not None:
      leaves, owned = stacks, True
    else:
      leaves, owned, layout = prepared[0].leaves, prepared[0].owned, prepared[0].layout
    fetch = self._options.experimental_fetch_to_device
    splits = self._splits
    if splits is None:  # default strategy (no mesh): the batches as they came, without padding
      rows = int(prepared[0].counts[0])
      leaves = [x[:, 0, :rows] if steps else x[0, :rows] for x in leaves]
      if not fetch:
        return jax.tree.unflatten(treedef, leaves)
      host = self._unaliased(leaves, owned, 1)
      arrays = self._transfer(state, jax.device_put, host)
      if not owned:
        state.pending = _from_source(arrays, host, leaves)
      return jax.tree.unflatten(treedef, arrays)
    counts = np.stack([p.counts for p in prepared]) if steps else prepared[0].counts
    host_counts: np.ndarray | None
    if layout is not None and layout.valid is not None:
      valid, host_counts = layout.valid
    else:
      valid, host_counts = self._valid_array(counts)  # tiny and mostly the same every step: cached
    if self._multi_process:  # a global array needs every process's part: always placed
      arrays = self._transfer(state, lambda: [self._from_local(x, steps) for x in leaves])
    elif fetch:
      host = self._unaliased(leaves, owned, self._num_replicas, None if layout is None else layout.residues)
      arrays = self._transfer(state, put_split, host, splits[steps])
      if not owned:
        state.pending = _from_source(arrays, host, leaves)
    else:  # without fetch_to_device the arrays stay on the host; `run` transfers them
      arrays = leaves
    if steps or self._multi_process:
      host_counts = None
    tags = element_tags(treedef, not self._pad_first) if layout is None else layout.tags
    # Each leaf is its own PerReplica (like `run`'s outputs), so that the batch keeps the user's pytree.
    return jax.tree.unflatten(treedef, [PerReplica.from_stacked(x, valid, host_real_rows=host_counts, tag=tag)
                                        for x, tag in zip(arrays, tags)])

  def _transfer(self, state: ProduceState, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a transfer to the devices (or a wait for one). A transfer made while a step runs (on
    XLA:CPU it may wait until the step ends) is added to `state.device_seconds`, which the iterator counts
    as device time, not input (`StepCounters.time_transfer`)."""
    stats = self._stats
    if stats is None:
      return fn(*args)
    result, on_devices = stats.time_transfer(lambda: fn(*args))
    state.device_seconds += on_devices
    return result

  def _unaliased(self, leaves: list[np.ndarray], owned: bool, parts: int,
                 residues: list[frozenset[int] | None] | None = None) -> list[np.ndarray]:
    """`leaves`, with those in the source's memory that a transfer would alias (XLA:CPU, aligned), and
    the small ones (`STAGE_BYTES`), copied first (into reused staging buffers: `tpustrat._src.input.staging`).
    `residues`: the leaves' `_staged_residues` (their layout's, computed once), so that only their addresses
    are tested here (not even those where every address is: ``x.ctypes`` costs microseconds)."""
    align = self._alias_align
    if owned or align is None:
      return leaves
    if residues is None:
      return [self._staging.copy(x) if _small(x) or host_memory.may_alias(x, parts, align) else x for x in leaves]
    return [self._staging.copy(x) if (host_memory.may_alias(x, parts, align) if r is None else
                                      r and (len(r) >= align or x.ctypes.data % align in r)) else x
            for x, r in zip(leaves, residues)]

  def _valid_array(self, counts: np.ndarray) -> tuple[jax.Array, np.ndarray]:
    """The real-row counts on the devices, and as a read-only int64 host array (cached by value)."""
    key = (counts.shape, counts.tobytes())
    cached = self._valid_cache.get(key)
    if cached is None:
      if len(self._valid_cache) > 16:
        self._valid_cache.clear()
      if self._multi_process:
        valid = self._from_local(counts, steps=counts.ndim == 2)
      else:
        valid = jax.device_put(counts, self._split_shardings()[counts.ndim == 2])
      host = counts.astype(np.int64)
      host.flags.writeable = False
      cached = self._valid_cache[key] = (valid, host)
    return cached

  def _from_local(self, local: np.ndarray, steps: bool) -> jax.Array:
    """A global ``[N, ...]`` array from this process's replicas' rows ``[N_local, ...]`` (multi-process);
    with `steps`, ``[steps, N, ...]`` from ``[steps, N_local, ...]``."""
    axis = int(steps)  # the replica axis: the second one of stacked steps

    def part(index: tuple[slice, ...] | None) -> np.ndarray:
      assert index is not None  # JAX's type allows None, but it never passes None (it asserts so itself)
      i = self._local_index[index[axis].start or 0]
      return local[(slice(None),) * axis + (slice(i, i + 1),)]

    shape = local.shape[:axis] + (self._num_replicas,) + local.shape[axis + 1:]
    return jax.make_array_from_callback(shape, self._split_shardings()[steps], part)

  def _split_shardings(self) -> tuple[NamedSharding, NamedSharding]:
    """(one batch split over the replicas, stacked steps split over them): a strategy with a mesh only."""
    splits = self._splits
    assert splits is not None  # the default strategy's batches are never placed split
    return splits


class LocalRows:
  """This process's part of one batch of a batched grain MapDataset (`DistributedDataset._read_local`)."""

  __slots__ = ("index", "rows", "k", "parts")

  def __init__(self, index: int, rows: int, k: int, parts: list[Any] | None) -> None:
    self.index = index  # the batch's index in the dataset
    self.rows = rows  # the global batch's rows
    self.k = k  # the per-replica size the parts were cut with
    self.parts = parts  # one batch per local replica with real rows, in order; None: not read (dropped)

  def __repr__(self) -> str:
    return f"LocalRows(batch {self.index}: {self.rows} rows, k={self.k})"


class Prepared(NamedTuple):
  """One step's batch on the host, ready to be placed."""
  treedef: Any
  leaves: list[np.ndarray]  # [N_local, k, ...] each
  counts: np.ndarray  # [N_local] real rows per replica
  owned: bool  # the leaves are the library's copies (else they may be the source's memory)
  layout: Layout | None = None  # a global batch's, when its signature is known (`BatchSignature`)


class Layout(NamedTuple):
  """What `_place` needs of the batches of one `BatchSignature` padded to per-replica size `k`, computed
  once (`DistributedDataset._new_layout`)."""
  k: int
  counts: np.ndarray  # [N_local] real rows per replica (read-only)
  shapes: list[tuple[int, ...]]  # each leaf's [N, k, ...]
  owned: bool  # padded into the library's copies (else the leaves are the source's memory)
  residues: list[frozenset[int] | None] | None  # each leaf's `_staged_residues`; None: the backend copies
  valid: tuple[jax.Array, np.ndarray] | None  # `_valid_array(counts)`; None: no mesh, or several processes
  tags: tuple[ElementTag, ...]  # `element_tags` of the leaves


class BatchSignature:
  """What every global batch of one signature (its tree structure and each numpy leaf's shape, dtype and
  strides) shares, checked and computed once by `DistributedDataset._flatten_global`: `flatten_batch`'s
  checks passed for it, its leading size `rows`, the indices of its int64 / uint64 leaves (whose values
  are checked in every batch), and the `Layout` it was last prepared with (None before, or replaced when
  the per-replica size grows)."""

  __slots__ = ("rows", "wide", "layout")

  def __init__(self, rows: int, wide: tuple[int, ...]) -> None:
    self.rows = rows
    self.wide = wide
    self.layout: Layout | None = None


def _from_source(arrays: list[jax.Array], host: list[np.ndarray],
                 leaves: list[np.ndarray]) -> list[jax.Array] | None:
  """The device arrays transferred out of the source's memory (`leaves`, sent as `host` except those
  copied into staging buffers first): the transfers to wait for before the source is read again; None
  when every leaf went through a staging copy."""
  pending = [a for a, h, x in zip(arrays, host, leaves) if h is x]
  return pending or None


def _small(x: np.ndarray) -> bool:
  """Whether a source's leaf is copied into a staging buffer whatever its address (`STAGE_BYTES`): a
  small array of a dtype that numpy copies as it is."""
  return x.nbytes <= STAGE_BYTES and not x.dtype.hasobject and x.dtype.kind not in "OSUMm"


def _staged_residues(x: np.ndarray, parts: int, align: int) -> frozenset[int] | None:
  """The data addresses modulo `align` at which a leaf of `x`'s layout is copied into a staging buffer
  before its transfer: every one for a small leaf (`_small`), else `alias_residues` (None: ask
  `host_memory.may_alias` each time)."""
  return frozenset(range(align)) if _small(x) else alias_residues(x, parts, align)


def device_dtype(x: np.ndarray) -> np.dtype:
  """The dtype `x` has once on the devices (float64 becomes float32 unless `jax_enable_x64` is set)."""
  return jax.dtypes.canonicalize_dtype(x.dtype)


# -- entry points (called by Strategy) ------------------------------------------------------------


def distribute_dataset(strategy: StrategyLike, dataset: Any, options: InputOptions | None) -> DistributedDataset:
  """`Strategy.experimental_distribute_dataset`."""
  what = "experimental_distribute_dataset"
  return DistributedDataset(strategy, iterable(dataset, what), options, per_replica=False, what=what)


def distribute_datasets_from_function(strategy: StrategyLike, dataset_fn: Callable[[InputContext], Any],
                                      options: InputOptions | None) -> DistributedDataset:
  """`Strategy.experimental_distribute_datasets_from_function`: one `dataset_fn` call per process."""
  what = "experimental_distribute_datasets_from_function"
  if not callable(dataset_fn):
    raise TypeError(f"{what} expects a callable `dataset_fn(input_context)`, got {dataset_fn!r:.100}.")
  ctx = InputContext(num_input_pipelines=jax.process_count(), input_pipeline_id=jax.process_index(),
                     num_replicas_in_sync=strategy.num_replicas_in_sync)
  dataset = dataset_fn(ctx)
  try:
    source = iterable(dataset, what)
  except TypeError:
    raise TypeError(
        f"{what}: `dataset_fn` must return a dataset of per-replica batches ({ACCEPTED}), but it "
        f"returned {type(dataset).__name__}: {dataset!r:.100}.") from None
  return DistributedDataset(strategy, source, options, per_replica=True, what=what)


@functools.lru_cache(maxsize=64)
def element_tags(treedef: Any, zero_padded: bool) -> tuple[ElementTag, ...]:
  """The `ElementTag` of each leaf of a dataset element of structure `treedef`, padded with zero rows or
  not: the leaves of one element are one batch for `run` (`PerReplica.batch_tag`)."""
  dummy = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
  paths = tuple(tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0])
  return tuple(ElementTag(paths, i, zero_padded) for i in range(len(paths)))
