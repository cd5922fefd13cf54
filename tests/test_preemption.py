"""`tpustrat.PreemptionCheckpointHandler` / `TerminationConfig`, launcher restarts and the step watchdog.

The end-to-end tests run one training loop (`tests/_preemption_scripts/linear_sgd.py`: a linear model,
SGD, a shuffled grain dataset, a checkpoint every 10 steps, 60 steps) four ways, in real processes on
loopback, and compare each interrupted run with the uninterrupted one on the same layout: the final
parameters bit for bit, `total_run_calls`, and the examples of every step. The in-process tests cover
the handler's API with a watcher function and an exit function that does not exit.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KeyValueStore

import tpustrat
from tpustrat._src import names, preemption, termination_notice, watchdog

SCRIPT = pathlib.Path(__file__).resolve().parent / "_preemption_scripts" / "linear_sgd.py"
EARLY_NOTICE = SCRIPT.with_name("early_notice.py")
ROOT = SCRIPT.parents[2]
STEPS = 60


def _env(**extra: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}
  env.update(extra)
  return env


def _single(ckpt: pathlib.Path, out: pathlib.Path, *fault: str, attempt: int = 0) -> subprocess.CompletedProcess:
  """The script as one process with 8 CPU devices, run by hand (`attempt` labels its records only)."""
  env = _env(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
             TPUSTRAT_RESTART_COUNT=str(attempt))
  return subprocess.run([sys.executable, str(SCRIPT), str(ckpt), str(out), *fault], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=300)


def _launched(ckpt: pathlib.Path, out: pathlib.Path, *args: str, fault: tuple[str, ...] = (),
              timeout: float = 300, script: pathlib.Path = SCRIPT) -> subprocess.CompletedProcess:
  """The script as 2 processes x 4 CPU devices under the launcher."""
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--heartbeat-timeout", "10", *args,
             str(script), str(ckpt), str(out), *fault]
  return subprocess.run(command, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _steps(out: pathlib.Path, process: int = 0) -> list[dict]:
  return [json.loads(line) for line in (out / f"steps_p{process}.jsonl").read_text().splitlines()]


def _trained(records: list[dict], resumed_at: dict[int, int]) -> list[dict]:
  """The steps whose updates are in the final state: each attempt's steps up to the step the next
  attempt resumed from (`resumed_at`: attempt -> its first step minus one)."""
  kept = []
  attempts = sorted({r["attempt"] for r in records})
  for a in attempts:
    end = resumed_at.get(a + 1, STEPS)
    kept += [r for r in records if r["attempt"] == a and r["step"] <= end]
  return kept


def _checkpoints(ckpt: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


def _starts(output: str) -> dict[int, int]:
  """attempt -> the step it started at, from the processes' 'attempt A starts at step S' lines."""
  found = {}
  for line in output.splitlines():
    if " attempt " in line and " starts at step " in line:
      words = line.split()
      found[int(words[words.index("attempt") + 1])] = int(words[-1])
  return found


