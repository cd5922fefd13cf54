"""Keras 3 models (``KERAS_BACKEND=jax``) trained in `strategy.run` with Keras's stateless API.

`state` takes a model's (and optimizer's) variables out as a pytree, `assign` writes such a pytree back;
`stateless_call` is ``model.stateless_call`` with TF's rules for a replica's state: per-replica random
streams for the model's `SeedGenerator`s, and non-trainable variables that differ between replicas
(`BatchNormalization`'s moving statistics) aggregated as TF aggregates them on read (MEAN). On a partial
batch, what TF computes over a replica's real rows is computed over them here too: a plain batch norm's
statistics, and Keras's L1 / L2 activity regularizers. Keras metrics updated inside a step
(``metric.stateless_update_state``) count the global batch's real rows, combined over the replicas as
TF reads its ``SyncOnRead`` metric variables. Keras's stateful calls ported from TF into a step (a
Keras variable read or written while `strategy.run` traces, outside a ``keras.StatelessScope`` mapping it:
``optimizer.scale_loss``, ``metric.update_state``, ``model(x)``) are refused at the call, naming the
stateless way (`_patch_variables`); `scale_loss` scales a loss by the optimizer state's loss scale, and
`iterations` reads the step count from a state, which is where a custom loop's progress lives until
`assign` writes it back. On the host, a read of a Keras variable that `state` exported (or `assign` wrote)
after a restore, or after steps that write it, raises `StaleVariableError` naming `assign`, instead of
giving the value from before (`_clock`, `keras_loop`). The synchronised batch norm, `SyncBatchNormalization`, is built on first use
(`sync_batch_normalization_class`) because it subclasses a Keras class, and Keras is an optional
dependency: nothing here imports Keras until it is used.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpustrat._src import context, jax_compat, profiler, replica_random, step_stats
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.values import DistributedValues, Mirrored, PerReplica

AGGREGATIONS = ("mean", "none")

# The attribute that records, on a Keras variable whose value `state` exported or `assign` wrote, the
# clock (`_clock`) at that moment: the variable is current while the clock has not moved.
_SYNCED = "_tpustrat_synced"
# The attribute that records, on a Keras variable, that a step `strategy.run` traced writes it (through
# Keras, in a ``keras.StatelessScope``: ``optimizer.stateless_apply``, a layer's state update): only such
# a variable changes when steps run. Set once, when the step is traced; never cleared.
_STEPPED = "_tpustrat_stepped"
# The attribute that records, on a Keras variable, that the array it holds may be a custom loop's state's
# too (`state` hands its own array out, `assign` writes the state's in): Keras's own fit / evaluate /
# predict donate the arrays they read, so it is copied first (`keras_loop`).
_SHARED = "_tpustrat_shared"
_ANY_SHARED = [False]  # whether `state` or `assign` has run in this process: else `_unshare` has nothing to do
# Keras's own fit / evaluate / predict under a strategy (`keras_loop`): how deep, the training steps the
# process had dispatched when the outermost began, and the steps dispatched inside them all (which leave
# no Keras object stale: Keras writes its state back).
_KERAS_LOOPS = [0, 0, 0]


class StaleVariableError(RuntimeError):
  """A Keras variable read on the host while a custom loop's state holds a newer value of it.

  `state` hands a model's and optimizer's values to a pytree; once a training step has run on that pytree
  (`strategy.run`, `experimental_run_steps`) or a checkpoint has been restored into it
  (`tpustrat.checkpoint.CheckpointManager.restore`), the Keras objects hold what they held before, until
  `assign` writes the state back. Reading one of them in between (``optimizer.iterations.numpy()``, the
  learning rate, ``model.predict``, ``model.save``, ``model.get_weights()``, a callback's ``self.model``)
  raises this, naming the variable and ``tpustrat.keras.assign(model, optimizer, state)``.
  """


def import_keras() -> Any:
  """Keras, checked to run on JAX; a clear error where it is missing or on another backend."""
  try:
    import keras  # type: ignore[import-untyped]  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    if getattr(e, "name", None) == "tensorflow":  # Keras is there, on its default backend, without TF
      raise ImportError("tpustrat.keras: Keras was imported on its default TensorFlow backend, which is not "
                        "installed; set the environment variable KERAS_BACKEND=jax before Keras is first "
                        "imported.") from e
    raise ImportError("tpustrat.keras needs Keras 3: pip install 'tpustrat[keras]' (and set "
                      "KERAS_BACKEND=jax before Keras is imported).") from e
  if keras.backend.backend() != "jax":
    raise RuntimeError(
        f"tpustrat.keras: Keras runs on the {keras.backend.backend()!r} backend; tpustrat trains Keras models "
        "on JAX. Set the environment variable KERAS_BACKEND=jax before Keras is first imported.")
  _patch_rnn()
  _patch_metrics()
  _patch_variables()
  return keras


# Keras's JAX recurrences (``keras.src.backend``): each takes its initial states in arguments named so.
_RECURRENCES = ("rnn", "gru", "lstm")


@functools.cache
def _patch_rnn() -> None:
  """Recurrent layers (LSTM, GRU, SimpleRNN) inside a step: Keras's JAX recurrences (``backend.rnn``, and
  its fused ``backend.gru`` / ``backend.lstm``) run a `jax.lax.scan` whose carry starts from states that
  are the same on every replica (zeros) and comes out different on each, which JAX's varying-axis check
  refuses inside `shard_map` ("scan carry ... manual axis types do not match"). Keras's private
  ``keras.src.backend.rnn``, ``gru`` and ``lstm`` (which the layers call through that module) are wrapped
  once so that, inside a step, every argument whose name holds ``initial_state`` is typed varying over the
  replicas (the same numbers; the cast's transpose sums a gradient over the replicas, as for any value
  given whole to every replica). A Keras where one of them is missing or takes no such argument raises
  here rather than being wrapped blindly."""
  from keras.src import backend  # type: ignore[import-untyped]  # pylint: disable=import-outside-toplevel
  for name in _RECURRENCES:
    function: Any = getattr(backend, name, None)
    params = list(inspect.signature(function).parameters) if callable(function) else []
    states = [p for p in params if "initial_state" in p]
    if not states:
      raise RuntimeError(
          f"tpustrat.keras wraps Keras's private keras.src.backend.{name} (Keras 3.5 to 3.15: its initial states "
          f"typed per replica inside a step); this Keras has {'no such function' if not params else params}. "
          "Use a Keras version this tpustrat was tested with.")
    setattr(backend, name, _replica_recurrence(function, inspect.signature(function), tuple(states)))


def _replica_recurrence(function: Any, signature: inspect.Signature, states: tuple[str, ...]) -> Any:
  @functools.wraps(function)
  def call(*args: Any, **kwargs: Any) -> Any:
    ctx = context.active_replica_context()
    if ctx is None or context.replica_axis(ctx) is None:
      return function(*args, **kwargs)
    bound = signature.bind(*args, **kwargs)
    for name in states:
      if bound.arguments.get(name) is not None:
        bound.arguments[name] = jax.tree.map(lambda s: jax_compat.to_varying(s, REPLICA_AXIS),
                                             bound.arguments[name])
    return function(*bound.args, **bound.kwargs)

  return call


def _check_model(model: Any, what: str) -> Any:
  keras = import_keras()
  if not isinstance(model, keras.layers.Layer):
    raise TypeError(f"{what}: expected a Keras model or layer (keras.Model, keras.layers.Layer); got "
                    f"{type(model).__name__}.")
  if not model.built:
    raise ValueError(f"{what}: the model {model.name!r} is not built, so it has no variables yet. Give it an "
                     "input shape (keras.Input) or call it once on a batch first.")
  return keras


def _check_optimizer(optimizer: Any, what: str) -> None:
  keras = import_keras()
  if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
    raise TypeError(f"{what}: expected a keras.optimizers.Optimizer or None; got {type(optimizer).__name__}.")


def state(model: Any, optimizer: Any = None) -> dict[str, list[jax.Array]]:
  """The variables of a Keras `model` (and `optimizer`) as a pytree, for `strategy.run` and checkpoints.

  Keras's stateless API in one value: ``{"trainable": [...], "non_trainable": [...], "optimizer": [...]}``,
  the current values of ``model.trainable_variables``, ``model.non_trainable_variables`` (batch norm
  statistics, `SeedGenerator` states) and ``optimizer.variables``, in those orders: what
  ``model.stateless_call`` and ``optimizer.stateless_apply`` take. Pass it to
  ``strategy.experimental_mirror`` for a training state, save it with
  `tpustrat.checkpoint.CheckpointManager`, and write it back with `assign`.

  From here on the state, not the Keras objects, holds the training's progress. The variables exported
  are current until a checkpoint is restored (`CheckpointManager.restore`) or `strategy.run` /
  ``experimental_run_steps`` runs a step that writes them (``optimizer.stateless_apply``, a layer's
  statistics or seeds in `stateless_call`); after that a host read of one (``optimizer.iterations.numpy()``,
  the learning rate, ``model.predict`` / ``save`` / ``get_weights()``, a callback's ``self.model``) raises
  `StaleVariableError`, until `assign` writes a state back. Counting costs nothing per step (see
  `_clock`). It exports what the Keras objects hold, stale or not, and marks them current.

  Args:
    model: a built Keras model (or layer).
    optimizer: optional: a Keras optimizer; built for ``model.trainable_variables`` here if it is not yet
      (``optimizer.build``), as its first ``apply`` would. Without it, the ``"optimizer"`` list is empty.

  Returns:
    A dict of three lists of arrays.

  Raises:
    TypeError: `model` is not a Keras layer, or `optimizer` not a Keras optimizer.
    ValueError: `model` is not built.
  """
  _check_model(model, "tpustrat.keras.state")
  _check_optimizer(optimizer, "tpustrat.keras.state")
  if optimizer is not None and not optimizer.built:
    optimizer.build(model.trainable_variables)
  # From now on the state may move on without these Keras objects: they are current until it does.
  _watch_keras_loops()
  _mark_current([*model.trainable_variables, *model.non_trainable_variables,
                 *(optimizer.variables if optimizer is not None else ())], shared=True)
  return {
      "trainable": [v.value for v in model.trainable_variables],
      "non_trainable": [v.value for v in model.non_trainable_variables],
      "optimizer": [] if optimizer is None else [v.value for v in optimizer.variables],
  }


def _read(x: Any, path: str, aggregate: bool) -> Any:
  """The value to assign to the Keras variable at `path` (for messages): a `Mirrored` converts like its
  array; a `PerReplica` of floats is averaged over the replicas where `aggregate` (TF's ON_READ MEAN)."""
  if isinstance(x, PerReplica):
    stacked = jax.tree.leaves(x.tree)[0]
    if not aggregate or not jnp.issubdtype(stacked.dtype, jnp.floating):
      raise ValueError(
          f"tpustrat.keras.assign: {path} is a PerReplica value (it differs between replicas) of dtype "
          f"{stacked.dtype}; only non-trainable floating variables (batch norm statistics) are averaged over "
          "the replicas on read. Train with tpustrat.keras.stateless_call, which keeps seeds and statistics "
          "Mirrored, or reduce it first (strategy.reduce).")
    return jnp.mean(stacked.astype(jnp.float32), axis=0).astype(stacked.dtype)
  if isinstance(x, DistributedValues) and not isinstance(x, Mirrored):
    raise TypeError(f"tpustrat.keras.assign: {path} is a {type(x).__name__}; expected an array or a Mirrored.")
  return x


def _keys(x: Any) -> str:
  return f" with keys {sorted(map(str, x))}" if isinstance(x, dict) else ""


def assign(model: Any, optimizer: Any, state: dict[str, Sequence[Any]]) -> None:
  """Writes a state pytree (as `state` makes it, or as a training step returns it) into `model` and
  `optimizer`, so that ``model.predict``, ``model.save`` and Keras's own ``fit`` see the trained values.

  In a custom loop the state, not the Keras objects, holds the training's progress: after a restore, or
  steps that write them, a host-side read of them (``optimizer.iterations``, a schedule's
  ``optimizer.learning_rate``, callbacks reading ``self.model``, ``model.predict``, ``model.save``) raises
  `StaleVariableError` until this writes the state back (they would give their values when the state was
  taken). Call it after `tpustrat.checkpoint.CheckpointManager.restore` and at the end of each loop of
  steps, before callbacks, summaries and saves (`iterations` reads the step count from a state without it):
  once per loop, not per step. The variables written are current until the state moves on again. Keras's
  own ``fit`` / ``evaluate`` / ``predict`` donate the arrays they read, which may be the state's after this:
  they are copied first (`keras_loop`), so the state stays usable.

  `Mirrored` values are written as the arrays they are. Non-trainable floating values that come back
  `PerReplica` (batch norm statistics from a plain ``model.stateless_call`` in `strategy.run`) are
  averaged over the replicas, TF's aggregation on read (``ON_READ``, ``MEAN``). Any other `PerReplica`
  value raises: trainable and optimizer variables must be the same on every replica.

  Args:
    model: the Keras model the state was taken from.
    optimizer: its optimizer, or None (then ``state["optimizer"]`` is not written).
    state: a dict with ``"trainable"``, ``"non_trainable"`` and ``"optimizer"`` lists of the model's and
      optimizer's variable counts.

  Raises:
    TypeError: bad `model`, `optimizer` or `state`.
    ValueError: a list's length does not match the model's variables, a value's shape differs from its
      variable's, or a `PerReplica` value that cannot be averaged.
  """
  _check_model(model, "tpustrat.keras.assign")
  _check_optimizer(optimizer, "tpustrat.keras.assign")
  if not isinstance(state, dict) or not {"trainable", "non_trainable"} <= set(state):
    raise TypeError("tpustrat.keras.assign: expected state = {'trainable': [...], 'non_trainable': [...], "
                    "'optimizer': [...]} (as tpustrat.keras.state makes it); got "
                    f"{type(state).__name__}{_keys(state)}.")
  groups = [("trainable", model.trainable_variables, False),
            ("non_trainable", model.non_trainable_variables, True)]
  if optimizer is not None:
    groups.append(("optimizer", optimizer.variables, False))
  writes = []
  for key, variables, aggregate in groups:
    values = list(state.get(key, ()))
    if len(values) != len(variables):
      raise ValueError(f"tpustrat.keras.assign: state[{key!r}] has {len(values)} values; the "
                       f"{'optimizer' if key == 'optimizer' else 'model ' + repr(model.name)} has "
                       f"{len(variables)} {key.replace('_', '-')} variables.")
    for i, (variable, value) in enumerate(zip(variables, values)):
      path = f"state[{key!r}][{i}] ({variable.path})"
      value = _read(value, path, aggregate)
      if tuple(np.shape(value)) != tuple(variable.shape):
        raise ValueError(f"tpustrat.keras.assign: {path} has shape {tuple(np.shape(value))}; the variable "
                         f"has shape {tuple(variable.shape)}.")
      writes.append((variable, value))
  for variable, value in writes:  # every check first: nothing written when one fails
    variable.assign(value)
  # They hold the state's values (its arrays, maybe) now: stale once it moves on.
  _watch_keras_loops()
  _mark_current([variable for variable, _ in writes], shared=True)


def _optimizer_mapping(optimizer: Any, optimizer_variables: Any, what: str) -> list[tuple[Any, Any]]:
  """``(variable, value)`` pairs of a built Keras `optimizer` and its values in a state (``state["optimizer"]``),
  for a ``keras.StatelessScope``; a clear error where they do not match."""
  _check_optimizer(optimizer, what)
  if optimizer is None or not optimizer.built:
    raise ValueError(f"{what}: the optimizer {getattr(optimizer, 'name', None)!r} is not built, so it has no "
                     "variables yet; tpustrat.keras.state(model, optimizer) builds it.")
  if not isinstance(optimizer_variables, (list, tuple)):
    raise TypeError(f"{what}: expected optimizer_variables = state['optimizer'], a list of the optimizer's "
                    f"{len(optimizer.variables)} values; got "
                    f"{type(optimizer_variables).__name__}{_keys(optimizer_variables)}.")
  if len(optimizer_variables) != len(optimizer.variables):
    raise ValueError(f"{what}: optimizer_variables has {len(optimizer_variables)} values; the optimizer "
                     f"{optimizer.name!r} has {len(optimizer.variables)} variables (optimizer.variables).")
  return [(v, _read(x, f"optimizer_variables[{i}] ({v.path})", False))
          for i, (v, x) in enumerate(zip(optimizer.variables, optimizer_variables))]


def scale_loss(optimizer: Any, optimizer_variables: Sequence[Any], loss: Any) -> Any:
  """``optimizer.scale_loss(loss)`` by the optimizer's state in a step: TF's ``optimizer.get_scaled_loss``
  / Keras 3's ``scale_loss`` in a custom loop.

  A Keras ``LossScaleOptimizer`` keeps its loss scale in a variable, which ``optimizer.stateless_apply``
  doubles after ``dynamic_growth_steps`` finite steps and halves after a step of non-finite gradients, in
  the state it returns. ``optimizer.scale_loss(loss)`` in a step reads the Keras variable, whose value
  never changes (tpustrat refuses that read while it traces a step); this reads the scale from
  `optimizer_variables` instead (``keras.StatelessScope`` over them), the one ``stateless_apply`` unscales
  the gradients by. For another Keras optimizer it is ``optimizer.scale_loss(loss)``: the loss times its
  fixed ``loss_scale_factor``, or the loss. Differentiate the scaled loss; report the unscaled one.

  Args:
    optimizer: a built Keras optimizer (`state` builds it).
    optimizer_variables: its values in the step's state, ``state["optimizer"]``.
    loss: the loss to scale.

  Returns:
    The scaled loss.

  Raises:
    TypeError: `optimizer` is not a Keras optimizer, or `optimizer_variables` not a list.
    ValueError: the optimizer is not built, or `optimizer_variables` does not match its variables.
  """
  keras = import_keras()
  with keras.StatelessScope(state_mapping=_optimizer_mapping(optimizer, optimizer_variables,
                                                             "tpustrat.keras.scale_loss")):
    return optimizer.scale_loss(loss)


def iterations(optimizer: Any, optimizer_variables: Sequence[Any]) -> int:
  """The optimizer's step count in a state, ``optimizer.iterations`` read from `optimizer_variables`
  (``state["optimizer"]``): where TF code reads ``optimizer.iterations.numpy()`` on the host, for the
  global step after a restore.

  A custom loop's state, not the Keras objects, holds the training's progress: after
  `tpustrat.checkpoint.CheckpointManager.restore`, or after steps in `strategy.run`, ``optimizer.iterations``
  itself holds what it held when `state` was taken (0 for a fresh optimizer) until `assign` writes the state
  back, and reading it raises `StaleVariableError`. The count is in the optimizer's variables, at a position that depends on the optimizer (a
  ``LossScaleOptimizer`` has its own before its inner optimizer's, which count the steps); Keras's own
  ``iterations`` is evaluated over them (``keras.StatelessScope``), so gradient accumulation's division is
  Keras's too. A host read: it waits for the step that produced the state.

  Args:
    optimizer: a built Keras optimizer (`state` builds it).
    optimizer_variables: its values in a state, ``state["optimizer"]`` (arrays or `Mirrored`), on the host.

  Returns:
    The step count, an int.

  Raises:
    TypeError: bad `optimizer` or `optimizer_variables`, or a value that is traced (inside a step, read it in
      ``keras.StatelessScope(state_mapping=list(zip(optimizer.variables, state["optimizer"])))``).
    ValueError: the optimizer is not built, or `optimizer_variables` does not match its variables.
  """
  keras = import_keras()
  mapping = _optimizer_mapping(optimizer, optimizer_variables, "tpustrat.keras.iterations")
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves([x for _, x in mapping])):
    raise TypeError("tpustrat.keras.iterations reads the step count on the host; inside a step, read "
                    "optimizer.iterations in keras.StatelessScope(state_mapping=list(zip(optimizer.variables, "
                    "state['optimizer']))).")
  with keras.StatelessScope(state_mapping=mapping):
    return int(np.asarray(optimizer.iterations))


def seed_positions(model: Any) -> tuple[int, ...]:
  """The positions in ``model.non_trainable_variables`` of its `SeedGenerator` states: Keras lists them
  there (``non_trainable_variables``) and not among the weights (``non_trainable_weights``)."""
  weights = {id(v) for v in model.non_trainable_weights}
  return tuple(i for i, v in enumerate(model.non_trainable_variables) if id(v) not in weights)


def _aggregate(x: Any, aggregation: str, replica: Any, has_rows: Any = None) -> Any:
  """A non-trainable value that varies over the replicas, made the same on every replica by the rule of
  its Keras variable's `aggregation` ("sum": SUM; "only_first_replica": replica 0's; otherwise MEAN,
  over the replicas that held real rows where `has_rows` says which: one that held none of a partial
  batch has no statistics to add)."""
  if aggregation == "sum":
    return jax.lax.psum(x, REPLICA_AXIS)
  if aggregation == "only_first_replica":
    return jax.lax.psum(jnp.where(replica == 0, x, jnp.zeros_like(x)), REPLICA_AXIS)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(
        f"tpustrat.keras.stateless_call: a non-trainable variable of dtype {x.dtype} differs between replicas "
        "after the call and cannot be averaged; give its Keras variable aggregation='sum' or "
        "'only_first_replica', or use model.stateless_call and keep it per replica.")
  if has_rows is None:
    return jax.lax.pmean(x.astype(jnp.float32), REPLICA_AXIS).astype(x.dtype)
  held = has_rows.astype(jnp.float32)
  total, holders = jax.lax.psum((x.astype(jnp.float32) * held, held), REPLICA_AXIS)
  return (total / jnp.maximum(holders, 1.0)).astype(x.dtype)


def stateless_call(model: Any, trainable_variables: Sequence[Any], non_trainable_variables: Sequence[Any],
                   *args: Any, aggregation: str = "mean", **kwargs: Any) -> tuple[Any, list[Any], list[Any]]:
  """``model.stateless_call(...)`` inside `strategy.run`, with TF's per-replica rules for the model's state.

  * **Random streams:** each of the model's `SeedGenerator` states (``[seed, counter]``, among the
    non-trainable variables) reaches the call with this replica's id folded in
    (``jax.random.fold_in``), so `Dropout` and other random layers draw a different mask on every
    replica, as under a TF strategy; the state that comes back is the one given, advanced by as many draws
    as Keras made (the same on every replica), so it stays `Mirrored`: a fixed seed reproduces a run, and
    a checkpoint of the state continues the same streams.
  * **Statistics:** with ``aggregation="mean"`` (the default) every other non-trainable variable that the
    call made differ between replicas (`BatchNormalization`'s moving mean and variance, computed from each
    replica's own rows) is averaged over the replicas in the step (one ``pmean``), so it stays `Mirrored`.
    TF keeps such a variable per replica and averages it when read (``ON_READ``, ``MEAN``); the moving
    averages are linear in the batch statistics, so the average of the replicas' moving averages is the
    moving average of the replicas' average statistics: the same numbers (up to rounding). A Keras
    variable created with ``aggregation="sum"`` or ``"only_first_replica"`` is summed, or takes replica
    0's value. With ``aggregation="none"`` they come back `PerReplica`, and `assign` averages them.
    (For statistics over the global batch instead, use `SyncBatchNormalization`.)
  * **Partial batches:** TF hands each replica only its real rows; here a partial batch's padding rows
    are there too, and left out of what is computed over the rows. A plain `BatchNormalization`'s batch
    statistics are this replica's real rows' (`mask_batch_norm_padding`), and a replica that holds none
    updates no moving statistics: with ``"mean"`` the mean is over the replicas that held rows, with
    ``"none"`` such a replica's values come back as given. An activity regularizer that is Keras's `L1`,
    `L2` or `L1L2` is the real rows' sum, scaled so that the replicas' losses (each divided by the number
    of replicas, ``scale_regularization_loss``) add up to one-device Keras's on the global batch's real
    rows (`real_row_activity_regularizers`); another activity regularizer (a function, a subclass) is
    Keras's own, over this replica's rows, padding included. Which rows are real is found from the
    model's inputs and the layers' own inputs and outputs, followed through the step to the batch (as
    `compute_average_loss` finds them).

  Outside `strategy.run`, under the default strategy, the model runs as replica 0 of one.

  Args:
    model: a built Keras model.
    trainable_variables: the values of ``model.trainable_variables`` (``state["trainable"]``).
    non_trainable_variables: the values of ``model.non_trainable_variables``.
    *args: the model's inputs.
    aggregation: ``"mean"`` or ``"none"``, as above.
    **kwargs: passed to the model's ``call`` (``training=True``, ``mask=...``).

  Returns:
    ``(outputs, non_trainable_variables, losses)``: ``losses`` are the model's losses
    (``model.losses`` inside the call: weight and activity regularization and ``add_loss``), this
    replica's. Each replica adds them to its loss, and the gradient w.r.t. `Mirrored` weights sums over
    replicas, so divide them by the number of replicas (TF's ``scale_regularization_loss``).

  Raises:
    ValueError: `aggregation` is not one of ``"mean"``, ``"none"``; a list's length does not match the
      model's variables.
    RuntimeError: called in cross-replica context (inside `scope()`, outside `run`).
  """
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"tpustrat.keras.stateless_call: aggregation={aggregation!r}; expected one of "
                     f"{AGGREGATIONS}.")
  _check_model(model, "tpustrat.keras.stateless_call")
  variables = model.non_trainable_variables
  non_trainable = list(non_trainable_variables)
  if len(non_trainable) != len(variables):
    raise ValueError(f"tpustrat.keras.stateless_call: {len(non_trainable)} non-trainable values for the "
                     f"{len(variables)} non-trainable variables of {model.name!r} (model.non_trainable_variables).")
  if context.get_replica_context() is None:
    raise RuntimeError("tpustrat.keras.stateless_call was called in cross-replica context (inside "
                       "strategy.scope(), outside strategy.run). Call it inside the function given to "
                       "strategy.run.")
  mask_batch_norm_padding(model)
  has_rows = _holds_rows(model, args)
  non_trainable, given, folded = fold_seeds(model, non_trainable)
  with real_row_activity_regularizers(model):
    outputs, new, losses = model.stateless_call(list(trainable_variables), non_trainable, *args,
                                                return_losses=True, **kwargs)
  new = list(new)
  if has_rows is not None and aggregation == "none":  # no real rows: no statistics to update
    new = [jnp.where(has_rows, v, non_trainable[i]) if i not in given and REPLICA_AXIS in jax_compat.varying_axes(v)
           else v for i, v in enumerate(new)]
  new = settle_seeds(model, new, given, folded, aggregate=aggregation == "mean", has_rows=has_rows)
  return outputs, new, list(losses)


