"""Every documented command, config fragment and link of README.md and docs/ checked against the code (the docs
as tests; docs/your-task.md's commands are also run whole by tests/integration/test_your_task.py):

- each command of a fenced shell block: ``make`` targets exist in the Makefile; repository paths exist; a
  ``python -m`` module exists; a flow command (``grpo_flow.py ...``) parses under Metaflow's own command line, which
  is asked with ``--help`` after the documented options (so ``run --config`` is refused: Metaflow's options go
  before the command);
- each YAML block that is a config fragment (its keys are config sections) validates against the config models;
- each Python block: it compiles; a block that names a file (``# my_tools.py``) is that module for the fragments;
- each relative link's file and ``#anchor`` exist (GitHub's heading slugs).
"""

import re
import shlex
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest
import yaml

from grpo_steps.config import REPO_ROOT, ConfigError, PipelineConfig, validate_config
from grpo_steps.config.pipeline import with_module_dirs

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)  # in list items too
SHELL = {"bash", "sh", "shell"}
REPO_DIRS = ("configs/", "flows/", "infra/", "docs/", "bench/", "tests/", "grpo_steps/", "rewards/")
EXTERNAL = {"docker", "kubectl", "curl", "helm", "argo", "cp", "mkdir", "cd", "export", "source", "git", "apt-get",
            "openssl", "echo", "cat", "ls", "aws"}
"""Commands of other tools: only their repository paths are checked."""
MODELS = "~/.cache/grpo-pipeline/models"
"""grpo_steps.models.cache_dir() / "models" with the default cache directory."""


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, text) of each fenced block of ``page`` (a block in a list item dedented)."""
    return [(lang, textwrap.dedent(text)) for lang, text in FENCE.findall(page.read_text())]


def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block: comments dropped, continuations joined, split at newlines, ``&&``,
    ``;``, ``|`` and ``&``, leading ``VAR=value`` assignments removed. A quoted program (``python -c '...'``) is one
    token."""
    chars, quote, i, text = [], None, 0, text.replace("\\\n", " ")
    while i < len(text):  # newlines outside quotes end a command; a '#' starting a word starts a comment
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1] in " \t\n"):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
            continue
        elif ch == "\n":
            ch = " ; "
        chars.append(ch)
        i += 1
    lexer = shlex.shlex("".join(chars), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, ""
    out, current = [], []
    for token in [*lexer, ";"]:
        if set(token) <= set(";&|"):
            while current and re.match(r"^[A-Z_][A-Z0-9_]*=", current[0]):
                current.pop(0)
            if current:
                out.append(current)
            current = []
        else:
            current.append(token)
    return out


def shell_commands() -> list[tuple[str, list[str]]]:
    return [(f"{page.name}: {' '.join(cmd)}", cmd) for page in PAGES for lang, text in blocks(page) if lang in SHELL
            for cmd in commands(text)]


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (REPO_ROOT / "Makefile").read_text(), re.MULTILINE))


def flow_help(args: list[str]) -> subprocess.CompletedProcess:
    """``grpo_flow.py ARGS --help`` in a scratch directory (Metaflow parses the options before ``--help`` at each
    level, and refuses one that is not there). A command for the cluster runs with the Metaflow profile
    docs/deploy.md installs (infra/metaflow/config-k8s-argo.json: ``@kubernetes`` needs an S3 datastore)."""
    import json
    import os
    import tempfile

    env = {**os.environ, "METAFLOW_USER": "grpo-tests"}
    if any(arg in ("argo-workflows", "kubernetes") for arg in args):
        profile = json.loads((REPO_ROOT / "infra" / "metaflow" / "config-k8s-argo.json").read_text())
        env.update({key: str(value) for key, value in profile.items()})
    with tempfile.TemporaryDirectory() as scratch:
        return subprocess.run([sys.executable, str(REPO_ROOT / "flows" / "grpo_flow.py"), *args, "--help"],
                              cwd=scratch, capture_output=True, text=True, timeout=120, env=env)


def flow_args(tokens: list[str]) -> list[str]:
    """A documented flow command's arguments, made checkable: a config file the reader writes (``my.yaml``) is
    replaced by configs/test.yaml."""
    args = list(tokens)
    for i, token in enumerate(args[:-2]):
        if token == "--config" and not (REPO_ROOT / args[i + 2]).exists():
            args[i + 2] = str(REPO_ROOT / "configs" / "test.yaml")
        elif token == "--config":
            args[i + 2] = str(REPO_ROOT / args[i + 2])
    if "resume" in args:  # `resume --help` resumes (Metaflow 2.19 runs the command): its options before it, as `run`'s
        args = [*args[:args.index("resume")], "run"]
    return args


