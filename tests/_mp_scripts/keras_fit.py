"""Keras's ``fit`` / ``evaluate`` / ``predict`` under ``MultiWorkerMirroredStrategy().scope()`` in a 2-process
job; run by tests/test_keras_fit.py.

``python -m tpustrat.launch -n 2 -d 4 tests/_mp_scripts/keras_fit.py``: every process builds and compiles the
same model in the scope, trains it with Keras's own ``fit`` on numpy data whose size is not a multiple of
the global batch (``steps_per_execution=2``, a validation split), evaluates and predicts, and prints one
``RESULT {json}`` line: the history, the weights, the evaluation, the predictions and the devices of the
variables. The test compares them with one-device Keras on the same data.
"""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tpustrat  # noqa: E402

ROWS, BATCH, EPOCHS = 150, 32, 2  # the training part (120 rows) ends in a batch of 24, the validation of 30


def data():
  rng = np.random.default_rng(0)
  return rng.normal(size=(ROWS, 6)).astype(np.float32), rng.integers(0, 3, size=ROWS).astype(np.int32)


def build():
  keras.utils.set_random_seed(3)
  model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
  return model


def compile_args(steps_per_execution=1):
  return dict(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"], steps_per_execution=steps_per_execution)


def train(model):
  x, y = data()
  history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, validation_split=0.2, verbose=0)
  return {"history": history.history,
          "weights": [np.asarray(v.value).tolist() for v in model.weights],
          "evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0),
          "predict": np.asarray(model.predict(x[:13], batch_size=BATCH, verbose=0)).tolist()}


def grain_data(reads=None):
  """The training and validation data as batched grain MapDatasets (120 and 30 rows, batches of 32):
  with `reads`, every example read is recorded there (its row number)."""
  import grain  # noqa: PLC0415

  x, y = data()

  def example(i):
    if reads is not None:
      reads.append(int(i))
    return x[i], y[i]

  rows = grain.MapDataset.range(ROWS).map(example)
  return rows.slice(slice(0, 120)).batch(BATCH), rows.slice(slice(120, ROWS)).batch(BATCH)


def train_grain(model, reads=None):
  train_ds, val_ds = grain_data(reads)
  history = model.fit(train_ds, epochs=EPOCHS, validation_data=val_ds, shuffle=False, verbose=0)
  return {"history": history.history, "weights": [np.asarray(v.value).tolist() for v in model.weights],
          "evaluate": model.evaluate(val_ds, verbose=0)}


def main():
  strategy = tpustrat.MultiWorkerMirroredStrategy()
  with strategy.scope():
    model = build()
    model.compile(**compile_args(steps_per_execution=2))
  if sys.argv[1:] == ["grain"]:
    reads = []
    out = train_grain(model, reads)
    out["reads"] = sorted(set(reads))
    out["process"] = jax.process_index()
    print("RESULT " + json.dumps(out), flush=True)
    return
  out = train(model)
  out["devices"] = sorted({len(v.value.sharding.device_set) for v in model.variables})
  out["replicas"] = strategy.num_replicas_in_sync
  out["process"] = jax.process_index()
  print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
