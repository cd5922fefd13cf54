"""An embedding table sharded by rows (`tpustrat.embedding.TPUEmbedding`) against the same table replicated.

What is measured
----------------
One training step of a tiny model, written twice and timed side by side in one process, at several
table sizes (``--rows``, width ``--dim``, float32):

* Model: one table of ``V`` rows; every example looks up ``4`` ids (uniform over ``[0, V)``) combined
  with the ``mean`` combiner (TF's default); the ``[b, D]`` activations go through a dense ``[D, 16]``
  layer; the loss is ``sum((act @ w - y)**2) / global_batch`` per replica (global batch 1024: 128 per
  replica with 8). The table is trained with ``--optimizer`` (SGD, learning rate 0.1, or Adagrad,
  0.1 with accumulators starting at 0.1: one slot), the dense layer with SGD (0.1). Every step uses
  the same batch; the step returns the new state and the global loss.
* ``sharded``: `TPUEmbedding` (one `FeatureConfig` on one `TableConfig`): inside `strategy.run`,
  ``emb.lookup`` (two `all_to_all`: ids out, rows back), the gradient of the loss with respect to the
  activations (`jax.grad`), and ``emb.apply_gradients`` (two more: ids and per-id gradients to the
  rows' owners, which update their rows). The table and its slots are `ShardedVariable`s of shape
  ``[V, D]`` split along axis 0: blocks ``[N, Vp/N, D]``, each replica holding ``Vp/N`` rows (``Vp``:
  ``V`` padded to a multiple of ``N``).
* ``replicated``: what one writes without it (TF's `MirroredStrategy` with the table as a variable):
  the table (and slot) is a `Mirrored` ``[V, D]`` array, a whole copy on every device; inside
  `strategy.run` the activations are ``jnp.take`` and the same combiner, the gradient with respect to
  the table is `jax.grad`'s dense ``[V, D]`` gradient (summed over replicas by JAX, the table being
  replicated: an all-reduce of ``V * D`` values), and the same optimizer updates the whole table.

Both variants run under `strategy.run` with the same bound on steps in flight, so the difference is
the program: ``2 x N x M`` ids and ``2 x N x M x D`` values through `all_to_all` per replica (``M`` =
ids per replica, whatever ``V``) and work on ``Vp / N`` rows per device, against an all-reduce of a
``[V, D]`` gradient and an update of all ``V`` rows on every device. The sharded step's work still
grows with ``V / N``: `apply_gradients` builds a dense ``[Vp/N, D]`` gradient and touched mask, the
optimizer writes a whole new block, and `run` does not donate its arguments (the old block is copied).

Reported per table size:

* us/step of each variant (median over trials), and the ratio sharded / replicated as the median of
  the per-round paired ratios [p25, p75].
* Table + slot bytes per device: the bytes of the shards of the state's table and slot arrays that
  live on device 0 (from the arrays' shardings), for both; their ratio, with the target
  ``<= ceil(V/N) / V`` (``1/N`` plus the padding rows).
* Program bytes per device: XLA's `memory_analysis` of the compiled step (arguments + outputs +
  temporaries - aliased, per device): the peak the step itself needs, dense gradient included. And
  ``jax.devices()[0].memory_stats()["peak_bytes_in_use"]`` after the table size's runs, where the
  backend reports it (a process-wide running maximum; XLA:CPU reports nothing: ``n/a``).
* `all_to_all` bytes per replica and step: analytic, from the shapes of the library's four exchanges
  (lookup: ids int32 ``[N, M]`` out, rows f32 ``[N, M, D]`` back; apply_gradients: ids ``[N, M]``
  and gradients ``[N, M, D]``); and as compiled: the bytes of the operands of the all-to-all
  instructions in the compiled step's HLO (``jax.jit(lambda *a: strategy.run(step, args=a))`` lowered
  and compiled on the same arguments; the same program `run` compiles, inlined in an outer jit),
  with their count. XLA merges the two identical ids exchanges (lookup and apply_gradients route the
  same ids), so the compiled step has 3 all-to-alls and moves ``N * M * 4`` bytes fewer than the four
  exchanges. The bytes include each replica's block for itself. The replicated step's all-reduce
  bytes are reported the same way (from its HLO).
* Targets: table + slot bytes per device at most ``1/N`` of replicated plus padding; at 1M rows and
  more, sharded step time no worse than replicated (paired ratio <= 1.00). Below 1M rows there is no
  step-time target: the rows show where the crossover lies, printed after the table.

Methodology (that of `bench_run.py`)
------------------------------------
1. Both variants run 2 chained steps from the same initial state; the script asserts that the tables
   (whole, ``[V, D]``), slots, dense layer and losses are allclose, and prints
   ``# <V> rows: results allclose``.
2. Warm-up: each variant runs one full trial untimed; nothing may compile during the timed trials.
3. ``--trials`` rounds; in each every variant runs ``--steps`` chained steps from the same initial
   state, timed with ``time.perf_counter`` from the first dispatch until the last step's outputs are
   ready; the order alternates (AB, BA, ...) so drift in machine load hits both alike.

Reproduce from the repository root (8 emulated CPU devices unless ``--cpu-devices 0``)::

    .venv/bin/python benchmarks/bench_embedding.py                         # 1e3 .. 1e6 rows, SGD
    .venv/bin/python benchmarks/bench_embedding.py --rows 3000,10000,30000 --trials 21   # the crossover
    .venv/bin/python benchmarks/bench_embedding.py --optimizer adagrad --rows 1000,1000000

Defaults: 20 steps x 15 trials up to 1e4 rows, 5 x 7 up to 1e5, 1 x 7 above (a replicated step takes
5-8 s at 1M rows on a 2-core machine with 8 emulated devices); about 2 minutes in all there. At 1M
rows the replicated state is 256 MB per device (2 GB for 8; 4 GB with Adagrad's slot), and the step
needs as much again for the dense gradient and the new table: the default run peaks at about 10 GB
resident; check ``free -g`` before larger runs.
Timings on shared CPU machines are noisy: the targets are checked on the median paired ratio.
"""

