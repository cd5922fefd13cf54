"""Embedding tables sharded by rows over the replicas (TF's `tf.tpu.experimental.embedding`).

Tables and their optimizer slots are `tpustrat.ShardedVariable`s of shape ``[V, D]`` split along axis 0.
"""

from tpustrat._src.embedding import FTRL as FTRL
from tpustrat._src.embedding import SGD as SGD
from tpustrat._src.embedding import Adagrad as Adagrad
from tpustrat._src.embedding import AdagradMomentum as AdagradMomentum
from tpustrat._src.embedding import Adam as Adam
from tpustrat._src.embedding import FeatureConfig as FeatureConfig
from tpustrat._src.embedding import TableConfig as TableConfig
from tpustrat._src.embedding import TPUEmbedding as TPUEmbedding

__all__ = ["FTRL", "SGD", "Adagrad", "AdagradMomentum", "Adam", "FeatureConfig", "TPUEmbedding", "TableConfig"]
