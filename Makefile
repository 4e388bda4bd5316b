# Two entry points: `make run` (train the default recipe on the embedded data set) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test install clean bench

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/lcv fit --recipe digits-small

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(BIN)/python benchmarks/strategy_overhead.py

clean:
	rm -rf $(VENV) lightning_logs runs
