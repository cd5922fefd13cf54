"""tpustrat.mixed_precision: the dtype `Policy`, `all_reduce_gradients` in the reduce dtype, and
`LossScaleOptimizer` (dynamic loss scaling whose skipped steps every replica agrees on).

The loss-scaling tests train a tiny linear model (16 features, 2 rows per replica) for 30 steps on 8
replicas with overflows planted in the data: a row of one replica, at some steps, carries a poison term
``1e37 * w[j]`` in its loss, finite unscaled but infinite once multiplied by the loss scale (float32), so
the scaled gradient of ``w[j]`` overflows on that replica only. Each run is compared with a numpy reference
of TF's schedule (the scale halves on an overflow, not below 1, and doubles after ``growth`` finite steps;
the counter resets on both) and of the training (SGD or Adam applied on the finite steps only, in float64):
the scale, counter, skipped count and finite flag at every step exactly, the parameters within float32
rounding. The same plan runs through `run`, `experimental_run_steps`, `run` inside `jax.jit` and inside a
jitted `lax.scan`, on `TPUStrategy` and `MirroredStrategy`, with the gradients in each of the three forms
the library gives: all-reduced per-replica gradients (TF's loop), per-replica gradients handed to a
`sharded_optimizer` (which sums them itself), and the blocks of a `ShardedVariable` (an overflow there
lands in the block of one replica only: without the agreement that replica alone would skip).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close

import tpustrat
from tpustrat import mixed_precision as mp

D = 16  # features; with FSDP, 2 rows of w per replica
ROWS = 2  # per replica
STEPS = 30
INITIAL_SCALE = 2.0 ** 12
GROWTH = 3
POISON = 1e37  # finite; times any loss scale >= 2**5 it overflows float32
LR = 0.05
# step -> (replica whose rows carry the poison, feature j): several in a row (the scale halves each time),
# and spread so that growth happens between them.
PLAN = {4: (3, 1), 5: (7, 14), 11: (0, 6), 19: (5, 9), 20: (5, 2), 21: (2, 11), 27: (6, 5)}


# -- numpy references ------------------------------------------------------------------------------------


def reference_schedule(finite, initial=INITIAL_SCALE, growth=GROWTH):
  """TF's dynamic loss scale: per step, (scale used, scale after, counter after, skipped after)."""
  scale, counter, skipped, rows = float(initial), 0, 0, []
  for ok in finite:
    used = scale
    if ok:
      if counter + 1 >= growth:
        doubled = np.float32(scale) * np.float32(2)
        scale = float(doubled) if np.isfinite(doubled) else scale
        counter = 0
      else:
        counter += 1
    else:
      scale, counter, skipped = max(scale / 2, 1.0), 0, skipped + 1
    rows.append((used, scale, counter, skipped))
  return rows


def reference_training(batches, finite, params, optimizer):
  """(params after each step, loss of each step) in float64: the updates of the finite steps only."""
  w, b = np.asarray(params["w"], np.float64), float(params["b"])
  mu = {"w": np.zeros(D), "b": 0.0}
  nu = {"w": np.zeros(D), "b": 0.0}
  count, history, losses = 0, [], []
  for batch, ok in zip(batches, finite):
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    resid = x @ w + b - y
    losses.append(float(np.mean(resid ** 2)))
    if ok:
      g = {"w": 2 * x.T @ resid / len(y), "b": float(2 * np.sum(resid) / len(y))}
      if optimizer == "sgd":
        w, b = w - LR * g["w"], b - LR * g["b"]
      else:  # optax.adam's defaults
        count += 1
        for k in ("w", "b"):
          mu[k] = 0.9 * mu[k] + 0.1 * g[k]
          nu[k] = 0.999 * nu[k] + 0.001 * np.square(g[k])
        step = {k: LR * (mu[k] / (1 - 0.9 ** count)) / (np.sqrt(nu[k] / (1 - 0.999 ** count)) + 1e-8)
                for k in ("w", "b")}
        w, b = w - step["w"], b - step["b"]
    history.append({"w": w.copy(), "b": b})
  return history, losses


# -- the model, its data and its step -------------------------------------------------------------------


