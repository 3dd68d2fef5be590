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

# Two pytest workers (pytest-xdist): 1.27x on 2 cores, as XLA's compiles and the
# simulated devices leave cores idle; `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2

test: lint $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --durations=15

test-all: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) -m ''

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
