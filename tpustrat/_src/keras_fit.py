"""Keras's ``compile`` / ``fit`` / ``evaluate`` / ``predict`` under ``strategy.scope()``, on every replica.

TF's most common distributed path: build and compile a Keras model inside ``strategy.scope()``, then call
``fit``. Here the same code trains on every replica of the strategy:

* **Placement.** While a strategy's scope is open, Keras's own distribution API is set to a
  `keras.distribution.DataParallel` over the strategy's devices, so every variable created in the scope
  (the model's, the optimizer's when it is built there) is replicated on those devices, as TF's mirrored
  variables are; which strategy created which variable is recorded (`_ScopeDistribution`).
* **The model remembers its strategy.** ``model.compile`` (inside the scope, or outside it for a model
  whose variables were created in it) attaches the strategy to the model. Its train, test and predict
  functions (Keras's public override points ``make_train_function`` and its siblings) are then tpustrat
  programs: the batches Keras's data adapters produce (global batches, as in TF) go through a tpustrat
  distributed dataset (padded to a whole number of rows per replica, the padding rows marked), and
  ``steps_per_execution`` batches run as one `experimental_run_steps` program (one `run` with 1).
  Keras's own ``fit`` loop is kept: callbacks, validation, history, ``initial_epoch``, the progress bar.
* **Exact on partial batches.** Each replica runs Keras's own ``compute_loss_and_updates`` on its rows;
  each compiled loss is Keras's per-example ``loss.call`` reduced as Keras reduces it but with the global
  batch's denominators (`_ReplicaLoss`: its real rows, its unmasked entries, the sum of its weights), the
  padding rows weighted 0, so the mean of the replicas' losses is Keras's one-device loss on the real
  rows, for every reduction; the loss differentiated is that mean (each replica's loss divided by ``N``,
  the gradients summed over the replicas by the program), TF's ``compute_average_loss`` rule. Metrics
  see the padding rows with weight 0; each metric variable is combined over the replicas by its Keras
  ``aggregation`` (``"sum"``: the replicas' increments added, TF's ``SyncOnRead`` ``SUM``), so accuracy,
  ``Mean``, ``AUC``, ``Precision`` / ``Recall`` and the loss trackers count every real example once.
  ``predict`` returns exactly the real rows, in order. What the trace finds cannot be exact on a padded
  batch (a loss that returns one number, the model's own batch-dependent losses) is warned once a
  partial batch has run.

The private Keras names this relies on are checked once, with the Keras version, in `check_keras`.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import inspect
import sys
import threading
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpustrat._src import context, jax_compat, keras_models, multistep
from tpustrat._src import input as input_lib
from tpustrat._src import steps as steps_lib
from tpustrat._src.engine import RunOptions
from tpustrat._src.input import padding
from tpustrat._src.input.sources import batched_examples
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.padding_reads import PaddingReadWarning
from tpustrat._src.values import DistributedValues, Mirrored

__all__ = ["fit_of", "install", "scope_distribution", "set_run_options", "strategy_of_model"]

# Keras's methods that run a model's train, test or predict function: under a strategy, tpustrat's.
_GUARDED = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")
# The steps Keras's functions call, which tpustrat's replace (a model that overrides one is refused).
_STEPS = {"fit": "train_step", "train_on_batch": "train_step", "evaluate": "test_step",
          "test_on_batch": "test_step", "predict": "predict_step", "predict_on_batch": "predict_step"}
# Private members of Keras 3's JAX trainer this module uses (see `check_keras`).
_PRIVATE = ("_get_jax_state", "jax_state_sync")
# Keras's loss reduction, private, which `_ReplicaLoss` mirrors with global denominators.
_LOSS_FUNCTIONS = ("standardize_reduction", "apply_mask", "squeeze_or_expand_to_same_rank")

_LOCK = threading.Lock()
_INSTALLED: list[Any] = []
# The attribute that records, on a Keras variable created inside a strategy's scope, that strategy.
_CREATED_IN = "_tpustrat_created_in"


def check_keras(keras: Any) -> None:
  """Fails loudly on a Keras whose JAX trainer lacks what this module relies on (Keras 3.5 to 3.15)."""
  trainer = keras.Model
  missing = [name for name in _PRIVATE + ("compute_loss_and_updates", "make_train_function",
                                          "make_test_function", "make_predict_function")
             if not callable(getattr(trainer, name, None))]
  loss_module = _keras_loss_module()
  missing += [f"keras.src.losses.loss.{name}" for name in _LOSS_FUNCTIONS
              if not callable(getattr(loss_module, name, None))]
  if not callable(getattr(getattr(loss_module, "backend", None), "get_keras_mask", None)):
    missing.append("keras.src.backend.get_keras_mask")
  try:  # each output's compiled metrics, a `MetricsList(metrics)` kept as `.metrics` (`_weighted_metrics`)
    from keras.src.trainers import compile_utils  # type: ignore[import-untyped]  # noqa: PLC0415
    listed = "metrics" in inspect.signature(compile_utils.MetricsList.__init__).parameters
  except (ImportError, AttributeError, TypeError, ValueError):
    listed = False
  if not listed:
    missing.append("keras.src.trainers.compile_utils.MetricsList(metrics)")
  if missing:
    raise RuntimeError(
        f"tpustrat: Keras {keras.__version__}'s JAX trainer has no {', '.join(missing)}; tpustrat's "
        "compile/fit under a strategy was written for Keras 3.5 to 3.15. Use a Keras version tpustrat was "
        "tested with, or train in strategy.run with tpustrat.keras.stateless_call.")


def _keras() -> Any:
  return sys.modules.get("keras")


# -- placement: Keras's distribution while a strategy's scope is open ------------------------------------


@functools.cache
def _distribution_class() -> type:
  keras = keras_models.import_keras()

  class _ScopeDistribution(keras.distribution.DataParallel):  # type: ignore[name-defined]
    """Keras's data-parallel distribution over a strategy's devices: variables replicated on every
    device; each variable created under it is recorded as the strategy's."""

    def __init__(self, strategy: Any) -> None:
      super().__init__(devices=list(strategy.mesh.devices.flat))
      self.tpustrat_strategy = strategy

    def get_variable_layout(self, variable: Any) -> Any:
      setattr(variable, _CREATED_IN, self.tpustrat_strategy)
      return super().get_variable_layout(variable)

  return _ScopeDistribution


@contextlib.contextmanager
def scope_distribution(strategy: Any):
  """Inside ``strategy.scope()``: Keras variables created here are replicated on the strategy's devices
  (when Keras is imported and runs on JAX; otherwise nothing happens). Installs the compile hook."""
  keras = _keras()
  if keras is None or strategy.mesh is None or not _on_jax(keras):
    yield
    return
  install()
  dist = _distribution_class()(strategy)
  with dist.scope():
    yield


