# specjax: the two entry points of the README.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then explain it.

.PHONY: setup setup-test demo test test-all

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q -e .

setup-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'

# Speculative generation on the default real model (SmolLM2-135M-Instruct), tokens/s and acceptance.
demo: setup
	$(BIN)/specjax fetch smollm2-135m-instruct
	$(BIN)/specjax generate --chat --warmup --spec ngram_simple,suffix --max-new-tokens 256 "$(PROMPT)"

# Tests run in 2 processes (pytest-xdist; a file stays in one process, so its module fixtures are
# built once): compilation is single-threaded, so two files compile at once on a 2-core machine.
# `make test` is the CI tier (the tests not marked slow, under 25 minutes on 2 cores); `make test-all`
# adds the slow tier (tests/tiers.py says what each slow test alone covers).
TEST_RUN = SPECJAX_TOKENIZER_TEST_MODELS=$${SPECJAX_TOKENIZER_TEST_MODELS:-smollm2-135m-instruct} \
	$(BIN)/python -m pytest -q -n $${SPECJAX_TEST_WORKERS:-2} --dist loadfile --durations=15

test: setup-test
	$(BIN)/specjax fetch smollm2-135m-instruct mt_bench humaneval sharegpt
	$(TEST_RUN) -m "not slow" tests

test-all: setup-test
	$(BIN)/specjax fetch smollm2-135m-instruct mt_bench humaneval sharegpt
	$(TEST_RUN) tests
