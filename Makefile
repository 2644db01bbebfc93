# msa_fed: two commands on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup demo federation federation-cluster lint typecheck test test-fast test-quick bench proto clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel on disk: a bare `torch` requirement would pull a CUDA build.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[coordinator,test]'
	touch $(STAMP)

demo: setup
	$(BIN)/msa-fed demo

# federated topology: registry, three `site serve` processes, job, model list/show/download/report,
# site status: deploy/federated.sh
federation: setup
	PY=$(abspath $(BIN))/python deploy/federated.sh

# cluster topology: registry, three sites, one Ray whose node carries the sites (non-default ports),
# job, model list/download: deploy/federation.sh
federation-cluster: setup
	PY=$(abspath $(BIN))/python deploy/federation.sh

# `make test` = lint + type check + the whole suite (what CI runs).  `make lint` also checks the
# formatting, which becomes part of `make test` once the tree has been formatted.
lint: setup typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

# The suite runs on TEST_WORKERS processes (pytest-xdist), a test file per worker at a time: most
# of its time is real processes, Ray and sockets waiting on each other, so three workers on two
# cores overlap the waits.  TEST_WORKERS=0 runs it in one process.  tests/conftest.py schedules
# --dist loadfile: the heaviest files first (HEAVY_FILES), a test at a time in SPLIT_FILES.
# Each worker's BLAS runs on one thread (TEST_BLAS_THREADS): three workers on two cores, each
# with a BLAS thread per core, spend their time handing the cores to each other.
TEST_WORKERS ?= 3
TEST_BLAS_THREADS ?= 1
BLAS_ENV := OMP_NUM_THREADS=$(TEST_BLAS_THREADS) OPENBLAS_NUM_THREADS=$(TEST_BLAS_THREADS) MKL_NUM_THREADS=$(TEST_BLAS_THREADS)
test: setup typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BLAS_ENV) $(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile

# core, control, the in-process API, local runtime, artifacts: no Ray, no data sets, no long runs
test-fast: setup
	$(BIN)/python -m pytest -q -x -m "not slow and not ray and not cluster and not data"

# the inner loop: core math, configuration, the control plane on port 0, the in-process API and CLI,
# artifacts (marker quick, tests/conftest.py).  Under a minute on an idle two-core machine; the run
# fails when it passes its budget: CPU seconds (load does not stretch them) and wall seconds scaled
# by the load per core (sleeps show there)
QUICK_CPU_S  ?= 60
QUICK_WALL_S ?= 60
test-quick: setup
	MSA_FED_QUICK_CPU_S=$(QUICK_CPU_S) MSA_FED_QUICK_WALL_S=$(QUICK_WALL_S) $(BIN)/python -m pytest -q -x -m quick

bench: setup
	$(BIN)/python benchmarks/bench_core.py
	$(BIN)/python benchmarks/bench_runtime.py
	$(BIN)/python benchmarks/bench_control.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
