"""`Engine`: `strategy.run` for one strategy's mesh: the program cache, argument placement and dispatch.

A strategy builds ``Engine(mesh, num_replicas, make_context=...)`` (the engine knows a mesh and a replica
count, not the strategy; `make_context` gives the `ReplicaContext` `fn` sees) and calls `Engine.run`. Per
call, `run`:

* looks up the program for ``(fn, argument structure)`` (`weak_keys.weak_key`: the cache does not keep
  `fn` alive; LRU of `_CACHE_SIZE` entries), built once by `program.make_program` and compiled over flat
  leaves (`flat_program.FlatProgram`); a program compiled again and again warns (`step_stats.Retraces`);
* places each argument leaf where the program wants it (arrays already there pass untouched, and so do
  arrays laid out equivalently to the replicated target, a plain array on a one-device mesh's device:
  `Engine._equivalent`; a numpy argument is captured when `run` is called, `host_memory`);
* applies `RunOptions.donate_argnums` (`donation`);
* dispatches under the engine's bound on programs in flight (`in_flight.dispatch`, with the per-step
  hooks);
* says the program's padding-read warning at the first partial batch (`output_padding`).

Other compiled programs that must share the bound on programs in flight (the multi-step loop,
cross-device reductions) go through `Engine.dispatch`, or, with no engine at hand, `in_flight.dispatch`
and its process-wide `InFlight`; a program passed to either returns ``(result, token)``, the token being
the output to wait on (`in_flight.wait_leaf` picks it).
"""

from __future__ import annotations

import collections
import functools
import operator
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src import host_memory, profiler
from tpustrat._src import numerics as numerics_lib
from tpustrat._src import step_stats as step_stats_lib
from tpustrat._src.engine.donation import DONATION_USED, check_donatable, check_not_deleted, donated_leaves
from tpustrat._src.engine.flat_program import FlatProgram
from tpustrat._src.engine.in_flight import (
  DEFAULT_STEPS_IN_FLIGHT,
  STEP_HOOKS,
  InFlight,
  dispatch,
  dispatch_flat,
)
from tpustrat._src.engine.options import RunOptions, donate_argnums_of
from tpustrat._src.engine.output_padding import warn_padding_reads
from tpustrat._src.engine.program import batch_group, make_program
from tpustrat._src.engine.weak_keys import weak_key
from tpustrat._src.jax_compat import staging
from tpustrat._src.logical import LayoutMap, check_layout_map
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import ShardedVariable
from tpustrat._src.validation import check_fits_32_bits, tree_path
from tpustrat._src.values import Mirrored, PerReplica, check_components, is_distributed, stacked_steps

__all__ = ["Engine", "check_run_call", "same_over_replicas"]

_CACHE_SIZE = 256  # programs (and argument structures) kept per engine, least recently used out first
_CONTEXT = context_lib.thread_state()  # this thread's replica context (`run` inside `run` is refused)
_NO_KWARGS: dict[str, Any] = {}
_PYTHON_SCALARS = frozenset({int, float, bool, complex})
_flatten = jax.tree_util.default_registry.flatten
_sharding_of = operator.attrgetter("sharding")
_is_deleted = operator.methodcaller("is_deleted")
_weakref = weakref.ref
_FunctionType = types.FunctionType
_collecting = profiler._collecting  # pylint: disable=protected-access
_MARK_OPEN, _PROFILE = profiler.OPEN, profiler.SESSION


def check_run_call(fn: Any, args: Any, kwargs: Any) -> dict[str, Any]:
  """Validates the arguments of `strategy.run` (every strategy's); returns `kwargs` as a dict."""
  if not isinstance(args, (tuple, list)):
    raise TypeError(
        f"strategy.run expects `args` to be a tuple or list of positional arguments, got "
        f"{type(args).__name__}: {args!r:.100}. For a single argument write args=(x,).")
  if kwargs is None:
    kwargs = {}
  elif not isinstance(kwargs, dict):
    raise TypeError(f"strategy.run expects `kwargs` to be a dict or None, got {type(kwargs).__name__}.")
  if not callable(fn):
    raise TypeError(f"strategy.run expects a callable `fn`, got {type(fn).__name__}: {fn!r:.100}.")
  return kwargs


