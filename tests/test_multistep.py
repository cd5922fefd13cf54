"""Many steps per program: run inside jit/scan/fori_loop, take_steps, experimental_run_steps, errors.

The reference is always the same step dispatched one `strategy.run` at a time on the same batches.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat._src.values import Mirrored, PerReplica

N = 8
GLOBAL = 16
NUM_EXAMPLES = 100  # 6 batches of 16 and a partial one of 4
LR = 0.1


def dataset(num_examples=NUM_EXAMPLES, batch=GLOBAL):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(num_examples, 3)).astype(np.float32)
  y = (x @ np.float32([1.0, -2.0, 0.5]) + 0.3).astype(np.float32)
  ids = np.arange(num_examples, dtype=np.int32)
  return [{"x": x[i:i + batch], "y": y[i:i + batch], "id": ids[i:i + batch]} for i in range(0, num_examples, batch)]


def init_state():
  return {"params": {"w": np.zeros(3, np.float32), "b": np.zeros((), np.float32)}, "step": np.int32(0)}


def train_step(state, batch):
  """SGD on a masked squared error; returns the new state, the global loss and per-example predictions."""
  ctx = tpustrat.get_replica_context()
  mask = tpustrat.valid_mask(batch["x"])

  def loss_fn(p):
    err = batch["x"] @ p["w"] + p["b"] - batch["y"]
    return jnp.sum(jnp.where(mask, err * err, 0.0)) / GLOBAL

  loss, grads = jax.value_and_grad(loss_fn)(state["params"])
  params = jax.tree.map(lambda p, g: p - LR * g, state["params"], grads)
  new = {"params": params, "step": state["step"] + 1}
  return new, (ctx.all_reduce("sum", loss), batch["x"] @ params["w"], batch["id"])


def scan_step(state, batch):
  """The same step in lax.scan's form: (carry, x) -> (carry, y)."""
  return train_step(state, batch)


def host(tree):
  """A run result as numpy per step: Mirrored as its value, PerReplica gathered (real rows only)."""
  def leaf(v):
    if isinstance(v, Mirrored):
      return np.asarray(v.values[0])
    if isinstance(v, PerReplica):
      return np.asarray(tpustrat.get_strategy().gather(v, axis=0)) if v.tree.ndim > 1 else np.stack(v.values)
    return np.asarray(v)
  return jax.tree.map(leaf, tree, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))


def reference(strategy, batches):
  """One run call per batch: per step (state, (loss, preds, ids)) as numpy."""
  state, steps = init_state(), []
  for batch in strategy.experimental_distribute_dataset(batches):
    state, out = strategy.run(train_step, args=(state, batch))
    with strategy.scope():
      steps.append(host((state, out)))
  return steps


def assert_steps_equal(got, want):
  assert len(got) == len(want)
  # Another program may add in another order: a float leaf's tolerance scales with its largest magnitude
  # over the steps (a parameter near zero at one step is the sum of larger ones); integers are exact.
  scales = [max(np.abs(np.asarray(v, np.float64)).max(initial=0.0) for v in leaf)
            for leaf in zip(*(jax.tree.leaves(w) for w in want))]
  for i, (g, w) in enumerate(zip(got, want)):
    assert jax.tree.structure(g) == jax.tree.structure(w), i
    for a, b, scale in zip(jax.tree.leaves(g), jax.tree.leaves(w), scales):
      if np.issubdtype(np.asarray(b).dtype, np.integer):
        np.testing.assert_array_equal(a, b, err_msg=f"step {i}")
      else:
        assert_close(a, b, scale=scale, err_msg=f"step {i}")


# -- the TF idiom: strategy.run inside jit + scan over take_steps ------------------------------------


def test_issue_idiom_scan_over_take_steps_equals_separate_runs(strategy):
  batches = dataset()
  want = reference(strategy, batches)
  traces = []

  def step(state, batch):
    traces.append(1)
    return train_step(state, batch)

  @jax.jit
  def train_steps(state, stacked):
    def body(state, batch):
      state, out = strategy.run(step, args=(state, batch))
      return state, (state, out)  # the state after every step too, to compare step by step
    return jax.lax.scan(body, state, stacked)

  state = strategy.experimental_mirror(init_state())  # the carry type run returns
  it = iter(strategy.experimental_distribute_dataset(batches))
  got, sizes = [], []
  while True:
    try:
      stacked = it.take_steps(4)
    except StopIteration:
      break
    sizes.append(stacked["x"].tree.shape[0])
    state, per_step = train_steps(state, stacked)
    with strategy.scope():
      got.extend(host(s) for s in tpustrat.unstack_steps(per_step))
  assert sizes == [4, 3]  # the last group is shorter, and holds the partial batch
  assert_steps_equal(got, want)
  assert isinstance(state["step"], Mirrored) and int(state["step"].values[0]) == 7
  assert len(traces) == 1  # the step is traced once, for both group sizes


