"""tpustrat.embedding: sharded tables trained over AllToAll against a dense single-device numpy reference.

Four tables of 37 rows (not a multiple of 2, 4 or 8) train for 5 steps of ``lookup`` + ``apply_gradients``
on 1, 2, 4 and 8 replicas over the same global batches (replica ``r`` takes examples ``[r*b, (r+1)*b)``),
with d(loss)/d(activations) a fixed random array per step: six features (two pairs sharing a table), one
id or several per example with -1 padding and duplicates, every combiner with and without weights, and
SGD, Adagrad, lazy and non-lazy Adam on every replica count (one optimizer per table, the global one and
three overrides). The reference (`DenseReference`, numpy float64, written from TF's rules, not from the
library's code) takes each global batch whole, combines the rows of every example with explicit loops
and updates each touched row with its summed gradient. Also: gradients of a dense layer on top of the
activations, a checkpoint saved on 8 replicas and restored on 4, the steps inside
`experimental_run_steps`, and bad input.

Runtime is XLA compilation, about one program per replica count: the step functions are built once
(`model`) and shared by the tests.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EMBEDDING_LAYOUTS, assert_close, distribute_batch, embedding_layout

import tpustrat
from tpustrat import embedding as emb_lib
from tpustrat.checkpoint import CheckpointManager

V = 37  # does not divide by 2, 4 or 8: the last block holds padding rows
B = 16  # global batch: 16 examples on 1 replica, 2 on each of 8
L = 4  # ids per example of the multi-hot features
STEPS = 5
REPLICA_COUNTS = (1, 2, 4, 8)
POISON = 1e6  # written into the padding rows of the tables: a lookup that reads one is off by that much

# table name: (combiner, dim)
TABLES = {"t_sum": ("sum", 4), "t_mean": ("mean", 3), "t_sqrtn_w": ("sqrtn", 2), "t_sqrtn_u": ("sqrtn", 3)}
# feature name: (table, multi-hot [B, L] (else one id per example, [B]), weighted)
FEATURES = {
    "sum_w": ("t_sum", True, True),
    "sum_1": ("t_sum", False, False),
    "mean_w1": ("t_mean", False, True),
    "mean_u": ("t_mean", True, False),
    "sqrtn_w": ("t_sqrtn_w", True, True),
    "sqrtn_u": ("t_sqrtn_u", True, False),
}
EMPTY_EXAMPLE = 2  # all ids -1 in every multi-hot feature, -1 in the single-id ones

# optimizer name: (kind, hyperparameters). epsilon=1e-2 makes sum_inside_sqrt matter.
OPTIMIZERS = {
    "sgd": ("sgd", {"learning_rate": 0.1}),
    "adagrad": ("adagrad", {"learning_rate": 0.1, "initial_accumulator_value": 0.1}),
    "adam_lazy_in": ("adam", {"learning_rate": 0.01, "epsilon": 1e-2, "lazy_adam": True,
                              "sum_inside_sqrt": True}),
    "adam_lazy_out": ("adam", {"learning_rate": 0.02, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-2,
                               "lazy_adam": True, "sum_inside_sqrt": False}),
    "adam_dense_in": ("adam", {"learning_rate": 0.02, "epsilon": 1e-2, "lazy_adam": False,
                               "sum_inside_sqrt": True}),
    "adam_dense_out": ("adam", {"learning_rate": 0.01, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-2,
                                "lazy_adam": False, "sum_inside_sqrt": False}),
}
ADAM_DEFAULTS = {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "lazy_adam": True, "sum_inside_sqrt": True}
# Each table's optimizer: t_sum takes the TPUEmbedding's (global) one, the others override it in their
# TableConfig. Every replica count trains with SGD, Adagrad, lazy and non-lazy Adam at once (a Latin
# square over tables, so each optimizer meets several combiners); 4 and 8 replicas share an assignment,
# so that the checkpoint test moves a state between them.
GLOBAL_TABLE = "t_sum"
ASSIGNMENTS = {
    "A": {"t_sum": "adam_lazy_in", "t_mean": "adagrad", "t_sqrtn_w": "adam_dense_out", "t_sqrtn_u": "sgd"},
    "B": {"t_sum": "sgd", "t_mean": "adam_dense_in", "t_sqrtn_w": "adagrad", "t_sqrtn_u": "adam_lazy_out"},
    "C": {"t_sum": "adagrad", "t_mean": "adam_lazy_out", "t_sqrtn_w": "sgd", "t_sqrtn_u": "adam_dense_in"},
}
ASSIGNMENT_OF = {1: "C", 2: "B", 4: "A", 8: "A"}


# -- numpy reference ----------------------------------------------------------------------------------


def np_coefficients(ids, weights, combiner):
  """The coefficient of each id in its example's activation, [b, L] (TF: padding -1 weighs 0)."""
  ids = ids.reshape(len(ids), -1)
  w = np.ones(ids.shape) if weights is None else np.asarray(weights, np.float64).reshape(ids.shape)
  c = np.zeros(ids.shape)
  for i in range(len(ids)):
    wi = np.where(ids[i] >= 0, w[i], 0.0)
    if combiner == "sum":
      c[i] = wi
    elif combiner == "mean":
      c[i] = wi / wi.sum() if wi.sum() > 0 else 0.0
    else:
      norm = np.sqrt((wi * wi).sum())
      c[i] = wi / norm if norm > 0 else 0.0
  return c


class DenseReference:
  """Single-device tables (float64) and TF's optimizer rules, one global batch per step."""

  def __init__(self, initial, optimizer_of_table, features=None):
    self.tables = {name: np.array(t, np.float64) for name, t in initial.items()}
    self.optimizers = {name: OPTIMIZERS[o] for name, o in optimizer_of_table.items()}
    self.features = FEATURES if features is None else features
    self.slots = {}
    for name, (kind, hp) in self.optimizers.items():
      shape = self.tables[name].shape
      if kind == "adagrad":
        self.slots[name] = {"accumulators": np.full(shape, hp["initial_accumulator_value"])}
      elif kind == "adam":
        self.slots[name] = {"momenta": np.zeros(shape), "velocities": np.zeros(shape)}
      else:
        self.slots[name] = {}
    self.t = 0

  def lookup(self, ids, weights=None):
    weights = weights or {}
    out = {}
    for f, ids_f in ids.items():
      table = self.tables[self.features[f][0]]
      combiner = TABLES[self.features[f][0]][0]
      ids2 = ids_f.reshape(len(ids_f), -1)
      c = np_coefficients(ids_f, weights.get(f), combiner)
      act = np.zeros((len(ids2), table.shape[1]))
      for i in range(len(ids2)):
        for j in range(ids2.shape[1]):
          if ids2[i, j] >= 0:
            act[i] += c[i, j] * table[ids2[i, j]]
      out[f] = act
    return out

  def apply_gradients(self, ids, grads, weights=None):
    weights = weights or {}
    summed = {name: np.zeros_like(t) for name, t in self.tables.items()}
    touched = {name: np.zeros(len(t), bool) for name, t in self.tables.items()}
    for f, ids_f in ids.items():
      name = self.features[f][0]
      ids2 = ids_f.reshape(len(ids_f), -1)
      c = np_coefficients(ids_f, weights.get(f), TABLES[name][0])
      g = np.asarray(grads[f], np.float64)
      for i in range(len(ids2)):
        for j in range(ids2.shape[1]):
          if ids2[i, j] >= 0:
            summed[name][ids2[i, j]] += c[i, j] * g[i]
            touched[name][ids2[i, j]] = True
    self.t += 1
    for name in {self.features[f][0] for f in ids}:
      self._update(name, summed[name], touched[name])

  def _update(self, name, g, touched):
    kind, hp = self.optimizers[name]
    table, slots = self.tables[name], self.slots[name]
    if kind == "sgd":
      table[touched] -= hp["learning_rate"] * g[touched]
    elif kind == "adagrad":
      slots["accumulators"][touched] += g[touched] ** 2
      table[touched] -= hp["learning_rate"] * g[touched] / np.sqrt(slots["accumulators"][touched])
    else:
      hp = {**ADAM_DEFAULTS, **hp}
      b1, b2, eps = hp["beta_1"], hp["beta_2"], hp["epsilon"]
      lr = hp["learning_rate"] * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
      rows = touched if hp["lazy_adam"] else np.ones(len(table), bool)
      m = b1 * slots["momenta"][rows] + (1 - b1) * g[rows]
      v = b2 * slots["velocities"][rows] + (1 - b2) * g[rows] ** 2
      denom = np.sqrt(v + eps ** 2) if hp["sum_inside_sqrt"] else np.sqrt(v) + eps
      table[rows] -= lr * m / denom
      slots["momenta"][rows], slots["velocities"][rows] = m, v