class Engine:
  """Compiles and dispatches `run` for one strategy mesh: its replica axis (`names.REPLICA_AXIS`), then any
  logical-core axes."""

  def __init__(self, mesh: jax.sharding.Mesh, num_replicas: int, *,
               make_context: Callable[[list[tuple[int, Any]]], context_lib.ReplicaContext]) -> None:
    """`make_context(real_rows)` returns the `ReplicaContext` that `fn` sees while it is traced
    (`real_rows`: a (padded batch size, this replica's real rows) pair per padded batch argument)."""
    axis_name = REPLICA_AXIS
    self._num_replicas = num_replicas
    self._make_context = make_context
    self._mesh = mesh
    self._axis = axis_name
    self._programs: collections.OrderedDict[Any, FlatProgram] = collections.OrderedDict()
    # Where the loop's time goes (`strategy.experimental_step_stats()`): the in-flight waits and the steps
    # noted here, the input waits by the strategy's iterators.
    self.step_stats = step_stats_lib.StepCounters()
    self._in_flight = InFlight(self.step_stats)
    # `RunOptions.check_numerics` of programs traced inside a user's jit / scan: their recorded errors
    self._traced_numerics = numerics_lib.TracedChecks(mesh)
    self._retraces = step_stats_lib.Retraces()  # programs compiled per function (`RetracingWarning`)
    self._placements = step_stats_lib.Placements()  # arrays placed call after call (`RepeatedPlacementWarning`)
    self._donations: dict[Any, tuple[int, ...]] = {}  # (run key, donate_argnums) -> donated leaf positions
    self._entries: collections.OrderedDict[Any, tuple[FlatProgram, list[NamedSharding]]] = (
        collections.OrderedDict())
    # `run`'s fast path: (function key, options, argument structure) -> (program, targets, the options'
    # max_steps_in_flight, the numerics check maker, the donated leaves); made by a checked call
    self._fast: dict[Any, tuple[Any, list[NamedSharding], int | None, Any, Any]] = {}
    self.run_steps_fast: dict[Any, Any] = {}  # `experimental_run_steps`' fast path (`multistep.run_steps_fast`)
    self._array_types: set[type] = set()  # concrete (non-tracer) jax.Array types seen already placed
    self._equivalents: dict[tuple[Any, int], bool] = {}  # (sharding, rank) -> laid out as replicated
    self._replicated = NamedSharding(mesh, P())
    self._split = NamedSharding(mesh, P(axis_name))
    self._core_axes = tuple(a for a in mesh.axis_names if a != axis_name)  # logical cores of a replica
    self.max_steps_in_flight = DEFAULT_STEPS_IN_FLIGHT
    self._alias_align = host_memory.mesh_alias_alignment(mesh)

  def run(self, fn: Callable[..., Any], args: Any, kwargs: Any, options: RunOptions | None) -> Any:
    # The fast path: a call like an earlier one (the same function, argument structure and options; every
    # argument leaf an array already laid out as the program wants it, or a Python scalar; no layout map),
    # with the default step hooks and no profile mark to make. Everything checked once per signature is
    # skipped: the lookup, one sharding comparison per leaf and the dispatch (`dispatch_flat`: the default
    # hooks and the compiled program's call written out in one frame) are all the Python that runs
    # (tests/test_engine.py checks that such a call runs no per-signature check).
    fast_key: Any = None
    if type(args) is tuple and (kwargs is None or (type(kwargs) is dict and not kwargs)) and (
        _CONTEXT.replica_context is None):
      try:
        fn_key = _weakref(fn) if type(fn) is _FunctionType else weak_key(fn)
        leaves, in_tree = _flatten((args, _NO_KWARGS))
        fast_key = (fn_key, options, in_tree)
        fast = self._fast.get(fast_key)
      except TypeError:  # an unhashable callable, tree or options: the checked path, without caching
        fast = fast_key = None
      # `in_flight.default_hooks_apply()`, written out (one call less per step)
      if fast is not None and STEP_HOOKS.unchanged and not _MARK_OPEN[0] and _PROFILE[0] is None and (
          not _collecting()):
        program, targets, limit, numerics, donate = fast
        array_types = self._array_types
        # Every leaf an array laid out as the program wants it: the types and the shardings compared by
        # `map` and list equality (no Python loop over a model's hundreds of leaves); with a Python scalar
        # among them, leaf by leaf.
        arrays = array_types.issuperset(map(type, leaves))
        if list(map(_sharding_of, leaves)) == targets if arrays else _placed_with_scalars(leaves, targets,
                                                                                          array_types):
          if DONATION_USED[0]:
            where = _where(in_tree)
            if not arrays or any(map(_is_deleted, leaves)):
              check_not_deleted(leaves, where)  # names the deleted one
            if donate:
              check_donatable(None, (), leaves, donate, where)
              self._in_flight.forget([leaves[i] for i in donate])
          out = dispatch_flat(program, leaves, self._in_flight, limit or self.max_steps_in_flight, numerics,
                              self._traced_numerics)
          if program.notes.get("padding_reads"):
            warn_padding_reads(program.notes, args, {})
          return out
    return self._run_checked(fn, args, kwargs, options, fast_key)

  def _run_checked(self, fn: Callable[..., Any], args: Any, kwargs: Any, options: RunOptions | None,
                   fast_key: Any) -> Any:
    """`run` with every check; remembers the call under `fast_key` (None: not) for `run`'s fast path."""
    kwargs = check_run_call(fn, args, kwargs)
    if context_lib.in_replica_context_of_a_run():
      raise RuntimeError(
          "strategy.run was called inside the function of another strategy.run (a replica context). "
          "Nested run is not supported: call the inner function directly, and use "
          "tpustrat.get_replica_context() for collectives.")
    if options is not None and not isinstance(options, RunOptions):
      raise TypeError(f"strategy.run expects `options` to be a tpustrat.RunOptions or None, got {options!r}.")
    limit = (options.max_steps_in_flight if options is not None else None) or self.max_steps_in_flight
    leaves, in_tree = jax.tree.flatten((tuple(args), kwargs))
    fn_key = function = weak_key(fn)
    key = (fn_key, in_tree)
    layout_map = options.experimental_layout_map if options is not None else None
    if layout_map is not None:  # a program per layout: the map's patterns and layouts join the cache keys
      check_layout_map(self, layout_map, "strategy.run")
      fn_key = (fn_key, layout_map.signature())
      key = (fn_key, in_tree)
    checked = options is not None and options.check_numerics
    if checked:  # a program of its own; without the option, the keys (and programs) are the plain ones
      fn_key = (fn_key, "check_numerics")
      key = (fn_key, in_tree)
    entries = self._entries
    try:
      program, targets = entries[key]
      entries.move_to_end(key)  # least recently used first out
    except KeyError:
      program, targets = entries[key] = self._entry(fn, fn_key, in_tree, layout_map, checked)
      if len(entries) > _CACHE_SIZE:
        entries.popitem(last=False)
    except TypeError:  # an unhashable callable (or tree): compile without caching
      program, targets = self._entry(fn, fn_key, in_tree, layout_map, checked)
    if DONATION_USED[0]:  # a donated array passed again: said before it is placed (and XLA:CPU crashes on it)
      check_not_deleted(leaves, _where(in_tree))
    given = list(leaves)  # as the caller gave them (placed copies of one array share its buffer on its device)
    array_types = self._array_types
    # The same array placed call after call warns, once per function (`RepeatedPlacementWarning`); not
    # counted while a user's jit traces `run` (placed once, into the compiled program): decided at the first
    # placed array, None until then.
    counting: bool | None = None if self._placements.counts(function) else False
    for i, x in enumerate(leaves):  # arrays already where the program wants them pass untouched
      if type(x) not in array_types or x.sharding != targets[i]:
        _check_host_integers(x, in_tree, i)
        try:
          leaves[i] = placed = self._place(x, targets[i])
        except ValueError:
          _check_sharded_replicas((args, kwargs), self._num_replicas)  # the clearer error, if that is the cause
          raise
        if placed is not x and counting is not False and isinstance(x, jax.Array):
          if counting is None:
            counting = not staging()
          if counting:
            self._placements.placed(function, in_tree, i, x, functools.partial(
                _placement_message, fn, in_tree, i, x, targets[i], targets[i] is self._split))
    donate_argnums = donate_argnums_of(options)
    donate: tuple[int, ...] | None = ()
    if donate_argnums:
      # What depends on the argument structure alone is worked out once per structure.
      try:
        donate = self._donations.get((key, donate_argnums))
      except TypeError:  # an unhashable callable: nothing is cached for it
        donate = None
      if donate is None:
        donate = donated_leaves(donate_argnums, [jax.tree.structure(a).num_leaves for a in args],
                                "strategy.run")
        check_donatable(args, donate_argnums, None, (), str)
        if len(self._donations) > _CACHE_SIZE:
          self._donations.clear()
        try:
          self._donations[(key, donate_argnums)] = donate
        except TypeError:
          pass
      where = _where(in_tree)
      check_donatable(None, (), given, donate, where)  # one array given twice, placed twice: one buffer
      check_donatable(None, (), leaves, donate, where)
      program = program.donating(donate)
      DONATION_USED[0] = True
      self._in_flight.forget([leaves[i] for i in donate])
    if checked:
      out = self.dispatch(program, leaves, limit=limit, steps=1, numerics=program.numerics_check)
    else:
      out = self.dispatch(program, leaves, limit=limit, steps=1)
    if program.notes.get("padding_reads"):
      warn_padding_reads(program.notes, args, kwargs)
    if fast_key is not None and layout_map is None:
      fast = self._fast
      if len(fast) >= _CACHE_SIZE:
        fast.clear()
      fast[fast_key] = (program, targets, options.max_steps_in_flight if options is not None else None,
                        program.numerics_check if checked else None, donate_argnums and donate)
    return out

  def dispatch(self, program: Callable[..., tuple[Any, Any]], *args: Any, limit: int | None = None,
               steps: int = 0, numerics: Callable[[Any], Callable[..., None] | None] | None = None) -> Any:
    """Calls ``program(*args)``, which returns ``(result, token)``, under this engine's bound on programs
    in flight (`limit`, default `max_steps_in_flight`); returns `result`. `token` is the output to wait
    on before a later dispatch (see `wait_leaf`), or None. `steps`: the training steps it runs.
    `numerics`: see `in_flight.dispatch`, which runs it with this engine's per-step state.

    In a one-process job, an error recorded by a checked program traced inside a user's jit / scan
    (`numerics.TracedChecks`) is raised here, before dispatching a step (not a reduction, not while
    tracing): by the numerics hook (`numerics.StepChecks`)."""
    return dispatch(program, *args, in_flight=self._in_flight, limit=limit or self.max_steps_in_flight,
                    steps=steps, numerics=numerics, traced=self._traced_numerics)

  def _entry(self, fn: Callable[..., Any], fn_key: Any, in_tree: Any, layout_map: LayoutMap | None = None,
             checked: bool = False) -> tuple[FlatProgram, list[NamedSharding]]:
    """The program for `fn` called with arguments of structure `in_tree` (`PerReplica` and `Mirrored`
    nodes included), and the sharding each flattened argument leaf must have.

    `Mirrored` values enter like plain arrays: structures that differ only by `Mirrored` wrappers (a plain
    array on step 1, the `Mirrored` result on step 2) share one program and one compilation.
    """
    dummy = jax.tree.unflatten(in_tree, list(range(in_tree.num_leaves)))
    top, outer = jax.tree.flatten(dummy, is_leaf=is_distributed)
    paths = [tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy, is_leaf=is_distributed)[0]]
    targets = [self._replicated] * in_tree.num_leaves
    nodes: list[Any] = []
    groups: list[int] = []
    roots: dict[Any, int] = {}
    for path, node in zip(paths, top):
      if isinstance(node, PerReplica):
        for i in jax.tree.leaves((node.tree, node.real_rows_array)):
          targets[i] = self._split
        if node.padding_is_marked:
          groups.append(batch_group(node, path, roots, len(groups)))
        nodes.append(node)
      elif isinstance(node, ShardedVariable):
        for i in jax.tree.leaves(node.tree):
          targets[i] = self._split  # blocks stacked on a leading replica axis, as a PerReplica's
        nodes.append(node)
      elif isinstance(node, Mirrored):
        nodes.append(node.tree)
      else:
        nodes.append(node)
    seen_tree = jax.tree.structure(jax.tree.unflatten(outer, nodes))
    key = (fn_key, seen_tree)
    programs = self._programs
    try:
      program = programs[key]
      programs.move_to_end(key)
    except KeyError:
      program = programs[key] = self._flat_program(fn, tuple(groups), layout_map, seen_tree, checked)
      if len(programs) > _CACHE_SIZE:
        programs.popitem(last=False)
    except TypeError:
      program = self._flat_program(fn, tuple(groups), layout_map, seen_tree, checked)
    return program, targets

  def _flat_program(self, fn: Callable[..., Any], groups: tuple[int, ...], layout_map: LayoutMap | None,
                    seen_tree: Any, checked: bool) -> FlatProgram:
    traced = self._on_trace(weak_key(fn), getattr(fn, "__qualname__", "") or getattr(fn, "__name__", "fn"))
    outputs = None if not checked else numerics_lib.Outputs(
        [], [], numerics_lib.replica_processes(self._mesh, self._axis),
        f"strategy.run({getattr(fn, '__name__', 'fn')})")
    structured = make_program(fn, groups, mesh=self._mesh, num_replicas=self._num_replicas,
                              make_context=self._make_context, layout_map=layout_map, numerics=outputs)
    names = (self._replicated, self._split) if self._mesh.size == 1 and not self._core_axes else None
    if outputs is None:
      return FlatProgram(structured, seen_tree, on_trace=traced, names=names)
    return FlatProgram(structured, seen_tree, checked=outputs, on_trace=traced,
                       traced_numerics=self._traced_numerics, names=names)

  def _on_trace(self, key: Any, name: str) -> Callable[[Any, list[Any]], None]:
    """What a program of `fn` (`key`: its `weak_key`) calls each time JAX traces it, that is, compiles a new
    program: counted per function (`step_stats.Retraces`), the compile after the fifth warns."""
    retraces = self._retraces

    def traced(seen_tree: Any, leaves: list[Any]) -> None:
      retraces.traced(key, name, lambda: _signature(seen_tree, leaves))

    return traced

  def _place(self, x: Any, target: NamedSharding) -> Any:
    """Puts an argument leaf on the sharding the program expects, so that each step sees the same input
    signature. Arrays already placed (and tracers) pass through; Python scalars are left to `jax.jit`.
    """
    if isinstance(x, jax.Array):
      if isinstance(x, jax.core.Tracer):
        return x
      if x.sharding == target:
        self._array_types.add(type(x))
        return x
      if self._core_axes and same_over_replicas(x.sharding, target, self._axis):
        return x  # differs from `target` over the logical cores only (a split result of `run`): keep it
      if target is self._replicated and self._equivalent(x.sharding, x.ndim):
        # Already on the devices as the program wants it under another name (on one device, a plain array
        # on that device): the same buffers renamed, not placed again (a `jax.device_put`, ~300 us), and
        # not passed as they are either, which would compile the program once more for that name (Keras's
        # optimizer scalars made a model's second `fit` compile its step again).
        return jax.make_array_from_single_device_arrays(x.shape, target, [s.data for s in x.addressable_shards])
    elif not isinstance(x, (np.ndarray, np.generic)):
      return x
    if target is self._split:
      if stacked_steps(x) is not None:
        raise ValueError(
            f"strategy.run: a PerReplica argument holds {x.shape[0]} stacked steps (shape {x.shape}: "
            "[steps, num_replicas, ...]), as DistributedIterator.take_steps returns them; run takes one "
            "step. Scan over the steps (jax.lax.scan with strategy.run in the body), use "
            "strategy.experimental_run_steps, or take one step with tpustrat.unstack_steps.")
      check_components(x, self._num_replicas, "strategy.run: a PerReplica argument")
    if not isinstance(x, np.ndarray):
      return jax.device_put(x, target)
    # TF captures a numpy argument when `run` is called; JAX's transfer may read it later (host_memory).
    parts = self._num_replicas if target is self._split else 1
    captured = host_memory.unaliased(x, parts, self._alias_align)
    placed = jax.device_put(captured, target)
    if captured is x:  # the caller's memory: wait until the transfer has read it
      placed.block_until_ready()
    return placed

  def _equivalent(self, sharding: Any, ndim: int) -> bool:
    """Whether an array of rank `ndim` laid out by `sharding` is laid out as the replicated target
    (`Sharding.is_equivalent_to`: the same devices holding the same data), cached per sharding object."""
    key = (sharding, ndim)
    same = self._equivalents.get(key)
    if same is None:
      same = self._equivalents[key] = bool(sharding.is_equivalent_to(self._replicated, ndim))
      if len(self._equivalents) > _CACHE_SIZE:
        self._equivalents.pop(next(iter(self._equivalents)))
    return same

  @property
  def mesh(self) -> jax.sharding.Mesh:
    """The strategy's mesh (``'replica'``, then the logical-core axes)."""
    return self._mesh

  def wait(self) -> None:
    """Blocks until every step dispatched by `run` has finished; with checked programs traced inside a
    user's jit / scan, also until every dispatched program's host callbacks have run
    (`jax.effects_barrier`), then raises the first error they recorded (`numerics.TracedChecks`)."""
    self._in_flight.drain()
    self._traced_numerics.raise_recorded(wait=True)

  @property
  def traced_numerics(self) -> numerics_lib.TracedChecks:
    """The checks of this engine's checked programs traced inside other programs (`RunOptions.check_numerics`)."""
    return self._traced_numerics

  @property
  def in_flight(self) -> InFlight:
    """The bound on this engine's programs in flight (`dispatch` goes through it)."""
    return self._in_flight


