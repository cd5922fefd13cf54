"""tpustrat.embedding, issue 25: sequence features, one exchange for all tables, deduplicated ids, bounded
buckets, and sparse in-place updates, each against a dense numpy reference.

* Sequence features (`max_sequence_length > 0`): ``[b, L, D]`` activations, no combiner, ids truncated or
  padded with -1 (zero rows, no update), gradients per position; mixed with combined features, one of
  them on the same table.
* The compiled step holds as many all-to-alls with 8 tables (two widths) as with 1; with
  ``max_unique_ids_per_partition`` the exchanged buckets are that size (bytes read from the HLO), and a
  duplicate id travels once (the bucket's filled slots are the distinct ids).
* A bound that is exceeded fails the step with an error naming the table and the bound (on the host:
  `check_ids`; inside `run`: a host callback); a bound that is met drops nothing.
* Updates read and write only the touched rows: with the state donated the compiled step's temporaries
  are below one ``[ceil(V/N), D]`` block, and the block is aliased to its result; lazy Adam leaves the
  untouched rows and moments alone, non-lazy Adam moves them (TF's rule), both against numpy.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import tpustrat
from tpustrat import embedding as E

V = 37
N = 8


def _ids_per_replica(strategy, x):
  """`x` [N * b, ...] (or a dict of them) split over the replicas in order."""
  n = strategy.num_replicas_in_sync
  b = len(next(iter(x.values())) if isinstance(x, dict) else x) // n
  return strategy.experimental_distribute_values_from_function(
      lambda ctx: jax.tree.map(lambda a: a[ctx.replica_id_in_sync_group * b:(ctx.replica_id_in_sync_group + 1) * b], x))


def _gathered(strategy, value):
  return np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(value)])


def _rows(table_init):
  return lambda shape, dtype: jnp.asarray(table_init, dtype)


# -- sequence features -----------------------------------------------------------------------------------


SEQ_L = 5


def _sequence_model(strategy, init_a, init_b, optimizer):
  a = E.TableConfig(V, 3, initializer=_rows(init_a), combiner="sum", name="a")
  b = E.TableConfig(V, 2, initializer=_rows(init_b), combiner="mean", name="b")
  features = {
      "long": E.FeatureConfig(a, max_sequence_length=SEQ_L, name="long"),  # ids [., 7]: truncated to 5
      "short": E.FeatureConfig(a, max_sequence_length=SEQ_L, name="short"),  # ids [., 3]: padded to 5
      "bag": E.FeatureConfig(a, name="bag"),  # combined, on the same table as the sequences
      "other": E.FeatureConfig(b, name="other"),
  }
  return E.TPUEmbedding(features, optimizer, strategy)


def _np_sequence(table, ids, weights=None):
  """[B, L, D] of a sequence feature: row of ids[i, j] (times its weight) for j < L, zero for -1."""
  out = np.zeros((len(ids), SEQ_L, table.shape[1]))
  for i in range(len(ids)):
    for j in range(min(SEQ_L, ids.shape[1])):
      if ids[i, j] >= 0:
        out[i, j] = table[ids[i, j]] * (1.0 if weights is None else weights[i, j])
  return out


def _np_combined(table, ids, combiner):
  out = np.zeros((len(ids), table.shape[1]))
  for i in range(len(ids)):
    valid = [x for x in ids[i] if x >= 0]
    for x in valid:
      out[i] += table[x] / (len(valid) if combiner == "mean" else 1.0)
  return out


def _np_sgd(tables, batch, grads, lr):
  """SGD on the summed per-row gradients of every feature (duplicates and positions add up)."""
  new = {k: v.astype(np.float64).copy() for k, v in tables.items()}
  summed = {k: np.zeros_like(v) for k, v in new.items()}
  for i in range(len(batch["long"])):
    for f in ("long", "short"):
      for j in range(min(SEQ_L, batch[f].shape[1])):
        if batch[f][i, j] >= 0:
          summed["a"][batch[f][i, j]] += grads[f][i, j]
    for x in batch["bag"][i]:
      if x >= 0:
        summed["a"][x] += grads["bag"][i]
    valid = [x for x in batch["other"][i] if x >= 0]
    for x in valid:
      summed["b"][x] += grads["other"][i] / len(valid)
  return {k: new[k] - lr * summed[k] for k in new}


def _sequence_batch(rng, b_total):
  long = rng.integers(0, V, (b_total, 7)).astype(np.int32)
  long[rng.random(long.shape) < 0.3] = -1
  long[0] = [4, 4, -1, 4, 36, 9, 9]  # duplicates, padding in the middle, ids beyond L=5
  short = rng.integers(0, V, (b_total, 3)).astype(np.int32)
  short[1] = -1  # an empty sequence
  bag = rng.integers(0, V, (b_total, 2)).astype(np.int32)
  bag[2] = [4, -1]
  other = rng.integers(0, V, (b_total, 3)).astype(np.int32)
  other[3] = -1
  return {"long": long, "short": short, "bag": bag, "other": other}


@pytest.mark.parametrize("n", (8, 2))
def test_sequence_features_match_numpy_per_position(strategy, n):
  s = strategy if n == 8 else tpustrat.MirroredStrategy(jax.devices()[:n])
  rng = np.random.default_rng(0)
  init = {"a": rng.standard_normal((V, 3)).astype(np.float32), "b": rng.standard_normal((V, 2)).astype(np.float32)}
  emb = _sequence_model(s, init["a"], init["b"], E.SGD(0.1))
  b_total = 16
  dims = {"long": (SEQ_L, 3), "short": (SEQ_L, 3), "bag": (3,), "other": (2,)}

  def step(state, batch, grads):
    acts = emb.lookup(state, batch)
    return emb.apply_gradients(state, batch, grads), acts

  state = emb.build()
  tables = {k: v.astype(np.float64) for k, v in init.items()}
  for t in range(3):
    batch = _sequence_batch(rng, b_total)
    grads = {f: rng.standard_normal((b_total,) + d).astype(np.float32) for f, d in dims.items()}
    state, acts = s.run(step, args=(state, _ids_per_replica(s, batch), _ids_per_replica(s, grads)))
    got = {f: _gathered(s, acts[f]) for f in dims}
    assert got["long"].shape == (b_total, SEQ_L, 3) and got["short"].shape == (b_total, SEQ_L, 3)
    assert got["bag"].shape == (b_total, 3)
    for f in ("long", "short"):
      assert_close(got[f], _np_sequence(tables["a"], batch[f]), err_msg=f"step {t}: {f}")
    np.testing.assert_array_equal(got["short"][:, 3:], 0.0)  # padded positions
    np.testing.assert_array_equal(got["short"][1], 0.0)  # an empty sequence
    assert_close(got["bag"], _np_combined(tables["a"], batch["bag"], "sum"), err_msg=f"step {t}: bag")
    assert_close(got["other"], _np_combined(tables["b"], batch["other"], "mean"), err_msg=f"step {t}: other")
    tables = _np_sgd(tables, batch, grads, 0.1)
    now = emb.embedding_tables(state)
    for k in tables:
      assert_close(now[k], tables[k], err_msg=f"step {t}: table {k}")


def test_weighted_sequence_feature_scales_each_position(strategy):
  rng = np.random.default_rng(1)
  init = rng.standard_normal((V, 3)).astype(np.float32)
  table = E.TableConfig(V, 3, initializer=_rows(init), name="a")
  emb = E.TPUEmbedding({"s": E.FeatureConfig(table, max_sequence_length=SEQ_L)}, E.SGD(0.5), strategy)
  ids = rng.integers(0, V, (16, SEQ_L)).astype(np.int32)
  ids[0, 2:] = -1
  w = rng.uniform(0.5, 2.0, ids.shape).astype(np.float32)
  g = rng.standard_normal((16, SEQ_L, 3)).astype(np.float32)

  def step(state, ids, w, g):
    act = emb.lookup(state, {"s": ids}, {"s": w})
    return emb.apply_gradients(state, {"s": ids}, {"s": g}, {"s": w}), act

  state, act = strategy.run(step, args=(emb.build(), *(_ids_per_replica(strategy, x) for x in (ids, w, g))))
  assert_close(_gathered(strategy, act["s"]), _np_sequence(init.astype(np.float64), ids, w))
  expected = init.astype(np.float64).copy()
  for i, j in zip(*np.nonzero(ids >= 0)):
    expected[ids[i, j]] -= 0.5 * w[i, j] * g[i, j]
  assert_close(emb.embedding_tables(state)["a"], expected)


def test_sequence_gradient_shape_is_checked(strategy):
  table = E.TableConfig(V, 3, name="a")
  emb = E.TPUEmbedding({"s": E.FeatureConfig(table, max_sequence_length=4, name="s")}, E.SGD(0.5), strategy)
  ids = _ids_per_replica(strategy, np.zeros((16, 4), np.int32))
  with pytest.raises(ValueError, match=r"gradient of feature 's' has shape \(2, 3\), expected \(2, 4, 3\)"):
    strategy.run(lambda st, ids: emb.apply_gradients(st, {"s": ids}, {"s": jnp.ones((2, 3))}), args=(emb.build(), ids))


# -- one exchange for all tables, deduplicated -------------------------------------------------------


def _compiled_step(strategy, emb, features, data):
  names = list(features)

  def step(state, ids):
    feats = {k: ids for k in names}
    acts = emb.lookup(state, feats)
    return emb.apply_gradients(state, feats, {k: jnp.ones_like(a) for k, a in acts.items()})

  return jax.jit(lambda st, ids: strategy.run(step, args=(st, ids))).lower(emb.build(), data).compile()


def _all_to_alls(hlo):
  """[(dtype, dims)] of the operands of each all-to-all in compiled HLO text."""
  out = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*(.*?)\sall-to-all(?:-start)?\(", line)
    if m:
      out.append(re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1)))
  return out


def _embedding(strategy, tables, dims=(4,), **bounds):
  configs = {f"f{i}": E.FeatureConfig(E.TableConfig(1000, dims[i % len(dims)], name=f"t{i}", **bounds), name=f"f{i}")
             for i in range(tables)}
  return configs, E.TPUEmbedding(configs, E.Adagrad(0.1), strategy)


def test_eight_tables_exchange_in_as_many_all_to_alls_as_one(strategy):
  ids = _ids_per_replica(strategy, np.arange(64, dtype=np.int32).reshape(16, 4) * 7 % 1000)
  counts = {}
  for tables in (1, 8):
    configs, emb = _embedding(strategy, tables, dims=(4, 8))
    counts[tables] = len(_all_to_alls(_compiled_step(strategy, emb, configs, ids).as_text()))
  assert 1 <= counts[8] == counts[1] <= 4, counts


def test_bounded_buckets_are_exchanged_at_their_size_and_duplicates_travel_once(strategy):
  """max_unique_ids_per_partition=3: the id and row buckets in the HLO are [8, 3] and [8, 3, D]; a
  replica's ids [5, 5, 5, 5, 6, 6, 130, -1] fill 3 slots (ids 5 and 6 owned by replica 0, 130 by
  replica 1), and the step equals numpy's."""
  dim = 4
  table = E.TableConfig(1000, dim, name="t", combiner="sum", initializer=lambda s, d: jnp.ones(s, d),
                        max_unique_ids_per_partition=3)
  emb = E.TPUEmbedding({"f": E.FeatureConfig(table, name="f")}, E.SGD(0.5), strategy)
  x = np.tile(np.array([[5, 5, 5, 5], [6, 6, 130, -1]], np.int32), (8, 1))
  ids = _ids_per_replica(strategy, x)
  shapes = _all_to_alls(_compiled_step(strategy, emb, {"f": None}, ids).as_text())
  # elements each replica sends per all-to-all (XLA:CPU lists one [1, ...] operand per destination)
  sizes = sorted(sum(int(np.prod([int(d) for d in dims.split(",")])) for _, dims in op) for op in shapes)
  assert sizes in ([8 * 3, 8 * 3 * dim], [8 * 3, 8 * 3 * dim, 8 * 3 * dim]), sizes

  def step(state, ids):
    prepared = emb._prepare(state, {"f": ids}, None, "lookup")
    (route,) = emb._routes(state, prepared, "lookup")
    act = emb.lookup(state, {"f": ids})["f"]
    return emb.apply_gradients(state, {"f": ids}, {"f": jnp.ones_like(act)}), route.send, act

  state, send, act = strategy.run(step, args=(emb.build(), ids))
  for bucket in strategy.experimental_local_results(send):
    bucket = np.asarray(bucket)
    assert bucket.shape == (8, 3)
    assert sorted(bucket[0][bucket[0] >= 0].tolist()) == [5, 6]  # replica 0 owns rows 0..124
    assert bucket[1][bucket[1] >= 0].tolist() == [130 - 125]
    assert (bucket[2:] == -1).all()
  np.testing.assert_allclose(_gathered(strategy, act), np.tile([[4.0] * dim, [3.0] * dim], (8, 1)))
  expected = np.ones((1000, dim))
  for row, count in ((5, 4 * 8), (6, 2 * 8), (130, 8)):  # each of 8 replicas: 4x id 5, 2x id 6, 1x id 130
    expected[row] -= 0.5 * count
  np.testing.assert_allclose(emb.embedding_tables(state)["t"], expected)