def _on_jax(keras: Any) -> bool:
  try:
    return keras.backend.backend() == "jax"
  except Exception:  # noqa: BLE001 - a half-imported Keras: leave it alone
    return False


def set_run_options(model: Any, options: RunOptions | None) -> None:
  """The `tpustrat.RunOptions` of the programs a Keras model's ``fit`` / ``evaluate`` / ``predict`` run.

  A model compiled under a strategy runs each call of its train, test and predict functions through
  `strategy.run` (one step) or `strategy.experimental_run_steps` (``steps_per_execution`` steps); these
  options are theirs: ``check_numerics=True`` checks every step's outputs for NaN and Inf
  (`tpustrat.NumericsError` names the step, the output and the replicas), ``max_steps_in_flight`` bounds
  the programs queued on the devices, ``scan_unroll`` unrolls the steps of one execution. The training
  state is always donated (as Keras's JAX trainer donates it), so ``donate_argnums`` cannot be set here.
  None restores the defaults.

  >>> import keras
  >>> strategy = tpustrat.TPUStrategy()
  >>> with strategy.scope():
  ...   model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
  ...   model.compile(optimizer="sgd", loss="mse")
  >>> tpustrat.keras.set_run_options(model, tpustrat.RunOptions(check_numerics=True))

  Raises:
    ValueError: the model is not compiled under a strategy, or `options` sets ``donate_argnums`` or
      ``experimental_layout_map``.
    TypeError: `options` is not a `tpustrat.RunOptions` or None.
  """
  fit = fit_of(model)
  if fit is None:
    raise ValueError(f"tpustrat.keras.set_run_options: the model {getattr(model, 'name', model)!r} is not "
                     "compiled under a strategy (build and compile it inside strategy.scope()).")
  if options is None:
    options = RunOptions()
  if not isinstance(options, RunOptions):
    raise TypeError(f"tpustrat.keras.set_run_options: options must be a tpustrat.RunOptions or None, got "
                    f"{type(options).__name__}: {options!r:.100}.")
  if options.donate_argnums:
    raise ValueError(f"tpustrat.keras.set_run_options: donate_argnums={options.donate_argnums}; fit always "
                     "donates the training state and nothing else (the batches belong to the input pipeline).")
  if options.experimental_layout_map is not None:
    raise ValueError("tpustrat.keras.set_run_options: experimental_layout_map is not supported for Keras "
                     "models (their variables are replicated on every replica).")
  fit.options = options


def fit_of(model: Any) -> Any:
  """What a model compiled under a strategy holds (`_Fit`), or None."""
  return getattr(model, "_tpustrat_fit", None)


def strategy_of_model(model: Any) -> Any:
  """The strategy whose replicas a Keras model's ``fit`` / ``evaluate`` / ``predict`` run on, or None.

  A model compiled inside ``strategy.scope()`` (or compiled anywhere after it was built inside one) is
  attached to that strategy, as TF's ``model.distribute_strategy``; a plain Keras model is not (None).
  """
  fit = getattr(model, "_tpustrat_fit", None)
  return None if fit is None else fit.strategy


def _created_in(model: Any) -> set[Any]:
  """The strategies (None for outside any) in whose scope the model's variables were created."""
  return {getattr(v, _CREATED_IN, None) for v in model.variables}


# -- the hooks on keras.Model ----------------------------------------------------------------------------


def install() -> None:
  """Wraps ``keras.Model.compile`` (once per process): a model compiled under a strategy gets tpustrat's
  train, test and predict functions; and ``fit`` / ``evaluate`` / ``predict`` inside a strategy's scope
  refuse a model that does not belong to it."""
  keras = keras_models.import_keras()
  with _LOCK:
    if _INSTALLED:
      return
    check_keras(keras)
    # Each method is wrapped on the class that defines it (Keras's Trainer, its JAX trainer): Keras compares
    # ``model.__class__.compile`` with ``Trainer.compile`` to tell a user's own compile (load_model).
    owners = {name: next(c for c in keras.Model.__mro__ if name in vars(c))
              for name in ("compile",) + _GUARDED}
    original = {name: vars(owner)[name] for name, owner in owners.items()}

    @functools.wraps(original["compile"])
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - Keras's name
      strategy = _strategy_for_compile(self)
      result = original["compile"](self, *args, **kwargs)
      if strategy is not None:
        _Fit.attach(self, strategy)
      elif getattr(self, "_tpustrat_fit", None) is not None:
        self._tpustrat_fit.detach()
      return result

    def guarded(name: str) -> Any:
      method = original[name]

      @functools.wraps(method)
      def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        fit = getattr(self, "_tpustrat_fit", None)
        current = context.get_strategy() if context.has_strategy() else None
        if fit is None:
          if current is not None and current.mesh is not None and len(current.mesh.devices.flat) > 1:
            raise ValueError(
                f"model.{name}() was called inside the scope of {current!r}, but the model "
                f"{self.name!r} was not compiled under it, so Keras would run it on its own. Build and "
                "compile the model inside the scope:\n  with strategy.scope():\n    model = build_model()\n"
                "    model.compile(...)\n  model.fit(...)")
          with keras_models.keras_loop(self):  # a custom loop's state: not Keras's to donate
            return method(self, *args, **kwargs)
        if current is not None and current is not fit.strategy:
          raise ValueError(
              f"model.{name}() was called inside the scope of {current!r}, but the model {self.name!r} "
              f"was compiled under {fit.strategy!r}. Call it outside any scope or inside that strategy's "
              "scope, or build and compile the model again under this one.")
        fit.check_steps(self, name)
        args, kwargs = _global_inputs(name, args, kwargs)
        args, kwargs = fit.read_per_process(name, args, kwargs)
        fit.depth += 1
        try:
          # Keras's own loop keeps the model current (it writes its state back): its steps leave no
          # Keras object stale, and it donates no array of a custom loop's state (`keras_models.keras_loop`).
          with fit.keras_distribution_off(), keras_models.keras_loop(self):
            result = method(self, *args, **kwargs)
          if fit.options.check_numerics and fit.depth == 1:
            # Its last steps' flags are read by a later wait: this call's own NaN / Inf is raised here,
            # not by whatever call of the strategy comes next.
            fit.strategy.experimental_run_wait()
          return result
        finally:
          fit.depth -= 1
          if not fit.depth:  # not the evaluate that fit calls for validation: fit's iterators stay open
            fit.close_iterators()
            fit.per_process = {}
          if name == "fit" and fit.backup is not None:  # fit returned or raised: stop watching for notices
            fit.backup.end()
            fit.backup = None

      return call

    owners["compile"].compile = compile
    for name in _GUARDED:
      setattr(owners[name], name, guarded(name))
    _INSTALLED.append(original)


