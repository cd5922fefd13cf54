"""Keras's ``compile`` / ``fit`` / ``evaluate`` / ``predict`` under ``strategy.scope()`` (`keras_fit`).

Every expected value comes from one-device Keras: the same model, built from the same seed outside any
scope, trained by Keras's own ``fit`` on the same global batches (``shuffle=False``). The strategies run
on 8 emulated CPU devices; the global batches are not multiples of 8 where a test says partial.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys
import time
import warnings

import jax
import numpy as np
import pytest
from conftest import assert_close, launched_results

import tpustrat

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
  pytest.skip(f"Keras runs on {keras.backend.backend()}, not JAX (KERAS_BACKEND=jax)", allow_module_level=True)

from tpustrat import keras as tk  # noqa: E402


def weights(model):
  return [np.asarray(v.value) for v in model.weights]


def mlp(seed=1, classes=3, features=10):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((features,)), keras.layers.Dense(16, activation="relu"),
                           keras.layers.Dense(classes)])


def compile_args(**kwargs):
  return dict(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"], **kwargs)


def classification(rows, rng, features=10, classes=3):
  x = rng.normal(size=(rows, features)).astype(np.float32)
  y = rng.integers(0, classes, size=(rows,)).astype(np.int32)
  return x, y


def assert_histories(actual, expected):
  """Two `History` objects (or their ``history`` dicts) hold the same figures per epoch."""
  actual, expected = (getattr(h, "history", h) for h in (actual, expected))
  assert set(actual) == set(expected), (actual, expected)
  for name, values in expected.items():
    assert_close(actual[name], values, rtol=1e-5, err_msg=name)


def assert_weights(actual, expected):
  for a, b in zip(weights(actual), weights(expected)):
    assert_close(a, b, rtol=1e-5, scale=np.abs(b).max() + 1.0)


def evaluate_and_fit_like_keras(strategy, build, x, y, batch_size=16, epochs=2):
  """`build()` under the strategy and on one device: `evaluate`, then `fit`'s history, equal; the two
  models."""
  with strategy.scope():
    model = build()
  reference = build()
  assert_close(model.evaluate(x, y, batch_size=batch_size, verbose=0),
               reference.evaluate(x, y, batch_size=batch_size, verbose=0), rtol=1e-5)
  assert_histories(model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0),
                   reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0))
  return model, reference


def on_every_device(model, strategy):
  devices = set(strategy.mesh.devices.flat)
  return all(v.value.sharding.device_set == devices for v in model.variables)


@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_fit_evaluate_predict_equal_one_device_keras_with_a_partial_last_batch(strategy, rng, steps_per_execution):
  x, y = classification(261, rng)  # batch 64: four full batches and one of 5 rows (8 replicas)
  with strategy.scope():
    model = mlp()
    model.compile(**compile_args(steps_per_execution=steps_per_execution))
  assert on_every_device(model, strategy)
  history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
  assert on_every_device(model, strategy)

  reference = mlp()
  reference.compile(**compile_args())
  expected = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
  assert_histories(history, expected)
  assert_weights(model, reference)
  assert_close(model.evaluate(x, y, batch_size=64, verbose=0), reference.evaluate(x, y, batch_size=64, verbose=0))
  for rows in (1, 7, 13, 261):
    predicted = model.predict(x[:rows], batch_size=64, verbose=0)
    assert predicted.shape == (rows, 3)
    assert_close(predicted, reference.predict(x[:rows], batch_size=64, verbose=0), rtol=1e-5)


def test_many_steps_per_execution_take_run_steps_fast_path_and_equal_one_device_keras(strategy, rng, monkeypatch):
  """At steps_per_execution 3, fit's calls reach `experimental_run_steps`' fast path (no checked `run_steps`)
  once their shapes were seen: 9 full batches and a partial one per epoch are 3 programs of 3 steps and one
  of 1. Checked: the first epoch's first two calls (Keras resets its metrics onto its own arrays at each
  epoch's start: placed again) and its 1-step call; then only each epoch's first call, the groups of 3 and
  the group of 1 alternating on the fast path. The numbers are one-device Keras's."""
  from tpustrat._src import multistep
  checked = []
  run_steps = multistep.run_steps
  monkeypatch.setattr(multistep, "run_steps", lambda *a: checked.append(1) or run_steps(*a))
  x, y = classification(9 * 16 + 5, rng)
  with strategy.scope():
    model = mlp(seed=4)
    model.compile(**compile_args(steps_per_execution=3))
  history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
  assert len(checked) == 3 + 1 + 1
  reference = mlp(seed=4)
  reference.compile(**compile_args())
  assert_histories(history, reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0))
  assert_weights(model, reference)
  for _ in range(2):
    assert_close(model.evaluate(x, y, batch_size=16, verbose=0), reference.evaluate(x, y, batch_size=16, verbose=0))
    predicted = model.predict(x, batch_size=16, verbose=0)
    assert predicted.shape == (len(x), 3)
    assert_close(predicted, reference.predict(x, batch_size=16, verbose=0), rtol=1e-5)
  # evaluate as fit (3 checked calls, then 1: its metrics are reset too); predict (no metrics) 2, then none
  assert len(checked) == 5 + (3 + 1) + (2 + 0)


