"""Every test sees 8 emulated CPU devices: configured here, before JAX initialises its backends.

The suite's own speed settings (docs/development.md, "The test suite's speed"), each inherited by the
processes the tests start through the environment:

* XLA:CPU compiles without LLVM's expensive optimisation passes (``--xla_backend_optimization_level=0``,
  ``--xla_llvm_disable_expensive_passes=true``): the suite's time is mostly compile time of small programs;
  the HLO passes (fusion, layouts, SPMD partitioning, buffer assignment) are unchanged, so memory figures and
  compiled collectives are the same. Where XLA knows it (JAX 0.10), ``--xla_cpu_use_fusion_emitters=false``
  too: fused computations through XLA's older emitters, 2.5x faster to compile. ``TPUSTRAT_TESTS_XLA_OPT=1``
  compiles as users do.
* One JAX persistent compilation cache for the whole run (``JAX_COMPILATION_CACHE_DIR``, every program
  written): a program compiled again by another test, another xdist worker or a test's subprocess (a
  restart, a resumed run) is read back instead. A temporary directory removed at the end of the run, or
  the directory ``TPUSTRAT_TESTS_JAX_CACHE`` names (kept, so a second run starts warm). Entries are keyed by
  the program, its devices, the compile options and the JAX version, never by a coincidence.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras 3 models in the tests run on JAX (the `keras` extra)

# The devices come from `jax_num_cpu_devices` below; a device count in the caller's XLA_FLAGS is dropped, so
# that the flags left can go to every process a test starts (which sets its own device count).
_FAST_XLA = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
# XLA:CPU's older emitters for fused computations compile 2.5x faster than its MLIR fusion emitters (the
# default in JAX 0.10: tests/test_zero.py's compile time 63 s -> 23 s); the flag is gone from JAX 0.12's XLA,
# whose only emitters those are. An XLA that does not know a flag aborts the process, so each of these is
# tried once, in a process of its own, by the run's first process; its workers and the processes the tests
# start inherit the result through XLA_FLAGS.
_FAST_XLA_IF_KNOWN = ("--xla_cpu_use_fusion_emitters=false",)
_CHECKED = "TPUSTRAT_TESTS_XLA_FLAGS_CHECKED"


def _xla_probe(flag: str) -> subprocess.Popen:
  """A process that exits with status 0 if and only if this XLA knows `flag`."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
_probes: dict[str, subprocess.Popen] = {}
if os.environ.get("TPUSTRAT_TESTS_XLA_OPT") != "1":
  _flags += [f for f in _FAST_XLA if f not in _flags]
  if os.environ.get(_CHECKED) != "1":
    # Answered after the imports below, which the probes overlap (1.3 s of the run's start, measured).
    _probes = {f: _xla_probe(f) for f in _FAST_XLA_IF_KNOWN if f not in _flags}
os.environ["XLA_FLAGS"] = " ".join(_flags)
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ  # set by this run's controller for its workers
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = (os.environ.get("TPUSTRAT_TESTS_JAX_CACHE")
                                            or tempfile.mkdtemp(prefix="tpustrat-tests-jax-cache-"))
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

import gc  # noqa: E402
import importlib.util  # noqa: E402
import logging  # noqa: E402
import multiprocessing.util  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import tpustrat  # noqa: E402

# XLA reads XLA_FLAGS when JAX starts a backend, which none of the imports above does.
if _probes:
  _flags += [f for f, probe in _probes.items() if probe.wait(timeout=300) == 0]
  os.environ["XLA_FLAGS"] = " ".join(_flags)
  os.environ[_CHECKED] = "1"

NUM_DEVICES = 8


# Modules whose tests each start processes of their own and share nothing compiled in this process: with
# `make test`'s workers (pytest-xdist) their tests are spread over the workers one by one. Every other
# module's tests run in one worker, in order, so that its module- and session-scoped strategies and compiled
# programs are built once (`pytest_xdist_make_scheduler` below).
SPREAD_MODULES = frozenset({
    "test_benchmarks", "test_notebooks", "test_multiprocess", "test_many_processes",
    "test_launch", "test_watchdog", "test_preemption", "test_loop_multiprocess", "test_input_multiprocess",
    "test_embedding_multiprocess", "test_compilation_cache", "test_distributed", "test_cluster_resolver",
    "test_cluster_resolvers_slurm_tfconfig", "test_docs", "test_packaging",
})

