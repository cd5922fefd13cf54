"""Per-replica random streams: each replica its own, from one key that stays the same on every replica.

In TF a `tf.random.Generator` created in a strategy's scope gives each replica its own stream. In JAX a key
given to `strategy.run` goes whole to every replica (`Mirrored`), so dropout drawn from it gives every
replica the same mask. The rule here: the state of a stream (a key, flax NNX's `RngKey`s, Keras's
`SeedGenerator` state) stays `Mirrored`, and advances the same way on every replica; inside the step each
replica folds its `replica_id_in_sync_group` into it (`jax.random.fold_in`) before drawing. The replica's
stream is then a pure function of (state, replica id): a fixed seed reproduces a run, and a checkpoint of
the `Mirrored` state (an ordinary pytree) restores the streams of every replica.

Under the default strategy (no `strategy.run`, no `scope()`) the one replica is replica 0, so code written
for a step also runs outside one and draws replica 0's numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpustrat._src import context


def _replica_id(what: str) -> Any:
  """This replica's id in the current `run` (traced), or 0 under the default strategy."""
  ctx = context.get_replica_context()
  if ctx is None:
    raise RuntimeError(
        f"{what} was called in cross-replica context (inside strategy.scope(), outside strategy.run): "
        "there is no replica whose id to fold in. Call it inside the function given to strategy.run.")
  return ctx.replica_id_in_sync_group


def _raw_key_shape() -> tuple[int, ...]:
  """The shape of a raw (uint32) key of JAX's default PRNG implementation: ``(2,)`` for threefry."""
  return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)


def check_key(key: Any, what: str) -> None:
  """Raises TypeError unless `key` is one JAX key: a typed key of shape ``()`` (`jax.random.key`) or a raw
  uint32 key of the default implementation's shape (`jax.random.PRNGKey`)."""
  dtype = getattr(key, "dtype", None)
  shape = tuple(getattr(key, "shape", ()))
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape != ():
      raise TypeError(f"{what}: expected one key (shape ()), got a typed key array of shape {shape}. Fold "
                      "the replica id into each key separately, or split a single key after folding.")
    return
  raw = _raw_key_shape()
  if dtype is None or np.dtype(dtype) != np.uint32 or shape != raw:
    raise TypeError(
        f"{what}: expected a JAX PRNG key (jax.random.key(seed), or a raw uint32 key of shape {raw} from "
        f"jax.random.PRNGKey(seed)); got {type(key).__name__} of dtype {dtype} and shape {shape}.")


def replica_key(key: Any) -> Any:
  """This replica's own key: `key` (the same on every replica) with the replica's id folded in.

  TF's per-replica random streams (a `tf.random.Generator` made in the strategy's scope) for a JAX key:
  ``jax.random.fold_in(key, replica_id_in_sync_group)``. Keep `key` itself in the training state
  (`Mirrored`) and advance it the same way on every replica, for example with a split per step, so that a
  fixed seed reproduces a run and a checkpoint of the state continues the same streams::

    def train_step(state, batch):
      key, step_key = jax.random.split(state["key"])       # the same on every replica: stays Mirrored
      mask = jax.random.bernoulli(tpustrat.replica_key(step_key), 0.9, batch.shape)   # each replica's own
      ...
      return {**state, "key": key}, loss

  Args:
    key: one JAX key: a typed key (``jax.random.key(seed)``) or a raw uint32 key
      (``jax.random.PRNGKey(seed)``). The result is of the same kind.

  Returns:
    ``jax.random.fold_in(key, replica_id_in_sync_group)``, inside `strategy.run`; under the default
    strategy (outside any `run` and `scope()`) the one replica's, replica 0's.

  Raises:
    TypeError: `key` is not one JAX key.
    RuntimeError: called in cross-replica context (inside `scope()`, outside `run`).

  >>> k = jax.random.key(0)
  >>> bool(jnp.all(jax.random.key_data(replica_key(k)) == jax.random.key_data(jax.random.fold_in(k, 0))))
  True
  """
  check_key(key, "tpustrat.replica_key")
  return jax.random.fold_in(key, _replica_id("tpustrat.replica_key"))


def _nnx() -> Any:
  from flax import nnx  # pylint: disable=import-outside-toplevel  # flax is imported only where NNX is used
  return nnx


@contextlib.contextmanager
def replica_rngs(node: Any) -> Iterator[Any]:
  """Inside the block, every flax NNX RNG stream in `node` draws this replica's own numbers.

  Each `nnx.RngKey` in `node` (an `nnx.Rngs`, or a module holding them, such as one with `nnx.Dropout`
  layers) is replaced by ``jax.random.fold_in(key, replica_id_in_sync_group)`` for the block and put back
  when it ends. The streams' counts (`nnx.RngCount`) advance as usual, by the same amount on every
  replica, so the RNG state that leaves the step is `Mirrored` again, and ``nnx.split`` after the block
  gives state that a checkpoint saves and restores as it is::

    def train_step(state, batch):
      model = nnx.merge(graphdef, state)
      with tpustrat.replica_rngs(model):                   # each replica its own dropout masks
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      ...
      return nnx.state(model), loss                        # split after the block: the shared keys

  Args:
    node: an NNX graph node holding RNG streams (`nnx.Rngs`, `nnx.RngStream`, an `nnx.Module`).

  Yields:
    `node`.

  Raises:
    TypeError: `node` is not an NNX graph node, or holds no `nnx.RngKey`.
    RuntimeError: used in cross-replica context (inside `scope()`, outside `run`).
  """
  nnx = _nnx()
  if not isinstance(node, nnx.Pytree):  # Module, Rngs and RngStream are all nnx.Pytree objects
    raise TypeError(f"tpustrat.replica_rngs: expected a flax NNX graph node holding RNG streams (nnx.Rngs, "
                    f"nnx.RngStream, an nnx.Module); got {type(node).__name__}.")
  keys = jax.tree.map(lambda k: k, nnx.state(node, nnx.RngKey))  # a copy: the state's Variables are node's own
  if not jax.tree.leaves(keys):
    raise TypeError(f"tpustrat.replica_rngs: {type(node).__name__} holds no nnx.RngKey: nothing draws random "
                    "numbers from it. Pass the nnx.Rngs, or the module that holds its streams.")
  replica = _replica_id("tpustrat.replica_rngs")
  nnx.update(node, jax.tree.map(lambda k: jax.random.fold_in(k, replica), keys))
  try:
    yield node
  finally:
    nnx.update(node, keys)


def fold_raw_seed(seed: Any, replica: Any) -> jax.Array:
  """A raw uint32 seed (Keras's `SeedGenerator` state on JAX: ``[seed, counter]``) with `replica` folded
  in, as a raw key of the same shape."""
  return jax.random.fold_in(jnp.asarray(seed, jnp.uint32), replica)
