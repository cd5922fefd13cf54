"""Memory of a training step per device, from the compiled programs: donation, and sharded state (FSDP).

Usage (from the repository root; the README's figures come from this command):

    python benchmarks/bench_sharding.py                 # the char transformer example, 4 layers, d_model 256
    python benchmarks/bench_sharding.py --layers 2 --d-model 64 --batch 16

The step is `examples/char_transformer.py`'s training step (AdamW, float32 state) under `strategy.run`
over N replicas, compiled three times: data parallel (Mirrored state) as is, and with
``RunOptions(donate_argnums=0)`` (the state's buffers hold the new state), and FSDP (its ``--shard`` step:
parameters of at least ``--shard-min-bytes`` and their AdamW state split over the replicas), donated. For each, XLA's `memory_analysis()` of the compiled program gives per-device bytes:
arguments, outputs, temporaries and the bytes of arguments aliased to outputs. The peak a step needs is
``arguments + outputs + temporaries - aliased``. Before the table, both programs run one step from the same
state and the script asserts that their new states are equal (allclose): donation changes memory, not
numbers.

Reported: state bytes per device, each program's figures, the ratio of the peaks (target <= 0.6:
without donation the old and the new state live at once), FSDP's arguments and peak against data
parallel's, and the collectives in each compiled program (all-gather / reduce-scatter / all-reduce). Memory figures are exact for the compiled
program (no timing), so one run suffices; they depend on XLA's buffer assignment for the platform (stated
in the machine line).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
  parser.add_argument("--d-model", type=int, default=256, help="model width")
  parser.add_argument("--seq-len", type=int, default=128, help="tokens per example")
  parser.add_argument("--batch", type=int, default=32, help="global batch (examples)")
  parser.add_argument("--shard-min-bytes", type=int, default=16 << 10,
                      help="FSDP: parameters of at least this many bytes are split over the replicas")
  parser.add_argument("--trials", type=int, default=7, help="rounds of step timing (0: memory figures only)")
  parser.add_argument("--steps", type=int, default=3, help="chained steps per timed trial")
  parser.add_argument("--large", action="store_true",
                      help="instead: train a model data parallel cannot hold here (24 layers x 1024 unless "
                           "--layers / --d-model say otherwise), FSDP with per-layer gathering")
  parser.add_argument("--large-steps", type=int, default=2, help="with --large: FSDP steps to run")


ARGS = h.parse_args(__doc__, add_flags) if __name__ == "__main__" else None
if ARGS is not None:
  h.emulate_cpu_devices(ARGS.cpu_devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import tpustrat  # noqa: E402


def memory(compiled) -> dict[str, int]:
  """Per-device bytes of a compiled program (XLA's `memory_analysis()`), and the peak a step needs."""
  m = compiled.memory_analysis()
  figures = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
             "temporaries": m.temp_size_in_bytes, "aliased": m.alias_size_in_bytes}
  figures["peak"] = figures["arguments"] + figures["outputs"] + figures["temporaries"] - figures["aliased"]
  return figures


def compiled_step(strategy: tpustrat.Strategy, step, args, options) -> object:
  """The compiled program `strategy.run(step, args, options=options)` dispatches (after one call)."""
  from tpustrat._src.engine import donated_leaves  # pylint: disable=import-outside-toplevel
  engine = strategy.extended.engine
  leaves, in_tree = jax.tree.flatten((tuple(args), {}))
  (program, targets), = [e for (k, t), e in engine._entries.items()  # pylint: disable=protected-access
                         if t == in_tree and (k() if callable(k) else k) is step]
  donate = options.donate_argnums if options is not None else ()
  if donate:
    program = program.donating(donated_leaves(donate, [jax.tree.structure(a).num_leaves for a in args], "bench"))
  placed = [engine._place(x, t) for x, t in zip(leaves, targets)]  # pylint: disable=protected-access
  return program._flat.lower(*placed).compile()  # pylint: disable=protected-access


