"""Host numpy memory on its way to the devices.

Two facts about `jax.device_put` of a numpy array (measured with JAX 0.10.2; tests/test_input_buffers.py
checks them) decide how arrays leave the host:

* It returns before the copy is done: the array must not change until the transfer has completed.
* XLA:CPU does not copy a 64-byte-aligned array at all, even with ``may_alias=False``: the device buffer
  *is* that memory for as long as the device array lives. GPU and TPU copy into device memory.

TF's semantics are that a value handed to the runtime is captured when it is handed over. The input
pipeline (`input.py`) and `strategy.run` (`engine/engine.py`) keep them with the helpers here: copy an array
that a transfer would alias (`may_alias`) into library memory first (`owned_copy`), and wait for a
transfer out of memory the caller still owns before that memory can change. Arrays the library builds
itself are allocated aligned (`host_empty`), so that on XLA:CPU they reach the devices without a copy.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

ALIGN = 64  # bytes: the alignment at which XLA:CPU aliases host memory (see `alias_alignment`)


def host_empty(shape: tuple[int, ...], dtype: Any, align: int = ALIGN) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary."""
  dtype = np.dtype(dtype)
  nbytes = math.prod(shape) * dtype.itemsize
  raw = np.empty(nbytes + align, np.uint8)
  start = -raw.ctypes.data % align
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def owned_copy(x: np.ndarray) -> np.ndarray:
  """A copy of `x` in aligned library memory."""
  out = host_empty(x.shape, x.dtype)
  np.copyto(out, x)
  return out


def unaliased(x: np.ndarray, parts: int, align: int | None) -> np.ndarray:
  """`x`, or a copy of it in library memory if putting it split into `parts` (see `may_alias`) onto a
  backend that aliases `align`-aligned host memory (`alias_alignment`; None: it always copies) would
  leave a device buffer on `x`'s memory."""
  return owned_copy(x) if align is not None and may_alias(x, parts, align) else x


def mesh_alias_alignment(mesh: jax.sharding.Mesh | None) -> int | None:
  """`alias_alignment` of this process's first device of `mesh` (None: the default device); None if
  the mesh has no device in this process."""
  local = jax.devices()[:1] if mesh is None else [d for d in mesh.devices.flat
                                                  if d.process_index == jax.process_index()]
  return alias_alignment(local[0]) if local else None


def owned_copies(tree: Any) -> Any:
  """`tree` with its numpy arrays copied into library memory: captured now, for a transfer that happens
  later (inside a `jax.jit` call) and may read them in place."""
  return jax.tree.map(lambda x: owned_copy(x) if isinstance(x, np.ndarray) else x, tree)


@functools.cache
def alias_alignment(device: jax.Device) -> int | None:
  """The smallest alignment (bytes) at which `jax.device_put` of a numpy array onto `device` aliases the
  array's memory instead of copying it, or None if it always copies.

  XLA:CPU: 64. GPU, TPU: None (a platform that cannot report buffer addresses is taken to copy into
  device memory). Probed once per device with a few small transfers, so that the library follows what
  the installed JAX does rather than a platform name.
  """
  raw = host_empty((3 * 4096,), np.uint8, align=4096)
  for align in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096):
    view = raw[align:align + 1024]  # starts exactly `align`-aligned (not 2*align)
    try:
      put = jax.device_put(view, device)
      put.block_until_ready()
      if put.unsafe_buffer_pointer() == view.ctypes.data:
        return align
    except Exception:  # pylint: disable=broad-except  # no buffer addresses: separate device memory
      return None
  return None


def may_alias(x: np.ndarray, parts: int, align: int) -> bool:
  """Whether putting `x` split into `parts` along its first axis (``parts=1``: whole, or replicated;
  else ``parts == x.shape[0]``, one part per index) may leave a device buffer on `x`'s memory: some part
  starts `align`-aligned. Never for arrays JAX first converts (a dtype it canonicalizes, such as float64
  without x64) or lays out anew (not C-contiguous): those reach the devices through new memory."""
  if x.dtype.hasobject or x.dtype.kind in "OSUMm":  # not an array dtype: JAX raises its own error
    return False
  if not x.flags.c_contiguous or jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype:
    return False
  addr = x.ctypes.data
  step = x.strides[0] if x.ndim else 0
  if step % align == 0:
    parts = 1  # every part starts at the same offset modulo `align`
  return any((addr + i * step) % align == 0 for i in range(parts))
