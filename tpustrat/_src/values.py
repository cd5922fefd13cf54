"""Distributed values: `PerReplica` and `Mirrored` as pytrees over global `jax.Array`s.

TF keeps one tensor per device in a tuple. tpustrat keeps one *global* array per leaf instead, so that a
distributed value goes into and out of the compiled SPMD program of `strategy.run` without passing
through the host:

* `PerReplica` holds a pytree whose leaves carry a leading replica axis (component ``r`` of the value is
  ``leaf[r]``), sharded over the strategy mesh's ``'replica'`` axis: each device holds its own component.
* `Mirrored` holds a pytree of ordinary arrays, replicated over the mesh: one full copy per device,
  never stacked.

Both are pytree nodes, so they trace through `jax.jit`, `lax.scan` and friends like any container.
A value split over the replicas, `ShardedVariable`, is in `tpustrat._src.sharded_variable`.

Padded batches: XLA compiles static shapes, so the input pipeline (`tpustrat._src.input`) pads a partial
global batch up to the usual per-replica size ``k``. Such a `PerReplica` also carries the number of real
rows of every component (an int32 array ``[num_replicas]`` sharded like the value, a pytree child so it
enters `strategy.run` as a traced input: full and partial batches share one compiled program). The counts
mean one of two things, and nothing else decides which:

* per-example (a batch from the input pipeline, or an output of `run` marked with `tpustrat.per_example`):
  the rows *are* examples. `values`, `strategy.reduce` (any `axis`) and `strategy.gather` see only the real
  rows, and the value enters the next `run` as a padded batch.
* batch rows (an unmarked output of `run` whose axis 0 the step's program shows to hold a padded batch's
  rows: the labels passed through, logits computed row by row): the counts are used along axis 0 only,
  where TF's replicas would have held fewer rows. `values` (and so `experimental_local_results`) give each
  replica's real rows, as TF's replicas returned only those; ``reduce(op, v, axis=0)`` and
  ``gather(v, axis=0)`` skip the padding rows. ``reduce(op, v, axis=None)`` (an element-wise combination
  of the components, which TF cannot do with components of different sizes) combines the components
  whole, and the value enters the next `run` whole, not as a padded batch.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np

from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.validation import check_fits_32_bits, tree_path

__all__ = ["DistributedValues", "ElementTag", "PerReplica", "Mirrored", "check_components", "host_counts",
           "is_distributed", "mesh_of", "name_replica_axis", "stacked_steps", "unstack_replicas"]


def _device_order(x: jax.Array) -> list[Any]:
  """Addressable shards of `x`, one per device, in the order of the sharding's devices."""
  sharding = x.sharding
  order = {d: i for i, d in enumerate(getattr(sharding, "_device_assignment", ()))}
  return sorted(x.addressable_shards, key=lambda s: order.get(s.device, s.device.id))


