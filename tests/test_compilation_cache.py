"""The persistent compilation cache (`tpustrat.experimental.enable_compilation_cache`, ``launch
--compilation-cache``): the first start writes entries, a second start (a restart) reads every program from
them and compiles nothing.

Cache hits and misses are JAX's `jax.monitoring` events (``/jax/compilation_cache/cache_hits`` and
``cache_misses``), counted in fresh processes: the cache is decided once per process.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import pytest

import tpustrat
from tpustrat._src import compilation_cache, names

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_mp_scripts" / "compile_cache.py"

_ONE_PROCESS = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    events = {"cache_hits": 0, "cache_misses": 0}
    def count(event, **kwargs):
      name = event.rsplit("/", 1)[1]
      if name in events:
        events[name] += 1
    jax.monitoring.register_event_listener(count)
    import jax.numpy as jnp
    import tpustrat
    if len(sys.argv) > 1:
      tpustrat.experimental.enable_compilation_cache(sys.argv[1])
    strategy = tpustrat.TPUStrategy()
    out = strategy.run(lambda x: tpustrat.get_replica_context().all_reduce("sum", jnp.sin(x)), args=(jnp.float32(2.0),))
    print("RESULT " + json.dumps({"dir": tpustrat.experimental.compilation_cache_dir(), **events}))
""")


def _env() -> dict[str, str]:
  """This process's environment without tpustrat's variables, the device count and the test suite's own
  compilation cache (tests/conftest.py): each process here starts with the cache off."""
  return {k: v for k, v in os.environ.items()
          if not k.startswith(("TPUSTRAT_", "JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
          and k != "JAX_NUM_CPU_DEVICES"}


def _results(stdout: str) -> list[dict]:
  return [json.loads(line.split("RESULT ", 1)[1]) for line in stdout.splitlines() if "RESULT " in line]


def _one_process(*args: str, env: dict[str, str] | None = None) -> dict:
  out = subprocess.run([sys.executable, "-c", _ONE_PROCESS, *args], env=env or _env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  return _results(out.stdout)[0]


@pytest.mark.processes
def test_second_start_reads_every_program_from_the_cache(tmp_path):
  cache = tmp_path / "cache"
  first = _one_process(str(cache))
  assert first["dir"] == str(cache) and first["cache_misses"] > 0 and first["cache_hits"] == 0
  entries = sorted(os.listdir(cache))
  assert len(entries) >= first["cache_misses"]  # every program was written, the small ones too
  second = _one_process(str(cache))
  assert second["cache_misses"] == 0 and second["cache_hits"] == first["cache_misses"]
  assert sorted(os.listdir(cache)) == entries  # nothing new compiled, nothing new written


@pytest.mark.processes
def test_off_by_default_and_on_from_the_environment(tmp_path):
  assert _one_process()["dir"] is None  # no option, no variable: no cache
  env = _env() | {names.ENV_COMPILATION_CACHE_DIR: str(tmp_path / "env")}
  result = _one_process(env=env)  # `import tpustrat` read the variable
  assert result["dir"] == str(tmp_path / "env") and result["cache_misses"] > 0
  assert os.listdir(tmp_path / "env")


def test_enable_compilation_cache_arguments(tmp_path):
  before_dir = tpustrat.experimental.compilation_cache_dir()
  before_min = jax.config.jax_persistent_cache_min_compile_time_secs
  with pytest.raises(ValueError, match="min_compile_time_secs"):
    compilation_cache.enable_compilation_cache(tmp_path, min_compile_time_secs=-1)
  with pytest.raises(ValueError, match="must not be empty"):
    compilation_cache.enable_compilation_cache(" ")
  # Refused before anything was set: the directory and the threshold are this process's own (the test
  # suite's cache, tests/conftest.py), untouched.
  assert tpustrat.experimental.compilation_cache_dir() == before_dir
  assert jax.config.jax_persistent_cache_min_compile_time_secs == before_min


@pytest.mark.parametrize("kind", ["tpu", "mirrored"])
@pytest.mark.processes
def test_launcher_restart_reads_the_first_start_s_programs(tmp_path, kind):
  cache = tmp_path / "cache"
  out = subprocess.run([sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--compilation-cache",
                        str(cache), "--max-restarts", "1", str(SCRIPT), kind], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  results = {(r["restart"], r["process"]): r for r in _results(out.stdout)}
  assert sorted(results) == [(0, 0), (0, 1), (1, 0), (1, 1)], out.stdout
  assert {r["cache_dir"] for r in results.values()} == {str(cache)}  # every process, both starts
  first, restart = results[0, 0], results[1, 0]
  assert first["cache_misses"] > 0 and len(os.listdir(cache)) == first["cache_misses"]  # process 0 wrote them
  # The restart's process 0 compiled nothing: every program it asked for came from the cache.
  assert restart["cache_misses"] == 0 and restart["cache_hits"] == restart["compile_requests_use_cache"] > 0
  assert restart["loss"] == first["loss"] == results[1, 1]["loss"]
  # JAX writes from process 0 only, and on XLA:CPU the cache key holds the process's own devices' topology
  # (`jax._src.cache_key._hash_accelerator_config`): process 1's programs have keys of their own, so it finds
  # nothing (JAX 0.10.2; a TPU slice's or GPU cluster's topology is the job's, the same in every process).
  assert results[0, 1]["cache_misses"] == results[1, 1]["cache_misses"] == 0  # process 1 writes nothing
