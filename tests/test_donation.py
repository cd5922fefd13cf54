"""Donated arguments: `RunOptions(donate_argnums=...)` for `run` and `experimental_run_steps`.

The numbers with donation equal those without (and numpy's); a donated argument is deleted and using it
again raises JAX's error; the compiled program aliases the donated state to its result.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpustrat import Mirrored, RunOptions

N = 8


def sgd_step(state, x):
  """One SGD step of a linear least-squares model on this replica's rows; the gradient is summed over
  replicas (JAX's shard_map), so every replica applies the same update."""
  def loss(w):
    return jnp.sum((x @ w - 1.0) ** 2)
  g = jax.grad(loss)(state["w"])
  return {"w": state["w"] - 0.01 * g, "step": state["step"] + 1}


def numpy_sgd(w, x, steps):
  for _ in range(steps):
    w = w - 0.01 * (2 * x.T @ (x @ w - 1.0))
  return w


def test_run_with_donation_equals_numpy_and_deletes_the_donated_state(strategy):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 4)).astype(np.float32)
  w0 = rng.normal(size=(4,)).astype(np.float32)
  batch = strategy.experimental_distribute_values_from_function(
      lambda ctx: x[2 * ctx.replica_id_in_sync_group:2 * ctx.replica_id_in_sync_group + 2])
  state = strategy.experimental_mirror({"w": w0, "step": np.int32(0)})
  donate = RunOptions(donate_argnums=0)
  for _ in range(5):
    old = state
    state = strategy.run(sgd_step, args=(state, batch), options=donate)
    assert old["w"].tree.is_deleted() and old["step"].tree.is_deleted()
  assert isinstance(state["w"], Mirrored) and int(state["step"].values[0]) == 5
  want = numpy_sgd(w0.astype(np.float64), x.astype(np.float64), 5)
  np.testing.assert_allclose(state["w"].values[0], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  with pytest.raises(RuntimeError, match=r"strategy.run: the argument at args\[0\]\['step'\] has been deleted"):
    strategy.run(sgd_step, args=(old, batch), options=donate)
  with pytest.raises(RuntimeError, match=r"has been deleted"):  # without donating this time, too
    strategy.run(sgd_step, args=(old, batch))
  # The batch was not donated: still usable.
  assert not batch.tree.is_deleted()


def test_donated_program_aliases_the_state(strategy):
  state = strategy.experimental_mirror({"w": np.ones((256, 256), np.float32), "step": np.int32(0)})
  x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((2, 256), np.float32))
  engine = strategy._engine
  sizes = {}
  for donate in ((), (0,)):
    leaves, in_tree = jax.tree.flatten(((state, x), {}))
    strategy.run(sgd_step, args=(strategy.experimental_mirror({"w": np.ones((256, 256), np.float32),
                                                                 "step": np.int32(0)}), x),
                 options=RunOptions(donate_argnums=donate))
    (program, targets), = [e for (k, t), e in engine._entries.items() if t == in_tree and (
        k() if callable(k) else k) is sgd_step]
    flat = program.donating(tuple(range(2)) if donate else ())._flat
    compiled = flat.lower(*[engine._place(v, t) for v, t in zip(leaves, targets)]).compile()
    sizes[donate] = compiled.memory_analysis().alias_size_in_bytes
  assert sizes[()] == 0
  assert sizes[(0,)] >= 256 * 256 * 4  # the donated weight's buffer becomes the new weight's


def test_bad_donate_argnums_are_errors_naming_them(strategy):
  with pytest.raises(TypeError, match="donate_argnums must be an int or a tuple"):
    RunOptions(donate_argnums="0")
  with pytest.raises(ValueError, match="donate_argnums"):
    RunOptions(donate_argnums=-1)
  with pytest.raises(ValueError, match=r"names an argument twice"):
    RunOptions(donate_argnums=(1, 1))
  with pytest.raises(ValueError, match=r"names argument 2, but there are 2 positional arguments"):
    strategy.run(lambda a, b: a + b, args=(jnp.ones(2), jnp.ones(2)), options=RunOptions(donate_argnums=2))
  with pytest.raises(ValueError, match=r"experimental_run_steps: .*names argument 2"):
    strategy.experimental_run_steps(lambda c, b: (c, b), iter([np.zeros(8, np.float32)]), steps=1, init=0.0,
                                    options=RunOptions(donate_argnums=(0, 2)))