@pytest.mark.parametrize("steps_per_execution", [2, 3])
def test_batches_of_growing_size_under_many_steps_per_execution_all_run(strategy, rng, steps_per_execution):
  """A PyDataset whose later batches are larger (bucketed data): a group of steps ends where a batch's shapes
  change, and the rest of Keras's call runs as more programs, so no batch is dropped: predict returns every
  row, evaluate and fit equal one-device Keras, every step counted."""
  sizes = [8, 16, 16, 16, 24, 5]
  cuts = np.cumsum([0, *sizes])
  x, y = classification(int(cuts[-1]), rng)

  class Batches(keras.utils.PyDataset):
    def __init__(self, with_y):
      super().__init__()
      self.with_y = with_y

    def __len__(self):
      return len(sizes)

    def __getitem__(self, i):
      a, b = cuts[i], cuts[i + 1]
      return (x[a:b], y[a:b]) if self.with_y else (x[a:b],)

  with strategy.scope():
    model = mlp(seed=5)
    model.compile(**compile_args(steps_per_execution=steps_per_execution))
  reference = mlp(seed=5)
  reference.compile(**compile_args())
  predicted = model.predict(Batches(False), verbose=0)
  assert predicted.shape == (len(x), 3)
  assert_close(predicted, reference.predict(Batches(False), verbose=0), rtol=1e-5)
  assert_close(model.evaluate(Batches(True), verbose=0), reference.evaluate(Batches(True), verbose=0))
  history = model.fit(Batches(True), epochs=2, shuffle=False, verbose=0)
  assert_histories(history, reference.fit(Batches(True), epochs=2, shuffle=False, verbose=0))
  assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 2 * len(sizes)
  assert_weights(model, reference)


@pytest.mark.parametrize("masked_by", ["mask_zero", "ignore_class"])
def test_a_masked_loss_reduced_mean_with_sample_weight_equals_one_device_keras(strategy, rng, masked_by):
  """A Keras mask (an Embedding's ``mask_zero``, or the loss's ``ignore_class``) and
  ``reduction="mean_with_sample_weight"`` with no sample weight: Keras makes the mask the weight and divides
  by the unmasked entries; with sample weights all 0 on a batch its loss is 0 there (``divide_no_nan``), not
  NaN. Full and partial batches equal one-device Keras."""
  tokens = rng.integers(1, 20, size=(61, 6)).astype(np.int32)  # 61 rows, batch 16: a partial last batch
  tokens[::3, 4:] = 0
  labels = rng.integers(0, 3, size=(61, 6)).astype(np.int32)
  if masked_by == "ignore_class":
    labels[::4, :3] = -1

  def build():
    keras.utils.set_random_seed(16)
    t = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8, mask_zero=masked_by == "mask_zero")(t)
    model = keras.Model(t, keras.layers.Dense(3)(h))
    ignore = {"ignore_class": -1} if masked_by == "ignore_class" else {}
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight", **ignore))
    return model

  model, reference = evaluate_and_fit_like_keras(strategy, build, tokens, labels)
  assert_weights(model, reference)
  zero = np.ones((61, 6), np.float32)
  zero[16:32] = 0.0  # the second batch weighs nothing
  got = model.evaluate(tokens, labels, sample_weight=zero, batch_size=16, verbose=0)
  assert np.isfinite(got)
  assert_close(got, reference.evaluate(tokens, labels, sample_weight=zero, batch_size=16, verbose=0), rtol=1e-5)


# Keras's IoU metrics ask JAX for int64 (plain one-device Keras warns the same).
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype int64:UserWarning")
def test_iou_metrics_on_outputs_with_several_values_per_row_equal_one_device_keras(strategy, rng):
  """Keras's IoU metrics weigh each element of ``y_true`` (they flatten it): a segmentation-like output
  ``(N, 4, 3)`` with `MeanIoU` (and with one-hot targets, `OneHotMeanIoU`) and a multi-label ``(N, 3)``
  output with `BinaryIoU` evaluate and train as
  one-device Keras, a partial last batch included (61 rows, batch 16)."""
  x = rng.normal(size=(61, 4, 5)).astype(np.float32)
  y = rng.integers(0, 3, size=(61, 4)).astype(np.int32)
  labels = (rng.uniform(size=(61, 3)) > 0.5).astype(np.float32)

  def segmentation():
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((4, 5)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.MeanIoU(num_classes=3, sparse_y_pred=False, name="miou")])
    return model

  def multi_label():
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4, 5)), keras.layers.Flatten(), keras.layers.Dense(3, activation="sigmoid")])
    model.compile(optimizer="sgd", loss="binary_crossentropy", metrics=[keras.metrics.BinaryIoU(name="biou")])
    return model

  def one_hot():  # OneHotMeanIoU takes the class axis away (an argmax) before it flattens
    keras.utils.set_random_seed(8)
    model = keras.Sequential([keras.Input((4, 5)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.CategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.OneHotMeanIoU(num_classes=3, name="ohmiou")])
    return model

  for build, targets in ((segmentation, y), (multi_label, labels), (one_hot, np.eye(3, dtype=np.float32)[y])):
    evaluate_and_fit_like_keras(strategy, build, x, targets)


def test_a_metric_of_an_output_without_a_feature_axis(strategy, rng):
  """An output of shape ``(N,)`` with ``metrics=["mae"]``: Keras's metric function reduces the whole batch to
  one number. Full batches equal one-device Keras (the replicas' means average to the batch's); a partial
  batch, whose padding rows are in each replica's number, is warned, naming the metric."""
  x = rng.normal(size=(32, 10)).astype(np.float32)
  y = rng.normal(size=32).astype(np.float32)

  def build():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(1), keras.layers.Reshape(())])
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model

  with strategy.scope():
    model = build()
  reference = build()
  # two full batches of 16 (2 rows a replica): the means of Keras's batches, and the loss
  assert_close(model.evaluate(x[:32], y[:32], batch_size=16, verbose=0),
               reference.evaluate(x[:32], y[:32], batch_size=16, verbose=0), rtol=1e-5)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.evaluate(x[:21], y[:21], batch_size=16, verbose=0)  # 16 rows, then 5: a partial batch
  said = [str(w.message) for w in caught if issubclass(w.category, tpustrat.PaddingReadWarning)]
  assert any("the metric 'mae' computes one number for the whole batch" in m for m in said), said
  assert any("the loss 'mse' returns one number for the batch" in m for m in said), said  # the loss likewise


