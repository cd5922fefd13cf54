"""Many steps per compiled program: TF's multi-step TPU loop, as one `jax.jit` of a `lax.scan`.

TF makes TPU training fast by running several steps inside one `tf.function`
(``for _ in tf.range(steps): strategy.run(step_fn, args=(next(iterator),))``), so the host launches one
program per ``k`` steps. In JAX the loop is a `lax.scan` over ``k`` batches stacked on a new leading axis,
with `strategy.run` in its body: `PerReplica` and `Mirrored` are pytrees, so `scan` slices and stacks
them like any container, and `run` traced inside the outer program still infers which outputs are
replicated.

Layout of ``k`` stacked steps: the pytree of one step with every array given a leading steps axis (JAX's
usual stacked-pytree convention). A `PerReplica` leaf becomes ``[k, num_replicas, ...]``, split over its
*second* axis (``P(None, 'replica')``), so that step ``i`` is the ordinary ``[num_replicas, ...]``
`PerReplica` that `lax.scan` hands to the body without moving data between devices; the real-row counts
of padded batches become ``[k, num_replicas]``, so partial batches stay exact inside the loop. A
`Mirrored` leaf becomes a replicated ``[k, ...]`` array.

* `DistributedIterator.take_steps(k)` hands out the next ``k`` batches of a distributed dataset in that
  layout, already on the devices (fewer at the end of the data).
* `strategy.experimental_run_steps(fn, iterator, steps, init)` runs ``carry, output = fn(carry, batch)``
  for ``steps`` batches as one program (cached per ``fn``) and returns the last carry and the outputs
  stacked per step; it bounds programs in flight like `run`.
* `stack_steps` / `unstack_steps` convert between a list of per-step values and the stacked layout.
"""

from __future__ import annotations

import collections
import collections.abc
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src.engine import RunOptions
from tpustrat._src.jax_compat import varying_axes
from tpustrat._src.values import Mirrored, PerReplica, is_distributed, name_replica_axis, stacked_steps

if TYPE_CHECKING:
  from tpustrat._src.strategy import Strategy

__all__ = ["stack_steps", "unstack_steps"]

_CACHE_SIZE = 64


# -- checks ------------------------------------------------------------------------------------------


def check_steps(steps: Any, what: str, name: str = "steps") -> int:
  """`steps` as an int, or a clear error if it is not an int >= 1."""
  if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)):
    raise TypeError(f"{what}: `{name}` must be an int >= 1, got {type(steps).__name__} {steps!r:.60}.")
  if steps < 1:
    raise ValueError(f"{what}: `{name}` must be >= 1 (the number of steps per compiled program), got {steps}.")
  return int(steps)


def _named_leaves(tree: Any) -> list[tuple[str, Any]]:
  """(readable path, array) for every array of `tree`; a padded batch's counts are named as such."""
  out = []
  for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_distributed)[0]:
    name = jax.tree_util.keystr(path) or "<root>"
    if not is_distributed(node):
      out.append((name, node))
      continue
    inner = jax.tree_util.tree_flatten_with_path(node._value)[0]  # pylint: disable=protected-access
    out.extend((name + jax.tree_util.keystr(p), x) for p, x in inner)
    if isinstance(node, PerReplica) and node._valid is not None:  # pylint: disable=protected-access
      out.append((f"{name} (real-row counts)", node._valid))  # pylint: disable=protected-access
  return out


def num_steps(stacked: Any, what: str) -> int:
  """The common leading (steps) size of every array of `stacked`, or a clear error."""
  sizes0 = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(stacked)}
  if len(sizes0) == 1 and None not in sizes0:
    return sizes0.pop()
  named = _named_leaves(stacked)
  if not named:
    raise ValueError(f"{what}: the stacked batches hold no arrays ({stacked!r:.100}).")
  sizes = {}
  for name, x in named:
    shape = np.shape(x)
    if not shape:
      raise ValueError(
          f"{what}: the leaf at {name} is a scalar; stacked batches carry the steps on the leading axis "
          "of every array.")
    sizes[name] = shape[0]
  if len(set(sizes.values())) != 1:
    detail = ", ".join(f"{name}: {size}" for name, size in sizes.items())
    raise ValueError(
        f"{what}: a stacked batch must have the same number of steps on the leading axis of every leaf, "
        f"got {detail}. Stack whole steps (tpustrat.stack_steps, DistributedIterator.take_steps).")
  return next(iter(sizes.values()))


