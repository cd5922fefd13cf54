"""Keras callbacks for ``fit`` under a strategy that Keras 3 on JAX cannot give without TensorFlow.

`TensorBoard`: Keras's ``keras.callbacks.TensorBoard`` writes through ``tensorflow.summary`` (it imports
TensorFlow when training begins, and ``fit`` fails without it). This one writes the same scalars, under
the same names and folders, through tensorboardX (``pip install 'tpustrat[tensorboard]'``), which
TensorBoard reads; in a job of several processes only process 0 writes (TF's chief). The classes
subclass Keras's, so they are built on first use (Keras is an optional dependency).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import numpy as np

from tpustrat._src import keras_models

__all__ = ["tensorboard_class"]


def _writer_class() -> Any:
  try:
    from tensorboardX import SummaryWriter  # type: ignore[import-untyped]  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("tpustrat.keras.TensorBoard writes TensorBoard's event files with tensorboardX: "
                      "pip install 'tpustrat[tensorboard]' (or pip install tensorboardX).") from e
  return SummaryWriter


def _scalar(value: Any) -> float | None:
  """A log value as a Python float, or None for one that is not a single number."""
  try:
    array = np.asarray(value)
  except Exception:  # noqa: BLE001 - a log Keras can hold but TensorBoard's scalars cannot
    return None
  if array.size != 1 or not np.issubdtype(array.dtype, np.number):
    return None
  return float(array.reshape(()))


@functools.cache
def tensorboard_class() -> type:
  """Builds `TensorBoard` (once): Keras is imported here, on first use."""
  keras = keras_models.import_keras()

  class TensorBoard(keras.callbacks.Callback):  # type: ignore[misc, name-defined]
    """TensorBoard scalars for ``fit`` without TensorFlow: Keras's ``keras.callbacks.TensorBoard``'s
    scalars, names and folders.

    At each epoch's end it writes every log (``loss``, each metric) as ``epoch_<name>`` into
    ``<log_dir>/train`` and the validation logs (``val_<name>``) as ``epoch_<name>`` into
    ``<log_dir>/validation``, at step ``epoch``, and the optimizer's learning rate as
    ``epoch_learning_rate``; with ``update_freq=N`` (an int) it also writes the training logs as
    ``batch_<name>`` every ``N`` batches, at step ``optimizer.iterations`` (Keras's step). In a job of
    several processes only process 0 writes, as TF's chief does. It writes through tensorboardX, which
    TensorBoard reads (``tensorboard --logdir <log_dir>``).

    Args:
      log_dir: the folder of the event files (created if missing).
      update_freq: ``"epoch"`` (the default) or an int: also write batch-level logs every that many
        batches (with ``steps_per_execution``, at the end of each execution that crosses a multiple).

    Raises:
      ValueError: `update_freq` is neither ``"epoch"`` nor an int >= 1.
      ImportError: tensorboardX is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", update_freq: Any = "epoch") -> None:
      super().__init__()
      if update_freq != "epoch" and (isinstance(update_freq, bool) or not isinstance(update_freq, int)
                                     or update_freq < 1):
        raise ValueError(f"tpustrat.keras.TensorBoard: update_freq={update_freq!r}; expected 'epoch' or an "
                         "int >= 1 (batches between writes).")
      self.log_dir = os.fspath(log_dir)
      self.update_freq = update_freq
      self._writers: dict[str, Any] = {}
      self._writer = _writer_class()
      self._batches = 0

    def _write(self, folder: str, tag: str, value: Any, step: int) -> None:
      if jax.process_index() != 0:
        return
      number = _scalar(value)
      if number is None:
        return
      writer = self._writers.get(folder)
      if writer is None:
        writer = self._writers[folder] = self._writer(os.path.join(self.log_dir, folder))
      writer.add_scalar(tag, number, step)

    def _learning_rate(self) -> Any:
      optimizer = getattr(self.model, "optimizer", None)
      rate = getattr(optimizer, "learning_rate", None)
      return None if rate is None else np.asarray(rate)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
      if self.update_freq == "epoch" or not logs:
        return
      done = batch + 1  # batches done this epoch (the last of an execution of steps_per_execution)
      crossed = done // self.update_freq > self._batches // self.update_freq
      self._batches = done
      if crossed:
        step = int(np.asarray(self.model.optimizer.iterations))
        for name, value in logs.items():
          self._write("train", f"batch_{name}", value, step)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
      self._batches = 0

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
      for name, value in (logs or {}).items():
        if name.startswith("val_"):
          self._write("validation", f"epoch_{name[4:]}", value, epoch)
        else:
          self._write("train", f"epoch_{name}", value, epoch)
      if "learning_rate" not in (logs or {}):
        rate = self._learning_rate()
        if rate is not None:
          self._write("train", "epoch_learning_rate", rate, epoch)
      for writer in self._writers.values():
        writer.flush()

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
      for writer in self._writers.values():
        writer.flush()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
      for writer in self._writers.values():
        writer.close()
      self._writers = {}

  TensorBoard.__module__ = "tpustrat.keras"
  TensorBoard.__qualname__ = "TensorBoard"
  return TensorBoard
