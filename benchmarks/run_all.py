"""Every benchmark in one command (``make bench``): one markdown table of every figure, with its platform.

Runs each ``benchmarks/bench_*.py`` script in a fresh process, one after another, with settings chosen so
that the whole run finishes within about 8 minutes on a 2-core machine with 8 emulated CPU devices (fewer
trials and smaller sizes than each script's defaults, which the README's individual figures use). On a
machine whose JAX backend is a GPU or TPU (asked in a subprocess, so the accelerator stays free for the
scripts), each script gets the larger settings of `ACCELERATOR` instead (the largest tables, more trials).

Each script records its headline figures with `_harness.figure` and prints them at its end as ``# FIGURE
| name | value | target | verdict`` lines; its first line is the machine line (`_harness.machine_line`: JAX
version, replicas, platform). This script collects both and writes one table, to stdout and to
``benchmarks/RESULTS.md`` (``--output``):

    | benchmark | figure | value | target | verdict | platform | JAX |

with the command that reproduces each script's figures under it. A script that fails or runs past its
time limit gets a row saying so, and the run goes on; the exit status is 1 if any failed.

Usage (from the repository root)::

    .venv/bin/python benchmarks/run_all.py                   # every benchmark, about 8 min here
    .venv/bin/python benchmarks/run_all.py --only run,compile_cache
    .venv/bin/python benchmarks/run_all.py --quick           # each script's tiniest settings (a smoke test)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import re
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
FIGURE_PREFIX = "# FIGURE | "  # as `_harness.FIGURE_PREFIX` (not imported: that would import JAX here)
MACHINE = re.compile(r"^# jax (?P<jax>\S+), (?P<replicas>\d+) replicas on (?P<platform>\S+) \((?P<kind>[^)]*)\), "
                     r"(?P<cores>\d+) host cores")


@dataclasses.dataclass(frozen=True)
class Bench:
  """One script and its flags: on CPU (`cpu`, within the 8-minute budget), on an accelerator
  (`accelerator`), and in `--quick` mode (`quick`: the fewest steps and trials)."""

  name: str  # the script is benchmarks/bench_<name>.py
  cpu: tuple[str, ...]
  accelerator: tuple[str, ...]
  quick: tuple[str, ...]
  timeout_s: float = 240.0


BENCHES = [
    Bench("run", ("--trials", "31"), ("--noise-floor", "--watchdog", "--check-numerics"),
          ("--only", "tiny", "--steps", "3", "--trials", "1")),
    Bench("multistep", ("--only", "tiny", "--trials", "11", "--no-input"), ("--only", "tiny", "mlp"),
          ("--only", "tiny", "--ks", "1", "10", "--steps", "10", "--trials", "1", "--no-input")),
    Bench("multistep", ("--only", "conv", "transformer", "--trials", "3"),
          ("--only", "conv", "transformer", "--conv-batch", "512", "--tf-batch", "64", "--tf-d-model", "256",
           "--tf-layers", "4", "--tf-seq-len", "128"),
          ("--only", "conv", "transformer", "--model-ks", "1", "2", "--steps", "2", "--trials", "1",
           "--conv-batch", "16", "--conv-width", "4", "--tf-batch", "8", "--tf-seq-len", "16", "--tf-layers", "1",
           "--tf-d-model", "32")),
    # one device, nothing emulated: the host cost of `run` / `experimental_run_steps` per call (issue 45)
    Bench("run", ("--devices", "1", "--only", "tiny", "--steps", "500", "--trials", "31", "--check-numerics"),
          ("--devices", "1", "--check-numerics"),
          ("--devices", "1", "--only", "tiny", "--steps", "3", "--trials", "1")),
    Bench("multistep", ("--devices", "1", "--only", "tiny", "--no-input", "--trials", "21"),
          ("--devices", "1", "--only", "tiny", "mlp", "--no-input"),
          ("--devices", "1", "--only", "tiny", "--ks", "1", "10", "--steps", "10", "--trials", "1", "--no-input")),
    Bench("collectives", ("--sizes-mib", "1", "--trials", "11"), ("--sizes-mib", "1,64", "--noise-floor"),
          ("--sizes-mib", "0.25", "--groups", "2x4", "--trials", "1", "--calls", "1")),
    Bench("input", ("--steps", "16", "--trials", "9", "--extra-rows"), ("--extra-rows", "--prefetch-row"),
          ("--extra-rows", "--steps", "2", "--trials", "1", "--batch", "64", "--features", "48")),
    Bench("cross_device_ops", ("--width", "0.25", "--trials", "5", "--calls", "1", "--only", "agg small <=32 KiB x10"),
          ("--algorithms", "--noise-floor"),
          ("--width", "0.0625", "--trials", "1", "--calls", "1", "--only", "agg small <=32 KiB x10")),
    Bench("keras_fit", ("--models", "mlp", "--trials", "3"), ("--trials", "5"),
          ("--models", "mlp", "--batches", "64", "--spes", "1", "--steps", "2", "--trials", "1")),
    Bench("peers", ("--steps", "10", "--trials", "3", "--compile-trials", "2"), (),
          ("--steps", "10", "--trials", "1", "--compile-trials", "1", "--skip-keras")),
    Bench("embedding", ("--rows", "2000,5000,1000000", "--trials", "5"), (),
          ("--rows", "1000", "--steps", "2", "--trials", "1")),
    Bench("sharding", ("--trials", "2", "--steps", "1"), ("--large",),
          ("--layers", "2", "--d-model", "32", "--seq-len", "16", "--batch", "8", "--trials", "0")),
    Bench("accumulation", ("--trials", "3"), ("--model", "transformer"),
          ("--ks", "1,2,4", "--rows", "64", "--width", "32", "--layers", "2", "--trials", "0")),
    # 2 processes x 4 devices through the launcher; compiling seven variants in both dominates
    Bench("hybrid", ("--d-model", "64", "--trials", "3", "--steps", "2"), ("--d-model", "256", "--seq-len", "128"),
          ("--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch", "8", "--trials", "0"), timeout_s=900.0),
    Bench("processes", ("--steps", "50", "--trials", "5", "--rate-seconds", "3"), ("--trials", "11"),
          ("--processes", "1", "2", "--steps", "20", "--trials", "1", "--kv-seconds", "0.2", "--rate-seconds", "1.5"),
          timeout_s=600.0),
    # the first save of a Mirrored state against a later one (issue 45, item 5)
    Bench("checkpoint", ("--trials", "3"), ("--trials", "3"), ("--layers", "1", "--d-model", "32", "--saves", "2",
                                                              "--trials", "1")),
    Bench("compile_cache", ("--pairs", "2"), ("--pairs", "3", "--layers", "6", "--d-model", "512"),
          ("--pairs", "1", "--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch", "16", "--max-files", "20")),
]


@dataclasses.dataclass
class Outcome:
  bench: Bench
  flags: tuple[str, ...]
  seconds: float
  status: str  # "ok", "failed (status N)", "timed out after S s"
  machine: dict[str, str] | None
  figures: list[list[str]]
  tail: str


def backend() -> str:
  """JAX's default backend here (``cpu``, ``gpu``, ``tpu``), asked in a subprocess."""
  out = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                       text=True, check=False, timeout=300)
  return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "cpu"


