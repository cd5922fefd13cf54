"""Saves two checkpoints of many arrays, or restores the newest intact one and exits (tests/test_checkpoint.py).

Run as ``python tests/_ckpt_scripts/truncated_chunk.py save CKPT_DIR`` or ``... restore CKPT_DIR [CKPT_DIR ...]``
(one process on 8 devices), or through ``python -m tpustrat.launch -n 2 -d 4``. The test truncates the data
files of step 2 in between.

``save``: checkpoints 1 and 2 of `values` (`LEAVES` arrays: reading one of them fails while the reads of the
others may still be running). ``restore``: restores the newest intact checkpoint of each directory in turn (each
one a new chance for a read to end after the failure) onto `Mirrored` targets and prints ``RESULT`` with, per
directory, the step restored, the arrays (as lists) and the warnings; then the process exits.
"""

from __future__ import annotations

import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat.checkpoint import CheckpointManager

LEAVES = 16


def values(step: int) -> dict[str, np.ndarray]:
  """The arrays of checkpoint `step`."""
  return {f"w{i:02d}": np.arange(64, dtype=np.float32) * (i + 1) + 1000 * step for i in range(LEAVES)}


def global_array(value: np.ndarray, strategy: tpustrat.Strategy) -> jax.Array:
  """`value` replicated over the strategy's mesh (a global array, also in a multi-process job)."""
  return jax.make_array_from_callback(value.shape, NamedSharding(strategy.mesh, P()), lambda index: value[index])


def save(ckpt_dir: str, strategy: tpustrat.Strategy) -> None:
  with CheckpointManager(ckpt_dir, strategy) as manager:
    for step in (1, 2):
      manager.save(step, {k: tpustrat.Mirrored(global_array(v, strategy)) for k, v in values(step).items()})


def restore(ckpt_dir: str, strategy: tpustrat.Strategy) -> dict:
  target = {k: tpustrat.Mirrored(jnp.zeros(v.shape, v.dtype)) for k, v in values(0).items()}
  with CheckpointManager(ckpt_dir, strategy) as manager:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      state = manager.restore(target=target)
    return {
        "restored_step": manager.last_restored_step,
        "values": {k: np.asarray(strategy.experimental_local_results(v)[0]).tolist() for k, v in state.items()},
        "warnings": [str(w.message) for w in caught],
    }


def main(mode: str, *ckpt_dirs: str) -> None:
  strategy = tpustrat.TPUStrategy()
  if mode == "save":
    save(ckpt_dirs[0], strategy)
    return
  print(f"RESULT {json.dumps([restore(d, strategy) for d in ckpt_dirs])}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
