"""Many steps per compiled program: TF's multi-step TPU loop, as one `jax.jit` of a `lax.scan`.

TF makes TPU training fast by running several steps inside one `tf.function`
(``for _ in tf.range(steps): strategy.run(step_fn, args=(next(iterator),))``), so the host launches one
program per ``k`` steps. In JAX the loop is a `lax.scan` over ``k`` batches stacked on a new leading axis
(the layout of `tpustrat._src.steps`), with `strategy.run` in its body: `PerReplica` and `Mirrored` are
pytrees, so `scan` slices and stacks them like any container, and `run` traced inside the outer program
still infers which outputs are replicated.

* `run_steps` is `strategy.experimental_run_steps(fn, iterator, steps, init)`: it takes ``steps``
  batches (`DistributedIterator.take_steps`, or batches already stacked), runs
  ``carry, output = fn(carry, batch)`` for each as one program (cached per ``fn``), and returns the last
  carry and the outputs stacked per step. It is dispatched through the strategy's engine
  (`strategy.extended.engine.dispatch`), so it counts against the same bound on programs in flight as
  `run`.
* `as_carry` lays a value out as `run` returns values (`strategy.experimental_run_steps`'s `init`).
* `check_not_stacked` (from `tpustrat._src.steps`) is re-exported for the strategy's reduce and gather.
"""

from __future__ import annotations

import collections
import collections.abc
import functools
import operator
import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src import conv_layouts, jax_compat, profiler
from tpustrat._src import engine as engine_lib
from tpustrat._src import numerics as numerics_lib
from tpustrat._src.engine import RunOptions
from tpustrat._src.jax_compat import varying_axes
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import ShardedVariable
from tpustrat._src.steps import check_not_stacked as check_not_stacked
from tpustrat._src.steps import concat_chunks, named_leaves, num_steps
from tpustrat._src.validation import check_int, check_tree_fits_32_bits
from tpustrat._src.values import Mirrored, PerReplica, is_distributed, name_replica_axis, stacked_steps

__all__ = ["MISS", "as_carry", "check_not_stacked", "run_steps", "run_steps_fast", "take"]

_CACHE_SIZE = 64
_CONTEXT = context_lib.thread_state()


class Strategy(Protocol):
  """What `run_steps` needs of its strategy (`tpustrat.Strategy`)."""

  @property
  def mesh(self) -> jax.sharding.Mesh | None: ...

  @property
  def extended(self) -> Any: ...

  def run(self, fn: Callable[..., Any], args: Any = (), kwargs: Any = None, options: Any = None) -> Any: ...


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
  return NamedSharding(mesh, P()), NamedSharding(mesh, P(REPLICA_AXIS))


def as_carry(strategy: Strategy, value: Any, keep_counts: bool = False) -> Any:
  """`value` laid out as `run` returns values: a `Mirrored` per replicated array leaf, a `PerReplica` per
  per-replica leaf (without padding counts: a carry keeps none), all placed where the next program wants
  them. `keep_counts` (`experimental_mirror`): a `PerReplica` carrying real-row counts (a padded batch, a
  `per_example` output) stays that value, its arrays and counts placed (its padding still skipped)."""
  mesh = strategy.mesh
  if mesh is None:  # the default strategy: run returns fn's values as they are
    return jax.tree.map(_strong, value)
  check_tree_fits_32_bits(value, lambda path: "the value given to experimental_mirror (or experimental_run_steps's "
                          "init)" + (f" at {path}" if path else ""))
  replicated, split = _shardings(mesh)

  def one(node: Any) -> Any:
    if isinstance(node, ShardedVariable):  # already split over the replicas: its blocks where run wants them
      return node.map_global(lambda x: _put(x, split))
    if isinstance(node, PerReplica):
      if keep_counts and node.real_rows_array is not None:
        return node.map_global(lambda x: _put(_strong(x), split))
      return jax.tree.map(lambda x: PerReplica.from_stacked(_put(_strong(x), split)), node.tree)
    if isinstance(node, Mirrored):
      node = node.tree
    return jax.tree.map(lambda x: Mirrored.from_global(_put(_strong(x), replicated)), node)

  return jax.tree.map(one, value, is_leaf=is_distributed)


