"""TF's "Distributed training with Keras" tutorial, ported to tpustrat: Keras's own ``Model.fit`` on every replica.

The original: https://www.tensorflow.org/tutorials/distribute/keras (source: github.com/tensorflow/docs,
``site/en/tutorials/distribute/keras.ipynb``). It trains an MNIST convnet with `MirroredStrategy` and
Keras's ``Model.fit``: the model built and compiled inside ``strategy.scope()``, a `tf.data` pipeline
(``map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)``), the callbacks TensorBoard, ModelCheckpoint
(weights only, one file per epoch), LearningRateScheduler(decay) and a custom ``PrintLR``; then the latest
checkpoint restored with ``model.load_weights`` and evaluated, the model saved with ``model.save`` and loaded
with ``keras.models.load_model`` both outside the scope (one device) and inside it (every replica), each
evaluated. This port keeps that structure, cell for cell, with Keras 3 on JAX; the only changes are the
input pipeline (a grain dataset, tpustrat's counterpart of `tf.data`) and TensorBoard (see below). The
data are synthetic, of MNIST's shapes and types (28 x 28 x 1 uint8 images, 10 classes, the label a fixed
function of the image), generated deterministically from a seed: nothing can be downloaded here. The
training set is not a multiple of the global batch: the last batch of every epoch is partial.

After the tutorial, `check_one_device` trains the same model (same seed, same batches, same learning-rate
schedule) with plain Keras on one device, outside any scope, and asserts that the per-epoch losses and
accuracies, the final weights and the evaluations agree.

Run it::

    KERAS_BACKEND=jax python examples/tf_tutorials/keras_fit.py      # 8 emulated CPU devices
    KERAS_BACKEND=jax python examples/tf_tutorials/keras_fit.py --epochs 12 --num-train-examples 6000

Side by side
------------
::

  TF (the tutorial)                                        tpustrat (this file; Keras 3 on JAX)
  -----------------------------------------------------    ----------------------------------------------------
  strategy = tf.distribute.MirroredStrategy()              strategy = tpustrat.MirroredStrategy()
  BATCH_SIZE = (BATCH_SIZE_PER_REPLICA *                   BATCH_SIZE = (BATCH_SIZE_PER_REPLICA *
      strategy.num_replicas_in_sync)                           strategy.num_replicas_in_sync)
  train_dataset = mnist_train.map(scale).cache().          train_dataset = strategy.experimental_make_numpy_
      shuffle(BUFFER_SIZE).batch(BATCH_SIZE)                   dataset(mnist_train).map(scale).shuffle(
                                                               seed=SEED).batch(BATCH_SIZE)        # grain
  with strategy.scope():                                   with strategy.scope():
    model = tf.keras.Sequential([...])                       model = keras.Sequential([...])    # the same
    model.compile(loss=..., optimizer=..., metrics=[...])    model.compile(loss=..., optimizer=..., metrics=[...])
  callbacks = [tf.keras.callbacks.TensorBoard(...),        callbacks = [keras.callbacks.CSVLogger(...),
               tf.keras.callbacks.ModelCheckpoint(...),                 keras.callbacks.ModelCheckpoint(...),
               tf.keras.callbacks.LearningRateScheduler(                keras.callbacks.LearningRateScheduler(
                   decay), PrintLR()]                                       decay), PrintLR()]
  model.fit(train_dataset, epochs=EPOCHS,                  model.fit(train_dataset, epochs=EPOCHS,
            callbacks=callbacks)                                     callbacks=callbacks)
  model.load_weights(latest_checkpoint)                    model.load_weights(latest_checkpoint)
  eval_loss, eval_acc = model.evaluate(eval_dataset)       eval_loss, eval_acc = model.evaluate(eval_dataset)
  model.save(path)                                         model.save(path)
  unreplicated_model = tf.keras.models.load_model(path)    unreplicated_model = keras.models.load_model(path)
  with strategy.scope():                                   with strategy.scope():
    replicated_model = tf.keras.models.load_model(path)      replicated_model = keras.models.load_model(path)

What changes, and why: nothing in the Keras code. ``model.compile`` inside the scope attaches the strategy
to the model, and Keras's ``fit`` / ``evaluate`` run each global batch on the 8 replicas (the partial last
batch padded, the padding rows weighted 0, so the losses and metrics are one device's). TensorBoard: Keras's
TensorBoard callback writes through ``tensorflow.summary`` (``keras/src/callbacks/tensorboard.py`` imports it
when training begins), so without TensorFlow installed ``fit`` fails with ``ModuleNotFoundError: No module
named 'tensorflow'``; `keras.callbacks.CSVLogger` records the same per-epoch logs in the logs directory
instead. The shuffle: grain's is a global shuffle (no ``BUFFER_SIZE``), and a `MapDataset` iterated again
by each Keras epoch gives the same order every epoch (TF's reshuffles each epoch).
"""

