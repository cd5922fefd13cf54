"""An embedding table sharded by rows (`tpustrat.embedding.TPUEmbedding`) against the same table replicated.

What is measured
----------------
One training step of a tiny model, written four ways and timed side by side in one process, at several
table sizes (``--rows``, width ``--dim``, float32):

* Model: one table of ``V`` rows; every example looks up ``4`` ids (uniform over ``[0, V)``) combined
  with the ``mean`` combiner (TF's default); the ``[b, D]`` activations go through a dense ``[D, 16]``
  layer; the loss is ``sum((act @ w - y)**2) / global_batch`` per replica (global batch 1024: 128 per
  replica with 8). The table is trained with ``--optimizer`` (SGD, learning rate 0.1, or Adagrad,
  0.1 with accumulators starting at 0.1: one slot), the dense layer with SGD (0.1). Every step uses
  the same batch; the step returns the new state and the global loss.
* ``sharded``: `TPUEmbedding` (one `FeatureConfig` on one `TableConfig`), the state donated
  (``RunOptions(donate_argnums=0)``): inside `strategy.run`, ``emb.lookup``, the gradient of the loss
  with respect to the activations (`jax.grad`), and ``emb.apply_gradients``, on the layout the library
  picks from the sizes (see `TPUEmbedding`): with 512 ids per replica and 8 replicas, a table of up to
  8192 rows is all-gathered whole (one `all_gather` of the blocks, one `psum_scatter` of the dense
  gradient), a larger one all-gathers the ids (rows back by one `psum_scatter`, gradients out by one
  `all_gather`, the owners updating only the touched rows, in place). The table and its slots are
  `ShardedVariable`s of shape ``[V, D]`` split along axis 0: blocks ``[N, Vp/N, D]``, each replica
  holding ``Vp/N`` rows (``Vp``: ``V`` padded to a multiple of ``N``).
* ``sharded, before``: the code path before issue 25, kept in `benchmarks/_embedding_per_table.py`
  (`PerTableEmbedding`, the library's state and `_prepare` with the old `lookup`/`apply_gradients`):
  each table exchanges on its own, buckets ``[N, M]`` sized for the worst case, no deduplication, a dense
  ``[Vp/N, D]`` gradient and touched mask, the whole block rewritten, the state not donated (as the
  benchmark ran it before).
* ``replicated``: what one writes without it (TF's `MirroredStrategy` with the table as a variable):
  the table (and slot) is a `Mirrored` ``[V, D]`` array, a whole copy on every device; inside
  `strategy.run` the activations are ``jnp.take`` and the same combiner, the gradient with respect to
  the table is `jax.grad`'s dense ``[V, D]`` gradient (summed over replicas by JAX, the table being
  replicated: an all-reduce of ``V * D`` values), and the same optimizer updates the whole table; the
  state donated too (so both sides update in place where they can).
* ``hand-written``: what one writes in plain JAX without tpustrat: the ``[V, D]`` table row-sharded
  with a `NamedSharding`, the global batch sharded by examples, ``jnp.take`` and its scatter-add
  gradient under one `jax.jit` (donating the state), partitioned by XLA's SPMD partitioner (which
  all-gathers the ids, gathers owned rows, all-reduces them, all-gathers the gradients and updates the
  whole block densely); at most 2 steps in flight, as `run` keeps.

Donated variants start each trial from a copy of the initial state made before the clock starts.

Reported per table size (first table): us/step of each variant (median over trials), the paired ratios
sharded / replicated [p25, p75], before / replicated, sharded / before and hand-written / sharded
[p25, p75]; table + slot bytes per device
(target ``<= ceil(V/N) / V`` of replicated); the compiled step's temporaries (XLA `memory_analysis`,
next to the size of one block); the exchanges' operand bytes per replica and step in the compiled HLO
(all-to-all, all-gather, reduce-scatter), with the ops, for both sharded paths; the replicated step's
all-reduce bytes; the hand-written step's collectives.

The issue's five figures (second table), each with the before-path measured in the same run:

* sharded step time at 1M rows: target <= 140 ms (it was 430 ms on this machine's CPU before);
* crossover vs replicated: where the paired ratio sharded / replicated crosses 1 (log-linear
  interpolation); target <= 2 000 rows (met when every measured size >= 2 000 rows has ratio <= 1);
* hand-written / sharded step time at 1M rows (or the largest measured size): target >= 1.0;
* exchanges per step in the compiled step of ``--tables`` tables (100 000 rows each, widths
  alternating 64 and 32, one feature each) and of 1 table, with every table on each layout in turn:
  target, the same exchanges;
* bytes exchanged per replica and step on a batch whose ids are 50% duplicates (each replica's 512
  ids: 256 distinct, each twice): compiled all-to-all operand bytes of the before-path, and of the
  library with ``max_unique_ids_per_partition`` set to the batch's largest count of distinct ids per
  (replica, owner) (what `check_ids` accepts; also shown: the buckets ``max_ids_per_partition`` would need
  counting every occurrence, and the unbounded default); and the payload (ids and rows that fill bucket
  slots). Target <= 0.6x of before, for both. The bounded step is checked allclose to the before-path.

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
    .venv/bin/python benchmarks/bench_embedding.py --rows 1000,2000,3000,5000 --trials 21   # the crossover
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
  parser.add_argument("--tables", type=int, default=8,
                      help="tables of the model whose all-to-alls are counted against a 1-table model")
  parser.add_argument("--rows", default="1000,2000,3000,5000,10000,100000,1000000",
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

from _embedding_per_table import PerTableEmbedding  # noqa: E402  # the code path before issue 25

import tpustrat  # noqa: E402
from tpustrat import embedding  # noqa: E402

GLOBAL_BATCH = 1024
IDS_PER_EXAMPLE = 4
OUT = 16  # width of the dense layer
LR = 0.1
ADAGRAD_INIT = 0.1
CHECK_STEPS = 2
STEP_TARGET_ROWS = 1_000_000  # the step-time target: at this table size
STEP_TARGET_MS = 140
CROSSOVER_TARGET = 2_000  # sharded no slower than replicated from this table size on
HAND_TARGET = 1.0  # the hand-written jax.jit step's time over the sharded one's
BYTES_TARGET = 0.6  # bytes exchanged with 50% duplicate ids, relative to before


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


def make_hand_written_step(optimizer: str) -> Callable[..., Any]:
  """The step as one writes it in plain JAX without tpustrat: the ``[V, D]`` table (and slot) row-sharded
  with a `NamedSharding`, the global batch sharded by examples, lookup (``jnp.take``) and its
  scatter-add gradient under `jax.jit`, partitioned by XLA's SPMD partitioner."""
  def step(carry, ids, y):
    (table, slots), w = carry

    def loss_fn(table, w):
      rows = jnp.take(table, ids, axis=0)  # [B, L, D]
      coef = jnp.full(ids.shape, 1.0 / ids.shape[1], jnp.float32)  # the mean combiner
      act = jnp.einsum("bl,bld->bd", coef, rows)
      return jnp.sum((act @ w - y) ** 2) / GLOBAL_BATCH

    loss, (g_t, g_w) = jax.value_and_grad(loss_fn, argnums=(0, 1))(table, w)
    if optimizer == "sgd":
      table = table - LR * g_t
    else:
      acc = slots["accumulators"] + g_t * g_t
      table = table - LR * g_t * lax.rsqrt(acc)
      slots = {"accumulators": acc}
    return ((table, slots), w - LR * g_w), loss

  return step


