"""Cluster resolvers (TF's `tf.distribute.cluster_resolver`): where a job's processes and devices are.

`TPUClusterResolver` finds this host's devices (and a whole Cloud TPU slice's), or takes a coordinator
address, a process count and a process id for GPU clusters and local multi-process runs. Pass it to
`tpustrat.experimental_connect_to_cluster`, `tpustrat.initialize_tpu_system` and `tpustrat.TPUStrategy`.
See `tpustrat._src.cluster_resolver`.

>>> resolver = tpustrat.cluster_resolver.TPUClusterResolver(tpu="local")
>>> resolver.num_processes
1
"""

from tpustrat._src.cluster_resolver import TPUClusterResolver as TPUClusterResolver

__all__ = ["TPUClusterResolver"]
