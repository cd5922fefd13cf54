"""Single-device equivalence, as properties: what tpustrat computes over n replicas is what one device computes.

Hypothesis draws the replica count (1, 2, 4, 8), global batch sizes (a first batch of 1..3n rows, which fixes
the per-replica size k = ceil(B / n), then partial ones, some smaller than n), pytrees of float32 / bfloat16 /
int32 arrays, reduce ops, group assignments and the path the step takes (`run`, `experimental_run_steps`,
`run` inside an outer `jax.jit` or a `lax.scan`). Each result is compared with the same computation done in
numpy (float64) on the whole, unsplit batch:

* float32: ``rtol = 1e-5`` and ``atol = 1e-5 * sum |operands|`` (elementwise), which holds for any order in
  which the backend adds (up to ~160 terms);
* bfloat16: ``rtol = (terms + 1) * eps / 2`` (eps = 2**-7, bfloat16 keeps ~3 significant digits), scaled the
  same way: the worst case of ``terms`` rounded additions and one final rounding;
* integers: exact.

The rules of the padding semantics (README, "Input"; tests/test_padding_semantics.py) decide what the numpy
value is: ``reduce(op, v, axis=0)`` / ``gather(v, axis=0)`` of a step output whose axis 0 is the batch's, and
every reduction of a `tpustrat.per_example` output, skip the padding rows; ``reduce(op, v, axis=None)`` of an
unmarked output sums every replica's component, padding rows included (padding rows of the input are zeros,
so ``f(0)`` is what a replica computes there).

Compilation dominates the time: every program is cached per (strategy, step function, argument signature),
so the step functions live at module level, one strategy per replica count is kept for the whole module,
and the shapes are drawn from a small set (trailing shapes (5,) and (4, 3); k in 1..3) while the data vary.
Every test is derandomized (``derandomize=True``, no example database, and no constants taken from whichever
project modules happen to be loaded: see `examples_independent_of_loaded_modules`), so CI sees the same
examples on every run, alone or in `make test`; explicit `@example`s pin the cases named in the README.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import tpustrat
from tpustrat import Mirrored, PerReplica, ReduceOp

REPLICAS = (1, 2, 4, 8)
F32, BF16, I32 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.int32)
DTYPES = (F32, BF16, I32)
F32_RTOL = 1e-5
BF16_HALF_EPS = 2.0 ** -8  # half of bfloat16's machine epsilon (2**-7): the largest relative error of one rounding

# No `explain` phase: it re-runs many variations of a failing example, each compiling new programs.
PHASES = (Phase.explicit, Phase.generate, Phase.shrink)


def _settings(max_examples: int):
  return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None, phases=PHASES,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                         HealthCheck.data_too_large])


@pytest.fixture(autouse=True, scope="module")
def examples_independent_of_loaded_modules():
  """Makes the derandomized examples depend on this file and Hypothesis only.

  Hypothesis (6.131 and later) sometimes draws a constant found in the source of the project's modules
  that are loaded at the time (here tpustrat, and examples/ or benchmarks/ when other tests have imported
  them), so the same test would draw other examples when run alone than in `make test`, or after an
  unrelated edit to the library. That pool is emptied for this module (Hypothesis's global constants stay).
  """
  try:
    from hypothesis.internal.conjecture import providers
    cache, empty = providers.CONSTANTS_CACHE.cache, providers.Constants
  except (ImportError, AttributeError):
    providers = None
  if providers is None or not hasattr(providers, "_get_local_constants"):  # another Hypothesis: nothing to pin
    yield
    return
  cache.clear()  # (choice type, constraints) -> constants allowed, computed with the current pool
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(providers, "_get_local_constants", empty)
    yield
  cache.clear()


# -- one strategy per replica count, for the whole module (its compiled programs are reused) --------------

_STRATEGIES: dict[int, tpustrat.TPUStrategy] = {}


def strategy_for(n: int) -> tpustrat.TPUStrategy:
  if n not in _STRATEGIES:
    _STRATEGIES[n] = tpustrat.TPUStrategy(device_assignment=jax.devices()[:n])
  return _STRATEGIES[n]


# -- comparing with numpy ----------------------------------------------------------------------------------


def assert_equivalent(actual, expected, dtype, *, scale=None, terms: int = 1, what: str = "") -> None:
  """`actual` (tpustrat) against `expected` (numpy, float64 or exact integers) for a computation in `dtype`.

  `scale` is the sum of |operands| that went into each element (default |expected|: an elementwise result);
  `terms` how many values were added into one element (bfloat16's tolerance grows with it).
  """
  dtype = np.dtype(dtype)
  got = np.asarray(actual)
  if dtype.kind in "iu":
    assert got.dtype == dtype, (what, got.dtype)
    np.testing.assert_array_equal(got, np.asarray(expected), err_msg=f"{what} (integers: exact)")
    return
  got = got.astype(np.float64)
  expected = np.asarray(expected, np.float64)
  assert got.shape == expected.shape, (what, got.shape, expected.shape)
  rtol = F32_RTOL if dtype != BF16 else (terms + 1) * BF16_HALF_EPS
  scale = np.abs(expected) if scale is None else np.broadcast_to(np.abs(np.asarray(scale, np.float64)), got.shape)
  atol = rtol * np.where(np.isnan(scale), 0.0, scale)
  both_nan = np.isnan(got) & np.isnan(expected)
  ok = both_nan | (np.abs(got - expected) <= atol + rtol * np.abs(expected))
  if not ok.all():
    bad = np.argwhere(~ok)[:5]
    details = "; ".join(f"at {tuple(int(j) for j in idx)}: got {got[tuple(idx)]!r}, expected "
                        f"{expected[tuple(idx)]!r}, allowed {atol[tuple(idx)] + rtol * abs(expected[tuple(idx)]):.3g}"
                        for idx in bad)
    raise AssertionError(f"{what} ({dtype.name}, rtol={rtol:.3g}, atol=rtol*sum|operands|): "
                         f"{int((~ok).sum())} of {ok.size} elements differ: {details}\n"
                         f"got\n{got}\nexpected\n{expected}")


def assert_int_mean(actual, total, count, what: str = "") -> None:
  """MEAN of int32 values: a float32 quotient of exact integers, within an ulp or two (XLA may divide by a
  constant count as a multiplication by its rounded reciprocal)."""
  with np.errstate(invalid="ignore", divide="ignore"):
    expected = np.float64(total) / np.float64(count)
  got = np.asarray(actual)
  assert got.dtype.kind == "f", (what, got.dtype)
  np.testing.assert_allclose(got.astype(np.float64), expected, rtol=2.0 ** -22, atol=0, equal_nan=True,
                             err_msg=f"{what} (MEAN of int32)")


def random_leaf(rng: np.random.Generator, rows: int, tail: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """Data that exercise each dtype: float32 over six orders of magnitude (sums cancel), bfloat16 of order 1,
  int32 in [-1000, 1000)."""
  shape = (rows,) + tail
  if dtype == I32:
    return rng.integers(-1000, 1000, size=shape).astype(np.int32)
  if dtype == BF16:
    return (rng.normal(size=shape) * 4.0).astype(jnp.bfloat16)
  return (rng.normal(size=shape) * 10.0 ** rng.integers(-3, 4, size=shape)).astype(np.float32)


# The elementwise maps a step applies: nonzero at 0, so a padding row changes every sum that counts it.
def f_map(a):
  return a * 3 - 7 if jnp.issubdtype(a.dtype, jnp.integer) else a * 2 + 5


def g_map(a):
  return a * 3 + 2 if jnp.issubdtype(a.dtype, jnp.integer) else a * 2 - 3


def f_ref(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
  return a * 3 - 7 if dtype == I32 else a * 2 + 5


def g_ref(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
  return a * 3 + 2 if dtype == I32 else a * 2 - 3


def exact(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """`a` in a type numpy computes exactly in: int64 for integers, float64 otherwise."""
  return a.astype(np.int64) if dtype == I32 else a.astype(np.float64)


# -- pytrees of batches ------------------------------------------------------------------------------------

# name -> (structure with leaf positions, trailing shape of each leaf). Leading size 5 or 4: never a k (<= 3),
# so axis 0 of a per-replica statistic is never mistaken for the batch's.
STRUCTURES = {
    "array": (0, [(5,)]),
    "dict": ({"a": 0, "b": 1}, [(5,), (5,)]),
    "tuple": ((0, {"c": 1}, 2), [(5,), (4, 3), (5,)]),
    "nested": ({"p": (0,), "q": {"r": 1}}, [(4, 3), (5,)]),
}


def build(structure: str, leaves: list) -> object:
  template, _ = STRUCTURES[structure]
  return jax.tree.map(lambda i: leaves[i], template)


@st.composite
def batch_plans(draw, later: tuple[int, int] = (1, 2)):
  """(n, [B0, B1, ...]): B0 in 1..3n fixes k = ceil(B0 / n); later batches have 1..B0 rows (mostly partial)."""
  n = draw(st.sampled_from(REPLICAS))
  k = draw(st.integers(1, 3))
  b0 = draw(st.integers((k - 1) * n + 1, k * n))
  later = draw(st.lists(st.integers(1, b0), min_size=later[0], max_size=later[1]))
  return n, [b0, *later]


@st.composite
def trees(draw):
  structure = draw(st.sampled_from(sorted(STRUCTURES)))
  count = len(STRUCTURES[structure][1])
  dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=count, max_size=count))
  return structure, dtypes


class Plan:
  """The global batches of one example, their padded per-replica layout, and numpy views of both."""

  def __init__(self, n: int, sizes: list[int], structure: str, dtypes: list[np.dtype], seed: int):
    rng = np.random.default_rng(seed)
    self.n, self.sizes, self.structure, self.dtypes = n, sizes, structure, dtypes
    self.tails = STRUCTURES[structure][1]
    self.k = math.ceil(sizes[0] / n)
    self.leaves = [[random_leaf(rng, b, tail, dt) for tail, dt in zip(self.tails, dtypes)] for b in sizes]
    self.batches = [build(structure, leaves) for leaves in self.leaves]

  def counts(self, t: int) -> np.ndarray:
    """Real rows of each replica in batch t: replica r holds rows [r*k, (r+1)*k) of the global batch."""
    return np.clip(self.sizes[t] - self.k * np.arange(self.n), 0, self.k)

  def real(self, t: int, i: int) -> np.ndarray:
    return exact(self.leaves[t][i], self.dtypes[i])

  def padded(self, t: int, i: int) -> np.ndarray:
    """Leaf i of batch t as the replicas hold it: [n, k, ...], past the real rows copies of the first
    (`InputOptions.experimental_padding`'s default)."""
    x = self.real(t, i)
    out = np.zeros((self.n * self.k,) + x.shape[1:], x.dtype)
    out[:len(x)] = x
    out[len(x):] = x[0]
    return out.reshape((self.n, self.k) + x.shape[1:])

  def mask(self, t: int, ndim: int) -> np.ndarray:
    m = np.arange(self.k)[None, :] < self.counts(t)[:, None]
    return m.reshape(m.shape + (1,) * (ndim - 2))

  def distribute(self):
    return strategy_for(self.n).experimental_distribute_dataset(self.batches)


def distributed_leaves(tree) -> list:
  return jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))


def row_mask(a):
  m = tpustrat.valid_mask(a)
  return m.reshape(m.shape + (1,) * (a.ndim - 1))


def masked_column_sums(batch):
  return jax.tree.map(lambda a: jnp.sum(jnp.where(row_mask(a), a, jnp.zeros((), a.dtype)), axis=0), batch)


# -- property 1: strategy.run, reduce and gather along both axes, Mirrored and PerReplica outputs ----------


def p1_step(batch):
  ctx = tpustrat.get_replica_context()
  y = jax.tree.map(f_map, batch)  # unmarked: only axis=0 reductions skip its padding rows
  marked = tpustrat.per_example(jax.tree.map(g_map, batch))  # skipped everywhere
  stat = jax.tree.map(lambda a: jnp.sum(a, axis=0), y)  # a per-replica statistic, padding rows included
  local = masked_column_sums(batch)
  nv = tpustrat.num_valid_examples(jax.tree.leaves(batch)[0])
  return {"y": y, "m": marked, "stat": stat, "sum": ctx.all_reduce(ReduceOp.SUM, local),
          "mean": ctx.all_reduce(ReduceOp.MEAN, local), "nv": nv, "rows": ctx.all_reduce("sum", nv)}


def check_reduction(name, total, count, scale, terms, *, results, i, op, dtype, where) -> None:
  """results[name][i], a SUM or MEAN, against numpy's `total` (/ `count` for MEAN) of operands summing to `scale`."""
  if op is ReduceOp.MEAN and dtype == I32:
    assert_int_mean(results[name][i], total, count, f"{where}: {name}")
    return
  with np.errstate(invalid="ignore", divide="ignore"):
    expected = total if op is ReduceOp.SUM else total / count
    scale = scale if op is ReduceOp.SUM else scale / count
  assert_equivalent(results[name][i], expected, dtype, scale=scale, terms=terms, what=f"{where}: {name}")


def check_p1_batch(plan: Plan, t: int, out, op: ReduceOp) -> None:
  strategy = strategy_for(plan.n)
  n, k, b = plan.n, plan.k, plan.sizes[t]
  counts = plan.counts(t)
  where = f"n={n} k={k} batch {t} of {plan.sizes} ({b} rows), {op.name}"
  sum_op = op is ReduceOp.SUM
  # Which rows are real, and how many there are in all.
  assert isinstance(out["nv"], PerReplica) and isinstance(out["rows"], Mirrored), where
  np.testing.assert_array_equal([int(c) for c in strategy.experimental_local_results(out["nv"])], counts, where)
  assert int(out["rows"].values[0]) == b, where

  leaves = {name: distributed_leaves(out[name]) for name in ("y", "m", "stat", "sum", "mean")}
  results = {
      "gather y": jax.tree.leaves(strategy.gather(out["y"], axis=0)),
      "y axis 0": jax.tree.leaves(strategy.reduce(op, out["y"], axis=0)),
      "y axis None": jax.tree.leaves(strategy.reduce(op, out["y"], axis=None)),
      "gather m": jax.tree.leaves(strategy.gather(out["m"], axis=0)),
      "m axis 0": jax.tree.leaves(strategy.reduce(op, out["m"], axis=0)),
      "m axis None": jax.tree.leaves(strategy.reduce(op, out["m"], axis=None)),
      "stat axis None": jax.tree.leaves(strategy.reduce(op, out["stat"], axis=None)),
      "stat axis 0": jax.tree.leaves(strategy.reduce(op, out["stat"], axis=0)),
      "gather stat": jax.tree.leaves(strategy.gather(out["stat"], axis=0)),
      "sum axis None": jax.tree.leaves(strategy.reduce(op, out["sum"], axis=None)),
  }
  for i, dt in enumerate(plan.dtypes):
    w = f"{where}, leaf {i} {dt.name}{list(plan.tails[i])}"
    assert all(isinstance(v, PerReplica) for v in (leaves["y"][i], leaves["m"][i], leaves["stat"][i])), w
    assert isinstance(leaves["sum"][i], Mirrored) and isinstance(leaves["mean"][i], Mirrored), w
    real, padded = plan.real(t, i), plan.padded(t, i)
    mask = plan.mask(t, padded.ndim)
    fy, gm = f_ref(real, dt), g_ref(real, dt)
    fy_pad, gm_pad = f_ref(padded, dt), g_ref(padded, dt)
    exp_dtype = dt if sum_op or dt != I32 else np.dtype(np.float32)
    for name in results:
      if not name.startswith("gather"):
        assert np.dtype(results[name][i].dtype) == exp_dtype, (w, name, results[name][i].dtype)
    reduced = functools.partial(check_reduction, results=results, i=i, op=op, dtype=dt, where=w)

    # gather along the batch axis: the b real rows, in order, for the unmarked and the marked output.
    assert_equivalent(results["gather y"][i], fy, dt, what=f"{w}: gather(y, axis=0)")
    assert_equivalent(results["gather m"][i], gm, dt, what=f"{w}: gather(per_example, axis=0)")
    # axis=0: the real rows only, MEAN over b.
    reduced("y axis 0", fy.sum(0), b, np.abs(fy).sum(0), b)
    reduced("m axis 0", gm.sum(0), b, np.abs(gm).sum(0), b)
    # axis=None, unmarked: every replica's component whole, padding rows (f(0)) included, MEAN over n.
    reduced("y axis None", fy_pad.sum(0), n, np.abs(fy_pad).sum(0), n)
    # axis=None, marked: the padding rows of each replica left out; MEAN divides each element by the number
    # of replicas that have a real row there (NaN where none has).
    per_row = mask.sum(0) * np.ones(padded.shape[1:])
    reduced("m axis None", np.where(mask, gm_pad, 0).sum(0), per_row, np.abs(np.where(mask, gm_pad, 0)).sum(0), n)
    # A statistic over every row a replica holds (f(0) for padding), reduced across replicas and its axis 0
    # (of size 5 or 4, not k: nothing is skipped).
    stat_terms = n * k
    reduced("stat axis None", fy_pad.sum((0, 1)), n, np.abs(fy_pad).sum((0, 1)), stat_terms)
    reduced("stat axis 0", fy_pad.sum((0, 1, 2)), n * padded.shape[2], np.abs(fy_pad).sum((0, 1, 2)),
            stat_terms * padded.shape[2])
    stats = fy_pad.sum(1)  # [n, *tail]: what each replica returned, concatenated whole along axis 0
    assert_equivalent(results["gather stat"][i], stats.reshape((-1,) + stats.shape[2:]), dt,
                      scale=np.abs(fy_pad).sum(1).reshape((-1,) + stats.shape[2:]), terms=k,
                      what=f"{w}: gather(stat, axis=0)")
    # Mirrored: all_reduce of the masked column sums is the sum over the whole batch, on every replica;
    # reduce counts a Mirrored value once per replica.
    total, scale = real.sum(0), np.abs(real).sum(0)
    assert_equivalent(leaves["sum"][i].values[0], total, dt, scale=scale, terms=b, what=f"{w}: all_reduce SUM")
    if dt != I32:
      assert_equivalent(leaves["mean"][i].values[0], total / n, dt, scale=scale / n, terms=b + 1,
                        what=f"{w}: all_reduce MEAN")
    else:
      assert_int_mean(leaves["mean"][i].values[0], total, n, f"{w}: all_reduce MEAN")
    reduced("sum axis None", n * total, n, n * scale, b + n)


# p1_step returns a per-replica statistic with the padding rows included on purpose ("stat"), which
# PaddingReadWarning rightly names (tests/test_losses.py tests the warning itself).
@pytest.mark.filterwarnings("ignore::tpustrat.PaddingReadWarning")
@_settings(max_examples=14)
@given(plan=batch_plans(), tree=trees(), op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN]),
       seed=st.integers(0, 2 ** 32 - 1))