def _holds_rows(model: Any, args: Sequence[Any]) -> Any:
  """Inside a step, whether this replica holds real rows of the padded batch whose rows the model's
  (first) input holds (a bool scalar), or None where that input holds no padded batch's rows, or the
  model has no non-trainable variables but seeds (nothing to leave out of a mean)."""
  ctx = context.active_replica_context()
  if ctx is None or context.replica_axis(ctx) is None:
    return None
  if len(model.non_trainable_variables) == len(seed_positions(model)):
    return None
  leaf = next((x for x in jax.tree.leaves(args) if jnp.ndim(x) > 0), None)
  if leaf is None:
    return None
  real = ctx.padding_count(leaf, f"tpustrat.keras.stateless_call: the inputs of {model.name!r}")
  return None if real is None else real > 0


def fold_seeds(model: Any, non_trainable: list[Any]) -> tuple[list[Any], dict[int, Any], dict[int, Any]]:
  """The non-trainable values with this replica's id folded into each `SeedGenerator` state, and the
  given and folded states by position (for `settle_seeds`)."""
  non_trainable = list(non_trainable)
  seeds = seed_positions(model)
  replica = context.get_replica_context().replica_id_in_sync_group  # type: ignore[union-attr]
  given = {i: jnp.asarray(non_trainable[i], jnp.uint32) for i in seeds}
  folded = {i: replica_random.fold_raw_seed(given[i], replica) for i in seeds}
  for i in seeds:
    non_trainable[i] = folded[i]
  return non_trainable, given, folded


