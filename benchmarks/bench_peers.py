"""Peers side by side: one MLP training step in tpustrat, in hand-written JAX and in Keras 3 on JAX.

What is measured
----------------
One SGD step (learning rate 0.01) of the 784-1024-1024-10 ReLU MLP of `bench_run.py` (same initial
parameters, `bench_run.init_mlp`), float32, global batch 512, loss the mean softmax cross-entropy over
the global batch, fed from host numpy batches: ``--steps`` distinct batches (``x`` [512, 784] float32,
``y`` [512] int32 labels), generated once and given to every variant in the same order. Each trial runs
those ``--steps`` steps from the same initial parameters. The variants, timed side by side in one
process:

* ``tpustrat run`` (k = 1): ``strategy.run(step, args=(params, next(it)))`` per step, ``it`` an
  iterator over ``strategy.experimental_distribute_dataset(batches)`` (its prefetch thread puts the next
  batch on the devices while the step runs); the `Mirrored` parameters are fed back.
* ``tpustrat experimental_run_steps`` (k = 10): ``strategy.experimental_run_steps(step, it, 10,
  init=params)``, 10 steps per compiled program (a `lax.scan`), on the same kind of iterator (its thread
  stacks 10 batches on the host and transfers them at once).
* ``hand-written jit(shard_map)`` (k = 1): ``jax.jit(jax.shard_map(step, in_specs=(P(), P('replica')),
  out_specs=(P(), P()), check_vma=True))`` called per step on ``jax.device_put(batch, split)``, with the
  bound of 2 steps in flight that `run` applies (`bench_run.py`).
* ``Keras 3 fit, DataParallel`` (k = 1 and 10): a ``keras.Sequential`` of three ``Dense`` layers (ReLU,
  ReLU, logits), Keras on the JAX backend (the script sets ``KERAS_BACKEND=jax`` before importing it),
  ``keras.distribution.set_distribution(keras.distribution.DataParallel())`` (all devices, batch split),
  ``SGD(0.01)``, ``SparseCategoricalCrossentropy(from_logits=True)``, ``jit_compile=True`` and
  ``steps_per_execution`` 1 or 10; one ``model.fit(x, y, batch_size=512, epochs=1, shuffle=False,
  verbose=0)`` per trial on the same batches (one pair of numpy arrays), weights set to the same initial
  values before each trial (untimed). Keras on JAX dispatches one jitted program per step (with
  ``steps_per_execution=10``, ten in a Python loop) and never waits for one: on XLA:CPU with emulated
  devices that deadlocked in the all-reduce within a few trials. The script therefore compiles Keras's
  train step through a ``jit`` that keeps at most 2 steps in flight, as `run` and the hand-written loop
  do (`bounded_keras_steps`). Keras is optional (the ``bench`` extra: ``pip install -e '.[bench]'``);
  without it, or with ``--skip-keras``, its rows are left out.

The step is one function (``step(params, batch) -> (params, loss)``): `run`'s and
`experimental_run_steps`'s ``fn`` and the hand-written shard_map body. Each replica's loss is
``sum(cross_entropy) / 512``; the gradient with respect to the replicated parameters comes back summed
over the replicas (``check_vma``), so every variant takes the gradient of the global mean loss, as
Keras's (one global program, partitioned by XLA) does.

Also measured: the compile time of ``experimental_run_steps`` at k = 1, 8 and 64 steps per program, each
time on a fresh step function (a new function object: its own program, traced and compiled anew) and a
fresh distributed iterator. The time is the sum of JAX's monitoring events for that program during its
first call (``/jax/core/compile/jaxpr_trace_duration``, ``jaxpr_to_mlir_module_duration``,
``backend_compile_duration``: tracing, lowering and XLA compilation, not running the k steps); a Python
counter in the step function counts its traces (one each expected). Target: compile time at k = 64 at
most 1.2x that at k = 1. For reference the same is measured for the hand-written
``jax.jit(lambda params, xs: lax.scan(shard_mapped_step, params, xs))``, ahead of time
(``.lower(shapes).compile()``). At k = 1 XLA removes the loop of one iteration (a smaller program); from
k = 2 on the compiled program is the same but for the trip count, in both.

Methodology (that of `bench_run.py`)
------------------------------------
1. Check, which is also the warm-up (tracing, compilation): every variant runs the first 10 steps from
   the same initial parameters; its final parameters must be allclose to those of ``run`` (tpustrat and
   hand-written: rtol 2e-4, atol 1e-5; Keras, another program: rtol 2e-3, atol 2e-4; on XLA:CPU all come
   out bitwise equal). The script prints one ``# parameters after 10 steps allclose ...`` line with the
   largest relative differences, and asserts that nothing compiles during the timed trials.
2. ``--trials`` rounds; in each every variant runs ``--steps`` steps (a multiple of 10), timed with
   ``time.perf_counter`` from creating the iterator until the last parameters are ready. Keras's clock
   starts when ``fit`` calls ``on_train_batch_begin`` for the first step (a callback), after fit's own
   set-up (data adapter, callbacks; printed separately, per fit call), and stops once its variables are
   ready. The order of the variants rotates from round to round (`_harness.rotation_schedule`).
3. Reported: median steps/s and ms/step per variant; for the others, the per-round ratio of the
   variant's time to tpustrat's at the same k (``run`` for k = 1, ``experimental_run_steps`` for
   k = 10), median [p25, p75]: how many times faster tpustrat is. Targets (the issue's figures, measured
   with Keras 3.15 and JAX 0.12): ``run`` at least 1.44x Keras ``fit`` with ``steps_per_execution=1``,
   and ``experimental_run_steps`` (k = 10) at least 1.47x Keras with ``steps_per_execution=10``.
4. Compile times: ``--compile-trials`` rounds, every k once per round (rotating order): the median
   seconds per k and the per-round ratio to k = 1, median [p25, p75], with the traces counted.

Reproduce from the repository root (8 emulated CPU devices unless ``--cpu-devices 0``)::

    .venv/bin/pip install -e '.[bench]'                 # Keras 3 (the test suite does not need it)
    .venv/bin/python benchmarks/bench_peers.py          # defaults: 40 steps x 5 trials, 3 compile rounds
    .venv/bin/python benchmarks/bench_peers.py --steps 100 --trials 9 --compile-trials 5
    .venv/bin/python benchmarks/bench_peers.py --skip-keras

Defaults: 40 steps x 5 trials per variant, 3 compile rounds: about 2 to 3 minutes on a 2-core machine
with 8 emulated devices (about 45 ms per step when the machine is otherwise idle; each k = 64 compile
round also runs its 64 steps). The batches take 1.6 MB of host memory per step.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
import _harness as h  # noqa: E402


def _add_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--steps", type=int, default=40, help="steps per trial, a multiple of 10 (default 40)")
  parser.add_argument("--trials", type=int, default=5, help="timed trials per variant (default 5)")
  parser.add_argument("--compile-trials", type=int, default=3,
                      help="compile-time rounds, each with a fresh step function per k (default 3)")
  parser.add_argument("--skip-keras", action="store_true", help="leave out the Keras rows")


ARGS = h.parse_args(__doc__, _add_flags) if __name__ == "__main__" else None
if ARGS is not None:
  h.emulate_cpu_devices(ARGS.cpu_devices)  # before JAX initialises its backends

import bench_run as br  # noqa: E402  # the MLP, its initial parameters and its loss

import tpustrat  # noqa: E402

AXIS = br.AXIS
IN_FLIGHT = br.IN_FLIGHT
LR = 0.01
K = 10  # steps per program of the multi-step variants
CHECK_STEPS = 10
COMPILE_KS = (1, 8, 64)
TARGETS = {1: 1.44, K: 1.47}  # tpustrat over Keras at k = 1 (run vs fit) and k = 10 (run_steps vs spe=10)
COMPILE_TARGET = 1.2  # compile time at k = 64 over k = 1
TOL = dict(rtol=2e-4, atol=1e-5)  # tpustrat and hand-written: the same program
KERAS_TOL = dict(rtol=2e-3, atol=2e-4)  # Keras: another program, the same arithmetic
RUN, RUN_STEPS, HAND = "tpustrat run", "tpustrat experimental_run_steps", "hand-written jit(shard_map)"
KERAS = "Keras 3 fit, DataParallel"
PLAIN_SCAN = "hand-written jit(scan(shard_map))"
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


# -- the step -----------------------------------------------------------------------------------------


def sgd_step(params, batch):
  """One replica's step, ``(params, batch) -> (params, loss)``: `run`'s and `experimental_run_steps`'s `fn`,
  and the hand-written shard_map body (where `batch` arrives as this replica's [64, ...] blocks)."""
  x, y = batch
  loss, grads = jax.value_and_grad(br._mlp_loss)(params, x, y)  # grads come back summed over replicas
  return jax.tree.map(lambda p, g: p - LR * g, params, grads), lax.psum(loss, AXIS)


def make_batches(steps: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, np.ndarray]:
  """`steps` host batches (x [512, 784] float32, y [512] int32), as a list of views and as two arrays."""
  rng = np.random.default_rng(1)
  xs = rng.standard_normal((steps * br.GLOBAL_BATCH, br.LAYERS[0])).astype(np.float32)
  ys = rng.integers(0, br.LAYERS[-1], size=(steps * br.GLOBAL_BATCH,)).astype(np.int32)
  b = br.GLOBAL_BATCH
  return [(xs[i * b:(i + 1) * b], ys[i * b:(i + 1) * b]) for i in range(steps)], xs, ys


# -- the variants -------------------------------------------------------------------------------------


class Variant:
  """A named training loop: `trial(steps)` runs `steps` steps from the initial parameters and returns
  (seconds, the final parameters as a dict of numpy arrays)."""

  def __init__(self, name: str, k: int, trial: Callable[[int], tuple[float, dict[str, np.ndarray]]]) -> None:
    self.name, self.k, self.trial = f"{name}, k={k}", k, trial
    self.label = name


def _numpy_params(strategy: tpustrat.Strategy, params: Any) -> dict[str, np.ndarray]:
  return jax.tree.map(lambda v: np.asarray(strategy.experimental_local_results(v)[0]), params,
                      is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))


