"""`RunOptions(check_numerics=True)`: NaN / Inf checks of a step's floating outputs that name the replica.

In the program (at trace time, inside the `shard_map` body of `run`): `replica_flags` computes, per replica,
one `uint8` per floating output leaf (bit 1: a NaN, bit 2: an Inf), and `gather_flags` all-gathers them into
one invariant ``[num_replicas, L]`` array: every device, so every process, holds every replica's flags. A
`Mirrored` (invariant) output is the same on every replica, so each replica checks only its ``1/N`` slice of
it (the host ORs the slices); a per-replica output is checked whole by its replica, without the padding
rows of a padded batch whose rows the program shows it to hold in place (`batch_rows`, or a
`per_example` mark), and a `ShardedVariable`'s block without its padding rows past the logical size
(neither is data). An output that only has a padded batch's size, its rows moved in a way not traced, is
checked whole; a NaN / Inf only past the real rows sets `PAST_REAL`, and the error explains the padding.

On the host: the flags array is the step's wait token (`engine.InFlight`). Where the devices have memory
of their own (a GPU, a TPU), its copy to the host is started as the step is dispatched (`copy_ahead`), so
it is there when it is read; on the CPU it is host memory already. When the steps-in-flight bound waits on
step ``t`` (before dispatching step ``t + k``), or `experimental_run_wait` drains it, `Check` reads the
flags (a few bytes) and raises `NumericsError` naming the step, the output's path, NaN / Inf and the
replicas and processes: the error of step ``t`` comes at most ``k`` calls late (the calls ``t + 1`` to
``t + k - 1`` return their results). Every process reads the same flags, so every process raises the same
error at the same call, and none is left waiting in a collective.

Inside another trace the host sees no call to check. `experimental_run_steps` collects the flags of its
inner `run` (`collecting`) and returns them stacked per inner step. A `run` (or `experimental_run_steps`)
traced inside a user's own `jax.jit` / `lax.scan` hands its flags to the host in the program itself
(`TracedChecks.emit`): after the step, in the outer program, an ordered `jax.experimental.io_callback`,
run by one device of each process, passes the (invariant) flags to `TracedChecks.record`, which counts the
execution and keeps the flags if any is set, raising nothing. The error is raised on the host by the next
call that syncs with it (`TracedChecks.raise_recorded`): `strategy.experimental_run_wait()`, which first
waits for every dispatched program's callbacks (`jax.effects_barrier`), and, in a one-process job, the
next `run` / `experimental_run_steps` dispatch of that strategy (what has been recorded by then). The
outer program's results have been returned by then. Every process records the same flags, so every
process raises the same error in `experimental_run_wait`. The cost: one host callback per step, ordered
(an execution of the outer program waits for the callbacks of the one before).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpustrat._src.jax_compat import all_gather_invariant, to_varying, varying_axes
from tpustrat._src.step_hooks import Step, StepHook

__all__ = ["NumericsError", "StepChecks", "Outputs", "Check", "Checker", "TracedChecks", "replica_flags", "gather_flags",
           "collecting", "collect", "replica_processes", "TRACE_BYTES", "trace_of"]

NAN, INF = 1, 2
PAST_REAL = 4  # the NaN / Inf lies only in rows past the real rows of a batch whose rows were not traced
_SLICE_MIN = 4096  # a Mirrored output of at least this many elements is checked a 1/N slice per replica


class NumericsError(FloatingPointError):
  """A step run with `RunOptions(check_numerics=True)` produced NaN or Inf.

  Attributes:
    step: the step, counting from 1: the call of `strategy.run` with this function and argument
      structure, or, for `experimental_run_steps`, the step counted over every call of that program. For
      a `run` traced inside a user's own `jax.jit` / `lax.scan`: its execution, counted over every
      execution of that traced `run` (one per call of the outer program, or one per scan iteration).
    inner_step: for `experimental_run_steps`, the step within its call (from 1), else None.
    outputs: one ``(path, kind, replicas, nan, inf)`` per bad output: its path in the step's result
      (``[0]['w']``), ``"PerReplica"`` / ``"Mirrored"`` / ``"ShardedVariable"``, the replica ids that
      produced it (every replica for a `Mirrored` one), whether it holds NaN, whether it holds Inf.
    replicas: the replica ids of the bad per-replica outputs (sorted; empty when only `Mirrored` ones).
    processes: the process indices of those replicas' devices; every process when only `Mirrored`
      outputs are bad.
  """

  def __init__(self, message: str, *, step: int, inner_step: int | None,
               outputs: list[tuple[str, str, tuple[int, ...], bool, bool]], replicas: tuple[int, ...],
               processes: tuple[int, ...]) -> None:
    super().__init__(message)
    self.step, self.inner_step, self.outputs = step, inner_step, outputs
    self.replicas, self.processes = replicas, processes


@dataclasses.dataclass
class Outputs:
  """What one program's flags describe (recorded when it is traced): the checked output leaves' paths and
  kinds, in flag order, the process of each replica, and what to call the program in a message."""

  paths: list[str]
  kinds: list[str]
  processes: tuple[int, ...]
  what: str
  untraced: list[str | None] = dataclasses.field(default_factory=list)
  """Per checked leaf: the padded batch its size matches where its rows could not be traced to it (it is
  checked whole, padding included), else None."""
  copy_ahead: bool | None = None
  """Whether each dispatch starts copying the flags to the host (`copy_ahead`); None until the first one."""
  calls: int = 0  # concrete dispatches so far
  steps: int = 0  # steps run by them (more than `calls` for experimental_run_steps)
  traces: dict[int, tuple[list[str], list[str], list[str | None]]] = dataclasses.field(default_factory=dict)
  """Per trace of the program (its id, `trace_id` columns of the flags it returns): the paths, kinds and
  untraced notes its flags describe. `jax.jit` keeps one executable per argument signature, whose flags
  describe the outputs of the trace that made it, not necessarily the latest (`paths`, `kinds`, `untraced`)."""
  last_trace: int = 0  # the id of the latest trace (0: none yet)

  def traced(self, paths: list[str], kinds: list[str], untraced: list[str | None], trace: int | None = None) -> int:
    """Records what the flags of a trace describe (at trace time); returns the trace's id, new unless
    given (`experimental_run_steps` records under its inner `run`'s id, which its flags carry)."""
    with _TRACE_LOCK:
      trace = next(_TRACE_IDS) if trace is None else trace
      if len(self.traces) >= _TRACES_KEPT:
        self.traces.pop(next(iter(self.traces)))
      self.traces[trace] = (paths, kinds, untraced)
    self.paths, self.kinds, self.untraced, self.last_trace = paths, kinds, untraced, trace
    return trace

  def of_trace(self, trace: int) -> Outputs:
    """These outputs as trace `trace` described them (the latest trace's if it is no longer kept)."""
    found = self.traces.get(trace)
    if found is None or trace == self.last_trace:
      return self
    paths, kinds, untraced = found
    return dataclasses.replace(self, paths=paths, kinds=kinds, untraced=untraced, last_trace=trace)


# Every trace of a checked program gets an id, carried by its flags (`TRACE_BYTES` columns of digits 1..255,
# never 0, so that the flags of a step without NaN / Inf are zero but for them): the host reads which
# trace's outputs the flags describe (`Outputs.of_trace`).
TRACE_BYTES = 4
_TRACE_IDS = itertools.count(1)
_TRACE_LOCK = threading.Lock()
_TRACES_KEPT = 256  # traces remembered per program (a program retraced more often warns of retracing)


def trace_id_bytes(trace: int) -> np.ndarray:
  """`trace` as `TRACE_BYTES` base-255 digits, each plus 1 (so none is 0), least significant first."""
  digits = []
  for _ in range(TRACE_BYTES):
    trace, digit = divmod(trace, 255)
    digits.append(digit + 1)
  return np.asarray(digits, np.uint8)


def trace_of(flags: np.ndarray) -> int:
  """The trace id a step's flags (``[..., L + TRACE_BYTES]``) carry (`trace_id_bytes`, read back)."""
  digits = flags.reshape(-1, flags.shape[-1])[0, -TRACE_BYTES:]
  return sum((int(d) - 1) * 255 ** i for i, d in enumerate(digits))


def replica_processes(mesh: jax.sharding.Mesh, axis: str) -> tuple[int, ...]:
  """The process index of each replica (the first device of its slice of `mesh` along `axis`)."""
  devices = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis), 0)
  return tuple(int(d.process_index) for d in devices.reshape(devices.shape[0], -1)[:, 0])


