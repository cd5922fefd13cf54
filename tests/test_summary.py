"""`tpustrat.summary`: TF's `tf.summary` scalars written as TensorBoard event files, by process 0 only.

The event files are read back here by a reader of their own (TFRecord framing: an 8-byte length, its masked
CRC-32C, the record, its masked CRC-32C; the CRC-32C written here bit by bit and checked against its standard
check value), with tensorboardX's `Event` protocol buffer; TensorBoard's and TensorFlow's readers are not
installed. Every name, step and value is compared with what the test wrote (values as float32, exactly).
"""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat
from tpustrat import summary
from tpustrat._src import summary as summary_lib

pytest.importorskip("tensorboardX")


@pytest.fixture(autouse=True)
def _fresh_summary_state():
  """Each test starts with no default writer, no default step and recording on (the state is a thread's, so
  a writer a test leaves as the default would otherwise reach the next test on this thread)."""
  state = summary_lib._STATE  # pylint: disable=protected-access
  saved = state.writer, state.step, state.recording
  state.writer, state.step, state.recording = None, None, True
  yield
  state.writer, state.step, state.recording = saved


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc ^= byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
  return crc ^ 0xFFFFFFFF


def masked(crc: int) -> int:
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_events(folder):
  """Every event of the event files in `folder`, in file-name order then file order; each record's CRCs
  checked as TensorBoard's reader checks them."""
  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  events = []
  for path in sorted(pathlib.Path(folder).glob("events.out.tfevents.*")):
    data = path.read_bytes()
    at = 0
    while at < len(data):
      header = data[at:at + 8]
      assert int.from_bytes(data[at + 8:at + 12], "little") == masked(crc32c(header)), path
      length = int.from_bytes(header, "little")
      record = data[at + 12:at + 12 + length]
      assert int.from_bytes(data[at + 12 + length:at + 16 + length], "little") == masked(crc32c(record)), path
      events.append(event_pb2.Event.FromString(record))
      at += 16 + length
  return events


def read_scalars(folder):
  """[(tag, step, value), ...] of the scalar events in `folder`, in the order written."""
  return [(v.tag, e.step, v.simple_value) for e in read_events(folder) for v in e.summary.value]


def test_the_readers_crc_is_crc32c():
  assert crc32c(b"123456789") == 0xE3069283  # CRC-32C's standard check value


def test_scalars_read_back_with_their_names_steps_and_values(strategy, tmp_path):
  writer = summary.create_file_writer(tmp_path / "train")
  third = 1 / 3
  mirrored_value = strategy.experimental_mirror(jnp.float32(0.625))
  mirrored_step = strategy.experimental_mirror(jnp.int32(12))
  assert isinstance(mirrored_value, tpustrat.Mirrored) and isinstance(mirrored_step, tpustrat.Mirrored)
  with writer.as_default(step=3):
    assert summary.scalar("loss", np.float32(0.25))                     # the default step
    assert summary.scalar("accuracy", jnp.array(0.75, jnp.float32))     # a 0-d jax array
    assert summary.scalar("third", third)                               # a float64: written as float32
    assert summary.scalar("count", 7, step=np.int64(4))                 # an int; a numpy step
    assert summary.scalar("learning rate/eval", mirrored_value, step=mirrored_step)   # TF's tag, as given
    assert summary.scalar("flag", True, step=jnp.array(5), description="a bool, as 1.0")
    writer.flush()
    got = read_scalars(tmp_path / "train")  # flushed: on disk before the block ends or the writer closes
  assert got == [("loss", 3, 0.25), ("accuracy", 3, 0.75), ("third", 3, float(np.float32(third))),
                 ("count", 4, 7.0), ("learning rate/eval", 12, 0.625), ("flag", 5, 1.0)]
  events = read_events(tmp_path / "train")
  assert events[0].file_version == "brain.Event:2"
  assert events[-1].summary.value[0].metadata.summary_description == "a bool, as 1.0"
  (path,) = (tmp_path / "train").glob("events.out.tfevents.*")
  assert path.name.endswith(".v2")
  writer.close()