def test_run_steps_with_a_donated_carry_equals_step_by_step(strategy):
  rng = np.random.default_rng(1)
  batches = [rng.normal(size=(16, 4)).astype(np.float32) for _ in range(6)]
  w0 = rng.normal(size=(4,)).astype(np.float32)

  def step(state, x):
    new = sgd_step(state, x)
    return new, jnp.zeros(())

  init = strategy.experimental_mirror({"w": w0, "step": np.int32(0)})
  it = iter(strategy.experimental_distribute_dataset(batches))
  state, _ = strategy.experimental_run_steps(step, it, steps=3, init=init, options=RunOptions(donate_argnums=0))
  assert init["w"].tree.is_deleted()
  with pytest.raises(RuntimeError, match=r"experimental_run_steps: an array of init .* has been deleted"):
    strategy.experimental_run_steps(step, it, steps=3, init=init)
  state, _ = strategy.experimental_run_steps(step, it, steps=3, init=state, options=RunOptions(donate_argnums=0))
  w = w0.astype(np.float64)
  for b in batches:
    w = numpy_sgd(w, b.astype(np.float64), 1)
  np.testing.assert_allclose(state["w"].values[0], w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
  assert int(state["step"].values[0]) == 6


def test_a_state_saved_then_donated_checkpoints_intact_and_restored_state_is_donatable(strategy, tmp_path):
  from tpustrat.checkpoint import CheckpointManager

  start = np.arange(300_000, dtype=np.float32)
  state = strategy.experimental_mirror({"w": start})
  donate = RunOptions(donate_argnums=0)
  with CheckpointManager(tmp_path, strategy) as manager:
    for i in range(3):
      manager.save(i, state)  # asynchronous: the next step donates the saved arrays at once
      state = strategy.run(lambda s, i=i: {"w": s["w"] * 0 + (i + 1)}, args=(state,), options=donate)
    manager.wait_until_finished()
    for i in range(3):
      got = manager.restore(i, target=strategy.experimental_mirror({"w": np.zeros_like(start)}))
      np.testing.assert_array_equal(got["w"].values[0], start if i == 0 else np.full_like(start, i))
    # A restored state can be donated: the step reuses its buffers.
    restored = manager.restore(2, target=strategy.experimental_mirror({"w": np.zeros_like(start)}))
    out = strategy.run(lambda s: {"w": s["w"] + 1.0}, args=(restored,), options=donate)
    assert restored["w"].tree.is_deleted()
    np.testing.assert_array_equal(out["w"].values[0], np.full_like(start, 3.0))


def test_many_donated_steps_whose_only_small_output_is_part_of_the_state(strategy):
  # The steps-in-flight bound waits on a small output of each step: here the step counter, which the next
  # step donates, so the bound forgets it (`InFlight.forget`). Waiting on it raised "BlockHostUntilReady()
  # called on deleted or donated buffer" in the 2-process preemptible example; here the numbers are checked
  # with steps long enough (a few 384 x 384 matmuls) to overlap.
  eye = np.eye(384, dtype=np.float32)
  state = strategy.experimental_mirror({"w": eye, "step": np.int32(0)})
  options = RunOptions(donate_argnums=0, max_steps_in_flight=2)

  def step(s):
    w = s["w"]
    for _ in range(6):
      w = w @ w  # the identity stays the identity
    return {"w": w + 0.0, "step": s["step"] + 1}

  for _ in range(12):
    state = strategy.run(step, args=(state,), options=options)
  assert int(state["step"].values[0]) == 12
  np.testing.assert_array_equal(state["w"].values[0], eye)


def test_donations_xla_cannot_make_are_errors_before_dispatch(strategy):
  w = strategy.experimental_mirror(np.ones((4, 4), np.float32))
  tied = {"enc": w, "dec": w}  # one array at two leaves of the donated state
  with pytest.raises(ValueError, match=r"args\[0\]\['dec'\] is the same array as the argument at args\[0\]\['enc'\]"):
    strategy.run(lambda s: s, args=(tied,), options=RunOptions(donate_argnums=0))
  with pytest.raises(ValueError, match=r"args\[1\] is the same array as the argument at args\[0\]"):
    strategy.run(lambda a, b: a + b, args=(w, w), options=RunOptions(donate_argnums=0))
  assert not w.tree.is_deleted()
  batch = next(iter(strategy.experimental_distribute_dataset([np.ones((16, 2), np.float32)])))
  with pytest.raises(ValueError, match=r"argument 1 holds a batch of a distributed dataset"):
    strategy.run(lambda s, b: (s, b * 2.0), args=(w, batch), options=RunOptions(donate_argnums=(0, 1)))
  it = iter(strategy.experimental_distribute_dataset([np.ones((16, 2), np.float32)] * 3))
  with pytest.raises(ValueError, match=r"only argument 0 \(init, the carry\) can be donated"):
    strategy.experimental_run_steps(lambda c, b: (c, b), it, steps=1, init=0.0,
                                    options=RunOptions(donate_argnums=(0, 1)))


def test_one_step_with_and_without_donation_and_two_donation_sets(strategy):
  def step(a, b):
    return a + 1.0, b * 2.0

  for options in (RunOptions(donate_argnums=0), None, RunOptions(donate_argnums=(0, 1)), RunOptions(donate_argnums=1)):
    a = strategy.experimental_mirror(np.zeros(3, np.float32))
    b = strategy.experimental_mirror(np.ones(3, np.float32))
    out_a, out_b = strategy.run(step, args=(a, b), options=options)
    np.testing.assert_array_equal(out_a.values[0], np.ones(3))
    np.testing.assert_array_equal(out_b.values[0], np.full(3, 2.0))


def test_donating_steps_stay_bounded_by_max_steps_in_flight(strategy):
  # Each donating program has a token of its own, so the bound counts every step: unbounded dispatch of
  # collective programs deadlocks XLA:CPU. (Waiting on the step's small state leaf instead, which the next
  # step donates, left the bound counting one step at most, and a 2-process job hung under load.)
  engine = strategy.extended.engine
  engine.wait()
  state = strategy.experimental_mirror({"w": np.zeros((8, 8), np.float32), "step": np.int32(0)})
  options = RunOptions(donate_argnums=0, max_steps_in_flight=2)
  step = lambda s: {"w": s["w"] + 1.0, "step": s["step"] + 1}  # noqa: E731
  for i in range(6):
    state = strategy.run(step, args=(state,), options=options)
    pending = list(engine.in_flight._pending)
    assert len(pending) == min(i + 1, 2)
    assert not any(t.is_deleted() for t in pending)
    assert all(t is not leaf for t in pending for leaf in jax.tree.leaves(state))
  engine.wait()
  assert int(state["step"].values[0]) == 6
