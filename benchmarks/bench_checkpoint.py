"""The first save of a `Mirrored` state against a later one (issue 45, item 5).

What is measured
----------------
A `tpustrat.checkpoint.CheckpointManager` saves a `Mirrored` state of the char transformer's shapes
(`examples/char_transformer.py`'s defaults: 3 layers, d_model 128, 128 positions, a vocabulary of 256; its
parameters and AdamW's two moments, about 2.0 M float32 values in 3 x 42 arrays) ``--saves`` times, each
a synchronous save to local disk (``wait_until_finished`` included), in a fresh Python process per trial:
the first save of a process is the one that used to stall (orbax's replica-parallel save compiled a slice
program per array shape and device, and the checksums a program per set of shapes). Reported per trial:
the first save's time, the median of the later ones, their ratio (target: <= 2) and the XLA compilations
of the first save (`jax.monitoring`'s backend compile events; target: 0). Median over ``--trials`` [25th,
75th percentiles]. A shared 2-core machine's times vary by tens of percent from process to process.

Reproduce (from the repository root; 8 emulated CPU devices by default)::

    .venv/bin/python benchmarks/bench_checkpoint.py                 # 3 trials, about 30 s here
    .venv/bin/python benchmarks/bench_checkpoint.py --layers 1 --d-model 32 --trials 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

TARGET = 2.0  # first save / a later save


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--layers", type=int, default=3, help="transformer blocks (the example's default)")
  parser.add_argument("--d-model", type=int, default=128, help="model width")
  parser.add_argument("--seq-len", type=int, default=128, help="positions")
  parser.add_argument("--saves", type=int, default=5, help="saves per process (the first and the later ones)")
  parser.add_argument("--trials", type=int, default=3, help="processes")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one trial (internal)


def shapes(layers: int, d: int, seq_len: int) -> list[tuple[int, ...]]:
  """The char transformer's parameter shapes (embeddings, per block: LayerNorms, attention, MLP; head)."""
  block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
  return [(256, d), (seq_len, d), *block * layers, (d,), (d,), (d, 256), (256,)]


def child(args: argparse.Namespace) -> None:
  import tpustrat  # pylint: disable=import-outside-toplevel
  from tpustrat.checkpoint import CheckpointManager  # pylint: disable=import-outside-toplevel

  compiles = [0]

  def listener(event: str, duration: float, **kwargs: object) -> None:
    del duration, kwargs
    if event.endswith("backend_compile_duration"):
      compiles[0] += 1

  strategy = tpustrat.MirroredStrategy()
  rng = np.random.default_rng(0)
  params = [rng.normal(size=s).astype(np.float32) for s in shapes(args.layers, args.d_model, args.seq_len)]
  state = {kind: {str(i): strategy.experimental_mirror(p if kind == "params" else np.abs(p) * 0.1)
                  for i, p in enumerate(params)} for kind in ("params", "mu", "nu")}
  jax.block_until_ready(state)
  jax.monitoring.register_event_duration_secs_listener(listener)
  times, first_compiles = [], 0
  with tempfile.TemporaryDirectory() as d, CheckpointManager(d, strategy, enable_async_checkpointing=False) as m:
    for step in range(args.saves):
      start = time.perf_counter()
      m.save(step, state)
      m.wait_until_finished()
      times.append(time.perf_counter() - start)
      if step == 0:
        first_compiles = compiles[0]
  print(json.dumps({"times": times, "compiles": first_compiles,
                    "values": sum(p.size for p in params) * 3, "arrays": len(params) * 3}))


def main(args: argparse.Namespace) -> None:
  print(h.machine_line(len(jax.devices())))
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  print(f"# orbax-checkpoint {ocp.__version__}")
  command = [sys.executable, os.path.abspath(__file__), "--child", "--cpu-devices", str(args.cpu_devices),
             "--layers", str(args.layers), "--d-model", str(args.d_model), "--seq-len", str(args.seq_len),
             "--saves", str(args.saves)]
  rows = []
  for _ in range(args.trials):
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
      raise SystemExit(f"a trial failed:\n{proc.stderr[-4000:]}")
    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  first = [r["times"][0] for r in rows]
  later = [statistics.median(r["times"][1:]) for r in rows]
  ratios = [f / l for f, l in zip(first, later)]
  compiles = max(r["compiles"] for r in rows)
  print(f"# {rows[0]['arrays']} Mirrored arrays, {rows[0]['values'] / 1e6:.2f} M float32 values, "
        f"{args.saves} saves per process, {args.trials} processes")
  print(h.markdown_header(["figure", "median [p25, p75]"], right={"median [p25, p75]"}))
  print(h.markdown_row(["first save", h.format_spread(h.spread([t * 1e3 for t in first]), 1, " ms")]))
  print(h.markdown_row(["later save (median of a process's)", h.format_spread(h.spread([t * 1e3 for t in later]),
                                                                              1, " ms")]))
  print(h.markdown_row(["first / later", h.format_spread(h.spread(ratios), 2, "x")]))
  print(h.markdown_row(["compilations in the first save (most of any process)", compiles]))
  h.figure("first save / later save, Mirrored state", f"{statistics.median(ratios):.2f}x", f"<= {TARGET:g}",
           statistics.median(ratios) <= TARGET)
  h.figure("compilations in the first save", str(compiles), "0", compiles == 0)


if __name__ == "__main__":
  ARGS = h.parse_args(__doc__, add_flags)
  h.emulate_cpu_devices(ARGS.cpu_devices)
  child(ARGS) if ARGS.child else main(ARGS)  # pylint: disable=expression-not-assigned
