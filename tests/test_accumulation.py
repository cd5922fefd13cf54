"""`tpustrat.accumulate_gradients`: k micro-batches in one program, one communication.

References are plain JAX on one device (no tpustrat) with the whole global batch, or numpy: the loss is
each example's squared error summed over the global batch's real rows and divided by the global batch size
(TF's ``compute_average_loss``), so the replicas' gradients add up to the one-device gradient. The compiled
programs are read for their collectives: as many all-reduces (reduce-scatters) with k = 4 as with k = 1,
none of them inside the accumulation's loop.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close

import tpustrat
from tpustrat import LocalShard, Mirrored, PerReplica, ShardedVariable

N = 8
GLOBAL = 32  # rows of a full global batch: 4 per replica on 8 replicas
_STRATEGIES = {}


def make_strategy(n):
  if n not in _STRATEGIES:
    _STRATEGIES[n] = tpustrat.MirroredStrategy(jax.devices()[:n]) if n < N else tpustrat.TPUStrategy()
  return _STRATEGIES[n]


def init_params(seed=0, d_in=6, hidden=16, d_out=3, dtype=np.float32):
  rng = np.random.default_rng(seed)
  return {"w1": (rng.normal(size=(d_in, hidden)) / np.sqrt(d_in)).astype(dtype),
          "b1": (0.1 * rng.normal(size=hidden)).astype(dtype),
          "w2": (rng.normal(size=(hidden, d_out)) / np.sqrt(hidden)).astype(dtype),
          "b2": (0.1 * rng.normal(size=d_out)).astype(dtype)}


def make_data(rows, seed=1, d_in=6, d_out=3):
  rng = np.random.default_rng(seed)
  return {"x": rng.normal(size=(rows, d_in)).astype(np.float32), "y": rng.normal(size=(rows, d_out)).astype(np.float32)}


def mlp(p, x):
  p = tpustrat.read_values(p)  # sharded parameters: whole (a no-op on arrays)
  h = jnp.tanh(x @ p["w1"].astype(jnp.float32) + p["b1"].astype(jnp.float32))
  return h @ p["w2"].astype(jnp.float32) + p["b2"].astype(jnp.float32)


def loss_fn(p, batch):
  """This replica's summed squared error over its real rows / the global batch (compute_average_loss)."""
  err = jnp.sum((mlp(p, batch["x"]) - batch["y"]) ** 2, axis=-1)
  return jnp.sum(jnp.where(tpustrat.valid_mask(batch["x"]), err, 0.0)) / GLOBAL


def reference(params, data, denominator=GLOBAL):
  """Plain JAX on one device, no tpustrat: loss and gradients on the whole batch of real rows."""
  def loss(p):
    h = jnp.tanh(data["x"] @ p["w1"] + p["b1"])
    return jnp.sum((h @ p["w2"] + p["b2"] - data["y"]) ** 2) / denominator
  with jax.default_device(jax.devices()[0]):
    return jax.jit(jax.value_and_grad(loss))(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params))


def scales(params, data, denominator=GLOBAL):
  """What each gradient entry adds up (for `assert_close`'s atol): sum over examples of |its gradient|."""
  def example_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.sum((h @ p["w2"] + p["b2"] - y) ** 2) / denominator
  p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  per_example = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(p, data["x"], data["y"])
  return {name: np.abs(np.asarray(g)).sum(0) for name, g in per_example.items()}


def batches(strategy, data):
  return iter(strategy.experimental_distribute_dataset([data]))


def local(value, strategy):
  """One replica's component of a `Mirrored` or the whole of a `ShardedVariable`."""
  if isinstance(value, ShardedVariable) or not isinstance(value, tpustrat.DistributedValues):
    return np.asarray(value)
  return np.asarray(strategy.experimental_local_results(value)[0])


def check_grads(strategy, grads, expected, params, data, rtol=1e-5, denominator=GLOBAL):
  scale = scales(params, data, denominator)
  for name in expected:
    assert_close(local(grads[name], strategy), expected[name], rtol=rtol, scale=scale[name], err_msg=name)


