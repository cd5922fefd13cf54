"""Input distribution: distributed datasets, partial batches, datasets_from_function, options, errors.

Expected values come from numpy on the same data.
"""

import threading

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, wait_until_read_ahead
from jax.sharding import PartitionSpec as P

import tpustrat
from tpustrat._src.values import Mirrored, PerReplica

N = 8


def ids_batches(num_examples, batch_size):
  """Global batches of example ids: {"id": int32 [b], "x": float32 [b, 3]} with x = id * [1, 2, 3]."""
  ids = np.arange(num_examples, dtype=np.int32)
  return [{"id": ids[i:i + batch_size], "x": ids[i:i + batch_size, None] * np.float32([1, 2, 3])}
          for i in range(0, num_examples, batch_size)]


def local_rows(strategy, value):
  return [np.asarray(v) for v in strategy.experimental_local_results(value)]


def per_example_step(batch):
  """A step returning per-example outputs (marked as such) and this replica's real-row count."""
  return tpustrat.per_example((batch["id"], batch["x"] * 2.0)) + (tpustrat.num_valid_examples(batch),)


# -- row assignment and partial batches ----------------------------------------------------------


def test_replica_r_gets_rows_2r_to_2r_plus_2_of_a_batch_of_16(strategy, rng):
  x = rng.normal(size=(16, 3)).astype(np.float32)
  batch = next(iter(strategy.experimental_distribute_dataset([x])))
  assert isinstance(batch, PerReplica)
  for r, component in enumerate(local_rows(strategy, batch)):
    np.testing.assert_array_equal(component, x[2 * r:2 * r + 2])
  # Inside run, replica r sees the same rows (checked on the devices against its replica id).
  def fn(v):
    r = tpustrat.get_replica_context().replica_id_in_sync_group
    return jnp.all(v == jnp.asarray(x).reshape(N, 2, 3)[r])
  assert all(bool(ok) for ok in strategy.run(fn, args=(batch,)).values)
  # The batch sits on the devices, split over the replica axis, before run is called.
  assert batch.tree.sharding.spec == P("replica") and batch.tree.shape == (N, 2, 3)


def test_partial_batch_of_12_counts_exactly_the_real_examples(strategy):
  batches = ids_batches(28, 16)  # 16 rows, then 12
  traces = []

  def step(batch):
    traces.append(1)
    ctx = tpustrat.get_replica_context()
    mask = tpustrat.valid_mask(batch["x"])
    masked_total = ctx.all_reduce("sum", jnp.sum(jnp.where(mask[:, None], batch["x"], 0.0)))
    return tpustrat.per_example(batch["x"] * 2.0), masked_total, tpustrat.num_valid_examples()

  got = []
  for batch in strategy.experimental_distribute_dataset(batches):
    got.append(strategy.run(step, args=(batch,)) + (batch,))
  assert len(traces) == 1  # the padded partial batch has the full batch's signature: no retrace

  full_out, _, full_n, _ = got[0]
  assert [int(v) for v in full_n.values] == [2] * 8
  np.testing.assert_allclose(strategy.reduce("MEAN", full_out, axis=0), (batches[0]["x"] * 2).mean(0))

  out, total, n, batch = got[1]
  real = batches[1]["x"] * 2.0  # ids 16..27
  assert [int(v) for v in n.values] == [2, 2, 2, 2, 2, 2, 0, 0]
  assert isinstance(total, Mirrored)
  np.testing.assert_allclose(total.values[0], batches[1]["x"].sum(), rtol=1e-6)
  # Local results: exactly the real rows, empty components for replicas 6 and 7.
  for v in (out, batch["x"]):
    rows = local_rows(strategy, v)
    assert [r.shape for r in rows] == [(2, 3)] * 6 + [(0, 3)] * 2
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, out)), real)
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, batch["id"])), np.arange(16, 28))
  # reduce over per-example outputs: SUM of the 12 real examples; MEAN divides by 12 (x 3 columns).
  np.testing.assert_allclose(strategy.reduce("SUM", out, axis=0), real.sum(0), rtol=1e-6)
  np.testing.assert_allclose(strategy.reduce(tpustrat.ReduceOp.MEAN, out, axis=0), real.mean(0), rtol=1e-6)
  np.testing.assert_allclose(strategy.reduce("MEAN", out, axis=1).shape, (2,))
  # gather returns only the real rows, in order.
  np.testing.assert_array_equal(strategy.gather(out, axis=0), real)
  np.testing.assert_array_equal(strategy.gather(batch["id"], axis=0), np.arange(16, 28))


