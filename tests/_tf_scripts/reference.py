"""TensorFlow's own answers for tests/test_tf_conformance.py (run only where TensorFlow is installed).

Runs every scenario of the conformance test on `tf.distribute.MirroredStrategy` over 8 logical CPU
devices and prints one JSON object: scenario name -> nested lists. The same scenarios run on tpustrat in
the test, which compares the two.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

N = 8
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * N)
strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(N)])
out = {}


def local(v):
  return [np.asarray(x).tolist() for x in strategy.experimental_local_results(v)]


# 1. Global batches of 16 and 12 rows split over the replicas; reduce and gather over them.
rows = np.arange(28 * 3, dtype=np.float32).reshape(28, 3)
ds = tf.data.Dataset.from_tensor_slices(rows).batch(16)
for i, b in enumerate(strategy.experimental_distribute_dataset(ds)):
  out[f"dataset/{i}/local"] = local(b)
  for op in ("SUM", "MEAN"):
    out[f"dataset/{i}/reduce_{op}_axis0"] = strategy.reduce(op, b, axis=0).numpy().tolist()
    if i == 0:  # the partial batch's components differ in shape: TF cannot add them elementwise
      out[f"dataset/{i}/reduce_{op}_axisNone"] = strategy.reduce(op, b, axis=None).numpy().tolist()
  out[f"dataset/{i}/gather0"] = strategy.gather(b, axis=0).numpy().tolist()
  per_example = strategy.run(lambda x: tf.reduce_sum(x * x, axis=1), args=(b,))
  out[f"dataset/{i}/run_local"] = local(per_example)
  out[f"dataset/{i}/run_MEAN_axis0"] = strategy.reduce("MEAN", per_example, axis=0).numpy().tolist()


# 2. Values from a function; reduce (both axes), gather, local results.
def value_fn(ctx):
  r = ctx.replica_id_in_sync_group
  return tf.constant([r, 2.0 * r + 1.0, r * r], tf.float32)


v = strategy.experimental_distribute_values_from_function(value_fn)
out["values/local"] = local(v)
for op in ("SUM", "MEAN"):
  out[f"values/reduce_{op}_axisNone"] = strategy.reduce(op, v, axis=None).numpy().tolist()
  out[f"values/reduce_{op}_axis0"] = strategy.reduce(op, v, axis=0).numpy().tolist()
out["values/gather0"] = strategy.gather(v, axis=0).numpy().tolist()


# 3. Replica-context collectives inside run.
def collectives(x):
  ctx = tf.distribute.get_replica_context()
  r = tf.cast(ctx.replica_id_in_sync_group, tf.float32)
  return (ctx.all_reduce("SUM", x * (r + 1.0)), ctx.all_reduce("MEAN", x + r),
          ctx.all_gather(tf.stack([r, -r]), axis=0))


s, m, g = strategy.run(collectives, args=(tf.constant([1.0, 2.0]),))
out["run/all_reduce_SUM"] = local(s)
out["run/all_reduce_MEAN"] = local(m)
out["run/all_gather0"] = local(g)
out["run/reduce_SUM_of_mirrored"] = strategy.reduce("SUM", s, axis=None).numpy().tolist()
out["run/reduce_MEAN_of_mirrored"] = strategy.reduce("MEAN", s, axis=None).numpy().tolist()


# 4. Per-replica batches from a function, with a short last step.
def dataset_fn(ctx):
  out["from_function/context"] = [ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync,
                                  ctx.get_per_replica_batch_size(16)]
  return tf.data.Dataset.range(N * 2 * 2 + 6).map(lambda i: tf.cast(i, tf.float32)).batch(2)


for i, b in enumerate(strategy.distribute_datasets_from_function(dataset_fn)):
  out[f"from_function/{i}/local"] = local(b)
  out[f"from_function/{i}/reduce_SUM_axis0"] = strategy.reduce("SUM", b, axis=0).numpy().tolist()
  out[f"from_function/{i}/reduce_MEAN_axis0"] = strategy.reduce("MEAN", b, axis=0).numpy().tolist()

# 5. Cross-device ops from the cross-replica context.
ext = strategy.extended
out["extended/reduce_to_SUM"] = local(ext.reduce_to("SUM", v, v))
out["extended/reduce_to_MEAN"] = local(ext.reduce_to("MEAN", v, v))
out["extended/batch_reduce_to"] = [local(x) for x in ext.batch_reduce_to("SUM", [(v, v), (v, v)])]

ops = tf.distribute.ReductionToOneDevice(reduce_to_device="/cpu:3")
out["ops/reduce_MEAN"] = local(ops.reduce(tf.distribute.ReduceOp.MEAN, v, v))
out["ops/batch_reduce_SUM"] = [local(x) for x in ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(v, v), (v, v)])]

print(json.dumps(out))