def _global_inputs(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
  """TF's ``model.fit(strategy.experimental_distribute_dataset(ds))``: a distributed dataset given to
  ``fit`` / ``evaluate`` / ``predict`` (as ``x`` or ``validation_data``) is read as the global batches it
  distributes (Keras's data adapters batch nothing again; tpustrat distributes them in the step)."""
  what = f"model.{name}"

  def unwrap(value: Any) -> Any:
    if isinstance(value, input_lib.DistributedIterator):
      raise TypeError(f"{what}: got a DistributedIterator; pass the dataset (or its source), as TF's fit "
                      "takes the distributed dataset itself.")
    if not isinstance(value, input_lib.DistributedDataset):
      return value
    source = value.global_source(what)
    if isinstance(source, collections.abc.Sequence) and not isinstance(source, (str, bytes)):
      return _py_dataset(source)  # a list of batches would read as arrays; Keras's PyDataset reads it in order
    return source if not isinstance(source, collections.abc.Iterator) else (b for b in source)

  given = args[0] if args else kwargs.get("x")
  args = tuple(unwrap(a) if i == 0 else a for i, a in enumerate(args))
  kwargs = {k: unwrap(v) if k in ("x", "validation_data") else v for k, v in kwargs.items()}
  if name == "fit" and isinstance(given, input_lib.DistributedDataset):
    kwargs["shuffle"] = False  # a dataset keeps its order, as TF's fit keeps a tf.data dataset's
  return args, kwargs


def _stand_in(dataset: Any, examples: Any) -> Any:
  """A Keras ``PyDataset`` as long as `dataset` (a batched grain MapDataset) whose every batch is one
  example of it (read once): what Keras's loop reads to build and count, never trained on."""
  return _py_dataset([examples.stack([examples.examples[0]])] * len(dataset))


def _py_dataset(batches: collections.abc.Sequence[Any]) -> Any:
  """A list of global batches as a Keras ``PyDataset`` (read in order, one batch per index)."""
  keras = keras_models.import_keras()

  class Batches(keras.utils.PyDataset):  # type: ignore[name-defined]
    def __len__(self) -> int:
      return len(batches)

    def __getitem__(self, i: int) -> Any:
      return batches[i]

  return Batches()


def _strategy_for_compile(model: Any) -> Any:
  """The strategy a ``compile`` attaches, as TF decides it: the scope's when inside one (every variable
  of the model must have been created in it), else the one the model's variables were created in."""
  current = context.get_strategy() if context.has_strategy() else None
  if current is not None and current.mesh is None:
    current = None
  created = _created_in(model) if model.built else set()
  if current is not None:
    strangers = created - {current}
    if strangers:
      where = ("outside any strategy's scope" if strangers == {None} else
               f"in the scope of {next(s for s in strangers if s is not None)!r}")
      raise ValueError(
          f"model.compile() inside the scope of {current!r}: variables of the model {model.name!r} were "
          f"created {where}. Create the model (and its optimizer) inside the scope you compile it in:\n"
          "  with strategy.scope():\n    model = build_model()\n    model.compile(...)")
    return current
  owners = created - {None}
  if len(owners) > 1:
    raise ValueError(f"model.compile(): the variables of {model.name!r} were created in the scopes of "
                     f"several strategies ({', '.join(map(repr, owners))}); create them in one.")
  if owners and None in created:
    raise ValueError(
        f"model.compile(): some variables of {model.name!r} were created in the scope of {next(iter(owners))!r} "
        "and some outside any scope; create the whole model inside the strategy's scope.")
  return next(iter(owners)) if owners else None


# -- the attached strategy: Keras's train / test / predict functions as tpustrat programs -------------------


class _Fit:
  """What a model compiled under a strategy holds (``model._tpustrat_fit``)."""

  def __init__(self, model: Any, strategy: Any) -> None:
    self._model_ref = weakref.ref(model)
    self.strategy = strategy
    self.replicas = strategy.num_replicas_in_sync
    self.iterators: dict[str, tuple[Any, Any]] = {}  # "train"/"test"/"predict" -> (Keras iterator, ours)
    self.warned: set[str] = set()
    # The step functions, one object each, so that the strategy's program cache finds them again.
    # The step functions, one object each (the strategy's program caches find them again): one step per
    # `run`; k steps per `experimental_run_steps`, the last step's logs in the carry (not stacked outputs,
    # which would cost a slice per log entry on the host).
    self.steps = {kind: _named(functools.partial(step, self), kind)
                  for kind, step in (("train", _train_step), ("test", _test_step), ("predict", _predict_step))}
    self.many_steps = {kind: _named(functools.partial(_carrying_logs, self.steps[kind]), kind)
                       for kind in ("train", "test")}
    self.log_zeros: dict[str, Any] = {}
    self.backup: Any = None  # a tpustrat.keras.BackupAndRestore while its fit runs
    self.options = RunOptions()  # set_run_options
    self._donating: tuple[RunOptions, RunOptions] | None = None  # (options, them donating the state)
    # What a traced step cannot make exact on a padded batch (`_ReplicaLoss`, `_forward_losses`), said
    # once each (`PaddingReadWarning`) when a partial batch has run; `padded`: one has been read.
    self.hazards: set[str] = set()
    self.padded = False
    self.depth = 0  # fit / evaluate / predict calls in progress (fit calls evaluate)
    self.per_process: dict[str, Any] = {}  # kind -> a grain dataset each process reads its share of
    self.skip_batches = 0  # batches of the next training epoch already done before a restart
    self.last_steps = 0  # training steps the last train execution ran

  def model(self) -> Any:
    """The model (held weakly: it holds this object)."""
    model = self._model_ref()
    if model is None:
      raise RuntimeError("tpustrat: the Keras model of this train function no longer exists.")
    return model

  @classmethod
  def attach(cls, model: Any, strategy: Any) -> None:
    fit = cls(model, strategy)
    object.__setattr__(model, "_tpustrat_fit", fit)
    # Keras's public override points, per instance: Keras's fit / evaluate / predict loops call them.
    object.__setattr__(model, "make_train_function", fit.make_train_function)
    object.__setattr__(model, "make_test_function", fit.make_test_function)
    object.__setattr__(model, "make_predict_function", fit.make_predict_function)
    model.train_function = model.test_function = model.predict_function = None
    _place(model, strategy)
    keras_models.mask_batch_norm_padding(model)

  def detach(self) -> None:
    model = self._model_ref()
    if model is None:
      return
    for name in ("_tpustrat_fit", "make_train_function", "make_test_function", "make_predict_function"):
      model.__dict__.pop(name, None)
    model.train_function = model.test_function = model.predict_function = None

  @contextlib.contextmanager
  def keras_distribution_off(self):
    """Keras's own distribution (set while the scope is open) is off during fit / evaluate / predict:
    the data goes through tpustrat's pipeline, which pads partial batches instead of refusing them."""
    keras = keras_models.import_keras()
    current = keras.distribution.distribution()
    if current is None:
      yield
      return
    keras.distribution.set_distribution(None)
    try:
      yield
    finally:
      keras.distribution.set_distribution(current)

  def check_steps(self, model: Any, name: str) -> None:
    """Refuses a model whose class overrides the Keras step that `name` runs: tpustrat runs Keras's own
    step per replica (exact on padded batches); a step of the user's would run per replica with padding
    rows and gradients already summed over the replicas, a different computation than the one written."""
    step = _STEPS[name]
    keras = keras_models.import_keras()
    base = next(c for c in keras.Model.__mro__ if step in vars(c))
    if getattr(type(model), step) is not vars(base)[step]:
      why = {"train_step": "its loss would count the padding rows of a partial batch, and its gradients "
                           "w.r.t. the replicated weights come back already summed over the replicas",
             "test_step": "its loss and metrics would count the padding rows of a partial batch",
             "predict_step": "its outputs would hold the padding rows of a partial batch"}[step]
      raise NotImplementedError(
          f"model.{name}() under {self.strategy!r}: the model's class {type(model).__name__} overrides "
          f"{step}, which tpustrat does not run per replica ({why}). "
          + ("Override compute_loss / compute_metrics instead (both are used, per example), or write the step "
             if step != "predict_step" else "Override call, or write the step ")
          + "for strategy.run with tpustrat.keras.stateless_call (docs/guides/keras.md, the custom loop).")

  def read_per_process(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """In a job of several processes, a batched grain ``MapDataset`` given to fit / evaluate / predict is
    read by each process for its own replicas' rows only (the distributed dataset's per-process read):
    Keras's loop gets a stand-in of the same length (its batches are counted, not read: the steps take the
    dataset's batches from tpustrat's iterator over it), built from one example for Keras's first look."""
    if jax.process_count() == 1 or self.depth > 1:
      return args, kwargs
    kinds = {"fit": ("train", "test"), "evaluate": ("test",), "predict": ("predict",)}.get(name)
    if kinds is None:
      return args, kwargs

    def stand_in(value: Any, kind: str) -> Any:
      examples = batched_examples(value)
      if examples is None:
        return value
      self.per_process[kind] = value
      return _stand_in(value, examples)

    if args:
      args = (stand_in(args[0], kinds[0]), *args[1:])
    elif "x" in kwargs:
      kwargs = {**kwargs, "x": stand_in(kwargs["x"], kinds[0])}
    if len(kinds) > 1 and kwargs.get("validation_data") is not None:
      kwargs = {**kwargs, "validation_data": stand_in(kwargs["validation_data"], kinds[1])}
    return args, kwargs

  def close_iterators(self) -> None:
    """Closes the distributed iterators over Keras's iterators (and their prefetch threads)."""
    iterators, self.iterators = self.iterators, {}
    for _, ours in iterators.values():
      ours.close()

  # Keras's override points --------------------------------------------------------------------------

  def make_train_function(self, force: bool = False) -> Any:
    model = self.model()
    if model.train_function is None or force:
      model.train_function = functools.partial(self._call, "train")
    return model.train_function

  def make_test_function(self, force: bool = False) -> Any:
    model = self.model()
    if model.test_function is None or force:
      model.test_function = functools.partial(self._call, "test")
    return model.test_function

  def make_predict_function(self, force: bool = False) -> Any:
    model = self.model()
    if model.predict_function is None or force:
      model.predict_function = functools.partial(self._call, "predict")
    return model.predict_function

  # One call of a Keras function: up to steps_per_execution batches in one program ---------------------

  def _distributed(self, kind: str, iterator: Any) -> Any:
    """Our distributed iterator over Keras's iterator of global batches (one per Keras epoch iterator), or,
    for a dataset each process reads its share of (`read_per_process`), over that dataset."""
    known = self.iterators.get(kind)
    if known is not None and known[0] is iterator:
      return known[1]
    if known is not None:
      known[1].close()
    source = self.per_process.get(kind)
    if source is not None:  # Keras's iterator holds stand-ins: the batches come from the dataset itself
      ours = iter(input_lib.distribute_dataset(self.strategy, source, None))
      self.iterators[kind] = (iterator, ours)
      return ours
    # Padding rows are copies of the batch's first row (the dataset's default): they weigh nothing, and
    # cannot make NaN or Inf (a masked mean over an all-zero row is 0/0) whose gradient, times the zero
    # weight, is still NaN.
    ours = iter(input_lib.distribute_dataset(self.strategy, _GlobalBatches(iterator, self), None))
    self.iterators[kind] = (iterator, ours)
    return ours

  def _call(self, kind: str, state: Any, iterator: Any) -> Any:
    if kind == "train" and self.backup is not None:
      return self.backup.run_call(lambda: self._execute(kind, state, iterator))
    logs, state, _ = self._execute(kind, state, iterator)
    return logs, state

  def _execute(self, kind: str, state: Any, iterator: Any) -> tuple[Any, Any, int]:
    """One call of a Keras function: up to ``steps_per_execution`` batches in one program. Returns the
    logs (or predictions), the new state and how many steps ran."""
    model = self.model()
    k = max(1, int(model.steps_per_execution))
    state = tuple(state)
    if kind == "train" and self.skip_batches:
      # Resuming inside an epoch: its first batches were trained on before the restart. Each call still
      # takes its k batches from Keras's iterator (Keras counts the epoch's batches by calls), but those
      # already done are dropped, and a call with none left to train on runs no step.
      drop = min(self.skip_batches, k)
      for _ in range(drop):
        next(iterator)  # the end of the data ends the epoch, as in Keras
      self.skip_batches -= drop
      k -= drop
      if k == 0:
        self.last_steps = 0
        return self._host_logs(model, state[-1]), state, 0
    ours = self._distributed(kind, iterator)
    return self._steps(kind, state, ours=ours, k=k)

  def _steps(self, kind: str, state: Any, *, ours: Any, k: int) -> Any:
    model = self.model()
    with warnings.catch_warnings():
      # The steps weigh padding rows 0 in the loss and every metric (see the module docstring): the
      # padding-read analysis, which cannot see through Keras's weighting, would be a false alarm.
      warnings.simplefilter("ignore", PaddingReadWarning)
      # The state is donated, as Keras's JAX trainer donates it: Keras reads it back from the step's
      # results (the model's variables were purged of it), so the old and new state are not both kept.
      options = self.options if kind == "predict" else self._donating_options()
      if k == 1:
        state, outputs = self.strategy.run(self.steps[kind], args=(state, next(ours)), options=options)
        steps = 1
      else:
        # The k batches taken here, stacked (fewer at the end of the data; StopIteration after it), not by
        # experimental_run_steps from the iterator: a call on stacked batches and a carry of placed arrays
        # like the last call's takes its fast path, which runs none of its per-call checks again.
        # Keras counts k batches a call: a group that ends early (a batch of other shapes than the group's:
        # a larger later batch, another sequence length) is followed, in the same call, by programs over
        # the batches after it, until k have run or the data ends.
        mirrored = self.strategy.mesh is not None
        steps, parts = 0, []
        while steps < k:
          try:
            batches = multistep.take(ours, k - steps, "model.fit")
          except StopIteration:
            if not steps:
              raise
            break  # the end of the data
          if kind == "predict":
            init = _mirrored(state) if mirrored else state
            state, outputs = self.strategy.experimental_run_steps(self.steps[kind], batches, None, init=init,
                                                                  options=options)
          else:
            init = (state, self._log_zeros(kind, model, state))
            (state, outputs), _ = self.strategy.experimental_run_steps(
                self.many_steps[kind], batches, None, init=_mirrored(init) if mirrored else init, options=options)
          parts.append(outputs)  # train / test: the logs of the group's last step
          steps += _steps_in(batches)
          if steps < k:
            state = tuple(_arrays(state))  # the next group's init, as Keras would hand it back
    self.last_steps = steps
    if self.padded and self.hazards - self.warned:
      for hazard in sorted(self.hazards - self.warned):
        self.warned.add(hazard)
        warnings.warn(
            f"model.{'fit' if kind == 'train' else 'evaluate' if kind == 'test' else 'predict'} under "
            f"{self.strategy!r}: a partial batch was padded to as many rows per replica as a full batch gives "
            f"each (padding rows), and {hazard}: those numbers differ from one device's on that batch (TF hands "
            "replicas only real rows). Compute the term per example inside a Keras loss (its padding rows then "
            "weigh nothing), or give the data a number of rows that divides into full global batches.",
            PaddingReadWarning, stacklevel=5)
    state = tuple(_arrays(state))
    if kind == "predict":
      if k == 1:
        return _predictions(self.strategy, outputs), state, steps
      return _predictions(self.strategy, groups=parts), state, steps
    return _arrays(outputs if k == 1 else parts[-1]), state, steps

  def _donating_options(self) -> RunOptions:
    """`options` with the state donated, made once per `set_run_options` (a `RunOptions` is checked when
    made: one per step cost more than the step's own host work on a small model)."""
    made = self._donating
    if made is None or made[0] is not self.options:
      made = self._donating = (self.options, dataclasses.replace(self.options, donate_argnums=0))
    return made[1]

  def _host_logs(self, model: Any, metrics: Any) -> Any:
    keras = keras_models.import_keras()
    with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics))):
      return model.get_metrics_result()

  def _log_zeros(self, kind: str, model: Any, state: Any) -> Any:
    """The carry's logs before the first step: zeros shaped as the metrics' results, made fresh for each call
    (the carry is donated) by one compiled call, replicated as the rest of the carry (a placed carry lets
    `experimental_run_steps` take its fast path; host zeros were placed leaf by leaf, every call)."""
    make = self.log_zeros.get(kind)
    if make is None:
      results = self._host_logs(model, state[-1])
      leaves, treedef = jax.tree.flatten(results)
      avals = [(np.shape(v), jax.dtypes.canonicalize_dtype(np.asarray(v).dtype)) for v in leaves]
      mesh = self.strategy.mesh
      make = self.log_zeros[kind] = jax.jit(
          lambda: treedef.unflatten([jnp.zeros(shape, dtype) for shape, dtype in avals]),
          out_shardings=None if mesh is None else NamedSharding(mesh, P()))
    return make()