from __future__ import annotations

import argparse
import gc
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--rows", default="1000,10000,100000,1000000",
                      help="comma-separated table sizes V (rows), one table row of the report each")
  parser.add_argument("--dim", type=int, default=64, help="table width D")
  parser.add_argument("--steps", type=int, default=None,
                      help="chained steps per trial (default: 20 up to 1e4 rows, 5 up to 1e5, then 1)")
  parser.add_argument("--trials", type=int, default=None,
                      help="timed trials per variant (default: 15 up to 1e4 rows, then 7)")
  parser.add_argument("--optimizer", choices=("sgd", "adagrad"), default="sgd",
                      help="the table's optimizer (adagrad: one slot per table)")


ARGS = h.parse_args(__doc__, _add_flags) if __name__ == "__main__" else None
if ARGS is not None:
  h.emulate_cpu_devices(ARGS.cpu_devices)  # before JAX initialises its backends

import tpustrat  # noqa: E402
from tpustrat import embedding  # noqa: E402

GLOBAL_BATCH = 1024
IDS_PER_EXAMPLE = 4
OUT = 16  # width of the dense layer
LR = 0.1
ADAGRAD_INIT = 0.1
CHECK_STEPS = 2
STEP_TARGET_ROWS = 1_000_000  # the step-time target applies from this table size on
STEP_TARGET = 1.00


def default_plan(rows: int) -> tuple[int, int]:
  """(steps, trials) for a table of `rows` rows: a step of the replicated table takes ~8 s at 1M rows."""
  return (20, 15) if rows <= 10_000 else (5, 7) if rows <= 100_000 else (1, 7)


# -- the model ------------------------------------------------------------------------------------------


def _head_loss(act: jax.Array, w: jax.Array, y: jax.Array) -> jax.Array:
  """This replica's share of the global mean loss."""
  return jnp.sum((act @ w - y) ** 2) / GLOBAL_BATCH


def make_sharded_step(emb: embedding.TPUEmbedding) -> Callable[..., Any]:
  def sharded_step(carry, ids, y):
    state, w = carry
    act = emb.lookup(state, {"f": ids})["f"]
    # g_act: this replica's d(global loss)/d(activations); g_w: summed over replicas (w is replicated)
    loss, (g_act, g_w) = jax.value_and_grad(_head_loss, argnums=(0, 1))(act, w, y)
    state = emb.apply_gradients(state, {"f": ids}, {"f": g_act})
    return (state, w - LR * g_w), lax.psum(loss, "replica")

  return sharded_step


