"""A byte-level transformer language model, trained on the Python standard library's own source code.

What this example shows
-----------------------
A real model on real text, with nothing downloaded: a decoder-only transformer (Flax NNX + Optax) reads
bytes (a vocabulary of 256) and learns to predict the next one, on the ``*.py`` files that ship with
every Python (found through `sysconfig`), trained with `tpustrat.TPUStrategy`:

* **a grain pipeline.** The files are listed in sorted order (deterministic), split into training and
  validation *by file*, concatenated, and cut into fixed-length sequences; a grain `MapDataset`
  shuffles them with a seed (a new order each epoch) and batches them into global batches, which
  `strategy.experimental_distribute_dataset` splits over the replicas.
* **many steps per program.** `strategy.experimental_run_steps` runs ``--steps-per-program`` training
  steps as one compiled `lax.scan`: the host launches one program per ``k`` steps.
* **the loss over the global batch.** Each replica's loss is the sum of its tokens' cross-entropies
  divided by the *global* number of tokens (``global_batch * seq_len``), so the replicas' losses add up
  to the global mean; the validation loss is `strategy.reduce("sum", ...)` of the per-replica losses.
* **mixed precision.** ``--policy mixed_bfloat16`` (or ``--dtype bfloat16``) is
  `tpustrat.mixed_precision.Policy("mixed_bfloat16")`: the parameters and the optimizer stay float32, the
  forward and backward passes compute in bfloat16 (each layer casts its float32 parameters on use:
  Flax's ``dtype=policy.compute_dtype``, ``param_dtype=policy.variable_dtype``); the gradients come back
  float32 and `tpustrat.mixed_precision.all_reduce_gradients` adds them in the policy's reduce dtype,
  float32 (below). ``--policy mixed_float16`` computes in float16 and wraps the optimizer in
  `tpustrat.mixed_precision.LossScaleOptimizer` (dynamic loss scaling: an overflow skips the step on
  every replica and halves the scale).
* **gradient accumulation.** ``--gradient-accumulation-steps K`` splits each replica's batch into ``K``
  micro-batches inside the step (`tpustrat.accumulate_gradients`, Keras 3's
  ``gradient_accumulation_steps``): forward and backward one micro-batch at a time in a `lax.scan`, the
  gradients added up locally and communicated once, so the activations' memory is one micro-batch's and
  the numbers are the whole batch's (the loss divides by the global number of tokens, a constant). It
  works with ``--shard`` (the sharded parameters are then read whole once per step, not one layer at a
  time) and with every policy (with ``mixed_float16`` each micro-batch's loss is multiplied by the loss
  scale).
* **checkpoints that resume.** With ``--ckpt-dir``, `tpustrat.checkpoint.CheckpointManager` saves the
  training state *and the input position* at every evaluation; run the same command again and it
  continues at the saved step with the next batch: the numbers are those of an uninterrupted run.
* a progress bar in tokens per second, the validation loss every ``--eval-every`` steps, and at the end
  a sample from the model (temperature sampling from ``--prompt``, on the host, on one device).

Gradients: TensorFlow -> tpustrat
---------------------------------
In TensorFlow each replica differentiates its own loss and the optimizer all-reduces the gradients::

    with tf.GradientTape() as tape:
      loss = tf.nn.compute_average_loss(per_token_loss, global_batch_size=GLOBAL_BATCH * SEQ_LEN)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))   # all-reduce (SUM), then update

In tpustrat, `jax.grad` with respect to the replicated parameters *already* returns the sum over the
replicas (docs/coming_from_tensorflow.md, "Gradients: JAX's or TF's"). JAX places that sum where the
replicated parameter first meets per-replica data, which in bfloat16 is *after* the layer cast the
parameter to bfloat16: the all-reduce would then add bfloat16 gradients. So `make_train_step` asks for TF's semantics instead,
differentiating with respect to this replica's own copy of the parameters, still float32, then adding
them in the policy's reduce dtype::

    loss, grads = jax.value_and_grad(loss_fn)(tpustrat.local_copy(params), batch)   # this replica's
    grads = tpustrat.mixed_precision.all_reduce_gradients(grads, policy)             # float32 all-reduce

and applies the summed gradients directly (no second sum). In float32 both ways give the same numbers.
With loss scaling (``mixed_float16``) the first line is ``tx.value_and_grad(loss_fn, opt_state)(...)``
(the loss times the scale; the optimizer's ``update`` divides the gradients by it).

Run it::

    python examples/char_transformer.py                      # 8 emulated CPU devices unless accelerators exist
    python examples/char_transformer.py --ckpt-dir /tmp/chars    # stop it, run it again: it resumes
    python examples/char_transformer.py --policy mixed_bfloat16  # pays off on TPUs and GPUs (CPUs emulate it)
    python examples/char_transformer.py --policy mixed_float16   # float16 with dynamic loss scaling (GPUs)
    python examples/char_transformer.py --gradient-accumulation-steps 4   # 4 micro-batches per replica and step
    python examples/char_transformer.py --steps 1000 --layers 4 --temperature 0   # longer; a greedy sample
    python -m tpustrat.launch -n 2 -d 4 examples/char_transformer.py --steps 40
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
import functools  # noqa: E402
import pathlib  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

try:  # packages beyond tpustrat's own: its `examples` extra
  from tqdm.auto import tqdm  # noqa: E402
except ImportError as e:
  raise SystemExit(f"{e}. This example needs tpustrat's `examples` extra: "
                   "pip install 'tpustrat[examples]' (in a clone: pip install -e '.[examples]')") from e

import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import tpustrat  # noqa: E402

VOCAB_SIZE = 256  # bytes
MIN_FILE_BYTES = 1024  # shorter files (mostly empty `__init__.py`) are left out
VALIDATION_FRACTION = 0.05  # of the files

# ---------------------------------------------------------------------------------------------------
# Data: the standard library's source, as bytes
# ---------------------------------------------------------------------------------------------------


def stdlib_files(max_files: int | None = None) -> list[pathlib.Path]:
  """The standard library's ``*.py`` files of at least `MIN_FILE_BYTES`, sorted by relative path.

  Third-party packages (``site-packages``, ``dist-packages``) are not the standard library and are left
  out. With `max_files`, that many files evenly spaced over the sorted list (a sample of the whole
  library, not the first directory). The same Python gives the same list on every machine.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages", "__pycache__"}
  found = []
  for directory, subdirectories, names in os.walk(root):
    subdirectories[:] = [d for d in subdirectories if d not in skip]  # not walked at all
    for name in names:
      path = pathlib.Path(directory, name)
      if name.endswith(".py") and path.is_file() and path.stat().st_size >= MIN_FILE_BYTES:
        found.append((path.relative_to(root).as_posix(), path))
  files = [path for _, path in sorted(found)]
  if not files:
    raise SystemExit(f"No standard library source found under {root}.")
  if max_files is not None and max_files < len(files):
    files = [files[i * len(files) // max_files] for i in range(max_files)]
  return files


def split_files(files: Sequence[pathlib.Path]) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
  """``(train, validation)``: `VALIDATION_FRACTION` of the files (at least one), evenly spaced."""
  if len(files) < 2:
    raise SystemExit(f"Need at least 2 files (one for validation), got {len(files)}.")
  n_val = max(1, round(len(files) * VALIDATION_FRACTION))
  val_index = {(2 * i + 1) * len(files) // (2 * n_val) for i in range(n_val)}
  train = [f for i, f in enumerate(files) if i not in val_index]
  return train, [f for i, f in enumerate(files) if i in val_index]


def read_bytes(files: Sequence[pathlib.Path]) -> np.ndarray:
  """The files' bytes concatenated, as a uint8 array (the tokens)."""
  return np.frombuffer(b"".join(f.read_bytes() for f in files), np.uint8)


def num_sequences(data: np.ndarray, seq_len: int) -> int:
  """How many sequences `sequence(data, i, seq_len)` cuts from `data`."""
  return max(0, (len(data) - 1) // seq_len)


def sequence(data: np.ndarray, i: int, seq_len: int) -> dict[str, np.ndarray]:
  """Sequence `i`: inputs ``x`` = bytes ``[i*T, (i+1)*T)``, targets ``y`` = the same shifted by one."""
  start = i * seq_len
  return {"x": data[start:start + seq_len], "y": data[start + 1:start + seq_len + 1]}


def train_dataset(data: np.ndarray, seq_len: int, global_batch_size: int, seed: int) -> grain.MapDataset:
  """Global batches of shuffled training sequences, forever (each epoch in a new order)."""
  n = num_sequences(data, seq_len)
  if n < global_batch_size:
    raise SystemExit(f"The training text gives {n} sequences of {seq_len} bytes, fewer than one global batch "
                     f"of {global_batch_size}; raise --max-files.")
  return (grain.MapDataset.range(n).shuffle(seed=seed).repeat()
          .map(lambda i: sequence(data, i, seq_len))
          .batch(global_batch_size, drop_remainder=True))


def validation_dataset(data: np.ndarray, seq_len: int, global_batch_size: int,
                       max_batches: int) -> grain.MapDataset:
  """Up to `max_batches` global batches of validation sequences, evenly spaced over the validation text."""
  n = num_sequences(data, seq_len)
  batches = min(max_batches, n // global_batch_size)
  if batches == 0:
    raise SystemExit(f"The validation text gives {n} sequences of {seq_len} bytes, fewer than one global "
                     f"batch of {global_batch_size}; raise --max-files.")
  picked = np.linspace(0, n - 1, batches * global_batch_size).astype(np.int64)
  return (grain.MapDataset.source(picked).map(lambda i: sequence(data, int(i), seq_len))
          .batch(global_batch_size, drop_remainder=True))


# ---------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  """The transformer's shape and its mixed-precision policy (`tpustrat.mixed_precision.Policy` name)."""

  seq_len: int = 128
  layers: int = 3
  d_model: int = 128
  heads: int = 4
  policy: str = "float32"  # or "mixed_bfloat16", "mixed_float16": compute dtype / parameter dtype
  remat: bool = False  # recompute each block in the backward pass (sharded weights are gathered again)

  @property
  def dtype_policy(self) -> tpustrat.mixed_precision.Policy:
    return tpustrat.mixed_precision.Policy(self.policy)

  def layer_dtypes(self) -> dict[str, Any]:
    """Flax's ``dtype`` (compute) and ``param_dtype`` (variables) from the policy."""
    return {"dtype": self.dtype_policy.compute_dtype, "param_dtype": self.dtype_policy.variable_dtype}


def float16_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, mask: jax.Array | None = None,
                      **unused: Any) -> jax.Array:
  """Scaled dot-product attention for float16 compute, the softmax in float32 (no dropout: the model has
  none). Flax's default calls `jax.nn.dot_product_attention`, whose float16 matmuls ask for the
  ``F16_F16_F32`` algorithm, which XLA:CPU cannot compile (JAX 0.10.2)."""
  del unused
  logits = jnp.einsum("...qhd,...khd->...hqk", query / np.sqrt(query.shape[-1]).astype(query.dtype), key)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
  weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(value.dtype)
  return jnp.einsum("...hqk,...khd->...qhd", weights, value)


class Block(nnx.Module):
  """A pre-LayerNorm transformer block: causal self-attention, then a 4x MLP, each with a residual."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs) -> None:
    d, kw = config.d_model, {**config.layer_dtypes(), "rngs": rngs}
    self.ln1 = nnx.LayerNorm(d, **kw)
    extra = {"attention_fn": float16_attention} if config.dtype_policy.compute_dtype == jnp.float16 else {}
    self.attention = nnx.MultiHeadAttention(num_heads=config.heads, in_features=d, decode=False, **extra, **kw)
    self.ln2 = nnx.LayerNorm(d, **kw)
    self.mlp_in = nnx.Linear(d, 4 * d, **kw)
    self.mlp_out = nnx.Linear(4 * d, d, **kw)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    x = x + self.attention(self.ln1(x), mask=mask)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))


class Transformer(nnx.Module):
  """Decoder-only: byte and position embeddings, `layers` blocks, a final LayerNorm and a byte head.

  The blocks are stacked: ``blocks`` is one `Block` whose parameters have a leading layer axis, and the
  forward pass is a `lax.scan` over it (one compiled layer, however many layers). With sharded parameters
  (``--shard``) the scan body reads (all-gathers) one layer's weights at a time, and with
  ``Config.remat`` the backward pass gathers them again instead of keeping every gathered layer
  (`tpustrat.gather_again_policy`): per-layer gathering, as FSDP does it.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs) -> None:
    kw = {**config.layer_dtypes(), "rngs": rngs}
    init = nnx.initializers.normal(0.02)
    self.tokens = nnx.Embed(VOCAB_SIZE, config.d_model, embedding_init=init, **kw)
    self.positions = nnx.Embed(config.seq_len, config.d_model, embedding_init=init, **kw)
    # `layers` blocks initialised one after the other, then stacked on a leading layer axis.
    blocks = [nnx.split(Block(config, rngs=rngs)) for _ in range(config.layers)]
    self.blocks = nnx.merge(blocks[0][0], jax.tree.map(lambda *xs: jnp.stack(xs), *[s for _, s in blocks]))
    self.remat = config.remat
    self.ln_final = nnx.LayerNorm(config.d_model, **kw)
    self.head = nnx.Linear(config.d_model, VOCAB_SIZE, kernel_init=init, **kw)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """Next-byte logits ``[batch, T, 256]`` (compute dtype) for byte ids ``[batch, T]``, ``T <= seq_len``."""
    tokens = tokens.astype(jnp.int32)
    x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))
    mask = nnx.make_causal_mask(tokens)  # [batch, 1, T, T]: position t sees positions <= t
    block_def, stacked = nnx.split(self.blocks)

    def layer(x: jax.Array, params: nnx.State) -> tuple[jax.Array, None]:
      # One layer's parameters; sharded ones (blocks of [layers, ...] values) are gathered here, one layer
      # at a time. Plain arrays pass as they are.
      return nnx.merge(block_def, tpustrat.read_values(params))(x, mask), None

    if self.remat:
      layer = jax.checkpoint(layer, policy=tpustrat.gather_again_policy())
    x, _ = jax.lax.scan(layer, x, stacked)
    return self.head(self.ln_final(x))


@functools.partial(nnx.jit, static_argnums=0)  # one compiled program, not one per initialiser op
def _init_model(config: Config, rngs: nnx.Rngs) -> Transformer:
  return Transformer(config, rngs=rngs)


def make_model(config: Config, seed: int) -> tuple[nnx.GraphDef, nnx.State]:
  """``(graphdef, params)``: the model's static structure and its float32 parameters."""
  return nnx.split(_init_model(config, nnx.Rngs(seed)))


def make_optimizer(learning_rate: float, warmup_steps: int, decay_steps: int,
                   policy: str = "float32") -> optax.GradientTransformation:
  """AdamW with a linear warmup and a cosine decay to 10%, after clipping the gradient's global norm to 1;
  with a float16 policy, inside a `LossScaleOptimizer` (dynamic loss scaling, Keras's defaults)."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(warmup_steps, 1),
                                                max(decay_steps, warmup_steps + 1), learning_rate * 0.1)
  # tpustrat's clip: the norm of the whole gradient also when parameters are sharded (--shard), where
  # optax's would see each replica's blocks only; the same as optax's otherwise.
  tx = optax.chain(tpustrat.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=0.01))
  if tpustrat.mixed_precision.Policy(policy).compute_dtype == jnp.float16:
    tx = tpustrat.mixed_precision.LossScaleOptimizer(tx)  # clipping inside: it sees unscaled gradients
  return tx


def init_state(params: nnx.State, tx: optax.GradientTransformation) -> dict[str, Any]:
  """The training state: everything that changes during training, as one pytree."""
  return {"params": params, "opt_state": tx.init(params)}  # zeros, and a step count


def fsdp_partitioner(min_shard_bytes: int) -> Callable[..., int | None]:
  """Which parameters `--shard` splits, and along which axis: those of at least `min_shard_bytes`. The
  stacked blocks' parameters (``[layers, ...]``) split along their largest axis after the layer axis, so
  that the scan over layers reads one layer at a time; the others along axis 0 (`MinSizePartitioner`)."""
  big = tpustrat.MinSizePartitioner(min_shard_bytes=min_shard_bytes)

  def partition(path: tuple[Any, ...], shape: tuple[int, ...], dtype: Any) -> int | None:
    if big(path, shape, dtype) is None:
      return None
    if getattr(path[0], "key", None) == "blocks":
      return 1 + int(np.argmax(shape[1:])) if len(shape) > 1 else None
    return 0

  return partition


def sharded_state(strategy: tpustrat.Strategy, params: nnx.State, tx: optax.GradientTransformation,
                  min_shard_bytes: int) -> dict[str, Any]:
  """The training state with the parameters of at least `min_shard_bytes` split over the replicas (FSDP):
  the optimizer state, made from them inside `run`, is split the same way."""
  params = strategy.experimental_shard(params, fsdp_partitioner(min_shard_bytes))
  return {"params": params, "opt_state": strategy.run(tx.init, args=(params,))}


def read_outside_blocks(params: nnx.State) -> nnx.State:
  """`params` with the sharded parameters outside the stacked blocks read whole (`tpustrat.read_values`);
  the blocks' stay blocks, for the scan over layers to read one layer at a time."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if getattr(path[0], "key", None) == "blocks" else tpustrat.read_values(x), params,
      is_leaf=lambda x: isinstance(x, tpustrat.LocalShard))