_MIRRORED: dict[Any, Any] = {}  # a carry's treedef -> that of the carry with each leaf `Mirrored`


def _mirrored(tree: Any) -> Any:
  """`tree`, replicated arrays, with each leaf a `Mirrored` (as `experimental_run_steps` lays a carry out
  and returns it): its structure worked out once, then one flatten and unflatten per call. A carry given
  laid out so, its arrays already placed, lets the next call with the same shapes take the fast path."""
  leaves, treedef = _flatten(tree)
  try:
    wrapped = _MIRRORED.get(treedef)
  except TypeError:  # node data that cannot be hashed
    return jax.tree.map(Mirrored.from_global, tree)
  if wrapped is None:
    if len(_MIRRORED) >= _UNWRAPPED_SIZE:
      _MIRRORED.clear()
    wrapped = _MIRRORED[treedef] = jax.tree.structure(jax.tree.map(Mirrored.from_global, tree))
  return wrapped.unflatten(leaves)


def _steps_in(batches: Any) -> int:
  """How many steps batches stacked by `multistep.take` hold (their leaves' leading axis)."""
  return int(jax.tree.leaves(batches)[0].shape[0])


class _GlobalBatches:
  """Keras's iterator of global batches as a one-shot source: ``(x,)``, ``(x, y)`` or ``(x, y, w)``
  with Nones dropped from the structure (kept as the positions that hold them)."""

  def __init__(self, iterator: Any, fit: _Fit) -> None:
    self.iterator = iterator
    self.fit = fit
    self.first_rows: int | None = None

  def __iter__(self) -> Any:
    return self

  def __next__(self) -> Any:
    data = next(self.iterator)
    if not isinstance(data, tuple):
      data = (data,)
    first = None
    for d in data:  # Keras's array adapters give numpy arrays (and Nones): nothing to convert
      if type(d) is np.ndarray:
        if first is None:
          first = d
      elif d is not None:
        data = tuple(_host(d) for d in data)
        leaves = jax.tree.leaves(data)
        first = leaves[0] if leaves else None
        break
    if first is not None and np.ndim(first):
      rows = int(np.shape(first)[0])
      if self.first_rows is None:
        self.first_rows = rows
      if rows % self.fit.replicas or rows != self.first_rows:  # padded: a partial batch
        self.fit.padded = True
    return data


