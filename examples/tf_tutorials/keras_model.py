"""A tf.keras-style convnet (Conv2D, BatchNormalization, Dropout, regularizers) in Keras 3, trained in
`strategy.run` with Keras's stateless API: the Keras port of TF's custom-training tutorial.

The originals: TF's "Custom training with tf.distribute.Strategy"
(https://www.tensorflow.org/tutorials/distribute/custom_training; source github.com/tensorflow/docs,
``site/en/tutorials/distribute/custom_training.ipynb``) for the distributed loop (`compute_loss` with
`tf.nn.compute_average_loss` and `tf.nn.scale_regularization_loss`, `train_step` run by `strategy.run`,
`strategy.reduce` of the losses), and Keras's "Writing a training loop from scratch in JAX"
(https://keras.io/guides/writing_a_custom_training_loop_in_jax/) for running the same Keras model on JAX
(`model.stateless_call`, `optimizer.stateless_apply`). The model is the tutorial's tf.keras convnet with
a batch norm after each convolution (TF's `SyncBatchNormalization` where asked) and Dropout before the
classifier; it stays a `keras.Sequential`, unchanged. The data are synthetic, of Fashion-MNIST's shapes
made smaller by default (no download).

Run it::

    KERAS_BACKEND=jax python examples/tf_tutorials/keras_model.py     # 8 emulated CPU devices
    KERAS_BACKEND=jax python examples/tf_tutorials/keras_model.py --image-size 28 --epochs 3 --sync-bn

Side by side
------------
::

  TF (tf.keras under a strategy)                          tpustrat (this file; Keras 3 on JAX)
  ----------------------------------------------------    -----------------------------------------------------
  strategy = tf.distribute.MirroredStrategy()             strategy = tpustrat.MirroredStrategy()
  with strategy.scope():                                  model = build_model(...)     # the same Sequential
    model = build_model(...)                              optimizer = keras.optimizers.Adam(LR)
    optimizer = tf.keras.optimizers.Adam(LR)              state = strategy.experimental_mirror(
                                                              tpustrat.keras.state(model, optimizer))
  def compute_loss(labels, predictions, model_losses):    def compute_loss(labels, predictions, model_losses):
    per_example_loss = loss_object(labels, predictions)     per_example_loss = loss_object(labels, predictions)
    loss = tf.nn.compute_average_loss(per_example_loss)     loss = tpustrat.compute_average_loss(per_example_loss)
    loss += tf.nn.scale_regularization_loss(                loss += tpustrat.scale_regularization_loss(
        tf.add_n(model_losses))                                 sum(model_losses))
    return loss                                             return loss
  def train_step(inputs):                                 def train_step(state, inputs):
    images, labels = inputs                                 images, labels = inputs
    with tf.GradientTape() as tape:                         def loss_fn(trainable, non_trainable):
      predictions = model(images, training=True)              predictions, non_trainable, losses = (
                                                                  tpustrat.keras.stateless_call(model,
                                                                  trainable, non_trainable, images,
                                                                  training=True))
      loss = compute_loss(labels, predictions,                return compute_loss(labels, predictions,
                          model.losses)                                           losses), non_trainable
    gradients = tape.gradient(loss,                         (loss, non_trainable), gradients = (
        model.trainable_variables)                              jax.value_and_grad(loss_fn, has_aux=True)(
                                                                state["trainable"], state["non_trainable"]))
    optimizer.apply_gradients(zip(gradients,                trainable, opt = optimizer.stateless_apply(
        model.trainable_variables))                             state["optimizer"], gradients, state["trainable"])
    return loss                                             return {...new state...}, loss
  @tf.function                                            def distributed_train_step(state, dataset_inputs):
  def distributed_train_step(dataset_inputs):               state, per_replica_losses = strategy.run(
    per_replica_losses = strategy.run(                          train_step, args=(state, dataset_inputs))
        train_step, args=(dataset_inputs,))                   return state, strategy.reduce(
    return strategy.reduce(                                     tpustrat.ReduceOp.SUM, per_replica_losses,
        tf.distribute.ReduceOp.SUM,                             axis=None)
        per_replica_losses, axis=None)
  # the model holds its variables                         tpustrat.keras.assign(model, optimizer, state)
  model.save("model.keras")                               model.save("model.keras")

What changes, and why: Keras on JAX is stateless inside a compiled step, so the variables are a state
pytree (`tpustrat.keras.state`) that goes through `strategy.run` and comes back, then is written into the
model (`tpustrat.keras.assign`). The gradients w.r.t. the replicated trainable values are already summed
over the replicas (TF's `apply_gradients` sums them). `tpustrat.keras.stateless_call` gives what TF's
strategy gives a Keras model implicitly: each replica's Dropout draws its own mask (the SeedGenerator state
with the replica id folded in, kept `Mirrored`), and BatchNormalization's moving statistics, computed per
replica, are averaged over the replicas (TF's ON_READ / MEAN); with ``--sync-bn`` the batch norm is
`tpustrat.keras.SyncBatchNormalization`, statistics of the global batch.
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
import json  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import tpustrat  # noqa: E402

try:
  import keras  # noqa: E402
except ImportError as e:  # pragma: no cover - the `keras` extra
  raise SystemExit("this example needs Keras 3: pip install 'tpustrat[keras]'") from e

NUM_CLASSES, L2, LR = 10, 1e-4, 1e-3


def build_model(*, image_size: int = 12, dropout: float = 0.3, sync_bn: bool = False, seed: int = 0) -> Any:
  """The tutorial's tf.keras convnet, with a batch norm after each convolution and Dropout before the
  classifier. `sync_bn`: TF's `SyncBatchNormalization` (global-batch statistics inside `strategy.run`)."""
  keras.utils.set_random_seed(seed)
  bn = tpustrat.keras.SyncBatchNormalization if sync_bn else keras.layers.BatchNormalization
  reg = keras.regularizers.L2(L2)
  return keras.Sequential([
      keras.Input((image_size, image_size, 1)),
      keras.layers.Conv2D(8, 3, use_bias=False, kernel_regularizer=reg), bn(), keras.layers.ReLU(),
      keras.layers.MaxPooling2D(),
      keras.layers.Conv2D(16, 3, use_bias=False, kernel_regularizer=reg), bn(), keras.layers.ReLU(),
      keras.layers.Flatten(),
      keras.layers.Dropout(dropout, seed=seed + 1),
      keras.layers.Dense(32, activation="relu", kernel_regularizer=reg),
      keras.layers.Dense(NUM_CLASSES),
  ])


