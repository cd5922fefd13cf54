"""Distributed values as values: a `Mirrored` of one array converts like that array (TF's `Mirrored`
converts to its value), so state written back into a model (a Keras variable) and used afterwards just
works; a `PerReplica` refuses to convert, naming what combines its components.

References: numpy on the same values.
"""

import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat


def test_a_mirrored_array_converts_like_its_value(strategy):
  want = np.arange(6, dtype=np.float32).reshape(2, 3) * 1.5
  m = strategy.run(lambda: jnp.asarray(want))
  assert isinstance(m, tpustrat.Mirrored)
  assert m.shape == (2, 3) and m.ndim == 2 and m.size == 6 and m.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(m), want)
  np.testing.assert_array_equal(np.asarray(m, dtype=np.float64), want.astype(np.float64))
  as_jax = jnp.asarray(m)
  assert isinstance(as_jax, jax.Array) and as_jax.sharding.is_fully_replicated
  assert len(as_jax.sharding.device_set) == strategy.num_replicas_in_sync  # the replicated array, not a copy
  np.testing.assert_array_equal(np.asarray(as_jax), want)
  np.testing.assert_array_equal(np.asarray(jnp.asarray(m) + 1), want + 1)


def test_a_mirrored_scalar_converts_to_python_numbers(strategy):
  s = strategy.run(lambda: jnp.float32(2.75))
  assert float(s) == 2.75 and int(s) == 2 and bool(s) and complex(s) == 2.75
  i = strategy.run(lambda: jnp.int32(3))
  assert [10, 20, 30, 40][i] == 40 and operator.index(i) == 3
  zero = strategy.run(lambda: jnp.float32(0.0))
  assert not bool(zero)
  assert f"loss {s:.3f}" == "loss 2.750" and f"{i:d}" == "3"


def test_a_mirrored_pytree_is_split_by_experimental_shard_leaf_by_leaf(strategy):
  w, b = np.arange(32, dtype=np.float32).reshape(16, 2), np.ones(2, np.float32)
  state = strategy.experimental_shard(tpustrat.Mirrored({"w": w, "b": b}),
                                      tpustrat.MinSizePartitioner(min_shard_bytes=64))
  assert isinstance(state["w"], tpustrat.ShardedVariable) and isinstance(state["b"], tpustrat.Mirrored)
  np.testing.assert_array_equal(np.asarray(state["w"]), w)
  np.testing.assert_array_equal(np.asarray(state["b"]), b)


def test_a_mirrored_pytree_or_per_replica_does_not_convert(strategy):
  tree = tpustrat.Mirrored({"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)})
  with pytest.raises(TypeError, match=r"np.asarray\(Mirrored\): this Mirrored holds a pytree"):
    np.asarray(tree)
  with pytest.raises(TypeError, match=r"Mirrored.shape: this Mirrored holds a pytree"):
    _ = tree.shape
  per = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
  for convert in (np.asarray, jnp.asarray, float):
    with pytest.raises(TypeError, match=r"one \(possibly different\) component per replica.*strategy.reduce"):
      convert(per)


def test_mirrored_state_written_into_a_keras_model_is_used_by_it(strategy):
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip(f"Keras runs on {keras.backend.backend()}, not JAX (KERAS_BACKEND=jax)")
  rng = np.random.default_rng(0)
  kernel, bias = rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=(2,)).astype(np.float32)
  model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
  new_kernel, new_bias = strategy.run(lambda: (jnp.asarray(kernel), jnp.asarray(bias)))
  model.layers[0].kernel.assign(new_kernel)
  model.layers[0].bias.assign(new_bias)
  x = rng.normal(size=(5, 3)).astype(np.float32)
  np.testing.assert_allclose(model.predict(x, verbose=0), x @ kernel + bias, rtol=1e-5, atol=1e-5)