def test_reduce_axis_none_and_inner_axes_of_padded_outputs(strategy, rng):
  x = rng.normal(size=(12, 4)).astype(np.float32)
  dist = strategy.experimental_distribute_dataset([np.zeros((16, 4), np.float32), x])
  batches = list(dist)
  out = strategy.run(lambda v: tpustrat.per_example(v + 1.0), args=(batches[1],))
  padded = np.zeros((16, 4), np.float32)
  padded[:12] = x + 1.0
  comps = padded.reshape(N, 2, 4)
  real = np.arange(16).reshape(N, 2) < 12
  # axis=None: sum over replicas of each component position, padding left out.
  assert_close(strategy.reduce("SUM", out, axis=None), comps.sum(0), scale=np.abs(comps).sum(0))
  assert_close(strategy.reduce("MEAN", out, axis=None), comps.sum(0) / real.sum(0)[:, None],
               scale=np.abs(comps).sum(0) / real.sum(0)[:, None])
  # axis=1 (features): per batch row, over the real elements only.
  assert_close(strategy.reduce("MEAN", out, axis=1), comps.sum((0, 2)) / (real.sum(0) * 4),
               scale=np.abs(comps).sum((0, 2)) / (real.sum(0) * 4))
  with pytest.raises(ValueError, match=r"gather along axis 1 of a padded batch.*\[2, 2, 2, 2, 2, 2, 0, 0\]"):
    strategy.gather(out, axis=1)


def test_batch_not_divisible_by_replicas_uses_ceil(strategy):
  # 20 rows on 8 replicas: k = 3, so replicas 0-5 get 3 rows, replica 6 gets 2, replica 7 none.
  x = np.arange(20, dtype=np.float32)
  batch = next(iter(strategy.experimental_distribute_dataset([x])))
  rows = local_rows(strategy, batch)
  assert [len(r) for r in rows] == [3, 3, 3, 3, 3, 3, 2, 0]
  np.testing.assert_array_equal(np.concatenate(rows), x)
  assert float(strategy.reduce("MEAN", batch, axis=0)) == pytest.approx(x.mean())


def test_padding_information_follows_outputs_into_the_next_run(strategy):
  (_, batch), = [(i, b) for i, b in enumerate(strategy.experimental_distribute_dataset([np.arange(12.0)]))]
  logits = strategy.run(lambda x: tpustrat.per_example(x * 3.0), args=(batch,))
  scores = strategy.run(lambda l: l + tpustrat.num_valid_examples(l).astype(l.dtype), args=(logits,))
  # Batch of 12 as the first batch: k = ceil(12 / 8) = 2, replicas 0-5 hold 2 real rows each.
  np.testing.assert_allclose(strategy.gather(scores, axis=0), np.arange(12.0) * 3 + 2)


def test_run_inside_outer_jit_with_padded_batch(strategy):
  batch = list(strategy.experimental_distribute_dataset([np.ones(16, np.float32), np.ones(12, np.float32)]))[1]

  @jax.jit
  def total(b):
    return strategy.run(
        lambda x: tpustrat.get_replica_context().all_reduce("sum", jnp.sum(jnp.where(tpustrat.valid_mask(x), x, 0))),
        args=(b,))

  assert float(total(batch).values[0]) == 12.0


# -- every example exactly once ---------------------------------------------------------------------


def _epoch_ids(strategy, dist):
  seen, count = [], 0
  for batch in dist:
    ids, _, _ = strategy.run(per_example_step, args=(batch,))
    seen.append(np.asarray(strategy.gather(ids, axis=0)))
    count += int(strategy.reduce("SUM", strategy.run(lambda i: i * 0 + 1, args=(ids,)), axis=0))  # one per row
  return np.concatenate(seen), count


def test_every_example_exactly_once_grain(strategy):
  ds = strategy.experimental_make_numpy_dataset(
      {"id": np.arange(100, dtype=np.int32), "x": np.arange(300, dtype=np.float32).reshape(100, 3)})
  dist = strategy.experimental_distribute_dataset(ds.batch(16))  # 6 batches of 16 and one of 4
  for _ in range(2):  # re-iterable: a second epoch sees everything again
    ids, count = _epoch_ids(strategy, dist)
    np.testing.assert_array_equal(ids, np.arange(100))
    assert count == 100


def test_every_example_exactly_once_plain_iterator(strategy):
  ids, count = _epoch_ids(strategy, strategy.experimental_distribute_dataset(iter(ids_batches(45, 16))))
  np.testing.assert_array_equal(np.sort(ids), np.arange(45))
  assert len(ids) == count == 45


