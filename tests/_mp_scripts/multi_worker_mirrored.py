"""`MultiWorkerMirroredStrategy` and `MirroredStrategy` in a 2-process job; run by tests/test_multiprocess.py.

``python -m tpustrat.launch -n 2 -d 4 tests/_mp_scripts/multi_worker_mirrored.py``: each process first tries
``MirroredStrategy()`` before connecting (the launcher's variables describe the job), then connects through
``MultiWorkerMirroredStrategy`` with ring options, tries ``MirroredStrategy()`` and
``MirroredStrategy(this process's devices)`` inside the connected job, and prints one ``RESULT {json}``
line: the errors' messages, the strategy's replicas, its resolver's answers, and sums over every replica
of the job (``ReplicaContext.all_reduce`` under the strategy's ring options and under a call's own NCCL
options, and ``extended.reduce_to``).
"""

import json

import jax
import numpy as np

import tpustrat


def error_of(make):
  try:
    make()
  except ValueError as e:
    return str(e)
  return None


out = {"before_connecting": error_of(tpustrat.MirroredStrategy)}
ring = tpustrat.CommunicationOptions(implementation="ring", bytes_per_pack=64)
strategy = tpustrat.MultiWorkerMirroredStrategy(communication_options=ring)
out["connected"] = error_of(tpustrat.MirroredStrategy)
out["local_devices"] = error_of(lambda: tpustrat.MirroredStrategy(jax.local_devices()))
r = strategy.cluster_resolver
out["resolver"] = {"type": type(r).__name__, "task": [r.task_type, r.task_id], "spec": r.cluster_spec().as_dict(),
                   "accelerators": r.num_accelerators(), "processes": [r.num_processes, r.process_id]}
out["replicas"] = [strategy.num_replicas_in_sync, len(strategy.extended.worker_devices)]
x = np.arange(8 * 5, dtype=np.float32).reshape(8, 5) ** 1.5
value = strategy.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group])


def step(v):
  ctx = tpustrat.get_replica_context()
  nccl = tpustrat.CommunicationOptions(implementation="nccl")
  return ctx.all_reduce("sum", v), ctx.all_reduce("sum", v, options=nccl)


by_ring, by_nccl = strategy.run(step, args=(value,))
reduced = strategy.extended.reduce_to("sum", value, destinations=value)
out["sums"] = [np.asarray(strategy.experimental_local_results(v)[0]).tolist() for v in (by_ring, by_nccl, reduced)]
out["ring_lowered"] = "collective_permute" in jax.jit(lambda v: strategy.run(step, args=(v,))).lower(value).as_text()
print("RESULT " + json.dumps(out), flush=True)
