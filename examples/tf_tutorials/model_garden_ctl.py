"""TF Model Garden's custom training loop, `run_customized_training_loop`, ported line by line to tpustrat.

The original: tensorflow/models, ``official/legacy/bert/model_training_utils.py`` (the loop most TF teams'
training code descends from). It builds the model and its optimizer in the strategy's scope, trains
``steps_per_loop`` steps per host loop (``train_steps`` in one `tf.function`), runs Keras metrics inside
the replicated step, evaluates on the host from `experimental_local_results` (logits and labels, each
replica's loss weighed by its rows), writes `tf.summary` scalars from the chief, saves a checkpoint after
each evaluation and restores the newest one on start, reading the global step back from
``optimizer.iterations``. This port keeps that structure, name for name, with the explicit all-reduce path
(``explicit_allreduce=True``): each replica's gradients of the Keras-scaled loss clipped by their global
norm (a ``pre_allreduce_callbacks`` entry), then summed with ``allreduce_bytes_per_pack``. The model is a
small Keras classifier on synthetic Fashion-MNIST-like data (no download); the optimizer Keras's AdamW with
a polynomial decay inside a ``LossScaleOptimizer``; the evaluation set is not a multiple of the global
batch, and the steps per loop leave a remainder before each evaluation.

Run it (8 emulated CPU devices unless accelerators)::

    KERAS_BACKEND=jax python examples/tf_tutorials/model_garden_ctl.py --model-dir /tmp/mg
    # kill it (kill -9) after "saved step 6" and run the same command again: it resumes at step 6

Side by side
------------
::

  TF (Model Garden)                                       tpustrat (this file)
  ----------------------------------------------------    -----------------------------------------------------
  with strategy.scope():                                  with strategy.scope():
    model, sub_model = model_fn()                           model = model_fn(...)
    optimizer = model.optimizer                             optimizer = model.optimizer
    train_loss_metric = tf.keras.metrics.Mean(...)          train_loss_metric = keras.metrics.Mean(...)
                                                          state = strategy.experimental_mirror(   # Keras's
                                                              tpustrat.keras.state(model, optimizer))  # values
  def _replicated_step(inputs):                           def _replicated_step(state, inputs):
    with tf.GradientTape() as tape:                         def scaled_loss_fn(trainable):
      model_outputs = model(inputs, training=True)            model_outputs, ... = tpustrat.keras.stateless_call(
      loss = loss_fn(labels, model_outputs)                       model, trainable, ..., inputs, training=True)
      raw_loss = loss                                         loss = loss_fn(labels, model_outputs)
      loss = loss / strategy.num_replicas_in_sync             raw_loss, loss = loss, loss / num_replicas
      scaled_loss = optimizer.get_scaled_loss(loss)           return tpustrat.keras.scale_loss(     # the scale
                                                                  optimizer, state["optimizer"], loss), ...  # in
    grads = tape.gradient(scaled_loss, training_vars)       grads = jax.grad(scaled_loss_fn)(             # the state
                                                                tpustrat.local_copy(state["trainable"]))  # per replica
    grads = clip_by_global_norm(grads)  # pre-allreduce     grads = clip_by_global_norm(grads)  # the same
    grads = ctx.all_reduce(SUM, grads, options=             grads = ctx.all_reduce("sum", grads, options=
        CommunicationOptions(bytes_per_pack=...))               tpustrat.CommunicationOptions(bytes_per_pack=...))
    optimizer.apply_gradients(                              trainable, opt = optimizer.stateless_apply(
        zip(optimizer.get_unscaled_gradients(grads), ...))      state["optimizer"], grads, state["trainable"])
    train_loss_metric.update_state(raw_loss)                metrics = train_loss_metric.stateless_update_state(
                                                                state["metrics"], raw_loss)  # summed over replicas
  for _ in tf.range(steps):                               state, _ = strategy.experimental_run_steps(
    strategy.run(_replicated_step, args=(next(it),))          _replicated_step, train_iterator, steps, init=state)
  outputs = strategy.experimental_local_results(          logits = strategy.experimental_local_results(logits)
      outputs)       # each replica's real rows                # each replica's real rows, as TF's
  eval_summary_writer = tf.summary.create_file_writer(    eval_summary_writer = tpustrat.summary.create_file_
      os.path.join(summary_dir, 'eval'))                      writer(os.path.join(summary_dir, 'eval'))
  tf.summary.scalar(metric.name, value, step=step)        tpustrat.summary.scalar(metric.name, value, step=step)
  checkpoint.restore(latest_checkpoint_file)              state = manager.restore(target=state,
                                                                                  iterator=train_iterator)
  current_step = optimizer.iterations.numpy()             current_step = tpustrat.keras.iterations(
                                                              optimizer, state["optimizer"])
  checkpoint.save(...)                                    manager.save(current_step, state,
                                                                       iterator=train_iterator)

What changes, and why: Keras on JAX is stateless inside a compiled step, so the model's, the optimizer's
and the metrics' variables are a state pytree that goes through the step and comes back; the Keras objects
on the host keep their initial values until `tpustrat.keras.assign` writes the state into them (so the
global step after a restore is read from the state: `tpustrat.keras.iterations`, and the loss scale inside
the step from the state: `tpustrat.keras.scale_loss`; ``optimizer.scale_loss`` or ``metric.update_state``
inside the step raise, naming these). TF's literal ``optimizer.iterations.numpy()`` after the restore, or
``model.save`` / a callback's ``self.model`` after steps without `assign`, raises
`tpustrat.keras.StaleVariableError` naming ``tpustrat.keras.assign(model, optimizer, state)``, instead of
reading step 0 and the initial weights. Gradients of a loss w.r.t. replicated values come back summed over
the replicas in JAX, so a pre-all-reduce callback needs TF's own two steps: gradients w.r.t.
`tpustrat.local_copy` (per replica), then ``ctx.all_reduce`` (which is also where ``bytes_per_pack`` goes).
"""

