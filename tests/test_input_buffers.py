"""Sources that reuse their buffers, and which host memory reaches the devices.

`jax.device_put` of a numpy array returns before the copy is done, and XLA:CPU does not copy a 64-byte
aligned array at all: the device buffer *is* the numpy memory. A source that writes each batch into the
same buffer (a common allocation-free loader) must still give every step its own batch, although the
prefetch thread reads the source ahead of the steps (buffer size 1, the default on GPU and TPU) and,
without one (buffer size 0, the default on XLA:CPU), the next batch is read while the steps run. The
batches are checked value by value.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat
from tpustrat._src import host_memory
from tpustrat._src.input import staging
from tpustrat._src.input.dataset import STAGING_SPARE

ROWS, COLS, STEPS = 16, 1024, 6


def _buffer(offset_bytes, rows=ROWS, cols=COLS):
  """A float32 [rows, cols] buffer starting `offset_bytes` past a 4096-byte boundary."""
  raw = np.empty(rows * cols * 4 + 8192, np.uint8)
  start = -raw.ctypes.data % 4096 + offset_bytes
  return raw[start:start + rows * cols * 4].view(np.float32).reshape(rows, cols)


def _slow_sum(x):
  """The sum of `x`, after enough work that the step is still running when `run` returns."""
  for _ in range(4):
    x = x @ jnp.eye(x.shape[-1], dtype=x.dtype)
  return x.sum()


def _reusing_source(buf, steps=STEPS, rows=ROWS):
  """Writes batch i (every value i*1000 + row) into the same buffer each time."""
  for i in range(steps):
    buf[:rows] = (i * 1000 + np.arange(rows, dtype=np.float32))[:, None]
    yield {"x": buf[:rows], "y": np.full((rows,), i, np.int32)}


# Both ways a distributed iterator reads: in the caller's thread (0) and in a prefetch thread (1), and a
# thread that keeps four batches' transfers in flight (4): the source is read again only after them.
BUFFERS = pytest.mark.parametrize("buffer", [0, 1, 4], ids=["no_thread", "thread", "thread_depth4"])


def _options(buffer):
  return tpustrat.InputOptions(experimental_per_replica_buffer_size=buffer)


def _expected(i, rows=ROWS):
  return i * 1000 + np.arange(rows, dtype=np.float32)


def _rows_of(strategy, value):
  """The real rows of a distributed component, in replica order, as one host array."""
  return np.concatenate([np.asarray(r) for r in strategy.experimental_local_results(value)])


@BUFFERS
@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_reused_buffer_gives_every_step_its_own_batch(strategy, offset, buffer):
  got = []
  for batch in strategy.experimental_distribute_dataset(_reusing_source(_buffer(offset)), _options(buffer)):
    got.append((_rows_of(strategy, batch["x"])[:, 0], _rows_of(strategy, batch["y"])))
  assert len(got) == STEPS
  for i, (x, y) in enumerate(got):
    np.testing.assert_array_equal(x, _expected(i))
    np.testing.assert_array_equal(y, np.full(ROWS, i))


@BUFFERS
@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_reused_buffer_through_run_matches_numpy(strategy, offset, buffer):
  # The step runs while the next batches are read (and the source rewrites its buffer).
  sums = [strategy.reduce("SUM", strategy.run(lambda b: b["x"].sum(axis=1), args=(b,)), axis=0)
          for b in strategy.experimental_distribute_dataset(_reusing_source(_buffer(offset)), _options(buffer))]
  np.testing.assert_allclose([float(s) for s in sums], [_expected(i).sum() * COLS for i in range(STEPS)])


@BUFFERS
def test_reused_buffer_with_a_partial_last_batch(strategy, buffer):
  buf = _buffer(0)

  def source():
    yield from _reusing_source(buf, steps=3)
    buf[:12] = 7000 + np.arange(12, dtype=np.float32)[:, None]
    yield {"x": buf[:12], "y": np.full((12,), 7, np.int32)}

  got = [_rows_of(strategy, b["x"])[:, 0] for b in strategy.experimental_distribute_dataset(source(), _options(buffer))]
  for i in range(3):
    np.testing.assert_array_equal(got[i], _expected(i))
  np.testing.assert_array_equal(got[3], 7000 + np.arange(12))


@BUFFERS
@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_reused_buffer_with_take_steps(strategy, offset, buffer):
  it = iter(strategy.experimental_distribute_dataset(_reusing_source(_buffer(offset)), _options(buffer)))
  groups = [it.take_steps(4), it.take_steps(4)]
  steps = [b for g in groups for b in tpustrat.unstack_steps(g)]
  assert len(steps) == STEPS
  for i, b in enumerate(steps):
    np.testing.assert_array_equal(_rows_of(strategy, b["x"])[:, 0], _expected(i))


@BUFFERS
@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_reused_per_replica_buffer_from_function(strategy, offset, buffer):
  # Each replica's batch of a step is read before the next one is written into the same buffer.
  per_replica = 2
  buf = _buffer(offset)

  def dataset_fn(ctx):
    def gen():
      for j in range(ctx.num_replicas_in_sync * 3):
        buf[:per_replica] = (j * 10 + np.arange(per_replica, dtype=np.float32))[:, None]
        yield buf[:per_replica]
    return gen()

  dist = strategy.experimental_distribute_datasets_from_function(dataset_fn, _options(buffer))
  n = strategy.num_replicas_in_sync
  for step, batch in enumerate(dist):
    for r, rows in enumerate(strategy.experimental_local_results(batch)):
      j = step * n + r
      np.testing.assert_array_equal(np.asarray(rows)[:, 0], j * 10 + np.arange(per_replica))


def test_element_spec_read_ahead_of_a_reusing_one_shot_source(strategy):
  # element_spec reads the first batch ahead of the iteration; the source then rewrites its buffer.
  dist = strategy.experimental_distribute_dataset(_reusing_source(_buffer(0)))
  n = strategy.num_replicas_in_sync
  assert jax.tree.leaves(dist.element_spec["x"])[0].shape == (n, ROWS // n, COLS)
  got = [_rows_of(strategy, b["x"])[:, 0] for b in dist]
  for i in range(STEPS):
    np.testing.assert_array_equal(got[i], _expected(i))


def test_default_strategy_reused_buffer():
  dist = tpustrat.get_strategy().experimental_distribute_dataset(_reusing_source(_buffer(0)))
  got = [np.asarray(b["x"])[:, 0] for b in dist]
  for i in range(STEPS):
    np.testing.assert_array_equal(got[i], _expected(i))


def _device_pointers(array):
  return {s.data.unsafe_buffer_pointer() for s in array.addressable_shards}


def _host_range(x):
  return x.ctypes.data, x.ctypes.data + x.nbytes


def test_device_batches_never_alias_the_sources_memory(strategy):
  buf = _buffer(0)  # aligned: XLA:CPU would alias it
  batch = next(iter(strategy.experimental_distribute_dataset(_reusing_source(buf))))
  lo, hi = _host_range(buf)
  leaked = [p for p in _device_pointers(batch["x"].tree) if lo <= p < hi]
  assert leaked == []


def test_host_alias_alignment_probe_matches_device_put():
  """The probe's answer agrees with what `jax.device_put` does with arrays at that alignment."""
  device = jax.devices()[0]
  align = host_memory.alias_alignment(device)
  raw = np.zeros(3 * 8192, np.uint8)
  base = -raw.ctypes.data % 8192
  for a in (8, 16, 32, 64, 128, 4096):
    view = raw[base + a:base + a + 1024]
    put = jax.device_put(view, device)
    put.block_until_ready()
    aliased = put.unsafe_buffer_pointer() == view.ctypes.data
    assert aliased == (align is not None and a >= align), (a, align)