def test_a_loss_without_reduction_is_warned_on_a_partial_batch(strategy, rng):
  """A loss with ``reduction=None`` returns per-example values that Keras averages after it, padding rows
  included: evaluate on a partial batch says so, naming the loss; on full batches it equals one device."""
  x, y = classification(48, rng)

  def build():
    keras.utils.set_random_seed(8)
    model = mlp(seed=8)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None))
    return model

  with strategy.scope():
    model = build()
  assert_close(model.evaluate(x, y, batch_size=16, verbose=0), build().evaluate(x, y, batch_size=16, verbose=0),
               rtol=1e-5)
  with pytest.warns(tpustrat.PaddingReadWarning, match="reduction=None: its per-example values are averaged"):
    model.evaluate(x[:45], y[:45], batch_size=16, verbose=0)


def test_a_last_batch_of_one_row_on_eight_replicas(strategy, rng):
  x, y = classification(65, rng)
  with strategy.scope():
    model = mlp(seed=3)
    model.compile(**compile_args())
  history = model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
  reference = mlp(seed=3)
  reference.compile(**compile_args())
  assert_histories(history, reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0))
  assert_weights(model, reference)
  # evaluate counts every example once: the loss is the one-device mean over the 65 rows
  assert_close(model.evaluate(x, y, batch_size=64, verbose=0), reference.evaluate(x, y, batch_size=64, verbose=0))


def two_towers(seed=2):
  keras.utils.set_random_seed(seed)
  a = keras.Input((6,), name="a")
  b = keras.Input((4,), name="b")
  h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="tanh")(a), keras.layers.Dense(8)(b)])
  h = keras.layers.LayerNormalization()(h)
  return keras.Model({"a": a, "b": b}, {"label": keras.layers.Dense(3, name="label")(h),
                                         "score": keras.layers.Dense(1, name="score")(h)})


def test_multi_input_multi_output_with_loss_weights_sample_weights_and_validation(strategy, rng):
  rows = 150
  x = {"a": rng.normal(size=(rows, 6)).astype(np.float32), "b": rng.normal(size=(rows, 4)).astype(np.float32)}
  y = {"label": rng.integers(0, 3, size=rows).astype(np.int32), "score": rng.normal(size=(rows, 1)).astype(np.float32)}
  w = rng.uniform(0.2, 2.0, size=rows).astype(np.float32)

  def compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=1.0),
                  loss={"label": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "score": "mse"},
                  loss_weights={"label": 1.0, "score": 0.5},
                  metrics={"label": ["accuracy"], "score": [keras.metrics.MeanAbsoluteError()]},
                  weighted_metrics={"score": [keras.metrics.MeanSquaredError(name="wmse")]})
    return model

  with strategy.scope():
    model = compiled(two_towers())
  history = model.fit(x, y, sample_weight=w, batch_size=40, epochs=2, shuffle=False, validation_split=0.2, verbose=0)
  reference = compiled(two_towers())
  expected = reference.fit(x, y, sample_weight=w, batch_size=40, epochs=2, shuffle=False, validation_split=0.2,
                           verbose=0)
  assert_histories(history, expected)
  assert_weights(model, reference)
  predicted = model.predict(x, batch_size=40, verbose=0)
  for name, value in reference.predict(x, batch_size=40, verbose=0).items():
    assert_close(predicted[name], value)


def convnet(norm, seed=4):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([
      keras.Input((6, 6, 1)),
      keras.layers.Conv2D(4, 3, use_bias=False, kernel_regularizer=keras.regularizers.L2(1e-3)),
      norm(momentum=0.8), keras.layers.ReLU(), keras.layers.Flatten(),
      keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L1(1e-3)),
  ])


def test_sync_batch_normalization_equals_one_device_batch_normalization_on_partial_batches(strategy, rng):
  x = rng.normal(size=(75, 6, 6, 1)).astype(np.float32)  # batch 32: a last batch of 11 rows
  y = rng.integers(0, 3, size=75).astype(np.int32)
  with strategy.scope():
    model = convnet(tk.SyncBatchNormalization)
    model.compile(**compile_args(steps_per_execution=2))
  history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, validation_data=(x[:21], y[:21]), verbose=0)
  reference = convnet(keras.layers.BatchNormalization)
  reference.compile(**compile_args())
  expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, validation_data=(x[:21], y[:21]),
                           verbose=0)
  assert_histories(history, expected)
  assert_weights(model, reference)  # the moving statistics too


def test_generator_and_pydataset_inputs(strategy, rng):
  x, y = classification(100, rng)
  batches = [(x[i:i + 24], y[i:i + 24]) for i in range(0, 100, 24)]  # the last of 4 rows

  class Batches(keras.utils.PyDataset):
    def __len__(self):
      return len(batches)

    def __getitem__(self, i):
      return batches[i]

  with strategy.scope():
    model = mlp(seed=5)
    model.compile(**compile_args())
  history = model.fit(Batches(), epochs=2, verbose=0)
  with pytest.warns(UserWarning, match="ran out of data"):  # Keras's own word: a generator's length is unknown
    history2 = model.fit((b for b in batches), epochs=1, shuffle=False, verbose=0)
  reference = mlp(seed=5)
  reference.compile(**compile_args())
  assert_histories(history, reference.fit(Batches(), epochs=2, verbose=0))
  with pytest.warns(UserWarning, match="ran out of data"):
    assert_histories(history2, reference.fit((b for b in batches), epochs=1, shuffle=False, verbose=0))
  assert_weights(model, reference)