def make_loss_fn(graphdef: nnx.GraphDef, global_batch_size: int) -> Callable[..., jax.Array]:
  """``loss_fn(params, batch)``: this replica's summed token cross-entropy / (global batch * seq_len).

  TF's ``compute_average_loss`` over the global number of tokens: the replicas' losses add up to the
  mean over the global batch (on one device, with the whole batch, it *is* that mean).
  """

  def loss_fn(params: nnx.State, batch: dict[str, jax.Array]) -> jax.Array:
    # Sharded parameters (--shard) are gathered whole here, the stacked blocks' one layer at a time inside
    # the model's scan; the gradient w.r.t. their blocks is then the block of the gradient summed over
    # replicas. Plain and Mirrored parameters pass as they are.
    logits = nnx.merge(graphdef, read_outside_blocks(params))(batch["x"]).astype(jnp.float32)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"].astype(jnp.int32))
    return jnp.sum(per_token) / (global_batch_size * batch["y"].shape[-1])

  return loss_fn


def loss_and_grads(tx: optax.GradientTransformation, loss_fn: Callable[..., jax.Array], state: dict[str, Any],
                   params: Any, batch: Any) -> tuple[jax.Array, Any]:
  """``(loss, grads)`` of `loss_fn` at `params`; with a `LossScaleOptimizer`, the gradients of the loss times
  the loss scale (its ``update`` divides them by it), and the loss itself unscaled."""
  if isinstance(tx, tpustrat.mixed_precision.LossScaleOptimizer):
    return tx.value_and_grad(loss_fn, state["opt_state"])(params, batch)
  return jax.value_and_grad(loss_fn)(params, batch)


