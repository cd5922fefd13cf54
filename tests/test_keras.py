"""Keras 3 models (KERAS_BACKEND=jax) trained in `strategy.run` (`tpustrat.keras`), and per-replica random
streams (`tpustrat.replica_key`, `tpustrat.replica_rngs`).

Every expected value is computed without tpustrat: by one-device Keras (its own ``train_on_batch`` on the
same global batches), by numpy (batch norm statistics), or by `jax.random` / flax on one device (masks).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import distribute_batch

import tpustrat

keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":
  pytest.skip(f"Keras runs on {keras.backend.backend()}, not JAX (KERAS_BACKEND=jax)", allow_module_level=True)

from tpustrat import keras as tk  # noqa: E402

N, GLOBAL = 8, 16


def weights(model):
  """The model's weights as numpy arrays (`model.get_weights()` warns under numpy 2: Keras's `__array__`
  takes no `copy`)."""
  return [np.asarray(v.value) for v in model.weights]


def value(variable):
  return np.asarray(variable.value)


def is_dv(v):
  return isinstance(v, tpustrat.DistributedValues)


def sequential(bn=None, dropout=0.0, seed=0):
  keras.utils.set_random_seed(seed)
  layers = [keras.Input((6, 6, 1)), keras.layers.Conv2D(3, 3, kernel_regularizer=keras.regularizers.L2(0.01),
                                                          use_bias=bn is None)]  # a bias before BN: noise
  layers += [bn(momentum=0.8)] if bn else []
  layers += [keras.layers.ReLU(), keras.layers.Flatten(), keras.layers.Dropout(dropout, seed=7),
             keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L1(0.001))]
  return keras.Sequential(layers)


def functional(bn=None, seed=0):
  keras.utils.set_random_seed(seed)
  x = keras.Input((5,))
  h = keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01), use_bias=bn is None)(x)
  h = bn(momentum=0.8)(h) if bn else h
  h = keras.layers.Concatenate()([h, keras.layers.Dense(3, bias_regularizer=keras.regularizers.L2(0.1))(x)])
  return keras.Model(x, keras.layers.Dense(4)(h))


def data(kind, steps, rng):
  shape = (6, 6, 1) if kind == "sequential" else (5,)
  return [(rng.normal(size=(GLOBAL, *shape)).astype(np.float32), rng.integers(0, 4, size=GLOBAL).astype(np.int32))
          for _ in range(steps)]


def make_step(model, optimizer, aggregation="mean"):
  """The guide's step: this replica's rows' loss over the global batch, its regularization losses over the
  number of replicas (TF's compute_average_loss and scale_regularization_loss)."""

  def step(state, x, y):
    ctx = tpustrat.get_replica_context()

    def loss_fn(trainable, non_trainable):
      logits, non_trainable, losses = tk.stateless_call(model, trainable, non_trainable, x, training=True,
                                                        aggregation=aggregation)
      per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
      loss = tpustrat.compute_average_loss(per_example) + tpustrat.scale_regularization_loss(sum(losses))
      return loss, non_trainable

    (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"],
                                                                             state["non_trainable"])
    trainable, opt = optimizer.stateless_apply(state["optimizer"], grads, state["trainable"])
    return {"trainable": trainable, "non_trainable": non_trainable, "optimizer": opt}, ctx.all_reduce("sum", loss)

  return step


def one_device_keras(build, batches):
  """Keras's own training (train_on_batch) on one device: its losses, then the model."""
  model = build()
  model.compile(optimizer=keras.optimizers.Adam(0.01),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  losses = [float(model.train_on_batch(x, y)) for x, y in batches]
  return losses, model


def ours(strategy, build, batches, aggregation="mean"):
  model, optimizer = build(), keras.optimizers.Adam(0.01)
  state = strategy.experimental_mirror(tk.state(model, optimizer))
  step = make_step(model, optimizer, aggregation)
  losses = []
  for x, y in batches:
    state, loss = strategy.run(step, args=(state, distribute_batch(strategy, x), distribute_batch(strategy, y)))
    losses.append(float(loss))
  return losses, state, model, optimizer


@pytest.mark.parametrize("kind", ["sequential", "functional"])
def test_losses_and_weights_equal_one_device_keras_without_batchnorm(strategy, rng, kind):
  build = sequential if kind == "sequential" else functional
  batches = data(kind, 2, rng)
  want, reference = one_device_keras(build, batches)
  got, state, model, optimizer = ours(strategy, build, batches)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert all(isinstance(v, tpustrat.Mirrored) for v in jax.tree.leaves(state, is_leaf=is_dv))
  tk.assign(model, optimizer, state)
  for mine, theirs in zip(weights(model), weights(reference)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_sync_batchnorm_equals_one_device_keras_on_the_global_batch(strategy, rng):
  batches = data("sequential", 3, rng)
  want, reference = one_device_keras(lambda: sequential(keras.layers.BatchNormalization), batches)
  got, state, model, optimizer = ours(strategy, lambda: sequential(tk.SyncBatchNormalization), batches)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert all(isinstance(v, tpustrat.Mirrored) for v in jax.tree.leaves(state, is_leaf=is_dv))
  tk.assign(model, optimizer, state)
  bn, bn_ref = model.layers[1], reference.layers[1]
  np.testing.assert_allclose(value(bn.moving_mean), value(bn_ref.moving_mean), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(value(bn.moving_variance), value(bn_ref.moving_variance), rtol=1e-5)
  for mine, theirs in zip(weights(model), weights(reference)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
  x = batches[0][0][:4]  # outside run it is plain BatchNormalization (the moving statistics)
  np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def numpy_moving_statistics(batches, momentum, per_replica):
  """TF's rule: each replica's moving averages of its own rows' statistics, averaged on read (numpy)."""
  features = batches[0][0].shape[-1]
  mean, var = np.zeros((N, features)), np.ones((N, features))
  for x, _ in batches:
    parts = x.reshape(N, GLOBAL // N, -1) if per_replica else np.broadcast_to(x, (N, *x.shape))
    mean = momentum * mean + (1 - momentum) * parts.mean(axis=1)
    var = momentum * var + (1 - momentum) * parts.var(axis=1)
  return mean.mean(axis=0), var.mean(axis=0)


@pytest.mark.parametrize("aggregation", ["mean", "none"])
def test_plain_batchnorm_statistics_are_the_mean_of_the_replicas(strategy, rng, aggregation):
  """Unsynchronised: each replica normalises by its own rows; the moving statistics read as their mean
  over the replicas (averaged in the step with "mean", on read by `assign` with "none")."""
  def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(momentum=0.7), keras.layers.Dense(4)])

  batches = [(rng.normal(2.0, 3.0, size=(GLOBAL, 3)).astype(np.float32), rng.integers(0, 4, GLOBAL).astype(np.int32))
             for _ in range(3)]
  _, state, model, optimizer = ours(strategy, build, batches, aggregation)
  kinds = {type(v).__name__ for v in state["non_trainable"]}
  assert kinds == ({"Mirrored"} if aggregation == "mean" else {"PerReplica"}), kinds
  tk.assign(model, optimizer, state)
  mean, var = numpy_moving_statistics(batches, 0.7, per_replica=True)
  np.testing.assert_allclose(value(model.layers[0].moving_mean), mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(value(model.layers[0].moving_variance), var, rtol=1e-5)
  # the mean of the replicas' variances is not the global batch's variance (what SyncBatchNormalization gives)
  _, global_var = numpy_moving_statistics(batches, 0.7, per_replica=False)
  assert not np.allclose(var, global_var, rtol=1e-2)


# -- per-replica random streams -----------------------------------------------------------------------------


def dropout_model(seed=11):
  return keras.Sequential([keras.Input((32,)), keras.layers.Dropout(0.5, seed=seed)])


def keras_dropout_step(model):
  def step(non_trainable, x):
    out, non_trainable, _ = tk.stateless_call(model, [], non_trainable, x, training=True)
    return non_trainable, out
  return step


def expected_masks(seed, counter, shape):
  """Replica r's Keras dropout mask at the generator's `counter`, by jax.random alone."""
  key = jnp.array([seed, counter], jnp.uint32)
  return np.stack([np.asarray(jax.random.bernoulli(jax.random.fold_in(key, r), 0.5, shape)) for r in range(N)])


def test_keras_dropout_draws_each_replicas_own_mask_and_reproduces(strategy):
  model = dropout_model()
  step = keras_dropout_step(model)
  x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((2, 32), np.float32))
  seeds = strategy.experimental_mirror(tk.state(model)["non_trainable"])
  runs = []
  for _ in range(2):  # the same seed twice: the same run
    state, outs = seeds, []
    for _ in range(3):
      state, out = strategy.run(step, args=(state, x))
      outs.append(np.stack([np.asarray(v) for v in out.values]))
    runs.append(outs)
    assert isinstance(state[0], tpustrat.Mirrored)
    np.testing.assert_array_equal(np.asarray(state[0]), [11, 3])  # Keras's counter: one draw per call
  for counter, out in enumerate(runs[0]):
    np.testing.assert_array_equal(out != 0, expected_masks(11, counter, (2, 32)))
    assert len({m.tobytes() for m in (out != 0)}) == N  # every replica its own mask
    np.testing.assert_array_equal(out, runs[1][counter])
  assert not np.array_equal(runs[0][0], runs[0][1])  # the stream advances per step


def test_keras_seed_state_restored_from_a_checkpoint_continues_the_stream(strategy, tmp_path):
  model = dropout_model(seed=5)
  step = keras_dropout_step(model)
  x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((2, 32), np.float32))
  state = strategy.experimental_mirror(tk.state(model)["non_trainable"])
  state, _ = strategy.run(step, args=(state, x))
  with tpustrat.checkpoint.CheckpointManager(tmp_path, strategy, max_to_keep=1) as manager:
    manager.save(1, state)
    manager.wait_until_finished()
    restored = manager.restore(1, target=state)
  _, uninterrupted = strategy.run(step, args=(state, x))
  _, resumed = strategy.run(step, args=(restored, x))
  for a, b in zip(uninterrupted.values, resumed.values):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(np.stack(resumed.values) != 0, expected_masks(5, 1, (2, 32)))


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_replica_key_folds_in_the_replica_id(strategy, kind):
  key = jax.random.key(3) if kind == "typed" else jax.random.PRNGKey(3)

  def step(key):
    return jax.random.uniform(tpustrat.replica_key(key), (4,))

  out = strategy.run(step, args=(key,))
  want = np.stack([np.asarray(jax.random.uniform(jax.random.fold_in(key, r), (4,))) for r in range(N)])
  np.testing.assert_array_equal(np.stack(out.values), want)
  assert len({row.tobytes() for row in want}) == N
  # under the default strategy the one replica is replica 0
  np.testing.assert_array_equal(step(key), want[0])


def test_replica_key_refuses_what_is_not_one_key(strategy):
  with pytest.raises(TypeError, match=r"replica_key: expected a JAX PRNG key .* got ndarray of dtype int32"):
    tpustrat.replica_key(np.zeros(2, np.int32))
  with pytest.raises(TypeError, match=r"expected one key \(shape \(\)\), got a typed key array of shape \(2,\)"):
    tpustrat.replica_key(jax.random.split(jax.random.key(0)))
  with strategy.scope(), pytest.raises(RuntimeError, match="cross-replica context"):
    tpustrat.replica_key(jax.random.key(0))


def test_nnx_rngs_draw_each_replicas_own_mask(strategy):
  from flax import nnx

  model = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=9))
  graphdef, state = nnx.split(model)
  x = np.ones((2, 16), np.float32)

  def step(state):
    model = nnx.merge(graphdef, state)
    with tpustrat.replica_rngs(model):
      out = model(x)
    return nnx.state(model), out

  new_state, out = strategy.run(step, args=(strategy.experimental_mirror(state),))
  assert all(isinstance(v, tpustrat.Mirrored) for v in jax.tree.leaves(new_state, is_leaf=is_dv))
  for r in range(N):  # replica r draws what flax draws on one device from its stream keyed fold_in(key, r)
    alone = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=9))  # the same model, fresh, on one device
    nnx.update(alone, jax.tree.map(lambda k, r=r: jax.random.fold_in(k, r), nnx.state(alone, nnx.RngKey)))
    np.testing.assert_array_equal(out.values[r], alone(x))
  assert len({np.asarray(v).tobytes() for v in out.values}) == N
  # the key that leaves the step is the shared one, its count advanced by the one draw
  after = nnx.merge(graphdef, jax.tree.map(jnp.asarray, new_state, is_leaf=is_dv))
  key_in, = jax.tree.leaves(nnx.state(model, nnx.RngKey))
  key_out, = jax.tree.leaves(nnx.state(after, nnx.RngKey))
  np.testing.assert_array_equal(jax.random.key_data(key_out), jax.random.key_data(key_in))
  count, = jax.tree.leaves(nnx.state(after, nnx.RngCount))
  assert int(count) == 1


