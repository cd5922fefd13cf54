"""Keras callbacks for ``fit`` under a strategy: what Keras 3 on JAX does not give, or not as TF does.

* `TensorBoard`: Keras's ``keras.callbacks.TensorBoard`` writes through ``tensorflow.summary`` (it imports
  TensorFlow when training begins, and ``fit`` fails without it). This one writes the same scalars, under
  the same names and folders, through tensorboardX (``pip install 'tpustrat[tensorboard]'``; the event
  files of `tpustrat.summary`), which TensorBoard reads; in a job of several processes only process 0
  writes (TF's chief).
* `BackupAndRestore`: TF's ``BackupAndRestore`` with TF's preemption semantics. Keras 3's saves the weights
  at an epoch's end and restarts an interrupted epoch from its first batch; this one saves the whole
  training state (weights, optimizer, metrics, random streams) through `CheckpointManager` at every epoch's
  end (or every ``save_freq`` batches) and, through a `PreemptionCheckpointHandler`, at the step every
  process agrees on after a SIGTERM, then ends the job with the launcher's restart status; the restarted
  ``fit`` resumes at that very step (the epoch and the batch within it).

The classes subclass Keras's ``Callback``, so they are built on first use (Keras is an optional
dependency).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tpustrat._src import keras_fit, keras_models
from tpustrat._src.checkpoint import CheckpointManager
from tpustrat._src.preemption import PreemptionCheckpointHandler, TerminationConfig
from tpustrat._src.summary import EventFile, import_tensorboardx

__all__ = ["backup_and_restore_class", "tensorboard_class"]

_TENSORBOARD = "tpustrat.keras.TensorBoard"


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

  class TensorBoard(keras.callbacks.Callback):  # type: ignore[name-defined]
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
      self._writers: dict[str, EventFile] = {}
      import_tensorboardx(_TENSORBOARD)  # a missing tensorboardX fails here, not when training begins
      self._batches = 0

    def _write(self, folder: str, tag: str, value: Any, step: int) -> None:
      if jax.process_index() != 0:
        return
      number = _scalar(value)
      if number is None:
        return
      writer = self._writers.get(folder)
      if writer is None:
        writer = self._writers[folder] = EventFile(os.path.join(self.log_dir, folder), user=_TENSORBOARD)
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


def _keras_state(model: Any) -> dict[str, list[Any]]:
  """The model's whole training state as Keras holds it between steps (read from its variables)."""
  optimizer = model.optimizer
  return {"trainable": [v.value for v in model.trainable_variables],
          "non_trainable": [v.value for v in model.non_trainable_variables],
          "optimizer": [v.value for v in optimizer.variables] if optimizer is not None else [],
          "metrics": [v.value for v in model.metrics_variables]}