# README's case: 12 rows on 8 replicas (k = 2, replicas 6-7 padding only), then 5 rows (fewer than replicas).
@example(plan=(8, [12, 5]), tree=("tuple", [F32, I32, BF16]), op=ReduceOp.MEAN, seed=1)
@example(plan=(8, [3, 1]), tree=("dict", [I32, F32]), op=ReduceOp.SUM, seed=2)  # k = 1
# 2 rows with k = 3: row 2 is real on no replica (MEAN of the per_example output there is 0/0).
@example(plan=(2, [5, 2]), tree=("nested", [BF16, F32]), op=ReduceOp.MEAN, seed=3)
def test_run_reduce_and_gather_match_numpy(plan, tree, op, seed):
  p = Plan(*plan, *tree, seed)
  strategy = strategy_for(p.n)
  for t, batch in enumerate(p.distribute()):
    check_p1_batch(p, t, strategy.run(p1_step, args=(batch,)), op)


# -- property 2: the same step under experimental_run_steps, an outer jax.jit and lax.scan ------------------


def p2_step(carry, batch):
  """A running total of the real rows (Mirrored carry) and per step: the marked map and this batch's total."""
  total = tpustrat.get_replica_context().all_reduce(ReduceOp.SUM, masked_column_sums(batch))
  new = jax.tree.map(jnp.add, carry, total)
  return new, (tpustrat.per_example(jax.tree.map(g_map, batch)), total)


