"""Embedding tables sharded by rows over the replicas, looked up and trained over AllToAll.

TF's `tf.tpu.experimental.embedding.TPUEmbedding`, with functional state, on every backend. A table of
``V`` rows of width ``D`` is padded to ``Vp`` rows (the next multiple of the replica count ``N``) and
split into ``N`` contiguous blocks of ``Vp / N`` rows: replica ``r`` owns rows ``[r * Vp/N, (r+1) * Vp/N)``,
so each device holds ``Vp * D / N`` table values (and as many per optimizer slot). The padding rows are
never looked up (ids must be below ``V``) and stay zero. Each table, and each of its optimizer slots, is
a `tpustrat.ShardedVariable` of logical shape ``[V, D]`` split along axis 0: its global array stacks the
blocks, ``[N, Vp / N, D]`` sharded over the replicas, and ``np.asarray(table)`` is the ``[V, D]`` table.
Inside `strategy.run` a step sees it as a `LocalShard` whose ``.block`` is this replica's rows; it saves,
restores onto another replica count and goes through `run`, `experimental_run_steps` and `jax.tree`
functions as every sharded value does.

Inside `strategy.run`, a lookup of this replica's ids:

1. routes each id to the replica that owns its row: ids are placed in one bucket per owner (a bucket
   holds up to all of this replica's ids, so nothing is ever dropped), ``[N, M]`` for ``M`` ids;
2. `all_to_all` sends bucket ``o`` to replica ``o``; each replica then holds the ids every replica asked
   it for, ``[N, M]``, and gathers their rows from its block, ``[N, M, D]``;
3. a second `all_to_all` sends the rows back; each id takes its row from its bucket's slot, and the rows
   of an example are combined (``sum``, ``mean`` or ``sqrtn``, weighted as in TF).

`apply_gradients` takes d(loss)/d(activations), spreads each example's gradient over its ids as the
combiner weighted them, sends the per-id gradients to the owners along the same routes, and sums them
per row there (duplicates within and across replicas add up); the optimizer then updates the touched
rows and their slots only (non-lazy Adam: every row, as TF does).

Bytes moved per lookup and replica: ``N * M`` ids out, ``N * M * D`` values back (twice that with the
gradients); the buckets are sized for the worst case, every id owned by one replica.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src.batch_rows import same_rows
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharding import place_blocks
from tpustrat._src.values import LocalShard, Mirrored, ShardedVariable, is_distributed

__all__ = ["Adagrad", "Adam", "FeatureConfig", "SGD", "TPUEmbedding", "TableConfig"]

_COMBINERS = ("sum", "mean", "sqrtn")


def split_rows(full: Any, num_replicas: int, mesh: Any) -> ShardedVariable:
  """`full` ``[V, D]`` as a `ShardedVariable` split along axis 0: padded with zero rows to a multiple of
  `num_replicas` and split into one block of ``ceil(V / N)`` rows per replica, the blocks stacked
  ``[N, ceil(V / N), D]`` and sharded over the replicas. Placed from the host as `experimental_shard`
  places a value (`place_blocks`): each device receives only its block, each process builds only its own."""
  value = np.asarray(jax.device_get(full))
  blocks = place_blocks(value, 0, num_replicas, NamedSharding(mesh, P(REPLICA_AXIS)))
  return ShardedVariable._wrap(blocks, value.shape, 0)  # pylint: disable=protected-access


def _block(value: Any, name: str, where: str) -> jax.Array:
  """This replica's ``[ceil(V / N), D]`` block of a table or slot: the `LocalShard` `run` hands the step."""
  if isinstance(value, LocalShard) and value.axis == 0:
    return value.block
  raise TypeError(f"TPUEmbedding.{where}: the state's {name} is {value!r:.120}, not this replica's block of a "
                  "table split by rows (a LocalShard inside strategy.run): pass the state TPUEmbedding.build or "
                  "a previous step returned.")