def _host(x: Any) -> Any:
  return jax.tree.map(lambda a: a if isinstance(a, np.ndarray) else np.asarray(a), x)


def _named(step: Any, kind: str) -> Any:
  def body(carry: Any, batch: Any) -> Any:
    return step(carry, batch)

  body.__name__ = body.__qualname__ = f"keras_{kind}_step"  # the step's name in profiles and messages
  return body


def _carrying_logs(step: Any, carry: Any, batch: Any) -> Any:
  """One step of `experimental_run_steps` whose carry holds the state and the last step's logs."""
  state, _ = carry
  return step(state, batch), jnp.zeros((), jnp.int8)  # stacked: its length is the number of steps run


def _array(v: Any) -> Any:
  return v.tree if isinstance(v, DistributedValues) else v


_flatten = jax.tree_util.default_registry.flatten
_UNWRAPPED: dict[Any, tuple[Any, list[int] | None]] = {}  # a result's treedef -> `_unwrapped` of it
_UNWRAPPED_SIZE = 64  # structures kept (a few per model: its train, test and predict results)


def _arrays(tree: Any) -> Any:
  """`tree` with each `DistributedValues` replaced by its global arrays (`_array`; padded real-row counts
  dropped): flattened by JAX (through the values' nodes), rebuilt as the structure without them, which is
  worked out once per structure (`_unwrapped`). A step's state is hundreds of arrays: a Python call per node
  or leaf cost more than the step's own host work on a small model."""
  leaves, treedef = _flatten(tree)
  try:
    known = _UNWRAPPED.get(treedef)
  except TypeError:  # a structure whose node data cannot be hashed: by `jax.tree.map`
    return jax.tree.map(_array, tree, is_leaf=lambda v: isinstance(v, DistributedValues))
  if known is None:
    if len(_UNWRAPPED) >= _UNWRAPPED_SIZE:
      _UNWRAPPED.clear()
    known = _UNWRAPPED[treedef] = _unwrapped(treedef)
  if known is _BY_TREE_MAP:
    return jax.tree.map(_array, tree, is_leaf=lambda v: isinstance(v, DistributedValues))
  plain, kept = known
  return plain.unflatten(leaves if kept is None else [leaves[i] for i in kept])


