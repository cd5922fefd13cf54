"""Input distribution: TF's distributed datasets, fed from any Python iterable of numpy batches.

`strategy.experimental_distribute_dataset(dataset)` takes global batches (pytrees of arrays with the batch
on the leading axis) from a grain `MapDataset`/`IterDataset`, a list, a generator, a PyTorch-style loader
or a `tf.data.Dataset`, and yields `PerReplica` values ready for `strategy.run`:

* Rows are split in order: with a global batch of ``B`` rows over ``N`` replicas each replica takes the
  next ``k = ceil(B / N)`` rows (replica ``r`` gets rows ``[r*k, (r+1)*k)``).
* XLA compiles static shapes, so every batch keeps the per-replica size ``k`` of the first batch: a
  partial batch is padded at the end (replicas past the real rows hold padding only) and the
  `PerReplica` carries how many rows of each component are real, as a traced int32 input. Full and
  partial batches therefore share one compiled program. Inside `run`, `tpustrat.valid_mask(x)` /
  `tpustrat.num_valid_examples(x)` say which rows are real; per-example outputs of `run` keep the counts,
  so `strategy.reduce`, `strategy.gather` and `experimental_local_results` see only real rows.
* Each global batch goes to the devices with one `jax.device_put` of the ``[N, k, ...]`` host array onto
  ``NamedSharding(mesh, P('replica'))``, in a background thread that keeps a bounded number of batches
  ready on device (`InputOptions`), so host-to-device transfer overlaps the previous steps.
* A source may reuse its buffers (write each batch where the last one was): every step still gets its
  own batch. The source is read again only after the transfers out of its memory have completed, and
  memory that XLA:CPU would alias instead of copying is copied first (see "host memory" below).

`strategy.experimental_distribute_datasets_from_function(dataset_fn)` calls ``dataset_fn(InputContext)``
once per process (one input pipeline per process); the dataset it returns yields per-replica batches,
and each of the process's replicas takes one per step.
"""

from __future__ import annotations

import atexit
import base64
import collections.abc
import dataclasses
import functools
import itertools
import math
import queue
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src import host_memory, multistep
from tpustrat._src.host_memory import host_empty
from tpustrat._src.jax_compat import varying_axes
from tpustrat._src.values import PerReplica

if TYPE_CHECKING:
  from tpustrat._src.strategy import Strategy

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "make_numpy_dataset",
    "num_valid_examples",
    "per_example",
    "valid_mask",
]

_ACCEPTED = ("a grain MapDataset or IterDataset, a list, a generator, a tf.data.Dataset or a "
             "PyTorch-style loader")


# -- options and context --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InputOptions:
  """Options for distributed datasets (TF's `tf.distribute.InputOptions`, plus `drop_remainder`).

  Attributes:
    experimental_fetch_to_device: if True (default), a background thread puts each batch on the devices
      ahead of use. If False, the iterator yields `PerReplica` values over host numpy arrays and
      `strategy.run` transfers them when it is called (in a multi-process job batches are always
      global device arrays).
    experimental_per_replica_buffer_size: how many batches are kept ready on the devices ahead of the
      one being used (each holds one component per replica). Default 1, as in TF. Must be >= 1.
    drop_remainder: if True, a batch with fewer rows than the largest batch read before it is dropped
      instead of padded (with `experimental_distribute_datasets_from_function`: a step in which a
      replica's batch is smaller than the largest per-replica batch so far, or some replica has none).
      For a dataset of equal batches this drops exactly the partial last batch, as TF's
      ``drop_remainder`` does; a first batch smaller than later ones is kept. Default False: every
      example is used.

  All three are checked when the options are made: the two flags must be bools (TypeError) and the
  buffer size an int (TypeError) >= 1 (ValueError).

  >>> InputOptions(experimental_per_replica_buffer_size=2).experimental_fetch_to_device
  True
  """

  experimental_fetch_to_device: bool = True
  experimental_per_replica_buffer_size: int = 1
  drop_remainder: bool = False

  def __post_init__(self) -> None:
    for name in ("experimental_fetch_to_device", "drop_remainder"):
      value = getattr(self, name)
      if not isinstance(value, bool):
        raise TypeError(f"InputOptions.{name} must be a bool, got {type(value).__name__} {value!r}.")
    size = self.experimental_per_replica_buffer_size
    if not isinstance(size, int) or isinstance(size, bool):
      raise TypeError(
          f"InputOptions.experimental_per_replica_buffer_size must be an int >= 1, got {type(size).__name__} "
          f"{size!r}.")
    if size < 1:
      raise ValueError(f"InputOptions.experimental_per_replica_buffer_size must be an int >= 1, got {size!r}.")


