"""Loss scaling and gradient accumulation on one 2-process job; run by tests/test_loop_multiprocess.py under
``python -m tpustrat.launch -n 2 -d 4``.

Every process prints one ``RESULT {json}`` line with two parts, which the test compares between the
processes and with numpy:

* ``"lso"``: a linear model trained with Adam inside `tpustrat.mixed_precision.LossScaleOptimizer` for
  `STEPS` steps on the job's 8 replicas (2 rows each), the first `RUN_STEPS` through `strategy.run` (one
  call per step) and the rest through `experimental_run_steps` (one program). At the steps of `PLAN` a row
  of one replica of process 1 (replicas 4-7) carries a poison term, finite unscaled and infinite times the
  loss scale, so only process 1's devices see an overflow. Per step: the scale used and after, the
  counter, the skipped count, the finite flag and the loss; then the final parameters of every replica
  this process holds.
* ``"accumulation"``: a small MLP trained with SGD for 3 steps (the last batch partial: 13 real rows of
  32, so process 1's replicas hold padding only) with ``tpustrat.accumulate_gradients(...,
  gradient_accumulation_steps=2)`` under ``RunOptions(check_numerics=True)``: the losses and the final
  parameters of every replica this process holds.

The data (`lso_data`, `accumulation_data`) is made here from fixed seeds; the test imports this file to
make the same data for its numpy reference.
"""

from __future__ import annotations

import json

import numpy as np

N = 8  # replicas: 2 processes x 4 devices
# Loss scaling.
D = 16
ROWS = 2  # per replica
STEPS = 16
RUN_STEPS = 8  # through strategy.run; the rest through experimental_run_steps
INITIAL_SCALE = 2.0 ** 12
GROWTH = 3
POISON = 1e37  # finite; times any loss scale >= 2**5 it overflows float32
LR = 0.2
# step -> (replica whose first row carries the poison, feature j): replicas of process 1 only, two in a
# row, one in each half (run / run_steps).
PLAN = {3: (5, 1), 4: (6, 14), 9: (4, 6), 13: (7, 9)}
# Accumulation.
GLOBAL = 32  # rows of a full global batch: 4 per replica
ACC_ROWS = (GLOBAL, GLOBAL, 13)  # the last batch partial
K = 2
ACC_LR = 0.1


def lso_data():
  """(global batches ``{"x", "y", "poison"}``, initial parameters ``{"w", "b"}``)."""
  rng = np.random.default_rng(0)
  w_true = rng.normal(size=D).astype(np.float32)
  batches = []
  for s in range(STEPS):
    x = rng.normal(size=(N * ROWS, D)).astype(np.float32)
    y = (x @ w_true + 0.1 * rng.normal(size=N * ROWS)).astype(np.float32)
    poison = np.zeros((N * ROWS, D), np.float32)
    if s in PLAN:
      replica, j = PLAN[s]
      poison[replica * ROWS, j] = POISON
    batches.append({"x": x, "y": y, "poison": poison})
  return batches, {"w": (0.1 * rng.normal(size=D)).astype(np.float32), "b": np.float32(0.5)}


def accumulation_data():
  """(global batches ``{"x", "y"}`` of `ACC_ROWS` rows, initial MLP parameters)."""
  rng = np.random.default_rng(1)
  batches = [{"x": rng.normal(size=(rows, 6)).astype(np.float32), "y": rng.normal(size=(rows, 3)).astype(np.float32)}
             for rows in ACC_ROWS]
  params = {"w1": (rng.normal(size=(6, 8)) / np.sqrt(6)).astype(np.float32),
            "b1": (0.1 * rng.normal(size=8)).astype(np.float32),
            "w2": (rng.normal(size=(8, 3)) / np.sqrt(8)).astype(np.float32),
            "b2": (0.1 * rng.normal(size=3)).astype(np.float32)}
  return batches, params


