"""Strategy: the default strategy (its `extended.max_steps_in_flight`, `run`'s argument checks), a process
that holds none of the strategy's replicas."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import tpustrat

# -- the default strategy's extended.max_steps_in_flight ----------------------------------------------


BAD_BOUND = r"^strategy\.extended: `max_steps_in_flight` must be an int >= 1, got "


def test_default_strategy_reports_and_accepts_max_steps_in_flight_like_tpu_strategy(strategy):
  default = tpustrat.get_strategy()
  assert not tpustrat.has_strategy()
  for s in (default, strategy):
    ext = s.extended
    before = ext.max_steps_in_flight
    assert before == 2
    try:
      ext.max_steps_in_flight = 5
      assert ext.max_steps_in_flight == 5
      for bad in (0, -1):
        with pytest.raises(ValueError, match=BAD_BOUND):
          ext.max_steps_in_flight = bad
      for bad in (1.5, True, "3", None):
        with pytest.raises(TypeError, match=BAD_BOUND):
          ext.max_steps_in_flight = bad
      assert ext.max_steps_in_flight == 5  # a rejected value leaves the bound as it was
    finally:
      ext.max_steps_in_flight = before
  # The default strategy's run calls fn directly: the bound changes nothing there.
  assert default.run(lambda x: x + 1, (1,)) == 2


# -- a process that holds none of the strategy's replicas ---------------------------------------------
# The whole behaviour (a global value without shards, then run / reduce) needs two processes:
# tests/test_multiprocess.py::test_a_process_that_holds_no_replica_builds_values_from_function_too.


def test_a_process_without_replicas_names_the_situation_when_value_fn_fails(strategy, monkeypatch):
  # As process 1 of a job whose strategy lives on process 0's devices: value_fn is called for replica 0
  # only to learn the value's structure; if it cannot do that here, the error says why it was called.
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
  seen = []

  def value_fn(ctx):
    seen.append(ctx.replica_id_in_sync_group)
    raise KeyError("replica 0's data lives on another host")

  with pytest.raises(KeyError, match="replica 0's data") as info:
    strategy.experimental_distribute_values_from_function(value_fn)
  assert seen == [0]
  assert "process 1 holds none of the strategy's 8 replicas" in "\n".join(info.value.__notes__)


def test_default_strategy_run_validates_fn_and_kwargs_like_tpu_strategy(strategy):
  default = tpustrat.get_strategy()
  assert not tpustrat.has_strategy()
  for s in (default, strategy):
    with pytest.raises(TypeError, match=r"^strategy.run expects `kwargs` to be a dict or None, got list\.$"):
      s.run(lambda x: x, (1.0,), [("x", 1.0)])
    with pytest.raises(TypeError, match=r"^strategy.run expects a callable `fn`, got int: 3\.$"):
      s.run(3, (1.0,))
  assert default.run(lambda x, y: x + y, (1.0,), {"y": 2.0}) == 3.0
  assert default.run(lambda x: x * 2, (4.0,), None) == 8.0


def test_repr_of_values_whose_leaves_are_not_arrays():
  """`jax.tree.map(lambda x: x.shape, state)` keeps the wrappers around shapes: printing it must work."""
  per_replica = tpustrat.PerReplica([np.zeros(3, np.float32)] * 8)
  mirrored = tpustrat.Mirrored(np.zeros(3, np.float32))
  shapes = jax.tree.map(lambda x: x.shape, {"p": per_replica, "m": mirrored})
  text = repr(shapes)
  assert "PerReplica(" in text and "Mirrored(" in text and "(8, 3)" in text and "(3,)" in text
  assert repr(per_replica) == "PerReplica(num_replicas=8, component=float32[3])"
  assert repr(mirrored) == "Mirrored(float32[3])"


# -- 64-bit host integers without jax_enable_x64, and PerReplica dtypes -------------------------------

BIG = 3_000_000_000


def test_values_from_function_raises_on_int64_beyond_int32_naming_the_replica(strategy):
  assert not jax.config.jax_enable_x64

  def value_fn(ctx):
    r = ctx.replica_id_in_sync_group
    return {"ids": np.array([r, BIG if r == 5 else r], np.int64), "w": np.float32(r)}

  with pytest.raises(OverflowError, match=(
      r"^experimental_distribute_values_from_function: value_fn's value for replica 5 at \['ids'\] is int64 and "
      rf"holds {BIG} at index \(1,\), outside the int32 range")):
    strategy.experimental_distribute_values_from_function(value_fn)
  ok = strategy.experimental_distribute_values_from_function(
      lambda ctx: np.array([2**31 - 1 - ctx.replica_id_in_sync_group], np.int64))
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in ok.values]),
                                (2**31 - 1 - np.arange(8))[:, None].astype(np.int32))


def test_experimental_mirror_and_run_steps_raise_on_int64_beyond_int32(strategy):
  with pytest.raises(OverflowError, match=r"the value given to experimental_mirror .* at \['step'\] is int64 and holds 3000000000"):
    strategy.experimental_mirror({"w": np.ones(2, np.float32), "step": np.int64(BIG)})
  stacked = {"ids": np.full((3, 8, 2), BIG, np.int64)}  # 3 steps, stacked host batches
  with pytest.raises(OverflowError, match=r"^experimental_run_steps: the stacked batches at \['ids'\] is int64"):
    strategy.experimental_run_steps(lambda c, b: (c, b["ids"]), stacked, init=np.float32(0))


def test_per_replica_components_of_different_dtypes_raise(strategy):
  with pytest.raises(ValueError, match=(
      r"^PerReplica components must share one dtype .* the leaf at \['b'\] is float32 in components 0, 1, 2, 3, "
      r"5, 6, 7; int32 in component 4\.")):
    tpustrat.PerReplica([{"a": np.zeros(2, np.int32), "b": np.float32(1) if r != 4 else np.int32(1)} for r in range(8)])
  with pytest.raises(ValueError, match=r"is float32 in components 0, 1, 2, 3; bfloat16 in components 4, 5, 6, 7\."):
    tpustrat.PerReplica([jax.numpy.zeros(2, jax.numpy.float32)] * 4 + [jax.numpy.zeros(2, jax.numpy.bfloat16)] * 4)
  with pytest.raises(OverflowError, match=rf"^PerReplica: component 3, the leaf at <root>, is int64 and holds {BIG}"):
    tpustrat.PerReplica([np.int64(BIG if r == 3 else r) for r in range(8)])
  # float64 is float32 on the devices without x64 (as in JAX): those components agree there.
  mixed = tpustrat.PerReplica([np.float64(r / 3) if r % 2 else np.float32(r / 3) for r in range(8)])
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in mixed.values]), (np.arange(8) / 3).astype(np.float32))
  out = strategy.run(lambda v: v * 2, args=(mixed,))
  np.testing.assert_array_equal(np.stack([np.asarray(v) for v in out.values]), (np.arange(8) / 3).astype(np.float32) * 2)


# -- MultiWorkerMirroredStrategy, MirroredStrategy in a multi-process job, cluster_resolver (issue 32) -----


def test_mirrored_strategy_in_a_launched_job_raises_naming_the_multi_process_strategies(monkeypatch):
  # Under `python -m tpustrat.launch -n 2` it made one independent 4-replica job per process, silently.
  monkeypatch.setenv("TPUSTRAT_NUM_PROCESSES", "2")
  for devices in (None, ["/cpu:0", "/cpu:1"], jax.local_devices()):
    with pytest.raises(ValueError, match=r"TPUSTRAT_NUM_PROCESSES=2.*MultiWorkerMirroredStrategy\(\).*TPUStrategy"):
      tpustrat.MirroredStrategy(devices)


def test_every_strategy_has_a_cluster_resolver_describing_this_process(strategy):
  # TF's multi-worker tutorial reads task_type, task_id and cluster_spec(); they were None or missing.
  for s in (strategy, tpustrat.MirroredStrategy(), tpustrat.get_strategy(), tpustrat.MultiWorkerMirroredStrategy()):
    r = s.cluster_resolver
    assert isinstance(r, tpustrat.cluster_resolver.ClusterResolver), s
    assert (r.task_type, r.task_id, r.num_processes, r.process_id) == ("worker", 0, 1, 0)
    assert r.cluster_spec().as_dict() == {} and not r.cluster_spec()
    assert r.num_accelerators() == {"CPU": 8}


def test_tpu_cluster_resolver_cluster_spec_lists_one_task_per_process():
  r = tpustrat.cluster_resolver.TPUClusterResolver(coordinator_address="10.0.0.1:1234", num_processes=3,
                                                   process_id=2)
  spec = r.cluster_spec()
  assert spec.as_dict() == {"worker": ["10.0.0.1:1234", None, None]}
  assert spec.num_tasks("worker") == 3 and spec.task_address("worker", 0) == "10.0.0.1:1234"
  assert (r.task_type, r.task_id) == ("worker", 2)
  with pytest.raises(ValueError, match="address of task 1 of job 'worker' is not known"):
    spec.task_address("worker", 1)


def _lowered_run(strategy, fn):
  x = np.arange(8 * 100, dtype=np.float32).reshape(8, 100)
  value = strategy.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group])
  return jax.jit(lambda v: strategy.run(fn, args=(v,))).lower(value).as_text()


def test_multi_worker_mirrored_strategy_honours_its_communication_options(strategy):
  def step(v):
    return tpustrat.get_replica_context().all_reduce("sum", v)

  ring = tpustrat.MultiWorkerMirroredStrategy(communication_options=tpustrat.CommunicationOptions(implementation="ring"))
  plain = tpustrat.MultiWorkerMirroredStrategy()
  assert plain.num_replicas_in_sync == 8 and plain.extended.communication_options == tpustrat.CommunicationOptions()
  assert "collective_permute" in _lowered_run(ring, step) and "all_reduce" not in _lowered_run(ring, step)
  assert "all_reduce" in _lowered_run(plain, step) and "collective_permute" not in _lowered_run(plain, step)
  # A call's own options override the strategy's (TF's merge): NCCL is one all-reduce.
  nccl = tpustrat.CommunicationOptions(implementation="nccl")
  text = _lowered_run(ring, lambda v: tpustrat.get_replica_context().all_reduce("sum", v, options=nccl))
  assert "all_reduce" in text and "collective_permute" not in text
  # Values: the same sums as the session's TPUStrategy, computed with numpy.
  x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  for s in (ring, plain):
    v = s.experimental_distribute_values_from_function(lambda ctx: x[ctx.replica_id_in_sync_group])
    np.testing.assert_allclose(s.experimental_local_results(s.run(step, args=(v,)))[0], x.sum(0))
    np.testing.assert_allclose(s.experimental_local_results(s.extended.reduce_to("sum", v, destinations=v))[0],
                               x.sum(0))


def test_multi_worker_mirrored_strategy_checks_its_arguments():
  with pytest.raises(TypeError, match=r"communication_options must be a tpustrat.CommunicationOptions or None, got "
                                      r"str: 'ring'"):
    tpustrat.MultiWorkerMirroredStrategy(communication_options="ring")
  with pytest.raises(TypeError, match=r"cluster_resolver must be None or a tpustrat.cluster_resolver resolver .*got "
                                      r"dict: \{'worker'"):
    tpustrat.MultiWorkerMirroredStrategy({"worker": ["h:1"]})


def test_multi_worker_mirrored_strategy_reads_tf_config_as_tf_does(monkeypatch):
  from tpustrat._src import cluster_connection
  monkeypatch.setattr(cluster_connection, "_RESOLVER", [])  # keep the session's resolver as it was
  monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}')
  s = tpustrat.MultiWorkerMirroredStrategy()
  r = s.cluster_resolver
  assert type(r).__name__ == "TFConfigClusterResolver" and (r.task_type, r.task_id) == ("worker", 0)
  assert r.cluster_spec().as_dict() == {"worker": ["127.0.0.1:2222"]}
  # TF_CONFIG and the launcher's variables both describing a job: refused before connecting.
  monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, '
                                  '"task": {"type": "worker", "index": 1}}')
  monkeypatch.setenv("TPUSTRAT_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match=r"both TF_CONFIG \(a cluster of 2 training tasks\) and "
                                       r"TPUSTRAT_NUM_PROCESSES=2"):
    tpustrat.MultiWorkerMirroredStrategy()


# -- which process writes: extended.should_checkpoint, should_save_summary (TF's chief rule) ----------


@pytest.mark.parametrize("process", [0, 1])
def test_only_the_chief_should_checkpoint_and_save_summaries(strategy, monkeypatch, process):
  # TF's Model Garden loop reads both; they raised AttributeError. TF: True for MirroredStrategy, TPUStrategy
  # and the default strategy; on the chief only (process 0 here) for MultiWorkerMirroredStrategy, the rule of
  # every strategy that spans processes here, where every process runs the loop.
  kinds = {"TPUStrategy": strategy, "MultiWorkerMirroredStrategy": tpustrat.MultiWorkerMirroredStrategy(),
           "default": tpustrat.get_strategy()}
  if process == 0:  # a MirroredStrategy exists in one-process jobs only
    kinds["MirroredStrategy"] = tpustrat.MirroredStrategy()
  # As process `process` of a job whose replicas start on process 0's devices (this session's).
  monkeypatch.setattr(jax, "process_index", lambda *a, **k: process)
  for name, s in kinds.items():
    chief = name == "default" or process == 0
    ext = s.extended
    assert (ext.should_checkpoint, ext.should_save_summary, ext.experimental_should_init) == (chief, chief, True), name
