# User-facing targets: `make demo` and `make test` (and `make lint`, `make format` for contributors). Each
# creates .venv and installs the project first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= $(CURDIR)/demo_output

.PHONY: demo test test-all lint format install clean

# The gpu-plan extra's CUDA plugin and cuDNN (pretrain.plan --topology=h100:8 without a GPU) go beside the venv,
# not into it: tests/conftest.py puts them on the test workers' path, so that the suite's many other JAX
# processes do not load the plugin (0.3 s and 460 MB each). The plugin's version is jaxlib's.
GPU_PLAN_DIR := $(VENV)/gpu-plan

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,tpu,lint]"
	$(PY) -m pip install --quiet --upgrade --no-deps --target $(GPU_PLAN_DIR) \
	    $$($(PY) -c 'import jaxlib; v = jaxlib.__version__; print(f"jax-cuda13-plugin=={v} jax-cuda13-pjrt=={v}")') \
	    "nvidia-cudnn-cu13>=9.12,<10"
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
