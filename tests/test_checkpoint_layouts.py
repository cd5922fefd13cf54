"""Checkpoints across layouts (issue 22, items 6 and 7): sharded state restored onto data parallel targets
and back, onto another replica count and onto 2 processes x 4 devices; restores that give each device only
its block; restored states that a donating step can take; the preemption handler with a donating step.

References are numpy values computed independently (the saved values as numpy, or Adam in float64
numpy, `sharded_common.numpy_train`), never tpustrat against itself, except where the point is that a
restored run continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat import Mirrored, ShardedVariable
from tpustrat._src.checkpoint import checksums
from tpustrat.checkpoint import CheckpointManager

SCRIPTS = pathlib.Path(__file__).resolve().parent / "_ckpt_scripts"
ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 8

_spec = importlib.util.spec_from_file_location("sharded_common", SCRIPTS / "sharded_common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)


def make_strategy(strategy, n):
  return strategy if n == N else tpustrat.MirroredStrategy(jax.devices()[:n])


def assert_equal_values(got: dict, want: dict) -> None:
  """Same keys, and every value bit for bit (dtype included)."""
  assert sorted(got) == sorted(want)
  for k in want:
    a, b = np.asarray(got[k]), np.asarray(want[k])
    assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, a.shape, b.dtype, b.shape)
    np.testing.assert_array_equal(a, b, err_msg=k)


def assert_close_values(got: dict, want: dict, rtol: float) -> None:
  assert sorted(got) == sorted(want)
  for k in want:
    assert_close(got[k], want[k], rtol=rtol, scale=np.abs(np.asarray(want[k], np.float64)).max() + 1e-30,
                 err_msg=k)


def numpy_blocks(value: np.ndarray, axis: int, n: int) -> np.ndarray:
  """The ``[n, ...block]`` blocks of `value` split along `axis`, zero-padded (independently of tpustrat)."""
  b = -(-value.shape[axis] // n)
  pad = [(0, 0)] * value.ndim
  pad[axis] = (0, n * b - value.shape[axis])
  return np.stack(np.split(np.pad(value, pad), n, axis=axis))


def sharded_leaves(tree):
  return [v for v in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, ShardedVariable))
          if isinstance(v, ShardedVariable)]


def all_arrays(tree):
  return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def assert_placed_like(got, target) -> None:
  """Every restored array has its target's sharding; a sharded value's devices hold one block each."""
  got_leaves = jax.tree.leaves(got)
  want_leaves = jax.tree.leaves(target)
  assert len(got_leaves) == len(want_leaves)
  for a, b in zip(got_leaves, want_leaves):
    assert a.sharding == b.sharding, (a.sharding, b.sharding)
  for v in sharded_leaves(got):
    block = (1, *v.tree.shape[1:])
    assert all(s.data.shape == block for s in v.tree.addressable_shards)


def test_host_fingerprint_equals_the_devices():
  """A restore that re-lays a value out checks its checksum on the host: the same two sums."""
  rng = np.random.default_rng(0)
  arrays = {
      "f32": rng.normal(size=(37, 5)).astype(np.float32),
      "bf16": rng.normal(size=(3, 7, 2)).astype(ml_dtypes.bfloat16),
      "f16": rng.normal(size=(9,)).astype(np.float16),
      "i8": rng.integers(-128, 127, size=(4, 5), dtype=np.int8),
      "u8": rng.integers(0, 255, size=(13,), dtype=np.uint8),
      "i16": rng.integers(-3000, 3000, size=(6,), dtype=np.int16),
      "i32": rng.integers(-2**31, 2**31 - 1, size=(8, 3), dtype=np.int32),
      "u32": rng.integers(0, 2**32 - 1, size=(5,), dtype=np.uint32),
      "bool": rng.random((3, 3)) > 0.5,
      "c64": (rng.normal(size=(4,)) + 1j * rng.normal(size=(4,))).astype(np.complex64),
      "scalar": np.float32(3.5).reshape(()),
      "empty": np.zeros((0, 3), np.float32),
      "strided": rng.normal(size=(6, 8)).astype(np.float32)[:, ::2],
  }
  for name, x in arrays.items():
    host = checksums.host_fingerprint(x)
    device = np.asarray(checksums._fingerprints([jax.device_put(x)])[0])  # pylint: disable=protected-access
    np.testing.assert_array_equal(host, device, err_msg=name)
  assert checksums.host_fingerprint(np.zeros(3, np.int64)) is None  # 64-bit: left to the devices


def test_sharded_state_restores_onto_mirrored_and_plain_targets_and_back(strategy, tmp_path):
  rng = np.random.default_rng(3)
  w = rng.normal(size=(37, 3)).astype(np.float32)  # 8 blocks of 5 rows, the last 2 rows real
  u = rng.normal(size=(2, 11)).astype(np.float32)  # split along axis 1
  one = rng.normal(size=(1, 4)).astype(np.float32)  # fewer rows than replicas: 7 blocks of padding
  saved = {"w": strategy.experimental_shard(w, lambda *_: 0), "u": strategy.experimental_shard(u, lambda *_: 1),
           "one": strategy.experimental_shard(one, lambda *_: 0), "step": strategy.experimental_mirror(np.int32(5))}
  with CheckpointManager(tmp_path / "sharded", strategy) as manager:
    manager.save(5, saved)
  mirrored = {"w": strategy.experimental_mirror(np.zeros_like(w)), "u": strategy.experimental_mirror(np.zeros_like(u)),
              "one": strategy.experimental_mirror(np.zeros_like(one)), "step": strategy.experimental_mirror(np.int32(0))}
  plain = {"w": jnp.zeros_like(w), "u": jax.ShapeDtypeStruct(u.shape, u.dtype), "one": np.zeros_like(one),
           "step": 0}
  four = make_strategy(strategy, 4)
  with CheckpointManager(tmp_path / "sharded", strategy) as manager:
    got = manager.restore(5, target=mirrored)
    flat = manager.restore(5, target=plain)
  with CheckpointManager(tmp_path / "sharded", four) as manager:
    got4 = manager.restore(5, target={k: four.experimental_mirror(np.asarray(v.tree.addressable_data(0)))
                                      for k, v in mirrored.items()})
  replicated = NamedSharding(strategy.mesh, P())
  for tree, where in ((got, replicated), (got4, NamedSharding(four.mesh, P()))):
    for name, want in (("w", w), ("u", u), ("one", one)):
      assert isinstance(tree[name], Mirrored) and tree[name].tree.sharding == where
      np.testing.assert_array_equal(np.asarray(tree[name].tree), want)
    assert int(tree["step"].tree) == 5
  for name, want in (("w", w), ("u", u), ("one", one)):
    assert isinstance(flat[name], jax.Array) and flat[name].sharding == replicated
    np.testing.assert_array_equal(np.asarray(flat[name]), want)

  # And back: saved mirrored (data parallel), restored split on 8 and on 4 replicas.
  with CheckpointManager(tmp_path / "mirrored", strategy) as manager:
    manager.save(1, got)
  for n in (8, 4):
    loader = make_strategy(strategy, n)
    target = {"w": loader.experimental_shard(np.zeros_like(w), lambda *_: 0),
              "u": loader.experimental_shard(np.zeros_like(u), lambda *_: 1),
              "one": loader.experimental_shard(np.zeros_like(one), lambda *_: 0),
              "step": loader.experimental_mirror(np.int32(0))}
    with CheckpointManager(tmp_path / "mirrored", loader) as manager:
      back = manager.restore(1, target=target)
    assert_placed_like(back, target)
    for name, want, axis in (("w", w, 0), ("u", u, 1), ("one", one, 0)):
      assert isinstance(back[name], ShardedVariable) and back[name].num_replicas == n
      np.testing.assert_array_equal(np.asarray(back[name]), want)
      blocks = np.stack([np.asarray(b) for b in back[name].values])
      np.testing.assert_array_equal(blocks, numpy_blocks(want, axis, n))  # padding is zeros
    assert int(back["step"].tree) == 5

  # A target whose shape the saved blocks cannot be blocks of is an error naming the leaf.
  with CheckpointManager(tmp_path / "sharded", strategy) as manager:
    with pytest.raises(ValueError, match=r"value at \['w'\] was saved as a sharded value of 8 blocks of shape \[5, 3\]"):
      manager.restore(5, target=dict(mirrored, w=strategy.experimental_mirror(np.zeros((3, 37), np.float32))))


def test_restore_items_carry_the_targets_shardings(strategy, tmp_path):
  """orbax reads a sharded value restored on as many replicas with the target's split sharding (a block per
  device); a re-split (another replica count, or sharded <-> mirrored) reads into host memory, not onto
  any device, and the restored arrays carry the target's shardings."""
  w = np.arange(37 * 3, dtype=np.float32).reshape(37, 3)
  b = np.arange(4, dtype=np.float32)
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(1, {"w": strategy.experimental_shard(w, lambda *_: 0), "b": strategy.experimental_mirror(b)})
  four = make_strategy(strategy, 4)
  cases = [
      ("same count", strategy, {"w": strategy.experimental_shard(np.zeros_like(w), lambda *_: 0),
                                "b": strategy.experimental_mirror(np.zeros_like(b))}),
      ("8 -> 4", four, {"w": four.experimental_shard(np.zeros_like(w), lambda *_: 0),
                        "b": four.experimental_mirror(np.zeros_like(b))}),
      ("sharded -> mirrored", strategy, {"w": strategy.experimental_mirror(np.zeros_like(w)),
                                         "b": strategy.experimental_mirror(np.zeros_like(b))}),
  ]
  for name, loader, target in cases:
    with CheckpointManager(tmp_path, loader) as manager:
      items = []
      handler = manager._state_handler  # pylint: disable=protected-access
      real = handler.restore
      handler.restore = lambda directory, args=None, real=real, items=items: (
          items.append(args.item), real(directory, args=args))[1]
      got = manager.restore(1, target=target)
    (item,) = items
    blocks = item["w"]["blocks"]
    if name == "same count":
      assert isinstance(blocks, jax.ShapeDtypeStruct) and blocks.sharding == NamedSharding(strategy.mesh, P("replica"))
      assert blocks.sharding.shard_shape(blocks.shape) == (1, 5, 3)  # one block per device, never the whole
    else:
      assert isinstance(blocks, np.ndarray) and blocks.strides == (0, 0, 0)  # read into host memory
    for x in jax.tree.leaves(item):  # no device reads a whole sharded value
      if isinstance(x, jax.ShapeDtypeStruct) and x.shape == (8, 5, 3):
        assert x.sharding.shard_shape(x.shape)[0] == 1
    assert_placed_like(got, target)
    np.testing.assert_array_equal(np.asarray(got["w"]) if name != "sharded -> mirrored"
                                  else np.asarray(got["w"].tree), w)
    np.testing.assert_array_equal(np.asarray(got["b"].tree), b)