_BY_TREE_MAP: Any = ("by jax.tree.map",)  # `_unwrapped` of a structure it cannot work out with stand-ins


def _unwrapped(treedef: Any) -> Any:
  """The structure of a tree of `treedef` with each `DistributedValues` replaced by its global arrays, and
  the positions of the leaves it keeps (None: all, in order). Worked out on a tree of stand-in leaves (their
  positions); a node that refuses them when it is rebuilt (a custom pytree that checks its children) leaves
  the structure to `jax.tree.map` on every call (`_BY_TREE_MAP`)."""
  n = treedef.num_leaves
  try:
    positions = jax.tree.map(_array, treedef.unflatten(list(range(n))),
                             is_leaf=lambda v: isinstance(v, DistributedValues))
  except Exception:  # pylint: disable=broad-except  # the user's node's own check of stand-in children
    return _BY_TREE_MAP
  kept, plain = jax.tree.flatten(positions)
  return plain, (None if kept == list(range(n)) else kept)


def _predictions(strategy: Any, one: Any = None, groups: list[Any] | None = None) -> Any:
  """The per-example outputs as one array per output, exactly the real rows, in order: of `one` step's
  outputs, or of consecutive programs' stacked outputs (`groups`)."""
  steps = (one,) if groups is None else [step for stacked in groups for step in steps_lib.unstack_steps(stacked)]
  parts = [strategy.gather(step, axis=0) for step in steps]
  return jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs]), *parts)


def _place(model: Any, strategy: Any) -> None:
  """Every variable of the model (and its optimizer, when built) replicated on the strategy's devices."""
  sharding = jax.sharding.NamedSharding(strategy.mesh, jax.sharding.PartitionSpec())
  variables = list(model.variables)
  optimizer = getattr(model, "optimizer", None)
  if optimizer is not None and getattr(optimizer, "built", False):
    variables += list(optimizer.variables)
  for v in variables:
    value = v.value
    if getattr(value, "sharding", None) != sharding:
      v.assign(jax.device_put(value, sharding))


# -- the per-replica steps (traced inside experimental_run_steps) -----------------------------------------


def _unpack(batch: Any) -> tuple[Any, Any, Any]:
  x = batch[0]
  y = batch[1] if len(batch) > 1 else None
  w = batch[2] if len(batch) > 2 else None
  return x, y, w


class _Rows:
  """This replica's rows of the step's batch: the mask of its real rows, ``k`` and the global count ``n``."""

  def __init__(self, x: Any, replicas: int) -> None:
    leaf = next(leaf for leaf in jax.tree.leaves(x) if leaf is not None)
    self.mask = padding.valid_mask(leaf).astype(jnp.float32)
    self.k = self.mask.shape[0]
    self.n = jax.lax.psum(jnp.sum(self.mask), REPLICA_AXIS)
    self.replicas = replicas


def _keras_loss_module() -> Any:
  from keras.src.losses import loss as loss_module  # type: ignore[import-untyped]  # pylint: disable=import-outside-toplevel
  return loss_module


class _ReplicaLoss:
  """One output's compiled loss inside a step: Keras's own per-example loss (``loss.call``), reduced so
  that the mean over the replicas of what each replica returns is Keras's one-device value over the
  global batch's real rows, for every reduction Keras has: the padding rows (and entries a Keras mask
  removes) weigh nothing, and the denominators (rows, unmasked entries, the sum of the weights) are the
  global batch's, summed over the replicas. Mirrors ``keras.losses.Loss.__call__``."""

  def __init__(self, fit: _Fit, loss: Any, rows: _Rows) -> None:
    self.fit = fit
    self.loss = loss
    self.rows = rows

  def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
    keras = keras_models.import_keras()
    lm = _keras_loss_module()
    loss, rows = self.loss, self.rows
    reduction = lm.standardize_reduction(loss.reduction)
    in_mask = lm.backend.get_keras_mask(y_pred)
    y_pred = jax.tree.map(lambda v: keras.ops.convert_to_tensor(v, dtype=loss.dtype), y_pred)
    y_true = jax.tree.map(lambda v: keras.ops.convert_to_tensor(v, dtype=loss.dtype), y_true)
    values = loss.call(y_true, y_pred)
    if reduction in (None, "none") or jnp.ndim(values) == 0:
      if jnp.ndim(values) == 0:  # the loss reduced its rows itself: its padding rows cannot be removed
        self.fit.hazards.add(f"the loss {getattr(loss, 'name', loss)!r} returns one number for the batch "
                             "(it reduces its rows itself), so each replica's value includes its padding rows")
      else:  # per-example values, reduced by Keras after the loss (a mean over every row, padding included)
        self.fit.hazards.add(f"the loss {getattr(loss, 'name', loss)!r} has reduction={loss.reduction!r}: its "
                             "per-example values are averaged after it, padding rows included")
      return loss(y_true, y_pred, sample_weight)
    out_mask = lm.backend.get_keras_mask(values)
    keras_mask = (in_mask & out_mask if in_mask is not None and out_mask is not None
                  else in_mask if in_mask is not None else out_mask)
    values = keras.ops.convert_to_tensor(values, dtype=loss.dtype)
    dtype = values.dtype
    real = rows.mask.reshape(rows.mask.shape + (1,) * (values.ndim - 1)).astype(bool)
    real = jnp.broadcast_to(real, values.shape)
    mask = real if keras_mask is None else real & jnp.broadcast_to(keras_mask.astype(bool), values.shape)
    weight = lm.apply_mask(sample_weight, mask, dtype=dtype, reduction="sum")  # weights x 0/1 mask
    weighted, weight = lm.squeeze_or_expand_to_same_rank(values, weight)
    total = jnp.sum(weighted * weight)
    psum = functools.partial(jax.lax.psum, axis_name=REPLICA_AXIS)
    if reduction == "sum":
      value = total
    elif reduction == "mean_with_sample_weight" and (sample_weight is not None or keras_mask is not None):
      # Keras: the mask becomes the weight (`apply_mask`) where none was given, and divides by its sum
      value = _divide_no_nan(total, psum(jnp.sum(weight)))
    elif keras_mask is not None and reduction != "mean_with_sample_weight":  # Keras: sum / unmasked entries
      value = _divide_no_nan(total, psum(jnp.sum(mask.astype(dtype))))
    else:  # sum over the global batch's size: its real rows times each row's entries
      entries = int(np.prod(values.shape[1:], dtype=np.int64))
      value = total / (rows.n.astype(dtype) * entries)
    return (value * rows.replicas).astype(dtype)  # the replicas' mean is the global value


