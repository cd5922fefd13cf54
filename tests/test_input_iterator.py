"""The distributed iterator: how far the prefetch thread reads ahead, `close()`, and one iterator at a time
on a one-shot source (a generator) while a re-iterable source gives a new pass per `iter()`."""

import threading
import time

import jax
import numpy as np
import pytest
from conftest import wait_until_read_ahead

import tpustrat


def _counting_source(pulled, n=100):
  for i in range(n):
    pulled.append(i)
    yield np.full((16,), i, np.float32)


def _values(strategy, dist_batch):
  return [float(x) for x in np.concatenate(strategy.experimental_local_results(dist_batch))]


def _ids(n):
  for i in range(n):
    yield np.full((8,), i, np.float32)  # one row per replica


@pytest.mark.parametrize("size", [1, 2])
def test_prefetch_keeps_exactly_buffer_size_batches_ahead(strategy, size):
  # Documented: at most `experimental_per_replica_buffer_size` batches ahead of the one in use.
  pulled = []
  options = tpustrat.InputOptions(experimental_per_replica_buffer_size=size)
  it = iter(strategy.experimental_distribute_dataset(_counting_source(pulled), options=options))
  next(it)
  prefetcher = wait_until_read_ahead(it)
  it.close()
  prefetcher.join(10)
  assert not prefetcher.is_alive() and len(pulled) == 1 + size


def test_prefetch_keeps_buffer_size_groups_ahead_with_take_steps(strategy):
  pulled = []
  options = tpustrat.InputOptions(experimental_per_replica_buffer_size=1)
  it = iter(strategy.experimental_distribute_dataset(_counting_source(pulled), options=options))
  it.take_steps(2)
  prefetcher = wait_until_read_ahead(it)
  it.close()
  prefetcher.join(10)
  assert not prefetcher.is_alive() and len(pulled) == 2 + 2  # the group in use and one group ready


def test_default_on_xla_cpu_reads_and_places_each_batch_when_asked_for(strategy):
  # The per-platform default (InputOptions.experimental_per_replica_buffer_size=None): no prefetch thread on
  # XLA:CPU; every batch is still on the devices when handed out, and nothing is read ahead.
  pulled = []
  before = {t for t in threading.enumerate() if t.name == "tpustrat-input-prefetch"}
  it = iter(strategy.experimental_distribute_dataset(_counting_source(pulled, n=4)))
  batch = next(it)
  time.sleep(0.3)
  assert len(pulled) == 1
  assert isinstance(batch.tree, jax.Array) and len(batch.tree.sharding.device_set) == 8
  assert not {t for t in threading.enumerate() if t.name == "tpustrat-input-prefetch"} - before
  assert [_values(strategy, b)[0] for b in it] == [1.0, 2.0, 3.0]
  stacked = iter(strategy.experimental_distribute_dataset(_counting_source(pulled, n=5))).take_steps(2)
  assert isinstance(stacked.tree, jax.Array) and stacked.tree.shape == (2, 8, 2)


@pytest.mark.parametrize("size", [0, 1])
def test_buffer_size_zero_or_one_gives_the_same_batches_and_positions(strategy, size):
  options = tpustrat.InputOptions(experimental_per_replica_buffer_size=size)
  dist = strategy.experimental_distribute_dataset([np.full((8,), i, np.float32) for i in range(6)], options)
  it = iter(dist)
  assert _values(strategy, next(it))[0] == 0.0
  assert [_values(strategy, b)[0] for b in tpustrat.unstack_steps(it.take_steps(2))] == [1.0, 2.0]
  state = it.get_state()
  assert (state["batches"], state["elements"]) == (3, 3)
  again = iter(dist)
  again.set_state(state)
  assert [_values(strategy, b)[0] for b in again] == [3.0, 4.0, 5.0]


@pytest.mark.parametrize("fetch", [True, False])
def test_close_after_a_pending_error_stops_iteration(strategy, fetch):
  def source():
    for i in range(3):
      yield np.full((16,), i, np.float32)
    raise RuntimeError("broken source")

  options = tpustrat.InputOptions(experimental_fetch_to_device=fetch)
  it = iter(strategy.experimental_distribute_dataset(source(), options=options))
  assert len(tpustrat.unstack_steps(it.take_steps(5))) == 3  # the error is kept for the next call
  it.close()
  with pytest.raises(StopIteration):  # close(): "later next calls raise StopIteration"
    next(it)


