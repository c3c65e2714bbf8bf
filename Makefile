# The two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
PY := .venv/bin/python
export PYTHONWARNINGS ?= ignore::UserWarning:megatron.core.hyper_comm_grid
export OMP_NUM_THREADS ?= 1
SUITE ?=
ARGS ?=

.PHONY: setup demo test test-fast lint typecheck bench clean

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(PY) examples/pretrain_gpt_moe.py

# Lint and type check first (seconds), then the suite (its tests run the structure and claim checks).
test: setup lint typecheck
	$(PY) -m pytest tests -q -ra

test-fast: setup lint typecheck
	$(PY) -m pytest tests -q -ra -m "not slow"

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The dispatcher, each backend held to the communicator contract (dispatcher/common/base.py).
typecheck: setup
	$(PY) -m mypy

# `make bench` lists the suites; `make bench SUITE=layer ARGS="--smoke"` runs one.
bench: setup
	$(PY) -m bench $(SUITE) $(ARGS)

clean:
	rm -rf .venv build *.egg-info .pytest_cache .mypy_cache .ruff_cache