# -- errors ---------------------------------------------------------------------------------------------------


def test_bad_input_is_refused_with_a_clear_error(strategy):
  with pytest.raises(TypeError, match="expected a Keras model or layer"):
    tk.state({"w": 1})
  with pytest.raises(ValueError, match="is not built"):
    tk.state(keras.Sequential([keras.layers.Dense(2)]))
  model = dropout_model()
  with pytest.raises(TypeError, match="expected a keras.optimizers.Optimizer or None; got str"):
    tk.state(model, "adam")
  with pytest.raises(ValueError, match=r"state\['non_trainable'\] has 0 values; the model .* has 1"):
    tk.assign(model, None, {"trainable": [], "non_trainable": []})
  with pytest.raises(ValueError, match="aggregation='sum'; expected one of"):
    tk.stateless_call(model, [], [np.zeros(2, np.uint32)], np.ones((1, 32)), aggregation="sum")
  dense = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
  per_replica = strategy.run(lambda: jnp.zeros((2, 1)) + tpustrat.get_replica_context().replica_id_in_sync_group)
  with pytest.raises(ValueError, match=r"state\['trainable'\]\[0\] .* is a PerReplica value"):
    tk.assign(dense, None, {"trainable": [per_replica, np.zeros(1)], "non_trainable": []})
  with pytest.raises(ValueError, match="drop synchronized=True"):
    tk.SyncBatchNormalization(synchronized=True)


