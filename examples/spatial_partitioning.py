"""Spatial partitioning: a small CNN whose images are split across the logical devices of each replica.

What this example shows
-----------------------
TF's model parallelism on TPUs (`tf.distribute.experimental.TPUStrategy` with a `DeviceAssignment`) with
tpustrat, on 8 emulated CPU devices in two layouts:

* ``4x2``: ``computation_shape=[1, 1, 2], num_replicas=4``: 4 replicas (data parallel), each on 2
  logical devices that split every image in two along its height (``[1, 2, 1, 1]``);
* ``1x8``: ``computation_shape=[2, 2, 2], num_replicas=1``: one replica on 8 logical devices, images
  split 2 ways along the height and 4 along the width (``[1, 2, 4, 1]``, the example of TF's docs).

The step is TF's documented one::

    def step_fn(images, labels):
      images = strategy.experimental_split_to_logical_devices(images, [1, 2, 4, 1])
      output = model(images)          # XLA runs the convolutions on the tiles (with halo exchanges)
      labels = strategy.experimental_replicate_to_logical_devices(labels)
      output = strategy.experimental_replicate_to_logical_devices(output)
      loss = loss_fn(labels, output)

with the model in plain `jax.lax` (two 3x3 convolutions, average pooling over 2 x 4 regions, a dense
head), the
parameters `Mirrored` across replicas, SGD on the mean loss over the global batch. Both layouts compute
the same thing as one device would: the losses agree with `reference_losses` (one device, no strategy).

Run it::

    python examples/spatial_partitioning.py                    # both layouts, 20 steps
    python examples/spatial_partitioning.py --layout 1x8 --steps 50
"""

from __future__ import annotations

import os

# Emulate 8 devices when JAX runs on the CPU (harmless elsewhere); must be set before JAX starts.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse  # noqa: E402
import math  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import tpustrat  # noqa: E402

HEIGHT, WIDTH, CHANNELS = 16, 32, 3
NUM_CLASSES = 4
GLOBAL_BATCH = 16
FILTERS = 8

# layout -> (computation_shape, num_replicas, partition_dimensions of a [batch, H, W, C] image batch)
LAYOUTS = {
    "4x2": ([1, 1, 2], 4, [1, 2, 1, 1]),
    "1x8": ([2, 2, 2], 1, [1, 2, 4, 1]),
}