def make_data(n=8, steps=STEPS, plan=PLAN, seed=0):
  """Global batches ``{"x", "y", "poison"}`` (n * ROWS rows) and the initial parameters."""
  rng = np.random.default_rng(seed)
  w_true = rng.normal(size=D).astype(np.float32)
  batches = []
  for s in range(steps):
    x = rng.normal(size=(n * ROWS, D)).astype(np.float32)
    y = (x @ w_true + 0.1 * rng.normal(size=n * ROWS)).astype(np.float32)
    poison = np.zeros((n * ROWS, D), np.float32)
    if s in plan:
      replica, j = plan[s]
      poison[replica * ROWS, j] = POISON  # one row of one replica
    batches.append({"x": x, "y": y, "poison": poison})
  params = {"w": (0.1 * rng.normal(size=D)).astype(np.float32), "b": np.float32(0.5)}
  return batches, params


def finite_flags(steps=STEPS, plan=PLAN):
  return [s not in plan for s in range(steps)]


def loss_fn(params, batch):
  """This replica's share of the global mean squared error, plus the poison term (0 but on planted rows)."""
  w = tpustrat.read_values(params["w"])
  resid = batch["x"] @ w + params["b"] - batch["y"]
  n = tpustrat.get_replica_context().num_replicas_in_sync
  return jnp.sum(resid ** 2) / (n * ROWS) + jnp.sum(batch["poison"] @ w)


def make_step(lso, mode):
  """The training step: mode "mirrored" (TF's loop: per-replica gradients all-reduced in float32), "zero"
  (per-replica gradients given to a sharded_optimizer inside `lso`), or "fsdp" (w a ShardedVariable: its
  gradient comes back as this replica's block)."""

  def step(state, batch):
    ctx = tpustrat.get_replica_context()
    params = state["params"]
    wrt = params if mode == "fsdp" else tpustrat.local_copy(params)
    loss, grads = lso.value_and_grad(loss_fn, state["opt"])(wrt, batch)
    if mode != "zero":
      grads = mp.all_reduce_gradients(grads, "float32")
    updates, opt = lso.update(grads, state["opt"], params)
    new = {"params": optax.apply_updates(params, updates), "opt": opt}
    report = {"loss": ctx.all_reduce("sum", loss), "scale": opt.loss_scale, "counter": opt.counter,
              "finite": opt.last_finite, "skipped": opt.skipped_steps, "used": state["opt"].loss_scale}
    return new, report

  return step


def make_optimizer(optimizer, mode):
  tx = optax.sgd(LR) if optimizer == "sgd" else optax.adam(LR)
  if mode == "zero":
    tx = tpustrat.sharded_optimizer(tx, lambda path, shape, dtype: 0 if shape else None)
  return mp.LossScaleOptimizer(tx, initial_scale=INITIAL_SCALE, dynamic_growth_steps=GROWTH)


def init_state(strategy, params, lso, mode):
  if mode == "fsdp":
    params = strategy.experimental_shard(params, lambda path, shape, dtype: 0 if shape == (D,) else None)
  else:
    params = strategy.experimental_mirror(params)
  return {"params": params, "opt": strategy.run(lso.init, args=(params,))}


def first(strategy, x):
  return np.asarray(strategy.experimental_local_results(x)[0])


def host(x):
  return np.asarray(x.values[0]) if isinstance(x, tpustrat.Mirrored) else np.asarray(x)


def check_against_numpy(strategy, batches, params0, optimizer, reports, final_params):
  """`reports`: one dict of numpy per step (the step's outputs, first replica)."""
  want_schedule = reference_schedule(finite_flags())
  got = [(float(r["used"]), float(r["scale"]), int(r["counter"]), int(r["skipped"])) for r in reports]
  assert got == want_schedule
  assert [bool(r["finite"]) for r in reports] == finite_flags()
  history, losses = reference_training(batches, finite_flags(), params0, optimizer)
  ok = [s for s in range(STEPS) if s not in PLAN]
  assert_close([float(reports[s]["loss"]) for s in ok], [losses[s] for s in ok], rtol=1e-5)
  assert_close(final_params["w"], history[-1]["w"], rtol=1e-5, scale=np.abs(history[-1]["w"]).max() + 1)
  assert_close(final_params["b"], history[-1]["b"], rtol=1e-5, scale=abs(history[-1]["b"]) + 1)
  # It trains between the overflows: the loss falls.
  assert losses[-1] < 0.5 * losses[0]