@functools.cache
def jitted_run(n: int):
  strategy = strategy_for(n)
  return jax.jit(lambda carry, batch: strategy.run(p2_step, args=(carry, batch)))


@functools.cache
def jitted_scan(n: int):
  strategy = strategy_for(n)

  def body(carry, batch):
    return strategy.run(p2_step, args=(carry, batch))

  return jax.jit(lambda carry, batches: jax.lax.scan(body, carry, batches))


def run_p2(p: Plan, path: str, chunk: int):
  """(final carry, [(marked, total) per step]) of p2_step over every batch of `p`: "jit" calls `run` inside
  an outer `jax.jit` once per batch, "scan" inside a jitted `lax.scan` over all of them (`take_steps`),
  "run_steps" is `experimental_run_steps`, `chunk` steps per call (the last call may take fewer)."""
  strategy = strategy_for(p.n)
  init = build(p.structure, [np.zeros(tail, dt) for tail, dt in zip(p.tails, p.dtypes)])
  it = iter(p.distribute())
  if path == "jit":
    carry, outs = strategy.experimental_mirror(init), []
    for batch in it:
      carry, out = jitted_run(p.n)(carry, batch)
      outs.append(jax.block_until_ready(out))  # a hand-written jit loop is not bounded by tpustrat (README)
    return carry, outs
  if path == "scan":
    carry, stacked = jitted_scan(p.n)(strategy.experimental_mirror(init), it.take_steps(len(p.sizes)))
    return carry, list(tpustrat.unstack_steps(stacked))
  carry, outs = init, []
  while True:
    try:
      carry, stacked = strategy.experimental_run_steps(p2_step, it, steps=chunk, init=carry)
    except StopIteration:
      return carry, outs
    outs.extend(tpustrat.unstack_steps(stacked))


