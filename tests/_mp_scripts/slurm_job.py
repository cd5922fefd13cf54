"""A 2-process job that connects through `SlurmClusterResolver` alone; run by
tests/test_cluster_resolvers_slurm_tfconfig.py under ``python -m tpustrat.launch -n 2 -d 4``.

Each process turns what the launcher told it into the variables of a Slurm job step of two tasks on one
node called ``127.0.0.1`` (``SLURM_PROCID`` = the launcher's process id, ``port_base`` = the launcher's
free port), removes the ``TPUSTRAT_*`` variables that describe the job (so that only the resolver does),
connects with ``tpustrat.experimental_connect_to_cluster(resolver)``, builds ``TPUStrategy(resolver)``
over the 8 devices of the job and all-reduces one value per replica. It prints one ``RESULT {json}``
line: what the resolver said, what JAX says after connecting, and the sum as every replica of this
process got it.
"""

import json
import os

me = os.environ.pop("TPUSTRAT_PROCESS_ID")
count = os.environ.pop("TPUSTRAT_NUM_PROCESSES")
port = int(os.environ.pop("TPUSTRAT_COORDINATOR_ADDRESS").rsplit(":", 1)[1])
os.environ.pop("TPUSTRAT_COORDINATOR_BIND_ADDRESS", None)
os.environ.pop("CUDA_VISIBLE_DEVICES", None)
os.environ.update({
    "SLURM_JOB_ID": "4242", "SLURM_PROCID": me, "SLURM_LOCALID": me, "SLURM_STEP_NUM_TASKS": count,
    "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_TASKS_PER_NODE": count, "SLURMD_NODENAME": "127.0.0.1",
})

import jax  # noqa: E402
import numpy as np  # noqa: E402

import tpustrat  # noqa: E402

resolver = tpustrat.cluster_resolver.SlurmClusterResolver(port_base=port, gpus_per_node=0)
tpustrat.experimental_connect_to_cluster(resolver)
strategy = tpustrat.TPUStrategy(resolver)


def value(ctx):
  return np.arange(3, dtype=np.float32) + np.float32(10 * ctx.replica_id_in_sync_group)


def step(x):
  return tpustrat.get_replica_context().all_reduce(tpustrat.ReduceOp.SUM, x)


summed = strategy.run(step, args=(strategy.experimental_distribute_values_from_function(value),))
local = [np.asarray(v).tolist() for v in strategy.experimental_local_results(summed)]
print("RESULT " + json.dumps({
    "resolver": [resolver.coordinator_address, resolver.num_processes, resolver.process_id,
                 resolver.task_type, resolver.task_id],
    "jax": [jax.process_index(), jax.process_count(), jax.device_count(), jax.local_device_count()],
    "replicas": strategy.num_replicas_in_sync,
    "local_sums": local,
}), flush=True)
