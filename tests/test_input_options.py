"""Input options and the input context: `InputOptions` (checked when made, `drop_remainder`) and the
`InputContext` handed to ``dataset_fn``."""

import numpy as np
import pytest

import tpustrat
from tpustrat._src.input.options import buffer_size


@pytest.mark.parametrize("kwargs, error, name", [
    ({"experimental_fetch_to_device": 1}, TypeError, "experimental_fetch_to_device"),
    ({"experimental_fetch_to_device": "no"}, TypeError, "'no'"),
    ({"drop_remainder": None}, TypeError, "drop_remainder"),
    ({"drop_remainder": np.bool_(True)}, TypeError, "drop_remainder"),
    ({"experimental_per_replica_buffer_size": 2.0}, TypeError, "2.0"),
    ({"experimental_per_replica_buffer_size": True}, TypeError, "experimental_per_replica_buffer_size"),
    ({"experimental_per_replica_buffer_size": -1}, ValueError, "got -1"),
    ({"experimental_per_replica_buffer_size": -3}, ValueError, "-3"),
    ({"experimental_per_replica_buffer_size": "1"}, TypeError, "an int >= 0 or None"),
])
def test_input_options_are_validated_at_construction(kwargs, error, name):
  with pytest.raises(error, match=name):
    tpustrat.InputOptions(**kwargs)


def test_input_options_accept_valid_values():
  o = tpustrat.InputOptions(experimental_fetch_to_device=False, experimental_per_replica_buffer_size=4,
                            drop_remainder=True)
  assert (o.experimental_fetch_to_device, o.experimental_per_replica_buffer_size, o.drop_remainder) == (
      False, 4, True)


def test_buffer_size_default_depends_on_the_platform():
  # None (the default): no prefetch thread on XLA:CPU, one batch ahead on GPU and TPU (TF's default);
  # an explicit size is kept everywhere, 0 included.
  assert tpustrat.InputOptions().experimental_per_replica_buffer_size is None
  assert [buffer_size(tpustrat.InputOptions(), p) for p in ("cpu", "gpu", "tpu", "cuda", "rocm")] == [0, 1, 1, 1, 1]
  for size in (0, 1, 3):
    options = tpustrat.InputOptions(experimental_per_replica_buffer_size=size)
    assert [buffer_size(options, p) for p in ("cpu", "gpu", "tpu")] == [size] * 3
  assert "XLA:CPU" in tpustrat.InputOptions.__doc__


def test_drop_remainder_drops_batches_smaller_than_the_largest_before_them(strategy):
  options = tpustrat.InputOptions(drop_remainder=True)
  sizes = [16, 16, 4]  # the usual case: the partial last batch is dropped
  dist = strategy.experimental_distribute_dataset([np.ones(n, np.float32) for n in sizes], options=options)
  assert [float(strategy.reduce("SUM", b, axis=0)) for b in dist] == [16.0, 16.0]
  sizes = [8, 16, 8, 16]  # a first batch smaller than a later one is kept; later smaller ones are not
  dist = strategy.experimental_distribute_dataset([np.ones(n, np.float32) for n in sizes], options=options)
  assert [float(strategy.reduce("SUM", b, axis=0)) for b in dist] == [8.0, 16.0, 16.0]
  doc = tpustrat.InputOptions.__doc__
  assert "largest" in doc and "smaller than the first" not in doc


def test_input_context():
  ctx = tpustrat.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
  assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 8)
  assert ctx.get_per_replica_batch_size(32) == 4
  with pytest.raises(ValueError, match="`global_batch_size` 30 is not divisible by `num_replicas_in_sync` 8"):
    ctx.get_per_replica_batch_size(30)
  with pytest.raises(ValueError, match="input_pipeline_id"):
    tpustrat.InputContext(num_input_pipelines=1, input_pipeline_id=1)


def test_bad_options(strategy):
  with pytest.raises(TypeError, match="tpustrat.InputOptions"):
    strategy.experimental_distribute_dataset([np.zeros(16)], options={"experimental_fetch_to_device": False})


