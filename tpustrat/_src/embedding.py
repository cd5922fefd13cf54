"""Embedding tables sharded by rows over the replicas, looked up and trained over all-gathers and all-to-alls.

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

Inside `strategy.run`, rows travel on one of three layouts, chosen per table from sizes known when the
step is traced (``M``: the ids this replica looks up in the table per step, all its features together;
``ceil(V/N)``: the rows of a block); the tables of a layout share its collectives, so a step holds one of
each whatever the number of tables:

* ``all_gather_table``, a block of at most ``2 * M`` rows (``_GATHER_TABLE_UP_TO``) and no bound:
  `lookup` all-gathers the blocks of all such tables (one `all_gather`) and reads each id's row
  locally; `apply_gradients` adds each id's gradient into a dense ``[Vp, D]`` array (with a count column
  where the optimizer tells touched rows from untouched ones) and one `psum_scatter` sums them over the
  replicas and hands each owner its block's rows, updated densely. Two collectives per step, moving
  what the all-reduce of a replicated table's gradient moves, with ``1/N`` of the update.
* ``all_gather_ids``, larger tables without a bound: every replica's ids are all-gathered (``N * M``
  int32, one `all_gather`; `lookup` and `apply_gradients` gather the same ids, which XLA merges), each
  owner reads the rows it holds for all of them (zeros elsewhere) and one `psum_scatter` hands every
  replica the rows of its own ids; the gradients go out in one `all_gather` of the per-id gradients,
  and each owner updates the rows it holds (`_update`). The partition XLA's SPMD partitioner gives a
  ``jnp.take`` on a row-sharded table, with a reduce-scatter where it all-reduces and sparse updates
  where it rewrites the block.
* ``all_to_all``, a table with ``max_ids_per_partition`` or ``max_unique_ids_per_partition``: its ids
  (all its features', concatenated) are sorted and deduplicated (`_unique`), and each distinct id takes a
  slot in the bucket of its owner, ``[N, C]``, ``C = min(M, ceil(V/N), max_ids_per_partition,
  max_unique_ids_per_partition)`` (a step that exceeds a bound fails, naming the table and the bound);
  the buckets of all such tables go out in one `all_to_all`, each owner gathers the rows asked for, and
  the rows (flattened, whatever their widths) come back in a second; the gradients, summed per distinct
  id, go out in a third (the ids' exchange is the lookup's: XLA merges the two). The layout whose bytes
  shrink with duplicates and bounds: ``N * C`` ids out, ``N * C * D`` values back and as many out.

On every layout an occurrence of an id takes its row, and the rows of an example are combined (``sum``,
``mean`` or ``sqrtn``, weighted as in TF), or, for a sequence feature (``max_sequence_length = L``),
kept per position: ``[b, L, D]``. `apply_gradients` spreads each example's gradient over its ids as the
combiner weighted them (a sequence feature: per position), and every duplicate's gradient adds up, across
replicas too. The owners of a routed or id-gathered table sum the gradients per distinct row (a sort
again) and update only those rows and their slots, gathered ``[K, D]`` and scattered back into the block
with ``.at[rows].set(mode="drop")``: in place when `run` donates the state (``RunOptions(donate_argnums=0)``),
and nothing of the size of the block is built (non-lazy Adam: every row, as TF defines it; a block no
larger than the ``K`` gradients received updates densely too).
"""

from __future__ import annotations

import dataclasses
import functools
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
  return ShardedVariable.from_blocks(blocks, value.shape, 0)


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


def _check_number(value: Any, where: str, name: str, ok: Callable[[float], bool], expected: str) -> float:
  """`value` as a float if it is a finite real number with ``ok(value)``, else a ValueError naming `name`."""
  if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating))
      or not math.isfinite(value) or not ok(float(value))):
    raise ValueError(f"{where}: {name} must be {expected}, got {value!r}.")
  return float(value)


