"""Distributed values: `PerReplica` and `Mirrored` as pytrees over global `jax.Array`s.

TF keeps one tensor per device in a tuple. tpustrat keeps one *global* array per leaf instead, so that a
distributed value goes into and out of the compiled SPMD program of `strategy.run` without passing
through the host:

* `PerReplica` holds a pytree whose leaves carry a leading replica axis (component ``r`` of the value is
  ``leaf[r]``), sharded over the strategy mesh's ``'replica'`` axis: each device holds its own component.
* `Mirrored` holds a pytree of ordinary arrays, replicated over the mesh: one full copy per device,
  never stacked.

Both are pytree nodes, so they trace through `jax.jit`, `lax.scan` and friends like any container.

Padded batches: XLA compiles static shapes, so the input pipeline (`tpustrat._src.input`) pads a partial
global batch up to the usual per-replica size ``k``. Such a `PerReplica` also carries the number of real
rows of every component (an int32 array ``[num_replicas]`` sharded like the value, a pytree child so it
enters `strategy.run` as a traced input: full and partial batches share one compiled program). The counts
mean one of two things, and nothing else decides which:

* per-example (a batch from the input pipeline, or an output of `run` marked with `tpustrat.per_example`):
  the rows *are* examples. `values`, `strategy.reduce` (any `axis`) and `strategy.gather` see only the real
  rows, and the value enters the next `run` as a padded batch.
* batch rows (an unmarked output of `run` whose axis 0 the step's program shows to hold a padded batch's
  rows): the counts are used only where the caller says that axis 0 is the batch, with
  ``reduce(op, v, axis=0)`` or ``gather(v, axis=0)``. Everywhere else the components are whole, as the
  replicas returned them.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeGuard

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.validation import check_fits_32_bits, tree_path

__all__ = ["DistributedValues", "ElementTag", "Groups", "LocalShard", "PerReplica", "Mirrored", "ShardedVariable",
           "block_size", "gather_within_groups", "group_position", "scatter_sum", "check_components", "is_distributed", "name_replica_axis", "read_values", "stacked_steps"]


def _device_order(x: jax.Array) -> list[Any]:
  """Addressable shards of `x`, one per device, in the order of the sharding's devices."""
  sharding = x.sharding
  order = {d: i for i, d in enumerate(getattr(sharding, "_device_assignment", ()))}
  return sorted(x.addressable_shards, key=lambda s: order.get(s.device, s.device.id))