class InputContext:
  """What `experimental_distribute_datasets_from_function` tells `dataset_fn` (TF's `InputContext`).

  There is one input pipeline per process: ``num_input_pipelines`` is the number of processes and
  ``input_pipeline_id`` this process's index. Shard the data with them, and batch it with
  `get_per_replica_batch_size`.

  >>> ctx = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)
  >>> ctx.get_per_replica_batch_size(64)
  8
  >>> ctx.get_per_replica_batch_size(60)
  Traceback (most recent call last):
  ...
  ValueError: The `global_batch_size` 60 is not divisible by `num_replicas_in_sync` 8
  """

  __slots__ = ("_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync")

  def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
               num_replicas_in_sync: int = 1) -> None:
    if not 0 <= input_pipeline_id < num_input_pipelines:
      raise ValueError(
          f"input_pipeline_id ({input_pipeline_id}) must be in [0, num_input_pipelines = "
          f"{num_input_pipelines}).")
    self._num_input_pipelines = num_input_pipelines
    self._input_pipeline_id = input_pipeline_id
    self._num_replicas_in_sync = num_replicas_in_sync

  @property
  def num_input_pipelines(self) -> int:
    """The number of input pipelines (one per process)."""
    return self._num_input_pipelines

  @property
  def input_pipeline_id(self) -> int:
    """This pipeline's index in ``[0, num_input_pipelines)``."""
    return self._input_pipeline_id

  @property
  def num_replicas_in_sync(self) -> int:
    """The number of replicas in sync (all processes together)."""
    return self._num_replicas_in_sync

  def get_per_replica_batch_size(self, global_batch_size: int) -> int:
    """Returns ``global_batch_size // num_replicas_in_sync``.

    Raises:
      ValueError: if `global_batch_size` is not divisible by `num_replicas_in_sync`.
    """
    if global_batch_size % self._num_replicas_in_sync != 0:
      raise ValueError(
          f"The `global_batch_size` {global_batch_size!r} is not divisible by `num_replicas_in_sync` "
          f"{self._num_replicas_in_sync!r}")
    return global_batch_size // self._num_replicas_in_sync

  def __repr__(self) -> str:
    return (f"InputContext(num_input_pipelines={self._num_input_pipelines}, input_pipeline_id="
            f"{self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})")


# -- which rows are real (inside `run`) -----------------------------------------------------------


def _first_leaf_rows(x: Any, fn: str) -> int:
  leaves = jax.tree.leaves(x)
  if not leaves or jnp.ndim(leaves[0]) == 0:
    raise ValueError(f"tpustrat.{fn}(x) needs `x` with a batch axis (an array or a batch pytree), got {x!r:.100}.")
  return jnp.shape(leaves[0])[0]


def _real_rows(x: Any, fn: str) -> tuple[int, Any]:
  """(padded batch size, this replica's number of real rows) for batch `x` in the current replica."""
  ctx = context_lib.get_replica_context()
  known = ctx.real_rows
  if x is None:
    sizes = {k for k, _ in known}
    if len(sizes) != 1:
      raise ValueError(
          f"tpustrat.{fn}() without an argument needs exactly one padded batch size among the "
          f"arguments of strategy.run, found {sorted(sizes) or 'none'}; pass the batch (or one of its "
          f"arrays) to tpustrat.{fn}(x).")
    return known[0]
  k = _first_leaf_rows(x, fn)
  for size, count in known:
    if size == k:
      return size, count
  return k, k  # not a padded batch of this step: every row is real


def num_valid_examples(x: Any = None) -> jax.Array:
  """The number of real (not padding) rows of this replica's part of a batch, inside `strategy.run`.

  Batches from a distributed dataset always have the same per-replica size ``k``; the last, partial
  batch is padded at the end. This returns an int32 scalar (traced inside `run`, different on each
  replica): ``k`` for full batches, fewer (possibly 0) for padding.

  Args:
    x: the batch, or any array of it with the batch on its leading axis. May be omitted when `run`
      received exactly one padded batch size. An `x` whose leading size is not that of a padded
      batch of this step counts as all real.

  Outside `run` (or with the default strategy) every row is real:

  >>> int(num_valid_examples(np.zeros((5, 3))))
  5
  """
  k, count = _real_rows(x, "num_valid_examples")
  return jnp.asarray(count, jnp.int32)


def valid_mask(x: Any = None) -> jax.Array:
  """A bool ``[k]`` mask, True for the real rows of this replica's part of a batch (inside `run`).

  Use it to keep padding out of losses and metrics on partial batches, for example
  ``jnp.sum(jnp.where(tpustrat.valid_mask(x), per_example_loss, 0)) / global_batch_size``. The
  library's own `strategy.reduce` / `gather` skip padding along ``axis=0`` of `run`'s outputs, and
  everywhere in outputs marked with `per_example`.

  Args:
    x: as for `num_valid_examples`.

  >>> print(valid_mask(np.zeros((3, 2))))
  [ True  True  True]
  """
  k, count = _real_rows(x, "valid_mask")
  return jnp.arange(k) < count


