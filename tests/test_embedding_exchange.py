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

import collections
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EMBEDDING_LAYOUTS, assert_close, distribute_batch, embedding_layout

import tpustrat
from tpustrat import embedding as E

V = 37
N = 8


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


@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
@pytest.mark.parametrize("n", (8, 2))
def test_sequence_features_match_numpy_per_position(strategy, n, layout):
  s = strategy if n == 8 else tpustrat.MirroredStrategy(jax.devices()[:n])
  rng = np.random.default_rng(0)
  init = {"a": rng.standard_normal((V, 3)).astype(np.float32), "b": rng.standard_normal((V, 2)).astype(np.float32)}
  emb = embedding_layout(_sequence_model(s, init["a"], init["b"], E.SGD(0.1)), layout)
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
    state, acts = s.run(step, args=(state, distribute_batch(s, batch), distribute_batch(s, grads)))
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

  state, act = strategy.run(step, args=(emb.build(), *(distribute_batch(strategy, x) for x in (ids, w, g))))
  assert_close(_gathered(strategy, act["s"]), _np_sequence(init.astype(np.float64), ids, w))
  expected = init.astype(np.float64).copy()
  for i, j in zip(*np.nonzero(ids >= 0)):
    expected[ids[i, j]] -= 0.5 * w[i, j] * g[i, j]
  assert_close(emb.embedding_tables(state)["a"], expected)


def test_sequence_gradient_shape_is_checked(strategy):
  table = E.TableConfig(V, 3, name="a")
  emb = E.TPUEmbedding({"s": E.FeatureConfig(table, max_sequence_length=4, name="s")}, E.SGD(0.5), strategy)
  ids = distribute_batch(strategy, np.zeros((16, 4), np.int32))
  with pytest.raises(ValueError, match=r"gradient of feature 's' has shape \(2, 3\), expected \(2, 4, 3\)"):
    strategy.run(lambda st, ids: emb.apply_gradients(st, {"s": ids}, {"s": jnp.ones((2, 3))}), args=(emb.build(), ids))


# -- one exchange for all tables, deduplicated -------------------------------------------------------


def _compiled_step(strategy, emb, features, data, use_activations=False):
  """The compiled step: lookup, then apply_gradients of ones (or, `use_activations`, of the activations
  themselves, so that the lookup's exchange is not dead code)."""
  names = list(features)

  def step(state, ids):
    feats = {k: ids for k in names}
    acts = emb.lookup(state, feats)
    grads = acts if use_activations else {k: jnp.ones_like(a) for k, a in acts.items()}
    return emb.apply_gradients(state, feats, grads)

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


def _collectives(hlo):
  """{op: count} of the exchanges in compiled HLO text."""
  return collections.Counter(re.findall(r"\s(all-to-all|all-gather|reduce-scatter)(?:-start)?\(", hlo))


# the exchanges of one step (lookup + apply_gradients) on each layout, however many tables
EXCHANGES = {"all_to_all": {"all-to-all": 3}, "all_gather_table": {"all-gather": 1, "reduce-scatter": 1},
             "all_gather_ids": {"all-gather": 2, "reduce-scatter": 1}}


@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
def test_eight_tables_take_as_many_exchanges_as_one(strategy, layout):
  """8 tables of two widths, one feature each, on one layout: the compiled step holds the same
  exchanges as with 1 table (all-to-all: ids out, rows back, gradients out; the all-gathers: the
  table or the ids, rows or gradients reduce-scattered, the gradients or nothing all-gathered)."""
  ids = distribute_batch(strategy, np.arange(64, dtype=np.int32).reshape(16, 4) * 7 % 1000)
  counts = {}
  for tables in (1, 8):
    configs, emb = _embedding(strategy, tables, dims=(4, 8))
    embedding_layout(emb, layout)
    counts[tables] = _collectives(_compiled_step(strategy, emb, configs, ids, use_activations=True).as_text())
  assert counts[8] == counts[1] == EXCHANGES[layout], counts


def test_eight_bounded_tables_take_as_many_exchanges_and_bound_checks_as_one(strategy):
  """Bounded tables: 3 all-to-alls and one all-gather of every table's id counts (the bound check),
  for 8 tables as for 1."""
  ids = distribute_batch(strategy, np.arange(64, dtype=np.int32).reshape(16, 4) * 7 % 1000)
  counts = {}
  for tables in (1, 8):
    configs, emb = _embedding(strategy, tables, dims=(4, 8), max_unique_ids_per_partition=8)
    counts[tables] = _collectives(_compiled_step(strategy, emb, configs, ids, use_activations=True).as_text())
  assert counts[8] == counts[1] == {"all-to-all": 3, "all-gather": 1}, counts