def test_run_inside_fori_loop_over_stacked_batches(strategy):
  batches = dataset(48)  # 3 full batches
  want = reference(strategy, batches)
  stacked = iter(strategy.experimental_distribute_dataset(batches)).take_steps(3)

  @jax.jit
  def loop(state, stacked):
    def body(i, carry):
      state, losses = carry
      batch = jax.tree.map(lambda x: x[i], stacked)  # step i: an ordinary PerReplica batch
      state, (loss, _, _) = strategy.run(train_step, args=(state, batch))
      return state, losses.at[i].set(loss.tree)
    return jax.lax.fori_loop(0, 3, body, (state, jnp.zeros(3)))

  state, losses = loop(strategy.experimental_mirror(init_state()), stacked)
  np.testing.assert_allclose(losses, [w[1][0] for w in want], rtol=1e-5)
  assert_close(state["params"]["w"].values[0], want[-1][0]["params"]["w"])


# -- experimental_run_steps -------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 10])
def test_experimental_run_steps_equals_separate_runs(strategy, k):
  batches = dataset()
  want = reference(strategy, batches)
  it = iter(strategy.experimental_distribute_dataset(batches))
  state, got, sizes = init_state(), [], []
  while True:
    try:
      state, outputs = strategy.experimental_run_steps(scan_step, it, k, state)
    except StopIteration:
      break
    loss = outputs[0]
    assert isinstance(loss, Mirrored) and isinstance(outputs[1], PerReplica)
    sizes.append(loss.tree.shape[0])
    assert outputs[1].tree.sharding.spec == P(None, "replica")
    with strategy.scope():
      got.extend(host(o) for o in tpustrat.unstack_steps(outputs))
  assert sizes == [min(k, 7 - i) for i in range(0, 7, k)]
  assert_steps_equal(got, [w[1] for w in want])
  assert_close(state["params"]["w"].values[0], want[-1][0]["params"]["w"])
  assert isinstance(state["step"], Mirrored) and int(state["step"].values[0]) == 7


@pytest.mark.parametrize("unroll", [2, True])
def test_scan_unroll_equals_separate_runs(strategy, unroll):
  """RunOptions(scan_unroll=...) (issue 32): the steps written out in the scan's body (2 per iteration, or all
  with no loop) give the numbers of one `run` per batch, partial last batch and short last group included."""
  batches = dataset()
  want = reference(strategy, batches)
  it = iter(strategy.experimental_distribute_dataset(batches))
  state, got = init_state(), []
  options = tpustrat.RunOptions(scan_unroll=unroll)
  while True:
    try:
      state, outputs = strategy.experimental_run_steps(scan_step, it, 3, state, options=options)
    except StopIteration:
      break
    with strategy.scope():
      got.extend(host(o) for o in tpustrat.unstack_steps(outputs))
  assert_steps_equal(got, [w[1] for w in want])
  assert_close(state["params"]["w"].values[0], want[-1][0]["params"]["w"])
  assert int(state["step"].values[0]) == 7


def test_scan_unroll_writes_the_steps_out(strategy):
  """The compiled program: a loop by default; with scan_unroll=True none (the steps one after another)."""
  from tpustrat._src import multistep

  stacked = iter(strategy.experimental_distribute_dataset(dataset(64))).take_steps(4)
  carry = strategy.experimental_mirror(init_state())
  rolled, by_two, unrolled = (multistep._program(strategy, scan_step, (), False, u).lower(carry, stacked).as_text()
                              for u in (1, 2, True))
  assert "while" in rolled and "while" in by_two and "while" not in unrolled


