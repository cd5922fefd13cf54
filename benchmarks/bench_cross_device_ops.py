"""Gradient all-reduce in one compiled training step: per tensor vs packing vs small-gradient aggregation.

What is measured
----------------
A ResNet-50-like gradient list (161 float32 tensors: 53 convolution kernels, 53 batch-norm scales and
offsets, the classifier's kernel and bias; 25.6 M parameters at ``--width 1``, most tensors small) on 8
emulated CPU devices. One training step, compiled once per variant::

    def step(params, scale):                  # strategy.run: params Mirrored, scale PerReplica
      grads = [p * scale for p in params]     # differs per replica
      grads = ops.all_reduce_in_replica_context("mean", grads, options)   # the configured CrossDeviceOps
      return [p - 0.01 * g for p, g in zip(params, grads)]

(`all_reduce_in_replica_context` is what ``ReplicaContext.all_reduce(..., options)`` runs on a
`MirroredStrategy`.) Variants, side by side in one process on the same inputs:

* ``per tensor``: ``NcclAllReduce(num_packs=0)``, one ``lax.psum`` per tensor (the baseline). XLA's
  all-reduce combiner pass merges independent all-reduces into tuple all-reduces before the program runs;
  the script prints how many all-reduces each compiled program has.
* ``per tensor, combiner off``: the same program compiled with that pass disabled: truly one all-reduce per
  tensor, i.e. what packing is meant to avoid.
* ``num_packs=k``: ``NcclAllReduce(k)``: all gradients concatenated into one flat buffer, cut into k.
* ``bytes_per_pack=B``: ``CommunicationOptions(bytes_per_pack=B)``: packs of about B bytes, in order.
* ``agg small <=B x G``: ``AllReduceCrossDeviceOps(num_packs=0, agg_small_grads_max_bytes=B,
  agg_small_grads_max_group=G)``.
* with ``--algorithms``: ``HierarchicalCopyAllReduce(1)``, the ring (``implementation=RING``) and
  ``ReductionToOneDevice`` (with 4 MiB packs): collective-permute based, for reference.

Every variant's result is checked against the per-tensor one (allclose) before timing.

Methodology: each variant is a ``jax.jit(lambda p, s: strategy.run(step, (p, s)))`` compiled ahead of time
(so that compiler options can differ) and called on the same inputs; a trial is ``--calls`` calls, each
waited for. Variants alternate within each round (order rotated every round) so that drift in machine load
hits them alike. Reported: median ms per step over trials, ratio to the per-tensor median, and the
per-round paired ratios as median [p25, p75]. ``--noise-floor`` adds a second, separately compiled copy of
the baseline (an A/A comparison).

Reproduce (repository root)::

    .venv/bin/python benchmarks/bench_cross_device_ops.py                  # ResNet-50: 25.6 M parameters
    .venv/bin/python benchmarks/bench_cross_device_ops.py --algorithms --noise-floor
    .venv/bin/python benchmarks/bench_cross_device_ops.py --width 0.125 --trials 21 --calls 5   # 2.4 MiB
    .venv/bin/python benchmarks/bench_cross_device_ops.py --only "num_packs=1,agg small <=32"  # a subset

About 3 minutes with the defaults on a 2-core machine (8 replicas x 102 MB of gradients per step, a few
GB of memory); the shared machine is noisy: read the paired spread and the ``--noise-floor`` row.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--width", type=float, default=1.0,
                      help="channel-width multiplier of the ResNet-50 shapes (1: 25.6 M parameters)")
  parser.add_argument("--trials", type=int, default=9, help="timed trials per variant")
  parser.add_argument("--calls", type=int, default=2, help="steps per trial")
  parser.add_argument("--algorithms", action="store_true",
                      help="also time the collective-permute algorithms (hierarchical copy, ring, to one device)")
  parser.add_argument("--noise-floor", action="store_true", help="also time a second copy of the baseline")
  parser.add_argument("--only", default="", help="time only variants whose name contains one of these "
                      "comma-separated strings (the per-tensor baseline is always timed)")


ARGS = h.parse_args(__doc__, _add_flags) if __name__ == "__main__" else None
if ARGS is not None:
  h.emulate_cpu_devices(ARGS.cpu_devices)  # before JAX initialises its backends

import tpustrat  # noqa: E402
from tpustrat import (  # noqa: E402
    AllReduceCrossDeviceOps,
    CommunicationImplementation,
    CommunicationOptions,
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)

MIB = 1 << 20
NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner,all-reduce-combiner"}


def resnet50_shapes(width: float = 1.0) -> list[tuple[int, ...]]:
  """Gradient shapes of ResNet-50 (v1.5, bottleneck blocks [3, 4, 6, 3]) in network order; 161 tensors."""
  c = lambda ch: max(1, int(round(ch * width)))
  shapes: list[tuple[int, ...]] = []

  def conv_bn(k: int, cin: int, cout: int) -> None:
    shapes.extend([(k, k, cin, cout), (cout,), (cout,)])  # kernel, batch-norm scale and offset

  conv_bn(7, 3, c(64))
  cin = c(64)
  for blocks, mid in zip((3, 4, 6, 3), (64, 128, 256, 512)):
    for b in range(blocks):
      conv_bn(1, cin, c(mid))
      conv_bn(3, c(mid), c(mid))
      conv_bn(1, c(mid), c(4 * mid))
      if b == 0:
        conv_bn(1, cin, c(4 * mid))  # projection shortcut
      cin = c(4 * mid)
  shapes.extend([(cin, 1000), (1000,)])
  return shapes


class Variant:
  """One compiled training step, called on the same inputs again and again."""

  def __init__(self, name: str, strategy: tpustrat.Strategy, ops: CrossDeviceOps,
               options: CommunicationOptions | None, params: Any, scale: Any,
               compiler_options: dict[str, str] | None = None) -> None:
    def step(ps, s):
      grads = [p * s for p in ps]
      grads = ops.all_reduce_in_replica_context("mean", grads, options)
      return [p - 0.01 * g for p, g in zip(ps, grads)]

    self.name = name
    lowered = jax.jit(lambda ps, s: strategy.run(step, args=(ps, s))).lower(params, scale)
    self.compiled = lowered.compile(compiler_options or {})
    self._args = (params, scale)

  def __call__(self) -> Any:
    return self.compiled(*self._args)

  def trial(self, calls: int) -> float:
    """Seconds per step, over `calls` steps (each waited for)."""
    return h.seconds_per_call(self.compiled, self._args, calls)

  def collectives(self) -> str:
    text = self.compiled.as_text()
    counts = collections.Counter(re.findall(r" (all-reduce|collective-permute|all-gather|reduce-scatter)(?:-start)?\(", text))
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"


def variant_specs(args: argparse.Namespace) -> list[tuple[str, CrossDeviceOps, CommunicationOptions | None, dict | None]]:
  per_tensor = NcclAllReduce(num_packs=0)
  specs = [("per tensor", per_tensor, None, None)]
  if args.noise_floor:
    specs.append(("per tensor (copy 2)", NcclAllReduce(num_packs=0), None, None))
  specs.append(("per tensor, combiner off", per_tensor, None, NO_COMBINER))
  specs += [(f"num_packs={k}", NcclAllReduce(num_packs=k), None, None) for k in (1, 2, 4, 8)]
  specs += [(f"bytes_per_pack={b // MIB} MiB", per_tensor, CommunicationOptions(bytes_per_pack=b), None)
            for b in (1 * MIB, 4 * MIB, 16 * MIB)]
  specs += [(f"agg small <={b // 1024} KiB x{g}", AllReduceCrossDeviceOps(
      num_packs=0, agg_small_grads_max_bytes=b, agg_small_grads_max_group=g), None, None)
            for b, g in ((16 * 1024, 10), (32 * 1024, 10), (32 * 1024, 32), (256 * 1024, 32))]
  if args.algorithms:
    specs += [
        ("hierarchical copy, num_packs=1", HierarchicalCopyAllReduce(num_packs=1), None, None),
        ("ring, num_packs=1", NcclAllReduce(num_packs=1), CommunicationOptions(implementation=CommunicationImplementation.RING), None),
        ("to one device, 4 MiB packs", ReductionToOneDevice(), CommunicationOptions(bytes_per_pack=4 * MIB), None),
    ]
  keep = [k for k in args.only.split(",") if k]
  if keep:
    specs = specs[:1] + [s for s in specs[1:] if any(k in s[0] for k in keep)]
  return specs


def bench(variants: list[Variant], trials: int, calls: int) -> dict[str, list[float]]:
  for v in variants:
    v.trial(1)  # warm-up: first layouts and allocations
  return h.time_rounds(variants, trials, h.rotation_schedule(variants), lambda v: v.trial(calls))


def _first(out: Any) -> list[np.ndarray]:
  return [np.asarray(m.values[0]) for m in out]


def main(args: argparse.Namespace, report: Callable[[str], None] = print) -> dict[str, list[float]]:
  strategy = tpustrat.TPUStrategy()
  shapes = resnet50_shapes(args.width)
  sizes = [int(np.prod(s)) * 4 for s in shapes]
  report(h.machine_line(strategy.num_replicas_in_sync))
  report(f"# ResNet-50 x{args.width:g}: {len(shapes)} gradient tensors, {sum(sizes) / MIB:.1f} MiB per replica; "
         f"{sum(s <= 32 * 1024 for s in sizes)} of them <= 32 KiB, median {statistics.median(sizes) / 1024:.1f} KiB")
  rng = np.random.default_rng(0)
  replicated = jax.sharding.NamedSharding(strategy.mesh, jax.sharding.PartitionSpec())
  params = [tpustrat.Mirrored.from_global(jax.device_put(rng.standard_normal(s, dtype=np.float32), replicated))
            for s in shapes]
  scale = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(1 + ctx.replica_id_in_sync_group))
  t0 = time.perf_counter()
  variants = []
  for name, ops, options, compiler_options in variant_specs(args):
    t = time.perf_counter()
    variants.append(Variant(name, strategy, ops, options, params, scale, compiler_options))
    report(f"# {name:32s} compiled in {time.perf_counter() - t:5.1f} s: {variants[-1].collectives()}")
  reference = _first(variants[0]())
  for v in variants[1:]:
    for got, want in zip(_first(v()), reference):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"{v.name} differs from per tensor")
  report(f"# results allclose to per tensor; timing {args.trials} trials x {args.calls} steps per variant ...")
  times = bench(variants, args.trials, args.calls)
  base = times[variants[0].name]
  report(f"# total {time.perf_counter() - t0:.0f} s\n")
  report(h.markdown_header(["variant", "ms/step", "ratio to per tensor", "paired ratio, median [p25, p75]"],
                           right={"ms/step", "ratio to per tensor"}))
  for v in variants:
    a = times[v.name]
    report(h.markdown_row([v.name, f"{statistics.median(a) * 1e3:.1f}",
                           f"{statistics.median(a) / statistics.median(base):.2f}",
                           h.format_spread(h.spread(h.paired_ratios(a, base)), 2)]))
    if v.name == "agg small <=32 KiB x10":  # the default cross_device_ops
      h.figure(f"gradient packing: default (aggregate <= 32 KiB x 10) vs per tensor, ResNet-50 x{args.width:g} grads",
               f"{h.spread(h.paired_ratios(a, base))[0]:.2f}x")
  fastest = min(variants, key=lambda v: statistics.median(times[v.name]))
  report(f"\nfastest: {fastest.name}. ms/step: median over trials of the mean time per step (each waited for); "
         "paired ratio: per-round ratio to the per-tensor trial of the same round.")
  return times


if __name__ == "__main__":
  main(ARGS)