def tpustrat_variants(strategy: tpustrat.Strategy, batches: list[Any],
                      p0: dict[str, np.ndarray]) -> list[Variant]:
  dist = strategy.experimental_distribute_dataset(batches)

  def start():
    params = strategy.experimental_mirror(p0)
    jax.block_until_ready(params)
    return params, time.perf_counter()

  def run_trial(steps):
    params, t0 = start()
    it = iter(dist)
    for _ in range(steps):
      params, _ = strategy.run(sgd_step, args=(params, next(it)))
    strategy.experimental_run_wait()
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    it.close()
    return seconds, _numpy_params(strategy, params)

  def run_steps_trial(steps):
    params, t0 = start()
    it = iter(dist)
    for _ in range(steps // K):
      params, _ = strategy.experimental_run_steps(sgd_step, it, K, init=params)
    strategy.experimental_run_wait()
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    it.close()
    return seconds, _numpy_params(strategy, params)

  return [Variant(RUN, 1, run_trial), Variant(RUN_STEPS, K, run_steps_trial)]


def handwritten_variant(strategy: tpustrat.Strategy, batches: list[Any],
                        p0: dict[str, np.ndarray]) -> Variant:
  mesh = strategy.mesh
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
  program = jax.jit(jax.shard_map(sgd_step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()),
                                  check_vma=True))

  def trial(steps):
    call, forget = h.bounded(program, IN_FLIGHT)
    params = jax.device_put(p0, replicated)
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    for i in range(steps):
      params, _ = call(params, jax.device_put(batches[i], split))
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    forget()
    return seconds, jax.tree.map(np.asarray, params)

  return Variant(HAND, 1, trial)