# -- the variants ---------------------------------------------------------------------------------------


def _copy(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.copy(), tree)


class Variant:
  """A named loop: `carry = step(carry)` k times from the initial carry, then wait for the end. With
  `donate`, each step donates its carry (``RunOptions(donate_argnums=0)``), and each loop starts from a
  copy of the initial carry made before the clock starts."""

  def __init__(self, name: str, strategy: tpustrat.Strategy, fn: Callable[..., Any], init: Any,
               data: tuple[Any, ...], donate: bool) -> None:
    self.name, self.strategy, self.fn, self.init, self.data = name, strategy, fn, init, data
    self.donate = donate
    self.options = tpustrat.RunOptions(donate_argnums=0) if donate else None

  def start(self) -> Any:
    return _copy(self.init) if self.donate else self.init

  def run(self, k: int) -> tuple[float, Any]:
    """Runs `k` chained steps; returns (seconds, outputs of the last step)."""
    def step(out):
      return self.strategy.run(self.fn, args=(out[0],) + self.data, options=self.options)

    return h.time_chain(lambda: (self.start(), None), step, k, self.strategy.experimental_run_wait)

  def compiled(self) -> Any:
    """The step as one compiled program (`run`'s program inlined in an outer `jax.jit`, which donates
    the carry when the variant does)."""
    return jax.jit(lambda carry, *data: self.strategy.run(self.fn, args=(carry,) + data),
                   donate_argnums=(0,) if self.donate else ()).lower(self.init, *self.data).compile()