# -- bounds ----------------------------------------------------------------------------------------------


def test_check_ids_refuses_a_batch_over_a_bound_naming_table_and_bound(strategy):
  table = E.TableConfig(1000, 4, name="clicks", max_ids_per_partition=4, max_unique_ids_per_partition=2)
  emb = E.TPUEmbedding({"f": E.FeatureConfig(table, name="f")}, E.SGD(0.5), strategy)
  emb.check_ids({"f": np.array([[1, 1, 1, 2], [200, -1, -1, -1]], np.int32)})  # 4 ids, 2 distinct to replica 0
  with pytest.raises(ValueError, match=r"table 'clicks'.*5 ids to replica 0.*max_ids_per_partition=4"):
    emb.check_ids({"f": np.array([[1, 1, 1, 2], [1, -1, -1, -1]], np.int32)})
  with pytest.raises(ValueError, match=r"table 'clicks'.*3 distinct ids to replica 0.*max_unique_ids_per_partition=2"):
    emb.check_ids({"f": np.array([[1, 2, 3, -1]], np.int32)})
  per_replica = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.array([[1, 2, 3 if ctx.replica_id_in_sync_group == 5 else 1]], np.int32))
  with pytest.raises(ValueError, match=r"max_unique_ids_per_partition=2 \(component 5"):
    emb.check_ids({"f": per_replica})