class Variant:
  """A training step timed as a chain of steps: ``state = step(state)`` from a fresh ``init()``."""

  def __init__(self, name: str, init, step, finish) -> None:
    self.name, self._init, self._step, self._finish = name, init, step, finish

  def run(self, count: int) -> tuple[float, object]:
    return h.time_chain(self._init, self._step, count, self._finish)


def hand_written(ct, strategy: tpustrat.Strategy, graphdef, tx, host_state, global_batch: int,
                 partition=None, donate: bool = True):
  """The training step as JAX users write it by hand: one `jax.jit` over the global batch, the parameters
  and AdamW state placed with `NamedSharding`: split along the axes `partition` (`--shard`'s partitioner)
  names, FSDP by XLA's SPMD partitioner, or replicated (data parallel) without one. Returns (the state's
  shardings, the jitted step, the batch's sharding)."""
  from jax.sharding import NamedSharding  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mesh, axis_name = strategy.mesh, strategy.mesh.axis_names[0]
  replicated = NamedSharding(mesh, P())

  def spec(path, x):
    axis = None if partition is None else partition(tuple(path), np.shape(x), np.dtype(x.dtype))
    return replicated if axis is None else NamedSharding(mesh, P(*([None] * axis), axis_name))

  param_shardings = jax.tree_util.tree_map_with_path(spec, host_state["params"])
  opt_shardings = optax.tree_map_params(tx, lambda _, sharding: sharding, host_state["opt_state"],
                                        param_shardings, transform_non_params=lambda _: replicated)
  shardings = {"params": param_shardings, "opt_state": opt_shardings}
  loss_fn = ct.make_loss_fn(graphdef, global_batch)  # the whole global batch: its mean loss

  @functools.partial(jax.jit, out_shardings=(shardings, replicated), donate_argnums=0 if donate else ())
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    return ct.apply_gradients(tx, state, grads), loss

  return shardings, step, NamedSharding(mesh, P(axis_name))


def abstract(tree, shardings):
  """`jax.ShapeDtypeStruct`s of `tree` with `shardings`: to compile a program without placing its inputs."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.dtype(x.dtype), sharding=s), tree, shardings)


def hand_written_fsdp(ct, strategy: tpustrat.Strategy, graphdef, tx, host_state, global_batch: int,
                      min_bytes: int, host_batch: dict):
  """FSDP as JAX users write it by hand (`hand_written` with `--shard`'s partitioner), state donated.
  Returns (init, step, batch on the devices)."""
  shardings, step, batch_sharding = hand_written(ct, strategy, graphdef, tx, host_state, global_batch,
                                                 ct.fsdp_partitioner(min_bytes))
  return (lambda: jax.device_put(host_state, shardings)), step, jax.device_put(host_batch, batch_sharding)


def hand_written_donation(ct, strategy, graphdef, tx, host_state, host_batch, global_batch: int) -> float:
  """Peak of hand-written data parallel (`hand_written`, replicated) with the state donated vs without:
  what XLA itself gives on this platform, beside tpustrat's figure."""
  peaks = []
  for donate in (False, True):
    shardings, step, batch_sharding = hand_written(ct, strategy, graphdef, tx, host_state, global_batch,
                                                   donate=donate)
    batch = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding) for k, x in host_batch.items()}
    peaks.append(memory(step.lower(abstract(host_state, shardings), batch).compile())["peak"])
  return peaks[1] / peaks[0]


