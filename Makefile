# Two entry points: `make run` (train the default recipe on the embedded data set) and `make test`, which
# runs `make lint` (ruff check + ruff format --check over the repository, settings in [tool.ruff]) and
# `make typecheck` (mypy on the three packages, settings in [tool.mypy]) before pytest: any finding fails it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean bench lint typecheck

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/lcv fit --recipe digits-small

# Two pytest-xdist workers (one per core of a CI runner), each with one torch thread (tests/conftest.py);
# --dist loadgroup keeps a file marked xdist_group (an expensive module fixture) on one worker.
test: lint typecheck
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy -p lightning_plugin -p lcv_kernels -p lcv_vision

bench: $(STAMP)
	$(BIN)/python benchmarks/strategy_overhead.py

clean:
	rm -rf $(VENV) lightning_logs runs
