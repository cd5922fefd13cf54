"""The `CrossDeviceOps` family (TF's `tf.distribute.CrossDeviceOps`): how replicas' values are combined.

Pass one to `tpustrat.MirroredStrategy(cross_device_ops=...)`, or call its `reduce`, `batch_reduce` and
`broadcast` in the cross-replica context. Every reduction is one compiled `jax.jit(jax.shard_map(...))`
program over the value's mesh; the implementations differ in the collectives it contains:

=================================  ======================================================================
implementation                     what each pack (one flat buffer of one dtype) becomes, n replicas
=================================  ======================================================================
`NcclAllReduce`                    one XLA all-reduce (`lax.psum`); every device sums
`HierarchicalCopyAllReduce`        two halves of the devices; members copy to their half's leader, which
                                   adds; the two leaders swap and add; leaders copy the total back.
                                   ``2 * (n/2 - 1) + 1`` collective-permutes, no all-reduce; leaders rotate
                                   from pack to pack as in TF
`ReductionToOneDevice`             ``n - 1`` collective-permutes to the reduce device, `accumulation_fn`
                                   there only (a `lax.cond` on the replica id), then a binomial-tree
                                   broadcast (``ceil(log2 n)`` permutes) or nothing for one destination
`CommunicationImplementation.RING` an explicit ring: ``n - 1`` reduce-scatter and ``n - 1`` all-gather
                                   collective-permutes of ``1/n`` of the pack each
=================================  ======================================================================

Packing (`AllReduceCrossDeviceOps`, in this order of precedence): a per-call
`CommunicationOptions.bytes_per_pack` > 0 groups tensors, in order, into packs of about that many bytes;
else ``num_packs`` > 0 concatenates all tensors of a dtype into one flat buffer cut into ``num_packs``
slices; else, with ``agg_small_grads_max_bytes`` > 0 and ``agg_small_grads_max_group`` > 0, runs of
consecutive small tensors are concatenated into groups of at most ``agg_small_grads_max_group``; else
every tensor is its own collective. Packs never mix dtypes, and every tensor comes back with its shape
and dtype. The algorithms and the packing live in `tpustrat._src.all_reduce`; measurements of what
packing costs and saves are in ``docs/benchmarks_cross_device.md``.

Inside `strategy.run`, `all_reduce_in_replica_context` (what `ReplicaContext.all_reduce` calls on a
strategy configured with cross-device ops) runs the same algorithm in the step's program; its result is
identical on every replica (`run` returns it as `Mirrored`). The permute-based algorithms are typed
replicated through a `jax.custom_vjp` (the backward pass is the all-reduce's adjoint), so `jax.jvp`
cannot go through them; `NcclAllReduce` has no such limit. There, `ReductionToOneDevice`'s reduce device
must be one of the strategy's devices.

Reductions in the cross-replica context are dispatched asynchronously through `engine.dispatch`, at most
`engine.DEFAULT_STEPS_IN_FLIGHT` in flight, each waited for on its smallest output of at most 64 KiB (or
on a one-byte token output when every result is larger).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tpustrat._src import all_reduce, engine, gradient_semantics
from tpustrat._src import context as context_lib
from tpustrat._src.cross_device.devices import device_from_string
from tpustrat._src.cross_device.layout import (
  Destination,
  Layout,
  components,
  deliver,
  layout_of,
  resolve_destinations,
  shard_on,
  to_distributed,
)
from tpustrat._src.cross_device.options import (
  CommunicationImplementation,
  CommunicationOptions,
  check_options,
)
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.validation import check_int
from tpustrat._src.values import DistributedValues, Mirrored, PerReplica

__all__ = [
    "AllReduceCrossDeviceOps",
    "CrossDeviceOps",
    "DEFAULT_AGG_SMALL_GRADS_MAX_BYTES",
    "DEFAULT_AGG_SMALL_GRADS_MAX_GROUP",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "check_cross_replica",
    "default_cross_device_ops",
]


def _normalize_pairs(value_destination_pairs: Any) -> list[tuple[DistributedValues, Any]]:
  """TF's `_normalize_value_destination_pairs`: a list or tuple of (value, destinations) pairs."""
  if not isinstance(value_destination_pairs, (list, tuple)):
    raise ValueError(
        "`value_destination_pairs` should be a list or tuple of (value, destinations) pairs, got "
        f"{type(value_destination_pairs).__name__}: {value_destination_pairs!r:.100}.")
  pairs = []
  for i, pair in enumerate(value_destination_pairs):
    if not isinstance(pair, (tuple, list)) or isinstance(pair, DistributedValues):
      raise ValueError(
          f"Each element of `value_destination_pairs` should be a tuple (value, destinations); element {i} "
          f"is {type(pair).__name__}: {pair!r:.100}.")
    if len(pair) != 2:
      raise ValueError(
          f"Each element of `value_destination_pairs` should be a tuple of size 2; element {i} has "
          f"{len(pair)} items.")
    pairs.append((to_distributed(pair[0], f"the value of pair {i}"), pair[1]))
  return pairs


