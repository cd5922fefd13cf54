"""Sources of batches: what `experimental_distribute_dataset` accepts, and how one batch is read from it.

* `iterable(dataset, what)` checks that a dataset yields batches (a grain `MapDataset`/`IterDataset`, a
  list, a generator, a PyTorch-style loader) and unwraps a `tf.data.Dataset` to numpy; `ACCEPTED` says
  what is accepted, for error messages.
* `flatten_batch(batch, index, what)` checks one batch and gives its host numpy leaves, tree structure
  and (common) leading size.
* `detached_copy(element)` copies an element out of the source's memory (a source may reuse its buffers).
* `make_numpy_dataset(arrays)` is `strategy.experimental_make_numpy_dataset`: a grain `MapDataset` over
  the examples of in-memory arrays.
* `batched_examples(dataset)` sees a grain ``MapDataset.batch(B)`` as its examples (`BatchedExamples`), so
  that a process of a multi-process job can read only the rows of its own replicas; `index_iterator`
  iterates such per-batch reads with grain's own reader threads and position.
"""

from __future__ import annotations

import collections.abc
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from tpustrat._src import host_memory
from tpustrat._src.validation import check_fits_32_bits, tree_path

__all__ = ["ACCEPTED", "OK_DTYPES", "BatchedExamples", "batched_examples", "check_narrowing", "detached_copy",
           "flatten_batch", "index_iterator", "iterable", "make_numpy_dataset", "wide_leaves"]

ACCEPTED = ("a grain MapDataset or IterDataset, a list, a generator, a tf.data.Dataset or a "
            "PyTorch-style loader")


