"""TF's "Custom training loop with Keras and MultiWorkerMirroredStrategy" tutorial, ported to tpustrat.

The original: https://www.tensorflow.org/tutorials/distribute/multi_worker_with_ctl (source:
github.com/tensorflow/docs, ``site/en/tutorials/distribute/multi_worker_with_ctl.ipynb``). It trains a small
MNIST CNN on two workers with `MultiWorkerMirroredStrategy`: `dataset_fn(input_context)` through
`distribute_datasets_from_function` (one input pipeline per worker, sharded), a `train_step` that runs
`step_fn` with `strategy.run` and sums the replicas' losses with `strategy.reduce`, a checkpoint per epoch
written through `write_filepath` / `_is_chief`, and `strategy.cluster_resolver`'s `task_type`, `task_id`
and `cluster_spec()` to tell the chief from the others. This port keeps that structure, name for name.
The data are synthetic, of MNIST's shapes (28 x 28 images in [0, 1], 10 classes; no download).

Run it as the tutorial runs its two workers, on one machine, through the launcher (2 processes of 4 CPU
devices)::

    python -m tpustrat.launch -n 2 -d 4 examples/tf_tutorials/multi_worker_ctl.py

or with ``TF_CONFIG``, as the tutorial does, one shell per worker (``"index": 1`` in the second; the other
variables give each process 4 CPU devices and CPU collectives between processes, as the launcher does)::

    export JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=4 JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]},
                "task": {"type": "worker", "index": 0}}' python examples/tf_tutorials/multi_worker_ctl.py

or alone (one process, every local device): ``python examples/tf_tutorials/multi_worker_ctl.py``.

Side by side
------------
::

  TF (the tutorial)                                        tpustrat (this file)
  -----------------------------------------------------    ----------------------------------------------------
  strategy = tf.distribute.MultiWorkerMirroredStrategy()   strategy = tpustrat.MultiWorkerMirroredStrategy()
    # reads TF_CONFIG                                        # the connected job; else TF_CONFIG (as TF), else
                                                             # the launcher's TPUSTRAT_* variables
  with strategy.scope():                                   with strategy.scope():
    multi_worker_model = mnist.build_cnn_model()             params = build_cnn_model(seed)       # a pytree
    multi_worker_dataset = strategy.                         multi_worker_dataset = strategy.
      distribute_datasets_from_function(                       distribute_datasets_from_function(
        lambda ctx: mnist.dataset_fn(global_bs, ctx))            lambda ctx: dataset_fn(global_bs, ctx, ...))
    optimizer = tf.keras.optimizers.RMSprop(0.001)           optimizer = optax.rmsprop(0.001, ...)  # Keras's
    train_accuracy = SparseCategoricalAccuracy()             # accuracy: correct counts summed by reduce
  dataset.shard(n, input_pipeline_id).batch(bs)            shard = x[input_pipeline_id::n]; batches of bs
  @tf.function                                             def train_step(state, iterator):
  def train_step(iterator):                                  ...
    def step_fn(inputs):                                       def step_fn(state, inputs):  (module level)
      with tf.GradientTape() as tape:                            jax.value_and_grad(loss_fn)(params)
        loss = tf.nn.compute_average_loss(                         loss = tpustrat.compute_average_loss(
          per_batch_loss, global_batch_size=gbs)                     per_batch_loss, global_batch_size=gbs)
      grads = tape.gradient(loss, model.trainable_vars)          # grads: already summed over replicas
      optimizer.apply_gradients(zip(grads, vars))                optimizer.update(grads, opt_state, params)
    per_replica_losses = strategy.run(                       state, per_replica_losses, correct = strategy.run(
        step_fn, args=(next(iterator),))                         step_fn, args=(state, next(iterator)))
    return strategy.reduce(SUM, per_replica_losses,          return state, strategy.reduce(SUM,
                           axis=None)                                           per_replica_losses, axis=None)
  task_type, task_id, cluster_spec = (                     task_type, task_id, cluster_spec = (
      strategy.cluster_resolver.task_type,                     strategy.cluster_resolver.task_type,
      strategy.cluster_resolver.task_id,                       strategy.cluster_resolver.task_id,
      strategy.cluster_resolver.cluster_spec())                strategy.cluster_resolver.cluster_spec())
  write_checkpoint_dir = write_filepath(                   manager = tpustrat.checkpoint.CheckpointManager(
      checkpoint_dir, task_type, task_id, cluster_spec)        checkpoint_dir, strategy, max_to_keep=1)
  checkpoint_manager = tf.train.CheckpointManager(           # the same directory in every process
      checkpoint, directory=write_checkpoint_dir, ...)
  latest = tf.train.latest_checkpoint(checkpoint_dir)      if manager.latest_step() is not None:
  if latest: checkpoint.restore(latest)                      state = manager.restore(target=state)
  while epoch.numpy() < num_epochs:                        while epoch < num_epochs:
    iterator = iter(multi_worker_dataset)                    iterator = iter(multi_worker_dataset)
    while step_in_epoch.numpy() < num_steps_per_epoch:       for step_in_epoch in range(num_steps_per_epoch):
      total_loss += train_step(iterator)                       state, loss = train_step(state, iterator)
    checkpoint_manager.save()                                manager.save(epoch + 1, {... "epoch": epoch + 1})
    if not _is_chief(...): tf.io.gfile.rmtree(write_dir)

What changes
------------
* The model is a pytree of arrays and `step_fn` is a function of the state (JAX is functional): the state goes
  into `strategy.run` and comes back `Mirrored`. `jax.grad` with respect to `Mirrored` parameters is already
  the sum over every replica of every worker, which is what TF's `apply_gradients` all-reduces: the update
  applies it as it is.
* Checkpoints: TF has every worker save a checkpoint of its own, the chief into `checkpoint_dir` and the
  others into a temporary directory they delete (`write_filepath`, `_is_chief`). tpustrat's
  `CheckpointManager` writes one checkpoint that every process writes its part of: each process passes the
  same `checkpoint_dir` (a directory per process would leave each checkpoint incomplete). `_is_chief` stays,
  to choose the process that prints.
* The tutorial saves ``epoch`` with the epoch's ``step_in_epoch`` already at its end, so a restarted job
  divides by zero batches at its first epoch; the port saves ``epoch + 1`` with the state, and a restarted
  job resumes at the next epoch.
* Keras's RMSprop is `optax.rmsprop(lr, decay=0.9, eps=1e-7, eps_in_sqrt=False)` (``var -= lr * g /
  (sqrt(v) + eps)``, ``v`` from zero); Keras's default initializers (Glorot uniform kernels, zero biases)
  are written out in `build_cnn_model`.
* The per-worker batch is every local replica's batch: with 4 devices per process, ``dataset_fn``'s batches
  are ``per_worker_batch_size / 4`` rows (`InputContext.get_per_replica_batch_size`), as in TF.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import tpustrat

NUM_CLASSES = 10
IMAGE = (28, 28)


# -- mnist.py -------------------------------------------------------------------------------------------


def mnist_dataset(num_examples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Synthetic MNIST of `num_examples` images: uint8 pixels scaled to [0, 1] (float32), int64 labels that a
  fixed linear map of the pixels decides (so that there is something to learn). The same arrays in every
  process (a fixed seed), as the tutorial's download is."""
  rng = np.random.default_rng(seed)
  x_train = rng.integers(0, 256, size=(num_examples,) + IMAGE, dtype=np.uint8)
  x_train = x_train / np.float32(255)
  w = np.random.default_rng(seed + 1).standard_normal((IMAGE[0] * IMAGE[1], NUM_CLASSES)).astype(np.float32)
  y_train = np.argmax((x_train.reshape(num_examples, -1) - 0.5) @ w, axis=1).astype(np.int64)
  return x_train.astype(np.float32), y_train