def check_cross_replica(method: str) -> None:
  """Raises if called inside `strategy.run`: `method` belongs to the cross-replica context."""
  if context_lib.in_replica_context_of_a_run():
    raise RuntimeError(
        f"{method} can only be called in the cross-replica context (outside strategy.run). Inside the "
        "function given to run, use tpustrat.get_replica_context().all_reduce(...).")


def _with_wait_token(program: Callable[[list[jax.Array]], list[jax.Array]]) -> Callable[..., Any]:
  """`program` returning ``(outputs, token)``: `token` is ``()``, or a one-byte array when no output is
  small enough to wait on (`engine.wait_leaf`: at most 64 KiB), as `strategy.run` adds one."""

  def with_token(xs: list[jax.Array]) -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
    out = list(program(xs))
    return out, (() if engine.wait_leaf(out, tuple(xs)) is not None else (jnp.zeros((), jnp.int8),))

  return with_token


def _wait_on(out: list[jax.Array], token: tuple[jax.Array, ...], inputs: list[jax.Array]) -> jax.Array | None:
  """What the next reductions wait for: the smallest output (the choice `engine.wait_leaf` makes for
  `run`, from shapes and dtypes only, so it matches the trace-time choice of `_with_wait_token`), else
  the token. Waiting on a large output would keep its buffer alive two reductions longer."""
  if token:
    return token[0]
  i = engine.wait_leaf(out, tuple(inputs))
  return None if i is None else out[i]


def _dispatch(program: Callable[..., Any], flat: list[jax.Array]) -> list[jax.Array]:
  """Runs a reduction program built with `_with_wait_token` through `engine.dispatch`: at most
  `engine.DEFAULT_STEPS_IN_FLIGHT` reductions in flight in the process, each waited for on `_wait_on`."""

  def run(xs: list[jax.Array]) -> tuple[list[jax.Array], jax.Array | None]:
    out, token = program(xs)
    return out, _wait_on(out, token, xs)

  return engine.dispatch(run, flat)


# -- the classes --------------------------------------------------------------------------------------


