"""Expert parallelism: a mixture-of-experts layer whose tokens travel to their experts with `all_to_all`.

What this example shows
-----------------------
A Switch-Transformer style mixture-of-experts (MoE) layer, trained with `tpustrat.TPUStrategy`:

* **experts live on different replicas.** With ``E`` experts over ``N`` replicas, each replica holds
  ``E / N`` of them (``E >= N``), or, with fewer experts than replicas, the replicas form groups of ``E``
  and every group holds a full set (expert parallelism inside a group, data parallelism across groups).
  A replica's expert weights are a `PerReplica` value: each device holds only its own experts.
* **top-1 routing with a fixed capacity.** A replicated router picks one expert per token; each replica
  sends at most ``C`` tokens to each expert (XLA needs static shapes), the rest are dropped (their
  output is zero), as in the Switch Transformer.
* **tokens travel with `tpustrat.ops.all_to_all`.** Each replica packs its tokens into an
  ``[E, C, D]`` buffer (slot ``c`` of expert ``e``), and one all-to-all sends the rows of expert ``e`` to
  the replica that holds it; a second all-to-all brings the results back to the tokens' replicas.
  Both run within the expert groups (TF's `group_assignment`), and JAX differentiates through them
  (the transpose of an all-to-all is the reverse all-to-all), so expert gradients come back to the
  expert's replica.
* **a dense check.** The same layer computed densely on one device, without a strategy (every token
  through every expert, the routed one selected, the same capacity rule), gives the same outputs, loss
  and gradients; the example asserts it before and after training.
* many steps per compiled program (`strategy.experimental_run_steps`) fed by a grain pipeline
  (`strategy.experimental_distribute_dataset`), with a load-balancing auxiliary loss.

TensorFlow -> tpustrat
----------------------
TF's TPU MoE code (GShard, Mesh TensorFlow, Lingvo) calls the raw collective inside the replicated
step::

    expert_inputs = tf.raw_ops.AllToAll(input=dispatched, group_assignment=groups,
                                        concat_dimension=0, split_dimension=0, split_count=group_size)

Here, inside the function given to `strategy.run` (see `moe_layer`)::

    expert_inputs = tpustrat.ops.all_to_all(dispatched, groups, concat_dimension=0, split_dimension=0,
                                            split_count=group_size)

with the same argument order and meaning. Per-replica state (a replica's own experts) is a `PerReplica`
value carried through `strategy.run` (TF would keep a variable with a replica-indexed leading axis and
slice it with the replica id); the replicated router is `Mirrored`, and its gradient comes back summed
over replicas as for any replicated parameter. The gradient of an expert's weights, by contrast, is per
replica: it already holds every token routed to that expert from every replica of its group (through
the all-to-all's transpose). With data-parallel copies of the experts (``E < N``) it is summed over the
copies with `tpustrat.ops.cross_replica_sum` and a group assignment, as TF's `CrossReplicaSum`.

Run it::

    python examples/moe.py                      # 8 experts, one per replica, on 8 emulated CPU devices
    python examples/moe.py --num-experts 16     # two experts per replica
    python examples/moe.py --num-experts 4      # 2 groups of 4 replicas, each with all 4 experts
"""

from __future__ import annotations

import os

# Emulate 8 devices when JAX runs on the CPU (harmless on a TPU VM or GPU machine); this must happen
# before JAX initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

try:  # packages beyond tpustrat's own: its `examples` extra
  from tqdm.auto import tqdm  # noqa: E402
except ImportError as e:
  raise SystemExit(f"{e}. This example needs tpustrat's `examples` extra: "
                   "pip install 'tpustrat[examples]' (in a clone: pip install -e '.[examples]')") from e

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import tpustrat  # noqa: E402
from tpustrat import ops  # noqa: E402

MODEL_DIM = 16
HIDDEN_DIM = 32
AUX_LOSS_WEIGHT = 0.01  # Switch Transformer's load-balancing loss coefficient

