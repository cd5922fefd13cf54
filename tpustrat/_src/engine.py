"""How `strategy.run(fn, args)` becomes one compiled SPMD program.

`run` is `jax.jit(jax.shard_map(fn))` over the strategy's mesh:

* Inputs: each `PerReplica` leaf enters with `in_specs=P('replica')` (its leading replica axis is split,
  and removed before `fn` sees its component); `Mirrored` values, plain arrays and Python scalars enter
  with `P()` (every replica gets the whole value).
* Outputs: while `fn` is traced, JAX's varying-axis analysis (``check_vma=True``) records, for every
  output leaf, whether it varies over the replica axis. Invariant leaves (for example the result of an
  `all_reduce`) leave the program with `P()` and are returned as `Mirrored`: one replicated global
  array, never stacked. Varying leaves get a leading axis and `P('replica')` and are returned as
  `PerReplica`. The split is made inside one trace: the body returns ``(invariant, varying)`` and
  `out_specs=(P(), P('replica'))` is a prefix of it, so `fn` is traced once per input signature.
* Padded batches (from the input pipeline, or outputs marked per-example): their per-replica real-row
  counts enter as one more `P('replica')` input, so full and partial batches share a program; inside
  `fn` they back `tpustrat.valid_mask` / `num_valid_examples`. An output that `fn` marked with
  `tpustrat.per_example` leaves `run` as a padded batch (its padding is skipped everywhere). An unmarked
  varying output whose axis 0 holds one padded batch's rows leaves carrying that batch's counts as
  *batch rows*, used only by ``reduce(op, v, axis=0)`` and ``gather(v, axis=0)``: the caller's word
  that axis 0 is the batch. Which outputs hold which batch's rows is read from the step's jaxpr
  (`tpustrat._src.batch_rows`; the step is traced once to a jaxpr and evaluated into the body), never
  from a size. The leaves of one dataset element are one batch (`batch_group`), any other padded value
  its own, so two batches of one size keep their own counts.
* Caching: one `jax.jit` per `(fn, argument structure)`; it takes the flattened argument leaves and
  returns the flattened result, so `jax.jit`'s C++ fast path sees plain arrays in and out, and the host
  work per step is one flatten, one dict lookup, one sharding check per leaf and one unflatten. `jax.jit`
  itself caches per shapes, dtypes and shardings: calling `run` again with the same kind of arguments
  never retraces `fn`.
* Logical cores: when the strategy's replicas have several logical cores (a `DeviceAssignment` with
  ``num_cores_per_replica > 1``), the mesh has core axes after ``'replica'`` and the `shard_map` is
  manual over ``'replica'`` only (``axis_names={'replica'}``): `in_specs` / `out_specs` name the replica
  axis alone, the body sees one replica's values, and how they are laid out on the replica's cores is
  left to XLA, steered by the annotations of `tpustrat._src.logical` (`fn` is traced once to a jaxpr so
  that `experimental_assign_to_logical_device` can place computations). The varying-axis analysis still
  tracks ``'replica'`` only, so a value split across the cores of each replica but equal across
  replicas is `Mirrored`. Results keep the layout XLA gives them over the cores (a split tensor comes
  back split), and arguments laid out differently over the cores only are passed as they are.
  `RunOptions(experimental_layout_map=...)` (a `logical.LayoutMap`) pins the results it matches, by their
  path in `fn`'s result, to its layout over the cores (a sharding constraint on the global result, after
  the `shard_map`): state that `strategy.experimental_shard(..., layout_map=...)` split over the cores
  stays split, optimizer state made inside the step included.
* Steps in flight: before dispatching step ``i``, `run` waits for step ``i - k`` (``k`` =
  `RunOptions.max_steps_in_flight`), on the smallest output the program computes (chosen when it is
  traced; a one-byte token output is added only when there is none of at most 64 KiB). Unbounded
  asynchronous dispatch of collective programs can deadlock XLA:CPU's rendezvous on small machines, and
  buys nothing once the device is busy.

Use: a strategy builds ``Engine(mesh, num_replicas, make_context=...)`` (the engine knows a mesh and a
replica count, not the strategy; `make_context` gives the `ReplicaContext` `fn` sees) and calls
`Engine.run`. Other compiled programs that must share the bound on programs in flight (the multi-step
loop, cross-device reductions) go through `Engine.dispatch`, or, with no engine at hand, the module-level
`dispatch` and its process-wide `InFlight`; a program passed to either returns ``(result, token)``, the
token being the output to wait on (`wait_leaf` picks it).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src import host_memory, profiler, watchdog
from tpustrat._src import numerics as numerics_lib
from tpustrat._src import step_stats as step_stats_lib
from tpustrat._src.batch_rows import BatchRowsWarning, Rows, leading_rows
from tpustrat._src.block_statistics import Mixed, caller, mixed_results
from tpustrat._src.jax_compat import (
  eval_closed_jaxpr,
  forget_failed_programs,
  open_jaxpr,
  same_trace,
  to_varying,
  varying_axes,
)
from tpustrat._src.logical import LayoutMap, check_layout_map, layout_spec
from tpustrat._src.logical_interpreter import place_on_logical_devices
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.padding_reads import PaddingReadWarning, Value, padding_reads
from tpustrat._src.validation import check_fits_32_bits, check_int, tree_path
from tpustrat._src.values import (
  LocalShard,
  Mirrored,
  PerReplica,
  ShardedVariable,
  check_components,
  is_distributed,
  stacked_steps,
)

__all__ = ["RunOptions", "Engine", "InFlight", "check_not_deleted", "dispatch", "donated_leaves", "donation_used", "wait_leaf",
           "donate_argnums_of", "DEFAULT_STEPS_IN_FLIGHT"]

DEFAULT_STEPS_IN_FLIGHT = 2
_MAX_WAIT_BYTES = 64 * 1024  # waiting on an output keeps it alive two steps longer: only small ones
_CACHE_SIZE = 256


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """Options for `strategy.run` (TF's `tf.distribute.RunOptions`, plus tpustrat's own).

  Attributes:
    experimental_enable_dynamic_batch_size: accepted for TF compatibility; XLA programs have static
      shapes and a new shape compiles a new program (partial batches are padded by the input pipeline).
    experimental_bucketizing_dynamic_shape: accepted for TF compatibility; no effect.
    experimental_xla_options: accepted for TF compatibility; no effect.
    max_steps_in_flight: how many `run` calls may be queued on the devices before the next one waits
      for the oldest. `None` uses the strategy's default (2). Must be >= 1.
    donate_argnums: positions of the arguments whose buffers the step may reuse for its results (JAX's
      `jax.jit(..., donate_argnums=...)`): an int or a tuple of ints. For `strategy.run` they index
      `args`; for `experimental_run_steps`, 0 is `init` (the carry) and 1 the stacked batches. A donated
      argument's arrays are deleted by the call (using one again raises JAX's "Array has been deleted"
      error), so the step holds the old and the new state at once only where XLA cannot reuse them: pass
      the training state and keep only what the step returns. Without a mesh (the default strategy)
      nothing is compiled and nothing is donated.
    experimental_layout_map: a `tpustrat.LayoutMap` (needs logical cores per replica): every result of
      the step whose path in the step's result (``[0]['w1']``, ``[1][0].mu['w1']``) a pattern matches is
      laid out on the replica's logical cores as the map says (a sharding constraint), so state placed by
      ``strategy.experimental_shard(..., layout_map=...)`` stays split, optimizer state made in the step
      included. A result two patterns match, or whose shape the layout does not fit, is an error; a map
      that matches none of the step's `Mirrored` arrays (of rank >= 1) is an error too (a pattern anchored to the tree given to
      `experimental_shard`, ``^\\['w1'\\]``, does not find ``[0]['w1']``). Ignored by
      `experimental_run_steps`.
    check_numerics: check every floating output of the step for NaN and Inf inside the compiled program
      (`tpustrat.NumericsError`, a `FloatingPointError`, naming the step, the output's path, NaN / Inf and
      the replicas and processes that produced it). The error is raised once the step has finished, by the
      next call that waits for it: the `run` (or `experimental_run_steps`) call that the steps-in-flight
      bound makes wait for it, or `strategy.experimental_run_wait()`; every process raises the same error
      at the same call. For `experimental_run_steps`, each inner step is checked and named. A `run` traced
      inside a user's own `jax.jit` / `lax.scan` hands its flags to the host by one ordered host callback
      per execution (one per scan iteration), which only records them: the error, naming the execution,
      is raised by `strategy.experimental_run_wait()` (which waits for those callbacks; in every
      process) or, in a one-process job, by the next `run` / `experimental_run_steps` of the strategy,
      after the outer program's results were returned. Off (the default), the program is the one
      compiled without the option.
    scan_unroll: `experimental_run_steps` only (`run` ignores it): the steps written out in each iteration
      of its `lax.scan` (JAX's ``unroll``): 1 (the default) compiles a loop of ``steps`` iterations; an int
      ``u`` >= 1, a loop of ``ceil(steps / u)`` iterations of ``u`` steps; True, the steps one after another
      with no loop. The numbers are the same. On XLA:CPU a convolutional step inside the loop ran 5-9x
      slower than as a program of its own (a one-device `jax.jit(lax.scan)` too) and unrolling fully
      recovered it, while it made a transformer step slower (`benchmarks/bench_multistep.py`, "Many steps
      per program" guide); compiling takes longer with every step written out. Not measured on GPU or
      TPU. Must be an int >= 1 or a bool (False is 1).

  >>> RunOptions(donate_argnums=0).donate_argnums
  (0,)
  """

  experimental_enable_dynamic_batch_size: bool = True
  experimental_bucketizing_dynamic_shape: bool = False
  experimental_xla_options: Any = None
  max_steps_in_flight: int | None = None
  donate_argnums: int | tuple[int, ...] = ()
  experimental_layout_map: LayoutMap | None = None
  check_numerics: bool = False
  scan_unroll: int | bool = 1

  def __post_init__(self) -> None:
    object.__setattr__(self, "check_numerics", numerics_lib.check_option(self.check_numerics))
    if not isinstance(self.scan_unroll, bool):  # True: no loop; False: lax.scan's 1
      object.__setattr__(self, "scan_unroll", check_int(self.scan_unroll, "RunOptions", "scan_unroll", minimum=1))
    elif not self.scan_unroll:
      object.__setattr__(self, "scan_unroll", 1)
    if self.experimental_layout_map is not None and not isinstance(self.experimental_layout_map, LayoutMap):
      raise TypeError(f"RunOptions: experimental_layout_map must be a tpustrat.LayoutMap or None, got "
                      f"{self.experimental_layout_map!r:.100}.")
    k = check_int(self.max_steps_in_flight, "RunOptions", "max_steps_in_flight", minimum=1, allow_none=True)
    object.__setattr__(self, "max_steps_in_flight", k)  # a Python int (frozen dataclass)
    donate = self.donate_argnums
    items = (donate,) if isinstance(donate, int) and not isinstance(donate, bool) else donate
    if not isinstance(items, (tuple, list)):
      raise TypeError(f"RunOptions: donate_argnums must be an int or a tuple of ints, got {donate!r:.100}.")
    checked = [check_int(i, "RunOptions", f"donate_argnums[{j}]", minimum=0) for j, i in enumerate(items)]
    if len(set(checked)) != len(checked):
      raise ValueError(f"RunOptions: donate_argnums {tuple(checked)} names an argument twice.")
    object.__setattr__(self, "donate_argnums", tuple(sorted(checked)))


def donate_argnums_of(options: RunOptions | None) -> tuple[int, ...]:
  """`options.donate_argnums` as `RunOptions.__post_init__` leaves it (a sorted tuple; an int given is
  made a one-element tuple), or () without options."""
  if options is None:
    return ()
  donate = options.donate_argnums
  assert isinstance(donate, tuple)  # __post_init__ always stores a tuple
  return donate


_DONATION_USED = [False]  # set once a program donates: from then on, arguments are checked (`check_not_deleted`)


def donation_used(now: bool = False) -> bool:
  """Whether a program of this process has donated arguments (`RunOptions.donate_argnums`); `now`: one
  is about to."""
  if now:
    _DONATION_USED[0] = True
  return _DONATION_USED[0]


_CONCRETE_ARRAY_TYPES: set[type] = set()  # concrete (non-tracer) jax.Array types seen by `check_not_deleted`


def check_not_deleted(leaves: list[Any], where: Callable[[int], str]) -> None:
  """RuntimeError naming the first deleted array among `leaves` (`where(i)` says which it is): one donated
  to an earlier program. Checked before dispatch, because a compiled program handed a deleted buffer
  crashed the process on XLA:CPU instead of raising (JAX 0.10.2). Per step: a set lookup of the leaf's type
  and `is_deleted()` (about 50 ns a leaf here)."""
  known = _CONCRETE_ARRAY_TYPES
  for i, x in enumerate(leaves):
    kind = type(x)
    if kind not in known:
      if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        continue
      known.add(kind)
    if x.is_deleted():
      raise RuntimeError(
          f"{where(i)} has been deleted: it was donated to an earlier step (RunOptions(donate_argnums=...)) "
          "or deleted. Pass the value that step returned instead (jax: Array has been deleted).")


def check_donatable(args: Any, donate_argnums: tuple[int, ...], leaves: list[Any] | None,
                    donate: tuple[int, ...], where: Callable[[int], str]) -> None:
  """Errors, before dispatch, for donations XLA cannot make: batches of a distributed dataset among `args`
  at `donate_argnums` (their iterator still uses their buffers, and their real-row counts are shared: a
  property of the arguments' structure), and, among `leaves`, an array at a donated position `donate` that
  is also passed at another position (XLA:CPU crashed on "a buffer that was previously donated in the same
  call")."""
  for i in donate_argnums:
    for node in jax.tree.leaves(args[i], is_leaf=is_distributed):
      if isinstance(node, PerReplica) and node.real_rows_array is not None:
        raise ValueError(
            f"RunOptions(donate_argnums={donate_argnums}): argument {i} holds a batch of a distributed dataset "
            f"({node!r}); its iterator keeps using the batch's buffers, so it cannot be donated. Donate the "
            "training state only.")
  if leaves is None:
    return
  donated = {id(leaves[j]): j for j in donate}
  for j, x in enumerate(leaves):
    first = donated.get(id(x))
    if first is not None and first != j and isinstance(x, jax.Array):
      raise ValueError(
          f"{where(j)} is the same array as {where(first).split(': ', 1)[-1]}, which is donated: an array "
          "can be donated only where it is passed once (tied weights: pass the copy that is donated once, or "
          "do not donate).")


def donated_leaves(donate: tuple[int, ...], arg_leaves: list[int], where: str) -> tuple[int, ...]:
  """The flat leaf positions of the arguments `donate` (see `RunOptions.donate_argnums`), given the
  number of leaves of each positional argument; ValueError naming an index out of range."""
  for i in donate:
    if i >= len(arg_leaves):
      raise ValueError(
          f"{where}: RunOptions(donate_argnums={donate}) names argument {i}, but there are "
          f"{len(arg_leaves)} positional arguments.")
  starts = np.cumsum([0, *arg_leaves])
  return tuple(int(j) for i in donate for j in range(starts[i], starts[i + 1]))


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


def is_output_node(x: Any) -> bool:
  """What a step's result is flattened down to: distributed values (an error) and sharded blocks stay whole."""
  return is_distributed(x) or isinstance(x, LocalShard)


def _as_output_array(x: Any, path: str) -> Any:
  if isinstance(x, LocalShard):
    return x
  if is_distributed(x):
    raise TypeError(
        f"strategy.run: the function returned a {type(x).__name__} at {path}; distributed values "
        "(PerReplica, Mirrored) are cross-replica objects that cannot be returned from the replica "
        "function: return the arrays instead (run wraps its results as PerReplica or Mirrored).")
  if isinstance(x, (jax.Array, int, float, complex, bool)) or hasattr(x, "__jax_array__") or (
      hasattr(x, "dtype") and hasattr(x, "shape")):
    return jnp.asarray(x)
  raise TypeError(
      f"strategy.run: the function returned {type(x).__name__} {x!r:.100} at {path}; results must be "
      "arrays, Python numbers or pytrees of them.")


class InFlight:
  """Bounds the number of dispatched-but-unfinished programs: before a dispatch, waits for the oldest
  until fewer than `limit` are pending; after it, records the output to wait on (the token).

  `Engine.dispatch` uses the engine's own; the module-level `dispatch` a process-wide one. With `stats`
  (the engine's `step_stats.StepCounters`), the time spent waiting is added to its device wait, and the
  steps dispatched are noted (two clock reads per dispatch that waits, one per dispatch that does not).
  """

  def __init__(self, stats: step_stats_lib.StepCounters | None = None) -> None:
    self._pending: collections.deque[jax.Array] = collections.deque()
    # id(token) -> the check to run once it is ready (`RunOptions.check_numerics`; empty without it)
    self._checks: dict[int, Callable[..., None]] = {}
    self.stats = stats
    if stats is not None:  # an iterator's transfer that waits for a running step is device time (`step_stats`)
      stats.programs = self._pending

  def before_dispatch(self, limit: int, steps: int = 0) -> float | None:
    """Waits until fewer than `limit` programs are pending. A program of `steps` training steps follows:
    with `stats`, returns the time (`time.perf_counter`) to note its steps at (`after_dispatch`)."""
    pending = self._pending
    stats = self.stats
    if len(pending) < limit:
      return time.perf_counter() if stats is not None and steps else None
    start = time.perf_counter()
    while len(pending) >= limit:
      try:
        oldest = pending.popleft()
      except IndexError:  # another thread took it
        break
      try:
        _wait(oldest)
      except Exception as e:
        # An earlier step failed (its outputs raise the same error wherever they are read). It is out of
        # the queue now, so the next call dispatches; this one raises, naming what happened.
        self._checks.pop(id(oldest), None)
        e.add_note("tpustrat: this error is a step's dispatched before this call, raised while the call waited "
                   f"for it (at most {limit} steps in flight); the step of this call was not dispatched.")
        raise
      if self._checks:
        self._check(oldest)
    if stats is None:
      return None
    now = time.perf_counter()
    stats.device_seconds += now - start
    return now if steps else None

  def _check(self, token: Any) -> None:
    """Runs the check of `token`'s program (it has finished). When it raises, the checks of the programs
    dispatched after it are dropped: they ran on its results, and the error names the first bad step."""
    check = self._checks.pop(id(token), None)
    if check is None:
      return
    try:
      check()
    except Exception:
      dropped = len(self._checks)
      self._checks.clear()
      if dropped:
        check(dropped)  # the same error, saying how many later steps are not checked
      raise

  def after_dispatch(self, token: Any, check: Callable[..., None] | None = None, steps: int = 0,
                     now: float | None = None) -> None:
    # The token is a small output of the step's program (at most 64 KiB, often a scalar loss), ready when
    # the program has finished. Holding large outputs alive would stop XLA from reusing their buffers
    # (measured: +340 us per 1 MiB step on XLA:CPU); an extra output costs every step (measured: +6.5 us
    # on a 90 us step on XLA:CPU with 8 devices), so a one-byte token is added only when nothing small
    # is computed.
    if token is not None and not isinstance(token, jax.core.Tracer):
      self._pending.append(token)
      if check is not None:
        self._checks[id(token)] = check
    elif token is not None:
      return  # a `run` traced inside another program (`experimental_run_steps`, a user's jit): not a step
    if now is not None:  # `steps` training steps dispatched at `now` (`before_dispatch`'s clock reading)
      assert self.stats is not None  # `before_dispatch` returns a clock reading only with `stats`
      self.stats.note_steps(steps, now)

  def drain(self) -> None:
    start = time.perf_counter()
    try:
      while self._pending:
        try:
          oldest = self._pending.popleft()
        except IndexError:
          break
        _wait(oldest)
        if self._checks:
          self._check(oldest)
    finally:
      if self.stats is not None:
        self.stats.device_seconds += time.perf_counter() - start


  def forget(self, arrays: list[Any]) -> None:
    """Stops waiting on any of `arrays` (by identity): arguments about to be donated to a program
    (`RunOptions.donate_argnums`). That program cannot finish before the one that computed them, and
    its own output is waited on instead, so the bound still holds."""
    ids = {id(x) for x in arrays}
    if any(id(t) in ids for t in self._pending):
      kept = [t for t in self._pending if id(t) not in ids]
      self._pending.clear()
      self._pending.extend(kept)


def _wait(token: jax.Array) -> None:
  """Waits for a program's output (skipped if it was deleted). When the program failed, its error is
  raised here, to the caller: JAX's own record of the failure, which it would report again at exit, is
  dropped (`jax_compat.forget_failed_programs`)."""
  if not token.is_deleted():
    try:
      token.block_until_ready()
    except Exception:
      forget_failed_programs()
      raise


_PROCESS_IN_FLIGHT = InFlight()  # for programs dispatched without an engine (cross-replica reductions)


def dispatch(program: Callable[..., tuple[Any, Any]], *args: Any, in_flight: InFlight | None = None,
             limit: int | None = None, steps: int = 0,
             numerics: Callable[[Any], Callable[..., None] | None] | None = None) -> Any:
  """Calls ``program(*args)``, which returns ``(result, token)``, with at most `limit` (default
  `DEFAULT_STEPS_IN_FLIGHT`) programs in flight in `in_flight` (default: one process-wide bound);
  returns `result`. `token` is the output to wait on (see `wait_leaf`), or None for nothing. The program
  counts as `steps` training steps for the step watchdog (`watchdog.note`; 0 for a reduction).
  `numerics` (`RunOptions.check_numerics`): the token is the program's numerics flags, and
  ``numerics(token)`` the check to run once the program has finished (`numerics.make_check`)."""
  bound = _PROCESS_IN_FLIGHT if in_flight is None else in_flight
  mark = profiler.step_begin(program, steps) if steps else None  # the step's trace mark (`profiler.py`)
  token = None
  try:
    noted = bound.before_dispatch(DEFAULT_STEPS_IN_FLIGHT if limit is None else limit, steps)
    result, token = program(*args)
  finally:
    if mark is not None:
      profiler.step_end(mark, steps, token)
  bound.after_dispatch(token, None if numerics is None else numerics(token), steps, noted)
  watchdog.note(token, steps)
  return result


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
    self._programs: collections.OrderedDict[Any, _FlatProgram] = collections.OrderedDict()
    # Where the loop's time goes (`strategy.experimental_step_stats()`): the in-flight waits and the steps
    # noted here, the input waits by the strategy's iterators.
    self.step_stats = step_stats_lib.StepCounters()
    self._in_flight = InFlight(self.step_stats)
    # `RunOptions.check_numerics` of programs traced inside a user's jit / scan: their recorded errors
    self._traced_numerics = numerics_lib.TracedChecks(mesh)
    self._one_process = jax.process_count() == 1
    self._retraces = step_stats_lib.Retraces()  # programs compiled per function (`RetracingWarning`)
    self._donations: dict[Any, tuple[int, ...]] = {}  # (run key, donate_argnums) -> donated leaf positions
    self._entries: collections.OrderedDict[Any, tuple[_FlatProgram, list[NamedSharding]]] = (
        collections.OrderedDict())
    self._array_types: set[type] = set()  # concrete (non-tracer) jax.Array types seen already placed
    self._replicated = NamedSharding(mesh, P())
    self._split = NamedSharding(mesh, P(axis_name))
    self._core_axes = tuple(a for a in mesh.axis_names if a != axis_name)  # logical cores of a replica
    self.max_steps_in_flight = DEFAULT_STEPS_IN_FLIGHT
    self._alias_align = host_memory.mesh_alias_alignment(mesh)

  def run(self, fn: Callable[..., Any], args: Any, kwargs: Any, options: RunOptions | None) -> Any:
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
    fn_key = weak_key(fn)
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
    array_types = self._array_types
    for i, x in enumerate(leaves):  # arrays already where the program wants them pass untouched
      if type(x) not in array_types or x.sharding != targets[i]:
        _check_host_integers(x, in_tree, i)
        try:
          leaves[i] = self._place(x, targets[i])
        except ValueError:
          _check_sharded_replicas((args, kwargs), self._num_replicas)  # the clearer error, if that is the cause
          raise
    donate_argnums = donate_argnums_of(options)
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
      check_donatable(None, (), leaves, donate, lambda i: f"strategy.run: the argument at {_run_arg_path(in_tree, i)}")
      program = program.donating(donate)
      _DONATION_USED[0] = True
      self._in_flight.forget([leaves[i] for i in donate])
    if _DONATION_USED[0]:  # a donated array passed again: XLA:CPU crashes on it (JAX 0.10.2), so say so first
      check_not_deleted(leaves, lambda i: f"strategy.run: the argument at {_run_arg_path(in_tree, i)}")
    if checked:
      out = self.dispatch(program, leaves, limit=limit, steps=1, numerics=program.numerics_check)
    else:
      out = self.dispatch(program, leaves, limit=limit, steps=1)
    if program.notes.get("padding_reads"):
      _warn_padding_reads(program.notes, args, kwargs)
    return out

  def dispatch(self, program: Callable[..., tuple[Any, Any]], *args: Any, limit: int | None = None,
               steps: int = 0, numerics: Callable[[Any], Callable[..., None] | None] | None = None) -> Any:
    """Calls ``program(*args)``, which returns ``(result, token)``, under this engine's bound on programs
    in flight (`limit`, default `max_steps_in_flight`); returns `result`. `token` is the output to wait
    on before a later dispatch (see `wait_leaf`), or None. `steps`: the training steps it runs (for the
    step watchdog). `numerics`: see the module-level `dispatch`.

    In a one-process job, an error recorded by a checked program traced inside a user's jit / scan
    (`numerics.TracedChecks`) is raised here, before dispatching a step (not a reduction, not while
    tracing)."""
    if steps and self._traced_numerics.recorded and self._one_process and not any(
        isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
      self._traced_numerics.raise_recorded()
    return dispatch(program, *args, in_flight=self._in_flight, limit=limit or self.max_steps_in_flight,
                    steps=steps, numerics=numerics)

  def _entry(self, fn: Callable[..., Any], fn_key: Any, in_tree: Any, layout_map: LayoutMap | None = None,
             checked: bool = False) -> tuple[_FlatProgram, list[NamedSharding]]:
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
                    seen_tree: Any, checked: bool) -> _FlatProgram:
    traced = self._on_trace(weak_key(fn), getattr(fn, "__qualname__", "") or getattr(fn, "__name__", "fn"))
    if not checked:
      return _FlatProgram(self._make_program(fn, groups, layout_map), seen_tree, on_trace=traced)
    outputs = numerics_lib.Outputs([], [], numerics_lib.replica_processes(self._mesh, self._axis),
                                   f"strategy.run({getattr(fn, '__name__', 'fn')})")
    return _FlatProgram(self._make_program(fn, groups, layout_map, outputs), seen_tree, checked=outputs,
                        on_trace=traced, traced_numerics=self._traced_numerics)

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
      if self._core_axes and _same_over_replicas(x.sharding, target, self._axis):
        return x  # differs from `target` over the logical cores only (a split result of `run`): keep it
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

  @property
  def mesh(self) -> jax.sharding.Mesh:
    """The strategy's mesh (``'replica'``, then the logical-core axes)."""
    return self._mesh

  def _pin_layouts(self, outs: list[Any], layout_map: LayoutMap, record: dict[str, Any]) -> list[Any]:
    """`RunOptions.experimental_layout_map`: the program's global results (`outs`, at trace time), each
    result a pattern matches constrained to its layout over the core axes (replicated over ``'replica'``
    for a `Mirrored` result, split on its leading axis for a `PerReplica` one). Without it XLA picks the
    results' layouts, and state made inside the step (an optimizer's zeros) comes back replicated."""
    where = "strategy.run (RunOptions.experimental_layout_map)"
    dummy = jax.tree.unflatten(record["tree"], list(range(record["tree"].num_leaves)))
    paths = [tree_path(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
    pinned, matched = [], False
    for x, path, v, sh, shape in zip(outs, paths, record["varying"], record["shards"], record["shapes"]):
      hit = layout_map.match(path, where)
      if hit is None:
        pinned.append(x)
        continue
      matched = True
      if sh is not None:
        raise ValueError(
            f"{where}: the result at {path} is a sharded value (a ShardedVariable, split over the replicas) and "
            f"matches the LayoutMap pattern {hit[0]!r}; a value is split over the replicas or laid out on the "
            "logical cores, not both. Make the pattern skip it.")
      spec = tuple(layout_spec(self, path, hit[0], hit[1], shape, where))
      spec = (self._axis, *spec) if v else spec
      pinned.append(jax.lax.with_sharding_constraint(x, NamedSharding(self._mesh, P(*spec))))
    # A map that finds none of the step's replicated (Mirrored) arrays is most likely anchored to the tree
    # given to experimental_shard; steps without such results (a loss, a stateless optimizer's init) pass.
    if not matched and any(not v and len(shape) for v, shape in zip(record["varying"], record["shapes"])):
      raise ValueError(
          f"{where}: no pattern of the LayoutMap ({', '.join(repr(p) for p in layout_map)}) matches a result of "
          f"the step (results: {', '.join(paths[:8])}{', ...' if len(paths) > 8 else ''}); pass the map only to "
          "steps that return the state it lays out. Patterns are searched (re.search) in the result's paths: "
          "do not anchor them to the tree given to experimental_shard.")
    return pinned

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

  def _make_program(self, fn: Callable[..., Any], groups: tuple[int, ...],
                    layout_map: LayoutMap | None = None,
                    numerics: numerics_lib.Outputs | None = None) -> Callable[..., Any]:
    """The structured program of `fn`; `groups` (see `batch_group`) says which padded batch arguments
    are one batch (share their real-row counts); `layout_map` pins the results it matches to their
    layouts over the logical cores (`RunOptions.experimental_layout_map`). With `numerics`
    (`RunOptions.check_numerics`) it returns ``(result, flags)``, `flags` being every replica's NaN / Inf
    flags of the floating outputs (`numerics.replica_flags`), and records in `numerics` which outputs
    they describe."""
    name = getattr(fn, "__name__", "fn")
    # What the trace found that is said when a call shows it matters: the padding-read warning, said at
    # the first call whose batch is partial (a program made on a full batch serves the partial one too).
    notes: dict[str, str | None] = {}
    fn = weak_callable(fn)  # the cache must not keep the user's function (and its closure) alive
    make_context, mesh, axis = self._make_context, self._mesh, self._axis
    n = self._num_replicas
    core_axes = self._core_axes
    manual = {"axis_names": frozenset({axis})} if core_axes else {}  # core axes: left to XLA

    def program(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
      # Runs once per input signature, at trace time: validate, then build the SPMD body.
      top, outer = jax.tree.flatten((args, kwargs), is_leaf=is_distributed)
      flat: list[Any] = []
      specs: list[P] = []
      rebuild: list[tuple[str, Any, int]] = []
      padded: list[int] = []  # positions in `flat` of the real-row counts of padded batches
      padded_paths: list[str] = []
      for path, node in zip(_leaf_paths(outer), top):
        if isinstance(node, PerReplica):
          leaves, inner = jax.tree.flatten(node.tree)
          for x in leaves:
            check_components(x, n, f"strategy.run: the PerReplica value at {path}")
          # A padded batch: its real-row counts enter as one more input (an unmarked output's batch
          # rows do not make it a padded batch of this step).
          valid = node.real_rows_array if node.padding_is_marked else None
          if valid is not None:
            _check_padded(leaves, path)
            padded.append(len(flat) + len(leaves))
            padded_paths.append(path)
            leaves = leaves + [valid]
          rebuild.append(("padded" if valid is not None else "per_replica", inner, len(leaves)))
          flat.extend(leaves)
          specs.extend([P(axis)] * len(leaves))
        elif isinstance(node, ShardedVariable):
          rebuild.append(("sharded", (node.shape, node.axis), 1))
          flat.append(node.tree)
          specs.append(P(axis))
        elif isinstance(node, Mirrored):
          leaves, inner = jax.tree.flatten(node.tree)
          rebuild.append(("mirrored", inner, len(leaves)))
          flat.extend(leaves)
          specs.extend([P()] * len(leaves))
        else:
          rebuild.append(("plain", None, 1))
          flat.append(node)
          specs.append(P())

      # One batch per group of padded arguments with the same counts (and size): its first argument's.
      batch_of_arg = [groups[j] if j < len(groups) else j for j in range(len(padded))]
      batches = sorted(set(batch_of_arg))
      record: dict[str, Any] = {}

      def marking(*args: Any, **kwargs: Any) -> Any:
        # `tpustrat.per_example` marks arrays by identity; resolved to output positions here, where `fn`'s
        # own results are seen (before a logical-core re-evaluation makes new ones).
        out = fn(*args, **kwargs)
        ctx = context_lib.get_replica_context()
        assert ctx is not None  # `body` calls this inside `enter_replica_context`
        marks = ctx.per_example_marks  # (array, batch or None)
        leaves = jax.tree.leaves(out, is_leaf=is_distributed)
        record["marked"] = {i: j for i, x in enumerate(leaves) for m, j in marks if x is m}
        return out

      # With logical cores, `fn` is traced to a jaxpr once and evaluated with its placements honoured.
      call = place_on_logical_devices(marking, core_axes, n) if core_axes else marking

      def body(*flat_in: Any) -> Any:
        nodes, row_leaves, size_of = _unpack(flat_in, rebuild, batch_of_arg)
        batch_leaves = [(batches.index(batch_of_arg[arg]), leaves) for arg, leaves in row_leaves]
        sizes = [size_of[b] for b in batches]  # per padded batch
        counts = [flat_in[padded[b]].reshape(()).astype(jnp.int32) for b in batches]  # this replica's real rows
        names = tuple(f"the argument at {padded_paths[b]}" for b in batches)
        if (batches or any(isinstance(x, LocalShard) for x in nodes)) and not core_axes:
          # A step on padded batches or sharded values is traced to a jaxpr, read (which outputs hold which
          # batch's rows, `batch_rows`; which blocks it returns hold a statistic of this replica's block
          # alone, `block_statistics`), and evaluated here: `fn` is still traced once.
          step = _StepJaxpr(fn, nodes, outer, batch_leaves, sizes, counts, names, make_context)
          step.check_block_statistics()
          notes["padding_reads"] = step.padding_reads_message()
          out_leaves = step.evaluate()
          out_tree, paths, marked = step.tree, step.paths, step.marked
          rows: list[Rows] | Callable[[], list[Rows]] = step.rows
        else:
          call_args, call_kwargs = jax.tree.unflatten(outer, nodes)
          ctx = make_context(list(zip(sizes, counts)))
          ctx.batch_names = names
          for b, leaves in batch_leaves:
            ctx.note_batch_leaves(leaves, b)
          with context_lib.enter_replica_context(ctx):
            out = call(*call_args, **call_kwargs)
          _warn_unresolved(ctx.unresolved)
          # Distributed values stay whole (trace time only), so that returning one is reported by name;
          # sharded blocks (`LocalShard`) stay whole to come back as `ShardedVariable`s.
          out_leaves, out_tree = jax.tree.flatten(out, is_leaf=is_output_node)
          paths = _leaf_paths(out_tree)
          marked = record.pop("marked")
          out_leaves = [_as_output_array(x, p) for x, p in zip(out_leaves, paths)]
          # With logical cores (and padded batches), the rows are read from one more trace of `fn`.
          rows = (lambda: _StepJaxpr(fn, nodes, outer, batch_leaves, sizes, counts, names, make_context,
                                     quiet=True).rows)
        # A block (`LocalShard`) leaves as one more per-replica output, a `ShardedVariable` again (a block
        # computed from constants, an optimizer's zeros, is cast to varying: it is still one replica's).
        shards = [(x.shape, x.axis) if isinstance(x, LocalShard) else None for x in out_leaves]
        for x, p in zip(out_leaves, paths):
          if isinstance(x, LocalShard):
            _check_block(x, p, n)
        out_leaves = [to_varying(x.block, axis) if isinstance(x, LocalShard) else x for x in out_leaves]
        is_varying = [axis in varying_axes(x) for x in out_leaves]
        record["tree"], record["varying"], record["shards"] = out_tree, is_varying, shards
        record["shapes"] = [jnp.shape(x) for x in out_leaves]  # one replica's (a block's for a shard)
        # Padding follows an output only as the user said: (batch, True) for a marked per-example output;
        # (batch, False), batch rows for `axis=0`, for an unmarked one whose axis 0 the program shows to
        # hold one padded batch's rows (`batch_rows`: traced, not read off its size).
        guessed: set[int] = set()  # outputs whose padding is assumed from their size, not traced
        record["padded"] = _output_padding(out_leaves, paths, [v and sh is None for v, sh in zip(is_varying, shards)],
                                           marked, sizes, names, rows, guessed)  # blocks are never a batch's rows
        invariant = tuple(x for x, v in zip(out_leaves, is_varying) if not v)
        varying = tuple(x[None] for x, v in zip(out_leaves, is_varying) if v)
        if numerics is None:
          return invariant, varying
        # Padding rows are skipped only where the program shows the rows to be the batch's (or the user
        # marked them): an output whose rows were moved in a way not traced (a flip, a sort) is checked
        # whole, and a NaN past the real rows is reported as possibly padding.
        out_batch = [p if p is not None and v and sh is None else None
                     for p, v, sh in zip(record["padded"], is_varying, shards)]
        row_counts = [counts[p[0]] if p is not None and i not in guessed else None for i, p in enumerate(out_batch)]
        untraced = [counts[p[0]] if p is not None and i in guessed else None for i, p in enumerate(out_batch)]
        # A block's padding rows (past the logical size) are not data: checked without them.
        checked_leaves = [LocalShard(x, *sh).real_block() if sh is not None else x for x, sh in zip(out_leaves, shards)]
        flags, checked = numerics_lib.replica_flags(checked_leaves, is_varying, row_counts, axis, n, untraced)
        numerics.untraced = [names[ob[0]] if (ob := out_batch[i]) is not None and i in guessed else None
                             for i in checked]
        numerics.paths = [paths[i] for i in checked]
        numerics.kinds = ["ShardedVariable" if shards[i] is not None else "PerReplica" if is_varying[i]
                          else "Mirrored" for i in checked]
        return (*invariant, numerics_lib.gather_flags(flags, axis)), varying

      invariant, varying = jax.shard_map(
          body, mesh=mesh, in_specs=tuple(specs), out_specs=(P(), P(axis)), check_vma=True, **manual)(*flat)
      if numerics is not None:
        *invariant, flags = invariant
      inv, var = iter(invariant), iter(varying)
      picked = [next(var) if v else next(inv) for v in record["varying"]]  # blocks are varying
      if layout_map is not None:
        picked = self._pin_layouts(picked, layout_map, record)
      outs = [ShardedVariable.from_blocks(x, *sh) if sh is not None
              else PerReplica.from_stacked(x) if v and p is None
              else PerReplica.from_stacked(x, flat[padded[batches[p[0]]]], per_example=p[1]) if v
              else Mirrored.from_global(x)
              for x, v, p, sh in zip(picked, record["varying"], record["padded"], record["shards"])]
      if numerics is not None:
        return jax.tree.unflatten(record["tree"], outs), flags
      return jax.tree.unflatten(record["tree"], outs)

    program.__name__ = f"run_{name}"
    program.__qualname__ = program.__name__
    program.notes = notes  # type: ignore[attr-defined]  # read by `Engine.run` (`_warn_padding_reads`)
    return program


def weak_key(fn: Callable[..., Any]) -> Any:
  """A cache key for `fn` that does not keep it alive: equal for the same function (or the same bound
  method: ``obj.step`` is a new object on every access), never equal once it is gone. Callables that
  cannot be referenced weakly are their own key."""
  if type(fn) is types.MethodType:
    return _MethodKey(weakref.ref(fn.__self__), fn.__func__)
  try:
    return weakref.ref(fn)  # CPython hands out the same ref object while `fn` lives: cheap per step
  except TypeError:
    return fn


class _MethodKey:
  """A bound method's identity (its object, held weakly, and its function), as a cache key."""

  __slots__ = ("_obj", "_func", "_hash")

  def __init__(self, obj: weakref.ref, func: Callable[..., Any]) -> None:
    self._obj, self._func = obj, func
    self._hash = hash((id(obj), id(func)))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, _MethodKey) or self._func is not other._func:
      return False
    obj = self._obj()
    return obj is not None and obj is other._obj()


def weak_callable(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn`, called through a weak reference where it can be (a compiled program retraces `fn` only while
  the caller still holds it, so the cache may hold the program without holding `fn`)."""
  if type(fn) is types.MethodType:
    ref: Callable[[], Any] = weakref.WeakMethod(fn)
  else:
    try:
      ref = weakref.ref(fn)
    except TypeError:
      return fn

  def call(*args: Any, **kwargs: Any) -> Any:
    target = ref()
    if target is None:
      raise RuntimeError("strategy.run: the step function of this cached program no longer exists.")
    return target(*args, **kwargs)

  return call


class _FlatProgram:
  """A `run` program over flat argument leaves that returns flat result leaves plus the one to wait on.

  The result's structure (with its `Mirrored` / `PerReplica` nodes) is recorded when the program is
  traced and rebuilt after each call. If one argument structure ever traces to two result structures
  (a result structure that depends on shapes), the program falls back to returning the pytree, which
  `jax.jit` tracks per signature.
  """

  def __init__(self, structured: Callable[..., Any], seen_tree: Any, donate: tuple[int, ...] = (),
               checked: numerics_lib.Outputs | None = None,
               on_trace: Callable[[Any, list[Any]], None] | None = None,
               traced_numerics: numerics_lib.TracedChecks | None = None) -> None:
    """`checked` (`RunOptions.check_numerics`): `structured` returns ``(result, flags)``; the flags are the
    output to wait on, and `numerics_check` makes the check of a call's flags (`traced_numerics`: the
    engine's, for a call traced inside a user's jit / scan). `on_trace(seen_tree,
    leaves)` is called each time JAX traces the program (a new program is compiled), with the traced
    argument leaves."""
    self._on_trace = on_trace
    # What the latest trace recorded, and the (result treedef, index of the leaf to wait on) kept.
    self._record: dict[str, tuple[Any, int] | None] = {"traced": None, "out": None}
    self._fallback: Callable[..., Any] | None = None
    self._structured, self._seen_tree, self._checked = structured, seen_tree, checked
    self.notes: dict[str, str | None] = getattr(structured, "notes", {})
    self._traced_numerics = traced_numerics
    self.numerics_check = None if checked is None else numerics_lib.make_check(checked, traced=traced_numerics)

    def flat(*leaves: Any) -> tuple[list[Any], Any, int]:
      if on_trace is not None:
        on_trace(seen_tree, list(leaves))
      args, kwargs = jax.tree.unflatten(seen_tree, leaves)
      if checked is not None:  # the flags: the last output, and the one to wait on
        result, flags = structured(args, kwargs)
        out, out_tree = jax.tree.flatten(result)
        out.append(flags)
        return out, out_tree, len(out) - 1
      out, out_tree = jax.tree.flatten(structured(args, kwargs))
      # A donating program always waits on a token of its own: its small outputs are typically part of
      # the state the next step donates, and a donated array cannot be waited on.
      wait = None if donate else wait_leaf(out, leaves)
      if wait is None:  # nothing small computed: a one-byte token to wait on
        out.append(jnp.zeros((), jnp.int8))
        wait = len(out) - 1
      return out, out_tree, wait

    def flat_program(*leaves: Any) -> list[Any]:
      out, out_tree, wait = flat(*leaves)
      self._record["traced"] = (out_tree, wait)
      return out

    def tree_program(*leaves: Any) -> tuple[Any, Any]:
      out, out_tree, wait = flat(*leaves)
      return out_tree.unflatten(out[:out_tree.num_leaves]), out[wait]

    self.__name__ = getattr(structured, "__name__", "run_fn")
    flat_program.__name__ = tree_program.__name__ = self.__name__
    self._flat = jax.jit(flat_program, donate_argnums=donate)
    self._tree = jax.jit(tree_program, donate_argnums=donate)
    self._donating: dict[tuple[int, ...], _FlatProgram] = {}

  def donating(self, leaves: tuple[int, ...]) -> _FlatProgram:
    """This program with the argument leaves at positions `leaves` donated (compiled once per set)."""
    if not leaves:
      return self
    variant = self._donating.get(leaves)
    if variant is None:
      variant = self._donating[leaves] = _FlatProgram(self._structured, self._seen_tree, leaves, self._checked,
                                                      self._on_trace, self._traced_numerics)
    return variant

  def __call__(self, leaves: list[Any]) -> tuple[Any, Any]:
    """Runs the program; returns (result pytree, the output to wait on)."""
    if self._fallback is not None:
      return self._fallback(*leaves)
    self._record["traced"] = None
    out = self._flat(*leaves)
    traced = self._record["traced"]
    known = self._record.get("out")
    if traced is not None and known is not None and traced != known:
      self._fallback = self._tree  # two result structures: let jax.jit keep them apart from now on
    elif traced is not None and known is None:
      self._record["out"] = traced
    kept = traced or self._record["out"]
    assert kept is not None  # a new program's first call traces it, and every trace records its result
    out_tree, wait = kept
    return out_tree.unflatten(out[:out_tree.num_leaves]), out[wait]


def wait_leaf(out: list[Any], inputs: Sequence[Any]) -> int | None:
  """Index of the smallest output (at most `_MAX_WAIT_BYTES`) the program computes, or None.

  `out` are the outputs of the `shard_map` of the step, so an argument `fn` returns unchanged is a new
  tracer here, not one of `inputs`: on jax 0.10.2 it is not forwarded to the input's buffer either
  (the pass-through is copied into a fresh output buffer by the compiled program, which becomes ready
  when the program finishes, like every output), so choosing it is correct. The `inputs` check only
  skips a jit argument returned as is, should a future jax forward shard_map pass-throughs to the outer
  jaxpr; such an output would be the argument's own buffer, ready before the step runs.
  """
  passed = {id(x) for x in inputs}
  best, best_size = None, _MAX_WAIT_BYTES + 1
  for i, x in enumerate(out):
    if id(x) in passed:
      continue
    size = int(np.prod(np.shape(x))) * x.dtype.itemsize  # a typed PRNG key's dtype is no numpy dtype
    if size < best_size:
      best, best_size = i, size
  return best


def _same_over_replicas(sharding: Any, target: NamedSharding, axis: str) -> bool:
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


def _check_block(x: LocalShard, path: str, n: int) -> None:
  """A block a step returns must still be a block of its value: same shape (elementwise updates)."""
  want = list(x.shape)
  want[x.axis] = -(-x.shape[x.axis] // n)
  if list(jnp.shape(x.block)) != want:
    raise ValueError(
        f"strategy.run: the sharded value at {path} comes back with a block of shape {list(jnp.shape(x.block))}, "
        f"but a value of shape {list(x.shape)} split along axis {x.axis} over {n} replicas has blocks of shape "
        f"{want}. Update blocks elementwise (jax.tree.map, optax), or return a new value read whole "
        "(x.read_value()) instead of a LocalShard.")


def batch_group(node: PerReplica, path: tuple[Any, ...], roots: dict[Any, int], index: int) -> int:
  """Which batch the padded argument `node` (the `index`-th, at `path` among `run`'s arguments) belongs
  to: the index of the first padded argument of its batch.

  The leaves of one dataset element, passed where the element put them (the element itself, anywhere in
  the arguments), are one batch: they share their real-row counts. Every other padded value (a leaf taken
  out of its element, an output marked `per_example`) is a batch of its own. Read from the arguments'
  structure (`PerReplica.batch_tag`), so the same inside `jax.jit` and `lax.scan`, where the counts of
  one element's leaves are separate tracers; two elements of one dataset are two batches.
  """
  tag = node.batch_tag
  if tag is None:
    return index
  root = tag.element_root(path)
  if root is None:
    return index
  return roots.setdefault((root, tag.paths), index)


def _unpack(flat_in: Any, rebuild: list[tuple[str, Any, int]],
            batch_of_arg: list[int]) -> tuple[list[Any], list[tuple[int, list[Any]]], dict[int, int]]:
  """The arguments `fn` sees, from the shard_map body's inputs: (nodes, the per-replica leaves of each
  padded batch argument, the per-replica size of each batch)."""
  it = iter(flat_in)
  nodes: list[Any] = []
  row_leaves: list[tuple[int, list[Any]]] = []
  sizes: dict[int, int] = {}
  arg = 0
  for kind, inner, count in rebuild:
    leaves = [next(it) for _ in range(count)]
    if kind == "padded":
      *leaves, _ = leaves
      b = batch_of_arg[arg]
      k = leaves[0].shape[1]
      if sizes.setdefault(b, k) != k:
        raise ValueError(
            f"strategy.run: two padded batch arguments share their real-row counts but have per-replica "
            f"sizes {sizes[b]} and {k}; a batch's arrays all have its size.")
      local = [x.reshape(x.shape[1:]) for x in leaves]
      row_leaves.append((arg, local))
      arg += 1
      nodes.append(jax.tree.unflatten(inner, local))
      continue
    if kind == "sharded":  # this replica's block of a ShardedVariable
      nodes.append(LocalShard(leaves[0].reshape(leaves[0].shape[1:]), *inner))
    elif kind == "per_replica":
      nodes.append(jax.tree.unflatten(inner, [x.reshape(x.shape[1:]) for x in leaves]))
    elif kind == "mirrored":
      nodes.append(jax.tree.unflatten(inner, leaves))
    else:
      nodes.append(leaves[0])
  return nodes, row_leaves, sizes


class _StepJaxpr:
  """`fn` traced to a jaxpr on the arguments it sees in the body of `run`'s `shard_map` (`nodes`; the
  arrays of each padded batch in `batch_leaves`, with its per-replica size and this replica's real rows),
  in a replica context of its own: `rows` says which outputs hold which batch's rows (`batch_rows`),
  `evaluate()` emits the step into the current trace."""

  def __init__(self, fn: Callable[..., Any], nodes: list[Any], outer: Any,
               batch_leaves: list[tuple[int, list[Any]]], sizes: list[int], counts: list[Any],
               names: tuple[str, ...], make_context: Callable[..., Any], *, quiet: bool = False) -> None:
    leaves, treedef = jax.tree.flatten(nodes)
    batch_at = {id(x): b for b, xs in batch_leaves for x in xs}
    labels = [Rows.of({batch_at[id(x)]}) if id(x) in batch_at else Rows.NONE for x in leaves]
    where = [(i, batch_at[id(x)]) for i, x in enumerate(leaves) if id(x) in batch_at]
    num = len(leaves)

    queries: list[tuple[Any, str, bool]] = []
    unresolved: list[str] = []

    def flat_fn(*flat: Any, answers: list[tuple[int, ...] | None] | None = None) -> list[Any]:
      ctx = make_context(list(zip(sizes, flat[num:])))
      ctx.batch_names = names
      ctx.row_answers = answers
      ctx.step_probe = flat[0] if flat else None
      for i, b in where:
        ctx.note_batch_leaves([flat[i]], b)
      args, kwargs = jax.tree.unflatten(outer, jax.tree.unflatten(treedef, list(flat[:num])))
      with context_lib.enter_replica_context(ctx), warnings.catch_warnings():
        if quiet:  # a second trace: the step's own has said what it had to say
          warnings.simplefilter("ignore")
        out = fn(*args, **kwargs)
      # Distributed values stay whole here, so that returning one is reported by name.
      out_leaves, self.tree = jax.tree.flatten(out, is_leaf=is_output_node)
      self.paths = _leaf_paths(self.tree)
      self.shards = [(x.shape, x.axis) if isinstance(x, LocalShard) else None for x in out_leaves]
      # `tpustrat.per_example` marks arrays by identity: resolved to output positions here.
      self.marked = {i: j for i, x in enumerate(out_leaves) for m, j in ctx.per_example_marks if x is m}
      results = [x.block if isinstance(x, LocalShard) else _as_output_array(x, p)
                 for x, p in zip(out_leaves, self.paths)]
      if answers is None:
        unresolved.extend(ctx.unresolved)
      if answers is None and ctx.row_queries:  # traced once more to follow them (`ReplicaContext.padding_count`)
        # Only values of this program can be followed (not one traced inside a loop body or a vmap).
        queries[:] = [(x, what, bool(flat) and same_trace(x, flat[0])) for x, what in ctx.row_queries]
        results += [jnp.asarray(x) for x, _, here in queries if here]
      return results

    self._args = [*leaves, *counts]
    self._unresolved = unresolved
    in_rows = labels + [Rows.NONE] * len(counts)
    self._batch_labels, self._names = labels, names
    self._jaxpr, self._consts = open_jaxpr(jax.make_jaxpr(flat_fn)(*self._args))
    self.rows = leading_rows(self._jaxpr, in_rows)
    if not quiet:
      _warn_unresolved(unresolved)
    if queries and not quiet:
      # Arrays computed in the step whose padded batch library code asked for: their rows, traced here,
      # answer the question in a second trace, whose program is the one that runs.
      followed = iter(self.rows[len(self.rows) - sum(here for *_, here in queries):])
      answers = [self._answer(next(followed) if here else Rows.unknown("a loop or vmap around it"), x, what, sizes,
                              names) for x, what, here in queries]
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first trace has said what it had to say
        self._jaxpr, self._consts = open_jaxpr(jax.make_jaxpr(functools.partial(flat_fn, answers=answers))(*self._args))
      self.rows = leading_rows(self._jaxpr, in_rows)
    # The split axis of each input leaf that is a block of a sharded value (`LocalShard`).
    self._split = [x.axis if isinstance(x, LocalShard) else None
                   for x in jax.tree.leaves(nodes, is_leaf=lambda x: isinstance(x, LocalShard))]
    self._split += [None] * len(counts)

  def padding_reads_message(self) -> str | None:
    """The `PaddingReadWarning` message naming the outputs that sum a padded batch's rows with padding
    rows no mask removed (`padding_reads`), and the fix; None where there are none."""
    if not self._batch_labels or not any(r.batches for r in self._batch_labels):
      return None
    inputs = [Value(rows=r, zero=True) if r.batches else Value() for r in self._batch_labels]
    inputs += [Value(mask=True)] * (len(self._split) - len(self._batch_labels))
    found = [(p, v.read) for p, v in zip(self.paths, padding_reads(self._jaxpr, inputs)) if v.read is not None]
    if not found:
      return None
    eqn, batches = found[0][1]
    where = ", ".join(p for p, _ in found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
    return (
        f"strategy.run: the output{'s' if len(found) > 1 else ''} at {where} "
        f"{'are' if len(found) > 1 else 'is'} computed from a sum over the rows of the padded batch "
        f"{' and '.join(self._names[b] for b in sorted(batches))} that includes its padding rows (`"
        f"{eqn.primitive.name}` in {caller(eqn)}): on a partial batch the padding examples (the zero rows "
        "the dataset adds; TF hands a replica only its real rows, so TF code never masks) count as examples "
        "and are trained on. Scale the per-example loss with tpustrat.compute_average_loss(per_example_loss, "
        "global_batch_size=...), which leaves them out, or mask it: jnp.where(tpustrat.valid_mask(batch), "
        "per_example_loss, 0).")

  @staticmethod
  def _answer(r: Rows, x: Any, what: str, sizes: list[int], names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The padded batches whose rows `x` (asked about by `what`) holds on axis 0, row for row, from its
    traced rows: one batch, or several combined row by row (features and labels passed apart), whose
    rows are real where they are real in all of them."""
    if (not r.is_unknown and r.batches and r.axis == 0
        and all(sizes[b] == x.shape[0] for b in r.batches)):
      return tuple(sorted(r.batches))
    if r.carries_rows:
      how = (f"they pass through `{r.unknown_via}`, whose effect on axis 0 is not traced" if r.is_unknown
             else f"they are on its axis {r.axis}, or have another batch's size")
      warnings.warn(
          f"strategy.run: {what} ({x.dtype}{list(x.shape)}): axis 0 has the per-replica size of a padded batch, "
          f"but its rows cannot be traced to one batch: {how}. Its padding rows cannot be told from real ones, "
          "so none is left out: mask them yourself (tpustrat.valid_mask(batch)).", BatchRowsWarning, stacklevel=4)
    return None

  def check_block_statistics(self) -> None:
    """A ValueError, while the step is traced, if a block the step returns (a `LocalShard`: new sharded
    parameters or optimizer state) was computed from a statistic of one replica's block of a split input
    (`block_statistics`): e.g. `optax.clip_by_global_norm` on the blocks of `experimental_shard`'s
    parameters, which would clip each replica's block by its own norm."""
    if not any(a is not None for a in self._split) or not any(sh is not None for sh in self.shards):
      return
    states = mixed_results(self._jaxpr, self._split)
    bad = [(p, s) for p, s, sh in zip(self.paths, states, self.shards) if sh is not None and isinstance(s, Mixed)]
    if bad:
      where = ", ".join(p for p, _ in bad[:4]) + (f" (and {len(bad) - 4} more)" if len(bad) > 4 else "")
      raise ValueError(
          f"strategy.run: the sharded output{'s' if len(bad) > 1 else ''} at {where} "
          f"{'are' if len(bad) > 1 else 'is'} computed from a statistic of this replica's block alone "
          f"({bad[0][1].via}), not of the whole value: each replica would use its own, and the result would "
          "depend on how the value is split. A norm over sharded leaves is tpustrat.global_norm (and "
          "optax.clip_by_global_norm's replacement tpustrat.clip_by_global_norm), which sums the blocks' "
          "squares over the replicas; a statistic of one leaf (clip_by_block_rms, trust ratios, adafactor) "
          "needs the leaf whole: read it with read_value(), or keep it out of experimental_shard's partitioner; a "
          "finite check (optax.apply_if_finite) is tpustrat.mixed_precision.all_finite, agreed over the replicas.")

  def evaluate(self) -> list[Any]:
    """The step's output leaves, emitted into the current trace (blocks as `LocalShard`s again)."""
    out = eval_closed_jaxpr(self._jaxpr, self._consts, self._args)
    return [jnp.asarray(x) if sh is None else LocalShard(x, *sh) for x, sh in zip(out, self.shards)]


def _output_padding(out_leaves: list[Any], paths: list[str], is_varying: list[bool],
                    marked: dict[int, int | None], sizes: list[int], names: tuple[str, ...],
                    rows: list[Rows] | Callable[[], list[Rows]], guessed: set[int] | None = None) -> list[Any]:
  """For each output leaf: None (whole), ``(batch, True)`` (marked per-example: its padding skipped
  everywhere) or ``(batch, False)`` (axis 0 holds that batch's rows: skipped along ``axis=0``).
  `rows`: the `Rows` of every output, or a function that traces them when first needed. The positions of
  outputs whose batch is only assumed from their size (their rows were not traced) go into `guessed`."""
  traced: list[list[Rows]] = []  # the rows, once known

  def rows_of(i: int) -> Rows:
    if not traced:
      traced.append(rows() if callable(rows) else rows)
    return traced[0][i]

  def describe(r: Rows) -> str:
    if r.is_unknown:
      return f"they pass through `{r.unknown_via}`, whose effect on axis 0 is not traced"
    return "it combines, row by row, the rows of " + " and ".join(names[b] for b in sorted(r.batches))

  result: list[Any] = []
  for i, (x, v) in enumerate(zip(out_leaves, is_varying)):
    k = x.shape[0] if x.ndim else None
    if i in marked:
      b = marked[i]
      if b is None:
        r = rows_of(i)
        if r.is_unknown or len(r.batches) != 1 or r.axis != 0 or sizes[next(iter(r.batches))] != k:
          candidates = ", ".join(names[j] for j, size in enumerate(sizes) if size == k)
          why = describe(r) if r.carries_rows else "its axis 0 does not hold any batch's rows"
          raise ValueError(
              f"tpustrat.per_example: the output at {paths[i]} has leading size {k}, like several padded "
              f"batches of this step ({candidates}), and its rows cannot be traced to one of them ({why}). "
              "Say which with tpustrat.per_example(x, batch=the_batch).")
        b = next(iter(r.batches))
      result.append((b, True))
      continue
    if not v or k is None or k not in sizes:
      result.append(None)
      continue
    r = rows_of(i)
    matching = [j for j, size in enumerate(sizes) if size == k]
    if not r.is_unknown and r.batches and r.axis != 0:
      result.append(None)  # the rows are on another axis: axis 0 is something else, kept whole
    elif not r.is_unknown and len(r.batches) == 1 and sizes[next(iter(r.batches))] == k:
      result.append((next(iter(r.batches)), False))
    elif r.carries_rows:
      chosen = matching[0] if r.is_unknown and len(matching) == 1 else None
      effect = (f"skip the padding of {names[chosen]}" if chosen is not None
                else "keep every row, padding included")
      warnings.warn(
          f"strategy.run: the output at {paths[i]} ({x.dtype}{list(x.shape)}) has the per-replica size of "
          f"the padded batch {' / '.join(names[j] for j in matching)} on axis 0, but its rows cannot be "
          f"traced to one batch: {describe(r)}. strategy.reduce(..., axis=0) and gather(..., axis=0) "
          f"will {effect}. Mark it with tpustrat.per_example(x, batch=...) to say whose rows it holds.",
          BatchRowsWarning, stacklevel=2)
      result.append(None if chosen is None else (chosen, False))
      if chosen is not None and guessed is not None:
        guessed.add(i)
    else:
      result.append(None)  # its axis 0 is not a batch's rows, whatever its size
  return result


def _warn_unresolved(unresolved: list[str]) -> None:
  """A `BatchRowsWarning` for each array whose padded batch `ReplicaContext.padding_count` could not tell:
  one of a nested trace with the size of several padded batches."""
  for what in dict.fromkeys(unresolved):
    warnings.warn(
        f"strategy.run: {what}, computed inside a nested trace of the step (a jax.jit, jax.checkpoint, cond, "
        "scan or vmap), has the per-replica size of several padded batches, so which padding rows are its "
        "own cannot be told; none is left out: mask them yourself (tpustrat.valid_mask(batch)).",
        BatchRowsWarning, stacklevel=4)


_INNER_NOTES = threading.local()
_INNER_NOTES.stack = []


@contextlib.contextmanager
def inner_padding_notes() -> Iterator[list[dict[str, str | None]]]:
  """While a program that runs `run` inside it is traced (`experimental_run_steps`), collects the notes of
  the inner programs whose padding-read warning waits for a partial batch; the enclosing program says it
  at its first call with one (`warn_padding_reads_stacked`)."""
  if not hasattr(_INNER_NOTES, "stack"):
    _INNER_NOTES.stack = []
  found: list[dict[str, str | None]] = []
  _INNER_NOTES.stack.append(found)
  try:
    yield found
  finally:
    _INNER_NOTES.stack.pop()


def warn_padding_reads_stacked(notes: list[dict[str, str | None]], batches: Any) -> None:
  """`_warn_padding_reads` for stacked steps (``[steps, num_replicas, rows, ...]``): once per program, at
  the first call whose batches hold a partial one."""
  pending = [n for n in notes if n.get("padding_reads")]
  if not pending:
    return
  for node in jax.tree.leaves(batches, is_leaf=is_distributed):
    if isinstance(node, PerReplica) and node.padding_is_marked:
      leaves = jax.tree.leaves(node.tree)
      rows = leaves[0].shape[2] if leaves and leaves[0].ndim >= 3 else None
      if rows is not None and (np.asarray(node.host_real_rows()) < rows).any():
        for n in pending:
          message, n["padding_reads"] = n["padding_reads"] or "", None
          warnings.warn(message, PaddingReadWarning, stacklevel=4)
        return


def _warn_padding_reads(notes: dict[str, str | None], args: Any, kwargs: Any) -> None:
  """Says the program's padding-read warning (`_StepJaxpr.padding_reads_message`) once, at the first call
  whose padded batch is partial: a dataset whose batches are all full never pads, and is not warned."""
  for node in jax.tree.leaves((args, kwargs), is_leaf=is_distributed):
    if isinstance(node, PerReplica) and node.padding_is_marked:
      leaves = jax.tree.leaves(node.tree)
      k = leaves[0].shape[1] if leaves and leaves[0].ndim >= 2 else None
      if isinstance(node.real_rows_array, jax.core.Tracer):  # a run traced inside another program (run_steps):
        # its counts are not known on the host here: the enclosing program says it (`inner_padding_notes`)
        if _INNER_NOTES.stack:
          _INNER_NOTES.stack[-1].append(notes)
        return
      if k is not None and (node.host_real_rows() < k).any():
        message, notes["padding_reads"] = notes["padding_reads"] or "", None
        warnings.warn(message, PaddingReadWarning, stacklevel=4)
        return


def _check_padded(leaves: list[Any], path: str) -> None:
  """Every leaf of a padded batch is ``[num_replicas, padded_batch, ...]`` with one padded batch size."""
  sizes = {jnp.shape(x)[1] if jnp.ndim(x) >= 2 else None for x in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(
        f"strategy.run: the padded PerReplica batch at {path} must have the batch on the leading axis "
        f"of every component, with one size for all leaves; got component shapes "
        f"{[tuple(jnp.shape(x)[1:]) for x in leaves]}.")


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


def _leaf_paths(treedef: Any) -> list[str]:
  """Human-readable paths of the leaves of `treedef`, for error messages."""
  dummy = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
  return [jax.tree_util.keystr(p) or "<root>"
          for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


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
