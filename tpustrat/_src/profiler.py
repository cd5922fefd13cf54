"""Profiles: a trace of every process, with each step marked (`tpustrat.experimental.profile`).

A profile is JAX's profiler (`jax.profiler.start_trace` / `stop_trace`) writing, in every process, into
``<logdir>/process_<i>/`` (``i`` = `jax.process_index()`), so the processes of a job never write into
one directory and TensorBoard (``tensorboard --logdir <logdir>``, the profile plugin) lists one run per
process; each holds ``plugins/profile/<time>/<host>.xplane.pb`` and ``<host>.trace.json.gz`` (and
``perfetto_trace.json.gz`` with ``create_perfetto_trace=True``, for https://ui.perfetto.dev).

What the library marks, whoever collects the trace (this module, `jax.profiler.trace`, TensorBoard's
capture from a profiler server):

* every program that runs training steps (`strategy.run`: one step; `experimental_run_steps`: ``k``) is a
  `jax.profiler.StepTraceAnnotation` named after it (``run_<fn>``, ``run_steps_<fn>``) whose ``step_num``
  is this process's count of steps dispatched before it (the same on every process of a job: they run the
  same calls), with ``steps=k``. It spans the host's wait for the bound on steps in flight and the
  dispatch, so consecutive marks tile the host's time and their length is the step time. Reductions and
  cross-device ops are not steps;
* the host's wait for the next batch of a distributed iterator is a `jax.profiler.TraceAnnotation`
  named ``tpustrat/input_wait`` (`input_wait`).

The marks are made only while a profiler session collects (`jax_compat.profiler_collecting`, one C call):
otherwise a step costs one counter update and that call (0.06 us, measured), so they are always on.

``python -m tpustrat.launch --profile DIR [--profile-steps N]`` sets ``TPUSTRAT_PROFILE_DIR`` (and
``TPUSTRAT_PROFILE_STEPS``) in every process; the first strategy a process creates then starts a profile
into ``DIR/process_<i>/`` (`start_from_environment`), which ends after ``N`` steps or when the process
exits. Set the variables by hand on a cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax

from tpustrat._src import jax_compat, names
from tpustrat._src.step_hooks import Step, StepHook

__all__ = ["StepMarks", "input_wait", "process_logdir", "profile", "start", "start_from_environment", "step_end",
           "stop", "steps_dispatched"]

_collecting = jax_compat.profiler_collecting
_STEPS = [0]  # training steps this process has dispatched (`StepMarks.before`)
_OPEN = [False]  # a step mark is open: a `run` traced inside another step's program is not a step of its own
# The same state, for the default hooks written out (`engine.in_flight.dispatch_default_hooks`): a dispatch
# with no mark to make (`_SESSION` None, nothing collecting, no mark open) does what `StepMarks` does.
STEPS, OPEN = _STEPS, _OPEN
_NO_MARK = contextlib.nullcontext()
_LOCK = threading.Lock()


class _Session:
  """The profile this module started: where it writes, and how many steps it still records (None: until
  `stop`)."""

  def __init__(self, directory: str, steps: int | None) -> None:
    self.directory = directory
    self.steps_left = steps


_SESSION: list[_Session | None] = [None]
SESSION = _SESSION
_FROM_ENVIRONMENT = [False]  # `start_from_environment` has run in this process


def steps_dispatched() -> int:
  """How many training steps this process has dispatched (`run`: 1 each; `experimental_run_steps`: k)."""
  return _STEPS[0]


def process_logdir(logdir: str | os.PathLike) -> str:
  """``<logdir>/process_<i>``, `i` this process's index in the job (`jax.process_index()`)."""
  return os.path.join(os.fspath(logdir), f"process_{jax.process_index()}")


def _check_steps(steps: Any, what: str) -> int | None:
  if steps is None:
    return None
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"{what}: steps must be a positive int or None, got {steps!r}")
  return steps


def start(logdir: str | os.PathLike, *, steps: int | None = None, create_perfetto_trace: bool = False) -> str:
  """Starts a profile of this process into ``<logdir>/process_<i>/``; returns that directory.

  `steps`: stop by itself once that many more training steps have been dispatched and have finished (the
  program that reaches the count is waited for, so its device work is in the trace); None: until `stop`.
  One profile at a time per process (JAX's rule): a second `start` raises `RuntimeError`.
  """
  steps = _check_steps(steps, "tpustrat.experimental.start_profile")
  directory = process_logdir(logdir)
  with _LOCK:
    if _SESSION[0] is not None:
      raise RuntimeError(f"tpustrat.experimental.start_profile: a profile into {_SESSION[0].directory} is "
                         "already running in this process; stop it first (one profile at a time).")
    os.makedirs(directory, exist_ok=True)
    jax.profiler.start_trace(directory, create_perfetto_trace=create_perfetto_trace)
    _SESSION[0] = _Session(directory, steps)
  return directory


