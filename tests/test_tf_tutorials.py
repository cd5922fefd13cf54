"""TF's tutorials ported to tpustrat (`examples/tf_tutorials/`), each run here and compared with one device.

Each port keeps the TF original's structure; the test runs it as the tutorial runs it (the multi-worker one
as 2 processes x 4 devices, through the launcher and through ``TF_CONFIG``) and compares its losses with
the same training written independently on one device (f32, rtol 1e-5).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import launched_results

TUTORIALS = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tf_tutorials"
ROOT = TUTORIALS.parents[1]


def _load_tutorial(name: str):
  spec = importlib.util.spec_from_file_location(f"tf_tutorial_{name}", TUTORIALS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def _job_env() -> dict[str, str]:
  """This environment without what a job's processes get for themselves (and without this process's 8
  devices)."""
  return {k: v for k, v in os.environ.items()
          if not k.startswith("TPUSTRAT_") and k not in ("JAX_NUM_CPU_DEVICES", "TF_CONFIG")}


# -- multi_worker_ctl: TF's "Custom training loop with Keras and MultiWorkerMirroredStrategy" -----------

MW_EPOCHS, MW_STEPS, MW_PER_WORKER_BATCH = 2, 2, 16
MW_ARGS = ["--num-epochs", str(MW_EPOCHS), "--num-steps-per-epoch", str(MW_STEPS),
           "--per-worker-batch-size", str(MW_PER_WORKER_BATCH), "--json"]


@pytest.fixture(scope="module")
def multi_worker_ctl():
  return _load_tutorial("multi_worker_ctl")


def _one_device_losses(tutorial, *, num_workers: int, epochs: int = MW_EPOCHS, steps: int = MW_STEPS,
                       per_worker_batch: int = MW_PER_WORKER_BATCH) -> list[float]:
  """The tutorial's training on one device, written here: the global batch of step ``s`` is examples
  ``[s * G, (s + 1) * G)`` (each worker's shard of them, every local replica's batch: together those rows),
  the loss their mean cross-entropy, Keras's RMSprop by hand. Only the initial parameters and the synthetic
  data come from the port."""
  global_batch = per_worker_batch * num_workers
  x, y = tutorial.mnist_dataset(global_batch * steps)
  params = jax.tree.map(jnp.asarray, tutorial.build_cnn_model(0))

  def logits(p, images):
    h = jax.lax.conv(images[:, None, :, :], jnp.transpose(p["conv"]["kernel"], (3, 2, 0, 1)), (1, 1), "VALID")
    h = jax.nn.relu(h + p["conv"]["bias"][None, :, None, None])
    h = jnp.transpose(h, (0, 2, 3, 1)).reshape(len(images), -1)  # Keras's Flatten of NHWC
    h = jax.nn.relu(h @ p["dense"]["kernel"] + p["dense"]["bias"])
    return h @ p["logits"]["kernel"] + p["logits"]["bias"]

  def loss_fn(p, images, labels):
    log_probs = jax.nn.log_softmax(logits(p, images))
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))

  @jax.jit
  def step(p, v, images, labels):
    loss, g = jax.value_and_grad(loss_fn)(p, images, labels)
    v = jax.tree.map(lambda v, g: 0.9 * v + 0.1 * g * g, v, g)
    p = jax.tree.map(lambda p, g, v: p - 0.001 * g / (jnp.sqrt(v) + 1e-7), p, g, v)
    return p, v, loss

  v = jax.tree.map(jnp.zeros_like, params)
  losses = []
  for _ in range(epochs):
    for s in range(steps):
      rows = slice(s * global_batch, (s + 1) * global_batch)
      params, v, loss = step(params, v, jnp.asarray(x[rows]), jnp.asarray(y[rows], jnp.int32))
      losses.append(float(loss))
  return losses


@pytest.fixture(scope="module")
def mw_reference(multi_worker_ctl) -> list[float]:
  """One device's losses of 3 epochs at a global batch of 2 x 16 rows: the two-worker runs (2 epochs) and
  the one-worker run of 32 rows per worker (2 epochs, then a third) train on the same batches."""
  return _one_device_losses(multi_worker_ctl, num_workers=2, epochs=3)


def _check_worker(got: dict, want: list[float], process: int, resolver: str, spec: dict) -> None:
  np.testing.assert_allclose(got["step_losses"], want, rtol=1e-5, err_msg=f"process {process}")
  assert got["num_replicas_in_sync"] == 8 and got["resolver"] == resolver
  assert (got["task_type"], got["task_id"], got["is_chief"]) == ("worker", process, process == 0)
  assert got["cluster_spec"] == spec


@pytest.mark.processes
def test_multi_worker_ctl_on_two_processes_through_the_launcher(mw_reference, tmp_path):
  # `MultiWorkerMirroredStrategy()` joins the launcher's job: 8 replicas over 2 processes, one input
  # pipeline per process; every process holds the job's losses, equal to one device's; both write their
  # part of one checkpoint per epoch into the one directory.
  command = [sys.executable, "-m", "tpustrat.launch", "-n", "2", "-d", "4", "--timeout", "150",
             str(TUTORIALS / "multi_worker_ctl.py"), *MW_ARGS, "--checkpoint-dir", str(tmp_path / "ckpt")]
  out = subprocess.run(command, env=_job_env(), cwd=ROOT, capture_output=True, text=True, timeout=200)
  assert out.returncode == 0, out.stderr[-4000:]
  results = launched_results(out.stdout)
  want = mw_reference[:MW_EPOCHS * MW_STEPS]
  coordinator = results[0]["cluster_spec"]["worker"][0]
  for p in (0, 1):
    _check_worker(results[p], want, p, "TPUClusterResolver", {"worker": [coordinator, None]})
  assert sorted(os.listdir(tmp_path / "ckpt")) == [str(MW_EPOCHS)]  # max_to_keep=1: the last epoch's


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.processes
def test_multi_worker_ctl_on_two_processes_through_tf_config(mw_reference):
  # The tutorial's own set-up: each worker started by hand with its TF_CONFIG; `MultiWorkerMirroredStrategy()`
  # reads it (TF's default resolver) and connects the two into one job.
  workers = [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]
  processes = []
  for index in (0, 1):
    env = {**_job_env(), "TF_CONFIG": json.dumps({"cluster": {"worker": workers},
                                                   "task": {"type": "worker", "index": index}}),
           "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
           "TPUSTRAT_INITIALIZATION_TIMEOUT": "60", "TPUSTRAT_HEARTBEAT_TIMEOUT": "10",
           "TPUSTRAT_SHUTDOWN_TIMEOUT": "30", "TPUSTRAT_EXIT_ON_UNCAUGHT_EXCEPTION": "1"}
    processes.append(subprocess.Popen([sys.executable, str(TUTORIALS / "multi_worker_ctl.py"), *MW_ARGS], env=env,
                                      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outputs = []
  try:
    for process in processes:
      outputs.append(process.communicate(timeout=150))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.communicate()
  for index, (process, (_, stderr)) in enumerate(zip(processes, outputs)):
    assert process.returncode == 0, f"worker {index}: {stderr[-4000:]}"
  results = {i: json.loads(stdout.split("RESULT ", 1)[1]) for i, (stdout, _) in enumerate(outputs)}
  want = mw_reference[:MW_EPOCHS * MW_STEPS]
  for p in (0, 1):
    _check_worker(results[p], want, p, "TFConfigClusterResolver", {"worker": workers})


def test_multi_worker_ctl_in_one_process_resumes_from_its_checkpoint(multi_worker_ctl, mw_reference, tmp_path):
  # One worker of 8 devices (no TF_CONFIG, no launcher): the same losses as one device; a second run with
  # one more epoch restores the saved epoch and trains only the next one, as one device's third epoch.
  want = mw_reference
  kwargs = {"num_steps_per_epoch": MW_STEPS, "per_worker_batch_size": 2 * MW_PER_WORKER_BATCH,
            "checkpoint_dir": str(tmp_path), "verbose": False}
  first = multi_worker_ctl.train(num_epochs=2, **kwargs)
  np.testing.assert_allclose(first["step_losses"], want[:2 * MW_STEPS], rtol=1e-5)
  assert (first["task_type"], first["task_id"], first["is_chief"], first["cluster_spec"]) == ("worker", 0, True, {})
  resumed = multi_worker_ctl.train(num_epochs=3, **kwargs)
  assert resumed["start_epoch"] == 2
  np.testing.assert_allclose(resumed["step_losses"], want[2 * MW_STEPS:], rtol=1e-5)


# -- custom_training: TF's "Custom training with tf.distribute.Strategy" -----------------------------------

CT = {"epochs": 2, "global_batch_size": 32, "train_examples": 72, "test_examples": 32}  # batches 32, 32, 8


def _custom_training_one_device(tutorial) -> list[float]:
  """The tutorial's training written here with plain JAX and optax on one device: each global batch (the
  port's grain dataset, in its order) whole, the mean cross-entropy plus the L2 penalty, Adam. Only the
  model, the data and the dataset's order come from the port."""
  import optax
  from flax import nnx

  import tpustrat

  train_data, _ = tutorial.load_data(CT["train_examples"], CT["test_examples"], 0)
  graphdef, params = nnx.split(tutorial.create_model(0))
  tx = optax.adam(0.001)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, images, labels):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(images)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      l2 = sum(1e-5 * jnp.sum(k ** 2) for path, k in jax.tree_util.tree_flatten_with_path(p)[0]
               if "kernel" in jax.tree_util.keystr(path))
      return ce + l2
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  dataset = tutorial.make_dataset(tpustrat.get_strategy(), train_data, CT["global_batch_size"], shuffle_seed=0)
  for _ in range(CT["epochs"]):
    for images, labels in dataset:
      params, opt_state, loss = step(params, opt_state, jnp.asarray(images), jnp.asarray(labels))
      losses.append(float(loss))
  return losses


