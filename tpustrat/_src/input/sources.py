"""Sources of batches: what `experimental_distribute_dataset` accepts, and how one batch is read from it.

* `iterable(dataset, what)` checks that a dataset yields batches (a grain `MapDataset`/`IterDataset`, a
  list, a generator, a PyTorch-style loader) and unwraps a `tf.data.Dataset` to numpy; `ACCEPTED` says
  what is accepted, for error messages.
* `flatten_batch(batch, index, what)` checks one batch and gives its host numpy leaves, tree structure
  and (common) leading size.
* `detached_copy(element)` copies an element out of the source's memory (a source may reuse its buffers).
* `make_numpy_dataset(arrays)` is `strategy.experimental_make_numpy_dataset`: a grain `MapDataset` over
  the examples of in-memory arrays.
"""

from __future__ import annotations

import collections.abc
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpustrat._src import host_memory

__all__ = ["ACCEPTED", "OK_DTYPES", "detached_copy", "flatten_batch", "iterable", "make_numpy_dataset"]

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