class DistributedValues:
  """Base class of values that hold one component per replica (TF's `tf.distribute.DistributedValues`)."""

  # `_children`, `_aux`: what `tree_flatten` returns, kept with the value (never reassigned), so that JAX
  # flattens it through `operator.attrgetter` without a Python call per value (`_FLAT`, below) and
  # `tree_unflatten` keeps the children JAX hands it without making anything but the value.
  __slots__ = ("_value", "_children", "_aux")
  _value: Any
  _children: tuple[Any, ...]
  _aux: Any

  def __init__(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - abstract
    raise TypeError("DistributedValues is abstract: use PerReplica or Mirrored.")

  @classmethod
  def _wrap(cls, value: Any):
    obj = object.__new__(cls)
    obj._value = value
    obj._children, obj._aux = (value,), None
    return obj

  @property
  def tree(self) -> Any:
    """The pytree of global arrays this value holds (internal API): a `PerReplica` leaf has a leading
    replica axis (sharded over it), a `Mirrored` leaf is one replicated array."""
    return self._value

  def map_global(self, fn: Any) -> Any:
    """This value over ``fn(x)`` for every global array ``x`` it holds (real-row counts included), which
    must hold the same data (internal API: a new sharding name, say)."""
    return type(self)._wrap(jax.tree.map(fn, self._value))

  def tree_flatten(self):
    return self._children, self._aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    obj = object.__new__(cls)  # `_wrap`, written out: every `run` result is rebuilt here
    obj._value = children[0]
    obj._children, obj._aux = children, aux
    return obj


class PerReplica(DistributedValues):
  """A value with one (possibly different) component per replica.

  Args:
    values: one component per replica, in replica order; each component is an array or a pytree of
      arrays, and all components must share tree structure, shapes and dtypes (XLA programs have static
      shapes; partial batches are handled by the input pipeline with padding).

  >>> v = PerReplica([np.float32(r) for r in range(8)])
  >>> len(v.values)
  8
  >>> print(np.asarray(v.values[3]))
  3.0

  Inside `strategy.run`, each replica sees only its own component.
  """

  __slots__ = ("_valid", "_host_valid", "_per_example", "_tag")
  _valid: Any
  _host_valid: np.ndarray | None
  _per_example: bool
  _tag: Any

  @classmethod
  def _wrap(cls, value: Any, valid: Any = None, host_valid: np.ndarray | None = None, *,
            per_example: bool = True, tag: Any = None) -> PerReplica:
    """A `PerReplica` over stacked leaves; `valid` ([num_replicas] int) holds the real rows of a padded
    batch: of the value itself (`per_example`), or of the batch of the step that returned it. `tag`: see
    `batch_tag`."""
    obj = object.__new__(cls)
    obj._value = value
    obj._valid = valid
    obj._host_valid = host_valid
    obj._per_example = per_example
    obj._tag = tag
    if valid is None:
      obj._children, obj._aux = (value,), None
    else:
      obj._children, obj._aux = (value, valid), (_PADDED if per_example else _BATCH_ROWS, tag)
    return obj

  def tree_flatten(self):
    return self._children, self._aux

  @classmethod
  def tree_unflatten(cls, aux, children):
    if aux is None:  # `_wrap`, written out: every `run` result is rebuilt here
      obj = object.__new__(cls)
      obj._value = children[0]
      obj._valid = obj._host_valid = obj._tag = None
      obj._per_example = True
      obj._children, obj._aux = children, None
      return obj
    return cls._wrap(children[0], children[1], per_example=aux[0] == _PADDED, tag=aux[1])

  def __init__(self, values: Sequence[Any]) -> None:
    self._valid = self._host_valid = self._tag = None
    self._per_example = True
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
      raise TypeError(
          "PerReplica expects a non-empty sequence with one component per replica, got "
          f"{type(values).__name__}: {values!r:.200}")
    treedef = jax.tree.structure(values[0])
    for r, component in enumerate(values):
      if jax.tree.structure(component) != treedef:
        raise ValueError(
            f"PerReplica component {r} has tree structure {jax.tree.structure(component)}, but "
            f"component 0 has {treedef}; every replica's component must have the same structure.")
    leaves = [jax.tree.leaves(c) for c in values]
    stacked = []
    for i in range(len(leaves[0])):
      parts = [np.asarray(l[i]) if not isinstance(l[i], jax.Array) else l[i] for l in leaves]
      shapes = {tuple(p.shape) for p in parts}
      if len(shapes) != 1:
        raise ValueError(
            f"PerReplica components must have the same shape on every replica (XLA needs static "
            f"shapes), but leaf {i} has shapes {[tuple(p.shape) for p in parts]}.")
      _check_component_dtypes(parts, i, values[0])
      stacked.append(jnp.stack(parts))
    self._value = jax.tree.unflatten(treedef, stacked)
    self._children, self._aux = (self._value,), None

  @property
  def values(self) -> tuple[Any, ...]:
    """The components, one per replica held by this process (TF's `PerReplica.values`).

    Where axis 0 holds a padded batch's rows (a batch itself, a `per_example` output, or an output whose
    rows the step's program traces to a batch; with a `BatchRowsWarning`, the only batch of its size)
    each component holds only its replica's real rows along axis 0, as TF's replica held only those
    (``[0, ...]`` for a replica with none); every other component is whole."""
    leaves, treedef = jax.tree.flatten(self._value)
    if not leaves:
      return ()
    steps = stacked_steps(leaves[0])
    if steps is not None:
      raise ValueError(
          f"{self!r} holds {steps} stacked steps ([steps, num_replicas, ...]), not one value per replica; "
          "tpustrat.unstack_steps(value)[i] is step i as strategy.run returns it.")
    per_leaf = [unstack_replicas(x) for x in leaves]
    if self._valid is not None:  # marked or not, axis 0 holds the batch's rows
      counts = self.host_real_rows()
      per_leaf = [[c if c.shape[0] == counts[r] else c[:counts[r]] for r, c in zip(_replica_ids(x), cs)]
                  for x, cs in zip(leaves, per_leaf)]
    return tuple(jax.tree.unflatten(treedef, list(c)) for c in zip(*per_leaf))

  @classmethod
  def from_stacked(cls, tree: Any, real_rows: Any = None, *, per_example: bool = True,
                   host_real_rows: np.ndarray | None = None, tag: Any = None) -> PerReplica:
    """A `PerReplica` over `tree`, whose leaves carry a leading replica axis (internal API).

    Args:
      tree: the stacked global arrays.
      real_rows: for a padded batch, the real rows of every component (int ``[num_replicas]``).
      per_example: whether the rows are the value's own examples (see the module docstring), or the rows
        of the batch of the step that returned it (used only along axis 0).
      host_real_rows: `real_rows` already on the host, if known.
      tag: the `ElementTag` of an input batch's leaf (see `batch_tag`), or None.
    """
    return cls._wrap(tree, real_rows, host_real_rows, per_example=per_example, tag=tag)

  def map_global(self, fn: Any) -> PerReplica:
    """See `DistributedValues.map_global`; the real-row counts and their meaning are kept."""
    return PerReplica._wrap(jax.tree.map(fn, self._value), None if self._valid is None else fn(self._valid),
                            self._host_valid, per_example=self._per_example, tag=self._tag)

  def _refuse_conversion(self) -> Any:
    raise TypeError(
        f"A PerReplica value ({self!r:.100}) holds one (possibly different) component per replica, so it does "
        "not convert to one array: combine the components with strategy.reduce(op, v, axis=...) or "
        "strategy.gather(v, axis=0), or read them with strategy.experimental_local_results(v).")

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    return self._refuse_conversion()

  def __jax_array__(self) -> Any:
    return self._refuse_conversion()

  def __float__(self) -> float:
    return self._refuse_conversion()

  @property
  def real_rows_array(self) -> Any:
    """The real-row counts this value carries (an int array ``[num_replicas]``), or None (internal API)."""
    return self._valid

  @property
  def batch_tag(self) -> ElementTag | None:
    """For a leaf of a dataset element, its `ElementTag` (internal API); None otherwise.

    Part of the pytree's structure (static), so it survives `jax.jit` and `lax.scan`: `run` takes the
    padded leaves that sit where one element put them, under one element root, as one batch (one set of
    real-row counts), and every other padded value as a batch of its own."""
    return self._tag

  @property
  def padding_is_marked(self) -> bool:
    """Whether this value's rows are examples of a padded batch (an input batch, or an output of `run`
    marked with `tpustrat.per_example`): then every reduction and its local results skip the padding."""
    return self._valid is not None and self._per_example

  def real_rows(self, axis: int | None) -> Any:
    """The per-replica real-row counts (an int array ``[num_replicas]``) that a reduction or gather along
    `axis` of the components must respect, or None when every row counts.

    Marked values skip padding along every axis; an unmarked output of a step on a padded batch only
    along axis 0, which the step's program shows to hold the batch's rows (`values` trims that axis too).
    """
    if self._valid is None or (not self._per_example and axis != 0):
      return None
    dtype = getattr(self._valid, "dtype", None)
    if dtype is None or not np.issubdtype(dtype, np.integer):  # a map over the whole value made them floats
      raise ValueError(_mapped_counts(self, f"of {dtype}", None))
    return self._valid

  def host_real_rows(self) -> np.ndarray:
    """Real rows per replica (host numpy ``[num_replicas]``), fetched once from the devices if needed.

    Fetched counts are checked: integers, between 0 and the rows each replica holds. They are a leaf of the
    value's pytree, so a function mapped over the whole value on the host (``jax.tree.map(lambda a: a / 255,
    batch)``) maps them too, and `gather`, `reduce` and the local results would read the wrong rows."""
    if self._host_valid is None:
      dtype = getattr(self._valid, "dtype", None)
      counts = host_counts(self._valid)
      leaves = jax.tree.leaves(self._value)
      first = leaves[0] if leaves else None
      rows_axis = 2 if first is not None and stacked_steps(first) is not None else 1
      rows = first.shape[rows_axis] if first is not None and np.ndim(first) > rows_axis else None
      if (dtype is None or not np.issubdtype(dtype, np.integer) or (counts < 0).any()
          or (rows is not None and (counts > rows).any())):
        raise ValueError(_mapped_counts(self, f"{counts.tolist()[:16]} of {dtype}", rows))
      self._host_valid = counts
    return self._host_valid

  def __repr__(self) -> str:
    leaves = jax.tree.leaves(self._value)
    if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
      # Not arrays (`jax.tree.map(lambda x: x.shape, value)`, say): show them as they are.
      return f"PerReplica({self._value!r})"
    n = leaves[0].shape[0] if leaves else 0
    steps = stacked_steps(leaves[0]) if leaves else None
    skip = 1 if steps is None else 2  # stacked steps: [steps, num_replicas, ...]
    body = jax.tree.map(lambda x: f"{x.dtype}{list(x.shape[skip:])}", self._value)
    padded = ", padded" if self.padding_is_marked else ", axis 0: a padded batch's rows" if self._valid is not None else ""
    if steps is not None:
      return f"PerReplica(steps={steps}, num_replicas={leaves[0].shape[1]}, component={body}{padded})"
    return f"PerReplica(num_replicas={n}, component={body}{padded})"


class ElementTag(NamedTuple):
  """Where a padded batch leaf sits in its dataset element (`PerReplica.batch_tag`): the key paths of the
  element's leaves and this leaf's index among them. A value, equal for equal structures, so that batches of
  a new dataset of the same kind (a new epoch's) share compiled programs."""

  paths: tuple[tuple[Any, ...], ...]
  position: int  # of this leaf in `paths`
  zero_padded: bool = False  # its padding rows are zeros (`InputOptions.experimental_padding="zeros"`)

  def element_root(self, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The path of the element this leaf belongs to, given the leaf's own `path` in a larger tree (the
    arguments of `run`); None when the leaf is no longer where its element put it."""
    own = self.paths[self.position]
    if len(own) > len(path) or tuple(path[len(path) - len(own):]) != tuple(own):
      return None
    return tuple(path[:len(path) - len(own)])


_PADDED = "padded"  # the counts are the value's own: its rows are examples
_BATCH_ROWS = "batch_rows"  # the counts are its step's batch's: used where axis 0 is said to be the batch


def mesh_of(x: jax.Array) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
  """The mesh of an array laid out over a strategy's mesh (by a `NamedSharding`, as every such array is)."""
  sharding = x.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise TypeError(f"expected an array laid out by a NamedSharding over a mesh, got one laid out by {sharding}.")
  return sharding.mesh


def as_array(x: Any) -> Any:
  """`x` as `jnp.asarray` gives it, except that a numpy value stays on the host (a copy, in the dtype
  `jnp.asarray` gives it: the caller's array may change later) until JAX places it, so no program is
  compiled for it (`jnp.asarray` of a numpy array compiles one per new shape). Python numbers go through
  `jnp.asarray` (which refuses an int that does not fit), as do device arrays and anything else."""
  if (isinstance(x, (np.ndarray, np.generic)) and not isinstance(x, np.ma.MaskedArray)
      and (x.dtype.kind in "biufc" or x.dtype == jnp.bfloat16)):
    return np.array(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype))
  return jnp.asarray(x)


