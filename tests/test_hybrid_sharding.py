"""Hybrid sharding (issue 34): state split within groups of replicas and replicated across the groups.

`experimental_shard(tree, partitioner, groups=...)` (FSDP), `sharded_optimizer(tx, groups=...)` (ZeRO-1/2)
and `accumulate_gradients` on such parameters: the numbers equal plain optax / JAX on one device with the
whole batch; the compiled program's all-gathers and reduce-scatters stay within the groups, and the only
collectives across them are the all-reduces of each block (``1/S`` of the state), whose bytes
`benchmarks/_collective_bytes.py` counts from the HLO (the same function the benchmark uses); checkpoints
move between hybrid, full FSDP and data parallel bit for bit; bad groups are errors naming the value
before anything is traced. The 2 processes x 4 devices job (one group per process) is
`tests/_mp_scripts/hybrid_mp.py`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import EMBEDDING_LAYOUTS, assert_close, distribute_batch, embedding_layout

import tpustrat
from tpustrat import Mirrored, ShardedVariable
from tpustrat._src import grouped_sums
from tpustrat.checkpoint import CheckpointManager

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 8
HALVES = [[0, 1, 2, 3], [4, 5, 6, 7]]
INTERLEAVED = [[0, 2, 4, 6], [1, 3, 5, 7]]
PAIRS = [[0, 1], [2, 3], [4, 5], [6, 7]]



def _load(name: str, path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


cb = _load("collective_bytes", ROOT / "benchmarks" / "_collective_bytes.py")
common = _load("hybrid_common", ROOT / "tests" / "_mp_scripts" / "hybrid_common.py")
K = common.K
init_params, split_all, batches, loss_fn = common.init_params, common.split_all, common.batches, common.loss_fn
one_device, distribute, fsdp_step, whole = common.one_device, common.distribute, common.fsdp_step, common.whole
adam_state, as_numpy, train = common.adam_state, common.as_numpy, common.train


def check_close(got, want):
  for name, w in want.items():
    assert_close(whole(got[name]), w, rtol=1e-5, scale=np.abs(w).max() + 1.0, err_msg=name)


def check_blocks(v: ShardedVariable, value: np.ndarray, groups):
  """Replica r holds block p of S (p: its position in its group), zero-padded: numpy's split."""
  s = len(groups[0])
  b = -(-value.shape[v.axis] // s)
  pad = [(0, 0)] * value.ndim
  pad[v.axis] = (0, s * b - value.shape[v.axis])
  blocks = np.split(np.pad(value, pad), s, axis=v.axis)
  got = v.values
  for group in groups:
    for p, r in enumerate(group):
      np.testing.assert_array_equal(got[r], blocks[p], err_msg=f"replica {r}")


# -- groups: resolution and errors ------------------------------------------------------------------------


def test_groups_resolve_to_replica_ids(strategy):
  assert tpustrat.sharding_groups(strategy, HALVES) == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert tpustrat.sharding_groups(strategy, np.array(INTERLEAVED)) == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert tpustrat.sharding_groups(strategy, None) is None
  assert tpustrat.sharding_groups(strategy, [list(range(8))]) is None  # one group: plain sharding
  assert tpustrat.sharding_groups(strategy, "process") is None  # one process holds every replica


@pytest.mark.parametrize("groups, message", [
    ([[0, 1, 2], [3, 4, 5, 6, 7]], "unequal sizes"),
    ([[0, 1, 2, 3], [3, 4, 5, 6]], "uses replica 3 more than once"),
    ([[0, 1], [2, 3], [4, 5]], r"missing \[6, 7\]"),
    ([[0, 1, 2], [3, 4, 5]], "do not divide the 8 replicas"),
    ([[0, 1, 2, 3], [4, 5, 6, 9]], "names replica 9, out of range"),
    ("host", "'host' is not a kind of group"),
    ("slice", "needs each device's slice_index"),
    (3, "must be 'process', 'slice'"),
])
def test_bad_groups_are_errors_naming_the_value(strategy, groups, message):
  with pytest.raises((ValueError, TypeError), match=message) as info:
    strategy.experimental_shard(init_params(), split_all, groups=groups)
  assert "experimental_shard" in str(info.value)
  if not isinstance(groups, (str, int)):
    assert "groups=" in str(info.value)


def test_process_groups_of_unequal_sizes_are_an_error(monkeypatch):
  from tpustrat._src import sharding

  class Fake:
    def __init__(self, process_index):
      self.process_index = process_index

  devices = [Fake(0), Fake(0), Fake(0), Fake(1)]
  with pytest.raises(ValueError, match=r"unequal sizes \(replicas per process_index: \{0: 3, 1: 1\}\)"):
    sharding._by_attribute(devices, "process_index", "experimental_shard", "process")
  assert sharding._by_attribute([Fake(1), Fake(0), Fake(1), Fake(0)], "process_index", "w", "process") == [[1, 3],
                                                                                                        [0, 2]]


@pytest.mark.parametrize("groups, message", [
    ([[0, 1, 2], [3, 4]], "unequal sizes"),
    ([[0, 1], [1, 2]], "replica 1 in more than one group"),
    ([[0, "a"]], "'a', not a replica id"),
    ([], "non-empty"),
])
def test_sharded_optimizer_checks_explicit_groups_when_made(groups, message):
  with pytest.raises(ValueError, match=message):
    tpustrat.sharded_optimizer(optax.adam(1e-3), groups=groups)


def test_sharded_optimizer_resolves_groups_on_the_running_strategy(strategy):
  zopt = tpustrat.sharded_optimizer(optax.adam(1e-3), split_all, groups=[[0, 1, 2], [3, 4, 5]])
  params = strategy.experimental_mirror(init_params())
  with pytest.raises(ValueError, match=r"sharded_optimizer: groups=\[\[0, 1, 2\], \[3, 4, 5\]\] has groups of 3"):
    strategy.run(zopt.init, args=(params,))


# -- layout ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [HALVES, INTERLEAVED, PAIRS], ids=["halves", "interleaved", "pairs"])
def test_each_replica_holds_its_groups_block(strategy, groups):
  params = init_params()
  state = strategy.experimental_shard(params, split_all, groups=groups)
  s = len(groups[0])
  for name in ("w1", "b1", "w2", "b2"):
    v = state[name]
    assert v.groups == tuple(tuple(g) for g in groups)
    assert v.num_replicas == N and f"groups={N // s}x{s}" in repr(v)
    np.testing.assert_array_equal(np.asarray(v), params[name])
    check_blocks(v, params[name], groups)
    # each device holds one block: 1/S of the value (padded)
    assert {sh.data.shape[1:] for sh in v.tree.addressable_shards} == {v.tree.shape[1:]}
    assert v.tree.shape[1] == -(-params[name].shape[0] // s)
  assert isinstance(state["s"], Mirrored)


def test_experimental_shard_re_splits_a_value_onto_other_groups(strategy):
  params = init_params()
  hybrid = strategy.experimental_shard(params, split_all, groups=HALVES)
  assert strategy.experimental_shard(hybrid, split_all, groups=HALVES)["w1"] is hybrid["w1"]
  full = strategy.experimental_shard(hybrid, split_all)
  assert full["w1"].groups is None and full["w1"].tree.shape[0] == N
  check_blocks(full["w1"], params["w1"], [list(range(N))])
  other = strategy.experimental_shard(full, split_all, groups=INTERLEAVED)
  check_blocks(other["w1"], params["w1"], INTERLEAVED)


# -- numbers: one device ---------------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [HALVES, INTERLEAVED], ids=["halves", "interleaved"])
def test_fsdp_adam_equals_one_device(strategy, groups):
  tx = optax.adam(1e-2)
  params = init_params()
  data = batches()
  want = one_device(tx, params, data)
  state = strategy.experimental_shard(params, split_all, groups=groups)
  state = (state, strategy.run(tx.init, args=(state,)))
  assert state[1][0].mu["w1"].groups == tuple(tuple(g) for g in groups)  # Adam's moments: split alike
  step = fsdp_step(tx)
  for x, y in distribute(strategy, data):
    state = strategy.run(step, args=(state, x, y), options=tpustrat.RunOptions(donate_argnums=0))
  params_out = state[0]
  assert params_out["w1"].groups == tuple(tuple(g) for g in groups)
  check_close(params_out, want)
  for name in ("w1", "w2", "b1", "b2"):  # the groups hold equal blocks, bit for bit
    check_blocks(params_out[name], np.asarray(params_out[name]), groups)


def test_global_norm_clip_counts_each_block_once(strategy):
  tx = optax.chain(tpustrat.clip_by_global_norm(0.5), optax.sgd(1e-2))
  want = one_device(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1e-2)), init_params(), batches())
  state = strategy.experimental_shard(init_params(), split_all, groups=HALVES)
  state = (state, strategy.run(tx.init, args=(state,)))
  step = fsdp_step(tx)
  for x, y in distribute(strategy, batches()):
    state = strategy.run(step, args=(state, x, y))
  check_close(state[0], want)