def test_scan_unroll_true_is_not_one(strategy):
  """``scan_unroll=True`` (no loop) and ``scan_unroll=1`` (a rolled loop) are different options, though
  ``True == 1`` in Python: a call with one after a call with the other (same function, same batches) runs
  its own program, not the one `experimental_run_steps`' fast path kept for the other."""
  from tpustrat._src import multistep

  assert tpustrat.RunOptions(scan_unroll=True) != tpustrat.RunOptions(scan_unroll=1)
  assert tpustrat.RunOptions(scan_unroll=False) == tpustrat.RunOptions(scan_unroll=1)
  assert hash(tpustrat.RunOptions(max_steps_in_flight=3)) == hash(tpustrat.RunOptions(max_steps_in_flight=3))
  stacked = iter(strategy.experimental_distribute_dataset(dataset(64))).take_steps(4)
  carry = strategy.experimental_mirror(init_state())

  def step(state, batch):
    return scan_step(state, batch)

  for unroll in (1, 1, True, True):
    carry, _ = strategy.experimental_run_steps(step, stacked, init=carry,
                                               options=tpustrat.RunOptions(scan_unroll=unroll))
  keys = [k for k in multistep._PROGRAMS[strategy] if k == step or (isinstance(k, tuple) and k[0] == step)]
  assert keys == [step, (step, "scan_unroll", "all")]


@pytest.mark.parametrize("unroll, error", [(0, ValueError), (-1, ValueError), (1.5, TypeError), ("2", TypeError)])
def test_scan_unroll_is_checked(unroll, error):
  with pytest.raises(error, match=r"RunOptions: `scan_unroll` must be an int >= 1"):
    tpustrat.RunOptions(scan_unroll=unroll)
  assert tpustrat.RunOptions(scan_unroll=False).scan_unroll == 1
  assert tpustrat.RunOptions(scan_unroll=True).scan_unroll is True
  assert tpustrat.RunOptions(scan_unroll=np.int64(4)).scan_unroll == 4 and tpustrat.RunOptions().scan_unroll == 1


def test_partial_batches_inside_a_program_are_counted_exactly(strategy):
  # 20 examples in batches of 16: the second batch has 4 real rows on replicas 0-1 (k = 2) and none elsewhere.
  it = iter(strategy.experimental_distribute_dataset(dataset(20)))

  def fn(count, batch):
    ctx = tpustrat.get_replica_context()
    n = ctx.all_reduce("sum", tpustrat.num_valid_examples(batch["x"]))
    return count + n, (n, tpustrat.per_example(batch["id"] * 10))

  count, (per_step, ids) = strategy.experimental_run_steps(fn, it, 5, np.int32(0))
  assert int(count.values[0]) == 20
  np.testing.assert_array_equal(per_step.values[0], [16, 4])
  first, second = tpustrat.unstack_steps(ids)
  np.testing.assert_array_equal(strategy.gather(second, axis=0), np.arange(16, 20) * 10)
  assert [len(v) for v in strategy.experimental_local_results(second)] == [2, 2, 0, 0, 0, 0, 0, 0]
  assert float(strategy.reduce("SUM", first, axis=0)) == np.arange(16).sum() * 10


def test_run_steps_over_a_dataset_with_an_unmasked_mean(strategy):
  """A classifier step with TF's literal loss (a mean over the batch's rows, no mask: the padding-read
  analysis marks it) runs inside experimental_run_steps over a dataset: the padding counts are traced values
  there, not read on the host (this raised a ConcretizationTypeError; issue 32). It equals separate runs."""
  rng = np.random.default_rng(3)
  batches = [(rng.normal(size=(GLOBAL, 3)).astype(np.float32), rng.integers(0, 2, GLOBAL).astype(np.int32))
             for _ in range(4)]  # full batches: no padding rows
  w0 = rng.normal(size=(3, 2)).astype(np.float32)

  def loss_fn(w, x, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(x @ w), y[:, None], 1))

  def fn(w, batch):
    loss, g = jax.value_and_grad(loss_fn)(w, *batch)  # g: already summed over the replicas (Mirrored w)
    return w - LR * g / N, tpustrat.get_replica_context().all_reduce("sum", loss) / N

  w, want = w0, []
  for batch in strategy.experimental_distribute_dataset(batches):
    w, loss = strategy.run(fn, args=(w, batch))
    want.append(float(loss.values[0]))
  got_w, losses = strategy.experimental_run_steps(fn, iter(strategy.experimental_distribute_dataset(batches)), 4,
                                                  w0)
  np.testing.assert_allclose(losses.values[0], want, rtol=1e-5)
  np.testing.assert_allclose(got_w.values[0], w.values[0], rtol=1e-5, atol=1e-6)
  x, y = batches[0]  # the first step's loss from numpy: the global batch's mean (equal rows per replica)
  logits = x @ w0
  logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  np.testing.assert_allclose(want[0], -logp[np.arange(GLOBAL), y].mean(), rtol=1e-5)


