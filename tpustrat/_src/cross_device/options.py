"""The options of one cross-device call: `CommunicationOptions` (packing, timeout, which all-reduce)
and `CommunicationImplementation`, TF's `tf.distribute.experimental` classes of those names.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from tpustrat._src.validation import is_int

__all__ = ["CommunicationImplementation", "CommunicationOptions", "check_options"]


class CommunicationImplementation(enum.Enum):
  """Which all-reduce a `CommunicationOptions` asks for (TF's `tf.distribute.experimental.CommunicationImplementation`).

  * `AUTO`: the algorithm of the cross-device ops in use.
  * `NCCL`: one XLA all-reduce (`lax.psum`) per pack, whatever the cross-device ops' algorithm.
  * `RING`: an explicit ring of collective-permutes per pack (reduce-scatter then all-gather).

  `ReductionToOneDevice` is not an all-reduce and ignores this setting.

  >>> CommunicationImplementation("ring")
  <CommunicationImplementation.RING: 'RING'>
  """

  AUTO = "AUTO"
  RING = "RING"
  NCCL = "NCCL"

  @classmethod
  def _missing_(cls, value: object) -> CommunicationImplementation | None:
    if isinstance(value, str) and value.upper() in cls.__members__:
      return cls[value.upper()]
    return None


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
  """Options for cross-device communication (TF's `tf.distribute.experimental.CommunicationOptions`).

  Args:
    bytes_per_pack: if > 0, a batch of tensors is split, in order, into packs of at least this many bytes
      (the last one may be smaller), each reduced by one collective; tensors of different dtypes never
      share a pack. 0 leaves packing to the cross-device ops (`num_packs`, small-tensor aggregation).
    timeout_seconds: accepted for TF compatibility. XLA collectives have no per-operation timeout
      (XLA:CPU aborts a rendezvous that waits for more than 40 s on its own); must be None or > 0.
    implementation: a `CommunicationImplementation` (or its name): which all-reduce to use.

  >>> CommunicationOptions(bytes_per_pack=4 << 20, implementation="nccl").implementation
  <CommunicationImplementation.NCCL: 'NCCL'>
  """

  bytes_per_pack: int = 0
  timeout_seconds: float | None = None
  implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO

  def __post_init__(self) -> None:
    b = self.bytes_per_pack
    if not is_int(b) or b < 0:  # a ValueError whatever is wrong with it
      raise ValueError(f"CommunicationOptions: `bytes_per_pack` must be an int >= 0, got {type(b).__name__} {b!r:.60}.")
    t = self.timeout_seconds
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
      raise ValueError(f"timeout_seconds must be None or a positive number, got {t!r}.")
    try:
      impl = CommunicationImplementation(self.implementation)
    except ValueError:
      raise ValueError(
          f"implementation must be a tpustrat.CommunicationImplementation (AUTO, RING or NCCL) or its "
          f"name, got {self.implementation!r}.") from None
    object.__setattr__(self, "bytes_per_pack", int(b))
    object.__setattr__(self, "implementation", impl)

  def merge(self, options: CommunicationOptions | None) -> CommunicationOptions:
    """Returns these options updated with the non-default fields of `options` (as TF's `merge`)."""
    options = check_options(options)
    default = CommunicationOptions()
    changes = {f.name: getattr(options, f.name) for f in dataclasses.fields(self)
               if getattr(options, f.name) != getattr(default, f.name)}
    return dataclasses.replace(self, **changes)


def check_options(options: Any) -> CommunicationOptions:
  if options is None:
    return CommunicationOptions()
  if not isinstance(options, CommunicationOptions):
    raise TypeError(f"`options` must be a tpustrat.CommunicationOptions or None, got {options!r:.200}.")
  return options