# ---------------------------------------------------------------------------------------------------
# Where the experts live
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """How `num_experts` experts are spread over `num_replicas` replicas.

  Replicas form groups of `group_size` consecutive replicas (`groups`, TF's group assignment for the
  all-to-all); member ``i`` of every group holds experts ``[i * k, (i + 1) * k)``,
  ``k = experts_per_replica``. With several groups, replicas ``i, i + group_size, ...`` hold copies of
  the same experts (`copies`: the group assignment that sums their gradients).
  """

  num_experts: int
  num_replicas: int

  def __post_init__(self) -> None:
    e, n = self.num_experts, self.num_replicas
    if e < 1 or (e % n and n % e):
      raise ValueError(f"--num-experts {e} must be a multiple or a divisor of the {n} replicas.")

  @property
  def group_size(self) -> int:
    return min(self.num_experts, self.num_replicas)

  @property
  def experts_per_replica(self) -> int:
    return self.num_experts // self.group_size

  @property
  def groups(self) -> list[list[int]]:
    g = self.group_size
    return [list(range(start, start + g)) for start in range(0, self.num_replicas, g)]

  @property
  def copies(self) -> list[list[int]]:
    g = self.group_size
    return [list(range(i, self.num_replicas, g)) for i in range(g)]

  def experts_of(self, replica: int) -> slice:
    k = self.experts_per_replica
    member = replica % self.group_size
    return slice(member * k, (member + 1) * k)


def capacity(tokens_per_replica: int, num_experts: int, capacity_factor: float) -> int:
  """Slots per expert for the tokens of one replica: ``ceil(factor * tokens / experts)``."""
  return max(1, math.ceil(capacity_factor * tokens_per_replica / num_experts))


# ---------------------------------------------------------------------------------------------------
# Parameters and data
# ---------------------------------------------------------------------------------------------------


def init_params(num_experts: int, seed: int = 0) -> dict[str, np.ndarray]:
  """All the layer's weights, as one host copy (the dense layout): the router and every expert."""
  rng = np.random.default_rng(seed)
  d, h, e = MODEL_DIM, HIDDEN_DIM, num_experts
  return {
      "router": (rng.normal(size=(d, e)) * 0.1).astype(np.float32),
      "w1": (rng.normal(size=(e, d, h)) / np.sqrt(d)).astype(np.float32),
      "b1": np.zeros((e, h), np.float32),
      "w2": (rng.normal(size=(e, h, d)) / np.sqrt(h)).astype(np.float32),
      "b2": np.zeros((e, d), np.float32),
  }


def distribute_params(strategy: tpustrat.Strategy, layout: ExpertLayout, dense: dict[str, Any]) -> dict[str, Any]:
  """Places the dense weights: the router on every replica, each replica's own experts on its device."""
  experts = {k: np.asarray(v) for k, v in dense.items() if k != "router"}
  return {
      "router": jnp.asarray(dense["router"]),  # a plain array: `run` gives it whole to every replica
      "experts": strategy.experimental_distribute_values_from_function(
          lambda ctx: {k: v[layout.experts_of(ctx.replica_id_in_sync_group)] for k, v in experts.items()}),
  }


def gather_params(strategy: tpustrat.Strategy, layout: ExpertLayout, params: dict[str, Any]) -> dict[str, np.ndarray]:
  """The inverse of `distribute_params`: the dense weights on the host (experts from the first group)."""
  router = np.asarray(strategy.experimental_local_results(params["router"])[0])
  per_replica = strategy.experimental_local_results(params["experts"])
  experts = {k: np.concatenate([np.asarray(per_replica[r][k]) for r in layout.groups[0]])
             for k in per_replica[0]}
  return {"router": router, **experts}


def make_data(num_tokens: int, num_clusters: int, seed: int = 0) -> dict[str, np.ndarray]:
  """Tokens from `num_clusters` clusters; each cluster's target is its own nonlinear map of the token.

  A router that sends each cluster to its own expert lets each expert learn one map: the task MoE
  layers are good at.
  """
  rng = np.random.default_rng(seed + 1)
  d = MODEL_DIM
  centers = rng.normal(size=(num_clusters, d)) * 2.0
  maps = rng.normal(size=(num_clusters, d, d)) / np.sqrt(d)
  cluster = rng.integers(num_clusters, size=num_tokens)
  x = centers[cluster] + rng.normal(size=(num_tokens, d))
  y = np.tanh(np.einsum("td,tde->te", x, maps[cluster]))
  return {"x": x.astype(np.float32), "y": y.astype(np.float32)}


