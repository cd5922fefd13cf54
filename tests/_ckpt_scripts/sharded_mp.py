"""Restores sharded Adam state saved by one process on 8 devices onto 2 processes x 4 devices, trains, saves.

Run by tests/test_checkpoint_layouts.py as
``python -m tpustrat.launch -n 2 -d 4 tests/_ckpt_scripts/sharded_mp.py CKPT_DIR REFERENCE.npz OUT_DIR``.
Every process restores step 2 onto the FSDP layout (`sharded_common.make_state`) and onto data parallel,
compares both with the reference (the saved values as numpy) bit for bit, checks the shardings, takes two
donating Adam steps on the sharded state and saves step 4. It writes ``OUT_DIR/process_<i>.json`` (and
process 0 ``OUT_DIR/after.npz``, the state it saved, as numpy).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat.checkpoint import CheckpointManager

_spec = importlib.util.spec_from_file_location("sharded_common", pathlib.Path(__file__).with_name("sharded_common.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def same(got: dict, ref: dict) -> bool:
  return sorted(got) == sorted(ref) and all(
      got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape and np.array_equal(got[k], ref[k]) for k in ref)


def placed_like(got, target) -> bool:
  return all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(target)))


def main(ckpt_dir: str, reference: str, out_dir: str) -> None:
  strategy = tpustrat.TPUStrategy()
  assert jax.process_count() == 2 and strategy.num_replicas_in_sync == 8, (jax.process_count(), strategy)
  loaded = np.load(reference)
  ref = {k.replace(".", "/"): loaded[k] for k in loaded.files}
  split = NamedSharding(strategy.mesh, P("replica"))
  with CheckpointManager(ckpt_dir, strategy) as manager:
    target = common.make_state(strategy, common.initial_params(seed=5))
    state = manager.restore(2, target=target)
    params = state["params"]
    placed = placed_like(state, target) and all(params[k].tree.sharding == split for k in ("w", "u"))
    block_shapes = [list(params[k].tree.addressable_shards[0].data.shape) for k in ("w", "u")]
    identical = same(common.to_numpy(state), ref)

    dp_target = common.make_state(strategy, common.initial_params(seed=5), sharded=False)
    dp = manager.restore(2, target=dp_target)  # sharded -> mirrored: read on the host, placed replicated
    mirrored_placed = placed_like(dp, dp_target) and all(
        isinstance(v, tpustrat.Mirrored) for v in dp["params"].values())
    mirrored_identical = same(common.to_numpy(dp), ref)

    arrays = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
    state = common.train(strategy, state, range(2, 4))  # donating steps on the restored sharded state
    donated = all(x.is_deleted() for x in arrays)
    manager.save(4, state)
    manager.wait_until_finished()
  after = common.to_numpy(state)
  out = pathlib.Path(out_dir)
  if jax.process_index() == 0:
    np.savez(out / "after.npz", **{k.replace("/", "."): v for k, v in after.items()})
  (out / f"process_{jax.process_index()}.json").write_text(json.dumps({
      "identical": identical, "placed": placed, "mirrored_identical": mirrored_identical,
      "mirrored_placed": mirrored_placed, "donated": donated, "block_shapes": block_shapes}))


if __name__ == "__main__":
  main(*sys.argv[1:4])