@_settings(max_examples=12)
@given(plan=batch_plans(), tree=trees(), path=st.sampled_from(["run_steps", "jit", "scan"]), chunk=st.integers(1, 3),
       seed=st.integers(0, 2 ** 32 - 1))
@example(plan=(8, [16, 13, 3]), tree=("tuple", [BF16, I32, F32]), path="scan", chunk=1, seed=4)
@example(plan=(8, [16, 13, 3]), tree=("dict", [F32, I32]), path="run_steps", chunk=2, seed=5)  # 2 steps, then 1
def test_run_steps_jit_and_scan_match_numpy(plan, tree, path, chunk, seed):
  p = Plan(*plan, *tree, seed)
  strategy = strategy_for(p.n)
  carry, outs = run_p2(p, path, chunk)
  assert len(outs) == len(p.sizes)
  running = [0] * len(p.dtypes)
  running_scale = [0] * len(p.dtypes)
  for t, (marked, total) in enumerate(outs):
    where = f"{path}: n={p.n} k={p.k} batch {t} of {p.sizes}"
    gathered = jax.tree.leaves(strategy.gather(marked, axis=0))
    summed = jax.tree.leaves(strategy.reduce(ReduceOp.SUM, marked, axis=None))
    totals = distributed_leaves(total)
    for i, dt in enumerate(p.dtypes):
      w = f"{where}, leaf {i} {dt.name}"
      real, padded = p.real(t, i), p.padded(t, i)
      gm_pad = np.where(p.mask(t, padded.ndim), g_ref(padded, dt), 0)
      assert_equivalent(gathered[i], g_ref(real, dt), dt, what=f"{w}: gather(per_example, axis=0)")
      assert_equivalent(summed[i], gm_pad.sum(0), dt, scale=np.abs(gm_pad).sum(0), terms=p.n,
                        what=f"{w}: reduce(SUM, per_example, axis=None)")
      assert isinstance(totals[i], Mirrored), w
      assert_equivalent(totals[i].values[0], real.sum(0), dt, scale=np.abs(real).sum(0), terms=p.sizes[t],
                        what=f"{w}: all_reduce SUM")
      running[i] = running[i] + real.sum(0)
      running_scale[i] = running_scale[i] + np.abs(real).sum(0)
  for i, (dt, leaf) in enumerate(zip(p.dtypes, distributed_leaves(carry))):
    assert isinstance(leaf, Mirrored), (path, i)
    assert_equivalent(leaf.values[0], running[i], dt, scale=running_scale[i], terms=sum(p.sizes) + len(p.sizes),
                      what=f"{path}: n={p.n} sizes {p.sizes}: carry leaf {i} {dt.name}")