def _drop_counts(tree: Any) -> Any:
  """A carry never keeps real-row counts (`run` attaches them to per-example outputs of a padded batch)."""
  return jax.tree.map(
      lambda v: PerReplica.from_stacked(v.tree) if isinstance(v, PerReplica) and v.real_rows_array is not None
      else v,
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
    axis = context_lib.replica_axis(context_lib.get_replica_context())
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


_CHECKED = RunOptions(check_numerics=True)


class _Checked:
  """A run-steps program with `RunOptions(check_numerics=True)`: `program` returns ``(carry, outputs,
  flags)``, `flags` the inner steps' numerics flags stacked (``[steps, N, L]``); `outputs` says what they
  describe (recorded when it is traced) and counts the steps run."""

  def __init__(self, program: Callable[..., Any], outputs: numerics_lib.Outputs) -> None:
    self.program, self.outputs = program, outputs


def _make_program(strategy: Strategy, fn: Callable[..., Any], donate: tuple[int, ...] = (),
                  checked: bool = False, unroll: int | bool = 1) -> Any:
  step = _ReplicaStep(fn)
  strategy_ref = weakref.ref(strategy)  # the cache entry must not keep its strategy alive
  outputs = None
  if checked:
    mesh = strategy.mesh
    assert mesh is not None  # numerics are checked only with an engine, which only a strategy with a mesh has
    outputs = numerics_lib.Outputs([], [], numerics_lib.replica_processes(mesh, REPLICA_AXIS),
                                   f"experimental_run_steps({step.__name__})")

  padding_notes: dict[str, Any] = {}  # the padding-read warnings of the inner runs, per signature of this program
  # In a loop on XLA:CPU the step's convolutions are laid out for its fast kernel first (`conv_layouts`:
  # XLA does it in the entry computation only); unrolled, every step is in the entry computation.
  canonical = unroll is not True and conv_layouts.on_cpu(None if strategy.mesh is None else strategy.mesh.devices)

  def run_steps_program(carry: Any, batches: Any) -> Any:
    owner = strategy_ref()
    if owner is None:
      raise RuntimeError("experimental_run_steps: the strategy this program was compiled for has been deleted.")
    run = owner.run

    def body(c: Any, batch: Any) -> Any:
      if outputs is None:
        c, out = run(step, args=(c, batch))
        return _drop_counts(c), out
      with numerics_lib.collecting() as got:  # the inner run's flags, a tracer of this body
        c, out = run(step, args=(c, batch), options=_CHECKED)
      flags, inner = got[-1]
      # fn's result is (carry, output): paths read as `carry['w']`, `output[1]`; the flags carry the id of
      # the inner run's trace (`numerics.trace_of`), under which this program's trace records them
      outputs.traced([("carry" + p[3:] if p.startswith("[0]") else "output" + p[3:]) for p in inner.paths],
                     inner.kinds, inner.untraced, trace=inner.last_trace)
      return _drop_counts(c), (out, flags)

    with engine_lib.inner_padding_notes() as found:  # the inner run's padding-read warning, said by run_steps
      loop_body = conv_layouts.canonical_convolutions(body) if canonical else body
      result = lax.scan(loop_body, carry, batches, unroll=unroll)  # RunOptions.scan_unroll
    engine_lib.note_stacked_padding_reads(padding_notes, engine_lib.stacked_signature(carry, batches), found)
    if outputs is not None:  # the stacked flags: the output to wait on (a donating program's too)
      carry, (outs, flags) = result
      return carry, outs, flags
    # A donating program returns a token of its own to wait on (`_with_token`): the carry, which the next
    # call donates, cannot be waited on.
    return (*result, jnp.zeros((), jnp.int8)) if donate else result

  run_steps_program.__name__ = f"run_steps_{step.__name__}"
  program = jax.jit(run_steps_program, donate_argnums=donate)
  wrapped: Any = program if outputs is None else _Checked(program, outputs)
  wrapped.padding_notes = padding_notes  # read after each dispatch (`engine.warn_padding_reads_stacked`)
  return wrapped


class _NamedOutputs:
  """A run-steps program on a strategy of one device (one replica, no logical cores) whose outputs come
  back named as `run` names them (`values.name_replica_axis`), with no renaming after each call.

  There every layout is the same one device, and XLA names an output after an input of its rank or after
  no axis at all, so the outputs would be renamed after every call (`name_replica_axis`: a
  `jax.make_array_from_single_device_arrays` a leaf, 30 us each on a CPU, most of a cached call's host
  time). Instead, per argument signature, the program is traced once (`jax.jit`'s trace: the step is not
  traced again), and its jaxpr compiled with the named output shardings: ``P()`` for a `Mirrored` leaf,
  ``P('replica')`` for a leaf of a per-replica carry, ``P(None, 'replica')`` for a per-replica output
  stacked over steps. The step's own program is never compiled, so nothing is compiled twice."""

  def __init__(self, program: Any, mesh: jax.sharding.Mesh, donate: tuple[int, ...]) -> None:
    self._program, self._mesh, self._donate = program, mesh, donate
    self._signatures: dict[Any, tuple[Any, Any]] = {}
    self.__name__ = getattr(program, "__name__", "run_steps")
    self.padding_notes = program.padding_notes

  def __call__(self, carry: Any, batches: Any) -> Any:
    leaves, in_tree = _flatten((carry, batches))
    key = (in_tree, tuple(jax.typeof(x) for x in leaves))
    found = self._signatures.get(key)
    if found is None:
      if len(self._signatures) >= _SIGNATURES_SIZE:
        self._signatures.clear()
      found = self._signatures[key] = self._compile(carry, batches, len(jax.tree.leaves(carry)))
    jitted, out_tree = found
    return out_tree.unflatten(jitted(*leaves))

  def for_leaves(self, carry: Any, batches: Any) -> tuple[Any, Any]:
    """The program of this signature over the flat leaves of ``(carry, batches)``, returning the result's
    flat leaves, and the result's structure (`run_steps_fast`)."""
    leaves, in_tree = _flatten((carry, batches))
    return self._signatures[(in_tree, tuple(jax.typeof(x) for x in leaves))]

  def _compile(self, carry: Any, batches: Any, carry_leaves: int) -> tuple[Any, Any]:
    traced = self._program.trace(carry, batches)
    closed, out_tree = traced.jaxpr, traced.out_tree
    replicated, split = _shardings(self._mesh)
    stacked = NamedSharding(self._mesh, P(None, REPLICA_AXIS))
    dummy = out_tree.unflatten(list(range(out_tree.num_leaves)))
    names: list[Any] = [replicated] * out_tree.num_leaves
    for part, per_replica in zip(dummy[:2], (split, stacked)):
      for node in jax.tree.leaves(part, is_leaf=lambda v: is_distributed(v) or isinstance(v, ShardedVariable)):
        if isinstance(node, (PerReplica, ShardedVariable)):
          for i in jax.tree.leaves(node.tree if isinstance(node, ShardedVariable) else (
              node.tree, node.real_rows_array)):
            names[i] = split if isinstance(node, ShardedVariable) or per_replica is split else stacked

    def run_steps_jaxpr(*flat: Any) -> list[Any]:
      return jax_compat.eval_closed_jaxpr(closed.jaxpr, closed.consts, flat)

    run_steps_jaxpr.__name__ = self.__name__
    donate = tuple(range(carry_leaves)) if self._donate else ()
    return jax.jit(run_steps_jaxpr, out_shardings=names, donate_argnums=donate), out_tree


def _names_outputs(mesh: jax.sharding.Mesh) -> bool:
  """Whether run-steps programs on `mesh` name their outputs themselves (`_NamedOutputs`): one device,
  the replica axis alone (no logical cores, whose layouts the step decides)."""
  return mesh.size == 1 and tuple(mesh.axis_names) == (REPLICA_AXIS,)


def _named(program: Any, mesh: jax.sharding.Mesh, donate: tuple[int, ...]) -> _NamedOutputs:
  """`program` as a `_NamedOutputs` (one per program)."""
  named = getattr(program, "named_outputs", None)
  if named is None:
    named = program.named_outputs = _NamedOutputs(program, mesh, donate)
  return named


def _program(strategy: Strategy, fn: Callable[..., Any], donate: tuple[int, ...] = (),
             checked: bool = False, unroll: int | bool = 1) -> Any:
  cache = _PROGRAMS.setdefault(strategy, collections.OrderedDict())
  key: Any = (fn, donate) if donate else fn
  if checked:
    key = (key, "check_numerics")
  if unroll is True or unroll != 1:  # True == 1 in a dict key: spelled out
    key = (key, "scan_unroll", "all" if unroll is True else unroll)
  try:
    program = cache[key]
  except KeyError:
    program = cache[key] = _make_program(strategy, fn, donate, checked, unroll)
    if len(cache) > _CACHE_SIZE:
      cache.popitem(last=False)
  except TypeError:  # an unhashable callable: compile without caching
    program = _make_program(strategy, fn, donate, checked, unroll)
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
    for name, x in named_leaves(batches):
      if not isinstance(x, _ARRAY_TYPES):
        raise TypeError(
            f"{what} expects an iterator of batches (e.g. iter(distributed_dataset)) or batches already "
            f"stacked on a leading steps axis; got {type(batches).__name__} with {type(x).__name__} "
            f"{x!r:.80} at {name}.")
  for node in jax.tree.leaves(batches, is_leaf=is_distributed):
    if isinstance(node, PerReplica):
      x = next(iter(jax.tree.leaves(node.tree)), None)
      spec = getattr(getattr(x, "sharding", None), "spec", None)
      if spec and spec[0] is not None and stacked_steps(x) is None:
        raise ValueError(
            f"{what}: {node!r} is one step's value (split over the replicas on its leading axis), not stacked "
            "steps. Pass an iterator (iter(batches)), or stack the steps first with tpustrat.stack_steps.")


# Batches already stacked: (strategy, signature of (init, batches)) -> (steps, whether `as_carry` keeps
# `init` as it is), for the checks of `_check_call` that depend on the signature alone (`run_steps`).
_SIGNATURES: dict[Any, tuple[int, bool]] = {}
_SIGNATURES_SIZE = 256


def _signature(strategy: Strategy, tree: Any) -> Any:
  """A key for `tree` (`init` and stacked batches) that is equal only when every check of `_check_call`
  would find the same: its structure and each leaf's type, shape, dtype, weak type and sharding (for a
  strategy held weakly). None when a leaf is not a placed `jax.Array` (a host array is checked by value,
  a tracer is not placed): such calls are checked every time."""
  leaves, tree_def = jax.tree.flatten(tree)
  key: list[Any] = [weakref.ref(strategy), tree_def]
  for x in leaves:
    if type(x) not in _PLACED_TYPES:
      if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
      _PLACED_TYPES.add(type(x))
    key.append((x.shape, x.dtype, x.weak_type, x.sharding))
  return tuple(key)


_PLACED_TYPES: set[type] = set()  # concrete jax.Array types (not tracers) seen by `_signature`


def _same_leaves(a: Any, b: Any) -> bool:
  """Whether `a` is `b` rebuilt: the same structure holding the same leaf objects."""
  a_leaves, a_tree = jax.tree.flatten(a)
  b_leaves, b_tree = jax.tree.flatten(b)
  return a_tree == b_tree and all(x is y for x, y in zip(a_leaves, b_leaves))


def _check_call(strategy: Strategy, iterator: Any, batches: Any, steps: int | None, init: Any,
                what: str) -> tuple[int, Any]:
  """The checks of a `run_steps` call on its batches and `init`: returns (the number of steps, `init` laid
  out as the carry, `as_carry`). Batches already stacked whose signature was checked skip this
  (`_SIGNATURES`)."""
  if isinstance(iterator, collections.abc.Iterator):
    k = num_steps(batches, what)  # fewer than `steps` at the end of the data
  elif isinstance(iterator, collections.abc.Iterable) and not isinstance(iterator, (dict, list, tuple)) and (
      not is_distributed(iterator)):
    raise TypeError(
        f"{what} takes an iterator, so that each call continues where the last one stopped: pass "
        f"iter({type(iterator).__name__}), not the {type(iterator).__name__} itself.")
  else:
    _check_stacked_input(iterator, what)
    k = num_steps(batches, what)
    if steps is not None and steps != k:
      raise ValueError(f"{what}: `steps` is {steps} but the stacked batches hold {k} steps.")
  check_tree_fits_32_bits(batches, lambda path: f"{what}: the stacked batches" + (f" at {path}" if path else ""))
  for node in jax.tree.leaves(batches, is_leaf=is_distributed):
    if isinstance(node, PerReplica):
      try:
        node.real_rows(0)  # their real-row counts' type, said here: not inside the step's trace
      except ValueError as e:
        raise ValueError(f"{what}: the stacked batches: {e}") from None
  return k, as_carry(strategy, init)


_NOT_ITERATORS: set[type] = set()  # types of `run_steps`' batches seen not to be iterators (an ABC check)
# `run_steps`' fast path: (function key, options, structure of (init, batches)) -> the `_Fast` of up to
# `_FAST_PER_KEY` signatures, the latest first, per engine (`Engine.run_steps_fast`), made by checked calls on
# batches already stacked. More than one: a loop's groups of k steps and the shorter group at the end of its
# data (fit's `steps_per_execution`, epoch after epoch) alternate.
_FAST_PER_KEY = 4
MISS = object()
_flatten = jax.tree_util.default_registry.flatten
_FunctionType = types.FunctionType
_aval_of, _sharding_of = operator.attrgetter("aval"), operator.attrgetter("sharding")
_STEP_HOOKS = engine_lib.STEP_HOOKS
_MARK_OPEN, _PROFILE = profiler.OPEN, profiler.SESSION
_collecting = profiler._collecting  # pylint: disable=protected-access
_is_deleted = operator.methodcaller("is_deleted")


class _Fast:
  """What a checked `run_steps` call on batches already stacked found, for the next call like it: each
  argument leaf's aval and sharding, the steps, the dispatch wrapper (the output to wait on chosen once),
  whether its outputs need their replica axis named (one replica)."""

  __slots__ = ("avals", "shardings", "k", "dispatched", "limit", "donate", "one_replica", "notes", "in_flight",
               "traced")

  def __init__(self, avals: tuple[Any, ...], shardings: tuple[Any, ...], k: int, dispatched: Any,
               limit: int | None, donate: tuple[int, ...], one_replica: bool, notes: dict[str, Any],
               engine: Any) -> None:
    self.avals, self.shardings, self.k, self.dispatched = avals, shardings, k, dispatched
    self.limit, self.donate, self.one_replica = limit, donate, one_replica
    self.notes = notes  # the program's padding notes (filled when it is traced: `note_stacked_padding_reads`)
    self.in_flight, self.traced = engine.in_flight, engine.traced_numerics  # the engine's, read once


def run_steps_fast(engine: Any, fn: Callable[..., Any], iterator: Any, steps: int | None, init: Any,
                   options: RunOptions | None) -> Any:
  """`run_steps` for a call like an earlier checked one (batches already stacked, the same function,
  options and structure, every leaf a placed `jax.Array` of the same aval and sharding, `init` laid out as
  the carry), with the default step hooks and no profile mark to make: none of the per-signature checks,
  the dispatch written out (`engine.dispatch_default_hooks`). `engine`: the strategy's (None: the default
  strategy's, none). `MISS` for any other call."""
  # `engine_lib.default_hooks_apply()`, written out (one call less per step)
  if engine is None or _CONTEXT.replica_context is not None or not _STEP_HOOKS.unchanged or _MARK_OPEN[0] or (
      _PROFILE[0] is not None or _collecting()):
    return MISS
  kind = type(iterator)
  if kind not in _NOT_ITERATORS:  # an iterator is no pytree (and JAX warns when it flattens one)
    if isinstance(iterator, collections.abc.Iterator):
      return MISS
    _NOT_ITERATORS.add(kind)
  try:
    leaves, tree = _flatten((init, iterator))
    known = engine.run_steps_fast.get(
        (weakref.ref(fn) if type(fn) is _FunctionType else engine_lib.weak_key(fn), options, tree))
  except TypeError:
    return MISS
  if known is None or not _PLACED_TYPES.issuperset(map(type, leaves)):
    return MISS
  # Each leaf a placed array of the aval and sharding of a call kept: compared by `map` and tuple equality,
  # no Python loop over a model's hundreds of leaves.
  avals, shardings = tuple(map(_aval_of, leaves)), tuple(map(_sharding_of, leaves))
  fast = known[0]
  if avals != fast.avals or shardings != fast.shardings:  # another signature of this key, if kept
    found = next((i for i in range(1, len(known)) if avals == known[i].avals and shardings == known[i].shardings),
                 None)
    if found is None:
      return MISS
    fast = known.pop(found)
    known.insert(0, fast)  # the latest first
  k = fast.k
  if steps is not None and (type(steps) is not int or steps != k):
    return MISS  # the checked path checks it (a wrong count or type raises there)
  if engine_lib.DONATION_USED[0]:
    where = lambda i: "experimental_run_steps: an array of init or of the batches"  # noqa: E731
    if any(map(_is_deleted, leaves)):
      engine_lib.check_not_deleted(leaves, where)  # names the deleted one
    if fast.donate:
      carry_leaves = leaves[:len(fast.donate)]
      engine_lib.check_donatable(None, (), leaves, fast.donate,
                                 lambda i: f"experimental_run_steps: leaf {i} of init and the batches")
      fast.in_flight.forget(carry_leaves)
  carry, outputs = engine_lib.dispatch_default_hooks(
      fast.dispatched, (init, iterator, leaves), fast.in_flight, fast.limit or engine.max_steps_in_flight, k,
      None, fast.traced)
  if fast.notes.get("padding_reads"):
    engine_lib.warn_padding_reads_stacked(fast.notes, init, iterator)
  if fast.one_replica:  # XLA's layouts do not say which outputs are stacked steps (see stacked_steps)
    return name_replica_axis(carry, steps=False), name_replica_axis(outputs, steps=True)
  return carry, outputs


def _remember(engine: Any, strategy: Strategy, fn: Callable[..., Any], options: RunOptions | None, init: Any,
              batches: Any, k: int, dispatched: Any, donate: tuple[int, ...], notes: dict[str, Any]) -> None:
  """Keeps a checked call on batches already stacked, `init` laid out as the carry, for `run_steps_fast`."""
  try:
    leaves, tree = _flatten((init, batches))
    key = (weakref.ref(fn) if type(fn) is _FunctionType else engine_lib.weak_key(fn), options, tree)
    hash(key)
  except TypeError:
    return
  if not all(type(x) in _PLACED_TYPES for x in leaves):
    return
  cache = engine.run_steps_fast
  known = cache.get(key)
  if known is None:
    if len(cache) >= _SIGNATURES_SIZE:
      cache.clear()
    known = cache[key] = []
  mesh = strategy.mesh
  # One replica: outputs are renamed after each call, unless the program names them (`_NamedOutputs`).
  one = mesh is not None and mesh.shape[REPLICA_AXIS] == 1 and not _names_outputs(mesh)
  donated = tuple(range(len(jax.tree.leaves(init)))) if donate else ()
  fast = _Fast(tuple(x.aval for x in leaves), tuple(x.sharding for x in leaves), k, dispatched,
               options.max_steps_in_flight if options is not None else None, donated, one, notes, engine)
  known[:] = [fast, *(f for f in known if (f.avals, f.shardings) != (fast.avals, fast.shardings))]
  del known[_FAST_PER_KEY:]


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
    steps = check_int(steps, what, "steps", minimum=1)
  donate = engine_lib.donate_argnums_of(options)
  if any(i != 0 for i in donate):
    raise ValueError(
        f"{what}: RunOptions(donate_argnums={donate}) names argument {max(donate)}, but only argument 0 "
        "(init, the carry) can be donated: the stacked batches come from the iterator, which keeps using "
        "their buffers.")
  if engine_lib.donation_used(now=bool(donate)):  # before any batch is taken from the iterator
    engine_lib.check_not_deleted(jax.tree.leaves((init, iterator if not isinstance(
        iterator, collections.abc.Iterator) else ())), lambda i: f"{what}: an array of init or of the batches")
  if isinstance(iterator, collections.abc.Iterator):
    if steps is None:
      raise TypeError(f"{what}: `steps` (how many batches to take from the iterator) is required.")
    batches = take(iterator, steps, what)
    signature = None
  else:
    batches = iterator
    # Batches already stacked: what the checks below find depends only on the signature of `init` and the
    # batches (structure; each leaf's type, shape, dtype, weak type and sharding), so they run once per
    # signature (`_signature`; None for host values, checked every call: their values matter).
    signature = _signature(strategy, (init, batches))
  known = _SIGNATURES.get(signature) if signature is not None else None
  carry_as_given = False
  if known is not None:
    k, carry_as_given = known
    if steps is not None and steps != k:
      raise ValueError(f"{what}: `steps` is {steps} but the stacked batches hold {k} steps.")
    carry = init if carry_as_given else as_carry(strategy, init)
  else:
    k, carry = _check_call(strategy, iterator, batches, steps, init, what)
    if signature is not None:
      if len(_SIGNATURES) >= _SIGNATURES_SIZE:
        _SIGNATURES.pop(next(iter(_SIGNATURES)))
      carry_as_given = _same_leaves(carry, init)
      _SIGNATURES[signature] = (k, carry_as_given)
  engine = strategy.extended.engine
  checked = engine is not None and options is not None and options.check_numerics
  program = _program(strategy, fn, donate, checked, options.scan_unroll if options is not None else 1)
  mesh = strategy.mesh
  if not checked and mesh is not None and _names_outputs(mesh):
    program = _named(program, mesh, donate)

  if engine is None:  # the default strategy: one device, no collectives to bound
    result = program(carry, batches)
    return result[:2]  # without a token (a donating program returns one)
  limit = options.max_steps_in_flight if options is not None else None
  if donate:
    leaves = jax.tree.leaves((carry, batches))
    engine_lib.check_donatable((carry, batches), donate, leaves, tuple(range(len(jax.tree.leaves(carry)))),
                               lambda i: f"{what}: leaf {i} of init and the batches")
  if donate:  # the donated arrays are no longer outputs to wait on (`InFlight.forget`)
    engine.in_flight.forget(jax.tree.leaves([(carry, batches)[i] for i in donate]))
  carry_in = carry  # the signature of the call (the padding-read warning of its trace)
  if checked:
    def dispatched(c: Any, b: Any) -> tuple[Any, Any]:
      c, outs, flags = program.program(c, b)
      return (c, outs), flags

    dispatched.__name__ = getattr(program.program, "__name__", "run_steps")  # the step's mark in a profile
    carry, outputs = engine.dispatch(dispatched, carry, batches, limit=limit, steps=k,
                                     numerics=numerics_lib.make_check(program.outputs, k, stacked=True,
                                                                      traced=engine.traced_numerics))
  else:
    tokened: Any = _with_token(program)
    carry, outputs = engine.dispatch(tokened, carry, batches, limit=limit, steps=k)
    if signature is not None and carry_as_given:  # `run_steps_fast` may take the next call like this one
      _remember(engine, strategy, fn, options, init, batches, k, tokened.fixed(carry, batches), donate,
                program.padding_notes)
  if program.padding_notes.get("padding_reads"):
    engine_lib.warn_padding_reads_stacked(program.padding_notes, carry_in, batches)
  # One replica: XLA's layouts do not say which outputs are stacked steps (see stacked_steps).
  return name_replica_axis(carry, steps=False), name_replica_axis(outputs, steps=True)


def _with_token(program: Callable[..., Any]) -> Callable[..., tuple[Any, Any]]:
  """`program` as `Engine.dispatch` calls it: returning ``(result, token)``. All outputs of one program are
  ready together, so the token is the smallest output it computes (`engine.wait_leaf`), or, when every
  output is large, the smallest output."""

  chosen: list[int | None] = []  # the leaf waited on, once chosen (`fixed`)

  def dispatched(carry: Any, batches: Any) -> tuple[Any, Any]:
    result = program(carry, batches)
    if len(result) == 3:  # a donating program's own token (see `_make_program`)
      return result[:2], result[2]
    leaves = jax.tree.leaves(result)
    i = engine_lib.wait_leaf(leaves, tuple(jax.tree.leaves((carry, batches))))
    if i is None and leaves:
      i = min(range(len(leaves)), key=lambda j: leaves[j].size * getattr(leaves[j].dtype, "itemsize", 8))
    chosen[:] = [i]
    return result, None if i is None else leaves[i]

  def fixed(carry: Any, batches: Any) -> Callable[..., tuple[Any, Any]]:
    """`dispatched` for later calls of the signature of ``(carry, batches)`` (`run_steps_fast`), called
    with the arguments' flat leaves too: the leaf to wait on is the one this call chose (one signature, one
    output structure); a `_NamedOutputs` program is called on the leaves, its compiled one directly."""
    i = chosen[0] if chosen else None
    if isinstance(program, _NamedOutputs):
      jitted, out_tree = program.for_leaves(carry, batches)
      tokened = len(out_tree.children()) == 3  # a donating program's own token (see `_make_program`)

      def again(carry: Any, batches: Any, leaves: list[Any]) -> tuple[Any, Any]:
        out = jitted(*leaves)
        result = out_tree.unflatten(out)
        if tokened:
          return result[:2], result[2]
        return result, None if i is None else out[i]
    else:
      def again(carry: Any, batches: Any, leaves: list[Any]) -> tuple[Any, Any]:
        result = program(carry, batches)
        if len(result) == 3:
          return result[:2], result[2]
        return result, None if i is None else _flatten(result)[0][i]

    again.__name__ = dispatched.__name__
    return again

  dispatched.__name__ = getattr(program, "__name__", "run_steps")  # the step's mark in a profile (`profiler`)
  dispatched.fixed = fixed  # type: ignore[attr-defined]
  return dispatched
