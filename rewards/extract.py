"""Answer extraction: completion -> final answer string -> number. Pure functions, table-tested."""

from __future__ import annotations

import re
from fractions import Fraction

_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:=]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_HASHES = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)
_NUMBER = re.compile(r"^[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?$")
_FRACTION = re.compile(r"^([-+]?\d+)\s*/\s*([-+]?\d+)$")


def completion_text(completion: str | list[dict]) -> str:
    """Text of a completion, standard (``str``) or conversational (list of messages: last one's content).

    >>> completion_text([{"role": "assistant", "content": "Answer: 4"}])
    'Answer: 4'
    """
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    return str(completion[-1].get("content") or "")


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces balanced; None when absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer a completion states, or None when it states none.

    Looks, in order, for the last ``Answer: X`` line, the last ``\\boxed{X}``, the last ``#### X``.
    A bare number without one of these markers is not an answer.

    >>> extract_answer("2 + 2 = 4\\nAnswer: 4")
    '4'
    >>> extract_answer("the result is \\\\boxed{\\\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    >>> extract_answer("I think it is 4") is None
    True
    """
    for found in (_ANSWER_LINE.findall(text), _HASHES.findall(text)):
        if found:
            return found[-1].strip().strip("*").strip()
    return _boxed(text)


def parse_number(text: str | None) -> Fraction | None:
    """Exact value of a numeric answer string, or None when it is not a number.

    Accepts signs, thousands separators, decimals, exponents, ``a/b``, ``\\frac{a}{b}``, a leading ``$``,
    a trailing ``.`` or ``%`` sign dropped. Values are exact ``Fraction``s so huge integers compare exactly.

    >>> parse_number("1,234.5")
    Fraction(2469, 2)
    >>> parse_number("\\\\frac{3}{4}")
    Fraction(3, 4)
    >>> parse_number("four") is None
    True
    """
    if text is None:
        return None
    s = text.strip().strip("$").strip().rstrip(".").rstrip("%").strip()
    s = re.sub(r"^\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}$", r"\1/\2", s)
    if m := _FRACTION.match(s):
        num, den = int(m.group(1)), int(m.group(2))
        return Fraction(num, den) if den else None
    if not s or not _NUMBER.match(s) or not any(c.isdigit() for c in s):
        return None
    return Fraction(s.replace(",", ""))
