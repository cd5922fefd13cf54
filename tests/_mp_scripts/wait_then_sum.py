"""A job that connects, waits for the test's signal, then sums over its replicas; run by tests/test_launch.py.

``python -m tpustrat.launch -n 2 -d 2 tests/_mp_scripts/wait_then_sum.py GO_FILE``: every process joins
the job (``TPUStrategy()``), prints ``connected``, waits until the file GO_FILE exists (at most 120 s),
then prints one ``RESULT {json}`` line: the all-reduced sum over the replicas of ``replica id + 1``,
computed on the devices of the whole job, and the number of replicas.
"""

import json
import os
import sys
import time

import jax.numpy as jnp

import tpustrat

strategy = tpustrat.TPUStrategy()  # joins the launcher's job (TPUSTRAT_* environment variables)
print("connected", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]):
  if time.monotonic() > deadline:
    sys.exit("the test never said go")
  time.sleep(0.05)


def replica_sum():
  ctx = tpustrat.get_replica_context()
  return ctx.all_reduce("sum", jnp.float32(ctx.replica_id_in_sync_group + 1))


total = strategy.run(replica_sum)
print("RESULT " + json.dumps({"sum": float(strategy.experimental_local_results(total)[0]),
                              "replicas": strategy.num_replicas_in_sync}), flush=True)