# -- optimizers ---------------------------------------------------------------------------------------


def _check_rate(value: Any, where: str, name: str = "learning_rate") -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
    raise ValueError(f"{where}: {name} must be a positive number, got {value!r}.")
  return float(value)


@dataclasses.dataclass(frozen=True)
class SGD:
  """Plain SGD on the touched rows: ``row -= learning_rate * g`` (TF's `tf.tpu.experimental.embedding.SGD`)."""

  learning_rate: float = 0.01

  def __post_init__(self) -> None:
    object.__setattr__(self, "learning_rate", _check_rate(self.learning_rate, "SGD"))

  slots = ()

  def slot_initial_values(self) -> dict[str, float]:
    return {}

  def update(self, rows: jax.Array, slots: dict[str, jax.Array], g: jax.Array, touched: jax.Array,
             step: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    del touched, step
    return rows - self.learning_rate * g, slots


@dataclasses.dataclass(frozen=True)
class Adagrad:
  """Adagrad on the touched rows: ``acc += g**2; row -= learning_rate * g / sqrt(acc)`` (TF's
  `tf.tpu.experimental.embedding.Adagrad`; accumulators start at `initial_accumulator_value`)."""

  learning_rate: float = 0.001
  initial_accumulator_value: float = 0.1

  def __post_init__(self) -> None:
    object.__setattr__(self, "learning_rate", _check_rate(self.learning_rate, "Adagrad"))
    object.__setattr__(self, "initial_accumulator_value",
                       _check_rate(self.initial_accumulator_value, "Adagrad", "initial_accumulator_value"))

  slots = ("accumulators",)

  def slot_initial_values(self) -> dict[str, float]:
    return {"accumulators": self.initial_accumulator_value}

  def update(self, rows, slots, g, touched, step):
    del step
    acc = jnp.where(touched[:, None], slots["accumulators"] + g * g, slots["accumulators"])
    new_rows = jnp.where(touched[:, None], rows - self.learning_rate * g * lax.rsqrt(acc), rows)
    return new_rows, {"accumulators": acc}


@dataclasses.dataclass(frozen=True)
class Adam:
  """Adam (TF's `tf.tpu.experimental.embedding.Adam`).

  ``m = beta_1 m + (1 - beta_1) g``, ``v = beta_2 v + (1 - beta_2) g**2``, and
  ``row -= lr_t * m / sqrt(v + epsilon**2)`` (TF's default ``sum_inside_sqrt=True``; False:
  ``m / (sqrt(v) + epsilon)``), with ``lr_t = learning_rate * sqrt(1 - beta_2**t) / (1 - beta_1**t)``
  at the ``t``-th `apply_gradients`. With ``lazy_adam=True`` (TF's default) only the touched rows and
  their moments change; with False every row's moments decay and every row moves, as in dense Adam.
  """

  learning_rate: float = 0.001
  beta_1: float = 0.9
  beta_2: float = 0.999
  epsilon: float = 1e-7
  lazy_adam: bool = True
  sum_inside_sqrt: bool = True

  def __post_init__(self) -> None:
    object.__setattr__(self, "learning_rate", _check_rate(self.learning_rate, "Adam"))
    for name in ("beta_1", "beta_2"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"Adam: {name} must be in [0, 1), got {value!r}.")
    object.__setattr__(self, "epsilon", _check_rate(self.epsilon, "Adam", "epsilon"))

  slots = ("momenta", "velocities")

  def slot_initial_values(self) -> dict[str, float]:
    return {"momenta": 0.0, "velocities": 0.0}

  def update(self, rows, slots, g, touched, step):
    t = step.astype(jnp.float32)
    lr = self.learning_rate * jnp.sqrt(1 - self.beta_2 ** t) / (1 - self.beta_1 ** t)
    m = self.beta_1 * slots["momenta"] + (1 - self.beta_1) * g
    v = self.beta_2 * slots["velocities"] + (1 - self.beta_2) * g * g
    denom = jnp.sqrt(v + self.epsilon ** 2) if self.sum_inside_sqrt else jnp.sqrt(v) + self.epsilon
    new_rows = rows - lr * m / denom
    if self.lazy_adam:
      keep = touched[:, None]
      m = jnp.where(keep, m, slots["momenta"])
      v = jnp.where(keep, v, slots["velocities"])
      new_rows = jnp.where(keep, new_rows, rows)
    return new_rows, {"momenta": m, "velocities": v}


_OPTIMIZERS = (SGD, Adagrad, Adam)


# -- configuration ------------------------------------------------------------------------------------


def _truncated_normal(stddev: float) -> Callable[[tuple[int, ...], Any], jax.Array]:
  def init(shape, dtype, key):
    return stddev * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)
  return init