def make_replicated_step(optimizer: str) -> Callable[..., Any]:
  def replicated_step(carry, ids, y):
    (table, slots), w = carry

    def loss_fn(table, w):
      rows = jnp.take(table, ids, axis=0)  # [b, L, D]
      coef = jnp.full(ids.shape, 1.0 / ids.shape[1], jnp.float32)  # the mean combiner, as TPUEmbedding
      return _head_loss(jnp.einsum("bl,bld->bd", coef, rows), w, y)

    loss, (g_t, g_w) = jax.value_and_grad(loss_fn, argnums=(0, 1))(table, w)  # dense, summed over replicas
    if optimizer == "sgd":
      table = table - LR * g_t
    else:  # Adagrad: untouched rows have g = 0 and keep their values and accumulators exactly
      acc = slots["accumulators"] + g_t * g_t
      table = table - LR * g_t * lax.rsqrt(acc)
      slots = {"accumulators": acc}
    return ((table, slots), w - LR * g_w), lax.psum(loss, "replica")

  return replicated_step


# -- the variants ---------------------------------------------------------------------------------------


class Variant:
  """A named loop: `carry = step(carry)` k times from the initial carry, then wait for the end."""

  def __init__(self, name: str, strategy: tpustrat.Strategy, fn: Callable[..., Any], init: Any,
               data: tuple[Any, ...]) -> None:
    self.name, self.strategy, self.fn, self.init, self.data = name, strategy, fn, init, data

  def run(self, k: int) -> tuple[float, Any]:
    """Runs `k` chained steps; returns (seconds, outputs of the last step)."""
    def step(out):
      return self.strategy.run(self.fn, args=(out[0],) + self.data)

    return h.time_chain(lambda: (self.init, None), step, k, self.strategy.experimental_run_wait)

  def compiled(self) -> Any:
    """The step as one compiled program (`run`'s program inlined in an outer `jax.jit`)."""
    return jax.jit(lambda carry, *data: self.strategy.run(self.fn, args=(carry,) + data)).lower(
        self.init, *self.data).compile()


def make_variants(strategy: tpustrat.Strategy, rows: int, dim: int, optimizer: str
                  ) -> tuple[embedding.TPUEmbedding, Variant, Variant]:
  n = strategy.num_replicas_in_sync
  if GLOBAL_BATCH % n:
    raise SystemExit(f"the global batch of {GLOBAL_BATCH} does not split over {n} replicas")
  b = GLOBAL_BATCH // n
  opt = embedding.SGD(LR) if optimizer == "sgd" else embedding.Adagrad(LR, ADAGRAD_INIT)
  table = embedding.TableConfig(rows, dim, combiner="mean", name="table")
  emb = embedding.TPUEmbedding({"f": embedding.FeatureConfig(table, name="f")}, opt, strategy)
  state = emb.build(seed=0)

  rng = np.random.default_rng(rows)
  ids = rng.integers(0, rows, size=(n, b, IDS_PER_EXAMPLE)).astype(np.int32)
  ys = rng.standard_normal((n, b, OUT)).astype(np.float32)
  w0 = (rng.standard_normal((dim, OUT)) / np.sqrt(dim)).astype(np.float32)
  mesh = strategy.mesh
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("replica"))
  data = tuple(tpustrat.PerReplica.from_stacked(jax.device_put(a, split)) for a in (ids, ys))
  w = tpustrat.Mirrored.from_global(jax.device_put(w0, replicated))

  full = jax.device_put(emb.embedding_tables(state)["table"], replicated)
  slots = {} if optimizer == "sgd" else {"accumulators": jax.device_put(
      np.full((rows, dim), ADAGRAD_INIT, np.float32), replicated)}
  sharded = Variant("sharded", strategy, make_sharded_step(emb), (state, w), data)
  dense = Variant("replicated", strategy, make_replicated_step(optimizer),
                  (tpustrat.Mirrored.from_global((full, slots)), w), data)
  return emb, sharded, dense


# -- checking, measuring --------------------------------------------------------------------------------


def _array(v: Any) -> np.ndarray:
  return np.asarray(jax.device_get(v.tree if isinstance(v, tpustrat.DistributedValues) else v))