_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def _check_flag(value: Any, where: str, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{where}: {name} must be True or False, got {value!r}.")
  return bool(value)


def _reject_unsupported_tf_options(opt: Any) -> None:
  """TF's options common to its embedding optimizers that tpustrat does not implement: their TF defaults
  pass (None, or what TF treats as off), anything else raises, so that no setting is silently dropped."""
  where = type(opt).__name__
  if opt.use_gradient_accumulation is not True:
    raise ValueError(f"{where}: use_gradient_accumulation={opt.use_gradient_accumulation!r} is not supported: "
                     "tpustrat always sums each row's gradients exactly before one update (TF's default, True).")
  for name in ("clip_weight_min", "clip_weight_max", "clipvalue", "slot_variable_creation_fn"):
    if getattr(opt, name) is not None:
      raise ValueError(f"{where}: {name} is not supported by tpustrat.embedding, got {getattr(opt, name)!r:.80}; "
                       "leave it None.")
  if opt.weight_decay_factor not in (None, 0):
    raise ValueError(f"{where}: weight_decay_factor is not supported by tpustrat.embedding, got "
                     f"{opt.weight_decay_factor!r}; leave it None.")
  if opt.multiply_weight_decay_factor_by_learning_rate not in (None, False):
    raise ValueError(f"{where}: multiply_weight_decay_factor_by_learning_rate is not supported (weight decay is "
                     "not), leave it None.")
  if opt.low_dimensional_packing_status is not False:
    raise ValueError(f"{where}: low_dimensional_packing_status (a TPU memory layout of narrow tables) is not "
                     "supported, leave it False.")


@dataclasses.dataclass(frozen=True)
class FTRL:
  """FTRL-Proximal (TF's `tf.tpu.experimental.embedding.FTRL`: the TPU embedding ``FtrlParameters`` of
  ``optimization_parameters.proto``, TF's ``ApplyFtrlV2`` kernel with ``beta``), on the touched rows.

  Slots ``accumulators`` (start at `initial_accumulator_value`) and ``linears`` (start at 0). With
  ``p = -learning_rate_power``, ``lr = learning_rate``, ``l1``, ``l2`` the regularization strengths and
  ``g`` a row's summed gradient::

    acc_new = acc + g**2
    sigma   = acc_new**p - acc**p
    # multiply_linear_by_learning_rate=False (TF's default):
    linear += g - sigma / lr * row
    quadratic = (acc_new**p + beta) / lr + 2 * l2;      l1_t = l1
    # multiply_linear_by_learning_rate=True (``linears`` holds lr * linear):
    linear += lr * g - sigma * row
    quadratic = acc_new**p + beta + 2 * l2 * lr;        l1_t = l1 * lr
    row = (clip(linear, -l1_t, l1_t) - linear) / quadratic   # 0 where |linear| <= l1_t
    acc = acc_new

  ``beta`` enters only the quadratic term, as in TF's TPU FTRL (equivalent to ``l2 += beta / (2 * lr)``
  in TF's other FTRL implementations). The row's new value depends on its old value only through
  ``linear``. `allow_zero_accumulator` changes nothing here: accumulators start positive (TF requires it
  too) and only grow, so they are never zero (newer TF ignores the flag). The TPU-only options
  `use_gradient_accumulation` (always True here), `clip_weight_min`/`max`, `weight_decay_factor`,
  `multiply_weight_decay_factor_by_learning_rate`, `slot_variable_creation_fn`, `clipvalue` and
  `low_dimensional_packing_status` accept only their defaults (anything else raises).
  """

  learning_rate: float = 0.001
  learning_rate_power: float = -0.5
  l1_regularization_strength: float = 0.0
  l2_regularization_strength: float = 0.0
  beta: float = 0.0
  initial_accumulator_value: float = 0.1
  use_gradient_accumulation: bool = True
  clip_weight_min: Any = None
  clip_weight_max: Any = None
  weight_decay_factor: Any = None
  multiply_weight_decay_factor_by_learning_rate: Any = None
  slot_variable_creation_fn: Any = None
  clipvalue: Any = None
  multiply_linear_by_learning_rate: bool = False
  allow_zero_accumulator: bool = False
  low_dimensional_packing_status: bool = False

  def __post_init__(self) -> None:
    where = "FTRL"
    set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
    set_("learning_rate", _check_rate(self.learning_rate, where))
    set_("learning_rate_power", _check_number(self.learning_rate_power, where, "learning_rate_power",
                                              lambda v: v <= 0, "a number <= 0 (0: a fixed learning rate)"))
    for name in ("l1_regularization_strength", "l2_regularization_strength", "beta"):
      set_(name, _check_number(getattr(self, name), where, name, lambda v: v >= 0, "a number >= 0"))
    # Positive in float32 too: a zero accumulator would make quadratic 0 (TF also requires > 0).
    set_("initial_accumulator_value", _check_number(
        self.initial_accumulator_value, where, "initial_accumulator_value",
        lambda v: _F32_TINY <= v <= _F32_MAX, "a positive number within float32's normal range"))
    for name in ("multiply_linear_by_learning_rate", "allow_zero_accumulator"):
      set_(name, _check_flag(getattr(self, name), where, name))
    _reject_unsupported_tf_options(self)

  slots = ("accumulators", "linears")

  def slot_initial_values(self) -> dict[str, float]:
    return {"accumulators": self.initial_accumulator_value, "linears": 0.0}

  def update(self, rows, slots, g, touched, step):
    del step
    lr, p = self.learning_rate, -self.learning_rate_power
    l1, l2, beta = self.l1_regularization_strength, self.l2_regularization_strength, self.beta
    acc, linear = slots["accumulators"], slots["linears"]
    new_acc = acc + g * g
    if p == 0.5:  # TF's special case: sqrt rather than pow
      pow_new, pow_old = jnp.sqrt(new_acc), jnp.sqrt(acc)
    else:
      pow_new, pow_old = jnp.power(new_acc, p), jnp.power(acc, p)
    if self.multiply_linear_by_learning_rate:
      new_linear = linear + (g * lr - (pow_new - pow_old) * rows)
      l1_t, quadratic = l1 * lr, pow_new + beta + 2 * l2 * lr
    else:
      new_linear = linear + (g - (pow_new - pow_old) / lr * rows)
      l1_t, quadratic = l1, (pow_new + beta) / lr + 2 * l2
    new_rows = (jnp.clip(new_linear, -l1_t, l1_t) - new_linear) / quadratic
    keep = touched[:, None]
    return jnp.where(keep, new_rows, rows), {"accumulators": jnp.where(keep, new_acc, acc),
                                             "linears": jnp.where(keep, new_linear, linear)}


@dataclasses.dataclass(frozen=True)
class AdagradMomentum:
  """Adagrad with momentum (TF's `tf.tpu.experimental.embedding.AdagradMomentum`, the TPU embedding
  ``AdagradMomentumParameters``; arXiv:2002.11803), on the touched rows.

  Slots ``accumulators`` and ``momenta``, both starting at 0 (as in TF). For a row's summed gradient ``g``::

    acc = acc + g**2                           if beta2 == 1 (TF's default)
    acc = beta2 * acc + (1 - beta2) * g**2     otherwise
    pg  = g * (acc + epsilon) ** (-1 / exponent)
    momenta = momentum * momenta + pg
    update  = momentum * momenta + pg          if use_nesterov, else momenta
    row -= learning_rate * update

  The momentum accumulates the preconditioned gradient ``pg``, as TF's TPU correctness test checks it
  (the proto's comment, ``mom = momentum * mom + (acc + epsilon)**(-1/exponent)`` then
  ``row -= lr * g * update``, differs from it after the first step unless ``momentum == 0``). Untouched
  rows keep their values and slots (no momentum step without a gradient, as TF's sparse update). The
  TPU-only options `use_gradient_accumulation` (always True here), `clip_weight_min`/`max`,
  `weight_decay_factor`, `multiply_weight_decay_factor_by_learning_rate`, `slot_variable_creation_fn`,
  `clipvalue` and `low_dimensional_packing_status` accept only their defaults (anything else raises).
  """

  learning_rate: float = 0.001
  momentum: float = 0.0
  use_nesterov: bool = False
  exponent: float = 2
  beta2: float = 1
  epsilon: float = 1e-10
  use_gradient_accumulation: bool = True
  clip_weight_min: Any = None
  clip_weight_max: Any = None
  weight_decay_factor: Any = None
  multiply_weight_decay_factor_by_learning_rate: Any = None
  slot_variable_creation_fn: Any = None
  clipvalue: Any = None
  low_dimensional_packing_status: bool = False

  def __post_init__(self) -> None:
    where = "AdagradMomentum"
    set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
    set_("learning_rate", _check_rate(self.learning_rate, where))
    set_("momentum", _check_number(self.momentum, where, "momentum", lambda v: 0 <= v <= 1, "in [0, 1]"))
    set_("use_nesterov", _check_flag(self.use_nesterov, where, "use_nesterov"))
    set_("exponent", _check_number(self.exponent, where, "exponent", lambda v: v > 0, "a positive number"))
    set_("beta2", _check_number(self.beta2, where, "beta2", lambda v: 0 <= v <= 1, "in [0, 1]"))
    set_("epsilon", _check_number(self.epsilon, where, "epsilon", lambda v: _F32_TINY <= v <= _F32_MAX,
                                  "a positive number within float32's normal range"))
    _reject_unsupported_tf_options(self)

  slots = ("accumulators", "momenta")

  def slot_initial_values(self) -> dict[str, float]:
    return {"accumulators": 0.0, "momenta": 0.0}

  def update(self, rows, slots, g, touched, step):
    del step
    acc, mom = slots["accumulators"], slots["momenta"]
    if self.beta2 == 1:
      new_acc = acc + g * g
    else:
      new_acc = self.beta2 * acc + (1 - self.beta2) * (g * g)
    if self.exponent == 2:
      pg = g * lax.rsqrt(new_acc + self.epsilon)
    else:
      pg = g * jnp.power(new_acc + self.epsilon, -1.0 / self.exponent)
    new_mom = self.momentum * mom + pg
    step_ = self.momentum * new_mom + pg if self.use_nesterov else new_mom
    keep = touched[:, None]
    return (jnp.where(keep, rows - self.learning_rate * step_, rows),
            {"accumulators": jnp.where(keep, new_acc, acc), "momenta": jnp.where(keep, new_mom, mom)})


_OPTIMIZERS = (SGD, Adagrad, Adam, FTRL, AdagradMomentum)


# -- configuration ------------------------------------------------------------------------------------


def _truncated_normal(stddev: float) -> Callable[[tuple[int, ...], Any, jax.Array], jax.Array]:
  def init(shape: tuple[int, ...], dtype: Any, key: jax.Array) -> jax.Array:
    return stddev * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)
  return init


