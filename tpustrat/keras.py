"""Keras 3 models (``KERAS_BACKEND=jax``) under a strategy: Keras's own ``compile`` / ``fit``, or `strategy.run`.

A model built and compiled inside ``strategy.scope()`` trains, evaluates and predicts with Keras's own
``fit`` / ``evaluate`` / ``predict`` on every replica (`strategy_of` says which strategy a model belongs
to; `TensorBoard` writes TensorBoard's scalars without TensorFlow). For a custom loop in `strategy.run`,
`state` / `assign` move a model's and optimizer's variables into a pytree and back, `stateless_call` is
``model.stateless_call`` with per-replica random streams and batch norm statistics aggregated as TF does,
`scale_loss` is ``optimizer.scale_loss`` by the loss scale in the step's state (Keras's
``LossScaleOptimizer``), `iterations` reads the step count from a state (TF's ``optimizer.iterations`` after
a restore), and `SyncBatchNormalization` is TF's synchronised batch norm. A Keras variable read or written
in a step outside a ``keras.StatelessScope`` that maps it (``metric.update_state``,
``optimizer.scale_loss``) raises, naming the stateless way; on the host, a read of a Keras object that a
custom loop's state has moved past (after a restore, or steps that write it, and no `assign` since:
``optimizer.iterations.numpy()``, ``model.predict``, ``model.save``) raises `StaleVariableError`, naming
`assign`. Keras is an optional dependency
(``pip install 'tpustrat[keras]'``): it is imported when one of these is first used, never by
``import tpustrat``. See docs/guides/keras.md and `tpustrat._src.keras_fit`.
"""

from typing import Any

from tpustrat._src.keras_callbacks import backup_and_restore_class as _backup_and_restore_class
from tpustrat._src.keras_callbacks import tensorboard_class as _tensorboard_class
from tpustrat._src.keras_fit import set_run_options as set_run_options
from tpustrat._src.keras_fit import strategy_of_model as strategy_of
from tpustrat._src.keras_models import StaleVariableError as StaleVariableError
from tpustrat._src.keras_models import assign as assign
from tpustrat._src.keras_models import iterations as iterations
from tpustrat._src.keras_models import scale_loss as scale_loss
from tpustrat._src.keras_models import state as state
from tpustrat._src.keras_models import stateless_call as stateless_call
from tpustrat._src.keras_models import sync_batch_normalization_class as _sync_batch_normalization_class

__all__ = ["BackupAndRestore", "StaleVariableError", "SyncBatchNormalization", "TensorBoard", "assign", "iterations", "scale_loss", "state", "set_run_options", "stateless_call", "strategy_of"]  # noqa: F822 (module __getattr__)


def __getattr__(name: str) -> Any:
  if name == "SyncBatchNormalization":  # a Keras subclass: built when first asked for (imports Keras)
    return _sync_batch_normalization_class()
  if name == "BackupAndRestore":  # a Keras callback: built when first asked for (imports Keras)
    return _backup_and_restore_class()
  if name == "TensorBoard":  # a Keras callback: built when first asked for (imports Keras)
    return _tensorboard_class()
  raise AttributeError(f"module 'tpustrat.keras' has no attribute {name!r}")