def _leaf_code(x: jax.Array) -> jax.Array:
  """`NAN` | `INF` as `x` holds them: one code byte per element, OR-reduced in one pass (two `any`
  reductions, one per kind, took XLA:CPU 1.9x as long over a model's parameters)."""
  # Both bits where both hold: a complex element can be NaN in one part and Inf in the other.
  codes = (jnp.isnan(x).astype(jnp.uint8) * jnp.uint8(NAN)) | (jnp.isinf(x).astype(jnp.uint8) * jnp.uint8(INF))
  return lax.reduce(codes, jnp.uint8(0), lax.bitwise_or, tuple(range(x.ndim)))


def replica_flags(leaves: Sequence[Any], is_varying: Sequence[bool], row_counts: Sequence[Any | None],
                  axis: str, n: int, untraced: Sequence[Any | None] | None = None,
                  ) -> tuple[jax.Array | None, list[int]]:
  """This replica's flags (`uint8[L]`) for the floating leaves among `leaves` (one replica's outputs, in
  the `shard_map` body), and their positions. `row_counts[i]`: this replica's real rows of a padded batch
  whose rows leaf `i`'s axis 0 holds, traced through the program (rows past it are padding and not
  checked), else None. `untraced[i]`: the real rows of a padded batch whose size leaf `i`'s axis 0 has but
  whose rows could not be traced there: the leaf is checked whole, and `PAST_REAL` is set where it is bad
  only past those rows (perhaps padding, perhaps a real row the step moved there)."""
  codes, checked = [], []
  untraced = [None] * len(leaves) if untraced is None else untraced
  for i, (x, v, rows, maybe) in enumerate(zip(leaves, is_varying, row_counts, untraced)):
    if not jnp.issubdtype(x.dtype, jnp.inexact) or x.size == 0:
      continue
    if not v:
      part = x
      if x.size >= _SLICE_MIN and n > 1:  # the same on every replica: each checks its own slice
        # Rows where there are at least as many as replicas: a reshape to one dimension first cost XLA:CPU a
        # three-stage reduction (5.0 against 1.7 ms for a 784-1024-1024-10 MLP's parameters, whole).
        part = x if x.ndim and x.shape[0] >= n else x.reshape(-1)
        chunk = -(-part.shape[0] // n)
        part = lax.dynamic_slice_in_dim(part, lax.axis_index(axis) * chunk, chunk)  # clamped at the end
      code = _leaf_code(part)
    elif rows is not None and x.ndim:
      real = lax.broadcasted_iota(jnp.int32, (x.shape[0],) + (1,) * (x.ndim - 1), 0) < rows
      code = _leaf_code(jnp.where(real, x, jnp.zeros((), x.dtype)))
    elif maybe is not None and x.ndim:
      code = _leaf_code(x)
      real = lax.broadcasted_iota(jnp.int32, (x.shape[0],) + (1,) * (x.ndim - 1), 0) < maybe
      in_real = _leaf_code(jnp.where(real, x, jnp.zeros((), x.dtype)))
      code = code | jnp.where((code != 0) & (in_real == 0), jnp.uint8(PAST_REAL), jnp.uint8(0))
    else:
      code = _leaf_code(x)
    codes.append(code)
    checked.append(i)
  if not codes:
    return None, checked
  return jnp.stack(codes), checked


def _with_trace(flags: jax.Array | None, trace: int) -> jax.Array:
  """This replica's flags followed by the trace's id columns (`trace_id_bytes`): ``uint8[L + TRACE_BYTES]``
  (with nothing floating, the id alone: still an output the program computes, a token)."""
  tag = jnp.asarray(trace_id_bytes(trace))
  return tag if flags is None else jnp.concatenate([flags, tag])


def gather_flags(flags: jax.Array | None, axis: str, trace: int) -> jax.Array:
  """Every replica's flags and the trace's id (`_with_trace`), ``uint8[N, L + TRACE_BYTES]``, the same on every
  replica (an invariant all-gather)."""
  flags = _with_trace(flags, trace)
  if axis not in varying_axes(flags):
    flags = to_varying(flags, axis)
  return all_gather_invariant(flags[None], axis, axis=0, tiled=True)


def one_replica_flags(flags: jax.Array | None, axis: str, trace: int) -> jax.Array:
  """`gather_flags` of the one replica of a one-replica strategy: its own flags, ``uint8[1, L + TRACE_BYTES]``,
  left per replica (the program returns them split over the one device, which holds them whole)."""
  flags = _with_trace(flags, trace)
  if axis not in varying_axes(flags):
    flags = to_varying(flags, axis)
  return flags[None]


# -- inside another trace ---------------------------------------------------------------------------------

_LOCAL = threading.local()


@contextmanager
def collecting() -> Iterator[list[tuple[Any, Outputs]]]:
  """While tracing a program around `run` (`experimental_run_steps`' scan body): the flags of every checked
  `run` traced inside are appended to the yielded list as ``(flags tracer, Outputs)``."""
  stack = _LOCAL.__dict__.setdefault("stack", [])
  box: list[tuple[Any, Outputs]] = []
  stack.append(box)
  try:
    yield box
  finally:
    stack.pop()


def collect(flags: Any, outputs: Outputs, traced: TracedChecks | None = None, stacked: bool = False) -> None:
  """Hands a checked `run`'s flags, traced inside another program, to the innermost `collecting`; when
  there is none (a user's own `jax.jit` / `lax.scan`), to `traced` (the engine's `TracedChecks`), which
  adds their host callback to the program being traced (`stacked`: the flags are ``[k, N, L]``)."""
  stack = getattr(_LOCAL, "stack", None)
  if stack:
    stack[-1].append((flags, outputs))
    return
  if traced is None:
    raise ValueError(
        f"{outputs.what}: RunOptions(check_numerics=True) is not supported for a program traced inside "
        "another jax.jit / lax.scan without a strategy's engine.")
  traced.emit(flags, outputs, stacked)


@dataclasses.dataclass
class _Site:
  """One checked `run` (or `experimental_run_steps`) traced inside another program: what its flags
  describe (a copy of its `Outputs` at trace time), its number among this engine's such traces, and how
  many times it has executed (counted by its host callback)."""

  outputs: Outputs
  number: int
  stacked: bool
  executions: int = 0


class TracedChecks:
  """The checks of one engine's checked programs traced inside other programs (a user's `jax.jit` /
  `lax.scan`): `emit` adds a program's host callback at trace time, `record` is that callback (it only
  records), `raise_recorded` raises the first recorded error on the host."""

  def __init__(self, mesh: jax.sharding.Mesh) -> None:
    self._mesh = mesh
    self.one_process = jax.process_count() == 1  # a dispatch raises what was recorded (`StepChecks`)
    self._lock = threading.Lock()
    self._sites = 0  # programs traced with a callback so far (nothing to wait for while 0)
    self.recorded: list[tuple[_Site, int, np.ndarray]] = []  # (site, execution, flags) of bad executions
    flat = [int(d.process_index) for d in np.asarray(mesh.devices).flat]
    # The callback runs on one device per process: the first of each process's devices in the mesh.
    self._recorders = np.array([flat.index(p) == i for i, p in enumerate(flat)])

  @property
  def active(self) -> bool:
    """Whether a checked program was traced inside another one (whose callbacks may be pending)."""
    return self._sites > 0

  def emit(self, flags: Any, outputs: Outputs, stacked: bool = False) -> None:
    """While tracing the outer program, after the checked program's call (`flags`: its invariant flags,
    a tracer of the outer program): one ordered `io_callback`, in a `shard_map` over the whole mesh on
    the first device of each process, that hands the flags to `record`.

    Ordered: on JAX 0.10.2 XLA:CPU (8 devices, 2 cores) an unordered `io_callback` here, in or out of a
    `shard_map`, hung the 200-call loop below in a collective's rendezvous; `jax.debug.callback(...,
    ordered=True)` is refused for more than one device. Outside a `shard_map` the callback would run on
    one device of the whole program (one process only); here each process runs it on one of its devices.
    Cost, measured on the tiny step of `benchmarks/bench_run.py` (8 emulated CPU devices, a loaded 2-core
    machine, 3 rounds side by side): 200 calls of a `jax.jit` of `run` (2 in flight), 190-314 us per
    step off, 855-893 us on; a jitted `lax.scan` of 200 `run` steps, 100-132 us per iteration off,
    359-478 us on."""
    from jax.experimental import io_callback  # noqa: PLC0415 (jax.experimental, loaded only when used)

    with self._lock:
      self._sites += 1
      site = _Site(dataclasses.replace(outputs, paths=list(outputs.paths), kinds=list(outputs.kinds)),
                   self._sites, stacked)
    mesh = self._mesh
    names = tuple(mesh.axis_names)
    recorders = self._recorders
    record = functools.partial(self.record, site)

    def body(f: jax.Array) -> tuple[()]:
      if recorders.all():  # one device per process: every device records
        io_callback(record, None, f, ordered=True)
      else:
        here = jnp.asarray(recorders)[lax.axis_index(names)]
        lax.cond(here, lambda: io_callback(record, None, f, ordered=True), lambda: None)
      return ()

    spec = jax.sharding.PartitionSpec()
    jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=(), check_vma=False)(flags)

  def record(self, site: _Site, flags: Any) -> None:
    """The host callback of `site`'s program, once per execution: counts it, keeps the flags if any is
    set. It raises nothing (an exception in a callback would fail the outer program's execution, not
    reach the caller): `raise_recorded` raises."""
    flags = np.asarray(flags)
    with self._lock:
      site.executions += 1
      if flags[..., :-TRACE_BYTES].any():
        self.recorded.append((site, site.executions, flags.copy()))

  def raise_recorded(self, wait: bool = False) -> None:
    """Raises `NumericsError` for the first bad execution recorded (the others are dropped, and counted in
    its message). `wait`: first wait for every dispatched program's callbacks (`jax.effects_barrier`)."""
    if wait and self._sites:
      jax.effects_barrier()
    if not self.recorded:
      return
    with self._lock:
      recorded, self.recorded = self.recorded, []
    site, execution, flags = recorded[0]
    raise traced_error(site, execution, flags, len(recorded) - 1)


