"""The embedding's configuration: `TableConfig` (a table, its optimizer, combiner and bounds) and
`FeatureConfig` (a feature looked up in a table), TF's `tf.tpu.experimental.embedding` configs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tpustrat._src.embedding.optimizers import OPTIMIZERS

_COMBINERS = ("sum", "mean", "sqrtn")


def truncated_normal(stddev: float) -> Callable[[tuple[int, ...], Any, jax.Array], jax.Array]:
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
    if optimizer is not None and not isinstance(optimizer, OPTIMIZERS):
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


def bounds_of(table: TableConfig) -> list[tuple[int, str]]:
  """[(bound, its name)] of the bounds `table` sets."""
  return [(b, what) for b, what in ((table.max_ids_per_partition, "max_ids_per_partition"),
                                    (table.max_unique_ids_per_partition, "max_unique_ids_per_partition"))
          if b is not None]
