"""Logical devices inside a replica: split / replicate / assign annotations are real, and `run` keeps its
semantics on a replicas x logical-cores mesh (4 x 2 and 1 x 8 on 8 CPU devices).

"Real" is checked on the program XLA compiles and on the arrays `run` returns: a split tensor is held as
1/k tiles by the right logical devices, its operations run on tiles, and an assigned computation sits in
the branch of a conditional on the core index that only the chosen core takes.

Float results are compared with a tolerance scaled to what they are computed from: a reduction (a matmul,
a sum) by its terms' magnitudes (`sum_atol`), since XLA may add them in any order and an element near zero
then differs by rounding of the terms, not of the result.
"""

import re
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tpustrat
from tpustrat._src import logical
from tpustrat._src.values import Mirrored, PerReplica


@pytest.fixture(scope="module")
def topology():
  return tpustrat.initialize_tpu_system()


@pytest.fixture(scope="module")
def da42(topology):
  return tpustrat.DeviceAssignment.build(topology, computation_shape=[1, 1, 2], num_replicas=4)


@pytest.fixture(scope="module")
def da18(topology):
  return tpustrat.DeviceAssignment.build(topology, computation_shape=[2, 2, 2], num_replicas=1)


@pytest.fixture(scope="module")
def s42(da42):
  return tpustrat.TPUStrategy(device_assignment=da42)


@pytest.fixture(scope="module")
def s18(da18):
  return tpustrat.TPUStrategy(device_assignment=da18)


def per_replica(strategy, arr):
  return strategy.experimental_distribute_values_from_function(lambda ctx: arr[ctx.replica_id_in_sync_group])


def sum_atol(abs_terms_sum, rtol=1e-5):
  """An absolute tolerance for a float32 reduction: `rtol` times the largest sum of its terms' magnitudes
  (for ``a @ b``: ``abs(a) @ abs(b)``). Summed in another order, an element whose terms cancel differs by
  rounding at that scale, however close to zero it is."""
  return rtol * float(np.max(abs_terms_sum))


def lowered(strategy, fn, args):
  """The lowered program `strategy.run(fn, args)` used (run it first)."""
  leaves, in_tree = jax.tree.flatten((tuple(args), {}))
  engine = strategy._engine
  (program, targets), = [entry for (key, tree), entry in engine._entries.items()  # the cache holds fn weakly
                         if tree == in_tree and (key() if isinstance(key, weakref.ref) else key) is fn]
  return program._flat.lower(*[engine._place(x, t) for x, t in zip(leaves, targets)])


def compiled_hlo(strategy, fn, args):
  """The optimized, partitioned HLO of the program `strategy.run(fn, args)` used (run it first)."""
  return lowered(strategy, fn, args).compile().as_text()


