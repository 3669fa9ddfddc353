"""The configuration reference, ``docs/configuration.md``, rendered from the config models (nothing in it is
written by hand)::

    python -m grpo_steps.config.reference --write    # or: make docs; without --write it prints the page
    python -m grpo_steps.config.reference --check    # exit 1 when the page on disk is stale

``tests/unit/test_config_reference.py`` fails when the page differs from a fresh rendering.

What the page holds and where each part comes from:

- **Sections**: :class:`~grpo_steps.config.PipelineConfig`'s fields, walked depth first in declaration order. A
  field whose type holds one config model (``X``, ``X | None``, ``list[X]``) is a section of its own at its dotted
  key; list items get ``[]`` (``data.mixture[]``). A section starts with its class docstring.
- **Per field**: the dotted key as written in YAML (the alias where there is one: ``generation.async``), the type
  from the annotation with the bounds of ``Field(ge=..., gt=..., pattern=...)``, the default (``required`` when there
  is none), and the description: the attribute docstring under the field (:func:`attribute_docstrings`; read here,
  not by pydantic's ``use_attribute_docstrings``, which parsed every config class's source in every process that
  imports the config, ~0.1-0.2 s of CPU each, for this page alone), or ``Field(description=...)``.
- **Rules**: every validator pydantic registered on the section's model (``__pydantic_decorators__``: field and
  model validators, inherited ones included), by name, with the first paragraph of its docstring and the refusal
  messages it raises: the text of each ``raise ...Error(<message>)`` in its source, read with :mod:`ast`, a
  formatted value shown as ``…``, and those of the config package's functions it calls by name (``_base_url``,
  ``distinct_cores``: part of its check lives there), or their docstrings where they raise no literal message. A
  validator with none of these only converts a value (``async: true`` -> ``{}``) and is left out.
- **Which fields a rule reads**, for the "Refused by" line under each field. Any of three checks counts:

  1. a field validator reads the fields it is declared for (``@field_validator("endpoint")``: pydantic's record);
  2. attribute chains in the validator's code, from ``self`` or a local name bound to a chain from ``self``
     (``gen, res = self.generation, self.resources``), followed through the nested models as far as they name
     fields: ``gen.server.replicas`` reads ``generation.server.replicas``;
  3. the validator's source names a field's full dotted key (refusal messages name the keys to change, the project's
     rule for errors): ``"... raise resources.vllm.gpu ..."``. A key followed by ``.`` and more of a key names the
     longer key only; a section's own validators name keys of that section only (the validators ``data`` shares
     with each ``data.mixture[]`` entry say ``data.path`` in both).

  The three are simple enough to trust and together find every field a rule refuses by; what they miss (a key read
  through ``getattr(self, name)``) the message usually names, so check 3 finds it.

Pure: imports the config package and pydantic only; nothing is validated or loaded.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from grpo_steps.config.base import REPO_ROOT
from grpo_steps.config.pipeline import PipelineConfig

PAGE = REPO_ROOT / "docs" / "configuration.md"
"""Where ``--write`` puts the page and the staleness test reads it."""

COMMAND = "python -m grpo_steps.config.reference --write"
"""The command that regenerates :data:`PAGE` (also ``make docs``)."""


@dataclass
class Rule:
    """One validator of a section: where it is listed, what it says, which dotted keys it reads."""

    section: str
    """Dotted key of the section it is listed under ("" for the top level)."""
    owner: str
    """The model class that defines it."""
    name: str
    text: str
    """First paragraph of its docstring (markdown), or empty."""
    messages: list[str]
    """Its refusal messages (markdown), formatted values as ``…``."""
    reads: set[str] = field(default_factory=set)

    @property
    def anchor(self) -> str:
        return "rule-" + re.sub(r"[^a-z0-9_-]+", "-", f"{self.section or 'top'}-{self.name}".lower()).strip("-")


@dataclass
class Section:
    """A config model at a dotted key."""

    key: str
    model: type[BaseModel]
    fields: list[tuple[str, str, FieldInfo]] = field(default_factory=list)
    """(dotted key, python name, field info) of each field, in declaration order."""
    rules: list[Rule] = field(default_factory=list)
    docs: dict[str, str] = field(default_factory=dict)
    """The attribute docstring of each field that has one, by python name (:func:`attribute_docstrings`)."""


# ---- types, defaults, descriptions -------------------------------------------------------------------------------


def _models_in(annotation: Any) -> list[tuple[type[BaseModel], bool]]:
    """The config models an annotation holds, each with whether it is inside a list (``list[X]``).

    >>> from grpo_steps.config import RewardSpec, PeftConfig
    >>> [(m.__name__, in_list) for m, in_list in _models_in(list[RewardSpec])]
    [('RewardSpec', True)]
    >>> [(m.__name__, in_list) for m, in_list in _models_in(PeftConfig | None)]
    [('PeftConfig', False)]
    """
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, False)]
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list:
        return [(model, True) for model, _ in _models_in(args[0])]
    if origin in (Union, types.UnionType):
        return [found for arg in args for found in _models_in(arg)]
    return []


def type_name(annotation: Any) -> str:
    """A short, YAML-minded name of a field's type (``null`` for None, literals quoted).

    >>> type_name(int | None), type_name(Literal["a", "b"]), type_name(dict[str, Any]), type_name(list[list[int]])
    ('int | null', '"a" | "b"', 'dict[str, any]', 'list[list[int]]')
    """
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(arg) for arg in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(type_name(arg) for arg in args)}]"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="),
           ("max_length", "length <="), ("pattern", "matches"))


def bounds(info: FieldInfo) -> list[str]:
    """The constraints of ``Field(...)`` (``ge``, ``gt``, ``le``, ``lt``, lengths, ``pattern``) as ``">= 1"`` etc."""
    out = []
    for item in info.metadata:
        for attr, word in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{word} {value!r}" if attr == "pattern" else f"{word} {value}")
    return out


def default_text(info: FieldInfo) -> str:
    """The default as YAML would spell it (JSON), ``required`` when the field has none."""
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "default_doc" in extra:  # a default made where the run starts (e.g. its working directory): named, not rendered
        return str(extra["default_doc"])
    value = info.get_default(call_default_factory=True)
    return json.dumps(to_jsonable_python(value, by_alias=True), ensure_ascii=False)


_ROLE = re.compile(r":(?:mod|class|func|data|attr|meth|exc):`~?([^`]+)`")


def markdown(text: str | None) -> str:
    """A docstring as markdown paragraphs: reST roles and double backticks become code spans, wrapped lines are
    joined, ``<`` and ``*`` outside code spans are escaped.

    >>> markdown('The ``train`` section\\n    (see :class:`~grpo_steps.config.TrainConfig`): a <b> *.')
    'The `train` section (see `grpo_steps.config.TrainConfig`): a &lt;b> \\\\*.'
    """
    if not text:
        return ""
    text = _ROLE.sub(r"``\1``", inspect.cleandoc(text))
    paragraphs = [" ".join(line.strip() for line in block.splitlines()) for block in re.split(r"\n\s*\n", text)]
    return "\n\n".join(_escape(paragraph.replace("``", "`")) for paragraph in paragraphs if paragraph)


def _escape(text: str) -> str:
    parts = text.split("`")  # odd parts are code spans
    return "`".join(part if i % 2 else part.replace("<", "&lt;").replace("*", "\\*") for i, part in enumerate(parts))


def first_paragraph(text: str | None) -> str:
    return markdown(text).split("\n\n", 1)[0]


# ---- walking the tree --------------------------------------------------------------------------------------------


def attribute_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """The docstring under each annotated attribute of ``model`` and its bases (a string literal right after
    ``name: type = ...``, as pydantic's ``use_attribute_docstrings`` reads it, cleaned by :func:`inspect.cleandoc`),
    by attribute name; a subclass's wins."""
    docs: dict[str, str] = {}
    for cls in reversed([c for c in model.__mro__ if issubclass(c, BaseModel) and c is not BaseModel]):
        (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
        for stmt, after in zip(node.body, node.body[1:], strict=False):  # each statement and the next
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def yaml_key(name: str, info: FieldInfo) -> str:
    return info.alias or name


def sections(root: type[BaseModel] = PipelineConfig) -> list[Section]:
    """Every section of the tree, depth first: the root (key ``""``) and each field that holds a config model."""
    out: list[Section] = []

    def walk(key: str, model: type[BaseModel]) -> None:
        section = Section(key, model, docs=attribute_docstrings(model))
        out.append(section)
        nested = []
        for name, info in model.model_fields.items():
            dotted = f"{key}.{yaml_key(name, info)}" if key else yaml_key(name, info)
            section.fields.append((dotted, name, info))
            for sub, in_list in _models_in(info.annotation):
                nested.append((dotted + ("[]" if in_list else ""), sub))
        for dotted, sub in nested:
            walk(dotted, sub)

    walk("", root)
    return out


# ---- rules -------------------------------------------------------------------------------------------------------


def _function(decorator: Any) -> Callable[..., Any]:
    func = decorator.func
    return getattr(func, "__func__", func)  # a field validator's classmethod is stored bound


def _source_tree(func: Callable[..., Any]) -> tuple[str, ast.FunctionDef]:
    source = textwrap.dedent(inspect.getsource(func))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.FunctionDef), node
    return source, node


def message_text(node: ast.expr) -> str | None:
    """The text of a refusal message expression: string constants as they are, formatted values as ``…``;
    ``sep.join(<f-string> for ...)`` gives the repeated part. None when the text is not written in the code.

    >>> message_text(ast.parse('f"eval.k {bad} must lie in 1..{n}" " (see below)"').body[0].value)
    'eval.k … must lie in 1..… (see below)'
    """
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "…" for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = message_text(node.left), message_text(node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join" and node.args:
        inner = node.args[0]
        return message_text(inner.elt) if isinstance(inner, ast.GeneratorExp | ast.ListComp) else None
    return None


def _body(tree: ast.FunctionDef) -> Iterator[ast.AST]:
    """Every node of a function's body (its decorators left out)."""
    for statement in tree.body:
        yield from ast.walk(statement)


def refusal_messages(func: Callable[..., Any], tree: ast.FunctionDef) -> list[str]:
    """The messages of every ``raise SomeError(message)`` in a validator, in source order; a message held in a
    module-level string constant (``raise ValueError(COLOCATE_NEEDS_GPU)``) is looked up."""
    out = []
    for node in _body(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            arg = node.exc.args[0]
            text = message_text(arg)
            if text is None and isinstance(arg, ast.Name) and isinstance(func.__globals__.get(arg.id), str):
                text = func.__globals__[arg.id]
            if text is not None:
                out.append(text)
    return out


def _helpers(func: Callable[..., Any], tree: ast.FunctionDef) -> list[Callable[..., Any]]:
    """The functions of the config package a validator calls by name (``_base_url``, ``distinct_cores``): part of
    its check lives there."""
    found = []
    for node in _body(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            helper = func.__globals__.get(node.func.id)
            if inspect.isfunction(helper) and helper.__module__.startswith(__package__) and helper not in found:
                found.append(helper)
    return found


def _chains(tree: ast.FunctionDef) -> Iterator[list[str]]:
    """Attribute chains rooted at ``self``/``cls``: ``self.a.b`` -> ``["a", "b"]``; a local name bound to a chain
    (``gen = self.generation``; ``gen, res = self.generation, self.resources``) continues it."""
    bound: dict[str, list[str]] = {"self": [], "cls": []}
    binding: set[int] = set()  # the chains bound to names: read where the name is used, not where it is bound

    def chain(node: ast.expr) -> list[str] | None:
        attrs: list[str] = []
        while isinstance(node, ast.Attribute):
            attrs.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in bound:
            return bound[node.id] + attrs
        return None

    for node in _body(tree):  # bindings first
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = (zip(target.elts, value.elts, strict=False) if isinstance(target, ast.Tuple)
                     and isinstance(value, ast.Tuple) else [(target, value)])
            for name, expr in pairs:
                found = chain(expr)
                if isinstance(name, ast.Name) and found:
                    bound[name.id] = found
                    binding.add(id(expr))
    inner = {id(node.value) for node in _body(tree) if isinstance(node, ast.Attribute)} | binding
    for node in _body(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # whole chains only: self.a.b, not self.a
            found = chain(node)
            if found:
                yield found


def _resolve(section: Section, attrs: list[str]) -> str | None:
    """The dotted key an attribute chain reads, following nested models while the names are fields."""
    model, key = section.model, section.key
    found = None
    for attr in attrs:
        info = model.model_fields.get(attr)
        if info is None:
            break
        key = f"{key}.{yaml_key(attr, info)}" if key else yaml_key(attr, info)
        found = key
        models = _models_in(info.annotation)
        if len(models) != 1 or models[0][1]:  # a list of sections, or several: the chain leaves the tree
            break
        model = models[0][0]
    return found


def _named_keys(source: str, keys: list[str]) -> set[str]:
    """The dotted keys a source names in full; a key followed by ``.word`` names the longer key only. Top-level
    keys (one word: ``model``, ``tools``) are left to the other checks: prose uses the same words.

    >>> keys = ["model", "resources.vllm", "resources.vllm.gpu"]
    >>> sorted(_named_keys('"raise resources.vllm.gpu, not the model"', keys))
    ['resources.vllm.gpu']
    """
    return {key for key in keys if "." in key and re.search(rf"(?<![\w.]){re.escape(key)}(?!\w|\.\w)", source)}


def rules(section: Section, all_keys: list[str]) -> list[Rule]:
    """The validators of a section's model with their texts and the dotted keys they read."""
    decorators = section.model.__pydantic_decorators__
    out = []
    for kind in (decorators.field_validators, decorators.model_validators):
        for name, decorator in kind.items():
            func = _function(decorator)
            source, tree = _source_tree(func)
            helpers = [(helper, *_source_tree(helper)) for helper in _helpers(func, tree)]
            messages = [text for fn, _, node in [(func, source, tree), *helpers] for text in refusal_messages(fn, node)]
            messages = [_escape(re.sub(r"…(\s+…)+", "…", " ".join(text.split()))) for text in dict.fromkeys(messages)]
            text = first_paragraph(func.__doc__) or ("" if messages else " ".join(
                first_paragraph(helper.__doc__) for helper, _, _ in helpers if helper.__doc__))
            if not text and not messages:  # it converts a value (``async: true`` -> ``{}``) and refuses nothing
                continue
            rule = Rule(section.key, func.__qualname__.split(".")[0], name, text, messages)
            own = {python: dotted for dotted, python, _ in section.fields}
            rule.reads.update(own[f] for f in getattr(decorator.info, "fields", ()) if f in own)
            rule.reads.update(key for attrs in _chains(tree) if (key := _resolve(section, attrs)))
            inside = [key for key in all_keys if not section.key or key == section.key
                      or key.startswith(section.key + ".")]
            rule.reads.update(_named_keys(source, inside))
            out.append(rule)
    return out


def tree(root: type[BaseModel] = PipelineConfig) -> list[Section]:
    """The sections with their rules."""
    found = sections(root)
    keys = [dotted for section in found for dotted, _, _ in section.fields]
    for section in found:
        section.rules = rules(section, keys)
    return found


# ---- the page ----------------------------------------------------------------------------------------------------


def _heading_anchor(key: str) -> str:
    """GitHub's anchor of a heading ``### `key` ``: lower case, punctuation but ``-`` and ``_`` dropped."""
    return re.sub(r"[^\w\- ]", "", key.lower()).replace(" ", "-")


def render(root: type[BaseModel] = PipelineConfig) -> str:
    """The whole page (markdown), ending in one newline."""
    found = tree(root)
    refused_by: dict[str, list[Rule]] = {}
    for section in found:
        for rule in section.rules:
            for key in sorted(rule.reads):
                refused_by.setdefault(key, []).append(rule)
    section_keys = {section.key for section in found}
    count = sum(len(section.fields) for section in found)
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from the config models by `{COMMAND}` (or `make docs`); do not edit by hand. -->",
        "",
        f"Every key of the run config ({count} fields in {len(found)} sections), as written in the YAML file "
        "(`configs/local.yaml` is an example; how to write your own: [config-guide.md](config-guide.md)). For each "
        "field: its type and bounds, its default, what it does, and the rules that refuse it. A config is "
        "validated once, in `start`, before anything runs; unknown keys and wrong types are refused too, and every "
        "refusal names the key and how to fix it.",
        "",
        "Sections:",
        "",
    ]
    for section in found[1:]:
        depth = section.key.count(".")
        lines.append(f"{'  ' * depth}- [`{section.key}`](#{_heading_anchor(section.key)})")
    for section in found:
        lines += ["", f"## `{section.key}`" if section.key else "## Top level", ""]
        doc = markdown(section.model.__doc__)
        if doc:
            lines += [doc, ""]
        for dotted, name, info in section.fields:
            lines += _field_entry(dotted, info, info.description or section.docs.get(name), section_keys,
                                  refused_by.get(dotted, []))
        if section.rules:
            where = f"`{section.key}`" if section.key else "the whole config"
            lines += [f"Rules of {where} (validators of `{section.model.__name__}`):", ""]
            for rule in section.rules:
                lines.append(_rule_entry(rule))
    return "\n".join(lines).rstrip("\n") + "\n"


def _field_entry(dotted: str, info: FieldInfo, description: str | None, section_keys: set[str],
                 rules_: list[Rule]) -> list[str]:
    subsection = next((key for key in (dotted, dotted + "[]") if key in section_keys), None)
    # a section defaulting to an instance of its model is that model's defaults; one defaulting to None (``async``,
    # ``train.peft``: off until set) or required shows that value, as any other field does
    default = "the section's defaults" if subsection == dotted and isinstance(info.default, BaseModel) \
        else f"`{default_text(info)}`"
    facts = [f"`{type_name(info.annotation)}`", *bounds(info), f"default {default}"]
    lines = [f"### `{dotted}`", "", " · ".join(facts), ""]
    if description:
        lines += [markdown(description), ""]
    if subsection:
        lines += [f"Section: [`{subsection}`](#{_heading_anchor(subsection)}).", ""]
    if rules_:
        lines += ["Refused by: " + ", ".join(f"[`{r.name}`](#{r.anchor})" for r in rules_) + ".", ""]
    return lines


def _rule_entry(rule: Rule) -> str:
    head = f'- <a id="{rule.anchor}"></a>`{rule.name}`'
    reads = ", ".join(f"`{key}`" for key in sorted(rule.reads))
    parts = [head + (f" (reads {reads})" if reads else "") + (f": {rule.text}" if rule.text else "")]
    parts += [f"  - refuses: “{message}”" for message in rule.messages]
    return "\n".join(parts)


def stale(on_disk: str, rendered: str) -> str | None:
    """None when the page on disk is the rendering, else the message that says how to regenerate it."""
    if on_disk == rendered:
        return None
    return (f"{PAGE.relative_to(REPO_ROOT)} is stale (it differs from a rendering of the config models in "
            f"grpo_steps/config/): run `{COMMAND}` (or `make docs`) and commit the page")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"write {PAGE.relative_to(REPO_ROOT)}")
    group.add_argument("--check", action="store_true", help="exit 1 when the page on disk is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        PAGE.write_text(page)
        return 0
    if args.check:
        message = stale(PAGE.read_text() if PAGE.exists() else "", page)
        if message:
            print(message, file=sys.stderr)
        return 1 if message else 0
    sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