from __future__ import annotations

import os

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()
os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import tpustrat  # noqa: E402

try:
  import keras  # noqa: E402
except ImportError as e:  # pragma: no cover - the `keras` extra
  raise SystemExit("this example needs Keras 3: pip install 'tpustrat[keras]'") from e

NUM_CLASSES, FEATURES, HIDDEN = 10, 64, 32
LR, WEIGHT_DECAY, CLIP_NORM, BYTES_PER_PACK = 1e-2, 1e-2, 5.0, 1 << 10


def model_fn(total_training_steps: int, seed: int = 0) -> Any:
  """Model Garden's ``model_fn``: the model, with its optimizer as ``model.optimizer`` (AdamW with a
  polynomial decay to 0 over the training, inside a dynamic ``LossScaleOptimizer`` whose scale doubles
  every 2 finite steps, so that it changes during the run)."""
  keras.utils.set_random_seed(seed)
  model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="relu"),
                            keras.layers.Dense(NUM_CLASSES)])
  model.optimizer = keras.optimizers.LossScaleOptimizer(
      keras.optimizers.AdamW(learning_rate_schedule(total_training_steps), weight_decay=WEIGHT_DECAY),
      initial_scale=2.0, dynamic_growth_steps=2)
  return model


def learning_rate_schedule(total_training_steps: int) -> Any:
  """A polynomial decay to 0 over the training (Model Garden's BERT optimizer's)."""
  return keras.optimizers.schedules.PolynomialDecay(LR, total_training_steps, end_learning_rate=0.0)


def loss_fn(labels: Any, logits: Any) -> Any:
  """Model Garden's classification loss: the mean over the replica's rows (its batches are full: the
  training dataset repeats; evaluation weighs each replica's loss by its rows on the host)."""
  return jnp.mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))