class DistributedValues:
  """Base class of values that hold one component per replica (TF's `tf.distribute.DistributedValues`)."""

  __slots__ = ("_value",)
  _value: Any

  def __init__(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover - abstract
    raise TypeError("DistributedValues is abstract: use PerReplica or Mirrored.")

  @classmethod
  def _wrap(cls, value: Any):
    obj = object.__new__(cls)
    obj._value = value
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
    return (self._value,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls._wrap(children[0])


@jax.tree_util.register_pytree_node_class
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
    return obj

  def tree_flatten(self):
    if self._valid is None:
      return (self._value,), None
    return (self._value, self._valid), (_PADDED if self._per_example else _BATCH_ROWS, self._tag)

  @classmethod
  def tree_unflatten(cls, aux, children):
    if aux is None:
      return cls._wrap(children[0])
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

  @property
  def values(self) -> tuple[Any, ...]:
    """The components, one per replica held by this process; padding rows of a batch are left out."""
    leaves, treedef = jax.tree.flatten(self._value)
    if not leaves:
      return ()
    steps = stacked_steps(leaves[0])
    if steps is not None:
      raise ValueError(
          f"{self!r} holds {steps} stacked steps ([steps, num_replicas, ...]), not one value per replica; "
          "tpustrat.unstack_steps(value)[i] is step i as strategy.run returns it.")
    per_leaf = [_unstack(x) for x in leaves]
    if self.padding_is_marked:
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
    along axis 0, where the caller has said that the rows are the batch's.
    """
    if self._valid is None or (not self._per_example and axis != 0):
      return None
    return self._valid

  def host_real_rows(self) -> np.ndarray:
    """Real rows per replica (host numpy ``[num_replicas]``), fetched once from the devices if needed."""
    if self._host_valid is None:
      self._host_valid = host_counts(self._valid)
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

  def element_root(self, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The path of the element this leaf belongs to, given the leaf's own `path` in a larger tree (the
    arguments of `run`); None when the leaf is no longer where its element put it."""
    own = self.paths[self.position]
    if len(own) > len(path) or tuple(path[len(path) - len(own):]) != tuple(own):
      return None
    return tuple(path[:len(path) - len(own)])


_PADDED = "padded"  # the counts are the value's own: its rows are examples
_BATCH_ROWS = "batch_rows"  # the counts are its step's batch's: used where axis 0 is said to be the batch


def _mesh(x: jax.Array) -> jax.sharding.Mesh | jax.sharding.AbstractMesh:
  """The mesh of an array laid out over a strategy's mesh (by a `NamedSharding`, as every such array is)."""
  sharding = x.sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise TypeError(f"expected an array laid out by a NamedSharding over a mesh, got one laid out by {sharding}.")
  return sharding.mesh


def host_counts(valid: Any) -> np.ndarray:
  """The per-replica real-row counts of a padded `PerReplica` as a host numpy int array."""
  if isinstance(valid, jax.Array) and not valid.is_fully_addressable:
    valid = jax.jit(lambda v: v, out_shardings=jax.sharding.NamedSharding(
        _mesh(valid), jax.sharding.PartitionSpec()))(valid)
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
  """The replica index of each component `_unstack(x)` returns, in the same order."""
  held = _replica_shards(x)
  return [r for r, _ in held] if held is not None else list(range(x.shape[0]))


def _unstack(x: Any) -> list[Any]:
  """The per-replica components of a stacked leaf held by this process, each on its own device."""
  held = _replica_shards(x)
  if held is not None:
    return [s.data.reshape(s.data.shape[1:]) for _, s in held]
  return [x[i] for i in range(x.shape[0])]


@jax.tree_util.register_pytree_node_class
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
          x = jax.jit(lambda v: v, out_shardings=jax.sharding.NamedSharding(
              x.sharding.mesh, jax.sharding.PartitionSpec()))(x)
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
  spec = [_without_replica(e) for e in sharding.spec] + [None] * (x.ndim - len(sharding.spec))
  if dim is not None:
    if spec[dim] is not None:  # another axis there (a logical-core split): leave the name as it is
      return x
    spec[dim] = REPLICA_AXIS
  while spec and spec[-1] is None:
    spec.pop()
  target = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec),
                                      memory_kind=sharding.memory_kind)
  if target == sharding:
    return x
  return jax.make_array_from_single_device_arrays(x.shape, target, [s.data for s in x.addressable_shards])


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