def _placed_with_scalars(leaves: list[Any], targets: list[NamedSharding], array_types: set[type]) -> bool:
  """Whether each leaf is an array of `array_types` laid out by its target, or a Python scalar."""
  for i, x in enumerate(leaves):
    kind = type(x)
    if kind in array_types:
      if x.sharding != targets[i]:
        return False
    elif kind not in _PYTHON_SCALARS:
      return False
  return True


def _where(in_tree: Any) -> Callable[[int], str]:
  return lambda i: f"strategy.run: the argument at {_run_arg_path(in_tree, i)}"


def same_over_replicas(sharding: Any, target: NamedSharding, axis: str) -> bool:
  """Whether `sharding` lays an array out over the replica axis as `target` does (split on the leading
  dimension, or not at all), on the same mesh: the two then differ over the logical-core axes only."""
  if not isinstance(sharding, NamedSharding) or sharding.mesh != target.mesh:
    return False

  def replica_dims(spec: Any) -> list[int]:
    return [i for i, p in enumerate(spec) if p == axis or (isinstance(p, tuple) and axis in p)]

  spec = tuple(sharding.spec)
  if replica_dims(tuple(target.spec)):  # per replica: 'replica' alone on the leading dimension
    return bool(spec) and spec[0] in (axis, (axis,)) and replica_dims(spec) == [0]
  return not replica_dims(spec)