GROUPS = pytest.mark.parametrize("groups", [HALVES, INTERLEAVED, PAIRS], ids=["halves", "interleaved", "pairs"])
BLOCK_STATISTICS = pytest.mark.parametrize("clip, message", [
    (optax.clip_by_global_norm(0.5), r"`reduce_sum` in optax .*clip_by_global_norm"),
    (optax.clip_by_block_rms(0.01), r"`reduce_sum` in optax clip_by_block_rms"),
], ids=["clip-by-global-norm", "clip-by-block-rms"])


def read_each(params):
  """Each sharded leaf read alone (`read_value`: one all-gather per leaf, not `read_values`' packed one)."""
  return {k: v.read_value() if isinstance(v, tpustrat.LocalShard) else v for k, v in params.items()}


@pytest.mark.parametrize("groups", [None, HALVES, INTERLEAVED, PAIRS],
                         ids=["no-groups", "halves", "interleaved", "pairs"])
@BLOCK_STATISTICS
@pytest.mark.parametrize("read", [tpustrat.read_values, read_each], ids=["read-values", "read-value"])
def test_optax_block_statistics_on_hybrid_blocks_are_refused(strategy, groups, clip, message, read):
  # Issue 43, item 1: optax's clip on a hybrid value's gradient blocks (reduce-scattered within the group,
  # then all-reduced across the groups) clipped each replica's block by its own norm: the update's norm was
  # 1.0 where one-device optax gives 0.5, and clip_by_block_rms was off by 7.7e-3. The update must not run.
  # Without groups, `read_values`' packed gradient (one reduce-scatter, cut back into the leaves) ran too.
  tx = optax.chain(clip, optax.sgd(1e-2))
  params = init_params()
  (x, y), = distribute(strategy, batches()[:1])
  g = jax.grad(loss_fn)(jax.tree.map(jnp.asarray, params), *batches()[0])
  assert float(optax.tree.norm(g)) > 0.5  # the clip is active: one-device optax would scale the update
  state = strategy.experimental_shard(params, split_all, groups=groups)
  state = (state, strategy.run(tx.init, args=(state,)))

  def step(state, x, y):
    p, opt = state
    grads = jax.grad(lambda q: loss_fn(read(q), x, y))(p)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt

  with pytest.raises(ValueError, match=r"sharded outputs at .*\['w1'\].* computed from a statistic of this replica's "
                                       r"block alone \(" + message + r".*tpustrat.clip_by_global_norm"):
    strategy.run(step, args=(state, x, y))
  np.testing.assert_array_equal(np.asarray(state[0]["w1"]), params["w1"])


