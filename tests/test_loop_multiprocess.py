"""The loop features on 2 processes x 4 devices: `LossScaleOptimizer` and `accumulate_gradients` in one
launch of `tests/_mp_scripts/loop_features.py` under ``python -m tpustrat.launch -n 2 -d 4`` (gloo on
loopback). (`RunOptions(check_numerics=True)` has its own 2-process test in tests/test_numerics.py; here it
watches the accumulation steps.)

* Loss scaling: overflows planted on replicas of process 1 only. Both processes report the same steps
  skipped and the same scale schedule, equal to TF's rules in numpy; their parameters are equal on every
  replica of both processes and equal numpy's Adam on the whole global batch, applied on the finite
  steps only; and the job ends (nobody waits in a collective for a process that decided otherwise).
* Accumulation with k = 2, the last batch partial (process 1's replicas hold padding only): the losses and
  parameters of numpy's SGD on the whole global batch of real rows.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import assert_close, launched_results

pytestmark = pytest.mark.processes  # every test here starts processes (tests/conftest.py)

SCRIPT = pathlib.Path(__file__).resolve().parent / "_mp_scripts" / "loop_features.py"


def _load_script():
  spec = importlib.util.spec_from_file_location("loop_features", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # defines the data; main() is not run
  return module


lf = _load_script()


def _env() -> dict[str, str]:
  return {k: v for k, v in os.environ.items()
          if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}


@pytest.fixture(scope="module")
def job():
  """{process index: its RESULT} of one launch, and the seconds it took."""
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--heartbeat-timeout", "10",
             "--timeout", "150", str(SCRIPT)]
  start = time.monotonic()
  done = subprocess.run(command, env=_env(), cwd=SCRIPT.parents[2], capture_output=True, text=True, timeout=200)
  elapsed = time.monotonic() - start
  assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
  results = launched_results(done.stdout)
  for index, result in results.items():
    assert result["process"] == index
  return results, elapsed


# -- numpy references -------------------------------------------------------------------------------------


def reference_schedule(finite):
  """TF's dynamic loss scale: per step, (scale used, scale after, counter after, skipped after)."""
  scale, counter, skipped, rows = lf.INITIAL_SCALE, 0, 0, []
  for ok in finite:
    used = scale
    if ok:
      counter += 1
      if counter >= lf.GROWTH:
        scale, counter = scale * 2, 0
    else:
      scale, counter, skipped = max(scale / 2, 1.0), 0, skipped + 1
    rows.append((used, scale, counter, skipped))
  return rows


def reference_adam(batches, finite, params):
  """(parameters after the last step, loss of each step) in float64: optax.adam's update on the finite
  steps' whole-batch gradients of the mean squared error (the poison's term is 0 on the finite steps)."""
  p = {"w": np.asarray(params["w"], np.float64), "b": np.float64(params["b"])}
  mu = {k: np.zeros_like(v) for k, v in p.items()}
  nu = {k: np.zeros_like(v) for k, v in p.items()}
  count, losses = 0, []
  for batch, ok in zip(batches, finite):
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    resid = x @ p["w"] + p["b"] - y
    losses.append(float(np.mean(resid ** 2)))
    if not ok:
      continue
    g = {"w": 2 * x.T @ resid / len(y), "b": 2 * np.sum(resid) / len(y)}
    count += 1
    for k in p:
      mu[k] = 0.9 * mu[k] + 0.1 * g[k]
      nu[k] = 0.999 * nu[k] + 0.001 * g[k] ** 2
      p[k] = p[k] - lf.LR * (mu[k] / (1 - 0.9 ** count)) / (np.sqrt(nu[k] / (1 - 0.999 ** count)) + 1e-8)
  return p, losses


def reference_sgd(batches, params):
  """(parameters after the last step, loss of each step) in float64: SGD on the whole global batch's real
  rows, the squared error summed and divided by the full global batch (`compute_average_loss`)."""
  p = {k: v.astype(np.float64) for k, v in params.items()}
  losses = []
  for batch in batches:
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    h = np.tanh(x @ p["w1"] + p["b1"])
    err = h @ p["w2"] + p["b2"] - y
    losses.append(float(np.sum(err ** 2) / lf.GLOBAL))
    d_out = 2 * err / lf.GLOBAL
    d_h = (d_out @ p["w2"].T) * (1 - h ** 2)
    grads = {"w2": h.T @ d_out, "b2": d_out.sum(0), "w1": x.T @ d_h, "b1": d_h.sum(0)}
    p = {k: p[k] - lf.ACC_LR * grads[k] for k in p}
  return p, losses


def _every_replica_equal(results, name):
  """The parameters of every replica of both processes (4 each), bit for bit; returns one copy."""
  copies = [(index, leaf, c) for index, result in results.items()
            for leaf, values in result[name]["params"].items() for c in values]
  assert {index for index, _, _ in copies} == {0, 1}
  for leaf in results[0][name]["params"]:
    mine = [c for _, name_, c in copies if name_ == leaf]
    assert len(mine) == 8 and all(c == mine[0] for c in mine), leaf
  return {leaf: np.asarray(values[0], np.float64) for leaf, values in results[0][name]["params"].items()}


# -- the tests --------------------------------------------------------------------------------------------


def test_loss_scaling_skips_the_same_steps_on_both_processes_as_numpy_does(job):
  results, elapsed = job
  assert results[0]["lso"]["reports"] == results[1]["lso"]["reports"]  # the same decisions, the same numbers
  reports = results[0]["lso"]["reports"]
  finite = [s not in lf.PLAN for s in range(lf.STEPS)]
  assert [r["finite"] for r in reports] == finite
  got = [(r["used"], r["scale"], r["counter"], r["skipped"]) for r in reports]
  assert got == reference_schedule(finite)
  assert got[-1][3] == len(lf.PLAN)

  batches, params0 = lf.lso_data()
  want, losses = reference_adam(batches, finite, params0)
  ok = [s for s in range(lf.STEPS) if finite[s]]
  assert_close([reports[s]["loss"] for s in ok], [losses[s] for s in ok], rtol=1e-5)
  params = _every_replica_equal(results, "lso")
  assert_close(params["w"], want["w"], rtol=1e-5, scale=np.abs(want["w"]).max() + 1)
  assert_close(params["b"], want["b"], rtol=1e-5, scale=abs(want["b"]) + 1)
  assert losses[-1] < 0.2 * losses[0]  # it trains between the overflows (13.6 -> 1.4)
  assert elapsed < 150, f"{elapsed:.1f} s"


def test_accumulation_gives_the_one_big_batch_numbers_on_both_processes(job):
  results, _ = job
  assert results[0]["accumulation"]["losses"] == results[1]["accumulation"]["losses"]
  batches, params0 = lf.accumulation_data()
  want, losses = reference_sgd(batches, params0)
  assert_close(results[0]["accumulation"]["losses"], losses, rtol=1e-5)
  params = _every_replica_equal(results, "accumulation")
  for k, v in want.items():
    assert_close(params[k], v, rtol=1e-5, scale=np.abs(v).max() + 1, err_msg=k)
