"""Keras's ``fit`` with `tpustrat.keras.BackupAndRestore` in a 2-process job that process 1 preempts with a
SIGTERM; run by tests/test_keras_fit.py.

``python -m tpustrat.launch -n 2 -d 4 --max-restarts 1 tests/_mp_scripts/keras_backup.py BACKUP_DIR``: on
the first start, process 1 sends itself SIGTERM after the 5th step (epoch 1, batch 1 of 4); every process
backs up at the step they agree on and ends with the restart status; the launcher starts the job again,
``fit`` resumes at that step and completes. Each process of the second start prints one ``RESULT {json}``
line: its start, the history of the epochs it ran, the weights and the optimizer's step count.
"""

import json
import os
import signal
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpustrat  # noqa: E402
from tpustrat import keras as tk  # noqa: E402

ROWS, BATCH, EPOCHS = 56, 16, 3  # 4 batches an epoch, the last of 8 rows


def data():
  rng = np.random.default_rng(1)
  return rng.normal(size=(ROWS, 6)).astype(np.float32), rng.integers(0, 3, size=ROWS).astype(np.int32)


def build():
  keras.utils.set_random_seed(5)
  return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])


def compile_args():
  return dict(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])


class Preempt(keras.callbacks.Callback):
  """On the first start, process 1 gets a SIGTERM after the 5th step."""

  def on_train_batch_end(self, batch, logs=None):
    if (os.environ.get("TPUSTRAT_RESTART_COUNT") == "0" and jax.process_index() == 1
        and int(self.model.optimizer.iterations.value) == 5):
      os.kill(os.getpid(), signal.SIGTERM)


def main():
  strategy = tpustrat.MultiWorkerMirroredStrategy()
  with strategy.scope():
    model = build()
    model.compile(**compile_args())
  x, y = data()
  history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
                      callbacks=[tk.BackupAndRestore(sys.argv[1], save_freq="epoch"), Preempt()])
  print("RESULT " + json.dumps({"start": int(os.environ["TPUSTRAT_RESTART_COUNT"]), "history": history.history,
                                "weights": [np.asarray(v.value).tolist() for v in model.weights],
                                "iterations": int(model.optimizer.iterations.value)}), flush=True)


if __name__ == "__main__":
  main()