def settle_seeds(model: Any, new: list[Any], given: dict[int, Any], folded: dict[int, Any],
                 aggregate: bool = True, has_rows: Any = None) -> list[Any]:
  """After a call: each seed state is the given one advanced as Keras advanced this replica's (the same
  on every replica), and, with `aggregate`, every other non-trainable value that differs between
  replicas is combined by its variable's aggregation (see `stateless_call`); `has_rows` (whether this
  replica held real rows of a padded batch, or None) leaves the replicas that held none out of a mean."""
  ctx = context.active_replica_context()
  in_run = ctx is not None and context.replica_axis(ctx) is not None
  for i in given:  # the shared state, advanced as Keras advanced this replica's
    advanced = given[i] + (jnp.asarray(new[i], jnp.uint32) - folded[i])
    if in_run and REPLICA_AXIS in jax_compat.varying_axes(advanced):
      advanced = jax.lax.pmax(advanced, REPLICA_AXIS)  # the same number everywhere, typed so
    new[i] = advanced
  if in_run and aggregate:
    replica = context.get_replica_context().replica_id_in_sync_group  # type: ignore[union-attr]
    for i, variable in enumerate(model.non_trainable_variables):
      if i not in given and REPLICA_AXIS in jax_compat.varying_axes(new[i]):
        new[i] = _aggregate(new[i], variable.aggregation, replica, has_rows)
  return new


