"""Checkpointing (issue 8): the whole training state and the input position survive save and restore.

* The iterator's state counts the batches handed to the training loop, not those the prefetch thread
  or `take_steps` read ahead; restoring it continues with the next batch: the example ids seen across
  save and restore are those of an uninterrupted run, none skipped or repeated.
* A checkpoint saved on 8 replicas restores bit for bit onto 8 replicas (and training then continues
  exactly as without the interruption), onto 4 replicas x 2 logical cores, and onto 2 processes x 4
  devices (through `python -m tpustrat.launch`), with arrays on the new strategy's shardings.
* A save that fails, or a process killed in the middle of one, leaves the last good checkpoint intact:
  orbax writes into a temporary directory and renames it only once the save is complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import launched_results, wait_until_read_ahead
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat._src import checkpoint as checkpoint_lib
from tpustrat._src.checkpoint import checksums, deadlines, handlers
from tpustrat._src.checkpoint import manager as manager_lib
from tpustrat._src.input import encoding
from tpustrat.checkpoint import CheckpointManager

SCRIPTS = pathlib.Path(__file__).resolve().parent / "_ckpt_scripts"
ROOT = pathlib.Path(__file__).resolve().parents[1]
SAVE_AT = 5  # batches trained on before the checkpoint of `saved`

_spec = importlib.util.spec_from_file_location("ckpt_common", SCRIPTS / "ckpt_common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def assert_bitwise(got, want):
  """Same number of leaves, dtypes, shapes and bytes (stricter than ==: -0.0, NaN payloads)."""
  assert len(got) == len(want)
  for a, b in zip(got, want):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def ids_of(strategy, batch):
  return common.batch_ids(strategy, batch)


def stacked_ids(strategy, stacked):
  return [ids_of(strategy, b) for b in tpustrat.unstack_steps(stacked)]


@pytest.fixture(scope="module")
def logical_strategy():
  """4 replicas x 2 logical cores on the same 8 devices."""
  da = tpustrat.DeviceAssignment.build(tpustrat.initialize_tpu_system(), computation_shape=[1, 1, 2], num_replicas=4)
  return tpustrat.TPUStrategy(device_assignment=da)


@pytest.fixture(scope="module")
def reference(strategy):
  """The uninterrupted run on 8 replicas: example ids of every batch, the state after every step."""
  graphdef, state = common.init_state()
  step = common.make_train_step(graphdef)
  ids, states = [], [common.host(state)]
  for batch in strategy.experimental_distribute_dataset(common.dataset()):
    ids.append(ids_of(strategy, batch))
    state, _ = strategy.run(step, args=(state, batch))
    states.append(common.host(state))
  assert len(ids) == common.NUM_BATCHES and sorted(sum(ids, [])) == list(range(common.NUM_EXAMPLES))
  return {"ids": ids, "states": states, "graphdef": graphdef}


@pytest.fixture(scope="module")
def saved(strategy, reference, tmp_path_factory):
  """A checkpoint of step SAVE_AT (state and iterator), saved on 8 replicas with prefetching on."""
  directory = tmp_path_factory.mktemp("ckpt") / "run"
  _, state = common.init_state()
  step = common.make_train_step(reference["graphdef"])
  options = tpustrat.InputOptions(experimental_per_replica_buffer_size=3)
  it = iter(strategy.experimental_distribute_dataset(common.dataset(), options))
  for _ in range(SAVE_AT):
    state, _ = strategy.run(step, args=(state, next(it)))
  with CheckpointManager(directory, strategy) as manager:
    assert manager.save(SAVE_AT, state, iterator=it)
  assert_bitwise(common.host(state), reference["states"][SAVE_AT])
  it.close()
  return directory


# -- the iterator's state -------------------------------------------------------------------------


def _source(kind):
  ds = common.dataset()
  if kind == "grain_iter":
    return ds.to_iter_dataset()
  if kind == "list":
    return list(ds)
  return ds


@pytest.mark.parametrize("kind,options", [
    ("grain_map", tpustrat.InputOptions(experimental_per_replica_buffer_size=3)),
    ("grain_iter", tpustrat.InputOptions()),
    ("list", tpustrat.InputOptions(experimental_per_replica_buffer_size=2)),
    ("grain_map", tpustrat.InputOptions(experimental_fetch_to_device=False)),
])
def test_iterator_resumes_exactly(strategy, reference, kind, options):
  """Mixed next / take_steps with batches read ahead; a new iterator continues with the next batch."""
  dist = strategy.experimental_distribute_dataset(_source(kind), options)
  it = iter(dist)
  seen = [ids_of(strategy, next(it))]
  seen += stacked_ids(strategy, it.take_steps(3))  # the producer now reads ahead in groups of 3
  seen.append(ids_of(strategy, next(it)))  # splits a group read ahead: 2 of its batches stay behind
  state = json.loads(json.dumps(it.get_state()))  # JSON round trip, as in a checkpoint
  assert state["batches"] == 5 and state["elements"] == 5
  if kind != "list":
    assert state["source"] == {"next_index": 5}
  resumed = iter(dist)
  resumed.set_state(state)
  seen += stacked_ids(strategy, resumed.take_steps(2))
  seen += [ids_of(strategy, b) for b in resumed]
  assert seen == reference["ids"]


def test_position_after_a_multi_step_program(strategy, reference):
  """experimental_run_steps takes its batches with take_steps: they count once the program has them."""
  dist = strategy.experimental_distribute_dataset(common.dataset())
  it = iter(dist)

  def step(total, batch):
    return total + tpustrat.get_replica_context().all_reduce("sum", jnp.sum(batch["id"])), 0

  total, _ = strategy.experimental_run_steps(step, it, 4, init=jnp.int32(0))
  assert int(total.values[0]) == sum(sum(ids) for ids in reference["ids"][:4])
  state = it.get_state()
  assert state["batches"] == 4
  resumed = iter(dist)
  resumed.set_state(state)
  assert [ids_of(strategy, b) for b in resumed] == reference["ids"][4:]


def test_state_counts_batches_handed_out_not_prefetched(strategy):
  it = iter(strategy.experimental_distribute_dataset(
      common.dataset(), tpustrat.InputOptions(experimental_per_replica_buffer_size=4)))
  next(it), next(it)
  wait_until_read_ahead(it)  # 4 more batches read ahead
  state = it.get_state()
  assert (state["batches"], state["elements"], state["source"]) == (2, 2, {"next_index": 2})


def test_set_state_moves_a_running_iterator(strategy, reference):
  dist = strategy.experimental_distribute_dataset(common.dataset())
  it = iter(dist)
  next(it)
  state = it.get_state()
  for _ in range(4):
    next(it)
  it.set_state(state)  # back to after batch 1: the prefetched batches are dropped
  assert [ids_of(strategy, b) for b in it] == reference["ids"][1:]
  assert it.get_state()["batches"] == common.NUM_BATCHES
  it.set_state(state)  # an iterator at its end restarts too
  assert ids_of(strategy, next(it)) == reference["ids"][1]


def test_element_spec_does_not_move_the_position(strategy, reference):
  it = iter(strategy.experimental_distribute_dataset(common.dataset()))
  assert isinstance(it.element_spec["id"], tpustrat.PerReplica)  # reads the first batch ahead
  assert it.get_state()["batches"] == 0
  first = next(it)
  assert ids_of(strategy, first) == reference["ids"][0]
  assert it.get_state()["source"] == {"next_index": 1}


def test_end_of_data_with_drop_remainder(strategy, reference):
  dist = strategy.experimental_distribute_dataset(common.dataset(), tpustrat.InputOptions(drop_remainder=True))
  it = iter(dist)
  assert [ids_of(strategy, b) for b in it] == reference["ids"][:-1]  # the partial last batch is dropped
  state = it.get_state()
  assert state["batches"] == common.NUM_BATCHES - 1
  resumed = iter(dist)
  resumed.set_state(state)
  with pytest.raises(StopIteration):
    next(resumed)


def test_per_replica_batches_from_function(strategy):
  import grain

  def dataset_fn(ctx):
    return grain.MapDataset.range(64).map(lambda i: {"id": np.int32(i)}).batch(ctx.get_per_replica_batch_size(16))

  dist = strategy.experimental_distribute_datasets_from_function(dataset_fn)
  it = iter(dist)
  seen = [ids_of(strategy, next(it)) for _ in range(2)]
  state = it.get_state()
  assert (state["batches"], state["elements"]) == (2, 16)  # 8 per-replica batches per step
  resumed = iter(dist)
  resumed.set_state(state)
  seen += [ids_of(strategy, b) for b in resumed]
  assert sum(seen, []) == list(range(64))


def test_one_shot_sources(strategy, reference):
  batches = list(common.dataset())
  it = iter(strategy.experimental_distribute_dataset(b for b in batches))  # a generator
  next(it)
  assert it.get_state()["batches"] == 1
  with pytest.raises(ValueError, match="one-shot generator"):
    it.set_state(it.get_state())
  grain_it = iter(common.dataset())  # one-shot, but it can be repositioned
  it = iter(strategy.experimental_distribute_dataset(grain_it))
  next(it), next(it)
  state = it.get_state()
  next(it)
  it.set_state(state)
  assert ids_of(strategy, next(it)) == reference["ids"][2]


@pytest.mark.parametrize("state,match", [
    ({"next_index": 3}, "expects a state from DistributedIterator.get_state"),
    ("abc", "expects a state"),
    ({"format": "tpustrat.DistributedIterator/1", "batches": -1, "elements": 0}, "ints >= 0"),
])
def test_bad_iterator_state(strategy, state, match):
  it = iter(strategy.experimental_distribute_dataset([np.zeros(8)]))
  with pytest.raises(ValueError, match=match):
    it.set_state(state)


def test_state_past_the_end_of_a_shorter_dataset(strategy):
  it = iter(strategy.experimental_distribute_dataset([np.zeros(8)] * 3))
  with pytest.raises(ValueError, match="ends after 3"):
    it.set_state({"format": "tpustrat.DistributedIterator/1", "batches": 5, "elements": 5, "source": None})


# -- save and restore -----------------------------------------------------------------------------


def test_resume_on_the_same_layout_is_the_uninterrupted_run(strategy, reference, saved, tmp_path):
  """Restore into a differently initialised state, train the rest: every step as without interruption."""
  directory = tmp_path / "run"
  shutil.copytree(saved, directory)
  _, state = common.init_state(seed=1)
  step = common.make_train_step(reference["graphdef"])
  it = iter(strategy.experimental_distribute_dataset(common.dataset()))
  with CheckpointManager(directory, strategy) as manager:
    assert manager.latest_step() == SAVE_AT
    state = manager.restore(target=state, iterator=it)
  assert_bitwise(common.host(state), reference["states"][SAVE_AT])
  for i, batch in enumerate(it, SAVE_AT):
    assert ids_of(strategy, batch) == reference["ids"][i]
    state, _ = strategy.run(step, args=(state, batch))
  assert int(state["step"].values[0]) == common.NUM_BATCHES
  assert_bitwise(common.host(state), reference["states"][-1])


def test_restore_onto_replicas_times_logical_cores(logical_strategy, reference, saved):
  """8 replicas saved, 4 replicas x 2 cores restored: same bits, replicated on the new mesh."""
  _, fresh = common.init_state(seed=1)
  target = jax.tree.map(tpustrat.Mirrored, fresh)  # as `run` returns state: Mirrored leaves
  it = iter(logical_strategy.experimental_distribute_dataset(common.dataset()))
  with CheckpointManager(saved, logical_strategy) as manager:
    state = manager.restore(target=target, iterator=it)
  leaves = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, tpustrat.Mirrored))
  assert leaves and all(isinstance(v, tpustrat.Mirrored) for v in leaves)
  replicated = NamedSharding(logical_strategy.mesh, P())
  assert logical_strategy.mesh.shape == {"replica": 4, "core_0": 2}
  assert all(x.sharding == replicated for x in jax.tree.leaves(state))
  assert_bitwise(common.host(state), reference["states"][SAVE_AT])

  step = common.make_train_step(reference["graphdef"])
  seen = []
  for batch in it:
    seen.append(ids_of(logical_strategy, batch))
    state, _ = logical_strategy.run(step, args=(state, batch))
  assert seen == reference["ids"][SAVE_AT:]
  # Another layout sums gradients in another order: the same training, up to rounding.
  for got, want in zip(common.host(state), reference["states"][-1]):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_restore_with_plain_target_and_without_target(logical_strategy, reference, saved):
  _, fresh = common.init_state(seed=1)
  with CheckpointManager(saved, logical_strategy) as manager:
    state = manager.restore(SAVE_AT, target=fresh)  # plain arrays stay plain, on the strategy's mesh
    tree = manager.restore()
  assert not any(isinstance(v, tpustrat.DistributedValues)
                 for v in jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues)))
  assert all(x.sharding == NamedSharding(logical_strategy.mesh, P()) for x in jax.tree.leaves(state))
  assert_bitwise(common.host(state), reference["states"][SAVE_AT])
  assert set(tree) == {"params", "opt_state", "step"} and int(tree["step"]) == SAVE_AT
  np.testing.assert_array_equal(tree["params"]["head"]["kernel"]["value"],
                                np.asarray(state["params"]["head"]["kernel"][...]))


@pytest.mark.processes
def test_restore_onto_two_processes(strategy, reference, saved, tmp_path):
  """8 devices in 1 process saved; 2 processes x 4 devices restore, train a step and save; 1 restores."""
  try:
    import tpustrat.launch  # noqa: F401
  except ImportError:
    pytest.skip("tpustrat.launch is not available")
  directory, out = tmp_path / "run", tmp_path / "out"
  shutil.copytree(saved, directory)
  out.mkdir()
  np.savez(tmp_path / "reference.npz", *reference["states"][SAVE_AT])
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  command = [sys.executable, "-m", "tpustrat.launch", "--num-processes", "2", "--devices-per-process", "4",
             "--timeout", "240", str(SCRIPTS / "restore_mp.py"), str(directory), str(tmp_path / "reference.npz"),
             str(out)]
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  results = [json.loads((out / f"process_{i}.json").read_text()) for i in range(2)]
  for r in results:
    assert r["restored_step"] == SAVE_AT
    assert r["identical"], "parameters differ after restoring on 2 processes"
    assert r["placed"], "restored arrays are not replicated over the 2-process mesh"
    assert r["first"] == reference["ids"][SAVE_AT]
    assert r["rest"] == reference["ids"][SAVE_AT + 1:]
  assert results[0]["loss"] == results[1]["loss"]

  # Back to one process: the checkpoint the 2 processes saved (each process wrote its iterator state).
  assert sorted(p.name for p in (directory / str(SAVE_AT + 1) / "iterator").glob("*.json")) == [
      "process_0-of-2.json", "process_1-of-2.json"]
  after = np.load(out / "after.npz")
  _, fresh = common.init_state(seed=2)
  it = iter(strategy.experimental_distribute_dataset(common.dataset()))
  with CheckpointManager(directory, strategy) as manager:
    assert manager.all_steps() == [SAVE_AT, SAVE_AT + 1]
    state = manager.restore(target=fresh, iterator=it)
  assert_bitwise(common.host(state), [after[f"arr_{i}"] for i in range(len(after.files))])
  assert [ids_of(strategy, b) for b in it] == reference["ids"][SAVE_AT + 1:]


def test_per_replica_state(strategy, logical_strategy, tmp_path):
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.full(3, ctx.replica_id_in_sync_group, np.float32))
  state = {"per_replica": values, "mirrored": tpustrat.Mirrored(jnp.arange(4.0))}
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(0, state)
    restored = manager.restore(target=state)
    assert isinstance(restored["per_replica"], tpustrat.PerReplica)
    assert restored["per_replica"].tree.sharding == NamedSharding(strategy.mesh, P("replica"))
    assert [float(v[0]) for v in restored["per_replica"].values] == list(range(8))
  with CheckpointManager(tmp_path, logical_strategy) as manager:
    target = {"per_replica": logical_strategy.experimental_distribute_values_from_function(
        lambda ctx: np.zeros(3, np.float32)), "mirrored": tpustrat.Mirrored(jnp.zeros(4))}
    with pytest.raises(ValueError, match=r"shape \(8, 3\), but `target` expects \(4, 3\)\. A PerReplica"):
      manager.restore(target=target)


def test_python_numbers_round_trip(strategy, tmp_path):
  state = {"w": tpustrat.Mirrored(jnp.ones(2)), "epoch": 3, "lr": 0.5}
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(3, state)
    restored = manager.restore(target={"w": tpustrat.Mirrored(jnp.zeros(2)), "epoch": 0, "lr": 0.0})
  assert (restored["epoch"], restored["lr"]) == (3, 0.5)
  assert type(restored["epoch"]) is int


def test_iterator_states_of_several_processes(strategy, tmp_path):
  """Another process count restores only if every process saved the same position (global batches)."""
  dist = strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(4)])
  it = iter(dist)
  next(it)
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(1, {"w": jnp.zeros(2)}, iterator=it)
  folder = tmp_path / "1" / "iterator"
  (folder / "process_0-of-1.json").rename(folder / "process_0-of-2.json")  # as if 2 processes saved
  shutil.copy(folder / "process_0-of-2.json", folder / "process_1-of-2.json")
  with CheckpointManager(tmp_path, strategy) as manager:
    resumed = iter(dist)
    manager.restore(target={"w": jnp.zeros(2)}, iterator=resumed)
    assert float(strategy.experimental_local_results(next(resumed))[0][0]) == 1.0
    other = json.loads((folder / "process_1-of-2.json").read_text())
    other["elements"] = other["batches"] = 2  # per-process input pipelines: positions differ
    (folder / "process_1-of-2.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="different iterator state for each of its 2 processes"):
      manager.restore(target={"w": jnp.zeros(2)}, iterator=iter(dist))


def test_max_to_keep_and_interval(strategy, tmp_path):
  with CheckpointManager(tmp_path, strategy, max_to_keep=2, save_interval_steps=2) as manager:
    saved = [manager.save(s, {"w": jnp.full(2, s)}) for s in range(6)]
    manager.wait_until_finished()
    assert saved == [True, False, True, False, True, False]
    assert manager.all_steps() == [2, 4]
    assert manager.save(5, {"w": jnp.full(2, 5)}, force=True)
    assert int(manager.restore()["w"][0]) == 5
  assert sorted(p.name for p in tmp_path.iterdir()) == ["4", "5"]


def test_errors(strategy, tmp_path):
  with CheckpointManager(tmp_path / "empty", strategy) as manager:
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
      manager.restore()
    manager.save(1, {"w": jnp.zeros(2)})
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 2 .* \(steps: \[1\]\)"):
      manager.restore(2)
    with pytest.raises(ValueError, match="has no iterator state"):
      manager.restore(target={"w": jnp.zeros(2)}, iterator=iter(strategy.experimental_distribute_dataset([])))
    with pytest.raises(ValueError, match=r"'w' of step 1 .* has shape \(2,\), but `target` expects \(3,\)"):
      manager.restore(target={"w": jnp.zeros(3)})
    batch = next(iter(strategy.experimental_distribute_dataset([np.zeros(12)])))
    with pytest.raises(ValueError, match="padded batch"):
      manager.save(2, {"batch": batch})
    with pytest.raises(TypeError, match="must have get_state"):
      manager.save(3, {"w": jnp.zeros(2)}, iterator=[1, 2])
  with pytest.raises(ValueError, match="either `options` or"):
    CheckpointManager(tmp_path, options=handlers.api().ocp.CheckpointManagerOptions(), max_to_keep=1)


# -- interrupted saves ----------------------------------------------------------------------------


def _tmp_dirs(directory, step):
  return [p for p in directory.iterdir() if p.name.startswith(f"{step}.orbax-checkpoint-tmp")]


@pytest.mark.parametrize("enable_async", [True, False])
def test_failed_save_keeps_the_last_good_checkpoint(strategy, tmp_path, monkeypatch, enable_async):
  good = {"w": jnp.arange(4.0), "step": jnp.int32(1)}
  dist = strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(4)])
  it = iter(dist)
  next(it)
  manager = CheckpointManager(tmp_path, strategy, enable_async_checkpointing=enable_async)
  manager.save(1, good, iterator=it)
  manager.wait_until_finished()
  handler = handlers.api().IteratorHandler
  original = handler.save

  def save_then_fail(self, directory, args=None):
    original(self, directory, args)  # the iterator state is on disk (in the temporary directory)...
    raise OSError(28, "No space left on device")  # ...and then the save fails

  monkeypatch.setattr(handler, "save", save_then_fail)
  next(it)
  start = time.monotonic()
  with pytest.raises(checkpoint_lib.CheckpointSaveError,
                     match=rf"could not write checkpoint 2 at {tmp_path / '2'} \(OSError: \[Errno 28\] No space "
                           r"left on device\)\. The previous checkpoints are intact \(steps \[1\]\)") as raised:
    manager.save(2, {"w": jnp.arange(4.0) + 100, "step": jnp.int32(2)}, iterator=it)
    manager.wait_until_finished()
  assert time.monotonic() - start < 10  # at once, not after the deadline
  assert isinstance(raised.value.__cause__, OSError)
  monkeypatch.undo()
  manager.close()
  assert not (tmp_path / "2").exists()
  assert _tmp_dirs(tmp_path, 2), sorted(p.name for p in tmp_path.iterdir())  # what was written stays aside

  with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning,
                    match=rf"removed the unfinished save of step 2 at {tmp_path / '2'}.orbax-checkpoint-tmp"):
    fresh = CheckpointManager(tmp_path, strategy)
  with fresh:
    assert not _tmp_dirs(tmp_path, 2)  # the leftover is gone at the next start
    assert fresh.all_steps() == [1]
    resumed = iter(dist)
    state = fresh.restore(target={"w": jnp.zeros(4), "step": jnp.int32(0)}, iterator=resumed)
    assert_bitwise([state["w"], state["step"]], [good["w"], good["step"]])
    assert float(strategy.experimental_local_results(next(resumed))[0][0]) == 1.0
    assert fresh.save(2, {"w": jnp.arange(4.0) + 100, "step": jnp.int32(2)})  # the step can be saved again
    fresh.wait_until_finished()
    assert fresh.all_steps() == [1, 2]


def _gloo_reset():  # what a device collective of orbax's barrier raises when the peer's socket closes
  return jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
                                    "Read error [127.0.0.1]:59827: Connection reset by peer")


def _barrier_timeout():  # orbax's commit thread, when the coordination service's barrier fails
  try:
    raise jax.errors.JaxRuntimeError("INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 "
                                     "heartbeat timeout. Barrier Id: _async_write_complete.2::0, Task: 1")
  except jax.errors.JaxRuntimeError as e:
    try:
      raise TimeoutError("Timed out while waiting for async_write_complete barrier.") from e
    except TimeoutError as timeout:
      return timeout


def _eio_after_a_runtime_error():  # the storage's error, raised while a runtime error was being handled
  try:
    raise _gloo_reset()
  except jax.errors.JaxRuntimeError:
    try:
      raise OSError(5, "Input/output error")
    except OSError as e:
      return e


def _enospc_then_a_runtime_error():  # a barrier failing while the storage's error was being handled
  try:
    raise OSError(28, "No space left on device")
  except OSError:
    try:
      raise _gloo_reset()
    except jax.errors.JaxRuntimeError as e:
      return e


def test_a_failed_save_is_the_peers_only_when_jax_runtime_raised_it_and_no_storage_error():
  """`_peer_failure`: JAX's runtime error behind the failure (a barrier or collective across the processes,
  raised directly or under orbax's TimeoutError), or None for the storage's errors (an OSError with an errno
  anywhere in the chain, tensorstore's ValueError) and for anything else."""
  gloo, timeout = _gloo_reset(), _barrier_timeout()
  assert manager_lib._peer_failure(gloo) is gloo
  assert manager_lib._peer_failure(timeout) is timeout.__cause__
  for storage in (OSError(28, "No space left on device"), OSError(30, "Read-only file system"),
                  OSError(5, "Input/output error"), _eio_after_a_runtime_error(), _enospc_then_a_runtime_error(),
                  ValueError("RESOURCE_EXHAUSTED: Error writing local file \"x/0\": No space left on device "
                             "[os_error_code='28']"),  # tensorstore's
                  TimeoutError("Timed out while waiting for async_write_complete barrier."),  # no runtime error
                  RuntimeError("something else")):
    assert manager_lib._peer_failure(storage) is None, repr(storage)


@pytest.mark.parametrize("make_error, status", [
    (_gloo_reset, 69),
    (lambda: OSError(28, "No space left on device"), 74),
    (lambda: ValueError("RESOURCE_EXHAUSTED: Error writing local file \"x/0\": No space left on device "
                        "[os_error_code='28']"), 74),  # tensorstore's
])
def test_a_save_that_fails_in_a_barrier_is_told_from_one_the_storage_refuses(strategy, tmp_path, monkeypatch,
                                                                             make_error, status):
  """Issue 43 item 10: a multi-process save that fails in JAX's distributed runtime (a barrier or collective
  across the processes: a peer died in the save) ends every process with 69 and says so, with the committed
  steps read from the storage; a write the storage refuses keeps 74 and its message."""
  ended = []
  monkeypatch.setattr(deadlines, "_exit_process", lambda message, code: ended.append((message, code)))
  good = {"w": jnp.arange(4.0), "step": jnp.int32(1)}
  it = iter(strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(4)]))
  next(it)
  manager = CheckpointManager(tmp_path, strategy, enable_async_checkpointing=False)
  manager.save(1, good, iterator=it)
  error = make_error()

  def fail(self, directory, args=None):
    raise error

  monkeypatch.setattr(handlers.api().IteratorHandler, "save", fail)
  monkeypatch.setattr(manager._store, "count", 2)  # the job's other process is the one that stopped
  with pytest.raises(checkpoint_lib.CheckpointSaveError) as raised:
    manager.save(2, {"w": jnp.arange(4.0) + 100, "step": jnp.int32(2)}, iterator=it)
  monkeypatch.undo()
  manager.close()
  committed = sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit())
  assert committed == [1] and _tmp_dirs(tmp_path, 2)
  assert [code for _, code in ended] == [status], ended
  message = ended[0][0]
  assert message.endswith(f"\nEvery process of the job stops with status {status}.")
  assert str(raised.value) == "CheckpointManager.save: " + message.split("\n")[0].removeprefix(
      "tpustrat: checkpoint save failed: ")
  if status == 69:
    assert message.startswith("tpustrat: checkpoint save failed: another process of the job stopped in the middle "
                              f"of the save of step 2 to {tmp_path}: a barrier or collective of the save across the "
                              "processes failed in JAX's distributed runtime on process 0 (")
    assert f"(JaxRuntimeError: {error}). The peer died, hung or lost its connection" in message
    assert "No write of process 0 failed: the storage is not the cause." in message
    assert (f"Step 2 was not committed (what was written of it stays in {_tmp_dirs(tmp_path, 2)[0]}, which the next "
            f"start removes); the last committed step is {committed[-1]} (committed steps: {committed}), intact."
            in message)
  else:
    assert message.startswith(f"tpustrat: checkpoint save failed: process 0 could not write checkpoint 2 at "
                              f"{tmp_path / '2'} ({type(error).__name__}: {error}). The previous checkpoints are "
                              f"intact (steps {committed})")
    assert "another process" not in message


