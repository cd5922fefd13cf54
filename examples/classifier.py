"""Data-parallel MLP classifier on scikit-learn's digits, trained with `tpustrat.TPUStrategy`.

What this example shows
-----------------------
The TensorFlow custom-training-loop recipe for `tf.distribute`, written with Flax NNX + Optax and fed by
the library's own input pipeline:

* one `TPUStrategy` over every device of JAX's default backend (TPU cores, GPUs, or 8 emulated CPU
  devices on a laptop: the same file runs unchanged on all three);
* input as in TF: `strategy.experimental_make_numpy_dataset` makes a grain `MapDataset` of the examples
  (shuffled anew every epoch), batched into global batches, and
  `strategy.experimental_distribute_dataset` splits each global batch into one `PerReplica` component
  per replica (replica ``r`` gets rows ``[r*k, (r+1)*k)``, ``k = ceil(B / N)``) and puts it on the
  devices in a background thread. No batch is split or padded by hand;
* the model split with `nnx.split` into a static `graphdef` and a pytree of parameters; parameters and
  the Optax optimizer state travel through `strategy.run` as one pytree and come back `Mirrored`
  (replicated, on device), ready for the next step;
* **every training example, every epoch** (the remainder is kept, not dropped): with the defaults the
  1,437 training examples are 5 batches of 256 and one of 157. The library pads the last batch to the
  same per-replica size ``k`` (one compiled program for full and partial batches), and the step masks
  the padding out of the loss and the accuracy with `tpustrat.valid_mask`. The loss is the mean over the
  batch's real examples: their sum divided by their global count (`tpustrat.num_valid_examples`,
  all-reduced). For a full batch that count is the global batch size, as in TF's
  `compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)`; for the partial batch it
  is 157, where TF's fixed `global_batch_size` would shrink that step's loss and gradient by 157/256;
* **exact evaluation** on the 360 held-out examples, not a multiple of the batch: the last test batch is
  partial, the step returns per-example results marked with `tpustrat.per_example`, and
  `strategy.reduce("sum", correct, axis=0)` / `strategy.gather(predictions, axis=0)` leave the padding
  rows out, so every test example is counted exactly once.

Input, loss scaling and gradient aggregation: TensorFlow -> tpustrat
--------------------------------------------------------------------
In TensorFlow::

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n).batch(GLOBAL_BATCH)
    for x, y in strategy.experimental_distribute_dataset(dataset):
      per_replica_loss = strategy.run(step_fn, args=(x, y))

    def step_fn(x, y):
      with tf.GradientTape() as tape:
        per_example_loss = loss_object(y, model(x))
        loss = tf.nn.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
      grads = tape.gradient(loss, model.trainable_variables)
      optimizer.apply_gradients(zip(grads, model.trainable_variables))  # all-reduces (SUM) grads
      return loss

Here (see `make_train_step` and `main`)::

    order = rng.permutation(n)                                    # a fresh shuffle every epoch
    dataset = strategy.experimental_make_numpy_dataset({"x": x[order], "y": y[order]}).batch(GLOBAL_BATCH)
    for batch in strategy.experimental_distribute_dataset(dataset):
      state, metrics = strategy.run(step_fn, args=(state, batch))

    def step_fn(state, batch):
      mask = tpustrat.valid_mask(batch["x"])        # False on the padding rows of a partial batch
      examples = ctx.all_reduce("sum", tpustrat.num_valid_examples(batch["x"]))  # real examples, globally
      loss, grads = jax.value_and_grad(loss_fn)(state["params"])  # sum(where(mask, loss, 0)) / examples
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
      ...
      return new_state, {"loss": ctx.all_reduce("sum", loss), "correct": correct, "examples": examples}

The one difference: `tape.gradient` gives each replica only its own gradient and `apply_gradients`
sums them across replicas. In tpustrat the parameters enter `run` replicated (they are the same on
every replica), and JAX differentiates the whole SPMD program, so `jax.grad` with respect to them
*already* returns the sum over replicas: the gradient of the global mean loss, identical everywhere.
Apply it directly; all-reducing it again would multiply it by the number of replicas.

Run it::

    python examples/classifier.py                 # 8 emulated CPU devices unless accelerators exist
    python -m tpustrat.launch -n 2 -d 4 examples/classifier.py   # 2 processes x 4 CPU devices: same losses
    python examples/classifier.py --epochs 5 --global-batch-size 128 --learning-rate 1e-2

In a multi-process job every process builds the same datasets (same seeds), so every process iterates
the same global batches; `experimental_distribute_dataset` transfers only the rows of its own replicas.
"""