def load_data(num_examples: int, image_size: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Synthetic images of Fashion-MNIST's kind in [0, 1], labels a fixed function of the image."""
  rng = np.random.default_rng(seed)
  images = rng.uniform(size=(num_examples, image_size, image_size, 1)).astype(np.float32)
  labels = (images[:, ::3, ::3, 0].reshape(num_examples, -1).sum(axis=1) * 3).astype(np.int32) % NUM_CLASSES
  return images, labels


def global_batches(data: tuple[np.ndarray, np.ndarray], global_batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
  images, labels = data
  return [(images[i:i + global_batch_size], labels[i:i + global_batch_size])
          for i in range(0, len(images) - global_batch_size + 1, global_batch_size)]


def train(strategy: Any, *, epochs: int = 2, batch_size_per_replica: int = 4, num_examples: int = 128,
          image_size: int = 12, dropout: float = 0.3, sync_bn: bool = False, seed: int = 0) -> dict[str, Any]:
  """The tutorial's loop on `strategy`: the losses of every step, and the trained model."""
  GLOBAL_BATCH_SIZE = batch_size_per_replica * strategy.num_replicas_in_sync  # noqa: N806 (the tutorial's name)
  model = build_model(image_size=image_size, dropout=dropout, sync_bn=sync_bn, seed=seed)
  optimizer = keras.optimizers.Adam(LR)
  state = strategy.experimental_mirror(tpustrat.keras.state(model, optimizer))
  batches = global_batches(load_data(num_examples, image_size, seed), GLOBAL_BATCH_SIZE)
  train_dist_dataset = strategy.experimental_distribute_dataset(batches)

  def loss_object(labels, predictions):
    return keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)

  def compute_loss(labels, predictions, model_losses):
    per_example_loss = loss_object(labels, predictions)
    loss = tpustrat.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
    if model_losses:
      loss += tpustrat.scale_regularization_loss(sum(model_losses))
    return loss

  def train_step(state, inputs):
    images, labels = inputs

    def loss_fn(trainable, non_trainable):
      predictions, non_trainable, losses = tpustrat.keras.stateless_call(
          model, trainable, non_trainable, images, training=True)
      return compute_loss(labels, predictions, losses), non_trainable

    (loss, non_trainable), gradients = jax.value_and_grad(loss_fn, has_aux=True)(
        state["trainable"], state["non_trainable"])
    trainable, opt = optimizer.stateless_apply(state["optimizer"], gradients, state["trainable"])
    return {"trainable": trainable, "non_trainable": non_trainable, "optimizer": opt}, loss

  def distributed_train_step(state, dataset_inputs):
    state, per_replica_losses = strategy.run(train_step, args=(state, dataset_inputs))
    return state, strategy.reduce(tpustrat.ReduceOp.SUM, per_replica_losses, axis=None)

  losses = []
  for _ in range(epochs):
    for x in train_dist_dataset:
      state, loss = distributed_train_step(state, x)
      losses.append(float(loss))
  tpustrat.keras.assign(model, optimizer, state)  # the trained values back into the Keras model
  return {"losses": losses, "model": model, "state": state, "global_batch_size": GLOBAL_BATCH_SIZE}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--batch-size-per-replica", type=int, default=4)
  parser.add_argument("--num-examples", type=int, default=128)
  parser.add_argument("--image-size", type=int, default=12)
  parser.add_argument("--dropout", type=float, default=0.3)
  parser.add_argument("--sync-bn", action="store_true", help="TF's SyncBatchNormalization")
  parser.add_argument("--save", default=None, help="model.save() the trained model to this .keras file")
  parser.add_argument("--json", action="store_true", help="print the losses as one JSON line")
  args = parser.parse_args(argv)
  strategy = tpustrat.MirroredStrategy()
  print(f"Number of devices: {strategy.num_replicas_in_sync}")
  result = train(strategy, epochs=args.epochs, batch_size_per_replica=args.batch_size_per_replica,
                 num_examples=args.num_examples, image_size=args.image_size, dropout=args.dropout,
                 sync_bn=args.sync_bn)
  if args.save:
    result["model"].save(args.save)
  if args.json:
    print(json.dumps({"losses": result["losses"]}))
  else:
    for i, loss in enumerate(result["losses"]):
      print(f"step {i}: loss {loss:.4f}")
  return result


if __name__ == "__main__":
  main()
