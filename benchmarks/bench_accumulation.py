"""Gradient accumulation in one program (`tpustrat.accumulate_gradients`): memory and step time against k = 1.

Usage (from the repository root; the README's figures come from these commands):

    python benchmarks/bench_accumulation.py                       # MLP, 4 layers of 256, 2048 rows per replica
    python benchmarks/bench_accumulation.py --model transformer   # the char transformer example, big batch
    python benchmarks/bench_accumulation.py --trials 0            # memory only (compiles, runs one step per k)

The step is a training step under `strategy.run` over N replicas (8 emulated CPU devices by default) whose
gradients come from ``tpustrat.accumulate_gradients(loss_fn, params, batch, gradient_accumulation_steps=k)``
for each k of ``--ks`` (k = 1: one forward and backward pass on the whole per-replica batch, no scan): an
activation-heavy model, a big batch and small parameters. ``mlp``: ``--layers`` tanh layers of ``--width``
units, squared error / global batch, SGD. ``transformer``: `examples/char_transformer.py`'s model and loss
(``--layers``, ``--d-model``, ``--seq-len``), AdamW, float32.

First the script asserts that every k's loss and gradients equal k = 1's (allclose, rtol 1e-5, atol 1e-5
of the largest gradient entry: the same numbers as the big batch). Then, per k, XLA's `memory_analysis()` of the
compiled step (the step compiled inside `jax.jit`) gives per-device bytes: temporaries (target at k = 4:
<= 0.4x k = 1's), arguments, outputs, and the peak ``arguments + outputs + temporaries``; and the compiled
HLO's all-reduces and reduce-scatters, with how many of them sit inside a loop (0: the gradients are
communicated once, after the accumulation). Memory figures are exact for the compiled program (no timing),
so one run suffices; they depend on XLA's buffer assignment for the platform (stated in the machine line).
Last, with ``--trials`` > 0, step times, every k once per round in a permuted order, as paired ratios to k = 1
(for information: on CPU, k micro-batches of 1/k the rows cost about the same arithmetic).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp", help="which model's step")
  parser.add_argument("--ks", default="1,2,4,8", help="gradient_accumulation_steps to compare (1 first)")
  parser.add_argument("--rows", type=int, default=None,
                      help="rows (examples) per replica (default: mlp 2048, transformer 32)")
  parser.add_argument("--layers", type=int, default=4, help="mlp / transformer layers")
  parser.add_argument("--width", type=int, default=256, help="mlp: units per layer")
  parser.add_argument("--d-model", type=int, default=64, help="transformer: model width")
  parser.add_argument("--seq-len", type=int, default=128, help="transformer: tokens per example")
  parser.add_argument("--trials", type=int, default=5, help="rounds of step timing (0: memory figures only)")
  parser.add_argument("--steps", type=int, default=2, help="chained steps per timed trial")


ARGS = h.parse_args(__doc__, add_flags) if __name__ == "__main__" else None
if ARGS is not None:
  h.emulate_cpu_devices(ARGS.cpu_devices)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import tpustrat  # noqa: E402

TARGET = 0.4  # temporaries at k = 4 over k = 1's


def mlp_model(args: argparse.Namespace, global_batch: int):
  """(description, parameters, host batch, loss_fn, optimizer) of the MLP."""
  rng = np.random.default_rng(0)
  w = args.width
  params = {f"layer{i}": {"w": (rng.normal(size=(w, w)) / np.sqrt(w)).astype(np.float32),
                          "b": np.zeros(w, np.float32)} for i in range(args.layers)}
  batch = {"x": rng.normal(size=(global_batch, w)).astype(np.float32),
           "y": rng.normal(size=(global_batch, w)).astype(np.float32)}

  def loss_fn(p, b):
    x = b["x"]
    for i in range(args.layers):
      x = jnp.tanh(x @ p[f"layer{i}"]["w"] + p[f"layer{i}"]["b"])
    return jnp.sum((x - b["y"]) ** 2) / global_batch

  return f"MLP {args.layers} x {w}", params, batch, loss_fn, optax.sgd(1e-2)


def transformer_model(args: argparse.Namespace, global_batch: int):
  """(description, parameters, host batch, loss_fn, optimizer) of the char transformer example."""
  ct = h.load_example("char_transformer")
  config = ct.Config(seq_len=args.seq_len, layers=args.layers, d_model=args.d_model, heads=4)
  graphdef, params = ct.make_model(config, seed=0)
  tokens = np.random.default_rng(0).integers(0, 256, size=(global_batch, args.seq_len + 1)).astype(np.int32)
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  return (f"char transformer {args.layers} x {args.d_model}, seq {args.seq_len}", jax.device_get(params), batch,
          ct.make_loss_fn(graphdef, global_batch), optax.adamw(1e-3))


def make_step(loss_fn, tx, k: int):
  def step(state, batch):
    loss, grads = tpustrat.accumulate_gradients(loss_fn, state["params"], batch, gradient_accumulation_steps=k)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss
  return step


def collectives(hlo: str) -> tuple[int, int, int]:
  """(all-reduces, reduce-scatters, collectives inside a loop body) of a compiled program's HLO text."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  in_loops, current = 0, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      current = head.group(1)
    elif current in bodies and re.search(r"(all-reduce|reduce-scatter|all-gather)(-start)?\(", line):
      in_loops += 1
  count = lambda op: len(re.findall(rf"\b{op}(-start)?\(", hlo))  # noqa: E731
  return count("all-reduce"), count("reduce-scatter"), in_loops