def test_compiled_metrics_count_padding_rows_zero(strategy, rng):
  x = rng.normal(size=(45, 5)).astype(np.float32)
  y = (rng.uniform(size=(45, 1)) > 0.5).astype(np.float32)

  def built():
    keras.utils.set_random_seed(6)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="sgd", loss="binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="p"),
                           keras.metrics.Recall(name="r")])
    return model

  with strategy.scope():
    model = built()
  reference = built()
  assert_close(model.evaluate(x, y, batch_size=16, verbose=0), reference.evaluate(x, y, batch_size=16, verbose=0))


def test_compile_inside_a_scope_needs_the_model_built_there(strategy):
  model = mlp()
  with strategy.scope(), pytest.raises(ValueError, match="created outside any strategy's scope"):
    model.compile(**compile_args())
  other = tpustrat.MirroredStrategy(jax.devices()[:2])
  with other.scope():
    model = mlp()
  with strategy.scope(), pytest.raises(ValueError, match="in the scope of"):
    model.compile(**compile_args())


def test_a_model_compiled_outside_the_scope_keeps_the_strategy_it_was_built_in(strategy, rng):
  x, y = classification(20, rng)
  with strategy.scope():
    model = mlp()
  model.compile(**compile_args())  # TF: the model's strategy, from its variables
  assert tk.strategy_of(model) is strategy
  model.fit(x, y, batch_size=8, verbose=0)
  assert on_every_device(model, strategy)
  other = tpustrat.MirroredStrategy(jax.devices()[:2])
  with other.scope(), pytest.raises(ValueError, match="was compiled under"):
    model.fit(x, y, batch_size=8, verbose=0)
  plain = mlp()
  plain.compile(**compile_args())
  with strategy.scope(), pytest.raises(ValueError, match="not compiled under it"):
    plain.fit(x, y, batch_size=8, verbose=0)


def test_keras_outside_any_scope_is_untouched(rng):
  x, y = classification(20, rng)
  model = mlp()
  model.compile(**compile_args())
  model.fit(x, y, batch_size=8, verbose=0)
  assert tk.strategy_of(model) is None
  assert all(len(v.value.sharding.device_set) == 1 for v in model.variables)


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size", "mean_with_sample_weight"])
def test_every_loss_reduction_equals_one_device_on_a_partial_batch(strategy, rng, reduction):
  x, y = classification(45, rng)  # batch 16: the last of 13 rows
  w = rng.uniform(0.5, 2.0, size=45).astype(np.float32)

  def compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.01), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction))
    return model

  with strategy.scope():
    model = compiled(mlp(seed=15))
  history = model.fit(x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False, verbose=0)
  reference = compiled(mlp(seed=15))
  assert_histories(history, reference.fit(x, y, sample_weight=w, batch_size=16, epochs=2, shuffle=False, verbose=0))
  assert_weights(model, reference)


def sequence_tagger(mask_zero, seed=16):
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((6,), dtype="int32")
  h = keras.layers.Embedding(20, 8, mask_zero=mask_zero)(tokens)
  return keras.Model(tokens, keras.layers.Dense(3)(h))


@pytest.mark.parametrize("mask_zero", [False, True])
def test_per_timestep_outputs_with_and_without_a_keras_mask_equal_one_device(strategy, rng, mask_zero):
  """Labels per timestep (y [N, T], predictions [N, T, 3]); with `mask_zero` the loss and accuracy count
  only the unmasked timesteps, over the global batch (replicas hold different numbers of them)."""
  tokens = rng.integers(1, 20, size=(51, 6)).astype(np.int32)
  tokens[::3, 4:] = 0
  tokens[1::7, 1:] = 0
  labels = rng.integers(0, 3, size=(51, 6)).astype(np.int32)

  def compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model

  with strategy.scope():
    model = compiled(sequence_tagger(mask_zero))
  history = model.fit(tokens, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
  reference = compiled(sequence_tagger(mask_zero))
  assert_histories(history, reference.fit(tokens, labels, batch_size=16, epochs=2, shuffle=False, verbose=0))
  assert_weights(model, reference)
  assert_close(model.evaluate(tokens, labels, batch_size=16, verbose=0),
               reference.evaluate(tokens, labels, batch_size=16, verbose=0))


def test_what_cannot_be_made_exact_on_a_partial_batch_is_warned(strategy, rng):
  """A loss that returns one number for its batch, and an activity regularizer (a loss of the model
  computed from each replica's rows), include the padding rows: said once each, when a partial batch
  ran; full batches are not warned."""
  x, y = classification(48, rng)

  def scalar_loss(y_true, y_pred):
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True))

  with strategy.scope():
    keras.utils.set_random_seed(17)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(8, activity_regularizer="l2"),
                              keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=scalar_loss)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # 3 full batches: exact, nothing said
  with pytest.warns(tpustrat.PaddingReadWarning) as said:
    model.fit(x[:45], y[:45], batch_size=16, epochs=1, verbose=0)
  text = " ".join(str(w.message) for w in said)
  assert "returns one number for the batch" in text and "activity_regularizer" in text


def test_save_load_and_callbacks_after_fit(strategy, rng, tmp_path):
  x, y = classification(90, rng)
  path = os.fspath(tmp_path / "model.keras")
  with strategy.scope():
    model = mlp(seed=8)
    model.compile(**compile_args())
  callbacks = [keras.callbacks.ModelCheckpoint(path), keras.callbacks.CSVLogger(os.fspath(tmp_path / "log.csv")),
               keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)]
  history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
  reference = mlp(seed=8)
  reference.compile(**compile_args())
  expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                           callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)])
  assert_histories(history, expected)
  loaded = keras.models.load_model(path)
  assert_weights(loaded, reference)
  assert_close(loaded.predict(x, verbose=0), reference.predict(x, verbose=0))
  assert_close(np.asarray(model(x)), np.asarray(reference(x)))  # plain Keras use after fit
  logged = np.genfromtxt(tmp_path / "log.csv", delimiter=",", names=True)
  assert_close(logged["loss"], expected.history["loss"])