class HandWritten:
  """`Variant`'s interface for the hand-written `jax.jit` step (no tpustrat): the carry donated, at most
  as many steps in flight as `run` keeps (`IN_FLIGHT`)."""

  def __init__(self, name: str, step: Callable[..., Any], init: Any, data: tuple[Any, ...], shardings: Any) -> None:
    self.name, self.init, self.data = name, init, data
    self.jitted = jax.jit(step, donate_argnums=0, out_shardings=shardings)

  def start(self) -> Any:
    return _copy(self.init)

  def run(self, k: int) -> tuple[float, Any]:
    call, forget = h.bounded(self.jitted, IN_FLIGHT)
    return h.time_chain(lambda: (self.start(), None), lambda out: call(out[0], *self.data), k, forget)

  def compiled(self) -> Any:
    return self.jitted.lower(self.init, *self.data).compile()


IN_FLIGHT = 2  # steps in flight in the hand-written loop: as many as `run` allows


def _feature_embedding(cls: type, strategy: tpustrat.Strategy, rows: int, dim: int, optimizer: str,
                       **bounds: int) -> embedding.TPUEmbedding:
  opt = embedding.SGD(LR) if optimizer == "sgd" else embedding.Adagrad(LR, ADAGRAD_INIT)
  table = embedding.TableConfig(rows, dim, combiner="mean", name="table", **bounds)
  return cls({"f": embedding.FeatureConfig(table, name="f")}, opt, strategy)


def _data(strategy: tpustrat.Strategy, ids: np.ndarray, ys: np.ndarray) -> tuple[Any, ...]:
  split = NamedSharding(strategy.mesh, P("replica"))
  return tuple(tpustrat.PerReplica.from_stacked(jax.device_put(a, split)) for a in (ids, ys))


def make_variants(strategy: tpustrat.Strategy, rows: int, dim: int, optimizer: str
                  ) -> tuple[embedding.TPUEmbedding, list[Variant]]:
  n = strategy.num_replicas_in_sync
  if GLOBAL_BATCH % n:
    raise SystemExit(f"the global batch of {GLOBAL_BATCH} does not split over {n} replicas")
  b = GLOBAL_BATCH // n
  emb = _feature_embedding(embedding.TPUEmbedding, strategy, rows, dim, optimizer)
  before = _feature_embedding(PerTableEmbedding, strategy, rows, dim, optimizer)
  state = emb.build(seed=0)

  rng = np.random.default_rng(rows)
  ids = rng.integers(0, rows, size=(n, b, IDS_PER_EXAMPLE)).astype(np.int32)
  ys = rng.standard_normal((n, b, OUT)).astype(np.float32)
  w0 = (rng.standard_normal((dim, OUT)) / np.sqrt(dim)).astype(np.float32)
  replicated = NamedSharding(strategy.mesh, P())
  data = _data(strategy, ids, ys)
  w = tpustrat.Mirrored.from_global(jax.device_put(w0, replicated))

  full = jax.device_put(emb.embedding_tables(state)["table"], replicated)
  slots = {} if optimizer == "sgd" else {"accumulators": jax.device_put(
      np.full((rows, dim), ADAGRAD_INIT, np.float32), replicated)}
  row_split = NamedSharding(strategy.mesh, P("replica", None))
  hand_table = jax.device_put(emb.embedding_tables(state)["table"], row_split)
  hand_slots = {k: jax.device_put(v, row_split) for k, v in slots.items()}
  hand_data = tuple(jax.device_put(a.reshape((n * b,) + a.shape[2:]), NamedSharding(strategy.mesh, P("replica")))
                    for a in (ids, ys))
  hand_w = jax.device_put(w0, replicated)
  shardings = (((row_split, {k: row_split for k in hand_slots}), replicated), replicated)
  variants = [
      Variant(SHARDED, strategy, make_sharded_step(emb), (state, w), data, donate=True),
      Variant(BEFORE, strategy, make_sharded_step(before), (state, w), data, donate=False),
      Variant(REPLICATED, strategy, make_replicated_step(optimizer),
              (tpustrat.Mirrored.from_global((full, slots)), w), data, donate=True),
      HandWritten(HAND, make_hand_written_step(optimizer), ((hand_table, hand_slots), hand_w), hand_data,
                  shardings),
  ]
  return emb, variants


