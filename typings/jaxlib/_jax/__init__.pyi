# Type stubs for jaxlib's compiled `_jax` module, for mypy only (`mypy_path = typings` in mypy.ini).
#
# jaxlib 0.10 ships no stubs for this extension, so mypy cannot resolve the types JAX re-exports from it
# (`jax.tree_util.PyTreeDef`, `jax.Device`): it reports every comparison of two treedefs and every method of
# one as an error. These stubs declare the two classes tpustrat uses (the members it reads, anything else
# Any) and leave the rest of the module Any.
from typing import Any

from . import pytree as pytree

class Device:
  id: int
  process_index: int
  platform: str
  device_kind: str
  def __getattr__(self, name: str) -> Any: ...

def __getattr__(name: str) -> Any: ...