def test_plain_batch_normalization_keeps_tf_per_replica_statistics_over_real_rows(strategy, rng):
  """TF's per-replica batch norm: each replica's statistics over its own real rows; the moving statistics
  are their mean over the replicas that held rows (`ON_READ` `MEAN`). 13 rows, batch 16: replicas 0-5 hold
  2 rows, replica 6 one, replica 7 none."""
  x = rng.normal(size=(13, 4)).astype(np.float32)
  y = rng.integers(0, 2, size=13).astype(np.int32)
  with strategy.scope():
    keras.utils.set_random_seed(9)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, use_bias=False),
                              keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  kernel = np.asarray(model.layers[0].kernel.value)
  model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  h = x.astype(np.float64) @ kernel
  parts = [h[r * 2:(r + 1) * 2] for r in range(8) if r * 2 < 13]
  mean = np.mean([p.mean(0) for p in parts], axis=0)
  var = np.mean([p.var(0) for p in parts], axis=0)
  bn = model.layers[1]
  assert_close(np.asarray(bn.moving_mean.value), 0.5 * 0.0 + 0.5 * mean, scale=np.abs(h).max())
  assert_close(np.asarray(bn.moving_variance.value), 0.5 * 1.0 + 0.5 * var, scale=np.abs(h).max() ** 2)


def test_a_distributed_dataset_is_read_as_its_global_batches(strategy, rng):
  x, y = classification(70, rng)
  batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 70, 32)]  # the last of 6 rows
  with strategy.scope():
    model = mlp(seed=10)
    model.compile(**compile_args())
  history = model.fit(strategy.experimental_distribute_dataset(batches), epochs=2,
                      validation_data=strategy.experimental_distribute_dataset(batches[:1]), verbose=0)
  reference = mlp(seed=10)
  reference.compile(**compile_args())
  expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, validation_data=batches[0], verbose=0)
  assert_histories(history, expected)
  assert_weights(model, reference)
  per_replica = strategy.experimental_distribute_datasets_from_function(lambda ctx: batches)
  with pytest.raises(ValueError, match="global batches"):
    model.fit(per_replica, verbose=0)


def launched_job(name, *args, launcher=()):
  """tests/_mp_scripts/NAME.py run by the launcher on 2 processes x 4 devices: (the completed process,
  {process: its RESULT}, the script as a module, for its model and data)."""
  script = pathlib.Path(__file__).resolve().parent / "_mp_scripts" / f"{name}.py"
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPUSTRAT_") and k != "JAX_NUM_CPU_DEVICES"}
  out = subprocess.run([sys.executable, "-m", "tpustrat.launch", "--num-processes", "2", "--devices-per-process",
                        "4", *launcher, "--timeout", "240", str(script), *args], env=env, cwd=script.parents[2],
                       capture_output=True, text=True, timeout=420)
  assert out.returncode == 0, out.stderr[-4000:]
  spec = importlib.util.spec_from_file_location(f"{name}_job", script)
  job = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(job)
  return out, launched_results(out.stdout), job


@pytest.mark.processes
def test_two_processes_of_four_devices_give_one_device_keras_numbers():
  """tests/_mp_scripts/keras_fit.py under the launcher (2 x 4, `MultiWorkerMirroredStrategy`): fit with a
  validation split and partial batches, evaluate and predict give one-device Keras's numbers in both
  processes, and every variable lives on the job's 8 devices."""
  _, results, job = launched_job("keras_fit")
  reference = job.build()
  reference.compile(**job.compile_args())
  want = job.train(reference)
  for process, got in results.items():
    assert got["process"] == process and got["replicas"] == 8 and got["devices"] == [8]
    assert_histories(got["history"], want["history"])
    for a, b in zip(got["weights"], want["weights"], strict=True):
      assert_close(a, b, scale=np.abs(b).max() + 1.0)
    assert_close(got["evaluate"], want["evaluate"])
    assert_close(got["predict"], want["predict"])


def read_scalars(folder):
  """{tag: [(step, value), ...]} from the TensorBoard event files in `folder` (TFRecord framing: an 8-byte
  length, its CRC, the record, its CRC), parsed with tensorboardX's own Event protocol buffer."""
  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  scalars = {}
  for path in sorted(pathlib.Path(folder).glob("events.out.tfevents.*")):
    data = path.read_bytes()
    at = 0
    while at < len(data):
      length = int.from_bytes(data[at:at + 8], "little")
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_tensorboard_writes_keras_scalars_without_tensorflow(strategy, rng, tmp_path):
  x, y = classification(60, rng)
  with strategy.scope():
    model = mlp(seed=11)
    model.compile(**compile_args())
  board = tk.TensorBoard(tmp_path, update_freq=2)
  history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, validation_data=(x[:20], y[:20]),
                      callbacks=[board], verbose=0)
  train, validation = read_scalars(tmp_path / "train"), read_scalars(tmp_path / "validation")
  for name in ("loss", "accuracy"):
    assert [s for s, _ in train[f"epoch_{name}"]] == [0, 1]
    assert_close([v for _, v in train[f"epoch_{name}"]], history.history[name])
    assert_close([v for _, v in validation[f"epoch_{name}"]], history.history[f"val_{name}"])
  assert_close([v for _, v in train["epoch_learning_rate"]], [1e-2, 1e-2])
  assert [s for s, _ in train["batch_loss"]] == [2, 4, 6, 8]  # 4 batches an epoch: after batches 2 and 4
  with pytest.raises(ValueError, match="update_freq=0"):
    tk.TensorBoard(tmp_path, update_freq=0)


class Interrupt(Exception):
  pass