def per_example(tree: Any) -> Any:
  """Marks arrays returned by a `strategy.run` step as per-example: their rows are the batch's rows.

  A partial global batch reaches the replicas padded to the usual per-replica size ``k``. Returning
  ``tpustrat.per_example(x)`` says that the rows of ``x`` are that batch's examples, so its padding rows
  are skipped wherever the value goes: `experimental_local_results` shows only the real rows,
  `strategy.reduce` leaves padding out along every ``axis`` (``None`` included), `strategy.gather`
  returns only the real rows, and the value enters the next `run` as a padded batch (`valid_mask`
  works on it). Unmarked outputs are kept whole, as the replicas returned them, except where the caller
  says that axis 0 is the batch (``reduce(op, v, axis=0)``, ``gather(v, axis=0)``).

  Args:
    tree: an array or a pytree of arrays computed inside the step; every leaf has the padded batch's
      per-replica size ``k`` on its leading axis and differs between replicas. Mark the arrays that the
      step returns (the mark belongs to the array object: an array computed from a marked one is not
      marked).

  Returns:
    `tree` itself. Outside `run`, and in a step with no padded batch among its arguments, nothing is
    marked (every row is real there).

  Raises:
    ValueError: a leaf is a scalar, has another leading size than the step's padded batches (with
      several padded batches of that size, the first one's counts are used, as for `valid_mask`), or is
      the same on every replica (it cannot hold one replica's examples).

  >>> tree = {"logits": np.zeros((4, 10))}
  >>> tpustrat.per_example(tree) is tree   # outside run: nothing to mark
  True
  """
  ctx = context_lib.get_replica_context()
  known = ctx.real_rows
  if not known:
    return tree
  sizes = [k for k, _ in known]
  axis = ctx._axis_name  # pylint: disable=protected-access
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    where = jax.tree_util.keystr(path) or "<root>"
    if jnp.ndim(x) == 0:
      raise ValueError(f"tpustrat.per_example: the value at {where} is a scalar; a per-example array has the "
                       f"batch on its leading axis (per-replica size {sizes[0]}).")
    k = jnp.shape(x)[0]
    if k not in sizes:
      raise ValueError(
          f"tpustrat.per_example: the array at {where} has leading size {k}, but the padded batches of this "
          f"step have per-replica sizes {sorted(set(sizes))}; only arrays whose rows are a batch's rows "
          "can be marked.")
    if axis is not None and axis not in varying_axes(x):
      raise ValueError(
          f"tpustrat.per_example: the array at {where} is the same on every replica (it does not vary over "
          f"the replica axis {axis!r}), so its rows cannot be one replica's examples. Mark the per-replica "
          "array before it is combined across replicas.")
    ctx.per_example_marks.append((x, sizes.index(k)))
  return tree


# -- reading batches ------------------------------------------------------------------------------


def _iterable(dataset: Any, what: str) -> Any:
  """Checks that `dataset` is an iterable of batches, and unwraps a `tf.data.Dataset` to numpy."""
  tf = sys.modules.get("tensorflow")
  if tf is not None and isinstance(dataset, getattr(getattr(tf, "data", None), "Dataset", ())):
    return _TFNumpy(dataset)
  if isinstance(dataset, (str, bytes)) or not isinstance(dataset, collections.abc.Iterable):
    raise TypeError(
        f"{what} expects a dataset that yields batches ({_ACCEPTED}), got {type(dataset).__name__}: "
        f"{dataset!r:.100}.")
  if isinstance(dataset, collections.abc.Mapping):
    raise TypeError(
        f"{what} got a {type(dataset).__name__} ({dataset!r:.100}): iterating it would give its keys, not "
        "batches. A dict of arrays is one batch: pass a list of batches, or slice examples with "
        "strategy.experimental_make_numpy_dataset(arrays).batch(global_batch_size).")
  return dataset


class _TFNumpy:
  """A `tf.data.Dataset` seen as a re-iterable source of numpy batches."""

  def __init__(self, dataset: Any) -> None:
    self._dataset = dataset

  def __iter__(self) -> Iterator[Any]:
    return iter(self._dataset.as_numpy_iterator())


_OK_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128, jnp.bfloat16))


def _to_numpy(x: Any, where: str) -> np.ndarray:
  if isinstance(x, np.ndarray):
    arr = x
  elif isinstance(x, (jax.Array, np.generic)) or hasattr(x, "__array__"):
    arr = np.asarray(x)  # also torch tensors and tf.Tensors
  else:
    raise TypeError(
        f"{where} is {type(x).__name__} {x!r:.60}, not an array; a batch must be a pytree (dict, tuple, "
        "list, ...) of arrays with the batch on the leading axis.")
  if arr.dtype not in _OK_DTYPES and not (arr.dtype == np.bool_ or jnp.issubdtype(arr.dtype, jnp.number)):
    raise TypeError(
        f"{where} has dtype {arr.dtype}; batches must hold numeric or bool arrays (XLA has no "
        "strings or objects). Encode strings as integer ids in the input pipeline.")
  if arr.ndim == 0:
    raise TypeError(
        f"{where} is a scalar ({arr!r}), not an array with the batch on its leading axis; batch the "
        "dataset first (for example grain's `.batch(global_batch_size)`).")
  return arr