def run(bench: Bench, flags: tuple[str, ...], timeout_s: float) -> Outcome:
  argv = [sys.executable, str(HERE / f"bench_{bench.name}.py"), *flags]
  t0 = time.perf_counter()
  try:
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
    stdout, status = out.stdout, "ok" if out.returncode == 0 else f"failed (status {out.returncode})"
    tail = (out.stdout + out.stderr)[-3000:]
  except subprocess.TimeoutExpired as e:
    stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    status, tail = f"timed out after {timeout_s:.0f} s", stdout[-3000:]
  machine = next((m.groupdict() for m in map(MACHINE.match, stdout.splitlines()) if m), None)
  figures = [line[len(FIGURE_PREFIX):].split(" | ") for line in stdout.splitlines() if line.startswith(FIGURE_PREFIX)]
  return Outcome(bench, flags, time.perf_counter() - t0, status, machine, figures, tail)


def platform(machine: dict[str, str] | None) -> str:
  if machine is None:
    return "?"
  emulated = " emulated" if machine["platform"] == "cpu" else ""
  return f"{machine['platform']} ({machine['kind']}), {machine['replicas']}{emulated} devices, {machine['cores']} cores"


def table(outcomes: list[Outcome], mode: str) -> str:
  lines = ["| benchmark | figure | value | target | verdict | platform | JAX |", "|---|---|---:|---|---|---|---|"]
  for o in outcomes:
    where = platform(o.machine)
    jax_version = o.machine["jax"] if o.machine else "?"
    if o.status != "ok":
      lines.append(f"| {o.bench.name} | (the script {o.status}) | | | | {where} | {jax_version} |")
    for name, value, target, verdict in ((f + ["", "", ""])[:4] for f in o.figures):
      lines.append(f"| {o.bench.name} | {name} | {value} | {target} | {verdict} | {where} | {jax_version} |")
  platforms = {o.machine["platform"] for o in outcomes if o.machine}
  never = ("Every figure above comes from the platform in its row; none of them has been measured on a GPU or TPU."
           if platforms <= {"cpu"} else "")
  commands = "\n".join(f"- `{o.bench.name}`: `python benchmarks/bench_{o.bench.name}.py {' '.join(_quote(f) for f in o.flags)}`"
                       f" ({o.seconds:.0f} s)" for o in outcomes)
  when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
  return "\n".join([f"# Benchmarks: every figure ({mode} settings, {when})", "", *lines, "",
                    *([never, ""] if never else []), f"Total {sum(o.seconds for o in outcomes):.0f} s. Commands:", "",
                    commands, ""])


