"""An input-bound training loop fed through `experimental_distribute_dataset` vs. batches already on device.

What is measured
----------------
One training step, ``strategy.run(step, args=(params, batch))``: SGD (lr 0.1) on a softmax regression
``3072 -> 10`` (CIFAR-sized float32 images, ``[B, 32*32*3]``, int32 labels), global batch ``B = 512``
(64 per replica with 8), parameters `Mirrored` and fed back, loss ``psum``-ed. The model is kept small on
purpose so that the step is *input-bound*: every step consumes 6 MiB of fresh input, and the compute
per byte is low. ``--hidden H`` puts a ReLU layer of width H in between (``3072 -> H -> 10``) to raise the
compute per byte: transfers can only be hidden behind steps that take longer than they do, so on an
accelerator pick H such that the printed step time on device exceeds the printed transfer time.
The loops run the same number of steps over the same data, side by side:

* ``on device`` (the baseline): the batches were put on the devices before the clock starts (a list
  of `PerReplica` batches, cycled); the loop only calls `run`.
* ``iterator``: the batches are host numpy arrays (a Python list of ``{"x", "y"}`` dicts, cycled by a
  generator); each trial iterates ``strategy.experimental_distribute_dataset(...)`` from the start with
  the default `InputOptions` (or ``--buffer``), so it includes validation, the ``[B, ...] -> [N, B/N, ...]``
  reshape, one `jax.device_put` per batch and the per-step real-row counts input. The default buffer
  size depends on the platform: 0 on XLA:CPU (no thread: each batch is read and placed when the loop
  asks for it), 1 on GPU and TPU (a background prefetch thread keeps one batch ready, overlapping the
  previous steps); a comment line says which ran.
* ``iterator, prefetch thread`` / ``iterator, no thread`` (with ``--prefetch-row``): the other choice,
  explicitly (buffer 1 where the default has no thread, else 0).
* ``iterator, no prefetch`` (with ``--extra-rows``): ``InputOptions(experimental_fetch_to_device=False)``:
  the iterator yields host arrays and `run` transfers each batch when it is called.
* ``bare device_put`` (with ``--extra-rows``): no library input code at all: the loop itself reshapes
  each host batch and calls ``jax.device_put(..., NamedSharding(mesh, P('replica')))`` before `run`.
  This is the cost of the transfer alone on the machine: the floor for any input pipeline. (It lets
  XLA:CPU alias the 64-byte-aligned host batches instead of copying them, which the library does not do:
  a source may rewrite its buffers. See the README's "Input" section.)
* ``iterator, depth D`` (with ``--depths D ...``): the iterator with
  ``InputOptions(experimental_per_replica_buffer_size=D)``: a prefetch thread keeps the next ``D``
  batches' transfers in flight (placed or being placed on the devices) while the current step runs; 0 is
  no thread. This is the overlap mode: its ratio to ``on device`` is what the depth buys, for a step
  longer than the transfer (the printed ``alone`` line says whether it is; raise ``--hidden`` if not).
* ``on device + host copy`` and ``on device + put without copy`` (with ``--ceiling-rows``): the ``on
  device`` loop plus only one part of a transfer per step, to show what the machine allows. The first
  copies each host batch into library memory (``np.copyto`` into an aligned buffer: the copy that
  capturing a batch at hand-over takes, with no `device_put`); the second puts pre-copied, aligned,
  never-changing host memory on the devices (on XLA:CPU a transfer without any copy: the device buffers
  alias it). Where these rows are already below the target, no input pipeline that captures batches can
  reach it on that machine: their cost is CPU time (and memory bandwidth) the step needs too.

Methodology (as ``bench_run.py``)
---------------------------------
1. The loops are checked to give allclose parameters after a few steps.
2. Warm-up: each loop runs one full trial untimed.
3. ``--trials`` rounds; each round runs every loop for ``--steps`` steps from the same initial
   parameters, timed with ``time.perf_counter`` from before the first batch is requested until the last
   step's outputs are ready. The order within a round rotates through all permutations (more than three
   loops: through the rotations and their reverses, so that every loop runs in every position equally).
4. Reported: median us/step per loop; throughput relative to ``on device`` = median(on device) /
   median(loop) (1.0 = input costs nothing; target >= 0.95 for the default iterator and every
   ``--depths`` row, issue 45 item 4); the per-round paired ratios as median
   [p25, p75]; with ``--extra-rows`` also the paired ratio to ``bare device_put`` (target for the default
   iterator on XLA:CPU, where the transfer cannot be hidden: >= 0.95 of the bare loop).

Reproduce (repository root; 8 emulated CPU devices unless ``--cpu-devices`` says otherwise; pass
``--cpu-devices 0`` on a machine with accelerators)::

    .venv/bin/python benchmarks/bench_input.py
    .venv/bin/python benchmarks/bench_input.py --steps 40 --trials 21 --extra-rows --prefetch-row
    .venv/bin/python benchmarks/bench_input.py --steps 40 --trials 21 --buffer 2 --extra-rows
    .venv/bin/python benchmarks/bench_input.py --steps 24 --trials 15 --depths 0 1 2 4 --ceiling-rows
    .venv/bin/python benchmarks/bench_input.py --per-batch --trials 5 --cpu-devices 0   # host time per batch

On a 2-core machine with 8 emulated devices host-to-"device" transfers are memory copies that compete
with the step's compute for the same 2 cores; on a TPU or GPU host they use separate DMA engines.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--steps", type=int, default=32, help="steps per trial")
  parser.add_argument("--trials", type=int, default=21, help="timed trials per loop")
  parser.add_argument("--batch", type=int, default=512, help="global batch size")
  parser.add_argument("--features", type=int, default=32 * 32 * 3, help="input features per example")
  parser.add_argument("--distinct", type=int, default=8, help="distinct batches, cycled")
  parser.add_argument("--buffer", type=int, default=None,
                      help="InputOptions.experimental_per_replica_buffer_size (default: the library's)")
  parser.add_argument("--hidden", type=int, default=0,
                      help="width of a hidden ReLU layer (0: softmax regression, the input-bound default)")
  parser.add_argument("--extra-rows", action="store_true",
                      help="also time the iterator without fetch_to_device, and a bare jax.device_put loop")
  parser.add_argument("--prefetch-row", action="store_true",
                      help="also time the iterator with the other prefetch choice: a thread (buffer 1) where the "
                           "default buffer size has none, else no thread (buffer 0)")
  parser.add_argument("--depths", type=int, nargs="*", default=[],
                      help="also time the iterator at these prefetch depths "
                           "(InputOptions.experimental_per_replica_buffer_size; 0: no thread)")
  parser.add_argument("--per-batch", action="store_true",
                      help="instead: the host time of next(it) per batch over small batches (8 x 16 float32, "
                           "int32 labels), the transfer through tpustrat's cached batched put against "
                           "jax.make_array_from_callback per leaf, paired rounds")
  parser.add_argument("--ceiling-rows", action="store_true",
                      help="also time the on-device loop plus a host copy of each batch, and plus a put of "
                           "pre-copied aligned memory (no copy): what the machine allows a capturing pipeline")


ARGS = h.parse_args(__doc__, _add_flags) if __name__ == "__main__" else None
if ARGS is not None:
  h.emulate_cpu_devices(ARGS.cpu_devices)  # before JAX initialises its backends

import tpustrat  # noqa: E402
from tpustrat._src.host_memory import host_empty, owned_copy  # noqa: E402  # aligned host memory (ceiling rows)
from tpustrat._src.input.options import buffer_size  # noqa: E402  # the default's resolution, to name the row

CLASSES = 10
LR = 0.1
TARGET = 0.95  # throughput vs on device, for a step longer than the transfer (issue 45 item 4)
TARGET_VS_BARE = 0.95  # throughput vs the bare device_put loop (XLA:CPU, where they cannot)


def make_params(features: int, hidden: int) -> dict[str, np.ndarray]:
  """Zero weights for ``features -> 10``; with `hidden`, ``features -> hidden -> 10`` (small random first layer)."""
  if not hidden:
    return {"w": np.zeros((features, CLASSES), np.float32), "b": np.zeros((CLASSES,), np.float32)}
  rng = np.random.default_rng(1)
  return {"w1": (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32),
          "b1": np.zeros((hidden,), np.float32),
          "w": np.zeros((hidden, CLASSES), np.float32), "b": np.zeros((CLASSES,), np.float32)}


def make_step(global_batch: int) -> Callable[..., Any]:
  def step(params, batch):
    def loss_fn(p):
      h = batch["x"] if "w1" not in p else jax.nn.relu(batch["x"] @ p["w1"] + p["b1"])
      logits = h @ p["w"] + p["b"]
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1)[:, 0]
      return jnp.sum(jnp.where(tpustrat.valid_mask(batch["y"]), nll, 0.0)) / global_batch

    loss, grads = jax.value_and_grad(loss_fn)(params)  # summed over replicas (Mirrored params)
    params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return params, tpustrat.get_replica_context().all_reduce("sum", loss)

  return step


class Loop:
  """`steps` training steps from fresh parameters, over batches from `batches()`; returns seconds."""

  def __init__(self, name: str, strategy: tpustrat.Strategy, step: Callable[..., Any], params0: Any,
               batches: Callable[[int], Any]) -> None:
    self.name, self._strategy, self._step, self._params0, self._batches = name, strategy, step, params0, batches

  def run(self, steps: int) -> tuple[float, Any]:
    strategy = self._strategy
    params = strategy.run(lambda p: p, args=(self._params0,))  # Mirrored, on device
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    for batch in self._batches(steps):
      params, loss = strategy.run(self._step, args=(params, batch))
    jax.block_until_ready((params, loss))
    strategy.experimental_run_wait()
    return time.perf_counter() - t0, params


def _seconds(fn: Callable[[], Any]) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def per_batch(args: argparse.Namespace) -> int:
  """``--per-batch``: microseconds of host time per `next(it)` (the batch handed out, its transfer
  dispatched; not waited for) over a list of 2,000 small batches, with the transfer through
  `jax_compat.sharded_put` (the default) and through `jax.make_array_from_callback` per leaf."""
  from tpustrat._src import jax_compat  # noqa: PLC0415
  from tpustrat._src.input import staging  # noqa: PLC0415

  strategy = tpustrat.TPUStrategy()
  print(h.machine_line(strategy.num_replicas_in_sync))
  rng = np.random.default_rng(0)
  batches = [{"x": rng.standard_normal((8, 16)).astype(np.float32), "y": rng.integers(0, 10, 8).astype(np.int32)}
             for _ in range(2000)]
  dataset = strategy.experimental_distribute_dataset(batches)

  def public(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Callable[[Any], Any]:
    return lambda x: jax.make_array_from_callback(shape, sharding, x.__getitem__)

  class Variant:
    def __init__(self, name: str, make: Callable[..., Any]) -> None:
      self.name, self.make = name, make

    def measure(self) -> float:
      staging._PUTS.clear()  # noqa: SLF001
      made = jax_compat.sharded_put
      jax_compat.sharded_put = self.make
      try:
        it = iter(dataset)
        next(it)  # the first batch of a signature is checked in full: left out
        t0 = time.perf_counter()
        for b in it:
          last = b
        seconds = time.perf_counter() - t0
        jax.block_until_ready(last)
      finally:
        jax_compat.sharded_put = made
        staging._PUTS.clear()  # noqa: SLF001
      return seconds / (len(batches) - 1) * 1e6

  variants = [Variant("batched put", jax_compat.sharded_put), Variant("make_array_from_callback", public)]
  for v in variants:
    v.measure()
  times = h.time_rounds(variants, args.trials, h.permutation_schedule(variants), lambda v: v.measure())
  med = {k: statistics.median(t) for k, t in times.items()}
  ratio = h.spread(h.paired_ratios(times["make_array_from_callback"], times["batched put"]))
  print(f"# next(it) host time per batch: batched put {med['batched put']:.1f} us, "
        f"make_array_from_callback {med['make_array_from_callback']:.1f} us")
  h.figure("iterator per-batch host time, make_array_from_callback / batched put (8x16 float32 + int32)",
           h.format_spread(ratio, 2, "x"))
  return 0


def main(args: argparse.Namespace) -> int:
  if args.per_batch:
    return per_batch(args)
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  print(h.machine_line(n))
  rng = np.random.default_rng(0)
  host = [{"x": rng.standard_normal((args.batch, args.features)).astype(np.float32),
           "y": rng.integers(0, CLASSES, args.batch).astype(np.int32)} for _ in range(args.distinct)]
  mib = host[0]["x"].nbytes / 2**20
  params0 = make_params(args.features, args.hidden)
  step = make_step(args.batch)
  options = tpustrat.InputOptions() if args.buffer is None else tpustrat.InputOptions(
      experimental_per_replica_buffer_size=args.buffer)
  platform = strategy.mesh.devices.flat[0].platform
  buffer = buffer_size(options, platform)

  def host_stream(steps: int):
    return (host[i % len(host)] for i in range(steps))

  on_device = list(strategy.experimental_distribute_dataset(host, options=options))
  jax.block_until_ready(on_device)

  loops = [
      Loop("on device", strategy, step, params0,
           lambda steps: (on_device[i % len(on_device)] for i in range(steps))),
      Loop("iterator", strategy, step, params0,
           lambda steps: strategy.experimental_distribute_dataset(host_stream(steps), options=options)),
  ]
  if args.prefetch_row:
    other = 1 if buffer == 0 else 0
    other_options = tpustrat.InputOptions(experimental_per_replica_buffer_size=other)
    loops.append(Loop("iterator, prefetch thread" if other else "iterator, no thread", strategy, step, params0,
                      lambda steps: strategy.experimental_distribute_dataset(host_stream(steps), options=other_options)))
  if args.extra_rows:
    no_fetch = tpustrat.InputOptions(experimental_fetch_to_device=False)
    loops.append(Loop("iterator, no prefetch", strategy, step, params0,
                      lambda steps: strategy.experimental_distribute_dataset(host_stream(steps), options=no_fetch)))
    split = NamedSharding(strategy.mesh, P("replica"))
    valid = on_device[0]["x"].real_rows_array  # the real-row counts input the distributed batches carry (all full)

    def bare(steps: int):
      for batch in host_stream(steps):
        x, y = jax.device_put([batch["x"].reshape(n, -1, args.features), batch["y"].reshape(n, -1)], split)
        yield {"x": tpustrat.PerReplica.from_stacked(x, valid), "y": tpustrat.PerReplica.from_stacked(y, valid)}

    loops.append(Loop("bare device_put", strategy, step, params0, bare))
  for depth in args.depths:
    depth_options = tpustrat.InputOptions(experimental_per_replica_buffer_size=depth)
    loops.append(Loop(f"iterator, depth {depth}", strategy, step, params0,
                      lambda steps, o=depth_options: strategy.experimental_distribute_dataset(host_stream(steps),
                                                                                                options=o)))
  if args.ceiling_rows:
    split = NamedSharding(strategy.mesh, P("replica"))
    scratch = [host_empty(host[0]["x"].shape, np.float32) for _ in range(2)]

    def host_copy(steps: int):  # the capture copy alone: no transfer (the batch is already on device)
      for i in range(steps):
        np.copyto(scratch[i % 2], host[i % len(host)]["x"])
        yield on_device[i % len(on_device)]

    staged = [(owned_copy(b["x"].reshape(n, -1, args.features)), owned_copy(b["y"].reshape(n, -1))) for b in host]
    valid_counts = on_device[0]["x"].real_rows_array

    def put_no_copy(steps: int):  # a transfer without any copy (XLA:CPU aliases aligned host memory)
      for i in range(steps):
        x, y = jax.device_put(list(staged[i % len(staged)]), split)
        yield {"x": tpustrat.PerReplica.from_stacked(x, valid_counts),
               "y": tpustrat.PerReplica.from_stacked(y, valid_counts)}

    loops.append(Loop("on device + host copy", strategy, step, params0, host_copy))
    loops.append(Loop("on device + put without copy", strategy, step, params0, put_no_copy))

  ref = loops[0].run(3)[1]
  for loop in loops[1:]:
    got = loop.run(3)[1]
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  print(f"# results allclose; batch {args.batch} x {args.features} float32 ({mib:.1f} MiB) + labels, "
        f"{args.trials} trials x {args.steps} steps per loop, buffer {buffer} "
        f"({'the default' if args.buffer is None else '--buffer'} on {platform}: "
        f"{'no prefetch thread' if buffer == 0 else 'a prefetch thread'}) ...", flush=True)

  for loop in loops:
    loop.run(args.steps)  # warm-up
  split = NamedSharding(strategy.mesh, P("replica"))
  x0 = host[1]["x"].reshape(n, -1, args.features)
  transfer = statistics.median(_seconds(lambda: jax.device_put(x0, split).block_until_ready()) for _ in range(50))
  step_time = statistics.median(loops[0].run(args.steps)[0] / args.steps for _ in range(3))
  print(f"# alone: one batch's transfer (device_put + wait) {transfer * 1e6:.0f} us; one step on device "
        f"{step_time * 1e6:.0f} us (ratio {step_time / transfer:.1f}; a transfer can hide behind a longer step)")
  order = h.permutation_schedule(loops) if len(loops) <= 3 else h.rotation_schedule(loops)
  t_start = time.perf_counter()
  times = h.time_rounds(loops, args.trials, order, lambda loop: loop.run(args.steps)[0] / args.steps * 1e6)
  print(f"# timing took {time.perf_counter() - t_start:.0f} s")
  print()
  base = times["on device"]
  bare = times.get("bare device_put")
  columns = ["loop", "us/step (median)", "MiB/s of input", "throughput vs on device", "paired, median [p25, p75]",
             "target"]
  if bare is not None:
    columns[5:5] = ["vs bare device_put, paired [p25, p75]", f"target vs bare ({platform})"]
  print(h.markdown_header(columns, right={"us/step (median)", "MiB/s of input", "throughput vs on device"}))
  for loop in loops:
    t = times[loop.name]
    paired = h.spread(h.paired_ratios(base, t))
    rel = statistics.median(base) / statistics.median(t)
    judged = loop.name == "iterator" or loop.name.startswith("iterator, depth")
    verdict = "baseline" if loop.name == "on device" else (
        h.verdict(f">= {TARGET}", paired[0] >= TARGET) if judged else "")
    if loop.name == "iterator":
      h.figure("input-bound loop: distributed iterator throughput vs batches on device", f"{paired[0]:.3f}",
               f">= {TARGET}", paired[0] >= TARGET)
    elif judged:
      h.figure(f"input loop: distributed iterator at prefetch {loop.name[len('iterator, '):]} vs batches on device",
               f"{paired[0]:.3f}", f">= {TARGET}", paired[0] >= TARGET)
    row = [loop.name, f"{statistics.median(t):.0f}", f"{mib / (statistics.median(t) * 1e-6):.0f}", f"{rel:.3f}",
           h.format_spread(paired, 3), verdict]
    if bare is not None:
      vs_bare = h.spread(h.paired_ratios(bare, t))
      row[5:5] = [h.format_spread(vs_bare, 3), h.verdict(f">= {TARGET_VS_BARE}", vs_bare[0] >= TARGET_VS_BARE)
                  if loop.name == "iterator" and platform == "cpu" and args.buffer is None else ""]
      if loop.name == "iterator" and platform == "cpu" and args.buffer is None:
        h.figure("input-bound loop: distributed iterator vs bare jax.device_put loop", f"{vs_bare[0]:.3f}",
                 f">= {TARGET_VS_BARE}", vs_bare[0] >= TARGET_VS_BARE)
    print(h.markdown_row(row))
  print()
  print("throughput vs on device: median us/step of `on device` / median us/step of the loop (1.0: input is "
        "free). paired: the same ratio per round. vs bare device_put: the paired ratio to the loop without "
        "library input code (1.0: the library adds nothing to the transfer). targets: checked on the paired "
        "medians.")
  return 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