@pytest.mark.parametrize("groups", [INTERLEAVED, PAIRS], ids=["interleaved", "pairs"])
def test_global_norm_clip_equals_one_device_on_groups_of_any_order(strategy, groups):
  # The fix the refusal names, on the groups `test_global_norm_clip_counts_each_block_once` does not cover.
  tx = optax.chain(tpustrat.clip_by_global_norm(0.5), optax.sgd(1e-2))
  want = one_device(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1e-2)), init_params(), batches())
  state = strategy.experimental_shard(init_params(), split_all, groups=groups)
  state = (state, strategy.run(tx.init, args=(state,)))
  step = fsdp_step(tx)
  for x, y in distribute(strategy, batches()):
    state = strategy.run(step, args=(state, x, y))
  check_close(state[0], want)


def clipped_by_a_grouped_norm(strategy, groups, sum_over):
  """Three SGD steps on `groups`-hybrid parameters, each gradient clipped to norm 0.5 by a norm summed by
  hand: each replica's blocks' squares, all-reduced over the replica groups `sum_over`."""

  def step(p, x, y):
    g = jax.grad(lambda q: loss_fn(tpustrat.read_values(q), x, y))(p)
    local = sum(jnp.sum(b.real_block() ** 2) for b in jax.tree.leaves(g, is_leaf=lambda v: isinstance(
        v, tpustrat.LocalShard)))
    norm = jnp.sqrt(tpustrat.get_replica_context().all_reduce("sum", local, group_assignment=sum_over))
    scale = jnp.minimum(1.0, 0.5 / norm)
    return jax.tree.map(lambda w, u: w - 1e-2 * scale * u, p, g)

  params = strategy.experimental_shard(init_params(scalar=False), split_all, groups=groups)
  for x, y in distribute(strategy, batches()):
    params = strategy.run(step, args=(params, x, y))
  return params


@pytest.mark.parametrize("impl", ["native", "scatter_gather"])
@pytest.mark.parametrize("groups", [HALVES, INTERLEAVED], ids=["halves", "interleaved"])
def test_a_block_statistic_summed_within_the_values_groups_is_right(strategy, monkeypatch, impl, groups):
  # Summed within the value's own groups, the blocks' squares are the whole gradient's: right, not refused
  # (whichever mechanism the grouped sum uses).
  monkeypatch.setattr(grouped_sums, "_GROUPED_SUM_IMPL", impl)
  want = one_device(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1e-2)), init_params(scalar=False),
                    batches())
  check_close(clipped_by_a_grouped_norm(strategy, groups, groups), want)


@pytest.mark.parametrize("impl", ["native", "scatter_gather"])
def test_a_block_statistic_summed_across_the_values_groups_is_refused(strategy, monkeypatch, impl):
  # Across the groups the replicas at one position hold copies of one block: G times that block's norm.
  monkeypatch.setattr(grouped_sums, "_GROUPED_SUM_IMPL", impl)
  across = [list(column) for column in zip(*HALVES)]
  with pytest.raises(ValueError, match=r"computed from a statistic of this replica's block alone \(`reduce_sum`"):
    clipped_by_a_grouped_norm(strategy, HALVES, across)