def iterable(dataset: Any, what: str) -> Any:
  """Checks that `dataset` is an iterable of batches, and unwraps a `tf.data.Dataset` to numpy."""
  tf = sys.modules.get("tensorflow")
  if tf is not None and isinstance(dataset, getattr(getattr(tf, "data", None), "Dataset", ())):
    return _TFNumpy(dataset)
  if isinstance(dataset, (str, bytes)) or not isinstance(dataset, collections.abc.Iterable):
    raise TypeError(
        f"{what} expects a dataset that yields batches ({ACCEPTED}), got {type(dataset).__name__}: "
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


OK_DTYPES = frozenset(np.dtype(t) for t in (
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
  if arr.dtype not in OK_DTYPES and not (arr.dtype == np.bool_ or jnp.issubdtype(arr.dtype, jnp.number)):
    raise TypeError(
        f"{where} has dtype {arr.dtype}; batches must hold numeric or bool arrays (XLA has no "
        "strings or objects). Encode strings as integer ids in the input pipeline.")
  if arr.ndim == 0:
    raise TypeError(
        f"{where} is a scalar ({arr!r}), not an array with the batch on its leading axis; batch the "
        "dataset first (for example grain's `.batch(global_batch_size)`).")
  return arr


def flatten_batch(batch: Any, index: int, what: str) -> tuple[list[np.ndarray], Any, int]:
  """Host numpy leaves of one batch, its tree structure and its (common) leading size."""
  leaves, treedef = jax.tree.flatten(batch)
  if leaves and all(type(x) is np.ndarray and x.ndim and x.dtype in OK_DTYPES for x in leaves):
    sizes = {x.shape[0] for x in leaves}  # the common case: numpy arrays, checked cheaply
    if len(sizes) == 1:
      check_narrowing(leaves, batch, index, what)
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
  check_narrowing(leaves, batch, index, what)
  return leaves, treedef, sizes.pop()


_WIDE_INTS = frozenset((np.dtype(np.int64), np.dtype(np.uint64)))


def wide_leaves(leaves: list[np.ndarray]) -> tuple[int, ...]:
  """The indices of the int64 / uint64 leaves: the only ones whose values `check_narrowing` reads."""
  return tuple(i for i, x in enumerate(leaves) if x.dtype in _WIDE_INTS)


def check_narrowing(leaves: list[np.ndarray], batch: Any, index: int, what: str,
                    wide: tuple[int, ...] | None = None) -> None:
  """Raises `OverflowError` (before the batch is padded or transferred) if a 64-bit integer leaf holds a
  value that JAX, without ``jax_enable_x64``, would wrap into 32 bits; see `validation.check_fits_32_bits`.
  A dtype test per leaf (none with `wide`, the `wide_leaves` of a batch of the same dtypes); a min and max
  only over int64 / uint64 leaves."""
  for i in range(len(leaves)) if wide is None else wide:
    x = leaves[i]
    if x.dtype in _WIDE_INTS:
      def where(i: int = i) -> str:
        return f"{what} {index}: the leaf at {_leaf_path(batch, i)}"

      check_fits_32_bits(x, where)


def _leaf_path(batch: Any, i: int) -> str:
  """The path of leaf `i` of `batch` (for error messages)."""
  path = jax.tree_util.tree_flatten_with_path(batch)[0][i][0]
  return tree_path(path) or "<root>"


# -- host memory: see tpustrat/_src/host_memory.py ------------------------------------------------
#
# A source may reuse its buffers (write batch i+1 where batch i was), and the prefetch thread reads it
# ahead of the steps. So a batch that still lives in the source's memory is never handed to the devices
# where it would be aliased (it is copied first), the source is not read again before the transfers
# out of its memory have completed, and batches held across reads (stacked steps, per-replica
# batches) are copied into library memory as they are read. The library's own arrays (padded, stacked)
# are allocated aligned, so that on XLA:CPU they reach the devices without a second copy.


def detached_copy(element: Any) -> Any:
  """A raw element with its arrays copied (it is kept while the source is read further): numpy arrays,
  and array-likes that `np.asarray` would read in place (a torch tensor may share the source's buffer
  just as well)."""
  def as_numpy(x: Any) -> Any:  # jax arrays and numpy scalars are immutable: kept as they are
    if hasattr(x, "__array__") and not isinstance(x, (np.ndarray, jax.Array, np.generic)):
      return np.asarray(x)  # a view of its memory, copied next
    return x
  return host_memory.owned_copies(jax.tree.map(as_numpy, element))


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


# -- a batched grain MapDataset seen as its examples ----------------------------------------------
#
# In a multi-process job each process needs only the rows of its own replicas. A grain
# ``MapDataset.batch(B)`` is random access over examples: batch i is examples [i*B, min((i+1)*B, n)) of
# its parent, stacked. So a process can read just its replicas' examples of batch i and stack them
# itself, instead of materialising the whole global batch. Recognised here: exactly grain's
# `BatchMapDataset` (written for grain 0.2.18: the ``parents`` property, and the attributes ``_batch_size``,
# ``_drop_remainder`` and ``_batch_fn``) with its default stacking `batch_fn`; a custom `batch_fn` (it may
# pad or mix rows), a transformation after ``batch`` (``.map``, ``.slice``, ``.repeat``, ...), an
# IterDataset and every other source are read whole, as before.


class BatchedExamples(NamedTuple):
  """A grain ``MapDataset.batch(batch_size)``: batch ``i`` is examples ``[i*B, min((i+1)*B, n))``."""

  examples: Any  # the parent MapDataset (random access: examples[j])
  batch_size: int
  num_batches: int  # len() of the batched dataset (grain's drop_remainder already applied)
  num_examples: int
  stack: Callable[[Sequence[Any]], Any]  # grain's batch_fn: examples -> a batch (rows stacked)

  def rows(self, index: int) -> int:
    """The number of rows of batch `index`."""
    return max(0, min(self.batch_size, self.num_examples - index * self.batch_size))

  def read(self, index: int, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` of batch `index` as one batch (examples read: those rows only)."""
    first = index * self.batch_size
    return self.stack([self.examples[first + j] for j in range(start, stop)])


def batched_examples(dataset: Any) -> BatchedExamples | None:
  """`dataset` as a `BatchedExamples` if it is grain's ``MapDataset.batch(B)`` with the default `batch_fn`;
  None for anything else (see above)."""
  if "grain" not in sys.modules:
    return None
  try:  # pylint: disable=import-outside-toplevel  # grain is already loaded when the source is grain's
    from grain._src.python.dataset.transformations import batch as grain_batch
  except ImportError:
    return None
  if type(dataset) is not getattr(grain_batch, "BatchMapDataset", None):
    return None
  size = getattr(dataset, "_batch_size", None)
  drop = getattr(dataset, "_drop_remainder", None)
  stack: Callable[[Sequence[Any]], Any] | None = getattr(dataset, "_batch_fn", None)
  parents: Sequence[Any] = getattr(dataset, "parents", ())
  if (stack is not getattr(grain_batch, "make_batch", None) or stack is None or type(size) is not int
      or size < 1 or not isinstance(drop, bool) or len(parents) != 1):
    return None
  try:
    n, batches = len(parents[0]), len(dataset)
  except TypeError:
    return None
  if batches != (n // size if drop else math.ceil(n / size)):  # not the layout this module assumes
    return None
  return BatchedExamples(parents[0], size, batches, n, stack)


class PositionedIterator(Protocol):
  """An iterator with a position it can give and go back to (grain's `DatasetIterator`)."""

  def __iter__(self) -> Iterator[Any]: ...

  def __next__(self) -> Any: ...

  def get_state(self) -> Any: ...

  def set_state(self, state: Any) -> None: ...


def index_iterator(num_batches: int, read: Callable[[int], Any]) -> PositionedIterator:
  """An iterator over ``read(0), read(1), ..., read(num_batches - 1)``, computed ahead by grain's reader
  threads as iterating a grain MapDataset is, with its position as that iterator's (``{"next_index": i}``,
  `set_state` included): so positions carry over between this and a plain pass over the batched
  dataset."""
  import grain  # pylint: disable=import-outside-toplevel  # loaded: the source is a grain dataset

  return iter(grain.MapDataset.range(num_batches).map(read))
