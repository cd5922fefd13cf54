"""Saves a step that is on disk already, from 2 processes (tests/test_checkpoint.py).

Run as ``python -m tpustrat.launch -n 2 -d 4 tests/_ckpt_scripts/replace_mp.py CKPT_DIR``.

Every process saves checkpoints 1 (``w = 1``) and 2 (``w = 2``), each with the iterator's position, then
step 2 again (``w = 3``, one batch further: it replaces step 2), then step 1 (older than the newest: a
`ValueError`, on every process), and restores the newest step with a fresh manager. Prints ``RESULT``
with what the second save of step 2 returned, the error, whether ``2.replaced`` existed while that save
was in flight, the steps, the restored ``w`` and the first element of the next batch, and what
`strategy.extended.should_checkpoint` / `should_save_summary` say on this process (TF's Model Garden loop
guards its own writes with them; every process calls `save`).
"""

from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import numpy as np

import tpustrat
from tpustrat.checkpoint import CheckpointManager


def main(ckpt_dir: str) -> None:
  strategy = tpustrat.TPUStrategy()
  dist = strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(6)])
  it = iter(dist)
  with CheckpointManager(ckpt_dir, strategy) as manager:
    for step in (1, 2):
      next(it)
      manager.save(step, {"w": strategy.run(lambda s=step: jnp.float32(s))}, iterator=it)
    next(it)
    replaced = manager.save(2, {"w": strategy.run(lambda: jnp.float32(3))}, iterator=it)
    aside = os.path.isdir(os.path.join(ckpt_dir, "2.replaced"))
    manager.wait_until_finished()
    try:
      manager.save(1, {"w": strategy.run(lambda: jnp.float32(4))})
      error = None
    except ValueError as e:
      error = str(e)
    steps = manager.all_steps()
  resumed = iter(dist)
  with CheckpointManager(ckpt_dir, strategy) as manager:
    state = manager.restore(target={"w": tpustrat.Mirrored(jnp.float32(0))}, iterator=resumed)
  result = {
      "replaced": replaced,
      "aside_while_writing": aside,
      "error": error,
      "steps": steps,
      "w": float(strategy.experimental_local_results(state["w"])[0]),
      "next_batch": float(strategy.experimental_local_results(next(resumed))[0][0]),
      "should": [[s.extended.should_checkpoint, s.extended.should_save_summary]
                 for s in (strategy, tpustrat.MultiWorkerMirroredStrategy())],
  }
  print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