@GROUPS
@BLOCK_STATISTICS
def test_sharded_optimizer_with_groups_refuses_optax_block_statistics(strategy, groups, clip, message):
  zopt = tpustrat.sharded_optimizer(optax.chain(clip, optax.sgd(1e-2)), split_all, groups=groups)
  params = strategy.experimental_mirror(init_params())
  opt = strategy.run(zopt.init, args=(params,))
  (x, y), = distribute(strategy, batches()[:1])

  def step(params, opt, x, y):
    updates, opt = zopt.update(jax.grad(loss_fn)(params, x, y), opt, params)
    return optax.apply_updates(params, updates), opt

  with pytest.raises(ValueError, match=r"sharded_optimizer: tx combines the elements of a split leaf's block "
                                       r"without summing over the replicas \(" + message):
    strategy.run(step, args=(params, opt, x, y))


def test_accumulate_gradients_on_hybrid_parameters_equals_one_device(strategy):
  tx = optax.adam(1e-2)
  data = batches()
  want = one_device(tx, init_params(), data)

  def step(state, x, y):
    params, opt = state
    _, grads = tpustrat.accumulate_gradients(lambda p, b: loss_fn(p, *b), params, (x, y),
                                             gradient_accumulation_steps=2)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  state = strategy.experimental_shard(init_params(), split_all, groups=HALVES)
  state = (state, strategy.run(tx.init, args=(state,)))
  for x, y in distribute(strategy, data):
    state = strategy.run(step, args=(state, x, y))
  check_close(state[0], want)