class CrossDeviceOps:
  """Base class of cross-device reduction and broadcast algorithms (TF's `tf.distribute.CrossDeviceOps`).

  Pass one to `tpustrat.MirroredStrategy(cross_device_ops=...)` to choose how replicas' values are
  combined; prefer the strategy's methods (`strategy.extended.reduce_to`, ...) to calling these directly.
  Subclasses override `reduce_implementation`, `batch_reduce_implementation` and
  `broadcast_implementation`; the built-in ones also say how to all-reduce inside `strategy.run`
  (`all_reduce_in_replica_context`).

  `destinations` may be a `DistributedValues` (the result is `Mirrored` on its devices; passing the value
  itself as destinations is an all-reduce), a `jax.Array` (its devices), a `jax.Device` or a device
  string such as ``"/device:CPU:0"`` (the result is a `jax.Array` on that one device), a
  `jax.sharding.Mesh` (`Mirrored` on the mesh) or a `jax.sharding.Sharding` (that exact layout).
  """

  def __init__(self) -> None:
    self._programs: dict[Any, Callable[..., Any]] = {}

  # -- TF's public methods ------------------------------------------------------------------------------

  def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any,
             options: CommunicationOptions | None = None) -> Any:
    """Reduces `per_replica_value` to `destinations` (cross-replica context only).

    >>> strategy = tpustrat.TPUStrategy()
    >>> v = strategy.experimental_distribute_values_from_function(lambda ctx: float(ctx.replica_id_in_sync_group))
    >>> total = NcclAllReduce().reduce("sum", v, destinations=v)
    >>> total
    Mirrored(float32[])
    >>> print(strategy.experimental_local_results(total)[5])
    28.0
    >>> one = ReductionToOneDevice().reduce("mean", v, destinations="/device:CPU:2")
    >>> print(one, one.devices() == {jax.devices()[2]})
    3.5 True

    Args:
      reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or "sum", "mean").
      per_replica_value: a `DistributedValues`, or a `jax.Array` on one device (one component).
      destinations: where the result goes (see the class docstring).
      options: a `CommunicationOptions`.

    Returns:
      `Mirrored`, or a `jax.Array` for a single-device destination.

    Raises:
      ValueError: if `per_replica_value` can't be converted to a `DistributedValues`, or if
        `destinations` is not one of the accepted kinds.
    """
    check_cross_replica("CrossDeviceOps.reduce")
    op = ReduceOp.from_value(reduce_op)
    options = check_options(options)
    value = to_distributed(per_replica_value)
    resolve_destinations(destinations)
    return self.reduce_implementation(op, value, destinations, options)

  def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]],
                   options: CommunicationOptions | None = None) -> list[Any]:
    """Reduces each value of `value_destination_pairs` to its destinations, as one batch.

    The built-in implementations reduce every pair that goes to the same devices in one compiled
    program, so their tensors can share packs.

    >>> strategy = tpustrat.TPUStrategy()
    >>> d = strategy.experimental_distribute_values_from_function(lambda ctx: float(ctx.replica_id_in_sync_group))
    >>> e = strategy.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group + 1.0)
    >>> [float(m.values[0]) for m in NcclAllReduce().batch_reduce("mean", [(d, d), (e, e)])]
    [3.5, 4.5]

    Raises:
      ValueError: if `value_destination_pairs` is not a list or tuple of (value, destinations) pairs
        whose values are `DistributedValues` (or tensors on a device).
    """
    check_cross_replica("CrossDeviceOps.batch_reduce")
    op = ReduceOp.from_value(reduce_op)
    options = check_options(options)
    pairs = _normalize_pairs(value_destination_pairs)
    for _, d in pairs:
      resolve_destinations(d)
    return self.batch_reduce_implementation(op, pairs, options)

  def broadcast(self, tensor: Any, destinations: Any) -> Any:
    """Copies `tensor` (an array-like or a pytree of them) to `destinations`.

    >>> strategy = tpustrat.TPUStrategy()
    >>> ones = NcclAllReduce().broadcast(1.0, strategy.mesh)
    >>> ones, len(ones.values)
    (Mirrored(float32[]), 8)
    """
    check_cross_replica("CrossDeviceOps.broadcast")
    resolve_destinations(destinations)
    return self.broadcast_implementation(tensor, destinations)

  # -- hooks for subclasses -----------------------------------------------------------------------------

  def reduce_implementation(self, reduce_op: ReduceOp, per_replica_value: DistributedValues, destinations: Any,
                            options: CommunicationOptions) -> Any:
    """Implementation of `reduce`; override in subclasses."""
    raise NotImplementedError("reduce_implementation must be implemented in descendants of CrossDeviceOps.")

  def batch_reduce_implementation(self, reduce_op: ReduceOp, value_destination_pairs: list[tuple[DistributedValues, Any]],
                                  options: CommunicationOptions) -> list[Any]:
    """Implementation of `batch_reduce`; override in subclasses."""
    raise NotImplementedError(
        "batch_reduce_implementation must be implemented in descendants of CrossDeviceOps.")

  def broadcast_implementation(self, tensor: Any, destinations: Any) -> Any:
    """Implementation of `broadcast`: copies the tensor to every destination device (TF's `simple_broadcast`)."""
    if isinstance(tensor, PerReplica):
      raise ValueError("broadcast expects one tensor (or a Mirrored value), got a PerReplica value.")
    if isinstance(tensor, Mirrored):
      tensor = tensor.tree
    dest = resolve_destinations(destinations)
    target = dest.devices[0] if dest.single else dest.sharding
    placed = jax.tree.map(lambda x: jax.device_put(x if isinstance(x, jax.Array) else jnp.asarray(x), target), tensor)
    return deliver(placed, dest)

  def all_reduce_in_replica_context(self, reduce_op: ReduceOp | str, value: Any,
                                    options: CommunicationOptions | None = None, *,
                                    axis_name: str = REPLICA_AXIS) -> Any:
    """All-reduces `value` (an array or pytree of arrays) inside `strategy.run` with this algorithm.

    This is what `ReplicaContext.all_reduce(reduce_op, value, options)` runs on a strategy configured with
    these cross-device ops. The result is identical on every replica (`run` returns it as `Mirrored`).
    Every leaf counts once per replica: a SUM of a value that is already the same on every replica is
    ``N`` times it, and warns at trace time (`AlreadyReplicatedWarning`, as `ReplicaContext.all_reduce`)
    when the value is traced, for example gradients w.r.t. `Mirrored` parameters, which `jax.grad` has
    already summed over replicas.

    >>> strategy = tpustrat.TPUStrategy()
    >>> ring = CommunicationOptions(implementation="ring")
    >>> out = strategy.run(lambda: NcclAllReduce().all_reduce_in_replica_context(
    ...     "sum", tpustrat.get_replica_context().replica_id_in_sync_group, ring))
    >>> out, int(out.values[0])
    (Mirrored(int32[]), 28)
    """
    op = ReduceOp.from_value(reduce_op)
    options = check_options(options)
    root = self._root_in_run(axis_name)  # validates the configuration before anything is traced
    leaves, treedef = jax.tree.flatten(value)
    n = lax.axis_size(axis_name)
    gradient_semantics.warn_if_already_replicated(f"{type(self).__name__}.all_reduce_in_replica_context", leaves,
                                           axis_name, n, "num_replicas_in_sync", op.name)
    leaves = [all_reduce.to_varying(all_reduce.summable(jnp.asarray(x)), axis_name) for x in leaves]
    out = self._all_reduce_local(op, leaves, axis_name, n, options, root=root)
    return jax.tree.unflatten(treedef, out)

  # -- shared machinery of the built-in implementations ---------------------------------------------------

  def _packing(self, options: CommunicationOptions) -> tuple[Any, ...]:
    """The packing rule for a batch (see `all_reduce.plan`)."""
    return ("bytes", options.bytes_per_pack) if options.bytes_per_pack > 0 else ("tensor",)

  def _sum_packs(self, pieces: list[jax.Array], axis: str, n: int, options: CommunicationOptions,
                 root: int) -> list[jax.Array]:
    """Sums flat varying packs over `axis`; the results must be typed replicated. Default: `lax.psum`."""
    del options, root
    return [lax.psum(p, axis) for p in pieces]

  def _root_in_run(self, axis_name: str) -> int:
    """The replica (index along `axis_name`) that roots a reduction inside `strategy.run`."""
    del axis_name
    return 0

  def _reduce_packed(self, op: ReduceOp, leaves: list[jax.Array], n: int, options: CommunicationOptions,
                     reduce_packs: Callable[[list[jax.Array]], list[jax.Array]]) -> list[jax.Array]:
    """Packs local leaves, reduces the packs with `reduce_packs`, unpacks; MEAN divides by `n`."""
    buckets = all_reduce.plan([(x.shape, x.dtype) for x in leaves], self._packing(options))
    pieces, unpack = all_reduce.pack(leaves, buckets)
    out = unpack(reduce_packs(pieces))
    return [all_reduce.divide_by(x, n) for x in out] if op is ReduceOp.MEAN else out

  def _all_reduce_local(self, op: ReduceOp, leaves: list[jax.Array], axis: str, n: int,
                        options: CommunicationOptions, root: int) -> list[jax.Array]:
    """Sums local (varying) leaves over `axis` inside shard_map, packed; the results are typed replicated."""
    if not leaves:
      return []
    if n == 1:  # nothing to communicate; psum over one replica types the result replicated
      return self._reduce_packed(op, leaves, n, options, lambda ps: [lax.psum(p, axis) for p in ps])
    return self._reduce_packed(op, leaves, n, options, lambda ps: self._sum_packs(ps, axis, n, options, root))

  def _route(self, layout: Layout, dest: Destination) -> tuple[Any, ...]:
    """How one (value, destinations) pair is reduced: ("all", root) in one program, or ("delegate", ops)."""
    if set(dest.devices) == set(layout.mesh.devices.flat):
      return ("all", 0)
    # TF: an all-reduce needs the destinations on the value's devices; otherwise reduce to one device.
    return ("delegate", self.__dict__.setdefault("_simple_cross_replica_ops", ReductionToOneDevice()))

  def _reduce_pairs(self, op: ReduceOp, pairs: Sequence[tuple[DistributedValues, Any]],
                    options: CommunicationOptions) -> list[Any]:
    """Reduces every pair; pairs that share a mesh and a route go through one compiled program."""
    groups: dict[Any, list[tuple[int, Layout, Destination]]] = {}
    delegated: dict[int, Any] = {}
    for i, (value, destinations) in enumerate(pairs):
      layout, dest = layout_of(value), resolve_destinations(destinations)
      route = self._route(layout, dest)
      if route[0] == "delegate":
        delegated[i] = route[1]
        continue
      groups.setdefault((layout.mesh, layout.axis, route), []).append((i, layout, dest))
    results: list[Any] = [None] * len(pairs)
    for i, ops in delegated.items():
      results[i] = ops.batch_reduce_implementation(op, [pairs[i]], options)[0]
    for (mesh, axis, route), items in groups.items():
      flat = [x for _, layout, _ in items for x in layout.leaves]
      kinds = tuple(layout.kind for _, layout, _ in items for _ in layout.leaves)
      out = self._run_program(op, mesh, axis, kinds, route, options, flat)
      it = iter(out)
      for i, layout, dest in items:
        tree = jax.tree.unflatten(layout.treedef, [next(it) for _ in layout.leaves])
        results[i] = deliver(tree, dest)
    return results

  def _run_program(self, op: ReduceOp, mesh: Mesh, axis: str, kinds: tuple[str, ...], route: tuple[Any, ...],
                   options: CommunicationOptions, flat: list[jax.Array]) -> list[jax.Array]:
    key = (mesh, axis, kinds, op, route, options)
    programs = self.__dict__.setdefault("_programs", {})  # subclasses may skip CrossDeviceOps.__init__
    program = programs.get(key)
    if program is None:
      program = programs[key] = jax.jit(_with_wait_token(self._make_program(op, mesh, axis, kinds, route, options)))
    return _dispatch(program, flat)

  def _make_program(self, op: ReduceOp, mesh: Mesh, axis: str, kinds: tuple[str, ...], route: tuple[Any, ...],
                    options: CommunicationOptions) -> Callable[[list[jax.Array]], Any]:
    n = mesh.shape[axis]
    mode, root = route
    in_specs = [P(axis) if k == "stacked" else P() for k in kinds]

    def local(xs: list[jax.Array], checked: bool) -> list[jax.Array]:
      out = []
      for x, k in zip(xs, kinds):
        x = all_reduce.summable(x[0] if k == "stacked" else x)
        out.append(all_reduce.to_varying(x, axis) if checked else x)
      return out

    if mode == "all":
      def body(xs: list[jax.Array]) -> list[jax.Array]:
        return self._all_reduce_local(op, local(xs, True), axis, n, options, root)

      return jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=P(), check_vma=True)

    def body_one(xs: list[jax.Array]) -> list[jax.Array]:  # mode "one": the result on replica `root` only
      return [x[None] for x in self._reduce_to_root_local(op, local(xs, False), axis, n, options, root)]

    return jax.shard_map(body_one, mesh=mesh, in_specs=(in_specs,), out_specs=P(axis), check_vma=False)

  def _reduce_to_root_local(self, op: ReduceOp, leaves: list[jax.Array], axis: str, n: int,
                            options: CommunicationOptions, root: int) -> list[jax.Array]:
    raise NotImplementedError(  # only ReductionToOneDevice routes to one device
        f"{type(self).__name__} cannot reduce to a single device inside a program; use ReductionToOneDevice.")