def _per_replica_pipelines(sizes_by_replica):
  """`dataset_fn` for datasets_from_function (one process: one input pipeline, whose consecutive batches
  go to replicas 0, 1, ..., 7 in each step): replica r's batches have the given sizes, its rows numbered
  ``1000 * r + i`` so that every row is known."""
  def dataset_fn(ctx):
    assert ctx.num_input_pipelines == 1
    batches, starts = [], [0] * len(sizes_by_replica)
    for step in range(max(len(s) for s in sizes_by_replica)):
      for r, sizes in enumerate(sizes_by_replica):
        if step < len(sizes):
          batches.append(np.arange(starts[r], starts[r] + sizes[step], dtype=np.float32) + 1000 * r)
          starts[r] += sizes[step]
    return batches
  return dataset_fn


def test_drop_remainder_from_function_is_tfs_rule_per_pipeline(strategy):
  options = tpustrat.InputOptions(drop_remainder=True)
  # One pipeline batches 1 row where the others batch 2, from the first step on: its batch size, not a
  # remainder. Nothing is dropped (the step is padded); TF's per-pipeline drop_remainder drops nothing either.
  sizes = [[2, 2]] * 7 + [[1, 1]]
  dist = strategy.experimental_distribute_datasets_from_function(_per_replica_pipelines(sizes), options=options)
  steps = [sorted(np.asarray(strategy.gather(b, axis=0)).tolist()) for b in dist]
  want = [sorted([1000.0 * r + i for r in range(8) for i in ((0, 1) if r < 7 else (0,))]),
          sorted([1000.0 * r + i for r in range(8) for i in ((2, 3) if r < 7 else (1,))])]
  assert steps == want
  # A pipeline's last batch smaller than its earlier ones is its remainder: that step is dropped (TF's
  # iterator ends where a pipeline runs out), the full steps before it are kept.
  sizes = [[2, 2, 2]] * 7 + [[2, 2, 1]]
  dist = strategy.experimental_distribute_datasets_from_function(_per_replica_pipelines(sizes), options=options)
  assert [len(s) for s in (np.asarray(strategy.gather(b, axis=0)) for b in dist)] == [16, 16]
  # Without drop_remainder every row is used.
  dist = strategy.experimental_distribute_datasets_from_function(_per_replica_pipelines(sizes))
  assert [len(s) for s in (np.asarray(strategy.gather(b, axis=0)) for b in dist)] == [16, 16, 15]


def test_drop_remainder_is_decided_per_pass_and_survives_a_restore(strategy):
  options = tpustrat.InputOptions(drop_remainder=True)
  sizes = [8, 16, 16, 12]  # the first batch is smaller than later ones (kept), the last is a remainder
  dist = strategy.experimental_distribute_dataset([np.ones(n, np.float32) for n in sizes], options=options)
  for _ in range(2):  # every epoch the same: the reference is the pass's own batches
    assert [float(strategy.reduce("SUM", b, axis=0)) for b in dist] == [8.0, 16.0, 16.0]
  # A position taken before the remainder restores the reference too: the remainder is still dropped.
  it = iter(dist)
  next(it), next(it)
  state = it.get_state()
  assert state["largest_batch"][0] == 16
  again = iter(dist)
  again.set_state(state)
  assert [float(strategy.reduce("SUM", b, axis=0)) for b in again] == [16.0]
  with pytest.raises(ValueError, match="largest_batch"):
    iter(dist).set_state({**state, "largest_batch": [16, "x"]})


def test_drop_remainder_from_function_stops_where_a_pipeline_runs_out(strategy):
  options = tpustrat.InputOptions(drop_remainder=True)
  # Replica 0's second batch is short: TF's iterator stops there, later full steps included.
  sizes = [[2, 1, 2]] + [[2, 2, 2]] * 7
  dist = strategy.experimental_distribute_datasets_from_function(_per_replica_pipelines(sizes), options=options)
  assert [np.asarray(strategy.gather(b, axis=0)).shape[0] for b in dist] == [16]
