"""The tools of ``tools:`` in TRL's contract, the chat template that renders them, and the shipped ``calculator``.

A tool is a Python function with type hints and a Google-style docstring (``Args:``), from which
``transformers.utils.get_json_schema`` builds the schema the chat template renders into the prompt. Each
``tools:`` function runs in a worker process of its own (:mod:`grpo_steps.tools.worker`), killed at
``generation.tool_timeout_s``; an answer longer than ``generation.max_tool_response_length`` characters is cut
before it is tokenized.

The model's chat template must render a tool-calling exchange: ``model.chat_template`` names one (a template TRL
ships, e.g. ``qwen2_5``: ChatML with ``<tool_call>``, the turn tokens SmolLM2 uses too) or a Jinja file
(:func:`check_tool_calling`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from grpo_steps.tools.worker import process_tool

DEFAULT_MAX_TOOL_RESPONSE = 4096
"""Characters of a tool's answer kept by default (``generation.max_tool_response_length``)."""


class ToolError(ValueError):
    """A tool, environment or chat template that cannot be used; the message names the config key and the fix."""


def resolve_callable(path: str, key: str) -> Callable:
    """The callable a ``module:name`` (or ``module.name``) path names.

    Raises:
        ToolError: not importable, or not callable; names ``key``.
    """
    from rewards.locate import import_attr

    module_name, sep, _ = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ToolError(f"{key} {path!r} is not a dotted path 'package.module:function'")
    try:
        value = import_attr(path)  # the config's directory, the working directory, then the installed packages
    except (ImportError, AttributeError) as err:
        raise ToolError(f"{key} {path!r} does not import ({err}); put its module beside the config file or in the "
                        "working directory, or install it") from None
    if not callable(value):
        raise ToolError(f"{key} {path!r} is not callable")
    return value


def check_tool(fn: Callable, key: str) -> dict:
    """The JSON schema of tool ``fn`` (what the chat template renders).

    Raises:
        ToolError: ``fn`` has no schema (type hints on every argument and a Google-style docstring with an
            ``Args:`` entry for each, transformers' rule); names ``key``.
    """
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers raises several types (TypeHintParsingException, DocstringParsingException)
        raise ToolError(f"{key}: {getattr(fn, '__name__', fn)!r} cannot be described to the model as a tool "
                          f"({err}); give every argument a type hint and the function a Google-style docstring "
                          "with an Args: entry per argument") from None


def tool_functions(paths: list[str], timeout_s: float, max_chars: int = DEFAULT_MAX_TOOL_RESPONSE) -> list[Callable]:
    """The configured tools (``tools:``), resolved; each call runs in the tool's worker process, killed past
    ``timeout_s`` seconds (:func:`grpo_steps.tools.worker.process_tool`; started at the first call), its answer cut
    to ``max_chars`` characters. An ``async`` tool's call waits for its worker in a thread that ends with the call.

    Raises:
        ToolError: as :func:`resolve_callable` and :func:`check_tool`.
    """
    tools = []
    for i, path in enumerate(paths):
        fn = resolve_callable(path, f"tools[{i}]")
        check_tool(fn, f"tools[{i}] {path!r}")
        tools.append(process_tool(fn, path, timeout_s, max_chars))
    return tools


def trl_templates() -> Path:
    """The folder of the chat templates TRL ships (``trl/chat_templates/*.jinja``; named by file name without
    ``.jinja``)."""
    spec = importlib.util.find_spec("trl")  # locates without importing trl
    return Path(spec.submodule_search_locations[0]) / "chat_templates"


def chat_template_text(spec: str) -> str:
    """The Jinja text of ``model.chat_template``: a file path, or the name of a template TRL ships.

    Raises:
        ToolError: neither; lists the names TRL ships.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    shipped = trl_templates() / f"{spec}.jinja"
    if shipped.is_file():
        return shipped.read_text()
    raise ToolError(f"model.chat_template {spec!r} is neither a file nor a template TRL ships "
                    f"({', '.join(shipped_template_names())})")


def shipped_template_names() -> list[str]:
    """The names ``model.chat_template`` takes for TRL's templates (its ``*_training`` variants left out)."""
    return sorted(p.stem for p in trl_templates().glob("*.jinja") if not p.stem.endswith("_training"))


def check_tool_calling(tokenizer, tools: list[Callable], spec: str | None) -> None:
    """The tokenizer's chat template must render a tool-calling exchange (user -> assistant with tool_calls -> tool),
    TRL's requirement for its tool loop, and must render the tools' schemas.

    Raises:
        ToolError: naming ``model.chat_template`` and a template that can.
    """
    from trl.chat_template_utils import supports_tool_calling

    where = f"model.chat_template {spec!r}" if spec else "the model's own chat template (model.chat_template: null)"
    if not supports_tool_calling(tokenizer):
        raise ToolError(f"{where} cannot render a tool-calling exchange (user -> assistant with tool_calls -> "
                          "tool), which tools and environments need: set model.chat_template to one that can, e.g. "
                          "qwen2_5 (ChatML with <tool_call>, SmolLM2's turn tokens) or a Jinja file")
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        import copy

        from trl.chat_template_utils import add_response_schema

        try:  # what GRPOTrainer does with tools: it parses tool calls with the schema of a template it knows
            add_response_schema(copy.copy(tokenizer))
        except ValueError:
            raise ToolError(f"{where} renders tool calls, but TRL cannot parse them back from completions: it knows "
                            "the response format of the templates it ships only (model.chat_template: one of "
                            f"{', '.join(shipped_template_names())}), or of a tokenizer that ships a response_schema"
                            ) from None
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tools or None, tokenize=False,
                                             add_generation_prompt=True)
    missing = [fn.__name__ for fn in tools if fn.__name__ not in rendered]
    if missing:
        raise ToolError(f"{where} does not render the tools {missing} into the prompt: set model.chat_template to "
                          "one that renders tools (e.g. qwen2_5)")


_OPERATORS = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mult": lambda a, b: a * b,
              "Div": lambda a, b: a / b, "FloorDiv": lambda a, b: a // b, "Mod": lambda a, b: a % b,
              "Pow": lambda a, b: a**b}


def _arithmetic(node) -> int | float:
    import ast

    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _arithmetic(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op).__name__ in _OPERATORS:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op).__name__](left, right)
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic expression, for example "123 * 45" or "(7 + 5) / 4".
    """
    # The docstring is what the model reads (transformers' get_json_schema puts everything after ``Args:`` into the
    # argument's description): examples live in __test__ below. The expression is parsed, never executed: numbers,
    # + - * / // % ** and parentheses only (the tool of the shipped configs/tools.yaml task; the policy writes it).
    import ast

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    return str(_arithmetic(ast.parse(expression.strip(), mode="eval")))


__test__ = {"calculator": """
>>> calculator("964 * 59"), calculator("(7 + 5) / 4"), calculator("2 ** 10")
('56876', '3.0', '1024')
>>> calculator("__import__('os')")
Traceback (most recent call last):
...
ValueError: not arithmetic: Call
"""}
