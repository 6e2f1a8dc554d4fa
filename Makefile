# `make demo` and `make test` set everything up on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test lint docs proto
setup:
	VENV=$(VENV) scripts/setup.sh

demo: setup
	$(VENV)/bin/tenplex demo

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

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