def test_library_built_batches_reach_cpu_devices_without_a_copy(strategy):
  # A partial batch is padded by the library into memory it owns, aligned: on a backend whose
  # device_put aliases aligned host memory, the padded batch is not copied a second time.
  if host_memory.alias_alignment(jax.devices()[0]) is None:
    pytest.skip("this backend copies host memory to the devices")
  padded = host_memory.host_empty((8, 4, 16), np.float32)  # 256 bytes per replica: every part aligned
  assert padded.ctypes.data % host_memory.ALIGN == 0
  put = jax.device_put(padded, jax.sharding.NamedSharding(strategy.mesh, jax.sharding.PartitionSpec("replica")))
  lo, hi = _host_range(padded)
  assert all(lo <= p < hi for p in _device_pointers(put))


def test_batch_that_ends_a_group_early_is_kept_intact():
  # Under the default strategy a partial batch has another shape: it ends the group being filled and
  # is held for the next group, which then reads the source (rewriting the buffer) after it.
  buf = _buffer(0)
  sizes = [ROWS, ROWS, 12, ROWS, ROWS]

  def source():
    for i, rows in enumerate(sizes):
      buf[:rows] = (i * 1000 + np.arange(rows, dtype=np.float32))[:, None]
      yield {"x": buf[:rows]}

  it = iter(tpustrat.get_strategy().experimental_distribute_dataset(source()))
  groups = [it.take_steps(3) for _ in range(3)]
  steps = [np.asarray(b["x"])[:, 0] for g in groups for b in tpustrat.unstack_steps(g)]
  assert [len(s) for s in steps] == sizes
  for i, s in enumerate(steps):
    np.testing.assert_array_equal(s, _expected(i, sizes[i]))


