"""Logical devices: model parallelism inside a replica, as sharding annotations on the mesh's core axes.

TF runs a replica on several TPU cores ("logical devices") when its `DeviceAssignment` has more than
one core per replica; inside `strategy.run` three annotations say how a tensor is laid out on them:
`experimental_split_to_logical_devices` (XLA tile sharding), `experimental_replicate_to_logical_devices`
(replicated sharding) and `experimental_assign_to_logical_device` (maximal sharding: one core). XLA's
SPMD partitioner then compiles one program for all cores.

tpustrat's strategy mesh is replicas x logical cores. The ``C`` logical cores of a replica are the axes
``core_0, core_1, ...`` of the mesh, one per prime factor of ``C`` in increasing order (8 cores:
three axes of size 2), so that logical core ``l`` is the row-major index over those axes. `run` is a
`jax.shard_map` that is manual over ``'replica'`` only (``axis_names={'replica'}``): inside the step,
every value is one replica's value, and how it is laid out on the replica's cores is left to XLA,
steered by these annotations:

* **split**: `jax.lax.with_sharding_constraint` with a `PartitionSpec` that gives each tensor dimension
  ``d`` the core axes whose sizes multiply to ``partition_dimensions[d]``, consecutive and in order.
  This is TF's tile assignment ``arange(C).reshape(partition_dimensions)``: the tile at position ``t``
  lives on logical core ``arange(C).reshape(partition_dimensions)[t]``. (Only when ``C`` has a prime
  factor twice *and* another prime, e.g. 12, can a partition need non-consecutive axes; the tiles then
  still go one per core, in a different order; values are unaffected.)
* **replicate**: `with_sharding_constraint` with ``P()``: every core holds the whole tensor.
* **assign**: XLA's maximal sharding is not expressible in JAX inside a multi-device program (a
  single-device sharding is rejected, and a maximal annotation inside `shard_map` is dropped). XLA
  implements a maximal sharding as a conditional on the partition id that computes the op on one
  device; tpustrat builds exactly that (`tpustrat._src.logical_interpreter`). The annotation marks the
  tensor; `run` traces the step once to a jaxpr and evaluates the *computation of the tensor* (the
  operation that produced it, and every operation before it whose results are used only on the way to
  it) inside a nested `jax.shard_map` over the core axes, under
  ``lax.cond(core == logical_device_id, ...)``: only that core computes; the others skip it. The
  result is then broadcast to the replica's other cores (an all-reduce of its bit patterns to which the
  other cores contribute zeros: exact, signed zeros and NaN payloads included), because later
  operations read it wherever they run. What is different from TF:

  - later operations that use the tensor are not moved (XLA would propagate the maximal sharding to
    them); annotate their results too to place them;
  - a tensor that the step did not compute (an argument of the step) has nothing to place: it already
    entered the step whole on every core of the replica, and the annotation returns it unchanged;
  - operations with side effects (callbacks, prints) and sharding annotations stay outside the placed
    computation, as do its inputs: values split across cores are gathered to every core first;
  - the annotation may be at the top level of the step function (plain Python, `jax.grad` and
    `jax.vmap` are fine), inside a nested `jax.jit`, `jax.checkpoint` or custom-derivative call (the
    call is evaluated inline, its body placed like the step's own; a checkpoint's rematerialisation is
    not kept for it), or inside a `lax.scan` body (the scan is re-emitted with each iteration's body
    placed). Inside `lax.cond`, `lax.while_loop` or another sub-program, compiling the step raises an
    error that says so;
  - gradients: only the forward computation is placed (tangents and cotangents pass unannotated).

With one core per replica the mesh has no core axes, `run` is manual over every axis as before, split
and replicate accept only the trivial partition, and assign accepts only logical device 0.

One replica of several cores (``num_replicas=1``): the ``'replica'`` axis then has size 1, and XLA's SPMD
partitioner rejects a collective over a manual axis of size 1 once sharding propagation has split its
operand over the core axes ("Cross-partition allreduce must be in (partial) manual partitioning mode";
it happens to the gradient sums JAX adds for replicated parameters). `run` keeps the operands and
results of such collectives at the top level of the step replicated over the cores, which moves no data
between replicas (there is one) and avoids the error; a collective over ``'replica'`` inside a nested
`jax.jit` of the step is not rewritten.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src import validation
from tpustrat._src.logical_interpreter import assign_p
from tpustrat._src.names import REPLICA_AXIS

__all__ = [
    "LayoutMap",
    "assign_to_logical_device",
    "core_axis_sizes",
    "replica_core_mesh",
    "replicate_to_logical_devices",
    "split_to_logical_devices",
]

CORE_AXIS_PREFIX = "core_"


class MeshStrategy(Protocol):
  """What the annotations need of a strategy: its mesh (``'replica'``, then the core axes)."""

  @property
  def mesh(self) -> Mesh: ...


# -- the mesh -----------------------------------------------------------------------------------------


def core_axis_sizes(num_cores: int) -> list[int]:
  """The prime factors of `num_cores`, in increasing order: the sizes of the mesh's core axes.

  >>> core_axis_sizes(8), core_axis_sizes(12), core_axis_sizes(1)
  ([2, 2, 2], [2, 2, 3], [])
  """
  sizes, n, p = [], int(num_cores), 2
  while n > 1:
    while n % p == 0:
      sizes.append(p)
      n //= p
    p += 1
  return sizes


def replica_core_mesh(grid: np.ndarray) -> Mesh:
  """The strategy mesh for a ``[num_replicas, cores_per_replica]`` array of devices.

  Axes: ``'replica'``, then one ``core_i`` axis per prime factor of the cores per replica (none for
  one core per replica: the mesh is then the 1-D replica mesh).

  >>> devices = np.asarray(jax.devices(), dtype=object).reshape(4, 2)
  >>> dict(replica_core_mesh(devices).shape)
  {'replica': 4, 'core_0': 2}
  >>> replica_core_mesh(devices.reshape(1, 8)).axis_names
  ('replica', 'core_0', 'core_1', 'core_2')
  """
  grid = np.asarray(grid, dtype=object)
  if grid.ndim != 2 or grid.size == 0:
    raise ValueError(f"Expected a non-empty [num_replicas, cores_per_replica] array of devices, got shape {grid.shape}.")
  sizes = core_axis_sizes(grid.shape[1])
  names = (REPLICA_AXIS,) + tuple(f"{CORE_AXIS_PREFIX}{i}" for i in range(len(sizes)))
  return Mesh(grid.reshape([grid.shape[0]] + sizes), names)


def _core_axes(strategy: MeshStrategy) -> tuple[tuple[str, ...], tuple[int, ...]]:
  mesh = strategy.mesh
  names = tuple(a for a in mesh.axis_names if a != REPLICA_AXIS)
  return names, tuple(mesh.shape[a] for a in names)


def _check_in_run(strategy: MeshStrategy, api: str) -> None:
  ctx = context_lib.active_replica_context()
  if ctx is None or context_lib.replica_axis(ctx) is None or ctx.strategy is not strategy:
    raise RuntimeError(
        f"strategy.{api} annotates a tensor inside a replica and must be called in the function given to "
        f"strategy.run of the same strategy ({strategy!r}).")


# -- split / replicate --------------------------------------------------------------------------------


def partition_spec(partition_dimensions: Sequence[int], names: Sequence[str], sizes: Sequence[int]) -> P:
  """The `PartitionSpec` over core axes (`names`, of `sizes`) that tiles a tensor like TF's tile
  assignment ``arange(prod(partition_dimensions)).reshape(partition_dimensions)``.

  >>> partition_spec([1, 2, 4, 1], ["core_0", "core_1", "core_2"], [2, 2, 2])
  P(None, 'core_0', ('core_1', 'core_2'), None)
  """
  spec: list[Any] = []
  pos = 0
  for d in partition_dimensions:  # consecutive axes in order: exactly TF's tile assignment
    group, prod = [], 1
    while prod < d and pos < len(sizes):
      group.append(names[pos])
      prod *= sizes[pos]
      pos += 1
    if prod != d:
      break
    spec.append(None if not group else group[0] if len(group) == 1 else tuple(group))
  else:
    return P(*spec)
  # Not expressible with consecutive axes (cores like 12 = 2*2*3 split [3, 4]): give each dimension
  # axes of its prime factors; tiles still go one per core, in another order.
  free = list(range(len(sizes)))
  spec = []
  for d in partition_dimensions:
    group = []
    for f in core_axis_sizes(d):
      i = next(i for i in free if sizes[i] == f)
      free.remove(i)
      group.append(names[i])
    spec.append(None if not group else group[0] if len(group) == 1 else tuple(group))
  return P(*spec)


def split_to_logical_devices(strategy: MeshStrategy, tensor: Any, partition_dimensions: Sequence[int]) -> Any:
  """`TPUStrategy.experimental_split_to_logical_devices` (see that method)."""
  _check_in_run(strategy, "experimental_split_to_logical_devices")
  names, sizes = _core_axes(strategy)
  num_cores = int(np.prod(sizes, dtype=np.int64))
  if isinstance(partition_dimensions, (str, bytes)) or not isinstance(partition_dimensions, (Sequence, np.ndarray)):
    raise ValueError(
        f"`partition_dimensions` must be a list of ints, one per dimension of the tensor; got {partition_dimensions!r}.")
  dims = [validation.check_int(d, "strategy.experimental_split_to_logical_devices", f"partition_dimensions[{i}]",
                               minimum=1) for i, d in enumerate(partition_dimensions)]
  x = jnp.asarray(tensor)
  if x.ndim != len(dims):
    raise ValueError(
        f"Length of `partition_dimensions` ({len(dims)}) must be equal to the rank of `tensor` ({x.ndim}); "
        f"got partition_dimensions={dims} for a tensor of shape {x.shape}.")
  for i, (size, d) in enumerate(zip(x.shape, dims)):
    if size % d:
      raise ValueError(
          f"Tensor shape at dimension ({i}) must be divisible by corresponding value specified by "
          f"`partition_dimensions` ({d}); got shape {x.shape} and partition_dimensions={dims}.")
  if int(np.prod(dims, dtype=np.int64)) != num_cores:
    raise ValueError(
        f"Number of logical devices ({num_cores}) does not match the number of partition splits specified "
        f"({int(np.prod(dims, dtype=np.int64))}): partition_dimensions={dims} must multiply to the number of "
        "logical devices per replica (num_cores_per_replica of the strategy's DeviceAssignment).")
  if not names:
    return x
  return lax.with_sharding_constraint(x, partition_spec(dims, names, sizes))


def replicate_to_logical_devices(strategy: MeshStrategy, tensor: Any) -> Any:
  """`TPUStrategy.experimental_replicate_to_logical_devices` (see that method)."""
  _check_in_run(strategy, "experimental_replicate_to_logical_devices")
  names, _ = _core_axes(strategy)
  if not names:
    return jax.tree.map(jnp.asarray, tensor)
  return jax.tree.map(lambda x: lax.with_sharding_constraint(jnp.asarray(x), P()), tensor)


# -- assign: a marker, honoured by `logical_interpreter.place_on_logical_devices` -----------------------


def assign_to_logical_device(strategy: MeshStrategy, tensor: Any, logical_device_id: int) -> Any:
  """`TPUStrategy.experimental_assign_to_logical_device` (see that method)."""
  _check_in_run(strategy, "experimental_assign_to_logical_device")
  names, sizes = _core_axes(strategy)
  num_cores = int(np.prod(sizes, dtype=np.int64))
  k = validation.check_int(logical_device_id, "strategy.experimental_assign_to_logical_device",
                           "logical_device_id")
  if not 0 <= k < num_cores:
    raise ValueError(
        f"`logical_core_id` to assign must be lower then total number of logical devices per replica. "
        f"Received logical device id {k} but there are only total of {num_cores} logical devices in replica.")
  if not names:
    return jax.tree.map(jnp.asarray, tensor)
  return jax.tree.map(lambda x: assign_p.bind(jnp.asarray(x), logical_device_id=k), tensor)




# -- LayoutMap: state laid out on the logical cores (tensor parallelism inside a replica) ------------------


class LayoutMap(MutableMapping):
  r"""Which leaves of a pytree are split over a replica's logical cores, and how: Keras's `LayoutMap` in
  TF's logical-device vocabulary (tensor parallelism inside a replica).

  An ordered mapping from a regular expression to a layout. A leaf's path (as error messages write it,
  e.g. ``['dense1']['kernel']``) is matched with `re.search` against every pattern; the one that matches
  gives its layout:

  * a list of ints, one per dimension: TF's ``partition_dimensions``, as for
    `experimental_split_to_logical_devices`: dimension ``d`` is cut into ``layout[d]`` equal pieces, the
    entries multiply to the logical cores per replica, and each divides its dimension;
  * None: the leaf is replicated on the replica's cores (matched, so no other pattern may match it).

  Leaves no pattern matches are left alone. A leaf two patterns match is an error (a conflict), as in
  Keras. Use it with `strategy.experimental_shard(tree, layout_map=...)` (places the leaves; a pattern that
  matches no leaf is an error) and `RunOptions(experimental_layout_map=...)` (keeps the step's results
  laid out the same way). Since patterns are searched, ``r"\['w1'\]"`` finds the parameter ``w1`` in
  the tree given to `experimental_shard` (``['w1']``), in a step's result ``(params, opt_state)``
  (``[0]['w1']``) and in Adam's moments (``[1][0].mu['w1']``): do not anchor patterns with ``^``.

  >>> layout_map = LayoutMap({r"dense.*kernel": [1, 2]})
  >>> layout_map[r"dense.*bias"] = [2]
  >>> layout_map["['dense1']['kernel']"], list(layout_map)
  ((1, 2), ['dense.*kernel', 'dense.*bias'])
  """

  def __init__(self, layouts: Mapping[str, Sequence[int] | None] | None = None) -> None:
    self._layouts: dict[str, tuple[int, ...] | None] = {}
    self._compiled: dict[str, re.Pattern[str]] = {}
    if layouts is not None:
      if not isinstance(layouts, Mapping):
        raise TypeError(f"LayoutMap: expected a mapping from regex to layout, got {type(layouts).__name__}.")
      for pattern, layout in layouts.items():
        self[pattern] = layout

  def __setitem__(self, pattern: str, layout: Sequence[int] | None) -> None:
    if not isinstance(pattern, str):
      raise TypeError(f"LayoutMap: a key must be a regular expression (str), got {type(pattern).__name__} "
                      f"{pattern!r:.60}.")
    if pattern in self._layouts:
      raise ValueError(f"LayoutMap: the pattern {pattern!r} already has the layout {self._layouts[pattern]}; "
                       "delete it first to change it.")
    try:
      compiled = re.compile(pattern)
    except re.error as e:
      raise ValueError(f"LayoutMap: {pattern!r} is not a regular expression: {e}.") from None
    if layout is not None:
      if isinstance(layout, (str, bytes)) or not isinstance(layout, (Sequence, np.ndarray)):
        raise TypeError(
            f"LayoutMap: the layout of {pattern!r} must be a list of ints (TF's partition_dimensions, one per "
            f"dimension) or None (replicated on the cores), got {layout!r:.100}.")
      layout = tuple(validation.check_int(d, "LayoutMap", f"[{pattern!r}][{i}]", minimum=1)
                     for i, d in enumerate(layout))
    self._compiled[pattern] = compiled
    self._layouts[pattern] = layout

  def __getitem__(self, path: str) -> tuple[int, ...] | None:
    """The layout of the leaf at `path` (Keras's lookup): a pattern equal to `path`, else the one pattern
    `path` matches (`re.search`); None if none does; ValueError if several do."""
    if path in self._layouts:
      return self._layouts[path]
    found = self.match(path)
    return None if found is None else found[1]

  def __delitem__(self, pattern: str) -> None:
    del self._layouts[pattern]
    del self._compiled[pattern]

  def __contains__(self, pattern: object) -> bool:
    return pattern in self._layouts

  def __iter__(self) -> Iterator[str]:
    return iter(self._layouts)

  def __len__(self) -> int:
    return len(self._layouts)

  def __repr__(self) -> str:
    return f"LayoutMap({self._layouts!r})"

  def signature(self) -> tuple[tuple[str, tuple[int, ...] | None], ...]:
    """The patterns and layouts, hashable (part of a compiled program's cache key)."""
    return tuple(self._layouts.items())

  def match(self, path: str, where: str = "LayoutMap") -> tuple[str, tuple[int, ...] | None] | None:
    """``(pattern, layout)`` of the one pattern that `path` matches, or None; ValueError if several do."""
    found = [p for p, c in self._compiled.items() if c.search(path)]
    if len(found) > 1:
      raise ValueError(
          f"{where}: the leaf at {path} is matched by {len(found)} patterns of the LayoutMap "
          f"({', '.join(repr(p) for p in found)}), with layouts {[self._layouts[p] for p in found]}: a leaf "
          "may have one layout. Make the patterns exclusive.")
    return (found[0], self._layouts[found[0]]) if found else None


def check_layout_map(strategy: MeshStrategy, layout_map: Any, where: str) -> None:
  """TypeError unless `layout_map` is a `LayoutMap`; ValueError if the strategy has one core per replica."""
  if not isinstance(layout_map, LayoutMap):
    raise TypeError(f"{where}: layout_map must be a tpustrat.LayoutMap or None, got {type(layout_map).__name__} "
                    f"{layout_map!r:.100}.")
  if not _core_axes(strategy)[0]:
    raise ValueError(
        f"{where}: a LayoutMap lays leaves out on the logical cores of each replica, and this strategy has one "
        "core per replica. Build the strategy with a tpustrat.DeviceAssignment of num_cores_per_replica > 1 "
        "(DeviceAssignment.build(topology, computation_shape=[1, 1, 2], ...)), or split state over the "
        "replicas with a partitioner instead.")


def layout_spec(strategy: MeshStrategy, path: str, pattern: str, layout: tuple[int, ...] | None,
                shape: Sequence[int], where: str) -> P:
  """The `PartitionSpec` over the core axes for a leaf of `shape` at `path` that `pattern` gave `layout`
  (``P()`` for None); ValueError naming the leaf and the pattern when the layout does not fit it."""
  if layout is None:
    return P()
  names, sizes = _core_axes(strategy)
  num_cores = int(np.prod(sizes, dtype=np.int64))
  shape = tuple(int(d) for d in shape)
  said = f"{where}: the leaf at {path} (shape {list(shape)}) matches the LayoutMap pattern {pattern!r}"
  if len(layout) != len(shape):
    raise ValueError(f"{said}, whose layout {list(layout)} has {len(layout)} entries: a layout has one entry "
                     f"per dimension of the leaf ({len(shape)}).")
  if int(np.prod(layout, dtype=np.int64)) != num_cores:
    raise ValueError(f"{said}, whose layout {list(layout)} splits it into {int(np.prod(layout, dtype=np.int64))} "
                     f"tiles: the entries must multiply to the {num_cores} logical cores per replica.")
  for d, (size, k) in enumerate(zip(shape, layout)):
    if size % k:
      raise ValueError(f"{said}, whose layout {list(layout)} cuts dimension {d} (size {size}) into {k} pieces: "
                       "each entry must divide its dimension (XLA's tiles are equal).")
  return partition_spec(layout, names, sizes)