def test_custom_training_equals_one_device_with_its_partial_batch(strategy):
  tutorial = _load_tutorial("custom_training")
  history = tutorial.train(strategy, **CT)
  want = _custom_training_one_device(tutorial)
  assert len(history["step_losses"]) == len(want) == 6  # 3 steps per epoch, the 3rd of 8 examples
  np.testing.assert_allclose(history["step_losses"], want, rtol=1e-5)
  assert history["train_loss"][1] < history["train_loss"][0]
  # The checkpoint of epoch 0, restored without the strategy, is the model the epoch-0 test loop measured.
  assert history["restored_accuracy"] == history["test_accuracy"][0]


# -- migration: the custom training loop of TF's "Use TPUs" guide (examples/migration.py) --------------------

def test_tpu_guide_loop_equals_one_device(load_example):
  """The TPU guide's loop (per-replica batches from distribute_datasets_from_function, compute_average_loss,
  many steps per program) on 8 replicas against plain JAX + optax on one device with the global batches of
  the same stream: every step's loss at rtol 1e-5."""
  import optax
  from flax import nnx

  import tpustrat

  migration = load_example("migration")
  steps, batch = 4, 64
  summary = migration.main(["--epochs", "1", "--steps-per-epoch", str(steps), "--global-batch-size", str(batch),
                            "--quiet"])
  train, _ = migration.load_data(0)
  graphdef, params = nnx.split(migration.create_model(nnx.Rngs(0)))
  tx = optax.adam(1e-3)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, images, labels):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p)(images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # The stream every replica dequeues from, in global batches: 8 consecutive per-replica batches.
  stream = iter(tpustrat.get_strategy().experimental_make_numpy_dataset(train).shuffle(seed=0).repeat().batch(batch))
  want = []
  for _ in range(steps):
    b = next(stream)
    params, opt_state, loss = step(params, opt_state, jnp.asarray(b["image"]), jnp.asarray(b["label"]))
    want.append(float(loss))
  np.testing.assert_allclose(summary["step_losses"], want, rtol=1e-5)


# -- keras_model: a tf.keras-style convnet in Keras 3, trained with Keras's stateless API ---------------------


def test_keras_model_port_equals_one_device_keras(strategy):
  """The port on 8 replicas (SyncBatchNormalization, Dropout rate 0: per-replica masks cannot be drawn alike
  on one device; tests/test_keras.py checks the masks themselves) gives the losses of Keras's own
  train_on_batch on one device with plain BatchNormalization over the same global batches (the model and
  the data come from the port)."""
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip(f"Keras runs on {keras.backend.backend()}, not JAX (KERAS_BACKEND=jax)")
  port = _load_tutorial("keras_model")
  kwargs = {"image_size": 8, "dropout": 0.0}
  result = port.train(strategy, epochs=1, batch_size_per_replica=2, num_examples=48, sync_bn=True, **kwargs)
  reference = port.build_model(sync_bn=False, **kwargs)
  reference.compile(optimizer=keras.optimizers.Adam(port.LR),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  batches = port.global_batches(port.load_data(48, kwargs["image_size"]), result["global_batch_size"])
  want = [float(reference.train_on_batch(x, y)) for x, y in batches]
  assert len(want) == 3
  np.testing.assert_allclose(result["losses"], want, rtol=1e-5)
  for mine, theirs in zip(result["model"].weights, reference.weights):
    np.testing.assert_allclose(np.asarray(mine.value), np.asarray(theirs.value), rtol=1e-4, atol=1e-6)


# -- keras_fit: TF's "Distributed training with Keras" (Model.fit under strategy.scope()) --------------------

KF_EPOCHS, KF_PER_REPLICA, KF_TRAIN, KF_TEST = 4, 4, 76, 40  # global batch 32: 2 full batches and one of 12


def test_keras_fit_port_equals_one_device_keras_with_its_partial_batch(tmp_path):
  """The tutorial on 8 replicas (`tpustrat.MirroredStrategy()`, Keras's own fit / evaluate, a partial last
  batch of 12 rows each epoch, the decay schedule reaching its second rate at epoch 4) gives plain Keras's
  one-device per-epoch losses and accuracies, final weights and evaluations (the port's `check_one_device`,
  checked again here); the checkpoints restore, and the saved model loads on one device and on every
  replica."""
  keras = pytest.importorskip("keras")
  if keras.backend.backend() != "jax":
    pytest.skip(f"Keras runs on {keras.backend.backend()}, not JAX (KERAS_BACKEND=jax)")
  port = _load_tutorial("keras_fit")
  result = port.main(["--epochs", str(KF_EPOCHS), "--batch-size-per-replica", str(KF_PER_REPLICA),
                      "--num-train-examples", str(KF_TRAIN), "--num-test-examples", str(KF_TEST),
                      "--workdir", str(tmp_path), "--quiet"])
  want = result["one_device"]
  assert result["num_replicas"] == 8 and result["batch_size"] == 32 and KF_TRAIN % 32 == 12
  assert set(result["history"]) == {"loss", "accuracy", "learning_rate"} == set(want["history"])
  for name in ("loss", "accuracy"):
    assert len(result["history"][name]) == KF_EPOCHS
    np.testing.assert_allclose(result["history"][name], want["history"][name], rtol=1e-5, atol=1e-6, err_msg=name)
  np.testing.assert_allclose(result["learning_rates"], [1e-3, 1e-3, 1e-3, 1e-4], rtol=1e-6)
  np.testing.assert_allclose(result["history"]["learning_rate"], [1e-3, 1e-3, 1e-3, 1e-4], rtol=1e-6)
  for mine, theirs in zip(result["weights"], want["weights"], strict=True):
    np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5 * (np.abs(theirs).max() + 1.0))
  for name in ("eval", "unreplicated_eval", "replicated_eval"):
    np.testing.assert_allclose(result[name], want["eval"], rtol=1e-5, atol=1e-6, err_msg=name)
  assert result["checkpoints"] == [f"ckpt_{e:04d}.weights.h5" for e in range(1, KF_EPOCHS + 1)]
  assert result["logs"] == ["training.csv"]
  assert (tmp_path / "my_model.keras").is_file()
  # Loaded outside the scope: a plain one-device model; inside it: compiled under the strategy, replicated.
  assert result["unreplicated_strategy"] is None and result["unreplicated_devices"] == 1
  assert result["replicated_strategy"] is not None and result["replicated_devices"] == 8


# -- model_garden_ctl: TF Model Garden's run_customized_training_loop ------------------------------------------

MG = {"steps_per_epoch": 6, "epochs": 2, "steps_per_loop": 4, "batch_size_per_replica": 2, "eval_examples": 75}


def _model_garden_one_device(tutorial, *, num_replicas: int = 8, seed: int = 0) -> dict:
  """The port's training on one device, written here with plain Keras and JAX: each global batch split
  into the 8 replicas' rows by hand, each part's mean cross-entropy / 8 times the loss scale read from the
  optimizer's values, each part's gradient clipped to global norm 5 by itself (the pre-all-reduce
  callback), summed, applied by Keras's LossScaleOptimizer; the evaluation's loss each replica part's mean
  weighed by its real rows, the accuracy over the 75 examples. Only the model and its optimizer (their
  initial values), the synthetic data and the clip norm come from the port."""
  import keras  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  k, total = MG["batch_size_per_replica"], MG["steps_per_epoch"] * MG["epochs"]
  global_batch = k * num_replicas
  model = tutorial.model_fn(total, seed)
  optimizer = model.optimizer
  optimizer.build(model.trainable_variables)
  trainable = [v.value for v in model.trainable_variables]
  opt_vars = [v.value for v in optimizer.variables]
  images, labels = tutorial.load_data(total * global_batch, seed)
  eval_images, eval_labels = tutorial.load_data(MG["eval_examples"], seed + 1)

  def mean_xent(y, logits):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))

  def part_loss(trainable, opt_vars, x, y):
    logits, _ = model.stateless_call(trainable, [], x, training=True)
    raw = mean_xent(y, logits)
    with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, opt_vars))):
      scale = optimizer.scale_loss(1.0)  # the dynamic loss scale in these values
    return raw / num_replicas * scale, raw

  @jax.jit
  def step(trainable, opt_vars, x, y):
    total_grads, raws = None, []
    for r in range(num_replicas):
      part = slice(r * k, (r + 1) * k)
      g, raw = jax.grad(part_loss, has_aux=True)(trainable, opt_vars, x[part], y[part])
      g, _ = optax.clip_by_global_norm(tutorial.CLIP_NORM).update(g, optax.EmptyState())
      total_grads = g if total_grads is None else jax.tree.map(jnp.add, total_grads, g)
      raws.append(raw)
    trainable, opt_vars = optimizer.stateless_apply(opt_vars, total_grads, trainable)
    return trainable, opt_vars, jnp.stack(raws)

  history = {"train_loss": {}, "eval": {}}
  current, loops = 0, [4, 2, 4, 2]  # 4 steps per loop, up to each evaluation (every 6 steps)
  for steps in loops:
    raws = []
    for s in range(current, current + steps):
      rows = slice(s * global_batch, (s + 1) * global_batch)
      trainable, opt_vars, r = step(trainable, opt_vars, images[rows], labels[rows])
      raws.append(np.asarray(r, np.float64))
    current += steps
    history["train_loss"][current] = float(np.mean(raws))
    if current % MG["steps_per_epoch"] == 0:
      losses, weights, correct = [], [], 0
      for start in range(0, len(eval_images), global_batch):
        x, y = eval_images[start:start + global_batch], eval_labels[start:start + global_batch]
        logits, _ = model.stateless_call(trainable, [], x, training=False)
        for r in range(num_replicas):
          part = slice(r * k, min((r + 1) * k, len(x)))
          if part.start < len(x):
            losses.append(float(mean_xent(y[part], logits[part])))
            weights.append(part.stop - part.start)
        correct += int((np.argmax(np.asarray(logits), axis=1) == y).sum())
      history["eval"][current] = {"examples": sum(weights), "training_loss": float(np.average(losses, weights=weights)),
                                  "accuracy": correct / len(eval_images)}
  with keras.StatelessScope(state_mapping=list(zip(optimizer.variables, opt_vars))):
    history["iterations"] = int(optimizer.iterations.value)
  history["weights"] = [np.asarray(w) for w in trainable]
  return history


