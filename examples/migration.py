r"""Migrating a TF `TPUStrategy` custom training loop to tpustrat: the two programs side by side.

The left column is the custom training loop of TensorFlow's "Use TPUs" guide (a Keras CNN, a distributed
`tf.data` pipeline, `strategy.run` inside a multi-step `tf.function`, Keras metrics). The right column is
its tpustrat twin, which is what this file runs (on scikit-learn's 8x8 digits instead of MNIST, so that it
needs no download). Numbered blocks correspond.

    TensorFlow                                          | tpustrat
    --------------------------------------------------- | ------------------------------------------------------
    # 1. Connect to the TPU; build the strategy.        | # 1. The same calls (jax.distributed underneath).
    resolver = tf.distribute.cluster_resolver \         | resolver = tpustrat.cluster_resolver \
        .TPUClusterResolver(tpu="")                     |     .TPUClusterResolver(tpu="")
    tf.config.experimental_connect_to_cluster(resolver) | tpustrat.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver) | tpustrat.initialize_tpu_system(resolver)
    strategy = tf.distribute.TPUStrategy(resolver)      | strategy = tpustrat.TPUStrategy(resolver)
                                                        |
    # 2. Input: global batches, split over replicas.    | # 2. A grain MapDataset of dicts.
    ds = (tf.data.Dataset                               | ds = (strategy.experimental_make_numpy_dataset(
          .from_tensor_slices((images, labels))         |           {"image": images, "label": labels})
          .shuffle(10_000).repeat()                     |       .shuffle(seed=0).repeat()
          .batch(GLOBAL_BATCH, drop_remainder=True))    |       .batch(GLOBAL_BATCH, drop_remainder=True))
    train_iterator = iter(                              | train_iterator = iter(
        strategy.experimental_distribute_dataset(ds))   |     strategy.experimental_distribute_dataset(ds))
                                                        |
    # 3. Model, optimizer, metrics under the scope.     | # 3. Flax NNX + optax: state is a pytree.
    with strategy.scope():                              | with strategy.scope():
      model = create_model()             # a Keras CNN  |   graphdef, params = nnx.split(CNN(nnx.Rngs(0)))
      optimizer = tf.keras.optimizers.Adam(1e-3)        |   tx = optax.adam(1e-3)
      training_loss = tf.keras.metrics.Mean()           |   state = {"params": params,
      training_accuracy = tf.keras.metrics \            |            "opt_state": tx.init(params)}
          .SparseCategoricalAccuracy()                  |   # metrics: step outputs, summed on the host
                                                        |
    # 4. One replica's step.                            | # 4. State in, state out: no variables.
    def step_fn(inputs):                                | def step_fn(state, inputs):
      images, labels = inputs                           |   images, labels = inputs["image"], inputs["label"]
      with tf.GradientTape() as tape:                   |   def loss_fn(params):
        logits = model(images, training=True)           |     logits = nnx.merge(graphdef, params)(images)
        per_example_loss = tf.keras.losses \            |     per_example_loss = optax \
            .sparse_categorical_crossentropy(           |         .softmax_cross_entropy_with_integer_labels(
                labels, logits, from_logits=True)       |             logits, labels)
        loss = tf.nn.compute_average_loss(              |     loss = jnp.sum(per_example_loss) / GLOBAL_BATCH
            per_example_loss,                           |     return loss, logits
            global_batch_size=GLOBAL_BATCH)             |   (loss, logits), grads = jax.value_and_grad(
      grads = tape.gradient(                            |       loss_fn, has_aux=True)(state["params"])
          loss, model.trainable_variables)              |   # grads are ALREADY summed over replicas
      # apply_gradients all-reduces (sums) the grads    |   updates, opt_state = tx.update(
      optimizer.apply_gradients(                        |       grads, state["opt_state"], state["params"])
          zip(grads, model.trainable_variables))        |   params = optax.apply_updates(
      training_loss.update_state(                       |       state["params"], updates)
          loss * strategy.num_replicas_in_sync)         |   correct = jnp.sum(jnp.argmax(logits, -1) == labels)
      training_accuracy.update_state(labels, logits)    |   metrics = tpustrat.get_replica_context() \
                                                        |       .all_reduce("sum", {"loss": loss,
                                                        |                           "correct": correct})
                                                        |   return {"params": params,
                                                        |           "opt_state": opt_state}, metrics
                                                        |
    # 5. Many steps per program.                        | # 5. Built in: one jit of a lax.scan over the
    @tf.function                                        | #    steps; outputs come back stacked per step.
    def train_multiple_steps(iterator, steps):          | #    strategy.experimental_run_steps(
      for _ in tf.range(steps):                         | #        step_fn, iterator, steps, init=state)
        strategy.run(step_fn, args=(next(iterator),))   |
                                                        |
    # 6. The loop.                                      | # 6. The loop.
    for epoch in range(EPOCHS):                         | for epoch in range(EPOCHS):
      train_multiple_steps(                             |   state, m = strategy.experimental_run_steps(
          train_iterator, tf.convert_to_tensor(STEPS))  |       step_fn, train_iterator, STEPS, init=state)
      print(epoch, training_loss.result().numpy(),      |   m = strategy.experimental_local_results(m)[0]
            training_accuracy.result().numpy())         |   print(epoch, m["loss"].mean(),
      training_loss.reset_states()                      |         m["correct"].sum() / (STEPS * GLOBAL_BATCH))
      training_accuracy.reset_states()                  |
                                                        |
    # 7. Evaluation.                                    | # 7. Evaluation: padded last batch, masked.
    @tf.function                                        | def test_fn(params, inputs):
    def test_step(inputs):                              |   logits = nnx.merge(graphdef, params)(
      def fn(inputs):                                   |       inputs["image"])
        images, labels = inputs                         |   hit = jnp.argmax(logits, -1) == inputs["label"]
        logits = model(images, training=False)          |   return jnp.sum(hit & tpustrat.valid_mask(hit))
        test_accuracy.update_state(labels, logits)      |
      strategy.run(fn, args=(inputs,))                  | correct = 0
                                                        | for inputs in strategy \
    for inputs in strategy \                            |     .experimental_distribute_dataset(test_ds):
        .experimental_distribute_dataset(test_ds):      |   per_replica = strategy.run(
      test_step(inputs)                                 |       test_fn, args=(state["params"], inputs))
    print(test_accuracy.result().numpy())               |   correct += strategy.reduce("sum", per_replica, None)
                                                        | print(correct / len(test_images))

What changes, and why
---------------------
* **Variables become a state pytree.** JAX is functional: parameters and optimizer state go into the step
  and come back out (`state, metrics = step_fn(state, inputs)`). They come back `Mirrored` (replicated,
  on the devices), ready for the next step, without passing through the host.
* **Gradients are already summed.** TF's `tape.gradient` gives each replica its own gradient and
  `apply_gradients` all-reduces them. In tpustrat the parameters enter the step replicated and JAX
  differentiates the whole SPMD program, so `jax.grad` returns the sum over replicas. Apply it directly;
  all-reducing it again would multiply it by the number of replicas. Scale the loss by the global batch
  size as `compute_average_loss` does.
* **Metrics are outputs.** Keras metrics update variables inside the replica context; here the step
  returns its sums (all-reduced: `Mirrored`), and the host adds them up.
* **`tf.function` is implicit.** `strategy.run` and `experimental_run_steps` compile the step on first
  use and reuse the program while the arguments keep their shapes: define `step_fn` once, outside the
  loop. `for _ in tf.range(steps)` becomes `experimental_run_steps` (one `lax.scan` per call).
* **Partial batches are padded, not ragged.** XLA needs static shapes: the last test batch is padded and
  `tpustrat.valid_mask` tells the real rows (TF on TPU needs `drop_remainder=True` or dynamic padding).
* `strategy.reduce`, `experimental_local_results`, `scope`, `experimental_distribute_dataset`, the
  cluster resolver and `initialize_tpu_system` keep their TF names and meaning.

Run it::

    python examples/migration.py                 # 8 emulated CPU devices unless accelerators exist
    python examples/migration.py --epochs 10
"""