def _check_num_packs(num_packs: Any, who: str) -> int:
  num_packs = check_int(num_packs, who, "num_packs")
  if num_packs < 0:  # TF's message
    raise ValueError(f"{who} requires num_packs >= 0, but {num_packs} is specified")
  return int(num_packs)


class ReductionToOneDevice(CrossDeviceOps):
  """Copies every replica's value to one device, adds them there, and copies the sum to the destinations.

  TF's `tf.distribute.ReductionToOneDevice`. In one compiled program: ``n - 1`` collective-permutes bring
  the components to the reduce device, which alone applies `accumulation_fn` (in replica order); for
  destinations on every replica's device a binomial tree of permutes broadcasts the result; for one
  destination device the result stays where it was computed (or is copied there).

  Inside `strategy.run` (`ReplicaContext.all_reduce` on a strategy configured with these ops, or
  `all_reduce_in_replica_context`) the reduction is part of the step's program over the strategy's mesh,
  so the reduce device must be one of the mesh's devices; default: the first replica's device.

  Args:
    reduce_to_device: the device (a `jax.Device` or device string) that sums; default: the first
      destination device. In the cross-replica context (`reduce`, `batch_reduce`,
      `strategy.extended.reduce_to`), a device outside the value's devices sums outside the program (the
      components are copied to it, as in TF). Inside `strategy.run` it must be a device of the
      strategy's mesh.
    accumulation_fn: a function from a list of same-shaped arrays to their sum; default: `add_n`.

  Raises:
    TypeError: if `reduce_to_device` is not None, a `jax.Device` or a string, or `accumulation_fn` is
      not callable.
    ValueError: when it is used, if `reduce_to_device` names no device of this process, or, inside
      `strategy.run`, a device outside the strategy's mesh (the message lists the mesh's devices).

  >>> strategy = tpustrat.TPUStrategy()
  >>> v = strategy.experimental_distribute_values_from_function(lambda ctx: float(ctx.replica_id_in_sync_group))
  >>> ops = ReductionToOneDevice(reduce_to_device="/cpu:3")
  >>> print(strategy.experimental_local_results(ops.reduce("sum", v, destinations=v))[0])
  28.0
  """

  def __init__(self, reduce_to_device: Any = None,
               accumulation_fn: Callable[[list[jax.Array]], Any] | None = None) -> None:
    super().__init__()
    if reduce_to_device is not None and not isinstance(reduce_to_device, (str, jax.Device)):
      raise TypeError(f"reduce_to_device must be None, a jax.Device or a device string, got {reduce_to_device!r}.")
    if accumulation_fn is not None and not callable(accumulation_fn):
      raise TypeError(f"accumulation_fn must be callable, got {accumulation_fn!r}.")
    self.reduce_to_device = reduce_to_device
    self.accumulation_fn = accumulation_fn or all_reduce.add_n

  def __repr__(self) -> str:
    return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"

  def _device(self) -> Any:
    d = self.reduce_to_device
    return device_from_string(d, what=f"ReductionToOneDevice(reduce_to_device={d!r})") if isinstance(d, str) else d

  def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):  # noqa: D102
    return self._reduce_pairs(reduce_op, [(per_replica_value, destinations)], options)[0]

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):  # noqa: D102
    return self._reduce_pairs(reduce_op, value_destination_pairs, options)

  def _route(self, layout: Layout, dest: Destination) -> tuple[Any, ...]:
    device = self._device() or dest.devices[0]
    where = np.argwhere(layout.mesh.devices == device)
    if not len(where):
      return ("host", device)
    root = int(where[0][layout.mesh.axis_names.index(layout.axis)])
    if set(dest.devices) == set(layout.mesh.devices.flat):
      return ("all", root)
    return ("one", root, device)

  def _reduce_pairs(self, op, pairs, options):  # noqa: D102
    results: list[Any] = [None] * len(pairs)
    rest = []
    for i, (value, destinations) in enumerate(pairs):
      layout, dest = layout_of(value), resolve_destinations(destinations)
      route = self._route(layout, dest)
      if route[0] == "host":
        results[i] = deliver(self._reduce_on_host(op, layout, route[1]), dest)
      elif route[0] == "one":
        out = self._run_program(op, layout.mesh, layout.axis, (layout.kind,) * len(layout.leaves),
                                ("one", route[1]), options, layout.leaves)
        device = route[2]
        tree = jax.tree.unflatten(layout.treedef, [shard_on(x, device) for x in out])
        results[i] = deliver(tree, dest)
      else:
        rest.append(i)
    if rest:
      done = super()._reduce_pairs(op, [pairs[i] for i in rest], options)
      for i, r in zip(rest, done):
        results[i] = r
    return results

  def _reduce_on_host(self, op: ReduceOp, layout: Layout, device: Any) -> Any:
    """The reduce device is outside the value's mesh: copy the components there and add them."""
    n = layout.num_components
    out = []
    for x in layout.leaves:
      parts = components(x, layout) if layout.kind == "stacked" else [x] * n
      parts = [jax.device_put(p, device) for p in parts]
      total = all_reduce.accumulate_on_device(parts, self.accumulation_fn)
      out.append(all_reduce.divide_by(total, n) if op is ReduceOp.MEAN else total)
    return jax.tree.unflatten(layout.treedef, out)

  def _sum_packs(self, pieces, axis, n, options, root):  # noqa: D102
    fn = self.accumulation_fn

    def algorithm(xs: list[jax.Array]) -> list[jax.Array]:
      return [all_reduce.tree_broadcast(all_reduce.reduce_to_root(x, axis, n, root, fn), axis, n, root) for x in xs]

    return all_reduce.as_replicated(algorithm, pieces, axis)

  def _reduce_to_root_local(self, op, leaves, axis, n, options, root):  # noqa: D102
    fn = self.accumulation_fn
    return self._reduce_packed(op, leaves, n, options,
                               lambda ps: [all_reduce.reduce_to_root(p, axis, n, root, fn) for p in ps])

  def _root_in_run(self, axis_name: str) -> int:
    """The index of `reduce_to_device` along `axis_name` of the current strategy's mesh.

    A program over the mesh can only sum on one of its devices: any other device is an error (TF's
    replica-context all-reduce, a cross-replica call, could copy to it; one compiled program cannot).
    """
    if self.reduce_to_device is None:
      return 0
    device = self._device()
    mesh = getattr(context_lib.get_strategy(), "mesh", None)
    if mesh is None or mesh.shape.get(axis_name) != lax.axis_size(axis_name):
      raise ValueError(
          f"{self!r}: inside a program, reduce_to_device must be a device of the mesh the reduction runs "
          f"over, but no current strategy has a mesh with the axis {axis_name!r} of size "
          f"{lax.axis_size(axis_name)}, so that device cannot be found. Call it inside strategy.run "
          "(ReplicaContext.all_reduce), or use ReductionToOneDevice() without reduce_to_device.")
    where = np.argwhere(mesh.devices == device)
    if not len(where):
      devices = ", ".join(str(d) for d in mesh.devices.flat)
      raise ValueError(
          f"{self!r}: reduce_to_device {device} is not one of the {mesh.size} devices of the strategy's "
          f"mesh ({devices}). Inside strategy.run the reduction is one program over those devices, so "
          "it can only sum on one of them: pass one of them as reduce_to_device, or None (the first "
          "replica's device). To sum on another device, reduce in the cross-replica context "
          "(strategy.extended.reduce_to), which copies the components to it.")
    return int(where[0][mesh.axis_names.index(axis_name)])


