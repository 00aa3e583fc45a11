# nebula-rl developer commands. `make demo` and `make test` are the README's quick start.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-all lint format typecheck bench clean

$(BIN)/nebula-rl: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned requirement would pull the CUDA build (GBs).
	# Users with a GPU install their own torch build before running this.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

setup: $(BIN)/nebula-rl

demo: setup
	$(BIN)/nebula-rl train --config configs/demo.toml

test: setup
	$(BIN)/python -m pytest -q -m "not slow and not gpu"

test-all: setup
	$(BIN)/python -m pytest -q -m "not gpu"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: setup
	$(BIN)/mypy

clean:
	rm -rf outputs .pytest_cache .ruff_cache .mypy_cache