SHARDED = "sharded"
BEFORE = "sharded, before"
REPLICATED = "replicated"
HAND = "hand-written jax.jit"


# -- checking, measuring --------------------------------------------------------------------------------


def _array(v: Any) -> np.ndarray:
  return np.asarray(jax.device_get(v.tree if isinstance(v, tpustrat.DistributedValues) else v))


def check_same(emb: embedding.TPUEmbedding, variants: list[Variant], rows: int) -> None:
  sharded, before, dense, hand = variants
  (state, w_s), loss_s = sharded.run(CHECK_STEPS)[1]
  ((table_h, slots_h), w_h), loss_h = hand.run(CHECK_STEPS)[1]
  (state_b, w_b), loss_b = before.run(CHECK_STEPS)[1]
  ((table, slots), w_d), loss_d = dense.run(CHECK_STEPS)[1]
  tol = dict(rtol=1e-5, atol=1e-6)
  what = f"{rows} rows: sharded and replicated give different"
  got = emb.embedding_tables(state)["table"]
  np.testing.assert_allclose(got, _array(table), **tol, err_msg=f"{what} tables")
  np.testing.assert_allclose(got, emb.embedding_tables(state_b)["table"], **tol,
                             err_msg=f"{rows} rows: sharded and sharded-before give different tables")
  for name, slot in slots.items():
    np.testing.assert_allclose(np.asarray(state["slots"]["table"][name]), _array(slot), **tol,
                               err_msg=f"{what} {name}")
  np.testing.assert_allclose(got, np.asarray(table_h), **tol, err_msg=f"{rows} rows: sharded and hand-written give different tables")
  for name, slot in slots_h.items():
    np.testing.assert_allclose(np.asarray(state["slots"]["table"][name]), np.asarray(slot), **tol,
                               err_msg=f"{rows} rows: sharded and hand-written give different {name}")
  for w_x, loss_x in ((w_d, loss_d), (w_b, loss_b), (w_h, loss_h)):
    np.testing.assert_allclose(_array(w_s), _array(w_x), **tol, err_msg=f"{what} dense layers")
    np.testing.assert_allclose(_array(loss_s), _array(loss_x), **tol, err_msg=f"{what} losses")
  before_table = emb.embedding_tables(sharded.init[0])["table"]
  assert not np.allclose(got, before_table), f"{rows} rows: the table did not move"


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


EXCHANGES = ("all-to-all", "all-gather", "reduce-scatter")  # the embedding's exchanges (both layouts)


def exchange_bytes(hlo: str, ops: tuple[str, ...]) -> tuple[str, int]:
  """(``"<count> <op>, ..."`` of the `ops` present, their operand bytes per device in all)."""
  found = {op: collective_bytes(hlo, op) for op in ops}
  return (", ".join(f"{c} {op}" for op, (c, _) in found.items() if c) or "none",
          sum(b for _, b in found.values()))


def program_bytes(compiled: Any) -> tuple[int, int] | tuple[None, None]:
  """(arguments + outputs + temporaries - aliased, temporaries) of a compiled program, per device (XLA)."""
  try:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes,
            m.temp_size_in_bytes)
  except Exception:  # pylint: disable=broad-except  # a backend without memory_analysis
    return None, None


def fmt_bytes(x: int | None) -> str:
  if x is None:
    return "n/a"
  for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if x >= scale:
      return f"{x / scale:.3g} {unit}"
  return f"{x} B"