def _flatten_batch(batch: Any, index: int, what: str) -> tuple[list[np.ndarray], Any, int]:
  """Host numpy leaves of one batch, its tree structure and its (common) leading size."""
  leaves, treedef = jax.tree.flatten(batch)
  if leaves and all(type(x) is np.ndarray and x.ndim and x.dtype in _OK_DTYPES for x in leaves):
    sizes = {x.shape[0] for x in leaves}  # the common case: numpy arrays, checked cheaply
    if len(sizes) == 1:
      return leaves, treedef, sizes.pop()
  leaves_with_paths = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves_with_paths:
    raise TypeError(f"{what} {index} ({batch!r:.100}) holds no arrays; a batch must be a pytree of arrays.")
  names = [jax.tree_util.keystr(path) or "<root>" for path, _ in leaves_with_paths]
  leaves = [_to_numpy(x, f"{what} {index}: the leaf at {name}") for name, (_, x) in zip(names, leaves_with_paths)]
  sizes = {x.shape[0] for x in leaves}
  if len(sizes) != 1:
    detail = ", ".join(f"{name}: {x.shape[0]}" for name, x in zip(names, leaves))
    raise ValueError(
        f"{what} {index} has leaves with different leading (batch) sizes ({detail}); every array of a "
        "batch must have the same number of rows on its leading axis.")
  return leaves, treedef, sizes.pop()


# -- host memory: see tpustrat/_src/host_memory.py ------------------------------------------------
#
# A source may reuse its buffers (write batch i+1 where batch i was), and the prefetch thread reads it
# ahead of the steps. So a batch that still lives in the source's memory is never handed to the devices
# where it would be aliased (it is copied first), the source is not read again before the transfers
# out of its memory have completed, and batches held across reads (stacked steps, per-replica
# batches) are copied into library memory as they are read. The library's own arrays (padded, stacked)
# are allocated aligned, so that on XLA:CPU they reach the devices without a second copy.


def _detach(element: Any) -> Any:
  """A raw element with its arrays copied (it is kept while the source is read further): numpy arrays,
  and array-likes that `np.asarray` would read in place (a torch tensor may share the source's buffer
  just as well)."""
  def as_numpy(x: Any) -> Any:  # jax arrays and numpy scalars are immutable: kept as they are
    if hasattr(x, "__array__") and not isinstance(x, (np.ndarray, jax.Array, np.generic)):
      return np.asarray(x)  # a view of its memory, copied next
    return x
  return host_memory.owned_copies(jax.tree.map(as_numpy, element))


# -- background prefetch --------------------------------------------------------------------------

_LIVE_PREFETCHERS: weakref.WeakSet[_Prefetcher] = weakref.WeakSet()
_END, _ITEM, _ERROR = 0, 1, 2


class _Prefetcher:
  """Runs `produce` in a daemon thread, at most `size` results ahead of the consumer.

  A result (or the end, or an error) is produced only into a free slot of the queue, and `get` frees
  one, so at most `size` results exist that the consumer has not taken: none is held back waiting for
  room. The thread holds no reference to the iterator that owns it, so dropping the iterator closes it.
  """

  def __init__(self, produce: Callable[[], Any], size: int) -> None:
    self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=size)
    self._slots = threading.Semaphore(size)  # free places in the queue
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._work, args=(produce,), name="tpustrat-input-prefetch",
                                    daemon=True)
    _LIVE_PREFETCHERS.add(self)
    self._thread.start()

  def _work(self, produce: Callable[[], Any]) -> None:
    kind = _ITEM
    while kind == _ITEM and self._slots.acquire() and not self._stop.is_set():
      try:
        kind, value = _ITEM, produce()
      except StopIteration:
        kind, value = _END, None
      except BaseException as e:  # pylint: disable=broad-except  # re-raised in the consumer's thread
        kind, value = _ERROR, e
      self._queue.put((kind, value))

  def get(self) -> tuple[int, Any]:
    while True:
      try:
        item = self._queue.get(timeout=1.0)
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          return (_END, None)
        continue
      self._slots.release()
      return item

  def close(self) -> None:
    self._stop.set()
    self._slots.release()  # wakes the thread if it waits for a slot

  def join(self, timeout: float) -> None:
    self._thread.join(timeout)

  def is_alive(self) -> bool:
    return self._thread.is_alive()


@atexit.register
def _stop_prefetchers() -> None:
  prefetchers = list(_LIVE_PREFETCHERS)
  for p in prefetchers:
    p.close()
  for p in prefetchers:
    p.join(1.0)


