"""The all-reduce algorithms of `tpustrat._src.cross_device` and gradient packing, inside `shard_map`.

Everything here runs inside a `jax.shard_map` body over the replica axis, on flat one-dtype buffers
("packs"). `plan` and `pack` say how a batch of tensors becomes packs (TF's three repacking rules and
`bytes_per_pack`); `ring_sum`, `hierarchical_sum`, `reduce_to_root` and `tree_broadcast` are written with
collective-permutes and run in an unchecked region; `as_replicated` runs such an algorithm and types its
result as replicated (with the all-reduce's adjoint as its gradient), as `lax.psum` does by itself.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from tpustrat._src import jax_compat
from tpustrat._src.jax_compat import varying_axes

__all__ = [
    "Bucket", "accumulate", "accumulate_on_device", "add_n", "as_replicated", "divide_by", "hierarchical_sum",
    "pack", "plan", "reduce_to_root", "ring_sum", "split_sizes", "summable", "to_varying", "tree_broadcast",
]


# -- packing ------------------------------------------------------------------------------------------


class Bucket(NamedTuple):
  """Tensors `indices` (one dtype) concatenated flat, then cut into `num_splits` slices."""

  dtype: np.dtype
  indices: tuple[int, ...]
  num_splits: int = 1


def plan(avals: Sequence[tuple[tuple[int, ...], np.dtype]], rule: tuple[Any, ...]) -> list[Bucket]:
  """How a batch of tensors (``(shape, dtype)`` each) is packed; `rule` is one of

  ``("tensor",)``: one bucket per tensor. ``("split", k)``: per dtype, everything concatenated and cut into
  `k` slices. ``("small", max_bytes, max_group)``: runs of consecutive tensors of one dtype with at most
  `max_bytes` bytes each, in groups of at most `max_group` (a run of one stays alone).
  ``("bytes", b)``: per dtype, in order, a new pack starts once the current one holds more than `b` bytes.

  >>> f32 = np.dtype("float32")
  >>> plan([((2,), f32), ((3,), f32), ((1000,), f32), ((4,), f32)], ("small", 64, 10))
  [Bucket(dtype=dtype('float32'), indices=(0, 1), num_splits=1), Bucket(dtype=dtype('float32'), indices=(2,), num_splits=1), Bucket(dtype=dtype('float32'), indices=(3,), num_splits=1)]
  """
  kind = rule[0]
  sizes = [int(np.prod(s, dtype=np.int64)) for s, _ in avals]
  dtypes = [np.dtype(d) for _, d in avals]
  if kind == "tensor":
    return [Bucket(d, (i,)) for i, d in enumerate(dtypes)]
  by_dtype: dict[np.dtype, list[int]] = {}
  for i, d in enumerate(dtypes):
    by_dtype.setdefault(d, []).append(i)
  if kind == "split":
    return [Bucket(d, tuple(idx), rule[1]) for d, idx in by_dtype.items()]
  if kind == "bytes":
    limit, buckets = rule[1], []
    for d, idx in by_dtype.items():
      packs: list[list[int]] = []
      size = 0
      for i in idx:
        if not packs or size > limit:  # TF: each pack is at least `bytes_per_pack` large
          packs.append([])
          size = 0
        packs[-1].append(i)
        size += sizes[i] * d.itemsize
      buckets += [Bucket(d, tuple(p)) for p in packs]
    return sorted(buckets, key=lambda b: b.indices[0])
  if kind == "small":
    max_bytes, max_group = rule[1], rule[2]
    buckets = []
    run: list[int] = []

    def flush() -> None:
      for start in range(0, len(run), max_group):
        group = run[start:start + max_group]
        buckets.append(Bucket(dtypes[group[0]], tuple(group)))
      run.clear()

    for i, d in enumerate(dtypes):
      small = sizes[i] * d.itemsize <= max_bytes
      if run and (not small or dtypes[run[-1]] != d):
        flush()
      if small:
        run.append(i)
      else:
        buckets.append(Bucket(d, (i,)))
    flush()
    return sorted(buckets, key=lambda b: b.indices[0])
  raise AssertionError(rule)


def split_sizes(total: int, num_splits: int) -> list[int]:
  """TF's `_ConcatAndSplitPacker`: equal slices, the last one takes the remainder; no empty slices."""
  size = total // num_splits
  if num_splits <= 1 or size == 0:
    return [total]
  return [size] * (num_splits - 1) + [total - size * (num_splits - 1)]


