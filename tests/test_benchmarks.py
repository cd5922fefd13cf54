"""Smoke test of `benchmarks/`: every script runs, its variants agree, and it reports one row per variant.

Each script is run as `make bench` / the README run it: a fresh process from the repository root on 8
emulated CPU devices (``--cpu-devices 8``, `benchmarks/_harness.py`), here with the flags that add every
variant the README's commands time (``--noise-floor``, ``--mechanisms``, ``--algorithms``,
``--extra-rows``, ``--buffer``, ``--hidden``, ``--only``, ``--watchdog``, ``--check-numerics``) and the fewest steps, trials and bytes the
flags allow. Before timing, every script asserts that its variants compute the same results (allclose)
and prints a line saying so; a failed check exits non-zero. The test checks the exit status, that line,
and the names of the rows of the printed markdown table, never the timings or ratios in it (timed tests
are not allowed: the machines running them are shared and noisy).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TIMEOUT_S = 300  # a hang fails the test instead of blocking the run

TINY = "tiny step (dispatch-bound)"
MLP = "MLP 784-1024-1024-10, batch 512"

_COLLECTIVE_VARIANTS = ["pmap native (copy 2)", "tpustrat", "op without run", "scatter_gather", "doubling",
                        "stacked"]
_CDO_VARIANTS = [
    "per tensor", "per tensor (copy 2)", "per tensor, combiner off",
    "num_packs=1", "num_packs=2", "num_packs=4", "num_packs=8",
    "bytes_per_pack=1 MiB", "bytes_per_pack=4 MiB", "bytes_per_pack=16 MiB",
    "agg small <=16 KiB x10", "agg small <=32 KiB x10", "agg small <=32 KiB x32", "agg small <=256 KiB x32",
    "hierarchical copy, num_packs=1", "ring, num_packs=1", "to one device, 4 MiB packs",
]
_INPUT_LOOPS = ["on device", "iterator", "iterator, no prefetch", "bare device_put"]
_KS = (1, 10)  # 10: the k the tiny step's target row is reported for (the models run k = 1, 2)
_MODEL_SIZES = ("--conv-batch", "16", "--conv-width", "4", "--tf-batch", "8", "--tf-seq-len", "16", "--tf-layers", "1",
                "--tf-d-model", "32")
CONV = "convnet 28x28x1, 4/8 channels, batch 16"
TRANSFORMER = "char transformer 1 x 32, 16 tokens, batch 8"


@dataclasses.dataclass(frozen=True)
class Case:
  """One run of a script: its flags, the "results agree" lines it must print, and its table's rows.

  `key` names the table columns that identify a row; `rows` lists each expected row as the values of
  those columns, in printing order.
  """

  script: str
  flags: tuple[str, ...]
  agree: tuple[str, ...]
  key: tuple[str, ...]
  rows: tuple[tuple[str, ...], ...]
  table: int = 0  # which table of the output the rows are checked in
  more: tuple[tuple[int, tuple[str, ...], tuple[tuple[str, ...], ...]], ...] = ()  # (table, key, rows) of others


CASES = {
    # `bench_keras_fit.py` (fit under TPUStrategy, Keras's DataParallel fit, tpustrat's run loop), the MLP at
    # one batch and both steps_per_execution, the fewest steps.
    "keras_fit": Case(
        "bench_keras_fit.py", ("--models", "mlp", "--batches", "64", "--spes", "1", "2", "--steps", "2",
                               "--trials", "1"),
        ("# mlp b64 spe1: weights allclose", "# mlp b64 spe2: weights allclose"),
        ("model", "batch", "spe"), (("mlp", "64", "1"), ("mlp", "64", "2"))),
    # README: `bench_run.py --noise-floor` (both steps, the hand-written second copy) and `--only mlp
    # --check-numerics` (run with RunOptions(check_numerics=True), against run; the same flags hand-written,
    # against the hand-written step), in one run.
    "run": Case(
        "bench_run.py", ("--noise-floor", "--check-numerics", "--steps", "2", "--trials", "2"),
        ("# tiny: results allclose;", "# mlp: results allclose;"),
        ("step", "variant", "steps x trials"),
        tuple((label, variant, "2 x 2") for label in (TINY, MLP)
              for variant in ("tpustrat", "hand-written (copy 2)", "tpustrat + check_numerics",
                              "hand-written + NaN / Inf flags"))),
    # README: `bench_run.py --only tiny --watchdog` (run with the step watchdog on, against run without it) and
    # `--only tiny --step-stats` (run, whose step counters are on, against run with them off), in one run.
    "run-only-tiny": Case(
        "bench_run.py", ("--only", "tiny", "--watchdog", "--step-stats", "--steps", "3", "--trials", "1"),
        ("# tiny: results allclose;", "step counters alone"),
        ("step", "variant", "steps x trials"),
        ((TINY, "tpustrat", "3 x 1"), (TINY, "tpustrat + step watchdog", "3 x 1"),
         (TINY, "tpustrat (step counters on)", "3 x 1"))),
    # README: `bench_run.py --devices 1` (one device, nothing emulated, the step watchdog on): run's host cost
    # per call over the hand-written jax.jit.
    "run-one-device": Case(
        "bench_run.py", ("--devices", "1", "--only", "tiny", "--steps", "3", "--trials", "1"),
        ("# tiny: results allclose;",),
        ("step", "variant", "steps x trials"),
        ((TINY, "tpustrat", "3 x 1"),)),
    # README: `bench_collectives.py --mechanisms --noise-floor` with both default group shapes, at 1/4 MiB.
    "collectives": Case(
        "bench_collectives.py",
        ("--mechanisms", "--noise-floor", "--sizes-mib", "0.25", "--groups", "2x4,4x2", "--trials", "2", "--calls", "1"),
        ("# 2 groups of 4, 0.25 MiB/replica: results allclose;", "# 4 groups of 2, 0.25 MiB/replica: results allclose;"),
        ("groups, size", "variant", "trials x calls"),
        tuple((f"{groups}, 0.25 MiB/replica", variant, "2 x 1")
              for groups in ("2 groups of 4", "4 groups of 2") for variant in _COLLECTIVE_VARIANTS)),
    # README: `bench_input.py --steps 40 --trials 21 --buffer 2 --extra-rows`, on small batches.
    "input": Case(
        "bench_input.py",
        ("--extra-rows", "--buffer", "2", "--steps", "2", "--trials", "2", "--batch", "64", "--features", "48",
         "--distinct", "2"),
        ("# results allclose; batch 64 x 48 float32",),
        ("loop",),
        tuple((loop,) for loop in _INPUT_LOOPS)),
    # README: `--hidden 256` (a ReLU layer: the other model), the library's default buffer.
    "input-hidden": Case(
        "bench_input.py",
        ("--extra-rows", "--hidden", "16", "--steps", "2", "--trials", "2", "--batch", "64", "--features", "48",
         "--distinct", "2"),
        ("# results allclose; batch 64 x 48 float32",),
        ("loop",),
        tuple((loop,) for loop in _INPUT_LOOPS)),
    # README: `bench_cross_device_ops.py --algorithms --noise-floor`; the 161 tensors at width 1/16 (0.9 MiB).
    "cross-device-ops": Case(
        "bench_cross_device_ops.py",
        ("--algorithms", "--noise-floor", "--width", "0.0625", "--trials", "2", "--calls", "1"),
        ("# results allclose to per tensor;",),
        ("variant",),
        tuple((v,) for v in _CDO_VARIANTS)),
    # README: `bench_cross_device_ops.py --only "num_packs=1,agg small <=32"` (a subset, plus the baseline).
    "cross-device-ops-only": Case(
        "bench_cross_device_ops.py",
        ("--only", "num_packs=1,agg small <=32", "--width", "0.0625", "--trials", "1", "--calls", "1"),
        ("# results allclose to per tensor;",),
        ("variant",),
        (("per tensor",), ("num_packs=1",), ("agg small <=32 KiB x10",), ("agg small <=32 KiB x32",))),
    # README: `bench_multistep.py` (tiny with the input family, mlp, and the conv and transformer steps against
    # the one-device control, rolled and unrolled), with k = 1, 10 (the models: 1, 2), at tiny sizes.
    "multistep": Case(
        "bench_multistep.py", ("--ks", *map(str, _KS), "--model-ks", "1", "2", "--steps", "10", "--trials", "1",
                               *_MODEL_SIZES),
        ("# tiny: final states allclose;", "# mlp: final states allclose;", "# conv: final states allclose;",
         "# transformer: final states allclose;"),
        ("step", "variant", "steps per program (k)", "steps x trials"),
        tuple((TINY, family, str(k), "10 x 1") for family in ("tpustrat", "plain JAX", "tpustrat + input")
              for k in _KS)
        + tuple((MLP, family, str(k), "10 x 1") for family in ("tpustrat", "plain JAX") for k in _KS)
        + tuple((label, family, k, "10 x 1") for label in (CONV, TRANSFORMER)
                for family, k in (("tpustrat", "1"), ("tpustrat", "2"), ("tpustrat, scan_unroll=True", "2"),
                                  ("one device, jit", "1"), ("one device, jit", "2"),
                                  ("one device, jit, unroll=True", "2")))),
    # README: `bench_embedding.py` (sharded against replicated tables), on one small table.
    "embedding": Case(
        "bench_embedding.py", ("--rows", "1000", "--steps", "2", "--trials", "1"),
        ("# 1000 rows: results allclose;",),
        ("rows", "optimizer", "steps x trials"),
        (("1000", "sgd", "2 x 1"),)),
    # README: `bench_sharding.py` (donation, FSDP, per-layer gathering), on a tiny transformer: the memory
    # table, then the step timing (FSDP against data parallel and hand-written FSDP).
    "sharding": Case(
        "bench_sharding.py", ("--layers", "1", "--d-model", "32", "--batch", "8", "--seq-len", "16",
                              "--trials", "1", "--steps", "1"),
        ("# new states allclose (donated vs not; FSDP vs data parallel; hand-written FSDP)",),
        ("variant",),
        (("data parallel",), ("data parallel, state donated",), ("data parallel, remat, state donated",),
         ("FSDP, state donated",), ("FSDP, per-layer gathering, donated",)),
        more=((1, ("variant", "throughput vs"),
               (("data parallel, state donated", ""), ("FSDP, state donated", "data parallel, state donated"),
                ("FSDP, per-layer gathering, donated", "data parallel, state donated"),
                ("FSDP, state donated", "hand-written FSDP"), ("hand-written FSDP", ""))),)),
    # `bench_hybrid.py` (its docstring's smoke command, on 2 processes x 2 devices): data parallel, full FSDP
    # and hybrid through tpustrat and the hand-written expert and naive programs; bytes and state only.
    "hybrid": Case(
        "bench_hybrid.py", ("--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch", "8", "--trials", "0",
                            "--devices", "2"),
        ("# new parameters allclose (full FSDP, hybrid, expert and naive hand-written vs data parallel)",),
        ("variant",),
        tuple((v,) for v in ("data parallel", "full FSDP", "hybrid", "expert FSDP", "expert hybrid", "naive FSDP",
                             "naive hybrid"))),
    # `bench_processes.py` (the job's own per-step cost as processes grow), on 1 and 2 processes.
    "processes": Case(
        "bench_processes.py", ("--processes", "1", "2", "--steps", "20", "--trials", "1", "--kv-seconds", "0.2",
                               "--rate-seconds", "1.5"),
        ("# results allclose to numpy on every process of 1, 2 processes",),
        ("processes x devices", "steps x trials"),
        (("1 x 1", "20 x 1"), ("2 x 1", "20 x 1"))),
    # README: `bench_accumulation.py` (k = 1, 2, 4, 8 micro-batches in one program), on a tiny MLP: memory
    # table, then the step-time table.
    "accumulation": Case(
        "bench_accumulation.py", ("--width", "32", "--rows", "64", "--layers", "2", "--ks", "1,2,4",
                                  "--trials", "1", "--steps", "1"),
        ("# loss and gradients allclose to k=1's (k = 2, 4)",),
        ("model", "k"),
        tuple(("MLP 2 x 32", k) for k in ("1", "2", "4")),
        more=((1, ("model", "k"), tuple(("MLP 2 x 32", k) for k in ("1", "2", "4"))),)),
    # `bench_peers.py` (its docstring's command): tpustrat, hand-written JAX and, where it is installed
    # (the `bench` extra), Keras 3; then compile times at k = 1, 8, 64. Without Keras its rows are left out.
    "peers": Case(
        "bench_peers.py", ("--steps", "10", "--trials", "1", "--compile-trials", "1"),
        ("# parameters after 10 steps allclose",),
        ("measure", "variant", "k", "runs"),
        tuple(("steps/s", variant, k, "10 steps x 1") for variant, k in
              [("tpustrat run", "1"), ("tpustrat experimental_run_steps", "10"),
               ("hand-written jit(shard_map)", "1")]
              + ([("Keras 3 fit, DataParallel", "1"), ("Keras 3 fit, DataParallel", "10")]
                 if importlib.util.find_spec("keras") is not None else []))
        + tuple(("compile s", variant, k, "fresh fn x 1")
                for variant in ("tpustrat experimental_run_steps", "hand-written jit(scan(shard_map))")
                for k in ("1", "8", "64"))),
    # README: `bench_compile_cache.py` (the char transformer started twice on one compilation cache), tiny.
    "compile-cache": Case(
        "bench_compile_cache.py", ("--pairs", "1", "--layers", "1", "--d-model", "32", "--seq-len", "16",
                                   "--batch", "16", "--max-files", "20"),
        ("# the same first loss",),
        ("pair", "start"),  # the script asserts that the second start's compile requests were all cache hits
        (("1", "first (empty cache)"), ("1", "second"))),
}


def run_script(script: str, *flags: str) -> str:
  """Runs ``benchmarks/SCRIPT FLAGS --cpu-devices 8`` from the repository root; returns stdout + stderr."""
  env = dict(os.environ)  # the script configures the devices itself (conftest.py left no count)
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, str(BENCHMARKS / script), *flags, "--cpu-devices", "8"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"{script} {' '.join(flags)} exited with {proc.returncode}:\n{out[-8000:]}"
  return proc.stdout


def markdown_table(text: str, which: int = 0) -> list[dict[str, str]]:
  """The rows of markdown table number `which` in `text` (tables are runs of lines starting with "|"),
  each as {column name: cell}."""
  tables, previous = [], False
  for line in text.splitlines():
    row = line.startswith("|")
    if row and not previous:
      tables.append([])
    if row:
      tables[-1].append(line)
    previous = row
  assert len(tables) > which, f"no markdown table number {which} in:\n{text}"
  lines = tables[which]
  assert len(lines) >= 2, f"no markdown table in:\n{text}"
  def cells(line: str) -> list[str]:
    assert line.endswith("|"), line
    return [c.strip() for c in line[1:-1].split("|")]

  header, rule, *rows = (cells(line) for line in lines)
  assert all(set(c) <= set("-:") and c for c in rule) and len(rule) == len(header), lines[1]
  assert all(len(r) == len(header) for r in rows), lines
  return [dict(zip(header, r)) for r in rows]


def test_markdown_table_parser():
  text = "# a comment\n\n| a | b c |\n|---|---:|\n| x, y | 1.0 [0.9, 1.1] |\n| z |  |\n\nfooter\n"
  assert markdown_table(text) == [{"a": "x, y", "b c": "1.0 [0.9, 1.1]"}, {"a": "z", "b c": ""}]
  two = text + "\n| c |\n|---|\n| 3 |\n"
  assert markdown_table(two, 1) == [{"c": "3"}] and markdown_table(two) == markdown_table(text)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.processes
def test_benchmark_runs_and_its_variants_agree(name):
  case = CASES[name]
  out = run_script(case.script, *case.flags)
  assert out.startswith("# jax "), out[:500]  # the machine line
  for line in case.agree:
    assert sum(x.startswith(line) for x in out.splitlines()) == 1, f"missing {line!r} in:\n{out}"
  for table, key, expected in ((case.table, case.key, case.rows), *case.more):
    rows = markdown_table(out, table)
    assert [tuple(r[c] for c in key) for r in rows] == list(expected), out
  # The headline figures for run_all.py: `# FIGURE | name | value | target | verdict` lines at the end.
  figures = [line.split(" | ")[1:] for line in out.splitlines() if line.startswith("# FIGURE | ")]
  assert figures and all(len(f) == 4 and f[3] in ("met", "MISSED", "-") for f in figures), out[-3000:]


@pytest.mark.processes
def test_run_all_writes_one_table_of_every_figure(tmp_path):
  """`make bench` (`benchmarks/run_all.py`), here `--quick` on one script: the table of figures, with the
  platform and JAX version of each, to stdout and to the output file."""
  output = tmp_path / "RESULTS.md"
  env = dict(os.environ)
  proc = subprocess.run([sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "--only", "run",
                         "--output", str(output)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr[-5000:]
  assert output.read_text().strip() == proc.stdout.strip()
  rows = markdown_table(proc.stdout)
  # bench_run's two entries: 8 emulated devices, then one device (the host cost per call)
  assert [r["benchmark"] for r in rows][:1] == ["run"] and set(r["benchmark"] for r in rows) == {"run"}
  assert rows[0]["figure"].startswith("strategy.run, tiny step")
  assert rows[0]["platform"].startswith("cpu (cpu), 8 emulated devices") and rows[0]["JAX"] == jax.__version__
  assert rows[0]["target"] == "<= 1.05x" and rows[0]["verdict"] in ("met", "MISSED")
  assert "none of them has been measured on a GPU or TPU" in proc.stdout
  assert "python benchmarks/bench_run.py --only tiny --steps 3 --trials 1" in proc.stdout
