"""The core on more processes: 4 processes x 2 CPU devices and 8 x 1, on loopback through the launcher.

Three jobs, each as small as it can be (a 4-feature linear model, 10 steps), since every process of a job
imports JAX and compiles on the same 2 cores:

* 4 x 2: `tests/_preemption_scripts/linear_sgd.py` under `PreemptionCheckpointHandler`, a checkpoint every 4
  steps, process 2 sends itself SIGTERM during call 6; the launcher restarts the job once.
* 8 x 1: the same script, started from the 4 x 2 job's checkpoint of step 4 (saved by 4 processes, restored
  by 8), process 5 sends itself SIGTERM during call 8; restarted once.
* 8 x 1: `tests/_mp_scripts/watchdog_faults.py`, process 5 of 8 hangs before its step 3.

Every step's examples, its all-reduced loss (`run`), the `reduce` of its targets, the parameters after the
last step and the agreed save step are checked against numpy's SGD on the same batches, in every process.
Hybrid sharding on 4 x 2 processes is `tests/test_hybrid_sharding.py`'s; on 8 x 1 a group per process is one
replica, plain data parallel, so it is not repeated here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import KeyValueStore

from tpustrat._src import names

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
SGD = TESTS / "_preemption_scripts" / "linear_sgd.py"
WATCHDOG = TESTS / "_mp_scripts" / "watchdog_faults.py"
STEPS, SAVE_EVERY = 10, 4


def _env() -> dict[str, str]:
  return {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}


def _launch(processes: int, devices: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
  command = [sys.executable, "-m", "tpustrat.launch", "-n", str(processes), "-d", str(devices),
             "--heartbeat-timeout", "10", "--timeout", str(int(timeout) - 20), *args]
  return subprocess.run(command, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _script_module():
  spec = importlib.util.spec_from_file_location("linear_sgd_reference", SGD)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def reference() -> dict:
  """numpy's SGD (float64) on the script's batches: each step's ids, loss (before the update) and sum of
  targets, and the parameters after every step."""
  script = _script_module()
  batches = [dict(b) for b in script.dataset(STEPS)]
  assert len(batches) == STEPS
  w = np.zeros(script.FEATURES)
  losses, y_sums, ws = [], [], []
  for b in batches:
    x, y = np.asarray(b["x"], np.float64), np.asarray(b["y"], np.float64)
    r = x @ w - y
    losses.append(float(np.sum(r ** 2) / script.GLOBAL_BATCH))
    y_sums.append(float(np.sum(y)))
    w = w - script.LEARNING_RATE * (2.0 / script.GLOBAL_BATCH) * (x.T @ r)
    ws.append(w.copy())
  return {"ids": [[int(i) for i in b["id"]] for b in batches], "loss": losses, "y_sum": y_sums, "w": ws}


def _records(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def _starts(output: str) -> dict[int, dict[int, int]]:
  """attempt -> {process: the step it started at}, from the 'process P attempt A starts at step S' lines."""
  found: dict[int, dict[int, int]] = {}
  for m in re.finditer(r"process (\d+) attempt (\d+) starts at step (\d+)", output):
    found.setdefault(int(m.group(2)), {})[int(m.group(1))] = int(m.group(3))
  return found


def _kept(records: list[dict], next_start: dict[int, int]) -> list[dict]:
  """The records whose steps are in the final state: each attempt's, up to the step the next one resumed
  from."""
  return [r for r in records if r["step"] <= next_start.get(r["attempt"] + 1, STEPS)]


def _assert_exact_resume(done: subprocess.CompletedProcess, out: pathlib.Path, processes: int,
                         first_step: int, noticed_at: int, reference: dict) -> int:
  """The job got SIGTERM on one process during call `noticed_at`; every process saved at one agreed call,
  exited 42, the restarted job resumed there, and every step from `first_step` on matches numpy. Returns
  the agreed call."""
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
  assert "restarting the job (restart 1 of 1): process " in done.stderr, done.stderr[-4000:]
  assert f"status {names.EXIT_RESTART}" in done.stderr
  saved_line = r"\[proc (\d+)\] tpustrat: process \d+: saved checkpoint (\d+) after a termination notice"
  saved = {int(m.group(1)): int(m.group(2)) for m in re.finditer(saved_line, done.stderr)}
  assert sorted(saved) == list(range(processes)), done.stderr[-4000:]  # every process saved ...
  agreed = saved[0]
  assert set(saved.values()) == {agreed}, saved  # ... the same call
  # The loop reads each step's loss (a host sync per call): the save is at the call of the notice or the next.
  assert noticed_at <= agreed <= noticed_at + 1, agreed
  starts = _starts(done.stdout)
  everyone = range(processes)
  assert starts == {0: dict.fromkeys(everyone, first_step - 1), 1: dict.fromkeys(everyone, agreed)}
  resumed = {1: agreed}
  for p in range(processes):
    steps = _kept(_records(out / f"steps_p{p}.jsonl"), resumed)
    assert [r["step"] for r in steps] == list(range(first_step, STEPS + 1)), p  # every step once
    assert [r["ids"] for r in steps] == reference["ids"][first_step - 1:], p  # the same examples
    # Written after each call returned: the agreed call saved and exited instead (its state is the next
    # attempt's start, checked through every later step).
    reduced = _records(out / f"reduced_p{p}.jsonl")
    stepped = [s for s in range(first_step, STEPS + 1) if s != agreed]
    assert [r["step"] for r in reduced] == stepped, p
    np.testing.assert_allclose([r["loss"] for r in reduced], [reference["loss"][s - 1] for s in stepped],
                               rtol=1e-5)
    np.testing.assert_allclose([r["y_sum"] for r in reduced], [reference["y_sum"][s - 1] for s in stepped],
                               rtol=1e-5, atol=1e-4)
  final = np.load(out / "final.npz")
  assert int(final["total_run_calls"]) == STEPS
  np.testing.assert_allclose(final["w"], reference["w"][-1], rtol=1e-5)
  return agreed


def _checkpoints(ckpt: pathlib.Path) -> list[int]:
  return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def four_by_two(tmp_path_factory, reference) -> tuple[pathlib.Path, int]:
  """The 4 x 2 preempted job: (its checkpoint directory, the agreed save step)."""
  base = tmp_path_factory.mktemp("four_by_two")
  ckpt, out = base / "ckpt", base / "out"
  out.mkdir()
  done = _launch(4, 2, "--max-restarts", "1", str(SGD), str(ckpt), str(out), "--steps", str(STEPS),
                 "--save-every", str(SAVE_EVERY), "--reduce", "--fault", "term", "--at", "6",
                 "--process", "2")
  agreed = _assert_exact_resume(done, out, 4, 1, 6, reference)
  assert _checkpoints(ckpt) == sorted({4, agreed, 8})
  return ckpt, agreed


@pytest.mark.processes
def test_four_processes_save_one_step_on_sigterm_and_resume_exactly(four_by_two):
  """run (the all-reduced loss), reduce, gather (the ids) and the preemption agreement on 4 x 2: checked in
  `four_by_two` against numpy, step by step and for the final parameters."""
  _, agreed = four_by_two
  assert agreed in (6, 7)


@pytest.mark.processes
def test_eight_processes_resume_a_four_process_checkpoint_and_a_preemption_exactly(four_by_two, reference,
                                                                                   tmp_path):
  source, _ = four_by_two
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  out.mkdir()
  ckpt.mkdir()
  shutil.copytree(source / "4", ckpt / "4")  # step 4 as 4 processes x 2 devices saved it, alone
  done = _launch(8, 1, "--max-restarts", "1", str(SGD), str(ckpt), str(out), "--steps", str(STEPS),
                 "--save-every", str(SAVE_EVERY), "--reduce", "--fault", "term", "--at", "8",
                 "--process", "5")
  agreed = _assert_exact_resume(done, out, 8, 5, 8, reference)
  assert _checkpoints(ckpt) == sorted({4, agreed, 8})


@pytest.mark.processes
def test_the_watchdog_names_the_one_stuck_process_of_eight():
  """Process 5 of 8 hangs (alive, in Python) before its step 3; the other 7 wait in step 3's all-reduce.
  A watchdog fires within the step timeout, names process 5 with the last step it reached, and the
  launcher blames it and exits with its status."""
  done = _launch(8, 1, "--step-timeout", "3", str(WATCHDOG), "hang", "0", "6", "5", timeout=150)
  err = done.stderr
  assert done.returncode == names.EXIT_STEP_TIMEOUT, done.stdout[-2000:] + err[-4000:]
  assert "[proc 5] process 5 hangs before step 3" in done.stdout
  others = "[0-46-7]"  # any process but 5
  assert re.search(rf"step watchdog: process {others} has waited \d+\.\d s for step [34] to finish", err), (
      err[-4000:])
  assert "processes behind: process 5 (last step reached: 2)." in err, err[-4000:]
  assert re.search(rf"tpustrat: step watchdog of process {others}: holding the job up: process 5\.", err), (
      err[-4000:])
  assert re.search(rf"tpustrat\.launch: process 5 failed first: the step watchdog of process {others} "
                   r"named it as holding the job up", err), err[-4000:]
  assert "the launcher exits with 124, the status of process 5." in err, err[-4000:]


# -- the watchdog and a dispatch that does not return (found on 8 x 1: XLA:CPU runs a one-device program in
# the calling thread, so the healthy processes' step 3 never returned from its dispatch and was never timed)



  def key_value_delete(self, key):
    self.values.pop(key, None)


class _Ready:
  def is_ready(self):
    return True


def test_a_dispatch_that_never_returns_is_timed_and_its_step_counts_as_reached():
  from tpustrat._src import step_hooks, watchdog  # pylint: disable=import-outside-toplevel

  client = KeyValueStore({"tpustrat/watchdog/steps/1": "2"})
  messages = []
  dog = watchdog.Watchdog(1.0, process_index=0, process_count=2, client=client, exit_fn=messages.append)
  previous = watchdog.activate(dog)
  try:
    hook, step = watchdog.Heartbeat(), step_hooks.Step("run_step", 1, None, None, None, ())
    for _ in range(2):  # steps 1 and 2: dispatched and finished
      hook.after(step, hook.before(step), _Ready(), None)
    assert dog.steps == 2 and dog.reached() == 2
    began = hook.before(step)  # step 3's dispatch begins ...
    assert began is dog and dog.reached() == 3
    hook.abort(step, began)  # ... and fails: nothing under way, nothing counted
    assert dog.reached() == 2
    nested = hook.before(step)  # step 3 again; a `run` traced inside it is no dispatch of its own
    assert hook.before(step) is None and dog.reached() == 3
    deadline = time.monotonic() + 20
    while not messages:  # the dispatch never returns: the thread times it
      assert time.monotonic() < deadline, "the watchdog did not fire"
      time.sleep(0.02)
  finally:
    dog.stop()
    watchdog.activate(previous)
  del nested
  text = messages[0]
  assert "process 0 has waited" in text and "for step 3 to finish" in text, text
  assert "processes behind: process 1 (last step reached: 2)." in text, text
  assert client.values["tpustrat/watchdog/steps/0"] == "3"  # published: it reached step 3
  assert "holding the job up: process 1." in text


# -- the preemption handler's requests to the coordination service (issue 34 item 6) -----------------------


class _KV(KeyValueStore):
  """`KeyValueStore` with the coordination client's blocking get, counting every request."""

  def __init__(self):
    super().__init__()
    self.calls: dict[str, int] = {}
    self.changed = threading.Condition()
    self.waiting = threading.Event()  # a blocking get is waiting

  def _count(self, op):
    self.calls[op] = self.calls.get(op, 0) + 1

  def key_value_set(self, key, value, allow_overwrite=False):
    self._count("set")
    with self.changed:
      super().key_value_set(key, value, allow_overwrite)
      self.changed.notify_all()

  def key_value_try_get(self, key):
    self._count("try_get")
    return super().key_value_try_get(key)

  def key_value_dir_get(self, prefix):
    self._count("dir_get")
    return super().key_value_dir_get(prefix)

  def key_value_delete(self, key):
    self._count("delete")
    super().key_value_delete(key)

  def blocking_key_value_get(self, key, timeout_in_ms):
    self._count("blocking_get")
    with self.changed:
      self.waiting.set()
      if not self.changed.wait_for(lambda: key in self.values, timeout=timeout_in_ms / 1000):
        raise RuntimeError("DEADLINE_EXCEEDED")
      return self.values[key]