@pytest.fixture(scope="module")
def model_garden():
  return _load_tutorial("model_garden_ctl")


@pytest.fixture(scope="module")
def model_garden_reference(model_garden):
  return _model_garden_one_device(model_garden)


def _assert_model_garden_history(got: dict, want: dict) -> None:
  assert [int(s) for s in got["train_loss"]] == [4, 6, 10, 12] == list(want["train_loss"])
  np.testing.assert_allclose(list(got["train_loss"].values()), list(want["train_loss"].values()), rtol=1e-5)
  assert [int(s) for s in got["eval"]] == [6, 12]
  for s, w in want["eval"].items():
    g = got["eval"][s] if s in got["eval"] else got["eval"][str(s)]
    assert g["examples"] == w["examples"] == 75  # every example once, none of the padding
    np.testing.assert_allclose(g["training_loss"], w["training_loss"], rtol=1e-5)
    assert round(g["accuracy"] * 75) == round(w["accuracy"] * 75)
  assert got["iterations"] == want["iterations"] == 12
  for g, w in zip(got["weights"], want["weights"], strict=True):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


def test_model_garden_loop_equals_one_device(model_garden, model_garden_reference, tmp_path):
  strategy = __import__("tpustrat").MirroredStrategy()
  history = model_garden.run_customized_training_loop(strategy, model_dir=str(tmp_path), **MG)
  _assert_model_garden_history(history, model_garden_reference)
  # The learning rate written each loop is the schedule's at that step; the chief wrote both summaries.
  lr = model_garden.learning_rate_schedule(12)
  np.testing.assert_allclose(list(history["learning_rate"].values()), [float(lr(s)) for s in (4, 6, 10, 12)],
                             rtol=1e-6)
  for kind in ("train", "eval"):
    files = list((tmp_path / "summaries" / kind).glob("events.out.tfevents.*"))
    assert files and all(f.stat().st_size > 0 for f in files), kind


