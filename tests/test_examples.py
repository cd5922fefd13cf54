"""The examples (`examples/*.py`): each trains, and its numbers are the right ones.

* classifier.py: it trains through the library's input pipeline (every training example once per epoch,
  the partial last batch padded and masked), evaluates every example exactly once, and its step is the
  right step: one `strategy.run` of the example's training step over 8 replicas, on a full or a partial
  batch, gives the loss, the parameters and the optimizer state of the same step computed on one device
  without a strategy over the batch's real examples (so gradients are aggregated exactly once, as the
  mean over the global batch, and padding counts for nothing).
* spatial_partitioning.py: images split across logical devices train exactly as on one device.
* moe.py, cross_replica_batchnorm.py, migration.py and multihost.py: smoke and correctness tests.

Each example is imported as a module (its `main(argv)` returns a summary dict) and also run as a script,
as a user would run it, in a fresh process where the example's own XLA_FLAGS give 8 CPU devices.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from flax import nnx

import tpustrat

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


# ---------------------------------------------------------------------------------------------------
# examples/classifier.py
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classifier(load_example):
  return load_example("classifier")


def numpy_forward(params: dict, x: np.ndarray) -> np.ndarray:
  """The MLP's logits in float64 numpy, from a pure dict of its weights (independent of Flax)."""
  h = x.astype(np.float64)
  for name in ("hidden1", "hidden2"):
    h = np.maximum(h @ params[name]["kernel"] + params[name]["bias"], 0.0)
  return h @ params["head"]["kernel"] + params["head"]["bias"]


