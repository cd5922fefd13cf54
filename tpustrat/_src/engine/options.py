"""`RunOptions`: the options of `strategy.run` and `experimental_run_steps` (TF's `tf.distribute.RunOptions`,
plus tpustrat's own), checked when they are made.

`donate_argnums_of` reads the donated argument positions the way every caller needs them (a sorted tuple,
empty without options). What donation does is in `donation`; the bound on steps in flight in `in_flight`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpustrat._src import numerics as numerics_lib
from tpustrat._src.logical import LayoutMap
from tpustrat._src.validation import check_int

__all__ = ["RunOptions", "donate_argnums_of"]


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
      the replicas and processes that produced it). The error is raised once the step has finished, by a
      later call: the flags of 8 consecutive steps of one `run` program are read together, by the call
      that the steps-in-flight bound makes wait for the last of them (at most ``7 + max_steps_in_flight``
      calls after the bad step), or by `strategy.experimental_run_wait()`; every process raises the same
      error at the same call (docs/guides/numerics.md, "How late the report comes"). For
      `experimental_run_steps`, each inner step is checked and named. A `run` traced inside a user's own
      `jax.jit` / `lax.scan` hands its flags to the host by one ordered host callback per execution (one per scan iteration), which only records them: the error, naming the execution,
      is raised by `strategy.experimental_run_wait()` (which waits for those callbacks; in every
      process) or, in a one-process job, by the next `run` / `experimental_run_steps` of the strategy,
      after the outer program's results were returned. Off (the default), the program is the one
      compiled without the option.
    scan_unroll: `experimental_run_steps` only (`run` ignores it): the steps written out in each iteration
      of its `lax.scan` (JAX's ``unroll``): 1 (the default) compiles a loop of ``steps`` iterations; an int
      ``u`` >= 1, a loop of ``ceil(steps / u)`` iterations of ``u`` steps; True, the steps one after another
      with no loop. The numbers are the same. On XLA:CPU the loop's convolutions are laid out for XLA's
      fast kernel before the loop is compiled (XLA does it outside loops only), so a convolutional step
      needs no unrolling there; unrolling made a transformer step slower (`benchmarks/bench_multistep.py`,
      "Many steps per program" guide), and compiling takes longer with every step written out. Not
      measured on GPU or TPU. Must be an int >= 1 or a bool (False is 1).

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
    self._keep_key()

  def _keep_key(self) -> None:
    """What equality and the hash compare, made once: `run`'s fast path hashes the options at every call (the
    dataclass's own hash of every field costs microseconds there). `scan_unroll=True` (no loop) is told
    apart from `scan_unroll=1` (a rolled loop), which Python's ``True == 1`` would make equal. Not pickled
    (`__reduce__` makes the options again; `__setstate__` keeps a pickle of a library before it loading)."""
    key = (*(getattr(self, f.name) for f in dataclasses.fields(self)), type(self.scan_unroll) is bool)
    object.__setattr__(self, "_key", key)
    try:
      object.__setattr__(self, "_hash", hash(key))
    except TypeError:  # an unhashable field: `__hash__` raises the TypeError
      object.__setattr__(self, "_hash", None)

  def __eq__(self, other: object) -> bool:
    if type(other) is not type(self):
      return NotImplemented
    return self._key == other._key  # type: ignore[attr-defined]

  def __hash__(self) -> int:
    h = self._hash  # type: ignore[attr-defined]
    return hash(self._key) if h is None else h  # type: ignore[attr-defined]

  def __reduce__(self) -> tuple[Any, ...]:
    # Made again from the fields when loaded, so the kept key and hash are this process's own.
    return type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self))

  def __setstate__(self, state: dict[str, Any]) -> None:
    # A pickle of the plain dataclass (its fields as a dict): the fields, then the key and hash.
    for name, value in state.items():
      if not name.startswith("_"):
        object.__setattr__(self, name, value)
    self._keep_key()


def donate_argnums_of(options: RunOptions | None) -> tuple[int, ...]:
  """`options.donate_argnums` as `RunOptions.__post_init__` leaves it (a sorted tuple; an int given is
  made a one-element tuple), or () without options."""
  if options is None:
    return ()
  donate = options.donate_argnums
  assert isinstance(donate, tuple)  # __post_init__ always stores a tuple
  return donate