def check_same(emb: embedding.TPUEmbedding, sharded: Variant, dense: Variant, rows: int) -> None:
  (state, w_s), loss_s = sharded.run(CHECK_STEPS)[1]
  ((table, slots), w_d), loss_d = dense.run(CHECK_STEPS)[1]
  tol = dict(rtol=1e-5, atol=1e-6)
  what = f"{rows} rows: sharded and replicated give different"
  got = emb.embedding_tables(state)["table"]
  np.testing.assert_allclose(got, _array(table), **tol, err_msg=f"{what} tables")
  for name, slot in slots.items():
    np.testing.assert_allclose(np.asarray(state["slots"]["table"][name]), _array(slot), **tol,
                               err_msg=f"{what} {name}")
  np.testing.assert_allclose(_array(w_s), _array(w_d), **tol, err_msg=f"{what} dense layers")
  np.testing.assert_allclose(_array(loss_s), _array(loss_d), **tol, err_msg=f"{what} losses")
  before = emb.embedding_tables(sharded.init[0])["table"]
  assert not np.allclose(got, before), f"{rows} rows: the table did not move"


def device0_bytes(tree: Any) -> int:
  """Bytes of the shards of `tree`'s arrays that live on device 0 (from their shardings)."""
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == dev)


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
                "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collective_bytes(hlo: str, op: str) -> tuple[int, int]:
  """(count, operand bytes per device) of the `op` instructions (``all-to-all``, ``all-reduce``) in
  compiled HLO text (asynchronous ``-start`` forms counted once, their ``-done`` not at all)."""
  count = total = 0
  for line in hlo.splitlines():
    m = re.search(rf"=\s*(.*?)\s{op}(?:-start)?\(", line)
    if not m:
      continue
    count += 1
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1)):
      total += _DTYPE_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
  return count, total


def program_bytes(compiled: Any) -> int | None:
  """Per-device bytes of a compiled program: arguments + outputs + temporaries - aliased (XLA)."""
  try:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  except Exception:  # pylint: disable=broad-except  # a backend without memory_analysis
    return None


def peak_bytes() -> int | None:
  stats = jax.devices()[0].memory_stats()
  return None if not stats else stats.get("peak_bytes_in_use")


def fmt_bytes(x: int | None) -> str:
  if x is None:
    return "n/a"
  for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if x >= scale:
      return f"{x / scale:.3g} {unit}"
  return f"{x} B"