@functools.cache
def _replicator(mesh: jax.sharding.Mesh) -> Any:
  """One jitted copy for each mesh (a new ``jax.jit`` per call would trace and lower on every call)."""
  return jax.jit(lambda v: v, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def replicated(x: jax.Array) -> jax.Array:
  """`x`, an array laid out over a strategy's mesh, copied whole onto every device of that mesh."""
  return _replicator(mesh_of(x))(x)


def _mapped_counts(value: PerReplica, counts: str, rows: int | None) -> str:
  """The error for a padded value whose real-row counts a map over the whole value changed."""
  held = f"the {rows} rows each replica holds" if rows is not None else "the rows each replica holds"
  return (f"{value!r:.200} carries real-row counts {counts}, not integers between 0 and {held}: a function "
          "mapped over the whole value (jax.tree.map(f, batch)) maps them as well, since they are a leaf of its "
          "pytree. Transform the arrays inside the step function, or in the dataset before it is distributed "
          "(dataset.map).")


def host_counts(valid: Any) -> np.ndarray:
  """The per-replica real-row counts of a padded `PerReplica` as a host numpy int array."""
  if isinstance(valid, jax.Array) and not valid.is_fully_addressable:
    valid = replicated(valid)
  return np.asarray(valid).astype(np.int64).reshape(-1)


def _replica_leaders(sharding: Any) -> set[Any] | None:
  """The first device of each replica of a strategy mesh (``'replica'`` first, then logical-core axes),
  so that a replicated value yields one copy per replica, not one per core; None if every device leads."""
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.devices.ndim < 2 or REPLICA_AXIS not in mesh.axis_names:
    return None
  axis = mesh.axis_names.index(REPLICA_AXIS)
  return set(np.moveaxis(mesh.devices, axis, 0).reshape(mesh.devices.shape[axis], -1)[:, 0].tolist())


def _replica_shards(x: Any) -> list[tuple[int, Any]] | None:
  """(replica id, shard) for each replica of a stacked leaf that this process holds, in replica order.

  One shard per replica even when a replica spans several devices (logical cores). None when `x` is not
  split one component per shard (a tracer, or a host or single-device stack).
  """
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return None
  shards = x.addressable_shards
  if not shards:
    return []  # a process that holds none of the replicas: no local components
  if any(s.data.shape != (1,) + x.shape[1:] for s in shards):  # also: not split over cores
    return None
  first: dict[int, Any] = {}
  for shard in _device_order(x):
    first.setdefault(shard.index[0].start or 0, shard)
  return sorted(first.items(), key=lambda item: item[0])


def _replica_ids(x: Any) -> list[int]:
  """The replica index of each component `unstack_replicas(x)` returns, in the same order."""
  held = _replica_shards(x)
  return [r for r, _ in held] if held is not None else list(range(x.shape[0]))


@functools.lru_cache(maxsize=64)
def _merge_leading_axes(devices: tuple[Any, ...]) -> tuple[jax.sharding.NamedSharding, Any]:
  """For the replicas on `devices` (one each, in replica order): their sharding over a mesh of just those
  devices, and one program that merges a stacked leaf's two leading axes, ``[n, d0, ...] -> [n * d0, ...]``
  with axis 0 split over the same devices. Each device's block of the result is its component, computed
  where it lies (a bitcast: nothing moves between devices)."""
  sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(devices, dtype=object), ("components",)),
                                        jax.sharding.PartitionSpec("components"))

  def merge(x: jax.Array) -> jax.Array:
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

  return sharding, jax.jit(merge, out_shardings=sharding)


