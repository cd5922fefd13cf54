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

* ``all_gather_table``, a block of at most ``2 * M`` rows (``exchange.GATHER_TABLE_UP_TO``) and no
  bound: `lookup` all-gathers the blocks of all such tables (one `all_gather`) and reads each id's row
  locally; `apply_gradients` adds each id's gradient into a dense ``[Vp, D]`` array (with a count column
  where the optimizer tells touched rows from untouched ones) and one `psum_scatter` sums them over the
  replicas and hands each owner its block's rows, updated densely. Two collectives per step, moving
  what the all-reduce of a replicated table's gradient moves, with ``1/N`` of the update.
* ``all_gather_ids``, larger tables without a bound: every replica's ids are all-gathered (``N * M``
  int32, one `all_gather`; `lookup` and `apply_gradients` gather the same ids, which XLA merges), each
  owner reads the rows it holds for all of them (zeros elsewhere) and one `psum_scatter` hands every
  replica the rows of its own ids; the gradients go out in one `all_gather` of the per-id gradients,
  and each owner updates the rows it holds (`exchange.update_rows`). The partition XLA's SPMD partitioner
  gives a ``jnp.take`` on a row-sharded table, with a reduce-scatter where it all-reduces and sparse
  updates where it rewrites the block.
* ``all_to_all``, a table with ``max_ids_per_partition`` or ``max_unique_ids_per_partition``: its ids
  (all its features', concatenated) are sorted and deduplicated (`exchange.route`), and each distinct id
  takes a slot in the bucket of its owner, ``[N, C]``, ``C = min(M, ceil(V/N), max_ids_per_partition,
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

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src.batch_rows import same_rows
from tpustrat._src.embedding.config import FeatureConfig, TableConfig, bounds_of, truncated_normal
from tpustrat._src.embedding.exchange import (
  ALL_GATHER_IDS,
  ALL_GATHER_TABLE,
  ALL_TO_ALL,
  EMPTY,
  GATHER_TABLE_UP_TO,
  Gathered,
  Route,
  check_bounds,
  one_collective,
  route,
  update_rows,
)
from tpustrat._src.embedding.optimizers import OPTIMIZERS, touched_matters, updates_untouched_rows
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import Groups, LocalShard, ShardedVariable, group_position, scatter_sum
from tpustrat._src.sharding import place_blocks, resolve_groups
from tpustrat._src.values import Mirrored, is_distributed


def split_rows(full: Any, num_replicas: int, mesh: Any, groups: Groups | None = None) -> ShardedVariable:
  """`full` ``[V, D]`` as a `ShardedVariable` split along axis 0: padded with zero rows to a multiple of
  `num_replicas` and split into one block of ``ceil(V / N)`` rows per replica, the blocks stacked
  ``[N, ceil(V / N), D]`` and sharded over the replicas. Placed from the host as `experimental_shard`
  places a value (`place_blocks`): each device receives only its block, each process builds only its own.
  With `groups` (hybrid), split within each group (``ceil(V / S)`` rows a block) and replicated across."""
  value = np.asarray(jax.device_get(full))
  blocks = place_blocks(value, 0, num_replicas, NamedSharding(mesh, P(REPLICA_AXIS)), groups)
  return ShardedVariable.from_blocks(blocks, value.shape, 0, groups)


def local_block(value: Any, name: str, where: str) -> jax.Array:
  """This replica's ``[ceil(V / N), D]`` block of a table or slot: the `LocalShard` `run` hands the step."""
  if isinstance(value, LocalShard) and value.axis == 0:
    return value.block
  raise TypeError(f"TPUEmbedding.{where}: the state's {name} is {value!r:.120}, not this replica's block of a "
                  "table split by rows (a LocalShard inside strategy.run): pass the state TPUEmbedding.build or "
                  "a previous step returned.")


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
    groups: hybrid sharding, as `Strategy.experimental_shard`'s: ``"process"``, ``"slice"`` or lists of
      replica ids. Each table is split by rows within each group (``ceil(V/S)`` rows a block, ``S``
      replicas a group) and replicated across the groups: lookups exchange ids and rows within the
      group only; the gradients of the rows reach the block's owners in every group (the dense layout:
      reduce-scattered within the group, the block all-reduced across; the others: the per-id gradients
      gathered across the groups), so every group's tables stay equal.

  How rows travel depends on each table's size and bounds, decided when a step is traced: a table whose
  block (``ceil(V/N)`` rows) holds at most twice the ids a replica looks up in it per step is
  all-gathered whole; a larger one all-gathers the ids instead; a table with ``max_ids_per_partition`` or
  ``max_unique_ids_per_partition`` is routed over all-to-all in buckets of that size, each distinct id
  once. Each layout takes the same collectives for one table or many (the module docstring has the
  details). The results are the same on every layout.
  """

  def __init__(self, feature_config: Any, optimizer: Any = None, strategy: Any = None, groups: Any = None) -> None:
    with_paths, self._treedef = jax.tree_util.tree_flatten_with_path(
        feature_config, is_leaf=lambda x: isinstance(x, FeatureConfig))
    leaves = [leaf for _, leaf in with_paths]
    if not leaves or not all(isinstance(f, FeatureConfig) for f in leaves):
      raise TypeError("TPUEmbedding: feature_config must be a nested structure of "
                      f"tpustrat.embedding.FeatureConfig, got {feature_config!r:.200}.")
    if optimizer is not None and not isinstance(optimizer, OPTIMIZERS):
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
    # hybrid sharding: the tables split within each group of replicas, replicated across the groups
    self._groups = resolve_groups(mesh, groups, "TPUEmbedding")
    self._replicas = self._strategy.num_replicas_in_sync
    self._n = self._replicas if self._groups is None else len(self._groups[0])  # blocks of a table: its owners
    self._lax_groups = None if self._groups is None else [list(g) for g in self._groups]
    self._mesh = mesh
    self._forced_layout: str | None = None  # tests: every unbounded table on this layout

  # -- layout -------------------------------------------------------------------------------------

  def _table_name(self, table: TableConfig) -> str:
    return self._names[next(i for i, t in enumerate(self._tables) if t is table)]

  def _opt(self, table: TableConfig) -> Any:
    return table.optimizer or self._optimizer

  def rows_per_replica(self, table_name: str) -> int:
    """``Vp / N``: the rows of table `table_name` that each replica holds (padding included; with groups,
    ``Vp / S`` for ``S`` replicas per group)."""
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
        full = truncated_normal(1.0 / math.sqrt(t.dim))(shape, jnp.float32, jax.random.fold_in(key, i))
      else:
        full = jnp.asarray(t.initializer(shape, jnp.float32), jnp.float32)
        if full.shape != shape:
          raise ValueError(f"TPUEmbedding.build: the initializer of table {name!r} returned shape {full.shape}, "
                           f"expected {shape}.")
      tables[name] = split_rows(full, self._replicas, self._mesh, self._groups)
      slots[name] = {slot: split_rows(np.full(shape, value, np.float32), self._replicas, self._mesh, self._groups)
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
      bounds = bounds_of(t)
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
    return lax.all_to_all(x, REPLICA_AXIS, 0, 0, tiled=True, axis_index_groups=self._lax_groups)

  def _exchange_stacked(self, parts: list[jax.Array]) -> list[jax.Array]:
    """One `all_to_all` for every table: each ``[N, C_t, ...]`` part flattened to ``[N, C_t * ...]``,
    exchanged together and given back in the parts' shapes."""
    got = one_collective([p.reshape(self._n, -1) for p in parts], self._exchange)
    return [g.reshape(p.shape) for p, g in zip(parts, got)]

  def _gather(self, x: jax.Array) -> jax.Array:
    """`x` [X] of every replica (of this replica's group): [N, X]."""
    return x[None] if self._n == 1 else lax.all_gather(x, REPLICA_AXIS, axis_index_groups=self._lax_groups)

  def _scatter_sum(self, x: jax.Array) -> jax.Array:
    """`x` [N, X]: row `r` summed over the replicas (of this replica's group), on replica `r` ([X])."""
    return x[0] if self._n == 1 else lax.psum_scatter(x, REPLICA_AXIS, axis_index_groups=self._lax_groups)

  def _gradient_sum(self, x: jax.Array) -> jax.Array:
    """`x` [N, X]: row `r` summed over every replica, on the replicas holding block `r` ([X]): with groups,
    within the group, then the block across the groups (each group's updates are every group's)."""
    if self._groups is None:
      return self._scatter_sum(x)
    return scatter_sum(x, 0, self._groups).reshape(x.shape[1:])

  def _gather_everyone(self, x: jax.Array) -> jax.Array:
    """`x` [X] of every replica of the job, groups or not: [replicas, X] (the gradients' ids)."""
    return self._gather(x) if self._groups is None else lax.all_gather(x, REPLICA_AXIS)

  def _across_groups(self, x: jax.Array) -> jax.Array:
    """`x` of the replica at this replica's position in every group, stacked on axis 0 (``[G, ...]``), and
    flattened into that axis: what the owners of one block receive, in every group alike."""
    if self._groups is None:
      return x
    across = [list(c) for c in zip(*self._groups)]
    return lax.all_gather(x, REPLICA_AXIS, axis_index_groups=across, tiled=True)

  def _block_index(self) -> Any:
    """Which block of each table this replica holds: its replica id, or with groups its position."""
    r = lax.axis_index(REPLICA_AXIS)
    return r if self._groups is None else jnp.asarray(group_position(self._groups), jnp.int32)[r]

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
    bound; otherwise a block of at most `GATHER_TABLE_UP_TO` times `ids` rows is all-gathered whole, and
    larger tables all-gather the ids."""
    if bounds_of(table):
      return ALL_TO_ALL
    if self._forced_layout is not None:
      return self._forced_layout
    return ALL_GATHER_TABLE if rows <= GATHER_TABLE_UP_TO * ids else ALL_GATHER_IDS

  def _routes(self, state: Any, prepared: list[Any], where: str
              ) -> tuple[list[Route], list[Gathered], list[Gathered], list[Gathered]]:
    """The tables `prepared` looks up (in the order of `table_names`), the ids of all features of each
    concatenated, by layout: a `Route` per table routed over all-to-all (its ids deduplicated and placed
    in one bucket per owner), a `Gathered` per table all-gathered whole, and one per table whose ids
    are all-gathered; and last, the tables whose features hold no ids this step (``[b, 0]``), which no
    collective serves: their lookups are empty, and only an optimizer that moves untouched rows updates
    them."""
    routes: list[Route] = []
    gathered: dict[str, list[Gathered]] = {ALL_GATHER_TABLE: [], ALL_GATHER_IDS: [], EMPTY: []}
    for t, name in zip(self._tables, self._names):
      members = [i for i, (f, _, _, _) in enumerate(prepared) if f.table is t]
      if not members:
        continue
      block = local_block(state["tables"][name], f"table {name!r}", where)
      rows = block.shape[0]
      flat = [prepared[i][2].reshape(-1) for i in members]
      ids = flat[0] if len(flat) == 1 else jnp.concatenate(flat)
      sizes = [x.shape[0] for x in flat]
      layout = EMPTY if ids.shape[0] == 0 else self._layout(t, ids.shape[0], rows)
      if layout != ALL_TO_ALL:
        gathered[layout].append(Gathered(t, name, block, members, sizes, ids))
        continue
      cap = self._capacity(t, ids.shape[0], rows)
      owner, slot, send, counts = route(ids, self._n, rows, cap)
      routes.append(Route(t, name, block, members, sizes, owner, slot, send, counts, jnp.zeros((), jnp.float32)))
    bounded = [r for r in routes if bounds_of(r.table)]  # without bounds a bucket holds every id
    if bounded:  # one check for all of them
      check = check_bounds([(r.name, bounds_of(r.table), r.send.shape[1]) for r in bounded],
                            jnp.stack([r.counts for r in bounded])).astype(jnp.float32)
      for r in bounded:
        r.check = check
    return routes, gathered[ALL_GATHER_TABLE], gathered[ALL_GATHER_IDS], gathered[EMPTY]

  def _rows_back(self, routes: list[Route]) -> list[jax.Array]:
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

  def _rows_gathered(self, wholes: list[Gathered]) -> list[jax.Array]:
    """Each all-gathered table's rows for its flat ids, ``[M, D]`` (zeros for padding): the blocks of all
    these tables, flattened and concatenated, in one `all_gather`; each id then reads its row locally."""
    if not wholes:
      return []
    out = []
    for w, blocks in zip(wholes, one_collective([w.block.reshape(-1) for w in wholes], self._gather)):
      full = blocks.reshape(-1, w.table.dim)  # [Vp, D]: the blocks in order
      out.append(jnp.where((w.ids >= 0)[:, None], full[jnp.maximum(w.ids, 0)], 0.0))
    return out

  def _everyones_ids(self, spread: list[Gathered]) -> list[jax.Array]:
    """Per table whose ids are all-gathered, ``[N, M]``: every replica's flat ids (one `all_gather` for
    all these tables; `lookup` and `apply_gradients` gather the same ids, which XLA merges)."""
    return one_collective([w.ids for w in spread], self._gather)

  def _owned(self, w: Gathered, ids: jax.Array) -> jax.Array:
    """`ids` as local rows of this replica's block of `w`'s table where it owns them, -1 elsewhere."""
    rows = w.block.shape[0]
    local = ids if self._n == 1 else ids - self._block_index() * rows  # padding (-1) stays < 0
    return jnp.where((local >= 0) & (local < rows), local, -1)  # compares: cheaper than // and %

  def _rows_by_ids(self, spread: list[Gathered]) -> list[jax.Array]:
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
    return [rows.reshape(-1, w.table.dim) for w, rows in zip(spread, one_collective(parts, self._scatter_sum))]

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
    found: list[tuple[Route | Gathered, jax.Array]] = [
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
      tables[name] = LocalShard(new_rows, shape, 0, self._groups)
      slots[name] = {k: LocalShard(v, shape, 0, self._groups) for k, v in new_slots.items()}

    def old_slots(name: str) -> dict[str, jax.Array]:
      return {k: local_block(v, f"slot {k!r} of table {name!r}", "apply_gradients")
              for k, v in state["slots"][name].items()}

    if routes:
      sent = []
      for r in routes:
        # duplicates of an id on this replica add up here, in the slot they share
        sent.append(jnp.zeros((self._n, r.send.shape[1], r.table.dim), jnp.float32).at[r.owner, r.slot].add(
            self._per_id_gradients(r, prepared, grad_list), mode="drop"))
      asked = self._exchange_stacked([r.send for r in routes])  # the lookup's exchange: XLA merges the two
      received = self._exchange_stacked(sent)  # [N, C, D]: the gradients of the rows in `asked`
      # with groups: every group's owner of this block receives every group's buckets
      asked, received = [self._across_groups(a) for a in asked], [self._across_groups(g) for g in received]
      for r, a, g in zip(routes, asked, received):
        store(r.name, r.table, *update_rows(self._opt(r.table), r.block, old_slots(r.name), a.reshape(-1),
                                        g.reshape(-1, r.table.dim) + r.check, step))
    if wholes:
      for w, (summed, touched) in zip(wholes, self._gradients_scattered(wholes, prepared, grad_list)):
        store(w.name, w.table, *self._opt(w.table).update(w.block, old_slots(w.name), summed, touched, step))
    if spread:
      # every replica's per-id gradients, all-gathered for all these tables at once
      everyone = one_collective([self._per_id_gradients(w, prepared, grad_list).reshape(-1) for w in spread],
                                 self._gather_everyone)
      ids_of_all = self._everyones_ids(spread) if self._groups is None else one_collective(
          [w.ids for w in spread], self._gather_everyone)  # with groups: every group's ids
      for w, g, ids in zip(spread, everyone, ids_of_all):
        grads = g.reshape(-1, w.table.dim)  # [N * M, D]
        store(w.name, w.table, *update_rows(self._opt(w.table), w.block, old_slots(w.name),
                                        self._owned(w, ids).reshape(-1), grads, step))
    for e in empty:  # no ids: TF's sparse rules leave the table alone; non-lazy Adam moves every row
      opt = self._opt(e.table)
      if updates_untouched_rows(opt):
        rows = e.block.shape[0]
        store(e.name, e.table, *opt.update(e.block, old_slots(e.name), jnp.zeros(e.block.shape, jnp.float32),
                                           jnp.zeros((rows,), bool), step))
    return {"tables": tables, "slots": slots, "step": step}

  def _per_id_gradients(self, r: Route | Gathered, prepared: list[Any], grad_list: list[Any]) -> jax.Array:
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

  def _gradients_scattered(self, wholes: list[Gathered], prepared: list[Any], grad_list: list[Any]
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
      count = touched_matters(self._opt(w.table))
      grads = self._per_id_gradients(w, prepared, grad_list)
      if count:
        grads = jnp.concatenate([grads, jnp.ones((grads.shape[0], 1), jnp.float32)], axis=1)
      target = jnp.where(w.ids >= 0, w.ids, self._n * rows)  # padding: out of bounds, dropped
      dense = jnp.zeros((self._n * rows, grads.shape[1]), jnp.float32).at[target].add(grads, mode="drop")
      parts.append(dense.reshape(self._n, -1))
      counted.append(count)
    out = []
    for w, mine, count in zip(wholes, one_collective(parts, self._gradient_sum), counted):
      rows, dim = w.block.shape[0], w.table.dim
      g = mine.reshape(rows, -1)  # [rows, D (+ 1)]
      if count:
        touched = g[:, dim] > 0
      else:  # every real row (a padding row's slots are zeros: Adagrad's 0 / sqrt(0) must not run there)
        first = 0 if self._n == 1 else self._block_index() * rows
        touched = first + jnp.arange(rows) < w.table.vocabulary_size
      out.append((g[:, :dim], touched))
    return out


def _to_length(x: jax.Array, length: int, fill: Any) -> jax.Array:
  """`x` [b, L] truncated or padded with `fill` to [b, length]."""
  if x.shape[1] >= length:
    return x[:, :length]
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=fill)