class TableConfig:
  """One embedding table (TF's `tf.tpu.experimental.embedding.TableConfig`).

  Args:
    vocabulary_size: rows ``V`` (ids are ``0 <= id < V``; ``-1`` is padding).
    dim: the width ``D`` of a row.
    initializer: ``initializer(shape, dtype) -> array`` for the ``[V, D]`` table, as in TF. None: TF's
      truncated normal with stddev ``1 / sqrt(dim)`` (from `TPUEmbedding.build`'s seed).
    optimizer: this table's `SGD` / `Adagrad` / `Adam` / `FTRL` / `AdagradMomentum`; None: the `TPUEmbedding`'s.
    combiner: how the ids of one example combine: ``"sum"``, ``"mean"`` (weighted mean) or ``"sqrtn"``
      (weighted sum over the square root of the sum of squared weights).
    name: the table's name (the key of `TPUEmbedding.embedding_tables`); default ``table_<i>``.
    max_ids_per_partition: None (the default), or the most ids (duplicates counted) one replica may
      send one owner of this table's rows in one step, all features of the table together: Keras RS's
      and SparseCore's bound of the same name. A bound puts the table on the ``all_to_all`` layout (see
      `TPUEmbedding`), whose buckets it sizes.
    max_unique_ids_per_partition: None, or the most distinct ids one replica may send one owner per step
      (duplicates travel once). The buckets hold ``min(M, ceil(V / N), max_ids_per_partition,
      max_unique_ids_per_partition)`` ids (``M``: the table's ids per replica and step): fewer bytes
      travel than on the all-gather layouts when duplicates are frequent, and a step that exceeds a
      bound fails with an error naming the table and the bound (ids are never dropped): on the host
      (`TPUEmbedding.check_ids`) a ValueError; inside `strategy.run` the ValueError of a host callback,
      which JAX hands on inside a `jax.errors.JaxRuntimeError`.
  """

  def __init__(self, vocabulary_size: int, dim: int, initializer: Callable[..., Any] | None = None,
               optimizer: Any = None, combiner: str = "mean", name: str | None = None,
               max_ids_per_partition: int | None = None, max_unique_ids_per_partition: int | None = None) -> None:
    for arg, value in (("vocabulary_size", vocabulary_size), ("dim", dim)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"TableConfig: {arg} must be a positive int, got {value!r}.")
    if combiner not in _COMBINERS:
      raise ValueError(f"TableConfig: combiner must be one of {_COMBINERS}, got {combiner!r}.")
    if initializer is not None and not callable(initializer):
      raise TypeError(f"TableConfig: initializer must be callable (shape, dtype) -> array, got {initializer!r:.100}.")
    if optimizer is not None and not isinstance(optimizer, _OPTIMIZERS):
      raise TypeError(f"TableConfig: optimizer must be tpustrat.embedding.SGD, Adagrad, Adam, FTRL or AdagradMomentum, got {optimizer!r:.100}.")
    for arg, bound in (("max_ids_per_partition", max_ids_per_partition),
                       ("max_unique_ids_per_partition", max_unique_ids_per_partition)):
      if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, np.integer)) or bound < 1):
        raise ValueError(f"TableConfig: {arg} must be None or a positive int, got {bound!r}.")
    self.vocabulary_size, self.dim = int(vocabulary_size), int(dim)
    self.max_ids_per_partition = None if max_ids_per_partition is None else int(max_ids_per_partition)
    self.max_unique_ids_per_partition = (None if max_unique_ids_per_partition is None
                                         else int(max_unique_ids_per_partition))
    self.initializer, self.optimizer, self.combiner, self.name = initializer, optimizer, combiner, name

  def __repr__(self) -> str:
    return (f"TableConfig(vocabulary_size={self.vocabulary_size}, dim={self.dim}, combiner={self.combiner!r}, "
            f"name={self.name!r})")