def large(args: argparse.Namespace) -> None:
  """A model data parallel cannot hold on this machine and FSDP trains: `--large-steps` steps of the
  transformer at `--layers` x `--d-model` (default 24 x 1024: about 300M parameters, 4.8 GB of float32
  AdamW state), with per-layer gathering; data parallel's per-device bytes from compiling its program
  only (never placed: 8 copies of the state would not fit)."""
  ct = h.load_example("char_transformer")
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  print(h.machine_line(n))
  config = ct.Config(seq_len=args.seq_len, layers=args.layers, d_model=args.d_model, heads=args.d_model // 64,
                     remat=True)
  t0 = time.perf_counter()
  graphdef, params = ct.make_model(config, seed=0)
  params = jax.device_get(params)  # on the host: no device keeps a whole copy
  tx = optax.chain(tpustrat.clip_by_global_norm(1.0), optax.adamw(1e-3))  # no warmup: every step moves
  n_params = sum(np.asarray(x).size for x in jax.tree.leaves(params))
  host_state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
  state_bytes = 16 * n_params  # float32 parameters, AdamW's two moments, and the new parameters' update
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(args.batch, args.seq_len + 1)).astype(np.int32)
  host_batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  _, dp_step, batch_sharding = hand_written(ct, strategy, graphdef, tx, host_state, args.batch)
  shardings = hand_written(ct, strategy, graphdef, tx, host_state, args.batch)[0]
  batch_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding), host_batch)
  dp = memory(dp_step.lower(abstract(host_state, shardings), batch_abstract).compile())
  print(f"# model: {args.layers} layers, d_model {args.d_model}, {n_params / 1e6:.1f}M parameters; global batch "
        f"{args.batch} x {args.seq_len}; made in {time.perf_counter() - t0:.0f} s")
  print(f"# data parallel (compiled, not run): {dp['arguments'] / 2**30:.2f} GiB of arguments and a peak of "
        f"{dp['peak'] / 2**30:.2f} GiB per device, {n * dp['peak'] / 2**30:.1f} GiB for the {n} devices")

  state = ct.sharded_state(strategy, params, tx, args.shard_min_bytes)
  del params
  step = ct.make_train_step(graphdef, tx, args.batch, sharded=True)
  batch = next(iter(strategy.experimental_distribute_dataset([host_batch])))
  donate = tpustrat.RunOptions(donate_argnums=0)
  compiled = None
  for i in range(args.large_steps):
    t = time.perf_counter()
    if compiled is None:
      state_for_compile = state
    state, loss = strategy.run(step, args=(state, batch), options=donate)
    loss = float(np.asarray(strategy.experimental_local_results(loss)[0]))
    print(f"# FSDP step {i + 1}: loss {loss:.4f}, {time.perf_counter() - t:.0f} s", flush=True)
    if compiled is None:
      del state_for_compile
      compiled = compiled_step(strategy, step, (state, batch), donate)
  fsdp = memory(compiled)
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
  print(f"# FSDP, per-layer gathering: {fsdp['arguments'] / 2**30:.2f} GiB of arguments and a peak of "
        f"{fsdp['peak'] / 2**30:.2f} GiB per device, {n * fsdp['peak'] / 2**30:.1f} GiB for the {n} devices; "
        f"this process's peak resident memory {rss / 2**30:.1f} GiB (the {n} emulated devices share it); "
        f"state {state_bytes / 2**30:.1f} GiB in all")
  print(f"# per device, FSDP vs data parallel: arguments {fsdp['arguments'] / dp['arguments']:.3f}, "
        f"peak {fsdp['peak'] / dp['peak']:.3f}")


