"""TensorFlow's `DeviceAssignment.build` on synthetic topologies, for tests/test_tf_conformance.py.

Reads a JSON list of cases on stdin ({mesh_shape, computation_shape, computation_stride, num_replicas});
prints a JSON list with, per case, TF's core_assignment (or the error's type and message). No TPU is
needed: a `Topology` is made from a mesh shape and device coordinates (one task, row-major order).
"""

import itertools
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def topology(mesh_shape):
  coords = np.array(list(itertools.product(*[range(n) for n in mesh_shape])), np.int32)
  return tf.tpu.experimental.Topology(mesh_shape=mesh_shape, device_coordinates=coords[None])


out = []
for case in json.load(sys.stdin):
  try:
    da = tf.tpu.experimental.DeviceAssignment.build(
        topology(case["mesh_shape"]), computation_shape=case["computation_shape"],
        computation_stride=case["computation_stride"], num_replicas=case["num_replicas"])
    out.append({"core_assignment": np.asarray(da.core_assignment).tolist()})
  except Exception as e:  # pylint: disable=broad-except
    out.append({"error": type(e).__name__, "message": str(e)})
print(json.dumps(out))
