"""Statistics of an evaluation, pure and doctested: the unbiased pass@k estimator, the mean over scored values, a
prompt's stable key, and the paired gain of one policy over another with its Student-t interval."""

from __future__ import annotations

import hashlib
import json
import statistics
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with ``c`` correct among ``n`` samples.

    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", eq. 1).

    Raises:
        ValueError: ``k`` not in 1..n or ``c`` not in 0..n.

    >>> pass_at_k(4, 1, 1)
    0.25
    >>> pass_at_k(4, 1, 4)
    1.0
    >>> pass_at_k(4, 0, 2)
    0.0
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_scored(values) -> float:
    """Mean of the values that are not None (a reward that does not apply scores None); NaN when none is.

    >>> mean_scored([1.0, None, 0.0])
    0.5
    >>> mean_scored([None])
    nan
    """
    values = [v for v in values if v is not None]
    return float(statistics.fmean(values)) if values else float("nan")


def prompt_key(prompt) -> str:
    """A short stable digest of one prompt (a string or a chat message list): which prompts two policies' scores
    share (the registry compares a version with the champion prompt by prompt, :mod:`grpo_steps.gate`).

    >>> prompt_key([{"role": "user", "content": "1 + 1?"}]) == prompt_key([{"role": "user", "content": "1 + 1?"}])
    True
    """
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean gain ``after - before`` over prompts scored by both policies, and the half-width of its 95 % interval:
    ``t(0.975, P-1) * sd(d) / sqrt(P)`` for the P per-prompt differences ``d`` (a paired interval: each prompt is
    its own control; Student's t rather than the normal 1.96, which is too narrow on a few prompts). When every
    difference is equal, ``sd(d)`` is 0 but the sample, not the policy, is degenerate (two prompts that both
    gained): the sd is then taken over ``d`` plus one prompt without a gain, so the interval never has width 0.
    The half-width is NaN with fewer than 2 prompts.

    Raises:
        ValueError: the lists differ in length or are empty.

    >>> paired_gain([0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0])
    (0.5, 0.918...)
    >>> paired_gain([0.0, 0.0], [1.0, 1.0])  # +1 on both prompts: wide, not +1 +- 0
    (1.0, 5.18...)
    """
    from scipy.stats import t as student_t

    if len(before) != len(after) or not before:
        raise ValueError(f"paired_gain needs two equally long, non-empty lists, got {len(before)} and {len(after)}")
    diffs = [b - a for a, b in zip(before, after, strict=True)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, float("nan")
    sd = statistics.stdev(diffs) or statistics.stdev([*diffs, 0.0])  # degenerate sample: one more, no-gain prompt
    return mean, float(student_t.ppf(0.975, len(diffs) - 1)) * sd / len(diffs) ** 0.5


def gain_metrics(baseline: dict[str, list[float]], trained: dict[str, list[float]]) -> dict[str, float]:
    """Trained minus baseline on the same prompts, per metric of ``per_prompt`` (see
    :func:`grpo_steps.evaluation.policy.evaluate_policy`): ``<metric>`` (mean gain) and ``<metric>_ci95`` (half-width of
    its paired 95 % interval, :func:`paired_gain`). With tools (a ``tool_call`` entry):
    ``accuracy_from_tool_calls``, the part of the accuracy gain made on prompts whose trained greedy episode called
    a tool (the rest of ``accuracy`` was made without a call).

    >>> gain = gain_metrics({"accuracy": [0, 0, 1], "tool_call": [0, 0, 0]},
    ...                     {"accuracy": [1, 1, 1], "tool_call": [1, 0, 1]})
    >>> gain["accuracy"], gain["accuracy_from_tool_calls"]
    (0.6666666666666666, 0.3333333333333333)
    """
    out = {}
    for name in baseline:
        out[name], out[f"{name}_ci95"] = paired_gain(baseline[name], trained[name])
    if "tool_call" in trained and "accuracy" in trained:
        deltas = [(t - b) * call for b, t, call in zip(baseline["accuracy"], trained["accuracy"],
                                                       trained["tool_call"], strict=True)]
        out["accuracy_from_tool_calls"] = sum(deltas) / max(len(deltas), 1)
    return out