def _divide_no_nan(total: Any, divisor: Any) -> Any:
  """``total / divisor``, 0 where `divisor` is 0 (every weight 0, every entry masked), as Keras's
  ``ops.divide_no_nan``; its gradient is 0 there too, not NaN."""
  zero = divisor == 0
  return jnp.where(zero, jnp.zeros_like(total), total / jnp.where(zero, jnp.ones_like(divisor), divisor))


@contextlib.contextmanager
def _replica_losses(fit: _Fit, model: Any, rows: _Rows):
  """While a step is traced, each compiled loss of the model is a `_ReplicaLoss` (Keras's compiled loss
  keeps them in its private ``_flat_losses``, checked by `check_keras`)."""
  compiled: Any = getattr(model, "_compile_loss", None)
  flat = getattr(compiled, "_flat_losses", None)
  if not flat:
    yield
    return
  original = list(flat)
  compiled._flat_losses = [entry._replace(loss=_ReplicaLoss(fit, entry.loss, rows))  # noqa: SLF001
                           for entry in original]
  try:
    yield
  finally:
    compiled._flat_losses = original  # noqa: SLF001


@contextlib.contextmanager
def _forward_losses(fit: _Fit, model: Any):
  """While a step is traced, notes whether the model's own losses (``add_loss``, activity regularizers)
  depend on the batch: each replica computes them over its rows, padding rows included."""
  call = model.stateless_call

  def noted(*args: Any, **kwargs: Any) -> Any:
    result = call(*args, **kwargs)
    if kwargs.get("return_losses") and isinstance(result, tuple) and len(result) == 3:
      names = [i for i, loss in enumerate(result[2]) if REPLICA_AXIS in jax_compat.varying_axes(loss)]
      if names:
        fit.hazards.add(f"{len(names)} of the model's own losses (add_loss, activity_regularizer) depend on "
                        "the batch's rows, and each replica computes them over its rows, padding rows included")
    return result

  object.__setattr__(model, "stateless_call", noted)
  try:
    yield
  finally:
    model.__dict__.pop("stateless_call", None)


def _settle(model: Any, rows: _Rows, new: list[Any], given: dict[int, Any], folded: dict[int, Any]) -> list[Any]:
  """The non-trainable values after a step, the same on every replica: the seeds advanced (`settle_seeds`);
  every other value that differs between replicas combined by its Keras aggregation, a mean (batch norm's
  moving statistics, TF's ``ON_READ`` ``MEAN``) over the replicas that held real rows (a replica that
  holds none of a partial batch has no statistics to add)."""
  new = keras_models.settle_seeds(model, new, given, folded, aggregate=False)
  has_rows = (jnp.sum(rows.mask) > 0).astype(jnp.float32)
  holders = jax.lax.psum(has_rows, REPLICA_AXIS)
  replica = jax.lax.axis_index(REPLICA_AXIS)
  for i, variable in enumerate(model.non_trainable_variables):
    v = new[i]
    if i in given or REPLICA_AXIS not in jax_compat.varying_axes(v):
      continue
    if variable.aggregation == "sum":
      new[i] = jax.lax.psum(v, REPLICA_AXIS)
    elif variable.aggregation == "only_first_replica":
      new[i] = jax.lax.psum(jnp.where(replica == 0, v, jnp.zeros_like(v)), REPLICA_AXIS)
    elif jnp.issubdtype(v.dtype, jnp.floating):
      mean = jax.lax.psum(v.astype(jnp.float32) * has_rows, REPLICA_AXIS) / jnp.maximum(holders, 1.0)
      new[i] = mean.astype(v.dtype)
    else:
      raise ValueError(
          f"model.fit under a strategy: the non-trainable variable {variable.path} (dtype {v.dtype}) differs "
          "between replicas after a step and cannot be averaged; give it aggregation='sum' or "
          "'only_first_replica'.")
  return new


def _metrics_start(model: Any, metrics: list[Any]) -> list[Any]:
  """Each replica's metric variables before its update: 0 for those summed over the replicas (their
  increments are added to the value before the step), the value itself for the others."""
  return [jnp.zeros_like(v) if ref.aggregation == "sum" else v for ref, v in zip(model.metrics_variables, metrics)]


def _loss_tracker_variables(model: Any) -> set[int]:
  """The variables of the per-output loss trackers Keras's compiled loss keeps (multi-output models):
  Keras weighs each update by the replica's padded row count ``k``."""
  compiled = getattr(model, "_compile_loss", None)
  return {id(v) for m in (getattr(compiled, "metrics", None) or ()) for v in m.variables}


def _metrics_combine(model: Any, rows: _Rows, before: list[Any], after: list[Any]) -> list[Any]:
  """The replicas' metric variables combined by each variable's Keras aggregation (TF's SyncOnRead); the
  per-output loss trackers' increments reweighted from ``k`` rows to the replica's share ``n / N``."""
  replica = jax.lax.axis_index(REPLICA_AXIS)
  replicas = rows.replicas
  trackers = _loss_tracker_variables(model)
  reweigh = rows.n / (replicas * rows.k)
  out = []
  for ref, v0, v in zip(model.metrics_variables, before, after):
    if id(ref) in trackers:
      v = (v * reweigh).astype(v.dtype)
    if REPLICA_AXIS not in jax_compat.varying_axes(v):  # the same increment on every replica
      out.append(v0 + v * jnp.asarray(replicas, v.dtype) if ref.aggregation == "sum" else v)
    elif ref.aggregation == "sum":
      out.append(v0 + jax.lax.psum(v, REPLICA_AXIS))
    elif ref.aggregation == "only_first_replica":
      out.append(jax.lax.psum(jnp.where(replica == 0, v, jnp.zeros_like(v)), REPLICA_AXIS))
    else:
      out.append(jax.lax.pmean(v.astype(jnp.float32), REPLICA_AXIS).astype(v.dtype))
  return out


