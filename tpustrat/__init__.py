"""tpustrat: TensorFlow's `tf.distribute` programming model (`TPUStrategy`, `run`, `reduce`, ...) on JAX.

Every public name is re-exported here once; the code lives in `tpustrat._src`. The public submodules
(`tpustrat.ops`, `tpustrat.cluster_resolver`, `tpustrat.checkpoint`, `tpustrat.embedding`,
`tpustrat.mixed_precision`, `tpustrat.experimental`, `tpustrat.keras`, `tpustrat.summary`) are imported
too, so that ``import tpustrat`` is enough to use them, as with ``tf.raw_ops`` or ``jax.lax``. `tpustrat.launch` is a
command-line entry point (``python -m tpustrat.launch``) and is imported on its own.
"""

from tpustrat import checkpoint as checkpoint  # orbax itself is imported on first use
from tpustrat import cluster_resolver as cluster_resolver
from tpustrat import embedding as embedding
from tpustrat import experimental as experimental
from tpustrat import keras as keras  # Keras itself is imported on first use (the `keras` extra)
from tpustrat import mixed_precision as mixed_precision
from tpustrat import ops as ops
from tpustrat import summary as summary  # tensorboardX itself is imported when a file writer is created
from tpustrat._src import compilation_cache as _compilation_cache
from tpustrat._src.accumulation import accumulate_gradients as accumulate_gradients
from tpustrat._src.batch_rows import BatchRowsWarning as BatchRowsWarning
from tpustrat._src.connect_to_cluster import (
    experimental_connect_to_cluster as experimental_connect_to_cluster,
)
from tpustrat._src.connect_to_cluster import initialize_tpu_system as initialize_tpu_system
from tpustrat._src.context import ReplicaContext as ReplicaContext
from tpustrat._src.context import ValueContext as ValueContext
from tpustrat._src.context import get_replica_context as get_replica_context
from tpustrat._src.context import get_strategy as get_strategy
from tpustrat._src.context import has_strategy as has_strategy
from tpustrat._src.context import in_cross_replica_context as in_cross_replica_context
from tpustrat._src.cross_device import AllReduceCrossDeviceOps as AllReduceCrossDeviceOps
from tpustrat._src.cross_device import CommunicationImplementation as CommunicationImplementation
from tpustrat._src.cross_device import CommunicationOptions as CommunicationOptions
from tpustrat._src.cross_device import CrossDeviceOps as CrossDeviceOps
from tpustrat._src.cross_device import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce
from tpustrat._src.cross_device import NcclAllReduce as NcclAllReduce
from tpustrat._src.cross_device import ReductionToOneDevice as ReductionToOneDevice
from tpustrat._src.engine import RunOptions as RunOptions
from tpustrat._src.gradient_semantics import AlreadyReplicatedWarning as AlreadyReplicatedWarning
from tpustrat._src.gradient_semantics import local_copy as local_copy
from tpustrat._src.input import DistributedDataset as DistributedDataset
from tpustrat._src.input import DistributedIterator as DistributedIterator
from tpustrat._src.input import InputContext as InputContext
from tpustrat._src.input import InputOptions as InputOptions
from tpustrat._src.input import num_valid_examples as num_valid_examples
from tpustrat._src.input import per_example as per_example
from tpustrat._src.input import valid_mask as valid_mask
from tpustrat._src.logical import LayoutMap as LayoutMap
from tpustrat._src.losses import compute_average_loss as compute_average_loss
from tpustrat._src.losses import scale_regularization_loss as scale_regularization_loss
from tpustrat._src.mirrored_strategy import MirroredStrategy as MirroredStrategy
from tpustrat._src.mirrored_strategy import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from tpustrat._src.numerics import NumericsError as NumericsError
from tpustrat._src.padding_reads import PaddingReadWarning as PaddingReadWarning
from tpustrat._src.preemption import PreemptionCheckpointHandler as PreemptionCheckpointHandler
from tpustrat._src.preemption import TerminationConfig as TerminationConfig
from tpustrat._src.reduce_op import ReduceOp as ReduceOp
from tpustrat._src.replica_random import replica_key as replica_key
from tpustrat._src.replica_random import replica_rngs as replica_rngs
from tpustrat._src.sharded_variable import GATHERED as GATHERED
from tpustrat._src.sharded_variable import LocalShard as LocalShard
from tpustrat._src.sharded_variable import ShardedVariable as ShardedVariable
from tpustrat._src.sharded_variable import gather_again_policy as gather_again_policy
from tpustrat._src.sharded_variable import read_values as read_values
from tpustrat._src.sharding import MinSizePartitioner as MinSizePartitioner
from tpustrat._src.sharding import clip_by_global_norm as clip_by_global_norm
from tpustrat._src.sharding import global_norm as global_norm
from tpustrat._src.sharding import sharding_groups as sharding_groups
from tpustrat._src.step_stats import InputBoundWarning as InputBoundWarning
from tpustrat._src.step_stats import RepeatedPlacementWarning as RepeatedPlacementWarning
from tpustrat._src.step_stats import RetracingWarning as RetracingWarning
from tpustrat._src.step_stats import StepRecord as StepRecord
from tpustrat._src.step_stats import StepStats as StepStats
from tpustrat._src.steps import stack_steps as stack_steps
from tpustrat._src.steps import unstack_steps as unstack_steps
from tpustrat._src.strategy import Strategy as Strategy
from tpustrat._src.strategy_extended import StrategyExtended as StrategyExtended
from tpustrat._src.topology import DeviceAssignment as DeviceAssignment
from tpustrat._src.topology import Topology as Topology
from tpustrat._src.tpu_strategy import TPUStrategy as TPUStrategy
from tpustrat._src.values import DistributedValues as DistributedValues
from tpustrat._src.values import Mirrored as Mirrored
from tpustrat._src.values import PerReplica as PerReplica
from tpustrat._src.zero import sharded_optimizer as sharded_optimizer
from tpustrat._version import __version__ as __version__  # written in tpustrat/_version.py only