# ---------------------------------------------------------------------------------------------------
# The layer: routing, the two all-to-alls, the experts
# ---------------------------------------------------------------------------------------------------


def route(router: jax.Array, x: jax.Array, num_experts: int, cap: int) -> dict[str, jax.Array]:
  """Top-1 routing of one replica's tokens ``x [T, D]`` with `cap` slots per expert.

  Returns ``probs [T, E]`` (router softmax), ``expert [T]`` (chosen expert), ``gate [T]`` (its
  probability) and ``dispatch [T, E, C]``: 1 where token ``t`` takes slot ``c`` of expert ``e``. Tokens
  take their expert's slots in order; those beyond `cap` get none (dropped).
  """
  probs = jax.nn.softmax(x @ router, axis=-1)
  expert = jnp.argmax(probs, axis=-1)
  onehot = jax.nn.one_hot(expert, num_experts, dtype=x.dtype)  # [T, E]
  position = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot, axis=-1).astype(jnp.int32) - 1  # [T]
  slot = jax.nn.one_hot(position, cap, dtype=x.dtype)  # all zeros when position >= cap: dropped
  dispatch = onehot[:, :, None] * slot[:, None, :]
  gate = jnp.take_along_axis(probs, expert[:, None], axis=-1)[:, 0]
  return {"probs": probs, "expert": expert, "gate": gate, "dispatch": dispatch}


def expert_ffn(w: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  """Experts ``k`` applied to their own tokens: ``x [..., k, C, D] -> [..., k, C, D]`` with weights ``[k, ...]``."""
  h = jax.nn.relu(jnp.einsum("...ecd,edh->...ech", x, w["w1"]) + w["b1"][:, None, :])
  return jnp.einsum("...ech,ehd->...ecd", h, w["w2"]) + w["b2"][:, None, :]


def moe_layer(params: dict[str, Any], x: jax.Array, layout: ExpertLayout, cap: int) -> tuple[jax.Array, dict]:
  """The MoE layer on one replica's tokens ``x [T, D]``, inside `strategy.run`. Returns ``(y, routing)``."""
  r = route(params["router"], x, layout.num_experts, cap)
  g, k = layout.group_size, layout.experts_per_replica
  dispatched = jnp.einsum("tec,td->ecd", r["dispatch"], x)  # [E, C, D]: this replica's tokens, by expert
  # Block i of the expert axis (experts [i*k, (i+1)*k)) goes to member i of the group; the blocks received
  # are stacked by sender: [group member that sent them * k + local expert, C, D].
  received = ops.all_to_all(dispatched, layout.groups, concat_dimension=0, split_dimension=0, split_count=g)
  outputs = expert_ffn(params["experts"], received.reshape(g, k, cap, -1)).reshape(g * k, cap, -1)
  # The reverse trip: block i (the outputs for member i's tokens) goes home to member i.
  returned = ops.all_to_all(outputs, layout.groups, concat_dimension=0, split_dimension=0, split_count=g)
  combine = r["dispatch"] * r["gate"][:, None, None]
  return jnp.einsum("tec,ecd->td", combine, returned), r


def dense_moe_layer(params: dict[str, Any], x: jax.Array, num_replicas: int, num_experts: int,
                    cap: int) -> tuple[jax.Array, dict]:
  """The same layer on the whole global batch ``x [N*T, D]`` on one device: no strategy, no all-to-all.

  Every token goes through every expert and the routed expert's output is selected. Capacity is applied
  as in `moe_layer`: per expert, to each replica's tokens (consecutive blocks of ``T``).
  """
  routing = jax.vmap(lambda xs: route(params["router"], xs, num_experts, cap))(
      x.reshape(num_replicas, -1, x.shape[-1]))
  routing = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), routing)
  every = jnp.einsum("td,edh->teh", x, params["w1"]) + params["b1"]
  every = jnp.einsum("teh,ehd->ted", jax.nn.relu(every), params["w2"]) + params["b2"]  # [T, E, D]
  kept = jnp.sum(routing["dispatch"], axis=-1)  # [T, E]: one-hot of the expert, zero if dropped
  return jnp.einsum("te,ted->td", kept * routing["gate"][:, None], every), routing