@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_run_captures_numpy_arguments_when_called(strategy, offset):
  # TF converts run's numpy arguments when run is called; writing into the array afterwards (while the
  # step may still be running) must not change the step's result.
  rows, cols = 512, 512  # 1 MiB
  buf = _buffer(offset, rows, cols)
  for i in range(4):
    buf[...] = i
    out = strategy.run(_slow_sum, args=(buf,))  # a plain array: given whole to every replica
    buf[...] = -1
    got = [float(np.asarray(r)) for r in strategy.experimental_local_results(out)]
    np.testing.assert_allclose(got, [i * rows * cols] * strategy.num_replicas_in_sync)


@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_reused_buffer_without_fetch_to_device(strategy, offset):
  # The elements stay on the host and `run` transfers them; the loop's next `next()` rewrites the
  # buffer while the step may still run.
  options = tpustrat.InputOptions(experimental_fetch_to_device=False)
  rows, cols = 512, 512  # 1 MiB
  dist = strategy.experimental_distribute_dataset(_reusing_source(_buffer(offset, rows, cols), rows=rows),
                                                  options=options)
  sums = [strategy.reduce("SUM", strategy.run(lambda b: _slow_sum(b["x"]), args=(b,)), axis=None) for b in dist]
  # 32768 positive float32 values per replica, partial sums above 2**24: rounded in whatever order XLA adds
  # them (~1e-6 for a blocked sum, 6e-6 for a naive one). A row of another batch moves a sum by > 3e-4.
  want = [_expected(i, rows).sum() * cols for i in range(STEPS)]
  np.testing.assert_allclose([float(s) for s in sums], want, rtol=1e-4)


def test_values_from_function_captures_values_when_called(strategy):
  buf = _buffer(0)
  buf[...] = 3.0
  values = strategy.experimental_distribute_values_from_function(lambda ctx: buf)
  buf[...] = -1.0
  for r in strategy.experimental_local_results(values):
    np.testing.assert_array_equal(np.asarray(r), np.full((ROWS, COLS), 3.0, np.float32))


def _whole_buffer_source(buf, steps=STEPS):
  """Writes batch i (every value i*1000 + row) into the whole of the same buffer each time."""
  for i in range(steps):
    buf[...] = _expected(i, buf.shape[0])[:, None]
    yield {"x": buf}


class _ArrayLike:
  """A torch-like tensor: not a numpy array, but ``np.asarray`` of it shares its memory."""

  def __init__(self, data):
    self._data = data

  def __array__(self, dtype=None, copy=None):
    return self._data


def _slow_carry(c, x):
  """A carry step that is still running when experimental_run_steps returns."""
  for _ in range(4):
    c = c @ jnp.eye(c.shape[-1], dtype=c.dtype)
  return c, x.sum()