def test_the_private_batchnorm_hook_is_checked():
  from tpustrat._src import keras_models

  class NoHook:
    pass

  class OtherHook:
    def _moments(self, inputs):
      return inputs

  keras_models._check_moments_hook(keras.layers.BatchNormalization, keras.__version__)  # this Keras has it
  with pytest.raises(RuntimeError, match=r"Keras 9.9 has no such method"):
    keras_models._check_moments_hook(NoHook, "9.9")
  with pytest.raises(RuntimeError, match=r"Keras 9.9 has _moments\('self', 'inputs'\)"):
    keras_models._check_moments_hook(OtherHook, "9.9")


def test_the_private_variable_hooks_are_checked():
  from keras.src import backend

  from tpustrat._src import keras_models

  class NoProperty:
    def value(self):
      return 0

    def assign(self, value):
      return value

  class OtherAssign:
    @property
    def value(self):
      return 0

    def assign(self, value, read_value):
      return value

  class NoScopes:
    get_stateless_scope = backend.get_stateless_scope

  keras_models._variable_hooks(keras.Variable, backend, keras.__version__)  # this Keras has them
  with pytest.raises(RuntimeError, match=r"Keras 9\.9 has value: no property"):
    keras_models._variable_hooks(NoProperty, backend, "9.9")
  with pytest.raises(RuntimeError, match=r"Keras 9\.9 has value: a property, assign: "
                                         r"\('self', 'value', 'read_value'\)"):
    keras_models._variable_hooks(OtherAssign, backend, "9.9")
  with pytest.raises(RuntimeError, match=r"in_symbolic_scope: missing"):
    keras_models._variable_hooks(keras.Variable, NoScopes, "9.9")