def _tmpfs(directory: pathlib.Path, size: str) -> None:
  """Mounts a tmpfs of `size` on `directory`, or skips the test where mounting is not permitted."""
  directory.mkdir()
  try:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                          capture_output=True, text=True, timeout=30)
  except FileNotFoundError:
    pytest.skip("no mount command on this machine")
  if done.returncode != 0:
    pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")


@pytest.mark.parametrize("mode", ["inject", "full", "readonly"])
@pytest.mark.processes
def test_a_save_the_storage_refuses_stops_the_job_at_once_as_a_failed_save(strategy, tmp_path, mode):
  """Process 1's write fails (an injected OSError), or the disk is full, or read-only: every process stops
  with status 74 within seconds (not the timeout), naming the step, path and OS error; steps 1 and 2 stay
  intact and restore to the saved values."""
  spec = importlib.util.spec_from_file_location("failed_save", SCRIPTS / "failed_save.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  mount = tmp_path / "disk"
  if mode == "inject":
    mount.mkdir()
  else:
    _tmpfs(mount, "3m")
  ckpt = mount / "ckpt"
  timeout = 40
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "2", str(SCRIPTS / "failed_save.py"),
             str(ckpt), mode, str(timeout), str(mount)]
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_")}
  try:
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode == 74, done.stderr[-3000:]
    assert "NOT STOPPED" not in done.stdout
    for p in (0, 1):
      assert f"process {p} saved checkpoint 2" in done.stdout and f"process {p} saved checkpoint 3" not in done.stdout
    oserror = {"inject": "No space left on device (injected)", "full": "No space left on device",
               "readonly": "Read-only file system"}[mode]
    assert re.search(rf"tpustrat: checkpoint save failed: process \d could not write checkpoint 3 at "
                     rf"{re.escape(str(ckpt / '3'))} \(.*{re.escape(oserror)}", done.stderr), done.stderr[-3000:]
    assert "failed to save a checkpoint" in done.stderr  # the launcher's report of status 74
    assert "checkpoint timeout" not in done.stderr and "stuck" not in done.stderr
    assert elapsed < timeout, f"{elapsed:.1f} s"  # ended at once, not by the deadline
    if mode == "readonly":
      subprocess.run(["mount", "-o", "remount,rw", str(mount)], check=True)
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["1", "2"]
    target = {"w": tpustrat.Mirrored(jnp.zeros(script.values(1, mode).shape, jnp.float32))}
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", tpustrat.checkpoint.DamagedCheckpointWarning)  # the leftover of step 3
      with CheckpointManager(ckpt, strategy) as manager:
        for step in (1, 2):
          got = manager.restore(step, target=target)
          np.testing.assert_array_equal(np.asarray(got["w"].tree), script.values(step, mode))
  finally:
    if mode != "inject":
      subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


