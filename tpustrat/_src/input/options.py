"""What a user configures about input: `InputOptions` (prefetching, buffer size, `drop_remainder`) and the
`InputContext` that `experimental_distribute_datasets_from_function` hands to ``dataset_fn``.

Both are plain values, checked when made; nothing here touches devices.

>>> InputOptions(drop_remainder=True).drop_remainder
True
>>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
>>> ctx.get_per_replica_batch_size(64)
8
"""

from __future__ import annotations

import dataclasses

from tpustrat._src.validation import check_int

__all__ = ["InputContext", "InputOptions"]


@dataclasses.dataclass(frozen=True)
class InputOptions:
  """Options for distributed datasets (TF's `tf.distribute.InputOptions`, plus `drop_remainder`).

  Attributes:
    experimental_fetch_to_device: if True (default), a background thread puts each batch on the devices
      ahead of use. If False, the iterator yields `PerReplica` values over host numpy arrays and
      `strategy.run` transfers them when it is called (in a multi-process job batches are always
      global device arrays).
    experimental_per_replica_buffer_size: how many batches are kept ready on the devices ahead of the
      one being used (each holds one component per replica). Default 1, as in TF. Must be >= 1.
    drop_remainder: if True, a batch with fewer rows than the largest batch read before it is dropped
      instead of padded (with `experimental_distribute_datasets_from_function`: a step in which a
      replica's batch is smaller than the largest per-replica batch so far, or some replica has none).
      For a dataset of equal batches this drops exactly the partial last batch, as TF's
      ``drop_remainder`` does; a first batch smaller than later ones is kept. Default False: every
      example is used.

  All three are checked when the options are made: the two flags must be bools (TypeError) and the
  buffer size an int (TypeError) >= 1 (ValueError).

  >>> InputOptions(experimental_per_replica_buffer_size=2).experimental_fetch_to_device
  True
  """

  experimental_fetch_to_device: bool = True
  experimental_per_replica_buffer_size: int = 1
  drop_remainder: bool = False

  def __post_init__(self) -> None:
    for name in ("experimental_fetch_to_device", "drop_remainder"):
      value = getattr(self, name)
      if not isinstance(value, bool):
        raise TypeError(f"InputOptions.{name} must be a bool, got {type(value).__name__} {value!r}.")
    check_int(self.experimental_per_replica_buffer_size, "InputOptions", "experimental_per_replica_buffer_size",
              minimum=1)


class InputContext:
  """What `experimental_distribute_datasets_from_function` tells `dataset_fn` (TF's `InputContext`).

  There is one input pipeline per process: ``num_input_pipelines`` is the number of processes and
  ``input_pipeline_id`` this process's index. Shard the data with them, and batch it with
  `get_per_replica_batch_size`.

  >>> ctx = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)
  >>> ctx.get_per_replica_batch_size(64)
  8
  >>> ctx.get_per_replica_batch_size(60)
  Traceback (most recent call last):
  ...
  ValueError: The `global_batch_size` 60 is not divisible by `num_replicas_in_sync` 8
  """

  __slots__ = ("_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync")

  def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
               num_replicas_in_sync: int = 1) -> None:
    if not 0 <= input_pipeline_id < num_input_pipelines:
      raise ValueError(
          f"input_pipeline_id ({input_pipeline_id}) must be in [0, num_input_pipelines = "
          f"{num_input_pipelines}).")
    self._num_input_pipelines = num_input_pipelines
    self._input_pipeline_id = input_pipeline_id
    self._num_replicas_in_sync = num_replicas_in_sync

  @property
  def num_input_pipelines(self) -> int:
    """The number of input pipelines (one per process)."""
    return self._num_input_pipelines

  @property
  def input_pipeline_id(self) -> int:
    """This pipeline's index in ``[0, num_input_pipelines)``."""
    return self._input_pipeline_id

  @property
  def num_replicas_in_sync(self) -> int:
    """The number of replicas in sync (all processes together)."""
    return self._num_replicas_in_sync

  def get_per_replica_batch_size(self, global_batch_size: int) -> int:
    """Returns ``global_batch_size // num_replicas_in_sync``.

    Raises:
      ValueError: if `global_batch_size` is not divisible by `num_replicas_in_sync`.
    """
    if global_batch_size % self._num_replicas_in_sync != 0:
      raise ValueError(
          f"The `global_batch_size` {global_batch_size!r} is not divisible by `num_replicas_in_sync` "
          f"{self._num_replicas_in_sync!r}")
    return global_batch_size // self._num_replicas_in_sync

  def __repr__(self) -> str:
    return (f"InputContext(num_input_pipelines={self._num_input_pipelines}, input_pipeline_id="
            f"{self._input_pipeline_id}, num_replicas_in_sync={self._num_replicas_in_sync})")