def test_sync_batchnorm_on_a_partial_batch_uses_the_real_examples_only(strategy, rng):
  # 16 then 11 examples: the second batch is padded (replicas 5-7 hold padding rows). One device trains on
  # the 11 real examples; the padding must weigh nothing in the statistics and the loss.
  full = data("sequential", 1, rng)[0]
  partial = tuple(a[:11] for a in data("sequential", 1, rng)[0])
  want, reference = one_device_keras(lambda: sequential(keras.layers.BatchNormalization), [full, partial])
  model, optimizer = sequential(tk.SyncBatchNormalization), keras.optimizers.Adam(0.01)
  state = strategy.experimental_mirror(tk.state(model, optimizer))
  step = make_step(model, optimizer)
  got = []
  for x, y in strategy.experimental_distribute_dataset([full, partial]):
    state, loss = strategy.run(step, args=(state, x, y))
    got.append(float(loss))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  tk.assign(model, optimizer, state)
  bn, bn_ref = model.layers[1], reference.layers[1]
  np.testing.assert_allclose(value(bn.moving_mean), value(bn_ref.moving_mean), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(value(bn.moving_variance), value(bn_ref.moving_variance), rtol=1e-5)


@pytest.mark.parametrize("layer", ["LSTM", "GRU", "SimpleRNN"])
def test_recurrent_layers_in_run_equal_one_device(strategy, layer):
  """Keras's recurrent layers inside `strategy.run` (through `stateless_call`): the scan's initial states
  are typed per replica, so they trace (JAX refused the carry before) and the loss and gradients of the
  global batch equal one-device Keras's."""
  rng = np.random.default_rng(3)
  keras.utils.set_random_seed(3)
  model = keras.Sequential([keras.Input((5, 3)), getattr(keras.layers, layer)(4), keras.layers.Dense(1)])
  x = rng.normal(size=(GLOBAL, 5, 3)).astype(np.float32)
  y = rng.normal(size=(GLOBAL, 1)).astype(np.float32)
  state = strategy.experimental_mirror(tk.state(model))

  def step(state, batch):
    xb, yb = batch

    def loss_fn(trainable):
      pred, _, _ = tk.stateless_call(model, trainable, state["non_trainable"], xb)
      return tpustrat.compute_average_loss(jnp.mean((pred - yb) ** 2, axis=-1), global_batch_size=GLOBAL)

    loss, grads = jax.value_and_grad(loss_fn)(state["trainable"])
    return tpustrat.get_replica_context().all_reduce("sum", loss), grads

  (batch,) = list(strategy.experimental_distribute_dataset([(x, y)]))
  loss, grads = strategy.run(step, args=(state, batch))

  def reference(trainable):
    pred, _ = model.stateless_call(trainable, [value(v) for v in model.non_trainable_variables], x)
    return jnp.mean((pred - y) ** 2)

  want_loss, want_grads = jax.value_and_grad(reference)([value(v) for v in model.trainable_variables])
  np.testing.assert_allclose(np.asarray(loss.values[0]), want_loss, rtol=1e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(got.values[0]), want, rtol=1e-5, atol=1e-6 * (np.abs(want).max() + 1))


# -- partial batches in a custom loop: batch norm, activity regularizers, metrics -----------------------------
# Each holds whatever the padding rows hold (copies of the batch's first row, or zeros): only the real rows'
# results are compared, against one-device Keras on those rows.

PADDINGS = ["first_row", "zeros"]


def padded_dataset(strategy, batches, padding):
  return strategy.experimental_distribute_dataset(batches, options=tpustrat.InputOptions(experimental_padding=padding))


def replica_rows(x, k):
  """Each replica's real rows of global batch `x` as the input pipeline splits it: replica r takes rows
  [r * k, (r + 1) * k), k the dataset's per-replica rows (the last replicas of a partial batch may hold
  fewer, or none)."""
  return [x[r * k:(r + 1) * k] for r in range(N)]


@pytest.mark.parametrize("padding, aggregation", [("first_row", "mean"), ("zeros", "none")])
def test_plain_batchnorm_on_a_partial_batch_uses_each_replicas_real_rows(strategy, rng, padding, aggregation):
  """Plain BatchNormalization after Dense(use_bias=False), per replica, on 16 then 13 rows (replica 6 holds
  one real row, replica 7 none): each replica's statistics are its real rows' (TF hands it only those), and
  a replica without rows updates no moving statistics. With "mean" they are averaged in the step over the
  replicas that held rows; with "none" each replica keeps its own and `assign` averages them on read.
  The reference runs one-device Keras (`model.stateless_call`) on each replica's real rows with that
  replica's moving statistics, sums the losses (over the 13 real rows) and their gradients, and applies
  Keras's own SGD."""
  def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, use_bias=False),
                             keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(1)])

  batches = [{"x": rng.normal(1.0, 2.0, size=(n, 5)).astype(np.float32), "y": rng.normal(size=(n, 1)).astype(np.float32)}
             for n in (GLOBAL, 13)]
  k = GLOBAL // N
  reference, ref_optimizer = build(), keras.optimizers.SGD(0.1)
  moving = [[value(v) for v in reference.non_trainable_variables] for _ in range(N)]  # each replica's

  def replicas_on_one_device(trainable, held, n):
    total, statistics = 0.0, {}
    for r, x, y in held:  # one replica's real rows at a time
      pred, statistics[r] = reference.stateless_call(trainable, moving[r], x, training=True)
      total += jnp.sum((pred - y) ** 2) / n
    return total, statistics

  want = []
  for batch in batches:
    held = [(r, x, y) for r, (x, y) in enumerate(zip(replica_rows(batch["x"], k), replica_rows(batch["y"], k))) if len(x)]
    (loss, statistics), grads = jax.value_and_grad(replicas_on_one_device, has_aux=True)(
        [value(v) for v in reference.trainable_variables], held, len(batch["x"]))
    want.append(float(loss))
    ref_optimizer.apply(grads, reference.trainable_variables)
    for r, new in statistics.items():
      moving[r] = [np.asarray(v) for v in new]
    if aggregation == "mean":  # averaged over the replicas that held rows, the same on every replica after
      moving = [[np.mean([moving[r][i] for r in statistics], axis=0) for i in range(len(moving[0]))]] * N
  for i, variable in enumerate(reference.non_trainable_variables):  # read: the mean over the replicas
    variable.assign(np.mean([m[i] for m in moving], axis=0))

  model, optimizer = build(), keras.optimizers.SGD(0.1)
  state = strategy.experimental_mirror(tk.state(model, optimizer))

  def step(state, batch):
    def loss_fn(trainable):
      pred, non_trainable, _ = tk.stateless_call(model, trainable, state["non_trainable"], batch["x"], training=True,
                                                 aggregation=aggregation)
      return tpustrat.compute_average_loss(jnp.mean((pred - batch["y"]) ** 2, axis=-1)), non_trainable

    (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"])
    trainable, opt = optimizer.stateless_apply(state["optimizer"], grads, state["trainable"])
    return ({"trainable": trainable, "non_trainable": non_trainable, "optimizer": opt},
            tpustrat.get_replica_context().all_reduce("sum", loss))

  got = []
  for batch in padded_dataset(strategy, batches, padding):
    state, loss = strategy.run(step, args=(state, batch))
    got.append(float(loss))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  kinds = {type(v).__name__ for v in state["non_trainable"]}
  assert kinds == ({"Mirrored"} if aggregation == "mean" else {"PerReplica"}), kinds
  tk.assign(model, optimizer, state)
  for mine, theirs in zip(weights(model), weights(reference)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padding", PADDINGS)
def test_activity_regularizer_on_a_partial_batch_equals_one_device_keras(strategy, rng, padding):
  """Keras's L1L2 activity regularizer of a Dense without a bias, on 16 then 15 rows: the regularization
  loss is the real rows' over their count (Keras divides by the batch's rows), as one-device Keras's
  `train_on_batch` on the 15 real rows computes it, not each replica's padded rows over k."""
  def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(4, use_bias=False, activity_regularizer=keras.regularizers.L1L2(l1=0.05, l2=0.1)),
        keras.layers.Dense(1)])

  batches = [(rng.normal(size=(n, 5)).astype(np.float32), rng.normal(size=(n, 1)).astype(np.float32))
             for n in (GLOBAL, 15)]
  reference = build()
  reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  want = [float(reference.train_on_batch(x, y)) for x, y in batches]

  model, optimizer = build(), keras.optimizers.SGD(0.1)
  regularizer = model.layers[0].activity_regularizer
  state = strategy.experimental_mirror(tk.state(model, optimizer))

  def step(state, batch):
    def loss_fn(trainable):
      pred, _, losses = tk.stateless_call(model, trainable, state["non_trainable"], batch["x"], training=True)
      per_example = jnp.mean((pred - batch["y"]) ** 2, axis=-1)
      return tpustrat.compute_average_loss(per_example) + tpustrat.scale_regularization_loss(sum(losses))

    loss, grads = jax.value_and_grad(loss_fn)(state["trainable"])
    trainable, opt = optimizer.stateless_apply(state["optimizer"], grads, state["trainable"])
    return dict(state, trainable=trainable, optimizer=opt), tpustrat.get_replica_context().all_reduce("sum", loss)

  got = []
  for batch in padded_dataset(strategy, [{"x": x, "y": y} for x, y in batches], padding):
    state, loss = strategy.run(step, args=(state, batch))
    got.append(float(loss))
  np.testing.assert_allclose(got, want, rtol=1e-5)
  tk.assign(model, optimizer, state)
  for mine, theirs in zip(weights(model), weights(reference)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
  assert model.layers[0].activity_regularizer is regularizer  # the layer's own again (what model.save writes)


@pytest.mark.parametrize("padding", PADDINGS)
def test_keras_metrics_updated_in_run_count_the_real_rows_only(strategy, rng, padding):
  """Keras metrics updated the Keras-on-JAX way inside `strategy.run` (`metric.stateless_update_state`),
  on 32 then 29 rows: the padding rows weigh nothing and the replicas' updates are summed (TF's SyncOnRead
  read), so the variables stay Mirrored and equal one-device Keras metrics updated with the real rows."""
  def metrics():
    return [keras.metrics.Mean(), keras.metrics.MeanSquaredError(), keras.metrics.SparseCategoricalAccuracy()]

  batches = [{"x": rng.normal(size=(n, 3)).astype(np.float32), "y": rng.integers(0, 3, size=n).astype(np.int32),
              "w": rng.uniform(0.5, 2.0, size=n).astype(np.float32)} for n in (2 * GLOBAL, 29)]
  reference = metrics()
  for b in batches:  # one device, eagerly, on the real rows
    reference[0].update_state(np.sum(b["x"] ** 2, axis=-1))
    reference[1].update_state(np.eye(3, dtype=np.float32)[b["y"]], b["x"])
    reference[2].update_state(b["y"], b["x"], sample_weight=b["w"])

  with strategy.scope():  # TF's way: the metrics made in the scope (which also has tpustrat wrap Keras's update)
    ours = metrics()

  def step(variables, batch):
    mean, mse, accuracy = ours
    return [mean.stateless_update_state(variables[0], jnp.sum(batch["x"] ** 2, axis=-1)),
            mse.stateless_update_state(variables[1], jax.nn.one_hot(batch["y"], 3), batch["x"]),
            accuracy.stateless_update_state(variables[2], batch["y"], batch["x"], sample_weight=batch["w"])]

  variables = strategy.experimental_mirror([[v.value for v in m.variables] for m in ours])
  for batch in padded_dataset(strategy, batches, padding):
    variables = strategy.run(step, args=(variables, batch))
  assert all(isinstance(v, tpustrat.Mirrored) for v in jax.tree.leaves(variables, is_leaf=is_dv))
  for metric, theirs, mine in zip(ours, reference, variables):
    for v, want in zip(mine, theirs.variables):  # totals and counts: 61 examples, not 64
      np.testing.assert_allclose(np.asarray(v), value(want), rtol=1e-5)
    np.testing.assert_allclose(metric.stateless_result([np.asarray(v) for v in mine]), theirs.result(), rtol=1e-5)


# -- Keras's loss scaling, metrics and step count in a custom loop, the TF way ---------------------------------


def loss_scale_optimizer(learning_rate=0.1):
  """Keras's LossScaleOptimizer over SGD (whose step is proportional to the gradient, so a wrong unscale
  shows), with a scale that doubles every two finite steps."""
  return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate), initial_scale=2.0**10,
                                             dynamic_growth_steps=2)


