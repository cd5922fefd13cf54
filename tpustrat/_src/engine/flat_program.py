"""`FlatProgram`: a `run` program compiled over flat argument leaves, so that `jax.jit`'s C++ fast path
sees plain arrays in and out.

The structured program (`program.make_program`: pytrees of `PerReplica` / `Mirrored` in and out) is
wrapped in a `jax.jit` that takes the flattened argument leaves and returns the flattened result, plus the
output to wait on (`in_flight.wait_leaf`; a one-byte token when nothing small is computed, and always for a
program that donates). The result's structure is recorded when the program is traced and rebuilt after
each call: the host work per step is one flatten, one dict lookup, one sharding check per leaf and one
unflatten. `donating` gives the same program with some argument leaves donated (compiled once per set).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from tpustrat._src import numerics as numerics_lib
from tpustrat._src.engine.in_flight import wait_leaf
from tpustrat._src.sharded_variable import ShardedVariable
from tpustrat._src.values import PerReplica, is_distributed

__all__ = ["FlatProgram"]

# This thread's latest trace of a `FlatProgram`: (the program, weakly; its trace number; what it recorded).
# JAX traces a program inside the call that needs it, in the calling thread: a call finds here whether it
# traced, and what, whatever other threads traced meanwhile.
_TRACE = threading.local()


class FlatProgram:
  """A `run` program over flat argument leaves that returns flat result leaves plus the one to wait on.

  The result's structure (with its `Mirrored` / `PerReplica` nodes) is recorded when the program is
  traced and rebuilt after each call. If one argument structure ever traces to two result structures
  (a result structure that depends on shapes), the program falls back to returning the pytree, which
  `jax.jit` tracks per signature.
  """

  def __init__(self, structured: Callable[..., Any], seen_tree: Any, donate: tuple[int, ...] = (),
               checked: numerics_lib.Outputs | None = None,
               on_trace: Callable[[Any, list[Any]], None] | None = None,
               traced_numerics: numerics_lib.TracedChecks | None = None,
               names: tuple[Any, Any] | None = None) -> None:
    """`checked` (`RunOptions.check_numerics`): `structured` returns ``(result, flags)``; the flags are the
    output to wait on, and `numerics_check` makes the check of a call's flags (`traced_numerics`: the
    engine's, for a call traced inside a user's jit / scan). `on_trace(seen_tree,
    leaves)` is called each time JAX traces the program (a new program is compiled), with the traced
    argument leaves.

    `names`: on a mesh of one device, the (replicated, split over the replicas) shardings the outputs are
    named with. There every layout is that device, and XLA names an output after an input of its rank or
    after no axis at all: a per-replica result named ``P()`` matched no target when fed back to the next
    call, which then took the checked path and placed it again (a per-replica state on one device: 100 us
    a call instead of 25). The program then returns its replicated and its per-replica leaves as two lists,
    compiled with those two shardings (`jax.jit`'s output shardings as a prefix: nothing is traced or
    compiled twice), and each call puts them back in order (one `operator.itemgetter`)."""
    self._on_trace = on_trace
    # What the first trace recorded: (result treedef, index of the leaf to wait on, the result's leaf count
    # when the program adds a token of its own past them, else None, and with `names` each output's
    # position in the (replicated + per-replica) lists); the traces counted in `traces`. A
    # trace that records another structure sends every later call to `_tree`, decided when it is traced
    # (even if that call then fails: JAX keeps the trace, and the next call of its signature does not trace).
    self._kept: tuple[Any, int, int | None, tuple[int, ...] | None] | None = None
    self.traces = 0
    self._lock = threading.Lock()
    # For `in_flight.dispatch_flat` (`Engine.run`'s fast path, which calls the compiled program itself):
    # ``(the jax.jit over flat leaves, result treedef, index of the leaf to wait on, leaf count or None,
    # None, or for named outputs True (in order once concatenated) or the itemgetter that puts them in order)``
    # once a trace has recorded the result's structure; None again if a second structure made it fall back.
    self.flat: tuple[Callable[..., Any], Any, int, int | None, Any] | None = None
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

    def flat_program(*leaves: Any) -> Any:
      out, out_tree, wait = flat(*leaves)
      count = out_tree.num_leaves if len(out) > out_tree.num_leaves else None
      if names is None:
        self._note_trace((out_tree, wait, count, None))
        return out
      split = _split_leaves(out_tree, len(out), checked is not None)
      order = [i for i, s in enumerate(split) if not s] + [i for i, s in enumerate(split) if s]
      position = [0] * len(out)
      for at, i in enumerate(order):
        position[i] = at
      self._note_trace((out_tree, wait, count, tuple(position)))
      return [out[i] for i in order if not split[i]], [out[i] for i in order if split[i]]

    def tree_program(*leaves: Any) -> tuple[Any, Any]:
      out, out_tree, wait = flat(*leaves)
      return out_tree.unflatten(out[:out_tree.num_leaves]), out[wait]

    self.__name__ = getattr(structured, "__name__", "run_fn")
    flat_program.__name__ = tree_program.__name__ = self.__name__
    self._names = names
    if names is None:
      self._flat = jax.jit(flat_program, donate_argnums=donate)
    else:
      self._flat = jax.jit(flat_program, donate_argnums=donate, out_shardings=names)
    self._tree = jax.jit(tree_program, donate_argnums=donate)
    self._donating: dict[tuple[int, ...], FlatProgram] = {}

  def donating(self, leaves: tuple[int, ...]) -> FlatProgram:
    """This program with the argument leaves at positions `leaves` donated (compiled once per set)."""
    if not leaves:
      return self
    variant = self._donating.get(leaves)
    if variant is None:
      variant = self._donating[leaves] = FlatProgram(self._structured, self._seen_tree, leaves, self._checked,
                                                      self._on_trace, self._traced_numerics, self._names)
    return variant

  def __call__(self, leaves: list[Any]) -> tuple[Any, Any]:
    """Runs the program; returns (result pytree, the output to wait on)."""
    if self._fallback is not None:
      return self._fallback(*leaves)
    kept, traces = self._kept, self.traces
    out = self._flat(*leaves)
    if self.traces != traces or kept is None:  # traced meanwhile: by this call, or by another thread
      kept = self.structure_after(traces, kept)
    out_tree, wait, count, position = kept
    if position is not None:  # named outputs: (replicated, per-replica), back in order
      out = _in_order(out, position)
    return out_tree.unflatten(out if count is None else out[:count]), out[wait]

  # `_in_order`, for `in_flight.dispatch_flat` (which this module imports, so it cannot import this one)
  in_order = staticmethod(lambda parts, position: _in_order(parts, position))

  def _note_trace(self, traced: tuple[Any, int, int | None, tuple[int, ...] | None]) -> None:
    """At trace time: counts the trace, records it for the calling thread (`structure_after`), keeps its
    structure if it is the first, and falls back to `_tree` for good if it differs from the one kept."""
    with self._lock:
      self.traces += 1
      _TRACE.last = (weakref.ref(self), self.traces, traced)
      if self._kept is None:
        self._kept = traced
        out_tree, wait, count, position = traced
        self.flat = (self._flat, out_tree, wait, count, None if position is None else _reorder(position))
      elif traced != self._kept:
        self._fallback = self._tree  # two result structures: let jax.jit keep them apart from now on
        self.flat = None

  def structure_after(self, traces: int, kept: Any) -> tuple[Any, int, int | None, tuple[int, ...] | None]:
    """The result structure of a call made when `traces` traces had been counted and `kept` was kept, after
    which the count moved: what this thread's trace recorded if the call traced, else `kept` (another
    thread traced meanwhile), or the structure kept now if none was then."""
    last = getattr(_TRACE, "last", None)
    if last is not None and last[0]() is self and last[1] > traces:
      return last[2]
    if kept is None:
      kept = self._kept
      assert kept is not None  # a program's first call traces it (here, or in another thread)
    return kept


def _split_leaves(out_tree: Any, count: int, checked: bool) -> list[bool]:
  """Of a program's `count` flat outputs (the result's leaves, then the flags of a checked program or a
  token of its own), which are split over the replicas: a `PerReplica`'s (its real-row counts too) or a
  `ShardedVariable`'s leaves, and a one-replica program's flags (its own, per replica); the rest (`Mirrored`
  leaves, the token) are replicated."""
  split = [False] * count
  dummy = out_tree.unflatten(list(range(out_tree.num_leaves)))
  for node in jax.tree.leaves(dummy, is_leaf=lambda v: is_distributed(v) or isinstance(v, ShardedVariable)):
    if isinstance(node, (PerReplica, ShardedVariable)):
      for i in jax.tree.leaves(node):
        split[i] = True
  if checked:
    split[count - 1] = True  # `numerics.one_replica_flags`: `[1, L]`, the one replica's
  return split


def _reorder(position: tuple[int, ...]) -> Any:
  """What puts a named program's outputs, (replicated + per-replica) concatenated, in the program's output
  order: True where they are in it already (its replicated outputs first: no reordering), else an
  `operator.itemgetter` (C, one call)."""
  if position == tuple(range(len(position))):
    return True
  return operator.itemgetter(*position)


def _in_order(parts: Any, position: tuple[int, ...]) -> Any:
  """A named program's outputs (replicated, per-replica) as one sequence in the program's output order."""
  reorder = _reorder(position)
  merged = parts[0] + parts[1]
  return merged if reorder is True else reorder(merged)