# -- distributed datasets -------------------------------------------------------------------------


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

  def __init__(self, strategy: Strategy, source: Any, options: InputOptions | None, *,
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
    self._live: DistributedIterator | None = None  # a one-shot source's iterator, until it is closed
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
      self._splits = (NamedSharding(mesh, P(mesh.axis_names[0])), NamedSharding(mesh, P(None, mesh.axis_names[0])))
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
    return [_detach(e) if detach else e for e in itertools.islice(it, n)]

  def __iter__(self) -> DistributedIterator:
    live = self._open_iterator()
    if live is not None:  # one-shot source: continue the open iterator (see the class docstring)
      return live
    it: Iterator[Any] = iter(self._source)
    if self._stash:
      it = itertools.chain(self._stash, it)
      self._stash = []
    iterator = DistributedIterator(self, it)
    if self._one_shot:
      self._live = iterator
    return iterator

  def _open_iterator(self) -> DistributedIterator | None:
    """A one-shot source's iterator while it is open (not closed); None otherwise, once the thread of a
    closed one has stopped reading the source."""
    live = self._live
    if live is None:
      return None
    if not live._closed:  # pylint: disable=protected-access
      return live
    live._stop_prefetch("iter()")  # pylint: disable=protected-access
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
        leaves, treedef, rows = _flatten_batch(element, index + j, what)
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
        stack, k = [_pad_rows_per_replica(s, rows) for s in stack], rows
      for s, x in zip(stack, leaves):
        s[j, :rows] = x
        s[j, rows:] = 0
    if not ok or stack is None:
      return raw, None
    for s in stack:
      s[len(raw):] = 0
    return raw, (k, stack)

  def _prepare(self, raw: list[Any], index: int, count_only: bool = False,
               stacked: tuple[int, list[np.ndarray]] | None = None) -> _Prepared | None:
    """Validates and pads one step's raw batch(es), the first being element `index` of the dataset
    (`stacked`: the per-replica batches already stacked by `_read_replicas`). Returns the
    `_Prepared` batch, or None if the batch is partial and `drop_remainder` is set. Sets the element
    spec."""
    what = f"{self._what}: per-replica batch" if self._per_replica else f"{self._what}: batch"
    parts = [_flatten_batch(b, index + i, what) for i, b in enumerate(raw)]
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
        leaves = stacked[1] if stacked[0] == k else [_pad_rows_per_replica(x, k) for x in stacked[1]]
      else:
        leaves = [_stack_padded([p[0][i] for p in parts], n_local, k) for i in range(len(parts[0][0]))]
      return _Prepared(treedef, leaves, counts, True)
    rows = parts[0][2]
    n = self._num_replicas
    counts = np.clip(rows - k * np.arange(n), 0, k).astype(np.int32)
    owned = rows != n * k  # padded: a copy; else the source's memory
    leaves = [_pad_rows(x, n * k).reshape((n, k) + x.shape[1:]) for x in parts[0][0]]
    if self._multi_process:
      counts = counts[self._local]
      leaves = [_take_rows(x, self._local) for x in leaves]
      owned = True
    return _Prepared(treedef, leaves, counts, owned)

  def _set_spec(self, treedef: Any, leaves: list[np.ndarray], k: int) -> None:
    self._spec_tree = treedef
    if self._mesh is None:
      self._spec = jax.tree.unflatten(
          treedef, [jax.ShapeDtypeStruct(x.shape, _device_dtype(x)) for x in leaves])
      return
    n, split = self._num_replicas, self._splits[0]
    valid = jax.ShapeDtypeStruct((n,), np.int32, sharding=split)
    self._spec = jax.tree.unflatten(treedef, [
        PerReplica._wrap(jax.ShapeDtypeStruct((n, k) + x.shape[1:], _device_dtype(x), sharding=split), valid)  # pylint: disable=protected-access
        for x in leaves])

  def _produce(self, it: Iterator[Any], state: _ProduceState) -> tuple[Any, int | None]:
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
    prepared: list[_Prepared] = []
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

  def _stackable(self, a: _Prepared, b: _Prepared) -> bool:
    """Whether two prepared batches have one element shape (a larger later batch grows ``k``; the default
    strategy does not pad partial batches)."""
    if [x.shape for x in a.leaves] != [x.shape for x in b.leaves]:
      return False
    return self._mesh is not None or a.counts[0] == b.counts[0]

  def _place(self, prepared: list[_Prepared], stacks: list[np.ndarray] | None, state: _ProduceState) -> Any:
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
        PerReplica._wrap(x, valid, host_counts if not self._multi_process else None) for x in arrays])  # pylint: disable=protected-access

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


