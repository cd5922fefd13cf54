"""`strategy.run` against the same step hand-written as `jax.jit(jax.shard_map(...))`.

What is measured
----------------
Steps, each written twice and timed side by side in one process:

* ``tiny``: a dispatch-bound step. ``w`` is a replicated float32 scalar, ``x`` one float32 scalar per
  replica; each step computes ``w <- w - 0.01 * pmean(x * w)`` and returns the new ``w`` (replicated:
  `Mirrored`) and ``x * w`` (per replica: `PerReplica`). Nearly all of its time is host-side dispatch,
  so it exposes any Python overhead `strategy.run` adds.
* ``mlp``: one SGD step (lr 0.1) of a 784-1024-1024-10 ReLU MLP in float32, global batch 512 split
  over the replicas (64 per replica with 8), parameters replicated (`Mirrored`) and fed back into the
  next step. Each replica's loss is ``sum(cross_entropy) / global_batch``; under ``check_vma`` the
  gradient with respect to replicated parameters comes back already summed over replicas, so both
  variants compute the gradient of the global mean loss. The step also returns ``psum`` of the losses.
* ``wide`` (only with ``--only wide``): a state of 256 float32 ``[16]`` arrays (`Mirrored` each, as many
  leaves as a mid-sized model's parameters and optimizer slots), each moved by the replicas' mean of one
  scalar per replica. No compute to speak of: what it shows is the host work `run` adds per leaf of its
  arguments and results (flattening them, checking each leaf's layout, rebuilding each `Mirrored`), against
  `jax.jit`'s own; the last column says it per leaf.

The ``tpustrat`` variant calls ``strategy.run(step, args=(...))`` with `Mirrored` / `PerReplica`
arguments and feeds the returned `Mirrored` back. The ``hand-written`` variant is
``jax.jit(jax.shard_map(body, mesh=strategy.mesh, in_specs=..., out_specs=..., check_vma=True))`` with
the same specs (``P()`` for replicated values, ``P('replica')`` for stacked per-replica ones), called
on plain global `jax.Array`s, with the same bound of 2 steps in flight that `run` applies (before
dispatching step ``i`` it blocks on an output of step ``i - 2``; unbounded dispatch of collective
programs can deadlock XLA:CPU with emulated devices). Both compile to the same XLA program (same HLO
up to names), so any difference is host-side work in `run`.

Methodology
-----------
1. Both variants run a few steps from the same initial state; the script asserts their outputs are
   allclose.
2. Warm-up: each variant runs one full trial untimed (tracing, compilation, caches); the script
   asserts that nothing is compiled during the timed trials.
3. ``--trials`` rounds; in each round every variant runs ``--steps`` chained steps from the same
   initial state, timed with ``time.perf_counter`` from the first dispatch until the last step's
   outputs are ready. The order within a round rotates (AB, BA, AB, ...; all orders with three
   variants) so drift in machine load hits the variants alike.
4. Reported per benchmark: the median us/step of each variant over trials, ratio = median(tpustrat) /
   median(hand-written), the per-round paired ratios as median [p25, p75] (the spread), the ratio of
   the fastest trials (least disturbed by other load), and the host overhead = median of the per-round
   differences tpustrat - hand-written in us/step.
   ``--noise-floor`` adds a second, separately jitted copy of the hand-written step timed the same way:
   its ratio to the first copy shows how large a difference the machine's noise alone produces.

Reproduce from the repository root (on CPU it emulates ``--cpu-devices`` devices, 8 by default; on a
machine with accelerators `TPUStrategy` uses those instead)::

    .venv/bin/python benchmarks/bench_run.py --noise-floor        # both steps, default sizes
    .venv/bin/python benchmarks/bench_run.py --only tiny --steps 500 --trials 41
    .venv/bin/python benchmarks/bench_run.py --only mlp --steps 3 --trials 101
    .venv/bin/python benchmarks/bench_run.py --only tiny --watchdog   # the step watchdog's cost
    .venv/bin/python benchmarks/bench_run.py --only mlp --check-numerics   # NaN / Inf checks' cost
    .venv/bin/python benchmarks/bench_run.py --only tiny --step-stats   # the step counters' cost
    .venv/bin/python benchmarks/bench_run.py --devices 1 --only tiny --steps 500 --trials 31   # host cost per call
    .venv/bin/python benchmarks/bench_run.py --devices 1 --only wide   # host cost per leaf (a state of 256 leaves)

``--devices 1`` uses no emulated devices: a `MirroredStrategy` on the one CPU device, with the step watchdog
on (the step counters and the in-flight bound are always on), against the same hand-written program on
its one-device mesh. With nothing emulated the step is a few microseconds, so the difference is the host
work `run` adds per call: the tiny step's target is at most 10 us per call over `jax.jit` ("overhead"),
the MLP's a paired ratio <= 1.05.

``--watchdog`` adds a third variant: the same `run` loop with the step watchdog on (what
``--step-timeout`` / ``TPUSTRAT_STEP_TIMEOUT`` turn on), compared with `run` without it (target 1.02). ``--check-numerics`` adds the same `run` loop with
``RunOptions(check_numerics=True)`` (every floating output checked for NaN / Inf in the program, the flags
read on the host when the in-flight bound waits), compared with `run` without it (target 1.05 on the MLP).
``--step-stats`` adds the same `run` loop with the step counters switched off (they are always on: two clock
reads around the in-flight wait and a step record per dispatch, `strategy.experimental_step_stats()`), and
reports `run` as it is against it (target 1.01).

Defaults: tiny 200 steps x 101 trials, mlp 3 steps x 101 trials: short trials, many rounds, so that
the two runs of a round see the same machine load. About 1 minute in all on a 2-core machine with 8
emulated devices (1.5 with ``--noise-floor``), compilation included. Timings on shared CPU machines
are noisy: the target is checked on the median paired ratio, and the noise-floor row (two identical
programs) shows what the machine's noise alone produces; the ratio of medians and of minima can be
several percent off 1.00 for identical programs under load.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--steps", type=int, default=None, help="chained steps per trial (default: per benchmark)")
  parser.add_argument("--trials", type=int, default=None, help="timed trials per variant (default: per benchmark)")
  parser.add_argument("--only", choices=("tiny", "mlp", "wide"), default=None,
                      help="run one benchmark only (wide: only when named)")
  parser.add_argument("--noise-floor", action="store_true",
                      help="also time a second copy of the hand-written step (A/A comparison)")
  parser.add_argument("--watchdog", action="store_true",
                      help="also time `run` with the step watchdog on (--step-timeout), against `run` without it")
  parser.add_argument("--check-numerics", action="store_true",
                      help="also time `run` with RunOptions(check_numerics=True), against `run` without it")
  parser.add_argument("--step-stats", action="store_true",
                      help="also time `run` with its step counters switched off: `run` (counters on) against it")
  parser.add_argument("--devices", type=int, choices=(1,), default=None,
                      help="1: no emulated devices, a MirroredStrategy on the one CPU device, the step watchdog on; "
                           "reports the host cost of `run` per call over the hand-written `jax.jit`")


ARGS = h.parse_args(__doc__, _add_flags) if __name__ == "__main__" else None
if ARGS is not None:
  h.emulate_cpu_devices(0 if ARGS.devices == 1 else ARGS.cpu_devices)  # before JAX initialises its backends

import tpustrat  # noqa: E402
from tpustrat._src import engine as engine_lib  # noqa: E402
from tpustrat._src import step_stats as step_stats_lib  # noqa: E402
from tpustrat._src import watchdog as watchdog_lib  # noqa: E402

AXIS = "replica"
IN_FLIGHT = 2
DEFAULTS = {"tiny": (200, 101), "mlp": (3, 101)}  # (steps, trials)
WIDE_DEFAULTS = {"wide": (50, 31)}  # `--only wide`
TARGETS: dict[str, float | None] = {"tiny": 1.05, "mlp": 1.02, "wide": None}
WATCHDOG_TARGET = 1.02  # `run` with the step watchdog on, against `run` without it
NUMERICS_TARGET = 1.1  # `run` with RunOptions(check_numerics=True), against `run` without it (issue 45 item 3)
NUMERICS = "tpustrat + check_numerics"
STEP_STATS_TARGET = 1.01  # `run` (step counters always on) against `run` with them switched off
ONE_DEVICE_TARGETS = {"tiny": 10.0}  # --devices 1: us per call over the hand-written jax.jit (issue 45)
ONE_DEVICE_RATIO: dict[str, float | None] = {"mlp": 1.05, "wide": None}  # --devices 1: paired ratio to jax.jit
NO_STATS = "tpustrat, step counters off"
WIDE_LEAVES = 256
LABELS = {"tiny": "tiny step (dispatch-bound)", "mlp": "MLP 784-1024-1024-10, batch 512",
          "wide": f"state of {WIDE_LEAVES} leaves (dispatch-bound)"}


# -- the steps ----------------------------------------------------------------------------------------


def tiny_step(w, x):
  """tpustrat: `w` is the Mirrored scalar, `x` this replica's scalar."""
  y = x * w
  return w - 0.01 * tpustrat.get_replica_context().all_reduce("mean", y), y