# -- sources ----------------------------------------------------------------------------------------


class _Tensor:
  """Stands in for a torch.Tensor: converts with __array__."""

  def __init__(self, a):
    self._a = np.asarray(a)

  def __array__(self, dtype=None, copy=None):
    return self._a if dtype is None else self._a.astype(dtype)


class TorchStyleLoader:
  """A PyTorch-DataLoader-like object: __iter__ / __len__, batches as [x, y] lists of tensors."""

  def __init__(self, x, y, batch_size):
    self.x, self.y, self.batch_size = x, y, batch_size

  def __len__(self):
    return -(-len(self.x) // self.batch_size)

  def __iter__(self):
    for i in range(0, len(self.x), self.batch_size):
      yield [_Tensor(self.x[i:i + self.batch_size]), _Tensor(self.y[i:i + self.batch_size])]


X = np.arange(40 * 2, dtype=np.float32).reshape(40, 2)
Y = (np.arange(40) % 3).astype(np.int32)


def _sources():
  grain_map = grain.MapDataset.source(np.arange(40)).batch(16).map(lambda i: (X[i], Y[i]))
  return {
      "list": lambda: [(X[i:i + 16], Y[i:i + 16]) for i in range(0, 40, 16)],
      "generator": lambda: ((X[i:i + 16], Y[i:i + 16]) for i in range(0, 40, 16)),
      "grain_map": lambda: grain_map,
      "grain_iter": lambda: grain_map.to_iter_dataset(),
      "torch_style_loader": lambda: TorchStyleLoader(X, Y, 16),
  }


@pytest.mark.parametrize("name", list(_sources()))
def test_sources(strategy, name):
  dist = strategy.experimental_distribute_dataset(_sources()[name]())
  xs, ys = [], []
  for x, y in dist:  # batches keep the source's structure, with PerReplica leaves
    assert isinstance(x, PerReplica) and isinstance(y, PerReplica)
    xs.append(np.asarray(strategy.gather(x, axis=0)))
    ys.append(np.asarray(strategy.gather(y, axis=0)))
  np.testing.assert_array_equal(np.concatenate(xs), X)
  np.testing.assert_array_equal(np.concatenate(ys), Y)
  second_epoch = sum(1 for _ in dist)
  assert second_epoch == (0 if name == "generator" else 3)  # a generator is one-shot


def test_tf_data_dataset(strategy):
  tf = pytest.importorskip("tensorflow")
  ds = tf.data.Dataset.from_tensor_slices({"x": X}).batch(16)
  got = [np.asarray(strategy.gather(b["x"], axis=0)) for b in strategy.experimental_distribute_dataset(ds)]
  np.testing.assert_array_equal(np.concatenate(got), X)


def test_tf_data_partial_batch_tuples_and_epochs(strategy):
  # TF's own usage: (features, labels) tuples, a last batch of 40 % 16 = 8 rows, one pass per epoch.
  tf = pytest.importorskip("tensorflow")
  ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)
  dist = strategy.experimental_distribute_dataset(ds)
  for _ in range(2):  # a tf.data.Dataset is re-iterable: each iter() is a new epoch
    sums, rows = [], []
    for x, y in dist:
      sums.append(float(strategy.reduce("SUM", strategy.run(lambda a: a.sum(axis=1), args=(x,)), axis=0)))
      rows.append(np.asarray(strategy.gather(y, axis=0)))
    np.testing.assert_allclose(sums, [X[i:i + 16].sum() for i in range(0, 40, 16)])
    np.testing.assert_array_equal(np.concatenate(rows), Y)


def test_tf_data_from_function_shards_per_input_pipeline(strategy):
  # TF's pattern for datasets_from_function: shard by input pipeline, batch per replica.
  tf = pytest.importorskip("tensorflow")
  n = strategy.num_replicas_in_sync
  contexts = []

  def dataset_fn(ctx):
    contexts.append(ctx)
    per_replica = ctx.get_per_replica_batch_size(2 * n)
    return (tf.data.Dataset.range(6 * n).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
            .map(lambda i: tf.cast(i, tf.int32)).batch(per_replica))

  dist = strategy.experimental_distribute_datasets_from_function(dataset_fn)
  steps = [[np.asarray(r) for r in strategy.experimental_local_results(b)] for b in dist]
  assert len(contexts) == 1 and contexts[0].num_input_pipelines == 1
  assert len(steps) == 3
  for s, step in enumerate(steps):  # each replica dequeues the next per-replica batch of 2
    for r, rows in enumerate(step):
      first = (s * n + r) * 2
      np.testing.assert_array_equal(rows, [first, first + 1])


