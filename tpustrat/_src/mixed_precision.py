"""Mixed precision: a dtype policy (Keras's `mixed_precision.Policy`) and dynamic loss scaling for float16
(Keras's / TF's `LossScaleOptimizer`) as an optax transformation whose skip decision every replica shares.

* `Policy(name)`: the compute dtype, the variable (parameter) dtype and, tpustrat's addition, the dtype in
  which gradients are all-reduced (`reduce_dtype`: float32 for the mixed policies, so that ``N`` replicas'
  bfloat16 / float16 gradients are not added in 8 or 11 bits of mantissa).
* `all_reduce_gradients(grads, policy)`: TF's ``optimizer.apply_gradients`` all-reduce (SUM) of per-replica
  gradients (w.r.t. `tpustrat.local_copy(params)`) in the policy's reduce dtype, through the strategy's
  cross-device ops; gradients JAX has already summed (w.r.t. `Mirrored` parameters, and the blocks of
  sharded ones) pass as they are. Which is which is read from JAX's varying-axes type, never from values.
* `LossScaleOptimizer(tx)`: multiplies the loss by a scale (`scale_loss` / `value_and_grad`), and in
  ``update`` divides the gradients by it, checks them for inf / NaN, agrees on the answer over every
  replica (and so every process: it is one SPMD program), and either applies `tx` or skips the step
  (zero updates, `tx`'s state unchanged) and halves the scale. After ``dynamic_growth_steps`` finite steps
  in a row the scale doubles. The skip is a select, not a branch: `tx.update` runs on every replica
  whatever the answer, so collectives inside it (`sharded_optimizer`, `clip_by_global_norm`) never wait
  for a replica that took the other branch.

Why not build on a library: flax's `flax.training.dynamic_scale.DynamicScale` is a `value_and_grad`
wrapper, not an optax transformation; it does not skip the update itself, casts every gradient to float32,
averages with `pmean` (gradients w.r.t. `Mirrored` parameters are already summed here), checks finiteness
per replica, and grows the scale on the ``growth_interval + 1``-th finite step (Keras and TF on the
``dynamic_growth_steps``-th). optax's `apply_if_finite` skips non-finite steps but has no scale and checks
each replica's gradients on their own. DeepMind's jmp is unmaintained. The schedule here is TF's
`LossScaleOptimizer`'s, tested against a numpy reference (`tests/test_mixed_precision.py`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tpustrat._src.context import get_replica_context, replica_axis
from tpustrat._src.jax_compat import varying_axes
from tpustrat._src.names import REPLICA_AXIS
from tpustrat._src.sharded_variable import LocalShard
from tpustrat._src.validation import check_int, x64_enabled

__all__ = ["LossScaleOptimizer", "LossScaleState", "Policy", "all_finite", "all_reduce_gradients"]

# name: (compute dtype, variable dtype). Keras 3's floating-point policy names.
_POLICIES: dict[str, tuple[str, str]] = {
    "float32": ("float32", "float32"),
    "float64": ("float64", "float64"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float16": ("float16", "float16"),
    "mixed_bfloat16": ("bfloat16", "float32"),
    "mixed_float16": ("float16", "float32"),
}
_KNOWN = ", ".join(repr(n) for n in _POLICIES)
# The floating dtypes a policy casts; float64 (only on the devices with jax_enable_x64) is never narrowed.
_CASTABLE = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32))


def _device_dtype(x: Any) -> np.dtype | None:
  """The dtype `x` has (or gets) on the devices: float64 host arrays are float32 without x64, as in JAX.
  None for leaves that are not arrays (Python numbers stay as they are: JAX types them weakly)."""
  if not hasattr(x, "dtype"):
    return None
  return np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))


def _cast_floats(tree: Any, dtype: np.dtype) -> Any:
  def cast(x: Any) -> Any:
    d = _device_dtype(x)
    return x if d is None or d not in _CASTABLE or d == dtype else jnp.asarray(x).astype(dtype)
  return jax.tree.map(cast, tree)


class Policy:
  """A dtype policy (Keras's `keras.mixed_precision.Policy`): which dtype layers compute in, which dtype
  parameters are kept in, and (tpustrat's addition) which dtype gradients are all-reduced in.

  ===================  =============  ==============  ==============
  name                 compute_dtype  variable_dtype  reduce_dtype
  ===================  =============  ==============  ==============
  ``float32``          float32        float32         float32
  ``mixed_bfloat16``   bfloat16       float32         float32
  ``mixed_float16``    float16        float32         float32
  ``bfloat16``         bfloat16       bfloat16        float32
  ``float16``          float16        float16         float32
  ``float64``          float64        float64         float64
  ===================  =============  ==============  ==============

  ``float64`` needs ``jax_enable_x64`` (without it JAX computes in float32). float16 compute needs loss
  scaling (`LossScaleOptimizer`), as Keras's ``compile`` adds for ``mixed_float16``: float16's smallest
  normal number is 6e-5 and gradients below it flush to zero; bfloat16 has float32's range and does not.

  With flax, give the layers ``dtype=policy.compute_dtype, param_dtype=policy.variable_dtype``; for
  hand-written models, `cast_to_compute(params)` at the top of the forward pass.

  Args:
    name: one of the names above.
    reduce_dtype: overrides the dtype of the gradient all-reduce (e.g. ``"bfloat16"`` to halve the
      all-reduce's bytes at the cost of its precision); by default float32 (float64 for ``float64``).

  >>> policy = Policy("mixed_bfloat16")
  >>> policy
  <Policy "mixed_bfloat16">
  >>> policy.compute_dtype, policy.variable_dtype, policy.reduce_dtype
  (dtype(bfloat16), dtype('float32'), dtype('float32'))
  >>> tree = policy.cast_to_compute({"w": np.ones(2, np.float32), "ids": np.arange(2)})
  >>> tree["w"].dtype, tree["ids"].dtype
  (dtype(bfloat16), dtype('int64'))
  """

  def __init__(self, name: str, reduce_dtype: Any = None) -> None:
    if not isinstance(name, str):
      raise TypeError(f"Policy: `name` must be a policy name (str), one of {_KNOWN}; got "
                      f"{type(name).__name__} {name!r:.60}.")
    if name not in _POLICIES:
      raise ValueError(f"Policy: unknown policy name {name!r}; the known names are {_KNOWN}.")
    compute, variable = _POLICIES[name]
    if name == "float64" and not x64_enabled():
      raise ValueError("Policy: 'float64' needs jax_enable_x64 (jax.config.update('jax_enable_x64', True)); "
                       "without it JAX computes in float32, and the policy would claim a precision it does not "
                       "have.")
    if reduce_dtype is None:
      reduce_dtype = "float64" if name == "float64" else "float32"
    try:
      reduce = np.dtype(jnp.dtype(reduce_dtype))
    except TypeError as e:
      raise TypeError(f"Policy: `reduce_dtype` must be a floating-point dtype, got {reduce_dtype!r:.60}.") from e
    if not jnp.issubdtype(reduce, jnp.floating):
      raise ValueError(f"Policy: `reduce_dtype` must be a floating-point dtype (float32, bfloat16, ...), got "
                       f"{reduce}.")
    if reduce == np.dtype(np.float64) and not x64_enabled():
      raise ValueError("Policy: reduce_dtype float64 needs jax_enable_x64.")
    self._name = name
    self._compute = np.dtype(jnp.dtype(compute))
    self._variable = np.dtype(jnp.dtype(variable))
    self._reduce = reduce

  @property
  def name(self) -> str:
    """The policy's name, e.g. ``"mixed_bfloat16"``."""
    return self._name

  @property
  def compute_dtype(self) -> np.dtype:
    """The dtype layers compute in (Keras's name)."""
    return self._compute

  @property
  def variable_dtype(self) -> np.dtype:
    """The dtype parameters are kept in, and the optimizer updates (Keras's name)."""
    return self._variable

  @property
  def reduce_dtype(self) -> np.dtype:
    """The dtype `all_reduce_gradients` adds the replicas' gradients in (tpustrat's addition)."""
    return self._reduce

  def cast_to_compute(self, tree: Any) -> Any:
    """`tree` with its float16 / bfloat16 / float32 leaves cast to `compute_dtype`. Integer, boolean and
    complex leaves, Python numbers, and float64 leaves (which exist on the devices only with
    ``jax_enable_x64``, where they were asked for) are left as they are: a policy never narrows float64.
    Works on `LocalShard` blocks inside `run` and on distributed values outside it."""
    return _cast_floats(tree, self._compute)

  def cast_to_variable(self, tree: Any) -> Any:
    """`tree` with its float16 / bfloat16 / float32 leaves cast to `variable_dtype` (the same rules as
    `cast_to_compute`): e.g. freshly initialised parameters."""
    return _cast_floats(tree, self._variable)

  def __repr__(self) -> str:
    extra = "" if self._reduce == np.dtype(np.float64 if self._name == "float64" else np.float32) else (
        f", reduce_dtype={self._reduce}")
    return f'<Policy "{self._name}"{extra}>'

  def __eq__(self, other: object) -> bool:
    return isinstance(other, Policy) and (self._name, self._reduce) == (other._name, other._reduce)

  def __hash__(self) -> int:
    return hash((Policy, self._name, str(self._reduce)))


def _as_policy(policy: Policy | str | None, where: str) -> Policy:
  if policy is None:
    return Policy("float32")
  if isinstance(policy, str):
    return Policy(policy)
  if not isinstance(policy, Policy):
    raise TypeError(f"{where}: `policy` must be a tpustrat.mixed_precision.Policy or a policy name ({_KNOWN}), "
                    f"got {type(policy).__name__}.")
  return policy


def _bound_replica_axis() -> bool:
  """Whether the replica axis is bound here (inside `strategy.run`'s `shard_map`)."""
  try:
    jax.lax.axis_size(REPLICA_AXIS)
  except NameError:
    return False
  return True


def _is_float(x: Any) -> bool:
  dtype = jnp.result_type(x)
  return dtype != jax.dtypes.float0 and jnp.issubdtype(dtype, jnp.inexact)


def all_reduce_gradients(grads: Any, policy: Policy | str | None = None) -> Any:
  """Sums per-replica gradients over the replicas in `policy.reduce_dtype` (TF's
  ``optimizer.apply_gradients`` all-reduce), inside `strategy.run`.

  Each leaf is read from JAX's varying-axes type:

  * per-replica gradients (w.r.t. `tpustrat.local_copy(params)`, TF's ``tape.gradient``) are cast to the
    reduce dtype, summed in one `ReplicaContext.all_reduce` (the strategy's cross-device ops), and cast
    back to their own dtype: float32 gradients of a ``mixed_bfloat16`` model are added in float32, bfloat16
    gradients of a ``bfloat16`` model too (and come back bfloat16);
  * gradients already the same on every replica pass as they are: those w.r.t. the `Mirrored` parameters
    themselves (JAX has summed them, in the dtype the parameter met the per-replica data in: for a
    parameter cast to bfloat16 on use, in bfloat16; differentiate w.r.t. ``local_copy(params)`` to have
    the sum in the reduce dtype), and `LocalShard` blocks of sharded parameters (reduce-scattered by the
    backward pass of `read_value`);
  * float64 leaves are summed in float64 (never narrowed), integer / ``float0`` leaves pass as they are.

  With the default strategy (one replica, no axis) it returns `grads` unchanged.

  Args:
    grads: a pytree of gradients, inside the function given to `strategy.run`.
    policy: a `Policy` or a policy name; None is ``"float32"`` (a float32 all-reduce).

  Returns:
    `grads` summed over the replicas, each leaf in its own dtype, typed the same on every replica
    (`Mirrored`), blocks excepted.
  """
  policy = _as_policy(policy, "all_reduce_gradients")
  ctx = get_replica_context()
  if ctx is None:
    raise RuntimeError("all_reduce_gradients: called in cross-replica context (inside strategy.scope(), outside "
                       "strategy.run); call it inside the function given to strategy.run.")
  if replica_axis(ctx) is None:
    return grads
  leaves, treedef = jax.tree.flatten(grads, is_leaf=lambda x: isinstance(x, LocalShard))
  todo = [i for i, x in enumerate(leaves)
          if not isinstance(x, LocalShard) and _is_float(x) and REPLICA_AXIS in varying_axes(x)]
  if not todo:
    return grads
  reduce = policy.reduce_dtype

  def wire(x: Any) -> Any:
    return x if jnp.result_type(x) == np.dtype(np.float64) else jnp.asarray(x).astype(reduce)

  summed = ctx.all_reduce("sum", [wire(leaves[i]) for i in todo])
  out = list(leaves)
  for i, s in zip(todo, summed):
    out[i] = s.astype(jnp.result_type(leaves[i]))
  return jax.tree.unflatten(treedef, out)


def all_finite(tree: Any) -> jax.Array:
  """Whether every floating-point element of `tree` is finite, as one boolean scalar that every replica
  agrees on.

  Inside `strategy.run`, when any leaf differs between replicas (per-replica values, `LocalShard` blocks
  of sharded values) the replicas' answers are combined with one `lax.pmin` over the replica axis, so an
  inf on one replica makes the answer False on all of them; values the same on every replica need no
  communication (JAX types them so, and so is the answer). Across processes the step is one SPMD program:
  the answer is the same on every process too. Outside `run` it is the local answer.

  >>> bool(all_finite({"a": np.ones(3, np.float32), "b": np.array([1.0, np.inf], np.float32)}))
  False
  """
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if _is_float(x)]
  finite = jnp.asarray(True)
  for f in flags:
    finite = jnp.logical_and(finite, f)
  if _bound_replica_axis() and REPLICA_AXIS in varying_axes(finite):
    finite = jax.lax.pmin(finite.astype(jnp.int32), REPLICA_AXIS).astype(jnp.bool_)
  return finite


class LossScaleState(NamedTuple):
  """`LossScaleOptimizer`'s state: its own scalars, then the wrapped transformation's state."""

  loss_scale: jax.Array
  """float32 scalar: what `scale_loss` multiplies the loss by (Keras's ``dynamic_scale``)."""
  counter: jax.Array
  """int32 scalar: finite steps since the scale last changed (Keras's ``step_counter``, TF's ``dynamic_counter``)."""
  last_finite: jax.Array
  """bool scalar: whether the last update's gradients were finite (and so applied)."""
  skipped_steps: jax.Array
  """int32 scalar: how many updates were skipped in all."""
  inner_state: Any
  """The wrapped transformation's state."""


_DEFAULT_INITIAL_SCALE = 2.0 ** 15
_DEFAULT_GROWTH_STEPS = 2000


class LossScaleOptimizer(optax.GradientTransformationExtraArgs):
  """Dynamic loss scaling around an optax transformation (Keras's / TF's `LossScaleOptimizer`).

  ``LossScaleOptimizer(tx)`` is itself an `optax.GradientTransformation` (``init``, ``update``), with
  `scale_loss` and `value_and_grad` to scale the loss. In the step::

    loss, grads = lso.value_and_grad(loss_fn, opt_state)(tpustrat.local_copy(params), batch)  # grads scaled
    grads = tpustrat.mixed_precision.all_reduce_gradients(grads, policy)   # summed in float32
    updates, opt_state = lso.update(grads, opt_state, params)             # unscaled; applied or skipped
    params = optax.apply_updates(params, updates)

  ``update(grads, state, params)`` takes the gradients of the *scaled* loss (as Keras 3's ``apply``),
  divides them by the scale, and asks `all_finite` whether every element is finite, agreed over all
  replicas and processes. Then, with ``dynamic=True`` (TF's rules):

  * finite: `tx`'s updates are returned and its state advances; the counter goes up by one, and when it
    reaches ``dynamic_growth_steps`` the scale doubles (unless that would overflow float32) and the counter
    goes back to 0;
  * not finite: the step is skipped on every replica: zero updates (``apply_updates`` leaves the parameters
    as they are), `tx`'s state unchanged, the scale halved (not below 1, as TF's) and the counter 0.

  With ``dynamic=False`` the scale stays ``initial_scale`` and every update is applied (TF's fixed loss
  scale); `last_finite` still reports the check.

  `tx` runs on every replica whatever the answer (the skip is a select): collectives inside it cannot hang.
  Wrap the whole optimizer, clipping included (``LossScaleOptimizer(optax.chain(clip, adamw))``): a
  transformation outside it would see the scaled gradients.

  Gradients may be of any kind the library gives: all-reduced or already summed (the same on every
  replica: the check needs no communication), per replica (for a `tpustrat.sharded_optimizer` that sums
  them itself; the check adds one scalar `pmin`), or `LocalShard` blocks of sharded parameters (one scalar
  `pmin`: an overflow in one replica's block skips the step everywhere).

  Args:
    tx: the optax transformation to apply to the unscaled gradients (Keras's ``inner_optimizer``).
    initial_scale: the first loss scale, a finite number > 0; 2**15 as Keras's and TF's default.
    dynamic_growth_steps: finite steps in a row after which the scale doubles, an int >= 1; 2000.
    dynamic: False for a fixed scale (TF's ``dynamic=False``).

  Raises:
    TypeError: `tx` is not an optax transformation; `initial_scale` not a real number; growth steps not
      an int.
    ValueError: ``initial_scale <= 0``, not finite, or outside float32's normal range (the scale is a
      float32: 2**200 would be inf there); ``dynamic_growth_steps < 1``.

  >>> import optax
  >>> lso = LossScaleOptimizer(optax.sgd(0.5), initial_scale=1024.0, dynamic_growth_steps=2)
  >>> params = {"w": jnp.ones(2)}
  >>> state = lso.init(params)
  >>> loss, grads = lso.value_and_grad(lambda p: jnp.sum(p["w"] ** 2), state)(params)
  >>> float(loss), grads["w"].tolist()          # the loss unscaled, the gradients scaled by 1024
  (2.0, [2048.0, 2048.0])
  >>> updates, state = lso.update(grads, state, params)
  >>> updates["w"].tolist(), float(state.loss_scale), int(state.counter)
  ([-1.0, -1.0], 1024.0, 1)
  >>> updates, state = lso.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)   # an overflow: skipped
  >>> updates["w"].tolist(), float(state.loss_scale), int(state.counter), int(state.skipped_steps)
  ([0.0, 0.0], 512.0, 0, 1)
  """

  # NamedTuple subclasses keep a __dict__ for these (optax's fields stay `init` and `update`).
  inner: optax.GradientTransformation
  initial_scale: float
  dynamic_growth_steps: int
  dynamic: bool

  def __new__(cls, tx: optax.GradientTransformation, initial_scale: float = _DEFAULT_INITIAL_SCALE,
              dynamic_growth_steps: int = _DEFAULT_GROWTH_STEPS, dynamic: bool = True) -> LossScaleOptimizer:
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError(f"LossScaleOptimizer: `tx` must be an optax.GradientTransformation, got "
                      f"{type(tx).__name__}.")
    if isinstance(initial_scale, bool) or not isinstance(initial_scale, numbers.Real):
      raise TypeError(f"LossScaleOptimizer: `initial_scale` must be a number > 0, got "
                      f"{type(initial_scale).__name__} {initial_scale!r:.60}.")
    if not (math.isfinite(float(initial_scale)) and float(initial_scale) > 0):
      raise ValueError(f"LossScaleOptimizer: `initial_scale` must be a finite number > 0, got {initial_scale!r}; "
                       "the loss is multiplied by it (2**15 is Keras's and TF's default).")
    f32 = np.finfo(np.float32)
    if not float(f32.tiny) <= float(initial_scale) <= float(f32.max):
      raise ValueError(f"LossScaleOptimizer: `initial_scale` {initial_scale!r} is outside float32's normal range "
                       f"[{float(f32.tiny):.3g}, {float(f32.max):.3g}]; the scale is kept in float32, where it would "
                       "be inf (every step skipped, the halved scale still inf) or 0.")
    growth = check_int(dynamic_growth_steps, "LossScaleOptimizer", "dynamic_growth_steps", minimum=1)
    if not isinstance(dynamic, bool):
      raise TypeError(f"LossScaleOptimizer: `dynamic` must be a bool, got {type(dynamic).__name__}.")
    inner = optax.with_extra_args_support(tx)
    scale0 = float(initial_scale)

    def init(params: Any) -> LossScaleState:
      return LossScaleState(loss_scale=jnp.asarray(scale0, jnp.float32), counter=jnp.asarray(0, jnp.int32),
                            last_finite=jnp.asarray(True), skipped_steps=jnp.asarray(0, jnp.int32),
                            inner_state=inner.init(params))

    def update(grads: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, LossScaleState]:
      if not isinstance(state, LossScaleState):
        raise TypeError(f"LossScaleOptimizer.update: `state` must be the LossScaleState this optimizer's init "
                        f"made, got {type(state).__name__}.")
      scale = jnp.asarray(state.loss_scale, jnp.float32)
      grads = _unscale(grads, scale)
      finite = all_finite(grads)
      updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
      if not dynamic:
        return updates, state._replace(last_finite=finite, inner_state=inner_state)
      updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
      inner_state = jax.tree.map(_keep_if(finite), inner_state, state.inner_state)
      counter = jnp.asarray(state.counter, jnp.int32)
      grow = finite & (counter + 1 >= growth)
      doubled = scale * 2.0
      grown = jnp.where(grow & jnp.isfinite(doubled), doubled, scale)
      new_scale = jnp.where(finite, grown, jnp.maximum(scale / 2.0, 1.0))
      new_counter = jnp.where(finite & ~grow, counter + 1, 0).astype(jnp.int32)
      skipped = (jnp.asarray(state.skipped_steps, jnp.int32) + (~finite).astype(jnp.int32))
      return updates, LossScaleState(loss_scale=new_scale.astype(jnp.float32), counter=new_counter,
                                     last_finite=finite, skipped_steps=skipped, inner_state=inner_state)

    self = super().__new__(cls, init, update)
    self.inner = tx
    self.initial_scale = scale0
    self.dynamic_growth_steps = growth
    self.dynamic = dynamic
    return self

  def scale_loss(self, loss: Any, state: LossScaleState) -> jax.Array:
    """``loss * state.loss_scale`` (Keras's ``scale_loss``, TF's ``get_scaled_loss``), at least float32:
    differentiate this, and give the (scaled) gradients to ``update``."""
    loss = jnp.asarray(loss)
    dtype = jnp.promote_types(loss.dtype, jnp.float32)
    return loss.astype(dtype) * jnp.asarray(state.loss_scale).astype(dtype)

  def value_and_grad(self, fun: Callable[..., Any], state: LossScaleState, argnums: int | Sequence[int] = 0,
                     has_aux: bool = False) -> Callable[..., Any]:
    """`jax.value_and_grad` of `fun`'s loss times the loss scale: the returned function gives the loss
    unscaled (``(loss, aux)`` with `has_aux`) and the gradients *scaled*, for ``update`` to unscale."""

    def scaled(*args: Any, **kwargs: Any) -> Any:
      out = fun(*args, **kwargs)
      loss, aux = out if has_aux else (out, None)
      return self.scale_loss(loss, state), (loss, aux)

    grad_fn = jax.value_and_grad(scaled, argnums, has_aux=True)

    def value_and_scaled_grad(*args: Any, **kwargs: Any) -> Any:
      (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
      return ((loss, aux) if has_aux else loss), grads

    return value_and_scaled_grad

  def __repr__(self) -> str:
    return (f"LossScaleOptimizer(initial_scale={self.initial_scale:g}, dynamic_growth_steps="
            f"{self.dynamic_growth_steps}, dynamic={self.dynamic})")


def _unscale(grads: Any, scale: jax.Array) -> Any:
  """`grads` divided by `scale`, each floating leaf in at least float32 and back to its own dtype."""

  def one(g: Any) -> Any:
    if not _is_float(g):
      return g
    g = jnp.asarray(g)
    wide = jnp.promote_types(g.dtype, jnp.float32)
    return (g.astype(wide) / scale.astype(wide)).astype(g.dtype)

  return jax.tree.map(one, grads)


def _keep_if(finite: jax.Array) -> Callable[[Any, Any], Any]:
  """A leaf of the wrapped transformation's new state where `finite`, else the old one, in the new one's
  dtype (the state must keep its types for `experimental_run_steps`' carry)."""

  def select(new: Any, old: Any) -> Any:
    new = jnp.asarray(new)
    return jnp.where(finite, new, jnp.asarray(old).astype(new.dtype))

  return select
