"""The strategy side of cross-device ops: `CrossDeviceExtendedMixin` gives a `StrategyExtended` TF's
`reduce_to`, `batch_reduce_to` and `broadcast_to`, and routes `ReplicaContext.all_reduce` inside
`strategy.run` through the configured `CrossDeviceOps`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpustrat._src import gradient_semantics
from tpustrat._src.cross_device.ops import CrossDeviceOps, check_cross_replica, default_cross_device_ops
from tpustrat._src.cross_device.options import CommunicationOptions, check_options
from tpustrat._src.reduce_op import ReduceOp
from tpustrat._src.values import Mirrored, is_distributed

__all__ = ["CrossDeviceExtendedMixin"]


class CrossDeviceExtendedMixin:
  """`reduce_to`, `batch_reduce_to` and `broadcast_to` of TF's `StrategyExtended`, through `CrossDeviceOps`.

  Mixed into a `StrategyExtended` (which provides ``self._strategy``); uses ``self._cross_device_ops`` when
  set, else `default_cross_device_ops()`.
  """

  _cross_device_ops: CrossDeviceOps | None = None
  _strategy: Any  # the `Strategy` that owns the extended object (set by `StrategyExtended`)

  def _get_cross_device_ops(self) -> CrossDeviceOps:
    ops = self._cross_device_ops
    if ops is None:
      ops = self._cross_device_ops_default = getattr(self, "_cross_device_ops_default", None) or default_cross_device_ops()
    return ops

  def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                options: CommunicationOptions | None = None) -> Any:
    """Combines `value` across replicas and puts the result on `destinations` (cross-replica context).

    `value` may be a `DistributedValues`, a pytree of them (reduced together, as one batch), or a
    non-distributed value, for which TF's rules hold: ``0`` stays ``0``, `MEAN` gives the value on
    `destinations`, and `SUM` over several replicas is an error. A `Mirrored` value (alone or in a
    pytree) with `MEAN` is returned unchanged. Every non-distributed leaf is checked before anything
    is reduced.

    Args:
      reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN` (or "sum", "mean").
      value: what to reduce.
      destinations: see `CrossDeviceOps`; pass `value` itself for an all-reduce.
      options: a `CommunicationOptions`.
    """
    check_cross_replica("StrategyExtended.reduce_to")
    op = ReduceOp.from_value(reduce_op)
    options = check_options(options)
    if isinstance(value, Mirrored) and op is ReduceOp.MEAN:
      return value
    nodes, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
    if not any(is_distributed(v) for v in nodes):
      return self._reduce_non_distributed(op, value, destinations)
    ops = self._get_cross_device_ops()
    if is_distributed(value):
      return ops.reduce(op, value, destinations, options)
    out = [v if is_distributed(v) else self._reduce_non_distributed(op, v, destinations) for v in nodes]
    todo = [i for i, v in enumerate(nodes)
            if is_distributed(v) and not (isinstance(v, Mirrored) and op is ReduceOp.MEAN)]
    if todo:
      for i, r in zip(todo, ops.batch_reduce(op, [(nodes[i], destinations) for i in todo], options)):
        out[i] = r
    return jax.tree.unflatten(treedef, out)

  def _reduce_non_distributed(self, op: ReduceOp, value: Any, destinations: Any) -> Any:
    """TF's `reduce_non_distributed_value`."""
    if not isinstance(value, (jax.Array, np.ndarray)) and not jax.tree.leaves(value):
      return value
    if isinstance(value, (int, float)) and value == 0:
      return 0
    n = self._strategy.num_replicas_in_sync
    if op is ReduceOp.SUM and n != 1:
      raise ValueError(
          f"A non-DistributedValues value {value!r:.100} cannot be reduced with the given reduce op {op} "
          f"across {n} replicas: it is not known how many replicas hold it. Pass a PerReplica or Mirrored "
          "value, or use MEAN.")
    return self._get_cross_device_ops().broadcast(value, destinations)

  def batch_reduce_to(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]],
                      options: CommunicationOptions | None = None) -> list[Any]:
    """Reduces several (value, destinations) pairs as one batch (one program, shared packs).

    Raises:
      ValueError: if `value_destination_pairs` is not a list or tuple of (value, destinations) pairs.
    """
    check_cross_replica("StrategyExtended.batch_reduce_to")
    return self._get_cross_device_ops().batch_reduce(reduce_op, value_destination_pairs, options)

  def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
    """Copies `tensor` to `destinations`; Python numbers are returned as they are (as in TF)."""
    check_cross_replica("StrategyExtended.broadcast_to")
    if isinstance(tensor, (int, float)) and not isinstance(tensor, bool):
      return tensor
    return self._get_cross_device_ops().broadcast(tensor, destinations)

  def _replica_all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any, axis_name: str) -> Any:
    """`ReplicaContext.all_reduce` inside `run`: through the configured cross-device ops.

    With none configured and no options, a plain `lax.psum` / `lax.pmean` per leaf. Either way a SUM of
    traced leaves that are already the same on every replica warns (`AlreadyReplicatedWarning`).
    """
    op = ReduceOp.from_value(reduce_op)
    if self._cross_device_ops is None and options is None:
      gradient_semantics.warn_if_already_replicated("ReplicaContext.all_reduce", jax.tree.leaves(value), axis_name,
                                             lax.axis_size(axis_name), "num_replicas_in_sync", op.name)
      reducer = lax.psum if op is ReduceOp.SUM else lax.pmean
      return jax.tree.map(lambda x: reducer(jnp.asarray(x), axis_name), value)
    return self._get_cross_device_ops().all_reduce_in_replica_context(op, value, options, axis_name=axis_name)
