"""A 2-process job for `RunOptions(check_numerics=True)` on a `run` traced inside the caller's own
`jax.jit` of a `lax.scan`; run by tests/test_numerics.py under ``python -m tpustrat.launch -n 2 -d 4``.

Usage: ``numerics_traced.py STEPS BAD_STEP BAD_REPLICA``

One call of the jitted scan runs STEPS steps; every step adds ``all_reduce(SUM, log(x))`` to a `Mirrored`
total and returns ``log(x)`` per replica, where ``x`` is the replica's id plus one, except on replica
BAD_REPLICA at scan iteration BAD_STEP (from 1), where ``x`` is -1. Then a second call, all clean. Each
process calls `strategy.experimental_run_wait()`, catches the `tpustrat.NumericsError`, prints one
``RESULT {json}`` line (the error's step, replicas, processes and output paths, its message, and whether
the scan's result came back), and exits with status 3; a process that sees no error prints ``RESULT`` with
``"error": null`` and exits 0. A final collective (a `run`) shows that neither process is left waiting.
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

  def step(total, value, i, bad):
    rid = tpustrat.get_replica_context().replica_id_in_sync_group
    y = jnp.log(jnp.where((i == bad_step) & (rid == bad_replica) & bad, -1.0, value))
    return total + tpustrat.get_replica_context().all_reduce("sum", y), y

  @jax.jit
  def loop(total, value, bad):
    def body(t, i):
      t, y = strategy.run(step, args=(t, value, i, bad), options=options)
      return t, y

    return jax.lax.scan(body, total, jnp.arange(1, steps + 1))

  total = strategy.experimental_mirror(np.float32(0))
  total, _ = loop(total, x, True)
  returned = bool(np.isnan(np.asarray(strategy.experimental_local_results(total)[0])))
  loop(strategy.experimental_mirror(np.float32(0)), x, False)
  error = None
  try:
    strategy.experimental_run_wait()
  except tpustrat.NumericsError as e:
    error = {"step": e.step, "replicas": list(e.replicas), "processes": list(e.processes),
             "paths": [o[0] for o in e.outputs], "message": str(e)}
  # Both processes go on into one more collective: no hang.
  strategy.run(lambda v: tpustrat.get_replica_context().all_reduce("sum", v), args=(x,))
  strategy.experimental_run_wait()
  print("RESULT " + json.dumps({"error": error, "process": jax.process_index(), "returned_nan": returned}),
        flush=True)
  sys.exit(3 if error else 0)


if __name__ == "__main__":
  main()