from __future__ import annotations

import os

# Emulate 8 devices when JAX runs on the CPU (harmless on a TPU VM or GPU machine), and run Keras on JAX;
# both must happen before JAX and Keras initialise.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import tpustrat  # noqa: E402

try:
  import keras  # noqa: E402
except ImportError as e:  # pragma: no cover - the `keras` extra
  raise SystemExit("this example needs Keras 3: pip install 'tpustrat[keras]'") from e

SEED = 0


# -- Download the dataset (here: generated) ----------------------------------------------------------------

def load_mnist(num_train_examples: int, num_test_examples: int, seed: int = SEED) -> tuple[
    tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """Synthetic MNIST in place of ``tfds.load(name='mnist', as_supervised=True)`` (no download possible):
  ``[n, 28, 28, 1]`` uint8 images in [0, 255] and int32 labels in [0, 10), the label a fixed linear
  function of the image (learnable), deterministic for a seed: ``(mnist_train, mnist_test)``."""
  rng = np.random.default_rng(seed)
  projection = rng.normal(size=(28 * 28, 10)).astype(np.float32)

  def make(n: int) -> tuple[np.ndarray, np.ndarray]:
    images = rng.integers(0, 256, size=(n, 28, 28, 1), dtype=np.uint8)
    labels = np.argmax((images.reshape(n, -1) / 255.0) @ projection, axis=-1).astype(np.int32)
    return images, labels

  return make(num_train_examples), make(num_test_examples)


# -- Set up the input pipeline -----------------------------------------------------------------------------

def scale(image: np.ndarray, label: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The tutorial's `scale`: pixel values from [0, 255] to [0, 1]."""
  image = image.astype(np.float32)
  image /= 255
  return image, label


def make_datasets(strategy: Any, mnist_train: Any, mnist_test: Any, batch_size: int, seed: int = SEED) -> tuple[
    Any, Any]:
  """``train_dataset = mnist_train.map(scale).cache().shuffle(BUFFER_SIZE).batch(BATCH_SIZE)`` and
  ``eval_dataset = mnist_test.map(scale).batch(BATCH_SIZE)`` as grain `MapDataset`s (the arrays are in
  memory: no ``cache``; grain shuffles globally: no ``BUFFER_SIZE``). Keras's ``fit`` takes them as it
  takes a `tf.data.Dataset`: each element a global batch, the last one partial."""
  train = strategy.experimental_make_numpy_dataset(mnist_train).map(lambda e: scale(*e))
  train_dataset = train.shuffle(seed=seed).batch(batch_size)
  eval_dataset = strategy.experimental_make_numpy_dataset(mnist_test).map(lambda e: scale(*e)).batch(batch_size)
  return train_dataset, eval_dataset


# -- Create the model and instantiate the optimizer --------------------------------------------------------

def build_model(seed: int = SEED) -> Any:
  """The tutorial's `tf.keras.Sequential`, layer for layer (the initial weights drawn from `seed`)."""
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((28, 28, 1)),  # Keras 3's spelling of `input_shape=(28, 28, 1)`
      keras.layers.Conv2D(32, 3, activation="relu"),
      keras.layers.MaxPooling2D(),
      keras.layers.Flatten(),
      keras.layers.Dense(64, activation="relu"),
      keras.layers.Dense(10),
  ])


def compile_model(model: Any) -> None:
  model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=keras.optimizers.Adam(learning_rate=0.001),
                metrics=["accuracy"])


# -- Define the callbacks ----------------------------------------------------------------------------------

def decay(epoch: int) -> float:
  """The tutorial's learning-rate decay, for LearningRateScheduler."""
  if epoch < 3:
    return 1e-3
  elif epoch >= 3 and epoch < 7:
    return 1e-4
  else:
    return 1e-5


class PrintLR(keras.callbacks.Callback):
  """Prints the learning rate at the end of each epoch (and keeps it in `learning_rates`)."""

  def __init__(self, verbose: bool = True) -> None:
    super().__init__()
    self.verbose = verbose
    self.learning_rates: list[float] = []

  def on_epoch_end(self, epoch, logs=None):
    # The tutorial reads its global `model`; Keras gives a callback its model as `self.model`.
    learning_rate = float(self.model.optimizer.learning_rate.numpy())
    self.learning_rates.append(learning_rate)
    if self.verbose:
      print(f"\nLearning rate for epoch {epoch + 1} is {learning_rate}")