class FeatureConfig:
  """One feature looked up in a table (TF's `tf.tpu.experimental.embedding.FeatureConfig`).

  Args:
    table: its `TableConfig` (several features may share one table).
    max_sequence_length: 0 (the default): the feature's ids of an example are combined into one
      activation, ``[b, dim]``, by the table's combiner. ``L > 0``: a sequence feature, as in TF: one
      activation per position, ``[b, L, dim]``, no combiner; ids ``[b, L_in]`` are truncated to ``L``
      or padded with ``-1``, and a ``-1`` position gives a zero row (and gets no update).
    name: the feature's name (for messages).
  """

  def __init__(self, table: TableConfig, max_sequence_length: int = 0, name: str | None = None) -> None:
    if not isinstance(table, TableConfig):
      raise TypeError(f"FeatureConfig: table must be a tpustrat.embedding.TableConfig, got {table!r:.100}.")
    if (isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, (int, np.integer))
        or max_sequence_length < 0):
      raise ValueError(f"FeatureConfig: max_sequence_length must be an int >= 0 (0: not a sequence feature), "
                       f"got {max_sequence_length!r}.")
    self.table, self.max_sequence_length, self.name = table, int(max_sequence_length), name

  def __repr__(self) -> str:
    seq = f", max_sequence_length={self.max_sequence_length}" if self.max_sequence_length else ""
    return f"FeatureConfig(table={self.table.name!r}{seq}, name={self.name!r})"


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
    optimizer: the `SGD` / `Adagrad` / `Adam` / `FTRL` / `AdagradMomentum` of the tables that name none.
    strategy: the strategy whose replicas hold the tables; None: the current one.

  How rows travel depends on each table's size and bounds, decided when a step is traced: a table whose
  block (``ceil(V/N)`` rows) holds at most twice the ids a replica looks up in it per step is
  all-gathered whole; a larger one all-gathers the ids instead; a table with ``max_ids_per_partition`` or
  ``max_unique_ids_per_partition`` is routed over all-to-all in buckets of that size, each distinct id
  once. Each layout takes the same collectives for one table or many (the module docstring has the
  details). The results are the same on every layout.
  """

  def __init__(self, feature_config: Any, optimizer: Any = None, strategy: Any = None) -> None:
    with_paths, self._treedef = jax.tree_util.tree_flatten_with_path(
        feature_config, is_leaf=lambda x: isinstance(x, FeatureConfig))
    leaves = [leaf for _, leaf in with_paths]
    if not leaves or not all(isinstance(f, FeatureConfig) for f in leaves):
      raise TypeError("TPUEmbedding: feature_config must be a nested structure of "
                      f"tpustrat.embedding.FeatureConfig, got {feature_config!r:.200}.")
    if optimizer is not None and not isinstance(optimizer, _OPTIMIZERS):
      raise TypeError(f"TPUEmbedding: optimizer must be tpustrat.embedding.SGD, Adagrad, Adam, FTRL or AdagradMomentum, got {optimizer!r:.100}.")
    self._features = leaves
    self._tables: list[TableConfig] = []
    for f in leaves:
      if not any(f.table is t for t in self._tables):
        self._tables.append(f.table)
    names = [t.name or f"table_{i}" for i, t in enumerate(self._tables)]
    if len(set(names)) != len(names):
      raise ValueError(f"TPUEmbedding: table names must be distinct, got {names} (a table without a name is "
                       "called table_<i>, i its position among the tables in the order the features use them).")
    self._names = names
    # for messages: a feature's name, else its path in the feature config, else its table's name
    self._feature_names = [f.name or jax.tree_util.keystr(path) or names[self._tables.index(f.table)]
                           for path, f in with_paths]
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
    self._forced_layout: str | None = None  # tests: every unbounded table on this layout

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
    `LocalShard` over its block, and the `LocalShard` blocks `apply_gradients` returns come back from `run`
    as `ShardedVariable` values."""
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
    ``[0, vocabulary_size)`` other than ``-1`` (a sequence feature: among its first
    ``max_sequence_length`` positions, which are all `lookup` reads), or a batch exceeds a table's
    bounds. `features`: the feature config's structure of arrays or distributed values, or one
    distributed value of that structure (each replica's checked). `lookup` calls it on concrete inputs;
    inside `strategy.run` the ids are traced and cannot be checked (an out-of-range id then looks up
    zeros and receives no update): check them in the input pipeline."""
    if is_distributed(features):
      for component in self._strategy.experimental_local_results(features):
        self.check_ids(component)
      return
    leaves = self._flatten_features(features, "check_ids")
    for f, fname, ids in zip(self._features, self._feature_names, leaves):
      if isinstance(ids, jax.core.Tracer):
        continue
      for part in self._strategy.experimental_local_results(ids) if is_distributed(ids) else [ids]:
        values = np.asarray(jax.device_get(part))
        if f.max_sequence_length and values.ndim == 2:
          values = values[:, :f.max_sequence_length]  # lookup truncates the rest away
        bad = (values != -1) & ((values < 0) | (values >= f.table.vocabulary_size))
        if bad.any():
          raise ValueError(
              f"TPUEmbedding: feature {fname!r} holds id {int(values[bad][0])}, outside "
              f"[0, {f.table.vocabulary_size}) of table {self._table_name(f.table)!r} (-1 is padding).")
    self._check_bounds_on_host(leaves)

  def _check_bounds_on_host(self, leaves: list[Any]) -> None:
    """The `TableConfig` bounds (``max_ids_per_partition``, ``max_unique_ids_per_partition``) checked on
    concrete features: per replica (a distributed feature's components; a host array is what every
    replica sees), the ids of all features of a table that each owner would receive."""
    for t, name in zip(self._tables, self._names):
      bounds = _bounds(t)
      mine = [(f, ids) for f, ids in zip(self._features, leaves) if f.table is t]
      if not bounds or any(isinstance(ids, jax.core.Tracer) for _, ids in mine):
        continue
      parts = [[np.asarray(jax.device_get(x)) for x in self._strategy.experimental_local_results(ids)]
               if is_distributed(ids) else [np.asarray(ids)] for _, ids in mine]
      rows = -(-t.vocabulary_size // self._n)
      for r in range(max(len(p) for p in parts)):
        flat = []
        for (f, _), p in zip(mine, parts):
          x = p[min(r, len(p) - 1)]
          x = x.reshape(len(x), -1)
          flat.append((x[:, :f.max_sequence_length] if f.max_sequence_length else x).reshape(-1))
        ids = np.concatenate(flat)
        ids = ids[(ids >= 0) & (ids < t.vocabulary_size)]
        for bound, what in bounds:
          counts = np.bincount((ids if what == "max_ids_per_partition" else np.unique(ids)) // rows,
                               minlength=self._n)
          if counts.max(initial=0) > bound:
            o = int(np.argmax(counts))
            raise ValueError(
                f"TPUEmbedding: table {name!r}: a replica's features send {int(counts[o])} "
                f"{'ids' if what == 'max_ids_per_partition' else 'distinct ids'} to replica {o}, more than its "
                f"{what}={bound} (component {r} of the batch). Raise TableConfig({what}=...) or spread the ids.")

  # -- inside run ---------------------------------------------------------------------------------

  def _flatten_features(self, features: Any, where: str, what: str = "features") -> list[Any]:
    """The leaves of `features` (or of the weights or gradients, `what`), one per feature, in the order
    of the feature config; a ValueError naming the expected structure if they do not have it."""
    one = {"features": "array of ids", "weights": "array of weights or None", "gradients": "gradient"}[what]
    try:
      return self._treedef.flatten_up_to(features)
    except (ValueError, TypeError) as e:
      raise ValueError(
          f"TPUEmbedding.{where}: the {what} must have the structure of the feature config, "
          f"{jax.tree.unflatten(self._treedef, [what[:-1]] * self._treedef.num_leaves)!r:.300} (one {one} "
          f"per feature), got {type(features).__name__} {features!r:.120} ({e}).") from None

  def _exchange(self, x: jax.Array) -> jax.Array:
    """`x` [N, ...]: block `o` to replica `o`; returns [N, ...], block `s` from replica `s`."""
    if self._n == 1:
      return x
    return lax.all_to_all(x, REPLICA_AXIS, 0, 0, tiled=True)

  def _exchange_stacked(self, parts: list[jax.Array]) -> list[jax.Array]:
    """One `all_to_all` for every table: each ``[N, C_t, ...]`` part flattened to ``[N, C_t * ...]``,
    exchanged together and given back in the parts' shapes."""
    got = _one_collective([p.reshape(self._n, -1) for p in parts], self._exchange)
    return [g.reshape(p.shape) for p, g in zip(parts, got)]

  def _gather(self, x: jax.Array) -> jax.Array:
    """`x` [X] of every replica: [N, X]."""
    return x[None] if self._n == 1 else lax.all_gather(x, REPLICA_AXIS)

  def _scatter_sum(self, x: jax.Array) -> jax.Array:
    """`x` [N, X]: row `r` summed over the replicas, on replica `r` ([X])."""
    return x[0] if self._n == 1 else lax.psum_scatter(x, REPLICA_AXIS)

  def _weights(self, ids: jax.Array, weights: Any, combiner: str | None) -> jax.Array:
    """The coefficient of each id in its example's activation ([b, L]), zero for padding. `combiner`
    None (a sequence feature): each id's own weight (1 unweighted), no combining."""
    w = jnp.where(ids >= 0, 1.0 if weights is None else jnp.asarray(weights, jnp.float32), 0.0)
    if combiner in (None, "sum"):
      return w
    if combiner == "mean":
      total = jnp.sum(w, axis=1, keepdims=True)
      return w / jnp.where(total == 0, 1.0, total)
    norm = jnp.sqrt(jnp.sum(w * w, axis=1, keepdims=True))
    return w / jnp.where(norm == 0, 1.0, norm)

  def _check_state(self, state: Any, where: str) -> None:
    """A ValueError unless `state` has the structure `build` gives this embedding's tables."""
    ok = (isinstance(state, dict) and {"tables", "slots", "step"} <= set(state)
          and isinstance(state["tables"], dict) and isinstance(state["slots"], dict))
    missing = [n for n in self._names if n not in state["tables"] or n not in state["slots"]] if ok else []
    if not ok or missing:
      got = (f"a dict with tables {sorted(state['tables'])}" if ok
             else f"{type(state).__name__} {state!r:.100}")
      raise ValueError(f"TPUEmbedding.{where}: the state must be what this embedding's build() returned, "
                       f"{{'tables', 'slots', 'step'}} with tables {self._names}; got {got}"
                       f"{f' (missing {missing})' if missing else ''}.")

  def _prepare(self, state: Any, features: Any, weights: Any, where: str) -> list[tuple[Any, str, jax.Array, jax.Array]]:
    """(feature, table name, ids [b, L], coefficients [b, L]) per feature: ids outside the table are -1;
    a sequence feature's ids truncated or padded (-1) to its `max_sequence_length`."""
    if not context_lib.in_replica_context_of_a_run():
      raise RuntimeError(f"TPUEmbedding.{where} runs inside strategy.run (a replica context).")
    ids_list = self._flatten_features(features, where)  # the structure first, named for the caller
    self._check_state(state, where)
    self.check_ids(features)
    weight_list = [None] * len(ids_list) if weights is None else self._flatten_features(weights, where, "weights")
    out = []
    ctx = context_lib.get_replica_context()
    for f, fname, ids, w in zip(self._features, self._feature_names, ids_list, weight_list):
      # A padded batch's padding examples (zeros: id 0) touch no row, whatever the caller masks: the rows
      # past this replica's real ones are found from the batch the ids are (or were computed from).
      real = None if ctx is None else ctx.padding_count(ids, f"TPUEmbedding.{where}: the ids of feature {fname!r}")
      ids = jnp.asarray(ids)
      if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.ndim not in (1, 2):
        raise ValueError(f"TPUEmbedding.{where}: the ids of feature {fname!r} must be int [b] or [b, L], got "
                         f"{ids.dtype}{list(ids.shape)}.")
      ids2 = ids[:, None] if ids.ndim == 1 else ids
      # Compared in a type that holds V: V as a weakly typed int8 or int16 would wrap (200 -> -56).
      ids2 = ids2.astype(jnp.promote_types(ids2.dtype, jnp.int32))
      # An id outside [0, V) cannot be checked while traced: it counts as padding (no row, no weight).
      ids2 = jnp.where((ids2 >= 0) & (ids2 < f.table.vocabulary_size), ids2, -1).astype(jnp.int32)
      if real is not None:
        ids2 = jnp.where(lax.broadcasted_iota(jnp.int32, ids2.shape, 0) < real, ids2, -1)
      if w is not None:
        w = jnp.asarray(w, jnp.float32)
        w = w[:, None] if w.ndim == 1 else w
        if w.shape != ids2.shape:
          raise ValueError(f"TPUEmbedding.{where}: the weights of feature {fname!r} have shape {w.shape}, the "
                           f"ids {ids.shape}.")
      seq = f.max_sequence_length
      if seq:  # TF: longer sequences are truncated, shorter ones padded
        ids2, w = _to_length(ids2, seq, -1), None if w is None else _to_length(w, seq, 0.0)
      coef = self._weights(ids2, w, None if seq else f.table.combiner)
      out.append((f, self._table_name(f.table), ids2, coef))
    return out

  def _capacity(self, table: TableConfig, ids: int, rows: int) -> int:
    """The bucket size: the most distinct ids one replica may send one owner per step. Without bounds,
    ``min(M, Vp/N)`` (all `M` ids of the table, or every row the owner holds): nothing can overflow."""
    cap = min(ids, rows)
    for bound in (table.max_ids_per_partition, table.max_unique_ids_per_partition):
      if bound is not None:
        cap = min(cap, bound)
    return max(cap, 1)

  def _layout(self, table: TableConfig, ids: int, rows: int) -> str:
    """How `table`'s rows travel (see the module docstring), from static sizes: `ids` this replica looks
    up in it per step, `rows` per block. A bounded table is routed over all-to-all in buckets of its
    bound; otherwise a block of at most `_GATHER_TABLE_UP_TO` times `ids` rows is all-gathered whole, and
    larger tables all-gather the ids."""
    if _bounds(table):
      return ALL_TO_ALL
    if self._forced_layout is not None:
      return self._forced_layout
    return ALL_GATHER_TABLE if rows <= _GATHER_TABLE_UP_TO * ids else ALL_GATHER_IDS

  def _routes(self, state: Any, prepared: list[Any], where: str
              ) -> tuple[list[_Route], list[_Gathered], list[_Gathered], list[_Gathered]]:
    """The tables `prepared` looks up (in the order of `table_names`), the ids of all features of each
    concatenated, by layout: a `_Route` per table routed over all-to-all (its ids deduplicated and placed
    in one bucket per owner), a `_Gathered` per table all-gathered whole, and one per table whose ids
    are all-gathered; and last, the tables whose features hold no ids this step (``[b, 0]``), which no
    collective serves: their lookups are empty, and only an optimizer that moves untouched rows updates
    them."""
    routes: list[_Route] = []
    gathered: dict[str, list[_Gathered]] = {ALL_GATHER_TABLE: [], ALL_GATHER_IDS: [], EMPTY: []}
    for t, name in zip(self._tables, self._names):
      members = [i for i, (f, _, _, _) in enumerate(prepared) if f.table is t]
      if not members:
        continue
      block = _block(state["tables"][name], f"table {name!r}", where)
      rows = block.shape[0]
      flat = [prepared[i][2].reshape(-1) for i in members]
      ids = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
      sizes = [x.shape[0] for x in flat]
      layout = EMPTY if ids.shape[0] == 0 else self._layout(t, ids.shape[0], rows)
      if layout != ALL_TO_ALL:
        gathered[layout].append(_Gathered(t, name, block, members, sizes, ids))
        continue
      cap = self._capacity(t, ids.shape[0], rows)
      owner, slot, send, counts = self._route(ids, rows, cap)
      routes.append(_Route(t, name, block, members, sizes, owner, slot, send, counts, jnp.zeros((), jnp.float32)))
    bounded = [r for r in routes if _bounds(r.table)]  # without bounds a bucket holds every id
    if bounded:  # one check for all of them
      check = _check_bounds([(r.name, _bounds(r.table), r.send.shape[1]) for r in bounded],
                            jnp.stack([r.counts for r in bounded])).astype(jnp.float32)
      for r in bounded:
        r.check = check
    return routes, gathered[ALL_GATHER_TABLE], gathered[ALL_GATHER_IDS], gathered[EMPTY]

  def _route(self, ids: jax.Array, rows: int, cap: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(owner [M], slot [M], send [N, cap], counts [2, N]) for a table's flat ids [M] (-1: padding):
    `send[o]` holds the distinct local rows this replica asks replica `o` for (-1: empty), id `i` finds
    its row at ``[owner[i], slot[i]]`` of what comes back (owner N: padding). Duplicates travel once.
    `counts`: the ids, and the distinct ids, this replica sends each owner (for `_check_bounds`)."""
    n, m = self._n, ids.shape[0]
    sentinel = n * rows  # sorts after every id
    uniq, inverse = _unique(jnp.where(ids >= 0, ids, sentinel), sentinel, m)
    u_owner = jnp.minimum(uniq // rows, n)  # n: padding
    per_owner = jnp.zeros((n + 1,), jnp.int32).at[u_owner].add(1)
    # uniq is sorted, so the distinct ids of each owner are consecutive: a slot is the rank among them
    u_slot = jnp.arange(m, dtype=jnp.int32) - (jnp.cumsum(per_owner) - per_owner)[u_owner]
    send = jnp.full((n, cap), -1, jnp.int32).at[u_owner, u_slot].set(uniq % rows, mode="drop")
    owner = u_owner[inverse]
    raw = jnp.zeros((n + 1,), jnp.int32).at[owner].add(1)[:n]
    return owner, u_slot[inverse], send, jnp.stack([raw, per_owner[:n]])

  def _rows_back(self, routes: list[_Route]) -> list[jax.Array]:
    """Each table's rows for its flat ids, ``[M, D]`` (zeros for padding): ids out and rows back, one
    `all_to_all` each way for all tables."""
    if not routes:
      return []
    asked = self._exchange_stacked([r.send for r in routes])  # [N, C]: the rows each replica asks this one for
    found = [jnp.where((a >= 0)[..., None], r.block[jnp.maximum(a, 0)], 0.0) for r, a in zip(routes, asked)]
    back = self._exchange_stacked(found)  # [N, C, D]: the rows this replica asked for, by owner
    out = []
    for r, b in zip(routes, back):
      valid = (r.owner < self._n) & (r.slot < b.shape[1])
      got = b[jnp.minimum(r.owner, self._n - 1), jnp.clip(r.slot, 0, b.shape[1] - 1)]
      out.append(jnp.where(valid[:, None], got, 0.0) + r.check)
    return out

  def _rows_gathered(self, wholes: list[_Gathered]) -> list[jax.Array]:
    """Each all-gathered table's rows for its flat ids, ``[M, D]`` (zeros for padding): the blocks of all
    these tables, flattened and concatenated, in one `all_gather`; each id then reads its row locally."""
    if not wholes:
      return []
    out = []
    for w, blocks in zip(wholes, _one_collective([w.block.reshape(-1) for w in wholes], self._gather)):
      full = blocks.reshape(-1, w.table.dim)  # [Vp, D]: the blocks in order
      out.append(jnp.where((w.ids >= 0)[:, None], full[jnp.maximum(w.ids, 0)], 0.0))
    return out

  def _everyones_ids(self, spread: list[_Gathered]) -> list[jax.Array]:
    """Per table whose ids are all-gathered, ``[N, M]``: every replica's flat ids (one `all_gather` for
    all these tables; `lookup` and `apply_gradients` gather the same ids, which XLA merges)."""
    return _one_collective([w.ids for w in spread], self._gather)

  def _owned(self, w: _Gathered, ids: jax.Array) -> jax.Array:
    """`ids` as local rows of this replica's block of `w`'s table where it owns them, -1 elsewhere."""
    rows = w.block.shape[0]
    local = ids if self._n == 1 else ids - lax.axis_index(REPLICA_AXIS) * rows  # padding (-1) stays < 0
    return jnp.where((local >= 0) & (local < rows), local, -1)  # compares: cheaper than // and %

  def _rows_by_ids(self, spread: list[_Gathered]) -> list[jax.Array]:
    """Each such table's rows for its flat ids, ``[M, D]`` (zeros for padding): every replica's ids
    all-gathered, each owner reads the rows it holds for all of them (zeros for the others), and one
    `psum_scatter` for all these tables hands every replica the sums for its own ids."""
    if not spread:
      return []
    parts = []
    for w, ids in zip(spread, self._everyones_ids(spread)):
      local = self._owned(w, ids)  # [N, M]
      found = jnp.where((local >= 0)[..., None], w.block[jnp.maximum(local, 0)], 0.0)
      parts.append(found.reshape(self._n, -1))
    return [rows.reshape(-1, w.table.dim) for w, rows in zip(spread, _one_collective(parts, self._scatter_sum))]

  def lookup(self, state: dict[str, Any], features: Any, weights: Any = None) -> Any:
    """This replica's activations, with the structure of the feature config: ``[b, dim]`` per feature,
    ``[b, max_sequence_length, dim]`` per sequence feature.

    Call inside `strategy.run`. Each feature is this replica's int ids, ``[b]`` (one id per example) or
    ``[b, L]`` (several, ``-1`` as padding); `weights` (optional, same structure, float ``[b]`` /
    ``[b, L]``) weigh the ids as in TF. An example with no ids gets zeros. A sequence feature
    (``max_sequence_length > 0``) is not combined: position ``j`` of example ``i`` is the row of
    ``ids[i, j]`` (times its weight, if weighted), zeros for ``-1``; ids beyond ``max_sequence_length``
    are dropped and shorter sequences padded, as in TF.

    A partial batch from a distributed dataset is padded with zeros, so its padding examples carry id 0.
    They touch no row, in `lookup` and `apply_gradients` alike: the ids of the padding examples count as
    ``-1`` (zeros out, no gradient, no row counted as touched by lazy Adam, FTRL or AdagradMomentum). The
    padding examples are known from the batch the ids are (the batch's own array), or were computed from
    (their rows followed through the step's program, as for `run`'s outputs: an elementwise function of
    the batch's ids, a `jnp.where` mask, a slice of columns); never from a size alone. Ids whose rows
    cannot be followed there (a sort or gather along the examples) have the padding's size but no known
    padding: a `BatchRowsWarning` says so, and nothing is left out; mask them yourself with
    ``jnp.where(tpustrat.valid_mask(batch)[:, None], ids, -1)``. (With logical cores only the batch's
    own arrays are recognised.)
    """
    prepared = self._prepare(state, features, weights, "lookup")
    routes, wholes, spread, empty = self._routes(state, prepared, "lookup")
    activations: list[Any] = [None] * len(prepared)
    found: list[tuple[_Route | _Gathered, jax.Array]] = [
        *zip(routes, self._rows_back(routes)), *zip(wholes, self._rows_gathered(wholes)),
        *zip(spread, self._rows_by_ids(spread)), *((e, jnp.zeros((0, e.table.dim))) for e in empty)]
    for r, rows in found:
      start = 0
      for i, size in zip(r.members, r.sizes):
        f, _, ids, coef = prepared[i]
        got = rows[start:start + size].reshape(ids.shape + (r.table.dim,))
        start += size
        act = coef[..., None] * got if f.max_sequence_length else jnp.einsum("bl,bld->bd", coef, got)
        # The rows went to their owners and came back in order: example i's activation is row i of ids.
        activations[i] = same_rows(lax.stop_gradient(act), ids)
    return self._treedef.unflatten(activations)

  def apply_gradients(self, state: dict[str, Any], features: Any, gradients: Any, weights: Any = None) -> dict[str, Any]:
    """The state after one optimizer step on the rows `features` touched (call inside `strategy.run`).

    `gradients` are d(loss)/d(activations) of this replica, with the activations' structure; each is
    spread over its example's ids as the combiner weighted them (a sequence feature's: position by
    position) and sent to the rows' owners on the table's layout (module docstring: one `psum_scatter`
    of a dense gradient for small tables, one `all_gather` of the per-id gradients for larger ones, one
    `all_to_all` of gradients summed per distinct id for bounded ones; one per layout for all tables),
    and summed per row there (duplicates add up, across replicas too). On the last two only the touched
    rows and their slots are read and written, scattered into the blocks in place when `run` donates
    the state (``RunOptions(donate_argnums=...)``); non-lazy Adam updates every row, as TF defines it.
    """
    prepared = self._prepare(state, features, weights, "apply_gradients")
    grad_list = self._flatten_features(gradients, "apply_gradients", "gradients")
    routes, wholes, spread, empty = self._routes(state, prepared, "apply_gradients")
    step = state["step"] + 1
    tables, slots = dict(state["tables"]), dict(state["slots"])

    def store(name: str, table: TableConfig, new_rows: jax.Array, new_slots: dict[str, jax.Array]) -> None:
      # Blocks again, so that run returns them as ShardedVariables of the same [V, D] along axis 0.
      shape = state["tables"][name].shape
      tables[name] = LocalShard(new_rows, shape, 0)
      slots[name] = {k: LocalShard(v, shape, 0) for k, v in new_slots.items()}

    def old_slots(name: str) -> dict[str, jax.Array]:
      return {k: _block(v, f"slot {k!r} of table {name!r}", "apply_gradients")
              for k, v in state["slots"][name].items()}

    if routes:
      sent = []
      for r in routes:
        # duplicates of an id on this replica add up here, in the slot they share
        sent.append(jnp.zeros((self._n, r.send.shape[1], r.table.dim), jnp.float32).at[r.owner, r.slot].add(
            self._per_id_gradients(r, prepared, grad_list), mode="drop"))
      asked = self._exchange_stacked([r.send for r in routes])  # the lookup's exchange: XLA merges the two
      received = self._exchange_stacked(sent)  # [N, C, D]: the gradients of the rows in `asked`
      for r, a, g in zip(routes, asked, received):
        store(r.name, r.table, *_update(self._opt(r.table), r.block, old_slots(r.name), a.reshape(-1),
                                        g.reshape(-1, r.table.dim) + r.check, step))
    if wholes:
      for w, (summed, touched) in zip(wholes, self._gradients_scattered(wholes, prepared, grad_list)):
        store(w.name, w.table, *self._opt(w.table).update(w.block, old_slots(w.name), summed, touched, step))
    if spread:
      # every replica's per-id gradients, all-gathered for all these tables at once
      everyone = _one_collective([self._per_id_gradients(w, prepared, grad_list).reshape(-1) for w in spread],
                                 self._gather)
      for w, g, ids in zip(spread, everyone, self._everyones_ids(spread)):
        grads = g.reshape(-1, w.table.dim)  # [N * M, D]
        store(w.name, w.table, *_update(self._opt(w.table), w.block, old_slots(w.name),
                                        self._owned(w, ids).reshape(-1), grads, step))
    for e in empty:  # no ids: TF's sparse rules leave the table alone; non-lazy Adam moves every row
      opt = self._opt(e.table)
      if _updates_untouched_rows(opt):
        rows = e.block.shape[0]
        store(e.name, e.table, *opt.update(e.block, old_slots(e.name), jnp.zeros(e.block.shape, jnp.float32),
                                           jnp.zeros((rows,), bool), step))
    return {"tables": tables, "slots": slots, "step": step}

  def _per_id_gradients(self, r: _Route | _Gathered, prepared: list[Any], grad_list: list[Any]) -> jax.Array:
    """``[M, D]``: the gradient of each of a table's flat ids, d(loss)/d(activation) of its example
    spread as the combiner weighted the ids (a sequence feature: its position's)."""
    dim = r.table.dim
    per_id = []
    for i in r.members:
      f, _, ids, coef = prepared[i]
      g = jnp.asarray(grad_list[i], jnp.float32)
      expected = ids.shape + (dim,) if f.max_sequence_length else (ids.shape[0], dim)
      if g.shape != expected:
        raise ValueError(f"TPUEmbedding.apply_gradients: the gradient of feature {self._feature_names[i]!r} has "
                         f"shape {g.shape}, "
                         f"expected {expected} (its activation's).")
      per_id.append((coef[..., None] * g if f.max_sequence_length else coef[:, :, None] * g[:, None, :]
                     ).reshape(-1, dim))
    return per_id[0] if len(per_id) == 1 else jnp.concatenate(per_id)

  def _gradients_scattered(self, wholes: list[_Gathered], prepared: list[Any], grad_list: list[Any]
                           ) -> list[tuple[jax.Array, jax.Array]]:
    """(summed gradient ``[rows, D]``, touched ``[rows]``) of this replica's block of each all-gathered
    table: every replica adds its ids' gradients into a ``[Vp, D]`` array (duplicates add up), and one
    `psum_scatter` for all these tables sums them over the replicas and hands each owner its block's
    rows. Where the optimizer tells touched rows from untouched ones (lazy Adam, FTRL, Adagrad with
    momentum: a touched row whose gradient sums to zero still moves), a count of 1 per id travels as
    column ``D``; SGD, Adagrad and non-lazy Adam leave a row with a zero gradient as it is (or update
    every row), so they go without it and update every row but the padding."""
    parts, counted = [], []
    for w in wholes:
      dim, rows = w.table.dim, w.block.shape[0]
      count = _touched_matters(self._opt(w.table))
      grads = self._per_id_gradients(w, prepared, grad_list)
      if count:
        grads = jnp.concatenate([grads, jnp.ones((grads.shape[0], 1), jnp.float32)], axis=1)
      target = jnp.where(w.ids >= 0, w.ids, self._n * rows)  # padding: out of bounds, dropped
      dense = jnp.zeros((self._n * rows, grads.shape[1]), jnp.float32).at[target].add(grads, mode="drop")
      parts.append(dense.reshape(self._n, -1))
      counted.append(count)
    out = []
    for w, mine, count in zip(wholes, _one_collective(parts, self._scatter_sum), counted):
      rows, dim = w.block.shape[0], w.table.dim
      g = mine.reshape(rows, -1)  # [rows, D (+ 1)]
      if count:
        touched = g[:, dim] > 0
      else:  # every real row (a padding row's slots are zeros: Adagrad's 0 / sqrt(0) must not run there)
        first = 0 if self._n == 1 else lax.axis_index(REPLICA_AXIS) * rows
        touched = first + jnp.arange(rows) < w.table.vocabulary_size
      out.append((g[:, :dim], touched))
    return out


@dataclasses.dataclass
class _Route:
  """A table's share of one exchange: its features (`members`, indexes into `_prepare`'s list) and
  their flat id counts (`sizes`), and where each of its flat ids went (`owner`, `slot`, `send`)."""

  table: TableConfig
  name: str
  block: jax.Array
  members: list[int]
  sizes: list[int]
  owner: jax.Array
  slot: jax.Array
  send: jax.Array
  counts: jax.Array  # [2, N]: the ids and the distinct ids this replica sends each owner
  check: jax.Array  # float32 zero that fails the step when a bound is exceeded: added to the results,
  # not to the ids sent, so that the exchanges of ids of `lookup` and `apply_gradients` stay one


@dataclasses.dataclass
class _Gathered:
  """The share of a step of a table on one of the all-gather layouts: its features (`members`, `sizes`
  as in `_Route`) and their flat ids (`ids` [M], -1: padding)."""

  table: TableConfig
  name: str
  block: jax.Array
  members: list[int]
  sizes: list[int]
  ids: jax.Array


def _one_collective(parts: list[jax.Array], collective: Callable[[jax.Array], jax.Array]) -> list[jax.Array]:
  """`collective` applied once to `parts` (same leading axes) concatenated along their last axis, and
  its result split back along its last axis into pieces of the parts' sizes: one collective for every
  table of a layout."""
  sizes = [p.shape[-1] for p in parts]
  out = collective(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1))
  return jnp.split(out, np.cumsum(sizes)[:-1].tolist(), axis=-1) if len(parts) > 1 else [out]


def _to_length(x: jax.Array, length: int, fill: Any) -> jax.Array:
  """`x` [b, L] truncated or padded with `fill` to [b, length]."""
  if x.shape[1] >= length:
    return x[:, :length]
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=fill)


def _unique(keys: jax.Array, sentinel: int, size: int) -> tuple[jax.Array, jax.Array]:
  """(uniq [size], inverse [len(keys)]): the distinct `keys` sorted (then `sentinel`), and each key's
  index in them: ``uniq[inverse] == keys``. Static shapes (`jnp.unique(size=...)` by a sort); `size`
  must be at least the number of distinct keys, and ``0 <= keys <= sentinel``."""
  ordered, order = _sort_with_order(keys, sentinel)
  first = jnp.concatenate([jnp.ones((1,), bool), ordered[1:] != ordered[:-1]])
  rank = (jnp.cumsum(first) - 1).astype(jnp.int32)
  inverse = jnp.zeros(keys.shape, jnp.int32).at[order].set(rank)
  uniq = jnp.full((size,), sentinel, keys.dtype).at[rank].set(ordered, mode="drop")
  return uniq, inverse


def _sort_with_order(keys: jax.Array, largest: int) -> tuple[jax.Array, jax.Array]:
  """(`keys` sorted, the permutation that sorts them) for int32 ``0 <= keys <= largest``. One sort of
  one int32 operand, each key packed with its position in the low bits (``key << b | i``) where that fits
  in int32: a sort of (key, position) pairs, what `jnp.argsort` does, costs about ten times as much on
  XLA:CPU (measured: 2.6 ms against 0.3 ms for 4096 keys on 8 emulated devices), and shifts and masks
  unpack what integer division would (slow there too). Ties are broken by position, as in a stable
  sort; keys too large to pack: `jnp.argsort`."""
  n = keys.shape[0]
  bits = max(n - 1, 1).bit_length()
  if (largest << bits) | ((1 << bits) - 1) > np.iinfo(np.int32).max:
    order = jnp.argsort(keys).astype(jnp.int32)
    return keys[order], order
  packed = jnp.sort(lax.shift_left(keys.astype(jnp.int32), jnp.int32(bits)) | jnp.arange(n, dtype=jnp.int32))
  return lax.shift_right_logical(packed, jnp.int32(bits)), packed & jnp.int32((1 << bits) - 1)


def _updates_untouched_rows(opt: Any) -> bool:
  """Whether `opt` changes rows no id touched (non-lazy Adam): it then updates the whole block."""
  return bool(getattr(opt, "updates_untouched_rows", isinstance(opt, Adam) and not opt.lazy_adam))


ALL_TO_ALL, ALL_GATHER_TABLE, ALL_GATHER_IDS = "all_to_all", "all_gather_table", "all_gather_ids"
EMPTY = "empty"  # a table whose features hold no ids in a step
def _touched_matters(opt: Any) -> bool:
  """Whether `opt` updates a touched row whose gradient is zero (lazy Adam, FTRL, Adagrad with momentum):
  SGD and Adagrad leave it as it is, non-lazy Adam updates every row anyway."""
  return not (isinstance(opt, (SGD, Adagrad)) or _updates_untouched_rows(opt))


_GATHER_TABLE_UP_TO = 2  # a table is all-gathered whole when its block has at most this many rows per id
_DENSE_BLOCKS_UP_TO = 2  # dense updates of blocks of at most this many times the received slots (tests: 0)


def _update(opt: Any, block: jax.Array, slots: dict[str, jax.Array], asked: jax.Array, grads: jax.Array,
            step: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The owner's update of its block from the gradients it received: `asked` [K] local rows (-1: empty
  slot; a row asked by several replicas appears several times), `grads` [K, D].

  Sparse (every optimizer but non-lazy Adam): the distinct touched rows are found by a sort, their
  gradients summed, their rows and slots gathered, updated by `opt.update` on ``[K', D]`` and scattered
  back with ``.at[rows].set(mode="drop")``: XLA writes them into the (donated) block in place, and
  nothing of the size of the block is built. Dense (non-lazy Adam: TF's rule on every row; or a block
  of no more rows than the `K` received slots, where the sort costs more than the block): a ``[rows, D]``
  gradient and touched mask, and `opt.update` on the whole block."""
  rows, dim = block.shape
  if _updates_untouched_rows(opt) or rows <= asked.shape[0] * _DENSE_BLOCKS_UP_TO:
    target = jnp.where(asked >= 0, asked, rows)
    summed = jnp.zeros((rows, dim), jnp.float32).at[target].add(grads, mode="drop")
    touched = jnp.zeros((rows,), bool).at[target].set(True, mode="drop")
    return opt.update(block, slots, summed, touched, step)
  size = min(asked.shape[0], rows + 1)  # distinct rows, plus the empty slots' key
  uniq, inverse = _unique(jnp.where(asked >= 0, asked, rows), rows, size)
  summed = jnp.zeros((size, dim), jnp.float32).at[inverse].add(grads)
  touched = uniq < rows  # the rest is the empty slots' key `rows`: out of bounds, dropped below
  at = jnp.minimum(uniq, rows - 1)
  new_rows, new_slots = opt.update(block[at], {k: v[at] for k, v in slots.items()}, summed, touched, step)
  return (block.at[uniq].set(new_rows, mode="drop"),
          {k: slots[k].at[uniq].set(v, mode="drop") for k, v in new_slots.items()})


def _bounds(table: TableConfig) -> list[tuple[int, str]]:
  """[(bound, its name)] of the bounds `table` sets."""
  return [(b, what) for b, what in ((table.max_ids_per_partition, "max_ids_per_partition"),
                                    (table.max_unique_ids_per_partition, "max_unique_ids_per_partition"))
          if b is not None]


def _check_bounds(tables: list[tuple[str, list[tuple[int, str]], int]], counts: jax.Array) -> jax.Array:
  """An int32 zero for the step's results to add, computed by a host callback that raises a ValueError
  naming the table, the bound and the replica when a replica sends one owner more ids than a bound allows
  (the bucket would drop some: the step fails instead). `tables`: (name, bounds, bucket size) of each
  routed table; `counts` [T, 2, N]: the ids and the distinct ids this replica sends each owner, per
  table. Every replica's counts, of all tables, are all-gathered first (one `all_gather`), so every
  replica sees the same excess and fails together (one replica failing alone would leave the others
  waiting in the exchange). Evaluated only when a bound is exceeded; JAX hands the ValueError to the
  caller inside a `jax.errors.JaxRuntimeError`."""
  everyone = lax.all_gather(counts, REPLICA_AXIS)  # [N, T, 2, N]: sender x table x count x owner
  limits = []
  for t, (_, bounds, cap) in enumerate(tables):
    for bound, what in bounds + [(cap, "bucket size")]:
      limits.append((t, 0 if what == "max_ids_per_partition" else 1, bound, what))
  bad = functools.reduce(jnp.logical_or, [jnp.any(everyone[:, t, k] > bound) for t, k, bound, _ in limits])

  def fail(everyone):
    values = np.asarray(everyone)
    for t, k, bound, what in limits:
      over = np.argwhere(values[:, t, k] > bound)
      if over.size:
        sender, o = (int(v) for v in over[0])
        kind = "ids" if k == 0 else "distinct ids"
        raise ValueError(
            f"TPUEmbedding: table {tables[t][0]!r}: replica {sender} sends {int(values[sender, t, k, o])} {kind} to "
            f"replica {o} in one step, more than its {what}={bound}. No id is dropped: the step fails. Raise "
            f"TableConfig({what}=...) or spread the ids (check batches on the host with TPUEmbedding.check_ids).")
    return np.zeros((), np.int32)

  zero = jax.ShapeDtypeStruct((), jnp.int32)
  return lax.cond(bad, lambda: jax.pure_callback(fail, zero, everyone), lambda: jnp.zeros((), jnp.int32))