@jax.tree_util.register_pytree_node_class
class ShardedVariable(DistributedValues):
  """One array split over the replicas along one axis (TF's `tf.distribute.experimental.ShardedVariable`):
  each replica holds one block, and no device holds the whole value.

  The global array holds the blocks stacked on a leading replica axis (``[N, ...block]``, the layout of a
  `PerReplica`, sharded over the replicas): block ``r`` is rows ``[r*b, (r+1)*b)`` of `axis`, ``b = ceil(d /
  N)`` for ``d`` the logical size there, zero-padded at the end; `shape` is the logical shape. Made by `strategy.experimental_shard`, and by
  `strategy.run` for every sharded value a step returns (a block, as `LocalShard`).

  * ``strategy.experimental_local_results(v)`` / ``v.values``: the blocks, one per replica of this process
    (the last ones padded with zeros; where ``d < N`` the blocks past row ``d`` are all padding).
  * ``np.asarray(v)``: the whole value, padding stripped (TF's conversion to the concatenated tensor).
  * Inside `strategy.run` a step sees its block as a `LocalShard`; ``read_value()`` all-gathers the value.

  Hybrid sharding (`groups`, ``experimental_shard(..., groups=...)``): the value is split within each group
  of replicas and replicated across the groups. Replica ``r`` at position ``p`` of its group holds block
  ``p`` of ``S`` (the group size; ``b = ceil(d / S)``), so the stacked global array is still ``[N,
  ...block]``, each device holding its own block, and the ``G`` replicas at one position hold equal blocks.
  """

  __slots__ = ("_shape", "_axis", "_groups")
  _shape: tuple[int, ...]
  _axis: int
  _groups: Groups | None

  @classmethod
  def from_blocks(cls, blocks: Any, shape: Sequence[int], axis: int, groups: Groups | None = None) -> ShardedVariable:
    """Internal constructor: a `ShardedVariable` over `blocks`, a global array of the blocks stacked on a
    leading replica axis (``[N, ...block]``, placed by the caller), of logical `shape`, split on `axis`
    (within each of `groups`, checked by the caller: see `group_position`; None: over every replica).

    Used by the modules that place blocks (`experimental_shard`, checkpoint restores, embedding tables,
    the engine's outputs); users make one with ``strategy.experimental_shard``.
    """
    return cls._wrap(blocks, tuple(shape), axis, groups)

  @classmethod
  def _wrap(cls, value: Any, shape: tuple[int, ...] = (), axis: int = 0,
            groups: Groups | None = None) -> ShardedVariable:
    obj = object.__new__(cls)
    obj._value = value
    obj._shape = tuple(shape)
    obj._axis = axis
    obj._groups = groups
    return obj

  def __init__(self, *args: Any, **kwargs: Any) -> None:
    raise TypeError("ShardedVariable values are made by strategy.experimental_shard(tree) or returned by "
                    "strategy.run; they are not built directly.")

  def tree_flatten(self):
    return (self._value,), (self._shape, self._axis, self._groups)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls._wrap(children[0], *aux)

  def map_global(self, fn: Any) -> ShardedVariable:
    return ShardedVariable._wrap(fn(self._value), self._shape, self._axis, self._groups)

  @property
  def shape(self) -> tuple[int, ...]:
    """The logical (unpadded) shape."""
    return self._shape

  @property
  def axis(self) -> int:
    """The axis the value is split along."""
    return self._axis

  @property
  def dtype(self) -> Any:
    return self._value.dtype

  @property
  def groups(self) -> Groups | None:
    """The groups of replica ids the value is split within (hybrid sharding), each ordered by block; None
    when it is split over every replica."""
    return self._groups

  @property
  def num_replicas(self) -> int:
    """How many blocks the value is stacked as: one per replica (with `groups`, ``len(groups)`` copies of
    each of the ``len(groups[0])`` distinct blocks)."""
    return _replica_count(self._value)

  @property
  def values(self) -> tuple[Any, ...]:
    """This process's blocks, in replica order (padded ones included: each block has the same shape)."""
    return tuple(_unstack(self._value))

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    del copy
    stacked = np.asarray(jax.device_get(_fully_replicated(self._value)))
    if self._groups is not None:
      stacked = stacked[list(self._groups[0])]  # one group's blocks, in block order
    full = np.concatenate(list(stacked), axis=self._axis)
    full = np.take(full, np.arange(self._shape[self._axis]), axis=self._axis)
    return full if dtype is None else full.astype(dtype)

  def __repr__(self) -> str:
    within = "" if self._groups is None else f", groups={len(self._groups)}x{len(self._groups[0])}"
    return (f"ShardedVariable(shape={list(self._shape)}, dtype={self._value.dtype}, axis={self._axis}, "
            f"num_replicas={_replica_count(self._value)}{within})")


Groups = tuple[tuple[int, ...], ...]
"""Groups of replica ids that split a sharded value among them (hybrid sharding): equal sizes, every
replica in one group, each group in block order."""


def group_position(groups: Groups) -> tuple[int, ...]:
  """For each replica id, its position in its group: the block of a hybrid-sharded value it holds."""
  position = [0] * sum(len(g) for g in groups)
  for group in groups:
    for p, r in enumerate(group):
      position[r] = p
  return tuple(position)


