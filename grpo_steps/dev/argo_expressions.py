"""Argo's three small languages, as far as Metaflow 2.19 renders them, read the way Argo's controller reads them
(argoproj/argo-workflows v4.0.0, ``workflow/controller/dag.go``, ``steps.go``, ``workflow/common/ancestry.go``).
Pure; anything outside the subsets below is refused with :class:`RenderError` naming it.

- ``{{=...}}`` tags: expr-lang (https://expr-lang.org/docs/language-definition) with sprig: paths
  (``inputs.parameters['n']``), strings, integers, ``nil``, ``true``/``false``, ``c ? a : b``, ``==``, ``!=``, ``!``,
  ``&&``, ``||``, parentheses and the calls of :data:`FUNCTIONS` (:func:`expression_value`);
- a task's ``when`` once its tags are filled: govaluate (https://argo-workflows.readthedocs.io/en/latest/walk-through/
  conditionals/), where Argo reads every bare word as a string (``Succeeded==Succeeded``; ``shouldExecute``):
  strings, ``true``/``false``, ``==``, ``!=``, ``!``, ``&&``, ``||``, parentheses (:func:`when_holds`);
- a task's ``depends``: ``<task>.<result>`` with ``&&``, ``||``, ``!`` and parentheses, a bare task name meaning
  ``(task.Succeeded || task.Skipped || task.Daemoned)``
  (https://argo-workflows.readthedocs.io/en/latest/enhanced-depends-logic/; :func:`depends_holds`).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Mapping, Sequence


class RenderError(ValueError):
    """The workflow uses something the rehearsal does not emulate (a template kind, an Argo tag or expression), or a
    parameter has no value yet; the message names it."""


FUNCTIONS: dict[str, tuple[int, Callable]] = {
    "sprig.int": (1, int), "asInt": (1, int), "int": (1, int),
    "sprig.sub": (2, lambda a, b: int(a) - int(b)), "sprig.add": (2, lambda a, b: int(a) + int(b)),
    "toBase64": (1, lambda s: base64.b64encode(str(s).encode()).decode()),  # expr-lang's: standard base64 of UTF-8
}
"""The functions of ``{{=...}}`` Metaflow renders, by name: (number of arguments, function)."""
RESULTS = {"Succeeded": "Succeeded", "Failed": "Failed", "Errored": "Error", "Skipped": "Skipped",
           "Omitted": "Omitted"}
"""A ``depends`` result -> the node phase it tests (``tasks.<t>.status``: Argo's phase of an errored task is Error)."""
_TOKEN = re.compile(r"""\s*('[^']*'|"[^"]*"|\d+|\.?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*|==|!=|&&|\|\||[!?:()\[\],])""")
_DEPENDS_NAME = re.compile(r"([a-zA-Z0-9][-a-zA-Z0-9]*?)\.[A-Z][a-zA-Z]+|([a-zA-Z0-9][-a-zA-Z0-9]*)")
"""Argo's ``taskNameRegex`` (ancestry.go), the name of ``task.Result`` captured apart: a task a ``depends`` names."""


class _Expression:
    """One expression, evaluated as it is parsed (recursive descent, loosest first): ``c ? a : b``, ``||``, ``&&``,
    ``==``/``!=``, ``!``, then an operand: a parenthesized expression, a quoted string, an integer, ``true``/``false``,
    ``nil``, a path (``tasks['t'].status`` reads as ``tasks.t.status``), given by ``name(path)``, or a call. Only
    expr-lang (``expr``) has ``?:``, ``nil``, brackets and calls. Both branches of ``?:`` are read, so a path without a
    value is refused in either (Argo v4.0 leaves such an expression unfilled, and the task fails)."""

    def __init__(self, text: str, name: Callable[[str], object], expr: bool):
        self.text, self.name, self.expr, self.tokens, self.at = text, name, expr, [], 0
        end = 0
        while text[end:].strip():
            match = _TOKEN.match(text, end)
            if not match:
                raise RenderError(f"the Argo expression {text!r} is not emulated at {text[end:].strip()!r}")
            self.tokens.append(match.group(1))
            end = match.end()

    def value(self):
        value = self._ternary()
        if self.at < len(self.tokens):
            self._refuse()
        return value

    def holds(self) -> bool:
        return self._bool(self.value())

    def _next(self) -> str:
        self.at += 1
        return self.tokens[self.at - 1] if self.at <= len(self.tokens) else ""

    def _take(self, *tokens: str) -> str | None:
        if self.at < len(self.tokens) and self.tokens[self.at] in tokens:
            return self._next()
        return None

    def _refuse(self):
        rest = " ".join(self.tokens[min(self.at, len(self.tokens)):]) or "its end"
        raise RenderError(f"the Argo expression {self.text!r} is not emulated at {rest!r}")

    def _bool(self, value) -> bool:
        if not isinstance(value, bool):
            raise RenderError(f"the Argo expression {self.text!r}: {value!r} is not a boolean")
        return value

    def _ternary(self):
        condition = self._or()
        if not (self.expr and self._take("?")):
            return condition
        yes = self._ternary()
        if not self._take(":"):
            self._refuse()
        no = self._ternary()
        return yes if self._bool(condition) else no

    def _or(self):
        value = self._and()
        while self._take("||"):
            left, right = self._bool(value), self._bool(self._and())
            value = left or right
        return value

    def _and(self):
        value = self._comparison()
        while self._take("&&"):
            left, right = self._bool(value), self._bool(self._comparison())
            value = left and right
        return value

    def _comparison(self):
        value = self._unary()
        if operator := self._take("==", "!="):
            other = self._unary()  # by type too: expr-lang's true == 1 is false, Python's True == 1 true
            return ((type(value), value) == (type(other), other)) == (operator == "==")
        return value

    def _unary(self):
        return not self._bool(self._unary()) if self._take("!") else self._operand()

    def _operand(self):
        token = self._next()
        if token == "(":
            value = self._ternary()
            if not self._take(")"):
                self._refuse()
            return value
        if token[:1] in ("'", '"'):
            return token[1:-1]
        if token.isdigit():
            return int(token)
        if token in ("true", "false"):
            return token == "true"
        if self.expr and token == "nil":
            return None
        if not (token[:1].isalpha() or token[:1] == "_"):
            self.at -= 1
            self._refuse()
        path = token
        while self.expr and self.at < len(self.tokens) and (self.tokens[self.at][0] == "." or self._take("[")):
            key = self._next()
            if key[0] == ".":
                path += key
            elif key[:1] in ("'", '"') and self._take("]"):
                path += "." + key[1:-1]
            else:
                self._refuse()
        return self._call(path) if self.expr and self._take("(") else self.name(path)

    def _call(self, function: str):
        args = []
        while not self._take(")"):
            if args and not self._take(","):
                self._refuse()
            args.append(self._ternary())
        arity, call = FUNCTIONS.get(function, (None, None))
        if arity != len(args):
            raise RenderError(f"the Argo expression function {function}({len(args)} args) is not emulated")
        return call(*args)


def expression_value(expression: str, values: Mapping[str, str]) -> str:
    """The text a ``{{=expression}}`` tag becomes: the expression's value, a boolean as JSON writes it (Argo
    marshals the result: ``expressionReplace``), read with ``values`` (``inputs.parameters.n``, ``tasks.t.status``).

    Raises:
        RenderError: a path without a value, a nil result, or anything outside the subset.

    >>> expression_value("sprig.int(sprig.sub(sprig.int(inputs.parameters['n']),1))", {"inputs.parameters.n": "2"})
    '1'
    >>> route = "(tasks['p'].status == 'Succeeded' ? tasks['p'].outputs.parameters['switch-step'] : nil) == 'end'"
    >>> expression_value(route, {"tasks.p.status": "Succeeded", "tasks.p.outputs.parameters.switch-step": "end"})
    'true'
    """
    def name(path: str) -> str:
        if path not in values:
            raise RenderError(f"no value for {path!r} in the Argo expression {expression!r}")
        return values[path]

    value = _Expression(expression, name, expr=True).value()
    if value is None:
        raise RenderError(f"the Argo expression {expression!r} is nil")
    return json.dumps(value) if isinstance(value, bool) else str(value)


def when_holds(when: str) -> bool:
    """Whether a task's ``when``, its tags already filled, holds, as govaluate reads it in Argo (``shouldExecute``:
    bare words are strings).

    Raises:
        RenderError: not a boolean, or anything outside the subset (``>``, ``=~``, arithmetic...).

    >>> when_holds("(Omitted==Succeeded) || ((false))"), when_holds("provision_vllm==provision_vllm")
    (False, True)
    """
    return _Expression(when, lambda word: word, expr=False).holds()


def depends_tasks(depends: str) -> tuple[str, ...]:
    """The task names a ``depends`` expression reads, in order, once each (Argo's ``GetTaskDependencies``).

    >>> depends_tasks("prepare-data.Succeeded || register.Succeeded && !prepare-data.Failed || start")
    ('prepare-data', 'register', 'start')
    """
    return tuple(dict.fromkeys(result or bare for result, bare in _DEPENDS_NAME.findall(depends)))


def depends_holds(depends: str, statuses: Mapping[str, str],
                  fan_outs: Mapping[str, Sequence[str]] | None = None) -> bool:
    """Whether a task's ``depends`` holds, given ``statuses`` (task -> Argo's node phase: Succeeded, Failed, Error,
    Skipped, Omitted) of every task it names, and ``fan_outs`` (a task with ``withParam`` -> its children's phases,
    for ``.AnySucceeded`` and ``.AllFailed``). As Argo's ``evaluateDependsLogic``: ``-`` in names read as ``_``; a
    bare name is (Succeeded || Skipped || Daemoned); ``.Daemoned`` is false (a rehearsed task is no daemon, and
    ``continueOn`` is not emulated: a failed pod stops the rehearsal).

    Raises:
        RenderError: a task without a status, an unknown result, or anything outside the subset.

    >>> depends_holds("prepare-data.Succeeded || register.Succeeded", {"prepare-data": "Succeeded",
    ...                                                                 "register": "Omitted"})
    True
    >>> depends_holds("provision-vllm", {"provision-vllm": "Skipped"})
    True
    """
    phases = {task.replace("-", "_"): phase for task, phase in statuses.items()}
    children = {task.replace("-", "_"): group for task, group in (fan_outs or {}).items()}

    def result(path: str) -> bool:
        task, _, name = path.rpartition(".")
        task, name = (task, name) if task else (name, None)
        if task not in phases:
            raise RenderError(f"depends {depends!r}: the task {task} has no status yet")
        if name is None:
            return phases[task] in ("Succeeded", "Skipped")
        if name in ("AnySucceeded", "AllFailed"):
            group = children.get(task, ())
            return "Succeeded" in group if name == "AnySucceeded" else bool(group) and set(group) == {"Failed"}
        if name != "Daemoned" and name not in RESULTS:
            raise RenderError(f"depends {depends!r}: the task result {name!r} is not one of Argo's")
        return phases[task] == RESULTS.get(name)

    return _Expression(depends.replace("-", "_"), result, expr=False).holds()