# -- on the host -------------------------------------------------------------------------------------------


GROUP = 8  # `run` dispatches whose flags one `Check` reads, once the newest of them has finished


class Check:
  """The check of dispatched programs' flags (``uint8[N, L]`` each, or ``[k, N, L]`` for `k` inner steps):
  called once the newest of them has finished (`engine.InFlight`), it raises `NumericsError` for the first
  one with a flag set.

  The bound merges up to `GROUP` consecutive checked dispatches of one `run` program into one check (no
  other check registered on that bound in between, so that errors still come in dispatch order): the check
  registered last stays open and takes the next dispatch of its program in (`InFlight.add_flags`: one list
  append, no check made per dispatch); it runs once its newest dispatch has finished, all of their flags
  read on the host then, one Python call per dispatch and no other. Its dispatches are steps ``first``,
  ``first + 1``, ...: one `run` program's consecutive dispatches. A run-steps dispatch's check is never
  merged. The report of a bad step ``t`` therefore comes with the wait for the last dispatch of its group:
  by call ``t + GROUP - 1 + max_steps_in_flight`` at the latest, or at `experimental_run_wait`."""

  __slots__ = ("flags", "_first", "outputs", "_call", "_later", "ran")

  def __init__(self, flags: jax.Array, outputs: Outputs, step: int, call: int | None = None) -> None:
    """`step`: the (first) step of this program, from 1; `call`: for stacked flags (``[k, N, L]``), the
    dispatch of the program it was (from 1)."""
    self.flags, self._first, self.outputs, self._call = [flags], step, outputs, call
    self._later = 0  # steps of this group after its bad one (once found)
    self.ran = False  # called (or dropped) already: it takes no more dispatches

  def absorb(self, other: Any) -> bool:
    """Takes `other`'s dispatch into this check (the bound's next checked dispatch), if both are one `run`
    program's checks, this one has not run and holds fewer than `GROUP`; whether it did."""
    if (self.ran or type(other) is not Check or other.outputs is not self.outputs or self._call is not None
        or other._call is not None or len(self.flags) >= GROUP):
      return False
    self.flags.append(other.flags[0])
    return True

  @property
  def size(self) -> int:
    """The dispatches it covers."""
    return len(self.flags)

  def __call__(self, dropped: int = 0) -> None:
    self.ran = True
    count = len(self.flags)
    for i, flags in enumerate(self.flags):
      if flags.is_deleted():
        continue
      # Replicated (the invariant all-gather's output; one replica's own, split over the one device, with
      # one replica), so `np.asarray` reads this process's first copy, in every process: already on the host
      # where `Checker` started its copy at dispatch (or, on the CPU, host memory already).
      # `addressable_data(0)` would make one more `jax.Array` per step (about 15 us on a 2-core CPU) and
      # numpy's `any` on a few bytes costs more than comparing them.
      try:
        local = np.asarray(flags)
      except Exception:  # pylint: disable=broad-except
        # Its program failed: the bound raised that error when it waited for it (its flags are its token,
        # waited for before this check, kept under a newer one); the other dispatches are still checked.
        continue
      raw = local.tobytes()
      if raw.count(0) != len(raw) - local.size // local.shape[-1] * TRACE_BYTES:  # the id bytes are never 0
        # Kept: the bad step alone, and how many of the group came after it (the bound calls the check
        # again, with the steps of the other checks dropped after it).
        self.flags = self.flags[i:i + 1]
        self._first += i
        self._later += count - 1 - i
        raise self._error(local, self._first, dropped + self._later)

  def _error(self, flags: np.ndarray, first: int, dropped: int) -> NumericsError:
    out = self.outputs
    inner = None
    k = flags.shape[0]
    if self._call is not None:  # [k, N, L]: the first inner step with a flag
      inner = _first_inner(flags)
      flags = flags[inner]
    step = first + (inner if inner is not None else 0)
    lines, bad, replicas, processes = _describe(flags, out)
    if inner is None:
      where = f"step {step} (call {step} of {out.what}, counting from 1)"
    else:
      where = (f"step {step} (inner step {inner + 1} of {k} of {out.what}'s call "
               f"{self._call}; steps counted from 1 over every call of this program)")
    after = (f" {dropped} step(s) dispatched after it ran on its results and are not checked."
             if dropped else "")
    return NumericsError(
        f"{out.what} with RunOptions(check_numerics=True): {where} produced non-finite values:\n"
        + "\n".join(lines) + "\nThe error is raised once that step has finished, by the call that waits for it "
        f"or, for strategy.run, for the last of the up to {GROUP} consecutive steps read with it (run / "
        f"experimental_run_steps past the steps-in-flight bound, or experimental_run_wait).{after}",
        step=step, inner_step=None if inner is None else inner + 1, outputs=bad, replicas=replicas,
        processes=processes)


