"""Sphinx configuration of tpustrat's documentation site: `make docs` builds it into docs/_build/html.

Guides are Markdown (MyST), the API reference is generated from the docstrings (autodoc + autosummary,
one page per public name, written under docs/api/_autosummary at build time), and the tour notebook is
rendered by myst-nb with the outputs saved in it (it is executed by tests/test_notebooks.py, not here).
"""

import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tpustrat from this checkout, also without `pip install -e .`

import tpustrat  # noqa: E402

project = "tpustrat"
author = "The tpustrat authors"
copyright = "The tpustrat authors"  # noqa: A001
release = version = tpustrat.__version__

extensions = [
    "myst_nb",  # Markdown (myst-parser) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

templates_path = ["_templates"]
exclude_patterns = ["_build", "_templates", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

# `name` in docstrings and Markdown is code, as in the JAX libraries' docs (not a cross-reference).
default_role = "code"

# -- MyST ---------------------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath"]
myst_heading_anchors = 3  # [text](guide.md#a-heading) links, as on GitHub

# -- Notebooks: rendered with the outputs saved in them; tests/test_notebooks.py runs them -------------
nb_execution_mode = "off"
nb_merge_streams = True

# -- API reference ------------------------------------------------------------------------------------
autosummary_generate = True
# Written afresh by every build, so that a name taken out of docs/api/*.rst leaves no page behind.
shutil.rmtree(pathlib.Path(__file__).parent / "api" / "_autosummary", ignore_errors=True)
autosummary_imported_members = True
autodoc_typehints = "none"  # signatures as written; the docstrings say the types in words
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
add_module_names = False

# -- HTML ---------------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"tpustrat {version}"
html_static_path: list[str] = []
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    # The sidebar stops at the API reference's module pages (each lists its names) and opens only the
    # current page's branch: every page's sidebar holding the whole tree (a page per public name) made the
    # build take 3 times as long (42 s -> 12 s here).
    "max_navbar_depth": 2,
    "collapse_navbar": True,
}


# -- Text kept in one place -------------------------------------------------------------------------------
# coming_from_tensorflow.md shows "What changes, and why" from the docstring of examples/migration.py, which
# is its one source (an rST section: its underline cannot be cut off by an include's start-after).
MIGRATION_NOTES = "<!-- the bullets of examples/migration.py's \"What changes, and why\" (docs/conf.py) -->"


def _migration_notes() -> str:
  import ast

  doc = ast.get_docstring(ast.parse((ROOT / "examples" / "migration.py").read_text()))
  assert doc is not None, "examples/migration.py has no docstring"
  notes = doc.split("What changes, and why\n---------------------\n", 1)[1].split("\nRun it::", 1)[0]
  return notes.strip() + "\n"


def _insert_migration_notes(app, docname, source):
  if docname == "coming_from_tensorflow":
    assert MIGRATION_NOTES in source[0], f"{docname}.md lost the line {MIGRATION_NOTES}"
    source[0] = source[0].replace(MIGRATION_NOTES, _migration_notes())


def setup(app):
  app.connect("source-read", _insert_migration_notes)
