"""Saves checkpoint 1, then starts saving checkpoint 2 and stops where a crash hurts most.

Run by tests/test_checkpoint.py as ``python killed_save.py CKPT_DIR REFERENCE.npz``, which kills it
(SIGKILL) once it prints ``WRITTEN``: every array and the iterator state of step 2 are on disk by then,
in orbax's temporary directory, but the save is not committed (the iterator handler's `finalize`, which
runs just before orbax renames the directory, never returns). Step 1's state goes to REFERENCE.npz.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import tpustrat  # noqa: E402
from tpustrat._src import checkpoint as checkpoint_lib  # noqa: E402
from tpustrat._src.checkpoint import handlers  # noqa: E402

_spec = importlib.util.spec_from_file_location("ckpt_common", pathlib.Path(__file__).with_name("ckpt_common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def main(ckpt_dir: str, reference: str) -> None:
  strategy = tpustrat.TPUStrategy()
  graphdef, state = common.init_state()
  train_step = common.make_train_step(graphdef)
  it = iter(strategy.experimental_distribute_dataset(common.dataset()))
  manager = checkpoint_lib.CheckpointManager(ckpt_dir, strategy)
  state, _ = strategy.run(train_step, args=(state, next(it)))
  manager.save(1, state, iterator=it)
  manager.wait_until_finished()
  np.savez(reference, *common.host(state))

  def finalize_forever(self, directory):
    print("WRITTEN", directory, flush=True)
    time.sleep(600)

  handlers.api().IteratorHandler.finalize = finalize_forever
  state, _ = strategy.run(train_step, args=(state, next(it)))
  manager.save(2, state, iterator=it)
  manager.wait_until_finished()
  print("NOT KILLED", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:3])