@pytest.mark.parametrize("rows, layout", [(37, "all_gather_table"), (128, "all_gather_table"),
                                          (129, "all_gather_ids"), (1000, "all_gather_ids")])
def test_the_size_rule_all_gathers_a_table_whose_block_is_at_most_twice_its_ids(strategy, rows, layout):
  """8 ids per replica (b = 2, 4 ids each): a block of up to 16 rows (V <= 128 on 8 replicas) is
  all-gathered whole, 17 rows or more gather the ids instead; a bound routes any table over all-to-all."""
  for bound in ({}, {"max_ids_per_partition": 8}):
    table = E.TableConfig(rows, 4, name="t", **bound)
    emb = E.TPUEmbedding({"f": E.FeatureConfig(table, name="f")}, E.SGD(0.1), strategy)
    ids = distribute_batch(strategy, np.arange(64, dtype=np.int32).reshape(16, 4) % rows)
    got = _collectives(_compiled_step(strategy, emb, {"f": None}, ids, use_activations=True).as_text())
    if bound:  # (the bound check all-gathers each replica's id counts per owner)
      assert got == {"all-to-all": 3, "all-gather": 1}, (rows, got)
    else:
      assert got == EXCHANGES[layout], (rows, got)


def test_tables_on_every_layout_together_match_numpy(strategy):
  """2 tables all-gathered whole, 3 gathering their ids and 3 routed (bounded), widths 4 and 8: the step
  holds each layout's exchanges once, and SGD on d(loss)/d(act) = act (sum combiner) equals numpy's,
  duplicates and -1 padding included."""
  sizes = [37, 90, 1000, 5000, 777, 1000, 400, 3000]  # 8 ids per replica: blocks of 5..12 rows, then 50..625
  bounded = {5, 6, 7}
  rng = np.random.default_rng(11)
  inits = [rng.standard_normal((v, 4 if i % 2 == 0 else 8)).astype(np.float32) for i, v in enumerate(sizes)]
  configs = {f"f{i}": E.FeatureConfig(E.TableConfig(
      v, inits[i].shape[1], name=f"t{i}", combiner="sum", initializer=_rows(inits[i]),
      max_unique_ids_per_partition=8 if i in bounded else None), name=f"f{i}") for i, v in enumerate(sizes)}
  emb = E.TPUEmbedding(configs, E.SGD(0.5), strategy)
  x = rng.integers(0, 37, (16, 4)).astype(np.int32)
  x[0] = [3, 3, -1, 3]
  x[5] = -1
  ids = distribute_batch(strategy, x)
  got = _collectives(_compiled_step(strategy, emb, configs, ids, use_activations=True).as_text())
  want = collections.Counter()
  for layout in EMBEDDING_LAYOUTS:
    want.update(EXCHANGES[layout])
  want.update({"all-gather": 1})  # the bound check all-gathers the id counts of every bounded table at once
  assert got == want, got

  def step(state, ids):
    feats = {k: ids for k in configs}
    acts = emb.lookup(state, feats)
    return emb.apply_gradients(state, feats, acts), acts

  state, acts = strategy.run(step, args=(emb.build(), ids))
  tables = emb.embedding_tables(state)
  for i, init in enumerate(inits):
    act = np.stack([sum((init[j] for j in row if j >= 0), np.zeros(init.shape[1])) for row in x])
    assert_close(_gathered(strategy, acts[f"f{i}"]), act, err_msg=f"activations of table {i}")
    want_t = init.astype(np.float64).copy()
    for row, a in zip(x, act):
      for j in row[row >= 0]:
        want_t[j] -= 0.5 * a
    assert_close(tables[f"t{i}"], want_t, err_msg=f"table {i}")