def local_values(strategy, tree):
  """{name: [this process's replicas' copies as lists]} of a dict of `Mirrored` values."""
  return {k: [np.asarray(c).tolist() for c in strategy.experimental_local_results(v)] for k, v in tree.items()}


def train_lso(strategy):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import tpustrat  # pylint: disable=import-outside-toplevel
  from tpustrat import mixed_precision as mp  # pylint: disable=import-outside-toplevel

  batches, params0 = lso_data()
  lso = mp.LossScaleOptimizer(optax.adam(LR), initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH)

  def loss_fn(params, batch):
    resid = batch["x"] @ params["w"] + params["b"] - batch["y"]
    return jnp.sum(resid ** 2) / (N * ROWS) + jnp.sum(batch["poison"] @ params["w"])

  def step(state, batch):
    ctx = tpustrat.get_replica_context()
    loss, grads = lso.value_and_grad(loss_fn, state["opt"])(tpustrat.local_copy(state["params"]), batch)
    grads = mp.all_reduce_gradients(grads, "mixed_float16")  # summed in float32
    updates, opt = lso.update(grads, state["opt"], state["params"])
    report = {"used": state["opt"].loss_scale, "scale": opt.loss_scale, "counter": opt.counter,
              "skipped": opt.skipped_steps, "finite": opt.last_finite, "loss": ctx.all_reduce("sum", loss)}
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, report

  params = strategy.experimental_mirror(params0)
  state = {"params": params, "opt": strategy.run(lso.init, args=(params,))}
  it = iter(strategy.experimental_distribute_dataset(batches))
  reports = []
  for _ in range(RUN_STEPS):
    state, report = strategy.run(step, args=(state, next(it)))
    for v in report.values():
      assert isinstance(v, tpustrat.Mirrored), v  # every replica took the same decision
    reports.append({k: np.asarray(strategy.experimental_local_results(v)[0]).item() for k, v in report.items()})
  state, stacked = strategy.experimental_run_steps(step, it, STEPS - RUN_STEPS, init=state)
  columns = {k: np.asarray(strategy.experimental_local_results(v)[0]).tolist() for k, v in stacked.items()}
  reports += [{k: columns[k][s] for k in columns} for s in range(STEPS - RUN_STEPS)]
  it.close()
  return {"reports": reports, "params": local_values(strategy, state["params"])}


def train_accumulation(strategy):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import tpustrat  # pylint: disable=import-outside-toplevel

  batches, params0 = accumulation_data()
  tx = optax.sgd(ACC_LR)

  def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    err = jnp.sum((h @ p["w2"] + p["b2"] - batch["y"]) ** 2, axis=-1)
    return jnp.sum(jnp.where(tpustrat.valid_mask(batch["x"]), err, 0.0)) / GLOBAL

  def step(state, batch):
    ctx = tpustrat.get_replica_context()
    loss, grads = tpustrat.accumulate_gradients(loss_fn, state["params"], batch, gradient_accumulation_steps=K)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, ctx.all_reduce("sum", loss)

  state = strategy.experimental_mirror({"params": params0, "opt": tx.init(params0)})
  options = tpustrat.RunOptions(check_numerics=True)
  losses = []
  for batch in strategy.experimental_distribute_dataset(batches):
    state, loss = strategy.run(step, args=(state, batch), options=options)
    losses.append(np.asarray(strategy.experimental_local_results(loss)[0]).item())
  strategy.experimental_run_wait()  # the last step's numerics check
  return {"losses": losses, "params": local_values(strategy, state["params"])}


def main() -> None:
  import jax  # pylint: disable=import-outside-toplevel

  import tpustrat  # pylint: disable=import-outside-toplevel

  strategy = tpustrat.TPUStrategy()
  assert strategy.num_replicas_in_sync == N and jax.process_count() == 2
  out = {"process": jax.process_index(), "lso": train_lso(strategy), "accumulation": train_accumulation(strategy)}
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