def unstack_replicas(x: Any) -> list[Any]:
  """The per-replica components of a stacked leaf held by this process, each on its own device.

  A component of at least one axis comes out of one compiled program for all of this process's replicas
  (compiled once per shape, dtype and set of devices): reshaping each device's ``[1, ...]`` block by itself
  would compile one program per device. Scalars, whose blocks cannot be split that way, are reshaped on
  each device (one program per device and dtype)."""
  held = _replica_shards(x)
  if held is None:
    return [x[i] for i in range(x.shape[0])]
  if len(x.shape) < 2 or not held or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    return [s.data.reshape(s.data.shape[1:]) for _, s in held]
  devices = tuple(s.device for _, s in held)
  sharding, merge = _merge_leading_axes(devices)
  local = jax.make_array_from_single_device_arrays((len(held),) + x.shape[1:], sharding, [s.data for _, s in held])
  blocks = {s.device: s.data for s in merge(local).addressable_shards}
  return [blocks[d] for d in devices]


class Mirrored(DistributedValues):
  """A value that is identical on every replica, stored once per device with a replicated sharding.

  `strategy.run` returns `Mirrored` for every output that JAX's varying-axis analysis proves identical
  across replicas (for example after `ReplicaContext.all_reduce`).

  Args:
    values: TF's constructor takes one (identical) value per replica; one copy is kept. Components that
      differ in structure, shape, dtype or (for values on the host or devices, not traced) in value raise
      `ValueError`: a mirrored value is the same on every replica. A single non-sequence value is
      accepted too.

  >>> Mirrored([np.float32(2.0)] * 8).values[0]
  np.float32(2.0)
  """

  __slots__ = ()

  @classmethod
  def from_global(cls, tree: Any) -> Mirrored:
    """A `Mirrored` over `tree`, a pytree of replicated global arrays (internal API)."""
    return cls._wrap(tree)

  def __init__(self, values: Any) -> None:
    if isinstance(values, (list, tuple)) and values and not hasattr(values, "_fields"):
      value = values[0]
      _check_identical(values)
    else:
      value = values
    self._value = value
    self._children, self._aux = (value,), None

  @property
  def values(self) -> tuple[Any, ...]:
    """One copy per replica held by this process (one in all if no leaf is a device array)."""
    leaves, treedef = jax.tree.flatten(self._value)
    if not leaves:
      return (self._value,)
    per_leaf = []
    for x in leaves:
      if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        if not x.sharding.is_fully_replicated and isinstance(x.sharding, jax.sharding.NamedSharding):
          # split across a replica's logical cores (as `run` may return it): whole copies first
          x = replicated(x)
        leaders = _replica_leaders(x.sharding)
        per_leaf.append([s.data for s in _device_order(x) if leaders is None or s.device in leaders])
      else:
        per_leaf.append([x])
    n = max(len(p) for p in per_leaf)  # a leaf held once (a host value) is the same on every replica
    return tuple(jax.tree.unflatten(treedef, [p[i] if len(p) > 1 else p[0] for p in per_leaf])
                 for i in range(n))

  # -- conversion: a Mirrored of one array converts like that array (TF's Mirrored converts to its value) --

  def _array(self, what: str) -> Any:
    """The one array this value holds (a replicated global array, a host value or a tracer); a TypeError
    naming `what` where it holds a pytree of several leaves (convert those one by one)."""
    leaves, treedef = jax.tree.flatten(self._value)
    if treedef.num_leaves != 1 or treedef.num_nodes != 1:
      raise TypeError(
          f"{what}: this Mirrored holds a pytree ({treedef}), not one array; convert its leaves, e.g. "
          "jax.tree.map(np.asarray, m.values[0]), or read it with strategy.experimental_local_results(m)[0].")
    return leaves[0]

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    """``np.asarray(m)``: the value (one copy, on the host)."""
    out = np.asarray(jax.device_get(self._array("np.asarray(Mirrored)")))
    return out if dtype is None else out.astype(dtype, copy=False)

  def __jax_array__(self) -> Any:
    """``jnp.asarray(m)``: the value as a `jax.Array`, replicated on the devices it is on (no copy)."""
    x = self._array("jnp.asarray(Mirrored)")
    return x if isinstance(x, jax.Array) else jnp.asarray(x)

  @property
  def shape(self) -> tuple[int, ...]:
    """The value's shape (a Mirrored of one array)."""
    return tuple(np.shape(self._array("Mirrored.shape")))

  @property
  def dtype(self) -> Any:
    """The value's dtype (a Mirrored of one array)."""
    return jnp.result_type(self._array("Mirrored.dtype"))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  def __float__(self) -> float:
    return float(np.asarray(self))

  def __int__(self) -> int:
    return int(np.asarray(self))

  def __complex__(self) -> complex:
    return complex(np.asarray(self))

  def __bool__(self) -> bool:
    return bool(np.asarray(self))

  def __index__(self) -> int:
    return operator.index(np.asarray(self)[()])

  def __format__(self, spec: str) -> str:
    """``f"{m:.4f}"``: the value formatted (a scalar as a Python number; no spec: its repr)."""
    if not spec:
      return repr(self)
    value = np.asarray(self)
    return format(value.item() if value.ndim == 0 else value, spec)

  def __repr__(self) -> str:
    leaves = jax.tree.leaves(self._value)
    if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
      return f"Mirrored({self._value!r})"  # not arrays (`jax.tree.map(lambda x: x.shape, value)`, say)
    body = jax.tree.map(lambda x: f"{jnp.result_type(x)}{list(np.shape(x))}", self._value)
    return f"Mirrored({body})"