def test_a_step_over_a_bound_fails_naming_table_and_bound_and_drops_nothing(strategy):
  s = tpustrat.MirroredStrategy(jax.devices()[:2])  # its own engine: the failed step stays there
  table = E.TableConfig(100, 2, name="clicks", combiner="sum", initializer=lambda sh, d: jnp.ones(sh, d),
                        max_unique_ids_per_partition=2)
  emb = E.TPUEmbedding({"f": E.FeatureConfig(table, name="f")}, E.SGD(0.5), s)

  def step(state, ids):
    act = emb.lookup(state, {"f": ids})["f"]
    return emb.apply_gradients(state, {"f": ids}, {"f": jnp.ones_like(act)}), act

  ok = s.experimental_distribute_values_from_function(lambda ctx: np.array([[1, 2, 1, 60]], np.int32))
  state, act = s.run(step, args=(emb.build(), ok))  # 2 distinct ids per owner: at the bound
  np.testing.assert_array_equal(_gathered(s, act), [[4.0, 4.0]] * 2)
  expected = np.ones((100, 2))
  expected[[1, 2, 60]] -= 0.5 * np.array([[4], [2], [2]])
  np.testing.assert_array_equal(emb.embedding_tables(state)["clicks"], expected)
  over = s.experimental_distribute_values_from_function(
      lambda ctx: np.array([[1, 2, 3, 60]], np.int32))  # 3 distinct ids for replica 0
  with pytest.raises(Exception, match=r"table 'clicks'.*3 distinct ids to replica 0.*max_unique_ids_per_partition=2"):
    new, act = s.run(step, args=(state, over))
    np.asarray(act.values[0]), np.asarray(new["tables"]["clicks"])


