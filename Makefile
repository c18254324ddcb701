# The two README commands: `make train` (set up and run the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup train test test-fast lint docs clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -c constraints.txt -e ".[dev,bench]"
	touch $@

train: setup
	$(VENV)/bin/stx train

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# everything but the cluster tests on two pytest workers (pytest-xdist: most tests keep one core busy,
# waiting on processes, signals and files; measured 1.6x on the e2e fault tests), then the cluster tests
# alone: sized in seconds of training on Slurm's clock, they missed their deadlines beside another worker
test: lint
	$(PY) -m pytest -n 2 --dist worksteal -m "not cluster"
	$(PY) -m pytest -m cluster

# the inner loop: lint and the unit tests but their slowest (marked slow: a dry run, a CPU measurement, a
# subprocess; CI runs them all), no daemons
test-fast: lint
	$(PY) -m pytest tests/unit -q -m "not slow" -n 2

docs: setup
	$(VENV)/bin/stx config docs --update README.md docs/CONFIG.md

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