@pytest.mark.parametrize("size", [1, 3])
def test_second_iter_of_a_one_shot_source_loses_nothing(strategy, size):
  # Two iter() calls on a generator-backed dataset must not share the generator between two prefetch
  # threads nor drop the first iterator's read-ahead: iter() continues the live iterator.
  options = tpustrat.InputOptions(experimental_per_replica_buffer_size=size)
  dist = strategy.experimental_distribute_dataset(_ids(10), options=options)
  seen = []
  for b in dist:
    seen.append(_values(strategy, b)[0])
    if len(seen) == 3:
      break
  time.sleep(0.3)  # let the prefetch thread read ahead
  for b in dist:  # a second epoch loop: continues where the first stopped
    seen.append(_values(strategy, b)[0])
  assert seen == [float(i) for i in range(10)]
  assert list(dist) == []  # the generator is spent


def test_one_shot_iter_after_close_resumes_after_read_ahead_is_discarded(strategy):
  # close() is explicit: batches read ahead are discarded, but iter() afterwards never races the old
  # thread and continues with the source's next element.
  pulled = []
  dist = strategy.experimental_distribute_dataset(_counting_source(pulled, n=10))
  it = iter(dist)
  assert _values(strategy, next(it))[0] == 0.0
  it.close()
  rest = [_values(strategy, b)[0] for b in dist]
  assert rest == [float(i) for i in range(len(pulled) - len(rest), 10)]
  assert rest[-1] == 9.0 and len(pulled) == 10


def test_one_shot_element_spec_while_an_iterator_is_live(strategy):
  dist = strategy.experimental_distribute_dataset(_ids(4))
  it = iter(dist)  # open, nothing read yet: element_spec must go through it, not read the source
  assert "float32[1]" in repr(dist.element_spec)
  assert [_values(strategy, b)[0] for b in it] == [0.0, 1.0, 2.0, 3.0]


def test_reiterable_source_still_gives_a_new_pass_per_iter(strategy):
  batches = [np.full((8,), i, np.float32) for i in range(4)]
  dist = strategy.experimental_distribute_dataset(batches)
  it1 = iter(dist)
  next(it1)
  it2 = iter(dist)
  assert it2 is not it1
  assert [_values(strategy, b)[0] for b in it2] == [0.0, 1.0, 2.0, 3.0]
  assert [_values(strategy, b)[0] for b in it1] == [1.0, 2.0, 3.0]


def _batches(n):
  return [np.full((16,), float(8 * i) / 16, np.float32) for i in range(n)]  # batch i sums to 8 * i


def test_next_inside_jit_is_an_error_showing_the_pattern_that_works(strategy):
  # TF's TPU guide: @tf.function def train_step(iterator): strategy.run(step_fn, args=(next(iterator),)).
  # Ported with jax.jit, next() would run once, at trace time, and every step would get the first batch.
  iterator = iter(strategy.experimental_distribute_dataset(_batches(3)))

  @jax.jit
  def train_step_reading_the_iterator():
    return strategy.run(lambda x: x.sum(), args=(next(iterator),))

  with pytest.raises(RuntimeError, match=r"next\(iterator\) was called while JAX traces a program.*every call of it "
                                         r"would train on that same batch.*batch = next\(iterator\); train_step\(batch\)"):
    train_step_reading_the_iterator()
  with pytest.raises(RuntimeError, match=r"take_steps was called while JAX traces"):
    jax.jit(lambda: iterator.take_steps(2))()

  # The pattern that works: read outside, pass the batch in. Each step gets its own batch: sums 0, 8, 16.
  @jax.jit
  def train_step(batch):
    return strategy.run(lambda x: x.sum(), args=(batch,))

  sums = [float(strategy.reduce("sum", train_step(next(iterator)), axis=None)) for _ in range(3)]
  assert sums == [0.0, 8.0, 16.0]


def test_next_inside_the_step_function_of_run_is_an_error(strategy):
  iterator = iter(strategy.experimental_distribute_dataset(_batches(2)))
  with pytest.raises(RuntimeError, match=r"next\(iterator\) was called while JAX traces"):
    strategy.run(lambda: next(iterator))
  # Eager transformations are not staging: jax.grad of a function that reads a batch reads it each call.
  got = [float(jax.grad(lambda w: w * strategy.reduce("sum", next(iterator), axis=0))(1.0)) for _ in range(2)]
  assert got == [0.0, 8.0]