def apply_gradients(tx: optax.GradientTransformation, state: dict[str, Any], grads: nnx.State) -> dict[str, Any]:
  """One optimizer step with gradients of the global mean loss."""
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    global_batch_size: int, sharded: bool = False, policy: str = "float32",
                    gradient_accumulation_steps: int = 1) -> Callable[..., Any]:
  """The per-replica step ``train_step(state, batch) -> (state, loss)`` for `run` / `experimental_run_steps`.

  ``loss`` is the global mean loss of the step (all-reduced, `Mirrored`). Create the step once: the
  compiled program is cached on the function. With ``gradient_accumulation_steps`` ``K > 1`` the gradients
  come from `tpustrat.accumulate_gradients` over ``K`` micro-batches of each replica's batch: the same
  numbers as ``K = 1``, the activations of one micro-batch at a time.
  """
  loss_fn = make_loss_fn(graphdef, global_batch_size)
  dtype_policy = tpustrat.mixed_precision.Policy(policy)
  scaled = isinstance(tx, tpustrat.mixed_precision.LossScaleOptimizer)

  def accumulated(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
    # The loss is a sum over tokens divided by the global token count (a constant), so the micro-batches'
    # losses and gradients add up to the whole batch's. With loss scaling each micro-batch's loss is
    # scaled (the gradients come back scaled, for `update` to unscale); the unscaled losses ride as `aux`.
    # W.r.t. the Mirrored parameters themselves: accumulate_gradients differentiates w.r.t. local copies
    # and all-reduces the float32 sums once (sharded ones: one reduce-scatter each).
    def micro_loss(params: Any, micro_batch: Any) -> tuple[jax.Array, jax.Array]:
      loss = loss_fn(params, micro_batch)
      return (tx.scale_loss(loss, state["opt_state"]) if scaled else loss), loss

    (_, losses), grads = tpustrat.accumulate_gradients(micro_loss, state["params"], batch, has_aux=True,
                                                      gradient_accumulation_steps=gradient_accumulation_steps)
    return jnp.sum(losses), grads

  def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array]:
    ctx = tpustrat.get_replica_context()
    # Data parallel: this replica's own gradients (TF's tape.gradient), float32 like the parameters they
    # belong to. (W.r.t. `state["params"]` itself JAX would sum them already, but in bfloat16, after each
    # layer's cast: see the module docstring.) FSDP (`sharded`): gradients come back summed over replicas
    # (the blocks reduce-scattered, the small Mirrored leaves all-reduced).
    if gradient_accumulation_steps > 1:
      loss, grads = accumulated(state, batch)  # already summed over replicas (all_reduce below passes them)
    else:
      params = state["params"] if sharded else tpustrat.local_copy(state["params"])
      loss, grads = loss_and_grads(tx, loss_fn, state, params, batch)
    # One all-reduce of the per-replica gradients in the policy's reduce dtype (float32); already-summed
    # ones pass as they are.
    grads = tpustrat.mixed_precision.all_reduce_gradients(grads, dtype_policy)
    return apply_gradients(tx, state, grads), ctx.all_reduce("sum", loss)

  return train_step


