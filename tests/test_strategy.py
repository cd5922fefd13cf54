"""Strategy edge cases (issue 13): the default strategy's `extended.max_steps_in_flight`, a process that
holds none of the strategy's replicas."""

from __future__ import annotations

import jax
import pytest

import tpustrat

# -- the default strategy's extended.max_steps_in_flight ----------------------------------------------


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
      for bad in (0, -1, 1.5, True, "3", None):
        with pytest.raises(ValueError, match=r"max_steps_in_flight must be an int >= 1, got "):
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