@contextlib.contextmanager
def keras_grain_warnings_off():
  """Keras's two warnings for every grain dataset, on one device as on a strategy: ``fit``'s default
  ``shuffle=True`` is ignored (the dataset shuffles itself, as a `tf.data` one does), and Keras's grain
  adapter does not report a grain dataset's length, so each epoch ends with the dataset running out of data
  ("Your input ran out of data; interrupting training"), the normal end of an epoch here."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="`shuffle=True` was passed, but will be ignored", category=UserWarning)
    warnings.filterwarnings("ignore", message="Your input ran out of data", category=UserWarning)
    yield


def _devices(model: Any) -> int:
  """On how many devices the model's variables are (all on the same number)."""
  (count,) = {len(v.value.sharding.device_set) for v in model.variables}
  return count


def _history(history: Any) -> dict[str, list[float]]:
  return {name: [float(v) for v in values] for name, values in history.history.items()}


def _weights(model: Any) -> list[np.ndarray]:
  return [np.asarray(v.value) for v in model.weights]


# -- The tutorial ------------------------------------------------------------------------------------------

def tutorial(strategy: Any, workdir: str, *, epochs: int = 4, batch_size_per_replica: int = 8,
             num_train_examples: int = 236, num_test_examples: int = 100, verbose: bool = True) -> dict[str, Any]:
  """The tutorial's cells on `strategy`, its files under `workdir`; returns what it printed."""
  say = print if verbose else (lambda *args, **kwargs: None)
  keras_verbose = "auto" if verbose else 0

  # Download the dataset
  mnist_train, mnist_test = load_mnist(num_train_examples, num_test_examples)

  # Define the distribution strategy (given: `strategy = tpustrat.MirroredStrategy()` in `main`)
  say(f"Number of devices: {strategy.num_replicas_in_sync}")

  # Set up the input pipeline
  BATCH_SIZE_PER_REPLICA = batch_size_per_replica  # noqa: N806 (the tutorial's names)
  BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync  # noqa: N806
  train_dataset, eval_dataset = make_datasets(strategy, mnist_train, mnist_test, BATCH_SIZE)

  # Create the model and instantiate the optimizer
  with strategy.scope():
    model = build_model()
    compile_model(model)

  # Define the callbacks
  checkpoint_dir = os.path.join(workdir, "training_checkpoints")
  checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt_{epoch:04d}.weights.h5")
  log_dir = os.path.join(workdir, "logs")
  os.makedirs(log_dir, exist_ok=True)
  print_lr = PrintLR(verbose)
  callbacks = [
      # tf.keras.callbacks.TensorBoard(log_dir='./logs') needs TensorFlow (tensorflow.summary): without it,
      # CSVLogger writes the per-epoch logs to the logs directory (see the module docstring).
      keras.callbacks.CSVLogger(os.path.join(log_dir, "training.csv")),
      keras.callbacks.ModelCheckpoint(filepath=checkpoint_prefix, save_weights_only=True),
      keras.callbacks.LearningRateScheduler(decay),
      print_lr,
  ]

  # Train and evaluate
  EPOCHS = epochs  # noqa: N806
  history = model.fit(train_dataset, epochs=EPOCHS, callbacks=callbacks, verbose=keras_verbose)
  trained_weights = _weights(model)

  checkpoints = sorted(os.listdir(checkpoint_dir))  # !ls {checkpoint_dir}
  say(checkpoints)

  latest_checkpoint = sorted(pathlib.Path(checkpoint_dir).glob("*"))[-1]
  model.load_weights(latest_checkpoint)
  eval_loss, eval_acc = model.evaluate(eval_dataset, verbose=keras_verbose)
  say(f"Eval loss: {eval_loss}, Eval accuracy: {eval_acc}")
  say(sorted(os.listdir(log_dir)))  # !ls -sh ./logs

  # Save the model
  path = os.path.join(workdir, "my_model.keras")
  model.save(path)

  # Load the model without Strategy.scope
  unreplicated_model = keras.models.load_model(path)
  unreplicated_model.compile(
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      optimizer=keras.optimizers.Adam(),
      metrics=["accuracy"])
  unreplicated_eval = unreplicated_model.evaluate(eval_dataset, verbose=keras_verbose)
  say("Eval loss: {}, Eval Accuracy: {}".format(*unreplicated_eval))

  # Load the model with Strategy.scope
  with strategy.scope():
    replicated_model = keras.models.load_model(path)
    replicated_model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             optimizer=keras.optimizers.Adam(),
                             metrics=["accuracy"])
    replicated_eval = replicated_model.evaluate(eval_dataset, verbose=keras_verbose)
    say("Eval loss: {}, Eval Accuracy: {}".format(*replicated_eval))

  return {
      "num_replicas": strategy.num_replicas_in_sync, "batch_size": BATCH_SIZE,
      "history": _history(history), "learning_rates": print_lr.learning_rates, "weights": trained_weights,
      "checkpoints": checkpoints, "logs": sorted(os.listdir(log_dir)),
      "eval": [float(eval_loss), float(eval_acc)],
      "unreplicated_eval": [float(v) for v in unreplicated_eval],
      "replicated_eval": [float(v) for v in replicated_eval],
      "unreplicated_strategy": tpustrat.keras.strategy_of(unreplicated_model),
      "replicated_strategy": tpustrat.keras.strategy_of(replicated_model),
      "unreplicated_devices": _devices(unreplicated_model), "replicated_devices": _devices(replicated_model),
  }