def test_backup_and_restore_resumes_at_the_batch_it_backed_up(strategy, rng, tmp_path):
  """A fit interrupted in its second epoch (after 2 of its 4 batches, backed up every batch) and run again
  with the same callback resumes at batch 3 of epoch 1: the weights, optimizer and the second epoch's
  logs equal an uninterrupted one-device Keras fit; the backup is deleted when fit completes."""
  x, y = classification(56, rng)  # batch 16: 3 full batches and one of 8 rows

  class StopAt(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
      if self.model.optimizer.iterations.value == 6:  # epoch 1, batch 1 (the 6th step)
        raise Interrupt

  backup_dir = tmp_path / "backup"
  with strategy.scope():
    model = mlp(seed=12)
    model.compile(**compile_args(steps_per_execution=1))
  with pytest.raises(Interrupt):
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
              callbacks=[tk.BackupAndRestore(backup_dir, save_freq=1), StopAt()])
  with strategy.scope():  # a new process would build the model again: start from fresh weights
    model = mlp(seed=99)
    model.compile(**compile_args(steps_per_execution=2))
  history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                      callbacks=[tk.BackupAndRestore(backup_dir, save_freq=1)])
  reference = mlp(seed=12)
  reference.compile(**compile_args())
  expected = reference.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
  assert_histories(history, {k: v[1:] for k, v in expected.history.items()})  # epochs 1 and 2
  assert_weights(model, reference)
  assert int(model.optimizer.iterations.value) == 12
  assert not backup_dir.exists()


@pytest.mark.processes
def test_a_sigterm_backs_up_and_the_restarted_job_resumes_at_that_step(tmp_path):
  """tests/_mp_scripts/keras_backup.py under the launcher (2 x 4, ``--max-restarts 1``): process 1 gets a
  SIGTERM in epoch 1; the job backs up at the step both processes agree on, ends with the restart status
  and is started again; the second start's fit resumes there and its epochs, weights and step count equal
  an uninterrupted one-device Keras fit's."""
  out, results, job = launched_job("keras_backup", str(tmp_path / "backup"), launcher=("--max-restarts", "1"))
  assert "saved checkpoint" in out.stdout + out.stderr and "restarting the job" in out.stderr
  reference = job.build()
  reference.compile(**job.compile_args())
  x, y = job.data()
  expected = reference.fit(x, y, batch_size=job.BATCH, epochs=job.EPOCHS, shuffle=False, verbose=0)
  for got in results.values():
    assert got["start"] == 1
    assert_histories(got["history"], {k: v[1:] for k, v in expected.history.items()})  # the resumed epochs
    for a, b in zip(got["weights"], weights(reference), strict=True):
      assert_close(a, b, scale=np.abs(b).max() + 1.0)
    assert got["iterations"] == int(reference.optimizer.iterations.value)
  assert not (tmp_path / "backup").exists()  # deleted once fit completed


def test_check_numerics_and_step_statistics_under_fit(strategy, rng):
  """What a step under tpustrat gets, fit gets: `set_run_options(check_numerics=True)` names the step and
  output that went NaN (a NaN in row 40 of 64: the third batch of 16); the step statistics count fit's
  steps (4 batches at steps_per_execution 2: 4 steps in 2 programs)."""
  x, y = classification(64, rng)
  with strategy.scope():
    model = mlp(seed=13)
    model.compile(**compile_args(steps_per_execution=2))
  strategy.experimental_step_stats(reset=True)
  model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  stats = strategy.experimental_step_stats(reset=True)
  assert stats.steps == 4, stats
  tk.set_run_options(model, tpustrat.RunOptions(check_numerics=True))
  bad = x.copy()
  bad[40, 0] = np.nan
  with pytest.raises(tpustrat.NumericsError, match="NaN"):
    model.fit(bad, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    strategy.experimental_run_wait()
  with pytest.raises(ValueError, match="donate_argnums"):
    tk.set_run_options(model, tpustrat.RunOptions(donate_argnums=0))
  with pytest.raises(ValueError, match="not compiled under a strategy"):
    tk.set_run_options(mlp(), None)


def test_train_on_batch_and_predict_on_batch_run_on_every_replica(strategy, rng):
  x, y = classification(13, rng)  # one batch of 13 rows: 2 per replica, the last replica's padded
  with strategy.scope():
    model = mlp(seed=14)
    model.compile(**compile_args())
    logs = model.train_on_batch(x, y, return_dict=True)  # inside the scope, as TF allows
  reference = mlp(seed=14)
  reference.compile(**compile_args())
  assert_histories({k: [v] for k, v in logs.items()},
                   {k: [v] for k, v in reference.train_on_batch(x, y, return_dict=True).items()})
  assert_weights(model, reference)
  assert_close(model.test_on_batch(x, y), reference.test_on_batch(x, y))
  assert_close(model.predict_on_batch(x), reference.predict_on_batch(x))


def test_a_model_that_overrides_train_step_is_refused_naming_what_to_override(strategy, rng):
  x, y = classification(16, rng)

  class Custom(keras.Sequential):
    def train_step(self, state, data):  # noqa: D102 - a user's own step
      return super().train_step(state, data)

  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = Custom([keras.Input((10,)), keras.layers.Dense(3)])
    model.compile(**compile_args())
  with pytest.raises(NotImplementedError, match="overrides train_step"):
    model.fit(x, y, batch_size=8, verbose=0)
  assert model.evaluate(x, y, batch_size=8, verbose=0)  # its test_step is Keras's own


def test_backup_and_restore_at_epoch_ends_with_validation_resumes_the_next_epoch(strategy, rng, tmp_path):
  """Backed up at each epoch's end (after validation, whose metrics the model's metrics then hold) and
  interrupted as epoch 2 begins, a new fit resumes at epoch 2 at once (the last backup was finished when
  the interrupted fit raised) with epoch 2's metrics counted from zero."""
  x, y = classification(70, rng)

  class StopAtEpoch2(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
      if epoch == 2:
        raise Interrupt

  kwargs = dict(batch_size=32, epochs=4, shuffle=False, verbose=0, validation_data=(x[:20], y[:20]))
  with strategy.scope():
    model = mlp(seed=18)
    model.compile(**compile_args())
  with pytest.raises(Interrupt):
    model.fit(x, y, callbacks=[tk.BackupAndRestore(tmp_path / "b"), StopAtEpoch2()], **kwargs)
  with strategy.scope():
    model = mlp(seed=98)
    model.compile(**compile_args())
  history = model.fit(x, y, callbacks=[tk.BackupAndRestore(tmp_path / "b")], **kwargs)
  reference = mlp(seed=18)
  reference.compile(**compile_args())
  expected = reference.fit(x, y, **kwargs)
  assert_histories(history, {k: v[2:] for k, v in expected.history.items()})
  assert_weights(model, reference)


@pytest.mark.parametrize("layer", ["LSTM", "GRU"])
def test_recurrent_layers_train_equal_to_one_device(strategy, rng, layer):
  """Keras's recurrent layers run a `lax.scan` whose carry starts the same on every replica; inside a step
  it is typed per replica (tpustrat wraps Keras's `rnn`), so they train, masked and on a partial batch."""
  tokens = rng.integers(1, 20, size=(21, 5)).astype(np.int32)  # batch 16: the last of 5 rows
  tokens[::4, 3:] = 0
  y = rng.normal(size=(21, 1)).astype(np.float32)

  def built():
    keras.utils.set_random_seed(19)
    inputs = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(getattr(keras.layers, layer)(3)(h)))

  model, reference = fit_both(strategy, built, tokens, y)
  assert_close(model.predict(tokens, verbose=0), reference.predict(tokens, verbose=0))


def fit_both(strategy, build, x, y):
  """The model `build` makes, compiled (SGD, MSE) and fit for 2 epochs of batches of 16 under `strategy`
  and on one device; asserts their histories and weights agree and returns (ours, the reference)."""
  with strategy.scope():
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  reference = build()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  assert_histories(history, reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0))
  assert all(np.isfinite(w).all() for w in weights(model))
  assert_weights(model, reference)
  return model, reference