def replica_groups(hlo_line):
  """The replica groups of one collective in HLO text, as lists of device indices. XLA prints them as an
  explicit list, ``replica_groups={{0,1},{2,3}}`` (JAX 0.10.2), as an iota, ``replica_groups=[2,2]<=[4]``
  (optionally transposed: ``[2,2]<=[2,2]T(1,0)``), or as mesh axes, ``replica_groups=mesh['a'=2,'b'=2] {'b'}``
  (JAX 0.12: the devices that differ only along the named axes; after the mesh, an explicit device order
  in parentheses when it is not 0, 1, 2, ...)."""
  m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", hlo_line)
  if m:
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", hlo_line)
  if m:
    shape, dims = [int(d) for d in m.group(1).split(",")], [int(d) for d in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    return ids.reshape(shape).tolist()
  m = re.search(r"replica_groups=@?mesh[\[<]([^\]>]*)[\]>](\([^)]*\))?\s*\{([^}]*)\}", hlo_line)
  assert m, f"unknown replica_groups format: {hlo_line}"
  axes = re.findall(r"'?([\w.\-]+)'?=(\d+)", m.group(1))
  names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
  grouped = [g.strip().strip("'") for g in m.group(3).split(",")]
  assert all(g in names for g in grouped), f"sub-axes are not parsed: {hlo_line}"
  ids = (np.asarray([int(d) for d in re.findall(r"\d+", m.group(2))]) if m.group(2)
         else np.arange(int(np.prod(sizes)))).reshape(sizes)
  order = [i for i, a in enumerate(names) if a not in grouped] + [names.index(g) for g in grouped]
  return ids.transpose(order).reshape(-1, int(np.prod([sizes[names.index(g)] for g in grouped]))).tolist()


def test_replica_groups_reads_every_format():
  want = [[0, 1], [2, 3], [4, 5], [6, 7]]
  assert replica_groups("all-reduce(%x), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add") == want
  assert replica_groups("all-reduce(%x), replica_groups=[4,2]<=[8], to_apply=%add") == want
  assert replica_groups("all-reduce(%x), replica_groups=mesh['replica'=4,'core_0'=2] {'core_0'}, to") == want
  transposed = [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert replica_groups("replica_groups=[2,4]<=[4,2]T(1,0), to_apply") == transposed
  assert replica_groups("replica_groups=mesh['replica'=4,'core_0'=2] {'replica'}, to_apply") == transposed
  assert replica_groups("replica_groups=mesh['a'=2,'b'=2]([[0,2],[1,3]]) {'b'}, to_apply") == [[0, 2], [1, 3]]


def computations(hlo):
  """name -> text of every computation of an HLO module; the entry is also under 'ENTRY'."""
  out = {}
  for block in re.split(r"\n(?=(?:ENTRY )?%\S+ \()", hlo):
    m = re.match(r"(ENTRY )?%(\S+) \(", block)
    if m:
      out[m.group(2)] = block
      if m.group(1):
        out["ENTRY"] = block
  return out


def reachable(comps, start, *, through_branches):
  """Computations called from `start` (fusions, reductions, loops; conditional branches if asked)."""
  seen, todo = set(), [start]
  while todo:
    name = todo.pop()
    if name in seen or name not in comps:
      continue
    seen.add(name)
    text = comps[name]
    todo += re.findall(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)", text)
    if through_branches:
      for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
        todo += re.findall(r"%([\w.\-]+)", group)
  return seen


def ops_in(comps, names, op):
  return [line for n in names for line in comps[n].splitlines() if re.search(rf"\s{op}\(", line)]


# -- split ---------------------------------------------------------------------------------------------


def test_split_4x2_each_logical_device_holds_half(s42, da42, rng):
  x = rng.normal(size=(4, 4, 8)).astype(np.float32)

  def step(v):
    return s42.experimental_split_to_logical_devices(jnp.sin(v), [1, 2])

  out = s42.run(step, args=(per_replica(s42, x),))
  assert isinstance(out, PerReplica)
  arr = jax.tree.leaves(out)[0]
  assert arr.shape == (4, 4, 8) and arr.sharding.spec == jax.sharding.PartitionSpec("replica", None, "core_0")
  by_device = {s.device: s for s in arr.addressable_shards}
  for r in range(4):
    for l in range(2):
      shard = by_device[da42.tpu_device(r, l)]
      assert shard.data.shape == (1, 4, 4)  # 1/2 of the replica's [4, 8] component
      assert shard.index[0] == slice(r, r + 1) and shard.index[2] == slice(4 * l, 4 * l + 4)
      np.testing.assert_allclose(shard.data[0], np.sin(x[r])[:, 4 * l:4 * l + 4], rtol=1e-6, atol=1e-7)
  hlo = compiled_hlo(s42, step, (per_replica(s42, x),))
  assert re.search(r"f32\[1,4,4\]\{[\d,]+\} (sine|fusion)\(", hlo)  # the sine runs on tiles
  assert not re.search(r"f32\[1,4,8\]\{[\d,]+\} sine\(", hlo)


def test_split_1x8_follows_tf_tile_assignment(s18, da18, rng):
  images = rng.normal(size=(2, 8, 16, 3)).astype(np.float32)

  def step(x):
    return s18.experimental_split_to_logical_devices(x * 2.0, [1, 2, 4, 1])

  out = s18.run(step, args=(images,))
  assert isinstance(out, Mirrored)  # equal across the (one) replica: invariant over 'replica'
  arr = jax.tree.leaves(out)[0]
  tiles = np.arange(8).reshape(1, 2, 4, 1)  # TF: tile at position t lives on logical core tiles[t]
  by_device = {s.device: s for s in arr.addressable_shards}
  for l in range(8):
    _, i, j, _ = (int(a[0]) for a in np.nonzero(tiles == l))
    shard = by_device[da18.tpu_device(0, l)]
    assert shard.data.shape == (2, 4, 4, 3)  # 1/8 of the image batch
    assert shard.index[1] == slice(4 * i, 4 * i + 4) and shard.index[2] == slice(4 * j, 4 * j + 4)
    np.testing.assert_allclose(shard.data, 2 * images[:, 4 * i:4 * i + 4, 4 * j:4 * j + 4], rtol=1e-6)
  np.testing.assert_allclose(out.values[0], 2 * images, rtol=1e-6)  # whole value per replica


def test_split_annotation_is_in_the_program(s18):
  def step(x):
    return jnp.tanh(s18.experimental_split_to_logical_devices(x, [1, 2, 4, 1]))

  args = (np.ones((2, 8, 16, 3), np.float32),)
  s18.run(step, args=args)
  text = lowered(s18, step, args).as_text()
  assert re.search(r'sharding_constraint .*\[\{\}, \{"core_0"\}, \{"core_1", "core_2"\}, \{\}\]', text)
  hlo = compiled_hlo(s18, step, args)
  assert re.search(r"f32\[2,4,4,3\]\{[\d,]+\} (tanh|fusion)\(", hlo)


def test_partition_spec_for_non_power_of_two_core_counts():
  names, sizes = ["core_0", "core_1", "core_2"], [2, 2, 3]  # 12 cores
  assert logical.partition_spec([1, 4, 3], names, sizes) == jax.sharding.PartitionSpec(None, ("core_0", "core_1"), "core_2")
  # [3, 4] cannot take consecutive axes (2 then 2*3): a valid tiling in another order.
  assert logical.partition_spec([3, 4], names, sizes) == jax.sharding.PartitionSpec("core_2", ("core_0", "core_1"))


# -- replicate -----------------------------------------------------------------------------------------


def test_replicate_gathers_a_split_tensor_on_every_logical_device(s18, rng):
  x = rng.normal(size=(8, 8)).astype(np.float32)

  def step(v):
    tiles = jnp.exp(s18.experimental_split_to_logical_devices(v, [2, 4]))
    return s18.experimental_replicate_to_logical_devices({"a": tiles, "b": 1.0})

  out = s18.run(step, args=(x,))
  arr = jax.tree.leaves(out["a"])[0]
  assert arr.sharding.is_fully_replicated
  assert all(s.data.shape == (8, 8) for s in arr.addressable_shards)
  np.testing.assert_allclose(out["a"].values[0], np.exp(x), rtol=1e-6)
  hlo = compiled_hlo(s18, step, (x,))
  assert re.search(r"f32\[4,2\]\{[\d,]+\} (exponential|fusion)\(", hlo)  # computed on tiles ...
  assert "all-gather" in hlo or "all-reduce" in hlo  # ... then gathered


# -- assign --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("core", [0, 1])
def test_assign_computes_only_on_the_chosen_logical_device(s42, rng, core):
  x = rng.normal(size=(4, 4, 8)).astype(np.float32)
  w = rng.normal(size=(8, 8)).astype(np.float32)

  def step(v, w):
    h = jnp.tanh(v @ w)                                   # used only on the way to the assigned tensor
    z = s42.experimental_assign_to_logical_device(jnp.sin(h) * 3.0, core)
    return z + 1.0

  step.__name__ = f"step_on_core_{core}"
  args = (per_replica(s42, x), w)
  out = s42.run(step, args=args)
  # sin(tanh(.)) * 3 changes by at most 3x what it is given: the matmul's rounding, scaled.
  np.testing.assert_allclose(np.stack(out.values), np.sin(np.tanh(x @ w)) * 3 + 1, rtol=1e-5,
                             atol=3 * sum_atol(np.abs(x) @ np.abs(w)))
  comps = computations(compiled_hlo(s42, step, args))
  entry = comps["ENTRY"]
  (branches,) = re.findall(r"conditional\(([^)]*)\), branch_computations=\{%([\w.\-]+), %([\w.\-]+)\}", entry)
  false_branch, true_branch = branches[1], branches[2]  # lax.cond: branch 1 is the predicate's True
  outside = reachable(comps, "ENTRY", through_branches=False)
  for op in ("dot", "tanh", "sine"):
    assert not ops_in(comps, outside, op), op             # not computed outside the conditional
    assert ops_in(comps, reachable(comps, true_branch, through_branches=True), op), op
    assert not ops_in(comps, reachable(comps, false_branch, through_branches=True), op), op
  assert "partition-id()" in entry                         # the predicate: this core's index == core
  # The broadcast stays in the replica: an all-reduce over each replica's two cores. (The values above
  # already show it: a sum over other replicas would add their results.)
  reduces = [line for line in entry.splitlines() if re.search(r"\sall-reduce(-start)?\(", line)]
  assert reduces, entry
  for line in reduces:
    assert replica_groups(line) == [[0, 1], [2, 3], [4, 5], [6, 7]], line


def test_assign_places_only_what_serves_the_tensor(s42, rng):
  x = rng.normal(size=(4, 4, 8)).astype(np.float32)

  def step(v):
    h = jnp.tanh(v)                                       # also returned: stays where it was
    z = s42.experimental_assign_to_logical_device(jnp.sin(h), 1)
    return h, z * 2.0

  args = (per_replica(s42, x),)
  h, z = s42.run(step, args=args)
  np.testing.assert_allclose(np.stack(z.values), 2 * np.sin(np.tanh(x)), rtol=1e-6, atol=1e-7)
  comps = computations(compiled_hlo(s42, step, args))
  outside = reachable(comps, "ENTRY", through_branches=False)
  assert ops_in(comps, outside, "tanh") and not ops_in(comps, outside, "sine")


def test_assign_keeps_values_bit_exact(s42):
  def step():
    f = jnp.asarray([-0.0, 0.0, jnp.nan, -jnp.inf, 1.5], jnp.float32)
    i = jnp.arange(5, dtype=jnp.int32) - 2
    b = jnp.asarray([True, False, True, True, False])
    return s42.experimental_assign_to_logical_device({"f": f * 1.0, "i": i * 3, "b": ~b}, 1)

  out = s42.run(step)
  f = np.asarray(out["f"].values[0])
  assert np.array_equal(np.signbit(f), [True, False, False, True, False]) and np.isnan(f[2])
  np.testing.assert_array_equal(out["i"].values[0], [-6, -3, 0, 3, 6])
  np.testing.assert_array_equal(out["b"].values[0], [False, True, False, False, True])


def test_assign_of_an_argument_returns_it_unchanged(s42, rng):
  """An argument has no computation in the step to place: documented, and no conditional is added."""
  x = rng.normal(size=(4, 3)).astype(np.float32)

  def step(v):
    return s42.experimental_assign_to_logical_device(v, 1) * 2.0

  args = (per_replica(s42, x),)
  out = s42.run(step, args=args)
  np.testing.assert_allclose(np.stack(out.values), 2 * x)
  assert "conditional" not in compiled_hlo(s42, step, args)


def test_assign_with_gradients(s42, rng):
  x = rng.normal(size=(4, 2, 8)).astype(np.float32)
  w = rng.normal(size=(8,)).astype(np.float32)

  def loss(w, v):
    return jnp.sum(s42.experimental_assign_to_logical_device(jnp.tanh(v * w), 0)) / 8.0

  def step(w, v):
    return jax.grad(loss)(w, v)

  g = s42.run(step, args=(w, per_replica(s42, x)))
  assert isinstance(g, Mirrored)  # gradient w.r.t. replicated w: summed over replicas
  terms = np.stack([(1 - np.tanh(x[r] * w) ** 2) * x[r] / 8.0 for r in range(4)])  # [replica, row, 8]
  np.testing.assert_allclose(g.values[0], terms.sum((0, 1)), rtol=1e-5,
                             atol=sum_atol(np.abs(terms).sum((0, 1))))


def test_assign_inside_a_nested_jit_or_checkpoint_is_placed(s42, rng):
  x = rng.normal(size=(4, 6)).astype(np.float32)

  def step_jit(v):
    return jax.jit(lambda y: s42.experimental_assign_to_logical_device(jnp.cos(y) * 2.0, 1))(v)

  def step_checkpoint(v):
    return jax.checkpoint(lambda y: s42.experimental_assign_to_logical_device(jnp.cos(y) * 2.0, 1))(v)

  args = (per_replica(s42, x),)
  for step in (step_jit, step_checkpoint):
    out = s42.run(step, args=args)
    np.testing.assert_allclose(np.stack(out.values), np.cos(x) * 2.0, rtol=1e-6, atol=1e-7)
    comps = computations(compiled_hlo(s42, step, args))
    assert not ops_in(comps, reachable(comps, "ENTRY", through_branches=False), "cosine"), step.__name__
    assert ops_in(comps, reachable(comps, "ENTRY", through_branches=True), "cosine"), step.__name__


def test_assign_inside_a_scan_is_placed_every_iteration(s42, rng):
  x = rng.normal(size=(4, 6)).astype(np.float32)
  ts = np.arange(1.0, 4.0, dtype=np.float32)

  def step(v):
    def body(c, t):
      z = s42.experimental_assign_to_logical_device(jnp.tanh(c * t), 1)
      return z + 1.0, z.sum()
    return lax.scan(body, v, ts)

  args = (per_replica(s42, x),)
  carry, ys = s42.run(step, args=args)
  want_c, want_y = x.copy(), []
  for t in ts:
    z = np.tanh(want_c * t)
    want_y.append(z.sum(axis=1))
    want_c = z + 1.0
  np.testing.assert_allclose(np.stack(carry.values), want_c, rtol=1e-5, atol=1e-6)
  # sums of 6 values of tanh, |tanh| < 1
  np.testing.assert_allclose(np.stack(ys.values), np.stack(want_y, axis=1), rtol=1e-5, atol=sum_atol(6.0))
  comps = computations(compiled_hlo(s42, step, args))
  assert "while(" in comps["ENTRY"] or any("while(" in c for c in comps.values())  # still a loop
  assert not ops_in(comps, reachable(comps, "ENTRY", through_branches=False), "tanh")  # only in a branch
  assert ops_in(comps, reachable(comps, "ENTRY", through_branches=True), "tanh")


def test_gradient_through_a_scan_with_assign(s42, rng):
  x = rng.normal(size=(4, 6)).astype(np.float32)

  def step(v):
    def loss(v):
      def body(c, t):
        return s42.experimental_assign_to_logical_device(jnp.tanh(c * t), 0), None
      c, _ = lax.scan(body, v, jnp.arange(1.0, 3.0))
      return c.sum()
    return jax.grad(loss)(v)

  g = s42.run(step, args=(per_replica(s42, x),))
  a = np.tanh(x * 1.0)  # d/dv sum(tanh(2 tanh(v))) = (1 - tanh(2a)^2) * 2 * (1 - a^2)
  np.testing.assert_allclose(np.stack(g.values), (1 - np.tanh(2 * a) ** 2) * 2 * (1 - a ** 2), rtol=1e-5, atol=1e-6)


def test_assign_inside_cond_or_while_is_an_error_not_a_no_op(s42):
  def step_cond(x):
    return lax.cond(x > 0, lambda y: s42.experimental_assign_to_logical_device(y * 2.0, 1), lambda y: y, x)

  def step_while(x):
    return lax.while_loop(lambda c: c < 10.0, lambda c: s42.experimental_assign_to_logical_device(c * 2.0, 1), x)

  for step in (step_cond, step_while):
    with pytest.raises(NotImplementedError, match="lax.cond, lax.while_loop"):
      s42.run(step, args=(1.0,))


def test_assign_of_a_control_flow_result_is_an_error(s42):
  def step(x):
    y = lax.fori_loop(0, 3, lambda i, c: c * 2.0, x)
    return s42.experimental_assign_to_logical_device(y, 1)

  with pytest.raises(ValueError, match="cannot run on one logical device"):
    s42.run(step, args=(1.0,))


def test_assign_calls_through_jit_and_custom_jvp_are_inlined(s42, rng):
  x = rng.normal(size=(4, 6)).astype(np.float32)

  def step(v):
    z = s42.experimental_assign_to_logical_device(jax.nn.relu(jnp.clip(jax.jit(jnp.cos)(v), -0.5, 0.5)), 1)
    return z

  args = (per_replica(s42, x),)
  out = s42.run(step, args=args)
  np.testing.assert_allclose(np.stack(out.values), np.maximum(np.clip(np.cos(x), -0.5, 0.5), 0), rtol=1e-6,
                             atol=1e-7)
  comps = computations(compiled_hlo(s42, step, args))
  assert not ops_in(comps, reachable(comps, "ENTRY", through_branches=False), "cosine")


# -- bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dims, match", [
    ([1, 2, 1], r"Length of `partition_dimensions` \(3\) must be equal to the rank of `tensor` \(2\)"),
    ([2, 1], r"Tensor shape at dimension \(0\) must be divisible by corresponding value specified by `partition_dimensions` \(2\)"),
    ([1, 1], r"Number of logical devices \(2\) does not match the number of partition splits specified \(1\)"),
    ([1, 4], r"Number of logical devices \(2\) does not match the number of partition splits specified \(4\)"),
    ([0, 2], r"`partition_dimensions\[0\]` must be an int >= 1, got 0"),
    ([1.0, 2], r"`partition_dimensions\[0\]` must be an int >= 1, got float 1.0"),
    ("12", "list of ints"),
])
def test_split_errors(s42, dims, match):
  def step(x):
    return s42.experimental_split_to_logical_devices(x, dims)

  with pytest.raises(TypeError if isinstance(dims[0], float) else ValueError, match=match):
    s42.run(step, args=(np.ones((3, 4), np.float32),))


