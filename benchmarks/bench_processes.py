"""The job's own cost per step as the process count grows: the preemption handler, the step watchdog, `run`.

Usage (from the repository root; docs/benchmarks.md's figures come from the first command):

    python benchmarks/bench_processes.py                   # 1, 2, 4 and 8 processes x 1 CPU device
    python benchmarks/bench_processes.py --processes 1 2 --steps 20 --trials 1 --kv-seconds 0.2   # smoke

For each process count P the script starts ``python -m tpustrat.launch -n P -d 1`` on itself (``--worker``);
every process runs the same loop, process 0 reports. The step is `bench_run.py`'s tiny step (``w <- w - 0.01 *
pmean(x * w)``, a replicated float32 scalar and one scalar per replica: nearly all of its time is host-side
dispatch and, across processes, the all-reduce over loopback), in three variants timed side by side in
rounds (the order rotated every round), ``--steps`` chained steps per trial:

* ``hand-written``: ``jax.jit(jax.shard_map(...))`` with 2 steps in flight, as `bench_run.py`'s;
* ``run``: ``strategy.run(step, ...)``: `run`'s bookkeeping (argument placement, the program cache, the
  in-flight bound, the step counters and the per-step hooks);
* ``run + handler + watchdog``: ``handler.run(train, state)`` (`PreemptionCheckpointHandler`: its per-call
  check, and its watcher thread) with a step watchdog noting every dispatch (timeout 600 s: a tick a
  second, as any timeout of 10 s or more), both created for the trial and stopped after it, so that the
  other variants run without their threads.

Also measured, in every process, through a counting wrapper of the coordination service's client:

* the key-value requests per second each process sends during the guarded trials, by who sends them
  (the handler's watcher, the watchdog) and their payload bytes (keys and values; gRPC's framing not
  counted);
* the coordinator's CPU per request: processes 1..P-1 send ``key_value_try_get`` of a missing key (the
  handler's idle poll before this issue) as fast as they can for ``--kv-seconds`` while process 0 does
  nothing else; process 0's CPU time (all its threads: the coordination service runs in them) over the
  requests served. Also the round trip of one request, as process 1 sees it.

From these the script models the coordinator's load at 64 and 256 hosts: requests per second =
P x (requests per second per process), CPU = that x the CPU per request. Every figure is from a 2-core
machine where the P processes share the cores, on loopback: noisy, and the absolute step times grow with
P mostly because P processes take turns on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8],
                      help="process counts (1 device each)")
  parser.add_argument("--steps", type=int, default=100, help="chained steps per timed trial")
  parser.add_argument("--trials", type=int, default=7, help="rounds (every variant once per round)")
  parser.add_argument("--kv-seconds", type=float, default=1.0,
                      help="length of the coordinator CPU measurement")
  parser.add_argument("--rate-seconds", type=float, default=4.0,
                      help="length of the guarded run whose key-value requests are counted (steady state)")
  parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the launched processes' report file


ARGS = h.parse_args(__doc__, add_flags) if __name__ == "__main__" else None

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tpustrat  # noqa: E402
from tpustrat._src import jax_compat  # noqa: E402
from tpustrat._src import watchdog as watchdog_lib  # noqa: E402

AXIS = "replica"
IN_FLIGHT = 2
VARIANTS = ("hand-written", "run", "run + handler + watchdog")
GUARD_TARGET = 1.05  # run + handler + watchdog against run, per step
HOSTS = (64, 256)


class Counting:
  """The coordination service's client, counting each request and its payload bytes by the caller's name."""

  def __init__(self, client: Any, who: str, counts: dict[str, list[int]]) -> None:
    self._client, self._who, self._counts = client, who, counts

  def _count(self, op: str, nbytes: int) -> None:
    entry = self._counts.setdefault(f"{self._who} {op}", [0, 0])
    entry[0] += 1
    entry[1] += nbytes

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    self._count("set", len(key) + len(value))
    return self._client.key_value_set(key, value, allow_overwrite=allow_overwrite)

  def key_value_try_get(self, key: str) -> str:
    self._count("try_get", len(key))
    return self._client.key_value_try_get(key)

  def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
    self._count("blocking_get", len(key))
    return self._client.blocking_key_value_get(key, timeout_in_ms)

  def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
    self._count("dir_get", len(prefix))
    return self._client.key_value_dir_get(prefix)

  def key_value_delete(self, key: str) -> None:
    self._count("delete", len(key))
    return self._client.key_value_delete(key)


@contextlib.contextmanager
def counted_client(who: str, counts: dict[str, list[int]]) -> Iterator[None]:
  """`jax_compat.coordination_client` answers with a `Counting` wrapper inside the block (for the handler,
  which asks for the client when it is created)."""
  real = jax_compat.coordination_client
  client = real()
  jax_compat.coordination_client = lambda: None if client is None else Counting(client, who, counts)
  try:
    yield
  finally:
    jax_compat.coordination_client = real


def tiny_step(w, x):
  y = x * w
  return w - 0.01 * tpustrat.get_replica_context().all_reduce("mean", y), y


def tiny_body(w, x):
  y = x * w
  return w - 0.01 * jax.lax.pmean(y, AXIS), y


def worker(args: argparse.Namespace) -> None:
  strategy = tpustrat.TPUStrategy()
  me, count = jax.process_index(), jax.process_count()
  n = strategy.num_replicas_in_sync
  mesh = strategy.mesh
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  xs = (1.0 + np.arange(n, dtype=np.float32)) / n
  x_pr = strategy.experimental_distribute_values_from_function(lambda ctx: xs[ctx.replica_id_in_sync_group])
  x_global = jax.device_put(xs, split)
  w0 = jax.device_put(np.float32(1.0), replicated)
  program = jax.jit(jax.shard_map(tiny_body, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P(AXIS)),
                                  check_vma=True))
  counts: dict[str, list[int]] = {}
  guarded_seconds = [0.0]
  last: dict[str, Any] = {}  # each variant's final w and the steps that made it
  tmp_dir = tempfile.TemporaryDirectory(prefix="bench_processes_")  # removed when the worker ends
  tmp = tmp_dir.name
  manager = tpustrat.checkpoint.CheckpointManager(os.path.join(tmp, "ckpt"), strategy)

  def hand_written(steps: int) -> float:
    call, forget = h.bounded(program, IN_FLIGHT)
    w = w0
    t0 = time.perf_counter()
    for _ in range(steps):
      w, _ = call(w, x_global)
    jax.block_until_ready(w)
    forget()
    last["hand-written"] = (w, steps)
    return time.perf_counter() - t0

  def plain(steps: int) -> float:
    w = tpustrat.Mirrored(w0)
    t0 = time.perf_counter()
    for _ in range(steps):
      w, _ = strategy.run(tiny_step, args=(w, x_pr))
    jax.block_until_ready(w)
    strategy.experimental_run_wait()
    last["run"] = (w, steps)
    return time.perf_counter() - t0

  def train(w):
    return strategy.run(tiny_step, args=(w, x_pr))

  def guarded(steps: int, count_requests: bool = False) -> float:
    """`steps` guarded steps (with `count_requests`, the key-value requests sent meanwhile go into
    `counts`): the handler and the watchdog are made before the clock starts and stopped after it stops."""
    seen: dict[str, list[int]] = {}
    config = tpustrat.TerminationConfig(exit_fn=lambda: None)
    with counted_client("handler", seen):
      handler = tpustrat.PreemptionCheckpointHandler(None, manager, termination_config=config)
    client = jax_compat.coordination_client()
    dog = watchdog_lib.Watchdog(600.0, process_index=me, process_count=count,
                                client=None if client is None else Counting(client, "watchdog", seen))
    previous = watchdog_lib.activate(dog)
    try:
      w = handler.restore(tpustrat.Mirrored(w0))
      w, _ = handler.run(train, w)  # the threads are up (the listener's request sent) before the clock starts
      jax.block_until_ready(w)
      before = {k: list(v) for k, v in seen.items()}
      t0 = time.perf_counter()
      for _ in range(steps):
        w, _ = handler.run(train, w)
      jax.block_until_ready(w)
      strategy.experimental_run_wait()
      elapsed = time.perf_counter() - t0
      after = {k: list(v) for k, v in seen.items()}
      last["run + handler + watchdog"] = (w, steps + 1)
    finally:
      watchdog_lib.activate(previous)
      dog.stop()
      handler.close()
    if count_requests:
      for k, (n, b) in after.items():
        n0, b0 = before.get(k, (0, 0))
        counts[k] = [n - n0, b - b0]
      guarded_seconds[0] = elapsed
    return elapsed

  measures: dict[str, Callable[[int], float]] = dict(zip(VARIANTS, (hand_written, plain, guarded)))
  warm = min(args.steps, 20)
  for name in VARIANTS:  # warm-up (compile, caches) and check: w = (1 - 0.01 mean(x))^steps, numpy
    measures[name](warm)
    value, ran = last[name]
    got = np.asarray(strategy.experimental_local_results(value)[0] if isinstance(value, tpustrat.Mirrored)
                     else value.addressable_data(0))
    want = (1.0 - 0.01 * np.mean(xs.astype(np.float64))) ** ran
    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
  if me == 0:
    print(h.machine_line(n), flush=True)

  class Item:
    def __init__(self, name):
      self.name = name

  items = [Item(v) for v in VARIANTS]
  with h.no_compilation():
    times = h.time_rounds(items, args.trials, h.rotation_schedule(items),
                          lambda v: measures[v.name](args.steps) / args.steps * 1e6)
  # The steady state's key-value requests: a guarded run of about --rate-seconds on process 0's clock (every
  # process runs the same number of steps: process 0 says how many).
  rate_steps = max(args.steps, int(args.rate_seconds / (statistics.median(times[VARIANTS[2]]) * 1e-6)))
  client = jax_compat.coordination_client()
  if client is not None:
    if me == 0:
      client.key_value_set("bench_processes/rate_steps", str(rate_steps))
    rate_steps = int(client.blocking_key_value_get("bench_processes/rate_steps", 120_000))
  guarded(rate_steps, count_requests=True)
  host = host_terms(manager)
  kv = coordinator_cost(args.kv_seconds) if count > 1 else None
  report = {"process": me, "times": times, "counts": counts, "guarded_seconds": guarded_seconds[0], "kv": kv,
            "host": host}
  if client is not None:  # process 0 gathers every process's counts
    client.key_value_set(f"bench_processes/report/{me}", json.dumps(report))
    if me == 0:
      reports = [json.loads(client.blocking_key_value_get(f"bench_processes/report/{p}", 120_000))
                 for p in range(count)]
  else:
    reports = [report]
  if me == 0:
    pathlib.Path(args.worker).write_text(json.dumps({"processes": count, "reports": reports}))


def host_terms(manager: Any, calls: int = 20000, rounds: int = 7) -> dict[str, float]:
  """The main thread's own cost per step, without a program, in this process (minimum over `rounds` of the
  mean over `calls`, the least disturbed by the other processes): `handler.run` of a function that returns
  its state (the handler's check: a lock, a counter), and the watchdog's per-dispatch hook
  (`Heartbeat.before` and `after` with a finished token: a dispatch marked, noted), each against the bare
  loop."""
  from tpustrat._src import step_hooks  # pylint: disable=import-outside-toplevel

  config = tpustrat.TerminationConfig(exit_fn=lambda: None)
  handler = tpustrat.PreemptionCheckpointHandler(None, manager, termination_config=config)
  handler.restore(0)
  dog = watchdog_lib.Watchdog(600.0)  # no client: the thread's requests are not the main thread's
  hook, step = watchdog_lib.Heartbeat(), step_hooks.Step("run_step", 1, None, None, None, ())
  token = jax.block_until_ready(jax.numpy.zeros((), jax.numpy.int8))
  identity = lambda s: (s,)  # noqa: E731

  def bare() -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
      identity(0)
    return (time.perf_counter() - t0) / calls * 1e6

  def checked() -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
      handler.run(identity, 0)
    return (time.perf_counter() - t0) / calls * 1e6

  def heartbeat() -> float:
    previous = watchdog_lib.activate(dog)
    t0 = time.perf_counter()
    for _ in range(calls):
      hook.after(step, hook.before(step), token, None)
    seconds = time.perf_counter() - t0
    watchdog_lib.activate(previous)
    return seconds / calls * 1e6

  try:
    found = {name: min(f() for _ in range(rounds)) for name, f in (("bare", bare), ("handler", checked),
                                                                  ("watchdog", heartbeat))}
  finally:
    dog.stop()
    handler.close()
  return {"handler_us": found["handler"] - found["bare"], "watchdog_us": found["watchdog"]}


def coordinator_cost(seconds: float) -> dict[str, float]:
  """Processes 1.. send `key_value_try_get` of a missing key for `seconds`; process 0 measures its CPU time
  meanwhile. Returns (on process 0) its CPU seconds per request served and (on every other process) the
  requests it sent and their mean round trip."""
  client = jax_compat.coordination_client()
  me, count = jax.process_index(), jax.process_count()
  client.wait_at_barrier("bench_processes/kv_start", 120_000)
  if me == 0:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, t0 = usage.ru_utime + usage.ru_stime, time.perf_counter()
    sent = [int(client.blocking_key_value_get(f"bench_processes/kv_sent/{p}", 120_000))
            for p in range(1, count)]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - cpu0
    wall = time.perf_counter() - t0
    total = sum(sent)
    return {"requests": total, "cpu_seconds": cpu, "wall_seconds": wall,
            "cpu_us_per_request": cpu / total * 1e6}
  sent, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    try:
      client.key_value_try_get("bench_processes/missing")
    except Exception:  # noqa: BLE001  # NOT_FOUND, as the handler's idle poll saw it
      pass
    sent += 1
  elapsed = time.perf_counter() - t0
  client.key_value_set(f"bench_processes/kv_sent/{me}", str(sent))
  return {"requests": sent, "round_trip_us": elapsed / sent * 1e6}


def summarise(result: dict) -> dict[str, Any]:
  reports = result["reports"]
  times = reports[0]["times"]  # process 0's clock (every process runs the same steps)
  hand, run, guard = (times[v] for v in VARIANTS)
  per_process: dict[str, list[float]] = {}
  for r in reports:
    seconds = r["guarded_seconds"]
    for what, (requests, nbytes) in r["counts"].items():
      per_process.setdefault(what, []).append(requests / seconds)
      per_process.setdefault(what + " bytes", []).append(nbytes / max(requests, 1))
  kv0 = reports[0]["kv"]
  round_trips = [r["kv"]["round_trip_us"] for r in reports[1:] if r["kv"]]
  return {
      "processes": result["processes"], "trials": len(run),
      "hand_us": statistics.median(hand), "run_us": statistics.median(run),
      "guard_us": statistics.median(guard),
      "run_ratio": h.spread(h.paired_ratios(run, hand)),
      "guard_ratio": h.spread(h.paired_ratios(guard, run)),
      "guard_overhead": statistics.median([g - r for g, r in zip(guard, run)]),
      "run_overhead": statistics.median([r - x for r, x in zip(run, hand)]),
      "rates": {k: statistics.mean(v) for k, v in per_process.items() if not k.endswith(" bytes")},
      "payload": {k.removesuffix(" bytes"): statistics.mean(v) for k, v in per_process.items()
                  if k.endswith(" bytes")},
      "cpu_us_per_request": kv0["cpu_us_per_request"] if kv0 else None,
      "handler_us": statistics.median(r["host"]["handler_us"] for r in reports),
      "watchdog_us": statistics.median(r["host"]["watchdog_us"] for r in reports),
      "round_trip_us": statistics.median(round_trips) if round_trips else None,
  }


def main(args: argparse.Namespace) -> int:
  rows = []
  root = pathlib.Path(__file__).resolve().parents[1]
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}
  passed = [a for a in sys.argv[1:]]
  for processes in args.processes:
    with tempfile.TemporaryDirectory() as tmp:
      report = pathlib.Path(tmp) / "report.json"
      command = [sys.executable, "-m", "tpustrat.launch", "-n", str(processes), "-d", "1", "--timeout", "900",
                 os.path.abspath(__file__), *passed, "--worker", str(report)]
      t0 = time.perf_counter()
      proc = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True)
      if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-6000:], file=sys.stderr)
        return proc.returncode
      machine = next(line.split("] ", 1)[-1] for line in proc.stdout.splitlines() if "# jax " in line)
      rows.append(summarise(json.loads(report.read_text())))
      print(f"# {processes} processes: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
  print(machine)
  print(f"# results allclose to numpy on every process of {', '.join(map(str, args.processes))} processes "
        "(every variant: w = (1 - 0.01 mean(x))^steps, rtol 1e-5)")
  print()
  numbers = ["hand-written us/step", "run us/step", "run + handler + watchdog us/step",
             "guarded - run, us/step", "handler check, us/call", "watchdog hooks, us/dispatch"]
  columns = ["processes x devices", "steps x trials", *numbers[:3], "run / hand-written, paired",
             "guarded / run, paired", numbers[3], "target", *numbers[4:]]
  print(h.markdown_header(columns, right=numbers))
  for r in rows:
    met = r["guard_ratio"][0] <= GUARD_TARGET
    print(h.markdown_row([f"{r['processes']} x 1", f"{args.steps} x {r['trials']}", f"{r['hand_us']:.0f}",
                          f"{r['run_us']:.0f}", f"{r['guard_us']:.0f}", h.format_spread(r["run_ratio"], 3),
                          h.format_spread(r["guard_ratio"], 3), f"{r['guard_overhead']:+.1f}",
                          h.verdict(f"<= {GUARD_TARGET:.2f}", met), f"{r['handler_us']:.2f}",
                          f"{r['watchdog_us']:.2f}"]))
    h.figure(f"handler + watchdog per step, {r['processes']} processes x 1 CPU device: paired ratio to run",
             f"{r['guard_ratio'][0]:.3f}x", f"<= {GUARD_TARGET:.2f}x", met)
    h.figure(f"handler check + watchdog hooks on the main thread per step, {r['processes']} processes",
             f"{r['handler_us'] + r['watchdog_us']:.2f} us")
  print()
  print("Key-value requests each process sends while guarded (mean over processes, per second), payload "
        "bytes per request (key + value):")
  print()
  print(h.markdown_header(["processes", "sender and request", "requests/s per process", "payload bytes"],
                          right={"requests/s per process", "payload bytes"}))
  for r in rows:
    for what in sorted(r["rates"]):
      print(h.markdown_row([r["processes"], what, f"{r['rates'][what]:.2f}", f"{r['payload'][what]:.0f}"]))
  multi = [r for r in rows if r["cpu_us_per_request"]]
  if multi:
    cpu = statistics.median(r["cpu_us_per_request"] for r in multi)
    rtt = statistics.median(r["round_trip_us"] for r in multi)
    largest = max(multi, key=lambda r: r["processes"])
    rate = sum(largest["rates"].values())
    print()
    jobs = ", ".join(str(r["processes"]) for r in multi)
    print(f"Coordinator: {cpu:.1f} us of process 0's CPU per try_get of a missing key (median over the jobs "
          f"of {jobs} processes); round trip {rtt:.0f} us from process 1.")
    print(f"Model (requests/s per process measured at {largest['processes']} processes: {rate:.2f}):")
    for hosts in HOSTS:
      load = hosts * rate
      print(f"  {hosts} hosts: {load:.0f} requests/s to the coordinator, {load * cpu / 1e4:.2f}% of one core "
            f"at {cpu:.1f} us each")
      h.figure(f"coordinator load at {hosts} hosts (model: P x measured requests/s per process)",
               f"{load:.0f} req/s, {load * cpu / 1e4:.2f}% of a core")
  print()
  print("us/step: median over trials of (time for `steps` chained steps, until the last is ready) / steps, "
        "on process 0. paired: per-round ratios, median [p25, p75]. guarded: `handler.run` with a step "
        "watchdog on, both created for the trial. The processes share the machine's cores; loopback: noisy.")
  return 0


if __name__ == "__main__":
  if ARGS.worker:
    worker(ARGS)
  else:
    sys.exit(main(ARGS))
