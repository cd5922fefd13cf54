"""Sphinx configuration of tpustrat's documentation site: `make docs` builds it into docs/_build/html.

Guides are Markdown (MyST), the API reference is generated from the docstrings (autodoc + autosummary,
one page per public name, written under docs/api/_autosummary at build time), and the tour notebook is
rendered by myst-nb with the outputs saved in it (it is executed by tests/test_notebooks.py, not here).
"""

import os
import pathlib
import shutil
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")  # tpustrat.keras.SyncBatchNormalization's page imports Keras

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
html_static_path = ["_static"]
html_css_files = ["tpustrat.css"]  # the article as wide as the window allows (wide tables and code blocks)
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    # The sidebar stops at the API reference's module pages (each lists its names) and opens only the
    # current page's branch: every page's sidebar holding the whole tree (a page per public name) made the
    # build take 3 times as long (42 s -> 12 s here).
    "max_navbar_depth": 2,
    "collapse_navbar": True,
}