def main(args: argparse.Namespace) -> None:
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  print(h.machine_line(n))
  ks = [int(k) for k in args.ks.split(",")]
  assert ks[0] == 1, "--ks must start with 1 (the baseline)"
  rows = args.rows or (2048 if args.model == "mlp" else 32)
  global_batch = rows * n
  name, params, host_batch, loss_fn, tx = (mlp_model if args.model == "mlp" else transformer_model)(args, global_batch)
  host_state = {"params": params, "opt": jax.device_get(tx.init(params))}
  n_params = sum(np.asarray(x).size for x in jax.tree.leaves(params))
  batch = next(iter(strategy.experimental_distribute_dataset([host_batch])))
  steps = {k: make_step(loss_fn, tx, k) for k in ks}

  grads = {}  # the numbers: loss and gradients of every k against k = 1's (Adam would magnify the rounding
  for k in ks:  # of gradients that are zero in theory, e.g. of attention's key bias, into whole updates)
    loss, g = strategy.run(lambda p, b, k=k: tpustrat.accumulate_gradients(loss_fn, p, b, gradient_accumulation_steps=k),
                           args=(strategy.experimental_mirror(params), batch))
    grads[k] = [float(strategy.reduce("SUM", loss, axis=None))] + [np.asarray(v.values[0]) for v in jax.tree.leaves(
        g, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))]
  scale = max(np.abs(x).max() for x in grads[1][1:])
  for k in ks[1:]:
    np.testing.assert_allclose(grads[k][0], grads[1][0], rtol=1e-5, err_msg=f"loss, k={k}")
    for a, b in zip(grads[1][1:], grads[k][1:]):
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale, err_msg=f"k={k}")
  print(f"# loss and gradients allclose to k=1's (k = {', '.join(map(str, ks[1:]))})")
  print(f"# model: {name}, {n_params / 1e6:.2f}M parameters; global batch {global_batch} ({rows} rows per "
        f"replica, micro-batches of {rows} / k)\n")

  figures = {}
  for k in ks:
    compiled = jax.jit(lambda s, b, k=k: strategy.run(steps[k], args=(s, b))).lower(
        strategy.experimental_mirror(host_state), batch).compile()
    m = compiled.memory_analysis()
    figures[k] = (m.temp_size_in_bytes, m.argument_size_in_bytes, m.output_size_in_bytes,
                  collectives(compiled.as_text()))
  mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
  print(h.markdown_header(["model", "k", "temporaries MiB", "vs k=1", "arguments MiB", "outputs MiB", "peak MiB",
                           "all-reduce / reduce-scatter (in a loop)", "target"],
                          right={"temporaries MiB", "vs k=1", "arguments MiB", "outputs MiB", "peak MiB"}))
  base = figures[1][0]
  for k in ks:
    temps, arguments, outputs, (ar, rs, in_loops) = figures[k]
    target = h.verdict(f"<= {TARGET}", temps <= TARGET * base) if k == 4 else ""
    if k == 4:
      h.figure(f"accumulate_gradients k=4 temporaries vs k=1 ({name.split(',')[0]})", f"{temps / base:.3f}x",
               f"<= {TARGET}x", temps <= TARGET * base)
    print(h.markdown_row([name, k, mib(temps), f"{temps / base:.3f}", mib(arguments), mib(outputs),
                          mib(arguments + outputs + temps), f"{ar} / {rs} ({in_loops})", target]))
  if args.trials:
    time_steps(args, strategy, name, steps, host_state, batch)


class Variant:
  """A training step timed as a chain of steps: ``state = step(state)`` from the same initial state."""

  def __init__(self, name: str, run_chain) -> None:
    self.name, self.run = name, run_chain


def time_steps(args, strategy, name, steps, host_state, batch) -> None:
  def variant(k):
    step = steps[k]
    return Variant(str(k), lambda count: h.time_chain(
        lambda: strategy.experimental_mirror(host_state), lambda s: strategy.run(step, args=(s, batch))[0], count,
        strategy.experimental_run_wait)[0])

  timed = [variant(k) for k in steps]
  for v in timed:
    v.run(1)  # warm-up (compiled above; this compiles nothing new)
  with h.no_compilation():
    times = h.time_rounds(timed, args.trials, h.permutation_schedule(timed), lambda v: v.run(args.steps) / args.steps * 1e3)
  print(f"\n# step time: {args.trials} rounds x {args.steps} chained steps per k, order permuted per round\n")
  print(h.markdown_header(["model", "k", "ms/step", "time vs k=1, median [p25, p75]"], right={"ms/step"}))
  for k in steps:
    ratio = h.spread(h.paired_ratios(times[str(k)], times["1"]))
    print(h.markdown_row([name, k, f"{statistics.median(times[str(k)]):.1f}", h.format_spread(ratio, 3)]))


if __name__ == "__main__":
  main(ARGS)