# -- data ---------------------------------------------------------------------------------------------


def make_initial_tables(seed=0):
  rng = np.random.default_rng(seed)
  return {name: (0.5 * rng.standard_normal((V, dim))).astype(np.float32) for name, (_, dim) in TABLES.items()}


def make_batches(seed=1, steps=STEPS, features=None):
  """`steps` global batches ``{"ids", "weights", "grads"}``, with duplicate ids within an example, within
  a replica (examples 0 and 1 are on one replica for every replica count) and across replicas (example
  B-1 is on the last), -1 padding in any position, an example with no ids, and ids 0 and V-1."""
  features = FEATURES if features is None else features
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(steps):
    ids, weights, grads = {}, {}, {}
    for f, (table, multi_hot, weighted) in features.items():
      if multi_hot:
        x = rng.integers(0, V, (B, L)).astype(np.int32)
        x[rng.random((B, L)) < 0.3] = -1
        x[0] = [5, 5, -1, 5]
        x[1] = [-1, V - 1, 0, 5]
        x[EMPTY_EXAMPLE] = -1
        x[B - 1] = [5, -1, V - 1, V - 1]
      else:
        x = rng.integers(0, V, (B,)).astype(np.int32)
        x[[0, 1, B - 1]] = V - 1
        x[EMPTY_EXAMPLE] = -1
        x[3] = 0
      ids[f] = x
      if weighted:  # nonzero at the padding positions too: they must weigh nothing
        weights[f] = rng.uniform(0.5, 2.0, x.shape).astype(np.float32)
      grads[f] = rng.standard_normal((B, TABLES[table][1])).astype(np.float32)
    batches.append({"ids": ids, "weights": weights, "grads": grads})
  return batches


INITIAL = make_initial_tables()
BATCHES = make_batches()


# -- the library under test ---------------------------------------------------------------------------


def ones(shape, dtype):
  return jnp.ones(shape, dtype)


def make_optimizer(name):
  kind, hp = OPTIMIZERS[name]
  return {"sgd": emb_lib.SGD, "adagrad": emb_lib.Adagrad, "adam": emb_lib.Adam}[kind](**hp)


def make_embedding(strategy, assignment, initial=INITIAL, features=None):
  """A TPUEmbedding of `features` whose tables start at `initial` and train with `assignment`."""
  features = FEATURES if features is None else features
  tables = {}
  for name, (combiner, dim) in TABLES.items():
    if any(t == name for t, _, _ in features.values()):
      tables[name] = emb_lib.TableConfig(
          V, dim, initializer=lambda shape, dtype, a=initial[name]: jnp.asarray(a, dtype),
          optimizer=None if name == GLOBAL_TABLE else make_optimizer(assignment[name]), combiner=combiner,
          name=name)
  feature_config = {f: emb_lib.FeatureConfig(tables[t], name=f) for f, (t, _, _) in features.items()}
  return emb_lib.TPUEmbedding(feature_config, make_optimizer(assignment[GLOBAL_TABLE]), strategy)


def reference(assignment, features=None):
  features = FEATURES if features is None else features
  tables = {t for t, _, _ in features.values()}
  return DenseReference({t: INITIAL[t] for t in tables}, {t: assignment[t] for t in tables}, features)


def make_step(emb):
  """One training step: the activations of the state it starts from, and the state after the update."""

  def step(state, batch):
    weights = {f: batch["weights"].get(f) for f in batch["ids"]}  # None: unweighted
    activations = emb.lookup(state, batch["ids"], weights)
    return emb.apply_gradients(state, batch["ids"], batch["grads"], weights), activations

  return step


_MODELS = {}


def model(strategies, n, layout=None):
  """(embedding, step) of all FEATURES on `n` replicas, shared by the tests (one compilation each); its
  tables on `layout` (None: the size rule's choice, the all-gather for these small tables)."""
  if (n, layout) not in _MODELS:
    emb = make_embedding(strategies[n], ASSIGNMENTS[ASSIGNMENT_OF[n]])
    if layout is not None:
      embedding_layout(emb, layout)
    _MODELS[n, layout] = emb, make_step(emb)
  return _MODELS[n, layout]


def gathered(strategy, activations):
  """The replicas' activations concatenated in replica order: the global batch's."""
  local = strategy.experimental_local_results(activations)
  return {f: np.concatenate([np.asarray(part[f]) for part in local]) for f in activations}


def poison_padding(state):
  """`state` with the padding rows of every table set to POISON (they must never be read or written)."""
  tables = {}
  for name, t in state["tables"].items():
    blocks = t.tree  # [N, ceil(V/N), D]
    array = np.array(blocks)
    flat = array.reshape(-1, array.shape[-1])
    flat[V:] = POISON
    tables[name] = tpustrat.ShardedVariable._wrap(jax.device_put(array, blocks.sharding), t.shape, t.axis)
  return {**state, "tables": tables}


def assert_matches(emb, state, ref, what):
  """Tables and optimizer slots of `state` equal the reference's."""
  tables = emb.embedding_tables(state)
  assert sorted(tables) == sorted(ref.tables)
  for name, expected in ref.tables.items():
    assert tables[name].shape == (V, TABLES[name][1])
    assert_close(tables[name], expected, err_msg=f"{what}: table {name}")
    assert sorted(state["slots"][name]) == sorted(ref.slots[name])
    for slot, value in ref.slots[name].items():
      assert_close(np.asarray(state["slots"][name][slot]), value, err_msg=f"{what}: slot {slot} of {name}")