def test_run_steps_traces_fn_once_and_reuses_the_program(strategy):
  traces = []

  def fn(w, x):
    traces.append(1)
    return w + tpustrat.get_replica_context().all_reduce("mean", x), x * w

  xs = np.arange(N * 6, dtype=np.float32).reshape(6, N)
  stacked = tpustrat.stack_steps([
      strategy.experimental_distribute_values_from_function(lambda ctx, a=a: a[ctx.replica_id_in_sync_group])
      for a in xs])
  w = 0.0
  for _ in range(5):
    w, ys = strategy.experimental_run_steps(fn, stacked, init=w)
  assert len(traces) == 1
  assert float(w.values[0]) == pytest.approx(5 * xs.mean(1).sum())
  assert ys.tree.shape == (6, N)


def test_per_replica_carry_stays_per_replica(strategy):
  xs = np.arange(3 * N, dtype=np.float32).reshape(3, N)
  stacked = tpustrat.stack_steps([strategy.experimental_distribute_values_from_function(
      lambda ctx, a=a: a[ctx.replica_id_in_sync_group]) for a in xs])
  zeros = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(0))

  def accumulate(acc, x):  # per replica: stays PerReplica
    return acc + x, acc

  acc, history = strategy.experimental_run_steps(accumulate, stacked, init=zeros)
  assert isinstance(acc, PerReplica)
  np.testing.assert_allclose(np.stack(acc.values), xs.sum(0))

  def replace(acc, x):  # a replicated new value for a per-replica carry: cast to per replica
    return tpustrat.get_replica_context().all_reduce("sum", x), x

  acc, _ = strategy.experimental_run_steps(replace, stacked, init=zeros)
  assert isinstance(acc, PerReplica)
  np.testing.assert_allclose(np.stack(acc.values), np.full(N, xs[-1].sum()))


def test_run_steps_long_chain_is_bounded(strategy):
  """3,000 steps in 300 chained programs with an all-reduce each: unbounded dispatch could deadlock XLA:CPU."""
  stacked = tpustrat.stack_steps([strategy.experimental_distribute_values_from_function(
      lambda ctx: np.float32(1))] * 10)

  def fn(w, x):
    return w + tpustrat.get_replica_context().all_reduce("mean", x), w

  w = 0.0
  for _ in range(300):
    w, _ = strategy.experimental_run_steps(fn, stacked, init=w)
  assert float(w.values[0]) == 3000.0
  w, _ = strategy.experimental_run_steps(fn, stacked, init=w, options=tpustrat.RunOptions(max_steps_in_flight=1))
  assert float(w.values[0]) == 3010.0


def test_run_steps_from_a_plain_iterator_and_the_default_strategy(strategy):
  per_step = [strategy.experimental_distribute_values_from_function(lambda ctx, i=i: np.float32(i))
              for i in range(5)]
  def fn(c, x):
    return c + tpustrat.get_replica_context().all_reduce("sum", x), x * 2

  total, ys = strategy.experimental_run_steps(fn, iter(per_step), 3, 0.0)
  assert float(total.values[0]) == N * (0 + 1 + 2) and ys.tree.shape == (3, N)
  default = tpustrat.get_strategy()
  batches = iter(default.experimental_distribute_dataset([np.ones(4, np.float32)] * 3 + [np.ones(2, np.float32)]))
  total, sums = default.experimental_run_steps(lambda c, x: (c + x.sum(), x.sum()), batches, 10, 0.0)
  np.testing.assert_allclose(sums, [4.0, 4.0, 4.0])  # the unpadded partial batch has another shape
  total, sums = default.experimental_run_steps(lambda c, x: (c + x.sum(), x.sum()), batches, 10, total)
  assert float(total) == 14.0 and sums.shape == (1,)


# -- take_steps -------------------------------------------------------------------------------------


def test_take_steps_layout(strategy):
  it = iter(strategy.experimental_distribute_dataset(dataset(40)))  # 16, 16, 8
  stacked = it.take_steps(5)
  x = stacked["x"]
  assert isinstance(x, PerReplica) and x.tree.shape == (3, N, 2, 3)
  assert x.tree.sharding.spec == P(None, "replica") and x.real_rows_array.shape == (3, N)
  assert repr(x) == "PerReplica(steps=3, num_replicas=8, component=float32[2, 3], padded)"
  np.testing.assert_array_equal(np.asarray(x.real_rows_array), [[2] * 8, [2] * 8, [2] * 4 + [0] * 4])
  with pytest.raises(StopIteration):
    it.take_steps(2)