def _check_sharded_replicas(tree: Any, n: int) -> None:
  """Raises a `ValueError` naming the first `ShardedVariable` in `tree` split over another number of
  replicas than `n` (only on the failing path of placing `run`'s arguments: nothing per step)."""
  nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: isinstance(v, ShardedVariable))[0]
  for path, v in nodes:
    if isinstance(v, ShardedVariable) and v.num_replicas != n:
      raise ValueError(
          f"strategy.run: the ShardedVariable at {tree_path(path[1:]) or '<root>'} ({v!r}) is split over "
          f"{v.num_replicas} replicas, but this strategy has {n}: re-split it first with "
          "strategy.experimental_shard(value) (or restore it from a checkpoint onto this strategy).")


def _signature(seen_tree: Any, leaves: list[Any]) -> step_stats_lib.Signature:
  """The argument signature of a traced `run` program (`step_stats.Signature`): each leaf's path (as
  `_run_arg_path` writes it) and type, and the structure of each top-level argument."""
  dummy = jax.tree.unflatten(seen_tree, list(range(seen_tree.num_leaves)))
  flat = jax.tree_util.tree_flatten_with_path(dummy)[0]
  paths = tuple(("args" if p[0].idx == 0 else "kwargs") + tree_path(p[1:]) for p, _ in flat)
  types_ = []
  for x in leaves:
    t = jax.typeof(x)
    types_.append((tuple(t.shape), str(t.dtype), bool(getattr(t, "weak_type", False))))
  args, kwargs = dummy
  tops = tuple(str(jax.tree.structure(a)) for a in args) + tuple(str(jax.tree.structure(kwargs[k])) for k in kwargs)
  return paths, tuple(types_), tops, len(args), tuple(kwargs)