def test_bounded_buckets_are_exchanged_at_their_size_and_duplicates_travel_once(strategy):
  """max_unique_ids_per_partition=3: the id and row buckets in the HLO are [8, 3] and [8, 3, D]; a
  replica's ids [5, 5, 5, 5, 6, 6, 130, -1] fill 3 slots (ids 5 and 6 owned by replica 0, 130 by
  replica 1), and the step equals numpy's."""
  dim = 4
  table = E.TableConfig(1000, dim, name="t", combiner="sum", initializer=lambda s, d: jnp.ones(s, d),
                        max_unique_ids_per_partition=3)
  emb = E.TPUEmbedding({"f": E.FeatureConfig(table, name="f")}, E.SGD(0.5), strategy)
  x = np.tile(np.array([[5, 5, 5, 5], [6, 6, 130, -1]], np.int32), (8, 1))
  ids = distribute_batch(strategy, x)
  shapes = _all_to_alls(_compiled_step(strategy, emb, {"f": None}, ids).as_text())
  # elements each replica sends per all-to-all (XLA:CPU lists one [1, ...] operand per destination)
  sizes = sorted(sum(int(np.prod([int(d) for d in dims.split(",")])) for _, dims in op) for op in shapes)
  assert sizes in ([8 * 3, 8 * 3 * dim], [8 * 3, 8 * 3 * dim, 8 * 3 * dim]), sizes

  def step(state, ids):
    prepared = emb._prepare(state, {"f": ids}, None, "lookup")
    (route,), wholes, spread, _ = emb._routes(state, prepared, "lookup")
    assert not wholes and not spread  # a bounded table is routed, whatever its size
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
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=r"ValueError: TPUEmbedding: table 'clicks'.*3 distinct ids to replica 0.*max_unique_ids_per_partition=2"):
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
    ids = distribute_batch(strategy, np.arange(64, dtype=np.int32).reshape(16, 4) * 509 % rows_total)

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