def _quote(flag: str) -> str:
  return f"'{flag}'" if (" " in flag or "<" in flag) else flag


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--quick", action="store_true", help="each script's tiniest settings (seconds each)")
  parser.add_argument("--only", default="", help="comma-separated benchmark names (run, multistep, ...)")
  parser.add_argument("--output", default=str(HERE / "RESULTS.md"), help="where the table is written ('-': nowhere)")
  parser.add_argument("--backend", choices=("auto", "cpu", "accelerator"), default="auto",
                      help="which settings: auto asks JAX for its default backend")
  args = parser.parse_args(argv)
  names = [n for n in args.only.split(",") if n]
  unknown = set(names) - {b.name for b in BENCHES}
  if unknown:
    parser.error(f"unknown benchmarks {sorted(unknown)}; known: {', '.join(b.name for b in BENCHES)}")
  benches = [b for b in BENCHES if not names or b.name in names]
  accelerator = args.backend == "accelerator" or (args.backend == "auto" and not args.quick and backend() != "cpu")
  mode = "quick" if args.quick else "accelerator" if accelerator else "CPU"
  outcomes = []
  for b in benches:
    flags = b.quick if args.quick else b.accelerator if accelerator else b.cpu
    print(f"# run_all: bench_{b.name}.py {' '.join(flags)}", file=sys.stderr, flush=True)
    outcome = run(b, flags, b.timeout_s * (3 if accelerator else 1))
    print(f"#   {outcome.status} in {outcome.seconds:.0f} s, {len(outcome.figures)} figure(s)", file=sys.stderr,
          flush=True)
    if outcome.status != "ok":
      print(outcome.tail, file=sys.stderr)
    outcomes.append(outcome)
  text = table(outcomes, mode)
  print(text)
  if args.output != "-":
    pathlib.Path(args.output).write_text(text)
  return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
  sys.exit(main())
