# Two entry points for a fresh machine: `make quickstart` and `make test`.
# torch is installed pinned and first: an unpinned torch (directly or via transformers)
# would download a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: quickstart test venv dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed

venv: $(VENV)/.installed
dev: $(VENV)/.dev

quickstart: $(VENV)/.installed
	$(BIN)/echo-rl quickstart $(ARGS)

# Fails if no test ran (pytest exits 5 when it collects nothing).
test: $(VENV)/.dev
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
