"""Devices named the way TF names them: device strings ("/job:worker/task:0/device:GPU:1", "/cpu:0",
"CPU:3") parsed to `jax.Device` objects, and the one-axis mesh over a tuple of devices.

>>> device_from_string("/device:CPU:2") == jax.devices()[2]
True
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from tpustrat._src.names import REPLICA_AXIS

__all__ = ["device_from_string", "mesh_for"]


@functools.lru_cache(maxsize=64)
def mesh_for(devices: tuple[Any, ...]) -> Mesh:
  """A mesh of `devices`, in order, along the replica axis."""
  return Mesh(np.asarray(devices, dtype=object), (REPLICA_AXIS,))


def device_from_string(spec: str, what: str = "destinations") -> Any:
  """The `jax.Device` a TF device string names: "/job:x/replica:0/task:0/device:GPU:1", "/cpu:0", "CPU:3".

  `what` names the argument in error messages.
  """
  task: int | None = None
  kind: str | None = None
  index = 0  # set with `kind`
  for part in filter(None, spec.strip().split("/")):
    key, _, rest = part.partition(":")
    key = key.lower()
    if key in ("job", "replica") and rest:
      continue
    if key == "task" and rest.isdigit():
      task = int(rest)
      continue
    if key == "device":
      key, _, rest = rest.partition(":")
      key = key.lower()
    if key in ("cpu", "gpu", "tpu") and rest.isdigit() and kind is None:
      kind, index = key, int(rest)
      continue
    kind = None
    break
  if kind is None:
    raise ValueError(
        f"{what}: cannot parse the device string {spec!r}; expected a TF device name such as "
        "'/device:GPU:0', '/cpu:0' or '/job:worker/task:0/device:CPU:1'.")
  try:
    devices = jax.devices(kind)
  except RuntimeError:
    devices = []
  task = jax.process_index() if task is None else task
  local = sorted((d for d in devices if d.process_index == task), key=lambda d: d.id)
  if index >= len(local):
    raise ValueError(
        f"{what}: the device string {spec!r} names {kind.upper()}:{index} of process {task}, "
        f"which has {len(local)} {kind.upper()} device(s).")
  return local[index]