def _check_component_dtypes(parts: Sequence[Any], i: int, first: Any) -> None:
  """Raises unless the components of leaf `i` of a `PerReplica` (`parts`, one per replica; `first` is
  component 0, for the leaf's path) share one dtype as JAX places them (so `jnp.stack` promotes nothing),
  and, for host int64 / uint64 components without ``jax_enable_x64``, fit the 32 bits JAX narrows them to.

  The dtypes compared are those the devices get: without ``jax_enable_x64`` a float64 component is float32
  (as in JAX), so float64 and float32 components agree there.

  Raises:
    ValueError: components of different dtypes, naming them, their dtypes and the leaf's path.
    OverflowError: a 64-bit integer that would wrap (`validation.check_fits_32_bits`).
  """
  dtypes = [jax.dtypes.canonicalize_dtype(p.dtype) for p in parts]
  if any(d != dtypes[0] for d in dtypes):
    by_dtype: dict[Any, list[int]] = {}
    for r, d in enumerate(dtypes):
      by_dtype.setdefault(d, []).append(r)
    detail = "; ".join(f"{d.name} in component{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs[:8]))}"
                       f"{', ...' if len(rs) > 8 else ''}" for d, rs in by_dtype.items())
    raise ValueError(
        f"PerReplica components must share one dtype (XLA programs have one dtype per value; tpustrat "
        f"does not promote them), but the leaf at {_leaf_path(first, i)} is {detail}. Cast the components "
        "to one dtype first.")
  for r, p in enumerate(parts):
    if isinstance(p, (np.ndarray, np.generic)):
      def where(r: int = r) -> str:
        return f"PerReplica: component {r}, the leaf at {_leaf_path(first, i)},"

      check_fits_32_bits(p, where)