def test_values_read_on_the_host_are_checked_against_their_checksums(strategy, tmp_path):
  """A re-split restore verifies the blocks it read into host memory (on the host): a changed checksum of the
  saved blocks makes the step damaged, as for arrays read onto the devices."""
  w = np.arange(37 * 3, dtype=np.float32).reshape(37, 3)
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(1, {"w": strategy.experimental_shard(w, lambda *_: 0)})
  path = tmp_path / "1" / "checksums" / "checksums.json"
  sums = json.loads(path.read_text())
  assert set(sums["arrays"]) == {"w/blocks", "w/shape"}  # the blocks and the logical shape
  sums["arrays"]["w/blocks"]["sums"][0] ^= 1
  path.write_text(json.dumps(sums))
  four = make_strategy(strategy, 4)
  for loader, target in ((four, four.experimental_shard(np.zeros_like(w), lambda *_: 0)),
                         (strategy, strategy.experimental_mirror(np.zeros_like(w)))):
    with CheckpointManager(tmp_path, loader) as manager:
      with pytest.raises(tpustrat.checkpoint.DamagedCheckpointError, match=r"the content of 'w/blocks'"):
        manager.restore(1, target={"w": target})


def test_adam_state_round_trips_and_training_continues(strategy, tmp_path):
  """Sharded params and Adam state saved after 2 steps; restored onto the same layout the next 2 steps give
  the uninterrupted run bit for bit; onto data parallel (8 replicas) and onto FSDP on 4 replicas, within
  rtol 1e-5. The restored values are the saved ones bit for bit, and every run matches numpy Adam."""
  state = common.train(strategy, common.make_state(strategy, common.initial_params()), range(2))
  at_save = common.to_numpy(state)
  assert_close_values(at_save, common.numpy_train(2), rtol=1e-4)
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(2, state)  # asynchronous; the next step donates the saved state at once
    uninterrupted = common.to_numpy(common.train(strategy, state, range(2, 4)))
  assert_close_values(uninterrupted, common.numpy_train(4), rtol=1e-4)
  four = make_strategy(strategy, 4)
  layouts = [("same layout", strategy, True), ("data parallel", strategy, False), ("FSDP on 4", four, True)]
  for name, loader, sharded in layouts:
    target = common.make_state(loader, common.initial_params(seed=5), sharded=sharded)
    with CheckpointManager(tmp_path, loader) as manager:
      restored = manager.restore(2, target=target)
    assert_placed_like(restored, target)
    assert all(isinstance(v, ShardedVariable if sharded and k != "b" else Mirrored)
               for k, v in restored["params"].items()), (name, restored["params"])
    assert_equal_values(common.to_numpy(restored), at_save)
    continued = common.to_numpy(common.train(loader, restored, range(2, 4)))
    if name == "same layout":
      assert_equal_values(continued, uninterrupted)
    else:
      assert_close_values(continued, uninterrupted, rtol=1e-5)


