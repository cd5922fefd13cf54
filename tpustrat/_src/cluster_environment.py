"""Where a job's description comes from: ``host:port`` addresses, the ``TPUSTRAT_*`` environment
variables, and a Cloud TPU slice found by JAX's cluster detection.

The resolvers (`tpustrat._src.cluster_resolver`, `tpustrat._src.tpu_cluster_resolver`, and the Slurm and
``TF_CONFIG`` ones) check what they are given here, so that an address, a count or a device list is
refused in one style wherever it came from: the resolver (`where`), the argument or variable, what was
given and what was expected. Nothing here starts JAX's backends.

>>> is_address("10.0.0.1:8476"), check_device_ids((0, 1), "TPUClusterResolver")
(True, [0, 1])
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from tpustrat._src import validation

__all__ = [
    "check_address",
    "check_device_ids",
    "detect_cluster",
    "env_device_ids",
    "env_int",
    "is_address",
    "is_loopback",
]


def is_loopback(host: str) -> bool:
  """Whether `host` (bracketed or not, for IPv6) is a loopback address: ``localhost``, ``::1``, ``127.*``."""
  host = host.strip("[]")
  return host == "localhost" or host == "::1" or host.startswith("127.")


def check_address(value: Any, what: str, where: str) -> str:
  """`value` if it is a ``host:port`` string (`is_address`), else a `ValueError` naming `where` and `what`."""
  if not is_address(value):
    raise ValueError(f"{where}: {what} must be a 'host:port' string, got {value!r}.")
  return value


def is_address(value: Any) -> bool:
  """Whether `value` is a ``host:port`` string: a non-empty host without white space or control characters
  (an IPv6 host in brackets, ``[::1]:80``), and a port of ASCII digits in [0, 65535].

  >>> is_address("10.0.0.1:8476"), is_address("[::1]:80"), is_address("h 1:1"), is_address("h:port")
  (True, True, False, False)
  """
  if not isinstance(value, str):
    return False
  host, sep, port = value.rpartition(":")
  if not (sep and port.isascii() and port.isdigit() and int(port) <= 65535):
    return False
  if host.startswith("[") or host.endswith("]"):  # an IPv6 address: [::1]
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else ""
  return bool(host) and host.isprintable() and not any(ch.isspace() or ch in "[]" for ch in host)


def check_device_ids(value: Any, where: str) -> list[int]:
  """`local_device_ids` as a list: one id (an int) or a sequence of ids, each an int >= 0."""
  if validation.is_int(value):
    return [validation.check_int(value, where, "local_device_ids", minimum=0)]
  if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
    raise ValueError(
        f"{where}: local_device_ids must be an int or a sequence of ints >= 0, got {value!r}.")
  return [validation.check_int(v, where, f"local_device_ids[{i}]", minimum=0) for i, v in enumerate(value)]


def env_int(name: str, minimum: int, where: str) -> int | None:
  """The int >= `minimum` in environment variable `name`, None when it is unset or blank."""
  text = os.environ.get(name, "").strip()
  if not text:
    return None
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value < minimum:
    raise ValueError(f"{where}: environment variable {name}={text!r} must be an int >= {minimum}.")
  return value


def env_device_ids(name: str, where: str) -> list[int] | None:
  """The comma-separated device ids in environment variable `name` (``"0,1"``), None when it is unset."""
  text = os.environ.get(name, "").strip()
  if not text:
    return None
  try:
    return [int(t) for t in text.split(",")]
  except ValueError:
    raise ValueError(
        f"{where}: environment variable {name}={text!r} must be a comma-separated list of "
        "device ids, e.g. '0,1,2,3'.") from None


def detect_cluster() -> tuple[str | None, int, int] | None:
  """(coordinator, process count, process id) of a Cloud TPU slice (GCE or GKE), from JAX's detection.

  Only TPU environments are detected: a Slurm or MPI allocation says how many tasks *may* run, not that
  this program was started once per task, so GPU clusters are described explicitly (arguments or
  environment variables). JAX keeps the detectors private (`jax._src.clusters`); if they move, detection
  is skipped and the job is one process unless told otherwise.
  """
  try:
    from jax._src import clusters  # pylint: disable=import-outside-toplevel
    envs = [env for env in clusters.ClusterEnv._cluster_types  # pylint: disable=protected-access
            if "tpu" in env.__name__.lower() and not env.opt_in_only_method and env.is_env_present()]
    if not envs:
      return None
    env = envs[0]
    count, index = int(env.get_process_count()), int(env.get_process_id())
    coordinator = env.get_coordinator_address(timeout_secs=None, override_coordinator_port=None) if count > 1 else None
    return coordinator, count, index
  except Exception:  # noqa: BLE001  # a detector that fails means: no cluster we can use
    return None