def _leaf_path(tree: Any, i: int) -> str:
  """The path of leaf `i` of `tree`, for error messages."""
  return tree_path(jax.tree_util.tree_flatten_with_path(tree)[0][i][0]) or "<root>"


def _check_identical(components: Sequence[Any]) -> None:
  """Raises `ValueError` unless every component of a `Mirrored` equals the first (when concrete)."""
  leaves0, treedef = jax.tree.flatten(components[0])
  for r, component in enumerate(components[1:], start=1):
    leaves, tree = jax.tree.flatten(component)
    if tree != treedef:
      raise ValueError(f"Mirrored: component {r} has tree structure {tree}, but component 0 has {treedef}; "
                       "a mirrored value is the same on every replica.")
    for i, (a, b) in enumerate(zip(leaves0, leaves)):
      if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
        raise ValueError(
            f"Mirrored: component {r} (leaf {i}) is {jnp.result_type(b)}{list(np.shape(b))}, but component 0 "
            f"is {jnp.result_type(a)}{list(np.shape(a))}; a mirrored value is the same on every replica.")
      if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        continue  # traced: the values are not known here
      if not np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True):
        raise ValueError(
            f"Mirrored: component {r} (leaf {i}) differs from component 0; a mirrored value is the same on "
            "every replica. Use PerReplica for values that differ between replicas.")