@pytest.mark.parametrize("fetch", [True, False])
def test_take_steps_mixed_with_next_keeps_the_order(strategy, fetch):
  options = tpustrat.InputOptions(experimental_fetch_to_device=fetch)
  it = iter(strategy.experimental_distribute_dataset(dataset(), options=options))  # 7 batches
  seen = []

  def ids(batch):
    return [int(i) for i in np.asarray(strategy.gather(batch["id"], axis=0))]

  seen.append(ids(next(it)))
  for step in tpustrat.unstack_steps(it.take_steps(3)):
    seen.append(ids(step))
  seen.append(ids(next(it)))  # may come out of a group read ahead
  for step in tpustrat.unstack_steps(it.take_steps(1)):
    seen.append(ids(step))
  for step in tpustrat.unstack_steps(it.take_steps(5)):  # only one left
    seen.append(ids(step))
  assert np.concatenate(seen).tolist() == list(range(NUM_EXAMPLES))
  assert [len(s) for s in seen] == [16] * 6 + [4]
  with pytest.raises(StopIteration):
    next(it)


def test_take_steps_group_ends_where_shapes_change(strategy):
  it = iter(strategy.experimental_distribute_dataset([np.ones(8, np.float32)] * 2 + [np.ones(24, np.float32)]))
  assert it.take_steps(3).tree.shape == (2, N, 1)  # the larger third batch starts the next group
  assert it.take_steps(3).tree.shape == (1, N, 3)


def test_take_steps_error_is_raised_after_the_good_batches(strategy):
  it = iter(strategy.experimental_distribute_dataset([np.zeros(16)] * 2 + [(np.zeros(16), np.zeros(15))]))
  assert it.take_steps(3).tree.shape[0] == 2
  with pytest.raises(ValueError, match=r"batch 2 has leaves with different leading"):
    it.take_steps(3)
  with pytest.raises(StopIteration):
    it.take_steps(3)


def test_take_steps_multi_process_layout(strategy):
  """The multi-process path (global arrays from this process's rows) on one process: same batches."""
  batches = dataset(40)
  plain = iter(strategy.experimental_distribute_dataset(batches)).take_steps(3)
  dist = strategy.experimental_distribute_dataset(batches)
  dist._multi_process = True
  built = iter(dist).take_steps(3)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(built)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)


# -- bad input --------------------------------------------------------------------------------------


def _stacked(strategy, steps=3):
  return tpustrat.stack_steps([strategy.experimental_distribute_values_from_function(
      lambda ctx: np.ones(2, np.float32))] * steps)


@pytest.mark.parametrize("steps, error", [(0, ValueError), (-2, ValueError), (2.5, TypeError), (True, TypeError)])
def test_steps_must_be_a_positive_int(strategy, steps, error):
  it = iter(strategy.experimental_distribute_dataset(dataset(32)))
  with pytest.raises(error, match=r"`steps` must be"):
    strategy.experimental_run_steps(scan_step, it, steps, init_state())
  with pytest.raises(error, match=r"take_steps: `k` must be"):
    it.take_steps(steps)


def test_stacked_batch_with_different_leading_axes(strategy):
  bad = {"x": _stacked(strategy, 3), "y": _stacked(strategy, 4)}
  with pytest.raises(ValueError, match=r"same number of steps.*\['x'\]: 3, \['y'\]: 4"):
    strategy.experimental_run_steps(lambda c, b: (c, b["x"]), bad, init=0.0)
  with pytest.raises(ValueError, match=r"`steps` is 2 but the stacked batches hold 3 steps"):
    strategy.experimental_run_steps(lambda c, b: (c, b), _stacked(strategy), 2, init=0.0)
  with pytest.raises(ValueError, match="same shapes and dtypes to be stacked"):
    tpustrat.stack_steps([np.zeros(2), np.zeros(3)])
  with pytest.raises(ValueError, match="same number of steps"):
    tpustrat.unstack_steps((np.zeros(2), np.zeros(3)))


@pytest.mark.parametrize("fn, error, match", [
    (lambda c, b: c + b, TypeError, r"must return a pair \(new_carry, output\)"),
    (lambda c, b: (c, "loss"), TypeError, r"returned str 'loss' at the output.*cannot be stacked over steps"),
    (lambda c, b: (c, {"name": object()}), TypeError, r"cannot be stacked over steps"),
    (lambda c, b: (jnp.zeros(3), b), ValueError, r"the carry at <root> enters fn as float32\[\] but fn returns float32\[3\]"),
    (lambda c, b: ((c, c), b), ValueError, "structure it received"),
    (lambda c, b: (c + b[0], b), ValueError, r"enters fn replicated .* differs between replicas"),
])
def test_functions_whose_results_cannot_be_scanned(strategy, fn, error, match):
  with pytest.raises(error, match=match):
    strategy.experimental_run_steps(fn, _stacked(strategy), init=0.0)


