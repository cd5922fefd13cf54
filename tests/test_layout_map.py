"""Tensor parallelism inside a replica: `tpustrat.LayoutMap` lays leaves out on the logical cores.

`strategy.experimental_shard(tree, layout_map=...)` keeps the matched leaves `Mirrored` (the same on every
replica) but split over each replica's logical cores; `RunOptions(experimental_layout_map=...)` keeps the
step's results laid out the same way. References are one-device optax on the whole batch; "split" is
checked on the arrays `run` returns (each device holds 1/C of a leaf) and on the compiled step's memory.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close, compiled_programs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat import LayoutMap, Mirrored, ShardedVariable


@pytest.fixture(scope="module")
def topology():
  return tpustrat.initialize_tpu_system()


def make(topology, cores):
  """8 devices as 8 / `cores` replicas of `cores` logical cores."""
  shape = {2: [1, 1, 2], 4: [1, 2, 2]}[cores]
  da = tpustrat.DeviceAssignment.build(topology, computation_shape=shape, num_replicas=8 // cores)
  return tpustrat.TPUStrategy(device_assignment=da)


@pytest.fixture(scope="module")
def s42(topology):
  return make(topology, 2)


@pytest.fixture(scope="module")
def s24(topology):
  return make(topology, 4)


def mlp_params(rng, d=16, h=64, o=8):
  return {"dense1": {"kernel": rng.normal(size=(d, h)).astype(np.float32) / 4,
                     "bias": rng.normal(size=(h,)).astype(np.float32) / 10},
          "dense2": {"kernel": rng.normal(size=(h, o)).astype(np.float32) / 8,
                     "bias": np.zeros(o, np.float32)}}


def mlp_layout(cores):
  """Megatron-style: the first kernel split by columns, the second by rows; the last bias replicated."""
  return LayoutMap({r"dense1'\]\['kernel": [1, cores], r"dense1'\]\['bias": [cores],
                    r"dense2'\]\['kernel": [cores, 1], r"dense2'\]\['bias": None})


def loss_fn(p, x, y):
  hidden = jnp.tanh(x @ p["dense1"]["kernel"] + p["dense1"]["bias"])
  return jnp.sum((hidden @ p["dense2"]["kernel"] + p["dense2"]["bias"] - y) ** 2)


def leaf(m):
  return jax.tree.leaves(m)[0]


def expected_spec(strategy, layout, rank):
  names = tuple(a for a in strategy.mesh.axis_names if a != "replica")
  sizes = [strategy.mesh.shape[a] for a in names]
  from tpustrat._src.logical import partition_spec  # pylint: disable=import-outside-toplevel
  return P() if layout is None else partition_spec(layout, names, sizes)


def assert_laid_out(strategy, tree, layout_map, cores):
  """Every leaf the map matches is a `Mirrored` global array with the map's sharding: each device holds
  1/`cores` of it (or all of it for a None layout), and every replica the whole value."""
  for path, m in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Mirrored))[0]:
    where = tpustrat._src.validation.tree_path(path)
    hit = layout_map.match(where)
    if hit is None:
      continue
    assert isinstance(m, Mirrored), where
    x = leaf(m)
    want = NamedSharding(strategy.mesh, expected_spec(strategy, hit[1], x.ndim))
    assert x.sharding.is_equivalent_to(want, x.ndim), (where, x.sharding.spec, want.spec)
    parts = 1 if hit[1] is None else cores
    assert {s.data.size for s in x.addressable_shards} == {x.size // parts}, where
    assert len(m.values) == strategy.num_replicas_in_sync and all(v.shape == x.shape for v in m.values)


def reference_steps(params, tx, x, y, steps):
  """One-device optax on the whole batch (the loss is the mean over every example)."""
  p = jax.tree.map(jnp.asarray, params)
  state = tx.init(p)
  for _ in range(steps):
    g = jax.grad(lambda p: loss_fn(p, x, y) / x.shape[0])(p)
    u, state = tx.update(g, state, p)
    p = optax.apply_updates(p, u)
  return p


@pytest.mark.parametrize("cores", [2, 4])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_mlp_split_over_logical_cores_trains_like_one_device(topology, s42, s24, cores, opt):
  strategy = {2: s42, 4: s24}[cores]
  n = strategy.num_replicas_in_sync
  rng = np.random.default_rng(0)
  params = mlp_params(rng)
  batch = 4 * n
  x = rng.normal(size=(batch, 16)).astype(np.float32)
  y = rng.normal(size=(batch, 8)).astype(np.float32)
  layout_map = mlp_layout(cores)
  tx = optax.sgd(0.1) if opt == "sgd" else optax.adam(1e-2)
  options = tpustrat.RunOptions(experimental_layout_map=layout_map)

  state = strategy.experimental_shard(params, layout_map=layout_map)
  assert_laid_out(strategy, state, layout_map, cores)
  # The optimizer state is made inside the step: without the map its zeros would come back replicated.
  opt_state = strategy.run(tx.init, (state,), options=options)
  assert_laid_out(strategy, opt_state, layout_map, cores)

  xs = strategy.experimental_distribute_values_from_function(
      lambda ctx: x.reshape(n, 4, 16)[ctx.replica_id_in_sync_group])
  ys = strategy.experimental_distribute_values_from_function(
      lambda ctx: y.reshape(n, 4, 8)[ctx.replica_id_in_sync_group])
  traces = []

  def step(p, o, x, y):
    traces.append(1)
    # Gradients w.r.t. Mirrored parameters are summed over replicas: the mean over the global batch.
    loss, g = jax.value_and_grad(lambda p: loss_fn(p, x, y) / batch)(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, tpustrat.get_replica_context().all_reduce("sum", loss)

  for _ in range(3):
    state, opt_state, loss = strategy.run(step, (state, opt_state, xs, ys), options=options)
    assert_laid_out(strategy, state, layout_map, cores)
    assert_laid_out(strategy, opt_state, layout_map, cores)
  assert len(traces) == 1  # the results come back with the layout they went in with: no retrace

  ref = reference_steps(params, tx, x, y, 3)
  for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda v: isinstance(v, Mirrored))[0],
                               jax.tree.leaves(ref)):
    for v in got.values:
      # atol: 1e-5 of the leaf's largest entry (measured: at most 2.3e-7 off, of entries up to ~1).
      assert_close(v, want, err_msg=str(path))


def compiled(strategy, step, args, layout_map):
  """The compiled program `strategy.run(step, args, options=...)` used (run it first)."""
  engine = strategy._engine
  leaves, in_tree = jax.tree.flatten((tuple(args), {}))
  want = layout_map.signature()
  (program, targets), = [e for (k, t), e in engine._entries.items()
                         if t == in_tree and isinstance(k, tuple) and k[1] == want and k[0]() is step]
  return program._flat.lower(*[engine._place(v, t) for v, t in zip(leaves, targets)]).compile()


def test_each_device_holds_one_core_s_part_of_the_state(s24):
  cores = 4
  rng = np.random.default_rng(1)
  w = rng.normal(size=(256, 512)).astype(np.float32)  # 512 KiB: the state dominates the program's arguments
  layout_map = LayoutMap({"w": [1, cores]})
  options = tpustrat.RunOptions(experimental_layout_map=layout_map)
  state = {"w": s24.experimental_shard(w, layout_map=LayoutMap({"": [1, cores]}))}
  xs = s24.experimental_distribute_values_from_function(lambda ctx: np.ones((2, 256), np.float32))

  def step(p, x):
    g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(p)
    return jax.tree.map(lambda a, b: a - 0.01 * b, p, g)

  new = s24.run(step, (state, xs), options=options)
  assert_laid_out(s24, new, layout_map, cores)
  memory = compiled(s24, step, (new, xs), layout_map).memory_analysis()
  assert memory.argument_size_in_bytes <= w.nbytes // cores + 2 * 256 * 4 + 64  # 1/4 of w, and the batch
  assert memory.output_size_in_bytes <= w.nbytes // cores + 64


def test_layout_none_replicates_and_unmatched_leaves_are_left_to_the_partitioner(s42):
  rng = np.random.default_rng(2)
  tree = {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": np.ones(4, np.float32),
          "emb": rng.normal(size=(40, 4)).astype(np.float32), "big": np.ones((256, 512), np.float32)}
  layout_map = LayoutMap({r"\['w'\]": [2, 1], r"\['b'\]": None, "big": [1, 2]})
  # An explicit partitioner splits `emb` over the replicas; the map's leaves it leaves alone.
  state = s42.experimental_shard(tree, lambda path, shape, dtype: 0 if path[0].key == "emb" else None,
                                 layout_map=layout_map)
  assert isinstance(state["emb"], ShardedVariable)
  assert_laid_out(s42, state, layout_map, 2)
  # The default partitioner would split `big` (512 KiB) over the replicas: it is not asked about it.
  default = s42.experimental_shard({"big": tree["big"]}, layout_map=LayoutMap({"big": [2, 1]}))
  assert isinstance(default["big"], Mirrored)
  np.testing.assert_array_equal(default["big"].values[0], tree["big"])

  def step(p):  # both kinds of split state in one step
    emb = p["emb"].read_value()
    return {"w": p["w"] * 2.0, "b": p["b"] * 3.0, "emb": p["emb"], "big": p["big"], "total": jnp.sum(emb)}

  out = s42.run(step, (state,), options=tpustrat.RunOptions(experimental_layout_map=layout_map))
  assert_laid_out(s42, out, layout_map, 2)
  np.testing.assert_array_equal(out["w"].values[1], 2 * tree["w"])
  np.testing.assert_array_equal(out["b"].values[0], 3 * tree["b"])
  assert_close(out["total"].values[0], tree["emb"].sum(), scale=np.abs(tree["emb"]).sum())
  np.testing.assert_array_equal(np.asarray(out["emb"]), tree["emb"])


# -- errors, each naming the pattern and the leaf ---------------------------------------------------------


def test_bad_layout_maps_are_errors_naming_the_leaf(s42):
  tree = {"w": np.zeros((8, 6), np.float32), "b": np.zeros(5, np.float32)}
  with pytest.raises(ValueError, match=r"pattern 'kernel' matches no leaf of the tree \(leaves: \['b'\], \['w'\]\)"):
    s42.experimental_shard(tree, layout_map=LayoutMap({"w": [1, 2], "kernel": [1, 2]}))
  with pytest.raises(ValueError, match=r"the leaf at \['w'\] is matched by 2 patterns of the LayoutMap \('w', '\.'\)"):
    s42.experimental_shard({"w": tree["w"]}, layout_map=LayoutMap({"w": [1, 2], ".": [2, 1]}))
  with pytest.raises(ValueError, match=r"leaf at \['w'\] \(shape \[8, 6\]\) matches the LayoutMap pattern 'w', whose "
                                       r"layout \[2\] has 1 entries: a layout has one entry per dimension of the leaf \(2\)"):
    s42.experimental_shard(tree, layout_map=LayoutMap({"w": [2]}))
  with pytest.raises(ValueError, match=r"leaf at \['w'\].*layout \[2, 2\] splits it into 4 tiles: the entries must "
                                       r"multiply to the 2 logical cores per replica"):
    s42.experimental_shard(tree, layout_map=LayoutMap({"w": [2, 2]}))
  with pytest.raises(ValueError, match=r"leaf at \['b'\] \(shape \[5\]\).*cuts dimension 0 \(size 5\) into 2 pieces"):
    s42.experimental_shard(tree, layout_map=LayoutMap({"b": [2]}))
  with pytest.raises(ValueError, match=r"the leaf at \['w'\] is split over the replicas by the partitioner \(axis 0\) "
                                       r"and laid out on the logical cores by the LayoutMap pattern 'w'"):
    s42.experimental_shard(tree, lambda *_: 0, layout_map=LayoutMap({"w": [1, 2]}))
  sharded = s42.experimental_shard({"w": tree["w"]}, lambda *_: 0)
  with pytest.raises(ValueError, match=r"the leaf at \['w'\] is a ShardedVariable and matches the LayoutMap pattern "
                                       r"'w'.*already split over the replicas"):
    s42.experimental_shard(sharded, layout_map=LayoutMap({"w": [1, 2]}))
  with pytest.raises(TypeError, match="layout_map must be a tpustrat.LayoutMap or None, got dict"):
    s42.experimental_shard(tree, layout_map={"w": [1, 2]})


def test_a_layout_map_needs_logical_cores(strategy):
  layout_map = LayoutMap({"w": [1, 1]})
  with pytest.raises(ValueError, match="a LayoutMap lays leaves out on the logical cores of each replica, and this "
                                       "strategy has one core per replica"):
    strategy.experimental_shard({"w": np.zeros((2, 2))}, layout_map=layout_map)
  with pytest.raises(ValueError, match=r"strategy.run: a LayoutMap .* one core per replica"):
    strategy.run(lambda w: w, (np.zeros((2, 2)),), options=tpustrat.RunOptions(experimental_layout_map=layout_map))


def test_bad_results_for_the_layout_map_are_errors_naming_the_result(s42):
  w = s42.experimental_shard({"w": np.ones((8, 6), np.float32)}, layout_map=LayoutMap({"w": [1, 2]}))

  def run(step, layout_map, args=(w,)):
    return s42.run(step, args, options=tpustrat.RunOptions(experimental_layout_map=layout_map))

  # Anchored, the pattern misses the result [0]['w'].
  with pytest.raises(ValueError, match=r"no pattern of the LayoutMap \('\^\[0\]w'\) matches a result of the step "
                                       r"\(results: \[0\]\['w'\], \[1\]\)"):
    run(lambda p: (p, jnp.sum(p["w"])), LayoutMap({r"^[0]w": [1, 2]}))
  with pytest.raises(ValueError, match=r"the leaf at \[0\]\['w'\] is matched by 2 patterns"):
    run(lambda p: (p, 1.0), LayoutMap({"w": [1, 2], r"\[0\]": [2, 1]}))
  with pytest.raises(ValueError, match=r"leaf at \['w_sum'\] \(shape \[\]\) matches the LayoutMap pattern 'w', whose "
                                       r"layout \[1, 2\] has 2 entries"):
    run(lambda p: {"w": p["w"], "w_sum": jnp.sum(p["w"])}, LayoutMap({"w": [1, 2]}))
  sharded = s42.experimental_shard({"v": np.ones((8, 6), np.float32)}, lambda *_: 0)
  with pytest.raises(ValueError, match=r"the result at \['v'\] is a sharded value .* and matches the LayoutMap "
                                       r"pattern 'v'"):
    run(lambda p: p, LayoutMap({"v": [1, 2]}), (sharded,))
  with pytest.raises(TypeError, match="experimental_layout_map must be a tpustrat.LayoutMap or None"):
    tpustrat.RunOptions(experimental_layout_map={"w": [1, 2]})


def test_a_per_replica_result_keeps_its_layout_on_the_cores(s42):
  x = np.arange(4 * 2 * 6, dtype=np.float32).reshape(4, 2, 6)
  xs = s42.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group])
  out = s42.run(lambda v: {"act": v * 2.0}, (xs,),
                options=tpustrat.RunOptions(experimental_layout_map=LayoutMap({"act": [1, 2]})))
  arr = leaf(out["act"])
  assert arr.sharding.is_equivalent_to(NamedSharding(s42.mesh, P("replica", None, "core_0")), 3)
  np.testing.assert_array_equal(np.stack(out["act"].values), 2 * x)


def test_layout_map_is_an_ordered_mapping_with_keras_lookup():
  layout_map = LayoutMap({r"dense.*kernel": [1, 2]})
  layout_map[r"dense.*bias"] = [2]
  layout_map["head"] = None
  assert list(layout_map) == ["dense.*kernel", "dense.*bias", "head"] and len(layout_map) == 3
  assert layout_map["['dense1']['kernel']"] == (1, 2) and layout_map["['dense1']['bias']"] == (2,)
  assert layout_map["['other']"] is None and layout_map["head"] is None
  assert "head" in layout_map and "['dense1']['kernel']" not in layout_map  # `in` is over the patterns
  with pytest.raises(ValueError, match=r"the leaf at \['dense1'\]\['kernel_bias'\] is matched by 2 patterns"):
    layout_map["['dense1']['kernel_bias']"]  # noqa: B018 (a lookup that raises)
  del layout_map["head"]
  assert list(layout_map) == ["dense.*kernel", "dense.*bias"]
  with pytest.raises(ValueError, match="already has the layout"):
    layout_map["dense.*bias"] = [1]
  with pytest.raises(ValueError, match="is not a regular expression"):
    LayoutMap({"(": [1]})
  with pytest.raises(TypeError, match="must be a list of ints"):
    LayoutMap({"w": 2})
  with pytest.raises(ValueError, match=r"LayoutMap: `\['w'\]\[1\]` must be an int >= 1, got 0"):
    LayoutMap({"w": [1, 0]})
  with pytest.raises(TypeError, match="a key must be a regular expression"):
    LayoutMap({1: [1]})


def test_reading_a_split_value_twice_compiles_once(s42, rng):
  # A Mirrored split over a replica's logical cores gives each replica the whole value: its parts are
  # copied together by one program, compiled the first time only (it was traced, lowered and looked up
  # again at every read).
  params = mlp_params(rng)
  layout_map = mlp_layout(2)
  state = s42.experimental_shard(params, layout_map=layout_map)
  kernel = state["dense1"]["kernel"]
  assert leaf(kernel).addressable_shards[0].data.shape == (16, 32)  # split over the 2 cores
  first, _ = compiled_programs(lambda: kernel.values)
  again, names = compiled_programs(lambda: kernel.values)
  assert names == [], names
  assert len(again) == s42.num_replicas_in_sync
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a, params["dense1"]["kernel"])
    np.testing.assert_array_equal(b, params["dense1"]["kernel"])