def _across(groups: Groups) -> list[list[int]]:
  """The groups across `groups`: the replicas at each position, one from each group (``G`` of them)."""
  return [list(column) for column in zip(*groups)]


def _psum_across_groups(x: jax.Array, groups: Groups) -> jax.Array:
  """The sum of `x` (varying) over the replicas at this replica's position in every group: the all-reduce
  across the groups of a hybrid-sharded block (``1/S`` of the value). JAX's typed collectives take no
  groups for `psum`: it runs in a nested region that opts out of varying-axis checks (its result differs
  between positions, so it is cast back to varying), as `grouped_sums` does for grouped all-reduces."""
  if len(groups) == 1:
    return x
  region = jax.shard_map(functools.partial(jax.lax.psum, axis_name=REPLICA_AXIS, axis_index_groups=_across(groups)),
                         in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                         axis_names=frozenset(), check_vma=False)
  return jax.lax.pcast(region(x), REPLICA_AXIS, to="varying")


def scatter_sum(x: jax.Array, axis: int, groups: Groups | None) -> jax.Array:
  """This replica's block of the sum over every replica of `x` (typed per replica), cut along `axis` into
  as many blocks as replicas (or, with `groups`, as replicas per group: ``x.shape[axis]`` must divide):
  one tiled reduce-scatter (with `groups`, within the group, then one all-reduce of the block across the
  groups: the only communication between groups, ``1/S`` of `x`)."""
  if groups is None:
    return jax.lax.psum_scatter(x, REPLICA_AXIS, scatter_dimension=axis, tiled=True)
  within = jax.lax.psum_scatter(x, REPLICA_AXIS, scatter_dimension=axis, tiled=True,
                                axis_index_groups=[list(g) for g in groups])
  return _psum_across_groups(within, groups)