def numpy_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
  shifted = logits - logits.max(axis=-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
  return -log_probs[np.arange(len(labels)), labels]


def jax_forward(params: dict, x: jax.Array) -> jax.Array:
  """The same MLP in plain jax.numpy on one device, for the reference gradient step."""
  h = x
  for name in ("hidden1", "hidden2"):
    h = jax.nn.relu(h @ params[name]["kernel"] + params[name]["bias"])
  return h @ params["head"]["kernel"] + params["head"]["bias"]


def host(tree):
  """Float64 numpy copies of a pytree's leaves (nnx.State becomes a pure dict)."""
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def test_classifier_main_trains_and_evaluates(classifier):
  summary = classifier.main(["--epochs", "3", "--global-batch-size", "64", "--learning-rate", "3e-3",
                             "--seed", "0", "--quiet"])
  assert summary["epochs"] == 3 and len(summary["losses"]) == 3
  assert summary["num_replicas"] == 8
  assert summary["final_loss"] == summary["losses"][-1]
  # Every training example every epoch (22 batches of 64 and one of 29), every test example once.
  assert summary["steps_per_epoch"] == 23 and summary["train_examples"] == [1437] * 3
  assert summary["test_examples"] == 360
  assert summary["test_correct"] == round(summary["test_accuracy"] * 360)
  # Measured: losses [1.36, 0.30, 0.16] and test accuracy 0.967 (0.950-0.967 over seeds 0-3 and 3-5
  # epochs); the start is ln(10) = 2.3 and chance is 0.1.
  assert summary["losses"][-1] < 0.4 * summary["losses"][0]
  assert summary["test_accuracy"] > 0.9
  assert summary["examples_per_second"] > 0


def test_an_epoch_of_training_input_is_every_example_once_in_the_shuffled_order(classifier, strategy):
  """The training input goes through the library's pipeline: batches of 256 split 32 per replica, the
  partial last batch (157 examples) padded, and the real rows are exactly the epoch's permutation."""
  x_train, y_train, _, _ = classifier.load_data(seed=0)
  dataset = classifier.make_dataset(strategy, x_train, y_train, 256, np.random.default_rng(7))
  order = np.random.default_rng(7).permutation(len(x_train))
  batches = list(strategy.experimental_distribute_dataset(dataset))
  assert len(batches) == 6
  for batch in batches:
    assert isinstance(batch["x"], tpustrat.PerReplica)
    assert jax.tree.leaves(batch["x"])[0].shape == (8, 32, 64)  # [replica, k, ...]: one shape for all
  # The partial batch: 157 = 4 * 32 + 29 real rows, replicas 5-7 hold padding only.
  assert [len(v) for v in strategy.experimental_local_results(batches[-1]["y"])] == [32] * 4 + [29, 0, 0, 0]
  # Input batches are per-example: `gather(..., axis=0)` returns their real rows, in order.
  got_x = np.concatenate([np.asarray(strategy.gather(b["x"], axis=0)) for b in batches])
  got_y = np.concatenate([np.asarray(strategy.gather(b["y"], axis=0)) for b in batches])
  np.testing.assert_array_equal(got_x, x_train[order])
  np.testing.assert_array_equal(got_y, y_train[order])


@pytest.mark.parametrize("which", [0, 1], ids=["full_batch", "partial_batch"])
def test_one_step_matches_single_device_computation(classifier, strategy, which):
  # 100 examples in global batches of 64: a full batch (8 per replica), then 36 examples (replicas 0-3
  # full, replica 4 with 4 real rows, replicas 5-7 padding only), both through the library's pipeline.
  graphdef, state, tx = classifier.create_train_state(seed=3, learning_rate=1e-2)
  x_train, y_train, _, _ = classifier.load_data(seed=0)
  batches = list(strategy.experimental_distribute_dataset(
      classifier.make_dataset(strategy, x_train[:100], y_train[:100], 64)))
  assert len(batches) == 2
  real = slice(0, 64) if which == 0 else slice(64, 100)
  batch = {"x": x_train[real], "y": y_train[real]}
  train_step = classifier.make_train_step(graphdef, tx)

  new_state, metrics = strategy.run(train_step, args=(state, batches[which]))
  assert isinstance(metrics["loss"], tpustrat.Mirrored) and isinstance(metrics["examples"], tpustrat.Mirrored)
  assert isinstance(metrics["correct"], tpustrat.PerReplica)
  assert int(strategy.experimental_local_results(metrics["examples"])[0]) == len(batch["x"])

  params0 = nnx.to_pure_dict(state["params"])
  # The reported loss is the mean cross-entropy over the batch's real examples at the initial parameters.
  logits = numpy_forward(host(params0), batch["x"])
  expected_loss = numpy_cross_entropy(logits, batch["y"]).mean()
  np.testing.assert_allclose(float(strategy.experimental_local_results(metrics["loss"])[0]), expected_loss,
                             rtol=1e-5)
  assert int(strategy.reduce("sum", metrics["correct"], axis=None)) == int(np.sum(logits.argmax(-1) == batch["y"]))

  # The update: one Adam step on the gradient of the mean loss over the real examples, on one device, no
  # strategy (padding rows contribute nothing).
  def mean_loss(params):
    logits = jax_forward(params, jnp.asarray(batch["x"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(batch["y"])).mean()

  @jax.jit  # one compilation instead of one per eager operation
  def reference_step(params):
    updates, opt_state = tx.update(jax.grad(mean_loss)(params), tx.init(params), params)
    return optax.apply_updates(params, updates), opt_state

  expected_params, expected_opt_state = reference_step(params0)

  got = strategy.experimental_local_results(new_state)[0]
  np.testing.assert_allclose(got["opt_state"][0].count, expected_opt_state[0].count)
  # Adam's first moment after one step is (1 - b1) * grad: it pins the gradient's scale, which the
  # sign-like first Adam update would not (a gradient summed twice, or divided by the padded batch size,
  # would still pass a params check). Gradients are sums over the batch, added in another order on 8
  # replicas: each leaf's tolerance scales with its largest element. Parameters: with Adam's step too
  # (learning rate 1e-2), lr * g / (|g| + eps), which a gradient that cancels to near zero makes
  # sensitive to rounding.
  for name, expected in (("mu", expected_opt_state[0].mu), ("nu", expected_opt_state[0].nu)):
    jax.tree.map(lambda g, e, name=name: assert_close(g, e, rtol=1e-4, err_msg=name),
                 host(nnx.to_pure_dict(getattr(got["opt_state"][0], name))), host(expected))
  jax.tree.map(lambda g, e: assert_close(g, e, rtol=1e-4, scale=np.abs(e) + 1e-2),
               host(nnx.to_pure_dict(got["params"])), host(expected_params))


@pytest.mark.parametrize("global_batch", [48, 64, 7, 128])
def test_evaluation_counts_every_example_exactly_once(classifier, strategy, global_batch):
  # 100 examples: 48 -> 48 + 48 + 4 (6 per replica; the last batch's 4 rows all on replica 0); 64 -> 64 +
  # 36; 7 -> 14 batches of 7 (1 per replica, replica 7 padding only) and one of 2; 128 -> one batch of
  # 100 (13 per replica: 100 is not a multiple of 8, the last replica holds 9 real rows).
  x = np.random.default_rng(0).random((100, 64), dtype=np.float32)
  y = np.arange(100, dtype=np.int32) % 10
  graphdef, state, _ = classifier.create_train_state(seed=0, learning_rate=1e-3)
  result = classifier.evaluate(strategy, classifier.make_eval_step(graphdef), state["params"], x, y,
                               global_batch)
  want = numpy_forward(host(nnx.to_pure_dict(state["params"])), x).argmax(-1)
  # One prediction per example, in order: no padding row kept, none lost.
  assert result["examples"] == 100
  np.testing.assert_array_equal(result["predictions"], want)
  assert result["correct"] == int(np.sum(want == y))
  assert result["accuracy"] == result["correct"] / 100


@pytest.mark.processes
def test_classifier_script_runs_on_eight_emulated_devices():
  # As `make demo` runs it: a fresh process, where the example's own XLA_FLAGS gives 8 CPU devices.
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, str(EXAMPLES / "classifier.py"), "--epochs", "1", "--global-batch-size", "128"],
                       env=env, capture_output=True, text=True, timeout=120, check=True)
  assert "num_replicas_in_sync=8" in out.stderr + out.stdout
  assert "test accuracy" in out.stderr + out.stdout


# ---------------------------------------------------------------------------------------------------
# examples/spatial_partitioning.py
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spatial(load_example):
  return load_example("spatial_partitioning")


def test_both_layouts_train_like_one_device(spatial):
  steps = 12
  reference = spatial.reference_losses(steps)
  for layout in ("4x2", "1x8"):
    losses = spatial.train(layout, steps)
    np.testing.assert_allclose(losses, reference, rtol=1e-4, atol=1e-5)
  assert reference[-1] < 0.5 * reference[0]  # it learns


def test_images_are_split_as_tf_tiles_them(spatial):
  strategy, partition = spatial.make_strategy("1x8")
  tiles = spatial.describe_layout(strategy, partition, spatial.make_data(1)[0])
  assert tiles == {f"logical device {l}": ((8 * (l // 4), 8 * (l // 4) + 8), (8 * (l % 4), 8 * (l % 4) + 8))
                   for l in range(8)}  # arange(8).reshape(1, 2, 4, 1): 2 x 4 tiles of 8 x 8 pixels
  strategy, partition = spatial.make_strategy("4x2")
  assert spatial.describe_layout(strategy, partition, spatial.make_data(1)[0]) == {
      "logical device 0": ((0, 8), (0, 32)), "logical device 1": ((8, 16), (0, 32))}


@pytest.mark.parametrize("visible, layout, needed", [(1, "both", 8), (4, "4x2", 8), (7, "1x8", 8)])
def test_too_few_devices_are_named_before_any_work(spatial, monkeypatch, capsys, visible, layout, needed):
  # One GPU (seen on an H200): the example says what it needs and how to run it, instead of failing inside
  # DeviceAssignment.build with a TPU topology's shape.
  devices = jax.devices()[:visible]
  monkeypatch.setattr(spatial.jax, "devices", lambda *a: devices)
  with pytest.raises(SystemExit) as exit_info:
    spatial.main(["--layout", layout, "--steps", "1"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert f"needs {needed} devices" in err and f"JAX sees {visible}" in err and "JAX_PLATFORMS=cpu" in err


@pytest.mark.processes
def test_spatial_partitioning_script_runs_on_eight_emulated_devices():
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, str(EXAMPLES / "spatial_partitioning.py"), "--layout", "1x8", "--steps", "2"],
                       env=env, capture_output=True, text=True, timeout=300, check=True)
  assert "8 CPU devices" in out.stdout and "1x8: final loss" in out.stdout
  assert "logical device 7 holds rows 8:16, columns 24:32" in out.stdout


# ---------------------------------------------------------------------------------------------------
# examples/moe.py, cross_replica_batchnorm.py, migration.py: as scripts
# ---------------------------------------------------------------------------------------------------


# Each example run as `python examples/NAME.py ARGS` would run it (`__name__ == "__main__"`, the example's
# own XLA_FLAGS), all in one fresh process to pay for JAX's start-up once.
_RUN_SCRIPTS = """
import runpy, sys
for path, *argv in {runs!r}:
  sys.argv = [path, *argv]
  print("=== " + path, flush=True)
  runpy.run_path(path, run_name="__main__")
"""


@pytest.mark.processes
def test_scripts_run_on_eight_emulated_devices():
  runs = [(str(EXAMPLES / "moe.py"), "--num-experts", "4", "--steps", "2", "--steps-per-program", "2"),
          (str(EXAMPLES / "cross_replica_batchnorm.py"), "--epochs", "1", "--group-size", "2"),
          (str(EXAMPLES / "migration.py"), "--epochs", "1", "--global-batch-size", "256")]
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", _RUN_SCRIPTS.format(runs=runs)], env=env, capture_output=True,
                        text=True, timeout=300)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-5000:]
  moe, bn, migration = out.split("=== ")[1:]
  # moe: 2 groups of 4 replicas, each with all 4 experts; the script asserts the dense check itself.
  assert "4 experts, 1 per replica, all-to-all groups [[0, 1, 2, 3], [4, 5, 6, 7]]" in moe
  assert "expert-parallel layer == dense layer after training" in moe
  assert "batch norm over groups [[0, 1], [2, 3], [4, 5], [6, 7]]" in bn
  assert "group statistics == numpy after training too" in bn and "test accuracy" in bn
  assert "num_replicas_in_sync=8" in migration and "test accuracy" in migration


# ---------------------------------------------------------------------------------------------------
# examples/moe.py
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe(load_example):
  return load_example("moe")


def test_moe_expert_layouts(moe):
  one_each = moe.ExpertLayout(8, 8)
  assert (one_each.group_size, one_each.experts_per_replica, one_each.groups) == (8, 1, [list(range(8))])
  two_each = moe.ExpertLayout(16, 8)
  assert two_each.experts_per_replica == 2 and two_each.experts_of(3) == slice(6, 8)
  grouped = moe.ExpertLayout(4, 8)
  assert grouped.groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert grouped.copies == [[0, 4], [1, 5], [2, 6], [3, 7]]
  assert grouped.experts_of(6) == slice(2, 3)
  with pytest.raises(ValueError, match="multiple or a divisor"):
    moe.ExpertLayout(3, 8)
  assert moe.capacity(32, 8, 1.25) == 5


def test_moe_trains_and_matches_the_dense_layer(moe):
  summary = moe.main(["--steps", "12", "--steps-per-program", "6", "--quiet"])
  assert summary["num_replicas"] == 8 and summary["steps"] == 12 and len(summary["losses"]) == 12
  assert summary["max_dense_diff"] < 1e-4  # main itself asserts allclose before and after training
  assert summary["final_loss"] < 0.75 * summary["initial_loss"]  # measured: 0.44-0.51x the start (seeds 0-2)
  assert sum(summary["tokens_per_expert"]) == 8 * 32


@pytest.mark.parametrize("num_experts", [16, 2], ids=["two_experts_per_replica", "groups_of_two"])
def test_moe_layer_and_gradients_match_dense(moe, strategy, num_experts):
  layout = moe.ExpertLayout(num_experts, 8)
  cap = moe.capacity(16, num_experts, 1.0)
  params = moe.distribute_params(strategy, layout, moe.init_params(num_experts, seed=1))
  # Each device holds only its own replica's experts.
  assert isinstance(params["experts"], tpustrat.PerReplica)
  w1 = strategy.experimental_local_results(params["experts"])[0]["w1"]
  assert w1.shape == (layout.experts_per_replica, moe.MODEL_DIM, moe.HIDDEN_DIM)
  for leaf in jax.tree.leaves(params["experts"]):  # global arrays [replica, experts of the replica, ...]
    assert leaf.shape[:2] == (8, layout.experts_per_replica)
    assert {s.data.shape[0] for s in leaf.addressable_shards} == {1}
  batch = moe.make_data(8 * 16, num_experts, seed=2)
  assert moe.check_against_dense(strategy, layout, params, batch, cap) < 1e-4  # asserts allclose inside


def test_moe_tokens_travel_by_all_to_all(moe, strategy):
  """The expert-parallel layer really exchanges tokens (a dense layer would pass the dense check too)."""
  layout = moe.ExpertLayout(8, 8)
  params = moe.distribute_params(strategy, layout, moe.init_params(8))
  batch = next(iter(strategy.experimental_distribute_dataset([moe.make_data(8 * 32, 8)])))
  jaxpr = jax.make_jaxpr(lambda p, b: strategy.run(lambda p, b: moe.moe_layer(p, b["x"], layout, 5)[0],
                                                   args=(p, b)))(params, batch)
  assert str(jaxpr).count("all_to_all") == 2


# ---------------------------------------------------------------------------------------------------
# examples/cross_replica_batchnorm.py
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bn(load_example):
  return load_example("cross_replica_batchnorm")


GROUPINGS = {
    "halves": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "interleaved": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "pairs": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "all": [list(range(8))],
}


@pytest.mark.parametrize("groups", GROUPINGS.values(), ids=GROUPINGS.keys())
def test_group_statistics_match_numpy(bn, strategy, groups):
  train, test = bn.load_data(0)
  params = bn.init_state(0)["params"]
  params["b1"] = np.linspace(-1, 1, bn.HIDDEN).astype(np.float32)  # not all zeros
  # A full batch, then a partial one: 20 real examples in the 8-per-replica layout, so replicas 0-1 are
  # full, replica 2 has 4 real rows and replicas 3-7 are only padding.
  batches = [{k: v[:64] for k, v in train.items()}, {k: v[:20] for k, v in test.items()}]
  assert bn.check_group_statistics(strategy, params, batches, groups) < 1e-4  # asserts allclose inside
  rows = bn.replica_rows(20, 8, per_replica=8)
  assert [len(r) for r in rows] == [8, 8, 4, 0, 0, 0, 0, 0]


def test_batchnorm_step_matches_one_device(bn, strategy):
  """One step with SGD(lr=1): the update is minus the gradient of the single-device group-BN loss."""
  groups = GROUPINGS["interleaved"]
  train, _ = bn.load_data(0)
  batch = {k: v[:64] for k, v in train.items()}
  state = bn.init_state(0)
  tx = optax.sgd(1.0)
  state["opt_state"] = tx.init(state["params"])
  dist = next(iter(strategy.experimental_distribute_dataset([batch])))
  new_state, metrics = strategy.run(bn.make_train_step(tx, groups), args=(state, dist))
  assert isinstance(new_state["params"]["w1"], tpustrat.Mirrored)
  assert isinstance(new_state["batch_stats"]["mean"], tpustrat.Mirrored)

  params = jax.tree.map(jnp.asarray, state["params"])
  loss, grads = jax.jit(jax.value_and_grad(lambda p, b: bn.reference_loss(p, b, groups, 8)))(
      params, jax.tree.map(jnp.asarray, batch))
  got = strategy.experimental_local_results(new_state)[0]
  np.testing.assert_allclose(strategy.experimental_local_results(metrics["loss"])[0], loss, rtol=1e-5)
  # A gradient is a sum over examples: it rounds relative to the gradients' magnitude, not its own (b1's,
  # zero in theory as batch norm removes a bias, is only rounding).
  grad_scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads))
  for name in params:
    assert_close(got["params"][name], params[name] - grads[name], rtol=1e-4,
                 scale=np.abs(params[name]) + grad_scale, err_msg=name)
  # Moving averages: momentum towards the mean of the groups' statistics.
  stats = bn.numpy_group_statistics(state["params"], batch["x"], groups, 8)
  mean_of_groups = np.mean([m for m, _ in stats], axis=0)
  assert_close(got["batch_stats"]["mean"], 0.1 * mean_of_groups, rtol=1e-4)