def bench_one(strategy: tpustrat.Strategy, rows: int, args: argparse.Namespace) -> dict[str, Any]:
  emb, variants = make_variants(strategy, rows, args.dim, args.optimizer)
  steps, trials = default_plan(rows)
  steps, trials = args.steps or steps, args.trials or trials
  check_same(emb, variants, rows)
  print(f"# {rows} rows: results allclose; timing {trials} trials x {steps} steps per variant ...",
        flush=True)
  for v in variants:
    v.run(steps)  # warm-up
  with h.no_compilation():
    times = h.time_rounds(variants, trials, h.permutation_schedule(variants),
                          lambda v: v.run(steps)[0] / steps * 1e6)
  compiled = {v.name: v.compiled() for v in variants}
  row = {"rows": rows, "steps": steps, "trials": trials,
         "paired": h.spread(h.paired_ratios(times[SHARDED], times[REPLICATED])),
         "paired_before": h.spread(h.paired_ratios(times[BEFORE], times[REPLICATED])),
         "vs_before": h.spread(h.paired_ratios(times[SHARDED], times[BEFORE])),
         "hand_vs": h.spread(h.paired_ratios(times[HAND], times[SHARDED])),
         "table_s": device0_bytes((variants[0].init[0]["tables"], variants[0].init[0]["slots"])),
         "table_d": device0_bytes(variants[2].init[0]), "mem_target": -(-rows // strategy.num_replicas_in_sync) / rows,
         "block": -(-rows // strategy.num_replicas_in_sync) * args.dim * 4}
  for v in variants:
    row[f"us {v.name}"] = statistics.median(times[v.name])
    row[f"prog {v.name}"], row[f"temp {v.name}"] = program_bytes(compiled[v.name])
    row[f"a2a {v.name}"] = exchange_bytes(compiled[v.name].as_text(), EXCHANGES)
  row["ar replicated"] = collective_bytes(compiled[REPLICATED].as_text(), "all-reduce")
  row["hand ops"] = exchange_bytes(compiled[HAND].as_text(), EXCHANGES + ("all-reduce", "collective-permute"))
  del emb, variants, compiled
  gc.collect()
  return row


def crossover(rows: list[dict[str, Any]], key: str = "paired") -> tuple[str, float | None]:
  """Where the median paired ratio (`key`) crosses 1 over the measured table sizes: (text, rows or None)."""
  faster = [r[key][0] <= 1.0 for r in rows]
  sizes = [r["rows"] for r in rows]
  if all(faster):
    return f"no slower at every measured size ({sizes[0]} to {sizes[-1]} rows)", float(sizes[0])
  if not any(faster):
    return f"slower at every measured size ({sizes[0]} to {sizes[-1]} rows)", None
  first = faster.index(True)
  if first > 0 and all(faster[first:]):
    lo, hi = rows[first - 1], rows[first]
    # log-linear interpolation of the ratio between the two sizes around 1.0
    x0, x1 = np.log10(lo["rows"]), np.log10(hi["rows"])
    y0, y1 = lo[key][0], hi[key][0]
    at = 10 ** (x0 + (1.0 - y0) * (x1 - x0) / (y1 - y0)) if y1 != y0 else hi["rows"]
    return (f"faster from between {lo['rows']} rows (ratio {y0:.2f}) and {hi['rows']} rows (ratio {y1:.2f}), "
            f"about {at:.2g} rows by log-linear interpolation", float(at))
  return "no single crossover: " + ", ".join(f"{s} rows {r[key][0]:.2f}" for s, r in zip(sizes, rows)), None


# -- the exchange figures (compiled programs, not timed) ----------------------------------------------


FIGURE_ROWS = 100_000  # rows per table of the exchange figures: buckets hold min(M, V/N) = M ids here
FIGURE_DIMS = (64, 32)  # the tables of the 8-table model alternate these widths


def multi_table_step(emb: embedding.TPUEmbedding, names: list[str]) -> Callable[..., Any]:
  def step(carry, ids, y):
    state, w = carry
    feats = {k: ids for k in names}
    acts = emb.lookup(state, feats)

    def loss_fn(acts, w):
      x = jnp.concatenate([acts[k] for k in names], axis=1)
      return jnp.sum((x @ w - y) ** 2) / GLOBAL_BATCH

    loss, (g_act, g_w) = jax.value_and_grad(loss_fn, argnums=(0, 1))(acts, w)
    return (emb.apply_gradients(state, feats, g_act), w - LR * g_w), lax.psum(loss, "replica")

  return step


LAYOUTS = ("all_to_all", "all_gather_table", "all_gather_ids")  # TPUEmbedding's layouts (see its docstring)


def exchange_counts(strategy: tpustrat.Strategy, tables: int) -> dict[str, tuple[str, int]]:
  """{variant: (exchanges, operand bytes) in the compiled step} of a model with `tables` tables (one
  feature each, widths alternating `FIGURE_DIMS`): the library with every table on each layout in turn
  (the size rule would pick all_gather_ids here; ``_forced_layout`` is the test hook that overrides it),
  and the before-path."""
  n = strategy.num_replicas_in_sync
  b = GLOBAL_BATCH // n
  dims = [FIGURE_DIMS[i % len(FIGURE_DIMS)] for i in range(tables)]
  names = [f"f{i}" for i in range(tables)]
  rng = np.random.default_rng(tables)
  ids = rng.integers(0, FIGURE_ROWS, size=(n, b, IDS_PER_EXAMPLE)).astype(np.int32)
  ys = rng.standard_normal((n, b, OUT)).astype(np.float32)
  data = _data(strategy, ids, ys)
  w = tpustrat.Mirrored.from_global(jax.device_put(np.zeros((sum(dims), OUT), np.float32),
                                                   NamedSharding(strategy.mesh, P())))
  out = {}
  for label in (*LAYOUTS, BEFORE):
    configs = {k: embedding.FeatureConfig(embedding.TableConfig(
        FIGURE_ROWS, d, combiner="mean", name=f"t{i}", initializer=lambda s, t: jnp.zeros(s, t)), name=k)
        for i, (k, d) in enumerate(zip(names, dims))}
    emb = (PerTableEmbedding if label == BEFORE else embedding.TPUEmbedding)(configs, embedding.SGD(LR), strategy)
    if label != BEFORE:
      emb._forced_layout = label
    step = multi_table_step(emb, names)
    hlo = jax.jit(lambda carry, *d, step=step: strategy.run(step, args=(carry,) + d)).lower(
        (emb.build(), w), *data).compile().as_text()
    out[label] = exchange_bytes(hlo, EXCHANGES)
  return out


def duplicate_ids(n: int, b: int, rows: int, seed: int = 5) -> np.ndarray:
  """[n, b, IDS_PER_EXAMPLE] ids, half of each replica's ids duplicates: b * L / 2 distinct uniform ids,
  each used twice, shuffled over the replica's examples and positions."""
  rng = np.random.default_rng(seed)
  m = b * IDS_PER_EXAMPLE
  out = np.empty((n, m), np.int32)
  for r in range(n):
    distinct = rng.choice(rows, m // 2, replace=False)
    out[r] = rng.permutation(np.concatenate([distinct, distinct]))
  return out.reshape(n, b, IDS_PER_EXAMPLE)


def dedup_bytes(strategy: tpustrat.Strategy, dim: int, optimizer: str) -> dict[str, Any]:
  """The bytes of the exchanges on a batch with 50% duplicate ids (`duplicate_ids`): compiled (HLO
  all-to-all operands) for the before-path, the library with its default buckets, and the library with
  ``max_unique_ids_per_partition`` set to the batch's largest count of distinct ids per (replica, owner)
  (what `check_ids` accepts), next to the buckets the same bound would need counting every occurrence;
  and payload (the ids and rows that fill bucket slots). The bounded library step is checked against
  the before-path (allclose)."""
  n = strategy.num_replicas_in_sync
  b = GLOBAL_BATCH // n
  rows = FIGURE_ROWS
  ids = duplicate_ids(n, b, rows)
  ys = np.random.default_rng(6).standard_normal((n, b, OUT)).astype(np.float32)
  data = _data(strategy, ids, ys)
  per_owner = -(-rows // n)
  raw = max(int(np.bincount(ids[r].reshape(-1) // per_owner, minlength=n).max()) for r in range(n))
  distinct = max(int(np.bincount(np.unique(ids[r]) // per_owner, minlength=n).max()) for r in range(n))
  w = tpustrat.Mirrored.from_global(jax.device_put(np.full((dim, OUT), 0.1, np.float32),
                                                   NamedSharding(strategy.mesh, P())))
  embs = {BEFORE: _feature_embedding(PerTableEmbedding, strategy, rows, dim, optimizer),
          SHARDED: _feature_embedding(embedding.TPUEmbedding, strategy, rows, dim, optimizer),
          "bounded": _feature_embedding(embedding.TPUEmbedding, strategy, rows, dim, optimizer,
                                        max_unique_ids_per_partition=distinct),
          "bounded, no dedup": _feature_embedding(embedding.TPUEmbedding, strategy, rows, dim, optimizer,
                                                  max_ids_per_partition=raw)}
  state = embs[SHARDED].build(seed=0)
  out: dict[str, Any] = {"raw": raw, "distinct": distinct}
  results = {}
  for label, emb in embs.items():
    step = make_sharded_step(emb)
    compiled = jax.jit(lambda carry, *d, step=step: strategy.run(step, args=(carry,) + d)).lower(
        (state, w), *data).compile()
    out[label] = exchange_bytes(compiled.as_text(), EXCHANGES)
    if label in (BEFORE, "bounded"):
      carry = (state, w)
      for _ in range(CHECK_STEPS):
        carry, loss = strategy.run(step, args=(carry,) + data)
      results[label] = (emb.embedding_tables(carry[0])["table"], _array(loss))
  for a, b_ in zip(results[BEFORE], results["bounded"]):
    np.testing.assert_allclose(b_, a, rtol=1e-5, atol=1e-6, err_msg="50% duplicates: bounded and before differ")
  m = b * IDS_PER_EXAMPLE
  unique_sent = sum(len(np.unique(ids[r])) for r in range(n)) / n  # per replica
  out["payload before"] = m * (4 + 2 * 4 * dim)  # ids once (merged), rows back, gradients out
  out["payload"] = unique_sent * (4 + 2 * 4 * dim)
  return out


def main(args: argparse.Namespace) -> int:
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  print(h.machine_line(n))
  sizes = [int(float(s)) for s in args.rows.split(",") if s.strip()]
  t_start = time.perf_counter()
  rows = [bench_one(strategy, v, args) for v in sizes]
  counts = {t: exchange_counts(strategy, t) for t in (1, args.tables)}
  dup = dedup_bytes(strategy, args.dim, args.optimizer)
  print(f"# 50% duplicates: bounded and before allclose; total {time.perf_counter() - t_start:.0f} s")
  print()
  columns = ["rows", "optimizer", "steps x trials", "sharded us/step", "before us/step", "replicated us/step",
             "hand-written us/step", "sharded / replicated [p25, p75]", "before / replicated", "sharded / before",
             "hand-written / sharded [p25, p75]",
             "table+slots/device sharded", "replicated", "memory target", "temporaries sharded (block)",
             "before", "exchanged/replica/step sharded (ops)", "before (ops)", "replicated all-reduce (ops)",
             "hand-written collectives (ops)"]
  print(h.markdown_header(columns, right={"sharded us/step", "before us/step", "replicated us/step",
                                          "hand-written us/step"}))
  for r in rows:
    mem_ratio = r["table_s"] / r["table_d"]
    mem_verdict = h.verdict(f"{mem_ratio:.4f} <= 1/{n} + pad = {r['mem_target']:.4f}",
                            mem_ratio <= r["mem_target"] + 1e-12)
    a2a = {k: f"{fmt_bytes(r[f'a2a {k}'][1])} ({r[f'a2a {k}'][0]})" for k in (SHARDED, BEFORE)}
    print(h.markdown_row([
        r["rows"], args.optimizer, f"{r['steps']} x {r['trials']}", f"{r['us ' + SHARDED]:.0f}",
        f"{r['us ' + BEFORE]:.0f}", f"{r['us ' + REPLICATED]:.0f}", f"{r['us ' + HAND]:.0f}",
        h.format_spread(r["paired"], 3), f"{r['paired_before'][0]:.3f}", f"{r['vs_before'][0]:.3f}",
        h.format_spread(r["hand_vs"], 3), fmt_bytes(r["table_s"]), fmt_bytes(r["table_d"]),
        mem_verdict, f"{fmt_bytes(r['temp ' + SHARDED])} ({fmt_bytes(r['block'])})", fmt_bytes(r["temp " + BEFORE]),
        a2a[SHARDED], a2a[BEFORE],
        f"{fmt_bytes(r['ar replicated'][1])} ({r['ar replicated'][0]})",
        f"{fmt_bytes(r['hand ops'][1])} ({r['hand ops'][0]})"]))
  print()

  # The issue's four figures, with their targets.
  figures = []
  at = [r for r in rows if r["rows"] == STEP_TARGET_ROWS]
  if at:
    r = at[0]
    us, before = r["us " + SHARDED], r["us " + BEFORE]
    figures.append((f"sharded step time at {STEP_TARGET_ROWS:,} rows", f"{before / 1e3:.0f} ms",
                    f"{us / 1e3:.1f} ms ({r['vs_before'][0]:.3f}x)", f"<= {STEP_TARGET_MS} ms",
                    us / 1e3 <= STEP_TARGET_MS))
  else:
    figures.append((f"sharded step time at {STEP_TARGET_ROWS:,} rows", "not measured (--rows)", "", "", None))
  text_b, _ = crossover(rows, "paired_before")
  text_s, at_rows = crossover(rows, "paired")
  measured_from = [r for r in rows if r["rows"] >= CROSSOVER_TARGET]
  # met: the sharded table is no slower from some measured size <= the target on, at every larger size
  met = (at_rows is not None and at_rows <= CROSSOVER_TARGET and bool(measured_from)
         and all(r["paired"][0] <= 1.0 for r in measured_from))
  figures.append(("crossover vs replicated", text_b, text_s, f"<= {CROSSOVER_TARGET:,} rows",
                  met if measured_from else None))
  at = [r for r in rows if r["rows"] == STEP_TARGET_ROWS] or rows[-1:]
  if at:
    r = at[0]
    figures.append((f"hand-written jax.jit (XLA SPMD) / sharded step time at {r['rows']:,} rows", "",
                    f"{h.format_spread(r['hand_vs'], 3)} ({r['us ' + HAND] / 1e3:.1f} ms vs "
                    f"{r['us ' + SHARDED] / 1e3:.1f} ms); smallest over sizes: "
                    f"{min(x['hand_vs'][0] for x in rows):.3f} at "
                    f"{min(rows, key=lambda x: x['hand_vs'][0])['rows']} rows",
                    f">= {HAND_TARGET}", r["hand_vs"][0] >= HAND_TARGET))
  one, many = counts[1], counts[args.tables]
  figures.append((f"exchanges per step, {args.tables} tables vs 1", f"{many[BEFORE][0]} vs {one[BEFORE][0]}",
                  "; ".join(f"{k}: {many[k][0]} vs {one[k][0]}" for k in LAYOUTS), "same as 1 table",
                  all(many[k][0] == one[k][0] for k in LAYOUTS)))
  ratio_c = dup["bounded"][1] / dup[BEFORE][1]
  ratio_p = dup["payload"] / dup["payload before"]
  figures.append(("bytes exchanged per replica and step, 50% duplicate ids",
                  f"{fmt_bytes(dup[BEFORE][1])} compiled; {fmt_bytes(dup['payload before'])} payload",
                  f"{fmt_bytes(dup['bounded'][1])} compiled ({ratio_c:.3f}x) with max_unique_ids_per_partition="
                  f"{dup['distinct']} ({fmt_bytes(dup['bounded, no dedup'][1])} if sized for every occurrence, "
                  f"max_ids_per_partition={dup['raw']}; {fmt_bytes(dup[SHARDED][1])} unbounded, "
                  f"{dup[SHARDED][0]}); "
                  f"{fmt_bytes(dup['payload'])} payload ({ratio_p:.3f}x)",
                  f"<= {BYTES_TARGET}x", ratio_c <= BYTES_TARGET and ratio_p <= BYTES_TARGET))
  print(h.markdown_header(["figure", "before (today's code path, same run)", "now", "target", "verdict"]))
  for name, before, now, target, met in figures:
    print(h.markdown_row([name, before, now, target, "-" if met is None else ("met" if met else "MISSED")]))
    if hasattr(h, "figure"):
      h.figure(f"embedding: {name}", now, target, met)
  print()
  print("sharded: TPUEmbedding, state donated (RunOptions(donate_argnums=0)); before: the code path before "
        "issue 25 (benchmarks/_embedding_per_table.py: per-table exchanges, worst-case buckets, dense [V/N, D] "
        "gradient, state not donated); replicated: a Mirrored table, dense gradient all-reduced, state donated. "
        "us/step: median over trials of (time for `steps` chained steps, until the last is ready) / steps. "
        "ratios: median per-round paired ratios. table+slots/device: bytes on device 0 of the table and "
        "optimizer-slot arrays; memory target: sharded / replicated <= ceil(V/N) / V. temporaries: XLA "
        "memory_analysis temp bytes of the compiled step (the block it would copy: in parentheses). "
        "exchanged: operand bytes of the all-to-all, all-gather and reduce-scatter ops each replica runs per "
        "step in the compiled HLO (own block included), the ops in parentheses. hand-written: jax.jit of the "
        "same step on a NamedSharding row-sharded [V, D] table (XLA SPMD). Figures: step time from the table; "
        "crossover where the paired ratio vs replicated crosses 1 (log-linear interpolation); exchanges "
        f"counted in the compiled step of {args.tables} tables of {FIGURE_ROWS} rows (widths alternating "
        f"{FIGURE_DIMS}, one feature each) and of 1, every table on each layout; bytes: compiled exchange "
        "operands, and payload = ids and rows filling bucket slots (ids once, rows back, gradients out).")
  return 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
