# Two entry points: `make run` (train the default recipe on the embedded data set) and `make test`;
# `make typecheck` runs mypy on the three packages (settings in pyproject.toml's [tool.mypy]).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean bench typecheck

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/lcv fit --recipe digits-small

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

typecheck: $(STAMP)
	$(BIN)/mypy lightning_plugin kernels vision

bench: $(STAMP)
	$(BIN)/python benchmarks/strategy_overhead.py

clean:
	rm -rf $(VENV) lightning_logs runs