def make_eval_step(graphdef: nnx.GraphDef, global_batch_size: int) -> Callable[..., jax.Array]:
  """``eval_step(params, batch)``: this replica's share of the batch's mean loss (`PerReplica`): the loss."""
  return make_loss_fn(graphdef, global_batch_size)


def evaluate(strategy: tpustrat.Strategy, eval_step: Callable[..., Any], params: Any, dataset: Any) -> float:
  """The mean loss over the validation batches: per-replica shares summed by `strategy.reduce`."""
  params = strategy.experimental_mirror(params)  # placed once, not by `run` at every batch
  totals = [strategy.reduce("sum", strategy.run(eval_step, args=(params, batch)), axis=None)
            for batch in strategy.experimental_distribute_dataset(dataset)]
  return float(np.mean(jax.device_get(totals)))


def generate(graphdef: nnx.GraphDef, params: nnx.State, prompt: bytes, length: int, seq_len: int,
             temperature: float = 0.8, seed: int = 0) -> bytes:
  """`length` bytes sampled after `prompt` (temperature 0: greedy), on the device that holds `params`.

  One compiled loop: each new byte sees at most the last `seq_len` bytes (the model's context).
  """
  prompt = prompt or b"\n"
  total = len(prompt) + length
  buf = np.zeros(max(total, seq_len), np.int32)
  buf[:len(prompt)] = np.frombuffer(prompt, np.uint8)

  @jax.jit
  def sample(params: nnx.State, buf: jax.Array, key: jax.Array) -> jax.Array:
    model = nnx.merge(graphdef, params)

    def body(p, carry):  # writes byte p from the window of bytes [max(p - seq_len, 0), p)
      buf, key = carry
      start = jnp.maximum(p - seq_len, 0)
      window = jax.lax.dynamic_slice(buf, (start,), (seq_len,))  # positions >= p are masked (causal)
      logits = model(window[None])[0, p - start - 1].astype(jnp.float32)
      key, sub = jax.random.split(key)
      if temperature > 0:
        byte = jax.random.categorical(sub, logits / temperature)
      else:
        byte = jnp.argmax(logits)
      return buf.at[p].set(byte.astype(buf.dtype)), key

    return jax.lax.fori_loop(len(prompt), total, body, (buf, key))[0]

  out = np.asarray(sample(params, buf, jax.random.key(seed)))
  return bytes(out[:total].astype(np.uint8).tolist())


