"""Argument checks shared by every layer, in one error style (jax's): the function, the argument, what was
given, what was expected. Raised on the host, before anything is traced.

>>> check_int(3, "RunOptions", "max_steps_in_flight", minimum=1)
3
>>> check_int(True, "RunOptions", "max_steps_in_flight", minimum=1)
Traceback (most recent call last):
...
TypeError: RunOptions: `max_steps_in_flight` must be an int >= 1, got bool True.
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["check_int", "is_int", "normalize_axis"]


def is_int(value: Any) -> bool:
  """Whether `value` is an integer (Python or numpy), not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value: Any, where: str, name: str, *, minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False) -> Any:
  """`value` as a Python int (or None where allowed), or an error in the house style.

  Args:
    value: what the user passed.
    where: the function or class that takes it, e.g. ``"strategy.experimental_run_steps"``.
    name: the argument's name.
    minimum, maximum: inclusive bounds, if any.
    allow_none: whether None is accepted (and returned).

  Raises:
    TypeError: `value` is not an int (bools are not ints here).
    ValueError: `value` is out of bounds.
  """
  if value is None and allow_none:
    return None
  expected = "an int" + (f" >= {minimum}" if minimum is not None else "") + (
      f" <= {maximum}" if maximum is not None else "") + (" or None" if allow_none else "")
  if not is_int(value):
    raise TypeError(f"{where}: `{name}` must be {expected}, got {type(value).__name__} {value!r:.60}.")
  if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
    raise ValueError(f"{where}: `{name}` must be {expected}, got {value!r}.")
  return int(value)


def normalize_axis(axis: Any, rank: int, where: str) -> int:
  """`axis` of a value of rank `rank` as an index in ``[0, rank)`` (negative axes count from the end).

  Only a Python int is an axis here (not a bool, not a numpy integer), as for `strategy.reduce`.

  Raises:
    TypeError: `axis` is not an int.
    ValueError: `axis` is outside ``[-rank, rank)``.
  """
  if not isinstance(axis, int) or isinstance(axis, bool):
    raise TypeError(f"{where}: `axis` must be an int or None, got {type(axis).__name__} {axis!r:.60}.")
  if not -rank <= axis < rank:
    raise ValueError(f"{where}: `axis` = {axis!r} out of range for `value` with rank {rank}.")
  return axis % rank