def test_restored_state_is_donated_without_a_warning(strategy, tmp_path):
  """Restored arrays (read by orbax onto the target's shardings, or placed from the host after a re-split)
  are taken by a donating step as they are: deleted afterwards, and no 'donated buffers were not usable'."""
  state = common.make_state(strategy, common.initial_params())
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(0, state)
  four = make_strategy(strategy, 4)
  for loader, sharded in ((strategy, True), (four, True), (strategy, False)):
    target = common.make_state(loader, common.initial_params(seed=5), sharded=sharded)
    with CheckpointManager(tmp_path, loader) as manager:
      restored = manager.restore(0, target=target)
    x, y = common.distribute(loader, 0)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      out = loader.run(common.step, args=(restored, x, y), options=tpustrat.RunOptions(donate_argnums=0))
      jax.block_until_ready(jax.tree.leaves(out))
    assert not [w for w in caught if "donated" in str(w.message)], [str(w.message) for w in caught]
    arrays = all_arrays(restored)
    assert arrays and all(a.is_deleted() for a in arrays)
    assert_close_values(common.to_numpy(out), common.numpy_train(1), rtol=1e-4)


def test_preemption_handler_run_with_a_donating_step_saves_the_new_state(strategy, tmp_path):
  """`handler.run`'s function donates the state it gets; the handler saves what the function returned (alive),
  and the input states are deleted. Saving a donated state is an error naming the leaf."""
  notice, exits = [False], []

  def exit_fn():  # does not exit: training goes on
    exits.append(1)
    notice[0] = False

  def train_fn(state, i):
    x, y = common.distribute(strategy, i)
    return (strategy.run(common.step, args=(state, x, y), options=tpustrat.RunOptions(donate_argnums=0)),)

  config = tpustrat.TerminationConfig(termination_watcher_fn=lambda: notice[0], exit_fn=exit_fn)
  with tpustrat.PreemptionCheckpointHandler(None, tmp_path, termination_config=config) as handler:
    state = handler.restore(common.make_state(strategy, common.initial_params()))
    old = state
    (state,) = handler.run(train_fn, state, 0)
    assert all(a.is_deleted() for a in all_arrays(old))
    notice[0] = True
    deadline = time.monotonic() + 10
    while not handler._local_notice:  # pylint: disable=protected-access  # the watcher thread polls it
      assert time.monotonic() < deadline, "the watcher thread did not see the notice"
      time.sleep(0.01)
    old = state
    (state,) = handler.run(train_fn, state, 1)  # call 2: saved after the function returned
    assert exits == [1] and handler.checkpoint_manager.all_steps() == [2]
    assert all(a.is_deleted() for a in all_arrays(old))
    at_two = common.to_numpy(state)
    (state,) = handler.run(train_fn, state, 2)  # the saved state is donated by the next call: the save is done
    assert handler.total_run_calls == 3
    with pytest.raises(RuntimeError, match=r"CheckpointManager.save: the array at \['opt'\]\[0\]\.count"
                                           r"|CheckpointManager.save: the array at .* has been deleted"):
      handler.checkpoint_manager.save(9, {"opt": old["opt"], "params": old["params"]}, force=True)
  assert_close_values(at_two, common.numpy_train(2), rtol=1e-4)
  with CheckpointManager(tmp_path, strategy) as manager:
    assert manager.all_steps() == [2]
    restored = manager.restore(2, target=common.make_state(strategy, common.initial_params(seed=5)))
  assert_equal_values(common.to_numpy(restored), at_two)