def test_batchnorm_trains(bn):
  summary = bn.main(["--epochs", "2", "--quiet"])
  assert summary["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert summary["max_stats_diff"] < 1e-4
  assert summary["losses"][-1] < summary["losses"][0]
  assert summary["test_accuracy"] > 0.85  # measured: 0.96 after 2 epochs


# ---------------------------------------------------------------------------------------------------
# examples/migration.py
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def migration(load_example):
  return load_example("migration")


def _squash(text: str) -> str:
  return re.sub(r"[\s\\]+", "", text)


def test_migration_side_by_side_is_the_code(migration):
  """The right-hand column of the side by side in docs/coming_from_tensorflow.md is what `main` runs (up to
  line breaks)."""
  page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "coming_from_tensorflow.md").read_text()
  block = page.split("## A training loop, side by side", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
  rows = [line for line in block.splitlines() if " | " in line or line.endswith(" |")]
  assert rows[0].split(" | ")[0].strip() == "TensorFlow" and rows[0].split(" | ")[1].strip() == "tpustrat"
  right = _squash("\n".join(line.split(" | ", 1)[1] for line in rows[2:] if " | " in line))
  source = _squash(pathlib.Path(migration.__file__).read_text().split('"""', 2)[2])
  for statement in [
      "strategy=tpustrat.TPUStrategy(resolver)",
      "tpustrat.initialize_tpu_system(resolver)",
      "dataset=dataset.shuffle(seed=args.seed).repeat()",
      "returndataset.batch(batch_size)",
      "train_dataset=strategy.distribute_datasets_from_function(lambda_:get_dataset(per_replica_batch_size,"
      "is_training=True))",
      "train_iterator=iter(train_dataset)",
      "loss=tpustrat.compute_average_loss(per_example_loss)",
      "jax.value_and_grad(loss_fn,has_aux=True)(state[\"params\"])",
      "tx.update(grads,state[\"opt_state\"],state[\"params\"])",
      "strategy.experimental_run_steps(step_fn,train_iterator,STEPS,init=state)",
      "strategy.run(test_fn,args=(state[\"params\"],inputs))",
  ]:
    assert statement in right, statement
    assert statement in source, statement


def test_migration_trains(migration):
  summary = migration.main(["--epochs", "2", "--quiet"])
  assert summary["num_replicas"] == 8 and summary["steps_per_epoch"] == 1437 // 64
  assert summary["losses"][1] < summary["losses"][0]
  assert summary["test_accuracy"] > 0.8  # measured: 0.89 after 2 epochs
  assert summary["test_correct"] == round(summary["test_accuracy"] * summary["test_examples"])


# ---------------------------------------------------------------------------------------------------
# examples/multihost.py
# ---------------------------------------------------------------------------------------------------


@pytest.mark.processes
def test_multihost_classifier_matches_one_process(load_example):
  """2 processes x 4 devices through `python -m tpustrat.launch`: the single-process run's numbers."""
  pytest.importorskip("tpustrat.launch")
  multihost = load_example("multihost")
  classifier_args = ["--epochs", "1", "--global-batch-size", "256"]
  summary = multihost.main(["--quiet", "--timeout", "240", "--", *classifier_args])
  assert (summary["num_processes"], summary["devices_per_process"], summary["num_replicas"]) == (2, 4, 8)
  assert len(summary["losses"]) == 1

  single = load_example("classifier").main([*classifier_args, "--quiet"])
  # The multi-process run prints 4 decimals; sums cross processes in another order (gloo).
  np.testing.assert_allclose(summary["losses"], single["losses"], atol=2e-4)
  assert abs(summary["test_accuracy"] - single["test_accuracy"]) <= 1 / 360 + 1e-4


# -- preemptible.py -------------------------------------------------------------------------------------


def test_preemptible_resumes_after_sigterm_with_the_parameters_of_an_uninterrupted_run(load_example, tmp_path,
                                                                                     monkeypatch):
  from tpustrat._src import preemption  # pylint: disable=import-outside-toplevel

  def hard_exit(status):  # the handler's os._exit, as an exception the test can catch
    raise SystemExit(status)

  monkeypatch.setattr(preemption, "_hard_exit", hard_exit)
  preemptible = load_example("preemptible")
  common = ["--steps", "20", "--save-every", "10", "--global-batch-size", "32"]
  reference = preemptible.main(["--ckpt-dir", str(tmp_path / "reference"), *common])
  assert reference["started_at"] == 0 and reference["total_run_calls"] == 20
  with pytest.raises(SystemExit) as stopped:  # SIGTERM during step 7: saved there, exit status 42
    preemptible.main(["--ckpt-dir", str(tmp_path / "run"), "--preempt-at", "7", *common])
  assert stopped.value.code == 42
  assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.isdigit()) == ["7"]
  resumed = preemptible.main(["--ckpt-dir", str(tmp_path / "run"), *common])
  assert resumed["started_at"] == 7 and resumed["total_run_calls"] == 20
  for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(reference["params"])):
    np.testing.assert_array_equal(a, b)  # the same training, bit for bit
  assert resumed["losses"][-1] == reference["losses"][-1]