def stop() -> str | None:
  """Stops the profile `start` began and writes it; returns its directory (None if none was running)."""
  with _LOCK:
    session, _SESSION[0] = _SESSION[0], None
    if session is None:
      return None
    jax.profiler.stop_trace()
  return session.directory


@contextlib.contextmanager
def profile(logdir: str | os.PathLike, *, steps: int | None = None,
            create_perfetto_trace: bool = False) -> Iterator[str]:
  """`start` on entry (yields the process's directory), `stop` on exit unless `steps` stopped it before."""
  directory = start(logdir, steps=steps, create_perfetto_trace=create_perfetto_trace)
  session = _SESSION[0]
  try:
    yield directory
  finally:
    if _SESSION[0] is session:
      stop()


def start_from_environment() -> str | None:
  """Once per process: with ``TPUSTRAT_PROFILE_DIR`` set (by ``python -m tpustrat.launch --profile DIR``),
  starts a profile into ``DIR/process_<i>/`` for ``TPUSTRAT_PROFILE_STEPS`` steps (unset: until the process
  exits; it is written at exit). Called when a strategy is created, once the process has connected to its
  job (the profiler starts JAX's backends). Returns the directory, or None."""
  if _FROM_ENVIRONMENT[0]:
    return None
  _FROM_ENVIRONMENT[0] = True
  logdir = os.environ.get(names.ENV_PROFILE_DIR, "").strip()
  if not logdir:
    return None
  text = os.environ.get(names.ENV_PROFILE_STEPS, "").strip()
  try:
    steps = int(text) if text else None
  except ValueError:
    steps = 0  # refused below, naming the variable
  try:
    steps = _check_steps(steps, names.ENV_PROFILE_STEPS)
  except ValueError:
    raise ValueError(f"{names.ENV_PROFILE_STEPS}={text!r} must be a positive number of steps.") from None
  if _SESSION[0] is not None:  # the program profiles itself already
    return None
  directory = start(logdir, steps=steps)
  atexit.register(stop)
  return directory


def step_end(mark: Any, steps: int, token: Any) -> None:
  """After the dispatch whose mark `StepMarks.before` opened (also when it raised: `token` None): closes the mark; a program
  that was only traced (`token` a tracer: `run` inside a user's `jax.jit`) does not count. Ends a profile
  of `steps` steps once it has recorded them."""
  if mark is None:
    return
  _OPEN[0] = False
  if mark is not _NO_MARK:
    mark.__exit__(None, None, None)
  if isinstance(token, jax.core.Tracer):
    _STEPS[0] -= steps
    return
  session = _SESSION[0]
  if session is not None and session.steps_left is not None:
    session.steps_left -= steps
    if session.steps_left <= 0:
      if token is not None and hasattr(token, "block_until_ready") and not token.is_deleted():
        token.block_until_ready()  # the last step's device work, in the trace
      if _SESSION[0] is session:
        stop()


class StepMarks(StepHook):
  """The per-step hook of profiles (`step_hooks`; registered by the engine, `engine.in_flight.STEP_HOOKS`):
  before the in-flight wait, a program of ``step.steps`` (> 0) training steps counts them and, while a
  profiler collects, opens its mark; the mark is closed once the program is dispatched, or when the
  dispatch did not happen (`step_end`)."""

  __slots__ = ()

  def before(self, step: Step) -> Any:
    steps = step.steps
    if not steps or _OPEN[0]:  # a reduction; or a `run` traced inside another step's program (run_steps' scan)
      return None
    first = _STEPS[0]
    _STEPS[0] = first + steps
    _OPEN[0] = True
    if not _collecting():
      return _NO_MARK
    mark = jax.profiler.StepTraceAnnotation(step.name, step_num=first, steps=steps)
    mark.__enter__()
    return mark

  def after(self, step: Step, state: Any, token: Any, now: float | None) -> None:
    if state is not None:
      step_end(state, step.steps, token)

  def abort(self, step: Step, state: Any) -> None:
    if state is not None:
      step_end(state, step.steps, None)


def input_wait() -> Any:
  """A context manager around the host's wait for the next input batch: a ``tpustrat/input_wait``
  annotation while a profiler collects, nothing otherwise."""
  if _collecting():
    return jax.profiler.TraceAnnotation("tpustrat/input_wait")
  return _NO_MARK
