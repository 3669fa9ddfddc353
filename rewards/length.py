"""Length shaping: DAPO's soft overlong punishment.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13
(https://arxiv.org/abs/2503.14476); the same formula as TRL's ``trl.rewards.get_soft_overlong_punishment``
(TRL 1.16, ``trl/rewards/other_rewards.py``), as a plain function whose limits are config options.
"""

from __future__ import annotations


def soft_overlong_punishment(
    completions: list,
    completion_ids: list[list[int]] | None = None,
    *,
    max_completion_len: int,
    soft_punish_cache: int,
    **_columns,
) -> list[float | None]:
    """Penalty for completions near or over the length limit; lengths in tokens.

    With ``L = len(completion_ids[i])``, ``L_max = max_completion_len``, ``L_cache = soft_punish_cache``::

        0                                  if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max   (linear from 0 down to -1)
        -1                                 if L > L_max

    Args:
        completions: N completions (only their count is used).
        completion_ids: N lists of completion token ids (GRPOTrainer passes them). None: lengths unknown,
            every row scores None.
        max_completion_len: ``L_max``, tokens; set it to the generation limit (``generation.max_completion_tokens``).
        soft_punish_cache: ``L_cache``, tokens, the soft zone before ``L_max``; 0 gives a hard -1 above ``L_max``.

    Raises:
        ValueError: ``max_completion_len <= 0`` or ``soft_punish_cache`` outside ``0..max_completion_len``.

    >>> soft_overlong_punishment(["a"] * 4, [[1] * 70, [1] * 80, [1] * 90, [1] * 101],
    ...                          max_completion_len=100, soft_punish_cache=20)
    [0.0, 0.0, -0.5, -1.0]
    """
    if max_completion_len <= 0 or not 0 <= soft_punish_cache <= max_completion_len:
        raise ValueError(f"need max_completion_len > 0 and 0 <= soft_punish_cache <= max_completion_len, got "
                         f"{max_completion_len} and {soft_punish_cache}")
    if completion_ids is None:
        return [None] * len(completions)
    start = max_completion_len - soft_punish_cache  # the soft zone is (start, max_completion_len]
    scores: list[float | None] = []
    for ids in completion_ids:
        length = len(ids)
        if length <= start:
            scores.append(0.0)
        elif length <= max_completion_len:
            scores.append((start - length) / soft_punish_cache)
        else:
            scores.append(-1.0)
    return scores