from __future__ import annotations

import os

# Emulate 8 devices when JAX runs on the CPU (harmless on a TPU VM or GPU machine); this must happen
# before JAX initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

try:  # packages beyond tpustrat's own: its `examples` extra
  from sklearn.datasets import load_digits  # noqa: E402
  from sklearn.model_selection import train_test_split  # noqa: E402
  from tqdm.auto import tqdm  # noqa: E402
except ImportError as e:
  raise SystemExit(f"{e}. This example needs tpustrat's `examples` extra: "
                   "pip install 'tpustrat[examples]' (in a clone: pip install -e '.[examples]')") from e

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import tpustrat  # noqa: E402


class CNN(nnx.Module):
  """Two 3x3 convolutions and two dense layers: the TF guide's model, scaled to 8x8 images."""

  def __init__(self, rngs: nnx.Rngs) -> None:
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 16, (3, 3), rngs=rngs)
    self.dense = nnx.Linear(8 * 8 * 16, 64, rngs=rngs)
    self.head = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(x))))
    return self.head(jax.nn.relu(self.dense(x.reshape(x.shape[0], -1))))


@nnx.jit  # one compiled program, rather than one small compilation per initialiser op run eagerly
def create_model(rngs: nnx.Rngs) -> CNN:
  return CNN(rngs)