def check_not_stacked(value: Any, what: str) -> None:
  """Raises if `value` holds a `PerReplica` laid out as stacked steps (for host-side reduce/gather)."""
  for node in jax.tree.leaves(value, is_leaf=is_distributed):
    if isinstance(node, PerReplica):
      leaves = jax.tree.leaves(node._value)  # pylint: disable=protected-access
      k = stacked_steps(leaves[0]) if leaves else None
      if k is not None:
        raise ValueError(
            f"{what}: the PerReplica value {node!r} holds {k} stacked steps ([steps, num_replicas, ...]), "
            "as experimental_run_steps and take_steps return them. Take the steps apart first: "
            "tpustrat.unstack_steps(value)[i] is step i as strategy.run returns it.")


# -- stacking and unstacking steps -----------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=1)
def _concat_device(columns: list[list[Any]], singles: tuple[bool, ...]) -> list[Any]:
  """Per leaf, the parts concatenated on a leading steps axis (single steps get a new axis)."""
  return [jnp.concatenate([x[None] if s else x for x, s in zip(col, singles)]) for col in columns]


@jax.jit
def _split_device(leaves: list[Any]) -> list[list[Any]]:
  return [list(x) for x in leaves]


@functools.partial(jax.jit, static_argnums=1)
def _cut_device(leaves: list[Any], m: int) -> tuple[list[Any], list[Any]]:
  return [x[:m] for x in leaves], [x[m:] for x in leaves]


def _per_place(items: list[Any], host: Callable[[Any], Any], device: Callable[[list[Any]], Sequence[Any]]) -> list[Any]:
  """`host(item)` for the items on the host (numpy arrays, or lists of them), one jitted `device(items)`
  call for all the others."""
  out = list(items)
  moved = []
  for j, x in enumerate(items):
    if all(isinstance(y, (np.ndarray, np.generic)) for y in (x if isinstance(x, list) else [x])):
      out[j] = host(x)
    else:
      moved.append(j)
  if moved:
    for j, y in zip(moved, device([items[j] for j in moved])):
      out[j] = y
  return out


def concat_chunks(chunks: Sequence[tuple[Any, int | None]], what: str) -> Any:
  """Concatenates chunks on a new leading steps axis: ``(tree, None)`` is one step, ``(tree, n)`` n stacked
  steps. Every chunk must have one step's structure, shapes and dtypes."""
  tree0, n0 = chunks[0]
  leaves0, treedef = jax.tree.flatten(tree0)
  names = [name for name, _ in _named_leaves(tree0)]
  step_shapes = [(np.shape(x) if n0 is None else np.shape(x)[1:], jnp.result_type(x)) for x in leaves0]
  columns: list[list[Any]] = [[] for _ in leaves0]
  for i, (tree, n) in enumerate(chunks):
    leaves, tdef = jax.tree.flatten(tree)
    if tdef != treedef:
      raise ValueError(
          f"{what}: step {i} has tree structure {tdef}, but step 0 has {treedef}; stacked steps must share "
          "one structure (including which PerReplica values are padded batches).")
    for j, x in enumerate(leaves):
      got = (np.shape(x) if n is None else np.shape(x)[1:], jnp.result_type(x))
      if got != step_shapes[j]:
        name = names[j] if len(names) == len(leaves0) else f"leaf {j}"
        raise ValueError(
            f"{what}: steps must have the same shapes and dtypes to be stacked, but the leaf at {name} is "
            f"{got[1]}{list(got[0])} in step {i} and {step_shapes[j][1]}{list(step_shapes[j][0])} in step 0.")
      columns[j].append(x)
  singles = tuple(n is None for _, n in chunks)
  out = _per_place(columns,
                   lambda col: np.concatenate([np.asarray(x)[None] if s else x for x, s in zip(col, singles)]),
                   lambda cols: _concat_device(cols, singles))
  # One replica: the program returns the steps without 'replica' on their second axis (see stacked_steps).
  return name_replica_axis(jax.tree.unflatten(treedef, out), steps=True)


def cut_chunk(tree: Any, m: int) -> tuple[Any, Any]:
  """Splits stacked steps into the first `m` steps and the rest (both stacked)."""
  leaves, treedef = jax.tree.flatten(tree)
  cut = _per_place(leaves, lambda x: (x[:m], x[m:]),
                   lambda xs: list(zip(*_cut_device(xs, m))))
  first, rest = [a for a, _ in cut], [b for _, b in cut]
  return (name_replica_axis(jax.tree.unflatten(treedef, first), steps=True),
          name_replica_axis(jax.tree.unflatten(treedef, rest), steps=True))