def test_padding_rows_cannot_make_nan_weights(strategy, rng):
  """A masked mean over an all-zero row is 0/0: zero padding rows gave NaN gradients (times a zero weight,
  still NaN) and NaN weights while the loss looked right. Padding rows are copies of a real row: the
  weights stay finite and equal one device's."""
  tokens = rng.integers(1, 20, size=(9, 4)).astype(np.int32)  # one batch of 9 rows on 8 replicas
  y = rng.normal(size=(9, 1)).astype(np.float32)

  def built():
    keras.utils.set_random_seed(20)
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4, mask_zero=True)(inputs))
    return keras.Model(inputs, keras.layers.Dense(1)(h))

  fit_both(strategy, built, tokens, y)  # finite weights, equal to one device's


def test_a_slow_input_under_fit_is_warned_input_bound():
  """fit's steps go through the strategy's step statistics: a generator that takes 25 ms a batch (a slow
  decoder) makes the loop input-bound, and the strategy says so (`InputBoundWarning`), as for `run`."""
  strategy = tpustrat.TPUStrategy()  # its own counters and warnings
  strategy.extended.experimental_input_bound_window = 25

  def slow():
    rng = np.random.default_rng(0)
    for _ in range(60):
      time.sleep(0.025)
      yield rng.normal(size=(16, 10)).astype(np.float32), rng.integers(0, 3, size=16).astype(np.int32)

  with strategy.scope():
    model = mlp(seed=21)
    model.compile(**compile_args())
  with pytest.warns(tpustrat.InputBoundWarning, match="waited for input"):
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", "Your input ran out of data", UserWarning)  # Keras: a generator's end
      model.fit(slow(), epochs=1, shuffle=False, verbose=0)
  assert strategy.experimental_step_stats().steps == 60


@pytest.mark.processes
def test_each_process_reads_only_its_share_of_a_grain_dataset_given_to_fit():
  """tests/_mp_scripts/keras_fit.py grain (2 x 4): fit and evaluate on batched grain MapDatasets (120
  training rows in batches of 32, the last of 24; 30 validation rows). Each process reads only its
  replicas' rows of each batch (replicas 0-3 of 8 hold a batch's first 16 rows, 4 per replica), plus the
  first example of each dataset, which Keras's loop looks at; the numbers equal one-device Keras fit on
  the same datasets."""
  _, results, job = launched_job("keras_fit", "grain")
  reference = job.build()
  reference.compile(**job.compile_args())
  with warnings.catch_warnings():  # Keras's grain adapter has no length: it says so at each epoch's end
    warnings.filterwarnings("ignore", "Your input ran out of data", UserWarning)
    want = job.train_grain(reference)
  k = job.BATCH // 8  # rows per replica, from the first (full) batch
  for process, got in results.items():
    assert got["process"] == process
    assert_histories(got["history"], want["history"])
    for a, b in zip(got["weights"], want["weights"], strict=True):
      assert_close(a, b, scale=np.abs(b).max() + 1.0)
    assert_close(got["evaluate"], want["evaluate"])
    mine = {start + i for start, rows in ((0, 120), (120, job.ROWS - 120))  # training rows, validation rows
            for b in range(0, rows, job.BATCH) for i in range(b, min(b + job.BATCH, rows))
            if (i - b) // (4 * k) == process}
    firsts = {0, 120}  # each dataset's first example, which Keras's loop looks at in every process
    # and the first example of each partial batch: a process whose replicas hold padding rows reads it (the
    # padding rows are copies of the batch's first row, InputOptions.experimental_padding)
    firsts |= {start + rows - rows % job.BATCH for start, rows in ((0, 120), (120, job.ROWS - 120))
               if rows % job.BATCH}
    assert set(got["reads"]) - firsts == mine - firsts, (process, sorted(set(got["reads"]) ^ mine))


def test_a_profile_marks_fits_steps(strategy, rng, tmp_path):
  """fit's programs are steps of the strategy's profile: one mark per program, with its step count (two
  programs of 2 steps for 4 batches at steps_per_execution 2), read back from JAX's trace."""
  import gzip  # noqa: PLC0415
  import json  # noqa: PLC0415

  from tpustrat._src import profiler  # noqa: PLC0415

  x, y = classification(64, rng)
  with strategy.scope():
    model = mlp(seed=22)
    model.compile(**compile_args(steps_per_execution=2))
  model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)  # compiled outside the profile
  first = profiler.steps_dispatched()
  with tpustrat.experimental.profile(tmp_path) as directory:
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    strategy.experimental_run_wait()
  assert profiler.steps_dispatched() == first + 4
  (trace,) = pathlib.Path(directory).glob("plugins/profile/*/*.trace.json.gz")
  with gzip.open(trace) as f:
    events = json.load(f)["traceEvents"]
  marks = sorted((e for e in events if e.get("ph") == "X" and "step_num" in e.get("args", {})), key=lambda e: e["ts"])
  assert [(e["name"], int(e["args"]["step_num"]), int(e["args"]["steps"])) for e in marks] == [
      ("run_steps_keras_train_step", first, 2), ("run_steps_keras_train_step", first + 2, 2)]


