"""A DLRM-style click model whose embedding tables are sharded by rows over the replicas.

What this example shows
-----------------------
A click-through-rate model in the style of DLRM (Naumov et al., 2019), trained with
`tpustrat.TPUStrategy` and `tpustrat.embedding` on synthetic click logs that it can learn:

* **eight categorical features, tables from 1e3 to 1e6 rows.** Each feature has its own table
  (1,000 to 1,000,000 rows of width 16), and `tpustrat.embedding.TPUEmbedding` splits every table into
  one contiguous block of rows per replica: with 8 replicas a table of ``V`` rows costs each device
  ``ceil(V / 8)`` rows (plus as many per optimizer slot), never the whole table. The small tables are
  all-gathered for the lookup (each block once per step), the larger ones all-gather the ids instead and
  get their rows back by a reduce-scatter: the embedding picks the layout per table from its size, with
  the same collectives for all eight tables as for one.
* **one sequence feature.** ``user_interests`` holds up to 10 ids per example (``[b, 10]``, ``-1`` as
  padding, some examples with none) and is a sequence feature (``FeatureConfig(max_sequence_length=10)``,
  as in TF): its activation is ``[b, 10, 16]``, one row per position, zeros for padding, and the model
  pools it itself (`pool_sequences`: the mean over the present ids, where attention over the positions
  would go); the gradient of each position goes back to its id's row. The other seven features hold one
  id per example, combined by ``sum`` (the id's row itself).
* **two optimizers, one step.** The dense part (a bottom MLP over 13 dense features and a top MLP over
  the concatenated activations, Flax NNX) is trained with Optax's Adam. The tables are trained by the
  embedding's own sparse optimizer (`tpustrat.embedding.Adam`, lazy as TF's: or `--embedding-optimizer
  adagrad`): `jax.value_and_grad` differentiates the loss with respect to the dense parameters *and
  the activations*, and `TPUEmbedding.apply_gradients` sends each example's activation gradient back
  to the rows of its ids (summed over duplicate ids and replicas), where only those rows and their
  optimizer slots change.
* **ids checked on the host.** Inside `strategy.run` the ids are traced and cannot be checked (an id
  outside the table would silently give a wrong activation), so the grain pipeline checks every batch
  with `TPUEmbedding.check_ids` before `strategy.experimental_distribute_dataset` splits it.
* **held-out AUC.** Predictions on a held-out split are gathered with `strategy.gather` and scored on
  the host (rank-based AUC, the Mann-Whitney U statistic), next to the AUC of the true click model that
  generated the labels: the best any model can do on this data.

The data: each feature's ids follow a Zipf-like law over its vocabulary (a few popular ids, a long
tail), scattered over the id space by a fixed permutation, as hashed ids are, so that the popular rows
do not all live on replica 0. A click is Bernoulli(sigmoid(true logit)), the true logit being a sum of
hidden per-id scores (one per feature; the mean over the ids of the multi-hot feature) plus a linear
function of the dense features: learnable, though rare ids are seen too seldom to learn their scores.

TensorFlow -> tpustrat
----------------------
In TensorFlow (TPUStrategy, `tf.tpu.experimental.embedding`)::

    table = tf.tpu.experimental.embedding.TableConfig(vocabulary_size=V, dim=16, combiner="mean")
    embedding = tf.tpu.experimental.embedding.TPUEmbedding(
        {"f": tf.tpu.experimental.embedding.FeatureConfig(table=table)},
        tf.tpu.experimental.embedding.Adam(learning_rate=0.01))

    def step(batch):
      activations = embedding.dequeue()
      with tf.GradientTape() as tape:
        tape.watch(activations)
        loss = tf.nn.compute_average_loss(per_example_loss(model, batch, activations), GLOBAL_BATCH)
      dense_grads, act_grads = tape.gradient(loss, (model.trainable_variables, activations))
      optimizer.apply_gradients(zip(dense_grads, model.trainable_variables))
      embedding.apply_gradients(act_grads)
    embedding.enqueue(next(iterator), training=True)
    strategy.run(step, args=(batch,))

Here (see `make_train_step`), the tables are state passed to and returned from the step::

    embedding = tpustrat.embedding.TPUEmbedding(features, tpustrat.embedding.Adam(0.01), strategy)
    state = {"params": params, "opt_state": tx.init(params), "embedding": embedding.build(seed)}

    def step(state, batch):
      activations = embedding.lookup(state["embedding"], batch["ids"])
      loss, (dense_grads, act_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
          state["params"], activations, batch)        # loss: sum(...) / GLOBAL_BATCH
      ...  # tx.update(dense_grads, ...): dense grads are already summed over replicas (replicated params)
      embedding_state = embedding.apply_gradients(state["embedding"], batch["ids"], act_grads)
    state, loss = strategy.run(step, args=(state, batch))

Run it::

    python examples/recommender.py                       # 8 emulated CPU devices unless accelerators exist
    python examples/recommender.py --steps 600 --vocab-scale 0.1   # tables 10x smaller, longer training
    python examples/recommender.py --embedding-optimizer adagrad   # the tables trained by Adagrad
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
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
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
from flax import nnx  # noqa: E402

import tpustrat  # noqa: E402

EMBEDDING_DIM = 16
NUM_DENSE = 13  # as Criteo's click logs, DLRM's benchmark
MAX_INTERESTS = 10  # ids per example of the multi-hot feature


@dataclasses.dataclass(frozen=True)
class Feature:
  """One categorical feature: its name (and its table's), its vocabulary, ids per example (1: one-hot)."""

  name: str
  vocabulary_size: int
  max_ids: int = 1

  @property
  def multi_hot(self) -> bool:
    return self.max_ids > 1


FEATURES = (
    Feature("site_category", 1_000),
    Feature("publisher", 3_000),
    Feature("advertiser", 10_000),
    Feature("campaign", 30_000),
    Feature("ad", 100_000),
    Feature("query", 300_000),
    Feature("user", 1_000_000),
    Feature("user_interests", 5_000, MAX_INTERESTS),
)


def scaled_features(vocab_scale: float) -> tuple[Feature, ...]:
  """`FEATURES` with every vocabulary multiplied by `vocab_scale` (at least 10 rows each)."""
  return tuple(dataclasses.replace(f, vocabulary_size=max(10, round(f.vocabulary_size * vocab_scale)))
               for f in FEATURES)


# ---------------------------------------------------------------------------------------------------
# Synthetic click logs
# ---------------------------------------------------------------------------------------------------


class ClickModel:
  """The hidden model that generates the data: Zipf-like ids, true per-id scores, Bernoulli clicks.

  The true logit of an example is ``bias + dense @ w + sum_f score_f(ids_f)``, where ``score_f`` is a
  hidden table (one number per id) and a multi-hot feature contributes the mean score of its ids.
  """

  def __init__(self, features: Sequence[Feature], seed: int = 0, zipf_exponent: float = 1.1,
               score_scale: float = 0.8, bias: float = -1.0) -> None:
    rng = np.random.default_rng([seed, 1])
    self.features = tuple(features)
    self.bias = bias
    self.dense_weights = rng.normal(0.0, 0.3, NUM_DENSE).astype(np.float32)
    self.cdfs, self.permutations, self.scores = [], [], []
    for f in self.features:
      p = np.arange(1, f.vocabulary_size + 1, dtype=np.float64) ** -zipf_exponent
      self.cdfs.append(np.cumsum(p / p.sum()))
      self.permutations.append(rng.permutation(f.vocabulary_size).astype(np.int32))  # popular ids, scattered
      self.scores.append(rng.normal(0.0, score_scale * (2.0 if f.multi_hot else 1.0),
                                    f.vocabulary_size).astype(np.float32))

  def _ids(self, i: int, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    rank = np.minimum(np.searchsorted(self.cdfs[i], rng.random(shape)), self.features[i].vocabulary_size - 1)
    return self.permutations[i][rank]

  def sample(self, num_examples: int, seed: int) -> dict[str, Any]:
    """`num_examples` examples: ``{"ids": {feature: int32 [n] or [n, L]}, "dense": [n, 13], "label": [n],
    "true_logit": [n]}`` (``true_logit``: what generated the label; the model never sees it)."""
    rng = np.random.default_rng([seed, 2])
    dense = rng.normal(size=(num_examples, NUM_DENSE)).astype(np.float32)
    logit = self.bias + dense @ self.dense_weights
    ids = {}
    for i, f in enumerate(self.features):
      if f.multi_hot:
        x = self._ids(i, rng, (num_examples, f.max_ids))
        present = np.arange(f.max_ids) < rng.integers(0, f.max_ids + 1, num_examples)[:, None]  # 0..L ids
        x = np.where(present, x, -1)
        total = np.sum(np.where(present, self.scores[i][np.maximum(x, 0)], 0.0), axis=1)
        logit = logit + total / np.maximum(present.sum(axis=1), 1)
      else:
        x = self._ids(i, rng, (num_examples,))
        logit = logit + self.scores[i][x]
      ids[f.name] = x.astype(np.int32)
    label = (rng.random(num_examples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return {"ids": ids, "dense": dense, "label": label, "true_logit": logit.astype(np.float32)}


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
  """The area under the ROC curve, rank-based: the Mann-Whitney U statistic over ``n_pos * n_neg``.

  The probability that a random positive scores above a random negative (ties count one half).
  """
  labels = np.asarray(labels).astype(bool)
  scores = np.asarray(scores, np.float64)
  n_pos = int(labels.sum())
  n_neg = labels.size - n_pos
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  order = np.argsort(scores, kind="mergesort")
  _, inverse, counts = np.unique(scores[order], return_inverse=True, return_counts=True)
  average_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based rank of each distinct score, ties averaged
  ranks = np.empty(scores.size)
  ranks[order] = average_rank[inverse]
  return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# ---------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------


def make_embedding(strategy: tpustrat.Strategy, features: Sequence[Feature], learning_rate: float,
                   optimizer: str = "adam") -> tpustrat.embedding.TPUEmbedding:
  """One table per feature, sharded by rows over the strategy's replicas.

  Trained by lazy Adam (only the rows looked up in a step, and their moments, change) or Adagrad.
  """
  configs = {}
  for f in features:
    table = tpustrat.embedding.TableConfig(vocabulary_size=f.vocabulary_size, dim=EMBEDDING_DIM,
                                           combiner="sum", name=f.name)
    # A multi-hot feature is a sequence feature: [b, max_ids, 16], pooled by the model (`pool_sequences`).
    configs[f.name] = tpustrat.embedding.FeatureConfig(table, max_sequence_length=f.max_ids if f.multi_hot else 0,
                                                       name=f.name)
  opt = {"adam": tpustrat.embedding.Adam, "adagrad": tpustrat.embedding.Adagrad}[optimizer](learning_rate)
  return tpustrat.embedding.TPUEmbedding(configs, opt, strategy)


class DLRM(nnx.Module):
  """The dense part: a bottom MLP over the dense features, a top MLP over it and the activations.

  DLRM's "cat" interaction: the bottom MLP's output and the eight activations are concatenated.
  """

  def __init__(self, num_sparse: int, *, rngs: nnx.Rngs) -> None:
    self.bottom1 = nnx.Linear(NUM_DENSE, 64, rngs=rngs)
    self.bottom2 = nnx.Linear(64, EMBEDDING_DIM, rngs=rngs)
    self.top1 = nnx.Linear(EMBEDDING_DIM * (num_sparse + 1), 128, rngs=rngs)
    self.top2 = nnx.Linear(128, 64, rngs=rngs)
    self.head = nnx.Linear(64, 1, rngs=rngs)

  def __call__(self, dense: jax.Array, activations: Sequence[jax.Array]) -> jax.Array:
    bottom = jax.nn.relu(self.bottom2(jax.nn.relu(self.bottom1(dense))))
    x = jnp.concatenate([bottom, *activations], axis=-1)
    x = jax.nn.relu(self.top2(jax.nn.relu(self.top1(x))))
    return self.head(x)[:, 0]  # the click logit


def create_dense_state(num_sparse: int, seed: int, learning_rate: float):
  """``(graphdef, {"params", "opt_state"}, tx)`` of the dense part, as in examples/classifier.py."""
  graphdef, params = nnx.split(nnx.jit(lambda rngs: DLRM(num_sparse, rngs=rngs))(nnx.Rngs(seed)))
  tx = optax.adam(learning_rate)
  return graphdef, {"params": params, "opt_state": jax.jit(tx.init)(params)}, tx


def pool_sequences(activations: dict[str, jax.Array], ids: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Each sequence feature's ``[b, L, 16]`` activation pooled to ``[b, 16]``: the mean over its present
  ids (padding positions are zero rows; an example with none gets zeros). The others pass as they are."""
  out = {}
  for name, act in activations.items():
    if act.ndim == 3:
      count = jnp.sum(ids[name] >= 0, axis=1, keepdims=True).astype(act.dtype)
      act = jnp.sum(act, axis=1) / jnp.maximum(count, 1.0)
    out[name] = act
  return out


def make_logits_fn(graphdef: nnx.GraphDef, feature_names: Sequence[str]) -> Callable[..., jax.Array]:
  def logits_fn(params: nnx.State, activations: dict[str, jax.Array], dense: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, params)(dense, [activations[name] for name in feature_names])
  return logits_fn


def make_train_step(embedding: tpustrat.embedding.TPUEmbedding, graphdef: nnx.GraphDef,
                    tx: optax.GradientTransformation, feature_names: Sequence[str], global_batch_size: int):
  """The per-replica step ``step(state, batch) -> (state, loss)`` for `strategy.run`."""
  logits_fn = make_logits_fn(graphdef, feature_names)

  def loss_fn(params, activations, batch):
    # pooled inside the differentiated function: each sequence position gets its own gradient
    logits = logits_fn(params, pool_sequences(activations, batch["ids"]), batch["dense"])
    # TF's `compute_average_loss`: over the GLOBAL batch, so that the replicas' shares add up to the mean.
    return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, batch["label"])) / global_batch_size

  def train_step(state: dict[str, Any], batch: dict[str, Any]) -> tuple[dict[str, Any], jax.Array]:
    activations = embedding.lookup(state["embedding"], batch["ids"])  # [b, 16] per feature ([b, 10, 16]: sequence)
    loss, (dense_grads, act_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        state["params"], activations, batch)
    # The dense parameters are replicated: their gradient is already summed over the replicas. The
    # activations are this replica's own: `apply_gradients` routes their gradients to the rows' owners
    # and sums them there, over every replica that looked the row up.
    updates, opt_state = tx.update(dense_grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    embedding_state = embedding.apply_gradients(state["embedding"], batch["ids"], act_grads)
    loss = tpustrat.get_replica_context().all_reduce("sum", loss)
    return {"params": params, "opt_state": opt_state, "embedding": embedding_state}, loss

  return train_step


def make_predict_step(embedding: tpustrat.embedding.TPUEmbedding, graphdef: nnx.GraphDef,
                      feature_names: Sequence[str]):
  """The per-replica step ``predict(state, batch) -> click logits [b]`` (marked per-example)."""
  logits_fn = make_logits_fn(graphdef, feature_names)

  def predict(state: dict[str, Any], batch: dict[str, Any]) -> jax.Array:
    activations = pool_sequences(embedding.lookup(state["embedding"], batch["ids"]), batch["ids"])
    return tpustrat.per_example(logits_fn(state["params"], activations, batch["dense"]))

  return predict


# ---------------------------------------------------------------------------------------------------
# Input pipeline and evaluation
# ---------------------------------------------------------------------------------------------------


def make_dataset(strategy: tpustrat.Strategy, embedding: tpustrat.embedding.TPUEmbedding,
                 data: dict[str, Any], global_batch_size: int) -> Any:
  """A grain dataset of global batches of ``{"ids", "dense", "label"}``, each batch's ids checked."""

  def check_ids(batch: dict[str, Any]) -> dict[str, Any]:
    embedding.check_ids(batch["ids"])  # a ValueError naming the feature and the id, on the host
    return batch

  inputs = {k: data[k] for k in ("ids", "dense", "label")}
  return strategy.experimental_make_numpy_dataset(inputs).batch(global_batch_size).map(check_ids)


def predict_logits(strategy: tpustrat.Strategy, predict: Callable[..., Any], state: dict[str, Any],
                   dataset: Any) -> np.ndarray:
  """The model's logits for every example of `dataset`, in order, gathered on the host."""
  state = strategy.experimental_mirror(state)  # placed once, not by `run` at every batch
  out = [strategy.gather(strategy.run(predict, args=(state, batch)), axis=0)
         for batch in strategy.experimental_distribute_dataset(dataset)]
  return np.concatenate([np.asarray(x) for x in jax.device_get(out)])


# ---------------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=300, help="training steps (one global batch each)")
  parser.add_argument("--global-batch-size", type=int, default=1024,
                      help="examples per step, over all replicas; a multiple of the replica count")
  parser.add_argument("--eval-batches", type=int, default=20, help="global batches of held-out examples")
  parser.add_argument("--vocab-scale", type=float, default=1.0,
                      help="multiplies every vocabulary size (at least 10 rows per table)")
  parser.add_argument("--learning-rate", type=float, default=2e-3, help="Adam learning rate (dense part)")
  parser.add_argument("--embedding-optimizer", choices=("adam", "adagrad"), default="adam",
                      help="the tables' optimizer: tpustrat.embedding.Adam (lazy) or Adagrad")
  parser.add_argument("--embedding-learning-rate", type=float, default=None,
                      help="the tables' learning rate (default: 1e-2 for Adam; 1.0 for Adagrad, whose "
                           "accumulators start at 0.1 while a row's gradient of the mean loss is ~1e-3)")
  parser.add_argument("--log-every", type=int, default=50, help="steps between loss reports")
  parser.add_argument("--seed", type=int, default=0, help="seed of the data, the tables and the model")
  parser.add_argument("--quiet", action="store_true", help="no progress bar and no printing")
  args = parser.parse_args(argv)
  for name in ("steps", "global_batch_size", "eval_batches", "log_every"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if args.embedding_learning_rate is None:
    args.embedding_learning_rate = 1.0 if args.embedding_optimizer == "adagrad" else 1e-2
  if not args.vocab_scale > 0:
    parser.error(f"--vocab-scale must be > 0, got {args.vocab_scale}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains the click model and evaluates its held-out AUC. Returns a summary dict."""
  args = parse_args(argv)
  strategy = tpustrat.TPUStrategy()
  quiet = args.quiet or jax.process_index() != 0
  say = (lambda *a: None) if quiet else tqdm.write
  n = strategy.num_replicas_in_sync
  if args.global_batch_size % n:
    raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of the {n} replicas; "
                     f"pick a multiple of {n}.")
  features = scaled_features(args.vocab_scale)
  names = [f.name for f in features]

  start = time.perf_counter()
  truth = ClickModel(features, seed=args.seed)
  train = truth.sample(args.steps * args.global_batch_size, seed=args.seed)
  held_out = truth.sample(args.eval_batches * args.global_batch_size, seed=args.seed + 1_000_003)

  embedding = make_embedding(strategy, features, args.embedding_learning_rate, args.embedding_optimizer)
  graphdef, state, tx = create_dense_state(len(features), args.seed, args.learning_rate)
  state["embedding"] = embedding.build(seed=args.seed)
  rows_per_device = {}
  for f in features:
    table = state["embedding"]["tables"][f.name]  # a ShardedVariable [V, 16] split by rows: a block per device
    assert table.shape == (f.vocabulary_size, EMBEDDING_DIM) and table.axis == 0
    rows_per_device[f.name] = int(strategy.experimental_local_results(table)[0].shape[0])
    assert rows_per_device[f.name] == embedding.rows_per_replica(f.name) == -(-f.vocabulary_size // n)
  total_rows, device_rows = sum(f.vocabulary_size for f in features), sum(rows_per_device.values())
  say(f"{strategy!r} on {jax.devices()[0].platform}: {len(features)} tables, {total_rows:,} rows x "
      f"{EMBEDDING_DIM} ({total_rows * EMBEDDING_DIM * 4 / 2**20:.1f} MiB), {device_rows:,} rows per device "
      f"({device_rows * EMBEDDING_DIM * 4 / 2**20:.1f} MiB, + as much per optimizer slot)")
  for f in features:
    kind = f"sequence of up to {f.max_ids} ids, pooled by the model" if f.multi_hot else "one id, sum"
    say(f"  {f.name:<15} {f.vocabulary_size:>9,} rows -> {rows_per_device[f.name]:>7,} per device ({kind})")
  say(f"{len(train['label']):,} training examples ({train['label'].mean():.1%} clicks), "
      f"{len(held_out['label']):,} held out; global batch {args.global_batch_size} "
      f"({args.global_batch_size // n} per replica)")

  train_step = make_train_step(embedding, graphdef, tx, names, args.global_batch_size)
  predict = make_predict_step(embedding, graphdef, names)
  held_out_ds = make_dataset(strategy, embedding, held_out, args.global_batch_size)
  auc_before = auc(held_out["label"], predict_logits(strategy, predict, state, held_out_ds))

  losses: list[Any] = []
  logged: list[tuple[int, float]] = []
  timed_start, timed_steps = None, 0
  dataset = strategy.experimental_distribute_dataset(
      make_dataset(strategy, embedding, train, args.global_batch_size))
  with tqdm(total=args.steps, unit="step", disable=quiet, leave=False) as bar:
    for step, batch in enumerate(dataset, start=1):
      state, loss = strategy.run(train_step, args=(state, batch), options=tpustrat.RunOptions(donate_argnums=0))
      losses.append(loss)
      if timed_start is None:  # throughput leaves out the first step, which compiles the program
        jax.block_until_ready(loss)
        timed_start = time.perf_counter()
      else:
        timed_steps += 1
      bar.update()
      if step % args.log_every == 0 or step == args.steps:
        # One host sync per report: the mean loss of the steps since the last one.
        since = logged[-1][0] if logged else 0
        window = jax.device_get([strategy.experimental_local_results(l)[0] for l in losses[since:]])
        logged.append((step, float(np.mean(window))))
        bar.set_postfix(loss=f"{logged[-1][1]:.4f}")
        say(f"step {step:5d}/{args.steps}: loss {logged[-1][1]:.4f}")
    jax.block_until_ready(state)
  elapsed = time.perf_counter() - timed_start
  examples_per_second = timed_steps * args.global_batch_size / elapsed if timed_steps else float("nan")

  logits = predict_logits(strategy, predict, state, held_out_ds)
  held_out_auc = auc(held_out["label"], logits)
  true_auc = auc(held_out["label"], held_out["true_logit"])
  say(f"held-out AUC {held_out_auc:.4f} (untrained {auc_before:.4f}; the true click model's {true_auc:.4f}); "
      f"{examples_per_second:,.0f} examples/s over {n} replicas, {time.perf_counter() - start:.0f} s in all")
  return {
      "num_replicas": n,
      "vocabulary_sizes": {f.name: f.vocabulary_size for f in features},
      "rows_per_device": rows_per_device,
      "steps": len(losses),
      "logged_losses": logged,
      "first_loss": logged[0][1],
      "final_loss": logged[-1][1],
      "held_out_auc": held_out_auc,
      "untrained_auc": auc_before,
      "true_auc": true_auc,
      "examples_per_second": examples_per_second,
  }


if __name__ == "__main__":
  main()
