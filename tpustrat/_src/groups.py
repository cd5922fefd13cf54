"""Replica-id matrices checked on the host: TF's `group_assignment` and `source_target_pairs`.

A TF group assignment is an int matrix of shape ``[num_groups, num_replicas_per_group]`` whose row ``g``
lists the replica ids of group ``g``; the groups partition the replicas. A permutation is a
``[num_pairs, 2]`` matrix of ``[source, target]`` rows. Both are checked in Python before any collective is
emitted: a malformed matrix is a `ValueError` (a non-integer one a `TypeError`) that quotes the user's
value. `normalize_group_assignment` returns the groups as a tuple of tuples (`Groups`), and `lax_groups`
the form `jax.lax`'s ``axis_index_groups`` takes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["Groups", "group_size", "label", "lax_groups", "normalize_group_assignment",
           "normalize_source_target_pairs", "quote"]

Groups = tuple[tuple[int, ...], ...]


def label(op: str) -> str:
  """How errors name the API: ``tpustrat.ops.<op>``, or a qualified name such as ``ReplicaContext.all_reduce``."""
  return op if "." in op else f"tpustrat.ops.{op}"


def quote(value: Any) -> str:
  """The user's value for an error message: nested lists for arrays, truncated if long."""
  if isinstance(value, (np.ndarray, jax.Array)) and not isinstance(value, jax.core.Tracer):
    value = np.asarray(value).tolist()
  text = repr(value)
  return text if len(text) <= 300 else text[:297] + "..."


def _static_int_matrix(value: Any, op: str, arg: str) -> np.ndarray:
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
        f"{label(op)}: `{arg}` must be known when the step is traced (a nested list, numpy "
        f"array or concrete jax array), but it is a traced value {value}. Build it from Python "
        "constants, not from arguments of strategy.run or a jitted function.")
  if isinstance(value, (list, tuple)) and value and all(isinstance(r, (list, tuple)) for r in value):
    if len({len(r) for r in value}) > 1:  # ragged nested lists: numpy refuses them
      return np.array([None])  # sentinel, reported by the caller as unequal groups
  try:
    array = np.asarray(value)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{label(op)}: {arg}={quote(value)} is not an integer matrix: {e}") from None
  if array.size and (array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer)):
    raise TypeError(
        f"{label(op)}: {arg}={quote(value)} must hold integer replica ids, got dtype {array.dtype}.")
  return array.astype(np.int64)


def normalize_group_assignment(group_assignment: Any, num_replicas: int, op: str = "collective") -> Groups | None:
  """Validates a TF group assignment and returns it as a tuple of tuples (`None` stays `None`).

  Args:
    group_assignment: ``None`` (one group of every replica) or an integer array-like of shape
      ``[num_groups, num_replicas_per_group]``: nested lists, a numpy array or a concrete jax array.
    num_replicas: the number of replicas the groups must partition.
    op: the API's name for error messages: an op of `tpustrat.ops` or a qualified name.

  Returns:
    ``None`` or the groups as a tuple of tuples of Python ints, in the given order.

  Raises:
    ValueError: quoting the assignment, if it is not rank 2, its groups differ in size, an index is out
      of ``[0, num_replicas)`` or used twice, or the groups do not cover every replica.

  >>> normalize_group_assignment([[0, 2], [1, 3]], 4)
  ((0, 2), (1, 3))
  >>> normalize_group_assignment([[0, 1], [1, 2]], 4)
  Traceback (most recent call last):
  ...
  ValueError: tpustrat.ops.collective: group_assignment=[[0, 1], [1, 2]] uses replica 1 more than once; each replica must be in exactly one group.
  """
  if group_assignment is None:
    return None
  where = f"{label(op)}: group_assignment={quote(group_assignment)}"
  array = _static_int_matrix(group_assignment, op, "group_assignment")
  if array.dtype == object:
    sizes = [len(g) for g in group_assignment]
    raise ValueError(
        f"{where} has groups of unequal sizes {sizes}; every group must have the same number of replicas.")
  if array.ndim != 2:
    raise ValueError(
        f"{where} has rank {array.ndim} (shape {array.shape}); it must have rank 2, shape "
        "[num_groups, num_replicas_per_group], for example [[0, 2, 4, 6], [1, 3, 5, 7]].")
  if array.shape[1] == 0:
    raise ValueError(f"{where} has empty groups; every group needs at least one replica.")
  ids = array.reshape(-1)
  bad = [int(i) for i in ids if not 0 <= i < num_replicas]
  if bad:
    raise ValueError(
        f"{where} names replica {bad[0]}, out of range: replica ids go from 0 to {num_replicas - 1} "
        f"(num_replicas_in_sync={num_replicas}).")
  seen: set[int] = set()
  twice = []
  for i in ids.tolist():
    if i in seen:
      twice.append(i)
    seen.add(i)
  if twice:
    raise ValueError(
        f"{where} uses replica {twice[0]} more than once; each replica must be in exactly one group.")
  if len(seen) != num_replicas:
    missing = sorted(set(range(num_replicas)) - seen)
    raise ValueError(
        f"{where} does not cover every replica (missing {missing}); the groups must partition all "
        f"{num_replicas} replicas (num_replicas_in_sync).")
  return tuple(tuple(int(i) for i in g) for g in array)


def normalize_source_target_pairs(source_target_pairs: Any, num_replicas: int,
                                  op: str = "collective_permute") -> list[tuple[int, int]]:
  """Validates a TF permutation (``[num_pairs, 2]`` rows of ``[source, target]``) and returns its pairs.

  Raises:
    ValueError: quoting the pairs, if they are not of shape ``[num_pairs, 2]``, a replica id is out of
      ``[0, num_replicas)``, or a replica is a source (or a target) more than once.

  >>> normalize_source_target_pairs([[0, 1], [1, 0]], 2)
  [(0, 1), (1, 0)]
  """
  where = f"{label(op)}: source_target_pairs={quote(source_target_pairs)}"
  if isinstance(source_target_pairs, (list, tuple)) and len(source_target_pairs) == 0:
    pairs = np.zeros((0, 2), np.int64)
  else:
    pairs = _static_int_matrix(source_target_pairs, op, "source_target_pairs")
  if pairs.dtype == object or pairs.ndim != 2 or pairs.shape[1] != 2:
    raise ValueError(f"{where} must have shape [num_pairs, 2] (rows of [source, target]).")
  bad = [int(i) for i in pairs.reshape(-1) if not 0 <= i < num_replicas]
  if bad:
    raise ValueError(f"{where} names replica {bad[0]}, out of range: replica ids go from 0 to {num_replicas - 1}.")
  for column, role in ((0, "source"), (1, "target")):
    ids = pairs[:, column].tolist()
    twice = [i for i in set(ids) if ids.count(i) > 1]
    if twice:
      raise ValueError(f"{where} uses replica {min(twice)} as a {role} more than once.")
  return [(int(s), int(t)) for s, t in pairs]


def group_size(groups: Groups | None, num_replicas: int) -> int:
  """The number of replicas in each group (all of them for `None`)."""
  return num_replicas if groups is None else len(groups[0])


def lax_groups(groups: Groups | None, num_replicas: int) -> list[list[int]] | None:
  """``axis_index_groups`` for `jax.lax`: `None` when the one group is every replica in order."""
  if groups is None or groups == (tuple(range(num_replicas)),):
    return None
  return [list(g) for g in groups]