def load_data(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """scikit-learn's digits as ``[n, 8, 8, 1]`` float32 images in [0, 1] and int32 labels: ``(train, test)``."""
  digits = load_digits()
  images = (digits.images[..., None] / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(images, labels, test_size=0.2, random_state=seed,
                                                      stratify=labels)
  return {"image": x_train, "label": y_train}, {"image": x_test, "label": y_test}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--global-batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quiet", action="store_true", help="no progress bar and no printing")
  args = parser.parse_args(argv)
  for name in ("epochs", "global_batch_size"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """The right-hand column of the module docstring, with a progress bar and a summary."""
  args = parse_args(argv)
  EPOCHS, GLOBAL_BATCH = args.epochs, args.global_batch_size  # noqa: N806 (the TF guide's names)
  train, test = load_data(args.seed)
  STEPS = len(train["image"]) // GLOBAL_BATCH  # noqa: N806 (steps per epoch)
  if STEPS == 0:
    raise SystemExit(f"--global-batch-size {GLOBAL_BATCH} exceeds the {len(train['image'])} training examples.")

  # 1. Connect to the TPU (a no-op for one process) and build the strategy.
  resolver = tpustrat.cluster_resolver.TPUClusterResolver(tpu="")
  tpustrat.experimental_connect_to_cluster(resolver)
  tpustrat.initialize_tpu_system(resolver)
  strategy = tpustrat.TPUStrategy(resolver)
  if GLOBAL_BATCH % strategy.num_replicas_in_sync:
    raise SystemExit(f"--global-batch-size {GLOBAL_BATCH} is not a multiple of the "
                     f"{strategy.num_replicas_in_sync} replicas; pick a multiple.")
  quiet = args.quiet or jax.process_index() != 0
  say = (lambda *a: None) if quiet else tqdm.write
  say(f"{strategy!r} on {jax.devices()[0].platform}: {STEPS} steps per epoch of {GLOBAL_BATCH} examples")

  # 2. Input: an endless shuffled stream of global batches (grain reshuffles each epoch).
  ds = (strategy.experimental_make_numpy_dataset(train)
        .shuffle(seed=args.seed).repeat()
        .batch(GLOBAL_BATCH, drop_remainder=True))
  train_iterator = iter(strategy.experimental_distribute_dataset(ds))
  test_ds = strategy.experimental_make_numpy_dataset(test).batch(GLOBAL_BATCH)  # last batch partial

  # 3. Model and optimizer.
  with strategy.scope():
    graphdef, params = nnx.split(create_model(nnx.Rngs(args.seed)))
    tx = optax.adam(args.learning_rate)
    state = {"params": params, "opt_state": tx.init(params)}

  # 4. One replica's step.
  def step_fn(state: dict[str, Any], inputs: dict[str, jax.Array]) -> tuple[dict[str, Any], dict]:
    images, labels = inputs["image"], inputs["label"]

    def loss_fn(params: nnx.State) -> tuple[jax.Array, jax.Array]:
      logits = nnx.merge(graphdef, params)(images)
      per_example_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      loss = jnp.sum(per_example_loss) / GLOBAL_BATCH  # tf.nn.compute_average_loss
      return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    # grads are ALREADY summed over replicas (the parameters entered replicated): apply them as they are.
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    correct = jnp.sum(jnp.argmax(logits, -1) == labels)
    metrics = tpustrat.get_replica_context().all_reduce("sum", {"loss": loss, "correct": correct})
    return {"params": params, "opt_state": opt_state}, metrics

  # 5 and 6. The loop: one compiled program of STEPS steps per epoch.
  losses, accuracies = [], []
  compiled_at = None
  with tqdm(total=EPOCHS * STEPS, unit="step", disable=quiet, leave=False) as bar:
    for epoch in range(EPOCHS):
      state, m = strategy.experimental_run_steps(step_fn, train_iterator, STEPS, init=state)
      m = strategy.experimental_local_results(m)[0]  # Mirrored: the same on every replica
      losses.append(float(np.mean(m["loss"])))
      accuracies.append(float(np.sum(m["correct"]) / (STEPS * GLOBAL_BATCH)))
      if compiled_at is None:  # throughput excludes the first epoch, which compiles the program
        compiled_at = time.perf_counter()
      bar.update(STEPS)
      bar.set_postfix(loss=f"{losses[-1]:.4f}")
      say(f"epoch {epoch + 1}/{EPOCHS}: loss {losses[-1]:.4f}, train accuracy {accuracies[-1]:.4f}")
  elapsed = time.perf_counter() - compiled_at
  examples_per_second = (EPOCHS - 1) * STEPS * GLOBAL_BATCH / elapsed if EPOCHS > 1 else float("nan")

  # 7. Evaluation: every test example counted once (the padding of the last batch masked out).
  def test_fn(params: nnx.State, inputs: dict[str, jax.Array]) -> jax.Array:
    logits = nnx.merge(graphdef, params)(inputs["image"])
    hit = jnp.argmax(logits, -1) == inputs["label"]
    return jnp.sum(hit & tpustrat.valid_mask(hit))

  correct = 0
  for inputs in strategy.experimental_distribute_dataset(test_ds):
    per_replica = strategy.run(test_fn, args=(state["params"], inputs))
    correct += int(strategy.reduce("sum", per_replica, None))
  test_accuracy = correct / len(test["image"])
  speed = f"; {examples_per_second:,.0f} examples/s after the first epoch" if EPOCHS > 1 else ""
  say(f"test accuracy {test_accuracy:.4f} ({correct}/{len(test['image'])}); loss {losses[0]:.4f} -> "
      f"{losses[-1]:.4f} over {EPOCHS} epochs of {STEPS} steps on {strategy.num_replicas_in_sync} "
      f"replicas{speed}")
  return {
      "num_replicas": strategy.num_replicas_in_sync,
      "steps_per_epoch": STEPS,
      "losses": losses,
      "final_loss": losses[-1],
      "train_accuracies": accuracies,
      "test_accuracy": test_accuracy,
      "test_examples": len(test["image"]),
      "test_correct": correct,
      "examples_per_second": examples_per_second,
  }


if __name__ == "__main__":
  main()
