"""Multi-host data parallelism on one machine: the flagship classifier as 2 processes x 4 devices.

What this example shows
-----------------------
A multi-host TPU slice runs one copy of the training program per host; the copies form one job whose
replicas span every host's devices. `python -m tpustrat.launch` reproduces that on one machine, so
multi-host code can be tried (and tested) on a laptop: it starts ``N`` processes of a program, each with
``M`` emulated CPU devices, joined by JAX's distributed runtime over loopback with gloo collectives.

This driver runs the unchanged flagship example, `examples/classifier.py`, that way::

    python -m tpustrat.launch --num-processes 2 --devices-per-process 4 examples/classifier.py --epochs 10

and follows process 0's report with a progress bar. Nothing in the classifier is multi-host specific:

* `TPUStrategy()` finds the job from the variables the launcher sets (``TPUSTRAT_COORDINATOR_ADDRESS``,
  ``TPUSTRAT_NUM_PROCESSES``, ``TPUSTRAT_PROCESS_ID``) and spans all 8 devices: 8 replicas, 4 per
  process, exactly as 8 devices in one process;
* every process builds the same input pipeline (`experimental_make_numpy_dataset`, same seed, same
  shuffle), so it iterates the same global batches; `experimental_distribute_dataset` transfers only
  the rows of its own replicas (the padded last batch of an epoch included), and the step's
  `valid_mask` and the evaluation's `per_example` outputs see the same real rows as in one process;
* collectives (the gradient sum inside `jax.grad`, `all_reduce`) cross the process boundary, and
  `strategy.reduce` of per-replica results gives every process the global answer;
* only process 0 prints (`jax.process_index() == 0`).

So the losses and accuracies match the single-process run (`python examples/classifier.py`) up to the
order of floating-point sums (the test checks it).

TensorFlow -> tpustrat
----------------------
On a TF multi-host TPU slice every host runs::

    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="my-pod")
    tf.config.experimental_connect_to_cluster(resolver)
    tf.tpu.experimental.initialize_tpu_system(resolver)
    strategy = tf.distribute.TPUStrategy(resolver)

The tpustrat calls are the same (`tpustrat.cluster_resolver.TPUClusterResolver`,
`tpustrat.experimental_connect_to_cluster`, which calls `jax.distributed.initialize` once,
`tpustrat.initialize_tpu_system`, `tpustrat.TPUStrategy`); on a Cloud TPU VM slice the resolver finds the
hosts by itself, and elsewhere (GPU clusters, this launcher) it reads the coordinator address, process
count and process id from its arguments or the ``TPUSTRAT_*`` variables. TF's
`experimental_distribute_dataset` / `distribute_datasets_from_function` keep their meaning: one input
pipeline per host.

Run it::

    python examples/multihost.py                                  # 2 processes x 4 devices, 10 epochs
    python examples/multihost.py --num-processes 4 --devices-per-process 2 -- --epochs 5
    python -m tpustrat.launch -n 2 -d 4 examples/classifier.py    # the same, without this driver

Arguments after ``--`` (or any this driver does not know) go to `examples/classifier.py`.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

try:  # packages beyond tpustrat's own: its `examples` extra
  from tqdm.auto import tqdm
except ImportError as e:
  raise SystemExit(f"{e}. This example needs tpustrat's `examples` extra: "
                   "pip install 'tpustrat[examples]' (in a clone: pip install -e '.[examples]')") from e

CLASSIFIER = pathlib.Path(__file__).resolve().with_name("classifier.py")

# What process 0 of the classifier prints (see examples/classifier.py).
_STRATEGY = re.compile(r"^\[proc 0\] (TPUStrategy\(num_replicas_in_sync=(\d+)\).*)$")
_EPOCH = re.compile(r"^\[proc 0\] epoch\s+(\d+)/\s*(\d+): loss ([\d.]+), train accuracy ([\d.]+)")
_TEST = re.compile(r"^\[proc 0\] test accuracy ([\d.]+)")


def launch_command(num_processes: int, devices_per_process: int, classifier_args: Sequence[str],
                   timeout: float | None = None) -> list[str]:
  """The command line: ``python -m tpustrat.launch -n N -d M [--timeout T] examples/classifier.py ARGS``."""
  command = [sys.executable, "-m", "tpustrat.launch", "--num-processes", str(num_processes),
             "--devices-per-process", str(devices_per_process)]
  if timeout is not None:
    command += ["--timeout", str(timeout)]
  return command + [str(CLASSIFIER), *classifier_args]


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("-n", "--num-processes", type=int, default=2, help="processes (emulated hosts)")
  parser.add_argument("-d", "--devices-per-process", type=int, default=4, help="CPU devices per process")
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the launcher stops the job")
  parser.add_argument("--quiet", action="store_true", help="no progress bar and no printing")
  args, rest = parser.parse_known_args(argv)
  if rest and rest[0] == "--":
    rest = rest[1:]
  if not any(a == "--epochs" or a.startswith("--epochs=") for a in rest):
    rest = ["--epochs", "10", *rest]
  if args.num_processes < 1 or args.devices_per_process < 1:
    parser.error("--num-processes and --devices-per-process must be >= 1")
  return args, rest


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the classifier under the launcher; returns process 0's results (raises if the job fails)."""
  args, classifier_args = parse_args(argv)
  say = (lambda *a: None) if args.quiet else tqdm.write
  command = launch_command(args.num_processes, args.devices_per_process, classifier_args, args.timeout)
  say("$ " + shlex.join(["python", *command[1:]]))

  start = time.perf_counter()
  # The launcher prefixes each process's lines with "[proc i]". stderr (tqdm bars, JAX and gloo logs) is
  # kept for the error message; stdout is parsed and echoed.
  with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1) as proc:
    stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
    drain = threading.Thread(target=lambda: stderr_tail.extend(proc.stderr), daemon=True)
    drain.start()
    summary: dict[str, Any] = {"losses": [], "train_accuracies": [], "test_accuracy": None,
                               "num_replicas": None}
    with tqdm(total=None, unit="epoch", disable=args.quiet, leave=False) as bar:
      for line in proc.stdout:
        line = line.rstrip("\n")
        if m := _STRATEGY.match(line):
          summary["num_replicas"] = int(m.group(2))
        elif m := _EPOCH.match(line):
          bar.total = int(m.group(2))
          summary["losses"].append(float(m.group(3)))
          summary["train_accuracies"].append(float(m.group(4)))
          bar.update()
          bar.set_postfix(loss=m.group(3))
        elif m := _TEST.match(line):
          summary["test_accuracy"] = float(m.group(1))
        if line.startswith("[proc ") and "[Gloo]" not in line:  # gloo's connection chatter: not news
          say(line)
    returncode = proc.wait()
    drain.join(5)
  if returncode != 0:
    raise RuntimeError(f"the launcher exited with status {returncode}; last lines of its stderr:\n"
                       + "\n".join(stderr_tail))
  if summary["test_accuracy"] is None or not summary["losses"]:
    raise RuntimeError("the classifier did not report its results; its stderr ended with:\n"
                       + "\n".join(stderr_tail))
  elapsed = time.perf_counter() - start
  say(f"{args.num_processes} processes x {args.devices_per_process} devices = {summary['num_replicas']} "
      f"replicas: loss {summary['losses'][0]:.4f} -> {summary['losses'][-1]:.4f} over "
      f"{len(summary['losses'])} epochs, test accuracy {summary['test_accuracy']:.4f}, {elapsed:.1f} s "
      "in all (start-up included)")
  return {**summary, "num_processes": args.num_processes, "devices_per_process": args.devices_per_process,
          "final_loss": summary["losses"][-1], "seconds": elapsed, "command": command}


if __name__ == "__main__":
  main()