def _first_inner(flags: np.ndarray) -> int:
  """The first inner step with a flag set, of stacked flags ``[k, N, L]``."""
  return int(np.flatnonzero(flags[..., :-TRACE_BYTES].reshape(flags.shape[0], -1).any(axis=1))[0])


def _describe(flags: np.ndarray, out: Outputs) -> tuple[
    list[str], list[tuple[str, str, tuple[int, ...], bool, bool]], tuple[int, ...], tuple[int, ...]]:
  """One step's flags (``[N, L + TRACE_BYTES]``) as message lines, `NumericsError.outputs`, `.replicas`,
  `.processes`, read as the trace whose id they carry described its outputs."""
  out = out.of_trace(trace_of(flags))
  flags = flags[:, :-TRACE_BYTES]
  n = flags.shape[0]
  bad: list[tuple[str, str, tuple[int, ...], bool, bool]] = []
  replicas: set[int] = set()
  processes: set[int] = set()
  lines = []
  for j, (path, kind) in enumerate(zip(out.paths, out.kinds)):
    column = flags[:, j]
    if not column.any():
      continue
    nan, inf = bool((column & NAN).any()), bool((column & INF).any())
    what = " and ".join(w for w, b in (("NaN", nan), ("Inf", inf)) if b)
    if kind == "Mirrored":
      who = tuple(range(n))
      lines.append(f"  {path}: {what} in a Mirrored value (the same on every replica)")
    else:
      who = tuple(int(r) for r in np.flatnonzero(column))
      replicas.update(who)
      processes.update(out.processes[r] for r in who)
      line = f"  {path}: {what} in a {kind} value, on {_replica_list(who, out.processes)}"
      if j < len(out.untraced) and out.untraced[j] is not None:
        past = tuple(int(r) for r in np.flatnonzero(column & PAST_REAL))
        note = (f"; on {_replica_list(past, out.processes)} only in rows past the real rows of "
                f"{out.untraced[j]}" if past else "")
        line += (f" (its rows could not be traced to {out.untraced[j]}, whose size it has, so every row was "
                 f"checked, padding included{note}: rows there are padding if the step kept rows in place, "
                 "a real example's if it moved them; mark the output with tpustrat.per_example(x, batch=...) "
                 "if its rows are the batch's)")
      lines.append(line)
    bad.append((path, kind, who, nan, inf))
  if not replicas:  # only Mirrored outputs: every process holds them
    processes.update(out.processes)
  return lines, bad, tuple(sorted(replicas)), tuple(sorted(processes))