def import_keras() -> Any:
  """Keras 3 on the JAX backend (``KERAS_BACKEND`` must be set before the first import)."""
  os.environ["KERAS_BACKEND"] = "jax"
  import keras  # pylint: disable=import-outside-toplevel

  if keras.backend.backend() != "jax":
    raise SystemExit(f"keras was imported with the {keras.backend.backend()} backend; this benchmark "
                     "needs jax")
  return keras


@contextlib.contextmanager
def bounded_keras_steps(wrapped: list[int]) -> Iterator[None]:
  """Inside the block, the train steps Keras compiles keep at most IN_FLIGHT steps in flight, as `run` does.

  Keras on JAX dispatches one jitted program per step (``steps_per_execution`` > 1 loops over them in
  Python) without waiting for any: on XLA:CPU with emulated devices that deadlocks in the all-reduce
  within a few runs (7 of 8 devices reach the rendezvous). This replaces, for the block, the ``jit`` with
  which ``keras.src.backend.jax.trainer`` compiles its train step by one whose programs, before step i is
  dispatched, wait for the metrics (``logs``, not donated) of step i - IN_FLIGHT. Counts in `wrapped`.
  """
  from keras.src.backend.jax import trainer  # pylint: disable=import-outside-toplevel

  jit = trainer.jit

  def bounded_jit(fn, *args, **kwargs):
    wrapped[0] += 1
    program = jit(fn, *args, **kwargs)
    pending: collections.deque = collections.deque()

    def call(state, data):
      while len(pending) >= IN_FLIGHT:
        jax.block_until_ready(pending.popleft())
      logs, state = program(state, data)
      pending.append(logs)
      return logs, state

    return call

  trainer.jit = bounded_jit
  try:
    yield
  finally:
    trainer.jit = jit