def make_data(num_batches: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
  """Noisy images whose label is the brightest quadrant, as global batches."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(num_batches):
    labels = rng.integers(0, NUM_CLASSES, size=GLOBAL_BATCH)
    images = rng.normal(0.0, 0.5, size=(GLOBAL_BATCH, HEIGHT, WIDTH, CHANNELS)).astype(np.float32)
    for i, label in enumerate(labels):
      r, c = divmod(int(label), 2)
      images[i, r * HEIGHT // 2:(r + 1) * HEIGHT // 2, c * WIDTH // 2:(c + 1) * WIDTH // 2] += 0.15
    batches.append({"images": images, "labels": labels.astype(np.int32)})
  return batches


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)

  def glorot(*shape: int) -> np.ndarray:
    fan_in, fan_out = int(np.prod(shape[:-1])), shape[-1]
    return (rng.normal(size=shape) * np.sqrt(2.0 / (fan_in + fan_out))).astype(np.float32)

  return {"conv1": glorot(3, 3, CHANNELS, FILTERS), "b1": np.zeros(FILTERS, np.float32),
          "conv2": glorot(3, 3, FILTERS, FILTERS), "b2": np.zeros(FILTERS, np.float32),
          "dense": glorot(8 * FILTERS, NUM_CLASSES), "b3": np.zeros(NUM_CLASSES, np.float32)}


def model(params: dict[str, jax.Array], images: jax.Array) -> jax.Array:
  """Logits ``[batch, NUM_CLASSES]`` of a [batch, H, W, C] image batch."""
  def conv(x: jax.Array, kernel: jax.Array, bias: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + bias)

  h = conv(conv(images, params["conv1"], params["b1"]), params["conv2"], params["b2"])
  b = h.shape[0]
  pooled = h.reshape(b, 2, HEIGHT // 2, 4, WIDTH // 4, FILTERS).mean(axis=(2, 4))  # 2 x 4 regions
  return pooled.reshape(b, 8 * FILTERS) @ params["dense"] + params["b3"]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1)[:, 0]


def make_strategy(layout: str) -> tuple[tpustrat.TPUStrategy, list[int]]:
  """TF's set-up: resolver, connect, topology, device assignment, strategy."""
  computation_shape, num_replicas, partition = LAYOUTS[layout]
  resolver = tpustrat.cluster_resolver.TPUClusterResolver(tpu="")
  tpustrat.experimental_connect_to_cluster(resolver)
  topology = tpustrat.initialize_tpu_system(resolver)
  device_assignment = tpustrat.DeviceAssignment.build(
      topology, computation_shape=computation_shape, num_replicas=num_replicas)
  return tpustrat.TPUStrategy(resolver, device_assignment=device_assignment), partition


def make_train_step(strategy: tpustrat.TPUStrategy, partition: list[int], learning_rate: float) -> Any:
  def train_step(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
    def loss_fn(params: dict[str, jax.Array]) -> jax.Array:
      images = strategy.experimental_split_to_logical_devices(batch["images"], partition)
      logits = model(params, images)
      labels = strategy.experimental_replicate_to_logical_devices(batch["labels"])
      logits = strategy.experimental_replicate_to_logical_devices(logits)
      return jnp.sum(cross_entropy(logits, labels)) / GLOBAL_BATCH  # this replica's share of the mean

    loss, grads = jax.value_and_grad(loss_fn)(params)  # grads w.r.t. Mirrored params: summed over replicas
    new_params = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
    return new_params, tpustrat.get_replica_context().all_reduce("sum", loss)

  return train_step


def describe_layout(strategy: tpustrat.TPUStrategy, partition: list[int], batch: dict[str, np.ndarray]) -> dict:
  """Which part of replica 0's images each of its logical devices holds once they are split."""
  dist = next(iter(strategy.experimental_distribute_dataset([batch])))
  split = strategy.run(lambda b: strategy.experimental_split_to_logical_devices(b["images"], partition),
                       args=(dist,))
  array = jax.tree.leaves(split)[0]  # [replica, batch, H, W, C]
  replica0 = strategy.mesh.devices.reshape(strategy.num_replicas_in_sync, -1)[0]
  by_device = {s.device: s for s in array.addressable_shards}
  return {f"logical device {l}": tuple((i.start or 0, i.stop if i.stop is not None else n)
                                       for i, n in zip(by_device[d].index[2:4], (HEIGHT, WIDTH)))
          for l, d in enumerate(replica0)}


def train(layout: str, steps: int = 20, learning_rate: float = 0.5, seed: int = 0, verbose: bool = False) -> list[float]:
  """Trains for `steps` steps in `layout`; returns the loss of every step."""
  strategy, partition = make_strategy(layout)
  data = make_data(steps, seed)
  step = make_train_step(strategy, partition, learning_rate)
  params: Any = init_params(seed)
  losses = []
  for i, batch in enumerate(strategy.experimental_distribute_dataset(data)):
    params, loss = strategy.run(step, args=(params, batch))
    losses.append(loss)
    if verbose and (i % 5 == 0 or i == steps - 1):
      print(f"  [{layout}] step {i:3d}  loss {float(strategy.experimental_local_results(loss)[0]):.4f}")
  return [float(strategy.experimental_local_results(loss)[0]) for loss in losses]


def reference_losses(steps: int = 20, learning_rate: float = 0.5, seed: int = 0) -> list[float]:
  """The same training on one device without a strategy or annotations."""
  @jax.jit
  def step(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
    def loss_fn(params: dict[str, jax.Array]) -> jax.Array:
      return jnp.mean(cross_entropy(model(params, batch["images"]), batch["labels"]))

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), loss

  params: Any = init_params(seed)
  losses = []
  for batch in make_data(steps, seed):
    params, loss = step(params, batch)
    losses.append(float(loss))
  return losses


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layout", choices=[*LAYOUTS, "both"], default="both")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--learning-rate", type=float, default=0.5)
  args = parser.parse_args(argv)
  layouts = list(LAYOUTS) if args.layout == "both" else [args.layout]
  print(f"{len(jax.devices())} {jax.devices()[0].platform.upper()} devices")
  for layout in layouts:
    shape, replicas, _ = LAYOUTS[layout]
    if (needed := math.prod(shape) * replicas) > len(jax.devices()):
      parser.exit(2, f"layout {layout} needs {needed} devices ({replicas} replica(s) x {math.prod(shape)} "
                     f"logical devices), and JAX sees {len(jax.devices())}: run it on {needed} TPU cores or GPUs, "
                     f"or on this machine's CPU with JAX_PLATFORMS=cpu (the example emulates 8 CPU devices).\n")
  results = {}
  for layout in layouts:
    strategy, partition = make_strategy(layout)
    print(f"{layout}: {strategy.num_replicas_in_sync} replica(s) x {strategy.extended.num_logical_cores_per_replica} "
          f"logical devices, mesh {dict(strategy.mesh.shape)}, images split {partition}")
    for name, (rows, cols) in describe_layout(strategy, partition, make_data(1)[0]).items():
      print(f"  {name} holds rows {rows[0]}:{rows[1]}, columns {cols[0]}:{cols[1]} of every image")
    results[layout] = train(layout, args.steps, args.learning_rate, verbose=True)
  reference = reference_losses(args.steps, args.learning_rate)
  for layout, losses in results.items():
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"{layout}: final loss {losses[-1]:.4f}; max difference from one device: {diff:.2e}")
  return results


if __name__ == "__main__":
  main()