class _Prepared(NamedTuple):
  """One step's batch on the host, ready to be placed."""
  treedef: Any
  leaves: list[np.ndarray]  # [N_local, k, ...] each
  counts: np.ndarray  # [N_local] real rows per replica
  owned: bool  # the leaves are the library's copies (else they may be the source's memory)


def _device_dtype(x: np.ndarray) -> np.dtype:
  """The dtype `x` has once on the devices (float64 becomes float32 unless `jax_enable_x64` is set)."""
  return jax.dtypes.canonicalize_dtype(x.dtype)


def _pad_rows(x: np.ndarray, rows: int) -> np.ndarray:
  if x.shape[0] == rows:
    return x
  out = host_empty((rows,) + x.shape[1:], x.dtype)
  out[:x.shape[0]] = x
  out[x.shape[0]:] = 0
  return out


def _pad_rows_per_replica(x: np.ndarray, k: int) -> np.ndarray:
  """``[n, k, ...]`` from ``[n, k0, ...]`` (k0 <= k), zero-padded."""
  out = host_empty((x.shape[0], k) + x.shape[2:], x.dtype)
  out[:, :x.shape[1]] = x
  out[:, x.shape[1]:] = 0
  return out


def _take_rows(x: np.ndarray, rows: list[int]) -> np.ndarray:
  """``x[rows]``, into library memory."""
  out = host_empty((len(rows),) + x.shape[1:], x.dtype)
  np.take(x, rows, axis=0, out=out)
  return out


def _stack_padded(parts: list[np.ndarray], n: int, k: int) -> np.ndarray:
  """``[n, k, ...]`` from up to `n` per-replica batches of at most `k` rows, zero-padded."""
  out = host_empty((n, k) + parts[0].shape[1:], parts[0].dtype)
  for i, p in enumerate(parts):
    out[i, :p.shape[0]] = p
    out[i, p.shape[0]:] = 0
  out[len(parts):] = 0
  return out


class DistributedIterator:
  """An iterator over a `DistributedDataset` (TF's distributed iterator).

  `next(it)` returns the next batch (a pytree of `PerReplica` values) and raises `StopIteration` at the
  end, every time it is called after that. `take_steps(k)` returns the next ``k`` batches at once,
  stacked for a multi-step program. With `InputOptions.experimental_fetch_to_device` (the default)
  batches are put on the devices by a background thread (started by the first request), at most
  `experimental_per_replica_buffer_size` elements ahead (with `take_steps(k)`, an element is a group of
  ``k`` batches). `close()` stops that thread early (it also stops when the iterator is
  garbage-collected).

  `get_state()` / `set_state(state)` save and restore the position in the data (as grain's iterators
  do; `tpustrat.checkpoint.CheckpointManager` stores it with the model): the position after the last
  batch *handed out*, whatever the prefetch thread has read ahead.
  """

  def __init__(self, dataset: DistributedDataset, it: Iterator[Any]) -> None:
    self._dataset = dataset
    self._done = False
    self._closed = False  # close() was called (a one-shot dataset may then open a new iterator)
    self._error: BaseException | None = None  # raised by the next call (met while filling a group)
    # Elements handed back or read ahead: (batch, None) for one step, (stacked, n) for n stacked steps.
    self._chunks: collections.deque[tuple[Any, int | None]] = collections.deque()
    self._state = _ProduceState(it)  # shared with the producer: it holds no reference to the iterator
    self._handed = 0  # batches handed out so far
    self._position: tuple[int, Any] = (0, None)  # the source after the batches handed out (see _advance)
    self._produce = functools.partial(dataset._produce, it, self._state)  # pylint: disable=protected-access
    # The prefetch thread starts with the first request, once it is known whether the consumer takes one
    # batch or groups of k at a time (so that groups are stacked on the host from the start).
    self._prefetcher: _Prefetcher | None = None

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
    options = self._dataset.options
    if not options.experimental_fetch_to_device:
      try:
        return self._produce()
      except BaseException:
        self._done = True
        raise
    if self._prefetcher is None:
      self._prefetcher = _Prefetcher(self._produce, options.experimental_per_replica_buffer_size)
    kind, value = self._prefetcher.get()
    if kind == _ITEM:
      return value
    self._done = True
    self._prefetcher.close()
    if kind == _ERROR:
      raise value
    raise StopIteration

  def __next__(self) -> Any:
    self._state.grid = (1, 0)
    batch, n = self._next_chunk()
    if n is not None:  # after take_steps: a group read ahead
      batch, *rest = multistep.unstack_steps(batch)
      self._chunks.extendleft((b, None) for b in reversed(rest))
    self._advance(1)
    return batch

  def _advance(self, n: int) -> None:
    """Counts `n` more batches handed out; the source position moves past them."""
    self._handed += n
    for _ in range(n):  # the producer recorded one position per batch, before handing it over
      self._position = self._state.positions.popleft()

  def get_next(self) -> Any:
    """Returns the next element, like `next(iterator)` (TF's `get_next`)."""
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
    k = multistep.check_steps(k, "take_steps", "k")
    self._state.grid = (k, self._handed)  # the producer stacks the next batches k at a time
    parts: list[tuple[Any, int | None]] = []
    have = 0
    while have < k:
      try:
        chunk = self._next_chunk()
      except StopIteration:
        break
      except Exception as e:  # pylint: disable=broad-except
        if not parts:
          raise
        self._error = e  # hand out the steps read so far; raise on the next call
        break
      steps = 1 if chunk[1] is None else chunk[1]
      if parts and not _same_step(parts[0], chunk):
        self._chunks.appendleft(chunk)
        break
      if have + steps > k:  # read ahead with another group size: keep the rest for later
        first, rest = multistep.cut_chunk(chunk[0], k - have)
        self._chunks.appendleft((rest, steps - (k - have)))
        chunk, steps = (first, k - have), k - have
      parts.append(chunk)
      have += steps
    if not parts:
      raise StopIteration
    self._advance(have)
    if len(parts) == 1 and parts[0][1] is not None:
      return parts[0][0]
    return multistep.concat_chunks(parts, "take_steps")

  @property
  def element_spec(self) -> Any:
    """The type of the elements (see `DistributedDataset.element_spec`)."""
    if self._dataset._spec is None and not self._done:  # pylint: disable=protected-access
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
    elements, source = self._position
    encoding = None
    if isinstance(source, bytes):  # grain's DataLoader iterators give bytes
      source, encoding = bytes_to_text(source), "base64"
    return {"format": _STATE_FORMAT, "batches": self._handed, "elements": elements, "source": source,
            "source_encoding": encoding}

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
    self._stop_prefetch("set_state")  # stop reading ahead from the old position
    dataset = self._dataset
    if dataset._one_shot and dataset._live is not self and dataset._open_iterator() is not None:  # pylint: disable=protected-access
      raise RuntimeError(
          "set_state: another iterator is open on this one-shot dataset; call set_state on it (iter() "
          "returns it) or close() it first.")
    it = dataset._resume(elements, source)  # pylint: disable=protected-access
    if dataset._one_shot:  # pylint: disable=protected-access
      dataset._live = self  # pylint: disable=protected-access
    self._chunks.clear()
    self._error = None
    self._done = False
    self._closed = False
    self._state = _ProduceState(it, produced=batches, read=elements)
    self._handed = batches
    self._position = (elements, source)
    self._produce = functools.partial(self._dataset._produce, it, self._state)  # pylint: disable=protected-access

  def _stop_prefetch(self, what: str) -> None:
    """Stops the prefetch thread and waits for it, so that it no longer reads the source, and for the
    transfer out of the source's memory it may have left (the batch handed out last, which the thread
    would have waited for before reading on): the source may be read again after this."""
    if self._prefetcher is None:
      return
    self._prefetcher.close()
    self._prefetcher.join(30.0)
    if self._dataset._one_shot and self._prefetcher.is_alive():  # pylint: disable=protected-access
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


