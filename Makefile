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

# two workers: the tests bound to the cluster daemons (Slurm time limits, signals) wait while the other worker
# computes; the cluster's tests stay together on one worker (xdist_group, they share its daemons)
test: lint
	$(PY) -m pytest -n 2 --dist loadgroup

# the inner loop: lint and the unit tests but their slowest (marked slow: a dry run, a CPU measurement, a
# subprocess; CI runs them all), no daemons
test-fast: lint
	$(PY) -m pytest tests/unit -q -m "not slow" -n 2

docs: setup
	$(VENV)/bin/stx config docs --update README.md docs/CONFIG.md

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