# -- activity regularizers on a padded batch ---------------------------------------------------------------

# Keras's activity regularizers that are a sum over the output's entries with no term for a zero entry:
# with the padding rows zeroed, the sum is the real rows'.
_ROW_SUM_REGULARIZERS = ("L1", "L2", "L1L2")


@functools.cache
def _keras_divides_activity_losses() -> bool:
  """Whether this Keras divides a layer's activity regularization loss by its output's rows (the batch
  size, as Keras documents and does since keras-team/keras#22021) or adds the sum itself (Keras 3 releases
  before it): measured once, on a layer of two rows."""
  keras = import_keras()
  layer = keras.layers.Identity(activity_regularizer=keras.ops.sum)
  with jax.ensure_compile_time_eval():
    layer(np.ones((2, 1), np.float32))
    value = float(np.asarray(layer.losses[0]))
  if value not in (1.0, 2.0):
    raise RuntimeError(f"tpustrat.keras: Keras {keras.__version__} makes the activity regularization loss "
                       f"{value} of a sum over two rows of ones (expected 2.0, or 1.0 divided by the rows).")
  return value == 1.0


class _RealRowsActivity:
  """A Keras `L1`, `L2` or `L1L2` activity regularizer inside a step, on a layer output whose rows are a
  padded batch's: the sum over this replica's real rows only (the padding rows zeroed), scaled so that
  the replicas' losses, each divided by the number of replicas (``scale_regularization_loss``) and
  summed, are one-device Keras's on the global batch's real rows: divided by their count ``n`` where
  Keras divides the loss by the output's rows (Keras then divides by this replica's ``k``, so the
  regularizer returns its sum times ``N * k / n``), the sum itself (times ``N``) where Keras does not."""

  def __init__(self, regularizer: Any, layer: str) -> None:
    self.regularizer = regularizer
    self.layer = layer

  def __call__(self, output: Any) -> Any:
    ctx = context.active_replica_context()
    assert ctx is not None  # installed inside a step only (`real_row_activity_regularizers`)
    if jnp.ndim(output) == 0 or REPLICA_AXIS not in jax_compat.varying_axes(output):
      return self.regularizer(output)  # not this replica's rows of a batch
    divides = _keras_divides_activity_losses()
    real = ctx.padding_count(output, f"the outputs of the layer {self.layer!r} (its activity_regularizer)")
    if real is None and divides:  # no padding rows: Keras's own value is one device's share
      return self.regularizer(output)
    if real is not None:
      keep = jax.lax.broadcasted_iota(jnp.int32, jnp.shape(output), 0) < real
      output = jnp.where(keep, output, jnp.zeros((), output.dtype))
    loss = self.regularizer(output)
    replicas = ctx.num_replicas_in_sync
    if not divides:
      return loss * replicas
    rows = jnp.shape(output)[0]
    n = jax.lax.psum(real, REPLICA_AXIS).astype(loss.dtype)
    return loss * (replicas * rows) / n