def stacked_steps(x: Any) -> int | None:
  """The number of steps if `x` is a `PerReplica` leaf holding stacked steps, else None.

  Stacked steps (`tpustrat.stack_steps`, `DistributedIterator.take_steps`, the per-step outputs of
  `experimental_run_steps`) are ``[steps, num_replicas, ...]`` arrays split over their second axis; a
  one-step leaf is split over its first. Only concrete arrays can be told apart; tracers give None.

  On a mesh whose ``'replica'`` axis has one device (a strategy with one replica) a spec that names it
  describes no layout, and the arrays a compiled program returns do not keep it: JAX names an output
  after the first input of the same rank, or after no axis at all (``P()``). There the shapes decide
  wherever they can, since one step is ``[1, ...]`` and stacked steps are ``[steps, 1, ...]``; the spec
  only tells ``[1, 1, ...]`` apart, as tpustrat names it on what it returns (`name_replica_axis`).
  """
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer) or x.ndim < 2:
    return None
  spec = getattr(x.sharding, "spec", None)
  if spec is None:
    return None
  if _lone_replica(x.sharding) and x.shape[:2] != (1, 1):
    return int(x.shape[0]) if x.shape[1] == 1 else None
  if len(spec) < 2 or spec[0] is not None or spec[1] is None:
    return None
  return int(x.shape[0])


def check_components(x: Any, num_replicas: int, what: str) -> None:
  """Raises `ValueError` unless the stacked `PerReplica` leaf `x` has one component per replica.

  `what` names the value in the message, e.g. ``"strategy.run: a PerReplica argument"``.
  """
  if np.ndim(x) == 0 or np.shape(x)[0] != num_replicas:
    got = np.shape(x)[0] if np.ndim(x) else "no"
    raise ValueError(
        f"{what} has {got} components, but the strategy has {num_replicas} replicas "
        "(num_replicas_in_sync); give one component per replica.")




