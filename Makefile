# User-facing targets: `make demo` and `make test` (and `make lint`, `make format` for contributors). Each
# creates .venv and installs the project first.
PYTHON ?= python3
VENV ?= .venv
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

# Two pytest-xdist workers, each running whole test modules (their fixtures are made once), the long ones first
# (tests/conftest.py): much of a test is single-threaded (imports, tracing, compiling), so two cores stay busy.
# The slowest tests are listed at the end: the suite must stay within CI's 15 minutes.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20

test: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-all: $(STAMP)
	$(PYTEST) tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Formats the Python files changed since the last commit (FILES=... for others) with .style.yapf.
FILES ?= $(shell git diff --name-only --diff-filter=AM HEAD -- '*.py')
format: $(STAMP)
	$(if $(strip $(FILES)),$(VENV)/bin/yapf -i $(FILES),@echo "no changed Python files")

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