def test_one_replica_over_a_bound_fails_every_replica_naming_it():
  # Replica 5 alone sends 4 ids to owner 0 (bound 3): every replica fails the step together, with the
  # error naming replica 5 (none is left waiting in the exchange, which would abort the process).
  s = tpustrat.MirroredStrategy(jax.devices()[:8])  # its own engine: the failed step stays there
  table = E.TableConfig(16, 2, name="t1", combiner="sum", max_ids_per_partition=3)
  emb = E.TPUEmbedding({"a": E.FeatureConfig(table)}, E.SGD(0.1), s)
  ok, over = np.array([[0, 5], [9, 12]], np.int32), np.array([[0, 1], [0, 1]], np.int32)
  ids = s.experimental_distribute_values_from_function(
      lambda ctx: {"a": over if ctx.replica_id_in_sync_group == 5 else ok})
  with pytest.raises(Exception, match=r"table 't1': replica 5 sends 4 ids to replica 0.*max_ids_per_partition=3"):
    out = s.run(lambda st, f: emb.lookup(st, f), args=(emb.build(), ids))
    np.asarray(out["a"].values[0])


# -- sparse in-place updates --------------------------------------------------------------------------


def test_donated_state_is_updated_in_place_without_a_block_sized_temporary(strategy):
  rows_total, dim = 8 * 4096, 32  # a 512 KiB block per replica
  block = rows_total // 8 * dim * 4
  for opt in (E.SGD(0.1), E.Adagrad(0.1), E.Adam(0.01)):  # Adam: lazy
    table = E.TableConfig(rows_total, dim, name="t", initializer=lambda s, d: jnp.zeros(s, d), optimizer=opt)
    emb = E.TPUEmbedding({"f": E.FeatureConfig(table)}, None, strategy)
    ids = _ids_per_replica(strategy, np.arange(64, dtype=np.int32).reshape(16, 4) * 509 % rows_total)

    def step(state, ids, emb=emb):
      act = emb.lookup(state, {"f": ids})["f"]
      return emb.apply_gradients(state, {"f": ids}, {"f": jnp.ones_like(act)})

    compiled = jax.jit(lambda st, ids: strategy.run(step, args=(st, ids)), donate_argnums=0).lower(
        emb.build(), ids).compile()
    memory = compiled.memory_analysis()
    assert memory.temp_size_in_bytes < block, (opt, memory.temp_size_in_bytes, block)
    assert memory.alias_size_in_bytes >= block * (1 + len(opt.slot_initial_values())), (opt, memory)
    # and through run's own donation: the old state is consumed, the numbers are numpy's
    state = emb.build()
    old = state["tables"]["t"].tree
    state = strategy.run(step, args=(state, ids), options=tpustrat.RunOptions(donate_argnums=0))
    assert old.is_deleted()
    got = emb.embedding_tables(state)["t"]
    touched = np.zeros(rows_total, bool)
    touched[np.arange(64) * 509 % rows_total] = True
    assert (got[touched] != 0).all() and (got[~touched] == 0).all()