class TableConfig:
  """One embedding table (TF's `tf.tpu.experimental.embedding.TableConfig`).

  Args:
    vocabulary_size: rows ``V`` (ids are ``0 <= id < V``; ``-1`` is padding).
    dim: the width ``D`` of a row.
    initializer: ``initializer(shape, dtype) -> array`` for the ``[V, D]`` table, as in TF. None: TF's
      truncated normal with stddev ``1 / sqrt(dim)`` (from `TPUEmbedding.build`'s seed).
    optimizer: this table's `SGD` / `Adagrad` / `Adam`; None: the `TPUEmbedding`'s.
    combiner: how the ids of one example combine: ``"sum"``, ``"mean"`` (weighted mean) or ``"sqrtn"``
      (weighted sum over the square root of the sum of squared weights).
    name: the table's name (the key of `TPUEmbedding.embedding_tables`); default ``table_<i>``.
  """

  def __init__(self, vocabulary_size: int, dim: int, initializer: Callable[..., Any] | None = None,
               optimizer: Any = None, combiner: str = "mean", name: str | None = None) -> None:
    for arg, value in (("vocabulary_size", vocabulary_size), ("dim", dim)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"TableConfig: {arg} must be a positive int, got {value!r}.")
    if combiner not in _COMBINERS:
      raise ValueError(f"TableConfig: combiner must be one of {_COMBINERS}, got {combiner!r}.")
    if initializer is not None and not callable(initializer):
      raise TypeError(f"TableConfig: initializer must be callable (shape, dtype) -> array, got {initializer!r:.100}.")
    if optimizer is not None and not isinstance(optimizer, _OPTIMIZERS):
      raise TypeError(f"TableConfig: optimizer must be tpustrat.embedding.SGD, Adagrad or Adam, got {optimizer!r:.100}.")
    self.vocabulary_size, self.dim = int(vocabulary_size), int(dim)
    self.initializer, self.optimizer, self.combiner, self.name = initializer, optimizer, combiner, name

  def __repr__(self) -> str:
    return (f"TableConfig(vocabulary_size={self.vocabulary_size}, dim={self.dim}, combiner={self.combiner!r}, "
            f"name={self.name!r})")


class FeatureConfig:
  """One feature looked up in a table (TF's `tf.tpu.experimental.embedding.FeatureConfig`).

  Args:
    table: its `TableConfig` (several features may share one table).
    max_sequence_length: accepted for TF compatibility; 0 (the default) combines a feature's ids into
      one activation per example, as TF does; sequence features are not supported yet (ValueError).
    name: the feature's name (for messages).
  """

  def __init__(self, table: TableConfig, max_sequence_length: int = 0, name: str | None = None) -> None:
    if not isinstance(table, TableConfig):
      raise TypeError(f"FeatureConfig: table must be a tpustrat.embedding.TableConfig, got {table!r:.100}.")
    if max_sequence_length != 0:
      raise ValueError(
          f"FeatureConfig: max_sequence_length={max_sequence_length!r}: sequence features (one activation "
          "per id) are not supported yet; give 0 to combine a feature's ids per example.")
    self.table, self.max_sequence_length, self.name = table, max_sequence_length, name

  def __repr__(self) -> str:
    return f"FeatureConfig(table={self.table.name!r}, name={self.name!r})"


