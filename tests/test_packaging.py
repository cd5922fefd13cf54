"""Packaging habits: the version is written once, the launcher prints it, CHANGELOG.md has its section, and
what the examples and notebooks import beyond tpustrat's own dependencies is the `examples` extra, which an
example that misses it names.

The wheel itself (built, installed into a fresh virtual environment, imported and run from outside the
repository) is checked by `.ci/wheel_check.py` (`make wheel`), not here: it needs minutes and the index.
"""

import ast
import importlib.metadata
import json
import pathlib
import platform
import re
import subprocess
import sys
import tomllib

import jax
import pytest

import tpustrat
from tpustrat import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def normalized(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def distribution_names(requirements: list[str]) -> set[str]:
  """The distributions `requirements` (PEP 508 strings) name, normalized."""
  return {normalized(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in requirements}


def imported_modules(source: str, filename: str) -> set[str]:
  """The top-level names of every module `source` imports (absolute imports, wherever they stand)."""
  found = set()
  for node in ast.walk(ast.parse(source, filename)):
    if isinstance(node, ast.Import):
      found |= {a.name.partition(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      found.add(node.module.partition(".")[0])
  return found


def notebook_source(path: pathlib.Path) -> str:
  cells = json.loads(path.read_text())["cells"]
  code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
  # IPython's magics and shell escapes are not Python.
  lines = [line for cell in code for line in cell.splitlines()]
  return "\n".join(line for line in lines if not line.lstrip().startswith(("%", "!")))


def third_party(modules: set[str]) -> set[str]:
  local = {p.stem for p in EXAMPLES}
  return {m for m in modules if m not in sys.stdlib_module_names and m not in local and m != "tpustrat"}


def extra_modules() -> set[str]:
  """The importable top-level modules that the `examples` extra's distributions install."""
  extra = distribution_names(PYPROJECT["project"]["optional-dependencies"]["examples"])
  return {module for module, dists in importlib.metadata.packages_distributions().items()
          if any(normalized(d) in extra for d in dists)}


# -- the version ------------------------------------------------------------------------------------------


def test_the_version_is_written_in_one_place():
  project = PYPROJECT["project"]
  assert "version" not in project and "version" in project["dynamic"]
  assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tpustrat._version.__version__"}
  from tpustrat import _version
  assert tpustrat.__version__ == _version.__version__
  version = tpustrat.__version__
  assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?(a|b|rc|dev|post)\d+)?", version), version
  # Nowhere else in the package is the version written out.
  for path in (ROOT / "tpustrat").rglob("*.py"):
    if path.name != "_version.py":
      assert f'"{tpustrat.__version__}"' not in path.read_text(), path


def test_launch_version_names_tpustrat_jax_jaxlib_and_python(capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.main(["--version"])
  assert exit_info.value.code == 0
  line = capsys.readouterr().out.strip()
  assert line == (f"tpustrat {tpustrat.__version__} (jax {jax.__version__}, "
                  f"jaxlib {importlib.metadata.version('jaxlib')}, python {platform.python_version()})")


def test_the_changelog_has_an_unreleased_section_and_one_for_this_version():
  text = (ROOT / "CHANGELOG.md").read_text()
  headings = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
  assert headings[0] == "Unreleased", headings
  assert tpustrat.__version__ in headings, f"CHANGELOG.md lacks {tpustrat.__version__}: {headings}"


# -- the examples extra -----------------------------------------------------------------------------------


def test_what_examples_and_notebooks_import_is_a_dependency_or_in_the_examples_extra():
  project = PYPROJECT["project"]
  allowed = distribution_names(project["dependencies"] + project["optional-dependencies"]["examples"])
  allowed |= {"jaxlib"}
  owners = importlib.metadata.packages_distributions()
  sources = [(p.name, p.read_text()) for p in EXAMPLES] + [(p.name, notebook_source(p)) for p in NOTEBOOKS]
  missing = []
  for name, source in sources:
    for module in sorted(third_party(imported_modules(source, name))):
      dists = {normalized(d) for d in owners.get(module, [module])}
      if not dists & allowed:
        missing.append(f"{name} imports {module} ({', '.join(sorted(dists))})")
  assert not missing, "neither a dependency nor in the examples extra:\n" + "\n".join(missing)


def test_dev_installs_the_examples_extra():
  assert "tpustrat[examples]" in PYPROJECT["project"]["optional-dependencies"]["dev"]


OPTIONAL = extra_modules()
NEEDING_EXTRA = [p for p in EXAMPLES if third_party(imported_modules(p.read_text(), p.name)) & OPTIONAL]

# Run an example as `python examples/NAME.py` would, with the extra's modules hidden: a finder ahead of the
# others fails their import as Python does when they are not installed.
_HIDDEN_RUN = """\
import runpy, sys
hidden = set(sys.argv[2:])
class Hide:
  def find_spec(self, name, path=None, target=None):
    if name.partition(".")[0] in hidden:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
path = sys.argv[1]
sys.argv = [path, "--help"]
runpy.run_path(path, run_name="__main__")
"""


def test_some_examples_need_the_extra():
  assert {"classifier.py", "char_transformer.py"} <= {p.name for p in NEEDING_EXTRA}


@pytest.mark.parametrize("path", NEEDING_EXTRA, ids=lambda p: p.name)
@pytest.mark.processes
def test_an_example_without_the_extra_says_which_extra_to_install(path):
  result = subprocess.run([sys.executable, "-c", _HIDDEN_RUN, str(path), *sorted(OPTIONAL)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
  last = result.stderr.strip().splitlines()[-1]
  assert "pip install 'tpustrat[examples]'" in last and "Traceback" not in result.stderr, result.stderr
  assert re.search(r"\b(tqdm|sklearn|matplotlib)\b", last), last  # names the module it missed
