"""TF's "Custom training with tf.distribute.Strategy" tutorial, ported to tpustrat.

The original: https://www.tensorflow.org/tutorials/distribute/custom_training (source: github.com/tensorflow/
docs, ``site/en/tutorials/distribute/custom_training.ipynb``). It trains a Fashion-MNIST CNN with
`MirroredStrategy`: a `tf.data` dataset batched by the global batch size (the last batch partial),
`compute_loss` with `tf.nn.compute_average_loss` and `tf.nn.scale_regularization_loss` for the layers' L2
regularizers, a `distributed_train_step` that runs `train_step` with `strategy.run` and sums the replicas'
losses with `strategy.reduce`, a test loop with Keras metrics, a checkpoint every other epoch, and an
evaluation of the restored model without the strategy. This port keeps that structure, name for name; the
model is a flax NNX module and the optimizer optax's Adam. The data are synthetic, of Fashion-MNIST's shapes
(28 x 28 x 1 images in [0, 1], 10 classes, labels a fixed function of the image; no download).

Run it::

    python examples/tf_tutorials/custom_training.py            # 8 emulated CPU devices unless accelerators
    python examples/tf_tutorials/custom_training.py --epochs 10 --train-examples 60000

Side by side
------------
::

  TF (the tutorial)                                        tpustrat (this file)
  -----------------------------------------------------    ----------------------------------------------------
  strategy = tf.distribute.MirroredStrategy()              strategy = tpustrat.MirroredStrategy()
  GLOBAL_BATCH_SIZE = (BATCH_SIZE_PER_REPLICA *            GLOBAL_BATCH_SIZE = (BATCH_SIZE_PER_REPLICA *
      strategy.num_replicas_in_sync)                           strategy.num_replicas_in_sync)
  train_dataset = tf.data.Dataset.from_tensor_slices(      train_dataset = strategy.experimental_make_numpy_
      (train_images, train_labels)).shuffle(                   dataset((train_images, train_labels)).shuffle(
      BUFFER_SIZE).batch(GLOBAL_BATCH_SIZE)                    seed=SEED).batch(GLOBAL_BATCH_SIZE)  # grain
  train_dist_dataset = strategy.                           train_dist_dataset = strategy.
      experimental_distribute_dataset(train_dataset)           experimental_distribute_dataset(train_dataset)
  def create_model():                                      class CNN(nnx.Module): ...  # the same layers
    regularizer = tf.keras.regularizers.L2(1e-5)             # L2(1e-5) on every kernel: model_losses(params)
    ...Conv2D(32, 3), MaxPooling2D(), Conv2D(64, 3),
    MaxPooling2D(), Flatten(), Dense(64), Dense(10)
  with strategy.scope():                                   with strategy.scope():
    loss_object = tf.keras.losses.                           def loss_object(labels, predictions):
      SparseCategoricalCrossentropy(from_logits=True,          return optax.softmax_cross_entropy_with_
        reduction=tf.keras.losses.Reduction.NONE)                integer_labels(predictions, labels)
    def compute_loss(labels, predictions, model_losses):     def compute_loss(labels, predictions, model_losses):
      per_example_loss = loss_object(labels, predictions)      per_example_loss = loss_object(labels, predictions)
      loss = tf.nn.compute_average_loss(per_example_loss)      loss = tpustrat.compute_average_loss(per_example_loss)
      if model_losses:                                         if model_losses is not None:
        loss += tf.nn.scale_regularization_loss(                 loss += tpustrat.scale_regularization_loss(
            tf.add_n(model_losses))                                  model_losses)
      return loss                                              return loss
  with strategy.scope():                                   with strategy.scope():
    model = create_model()                                   graphdef, params = nnx.split(create_model(SEED))
    optimizer = tf.keras.optimizers.Adam(0.001)              optimizer = optax.adam(0.001)
    checkpoint = tf.train.Checkpoint(optimizer=optimizer,    state = {"params": params,
                                     model=model)                     "opt_state": optimizer.init(params)}
                                                             manager = tpustrat.checkpoint.CheckpointManager(
                                                                 checkpoint_dir, strategy)
  def train_step(inputs):                                  def train_step(state, inputs):
    images, labels = inputs                                  images, labels = inputs
    with tf.GradientTape() as tape:                          def loss_fn(params):
      predictions = model(images, training=True)               predictions = nnx.merge(graphdef, params)(images)
      loss = compute_loss(labels, predictions,                 loss = compute_loss(labels, predictions,
                          model.losses)                                            model_losses(params))
                                                               return loss, predictions
    gradients = tape.gradient(                               (loss, predictions), gradients = jax.value_and_grad(
        loss, model.trainable_variables)                         loss_fn, has_aux=True)(state["params"])
    optimizer.apply_gradients(zip(                           # gradients: already summed over the replicas
        gradients, model.trainable_variables))               updates, opt_state = optimizer.update(
                                                                 gradients, state["opt_state"], state["params"])
    train_accuracy.update_state(labels, predictions)         correct = accuracy_count(labels, predictions)
    return loss                                              return {"params": optax.apply_updates(...),
                                                                     "opt_state": opt_state}, loss, correct
  @tf.function                                             def distributed_train_step(state, dataset_inputs):
  def distributed_train_step(dataset_inputs):                state, per_replica_losses, correct = strategy.run(
    per_replica_losses = strategy.run(train_step,                train_step, args=(state, dataset_inputs))
                                      args=(dataset_inputs,))  return state, strategy.reduce(
    return strategy.reduce(tf.distribute.ReduceOp.SUM,           tpustrat.ReduceOp.SUM, per_replica_losses,
                           per_replica_losses, axis=None)        axis=None), correct
  for epoch in range(EPOCHS):                              for epoch in range(EPOCHS):
    for x in train_dist_dataset:                             for x in train_dist_dataset:
      total_loss += distributed_train_step(x)                  state, loss, correct = distributed_train_step(
      num_batches += 1                                             state, x)
    for x in test_dist_dataset:                              for x in test_dist_dataset:
      distributed_test_step(x)                                 strategy.run(test_step, args=(params, x))
    if epoch % 2 == 0:                                       if epoch % 2 == 0:
      checkpoint.save(checkpoint_prefix)                       manager.save(epoch, state)
  new_model = create_model()                               # without the strategy: the default one
  checkpoint.restore(                                      restored = manager.restore(target=template)
      tf.train.latest_checkpoint(checkpoint_dir))
  for images, labels in test_dataset:                      for images, labels in test_batches:
    eval_step(images, labels)                                eval_step(restored["params"], images, labels)

What changes, and why: the model's variables are a state pytree that goes into the step and comes back;
`jax.value_and_grad` w.r.t. the replicated parameters returns gradients already summed over the replicas
(TF's `apply_gradients` sums them); metrics are step outputs, summed by `strategy.reduce` on the host. The
last training batch is partial: TF hands each replica fewer rows, tpustrat pads them, and
`tpustrat.compute_average_loss` leaves the padding out (its default denominator is then the real examples
of the global batch), as the metrics do with `tpustrat.valid_mask`.
"""

