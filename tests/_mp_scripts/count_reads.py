"""Which examples each process reads from a batched grain MapDataset; run by tests/test_input_multiprocess.py.

``python -m tpustrat.launch -n 2 -d 4 tests/_mp_scripts/count_reads.py`` prints, in every process, one
``RESULT {json}`` line, the output of `check(strategy)`; the test runs the same function in its own
process on 8 devices for the one-process answers. The dataset's map function records every example id it
is called with, per dataset, in this process:

* ``epoch``: one pass of ``for batch in experimental_distribute_dataset(ds)`` (two full batches of 16 and
  a partial one of 12 on 8 replicas): the ids read, and what the batches held (this process's replicas'
  components, and the whole batches gathered).
* ``dropped``: the same with ``InputOptions(drop_remainder=True)``: the ids read, and the batches' ids.
* ``resumed``: the batches after ``set_state`` of a state taken after the first batch, and
  ``experimental_run_steps`` over stacked steps (values only).
* ``spec``: the element spec.
"""

from __future__ import annotations

import json
import sys
import threading

import grain
import jax
import numpy as np

import tpustrat

NUM_EXAMPLES = 44
GLOBAL_BATCH = 16
SEED = 3


def example(i: int) -> dict[str, np.ndarray]:
  """Example `i`: its id and a feature vector computed from it."""
  return {"id": np.int32(i), "x": np.arange(3, dtype=np.float32) + np.float32(10 * i)}


def dataset(reads: list[int] | None = None) -> grain.MapDataset:
  """The shuffled, batched dataset; with `reads`, every example read is recorded there."""
  lock = threading.Lock()

  def read(i):
    if reads is not None:
      with lock:  # grain reads in several threads
        reads.append(int(i))
    return example(i)

  return grain.MapDataset.range(NUM_EXAMPLES).map(read).shuffle(seed=SEED).batch(GLOBAL_BATCH)


def host(x) -> list:
  return np.asarray(x).tolist()


def held(strategy: tpustrat.Strategy, batch) -> dict:
  """This process's replicas' real rows, and the whole batch gathered (identical in every process)."""
  def step(b):
    return {"id": b["id"], "x": b["x"] * 2, "count": tpustrat.num_valid_examples(b["id"])[None]}

  out = strategy.run(step, args=(batch,))
  return {
      "local_ids": [host(v) for v in strategy.experimental_local_results(batch["id"])],
      "ids": host(strategy.gather(out["id"], axis=0)),
      "x": host(strategy.gather(out["x"], axis=0)),
      "counts": host(strategy.gather(out["count"], axis=0)),
  }


def check(strategy: tpustrat.Strategy) -> dict:
  out = {"process": jax.process_index(),
         "local_replicas": [int(v) for v in strategy.experimental_local_results(
             strategy.run(lambda: tpustrat.get_replica_context().replica_id_in_sync_group))]}

  reads: list[int] = []
  out["epoch"] = {"batches": [held(strategy, b) for b in strategy.experimental_distribute_dataset(dataset(reads))]}
  out["epoch"]["reads"] = reads

  reads = []
  dist = strategy.experimental_distribute_dataset(dataset(reads), tpustrat.InputOptions(drop_remainder=True))
  out["dropped"] = {"ids": [host(strategy.gather(b["id"], axis=0)) for b in dist], "reads": reads}

  dist = strategy.experimental_distribute_dataset(dataset())
  it = iter(dist)
  first = held(strategy, next(it))
  state = json.loads(json.dumps(it.get_state()))
  again = iter(dist)
  again.set_state(state)
  out["resumed"] = {"first": first, "state": state, "rest": [held(strategy, b) for b in again]}

  def scan_step(carry, b):
    real = jax.numpy.where(tpustrat.valid_mask(b["id"]), b["id"], 0)  # the padding rows are copies of a real row
    return carry + tpustrat.get_replica_context().all_reduce("sum", real.sum()), b["id"] * 1

  carry, ids = strategy.experimental_run_steps(scan_step, iter(dist), 3, init=np.int32(0))
  out["resumed"]["run_steps_total"] = host(carry.values[0])
  out["resumed"]["run_steps_ids"] = [host(strategy.gather(s, axis=0)) for s in tpustrat.unstack_steps(ids)]
  out["spec"] = repr(strategy.experimental_distribute_dataset(dataset()).element_spec)
  return out


if __name__ == "__main__":
  # TPUStrategy() joins the launcher's job (TPUSTRAT_* environment variables).
  print("RESULT " + json.dumps(check(tpustrat.TPUStrategy())), flush=True)
  sys.exit(0)