_compilation_cache.enable_from_environment()  # `launch --compilation-cache DIR` (TPUSTRAT_COMPILATION_CACHE_DIR)

__all__ = [
    "accumulate_gradients",
    "AllReduceCrossDeviceOps",
    "AlreadyReplicatedWarning",
    "BatchRowsWarning",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NumericsError",
    "DeviceAssignment",
    "DistributedDataset",
    "DistributedIterator",
    "DistributedValues",
    "InputBoundWarning",
    "InputContext",
    "InputOptions",
    "Mirrored",
    "LocalShard",
    "MinSizePartitioner",
    "LayoutMap",
    "PaddingReadWarning",
    "PerReplica",
    "ShardedVariable",
    "read_values",
    "GATHERED",
    "gather_again_policy",
    "clip_by_global_norm",
    "global_norm",
    "sharded_optimizer",
    "sharding_groups",
    "PreemptionCheckpointHandler",
    "ReduceOp",
    "replica_key",
    "replica_rngs",
    "ReplicaContext",
    "RepeatedPlacementWarning",
    "RetracingWarning",
    "RunOptions",
    "Strategy",
    "StepRecord",
    "StepStats",
    "StrategyExtended",
    "TPUStrategy",
    "TerminationConfig",
    "Topology",
    "ValueContext",
    "checkpoint",
    "cluster_resolver",
    "compute_average_loss",
    "embedding",
    "experimental",
    "experimental_connect_to_cluster",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize_tpu_system",
    "local_copy",
    "mixed_precision",
    "num_valid_examples",
    "ops",
    "per_example",
    "scale_regularization_loss",
    "stack_steps",
    "summary",
    "unstack_steps",
    "valid_mask",
]