@pytest.mark.parametrize("wrap", [lambda b: b, _ArrayLike], ids=["numpy", "array_like"])
def test_element_spec_read_ahead_of_a_reusing_per_replica_source(strategy, wrap):
  # element_spec reads a whole step of a one-shot per-replica source ahead; the source writes every
  # replica's batch into one buffer, handed out as numpy or as a torch-like tensor over it.
  n = strategy.num_replicas_in_sync
  buf = np.empty((2, 3), np.float32)

  def dataset_fn(ctx):
    def gen():
      for j in range(2 * ctx.num_replicas_in_sync):
        buf[...] = j
        yield wrap(buf)
    return gen()

  dist = strategy.experimental_distribute_datasets_from_function(dataset_fn)
  assert jax.tree.leaves(dist.element_spec)[0].shape == (n, 2, 3)
  steps = list(dist)
  assert len(steps) == 2
  for step, batch in enumerate(steps):
    for r, rows in enumerate(strategy.experimental_local_results(batch)):
      np.testing.assert_array_equal(np.asarray(rows), np.full((2, 3), step * n + r, np.float32))


@pytest.mark.parametrize("strategy_name", ["tpu", "default"])
def test_take_steps_keeps_values_of_a_batch_with_another_dtype(strategy, strategy_name):
  # A group whose batches differ in dtype holds every batch's values (the stack is promoted, as
  # np.stack does), not values cast to the first batch's dtype.
  s = strategy if strategy_name == "tpu" else tpustrat.get_strategy()
  batches = [np.full(8, 1, np.int32), np.full(8, 0.5, np.float32), np.full(8, 2, np.int32),
             np.full(8, 2.5, np.float32)]
  it = iter(s.experimental_distribute_dataset(batches))
  steps = tpustrat.unstack_steps(it.take_steps(4))
  assert len(steps) == 4
  for b, want in zip(steps, batches):
    got = _rows_of(s, b) if strategy_name == "tpu" else np.asarray(b)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_per_replica_step_read_while_another_iterator_grows_the_batch(strategy):
  # Two iterators over one dataset (say an abandoned epoch's, whose prefetch thread still reads ahead)
  # share the padded size k. If the other one grows k while this one reads a step from a source that
  # reuses its buffer, this step's batches must still be the ones read, padded to the new k.
  n = strategy.num_replicas_in_sync
  sizes = [2] * n + [4] * n  # step 0: 2 rows per replica; step 1: 4
  hook = []

  class Source:
    """Re-iterable; each pass writes every per-replica batch into the same buffer of its own."""

    def __iter__(self):
      buf = np.empty((4, 3), np.float32)
      for j, rows in enumerate(sizes):
        if hook and j == n - 1:
          hook.pop()()  # the other iterator reads its next step now
        buf[:rows] = (j * 10 + np.arange(rows, dtype=np.float32))[:, None]
        yield buf[:rows]

  options = tpustrat.InputOptions(experimental_fetch_to_device=False)  # no threads: a fixed interleaving
  dist = strategy.experimental_distribute_datasets_from_function(lambda ctx: Source(), options=options)
  ahead = iter(dist)
  next(ahead)
  hook.append(lambda: next(ahead))  # its step 1 has 4 rows per replica: k grows from 2 to 4
  first = next(iter(dist))
  assert jax.tree.leaves(first)[0].shape == (n, 4, 3)  # padded to the grown k
  for r, rows in enumerate(strategy.experimental_local_results(first)):
    np.testing.assert_array_equal(np.asarray(rows), np.repeat((r * 10 + np.arange(2.0))[:, None], 3, axis=1))