@pytest.mark.processes
def test_model_garden_loop_killed_after_a_save_resumes_there(model_garden_reference, tmp_path):
  # kill -9 after the checkpoint of step 6; the same command resumes at step 6 and ends as one device does.
  import signal  # pylint: disable=import-outside-toplevel
  cmd = [sys.executable, str(TUTORIALS / "model_garden_ctl.py"), "--model-dir", str(tmp_path)]
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  lines = []
  with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True) as first:
    for line in first.stdout:
      lines.append(line)
      if line.startswith("saved step 6"):
        first.send_signal(signal.SIGKILL)
        break
    first.wait(timeout=120)
  assert first.returncode == -signal.SIGKILL, "".join(lines)
  second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert second.returncode == 0, second.stdout + second.stderr
  out = second.stdout.splitlines()
  assert out[0] == "restored step 6" and not any(line.startswith("Train Step: 4/") for line in out), out
  resumed = json.loads(out[-1])
  assert [int(s) for s in resumed["train_loss"]] == [10, 12]  # only the steps after the checkpoint ran
  np.testing.assert_allclose(list(resumed["train_loss"].values()),
                             [model_garden_reference["train_loss"][s] for s in (10, 12)], rtol=1e-5)
  assert resumed["iterations"] == 12
  for g, w in zip(resumed["weights"], model_garden_reference["weights"], strict=True):
    np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