# -- iterator protocol, element_spec, options ----------------------------------------------------------


@pytest.mark.parametrize("fetch", [True, False])
def test_iterator_protocol_and_stop_iteration(strategy, fetch):
  dist = strategy.experimental_distribute_dataset(
      ids_batches(20, 16), options=tpustrat.InputOptions(experimental_fetch_to_device=fetch))
  it = iter(dist)
  assert isinstance(it, tpustrat.DistributedIterator) and iter(it) is it
  first = it.get_next()
  second = next(it)
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, first["id"])), np.arange(16))
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, second["id"])), np.arange(16, 20))
  for _ in range(3):  # finished: StopIteration every time, as Python expects
    with pytest.raises(StopIteration):
      next(it)
  leaf = first["x"].tree
  if fetch:
    assert isinstance(leaf, jax.Array) and leaf.sharding.spec == P("replica")
  else:
    assert isinstance(leaf, np.ndarray)  # stays on the host; run transfers it
  ids, x2, _ = strategy.run(per_example_step, args=(second,))
  np.testing.assert_allclose(strategy.gather(x2, axis=0), ids_batches(20, 16)[1]["x"] * 2)


def test_element_spec(strategy):
  dist = strategy.experimental_distribute_dataset(ids_batches(20, 16))
  spec = dist.element_spec
  assert set(spec) == {"id", "x"}
  assert spec["x"].tree == jax.ShapeDtypeStruct((N, 2, 3), jnp.float32, sharding=spec["x"].tree.sharding)
  assert spec["id"].tree.shape == (N, 2) and spec["id"].tree.dtype == jnp.int32
  assert iter(dist).element_spec["x"].tree.shape == (N, 2, 3)
  # A one-shot source: reading element_spec first must not lose the first batch.
  gen = strategy.experimental_distribute_dataset(b for b in ids_batches(20, 16))
  assert gen.element_spec["x"].tree.shape == (N, 2, 3)
  assert [len(np.asarray(strategy.gather(b["id"], axis=0))) for b in gen] == [16, 4]
  # Every batch matches the spec (the partial one is padded to it).
  for batch in dist:
    assert batch["x"].tree.shape == spec["x"].tree.shape
  with pytest.raises(ValueError, match="empty"):
    strategy.experimental_distribute_dataset([]).element_spec  # noqa: B018


def test_drop_remainder_option(strategy):
  options = tpustrat.InputOptions(drop_remainder=True)
  dist = strategy.experimental_distribute_dataset(ids_batches(44, 16), options=options)
  ids, count = _epoch_ids(strategy, dist)
  np.testing.assert_array_equal(ids, np.arange(32))
  assert count == 32
  assert options.experimental_fetch_to_device and options.experimental_per_replica_buffer_size is None


def test_prefetch_buffer_is_bounded_and_thread_stops(strategy):
  pulled = []

  def source():
    for i in range(100):
      pulled.append(i)
      yield np.full((16,), i, np.float32)

  options = tpustrat.InputOptions(experimental_per_replica_buffer_size=3)
  it = iter(strategy.experimental_distribute_dataset(source(), options=options))
  first = next(it)
  wait_until_read_ahead(it)  # 3 batches read ahead
  # One batch handed out, 3 ready in the buffer, at most one more being prepared.
  assert 4 <= len(pulled) <= 5
  assert float(strategy.reduce("MEAN", first, axis=0)) == 0.0
  threads = [t for t in threading.enumerate() if t.name == "tpustrat-input-prefetch"]
  it.close()
  with pytest.raises(StopIteration):
    next(it)
  for t in threads:
    t.join(2.0)
  assert len(pulled) <= 5
  with pytest.raises(ValueError, match="experimental_per_replica_buffer_size"):
    tpustrat.InputOptions(experimental_per_replica_buffer_size=-1)


def test_a_larger_later_batch_grows_the_per_replica_size(strategy):
  dist = strategy.experimental_distribute_dataset([np.arange(8.0), np.arange(24.0)])
  sizes = [(b.tree.shape, float(strategy.reduce("SUM", b, axis=0))) for b in dist]
  assert sizes == [((N, 1), 28.0), ((N, 3), float(np.arange(24).sum()))]


def test_default_strategy_passes_batches_through():
  default = tpustrat.get_strategy()
  assert default.num_replicas_in_sync == 1
  batches = [b for b in default.experimental_distribute_dataset(ids_batches(20, 16))]
  assert [b["id"].shape for b in batches] == [(16,), (4,)]
  np.testing.assert_array_equal(batches[1]["id"], np.arange(16, 20))


