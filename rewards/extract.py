"""Answer extraction: completion -> final answer string -> number, and GSM8K's ``#### N`` answers.
Pure functions, table-tested."""

from __future__ import annotations

import re
from fractions import Fraction

GSM8K_MARKER = "####"
"""GSM8K's final-answer marker: a worked solution ends with the line ``#### N``."""

_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:=]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3})")
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


def gsm8k_answer(text: str) -> str | None:
    """The final answer N of GSM8K-format text ending in ``#### N``, or None when it has none.

    The one parser of the marker: data sources read reference solutions with it, the math reward its
    gold answers, :func:`extract_answer` completions that end the GSM8K way. Takes the first non-blank
    line after the last ``####``; drops thousands separators, a leading ``$`` and a trailing ``.``;
    keeps anything else as written (signs, decimals, ``1/2``, LaTeX). None: no marker, or nothing after
    the last one.

    >>> gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n#### 72")
    '72'
    >>> gsm8k_answer("... #### $1,250.")
    '1250'
    >>> gsm8k_answer("The answer is 72.") is None
    True
    """
    if GSM8K_MARKER not in text:
        return None
    tail = text.rsplit(GSM8K_MARKER, 1)[1].strip()
    answer = tail.splitlines()[0].strip() if tail else ""
    answer = _THOUSANDS.sub("", answer).removeprefix("$").removesuffix(".").strip()
    return answer or None


def extract_answer(text: str) -> str | None:
    """The final answer a completion states, or None when it states none.

    Looks, in order, for the last ``Answer: X`` line, the last ``#### X`` (:func:`gsm8k_answer`), the
    last ``\\boxed{X}``; markdown bold around the answer is dropped. A bare number without one of these
    markers is not an answer.

    >>> extract_answer("2 + 2 = 4\\nAnswer: 4")
    '4'
    >>> extract_answer("the result is \\\\boxed{\\\\frac{1}{2}}")
    '\\\\frac{1}{2}'
    >>> extract_answer("I think it is 4") is None
    True
    """
    lines = _ANSWER_LINE.findall(text)
    stated = lines[-1] if lines else gsm8k_answer(text)
    if stated is not None:
        return stated.strip().strip("*").strip()
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
