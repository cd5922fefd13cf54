"""What a user configures about input: `InputOptions` (prefetching, buffer size, `drop_remainder`) and the
`InputContext` that `experimental_distribute_datasets_from_function` hands to ``dataset_fn``.

Both are plain values, checked when made; nothing here touches devices. `buffer_size(options, platform)`
says how many batches an iterator reads ahead on a platform (the default depends on it).

>>> InputOptions(drop_remainder=True).drop_remainder
True
>>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
>>> ctx.get_per_replica_batch_size(64)
8
"""

from __future__ import annotations

import dataclasses

from tpustrat._src.validation import check_int

__all__ = ["DEFAULT_BUFFER_SIZE", "PADDINGS", "InputContext", "InputOptions", "buffer_size"]

# Batches read ahead by default, per platform (`InputOptions.experimental_per_replica_buffer_size=None`).
# XLA:CPU: none. Its host-to-device "transfer" is a memory copy on the same cores as the steps' compute,
# so a thread cannot overlap it with anything; the thread only adds a hand-over per batch and competes
# for those cores (benchmarks/bench_input.py --depths 1 2 4 on 2 cores, three runs: 0.78-0.86, 0.77-0.82
# and 0.74-0.78 of the loop on batches already on the devices, against 0.82-0.85 without a thread). GPU
# and TPU: one, as in TF: the copy runs on the device's DMA engines while the previous step computes.
DEFAULT_BUFFER_SIZE = {"cpu": 0}
_ACCELERATOR_BUFFER_SIZE = 1
PADDINGS = ("first_row", "zeros")  # `InputOptions.experimental_padding`


@dataclasses.dataclass(frozen=True)
class InputOptions:
  """Options for distributed datasets (TF's `tf.distribute.InputOptions`, plus `drop_remainder`).

  Attributes:
    experimental_fetch_to_device: if True (default), the iterator puts each batch on the devices (ahead of
      use, in a background thread, when the buffer size is >= 1). If False, it yields `PerReplica` values
      over host numpy arrays and `strategy.run` transfers them when it is called (in a multi-process
      job batches are always global device arrays).
    experimental_per_replica_buffer_size: the prefetch depth: how many batches a background thread keeps
      ready on the devices ahead of the one being used (each holds one component per replica), so that
      the next batches' host-to-device transfers are in flight while the current step runs. At most that
      many batches beyond the one handed out are read, placed or being placed (the thread takes a free
      place before it reads): device memory for ``depth`` more batches. 0: no thread, each batch is read
      and put on the devices when it is asked for. None (default): per platform, 1 on GPU and TPU (as in
      TF: the transfer overlaps the previous steps) and 0 on XLA:CPU (there the transfer is a memory copy
      on the cores that compute the steps, so a thread cannot hide it and only costs: see
      `DEFAULT_BUFFER_SIZE`). An int >= 0 or None. Raise it on an accelerator when the input is bursty
      (a source that is sometimes slower than a step); a transfer longer than a step is not hidden by
      any depth (`InputBoundWarning`: send a smaller dtype, or do the work on the devices).
    drop_remainder: if True, a batch with fewer rows than the largest batch read before it in the same
      pass (epoch) is dropped instead of padded. For a dataset of equal batches this drops exactly the
      partial last batch, as TF's ``drop_remainder`` does; a first batch smaller than later ones is
      kept, in every epoch; a restored iterator keeps its pass's reference. With
      `experimental_distribute_datasets_from_function` the rule is TF's per pipeline: each replica's
      batch is compared with the batches of its own pipeline only (as ``batch(n,
      drop_remainder=True)`` inside each pipeline would); when some replica's batch is smaller than its
      pipeline's earlier ones, or its pipeline has ended, that step is dropped and the pass ends (TF's
      iterator stops there). Pipelines that batch different numbers of rows (7 replicas of 2 rows and
      one of 1, from the first step on) lose nothing: the step is padded to the largest. Default False:
      every example is used.
    experimental_padding: what the padding rows of a partial batch hold (every step sees them; the
      library's `valid_mask`, `compute_average_loss`, `per_example` reductions and Keras's `fit` weigh them
      0). ``"first_row"`` (default): copies of a real row (the global batch's first row; with
      `experimental_distribute_datasets_from_function`, each replica's own first row, else the first row
      of another local replica), so that a step that is finite on real rows is finite on padding too: a
      per-example loss that would be NaN on an all-zero row (row-normalised features, a fully masked
      sequence averaged) cannot make NaN gradients through a zero weight. ``"zeros"``: zero rows, for
      steps that read the dataset's own mask or weight column (``jnp.where(batch["mask"], loss, 0)``)
      and rely on it being 0 on padding. TF hands each replica only its real rows, so TF code never
      needs either: `PaddingReadWarning` names a step that sums padding rows either way.

  All four are checked when the options are made: the two flags must be bools (TypeError), the buffer
  size None or an int (TypeError) >= 0 (ValueError), and the padding one of the two names (ValueError).

  >>> InputOptions(experimental_per_replica_buffer_size=2).experimental_fetch_to_device
  True
  >>> [buffer_size(InputOptions(), platform) for platform in ("cpu", "gpu", "tpu")]
  [0, 1, 1]
  """

  experimental_fetch_to_device: bool = True
  experimental_per_replica_buffer_size: int | None = None
  drop_remainder: bool = False
  experimental_padding: str = "first_row"

  def __post_init__(self) -> None:
    for name in ("experimental_fetch_to_device", "drop_remainder"):
      value = getattr(self, name)
      if not isinstance(value, bool):
        raise TypeError(f"InputOptions.{name} must be a bool, got {type(value).__name__} {value!r}.")
    check_int(self.experimental_per_replica_buffer_size, "InputOptions", "experimental_per_replica_buffer_size",
              minimum=0, allow_none=True)
    if self.experimental_padding not in PADDINGS:
      raise ValueError(f"InputOptions.experimental_padding must be one of {', '.join(map(repr, PADDINGS))}, got "
                       f"{self.experimental_padding!r}.")


def buffer_size(options: InputOptions, platform: str) -> int:
  """How many batches an iterator with `options` reads ahead onto devices of `platform` (``"cpu"``,
  ``"gpu"``, ``"tpu"``, ...): the option, or the platform's default when it is None."""
  size = options.experimental_per_replica_buffer_size
  return DEFAULT_BUFFER_SIZE.get(platform, _ACCELERATOR_BUFFER_SIZE) if size is None else size


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