def load_data(num_examples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Synthetic images of Fashion-MNIST's kind (flattened, in [0, 1]); labels a fixed function of them."""
  rng = np.random.default_rng(seed)
  images = rng.uniform(size=(num_examples, FEATURES)).astype(np.float32)
  labels = (images[:, ::4].sum(axis=1) * 3).astype(np.int32) % NUM_CLASSES
  return images, labels


def batches(data: tuple[np.ndarray, np.ndarray], global_batch_size: int) -> list[tuple[np.ndarray, np.ndarray]]:
  images, labels = data
  return [(images[i:i + global_batch_size], labels[i:i + global_batch_size])
          for i in range(0, len(images), global_batch_size)]


def steps_to_run(current_step: int, steps_between_evals: int, steps_per_loop: int) -> int:
  """Model Garden's: the steps of the next host loop, up to the next evaluation."""
  if steps_per_loop <= 0:
    raise ValueError("steps_per_loop should be positive integer.")
  if steps_per_loop == 1:
    return steps_per_loop
  remainder_in_epoch = current_step % steps_between_evals
  if remainder_in_epoch != 0:
    return min(steps_between_evals - remainder_in_epoch, steps_per_loop)
  return steps_per_loop


def _metric_values(metric: Any, variables: Any) -> float:
  """``metric.result()`` of the metric's values in a state (`Mirrored`: the same on every replica)."""
  return float(metric.stateless_result([jnp.asarray(v.values[0] if isinstance(v, tpustrat.Mirrored) else v)
                                        for v in variables]))


def run_customized_training_loop(strategy: Any, *, model_dir: str, steps_per_epoch: int = 6, epochs: int = 2,
                                 steps_per_loop: int = 4, num_eval_per_epoch: int = 1,
                                 batch_size_per_replica: int = 2, eval_examples: int = 75,
                                 seed: int = 0, log: Any = None) -> dict[str, Any]:
  """Model Garden's loop on `strategy`; returns the train loss per loop, the evaluations and the trained
  weights (and writes checkpoints and summaries under `model_dir`)."""
  log = log or (lambda *a: None)
  num_replicas = strategy.num_replicas_in_sync
  global_batch_size = batch_size_per_replica * num_replicas
  total_training_steps = steps_per_epoch * epochs
  steps_between_evals = int(steps_per_epoch / num_eval_per_epoch)
  steps_per_loop = min(steps_per_loop, steps_between_evals)

  train_dataset = strategy.experimental_distribute_dataset(
      batches(load_data(total_training_steps * global_batch_size, seed), global_batch_size))
  train_iterator = iter(train_dataset)
  eval_batches = batches(load_data(eval_examples, seed + 1), global_batch_size)  # the last one partial
  eval_steps = len(eval_batches)

  with strategy.scope():
    model = model_fn(total_training_steps, seed)
    optimizer = model.optimizer
    train_loss_metric = keras.metrics.Mean("training_loss")
    eval_loss_metric = keras.metrics.Mean("training_loss")  # Model Garden's name for it
    eval_metrics = [keras.metrics.SparseCategoricalAccuracy("accuracy")]
    train_metrics = [m.__class__.from_config(m.get_config()) for m in eval_metrics]
    state = strategy.experimental_mirror(tpustrat.keras.state(model, optimizer))

  def fresh(metrics: list[Any]) -> list[Any]:  # a metric's reset_states(), as values
    return strategy.experimental_mirror([[jnp.asarray(v.value) for v in m.variables] for m in metrics])

  # Summaries from the chief only (tpustrat.summary writes on process 0, a no-op writer elsewhere).
  summary_dir = os.path.join(model_dir, "summaries")
  eval_summary_writer = tpustrat.summary.create_file_writer(os.path.join(summary_dir, "eval"))
  train_summary_writer = tpustrat.summary.create_file_writer(os.path.join(summary_dir, "train"))

  def _replicated_step(carry: Any, inputs: Any) -> tuple[Any, Any]:
    state, metric_vars = carry
    inputs, labels = inputs
    ctx = tpustrat.get_replica_context()

    def scaled_loss_fn(trainable: Any) -> Any:
      model_outputs, non_trainable, _ = tpustrat.keras.stateless_call(
          model, trainable, state["non_trainable"], inputs, training=True)
      loss = loss_fn(labels, model_outputs)
      raw_loss = loss  # for the metrics
      loss = loss / num_replicas  # scale_loss: the gradients invariant to the replicas
      scaled_loss = tpustrat.keras.scale_loss(optimizer, state["optimizer"], loss)
      return scaled_loss, (raw_loss, model_outputs, non_trainable)

    # explicit_allreduce: this replica's gradients of the scaled loss, the pre-all-reduce callback (a clip
    # by their global norm), then the all-reduce packed by allreduce_bytes_per_pack.
    grads, (raw_loss, model_outputs, non_trainable) = jax.grad(scaled_loss_fn, has_aux=True)(
        tpustrat.local_copy(state["trainable"]))
    grads, _ = optax.clip_by_global_norm(CLIP_NORM).update(grads, optax.EmptyState())
    grads = ctx.all_reduce("sum", grads,
                           options=tpustrat.CommunicationOptions(bytes_per_pack=BYTES_PER_PACK))
    trainable, opt = optimizer.stateless_apply(state["optimizer"], grads, state["trainable"])  # unscales
    loss_vars = train_loss_metric.stateless_update_state(metric_vars[0], raw_loss)
    acc_vars = [m.stateless_update_state(v, labels, model_outputs) for m, v in zip(train_metrics, metric_vars[1:])]
    new_state = {"trainable": trainable, "non_trainable": non_trainable, "optimizer": opt}
    return (new_state, [loss_vars, *acc_vars]), raw_loss

  def _test_step_fn(state: Any, metric_vars: Any, inputs: Any) -> tuple[Any, Any, Any]:
    inputs, labels = inputs
    model_outputs, _, _ = tpustrat.keras.stateless_call(
        model, state["trainable"], state["non_trainable"], inputs, training=False)
    metric_vars = [m.stateless_update_state(v, labels, model_outputs) for m, v in zip(eval_metrics, metric_vars)]
    return metric_vars, model_outputs, labels

  def _run_evaluation(current_training_step: int, state: Any) -> dict[str, float]:
    eval_vars = fresh(eval_metrics)
    loss_list, loss_weights = [], []
    test_iterator = iter(strategy.experimental_distribute_dataset(eval_batches))
    for _ in range(eval_steps):
      eval_vars, outputs, labels = strategy.run(_test_step_fn, args=(state, eval_vars, next(test_iterator)))
      # Each replica's local result holds its real rows only (none on a replica past the data), as TF's.
      for cur_logits, cur_labels in zip(strategy.experimental_local_results(outputs),
                                        strategy.experimental_local_results(labels)):
        cur_weight = cur_labels.shape[0]
        if cur_weight != 0:
          loss_list.append(float(loss_fn(cur_labels, cur_logits)))
          loss_weights.append(cur_weight)
    eval_loss_metric.reset_state()
    eval_loss_metric.update_state(np.asarray(loss_list), sample_weight=np.asarray(loss_weights, np.float32))
    logs = {"examples": float(sum(loss_weights))}
    with eval_summary_writer.as_default():
      values = [(eval_loss_metric.name, float(eval_loss_metric.result()))]
      values += [(m.name, _metric_values(m, v)) for m, v in zip(eval_metrics, eval_vars)]
      for name, value in values:
        logs[name] = value
        log(f"Step: [{current_training_step}] Validation {name} = {value:f}")
        tpustrat.summary.scalar(name, value, step=current_training_step)
      eval_summary_writer.flush()
    return logs

  manager = tpustrat.checkpoint.CheckpointManager(os.path.join(model_dir, "checkpoints"), strategy, max_to_keep=2)
  if manager.latest_step() is not None:
    state = manager.restore(target=state, iterator=train_iterator)
  # The global step is the optimizer's, in the state: the Keras object is stale until assign (TF's
  # `optimizer.iterations.numpy()` here raises tpustrat.keras.StaleVariableError after a restore).
  current_step = tpustrat.keras.iterations(optimizer, state["optimizer"])
  log(f"restored step {current_step}" if current_step else "starting at step 0")

  history: dict[str, Any] = {"train_loss": {}, "eval": {}, "learning_rate": {}}
  schedule = learning_rate_schedule(total_training_steps)  # TF's optimizer.learning_rate, a callable
  while current_step < total_training_steps:
    steps = steps_to_run(current_step, steps_between_evals, steps_per_loop)
    (state, metric_vars), _ = strategy.experimental_run_steps(
        _replicated_step, train_iterator, steps, init=(state, fresh([train_loss_metric, *train_metrics])))
    train_loss = _metric_values(train_loss_metric, metric_vars[0])
    current_step += steps
    history["train_loss"][current_step] = train_loss
    training_status = f"Train Step: {current_step}/{total_training_steps}  / loss = {train_loss}"
    with train_summary_writer.as_default():
      lr = float(schedule(current_step))
      history["learning_rate"][current_step] = lr
      tpustrat.summary.scalar("learning_rate", lr, step=current_step)
      tpustrat.summary.scalar(train_loss_metric.name, train_loss, step=current_step)
      for metric, variables in zip(train_metrics, metric_vars[1:]):
        value = _metric_values(metric, variables)
        training_status += f"  {metric.name} = {value:f}"
        tpustrat.summary.scalar(metric.name, value, step=current_step)
      train_summary_writer.flush()
    log(training_status)
    if current_step % steps_between_evals == 0 and current_step < total_training_steps:
      manager.save(current_step, state, iterator=train_iterator)
      manager.wait_until_finished()  # Model Garden's checkpoint.save returns once it is written
      log(f"saved step {current_step}")
      history["eval"][current_step] = _run_evaluation(current_step, state)
  if current_step not in history["eval"]:  # the final evaluation and checkpoint, after the loop
    history["eval"][current_step] = _run_evaluation(current_step, state)
    manager.save(current_step, state, iterator=train_iterator)
  manager.close()
  tpustrat.keras.assign(model, optimizer, state)  # the Keras objects current, for model.save and callbacks
  history["iterations"] = int(optimizer.iterations.numpy())
  history["weights"] = [np.asarray(v.value).tolist() for v in model.trainable_variables]
  return history


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model-dir", required=True)
  parser.add_argument("--steps-per-epoch", type=int, default=6)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--steps-per-loop", type=int, default=4)
  parser.add_argument("--eval-examples", type=int, default=75)
  args = parser.parse_args(argv)
  strategy = tpustrat.MirroredStrategy()
  history = run_customized_training_loop(strategy, model_dir=args.model_dir, steps_per_epoch=args.steps_per_epoch,
                                         epochs=args.epochs, steps_per_loop=args.steps_per_loop,
                                         eval_examples=args.eval_examples, log=lambda m: print(m, flush=True))
  print(json.dumps(history), flush=True)


if __name__ == "__main__":
  main()