def dense_model():
  keras.utils.set_random_seed(0)
  return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(4)])


def scaled_step(model, optimizer):
  """The mixed-precision custom loop's step: the loss scaled by the optimizer state's scale
  (`tk.scale_loss`), the gradients of the scaled loss unscaled (and a non-finite step skipped) by
  `stateless_apply`; the unscaled loss reported."""

  def step(state, batch):
    x, y = batch

    def loss_fn(trainable):
      logits, non_trainable, _ = tk.stateless_call(model, trainable, state["non_trainable"], x, training=True)
      per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
      loss = tpustrat.compute_average_loss(per_example)
      return tk.scale_loss(optimizer, state["optimizer"], loss), (loss, non_trainable)

    (_, (loss, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["trainable"])
    trainable, opt = optimizer.stateless_apply(state["optimizer"], grads, state["trainable"])
    new = {"trainable": trainable, "non_trainable": non_trainable, "optimizer": opt}
    return new, tpustrat.get_replica_context().all_reduce("sum", loss)

  return step


def one_device_scaled(batches, learning_rate=0.1):
  """One-device Keras `train_on_batch` with the same LossScaleOptimizer: its losses and its model."""
  reference = dense_model()
  reference.compile(optimizer=loss_scale_optimizer(learning_rate),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  return [float(reference.train_on_batch(x, y)) for x, y in batches], reference


def scaled_batches(rng, steps, inf_at=None):
  batches = [(rng.normal(size=(GLOBAL, 5)).astype(np.float32), rng.integers(0, 4, GLOBAL).astype(np.int32))
             for _ in range(steps)]
  if inf_at is not None:  # one row on one replica: every replica's summed gradient is non-finite
    batches[inf_at][0][3, 1] = np.inf
  return batches


def test_keras_loss_scaling_in_a_step_equals_one_device_keras(strategy, rng):
  """Keras's LossScaleOptimizer in a custom loop over 7 steps: the scale doubles every two finite steps and
  halves at the step whose gradients are not finite (that step skipped on every replica). The loss is scaled
  by the scale in the step's state (`tk.scale_loss`), as Keras's own train step does: the losses, weights,
  scale and step count equal one-device Keras's `train_on_batch`. (`optimizer.scale_loss(loss)` read the
  Keras variable, 2**10 for ever in the compiled program, while `stateless_apply` unscaled by 2**11 and on.)"""
  batches = scaled_batches(rng, 7, inf_at=3)
  want, reference = one_device_scaled(batches)
  ref_scale = float(value(reference.optimizer.dynamic_scale))
  assert ref_scale not in (2.0**10, 2.0**13)  # it grew and it halved: the test exercises both

  model, optimizer = dense_model(), loss_scale_optimizer()
  state = strategy.experimental_mirror(tk.state(model, optimizer))
  step = scaled_step(model, optimizer)
  got = []
  for batch in strategy.experimental_distribute_dataset(batches):
    state, loss = strategy.run(step, args=(state, batch))
    got.append(float(loss))
  np.testing.assert_allclose(got, want, rtol=1e-5)  # the skipped step's loss is inf / NaN on both
  for mine, theirs in zip(state["optimizer"], reference.optimizer.variables):
    np.testing.assert_allclose(np.asarray(mine), value(theirs), rtol=1e-6)  # scale, counters, steps
  assert tk.iterations(optimizer, state["optimizer"]) == int(value(reference.optimizer.iterations))
  tk.assign(model, optimizer, state)
  for mine, theirs in zip(weights(model), weights(reference)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_resume_reads_the_step_from_the_restored_state(strategy, rng, tmp_path):
  """Model Garden's resume: a restarted job restores the state and reads the global step. The step lives in
  the optimizer's variables (a LossScaleOptimizer's inner optimizer counts it): `tk.iterations` reads it
  from the restored state, while the new process's Keras objects still hold their initial values (step 0,
  the schedule's first learning rate) until `tk.assign` writes the state into them: reading them before
  raises `tk.StaleVariableError` (TF's `optimizer.iterations.numpy()` read 0 with no word). Training then
  goes on as one-device Keras's uninterrupted `train_on_batch`."""
  batches = scaled_batches(rng, 5)
  schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.8)
  want, reference = one_device_scaled(batches, schedule)
  kept = 3

  model, optimizer = dense_model(), loss_scale_optimizer(schedule)
  state = strategy.experimental_mirror(tk.state(model, optimizer))
  step = scaled_step(model, optimizer)
  dataset = list(strategy.experimental_distribute_dataset(batches))
  for batch in dataset[:kept]:
    state, _ = strategy.run(step, args=(state, batch))
  with tpustrat.checkpoint.CheckpointManager(tmp_path, strategy) as manager:
    manager.save(kept, state)
    manager.wait_until_finished()

  # the restarted process: new Keras objects, the state restored into a pytree of theirs
  model, optimizer = dense_model(), loss_scale_optimizer(schedule)
  state = strategy.experimental_mirror(tk.state(model, optimizer))
  with tpustrat.checkpoint.CheckpointManager(tmp_path, strategy) as manager:
    state = manager.restore(manager.latest_step(), target=state)
  assert tk.iterations(optimizer, state["optimizer"]) == kept
  # TF's `optimizer.iterations.numpy()` here: the Keras object is stale (step 0) until assign, and says so
  stale = r"'[^']*iteration' is stale: .*a checkpoint was restored.*tpustrat\.keras\.assign\(model, optimizer, state\)"
  with pytest.raises(tk.StaleVariableError, match=stale):
    optimizer.iterations.numpy()
  with pytest.raises(tk.StaleVariableError, match=stale):
    float(np.asarray(optimizer.learning_rate))  # the schedule of the stale step
  with pytest.raises(tk.StaleVariableError, match=r"is stale: .*a checkpoint was restored.*tpustrat\.keras\.assign"):
    model.get_weights()  # the initial weights, not the restored ones
  tk.assign(model, optimizer, state)
  assert int(value(optimizer.iterations)) == kept
  assert float(np.asarray(optimizer.learning_rate)) == pytest.approx(float(schedule(kept)), rel=1e-6)

  step = scaled_step(model, optimizer)
  got = []
  for batch in dataset[kept:]:
    state, loss = strategy.run(step, args=(state, batch))
    got.append(float(loss))
  np.testing.assert_allclose(got, want[kept:], rtol=1e-5)
  assert tk.iterations(optimizer, state["optimizer"]) == int(value(reference.optimizer.iterations))
  tk.assign(model, optimizer, state)
  for mine, theirs in zip(weights(model), weights(reference)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


# -- host reads of Keras objects while a custom loop's state moves on ------------------------------------------


def numpy_logits(params, x):
  """`dense_model`'s forward pass in numpy: relu(x w0 + b0) w1 + b1."""
  w0, b0, w1, b1 = (np.asarray(p, np.float64) for p in params)
  return np.maximum(x @ w0 + b0, 0.0) @ w1 + b1


def test_a_host_read_of_a_stale_keras_object_raises_until_assign(strategy, rng, tmp_path):
  """After `tk.state`, a training step in `run` changes the state, not the Keras objects: TF's host reads of
  them (`optimizer.iterations.numpy()`, `model.get_weights()`, `model.predict`, `model.save`) gave the values
  from before with no word; each now raises StaleVariableError naming `tk.assign`. After `tk.assign` they read
  the trained values: the state's arrays, one-device Keras's after the same batch, numpy's forward pass. A
  step that only reads the state (evaluation), a variable no step writes (the learning rate) and a model
  never exported are left as they are."""
  batches = scaled_batches(rng, 2)
  want, reference = one_device_scaled(batches[:1])
  bystander = dense_model()  # never exported: Keras as Keras is
  initial = weights(bystander)
  model, optimizer = dense_model(), loss_scale_optimizer()
  state = strategy.experimental_mirror(tk.state(model, optimizer))
  dataset = list(strategy.experimental_distribute_dataset(batches))
  x = batches[0][0]

  def evaluate(state, batch):
    logits, _, _ = tk.stateless_call(model, state["trainable"], state["non_trainable"], batch[0])
    return logits

  strategy.run(evaluate, args=(state, dataset[0]))  # reads the state only: the Keras objects stay current
  np.testing.assert_allclose(model.predict(x, verbose=0), numpy_logits(weights(model), x), rtol=1e-5, atol=1e-5)
  assert int(value(optimizer.iterations)) == 0

  state, loss = strategy.run(scaled_step(model, optimizer), args=(state, dataset[0]))
  np.testing.assert_allclose(float(loss), want[0], rtol=1e-5)
  stale = r"'{}' is stale: .* since then strategy\.run / experimental_run_steps dispatched {} steps?, and steps that write it .*`tpustrat\.keras\.assign\(model, optimizer, state\)`"
  kernel = model.layers[0].kernel.path
  for read, path in [(lambda: optimizer.iterations.numpy(), optimizer.iterations.path),
                     (model.get_weights, kernel),
                     (lambda: model.predict(x, verbose=0), kernel),
                     (lambda: model.save(tmp_path / "stale.keras"), kernel),
                     (lambda: float(np.asarray(optimizer.dynamic_scale)), optimizer.dynamic_scale.path)]:
    with pytest.raises(tk.StaleVariableError, match=stale.format(path, r"\d")):
      read()
  assert float(np.asarray(optimizer.learning_rate)) == pytest.approx(0.1)  # no step writes it: current
  for mine, theirs in zip(weights(bystander), initial, strict=True):
    np.testing.assert_array_equal(mine, theirs)
  np.testing.assert_allclose(bystander.predict(x, verbose=0), numpy_logits(initial, x), rtol=1e-5, atol=1e-5)

  tk.assign(model, optimizer, state)
  assert int(value(optimizer.iterations)) == 1 == tk.iterations(optimizer, state["optimizer"])
  for mine, theirs in zip(weights(model), state["trainable"], strict=True):
    np.testing.assert_array_equal(mine, np.asarray(theirs))
  for mine, theirs in zip(weights(model), weights(reference), strict=True):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(model.predict(x, verbose=0), numpy_logits(weights(model), x), rtol=1e-5, atol=1e-5)
  model.save(tmp_path / "trained.keras")
  for mine, saved in zip(weights(model), weights(keras.models.load_model(tmp_path / "trained.keras")), strict=True):
    np.testing.assert_array_equal(mine, saved)

  # a loop of steps in one program: stale again, until assign
  state, _ = strategy.experimental_run_steps(scaled_step(model, optimizer),
                                             iter(strategy.experimental_distribute_dataset(batches[1:])), 1,
                                             init=state)
  with pytest.raises(tk.StaleVariableError, match=stale.format(kernel, 1)):
    model.get_weights()
  tk.assign(model, optimizer, state)
  assert int(value(optimizer.iterations)) == 2


def test_keras_fit_after_a_custom_loop_starts_from_the_assigned_state(strategy, rng):
  """A model trained in `run` and then by Keras's own `fit` (compiled under the strategy): `fit` before
  `tk.assign` would start from the values before the custom loop, and raises; after it, `fit` goes on from
  the state as one-device Keras's `train_on_batch` does. Keras's own steps (fit, evaluate, predict) keep the
  Keras objects current (Keras writes its state back): reading them after is no false alarm."""
  batches = data("functional", 2, rng)
  want, reference = one_device_keras(lambda: functional(), batches)
  with strategy.scope():
    model = functional()
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  optimizer = model.optimizer
  state = strategy.experimental_mirror(tk.state(model, optimizer))
  (x0, y0), (x1, y1) = batches
  state, loss = strategy.run(make_step(model, optimizer), args=(state, distribute_batch(strategy, x0),
                                                                distribute_batch(strategy, y0)))
  np.testing.assert_allclose(float(loss), want[0], rtol=1e-5)
  with pytest.raises(tk.StaleVariableError, match=r"is stale: .*tpustrat\.keras\.assign"):
    model.fit(x1, y1, batch_size=GLOBAL, epochs=1, verbose=0)
  tk.assign(model, optimizer, state)
  history = model.fit(x1, y1, batch_size=GLOBAL, epochs=1, verbose=0)
  np.testing.assert_allclose(history.history["loss"], want[1:], rtol=1e-5)
  model.evaluate(x1, y1, batch_size=GLOBAL, verbose=0)
  model.predict(x1, batch_size=GLOBAL, verbose=0)
  assert int(value(optimizer.iterations)) == 2  # Keras's steps leave nothing stale
  for mine, theirs in zip(weights(model), weights(reference), strict=True):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def stateful_steps(model, optimizer, metric):
  """Steps ported literally from TF, each using a Keras object the stateful way inside `run`."""

  def loss_of(state, x, y):
    logits, _, _ = tk.stateless_call(model, state["trainable"], state["non_trainable"], x)
    return tpustrat.compute_average_loss(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))

  def scale(state, x, y):
    return optimizer.scale_loss(loss_of(state, x, y))

  def update_metric(state, x, y):
    metric.update_state(loss_of(state, x, y))
    return loss_of(state, x, y)

  def reset_metric(state, x, y):
    metric.reset_state()
    return loss_of(state, x, y)

  def call_model(state, x, y):
    return model(x)

  def read_weight(state, x, y):
    return x @ model.layers[0].kernel

  return {"scale_loss": scale, "update_state": update_metric, "reset_state": reset_metric,
          "model(x)": call_model, "a weight": read_weight}


@pytest.mark.parametrize("use, what, where, fix", [
    ("scale_loss", "read", r"LossScaleOptimizer\.scale_loss",
     r"tpustrat\.keras\.scale_loss\(optimizer, state\['optimizer'\], loss\)"),
    ("update_state", "read", r"Mean\.update_state", r"metric\.stateless_update_state\(variables"),
    ("reset_state", "written", r"Mean\.reset_state", r"metric\.stateless_update_state\(variables"),
    ("model(x)", "read", r"Dense\.", r"tpustrat\.keras\.stateless_call\(model"),
    ("a weight", "read", r"", r"keras\.StatelessScope\(state_mapping="),
])
def test_a_keras_variable_used_statefully_in_a_step_is_refused_naming_the_fix(strategy, rng, use, what, where, fix):
  """TF's stateful Keras calls ported literally into a step: a Keras variable read (or written) while `run`
  traces, outside a keras.StatelessScope mapping it, is refused at that call, with the stateless way. Before,
  the read was a constant of the compiled program (the loss scale frozen at its initial value, the model's
  initial weights), and `metric.update_state` left tracers in the metric, for `result()` to fail on the host
  later with JAX's UnexpectedTracerError."""
  model, optimizer = dense_model(), loss_scale_optimizer()
  state = strategy.experimental_mirror(tk.state(model, optimizer))
  with strategy.scope():
    metric = keras.metrics.Mean()
  step = stateful_steps(model, optimizer, metric)[use]
  (batch,) = strategy.experimental_distribute_dataset(scaled_batches(rng, 1))
  with pytest.raises(RuntimeError, match=rf"Keras variable '[^']+' is {what} while strategy\.run traces a step.*"
                                         rf"{where}.*{fix}"):
    strategy.run(step, args=(state, *batch))
  # nothing leaked into the Keras objects: on the host they work as Keras's own
  metric.update_state(np.array([1.0, 3.0], np.float32))
  fresh = keras.metrics.Mean()
  fresh.update_state(np.array([1.0, 3.0], np.float32))
  assert float(metric.result()) == float(fresh.result())
  metric.reset_state()
  assert float(optimizer.scale_loss(np.float32(1.0))) == float(value(optimizer.dynamic_scale))


def test_keras_under_the_default_strategy_reads_its_variables_as_keras_does(rng):
  """Outside `run` (the default strategy's one replica) Keras's stateful calls are untouched, even inside
  the user's own `jax.jit`, where a read is the user's to make: the guard is for steps tpustrat traces."""
  model, optimizer = dense_model(), loss_scale_optimizer()
  tk.state(model, optimizer)
  x = rng.normal(size=(4, 5)).astype(np.float32)
  np.testing.assert_allclose(jax.jit(lambda x: model(x))(x), model.predict(x, verbose=0), rtol=1e-6)
  assert float(optimizer.scale_loss(np.float32(2.0))) == 2.0 * float(value(optimizer.dynamic_scale))


def test_scale_loss_and_iterations_refuse_what_does_not_match_the_optimizer(strategy):
  model, optimizer = dense_model(), loss_scale_optimizer()
  with pytest.raises(ValueError, match=r"scale_loss: the optimizer 'loss_scale_optimizer\w*' is not built"):
    tk.scale_loss(optimizer, [], 1.0)
  values = tk.state(model, optimizer)["optimizer"]
  with pytest.raises(ValueError, match=rf"iterations: optimizer_variables has 2 values; the optimizer .* has "
                                       rf"{len(values)}"):
    tk.iterations(optimizer, values[:2])
  with pytest.raises(TypeError, match=r"expected optimizer_variables = state\['optimizer'\].* got dict with keys"):
    tk.iterations(optimizer, tk.state(model, optimizer))
  with pytest.raises(TypeError, match=r"iterations reads the step count on the host; inside a step"):
    strategy.run(lambda v: tk.iterations(optimizer, v), args=(strategy.experimental_mirror(values),))
  # another Keras optimizer: its fixed loss_scale_factor, as Keras's own scale_loss
  sgd = keras.optimizers.SGD(0.1, loss_scale_factor=4.0)
  sgd_values = tk.state(model, sgd)["optimizer"]
  assert float(tk.scale_loss(sgd, sgd_values, np.float32(2.0))) == float(sgd.scale_loss(np.float32(2.0)))