def host_params(strategy: tpustrat.Strategy, params: Any) -> Any:
  """The parameters on the host: the first copy of `Mirrored` ones, sharded ones whole."""
  sharded = lambda v: isinstance(v, tpustrat.ShardedVariable)  # noqa: E731
  whole = jax.tree.map(lambda v: jnp.asarray(np.asarray(v)) if sharded(v) else v, params, is_leaf=sharded)
  return strategy.experimental_local_results(whole)[0]


# ---------------------------------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--steps", type=int, default=300, help="training steps in all (a resumed run continues)")
  parser.add_argument("--steps-per-program", type=int, default=10,
                      help="steps compiled into one program (experimental_run_steps)")
  parser.add_argument("--seq-len", type=int, default=128, help="bytes per sequence (the model's context)")
  parser.add_argument("--global-batch-size", type=int, default=64,
                      help="sequences per step, over all replicas; a multiple of the replica count")
  parser.add_argument("--layers", type=int, default=3, help="transformer blocks")
  parser.add_argument("--d-model", type=int, default=128, help="model width")
  parser.add_argument("--heads", type=int, default=4, help="attention heads; must divide --d-model")
  parser.add_argument("--policy", choices=("float32", "mixed_bfloat16", "mixed_float16"), default=None,
                      help="mixed-precision policy (tpustrat.mixed_precision.Policy): compute dtype; parameters, "
                           "optimizer and gradient all-reduce stay float32; mixed_float16 adds loss scaling "
                           "(default: float32)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="the compute dtype, a shorthand for --policy float32 / mixed_bfloat16 / mixed_float16")
  parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak AdamW learning rate")
  parser.add_argument("--warmup-steps", type=int, default=30, help="linear learning-rate warmup")
  parser.add_argument("--decay-steps", type=int, default=None,
                      help="length of the warmup + cosine schedule (default: --steps); keep it fixed when a "
                           "resumed run goes on for more steps than the first, to get the same numbers")
  parser.add_argument("--eval-every", type=int, default=50,
                      help="steps between validation losses (and checkpoints, with --ckpt-dir)")
  parser.add_argument("--eval-batches", type=int, default=8, help="global batches of validation sequences")
  parser.add_argument("--ckpt-dir", default=None,
                      help="save checkpoints here at every evaluation; resume from the latest one if present")
  parser.add_argument("--max-files", type=int, default=None,
                      help="read only this many standard library files (evenly spaced; default: all)")
  parser.add_argument("--sample-len", type=int, default=300, help="bytes to sample at the end (0: none)")
  parser.add_argument("--prompt", default="def ", help="what the sample starts from")
  parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the initialisation, shuffle and sample")
  parser.add_argument("--quiet", action="store_true", help="no progress bar and no printing")
  parser.add_argument("--shard", action="store_true",
                      help="split the parameters and optimizer state over the replicas (FSDP)")
  parser.add_argument("--shard-min-bytes", type=int, default=64 << 10,
                      help="with --shard: parameters of at least this many bytes are split")
  parser.add_argument("--gradient-accumulation-steps", type=int, default=1,
                      help="micro-batches per replica and step (tpustrat.accumulate_gradients): the same numbers, "
                           "1/K of the activations' memory; must divide the per-replica batch")
  parser.add_argument("--remat", action="store_true",
                      help="recompute each block in the backward pass instead of keeping its activations "
                           "(with --shard: gather each layer's weights again, so one layer is whole at a time)")
  args = parser.parse_args(argv)
  for name in ("steps", "steps_per_program", "seq_len", "global_batch_size", "layers", "d_model", "heads",
               "eval_every", "eval_batches", "gradient_accumulation_steps"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  for name in ("warmup_steps", "sample_len"):
    if getattr(args, name) < 0:
      parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
  if args.max_files is not None and args.max_files < 2:
    parser.error(f"--max-files must be >= 2 (one file for validation), got {args.max_files}")
  if args.d_model % args.heads:
    parser.error(f"--heads {args.heads} does not divide --d-model {args.d_model}")
  if args.temperature < 0:
    parser.error(f"--temperature must be >= 0, got {args.temperature}")
  if args.decay_steps is None:
    args.decay_steps = args.steps
  from_dtype = {None: None, "float32": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}[args.dtype]
  if args.policy is not None and from_dtype is not None and args.policy != from_dtype:
    parser.error(f"--dtype {args.dtype} (policy {from_dtype}) contradicts --policy {args.policy}")
  args.policy = args.policy or from_dtype or "float32"
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Trains the model (resuming from --ckpt-dir if it holds a checkpoint) and samples from it.

  Returns a summary dict (see the end of this function).
  """
  args = parse_args(argv)
  wall_start = time.perf_counter()
  # In a multi-process job (`python -m tpustrat.launch ...`) every process runs this program, reads the
  # same files and iterates the same global batches; only process 0 reports.
  strategy = tpustrat.TPUStrategy()
  quiet = args.quiet or jax.process_index() != 0
  say = (lambda *a: None) if quiet else tqdm.write
  n = strategy.num_replicas_in_sync
  if args.global_batch_size % n:
    raise SystemExit(f"--global-batch-size {args.global_batch_size} is not a multiple of the {n} replicas; "
                     f"pick a multiple of {n}.")
  if (args.global_batch_size // n) % args.gradient_accumulation_steps:
    raise SystemExit(f"--gradient-accumulation-steps {args.gradient_accumulation_steps} does not divide the "
                     f"{args.global_batch_size // n} sequences per replica (--global-batch-size "
                     f"{args.global_batch_size} over {n} replicas).")
  config = Config(seq_len=args.seq_len, layers=args.layers, d_model=args.d_model, heads=args.heads,
                  policy=args.policy, remat=args.remat)

  train_files, val_files = split_files(stdlib_files(args.max_files))
  train_text, val_text = read_bytes(train_files), read_bytes(val_files)
  train_ds = train_dataset(train_text, args.seq_len, args.global_batch_size, args.seed)
  val_ds = validation_dataset(val_text, args.seq_len, args.global_batch_size, args.eval_batches)
  tokens_per_step = args.global_batch_size * args.seq_len
  say(f"{strategy!r} on {jax.devices()[0].platform}: {len(train_files)} training files "
      f"({len(train_text) / 1e6:.2f} MB), {len(val_files)} validation files ({len(val_text) / 1e6:.2f} MB, "
      f"{len(val_ds)} batches evaluated); global batch {args.global_batch_size} x {args.seq_len} bytes "
      f"({args.global_batch_size // n} sequences per replica"
      + (f", in {args.gradient_accumulation_steps} micro-batches" if args.gradient_accumulation_steps > 1 else "")
      + ")")

  graphdef, params = make_model(config, args.seed)
  tx = make_optimizer(args.learning_rate, args.warmup_steps, args.decay_steps, args.policy)
  # Mirrored from the start, as `experimental_run_steps` returns the state (and a restore target); with
  # --shard, the large parameters and their optimizer state split over the replicas.
  if args.shard:
    state = sharded_state(strategy, params, tx, args.shard_min_bytes)
  else:
    state = strategy.experimental_mirror(init_state(params, tx))
  num_params = sum(x.size for x in jax.tree.leaves(params))
  say(f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, {num_params:,} float32 "
      f"parameters, policy {args.policy} (computing in {config.dtype_policy.compute_dtype})")

  train_step = make_train_step(graphdef, tx, args.global_batch_size, sharded=args.shard, policy=args.policy,
                               gradient_accumulation_steps=args.gradient_accumulation_steps)
  eval_step = make_eval_step(graphdef, args.global_batch_size)
  iterator = iter(strategy.experimental_distribute_dataset(train_ds))

  manager, start = None, 0
  if args.ckpt_dir:
    manager = tpustrat.checkpoint.CheckpointManager(args.ckpt_dir, strategy, max_to_keep=2)
    if manager.latest_step() is not None:  # resume: the state and the position in the data
      start = manager.latest_step()
      state = manager.restore(target=state, iterator=iterator)
      say(f"resumed from {manager.directory} at step {start}")

  history = [(start, evaluate(strategy, eval_step, state["params"], val_ds))]
  say(f"step {start:5d}: validation loss {history[-1][1]:.4f}")
  losses: list[Any] = []
  step, timed_tokens, timed_seconds, segment_start = start, 0, 0.0, None
  with tqdm(total=max(args.steps - start, 0) * tokens_per_step, unit="tok", unit_scale=True, disable=quiet,
            leave=False) as bar:
    while step < args.steps:
      # Programs of `--steps-per-program` steps, ending at every evaluation (and at the last step).
      stop = min(args.steps, (step // args.eval_every + 1) * args.eval_every)
      k = min(args.steps_per_program, stop - step)
      state, out = strategy.experimental_run_steps(train_step, iterator, k, init=state,
                                                   options=tpustrat.RunOptions(donate_argnums=0))
      losses.append(out)
      step += k
      if segment_start is None:  # throughput leaves out the first program, which compiled the step
        jax.block_until_ready(out)
        segment_start = time.perf_counter()
      else:
        timed_tokens += k * tokens_per_step
      bar.update(k * tokens_per_step)
      if step == stop:
        train_loss = float(np.asarray(strategy.experimental_local_results(out)[0])[-1])  # waits for it
        timed_seconds += time.perf_counter() - segment_start
        history.append((step, evaluate(strategy, eval_step, state["params"], val_ds)))
        if manager is not None:
          manager.save(step, state, iterator=iterator)  # asynchronous: training goes on while it writes
        segment_start = time.perf_counter()
        bar.set_postfix(loss=f"{train_loss:.3f}", val=f"{history[-1][1]:.3f}")
        say(f"step {step:5d}: training loss {train_loss:.4f}, validation loss {history[-1][1]:.4f}")
  if manager is not None:
    manager.close()  # waits for the last save
  iterator.close()
  # Where the loop's time went (this process's; evaluation included): waiting for batches, waiting on the
  # devices (the bound on programs in flight), and the host's own work (dispatch, compiles, evaluation's sync).
  step_stats = strategy.experimental_step_stats()
  tokens_per_second = timed_tokens / timed_seconds if timed_tokens else float("nan")
  train_losses = ([float(x) for o in losses for x in np.asarray(strategy.experimental_local_results(o)[0])]
                  if losses else [])

  final_params = host_params(strategy, state["params"])
  sample = ""
  if args.sample_len:
    sample = generate(graphdef, final_params, args.prompt.encode(), args.sample_len, args.seq_len,
                      args.temperature, args.seed).decode("utf-8", errors="replace")
  seconds = time.perf_counter() - wall_start
  say(f"validation loss {history[0][1]:.4f} (step {history[0][0]}) -> {history[-1][1]:.4f} (step "
      f"{history[-1][0]}); {tokens_per_second:,.0f} tokens/s over {n} replicas; {seconds:.0f} s in all")
  say(f"training and evaluation loop: {step_stats}")
  loss_scale, skipped = None, 0
  if isinstance(tx, tpustrat.mixed_precision.LossScaleOptimizer):  # the scale and the steps it skipped
    opt = state["opt_state"]
    loss_scale = float(strategy.experimental_local_results(opt.loss_scale)[0])
    skipped = int(strategy.experimental_local_results(opt.skipped_steps)[0])
    say(f"loss scale {loss_scale:g}; {skipped} step(s) skipped on an overflow")
  if sample:
    say(f"sample (temperature {args.temperature}):\n{sample}")
  return {
      "num_replicas": n,
      "policy": args.policy,
      "gradient_accumulation_steps": args.gradient_accumulation_steps,
      "loss_scale": loss_scale,  # None without loss scaling
      "skipped_steps": skipped,
      "start_step": start,
      "steps": step,
      "train_losses": train_losses,  # one per step run by this call: steps start+1 .. steps
      "eval_history": history,  # (step, validation loss), first at the start step
      "initial_val_loss": history[0][1],
      "final_val_loss": history[-1][1],
      "tokens_per_step": tokens_per_step,
      "tokens_per_second": tokens_per_second,
      "step_stats": step_stats,  # tpustrat.StepStats
      "num_params": num_params,
      "train_files": len(train_files),
      "val_files": len(val_files),
      "sample": sample,
      "params": jax.tree.map(np.asarray, nnx.to_pure_dict(final_params)),
      "seconds": seconds,
  }


if __name__ == "__main__":
  main()