def test_lazy_adam_keeps_untouched_rows_and_non_lazy_adam_moves_them(strategy):
  """Rows touched at step 1 only: lazy Adam leaves them after step 1, non-lazy Adam keeps moving them
  (their moments decay), as TF defines it; both equal numpy's, the state donated every step."""
  init = np.random.default_rng(3).standard_normal((V, 2)).astype(np.float32)
  lr, b1, b2, eps = 0.05, 0.9, 0.999, 1e-3
  results, last_touched = {}, None
  for lazy in (True, False):
    rng = np.random.default_rng(4)  # the same batches for both
    table = E.TableConfig(V, 2, initializer=_rows(init), combiner="sum", name="t")
    emb = E.TPUEmbedding({"f": E.FeatureConfig(table)}, E.Adam(lr, b1, b2, eps, lazy_adam=lazy), strategy)

    def step(state, ids, g, emb=emb):
      return emb.apply_gradients(state, {"f": ids}, {"f": g})

    table_np, m, v = init.astype(np.float64), np.zeros((V, 2)), np.zeros((V, 2))
    state = emb.build()
    for t in range(1, 4):
      ids = rng.integers(0, 36 if t == 1 else 6, 16).astype(np.int32)  # later steps: rows 0..5 only
      g = rng.standard_normal((16, 2)).astype(np.float32)
      state = strategy.run(step, args=(state, _ids_per_replica(strategy, ids), _ids_per_replica(strategy, g)),
                           options=tpustrat.RunOptions(donate_argnums=0))
      summed, touched = np.zeros((V, 2)), np.zeros(V, bool)
      np.add.at(summed, ids, g)
      touched[ids] = True
      rows = touched if lazy else np.ones(V, bool)
      m[rows] = b1 * m[rows] + (1 - b1) * summed[rows]
      v[rows] = b2 * v[rows] + (1 - b2) * summed[rows] ** 2
      lr_t = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
      table_np[rows] -= lr_t * m[rows] / np.sqrt(v[rows] + eps ** 2)
      if t == 1:
        after_first = table_np.copy()
        first = touched.copy()
    last_touched = touched
    got = emb.embedding_tables(state)["t"]
    assert_close(got, table_np, err_msg=f"lazy_adam={lazy}")
    assert_close(np.asarray(state["slots"]["t"]["momenta"]), m, err_msg=f"lazy_adam={lazy}: momenta")
    assert_close(np.asarray(state["slots"]["t"]["velocities"]), v, err_msg=f"lazy_adam={lazy}: velocities")
    results[lazy] = got
    stale = first & ~np.isin(np.arange(V), np.arange(6))  # touched at step 1, never after
    assert stale.sum() > 3
    if lazy:
      assert_close(got[stale], after_first[stale])
    else:
      assert (np.abs(got[stale] - after_first[stale]) > 1e-4).all()
  never = ~first & ~last_touched
  np.testing.assert_array_equal(results[True][never], init[never])


