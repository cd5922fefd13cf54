"""Cross-replica batch normalisation: statistics summed within groups of replicas with `cross_replica_sum`.

What this example shows
-----------------------
Batch normalisation normalises a layer's activations with the mean and variance of the batch. Under data
parallelism each replica sees only its share of the global batch, and with small per-replica batches
(8 examples here) those statistics are noisy. Summing them over *all* replicas costs a global
all-reduce per layer; TF's TPU models (ResNet's ``num_shards_per_group``, EfficientNet) sum them over
*groups* of replicas instead, for example ``[[0, 1, 2, 3], [4, 5, 6, 7]]``: statistics of 32 examples,
and each all-reduce stays within a few neighbouring cores. This example:

* trains a small MLP with group batch normalisation on scikit-learn's digits, fed by a grain pipeline
  (`strategy.experimental_distribute_dataset`) and run many steps per compiled program
  (`strategy.experimental_run_steps`);
* computes each replica's sums ``(sum h, sum h**2, count)`` and adds them up within its group with one
  `tpustrat.ops.cross_replica_sum(..., group_assignment)`; the padding rows of partial batches are left
  out (`tpustrat.valid_mask`), so every group's statistics are exact even for the last batch;
* checks every group's mean and variance against numpy over exactly that group's examples (a full and
  a partial batch) before and after training, and evaluates on the test split with the moving averages;
* `--group-size 1` is per-replica batch norm (no communication), `--group-size 8` TF's
  `SyncBatchNormalization` (one group of every replica).

Moving averages: the groups' statistics differ, so each replica's running averages would too. Here they
are averaged over all replicas, weighted by the number of real examples of each group (a small
all-reduce per step), so they stay `Mirrored`: one set of inference statistics, the same on every
replica. (TF's TPU models let each replica keep its own and saved replica 0's.)

TensorFlow -> tpustrat
----------------------
TF (inside the function given to `strategy.run`, or a TPUEstimator model_fn)::

    group_assignment = [[0, 1, 2, 3], [4, 5, 6, 7]]
    sums = tf.compat.v1.tpu.cross_replica_sum(tf.stack([s1, s2, count]), group_assignment)

tpustrat (see `group_statistics`)::

    sums = tpustrat.ops.cross_replica_sum(jnp.concatenate([s1, s2, count]), group_assignment)

Same arguments, same meaning; the result differs between groups, so `strategy.run` returns it as a
`PerReplica` value. The gradient flows back through the grouped sum (the gradient of a grouped sum is
the grouped sum of the cotangents), so the normalisation is differentiated exactly as on one device
with the group's examples in one batch.

Why not flax's `nnx.BatchNorm(axis_name="replica", axis_index_groups=groups)`? It calls
``lax.pmean(..., axis_index_groups=groups)``, which JAX 0.10 rejects inside `jax.shard_map` (what
`strategy.run` compiles to) with a bare `NotImplementedError`. Without groups,
``nnx.BatchNorm(..., axis_name="replica")`` does work inside `strategy.run` (statistics over all replicas).

Run it::

    python examples/cross_replica_batchnorm.py                    # groups [[0, 1, 2, 3], [4, 5, 6, 7]]
    python examples/cross_replica_batchnorm.py --group-size 2     # groups [[0, 1], [2, 3], [4, 5], [6, 7]]
"""

from __future__ import annotations

import os

# Emulate 8 devices when JAX runs on the CPU (harmless on a TPU VM or GPU machine); this must happen
# before JAX initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

try:  # packages beyond tpustrat's own: its `examples` extra
  from sklearn.datasets import load_digits  # noqa: E402
  from sklearn.model_selection import train_test_split  # noqa: E402
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

NUM_FEATURES = 64
NUM_CLASSES = 10
HIDDEN = 64
EPSILON = 1e-5
MOMENTUM = 0.9

Groups = list[list[int]]


def consecutive_groups(num_replicas: int, group_size: int) -> Groups:
  """``[[0, .., g-1], [g, .., 2g-1], ...]``: TF's group assignment of consecutive replicas."""
  if group_size < 1 or num_replicas % group_size:
    raise ValueError(f"--group-size {group_size} must divide the {num_replicas} replicas.")
  return [list(range(s, s + group_size)) for s in range(0, num_replicas, group_size)]