KERAS_SETUP_S: list[float] = []  # seconds from calling fit to its first step, per fit call (not timed)


def first_batch_clock(keras: Any) -> Any:
  """A Keras callback noting when fit is about to run its first step (``t0``), after fit's own set-up.

  It only defines ``on_train_batch_begin``, so Keras keeps running its batch-end callbacks asynchronously.
  """

  class FirstBatchClock(keras.callbacks.Callback):
    t0: float | None = None

    def on_train_batch_begin(self, batch, logs=None):
      if self.t0 is None:
        self.t0 = time.perf_counter()

  return FirstBatchClock()


def keras_variants(keras: Any, xs: np.ndarray, ys: np.ndarray, p0: dict[str, np.ndarray]) -> list[Variant]:
  keras.distribution.set_distribution(keras.distribution.DataParallel())  # all devices, batch split
  n = len(br.LAYERS) - 1
  weights = [p0[f"{kind}{i}"] for i in range(n) for kind in ("w", "b")]  # Dense: kernel [in, out], bias
  variants = []
  for spe in (1, K):
    model = keras.Sequential(
        [keras.Input((br.LAYERS[0],))]
        + [keras.layers.Dense(units, activation="relu" if i < n - 1 else None)
           for i, units in enumerate(br.LAYERS[1:])])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=spe, jit_compile=True)

    def trial(steps, model=model):
      model.set_weights(weights)
      rows = steps * br.GLOBAL_BATCH
      wrapped = [0]
      first = model.train_function is None  # fit makes it (once), with the bounded jit
      clock = first_batch_clock(keras)
      with bounded_keras_steps(wrapped) if first else contextlib.nullcontext():
        jax.block_until_ready([v.value for v in model.variables])
        t_call = time.perf_counter()
        model.fit(xs[:rows], ys[:rows], batch_size=br.GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[clock])
        jax.block_until_ready([v.value for v in model.variables])  # fit may return before the last step ends
        seconds = time.perf_counter() - clock.t0
      KERAS_SETUP_S.append(clock.t0 - t_call)
      if first and wrapped[0] != 1:
        raise SystemExit(f"keras {keras.__version__} compiled {wrapped[0]} train steps through "
                         "keras.src.backend.jax.trainer.jit (1 expected): cannot bound its steps in flight; "
                         "run with --skip-keras")
      final = model.get_weights()
      return seconds, {f"{kind}{i}": final[2 * i + j] for i in range(n) for j, kind in enumerate(("w", "b"))}

    variants.append(Variant(KERAS, spe, trial))
  return variants


# -- checking and timing ------------------------------------------------------------------------------


def check(variants: list[Variant]) -> str:
  """Runs every variant CHECK_STEPS steps (also the warm-up); asserts that the final parameters agree
  with `run`'s; returns the largest relative differences, for the report."""
  results = {v.name: v.trial(CHECK_STEPS)[1] for v in variants}
  ref = results[variants[0].name]
  diffs = []
  for v in variants[1:]:
    tol = KERAS_TOL if v.label == KERAS else TOL
    worst = 0.0
    for key in ref:
      np.testing.assert_allclose(results[v.name][key], ref[key], **tol,
                                 err_msg=f"{v.name}: parameter {key} differs from {variants[0].name}")
      relative = np.abs(results[v.name][key] - ref[key]) / (np.abs(ref[key]) + tol["atol"])
      worst = max(worst, float(np.max(relative)))
    diffs.append(f"{v.name} {worst:.1e}")
  return "; ".join(diffs)


def bench(variants: list[Variant], steps: int, trials: int) -> dict[str, list[float]]:
  """Seconds per trial of every variant, in rotating order; nothing may compile."""
  with h.no_compilation():
    return h.time_rounds(variants, trials, h.rotation_schedule(variants), lambda v: v.trial(steps)[0])


