r"""TF's "Use TPUs" guide, its custom training loop ported to tpustrat.

The original: the "Train a model using a custom training loop" section of https://www.tensorflow.org/guide/tpu
(source: github.com/tensorflow/docs, ``site/en/guide/tpu.ipynb``): a Keras CNN, per-replica batches from
`strategy.distribute_datasets_from_function`, a step that scales its loss with `tf.nn.compute_average_loss`,
`strategy.run` inside a multi-step `tf.function` (``for _ in tf.range(steps)``) and Keras metrics. This file
is its tpustrat twin, which trains on scikit-learn's 8x8 digits instead of MNIST (no download). The two
programs side by side, numbered block for numbered block, and what changes and why, are in
``docs/coming_from_tensorflow.md`` ("A training loop, side by side"); the test suite checks that the right
column there is this file's code.

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
  parser.add_argument("--steps-per-epoch", type=int, default=None,
                      help="steps per epoch (default: as many global batches as the training set holds)")
  parser.add_argument("--quiet", action="store_true", help="no progress bar and no printing")
  args = parser.parse_args(argv)
  for name in ("epochs", "global_batch_size", "steps_per_epoch"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """The right-hand column of the module docstring, with a progress bar and a summary."""
  args = parse_args(argv)
  EPOCHS, GLOBAL_BATCH = args.epochs, args.global_batch_size  # noqa: N806 (the TF guide's names)
  train, test = load_data(args.seed)
  STEPS = args.steps_per_epoch or len(train["image"]) // GLOBAL_BATCH  # noqa: N806 (steps per epoch)
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

  # 2. Input: each replica dequeues per-replica batches from an endless shuffled stream (one pipeline
  # per process, made by get_dataset).
  def get_dataset(batch_size: int, is_training: bool = True) -> Any:
    dataset = strategy.experimental_make_numpy_dataset(train if is_training else test)
    if is_training:
      dataset = dataset.shuffle(seed=args.seed).repeat()
    return dataset.batch(batch_size)

  per_replica_batch_size = GLOBAL_BATCH // strategy.num_replicas_in_sync
  train_dataset = strategy.distribute_datasets_from_function(
      lambda _: get_dataset(per_replica_batch_size, is_training=True))
  train_iterator = iter(train_dataset)
  test_ds = get_dataset(GLOBAL_BATCH, is_training=False)  # global batches, the last one partial

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
      loss = tpustrat.compute_average_loss(per_example_loss)
      return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    # grads are ALREADY summed over replicas (the parameters entered replicated): apply them as they are.
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    correct = jnp.sum(jnp.argmax(logits, -1) == labels)
    metrics = tpustrat.get_replica_context().all_reduce("sum", {"loss": loss, "correct": correct})
    return {"params": params, "opt_state": opt_state}, metrics

  # 5 and 6. The loop: one compiled program of STEPS steps per epoch.
  losses, accuracies, step_losses = [], [], []
  compiled_at = None
  with tqdm(total=EPOCHS * STEPS, unit="step", disable=quiet, leave=False) as bar:
    for epoch in range(EPOCHS):
      state, m = strategy.experimental_run_steps(step_fn, train_iterator, STEPS, init=state)
      m = strategy.experimental_local_results(m)[0]  # Mirrored: the same on every replica
      step_losses.extend(float(v) for v in np.asarray(m["loss"]))
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
      "step_losses": step_losses,
      "final_loss": losses[-1],
      "train_accuracies": accuracies,
      "test_accuracy": test_accuracy,
      "test_examples": len(test["image"]),
      "test_correct": correct,
      "examples_per_second": examples_per_second,
  }


if __name__ == "__main__":
  main()