from __future__ import annotations

import os

# Emulate 8 devices when JAX runs on the CPU. The flag only affects the host (CPU) platform, so it is
# harmless on a TPU VM or a GPU machine; it must be set before JAX initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
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

NUM_FEATURES = 64  # 8x8 grey-level images, flattened
NUM_CLASSES = 10

# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------


# The training state is donated to each step: its buffers hold the new state (no second copy at the peak).
DONATE_STATE = tpustrat.RunOptions(donate_argnums=0)

def load_data(seed: int, test_fraction: float = 0.2) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """The 1,797 digits images (bundled with scikit-learn), scaled to [0, 1] and split train/test.

  Returns `(x_train, y_train, x_test, y_test)`: float32 features `[n, 64]` and int32 labels `[n]`.
  """
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)  # pixel values are 0..16
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=test_fraction, random_state=seed, stratify=y)
  return x_train, y_train, x_test, y_test


def make_dataset(strategy: tpustrat.Strategy, x: np.ndarray, y: np.ndarray, global_batch_size: int,
                 rng: np.random.Generator | None = None) -> Any:
  """One pass over `(x, y)` in global batches ``{"x": [B, 64], "y": [B]}``: a grain `MapDataset`.

  With `rng`, the examples are first shuffled with a fresh permutation (training: call once per epoch).
  The arrays are in memory, so they are permuted with one numpy gather; grain's `MapDataset.shuffle`
  would do the same by computing every example's shuffled index on its own (measured: ~0.1 ms per
  example on a CPU host, about as long as the training step itself for these tiny examples). The last batch is partial when `global_batch_size` does not
  divide the number of examples: `experimental_distribute_dataset` pads it, and the steps tell its real
  rows with `tpustrat.valid_mask` / `tpustrat.per_example`. Every process of a multi-process job builds
  the same dataset (same seed), hence iterates the same global batches.
  """
  if rng is not None:
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
  return strategy.experimental_make_numpy_dataset({"x": x, "y": y}).batch(global_batch_size)


# ---------------------------------------------------------------------------------------------------
# Model and steps
# ---------------------------------------------------------------------------------------------------


class MLP(nnx.Module):
  """Two hidden ReLU layers and a linear classifier head."""

  def __init__(self, hidden: int = 128, *, rngs: nnx.Rngs) -> None:
    self.hidden1 = nnx.Linear(NUM_FEATURES, hidden, rngs=rngs)
    self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
    self.head = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = jax.nn.relu(self.hidden1(x))
    x = jax.nn.relu(self.hidden2(x))
    return self.head(x)


@nnx.jit  # one compiled program, rather than one small compilation per initialiser op run eagerly
def _init_model(rngs: nnx.Rngs) -> MLP:
  return MLP(rngs=rngs)