_EVENT_SECONDS: list[tuple[str, float]] = []  # (fun_name, seconds) of the compile events seen


def _listen(event: str, duration: float, **kwargs: Any) -> None:
  if event in _COMPILE_EVENTS:
    _EVENT_SECONDS.append((str(kwargs.get("fun_name", "")), duration))


def _compile_seconds(name: str, since: int) -> float:
  """Seconds of the trace, lowering and compilation events of the program named `name` since event `since`."""
  mine = [s for fun, s in _EVENT_SECONDS[since:] if name in fun]
  assert len(mine) == 3, (f"{name}: expected a trace, a lowering and a compilation, got "
                          f"{_EVENT_SECONDS[since:]}")
  return sum(mine)


def compile_times(strategy: tpustrat.Strategy, batches: list[Any], p0: dict[str, np.ndarray],
                  trials: int) -> tuple[dict[str, dict[int, list[float]]], dict[int, list[int]]]:
  """Trace + lower + compile seconds of `experimental_run_steps`'s program at each k, each on a fresh step
  function (its first call, which then runs the k steps), and of the plain-JAX scan of the same step
  (ahead of time: ``jit(...).lower(shapes).compile()``, nothing run); and how often each tpustrat step
  function was traced."""
  jax.monitoring.register_event_duration_secs_listener(_listen)
  mesh = strategy.mesh
  endless = _Cycle(batches)
  replicated, steps_split = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, AXIS))
  params_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), p0)
  body = jax.shard_map(sgd_step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()), check_vma=True)
  seconds: dict[str, dict[int, list[float]]] = {RUN_STEPS: {k: [] for k in COMPILE_KS},
                                                PLAIN_SCAN: {k: [] for k in COMPILE_KS}}
  traces: dict[int, list[int]] = {k: [] for k in COMPILE_KS}
  order = h.rotation_schedule(COMPILE_KS)
  for t in range(trials):
    for k in order(t):
      count = [0]

      def step(params, batch, count=count):
        count[0] += 1  # runs once per trace
        return sgd_step(params, batch)

      name = step.__name__ = f"peers_probe{t:04d}k{k:04d}"  # unique: names the program and its events
      it = iter(strategy.experimental_distribute_dataset(endless))
      params = strategy.experimental_mirror(p0)
      since = len(_EVENT_SECONDS)
      params, _ = strategy.experimental_run_steps(step, it, k, init=params)
      strategy.experimental_run_wait()
      jax.block_until_ready(params)
      it.close()
      seconds[RUN_STEPS][k].append(_compile_seconds(name, since))
      traces[k].append(count[0])

      def scanned(params, xs):
        return lax.scan(body, params, xs)

      name = scanned.__name__ = f"peers_plain{t:04d}k{k:04d}"
      xs_spec = tuple(jax.ShapeDtypeStruct((k,) + a.shape, a.dtype, sharding=steps_split) for a in batches[0])
      since = len(_EVENT_SECONDS)
      jax.jit(scanned).lower(params_spec, xs_spec).compile()
      seconds[PLAIN_SCAN][k].append(_compile_seconds(name, since))
  return seconds, traces


class _Cycle:
  """An endless dataset repeating `batches` (a fresh pass per iter)."""

  def __init__(self, batches: list[Any]) -> None:
    self._batches = batches

  def __iter__(self):
    while True:
      yield from self._batches


