"""Input that scales: in a 2-process job each process reads only its own replicas' examples of a batched grain
MapDataset (issue 17).

One launch of tests/_mp_scripts/count_reads.py under ``python -m tpustrat.launch -n 2 -d 4``: the dataset's
map function records the example ids each process reads. Every example is read by exactly one process,
the one holding the replica its row goes to (half each for full batches), nothing lost, and nothing twice
but the partial batch's first example, which the process holding padding rows also reads (its padding rows
copy it: `InputOptions.experimental_padding`); the partial last batch is padded as before, `drop_remainder` reads nothing of it, and every value (the
batches' rows per replica, the real-row counts, a resumed iterator, stacked steps, the element spec) is
the one-process answer of the same script on this process's 8 devices.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from conftest import launched_results

pytestmark = pytest.mark.processes  # every test here starts processes (tests/conftest.py)

SCRIPTS = pathlib.Path(__file__).resolve().parent / "_mp_scripts"
ROOT = SCRIPTS.parents[1]
LAUNCH = [sys.executable, "-m", "tpustrat.launch", "--num-processes", "2", "--devices-per-process", "4"]
REPLICAS_PER_PROCESS = 4


def _env() -> dict[str, str]:
  """This environment without what the launcher sets per process (and without this process's 8 devices)."""
  return {k: v for k, v in os.environ.items()
          if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}


@pytest.fixture(scope="module")
def script():
  spec = importlib.util.spec_from_file_location("count_reads", SCRIPTS / "count_reads.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def job():
  """{process index: its RESULT} of one 2-process launch of count_reads.py."""
  out = subprocess.run(LAUNCH + ["--timeout", "240", str(SCRIPTS / "count_reads.py")], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-4000:]
  return launched_results(out.stdout)


@pytest.fixture(scope="module")
def one_process(script, strategy):
  """The same script's answers in this process, on 8 devices (every example read here)."""
  return script.check(strategy)


def _own_ids(batches, p):
  """The example ids of process p's replicas' rows, per batch (from the one-process per-replica rows)."""
  mine = slice(REPLICAS_PER_PROCESS * p, REPLICAS_PER_PROCESS * (p + 1))
  return [sorted(i for rows in b["local_ids"][mine] for i in rows) for b in batches]


def test_each_process_reads_exactly_its_own_replicas_examples(job, one_process, script):
  batches = one_process["epoch"]["batches"]
  assert [len(b["ids"]) for b in batches] == [16, 16, 12]  # the last batch is partial
  assert sorted(one_process["epoch"]["reads"]) == list(range(script.NUM_EXAMPLES))
  reads = {}
  padding_rows = set()  # the first example of a partial batch, read by process 1 for its padding rows
  for p in (0, 1):
    assert job[p]["local_replicas"] == [REPLICAS_PER_PROCESS * p + r for r in range(REPLICAS_PER_PROCESS)]
    got = job[p]["epoch"]["reads"]
    assert len(got) == len(set(got)), f"process {p} read an example twice"
    want = sum(_own_ids(batches, p), [])
    mine = slice(REPLICAS_PER_PROCESS * p, REPLICAS_PER_PROCESS * (p + 1))
    for b in batches:  # a process holding padding rows but not the batch's first row reads it: they copy it
      if p > 0 and any(c < b["counts"][0] for c in b["counts"][mine]):
        want.append(b["ids"][0])
        padding_rows.add(b["ids"][0])
    assert sorted(got) == sorted(want), f"process {p}"
    reads[p] = set(got)
  assert padding_rows == {batches[-1]["ids"][0]}  # the partial batch's first example
  assert reads[0] & reads[1] == padding_rows  # nothing else read twice
  assert reads[0] | reads[1] == set(range(script.NUM_EXAMPLES))  # nothing lost
  # Full batches: half each. The partial one (12 rows, 2 per replica): replicas 0-5 hold them.
  for p, counts in ((0, [8, 8, 8]), (1, [8, 8, 4])):
    assert [len(ids) for ids in _own_ids(batches, p)] == counts


def _assert_same_batch(got, want, p):
  """A batch as held by process p vs the one-process batch: the same rows, values and real-row counts,
  and p's replicas' components."""
  assert got["ids"] == want["ids"] and got["x"] == want["x"]
  assert got["counts"] == want["counts"]
  assert got["local_ids"] == want["local_ids"][REPLICAS_PER_PROCESS * p:REPLICAS_PER_PROCESS * (p + 1)]


def test_batches_hold_the_one_process_values(job, one_process):
  want = one_process["epoch"]["batches"]
  assert want[-1]["counts"] == [2] * 6 + [0, 0]  # the partial batch: replicas 6 and 7 hold padding
  for p in (0, 1):
    got = job[p]["epoch"]["batches"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
      _assert_same_batch(g, w, p)


def test_drop_remainder_reads_nothing_of_the_dropped_batch(job, one_process):
  full = one_process["epoch"]["batches"][:2]
  for p in (0, 1):
    assert job[p]["dropped"]["ids"] == one_process["dropped"]["ids"] == [b["ids"] for b in full]
    assert sorted(job[p]["dropped"]["reads"]) == sorted(sum(_own_ids(full, p), []))


def test_positions_resume_and_stacked_steps_as_in_one_process(job, one_process):
  want = one_process["resumed"]
  assert want["state"]["source"] == {"next_index": 1}  # grain's own position format
  for p in (0, 1):
    got = job[p]["resumed"]
    assert got["state"] == want["state"]
    _assert_same_batch(got["first"], want["first"], p)
    assert len(got["rest"]) == len(want["rest"]) == 2
    for g, w in zip(got["rest"], want["rest"]):
      _assert_same_batch(g, w, p)
    assert got["run_steps_total"] == want["run_steps_total"] == sum(range(44))
    assert got["run_steps_ids"] == want["run_steps_ids"]
    assert job[p]["spec"] == one_process["spec"]