# -- property 3: grouped cross_replica_sum (and grouped all_reduce MEAN) ------------------------------------


@st.composite
def group_assignments(draw):
  """(n, groups): a random permutation of the replica ids cut into equal groups (8 replicas and groups of 2
  first: what Hypothesis draws first and shrinks towards)."""
  n = draw(st.sampled_from((8, 4, 2, 1)))
  size = draw(st.sampled_from([d for d in (2, 4, 8, 1) if n % d == 0]))
  perm = draw(st.permutations(range(n)))
  return n, [list(perm[i:i + size]) for i in range(0, n, size)]


@functools.cache
def crs_step(groups: tuple[tuple[int, ...], ...], as_array: bool):
  assignment = np.array(groups, np.int32) if as_array else [list(g) for g in groups]

  def step(x):
    ctx = tpustrat.get_replica_context()
    out = {"sum": tpustrat.ops.cross_replica_sum(x, assignment)}
    if jnp.issubdtype(x.dtype, jnp.floating):
      out["mean"] = ctx.all_reduce(ReduceOp.MEAN, x, group_assignment=assignment)
    return out

  return step


def per_replica_array(strategy, value, shape: tuple[int, ...]) -> np.ndarray:
  """[n, *shape] numpy: the components of a PerReplica (gathered on the devices), or n copies of a Mirrored."""
  n = strategy.num_replicas_in_sync
  if isinstance(value, Mirrored):
    return np.stack([np.asarray(value.values[0])] * n)
  return np.asarray(strategy.gather(value, axis=0)).reshape((n,) + shape)