def stack_steps(values: Sequence[Any]) -> Any:
  """Stacks per-step values (batches, or results of `strategy.run`) on a new leading steps axis.

  The result is what `DistributedIterator.take_steps` returns and what a `lax.scan` over
  `strategy.run` takes (and gives back): the pytree of one step, every array with a leading steps axis.
  A `PerReplica` leaf ``[num_replicas, ...]`` becomes ``[steps, num_replicas, ...]``, still split over
  the replicas (on its second axis); real-row counts of padded batches are stacked too.

  >>> strategy = tpustrat.TPUStrategy()
  >>> one = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(3, np.float32))
  >>> stacked = stack_steps([one, one, one, one])
  >>> stacked
  PerReplica(steps=4, num_replicas=8, component=float32[3])
  >>> len(unstack_steps(stacked)), unstack_steps(stacked)[0]
  (4, PerReplica(num_replicas=8, component=float32[3]))

  Args:
    values: a non-empty sequence of pytrees with one structure, shapes and dtypes.

  Returns:
    The stacked pytree, on the devices where the steps were.

  Raises:
    ValueError: if the steps differ in structure, shape or dtype.
  """
  what = "tpustrat.stack_steps"
  if isinstance(values, (str, bytes)) or not isinstance(values, collections.abc.Sequence) or not values:
    raise TypeError(f"{what} expects a non-empty list of per-step values, got {type(values).__name__}: "
                    f"{values!r:.100}.")
  return concat_chunks([(v, None) for v in values], what)


def unstack_steps(stacked: Any) -> tuple[Any, ...]:
  """Splits stacked steps into a tuple of per-step values, each as `strategy.run` returns (or takes) it.

  The inverse of `stack_steps`: step ``i`` of the per-step outputs of `experimental_run_steps` (or of a
  `lax.scan` over `strategy.run`) is ``unstack_steps(outputs)[i]``, ready for `strategy.reduce`,
  `strategy.gather` and `experimental_local_results` (padding rows of partial batches still excluded).

  >>> strategy = tpustrat.TPUStrategy()
  >>> steps = unstack_steps({"loss": tpustrat.Mirrored(jnp.arange(3.0))})
  >>> [float(s["loss"].values[0]) for s in steps]
  [0.0, 1.0, 2.0]

  Raises:
    ValueError: if the arrays do not all have the same leading (steps) size.
  """
  k = num_steps(stacked, "tpustrat.unstack_steps")
  leaves, treedef = jax.tree.flatten(stacked)
  parts = _per_place(leaves, lambda x: [x[i] for i in range(k)], _split_device)
  return tuple(name_replica_axis(jax.tree.unflatten(treedef, [p[i] for p in parts]), steps=False)
               for i in range(k))


# -- the carry -------------------------------------------------------------------------------------------


def _strong(x: Any) -> Any:
  """`x` as an array without JAX's weak type (a Python float carry would otherwise change type in a scan)."""
  if isinstance(x, (np.ndarray, np.generic)):
    return x
  if not isinstance(x, jax.Array):
    x = jnp.asarray(x)
  return lax.convert_element_type(x, x.dtype) if jax.typeof(x).weak_type else x


def _put(x: Any, sharding: NamedSharding) -> Any:
  if isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and x.sharding == sharding):
    return x
  return jax.device_put(x, sharding)


@functools.lru_cache(maxsize=16)
def _shardings(mesh: jax.sharding.Mesh) -> tuple[NamedSharding, NamedSharding]:
  """(replicated, split over the replicas) on `mesh`."""
  return NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh.axis_names[0]))


def as_carry(strategy: Strategy, value: Any) -> Any:
  """`value` laid out as `run` returns values: a `Mirrored` per replicated array leaf, a `PerReplica` per
  per-replica leaf (without padding counts), all placed where the next program wants them."""
  mesh = strategy.mesh
  if mesh is None:  # the default strategy: run returns fn's values as they are
    return jax.tree.map(_strong, value)
  replicated, split = _shardings(mesh)

  def one(node: Any) -> Any:
    if isinstance(node, PerReplica):
      return jax.tree.map(lambda x: PerReplica._wrap(_put(_strong(x), split)), node._value)  # pylint: disable=protected-access
    if isinstance(node, Mirrored):
      node = node._value  # pylint: disable=protected-access
    return jax.tree.map(lambda x: Mirrored._wrap(_put(_strong(x), replicated)), node)  # pylint: disable=protected-access

  return jax.tree.map(one, value, is_leaf=is_distributed)