def reports_per_step(strategy, stacked):
  out = {k: first(strategy, v) for k, v in stacked.items()}
  return [{k: v[s] for k, v in out.items()} for s in range(STEPS)]


# -- the schedule, the skipped steps and the parameters against numpy --------------------------------------


@pytest.mark.parametrize("mode,optimizer", [("mirrored", "sgd"), ("mirrored", "adam"), ("zero", "adam"),
                                            ("fsdp", "adam")])
def test_run_matches_the_numpy_schedule_and_training(strategy, mode, optimizer):
  batches, params0 = make_data()
  lso = make_optimizer(optimizer, mode)
  state = init_state(strategy, params0, lso, mode)
  step = make_step(lso, mode)
  reports = []
  for batch in strategy.experimental_distribute_dataset(batches):
    state, report = strategy.run(step, args=(state, batch))
    # Every replica took the same decision: the optimizer's scalars and the parameters are Mirrored.
    for v in jax.tree.leaves(report, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues)):
      assert isinstance(v, tpustrat.Mirrored), v
    reports.append({k: first(strategy, v) for k, v in report.items()})
  kinds = {type(v).__name__ for v in jax.tree.leaves(
      state, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))}
  assert kinds == ({"Mirrored", "ShardedVariable"} if mode in ("fsdp", "zero") else {"Mirrored"}), kinds
  final = {"w": np.asarray(state["params"]["w"]) if mode == "fsdp" else host(state["params"]["w"]),
           "b": host(state["params"]["b"])}
  check_against_numpy(strategy, batches, params0, optimizer, reports, final)


def test_fsdp_overflow_lands_in_one_replicas_block_and_every_replica_skips(strategy):
  # The premise of the agreement: the poison's gradient, reduce-scattered, is infinite in one block only.
  batches, params0 = make_data()
  sharded = strategy.experimental_shard(params0, lambda path, shape, dtype: 0 if shape == (D,) else None)
  step_batch = next(iter(strategy.experimental_distribute_dataset(batches[4:5])))

  def blocks_finite(params, batch):
    grads = jax.grad(lambda p: 1024.0 * loss_fn(p, batch))(params)
    return jnp.all(jnp.isfinite(grads["w"].block))[None], mp.all_finite(grads)

  local, agreed = strategy.run(blocks_finite, args=(sharded, step_batch))
  owner = PLAN[4][1] // (D // 8)
  np.testing.assert_array_equal(np.asarray(local.values).ravel(), [r != owner for r in range(8)])
  assert isinstance(agreed, tpustrat.Mirrored) and not bool(agreed.values[0])


def test_one_replicas_per_replica_overflow_skips_everywhere_without_an_all_reduce(strategy):
  # Per-replica gradients straight into update (no all-reduce): replica 3's are infinite, the others finite;
  # the scale, counter and skip are still the same on every replica (Mirrored).
  lso = mp.LossScaleOptimizer(optax.sgd(0.1), initial_scale=8.0)

  def step(opt, x):
    rid = tpustrat.get_replica_context().replica_id_in_sync_group
    grads = {"w": jnp.where(rid == 3, jnp.inf, x)}
    _, opt = lso.update(grads, opt, {"w": jnp.zeros(2)})
    return opt

  opt = strategy.run(lso.init, args=({"w": np.zeros(2, np.float32)},))
  x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(2, np.float32))
  opt = strategy.run(step, args=(opt, x))
  for name in ("loss_scale", "counter", "last_finite", "skipped_steps"):
    v = getattr(opt, name)
    assert isinstance(v, tpustrat.Mirrored), (name, v)
  assert float(opt.loss_scale.values[0]) == 4.0 and not bool(opt.last_finite.values[0])
  assert int(opt.skipped_steps.values[0]) == 1 and int(opt.counter.values[0]) == 0


