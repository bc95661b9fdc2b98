# User-facing targets: `make demo` and `make test` (and `make lint`, `make format` for contributors). Each
# creates .venv and installs the project first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= $(CURDIR)/demo_output

.PHONY: demo test test-all lint format install clean

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,tpu,lint]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m pretrain.demo --output_dir=$(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Formats the Python files changed since the last commit (FILES=... for others) with .style.yapf.
FILES ?= $(shell git diff --name-only --diff-filter=AM HEAD -- '*.py')
format: $(STAMP)
	$(if $(strip $(FILES)),$(VENV)/bin/yapf -i $(FILES),@echo "no changed Python files")

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
