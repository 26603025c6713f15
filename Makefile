# Resident: `make serve`, `make cluster`, `make test`, `make bench`, `make lint`. Everything installs into .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (on these machines' disk). On a CUDA machine: make TORCH=torch serve
TORCH ?= torch==2.13.0
PORT ?= 8080
export PORT
# TorchServe backends behind the front for `make cluster` ("auto": one per visible device).
BACKENDS ?= 2

.PHONY: install models serve cluster test bench bench-all device-check lint clean

$(VENV)/.installed: pyproject.toml
	@command -v java >/dev/null || { echo "TorchServe needs Java 17: sudo apt-get install -y openjdk-17-jre-headless"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

models: install
	$(PY) -m model_store.build_models --only tiny
	$(PY) -m model_store.build_smollm2

# The front on $(PORT) before one TorchServe backend on $(PORT)+10 (docs/DEPLOY.md).
serve: install
	$(PY) -m launch serve

# The front on $(PORT) before $(BACKENDS) TorchServe backends on internal ports (docs/DEPLOY.md).
cluster: install
	BACKENDS=$(BACKENDS) $(PY) -m launch cluster

test: install models
	$(PY) -m pytest

bench: install
	$(PY) -m model_store.build_models --only bench
	$(PY) -m benchmarks.first_vs_followup --start-server

# Every benchmark in turn (tens of minutes on a 2-core machine); results in benchmarks/results/.
bench-all: bench
	$(PY) -m benchmarks.decode --static
	$(PY) -m benchmarks.load --start-server
	$(PY) -m benchmarks.adapters
	$(PY) -m benchmarks.speculative
	$(PY) -m benchmarks.front_overhead

# The device check (docs/DEVICE_CHECK.md): on a CUDA machine a 7B-shaped LLaVA and a Llama-3-8B slice with
# random weights, one table (paths vs transformers, host syncs, kernels, timings vs the floor, memory); without
# CUDA the CPU smoke, exit 0. PYTHON: a python with torch; WHEELS: scripts/device_wheels.sh's folder. No Java.
device-check:
	PYTHON=$(PYTHON) WHEELS=$(WHEELS) scripts/device_check.sh

# ruff (pyproject.toml's rule set), the layers of session/ as import contracts (pyproject.toml,
# [tool.importlinter]), mypy over session/ ([tool.mypy]), no session/ module over 450 lines
# (scripts/check_file_sizes.py), and, since the images cannot be built here (no Docker engine), the
# Dockerfiles and the shell entrypoints.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) scripts/check_file_sizes.py
	$(VENV)/bin/hadolint docker/Dockerfile.cuda docker/Dockerfile.neuron
	$(VENV)/bin/shellcheck docker/serve scripts/device_check.sh scripts/device_wheels.sh scripts/build_llama_cpp.sh

clean:
	rm -rf build models benchmarks/results