def load_data(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
  """scikit-learn's 1,797 digits, standardised per pixel, split 80/20: ``(train, test)`` dicts of x and y."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
  return {"x": x_train, "y": y_train}, {"x": x_test, "y": y_test}


def init_state(seed: int) -> dict[str, Any]:
  """Parameters and the batch-norm moving averages, as numpy (plain arrays enter `run` replicated)."""
  rng = np.random.default_rng(seed)
  params = {
      "w1": (rng.normal(size=(NUM_FEATURES, HIDDEN)) / np.sqrt(NUM_FEATURES)).astype(np.float32),
      "b1": np.zeros(HIDDEN, np.float32),
      "gamma": np.ones(HIDDEN, np.float32),
      "beta": np.zeros(HIDDEN, np.float32),
      "w2": (rng.normal(size=(HIDDEN, NUM_CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32),
      "b2": np.zeros(NUM_CLASSES, np.float32),
  }
  stats = {"mean": np.zeros(HIDDEN, np.float32), "var": np.ones(HIDDEN, np.float32)}
  return {"params": params, "batch_stats": stats}


# ---------------------------------------------------------------------------------------------------
# Group batch normalisation
# ---------------------------------------------------------------------------------------------------


def group_statistics(h: jax.Array, mask: jax.Array, groups: Groups) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Mean and (biased) variance of ``h [k, H]`` over the real rows of every replica in this replica's group.

  One grouped all-reduce carries the three sums. Returns ``(mean [H], var [H], count [])``.
  """
  w = mask.astype(h.dtype)[:, None]
  local = jnp.concatenate([jnp.sum(w * h, axis=0), jnp.sum(w * h * h, axis=0), jnp.sum(w, axis=0)[:1]])
  total = ops.cross_replica_sum(local, groups)
  s1, s2, count = total[:HIDDEN], total[HIDDEN:2 * HIDDEN], total[2 * HIDDEN]
  n = jnp.maximum(count, 1.0)  # a group made only of padding (the end of the data) normalises nothing real
  mean = s1 / n
  return mean, jnp.maximum(s2 / n - mean * mean, 0.0), count


def normalize(h: jax.Array, mean: jax.Array, var: jax.Array, params: dict[str, jax.Array]) -> jax.Array:
  return (h - mean) * jax.lax.rsqrt(var + EPSILON) * params["gamma"] + params["beta"]


def hidden(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  return x @ params["w1"] + params["b1"]


def head(params: dict[str, jax.Array], h: jax.Array) -> jax.Array:
  return jax.nn.relu(h) @ params["w2"] + params["b2"]


def make_train_step(tx: optax.GradientTransformation, groups: Groups):
  """``step(state, batch) -> (state, metrics)``, one replica's part of a training step."""

  def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], dict]:
    ctx = tpustrat.get_replica_context()
    mask = tpustrat.valid_mask(batch["x"])
    # The loss is a mean over the real examples of the whole global batch (partial batches included).
    global_count = ctx.all_reduce("sum", jnp.sum(mask).astype(jnp.float32))

    def loss_fn(params: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
      h = hidden(params, batch["x"])
      mean, var, count = group_statistics(h, mask, groups)
      logits = head(params, normalize(h, mean, var, params))
      per_example = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
      correct = jnp.sum(mask & (jnp.argmax(logits, -1) == batch["y"]))
      return jnp.sum(jnp.where(mask, per_example, 0.0)) / global_count, (mean, var, count, correct)

    (loss, (mean, var, count, correct)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    # Moving averages: the groups' statistics averaged over all replicas, weighted by the groups' real
    # examples (a group of padding only, at the end of the data, counts for nothing), so that they stay
    # the same on every replica.
    def average(stat: jax.Array) -> jax.Array:
      return ctx.all_reduce("sum", count * stat) / ctx.all_reduce("sum", count)

    new_stats = jax.tree.map(lambda old, new: MOMENTUM * old + (1 - MOMENTUM) * average(new),
                             state["batch_stats"], {"mean": mean, "var": var})
    metrics = {"loss": ctx.all_reduce("sum", loss), "correct": ctx.all_reduce("sum", correct),
               "examples": global_count}
    return {"params": params, "opt_state": opt_state, "batch_stats": new_stats}, metrics

  return train_step


def eval_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
  """Correct predictions among this replica's real examples, normalised with the moving averages."""
  params, stats = state["params"], state["batch_stats"]
  logits = head(params, normalize(hidden(params, batch["x"]), stats["mean"], stats["var"], params))
  return jnp.sum(tpustrat.valid_mask(batch["x"]) & (jnp.argmax(logits, -1) == batch["y"]))


# ---------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------


def replica_rows(num_rows: int, num_replicas: int, per_replica: int | None = None) -> list[range]:
  """The rows of a batch each replica gets (`experimental_distribute_dataset`'s split).

  Replica ``r`` gets rows ``[r*k, (r+1)*k)``, ``k`` the per-replica size of the dataset's first batch
  (`per_replica`; by default this batch's, ``ceil(num_rows / num_replicas)``); in a shorter batch the
  last replicas get fewer rows, or none.
  """
  k = per_replica or -(-num_rows // num_replicas)
  return [range(min(r * k, num_rows), min((r + 1) * k, num_rows)) for r in range(num_replicas)]


def numpy_group_statistics(params: dict[str, Any], x: np.ndarray, groups: Groups, num_replicas: int,
                           per_replica: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per replica, the float64 mean and variance of the hidden activations of its group's examples."""
  h = x.astype(np.float64) @ np.asarray(params["w1"], np.float64) + np.asarray(params["b1"], np.float64)
  rows = replica_rows(len(x), num_replicas, per_replica)
  out: list[Any] = [None] * num_replicas
  for group in groups:
    examples = h[[i for r in group for i in rows[r]]]
    stats = (examples.mean(axis=0), examples.var(axis=0)) if len(examples) else (np.zeros(HIDDEN),) * 2
    for r in group:
      out[r] = stats
  return out


def check_group_statistics(strategy: tpustrat.Strategy, params: dict[str, Any],
                           batches: Sequence[dict[str, np.ndarray]], groups: Groups) -> float:
  """Asserts that every replica's batch-norm statistics are its group's, computed with numpy.

  `batches` are distributed as one dataset, so a shorter batch after the first is padded (its last
  replicas get fewer real rows, or none). Returns the largest absolute difference. The statistics are
  computed at full float32 precision: on a GPU, JAX's default float32 matrix products use TF32 (10 mantissa
  bits), which alone moves a mean by about 1e-4 from numpy's.
  """
  with jax.default_matmul_precision("float32"):
    return _check_group_statistics(strategy, params, batches, groups)


def _check_group_statistics(strategy: tpustrat.Strategy, params: dict[str, Any],
                            batches: Sequence[dict[str, np.ndarray]], groups: Groups) -> float:
  def stats_step(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    mean, var, _ = group_statistics(hidden(params, batch["x"]), tpustrat.valid_mask(batch["x"]), groups)
    return mean, var

  n = strategy.num_replicas_in_sync
  host_params = strategy.experimental_local_results(params)[0]  # Mirrored -> one copy; numpy -> itself
  per_replica = -(-len(batches[0]["x"]) // n)
  worst = 0.0
  for batch, dist in zip(batches, strategy.experimental_distribute_dataset(batches)):
    mean, var = strategy.run(stats_step, args=(params, dist))
    got = zip(strategy.experimental_local_results(mean), strategy.experimental_local_results(var))
    want = numpy_group_statistics(host_params, batch["x"], groups, n, per_replica)
    for r, ((gm, gv), (wm, wv)) in enumerate(zip(got, want)):
      for name, g, w in (("mean", gm, wm), ("variance", gv, wv)):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5,
                                   err_msg=f"replica {r}: batch-norm {name} differs from its group's "
                                           f"({len(batch['x'])}-example batch)")
        worst = max(worst, float(np.max(np.abs(np.asarray(g) - w))))
  return worst


def reference_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array], groups: Groups,
                   num_replicas: int) -> jax.Array:
  """The training loss on one device, no strategy: each group's examples normalised as one batch."""
  rows = replica_rows(batch["x"].shape[0], num_replicas)
  h = hidden(params, batch["x"])
  total = 0.0
  for group in groups:
    idx = np.array([i for r in group for i in rows[r]], np.int32)
    hg = h[idx]
    logits = head(params, normalize(hg, hg.mean(axis=0), hg.var(axis=0), params))
    total += jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"][idx]))
  return total / batch["x"].shape[0]


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------


def evaluate(strategy: tpustrat.Strategy, state: dict[str, Any], data: dict[str, np.ndarray],
             global_batch: int) -> float:
  dataset = strategy.experimental_make_numpy_dataset(data).batch(global_batch)  # last batch partial
  correct = sum(int(strategy.reduce("sum", strategy.run(eval_step, args=(state, batch)), axis=None))
                for batch in strategy.experimental_distribute_dataset(dataset))
  return correct / len(data["x"])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--group-size", type=int, default=None,
                      help="replicas whose batch-norm statistics are summed together (default: 4, or fewer "
                           "if 4 does not divide the replica count)")
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--global-batch-size", type=int, default=64)
  parser.add_argument("--steps-per-program", type=int, default=10,
                      help="steps compiled into one program (experimental_run_steps)")
  parser.add_argument("--learning-rate", type=float, default=1e-2, help="Adam learning rate")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quiet", action="store_true", help="no progress bar and no printing")
  args = parser.parse_args(argv)
  for name in ("epochs", "global_batch_size", "steps_per_program"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Checks the group statistics, trains, checks them again and evaluates. Returns a summary dict."""
  args = parse_args(argv)
  say = (lambda *a: None) if args.quiet else tqdm.write
  strategy = tpustrat.TPUStrategy()
  n = strategy.num_replicas_in_sync
  if args.group_size is None:
    args.group_size = math.gcd(4, n)
  try:
    groups = consecutive_groups(n, args.group_size)
  except ValueError as e:
    raise SystemExit(str(e)) from None
  train, test = load_data(args.seed)
  batches_per_epoch = -(-len(train["x"]) // args.global_batch_size)
  say(f"{strategy!r} on {jax.devices()[0].platform}: batch norm over groups {groups}; global batch "
      f"{args.global_batch_size} ({-(-args.global_batch_size // n)} per replica, "
      f"{-(-args.global_batch_size // n) * args.group_size} per group)")

  state: dict[str, Any] = init_state(args.seed)
  tx = optax.adam(args.learning_rate)
  state["opt_state"] = jax.jit(tx.init)(state["params"])
  train_step = make_train_step(tx, groups)

  # Statistics of a full batch and of a partial one after it (the end of the test split: padded, the
  # padding left out of the sums; the second group gets 8 real examples, on replica 4 only).
  partial = len(test["x"]) % args.global_batch_size or args.global_batch_size
  probes = [{k: v[:args.global_batch_size] for k, v in train.items()},
            {k: v[-partial:] for k, v in test.items()}]
  diff = check_group_statistics(strategy, state["params"], probes, groups)
  say(f"group statistics == numpy over each group's examples (full and {partial}-example batch; max |diff| "
      f"{diff:.1e})")

  losses, accuracies = [], []
  start, compiled_at, timed_steps = time.perf_counter(), None, 0
  with tqdm(total=args.epochs * batches_per_epoch, unit="step", disable=args.quiet, leave=False) as bar:
    for epoch in range(args.epochs):
      # A fresh shuffle every epoch; the last batch of the epoch is partial and is padded, not dropped.
      dataset = strategy.experimental_make_numpy_dataset(train).shuffle(seed=args.seed + epoch)
      iterator = iter(strategy.experimental_distribute_dataset(dataset.batch(args.global_batch_size)))
      epoch_metrics = []
      while True:
        try:
          state, metrics = strategy.experimental_run_steps(train_step, iterator, args.steps_per_program,
                                                           init=state, options=tpustrat.RunOptions(donate_argnums=0))
        except StopIteration:
          break
        epoch_metrics.append(metrics)
        steps = int(metrics["loss"].values[0].shape[0])
        if compiled_at is None:
          jax.block_until_ready(metrics)
          compiled_at = time.perf_counter()
        else:
          timed_steps += steps
        bar.update(steps)
      host = jax.device_get([{k: strategy.experimental_local_results(v)[0] for k, v in m.items()}
                             for m in epoch_metrics])
      loss = np.concatenate([m["loss"] for m in host])
      examples = np.concatenate([m["examples"] for m in host])
      correct = np.concatenate([m["correct"] for m in host])
      losses.append(float(np.sum(loss * examples) / np.sum(examples)))
      accuracies.append(float(np.sum(correct) / np.sum(examples)))
      bar.set_postfix(loss=f"{losses[-1]:.4f}")
      say(f"epoch {epoch + 1:3d}/{args.epochs}: loss {losses[-1]:.4f}, train accuracy {accuracies[-1]:.4f}")
  elapsed = time.perf_counter() - (compiled_at or start)

  diff = max(diff, check_group_statistics(strategy, state["params"], probes, groups))
  test_accuracy = evaluate(strategy, state, test, args.global_batch_size)
  examples_per_second = timed_steps * args.global_batch_size / elapsed if timed_steps else float("nan")
  say(f"group statistics == numpy after training too (max |diff| {diff:.1e}); test accuracy "
      f"{test_accuracy:.4f} ({len(test['x'])} examples, moving averages); {examples_per_second:,.0f} "
      f"examples/s over {n} replicas")
  return {
      "num_replicas": n,
      "groups": groups,
      "losses": losses,
      "final_loss": losses[-1],
      "train_accuracies": accuracies,
      "test_accuracy": test_accuracy,
      "max_stats_diff": diff,
      "examples_per_second": examples_per_second,
  }


if __name__ == "__main__":
  main()