def bytes_to_text(data: bytes) -> str:
  """Bytes (a grain DataLoader iterator's state) as JSON-safe text: standard base64, ASCII."""
  return base64.b64encode(data).decode("ascii")


def text_to_bytes(text: str) -> bytes:
  """The inverse of `bytes_to_text`."""
  return base64.b64decode(text)


def _check_state(state: Any) -> tuple[int, int, Any]:
  """(batches, elements, source state) of a `DistributedIterator.get_state()` dict, validated."""
  if not isinstance(state, collections.abc.Mapping) or state.get("format") != _STATE_FORMAT:
    raise ValueError(
        f"DistributedIterator.set_state expects a state from DistributedIterator.get_state() (a dict with "
        f"format {_STATE_FORMAT!r}), got {state!r:.200}.")
  counts = [state.get("batches"), state.get("elements")]
  if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
    raise ValueError(f"DistributedIterator.set_state: `batches` and `elements` must be ints >= 0, got {counts}.")
  source = state.get("source")
  if state.get("source_encoding") == "base64":
    source = text_to_bytes(source)
  return counts[0], counts[1], source


def _same_step(a: tuple[Any, int | None], b: tuple[Any, int | None]) -> bool:
  """Whether two chunks hold steps of one structure and shape (so that they can be stacked)."""
  (ta, na), (tb, nb) = a, b
  la, da = jax.tree.flatten(ta)
  lb, db = jax.tree.flatten(tb)
  if da != db:
    return False
  return all(np.shape(x)[0 if na is None else 1:] == np.shape(y)[0 if nb is None else 1:] for x, y in zip(la, lb))