def test_a_loss_from_run_is_reduced_then_written(strategy, tmp_path):
  """The Model Garden way: the step returns the per-replica loss; the host reduces it and writes it."""
  rows = np.arange(16, dtype=np.float32).reshape(8, 2) * 0.5
  values = strategy.experimental_distribute_values_from_function(
      lambda ctx: rows[ctx.replica_id_in_sync_group])
  loss = strategy.run(lambda x: jnp.sum(x * x), args=(values,))
  assert isinstance(loss, tpustrat.PerReplica)
  writer = summary.create_file_writer(tmp_path)
  with writer.as_default(step=1):
    with pytest.raises(TypeError, match=r"scalar\('loss'\): `data` is a PerReplica.*strategy\.reduce"):
      summary.scalar("loss", loss)
    with pytest.raises(TypeError, match=r"`step` is a PerReplica.*strategy\.reduce"):
      summary.scalar("loss", 1.0, step=loss)
    assert summary.scalar("loss", strategy.reduce("MEAN", loss, axis=None))
  writer.close()
  want = np.float32(np.mean(np.sum(rows * rows, axis=1)))
  assert read_scalars(tmp_path) == [("loss", 1, float(want))]


def test_scalar_inside_a_traced_step_says_to_write_on_the_host(strategy):
  def step(x):
    summary.scalar("loss", x)
    return x

  with pytest.raises(RuntimeError, match=r"scalar\('loss'\): called while a step is traced.*return the value "
                                         r"from the step.*after run returns"):
    strategy.run(step, args=(jnp.float32(1.0),))
  with pytest.raises(RuntimeError, match="called while a step is traced"):
    jax.jit(step)(jnp.float32(1.0))


def test_only_process_0_writes_and_every_process_checks(monkeypatch, tmp_path):
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
  writer = summary.create_file_writer(tmp_path / "logs")
  assert not (tmp_path / "logs").exists()  # process 1 opens no file
  with writer.as_default(step=2):
    assert summary.should_record_summaries()  # as on process 0: a collective for a summary runs everywhere
    assert summary.scalar("loss", 0.5) is False
    with pytest.raises(ValueError, match=r"shape \(\)"):
      summary.scalar("loss", np.zeros(2))
  with writer.as_default():
    with pytest.raises(ValueError, match="no step"):
      summary.scalar("loss", 0.5)
  writer.close()
  assert not (tmp_path / "logs").exists()


def test_a_missing_tensorboardx_names_the_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # `import tensorboardX` raises ImportError
  with pytest.raises(ImportError, match=r"create_file_writer .*pip install 'tpustrat\[tensorboard\]'"):
    summary.create_file_writer(tmp_path)
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
  with pytest.raises(ImportError, match=r"tpustrat\[tensorboard\]"):  # on every process, not only process 0
    summary.create_file_writer(tmp_path)


def test_record_if_and_should_record_summaries(tmp_path):
  writer = summary.create_file_writer(tmp_path)
  assert not summary.should_record_summaries()  # no default writer
  assert summary.scalar("x", 1.0, step=0) is False
  calls = []

  def every_other():
    calls.append(None)
    return len(calls) % 2 == 1

  with writer.as_default(step=0):
    assert summary.should_record_summaries()
    with summary.record_if(False):
      assert not summary.should_record_summaries()
      assert summary.scalar("x", 1.0) is False
      with summary.record_if(np.bool_(True)):  # the inner condition holds inside the inner block
        assert summary.scalar("x", 2.0)
    with summary.record_if(every_other):  # called at each scalar
      results = [summary.scalar("y", float(i), step=i) for i in range(4)]
    assert results == [True, False, True, False] and len(calls) == 4
    with pytest.raises(TypeError, match=r"record_if: `condition` must be a bool"):
      with summary.record_if("yes"):
        pass
    with summary.record_if(lambda: 1):
      with pytest.raises(TypeError, match=r"record_if: `condition\(\)` must be a bool"):
        summary.scalar("x", 1.0)
  writer.close()
  assert read_scalars(tmp_path) == [("x", 0, 2.0), ("y", 0, 0.0), ("y", 2, 2.0)]


