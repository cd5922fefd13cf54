"""Machinery the benchmark scripts share: command line, timing rounds, paired statistics, tables.

`benchmarks/` is not a package. Every script puts its own directory first on ``sys.path`` and imports this
module as ``_harness``::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
    import _harness as h  # noqa: E402

(``python benchmarks/NAME.py`` already has the script's directory on ``sys.path``; the insert makes the
import work however the script is loaded, e.g. when `bench_multistep.py` imports `bench_run.py`.)

What a script does with it, in order:

1. ``ARGS = h.parse_args(__doc__, add_flags) if __name__ == "__main__" else None``, then
   ``h.emulate_cpu_devices(ARGS.cpu_devices)`` before anything initialises JAX's backends (importing
   ``tpustrat`` comes after). Scripts with several benchmarks loop over `selected_benchmarks`.
2. ``print(h.machine_line(n))``: which JAX, devices, host and Python produced the figures.
3. Time its variants in rounds, every variant once per round in an order that changes from round to round
   (`permutation_schedule` or `rotation_schedule`, `time_rounds`), with `time_chain` or `seconds_per_call`
   as the measurement, optionally inside `no_compilation()`.
4. Compare each variant with a baseline timed in the same rounds: `paired_ratios`, `spread`,
   `format_spread`, and print a markdown table (`markdown_header`, `markdown_row`, `verdict`).
5. Record each headline figure with `figure` (its value, its target and whether it is met): when the script
   ends they are printed as ``# FIGURE | name | value | target | verdict`` lines, which
   `benchmarks/run_all.py` (``make bench``) collects into one table.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import importlib.util
import itertools
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import jax


class Named(Protocol):
  """What `time_rounds` times: anything with a unique ``name``."""

  name: str


T = TypeVar("T")
V = TypeVar("V", bound=Named)

# -- command line -------------------------------------------------------------------------------------


def parse_args(doc: str, add_flags: Callable[[argparse.ArgumentParser], None],
               argv: list[str] | None = None) -> argparse.Namespace:
  """A benchmark's command line: the flags `add_flags` adds, then ``--cpu-devices`` (every script has it).

  The description is the first line of `doc` (the script's docstring).

  Every benchmark computes float32 matrix products at full float32 precision
  (``jax_default_matmul_precision="highest"``): each script first checks that its variants compute the same
  results at float32 tolerances, and on GPUs JAX's default lets XLA use TF32 (10-bit mantissas), with which
  two programs of the same step (one step per program against ten, say) differ by ~1e-3 relative. On CPUs
  this changes nothing; the variants compared in a timing always share it.
  """
  parser = argparse.ArgumentParser(description=doc.split("\n", 1)[0])
  add_flags(parser)
  parser.add_argument("--cpu-devices", type=int, default=8,
                      help="number of emulated CPU devices (0: leave JAX's device configuration alone)")
  args = parser.parse_args(argv)
  jax.config.update("jax_default_matmul_precision", "highest")
  return args


def selected_benchmarks(args: argparse.Namespace,
                        defaults: dict[str, tuple[int, int]]) -> Iterator[tuple[str, int, int]]:
  """(name, steps, trials) of each benchmark to run, for scripts with several (``tiny``, ``mlp``, ...).

  `defaults` maps every benchmark, in running order, to its default (steps, trials); ``args.only`` picks
  one (or, a list, several: in running order), and ``args.steps`` / ``args.trials``, where given, replace
  the defaults.
  """
  only = [args.only] if isinstance(args.only, str) else list(args.only or ())
  for name in [n for n in defaults if n in only] if only else list(defaults):
    steps, trials = defaults[name]
    yield name, args.steps or steps, args.trials or trials


def emulate_cpu_devices(count: int) -> None:
  """Makes the CPU backend emulate `count` devices (0: leaves JAX's configuration alone).

  Must run before JAX initialises its backends (before the first device is asked for).
  """
  if count:
    jax.config.update("jax_num_cpu_devices", count)


def machine_line(num_replicas: int) -> str:
  """The first line of every report: JAX version, replicas and device, host cores, Python version."""
  dev = jax.devices()[0]
  return (f"# jax {jax.__version__}, {num_replicas} replicas on {dev.platform} ({dev.device_kind}), "
          f"{os.cpu_count()} host cores, python {sys.version.split()[0]}")


# -- measuring one trial ------------------------------------------------------------------------------


def time_chain(init: Callable[[], Any], step: Callable[[Any], Any], count: int,
               finish: Callable[[], None]) -> tuple[float, Any]:
  """Runs ``state = step(state)`` `count` times from ``init()``; returns (seconds, the last state).

  The clock starts once the initial state is ready and stops once the last state is ready and
  ``finish()`` (e.g. `Strategy.experimental_run_wait`) has returned.
  """
  state = init()
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  for _ in range(count):
    state = step(state)
  jax.block_until_ready(state)
  finish()
  return time.perf_counter() - t0, state


def seconds_per_call(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
  """Mean seconds per ``fn(*args)`` over `calls` calls, each waited for before the next."""
  t0 = time.perf_counter()
  for _ in range(calls):
    jax.block_until_ready(fn(*args))
  return (time.perf_counter() - t0) / calls


def bounded(program: Callable[..., Any], depth: int) -> tuple[Callable[..., Any], Callable[[], None]]:
  """`program` with at most `depth` calls in flight, the bound `Strategy.run` applies to its steps.

  Before each call the returned ``call(*args)`` waits for output 1 of the call `depth` calls back
  (unbounded dispatch of collective programs can deadlock XLA:CPU with emulated devices). Also returns
  ``forget()``, which drops the outputs it still holds (call it once the last output is ready).
  """
  pending: collections.deque = collections.deque()

  def call(*args: Any) -> Any:
    while len(pending) >= depth:
      pending.popleft().block_until_ready()
    out = program(*args)
    pending.append(out[1])
    return out

  return call, pending.clear


# -- rounds of trials ---------------------------------------------------------------------------------


def permutation_schedule(items: Sequence[T]) -> Callable[[int], Sequence[T]]:
  """Round t's order: the permutations of `items` in turn (AB, BA, AB, ...; all six orders of three).

  Every item runs equally often in every position, so drift in machine load hits them alike. There are
  ``len(items)!`` orders: for a handful of items.
  """
  orders = list(itertools.permutations(items))
  return lambda t: orders[t % len(orders)]


def rotation_schedule(items: Sequence[T]) -> Callable[[int], Sequence[T]]:
  """Round t's order: `items` rotated left by t, reversed in odd rounds (ABC, ACB, CAB, CBA, BCA, ...).

  For more items than `permutation_schedule` can cycle through in a run.
  """
  rotations = [list(items[i:]) + list(items[:i]) for i in range(len(items))]
  return lambda t: rotations[t % len(rotations)] if t % 2 == 0 else rotations[t % len(rotations)][::-1]


def time_rounds(items: Sequence[V], trials: int, order: Callable[[int], Sequence[V]],
                measure: Callable[[V], float]) -> dict[str, list[float]]:
  """`trials` rounds; round t measures every item once, in the order ``order(t)``.

  Returns ``measure(item)`` of every round by ``item.name``, in round order: entry t of two items comes
  from the same round, so their ratio is a paired comparison.
  """
  times: dict[str, list[float]] = {v.name: [] for v in items}
  for t in range(trials):
    for v in order(t):
      times[v.name].append(measure(v))
  return times


_COMPILES = [0]  # backend compilations seen so far, once `_count_compiles` is listening
_LISTENING = [False]


def _count_compiles(event: str, duration: float, **kwargs: Any) -> None:
  del duration, kwargs
  if event.endswith("backend_compile_duration"):  # "/jax/core/compile/backend_compile_duration"
    _COMPILES[0] += 1


@contextlib.contextmanager
def no_compilation() -> Iterator[None]:
  """Asserts that XLA compiles nothing inside the block (the timed trials: a compile there is timed)."""
  if not _LISTENING[0]:
    jax.monitoring.register_event_duration_secs_listener(_count_compiles)
    _LISTENING[0] = True
  before = _COMPILES[0]
  yield
  assert _COMPILES[0] == before, f"{_COMPILES[0] - before} compilations inside the timed trials"


# -- paired statistics --------------------------------------------------------------------------------


def quantile(xs: Sequence[float], q: float) -> float:
  """The `q` quantile of `xs`, interpolating linearly between order statistics (numpy's default)."""
  s = sorted(xs)
  pos = q * (len(s) - 1)
  lo = int(pos)
  hi = min(lo + 1, len(s) - 1)
  return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
  """``a[t] / b[t]`` for every round t (two `time_rounds` series)."""
  return [x / y for x, y in zip(a, b)]


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
  """(median, p25, p75) of `xs`."""
  return statistics.median(xs), quantile(xs, 0.25), quantile(xs, 0.75)


def format_spread(s: tuple[float, float, float], digits: int, unit: str = "") -> str:
  """A `spread` as ``median[unit] [p25, p75]``, e.g. ``1.044 [1.018, 1.071]`` or ``2.47x [2.38, 2.59]``."""
  median, p25, p75 = s
  return f"{median:.{digits}f}{unit} [{p25:.{digits}f}, {p75:.{digits}f}]"


# -- reports ------------------------------------------------------------------------------------------


def markdown_header(columns: Sequence[str], right: Collection[str] = ()) -> str:
  """The first two lines of a markdown table; the columns named in `right` are right-aligned."""
  return markdown_row(columns) + "\n|" + "|".join("---:" if c in right else "---" for c in columns) + "|"


def markdown_row(cells: Sequence[Any]) -> str:
  """One markdown table row of already formatted cells."""
  return "| " + " | ".join(str(c) for c in cells) + " |"


def verdict(target: str, met: bool) -> str:
  """The target column: e.g. ``<= 1.05: met`` or ``>= 0.9: MISSED``."""
  return f"{target}: {'met' if met else 'MISSED'}"


# -- figures for run_all.py -----------------------------------------------------------------------------

FIGURE_PREFIX = "# FIGURE | "
_FIGURES: list[str] = []


def _print_figures() -> None:
  if _FIGURES:
    print()
    print("\n".join(_FIGURES), flush=True)


def figure(name: str, value: str, target: str = "", met: bool | None = None) -> None:
  """Records a headline figure: `name` (what it is), `value` (formatted, with its unit), `target` (e.g.
  ``<= 1.05``; empty for none) and whether the target is `met` (None: no target). They are printed when the
  script ends, after its own report, one ``# FIGURE | name | value | target | met/MISSED/-`` line each, for
  `benchmarks/run_all.py`."""
  if not _FIGURES:
    atexit.register(_print_figures)
  cells = [name, value, target, "-" if met is None else ("met" if met else "MISSED")]
  _FIGURES.append(FIGURE_PREFIX + " | ".join(str(c).replace("|", "/") for c in cells))


def load_example(name: str) -> Any:
  """``examples/NAME.py`` as a module (the examples are scripts, not a package), registered in
  `sys.modules` as ``NAME_example`` so that pickling and dataclasses inside it work."""
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"{name}_example", path)
  assert spec is not None and spec.loader is not None, path
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module
