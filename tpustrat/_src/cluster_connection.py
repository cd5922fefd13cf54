"""This process's connection to its job: JAX's distributed runtime, started once, and what it was started with.

`connect` is the work of `experimental_connect_to_cluster` (`tpustrat._src.connect_to_cluster`) once it
holds a resolver: with more than one process it starts `jax.distributed.initialize`
(`tpustrat._src.distributed`, with its start-up checks) from the resolver's values; with one it starts
nothing, but restricts JAX's GPUs to the resolver's `local_device_ids` if it names some. Either way it
starts the step watchdog when the resolver has a step timeout, and remembers the resolver
(`connected_resolver`, which `Strategy.cluster_resolver` reports). Connecting again to the same cluster is
a no-op; to another, a `ValueError`: JAX's distributed runtime is started once per process.

>>> connect(tpustrat.cluster_resolver.TPUClusterResolver())  # one process: nothing to start
"""

from __future__ import annotations

from typing import Any

import jax

from tpustrat._src import distributed as distributed_lib
from tpustrat._src import watchdog
from tpustrat._src.cluster_resolver import ClusterResolver, runtime_options

__all__ = ["connect", "connected_resolver", "is_connected"]


_CONNECTED: list[tuple[str | None, int, int, Any]] = []  # what experimental_connect_to_cluster started
_RESOLVER: list[ClusterResolver] = []  # the resolver this process connected with (the newest, for one process)
_CONNECTED_ONE: list[list[int]] = []  # the local devices a one-process job was restricted to, if any


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # pragma: no cover - private API moved
    return False


def _restrict_local_devices(local: list[int]) -> None:
  """A one-process job's `local_device_ids`: what `jax.distributed.initialize` does with them for several
  (JAX's ``jax_cuda_visible_devices`` / ``jax_rocm_visible_devices``; no effect on CPU and TPU)."""
  if _backends_initialized():
    raise RuntimeError(
        f"experimental_connect_to_cluster: the resolver gives this process the devices {local} "
        "(local_device_ids), which must be chosen before JAX initialises its backends, but they are "
        "already initialised (something called jax.devices() or ran a computation). Connect first, at the "
        "top of the program.")
  visible = ",".join(str(i) for i in local)
  jax.config.update("jax_cuda_visible_devices", visible)
  jax.config.update("jax_rocm_visible_devices", visible)


def connect(resolver: ClusterResolver) -> None:
  """Connects this process to the job `resolver` describes (see `experimental_connect_to_cluster`)."""
  coordinator, count, index, local = (resolver.coordinator_address, resolver.num_processes, resolver.process_id,
                                      resolver.local_device_ids)
  step_timeout = resolver.step_timeout
  if count == 1:
    if local is not None and _CONNECTED_ONE != [local]:
      _restrict_local_devices(local)
      _CONNECTED_ONE[:] = [local]
    if step_timeout is not None:
      watchdog.start(step_timeout, process_index=0, process_count=1)
    if not _CONNECTED:
      _RESOLVER[:] = [resolver]
    return
  assert coordinator is not None  # a resolver gives every multi-process job a coordinator
  wanted = (coordinator, count, index, None if local is None else tuple(local))
  if _CONNECTED:
    if _CONNECTED[0] != wanted:
      raise ValueError(
          f"experimental_connect_to_cluster: already connected to coordinator {_CONNECTED[0][0]!r} as "
          f"process {_CONNECTED[0][2]} of {_CONNECTED[0][1]}; cannot connect again as process {index} of "
          f"{count} at {coordinator!r}. JAX's distributed runtime is started once per process.")
    return
  if jax.distributed.is_initialized():  # started by the user's own jax.distributed.initialize
    if (jax.process_count(), jax.process_index()) != (count, index):
      raise ValueError(
          f"experimental_connect_to_cluster: JAX's distributed runtime is already running as process "
          f"{jax.process_index()} of {jax.process_count()}, but the resolver describes process {index} "
          f"of {count}.")
    _CONNECTED.append(wanted)
    _RESOLVER[:] = [resolver]
    if step_timeout is not None:
      watchdog.start(step_timeout, process_index=index, process_count=count)
    return
  if _backends_initialized():
    raise RuntimeError(
        f"experimental_connect_to_cluster: {count} processes need JAX's distributed runtime, which must "
        "start before JAX initialises its backends, but they are already initialised (something called "
        "jax.devices() or ran a computation). Connect first, at the top of the program.")
  distributed_lib.initialize(coordinator, count, index, local, **runtime_options(resolver))
  _CONNECTED.append(wanted)
  _RESOLVER[:] = [resolver]
  if step_timeout is not None:
    watchdog.start(step_timeout, process_index=index, process_count=count)


def is_connected() -> bool:
  """Whether `connect` started (or adopted) JAX's distributed runtime in this process."""
  return bool(_CONNECTED)


def connected_resolver() -> ClusterResolver | None:
  """The resolver this process connected with (the newest, for one process), None before any `connect`."""
  return _RESOLVER[0] if _RESOLVER else None
