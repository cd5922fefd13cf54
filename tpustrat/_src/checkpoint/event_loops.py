"""orbax's event loops are closed only once every task on them has finished.

orbax runs each coroutine of a save or restore to completion on an event loop of its own, created for it
(``orbax.checkpoint._src.asyncio_utils``: `_run_sync_via_new_loop` when no loop is running in the
thread, else a loop in a thread of its own, `_run_event_loop`), and closes that loop as soon as the
coroutine returns or raises. A coroutine that awaits several tensorstore operations at once
(`asyncio.gather`) raises as soon as one of them fails, a read of a truncated data file or a write to a
full disk, while the others are still running in tensorstore's threads. When one of those completes,
tensorstore hands its result to the loop it was awaited on (``loop.call_soon_threadsafe``); that loop is
closed by then, and tensorstore prints the ``RuntimeError: Event loop is closed`` of each one as an
unraisable exception: tracebacks unrelated to the failure, after `CheckpointManager.restore` has already
fallen back to an older step, or after a failed save has been reported.

`install` makes orbax's loops wait, before they are closed, for the tasks still pending on them: the
operations already started run to their end (success or error, which is dropped: the coroutine's own
outcome is what the caller gets) and report to a loop that is still open. Cancelling them instead would
not do: a tensorstore operation goes on when the task awaiting it is cancelled, and still reports to the
loop when it ends. The wait is part of the save or restore that started the operations, so it is
bounded by that operation's deadline (`tpustrat._src.checkpoint.deadlines`). A loop interrupted by
`KeyboardInterrupt` or `SystemExit` is closed at once, as before.

Written for orbax-checkpoint 0.12 (the two functions above; `install` leaves an orbax without them as it
is).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any

__all__ = ["finish_tasks", "install"]

_LOCK = threading.Lock()


def finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
  """Runs `loop` (not running) until every task still pending on it has finished; their outcomes are
  retrieved and dropped."""
  pending = asyncio.all_tasks(loop)
  if pending:
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _run_sync_via_new_loop(coro: Coroutine[Any, Any, Any]) -> Any:
  """orbax's `_run_sync_via_new_loop` (a coroutine run on a fresh event loop, without `asyncio.run`'s
  teardown), with the tasks it leaves behind finished before the loop is closed."""
  loop = asyncio.new_event_loop()
  interrupted = False
  try:
    asyncio.set_event_loop(loop)
    try:
      return loop.run_until_complete(coro)
    except (KeyboardInterrupt, SystemExit):
      interrupted = True
      raise
    finally:
      if not interrupted:
        finish_tasks(loop)
  finally:
    asyncio.set_event_loop(None)
    loop.close()


def _run_event_loop(loop: asyncio.AbstractEventLoop) -> None:
  """orbax's `_run_event_loop` (runs `loop`, in a thread of its own, until it is stopped, then closes it),
  with the tasks left on the loop finished before it is closed."""
  try:
    loop.run_forever()
    finish_tasks(loop)
  except BaseException as e:  # noqa: BLE001  # as orbax's: the thread ends, the loop is closed
    logging.info("Background event loop ended: %r", e)
  finally:
    try:
      loop.close()
    except Exception:  # noqa: BLE001  # as orbax's
      pass


_REPLACEMENTS = {"_run_sync_via_new_loop": _run_sync_via_new_loop, "_run_event_loop": _run_event_loop}


def install() -> None:
  """Makes orbax's event loops finish their pending tasks before they are closed (see the module
  docstring); once per process."""
  from orbax.checkpoint._src import asyncio_utils  # pylint: disable=import-outside-toplevel

  with _LOCK:
    for name, replacement in _REPLACEMENTS.items():
      if callable(getattr(asyncio_utils, name, None)):
        setattr(asyncio_utils, name, replacement)