@pytest.mark.parametrize("path", ["run_steps", "jit", "scan"])
def test_run_steps_and_run_inside_jit_and_scan_match_numpy(strategy, path):
  batches, params0 = make_data()
  lso = make_optimizer("adam", "mirrored")
  state = init_state(strategy, params0, lso, "mirrored")
  step = make_step(lso, "mirrored")
  it = iter(strategy.experimental_distribute_dataset(batches))
  if path == "run_steps":
    state, stacked = strategy.experimental_run_steps(step, it, STEPS, init=state)
    reports = reports_per_step(strategy, stacked)
  elif path == "scan":
    scan = jax.jit(lambda carry, xs: jax.lax.scan(lambda c, b: strategy.run(step, args=(c, b)), carry, xs))
    state, stacked = scan(state, it.take_steps(STEPS))
    reports = reports_per_step(strategy, stacked)
  else:
    jitted = jax.jit(lambda s, b: strategy.run(step, args=(s, b)))
    reports = []
    for batch in it:
      state, report = jitted(state, batch)
      reports.append({k: first(strategy, v) for k, v in report.items()})
  final = {k: first(strategy, v) for k, v in state["params"].items()}
  check_against_numpy(strategy, batches, params0, "adam", reports, final)


def test_mirrored_strategy_matches_numpy():
  strategy = tpustrat.MirroredStrategy()
  batches, params0 = make_data()
  lso = make_optimizer("sgd", "mirrored")
  state = init_state(strategy, params0, lso, "mirrored")
  state, stacked = strategy.experimental_run_steps(make_step(lso, "mirrored"),
                                                   iter(strategy.experimental_distribute_dataset(batches)),
                                                   STEPS, init=state)
  final = {k: first(strategy, v) for k, v in state["params"].items()}
  check_against_numpy(strategy, batches, params0, "sgd", reports_per_step(strategy, stacked), final)


# -- the schedule's edges, outside any strategy -----------------------------------------------------------


def run_schedule(lso, finite, params=None):
  params = {"w": jnp.zeros(3)} if params is None else params
  update = jax.jit(lso.update)
  state, rows = lso.init(params), []
  for ok in finite:
    used = float(state.loss_scale)
    grads = {"w": jnp.full(3, 1.0 if ok else jnp.nan)}
    _, state = update(grads, state, params)
    rows.append((used, float(state.loss_scale), int(state.counter), int(state.skipped_steps)))
  return rows, state


def test_schedule_floor_of_one_growth_every_step_and_the_float32_cap():
  rng = np.random.default_rng(1)
  finite = list(rng.random(60) < 0.7)
  for initial, growth in [(4.0, 2), (2.0 ** 15, 1), (3.0, 5), (1.0, 2000)]:
    rows, _ = run_schedule(mp.LossScaleOptimizer(optax.sgd(1.0), initial, growth), finite)
    assert rows == reference_schedule(finite, initial, growth), (initial, growth)
  rows, _ = run_schedule(mp.LossScaleOptimizer(optax.sgd(1.0), 4.0, 1), [False] * 4)
  assert [r[1] for r in rows] == [2.0, 1.0, 1.0, 1.0]  # halves, not below 1 (TF's floor)
  rows, _ = run_schedule(mp.LossScaleOptimizer(optax.sgd(1.0), 2.0 ** 126, 1), [True] * 3)
  assert [r[1] for r in rows] == [2.0 ** 127] * 3  # 2**128 would be inf in float32: kept
  assert [r[2] for r in rows] == [0, 0, 0]