# -- report -------------------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  if br.GLOBAL_BATCH % n:
    raise SystemExit(f"the global batch of {br.GLOBAL_BATCH} does not split over {n} replicas")
  if args.steps < CHECK_STEPS or args.steps % K:
    raise SystemExit(f"--steps ({args.steps}) must be a multiple of {K}")
  print(h.machine_line(n))
  keras = None
  if args.skip_keras:
    print("# --skip-keras: Keras rows left out")
  elif importlib.util.find_spec("keras") is None:
    print("# keras is not installed (pip install -e '.[bench]'): Keras rows left out")
  else:
    keras = import_keras()
    print(f"# keras {keras.__version__} (backend {keras.backend.backend()}), DataParallel over {n} devices")
  t_start = time.perf_counter()
  batches, xs, ys = make_batches(args.steps)
  p0 = br.init_mlp()
  variants = tpustrat_variants(strategy, batches, p0) + [handwritten_variant(strategy, batches, p0)]
  if keras is not None:
    variants += keras_variants(keras, xs, ys, p0)
  diffs = check(variants)
  print(f"# parameters after {CHECK_STEPS} steps allclose to {variants[0].name}'s; largest relative "
        f"difference: {diffs}", flush=True)
  print(f"# timing {args.trials} trials x {args.steps} steps per variant ...", flush=True)
  setups = len(KERAS_SETUP_S)
  times = bench(variants, args.steps, args.trials)
  if keras is not None:
    print(f"# Keras fit's own set-up before its first step (left out of its timed window): median "
          f"{statistics.median(KERAS_SETUP_S[setups:]) * 1e3:.0f} ms per fit call")
  print(f"# compile times: {args.compile_trials} rounds of k = {', '.join(map(str, COMPILE_KS))} ...",
        flush=True)
  compile_s, traces = compile_times(strategy, batches, p0, args.compile_trials)
  print(f"# total {time.perf_counter() - t_start:.0f} s")
  print()
  print(h.markdown_header(["measure", "variant", "k", "runs", "median", "ms/step",
                           "ratio, median [p25, p75]", "target"],
                          right={"k", "median", "ms/step"}))
  reference = {1: times[f"{RUN}, k=1"], K: times[f"{RUN_STEPS}, k={K}"]}
  for v in variants:
    ts = times[v.name]
    steps_per_s = statistics.median([args.steps / s for s in ts])
    ms = statistics.median([s / args.steps * 1e3 for s in ts])
    ratio, target = "(reference)", ""
    if not v.label.startswith("tpustrat"):
      r = h.spread(h.paired_ratios(ts, reference[v.k]))  # this time / tpustrat's: tpustrat's speed-up
      ratio = h.format_spread(r, 2, unit="x")
      if v.label == KERAS:
        target = h.verdict(f">= {TARGETS[v.k]:.2f}x", r[0] >= TARGETS[v.k])
        h.figure(f"tpustrat steps/s vs Keras 3 fit, k={v.k}", f"{r[0]:.2f}x", f">= {TARGETS[v.k]:.2f}x",
                 r[0] >= TARGETS[v.k])
    print(h.markdown_row(["steps/s", v.label, v.k, f"{args.steps} steps x {len(ts)}", f"{steps_per_s:.2f}",
                          f"{ms:.1f}", ratio, target]))
  for family in (RUN_STEPS, PLAIN_SCAN):
    for k in COMPILE_KS:
      cs = compile_s[family][k]
      r = h.spread(h.paired_ratios(cs, compile_s[family][COMPILE_KS[0]]))
      target = ""
      if family == RUN_STEPS:
        target = h.verdict("1 trace each", all(c == 1 for c in traces[k]))
        if k == COMPILE_KS[-1]:
          target += "; " + h.verdict(f"k={k} / k=1 <= {COMPILE_TARGET:.1f}x", r[0] <= COMPILE_TARGET)
          h.figure(f"experimental_run_steps compile time, k={k} / k=1", f"{r[0]:.2f}x", f"<= {COMPILE_TARGET:.1f}x",
                   r[0] <= COMPILE_TARGET)
      print(h.markdown_row(["compile s", family, k, f"fresh fn x {len(cs)}", f"{statistics.median(cs):.2f}",
                            "", h.format_spread(r, 2, unit="x"), target]))
  print()
  print("steps/s, ms/step: medians over trials of the time for `steps` steps, from creating the iterator "
        "(Keras: from fit's first step, after its set-up) until the last parameters are ready. ratio "
        "(steps/s rows): per-round ratio of this variant's time to tpustrat's at the same k (run at k=1, "
        f"experimental_run_steps at k={K}), median [p25, p75]: how many times faster tpustrat is. "
        "compile s: trace + lowering + XLA compilation of the program of a fresh step function (JAX's "
        "monitoring events; tpustrat: during the first experimental_run_steps call; hand-written: "
        "jit(...).lower(...).compile()). ratio (compile rows): per-round ratio of the compile time at k to "
        "that at k=1. Targets: the issue's figures (Keras 3.15, JAX 0.12): run >= 1.44x Keras fit, "
        "experimental_run_steps k=10 >= 1.47x Keras with steps_per_execution=10; experimental_run_steps "
        "compiled at k=64 within 1.2x the time at k=1, one trace each.")
  return 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
