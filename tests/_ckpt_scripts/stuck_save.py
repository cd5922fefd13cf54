"""A checkpoint operation stuck on process 1 of a 2-process job: the job must stop within the timeout.

Run by tests/test_checkpoint.py as
``python -m tpustrat.launch -n 2 -d 2 [--step-timeout S] tests/_ckpt_scripts/stuck_save.py CKPT_DIR MODE [TIMEOUT]``.

Every process saves checkpoint 1 (state and iterator position) and waits for it; then process 1 gets stuck
in the save of checkpoint 2, as MODE says:

* ``write``: slow storage: writing its iterator item (inside orbax's save) sleeps;
* ``position``: the iterator's ``get_state`` sleeps (before orbax's save starts);
* ``save_fn``: a `PreemptionCheckpointHandler` notice (a watcher function, true on process 0) leads to a
  save through a ``save_fn`` that sleeps on process 1 and saves normally on process 0.

TIMEOUT, if given, is the manager's `timeout`; without it the manager uses the step timeout. A process
that comes back from the stuck save prints ``NOT STOPPED``.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import tpustrat
from tpustrat._src import checkpoint as checkpoint_lib
from tpustrat._src.checkpoint import handlers

SLEEP = 3600.0


def main(ckpt_dir: str, mode: str, timeout: str | None = None) -> None:
  strategy = tpustrat.TPUStrategy()
  index = jax.process_index()
  it = iter(strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(8)]))
  next(it)
  state = {"w": strategy.run(lambda: jnp.arange(4.0))}
  manager = checkpoint_lib.CheckpointManager(ckpt_dir, strategy, timeout=None if timeout is None else float(timeout))
  manager.save(1, state, iterator=it)
  manager.wait_until_finished()
  print(f"process {index} saved checkpoint 1", flush=True)
  next(it)
  start = time.monotonic()

  if mode == "write":
    original = handlers.api().IteratorHandler.save

    def slow_write(self, directory, args=None):
      if index == 1:
        print("process 1 writes slowly", flush=True)
        time.sleep(SLEEP)
      return original(self, directory, args)

    handlers.api().IteratorHandler.save = slow_write
    manager.save(2, state, iterator=it)
    manager.wait_until_finished()
  elif mode == "position":
    class SlowPosition:
      def get_state(self):
        if index == 1:
          print("process 1 takes the position slowly", flush=True)
          time.sleep(SLEEP)
        return it.get_state()

    manager.save(2, state, iterator=SlowPosition())
    manager.wait_until_finished()
  elif mode == "save_fn":
    def save_fn(step, state, iterator):
      if index == 1:
        print("process 1 runs a slow save_fn", flush=True)
        time.sleep(SLEEP)
      manager.save(step, state, iterator=iterator, force=True)

    config = tpustrat.TerminationConfig(termination_watcher_fn=lambda: index == 0, save_fn=save_fn,
                                        exit_fn=lambda: None)
    handler = tpustrat.PreemptionCheckpointHandler(None, manager, termination_config=config)
    handler.restore(state, iterator=it)
    time.sleep(2)  # the watcher function has been called; both processes know of the notice
    for _ in range(5):
      state, = handler.run(lambda s: (strategy.run(lambda w: {"w": w["w"] + 1.0}, args=(s,)),), state)
  else:
    raise ValueError(mode)
  print(f"process {index}: NOT STOPPED after {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:4])
