"""A job that compiles a training step, asks to be restarted once, and compiles it again; run by
tests/test_compilation_cache.py.

``python -m tpustrat.launch -n 2 -d 4 --compilation-cache DIR --max-restarts 1 tests/_mp_scripts/compile_cache.py
KIND``: every process builds a strategy of KIND (``tpu``: `TPUStrategy` over the job's 8 devices; ``mirrored``:
a strategy over its own 4, `TPUStrategy(device_assignment=jax.local_devices())`: `MirroredStrategy` refuses a
multi-process job), runs two steps (`run`, then `experimental_run_steps`) and prints ``RESULT
{json}``: its restart count, the cache directory JAX uses, and the persistent cache's hits and misses
(`jax.monitoring` events). The first start then exits with 42 (the launcher restarts the job); the second
exits with 0.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import tpustrat

events = {"cache_hits": 0, "cache_misses": 0}


def count(event, **kwargs):
  del kwargs
  name = event.rsplit("/", 1)[1]
  if event.startswith("/jax/compilation_cache/"):
    events.setdefault(name, 0)
    events[name] += 1


jax.monitoring.register_event_listener(count)
if sys.argv[1] == "mirrored":
  tpustrat.experimental_connect_to_cluster(tpustrat.cluster_resolver.TPUClusterResolver())
  strategy = tpustrat.TPUStrategy(device_assignment=jax.local_devices())  # this process's 4 alone
else:
  strategy = tpustrat.TPUStrategy()
n = strategy.num_replicas_in_sync


def train_step(w, x):
  loss = tpustrat.get_replica_context().all_reduce("sum", jnp.sum(jnp.tanh(x * w)))
  return w - 0.01 * loss, loss


it = iter(strategy.experimental_distribute_dataset([np.ones(2 * n, np.float32)] * 8))
w, _ = strategy.run(train_step, args=(jnp.float32(1.0), next(it)))
w, losses = strategy.experimental_run_steps(train_step, it, 2, init=w)
restart = int(os.environ["TPUSTRAT_RESTART_COUNT"])
print("RESULT " + json.dumps({"process": jax.process_index(), "restart": restart,
                              "cache_dir": tpustrat.experimental.compilation_cache_dir(),
                              "loss": float(np.asarray(strategy.experimental_local_results(losses)[0])[-1]),
                              **events}), flush=True)
sys.exit(42 if restart == 0 else 0)