def check_padding(emb, state, n, initial_state):
  """Blocks are [n, ceil(V/n), D]; the padding rows of tables and slots kept their values."""
  rows = -(-V // n)
  for name, (_, dim) in TABLES.items():
    assert emb.rows_per_replica(name) == rows
    blocks = np.asarray(state["tables"][name].tree)
    assert blocks.shape == (n, rows, dim)
    np.testing.assert_array_equal(blocks.reshape(-1, dim)[V:], POISON, err_msg=f"padding rows of {name}")
    for slot, table in state["slots"][name].items():
      got = np.asarray(table.tree).reshape(-1, dim)[V:]
      want = np.asarray(initial_state["slots"][name][slot].tree).reshape(-1, dim)[V:]
      np.testing.assert_array_equal(got, want, err_msg=f"padding rows of slot {slot} of {name}")


# -- training against the reference --------------------------------------------------------------------


@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_five_steps_match_dense_reference(strategies, n, layout):
  """SGD, Adagrad, lazy and non-lazy Adam (one per table), every combiner with and without weights, on
  both layouts (ids routed over all-to-all; blocks all-gathered and gradients reduce-scattered)."""
  strategy = strategies[n]
  emb, step = model(strategies, n, layout)
  assignment = ASSIGNMENTS[ASSIGNMENT_OF[n]]
  kinds = {(OPTIMIZERS[o][0], OPTIMIZERS[o][1].get("lazy_adam")) for o in assignment.values()}
  assert kinds == {("sgd", None), ("adagrad", None), ("adam", True), ("adam", False)}
  assert sorted(emb.table_names) == sorted(TABLES)  # in the order of the (sorted) feature dict
  state = emb.build()
  for name, table in emb.embedding_tables(state).items():
    np.testing.assert_array_equal(table, INITIAL[name])
  initial_state = state
  state = poison_padding(state)
  ref = reference(assignment)
  for s, batch in enumerate(BATCHES):
    state, activations = strategy.run(step, args=(state, distribute_batch(strategy, batch)))
    got = gathered(strategy, activations)
    expected = ref.lookup(batch["ids"], batch["weights"])
    for f in FEATURES:
      assert got[f].shape == (B, TABLES[FEATURES[f][0]][1])
      assert_close(got[f], expected[f], err_msg=f"step {s}: activations of {f}")
      np.testing.assert_array_equal(got[f][EMPTY_EXAMPLE], 0.0, err_msg=f"{f}: an example with no ids")
    ref.apply_gradients(batch["ids"], batch["grads"], batch["weights"])
  assert int(strategy.experimental_local_results(state["step"])[0]) == STEPS
  assert_matches(emb, state, ref, f"{n} replicas")
  check_padding(emb, state, n, initial_state)


def test_reference_sanity():
  """The reference itself, on hand-computed cases: TF's combiners, -1 padding, duplicates add up."""
  c = np_coefficients(np.array([[1, 1, -1], [-1, -1, -1], [2, 3, -1]]),
                      np.array([[1.0, 3.0, 9.0], [1.0, 1.0, 1.0], [3.0, 4.0, 9.0]]), "sqrtn")
  np.testing.assert_allclose(c, [[1 / np.sqrt(10), 3 / np.sqrt(10), 0], [0, 0, 0], [0.6, 0.8, 0]])
  c = np_coefficients(np.array([[1, 1, -1]]), np.array([[1.0, 3.0, 9.0]]), "mean")
  np.testing.assert_allclose(c, [[0.25, 0.75, 0]])
  features = {"f": ("t_sum", True, False)}
  table = np.arange(V * 4, dtype=np.float64).reshape(V, 4)
  ref = DenseReference({"t_sum": table}, {"t_sum": "sgd"}, features)
  ids = {"f": np.array([[3, 3, -1], [3, 5, 5]])}
  np.testing.assert_allclose(ref.lookup(ids)["f"], [2 * table[3], table[3] + 2 * table[5]])
  ref.apply_gradients(ids, {"f": np.ones((2, 4))})
  np.testing.assert_allclose(ref.tables["t_sum"][3], table[3] - 0.1 * 3)
  np.testing.assert_allclose(ref.tables["t_sum"][5], table[5] - 0.1 * 2)
  np.testing.assert_allclose(ref.tables["t_sum"][4], table[4])


def test_default_initializer_is_seeded_truncated_normal(strategies):
  table = emb_lib.TableConfig(V, 16, combiner="sum", name="t")
  emb = emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table)}, emb_lib.SGD(0.1), strategies[8])
  a, b, c = (emb.embedding_tables(emb.build(seed))["t"] for seed in (0, 0, 1))
  assert a.shape == (V, 16) and a.dtype == np.float32
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert np.abs(a).max() <= 2 / np.sqrt(16) + 1e-6  # truncated at 2 standard deviations
  assert 0.15 < a.std() < 0.25  # 1 / sqrt(16) = 0.25, truncation shrinks it to ~0.22
  blocks = np.asarray(emb.build(0)["tables"]["t"].tree)
  assert blocks.shape == (8, 5, 16)
  np.testing.assert_array_equal(blocks.reshape(-1, 16)[V:], 0.0)