@pytest.mark.parametrize("core", [2, -1, 1.0, True])
def test_assign_errors(s42, core):
  error = ValueError if type(core) is int else TypeError
  with pytest.raises(error, match="logical device id|`logical_device_id` must be an int"):
    s42.run(lambda x: s42.experimental_assign_to_logical_device(x * 1.0, core), args=(1.0,))


def test_annotations_need_run_of_the_same_strategy(s42, s18):
  with pytest.raises(RuntimeError, match="inside|in the function given to strategy.run"):
    s42.experimental_split_to_logical_devices(jnp.ones((2, 2)), [1, 2])
  with pytest.raises(RuntimeError, match="strategy.run of the same strategy"):
    s18.run(lambda x: s42.experimental_replicate_to_logical_devices(x), args=(1.0,))
  with pytest.raises(RuntimeError):
    s42.experimental_assign_to_logical_device(1.0, 0)


def test_one_core_per_replica(strategy):
  """With one logical device per replica only the trivial annotations exist (TF's checks still apply)."""
  def step(x):
    y = strategy.experimental_split_to_logical_devices(x, [1, 1])
    y = strategy.experimental_replicate_to_logical_devices(y)
    return strategy.experimental_assign_to_logical_device(y * 2.0, 0)

  out = strategy.run(step, args=(np.ones((2, 2), np.float32),))
  np.testing.assert_allclose(out.values[0], 2 * np.ones((2, 2)))
  with pytest.raises(ValueError, match=r"Number of logical devices \(1\)"):
    strategy.run(lambda x: strategy.experimental_split_to_logical_devices(x, [1, 2]), args=(np.ones((2, 2)),))
  with pytest.raises(ValueError, match="Received logical device id 1 but there are only total of 1"):
    strategy.run(lambda x: strategy.experimental_assign_to_logical_device(x, 1), args=(1.0,))


