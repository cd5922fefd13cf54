"""TPU collectives with TF's group assignments, for use inside `strategy.run` (`import tpustrat.ops`).

The counterparts of TF's raw TPU ops `CrossReplicaSum`, `AllToAll`, `CollectivePermute`, all-gather and
reduce-scatter. See `tpustrat._src.collectives` for how each maps onto `jax.lax` and `tpustrat._src.grouped_sums`
for how grouped sums are computed. `cross_replica_sum` and `reduce_scatter` (SUM) of a traced value that is already the same on
every replica (for example gradients w.r.t. `Mirrored` parameters, which `jax.grad` has already summed
over replicas) multiply it by the group size and emit a `tpustrat.AlreadyReplicatedWarning` at trace time.
"""

from tpustrat._src.collectives import all_gather as all_gather
from tpustrat._src.collectives import all_to_all as all_to_all
from tpustrat._src.collectives import collective_permute as collective_permute
from tpustrat._src.collectives import cross_replica_sum as cross_replica_sum
from tpustrat._src.collectives import reduce_scatter as reduce_scatter

__all__ = ["all_gather", "all_to_all", "collective_permute", "cross_replica_sum", "reduce_scatter"]
