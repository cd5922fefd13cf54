"""The embedding tables' optimizers: `SGD`, `Adagrad`, `Adam`, `FTRL` and `AdagradMomentum` (TF's
`tf.tpu.experimental.embedding` optimizers, the rules of `tpu_embedding_v2_utils.py`).

Each is a frozen dataclass with the slots it keeps per row (`slots`, `slot_initial_values`) and
``update(rows, slots, g, touched, step)``: one step of its rule on a block of rows (or the rows gathered
for a sparse update) from their summed gradients, `touched` saying which rows ids reached.
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


OPTIMIZERS = (SGD, Adagrad, Adam, FTRL, AdagradMomentum)


def updates_untouched_rows(opt: Any) -> bool:
  """Whether `opt` changes rows no id touched (non-lazy Adam): it then updates the whole block."""
  return bool(getattr(opt, "updates_untouched_rows", isinstance(opt, Adam) and not opt.lazy_adam))


def touched_matters(opt: Any) -> bool:
  """Whether `opt` updates a touched row whose gradient is zero (lazy Adam, FTRL, Adagrad with momentum):
  SGD and Adagrad leave it as it is, non-lazy Adam updates every row anyway."""
  return not (isinstance(opt, (SGD, Adagrad)) or updates_untouched_rows(opt))
