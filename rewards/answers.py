"""Rewards for tasks with one exact final answer: correctness (numeric match) and answer format.

Each follows TRL's reward contract ``fn(completions, **dataset_columns) -> list[float | None]``
(one score per completion; None where the reward does not apply to that row).
"""

from __future__ import annotations

import re

from rewards.extract import completion_text, extract_answer, parse_number

_FINAL_LINE = re.compile(r"^\s*answer\s*:\s*\S+.*$", re.IGNORECASE)


def answer_accuracy(completions: list, answer: list, **_columns) -> list[float | None]:
    """1.0 when the stated final answer equals the reference answer, else 0.0.

    Numbers compare exactly as fractions (``0.5`` == ``1/2``, ``1,000`` == ``1000``); answers that are
    not numbers compare as case-insensitive strings. A row without a reference answer scores None.

    Args:
        completions: N completions (strings or conversational message lists).
        answer: N reference answers (the dataset's answer column).

    >>> answer_accuracy(["so\\nAnswer: 0.5", "Answer: 2", "it is 0.5"], ["1/2", "1/2", "1/2"])
    [1.0, 0.0, 0.0]
    """
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        if reference is None:
            scores.append(None)
            continue
        stated = extract_answer(completion_text(completion))
        got, want = parse_number(stated), parse_number(str(reference))
        if got is not None and want is not None:
            scores.append(float(got == want))
        else:
            scores.append(float(stated is not None and stated.strip().lower() == str(reference).strip().lower()))
    return scores


def answer_format(completions: list, **_columns) -> list[float]:
    """1.0 when the completion ends with a line ``Answer: <value>``, else 0.0.

    >>> answer_format(["3 + 4 = 7\\nAnswer: 7", "Answer: 7 and more text after", "7"])
    [1.0, 0.0, 0.0]
    """
    scores = []
    for completion in completions:
        lines = [line for line in completion_text(completion).strip().splitlines() if line.strip()]
        ok = bool(lines) and _FINAL_LINE.match(lines[-1]) and parse_number(extract_answer(lines[-1])) is not None
        scores.append(1.0 if ok else 0.0)
    return scores