# Run by the test below as ``python -m tpustrat.launch -n 2 -d 4 job.py CKPT_DIR``: saves checkpoint 1 of
# ``w`` and waits for it; in the save of checkpoint 2, process 1 is SIGKILLed as it writes its iterator
# position (inside orbax's save, before the barrier that follows the writes).
_PEER_KILLED_IN_A_SAVE = """\
import os, signal, sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import tpustrat
from tpustrat._src.checkpoint import handlers
from tpustrat.checkpoint import CheckpointManager

strategy = tpustrat.TPUStrategy()
index = jax.process_index()
it = iter(strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(8)]))
manager = CheckpointManager(sys.argv[1], strategy, timeout=60)
for step in (1, 2):
  next(it)
  host = np.random.default_rng(step).normal(size=(1000,)).astype(np.float32)
  replicated = NamedSharding(strategy.mesh, P())
  state = {"w": tpustrat.Mirrored(jax.make_array_from_callback(host.shape, replicated, lambda i, h=host: h[i]))}
  if step == 2 and index == 1:
    handlers.api().IteratorHandler.save = lambda self, directory, args=None: os.kill(os.getpid(), signal.SIGKILL)
  manager.save(step, state, iterator=it)
  manager.wait_until_finished()
  print(f"process {index} saved checkpoint {step}", flush=True)
print(f"process {index}: NOT STOPPED", flush=True)
"""