@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_tables_and_slots_are_sharded_variables_split_by_rows(strategies, n):
  """A built table (and each optimizer slot) is a ShardedVariable of shape (V, D) along axis 0, blocks
  [n, ceil(V/n), D] split over the replicas; np.asarray of it is embedding_tables' array. Inside run a step
  sees LocalShards of the blocks, and the state comes back as ShardedVariables of the same layout."""
  strategy = strategies[n]
  emb = make_embedding(strategy, ASSIGNMENTS["A"], features={"sum_1": FEATURES["sum_1"]})  # lazy Adam: 2 slots
  state = emb.build()
  split = jax.sharding.NamedSharding(strategy.mesh, jax.sharding.PartitionSpec("replica"))
  rows = -(-V // n)

  def check(state, what):
    tables = emb.embedding_tables(state)
    for value in [state["tables"]["t_sum"], *state["slots"]["t_sum"].values()]:
      assert isinstance(value, tpustrat.ShardedVariable), (what, value)
      assert (value.shape, value.axis, value.num_replicas, value.dtype) == ((V, 4), 0, n, np.float32), (what, value)
      assert value.tree.shape == (n, rows, 4) and value.tree.sharding == split, (what, value.tree.sharding)
      assert [b.shape for b in strategy.experimental_local_results(value)] == [(rows, 4)] * n
      np.testing.assert_array_equal(np.asarray(value.tree).reshape(-1, 4)[V:], 0.0, err_msg=f"{what}: padding")
    np.testing.assert_array_equal(np.asarray(state["tables"]["t_sum"]), tables["t_sum"], err_msg=what)
    return tables["t_sum"], {k: np.asarray(v) for k, v in state["slots"]["t_sum"].items()}

  table, slots = check(state, "built")
  np.testing.assert_array_equal(table, INITIAL["t_sum"])
  assert sorted(slots) == ["momenta", "velocities"]
  for slot in slots.values():
    np.testing.assert_array_equal(slot, 0.0)

  seen = []

  def step(state, ids):
    seen.append([(type(x).__name__, x.shape, x.axis, x.block.shape)
                 for x in [state["tables"]["t_sum"], *state["slots"]["t_sum"].values()]])
    act = emb.lookup(state, {"sum_1": ids})
    return emb.apply_gradients(state, {"sum_1": ids}, {"sum_1": jnp.ones_like(act["sum_1"])})

  ids = np.arange(B, dtype=np.int32) * 2 % V
  state = strategy.run(step, args=(state, strategy.experimental_distribute_values_from_function(
      lambda ctx: ids[ctx.replica_id_in_sync_group * (B // n):(ctx.replica_id_in_sync_group + 1) * (B // n)])))
  assert seen == [[("LocalShard", (V, 4), 0, (rows, 4))] * 3]
  table, slots = check(state, "after a step")
  touched = np.zeros(V, bool)
  touched[ids] = True
  assert np.all(table[touched] != INITIAL["t_sum"][touched]) and np.all(slots["momenta"][touched] != 0)
  np.testing.assert_array_equal(table[~touched], INITIAL["t_sum"][~touched])  # lazy Adam
  np.testing.assert_array_equal(slots["velocities"][~touched], 0.0)


@pytest.mark.parametrize("dtype, vocab", [(np.int8, 200), (np.uint8, 300), (np.int16, 40_000), (np.int64, 200)])
def test_ids_of_a_narrow_integer_type_look_up_rows_beyond_its_range_of_v(strategies, dtype, vocab):
  """int8 ids on a 200-row table (V itself does not fit int8): the ids are compared with V in a type that
  holds it, so ids 5, 100 and 7 look up their rows and train (V did wrap to -56 and every id was padding);
  a uint8 255 on a 300-row table too. Against numpy: row i holds i, SGD(1.0) with gradient 1."""
  strategy = strategies[2]
  table = emb_lib.TableConfig(vocab, 1, combiner="sum", name="t",
                              initializer=lambda s, d: jnp.arange(s[0], dtype=d)[:, None])
  emb = emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table)}, emb_lib.SGD(1.0), strategy)
  last = np.iinfo(dtype).max if np.iinfo(dtype).max < vocab else vocab - 1
  x = np.array([[5, -1 if np.iinfo(dtype).min < 0 else 5], [100, 7], [last, 5], [7, 7]]).astype(dtype)

  def step(state, ids):
    act = emb.lookup(state, {"f": ids})["f"]
    return emb.apply_gradients(state, {"f": ids}, {"f": jnp.ones_like(act)}), act

  ids = strategy.experimental_distribute_values_from_function(
      lambda ctx: x[2 * ctx.replica_id_in_sync_group:2 * ctx.replica_id_in_sync_group + 2])
  state, act = strategy.run(step, args=(emb.build(), ids))
  flat = x.astype(np.int64)
  want_act = np.array([[sum(float(i) for i in row if i >= 0)] for row in flat])
  np.testing.assert_array_equal(np.concatenate(strategy.experimental_local_results(act)), want_act)
  want = np.arange(vocab, dtype=np.float64)[:, None]
  np.subtract.at(want, flat[flat >= 0], 1.0)
  np.testing.assert_array_equal(emb.embedding_tables(state)["t"], want)


def test_out_of_range_id_inside_run_looks_up_zeros_and_gets_no_update(strategies):
  strategy = strategies[4]
  table = emb_lib.TableConfig(V, 2, combiner="sum", name="t", initializer=ones)
  emb = emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table)}, emb_lib.SGD(0.5), strategy)

  def step(state, ids):
    act = emb.lookup(state, {"f": ids})
    return emb.apply_gradients(state, {"f": ids}, {"f": jnp.ones_like(act["f"])}), act["f"]

  ids = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([V, V + 2], np.int32))
  state = emb.build()
  for _ in range(2):
    state, act = strategy.run(step, args=(state, ids))
    np.testing.assert_array_equal(np.concatenate(strategy.experimental_local_results(act)), 0.0)
  np.testing.assert_array_equal(emb.embedding_tables(state)["t"], 1.0)
  blocks = np.asarray(state["tables"]["t"].tree)
  assert blocks.shape == (4, 10, 2)
  np.testing.assert_array_equal(blocks.reshape(-1, 2)[V:], 0.0)


def test_partial_batch_padding_masked_as_documented_does_not_touch_row_zero(strategies):
  """A partial batch is padded with zero rows (id 0); masking the ids with valid_mask, as lookup's
  docstring says, keeps row 0 untouched (lazy Adam would otherwise decay its moments)."""
  strategy = strategies[2]
  features = {"sum_1": FEATURES["sum_1"]}
  assignment = {"t_sum": "adam_lazy_in"}
  emb = make_embedding(strategy, assignment, features=features)
  rng = np.random.default_rng(11)
  first = {"ids": {"sum_1": np.arange(B, dtype=np.int32)},
           "grads": {"sum_1": rng.standard_normal((B, 4)).astype(np.float32)}}
  partial = {"ids": {"sum_1": np.full(B - 4, 20, np.int32)},  # 12 real examples, none with id 0
             "grads": {"sum_1": rng.standard_normal((B - 4, 4)).astype(np.float32)}}

  def step(state, batch):
    valid = tpustrat.valid_mask(batch["grads"]["sum_1"])
    ids = {"sum_1": jnp.where(valid, batch["ids"]["sum_1"], -1)}
    grads = {"sum_1": jnp.where(valid[:, None], batch["grads"]["sum_1"], 0.0)}
    return emb.apply_gradients(state, ids, grads), emb.lookup(state, ids)

  state = emb.build()
  ref = reference(assignment, features)
  for batch in strategy.experimental_distribute_dataset([first, partial]):
    state, _ = strategy.run(step, args=(state, batch))
  for batch in (first, partial):
    ref.apply_gradients(batch["ids"], batch["grads"])
  assert_matches(emb, state, ref, "after a partial batch")


# -- a dense layer on top ------------------------------------------------------------------------------