@BUFFERS
def test_new_iterator_after_close_waits_for_the_batch_handed_out(strategy, buffer):
  # After close(), iter() of a one-shot dataset continues on the source, whose next read rewrites the
  # buffer. The batch handed out last may still be copying out of that buffer (unaligned: XLA:CPU copies
  # asynchronously); once iter() has stopped the old prefetch thread (if any), that copy must be complete.
  rows, cols = 64, 1 << 18  # 64 MiB: a copy that takes a while
  buf = _buffer(16, rows, cols)
  for _ in range(4):
    dist = strategy.experimental_distribute_dataset(_whole_buffer_source(buf, steps=3), _options(buffer))
    it = iter(dist)
    first = next(it)
    it.close()  # drops what the thread read ahead (batch 1, or none yet)
    again = iter(dist)  # reads the rest of the source
    assert all(x.is_ready() for x in jax.tree.leaves(first))
    later = _rows_of(strategy, next(again)["x"])[:, 0]
    np.testing.assert_array_equal(_rows_of(strategy, first["x"])[:, 0], _expected(0, rows))
    assert later[0] in (1000, 2000)
    np.testing.assert_array_equal(later, _expected(int(later[0]) // 1000, rows))


@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_run_steps_captures_a_numpy_init_when_called(strategy, offset):
  # `init` arrays are given to every replica "as by run": run captures numpy arguments when called.
  w = _buffer(offset, 512, 512)
  for i in range(3):
    w[...] = i
    it = iter(strategy.experimental_distribute_dataset([np.ones(8, np.float32)] * 2))
    carry, _ = strategy.experimental_run_steps(_slow_carry, it, 2, init=w)
    w[...] = -1
    for r in strategy.experimental_local_results(carry):
      np.testing.assert_array_equal(np.asarray(r), np.full((512, 512), i, np.float32))


@pytest.mark.parametrize("offset", [0, 16], ids=["aligned", "unaligned"])
def test_run_steps_captures_numpy_stacked_batches_when_called(strategy, offset):
  # Batches already stacked on a leading steps axis, as a numpy array the caller then reuses.
  batches = _buffer(offset, 2 * 256, 512).reshape(2, 256, 512)

  def step(total, batch):
    x = batch["x"]
    for _ in range(4):
      x = x @ jnp.eye(x.shape[-1], dtype=x.dtype)
    return total + x.sum(), x.sum()

  for i in range(3):
    batches[...] = i
    total, _ = strategy.experimental_run_steps(step, {"x": batches}, init=np.float32(0))
    batches[...] = -1
    for r in strategy.experimental_local_results(total):
      assert float(r) == i * batches.size


def test_may_alias_only_for_arrays_the_transfer_would_alias():
  """`host_memory.may_alias` is checked against what `jax.device_put` does: arrays JAX converts
  (float64 without x64) or re-lays out (transposed, strided) reach the device through new memory."""
  device = jax.devices()[0]
  align = host_memory.alias_alignment(device)
  if align is None:
    pytest.skip("this backend copies host memory to the devices")
  base = host_memory.host_empty((64, 128), np.float32)
  cases = {"contiguous": host_memory.host_empty((64, 64), np.float32),
           "transposed": host_memory.host_empty((64, 64), np.float32).T,
           "strided": base[:, ::2],
           "float64": host_memory.host_empty((64, 64), np.float64)}
  for name, x in cases.items():
    x[...] = 1
    put = jax.device_put(x, device)
    put.block_until_ready()
    aliased = put.unsafe_buffer_pointer() == x.ctypes.data
    assert host_memory.may_alias(x, 1, align) == aliased, name
    assert aliased == (name == "contiguous"), name



@pytest.mark.parametrize("parts", [1, 8])
def test_alias_residues_are_may_alias_with_the_address_left_open(parts):
  """`staging.alias_residues` (a batch layout's half of the aliasing test, computed once per layout) gives
  `host_memory.may_alias`'s answer at every address: arrays of several layouts, at each offset mod 64."""
  align = 64
  raw = host_memory.host_empty((4096,), np.uint8)
  layouts = [((8, 2, 3), np.float32), ((8, 16), np.float32), ((8, 4), np.int32), ((8,), np.int8),
             ((8, 8), np.bool_), ((8, 2), np.float16), ((8, 3), np.float64), ((8, 5), np.int64),
             ((8, 1), np.complex64)]
  for shape, dtype in layouts:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    for offset in range(0, align, dtype.itemsize):
      x = raw[offset:offset + nbytes].view(dtype).reshape(shape)
      for view in (x, x[:, ::2] if x.ndim > 1 else x[::2]):
        residues = staging.alias_residues(view, parts, align)
        expected = host_memory.may_alias(view, parts, align)
        if residues is None:  # 64-bit dtypes: the answer depends on jax_enable_x64, asked each time
          assert dtype.itemsize == 8, (shape, dtype)
          continue
        assert (view.ctypes.data % align in residues) == expected, (shape, dtype, offset, view.strides)


def test_run_with_an_object_array_raises_jax_error(strategy):
  # Whatever its address (a 64-byte-aligned one would otherwise be copied first), the capture path
  # leaves an object array to JAX's own, clear, error.
  arrays = [np.empty(8, object) for _ in range(200)]
  aligned = [x for x in arrays if x.ctypes.data % 64 == 0][:1]
  other = [x for x in arrays if x.ctypes.data % 64][:1]
  assert aligned and other
  for x in aligned + other:
    with pytest.raises(TypeError, match="not a valid JAX array type"):
      strategy.run(lambda v: v, args=(x,))


@BUFFERS
def test_small_source_batches_are_staged_whatever_their_address(strategy, buffer, monkeypatch):
  # On XLA:CPU a small batch in the source's memory is copied into a staging buffer (which the devices
  # alias) even where its transfer would copy it (no part of it aligned): no transfer out of the source's
  # memory is left to wait for before the source is read again, and every step still gets its own batch.
  if host_memory.alias_alignment(jax.devices()[0]) is None:
    pytest.skip("this backend copies host memory to the devices")
  staged = []
  owned_copy = host_memory.owned_copy
  monkeypatch.setattr(host_memory, "owned_copy", lambda x: staged.append(x.shape) or owned_copy(x))
  buf = _buffer(16, cols=4)  # 16 bytes past a 64-byte boundary, rows of 16 bytes: no replica's part aligned
  n = strategy.num_replicas_in_sync
  assert not host_memory.may_alias(buf.reshape(n, ROWS // n, 4), n, host_memory.ALIGN)
  it = iter(strategy.experimental_distribute_dataset(_reusing_source(buf), _options(buffer)))
  got = []
  for b in it:
    assert it._state.pending is None  # pylint: disable=protected-access
    got.append(_rows_of(strategy, b["x"])[:, 0])
  assert len(got) == STEPS
  for i, x in enumerate(got):
    np.testing.assert_array_equal(x, _expected(i))
  assert (n, ROWS // n, 4) in staged


@BUFFERS
def test_staging_buffers_are_reused_only_once_nothing_uses_them(strategy, buffer, monkeypatch):
  # On XLA:CPU the copies of an aligned source batch go into reused staging buffers, which the devices
  # then alias. Batches kept alive (here: every one, to the end) must keep their values; batches
  # dropped as the loop goes free their buffers for reuse. The pool keeps a buffer for every batch that
  # can hold one at a time (`depth` read ahead, the one being read, the one the loop holds, the steps in
  # flight's), so that a long pass allocates a fixed number of them, at any prefetch depth.
  steps = 12
  dist = strategy.experimental_distribute_dataset(_reusing_source(_buffer(0), steps=steps), _options(buffer))
  kept = list(dist)
  for i, b in enumerate(kept):
    np.testing.assert_array_equal(_rows_of(strategy, b["x"])[:, 0], _expected(i))
  allocated = []
  owned_copy = host_memory.owned_copy
  monkeypatch.setattr(host_memory, "owned_copy", lambda x: allocated.append(x.shape) or owned_copy(x))
  steps = 24
  dist = strategy.experimental_distribute_dataset(_reusing_source(_buffer(0), steps=steps), _options(buffer))
  seen = set()
  for i, b in enumerate(dist):
    seen |= _device_pointers(b["x"].tree)
    total = float(strategy.reduce("SUM", strategy.run(lambda v: v["x"][:, 0], args=(b,)), axis=0))
    assert total == _expected(i).sum()
  # Fresh staging buffers for the x batches (8 replicas x 2 rows x COLS): at most depth + 4 in the pass (a
  # pool of 4 at depth 4 allocated 10-11 here), each of 8 shards.
  assert 0 < allocated.count((8, ROWS // 8, COLS)) <= buffer + STAGING_SPARE
  assert len(seen) <= 8 * (buffer + STAGING_SPARE)
