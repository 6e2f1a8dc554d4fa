# `make demo` and `make test` set everything up on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The suite runs on pytest-xdist workers: one per core, at most 4 (each test already runs several processes);
# --dist loadfile keeps a file's tests in one worker, so its module fixtures (the jobs its tests read) run once;
# the files go out slowest first (tests/conftest.py; --no-loadscope-reorder keeps that order).
# TEST_WORKERS=1 (or a one-core machine) runs it in this process, without workers.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n > 4 ? 4 : n )))
XDIST_ARGS := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder,)

.PHONY: setup demo test lint docs proto
setup:
	VENV=$(VENV) scripts/setup.sh

demo: setup
	$(VENV)/bin/tenplex demo

test: setup
	$(PY) -m pytest $(XDIST_ARGS) $(PYTEST_ARGS)

# ruff and mypy with the rule sets in pyproject.toml; .ci/run runs this before the tests.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# The guides under docs/: a broken link or anchor fails (the site goes to a temporary directory).
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir $$(mktemp -d)

# Regenerates the gRPC/protobuf code from proto/ (tests fail when it is stale).
proto: setup
	$(PY) -m tenplex.store.codegen
