# Everything runs from the project's virtualenv; `make .venv` builds or refreshes it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint format bench clean

# The stamp is re-made (pip install re-run) whenever pyproject.toml is newer.
$(VENV): $(STAMP)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo: $(STAMP)
	$(BIN)/python -m autopar demo

test: lint $(STAMP)
	$(BIN)/pytest -q --durations=15

test-all: $(STAMP)
	$(BIN)/pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	@test -f benchmarks/run.py || { echo "no benchmarks/run.py yet: nothing to benchmark" >&2; exit 1; }
	$(BIN)/python -m benchmarks.run

# Leaves .venv alone (`rm -rf .venv` to rebuild it from scratch).
clean:
	rm -rf build .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