def _layers(model: Any) -> list[Any]:
  """The model and every layer inside it (Keras's private ``_flatten_layers``, where it has it)."""
  flatten = getattr(model, "_flatten_layers", None)
  return list(flatten(include_self=True)) if callable(flatten) else [model]


@contextlib.contextmanager
def real_row_activity_regularizers(model: Any) -> Any:
  """While `model` is called inside a step, every layer's activity regularizer that is Keras's `L1`,
  `L2` or `L1L2` (the type itself: a subclass may compute anything) is a `_RealRowsActivity`: on a
  partial batch its loss is the real rows', as on one device. Other activity regularizers are Keras's,
  over each replica's rows, padding included. The layer's own regularizer is back after the call (it is
  what ``model.save`` writes)."""
  ctx = context.active_replica_context()
  if ctx is None or context.replica_axis(ctx) is None:
    yield
    return
  keras = import_keras()
  exact = tuple(getattr(keras.regularizers, name) for name in _ROW_SUM_REGULARIZERS)
  swapped = [(layer, regularizer) for layer in _layers(model)
             if type(regularizer := getattr(layer, "activity_regularizer", None)) in exact]
  for layer, regularizer in swapped:
    object.__setattr__(layer, "activity_regularizer", _RealRowsActivity(regularizer, layer.name))
  try:
    yield
  finally:
    for layer, regularizer in swapped:
      object.__setattr__(layer, "activity_regularizer", regularizer)


# -- Keras metrics updated inside a step ---------------------------------------------------------------------


@functools.cache
def _patch_metrics() -> None:
  """Keras metrics in a custom loop on JAX are updated with ``metric.stateless_update_state(variables,
  ...)``, which Keras defines once, on ``keras.metrics.Metric``. Wrapped once so that, inside a step, the
  update is the global batch's, as TF reads a metric updated in ``strategy.run`` (its variables are
  ``SyncOnRead``, summed over the replicas): the padding rows of a partial batch weigh nothing
  (`_padding_weighted`) and each variable is combined over the replicas (`_combine_metric`), so that the
  variables it returns are the same on every replica and equal one-device Keras's update on the real
  rows. A Keras whose method takes other arguments raises here rather than being wrapped blindly."""
  import keras  # pylint: disable=import-outside-toplevel

  base = keras.metrics.Metric
  function: Any = vars(base).get("stateless_update_state")
  params = list(inspect.signature(function).parameters) if callable(function) else []
  if params[:2] != ["self", "metric_variables"]:
    raise RuntimeError(
        "tpustrat.keras wraps keras.metrics.Metric.stateless_update_state(metric_variables, *args, **kwargs) "
        f"(Keras 3.5 to 3.15); Keras {keras.__version__} has {params or 'no such method'}. Use a Keras version "
        "this tpustrat was tested with.")
  base.stateless_update_state = _replica_metric_update(function)


def _replica_metric_update(function: Any) -> Any:
  @functools.wraps(function)
  def update(metric: Any, metric_variables: Any, *args: Any, **kwargs: Any) -> Any:
    ctx = context.active_replica_context()
    if ctx is None or context.replica_axis(ctx) is None:
      return function(metric, metric_variables, *args, **kwargs)
    given = list(metric_variables)
    args, kwargs = _padding_weighted(metric, ctx, args, kwargs)
    return _combine_metric(metric, ctx, given, function(metric, given, *args, **kwargs))

  return update


def padding_weight(mask: Any, y_pred: Any, sample_weight: Any) -> Any:
  """A Keras metric's sample weight with the padding rows at 0: the given weight (or 1) times `mask`
  (``[k]``, True on this replica's real rows), shaped like the weight, or like the Keras mask of `y_pred`
  when there is no weight (a per-timestep mask), so that Keras combines the two as on one device."""
  mask = jnp.asarray(mask).astype(jnp.float32)
  if sample_weight is None:
    from keras.src import backend  # pylint: disable=import-outside-toplevel
    keras_mask = None if y_pred is None else backend.get_keras_mask(y_pred)
    if keras_mask is None:
      return mask
    shaped = mask.reshape(mask.shape + (1,) * (jnp.ndim(keras_mask) - 1))
    return jnp.broadcast_to(shaped, jnp.shape(keras_mask))
  weight = jnp.asarray(sample_weight)
  return weight * mask.reshape(mask.shape + (1,) * (weight.ndim - 1)).astype(jnp.result_type(weight, jnp.float32))


def weighs_elements(metric: Any) -> bool:
  """Whether `metric` takes its sample weight per element of ``y_true``: Keras's IoU metrics (`IoU`,
  `BinaryIoU`, `MeanIoU`, `OneHotIoU`, `OneHotMeanIoU`) flatten ``y_true`` and broadcast the weight to it, so a
  weight per row fails there when a row holds several values (a segmentation map, multi-label outputs)."""
  return isinstance(metric, import_keras().metrics.IoU)


def reduces_batch(metric: Any, y_true: Any, y_pred: Any) -> bool:
  """Whether `metric`, a Keras ``MeanMetricWrapper`` (``metrics=["mae"]``), computes one number for the whole
  batch: its function reduces the last axis, which, for an output without a feature axis (``(N,)``), is the
  batch's. Its value on one replica's rows then cannot weigh padding rows apart. Read from the function's
  output shape on `y_true` / `y_pred` (abstractly, at trace time); the function is Keras's private ``_fn``,
  checked here: a Keras without it fails loudly."""
  keras = import_keras()
  if not isinstance(metric, keras.metrics.MeanMetricWrapper) or y_true is None:
    return False
  fn = getattr(metric, "_fn", None)
  if not callable(fn):
    raise RuntimeError(
        f"tpustrat: Keras {keras.__version__}'s MeanMetricWrapper keeps no `_fn`; tpustrat's fit under a strategy "
        "was written for Keras 3.5 to 3.15, whose metric wrappers do.")
  kwargs = getattr(metric, "_fn_kwargs", None) or {}
  out = jax.eval_shape(lambda t, p: fn(t, p, **kwargs), y_true, y_pred)
  return all(len(o.shape) == 0 for o in jax.tree.leaves(out))


def element_padding_weight(metric: Any, mask: Any, y_true: Any) -> Any:
  """`padding_weight` for a metric that `weighs_elements` and was given no weight: `mask` (``[k]``, True on
  the real rows) broadcast to ``y_true``'s shape, in the metric's dtype where that is an integer one (0 and
  1 exactly, and no warning from Keras about float weights)."""
  dtype = np.dtype(metric.dtype) if np.issubdtype(np.dtype(metric.dtype), np.integer) else np.float32
  mask = jnp.asarray(mask).astype(dtype)
  shape = jnp.shape(y_true)
  metrics = import_keras().metrics
  if isinstance(metric, (metrics.OneHotIoU, metrics.OneHotMeanIoU)):
    shape = shape[:-1]  # one-hot targets: the class axis is taken away (an argmax) before the flatten
  return jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - 1)), shape)


