"""A preemptible training loop: a linear model, SGD, a shuffled grain dataset, a checkpoint every 10 steps,
60 steps in all. Run by tests/test_preemption.py, alone or under ``python -m tpustrat.launch``.

Usage: ``linear_sgd.py CKPT_DIR OUT_DIR [--fault KIND --at STEP --process P] [--steps N --save-every K]
[--reduce]``

* KIND ``term`` / ``kill``: process P sends itself SIGTERM / SIGKILL during the STEP-th call of the
  handler (when ``total_run_calls == STEP - 1``), on the first attempt only (``TPUSTRAT_RESTART_COUNT``
  unset or 0, and no checkpoint at or after STEP yet: a run may start from a checkpoint copied in);
* KIND ``hang``: process P sleeps forever before its STEP-th step (a live but stuck process).

Every process appends one JSON line per step to ``OUT_DIR/steps_p<index>.jsonl``, before the step: the
attempt, the step (``total_run_calls`` after the call) and the ids of the step's examples. At the end,
process 0 writes the final parameters to ``OUT_DIR/final.npz`` with ``total_run_calls``.

``--steps`` / ``--save-every`` (default 60 / 10) shorten the run (tests/test_many_processes.py). With
``--reduce`` every process also appends, after each call, ``{"attempt", "step", "loss", "y_sum"}`` to
``OUT_DIR/reduced_p<index>.jsonl``: the step's all-reduced loss and ``strategy.reduce("SUM", batch["y"],
axis=0)``, the sum over every replica's rows of the batch's targets.
"""

import argparse
import json
import os
import signal
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np

import tpustrat

STEPS = 60
GLOBAL_BATCH = 16
FEATURES = 4
LEARNING_RATE = 0.05


def dataset(steps: int = STEPS):
  rng = np.random.default_rng(0)
  n = steps * GLOBAL_BATCH
  x = rng.normal(size=(n, FEATURES)).astype(np.float32)
  y = (x @ np.arange(1, FEATURES + 1, dtype=np.float32) + 0.1 * rng.normal(size=n)).astype(np.float32)
  examples = grain.MapDataset.range(n).map(lambda i: {"id": np.int32(i), "x": x[i], "y": y[i]})
  return examples.shuffle(seed=3).batch(GLOBAL_BATCH)


def step(state, batch):
  def loss_fn(w):
    return jnp.sum((batch["x"] @ w - batch["y"]) ** 2) / GLOBAL_BATCH

  loss, grad = jax.value_and_grad(loss_fn)(state["w"])  # w is Mirrored: the gradient is already summed
  return {"w": state["w"] - LEARNING_RATE * grad}, tpustrat.get_replica_context().all_reduce("sum", loss)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("ckpt_dir")
  parser.add_argument("out_dir")
  parser.add_argument("--fault", choices=("term", "kill", "hang"))
  parser.add_argument("--at", type=int, default=0)
  parser.add_argument("--process", type=int, default=0)
  parser.add_argument("--steps", type=int, default=STEPS)
  parser.add_argument("--save-every", type=int, default=10)
  parser.add_argument("--reduce", action="store_true")
  args = parser.parse_args()

  strategy = tpustrat.TPUStrategy()
  index = jax.process_index()
  attempt = int(os.environ.get("TPUSTRAT_RESTART_COUNT", "0"))
  manager = tpustrat.checkpoint.CheckpointManager(args.ckpt_dir, strategy)
  first_attempt = attempt == 0 and (manager.latest_step() or 0) < args.at
  handler = tpustrat.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
  it = iter(strategy.experimental_distribute_dataset(dataset(args.steps)))
  state = handler.restore({"w": tpustrat.Mirrored(jnp.zeros(FEATURES, jnp.float32))}, iterator=it)
  print(f"process {index} attempt {attempt} starts at step {handler.total_run_calls}", flush=True)

  fault_here = args.fault is not None and index == args.process

  def train(state, batch):
    if fault_here and handler.total_run_calls == args.at - 1:
      if args.fault == "hang":
        print(f"process {index} hangs before step {args.at}", flush=True)
        while True:
          time.sleep(3600)
      if first_attempt:
        os.kill(os.getpid(), signal.SIGTERM if args.fault == "term" else signal.SIGKILL)
    return strategy.run(step, args=(state, batch))

  train_loop(strategy, handler, manager, it, state, train, args.out_dir, attempt, steps=args.steps,
             save_every=args.save_every, reduce=args.reduce)


def train_loop(strategy, handler, manager, it, state, train, out_dir, attempt, steps=STEPS, save_every=10,
               reduce=False):
  """The loop both scripts run: each step's batch ids logged to ``OUT_DIR/steps_p<index>.jsonl`` before
  the call, a checkpoint every `save_every` steps, and process 0's final parameters in
  ``OUT_DIR/final.npz``; with `reduce`, each step's reduced values in ``OUT_DIR/reduced_p<index>.jsonl``."""
  index = jax.process_index()
  log = open(os.path.join(out_dir, f"steps_p{index}.jsonl"), "a")
  reduced = open(os.path.join(out_dir, f"reduced_p{index}.jsonl"), "a") if reduce else None
  while handler.total_run_calls < steps:
    batch = next(it)
    ids = [int(i) for i in np.asarray(strategy.gather(batch["id"], axis=0))]
    # Logged before the call: the call that saves after a termination notice does not return.
    log.write(json.dumps({"attempt": attempt, "step": handler.total_run_calls + 1, "ids": ids}) + "\n")
    log.flush()
    state, loss = handler.run(train, state, batch)
    step_no = handler.total_run_calls
    # waits for the step, as a loss log would
    loss_value = np.asarray(strategy.experimental_local_results(loss)[0])
    if reduced is not None:
      y_sum = np.asarray(strategy.reduce("SUM", batch["y"], axis=0))
      reduced.write(json.dumps({"attempt": attempt, "step": step_no, "loss": float(loss_value),
                                "y_sum": float(y_sum)}) + "\n")
      reduced.flush()
    if step_no % save_every == 0:
      manager.save(step_no, state, iterator=it)
      # Written in the background (orbax's asynchronous save); wait, so that a SIGKILL three steps later
      # finds it committed. Without the wait, a kill that soon resumes from the checkpoint before.
      manager.wait_until_finished()
  manager.wait_until_finished()
  handler.close()
  if index == 0:
    final = np.asarray(strategy.experimental_local_results(state["w"])[0])
    np.savez(os.path.join(out_dir, "final.npz"), w=final, total_run_calls=handler.total_run_calls)
  print(f"process {index} done at step {handler.total_run_calls}", flush=True)


if __name__ == "__main__":
  main()