def test_iterator_arguments(strategy):
  dist = strategy.experimental_distribute_dataset(dataset(32))
  with pytest.raises(TypeError, match=r"pass iter\(DistributedDataset\)"):
    strategy.experimental_run_steps(scan_step, dist, 2, init_state())
  with pytest.raises(TypeError, match="`steps` .* is required"):
    strategy.experimental_run_steps(scan_step, iter(dist), init=init_state())
  with pytest.raises(ValueError, match="one step's value.*not stacked"):
    strategy.experimental_run_steps(scan_step, list(dist), init=init_state())
  it = iter(dist)
  strategy.experimental_run_steps(scan_step, it, 5, init_state())
  with pytest.raises(StopIteration):
    strategy.experimental_run_steps(scan_step, it, 5, init_state())


def test_stacked_steps_are_not_one_step(strategy):
  stacked = _stacked(strategy)
  with pytest.raises(ValueError, match=r"holds 3 stacked steps.*strategy.experimental_run_steps"):
    strategy.run(lambda x: x, args=(stacked,))
  with pytest.raises(ValueError, match="stacked steps.*unstack_steps"):
    strategy.reduce("SUM", stacked, axis=None)
  with pytest.raises(ValueError, match="stacked steps.*unstack_steps"):
    strategy.gather(stacked, axis=0)
  with pytest.raises(ValueError, match="stacked steps.*unstack_steps"):
    strategy.experimental_local_results(stacked)
  assert float(strategy.reduce("SUM", tpustrat.unstack_steps(stacked)[0], axis=None)[0]) == N


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_few_replicas_keep_stacked_steps_apart_from_one_step(num_replicas):
  """With one replica the 'replica' axis has one device, and XLA returns the programs' outputs without it
  in their specs: take_steps after next(), unstacked steps and run_steps outputs must still say which is
  which (regression: a P() spec made 3 stacked steps look like 3 replicas, and reduce summed them)."""
  small = tpustrat.TPUStrategy(device_assignment=jax.devices()[:num_replicas])
  n = num_replicas
  batches = [np.arange(4 * n, dtype=np.float32) + 10 * i for i in range(8)]
  it = iter(small.experimental_distribute_dataset(batches))
  first = next(it)  # the prefetch thread reads ahead single batches: take_steps stacks them on the devices
  assert first.tree.sharding.spec == P("replica")

  def check_stacked(value, steps):
    assert value.tree.shape == (steps, n, 4) and value.real_rows_array.shape == (steps, n)
    assert value.tree.sharding.spec == P(None, "replica") and value.real_rows_array.sharding.spec == P(None, "replica")
    assert repr(value) == f"PerReplica(steps={steps}, num_replicas={n}, component=float32[4], padded)"
    with pytest.raises(ValueError, match=rf"holds {steps} stacked steps.*unstack_steps"):
      small.reduce("SUM", value, axis=None)
    with pytest.raises(ValueError, match="stacked steps"):
      small.experimental_local_results(value)

  stacked = it.take_steps(3)
  check_stacked(stacked, 3)
  steps = tpustrat.unstack_steps(stacked)
  for i, step in enumerate(steps):
    assert step.tree.sharding.spec == P("replica") and step.real_rows_array.sharding.spec == P("replica")
    assert repr(step) == f"PerReplica(num_replicas={n}, component=float32[4], padded)"
    np.testing.assert_array_equal(small.reduce("SUM", step, axis=None), batches[1 + i].reshape(n, 4).sum(0))
  check_stacked(tpustrat.stack_steps(list(steps)), 3)
  check_stacked(it.take_steps(1), 1)  # one step: its shape [1, n, 4] alone cannot tell on one replica
  one = next(it)  # out of a group read ahead
  assert one.tree.sharding.spec == P("replica")
  np.testing.assert_array_equal(small.reduce("SUM", one, axis=None), batches[5].reshape(n, 4).sum(0))

  carry, out = small.experimental_run_steps(lambda c, b: (c + b, tpustrat.per_example(b * 2)), it, 2, init=tpustrat.PerReplica(
      [np.zeros(4, np.float32)] * n))
  check_stacked(out, 2)
  assert carry.tree.sharding.spec == P("replica")
  np.testing.assert_array_equal(np.stack(small.experimental_local_results(carry)),
                                (batches[6] + batches[7]).reshape(n, 4))
  np.testing.assert_array_equal(
      [small.reduce("SUM", s, axis=None) for s in tpustrat.unstack_steps(out)],
      [2 * batches[6].reshape(n, 4).sum(0), 2 * batches[7].reshape(n, 4).sum(0)])

  # A scan over run jitted by the user: its outputs come back with whatever spec XLA gives them, and
  # the shapes alone tell stacked steps apart on one replica.
  it = iter(small.experimental_distribute_dataset(batches))
  scanned = jax.jit(lambda b: jax.lax.scan(lambda c, x: (c, small.run(lambda v: tpustrat.per_example(v * 2), args=(x,))), 0.0, b)[1])
  out = scanned(it.take_steps(3))
  assert repr(out) == f"PerReplica(steps=3, num_replicas={n}, component=float32[4], padded)"
  with pytest.raises(ValueError, match="holds 3 stacked steps"):
    small.reduce("SUM", out, axis=None)