def test_growth_after_exactly_n_finite_steps_and_the_counter_resets_on_overflow():
  lso = mp.LossScaleOptimizer(optax.sgd(1.0), initial_scale=16.0, dynamic_growth_steps=4)
  rows, _ = run_schedule(lso, [True] * 3 + [False] + [True] * 4 + [True] * 4)
  assert [r[1] for r in rows] == [16, 16, 16, 8, 8, 8, 8, 16, 16, 16, 16, 32]
  assert [r[2] for r in rows] == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_skipped_step_keeps_the_inner_state_and_gives_zero_updates():
  lso = mp.LossScaleOptimizer(optax.adam(0.1), initial_scale=2.0)
  params = {"w": jnp.ones(3)}
  state = lso.init(params)
  ok = {"w": jnp.full(3, 2.0)}
  updates, state = lso.update(ok, state, params)
  # The unscaled gradient reaches adam: its first moment is 0.1 * (2 / scale 2).
  assert int(state.inner_state[0].count) == 1 and float(state.inner_state[0].mu["w"][0]) == pytest.approx(0.1)
  bad = {"w": jnp.array([1.0, jnp.inf, 1.0])}
  updates2, state2 = lso.update(bad, state, params)
  np.testing.assert_array_equal(updates2["w"], np.zeros(3))
  jax.tree.map(np.testing.assert_array_equal, state2.inner_state, state.inner_state)
  assert not bool(state2.last_finite) and int(state2.skipped_steps) == 1


def test_fixed_scale_applies_every_update():
  lso = mp.LossScaleOptimizer(optax.sgd(1.0), initial_scale=4.0, dynamic=False)
  rows, state = run_schedule(lso, [True, False, True])
  assert [r[1] for r in rows] == [4.0, 4.0, 4.0] and [r[3] for r in rows] == [0, 0, 0]
  assert bool(state.last_finite)
  updates, state = lso.update({"w": jnp.array([4.0, jnp.inf, 8.0])}, state, {"w": jnp.zeros(3)})
  assert not bool(state.last_finite) and updates["w"].tolist() == [-1.0, -np.inf, -2.0]


def test_works_with_optax_chain_and_extra_args():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  lso = mp.LossScaleOptimizer(tx, initial_scale=256.0)
  assert isinstance(lso, optax.GradientTransformation)
  params = {"w": jnp.zeros(2)}
  state = lso.init(params)
  updates, state = lso.update({"w": jnp.array([3.0 * 256, 4.0 * 256])}, state, params, value=jnp.ones(()))
  np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)  # clipped after unscaling
  # And wrapped in optax itself (a transformation like any other).
  outer = optax.chain(optax.identity(), lso)
  _, s = outer.update({"w": jnp.ones(2)}, outer.init(params), params)
  assert int(s[1].counter) == 1


def test_scale_loss_and_value_and_grad():
  lso = mp.LossScaleOptimizer(optax.sgd(1.0), initial_scale=8.0)
  state = lso.init({"w": jnp.zeros(2)})
  assert lso.scale_loss(jnp.float16(2.0), state).dtype == jnp.float32
  assert float(lso.scale_loss(2.0, state)) == 16.0
  (loss, aux), grads = lso.value_and_grad(lambda w, c: (jnp.sum(w * c), "aux"), state, has_aux=True)(
      jnp.ones(2), 3.0)
  assert float(loss) == 6.0 and aux == "aux" and grads.tolist() == [24.0, 24.0]
  assert "initial_scale=8" in repr(lso)


# -- float16 on a tiny model, against numpy ---------------------------------------------------------------