@pytest.mark.processes
def test_sharded_state_between_one_process_and_two(strategy, tmp_path):
  """Saved by 1 process x 8 devices after 2 Adam steps; a 2 processes x 4 devices job restores it (onto the
  FSDP layout and onto data parallel), takes 2 donating steps on the sharded state and saves; this process
  restores that. Every value is checked against numpy Adam, and the restores bit for bit."""
  try:
    import tpustrat.launch  # noqa: F401
  except ImportError:
    pytest.skip("tpustrat.launch is not available")
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  state = common.train(strategy, common.make_state(strategy, common.initial_params()), range(2))
  with CheckpointManager(ckpt, strategy) as manager:
    manager.save(2, state)
  at_save = common.to_numpy(state)
  np.savez(tmp_path / "reference.npz", **{k.replace("/", "."): v for k, v in at_save.items()})
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--timeout", "200",
             str(SCRIPTS / "sharded_mp.py"), str(ckpt), str(tmp_path / "reference.npz"), str(out)]
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  results = [json.loads((out / f"process_{i}.json").read_text()) for i in range(2)]
  for r in results:
    assert r == {"identical": True, "placed": True, "mirrored_identical": True, "mirrored_placed": True,
                 "donated": True, "block_shapes": [[1, 5, 5], [1, 5, 2]]}, r
  after = np.load(out / "after.npz")
  after = {k.replace(".", "/"): after[k] for k in after.files}
  assert_close_values(after, common.numpy_train(4), rtol=1e-4)
  target = common.make_state(strategy, common.initial_params(seed=5))
  with CheckpointManager(ckpt, strategy) as manager:
    assert manager.all_steps() == [2, 4]
    restored = manager.restore(4, target=target)
  assert_placed_like(restored, target)
  assert_equal_values(common.to_numpy(restored), after)


