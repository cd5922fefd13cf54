"""The tpustrat API on one multi-process job; run by tests/test_multiprocess.py under the launcher.

``python -m tpustrat.launch -n 2 -d 4 tests/_mp_scripts/across_processes.py`` prints, in every process, one
``RESULT {json}`` line: the host-side answers of `check_api` (which the test compares with the same
function run in one process on 8 devices) and of `this_process` (what each process holds), then the
losses of the flagship example (examples/classifier.py), trained on all 8 devices of the job, and what
`step_stats` saw (this process's step counters over a slow source, and the warnings).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import tpustrat
import tpustrat.ops as ops

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "classifier.py"
CLASSIFIER_ARGS = ["--epochs", "2", "--global-batch-size", "64", "--seed", "1", "--quiet"]


def host(x):
  """A nested list of Python numbers: must succeed in every process (host-side complete results)."""
  return np.asarray(x).tolist()


def check_api(strategy: tpustrat.Strategy) -> dict:
  """Host-side results of run / reduce / gather / ops / input, identical for any process layout."""
  n = strategy.num_replicas_in_sync
  out = {}
  x = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.arange(3, dtype=np.float32) + 10 * ctx.replica_id_in_sync_group)

  def step(v):
    ctx = tpustrat.get_replica_context()
    return v * 2, ctx.all_reduce("sum", v), ctx.all_gather(v[:1], axis=0)

  per, total, gathered = strategy.run(step, args=(x,))
  out["reduce_sum"] = host(strategy.reduce("SUM", per, axis=None))
  out["reduce_mean_axis0"] = host(strategy.reduce("MEAN", per, axis=0))
  out["reduce_mirrored_sum"] = host(strategy.reduce("SUM", total, axis=None))
  out["gather"] = host(strategy.gather(per, axis=0))
  out["gather_mirrored"] = host(strategy.gather(gathered, axis=0))
  out["all_reduce"] = host(strategy.experimental_local_results(total)[0])
  out["reduce_to"] = host(strategy.experimental_local_results(
      strategy.extended.reduce_to("sum", per, destinations=per))[0])

  groups = [[0, 2, 4, 6], [1, 3, 5, 7]]

  def collectives(v):
    return {
        "cross_replica_sum": ops.cross_replica_sum(v, groups),
        "all_to_all": ops.all_to_all(jnp.tile(v, n), groups, 0, 0, 4),
        "permute": ops.collective_permute(v, [(r, (r + 1) % n) for r in range(n)]),
        "all_gather": ops.all_gather(v[:1], groups, axis=0),
        "reduce_scatter": ops.reduce_scatter(jnp.tile(v, 2)[:4], groups, 0),
    }

  for name, value in strategy.run(collectives, args=(x,)).items():
    out[f"ops_{name}"] = host(strategy.gather(value, axis=0))

  ds = strategy.experimental_make_numpy_dataset(np.arange(56.0, dtype=np.float32).reshape(28, 2)).batch(16)
  batches = []
  for batch in strategy.experimental_distribute_dataset(ds):  # a full batch of 16, then 12 rows (padded)
    y = strategy.run(lambda b: b * 10, args=(batch,))
    batches.append({"mean": host(strategy.reduce("MEAN", y, axis=0)), "rows": host(strategy.gather(y, axis=0))})
  out["dataset"] = batches

  def dataset_fn(ctx):
    b = ctx.get_per_replica_batch_size(16)
    data = np.arange(64.0, dtype=np.float32)[ctx.input_pipeline_id::ctx.num_input_pipelines]
    return [data[i:i + b] for i in range(0, len(data), b)]

  dist = strategy.experimental_distribute_datasets_from_function(dataset_fn)
  out["from_function_sums"] = [host(strategy.reduce("SUM", b, axis=0)) for b in dist]

  def scan_step(carry, b):
    s = tpustrat.get_replica_context().all_reduce("sum", jnp.sum(b))
    return carry + s, s

  it = iter(strategy.experimental_distribute_dataset([np.full(16, i, np.float32) for i in range(5)]))
  carry, sums = strategy.experimental_run_steps(scan_step, it, 3, init=0.0)
  out["run_steps"] = [host(carry.values[0]), host(sums.values[0])]
  return out


def this_process(strategy: tpustrat.Strategy) -> dict:
  """What this process holds: its replicas' components, its input pipeline, its devices."""
  ids = strategy.run(lambda: tpustrat.get_replica_context().replica_id_in_sync_group)
  contexts = []
  strategy.experimental_distribute_datasets_from_function(lambda ctx: contexts.append(ctx) or [np.zeros(2)])
  batch = next(iter(strategy.experimental_distribute_dataset([np.arange(12.0)])))
  return {
      "process": [jax.process_index(), jax.process_count()],
      "local_replica_ids": [int(v) for v in strategy.experimental_local_results(ids)],
      "local_mirrored": len(strategy.experimental_local_results(strategy.run(lambda: jnp.float32(1.0)))),
      "local_batch_rows": [host(v) for v in strategy.experimental_local_results(batch)],
      "input_context": [contexts[0].num_input_pipelines, contexts[0].input_pipeline_id,
                        contexts[0].num_replicas_in_sync],
      "worker_devices": len(strategy.extended.worker_devices),
  }


def step_stats(strategy: tpustrat.Strategy) -> dict:
  """This process's step counters over a slow source (each element sleeps: a slow decoder), the
  input-bound warning it gives, and the retracing warning of a function compiled for 6 shapes."""
  strategy.experimental_step_stats(reset=True)
  strategy.extended.experimental_input_bound_window = 20
  slept = [0.0]

  def slow():
    for i in range(40):
      start = time.perf_counter()
      time.sleep(0.03)
      slept[0] += time.perf_counter() - start
      yield np.full((16, 2), i, np.float32)

  def double(x):
    return x * 2

  def add_one(x):
    return x + 1

  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for batch in strategy.experimental_distribute_dataset(slow()):
      strategy.run(double, args=(batch,))
    strategy.experimental_run_wait()
    stats = strategy.experimental_step_stats()
    for n in range(1, 7):
      strategy.run(add_one, args=(np.ones(n, np.float32),))
  return {"steps": stats.steps, "history": [r.steps for r in stats.history], "slept": slept[0],
          "input_seconds": stats.input_seconds, "device_seconds": stats.device_seconds,
          "wall_seconds": stats.wall_seconds,
          "warnings": [[type(w.message).__name__, str(w.message)] for w in record
                       if issubclass(w.category, (tpustrat.InputBoundWarning, tpustrat.RetracingWarning))]}


def classifier_losses() -> list[float]:
  spec = importlib.util.spec_from_file_location("classifier_example", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main(CLASSIFIER_ARGS)["losses"]


if __name__ == "__main__":
  strategy = tpustrat.TPUStrategy()  # joins the launcher's job (TPUSTRAT_* environment variables)
  result = {"api": check_api(strategy), "local": this_process(strategy), "losses": classifier_losses(),
            "step_stats": step_stats(strategy)}
  print("RESULT " + json.dumps(result), flush=True)
  sys.exit(0)