def _assert_same_training(reference: pathlib.Path, run: pathlib.Path, output: str, processes: int) -> None:
  ref_final, final = np.load(reference / "final.npz"), np.load(run / "final.npz")
  np.testing.assert_array_equal(final["w"], ref_final["w"])  # bit for bit
  assert int(final["total_run_calls"]) == STEPS
  starts = _starts(output)
  for p in range(processes):
    expected = [(r["step"], r["ids"]) for r in _steps(reference, p)]
    trained = [(r["step"], r["ids"]) for r in _trained(_steps(run, p), starts)]
    assert [s for s, _ in trained] == list(range(1, STEPS + 1))  # every step once
    assert trained == expected  # the same examples at every step
    ids = [i for _, batch in trained for i in batch]
    assert sorted(ids) == list(range(STEPS * 16))  # none skipped, none repeated


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The uninterrupted runs: one process (by hand) and 2 processes x 4 devices (launcher)."""
  base = tmp_path_factory.mktemp("uninterrupted")
  runs = {}
  for layout in ("single", "launched"):
    ckpt, out = base / f"{layout}_ckpt", base / f"{layout}_out"
    out.mkdir()
    done = _single(ckpt, out) if layout == "single" else _launched(ckpt, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _checkpoints(ckpt) == [10, 20, 30, 40, 50, 60]
    runs[layout] = out
  return runs


@pytest.mark.processes
def test_sigterm_on_one_of_two_processes_saves_at_one_step_and_the_restarted_job_resumes(uninterrupted, tmp_path):
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  done = _launched(ckpt, out, "--max-restarts", "1", fault=("--fault", "term", "--at", "23", "--process", "1"))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "restarting the job (restart 1 of 1): process " in done.stderr
  assert f"status {names.EXIT_RESTART}" in done.stderr
  starts = _starts(done.stdout)
  # Process 1 got SIGTERM during call 23; every process saved at the same call, 23 or 24 (no step after
  # 23 lost), and the second attempt started there.
  assert starts[0] == 0 and starts[1] in (23, 24), starts
  saved = starts[1]
  for p in (0, 1):  # both processes saved it
    assert f"[proc {p}] tpustrat: process {p}: saved checkpoint {saved} after a termination notice" in done.stderr
  assert _checkpoints(ckpt) == sorted({10, 20, saved, 30, 40, 50, 60})
  _assert_same_training(uninterrupted["launched"], out, done.stdout, processes=2)


@pytest.mark.processes
def test_sigterm_before_the_handler_exists_saves_at_the_first_agreed_step(uninterrupted, tmp_path):
  """Process 1 gets SIGTERM after connecting (JAX's own notifier installed) and before it creates its
  handler: the handler takes the notice when created, and both processes save at the first call they agree
  on; the restarted job resumes there and ends as the uninterrupted run."""
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  done = _launched(ckpt, out, "--max-restarts", "1", fault=("--process", "1"), script=EARLY_NOTICE)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "process 1 got SIGTERM before creating its handler" in done.stdout
  assert "[proc 1] tpustrat: process 1: SIGTERM received before a PreemptionCheckpointHandler exists" in done.stderr
  assert "before this PreemptionCheckpointHandler existed counts as a termination notice" in done.stderr
  assert "restarting the job (restart 1 of 1): process " in done.stderr
  assert f"status {names.EXIT_RESTART}" in done.stderr
  starts = _starts(done.stdout)
  assert starts[0] == 0, starts
  saved = starts[1]
  # The notice came before call 1's check on process 1: the agreed call is 1, or a few calls later on a
  # process that had dispatched those calls before it saw the notice; long before the first periodic save.
  assert 1 <= saved < 10, saved
  for p in (0, 1):
    assert f"[proc {p}] tpustrat: process {p}: saved checkpoint {saved} after a termination notice" in done.stderr
  assert _checkpoints(ckpt) == [saved, 10, 20, 30, 40, 50, 60]
  _assert_same_training(uninterrupted["launched"], out, done.stdout, processes=2)


@pytest.mark.processes
def test_sigkill_resumes_from_the_last_periodic_checkpoint(uninterrupted, tmp_path):
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  done = _launched(ckpt, out, "--max-restarts", "1", fault=("--fault", "kill", "--at", "23", "--process", "1"))
  assert done.returncode == 0, done.stderr[-3000:]
  assert "restarting the job (restart 1 of 1): process 1 was killed by SIGKILL" in done.stderr
  assert _starts(done.stdout) == {0: 0, 1: 20}  # no chance to save: the step-20 checkpoint
  assert _checkpoints(ckpt) == [10, 20, 30, 40, 50, 60]
  _assert_same_training(uninterrupted["launched"], out, done.stdout, processes=2)


@pytest.mark.processes
def test_sigterm_on_one_process_then_run_again_by_hand(uninterrupted, tmp_path):
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  first = _single(ckpt, out, "--fault", "term", "--at", "23")
  assert first.returncode == names.EXIT_RESTART, first.stderr[-3000:]
  assert _checkpoints(ckpt) == [10, 20, 23]  # one process: the notice came before call 23's check
  second = _single(ckpt, out, attempt=1)
  assert second.returncode == 0, second.stderr[-3000:]
  output = first.stdout + second.stdout
  assert _starts(output) == {0: 0, 1: 23}
  _assert_same_training(uninterrupted["single"], out, output, processes=1)


@pytest.mark.processes
def test_a_stuck_process_stops_the_job_within_the_step_timeout(tmp_path):
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  start = time.monotonic()
  done = _launched(ckpt, out, "--step-timeout", "20", fault=("--fault", "hang", "--at", "20", "--process", "1"),
                   timeout=180)
  elapsed = time.monotonic() - start
  assert done.returncode != 0
  assert elapsed < 90, f"{elapsed:.1f} s"
  assert "process 1 hangs before step 20" in done.stdout
  # Process 0 waits at step 20 (its 20th dispatched step); process 1 reached step 19 and stopped there.
  assert "step watchdog: process 0 has waited" in done.stderr, done.stderr[-3000:]
  assert "processes behind: process 1 (last step reached: 19)" in done.stderr, done.stderr[-3000:]
  assert f"status {names.EXIT_STEP_TIMEOUT}" in done.stderr


# -- the handler in this process ---------------------------------------------------------------------


class _Notice:
  """A termination_watcher_fn that a test turns on."""

  def __init__(self) -> None:
    self.on = False

  def __call__(self) -> bool:
    return self.on


def _wait_for(predicate, seconds: float = 10.0) -> None:
  deadline = time.monotonic() + seconds
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.01)


def _sum_step(strategy):
  def train(state, batch):
    new = strategy.run(lambda w, x: {"w": w["w"] + tpustrat.get_replica_context().all_reduce("sum", x.sum())},
                       args=(state, batch))
    return (new,)
  return train


def _batches(strategy, n: int):
  return strategy.experimental_distribute_dataset([np.full(8, i + 1, np.float32) for i in range(n)])


def _value(strategy, state) -> float:
  return float(np.asarray(strategy.experimental_local_results(state["w"])[0]))


def test_a_watcher_notice_saves_the_state_and_position_of_that_call_and_calls_exit_fn(strategy, tmp_path):
  notice, exits = _Notice(), []

  def exit_fn():  # does not exit; the notice ends (a watcher function that stays True notices again)
    exits.append(1)
    notice.on = False

  config = tpustrat.TerminationConfig(termination_watcher_fn=notice, exit_fn=exit_fn)
  it = iter(_batches(strategy, 10))
  with tpustrat.PreemptionCheckpointHandler(None, tmp_path / "ckpt", termination_config=config) as handler:
    state = handler.restore({"w": tpustrat.Mirrored(jnp.float32(0))}, iterator=it)
    train = _sum_step(strategy)
    for _ in range(3):
      (state,) = handler.run(train, state, next(it))
    notice.on = True
    _wait_for(lambda: handler._local_notice)  # pylint: disable=protected-access  # the thread polled it
    (state,) = handler.run(train, state, next(it))  # call 4: the notice came before its check
    assert exits == [1] and handler.checkpoint_manager.all_steps() == [4]
    (state,) = handler.run(train, state, next(it))  # exit_fn returned: training goes on
    assert handler.total_run_calls == 5
  expected = 8 * sum(range(1, 5))  # batches 1..4, 8 replicas each
  it2 = iter(_batches(strategy, 10))
  with tpustrat.PreemptionCheckpointHandler(None, tmp_path / "ckpt", termination_config=config) as again:
    restored = again.restore({"w": tpustrat.Mirrored(jnp.float32(0))}, iterator=it2)
    assert again.total_run_calls == 4 and _value(strategy, restored) == expected
    first = np.asarray(strategy.experimental_local_results(next(it2))[0])
    np.testing.assert_array_equal(first, [5.0])  # the batch after the saved ones


def test_sigterm_in_this_process_is_the_default_notice(strategy, tmp_path):
  exits = []
  previous = signal.getsignal(signal.SIGTERM)
  config = tpustrat.TerminationConfig(exit_fn=lambda: exits.append(1))
  handler = tpustrat.PreemptionCheckpointHandler(None, str(tmp_path), termination_config=config)
  try:
    state = handler.restore({"w": tpustrat.Mirrored(jnp.float32(0))})
    os.kill(os.getpid(), signal.SIGTERM)
    (state,) = handler.run(_sum_step(strategy), state, _batches(strategy, 1).__iter__().__next__())
    assert exits == [1] and handler.checkpoint_manager.all_steps() == [1]
  finally:
    handler.close()
  assert signal.getsignal(signal.SIGTERM) == previous  # put back


def test_a_sigterm_kept_from_before_the_handler_existed_saves_at_its_first_call(strategy, tmp_path, monkeypatch):
  """What connecting installs (`termination_notice`), here in one process: the signal is recorded, the
  process goes on, and the handler created afterwards saves at call 1; a handler with a watcher function
  (not SIGTERM) leaves the notice alone."""
  previous = signal.getsignal(signal.SIGTERM)
  for name, value in (("_installed", False), ("_received", None), ("_previous", None)):
    monkeypatch.setattr(termination_notice, name, value)
  try:
    assert termination_notice.install(0)
    assert signal.getsignal(signal.SIGTERM) is termination_notice.handler()
    os.kill(os.getpid(), signal.SIGTERM)
    _wait_for(lambda: termination_notice._received is not None)  # pylint: disable=protected-access
    watched = tpustrat.PreemptionCheckpointHandler(
        None, tmp_path / "other", termination_config=tpustrat.TerminationConfig(termination_watcher_fn=lambda: False))
    watched.close()
    exits = []
    config = tpustrat.TerminationConfig(exit_fn=lambda: exits.append(1))
    handler = tpustrat.PreemptionCheckpointHandler(None, tmp_path / "ckpt", termination_config=config)
    try:
      assert termination_notice.take() is None  # the handler took it
      state = handler.restore({"w": tpustrat.Mirrored(jnp.float32(0))})
      (state,) = handler.run(_sum_step(strategy), state, next(iter(_batches(strategy, 1))))
      assert exits == [1] and handler.checkpoint_manager.all_steps() == [1]
      assert _value(strategy, handler.checkpoint_manager.restore(1, target=state)) == 8.0
    finally:
      handler.close()
    assert signal.getsignal(signal.SIGTERM) is termination_notice.handler()  # put back: notices are kept again
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_default_exit_is_the_restart_status(strategy, tmp_path, monkeypatch):
  def hard_exit(status):  # os._exit, here as an exception the test can catch
    raise SystemExit(status)

  monkeypatch.setattr(preemption, "_hard_exit", hard_exit)
  notice = _Notice()
  notice.on = True
  handler = tpustrat.PreemptionCheckpointHandler(
      None, str(tmp_path), termination_config=tpustrat.TerminationConfig(termination_watcher_fn=notice))
  state = handler.restore({"w": tpustrat.Mirrored(jnp.float32(0))})
  _wait_for(lambda: handler._local_notice)  # pylint: disable=protected-access
  with pytest.raises(SystemExit) as exit_info:
    handler.run(lambda s: (s,), state)
  assert exit_info.value.code == names.EXIT_RESTART == 42
  assert handler.checkpoint_manager.all_steps() == [1]


def test_grace_period_saves_at_once_then_again_before_it_ends(strategy, tmp_path):
  notice, exits, saves = _Notice(), [], []

  def save_fn(step, state, iterator):
    saves.append((step, _value(strategy, state), iterator))

  config = tpustrat.TerminationConfig(termination_watcher_fn=notice, exit_fn=lambda: exits.append(time.monotonic()),
                                      grace_period=1.5, save_fn=save_fn)

  def add_one(w):
    return {"w": w["w"] + 1.0}

  def step(s):
    return (strategy.run(add_one, args=(s,)),)

  with tpustrat.PreemptionCheckpointHandler(None, tmp_path, termination_config=config) as handler:
    state = handler.restore({"w": tpustrat.Mirrored(jnp.float32(0))})
    sent = time.monotonic()  # the notice is noticed after this
    notice.on = True
    _wait_for(lambda: handler._local_notice)  # pylint: disable=protected-access
    noticed = time.monotonic()  # ... and before this
    first_save_call = None  # the duration of the call that made the first save: at least that save's
    while not exits:
      began = time.monotonic()
      (state,) = handler.run(step, state)
      if first_save_call is None and saves:
        first_save_call = time.monotonic() - began
      assert time.monotonic() - noticed < 10
  assert saves[0][:2] == (1, 1.0)  # the first call after the notice: at once, without exiting
  assert len(saves) == 2 and saves[1][0] > 1 and saves[1][1] == saves[1][0]  # the final save exits
  # The final round starts at the notice + the grace period - (twice the first save + 1 s): not before
  # (bounded with the first save's call, which contains the save), and well before the grace period ends.
  assert exits[0] - sent >= 1.5 - (2 * first_save_call + 1.0)
  assert exits[0] - noticed <= 1.5 + 0.5


def test_save_checkpoint_if_preempted_counts_calls_like_run(strategy, tmp_path):
  notice, exits = _Notice(), []
  config = tpustrat.TerminationConfig(termination_watcher_fn=notice, exit_fn=lambda: exits.append(1))
  with tpustrat.PreemptionCheckpointHandler(None, tmp_path, termination_config=config) as handler:
    state = {"w": jnp.float32(0)}
    for _ in range(2):
      state = {"w": state["w"] + 1}
      handler.save_checkpoint_if_preempted(state)
    assert handler.total_run_calls == 2 and not exits
    notice.on = True
    _wait_for(lambda: handler._local_notice)  # pylint: disable=protected-access
    handler.save_checkpoint_if_preempted({"w": state["w"] + 1})
    assert exits == [1] and handler.checkpoint_manager.all_steps() == [3]
    assert float(handler.checkpoint_manager.restore(3, target={"w": jnp.float32(0)})["w"]) == 3.0


def test_watch_preemption_scope_turns_an_error_after_a_notice_into_the_exit(tmp_path):
  notice, exits = _Notice(), []
  config = tpustrat.TerminationConfig(termination_watcher_fn=notice, exit_fn=lambda: exits.append(1))
  with tpustrat.PreemptionCheckpointHandler(None, tmp_path, termination_config=config) as handler:
    with pytest.raises(ValueError, match="before"):
      with handler.watch_preemption_scope():
        raise ValueError("before the notice: a crash")
    assert exits == []
    notice.on = True
    _wait_for(lambda: handler._local_notice)  # pylint: disable=protected-access
    with pytest.raises(RuntimeError):  # exit_fn returned: the error still propagates
      with handler.watch_preemption_scope():
        raise RuntimeError("a peer left")
    assert exits == [1]


def test_restore_without_a_checkpoint_returns_the_initial_state(tmp_path):
  config = tpustrat.TerminationConfig(termination_watcher_fn=lambda: False)
  with tpustrat.PreemptionCheckpointHandler(None, tmp_path, termination_config=config) as handler:
    init = {"w": jnp.arange(3.0)}
    assert handler.restore(init) is init and handler.total_run_calls == 0


def test_bad_arguments_are_named(tmp_path):
  config = tpustrat.TerminationConfig(termination_watcher_fn=lambda: False)
  with pytest.raises(TypeError, match="checkpoint_manager must be"):
    tpustrat.PreemptionCheckpointHandler(None, 3, termination_config=config)
  with pytest.raises(TypeError, match="termination_config must be"):
    tpustrat.PreemptionCheckpointHandler(None, tmp_path, termination_config={"grace_period": 1})
  with pytest.raises(ValueError, match="grace_period must be"):
    tpustrat.TerminationConfig(grace_period=-1)
  with pytest.raises(TypeError, match="exit_fn must be callable"):
    tpustrat.TerminationConfig(exit_fn=42)
  manager = tpustrat.checkpoint.CheckpointManager(tmp_path / "a")
  with pytest.raises(ValueError, match="differs from the directory"):
    tpustrat.PreemptionCheckpointHandler(None, manager, checkpoint_dir=tmp_path / "b", termination_config=config)
  resolver = tpustrat.cluster_resolver.TPUClusterResolver(coordinator_address="127.0.0.1:1", num_processes=2,
                                                          process_id=0)
  with pytest.raises(ValueError, match="describes a job of 2 processes, but this process runs in a job of 1"):
    tpustrat.PreemptionCheckpointHandler(resolver, manager, termination_config=config)
  with tpustrat.PreemptionCheckpointHandler(None, manager, termination_config=config) as handler:
    with pytest.raises(TypeError, match=r"must return a tuple \(new_state, \*outputs\)"):
      handler.run(lambda s: s, {"w": 1})
    with pytest.raises(TypeError, match="must have get_state"):
      handler.restore({}, iterator=iter([1]))


@pytest.mark.parametrize("value, error", [
    (-1, ValueError), (math.inf, ValueError), (math.nan, ValueError), (2**40, ValueError),
    (names.MAX_TIMEOUT_SECONDS + 1, ValueError), ("30", TypeError), (True, TypeError),
])
def test_grace_period_is_range_checked_like_every_timeout(value, error):
  # inf and 2**40 used to be accepted (issue 31 item 8); the range is every timeout's: [0, 2**31 - 1] s.
  with pytest.raises(error, match=re.escape(
      f"TerminationConfig: grace_period must be a number of seconds in [0, {names.MAX_TIMEOUT_SECONDS}], got ")):
    tpustrat.TerminationConfig(grace_period=value)
  for bound in (0, 0.5, names.MAX_TIMEOUT_SECONDS):
    assert tpustrat.TerminationConfig(grace_period=bound).grace_period == bound


# -- the step watchdog in this process ---------------------------------------------------------------


class _Pending:
  def __init__(self):
    self.ready = False

  def is_ready(self):
    return self.ready


def test_watchdog_fires_on_a_step_that_waits_too_long_and_names_who_is_behind():
  client = KeyValueStore({"tpustrat/watchdog/steps/1": "19", "tpustrat/watchdog/steps/2": "20"})
  messages = []
  dog = watchdog.Watchdog(0.3, process_index=0, process_count=4, client=client, exit_fn=messages.append)
  try:
    for _ in range(19):
      done = _Pending()
      done.ready = True
      dog.note(done, 1)
    stuck = _Pending()
    dog.note(stuck, 1)  # step 20 never finishes
    _wait_for(lambda: messages, 5)
  finally:
    dog.stop()
  text = messages[0]
  assert "process 0 has waited" in text and "for step 20" in text and "(step timeout 0.3 s)" in text
  assert "processes behind: process 1 (last step reached: 19)." in text
  assert "processes that never reported a step: process 3." in text
  assert "process 2" not in text.split("processes behind")[1].split("\n")[0]  # at step 20: not behind
  assert client.values["tpustrat/watchdog/steps/0"] == "20"  # published
  assert client.values["tpustrat/watchdog/abort"] == text  # the others stop too


def test_watchdog_does_not_fire_on_finished_steps_and_stops_when_another_process_fired():
  client = KeyValueStore()
  messages = []
  dog = watchdog.Watchdog(0.2, process_index=1, process_count=2, client=client, exit_fn=messages.append)
  try:
    done = _Pending()
    done.ready = True
    dog.note(done, 3)  # a finished 3-step program, long ago: nothing to report
    time.sleep(0.6)
    assert messages == []
    client.values["tpustrat/watchdog/abort"] = "tpustrat: step watchdog: process 0 has waited ..."
    _wait_for(lambda: messages, 5)
  finally:
    dog.stop()
  assert messages[0].startswith("tpustrat: step watchdog: process 0 has waited")
  assert "process 1 (last step reached: 3) stops too" in messages[0]


def test_watchdog_is_off_unless_asked_and_checks_its_timeout(monkeypatch):
  assert watchdog.active() is None
  watchdog.note(object(), 1)  # off: nothing happens
  monkeypatch.delenv(names.ENV_STEP_TIMEOUT, raising=False)
  assert watchdog.timeout_from_environment() is None
  monkeypatch.setenv(names.ENV_STEP_TIMEOUT, "2.5")
  assert watchdog.timeout_from_environment() == 2.5
  assert tpustrat.cluster_resolver.TPUClusterResolver().step_timeout == 2.5
  assert tpustrat.cluster_resolver.TPUClusterResolver(step_timeout=7).step_timeout == 7.0
  for bad in ("0", "-1", "soon", "inf", "1e-300", "0.5", "2147483648", "nan"):  # below 1 s fires on healthy steps
    monkeypatch.setenv(names.ENV_STEP_TIMEOUT, bad)
    with pytest.raises(ValueError, match=f"TPUSTRAT_STEP_TIMEOUT={bad!r} must be a positive number.*in \\[1, 2147483647\\]"):
      watchdog.timeout_from_environment()
  monkeypatch.delenv(names.ENV_STEP_TIMEOUT)
  for bad in (0, 1e-300, 2**31, float("nan")):
    with pytest.raises(ValueError, match=r"step_timeout must be a positive number of seconds in \[1, 2147483647\], got"):
      tpustrat.cluster_resolver.TPUClusterResolver(step_timeout=bad)
  assert tpustrat.cluster_resolver.TPUClusterResolver(step_timeout=2**31 - 1).step_timeout == 2**31 - 1


def test_watchdog_counts_the_steps_of_run_and_run_steps_not_reductions(strategy):
  dog = watchdog.start(600.0, process_index=0, process_count=1)
  try:
    x = strategy.experimental_distribute_values_from_function(lambda ctx: jnp.float32(ctx.replica_id_in_sync_group))
    y = strategy.run(lambda v: v + 1, args=(x,))
    strategy.reduce("sum", y, axis=None)
    assert dog.steps == 1
    it = iter(strategy.experimental_distribute_dataset([np.full(8, i, np.float32) for i in range(3)]))
    strategy.experimental_run_steps(lambda c, v: (c + 1, v), it, 3, init=jnp.float32(0))
    assert dog.steps == 4
    assert dog.counters() == {0: 4}
  finally:
    watchdog.stop()
  assert watchdog.active() is None