from __future__ import annotations

import os

# Emulate 8 devices when JAX runs on the CPU (harmless on a TPU VM or GPU machine); this must happen
# before JAX initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import tpustrat  # noqa: E402

L2 = 1e-5  # the tutorial's tf.keras.regularizers.L2(1e-5) on every kernel


class CNN(nnx.Module):
  """The tutorial's `create_model()`: Conv2D(32, 3) + MaxPooling2D, Conv2D(64, 3) + MaxPooling2D, Flatten,
  Dense(64), Dense(10), ReLU between; Keras's "valid" padding and 2 x 2 pooling."""

  def __init__(self, rngs: nnx.Rngs) -> None:
    self.conv1 = nnx.Conv(1, 32, (3, 3), padding="VALID", rngs=rngs)
    self.conv2 = nnx.Conv(32, 64, (3, 3), padding="VALID", rngs=rngs)
    self.dense = nnx.Linear(5 * 5 * 64, 64, rngs=rngs)
    self.head = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.max_pool(jax.nn.relu(self.conv1(x)), (2, 2), (2, 2))
    x = nnx.max_pool(jax.nn.relu(self.conv2(x)), (2, 2), (2, 2))
    return self.head(jax.nn.relu(self.dense(x.reshape(x.shape[0], -1))))


@nnx.jit  # one compiled program, rather than one small compilation per initialiser op run eagerly
def _create_model(rngs: nnx.Rngs) -> CNN:
  return CNN(rngs)


def create_model(seed: int) -> CNN:
  return _create_model(nnx.Rngs(seed))


