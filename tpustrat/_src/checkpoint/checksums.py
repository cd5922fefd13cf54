"""Checksums of a checkpoint's arrays: computed on the devices at save, compared after restore.

Two weighted sums of the array's 32-bit words modulo 2**32, each weight odd: an error in one word
always changes both sums (``w * odd == 0 mod 2**32`` only for ``w == 0``); integer sums do not depend on
the order of the reduction, so the value is the same on every layout, replica count and process count.
A multi-process job computes them in one program over the global arrays, a collective: every process
calls `compute` with the same arrays.

Small arrays whose whole value this process holds (a `Mirrored` value's global array; any array of a
one-process job) are fingerprinted on the host instead (`HOST_MAX_ELEMENTS`): the device program is
compiled for each new set of shapes, about a second on a CPU, which made the first save of a small state
ten times a later one; numpy takes about 16 ns an element (2-core CPU), and such a copy is read into host
memory by orbax's save anyway.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpustrat._src.checkpoint.handlers import api

__all__ = ["ALGORITHM", "HOST_MAX_ELEMENTS", "compute", "flat_arrays", "host_fingerprint", "mismatches"]

ALGORITHM = "tpustrat-wsum32x2-v1"
_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77)
_OFFSETS = (0x7F4A7C15, 0x165667B1)
# The largest jax array fingerprinted on the host (about 17 ms of numpy on a 2-core CPU); larger ones, on the
# devices, where the fingerprint is faster and the program's compile time small beside writing the array.
HOST_MAX_ELEMENTS = 1 << 20


def _words(x: jax.Array) -> jax.Array:
  """The content of `x` as uint32 words (any shape; a trailing axis of 2 for 64-bit types)."""
  dtype = x.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # typed PRNG keys
    return _words(jax.random.key_data(x))
  if dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return _words(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
  if jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 8:  # int4 and the like
    return lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)
  size = np.dtype(dtype).itemsize
  if size in (4, 8):
    return lax.bitcast_convert_type(x, jnp.uint32)
  return lax.bitcast_convert_type(x, {2: jnp.uint16, 1: jnp.uint8}[size]).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
  w = _words(x)
  index = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):
    index = index + lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= w.shape[axis]
  rotated = (w << 16) | (w >> 16)
  sums = []
  for words, multiplier, offset in ((w, *_pair(0)), (rotated, *_pair(1))):
    weights = ((index + jnp.uint32(offset)) * jnp.uint32(multiplier)) | jnp.uint32(1)
    sums.append(jnp.sum(words * weights, dtype=jnp.uint32))
  return jnp.stack(sums)


def _pair(i: int) -> tuple[int, int]:
  return _MULTIPLIERS[i], _OFFSETS[i]


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
  return [_fingerprint(x) for x in leaves]


def _host_words(x: np.ndarray) -> np.ndarray | None:
  """`_words` of a host array, computed on the host; None for dtypes left to the devices (64-bit types,
  which JAX narrows without ``jax_enable_x64``; sub-byte and extended types)."""
  dtype = x.dtype
  if jax.dtypes.canonicalize_dtype(dtype) != dtype:
    return None
  if dtype == np.bool_:
    return x.astype(np.uint32)
  if dtype == np.complex64:
    return _host_words(np.stack([x.real, x.imag], axis=-1))
  if not _plain_number(dtype) or dtype.itemsize not in (1, 2, 4):
    return None
  if jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 8:  # int4 and the like
    return None
  unsigned = np.ascontiguousarray(x).view({4: np.uint32, 2: np.uint16, 1: np.uint8}[dtype.itemsize])
  return unsigned.astype(np.uint32)


def host_fingerprint(x: np.ndarray) -> np.ndarray | None:
  """`_fingerprint` of a host array computed with numpy (the same two sums, without putting the array on
  a device: a restore that re-lays a sharded value out reads it into host memory only), or None for the
  dtypes `_host_words` leaves to the devices."""
  w = _host_words(np.asarray(x))
  if w is None:
    return None
  w = w.reshape(-1)
  index = np.arange(w.size, dtype=np.uint64).astype(np.uint32)  # row-major position, modulo 2**32
  rotated = (w << np.uint32(16)) | (w >> np.uint32(16))
  sums = []
  for words, (multiplier, offset) in ((w, _pair(0)), (rotated, _pair(1))):
    weights = ((index + np.uint32(offset)) * np.uint32(multiplier)) | np.uint32(1)
    sums.append(np.sum(words * weights, dtype=np.uint32))
  return np.array(sums, np.uint32)


def _plain_number(dtype: np.dtype) -> bool:
  """Whether `dtype` is a boolean, integer or floating type (ml_dtypes' bfloat16 and float8 included)."""
  return dtype.kind in "biuf" or (dtype.kind == "V" and jnp.issubdtype(dtype, jnp.floating))


def _checksummable(x: Any) -> bool:
  if isinstance(x, jax.Array):
    return True
  return isinstance(x, np.ndarray) and (x.dtype.kind == "c" or _plain_number(x.dtype))


def flat_arrays(tree: Any) -> dict[str, Any]:
  """``{orbax's name of the leaf ("a/b/0"): array}`` for every array leaf of `tree` (orbax's own flattening,
  the names its files use, so that a tree restored without a target has the same names). A tree orbax
  cannot flatten is named by JAX's key paths instead."""
  ocp = api().ocp
  try:
    flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(tree))
    named = {"/".join(str(k) for k in key): x for key, x in flat.items()}
  except Exception:  # noqa: BLE001  # an unusual tree: JAX's names
    named = {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
  return {name: x for name, x in named.items() if _checksummable(x)}


def _on_host(x: jax.Array) -> np.ndarray | None:
  """The value of `x` read into host memory when it is small enough to fingerprint there and this process
  holds all of it, else None. The choice depends only on the array's shape, dtype and sharding and on the
  process count, so every process of a job makes the same one (the others join one device program)."""
  if x.size > HOST_MAX_ELEMENTS or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
    return None
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))  # one device's copy: no program runs
  if jax.process_count() == 1 and x.is_fully_addressable:
    return np.asarray(x)
  return None


