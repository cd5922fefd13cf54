"""The suite's two tiers (`tests/conftest.py`): a test that starts a process must carry the `processes` mark,
and a test with the mark must start one (itself or through a fixture); `make test` runs the unmarked tests,
`make test-processes` the marked ones.

A file of probe tests, each a way of starting (or not starting) a process, is run by pytest in a process of
its own with the suite's conftest as a plugin; its JUnit report gives each probe's outcome and message.
"""

import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROBES = '''
import multiprocessing, os, subprocess, sys
import pytest

def nothing():
  pass

def test_popen_unmarked():
  subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_spawn_unmarked():
  p = multiprocessing.get_context("spawn").Process(target=nothing); p.start(); p.join()

def test_fork_unmarked():
  p = multiprocessing.get_context("fork").Process(target=nothing); p.start(); p.join()

def test_system_unmarked():
  os.system("true")

def test_error_swallowed_unmarked():
  try:
    subprocess.run([sys.executable, "-c", "pass"])
  except Exception:
    pass

@pytest.mark.processes
def test_marked_without_a_process():
  pass

@pytest.mark.processes
def test_marked_and_skipped():
  pytest.skip("skipped before its process")

@pytest.mark.processes
def test_marked_with_a_process():
  subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.fixture(scope="module")
def job():
  return subprocess.run([sys.executable, "-c", "print(42)"], capture_output=True, text=True, check=True).stdout

@pytest.mark.processes
def test_marked_first_reader_of_a_fixtures_job(job):
  assert job.strip() == "42"

@pytest.mark.processes
def test_marked_second_reader_of_a_fixtures_job(job):
  assert job.strip() == "42"

def test_unmarked_in_process():
  assert sum(range(4)) == 6
'''


@pytest.mark.processes
def test_only_marked_tests_start_processes_and_marked_tests_do(tmp_path):
  (tmp_path / "test_probes.py").write_text(PROBES)
  report = tmp_path / "report.xml"
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
       str(tmp_path), "-p", "no:cacheprovider", f"--junitxml={report}", str(tmp_path)],
      cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
      env={**__import__("os").environ, "PYTHONPATH": str(ROOT / "tests")})
  assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
  outcomes = {}
  for case in ET.parse(report).getroot().iter("testcase"):
    failure = case.find("failure")
    outcome = "failed" if failure is not None else "skipped" if case.find("skipped") is not None else "passed"
    outcomes[case.get("name")] = (outcome, "" if failure is None else failure.get("message", "") + failure.text)
  assert {name: outcome for name, (outcome, _) in outcomes.items()} == {
      "test_popen_unmarked": "failed", "test_spawn_unmarked": "failed", "test_fork_unmarked": "failed",
      "test_system_unmarked": "failed", "test_error_swallowed_unmarked": "failed",
      "test_marked_without_a_process": "failed", "test_marked_and_skipped": "skipped",
      "test_marked_with_a_process": "passed", "test_marked_first_reader_of_a_fixtures_job": "passed",
      "test_marked_second_reader_of_a_fixtures_job": "passed", "test_unmarked_in_process": "passed",
  }, run.stdout[-3000:]
  for name in ("test_popen_unmarked", "test_spawn_unmarked", "test_fork_unmarked", "test_system_unmarked",
               "test_error_swallowed_unmarked"):
    assert f"test_probes.py::{name} started a process" in outcomes[name][1], outcomes[name][1]
    assert "without the `processes` mark" in outcomes[name][1]
  assert "has the `processes` mark but neither it nor its fixtures started a process" in (
      outcomes["test_marked_without_a_process"][1])
