# Each command sets itself up on a fresh machine with only Python 3.11+:
#   make demo   - the flagship example on 8 emulated CPU devices (or the accelerators present)
#   make test   - the tests that run in one process, doctests included (the README's test command)
#   make test-processes - the tests that start processes (multi-process jobs, scripts, notebooks)
#   make test-all - both in one run
#   make check  - what .ci/run runs: lint, types, wheel, docs, test, test-processes, every one even after a
#                 failure, timed
#                 (each is a target of its own: make lint, make types, make wheel, make docs)
#   make bench  - every benchmark (about 8 min on 2 cores), one table of every figure in benchmarks/RESULTS.md
# Another interpreter gets a virtual environment of its own, named after its version, so the default
# .venv is left alone:
#   make test PYTHON=~/.pyenv/versions/3.12.1/bin/python3.12   (or PYTHON=python3.12: venv .venv312)
# VENV=... names the virtual environment explicitly.
PYTHON ?= python3
ifeq ($(origin PYTHON),command line)
  PYTHON_TAG := $(subst .,,$(patsubst python%,%,$(notdir $(PYTHON))))
  VENV := .venv$(or $(PYTHON_TAG),-$(notdir $(PYTHON)))
else
  VENV := .venv
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-processes test-all bench lint types wheel docs check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/classifier.py

# Two pytest-xdist workers (TEST_WORKERS=...; 0 runs in this process), modules kept whole (tests/conftest.py).
# `make test`: every test that runs in this process; `make test-processes`: the tests that start processes
# (launched multi-process jobs, example and benchmark scripts, notebooks); `make test-all`: both in one run.
# CI runs test, then test-processes. Three workers on the 2 cores were measured and not kept
# (docs/development.md).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) -m "not processes"

test-processes: $(STAMP)
	$(PY) -m pytest tests -q -n $(TEST_WORKERS) -m processes

test-all: $(STAMP)
	$(PY) -m pytest tests -q -n $(TEST_WORKERS)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

lint: $(STAMP)
	$(PY) -m ruff check tpustrat tests examples benchmarks .ci

types: $(STAMP)
	$(PY) -m mypy tpustrat

# The wheel built from the files git knows, installed into a fresh venv, imported and run from outside the
# repository (.ci/wheel_check.py; about 1 min with pip's cache warm).
wheel: $(STAMP)
	$(PY) .ci/wheel_check.py

# The documentation site (docs/conf.py: Sphinx, myst-nb, sphinx-book-theme, the `docs` extra) into
# docs/_build/html, warnings as errors. -E: every page is read again, so a warning is never hidden by a
# previous build (about 15 s on 2 cores). Open docs/_build/html/index.html.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

# Cheapest first, so the quick failures show within minutes; every step runs even after one fails.
CHECK_STEPS ?= lint types wheel docs test test-processes
check: $(STAMP)
	@MAKE='$(MAKE)' bash .ci/steps $(CHECK_STEPS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache build dist docs/_build docs/api/_autosummary