# The modules that take longest, slowest first (measured: the sum of their tests' times in `make test`
# with JAX 0.10.2 on 2 cores, two workers; `make test-processes`'s in the same way), run before the others
# so that no worker is left with a long module at the end (alphabetical order: 740 s for the longer worker
# where 709 s is half the work; slowest first: 709 s). A module not named here keeps its place after them.
SLOWEST_FIRST = (
    "test_char_transformer",  # 153 s
    "test_benchmarks",  # processes: ~560 s, spread
    "test_multiprocess",  # processes: ~210 s, spread
    "test_preemption",  # processes: ~160 s, spread
    "test_many_processes",  # processes: ~140 s, spread
    "test_keras_fit",  # 60 s (processes: ~85 s)
    "test_examples",  # 55 s
    "test_embedding_exchange",  # 54 s
    "test_embedding",  # 44 s
    "test_cross_device_ops",  # 41 s
    "test_single_device_equivalence",  # 40 s
    "test_hybrid_sharding",  # 38 s
    "test_zero",  # 30 s
    "test_tf_tutorials",  # 28 s
    "test_collectives",  # 21 s
    "test_checkpoint",  # 18 s
    "test_docs",  # 18 s
    "test_input_buffers",  # 18 s
    "test_accumulation",  # 18 s
    "test_embedding_optimizers",  # 16 s
)


def pytest_collection_modifyitems(session, config, items) -> None:
  """Orders the modules `SLOWEST_FIRST`, the tests of a module in their own order (every worker collects
  the same order; xdist hands the modules out in it)."""
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  position = {id(item): i for i, item in enumerate(items)}
  items.sort(key=lambda item: (rank.get(item.path.stem, len(rank)), position[id(item)]))


if importlib.util.find_spec("xdist") is not None:
  from xdist.scheduler import LoadScopeScheduling  # noqa: E402

  class _ModuleScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduling with a module as the scope, except `SPREAD_MODULES`, whose tests
    are scopes of their own (xdist's ``--dist loadgroup`` would do this from markers, but in xdist 3.8 with
    pytest 9 its workers leave the group out of the test ids, so the groups were ignored: measured)."""

    def _split_scope(self, nodeid: str) -> str:
      module = nodeid.split("::", 1)[0]
      return nodeid if pathlib.Path(module).stem in SPREAD_MODULES else module

  def pytest_xdist_make_scheduler(config, log):
    # xdist (3.6 and later) otherwise hands the scopes out by their number of tests, most first, whatever
    # the collection order: the modules would not run slowest first (seen in a timeline of `make test`).
    config.option.loadscopereorder = False
    return _ModuleScheduling(config, log)


def pytest_collection_finish(session) -> None:
  """Python's cyclic garbage collector, tuned for the tests' heap: what the imports and the collection made
  (about 300,000 objects: JAX, flax, Keras, scikit-learn, the test modules) lives for the whole run, so it is
  frozen out of every later collection (`gc.freeze`), and the youngest generation is collected every
  10,000 allocations, not 700, so that full collections come about a third as often. Measured over a whole
  `make test` (`gc.callbacks`): each worker spent 23.7-23.8 s collecting garbage, 8.4-8.8 s after this.
  Every unreachable cycle is still freed, later (the largest worker's memory: 4.2 GB, 4.0-4.2 GB before)."""
  gc.collect()
  gc.freeze()
  gc.set_threshold(10_000, 10, 10)


def _ends_with_exit(config) -> bool:
  """Whether this process is an xdist worker that ends with `os._exit` (see `pytest_unconfigure` below)."""
  return hasattr(config, "workerinput") and not multiprocessing.active_children()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session) -> None:
  """A worker that will end with `os._exit` freezes its heap here, so that pytest's full garbage collection
  in `pytest_unconfigure` has nothing to scan: it took 3-4 s of each worker at the end of `make test`
  (faulthandler's stacks every 0.2 s: all in `gc.collect`), with the controller waiting. That collection
  only feeds pytest's end-of-run unraisable-exception check, whose report from a worker never reached the
  controller (checked: a cycle with a raising finalizer left by the last test is reported in a run without
  workers, and with workers neither before nor after this). Each test's own check, after the test, and the
  controller's end-of-run check are unchanged."""
  if _ends_with_exit(session.config):
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
  """The run's temporary compilation cache goes with the run (the controller's, once its workers ended).

  An xdist worker ends here, with `os._exit`, once it has sent its results (in `pytest_sessionfinish`) and
  the other plugins' end-of-run work ran (pytest's check for unraisable exceptions among them). What it
  skips is JAX's teardown of its backend and caches and the interpreter's of everything else: the
  controller waits for its workers' processes to end, and at the end of `make test` that took about 10 s,
  4.9 s of it JAX's `clean_up` (measured). Not when the worker has multiprocessing children, which a normal
  exit terminates or joins."""
  if _ends_with_exit(config):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the worker's status went with its results; xdist does not read the process's
  elif _OWN_CACHE and not os.environ.get("TPUSTRAT_TESTS_JAX_CACHE"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# --- The two tiers: in-process tests (`make test`) and tests that start processes (`make test-processes`) ---
#
# A test that starts an operating-system process (a launched multi-process job, an example or benchmark
# script, a notebook's kernel, pip, python -c) carries the `processes` mark. `make test` runs every other
# test; `make test-processes` runs these; CI runs both. The mark is checked, not trusted: Python's audit
# events for starting a process (`sys.addaudithook`) fail a test that starts one without the mark, so no
# test can slip out of the tier that runs it.
_SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
                           "os.system", "os.exec", "multiprocessing.spawnv_passfds"})