@pytest.mark.parametrize("policy_name", ["float16", "mixed_float16"])
def test_float16_training_skips_real_overflows_and_matches_numpy(strategy, policy_name):
  # A loss scale far too large for float16: the scaled gradients overflow float16 (no planted poison), the
  # first steps are skipped with the parameters untouched, the scale halves until the gradients fit, and
  # from then on the model trains as the float64 reference does on the steps that were applied.
  policy = mp.Policy(policy_name)
  batches, params0 = make_data(plan={})
  params0 = policy.cast_to_variable(params0)
  lso = mp.LossScaleOptimizer(optax.sgd(LR), initial_scale=2.0 ** 18, dynamic_growth_steps=1000)

  def f16_loss(params, batch):
    p = policy.cast_to_compute(params)
    x = policy.cast_to_compute(batch["x"])
    resid = (x @ p["w"] + p["b"]).astype(jnp.float32) - batch["y"]
    return jnp.sum(resid ** 2) / (8 * ROWS)

  def step(state, batch):
    loss, grads = lso.value_and_grad(f16_loss, state["opt"])(tpustrat.local_copy(state["params"]), batch)
    assert grads["w"].dtype == policy.variable_dtype
    grads = mp.all_reduce_gradients(grads, policy)
    updates, opt = lso.update(grads, state["opt"], state["params"])
    return ({"params": optax.apply_updates(state["params"], updates), "opt": opt},
            {"finite": opt.last_finite, "scale": opt.loss_scale, "w": state["params"]["w"],
             "b": state["params"]["b"]})

  state = strategy.experimental_mirror({"params": params0, "opt": lso.init(params0)})
  state, stacked = strategy.experimental_run_steps(step, iter(strategy.experimental_distribute_dataset(batches)),
                                                   STEPS, init=state)
  finite = [bool(f) for f in first(strategy, stacked["finite"])]
  scales = first(strategy, stacked["scale"])
  assert not any(finite[:3]) and sum(finite) >= STEPS - 10, finite
  # The scale follows TF's schedule over the overflows that happened (each a real float16 overflow).
  np.testing.assert_array_equal(scales, [r[1] for r in reference_schedule(finite, 2.0 ** 18, 1000)])
  ws = first(strategy, stacked["w"])  # the parameters each step started from
  for s in range(STEPS - 1):
    if not finite[s]:
      np.testing.assert_array_equal(ws[s + 1], ws[s])  # a skipped step leaves the parameters alone
    else:
      assert not np.array_equal(ws[s + 1], ws[s])
  # Each decision is float16's: the largest scaled gradient value in float16 (this replica's output
  # gradient and weight gradient, and their sum over replicas), computed in float64 from the parameters the
  # step started from, is beyond float16's largest (65504) on the skipped steps, within it on the others
  # (up to a factor 2 either way: float16 rounding and XLA's order of operations).
  bs = first(strategy, stacked["b"])
  for s, batch in enumerate(batches):
    resid = batch["x"].astype(np.float64) @ ws[s].astype(np.float64) + float(bs[s]) - batch["y"]
    used = 2.0 ** 18 if s == 0 else scales[s - 1]  # the scale this step's loss was multiplied by
    dpred = used * 2 * resid / (8 * ROWS)
    per_replica = [batch["x"][r * ROWS:(r + 1) * ROWS].T @ dpred[r * ROWS:(r + 1) * ROWS] for r in range(8)]
    largest = max(np.abs(dpred).max(), np.abs(per_replica).max(), np.abs(np.sum(per_replica, 0)).max())
    assert (largest < 2 * 65504) if finite[s] else (largest > 65504 / 2), (s, finite[s], largest)
  final_w = first(strategy, state["params"]["w"])
  assert final_w.dtype == policy.variable_dtype
  history, losses = reference_training(batches, finite, {k: np.float32(v) if np.ndim(v) == 0 else
                                                         np.asarray(v, np.float32) for k, v in params0.items()},
                                       "sgd")
  assert losses[-1] < 0.1 * losses[0]
  eps = float(jnp.finfo(policy.compute_dtype).eps)
  assert_close(final_w, history[-1]["w"], rtol=40 * eps, scale=np.abs(history[-1]["w"]).max())


# -- all_reduce_gradients ---------------------------------------------------------------------------------


def test_all_reduce_gradients_sums_per_replica_leaves_in_the_reduce_dtype(strategy):
  def step(g):
    x = {"per_replica": g, "bf16": g.astype(jnp.bfloat16), "summed": jnp.ones(2),  # the same everywhere
         "ids": jnp.arange(2)}
    return mp.all_reduce_gradients(x, "mixed_bfloat16")

  g = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.full(2, ctx.replica_id_in_sync_group + 1, np.float32))
  out = strategy.run(step, args=(g,))
  np.testing.assert_array_equal(out["per_replica"].values[0], [36.0, 36.0])
  assert out["bf16"].values[0].dtype == jnp.bfloat16 and float(out["bf16"].values[0][0]) == 36.0
  np.testing.assert_array_equal(out["summed"].values[0], [1.0, 1.0])  # not summed again
  assert isinstance(out["ids"], tpustrat.Mirrored)  # integer leaves pass as they are
  # The all-reduce of the bfloat16 leaf is a float32 one: the program's psums carry f32 values only.
  jaxpr = str(jax.make_jaxpr(lambda v: strategy.run(step, args=(v,)))(g))
  psums = [line for line in jaxpr.splitlines() if "psum" in line]
  assert psums and all("bf16" not in line for line in psums), psums
  with_bf16 = str(jax.make_jaxpr(lambda v: strategy.run(
      lambda x: mp.all_reduce_gradients(x.astype(jnp.bfloat16), mp.Policy("bfloat16", reduce_dtype="bfloat16")),
      args=(v,)))(g))
  assert any("psum" in line and "bf16" in line for line in with_bf16.splitlines())