# -- recommender.py -------------------------------------------------------------------------------------


def test_recommender_learns_clicks(load_example, strategy):
  """The DLRM-style click model on tables shrunk 100x (10 to 10,000 rows): each device holds ceil(V / 8)
  rows of each table, the loss falls, the held-out AUC is far above chance and below the true model's;
  the AUC is the pairwise one, and the input pipeline stops at an id outside its table."""
  recommender = load_example("recommender")
  summary = recommender.main(["--vocab-scale", "0.01", "--steps", "60", "--log-every", "15", "--eval-batches", "4",
                              "--global-batch-size", "512", "--seed", "0", "--quiet"])
  sizes = summary["vocabulary_sizes"]
  assert list(sizes.values()) == [10, 30, 100, 300, 1000, 3000, 10000, 50]
  assert summary["num_replicas"] == 8
  # Read off the tables' blocks on the devices: V padded to a multiple of 8, split into 8 blocks of rows.
  assert summary["rows_per_device"] == {name: -(-v // 8) for name, v in sizes.items()}
  assert summary["steps"] == 60 and [step for step, _ in summary["logged_losses"]] == [15, 30, 45, 60]
  # Measured over seeds 0-5: the last logged loss is 0.70-0.80x the first; held-out AUC 0.82-0.87, the true
  # click model's 0.87-0.91 (the model stays 0.03-0.05 below it), the untrained model's 0.45-0.55.
  assert summary["final_loss"] < 0.9 * summary["first_loss"]
  assert summary["held_out_auc"] > 0.75
  assert summary["held_out_auc"] < summary["true_auc"] + 0.02

  # The rank-based AUC is the fraction of (positive, negative) pairs in order, ties counting one half.
  rng = np.random.default_rng(0)
  labels = rng.random(300) < 0.3
  scores = rng.integers(0, 20, 300).astype(np.float32)  # many ties
  pos, neg = scores[labels][:, None], scores[~labels][None, :]
  assert recommender.auc(labels, scores) == pytest.approx(np.mean((pos > neg) + 0.5 * (pos == neg)))

  # Inside `strategy.run` ids cannot be checked: the example's pipeline checks each batch on the host.
  features = recommender.scaled_features(0.01)
  embedding = recommender.make_embedding(strategy, features, 1e-2)
  data = recommender.ClickModel(features).sample(64, seed=0)
  data["ids"]["user"][40] = 10000  # "user" has 10,000 rows
  with pytest.raises(ValueError, match="feature 'user' holds id 10000"):
    list(strategy.experimental_distribute_dataset(recommender.make_dataset(strategy, embedding, data, 32)))