def aux_loss_terms(routing: dict[str, jax.Array], num_experts: int) -> tuple[jax.Array, jax.Array]:
  """Per-expert token counts (not differentiated) and router probability sums of some tokens."""
  counts = jnp.sum(jax.nn.one_hot(routing["expert"], num_experts), axis=0)
  return jax.lax.stop_gradient(counts), jnp.sum(routing["probs"], axis=0)


def make_loss_fn(layout: ExpertLayout, cap: int, global_tokens: int):
  """This replica's share of the global loss: MSE over the global batch + the load-balancing loss.

  The Switch load-balancing loss is ``E * sum_e f_e * P_e`` (``f_e``: fraction of all tokens routed to
  expert ``e``; ``P_e``: their mean router probability). ``f`` needs every replica's counts (an
  all-reduce); ``P`` is a mean, so each replica contributes its tokens' share, like the MSE.
  """
  e = layout.num_experts

  def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    y, routing = moe_layer(params, batch["x"], layout, cap)
    mse = jnp.sum((y - batch["y"]) ** 2) / (global_tokens * MODEL_DIM)
    counts, prob_sums = aux_loss_terms(routing, e)
    fraction = tpustrat.get_replica_context().all_reduce("sum", counts) / global_tokens
    aux = AUX_LOSS_WEIGHT * e * jnp.sum(fraction * prob_sums) / global_tokens
    dropped = jnp.sum(1.0 - jnp.sum(routing["dispatch"], axis=(1, 2)))
    return mse + aux, {"mse": mse, "dropped": dropped, "counts": counts}

  return loss_fn


def dense_loss_fn(params: dict[str, Any], batch: dict[str, jax.Array], layout: ExpertLayout, cap: int) -> jax.Array:
  """The global loss of `make_loss_fn`, computed densely on one device."""
  y, routing = dense_moe_layer(params, batch["x"], layout.num_replicas, layout.num_experts, cap)
  t, e = batch["x"].shape[0], layout.num_experts
  counts, prob_sums = aux_loss_terms(routing, e)
  return jnp.mean((y - batch["y"]) ** 2) + AUX_LOSS_WEIGHT * e * jnp.sum((counts / t) * (prob_sums / t))


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------


def make_loss_and_grads(layout: ExpertLayout, cap: int, global_tokens: int):
  """``f(params, batch) -> ((loss, stats), grads)``, the gradients of the whole global loss."""
  grad_fn = jax.value_and_grad(make_loss_fn(layout, cap, global_tokens), has_aux=True)
  copies = layout.copies if layout.num_replicas > layout.group_size else None

  def loss_and_grads(params: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[Any, dict[str, Any]]:
    out, grads = grad_fn(params, batch)
    # The router is replicated: its gradient is already the sum over replicas. An expert's gradient is
    # this replica's (every token of its group routed to it); sum it over the data-parallel copies.
    if copies is not None:
      grads["experts"] = jax.tree.map(lambda g: ops.cross_replica_sum(g, copies), grads["experts"])
    return out, grads

  return loss_and_grads


def make_train_step(layout: ExpertLayout, tx: optax.GradientTransformation, cap: int, global_tokens: int):
  """``step(state, batch) -> (state, metrics)`` for `strategy.run` and `experimental_run_steps`."""
  loss_and_grads = make_loss_and_grads(layout, cap, global_tokens)

  def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict]:
    (loss, stats), grads = loss_and_grads(state["params"], batch)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    ctx = tpustrat.get_replica_context()
    metrics = {"loss": ctx.all_reduce("sum", loss), "mse": ctx.all_reduce("sum", stats["mse"]),
               "dropped": ctx.all_reduce("sum", stats["dropped"]),
               "counts": ctx.all_reduce("sum", stats["counts"])}
    return {"params": params, "opt_state": opt_state}, metrics

  return train_step


