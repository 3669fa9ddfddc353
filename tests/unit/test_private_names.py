"""TRL's private names (methods and attributes of ``GRPOTrainer`` and transformers' ``Trainer`` whose names start with
one underscore) are named only in ``grpo_steps/training/trainer.py`` (the overrides) and
``grpo_steps/trl_hooks.py`` (one function per name): a TRL upgrade reviews those two files. The names are
read from the installed TRL's and transformers' source, so a name TRL adds is covered without editing this test."""

import ast
import inspect
from pathlib import Path

import pytest

from grpo_steps.config import REPO_ROOT

trl = pytest.importorskip("trl")

ALLOWED = {Path("grpo_steps/training/trainer.py"), Path("grpo_steps/trl_hooks.py")}
SCANNED = ("grpo_steps", "rewards", "flows", "bench")


def trl_private_names() -> set[str]:
    """Single-underscore names that ``GRPOTrainer`` or ``Trainer`` define as methods or assign on ``self``."""
    import transformers

    names: set[str] = set()
    for cls in (trl.GRPOTrainer, transformers.Trainer):
        tree = ast.parse(Path(inspect.getsourcefile(cls)).read_text())
        (body,) = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
        for node in ast.walk(body):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of every attribute access ``x.<name>`` in ``source`` with ``name`` in ``names``."""
    return [(node.lineno, node.attr) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in names]


def test_the_names_read_from_trl_include_those_the_pipeline_wraps():
    assert {"_metrics", "_logs", "_step", "_buffered_inputs", "_current_train_step_time", "_last_loaded_step",
            "_get_per_token_logps_and_entropies", "_tokenize_prompts", "_get_tool_suffix_ids",
            "_generate_and_score_completions", "_prepare_inputs"} <= trl_private_names()


def test_only_the_trainer_and_its_hooks_name_trls_private_names():
    names = trl_private_names()
    found = []
    for folder in SCANNED:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            relative = path.relative_to(REPO_ROOT)
            if relative not in ALLOWED:
                found += [f"{relative}:{line}: .{name}" for line, name in uses(path.read_text(), names)]
    assert not found, "TRL's private names outside training/trainer.py and trl_hooks.py (add a function " \
                      "to trl_hooks.py and call it):\n" + "\n".join(found)


def test_a_planted_private_name_is_found():
    """The scan is not blind: ``trainer._metrics`` planted into another module of the training process is found."""
    source = (REPO_ROOT / "grpo_steps/training/generation/server.py").read_text()
    assert uses(source, trl_private_names()) == []
    planted = source + "\n\ndef _planted(trainer):\n    trainer._metrics['train']['x'].append(1.0)\n"
    assert [name for _, name in uses(planted, trl_private_names())] == ["_metrics"]