def _lone_replica(sharding: Any) -> TypeGuard[jax.sharding.NamedSharding]:
  """Whether `sharding` lies on a strategy mesh whose ``'replica'`` axis has a single device."""
  return (isinstance(sharding, jax.sharding.NamedSharding) and REPLICA_AXIS in sharding.mesh.axis_names
          and sharding.mesh.shape[REPLICA_AXIS] == 1)


def _without_replica(entry: Any) -> Any:
  """A `PartitionSpec` entry with the ``'replica'`` axis taken out."""
  if entry == REPLICA_AXIS:
    return None
  if isinstance(entry, tuple) and REPLICA_AXIS in entry:
    rest = tuple(a for a in entry if a != REPLICA_AXIS)
    return None if not rest else rest[0] if len(rest) == 1 else rest
  return entry


def _name_replica(x: Any, dim: int | None) -> Any:
  """`x` with its sharding naming ``'replica'`` on axis `dim` alone (nowhere for None), if its mesh's
  replica axis has one device; the same buffers, only the name changes (both shardings are equivalent)."""
  if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
    return x
  sharding = x.sharding
  if not _lone_replica(sharding) or (dim is not None and x.ndim <= dim):
    return x
  target = _replica_named(sharding, x.ndim, dim)
  if target is sharding:
    return x
  return jax.make_array_from_single_device_arrays(x.shape, target, [s.data for s in x.addressable_shards])


@functools.lru_cache(maxsize=256)
def _replica_named(sharding: jax.sharding.NamedSharding, ndim: int, dim: int | None) -> jax.sharding.NamedSharding:
  """`sharding` of an array of rank `ndim` with ``'replica'`` named on axis `dim` alone (nowhere for
  None); `sharding` itself where that changes nothing. Cached: `run_steps` renames its outputs on every
  call on one replica, and building and comparing the shardings cost more than the renaming."""
  spec = [_without_replica(e) for e in sharding.spec] + [None] * (ndim - len(sharding.spec))
  if dim is not None:
    if spec[dim] is not None:  # another axis there (a logical-core split): leave the name as it is
      return sharding
    spec[dim] = REPLICA_AXIS
  while spec and spec[-1] is None:
    spec.pop()
  target = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec),
                                      memory_kind=sharding.memory_kind)
  return sharding if target == sharding else target


def name_replica_axis(tree: Any, steps: bool) -> Any:
  """`tree` with the ``'replica'`` axis named in the sharding of its distributed values as their layout
  says: on the leading axis of every `PerReplica` array and its real-row counts (on the second with
  `steps`: stacked steps ``[steps, num_replicas, ...]``), on no axis of a `Mirrored` array.

  Only arrays on a mesh whose replica axis has one device change (there compiled programs return them
  without the name, or with another input's: see `stacked_steps`), and only in name: the data is not
  moved. Called on what tpustrat's own programs over stacked steps return, so that one step and stacked
  steps stay apart on one replica as they do on many.
  """
  if not any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and _lone_replica(x.sharding)
             for x in jax.tree.leaves(tree)):
    return tree  # the usual case: nothing to rename
  dim = 1 if steps else 0

  def one(node: Any) -> Any:
    if isinstance(node, PerReplica):
      return node.map_global(lambda x: _name_replica(x, dim))
    if isinstance(node, Mirrored):
      return node.map_global(lambda x: _name_replica(x, None))
    return node

  return jax.tree.map(one, tree, is_leaf=is_distributed)


def is_distributed(x: Any) -> bool:
  """Whether `x` is a `PerReplica` or `Mirrored` value (used as `is_leaf` in tree maps)."""
  return isinstance(x, DistributedValues)


# JAX flattens a `PerReplica` / `Mirrored` by reading its `_children` and `_aux` (`operator.attrgetter`,
# called by JAX's C++ pytree code without a Python frame): `run` flattens every argument and rebuilds every
# result each call, one node per leaf of a model's state.
_FLAT = operator.attrgetter("_children", "_aux")
for _cls in (PerReplica, Mirrored):
  jax.tree_util.register_pytree_node(_cls, _FLAT, _cls.tree_unflatten)
del _cls