# -- datasets_from_function -----------------------------------------------------------------------------


def test_datasets_from_function_each_replica_dequeues_one_batch(strategy):
  contexts = []

  def dataset_fn(ctx):
    contexts.append(ctx)
    b = ctx.get_per_replica_batch_size(16)
    ids = np.arange(37, dtype=np.int32)[ctx.input_pipeline_id::ctx.num_input_pipelines]
    return grain.MapDataset.source(ids).batch(b).map(lambda i: {"id": i, "x": i[:, None] * np.float32([1, 2, 3])})

  dist = strategy.experimental_distribute_datasets_from_function(dataset_fn)
  assert len(contexts) == 1  # one input pipeline per process
  ctx = contexts[0]
  assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, N)
  batches = list(dist)
  assert len(batches) == 3  # 19 batches of 2 (the last one of 1) over 8 replicas: steps of 8, 8, 3
  first = local_rows(strategy, batches[0]["id"])
  for r in range(N):  # replica r got the r-th per-replica batch of the step
    np.testing.assert_array_equal(first[r], [2 * r, 2 * r + 1])
  last = local_rows(strategy, batches[2]["id"])
  assert [len(v) for v in last] == [2, 2, 1, 0, 0, 0, 0, 0]
  ids, count = _epoch_ids(strategy, dist)
  np.testing.assert_array_equal(ids, np.arange(37))
  assert count == 37
  assert strategy.distribute_datasets_from_function is not None  # TF 2.4+ name


# -- make_numpy_dataset -------------------------------------------------------------------------------


def test_make_numpy_dataset(strategy):
  ds = strategy.experimental_make_numpy_dataset(np.ones([10], dtype=np.float32))
  assert isinstance(ds, grain.MapDataset) and len(ds) == 10
  nested = strategy.experimental_make_numpy_dataset(
      ({"a": np.arange(6).reshape(3, 2)}, [np.zeros(2), np.ones(2), np.full(2, 2.0)]))
  a, stacked = nested[2]
  np.testing.assert_array_equal(a["a"], [4, 5])
  np.testing.assert_array_equal(stacked, [2.0, 2.0])  # the list was stacked into a [3, 2] array
  with pytest.raises(ValueError, match=r"same first dimension.*\['x'\]: 3.*\['y'\]: 4"):
    strategy.experimental_make_numpy_dataset({"x": np.zeros(3), "y": np.zeros(4)})


# -- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", [3, None, "abc", object()])
def test_non_iterable_dataset(strategy, dataset):
  with pytest.raises(TypeError, match=r"experimental_distribute_dataset expects a dataset that yields batches"):
    strategy.experimental_distribute_dataset(dataset)


def test_dict_is_a_batch_not_a_dataset(strategy):
  with pytest.raises(TypeError, match="iterating it would give its keys"):
    strategy.experimental_distribute_dataset({"x": np.zeros(16)})


@pytest.mark.parametrize("batch, error, match", [
    ({"x": np.zeros((16, 2)), "y": np.zeros(15)}, ValueError,
     r"different leading \(batch\) sizes \(\['x'\]: 16, \['y'\]: 15\)"),
    ({"x": np.zeros(16), "name": "abc"}, TypeError, r"leaf at \['name'\] is str 'abc', not an array"),
    ((np.zeros(16), 3.0), TypeError, r"leaf at \[1\] is float 3.0, not an array"),
    (np.float32(2.0), TypeError, "is a scalar"),
    (np.array(["a", "b"]), TypeError, "dtype <U1"),
    ({}, TypeError, "holds no arrays"),
])
def test_bad_batches(strategy, batch, error, match):
  for fetch in (True, False):
    it = iter(strategy.experimental_distribute_dataset(
        [batch], options=tpustrat.InputOptions(experimental_fetch_to_device=fetch)))
    with pytest.raises(error, match=match):
      next(it)
    with pytest.raises(StopIteration):  # the iterator is finished after the error
      next(it)


def test_batch_structure_must_not_change(strategy):
  it = iter(strategy.experimental_distribute_dataset([{"x": np.zeros(16)}, {"y": np.zeros(16)}]))
  next(it)
  with pytest.raises(ValueError, match="every batch of a dataset must have the same structure"):
    next(it)


def test_errors_name_the_batch_index(strategy):
  it = iter(strategy.experimental_distribute_dataset([np.zeros(16)] * 3 + [(np.zeros(16), np.zeros(15))]))
  for _ in range(3):
    next(it)
  with pytest.raises(ValueError, match=r"batch 3 has leaves with different leading"):
    next(it)


