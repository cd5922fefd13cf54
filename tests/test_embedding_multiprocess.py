"""Embedding tables (ShardedVariables split by rows) through checkpoints between 1 process and 2 x 4.

The test saves a trained state on 4 replicas of this process; a job of 2 processes x 4 devices (this file
run by `tpustrat.launch`, `worker`) restores it onto 8 replicas (re-split on the host, each process
placing its own blocks), checks tables and slots against numpy bit for bit, takes one training step and
saves; this process restores that onto 8 replicas and onto 4, and compares with the same step taken here.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat
from tpustrat import embedding as E
from tpustrat.checkpoint import CheckpointManager

pytestmark = pytest.mark.processes  # every test here starts processes (tests/conftest.py)

ROOT = pathlib.Path(__file__).resolve().parents[1]
V = 37  # 10 rows per replica on 4, 5 on 8: the last blocks hold padding
DIMS = {"adam": 3, "adagrad": 2}
IDS = np.array([0, 5, 5, 36, 12, -1, 36, 20], np.int32)  # one id per example of the global batch of 8


def make_embedding(strategy: tpustrat.Strategy) -> E.TPUEmbedding:
  tables = {name: E.TableConfig(V, dim, combiner="sum", name=name,
                                optimizer=E.Adam(0.1) if name == "adam" else E.Adagrad(0.1))
            for name, dim in DIMS.items()}
  return E.TPUEmbedding({name: E.FeatureConfig(t, name=name) for name, t in tables.items()}, None, strategy)


def train_step(strategy: tpustrat.Strategy, emb: E.TPUEmbedding, state: dict, ids: np.ndarray) -> dict:
  """One step on `ids` (replica r takes its consecutive share), d(loss)/d(activations) = the example's index."""
  b = len(ids) // strategy.num_replicas_in_sync

  def step(state, ids):
    features = {name: ids for name in DIMS}
    act = emb.lookup(state, features)
    r = tpustrat.get_replica_context().replica_id_in_sync_group
    g = (r * b + jnp.arange(b, dtype=jnp.float32))[:, None] + 1.0
    return emb.apply_gradients(state, features, {k: jnp.broadcast_to(g, a.shape) for k, a in act.items()})

  dist = strategy.experimental_distribute_values_from_function(
      lambda ctx: ids[ctx.replica_id_in_sync_group * b:(ctx.replica_id_in_sync_group + 1) * b])
  return strategy.run(step, args=(state, dist))


def as_numpy(state: dict) -> dict[str, np.ndarray]:
  out = {f"tables.{name}": np.asarray(t) for name, t in state["tables"].items()}
  out.update({f"slots.{name}.{slot}": np.asarray(v) for name, slots in state["slots"].items()
              for slot, v in slots.items()})
  return out


def layout(state: dict, n: int) -> bool:
  """Every table and slot a ShardedVariable of (V, D) along axis 0 in [n, ceil(V/n), D] blocks, one per device."""
  values = [*state["tables"].values(), *(v for slots in state["slots"].values() for v in slots.values())]
  return all(isinstance(v, tpustrat.ShardedVariable) and v.shape[0] == V and v.axis == 0
             and v.tree.shape == (n, -(-V // n), v.shape[1])
             and all(s.data.shape == (1, -(-V // n), v.shape[1]) for s in v.tree.addressable_shards)
             for v in values)


def test_tables_saved_on_4_replicas_restore_on_2_processes_x_4_and_back(tmp_path):
  s4 = tpustrat.MirroredStrategy(jax.devices()[:4])
  s8 = tpustrat.TPUStrategy()
  emb4 = make_embedding(s4)
  state = train_step(s4, emb4, emb4.build(seed=1), IDS)
  saved = as_numpy(state)
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  with CheckpointManager(ckpt, s4) as manager:
    manager.save(1, state)
  np.savez(tmp_path / "saved.npz", **saved)

  env = {k: v for k, v in os.environ.items()
         if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--timeout", "200",
             str(pathlib.Path(__file__).resolve()), str(ckpt), str(tmp_path / "saved.npz"), str(out)]
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  for i in range(2):
    assert json.loads((out / f"process_{i}.json").read_text()) == {"identical": True, "layout": True}, i

  emb8 = make_embedding(s8)
  with CheckpointManager(ckpt, s8) as manager:
    assert manager.all_steps() == [1, 2]
    here = train_step(s8, emb8, manager.restore(1, target=emb8.build(seed=9)), IDS)  # the worker's step
  after = dict(np.load(out / "after.npz"))
  expected = as_numpy(here)
  assert sorted(after) == sorted(expected)
  for key in expected:
    np.testing.assert_array_equal(after[key], expected[key], err_msg=key)
  for n, strategy, emb in ((8, s8, emb8), (4, s4, emb4)):
    with CheckpointManager(ckpt, strategy) as manager:
      restored = manager.restore(2, target=emb.build(seed=9))
    assert layout(restored, n)
    got = as_numpy(restored)
    for key in expected:
      np.testing.assert_array_equal(got[key], after[key], err_msg=f"{key} restored on {n} replicas")


def worker(ckpt_dir: str, saved_npz: str, out_dir: str) -> None:
  """In each of the 2 processes x 4 devices: restore step 1 onto 8 replicas, check, train a step, save."""
  strategy = tpustrat.TPUStrategy()
  assert jax.process_count() == 2 and strategy.num_replicas_in_sync == 8, (jax.process_count(), strategy)
  saved = dict(np.load(saved_npz))
  emb = make_embedding(strategy)
  with CheckpointManager(ckpt_dir, strategy) as manager:
    state = manager.restore(1, target=emb.build(seed=9))
    got = as_numpy(state)
    identical = sorted(got) == sorted(saved) and all(np.array_equal(got[k], saved[k]) for k in saved)
    ok = layout(state, 8)
    state = train_step(strategy, emb, state, IDS)
    manager.save(2, state)
    manager.wait_until_finished()
  after = as_numpy(state)
  out = pathlib.Path(out_dir)
  if jax.process_index() == 0:
    np.savez(out / "after.npz", **after)
  (out / f"process_{jax.process_index()}.json").write_text(json.dumps({"identical": identical, "layout": ok}))


if __name__ == "__main__":
  worker(*sys.argv[1:4])