def _placement_message(fn: Any, in_tree: Any, i: int, x: jax.Array, target: NamedSharding, split: bool,
                       count: int) -> str:
  """The `RepeatedPlacementWarning`'s text: `run` of `fn` placed the array `x`, leaf `i` of its arguments (of
  structure `in_tree`), onto `target` for the `count`-th time (`split`: as a `PerReplica`'s component or a
  `ShardedVariable`'s blocks, else as a value given whole)."""
  name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
  if split:
    wants = "split over the replicas (a PerReplica's component, or a ShardedVariable's blocks)"
    fix = ("lay it out once as the program wants it, its leading axis split over the strategy's replica axis "
           "(`jax.device_put(x, NamedSharding(strategy.mesh, PartitionSpec('replica')))`), or pass on the "
           "value run returned")
  else:
    wants = "replicated on every device of the strategy"
    fix = ("place it once, `x = strategy.experimental_mirror(x)`, and pass what that returns (or pass on the "
           "Mirrored value run returned)")
  try:  # its buffers already where the program wants them, under another name: no copy
    renamed = bool(x.sharding.is_equivalent_to(target, x.ndim))
  except Exception:  # pylint: disable=broad-except  # shardings of other meshes compare unequal or raise
    renamed = False
  how = ("renames its buffers (they are on the right devices already)" if renamed else
         "copies it there (a jax.device_put)")
  return (f"strategy.run({name}) placed the jax.Array at {_run_arg_path(in_tree, i)} "
          f"({x.dtype}[{','.join(map(str, x.shape))}], laid out as {_layout(x.sharding)}) onto the strategy's "
          f"devices ({_layout(target)}) for the {_ordinal(count)} time: the program wants it {wants}, so every "
          f"call {how} and takes run's checked path. If it does not change between calls, {fix}. This warning "
          "is given once per function (and strategy).")