def _padding_weighted(metric: Any, ctx: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
  """A metric update's arguments with the padding rows weighted 0 (`padding_weight`), where its first
  argument (``values``, ``y_true``) holds a padded batch's rows (followed through the step, as
  `compute_average_loss` follows its losses) and its ``update_state`` takes a ``sample_weight``; else as
  given (arguments Keras would refuse too are left for Keras to refuse)."""
  try:
    signature = inspect.signature(metric.update_state)
    bound = signature.bind(*args, **kwargs)
  except (TypeError, ValueError):
    return args, kwargs
  names = list(signature.parameters)
  if "sample_weight" not in names or names[0] == "sample_weight":
    return args, kwargs
  leaf = next((x for x in jax.tree.leaves(bound.arguments.get(names[0])) if jnp.ndim(x) > 0), None)
  if leaf is None:
    return args, kwargs
  real = ctx.padding_count(leaf, f"the inputs of the Keras metric {metric.name!r}")
  if real is None:
    return args, kwargs
  mask = jnp.arange(jnp.shape(leaf)[0]) < real
  bound.arguments["sample_weight"] = padding_weight(mask, bound.arguments.get("y_pred"),
                                                    bound.arguments.get("sample_weight"))
  return bound.args, bound.kwargs


def _combine_metric(metric: Any, ctx: Any, given: list[Any], new: list[Any]) -> list[Any]:
  """A metric's variables after this replica's update, made the global batch's (the same on every
  replica) by each variable's Keras aggregation, TF's ``SyncOnRead`` read: ``"sum"`` (Keras's default
  for metrics) adds the replicas' increments to the given value; ``"only_first_replica"`` takes replica
  0's; any other the replicas' mean. An increment that is the same on every replica (an update with a
  value already reduced over the replicas) is added once per replica, as TF's replicas each add it."""
  replicas = ctx.num_replicas_in_sync
  out = []
  for variable, before, after in zip(metric.variables, given, new):
    if after is variable:  # Keras hands the variable itself back where the update left it alone
      out.append(before)
      continue
    after = jnp.asarray(after)
    varying = REPLICA_AXIS in jax_compat.varying_axes(after)
    if variable.aggregation == "sum":
      start = jnp.asarray(before, after.dtype)
      increment = after - start
      if REPLICA_AXIS in jax_compat.varying_axes(increment):
        increment = jax.lax.psum(increment, REPLICA_AXIS)
      else:
        increment = increment * jnp.asarray(replicas, after.dtype)
      out.append(start + increment)
    elif not varying:
      out.append(after)
    elif variable.aggregation == "only_first_replica":
      replica = ctx.replica_id_in_sync_group
      out.append(jax.lax.psum(jnp.where(replica == 0, after, jnp.zeros_like(after)), REPLICA_AXIS))
    else:
      out.append(jax.lax.pmean(after.astype(jnp.float32), REPLICA_AXIS).astype(after.dtype))
  return out


# -- Keras variables used statefully while a step is traced ---------------------------------------------------


def _defining_class(cls: type, name: str) -> type | None:
  """The class in `cls`'s MRO whose own namespace holds `name` (where an attribute lookup finds it)."""
  return next((c for c in cls.__mro__ if name in vars(c)), None)


@functools.cache
def _patch_variables() -> None:
  """A Keras variable read or written while `strategy.run` traces a step, outside a ``keras.StatelessScope``
  that maps it, raises (`_refuse_stateful_use`) instead of going wrong with no word. Such a read is a
  constant of the compiled program, what the variable holds when the step is traced, never the step's
  state: ``optimizer.scale_loss(loss)`` of a Keras ``LossScaleOptimizer`` would scale by the initial scale
  for ever while ``stateless_apply`` unscales by the one its state grew to; ``metric.update_state`` would add
  to a constant. Such a write leaves a traced value in the variable (JAX's ``UnexpectedTracerError`` when it
  is read later) and reaches nothing the step returns. The cause is checked, not a symptom: Keras's
  ``Variable.value`` (which every read goes through: ``__jax_array__``, the operators, ``numpy``) and
  ``Variable.assign`` (which ``assign_add`` / ``assign_sub`` call) are wrapped once, on the class where
  ``keras.Variable`` finds them, and refuse only while a step is traced in this thread (the replica
  context of a `run`) and Keras's innermost stateless scope holds no value for the variable (no scope, for a
  write: inside one Keras records the write in the scope). A read in Keras's symbolic scope (shape
  inference) computes no value and passes, as does a read of a variable Keras has not initialised yet (its
  placeholder, shape inference too). Outside a step an access costs one thread-local read and one attribute
  read (class defaults set here on that class: `_SYNCED`, `_STEPPED`, `_SHARED`).

  The same wrappers keep a host read of a stale variable loud: a read outside any stateless scope mapping it
  of a variable `state` exported or `assign` wrote, once the state has moved on since (`_stale`), raises
  `StaleVariableError`; a write in a stateless scope while a step is traced records that steps change the
  variable (`_STEPPED`); a write on the host makes it current again. A Keras where these are not what is
  checked here (or without the scope queries, private ``keras.src.backend`` names) raises rather than being
  wrapped blindly."""
  import keras  # pylint: disable=import-outside-toplevel
  from keras.src import backend  # pylint: disable=import-outside-toplevel

  reader, prop, writer, assign, get_scope, symbolic = _variable_hooks(keras.Variable, backend, keras.__version__)
  fget: Any = prop.fget
  setattr(reader, _SYNCED, None)  # a variable `state` never exported: one attribute read, no more
  setattr(reader, _STEPPED, False)
  setattr(reader, _SHARED, False)

  def value(variable: Any) -> Any:
    synced = getattr(variable, _SYNCED)
    tracing = _tracing_a_step()
    if (tracing or synced is not None) and not symbolic():
      scope = get_scope()
      mapped = scope is not None and scope.get_current_value(variable) is not None
      if not mapped and getattr(variable, "_value", None) is not None:  # None: Keras's placeholder
        if tracing:
          _refuse_stateful_use(variable, "read")
        now = _clock()
        if _stale(variable, synced, now):
          _refuse_stale_read(variable, synced, now)
    return fget(variable)

  @functools.wraps(assign)
  def guarded_assign(variable: Any, new: Any) -> Any:
    if _tracing_a_step() and not symbolic():
      if get_scope() is None:
        _refuse_stateful_use(variable, "written")
      setattr(variable, _STEPPED, True)  # a step changes it: stale on the host once steps run
    result = assign(variable, new)
    if getattr(variable, _SYNCED) is not None and get_scope() is None and not symbolic():
      setattr(variable, _SYNCED, _clock())  # written on the host: it holds what was written, current
      setattr(variable, _SHARED, False)  # (`assign` marks its writes shared again)
    return result

  guarded_value = property(functools.wraps(fget)(value), prop.fset, prop.fdel, prop.__doc__)
  reader.value = guarded_value  # type: ignore[attr-defined]
  writer.assign = guarded_assign  # type: ignore[attr-defined]


def _variable_hooks(variable: type, backend: Any, version: str) -> tuple[type, property, type, Any, Any, Any]:
  """What `_patch_variables` wraps and reads, checked: the classes of `variable`'s MRO that define its
  ``value`` property and its ``assign(value)`` method, and the private scope queries of Keras's
  `backend` module (``get_stateless_scope``, ``in_symbolic_scope``); a RuntimeError naming what this Keras
  has instead."""
  get_scope: Any = getattr(backend, "get_stateless_scope", None)
  symbolic: Any = getattr(backend, "in_symbolic_scope", None)
  reader, writer = _defining_class(variable, "value"), _defining_class(variable, "assign")
  prop = vars(reader).get("value") if reader else None
  assign: Any = vars(writer).get("assign") if writer else None
  params = list(inspect.signature(assign).parameters) if callable(assign) else None
  if (reader is None or writer is None or not isinstance(prop, property) or prop.fget is None
      or params != ["self", "value"] or not callable(get_scope) or not callable(symbolic)):
    raise RuntimeError(
        "tpustrat.keras wraps keras.Variable's `value` property and `assign(value)` method, and reads Keras's "
        "private keras.src.backend.get_stateless_scope and in_symbolic_scope (Keras 3.5 to 3.15); Keras "
        f"{version} has value: {'no property' if not isinstance(prop, property) else 'a property'}, assign: "
        f"{tuple(params) if params is not None else 'no method'}, get_stateless_scope: "
        f"{'present' if callable(get_scope) else 'missing'}, in_symbolic_scope: "
        f"{'present' if callable(symbolic) else 'missing'}. Use a Keras version this tpustrat was tested with.")
  return reader, prop, writer, assign, get_scope, symbolic


def _tracing_a_step() -> bool:
  """Whether this thread is tracing the function given to `strategy.run` (not the default strategy's
  one replica, which runs as written)."""
  ctx = context.active_replica_context()
  return ctx is not None and context.replica_axis(ctx) is not None


def _refuse_stateful_use(variable: Any, what: str) -> None:
  """Raises the error for a Keras variable `what` ("read" / "written") in a traced step outside a stateless
  scope that maps it, with the stateless way of the Keras call it came from (the innermost Keras metric,
  optimizer or layer method on the stack, for the message only)."""
  keras = import_keras()
  owner, method = None, None
  frame = inspect.currentframe()
  try:
    while frame is not None and owner is None:
      candidate = frame.f_locals.get("self")
      if isinstance(candidate, (keras.metrics.Metric, keras.optimizers.Optimizer, keras.layers.Layer)):
        owner, method = candidate, frame.f_code.co_name
      frame = frame.f_back
  finally:
    del frame
  if isinstance(owner, keras.metrics.Metric):
    fix = ("A Keras metric's update_state, result and reset_state keep its state in its variables, which a "
           "compiled step cannot update: carry the variables through the step instead, `variables = "
           "metric.stateless_update_state(variables, ...)` inside it (the padding rows weigh 0 and the replicas' "
           "updates are summed, as TF reads a SyncOnRead metric) and `metric.stateless_result(variables)` after "
           "it (docs/guides/keras.md, 'Partial batches and metrics in a custom loop').")
  elif isinstance(owner, keras.optimizers.Optimizer) and method == "scale_loss":
    fix = ("Scale the loss by the scale in the step's optimizer state: `loss = tpustrat.keras.scale_loss("
           "optimizer, state['optimizer'], loss)` (a LossScaleOptimizer's scale grows and shrinks in its "
           "variables, which optimizer.stateless_apply updates).")
  elif isinstance(owner, keras.optimizers.Optimizer):
    fix = ("Apply the gradients with `trainable, optimizer_variables = optimizer.stateless_apply("
           "state['optimizer'], grads, state['trainable'])`.")
  elif isinstance(owner, keras.layers.Layer):
    fix = ("Call the model with `tpustrat.keras.stateless_call(model, state['trainable'], "
           "state['non_trainable'], ...)`.")
  else:
    fix = ("Take its value from the step's state (`tpustrat.keras.state(model, optimizer)` makes one), or "
           "read it inside `keras.StatelessScope(state_mapping=[(variable, value), ...])`.")
  where = f" (in {type(owner).__name__}.{method})" if owner is not None else ""
  effect = ("Its value would be a constant of the compiled program, what the variable holds now: the step's "
            "state changes from step to step, the Keras variable does not." if what == "read" else
            "The write would reach nothing the step returns and would leave a traced value in the variable.")
  raise RuntimeError(f"tpustrat.keras: the Keras variable {variable.path!r} is {what} while strategy.run "
                     f"traces a step, outside a keras.StatelessScope that maps it{where}. {effect} {fix}")


# -- Keras objects stale on the host while a custom loop's state moves on ------------------------------------


def _clock() -> tuple[int, int]:
  """What moves a custom loop's state on without its Keras objects, as two counts of this process: the
  training steps dispatched (`profiler.steps_dispatched`: `run` 1, `experimental_run_steps` k, which every
  dispatch counts already: nothing is added to a step) less those of Keras's own loops (`keras_loop`; frozen
  while one runs), and the checkpoints restored (`CheckpointManager.restore`)."""
  depth, began, theirs = _KERAS_LOOPS
  steps = began if depth else profiler.steps_dispatched()
  return steps - theirs, step_stats.RESTORES[0]


# Called before `state` / `assign` hand a state out (`_watch_keras_loops`): `keras_fit.install` registers
# itself here when it is imported (as `tpustrat.keras` does), so this module imports nothing above it.
ON_EXPORT: list[Any] = []


def _watch_keras_loops() -> None:
  """Keras's own ``fit`` / ``evaluate`` / ``predict`` of any model run inside `keras_loop` from now on
  (`keras_fit.install`, once per process, through `ON_EXPORT`; it wraps them on ``keras.Model`` for every
  model)."""
  for hook in ON_EXPORT:
    hook()


def _mark_current(variables: Sequence[Any], shared: bool = False) -> None:
  """Records that `variables` hold their state's values now (`state` exported them, `assign` wrote them;
  `shared`: maybe as the state's own arrays): a host read of one raises `StaleVariableError` once the clock
  (`_clock`) has moved, until it is written again (`assign`, or any host ``variable.assign``)."""
  now = _clock()
  for variable in variables:
    setattr(variable, _SYNCED, now)
    setattr(variable, _SHARED, shared)
  if shared:
    _ANY_SHARED[0] = True


def _stale(variable: Any, synced: tuple[int, int], now: tuple[int, int]) -> bool:
  """Whether `variable`, current at clock `synced`, is stale at `now`: a checkpoint was restored since
  (into a state of it, maybe), or steps ran since and a step writes it (`_STEPPED`). A variable no step
  writes (a learning rate, a model the steps only evaluate) holds what the state holds."""
  return now[1] != synced[1] or (now[0] != synced[0] and getattr(variable, _STEPPED))


@contextlib.contextmanager
def keras_loop(model: Any) -> Any:
  """While Keras's own ``fit`` / ``evaluate`` / ``predict`` (or ``*_on_batch``) runs `model` (`keras_fit`
  wraps them): the steps it dispatches under a strategy leave no Keras object stale (Keras keeps its state
  in its own pytree and writes it back into the variables, which makes them current), and the clock stands
  still meanwhile, so that its callbacks' reads of objects made current before it began pass. A read at its
  start of an object that was stale already (``fit`` would start from the values before the custom loop's
  steps) raises. Keras donates the arrays it reads to its steps: the model's (and its optimizer's)
  current variables whose arrays a custom loop's state may hold too (`_SHARED`) get a copy first, once, or
  Keras would delete the state's arrays (the next `strategy.run` of it: "Array has been deleted")."""
  _unshare(model)
  loops = _KERAS_LOOPS
  if not loops[0]:
    loops[1] = profiler.steps_dispatched()
  loops[0] += 1
  try:
    yield
  finally:
    loops[0] -= 1
    if not loops[0]:
      loops[2] += profiler.steps_dispatched() - loops[1]


def _unshare(model: Any) -> None:
  """Each current variable of `model` and its optimizer whose array a custom loop's state may hold too
  (`_SHARED`) gets a copy of it (see `keras_loop`). Stale ones are left for Keras's read to refuse."""
  if not _ANY_SHARED[0]:  # a process that never exported a state: nothing to look at
    return
  variables = list(getattr(model, "variables", ()))
  optimizer = getattr(model, "optimizer", None)
  if optimizer is not None and getattr(optimizer, "built", False):
    variables += list(optimizer.variables)
  shared = [v for v in variables if getattr(v, _SHARED, False) and getattr(v, "_value", None) is not None]
  if not shared:
    return
  now = _clock()
  for variable in shared:
    if not _stale(variable, getattr(variable, _SYNCED), now):
      variable.assign(jnp.copy(variable.value))  # a host write: no longer shared, current


def _refuse_stale_read(variable: Any, synced: tuple[int, int], now: tuple[int, int]) -> None:
  """Raises `StaleVariableError` for a host read of `variable`, exported or written at clock `synced`,
  now that the clock is at `now`."""
  moved = []
  if now[0] != synced[0] and getattr(variable, _STEPPED):
    steps = now[0] - synced[0]
    moved.append(f"strategy.run / experimental_run_steps dispatched {steps} step{'s' if steps != 1 else ''}, and "
                 "steps that write it have been traced (steps are counted, not which program ran: after steps "
                 "that only read the state, an evaluation, assign all the same)")
  if now[1] != synced[1]:
    moved.append("a checkpoint was restored (CheckpointManager.restore)")
  raise StaleVariableError(
      f"tpustrat.keras: the Keras variable {variable.path!r} is stale: tpustrat.keras.state handed its value to "
      f"a state pytree (or tpustrat.keras.assign wrote one into it), and since then {' and '.join(moved)}. A "
      "custom loop's progress is in that state, not in the Keras objects, so this read would give the value "
      "from before (TF's `optimizer.iterations.numpy()` after a restore would read 0, model.predict / save / "
      "get_weights and callbacks the old weights). Write the state back first: "
      "`tpustrat.keras.assign(model, optimizer, state)`, after a restore and at the end of each loop of steps; "
      "the step count alone is `tpustrat.keras.iterations(optimizer, state['optimizer'])`. A model whose "
      "values the steps do not change (evaluated only): `tpustrat.keras.state(model)` again marks it current.")


# -- SyncBatchNormalization -------------------------------------------------------------------------------


def _sync_moments(x: Any, axes: Sequence[int], mask: Any, real: Any = None, sync: bool = True) -> tuple[Any, Any]:
  """Mean and variance of `x` over `axes` and over every replica's rows: two sums over the replicas (the
  mean first, then the squared deviations from it, as ``jnp.var`` computes on one device). `real`: this
  replica's real rows of a padded batch whose rows `x` holds (the padding rows weigh nothing), or None.
  Without `sync`, this replica's rows only (no sums over the replicas)."""
  psum = (lambda v: jax.lax.psum(v, REPLICA_AXIS)) if sync else (lambda v: v)
  x32 = x.astype(jnp.float32)
  if mask is None and real is None:
    weight = jnp.ones((), jnp.float32)
    count = jnp.asarray(float(np.prod([x.shape[a] for a in axes])), jnp.float32)
  else:
    weight = (jnp.ones(x.shape, jnp.float32) if mask is None
              else jnp.broadcast_to(jnp.expand_dims(mask, -1), x.shape).astype(jnp.float32))
    if real is not None:
      weight = jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) < real, weight, 0.0)
    count = jnp.sum(weight, axis=tuple(axes))
  total, count = psum((jnp.sum(x32 * weight, axis=tuple(axes)), count))
  mean = total / jnp.maximum(count, 1.0)
  shape = [1 if a in axes else d for a, d in enumerate(x.shape)]
  squares = psum(jnp.sum(jnp.square(x32 - mean.reshape(shape)) * weight, axis=tuple(axes)))
  return mean.astype(x.dtype), (squares / jnp.maximum(count, 1.0)).astype(x.dtype)


