"""Cluster resolvers (TF's `tf.distribute.cluster_resolver`): where a job's processes and devices are.

* `TPUClusterResolver` finds this host's devices (and a whole Cloud TPU slice's), or takes a coordinator
  address, a process count and a process id (arguments or ``TPUSTRAT_*`` variables) for any cluster and
  for local multi-process runs.
* `SlurmClusterResolver` reads a Slurm job step (one process per task), this task's GPUs included.
* `TFConfigClusterResolver` reads ``TF_CONFIG`` (chief first, then the workers).

Each is a `ClusterResolver`. Pass one to `tpustrat.experimental_connect_to_cluster`,
`tpustrat.initialize_tpu_system` or `tpustrat.TPUStrategy`; the Slurm and ``TF_CONFIG`` ones are used
only when constructed (as in TF). `ClusterSpec` is what their `cluster_spec()` returns. See
`tpustrat._src.tpu_cluster_resolver`, `tpustrat._src.slurm_cluster_resolver`,
`tpustrat._src.tfconfig_cluster_resolver`, `tpustrat._src.cluster_resolver` (the base) and
`tpustrat._src.cluster_spec`.

>>> resolver = tpustrat.cluster_resolver.TPUClusterResolver(tpu="local")
>>> resolver.num_processes
1
"""

from tpustrat._src.cluster_resolver import ClusterResolver as ClusterResolver
from tpustrat._src.cluster_spec import ClusterSpec as ClusterSpec
from tpustrat._src.slurm_cluster_resolver import SlurmClusterResolver as SlurmClusterResolver
from tpustrat._src.tfconfig_cluster_resolver import TFConfigClusterResolver as TFConfigClusterResolver
from tpustrat._src.tpu_cluster_resolver import TPUClusterResolver as TPUClusterResolver

__all__ = ["ClusterResolver", "ClusterSpec", "SlurmClusterResolver", "TFConfigClusterResolver", "TPUClusterResolver"]