def main(args: argparse.Namespace) -> None:
  ct = h.load_example("char_transformer")
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  print(h.machine_line(n))
  config = ct.Config(seq_len=args.seq_len, layers=args.layers, d_model=args.d_model, heads=4)
  graphdef, params = ct.make_model(config, seed=0)
  # The same model and parameters, its blocks rematerialised: the backward pass gathers each layer's
  # weights again (`tpustrat.gather_again_policy`) instead of keeping every gathered layer.
  remat_graphdef, _ = ct.make_model(dataclasses.replace(config, remat=True), seed=0)
  tx = ct.make_optimizer(1e-3, 10, 100)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(args.batch, args.seq_len + 1)).astype(np.int32)
  host_batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  batch = next(iter(strategy.experimental_distribute_dataset([host_batch])))
  host_state = jax.device_get(ct.init_state(params, tx))
  state_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(host_state))
  n_params = sum(np.asarray(x).size for x in jax.tree.leaves(host_state["params"]))

  donate = tpustrat.RunOptions(donate_argnums=0)
  min_bytes = args.shard_min_bytes

  def mirrored_state():
    return strategy.experimental_mirror(host_state)

  def fsdp_state():
    return ct.sharded_state(strategy, host_state["params"], tx, min_bytes)

  # (step, make the state, options): data parallel (Mirrored state), with and without donation and
  # remat, and FSDP (parameters and AdamW state split over the replicas), donated, without and with
  # per-layer gathering (remat).
  variants = {
      "data parallel": (ct.make_train_step(graphdef, tx, args.batch), mirrored_state, None),
      "data parallel, state donated": (ct.make_train_step(graphdef, tx, args.batch), mirrored_state, donate),
      "data parallel, remat, state donated": (ct.make_train_step(remat_graphdef, tx, args.batch), mirrored_state,
                                              donate),
      "FSDP, state donated": (ct.make_train_step(graphdef, tx, args.batch, sharded=True), fsdp_state, donate),
      "FSDP, per-layer gathering, donated": (ct.make_train_step(remat_graphdef, tx, args.batch, sharded=True),
                                             fsdp_state, donate)}
  results, figures, collectives = {}, {}, {}
  for name, (step, make, options) in variants.items():
    new_state, _ = strategy.run(step, args=(make(), batch), options=options)
    results[name] = [np.asarray(v) if isinstance(v, tpustrat.ShardedVariable) else np.asarray(v.values[0])
                     for v in jax.tree.leaves(new_state["params"], is_leaf=lambda v: isinstance(
                         v, tpustrat.DistributedValues))]
    compiled = compiled_step(strategy, step, (make(), batch), options)
    figures[name] = memory(compiled)
    hlo = compiled.as_text()
    collectives[name] = {op: hlo.count(f"{op}(") for op in ("all-gather", "reduce-scatter", "all-reduce")}
  hand_init, hand_step, hand_batch = hand_written_fsdp(ct, strategy, graphdef, tx, host_state, args.batch,
                                                       min_bytes, host_batch)
  results["hand-written FSDP"] = [np.asarray(x) for x in jax.tree.leaves(hand_step(hand_init(), hand_batch)[0]["params"])]
  for other in list(results)[1:]:
    for a, b in zip(results["data parallel"], results[other]):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=other)
  print("# new states allclose (donated vs not; FSDP vs data parallel; hand-written FSDP)")
  print(f"# model: {args.layers} layers, d_model {args.d_model}, {n_params / 1e6:.2f}M parameters; state "
        f"(parameters + AdamW) {state_bytes / 2**20:.1f} MiB on every device (Mirrored); global batch "
        f"{args.batch} x {args.seq_len}\n")
  mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
  print(h.markdown_header(["variant", "arguments MiB", "outputs MiB", "temporaries MiB", "aliased MiB",
                           "peak MiB", "peak vs data parallel", "all-gather / reduce-scatter / all-reduce"]))
  base = figures["data parallel"]["peak"]
  for name, f in figures.items():
    c = collectives[name]
    print(h.markdown_row([name, mib(f["arguments"]), mib(f["outputs"]), mib(f["temporaries"]), mib(f["aliased"]),
                          mib(f["peak"]), f"{f['peak'] / base:.3f}",
                          f"{c['all-gather']} / {c['reduce-scatter']} / {c['all-reduce']}"]))
  ratio = figures["data parallel, state donated"]["peak"] / base
  xla = hand_written_donation(ct, strategy, graphdef, tx, host_state, host_batch, args.batch)
  h.figure("donated state: peak memory vs not donated (char transformer, data parallel)", f"{ratio:.3f}x",
           "<= 0.6x", ratio <= 0.6)
  print(f"\n# peak with donation vs without (data parallel): {ratio:.3f} (target <= 0.6: "
        f"{('met' if ratio <= 0.6 else 'MISSED')}); hand-written jax.jit data parallel: {xla:.3f}")
  state = figures["FSDP, state donated"]["arguments"] / figures["data parallel"]["arguments"]
  h.figure("FSDP state per device vs data parallel (char transformer)", f"{state:.3f}x", "<= 0.15x", state <= 0.15)
  print(f"# FSDP arguments (state + batch) vs data parallel: {state:.3f} (target <= 0.15: "
        f"{('met' if state <= 0.15 else 'MISSED')})")
  h.figure("donated state, hand-written jax.jit data parallel (XLA's own figure)", f"{xla:.3f}x")
  for name in ("FSDP, state donated", "FSDP, per-layer gathering, donated"):
    peak = figures[name]["peak"] / base
    remat = figures[name]["peak"] / figures["data parallel, remat, state donated"]["peak"]
    layered = name == "FSDP, per-layer gathering, donated"  # the target assumes per-layer gathering
    h.figure(f"{name}: peak memory vs data parallel", f"{peak:.3f}x", "<= 0.35x" if layered else "",
             (peak <= 0.35) if layered else None)
    verdict = f"target <= 0.35: {'met' if peak <= 0.35 else 'MISSED'}" if layered else "no target without per-layer gathering"
    print(f"# {name}: peak vs data parallel {peak:.3f} ({verdict}); vs data parallel with the same remat, "
          f"donated: {remat:.3f}")
  if args.trials:
    time_steps(args, strategy, variants, batch, donate, hand_init, hand_step, hand_batch)


