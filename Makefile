# nebula-rl developer commands. `make demo` and `make test` are the README's quick start.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo vlm-demo wfm-demo test test-all lint format typecheck bench clean

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

# GRPO of a tiny vision-language model on images (see configs/vlm_demo.toml; ~5 min on 2 cores).
vlm-demo: setup
	$(BIN)/nebula-rl train --config configs/vlm_demo.toml

wfm-demo: setup
	$(BIN)/python -m nebula_rl.flow.demo --output-dir outputs/wfm-demo

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

# Every script of bench/ (see BENCHMARKS.md; ~50 min on 2 CPU cores), one after the other, with
# the flags of BENCH_ARGS_<script> if any; each one's output also in $(BENCH_OUT)/<name>.log, then
# all SUMMARY lines together. A script that fails does not stop the others; the target fails at
# the end. TRL (bench/trl_grpo.py's peer) comes from the `bench` extra.
BENCH_ARGS_async.py ?= --steps 20
BENCH ?= $(foreach s,$(sort $(notdir $(wildcard bench/*.py))),"$(strip $(s) $(BENCH_ARGS_$(s)))")
BENCH_OUT ?= outputs/bench

bench: setup
	$(BIN)/python -c "import trl" 2>/dev/null || $(BIN)/pip install -q -e ".[bench]"
	@mkdir -p $(BENCH_OUT); rm -f $(BENCH_OUT)/*.log $(BENCH_OUT)/*.rc; failed=""; \
	for cmd in $(BENCH); do \
	  name=$${cmd%%.py*}; start=$$(date +%s); echo "== bench/$$cmd"; \
	  { $(BIN)/python bench/$$cmd 2>&1; echo $$? > $(BENCH_OUT)/$$name.rc; } \
	    | tee $(BENCH_OUT)/$$name.log; \
	  echo "== bench/$$cmd: $$(( $$(date +%s) - start )) s, exit $$(cat $(BENCH_OUT)/$$name.rc)"; \
	  [ "$$(cat $(BENCH_OUT)/$$name.rc)" = 0 ] || failed="$$failed bench/$$name.py"; \
	done; \
	echo "== SUMMARY <name> <measured>x goal <goal>x (met when measured >= goal)"; \
	for cmd in $(BENCH); do grep -h '^SUMMARY' $(BENCH_OUT)/$${cmd%%.py*}.log; done; \
	if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

clean:
	rm -rf outputs .pytest_cache .ruff_cache .mypy_cache
