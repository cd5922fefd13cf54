"""The wheel as a user gets it: built, installed into a fresh virtual environment, imported and run.

    python .ci/wheel_check.py [--keep DIR]        # `make wheel`; part of `make check` and `.ci/run`

1. Copies the files git knows (tracked, and untracked ones it does not ignore) into a temporary folder, so
   that nothing left in the work tree (`build/`, stale modules) can reach the wheel, and builds the wheel
   there with `pip wheel --no-deps` (setuptools from the index, in pip's isolated build environment).
2. Checks the wheel's contents: `tpustrat/py.typed`, `tpustrat/_version.py`, no tests, examples or
   benchmarks; its metadata's version is `tpustrat/_version.py`'s, and it declares the `examples` extra.
3. Creates a fresh virtual environment (no system site-packages), installs the wheel with its runtime
   dependencies from the index, and from a folder outside the repository (so the source tree cannot be
   imported) imports tpustrat, checks it came from the environment, runs `python -m tpustrat.launch
   --version`, and runs one `strategy.run` step on 2 emulated CPU devices whose all-reduced result it checks.

Exits non-zero with the step that failed; prints each step's time.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import venv
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The smoke script: runs in the fresh environment, from outside the repository.
SMOKE = r"""
import pathlib, sys
import jax, jax.numpy as jnp, numpy as np
import tpustrat

where = pathlib.Path(tpustrat.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.prefix).resolve()), f"tpustrat imported from {where}"
assert tpustrat.__version__ == sys.argv[1], (tpustrat.__version__, sys.argv[1])

strategy = tpustrat.TPUStrategy()
assert strategy.num_replicas_in_sync == 2, strategy

def step(w, x):
  ctx = tpustrat.get_replica_context()
  total = ctx.all_reduce(tpustrat.ReduceOp.SUM, jnp.sum(x * w))
  return w - 0.5 * total, x * (ctx.replica_id_in_sync_group + 1)

batch = strategy.experimental_distribute_values_from_function(
    lambda ctx: np.full((3,), ctx.replica_id_in_sync_group + 1, np.float32))
w, scaled = strategy.run(step, args=(jnp.ones(3, jnp.float32), batch))
# Replica r holds [r + 1] * 3: the all-reduced sum is 3 + 6 = 9, so w = 1 - 4.5 everywhere.
for local in strategy.experimental_local_results(w):
  np.testing.assert_array_equal(np.asarray(local), np.full(3, -3.5, np.float32))
# scaled is [1] * 3 on replica 0 and [4] * 3 on replica 1.
summed = strategy.reduce("SUM", scaled, axis=None)
np.testing.assert_array_equal(np.asarray(summed), np.full(3, 5.0, np.float32))
print(f"tpustrat {tpustrat.__version__} from {where.parent}: one step on {strategy.num_replicas_in_sync} "
      f"replicas ({jax.devices()[0].platform}) gave the expected numbers")
"""


def say(message: str) -> None:
  print(f"[wheel_check] {message}", flush=True)


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
  shown = ["<SMOKE>" if c == SMOKE else str(c) for c in command]
  say("$ " + " ".join(shown))
  return subprocess.run(command, check=True, **kwargs)


def source_files() -> list[pathlib.Path]:
  """The repository's files as a clean clone plus the untracked, not ignored, ones would have them."""
  try:
    command = ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    out = subprocess.run(command, check=True, capture_output=True).stdout
  except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist, an export): take it all
    skip = {".git", "build", "dist", "__pycache__"}
    return [p.relative_to(ROOT) for p in ROOT.rglob("*")
            if p.is_file() and not any(part in skip or part.startswith(".venv") or part.endswith(".egg-info")
                                       for part in p.relative_to(ROOT).parts)]
  return [pathlib.Path(name) for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def build_wheel(work: pathlib.Path) -> pathlib.Path:
  source = work / "source"
  for relative in source_files():
    (source / relative).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / relative, source / relative)
  dist = work / "dist"
  run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(source)])
  wheels = list(dist.glob("tpustrat-*.whl"))
  assert len(wheels) == 1, wheels
  return wheels[0]


def expected_version() -> str:
  text = (ROOT / "tpustrat" / "_version.py").read_text()
  return re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE).group(1)


def check_contents(wheel: pathlib.Path, version: str) -> None:
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
  for required in ("tpustrat/py.typed", "tpustrat/__init__.py", "tpustrat/_version.py", "tpustrat/launch.py"):
    assert required in names, f"{wheel.name} lacks {required}"
  stray = [n for n in names if n.split("/")[0] in ("tests", "examples", "benchmarks", "notebooks", "docs")]
  assert not stray, f"{wheel.name} holds files outside the package: {stray[:5]}"
  assert metadata["Version"] == version, (metadata["Version"], version)
  extras = metadata.get_all("Provides-Extra") or []
  assert "examples" in extras and "dev" in extras, extras
  say(f"{wheel.name}: {len(names)} files, py.typed present, version {metadata['Version']}, extras {extras}")


def install_and_run(wheel: pathlib.Path, work: pathlib.Path, version: str) -> None:
  env_dir = work / "venv"
  started = time.perf_counter()
  venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
  python = env_dir / "bin" / "python"
  say(f"fresh virtual environment in {time.perf_counter() - started:.0f} s")
  started = time.perf_counter()
  run([str(python), "-m", "pip", "install", "--quiet", str(wheel)])
  say(f"wheel and its runtime dependencies installed in {time.perf_counter() - started:.0f} s")
  outside = work / "elsewhere"
  outside.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONNOUSERSITE="1")
  line = run([str(python), "-m", "tpustrat.launch", "--version"], cwd=outside, env=env, capture_output=True,
             text=True).stdout.strip()
  say(line)
  assert line.startswith(f"tpustrat {version} (jax "), line
  started = time.perf_counter()
  run([str(python), "-c", SMOKE, version], cwd=outside, env=env)
  say(f"import and one step in {time.perf_counter() - started:.0f} s")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
  parser.add_argument("--keep", metavar="DIR",
                      help="work in DIR and leave it there (default: a temporary folder)")
  args = parser.parse_args(argv)
  started = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="tpustrat-wheel-") as temporary:
    work = pathlib.Path(args.keep or temporary).resolve()
    if args.keep:
      shutil.rmtree(work, ignore_errors=True)
      work.mkdir(parents=True)
    version = expected_version()
    wheel = build_wheel(work)
    say(f"built {wheel.name} in {time.perf_counter() - started:.0f} s")
    check_contents(wheel, version)
    install_and_run(wheel, work, version)
  say(f"passed in {time.perf_counter() - started:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