@_settings(max_examples=30)
@given(assignment=group_assignments(), dtype=st.sampled_from(DTYPES), as_array=st.booleans(),
       seed=st.integers(0, 2 ** 32 - 1))
@example(assignment=(8, [[0, 2, 4, 6], [1, 3, 5, 7]]), dtype=BF16, as_array=False, seed=6)  # README's groups
@example(assignment=(8, [[5, 1], [0, 7], [2, 3], [6, 4]]), dtype=I32, as_array=True, seed=7)
@example(assignment=(8, [[7, 6, 5, 4, 3, 2, 1, 0]]), dtype=F32, as_array=False, seed=8)  # one group: Mirrored
def test_grouped_cross_replica_sum_matches_numpy(assignment, dtype, as_array, seed):
  n, groups = assignment
  strategy = strategy_for(n)
  rng = np.random.default_rng(seed)
  xs = random_leaf(rng, n, (2, 3), dtype)  # one (2, 3) component per replica
  out = strategy.run(crs_step(tuple(map(tuple, groups)), as_array), args=(PerReplica(list(xs)),))
  where = f"n={n} groups={groups} {dtype.name}"
  one_group = len(groups) == 1
  assert isinstance(out["sum"], Mirrored if one_group else PerReplica), (where, out["sum"])
  exact_xs = exact(xs, dtype)
  expected = np.zeros_like(exact_xs)
  scale = np.zeros(xs.shape, np.float64)
  for group in groups:
    expected[group] = exact_xs[group].sum(0)
    scale[group] = np.abs(exact_xs[group]).sum(0)
  size = len(groups[0])
  assert_equivalent(per_replica_array(strategy, out["sum"], xs.shape[1:]), expected, dtype, scale=scale, terms=size,
                    what=f"{where}: cross_replica_sum")
  if "mean" in out:
    assert isinstance(out["mean"], Mirrored if one_group else PerReplica), (where, out["mean"])
    assert_equivalent(per_replica_array(strategy, out["mean"], xs.shape[1:]), expected / size, dtype, scale=scale / size,
                      terms=size + 1, what=f"{where}: all_reduce(MEAN, group_assignment)")


