"""Distributed datasets: a source of global (or per-replica) batches turned into `PerReplica` batches.

`distribute_dataset(strategy, dataset, options)` (`strategy.experimental_distribute_dataset`) and
`distribute_datasets_from_function(strategy, dataset_fn, options)` make a `DistributedDataset`; each
`iter()` of it is a `DistributedIterator` (`tpustrat._src.input.iterator`) that asks the dataset for the
next element, in the prefetch thread or in the caller's.

For one step the dataset reads the raw batch(es) from the source (`sources`), checks and pads them into
``[N, k, ...]`` host arrays with their real-row counts (`padding`), and places them: one `jax.device_put`
per leaf onto ``NamedSharding(mesh, P('replica'))`` (stacked steps: ``P(None, 'replica')``), each leaf a
`PerReplica`. The source is read again only once nothing still needs its memory (see
`tpustrat._src.host_memory`).
"""

from __future__ import annotations

import collections.abc
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
from tpustrat._src.input.options import InputContext, InputOptions
from tpustrat._src.input.padding import pad_rows, pad_rows_per_replica, stack_padded, take_rows
from tpustrat._src.input.sources import ACCEPTED, detached_copy, flatten_batch, iterable
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.values import PerReplica

__all__ = ["DistributedDataset", "distribute_dataset", "distribute_datasets_from_function"]


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
    self._options = options
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
    # XLA:CPU aliases aligned host memory on transfer (see "host memory"): None where it always copies.
    self._alias_align = host_memory.mesh_alias_alignment(mesh)
    self._local_index = {r: i for i, r in enumerate(self._local)}  # replica -> its row in local arrays
    self._k = 0  # padded rows per replica (the first batch's); only grows
    self._batch_rows = 0  # rows of a full batch (global, or per replica for from_function)
    self._spec: Any = None
    self._spec_tree: Any = None
    self._valid_cache: dict[Any, Any] = {}
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
        first = self._read_ahead(iter(self._source))
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
    it: Iterator[Any] = iter(self._source)
    if self._stash:
      it = itertools.chain(self._stash, it)
      self._stash = []
    return DistributedIterator(self, it, self._feed())

  def _feed(self) -> Feed:
    """What an iterator of this dataset needs of it."""
    return Feed(produce=self._produce, spec_known=lambda: self._spec is not None, one_shot=self._one_shot,
                opened=self._opened, reopen=self._reopen)

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
               stacked: tuple[int, list[np.ndarray]] | None = None) -> Prepared | None:
    """Validates and pads one step's raw batch(es), the first being element `index` of the dataset
    (`stacked`: the per-replica batches already stacked by `_read_replicas`). Returns the
    `Prepared` batch, or None if the batch is partial and `drop_remainder` is set. Sets the element
    spec."""
    what = f"{self._what}: per-replica batch" if self._per_replica else f"{self._what}: batch"
    parts = [flatten_batch(b, index + i, what) for i, b in enumerate(raw)]
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
      k, full = self._k, self._batch_rows
      if self._spec is None or count_only:
        self._set_spec(treedef, parts[0][0], k)
    if count_only:
      return None
    partial = (any(p[2] < full for p in parts) or len(parts) < len(self._local)) if self._per_replica \
        else parts[0][2] < full
    if partial and self._options.drop_remainder:
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
      return Prepared(treedef, leaves, counts, True)
    rows = parts[0][2]
    n = self._num_replicas
    counts = np.clip(rows - k * np.arange(n), 0, k).astype(np.int32)
    owned = rows != n * k  # padded: a copy; else the source's memory
    leaves = [pad_rows(x, n * k).reshape((n, k) + x.shape[1:]) for x in parts[0][0]]
    if self._multi_process:
      counts = counts[self._local]
      leaves = [take_rows(x, self._local) for x in leaves]
      owned = True
    return Prepared(treedef, leaves, counts, owned)

  def _set_spec(self, treedef: Any, leaves: list[np.ndarray], k: int) -> None:
    self._spec_tree = treedef
    if self._mesh is None:
      self._spec = jax.tree.unflatten(
          treedef, [jax.ShapeDtypeStruct(x.shape, device_dtype(x)) for x in leaves])
      return
    n, split = self._num_replicas, self._splits[0]
    valid = jax.ShapeDtypeStruct((n,), np.int32, sharding=split)
    self._spec = jax.tree.unflatten(treedef, [
        PerReplica.from_stacked(
            jax.ShapeDtypeStruct((n, k) + x.shape[1:], device_dtype(x), sharding=split), valid)
        for x in leaves])

  def _produce(self, it: Iterator[Any], state: ProduceState) -> tuple[Any, int | None]:
    """The next chunk: ``(batch, None)``, one element ready for `run`, while the consumer takes one batch
    at a time, else ``(stacked, n)``: up to ``k`` batches stacked on a leading steps axis, ending where
    the consumer's groups of ``k`` end (fewer at the end, or when the next batch has other shapes: it
    starts the next chunk). Raises StopIteration at the end. Runs in the prefetch thread.

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
            jax.block_until_ready(state.pending)
            state.pending = None
          first = state.read
          raw, stacked = self._next_raw(it, first)
          state.read += len(raw)
          p = self._prepare(raw, first, stacked=stacked)
        except StopIteration:
          if prepared:
            break
          raise
        except Exception as e:  # pylint: disable=broad-except
          if not prepared:
            raise
          state.error = e
          break
        if p is None:
          continue
        state.positions.append((state.read, None if state.source_state is None else state.source_state()))
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
    leaves, owned = (stacks, True) if steps else (prepared[0].leaves, prepared[0].owned)
    fetch = self._options.experimental_fetch_to_device
    if self._mesh is None:  # default strategy: the batches as they came, without padding
      rows = int(prepared[0].counts[0])
      leaves = [x[:, 0, :rows] if steps else x[0, :rows] for x in leaves]
      if not fetch:
        return jax.tree.unflatten(treedef, leaves)
      arrays = jax.device_put(self._unaliased(leaves, owned, 1))
      if not owned:
        state.pending = arrays
      return jax.tree.unflatten(treedef, arrays)
    counts = np.stack([p.counts for p in prepared]) if steps else prepared[0].counts
    valid = self._valid_array(counts)  # tiny and mostly the same every step: cached on the devices
    host_counts = None
    if self._multi_process:  # a global array needs every process's part: always placed
      arrays = [self._from_local(x, steps) for x in leaves]
    elif fetch:
      arrays = jax.device_put(self._unaliased(leaves, owned, self._num_replicas), self._splits[steps])
      if not owned:
        state.pending = arrays
    else:  # without fetch_to_device the arrays stay on the host; `run` transfers them
      arrays = leaves
    if not steps:
      host_counts = counts.astype(np.int64)
    # Each leaf is its own PerReplica (like `run`'s outputs), so that the batch keeps the user's pytree.
    return jax.tree.unflatten(treedef, [
        PerReplica.from_stacked(x, valid, host_real_rows=host_counts if not self._multi_process else None)
        for x in arrays])

  def _unaliased(self, leaves: list[np.ndarray], owned: bool, parts: int) -> list[np.ndarray]:
    """`leaves`, with those in the source's memory that a transfer would alias (XLA:CPU, aligned)
    copied first."""
    return leaves if owned else [host_memory.unaliased(x, parts, self._alias_align) for x in leaves]

  def _valid_array(self, counts: np.ndarray) -> jax.Array:
    key = (counts.shape, counts.tobytes())
    valid = self._valid_cache.get(key)
    if valid is None:
      if len(self._valid_cache) > 16:
        self._valid_cache.clear()
      if self._multi_process:
        valid = self._from_local(counts, steps=counts.ndim == 2)
      else:
        valid = jax.device_put(counts, self._splits[counts.ndim == 2])
      self._valid_cache[key] = valid
    return valid

  def _from_local(self, local: np.ndarray, steps: bool) -> jax.Array:
    """A global ``[N, ...]`` array from this process's replicas' rows ``[N_local, ...]`` (multi-process);
    with `steps`, ``[steps, N, ...]`` from ``[steps, N_local, ...]``."""
    axis = int(steps)  # the replica axis: the second one of stacked steps

    def part(index: tuple[slice, ...]) -> np.ndarray:
      i = self._local_index[index[axis].start or 0]
      return local[(slice(None),) * axis + (slice(i, i + 1),)]

    shape = local.shape[:axis] + (self._num_replicas,) + local.shape[axis + 1:]
    return jax.make_array_from_callback(shape, self._splits[steps], part)


class Prepared(NamedTuple):
  """One step's batch on the host, ready to be placed."""
  treedef: Any
  leaves: list[np.ndarray]  # [N_local, k, ...] each
  counts: np.ndarray  # [N_local] real rows per replica
  owned: bool  # the leaves are the library's copies (else they may be the source's memory)


def device_dtype(x: np.ndarray) -> np.dtype:
  """The dtype `x` has once on the devices (float64 becomes float32 unless `jax_enable_x64` is set)."""
  return jax.dtypes.canonicalize_dtype(x.dtype)


# -- entry points (called by Strategy) ------------------------------------------------------------


def distribute_dataset(strategy: StrategyLike, dataset: Any,
                       options: InputOptions | None) -> DistributedDataset:
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
