"""Bytes as JSON-safe text, for iterator states: grain's DataLoader iterators give their state as bytes,
while `DistributedIterator.get_state` and `tpustrat.checkpoint` store JSON.

>>> text_to_bytes(bytes_to_text(b"\\x00\\xff"))
b'\\x00\\xff'
"""

from __future__ import annotations

import base64

__all__ = ["bytes_to_text", "text_to_bytes"]


def bytes_to_text(data: bytes) -> str:
  """Bytes (a grain DataLoader iterator's state) as JSON-safe text: standard base64, ASCII."""
  return base64.b64encode(data).decode("ascii")


def text_to_bytes(text: str) -> bytes:
  """The inverse of `bytes_to_text`."""
  return base64.b64decode(text)
