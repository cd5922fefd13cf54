"""The prefetch thread of a distributed iterator: runs a producer ahead of the consumer, bounded.

`Prefetcher(produce, size)` calls ``produce()`` in a daemon thread into a queue of at most `size` results;
`get()` returns ``(ITEM, value)``, ``(END, None)`` once ``produce`` raised `StopIteration`, or
``(ERROR, exception)`` for the consumer to raise. `close()` stops it; threads still running at
interpreter exit are stopped too.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["END", "ERROR", "ITEM", "Prefetcher"]

_LIVE_PREFETCHERS: weakref.WeakSet[Prefetcher] = weakref.WeakSet()
END, ITEM, ERROR = 0, 1, 2


class Prefetcher:
  """Runs `produce` in a daemon thread, at most `size` results ahead of the consumer.

  A result (or the end, or an error) is produced only into a free slot of the queue, and `get` frees
  one, so at most `size` results exist that the consumer has not taken: none is held back waiting for
  room. The thread holds no reference to the iterator that owns it, so dropping the iterator closes it.
  """

  def __init__(self, produce: Callable[[], Any], size: int) -> None:
    self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=size)
    self._slots = threading.Semaphore(size)  # free places in the queue
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._work, args=(produce,), name="tpustrat-input-prefetch",
                                    daemon=True)
    _LIVE_PREFETCHERS.add(self)
    self._thread.start()

  def _work(self, produce: Callable[[], Any]) -> None:
    kind = ITEM
    while kind == ITEM and self._slots.acquire() and not self._stop.is_set():
      try:
        kind, value = ITEM, produce()
      except StopIteration:
        kind, value = END, None
      except BaseException as e:  # pylint: disable=broad-except  # re-raised in the consumer's thread
        kind, value = ERROR, e
      self._queue.put((kind, value))

  def get(self) -> tuple[int, Any]:
    while True:
      try:
        item = self._queue.get(timeout=1.0)
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          return (END, None)
        continue
      self._slots.release()
      return item

  def close(self) -> None:
    self._stop.set()
    self._slots.release()  # wakes the thread if it waits for a slot

  def join(self, timeout: float) -> None:
    self._thread.join(timeout)

  def is_alive(self) -> bool:
    return self._thread.is_alive()


@atexit.register
def _stop_prefetchers() -> None:
  prefetchers = list(_LIVE_PREFETCHERS)
  for p in prefetchers:
    p.close()
  for p in prefetchers:
    p.join(1.0)