def test_dense_layer_gradients_flow_and_tables_train_with_activation_gradients(strategies):
  """loss = sum over replicas of 0.5 |[act_a, act_b] @ W + c - y|^2: the dense gradient is numpy's on the
  global batch, and the tables trained with d(loss)/d(activations) match the reference."""
  strategy = strategies[4]
  features = {"mean_u": FEATURES["mean_u"], "sum_1": FEATURES["sum_1"]}
  assignment = {"t_sum": "sgd", "t_mean": "adagrad"}
  emb = make_embedding(strategy, assignment, features=features)
  rng = np.random.default_rng(7)
  dims = [TABLES[FEATURES[f][0]][1] for f in features]
  params = {"w": rng.standard_normal((sum(dims), 2)).astype(np.float32),
            "c": np.array([0.5, -0.25], np.float32)}
  lr = 0.05

  def step(state, params, batch):
    ctx = tpustrat.get_replica_context()
    act = emb.lookup(state, batch["ids"])

    def loss_fn(params, act):
      x = jnp.concatenate([act[f] for f in features], axis=1)
      return 0.5 * jnp.sum((x @ params["w"] + params["c"] - batch["y"]) ** 2)

    loss, (g_params, g_act) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, act)
    # no all_reduce: the gradients w.r.t. replicated (Mirrored) parameters are already summed over replicas
    new_params = jax.tree.map(lambda p, g: p - lr * g, params, g_params)
    return emb.apply_gradients(state, batch["ids"], g_act), new_params, ctx.all_reduce("sum", loss), g_params

  batches = make_batches(seed=8, steps=3, features=features)
  ref = reference(assignment, features)
  ref_params = {k: v.astype(np.float64) for k, v in params.items()}
  state = emb.build()
  for s, batch in enumerate(batches):
    y = rng.standard_normal((B, 2)).astype(np.float32)
    dist = distribute_batch(strategy, {"ids": batch["ids"], "y": y})
    state, params, loss, g_params = strategy.run(step, args=(state, params, dist))
    assert isinstance(params["w"], tpustrat.Mirrored) and isinstance(loss, tpustrat.Mirrored)
    params = {k: np.asarray(strategy.experimental_local_results(v)[0]) for k, v in params.items()}
    # numpy on the global batch
    act = ref.lookup(batch["ids"])
    x = np.concatenate([act[f] for f in features], axis=1)
    r = x @ ref_params["w"] + ref_params["c"] - y
    want = {"w": x.T @ r, "c": r.sum(0)}
    assert_close(strategy.experimental_local_results(loss)[0], 0.5 * (r ** 2).sum(), err_msg=f"step {s}: loss")
    scale = np.abs(x).sum() * np.abs(r).max() + np.abs(r).sum()  # of the terms the gradients add up
    for k in want:
      assert_close(strategy.experimental_local_results(g_params[k])[0], want[k], scale=scale,
                   err_msg=f"step {s}: d loss / d {k}")
    g_x = r @ ref_params["w"].T
    g_act = dict(zip(features, np.split(g_x, np.cumsum(dims)[:-1], axis=1)))
    ref.apply_gradients(batch["ids"], g_act)
    ref_params = {k: ref_params[k] - lr * want[k] for k in want}
    for k in params:
      assert_close(params[k], ref_params[k], err_msg=f"step {s}: {k}")
    assert_matches(emb, state, ref, f"step {s}")


# -- checkpoints ---------------------------------------------------------------------------------------


def test_checkpoint_saved_on_8_replicas_restores_on_4_and_training_continues(strategies, tmp_path):
  assert ASSIGNMENT_OF[8] == ASSIGNMENT_OF[4]  # slots: Adagrad accumulators, Adam moments (lazy and not)
  emb8, step8 = model(strategies, 8)
  emb4, step4 = model(strategies, 4)
  s8, s4 = strategies[8], strategies[4]
  ref = reference(ASSIGNMENTS[ASSIGNMENT_OF[4]])
  state = emb8.build()
  for batch in BATCHES[:2]:
    state, _ = s8.run(step8, args=(state, distribute_batch(s8, batch)))
    ref.apply_gradients(batch["ids"], batch["grads"], batch["weights"])
  with CheckpointManager(tmp_path / "ckpt", s8) as manager:
    manager.save(2, state)
  with CheckpointManager(tmp_path / "ckpt", s4) as manager:
    restored = manager.restore(target=emb4.build(seed=3))

  assert int(s4.experimental_local_results(restored["step"])[0]) == 2
  saved_tables, restored_tables = emb8.embedding_tables(state), emb4.embedding_tables(restored)
  for name, (_, dim) in TABLES.items():
    assert isinstance(restored["tables"][name], tpustrat.ShardedVariable)
    assert restored["tables"][name].shape == (V, dim) and restored["tables"][name].axis == 0
    assert np.asarray(restored["tables"][name].tree).shape == (4, 10, dim)
    assert restored_tables[name].shape == (V, dim)
    np.testing.assert_array_equal(restored_tables[name], saved_tables[name])
    assert sorted(restored["slots"][name]) == sorted(state["slots"][name])
    for slot in state["slots"][name]:
      np.testing.assert_array_equal(np.asarray(restored["slots"][name][slot]), np.asarray(state["slots"][name][slot]),
                                    err_msg=f"slot {slot} of {name}")
      padding = np.asarray(restored["slots"][name][slot].tree).reshape(-1, dim)[V:]
      np.testing.assert_array_equal(padding, 0.0)
  assert_matches(emb4, restored, ref, "restored")

  state = restored
  for s, batch in enumerate(BATCHES[2:], start=2):
    state, activations = s4.run(step4, args=(state, distribute_batch(s4, batch)))
    got, expected = gathered(s4, activations), ref.lookup(batch["ids"], batch["weights"])
    for f in FEATURES:
      assert_close(got[f], expected[f], err_msg=f"step {s}: activations of {f}")
    ref.apply_gradients(batch["ids"], batch["grads"], batch["weights"])
  assert int(s4.experimental_local_results(state["step"])[0]) == STEPS
  assert_matches(emb4, state, ref, "4 replicas after the restore")


def trained_on_8(strategies, steps=2):
  """The state after `steps` training steps on 8 replicas (assignment A: every kind of slot)."""
  emb8, step8 = model(strategies, 8)
  state = emb8.build()
  for batch in BATCHES[:steps]:
    state, _ = strategies[8].run(step8, args=(state, distribute_batch(strategies[8], batch)))
  return state


def as_numpy(state):
  """{"tables/<name>" and "slots/<name>/<slot>": the whole [V, D] value} of an embedding state."""
  out = {f"tables/{name}": np.asarray(t) for name, t in state["tables"].items()}
  out.update({f"slots/{name}/{slot}": np.asarray(v) for name, slots in state["slots"].items()
              for slot, v in slots.items()})
  return out


