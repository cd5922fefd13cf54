"""Donation (`RunOptions.donate_argnums`): which argument leaves a program may reuse, and the errors said
before dispatch for the donations XLA cannot make.

* `donated_leaves` maps donated argument positions to flat leaf positions (worked out once per argument
  structure by `Engine.run`).
* `check_donatable` refuses, before dispatch, a batch of a distributed dataset (its iterator still uses
  its buffers) and an array donated at one position and passed at another.
* Once any program of the process has donated (`donation_used`), every dispatch checks its arguments with
  `check_not_deleted`: a compiled program handed a deleted (donated) buffer crashed the process on
  XLA:CPU instead of raising (JAX 0.10.2), so the error is said first, naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tpustrat._src.values import PerReplica, is_distributed

__all__ = ["DONATION_USED", "check_donatable", "check_not_deleted", "donated_leaves", "donation_used"]

# Set once a program of this process donates: from then on, arguments are checked (`check_not_deleted`). A
# one-element list, read by `Engine.run` on every step (one index, no call).
DONATION_USED = [False]


def donation_used(now: bool = False) -> bool:
  """Whether a program of this process has donated arguments (`RunOptions.donate_argnums`); `now`: one
  is about to."""
  if now:
    DONATION_USED[0] = True
  return DONATION_USED[0]


_CONCRETE_ARRAY_TYPES: set[type] = set()  # concrete (non-tracer) jax.Array types seen by `check_not_deleted`


def check_not_deleted(leaves: list[Any], where: Callable[[int], str]) -> None:
  """RuntimeError naming the first deleted array among `leaves` (`where(i)` says which it is): one donated
  to an earlier program. Checked before dispatch, because a compiled program handed a deleted buffer
  crashed the process on XLA:CPU instead of raising (JAX 0.10.2). Per step: a set lookup of the leaf's type
  and `is_deleted()` (about 50 ns a leaf here)."""
  known = _CONCRETE_ARRAY_TYPES
  for i, x in enumerate(leaves):
    kind = type(x)
    if kind not in known:
      if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        continue
      known.add(kind)
    if x.is_deleted():
      raise RuntimeError(
          f"{where(i)} has been deleted: it was donated to an earlier step (RunOptions(donate_argnums=...)) "
          "or deleted. Pass the value that step returned instead (jax: Array has been deleted).")


def check_donatable(args: Any, donate_argnums: tuple[int, ...], leaves: list[Any] | None,
                    donate: tuple[int, ...], where: Callable[[int], str]) -> None:
  """Errors, before dispatch, for donations XLA cannot make: batches of a distributed dataset among `args`
  at `donate_argnums` (their iterator still uses their buffers, and their real-row counts are shared: a
  property of the arguments' structure), and, among `leaves`, an array at a donated position `donate` that
  is also passed at another position (XLA:CPU crashed on "a buffer that was previously donated in the same
  call")."""
  for i in donate_argnums:
    for node in jax.tree.leaves(args[i], is_leaf=is_distributed):
      if isinstance(node, PerReplica) and node.real_rows_array is not None:
        raise ValueError(
            f"RunOptions(donate_argnums={donate_argnums}): argument {i} holds a batch of a distributed dataset "
            f"({node!r}); its iterator keeps using the batch's buffers, so it cannot be donated. Donate the "
            "training state only.")
  if leaves is None:
    return
  donated = {id(leaves[j]): j for j in donate}
  for j, x in enumerate(leaves):
    first = donated.get(id(x))
    if first is not None and first != j and isinstance(x, jax.Array):
      raise ValueError(
          f"{where(j)} is the same array as {where(first).split(': ', 1)[-1]}, which is donated: an array "
          "can be donated only where it is passed once (tied weights: pass the copy that is donated once, or "
          "do not donate).")


def donated_leaves(donate: tuple[int, ...], arg_leaves: list[int], where: str) -> tuple[int, ...]:
  """The flat leaf positions of the arguments `donate` (see `RunOptions.donate_argnums`), given the
  number of leaves of each positional argument; ValueError naming an index out of range."""
  for i in donate:
    if i >= len(arg_leaves):
      raise ValueError(
          f"{where}: RunOptions(donate_argnums={donate}) names argument {i}, but there are "
          f"{len(arg_leaves)} positional arguments.")
  starts = np.cumsum([0, *arg_leaves])
  return tuple(int(j) for i in donate for j in range(starts[i], starts[i + 1]))