def pack(leaves: Sequence[jax.Array], buckets: Sequence[Bucket]) -> tuple[list[jax.Array], Callable[[list[jax.Array]], list[jax.Array]]]:
  """Flat packs of `leaves` per `buckets`, and the function that takes reduced packs back to leaves."""
  pieces: list[jax.Array] = []
  layout = []
  for bucket in buckets:
    parts = [leaves[i].reshape(-1) for i in bucket.indices]
    flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    sizes = split_sizes(flat.shape[0], bucket.num_splits)
    if len(sizes) == 1:
      pieces.append(flat)
    else:
      pieces.extend(jnp.split(flat, np.cumsum(sizes)[:-1].tolist()))
    layout.append(len(sizes))
  shapes = [x.shape for x in leaves]

  def unpack(reduced: list[jax.Array]) -> list[jax.Array]:
    out: list[Any] = [None] * len(shapes)
    it = iter(reduced)
    for bucket, count in zip(buckets, layout):
      got = [next(it) for _ in range(count)]
      flat = got[0] if count == 1 else jnp.concatenate(got)
      offsets = np.cumsum([int(np.prod(shapes[i], dtype=np.int64)) for i in bucket.indices])[:-1].tolist()
      for i, part in zip(bucket.indices, jnp.split(flat, offsets) if offsets else [flat]):
        out[i] = part.reshape(shapes[i])
    return out

  return pieces, unpack


# -- the algorithms (inside shard_map; one flat buffer per pack) --------------------------------------


def _replica_mask(n: int, members: Sequence[int], axis: str) -> jax.Array:
  """A boolean scalar: whether this replica is one of `members` (a static table indexed by axis_index)."""
  table = np.zeros(n, bool)
  table[list(members)] = True
  return jnp.asarray(table)[lax.axis_index(axis)]