def test_run_steps_checks_stacked_batches_once_per_signature(strategy, monkeypatch):
  """Batches already stacked: the checks that depend only on the signature of `init` and the batches
  (their structure, shapes, dtypes, shardings) run at the first call, not again for the same signature;
  a wrong `steps` is still an error at every call, and the results are numpy's."""
  from tpustrat._src import multistep
  calls = []
  check = multistep._check_call
  monkeypatch.setattr(multistep, "_check_call", lambda *a: calls.append(1) or check(*a))
  k = 3
  xs = np.arange(1, k * N + 1, dtype=np.float32).reshape(k, N) / 10
  batches = tpustrat.stack_steps([
      strategy.experimental_distribute_values_from_function(lambda ctx, a=a: a[ctx.replica_id_in_sync_group])
      for a in xs])

  def step(w, x):
    return w + tpustrat.get_replica_context().all_reduce("sum", x * w), x * w

  w, _ = strategy.experimental_run_steps(step, batches, init=np.float32(1.0))  # a host init: checked
  w, _ = strategy.experimental_run_steps(step, batches, init=w)  # the signature of the loop: checked once
  assert len(calls) == 2
  w, _ = strategy.experimental_run_steps(step, batches, init=w)
  w, _ = strategy.experimental_run_steps(step, batches, init=w)
  assert len(calls) == 2
  with pytest.raises(ValueError, match="`steps` is 2 but the stacked batches hold 3 steps"):
    strategy.experimental_run_steps(step, batches, steps=2, init=w)
  expected = 1.0
  for _ in range(4):
    for i in range(k):
      expected = expected + (xs[i].astype(np.float64) * expected).sum()
  assert_close(np.asarray(strategy.experimental_local_results(w)[0]), expected, rtol=1e-5)