def dataset_fn(global_batch_size: int, input_context: tpustrat.InputContext, num_examples: int,
               seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
  """The tutorial's `dataset_fn`: this worker's shard (`dataset.shard(num_input_pipelines,
  input_pipeline_id)`), in per-replica batches (`.batch(batch_size)`)."""
  batch_size = input_context.get_per_replica_batch_size(global_batch_size)
  x, y = mnist_dataset(num_examples, seed)
  x = x[input_context.input_pipeline_id::input_context.num_input_pipelines]
  y = y[input_context.input_pipeline_id::input_context.num_input_pipelines]
  return [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(x), batch_size)]


def build_cnn_model(seed: int = 0) -> dict[str, Any]:
  """The tutorial's Sequential model as parameters: Reshape(28, 28, 1), Conv2D(32, 3, relu), Flatten,
  Dense(128, relu), Dense(10); Keras's default initializers (Glorot uniform kernels, zero biases)."""
  rng = np.random.default_rng(seed)

  def glorot(shape: tuple[int, ...], fan_in: int, fan_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)

  flat = (IMAGE[0] - 2) * (IMAGE[1] - 2) * 32
  return {
      "conv": {"kernel": glorot((3, 3, 1, 32), 3 * 3 * 1, 3 * 3 * 32), "bias": np.zeros(32, np.float32)},
      "dense": {"kernel": glorot((flat, 128), flat, 128), "bias": np.zeros(128, np.float32)},
      "logits": {"kernel": glorot((128, NUM_CLASSES), 128, NUM_CLASSES),
                 "bias": np.zeros(NUM_CLASSES, np.float32)},
  }