def test_a_target_of_another_logical_shape_is_an_error_even_when_its_blocks_fit(strategy, tmp_path):
  # [3, 2] on 8 replicas is 8 blocks of 1 row; targets of 5 or 2 rows (Mirrored), or 7 rows on 4 replicas,
  # would take those blocks (padded or cut) without the saved logical shape: each is an error naming both.
  w = np.arange(6, dtype=np.float32).reshape(3, 2) + 1
  with CheckpointManager(tmp_path, strategy) as manager:
    manager.save(1, {"a": strategy.experimental_shard(w, lambda *_: 0)})
  four = make_strategy(strategy, 4)
  targets = [(strategy, strategy.experimental_mirror(np.zeros((5, 2), np.float32)), [5, 2]),
             (strategy, strategy.experimental_mirror(np.zeros((2, 2), np.float32)), [2, 2]),
             (strategy, strategy.experimental_shard(np.zeros((8, 2), np.float32), lambda *_: 0), [8, 2]),
             (four, four.experimental_shard(np.zeros((7, 2), np.float32), lambda *_: 0), [7, 2])]
  for loader, target, shape in targets:
    with CheckpointManager(tmp_path, loader) as manager:
      with pytest.raises(ValueError, match=re.escape(f"['a'] was saved with shape [3, 2], but the target's is {shape}")):
        manager.restore(1, target={"a": target})
  with CheckpointManager(tmp_path, four) as manager:  # the right shape restores, bit for bit
    got = manager.restore(1, target={"a": four.experimental_shard(np.zeros((3, 2), np.float32), lambda *_: 0)})
  np.testing.assert_array_equal(np.asarray(got["a"]), w)