_RUNNING: list = [None]  # the test item being run (set and unset around each test's whole protocol)
_UNMARKED = pytest.StashKey[list]()
_STARTED = pytest.StashKey[int]()
_SETTING_UP: list = []  # the fixtures being set up, innermost last
_STARTING_FIXTURES: set = set()  # the names of the fixtures whose set-up started a process


class UnmarkedProcessError(RuntimeError):
  """A test without the `processes` mark started a process."""


def _process_audit(event: str, args: tuple, _events=_SPAWN_EVENTS, _running=_RUNNING) -> None:
  # The hook outlives this module's globals at interpreter exit (it cannot be removed): what it reads
  # first is bound here.
  if event not in _events:
    return
  item = _running[0]
  if item is None:
    return
  item.stash[_STARTED] = item.stash.get(_STARTED, 0) + 1
  _STARTING_FIXTURES.update(fixturedef.argname for fixturedef in _SETTING_UP)
  if item.get_closest_marker("processes") is not None:
    return
  what = args[1] if event in ("subprocess.Popen", "multiprocessing.spawnv_passfds") else args
  message = (f"{item.nodeid} started a process ({event}: {what!r}) without the `processes` mark: mark the "
             "test (or its module) `@pytest.mark.processes`, so that it runs in `make test-processes`")
  item.stash.setdefault(_UNMARKED, []).append(message)
  raise UnmarkedProcessError(message)


# Python's `platform.processor()` runs `uname -p` once per process and keeps the answer; libraries call it on
# import (Keras through h5py). Asked here, before any test, so that whichever test first imports such a
# library does not count as starting a process (it did, for a test run alone: the check depended on order).
platform.processor()
sys.addaudithook(_process_audit)

# multiprocessing's "spawn" and "forkserver" start methods (the default from Python 3.14) start their
# processes through `multiprocessing.util.spawnv_passfds`, which raises no audit event (measured on 3.11 and
# 3.12): it raises one here.
_spawnv_passfds = multiprocessing.util.spawnv_passfds


def _audited_spawnv_passfds(path, args, passfds):
  sys.audit("multiprocessing.spawnv_passfds", path, args)
  return _spawnv_passfds(path, args, passfds)


