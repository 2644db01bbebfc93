# msa_fed: two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo federation test test-fast bench proto clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel on disk: a bare `torch` requirement would pull a CUDA build.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: setup
	$(BIN)/msa-fed demo

# registry, three sites, Ray (non-default ports), job, model list/download: deploy/federation.sh
federation: setup
	PY=$(abspath $(BIN))/python deploy/federation.sh

test: setup
	$(BIN)/python -m pytest -q -ra --durations=15

test-fast: setup
	$(BIN)/python -m pytest -q -x -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_core.py
	$(BIN)/python benchmarks/bench_runtime.py
	$(BIN)/python benchmarks/bench_control.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
