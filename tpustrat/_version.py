"""tpustrat's version, written here and nowhere else.

`pyproject.toml` reads it (``[tool.setuptools.dynamic]``), `tpustrat.__version__` re-exports it, and
``python -m tpustrat.launch --version`` prints it. Bump it together with a new section of `CHANGELOG.md`.
"""

__version__ = "0.1.0"
