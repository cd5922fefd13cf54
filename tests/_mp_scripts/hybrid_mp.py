"""Hybrid sharding with one group per process, run by tests/test_hybrid_sharding.py as
``python -m tpustrat.launch -n P -d D tests/_mp_scripts/hybrid_mp.py CKPT_DIR SAVED.npz OUT_DIR`` (2 x 4,
then 4 x 2).

Every process restores step 2 (saved by one process on 8 devices with groups of 4) onto ``groups="process"``
and compares it with SAVED.npz bit for bit; trains 3 Adam steps and compares the parameters with plain JAX
on one device (rtol 1e-5); reads the compiled step's collectives (all-gathers and reduce-scatters within a
process, all-reduces across them). The 2-process job saves step 5 (process 0 writes ``OUT_DIR/after.npz``);
the 4-process job restores that step and compares it with the 2-process job's ``after.npz`` bit for bit.
Writes ``OUT_DIR/process_<i>.json``.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import jax
import numpy as np
import optax

import tpustrat
from tpustrat.checkpoint import CheckpointManager

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _load(name: str, path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


common = _load("hybrid_common", HERE / "hybrid_common.py")
cb = _load("collective_bytes", ROOT / "benchmarks" / "_collective_bytes.py")


def same(got: dict, ref) -> bool:
  return len(got) == len(ref.files) and all(
      np.asarray(v).dtype == ref[str(i)].dtype and np.array_equal(np.asarray(v), ref[str(i)])
      for i, v in enumerate(got.values()))


def close(got: dict, want: dict) -> bool:
  for name, w in want.items():
    g = common.whole(got[name]).astype(np.float64)
    if not np.allclose(g, w, rtol=1e-5, atol=1e-5 * (np.abs(w).max() + 1.0)):
      print(f"{name}: max |diff| {np.abs(g - w).max()}", flush=True)
      return False
  return True


def main(ckpt_dir: str, saved: str, out_dir: str) -> None:
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  strategy = tpustrat.TPUStrategy()
  assert strategy.num_replicas_in_sync == 8, strategy
  groups = tpustrat.sharding_groups(strategy, "process")
  result = {"groups": [list(g) for g in groups]}
  with CheckpointManager(ckpt_dir, strategy) as manager:
    target = common.adam_state(strategy, common.init_params(seed=7), "process")
    state = manager.restore(2, target=target)
    result["restored_identical"] = same(common.as_numpy(state), np.load(saved))
    assert state["params"]["w1"].groups == groups
    data = common.batches(seed=2)
    state = common.train(strategy, state, data)
    want = common.one_device(optax.adam(1e-2), common.init_params(), common.batches()[:2] + data)
    result["one_device_close"] = close(state["params"], want)
    # the compiled step: gathers and reduce-scatters within a process, all-reduces across them
    x, y = common.distribute(strategy, data)[0]
    s = (state["params"], state["opt"])
    step = common.fsdp_step(optax.adam(1e-2))
    hlo = jax.jit(lambda s, x, y: strategy.run(step, args=(s, x, y))).lower(s, x, y).compile().as_text()
    across = tuple(zip(*groups))
    found = cb.collectives(hlo)
    result["within_groups"] = bool(found) and all(
        c.groups == (across if c.op == "all-reduce" else groups) or (c.op == "all-reduce" and c.nbytes <= 4)
        for c in found)
    result["collectives"] = [[c.op, c.nbytes, c.groups] for c in found]
    result["cross_bytes"] = cb.cross_domain_bytes(found, groups)["total"]
    if jax.process_count() == 2:
      manager.save(5, state)
      manager.wait_until_finished()
      values = common.as_numpy(state)
      if jax.process_index() == 0:
        np.savez(out / "after.npz", **{str(i): v for i, v in enumerate(values.values())})
    else:
      after = np.load(out.parent / "2x4" / "after.npz")
      restored = manager.restore(5, target=common.adam_state(strategy, common.init_params(seed=7), "process"))
      result["restored_identical"] = result["restored_identical"] and same(common.as_numpy(restored), after)
  (out / f"process_{jax.process_index()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
  main(*sys.argv[1:4])
