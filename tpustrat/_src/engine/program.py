"""The program builder: how `strategy.run(fn, args)` becomes one compiled SPMD program.

`run` is `jax.jit(jax.shard_map(fn))` over the strategy's mesh:

* Inputs: each `PerReplica` leaf enters with `in_specs=P('replica')` (its leading replica axis is split,
  and removed before `fn` sees its component); `Mirrored` values, plain arrays and Python scalars enter
  with `P()` (every replica gets the whole value).
* Outputs: while `fn` is traced, JAX's varying-axis analysis (``check_vma=True``) records, for every
  output leaf, whether it varies over the replica axis. Invariant leaves (for example the result of an
  `all_reduce`) leave the program with `P()` and are returned as `Mirrored`: one replicated global
  array, never stacked. Varying leaves get a leading axis and `P('replica')` and are returned as
  `PerReplica`. The split is made inside one trace: the body returns ``(invariant, varying)`` and
  `out_specs=(P(), P('replica'))` is a prefix of it, so `fn` is traced once per input signature.
* Padded batches (from the input pipeline, or outputs marked per-example): their per-replica real-row
  counts enter as one more `P('replica')` input, so full and partial batches share a program; inside
  `fn` they back `tpustrat.valid_mask` / `num_valid_examples`. An output that `fn` marked with
  `tpustrat.per_example` leaves `run` as a padded batch (its padding is skipped everywhere). An unmarked
  varying output whose axis 0 holds one padded batch's rows leaves carrying that batch's counts as
  *batch rows*, used only by ``reduce(op, v, axis=0)`` and ``gather(v, axis=0)``: the caller's word
  that axis 0 is the batch. Which outputs hold which batch's rows is read from the step's jaxpr
  (`tpustrat._src.batch_rows`; the step is traced once to a jaxpr and evaluated into the body), never
  from a size. The leaves of one dataset element are one batch (`batch_group`), any other padded value
  its own, so two batches of one size keep their own counts.
* Caching (`Engine`): one `jax.jit` per `(fn, argument structure)`; it takes the flattened argument leaves
  and returns the flattened result (`flat_program.FlatProgram`). `jax.jit` itself caches per shapes,
  dtypes and shardings: calling `run` again with the same kind of arguments never retraces `fn`.
* Logical cores: when the strategy's replicas have several logical cores (a `DeviceAssignment` with
  ``num_cores_per_replica > 1``), the mesh has core axes after ``'replica'`` and the `shard_map` is
  manual over ``'replica'`` only (``axis_names={'replica'}``): `in_specs` / `out_specs` name the replica
  axis alone, the body sees one replica's values, and how they are laid out on the replica's cores is
  left to XLA, steered by the annotations of `tpustrat._src.logical` (`fn` is traced once to a jaxpr so
  that `experimental_assign_to_logical_device` can place computations). The varying-axis analysis still
  tracks ``'replica'`` only, so a value split across the cores of each replica but equal across
  replicas is `Mirrored`. Results keep the layout XLA gives them over the cores (a split tensor comes
  back split), and arguments laid out differently over the cores only are passed as they are.
  `RunOptions(experimental_layout_map=...)` (a `logical.LayoutMap`) pins the results it matches, by their
  path in `fn`'s result, to its layout over the cores (a sharding constraint on the global result, after
  the `shard_map`): state that `strategy.experimental_shard(..., layout_map=...)` split over the cores
  stays split, optimizer state made inside the step included.
* Steps in flight: `run` dispatches the program under the engine's bound on programs in flight
  (`in_flight`), waiting on the smallest output the program computes.

`make_program` builds that program for one step function (`Engine` caches it, per function and argument
structure, as a `flat_program.FlatProgram`). The step's jaxpr and what is read off it are in `step_jaxpr`,
the padding of the outputs in `output_padding`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context as context_lib
from tpustrat._src import numerics as numerics_lib
from tpustrat._src.batch_rows import Rows
from tpustrat._src.engine.output_padding import arguments_signature, note_padding_reads, output_padding
from tpustrat._src.engine.step_jaxpr import (
  StepJaxpr,
  as_output_array,
  is_output_node,
  leaf_paths,
  warn_unresolved,
)
from tpustrat._src.engine.weak_keys import weak_callable
from tpustrat._src.jax_compat import to_varying, varying_axes
from tpustrat._src.logical import LayoutMap, layout_spec
from tpustrat._src.logical_interpreter import place_on_logical_devices
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import LocalShard, ShardedVariable
from tpustrat._src.validation import tree_path
from tpustrat._src.values import Mirrored, PerReplica, check_components, is_distributed

__all__ = ["batch_group", "make_program", "pin_layouts"]


class _OnMesh:
  """A `logical.MeshStrategy` over `mesh` (what `layout_spec` reads of a strategy)."""

  def __init__(self, mesh: jax.sharding.Mesh) -> None:
    self.mesh = mesh


def make_program(fn: Callable[..., Any], groups: tuple[int, ...], *, mesh: jax.sharding.Mesh, num_replicas: int,
                 make_context: Callable[[list[tuple[int, Any]]], context_lib.ReplicaContext],
                 layout_map: LayoutMap | None = None,
                 numerics: numerics_lib.Outputs | None = None) -> Callable[..., Any]:
  """The structured program of `fn` on `mesh` (``'replica'`` of `num_replicas`, then any logical-core axes;
  `make_context` gives the `ReplicaContext` `fn` sees: see `Engine`); `groups` (see `batch_group`) says which padded batch arguments
  are one batch (share their real-row counts); `layout_map` pins the results it matches to their
  layouts over the logical cores (`RunOptions.experimental_layout_map`). With `numerics`
  (`RunOptions.check_numerics`) it returns ``(result, flags)``, `flags` being every replica's NaN / Inf
  flags of the floating outputs (`numerics.replica_flags`), and records in `numerics` which outputs
  they describe."""
  name = getattr(fn, "__name__", "fn")
  # What the trace found that is said when a call shows it matters: the padding-read warning, said at
  # the first call whose batch is partial (a program made on a full batch serves the partial one too).
  notes: dict[str, Any] = {}
  fn = weak_callable(fn)  # the cache must not keep the user's function (and its closure) alive
  axis = REPLICA_AXIS
  n = num_replicas
  core_axes = tuple(a for a in mesh.axis_names if a != axis)  # logical cores of a replica
  manual = {"axis_names": frozenset({axis})} if core_axes else {}  # core axes: left to XLA

  def program(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # Runs once per input signature, at trace time: validate, then build the SPMD body.
    top, outer = jax.tree.flatten((args, kwargs), is_leaf=is_distributed)
    flat: list[Any] = []
    specs: list[P] = []
    rebuild: list[tuple[str, Any, int]] = []
    padded: list[int] = []  # positions in `flat` of the real-row counts of padded batches
    padded_paths: list[str] = []
    padded_zero: list[bool] = []  # of each padded argument: its padding rows are zeros (`ElementTag`)
    for path, node in zip(leaf_paths(outer), top):
      if isinstance(node, PerReplica):
        leaves, inner = jax.tree.flatten(node.tree)
        for x in leaves:
          check_components(x, n, f"strategy.run: the PerReplica value at {path}")
        # A padded batch: its real-row counts enter as one more input (an unmarked output's batch
        # rows do not make it a padded batch of this step).
        valid = node.real_rows_array if node.padding_is_marked else None
        if valid is not None:
          _check_padded(leaves, path)
          _check_real_rows(valid, n, path)
          padded.append(len(flat) + len(leaves))
          padded_paths.append(path)
          padded_zero.append(node.batch_tag is not None and node.batch_tag.zero_padded)
          leaves = leaves + [valid]
        rebuild.append(("padded" if valid is not None else "per_replica", inner, len(leaves)))
        flat.extend(leaves)
        specs.extend([P(axis)] * len(leaves))
      elif isinstance(node, ShardedVariable):
        rebuild.append(("sharded", (node.shape, node.axis, node.groups), 1))
        flat.append(node.tree)
        specs.append(P(axis))
      elif isinstance(node, Mirrored):
        leaves, inner = jax.tree.flatten(node.tree)
        rebuild.append(("mirrored", inner, len(leaves)))
        flat.extend(leaves)
        specs.extend([P()] * len(leaves))
      else:
        rebuild.append(("plain", None, 1))
        flat.append(node)
        specs.append(P())

    # One batch per group of padded arguments with the same counts (and size): its first argument's.
    batch_of_arg = [groups[j] if j < len(groups) else j for j in range(len(padded))]
    batches = sorted(set(batch_of_arg))
    record: dict[str, Any] = {}

    def marking(*args: Any, **kwargs: Any) -> Any:
      # `tpustrat.per_example` marks arrays by identity; resolved to output positions here, where `fn`'s
      # own results are seen (before a logical-core re-evaluation makes new ones).
      out = fn(*args, **kwargs)
      ctx = context_lib.get_replica_context()
      assert ctx is not None  # `body` calls this inside `enter_replica_context`
      marks = ctx.per_example_marks  # (array, batch or None)
      leaves = jax.tree.leaves(out, is_leaf=is_distributed)
      record["marked"] = {i: j for i, x in enumerate(leaves) for m, j in marks if x is m}
      return out

    # With logical cores, `fn` is traced to a jaxpr once and evaluated with its placements honoured.
    call = place_on_logical_devices(marking, core_axes, n) if core_axes else marking

    def body(*flat_in: Any) -> Any:
      nodes, row_leaves, size_of = _unpack(flat_in, rebuild, batch_of_arg)
      batch_leaves = [(batches.index(batch_of_arg[arg]), leaves) for arg, leaves in row_leaves]
      sizes = [size_of[b] for b in batches]  # per padded batch
      counts = [flat_in[padded[b]].reshape(()).astype(jnp.int32) for b in batches]  # this replica's real rows
      names = tuple(f"the argument at {padded_paths[b]}" for b in batches)
      if (batches or any(isinstance(x, LocalShard) for x in nodes)) and not core_axes:
        # A step on padded batches or sharded values is traced to a jaxpr, read (which outputs hold which
        # batch's rows, `batch_rows`; which blocks it returns hold a statistic of this replica's block
        # alone, `block_statistics`), and evaluated here: `fn` is still traced once.
        step = StepJaxpr(fn, nodes, outer, batch_leaves, sizes, counts, names, make_context)
        step.check_block_statistics()
        zero = {i for i, b in enumerate(batches)
                if all(z for arg, z in enumerate(padded_zero) if batch_of_arg[arg] == b)}
        note_padding_reads(notes, arguments_signature(args, kwargs), step.padding_reads_message(zero, n))
        out_leaves = step.evaluate()
        out_tree, paths, marked = step.tree, step.paths, step.marked
        rows: list[Rows] | Callable[[], list[Rows]] = step.rows
      else:
        call_args, call_kwargs = jax.tree.unflatten(outer, nodes)
        ctx = make_context(list(zip(sizes, counts)))
        ctx.batch_names = names
        for b, leaves in batch_leaves:
          ctx.note_batch_leaves(leaves, b)
        with context_lib.enter_replica_context(ctx):
          out = call(*call_args, **call_kwargs)
        warn_unresolved(ctx.unresolved)
        # Distributed values stay whole (trace time only), so that returning one is reported by name;
        # sharded blocks (`LocalShard`) stay whole to come back as `ShardedVariable`s.
        out_leaves, out_tree = jax.tree.flatten(out, is_leaf=is_output_node)
        paths = leaf_paths(out_tree)
        marked = record.pop("marked")
        out_leaves = [as_output_array(x, p) for x, p in zip(out_leaves, paths)]
        # With logical cores (and padded batches), the rows are read from one more trace of `fn`.
        rows = (lambda: StepJaxpr(fn, nodes, outer, batch_leaves, sizes, counts, names, make_context,
                                   quiet=True).rows)
      # A block (`LocalShard`) leaves as one more per-replica output, a `ShardedVariable` again (a block
      # computed from constants, an optimizer's zeros, is cast to varying: it is still one replica's).
      shards = [(x.shape, x.axis, x.groups) if isinstance(x, LocalShard) else None for x in out_leaves]
      for x, p in zip(out_leaves, paths):
        if isinstance(x, LocalShard):
          _check_block(x, p, n)
      out_leaves = [to_varying(x.block, axis) if isinstance(x, LocalShard) else x for x in out_leaves]
      is_varying = [axis in varying_axes(x) for x in out_leaves]
      record["tree"], record["varying"], record["shards"] = out_tree, is_varying, shards
      record["shapes"] = [jnp.shape(x) for x in out_leaves]  # one replica's (a block's for a shard)
      # Padding follows an output only as the user said: (batch, True) for a marked per-example output;
      # (batch, False), batch rows for `axis=0`, for an unmarked one whose axis 0 the program shows to
      # hold one padded batch's rows (`batch_rows`: traced, not read off its size).
      guessed: set[int] = set()  # outputs whose padding is assumed from their size, not traced
      record["padded"] = output_padding(out_leaves, paths, [v and sh is None for v, sh in zip(is_varying, shards)],
                                         marked, sizes, names, rows, guessed)  # blocks are never a batch's rows
      invariant = tuple(x for x, v in zip(out_leaves, is_varying) if not v)
      varying = tuple(x[None] for x, v in zip(out_leaves, is_varying) if v)
      if numerics is None:
        return invariant, varying
      # Padding rows are skipped only where the program shows the rows to be the batch's (or the user
      # marked them): an output whose rows were moved in a way not traced (a flip, a sort) is checked
      # whole, and a NaN past the real rows is reported as possibly padding.
      out_batch = [p if p is not None and v and sh is None else None
                   for p, v, sh in zip(record["padded"], is_varying, shards)]
      row_counts = [counts[p[0]] if p is not None and i not in guessed else None for i, p in enumerate(out_batch)]
      untraced = [counts[p[0]] if p is not None and i in guessed else None for i, p in enumerate(out_batch)]
      # A block's padding rows (past the logical size) are not data: checked without them.
      checked_leaves = [LocalShard(x, *sh).real_block() if sh is not None else x for x, sh in zip(out_leaves, shards)]
      flags, checked = numerics_lib.replica_flags(checked_leaves, is_varying, row_counts, axis, n, untraced)
      trace = numerics.traced(
          [paths[i] for i in checked],
          ["ShardedVariable" if shards[i] is not None else "PerReplica" if is_varying[i] else "Mirrored"
           for i in checked],
          [names[ob[0]] if (ob := out_batch[i]) is not None and i in guessed else None for i in checked])
      if n == 1:  # one replica: its flags are every replica's, no all-gather (a third of a tiny step's time)
        return invariant, (*varying, numerics_lib.one_replica_flags(flags, axis, trace))
      return (*invariant, numerics_lib.gather_flags(flags, axis, trace)), varying

    invariant, varying = jax.shard_map(
        body, mesh=mesh, in_specs=tuple(specs), out_specs=(P(), P(axis)), check_vma=True, **manual)(*flat)
    if numerics is not None and n == 1:
      *varying, flags = varying
    elif numerics is not None:
      *invariant, flags = invariant
    inv, var = iter(invariant), iter(varying)
    picked = [next(var) if v else next(inv) for v in record["varying"]]  # blocks are varying
    if layout_map is not None:
      picked = pin_layouts(picked, layout_map, record, mesh)
    outs = [ShardedVariable.from_blocks(x, *sh) if sh is not None
            else PerReplica.from_stacked(x) if v and p is None
            else PerReplica.from_stacked(x, flat[padded[batches[p[0]]]], per_example=p[1]) if v
            else Mirrored.from_global(x)
            for x, v, p, sh in zip(picked, record["varying"], record["padded"], record["shards"])]
    if numerics is not None:
      return jax.tree.unflatten(record["tree"], outs), flags
    return jax.tree.unflatten(record["tree"], outs)

  program.__name__ = f"run_{name}"
  program.__qualname__ = program.__name__
  program.notes = notes  # type: ignore[attr-defined]  # read by `Engine.run` (`warn_padding_reads`)
  return program


def pin_layouts(outs: list[Any], layout_map: LayoutMap, record: dict[str, Any], mesh: jax.sharding.Mesh) -> list[Any]:
  """`RunOptions.experimental_layout_map`: the program's global results (`outs`, at trace time), each
  result a pattern matches constrained to its layout over the core axes (replicated over ``'replica'``
  for a `Mirrored` result, split on its leading axis for a `PerReplica` one). Without it XLA picks the
  results' layouts, and state made inside the step (an optimizer's zeros) comes back replicated."""
  where = "strategy.run (RunOptions.experimental_layout_map)"
  on_mesh = _OnMesh(mesh)
  dummy = jax.tree.unflatten(record["tree"], list(range(record["tree"].num_leaves)))
  paths = [tree_path(p) or "<root>" for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
  pinned, matched = [], False
  for x, path, v, sh, shape in zip(outs, paths, record["varying"], record["shards"], record["shapes"]):
    hit = layout_map.match(path, where)
    if hit is None:
      pinned.append(x)
      continue
    matched = True
    if sh is not None:
      raise ValueError(
          f"{where}: the result at {path} is a sharded value (a ShardedVariable, split over the replicas) and "
          f"matches the LayoutMap pattern {hit[0]!r}; a value is split over the replicas or laid out on the "
          "logical cores, not both. Make the pattern skip it.")
    spec = tuple(layout_spec(on_mesh, path, hit[0], hit[1], shape, where))
    spec = (REPLICA_AXIS, *spec) if v else spec
    pinned.append(jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec))))
  # A map that finds none of the step's replicated (Mirrored) arrays is most likely anchored to the tree
  # given to experimental_shard; steps without such results (a loss, a stateless optimizer's init) pass.
  if not matched and any(not v and len(shape) for v, shape in zip(record["varying"], record["shapes"])):
    raise ValueError(
        f"{where}: no pattern of the LayoutMap ({', '.join(repr(p) for p in layout_map)}) matches a result of "
        f"the step (results: {', '.join(paths[:8])}{', ...' if len(paths) > 8 else ''}); pass the map only to "
        "steps that return the state it lays out. Patterns are searched (re.search) in the result's paths: "
        "do not anchor them to the tree given to experimental_shard.")
  return pinned


def _check_block(x: LocalShard, path: str, n: int) -> None:
  """A block a step returns must still be a block of its value: same shape (elementwise updates)."""
  n = x.num_blocks(n)  # with groups (hybrid sharding): the group size
  want = list(x.shape)
  want[x.axis] = -(-x.shape[x.axis] // n)
  if list(jnp.shape(x.block)) != want:
    raise ValueError(
        f"strategy.run: the sharded value at {path} comes back with a block of shape {list(jnp.shape(x.block))}, "
        f"but a value of shape {list(x.shape)} split along axis {x.axis} over {n} replicas has blocks of shape "
        f"{want}. Update blocks elementwise (jax.tree.map, optax), or return a new value read whole "
        "(x.read_value()) instead of a LocalShard.")


def batch_group(node: PerReplica, path: tuple[Any, ...], roots: dict[Any, int], index: int) -> int:
  """Which batch the padded argument `node` (the `index`-th, at `path` among `run`'s arguments) belongs
  to: the index of the first padded argument of its batch.

  The leaves of one dataset element, passed where the element put them (the element itself, anywhere in
  the arguments), are one batch: they share their real-row counts. Every other padded value (a leaf taken
  out of its element, an output marked `per_example`) is a batch of its own. Read from the arguments'
  structure (`PerReplica.batch_tag`), so the same inside `jax.jit` and `lax.scan`, where the counts of
  one element's leaves are separate tracers; two elements of one dataset are two batches.
  """
  tag = node.batch_tag
  if tag is None:
    return index
  root = tag.element_root(path)
  if root is None:
    return index
  return roots.setdefault((root, tag.paths), index)


def _unpack(flat_in: Any, rebuild: list[tuple[str, Any, int]],
            batch_of_arg: list[int]) -> tuple[list[Any], list[tuple[int, list[Any]]], dict[int, int]]:
  """The arguments `fn` sees, from the shard_map body's inputs: (nodes, the per-replica leaves of each
  padded batch argument, the per-replica size of each batch)."""
  it = iter(flat_in)
  nodes: list[Any] = []
  row_leaves: list[tuple[int, list[Any]]] = []
  sizes: dict[int, int] = {}
  arg = 0
  for kind, inner, count in rebuild:
    leaves = [next(it) for _ in range(count)]
    if kind == "padded":
      *leaves, _ = leaves
      b = batch_of_arg[arg]
      k = leaves[0].shape[1]
      if sizes.setdefault(b, k) != k:
        raise ValueError(
            f"strategy.run: two padded batch arguments share their real-row counts but have per-replica "
            f"sizes {sizes[b]} and {k}; a batch's arrays all have its size.")
      local = [x.reshape(x.shape[1:]) for x in leaves]
      row_leaves.append((arg, local))
      arg += 1
      nodes.append(jax.tree.unflatten(inner, local))
      continue
    if kind == "sharded":  # this replica's block of a ShardedVariable
      nodes.append(LocalShard(leaves[0].reshape(leaves[0].shape[1:]), *inner))
    elif kind == "per_replica":
      nodes.append(jax.tree.unflatten(inner, [x.reshape(x.shape[1:]) for x in leaves]))
    elif kind == "mirrored":
      nodes.append(jax.tree.unflatten(inner, leaves))
    else:
      nodes.append(leaves[0])
  return nodes, row_leaves, sizes


def _check_real_rows(valid: Any, n: int, path: str) -> None:
  """A padded batch's real-row counts are integers, one per replica (``[num_replicas]``). They are a leaf of
  the batch's pytree, so a function mapped over the whole batch (``jax.tree.map(lambda x: x / 255, batch)``)
  maps them too: one that makes them floats (or reshapes them) is refused here, when the step is traced,
  instead of masking the wrong rows. (One that keeps them integers cannot be told from real counts.)"""
  dtype, shape = jnp.result_type(valid), tuple(jnp.shape(valid))
  if not jnp.issubdtype(dtype, jnp.integer) or shape != (n,):
    raise ValueError(
        f"strategy.run: the padded PerReplica batch at {path} carries real-row counts of {dtype}{list(shape)}, "
        f"not the int32[{n}] (one count per replica) its dataset made: a function mapped over the whole batch "
        "(jax.tree.map(f, batch)) maps them as well, since they are a leaf of its pytree. Transform the "
        "batch's arrays inside the step function (each replica sees plain arrays there) or in the dataset "
        "before it is distributed (dataset.map), not with jax.tree.map over the distributed batch.")


def _check_padded(leaves: list[Any], path: str) -> None:
  """Every leaf of a padded batch is ``[num_replicas, padded_batch, ...]`` with one padded batch size."""
  sizes = {jnp.shape(x)[1] if jnp.ndim(x) >= 2 else None for x in leaves}
  if len(sizes) != 1 or None in sizes:
    raise ValueError(
        f"strategy.run: the padded PerReplica batch at {path} must have the batch on the leading axis "
        f"of every component, with one size for all leaves; got component shapes "
        f"{[tuple(jnp.shape(x)[1:]) for x in leaves]}.")
