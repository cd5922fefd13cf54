"""A training loop that survives preemption: stop it with Ctrl-C or SIGTERM, run it again, and it resumes.

What this example shows
-----------------------
Cloud TPU users train on preemptible and spot VMs, which get a termination notice (SIGTERM) shortly
before they go. `tpustrat.PreemptionCheckpointHandler` (TF's
`tf.distribute.experimental.PreemptionCheckpointHandler`) turns that notice into a checkpoint:

* `handler.restore(init_state, iterator=it)` returns the latest checkpoint's state (or `init_state`),
  moves the grain iterator to the saved position and sets `handler.total_run_calls`;
* each step goes through `handler.run(train_fn, state, batch)`, which counts it;
* on SIGTERM (to any process of the job), every process saves the state and the input position at the
  same step and exits with status 42, "restart me"; a periodic save every ``--save-every`` steps covers
  crashes that give no notice;
* run it again and it continues at the saved step, with the next batch: the final parameters are the
  ones of an uninterrupted run (the tests check this bit for bit).

Here Ctrl-C (SIGINT) is turned into the same notice, so that a keyboard interrupt saves too.

TensorFlow -> tpustrat
----------------------
::

    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)        # TF: variables
    handler = tf.distribute.experimental.PreemptionCheckpointHandler(resolver, checkpoint, "/ckpt")
    while handler.total_run_calls < STEPS:
      handler.run(distributed_train_step, next(iterator))

    handler = tpustrat.PreemptionCheckpointHandler(resolver, "/ckpt")      # tpustrat: functional state
    state = handler.restore(state, iterator=it)
    while handler.total_run_calls < STEPS:
      state, loss = handler.run(train_fn, state, next(it))

Run it::

    python examples/preemptible.py --ckpt-dir /tmp/preemptible        # press Ctrl-C, then run it again
    python -m tpustrat.launch -n 2 -d 4 --max-restarts 3 examples/preemptible.py --ckpt-dir /tmp/pre2
        # then, from another terminal: kill -TERM <pid of one process>; the launcher restarts the job
    python examples/preemptible.py --ckpt-dir /tmp/p3 --preempt-at 40   # a simulated SIGTERM at step 40
"""

from __future__ import annotations

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import signal  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import grain  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import tpustrat  # noqa: E402

FEATURES, CLASSES = 16, 4


def dataset(num_examples: int, global_batch: int, seed: int = 0) -> Any:
  """A shuffled grain dataset of a synthetic 4-class problem (labels from a fixed linear map)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(num_examples, FEATURES)).astype(np.float32)
  y = np.argmax(x @ rng.normal(size=(FEATURES, CLASSES)), axis=1).astype(np.int32)
  return (grain.MapDataset.range(num_examples).map(lambda i: {"x": x[i], "y": y[i]})
          .shuffle(seed=seed).repeat().batch(global_batch, drop_remainder=True))


class MLP(nnx.Module):

  def __init__(self, rngs: nnx.Rngs) -> None:
    self.hidden = nnx.Linear(FEATURES, 64, rngs=rngs)
    self.out = nnx.Linear(64, CLASSES, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jax.nn.relu(self.hidden(x)))


def make_train_fn(strategy: tpustrat.Strategy, graphdef: Any, tx: Any, global_batch: int):
  """`train_fn(state, batch) -> (new_state, loss)`, one `strategy.run` step, as `handler.run` calls it."""

  def step(state, batch):
    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).sum() / global_batch

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])  # already summed over replicas
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    return new_state, tpustrat.get_replica_context().all_reduce("sum", loss)

  def train_fn(state, batch):
    # The state's buffers are reused for the new state (donated): the old state is gone after the call.
    return strategy.run(step, args=(state, batch), options=tpustrat.RunOptions(donate_argnums=0))

  return train_fn


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--ckpt-dir", required=True, help="where checkpoints go (resumed from when present)")
  parser.add_argument("--steps", type=int, default=200, help="training steps in all")
  parser.add_argument("--save-every", type=int, default=50, help="periodic checkpoint interval, in steps")
  parser.add_argument("--global-batch-size", type=int, default=64)
  parser.add_argument("--preempt-at", type=int, default=None,
                      help="send this process SIGTERM during that step, when starting from scratch (a demo)")
  args = parser.parse_args(argv)

  strategy = tpustrat.TPUStrategy()
  is_main = jax.process_index() == 0
  tx = optax.adam(1e-2)
  graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
  init_state = {"params": params, "opt_state": tx.init(params)}  # plain arrays: replicated by `run`

  manager = tpustrat.checkpoint.CheckpointManager(args.ckpt_dir, strategy, max_to_keep=2)
  handler = tpustrat.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
  # Ctrl-C is a termination notice too (the handler listens to SIGTERM).
  previous_sigint = signal.signal(signal.SIGINT, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
  it = iter(strategy.experimental_distribute_dataset(dataset(4096, args.global_batch_size)))
  state = handler.restore(init_state, iterator=it)
  start = handler.total_run_calls
  if is_main:
    print(f"{strategy!r}: {'resuming at step ' + str(start) if start else 'starting'}; "
          f"{args.steps} steps, checkpoints in {manager.directory}", flush=True)
  train_fn = make_train_fn(strategy, graphdef, tx, args.global_batch_size)
  preempt = args.preempt_at if start == 0 else None
  losses = []
  try:
    while handler.total_run_calls < args.steps:
      if preempt is not None and handler.total_run_calls == preempt - 1:
        os.kill(os.getpid(), signal.SIGTERM)  # what a preemptible VM receives
      state, loss = handler.run(train_fn, state, next(it))
      step = handler.total_run_calls
      if step % 10 == 0 or step == args.steps:
        losses.append(float(np.asarray(strategy.experimental_local_results(loss)[0])))
        if is_main:
          print(f"step {step:4d}: loss {losses[-1]:.4f}", flush=True)
      if step % args.save_every == 0:
        manager.save(step, state, iterator=it)
  finally:
    signal.signal(signal.SIGINT, previous_sigint)
  manager.close()
  handler.close()
  params_out = jax.tree.map(lambda v: np.asarray(strategy.experimental_local_results(v)[0]), state["params"],
                            is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))
  return {"started_at": start, "total_run_calls": handler.total_run_calls, "losses": losses,
          "params": params_out}


if __name__ == "__main__":
  summary = main()
  if jax.process_index() == 0:
    print(f"done: {summary['total_run_calls']} steps (started at {summary['started_at']}), "
          f"final loss {summary['losses'][-1]:.4f}")