def _ordinal(n: int) -> str:
  suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
  return f"{n}{suffix}"


def traced_error(site: _Site, execution: int, flags: np.ndarray, dropped: int) -> NumericsError:
  """The `NumericsError` of `site`'s `execution` (from 1), whose flags are `flags`; `dropped` more bad
  executions were recorded after it."""
  out = site.outputs
  inner = None
  k = 1
  if site.stacked:  # [k, N, L]: the first inner step with a flag
    k = flags.shape[0]
    inner = _first_inner(flags)
    flags = flags[inner]
  lines, bad, replicas, processes = _describe(flags, out)
  step = (execution - 1) * k + (inner if inner is not None else 0) + 1
  where = (f"its {_ordinal(execution)} execution" if inner is None else
           f"inner step {inner + 1} of {k} of its {_ordinal(execution)} execution (step {step} counted over "
           "every execution)")
  after = (f" {dropped} later bad execution(s) of traced programs of this strategy were recorded too and "
           "are not reported." if dropped else "")
  return NumericsError(
      f"{out.what} with RunOptions(check_numerics=True), traced inside another program (the caller's "
      f"jax.jit / lax.scan; the {_ordinal(site.number)} checked program traced so on this strategy): {where} "
      "produced non-finite values (executions counted from 1 over every execution of that traced program: "
      "one per call of the outer jax.jit, one per iteration of a lax.scan around it):\n" + "\n".join(lines)
      + "\nThe outer program's results were already returned: the error is raised on the host after the "
      "execution, by strategy.experimental_run_wait() (or, in a one-process job, by the next run / "
      f"experimental_run_steps of this strategy).{after}",
      step=step, inner_step=None if inner is None else inner + 1, outputs=bad, replicas=replicas,
      processes=processes)