def tiny_body(w, x):
  """Hand-written shard_map body: `x` arrives as this replica's [1] block of the stacked array."""
  y = x[0] * w
  return w - 0.01 * lax.pmean(y, AXIS), y[None]


def wide_step(params, x):
  """tpustrat: a state of `WIDE_LEAVES` small arrays (as many leaves as a mid-sized model's parameters and
  optimizer slots), each moved by the replicas' mean of `x`: no compute to speak of, the host work per leaf."""
  g = tpustrat.get_replica_context().all_reduce("mean", x)
  return jax.tree.map(lambda p: p - 0.01 * g, params), g


def wide_body(params, x):
  """Hand-written shard_map body of `wide_step`: `x` arrives as this replica's [1] block."""
  g = lax.pmean(x[0], AXIS)
  return jax.tree.map(lambda p: p - 0.01 * g, params), g


LAYERS = (784, 1024, 1024, 10)
GLOBAL_BATCH = 512
LR = 0.1


def init_mlp(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  params = {}
  for i, (a, b) in enumerate(zip(LAYERS[:-1], LAYERS[1:])):
    params[f"w{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
    params[f"b{i}"] = np.zeros((b,), np.float32)
  return params


def _mlp_loss(params, x, y):
  h = x
  n = len(LAYERS) - 1
  for i in range(n):
    h = h @ params[f"w{i}"] + params[f"b{i}"]
    if i < n - 1:
      h = jax.nn.relu(h)
  logp = jax.nn.log_softmax(h)
  nll = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
  return jnp.sum(nll) / GLOBAL_BATCH  # this replica's share of the global mean loss


def _sgd(params, x, y):
  loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)  # grads come back summed over replicas
  params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
  return params, lax.psum(loss, AXIS)


def mlp_step(params, x, y):
  """tpustrat: `params` Mirrored, `x` / `y` this replica's part of the batch."""
  return _sgd(params, x, y)


def mlp_body(params, x, y):
  """Hand-written shard_map body: `x` / `y` arrive as [1, 64, ...] blocks of the stacked batch."""
  return _sgd(params, x[0], y[0])


# -- the variants -------------------------------------------------------------------------------------


class Variant:
  """A named loop: `state = step(state)` k times from a fresh initial state, then wait for the end."""

  def __init__(self, name: str, init: Callable[[], Any], step: Callable[[Any], Any],
               finish: Callable[[], None]) -> None:
    self.name, self._init, self._step, self._finish = name, init, step, finish

  def run(self, k: int) -> tuple[float, Any]:
    """Runs `k` chained steps; returns (seconds, outputs of the last step)."""
    return h.time_chain(self._init, self._step, k, self._finish)


def tpustrat_variant(strategy: tpustrat.Strategy, fn: Callable[..., Any], init: Callable[[], Any],
                     data: tuple[Any, ...], options: tpustrat.RunOptions | None = None,
                     name: str = "tpustrat") -> Variant:
  def step(state):
    return strategy.run(fn, args=(state[0],) + data, options=options)  # state[0]: the Mirrored output fed back

  return Variant(name, lambda: (init(), None), step, strategy.experimental_run_wait)


def numerics_variant(strategy: tpustrat.Strategy, fn: Callable[..., Any], init: Callable[[], Any],
                     data: tuple[Any, ...]) -> Variant:
  """The tpustrat variant with `RunOptions(check_numerics=True)`: its own program (the flags as one more
  output), checked on the host when the in-flight bound (or the final wait) waits for each step."""
  return tpustrat_variant(strategy, fn, init, data, tpustrat.RunOptions(check_numerics=True), NUMERICS)


HANDWRITTEN_CHECKED = "hand-written + NaN / Inf flags"
CHECK_GROUP = 8  # steps whose flags the host reads together, as `RunOptions(check_numerics=True)` does


def flagged(body: Callable[..., Any]) -> Callable[..., Any]:
  """`body` (a shard_map body) with one more output: per replica, one byte per floating output (1: it
  holds a NaN, 2: an Inf), ``[1, L]``, what `check_numerics` computes, written out in plain JAX."""
  def checked(*args: Any) -> Any:
    outs = body(*args)
    codes = [jnp.isnan(o).any().astype(jnp.uint8) | (jnp.isinf(o).any().astype(jnp.uint8) * 2)
             for o in jax.tree.leaves(outs) if jnp.issubdtype(o.dtype, jnp.inexact)]
    return (*outs, jnp.stack(codes)[None])

  return checked


def handwritten_checked_variant(program: Callable[..., Any], init: Callable[[], Any],
                                data: tuple[Any, ...]) -> Variant:
  """The hand-written step with NaN / Inf flags (`flagged`), checked on the host as `check_numerics` does:
  each step waits (at most `IN_FLIGHT` in flight) on its flags, and the flags of `CHECK_GROUP` steps are
  read together once the newest has finished; a flag set raises. What JAX itself costs for the check."""
  pending: collections.deque = collections.deque()
  group: list[Any] = []

  def read() -> None:
    for flags in group:
      if np.asarray(flags).any():
        raise FloatingPointError("a NaN / Inf in the hand-written checked step")
    group.clear()

  def step(state: Any) -> Any:
    while len(pending) >= IN_FLIGHT:
      pending.popleft().block_until_ready()
    out = program(state[0], *data)
    pending.append(out[-1])
    group.append(out[-1])
    if len(group) == CHECK_GROUP:
      out[-1].block_until_ready()
      read()
    return out[:-1]  # the step's own outputs, as the other variants return them

  def finish() -> None:
    if group:
      group[-1].block_until_ready()
      read()
    pending.clear()

  return Variant(HANDWRITTEN_CHECKED, lambda: (init(), None), step, finish)


def watchdog_variant(variant: Variant) -> Variant:
  """`variant` (the tpustrat one) with a step watchdog noting every dispatch, as ``--step-timeout``
  turns on. Its thread is started once; each trial switches it on and off around the timed steps."""
  dog = watchdog_lib.Watchdog(3600.0)

  def init():
    watchdog_lib.activate(dog)
    return variant._init()  # pylint: disable=protected-access

  def finish():
    variant._finish()  # pylint: disable=protected-access
    watchdog_lib.activate(None)

  return Variant("tpustrat + step watchdog", init, variant._step, finish)  # pylint: disable=protected-access


def no_stats_variant(strategy: tpustrat.Strategy, variant: Variant) -> Variant:
  """`variant` (the tpustrat one) with the strategy's step counters switched off: its in-flight bound notes
  no waits and no steps (what `run` costs without `strategy.experimental_step_stats()`)."""
  in_flight = strategy.extended.engine.in_flight
  counters = in_flight.stats

  def init():
    in_flight.stats = None
    return variant._init()  # pylint: disable=protected-access

  def finish():
    variant._finish()  # pylint: disable=protected-access
    in_flight.stats = counters

  return Variant(NO_STATS, init, variant._step, finish)  # pylint: disable=protected-access


def counter_cost_us(rounds: int = 21, dispatches: int = 20000) -> tuple[float, float, float]:
  """The step counters' own cost per dispatch, without a program: `InFlight.before_dispatch` /
  `after_dispatch` (as `engine.dispatch` calls them) with a token that is already ready, with the counters
  and without, `dispatches` times per round, the rounds interleaved. Returns (us per dispatch on, off,
  their difference), each the minimum over the rounds (the least disturbed by other load)."""
  token = jax.block_until_ready(jnp.zeros((), jnp.int8))

  def loop(stats: step_stats_lib.StepCounters | None) -> float:
    bound = engine_lib.InFlight(stats)
    start = time.perf_counter()
    for _ in range(dispatches):
      noted = bound.before_dispatch(IN_FLIGHT, 1)
      bound.after_dispatch(token, None, 1, noted)
    return (time.perf_counter() - start) / dispatches * 1e6

  on, off = [], []
  for _ in range(rounds):
    on.append(loop(step_stats_lib.StepCounters()))
    off.append(loop(None))
  return min(on), min(off), min(on) - min(off)


def handwritten_variant(name: str, program: Callable[..., Any], init: Callable[[], Any],
                        data: tuple[Any, ...]) -> Variant:
  """Feeds output 0 back; before dispatching step i waits for step i - IN_FLIGHT, like `run`."""
  call, forget = h.bounded(program, IN_FLIGHT)
  return Variant(name, lambda: (init(), None), lambda state: call(state[0], *data), forget)


def make_tiny(strategy: tpustrat.Strategy, copies: int, numerics: bool = False) -> list[Variant]:
  n = strategy.num_replicas_in_sync
  mesh = strategy.mesh
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  w0 = np.float32(1.0)
  xs = (1.0 + np.arange(n, dtype=np.float32)) / n

  x_pr = strategy.experimental_distribute_values_from_function(lambda ctx: xs[ctx.replica_id_in_sync_group])
  init = lambda: tpustrat.Mirrored(jax.device_put(w0, replicated))  # noqa: E731
  variants = [tpustrat_variant(strategy, tiny_step, init, (x_pr,))]
  x_stacked = jax.device_put(xs, split)
  for c in range(copies):
    program = jax.jit(jax.shard_map(tiny_body, mesh=mesh, in_specs=(P(), P(AXIS)),
                                    out_specs=(P(), P(AXIS)), check_vma=True))
    variants.append(handwritten_variant("hand-written" + " (copy 2)" * c, program,
                                        lambda: jax.device_put(w0, replicated), (x_stacked,)))
  if numerics:
    variants.append(numerics_variant(strategy, tiny_step, init, (x_pr,)))
    program = jax.jit(jax.shard_map(flagged(tiny_body), mesh=mesh, in_specs=(P(), P(AXIS)),
                                    out_specs=(P(), P(AXIS), P(AXIS)), check_vma=True))
    variants.append(handwritten_checked_variant(program, lambda: jax.device_put(w0, replicated), (x_stacked,)))
  return variants


def make_wide(strategy: tpustrat.Strategy, copies: int, numerics: bool = False) -> list[Variant]:
  n = strategy.num_replicas_in_sync
  mesh = strategy.mesh
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  p0 = {f"v{i:03d}": np.full((16,), i / WIDE_LEAVES, np.float32) for i in range(WIDE_LEAVES)}
  xs = (1.0 + np.arange(n, dtype=np.float32)) / n
  x_pr = strategy.experimental_distribute_values_from_function(lambda ctx: xs[ctx.replica_id_in_sync_group])
  init = lambda: strategy.experimental_mirror(jax.device_put(p0, replicated))  # noqa: E731  # a Mirrored per leaf
  variants = [tpustrat_variant(strategy, wide_step, init, (x_pr,))]
  x_stacked = jax.device_put(xs, split)
  for c in range(copies):
    program = jax.jit(jax.shard_map(wide_body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()),
                                    check_vma=True))
    variants.append(handwritten_variant("hand-written" + " (copy 2)" * c, program,
                                        lambda: jax.device_put(p0, replicated), (x_stacked,)))
  if numerics:
    variants.append(numerics_variant(strategy, wide_step, init, (x_pr,)))
  return variants