def gather_within_groups(x: jax.Array, axis: int, groups: Groups) -> jax.Array:
  """The blocks of this replica's group, `x` from each (typed per replica), concatenated along `axis` in
  block order, typed invariant: for values whose groups hold equal blocks (a hybrid-sharded value's
  updates), so that the result is the same on every replica. Runs in a nested region that opts out of
  varying-axis checks (JAX types a grouped all-gather varying)."""
  region = jax.shard_map(functools.partial(jax.lax.all_gather, axis_name=REPLICA_AXIS, axis=axis, tiled=True,
                                           axis_index_groups=[list(g) for g in groups]),
                         in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec(),
                         axis_names=frozenset(), check_vma=False)
  return region(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _summed_across_groups(block: jax.Array, groups: Groups) -> jax.Array:
  """`block` itself; its cotangent is summed across the groups (`_psum_across_groups`). Read through the
  grouped all-gather, whose transpose sums a gradient within the group, a hybrid block's gradient is then
  the sum over every replica: the block is one value, held once per group."""
  del groups
  return block


def _summed_across_groups_fwd(block: jax.Array, groups: Groups) -> tuple[jax.Array, None]:
  del groups
  return block, None


def _summed_across_groups_bwd(groups: Groups, _: None, ct: jax.Array) -> tuple[jax.Array]:
  return (_psum_across_groups(ct, groups),)


_summed_across_groups.defvjp(_summed_across_groups_fwd, _summed_across_groups_bwd)


def block_size(size: int, num_replicas: int) -> int:
  """Rows of each replica's block of an axis of `size` split over `num_replicas`: ``ceil(size / n)``."""
  return -(-size // num_replicas)


def _replica_count(x: Any) -> int:
  return int(x.shape[0])  # blocks stacked on a leading replica axis


def _fully_replicated(x: Any) -> Any:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    mesh = _mesh(x)
    return jax.jit(lambda v: v, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(x)
  return x


@jax.tree_util.register_pytree_node_class
class LocalShard:
  """A `ShardedVariable` as a step of `strategy.run` sees it: this replica's block.

  A pytree node over the block, so `jax.grad`, optax and `jax.tree.map` work on blocks (an optimizer's
  state made from it is sharded the same way, and `run` returns every `LocalShard` as a
  `ShardedVariable`). Arithmetic on it is an error: read the whole value first with `read_value()` (or
  `tpustrat.read_values(tree)`), whose gradient is this replica's block of the gradient summed over the
  replicas (the all-gather's transpose is a reduce-scatter).

  With `groups` (hybrid sharding) the block is this replica's block of the value split within its group:
  ``read_value`` gathers within the group, and the gradient is reduce-scattered within the group and then
  summed across the groups (``1/S`` of the value crosses them).
  """

  __slots__ = ("block", "shape", "axis", "groups")

  def __init__(self, block: Any, shape: tuple[int, ...], axis: int, groups: Groups | None = None) -> None:
    self.block = block
    self.shape = tuple(shape)
    self.axis = axis
    self.groups = groups

  def tree_flatten(self):
    return (self.block,), (self.shape, self.axis, self.groups)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  @property
  def dtype(self) -> Any:
    return self.block.dtype

  def num_blocks(self, num_replicas: int) -> int:
    """How many distinct blocks the value is split into: the group size, or `num_replicas` (no groups)."""
    return num_replicas if self.groups is None else len(self.groups[0])

  def block_index(self) -> Any:
    """Which block of the value this replica holds (inside `strategy.run`): its replica id, or with
    `groups` its position in its group."""
    r = jax.lax.axis_index(REPLICA_AXIS)
    return r if self.groups is None else jnp.asarray(group_position(self.groups), jnp.int32)[r]

  def _slice_axis(self) -> tuple[int, tuple[int, ...]]:
    """(the split axis of `block`, the logical shape of what `block` is a block of): `block` may be a slice
    of its leading axes (a scan over stacked layers); the split axis must not be one of them."""
    lead = len(self.shape) - jnp.ndim(self.block)
    if lead < 0 or (lead and self.axis < lead):
      raise ValueError(
          f"{self!r}: a block of rank {jnp.ndim(self.block)} is not a block of a value of shape {list(self.shape)} "
          f"split along axis {self.axis}; only leading axes before the split axis may be indexed away (a scan "
          "over stacked layers), not the split axis itself.")
    return self.axis - lead, self.shape[lead:]

  def real_block(self) -> jax.Array:
    """The block with its padding (the rows past the logical size, zeros as placed, but whatever an
    elementwise update made of them since) set to zero: for statistics over the whole value
    (`tpustrat.global_norm`, the numerics check)."""
    axis, shape = self._slice_axis()
    rows = jnp.shape(self.block)[axis]
    index = jax.lax.broadcasted_iota(jnp.int32, tuple(rows if i == axis else 1 for i in range(jnp.ndim(self.block))),
                                     axis) + self.block_index() * rows
    return jnp.where(index < shape[axis], self.block, jnp.zeros((), self.block.dtype))

  def read_value(self) -> jax.Array:
    """The whole value (logical shape), all-gathered from every replica's block.

    A block indexed along leading axes, as `lax.scan` and `jax.vmap` over a stacked layer axis hand it to
    their body, reads the matching slice only: for a value of shape ``[L, d, f]`` split along axis 1, a
    scan over its layers reads one ``[d, f]`` layer per iteration (per-layer gathering, FSDP). The
    leading axes must not include the split axis. The result is named `GATHERED` for `jax.checkpoint`
    policies (`gather_again_policy`): a rematerialised layer gathers again in the backward pass instead
    of keeping every gathered layer alive.

    With `groups` the all-gather runs within this replica's group, and the gradient w.r.t. the block is
    reduce-scattered within the group, then all-reduced across the groups (the block's ``1/S`` of the
    value): the sum over every replica, as without groups.
    """
    block = self.block
    axis, shape = self._slice_axis()
    n = self.num_blocks(jax.lax.axis_size(REPLICA_AXIS))
    want = list(shape)
    want[axis] = block_size(shape[axis], n)
    if list(jnp.shape(block)) != want:
      raise ValueError(f"{self!r}: the block has shape {list(jnp.shape(block))}, but a value of shape {list(shape)} "
                       f"split along axis {axis} over {n} replicas has blocks of shape {want}.")
    if self.groups is None:
      full = jax.lax.all_gather(block, REPLICA_AXIS, axis=axis, tiled=True)
    else:
      full = jax.lax.all_gather(_summed_across_groups(block, self.groups), REPLICA_AXIS, axis=axis, tiled=True,
                                axis_index_groups=[list(g) for g in self.groups])
    full = jax.lax.slice_in_dim(full, 0, shape[axis], axis=axis)
    return checkpoint_name(full, GATHERED)

  def _refuse(self, *args: Any) -> Any:
    raise TypeError(
        f"A sharded value ({self!r}) holds only this replica's block: read the whole value first, "
        "x.read_value() (or tpustrat.read_values(tree)), or update the block itself with jax.tree.map.")

  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
  __matmul__ = __rmatmul__ = __neg__ = __getitem__ = __pow__ = _refuse

  def __jax_array__(self) -> Any:
    self._refuse()

  def sum_to_block(self, whole: jax.Array) -> jax.Array:
    """This replica's block of the sum over every replica of `whole` (a value of the logical shape, typed
    per replica: a local gradient), zero-padded to whole blocks: what `jax.grad` through `read_value` gives
    (one reduce-scatter; with `groups` within the group, then one all-reduce of the block across them)."""
    n = self.num_blocks(jax.lax.axis_size(REPLICA_AXIS))
    rows = block_size(self.shape[self.axis], n) * n
    pad = [(0, 0)] * jnp.ndim(whole)
    pad[self.axis] = (0, rows - jnp.shape(whole)[self.axis])
    if rows != jnp.shape(whole)[self.axis]:
      whole = jnp.pad(whole, pad)
    return scatter_sum(whole, self.axis, self.groups)

  def __repr__(self) -> str:
    within = "" if self.groups is None else f", groups={len(self.groups)}x{len(self.groups[0])}"
    return (f"LocalShard(shape={list(self.shape)}, axis={self.axis}, block={getattr(self.block, 'shape', '?')}"
            f"{within})")


GATHERED = "tpustrat_gathered"
"""The name (`jax.ad_checkpoint.checkpoint_name`) of every value `LocalShard.read_value` gathers."""


def gather_again_policy() -> Any:
  """A `jax.checkpoint` policy for FSDP layers: the backward pass all-gathers each layer's weights again
  instead of keeping every gathered layer alive from the forward pass. It saves the outputs of matrix
  products without batch dimensions (activations times weights: activation-sized) and recomputes the rest,
  the gathers and the weights' casts included. Use it on the body of a scan over stacked layers::

      body = jax.checkpoint(layer, policy=tpustrat.gather_again_policy())
      x, _ = jax.lax.scan(body, x, stacked_params)   # reads (gathers) one layer per iteration

  It is `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`, the usual transformer policy.
  `jax.checkpoint_policies.nothing_saveable` recomputes everything (less memory, more compute). A policy
  that saves everything but names does not do: it saves the all-gather's output itself. Custom policies
  that save by name can leave the gathered values out by their name, `GATHERED`.
  """
  return jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def read_values(tree: Any) -> Any:
  """`tree` with every sharded value (`LocalShard`, inside `strategy.run`) read whole (all-gathered); other
  leaves as they are. The gradient w.r.t. the blocks is the block of the gradient summed over replicas.

  >>> read_values({"b": np.ones(2)})["b"]
  array([1., 1.])
  """
  return jax.tree.map(lambda x: x.read_value() if isinstance(x, LocalShard) else x, tree,
                      is_leaf=lambda x: isinstance(x, LocalShard))


def is_distributed(x: Any) -> bool:
  """Whether `x` is a `PerReplica` or `Mirrored` value (used as `is_leaf` in tree maps)."""
  return isinstance(x, DistributedValues)
