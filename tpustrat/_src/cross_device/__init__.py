"""Cross-device reductions: TF's `CrossDeviceOps` family as XLA collectives in one compiled program.

Modules, lowest first:

* `devices`: TF device strings ("/job:worker/task:0/device:GPU:1") to `jax.Device` objects.
* `layout`: a distributed value as global arrays on a mesh, and where a result goes (`destinations`).
* `options`: `CommunicationOptions` and `CommunicationImplementation`.
* `ops`: `CrossDeviceOps` and its implementations (`ReductionToOneDevice`, `AllReduceCrossDeviceOps`,
  `NcclAllReduce`, `HierarchicalCopyAllReduce`), and `default_cross_device_ops`.
* `extended`: `CrossDeviceExtendedMixin`, the `reduce_to`/`batch_reduce_to`/`broadcast_to` of a strategy.
"""

from tpustrat._src.cross_device.devices import device_from_string
from tpustrat._src.cross_device.extended import CrossDeviceExtendedMixin
from tpustrat._src.cross_device.ops import (
    AllReduceCrossDeviceOps,
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    default_cross_device_ops,
)
from tpustrat._src.cross_device.options import CommunicationImplementation, CommunicationOptions

__all__ = [
    "AllReduceCrossDeviceOps",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceExtendedMixin",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "default_cross_device_ops",
    "device_from_string",
]