@pytest.mark.parametrize("num_replicas", [1, 8])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("donate", [False, True])
def test_run_steps_fast_path_names_outputs_and_equals_numpy(num_replicas, k, donate, monkeypatch):
  """A call like an earlier one on batches already stacked takes the fast path (no `run_steps` at all); on
  one device its outputs come back named as `run` names them with no renaming after the call (a
  per-replica carry on 'replica', a per-replica output on the axis after the steps, replicated values on
  none, even for the [1, 1] shapes of one step on one replica); the numbers are numpy's, donated or not."""
  from tpustrat._src import multistep
  small = tpustrat.MirroredStrategy(devices=jax.devices()[:num_replicas])
  n = num_replicas
  slow = []
  run_steps = multistep.run_steps
  monkeypatch.setattr(multistep, "run_steps", lambda *a: slow.append(1) or run_steps(*a))
  renamed = []
  name = multistep.name_replica_axis
  monkeypatch.setattr(multistep, "name_replica_axis", lambda t, steps: renamed.append(1) or name(t, steps))
  rng = np.random.default_rng(k + n)
  xs = rng.normal(size=(4, k, n)).astype(np.float32)  # 4 calls of k steps, one scalar per replica

  def step(carry, x):
    w, acc = carry
    ctx = tpustrat.get_replica_context()
    w = w - 0.1 * ctx.all_reduce("mean", x * w)
    return (w, acc + x), (x * w, ctx.all_reduce("sum", x))

  options = tpustrat.RunOptions(donate_argnums=(0,)) if donate else None
  carry = small.experimental_mirror((np.float32(1.0), tpustrat.PerReplica([np.float32(0.0)] * n)))
  w_np, acc_np = 1.0, np.zeros(n)
  for call in range(4):
    batches = tpustrat.stack_steps([tpustrat.PerReplica(list(xs[call, i])) for i in range(k)])
    carry, (per_replica, total) = small.experimental_run_steps(step, batches, init=carry, options=options)
    expected_pr = []
    for i in range(k):
      w_np = w_np - 0.1 * (xs[call, i].astype(np.float64) * w_np).mean()
      expected_pr.append(xs[call, i] * w_np)
      acc_np = acc_np + xs[call, i]
    w, acc = carry
    assert w.tree.sharding.spec == P() and acc.tree.sharding.spec == P("replica")
    assert per_replica.tree.sharding.spec == P(None, "replica") and total.tree.sharding.spec == P()
    assert repr(per_replica) == f"PerReplica(steps={k}, num_replicas={n}, component=float32[])"
    assert_close(np.asarray(w.tree), w_np, rtol=1e-5)
    assert_close(np.asarray(acc.tree), acc_np, rtol=1e-5)
    assert_close(np.asarray(per_replica.tree), np.stack(expected_pr), rtol=1e-5)
    assert_close(np.asarray(total.tree), xs[call].sum(axis=1), rtol=1e-5)
  assert len(slow) == 1  # the first call only: the others take the fast path
  if n == 1:
    assert len(renamed) == 2  # the first call's two (names already right); none after
  # A call that differs (another number of steps) takes the checked path again, and is right.
  more = tpustrat.stack_steps([tpustrat.PerReplica(list(xs[0, 0]))] * (k + 1))
  carry, _ = small.experimental_run_steps(step, more, init=carry, options=options)
  assert len(slow) == 2
  for _ in range(k + 1):
    w_np = w_np - 0.1 * (xs[0, 0].astype(np.float64) * w_np).mean()
  assert_close(np.asarray(carry[0].tree), w_np, rtol=1e-5)


def test_run_steps_fast_path_keeps_alternating_signatures(strategy, monkeypatch):
  """Groups of 3 steps and a last group of 1, pass after pass (a loop's epochs): each shape is checked once,
  then both take the fast path; the numbers are numpy's."""
  from tpustrat._src import multistep
  slow = []
  run_steps = multistep.run_steps
  monkeypatch.setattr(multistep, "run_steps", lambda *a: slow.append(1) or run_steps(*a))
  rng = np.random.default_rng(5)
  xs = rng.normal(size=(7, N)).astype(np.float32)  # one pass: steps 0-2, 3-5, then 6 alone

  def step(w, x):
    w = w + tpustrat.get_replica_context().all_reduce("sum", x * w) / 100
    return w, x * w

  w = strategy.experimental_mirror(np.float32(1.0))
  expected = 1.0
  for _ in range(3):
    for lo, hi in ((0, 3), (3, 6), (6, 7)):
      batches = tpustrat.stack_steps([tpustrat.PerReplica(list(x)) for x in xs[lo:hi]])
      w, _ = strategy.experimental_run_steps(step, batches, init=w)
      for x in xs[lo:hi]:
        expected = expected + (x.astype(np.float64) * expected).sum() / 100
  assert len(slow) == 2  # the first call of each shape
  assert_close(np.asarray(w.tree), expected, rtol=1e-5)


def test_stacked_batches_whose_counts_a_map_made_floats_are_refused_by_run_steps(strategy):
  """`jax.tree.map` over stacked padded batches maps their real-row counts too: `experimental_run_steps`
  refuses float counts before tracing, naming the stacked batches; the batches as taken run and give
  numpy's sums over the real rows."""
  x = np.arange(13 * 2, dtype=np.float32).reshape(13, 2)
  stacked = iter(strategy.experimental_distribute_dataset([x[:8], x[8:]])).take_steps(2)

  def step(total, v):
    mine = jnp.where(tpustrat.valid_mask(v)[:, None], v, 0.0).sum(axis=0)
    return total + tpustrat.get_replica_context().all_reduce("sum", mine), jnp.zeros(())

  with pytest.raises(ValueError, match=r"experimental_run_steps: the stacked batches: .*real-row counts .*float32"):
    strategy.experimental_run_steps(step, jax.tree.map(lambda a: a / 255.0, stacked), init=jnp.zeros(2))
  total, _ = strategy.experimental_run_steps(step, stacked, init=jnp.zeros(2))
  np.testing.assert_allclose(np.asarray(strategy.experimental_local_results(total)[0]), x.sum(axis=0), rtol=1e-6)
