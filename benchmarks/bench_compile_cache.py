"""Time to first step with JAX's persistent compilation cache: a second start against the first.

What is measured
----------------
The char transformer example's training (`examples/char_transformer.py`: its model, AdamW optimizer,
training step and grain pipeline; default sizes: 3 layers, d_model 128, 128 bytes x 64 sequences per
global batch) is started twice, each time in a fresh Python process, both with the same compilation cache
directory, empty before the first (`tpustrat.experimental.enable_compilation_cache`, as ``python -m
tpustrat.launch --compilation-cache DIR`` gives every restart); ``--pairs`` such pairs (default 3), each
on a fresh cache. Each start times:

* ``process``: from just before the parent starts the process until the first training step's loss is on
  the host: interpreter, imports, data, model, tracing, compilation (or the cache's load) and one step of
  ``--steps-per-program`` steps (`experimental_run_steps`, as the example runs it). This is what a restart
  waits for.
* ``after imports``: the same from the moment the imports are done (strategy, data, model, programs).
* the compilations JAX made and the cache's hits and misses (`jax.monitoring` events), and the cache's
  files.

Reported: each start's times, and second / first of both, median over the pairs [min, max] (target for
the process: <= 0.4x). The second start must compile nothing its cache does not hold (the script asserts
it: every compile request of the second start is a cache hit), and both must compute the same first loss.
Timings on a shared 2-core machine vary by tens of percent from start to start: hence the pairs.

Reproduce (from the repository root; ``--cpu-devices`` emulated CPU devices, 8 by default; on a GPU or TPU
machine the accelerators)::

    .venv/bin/python benchmarks/bench_compile_cache.py              # the example's sizes, about 1 min here (3 pairs)
    .venv/bin/python benchmarks/bench_compile_cache.py --layers 1 --d-model 32 --seq-len 16 --batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGET = 0.4  # second start's time to first step / first start's


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--pairs", type=int, default=3, help="pairs of starts (first, second), each on a fresh cache")
  parser.add_argument("--layers", type=int, default=3, help="transformer blocks (the example's default)")
  parser.add_argument("--d-model", type=int, default=128, help="model width")
  parser.add_argument("--heads", type=int, default=4, help="attention heads")
  parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
  parser.add_argument("--batch", type=int, default=64, help="global batch (sequences)")
  parser.add_argument("--steps-per-program", type=int, default=1, help="steps of the first program")
  parser.add_argument("--max-files", type=int, default=200, help="standard-library files read (data)")
  parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)  # a start's cache (internal)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one start (internal)


def child(args: argparse.Namespace) -> None:
  """One start: the example's training up to its first step's loss; prints ``RESULT {json}``."""
  after_imports = time.time()
  events: dict[str, int] = {}
  import jax  # pylint: disable=import-outside-toplevel

  def count(event: str, **kwargs) -> None:
    del kwargs
    if event.startswith("/jax/compilation_cache/"):
      events[event.rsplit("/", 1)[1]] = events.get(event.rsplit("/", 1)[1], 0) + 1

  compiles = [0]

  def count_compiles(event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event.endswith("backend_compile_duration"):
      compiles[0] += 1

  jax.monitoring.register_event_listener(count)
  jax.monitoring.register_event_duration_secs_listener(count_compiles)
  import importlib.util  # pylint: disable=import-outside-toplevel

  import numpy as np  # pylint: disable=import-outside-toplevel

  import tpustrat  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("char_transformer_example", ROOT / "examples" / "char_transformer.py")
  ct = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = ct
  spec.loader.exec_module(ct)
  after_imports = time.time()

  tpustrat.experimental.enable_compilation_cache(args.cache_dir)
  strategy = tpustrat.TPUStrategy()
  config = ct.Config(seq_len=args.seq_len, layers=args.layers, d_model=args.d_model, heads=args.heads)
  train_files, _ = ct.split_files(ct.stdlib_files(args.max_files))
  train_ds = ct.train_dataset(ct.read_bytes(train_files), args.seq_len, args.batch, 0)
  graphdef, params = ct.make_model(config, 0)
  tx = ct.make_optimizer(3e-3, 30, 300)
  state = strategy.experimental_mirror(ct.init_state(params, tx))
  train_step = ct.make_train_step(graphdef, tx, args.batch)
  iterator = iter(strategy.experimental_distribute_dataset(train_ds))
  state, out = strategy.experimental_run_steps(train_step, iterator, args.steps_per_program, init=state,
                                               options=tpustrat.RunOptions(donate_argnums=0))
  loss = float(np.asarray(strategy.experimental_local_results(out)[0])[-1])
  first_step = time.time()
  print("RESULT " + json.dumps({
      "after_imports": after_imports, "first_step": first_step, "loss": loss, "compiles": compiles[0],
      "hits": events.get("cache_hits", 0), "misses": events.get("cache_misses", 0),
      "requests": events.get("compile_requests_use_cache", 0), "replicas": strategy.num_replicas_in_sync,
      "machine": h.machine_line(strategy.num_replicas_in_sync)}), flush=True)
  iterator.close()


def start(args: argparse.Namespace, cache_dir: str) -> dict:
  """One fresh process of `child`; its result with ``process`` / ``after imports`` seconds."""
  argv = [sys.executable, os.path.abspath(__file__), "--child", "--cache-dir", cache_dir,
          "--cpu-devices", str(args.cpu_devices)]
  for flag in ("layers", "d_model", "heads", "seq_len", "batch", "steps_per_program", "max_files"):
    argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
  env = {k: v for k, v in os.environ.items() if k != "TPUSTRAT_COMPILATION_CACHE_DIR"}
  t0 = time.time()
  out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise SystemExit(f"a start failed (status {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
  result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
  result["process_s"] = result["first_step"] - t0
  result["imports_s"] = result["after_imports"] - t0
  result["after_imports_s"] = result["first_step"] - result["after_imports"]
  result["files"] = sum(len(files) for _, _, files in os.walk(cache_dir))
  return result


def main(args: argparse.Namespace) -> None:
  if args.pairs < 1:
    raise SystemExit("--pairs must be >= 1")
  pairs = []
  for _ in range(args.pairs):  # each pair: a fresh empty cache, a first start on it, then a second
    with tempfile.TemporaryDirectory(prefix="tpustrat-compile-cache-") as cache_dir:
      pairs.append((start(args, cache_dir), start(args, cache_dir)))
  print(pairs[0][0]["machine"])
  print(f"# char transformer: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, global batch "
        f"{args.batch} x {args.seq_len} bytes, first program {args.steps_per_program} step(s); {args.pairs} pair(s) "
        "of fresh processes, each pair on a fresh cache")
  for first, second in pairs:
    assert abs(first["loss"] - second["loss"]) <= 1e-5 * max(1.0, abs(first["loss"])), (first["loss"], second["loss"])
    assert first["misses"] > 0 and first["files"] > 0, "the first start wrote nothing to the cache"
    assert second["misses"] == 0 and second["hits"] == second["requests"] > 0, (
        f"the second start compiled programs the cache did not hold: {second['misses']} misses, "
        f"{second['hits']} hits")
  print(f"# the same first loss ({pairs[0][0]['loss']:.6f}) at both starts; all of the second starts' "
        f"{pairs[0][1]['requests']} compile requests were cache hits\n")
  print(h.markdown_header(["pair", "start", "process to first step s", "imports s", "after imports s",
                           "cache hits / misses", "cache files"],
                          right={"process to first step s", "imports s", "after imports s"}))
  for i, pair in enumerate(pairs):
    for which, r in zip(("first (empty cache)", "second"), pair):
      print(h.markdown_row([i + 1, which, f"{r['process_s']:.2f}", f"{r['imports_s']:.2f}",
                            f"{r['after_imports_s']:.2f}", f"{r['hits']} / {r['misses']}", r["files"]]))
  ratios = [b["process_s"] / a["process_s"] for a, b in pairs]
  after = [b["after_imports_s"] / a["after_imports_s"] for a, b in pairs]
  ratio = statistics.median(ratios)
  print(f"\n# second / first start, time to first step, median over {len(pairs)} pair(s): {ratio:.3f} "
        f"[{min(ratios):.3f}, {max(ratios):.3f}] (target <= {TARGET}: {'met' if ratio <= TARGET else 'MISSED'}); "
        f"after imports: {statistics.median(after):.3f} [{min(after):.3f}, {max(after):.3f}]")
  h.figure("compilation cache: 2nd / 1st start, time to first step (char transformer)", f"{ratio:.3f}x",
           f"<= {TARGET}x", ratio <= TARGET)
  h.figure("compilation cache: 2nd / 1st start, after imports", f"{statistics.median(after):.3f}x")


if __name__ == "__main__":
  ARGS = h.parse_args(__doc__, add_flags)
  if ARGS.child:
    h.emulate_cpu_devices(ARGS.cpu_devices)
    child(ARGS)
  else:
    main(ARGS)