def apply_model(params: dict[str, Any], x: jax.Array) -> jax.Array:
  """Logits of the CNN for images `x` ``[batch, 28, 28]``."""
  h = lax.conv_general_dilated(x[..., None], params["conv"]["kernel"], (1, 1), "VALID",
                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
  h = jax.nn.relu(h + params["conv"]["bias"])
  h = h.reshape(h.shape[0], -1)
  h = jax.nn.relu(h @ params["dense"]["kernel"] + params["dense"]["bias"])
  return h @ params["logits"]["kernel"] + params["logits"]["bias"]


def make_optimizer() -> optax.GradientTransformation:
  """Keras's `RMSprop(learning_rate=0.001)`: rho 0.9, epsilon 1e-7 outside the square root."""
  return optax.rmsprop(0.001, decay=0.9, eps=1e-7, eps_in_sqrt=False)


# -- main.py --------------------------------------------------------------------------------------------


def _is_chief(task_type: str | None, task_id: int | None, cluster_spec: Any) -> bool:
  """The tutorial's `_is_chief`, unchanged."""
  return (task_type is None
          or task_type == "chief"
          or (task_type == "worker"
              and task_id == 0
              and "chief" not in cluster_spec.as_dict()))


def make_step_fn(global_batch_size: int, optimizer: optax.GradientTransformation):
  """The tutorial's `step_fn` (per replica): the loss, its gradient, the update, and the correct count."""

  def step_fn(state: dict[str, Any], inputs: tuple[jax.Array, jax.Array]):
    x, y = inputs

    def loss_fn(params):
      predictions = apply_model(params, x)
      per_batch_loss = optax.softmax_cross_entropy_with_integer_labels(predictions, y)  # from_logits, NONE
      loss = tpustrat.compute_average_loss(per_batch_loss, global_batch_size=global_batch_size)
      return loss, predictions

    (loss, predictions), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    correct = jnp.sum(jnp.argmax(predictions, axis=-1) == y)  # train_accuracy.update_state(y, predictions)
    return {"params": params, "opt_state": opt_state}, loss, correct

  return step_fn


def train(strategy: tpustrat.Strategy | None = None, *, num_epochs: int = 3, num_steps_per_epoch: int = 10,
          per_worker_batch_size: int = 64, checkpoint_dir: str | None = None, seed: int = 0,
          verbose: bool = True) -> dict[str, Any]:
  """The tutorial's training, on `strategy` (default: ``tpustrat.MultiWorkerMirroredStrategy()``).

  The global batch is ``per_worker_batch_size * num_workers`` (one worker per process), as in the
  tutorial. Returns what the run saw: every step's loss (`strategy.reduce(SUM, per_replica_losses)`), each
  epoch's mean loss and accuracy, the epoch it started from (a restored checkpoint's), and what
  `strategy.cluster_resolver` said (task type and id, the cluster spec, the chief).
  """
  if strategy is None:
    strategy = tpustrat.MultiWorkerMirroredStrategy()
  num_workers = jax.process_count()
  global_batch_size = per_worker_batch_size * num_workers
  num_examples = global_batch_size * num_steps_per_epoch

  with strategy.scope():
    # Model building needs to be within `strategy.scope()` (TF); here it makes no difference.
    params = build_cnn_model(seed)
    multi_worker_dataset = strategy.distribute_datasets_from_function(
        lambda input_context: dataset_fn(global_batch_size, input_context, num_examples, seed))
    optimizer = make_optimizer()
  state = strategy.experimental_mirror({"params": params, "opt_state": optimizer.init(params)})
  step_fn = make_step_fn(global_batch_size, optimizer)  # one function object: compiled once

  def train_step(state, iterator):
    """Training step function (the tutorial's `@tf.function train_step`)."""
    state, per_replica_losses, correct = strategy.run(step_fn, args=(state, next(iterator)))
    return (state, strategy.reduce(tpustrat.ReduceOp.SUM, per_replica_losses, axis=None),
            strategy.reduce(tpustrat.ReduceOp.SUM, correct, axis=None))

  task_type, task_id, cluster_spec = (strategy.cluster_resolver.task_type,
                                      strategy.cluster_resolver.task_id,
                                      strategy.cluster_resolver.cluster_spec())
  chief = _is_chief(task_type, task_id, cluster_spec)

  epoch = 0
  manager = None
  if checkpoint_dir is not None:
    # One checkpoint, which every process writes its part of: the same directory everywhere.
    manager = tpustrat.checkpoint.CheckpointManager(checkpoint_dir, strategy, max_to_keep=1)
    if manager.latest_step() is not None:  # tf.train.latest_checkpoint(checkpoint_dir)
      restored = manager.restore(target={**state, "epoch": np.int32(0)})
      epoch = int(np.asarray(restored.pop("epoch")))
      state = restored
  start_epoch = epoch

  step_losses: list[float] = []
  epoch_losses: list[float] = []
  accuracies: list[float] = []
  while epoch < num_epochs:
    iterator = iter(multi_worker_dataset)
    total_loss = 0.0
    total_correct = 0
    num_batches = 0
    for _ in range(num_steps_per_epoch):  # step_in_epoch
      state, loss, correct = train_step(state, iterator)
      step_losses.append(float(loss))
      total_loss += float(loss)
      total_correct += int(correct)
      num_batches += 1
    train_loss = total_loss / num_batches
    accuracy = total_correct / (num_batches * global_batch_size)
    epoch_losses.append(train_loss)
    accuracies.append(accuracy)
    if verbose and chief:
      print(f"Epoch: {epoch}, accuracy: {accuracy:f}, train_loss: {train_loss:f}.", flush=True)
    if manager is not None:
      manager.save(epoch + 1, {**state, "epoch": np.int32(epoch + 1)})
    epoch += 1
  if manager is not None:
    manager.close()
  return {"step_losses": step_losses, "epoch_losses": epoch_losses, "accuracies": accuracies,
          "start_epoch": start_epoch, "task_type": task_type, "task_id": task_id,
          "cluster_spec": cluster_spec.as_dict(), "is_chief": chief,
          "resolver": type(strategy.cluster_resolver).__name__,
          "num_replicas_in_sync": strategy.num_replicas_in_sync}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains as the tutorial's `main.py` does, with small defaults; ``--json`` prints a ``RESULT`` line."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num-epochs", type=int, default=3)
  parser.add_argument("--num-steps-per-epoch", type=int, default=10)
  parser.add_argument("--per-worker-batch-size", type=int, default=64)
  parser.add_argument("--checkpoint-dir", default=None, help="the same directory for every process")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", action="store_true", help="print the run's results as one RESULT line")
  args = parser.parse_args(argv)
  result = train(num_epochs=args.num_epochs, num_steps_per_epoch=args.num_steps_per_epoch,
                 per_worker_batch_size=args.per_worker_batch_size, checkpoint_dir=args.checkpoint_dir,
                 seed=args.seed, verbose=not args.json)
  if args.json:
    print("RESULT " + json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