def _until(predicate, what: str, seconds: float = 20.0) -> None:
  deadline = time.monotonic() + seconds
  while not predicate():
    assert time.monotonic() < deadline, what
    time.sleep(0.005)


def test_the_handler_sends_nothing_while_idle_and_answers_a_peers_notice_at_once(strategy, tmp_path,
                                                                                  monkeypatch):
  """Process 0 of 2 (the coordination client a counting table): while nothing happens its threads send no
  request (the listener's one long-poll waits); a peer's notice wakes it, it answers with the first call it
  has not checked, and the agreement reads the answers with directory reads, not one request per process."""
  import tpustrat  # pylint: disable=import-outside-toplevel
  from tpustrat._src import preemption  # pylint: disable=import-outside-toplevel

  kv, ticks, exits = _KV(), [], []
  manager = tpustrat.checkpoint.CheckpointManager(tmp_path / "ckpt", strategy)
  monkeypatch.setattr(preemption, "_POLL_SECONDS", 0.01)
  monkeypatch.setattr(preemption, "_WATCHER_FN_SECONDS", 0.0)
  config = tpustrat.TerminationConfig(termination_watcher_fn=lambda: ticks.append(1) and False,
                                      exit_fn=lambda: exits.append(1))
  with monkeypatch.context() as m:  # a job of 2 processes, for the constructor only
    m.setattr(preemption.jax, "process_count", lambda: 2)
    m.setattr(preemption.jax, "process_index", lambda: 0)
    m.setattr(preemption.jax_compat, "coordination_client", lambda: kv)
    handler = tpustrat.PreemptionCheckpointHandler(None, manager, termination_config=config)
  try:
    state = handler.restore({"w": jnp.float32(0)})
    step = lambda s: ({"w": s["w"] + 1},)  # noqa: E731
    for _ in range(3):
      (state,) = handler.run(step, state)
    _until(kv.waiting.is_set, "the listener's long-poll")
    _until(lambda: len(ticks) >= 20, "20 ticks of the watcher thread")
    assert kv.calls == {"blocking_get": 1}, kv.calls  # idle: one outstanding request, nothing polled
    # Process 1 got SIGTERM before its call 5: it writes the notice, wakes every listener, and answers 5.
    kv.key_value_set("tpustrat/preemption/0/notice", "1")
    for p in (0, 1):
      kv.key_value_set(f"tpustrat/preemption/0/wake/{p}", "notice")
    kv.key_value_set("tpustrat/preemption/0/earliest/1", "5")
    _until(lambda: "tpustrat/preemption/0/earliest/0" in kv.values, "process 0's answer")
    assert kv.values["tpustrat/preemption/0/earliest/0"] == "4"  # its first call not checked yet
    before = dict(kv.calls)
    (state,) = handler.run(step, state)  # call 4: agrees on max(4, 5) = 5
    assert kv.calls.get("dir_get", 0) - before.get("dir_get", 0) == 1 and "try_get" not in kv.calls, kv.calls
    assert not exits and manager.all_steps() == []
    (state,) = handler.run(step, state)  # call 5: saves and calls exit_fn
    assert exits == [1] and manager.all_steps() == [5]
    assert float(manager.restore(5, target={"w": jnp.float32(0)})["w"]) == 5.0
  finally:
    handler.close()
  listener = handler._listener  # pylint: disable=protected-access
  assert listener is not None and not listener.is_alive()
