"""Checkpoints of the whole training state with orbax-checkpoint: arrays, step and input position.

TF checkpoints a training loop with ``tf.train.Checkpoint(model=..., optimizer=..., iterator=...)`` and
a ``tf.train.CheckpointManager``. tpustrat's `CheckpointManager` wraps `orbax.checkpoint.CheckpointManager`
and saves, under one step number, three items:

* ``state``: any pytree of arrays (flax ``nnx.State``, optax states, a step counter, ...), saved with
  orbax's `StandardSave`. `Mirrored` and `PerReplica` values are saved as the global `jax.Array` they
  hold (a replicated array is written once, not once per replica: whole, by the device holding its
  replica 0, so that a save runs no slicing program; `handlers`), so a checkpoint does not depend on
  the layout it was written from: restoring puts every array on the shardings of the strategy it is
  restored under (any number of replicas, logical cores or processes), bit for bit. A `ShardedVariable`
  is saved as its blocks (``{"blocks": [N, ...block]}``) and restored split over the new replicas, or
  whole where the target holds the value `Mirrored` (and a `Mirrored` value split where the target holds
  a `ShardedVariable`). Each array is read onto the target's sharding, so a device receives only its
  block of a sharded value; a value whose layout changes is read into host memory (every process reads
  all of it, once, during the restore), checked there against its checksum, and placed from the host.
  Restored arrays can be donated by the next step.
* ``iterator``: the position of a `DistributedIterator` (`DistributedIterator.get_state`), one small
  JSON file per process: the batches the training loop has taken, not those read ahead by the
  prefetch thread, so the restored iterator continues with the next batch, none skipped or repeated.
* ``checksums``: two 32-bit fingerprints of the content of every array of ``state``, computed on the
  devices when the state is saved, or on the host for small arrays the process holds whole
  (``checksums.json``, written by process 0). They depend on the
  array's values only, not on its layout, so a restore onto any layout recomputes them and compares.

A save is atomic: orbax writes into a temporary ``<step>.orbax-checkpoint-tmp`` directory and renames
it to ``<step>`` only once every item of every process is written, so a save interrupted by an error or
a crash leaves the previous checkpoints as they were, and `latest_step` never sees the partial one. The
next start removes such a leftover (process 0, with a warning). A write the storage refuses (disk full,
read-only file system) ends the save at once: `CheckpointSaveError` naming the step, its directory and
the error in a one-process job; in a multi-process job every process stops with status 74
(`names.EXIT_CHECKPOINT_FAILED`), for the same reason as a deadline's 124 below. A save that another process
leaves in the middle (it is killed, say) is told apart by its cause: a barrier or collective of the save
across the processes fails in JAX's distributed runtime (`jax.errors.JaxRuntimeError`, with no `OSError`
of the storage behind it), and every process stops with status 69 (`names.EXIT_CHECKPOINT_PEER_LOST`), the
message saying that the storage is not the cause, whether the step was committed, and the last committed
step (read from the storage).

Damaged checkpoints. A step whose files were changed, truncated or deleted after the save (a data file
that no longer decodes, an array whose content no longer matches its checksum, a missing item, among them
an iterator position or checksums that the step's metadata lists, an empty step directory) is *damaged*.
`restore(step)` raises `DamagedCheckpointError` naming the step, its directory and what is wrong.
`restore()` (the latest step) falls back to the next older step, until one is intact, then moves the
damaged steps aside (``<step>.damaged``, kept for inspection, so that the step can be saved again) and
warns with `DamagedCheckpointWarning` for each, naming the same, the step restored and where it was
moved; when every step is damaged, nothing is moved and the error lists them. In a multi-process
job every process reads the step, the processes exchange their verdicts through the coordination
service, and all fall back together when any of them could not read it; the checksums are computed on
the global arrays, so every process reaches the same verdict on them.

Bounded. Every blocking operation of the manager (`save`, `restore`, `wait_until_finished`, `close`,
and the saves of `PreemptionCheckpointHandler`) must finish within the manager's `timeout`: by default
the step timeout when one is set (``--step-timeout``, ``TPUSTRAT_STEP_TIMEOUT``), else 1200 s. Each
process publishes what it is doing (taking the iterator's position, computing checksums, writing its
part of step ``s``, reading step ``s``, ...) and when it has finished its own part. When an operation
runs past the timeout, a thread ends the process with status 124 (`names.EXIT_STEP_TIMEOUT`) and a
message naming the processes that have not finished their part and what each is doing; the others see
the published message and stop too. It ends the process rather than raising because the main thread is
then blocked inside orbax (a barrier that is a device collective), where no exception reaches it.

orbax is imported on first use (it is a few hundred milliseconds), not by ``import tpustrat``.
"""

from tpustrat._src.checkpoint.deadlines import DEFAULT_TIMEOUT
from tpustrat._src.checkpoint.handlers import (
           CheckpointSaveError,
           DamagedCheckpointError,
           DamagedCheckpointWarning,
)
from tpustrat._src.checkpoint.manager import CheckpointManager
from tpustrat._src.checkpoint.operations import bounded_operation

__all__ = ["DEFAULT_TIMEOUT", "CheckpointManager", "CheckpointSaveError", "DamagedCheckpointError",
           "DamagedCheckpointWarning", "bounded_operation"]
