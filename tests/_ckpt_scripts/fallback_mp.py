"""Saves two checkpoints from 2 processes, or restores the newest intact one (tests/test_checkpoint.py).

Run as ``python -m tpustrat.launch -n 2 -d 4 tests/_ckpt_scripts/fallback_mp.py CKPT_DIR save|restore``.

``save``: every process takes one batch and saves checkpoint 1 (``w = 1``), takes another and saves
checkpoint 2 (``w = 2``), each with the iterator's position. ``restore``: every process restores the newest
intact checkpoint (``restore()`` with no step) and prints ``RESULT`` with the step restored, ``w``, the
first element of the next batch, the steps left and the warnings it got.
"""

from __future__ import annotations

import json
import sys
import warnings

import jax.numpy as jnp
import numpy as np

import tpustrat
from tpustrat.checkpoint import CheckpointManager


def main(ckpt_dir: str, mode: str) -> None:
  strategy = tpustrat.TPUStrategy()
  dist = strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(6)])
  it = iter(dist)
  with CheckpointManager(ckpt_dir, strategy) as manager:
    if mode == "save":
      for step in (1, 2):
        next(it)
        manager.save(step, {"w": strategy.run(lambda s=step: jnp.float32(s))}, iterator=it)
      return
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      state = manager.restore(target={"w": tpustrat.Mirrored(jnp.float32(0))}, iterator=it)
    result = {
        "restored_step": manager.last_restored_step,
        "w": float(strategy.experimental_local_results(state["w"])[0]),
        "next_batch": float(strategy.experimental_local_results(next(it))[0][0]),
        "steps": manager.all_steps(),
        "warnings": [str(w.message) for w in caught],
    }
  print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:3])