multiprocessing.util.spawnv_passfds = _audited_spawnv_passfds


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  _RUNNING[0] = item
  try:
    return (yield)
  finally:
    _RUNNING[0] = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
  _SETTING_UP.append(fixturedef)
  try:
    return (yield)
  finally:
    _SETTING_UP.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  """A test that passed fails here if it started a process without the `processes` mark (even where the
  audit hook's error was caught on the way: a launcher that reports a failed start instead of raising),
  or if it has the mark and neither it nor a fixture it uses started one (then it belongs in `make
  test`)."""
  report = yield
  if call.when == "call" and report.passed:
    unmarked = item.stash.get(_UNMARKED, [])
    if unmarked:
      report.outcome, report.longrepr = "failed", unmarked[0]
    elif (item.get_closest_marker("processes") is not None and not item.stash.get(_STARTED, 0)
          and _STARTING_FIXTURES.isdisjoint(item.fixturenames)):
      report.outcome = "failed"
      report.longrepr = (f"{item.nodeid} has the `processes` mark but neither it nor its fixtures started a "
                         "process: remove the mark, so that it runs in `make test`")
  return report


@pytest.fixture(autouse=True)
def _restore_process_state():
  """Each test starts with the process's connection as the session left it: a one-process strategy given a
  resolver (`TPUStrategy(resolver)`) becomes the resolver `Strategy.cluster_resolver` reports afterwards, and
  without this the next test on the same worker (a doctest, say) would read whichever test ran before it.
  Likewise a step watchdog that a test started (a resolver with a ``step_timeout``) is stopped after it."""
  from tpustrat._src import cluster_connection, watchdog  # pylint: disable=import-outside-toplevel
  saved = list(cluster_connection._RESOLVER), list(cluster_connection._CONNECTED_ONE)  # pylint: disable=protected-access
  running = watchdog._ACTIVE  # pylint: disable=protected-access
  yield
  cluster_connection._RESOLVER[:], cluster_connection._CONNECTED_ONE[:] = saved  # pylint: disable=protected-access
  if running is None and watchdog._ACTIVE is not None:  # pylint: disable=protected-access
    watchdog.stop()


@pytest.fixture(scope="session")
def strategy() -> tpustrat.TPUStrategy:
  """One 8-replica strategy shared by the tests (compilation caches live on it)."""
  assert len(jax.devices()) == NUM_DEVICES, jax.devices()
  return tpustrat.TPUStrategy()


@pytest.fixture(scope="module")
def strategies(strategy) -> dict:
  """Strategies of 1, 2, 4 and 8 replicas (both kinds of strategy; 8 is the session's TPUStrategy)."""
  devices = jax.devices()
  return {1: tpustrat.MirroredStrategy(devices[:1]), 2: tpustrat.TPUStrategy(device_assignment=devices[:2]),
          4: tpustrat.MirroredStrategy(devices[:4]), 8: strategy}


def distribute_batch(strategy, batch):
  """`batch` (a pytree of ``[N * b, ...]`` arrays) split over the replicas in order: replica ``r`` takes
  rows ``[r * b, (r + 1) * b)``."""
  b = len(jax.tree.leaves(batch)[0]) // strategy.num_replicas_in_sync

  def part(ctx):
    r = ctx.replica_id_in_sync_group
    return jax.tree.map(lambda x: x[r * b:(r + 1) * b], batch)

  return strategy.experimental_distribute_values_from_function(part)


@pytest.fixture
def rng() -> np.random.Generator:
  return np.random.default_rng(0)


EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load_example(name: str):
  """`examples/NAME.py` as a module. Importing it sets XLA_FLAGS (a no-op here, JAX is up): keep that local."""
  spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored (or removed) on exit
    spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="session")
def load_example():
  """A function that imports an example script by name (``load_example("classifier")``)."""
  return _load_example


