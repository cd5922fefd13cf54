"""A training loop under `tpustrat.PreemptionCheckpointHandler` that runs until the launcher gets SIGTERM.

Run by tests/test_launch.py: ``python -m tpustrat.launch -n 2 -d 2 preempted_by_sigterm.py CKPT_DIR``.
The state is one `Mirrored` counter that each call of the handler adds 1 to (on the devices, summed over
the replicas and divided by their number), so the checkpoint of call ``c`` holds ``c``. Every process
prints ``ready`` once it has made 3 calls, then keeps calling (a few milliseconds apart) until the test
sends SIGTERM to the launcher, which forwards it: the handler saves at one agreed call on every process
and exits with status 42. The loop is bounded (2000 calls) and exits 3 if no notice ever came.
"""

import sys
import time

import jax.numpy as jnp

import tpustrat

strategy = tpustrat.TPUStrategy()  # joins the launcher's job (TPUSTRAT_* environment variables)
manager = tpustrat.checkpoint.CheckpointManager(sys.argv[1], strategy)
handler = tpustrat.PreemptionCheckpointHandler(strategy.cluster_resolver, manager)
state = handler.restore({"count": tpustrat.Mirrored(jnp.zeros((), jnp.float32))})


def step(state):
  ctx = tpustrat.get_replica_context()
  one = ctx.all_reduce("sum", jnp.float32(1.0)) / ctx.num_replicas_in_sync
  return {"count": state["count"] + one}


def train(state):
  new = strategy.run(step, args=(state,))
  return (new,)


while handler.total_run_calls < 2000:
  (state,) = handler.run(train, state)
  float(strategy.experimental_local_results(state["count"])[0])  # waits for the call
  if handler.total_run_calls == 3:
    print("ready", flush=True)
  time.sleep(0.01)
sys.exit(3)