@pytest.mark.parametrize("n", (8, 4, 2, 1))
def test_tables_and_slots_saved_on_8_replicas_restore_on_n_as_sharded_variables(strategies, tmp_path, n):
  """Tables and slots go through the checkpoint's ShardedVariable path: saved as their [8, 5, D] blocks,
  restored re-padded and re-split onto n replicas ([n, ceil(V/n), D], zero padding), bit for bit."""
  state = trained_on_8(strategies)
  saved = as_numpy(state)
  assert np.any(saved["slots/t_sum/momenta"] != 0) and np.any(saved["slots/t_mean/accumulators"] != 0.1)
  with CheckpointManager(tmp_path / "ckpt", strategies[8]) as manager:
    manager.save(2, state)
  emb = make_embedding(strategies[n], ASSIGNMENTS[ASSIGNMENT_OF[8]], initial=make_initial_tables(seed=7))
  target = emb.build()
  with CheckpointManager(tmp_path / "ckpt", strategies[n]) as manager:
    restored = manager.restore(target=target)
  split = jax.sharding.NamedSharding(strategies[n].mesh, jax.sharding.PartitionSpec("replica"))
  for path, value in jax.tree_util.tree_flatten_with_path(
      {"tables": restored["tables"], "slots": restored["slots"]}, is_leaf=lambda x: isinstance(x, tpustrat.DistributedValues))[0]:
    where = jax.tree_util.keystr(path)
    assert isinstance(value, tpustrat.ShardedVariable), where
    dim = value.shape[1]
    assert (value.shape, value.axis, value.tree.shape) == ((V, dim), 0, (n, -(-V // n), dim)), where
    assert value.tree.sharding == split, where
    np.testing.assert_array_equal(np.asarray(value.tree).reshape(-1, dim)[V:], 0.0, err_msg=f"{where}: padding")
  got = as_numpy(restored)
  assert sorted(got) == sorted(saved)
  for key, value in saved.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  np.testing.assert_array_equal(emb.embedding_tables(restored)["t_sum"], saved["tables/t_sum"])
  assert int(strategies[n].experimental_local_results(restored["step"])[0]) == 2


def test_tables_restore_whole_onto_mirrored_and_back(strategies, tmp_path):
  """As every ShardedVariable: a table saved sharded restores whole where the target holds a Mirrored
  [V, D] array (a dense model's embedding), and a Mirrored [V, D] array saved restores as a table."""
  s8, s4 = strategies[8], strategies[4]
  state = trained_on_8(strategies)
  saved = as_numpy(state)
  with CheckpointManager(tmp_path / "sharded", s8) as manager:
    manager.save(2, state)
  dense_target = jax.tree.map(
      lambda v: s4.experimental_mirror(np.zeros(v.shape, np.float32)) if isinstance(v, tpustrat.ShardedVariable)
      else v, state, is_leaf=lambda x: isinstance(x, tpustrat.DistributedValues))
  with CheckpointManager(tmp_path / "sharded", s4) as manager:
    dense = manager.restore(target=dense_target)
  for name in TABLES:
    assert isinstance(dense["tables"][name], tpustrat.Mirrored)
    np.testing.assert_array_equal(np.asarray(dense["tables"][name].tree), saved[f"tables/{name}"], err_msg=name)
    for slot, value in dense["slots"][name].items():
      assert isinstance(value, tpustrat.Mirrored)
      np.testing.assert_array_equal(np.asarray(value.tree), saved[f"slots/{name}/{slot}"], err_msg=f"{name} {slot}")
  whole = {"tables": {name: s8.experimental_mirror(saved[f"tables/{name}"]) for name in TABLES}}
  with CheckpointManager(tmp_path / "whole", s8) as manager:
    manager.save(1, whole)
  emb4 = make_embedding(s4, ASSIGNMENTS[ASSIGNMENT_OF[4]], initial=make_initial_tables(seed=7))
  with CheckpointManager(tmp_path / "whole", s4) as manager:
    restored = manager.restore(target={"tables": emb4.build()["tables"]})
  for name in TABLES:
    assert isinstance(restored["tables"][name], tpustrat.ShardedVariable)
    np.testing.assert_array_equal(np.asarray(restored["tables"][name]), saved[f"tables/{name}"], err_msg=name)


def test_checkpoint_in_the_layout_of_sharded_tables_restores(strategies, tmp_path):
  """Checkpoints written before tables were ShardedVariables (embedding.ShardedTable, saved as
  ``{"blocks": [N, ceil(V/N), D]}``, the PerReplica's stacked array) hold the layout ShardedVariables are
  saved in, so they restore into today's state (onto another replica count too)."""
  state = trained_on_8(strategies)
  saved = as_numpy(state)

  def old_layout(v):  # what the ShardedTable node was unwrapped to
    return {"blocks": tpustrat.PerReplica.from_stacked(v.tree)}

  old = {"tables": {k: old_layout(v) for k, v in state["tables"].items()},
         "slots": {k: {s: old_layout(v) for s, v in slots.items()} for k, slots in state["slots"].items()},
         "step": state["step"]}
  with CheckpointManager(tmp_path / "ckpt", strategies[8]) as manager:
    manager.save(2, old)
  emb4 = make_embedding(strategies[4], ASSIGNMENTS[ASSIGNMENT_OF[4]], initial=make_initial_tables(seed=7))
  with CheckpointManager(tmp_path / "ckpt", strategies[4]) as manager:
    restored = manager.restore(target=emb4.build())
  got = as_numpy(restored)
  for key, value in saved.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)


# -- experimental_run_steps ----------------------------------------------------------------------------


def test_run_steps_over_a_distributed_dataset_equals_step_by_step(strategies):
  strategy = strategies[4]
  features = {f: FEATURES[f] for f in ("sum_w", "mean_w1")}
  assignment = {"t_sum": "adam_dense_out", "t_mean": "adam_lazy_in"}
  emb = make_embedding(strategy, assignment, features=features)
  step = make_step(emb)
  batches = [{k: {f: v for f, v in part.items() if f in features} for k, part in batch.items()}
             for batch in BATCHES]
  dist = strategy.experimental_distribute_dataset(batches)  # a list of global batches

  by_step, by_step_acts = emb.build(), []
  for batch in dist:
    by_step, act = strategy.run(step, args=(by_step, batch))
    by_step_acts.append(gathered(strategy, act))

  state, outputs = strategy.experimental_run_steps(step, iter(dist), STEPS, init=emb.build())
  assert isinstance(state["tables"]["t_sum"], tpustrat.ShardedVariable)
  assert state["tables"]["t_sum"].shape == (V, 4) and state["tables"]["t_sum"].axis == 0
  assert np.asarray(state["tables"]["t_sum"].tree).shape == (4, 10, 4)
  assert int(strategy.experimental_local_results(state["step"])[0]) == STEPS
  per_step = tpustrat.unstack_steps(outputs)
  assert len(per_step) == STEPS
  ref = reference(assignment, features)
  for s, batch in enumerate(batches):
    got, expected = gathered(strategy, per_step[s]), ref.lookup(batch["ids"], batch["weights"])
    for f in features:
      assert_close(got[f], by_step_acts[s][f], rtol=1e-6, err_msg=f"step {s}: {f}, scan vs run")
      assert_close(got[f], expected[f], err_msg=f"step {s}: {f}, scan vs reference")
    ref.apply_gradients(batch["ids"], batch["grads"], batch["weights"])
  scanned, stepped = emb.embedding_tables(state), emb.embedding_tables(by_step)
  for name in scanned:
    assert_close(scanned[name], stepped[name], rtol=1e-6, err_msg=f"table {name}, scan vs run")
    for slot in state["slots"][name]:
      assert_close(np.asarray(state["slots"][name][slot]), np.asarray(by_step["slots"][name][slot]), rtol=1e-6,
                   err_msg=f"slot {slot} of {name}, scan vs run")
  assert_matches(emb, state, ref, "experimental_run_steps")


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: emb_lib.TableConfig(V, 4, combiner="max"), "combiner"),
    (lambda: emb_lib.TableConfig(0, 4), "vocabulary_size"),
    (lambda: emb_lib.TableConfig(True, 4), "vocabulary_size"),
    (lambda: emb_lib.TableConfig(V, 0), "dim"),
    (lambda: emb_lib.SGD(learning_rate=-1), "learning_rate"),
    (lambda: emb_lib.Adagrad(learning_rate=-1), "learning_rate"),
    (lambda: emb_lib.Adagrad(initial_accumulator_value=0.0), "initial_accumulator_value"),
    (lambda: emb_lib.Adam(learning_rate=-1), "learning_rate"),
    (lambda: emb_lib.Adam(beta_1=1.0), "beta_1"),
    (lambda: emb_lib.Adam(epsilon=0.0), "epsilon"),
    (lambda: emb_lib.FeatureConfig(emb_lib.TableConfig(V, 4), max_sequence_length=-1), "max_sequence_length"),
    (lambda: emb_lib.FeatureConfig(emb_lib.TableConfig(V, 4), max_sequence_length=True), "max_sequence_length"),
    (lambda: emb_lib.TableConfig(V, 4, max_ids_per_partition=0), "max_ids_per_partition"),
    (lambda: emb_lib.TableConfig(V, 4, max_unique_ids_per_partition=2.5), "max_unique_ids_per_partition"),
], ids=["combiner_max", "vocabulary_size_0", "vocabulary_size_bool", "dim_0", "sgd_lr_-1", "adagrad_lr_-1",
        "adagrad_accumulator_0", "adam_lr_-1", "adam_beta_1_1", "adam_epsilon_0", "sequence_length_-1",
        "sequence_length_bool", "max_ids_0", "max_unique_ids_float"])
