"""The training loop of ``linear_sgd.py``, with a SIGTERM that comes before the preemption handler exists.

Run by tests/test_preemption.py under ``python -m tpustrat.launch``.

Usage: ``early_notice.py CKPT_DIR OUT_DIR --process P``

On the first attempt (``TPUSTRAT_RESTART_COUNT`` unset or 0, and no checkpoint yet), process P sends
itself SIGTERM after connecting (``tpustrat.TPUStrategy()``, which starts JAX's distributed runtime and
with it JAX's own SIGTERM handler) and before it creates its `PreemptionCheckpointHandler`: while it
"builds the model" (a compiled initialisation). The loop, its records (``OUT_DIR/steps_p<index>.jsonl``)
and its result (``OUT_DIR/final.npz``) are those of ``linear_sgd.py``, so a test compares this run with
an uninterrupted run of that script.
"""

import argparse
import importlib.util
import os
import pathlib
import signal

import jax
import jax.numpy as jnp

import tpustrat

_spec = importlib.util.spec_from_file_location("linear_sgd", pathlib.Path(__file__).with_name("linear_sgd.py"))
linear_sgd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(linear_sgd)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("ckpt_dir")
  parser.add_argument("out_dir")
  parser.add_argument("--process", type=int, default=1)
  args = parser.parse_args()

  strategy = tpustrat.TPUStrategy()  # connected: JAX's preemption notifier is installed
  index = jax.process_index()
  attempt = int(os.environ.get("TPUSTRAT_RESTART_COUNT", "0"))
  manager = tpustrat.checkpoint.CheckpointManager(args.ckpt_dir, strategy)
  first_attempt = attempt == 0 and manager.latest_step() is None
  if first_attempt and index == args.process:
    os.kill(os.getpid(), signal.SIGTERM)  # the notice, while the model is built: no handler yet
    print(f"process {index} got SIGTERM before creating its handler", flush=True)
  init = {"w": tpustrat.Mirrored(jax.jit(lambda: jnp.zeros(linear_sgd.FEATURES, jnp.float32))())}  # "building"

  handler = tpustrat.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
  it = iter(strategy.experimental_distribute_dataset(linear_sgd.dataset()))
  state = handler.restore(init, iterator=it)
  print(f"process {index} attempt {attempt} starts at step {handler.total_run_calls}", flush=True)

  def train(state, batch):
    return strategy.run(linear_sgd.step, args=(state, batch))

  linear_sgd.train_loop(strategy, handler, manager, it, state, train, args.out_dir, attempt)


if __name__ == "__main__":
  main()