def _row_weight(rows: _Rows, y_pred: Any, sample_weight: Any) -> Any:
  """A compiled metric's sample weight with the padding rows at 0 (`keras_models.padding_weight`, which
  `strategy.run`'s metric updates share)."""
  return keras_models.padding_weight(rows.mask, y_pred, sample_weight)


@contextlib.contextmanager
def _weighted_metrics(model: Any, rows: _Rows, hazards: set[str]):
  """While a step is traced, every compiled metric (``compile(metrics=...)``, which Keras updates without
  sample weights, and ``weighted_metrics``) is updated with the padding rows weighted 0 (`_row_weight`):
  on the real rows the weights are Keras's own, so the numbers are one device's."""
  compiled = getattr(model, "_compile_metrics", None)
  # Each output's metrics (Keras's `MetricsList`, which passes its weight on to each of them): every metric
  # gets its own weight, per element for those that weigh elements (`keras_models.weighs_elements`).
  lists = [inner for name in ("_flat_metrics", "_flat_weighted_metrics")
           for m in (getattr(compiled, name, None) or ()) if m
           for inner in (m.metrics if isinstance(getattr(m, "metrics", None), list) else [m])]
  for m in lists:
    update = type(m).update_state

    def masked(y_true: Any, y_pred: Any, sample_weight: Any = None, _m: Any = m, _update: Any = update) -> Any:
      if sample_weight is None and y_true is not None and keras_models.weighs_elements(_m):
        weight = keras_models.element_padding_weight(_m, rows.mask, y_true)
      elif keras_models.reduces_batch(_m, y_true, y_pred):
        # One number per replica's batch, as Keras's one per global batch: their mean is Keras's on full
        # batches; a padded batch's padding rows are in it (warned).
        hazards.add(f"the metric {_m.name!r} computes one number for the whole batch (the model's output has "
                    "no feature axis, and the metric's function reduces the last one), so each replica's value "
                    "includes its padding rows")
        weight = sample_weight
      else:
        weight = _row_weight(rows, y_pred, sample_weight)
      return _update(_m, y_true, y_pred, sample_weight=weight)

    object.__setattr__(m, "update_state", masked)
  try:
    yield
  finally:
    for m in lists:
      m.__dict__.pop("update_state", None)


def _update_metrics(model: Any, rows: _Rows, metrics: list[Any], loss: Any, x: Any, y: Any, y_pred: Any,
                    weights: Any, hazards: set[str]) -> list[Any]:
  """Keras's ``_update_metrics_variables`` for one replica: the loss tracker weighs this replica's loss by
  its share of the global batch's real rows (``n / N``: summed, the tracker counts ``n`` rows, as Keras on
  one device), and every compiled metric sees the padding rows with weight 0. `weights` are the user's
  sample weights (or None), as Keras passes them; `hazards`: the fit's (`_weighted_metrics`)."""
  keras = keras_models.import_keras()
  with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics))) as scope:
    model._loss_tracker.update_state(loss, sample_weight=rows.n / rows.replicas)  # noqa: SLF001
    with _weighted_metrics(model, rows, hazards):
      model.compute_metrics(x, y, y_pred, weights)
  out = []
  for ref, value in zip(model.metrics_variables, metrics):
    new = scope.get_current_value(ref)
    out.append(value if new is None else new)
  return out


def _results(model: Any, metrics: list[Any]) -> Any:
  keras = keras_models.import_keras()
  with keras.StatelessScope(state_mapping=list(zip(model.metrics_variables, metrics))):
    return model.get_metrics_result()


def _train_step(fit: _Fit, state: Any, batch: Any) -> Any:
  model = fit.model()
  trainable, non_trainable, optimizer_vars, metrics = (list(s) for s in state)
  x, y, w = _unpack(batch)
  rows = _Rows(x, fit.replicas)
  non_trainable, given, folded = keras_models.fold_seeds(model, non_trainable)
  start = _metrics_start(model, metrics)

  def loss_fn(tv: Any) -> Any:
    # Each replica's loss is its share (the replicas' mean is the one-device loss): the gradient of the
    # mean, summed over the replicas by the program (w.r.t. replicated weights), is one device's.
    loss, aux = model.compute_loss_and_updates(tv, non_trainable, start, x, y, w, training=True,
                                               optimizer_variables=optimizer_vars)
    return loss / fit.replicas, aux

  with _replica_losses(fit, model, rows), _forward_losses(fit, model):
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
  unscaled, y_pred, new_non_trainable, new_metrics = aux
  new_non_trainable = _settle(model, rows, list(new_non_trainable), given, folded)
  trainable, optimizer_vars = model.optimizer.stateless_apply(optimizer_vars, grads, trainable)
  new_metrics = _update_metrics(model, rows, new_metrics, unscaled, x, y, y_pred, w, fit.hazards)
  new_metrics = _metrics_combine(model, rows, metrics, new_metrics)
  logs = _results(model, new_metrics)
  return (trainable, new_non_trainable, optimizer_vars, new_metrics), logs


def _test_step(fit: _Fit, state: Any, batch: Any) -> Any:
  model = fit.model()
  trainable, non_trainable, metrics = (list(s) for s in state)
  x, y, w = _unpack(batch)
  rows = _Rows(x, fit.replicas)
  folded_nt, given, folded = keras_models.fold_seeds(model, non_trainable)
  start = _metrics_start(model, metrics)
  with _replica_losses(fit, model, rows), _forward_losses(fit, model):
    _, aux = model.compute_loss_and_updates(trainable, folded_nt, start, x, y, w, training=False)
  unscaled, y_pred, new_non_trainable, new_metrics = aux
  new_non_trainable = _settle(model, rows, list(new_non_trainable), given, folded)
  new_metrics = _update_metrics(model, rows, new_metrics, unscaled, x, y, y_pred, w, fit.hazards)
  new_metrics = _metrics_combine(model, rows, metrics, new_metrics)
  return (trainable, new_non_trainable, new_metrics), _results(model, new_metrics)


def _predict_step(fit: _Fit, state: Any, batch: Any) -> Any:
  model = fit.model()
  trainable, non_trainable = (list(s) for s in state)
  x, _, _ = _unpack(batch)
  kwargs: dict[str, Any] = {"training": False} if model._call_has_training_arg else {}  # noqa: SLF001
  outputs, new_non_trainable, _ = keras_models.stateless_call(model, trainable, non_trainable, x, **kwargs)
  return (trainable, new_non_trainable), padding.per_example(outputs)


keras_models.ON_EXPORT.append(install)  # `keras_models.state` / `assign` wrap Keras's loops first
