# Two user-facing targets: `make demo` and `make test`. Both create .venv and install the project first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= $(CURDIR)/demo_output

.PHONY: demo test test-all install clean

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,tpu]"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m pretrain.demo --output_dir=$(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(DEMO_DIR) .pytest_cache