def time_steps(args, strategy, variants, batch, donate, hand_init, hand_step, hand_batch) -> None:
  """Step times, side by side in rounds (the machine is shared): data parallel, FSDP, FSDP with per-layer
  gathering, and hand-written FSDP (`hand_written_fsdp`), all donating the state."""

  def tpustrat_variant(name: str) -> Variant:
    step, make, _ = variants[name]
    return Variant(name, make, lambda s: strategy.run(step, args=(s, batch), options=donate)[0],
                   strategy.experimental_run_wait)

  timed = [tpustrat_variant(name) for name in ("data parallel, state donated", "FSDP, state donated",
                                                "FSDP, per-layer gathering, donated")]
  timed.append(Variant("hand-written FSDP", hand_init, lambda s: hand_step(s, hand_batch)[0], lambda: None))
  for v in timed:
    v.run(args.steps)  # warm-up (compiled above; this compiles nothing new)
  with h.no_compilation():
    times = h.time_rounds(timed, args.trials, h.permutation_schedule(timed),
                          lambda v: v.run(args.steps)[0] / args.steps * 1e3)
  print(f"\n# step time: {args.trials} rounds x {args.steps} chained steps per variant, order permuted per round\n")
  print(h.markdown_header(["variant", "ms/step", "throughput vs", "paired ratio, median [p25, p75]", "target"],
                          right={"ms/step"}))
  rows = [("data parallel, state donated", None, None),
          ("FSDP, state donated", "data parallel, state donated", 0.85),
          ("FSDP, per-layer gathering, donated", "data parallel, state donated", 0.85),
          ("FSDP, state donated", "hand-written FSDP", 0.95),
          ("hand-written FSDP", None, None)]
  for name, base, target in rows:
    if base is None:
      print(h.markdown_row([name, f"{statistics.median(times[name]):.1f}", "", "", ""]))
      continue
    paired = h.spread(h.paired_ratios(times[base], times[name]))  # throughput: base time / this time
    h.figure(f"{name}: step throughput vs {base}", f"{paired[0]:.3f}", f">= {target:.2f}", paired[0] >= target)
    print(h.markdown_row([name, f"{statistics.median(times[name]):.1f}", base, h.format_spread(paired, 3),
                          h.verdict(f">= {target:.2f}", paired[0] >= target)]))


if __name__ == "__main__":
  if ARGS.large:
    for flag, value in (("layers", 24), ("d_model", 1024), ("batch", 8)):
      if f"--{flag.replace('_', '-')}" not in sys.argv:
        setattr(ARGS, flag, value)
    large(ARGS)
  else:
    main(ARGS)