# -- The check: the same training on one device, with plain Keras ----------------------------------------

def one_device(*, epochs: int, batch_size: int, num_train_examples: int, num_test_examples: int) -> dict[str, Any]:
  """The tutorial's model trained with plain Keras on one device, outside any scope: the same seed, the
  same global batches in the same order, the same learning-rate schedule."""
  mnist_train, mnist_test = load_mnist(num_train_examples, num_test_examples)
  train_dataset, eval_dataset = make_datasets(tpustrat.get_strategy(), mnist_train, mnist_test, batch_size)
  model = build_model()
  compile_model(model)
  history = model.fit(train_dataset, epochs=epochs, callbacks=[keras.callbacks.LearningRateScheduler(decay)],
                      verbose=0)
  return {"history": _history(history), "weights": _weights(model),
          "eval": [float(v) for v in model.evaluate(eval_dataset, verbose=0)]}


def check_one_device(result: dict[str, Any], reference: dict[str, Any], rtol: float = 1e-5) -> None:
  """Asserts that the tutorial on the strategy trained as one device did: every epoch's loss, accuracy and
  learning rate, the final weights (atol scaled by each array's magnitude: an optimizer step rounds relative
  to what it adds up) and the evaluations (restored, unreplicated, replicated)."""
  assert set(result["history"]) == set(reference["history"]), (result["history"], reference["history"])
  for name, values in reference["history"].items():
    np.testing.assert_allclose(result["history"][name], values, rtol=rtol, atol=rtol, err_msg=name)
  assert len(result["weights"]) == len(reference["weights"])
  for i, (mine, theirs) in enumerate(zip(result["weights"], reference["weights"])):
    np.testing.assert_allclose(mine, theirs, rtol=rtol, atol=rtol * (np.abs(theirs).max() + 1.0),
                               err_msg=f"weight {i}")
  for name in ("eval", "unreplicated_eval", "replicated_eval"):
    np.testing.assert_allclose(result[name], reference["eval"], rtol=rtol, atol=rtol, err_msg=name)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--epochs", type=int, default=4, help="the tutorial's EPOCHS (12 there)")
  parser.add_argument("--batch-size-per-replica", type=int, default=8, help="64 in the tutorial")
  parser.add_argument("--num-train-examples", type=int, default=236,
                      help="not a multiple of the global batch: the last batch of each epoch is partial")
  parser.add_argument("--num-test-examples", type=int, default=100)
  parser.add_argument("--workdir", default=None, help="the checkpoints, logs and saved model (default: a "
                      "temporary directory, removed at the end)")
  parser.add_argument("--no-check", action="store_true", help="skip the one-device comparison")
  parser.add_argument("--quiet", action="store_true", help="no progress bars or prints")
  parser.add_argument("--json", action="store_true", help="print the results as one JSON line")
  args = parser.parse_args(argv)
  strategy = tpustrat.MirroredStrategy()
  owned = args.workdir is None
  workdir = args.workdir or tempfile.mkdtemp(prefix="keras_fit_")
  # The comparison with one device at full float32 precision: a GPU's default TF32 matrix products would
  # put the two sides ~1e-3 apart (a no-op on the CPU).
  precision = jax.default_matmul_precision("float32") if not args.no_check else contextlib.nullcontext()
  with keras_grain_warnings_off(), precision:
    try:
      result = tutorial(strategy, workdir, epochs=args.epochs, batch_size_per_replica=args.batch_size_per_replica,
                        num_train_examples=args.num_train_examples, num_test_examples=args.num_test_examples,
                        verbose=not args.quiet)
    finally:
      if owned:
        shutil.rmtree(workdir, ignore_errors=True)
    if not args.no_check:
      result["one_device"] = one_device(epochs=args.epochs, batch_size=result["batch_size"],
                                        num_train_examples=args.num_train_examples,
                                        num_test_examples=args.num_test_examples)
  if not args.no_check:
    check_one_device(result, result["one_device"])
    if not args.quiet:
      print("The same as one device: every epoch's loss and accuracy, the weights, the evaluations.")
  if args.json:
    print(json.dumps({k: v for k, v in result.items() if k in ("history", "learning_rates", "eval",
                                                                 "unreplicated_eval", "replicated_eval")}))
  return result


if __name__ == "__main__":
  main()
