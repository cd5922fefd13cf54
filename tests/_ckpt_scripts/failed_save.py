"""A save that the storage refuses, in a 2-process job: the job must stop at once with the failed-save status.

Run by tests/test_checkpoint.py as
``python -m tpustrat.launch -n 2 -d 2 tests/_ckpt_scripts/failed_save.py CKPT_DIR MODE TIMEOUT [MOUNT]``.

Every process saves checkpoints 1 and 2 of ``w`` (`values(step, mode)`: in the ``full`` mode ``SIZE``
float32 words, over 1 MB once compressed) and waits for each; then the save of checkpoint 3 fails, as MODE
says:

* ``inject``: process 1's write of its iterator position raises ``OSError(ENOSPC)``;
* ``full``: CKPT_DIR is on a small file system (a 3 MiB tmpfs) that two checkpoints fill;
* ``readonly``: process 0 remounts MOUNT (CKPT_DIR's file system) read-only before the save.

TIMEOUT is the manager's `timeout`: the job must end long before it. A process that comes back from the
failed save prints ``NOT STOPPED``.
"""

from __future__ import annotations

import errno
import subprocess
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat._src.checkpoint import handlers
from tpustrat.checkpoint import CheckpointManager

SIZE = 400_000


def values(step: int, mode: str) -> np.ndarray:
  """The saved ``w`` of checkpoint `step` (random: it does not compress; small unless the disk is to fill)."""
  return np.random.default_rng(step).normal(size=(SIZE if mode == "full" else 1000,)).astype(np.float32)


def main(ckpt_dir: str, mode: str, timeout: str, mount: str | None = None) -> None:
  strategy = tpustrat.TPUStrategy()
  index = jax.process_index()
  it = iter(strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(8)]))
  manager = CheckpointManager(ckpt_dir, strategy, timeout=float(timeout))
  replicated = NamedSharding(strategy.mesh, P())
  for step in (1, 2, 3):
    next(it)
    host = values(step, mode)
    state = {"w": tpustrat.Mirrored(jax.make_array_from_callback(host.shape, replicated, lambda i, h=host: h[i]))}
    if step == 3:
      if mode == "inject" and index == 1:
        def refuse(self, directory, args=None):
          raise OSError(errno.ENOSPC, "No space left on device (injected)", str(directory))

        handlers.api().IteratorHandler.save = refuse
      elif mode == "readonly" and index == 0:
        subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
      elif mode not in ("inject", "full", "readonly"):
        raise ValueError(mode)
    manager.save(step, state, iterator=it)
    manager.wait_until_finished()
    print(f"process {index} saved checkpoint {step}", flush=True)
  print(f"process {index}: NOT STOPPED", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:5])