@pytest.mark.parametrize(("where", "cmd"), shell_commands(), ids=[where for where, _ in shell_commands()])
def test_every_documented_command_names_what_exists(where, cmd):
    program = Path(cmd[0]).name
    if program == "make":
        targets = [t for t in cmd[1:] if "=" not in t and not t.startswith("-")]
        assert set(targets) <= make_targets(), f"{where}: no make target {sorted(set(targets) - make_targets())}"
    for token in cmd[1:]:
        path = token.split("=", 1)[-1]
        if path.startswith(REPO_DIRS) and not any(c in path for c in "<>*"):
            assert (REPO_ROOT / path).exists(), f"{where}: {path} does not exist"
    for token in cmd[1:]:  # the pipeline's cache: where `make model` (grpo_steps.models prepare) puts a model
        if token.startswith("~/.cache/grpo-pipeline/"):
            name = token.rstrip("/").rsplit("/", 1)[-1]
            assert token == f"~/.cache/grpo-pipeline/models/{name}", f"{where}: models live in {MODELS}/<name>"
    if program.startswith("python") and len(cmd) > 2 and cmd[1] == "-m":
        module = cmd[2]
        if module.split(".")[0] in ("grpo_steps", "rewards"):
            base = REPO_ROOT / module.replace(".", "/")
            assert base.with_suffix(".py").exists() or (base / "__main__.py").exists(), f"{where}: no module {module}"
        else:
            import importlib.util

            assert importlib.util.find_spec(module.split(".")[0]) is not None, f"{where}: {module} is not installed"
    if program.startswith("python") and len(cmd) > 1 and cmd[1].endswith(".py") and "grpo_flow" not in cmd[1]:
        assert (REPO_ROOT / cmd[1]).exists(), f"{where}: {cmd[1]} does not exist"


def flow_commands() -> list[tuple[str, list[str]]]:
    return [(where, cmd[2:]) for where, cmd in shell_commands()
            if Path(cmd[0]).name.startswith("python") and len(cmd) > 1 and cmd[1].endswith("grpo_flow.py")]


@pytest.mark.slow  # starts the flow's command line: ~2-5 s each
@pytest.mark.parametrize(("where", "args"), flow_commands(), ids=[where for where, _ in flow_commands()])
def test_every_documented_flow_command_parses_under_metaflow(where, args):
    proc = flow_help(flow_args(args))
    assert proc.returncode == 0 and "Usage:" in proc.stdout, f"{where}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_a_config_option_after_run_is_refused_by_the_check():
    """The check can fail: docs/weight-sync.md had ``run --config config ...``, which Metaflow refuses."""
    proc = flow_help(flow_args(["run", "--config", "config", "configs/local.yaml"]))
    assert proc.returncode != 0 and "no such option: --config" in (proc.stdout + proc.stderr).lower()


def python_modules(tmp_path: Path) -> Path:
    """The documented Python blocks that name their file (``# my_tools.py ...``), written to ``tmp_path`` (the
    fragments' module directory)."""
    for page in PAGES:
        for lang, text in blocks(page):
            name = re.match(r"#\s*(?:[\w-]+/)*(\w+\.py)\b", text)
            if lang == "python" and name:
                (tmp_path / name.group(1)).write_text(text)
    return tmp_path


def yaml_fragments() -> list[tuple[str, dict]]:
    found = []
    for page in PAGES:
        for i, (lang, text) in enumerate(blocks(page)):
            if lang == "yaml":
                data = yaml.safe_load(text)
                if isinstance(data, dict) and set(data) <= set(PipelineConfig.model_fields):
                    found.append((f"{page.name}[{i}]", data))
    return found


def merged(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.mark.parametrize(("where", "fragment"), yaml_fragments(), ids=[where for where, _ in yaml_fragments()])
def test_every_documented_config_fragment_validates(where, fragment, tmp_path):
    """A fragment validates on its own (the defaults around it) or as a change to one of the shipped configs (a
    page about the cluster changes configs/multinode.yaml)."""
    place = python_modules(tmp_path) / "fragment.yaml"
    try:
        validate_config(with_module_dirs(fragment, place))
        return
    except ConfigError as alone:
        refusal = alone
    for shipped in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        try:
            validate_config(with_module_dirs(merged(yaml.safe_load(shipped.read_text()), fragment), place))
            return
        except ConfigError:
            continue
    raise refusal


def test_every_python_block_compiles():
    for page in PAGES:
        for i, (lang, text) in enumerate(blocks(page)):
            if lang == "python":
                compile(text, f"{page.name}[{i}]", "exec")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``.

    >>> slug("Credentials, sandbox, servers, registry in detail"), slug("`data.few_shot`")
    ('credentials-sandbox-servers-registry-in-detail', 'datafew_shot')
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of ``page``: its headings' slugs and its ``<a id=...>`` / ``<a name=...>`` targets."""
    text = FENCE.sub("", page.read_text())
    return ({slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)}
            | set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text)))


def links() -> list[tuple[str, Path, str]]:
    out = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto
                continue
            path, _, anchor = target.partition("#")
            out.append((f"{page.name} -> {target}", (page.parent / path).resolve() if path else page, anchor))
    return out


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for where, path, anchor in links():
        if not path.exists():
            broken.append(f"{where}: no file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)