def test_bad_config_raises_value_error(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_config_types_and_embedding_arguments(strategies):
  with pytest.raises(TypeError, match="table"):
    emb_lib.FeatureConfig("t")
  with pytest.raises(TypeError, match="optimizer"):
    emb_lib.TableConfig(V, 4, optimizer="sgd")
  with pytest.raises(TypeError, match="initializer"):
    emb_lib.TableConfig(V, 4, initializer=np.zeros((V, 4)))
  table = emb_lib.TableConfig(V, 4, name="t")
  with pytest.raises(ValueError, match="no optimizer"):
    emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table)}, None, strategies[8])
  same_name = emb_lib.TableConfig(V, 4, name="t")
  with pytest.raises(ValueError, match="distinct"):
    emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table), "g": emb_lib.FeatureConfig(same_name)},
                         emb_lib.SGD(), strategies[8])
  wrong = emb_lib.TableConfig(V, 4, name="w", initializer=lambda shape, dtype: jnp.zeros((V + 1, 4), dtype))
  with pytest.raises(ValueError, match="shape"):
    emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(wrong)}, emb_lib.SGD(), strategies[8]).build()


def test_lookup_and_apply_gradients_outside_run_raise_runtime_error(strategies):
  emb, _ = model(strategies, 8)
  state = emb.build()
  ids = {f: batch_ids[:2] for f, batch_ids in BATCHES[0]["ids"].items()}
  with pytest.raises(RuntimeError, match="strategy.run"):
    emb.lookup(state, ids)
  grads = {f: g[:2] for f, g in BATCHES[0]["grads"].items()}
  with pytest.raises(RuntimeError, match="strategy.run"):
    emb.apply_gradients(state, ids, grads)
  with pytest.raises(RuntimeError, match="strategy.run"):
    strategies[8].run(lambda: emb.build())


def test_a_table_that_is_not_a_row_block_inside_run_raises_type_error(strategies):
  """A state whose table reaches the step whole (Mirrored, say) names the table instead of failing later."""
  strategy = strategies[2]
  emb = make_embedding(strategy, ASSIGNMENTS["A"], features={"sum_1": FEATURES["sum_1"]})
  state = emb.build()
  state = {**state, "tables": {"t_sum": strategy.experimental_mirror(np.asarray(state["tables"]["t_sum"]))}}
  ids = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([1, 2], np.int32))
  with pytest.raises(TypeError, match="table 't_sum'.*LocalShard"):
    strategy.run(lambda state, ids: emb.lookup(state, {"sum_1": ids}), args=(state, ids))


@pytest.mark.parametrize("bad", [V, -2])
def test_check_ids_names_an_out_of_range_id(strategies, bad):
  strategy = strategies[8]
  table = emb_lib.TableConfig(V, 2, combiner="sum", name="t", initializer=ones)
  emb = emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table, name="feat")}, emb_lib.SGD(0.5), strategy)
  emb.check_ids({"f": np.array([[0, V - 1], [-1, -1]], np.int32)})  # fine: -1 is padding
  with pytest.raises(ValueError, match=rf"'feat' holds id {bad}\b"):
    emb.check_ids({"f": np.array([[0, bad], [-1, 3]], np.int32)})
  per_replica = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.array([bad if ctx.replica_id_in_sync_group == 5 else 1], np.int32))
  with pytest.raises(ValueError, match=rf"holds id {bad}\b"):
    emb.check_ids({"f": per_replica})
  # a concrete (captured) numpy feature is checked by lookup inside run too
  host = np.array([1, bad], np.int32)
  with pytest.raises(ValueError, match=rf"holds id {bad}\b"):
    strategy.run(lambda state: emb.lookup(state, {"f": host}), args=(emb.build(),))


def test_wrong_gradient_weight_and_id_shapes_raise_value_error(strategies):
  strategy = strategies[8]
  table = emb_lib.TableConfig(V, 2, combiner="mean", name="t", initializer=ones)
  emb = emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table, name="feat")}, emb_lib.SGD(0.5), strategy)
  state = emb.build()
  ids = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([[1, 2], [3, -1]], np.int32))

  def apply(grad_shape):
    return lambda state, ids: emb.apply_gradients(state, {"f": ids}, {"f": jnp.ones(grad_shape)})

  for shape in [(2, 3), (1, 2), (2,), (2, 2, 1)]:
    with pytest.raises(ValueError, match=r"gradient of feature 'feat' has shape"):
      strategy.run(apply(shape), args=(state, ids))
  with pytest.raises(ValueError, match="weights of feature 'feat'"):
    strategy.run(lambda state, ids: emb.lookup(state, {"f": ids}, {"f": jnp.ones((2, 3))}), args=(state, ids))
  with pytest.raises(ValueError, match="must be int"):
    strategy.run(lambda state, ids: emb.lookup(state, {"f": ids.astype(jnp.float32)}), args=(state, ids))
  with pytest.raises(ValueError, match="must be int"):
    strategy.run(lambda state, ids: emb.lookup(state, {"f": ids[None]}), args=(state, ids))


def test_messages_name_unnamed_features_by_path_and_bad_structures_and_states(strategies):
  """An unnamed feature is named by its path in the feature config; weights or gradients without a
  feature's entry, and the state of another embedding, get a ValueError naming what was expected."""
  strategy = strategies[2]
  table = emb_lib.TableConfig(V, 2, combiner="mean", name="t", initializer=ones)
  other = emb_lib.TableConfig(V, 2, combiner="mean", name="u", initializer=ones)
  config = {"clicks": emb_lib.FeatureConfig(table), "views": emb_lib.FeatureConfig(other)}
  emb = emb_lib.TPUEmbedding(config, emb_lib.SGD(0.5), strategy)
  state = emb.build()
  ids = strategy.experimental_distribute_values_from_function(lambda ctx: np.array([[1, 2], [3, -1]], np.int32))
  feats = lambda ids: {"clicks": ids, "views": ids}  # noqa: E731
  with pytest.raises(ValueError, match=r"the ids of feature \"\['clicks'\]\" must be int"):
    strategy.run(lambda st, ids: emb.lookup(st, {"clicks": ids.astype(jnp.float32), "views": ids}), args=(state, ids))
  with pytest.raises(ValueError, match=r"the weights must have the structure of the feature config"):
    strategy.run(lambda st, ids: emb.lookup(st, feats(ids), {"clicks": jnp.ones((2, 2))}), args=(state, ids))
  with pytest.raises(ValueError, match=r"the gradients must have the structure of the feature config"):
    strategy.run(lambda st, ids: emb.apply_gradients(st, feats(ids), {"clicks": jnp.ones((2, 2))}),
                 args=(state, ids))
  with pytest.raises(ValueError, match=r"gradient of feature \"\['views'\]\" has shape \(2, 3\)"):
    strategy.run(lambda st, ids: emb.apply_gradients(
        st, feats(ids), {"clicks": jnp.ones((2, 2)), "views": jnp.ones((2, 3))}), args=(state, ids))
  one_table = emb_lib.TPUEmbedding({"clicks": emb_lib.FeatureConfig(table)}, emb_lib.SGD(0.5), strategy)
  with pytest.raises(ValueError, match=r"the state must be what this embedding's build\(\) returned.*missing \['u'\]"):
    strategy.run(lambda st, ids: emb.lookup(st, feats(ids)), args=(one_table.build(), ids))
  with pytest.raises(ValueError, match=r"table names must be distinct, got \['table_1', 'table_1'\] \(a table without"):
    emb_lib.TPUEmbedding({"a": emb_lib.FeatureConfig(emb_lib.TableConfig(V, 2, name="table_1")),
                          "b": emb_lib.FeatureConfig(emb_lib.TableConfig(V, 2))}, emb_lib.SGD(0.5), strategy)


