"""The documentation's code runs, on the 8 emulated CPU devices: the docstring examples of every tpustrat
module, and the code blocks of README.md and docs/ marked `<!-- tests/test_docs.py runs this block -->`.
Also: relative links in those pages point at files of the repository, and docs/api lists every public name.
"""

import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tpustrat

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(tpustrat.__path__, "tpustrat.")
    if not m.name.endswith("__main__") and not m.name.endswith(".launch"))


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
  module = importlib.import_module(name)
  globs = {"jax": jax, "jnp": jnp, "np": np, "tpustrat": tpustrat}
  globs.update({k: getattr(module, k) for k in dir(module) if not k.startswith("__")})
  result = doctest.testmod(module, extraglobs=globs, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
                           verbose=False, report=True)
  assert result.failed == 0, f"{result.failed} doctest(s) failed in {name}"
  if name in ("tpustrat._src.strategy", "tpustrat._src.values", "tpustrat._src.context"):
    assert result.attempted > 0, f"no doctest found in {name}"


# -- Code blocks of the README and the documentation that run -------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
RUNS = "<!-- tests/test_docs.py runs this block -->"


def marked_blocks(path: pathlib.Path) -> dict[str, str]:
  """{the heading of the section it is in: its code} for each ```python block of the Markdown page `path`
  right after a line `RUNS`."""
  blocks, heading, fence = {}, None, False
  lines = path.read_text().splitlines()
  for i, line in enumerate(lines):
    if line.lstrip().startswith("```"):
      fence = not fence
    if line.startswith("#") and not fence:
      heading = line.lstrip("#").strip()
    if line.strip() == RUNS:
      where = f"{path.relative_to(ROOT)} line {i + 2}"
      assert lines[i + 1].strip() == "```python", f"{where}: a ```python block must follow {RUNS}"
      assert heading not in blocks, f"{where}: two marked blocks under the heading {heading!r}"
      end = lines.index("```", i + 2)
      blocks[heading] = "\n".join(lines[i + 2:end]) + "\n"
  return blocks


MARKED = [(path, heading) for path in PAGES for heading in marked_blocks(path)]


def run_block(path: pathlib.Path, heading: str) -> dict:
  namespace = {"__name__": "docs"}
  exec(compile(marked_blocks(path)[heading], str(path.relative_to(ROOT)), "exec"), namespace)  # noqa: S102
  return namespace


def test_the_readme_and_the_guides_have_blocks_that_run():
  pages = {str(path.relative_to(ROOT)) for path, _ in MARKED}
  assert {"README.md", "docs/getting_started.md", "docs/guides/training_loop.md"} <= pages, sorted(pages)


@pytest.mark.parametrize("path, heading", MARKED, ids=[f"{p.relative_to(ROOT)}: {h}" for p, h in MARKED])
def test_marked_block_runs(path, heading, capsys):
  namespace = run_block(path, heading)
  out = capsys.readouterr().out
  if heading == "A training loop with accumulation, mixed precision and numerics checks":
    state, losses, loss = namespace["state"], namespace["losses"], namespace["loss"]
    first, last = float(losses.values[0][0]), float(loss.values[0])
    assert last < 0.2 * first, (first, last)  # it trains (11.9 -> 1.05)
    assert isinstance(state["opt"], tpustrat.mixed_precision.LossScaleState)
    assert all(isinstance(v, tpustrat.Mirrored) for v in jax.tree.leaves(
        state, is_leaf=lambda v: isinstance(v, tpustrat.DistributedValues)))
    assert state["params"]["w"].values[0].dtype == np.float32  # mixed_float16's variables
    assert "[" in out
  if heading == "A first program":
    assert isinstance(namespace["w"], tpustrat.Mirrored) and isinstance(namespace["local"], tpustrat.PerReplica)
    assert out.strip(), "the first program prints its results"


# -- Links and the API reference ---------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_in_the_repository(path):
  """The README's links into docs/ work on GitHub; the docs build checks its own links too (-W)."""
  fence = False
  for number, line in enumerate(path.read_text().splitlines(), 1):
    if line.lstrip().startswith("```"):
      fence = not fence
    if fence:
      continue
    for target in LINK.findall(line):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      file = (path.parent / target.split("#")[0]).resolve()
      assert file.is_relative_to(ROOT), f"{path.relative_to(ROOT)}:{number}: {target} is outside the repository"
      assert file.exists(), f"{path.relative_to(ROOT)}:{number}: {target} does not exist"


PUBLIC_MODULES = ["tpustrat", "tpustrat.ops", "tpustrat.mixed_precision", "tpustrat.keras", "tpustrat.embedding",
                  "tpustrat.checkpoint", "tpustrat.cluster_resolver", "tpustrat.experimental", "tpustrat.launch",
                  "tpustrat.summary"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_api_reference_lists_every_public_name(name):
  module = importlib.import_module(name)
  page = ROOT / "docs" / "api" / f"{name.removeprefix('tpustrat.') if name != 'tpustrat' else name}.rst"
  listed = {line.strip() for line in page.read_text().splitlines() if line.startswith("   ") and
            not line.strip().startswith(":")}
  public = {n for n in module.__all__ if not inspect.ismodule(getattr(module, n))}
  assert public <= listed, f"{page.relative_to(ROOT)} does not list {sorted(public - listed)}"
  assert listed <= public, f"{page.relative_to(ROOT)} lists names that are not public: {sorted(listed - public)}"