def test_bad_dataset_fn(strategy):
  with pytest.raises(TypeError, match=r"`dataset_fn` must return a dataset of per-replica batches.*int: 3"):
    strategy.experimental_distribute_datasets_from_function(lambda ctx: 3)
  with pytest.raises(TypeError, match="expects a callable `dataset_fn"):
    strategy.experimental_distribute_datasets_from_function([np.zeros(2)])
  dist = strategy.experimental_distribute_datasets_from_function(
      lambda ctx: [np.zeros((2, 3))] * 4 + [np.zeros((2, 4))] * 4)
  with pytest.raises(ValueError, match=r"agree on everything but their number of rows"):
    next(iter(dist))


def test_valid_mask_needs_a_batch_when_ambiguous(strategy):
  batch = next(iter(strategy.experimental_distribute_dataset([np.zeros(16, np.float32)])))
  with pytest.raises(ValueError, match=r"exactly one padded batch among the arguments.*found 0"):
    strategy.run(lambda: tpustrat.valid_mask())
  # Arrays that are not a padded batch of this step count as all real.
  out = strategy.run(lambda b, w: jnp.sum(tpustrat.valid_mask(w)) + 0 * b.sum(), args=(batch, jnp.ones(5)))
  assert [int(v) for v in out.values] == [5] * N


# -- a process's own rows of a batched grain MapDataset (multi-process jobs) ------------------------
#
# tests/test_input_multiprocess.py runs a real 2-process job. Here one process plays a process of a larger
# job: the dataset is told that only `local` replicas are its own, and each step's host part is checked
# (what `_place` would put in the global array) with the examples it read.


def _counting_grain(n, batch_size, reads, **batch_kwargs):
  def read(i):
    reads.append(int(i))
    return {"id": np.int32(i), "x": np.full((2,), i, np.float32)}

  return grain.MapDataset.range(n).map(read).shuffle(seed=5).batch(batch_size, **batch_kwargs)


def _as_process(strategy, source, local, options=None):
  from tpustrat._src.input.sources import batched_examples  # pylint: disable=import-outside-toplevel

  dist = strategy.experimental_distribute_dataset(source, options)
  dist._local, dist._local_index = list(local), {r: i for i, r in enumerate(local)}
  dist._multi_process, dist._examples = True, batched_examples(source)
  assert dist._examples is not None
  return dist


def _host_parts(dist, start=0):
  """[(ids [N_local, k], counts [N_local])] of this process, per step kept (leaf 0 is "id")."""
  parts = []
  for i, raw in enumerate(dist._iter_source(start), start):
    prepared = dist._prepare([raw], i)
    if prepared is not None:
      parts.append((np.asarray(prepared.leaves[0]), np.asarray(prepared.counts)))
  return parts


def _global_batches(n, batch_size, **batch_kwargs):
  return [b["id"] for b in _counting_grain(n, batch_size, [], **batch_kwargs)]


@pytest.mark.parametrize("local", [[4, 5, 6, 7], [0, 1, 2, 3], [1, 3, 5, 7], [6]])
def test_a_process_reads_only_its_replicas_rows(strategy, local):
  n = strategy.num_replicas_in_sync
  reads = []
  parts = _host_parts(_as_process(strategy, _counting_grain(44, 16, reads), local))
  want_reads = []
  for (ids, counts), batch in zip(parts, _global_batches(44, 16), strict=True):
    k = 2
    rows = [batch[r * k:(r + 1) * k] for r in range(n)]  # replica r: rows [2r, 2r + 2) (none past the end)
    np.testing.assert_array_equal(counts, [len(rows[r]) for r in local])
    for j, r in enumerate(local):
      np.testing.assert_array_equal(ids[j, :len(rows[r])], rows[r])
      np.testing.assert_array_equal(ids[j, len(rows[r]):], batch[0])  # padding: the batch's first row
      want_reads += list(rows[r])
    if local[0] != 0 and any(len(rows[r]) < k for r in local):  # that row read once, for the padding
      want_reads.append(batch[0])
  assert sorted(reads) == sorted(want_reads) and len(reads) == len(set(reads))