def _drop_counts(tree: Any) -> Any:
  """A carry never keeps real-row counts (`run` attaches them to per-example outputs of a padded batch)."""
  return jax.tree.map(
      lambda v: PerReplica._wrap(v._value) if isinstance(v, PerReplica) and v._valid is not None else v,  # pylint: disable=protected-access
      tree, is_leaf=is_distributed)


def _as_output(x: Any, where: str) -> Any:
  if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)) or hasattr(x, "__jax_array__"):
    return jnp.asarray(x)
  raise TypeError(
      f"experimental_run_steps: fn returned {type(x).__name__} {x!r:.80} at {where}, which cannot be "
      "stacked over steps; fn must return (carry, output) with arrays, Python numbers or pytrees of them.")


class _ReplicaStep:
  """`fn(carry, batch) -> (carry, output)` as one replica runs it, checked so that it can be scanned.

  The carry must keep its structure, shapes and dtypes. A carry that enters per replica stays per replica
  (a replicated new value is cast to varying); one that enters replicated (`Mirrored`) must come back
  replicated, as TF requires of mirrored variables updated in a replica context.
  """

  def __init__(self, fn: Callable[..., Any]) -> None:
    self._fn = fn
    self.__name__ = getattr(fn, "__name__", "fn")

  def __call__(self, carry: Any, batch: Any) -> Any:
    result = self._fn(carry, batch)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
      raise TypeError(
          "experimental_run_steps: fn(carry, batch) must return a pair (new_carry, output), like the body "
          f"of jax.lax.scan; got {type(result).__name__}: {result!r:.100}.")
    new, out = result
    old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(carry)
    new_leaves, new_tree = jax.tree.flatten(new)
    if new_tree != old_tree:
      raise ValueError(
          f"experimental_run_steps: fn must return the carry with the structure it received, got {new_tree} "
          f"for a carry of structure {old_tree}.")
    axis = getattr(context_lib.get_replica_context(), "_axis_name", None)
    fixed = []
    for (path, c), n in zip(old_leaves, new_leaves):
      where = "the carry at " + (jax.tree_util.keystr(path) or "<root>")
      n = _as_output(n, where)
      c = jnp.asarray(c)
      if n.shape != c.shape or n.dtype != c.dtype:
        raise ValueError(
            f"experimental_run_steps: {where} enters fn as {c.dtype}{list(c.shape)} but fn returns "
            f"{n.dtype}{list(n.shape)}; a carry keeps its shape and dtype from step to step.")
      if jax.typeof(n).weak_type and not jax.typeof(c).weak_type:
        n = lax.convert_element_type(n, c.dtype)
      if axis is not None:
        was, now = axis in varying_axes(c), axis in varying_axes(n)
        if was and not now:
          n = lax.pcast(n, axis, to="varying")
        elif now and not was:
          raise ValueError(
              f"experimental_run_steps: {where} enters fn replicated (the same on every replica, Mirrored) "
              "but fn returns a value that differs between replicas. Combine it across replicas "
              "(tpustrat.get_replica_context().all_reduce) or start it per replica (a PerReplica value, "
              "e.g. from strategy.experimental_distribute_values_from_function).")
      fixed.append(n)
    out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(out)
    outs = [_as_output(x, "the output at " + (jax.tree_util.keystr(p) or "<root>")) for p, x in out_leaves]
    return jax.tree.unflatten(new_tree, fixed), jax.tree.unflatten(jax.tree.structure(out), outs)


# -- experimental_run_steps ---------------------------------------------------------------------------------

_PROGRAMS: weakref.WeakKeyDictionary[Any, collections.OrderedDict[Any, Callable[..., Any]]] = (
    weakref.WeakKeyDictionary())


def _make_program(strategy: Strategy, fn: Callable[..., Any]) -> Callable[..., Any]:
  step = _ReplicaStep(fn)
  strategy_ref = weakref.ref(strategy)  # the cache entry must not keep its strategy alive

  def run_steps_program(carry: Any, batches: Any) -> Any:
    run = strategy_ref().run

    def body(c: Any, batch: Any) -> Any:
      c, out = run(step, args=(c, batch))
      return _drop_counts(c), out

    return lax.scan(body, carry, batches)

  run_steps_program.__name__ = f"run_steps_{step.__name__}"
  return jax.jit(run_steps_program)