# -- property 4: all_to_all ---------------------------------------------------------------------------------


@functools.cache
def a2a_step(groups, split_dimension: int, concat_dimension: int, none_for_all: bool):
  assignment = None if none_for_all else [list(g) for g in groups]
  count = len(groups[0])

  def step(x):
    return tpustrat.ops.all_to_all(x, assignment, concat_dimension=concat_dimension,
                                   split_dimension=split_dimension, split_count=count)

  return step


@_settings(max_examples=24)
@given(assignment=group_assignments(), dtype=st.sampled_from(DTYPES), split=st.sampled_from([0, 1, -1]),
       concat=st.sampled_from([0, 1, -2]), use_none=st.booleans(), seed=st.integers(0, 2 ** 32 - 1))
@example(assignment=(8, [list(range(8))]), dtype=F32, split=1, concat=0, use_none=True, seed=9)
@example(assignment=(8, [[6, 1, 3, 0], [2, 7, 5, 4]]), dtype=I32, split=0, concat=1, use_none=False, seed=10)
def test_all_to_all_matches_numpy(assignment, dtype, split, concat, use_none, seed):
  n, groups = assignment
  size = len(groups[0])
  none_for_all = use_none and size == n and groups[0] == sorted(groups[0])  # None: one group, replica order
  strategy = strategy_for(n)
  rng = np.random.default_rng(seed)
  shape = (2 * size, 3) if split % 2 == 0 else (2, 3 * size)
  xs = random_leaf(rng, n, shape, dtype)
  out = strategy.run(a2a_step(tuple(map(tuple, groups)), split, concat, none_for_all), args=(PerReplica(list(xs)),))
  assert isinstance(out, PerReplica), out
  expected = [None] * n
  for group in groups:
    for position, r in enumerate(group):
      # replica r gets block `position` of every member's input, in group order.
      expected[r] = np.concatenate([np.split(xs[q], size, axis=split)[position] for q in group], axis=concat)
  got = per_replica_array(strategy, out, expected[0].shape)
  np.testing.assert_array_equal(got, np.stack(expected),
                                err_msg=f"n={n} groups={groups} split={split} concat={concat} {dtype.name}")


# -- property 5: a data-parallel SGD loop equals the single-device loop -------------------------------------

LR = 0.05
STEPS = 20
D_IN, D_HIDDEN, D_OUT = 4, 3, 2


def model(params, x):
  if "w2" in params:
    return jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]
  return x @ params["w"] + params["b"]


def sgd_step(params, batch):
  """One SGD step on the mean squared error over the global batch: padding masked, gradients used as they
  come (already summed over replicas: Mirrored params)."""
  ctx = tpustrat.get_replica_context()
  x, y = batch["x"], batch["y"]
  mask = tpustrat.valid_mask(x)
  rows = ctx.all_reduce(ReduceOp.SUM, tpustrat.num_valid_examples(x)).astype(jnp.float32)

  def loss_fn(p):
    per_example = 0.5 * jnp.sum((model(p, x) - y) ** 2, axis=1)
    return jnp.sum(jnp.where(mask, per_example, 0.0)) / rows

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return jax.tree.map(lambda p, g: p - LR * g, params, grads), ctx.all_reduce(ReduceOp.SUM, loss)


