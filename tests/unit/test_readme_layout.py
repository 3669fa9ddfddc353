"""The README's "Layout" section is a map of the tree that stays true: every module and package folder of
``grpo_steps/`` and ``rewards/`` is named there, and everything named there exists.

The section's first fenced block holds one entry per line: ``<indent><name>  <what it is>``, at least two spaces
between the two. A name ends in ``/`` (a folder) or ``.py`` (a module); several names of one line are separated by
``, ``. Lines without indent name paths from the repository root; an entry indented two spaces more than the folder
above it lies in that folder.
"""

import re
from pathlib import Path

import pytest

from grpo_steps.config import REPO_ROOT

PACKAGES = ("grpo_steps", "rewards")
"""The folders whose every module the layout names."""

_NAME = re.compile(r"[\w.-]+(?:/[\w.-]+)*(?:/|\.py)")


def layout_block(readme: str) -> str:
    """The first fenced block of the ``## Layout`` section. Raises ValueError when there is none."""
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    block = match and re.search(r"^```[^\n]*\n(.*?)^```", match.group(1), re.M | re.S)
    if not block:
        raise ValueError("the README has no '## Layout' section with a fenced block")
    return block.group(1)


def layout_paths(block: str) -> list[str]:
    """The paths a layout block names, from the repository root (folders end in ``/``).

    >>> layout_paths("a/  a folder\\n  b.py  a module\\n  c/  a subfolder\\n    d.py, e.py  two modules\\nf.py  root")
    ['a/', 'a/b.py', 'a/c/', 'a/c/d.py', 'a/c/e.py', 'f.py']

    Raises:
        ValueError: a line that is not ``<name(s)>  <description>``, or indented other than two spaces below a
            folder above it (the message quotes the line).
    """
    paths: list[str] = []
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders the next line may lie in
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        parts = re.split(r" {2,}", line.strip(), maxsplit=1)
        names = parts[0].split(", ")
        if len(parts) < 2 or not all(_NAME.fullmatch(name) for name in names):
            raise ValueError(f"layout line is not '<name(s)>  <what it is>': {line!r}")
        while folders and folders[-1][0] >= indent:
            folders.pop()
        expected = folders[-1][0] + 2 if folders else 0
        if indent != expected:
            raise ValueError(f"layout line indented {indent} spaces, {expected} expected: {line!r}")
        parent = folders[-1][1] if folders else ""
        paths += [parent + name for name in names]
        if len(names) == 1 and names[0].endswith("/"):
            folders.append((indent, parent + names[0]))
    return paths


def package_paths(root: Path) -> set[str]:
    """Every module (``.py`` other than ``__init__.py``/``__main__.py``) and every folder holding one, under
    :data:`PACKAGES`, as paths from ``root`` (folders end in ``/``)."""
    out: set[str] = set()
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            relative = path.relative_to(root)
            if "__pycache__" in relative.parts:
                continue
            out.update(f"{'/'.join(relative.parts[:i])}/" for i in range(1, len(relative.parts)))
            if path.name not in ("__init__.py", "__main__.py"):
                out.add(relative.as_posix())
    return out


def layout_errors(readme: str, root: Path) -> list[str]:
    """What is wrong with the layout against the tree at ``root``: modules and folders it does not name, names that
    do not exist."""
    named = layout_paths(layout_block(readme))
    missing = sorted(package_paths(root) - set(named))
    absent = [path for path in named if not (root / path.rstrip("/")).exists()]
    return ([f"not in the README's Layout: {path}" for path in missing]
            + [f"in the README's Layout but not in the tree: {path}" for path in absent])


def test_the_layout_names_every_module_and_only_what_exists():
    errors = layout_errors((REPO_ROOT / "README.md").read_text(), REPO_ROOT)
    assert not errors, "README.md's Layout section (one line per module) is out of date:\n" + "\n".join(errors)


def _tree(root: Path, files: list[str]) -> Path:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


README = """# x

## Layout

```
grpo_steps/        the flow side
  steps.py         step bodies
  servers/         servers
    local.py, external.py   providers
rewards/           rewards
  guard.py         the guard
docs/              pages
```

## Next
"""


def test_a_layout_that_matches_its_tree_has_no_errors(tmp_path):
    root = _tree(tmp_path, ["grpo_steps/__init__.py", "grpo_steps/__main__.py", "grpo_steps/steps.py",
                            "grpo_steps/servers/__init__.py", "grpo_steps/servers/local.py",
                            "grpo_steps/servers/external.py", "rewards/__init__.py", "rewards/guard.py",
                            "docs/x.md"])
    assert layout_errors(README, root) == []


def test_a_module_left_out_and_a_name_that_is_gone_are_both_reported(tmp_path):
    root = _tree(tmp_path, ["grpo_steps/steps.py", "grpo_steps/servers/local.py", "grpo_steps/servers/external.py",
                            "grpo_steps/servers/lifecycle.py", "grpo_steps/evaluation/stats.py", "docs/x.md"])
    assert layout_errors(README, root) == [
        "not in the README's Layout: grpo_steps/evaluation/",
        "not in the README's Layout: grpo_steps/evaluation/stats.py",
        "not in the README's Layout: grpo_steps/servers/lifecycle.py",
        "in the README's Layout but not in the tree: rewards/",
        "in the README's Layout but not in the tree: rewards/guard.py",
    ]


@pytest.mark.parametrize("block, fault", [
    ("grpo_steps/\n  steps.py\n", "is not '<name(s)>  <what it is>'"),  # no description
    ("grpo_steps/  the flow side\n    steps.py  step bodies\n", "indented 4 spaces, 2 expected"),
    ("  steps.py  step bodies\n", "indented 2 spaces, 0 expected"),  # no folder above
    ("grpo_steps/  the flow side\n  the step bodies live in steps.py\n", "is not '<name(s)>  <what it is>'"),
])
def test_a_line_the_parser_cannot_place_is_an_error(block, fault):
    with pytest.raises(ValueError, match=re.escape(fault)):
        layout_paths(block)


def test_the_readme_layout_parses_and_names_the_stages():
    paths = layout_paths(layout_block((REPO_ROOT / "README.md").read_text()))
    assert len(paths) == len(set(paths)), "a path named twice"
    for path in ("grpo_steps/preflight.py", "grpo_steps/servers/lifecycle.py", "grpo_steps/evaluation/stats.py",
                 "grpo_steps/training/generation/server.py", "grpo_steps/trl_hooks.py", "rewards/sandbox_wire.py"):
        assert path in paths