def accumulate_step(k):
  def step(params, batch):
    loss, grads = tpustrat.accumulate_gradients(loss_fn, params, batch, gradient_accumulation_steps=k)
    return loss, grads
  return step


# -- the numbers ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_equals_the_one_device_big_batch_step(n, k):
  strategy = make_strategy(n)
  params, data = init_params(), make_data(GLOBAL)
  ref_loss, ref_grads = reference(params, data)
  loss, grads = strategy.run(accumulate_step(k), args=(params, next(batches(strategy, data))))
  assert isinstance(loss, PerReplica) and all(isinstance(g, Mirrored) for g in grads.values())
  assert_close(strategy.reduce("SUM", loss, axis=None), ref_loss, rtol=1e-5)
  check_grads(strategy, grads, ref_grads, params, data)


@pytest.mark.parametrize("k", [2, 4])
def test_padding_rows_of_a_partial_batch_count_for_nothing(strategy, k):
  # 32 rows then 13: k = 4 rows per replica, so the partial batch fills replicas 0-2, gives replica 3 one
  # real row (micro-batches of 2 or 1 rows: one with a real row and padding, the others padding only) and
  # replicas 4-7 padding only. The padding rows hold zeros, whose squared error is not zero.
  params = init_params()
  full, tail = make_data(GLOBAL, seed=1), make_data(13, seed=2)
  it = iter(strategy.experimental_distribute_dataset([full, tail]))
  next(it)
  partial = next(it)
  assert [int(c) for c in partial["x"].host_real_rows()] == [4, 4, 4, 1, 0, 0, 0, 0]

  def step(params, batch):
    def loss(p, b):  # masks through valid_mask() without an argument, and counts real rows
      err = jnp.sum((mlp(p, b["x"]) - b["y"]) ** 2, axis=-1)
      return jnp.sum(jnp.where(tpustrat.valid_mask(), err, 0.0)) / GLOBAL, tpustrat.num_valid_examples(b)
    (value, counts), grads = tpustrat.accumulate_gradients(loss, params, batch, gradient_accumulation_steps=k,
                                                           has_aux=True)
    return value, counts, grads

  value, counts, grads = strategy.run(step, args=(params, partial))
  m = 4 // k
  expected_counts = [[min(max(c - i * m, 0), m) for i in range(k)] for c in (4, 4, 4, 1, 0, 0, 0, 0)]
  assert [list(np.asarray(c)) for c in strategy.experimental_local_results(counts)] == expected_counts
  # numpy on the 13 real rows only.
  x, y = tail["x"].astype(np.float64), tail["y"].astype(np.float64)
  p = {name: v.astype(np.float64) for name, v in params.items()}
  h = np.tanh(x @ p["w1"] + p["b1"])
  err = h @ p["w2"] + p["b2"] - y
  d_out = 2 * err / GLOBAL
  d_h = (d_out @ p["w2"].T) * (1 - h ** 2)
  expected = {"w2": h.T @ d_out, "b2": d_out.sum(0), "w1": x.T @ d_h, "b1": d_h.sum(0)}
  assert_close(strategy.reduce("SUM", value, axis=None), np.sum(err ** 2) / GLOBAL, rtol=1e-5)
  check_grads(strategy, grads, expected, params, tail)


def average_loss_step(k, global_batch_size):
  """The step of TF's tutorials: `compute_average_loss` of the per-example losses, accumulated over k."""
  def step(params, batch):
    def loss(p, b):
      per_example = jnp.sum((mlp(p, b["x"]) - b["y"]) ** 2, axis=-1)
      return tpustrat.compute_average_loss(per_example, global_batch_size=global_batch_size)
    return tpustrat.accumulate_gradients(loss, params, batch, gradient_accumulation_steps=k)
  return step


