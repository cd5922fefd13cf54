"""Hybrid sharding across processes: bytes sent between processes per step, state per device, step time.

Usage (from the repository root; docs/benchmarks.md's figures come from the first command):

    python benchmarks/bench_hybrid.py                          # 2 processes x 4 CPU devices, on loopback
    python benchmarks/bench_hybrid.py --layers 1 --d-model 32 --seq-len 16 --batch 8 --trials 0   # smoke

The script starts ``python -m tpustrat.launch -n PROCESSES -d DEVICES`` on itself (``--worker``); every
process runs the same variants, process 0 reports. The step is `examples/char_transformer.py`'s training
step (AdamW with `tpustrat.clip_by_global_norm`, float32), one global batch, in seven variants:

* tpustrat: data parallel (`Mirrored` state), full FSDP (``--shard``'s partitioner: parameters of at least
  ``--shard-min-bytes`` split over all 8 replicas, with their AdamW state) and hybrid (the same leaves split
  within each process's 4 replicas, ``experimental_shard(..., groups="process")``, replicated across
  processes);
* hand-written `jax.jit` over the global batch, with the state placed by `NamedSharding` (split along the
  same axes) and the batch split over the devices: *naive* (nothing else: XLA's SPMD partitioner chooses
  every intermediate layout, which is `bench_sharding.py`'s "hand-written FSDP") and *expert*
  (`jax.lax.with_sharding_constraint` of the activations to the batch axis after the embeddings, after
  every layer and on the logits, as MaxText's logical axis rules do: the weights are gathered and the
  activations never move), each for full FSDP (a mesh ``('fsdp',)`` of 8) and hybrid (a mesh ``('data',
  'fsdp')`` of 2 x 4, the state split over ``'fsdp'`` and the batch over both).

Measured: the bytes each program sends between processes per step, from its compiled HLO's collectives,
their result shapes and replica groups (`_collective_bytes.cross_domain_bytes`: flat collectives, each
member's share sent to the member that needs it); the state's bytes on one device; step times, the
variants side by side in rounds (order rotated each round), ``--steps`` chained donating steps per trial.
Before measuring, one step of every variant from the same state must give the data parallel new
parameters (allclose, rtol 1e-4).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
  parser.add_argument("--d-model", type=int, default=128, help="model width")
  parser.add_argument("--seq-len", type=int, default=64, help="tokens per example")
  parser.add_argument("--batch", type=int, default=16, help="global batch (examples)")
  parser.add_argument("--shard-min-bytes", type=int, default=16 << 10,
                      help="parameters of at least this many bytes are split (FSDP and hybrid)")
  parser.add_argument("--trials", type=int, default=7, help="rounds of step timing (0: bytes and memory only)")
  parser.add_argument("--steps", type=int, default=3, help="chained steps per timed trial")
  parser.add_argument("--processes", type=int, default=2, help="processes (one group each)")
  parser.add_argument("--devices", type=int, default=4, help="CPU devices per process")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the launched processes' report file


ARGS = h.parse_args(__doc__, add_flags) if __name__ == "__main__" else None

import _collective_bytes as cb  # noqa: E402
import bench_sharding as bs  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpustrat  # noqa: E402

TPUSTRAT = ("data parallel", "full FSDP", "hybrid")
EXPERT = ("expert FSDP", "expert hybrid")
NAIVE = ("naive FSDP", "naive hybrid")


def hand_written(ct, graphdef, tx, host_state, global_batch: int, mesh: Mesh, state_axis: str, batch_axes,
                 partition, constrain: bool):
  """The training step as one `jax.jit` over the global batch: the state split along `partition`'s axes
  over `state_axis` (replicated over the mesh's other axes), the batch over `batch_axes`; with `constrain`,
  the activations pinned to the batch axes (after the embeddings, every layer, and the logits). Returns
  (make the state, the step, the batch's sharding)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P(batch_axes))

  def spec(path, x):
    axis = partition(tuple(path), np.shape(x), np.dtype(x.dtype))
    return replicated if axis is None else NamedSharding(mesh, P(*([None] * axis), state_axis))

  param_shardings = jax.tree_util.tree_map_with_path(spec, host_state["params"])
  opt_shardings = optax.tree_map_params(tx, lambda _, sharding: sharding, host_state["opt_state"],
                                        param_shardings, transform_non_params=lambda _: replicated)
  shardings = {"params": param_shardings, "opt_state": opt_shardings}
  pin = (lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)) if constrain else (lambda x: x)  # noqa: E731

  def loss_fn(params, batch):
    # `Transformer.__call__` of the example, with the activations pinned to the batch axes
    model = nnx.merge(graphdef, params)
    tokens = batch["x"].astype(jnp.int32)
    x = pin(model.tokens(tokens) + model.positions(jnp.arange(tokens.shape[-1])))
    mask = nnx.make_causal_mask(tokens)
    block_def, stacked = nnx.split(model.blocks)
    x, _ = jax.lax.scan(lambda x, p: (pin(nnx.merge(block_def, p)(x, mask)), None), x, stacked)
    logits = pin(model.head(model.ln_final(x))).astype(jnp.float32)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"].astype(jnp.int32))
    return jnp.sum(per_token) / (global_batch * batch["y"].shape[-1])

  place = jax.jit(lambda s: s, out_shardings=shardings)  # one program: the timed rounds compile nothing

  def init():
    return place(jax.tree.map(jnp.asarray, host_state))

  @functools.partial(jax.jit, out_shardings=(shardings, replicated), donate_argnums=0)
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch)
    return ct.apply_gradients(tx, state, grads), loss

  return init, step, batch_sharding