def assert_close(actual, expected, *, rtol: float = 1e-5, scale=None, err_msg: str = "") -> None:
  """`np.testing.assert_allclose` with ``atol = rtol * scale``, for float results of a reduction.

  A sum, mean, matmul, all-reduce, gradient or optimizer step rounds relative to the magnitude of what it
  adds up, not of its result, and the backend may add in any order: an element that cancels to near zero
  can differ by ~1e-7 of its operands on another CPU. `scale` is that magnitude (a number or an array,
  whose largest absolute value is used, e.g. ``np.abs(x).sum(0)``); by default max |expected|, which is
  wrong when the whole result cancels (a gradient that is zero in theory): pass `scale` then. A sum of n
  values added in any order, each addition rounded, is within ``(n - 1) * eps / 2 * sum|x|``: the default
  rtol covers float32 sums of up to ~160 terms; pass ``rtol=n * float(jnp.finfo(dtype).eps) / 2`` for
  bfloat16 / float16.
  """
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  scale = np.abs(expected) if scale is None else np.abs(np.asarray(scale, np.float64))
  atol = rtol * float(scale.max(initial=0.0))
  np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=err_msg)


def backend_compiles(fn):
  """(fn(), how many times XLA compiled a program while it ran), from JAX's compile-time events
  (`jax.monitoring`). Unlike `compiled_programs` this counts each device's compilation of one lowered
  program: an op run eagerly on a new device is compiled again for it without being lowered or logged."""
  count = []

  def listen(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      count.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    out = fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  return out, len(count)


def launched_results(stdout: str, processes: int = 2) -> dict:
  """{process index: its RESULT} from the launcher's ``[proc i] ... RESULT <json>`` lines of a job."""
  import json  # pylint: disable=import-outside-toplevel
  results = {}
  for line in stdout.splitlines():
    prefix, _, payload = line.partition(" RESULT ")
    if payload:
      results[int(prefix.removeprefix("[proc ").rstrip("]"))] = json.loads(payload)
  assert sorted(results) == list(range(processes)), stdout[-4000:]
  return results


class KeyValueStore:
  """The coordination service's key-value store (`jax.distributed`'s client), in memory: set, try_get and
  dir_get with the service's errors."""

  def __init__(self, values=None):
    self.values = dict(values or {})

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.values and not allow_overwrite:
      raise RuntimeError("ALREADY_EXISTS")
    self.values[key] = value

  def key_value_try_get(self, key):
    if key not in self.values:
      raise RuntimeError("NOT_FOUND")
    return self.values[key]

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


EMBEDDING_LAYOUTS = ("all_to_all", "all_gather_table", "all_gather_ids")


def embedding_layout(emb, layout: str):
  """`emb` (a `tpustrat.embedding.TPUEmbedding`) with every unbounded table on one layout, whatever its
  size: ``"all_to_all"`` (ids routed to the rows' owners), ``"all_gather_table"`` (blocks all-gathered,
  gradients reduce-scattered) or ``"all_gather_ids"`` (ids and gradients all-gathered, rows
  reduce-scattered). Set before the first step traces."""
  emb._forced_layout = layout
  return emb


def compiled_programs(fn):
  """(fn(), the names of the programs JAX lowered for compilation while it ran), from JAX's own log of
  compilations (`jax.log_compiles`); a program found in JAX's in-memory caches is not lowered or listed.
  The log's level is set here, so that no logging configuration elsewhere can silence it."""
  names = []

  class Record(logging.Handler):
    def emit(self, record):
      message = record.getMessage()
      if message.startswith("Compiling "):
        names.append(message.split()[1])

  handler, logger = Record(level=logging.DEBUG), logging.getLogger("jax")
  level = logger.level
  logger.addHandler(handler)
  logger.setLevel(logging.DEBUG)
  try:
    with jax.log_compiles(True):
      out = fn()
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)
  return out, names


def wait_until_read_ahead(iterator, seconds: float = 30.0):
  """Waits (up to `seconds`) until the distributed iterator's prefetch thread has filled its buffer; the
  thread then waits for a free place and reads nothing more (it takes a place before it reads). Returns
  the prefetcher (`join`, `is_alive`)."""
  prefetcher = iterator._prefetcher  # pylint: disable=protected-access
  deadline = time.monotonic() + seconds
  while not prefetcher._queue.full():  # pylint: disable=protected-access
    assert time.monotonic() < deadline, "the prefetch thread did not fill its buffer"
    time.sleep(0.01)
  return prefetcher