@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
def test_lazy_adam_keeps_untouched_rows_and_non_lazy_adam_moves_them(strategy, layout):
  """Rows touched at step 1 only: lazy Adam leaves them after step 1, non-lazy Adam keeps moving them
  (their moments decay), as TF defines it; both equal numpy's, the state donated every step, on both
  layouts."""
  init = np.random.default_rng(3).standard_normal((V, 2)).astype(np.float32)
  lr, b1, b2, eps = 0.05, 0.9, 0.999, 1e-3
  results, last_touched = {}, None
  for lazy in (True, False):
    rng = np.random.default_rng(4)  # the same batches for both
    table = E.TableConfig(V, 2, initializer=_rows(init), combiner="sum", name="t")
    emb = E.TPUEmbedding({"f": E.FeatureConfig(table)}, E.Adam(lr, b1, b2, eps, lazy_adam=lazy), strategy)
    embedding_layout(emb, layout)

    def step(state, ids, g, emb=emb):
      return emb.apply_gradients(state, {"f": ids}, {"f": g})

    table_np, m, v = init.astype(np.float64), np.zeros((V, 2)), np.zeros((V, 2))
    state = emb.build()
    for t in range(1, 4):
      ids = rng.integers(0, 36 if t == 1 else 6, 16).astype(np.int32)  # later steps: rows 0..5 only
      g = rng.standard_normal((16, 2)).astype(np.float32)
      state = strategy.run(step, args=(state, distribute_batch(strategy, ids), distribute_batch(strategy, g)),
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


@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
def test_a_touched_row_whose_gradients_cancel_is_still_updated_by_lazy_optimizers(strategy, layout):
  """Row 7 looked up on replicas 0 and 1 with gradients h and -h: they sum to exactly 0, but TF's lazy
  optimizers update every row the batch touched: FTRL recomputes it from its linear slot (0: the row
  becomes 0), lazy Adam decays its moments (the row moves on); row 8, never looked up, keeps its value.
  Against numpy, on both layouts (the all-gather's touched rows come from counts, not gradients)."""
  from test_embedding_optimizers import FTRL_DEFAULTS, np_ftrl

  init = np.random.default_rng(8).standard_normal((V, 2)).astype(np.float32)
  h = np.array([0.75, -1.5], np.float32)
  ids = np.full(16, -1, np.int32)
  ids[[0, 2]] = 7  # example 0 on replica 0, example 2 on replica 1
  cancel = np.zeros((16, 2), np.float32)
  cancel[0], cancel[2] = h, -h
  once = np.zeros((16, 2), np.float32)
  once[0] = h
  lr, b1, b2, eps = 0.05, 0.9, 0.999, 1e-3
  for opt in (E.FTRL(learning_rate=0.1), E.Adam(lr, b1, b2, eps, lazy_adam=True)):
    table = E.TableConfig(V, 2, initializer=_rows(init), combiner="sum", name="t")
    emb = embedding_layout(E.TPUEmbedding({"f": E.FeatureConfig(table)}, opt, strategy), layout)

    def step(state, ids, g, emb=emb):
      return emb.apply_gradients(state, {"f": ids}, {"f": g})

    def run(state, g, emb=emb):
      return strategy.run(step, args=(state, distribute_batch(strategy, ids), distribute_batch(strategy, g)))

    want = init.astype(np.float64)
    if isinstance(opt, E.FTRL):
      state = run(emb.build(), cancel)
      acc0 = FTRL_DEFAULTS["initial_accumulator_value"]
      want[7], _, _ = np_ftrl(want[7], np.full(2, acc0), np.zeros(2), np.zeros(2), {"learning_rate": 0.1})
      assert (want[7] == 0).all()
    else:
      state = run(run(emb.build(), once), cancel)
      m, v = (1 - b1) * h, (1 - b2) * h.astype(np.float64) ** 2
      want[7] -= lr * np.sqrt(1 - b2) / (1 - b1) * m / np.sqrt(v + eps ** 2)
      m, v = b1 * m, b2 * v  # step 2: a zero gradient on a touched row
      want[7] -= lr * np.sqrt(1 - b2 ** 2) / (1 - b1 ** 2) * m / np.sqrt(v + eps ** 2)
    got = emb.embedding_tables(state)["t"]
    assert_close(got, want, err_msg=f"{type(opt).__name__}, {layout}")
    np.testing.assert_array_equal(got[8], init[8])


@pytest.mark.parametrize("n", (4, 8))
def test_sparse_updates_match_the_dense_reference_on_small_tables(monkeypatch, n):
  """The five-step dense-reference test of test_embedding.py (every combiner, SGD, Adagrad, lazy and
  non-lazy Adam) with the sparse update forced on its 37-row tables, which update densely by default
  (a block no bigger than the received slots)."""
  import test_embedding as ref_lib

  from tpustrat._src.embedding import exchange as impl

  monkeypatch.setattr(impl, "_DENSE_BLOCKS_UP_TO", 0)
  devices = jax.devices()
  s = tpustrat.MirroredStrategy(devices[:n])
  assignment = ref_lib.ASSIGNMENTS[ref_lib.ASSIGNMENT_OF[n]]
  emb = embedding_layout(ref_lib.make_embedding(s, assignment), "all_to_all")
  step = ref_lib.make_step(emb)
  state, ref = emb.build(), ref_lib.reference(assignment)
  for batch in ref_lib.BATCHES:
    state, acts = s.run(step, args=(state, distribute_batch(s, batch)), options=tpustrat.RunOptions(donate_argnums=0))
    got, expected = ref_lib.gathered(s, acts), ref.lookup(batch["ids"], batch["weights"])
    for f in ref_lib.FEATURES:
      assert_close(got[f], expected[f], err_msg=f)
    ref.apply_gradients(batch["ids"], batch["grads"], batch["weights"])
  ref_lib.assert_matches(emb, state, ref, f"{n} replicas, sparse updates")


# -- the sort behind deduplication ----------------------------------------------------------------------


@pytest.mark.parametrize("n, largest", [(1, 0), (7, 3), (512, 40_000), (4096, 125_000), (300, 2 ** 30)])
def test_sort_with_order_is_a_stable_argsort_packed_or_not(n, largest):
  """`_sort_with_order` against numpy's stable argsort, duplicates included: keys packed with their
  positions where they fit in int32 (all but the last case), `jnp.argsort` otherwise; `_unique` against
  `np.unique`."""
  from tpustrat._src.embedding import exchange as impl

  rng = np.random.default_rng(n)
  keys = rng.integers(0, min(largest, 50) + 1 if n > 60 else largest + 1, n).astype(np.int32)
  keys[-1] = largest  # the largest key packs too
  ordered, order = jax.jit(impl._sort_with_order, static_argnums=1)(jnp.asarray(keys), largest)
  np.testing.assert_array_equal(np.asarray(order), np.argsort(keys, kind="stable"))
  np.testing.assert_array_equal(np.asarray(ordered), np.sort(keys))
  uniq, inverse = jax.jit(impl._unique, static_argnums=(1, 2))(jnp.asarray(keys), largest, n)
  want, want_inverse = np.unique(keys, return_inverse=True)
  np.testing.assert_array_equal(np.asarray(uniq)[:len(want)], want)
  np.testing.assert_array_equal(np.asarray(uniq)[len(want):], largest)
  np.testing.assert_array_equal(np.asarray(inverse), want_inverse.reshape(-1))


# -- a step without ids ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
def test_a_table_without_ids_in_a_step_looks_up_nothing_and_only_non_lazy_adam_moves_it(strategy, layout):
  """Step 1 looks up rows 3 and 30 on every replica; step 2's feature is ``[b, 0]`` (no ids): its
  activations are zeros, lazy Adam leaves the table and slots as they were, non-lazy Adam decays the
  moments and moves the rows step 1 touched (TF's rule), against numpy."""
  init = np.random.default_rng(9).standard_normal((V, 2)).astype(np.float32)
  lr, b1, b2, eps = 0.05, 0.9, 0.999, 1e-3
  some = np.tile(np.array([[3, 30]], np.int32), (16, 1))
  grads = np.random.default_rng(10).standard_normal((16, 2)).astype(np.float32)
  for lazy in (True, False):
    table = E.TableConfig(V, 2, initializer=_rows(init), combiner="sum", name="t")
    emb = embedding_layout(E.TPUEmbedding({"f": E.FeatureConfig(table, name="f")},
                                          E.Adam(lr, b1, b2, eps, lazy_adam=lazy), strategy), layout)

    def step(state, ids, g, emb=emb):
      act = emb.lookup(state, {"f": ids})["f"]
      return emb.apply_gradients(state, {"f": ids}, {"f": g}), act

    state, _ = strategy.run(step, args=(emb.build(), distribute_batch(strategy, some),
                                        distribute_batch(strategy, grads)))
    state, act = strategy.run(step, args=(state, distribute_batch(strategy, np.zeros((16, 0), np.int32)),
                                          distribute_batch(strategy, grads)))
    np.testing.assert_array_equal(_gathered(strategy, act), 0.0)
    summed = np.zeros((V, 2))
    for j in (3, 30):
      summed[j] = grads.astype(np.float64).sum(axis=0)
    touched = np.isin(np.arange(V), [3, 30])
    want, m, v = init.astype(np.float64), np.zeros((V, 2)), np.zeros((V, 2))
    for t, g in ((1, summed), (2, np.zeros((V, 2)))):
      rows = touched if (lazy and t == 1) else (np.zeros(V, bool) if lazy else np.ones(V, bool))
      m[rows] = b1 * m[rows] + (1 - b1) * g[rows]
      v[rows] = b2 * v[rows] + (1 - b2) * g[rows] ** 2
      want[rows] -= lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m[rows] / np.sqrt(v[rows] + eps ** 2)
    got = emb.embedding_tables(state)["t"]
    assert_close(got, want, err_msg=f"lazy_adam={lazy}, {layout}")
    assert_close(np.asarray(state["slots"]["t"]["momenta"]), m, err_msg=f"lazy_adam={lazy}, {layout}: momenta")
    assert lazy or not np.allclose(got[touched], emb.embedding_tables(
        strategy.run(step, args=(emb.build(), distribute_batch(strategy, some),
                                 distribute_batch(strategy, grads)))[0])["t"][touched])


_BOUND_FAILS_THEN_EXITS = """
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import numpy as np, jax, tpustrat
from tpustrat import embedding as E
s = tpustrat.TPUStrategy()
emb = E.TPUEmbedding({"f": E.FeatureConfig(E.TableConfig(64, 2, max_ids_per_partition=2, name="t"))}, E.SGD(0.1), s)
ids = s.experimental_distribute_values_from_function(lambda ctx: np.zeros((4,), np.int32))  # 4 ids to owner 0
s.run(lambda state, f: emb.lookup(state, {"f": f}), args=(emb.build(), ids))
try:
  s.experimental_run_wait()
except jax.errors.JaxRuntimeError as e:
  print("CAUGHT", "max_ids_per_partition=2" in str(e))
"""


@pytest.mark.processes
def test_a_failed_bound_check_is_reported_once_not_again_at_exit(tmp_path):
  # The caller caught the error where tpustrat raised it: JAX must not print it again at exit ("Exception
  # ignored in atexit callback", twice, from its record of the failed program).
  script = tmp_path / "bound.py"
  script.write_text(_BOUND_FAILS_THEN_EXITS)
  done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                        env=dict(os.environ))
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.strip() == "CAUGHT True"
  assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