@pytest.mark.parametrize("per_replica", [True, False], ids=["per-replica-grads", "summed-grads"])
def test_sharded_optimizer_adam_equals_one_device(strategy, per_replica):
  tx = optax.adam(1e-2)
  data = batches()
  want = one_device(tx, init_params(), data)
  zopt = tpustrat.sharded_optimizer(tx, split_all, groups=HALVES)
  params = strategy.experimental_mirror(init_params())
  opt = strategy.run(zopt.init, args=(params,))
  mu = opt[0].mu["w1"]
  assert mu.groups == tuple(tuple(g) for g in HALVES) and mu.shape == (13 * 37,)
  assert mu.tree.shape == (N, -(-13 * 37 // 4))  # each device: 1/4 of the moment

  def step(params, opt, x, y):
    wrt = tpustrat.local_copy(params) if per_replica else params
    grads = jax.grad(loss_fn)(wrt, x, y)
    updates, opt = zopt.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  for x, y in distribute(strategy, data):
    params, opt = strategy.run(step, args=(params, opt, x, y), options=tpustrat.RunOptions(donate_argnums=(0, 1)))
  for name in want:
    assert isinstance(params[name], Mirrored), name
  check_close(params, want)


# -- the compiled program: which collectives cross the groups, and how many bytes --------------------------


def compiled_hlo(strategy, fn, args):
  """The optimized HLO of the program `strategy.run(fn, args)` ran (as tests/test_sharding.py reads it)."""
  engine = strategy._engine
  leaves, in_tree = jax.tree.flatten((tuple(args), {}))
  (program, targets), = [e for (k, t), e in engine._entries.items() if t == in_tree and (
      k() if callable(k) else k) is fn]
  return program._flat.lower(*[engine._place(v, t) for v, t in zip(leaves, targets)]).compile().as_text()


def program_of(strategy, state, tx, sharded: bool):
  data = distribute(strategy, batches())[0]
  if sharded:
    step = fsdp_step(tx)
  else:
    def step(state, x, y):
      params, opt = state
      grads = jax.grad(loss_fn)(params, x, y)
      updates, opt = tx.update(grads, opt, params)
      return optax.apply_updates(params, updates), opt
  state = (state, strategy.run(tx.init, args=(state,)))
  strategy.run(step, args=(state, *data))
  return compiled_hlo(strategy, step, (state, *data))


def padded_bytes(params, s):
  return sum(-(-v.shape[0] // s) * s * (v.size // v.shape[0]) * 4 for v in params.values())


def test_collectives_stay_within_groups_and_one_share_crosses(strategy):
  """Hybrid over groups of 4: every all-gather and reduce-scatter within a group, every all-reduce across
  the groups (one replica per group: the block's 1/4 of the value); the bytes sent across the groups are
  1/4 of full FSDP's and of data parallel's, as the model counts them (`cross_domain_bytes`)."""
  tx = optax.sgd(1e-2)
  params = init_params(scalar=False)
  groups = tuple(tuple(g) for g in HALVES)
  across = tuple(tuple(c) for c in zip(*groups))
  hlo = program_of(strategy, strategy.experimental_shard(params, split_all, groups=HALVES), tx, True)
  found = cb.collectives(hlo)
  kinds = {c.op for c in found}
  assert kinds == {"all-gather", "reduce-scatter", "all-reduce"}, found
  for c in found:
    want = across if c.op == "all-reduce" else groups
    assert c.groups == want, c
  # the all-reduces carry the blocks: 1/4 of every (padded) leaf, once each
  assert sum(c.nbytes for c in found if c.op == "all-reduce") == padded_bytes(params, 4) // 4
  hybrid = cb.cross_domain_bytes(hlo, HALVES)
  full = cb.cross_domain_bytes(program_of(strategy, strategy.experimental_shard(params, split_all), tx, True), HALVES)
  dp = cb.cross_domain_bytes(program_of(strategy, strategy.experimental_mirror(params), tx, False), HALVES)
  assert hybrid["all-gather"] == hybrid["reduce-scatter"] == 0
  # per device, the block (P/4) once out in the all-reduce of 2 (reduce-scatter + all-gather halves): P/4
  assert hybrid["total"] == N * padded_bytes(params, 4) // 4
  # full FSDP: each device sends its 1/8 to the 4 devices of the other group (gather), and the other group's
  # 4 pieces of its gradient (reduce-scatter): P / 2 each
  assert full["total"] == N * padded_bytes(params, 8) // 2 + N * padded_bytes(params, 8) // 2
  # data parallel: a flat all-reduce of 8 sends 2 * 4/8 of P to the other group
  assert dp["total"] == N * sum(v.size * 4 for v in params.values())
  assert hybrid["total"] <= 0.3 * full["total"] and hybrid["total"] <= 0.3 * dp["total"]


# A tree of sharded leaves: split along axis 0 and axis 1, padded, two dtypes; the per-replica factor of
# the loss (replica r: r + 1) makes each replica's gradient differ.
READ_AXES = {"a": 0, "b": 1, "c": 0, "h": 0}


def read_params():
  rng = np.random.default_rng(3)
  return {"a": rng.normal(size=(13, 6)).astype(np.float32), "b": rng.normal(size=(3, 10)).astype(np.float32),
          "c": rng.normal(size=(9,)).astype(np.float32), "h": rng.normal(size=(6, 4)).astype(jnp.bfloat16)}


def read_loss(full, x):
  return sum(jnp.sum(jnp.sin(v.astype(jnp.float32) * x)) for v in full.values())


def read_together(p, x):
  full = tpustrat.read_values(p)
  return full, jax.grad(lambda q: read_loss(tpustrat.read_values(q), x))(p)


def read_alone(p, x):
  full = {k: v.read_value() for k, v in p.items()}
  return full, jax.grad(lambda q: read_loss({k: v.read_value() for k, v in q.items()}, x))(p)


@pytest.mark.parametrize("groups", [None, HALVES], ids=["full", "halves"])
def test_read_values_gathers_a_trees_leaves_together(strategy, groups):
  """`read_values` reads the sharded leaves of one dtype through one all-gather, so the gradient is one
  reduce-scatter (and with groups one all-reduce across them), where reading each leaf alone costs one per
  leaf; the values, the gradients and the bytes sent across the groups are the same."""
  params = read_params()
  sharded = strategy.experimental_shard(params, lambda path, shape, dtype: READ_AXES[path[0].key], groups=groups)
  x = strategy.experimental_distribute_values_from_function(lambda c: np.float32(c.replica_id_in_sync_group + 1))
  hlo, out = {}, {}
  for fn in (read_together, read_alone):
    out[fn] = strategy.run(fn, args=(sharded, x))
    hlo[fn] = compiled_hlo(strategy, fn, (sharded, x))
  factors = np.arange(1, N + 1, dtype=np.float32)
  for name, value in params.items():
    v32 = value.astype(np.float32)
    want = sum(np.cos(v32 * f) * f for f in factors)  # d/dv of sum_r sin(v * x_r)
    tol = 1e-5 if value.dtype == np.float32 else 2e-2
    for fn in (read_together, read_alone):
      full, grads = out[fn]
      for r in range(N):
        np.testing.assert_array_equal(np.asarray(full[name].values[r]), value, err_msg=f"{fn.__name__} {name} {r}")
      assert_close(np.asarray(grads[name]).astype(np.float32), want, rtol=tol, scale=np.abs(want).max() + 1.0,
                   err_msg=f"{fn.__name__} {name}")
    np.testing.assert_array_equal(np.asarray(out[read_together][1][name]), np.asarray(out[read_alone][1][name]),
                                  err_msg=name)
  s = N if groups is None else len(groups[0])
  # float32 block elements per leaf, by hand: ceil(rows / s) rows of the split axis times the other axes
  f32_blocks = [-(-13 // s) * 6, 3 * -(-10 // s), -(-9 // s)]
  together, alone = cb.collectives(hlo[read_together]), cb.collectives(hlo[read_alone])
  sizes = lambda found, op: sorted(c.nbytes for c in found if c.op == op)  # noqa: E731
  # alone: one all-gather and one reduce-scatter per leaf, the float32 ones of these sizes, and the bfloat16
  # leaf's (whose bytes are XLA's: XLA:CPU gathers bfloat16 as float32)
  gathers, scatters = sizes(alone, "all-gather"), sizes(alone, "reduce-scatter")
  assert len(gathers) == len(scatters) == 4, alone
  for b in f32_blocks:
    gathers.remove(s * b * 4)
    scatters.remove(b * 4)
  (bf16_gather,), (bf16_scatter,) = gathers, scatters
  # together: the float32 leaves in one all-gather and one reduce-scatter of their blocks end to end
  assert sizes(together, "all-gather") == sorted([s * sum(f32_blocks) * 4, bf16_gather]), together
  assert sizes(together, "reduce-scatter") == sorted([sum(f32_blocks) * 4, bf16_scatter]), together
  if groups is None:
    assert sizes(together, "all-reduce") == sizes(alone, "all-reduce") == []
  else:
    in_groups = tuple(tuple(g) for g in groups)
    across = tuple(tuple(c) for c in zip(*in_groups))
    for c in together:
      assert c.groups == (across if c.op == "all-reduce" else in_groups), c
    # the blocks cross the groups once, as when each leaf is read alone
    assert sum(sizes(together, "all-reduce")) == sum(sizes(alone, "all-reduce")) == sum(f32_blocks) * 4 + bf16_scatter
    assert cb.cross_domain_bytes(hlo[read_together], HALVES) == cb.cross_domain_bytes(hlo[read_alone], HALVES)


def test_sharded_optimizer_collectives_stay_within_groups(strategy):
  zopt = tpustrat.sharded_optimizer(optax.adam(1e-2), split_all, groups=HALVES)
  params = strategy.experimental_mirror(init_params(scalar=False))
  opt = strategy.run(zopt.init, args=(params,))
  x, y = distribute(strategy, batches())[0]

  def step(params, opt, x, y):
    grads = jax.grad(loss_fn)(tpustrat.local_copy(params), x, y)
    updates, opt = zopt.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  strategy.run(step, args=(params, opt, x, y))
  found = cb.collectives(compiled_hlo(strategy, step, (params, opt, x, y)))
  groups = tuple(tuple(g) for g in HALVES)
  across = tuple(tuple(c) for c in zip(*groups))
  assert sorted(c.op for c in found) == ["all-gather", "all-reduce", "reduce-scatter"], found
  for c in found:
    assert c.groups == (across if c.op == "all-reduce" else groups), c


def test_collective_bytes_reads_iota_groups_and_async_starts():
  hlo = """
  %a = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %p), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %b = f32[2]{0} all-reduce(f32[2]{0} %q), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add
  %c = (f32[2,4]{1,0}, f32[8,4]{1,0}) all-gather-start(f32[2,4]{1,0} %p), replica_groups={{0,1,2,3},{4,5,6,7}}
  %d = f32[3]{0} collective-permute(f32[3]{0} %r), source_target_pairs={{0,4},{1,2}}
  %e = bf16[4]{0} reduce-scatter(bf16[16]{0} %s), replica_groups={}, dimensions={0}
  %f = (f32[2]{0}, /*index=1*/f32[3]{0}) all-reduce(f32[2]{0} %t, f32[3]{0} %u), to_apply=%add, metadata={op_name="x"}
  """
  found = cb.collectives(hlo)
  assert [c.op for c in found] == ["all-gather", "all-reduce", "all-gather", "collective-permute", "reduce-scatter",
                                   "all-reduce"]
  assert found[5].nbytes == 20 and found[5].groups is None  # a combined all-reduce's tuple; no groups: all
  found = found[:5]
  assert found[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and found[0].nbytes == 128
  assert found[1].groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and found[1].nbytes == 8
  assert found[2].nbytes == 128 and found[4].groups is None and found[4].nbytes == 8
  out = cb.cross_domain_bytes(found, HALVES)
  assert out["all-gather"] == 0
  assert out["all-reduce"] == 8 * 2 * 1 * 8 // 2
  assert out["collective-permute"] == 12
  assert out["reduce-scatter"] == 8 * 4 * 8  # each device: the other half's 4 pieces of 8 bytes


def test_collective_bytes_reads_mesh_groups():
  """XLA's mesh form of replica groups (what jit's SPMD partitioner writes on a 2-D mesh): the devices laid
  out on the mesh's axes (an iota list, transposed where `device_ids` says), grouped along the named axes.
  Read as every device before, it counted a hybrid program's gathers as crossing the processes."""
  hlo = """
  %a = f32[128,4,32]{2,1,0} all-gather(f32[32,4,32]{2,1,0} %p), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}, use_global_device_ids=true
  %b = (f32[4,32]{1,0}, f32[128]{0}) all-reduce(f32[4,32]{1,0} %q, f32[128]{0} %r), channel_id=2, replica_groups=mesh['axis_0'=1,'axis_1'=1,'axis_2'=4,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_3'}, use_global_device_ids=true, to_apply=%add
  %c = f32[256,128]{1,0} all-reduce(f32[256,128]{1,0} %s), channel_id=3, replica_groups=mesh['axis_0'=8,'axis_1'=1,'axis_2'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  """
  found = cb.collectives(hlo)
  # %a: ids 0..7 as [2,4], transposed to [4,2] = [[0,4],[1,5],[2,6],[3,7]] on axes (axis_0, axis_3): along axis_0
  assert found[0].groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and found[0].nbytes == 128 * 4 * 32 * 4
  # %b: the same layout on (axis_2, axis_3), along axis_3: one device of each half
  assert found[1].groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and found[1].nbytes == (4 * 32 + 128) * 4
  assert found[2].groups == ((0, 1, 2, 3, 4, 5, 6, 7),)
  out = cb.cross_domain_bytes(found[:2], HALVES)
  assert out["all-gather"] == 0 and out["all-reduce"] == 8 * 2 * 1 * (4 * 32 + 128) * 4 // 2
  # a compiled program on a (data, fsdp) mesh of 2 x 4: sums over 'fsdp' stay within the halves, over 'data'
  # they pair the halves
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
  for axis, want in (("fsdp", tuple(tuple(g) for g in HALVES)), ("data", ((0, 4), (1, 5), (2, 6), (3, 7)))):
    program = jax.jit(lambda x: jnp.sum(x, axis=0, keepdims=True), in_shardings=NamedSharding(mesh, P(axis)),
                      out_shardings=NamedSharding(mesh, P()))
    (c,) = [c for c in cb.collectives(program.lower(jnp.ones((8, 16))).compile().as_text()) if c.op == "all-reduce"]
    assert c.groups == want, (axis, c)


# -- checkpoints -----------------------------------------------------------------------------------------


def trained(strategy, groups):
  state = adam_state(strategy, init_params(), groups)
  return train(strategy, state, batches(strategy.num_replicas_in_sync)[:2])


LAYOUTS = {"hybrid": (HALVES, True), "interleaved": (INTERLEAVED, True), "pairs": (PAIRS, True),
           "full": (None, True), "data parallel": (None, False)}


@pytest.mark.parametrize("source", ["hybrid", "interleaved"])
@pytest.mark.parametrize("target", sorted(LAYOUTS))
def test_checkpoints_move_between_layouts_bit_for_bit(strategy, tmp_path, source, target):
  state = trained(strategy, LAYOUTS[source][0])
  saved = as_numpy(state)
  with CheckpointManager(tmp_path / "ckpt", strategy) as manager:
    manager.save(2, state)
    manager.wait_until_finished()
    groups, sharded = LAYOUTS[target]
    like = adam_state(strategy, init_params(seed=7), groups, sharded)
    restored = manager.restore(2, target=like)
  got = as_numpy(restored)
  assert sorted(got) == sorted(saved)
  for k in saved:
    np.testing.assert_array_equal(got[k], saved[k], err_msg=k)
  for (path, got_v), want_v in zip(
      jax.tree_util.tree_flatten_with_path(restored, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))[0],
      jax.tree.leaves(like, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues))):
    assert type(got_v) is type(want_v), path
    if isinstance(want_v, ShardedVariable):
      assert got_v.groups == want_v.groups and got_v.tree.sharding == want_v.tree.sharding, path
      check_blocks(got_v, np.asarray(got_v), groups or [list(range(N))])


@pytest.mark.parametrize("source", ["full", "data parallel"])
def test_full_fsdp_and_data_parallel_checkpoints_restore_as_hybrid(strategy, tmp_path, source):
  groups, sharded = LAYOUTS[source]
  state = adam_state(strategy, init_params(seed=3), groups, sharded)
  saved = as_numpy(state)
  with CheckpointManager(tmp_path / "ckpt", strategy) as manager:
    manager.save(1, state)
    manager.wait_until_finished()
    restored = manager.restore(1, target=adam_state(strategy, init_params(seed=7), HALVES))
  got = as_numpy(restored)
  for k in saved:
    np.testing.assert_array_equal(got[k], saved[k], err_msg=k)
  check_blocks(restored["params"]["w1"], saved["['params']['w1']"], HALVES)


def test_a_hybrid_checkpoint_saves_one_groups_blocks(strategy, tmp_path):
  """Saved as a value split over 4 replicas: a 4-replica strategy restores it block for block."""
  state = trained(strategy, HALVES)
  saved = as_numpy(state)
  with CheckpointManager(tmp_path / "ckpt", strategy) as manager:
    manager.save(2, state)
    manager.wait_until_finished()
  four = tpustrat.MirroredStrategy(jax.devices()[:4])
  with CheckpointManager(tmp_path / "ckpt", four) as manager:
    restored = manager.restore(2, target=adam_state(four, init_params(seed=7)))
  assert restored["params"]["w1"].tree.shape == (4, 4, 37)
  got = as_numpy(restored)
  for k in saved:
    np.testing.assert_array_equal(got[k], saved[k], err_msg=k)


# -- two processes x four devices: one group per process ---------------------------------------------------


@pytest.mark.processes
def test_two_processes_one_group_each(tmp_path):
  """`tests/_mp_scripts/hybrid_mp.py` on 2 processes x 4 devices with groups='process': the groups are the
  processes, Adam equals one device (checked in the script against numpy), the compiled step's gathers and
  reduce-scatters stay within a process, and checkpoints move 2x4 -> 1x8 (here) and 1x8 -> 2x4 / 4x2."""
  try:
    import tpustrat.launch  # noqa: F401
  except ImportError:
    pytest.skip("tpustrat.launch is not available")
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  strategy = tpustrat.TPUStrategy()
  # 1 x 8, groups of 4 (as the processes of the 2 x 4 job will be): 2 Adam steps, saved for the job
  state = trained(strategy, HALVES)
  with CheckpointManager(ckpt, strategy) as manager:
    manager.save(2, state)
  saved = as_numpy(state)
  np.savez(tmp_path / "saved.npz", **{str(i): v for i, v in enumerate(saved.values())})
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_") and k not in ("XLA_FLAGS",
                                                                                             "JAX_NUM_CPU_DEVICES")}
  script = ROOT / "tests" / "_mp_scripts" / "hybrid_mp.py"
  for procs, devices in ((2, 4), (4, 2)):
    command = [sys.executable, "-m", "tpustrat.launch", "-n", str(procs), "-d", str(devices), "--timeout", "200",
               str(script), str(ckpt), str(tmp_path / "saved.npz"), str(out / f"{procs}x{devices}")]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.loads((out / f"{procs}x{devices}" / f"process_{i}.json").read_text()) for i in range(procs)]
    for r in results:
      assert r["groups"] == [list(range(p * devices, (p + 1) * devices)) for p in range(procs)], r
      assert r["restored_identical"] and r["one_device_close"] and r["within_groups"], r
  # the 2 x 4 job's checkpoint (step 5: 3 more Adam steps there), restored here on 1 x 8 (full FSDP and hybrid)
  after = np.load(out / "2x4" / "after.npz")
  with CheckpointManager(ckpt, strategy) as manager:
    assert manager.all_steps() == [2, 5]
    for groups in (None, HALVES):
      restored = manager.restore(5, target=adam_state(strategy, init_params(seed=7), groups))
      got = as_numpy(restored)
      for i, k in enumerate(got):
        np.testing.assert_array_equal(got[k], after[str(i)], err_msg=k)
  want = one_device(optax.adam(1e-2), init_params(), batches()[:2] + batches(seed=2)[:3])
  check_close(restored["params"], want)


# -- embedding tables ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", EMBEDDING_LAYOUTS)
def test_embedding_tables_split_within_groups_equal_the_dense_reference(strategy, monkeypatch, layout):
  """`TPUEmbedding(..., groups=...)`: SGD, Adagrad, lazy and non-lazy Adam, every combiner, on each layout,
  against test_embedding's dense numpy reference; each replica holds its group position's block, the
  groups' blocks stay equal, and the lookups' collectives stay within the groups."""
  te = importlib.import_module("test_embedding")
  monkeypatch.setattr(te.emb_lib, "TPUEmbedding", functools.partial(te.emb_lib.TPUEmbedding, groups=INTERLEAVED))
  assignment = te.ASSIGNMENTS[te.ASSIGNMENT_OF[4]]
  emb = embedding_layout(te.make_embedding(strategy, assignment), layout)
  step = te.make_step(emb)
  state = emb.build()
  for name in emb.table_names:
    t = state["tables"][name]
    assert t.groups == tuple(tuple(g) for g in INTERLEAVED) and emb.rows_per_replica(name) == -(-te.V // 4)
    check_blocks(t, te.INITIAL[name], INTERLEAVED)
  ref = te.reference(assignment)
  for s, batch in enumerate(te.BATCHES):
    state, activations = strategy.run(step, args=(state, distribute_batch(strategy, batch)))
    got = te.gathered(strategy, activations)
    expected = ref.lookup(batch["ids"], batch["weights"])
    for f in te.FEATURES:
      assert_close(got[f], expected[f], err_msg=f"step {s}: activations of {f}")
    ref.apply_gradients(batch["ids"], batch["grads"], batch["weights"])
  te.assert_matches(emb, state, ref, "groups of 4")
  for name in emb.table_names:
    check_blocks(state["tables"][name], np.asarray(state["tables"][name]), INTERLEAVED)
    for slot in state["slots"][name].values():
      check_blocks(slot, np.asarray(slot), INTERLEAVED)
  args = (state, distribute_batch(strategy, te.BATCHES[0]))
  groups = tuple(tuple(g) for g in INTERLEAVED)
  lookups = cb.collectives(jax.jit(lambda st, b: strategy.run(
      lambda st, b: emb.lookup(st, b["ids"], {f: b["weights"].get(f) for f in b["ids"]}), args=(st, b))).lower(
          *args).compile().as_text())
  assert lookups and all(c.groups == groups for c in lookups), lookups


def test_collective_bytes_counts_a_loop_body_once_per_iteration():
  """A collective in a `lax.scan` over 3 layers runs 3 times per run of the program (XLA's trip count)."""
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()), ("r",))

  def body(w, x):
    return jax.lax.scan(lambda h, wl: (h @ jax.lax.all_gather(wl, "r", axis=0, tiled=True), None), x, w)[0]

  program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "r"), P("r")), out_specs=P("r")))
  found = cb.collectives(program.lower(jnp.ones((3, 16, 16)), jnp.ones((8, 16))).compile().as_text())
  assert [(c.op, c.nbytes, c.count) for c in found] == [("all-gather", 16 * 16 * 4, 3)]
  # each device sends its 2 rows (128 bytes) to the 4 devices of the other half, 3 times
  assert cb.cross_domain_bytes(found, HALVES)["total"] == 8 * 4 * 128 * 3
