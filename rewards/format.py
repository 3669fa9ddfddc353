"""Format rewards: the completion's structure, not its correctness."""

from __future__ import annotations

import re

from rewards.extract import completion_text

_TAG = re.compile(r"</?(?:think|answer)>")
_ORDER = ["<think>", "</think>", "<answer>", "</answer>"]


def think_answer_format(completions: list, **_columns) -> list[float]:
    """1.0 for ``<think>...</think><answer>...</answer>``: each tag exactly once, in that order, nothing after.

    Whitespace may surround the blocks (and separate them); text before ``<think>`` or after
    ``</answer>``, a missing, duplicated or nested tag, or an empty answer score 0.0. Tags are exact
    and case-sensitive (``<Think>`` is text, so it does not count as a tag but counts as text outside).

    >>> think_answer_format(["<think>2+2</think>\\n<answer>4</answer>", "<answer>4</answer>",
    ...                      "<think>a</think><answer>4</answer> and more"])
    [1.0, 0.0, 0.0]
    """
    return [1.0 if _well_formed(completion_text(c)) else 0.0 for c in completions]


def _well_formed(text: str) -> bool:
    tags = list(_TAG.finditer(text))
    if [m.group() for m in tags] != _ORDER:
        return False
    think_open, think_close, answer_open, answer_close = tags
    outside = text[: think_open.start()] + text[think_close.end() : answer_open.start()] + text[answer_close.end() :]
    return not outside.strip() and bool(text[answer_open.end() : answer_close.start()].strip())