def create_train_state(seed: int, learning_rate: float) -> tuple[nnx.GraphDef, dict[str, Any],
                                                                 optax.GradientTransformation]:
  """Builds the model and optimizer. Returns `(graphdef, state, tx)`.

  `state` is a plain pytree `{"params": nnx.State, "opt_state": optax state}`: everything that changes
  during training, passed to and returned from `strategy.run`. `graphdef` (the model's structure) and
  `tx` (the optimizer's update rule) are static and are closed over by the step functions.
  """
  graphdef, params = nnx.split(_init_model(nnx.Rngs(seed)))
  tx = optax.adam(learning_rate)
  return graphdef, {"params": params, "opt_state": jax.jit(tx.init)(params)}, tx


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation) -> Callable[..., Any]:
  """Returns the per-replica training step `step(state, batch) -> (state, metrics)`.

  `batch` is an element of a distributed dataset. `metrics` holds the batch's mean loss and its number
  of real examples (all-reduced: `Mirrored`) and this replica's correct predictions (`PerReplica`).
  Create the step once and pass the same function to every `strategy.run` call, so that it compiles
  once (full and partial batches have the same shapes: one program).
  """

  def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict[str, Any]]:
    ctx = tpustrat.get_replica_context()
    # The rows of this replica's part of the batch that are real examples: all of them, except in the
    # last batch of an epoch, which the library pads to the usual per-replica size.
    mask = tpustrat.valid_mask(batch["x"])
    examples = ctx.all_reduce("sum", tpustrat.num_valid_examples(batch["x"]))  # real examples, all replicas

    def loss_fn(params: nnx.State) -> tuple[jax.Array, jax.Array]:
      logits = nnx.merge(graphdef, params)(batch["x"])
      per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
      # TF's `compute_average_loss`: divide by the GLOBAL number of examples, not this replica's share,
      # so that the replicas' losses (and their gradients) add up to the mean over the whole global
      # batch. Padding rows count for nothing.
      loss = jnp.sum(jnp.where(mask, per_example, 0.0)) / examples
      correct = jnp.sum(mask & (jnp.argmax(logits, axis=-1) == batch["y"]))
      return loss, correct

    params, opt_state = state["params"], state["opt_state"]
    (loss, correct), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    # `params` are the same on every replica, so `grads` is already summed over replicas (TF's
    # `apply_gradients` all-reduce happens inside `jax.grad`): apply it as is.
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    # The loss itself is per replica: all-reduce it for reporting. It comes back `Mirrored`; `correct`
    # (not reduced) comes back `PerReplica`, for `strategy.reduce` on the host.
    metrics = {"loss": ctx.all_reduce("sum", loss), "examples": examples, "correct": correct}
    return {"params": params, "opt_state": opt_state}, metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[..., Any]:
  """Returns the per-replica evaluation step `step(params, batch) -> {"prediction", "correct"}`.

  Both outputs have one row per example of this replica's part of the batch, and are marked with
  `tpustrat.per_example`: `strategy.reduce` and `strategy.gather` then leave out the padding rows of a
  partial batch.
  """

  def eval_step(params: nnx.State, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    predictions = jnp.argmax(nnx.merge(graphdef, params)(batch["x"]), axis=-1)
    correct = (predictions == batch["y"]).astype(jnp.int32)
    return tpustrat.per_example({"prediction": predictions, "correct": correct})

  return eval_step


def evaluate(strategy: tpustrat.Strategy, eval_step: Callable[..., Any], params: Any, x: np.ndarray,
             y: np.ndarray, global_batch_size: int) -> dict[str, Any]:
  """Exact accuracy on `(x, y)`, through the library's input pipeline.

  Returns ``{"accuracy", "correct", "examples", "predictions"}``: the correct count summed over the
  replicas and the batches (padding left out by `strategy.reduce(..., axis=0)`), and the predicted
  classes of every example in order (`strategy.gather(..., axis=0)`: only real rows), so that
  ``examples == len(x)``.
  """
  correct, predictions = [], []
  params = strategy.experimental_mirror(params)  # placed once, not by `run` at every batch
  for batch in strategy.experimental_distribute_dataset(make_dataset(strategy, x, y, global_batch_size)):
    out = strategy.run(eval_step, args=(params, batch))
    correct.append(strategy.reduce("sum", out["correct"], axis=0))
    predictions.append(strategy.gather(out["prediction"], axis=0))
  correct, predictions = jax.device_get((correct, predictions))  # one host sync for the whole split
  predictions = np.concatenate(predictions)
  total = int(np.sum(correct))
  return {"accuracy": total / len(x), "correct": total, "examples": len(predictions),
          "predictions": predictions}


# ---------------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--epochs", type=int, default=30, help="passes over the training split")
  parser.add_argument("--global-batch-size", type=int, default=256,
                      help="examples per step, over all replicas (each replica gets ceil(B / replicas) rows, "
                           "padding included)")
  parser.add_argument("--learning-rate", type=float, default=3e-3, help="Adam learning rate")
  parser.add_argument("--seed", type=int, default=0, help="seed for the split, the init and the shuffling")
  parser.add_argument("--quiet", action="store_true", help="no progress bar and no printing")
  args = parser.parse_args(argv)
  if args.epochs < 1:
    parser.error(f"--epochs must be >= 1, got {args.epochs}")
  if args.global_batch_size < 1:
    parser.error(f"--global-batch-size must be >= 1, got {args.global_batch_size}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains and evaluates the classifier. Returns a summary dict (see the end of this function)."""
  args = parse_args(argv)
  # In a multi-process job (`python -m tpustrat.launch ...`, or several hosts) the strategy spans every
  # process's devices; each process runs this same program, and only process 0 reports progress.
  strategy = tpustrat.TPUStrategy()
  quiet = args.quiet or jax.process_index() != 0
  say = (lambda *a: None) if quiet else tqdm.write
  n = strategy.num_replicas_in_sync
  x_train, y_train, x_test, y_test = load_data(args.seed)
  # Every epoch uses every training example: the last batch is partial (padded, masked in the step).
  steps_per_epoch = -(-len(x_train) // args.global_batch_size)
  say(f"{strategy!r} on {jax.devices()[0].platform}: {len(x_train)} train / {len(x_test)} test examples, "
      f"global batch {args.global_batch_size} ({-(-args.global_batch_size // n)} per replica)")

  graphdef, state, tx = create_train_state(args.seed, args.learning_rate)
  train_step = make_train_step(graphdef, tx)
  eval_step = make_eval_step(graphdef)
  rng = np.random.default_rng(args.seed)

  losses: list[float] = []
  train_accuracies: list[float] = []
  train_examples: list[int] = []
  timed_start, timed_examples = None, 0
  with tqdm(total=args.epochs * steps_per_epoch, unit="step", disable=quiet, leave=False) as bar:
    for epoch in range(args.epochs):
      # A fresh shuffle every epoch (the same in every process), split over the replicas by the library.
      dataset = make_dataset(strategy, x_train, y_train, args.global_batch_size, rng)
      epoch_metrics = []
      for batch in strategy.experimental_distribute_dataset(dataset):
        # Asynchronous: returns device values at once; `run` itself bounds the steps in flight.
        state, metrics = strategy.run(train_step, args=(state, batch), options=DONATE_STATE)
        epoch_metrics.append(metrics)
        if timed_start is None:  # throughput excludes the first step, which compiles the program
          jax.block_until_ready(metrics)
          timed_start = time.perf_counter()
        bar.update()
      # One host sync per epoch, not per step: fetch the epoch's metrics together. A `Mirrored` value is
      # the same on every replica (take the first local copy); the `PerReplica` correct counts are
      # summed across replicas with `strategy.reduce`, as in TF.
      step_losses, step_examples, step_correct = (np.asarray(v) for v in jax.device_get((
          [strategy.experimental_local_results(m["loss"])[0] for m in epoch_metrics],
          [strategy.experimental_local_results(m["examples"])[0] for m in epoch_metrics],
          [strategy.reduce("sum", m["correct"], axis=None) for m in epoch_metrics])))
      seen = int(np.sum(step_examples))
      losses.append(float(np.sum(step_losses * step_examples) / seen))  # mean over the epoch's examples
      train_accuracies.append(int(np.sum(step_correct)) / seen)
      train_examples.append(seen)
      timed_examples += seen - (int(step_examples[0]) if epoch == 0 else 0)
      bar.set_postfix(loss=f"{losses[-1]:.4f}")
      say(f"epoch {epoch + 1:3d}/{args.epochs}: loss {losses[-1]:.4f}, "
          f"train accuracy {train_accuracies[-1]:.4f}")
    jax.block_until_ready(state)
  elapsed = time.perf_counter() - timed_start
  # Where the training loop's time went (this process's): waiting for batches, waiting on the devices (the
  # bound on steps in flight), and the host's own work (the step's Python, dispatch, the first compile).
  step_stats = strategy.experimental_step_stats()
  say(f"training loop: {step_stats}")
  examples_per_second = timed_examples / elapsed if timed_examples else float("nan")

  test = evaluate(strategy, eval_step, state["params"], x_test, y_test, args.global_batch_size)
  say(f"test accuracy {test['accuracy']:.4f} ({test['correct']}/{test['examples']} examples); "
      f"{examples_per_second:,.0f} examples/s over {n} replicas")
  return {
      "final_loss": losses[-1],
      "losses": losses,
      "train_accuracies": train_accuracies,
      "train_examples": train_examples,
      "test_accuracy": test["accuracy"],
      "test_correct": test["correct"],
      "test_examples": test["examples"],
      "examples_per_second": examples_per_second,
      "step_stats": {"steps": step_stats.steps, "wall_seconds": step_stats.wall_seconds,
                     "input_seconds": step_stats.input_seconds, "device_seconds": step_stats.device_seconds},
      "epochs": args.epochs,
      "steps_per_epoch": steps_per_epoch,
      "num_replicas": n,
  }


if __name__ == "__main__":
  main()
