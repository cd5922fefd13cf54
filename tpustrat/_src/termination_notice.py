"""A SIGTERM that reaches a connected process before its `PreemptionCheckpointHandler` exists, kept for it.

`jax.distributed.initialize` installs JAX's preemption notifier, a C++ SIGTERM handler that only tells
JAX's own preemption sync manager (`jax.experimental.multihost_utils.reached_preemption_sync_point`):
from then on SIGTERM no longer ends the process, and a `PreemptionCheckpointHandler` created later (model
building and restoring come first) would never learn of a notice that came in between. So
`tpustrat._src.distributed.initialize` calls `install` right after connecting: SIGTERM then records the
time it arrived (and calls a Python handler installed before, if any), and the first
`PreemptionCheckpointHandler` created afterwards takes the notice (`take`) and saves at the first call
the processes agree on, as if the signal had come while it existed. The handler installs its own SIGTERM
handler while it watches; `close` puts this one back.

Not installed when JAX's preemption service is off (``jax_enable_preemption_service=False``: SIGTERM keeps
its default action), outside the main thread (Python sets signal handlers only there), nor in a
one-process job (nothing connects; SIGTERM before the handler exists ends the process). While installed,
JAX's own preemption sync manager does not see SIGTERM: tpustrat's handler is the one that answers it.

Imports nothing from tpustrat beyond the foundations, so that the connection code (layer 6) and the
handler (layer 8) can both use it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import jax

__all__ = ["handler", "install", "installed", "take"]

_received: float | None = None  # time.monotonic() of the first SIGTERM not yet taken
_installed = False
_previous: Any = None
_process_index = 0


def install(process_index: int) -> bool:
  """Records SIGTERM from now on, for the first `PreemptionCheckpointHandler` created later (see the module
  docstring). Idempotent; returns whether the recorder is installed."""
  global _installed, _previous, _process_index
  if _installed:
    return True
  if threading.current_thread() is not threading.main_thread():
    return False
  if not getattr(jax.config, "jax_enable_preemption_service", True):
    return False
  _process_index = process_index
  _previous = signal.signal(signal.SIGTERM, _on_sigterm)
  _installed = True
  return True


def installed() -> bool:
  """Whether the recorder is installed in this process."""
  return _installed


def take() -> float | None:
  """The `time.monotonic` of a SIGTERM recorded and not yet taken (None when there is none); taking it
  clears it. Main thread (where the signal handler runs)."""
  global _received
  received, _received = _received, None
  return received


def handler() -> Any:
  """The recorder's signal handler (what `signal.getsignal` returns while it is installed)."""
  return _on_sigterm


def _on_sigterm(signum: int, frame: Any) -> None:
  global _received
  if _received is None:
    _received = time.monotonic()
  # os.write, not print: the main thread may be inside a write to sys.stderr when the signal comes.
  os.write(2, (f"tpustrat: process {_process_index}: SIGTERM received before a PreemptionCheckpointHandler "
               "exists; the first handler created saves at the first step the processes agree on.\n").encode())
  if callable(_previous):
    _previous(signum, frame)