@pytest.mark.parametrize("global_batch_size", [None, GLOBAL], ids=["default", "global_batch_size"])
@pytest.mark.parametrize("rows", [GLOBAL, 13, 1], ids=["full", "13_of_32", "1_of_32"])
@pytest.mark.parametrize("k", [2, 4])
def test_compute_average_loss_in_micro_batches_is_the_whole_global_batchs(strategy, k, rows, global_batch_size):
  # Issue 43, item 2: the default denominator was each micro-batch's own (its rows, or real rows, over
  # the replicas), so loss and gradients were about k times the batch's. It is the whole global batch's,
  # as TF's compute_average_loss on the big batch: its GLOBAL examples, or its real ones on a partial
  # batch (the second batch of the dataset: 4 rows per replica, 13 real = [4, 4, 4, 1, 0, 0, 0, 0], or 1
  # real = [1, 0, ...]). The reference: one device, the real rows only, their mean (or sum / GLOBAL).
  params, data = init_params(), make_data(rows, seed=3)
  it = iter(strategy.experimental_distribute_dataset([make_data(GLOBAL, seed=2), data]))
  next(it)
  batch = next(it)
  assert sum(int(c) for c in batch["x"].host_real_rows()) == rows
  loss, grads = strategy.run(average_loss_step(k, global_batch_size), args=(params, batch))
  denominator = rows if global_batch_size is None else GLOBAL
  ref_loss, ref_grads = reference(params, data, denominator)
  assert_close(strategy.reduce("SUM", loss, axis=None), ref_loss, rtol=1e-5)
  check_grads(strategy, grads, ref_grads, params, data, denominator=denominator)


def test_nested_accumulations_keep_the_whole_global_batchs_denominator(strategy):
  # An accumulation inside another's loss: the inner micro-batches are parts of the outer's, which are
  # parts of the step's batch (k = 2 x 2), on a plain per-replica batch (no padding: GLOBAL examples) and
  # on a partial one (its 13 real examples).
  params, inner = init_params(), average_loss_step(2, None)

  def step(p, b):
    return tpustrat.accumulate_gradients(lambda p, b: inner(p, b)[0], p, b, gradient_accumulation_steps=2)

  for rows in (GLOBAL, 13):
    data = make_data(rows, seed=4)
    if rows == GLOBAL:  # a PerReplica of arrays, not a dataset's: no real-row counts
      batch = PerReplica([jax.tree.map(lambda a, r=r: a[r * 4:(r + 1) * 4], data) for r in range(N)])
    else:
      it = iter(strategy.experimental_distribute_dataset([make_data(GLOBAL, seed=2), data]))
      next(it)
      batch = next(it)
    loss, grads = strategy.run(step, args=(params, batch))
    ref_loss, ref_grads = reference(params, data, rows)
    assert_close(strategy.reduce("SUM", loss, axis=None), ref_loss, rtol=1e-5, err_msg=str(rows))
    check_grads(strategy, grads, ref_grads, params, data, denominator=rows)


def test_without_a_strategy_the_default_denominator_is_the_whole_batchs():
  params, data = init_params(), make_data(GLOBAL)
  ref_loss, ref = reference(params, data)
  loss, grads = average_loss_step(4, None)(params, data)
  assert_close(loss, ref_loss, rtol=1e-5)
  for name in params:
    assert_close(grads[name], ref[name], rtol=1e-5, scale=scales(params, data)[name], err_msg=name)