def _replica_moments(layer: Any, inputs: Any, mask: Any) -> tuple[Any, Any]:
  """A plain `BatchNormalization`'s statistics inside a step: this replica's real rows only (TF hands a
  replica only its real rows of a partial batch); Keras's own outside a step or for a batch not padded."""
  ctx = context.active_replica_context()
  axis = layer.axis % inputs.ndim
  real = None
  if ctx is not None and context.replica_axis(ctx) is not None and axis != 0:
    real = ctx.padding_count(inputs, f"{type(layer).__name__} {layer.name!r}: its inputs")
  if real is None:
    return type(layer)._moments(layer, inputs, mask)  # pylint: disable=protected-access
  return _sync_moments(inputs, [a for a in range(inputs.ndim) if a != axis], mask, real, sync=False)


def mask_batch_norm_padding(model: Any) -> None:
  """Makes every plain `BatchNormalization` layer of `model` (not `SyncBatchNormalization`) compute its
  batch statistics over this replica's real rows of a padded batch (an instance attribute over Keras's
  private ``_moments``, checked as for `SyncBatchNormalization`; not saved with the model)."""
  keras = import_keras()
  base = keras.layers.BatchNormalization
  _check_moments_hook(base, keras.__version__)
  sync = sync_batch_normalization_class()
  for layer in _layers(model):
    if (isinstance(layer, base) and not isinstance(layer, sync) and "_moments" not in vars(layer)
        and type(layer)._moments is base._moments):  # pylint: disable=protected-access
      object.__setattr__(layer, "_moments", functools.partial(_replica_moments, layer))


