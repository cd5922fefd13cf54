"""Reusable aligned host buffers for the copies the input pipeline makes of a source's memory.

On XLA:CPU a transfer of 64-byte-aligned host memory aliases it instead of copying (see
`tpustrat._src.host_memory`), so a batch that still lives in the source's memory is copied into library
memory before it is put on the devices. A fresh allocation for every such copy costs more than the copy:
a multi-MiB allocation typically gets memory fresh from the operating system, whose pages fault on
first write (measured on the 2-core machine of benchmarks/bench_input.py: about 1 ms for a 6 MiB batch
against 0.25 ms for the copy into memory already touched). `StagingBuffers` keeps a few buffers per shape
and dtype and reuses one once nothing else can use its memory any more; `clear()` (at the end of a pass
over the data) lets go of them, so that they are freed with the last batch that uses them.

A buffer is free when the only references to it and to the array that owns its memory are the pool's
own: anything that still reads the memory in place holds a reference to its owner, as it must to keep
the memory from being freed under it. That includes a device buffer that aliases it (jaxlib keeps the
owner alive until the device buffer, and every computation using it, is done) and any numpy view.

Two helpers make the per-batch path of a batch layout seen before cheap: `alias_residues` is
`host_memory.may_alias` with the address left open (computed once per layout, then one remainder per
batch), and `put_split` is `jax.device_put` of numpy leaves onto one sharding without its per-call dispatch.

>>> pool = StagingBuffers()
>>> a = pool.copy(np.arange(4.0))
>>> address = a.ctypes.data
>>> b = pool.copy(np.ones(4))   # `a` is still referenced: another buffer
>>> b.ctypes.data == address
False
>>> del a
>>> c = pool.copy(np.zeros(4))   # the first one again
>>> c.ctypes.data == address, c.tolist()
(True, [0.0, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from tpustrat._src import host_memory, jax_compat

__all__ = ["StagingBuffers", "alias_residues", "put_split"]


class StagingBuffers:
  """At most `per_shape` reusable aligned buffers for each (shape, dtype); thread-safe."""

  def __init__(self, per_shape: int = 4) -> None:
    self._per_shape = per_shape
    self._buffers: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}
    self._lock = threading.Lock()

  def copy(self, x: np.ndarray) -> np.ndarray:
    """A copy of `x` in aligned library memory: a free buffer of the pool, or a new one (kept for reuse
    while the pool holds fewer than `per_shape` of that shape)."""
    key = (x.shape, x.dtype)
    with self._lock:
      buffers = self._buffers.setdefault(key, [])
      for i in range(len(buffers)):
        if _unused(buffers, i):
          np.copyto(buffers[i], x)
          return buffers[i]
      out = host_memory.owned_copy(x)
      if len(buffers) < self._per_shape and out.base is not None:
        buffers.append(out)
      return out


  def clear(self) -> None:
    """Forgets every buffer (those still in use stay alive as long as their users hold them)."""
    with self._lock:
      self._buffers.clear()


def _unused(buffers: list[np.ndarray], i: int) -> bool:
  """Whether nothing but the pool refers to ``buffers[i]`` or to the array that owns its memory (its
  ``base``, referred to once by the buffer itself)."""
  # `sys.getrefcount` counts its argument too: 2 for the buffer (the list + the argument), 2 for its base
  # (the buffer's `base` + the argument).
  return sys.getrefcount(buffers[i]) == 2 and sys.getrefcount(buffers[i].base) == 2


def alias_residues(x: np.ndarray, parts: int, align: int) -> frozenset[int] | None:
  """The data addresses modulo `align` at which ``host_memory.may_alias(x, parts, align)`` holds, for any
  array of `x`'s dtype, shape and strides: the layout's half of that test, so that a batch of a layout
  seen before needs one remainder (``x.ctypes.data % align in residues``). Empty: never aliased. None
  where the answer also depends on ``jax_enable_x64`` (64-bit dtypes, which JAX may narrow): ask
  `may_alias` each time.

  >>> x = host_memory.host_empty((4, 8), np.float32)   # rows of 32 bytes
  >>> sorted(alias_residues(x, 4, 64)), host_memory.may_alias(x, 4, 64)
  ([0, 32], True)
  >>> alias_residues(x[:, ::2], 4, 64), alias_residues(np.zeros(3), 1, 64)
  (frozenset(), None)
  """
  if x.dtype.itemsize == 8 and x.dtype.kind in "iufc":
    return None
  if x.dtype.hasobject or x.dtype.kind in "OSUMm" or not x.flags.c_contiguous:
    return frozenset()
  if jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype:
    return frozenset()
  step = x.strides[0] if x.ndim else 0
  if step % align == 0:
    parts = 1  # every part starts at the same offset modulo `align`
  return frozenset((-i * step) % align for i in range(parts))


_PUTS: dict[tuple[tuple[int, ...], np.dtype, jax.sharding.Sharding], Callable[[np.ndarray], jax.Array]] = {}
_PUTS_SIZE = 256  # layouts kept; forgotten all at once when full


def put_split(leaves: Sequence[np.ndarray], sharding: jax.sharding.Sharding) -> list[jax.Array]:
  """``jax.device_put(leaves, sharding)`` for host numpy leaves, as `jax.make_array_from_callback` makes
  them: the same transfers of the same slices (``jax.device_put`` ends in the same batched transfer; the
  same dtype narrowing, and on XLA:CPU the same aliasing of aligned memory), without ``device_put``'s
  per-call dispatch (a primitive bind, abstractification and sharding inference for each leaf: about 90 us
  of a small batch's 150 us on XLA:CPU, see docs/guides/input.md), and with what depends only on a leaf's
  (shape, dtype) and the sharding worked out once (`jax_compat.sharded_put`)."""
  out = []
  for x in leaves:
    key = (x.shape, x.dtype, sharding)
    put = _PUTS.get(key)
    if put is None:
      if len(_PUTS) >= _PUTS_SIZE:
        _PUTS.clear()
      put = _PUTS[key] = jax_compat.sharded_put(x.shape, x.dtype, sharding)
    out.append(put(x))
  return out