@functools.cache
def backup_and_restore_class() -> type:
  """Builds `BackupAndRestore` (once): Keras is imported here, on first use."""
  keras = keras_models.import_keras()

  class BackupAndRestore(keras.callbacks.Callback):  # type: ignore[name-defined]
    """TF's ``tf.keras.callbacks.BackupAndRestore`` with TF's preemption semantics, for ``fit`` under a
    strategy.

    At the start of ``fit`` it restores the newest backup in `backup_dir`, if there is one: the weights,
    the optimizer's state, the metrics and the random streams, and where training stood (the epoch and
    the batches done in it); ``fit`` then goes on from the next batch, so an interrupted run and an
    uninterrupted one train on the same batches with the same numbers (with ``shuffle=False`` or a
    dataset that keeps its order: Keras's shuffling of arrays draws a new order per epoch, which is not
    part of the backup, as in TF). It backs up at every epoch's end (``save_freq="epoch"``) or every
    ``save_freq`` batches, through `tpustrat.checkpoint.CheckpointManager` (in a job of several processes,
    every process takes part). A SIGTERM to any process of the job (a preemption notice) makes every
    process back up at the step they agree on, then end with status 42, on which ``python -m
    tpustrat.launch --max-restarts N`` starts the job again (`tpustrat.PreemptionCheckpointHandler`; set
    `termination_config` to change what happens). At the end of a ``fit`` that completes, the backup
    folder is deleted (``delete_checkpoint=True``), as Keras and TF do.

    The model must be compiled under a strategy (inside its scope).

    Args:
      backup_dir: where the backups are written (shared by the job's processes).
      save_freq: ``"epoch"`` or an int >= 1 (batches between backups).
      delete_checkpoint: delete `backup_dir` when ``fit`` completes.
      termination_config: a `tpustrat.TerminationConfig` for the preemption handler (None: SIGTERM,
        then exit with the restart status).

    Raises:
      ValueError: `save_freq` is neither ``"epoch"`` nor an int >= 1; (at ``fit``) the model is not
        compiled under a strategy.
    """

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: Any = "epoch",
                 delete_checkpoint: bool = True, termination_config: TerminationConfig | None = None) -> None:
      super().__init__()
      if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
        raise ValueError(f"tpustrat.keras.BackupAndRestore: save_freq={save_freq!r}; expected 'epoch' or an int "
                         ">= 1 (batches between backups).")
      if not backup_dir:
        raise ValueError("tpustrat.keras.BackupAndRestore: backup_dir is empty; give the folder of the backups.")
      self.backup_dir = os.path.abspath(os.fspath(backup_dir))
      self.save_freq = save_freq
      self.delete_checkpoint = delete_checkpoint
      self.termination_config = termination_config
      self._manager: CheckpointManager | None = None
      self._handler: PreemptionCheckpointHandler | None = None
      self._epoch = 0
      self._done = 0  # batches done in the current epoch
      self._resumed: tuple[int, int] | None = None
      self._metrics: Any = None

    # what fit's train function calls (`keras_fit._Fit`) ----------------------------------------------

    def run_call(self, execute: Callable[[], tuple[Any, Any, int]]) -> tuple[Any, Any]:
      """One train execution under the preemption handler: saves its result, with the position after
      it, at the step the processes agree on after a termination notice."""
      def call(_: Any) -> tuple[Any, ...]:
        logs, state, steps = execute()
        self._done += steps
        return self._backup(state, self._epoch, self._done), logs, state

      assert self._handler is not None  # set at on_train_begin, which Keras calls before any step
      _, logs, state = self._handler.run(call, None)
      return logs, state

    def end(self) -> None:
      """Stops watching for termination notices and waits for a backup still being written (fit has
      returned or raised: an interrupted fit leaves its last backup whole, for the next to resume from)."""
      if self._handler is not None:
        self._handler.close()
        self._handler = None
      if self._manager is not None:
        self._manager.close()
        self._manager = None

    # Keras's hooks ------------------------------------------------------------------------------------

    def _backup(self, state: Any, epoch: int, done: int) -> dict[str, Any]:
      trainable, non_trainable, optimizer, metrics = state
      return {"trainable": list(trainable), "non_trainable": list(non_trainable), "optimizer": list(optimizer),
              "metrics": list(metrics), "position": np.asarray([epoch, done], np.int32)}

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
      model = self.model
      fit = keras_fit.fit_of(model)
      if fit is None:
        raise ValueError(
            f"tpustrat.keras.BackupAndRestore: the model {model.name!r} is not compiled under a strategy; build "
            "and compile it inside strategy.scope() (Keras's own keras.callbacks.BackupAndRestore serves a "
            "model without one).")
      self._manager = CheckpointManager(self.backup_dir, fit.strategy)
      self._handler = PreemptionCheckpointHandler(fit.strategy.cluster_resolver, self._manager,
                                                  termination_config=self.termination_config)
      fit.backup = self
      current = _keras_state(model)
      init = self._backup((current["trainable"], current["non_trainable"], current["optimizer"],
                           current["metrics"]), 0, 0)
      found = self._manager.latest_step() is not None
      restored = self._handler.restore(init)
      if not found:
        return
      for key, variables in (("trainable", model.trainable_variables),
                             ("non_trainable", model.non_trainable_variables),
                             ("optimizer", model.optimizer.variables)):
        for variable, value in zip(variables, restored[key]):
          variable.assign(value)
      epoch, done = (int(v) for v in np.asarray(restored["position"]))
      self._resumed = (epoch, done)
      self._metrics = restored["metrics"]  # written when the epoch begins: Keras resets them first
      model._initial_epoch = epoch  # noqa: SLF001 - how Keras's own BackupAndRestore resumes at an epoch
      fit.skip_batches = done

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
      self._epoch = epoch
      resumed, self._resumed = self._resumed, None
      self._done = 0
      if resumed is not None and resumed[0] == epoch and resumed[1]:
        # Inside an epoch: its metrics so far, over Keras's reset. (A backup at an epoch's end holds the
        # last validation's metrics, and the next epoch starts them from zero.)
        self._done = resumed[1]
        for variable, value in zip(self.model.metrics_variables, self._metrics):
          variable.assign(value)
      self._metrics = None

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
      if self.save_freq == "epoch" or self._manager is None or self._handler is None:
        return
      if self._done // self.save_freq > (self._done - self._last_steps()) // self.save_freq:
        self._save(self._epoch, self._done)

    def _last_steps(self) -> int:
      fit = keras_fit.fit_of(self.model)
      return 0 if fit is None else fit.last_steps

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
      if self.save_freq == "epoch":
        self._save(epoch + 1, 0)

    def _save(self, epoch: int, done: int) -> None:
      assert self._manager is not None and self._handler is not None
      current = _keras_state(self.model)
      state = self._backup((current["trainable"], current["non_trainable"], current["optimizer"],
                            current["metrics"]), epoch, done)
      self._manager.save(self._handler.total_run_calls, state, force=True)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
      self.end()
      if self.delete_checkpoint and jax.process_index() == 0:
        shutil.rmtree(self.backup_dir, ignore_errors=True)

  BackupAndRestore.__module__ = "tpustrat.keras"
  BackupAndRestore.__qualname__ = "BackupAndRestore"
  return BackupAndRestore