def _replica_list(replicas: Sequence[int], processes: Sequence[int]) -> str:
  """``replica 3 (process 0)``, ``replicas 4, 5 (process 1), 7 (process 1)``."""
  parts = [f"{r} (process {processes[r]})" for r in replicas]
  return ("replica " if len(parts) == 1 else "replicas ") + ", ".join(parts)


def check_option(value: Any) -> bool:
  """`RunOptions.check_numerics`: a bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"RunOptions: check_numerics must be a bool (True or False), got {value!r:.100}.")
  return bool(value)


def copy_ahead(flags: jax.Array) -> bool:
  """Whether to start copying a dispatched program's flags to the host at once (`copy_to_host_async`): on
  a device with memory of its own (a GPU, a TPU), so that the bound, when it waits for that program
  `max_steps_in_flight` dispatches later, finds them on the host and the read adds no device round trip.
  Not on the CPU, whose buffers are host memory already: there the copy is only cost (measured on a 2-core
  machine, JAX 0.10.2: +20-40 us a step for a copy started before the program had finished, against
  +5-10 us for reading the ready flags with `np.asarray`)."""
  return any(d.platform != "cpu" for d in flags.sharding.device_set)


def make_check(outputs: Outputs, steps: int = 1, stacked: bool = False,
               traced: TracedChecks | None = None) -> Checker:
  """For `engine.dispatch`: the `Checker` of a program's dispatches (it runs `steps` steps; `stacked`: its
  flags are ``[steps, N, L]``; `traced`: the engine's `TracedChecks`)."""
  return Checker(outputs, steps, stacked, traced)


