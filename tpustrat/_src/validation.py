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
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["check_fits_32_bits", "check_int", "check_seconds", "check_tree_fits_32_bits", "is_int",
           "normalize_axis", "tree_path", "x64_enabled"]


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


# -- 64-bit host integers without `jax_enable_x64` -------------------------------------------------------
#
# Without `jax_enable_x64` JAX narrows int64 to int32 and uint64 to uint32 when a host array reaches the
# devices, silently wrapping values that do not fit (3_000_000_000 arrives as -1294967296). tpustrat checks
# host arrays where user data enters (batches, `run` arguments, `experimental_distribute_values_from_function`,
# `PerReplica` components) and raises instead. Only 64-bit integer dtypes are narrowed, so only they are
# read (one min and one max over the array); uint32 stays uint32 in JAX and is never checked. float64 and
# complex128 become float32 and complex64, as in JAX: that loses precision, not the integers' identity,
# and is not checked.

_NARROWED: dict[np.dtype[Any], np.dtype[Any]] = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32)}


def x64_enabled() -> bool:
  """Whether JAX keeps 64-bit values (``jax_enable_x64``, also within its context managers)."""
  import jax  # pylint: disable=import-outside-toplevel  # loaded by every caller; the launcher never calls this
  # The flag read through its effect: `jax.config.jax_enable_x64` is a dynamic attribute JAX's types lack.
  return jax.dtypes.canonicalize_dtype(np.int64) == np.dtype(np.int64)


def check_fits_32_bits(x: Any, where: str | Callable[[], str]) -> None:
  """Raises `OverflowError` if `x`, a host numpy array or scalar of dtype int64 or uint64, holds a value
  that the 32-bit type JAX narrows it to without ``jax_enable_x64`` cannot hold.

  Cheap where nothing can go wrong: other dtypes, other types (jax arrays are already on the devices) and
  a JAX with ``jax_enable_x64`` return at once; a 64-bit integer array costs one min and one max.

  Args:
    x: the value as the user gave it.
    where: what it is, e.g. ``"strategy.run: the argument at args[1]['ids']"``, or a function returning that
      (called only to raise).

  Raises:
    OverflowError: naming `where`, the dtype, the offending value (and its index in an array), what it
      would become, and the fixes: enable ``jax_enable_x64``, or cast or hash the values into the 32-bit
      range before the data enters tpustrat.
  """
  if not isinstance(x, (np.ndarray, np.generic)):
    return
  target = _NARROWED.get(x.dtype)
  if target is None or x.size == 0 or x64_enabled():
    return
  info = np.iinfo(target)
  if x.min() >= info.min and x.max() <= info.max:
    return
  array = np.asarray(x)
  where = where() if callable(where) else where
  at = ""
  if array.ndim:  # the first value out of range, in the array's order
    out = (array > info.max) | (array < info.min)
    flat = int(np.argmax(out))
    bad = array.reshape(-1)[flat]
    at = f" at index {tuple(int(i) for i in np.unravel_index(flat, array.shape))}"
    count = int(np.count_nonzero(out))
    at += f" ({count} of its {array.size} values are out of range)" if count > 1 else ""
  else:
    bad = array[()]
  wrapped = np.asarray(bad).astype(target)
  raise OverflowError(
      f"{where} is {x.dtype.name} and holds {int(bad)}{at}, outside the {target.name} range "
      f"[{info.min}, {info.max}]. Without jax_enable_x64, JAX narrows {x.dtype.name} to {target.name} and the "
      f"value would arrive as {int(wrapped)}. Enable 64-bit values (jax.config.update('jax_enable_x64', True) "
      "before any JAX computation, or the environment variable JAX_ENABLE_X64=1), or cast or hash the values "
      f"into the {target.name} range before they reach tpustrat (e.g. ids % {info.max + 1} in the input "
      "pipeline).")