def test_all_reduce_gradients_with_the_default_strategy_and_in_cross_replica_context(strategy):
  g = {"w": jnp.ones(2)}
  assert mp.all_reduce_gradients(g) is g
  with strategy.scope(), pytest.raises(RuntimeError, match="cross-replica context"):
    mp.all_reduce_gradients(g)


# -- the policy -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,compute,variable", [
    ("float32", "float32", "float32"), ("mixed_bfloat16", "bfloat16", "float32"),
    ("mixed_float16", "float16", "float32"), ("bfloat16", "bfloat16", "bfloat16"),
    ("float16", "float16", "float16")])
def test_policy_dtypes(name, compute, variable):
  policy = mp.Policy(name)
  assert policy.name == name and policy.compute_dtype == compute and policy.variable_dtype == variable
  assert policy.reduce_dtype == "float32"
  assert repr(policy) == f'<Policy "{name}">'
  assert policy == mp.Policy(name) and hash(policy) == hash(mp.Policy(name))
  assert policy != mp.Policy(name, reduce_dtype="bfloat16")


def test_policy_casts_floating_leaves_only():
  policy = mp.Policy("mixed_float16")
  tree = {"f32": np.ones(2, np.float32), "bf16": jnp.ones(2, jnp.bfloat16), "i": np.arange(3),
          "b": np.array([True]), "py": 1.5, "c": np.ones(1, np.complex64),
          "f64": np.ones(2, np.float64)}  # float32 on the devices without x64: cast like float32
  out = policy.cast_to_compute(tree)
  assert {k: str(getattr(v, "dtype", type(v).__name__)) for k, v in out.items()} == {
      "f32": "float16", "bf16": "float16", "i": "int64", "b": "bool", "py": "float", "c": "complex64",
      "f64": "float16"}
  assert out["py"] == 1.5 and out["i"] is tree["i"]
  back = policy.cast_to_variable(out)
  assert back["f32"].dtype == jnp.float32 and back["bf16"].dtype == jnp.float32


def test_policy_never_narrows_float64_with_x64():
  with jax.enable_x64(True):
    policy = mp.Policy("mixed_bfloat16")
    out = policy.cast_to_compute({"f64": jnp.ones(2, jnp.float64), "f32": jnp.ones(2, jnp.float32)})
    assert out["f64"].dtype == jnp.float64 and out["f32"].dtype == jnp.bfloat16
    assert mp.Policy("float64").compute_dtype == "float64"


def test_policy_inside_run_on_blocks_and_outside_on_distributed_values(strategy):
  policy = mp.Policy("mixed_bfloat16")
  params = strategy.experimental_shard({"w": np.ones((16, 2), np.float32), "b": np.ones(2, np.float32)},
                                       lambda path, shape, dtype: 0 if len(shape) == 2 else None)
  cast = policy.cast_to_compute(params)
  assert isinstance(cast["w"], tpustrat.ShardedVariable) and cast["w"].dtype == jnp.bfloat16
  assert isinstance(cast["b"], tpustrat.Mirrored) and cast["b"].values[0].dtype == jnp.bfloat16
  out = strategy.run(lambda p: policy.cast_to_compute(p), args=(params,))
  assert isinstance(out["w"], tpustrat.ShardedVariable) and out["w"].dtype == jnp.bfloat16


# -- errors -----------------------------------------------------------------------------------------------