# -- run on a replicas x cores mesh ----------------------------------------------------------------------


def test_mirrored_and_per_replica_are_decided_by_the_replica_axis_only(s42, rng):
  x = rng.normal(size=(4, 4, 8)).astype(np.float32)
  w = rng.normal(size=(8, 8)).astype(np.float32)

  def step(v, w):
    w_tiles = s42.experimental_split_to_logical_devices(w, [1, 2])  # varies over cores, not replicas
    y = v @ w_tiles
    ctx = tpustrat.get_replica_context()
    return w_tiles * 2.0, y, ctx.all_reduce("sum", y), ctx.replica_id_in_sync_group

  w2, y, total, rid = s42.run(step, args=(per_replica(s42, x), w))
  assert isinstance(w2, Mirrored) and isinstance(total, Mirrored)
  assert isinstance(y, PerReplica) and isinstance(rid, PerReplica)
  assert jax.tree.leaves(w2)[0].sharding.spec == jax.sharding.PartitionSpec(None, "core_0")  # kept split
  assert len(w2.values) == 4 and all(v.shape == (8, 8) for v in w2.values)  # one whole copy per replica
  np.testing.assert_array_equal(w2.values[3], 2 * w)  # exact
  # Matmuls and sums of them: each element within rounding of its terms' magnitudes (a near-zero element
  # differs by ~1e-7 when XLA:CPU adds the split contraction in another order).
  xw, abs_xw = x.astype(np.float64) @ w, np.abs(x).astype(np.float64) @ np.abs(w)  # [replica, 4, 8]
  np.testing.assert_allclose(np.stack(y.values), xw, rtol=1e-5, atol=sum_atol(abs_xw))
  np.testing.assert_allclose(total.values[0], xw.sum(0), rtol=1e-5, atol=sum_atol(abs_xw.sum(0)))
  assert np.asarray(rid.values).tolist() == [0, 1, 2, 3]
  everything = float(s42.reduce("SUM", total, axis=None).sum())  # 4 replicas' copies of the total
  assert everything == pytest.approx(4 * xw.sum(), rel=1e-5, abs=sum_atol(4 * abs_xw.sum()))
  np.testing.assert_allclose(s42.gather(y, axis=0), xw.reshape(16, 8), rtol=1e-5, atol=sum_atol(abs_xw))