def test_a_process_without_rows_in_a_batch_reads_only_its_first_row(strategy):
  reads = []
  # 40 examples: batches of 16, 16, 8; k = 2, so replicas 4-7 hold only padding in the last batch.
  parts = _host_parts(_as_process(strategy, _counting_grain(40, 16, reads), [4, 5, 6, 7]))
  assert [c.tolist() for _, c in parts] == [[2, 2, 2, 2], [2, 2, 2, 2], [0, 0, 0, 0]]
  last = _global_batches(40, 16)[-1]
  assert parts[-1][0].shape == (4, 2) and (parts[-1][0] == last[0]).all()  # padding: the batch's first row
  assert len(reads) == 17  # 8 rows of each full batch, the last one's first row for the padding
  # With zero padding nothing of the last batch is read.
  reads = []
  parts = _host_parts(_as_process(strategy, _counting_grain(40, 16, reads), [4, 5, 6, 7],
                                  tpustrat.InputOptions(experimental_padding="zeros")))
  assert not parts[-1][0].any() and len(reads) == 16
  # A process that holds no replica at all reads one example, once, for the batches' layout.
  reads = []
  parts = _host_parts(_as_process(strategy, _counting_grain(40, 16, reads), []))
  assert [p[0].shape for p in parts] == [(0, 2)] * 3 and len(reads) == 1


def test_a_process_reads_nothing_of_a_batch_drop_remainder_drops(strategy):
  reads = []
  options = tpustrat.InputOptions(drop_remainder=True)
  parts = _host_parts(_as_process(strategy, _counting_grain(44, 16, reads), [0, 1, 2, 3], options))
  assert len(parts) == 2 and len(reads) == 16
  reads = []  # grain's own drop_remainder: the dataset has two batches
  parts = _host_parts(_as_process(strategy, _counting_grain(44, 16, reads, drop_remainder=True), [0, 1, 2, 3]))
  assert len(parts) == 2 and len(reads) == 16


def test_a_process_resumes_at_grain_positions_with_the_one_process_split(strategy):
  # Started at the partial last batch, a new dataset splits it as one process does: k from that batch
  # (12 rows: k = 2; 4 rows: k = 1).
  for n_examples, k in ((44, 2), (36, 1)):
    reads = []
    dist = _as_process(strategy, _counting_grain(n_examples, 16, reads), [0, 1, 2, 3])
    (ids, counts), = _host_parts(dist, start=2)
    last = _global_batches(n_examples, 16)[2]
    np.testing.assert_array_equal(ids.reshape(-1)[:len(last[:4 * k])], last[:4 * k])
    one = next(iter(strategy.experimental_distribute_dataset([last])))
    assert ids.shape == (4, k) == (4, one.tree.shape[1])
    np.testing.assert_array_equal(counts, np.asarray(one.real_rows_array)[:4])
    assert sorted(reads) == sorted(last[:4 * k].tolist())


def test_only_grain_batch_with_default_stacking_is_read_by_rows(strategy):
  from tpustrat._src.input.sources import batched_examples  # pylint: disable=import-outside-toplevel

  ds = grain.MapDataset.range(10).map(lambda i: {"x": np.float32(i)})
  got = batched_examples(ds.batch(4))
  assert (got.batch_size, got.num_batches, got.num_examples, got.rows(2)) == (4, 3, 10, 2)
  np.testing.assert_array_equal(got.read(1, 1, 3)["x"], [5.0, 6.0])
  assert batched_examples(ds.batch(4, drop_remainder=True)).num_batches == 2
  for other in (ds, ds.batch(4).map(lambda b: b), ds.batch(4).to_iter_dataset(), ds.batch(4)[1:],
                ds.batch(4, batch_fn=lambda xs: xs), ds.to_iter_dataset().batch(4), list(ds.batch(4)), [1, 2]):
    assert batched_examples(other) is None


# -- 64-bit integers without jax_enable_x64 ----------------------------------------------------------
#
# JAX narrows int64 to int32 (uint64 to uint32) without x64, wrapping what does not fit: hashed ids of
# 3_000_000_000 would arrive as -1294967296, and an embedding would treat them as padding. The pipeline
# raises before the batch is padded or transferred; values that fit arrive exactly.

BIG = 3_000_000_000


def hashed_batches(ids):
  """Two global batches of 16 rows: {"ids": int64, "x": float32}; `ids` goes in the second one."""
  first = np.arange(16, dtype=np.int64)
  return [{"ids": first, "x": np.ones((16, 2), np.float32)}, {"ids": ids, "x": np.ones((16, 2), np.float32)}]


def wrapped(value, dtype):
  return int(np.asarray(value).astype(dtype))  # what JAX would have made of it (numpy's wrap-around)