class _ProduceState:
  """What the producer of a `DistributedIterator` keeps between elements."""

  __slots__ = ("grid", "produced", "held", "error", "read", "positions", "source_state", "pending")

  def __init__(self, it: Iterator[Any], produced: int = 0, read: int = 0) -> None:
    # Set by the consumer: (1, 0) for one batch at a time, (k, i) for groups of k from batch i on.
    self.grid = (1, produced)
    self.produced = produced  # batches placed so far
    self.held: Any = None  # a prepared batch that did not fit the last group
    self.error: Exception | None = None  # raised after the group that was being filled
    self.read = read  # raw elements read from the source so far
    # Where the source stood after each batch kept, in order: (elements read, source state or None).
    # The consumer pops one per batch it hands out (`DistributedIterator.get_state`).
    self.positions: collections.deque[tuple[int, Any]] = collections.deque()
    get_state = getattr(it, "get_state", None)  # grain iterators: their own, exact, cheap position
    self.source_state: Callable[[], Any] | None = get_state if callable(get_state) else None
    # Device arrays still being copied out of the source's memory: waited for before the next read.
    self.pending: Any = None


# -- entry points (called by Strategy) ------------------------------------------------------------


def distribute_dataset(strategy: Strategy, dataset: Any, options: InputOptions | None) -> DistributedDataset:
  """`Strategy.experimental_distribute_dataset`."""
  what = "experimental_distribute_dataset"
  return DistributedDataset(strategy, _iterable(dataset, what), options, per_replica=False, what=what)


def distribute_datasets_from_function(strategy: Strategy, dataset_fn: Callable[[InputContext], Any],
                                      options: InputOptions | None) -> DistributedDataset:
  """`Strategy.experimental_distribute_datasets_from_function`: one `dataset_fn` call per process."""
  what = "experimental_distribute_datasets_from_function"
  if not callable(dataset_fn):
    raise TypeError(f"{what} expects a callable `dataset_fn(input_context)`, got {dataset_fn!r:.100}.")
  ctx = InputContext(num_input_pipelines=jax.process_count(), input_pipeline_id=jax.process_index(),
                     num_replicas_in_sync=strategy.num_replicas_in_sync)
  dataset = dataset_fn(ctx)
  try:
    source = _iterable(dataset, what)
  except TypeError:
    raise TypeError(
        f"{what}: `dataset_fn` must return a dataset of per-replica batches ({_ACCEPTED}), but it "
        f"returned {type(dataset).__name__}: {dataset!r:.100}.") from None
  return DistributedDataset(strategy, source, options, per_replica=True, what=what)


class _Rows(collections.abc.Sequence):
  """A pytree of arrays seen as a sequence of examples (rows of the leading axis)."""

  def __init__(self, tree: Any, n: int) -> None:
    self._leaves, self._treedef = jax.tree.flatten(tree)
    self._n = n

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i: Any) -> Any:
    if isinstance(i, slice):
      return [self[j] for j in range(*i.indices(self._n))]
    if not -self._n <= i < self._n:
      raise IndexError(f"example {i} out of range for {self._n} examples")
    return jax.tree.unflatten(self._treedef, [x[i] for x in self._leaves])

  def __repr__(self) -> str:
    return f"_Rows({self._n} examples)"


def make_numpy_dataset(numpy_input: Any) -> Any:
  """`Strategy.experimental_make_numpy_dataset`: a grain `MapDataset` over the first axis of the arrays.

  `numpy_input` is an array or a nest (dicts, tuples) of arrays sharing their first dimension; lists are
  stacked into arrays, as in `tf.data`. Batch the result (``.batch(global_batch_size)``) and give it to
  `experimental_distribute_dataset`.

  >>> ds = make_numpy_dataset({"x": np.arange(10.0), "y": np.arange(10) % 2})
  >>> len(ds), int(ds[3]["y"])
  (10, 1)
  >>> [len(b["x"]) for b in ds.batch(4)]
  [4, 4, 2]
  """
  import grain  # pylint: disable=import-outside-toplevel  # imported on first use: it takes ~0.5 s

  tree = jax.tree.map(np.asarray, numpy_input, is_leaf=lambda x: isinstance(x, list))
  leaves_with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not leaves_with_paths:
    raise ValueError(f"experimental_make_numpy_dataset got no arrays in {numpy_input!r:.100}.")
  sizes = {}
  for path, x in leaves_with_paths:
    name = jax.tree_util.keystr(path) or "<root>"
    if x.ndim == 0:
      raise TypeError(
          f"experimental_make_numpy_dataset: the leaf at {name} must be an array with examples on its first "
          f"axis, got the scalar {x!r}.")
    sizes[name] = x.shape[0]
  if len(set(sizes.values())) != 1:
    raise ValueError(
        f"experimental_make_numpy_dataset: the arrays must have the same first dimension (the number of "
        f"examples), got {', '.join(f'{k}: {v}' for k, v in sizes.items())}.")
  if isinstance(tree, np.ndarray):
    return grain.MapDataset.source(tree)
  return grain.MapDataset.source(_Rows(tree, next(iter(sizes.values()))))
