# Two commands, each setting itself up on a fresh machine with only Python 3.11+:
#   make demo   - the flagship example on 8 emulated CPU devices (or the accelerators present)
#   make test   - the whole test suite, doctests included
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

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/classifier.py

test: $(STAMP)
	$(PY) -m pytest tests -q

bench: $(STAMP)
	$(PY) benchmarks/bench_run.py

lint: $(STAMP)
	$(PY) -m ruff check tpustrat tests examples benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
