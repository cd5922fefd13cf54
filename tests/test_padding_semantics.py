"""Which rows of a step's outputs are padding: the rule behind reduce, gather and local results.

A partial global batch is padded to the usual per-replica size ``k`` (XLA needs static shapes). Padding is
skipped only where the user has said which axis is the batch: ``reduce(op, v, axis=0)``,
``gather(v, axis=0)``, or `tpustrat.per_example` inside the step. Everything else sees every replica's
component whole, as TF does: ``axis=None`` never drops data.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat
from tpustrat import Mirrored, PerReplica

N = 8


def partial_batch(strategy, rows=12, cols=3, seed=0):
  """One global batch of `rows` rows (k = ceil(rows / 8); the last replicas hold padding only)."""
  x = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
  return x, next(iter(strategy.experimental_distribute_dataset([x])))


def replica_id():
  return tpustrat.get_replica_context().replica_id_in_sync_group


def components(strategy, value):
  return [np.asarray(c) for c in strategy.experimental_local_results(value)]


def test_axis_none_sums_every_replica_component_even_when_its_shape_matches_the_batch(strategy):
  # 12 rows on 8 replicas: k = 2, replicas 6 and 7 hold only padding. Every replica returns a (2, 3)
  # statistic that is not per-example: TF sums all 8 of them.
  _, batch = partial_batch(strategy)
  out = strategy.run(lambda x: jnp.ones((2, 3)) * (replica_id() + 1), args=(batch,))
  expected = sum(np.ones((2, 3)) * (r + 1) for r in range(N))  # 36 everywhere
  np.testing.assert_array_equal(strategy.reduce("SUM", out, axis=None), expected)
  np.testing.assert_array_equal(strategy.reduce("MEAN", out, axis=None), expected / N)
  # Local results show what every replica returned.
  got = components(strategy, out)
  assert [c.shape for c in got] == [(2, 3)] * N
  for r, c in enumerate(got):
    np.testing.assert_array_equal(c, np.full((2, 3), r + 1.0))
  assert [c.shape for c in out.values] == [(2, 3)] * N


def test_axis_0_is_the_users_word_that_rows_are_the_batch(strategy):
  x, batch = partial_batch(strategy)
  out = strategy.run(lambda v: v * 2.0, args=(batch,))
  real = x * 2.0
  # reduce / gather along axis 0: only the 12 real rows, in order.
  np.testing.assert_array_equal(strategy.gather(out, axis=0), real)
  scale = np.abs(real).sum(0)
  np.testing.assert_allclose(strategy.reduce("SUM", out, axis=0), real.sum(0), rtol=1e-6, atol=1e-6 * scale.max())
  np.testing.assert_allclose(strategy.reduce("MEAN", out, axis=0), real.mean(0), rtol=1e-6, atol=1e-6 * scale.max())
  # axis=None and local results: every row every replica returned (padding rows are zeros here).
  padded = np.zeros((16, 3), np.float32)
  padded[:12] = real
  np.testing.assert_allclose(strategy.reduce("SUM", out, axis=None), padded.reshape(N, 2, 3).sum(0),
                             rtol=1e-6, atol=1e-6 * np.abs(padded).sum())
  assert [c.shape for c in components(strategy, out)] == [(2, 3)] * N
  # Another axis is not the batch: every replica's component is concatenated, as TF does.
  np.testing.assert_array_equal(strategy.gather(out, axis=1),
                                np.concatenate(list(padded.reshape(N, 2, 3)), axis=1))


def test_axis_0_of_an_output_whose_rows_are_not_the_batchs_keeps_every_row(strategy):
  _, batch = partial_batch(strategy)
  out = strategy.run(lambda v: jnp.ones((5,)) * (replica_id() + 1.0), args=(batch,))
  np.testing.assert_array_equal(strategy.gather(out, axis=0), np.repeat(np.arange(1.0, N + 1), 5))
  np.testing.assert_array_equal(strategy.reduce("SUM", out, axis=0), 5 * np.arange(1.0, N + 1).sum())


def test_per_example_marks_an_output_whose_rows_are_the_batchs(strategy):
  x, batch = partial_batch(strategy)

  def step(v):
    stat = jnp.ones((2, 3)) * (replica_id() + 1)
    return tpustrat.per_example(v * 2.0), stat

  out, stat = strategy.run(step, args=(batch,))
  real = x * 2.0
  assert repr(out) == "PerReplica(num_replicas=8, component=float32[2, 3], padded)"
  assert repr(stat) == "PerReplica(num_replicas=8, component=float32[2, 3], axis 0: a padded batch's rows)"
  # Marked: local results hold only the real rows, and axis=None leaves padding out.
  got = components(strategy, out)
  assert [c.shape for c in got] == [(2, 3)] * 6 + [(0, 3)] * 2
  np.testing.assert_array_equal(np.concatenate(got), real)
  counts = np.array([2] * 6 + [0] * 2)
  comps = np.zeros((N, 2, 3), np.float32)
  comps[:6] = real.reshape(6, 2, 3)
  np.testing.assert_allclose(strategy.reduce("SUM", out, axis=None), comps.sum(0),
                             rtol=1e-6, atol=1e-6 * np.abs(real).sum())
  np.testing.assert_allclose(strategy.reduce("MEAN", out, axis=None), comps.sum(0) / (counts > 0).sum(),
                             rtol=1e-6, atol=1e-6 * np.abs(real).sum())
  # The unmarked statistic of the same step is still whole.
  np.testing.assert_array_equal(strategy.reduce("SUM", stat, axis=None), np.full((2, 3), 36.0))


def test_per_example_accepts_a_pytree_and_is_the_identity_outside_run(strategy):
  tree = {"a": np.arange(3.0), "b": np.ones((3, 2))}
  assert tpustrat.per_example(tree) is tree
  x, batch = partial_batch(strategy)
  out = strategy.run(lambda v: tpustrat.per_example({"y": v + 1.0, "s": jnp.sum(v, axis=1)}), args=(batch,))
  np.testing.assert_array_equal(np.concatenate(components(strategy, out["y"])), x + 1.0)
  assert [c.shape for c in components(strategy, out["s"])] == [(2,)] * 6 + [(0,)] * 2


def test_per_example_needs_the_batchs_leading_size(strategy):
  _, batch = partial_batch(strategy)
  with pytest.raises(ValueError, match=r"per_example.*leading size 3.*\[2\]"):
    strategy.run(lambda v: tpustrat.per_example(jnp.ones((3,)) * v[0, 0]), args=(batch,))
  with pytest.raises(ValueError, match=r"per_example.*scalar"):
    strategy.run(lambda v: tpustrat.per_example(v[0, 0]), args=(batch,))


def test_per_example_of_a_value_equal_on_every_replica_is_an_error(strategy):
  _, batch = partial_batch(strategy)
  with pytest.raises(ValueError, match=r"per_example.*same on every replica"):
    strategy.run(lambda v: tpustrat.per_example(
        tpustrat.get_replica_context().all_reduce("sum", v)), args=(batch,))


def test_per_example_without_a_padded_batch_changes_nothing(strategy):
  batch = strategy.experimental_distribute_values_from_function(lambda ctx: np.full((2,), ctx.replica_id_in_sync_group,
                                                                                  np.float32))
  out = strategy.run(lambda v: tpustrat.per_example(v * 2.0), args=(batch,))
  assert [c.tolist() for c in components(strategy, out)] == [[2.0 * r] * 2 for r in range(N)]


def test_marked_outputs_carry_their_padding_into_the_next_run_and_unmarked_ones_do_not(strategy):
  x, batch = partial_batch(strategy)
  marked = strategy.run(lambda v: tpustrat.per_example(v * 3.0), args=(batch,))
  plain = strategy.run(lambda v: v * 3.0, args=(batch,))
  n_marked = strategy.run(lambda v: tpustrat.num_valid_examples(v), args=(marked,))
  assert [int(c) for c in n_marked.values] == [2] * 6 + [0] * 2
  n_plain = strategy.run(lambda v: tpustrat.num_valid_examples(v), args=(plain,))
  assert [int(c) for c in n_plain.values] == [2] * N  # not a padded batch: every row counts


def test_per_example_under_experimental_run_steps(strategy):
  xs = [np.arange(16.0, dtype=np.float32).reshape(16, 1), np.arange(12.0, dtype=np.float32).reshape(12, 1)]
  it = iter(strategy.experimental_distribute_dataset(xs))

  def step(carry, batch):
    return carry, (tpustrat.per_example(batch * 2.0), jnp.ones((2, 1)))

  _, (marked, stat) = strategy.experimental_run_steps(step, it, steps=2, init=jnp.zeros(()))
  steps = tpustrat.unstack_steps(marked)
  np.testing.assert_array_equal(np.concatenate(components(strategy, steps[1])), xs[1] * 2.0)
  # The unmarked output: every replica's rows in every step.
  stat_steps = tpustrat.unstack_steps(stat)
  np.testing.assert_array_equal(strategy.reduce("SUM", stat_steps[1], axis=None), np.full((2, 1), 8.0))


def test_mirrored_with_different_components_is_an_error():
  a, b = np.arange(3.0), np.arange(3.0) + 1
  with pytest.raises(ValueError, match=r"Mirrored.*component 1.*differs"):
    Mirrored([a, b])
  with pytest.raises(ValueError, match=r"Mirrored.*component 1"):
    Mirrored([a, np.arange(4.0)])
  m = Mirrored([a, a.copy()])
  np.testing.assert_array_equal(m.values[0], a)


def test_public_submodules_need_no_import():
  import os
  import subprocess
  import sys
  code = ("import tpustrat\n"
          "for name in ('ops', 'cluster_resolver', 'checkpoint'):\n"
          "  assert hasattr(tpustrat, name), name\n"
          "assert callable(tpustrat.ops.cross_replica_sum)\n")
  subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_per_replica_values_built_by_hand_are_whole(strategy):
  v = PerReplica([np.full((2,), r, np.float32) for r in range(N)])
  np.testing.assert_array_equal(strategy.reduce("SUM", v, axis=None), np.full((2,), sum(range(N))))