def test_a_value_saved_split_on_one_axis_restores_into_a_target_split_on_another(strategy, tmp_path):
  """Saved as blocks along axis 0, restored into a `ShardedVariable` of the same shape split along axis 1
  (and back), on 8 replicas and on 4: read on the host and re-split, as through a `Mirrored` target."""
  rng = np.random.default_rng(11)
  w = rng.normal(size=(13, 10)).astype(np.float32)  # 8 blocks of 2 rows, or of 2 columns (both padded)
  for saved_axis, target_axis in ((0, 1), (1, 0)):
    directory = tmp_path / f"split{saved_axis}"
    with CheckpointManager(directory, strategy) as manager:
      manager.save(1, {"w": strategy.experimental_shard(w, lambda *_, a=saved_axis: a)})
    for n in (8, 4):
      loader = make_strategy(strategy, n)
      target = {"w": loader.experimental_shard(np.zeros_like(w), lambda *_, a=target_axis: a)}
      with CheckpointManager(directory, loader) as manager:
        got = manager.restore(1, target=target)
      assert_placed_like(got, target)
      assert isinstance(got["w"], ShardedVariable) and got["w"].axis == target_axis and got["w"].num_replicas == n
      np.testing.assert_array_equal(np.asarray(got["w"]), w)
      blocks = np.stack([np.asarray(b) for b in got["w"].values])
      np.testing.assert_array_equal(blocks, numpy_blocks(w, target_axis, n))  # padding is zeros


def test_the_first_save_of_a_mirrored_state_runs_no_program_and_moves_between_layouts(strategy, tmp_path):
  """Issue 45, item 5: orbax's replica-parallel save sliced each device's copy of a replicated array with a
  program of its own (one per shape and device: 97 compilations at the char transformer's first save), and
  the checksums were a device program compiled per set of shapes. Now the first save of a `Mirrored` state
  lowers no program at all (JAX's lowering events are counted, which fire whether or not the persistent
  compilation cache then holds the program). The checkpoint restores bit for bit onto 8 and 4 replicas,
  mirrored and split, and its checksums are the numpy definition's."""
  rng = np.random.default_rng(45)
  # Shapes no other test saves (a program compiled earlier in this process would not be lowered again),
  # each with an axis 8 divides, so replica-parallel saving would have sliced every one.
  values = {"a": rng.normal(size=(40, 24)).astype(np.float32), "b": rng.normal(size=(56,)).astype(np.float32),
            "c": rng.normal(size=(3, 16, 5)).astype(ml_dtypes.bfloat16),
            "d": rng.integers(-9, 9, size=(24, 7)).astype(np.int32), "e": rng.normal(size=(8, 3, 3)) > 0}
  state = {k: strategy.experimental_mirror(v) for k, v in values.items()}
  lowered = []

  def listener(event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      lowered.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    with CheckpointManager(tmp_path, strategy) as manager:
      manager.save(1, state)
      manager.wait_until_finished()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert lowered == []
  saved = json.loads((tmp_path / "1" / "checksums" / "checksums.json").read_text())["arrays"]
  for k, v in values.items():
    assert saved[k]["sums"] == _numpy_sums(v), k
  for n in (8, 4):
    loader = make_strategy(strategy, n)
    mirrored = {k: loader.experimental_mirror(np.zeros_like(v)) for k, v in values.items()}
    split = {k: loader.experimental_shard(np.zeros_like(v), lambda *_: 0) for k, v in values.items()}
    for target in (mirrored, split):
      with CheckpointManager(tmp_path, loader) as manager:
        got = manager.restore(1, target=target)
      assert_placed_like(got, target)
      assert_equal_values({k: np.asarray(v) for k, v in got.items()}, values)


def _numpy_sums(x: np.ndarray) -> list[int]:
  """The two checksums of `x` by their definition (tpustrat._src.checkpoint.checksums), in Python ints."""
  words = x.astype(np.uint32) if x.dtype == np.bool_ else (
      x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize]).astype(np.uint32))
  words = words.reshape(-1).astype(np.uint64)
  index = np.arange(words.size, dtype=np.uint64)
  rotated = ((words << np.uint64(16)) | (words >> np.uint64(16))) & np.uint64(0xFFFFFFFF)
  sums = []
  for w, multiplier, offset in ((words, 0x9E3779B1, 0x7F4A7C15), (rotated, 0x85EBCA77, 0x165667B1)):
    weights = (((index + np.uint64(offset)) * np.uint64(multiplier)) & np.uint64(0xFFFFFFFF)) | np.uint64(1)
    sums.append(int(np.sum((w * weights) & np.uint64(0xFFFFFFFF), dtype=np.uint64) % 2**32))
  return sums