def test_check_ids_takes_one_distributed_value_of_the_features_and_reads_sequences_up_to_their_length(strategies):
  """`experimental_distribute_values_from_function(lambda ctx: {"f": ...})` (one distributed value of
  the whole structure) is checked replica by replica; a sequence feature's ids past its
  max_sequence_length (which lookup truncates away) are not checked."""
  strategy = strategies[2]
  table = emb_lib.TableConfig(V, 2, name="t", initializer=ones)
  emb = emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table, name="f"),
                              "s": emb_lib.FeatureConfig(table, max_sequence_length=2, name="s")},
                             emb_lib.SGD(0.5), strategy)
  good = np.array([[1, 2, V + 5], [3, -1, -1]], np.int32)  # V + 5 sits past the sequence's length 2
  emb.check_ids(strategy.experimental_distribute_values_from_function(lambda ctx: {"f": good[:, :1], "s": good}))

  def bad_on_replica_1(ctx):
    return {"f": np.array([[1], [V if ctx.replica_id_in_sync_group == 1 else 2]], np.int32), "s": good}

  with pytest.raises(ValueError, match=rf"feature 'f' holds id {V}, outside \[0, {V}\)"):
    emb.check_ids(strategy.experimental_distribute_values_from_function(bad_on_replica_1))
  with pytest.raises(ValueError, match=rf"feature 's' holds id {V + 5}"):
    emb.check_ids({"f": good[:, :1], "s": np.concatenate([good[:, 2:], good[:, :1]], axis=1)})


# -- padding examples of a partial batch touch no row -----------------------------------------------------

PADDING_OPTIMIZERS = {
    "ftrl": lambda: emb_lib.FTRL(learning_rate=0.5, l1_regularization_strength=0.01),
    "lazy-adam": lambda: emb_lib.Adam(learning_rate=0.1),
    "adagrad-momentum": lambda: emb_lib.AdagradMomentum(learning_rate=0.1, momentum=0.9),
}
# How the step hands the batch's ids to the embedding: as the batch holds them, or computed from them.
PADDING_IDS = {
    "as-given": lambda ids: ids,
    "computed": lambda ids: ids + 1,  # elementwise: the batch's rows, traced through the program (padding: row 1)
    "masked-by-the-caller": lambda ids: jnp.where(tpustrat.valid_mask(ids), ids, -1),
}


@pytest.mark.parametrize("how", sorted(PADDING_IDS))
@pytest.mark.parametrize("opt", sorted(PADDING_OPTIMIZERS))
@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
def test_padding_examples_of_a_partial_batch_touch_no_row(strategy, layout, opt, how):
  # A 50 x 2 table on 8 replicas; batches of 16 and 13 examples (2 per replica: the second is padded with
  # zeros, id 0, on replicas 6 and 7). The padding's row (0, or 1 for ids computed as ids + 1) is looked up
  # by no real example of the second batch. For lazy Adam and AdagradMomentum real examples of the first
  # batch look it up, so that its momentum is not zero (a touched row would move on it); for FTRL none
  # does (a touched row would be reset to FTRL's closed form, 0 for a row without gradients).
  rng = np.random.default_rng(3)
  first = rng.integers(1, 49, size=16).astype(np.int32)
  if opt != "ftrl":
    first[[2, 9]] = 0
  second = rng.integers(1, 49, size=13).astype(np.int32)
  compute = PADDING_IDS[how]
  real_second = np.unique(np.asarray(compute(jnp.asarray(second))))
  padding_row = int(np.asarray(compute(jnp.zeros((1,), jnp.int32)))[0])
  assert padding_row not in real_second
  assert (padding_row in np.asarray(compute(jnp.asarray(first)))) == (opt != "ftrl")
  emb = embedding_layout(emb_lib.TPUEmbedding(
      {"f": emb_lib.FeatureConfig(emb_lib.TableConfig(50, 2, optimizer=PADDING_OPTIMIZERS[opt](), name="t"))},
      strategy=strategy), layout)
  state = emb.build(seed=0)

  def step(state, batch):
    ids = compute(batch["ids"])
    acts = emb.lookup(state, {"f": ids})
    # The loss masks the padding examples, as the guides teach: d(sum of real activations) / d(activations).
    grads = jnp.where(tpustrat.valid_mask(batch["ids"])[:, None], jnp.ones_like(acts["f"]), 0.0)
    return emb.apply_gradients(state, {"f": ids}, {"f": grads})

  batches = iter(strategy.experimental_distribute_dataset([{"ids": first}, {"ids": second}]))
  state = strategy.run(step, args=(state, next(batches)))
  after_first = emb.embedding_tables(state)["t"].copy()
  state = strategy.run(step, args=(state, next(batches)))
  after_second = emb.embedding_tables(state)["t"]
  # Row 0 (and every row no real example of the second batch looked up) is as the first step left it.
  untouched = np.setdiff1d(np.arange(50), real_second)
  np.testing.assert_array_equal(after_second[untouched], after_first[untouched])
  assert not np.allclose(after_second[real_second], after_first[real_second])  # the real rows did move


def test_ids_whose_rows_cannot_be_traced_warn_and_keep_every_row(strategy):
  emb = emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(emb_lib.TableConfig(50, 2, optimizer=emb_lib.SGD(0.1),
                                                                             name="t"))}, strategy=strategy)
  state = emb.build(seed=0)
  ids = np.arange(1, 14, dtype=np.int32)
  batch = next(iter(strategy.experimental_distribute_dataset([{"ids": ids}])))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    acts = strategy.run(lambda s, b: emb.lookup(s, {"f": jnp.sort(b["ids"])}), args=(state, batch))
  messages = [str(w.message) for w in caught if issubclass(w.category, tpustrat.BatchRowsWarning)]
  # One for the ids, one for the output (whose rows are the sorted ids').
  assert any(re.search(r"the ids of feature \"\['f'\]\" .* cannot be traced to one batch: they pass through "
                       r"`sort`.*valid_mask", m) for m in messages), messages
  # Nothing left out: replica 6's padding row (a copy of the batch's first id, 1, first after the sort) is
  # looked up.
  table = emb.embedding_tables(state)["t"]
  np.testing.assert_allclose(np.asarray(acts["f"].tree)[6], table[[ids[0], 13]], rtol=1e-6)
