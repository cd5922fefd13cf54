"""A small job for the step watchdog; run by tests/test_watchdog.py under ``python -m tpustrat.launch``.

Usage: ``watchdog_faults.py MODE SECONDS STEPS [STUCK]``

Every step adds ``all_reduce(SUM, x)`` to a `Mirrored` state, where ``x`` is the replica's id plus one, so
after ``STEPS`` steps on ``N`` replicas the state is ``STEPS * N * (N + 1) / 2``. Process 0 prints one
``RESULT {json}`` line at the end: the state, the number of steps and replicas.

MODE is what process STUCK (default 1; "process 1" below) does wrong:

* ``slow-compile``: the step function sleeps SECONDS while it is traced (on process 1 only): a compile that
  takes longer than the step timeout, as a cold compilation cache beside a warm one does. Not a hang: the
  job must finish.
* ``hang``: process 1 sleeps forever (in Python) before its step 3: a live but stuck process.
* ``callback``: at step 3 the step program's host callback (`jax.experimental.io_callback`, before the
  all-reduce) never returns on process 1: every process dispatched step 3, none finishes it.
* ``none``: nothing; the job runs STEPS steps.

Each process prints ``process P dispatched step S`` after each dispatch. Every argument of the step is
already on the devices (the state, with its own step counter): a host array would be placed with
`jax.device_put`, which checks across processes that every process passes the same value, outside any
program the watchdog times.
"""

import json
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import tpustrat

STUCK_STEP = 3


def main() -> None:
  mode, seconds, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
  stuck = int(sys.argv[4]) if len(sys.argv) > 4 else 1
  strategy = tpustrat.TPUStrategy()
  index = jax.process_index()
  x = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
  forever = threading.Event()  # never set

  def host_check(step):
    """The step program's host callback; blocks forever on process 1 at STUCK_STEP in ``callback`` mode."""
    if mode == "callback" and index == stuck and int(step) == STUCK_STEP:
      forever.wait()  # the stuck host callback
    return np.zeros((), np.float32)

  def step(state, value):
    if mode == "slow-compile" and index == stuck:
      time.sleep(seconds)  # at trace time: part of compiling the program, on process 1 only
    total, count = state["total"], state["step"] + 1
    if mode == "callback":
      value = value + io_callback(host_check, jax.ShapeDtypeStruct((), jnp.float32), count)
    return {"total": total + tpustrat.get_replica_context().all_reduce("sum", value), "step": count}

  state = {"total": jnp.zeros((), jnp.float32), "step": jnp.zeros((), jnp.int32)}
  for i in range(1, steps + 1):
    if mode == "hang" and index == stuck and i == STUCK_STEP:
      print(f"process {index} hangs before step {i}", flush=True)
      forever.wait()
    state = strategy.run(step, args=(state, x))
    print(f"process {index} dispatched step {i}", flush=True)
  total = float(np.asarray(strategy.experimental_local_results(state["total"])[0]))
  if index == 0:
    print("RESULT " + json.dumps({"state": total, "steps": steps, "replicas": strategy.num_replicas_in_sync}),
          flush=True)


if __name__ == "__main__":
  main()
