# `make demo` and `make test` set everything up on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test proto
setup:
	VENV=$(VENV) scripts/setup.sh

demo: setup
	$(VENV)/bin/tenplex layout --model gpt --layers 8 --hidden 1024 --heads 16 --vocab 50257 --optimizer adam --parallel dp=2,tp=2,pp=2 --hosts 2 --devices-per-host 4 -o /tmp/tenplex-old.json
	$(VENV)/bin/tenplex layout --model gpt --layers 8 --hidden 1024 --heads 16 --vocab 50257 --optimizer adam --parallel dp=1,tp=4,pp=3 --hosts 3 --devices-per-host 4 -o /tmp/tenplex-new.json
	$(VENV)/bin/tenplex plan /tmp/tenplex-old.json /tmp/tenplex-new.json

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Regenerates the gRPC/protobuf code from proto/ (tests fail when it is stale).
proto: setup
	$(PY) -m tenplex.store.codegen
