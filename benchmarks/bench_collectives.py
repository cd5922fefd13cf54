"""Grouped `tpustrat.ops.cross_replica_sum` inside `strategy.run` against `jax.pmap`'s native grouped `psum`.

What is measured
----------------
For every group shape (default: 2 groups of 4, ``[[0,1,2,3],[4,5,6,7]]``, and 4 groups of 2,
``[[0,1],[2,3],[4,5],[6,7]]``) and every size per replica (default 1 MiB and 64 MiB of float32), one
grouped sum of the same global data, timed side by side in one process:

* ``pmap native``: ``jax.pmap(lambda x: lax.psum(x, 'i', axis_index_groups=groups), axis_name='i')``,
  the reference (JAX 0.10's pmap is ``jit(shard_map(..., check_vma=False))``, so this is XLA's
  all-reduce with ``replica_groups``). Its input is one of its own outputs, so it is already laid out
  the way pmap wants.
* ``tpustrat``: ``strategy.run(lambda x: tpustrat.ops.cross_replica_sum(x, groups), args=(x,))`` with
  a `PerReplica` input made by `experimental_distribute_values_from_function` (the engine,
  ``check_vma=True``, output inference and the bound on steps in flight included).
* ``op without run``: the same grouped sum in a hand-written ``jax.jit(jax.shard_map(...,
  check_vma=True))`` on the same global array: the op's cost without `run`'s host-side work.
* with ``--mechanisms``, the alternatives `docs/benchmarks_collectives.md`
  discusses, each also inside `strategy.run`: ``scatter_gather`` (grouped reduce-scatter + all-gather),
  ``doubling`` (recursive doubling with `ppermute`), ``stacked`` (one full `psum` of a
  ``[num_groups, ...]`` stack).

Before timing, every variant's result is checked against the native one, and the script prints the
collectives in each compiled program: the chosen mechanism compiles to the same single all-reduce with
the same ``replica_groups`` as pmap.

Methodology: a trial is ``--calls`` calls on the same input, each waited for (``block_until_ready``)
before the next; each variant runs one untimed trial first (compilation). The variants of one configuration
alternate within each round (order rotated every round) so that drift in machine load hits them alike.
Reported: median ms per call over trials, ratio = median / pmap median, and the per-round paired ratios
as median [p25, p75]. ``--noise-floor`` adds a second, separately compiled pmap (an A/A comparison).

Reproduce (repository root; 8 emulated CPU devices unless ``--cpu-devices`` says otherwise)::

    .venv/bin/python benchmarks/bench_collectives.py                      # 2x4 and 4x2, 1 and 64 MiB
    .venv/bin/python benchmarks/bench_collectives.py --mechanisms --noise-floor
    .venv/bin/python benchmarks/bench_collectives.py --sizes-mib 1 --trials 41

About 1 minute on a 2-core machine with the defaults (64 MiB x 8 replicas = 512 MiB per array; a few
such arrays are alive at once, about 3 GiB peak). Shared CPU machines are noisy: read the paired spread
and the noise-floor row before reading much into ten percent.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--sizes-mib", default="1,64", help="comma-separated MiB of float32 per replica")
  parser.add_argument("--groups", default="2x4,4x2",
                      help="comma-separated GxS: G groups of S consecutive replicas (G*S = replicas)")
  parser.add_argument("--trials", type=int, default=None,
                      help="timed trials per variant (default: 21 below 16 MiB, else 9)")
  parser.add_argument("--calls", type=int, default=None,
                      help="calls per trial (default: 10 below 16 MiB, else 1)")
  parser.add_argument("--mechanisms", action="store_true", help="also time the alternative mechanisms")
  parser.add_argument("--noise-floor", action="store_true", help="also time a second copy of the pmap baseline")


ARGS = h.parse_args(__doc__, _add_flags) if __name__ == "__main__" else None
if ARGS is not None:
  h.emulate_cpu_devices(ARGS.cpu_devices)  # before JAX initialises its backends

import tpustrat  # noqa: E402
import tpustrat.ops  # noqa: E402
from tpustrat._src import grouped_sums  # noqa: E402

TARGET = 1.2


# -- the alternative mechanisms (for --mechanisms; the library uses `cross_replica_sum`) ----------------


def _axis() -> str:
  return tpustrat.get_replica_context()._axis_name  # pylint: disable=protected-access


def scatter_gather(x: jax.Array, groups: tuple[tuple[int, ...], ...]) -> jax.Array:
  return grouped_sums._grouped_psum_scatter_gather(x, _axis(), groups)  # pylint: disable=protected-access


def doubling(x: jax.Array, groups: tuple[tuple[int, ...], ...]) -> jax.Array:
  """Recursive doubling: log2(group size) exchanges with the partner whose group index differs in one bit."""
  size = len(groups[0])
  assert size & (size - 1) == 0, "recursive doubling needs power-of-two groups"
  d = 1
  while d < size:
    x = x + lax.ppermute(x, _axis(), [(r, g[i ^ d]) for g in groups for i, r in enumerate(g)])
    d *= 2
  return x


def stacked(x: jax.Array, groups: tuple[tuple[int, ...], ...]) -> jax.Array:
  """One full psum of a [num_groups, ...] stack: row g holds x on members of group g, zeros elsewhere."""
  group_of = np.zeros(sum(len(g) for g in groups), np.int32)
  for i, g in enumerate(groups):
    group_of[list(g)] = i
  mine = jnp.asarray(group_of)[lax.axis_index(_axis())]
  rows = (jnp.arange(len(groups)) == mine).astype(x.dtype).reshape((-1,) + (1,) * x.ndim) * x[None]
  total = lax.pcast(lax.psum(rows, _axis()), _axis(), to="varying")
  return lax.dynamic_index_in_dim(total, mine, 0, keepdims=False)


MECHANISMS = {"scatter_gather": scatter_gather, "doubling": doubling, "stacked": stacked}


# -- variants -----------------------------------------------------------------------------------------


class Variant:
  """A grouped sum called again and again on the same input, each call waited for."""

  def __init__(self, name: str, call: Callable[[Any], Any], x: Any) -> None:
    self.name, self._call, self._x = name, call, x

  def trial(self, calls: int) -> float:
    """Seconds per call, over `calls` calls."""
    return h.seconds_per_call(self._call, (self._x,), calls)


def make_variants(strategy: tpustrat.Strategy, x: np.ndarray, groups: tuple[tuple[int, ...], ...],
                  mechanisms: bool, noise_floor: bool) -> tuple[list[Variant], dict[str, Any]]:
  """The variants, and for each a (function, input) to check results and read compiled collectives."""
  lists = [list(g) for g in groups]
  x_pr = strategy.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group])
  x_global = jax.tree.leaves(x_pr)[0]
  variants, programs = [], {}
  for copy in range(2 if noise_floor else 1):
    native = jax.pmap(lambda v: lax.psum(v, "i", axis_index_groups=lists), axis_name="i")
    own = native(x_global)  # an input in pmap's own layout
    name = "pmap native" + " (copy 2)" * copy
    variants.append(Variant(name, native, own))
    programs[name] = (native, x_global)

  def add(name: str, fn: Callable[[Any], Any]) -> None:
    def step(v):
      return fn(v)

    call = lambda v: strategy.run(step, args=(v,))
    variants.append(Variant(name, call, x_pr))
    programs[name] = (jax.jit(lambda v: call(v)), x_pr)

  add("tpustrat", lambda v: tpustrat.ops.cross_replica_sum(v, groups))

  # The same mechanism without the engine: separates the op's cost from `run`'s host-side dispatch.
  axis = strategy.mesh.axis_names[0]
  alone = jax.jit(jax.shard_map(lambda v: grouped_sums.grouped_sum(v, axis, groups),
                                mesh=strategy.mesh, in_specs=P(axis), out_specs=P(axis)))
  variants.append(Variant("op without run", alone, x_global))
  programs["op without run"] = (alone, x_global)
  if mechanisms:
    for name, mech in MECHANISMS.items():
      if name == "doubling" and len(groups[0]) & (len(groups[0]) - 1):
        continue
      add(name, lambda v, mech=mech: mech(v, groups))
  return variants, programs


def _values(out: Any) -> np.ndarray:
  if isinstance(out, tpustrat.DistributedValues):
    out = jax.tree.leaves(out)[0]
  return np.asarray(out)


_COLLECTIVE = re.compile(r"\b(all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")
_GROUPS = re.compile(r"replica_groups=(\{[^=]*\}|\[[^\]]*\][^,]*)")


def collectives_in(fn: Callable[[Any], Any], x: Any) -> str:
  """The collectives of the compiled program, e.g. ``all-reduce{{0,1,2,3},{4,5,6,7}}``."""
  text = jax.jit(fn).lower(x).compile().as_text()
  found = []
  for line in text.splitlines():
    m = _COLLECTIVE.search(line)
    if m:
      g = _GROUPS.search(line)
      found.append(m.group(1) + (g.group(1).split(", ")[0] if g else ""))
  return " + ".join(found) or "none"


# -- timing -------------------------------------------------------------------------------------------


def bench(variants: list[Variant], trials: int, calls: int) -> dict[str, list[float]]:
  for v in variants:
    v.trial(1)  # warm-up: compile, first layouts
  return h.time_rounds(variants, trials, h.rotation_schedule(variants), lambda v: v.trial(calls))


def main(args: argparse.Namespace) -> int:
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  print(h.machine_line(n))
  rows = []
  t_start = time.perf_counter()
  for mib, spec in itertools.product([float(s) for s in args.sizes_mib.split(",")], args.groups.split(",")):
    num_groups, size = (int(s) for s in spec.lower().split("x"))
    if num_groups * size != n:
      raise SystemExit(f"--groups {spec}: {num_groups} x {size} != {n} replicas")
    groups = tuple(tuple(range(g * size, (g + 1) * size)) for g in range(num_groups))
    elements = int(mib * 2**20) // 4
    big = mib >= 16
    trials = args.trials or (9 if big else 21)
    calls = args.calls or (1 if big else 10)
    x = np.random.default_rng(0).standard_normal((n, elements), dtype=np.float32)
    variants, programs = make_variants(strategy, x, groups, args.mechanisms, args.noise_floor)
    reference = _values(programs["pmap native"][0](programs["pmap native"][1]))
    for name, (fn, arg) in programs.items():
      np.testing.assert_allclose(_values(fn(arg)), reference, rtol=1e-5, atol=1e-4,
                                 err_msg=f"{name} differs from pmap's grouped psum")
      if not name.startswith("pmap native (copy"):
        print(f"# {mib:g} MiB {spec}: {name:14s} compiles to {collectives_in(fn, arg)}")
    del x
    label = f"{num_groups} groups of {size}, {mib:g} MiB/replica"
    print(f"# {label}: results allclose; timing {trials} trials x {calls} calls per variant ...", flush=True)
    times = bench(variants, trials, calls)
    base = times["pmap native"]
    for v in variants[1:]:
      a = times[v.name]
      rows.append((label, v.name, trials, calls, statistics.median(a) * 1e3, statistics.median(base) * 1e3,
                   statistics.median(a) / statistics.median(base), h.spread(h.paired_ratios(a, base))))
    del variants, programs
  print(f"# total {time.perf_counter() - t_start:.0f} s")
  print()
  print(h.markdown_header(["groups, size", "variant", "trials x calls", "ms/call", "pmap ms/call", "ratio",
                           "paired ratio, median [p25, p75]", "target"],
                          right={"ms/call", "pmap ms/call", "ratio"}))
  for label, name, trials, calls, ms, base_ms, ratio, paired in rows:
    if name == "tpustrat":
      verdict = h.verdict(f"<= {TARGET}", ratio <= TARGET)
      h.figure(f"cross_replica_sum in run vs pmap psum, {label}", f"{ratio:.2f}x", f"<= {TARGET}x", ratio <= TARGET)
    elif name.startswith("pmap native"):
      verdict = "(noise floor)"
    elif name == "op without run":
      verdict = "(no engine)"
    else:
      verdict = "(alternative)"
    print(h.markdown_row([label, name, f"{trials} x {calls}", f"{ms:.3f}", f"{base_ms:.3f}", f"{ratio:.2f}",
                          h.format_spread(paired, 2), verdict]))
  print()
  print("ms/call: median over trials of the mean time per call (each call waited for). ratio: median / pmap "
        "median. paired ratio: per-round ratios to the pmap trial of the same round.")
  return 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