def ring_sum(x: jax.Array, axis: str, n: int) -> jax.Array:
  """Ring all-reduce of a flat buffer: n-1 reduce-scatter steps, then n-1 all-gather steps (unchecked)."""
  if n == 1 or x.size == 0:
    return x
  length = x.shape[0]
  chunk = -(-length // n)
  buf = jnp.pad(x, (0, n * chunk - length)).reshape(n, chunk)
  i = lax.axis_index(axis)
  right = [(j, (j + 1) % n) for j in range(n)]
  for s in range(n - 1):  # after step s, chunk (i - s - 1) holds s + 2 replicas' terms
    recv = lax.ppermute(buf[(i - s) % n], axis, right)
    buf = buf.at[(i - s - 1) % n].add(recv)
  for s in range(n - 1):  # replica i owns the full sum of chunk (i + 1); pass the sums around
    recv = lax.ppermute(buf[(i + 1 - s) % n], axis, right)
    buf = buf.at[(i - s) % n].set(recv)
  return buf.reshape(-1)[:length]


def hierarchical_sum(x: jax.Array, axis: str, n: int, pack_index: int) -> jax.Array:
  """TF's hierarchical copy on a flat buffer: two halves, sum at each half's leader, leaders swap, copy back.

  The leaders are at offset ``pack_index % half_size`` in their halves (TF rotates them from pack to pack
  to spread the work). Runs unchecked (the copies are collective-permutes).
  """
  if n == 1 or x.size == 0:
    return x
  half = n // 2
  groups = [list(range(half)), list(range(half, n))]
  leaders = [g[pack_index % len(g)] for g in groups]
  width = max(len(g) for g in groups)
  acc = x
  for r in range(1, width):  # each member copies its tensor to its group's leader, which adds it
    pairs = [(g[(g.index(lead) + r) % len(g)], lead) for g, lead in zip(groups, leaders) if r < len(g)]
    acc = acc + lax.ppermute(x, axis, pairs)  # non-leaders receive zeros
  is_leader = _replica_mask(n, leaders, axis)
  other = lax.ppermute(acc, axis, [(leaders[0], leaders[1]), (leaders[1], leaders[0])])
  acc = jnp.where(is_leader, acc + other, acc)  # a + b == b + a exactly: both leaders hold one value
  out = acc
  for r in range(1, width):  # each leader copies the total to one more member of its group
    pairs = [(lead, g[(g.index(lead) + r) % len(g)]) for g, lead in zip(groups, leaders) if r < len(g)]
    got = lax.ppermute(acc, axis, pairs)
    out = jnp.where(_replica_mask(n, [dst for _, dst in pairs], axis), got, out)
  return out


def add_n(values: Sequence[jax.Array]) -> jax.Array:
  """TF's default `accumulation_fn` (`add_n`): the sum of the tensors, added in order."""
  return functools.reduce(operator.add, values)


def reduce_to_root(x: jax.Array, axis: str, n: int, root: int,
                    accumulation_fn: Callable[[list[jax.Array]], Any]) -> jax.Array:
  """Copies every replica's buffer to replica `root` (n-1 permutes), which alone accumulates them.

  Other replicas return zeros. Runs unchecked.
  """
  if n == 1:
    return accumulate(accumulation_fn, [x])
  parts: list[jax.Array] = [x] * n
  for r in range(1, n):
    src = (root + r) % n
    parts[src] = lax.ppermute(x, axis, [(src, root)])
  return lax.cond(lax.axis_index(axis) == root,
                  lambda ps: accumulate(accumulation_fn, list(ps)), lambda ps: jnp.zeros_like(ps[0]), parts)


def accumulate(accumulation_fn: Callable[[list[jax.Array]], Any], parts: list[jax.Array]) -> jax.Array:
  out = jnp.asarray(accumulation_fn(parts))
  if out.shape != parts[0].shape or out.dtype != parts[0].dtype:
    raise ValueError(
        f"accumulation_fn must return one tensor with the shape and dtype of its inputs "
        f"({parts[0].dtype}{list(parts[0].shape)}), got {out.dtype}{list(out.shape)}.")
  return out


def tree_broadcast(x: jax.Array, axis: str, n: int, root: int) -> jax.Array:
  """Binomial-tree broadcast from replica `root`: ceil(log2 n) rounds of collective-permutes (unchecked)."""
  d = 1
  while d < n:
    pairs = [((root + r) % n, (root + r + d) % n) for r in range(d) if r + d < n]
    got = lax.ppermute(x, axis, pairs)
    x = jnp.where(_replica_mask(n, [dst for _, dst in pairs], axis), got, x)
    d *= 2
  return x


def as_replicated(algorithm: Callable[[list[jax.Array]], list[jax.Array]], pieces: list[jax.Array],
                  axis: str) -> list[jax.Array]:
  """Runs an unchecked all-reduce `algorithm` and types its (identical) results as replicated.

  The backward pass is the all-reduce's adjoint under JAX's varying-axis semantics (as for `lax.psum`):
  each replica's input gets the result's cotangent.
  """

  @jax.custom_vjp
  def all_reduce(xs: list[jax.Array]) -> list[jax.Array]:
    region = jax.shard_map(algorithm, in_specs=P(), out_specs=P(), axis_names=frozenset(), check_vma=False)
    return region(xs)

  def fwd(xs: list[jax.Array]) -> tuple[list[jax.Array], None]:
    return all_reduce(xs), None

  def bwd(_: None, cts: list[jax.Array]) -> tuple[list[jax.Array]]:
    return ([ct if ct.dtype == jax.dtypes.float0 or axis in varying_axes(ct)
             else lax.pcast(ct, axis, to="varying") for ct in cts],)

  all_reduce.defvjp(fwd, bwd)
  # Empty buffers need no communication (and JAX would not type an empty region output as replicated).
  full = [p for p in pieces if p.size]
  out = iter(all_reduce(full) if full else [])
  return [next(out) if p.size else jnp.zeros(p.shape, p.dtype) for p in pieces]


def to_varying(x: jax.Array, axis: str) -> jax.Array:
  """`x` typed as varying over `axis` (`jax_compat.to_varying`): an all-reduce's input is a local value."""
  return jax_compat.to_varying(x, axis)


def divide_by(x: jax.Array, n: int) -> jax.Array:
  """MEAN: the sum divided by the number of replicas (integer sums become float32, as in `strategy.reduce`)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return x / jnp.asarray(n, x.dtype)
  return x / jnp.float32(n)


def summable(x: jax.Array) -> jax.Array:
  return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x  # as lax.psum does


@functools.partial(jax.jit, static_argnums=1)
def accumulate_on_device(parts: list[jax.Array], accumulation_fn: Callable[[list[jax.Array]], Any]) -> jax.Array:
  return accumulate(accumulation_fn, [summable(p) for p in parts])