_ALGORITHMS = ("nccl", "hierarchical_copy")
DEFAULT_AGG_SMALL_GRADS_MAX_BYTES = 32 * 1024  # the default cross-device ops' packing (see the benchmark)
DEFAULT_AGG_SMALL_GRADS_MAX_GROUP = 10


class AllReduceCrossDeviceOps(CrossDeviceOps):
  """All-reduce of packed tensors (TF's `tf.contrib.distribute.AllReduceCrossDeviceOps`).

  Before the all-reduce, tensors are repacked, in this order of precedence (see the module docstring):

  1. if `num_packs` > 0, all tensors of a dtype are concatenated and cut into `num_packs` slices;
  2. otherwise, if `agg_small_grads_max_bytes` > 0 and `agg_small_grads_max_group` > 0, runs of
     consecutive tensors of at most `agg_small_grads_max_bytes` bytes are concatenated into groups of
     at most `agg_small_grads_max_group` tensors;
  3. otherwise, no repacking: one all-reduce per tensor.

  A per-call `CommunicationOptions(bytes_per_pack=b)` with ``b > 0`` overrides these rules, and
  `CommunicationOptions.implementation` (`NCCL`, `RING`) overrides `all_reduce_alg`. Destinations on
  devices other than the value's are reduced with `ReductionToOneDevice`, as in TF.

  Args:
    all_reduce_alg: ``"nccl"`` (one XLA all-reduce per pack) or ``"hierarchical_copy"`` (copies to group
      leaders, a swap between them, copies back; collective-permutes only).
    num_packs: see above; must be >= 0.
    agg_small_grads_max_bytes: see above.
    agg_small_grads_max_group: see above.

  Raises:
    ValueError: for an unknown `all_reduce_alg`, a negative `num_packs`, or, when small-tensor
      aggregation is asked for (`num_packs` is 0 and `agg_small_grads_max_bytes` is not), if
      `agg_small_grads_max_bytes` and `agg_small_grads_max_group` are not both greater than zero.

  >>> AllReduceCrossDeviceOps("hierarchical_copy", num_packs=0, agg_small_grads_max_bytes=1024)
  AllReduceCrossDeviceOps(all_reduce_alg='hierarchical_copy', num_packs=0, agg_small_grads_max_bytes=1024, agg_small_grads_max_group=10)
  """

  def __init__(self, all_reduce_alg: str = "nccl", num_packs: int = 1, agg_small_grads_max_bytes: int = 0,
               agg_small_grads_max_group: int = 10) -> None:
    super().__init__()
    if not isinstance(all_reduce_alg, str) or all_reduce_alg.lower() not in _ALGORITHMS:
      raise ValueError(
          f"Unknown all_reduce_alg {all_reduce_alg!r}: only 'nccl' or 'hierarchical_copy' are supported.")
    num_packs = _check_num_packs(num_packs, type(self).__name__)
    for name, v in (("agg_small_grads_max_bytes", agg_small_grads_max_bytes),
                    ("agg_small_grads_max_group", agg_small_grads_max_group)):
      check_int(v, type(self).__name__, name)
    if num_packs == 0 and agg_small_grads_max_bytes != 0 and not (
        agg_small_grads_max_bytes > 0 and agg_small_grads_max_group > 0):
      raise ValueError(
          "agg_small_grads_max_bytes and agg_small_grads_max_group should both be greater than zero, got "
          f"agg_small_grads_max_bytes={agg_small_grads_max_bytes}, "
          f"agg_small_grads_max_group={agg_small_grads_max_group}.")
    self._all_reduce_alg = all_reduce_alg.lower()
    self._num_packs = num_packs
    self._agg_small_grads_max_bytes = int(agg_small_grads_max_bytes)
    self._agg_small_grads_max_group = int(agg_small_grads_max_group)
    self._simple_cross_replica_ops = ReductionToOneDevice()

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(all_reduce_alg={self._all_reduce_alg!r}, num_packs={self._num_packs}, "
            f"agg_small_grads_max_bytes={self._agg_small_grads_max_bytes}, "
            f"agg_small_grads_max_group={self._agg_small_grads_max_group})")

  def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):  # noqa: D102
    return self._reduce_pairs(reduce_op, [(per_replica_value, destinations)], options)[0]

  def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):  # noqa: D102
    return self._reduce_pairs(reduce_op, value_destination_pairs, options)

  def _packing(self, options: CommunicationOptions) -> tuple[Any, ...]:
    if options.bytes_per_pack > 0:  # a per-call bytes_per_pack takes precedence over every rule below
      return super()._packing(options)
    if self._num_packs > 0:
      return ("split", self._num_packs)
    if self._agg_small_grads_max_bytes > 0 and self._agg_small_grads_max_group > 0:
      return ("small", self._agg_small_grads_max_bytes, self._agg_small_grads_max_group)
    return ("tensor",)

  def _algorithm(self, options: CommunicationOptions) -> str:
    impl = options.implementation
    if impl is CommunicationImplementation.NCCL:
      return "nccl"
    if impl is CommunicationImplementation.RING:
      return "ring"
    return self._all_reduce_alg

  def _sum_packs(self, pieces, axis, n, options, root):  # noqa: D102
    alg = self._algorithm(options)
    if alg == "nccl":
      return [lax.psum(p, axis) for p in pieces]
    if alg == "ring":
      return all_reduce.as_replicated(lambda xs: [all_reduce.ring_sum(x, axis, n) for x in xs], pieces, axis)
    return all_reduce.as_replicated(lambda xs: [all_reduce.hierarchical_sum(x, axis, n, i) for i, x in enumerate(xs)], pieces, axis)