def init_params(rng: np.random.Generator, kind: str) -> dict:
  def w(*shape):
    return (rng.normal(size=shape) * 0.5).astype(np.float32)

  if kind == "mlp":
    return {"w1": w(D_IN, D_HIDDEN), "b1": w(D_HIDDEN), "w2": w(D_HIDDEN, D_OUT), "b2": w(D_OUT)}
  return {"w": w(D_IN, D_OUT), "b": w(D_OUT)}


def reference_sgd(params: dict, batches: list[dict]):
  """The loop on one device, in float64 numpy on each whole global batch: (params, losses, scales), where
  `scales` bound |p0| + lr * sum_t sum_i |per-example gradient| / B_t for each parameter (the operands the
  float32 run adds up)."""
  p = {name: v.astype(np.float64) for name, v in params.items()}
  scale = {name: np.abs(v) for name, v in p.items()}
  losses = []
  for batch in batches:
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    b = len(x)
    if "w2" in p:
      h = np.tanh(x @ p["w1"] + p["b1"])
      r = h @ p["w2"] + p["b2"] - y
      dh = (r @ p["w2"].T) * (1 - h * h)
      dh_abs = (np.abs(r) @ np.abs(p["w2"]).T) * (1 - h * h)
      grads = {"w2": h.T @ r / b, "b2": r.sum(0) / b, "w1": x.T @ dh / b, "b1": dh.sum(0) / b}
      gabs = {"w2": np.abs(h).T @ np.abs(r) / b, "b2": np.abs(r).sum(0) / b, "w1": np.abs(x).T @ dh_abs / b,
              "b1": dh_abs.sum(0) / b}
    else:
      r = x @ p["w"] + p["b"] - y
      grads = {"w": x.T @ r / b, "b": r.sum(0) / b}
      gabs = {"w": np.abs(x).T @ np.abs(r) / b, "b": np.abs(r).sum(0) / b}
    losses.append(0.5 * (r * r).sum() / b)
    for name in p:
      p[name] = p[name] - LR * grads[name]
      scale[name] = scale[name] + LR * gabs[name]
  return p, np.array(losses), scale


@_settings(max_examples=10)
@given(plan=batch_plans(later=(0, 0)), epoch_batches=st.integers(1, 3), short=st.integers(0, 2 ** 16),
       kind=st.sampled_from(["linear", "mlp"]), path=st.sampled_from(["run", "run_steps"]),
       seed=st.integers(0, 2 ** 32 - 1))
# Global batch 12 on 8 replicas, epochs of 2 full batches and one of 5 rows.
@example(plan=(8, [12]), epoch_batches=2, short=5, kind="mlp", path="run", seed=11)
# Global batch 3 on 8 replicas (k = 1, 5 replicas idle), epochs of 3 + 2 rows.
@example(plan=(8, [3]), epoch_batches=1, short=2, kind="linear", path="run_steps", seed=12)
def test_sgd_matches_single_device_loop(plan, epoch_batches, short, kind, path, seed):
  n, (b0,) = plan
  # An epoch: `epoch_batches` full batches and, unless `short` says none, a partial last one.
  last = short % b0
  rows = epoch_batches * b0 + last
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, D_IN)).astype(np.float32)
  y = (np.sin(x @ rng.normal(size=(D_IN, D_OUT))) + 0.1 * rng.normal(size=(rows, D_OUT))).astype(np.float32)
  epoch = [{"x": x[i:i + b0], "y": y[i:i + b0]} for i in range(0, rows, b0)]
  batches = (epoch * STEPS)[:STEPS]
  params0 = init_params(rng, kind)
  strategy = strategy_for(n)
  it = iter(strategy.experimental_distribute_dataset(batches))
  if path == "run":
    params, losses = params0, []
    for batch in it:
      params, loss = strategy.run(sgd_step, args=(params, batch))
      losses.append(loss.values[0])
  else:
    params, stacked = strategy.experimental_run_steps(sgd_step, it, steps=STEPS, init=params0)
    losses = list(np.asarray(stacked.values[0]))
  expected, expected_losses, scale = reference_sgd(params0, batches)
  where = f"{kind} via {path}: n={n} global batch {b0} (k={math.ceil(b0 / n)}), epoch of {rows} rows"
  assert len(losses) == STEPS, where
  assert_equivalent(np.array(losses, np.float64), expected_losses, F32, scale=expected_losses.max(),
                    what=f"{where}: losses")
  for name, value in params.items():
    assert isinstance(value, Mirrored), (where, name)
    assert_equivalent(value.values[0], expected[name], F32, scale=scale[name], what=f"{where}: {name}")