# -- prefetch depth (InputOptions.experimental_per_replica_buffer_size): the next `depth` batches' transfers
# are in flight while the current step runs; order, padding, bounds and positions stay as without a thread.

DEPTHS = pytest.mark.parametrize("depth", [1, 2, 4])


def _global_batches(sizes, cols=3, seed=0):
  """Global batches of random float32 values and int32 labels, `sizes[i]` rows each."""
  rng = np.random.default_rng(seed)
  return [{"x": rng.standard_normal((n, cols)).astype(np.float32), "y": rng.integers(0, 100, n).astype(np.int32)}
          for n in sizes]


def _padded(x, replicas, k):
  """What the iterator places for global batch `x`: ``[replicas, k, ...]``, rows past the real ones filled
  with the batch's first row (`InputOptions.experimental_padding="first_row"`, the default)."""
  out = np.repeat(x[:1], replicas * k, axis=0)
  out[:len(x)] = x
  return out.reshape((replicas, k) + x.shape[1:])


@DEPTHS
def test_prefetch_depth_keeps_batches_in_order_with_the_partial_last_one_padded_exactly(strategy, depth):
  # 16 rows per batch over 8 replicas (k = 2); the last batch has 5: replicas 0-1 get 2 real rows, 2 one,
  # 3-7 none. Compared with numpy on the same inputs: the placed arrays, the counts, the local results
  # (real rows only) and a step's output, batch by batch, at each depth and without a thread.
  sizes = [16] * 7 + [5]
  data = _global_batches(sizes)
  got = {}
  for d in (0, depth):
    options = tpustrat.InputOptions(experimental_per_replica_buffer_size=d)
    got[d] = []
    for batch in strategy.experimental_distribute_dataset(iter(data), options=options):  # a one-shot source
      doubled = strategy.run(lambda b: b["x"] * 2.0 + b["y"][:, None].astype(np.float32), args=(batch,))
      got[d].append((np.asarray(batch["x"].tree), np.asarray(batch["y"].tree), batch["x"].host_real_rows(),
                     _rows_of(strategy, batch["x"]), _rows_of(strategy, doubled)))
  assert len(got[depth]) == len(sizes)
  for i, (b, n) in enumerate(zip(data, sizes)):
    counts = np.clip(n - 2 * np.arange(8), 0, 2)
    for d in (0, depth):
      x, y, real, local_x, local_doubled = got[d][i]
      np.testing.assert_array_equal(x, _padded(b["x"], 8, 2))
      np.testing.assert_array_equal(y, _padded(b["y"], 8, 2))
      np.testing.assert_array_equal(real, counts)
      np.testing.assert_array_equal(local_x, b["x"])
      np.testing.assert_allclose(local_doubled, b["x"] * 2.0 + b["y"][:, None], rtol=1e-6)


def _rows_of(strategy, value):
  """The real rows of a distributed value, in replica order, as one host array."""
  return np.concatenate([np.asarray(r) for r in strategy.experimental_local_results(value)])


@DEPTHS
def test_prefetch_depth_bounds_the_batches_in_flight(strategy, depth):
  # The thread takes a free place before it reads an element and places it, so while the loop holds its
  # batches (it keeps all of them here), exactly `depth` batches are read and on (or on their way to) the
  # devices beyond those handed out: never more, at every point of the pass.
  pulled = []
  options = tpustrat.InputOptions(experimental_per_replica_buffer_size=depth)
  it = iter(strategy.experimental_distribute_dataset(_counting_source(pulled, n=20), options=options))
  held = []
  for handed in range(1, 6):
    held.append(next(it))
    prefetcher = wait_until_read_ahead(it)
    assert len(pulled) == handed + depth
    assert prefetcher._queue.qsize() == depth  # pylint: disable=protected-access
  assert [_values(strategy, b)[0] for b in held] == [0.0, 1.0, 2.0, 3.0, 4.0]
  assert all(isinstance(b.tree, jax.Array) and len(b.tree.sharding.device_set) == 8 for b in held)
  it.close()
  prefetcher.join(10)
  assert not prefetcher.is_alive() and len(pulled) == 5 + depth