def state_bytes_on(tree, device) -> int:
  """Bytes of `tree`'s arrays held by `device`."""
  leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  return sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)


def gathered(x) -> np.ndarray:
  """A global array (or a sharded / mirrored value) whole on the host, on every process."""
  if isinstance(x, tpustrat.ShardedVariable):
    return np.asarray(x)
  if isinstance(x, tpustrat.Mirrored):
    return np.asarray(x.values[0])
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def worker(args: argparse.Namespace) -> None:
  ct = h.load_example("char_transformer")
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  groups = tpustrat.sharding_groups(strategy, "process")
  assert groups is not None, "run with several processes"
  domains = [list(g) for g in groups]
  lines = [h.machine_line(n) + f", {jax.process_count()} processes x {jax.local_device_count()} devices"]
  config = ct.Config(seq_len=args.seq_len, layers=args.layers, d_model=args.d_model, heads=4)
  graphdef, params = ct.make_model(config, seed=0)
  tx = ct.make_optimizer(1e-3, 10, 100)
  host_state = jax.device_get(ct.init_state(params, tx))
  n_params = sum(np.asarray(x).size for x in jax.tree.leaves(host_state["params"]))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=(args.batch, args.seq_len + 1)).astype(np.int32)
  host_batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  k = args.batch // n
  batch = strategy.experimental_distribute_values_from_function(
      lambda c: {key: v[k * c.replica_id_in_sync_group:][:k] for key, v in host_batch.items()})
  partition = ct.fsdp_partitioner(args.shard_min_bytes)
  donate = tpustrat.RunOptions(donate_argnums=0)

  def sharded(groups_arg):
    def make():
      p = strategy.experimental_shard(host_state["params"], partition, groups=groups_arg)
      return {"params": p, "opt_state": strategy.run(tx.init, args=(p,))}
    return make

  makes = {"data parallel": lambda: strategy.experimental_mirror(host_state), "full FSDP": sharded(None),
           "hybrid": sharded("process")}
  steps = {"data parallel": ct.make_train_step(graphdef, tx, args.batch),
           "full FSDP": ct.make_train_step(graphdef, tx, args.batch, sharded=True),
           "hybrid": ct.make_train_step(graphdef, tx, args.batch, sharded=True)}
  devices = strategy.mesh.devices.reshape(-1)
  flat_mesh = Mesh(devices, ("fsdp",))
  grid_mesh = Mesh(np.array([[devices[r] for r in g] for g in groups]), ("data", "fsdp"))
  hand = {}
  for name, mesh, batch_axes in (("FSDP", flat_mesh, "fsdp"), ("hybrid", grid_mesh, ("data", "fsdp"))):
    for kind, constrain in (("expert", True), ("naive", False)):
      hand[f"{kind} {name}"] = hand_written(ct, graphdef, tx, host_state, args.batch, mesh, "fsdp", batch_axes,
                                            partition, constrain)

  # one step of every variant from the same state: the same new parameters; compiled programs' bytes
  results, hlo, state_bytes = {}, {}, {}
  dev = jax.local_devices()[0]
  for name in TPUSTRAT:
    state = makes[name]()
    state_bytes[name] = state_bytes_on(state, dev)
    new_state, _ = strategy.run(steps[name], args=(state, batch), options=donate)
    results[name] = [gathered(v) for v in jax.tree.leaves(new_state["params"], is_leaf=lambda v: isinstance(
        v, tpustrat.DistributedValues))]
    hlo[name] = bs.compiled_step(strategy, steps[name], (makes[name](), batch), donate).as_text()
  hand_batches = {}
  for name, (init, step, batch_sharding) in hand.items():
    hb = jax.make_array_from_callback  # each process builds its own rows
    hand_batches[name] = {key: hb(v.shape, batch_sharding, lambda index, v=v: v[index]) for key, v in host_batch.items()}
    state = init()
    state_bytes[name] = state_bytes_on(state, dev)
    hlo[name] = step.lower(state, hand_batches[name]).compile().as_text()
    results[name] = [gathered(x) for x in jax.tree.leaves(step(state, hand_batches[name])[0]["params"])]
  for other in list(results)[1:]:
    for a, b in zip(results["data parallel"], results[other]):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=other)
  lines.append("# new parameters allclose (full FSDP, hybrid, expert and naive hand-written vs data parallel)")
  lines.append(f"# model: char transformer {args.layers} layers x d_model {args.d_model}, {n_params / 1e6:.2f}M "
               f"parameters, AdamW float32 state {state_bytes['data parallel'] / 2**20:.1f} MiB per device "
               f"data parallel; global batch {args.batch} x {args.seq_len}; groups {domains}\n")
  cross = {name: cb.cross_domain_bytes(text, domains) for name, text in hlo.items()}
  counts = {name: {op: sum(c.op == op for c in cb.collectives(text)) for op in ("all-gather", "reduce-scatter",
                                                                               "all-reduce")}
            for name, text in hlo.items()}
  mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
  lines.append(h.markdown_header(["variant", "bytes across processes / step, MiB", "vs full FSDP",
                                  "vs data parallel", "state per device, MiB", "vs data parallel",
                                  "all-gather / reduce-scatter / all-reduce ops"]))
  for name in (*TPUSTRAT, *EXPERT, *NAIVE):
    c = counts[name]
    lines.append(h.markdown_row([name, mib(cross[name]["total"]),
                                 f"{cross[name]['total'] / cross['full FSDP']['total']:.3f}",
                                 f"{cross[name]['total'] / cross['data parallel']['total']:.3f}",
                                 mib(state_bytes[name]), f"{state_bytes[name] / state_bytes['data parallel']:.3f}",
                                 f"{c['all-gather']} / {c['reduce-scatter']} / {c['all-reduce']}"]))
  figures = []
  vs_fsdp = cross["hybrid"]["total"] / cross["full FSDP"]["total"]
  vs_dp = cross["hybrid"]["total"] / cross["data parallel"]["total"]
  state = state_bytes["hybrid"] / state_bytes["data parallel"]
  figures.append(("hybrid: bytes across processes per step vs full FSDP", f"{vs_fsdp:.3f}x", "<= 0.3x", vs_fsdp <= 0.3))
  figures.append(("hybrid: bytes across processes per step vs data parallel", f"{vs_dp:.3f}x", "<= 0.6x",
                  vs_dp <= 0.6))
  figures.append(("hybrid: state per device vs data parallel (groups of 4)", f"{state:.3f}x", "<= 0.3x", state <= 0.3))
  if args.trials:
    lines.append("")
    lines.extend(time_steps(args, strategy, makes, steps, batch, donate, hand, hand_batches, figures))
  if jax.process_index() == 0:
    pathlib.Path(args.worker).write_text(json.dumps({"lines": lines, "figures": figures}))