def check_against_dense(strategy: tpustrat.Strategy, layout: ExpertLayout, params: dict[str, Any],
                        batch: dict[str, np.ndarray], cap: int, rtol: float = 1e-4, atol: float = 1e-5) -> float:
  """Asserts that the distributed layer matches the dense one: outputs, loss and every gradient.

  Returns the largest absolute difference seen. Both sides compute at full float32 precision: on a GPU,
  JAX's default float32 matrix products use TF32 (10 mantissa bits), which alone differ by about 1e-3.
  """
  with jax.default_matmul_precision("float32"):
    return _check_against_dense(strategy, layout, params, batch, cap, rtol, atol)


def _check_against_dense(strategy: tpustrat.Strategy, layout: ExpertLayout, params: dict[str, Any],
                         batch: dict[str, np.ndarray], cap: int, rtol: float, atol: float) -> float:
  loss_and_grads = make_loss_and_grads(layout, cap, batch["x"].shape[0])

  def forward_and_grads(params: dict[str, Any], batch: dict[str, jax.Array]):
    (loss, _), grads = loss_and_grads(params, batch)
    y, _ = moe_layer(params, batch["x"], layout, cap)
    # y's rows are the batch's tokens (they went to their experts and came back in order): marked so.
    return tpustrat.per_example(y), tpustrat.get_replica_context().all_reduce("sum", loss), grads

  dist_batch = next(iter(strategy.experimental_distribute_dataset([batch])))
  y, loss, grads = strategy.run(forward_and_grads, args=(params, dist_batch))
  got_y = np.asarray(strategy.gather(y, axis=0))
  got_loss = float(strategy.experimental_local_results(loss)[0])
  got_grads = gather_params(strategy, layout, grads)

  dense_params = jax.tree.map(jnp.asarray, gather_params(strategy, layout, params))
  dense_batch = jax.tree.map(jnp.asarray, batch)
  want_y, _ = jax.jit(dense_moe_layer, static_argnums=(2, 3, 4))(
      dense_params, dense_batch["x"], layout.num_replicas, layout.num_experts, cap)
  want_loss, want_grads = jax.jit(jax.value_and_grad(dense_loss_fn), static_argnums=(2, 3))(
      dense_params, dense_batch, layout, cap)
  worst = 0.0
  for name, got, want in [("outputs", got_y, want_y), ("loss", got_loss, want_loss),
                          *((f"gradient of {k}", got_grads[k], want_grads[k]) for k in sorted(want_grads))]:
    np.testing.assert_allclose(got, np.asarray(want), rtol=rtol, atol=atol,
                               err_msg=f"expert-parallel {name} differ from the dense layer's")
    worst = max(worst, float(np.max(np.abs(np.asarray(got) - np.asarray(want)))))
  return worst


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--num-experts", type=int, default=None,
                      help="experts; a multiple of the replica count, or a divisor of it (default: 8 if "
                           "that fits the replicas, else one per replica)")
  parser.add_argument("--tokens-per-replica", type=int, default=32, help="tokens each replica routes per step")
  parser.add_argument("--capacity-factor", type=float, default=1.25,
                      help="slots per expert, as a multiple of the tokens a perfectly even router sends it")
  parser.add_argument("--steps", type=int, default=200, help="training steps")
  parser.add_argument("--steps-per-program", type=int, default=20,
                      help="steps compiled into one program (experimental_run_steps)")
  parser.add_argument("--learning-rate", type=float, default=1e-2, help="Adam learning rate")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quiet", action="store_true", help="no progress bar and no printing")
  args = parser.parse_args(argv)
  for name in ("num_experts", "tokens_per_replica", "steps", "steps_per_program"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.capacity_factor <= 0:
    parser.error(f"--capacity-factor must be > 0, got {args.capacity_factor}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Checks the layer against the dense one, trains it, checks again. Returns a summary dict."""
  args = parse_args(argv)
  say = (lambda *a: None) if args.quiet else tqdm.write
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  if args.num_experts is None:
    args.num_experts = 8 if 8 % n == 0 or n % 8 == 0 else n
  try:
    layout = ExpertLayout(args.num_experts, n)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  cap = capacity(args.tokens_per_replica, args.num_experts, args.capacity_factor)
  global_tokens = n * args.tokens_per_replica
  say(f"{strategy!r} on {jax.devices()[0].platform}: {args.num_experts} experts, {layout.experts_per_replica} "
      f"per replica, all-to-all groups {layout.groups}; {args.tokens_per_replica} tokens per replica, "
      f"capacity {cap} per expert")

  data = make_data(global_tokens * args.steps, args.num_experts, args.seed)
  dataset = strategy.experimental_make_numpy_dataset(data).batch(global_tokens)  # a grain MapDataset
  probe = {k: v[:global_tokens] for k, v in data.items()}

  dense = init_params(args.num_experts, args.seed)
  params = distribute_params(strategy, layout, dense)
  diff_before = check_against_dense(strategy, layout, params, probe, cap)
  say(f"expert-parallel layer == dense layer before training (outputs, loss, gradients; max |diff| "
      f"{diff_before:.1e})")

  tx = optax.adam(args.learning_rate)
  # The optimizer state is created per replica too: Adam's moments of a replica's experts live with them.
  state = {"params": params, "opt_state": strategy.run(tx.init, args=(params,))}
  train_step = make_train_step(layout, tx, cap, global_tokens)

  iterator = iter(strategy.experimental_distribute_dataset(dataset))
  metrics: list[Any] = []
  compiled_at, timed_from, done = None, 0, 0
  with tqdm(total=args.steps, unit="step", disable=args.quiet, leave=False) as bar:
    while done < args.steps:
      state, out = strategy.experimental_run_steps(
          train_step, iterator, min(args.steps_per_program, args.steps - done), init=state,
          options=tpustrat.RunOptions(donate_argnums=0))  # the old state's buffers hold the new one
      metrics.append(out)
      steps = int(out["loss"].values[0].shape[0])
      done += steps
      loss = float(np.asarray(strategy.experimental_local_results(out["loss"])[0])[-1])  # one sync per program
      if compiled_at is None:  # throughput leaves out the first program, which compiled the step
        compiled_at, timed_from = time.perf_counter(), done
      bar.update(steps)
      bar.set_postfix(loss=f"{loss:.4f}")
  elapsed = time.perf_counter() - compiled_at
  losses = np.concatenate([np.asarray(strategy.experimental_local_results(m["loss"])[0]) for m in metrics])
  dropped = np.concatenate([np.asarray(strategy.experimental_local_results(m["dropped"])[0]) for m in metrics])
  counts = np.asarray(strategy.experimental_local_results(metrics[-1]["counts"])[0])[-1]

  diff_after = check_against_dense(strategy, layout, state["params"], probe, cap)
  tokens_per_second = (done - timed_from) * global_tokens / elapsed if done > timed_from else float("nan")
  say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {done} steps; tokens dropped (over capacity): "
      f"{dropped[0] / global_tokens:.1%} at the start, {dropped[-1] / global_tokens:.1%} at the end")
  say(f"tokens per expert in the last step: {counts.astype(int).tolist()}")
  say(f"expert-parallel layer == dense layer after training (max |diff| {diff_after:.1e}); "
      f"{tokens_per_second:,.0f} tokens/s over {n} replicas")
  return {
      "num_replicas": n,
      "num_experts": args.num_experts,
      "experts_per_replica": layout.experts_per_replica,
      "groups": layout.groups,
      "capacity": cap,
      "steps": done,
      "losses": losses.tolist(),
      "initial_loss": float(losses[0]),
      "final_loss": float(losses[-1]),
      "dropped_fraction": (dropped / global_tokens).tolist(),
      "tokens_per_expert": counts.astype(int).tolist(),
      "max_dense_diff": max(diff_before, diff_after),
      "tokens_per_second": tokens_per_second,
  }


if __name__ == "__main__":
  main()