@DEPTHS
def test_prefetch_depth_state_counts_only_the_batches_handed_out(strategy, depth):
  # Batches placed ahead but not handed out are neither lost nor counted twice: the state saved after 3
  # batches (with `depth` more read ahead) resumes at batch 3, in a new iterator and in the old one, the
  # partial last batch padded as in the uninterrupted pass.
  sizes = [16] * 9 + [5]
  data = _global_batches(sizes, seed=1)
  options = tpustrat.InputOptions(experimental_per_replica_buffer_size=depth)
  dist = strategy.experimental_distribute_dataset(data, options=options)
  it = iter(dist)
  for _ in range(3):
    next(it)
  wait_until_read_ahead(it)
  state = it.get_state()
  assert (state["batches"], state["elements"]) == (3, 3)
  restored = iter(dist)
  restored.set_state(state)
  for source in (restored, it):
    rest = list(source)
    assert len(rest) == len(sizes) - 3
    for b, batch in zip(data[3:], rest):
      np.testing.assert_array_equal(_rows_of(strategy, batch["x"]), b["x"])
      np.testing.assert_array_equal(_rows_of(strategy, batch["y"]), b["y"])
    np.testing.assert_array_equal(np.asarray(rest[-1]["x"].tree), _padded(data[-1]["x"], 8, 2))
    np.testing.assert_array_equal(rest[-1]["x"].host_real_rows(), [2, 2, 1, 0, 0, 0, 0, 0])
    assert source.get_state()["batches"] == len(sizes)
    with pytest.raises(StopIteration):
      next(source)


@pytest.mark.parametrize(("depth", "error"), [(-1, ValueError), (-4, ValueError), (1.5, TypeError),
                                              (True, TypeError), ("2", TypeError)])
def test_prefetch_depth_is_checked_naming_the_bad_value(depth, error):
  with pytest.raises(error) as raised:
    tpustrat.InputOptions(experimental_per_replica_buffer_size=depth)
  message = str(raised.value)
  assert "experimental_per_replica_buffer_size" in message and repr(depth) in message, message


@pytest.mark.parametrize("replicas", [1, 8])
def test_a_known_signature_runs_none_of_its_checks_but_reads_its_values(strategy, monkeypatch, replicas):
  """What depends only on a global batch's structure, shapes, dtypes and strides is checked once per
  signature (`flatten_batch`, `alias_residues`); a later batch like it runs none of that. Its values are
  still read: every batch arrives as numpy has it, the partial one (a new signature) padded exactly, and a
  later int64 value out of the int32 range still raises."""
  from tpustrat._src.input import dataset as dataset_lib

  calls = {"flatten_batch": 0, "alias_residues": 0}
  for name in calls:
    real = getattr(dataset_lib, name)

    def counting(*args, _real=real, _name=name, **kwargs):
      calls[_name] += 1
      return _real(*args, **kwargs)

    monkeypatch.setattr(dataset_lib, name, counting)
  chosen = strategy if replicas == 8 else tpustrat.MirroredStrategy(jax.devices()[:1])
  k = 16 // replicas
  rng = np.random.default_rng(7)
  data = [{"x": rng.normal(size=(n, 3)).astype(np.float32), "ids": np.arange(n, dtype=np.int64) + 100 * i}
          for i, n in enumerate([16, 16, 16, 5])]
  it = iter(chosen.experimental_distribute_dataset(data))
  got = [next(it)]
  once = dict(calls)
  assert once["flatten_batch"] == 1 and once["alias_residues"] in (0, 2)  # 0: a backend that copies
  got += [next(it), next(it)]
  assert calls == once  # the same signature: no check of its structure again
  got.append(next(it))  # 5 rows: another signature, checked once
  assert calls["flatten_batch"] == 2
  for batch, b in zip(got, data):
    n = len(b["x"])
    np.testing.assert_array_equal(np.asarray(batch["x"].tree), _padded(b["x"], replicas, k))
    ids = _padded(b["ids"], replicas, k).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(batch["ids"].tree), ids)
    np.testing.assert_array_equal(batch["x"].host_real_rows(), np.clip(n - k * np.arange(replicas), 0, k))
    np.testing.assert_array_equal(_rows_of(chosen, batch["x"]), b["x"])
  wrapping = [data[0], {"x": data[1]["x"], "ids": data[1]["ids"] + 2**40}]
  it = iter(chosen.experimental_distribute_dataset(wrapping))
  next(it)
  before = calls["flatten_batch"]
  with pytest.raises(OverflowError, match=r"batch 1: the leaf at \['ids'\] is int64"):
    next(it)
  assert calls["flatten_batch"] == before  # a known signature: only the values were read