# -- the embedding ------------------------------------------------------------------------------------


class TPUEmbedding:
  """Embedding tables sharded by rows over the replicas (TF's `tf.tpu.experimental.embedding.TPUEmbedding`).

  >>> strategy = tpustrat.TPUStrategy()
  >>> table = tpustrat.embedding.TableConfig(vocabulary_size=37, dim=4, combiner="sum", name="t",
  ...                                        initializer=lambda shape, dtype: jnp.ones(shape, dtype))
  >>> emb = tpustrat.embedding.TPUEmbedding({"f": tpustrat.embedding.FeatureConfig(table)},
  ...                                       tpustrat.embedding.SGD(0.5), strategy)
  >>> state = emb.build()
  >>> ids = strategy.experimental_distribute_values_from_function(
  ...     lambda ctx: np.array([[ctx.replica_id_in_sync_group, -1]], np.int32))
  >>> def step(state, ids):
  ...   act = emb.lookup(state, {"f": ids})
  ...   return emb.apply_gradients(state, {"f": ids}, {"f": jnp.ones_like(act["f"])}), act["f"]
  >>> state, act = strategy.run(step, args=(state, ids))
  >>> print(strategy.experimental_local_results(act)[3])
  [[1. 1. 1. 1.]]
  >>> tables = emb.embedding_tables(state)
  >>> print(tables["t"].shape, tables["t"][3], tables["t"][8])
  (37, 4) [0.5 0.5 0.5 0.5] [1. 1. 1. 1.]

  Args:
    feature_config: a nested structure (dict, list, tuple) of `FeatureConfig`s; `lookup`'s features and
      activations have this structure.
    optimizer: the `SGD` / `Adagrad` / `Adam` of the tables that name none.
    strategy: the strategy whose replicas hold the tables; None: the current one.
  """

  def __init__(self, feature_config: Any, optimizer: Any = None, strategy: Any = None) -> None:
    leaves, self._treedef = jax.tree.flatten(feature_config, is_leaf=lambda x: isinstance(x, FeatureConfig))
    if not leaves or not all(isinstance(f, FeatureConfig) for f in leaves):
      raise TypeError("TPUEmbedding: feature_config must be a nested structure of "
                      f"tpustrat.embedding.FeatureConfig, got {feature_config!r:.200}.")
    if optimizer is not None and not isinstance(optimizer, _OPTIMIZERS):
      raise TypeError(f"TPUEmbedding: optimizer must be tpustrat.embedding.SGD, Adagrad or Adam, got {optimizer!r:.100}.")
    self._features = leaves
    self._tables: list[TableConfig] = []
    for f in leaves:
      if not any(f.table is t for t in self._tables):
        self._tables.append(f.table)
    names = [t.name or f"table_{i}" for i, t in enumerate(self._tables)]
    if len(set(names)) != len(names):
      raise ValueError(f"TPUEmbedding: table names must be distinct, got {names}.")
    self._names = names
    for t, name in zip(self._tables, names):
      if (t.optimizer or optimizer) is None:
        raise ValueError(f"TPUEmbedding: table {name!r} has no optimizer: give one to TPUEmbedding or its TableConfig.")
    self._optimizer = optimizer
    self._strategy = strategy if strategy is not None else context_lib.get_strategy()
    mesh = self._strategy.mesh
    if mesh is None:
      raise ValueError("TPUEmbedding needs a TPUStrategy or MirroredStrategy (the default strategy has no mesh).")
    self._n = self._strategy.num_replicas_in_sync
    self._mesh = mesh

  # -- layout -------------------------------------------------------------------------------------

  def _table_name(self, table: TableConfig) -> str:
    return self._names[next(i for i, t in enumerate(self._tables) if t is table)]

  def _opt(self, table: TableConfig) -> Any:
    return table.optimizer or self._optimizer

  def rows_per_replica(self, table_name: str) -> int:
    """``Vp / N``: the rows of table `table_name` that each replica holds (padding included)."""
    t = self._tables[self._names.index(table_name)]
    return -(-t.vocabulary_size // self._n)

  @property
  def table_names(self) -> list[str]:
    return list(self._names)

  def build(self, seed: int = 0) -> dict[str, Any]:
    """The initial state (cross-replica context): ``{"tables": {name: ShardedVariable}, "slots": {name: {slot:
    ShardedVariable}}, "step": Mirrored int32}``. Each table is initialised whole (the `TableConfig`'s
    initializer, or TF's truncated normal from `seed`) and split by rows: a `tpustrat.ShardedVariable` of
    shape ``[V, D]`` along axis 0, one block of ``ceil(V / N)`` rows per replica (the last ones padded
    with zero rows); each optimizer slot likewise. Inside `strategy.run` a step sees each as a
    `LocalShard` over its block, and the `LocalShard`s `apply_gradients` returns come back from `run` as
    `ShardedVariable`s."""
    if context_lib.in_replica_context_of_a_run():
      raise RuntimeError("TPUEmbedding.build is called in the cross-replica context, not inside strategy.run.")
    key = jax.random.key(seed)
    tables, slots = {}, {}
    for i, (t, name) in enumerate(zip(self._tables, self._names)):
      shape = (t.vocabulary_size, t.dim)
      if t.initializer is None:
        full = _truncated_normal(1.0 / math.sqrt(t.dim))(shape, jnp.float32, jax.random.fold_in(key, i))
      else:
        full = jnp.asarray(t.initializer(shape, jnp.float32), jnp.float32)
        if full.shape != shape:
          raise ValueError(f"TPUEmbedding.build: the initializer of table {name!r} returned shape {full.shape}, "
                           f"expected {shape}.")
      tables[name] = split_rows(full, self._n, self._mesh)
      slots[name] = {slot: split_rows(np.full(shape, value, np.float32), self._n, self._mesh)
                     for slot, value in self._opt(t).slot_initial_values().items()}
    step = Mirrored.from_global(jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self._mesh, P())))
    return {"tables": tables, "slots": slots, "step": step}

  def embedding_tables(self, state: dict[str, Any]) -> dict[str, np.ndarray]:
    """``{table name: the whole [V, D] table}`` as numpy (cross-replica context), padding removed."""
    return {name: np.asarray(state["tables"][name]) for name in self._names}

  def check_ids(self, features: Any) -> None:
    """Raises a ValueError naming the feature and the id if a host (numpy) feature holds an id outside
    ``[0, vocabulary_size)`` other than ``-1``. `lookup` calls it on concrete inputs; inside
    `strategy.run` the ids are traced and cannot be checked (an out-of-range id then looks up zeros and
    receives no update): check them in the input pipeline."""
    for f, ids in zip(self._features, self._flatten_features(features, "check_ids")):
      if isinstance(ids, jax.core.Tracer):
        continue
      values = np.asarray(jax.device_get(ids.tree if is_distributed(ids) else ids))
      bad = (values != -1) & ((values < 0) | (values >= f.table.vocabulary_size))
      if bad.any():
        raise ValueError(
            f"TPUEmbedding: feature {f.name or self._table_name(f.table)!r} holds id {int(values[bad][0])}, outside "
            f"[0, {f.table.vocabulary_size}) of table {self._table_name(f.table)!r} (-1 is padding).")

  # -- inside run ---------------------------------------------------------------------------------

  def _flatten_features(self, features: Any, where: str) -> list[Any]:
    leaves = self._treedef.flatten_up_to(features)
    return leaves

  def _route(self, ids: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(owner [M], slot [M], valid [M], send [N, M]) for flat ids [M]: `send[o]` holds the local rows
    this replica asks replica `o` for (-1: empty)."""
    n = self._n
    valid = (ids >= 0) & (ids < n * rows)
    owner = jnp.where(valid, ids // rows, n)  # n: nowhere
    onehot = owner[:, None] == jnp.arange(n)[None, :]
    slot = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # rank among the ids of the same owner
    local = jnp.where(valid, ids % rows, -1)
    m = ids.shape[0]
    send = jnp.full((n, m), -1, jnp.int32).at[owner, slot].set(local.astype(jnp.int32), mode="drop")
    return owner, slot, valid, send

  def _exchange(self, x: jax.Array) -> jax.Array:
    """`x` [N, ...]: block `o` to replica `o`; returns [N, ...], block `s` from replica `s`."""
    if self._n == 1:
      return x
    return lax.all_to_all(x, REPLICA_AXIS, 0, 0, tiled=True)

  def _weights(self, ids: jax.Array, weights: Any, combiner: str) -> jax.Array:
    """The coefficient of each id in its example's activation ([b, L]), zero for padding."""
    w = jnp.where(ids >= 0, 1.0 if weights is None else jnp.asarray(weights, jnp.float32), 0.0)
    if combiner == "sum":
      return w
    if combiner == "mean":
      total = jnp.sum(w, axis=1, keepdims=True)
      return w / jnp.where(total == 0, 1.0, total)
    norm = jnp.sqrt(jnp.sum(w * w, axis=1, keepdims=True))
    return w / jnp.where(norm == 0, 1.0, norm)

  def _prepare(self, state: Any, features: Any, weights: Any, where: str):
    if not context_lib.in_replica_context_of_a_run():
      raise RuntimeError(f"TPUEmbedding.{where} runs inside strategy.run (a replica context).")
    self.check_ids(features)
    ids_list = self._flatten_features(features, where)
    weight_list = [None] * len(ids_list) if weights is None else self._treedef.flatten_up_to(weights)
    out = []
    for f, ids, w in zip(self._features, ids_list, weight_list):
      ids = jnp.asarray(ids)
      if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.ndim not in (1, 2):
        raise ValueError(f"TPUEmbedding.{where}: the ids of feature {f.name!r} must be int [b] or [b, L], got "
                         f"{ids.dtype}{list(ids.shape)}.")
      ids2 = ids[:, None] if ids.ndim == 1 else ids
      # An id outside [0, V) cannot be checked while traced: it counts as padding (no row, no weight).
      ids2 = jnp.where((ids2 >= 0) & (ids2 < f.table.vocabulary_size), ids2, -1)
      if w is not None:
        w = jnp.asarray(w, jnp.float32)
        w = w[:, None] if w.ndim == 1 else w
        if w.shape != ids2.shape:
          raise ValueError(f"TPUEmbedding.{where}: the weights of feature {f.name!r} have shape {w.shape}, the "
                           f"ids {ids.shape}.")
      name = self._table_name(f.table)
      coef = self._weights(ids2, w, f.table.combiner)
      out.append((f, name, ids2, coef))
    return out

  def lookup(self, state: dict[str, Any], features: Any, weights: Any = None) -> Any:
    """This replica's activations, ``[b, dim]`` per feature, with the structure of the feature config.

    Call inside `strategy.run`. Each feature is this replica's int ids, ``[b]`` (one id per example) or
    ``[b, L]`` (several, ``-1`` as padding); `weights` (optional, same structure, float ``[b]`` /
    ``[b, L]``) weigh the ids as in TF. An example with no ids gets zeros.

    A partial batch from a distributed dataset is padded with zeros, so its padding examples carry id 0:
    mask them, ``jnp.where(tpustrat.valid_mask(ids)[:, None], ids, -1)``, in `lookup` and
    `apply_gradients` alike, or lazy Adam and Adagrad would count row 0 as touched (their gradient is
    zero when the loss masks them too).
    """
    activations = []
    for f, name, ids, coef in self._prepare(state, features, weights, "lookup"):
      block = _block(state["tables"][name], f"table {name!r}", "lookup")
      rows = block.shape[0]
      flat = ids.reshape(-1)
      owner, slot, valid, send = self._route(flat, rows)
      asked = self._exchange(send)  # [N, M]: the rows each replica asks this one for
      found = jnp.where((asked >= 0)[..., None], block[jnp.maximum(asked, 0)], 0.0)
      back = self._exchange(found)  # [N, M, D]: the rows this replica asked for, by owner
      got = back[jnp.minimum(owner, self._n - 1), jnp.maximum(slot, 0)]
      got = jnp.where(valid[:, None], got, 0.0).reshape(ids.shape + (f.table.dim,))
      # The rows went to their owners and came back in order: example i's activation is row i of ids.
      activations.append(same_rows(lax.stop_gradient(jnp.einsum("bl,bld->bd", coef, got)), ids))
    return self._treedef.unflatten(activations)

  def apply_gradients(self, state: dict[str, Any], features: Any, gradients: Any, weights: Any = None) -> dict[str, Any]:
    """The state after one optimizer step on the rows `features` touched (call inside `strategy.run`).

    `gradients` are d(loss)/d(activations) of this replica, with the activations' structure; each is
    spread over its example's ids as the combiner weighted them, sent to the rows' owners over
    `all_to_all` and summed per row (duplicates add up, across replicas too). Only the touched rows and
    their slots change (non-lazy Adam: all rows).
    """
    grad_list = self._treedef.flatten_up_to(gradients)
    per_table: dict[str, tuple[jax.Array, jax.Array]] = {}
    for (f, name, ids, coef), g in zip(self._prepare(state, features, weights, "apply_gradients"), grad_list):
      block = _block(state["tables"][name], f"table {name!r}", "apply_gradients")
      rows, dim = block.shape
      g = jnp.asarray(g, jnp.float32)
      if g.shape != (ids.shape[0], dim):
        raise ValueError(f"TPUEmbedding.apply_gradients: the gradient of feature {f.name!r} has shape {g.shape}, "
                         f"expected {(ids.shape[0], dim)} (its activation's).")
      flat = ids.reshape(-1)
      owner, slot, valid, send = self._route(flat, rows)
      per_id = (coef[:, :, None] * g[:, None, :]).reshape(-1, dim)
      out = jnp.zeros((self._n, flat.shape[0], dim), jnp.float32).at[owner, slot].set(per_id, mode="drop")
      asked = self._exchange(send)
      received = self._exchange(out)  # [N, M, D]: gradients for the rows in `asked`
      target = jnp.where(asked >= 0, asked, rows).reshape(-1)
      summed = jnp.zeros((rows, dim), jnp.float32).at[target].add(received.reshape(-1, dim), mode="drop")
      touched = jnp.zeros((rows,), bool).at[target].set(True, mode="drop")
      if name in per_table:
        prev_g, prev_t = per_table[name]
        summed, touched = prev_g + summed, prev_t | touched
      per_table[name] = (summed, touched)
    step = state["step"] + 1
    tables, slots = dict(state["tables"]), dict(state["slots"])
    for t, name in zip(self._tables, self._names):
      if name not in per_table:
        continue
      summed, touched = per_table[name]
      table = state["tables"][name]
      old_slots = {k: _block(v, f"slot {k!r} of table {name!r}", "apply_gradients")
                   for k, v in state["slots"][name].items()}
      new_rows, new_slots = self._opt(t).update(_block(table, f"table {name!r}", "apply_gradients"), old_slots,
                                                summed, touched, step)
      # Blocks again, so that run returns them as ShardedVariables of the same [V, D] along axis 0.
      tables[name] = LocalShard(new_rows, table.shape, 0)
      slots[name] = {k: LocalShard(v, table.shape, 0) for k, v in new_slots.items()}
    return {"tables": tables, "slots": slots, "step": step}