@pytest.mark.parametrize("source", ["list", "grain", "generator", "datasets_from_function"])
def test_int64_ids_beyond_int32_raise_naming_the_batch_the_leaf_and_the_fix(strategy, source):
  assert not jax.config.jax_enable_x64
  ids = np.arange(16, dtype=np.int64)
  ids[5] = BIG
  batches = hashed_batches(ids)
  if source == "list":
    dist = strategy.experimental_distribute_dataset(batches)
  elif source == "grain":
    ds = strategy.experimental_make_numpy_dataset({k: np.concatenate([b[k] for b in batches]) for k in batches[0]})
    dist = strategy.experimental_distribute_dataset(ds.batch(16))
  elif source == "generator":
    dist = strategy.experimental_distribute_dataset(b for b in batches)
  else:  # one per-replica batch of 2 rows per replica and step: rows 4-5 are replica 2's batch of step 1
    per_replica = [{k: b[k][i:i + 2] for k in b} for b in batches for i in range(0, 16, 2)]
    dist = strategy.experimental_distribute_datasets_from_function(lambda ctx: per_replica)
  it = iter(dist)
  first = next(it)  # the first batch fits: it arrives exactly, as int32
  assert first["ids"].values[0].dtype == np.int32
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, first["ids"])), np.arange(16))
  with pytest.raises(OverflowError) as caught:
    next(it)
  message = str(caught.value)
  number = "10" if source == "datasets_from_function" else "1"  # per-replica batch 10 (step 1, replica 2)
  assert f" batch {number}: the leaf at ['ids'] is int64 and holds {BIG} at index (" in message, message
  assert "outside the int32 range [-2147483648, 2147483647]" in message
  assert f"would arrive as {wrapped(BIG, np.int32)}" in message  # -1294967296
  assert "jax_enable_x64" in message and "into the int32 range" in message


def test_int64_values_that_fit_arrive_exactly_at_the_int32_bounds(strategy):
  ids = np.array([-2**31, 2**31 - 1, -1, 0, 7, 2**31 - 2, -2**31 + 1, 123456789] * 2, np.int64)
  (batch,) = list(strategy.experimental_distribute_dataset([{"ids": ids}]))
  assert batch["ids"].values[0].dtype == np.int32
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, batch["ids"])), ids.astype(np.int32))
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, batch["ids"])).astype(np.int64), ids)


def test_uint64_beyond_uint32_raises_and_uint32_is_kept_whole(strategy):
  # JAX narrows uint64 to uint32 but keeps uint32 as it is: only the former can lose values.
  big = np.full(16, 2**32 + 5, np.uint64)
  with pytest.raises(OverflowError, match=r"batch 0: the leaf at \['u'\] is uint64 and holds 4294967301 at index "
                     r"\(0,\) \(16 of its 16 values are out of range\), outside the uint32 range \[0, 4294967295\]"):
    list(strategy.experimental_distribute_dataset([{"u": big}]))
  u32 = np.full(16, BIG, np.uint32)  # above int32's range, inside uint32's
  (batch,) = list(strategy.experimental_distribute_dataset([{"u": u32}]))
  assert batch["u"].values[0].dtype == np.uint32
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, batch["u"])), u32)


def test_int64_with_x64_enabled_arrives_as_int64():
  with jax.enable_x64(True):
    strategy = tpustrat.TPUStrategy()
    ids = np.arange(16, dtype=np.int64) + BIG
    (batch,) = list(strategy.experimental_distribute_dataset([{"ids": ids}]))
    assert batch["ids"].values[0].dtype == np.int64
    np.testing.assert_array_equal(np.concatenate(local_rows(strategy, batch["ids"])), ids)


def test_float64_becomes_float32_without_x64_as_in_jax(strategy):
  # The stated rule (README, "Input"): float64 arrives as float32, rounded to nearest as numpy rounds it;
  # no warning from tpustrat (pytest turns warnings into errors), no error.
  x = np.array([1 / 3, 1e-40, 3e38, -1e-300, 2.0**-149, 0.1, 2.0**24 + 1, -7.0] * 2, np.float64)
  (batch,) = list(strategy.experimental_distribute_dataset([{"x": x}]))
  assert batch["x"].values[0].dtype == np.float32
  np.testing.assert_array_equal(np.concatenate(local_rows(strategy, batch["x"])), x.astype(np.float32))


def test_int64_batches_left_on_the_host_are_checked_too(strategy):
  ids = np.arange(16, dtype=np.int64)
  ids[15] = -BIG
  options = tpustrat.InputOptions(experimental_fetch_to_device=False)
  with pytest.raises(OverflowError, match=rf"batch 0: the leaf at \['ids'\] is int64 and holds {-BIG} at index \(15,\)"):
    list(strategy.experimental_distribute_dataset([{"ids": ids}], options))