class NcclAllReduce(AllReduceCrossDeviceOps):
  """All-reduce with one XLA all-reduce per pack (TF's `tf.distribute.NcclAllReduce`).

  XLA lowers its all-reduce to NCCL on GPUs, to the interconnect on TPUs and to shared memory on CPUs.

  Args:
    num_packs: tensors of each dtype are concatenated and cut into this many packs; 0: one all-reduce
      per tensor. Must be >= 0.

  >>> NcclAllReduce(num_packs=2)
  NcclAllReduce(num_packs=2)
  """

  def __init__(self, num_packs: int = 1) -> None:
    num_packs = _check_num_packs(num_packs, "NCCL all-reduce")
    super().__init__(all_reduce_alg="nccl", num_packs=num_packs)

  def __repr__(self) -> str:
    return f"NcclAllReduce(num_packs={self._num_packs})"


class HierarchicalCopyAllReduce(AllReduceCrossDeviceOps):
  """Two-level all-reduce by copies (TF's `tf.distribute.HierarchicalCopyAllReduce`, made for DGX-1).

  The devices form two halves. For each pack, every member of a half copies its tensor to the half's
  leader, which adds them; the two leaders swap their sums and add; each leader copies the total back to
  the members of its half. Leaders rotate from pack to pack. All copies are XLA collective-permutes in
  one program; no all-reduce is used.

  Args:
    num_packs: tensors of each dtype are concatenated and cut into this many packs; 0: one pack per
      tensor. Must be >= 0.

  >>> HierarchicalCopyAllReduce()
  HierarchicalCopyAllReduce(num_packs=1)
  """

  def __init__(self, num_packs: int = 1) -> None:
    num_packs = _check_num_packs(num_packs, "HierarchicalCopy")
    super().__init__(all_reduce_alg="hierarchical_copy", num_packs=num_packs)

  def __repr__(self) -> str:
    return f"HierarchicalCopyAllReduce(num_packs={self._num_packs})"


