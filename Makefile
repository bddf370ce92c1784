# kvcompress: set up, run the default sweep through a local Prefect deployment, test.
# `make demo` on a fresh machine does everything; `make test` runs the suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export KVCOMPRESS_HOME := $(CURDIR)
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_API_URL ?= http://127.0.0.1:4200/api
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1

.PHONY: setup demo server pool deploy worker workers default-run report speed stop test benchmarks

setup: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $@

# the tests also need Chromium (HTML report screenshot test)
$(VENV)/.installed-test: $(VENV)/.installed
	bash scripts/setup.sh $(VENV) --test
	touch $@

demo: setup
	bash scripts/prefect_local.sh demo

server pool deploy worker stop: setup
	bash scripts/prefect_local.sh $@

N ?= 2
workers: setup
	bash scripts/prefect_local.sh workers $(N)

default-run: setup
	bash scripts/prefect_local.sh run default

report: setup
	$(VENV)/bin/kvcompress report

# decode throughput at equal KV memory on the embedded model (kvcompress/grids/speed-cpu.yaml, docs/speed.md)
speed: setup
	$(VENV)/bin/kvcompress sweep speed-cpu

# two processes, a test file to each at a time (so module fixtures, the Prefect deployment among them,
# are made once): many tests wait on subprocesses (Prefect servers, workers, sweeps) while the other
# process computes. `pytest -n 0` runs it in one.
test: $(VENV)/.installed-test
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# every CPU suite at smoke-run sizes (a few minutes on two cores); the documented tables: `python -m
# benchmarks SUITE [--gpu]` without --quick (benchmarks/__main__.py)
benchmarks: setup
	$(PY) -m benchmarks quality e2e kernels memory workers --quick
