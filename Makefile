# The two commands: `make demo` and `make test`. Both set up .venv first (idempotent).
PY := .venv/bin/python
export PYTHONWARNINGS ?= ignore::UserWarning:megatron.core.hyper_comm_grid
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-fast clean

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(PY) examples/pretrain_gpt_moe.py

test: setup
	$(PY) -m pytest tests -q -ra

test-fast: setup
	$(PY) -m pytest tests -q -ra -m "not slow"

clean:
	rm -rf .venv build *.egg-info .pytest_cache