def test_errors():
  with pytest.raises(ValueError, match=r"unknown policy name 'mixed_float8'; the known names are 'float32', "
                                       r"'float64', 'bfloat16', 'float16', 'mixed_bfloat16', 'mixed_float16'"):
    mp.Policy("mixed_float8")
  with pytest.raises(TypeError, match="policy name"):
    mp.Policy(jnp.float16)
  with pytest.raises(ValueError, match="jax_enable_x64"):
    mp.Policy("float64")
  with pytest.raises(ValueError, match="floating-point"):
    mp.Policy("float32", reduce_dtype="int32")
  with pytest.raises(TypeError, match="policy"):
    mp.all_reduce_gradients({}, 3)
  for bad in (0, 0.0, -1.0, float("inf"), float("nan")):
    with pytest.raises(ValueError, match="initial_scale` must be a finite number > 0"):
      mp.LossScaleOptimizer(optax.sgd(1.0), initial_scale=bad)
  for bad in (2.0 ** 200, 1e-50):  # finite in Python, but inf / 0 as the float32 the scale is kept in
    with pytest.raises(ValueError, match="outside float32's normal range"):
      mp.LossScaleOptimizer(optax.sgd(1.0), initial_scale=bad)
  assert mp.LossScaleOptimizer(optax.sgd(1.0), initial_scale=2.0 ** 127).initial_scale == 2.0 ** 127
  for bad in (True, "2", None):
    with pytest.raises(TypeError, match="initial_scale"):
      mp.LossScaleOptimizer(optax.sgd(1.0), initial_scale=bad)
  with pytest.raises(ValueError, match=r"dynamic_growth_steps` must be an int >= 1, got 0"):
    mp.LossScaleOptimizer(optax.sgd(1.0), dynamic_growth_steps=0)
  with pytest.raises(TypeError, match="dynamic_growth_steps"):
    mp.LossScaleOptimizer(optax.sgd(1.0), dynamic_growth_steps=2.0)
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    mp.LossScaleOptimizer(lambda g: g)
  with pytest.raises(TypeError, match="dynamic"):
    mp.LossScaleOptimizer(optax.sgd(1.0), dynamic="yes")
  lso = mp.LossScaleOptimizer(optax.sgd(1.0))
  with pytest.raises(TypeError, match="LossScaleState"):
    lso.update({"w": jnp.ones(2)}, optax.sgd(1.0).init({"w": jnp.ones(2)}))


def test_state_restored_from_a_checkpoint_continues_identically(strategy, tmp_path):
  # LossScaleState (a NamedTuple around Adam's state) saved by tpustrat.checkpoint.CheckpointManager after
  # step 8 of 30 (with a skipped step behind it), with the iterator's position, restored into a fresh
  # state: the remaining 22 steps give the uninterrupted run's scale, counter, skips and parameters, bit
  # for bit, and both match the numpy reference.
  batches, params0 = make_data()
  lso = make_optimizer("adam", "mirrored")
  step = make_step(lso, "mirrored")
  options = tpustrat.RunOptions(donate_argnums=0)
  dataset = strategy.experimental_distribute_dataset(batches)

  def train(state, it, steps):
    reports = []
    for _ in range(steps):
      state, report = strategy.run(step, args=(state, next(it)), options=options)
      reports.append({k: first(strategy, v) for k, v in report.items()})
    return state, reports

  manager = tpustrat.checkpoint.CheckpointManager(tmp_path, strategy)
  it = iter(dataset)
  state, reports = train(init_state(strategy, params0, lso, "mirrored"), it, 8)
  manager.save(8, state, iterator=it)
  manager.wait_until_finished()
  state, rest = train(state, it, STEPS - 8)
  reports += rest
  it.close()

  it = iter(dataset)
  restored = manager.restore(target=init_state(strategy, params0, lso, "mirrored"), iterator=it)
  assert isinstance(restored["opt"], mp.LossScaleState)
  assert int(first(strategy, restored["opt"].skipped_steps)) == 2  # steps 4 and 5 were skipped
  restored, resumed = train(restored, it, STEPS - 8)
  it.close()
  manager.close()
  for got, want in zip(resumed, reports[8:]):
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got), (got, want)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(first(strategy, a), first(strategy, b))
  final = {k: first(strategy, v) for k, v in state["params"].items()}
  check_against_numpy(strategy, batches, params0, "adam", reports, final)