def default_cross_device_ops() -> CrossDeviceOps:
  """The cross-device ops a strategy uses when none is given: XLA all-reduce with small-gradient aggregation.

  `AllReduceCrossDeviceOps("nccl", num_packs=0, agg_small_grads_max_bytes=32 KiB,
  agg_small_grads_max_group=10)`: tensors of up to 32 KiB are concatenated in groups of up to 10, larger
  ones get an all-reduce each. On a ResNet-50-like gradient list
  (`benchmarks/bench_cross_device_ops.py`; figures in docs/benchmarks.md) it was the only setting never
  slower than one all-reduce per tensor, and the fastest or tied for fastest at every model size measured,
  while concatenating everything (TF's default ``num_packs=1``) ranged from 0.56x (2.4 MiB of gradients) to 2x
  slower (26 MiB and up): copying every gradient twice costs more than the collectives it saves once the
  model is large.

  >>> default_cross_device_ops()
  AllReduceCrossDeviceOps(all_reduce_alg='nccl', num_packs=0, agg_small_grads_max_bytes=32768, agg_small_grads_max_group=10)
  """
  return AllReduceCrossDeviceOps("nccl", num_packs=0, agg_small_grads_max_bytes=DEFAULT_AGG_SMALL_GRADS_MAX_BYTES,
                                 agg_small_grads_max_group=DEFAULT_AGG_SMALL_GRADS_MAX_GROUP)
