"""Which rows of a step's outputs are padding: the rule behind reduce, gather and local results.

A partial global batch is padded to the usual per-replica size ``k`` (XLA needs static shapes). Padding is
skipped where a value's rows are known to be the batch's: along axis 0 of an output whose axis 0 the
step's program shows to hold a batch's rows (``reduce(op, v, axis=0)``, ``gather(v, axis=0)``, and its
local results, which hold each replica's real rows as TF's replicas did), and everywhere for
`tpustrat.per_example` outputs. Everything else sees every replica's component whole, as TF does:
``axis=None`` of an unmarked output never drops data, and a size that merely equals ``k`` means nothing.
"""

import jax
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


def test_axis_0_of_an_output_traced_to_the_batch_holds_its_real_rows(strategy):
  x, batch = partial_batch(strategy)
  out = strategy.run(lambda v: v * 2.0, args=(batch,))
  real = x * 2.0
  # reduce / gather along axis 0: only the 12 real rows, in order.
  np.testing.assert_array_equal(strategy.gather(out, axis=0), real)
  scale = np.abs(real).sum(0)
  np.testing.assert_allclose(strategy.reduce("SUM", out, axis=0), real.sum(0), rtol=1e-6, atol=1e-6 * scale.max())
  np.testing.assert_allclose(strategy.reduce("MEAN", out, axis=0), real.mean(0), rtol=1e-6, atol=1e-6 * scale.max())
  # axis=None: every row every replica returned (the padding rows are copies of the batch's first row,
  # InputOptions.experimental_padding).
  padded = np.zeros((16, 3), np.float32)
  padded[:12], padded[12:] = real, real[0]
  np.testing.assert_allclose(strategy.reduce("SUM", out, axis=None), padded.reshape(N, 2, 3).sum(0),
                             rtol=1e-6, atol=1e-6 * np.abs(padded).sum())
  # Local results: each replica's real rows, as TF's replicas returned them (none on replicas 6 and 7).
  got = components(strategy, out)
  assert [c.shape for c in got] == [(2, 3)] * 6 + [(0, 3)] * 2
  np.testing.assert_array_equal(np.concatenate(got), real)
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
  # The statistic has k = 2 rows too, but its rows are not the batch's (the step's program shows it):
  # nothing about padding follows it, not even along axis 0.
  assert repr(stat) == "PerReplica(num_replicas=8, component=float32[2, 3])"
  np.testing.assert_array_equal(strategy.gather(stat, axis=0),
                                np.concatenate([np.full((2, 3), r + 1.0) for r in range(N)]))
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


@pytest.mark.processes
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


# -- local results: what each replica held ----------------------------------------------------------