def test_the_step_watchdog_notes_fits_programs(strategy, rng):
  """fit's programs reach the step watchdog as every dispatch does: 4 batches at steps_per_execution 2
  are 4 steps noted, in 2 programs, none of them a hang."""
  from tpustrat._src import watchdog  # noqa: PLC0415

  x, y = classification(64, rng)
  with strategy.scope():
    model = mlp(seed=23)
    model.compile(**compile_args(steps_per_execution=2))
  fired = []
  dog = watchdog.Watchdog(60.0, exit_fn=fired.append)
  previous = watchdog.activate(dog)
  try:
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    strategy.experimental_run_wait()
  finally:
    watchdog.activate(previous)
    dog.stop()
  assert dog.steps == 4 and len(dog._recent) == 2 and not fired  # noqa: SLF001


def test_step_results_unwrapped_as_jax_tree_map_would():
  """The state and logs a step returns, without their DistributedValues (`keras_fit._arrays`, which walks
  lists, tuples and dicts itself): the same tree as ``jax.tree.map`` gives, dict keys in JAX's sorted order,
  real-row counts dropped, other nodes (a namedtuple) as JAX rebuilds them."""
  import collections  # noqa: PLC0415

  from tpustrat._src import keras_fit  # noqa: PLC0415
  from tpustrat._src.values import DistributedValues, Mirrored, PerReplica  # noqa: PLC0415

  a, b, counts = jax.numpy.ones(3), jax.numpy.zeros((2, 4)), jax.numpy.array([2, 1])
  pair = collections.namedtuple("pair", "p q")
  tree = ([Mirrored.from_global(a), b], (), {"z": Mirrored.from_global({"k": a}), "a": None, "m": [b]},
          PerReplica.from_stacked(b, counts), pair(Mirrored.from_global(a), b), np.arange(2), None)
  got = keras_fit._arrays(tree)  # noqa: SLF001
  want = jax.tree.map(lambda v: v.tree if isinstance(v, DistributedValues) else v, tree,
                      is_leaf=lambda v: isinstance(v, DistributedValues))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert list(got[2]) == list(want[2]) == ["a", "m", "z"]
  assert all(x is y for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  assert type(got[4]) is pair and type(got[0]) is list and type(got[1]) is tuple
  # The structure is worked out once: the same structure holding other arrays gives those arrays.
  other = jax.tree.map(lambda x: x + 1 if isinstance(x, jax.Array) else x, tree)
  again = keras_fit._arrays(other)  # noqa: SLF001
  want = jax.tree.map(lambda v: v.tree if isinstance(v, DistributedValues) else v, other,
                      is_leaf=lambda v: isinstance(v, DistributedValues))
  assert jax.tree.structure(again) == jax.tree.structure(want)
  assert all(x is y for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(want)))
  # A custom node that checks its children when rebuilt (a user's train_step may return one in its logs).

  class Checked:
    def __init__(self, x):
      if not isinstance(x, jax.Array):
        raise TypeError(f"Checked holds an array, got {type(x).__name__}")
      self.x = x

  jax.tree_util.register_pytree_node(Checked, lambda c: ((c.x,), None), lambda _, children: Checked(children[0]))
  for _ in range(2):  # the structure's verdict is kept: the second call takes it
    got = keras_fit._arrays((Checked(a), Mirrored.from_global(b)))  # noqa: SLF001
    assert type(got[0]) is Checked and got[0].x is a and got[1] is b


def test_check_numerics_raises_a_nan_of_fits_last_steps_before_fit_returns(strategy, rng):
  """A NaN in the 5th of 6 steps (a NaN input row, numpy: NaN propagates into the loss) is read after the
  steps-in-flight bound, past fit's last call: fit waits for its steps before it returns, so fit itself
  raises, naming step 5, and nothing is left for a later call."""
  x, y = classification(96, rng)
  x[70, 2] = np.nan  # batch 5 of 6 (rows 64-79)
  with strategy.scope():
    model = mlp(seed=9)
    model.compile(**compile_args())
  tk.set_run_options(model, tpustrat.RunOptions(check_numerics=True))
  with pytest.raises(tpustrat.NumericsError) as info:
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
  assert info.value.step == 5
  strategy.experimental_run_wait()  # nothing more to report
