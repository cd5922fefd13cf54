"""Embedding tables sharded by rows over the replicas (TF's `tf.tpu.experimental.embedding`), in four
modules:

* `optimizers`: `SGD`, `Adagrad`, `Adam`, `FTRL`, `AdagradMomentum`, the tables' sparse update rules;
* `config`: `TableConfig` and `FeatureConfig`;
* `exchange`: how ids and rows travel between the replicas inside a step (the layouts, the routing of
  ids into the owners' buckets, one collective per layout for all tables, the owners' updates, the
  bounds' check);
* `tpu_embedding`: `TPUEmbedding`, which builds the tables as `ShardedVariable`s split by rows, looks
  them up and applies gradients (its module docstring describes the layouts).

Each module imports only the ones listed before it; `tpustrat.embedding` is the public surface.
"""

from tpustrat._src.embedding.config import FeatureConfig as FeatureConfig
from tpustrat._src.embedding.config import TableConfig as TableConfig
from tpustrat._src.embedding.optimizers import FTRL as FTRL
from tpustrat._src.embedding.optimizers import SGD as SGD
from tpustrat._src.embedding.optimizers import Adagrad as Adagrad
from tpustrat._src.embedding.optimizers import AdagradMomentum as AdagradMomentum
from tpustrat._src.embedding.optimizers import Adam as Adam
from tpustrat._src.embedding.tpu_embedding import TPUEmbedding as TPUEmbedding
from tpustrat._src.embedding.tpu_embedding import local_block as _block  # noqa: F401 (benchmarks/ imports it)
from tpustrat._src.embedding.tpu_embedding import split_rows as split_rows

__all__ = ["Adagrad", "AdagradMomentum", "Adam", "FTRL", "FeatureConfig", "SGD", "TPUEmbedding",
           "TableConfig"]
