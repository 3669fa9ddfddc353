"""The import contracts of ``pyproject.toml`` ([tool.importlinter]) hold, and each kind of forbidden import breaks
them: the check is import-linter's ``lint-imports`` run on the code (a copy of it, for the broken cases)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_steps.config import REPO_ROOT

LINT = "from importlinter.cli import lint_imports; raise SystemExit(lint_imports(no_cache=True, no_logo=True))"


def lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the packages under ``root`` with ``root/pyproject.toml``'s contracts."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_contracts_hold():
    result = lint(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    # flow-side evaluation reaching into the training process past its job module
    ("grpo_steps/evaluation/policy.py", "from grpo_steps.training import rollouts", "Flow side reaches training only"),
    # two modules importing each other (data imports config)
    ("grpo_steps/config/pipeline.py", "import grpo_steps.data", "No two modules import each other"),
    # the rewards (the lowest layer) reaching into the pipeline
    ("rewards/guard.py", "import grpo_steps.config", "Layers from the step bodies"),
    # a lower layer importing a higher one (the server client importing the step bodies)
    ("grpo_steps/servers/client.py", "import grpo_steps.steps", "Layers from the step bodies"),
    # inside the training process: the job (imported by the flow) pulling in the trainer and TRL
    ("grpo_steps/training/job.py", "import grpo_steps.training.trainer", "Layers inside the training process"),
    # inside the servers: the HTTP client reaching up into a provider
    ("grpo_steps/servers/client.py", "import grpo_steps.servers.local", "Layers inside the generation servers"),
    # inside the tools wing: the tool's worker process importing the tools' resolution (and transformers with it)
    ("grpo_steps/tools/worker.py", "import grpo_steps.tools.functions", "Layers inside the tools wing"),
    # the config's validators starting environments' worker processes
    ("grpo_steps/config/pipeline.py", "import grpo_steps.tools.environments", "The config checks tools and games"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, line, broken):
    for package in ("grpo_steps", "rewards"):
        shutil.copytree(REPO_ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO_ROOT / "pyproject.toml", tmp_path)
    assert lint(tmp_path).returncode == 0  # the copy as it is keeps them
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n\ndef _back_import():\n    {line}  # noqa\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    assert re.search(rf"^{re.escape(broken)}.* BROKEN\b", result.stdout, re.MULTILINE), result.stdout


def layered_names(contract: dict) -> set[str]:
    """The module names a layers contract lists (``a | b`` and ``a : b`` layers split into their names)."""
    return {name.strip() for layer in contract["layers"] for name in re.split(r"[|:]", layer) if name.strip()}


def children(package: Path) -> set[str]:
    """The modules (``x.py`` but ``__init__``) and subpackages directly in ``package``."""
    return {p.stem for p in package.glob("*.py") if p.stem != "__init__"} | \
        {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def test_every_module_is_in_a_layer():
    """A module no layer names is checked by no layers contract: each top-level module of grpo_steps is in the
    first contract's layers, and each module of a package that has a contract of its own (``containers``) is in
    that contract's layers."""
    import tomllib

    contracts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = [c for c in contracts if c["type"] == "layers"]
    top = {name.removeprefix("grpo_steps.") for name in layered_names(layers[0]) if name.startswith("grpo_steps.")}
    assert children(REPO_ROOT / "grpo_steps") - top == set()
    for contract in layers[1:]:
        for container in contract["containers"]:
            package = REPO_ROOT.joinpath(*container.split("."))
            assert children(package) - {"__main__"} - layered_names(contract) == set(), contract["name"]
