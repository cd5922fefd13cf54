"""A 2-process job for `RunOptions(check_numerics=True)`; run by tests/test_numerics.py under
``python -m tpustrat.launch -n 2 -d 4``.

Usage: ``numerics_nan.py STEPS BAD_STEP BAD_REPLICA``

Every step adds ``all_reduce(SUM, log(x))`` to a `Mirrored` state and returns ``log(x)`` per replica, where
``x`` is the replica's id plus one, except on replica BAD_REPLICA at step BAD_STEP, where ``x`` is -1: a NaN
made inside the program on one replica (of process 1 for a replica >= 4). Each process catches the
`tpustrat.NumericsError`, prints one ``RESULT {json}`` line (the call that raised it, and the error's step,
replicas, processes and output paths), and exits with status 3; a process that sees no error prints
``RESULT`` with ``"error": null`` and exits 0.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import tpustrat


def main() -> None:
  steps, bad_step, bad_replica = (int(a) for a in sys.argv[1:4])
  strategy = tpustrat.TPUStrategy()
  x = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.float32(ctx.replica_id_in_sync_group + 1))
  options = tpustrat.RunOptions(check_numerics=True)

  def step(state, value):
    count = state["step"] + 1
    rid = tpustrat.get_replica_context().replica_id_in_sync_group
    y = jnp.log(jnp.where((count == bad_step) & (rid == bad_replica), -1.0, value))
    return {"total": state["total"] + tpustrat.get_replica_context().all_reduce("sum", y), "step": count}, y

  state = strategy.experimental_mirror({"total": np.float32(0), "step": np.int32(0)})
  call = 0
  try:
    while call < steps:
      call += 1
      state, _ = strategy.run(step, args=(state, x), options=options)
    call = steps + 1  # the final wait
    strategy.experimental_run_wait()
  except tpustrat.NumericsError as e:
    print("RESULT " + json.dumps({"error": {"call": call, "step": e.step, "replicas": list(e.replicas),
                                            "processes": list(e.processes),
                                            "paths": [o[0] for o in e.outputs]},
                                  "process": jax.process_index(), "message": str(e)}), flush=True)
    sys.exit(3)
  print("RESULT " + json.dumps({"error": None, "process": jax.process_index()}), flush=True)


if __name__ == "__main__":
  main()