def test_adam_through_run_steps_and_run_inside_jit_and_scan_equals_one_device_optax(strategy):
  tx = optax.adam(1e-2)
  params = init_params()
  data = [make_data(rows, seed=s) for s, rows in enumerate((GLOBAL, GLOBAL, 13))]  # the last one partial
  # The reference: plain optax on one device, the whole global batch (its real rows) each step.
  ref_params, ref_opt = params, tx.init(params)
  for batch in data:
    _, g = reference(ref_params, batch)
    updates, ref_opt = tx.update(g, ref_opt, ref_params)
    ref_params = optax.apply_updates(ref_params, updates)

  def train_step(state, batch):
    loss, grads = tpustrat.accumulate_gradients(loss_fn, state["params"], batch, gradient_accumulation_steps=4)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

  init = {"params": params, "opt": tx.init(params)}
  dist = strategy.experimental_distribute_dataset(data)
  state, losses = strategy.experimental_run_steps(train_step, iter(dist), 3, init=init)
  stacked = tpustrat.stack_steps(list(iter(dist)))

  @jax.jit
  def in_jit_and_scan(state, stacked):
    return jax.lax.scan(lambda s, b: strategy.run(train_step, args=(s, b)), state, stacked)

  state_jit, _ = in_jit_and_scan(strategy.experimental_mirror(init), stacked)  # scan: the carry's type
  for got in (state, state_jit):
    for name in params:
      assert_close(local(got["params"][name], strategy), ref_params[name], rtol=1e-5,
                   scale=np.abs(ref_params[name]).max() + 1e-2, err_msg=name)
  assert np.shape(strategy.reduce("SUM", tpustrat.unstack_steps(losses)[0], axis=None)) == ()


def test_sgd_on_sharded_parameters_equals_one_device(strategy):
  # The large leaves are ShardedVariables (split along axis 0 and axis 1; 16 and 3 rows over 8 replicas:
  # the second padded), the biases Mirrored: one SGD step with k = 4 against plain JAX on the whole batch.
  params = init_params(hidden=16)
  sharded = strategy.experimental_shard(params, lambda path, shape, dtype: {"['w1']": 1, "['w2']": 0}.get(
      jax.tree_util.keystr(path)))
  assert isinstance(sharded["w1"], ShardedVariable) and isinstance(sharded["b1"], Mirrored)
  data = make_data(GLOBAL)
  _, ref = reference(params, data)

  def step(params, batch):
    loss, grads = tpustrat.accumulate_gradients(loss_fn, params, batch, gradient_accumulation_steps=4)
    assert isinstance(grads["w1"], LocalShard) and grads["w1"].block.shape == params["w1"].block.shape
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), grads

  new, grads = strategy.run(step, args=(sharded, next(batches(strategy, data))))
  assert isinstance(new["w1"], ShardedVariable) and isinstance(grads["w2"], ShardedVariable)
  check_grads(strategy, grads, ref, params, data)
  for name in params:
    assert_close(local(new[name], strategy), params[name] - 0.1 * np.asarray(ref[name]), rtol=1e-5,
                 scale=np.abs(params[name]).max(), err_msg=name)


def test_bfloat16_parameters_accumulate_in_float32_and_return_bfloat16(strategy):
  params = init_params(dtype=jnp.bfloat16)
  data = make_data(GLOBAL)
  _, ref = reference(params, data)
  _, grads = strategy.run(accumulate_step(4), args=(params, next(batches(strategy, data))))
  for name in params:
    g = local(grads[name], strategy)
    assert g.dtype == jnp.bfloat16
    assert_close(g.astype(np.float32), ref[name], rtol=2 ** -7, scale=scales(
        jax.tree.map(lambda a: np.asarray(a, np.float32), params), data)[name], err_msg=name)


def test_per_replica_parameters_get_their_own_gradients_without_communication(strategy):
  # Parameters that differ per replica (PerReplica, or local copies): each replica's own gradient, as
  # jax.grad gives it. Replica r's parameter is r + 1; its loss is sum(w * x) / GLOBAL on its own rows.
  data = {"x": np.arange(GLOBAL, dtype=np.float32)}
  w = PerReplica([np.float32(r + 1) for r in range(N)])

  def step(w, batch):
    return tpustrat.accumulate_gradients(lambda w, b: jnp.sum(w * b["x"]) / GLOBAL, w, batch,
                                         gradient_accumulation_steps=2)

  loss, grad = strategy.run(step, args=(w, next(batches(strategy, data))))
  assert isinstance(grad, PerReplica)
  rows = data["x"].reshape(N, -1)
  np.testing.assert_allclose([np.asarray(g) for g in strategy.experimental_local_results(grad)],
                             rows.sum(1) / GLOBAL, rtol=1e-6)
  np.testing.assert_allclose([np.asarray(v) for v in strategy.experimental_local_results(loss)],
                             (np.arange(N) + 1) * rows.sum(1) / GLOBAL, rtol=1e-6)