def model_losses(params: Any) -> jax.Array:
  """`model.losses`: the L2 penalty of every kernel (Keras adds ``l2 * sum(kernel ** 2)`` per layer)."""
  return sum(L2 * jnp.sum(jnp.square(leaf)) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
             if "kernel" in jax.tree_util.keystr(path))


def loss_object(labels: jax.Array, predictions: jax.Array) -> jax.Array:
  """`SparseCategoricalCrossentropy(from_logits=True, reduction=NONE)`: one loss per example."""
  return optax.softmax_cross_entropy_with_integer_labels(predictions, labels)


def compute_loss(labels: jax.Array, predictions: jax.Array, model_losses: jax.Array | None) -> jax.Array:
  """The tutorial's `compute_loss`, line for line."""
  per_example_loss = loss_object(labels, predictions)
  loss = tpustrat.compute_average_loss(per_example_loss)
  if model_losses is not None:
    loss += tpustrat.scale_regularization_loss(model_losses)
  return loss


def accuracy_count(labels: jax.Array, predictions: jax.Array) -> jax.Array:
  """`SparseCategoricalAccuracy.update_state`: the correct predictions among this replica's real rows."""
  hit = (jnp.argmax(predictions, -1) == labels) & tpustrat.valid_mask(labels)
  return jnp.sum(hit.astype(jnp.int32))


def load_data(train_examples: int, test_examples: int, seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray],
                                                                                 tuple[np.ndarray, np.ndarray]]:
  """Synthetic Fashion-MNIST: ``[n, 28, 28, 1]`` float32 images in [0, 1] and int32 labels in [0, 10), the
  label a fixed linear function of the image (learnable): ``(train, test)``."""
  rng = np.random.default_rng(seed)
  projection = rng.normal(size=(28 * 28, 10)).astype(np.float32)

  def make(n: int) -> tuple[np.ndarray, np.ndarray]:
    images = rng.uniform(size=(n, 28, 28, 1)).astype(np.float32)
    labels = np.argmax(images.reshape(n, -1) @ projection, axis=-1).astype(np.int32)
    return images, labels

  return make(train_examples), make(test_examples)


def make_dataset(strategy: Any, data: tuple[np.ndarray, np.ndarray], global_batch_size: int,
                 shuffle_seed: int | None) -> Any:
  """The tutorial's `tf.data.Dataset.from_tensor_slices(...).shuffle(...).batch(GLOBAL_BATCH_SIZE)`, as a
  grain `MapDataset` (the last batch partial, as in the tutorial)."""
  dataset = strategy.experimental_make_numpy_dataset(data)
  if shuffle_seed is not None:
    dataset = dataset.shuffle(seed=shuffle_seed)
  return dataset.batch(global_batch_size)