def log_softmax(z):
  z = z - z.max(axis=1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def test_model_gardens_host_side_evaluation_counts_the_real_examples(strategy):
  # TF Model Garden's `_run_evaluation` (official/legacy/bert/model_training_utils.py), as written: the step
  # returns its logits and the labels it was given, unmarked; the host takes each replica's local results,
  # skips a replica with no rows, weighs each replica's mean loss by its row count and counts the correct
  # predictions. TF's replicas hold only their real rows, so it sees the 300 examples: 4 batches of 64 and
  # one of 44 (k = 8: replica 5 holds 4 real rows, replicas 6 and 7 none).
  rng = np.random.default_rng(44)
  x = rng.normal(size=(300, 5)).astype(np.float32)
  y = rng.integers(0, 3, size=300).astype(np.int32)
  w = rng.normal(size=(5, 3)).astype(np.float32)
  b = rng.normal(size=(3,)).astype(np.float32)
  ds = strategy.experimental_make_numpy_dataset({"x": x, "y": y}).batch(64)

  def test_step(batch, w, b):
    return batch["x"] @ w + b, batch["y"]

  losses, weights, correct, seen = [], [], 0, []
  for batch in strategy.experimental_distribute_dataset(ds):
    logits, labels = strategy.run(test_step, args=(batch, w, b))
    for cur_logits, cur_labels in zip(strategy.experimental_local_results(logits),
                                      strategy.experimental_local_results(labels)):
      cur_logits, cur_labels = np.asarray(cur_logits), np.asarray(cur_labels)
      assert cur_logits.shape[0] == cur_labels.shape[0]
      if cur_labels.shape[0]:
        losses.append(-log_softmax(cur_logits)[np.arange(len(cur_labels)), cur_labels].mean())
        weights.append(cur_labels.shape[0])
        correct += int((cur_logits.argmax(axis=1) == cur_labels).sum())
      seen.append(cur_labels)
    # `.values` is the same per-replica view.
    assert [len(c) for c in labels.values] == [len(c) for c in strategy.experimental_local_results(labels)]
  # numpy on the 300 examples
  want_logits = x.astype(np.float64) @ w + b
  want_loss = -log_softmax(want_logits)[np.arange(300), y].mean()
  assert sum(weights) == 300
  np.testing.assert_array_equal(np.concatenate(seen), y)  # every example once, in order
  np.testing.assert_allclose(np.average(losses, weights=weights), want_loss, rtol=1e-5)
  assert correct == int((want_logits.argmax(axis=1) == y).sum())


def test_local_results_of_an_output_traced_to_the_batch_hold_the_real_rows(strategy):
  x, batch = partial_batch(strategy, rows=13, cols=3)  # k = 2: replica 6 holds 1 real row, replica 7 none

  def step(v):
    stat = jnp.ones((2, 3)) * (replica_id() + 1)  # k rows, not the batch's
    return v * 2.0, jnp.cumsum(v, axis=0)[:, 0], stat

  rows, running, stat = strategy.run(step, args=(batch,))
  want = [x[2 * r:2 * r + 2] for r in range(N)]  # replica r's real rows
  got = components(strategy, rows)
  assert [c.shape for c in got] == [(2, 3)] * 6 + [(1, 3), (0, 3)]
  for g, real in zip(got, want):
    np.testing.assert_array_equal(g, real * 2.0)
  assert [c.shape for c in (np.asarray(v) for v in rows.values)] == [c.shape for c in got]
  for g, real in zip(components(strategy, running), want):  # row i of a running sum is example i's
    np.testing.assert_allclose(g, np.cumsum(real, axis=0)[:, 0], rtol=1e-6, atol=1e-6)
  # A per-replica statistic that merely has k rows is whole, as every replica returned it.
  assert [c.tolist() for c in components(strategy, stat)] == [np.full((2, 3), r + 1.0).tolist() for r in range(N)]
  # A pytree of outputs: each leaf by its own rows.
  tree = strategy.experimental_local_results({"rows": rows, "stat": stat})
  assert [(t["rows"].shape, t["stat"].shape) for t in tree] == [((2, 3), (2, 3))] * 6 + [((1, 3), (2, 3)),
                                                                                          ((0, 3), (2, 3))]
  # Under experimental_run_steps: each step's local results hold that step's real rows.
  xs = [np.arange(16.0, dtype=np.float32).reshape(16, 1), np.arange(12.0, dtype=np.float32).reshape(12, 1)]
  it = iter(strategy.experimental_distribute_dataset(xs))
  _, doubled = strategy.experimental_run_steps(lambda c, v: (c, v * 2.0), it, steps=2, init=jnp.zeros(()))
  for step, host_x in zip(tpustrat.unstack_steps(doubled), xs):
    got = components(strategy, step)
    assert [len(c) for c in got] == [len(host_x[2 * r:2 * r + 2]) for r in range(N)]
    np.testing.assert_array_equal(np.concatenate(got), host_x * 2.0)


# -- several batches in one step: each keeps its own counts --------------------------------------------


def two_batches(strategy, rows_a=16, rows_b=12, cols=3):
  """Batch A (16 rows: k = 2, all real) and batch B (12 rows: k = 2, replicas 6 and 7 padding only), each
  from its own distributed dataset."""
  rng = np.random.default_rng(1)
  a = rng.normal(size=(rows_a, cols)).astype(np.float32)
  b = rng.normal(size=(rows_b, cols)).astype(np.float32)
  return a, b, (next(iter(strategy.experimental_distribute_dataset([a]))),
                next(iter(strategy.experimental_distribute_dataset([b]))))


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_two_batches_of_one_size_keep_their_own_padding(strategy, order):
  a, b, (da, db) = two_batches(strategy)
  x, y = (da, db) if order == "ab" else (db, da)
  host_x, host_y = (a, b) if order == "ab" else (b, a)

  def step(x, y):
    return (tpustrat.num_valid_examples(x)[None], tpustrat.num_valid_examples(y)[None],
            jnp.sum(tpustrat.valid_mask(y)).astype(jnp.int32)[None],
            tpustrat.per_example(x * 2.0), tpustrat.per_example(y * 3.0), x.sum(axis=1), y.sum(axis=1))

  nx, ny, my, px, py, sx, sy = strategy.run(step, args=(x, y))
  assert int(strategy.reduce("SUM", nx, axis=None)[0]) == len(host_x)
  assert int(strategy.reduce("SUM", ny, axis=None)[0]) == len(host_y)
  assert int(strategy.reduce("SUM", my, axis=None)[0]) == len(host_y)
  np.testing.assert_array_equal(strategy.gather(px, axis=0), host_x * 2.0)
  np.testing.assert_array_equal(strategy.gather(py, axis=0), host_y * 3.0)
  # Unmarked outputs traced to their batch: axis 0 skips that batch's padding, and only that batch's.
  np.testing.assert_allclose(strategy.gather(sx, axis=0), host_x.sum(axis=1), rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(strategy.gather(sy, axis=0), host_y.sum(axis=1), rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(strategy.reduce("MEAN", sy, axis=0), host_y.sum(axis=1).mean(), rtol=1e-5,
                             atol=1e-5 * np.abs(host_y).sum())


def test_a_per_example_output_fed_back_beside_a_fresh_batch_keeps_its_counts(strategy):
  a, b, (da, db) = two_batches(strategy)
  marked = strategy.run(lambda v: tpustrat.per_example(v * 1.0), args=(db,))  # 12 rows of B

  def step(prev, fresh):
    return (tpustrat.num_valid_examples(prev)[None], tpustrat.num_valid_examples(fresh)[None],
            tpustrat.per_example(prev + 1.0), tpustrat.per_example(fresh - 1.0))

  n_prev, n_fresh, p, f = strategy.run(step, args=(marked, da))
  assert int(strategy.reduce("SUM", n_prev, axis=None)[0]) == 12
  assert int(strategy.reduce("SUM", n_fresh, axis=None)[0]) == 16
  np.testing.assert_array_equal(strategy.gather(p, axis=0), b + 1.0)
  np.testing.assert_array_equal(strategy.gather(f, axis=0), a - 1.0)


def test_the_leaves_of_one_dataset_element_are_one_batch(strategy):
  x = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
  y = np.arange(12, dtype=np.int32)
  batch = next(iter(strategy.experimental_distribute_dataset([{"x": x, "y": y}])))
  # valid_mask() without an argument: one batch, although it reaches run as two PerReplica leaves.
  out = strategy.run(lambda b: jnp.sum(tpustrat.valid_mask()).astype(jnp.int32)[None], args=(batch,))
  assert int(strategy.reduce("SUM", out, axis=None)[0]) == 12
  # An output computed from both leaves holds the rows of that one batch.
  combined = strategy.run(lambda b: b["x"].sum(axis=1) + b["y"], args=(batch,))
  np.testing.assert_allclose(strategy.gather(combined, axis=0), x.sum(axis=1) + y, rtol=1e-6)


def test_which_batch_cannot_be_told_from_a_size_shared_by_two_batches(strategy):
  _, b, (da, db) = two_batches(strategy)
  with pytest.raises(ValueError, match=r"valid_mask\(x\).*several padded batches.*size 2"):
    strategy.run(lambda x, y: tpustrat.valid_mask(jnp.zeros((2,))), args=(da, db))
  with pytest.raises(ValueError, match=r"valid_mask\(\) without an argument.*found 2"):
    strategy.run(lambda x, y: tpustrat.valid_mask(), args=(da, db))
  # A marked output that combines the rows of both batches: per_example needs to be told whose rows.
  with pytest.raises(ValueError, match=r"per_example: the output at <root>.*cannot be traced.*batch="):
    strategy.run(lambda x, y: tpustrat.per_example(x + y), args=(da, db))
  out = strategy.run(lambda x, y: tpustrat.per_example(x + y, batch=y), args=(da, db))
  assert [c.shape[0] for c in out.values] == [2] * 6 + [0] * 2
  with pytest.raises(ValueError, match=r"per_example\(tree, batch=...\).*not one of the padded batches"):
    strategy.run(lambda x, y: tpustrat.per_example(x + y, batch=jnp.zeros((2, 3))), args=(da, db))
  assert b.shape == (12, 3)


# -- a shape coincidence is not a batch's rows -------------------------------------------------------


def test_a_statistic_with_the_batchs_size_is_whole_along_axis_0(strategy):
  x, batch = partial_batch(strategy)  # k = 2; replicas 6 and 7 hold padding only

  def step(v):
    stat = jnp.stack([jnp.sum(v), jnp.max(v)])  # a per-replica [2] statistic, not per-example
    return stat, v.mean(axis=0)[:2]

  with pytest.warns(tpustrat.PaddingReadWarning, match="sum over the rows"):  # true: it reads padding rows
    stat, firsts = strategy.run(step, args=(batch,))
  padded = np.zeros((16, 3), np.float32)
  padded[:12], padded[12:] = x, x[0]  # padding: the batch's first row
  comps = padded.reshape(N, 2, 3)
  want = np.concatenate([np.stack([c.sum(), c.max()]) for c in comps])
  np.testing.assert_allclose(strategy.gather(stat, axis=0), want, rtol=1e-6, atol=1e-5)
  np.testing.assert_allclose(strategy.reduce("SUM", stat, axis=0), want.sum(), rtol=1e-5,
                             atol=1e-5 * np.abs(want).sum())
  np.testing.assert_allclose(strategy.gather(firsts, axis=0), np.concatenate([c.mean(0)[:2] for c in comps]),
                             rtol=1e-6, atol=1e-6)
  # Rows reordered along axis 0 (a sort, a flip) are not followed: run says so, once per program.
  with pytest.warns(tpustrat.BatchRowsWarning, match=r"`sort`, whose effect on axis 0 is not traced"):
    strategy.run(lambda v: jnp.sort(v, axis=0), args=(batch,))


def test_rows_are_traced_through_a_model(strategy):
  x, batch = partial_batch(strategy, rows=13, cols=4)  # k = 2
  w1 = np.random.default_rng(3).normal(size=(4, 5)).astype(np.float32)
  w2 = np.random.default_rng(4).normal(size=(5, 3)).astype(np.float32)

  def step(v, w1, w2):
    h = jax.nn.relu(v @ w1)
    logits = jax.nn.log_softmax(jnp.transpose(h.reshape(2, 5, 1), (0, 2, 1))[:, 0] @ w2, axis=-1)
    return jax.jit(lambda z: z * 1.0)(logits), jax.lax.stop_gradient(logits).argmax(axis=1)

  logits, labels = strategy.run(step, args=(batch, w1, w2))
  h = np.maximum(x @ w1, 0) @ w2
  want = h - np.log(np.exp(h - h.max(1, keepdims=True)).sum(1, keepdims=True)) - h.max(1, keepdims=True)
  np.testing.assert_allclose(strategy.gather(logits, axis=0), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  np.testing.assert_array_equal(strategy.gather(labels, axis=0), want.argmax(axis=1))


def test_rows_through_an_untraced_operation_warn_and_say_what_happens(strategy):
  x, batch = partial_batch(strategy)

  def step(v):
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] + 1.0, c[1] + 1), (v[:, 0], 0))[0]

  with pytest.warns(tpustrat.BatchRowsWarning,
                    match=r"output at <root>.*`while`.*experimental_local_results will skip the padding.*per_example"):
    out = strategy.run(step, args=(batch,))
  np.testing.assert_allclose(strategy.gather(out, axis=0), x[:, 0] + 3.0, rtol=1e-6)
  np.testing.assert_allclose(np.concatenate(components(strategy, out)), x[:, 0] + 3.0, rtol=1e-6)


def test_run_steps_keeps_one_batch_per_dataset_element(strategy):
  x = np.arange(20 * 3, dtype=np.float32).reshape(20, 3)
  y = np.arange(20, dtype=np.int32)
  it = iter(strategy.experimental_distribute_dataset(
      tpustrat.experimental_make_numpy_dataset({"x": x, "y": y}).batch(16)
      if hasattr(tpustrat, "experimental_make_numpy_dataset")
      else strategy.experimental_make_numpy_dataset({"x": x, "y": y}).batch(16)))

  def step(total, b):
    n = tpustrat.get_replica_context().all_reduce("sum", jnp.sum(tpustrat.valid_mask()).astype(jnp.int32))
    return total + n, tpustrat.per_example(b["x"].sum(axis=1) + b["y"])

  total, outs = strategy.experimental_run_steps(step, it, steps=2, init=jnp.int32(0))
  assert int(np.asarray(total.values[0] if isinstance(total, Mirrored) else total)) == 20
  got = [strategy.gather(o, axis=0) for o in tpustrat.unstack_steps(outs)]
  np.testing.assert_allclose(np.concatenate(got), x.sum(axis=1) + y, rtol=1e-6)


def test_run_inside_jit_keeps_one_batch_per_dataset_element_and_datasets_apart(strategy):
  a, b, (da, db) = two_batches(strategy)
  y = np.arange(12, dtype=np.int32)
  element = next(iter(strategy.experimental_distribute_dataset([{"x": b, "y": y}])))

  @jax.jit
  def outer(e, other):
    def step(e, other):
      n = tpustrat.num_valid_examples(e["x"])
      return n[None], tpustrat.num_valid_examples(other)[None], tpustrat.per_example(e["x"].sum(1) + e["y"])
    return strategy.run(step, args=(e, other))

  n_e, n_other, rows = outer(element, da)
  assert int(strategy.reduce("SUM", n_e, axis=None)[0]) == 12
  assert int(strategy.reduce("SUM", n_other, axis=None)[0]) == 16
  np.testing.assert_allclose(strategy.gather(rows, axis=0), b.sum(1) + y, rtol=1e-6)

  @jax.jit
  def no_argument(e):
    return strategy.run(lambda e: jnp.sum(tpustrat.valid_mask()).astype(jnp.int32)[None], args=(e,))

  assert int(strategy.reduce("SUM", no_argument(element), axis=None)[0]) == 12


def test_two_elements_of_one_dataset_are_two_batches_eagerly_in_jit_and_in_run_steps(strategy):
  rng = np.random.default_rng(7)
  a = rng.normal(size=(16, 3)).astype(np.float32)
  b = rng.normal(size=(12, 3)).astype(np.float32)
  first, second = list(strategy.experimental_distribute_dataset([a, b]))

  def step(x, y):
    return tpustrat.num_valid_examples(x)[None], tpustrat.num_valid_examples(y)[None], y * 2.0

  for runner in (lambda x, y: strategy.run(step, args=(x, y)), jax.jit(lambda x, y: strategy.run(step, args=(x, y)))):
    for (x, y), (hx, hy) in (((first, second), (a, b)), ((second, first), (b, a))):
      nx, ny, y2 = runner(x, y)
      assert int(strategy.reduce("SUM", nx, axis=None)[0]) == len(hx)
      assert int(strategy.reduce("SUM", ny, axis=None)[0]) == len(hy)
      np.testing.assert_array_equal(strategy.gather(y2, axis=0), hy * 2.0)

  # Pairs of elements of one dataset, stacked as steps: each element keeps its own counts in the scan.
  pairs = iter([(first, second)])
  _, (nx, ny, _) = strategy.experimental_run_steps(lambda c, xy: (c, step(*xy)), pairs, steps=1, init=jnp.int32(0))
  assert int(strategy.reduce("SUM", tpustrat.unstack_steps(nx)[0], axis=None)[0]) == 16
  assert int(strategy.reduce("SUM", tpustrat.unstack_steps(ny)[0], axis=None)[0]) == 12


def test_a_new_dataset_of_the_same_kind_compiles_nothing_new_in_a_users_jit(strategy):
  traces = []

  @jax.jit
  def outer(batch):
    traces.append(1)
    return strategy.run(lambda b: tpustrat.per_example({"x": b["x"] + 1.0}), args=(batch,))

  for epoch in range(3):  # a new distributed dataset per epoch, same shapes
    x = np.full((12, 3), epoch, np.float32)
    out = outer(next(iter(strategy.experimental_distribute_dataset([{"x": x}]))))
    np.testing.assert_array_equal(strategy.gather(out["x"], axis=0), x + 1.0)
  assert len(traces) == 1


@pytest.mark.parametrize("name,fn,want", [
    # Rows that leave axis 0 and come back are followed...
    ("transpose round trip", lambda v, w: (w @ v.T).T, lambda x, w: (w @ x.T).T),
    ("lax.map per example", lambda v, w: jax.lax.map(lambda r: r @ w.T, v), lambda x, w: x @ w.T),
    ("time-major scan", lambda v, w: jax.lax.scan(lambda c, r: (c, r * 2.0), 0.0, v.T)[1].T,
     lambda x, w: x * 2.0),
    ("running sum along the rows", lambda v, w: jnp.cumsum(v, axis=0), lambda x, w: None),
    # ... and rows moved to another axis are not axis 0's.
    ("stacked on a new axis 0", lambda v, w: jnp.stack([v[:, 0], v[:, 1]], axis=0), lambda x, w: None),
])
def test_rows_are_followed_where_they_go(strategy, name, fn, want):
  x, batch = partial_batch(strategy, rows=12, cols=3)
  w = np.random.default_rng(5).normal(size=(3, 3)).astype(np.float32)
  out = strategy.run(fn, args=(batch, w))
  got = np.asarray(strategy.gather(out, axis=0))
  padded = np.zeros((16, 3), np.float32)
  padded[:12], padded[12:] = x, x[0]  # padding: the batch's first row
  if name == "running sum along the rows":  # row i of the running sum is example i's: padding skipped
    comps = [np.cumsum(c, axis=0) for c in padded.reshape(N, 2, 3)]
    np.testing.assert_allclose(got, np.concatenate(comps)[:12], rtol=1e-6, atol=1e-6)
  elif name == "stacked on a new axis 0":  # axis 0 is the stack: every replica's [2, 2] kept whole
    comps = [np.stack([c[:, 0], c[:, 1]]) for c in padded.reshape(N, 2, 3)]
    np.testing.assert_array_equal(got, np.concatenate(comps))
  else:
    np.testing.assert_allclose(got, want(x, w), rtol=1e-5, atol=1e-5 * np.abs(x).sum())


def test_real_row_counts_mapped_to_floats_over_the_whole_batch_are_refused(strategy):
  """`jax.tree.map` over a distributed batch maps its real-row counts too (a leaf of its pytree): made
  floats, they would mask the wrong rows, so `run` refuses them when the step is traced, naming them. The
  same transformation inside the step gives numpy's masked sum."""
  x, batch = partial_batch(strategy, rows=13)

  def masked_sum(v):
    return jnp.where(tpustrat.valid_mask(v)[:, None], v, 0.0).sum(axis=0)

  scaled = jax.tree.map(lambda a: a / 255.0, batch)
  with pytest.raises(ValueError, match=r"real-row counts of float32\[8\], not the int32\[8\].*jax\.tree\.map"):
    strategy.run(masked_sum, args=(scaled,))
  out = strategy.run(lambda v: masked_sum(v / 255.0), args=(batch,))
  np.testing.assert_allclose(strategy.reduce("SUM", out, axis=None), (x / 255.0).sum(axis=0), rtol=1e-5,
                             atol=1e-6 * np.abs(x / 255.0).sum())


def test_host_reads_of_a_value_whose_counts_a_map_changed_are_refused(strategy):
  """On the host too (`gather`, `reduce` along the rows, the local results), real-row counts that a map over
  the whole value changed (made floats, or integers past the rows a replica holds) are refused, naming
  them; the value as the dataset made it gives numpy's sums over the real rows."""
  x, batch = partial_batch(strategy, rows=13)
  np.testing.assert_allclose(strategy.reduce("SUM", batch, axis=0), x.sum(axis=0), rtol=1e-5,
                             atol=1e-6 * np.abs(x).sum())
  assert np.asarray(strategy.gather(batch, axis=0)).shape == x.shape
  gather, local = (lambda v: strategy.gather(v, axis=0)), strategy.experimental_local_results
  reduce = lambda v: strategy.reduce("SUM", v, axis=0)  # noqa: E731  # masks on the devices: the counts' type
  # Made floats: refused by every reader. Integers doubled (past the 2 rows a replica holds): by the readers
  # that read the counts on the host (a reduction masks on the devices and is not made to wait for them).
  for mapped, readers in ((jax.tree.map(lambda a: a / 255.0, batch), (gather, local, reduce)),
                          (jax.tree.map(lambda a: a * 2, batch), (gather, local))):
    for read in readers:
      with pytest.raises(ValueError, match=r"carries real-row counts .* not integers between 0 and the"):
        read(mapped)


def test_experimental_mirror_of_a_padded_batch_keeps_its_padding_skipped(strategy):
  """`strategy.experimental_mirror` places a padded batch's arrays and its real-row counts: a masked sum,
  a reduction along the batch and the local results still see the 12 real rows only (numpy), as the batch
  did before (the counts were dropped: the masked sum read the 4 padding rows, and so did the reduction)."""
  x, batch = partial_batch(strategy)  # 12 real rows of a global batch of 16: 4 padding rows
  placed = strategy.experimental_mirror(batch)
  for value in (batch, placed):
    masked = strategy.run(
        lambda b: tpustrat.get_replica_context().all_reduce(
            "sum", jnp.sum(jnp.where(tpustrat.valid_mask(b)[:, None], b, 0.0))), args=(value,))
    np.testing.assert_allclose(np.asarray(masked), x.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(strategy.reduce("SUM", value, axis=0)), x.sum(0), rtol=1e-5)
    np.testing.assert_array_equal(np.concatenate(components(strategy, value)), x)
