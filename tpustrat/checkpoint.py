"""Checkpointing (TF's `tf.train.CheckpointManager`): training state and input position with orbax.

`CheckpointManager` saves a pytree of arrays (parameters, optimizer state, step; `Mirrored` and
`PerReplica` values as their global arrays), the checksums of its arrays and a `DistributedIterator`'s
position under one step, and restores them onto any strategy layout, checking the content. A damaged
step raises `DamagedCheckpointError` (``restore(step)``) or is skipped with a `DamagedCheckpointWarning`
(``restore()``, the newest intact step). A save the storage refuses raises `CheckpointSaveError` (one
process) or stops the job with status 74 (several); a save a peer process died in stops it with 69.
Every blocking operation is bounded by the manager's timeout.
See `tpustrat._src.checkpoint`.
"""

from tpustrat._src.checkpoint import CheckpointManager as CheckpointManager
from tpustrat._src.checkpoint import CheckpointSaveError as CheckpointSaveError
from tpustrat._src.checkpoint import DamagedCheckpointError as DamagedCheckpointError
from tpustrat._src.checkpoint import DamagedCheckpointWarning as DamagedCheckpointWarning

__all__ = ["CheckpointManager", "CheckpointSaveError", "DamagedCheckpointError", "DamagedCheckpointWarning"]