def train(strategy: Any, *, epochs: int = 2, batch_size_per_replica: int = 8, global_batch_size: int | None = None,
          train_examples: int = 200, test_examples: int = 64, learning_rate: float = 0.001, seed: int = 0,
          checkpoint_dir: str | None = None) -> dict[str, Any]:
  """The tutorial on `strategy`; returns each epoch's training loss (the mean of the steps' summed
  losses, as the tutorial prints it), every step's loss, the test loss and accuracy per epoch, and the
  accuracy of the restored model evaluated without the strategy."""
  # The tutorial's GLOBAL_BATCH_SIZE (given explicitly to compare replica counts on the same batches).
  GLOBAL_BATCH_SIZE = global_batch_size or batch_size_per_replica * strategy.num_replicas_in_sync  # noqa: N806
  train_data, test_data = load_data(train_examples, test_examples, seed)
  train_dataset = make_dataset(strategy, train_data, GLOBAL_BATCH_SIZE, shuffle_seed=seed)
  test_dataset = make_dataset(strategy, test_data, GLOBAL_BATCH_SIZE, shuffle_seed=None)
  train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
  test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

  with strategy.scope():
    graphdef, params = nnx.split(create_model(seed))
    optimizer = optax.adam(learning_rate)
    state = {"params": params, "opt_state": optimizer.init(params)}

  def train_step(state, inputs):
    images, labels = inputs

    def loss_fn(params):
      predictions = nnx.merge(graphdef, params)(images)
      loss = compute_loss(labels, predictions, model_losses(params))
      return loss, predictions

    (loss, predictions), gradients = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    # The gradients w.r.t. the replicated parameters come back summed over the replicas (TF's
    # apply_gradients sums them): apply them as they are.
    updates, opt_state = optimizer.update(gradients, state["opt_state"], state["params"])
    new_state = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    return new_state, loss, accuracy_count(labels, predictions)

  def test_step(params, inputs):
    images, labels = inputs
    predictions = nnx.merge(graphdef, params)(images)
    t_loss = jnp.where(tpustrat.valid_mask(labels), loss_object(labels, predictions), 0.0)
    return jnp.sum(t_loss), accuracy_count(labels, predictions)

  def distributed_train_step(state, dataset_inputs):
    state, per_replica_losses, correct = strategy.run(train_step, args=(state, dataset_inputs))
    return (state, strategy.reduce(tpustrat.ReduceOp.SUM, per_replica_losses, axis=None),
            strategy.reduce(tpustrat.ReduceOp.SUM, correct, axis=None))

  owned = checkpoint_dir is None
  checkpoint_dir = checkpoint_dir or tempfile.mkdtemp(prefix="custom_training_")
  manager = tpustrat.checkpoint.CheckpointManager(checkpoint_dir, strategy)
  history: dict[str, Any] = {"train_loss": [], "step_losses": [], "train_accuracy": [], "test_loss": [],
                             "test_accuracy": []}
  try:
    for epoch in range(epochs):
      total_loss, num_batches, total_correct = 0.0, 0, 0
      for x in train_dist_dataset:  # TRAIN LOOP
        state, loss, correct = distributed_train_step(state, x)
        history["step_losses"].append(float(loss))
        total_loss += float(loss)
        total_correct += int(correct)
        num_batches += 1
      history["train_loss"].append(total_loss / num_batches)
      history["train_accuracy"].append(total_correct / len(train_data[0]))
      test_loss, test_correct = 0.0, 0
      for x in test_dist_dataset:  # TEST LOOP
        loss_sum, correct = strategy.run(test_step, args=(state["params"], x))
        test_loss += float(strategy.reduce("sum", loss_sum, axis=None))
        test_correct += int(strategy.reduce("sum", correct, axis=None))
      history["test_loss"].append(test_loss / len(test_data[0]))
      history["test_accuracy"].append(test_correct / len(test_data[0]))
      if epoch % 2 == 0:
        manager.save(epoch, state)
    manager.wait_until_finished()

    # Restore the last checkpoint without the strategy (the default strategy: one device) and evaluate.
    # The values, whole, on the host (a Mirrored converts like its value).
    template = jax.tree.map(np.asarray, state, is_leaf=lambda v: isinstance(v, tpustrat.Mirrored))
    restored = tpustrat.checkpoint.CheckpointManager(checkpoint_dir).restore(target=template)
    new_model = nnx.merge(graphdef, restored["params"])
    images, labels = test_data
    history["restored_accuracy"] = float(np.mean(np.argmax(np.asarray(new_model(images)), -1) == labels))
  finally:
    manager.close()
    if owned:
      shutil.rmtree(checkpoint_dir, ignore_errors=True)
  history["num_replicas"] = strategy.num_replicas_in_sync
  history["global_batch_size"] = GLOBAL_BATCH_SIZE
  return history


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--batch-size-per-replica", type=int, default=8)
  parser.add_argument("--train-examples", type=int, default=200)
  parser.add_argument("--test-examples", type=int, default=64)
  parser.add_argument("--json", action="store_true", help="print the history as one JSON line")
  args = parser.parse_args(argv)
  strategy = tpustrat.MirroredStrategy()
  print(f"Number of devices: {strategy.num_replicas_in_sync}")
  history = train(strategy, epochs=args.epochs, batch_size_per_replica=args.batch_size_per_replica,
                  train_examples=args.train_examples, test_examples=args.test_examples)
  if args.json:
    print(json.dumps({k: v for k, v in history.items()}))
  else:
    for epoch in range(args.epochs):
      print(f"Epoch {epoch + 1}, Loss: {history['train_loss'][epoch]:.4f}, "
            f"Accuracy: {100 * history['train_accuracy'][epoch]:.2f}, Test Loss: {history['test_loss'][epoch]:.4f}, "
            f"Test Accuracy: {100 * history['test_accuracy'][epoch]:.2f}")
    print(f"Accuracy after restoring the saved model without strategy: {100 * history['restored_accuracy']:.2f}")
  return history


if __name__ == "__main__":
  main()