class Checker:
  """Makes the check of a dispatched program's flags (its token): called with them, the `Check` to run
  once the program has finished, or, for a tracer (traced inside another program), None after handing the
  flags to `collect` (and so to `traced`, the engine's `TracedChecks`, inside a user's own `jax.jit` /
  `lax.scan`). The bound's `InFlight.add_flags` does the same for a dispatched program without making a
  check when the open one takes the dispatch in (`started` and `copy` are what it reads)."""

  __slots__ = ("outputs", "steps", "stacked", "traced", "copy")

  def __init__(self, outputs: Outputs, steps: int, stacked: bool, traced: TracedChecks | None) -> None:
    self.outputs, self.steps, self.stacked, self.traced = outputs, steps, stacked, traced
    self.copy: bool | None = None  # whether to start the flags' copy to the host (`copy_ahead`), once known

  def started(self, flags: jax.Array) -> int:
    """Counts a dispatch of the program, whose flags are `flags`, and starts their copy to the host where
    that helps (`copy_ahead`, decided at the first dispatch); returns its first step (from 1)."""
    copy = self.copy
    if copy is None:  # the first dispatch: where the flags live decides
      copy = self.copy = self.outputs.copy_ahead = copy_ahead(flags)
    if copy:
      flags.copy_to_host_async()  # on the host by the time the bound reads it (`Check`)
    outputs = self.outputs
    first = outputs.steps + 1
    outputs.calls += 1
    outputs.steps += self.steps
    return first

  def __call__(self, flags: Any) -> Check | None:
    if isinstance(flags, jax.core.Tracer):
      collect(flags, self.outputs, self.traced, self.stacked)
      return None
    first = self.started(flags)
    return Check(flags, self.outputs, first, self.outputs.calls if self.stacked else None)


class StepChecks(StepHook):
  """The per-step hook of `RunOptions(check_numerics=True)` (`step_hooks`; registered by the engine,
  `engine.in_flight.STEP_HOOKS`, first of its hooks).

  Before a step is dispatched (not a reduction, not while tracing), in a one-process job, it raises the
  first error recorded by the engine's checked programs traced inside a user's jit / scan
  (``step.traced``, a `TracedChecks`). Once a checked program is dispatched, it makes the check of its
  flags (``step.numerics``, from `make_check`) and hands it to the bound (``step.in_flight``), which runs
  it when it waits for that program; for a program only traced, `make_check` hands the flags on instead."""

  __slots__ = ()

  def before(self, step: Step) -> Any:
    traced = step.traced
    if traced is not None and step.steps and traced.recorded and traced.one_process and not any(
        isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(step.args)):
      traced.raise_recorded()
    return None

  def after(self, step: Step, state: Any, token: Any, now: float | None) -> None:
    checker = step.numerics
    if checker is not None:
      if isinstance(token, jax.core.Tracer):
        checker(token)  # hands the flags on (`collect`)
      else:
        step.in_flight.add_flags(token, checker)
