"""A job that trains a few steps under a profile; run by tests/test_profiler.py.

``python -m tpustrat.launch -n 2 -d 4 [--profile DIR --profile-steps N] tests/_mp_scripts/profile_steps.py
KIND [LOGDIR]``: every process joins the job, builds a strategy of KIND (``tpu``: `TPUStrategy` over the 8
devices of the job; ``mirrored``: a strategy over its own 4,
`TPUStrategy(device_assignment=jax.local_devices())` after `tpustrat.experimental_connect_to_cluster`:
`MirroredStrategy` refuses a multi-process job), then runs 3 steps with `strategy.run` and 4 with
`experimental_run_steps`, fed by a distributed iterator. With LOGDIR it profiles those steps itself with
`tpustrat.experimental.profile(LOGDIR)`; without, the launcher's ``--profile`` does. Each process prints
``RESULT {json}``: its index, the steps dispatched and the directory its profile went to.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import tpustrat

kind = sys.argv[1]
if kind == "mirrored":
  tpustrat.experimental_connect_to_cluster(tpustrat.cluster_resolver.TPUClusterResolver())
  strategy = tpustrat.TPUStrategy(device_assignment=jax.local_devices())  # this process's 4 alone
else:
  strategy = tpustrat.TPUStrategy()
n = strategy.num_replicas_in_sync


def train_step(w, x):
  loss = tpustrat.get_replica_context().all_reduce("sum", jnp.sum(x * w))
  return w - 0.01 * loss, loss


def loop():
  it = iter(strategy.experimental_distribute_dataset([np.ones(2 * n, np.float32)] * 16))
  w = jnp.float32(1.0)
  for _ in range(3):
    w, _ = strategy.run(train_step, args=(w, next(it)))
  w, losses = strategy.experimental_run_steps(train_step, it, 4, init=w)
  jax.block_until_ready((w, losses))


if len(sys.argv) > 2:
  with tpustrat.experimental.profile(sys.argv[2]) as directory:
    loop()
else:
  directory = None
  loop()
print("RESULT " + json.dumps({"process": jax.process_index(), "steps": tpustrat.experimental.steps_dispatched(),
                              "directory": directory}), flush=True)