def test_split_state_stays_split_and_the_step_is_traced_once(s42, rng):
  x = rng.normal(size=(4, 4, 8)).astype(np.float32)
  traces = []

  def step(w, v):
    traces.append(1)
    w = s42.experimental_split_to_logical_devices(w, [1, 2])
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(v @ w)) / 16.0)(w)
    return w - 0.1 * g

  w_np = np.eye(8, dtype=np.float32)
  w = w_np
  xs = per_replica(s42, x)
  for _ in range(4):
    w = s42.run(step, args=(w, xs))
    assert jax.tree.leaves(w)[0].sharding.spec == jax.sharding.PartitionSpec(None, "core_0")
  assert len(traces) == 1
  ref, scale = w_np.astype(np.float64), np.abs(w_np).astype(np.float64)
  for _ in range(4):
    g = sum(x[r].T @ (1 - np.tanh(x[r] @ ref) ** 2) for r in range(4)) / 16.0
    ref = ref - 0.1 * g
    scale = scale + 0.1 * sum(np.abs(x[r]).T @ np.ones((4, 8)) for r in range(4)) / 16.0  # |g| <= this
  np.testing.assert_allclose(w.values[0], ref, rtol=1e-5, atol=sum_atol(scale))


def test_values_from_function_and_datasets_on_logical_cores(s42, da42):
  v = s42.experimental_distribute_values_from_function(lambda ctx: np.full((3,), ctx.replica_id_in_sync_group))
  arr = jax.tree.leaves(v)[0]
  for r in range(4):
    for l in range(2):
      (shard,) = [s for s in arr.addressable_shards if s.device == da42.tpu_device(r, l)]
      assert shard.data.tolist() == [[r, r, r]]
  ds = [np.arange(16.0).reshape(8, 2) + 100 * i for i in range(2)]
  sums = [float(s42.reduce("SUM", s42.run(lambda b: jnp.sum(b), args=(batch,)), axis=None))
          for batch in s42.experimental_distribute_dataset(ds)]
  assert sums == [120.0, 120.0 + 1600.0]
  assert [len(b.values) for b in s42.experimental_distribute_dataset(ds)] == [4, 4]