def make_mlp(strategy: tpustrat.Strategy, copies: int, numerics: bool = False) -> list[Variant]:
  n = strategy.num_replicas_in_sync
  if GLOBAL_BATCH % n:
    raise SystemExit(f"the global batch of {GLOBAL_BATCH} does not split over {n} replicas")
  mesh = strategy.mesh
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  rng = np.random.default_rng(1)
  xs = rng.standard_normal((n, GLOBAL_BATCH // n, LAYERS[0])).astype(np.float32)
  ys = rng.integers(0, LAYERS[-1], size=(n, GLOBAL_BATCH // n)).astype(np.int32)
  p0 = init_mlp()

  x_pr, y_pr = (strategy.experimental_distribute_values_from_function(lambda ctx, a=a: a[ctx.replica_id_in_sync_group])
                for a in (xs, ys))
  init = lambda: tpustrat.Mirrored(jax.device_put(p0, replicated))  # noqa: E731
  variants = [tpustrat_variant(strategy, mlp_step, init, (x_pr, y_pr))]
  x_stacked, y_stacked = jax.device_put(xs, split), jax.device_put(ys, split)
  for c in range(copies):
    program = jax.jit(jax.shard_map(mlp_body, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                                    out_specs=(P(), P()), check_vma=True))
    variants.append(handwritten_variant("hand-written" + " (copy 2)" * c, program,
                                        lambda: jax.device_put(p0, replicated), (x_stacked, y_stacked)))
  if numerics:
    variants.append(numerics_variant(strategy, mlp_step, init, (x_pr, y_pr)))
    program = jax.jit(jax.shard_map(flagged(mlp_body), mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                                    out_specs=(P(), P(), P(AXIS)), check_vma=True))
    variants.append(handwritten_checked_variant(program, lambda: jax.device_put(p0, replicated),
                                                (x_stacked, y_stacked)))
  return variants


# -- checking and timing ------------------------------------------------------------------------------


def _global(strategy: tpustrat.Strategy, tree: Any) -> Any:
  """A `run` result as numpy: a Mirrored leaf as its value, a PerReplica leaf stacked over replicas."""
  def leaf(v):
    if isinstance(v, tpustrat.Mirrored):
      return np.asarray(strategy.experimental_local_results(v)[0])
    if isinstance(v, tpustrat.PerReplica):
      return np.stack([np.asarray(c) for c in strategy.experimental_local_results(v)])
    return np.asarray(v)

  return jax.tree.map(leaf, tree, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))


def check_same(strategy: tpustrat.Strategy, name: str, variants: list[Variant], k: int, rtol: float,
               atol: float) -> None:
  ref = _global(strategy, variants[0].run(k)[1])
  for v in variants[1:]:
    got = _global(strategy, v.run(k)[1])
    assert jax.tree.structure(ref) == jax.tree.structure(got), (jax.tree.structure(ref), jax.tree.structure(got))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
      np.testing.assert_allclose(a, b, rtol=rtol, atol=atol,
                                 err_msg=f"{name}: {variants[0].name} and {v.name} give different results")


def bench(variants: list[Variant], steps: int, trials: int) -> dict[str, list[float]]:
  """us/step of every variant in every trial; the order rotates through all permutations."""
  for v in variants:
    v.run(steps)  # warm-up
  with h.no_compilation():
    return h.time_rounds(variants, trials, h.permutation_schedule(variants),
                         lambda v: v.run(steps)[0] / steps * 1e6)


def summarise(name: str, times: dict[str, list[float]], other: str, base: str = "hand-written") -> dict[str, Any]:
  a, b = times[other], times[base]
  return {
      "name": name, "variant": other, "trials": len(a),
      "us": statistics.median(a), "base_us": statistics.median(b),
      "ratio": statistics.median(a) / statistics.median(b),
      "paired": h.spread(h.paired_ratios(a, b)),
      "overhead": statistics.median([x - y for x, y in zip(a, b)]),
      "min_ratio": min(a) / min(b),
  }


def one_device_strategy() -> tpustrat.Strategy:
  """``--devices 1``: a `MirroredStrategy` on the one CPU device with the step watchdog on (as
  ``--step-timeout`` turns it on), the step counters and the in-flight bound as always: nothing emulated,
  so the host work of each call is not hidden behind a step of 8 devices."""
  watchdog_lib.activate(watchdog_lib.Watchdog(3600.0))
  return tpustrat.MirroredStrategy(devices=jax.devices()[:1])


def main(args: argparse.Namespace) -> int:
  one = args.devices == 1
  strategy = one_device_strategy() if one else tpustrat.TPUStrategy()
  print(h.machine_line(strategy.num_replicas_in_sync) + (" (--devices 1: step watchdog on)" if one else ""))
  rows = []
  t_start = time.perf_counter()
  makers = {"tiny": make_tiny, "mlp": make_mlp, "wide": make_wide}
  for name, steps, trials in h.selected_benchmarks(args, WIDE_DEFAULTS if args.only == "wide" else DEFAULTS):
    variants = makers[name](strategy, 2 if args.noise_floor else 1, args.check_numerics)
    if args.watchdog:
      variants.append(watchdog_variant(variants[0]))
    if args.step_stats:
      variants.append(no_stats_variant(strategy, variants[0]))
    tol = dict(rtol=1e-6, atol=1e-7) if name != "mlp" else dict(rtol=1e-5, atol=1e-6)
    check_same(strategy, name, variants, 3, **tol)
    print(f"# {name}: results allclose; timing {trials} trials x {steps} steps per variant ...", flush=True)
    times = bench(variants, steps, trials)
    rows.append(summarise(name, times, "tpustrat") | {"steps": steps})
    if args.noise_floor:
      rows.append(summarise(name, times, "hand-written (copy 2)") | {"steps": steps})
    if args.watchdog:
      rows.append(summarise(name, times, "tpustrat + step watchdog", base="tpustrat") | {"steps": steps})
    if args.check_numerics:
      rows.append(summarise(name, times, NUMERICS, base="tpustrat") | {"steps": steps})
      if any(v.name == HANDWRITTEN_CHECKED for v in variants):
        rows.append(summarise(name, times, HANDWRITTEN_CHECKED, base="hand-written") | {"steps": steps})
    if args.step_stats:
      rows.append(summarise(name, times, "tpustrat", base=NO_STATS) | {"steps": steps, "target": STEP_STATS_TARGET,
                                                                      "label": "tpustrat (step counters on)"})
  print(f"# total {time.perf_counter() - t_start:.0f} s")
  print()
  print(h.markdown_header(
      ["step", "variant", "steps x trials", "us/step", "hand-written us/step", "ratio",
       "paired ratio, median [p25, p75]", "ratio of minima", "overhead us/step", "target"],
      right={"us/step", "hand-written us/step", "ratio", "ratio of minima", "overhead us/step"}))
  for r in rows:
    target = r.get("target") or (WATCHDOG_TARGET if r["variant"] == "tpustrat + step watchdog"
                                 else NUMERICS_TARGET if r["variant"] == NUMERICS else TARGETS[r["name"]])
    if one and r["variant"] == "tpustrat" and r["name"] in ONE_DEVICE_TARGETS:
      limit = ONE_DEVICE_TARGETS[r["name"]]
      verdict = h.verdict(f"<= +{limit:.0f} us", r["overhead"] <= limit)
      h.figure(f"one device: strategy.run, {LABELS[r['name']]}: host cost per call over jax.jit",
               f"{r['overhead']:+.1f} us", f"<= +{limit:.0f} us", r["overhead"] <= limit)
    elif one and r["variant"] == "tpustrat" and ONE_DEVICE_RATIO[r["name"]] is not None:
      limit = ONE_DEVICE_RATIO[r["name"]]
      verdict = h.verdict(f"<= {limit:.2f}", r["paired"][0] <= limit)
      h.figure(f"one device: strategy.run, {LABELS[r['name']]}: paired ratio to jax.jit",
               f"{r['paired'][0]:.3f}x", f"<= {limit:.2f}x", r["paired"][0] <= limit)
    elif r["variant"] == HANDWRITTEN_CHECKED:  # what the check costs JAX itself: the floor under the target
      verdict = f"(plain JAX's own cost of the check; target for tpustrat <= {NUMERICS_TARGET:.2f})"
      h.figure(f"plain JAX, {LABELS[r['name']]}: the same NaN / Inf flags, read 8 steps at a time, paired ratio to "
               "the step without them", f"{r['paired'][0]:.3f}x", "(none)", None)
    elif target is None:  # the wide step: what each leaf costs, no target of its own
      verdict = f"(no target: {r['overhead'] / WIDE_LEAVES:+.2f} us a leaf)"
    elif r["variant"].startswith("tpustrat"):
      verdict = h.verdict(f"<= {target:.2f}", r["paired"][0] <= target)
      h.figure(f"strategy.run, {LABELS[r['name']]}: {r.get('label', r['variant'])}, paired ratio to its baseline",
               f"{r['paired'][0]:.3f}x", f"<= {target:.2f}x", r["paired"][0] <= target)
    else:
      verdict = "(noise floor)"
    print(h.markdown_row([LABELS[r["name"]], r.get("label", r["variant"]), f"{r['steps']} x {r['trials']}", f"{r['us']:.1f}",
                          f"{r['base_us']:.1f}", f"{r['ratio']:.3f}", h.format_spread(r["paired"], 3),
                          f"{r['min_ratio']:.3f}", f"{r['overhead']:+.1f}", verdict]))
  if args.step_stats and any(r["name"] == "tiny" and r["variant"] == "tpustrat" for r in rows):
    on, off, cost = counter_cost_us()
    tiny = next(r["us"] for r in rows if r["name"] == "tiny" and r["variant"] == "tpustrat")
    share = cost / tiny
    print()
    print(f"step counters alone (InFlight with a ready token, 21 x 20000 dispatches, minima): {on:.3f} us per "
          f"dispatch with them, {off:.3f} us without: +{cost * 1e3:.0f} ns, {share:.3%} of the tiny step's "
          f"{tiny:.1f} us (target <= 1%: {'met' if share <= 0.01 else 'MISSED'})")
    h.figure("step counters' cost per step, share of the tiny step", f"{share:.3%}", "<= 1%", share <= 0.01)
  print()
  print("us/step: median over trials of (time for `steps` chained steps, until the last is ready) / steps. "
        "ratio: median / hand-written median. paired ratio: per-trial ratios to the hand-written run of the "
        "same round (for the step-watchdog and check_numerics rows, the baseline is `run` without them; for the step-counters row, `run` with the counters switched off). ratio of minima: fastest trial / fastest hand-written trial. overhead: median per-round "
        "difference to hand-written. target: checked on the median paired ratio (the most robust to load).")
  return 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