def time_steps(args, strategy, makes, steps, batch, donate, hand, hand_batches, figures) -> list[str]:
  """Step times side by side in rounds; every process runs the same rounds (their collectives pair up)."""
  timed = [bs.Variant(name, makes[name], lambda s, name=name: strategy.run(steps[name], args=(s, batch),
                                                                          options=donate)[0],
                      strategy.experimental_run_wait) for name in TPUSTRAT]
  for name, (init, step, _) in hand.items():
    timed.append(bs.Variant(name, init, lambda s, step=step, name=name: step(s, hand_batches[name])[0], lambda: None))
  for v in timed:
    v.run(args.steps)  # warm-up
  with h.no_compilation():
    times = h.time_rounds(timed, args.trials, h.rotation_schedule(timed),
                          lambda v: v.run(args.steps)[0] / args.steps * 1e3)
  lines = [f"# step time: {args.trials} rounds x {args.steps} chained donated steps per variant, order rotated "
           "per round, on loopback\n",
           h.markdown_header(["variant", "ms/step", "throughput vs", "paired ratio, median [p25, p75]", "target"],
                             right={"ms/step"})]
  rows = [("data parallel", None, None), ("full FSDP", "expert FSDP", 0.95), ("hybrid", "expert hybrid", 0.95),
          ("hybrid", "full FSDP", None), ("hybrid", "data parallel", None), ("naive FSDP", "expert FSDP", None),
          ("naive hybrid", "expert hybrid", None), ("expert FSDP", None, None), ("expert hybrid", None, None)]
  for name, base, target in rows:
    if base is None:
      lines.append(h.markdown_row([name, f"{statistics.median(times[name]):.1f}", "", "", ""]))
      continue
    paired = h.spread(h.paired_ratios(times[base], times[name]))  # throughput: base time / this time
    met = None if target is None else paired[0] >= target
    figures.append((f"{name}: step throughput vs {base} (2 x 4 processes, loopback)", f"{paired[0]:.3f}",
                    "" if target is None else f">= {target:.2f}", met))
    lines.append(h.markdown_row([name, f"{statistics.median(times[name]):.1f}", base, h.format_spread(paired, 3),
                                 "" if target is None else h.verdict(f">= {target:.2f}", bool(met))]))
  return lines


def main(args: argparse.Namespace) -> int:
  with tempfile.TemporaryDirectory() as tmp:
    report = pathlib.Path(tmp) / "report.json"
    passed = sys.argv[1:]  # the workers leave the CPU devices to the launcher (-d)
    # The launcher sets each process's device count (in XLA_FLAGS, whose other flags it keeps).
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}
    command = [sys.executable, "-m", "tpustrat.launch", "-n", str(args.processes), "-d", str(args.devices),
               "--timeout", "900", os.path.abspath(__file__), *passed, "--worker", str(report)]
    # The processes' own output goes to stderr: stdout is the report (its first line the machine line).
    proc = subprocess.run(command, env=env, cwd=pathlib.Path(__file__).resolve().parents[1], stdout=sys.stderr)
    if proc.returncode != 0:
      return proc.returncode
    out = json.loads(report.read_text())
  print("\n".join(out["lines"]), flush=True)
  for name, value, target, met in out["figures"]:
    h.figure(name, value, target, met)
  return 0


if __name__ == "__main__":
  if ARGS.worker:
    worker(ARGS)
  else:
    sys.exit(main(ARGS))