@pytest.mark.processes
def test_a_peer_killed_in_a_save_is_not_reported_as_a_storage_error(strategy, tmp_path):
  """Issue 43 item 10, 2 processes x 4 devices: process 1 is SIGKILLed in the middle of a save. Process 0's
  barrier fails in JAX's runtime: it stops with 69, says a peer stopped in the save (not that the storage
  refused a write) and that step 2 was not committed, the last committed being 1; the launcher names
  process 1 and says of process 0 that the storage refused nothing. Step 1 restores bit for bit."""
  script = tmp_path / "job.py"
  script.write_text(_PEER_KILLED_IN_A_SAVE)
  ckpt = tmp_path / "ckpt"
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_")}
  done = subprocess.run([sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--timeout", "120",
                         str(script), str(ckpt)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
  err = done.stderr
  assert done.returncode == 128 + signal.SIGKILL, err[-3000:]  # process 1's
  assert "process 0 saved checkpoint 1" in done.stdout and "process 1 saved checkpoint 1" in done.stdout
  assert "saved checkpoint 2" not in done.stdout and "NOT STOPPED" not in done.stdout
  assert f"[proc 0] tpustrat: checkpoint save failed: another process of the job stopped in the middle of the save " \
         f"of step 2 to {ckpt}: a barrier or collective of the save across the processes failed in JAX's " \
         "distributed runtime on process 0 (" in err, err[-3000:]
  assert "No write of process 0 failed: the storage is not the cause. Step 2 was not committed (what was " \
         f"written of it stays in {ckpt / '2'}.orbax-checkpoint-tmp, which the next start removes); the last " \
         "committed step is 1 (committed steps: [1]), intact." in err, err[-3000:]
  assert "[proc 0] Every process of the job stops with status 69." in err
  assert "tpustrat.launch: process 1 failed first: it was killed by SIGKILL" in err, err[-3000:]
  assert ("process 0 stopped on its own: it exited with status 69 (it failed to save a checkpoint because another "
          "process stopped in the middle of the save") in err, err[-3000:]
  assert "storage refused a write" not in err and "could not write checkpoint" not in err
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["1"]
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", tpustrat.checkpoint.DamagedCheckpointWarning)  # the leftover of step 2
    with CheckpointManager(ckpt, strategy) as manager:
      got = manager.restore(target={"w": tpustrat.Mirrored(jnp.zeros(1000, jnp.float32))})
  want = np.random.default_rng(1).normal(size=(1000,)).astype(np.float32)
  assert np.asarray(got["w"].tree).tobytes() == want.tobytes()


@pytest.mark.processes
def test_killed_save_keeps_the_last_good_checkpoint(strategy, reference, tmp_path):
  """SIGKILL after every file of step 2 is written, before orbax commits it: step 1 is the latest."""
  directory = tmp_path / "run"
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  proc = subprocess.Popen([sys.executable, str(SCRIPTS / "killed_save.py"), str(directory),
                           str(tmp_path / "reference.npz")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  lines = []
  watchdog = threading.Timer(120, os.killpg, (proc.pid, signal.SIGKILL))  # never hang the suite
  watchdog.start()
  try:
    for line in proc.stdout:
      lines.append(line)
      if line.startswith("WRITTEN"):
        break
  finally:
    watchdog.cancel()
    os.killpg(proc.pid, signal.SIGKILL)  # the crash, in the middle of saving step 2
    proc.wait()
    proc.stdout.close()
  assert any(line.startswith("WRITTEN") for line in lines), "".join(lines[-40:])
  tmp = _tmp_dirs(directory, 2)
  assert len(tmp) == 1 and not (directory / "2").exists()
  written = {p.relative_to(tmp[0]).parts[0] for p in tmp[0].rglob("*") if p.is_file()}
  assert {"state", "iterator"} <= {name.split(".orbax-checkpoint-tmp")[0] for name in written}, written

  ref = np.load(tmp_path / "reference.npz")
  assert_bitwise([ref[f"arr_{i}"] for i in range(len(ref.files))], reference["states"][1])
  _, fresh = common.init_state(seed=1)
  it = iter(strategy.experimental_distribute_dataset(common.dataset()))
  with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning,
                    match=rf"removed the unfinished save of step 2 at {tmp[0]} \(a process stopped while saving it"):
    manager = CheckpointManager(directory, strategy)
  with manager:
    assert not _tmp_dirs(directory, 2)  # removed by the next start (process 0)
    assert manager.latest_step() == 1
    state = manager.restore(target=fresh, iterator=it)
  assert_bitwise(common.host(state), reference["states"][1])
  assert ids_of(strategy, next(it)) == reference["ids"][1]


def test_bytes_states_share_one_base64_encoding():
  raw = bytes(range(256))
  text = encoding.bytes_to_text(raw)
  assert encoding.text_to_bytes(text) == raw

  class BytesIterator:
    state = raw

    def get_state(self):
      return self.state

    def set_state(self, s):
      self.state = s

  saved = manager_lib._iterator_state(BytesIterator())
  assert saved == {"bytes_base64": text}  # the on-disk format is unchanged
  target = BytesIterator()
  target.state = None
  manager_lib._set_iterator_state(target, saved)
  assert target.state == raw


# -- damaged checkpoints --------------------------------------------------------------------------


def _reference_sums(x: np.ndarray) -> list[int]:
  """The two checksums of an array, computed here with numpy from the definition (the words of the
  array in row-major order, each times an odd weight of its position, summed modulo 2**32)."""
  x = np.asarray(x)
  if x.dtype == np.bool_:
    words = x.astype(np.uint64)
  elif x.dtype.itemsize == 4:
    words = x.view(np.uint32).astype(np.uint64)
  else:
    words = x.view({2: np.uint16, 1: np.uint8}[x.dtype.itemsize]).astype(np.uint64)
  words = words.reshape(-1)
  index = np.arange(words.size, dtype=np.uint64)
  rotated = ((words << 16) | (words >> 16)) & 0xFFFFFFFF
  sums = []
  for w, multiplier, offset in ((words, 0x9E3779B1, 0x7F4A7C15), (rotated, 0x85EBCA77, 0x165667B1)):
    weights = (((index + offset) * multiplier) & 0xFFFFFFFF) | 1
    sums.append(int(np.sum((w * weights) & 0xFFFFFFFF) % 2**32))
  return sums


def test_checksums_follow_the_definition_on_every_layout(strategy, logical_strategy):
  rng = np.random.default_rng(1)
  arrays = {
      "f32": rng.normal(size=(8, 5)).astype(np.float32),
      "bf16": rng.normal(size=(16,)).astype(jnp.bfloat16),
      "i8": rng.integers(-100, 100, size=(8, 3)).astype(np.int8),
      "bool": rng.integers(0, 2, size=(7,)).astype(bool),
      "scalar": np.float32(2.5),
  }
  want = {name: _reference_sums(x) for name, x in arrays.items()}
  split = jax.device_put(arrays["f32"], NamedSharding(strategy.mesh, P("replica")))
  replicated = jax.device_put(arrays["f32"], NamedSharding(logical_strategy.mesh, P()))
  on_devices = {name: jnp.asarray(x) for name, x in arrays.items()}
  for layout in (arrays, on_devices, {"f32": split}, {"f32": replicated}):
    got = checksums.compute(layout)
    assert {name: entry["sums"] for name, entry in got.items()} == {name: want[name] for name in layout}
  changed = arrays["f32"].copy()
  changed.view(np.uint32)[3, 2] ^= 1 << 7  # one bit of one word
  assert all(a != b for a, b in zip(_reference_sums(changed), want["f32"]))
  got = checksums.compute({"f32": changed})["f32"]["sums"]
  assert got == _reference_sums(changed)


def _flip(path: pathlib.Path, offset: int) -> bytes:
  """Flips the 4 bytes of `path` at `offset`; returns the original content."""
  original = path.read_bytes()
  data = bytearray(original)
  data[offset:offset + 4] = bytes(b ^ 0xFF for b in data[offset:offset + 4])
  path.write_bytes(bytes(data))
  return original


def _saved_twice(strategy, directory, values):
  """Checkpoints 1 and 2 of ``{"w": values[i]}`` with the iterator's position (1 and 2 batches taken)."""
  dist = strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(6)])
  it = iter(dist)
  with CheckpointManager(directory, strategy) as manager:
    for step in (1, 2):
      next(it)
      manager.save(step, {"w": tpustrat.Mirrored(jax.device_put(values[step - 1],
                                                                NamedSharding(strategy.mesh, P())))}, iterator=it)
  return dist


def test_flipped_bytes_in_a_data_chunk_are_found_and_the_previous_step_restored(strategy, tmp_path):
  rng = np.random.default_rng(2)
  values = [rng.normal(size=(65536,)).astype(np.float32) for _ in range(2)]
  dist = _saved_twice(strategy, tmp_path, values)
  target = {"w": tpustrat.Mirrored(jnp.zeros(65536, jnp.float32))}
  # The largest file of step 2 holds the array's compressed chunk. Find 4 bytes whose flip orbax itself
  # reads back without an error, as wrong numbers: the silent case.
  chunk = max((p for p in (tmp_path / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  orbax = handlers.api()
  raw = CheckpointManager(tmp_path, strategy)
  abstract = {"w": jax.ShapeDtypeStruct((65536,), jnp.float32, sharding=NamedSharding(strategy.mesh, P()))}
  for offset in range(chunk.stat().st_size // 2, chunk.stat().st_size - 4, 101):
    original = _flip(chunk, offset)
    try:
      read = raw.orbax_manager.restore(2, args=orbax.ocp.args.Composite(state=orbax.StateRestore(abstract)))
    except Exception:  # noqa: BLE001  # this flip breaks the encoding: orbax notices; try another
      chunk.write_bytes(original)
      continue
    if not np.array_equal(np.asarray(read["state"]["w"]), values[1]):
      break
    chunk.write_bytes(original)
  else:
    pytest.fail("no flip of 4 bytes of the chunk reads back silently")
  raw.close()

  step_dir = str(tmp_path / "2")
  with CheckpointManager(tmp_path, strategy) as manager:
    with pytest.raises(tpustrat.checkpoint.DamagedCheckpointError,
                       match=rf"checkpoint 2 at {step_dir} is damaged: the content of 'w' \(float32\[65536\]"):
      manager.restore(2, target=target)
    it = iter(dist)
    with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning,
                      match=rf"checkpoint 2 at {step_dir} is damaged: .*'w'.* Restored checkpoint 1 instead; the "
                            rf"damaged step was moved aside to {step_dir}.damaged\.$"):
      state = manager.restore(target=target, iterator=it)
    assert manager.last_restored_step == 1
    assert_bitwise([strategy.experimental_local_results(state["w"])[0]], [values[0]])
    assert float(strategy.experimental_local_results(next(it))[0][0]) == 1.0  # the batch after step 1's
    assert manager.all_steps() == [1] and (tmp_path / "2.damaged").is_dir() and not (tmp_path / "2").exists()
    assert manager.save(2, state)  # the step can be saved again
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]


def test_an_empty_step_directory_is_named_with_its_path(strategy, tmp_path):
  values = [np.arange(4, dtype=np.float32) + i for i in range(2)]
  _saved_twice(strategy, tmp_path, values)
  (tmp_path / "3").mkdir()  # a step directory whose files are gone
  target = {"w": tpustrat.Mirrored(jnp.zeros(4, jnp.float32))}
  with CheckpointManager(tmp_path, strategy) as manager:
    assert manager.all_steps() == [1, 2, 3]
    with pytest.raises(tpustrat.checkpoint.DamagedCheckpointError,
                       match=rf"checkpoint 3 at {tmp_path / '3'} is damaged: it has no 'state' item \(the directory "
                             r"is empty\)"):
      manager.restore(3, target=target)
    with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning, match=rf"checkpoint 3 at {tmp_path / '3'}"):
      state = manager.restore(target=target)
    assert manager.last_restored_step == 2
    assert_bitwise([strategy.experimental_local_results(state["w"])[0]], [values[1]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3.damaged"]


def test_a_step_whose_iterator_item_was_deleted_is_damaged_and_the_previous_one_restored(strategy, tmp_path):
  """Its metadata lists an iterator item: a missing ``iterator/`` is damage, not a step saved without one."""
  values = [np.arange(4, dtype=np.float32) + i for i in range(2)]
  dist = _saved_twice(strategy, tmp_path, values)
  shutil.rmtree(tmp_path / "2" / "iterator")
  target = {"w": tpustrat.Mirrored(jnp.zeros(4, jnp.float32))}
  with CheckpointManager(tmp_path, strategy) as manager:
    with pytest.raises(tpustrat.checkpoint.DamagedCheckpointError,
                       match=rf"checkpoint 2 at {tmp_path / '2'} is damaged: its 'iterator' item is missing \(it was "
                             r"saved with one\)"):
      manager.restore(2, target=target, iterator=iter(dist))
    it = iter(dist)
    with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning, match=rf"checkpoint 2 at {tmp_path / '2'} is "
                                                                          r"damaged: its 'iterator' item is missing"):
      state = manager.restore(target=target, iterator=it)
    assert manager.last_restored_step == 1
    assert_bitwise([strategy.experimental_local_results(state["w"])[0]], [values[0]])
    assert float(strategy.experimental_local_results(next(it))[0][0]) == 1.0  # the batch after step 1's


@pytest.mark.parametrize("swap", [False, True])
def test_a_step_whose_checksums_were_deleted_is_damaged_and_the_previous_one_restored(strategy, tmp_path, swap):
  """Its metadata lists checksums: without them the step cannot be verified, so it is damaged; with its
  ``state/`` swapped for step 1's as well, restoring it would give step 1's values with step 2's position."""
  values = [np.arange(4, dtype=np.float32) + i for i in range(2)]
  dist = _saved_twice(strategy, tmp_path, values)
  shutil.rmtree(tmp_path / "2" / "checksums")
  if swap:
    shutil.rmtree(tmp_path / "2" / "state")
    shutil.copytree(tmp_path / "1" / "state", tmp_path / "2" / "state")
  target = {"w": tpustrat.Mirrored(jnp.zeros(4, jnp.float32))}
  with CheckpointManager(tmp_path, strategy) as manager:
    with pytest.raises(tpustrat.checkpoint.DamagedCheckpointError,
                       match=rf"checkpoint 2 at {tmp_path / '2'} is damaged: its 'checksums' item is missing \(it "
                             r"was saved with one\)"):
      manager.restore(2, target=target)
    it = iter(dist)
    with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning, match="its 'checksums' item is missing"):
      state = manager.restore(target=target, iterator=it)
    assert manager.last_restored_step == 1
    assert_bitwise([strategy.experimental_local_results(state["w"])[0]], [values[0]])
    assert float(strategy.experimental_local_results(next(it))[0][0]) == 1.0


@pytest.mark.parametrize("item,file", [("iterator", "process_0-of-1.json"), ("checksums", "checksums.json")])
def test_a_json_file_that_does_not_decode_is_named_with_its_path(strategy, tmp_path, item, file):
  values = [np.arange(4, dtype=np.float32) + i for i in range(2)]
  dist = _saved_twice(strategy, tmp_path, values)
  path = tmp_path / "2" / item / file
  path.write_text(path.read_text()[:-3])  # truncated
  with CheckpointManager(tmp_path, strategy) as manager:
    with pytest.raises(tpustrat.checkpoint.DamagedCheckpointError,
                       match=rf"checkpoint 2 at {tmp_path / '2'} is damaged: ValueError: {re.escape(str(path))} is "
                             r"not valid JSON \(JSONDecodeError: "):
      manager.restore(2, target={"w": tpustrat.Mirrored(jnp.zeros(4, jnp.float32))}, iterator=iter(dist))


@pytest.mark.processes
def test_a_truncated_data_file_falls_back_without_event_loop_tracebacks(strategy, tmp_path):
  """Issue 31: step 2's data files are truncated. Reading one of its 16 arrays fails while orbax's reads of
  the others may still be running in tensorstore; orbax closed its event loop under them, and each one that
  ended then printed ``RuntimeError: Event loop is closed``. Step 1 restores, and the process's output,
  exit included, holds nothing else. The reads race with the failure (before the fix, 4 to 7 of 12
  directories printed the tracebacks, the first one nearly always), so one process restores 12 such
  directories, in about a second."""
  spec = importlib.util.spec_from_file_location("truncated_chunk", SCRIPTS / "truncated_chunk.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  script.save(str(tmp_path / "saved"), strategy)
  chunks = [p for p in (tmp_path / "saved" / "2" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
  assert chunks
  for path in chunks:
    os.truncate(path, path.stat().st_size // 2)
  dirs = [tmp_path / f"ckpt{i}" for i in range(12)]
  for d in dirs:
    shutil.copytree(tmp_path / "saved", d)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8")
  done = subprocess.run([sys.executable, str(SCRIPTS / "truncated_chunk.py"), "restore", *map(str, dirs)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Event loop is closed" not in done.stderr, done.stderr[-3000:]
  assert "Traceback" not in done.stderr, done.stderr[-3000:]
  results = json.loads(done.stdout.split("RESULT ", 1)[1])
  want = script.values(1)
  for d, result in zip(dirs, results, strict=True):
    assert result["restored_step"] == 1
    assert len(result["warnings"]) == 1 and result["warnings"][0].startswith(
        f"CheckpointManager.restore: checkpoint 2 at {d / '2'} is damaged: "), result["warnings"]
    assert sorted(result["values"]) == sorted(want)
    for k, v in want.items():
      np.testing.assert_array_equal(np.asarray(result["values"][k], np.float32), v)


def test_deleted_files_fall_back_step_by_step_and_every_damaged_step_is_named(strategy, tmp_path):
  values = [np.arange(4, dtype=np.float32) + i for i in range(2)]
  _saved_twice(strategy, tmp_path, values)
  target = {"w": tpustrat.Mirrored(jnp.zeros(4, jnp.float32))}
  shutil.copytree(tmp_path / "2", tmp_path / "3")  # a third step, to damage differently
  (tmp_path / "3" / "checksums" / "checksums.json").unlink()
  for path in (tmp_path / "2" / "state").rglob("*"):
    if path.is_file() and path.parent.name == "d":
      path.unlink()  # the array data of step 2
  with CheckpointManager(tmp_path, strategy) as manager:
    with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning) as caught:
      state = manager.restore(target=target, iterator=None)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert messages[0].startswith(f"CheckpointManager.restore: checkpoint 3 at {tmp_path / '3'} is damaged: ")
    assert "checksums" in messages[0] and "Restored checkpoint 1 instead" in messages[0]
    assert messages[0].endswith(f"moved aside to {tmp_path / '3.damaged'}.")
    assert messages[1].startswith(f"CheckpointManager.restore: checkpoint 2 at {tmp_path / '2'} is damaged: ")
    assert messages[1].endswith(f"Restored checkpoint 1 instead; the damaged step was moved aside to "
                                f"{tmp_path / '2.damaged'}.")
    assert manager.last_restored_step == 1
    assert_bitwise([strategy.experimental_local_results(state["w"])[0]], [values[0]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.damaged", "3.damaged"]
  shutil.rmtree(tmp_path / "1" / "state")
  shutil.move(tmp_path / "2.damaged", tmp_path / "2")
  with CheckpointManager(tmp_path, strategy) as manager:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      with pytest.raises(tpustrat.checkpoint.DamagedCheckpointError,
                         match=rf"every checkpoint in {tmp_path} is damaged \(checkpoint 2 at {tmp_path / '2'}: .*; "
                               rf"checkpoint 1 at {tmp_path / '1'}: .*\); none was moved aside\.$"):
        manager.restore(target=target)
    assert not caught, [str(w.message) for w in caught]  # no message says a step was moved
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3.damaged"]


def test_the_preemption_handler_resumes_from_the_newest_intact_step(strategy, tmp_path):
  values = [np.arange(4, dtype=np.float32) + i for i in range(2)]
  _saved_twice(strategy, tmp_path, values)
  (tmp_path / "3").mkdir()
  config = tpustrat.TerminationConfig(termination_watcher_fn=lambda: False)
  with tpustrat.PreemptionCheckpointHandler(None, tmp_path, termination_config=config) as handler:
    with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning, match="checkpoint 3 at"):
      state = handler.restore({"w": tpustrat.Mirrored(jnp.zeros(4, jnp.float32))})
    assert handler.total_run_calls == 2
    assert_bitwise([strategy.experimental_local_results(state["w"])[0]], [values[1]])


@pytest.mark.processes
def test_damage_seen_by_one_process_moves_every_process_to_the_previous_step(tmp_path):
  """Process 1's iterator file of step 2 is lost: process 0 could read step 2, process 1 could not; both
  restore step 1."""
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", str(SCRIPTS / "fallback_mp.py"),
             str(ckpt)]
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_")}
  saved = subprocess.run([*command, "save"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
  assert saved.returncode == 0, saved.stderr[-3000:]
  (ckpt / "2" / "iterator" / "process_1-of-2.json").unlink()
  done = subprocess.run([*command, "restore"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
  assert done.returncode == 0, done.stderr[-3000:]
  results = launched_results(done.stdout)
  for p in (0, 1):
    warned = results[p].pop("warnings")
    assert len(warned) == 1 and warned[0].startswith(
        f"CheckpointManager.restore: checkpoint 2 at {ckpt / '2'} is damaged: process 1: FileNotFoundError: "), warned
  assert results[0] == results[1] == {"restored_step": 1, "w": 1.0, "next_batch": 1.0, "steps": [1]}
  assert sorted(p.name for p in ckpt.iterdir()) == ["1", "2.damaged"]


# -- bounded operations ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode,args,stuck", [
    # Slow storage: process 1's write inside orbax's save; the bound is the step timeout.
    ("write", ("--step-timeout", "8"),
     "stuck: process 1 is in orbax's save of step 2 (writing its part, or waiting at orbax's barriers)"),
    # Process 1's iterator position never comes; process 0 waits in orbax's first barrier.
    ("position", ("6",), "stuck: process 1 is taking the iterator's position for step 2"),
    # The preemption handler's save_fn sleeps on process 1; process 0 saves through the manager.
    # Whichever process reports first names process 1 (as not having reached process 0's save, or as
    # running its save_fn).
    ("save_fn", ("6",), "running save_fn for step 2 after a termination notice (for "),
])
@pytest.mark.processes
def test_a_checkpoint_operation_stuck_on_one_process_stops_the_job_naming_it(tmp_path, mode, args, stuck):
  launcher_args, timeout = (args, ()) if args[0].startswith("--") else ((), args)
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "2", *launcher_args,
             str(SCRIPTS / "stuck_save.py"), str(tmp_path), mode, *timeout]
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_")}
  start = time.monotonic()
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  elapsed = time.monotonic() - start
  assert done.returncode == 124, done.stderr[-3000:]
  assert "NOT STOPPED" not in done.stdout
  assert "process 0 saved checkpoint 1" in done.stdout and "process 1 saved checkpoint 1" in done.stdout
  bound = args[-1]
  source = "the step timeout" if mode == "write" else "CheckpointManager(timeout=...)"
  assert "s for the save of step 2" in done.stderr and f"(checkpoint timeout {bound} s: {source}" in done.stderr
  assert stuck in done.stderr, done.stderr[-3000:]
  assert "stuck: process 1" in done.stderr
  assert "stuck: process 0" not in done.stderr
  assert elapsed < 60, f"{elapsed:.1f} s"  # the bound plus start-up, far from a hang
  assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["1"]  # step 2 never committed


def test_a_stuck_operation_of_one_process_is_reported_and_ends_it(strategy, tmp_path, monkeypatch):
  ended, release = [], threading.Event()

  def record(message, status):  # instead of os._exit: record, and let the stuck get_state return
    assert status == 124
    ended.append(message)
    release.set()

  monkeypatch.setattr(deadlines, "_exit_process", record)

  class StuckPosition:
    def get_state(self):
      release.wait(30)
      return {"position": 1}

  with CheckpointManager(tmp_path, strategy, timeout=1) as manager:
    assert manager.timeout == 1
    manager.save(1, {"w": jnp.zeros(2)}, iterator=StuckPosition())
  assert len(ended) == 1, ended
  assert ended[0].startswith("tpustrat: checkpoint timeout: process 0 has waited ")
  assert f"s for the save of step 1 in {tmp_path} (checkpoint timeout 1 s: CheckpointManager(timeout=...))." in ended[0]
  assert "stuck: process 0 is taking the iterator's position for step 1 (for " in ended[0]
  assert ended[0].endswith("Every process of the job stops with status 124.")


def test_the_timeout_is_the_step_timeout_unless_given(strategy, tmp_path, monkeypatch):
  from tpustrat._src import names  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv(names.ENV_STEP_TIMEOUT, raising=False)
  with CheckpointManager(tmp_path, strategy) as manager:
    assert manager.timeout == checkpoint_lib.DEFAULT_TIMEOUT == 1200
    monkeypatch.setenv(names.ENV_STEP_TIMEOUT, "7.5")
    assert manager.timeout == 7.5
  with CheckpointManager(tmp_path, strategy, timeout=30) as manager:
    assert manager.timeout == 30.0
  with CheckpointManager(tmp_path, strategy, timeout=names.MAX_TIMEOUT_SECONDS) as manager:
    assert manager.timeout == 2**31 - 1
  # The step timeout's range (the launcher's, the resolver's): under a second fires on a healthy save, and
  # JAX's runtime takes int32 seconds.
  for bad in (1e-300, 0.5, 0, -1, 2**40, 2**31, float("inf"), float("nan"), True, "10"):
    with pytest.raises(ValueError, match=r"^CheckpointManager: timeout must be a positive number of seconds in "
                                         rf"\[1, 2147483647\], got {re.escape(repr(bad))}\.$"):
      CheckpointManager(tmp_path, strategy, timeout=bad)


# -- saving a step that is on disk already (issue 44 item 5) -------------------------------------------


def _two_steps(strategy, directory, values, enable_async=True):
  """A manager with checkpoints 1 and 2 of ``{"w": values[i]}``, each with the iterator's position (1 and 2
  batches taken); returns it, the dataset and the iterator (2 batches taken)."""
  dist = strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(6)])
  it = iter(dist)
  manager = CheckpointManager(directory, strategy, enable_async_checkpointing=enable_async)
  for step in (1, 2):
    next(it)
    manager.save(step, {"w": jnp.asarray(values[step - 1])}, iterator=it)
  manager.wait_until_finished()
  return manager, dist, it


def _restored(strategy, directory, dist, step=None):
  """``w`` of checkpoint `step` (default: the newest) read by a fresh manager, and the first element of the
  batch its iterator position gives next."""
  with CheckpointManager(directory, strategy) as manager:
    resumed = iter(dist)
    state = manager.restore(step, target={"w": jnp.zeros(4, jnp.float32)}, iterator=resumed)
    return np.asarray(state["w"]), float(strategy.experimental_local_results(next(resumed))[0][0])


@pytest.mark.parametrize("enable_async", [True, False])
def test_saving_the_newest_step_again_replaces_it(strategy, tmp_path, enable_async):
  # A resumed job saving the step it resumed from, or a finished job started again: orbax's manager
  # returned False and kept the old step; TF's CheckpointManager.save(checkpoint_number=2) overwrites.
  values = [np.arange(4, dtype=np.float32) + 10 * i for i in range(3)]
  manager, dist, it = _two_steps(strategy, tmp_path, values, enable_async)
  with manager:
    next(it)  # the replacement holds another state and another position (3 batches taken)
    assert manager.save(2, {"w": jnp.asarray(values[2])}, iterator=it) is True
    # The previous checkpoint waits aside until the new one is committed, then goes.
    assert (tmp_path / "2.replaced").is_dir()
    manager.wait_until_finished()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
    assert manager.all_steps() == [1, 2]
  w, next_batch = _restored(strategy, tmp_path, dist)
  np.testing.assert_array_equal(w, values[2])
  assert next_batch == 3.0
  w, next_batch = _restored(strategy, tmp_path, dist, step=1)  # the other step is untouched
  np.testing.assert_array_equal(w, values[0])
  assert next_batch == 1.0


def test_saving_a_step_older_than_the_newest_raises_and_writes_nothing(strategy, tmp_path):
  # A job whose step count restarted at 0 after a restore: its saves were skipped without a word.
  values = [np.arange(4, dtype=np.float32) + 10 * i for i in range(3)]
  manager, dist, _ = _two_steps(strategy, tmp_path, values)
  with manager:
    for step, held in ((1, "checkpoint 1 exists"), (0, "there is no checkpoint 0")):
      for force in (False, True):
        with pytest.raises(ValueError, match=(
            rf"^CheckpointManager\.save: step {step} is older than the newest checkpoint, step 2, in "
            rf"{re.escape(str(tmp_path))} \(steps \[1, 2\]; {held}\)\. Nothing was written: restore\(\) takes "
            r"the newest step.* continues its step count from the restored step")):
          manager.save(step, {"w": jnp.asarray(values[2])}, force=force)
    manager.wait_until_finished()
    assert manager.all_steps() == [1, 2]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
  for step in (1, 2):
    w, next_batch = _restored(strategy, tmp_path, dist, step=step)
    np.testing.assert_array_equal(w, values[step - 1])
    assert next_batch == float(step)


@pytest.mark.parametrize("enable_async", [True, False])
def test_a_replacement_that_fails_puts_the_previous_checkpoint_back(strategy, tmp_path, monkeypatch,
                                                                    enable_async):
  values = [np.arange(4, dtype=np.float32) + 10 * i for i in range(3)]
  manager, dist, it = _two_steps(strategy, tmp_path, values, enable_async)
  handler = handlers.api().IteratorHandler
  original = handler.save

  def save_then_fail(self, directory, args=None):
    original(self, directory, args)
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(handler, "save", save_then_fail)
  next(it)
  with pytest.raises(checkpoint_lib.CheckpointSaveError,
                     match=r"could not write checkpoint 2 .* No space left on device.* The previous checkpoint 2, "
                           r"which this save was replacing, is back in place, intact\.$"):
    manager.save(2, {"w": jnp.asarray(values[2])}, iterator=it)
    manager.wait_until_finished()
  monkeypatch.undo()
  assert manager.all_steps() == [1, 2]
  manager.close()
  assert (tmp_path / "2").is_dir() and not (tmp_path / "2.replaced").exists()
  with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning, match="removed the unfinished save of step 2"):
    w, next_batch = _restored(strategy, tmp_path, dist)
  np.testing.assert_array_equal(w, values[1])
  assert next_batch == 2.0


@pytest.mark.parametrize("committed", [True, False])
def test_the_next_start_settles_a_replacement_that_a_stopped_process_left(strategy, tmp_path, committed):
  # A process stopped between setting step 2's previous checkpoint aside and removing it: the replacement
  # had been committed (the previous checkpoint goes), or it had not (the previous checkpoint comes back).
  values = [np.arange(4, dtype=np.float32) + 10 * i for i in range(3)]
  directory, other = tmp_path / "run", tmp_path / "other"
  manager, dist, _ = _two_steps(strategy, directory, values)
  manager.close()
  with CheckpointManager(other, strategy) as elsewhere:  # a checkpoint 2 of other content
    elsewhere.save(2, {"w": jnp.asarray(values[2])}, iterator=iter(dist))
  if committed:  # "2" is the replacement, "2.replaced" the previous checkpoint (values[2] here)
    shutil.copytree(other / "2", directory / "2.replaced")
    want = values[1]
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # nothing to say: the job's own save had been committed
      CheckpointManager(directory, strategy).close()
  else:  # the replacement never committed: its temporary directory, and the previous checkpoint aside
    (directory / "2").rename(directory / "2.replaced")
    shutil.copytree(other / "2", directory / "2.orbax-checkpoint-tmp-1")
    want = values[1]
    with pytest.warns(tpustrat.checkpoint.DamagedCheckpointWarning) as caught:
      CheckpointManager(directory, strategy).close()
    said = [str(w.message) for w in caught]
    assert any("removed the unfinished save of step 2" in m for m in said), said
    assert any(m.startswith("CheckpointManager: the save that was replacing step 2 never committed (a process "
                            "stopped while writing it); the previous checkpoint 2 was put back in place from "
                            f"{directory / '2.replaced'}.") for m in said), said
  assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]
  w, next_batch = _restored(strategy, directory, dist)
  np.testing.assert_array_equal(w, want)
  assert next_batch == 2.0


@pytest.mark.processes
def test_every_process_replaces_the_newest_step_and_refuses_an_older_one(tmp_path):
  """2 processes x 4 devices: the replacement of step 2 is set aside by process 0 and forgotten by both
  before orbax's save; the save of step 1 raises on both, before any collective. Both processes save;
  `strategy.extended.should_checkpoint` (TF's chief rule) is True on process 0 only."""
  ckpt = tmp_path / "ckpt"
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_")}
  done = subprocess.run([sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4",
                         str(SCRIPTS / "replace_mp.py"), str(ckpt)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert done.returncode == 0, done.stderr[-3000:]
  results = launched_results(done.stdout)
  for p in (0, 1):
    assert results[p].pop("should") == [[p == 0, p == 0]] * 2  # TPUStrategy, MultiWorkerMirroredStrategy
    error = results[p].pop("error")
    assert error.startswith(f"CheckpointManager.save: step 1 is older than the newest checkpoint, step 2, in {ckpt} "
                            "(steps [1, 2]; checkpoint 1 exists)."), error
  assert results[0] == results[1] == {"replaced": True, "aside_while_writing": True, "steps": [1, 2], "w": 3.0,
                                      "next_batch": 3.0}
  assert sorted(p.name for p in ckpt.iterdir()) == ["1", "2"]