def compute(arrays: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """``{name: {"dtype", "shape", "sums": [s1, s2]}}``. Host numpy arrays and small jax arrays whose whole
  value this process holds are fingerprinted on the host (`host_fingerprint`, `_on_host`); the other jax
  arrays in one program per set of devices they live on (a collective for arrays of a multi-process job:
  every process calls it with the same arrays); numpy arrays of the dtypes `host_fingerprint` leaves to
  the devices on this process's first device."""
  groups: dict[Any, list[str]] = {}
  values: dict[str, Any] = {}
  for name in sorted(arrays):
    x = arrays[name]
    local = x if isinstance(x, np.ndarray) else _on_host(x) if isinstance(x, jax.Array) else None
    if local is not None:
      host = host_fingerprint(local)
      if host is not None:
        values[name] = host
        continue
    if isinstance(x, jax.Array) and getattr(x, "committed", True):
      # the devices in their mesh's order: one program takes arrays of one device order (a hybrid-sharded
      # value's saved blocks lie on its groups' mesh, the strategy's devices in another order)
      mesh = getattr(x.sharding, "mesh", None)
      ids = [d.id for d in mesh.devices.flat] if isinstance(mesh, jax.sharding.Mesh) else None
      key = tuple(ids) if ids is not None else tuple(sorted(d.id for d in x.sharding.device_set))
    else:  # numpy, or a jax array JAX may place anywhere: this process's first device
      key = None
    groups.setdefault(key, []).append(name)
  for key, group in groups.items():
    leaves = [arrays[n] for n in group]
    if key is None:
      device = jax.local_devices()[0]
      leaves = [jax.device_put(x, device) for x in leaves]
    values.update(zip(group, _fingerprints(leaves)))
  out = {}
  for n in sorted(arrays):
    fp, x = values[n], arrays[n]
    host = fp if isinstance(fp, np.ndarray) else np.asarray(fp.addressable_data(0))
    dtype = str(x.dtype) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else str(np.dtype(x.dtype))
    out[n] = {"dtype": dtype, "shape": list(np.shape(x)), "sums": [int(v) for v in host]}
  return out


def mismatches(saved: dict[str, Any], restored_tree: Any) -> list[str]:
  """The arrays of `restored_tree` whose content differs from the checksums saved with them. An array
  restored with another dtype than it was saved with (the target's) cannot be compared, and is not."""
  arrays = flat_arrays(restored_tree)
  comparable = {n: x for n, x in arrays.items()
                if n in saved and list(np.shape(x)) == saved[n]["shape"] and str(x.dtype) == saved[n]["dtype"]}
  now = compute(comparable)
  return [f"{n!r} ({saved[n]['dtype']}{saved[n]['shape']}: saved with checksums "
          f"{saved[n]['sums'][0]:08x}{saved[n]['sums'][1]:08x}, read back as "
          f"{now[n]['sums'][0]:08x}{now[n]['sums'][1]:08x})"
          for n in sorted(now) if now[n]["sums"] != saved[n]["sums"]]