def test_aux_is_stacked_per_micro_batch(strategy):
  data = make_data(GLOBAL)

  def step(params, batch):
    def loss(p, b):
      out = mlp(p, b["x"])
      return jnp.sum((out - b["y"]) ** 2) / GLOBAL, out
    (_, out), _ = tpustrat.accumulate_gradients(loss, params, batch, gradient_accumulation_steps=2, has_aux=True)
    return out

  out = strategy.run(step, args=(init_params(), next(batches(strategy, data))))
  got = np.concatenate([np.asarray(c).reshape(-1, 3) for c in strategy.experimental_local_results(out)])
  p = init_params()
  assert_close(got, np.tanh(data["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], rtol=1e-5, scale=4.0)
  assert out.values[0].shape == (2, 2, 3)  # [k, rows / k, ...]


def test_without_a_strategy_it_is_value_and_grad():
  params, data = init_params(), make_data(GLOBAL)
  ref_loss, ref = reference(params, data)
  loss, grads = tpustrat.accumulate_gradients(loss_fn, params, data, gradient_accumulation_steps=4)
  assert_close(loss, ref_loss)
  check_grads(None, {k: np.asarray(v) for k, v in grads.items()}, ref, params, data)


# -- the compiled program: one communication ------------------------------------------------------------


def hlo_computations(hlo):
  """{name: body text} of every computation in an HLO module's text."""
  found, name, lines = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head and not line.startswith(" "):
      name, lines = head.group(1), []
    elif line == "}" and name is not None:
      found[name] = "\n".join(lines)
      name = None
    elif name is not None:
      lines.append(line)
  return found


def collectives(hlo):
  """(all-reduces, reduce-scatters, all-gathers) in the program, and the collectives in its loops' bodies."""
  comps = hlo_computations(hlo)
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  ops = ("all-reduce(", "reduce-scatter(", "all-gather(", "all-reduce-start(", "reduce-scatter-start(",
         "all-gather-start(")
  in_loops = sum(comps[b].count(op) for b in bodies for op in ops)
  return tuple(hlo.count(op) + hlo.count(op[:-1] + "-start(") for op in ops[:3]), in_loops


def compiled_hlo(strategy, step, *args):
  return jax.jit(lambda *a: strategy.run(step, args=a)).lower(*args).compile().as_text()


def test_naive_accumulation_all_reduces_in_its_loop():
  # What the test below rules out: jax.grad w.r.t. Mirrored parameters inside a scan all-reduces every
  # micro-batch (the all-reduce sits in the loop's body).
  strategy = make_strategy(N)
  data = make_data(GLOBAL)

  def naive(params, batch):
    micro = jax.tree.map(lambda x: x.reshape((4, -1) + x.shape[1:]), batch)
    def body(acc, b):
      return jax.tree.map(jnp.add, acc, jax.grad(lambda p: jnp.sum((mlp(p, b["x"]) - b["y"]) ** 2))(params)), None
    return jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), micro)[0]

  _, in_loops = collectives(compiled_hlo(strategy, naive, init_params(), next(batches(strategy, data))))
  assert in_loops >= 1


def test_k4_step_all_reduces_as_often_as_the_k1_step_and_never_in_its_loop(strategy):
  params, batch = init_params(), next(batches(strategy, make_data(GLOBAL)))

  def plain(params, batch):  # the big-batch step as JAX writes it: grad w.r.t. the Mirrored parameters
    return jax.value_and_grad(loss_fn)(params, batch)

  counts = {}
  for name, step in (("plain", plain), ("k=1", accumulate_step(1)), ("k=4", accumulate_step(4))):
    (all_reduces, _, _), in_loops = collectives(compiled_hlo(strategy, step, params, batch))
    counts[name] = all_reduces
    assert in_loops == 0, name
  assert counts["k=4"] == counts["k=1"] >= 1, counts
  assert counts["k=4"] <= counts["plain"], counts


def test_the_default_denominator_is_summed_once_outside_the_loop(strategy):
  # compute_average_loss's default denominator on a padded batch: its real examples summed over the
  # replicas (a scalar all-reduce) once, before the micro-batches' loop: as many all-reduces as with k = 1.
  params, batch = init_params(), next(batches(strategy, make_data(GLOBAL)))
  counts = {}
  for k in (1, 4):
    (all_reduces, _, _), in_loops = collectives(compiled_hlo(strategy, average_loss_step(k, None), params, batch))
    assert in_loops == 0, k
    counts[k] = all_reduces
  assert counts[4] == counts[1] >= 1, counts


def test_k4_step_reduce_scatters_sharded_gradients_as_often_as_the_k1_step(strategy):
  params = strategy.experimental_shard(init_params(hidden=16), tpustrat.MinSizePartitioner(min_shard_bytes=128))
  assert sum(isinstance(v, ShardedVariable) for v in params.values()) == 2
  batch = next(batches(strategy, make_data(GLOBAL)))
  found = {}
  for k in (1, 4):
    found[k] = collectives(compiled_hlo(strategy, accumulate_step(k), params, batch))
  (ar1, rs1, ag1), loops1 = found[1]
  (ar4, rs4, ag4), loops4 = found[4]
  assert loops1 == loops4 == 0, found
  assert (ar4, rs4, ag4) == (ar1, rs1, ag1), found
  assert 1 <= rs4 <= 2 and 1 <= ag4 <= 2, found  # one per sharded leaf at most (XLA may combine them)


def test_k4_step_needs_at_most_0_4x_the_temporaries_of_the_k1_step(strategy):
  # An activation-heavy MLP: 2048 rows per replica through 4 layers of width 64 (activations 512 KiB a
  # layer, parameters 16 KiB). Measured with JAX 0.10.2 on XLA:CPU: 0.323x (k = 2: 0.621x, k = 8: 0.174x).
  rng = np.random.default_rng(0)
  width, rows = 64, 2048
  params = [(rng.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(4)]
  x = PerReplica([np.zeros((rows, width), np.float32)] * N)

  def loss(ps, x):
    for w in ps:
      x = jnp.tanh(x @ w)
    return jnp.sum(x ** 2) / (N * rows)

  def step(k):
    return lambda ps, x: tpustrat.accumulate_gradients(loss, ps, x, gradient_accumulation_steps=k)

  temps = {}
  for k in (1, 4):
    compiled = jax.jit(lambda ps, x, k=k: strategy.run(step(k), args=(ps, x))).lower(params, x).compile()
    temps[k] = compiled.memory_analysis().temp_size_in_bytes
  assert temps[4] <= 0.4 * temps[1], temps


# -- errors ---------------------------------------------------------------------------------------------


def test_bad_k_is_an_error_before_tracing(strategy):
  batch = next(batches(strategy, make_data(GLOBAL)))
  traced = []

  def run(k, batch=batch):
    def loss(p, b):
      traced.append(1)
      return loss_fn(p, b)
    return strategy.run(lambda p, b: tpustrat.accumulate_gradients(loss, p, b, gradient_accumulation_steps=k),
                        args=(init_params(), batch))

  with pytest.raises(ValueError, match=r"the leaf of `batch` at \['x'\] has 4 rows per replica, which "
                                       r"gradient_accumulation_steps=3 does not divide"):
    run(3)
  with pytest.raises(ValueError, match=r"`gradient_accumulation_steps` must be an int >= 1, got 0"):
    run(0)
  with pytest.raises(TypeError, match=r"`gradient_accumulation_steps` must be an int >= 1, got float 2.0"):
    run(2.0)
  with pytest.raises(TypeError, match=r"got bool True"):
    run(True)
  assert not traced
  with pytest.raises(ValueError, match=r"the leaf of `batch` at \['s'\] is a scalar"):
    strategy.run(lambda p, b: tpustrat.accumulate_gradients(lambda p, b: jnp.sum(p["b1"]), p, {"s": 1.0, **b},
                                                            gradient_accumulation_steps=2), args=(init_params(), batch))
  with pytest.raises(TypeError, match=r"`loss_fn` must be callable"):
    tpustrat.accumulate_gradients("loss", {}, np.zeros(4), gradient_accumulation_steps=2)
  with pytest.raises(RuntimeError, match=r"cross-replica context"), strategy.scope():
    tpustrat.accumulate_gradients(loss_fn, {}, np.zeros(4), gradient_accumulation_steps=2)


def test_per_example_inside_the_loss_is_an_error(strategy):
  it = iter(strategy.experimental_distribute_dataset([make_data(GLOBAL), make_data(13)]))
  next(it)

  def step(params, batch):
    def loss(p, b):
      out = tpustrat.per_example(mlp(p, b["x"]))
      return jnp.sum(out) / GLOBAL
    return tpustrat.accumulate_gradients(loss, params, batch, gradient_accumulation_steps=2)[1]

  with warnings.catch_warnings(), pytest.raises(ValueError, match=r"`loss_fn` called tpustrat.per_example"):
    strategy.run(step, args=(init_params(), next(it)))


def test_cross_device_ops_and_unused_parameters():
  # MirroredStrategy with TF's NcclAllReduce (packs): the one all-reduce goes through it; a parameter the
  # loss does not use gets zeros (no AlreadyReplicatedWarning: warnings are errors here).
  strategy = tpustrat.MirroredStrategy(jax.devices()[:4], cross_device_ops=tpustrat.NcclAllReduce(num_packs=2))
  params, data = {**init_params(), "unused": np.ones(3, np.float32)}, make_data(GLOBAL)
  _, ref = reference({k: v for k, v in params.items() if k != "unused"}, data)
  _, grads = strategy.run(accumulate_step(2), args=(params, next(batches(strategy, data))))
  check_grads(strategy, grads, ref, params, data)
  np.testing.assert_array_equal(local(grads["unused"], strategy), np.zeros(3, np.float32))


def test_a_loss_that_is_not_a_scalar_and_batch_leaves_of_different_rows_are_errors(strategy):
  params, batch = init_params(), next(batches(strategy, make_data(GLOBAL)))

  def run(loss, batch=batch, k=2, **kw):
    return strategy.run(lambda p, b: tpustrat.accumulate_gradients(loss, p, b, gradient_accumulation_steps=k, **kw),
                        args=(params, batch))

  per_example = lambda p, b: jnp.sum((mlp(p, b["x"]) - b["y"]) ** 2, axis=-1)  # noqa: E731
  with pytest.raises(TypeError, match=r"`loss_fn` must return a scalar loss, got shape \(2,\) on a micro-batch "
                                      r"of 2 rows \(1/2 of this replica's batch\)\. Sum the per-example"):
    run(per_example)
  with pytest.raises(TypeError, match=r"must return a scalar loss, got shape \(4,\)\. Sum"):
    run(per_example, k=1)
  with pytest.raises(TypeError, match=r"must return a scalar loss, got shape \(1,\)"):
    run(lambda p, b: jnp.sum(per_example(p, b), keepdims=True))
  with pytest.raises(TypeError, match=r"with has_aux=True, `loss_fn` must return \(loss, aux\)"):
    run(loss_fn, has_aux=True)
  # A leaf that is not per example (a table of 8 rows beside 4 examples) would be split too: an error.
  table = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((8, 3), np.float32))
  with pytest.raises(ValueError, match=r"different numbers of rows: \['table'\] has 8 per replica, \['x'\] 4"):
    run(loss_fn, batch={**batch, "table": table})