def bench_one(strategy: tpustrat.Strategy, rows: int, args: argparse.Namespace) -> dict[str, Any]:
  n = strategy.num_replicas_in_sync
  emb, sharded, dense = make_variants(strategy, rows, args.dim, args.optimizer)
  steps, trials = default_plan(rows)
  steps, trials = args.steps or steps, args.trials or trials
  check_same(emb, sharded, dense, rows)
  print(f"# {rows} rows: results allclose; timing {trials} trials x {steps} steps per variant ...",
        flush=True)
  variants = [sharded, dense]
  for v in variants:
    v.run(steps)  # warm-up
  with h.no_compilation():
    times = h.time_rounds(variants, trials, h.permutation_schedule(variants),
                          lambda v: v.run(steps)[0] / steps * 1e6)
  hlo_s, hlo_d = (v.compiled() for v in variants)
  m = (GLOBAL_BATCH // n) * IDS_PER_EXAMPLE  # ids per replica
  a2a_analytic = 2 * (n * m * 4 + n * m * args.dim * 4) if n > 1 else 0
  a2a_count, a2a_bytes = collective_bytes(hlo_s.as_text(), "all-to-all")
  ar_count_d, ar_bytes_d = collective_bytes(hlo_d.as_text(), "all-reduce")
  table_s = device0_bytes((sharded.init[0]["tables"], sharded.init[0]["slots"]))
  table_d = device0_bytes(dense.init[0])
  padded_rows = -(-rows // n)
  row = {
      "rows": rows, "steps": steps, "trials": trials,
      "us_s": statistics.median(times["sharded"]), "us_d": statistics.median(times["replicated"]),
      "paired": h.spread(h.paired_ratios(times["sharded"], times["replicated"])),
      "table_s": table_s, "table_d": table_d, "mem_target": padded_rows / rows,
      "prog_s": program_bytes(hlo_s), "prog_d": program_bytes(hlo_d), "peak": peak_bytes(),
      "a2a_analytic": a2a_analytic, "a2a_count": a2a_count, "a2a_bytes": a2a_bytes,
      "ar_count_d": ar_count_d, "ar_bytes_d": ar_bytes_d,
  }
  del emb, sharded, dense, variants, hlo_s, hlo_d
  gc.collect()
  return row


def crossover(rows: list[dict[str, Any]]) -> str:
  """Where the median paired ratio sharded / replicated crosses 1 over the measured table sizes."""
  faster = [r["paired"][0] <= 1.0 for r in rows]
  sizes = [r["rows"] for r in rows]
  if all(faster):
    return f"sharded is no slower than replicated at every measured size ({sizes[0]} to {sizes[-1]} rows)"
  if not any(faster):
    return f"replicated is faster at every measured size ({sizes[0]} to {sizes[-1]} rows)"
  first = faster.index(True)
  if first > 0 and all(faster[first:]):
    lo, hi = rows[first - 1], rows[first]
    # log-linear interpolation of the ratio between the two sizes around 1.0
    x0, x1 = np.log10(lo["rows"]), np.log10(hi["rows"])
    y0, y1 = lo["paired"][0], hi["paired"][0]
    at = 10 ** (x0 + (1.0 - y0) * (x1 - x0) / (y1 - y0)) if y1 != y0 else hi["rows"]
    return (f"sharded becomes faster between {lo['rows']} rows (ratio {y0:.2f}) and {hi['rows']} rows "
            f"(ratio {y1:.2f}), about {at:.2g} rows by log-linear interpolation")
  return "no single crossover: " + ", ".join(f"{s} rows {r['paired'][0]:.2f}" for s, r in zip(sizes, rows))


def main(args: argparse.Namespace) -> int:
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  print(h.machine_line(n))
  sizes = [int(float(s)) for s in args.rows.split(",") if s.strip()]
  t_start = time.perf_counter()
  rows = [bench_one(strategy, v, args) for v in sizes]
  print(f"# total {time.perf_counter() - t_start:.0f} s")
  print()
  columns = ["rows", "optimizer", "steps x trials", "sharded us/step", "replicated us/step",
             "ratio, median [p25, p75]", "table+slots/device sharded", "replicated", "memory ratio",
             "memory target", "step program/device sharded", "replicated program", "memory_stats peak",
             "all_to_all/replica/step analytic", "compiled (ops)", "replicated all-reduce/replica/step",
             "step target"]
  print(h.markdown_header(columns, right={"sharded us/step", "replicated us/step", "memory ratio"}))
  for r in rows:
    mem_ratio = r["table_s"] / r["table_d"]
    mem_verdict = h.verdict(f"<= 1/{n} + pad = {r['mem_target']:.4f}", mem_ratio <= r["mem_target"] + 1e-12)
    if r["rows"] >= STEP_TARGET_ROWS:
      step_verdict = h.verdict(f"<= {STEP_TARGET:.2f}", r["paired"][0] <= STEP_TARGET)
    else:
      step_verdict = f"(none below {STEP_TARGET_ROWS:.0e} rows)"
    print(h.markdown_row([
        r["rows"], args.optimizer, f"{r['steps']} x {r['trials']}", f"{r['us_s']:.0f}", f"{r['us_d']:.0f}",
        h.format_spread(r["paired"], 3), fmt_bytes(r["table_s"]), fmt_bytes(r["table_d"]), f"{mem_ratio:.4f}",
        mem_verdict, fmt_bytes(r["prog_s"]), fmt_bytes(r["prog_d"]), fmt_bytes(r["peak"]),
        fmt_bytes(r["a2a_analytic"]), f"{fmt_bytes(r['a2a_bytes'])} ({r['a2a_count']})",
        f"{fmt_bytes(r['ar_bytes_d'])} ({r['ar_count_d']})", step_verdict]))
  print()
  print(f"# crossover: {crossover(rows)}")
  print("us/step: median over trials of (time for `steps` chained steps, until the last is ready) / steps. "
        "ratio: per-round paired ratios sharded / replicated. table+slots/device: bytes on device 0 of the "
        "table and optimizer-slot arrays (from their shardings); memory target: sharded / replicated <= "
        "ceil(V/N) / V. step program/device: XLA memory_analysis of the compiled step (arguments + outputs + "
        "temporaries - aliased). memory_stats peak: device 0's peak_bytes_in_use after the size's runs "
        "(process-wide running maximum; n/a where the backend reports none). all_to_all: bytes each "
        "replica sends per step (own block included), analytic for the library's 4 exchanges, and as "
        "compiled (operand bytes of the HLO's all-to-all ops, their count in parentheses; XLA merges the "
        "two identical ids exchanges). replicated all-reduce: bytes of the dense gradient all-reduced per "
        "step (from its HLO; its ops in parentheses: the table's and the dense layer's gradients may be "
        "combined). step target: sharded / replicated paired ratio at >= 1M rows.")
  return 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