def _program(strategy: Strategy, fn: Callable[..., Any]) -> Callable[..., Any]:
  cache = _PROGRAMS.setdefault(strategy, collections.OrderedDict())
  try:
    program = cache[fn]
  except KeyError:
    program = cache[fn] = _make_program(strategy, fn)
    if len(cache) > _CACHE_SIZE:
      cache.popitem(last=False)
  except TypeError:  # an unhashable callable: compile without caching
    program = _make_program(strategy, fn)
  return program


def take(iterator: Any, steps: int, what: str) -> Any:
  """The next `steps` batches of `iterator`, stacked (fewer at the end); StopIteration when none is left."""
  take_steps = getattr(iterator, "take_steps", None)
  if take_steps is not None:
    return take_steps(steps)
  batches = []
  for _ in range(steps):
    try:
      batches.append(next(iterator))
    except StopIteration:
      break
  if not batches:
    raise StopIteration
  return concat_chunks([(b, None) for b in batches], what)


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, int, float, complex, bool)


def _check_stacked_input(batches: Any, what: str) -> None:
  if not all(isinstance(x, _ARRAY_TYPES) for x in jax.tree.leaves(batches)):
    for name, x in _named_leaves(batches):
      if not isinstance(x, _ARRAY_TYPES):
        raise TypeError(
            f"{what} expects an iterator of batches (e.g. iter(distributed_dataset)) or batches already "
            f"stacked on a leading steps axis; got {type(batches).__name__} with {type(x).__name__} "
            f"{x!r:.80} at {name}.")
  for node in jax.tree.leaves(batches, is_leaf=is_distributed):
    if isinstance(node, PerReplica):
      x = next(iter(jax.tree.leaves(node._value)), None)  # pylint: disable=protected-access
      spec = getattr(getattr(x, "sharding", None), "spec", None)
      if spec and spec[0] is not None and stacked_steps(x) is None:
        raise ValueError(
            f"{what}: {node!r} is one step's value (split over the replicas on its leading axis), not stacked "
            "steps. Pass an iterator (iter(batches)), or stack the steps first with tpustrat.stack_steps.")


def run_steps(strategy: Strategy, fn: Callable[..., Any], iterator: Any, steps: int | None, init: Any,
              options: RunOptions | None) -> tuple[Any, Any]:
  """`Strategy.experimental_run_steps`.

  The compiled program is cached per `fn` object: pass the same function object on every call (a new
  lambda or closure per call compiles again).
  """
  what = "experimental_run_steps"
  if not callable(fn):
    raise TypeError(f"{what} expects a callable `fn(carry, batch)`, got {type(fn).__name__}: {fn!r:.100}.")
  if options is not None and not isinstance(options, RunOptions):
    raise TypeError(f"{what} expects `options` to be a tpustrat.RunOptions or None, got {options!r:.100}.")
  if steps is not None:
    steps = check_steps(steps, what)
  if isinstance(iterator, collections.abc.Iterator):
    if steps is None:
      raise TypeError(f"{what}: `steps` (how many batches to take from the iterator) is required.")
    batches = take(iterator, steps, what)
  elif isinstance(iterator, collections.abc.Iterable) and not isinstance(iterator, (dict, list, tuple)) and (
      not is_distributed(iterator)):
    raise TypeError(
        f"{what} takes an iterator, so that each call continues where the last one stopped: pass "
        f"iter({type(iterator).__name__}), not the {type(iterator).__name__} itself.")
  else:
    _check_stacked_input(iterator, what)
    batches = iterator
    k = num_steps(batches, what)
    if steps is not None and steps != k:
      raise ValueError(f"{what}: `steps` is {steps} but the stacked batches hold {k} steps.")
  carry = as_carry(strategy, init)
  program = _program(strategy, fn)
  engine = strategy._engine  # pylint: disable=protected-access
  if engine is None:  # the default strategy: one device, no collectives to bound
    return program(carry, batches)
  limit = (options.max_steps_in_flight if options is not None else None) or engine.max_steps_in_flight
  engine._in_flight.before_dispatch(limit)  # pylint: disable=protected-access
  carry, outputs = program(carry, batches)
  leaves = jax.tree.leaves((carry, outputs))
  if leaves:  # all outputs of one program are ready together: wait on the smallest
    engine._in_flight.after_dispatch(min(leaves, key=lambda x: x.size * getattr(x.dtype, "itemsize", 8)))  # pylint: disable=protected-access
  # One replica: XLA's layouts do not say which outputs are stacked steps (see stacked_steps).
  return name_replica_axis(carry, steps=False), name_replica_axis(outputs, steps=True)