def test_assign_of_prng_keys_is_an_error(s42):
  def step(x):
    key = s42.experimental_assign_to_logical_device(jax.random.fold_in(jax.random.key(0), 3), 1)
    return jax.random.normal(key, (2,)) + x

  with pytest.raises(ValueError, match="key"):
    s42.run(step, args=(1.0,))


def test_grouped_collectives_over_replicas_with_logical_cores(s42):
  import tpustrat.ops  # noqa: F401  # pylint: disable=import-outside-toplevel

  x = per_replica(s42, np.arange(16, dtype=np.float32).reshape(4, 4))

  def step(v):
    v = s42.experimental_split_to_logical_devices(v, [2])
    return tpustrat.ops.cross_replica_sum(v, [[0, 2], [1, 3]]), tpustrat.ops.all_gather(v, [[0, 1], [2, 3]], 0)

  summed, gathered = s42.run(step, args=(x,))
  rows = np.arange(16, dtype=np.float32).reshape(4, 4)
  # integer-valued floats: sums are exact in any order
  np.testing.assert_array_equal(np.stack(summed.values), rows[[0, 1, 0, 1]] + rows[[2, 3, 2, 3]])
  np.testing.assert_array_equal(gathered.values[3], rows[2:].reshape(-1))


def test_spec_examples_on_4_replicas_of_2_logical_devices(s42, rng):
  """TF's `experimental_assign_to_logical_device` and `experimental_replicate_to_logical_devices` examples."""
  inputs = rng.normal(size=(4, 2, 8, 8, 3)).astype(np.float32)

  def assign_step(inputs):
    output = jnp.add(inputs, inputs)
    return s42.experimental_assign_to_logical_device(output, 0)  # the add runs on logical device 0

  args = (per_replica(s42, inputs),)
  np.testing.assert_allclose(np.stack(s42.run(assign_step, args=args).values), 2 * inputs)
  comps = computations(compiled_hlo(s42, assign_step, args))
  adds = ops_in(comps, reachable(comps, "ENTRY", through_branches=False), "add")
  assert not [a for a in adds if "f32[" in a]  # only the u32 adds of the broadcast's all-reduce

  labels = rng.integers(0, 3, size=(4, 2)).astype(np.int32)

  def replicate_step(images, labels):
    images = s42.experimental_split_to_logical_devices(images, [1, 2, 1, 1])
    output = jnp.mean(images, axis=(1, 2)) @ jnp.ones((3, 3), jnp.float32)
    labels = s42.experimental_replicate_to_logical_devices(labels)
    output = s42.experimental_replicate_to_logical_devices(output)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(output), labels[:, None], axis=1))

  loss = s42.run(replicate_step, args=(per_replica(s42, inputs), per_replica(s42, labels)))
  assert np.all(np.isfinite(np.asarray(loss.values)))
  # The docs' snippet splits [1, 2, 4, 1] with 2 logical devices: an error in TF and here.
  with pytest.raises(ValueError, match=r"Number of logical devices \(2\) does not match .* \(8\)"):
    s42.run(lambda x: s42.experimental_split_to_logical_devices(x, [1, 2, 4, 1]), args=(per_replica(s42, inputs),))


def test_arguments_keep_their_layout_over_cores_but_not_over_replicas(s42):
  from tpustrat._src.engine import _same_over_replicas  # pylint: disable=import-outside-toplevel

  mesh, P = s42.mesh, jax.sharding.PartitionSpec
  split, replicated = jax.sharding.NamedSharding(mesh, P("replica")), jax.sharding.NamedSharding(mesh, P())
  for spec, per_replica_ok, mirrored_ok in [
      (P("replica", None, "core_0"), True, False),
      (P(("replica",), "core_0"), True, False),
      (P(None, "core_0"), False, True),
      (P("core_0"), False, True),
      (P(None, "replica"), False, False),
      (P(("replica", "core_0")), False, False),
  ]:
    sharding = jax.sharding.NamedSharding(mesh, spec)
    assert _same_over_replicas(sharding, split, "replica") == per_replica_ok, spec
    assert _same_over_replicas(sharding, replicated, "replica") == mirrored_ok, spec
  other = jax.sharding.NamedSharding(jax.sharding.Mesh(mesh.devices.T, ("core_0", "replica")), P())
  assert not _same_over_replicas(other, replicated, "replica")
