"""`TPUStrategy`: synchronous training on TPU cores, GPUs or CPU devices (TF's
`tf.distribute.experimental.TPUStrategy`, `tpu_strategy.py`).

It connects to the cluster, lists the devices (or takes a `DeviceAssignment`), and adds to `Strategy` the
model parallelism inside a replica: the logical-device annotations `experimental_split_to_logical_devices`,
`experimental_replicate_to_logical_devices` and `experimental_assign_to_logical_device`
(`tpustrat._src.logical`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from tpustrat._src import logical as logical_lib
from tpustrat._src.cluster_resolver import ClusterResolver
from tpustrat._src.connect_to_cluster import connect_from_environment, experimental_connect_to_cluster
from tpustrat._src.strategy import Strategy
from tpustrat._src.topology import DeviceAssignment, device_grid

__all__ = ["TPUStrategy"]


class TPUStrategy(Strategy):
  """Synchronous training on TPU cores, GPUs or CPU devices (TF's `tf.distribute.experimental.TPUStrategy`).

  With no arguments it uses every device of JAX's default backend: the TPU cores of a TPU VM, else the
  GPUs, else the CPU devices (emulate several with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8``). There is one replica per device.

  With a `tpustrat.DeviceAssignment` each replica runs on ``num_cores_per_replica`` logical devices:
  the mesh is replicas x logical cores (`strategy.extended.logical_core_axes`), `run` is manual over
  the replicas only, and inside it `experimental_split_to_logical_devices`,
  `experimental_replicate_to_logical_devices` and `experimental_assign_to_logical_device` tell XLA how
  to lay tensors out on a replica's cores (`tpustrat._src.logical`).

  Args:
    tpu_cluster_resolver: optional `tpustrat.cluster_resolver.TPUClusterResolver` (or another
      `tpustrat.cluster_resolver.ClusterResolver`: `SlurmClusterResolver`, `TFConfigClusterResolver`); kept
      as `cluster_resolver`. It is connected (`tpustrat.experimental_connect_to_cluster`, a no-op for one
      process) before the devices are listed. Without one, the strategy joins the multi-process job
      that the ``TPUSTRAT_*`` environment variables describe (as `python -m tpustrat.launch` sets
      them), if any.
    device_assignment: optional placement of replicas on devices: a `tpustrat.DeviceAssignment`, or a
      sequence of `jax.Device` objects, one per replica, in replica order.

  >>> strategy = tpustrat.TPUStrategy()
  >>> strategy.num_replicas_in_sync
  8

  TF's model-parallel set-up, 4 replicas of 2 logical devices on 8 devices:

  >>> resolver = tpustrat.cluster_resolver.TPUClusterResolver(tpu="")
  >>> tpustrat.experimental_connect_to_cluster(resolver)
  >>> topology = tpustrat.initialize_tpu_system(resolver)
  >>> device_assignment = tpustrat.DeviceAssignment.build(topology, computation_shape=[1, 1, 2], num_replicas=4)
  >>> strategy = tpustrat.TPUStrategy(resolver, device_assignment=device_assignment)
  >>> strategy.num_replicas_in_sync, strategy.extended.num_logical_cores_per_replica
  (4, 2)
  >>> dict(strategy.mesh.shape)
  {'replica': 4, 'core_0': 2}
  """

  def __init__(self, tpu_cluster_resolver: Any = None, device_assignment: Any = None) -> None:
    if tpu_cluster_resolver is not None:
      if not isinstance(tpu_cluster_resolver, ClusterResolver):
        raise TypeError(
            "tpu_cluster_resolver must be None or a tpustrat.cluster_resolver resolver (TPUClusterResolver, "
            f"SlurmClusterResolver, TFConfigClusterResolver), got {type(tpu_cluster_resolver).__name__}: "
            f"{tpu_cluster_resolver!r:.100}.")
      experimental_connect_to_cluster(tpu_cluster_resolver)
    else:
      connect_from_environment()  # the launcher's job
    devices: Sequence[Any] | np.ndarray  # one device per replica, or the [replica, logical core] grid
    if device_assignment is None:
      devices = jax.devices()
    elif isinstance(device_assignment, DeviceAssignment):
      devices = device_grid(device_assignment)
    elif isinstance(device_assignment, Sequence) and all(isinstance(d, jax.Device) for d in device_assignment):
      devices = list(device_assignment)
      if len(set(devices)) != len(devices):
        raise ValueError(f"device_assignment names a device twice: {devices}.")
    else:
      raise TypeError(
          "device_assignment must be None, a tpustrat.DeviceAssignment or a sequence of jax.Device objects "
          f"(one per replica), got {device_assignment!r:.200}.")
    super().__init__(devices)
    self._cluster_resolver = tpu_cluster_resolver  # None: the job's (`Strategy.cluster_resolver`)
    self._device_assignment = device_assignment if isinstance(device_assignment, DeviceAssignment) else None

  @property
  def mesh(self) -> Mesh:
    """The `jax.sharding.Mesh` the strategy runs on: axis ``'replica'``, then the logical-core axes."""
    return self._mesh

  # -- logical devices (model parallelism inside a replica) -----------------------------------------

  def experimental_split_to_logical_devices(self, tensor: Any, partition_dimensions: Sequence[int]) -> Any:
    """Annotates `tensor` to be split across the replica's logical devices (inside `run`).

    Dimension ``d`` of `tensor` is cut into ``partition_dimensions[d]`` equal pieces; the tiles go to
    the logical devices as TF's tile assignment ``arange(C).reshape(partition_dimensions)``. XLA then
    computes the operations on `tensor` (and, by propagation, around it) split the same way. With 8
    logical devices and images ``[batch, height, width, channels]``, ``[1, 2, 4, 1]`` splits the
    height 2 ways and the width 4 ways:

    >>> topology = tpustrat.initialize_tpu_system()
    >>> da = tpustrat.DeviceAssignment.build(topology, computation_shape=[2, 2, 2], num_replicas=1)
    >>> strategy = tpustrat.TPUStrategy(device_assignment=da)
    >>> def step(images):
    ...   return strategy.experimental_split_to_logical_devices(images * 2.0, [1, 2, 4, 1])
    >>> out = strategy.run(step, args=(np.ones([2, 8, 8, 3], np.float32),))
    >>> array = jax.tree.leaves(out)[0]                   # the result, [2, 8, 8, 3]
    >>> {s.data.shape for s in array.addressable_shards}  # each logical device holds 1/8 of it
    {(2, 4, 2, 3)}

    Args:
      tensor: an array inside the function given to `run`.
      partition_dimensions: one positive int per dimension of `tensor`, multiplying to the number of
        logical devices per replica; each divides its dimension.

    Returns:
      `tensor`, annotated (same value).

    Raises:
      ValueError: the length of `partition_dimensions` is not the rank of `tensor`, a dimension is not
        divisible by its entry, or the entries do not multiply to the logical devices per replica.
      RuntimeError: called outside `run` of this strategy.
    """
    return logical_lib.split_to_logical_devices(self, tensor, partition_dimensions)

  def experimental_replicate_to_logical_devices(self, tensor: Any) -> Any:
    """Annotates `tensor` (or a pytree) to be replicated on every logical device of the replica (inside `run`).

    Typically for values that every logical device needs whole: labels, and logits before the loss.

    Returns:
      `tensor`, annotated (same value).
    """
    return logical_lib.replicate_to_logical_devices(self, tensor)

  def experimental_assign_to_logical_device(self, tensor: Any, logical_device_id: int) -> Any:
    """Places the computation of `tensor` (or of each leaf of a pytree) on one logical device (inside `run`).

    The operation that produced `tensor`, and the operations before it whose results serve only to
    compute it, run on logical device `logical_device_id` of each replica only (under a conditional on
    the core index, as XLA runs an operation with a maximal sharding); the result is then broadcast to
    the replica's other logical devices. Operations that use the result afterwards are not moved, and a
    tensor the step did not compute (an argument) is returned unchanged. See `tpustrat._src.logical`
    for exactly what is placed.

    Args:
      tensor: an array (or pytree) computed inside the function given to `run`: at its top level, or
        inside a nested `jax.jit` or `jax.checkpoint` (evaluated inline) or a `lax.scan` body (placed in
        every iteration); not inside `lax.cond` or `lax.while_loop` (a compile-time error).
      logical_device_id: which logical device, ``0 <= id < num_cores_per_replica``.

    Returns:
      `tensor`, with the same value.

    Raises:
      ValueError: `logical_device_id` out of range.
      RuntimeError: called outside `run` of this strategy.
    """
    return logical_lib.assign_to_logical_device(self, tensor, logical_device_id)
