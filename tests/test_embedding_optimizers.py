"""tpustrat.embedding.FTRL and AdagradMomentum against numpy references of TF's update rules.

The references (float64) follow TF's kernels, not the library's code: FTRL as TF's ``ApplyFtrlV2`` with
``l2 + beta / (2 * lr)`` for ``beta`` (the equivalence `optimization_parameters.proto` states) and its
``|linear| > l1`` select; Adagrad with momentum as TF's TPU embedding correctness test checks it. Four
tables (two FTRL, two AdagradMomentum, with l1 / l2 / beta / learning_rate_power / multiply_linear_by_lr
/ nesterov / exponent / beta2 set) train for several steps of ``lookup`` + ``apply_gradients`` on 1, 2 and
8 replicas over the same global batches, with duplicate ids within an example, within a replica and
across replicas, -1 padding and rows never looked up; each row's gradients are summed before its one
update (TF's gradient accumulation). Also: slot names and initial values, TF's defaults, equivalences
(multiply_linear_by_learning_rate; AdagradMomentum without momentum is Adagrad) and bad arguments.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EMBEDDING_LAYOUTS, assert_close, distribute_batch, embedding_layout

import tpustrat
from tpustrat import embedding as emb_lib

V = 13  # not a multiple of 2 or 8: the last block holds padding rows
UNTOUCHED = 3  # ids are drawn from [0, V - UNTOUCHED): the last rows are never looked up
B = 8  # global batch
L = 3  # ids per example
STEPS = 4
REPLICA_COUNTS = (1, 2, 8)

# table name: (combiner, dim, optimizer kind, hyperparameters)
TABLES = {
    "ftrl": ("sum", 3, "ftrl", {"learning_rate": 0.5, "l1_regularization_strength": 0.5,
                                "l2_regularization_strength": 0.1, "beta": 0.3,
                                "initial_accumulator_value": 0.2}),
    "ftrl_lin_lr": ("mean", 2, "ftrl", {"learning_rate": 0.3, "learning_rate_power": -0.3,
                                        "l1_regularization_strength": 0.02, "l2_regularization_strength": 0.05,
                                        "beta": 0.1, "multiply_linear_by_learning_rate": True}),
    "agm_nesterov": ("sum", 3, "agm", {"learning_rate": 0.1, "momentum": 0.9, "use_nesterov": True,
                                       "exponent": 3.0, "beta2": 0.9, "epsilon": 0.1}),
    "agm": ("mean", 2, "agm", {"learning_rate": 0.2, "momentum": 0.5, "epsilon": 1e-3}),
}
FTRL_DEFAULTS = {"learning_rate": 0.001, "learning_rate_power": -0.5, "l1_regularization_strength": 0.0,
                 "l2_regularization_strength": 0.0, "beta": 0.0, "initial_accumulator_value": 0.1,
                 "multiply_linear_by_learning_rate": False}
AGM_DEFAULTS = {"learning_rate": 0.001, "momentum": 0.0, "use_nesterov": False, "exponent": 2.0, "beta2": 1.0,
                "epsilon": 1e-10}


# -- numpy references of TF's rules ---------------------------------------------------------------------


def np_ftrl(var, accum, linear, g, hp):
  """One FTRL step on rows whose summed gradient is `g` (TF's ApplyFtrlV2, beta folded into l2)."""
  hp = {**FTRL_DEFAULTS, **hp}
  lr, lr_power = hp["learning_rate"], hp["learning_rate_power"]
  l1 = hp["l1_regularization_strength"]
  l2 = hp["l2_regularization_strength"] + hp["beta"] / (2 * lr)
  new_accum = accum + g * g
  if hp["multiply_linear_by_learning_rate"]:
    linear = linear + g * lr - (new_accum ** -lr_power - accum ** -lr_power) * var
    quadratic = new_accum ** -lr_power + 2 * l2 * lr
    l1 = l1 * lr
  else:
    linear = linear + g - (new_accum ** -lr_power - accum ** -lr_power) / lr * var
    quadratic = new_accum ** -lr_power / lr + 2 * l2
  var = np.where(np.abs(linear) > l1, (np.sign(linear) * l1 - linear) / quadratic, 0.0)
  return var, new_accum, linear


def np_adagrad_momentum(var, accum, momenta, g, hp):
  """One Adagrad-with-momentum step (as TF's tpu_embedding_base_test checks it on TPUs)."""
  hp = {**AGM_DEFAULTS, **hp}
  if hp["beta2"] == 1.0:
    accum = accum + g ** 2
  else:
    accum = hp["beta2"] * accum + (1 - hp["beta2"]) * g ** 2
  accumulator_power = np.power(accum + hp["epsilon"], -1.0 / hp["exponent"])
  momenta = hp["momentum"] * momenta + g * accumulator_power
  if hp["use_nesterov"]:
    update = hp["momentum"] * momenta + g * accumulator_power
  else:
    update = momenta
  return var - hp["learning_rate"] * update, accum, momenta


class Reference:
  """Whole tables (float64), one global batch per step; each touched row updated once with its summed
  gradient, the others (and their slots) left alone."""

  def __init__(self, initial):
    self.tables = {name: np.array(t, np.float64) for name, t in initial.items()}
    self.slots = {}
    for name, (_, dim, kind, hp) in TABLES.items():
      if kind == "ftrl":
        init = {**FTRL_DEFAULTS, **hp}["initial_accumulator_value"]
        self.slots[name] = {"accumulators": np.full((V, dim), init), "linears": np.zeros((V, dim))}
      else:
        self.slots[name] = {"accumulators": np.zeros((V, dim)), "momenta": np.zeros((V, dim))}

  def lookup(self, ids):
    out = {}
    for name, (combiner, dim, _, _) in TABLES.items():
      act = np.zeros((B, dim))
      for i in range(B):
        valid = [j for j in ids[name][i] if j >= 0]
        for j in valid:
          act[i] += self.tables[name][j] / (len(valid) if combiner == "mean" else 1)
      out[name] = act
    return out

  def apply_gradients(self, ids, grads):
    for name, (combiner, dim, kind, hp) in TABLES.items():
      g = np.zeros((V, dim))
      touched = np.zeros(V, bool)
      for i in range(B):
        valid = [j for j in ids[name][i] if j >= 0]
        for j in valid:
          g[j] += np.asarray(grads[name][i], np.float64) / (len(valid) if combiner == "mean" else 1)
          touched[j] = True
      table, slots = self.tables[name], self.slots[name]
      a, b = slots.keys()
      fn = np_ftrl if kind == "ftrl" else np_adagrad_momentum
      new = fn(table[touched], slots[a][touched], slots[b][touched], g[touched], hp)
      table[touched], slots[a][touched], slots[b][touched] = new


def make_initial(seed=0):
  rng = np.random.default_rng(seed)
  return {name: (0.5 * rng.standard_normal((V, dim))).astype(np.float32) for name, (_, dim, _, _) in TABLES.items()}


def make_batches(seed=1):
  """Ids with duplicates within an example (0), within every replica's examples (0 and 1 share a replica
  on every count) and across replicas (B-1), -1 padding, and an example with no ids (2)."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(STEPS):
    ids, grads = {}, {}
    for name, (_, dim, _, _) in TABLES.items():
      x = rng.integers(0, V - UNTOUCHED, (B, L)).astype(np.int32)
      x[rng.random((B, L)) < 0.25] = -1
      x[0] = [4, 4, 4]
      x[1] = [4, -1, 0]
      x[2] = -1
      x[B - 1] = [4, 0, -1]
      ids[name] = x
      grads[name] = rng.standard_normal((B, dim)).astype(np.float32)
    batches.append({"ids": ids, "grads": grads})
  return batches


INITIAL = make_initial()
BATCHES = make_batches()


# -- the library under test ---------------------------------------------------------------------------


def make_optimizer(kind, hp):
  return (emb_lib.FTRL if kind == "ftrl" else emb_lib.AdagradMomentum)(**hp)


def make_embedding(strategy):
  """One feature per table; "ftrl" takes the TPUEmbedding's optimizer, the others their TableConfig's."""
  features = {}
  for name, (combiner, dim, kind, hp) in TABLES.items():
    table = emb_lib.TableConfig(V, dim, initializer=lambda shape, dtype, a=INITIAL[name]: jnp.asarray(a, dtype),
                                optimizer=None if name == "ftrl" else make_optimizer(kind, hp),
                                combiner=combiner, name=name)
    features[name] = emb_lib.FeatureConfig(table, name=name)
  kind, hp = TABLES["ftrl"][2:]
  return emb_lib.TPUEmbedding(features, make_optimizer(kind, hp), strategy)


def test_reference_hand_checked():
  """The references on cases worked by hand (and TF's own single-step FTRL check, l1 = l2 = 0)."""
  w, g = np.array([0.5, -1.0]), np.array([2.0, 0.0])
  var, acc, lin = np_ftrl(w, np.full(2, 0.1), np.zeros(2), g, {"learning_rate": 0.1})
  sigma = (np.sqrt(0.1 + g ** 2) - np.sqrt(0.1)) / 0.1
  np.testing.assert_allclose(lin, g - sigma * w)
  np.testing.assert_allclose(var, -(g - sigma * w) / (np.sqrt(0.1 + g ** 2) / 0.1))
  np.testing.assert_allclose(acc, 0.1 + g ** 2)
  np.testing.assert_array_equal(var[1], 0.0)  # g = 0 on a touched row: linear 0, the row goes to 0
  # l1 larger than |linear| zeroes the row
  big_l1 = {"learning_rate": 0.1, "l1_regularization_strength": 100.0}
  var, _, lin = np_ftrl(w, np.full(2, 0.1), np.zeros(2), g, big_l1)
  assert np.all(np.abs(lin) < 100) and np.all(var == 0)
  var, acc, mom = np_adagrad_momentum(np.array([1.0]), np.zeros(1), np.zeros(1), np.array([2.0]),
                                      {"learning_rate": 0.5, "momentum": 0.9, "epsilon": 0.0})
  np.testing.assert_allclose([acc[0], mom[0], var[0]], [4.0, 1.0, 0.5])  # 2 / sqrt(4) = 1
  nesterov = {"learning_rate": 0.5, "momentum": 0.9, "epsilon": 0.0, "use_nesterov": True}
  var, acc, mom = np_adagrad_momentum(var, acc, mom, np.array([2.0]), nesterov)
  pg = 2 / np.sqrt(8.0)
  np.testing.assert_allclose([acc[0], mom[0], var[0]], [8.0, 0.9 + pg, 0.5 - 0.5 * (0.9 * (0.9 + pg) + pg)])


@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
@pytest.mark.parametrize("n", REPLICA_COUNTS)
def test_steps_match_numpy_reference_of_tf_rules(strategies, n, layout):
  strategy = strategies[n]
  emb = embedding_layout(make_embedding(strategy), layout)

  def step(state, batch):
    activations = emb.lookup(state, batch["ids"])
    return emb.apply_gradients(state, batch["ids"], batch["grads"]), activations

  state = emb.build()
  ref = Reference(INITIAL)
  ever_touched = {name: np.zeros(V, bool) for name in TABLES}
  for s, batch in enumerate(BATCHES):
    state, activations = strategy.run(step, args=(state, distribute_batch(strategy, batch)))
    local = strategy.experimental_local_results(activations)
    expected = ref.lookup(batch["ids"])
    for name in TABLES:
      got = np.concatenate([np.asarray(part[name]) for part in local])
      assert_close(got, expected[name], err_msg=f"step {s}: activations of {name}")
      ever_touched[name][batch["ids"][name][batch["ids"][name] >= 0]] = True
    ref.apply_gradients(batch["ids"], batch["grads"])
    tables = emb.embedding_tables(state)
    for name in TABLES:
      assert_close(tables[name], ref.tables[name], err_msg=f"{n} replicas, step {s}: table {name}")
      assert sorted(state["slots"][name]) == sorted(ref.slots[name])
      for slot, want in ref.slots[name].items():
        assert_close(np.asarray(state["slots"][name][slot]), want,
                     err_msg=f"{n} replicas, step {s}: slot {slot} of {name}")
  for name in TABLES:  # rows never looked up kept their values and slots' initial values, bit for bit
    untouched = ~ever_touched[name]
    assert untouched[V - UNTOUCHED:].all() and ever_touched[name][[0, 4]].all()
    np.testing.assert_array_equal(emb.embedding_tables(state)[name][untouched], INITIAL[name][untouched])
    built = emb.build()
    for slot, value in state["slots"][name].items():
      initial = np.asarray(built["slots"][name][slot])
      np.testing.assert_array_equal(np.asarray(value)[untouched], initial[untouched], err_msg=f"{name}/{slot}")
  ftrl_table = emb.embedding_tables(state)["ftrl"]
  assert np.any(ftrl_table[ever_touched["ftrl"]] == 0.0)  # l1 zeroed some weights ...
  assert np.any(ftrl_table[ever_touched["ftrl"]] != 0.0)  # ... not all


def test_slot_names_and_initial_values(strategies):
  emb = make_embedding(strategies[8])
  state = emb.build()
  expected = {"ftrl": {"accumulators": 0.2, "linears": 0.0},
              "ftrl_lin_lr": {"accumulators": 0.1, "linears": 0.0},
              "agm_nesterov": {"accumulators": 0.0, "momenta": 0.0},
              "agm": {"accumulators": 0.0, "momenta": 0.0}}
  for name, slots in expected.items():
    assert sorted(state["slots"][name]) == sorted(slots)
    for slot, value in slots.items():
      got = state["slots"][name][slot]
      assert isinstance(got, tpustrat.ShardedVariable) and got.shape == (V, TABLES[name][1])
      np.testing.assert_array_equal(np.asarray(got), np.float32(value), err_msg=f"{name}/{slot}")
  assert emb_lib.FTRL(initial_accumulator_value=0.7).slot_initial_values() == {"accumulators": 0.7, "linears": 0.0}
  assert emb_lib.FTRL.slots == ("accumulators", "linears")
  assert emb_lib.AdagradMomentum.slots == ("accumulators", "momenta")


def test_defaults_and_positional_order_are_tfs():
  f = emb_lib.FTRL()
  assert {k: getattr(f, k) for k in FTRL_DEFAULTS} == FTRL_DEFAULTS
  assert (f.use_gradient_accumulation, f.allow_zero_accumulator) == (True, False)
  a = emb_lib.AdagradMomentum()
  assert {k: getattr(a, k) for k in AGM_DEFAULTS} == AGM_DEFAULTS
  # TF's positional order: FTRL(learning_rate, learning_rate_power, l1, l2, beta, initial_accumulator_value,
  # ...); AdagradMomentum(learning_rate, momentum, use_nesterov, exponent, beta2, epsilon, ...).
  f = emb_lib.FTRL(0.1, -0.25, 0.01, 0.02, 0.03, 0.4)
  assert (f.learning_rate, f.learning_rate_power, f.l1_regularization_strength, f.l2_regularization_strength,
          f.beta, f.initial_accumulator_value) == (0.1, -0.25, 0.01, 0.02, 0.03, 0.4)
  a = emb_lib.AdagradMomentum(0.1, 0.9, True, 3, 0.99, 1e-5)
  got = (a.learning_rate, a.momentum, a.use_nesterov, a.exponent, a.beta2, a.epsilon)
  assert got == (0.1, 0.9, True, 3.0, 0.99, 1e-5)
  # TF's other defaults are accepted (and change nothing)
  emb_lib.FTRL(use_gradient_accumulation=True, weight_decay_factor=0.0, allow_zero_accumulator=True,
               multiply_weight_decay_factor_by_learning_rate=False)
  emb_lib.AdagradMomentum(clip_weight_min=None, clipvalue=None, low_dimensional_packing_status=False)


def _update(opt, rows, g, touched, slots=None):
  slots = slots or {k: np.full(rows.shape, v, np.float32) for k, v in opt.slot_initial_values().items()}
  rows, slots = opt.update(jnp.asarray(rows), {k: jnp.asarray(v) for k, v in slots.items()},
                           jnp.asarray(g), jnp.asarray(touched), jnp.asarray(1))
  return np.asarray(rows), {k: np.asarray(v) for k, v in slots.items()}


def test_equivalences_on_the_update_rule():
  """multiply_linear_by_learning_rate: same rows, linears scaled by the learning rate (TF: "mathematically
  equivalent for a static learning rate"); AdagradMomentum with momentum 0, beta2 1, exponent 2 is
  Adagrad whose accumulators start at epsilon; untouched rows keep rows and slots."""
  rng = np.random.default_rng(3)
  rows = rng.standard_normal((6, 4)).astype(np.float32)
  touched = np.array([True, True, False, True, True, False])
  hp = {"learning_rate": 0.2, "learning_rate_power": -0.4, "l1_regularization_strength": 0.05,
        "l2_regularization_strength": 0.1, "beta": 0.2}
  plain, times_lr = emb_lib.FTRL(**hp), emb_lib.FTRL(**hp, multiply_linear_by_learning_rate=True)
  r1, s1, r2, s2 = rows, None, rows, None
  for _ in range(3):
    g = rng.standard_normal(rows.shape).astype(np.float32)
    r1, s1 = _update(plain, r1, g, touched, s1)
    r2, s2 = _update(times_lr, r2, g, touched, s2)
    assert_close(r2, r1, scale=1.0)
    assert_close(s2["linears"], 0.2 * s1["linears"])
    np.testing.assert_array_equal(s2["accumulators"], s1["accumulators"])
  np.testing.assert_array_equal(r1[~touched], rows[~touched])
  np.testing.assert_array_equal(s1["accumulators"][~touched], np.float32(0.1))
  np.testing.assert_array_equal(s1["linears"][~touched], 0.0)

  agm, adagrad = emb_lib.AdagradMomentum(0.3, epsilon=0.1), emb_lib.Adagrad(0.3, initial_accumulator_value=0.1)
  r1, s1, r2, s2 = rows, None, rows, None
  for _ in range(3):
    g = rng.standard_normal(rows.shape).astype(np.float32)
    r1, s1 = _update(agm, r1, g, touched, s1)
    r2, s2 = _update(adagrad, r2, g, touched, s2)
    assert_close(r1, r2)
    assert_close(s1["accumulators"][touched] + 0.1, s2["accumulators"][touched])
  np.testing.assert_array_equal(r1[~touched], rows[~touched])
  np.testing.assert_array_equal(s1["momenta"][~touched], 0.0)


def test_new_optimizers_are_accepted_per_table_and_globally(strategies):
  table = emb_lib.TableConfig(V, 2, name="t", optimizer=emb_lib.AdagradMomentum(0.1))
  emb_lib.TPUEmbedding({"f": emb_lib.FeatureConfig(table)}, emb_lib.FTRL(0.1), strategies[8])


@pytest.mark.parametrize("make, match", [
    (lambda: emb_lib.FTRL(learning_rate=0.0), "learning_rate"),
    (lambda: emb_lib.FTRL(learning_rate=float("nan")), "learning_rate"),
    (lambda: emb_lib.FTRL(learning_rate_power=0.5), "learning_rate_power"),
    (lambda: emb_lib.FTRL(l1_regularization_strength=-0.1), "l1_regularization_strength"),
    (lambda: emb_lib.FTRL(l2_regularization_strength=-0.1), "l2_regularization_strength"),
    (lambda: emb_lib.FTRL(beta=-1.0), "beta"),
    (lambda: emb_lib.FTRL(beta=float("inf")), "beta"),
    (lambda: emb_lib.FTRL(initial_accumulator_value=0.0), "initial_accumulator_value"),
    (lambda: emb_lib.FTRL(initial_accumulator_value=1e-45), "initial_accumulator_value"),  # 0 in float32
    (lambda: emb_lib.FTRL(use_gradient_accumulation=False), "use_gradient_accumulation"),
    (lambda: emb_lib.FTRL(clip_weight_min=-1.0), "clip_weight_min"),
    (lambda: emb_lib.FTRL(clip_weight_max=1.0), "clip_weight_max"),
    (lambda: emb_lib.FTRL(weight_decay_factor=0.01), "weight_decay_factor"),
    (lambda: emb_lib.FTRL(multiply_weight_decay_factor_by_learning_rate=True),
     "multiply_weight_decay_factor_by_learning_rate"),
    (lambda: emb_lib.FTRL(slot_variable_creation_fn=lambda *a: {}), "slot_variable_creation_fn"),
    (lambda: emb_lib.FTRL(clipvalue=1.0), "clipvalue"),
    (lambda: emb_lib.FTRL(low_dimensional_packing_status=True), "low_dimensional_packing_status"),
    (lambda: emb_lib.AdagradMomentum(learning_rate=-1.0), "learning_rate"),
    (lambda: emb_lib.AdagradMomentum(momentum=-0.1), "momentum"),
    (lambda: emb_lib.AdagradMomentum(momentum=1.5), "momentum"),
    (lambda: emb_lib.AdagradMomentum(exponent=0.0), "exponent"),
    (lambda: emb_lib.AdagradMomentum(beta2=1.1), "beta2"),
    (lambda: emb_lib.AdagradMomentum(beta2=-0.1), "beta2"),
    (lambda: emb_lib.AdagradMomentum(epsilon=0.0), "epsilon"),
    (lambda: emb_lib.AdagradMomentum(use_gradient_accumulation=False), "use_gradient_accumulation"),
    (lambda: emb_lib.AdagradMomentum(clipvalue=(-1.0, 1.0)), "clipvalue"),
    (lambda: emb_lib.AdagradMomentum(weight_decay_factor=0.1), "weight_decay_factor"),
])
def test_bad_arguments_raise_value_error_naming_them(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("make, match", [
    (lambda: emb_lib.FTRL(multiply_linear_by_learning_rate="yes"), "multiply_linear_by_learning_rate"),
    (lambda: emb_lib.FTRL(allow_zero_accumulator=1), "allow_zero_accumulator"),
    (lambda: emb_lib.FTRL(learning_rate="0.1"), "learning_rate"),
    (lambda: emb_lib.AdagradMomentum(use_nesterov=1), "use_nesterov"),
    (lambda: emb_lib.AdagradMomentum(momentum=True), "momentum"),
])
def test_bad_argument_types_raise(make, match):
  with pytest.raises((TypeError, ValueError), match=match):
    make()