def _layout(sharding: Any) -> str:
  """A sharding as the placement warning writes it: its repr, with a mesh's device ids in order (two meshes
  of the same devices in another order print alike otherwise)."""
  ids = getattr(getattr(sharding, "mesh", None), "device_ids", None)
  return f"{sharding!r}" if ids is None else f"{sharding!r} over devices {np.asarray(ids).ravel().tolist()}"


def _ordinal(n: int) -> str:
  return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _check_host_integers(x: Any, in_tree: Any, i: int) -> None:
  """Raises `OverflowError` before argument leaf `i` (of `run`'s ``(args, kwargs)`` tree `in_tree`) is
  transferred if it is a host int64 / uint64 array holding a value that JAX, without ``jax_enable_x64``,
  would wrap into 32 bits (`validation.check_fits_32_bits`: a type test for anything else)."""
  if isinstance(x, (np.ndarray, np.generic)):
    check_fits_32_bits(x, lambda: f"strategy.run: the argument at {_run_arg_path(in_tree, i)}")


def _run_arg_path(in_tree: Any, i: int) -> str:
  """Leaf `i` of `run`'s ``(args, kwargs)`` tree as the user wrote it: ``args[1]['ids']``, ``kwargs['x']``."""
  dummy = jax.tree.unflatten(in_tree, list(range(in_tree.num_leaves)))
  path = jax.tree_util.tree_flatten_with_path(dummy)[0][i][0]
  return ("args" if path[0].idx == 0 else "kwargs") + tree_path(path[1:])