@pytest.mark.parametrize("n", (4, 8))
def test_sparse_updates_match_the_dense_reference_on_small_tables(monkeypatch, n):
  """The five-step dense-reference test of test_embedding.py (every combiner, SGD, Adagrad, lazy and
  non-lazy Adam) with the sparse update forced on its 37-row tables, which update densely by default
  (a block no bigger than the received slots)."""
  import test_embedding as ref_lib

  from tpustrat._src import embedding as impl

  monkeypatch.setattr(impl, "_DENSE_BLOCKS_UP_TO", 0)
  devices = jax.devices()
  s = tpustrat.MirroredStrategy(devices[:n])
  assignment = ref_lib.ASSIGNMENTS[ref_lib.ASSIGNMENT_OF[n]]
  emb = ref_lib.make_embedding(s, assignment)
  step = ref_lib.make_step(emb)
  state, ref = emb.build(), ref_lib.reference(assignment)
  for batch in ref_lib.BATCHES:
    state, acts = s.run(step, args=(state, ref_lib.distribute(s, batch)), options=tpustrat.RunOptions(donate_argnums=0))
    got, expected = ref_lib.gathered(s, acts), ref.lookup(batch["ids"], batch["weights"])
    for f in ref_lib.FEATURES:
      assert_close(got[f], expected[f], err_msg=f)
    ref.apply_gradients(batch["ids"], batch["grads"], batch["weights"])
  ref_lib.assert_matches(emb, state, ref, f"{n} replicas, sparse updates")