def tree_path(path: Any) -> str:
  """A pytree key path as text (`jax.tree_util.keystr`), without the flat-index keys of nodes registered
  without keys (`PerReplica`, `Mirrored`), so that it reads as the user's own indexing."""
  import jax  # pylint: disable=import-outside-toplevel
  keys = tuple(k for k in path if not isinstance(k, jax.tree_util.FlattenedIndexKey))
  return jax.tree_util.keystr(keys)


def check_tree_fits_32_bits(tree: Any, describe: Callable[[str], str]) -> None:
  """`check_fits_32_bits` for every leaf of a pytree; ``describe(path)`` says what the leaf is, given its
  path in `tree` (`tree_path`; ``""`` for a leaf that is the whole tree), and is called only to raise.

  Costs one pass over the leaves (a type and dtype test each) when no leaf is a 64-bit integer host array.
  """
  import jax  # pylint: disable=import-outside-toplevel
  leaves = jax.tree.leaves(tree)
  if not any(isinstance(x, (np.ndarray, np.generic)) and x.dtype in _NARROWED for x in leaves):
    return
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    def where(path: Any = path) -> str:
      return describe(tree_path(path))

    check_fits_32_bits(x, where)


# -- timeouts ----------------------------------------------------------------------------------------------


def _number_text(x: float) -> str:
  return str(int(x)) if float(x).is_integer() else repr(float(x))


def check_seconds(value: Any, what: str, *, minimum: float, maximum: float, integer: bool = False,
                  note: str = "") -> Any:
  """`value`, a timeout in seconds, checked against ``[minimum, maximum]``; an error naming it otherwise.

  For every timeout of the launcher (flags), of the ``TPUSTRAT_*`` variables and of the resolvers'
  arguments, so that a value JAX cannot take (its distributed runtime takes C int32 seconds) or one too
  small to mean anything fails at once, with the setting's name, rather than later inside JAX.

  Args:
    value: a number, or text as a flag or an environment variable gives it (``"30"``, ``"2.5"``).
    what: the setting as the user named it: ``"--heartbeat-timeout"``, ``"TPUSTRAT_STEP_TIMEOUT"``,
      ``"TPUClusterResolver: heartbeat_timeout"``.
    minimum, maximum: the accepted range, both included.
    integer: whether only whole seconds are accepted (JAX's timeouts); the result is then an int.
    note: said after the range in the error, e.g. why it is the range.

  Returns:
    The value as an int (with `integer`) or a float.

  Raises:
    TypeError: `value` is neither a number nor text (a bool is not a number here).
    ValueError: text that is not a number, a number that is not whole (with `integer`), NaN, or a value
      outside the range; the message names `what`, the value and the range.

  >>> check_seconds("30", "--heartbeat-timeout", minimum=1, maximum=2**31 - 1, integer=True)
  30
  >>> check_seconds(1e-300, "--step-timeout", minimum=1, maximum=2**31 - 1)
  Traceback (most recent call last):
  ...
  ValueError: --step-timeout must be a number of seconds in [1, 2147483647], got 1e-300.
  """
  kind = "a whole number" if integer else "a number"
  expected = f"{kind} of seconds in [{_number_text(minimum)}, {_number_text(maximum)}]"
  suffix = f" ({note})" if note else ""
  if isinstance(value, str):
    text = value.strip()
    try:
      number: Any = int(text) if integer else float(text)
    except ValueError:
      raise ValueError(f"{what} must be {expected}, got {value!r}{suffix}.") from None
    shown = repr(value)
  elif isinstance(value, numbers.Real) and not isinstance(value, bool):
    number, shown = value, repr(value)
    if integer and not (isinstance(value, numbers.Integral) or float(value).is_integer()):
      raise ValueError(f"{what} must be {expected}, got {shown}{suffix}.")
  else:
    raise TypeError(f"{what} must be {expected}, got {type(value).__name__} {value!r:.60}.")
  if not minimum <= number <= maximum:  # NaN fails too
    raise ValueError(f"{what} must be {expected}, got {shown}{suffix}.")
  return int(number) if integer else float(number)
