"""Weak keys: the engine's caches are keyed by the user's step function without keeping it alive.

`weak_key(fn)` is a cache key equal for the same function (or the same bound method: ``obj.step`` is a
new object on every access, so a method's key is its object, held weakly, and its function: `_MethodKey`)
and never equal once the function is gone. `weak_callable(fn)` calls `fn` through a weak reference, so a
cached compiled program (which retraces `fn` only while the caller still holds it) does not hold `fn` or
its closure either.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["weak_callable", "weak_key"]


def weak_key(fn: Callable[..., Any]) -> Any:
  """A cache key for `fn` that does not keep it alive: equal for the same function (or the same bound
  method: ``obj.step`` is a new object on every access), never equal once it is gone. Callables that
  cannot be referenced weakly are their own key."""
  if type(fn) is types.MethodType:
    return _MethodKey(weakref.ref(fn.__self__), fn.__func__)
  try:
    return weakref.ref(fn)  # CPython hands out the same ref object while `fn` lives: cheap per step
  except TypeError:
    return fn


class _MethodKey:
  """A bound method's identity (its object, held weakly, and its function), as a cache key."""

  __slots__ = ("_obj", "_func", "_hash")

  def __init__(self, obj: weakref.ref, func: Callable[..., Any]) -> None:
    self._obj, self._func = obj, func
    self._hash = hash((id(obj), id(func)))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, _MethodKey) or self._func is not other._func:
      return False
    obj = self._obj()
    return obj is not None and obj is other._obj()


def weak_callable(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn`, called through a weak reference where it can be (a compiled program retraces `fn` only while
  the caller still holds it, so the cache may hold the program without holding `fn`)."""
  if type(fn) is types.MethodType:
    ref: Callable[[], Any] = weakref.WeakMethod(fn)
  else:
    try:
      ref = weakref.ref(fn)
    except TypeError:
      return fn

  def call(*args: Any, **kwargs: Any) -> Any:
    target = ref()
    if target is None:
      raise RuntimeError("strategy.run: the step function of this cached program no longer exists.")
    return target(*args, **kwargs)

  return call
