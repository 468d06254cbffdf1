# Durable Dataflow: every target creates .venv when missing and reinstalls the package when
# pyproject.toml changed, so `make demo` and `make test` work on a fresh clone.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV := .venv
BIN := $(VENV)/bin
# Touched after a successful install; older than pyproject.toml means "install again".
STAMP := $(VENV)/.dataflow-installed
# The first Python >= 3.11 on PATH; override with `make PYTHON=/path/to/python3.12 ...`.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	2>/dev/null && { command -v $$p; break; }; done)
# Extra pytest arguments, e.g. `make test PYTEST_ARGS="-x -k ledger"` (.ci/run adds --junitxml).
PYTEST_ARGS ?=
# pytest-xdist processes (one per core; whole files stay in one process for their module fixtures);
# PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
# Extra soak arguments, e.g. `make soak SOAK_ARGS="--runs 2000 --seed 7"`.
SOAK_ARGS ?=

# The demo, one shell command per line; run with `set -e`, so the first failure stops it.
define DEMO_SCRIPT
$(BIN)/dataflow run examples/revenue_by_region/dataflow.yaml --param day=2026-11-02 --idempotency-key demo-revenue-2026-11-02
# A publication whose answer is lost: the process is killed right after the sink committed (crash point).
# A second `make demo` replays the key instead: exit 3 while the run is unresolved, 0 once reconciled.
DATAFLOW_LEASE_TTL=1 DATAFLOW_CRASH_AT=after_provider_call $(BIN)/dataflow run examples/daily_orders_publish/dataflow.yaml --param day=2026-11-03 --idempotency-key demo-publish-lost-answer && published=0 || published=$$?
case $$published in 137) echo "demo: that run died after publishing; the platform cannot know whether its output exists";; 3) echo "demo: a replay of that run, which is still unresolved (see its warning): nothing was executed again";; 0) echo "demo: a replay of that run, settled already: nothing was executed again";; *) exit $$published;; esac
# Let its 1-second lease expire; the worker's sweeper then marks it outcome_unknown (never retried).
sleep 1.5
$(BIN)/dataflow worker --until-idle
$(BIN)/dataflow runs
endef
export DEMO_SCRIPT

.PHONY: help venv sysdeps test test-unit lint typecheck pytest demo bench soak model screenshots clean distclean

help:
	@echo "make demo       run the example dataflow and show the run history"
	@echo "make test       system deps, ruff, mypy, the whole pytest suite (SQLite and PostgreSQL), model check"
	@echo "make test-unit  the unit tier alone (tests/unit): no database server, no process, no JVM; seconds"
	@echo "make lint       ruff check src tests"
	@echo "make typecheck  mypy (strict, src)"
	@echo "make bench      benchmarks vs DBOS (BENCH_ARGS=--quick for a smoke run); see docs/performance.md"
	@echo "make soak       200 runs, faults in >= 1 run in 10, reconciles, replays, partition re-runs (scripts/soak.py), then the state machine's long profile"
	@echo "make model      model-check the recovery protocol (model/check, needs spin)"
	@echo "make screenshots refresh docs/img from the browser test"
	@echo "make clean      remove caches and test artefacts (distclean also removes .venv)"

venv: $(STAMP)

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "No Python >= 3.11 found on PATH (set PYTHON=...)" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); \
	  echo "'$(PYTHON) -m venv' failed; on Debian/Ubuntu: apt-get install python3-venv" >&2; exit 1; }

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

# The demo needs only what a user installs (`.[all]`: no pyspark, no test tools): about 20 s and 500 MB
# on a fresh clone. A venv that `make test` installed already holds all of it.
DEMO_STAMP := $(VENV)/.dataflow-demo-installed
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ]; then :; else \
	  $(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[all]'; fi
	touch $(DEMO_STAMP)

sysdeps:
	bash scripts/install-system-deps.sh

lint: venv
	$(BIN)/ruff check src tests

typecheck: venv
	$(BIN)/mypy

pytest: venv sysdeps
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The unit tier: pure and fast, so it needs no system deps (tests/unit/conftest.py keeps it so).
test-unit: venv
	$(BIN)/pytest -q -n 2 -p no:schemathesis tests/unit $(PYTEST_ARGS)

test: venv sysdeps
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	if [ -x model/check ]; then $(MAKE) --no-print-directory model; \
	else echo "make test: no model/check yet, model check skipped"; fi

demo: $(DEMO_STAMP)
	bash -eux -o pipefail -c "$$DEMO_SCRIPT"

# The benchmarks need PostgreSQL (sysdeps) and DBOS (the bench extra). BENCH_ARGS, e.g.
# `make bench BENCH_ARGS=--quick` or `make bench BENCH_ARGS="--only commits,replay"`.
BENCH_ARGS ?=
bench: venv sysdeps
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

soak: venv sysdeps
	$(BIN)/python scripts/soak.py $(SOAK_ARGS)
	$(BIN)/pytest -n 2 --hypothesis-profile=long tests/integration/test_state_machine.py

screenshots: venv sysdeps
	DATAFLOW_SCREENSHOT_DIR=docs/img $(BIN)/pytest tests/acceptance/test_browser.py

model: sysdeps
	if [ -x model/check ]; then model/check; \
	else echo "make model: model/check does not exist yet"; fi

clean:
	rm -rf .pytest_cache .mypy_cache .ruff_cache test-artifacts build dist .hypothesis
	find src tests benchmarks scripts -name __pycache__ -type d -prune -exec rm -rf {} + 2>/dev/null || true

distclean: clean
	rm -rf $(VENV)