def test_writers_steps_and_the_noop_writer_follow_tf(tmp_path):
  a, b = summary.create_file_writer(tmp_path / "a"), summary.create_file_writer(tmp_path / "b")
  with a.as_default(step=10):
    summary.scalar("v", 1.0)
    with b.as_default(step=20):
      summary.scalar("v", 2.0)
      with b.as_default():  # no step given: the default step stays
        summary.scalar("v", 3.0)
    summary.scalar("v", 4.0)  # a and its step again
    with summary.create_noop_writer().as_default(step=99):  # TF's no-op writer changes nothing
      summary.scalar("v", 5.0)
  with summary.create_noop_writer().as_default(step=1):
    assert summary.scalar("v", 6.0) is False  # no default writer
  b.set_as_default(step=30)  # for good
  summary.scalar("v", 7.0)
  summary.flush()
  assert read_scalars(tmp_path / "b") == [("v", 20, 2.0), ("v", 20, 3.0), ("v", 30, 7.0)]
  a.close()
  b.close()
  assert read_scalars(tmp_path / "a") == [("v", 10, 1.0), ("v", 10, 4.0), ("v", 10, 5.0)]
  with pytest.raises(RuntimeError, match="closed"):
    summary.scalar("v", 8.0)  # b, the default writer, is closed
  with pytest.raises(RuntimeError, match="closed"):
    a.as_default()
  a.close()  # twice is fine
  two = [summary.create_file_writer(tmp_path / "c") for _ in range(2)]  # in the same second: two files
  assert len(list((tmp_path / "c").glob("events.out.tfevents.*"))) == 2
  for w in two:
    w.close()


def test_max_queue_flushes_without_a_call(tmp_path):
  writer = summary.create_file_writer(tmp_path, max_queue=3)  # the file-version event and two scalars
  with writer.as_default(step=0):
    summary.scalar("x", 1.0)
    summary.scalar("x", 2.0)
    assert read_scalars(tmp_path) == [("x", 0, 1.0), ("x", 0, 2.0)]
  writer.close()


@pytest.mark.parametrize("data, error, match", [
    (np.zeros(1), ValueError, r"must be a scalar \(shape \(\)\).*got shape \(1,\)"),
    (1 + 2j, TypeError, "must be a real number, got dtype complex128"),
    ("0.5", TypeError, "must be a real number"),
    (tpustrat.Mirrored({"a": 1.0, "b": 2.0}), TypeError, "Mirrored pytree"),
])
def test_data_that_is_not_one_real_number_is_refused(tmp_path, data, error, match):
  writer = summary.create_file_writer(tmp_path)
  with writer.as_default(step=0):
    with pytest.raises(error, match=match):
      summary.scalar("x", data)
  writer.close()


@pytest.mark.parametrize("step", [1.0, True, np.zeros(1, np.int32), jnp.float32(2.0)])
def test_a_step_that_is_not_an_integer_is_refused(tmp_path, step):
  writer = summary.create_file_writer(tmp_path)
  with pytest.raises(TypeError, match="`step` must be an integer"):
    with writer.as_default(step=step):
      pass
  with pytest.raises(TypeError, match="`step` must be an integer"):
    summary.scalar("x", 1.0, step=step)  # no writer: checked all the same (as on every process)
  writer.close()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"logdir": ""}, ValueError, "non-empty path"),
    ({"logdir": 3}, TypeError, "non-empty path"),
    ({"logdir": "x", "max_queue": 0}, ValueError, "max_queue"),
    ({"logdir": "x", "flush_millis": 1.5}, TypeError, "flush_millis"),
    ({"logdir": "x", "filename_suffix": 2}, TypeError, "filename_suffix"),
])
def test_bad_writer_arguments_are_named(kwargs, error, match):
  with pytest.raises(error, match=match):
    summary.create_file_writer(**kwargs)