def _check_moments_hook(bn: type, version: str) -> None:
  """`SyncBatchNormalization` overrides Keras's private ``BatchNormalization._moments(inputs, mask)``:
  Keras exposes no public way to change the statistics (its ``synchronized=True`` raises on JAX)."""
  hook = getattr(bn, "_moments", None)
  params = list(inspect.signature(hook).parameters) if callable(hook) else None
  if params != ["self", "inputs", "mask"]:
    raise RuntimeError(
        f"tpustrat.keras.SyncBatchNormalization overrides keras.layers.BatchNormalization._moments(inputs, "
        f"mask), a private method of Keras 3.5 to 3.15; Keras {version} has "
        f"{'no such method' if params is None else '_moments' + str(tuple(params))}. Use "
        "keras.layers.BatchNormalization with tpustrat.keras.stateless_call (per-replica statistics, "
        "averaged), or a Keras version this tpustrat was tested with.")


@functools.cache
def sync_batch_normalization_class() -> type:
  """Builds `SyncBatchNormalization` (once): Keras is imported here, on first use."""
  keras = import_keras()
  base = keras.layers.BatchNormalization
  _check_moments_hook(base, keras.__version__)

  class SyncBatchNormalization(base):  # type: ignore[misc, valid-type]
    """TF's ``tf.keras.layers.experimental.SyncBatchNormalization`` for Keras 3 on JAX: inside
    `strategy.run`, the batch statistics are the global batch's.

    Each replica computes the sum of its rows (and their count); one sum over the replicas gives the
    global mean, a second the sum of squared deviations from it: the mean and variance of the whole
    global batch, on every replica, exactly as one device computes them over that batch (and the same
    gradients). The padding rows of a partial batch weigh nothing (their rows are followed through the
    step to the batch, as `compute_average_loss` finds them): the statistics are the real examples'.
    The moving statistics are then the same on every replica (`Mirrored`). Outside `run` it
    is `keras.layers.BatchNormalization`. It takes BatchNormalization's arguments (not
    ``synchronized``, which Keras refuses on JAX) and saves and loads with ``model.save`` /
    ``keras.models.load_model`` (registered as ``"tpustrat>SyncBatchNormalization"``).

    It overrides Keras's private ``BatchNormalization._moments(inputs, mask)`` (Keras exposes no public
    hook for the statistics); the signature is checked when the class is built.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
      if kwargs.pop("synchronized", False):
        raise ValueError("SyncBatchNormalization is synchronised already: drop synchronized=True (Keras "
                         "refuses it on the JAX backend).")
      super().__init__(*args, **kwargs)

    def _moments(self, inputs: Any, mask: Any) -> Any:
      ctx = context.active_replica_context()
      if ctx is None or context.replica_axis(ctx) is None:
        return super()._moments(inputs, mask)
      axis = self.axis % inputs.ndim
      # A partial batch's padding rows weigh nothing: found from the batch `inputs` was computed from.
      real = ctx.padding_count(inputs, "SyncBatchNormalization: its inputs") if axis != 0 else None
      return _sync_moments(inputs, [a for a in range(inputs.ndim) if a != axis], mask, real)

    def get_config(self) -> dict[str, Any]:
      config = super().get_config()
      config.pop("synchronized", None)
      return config

  SyncBatchNormalization.__module__ = "tpustrat.keras"
  SyncBatchNormalization.__qualname__ = "SyncBatchNormalization"
  return keras.saving.register_keras_serializable(package="tpustrat")(SyncBatchNormalization)
