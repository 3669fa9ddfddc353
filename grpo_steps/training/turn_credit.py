"""Per-turn credit (``train.turn_credit``): where an environment's game rewards each move, each turn's tokens get
the episode's advantage plus the credit of the moves from that turn on, so a turn that earned (or lost) reward is
told apart from the episode's other turns.

The formula. Per group of ``num_generations`` episodes of one prompt, the turn rewards ``r`` (the game's rewards of the
moves a turn made: :func:`rewards.game.turn_rewards`) are normalised over every turn of the group,
``r~ = (r - mean(R)) / (std(R) + 1e-4)``, and the tokens of turn ``k`` get ``sum_{j >= k} r~_j``: GRPO's process
supervision (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300, section 4.1.3, each reasoning step a turn here). That
term is added, weighted by ``w = train.turn_credit``, to the episode's own GRPO advantage ``A_i`` (TRL's, from the
episode's rewards), as GiGPO adds its step-level advantage to the episode-level one (``A = A^E + w A^S``; Feng et al.
2025, arXiv 2505.10978, eq. 9): ``A_{i,t} = A_i + w * sum_{j >= turn(t)} r~_{i,j}``. TRL's loss takes (B, T)
advantages as they are (``GRPOTrainer._compute_loss``). The standard deviation is torch's (unbiased), as TRL's
group scaling; a group whose turn rewards are all equal gets no per-turn term.

A turn is a run of the model's tokens in the completion (``tool_mask`` 1: TRL's tool loop masks the tools' answers
with 0), matched in order with the episode's assistant messages; a turn that made no move, an episode whose
environment keeps no per-move rewards, or one whose runs do not match its messages, adds nothing.
"""

from __future__ import annotations

import torch

EPSILON = 1e-4
"""Added to the standard deviation (TRL's ``1e-4`` in its advantage scaling)."""


def turn_spans(tool_mask: list[int], completion_mask: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of model tokens (``tool_mask`` 1 within ``completion_mask`` 1), in order.

    >>> turn_spans([1, 1, 0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 0])
    [(0, 2), (4, 7)]
    """
    spans, start = [], None
    for t, (model, real) in enumerate(zip(tool_mask, completion_mask, strict=True)):
        if model and real:
            start = t if start is None else start
        elif start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, len(tool_mask)))
    return spans


def normalised(turns: list[list[float | None]]) -> list[list[float]]:
    """The turn rewards of one group's episodes (None: no move), each ``(r - mean) / (std + EPSILON)`` over all the
    group's turn rewards; 0.0 for a turn without one, and everywhere when fewer than two rewards or all equal.

    >>> [[round(r, 3) for r in episode] for episode in normalised([[-1.0, 1.0], [None, 1.0]])]
    [[-1.155, 0.577], [0.0, 0.577]]
    """
    values = [r for episode in turns for r in episode if r is not None]
    if len(values) < 2 or max(values) == min(values):
        return [[0.0] * len(episode) for episode in turns]
    rewards = torch.tensor(values, dtype=torch.float64)
    mean, std = rewards.mean().item(), rewards.std().item()
    return [[0.0 if r is None else (r - mean) / (std + EPSILON) for r in episode] for episode in turns]


def fold(advantages: torch.Tensor, tool_mask: torch.Tensor, completion_mask: torch.Tensor,
         turns: list[list[float | None] | None], num_generations: int, weight: float) -> torch.Tensor:
    """Per-token advantages: ``advantages`` (B,) (the episodes' own, TRL's) plus ``weight`` times each token's
    turn-to-go credit (module docstring).

    Args:
        advantages: (B,) float, one per completion, groups of ``num_generations`` consecutive rows.
        tool_mask, completion_mask: (B, T) 0/1, TRL's: model tokens 1 / tool answers 0; real tokens 1 / padding 0.
        turns: per completion, the game's reward of each of its assistant turns (None where a turn made no move),
            or None where the environment keeps no per-move rewards.
        num_generations: G.
        weight: ``train.turn_credit``.

    Returns:
        (B, T) float on ``advantages``' device.
    """
    out = advantages[:, None].expand(-1, tool_mask.size(1)).clone()
    for group in range(0, len(turns), num_generations):
        rows = range(group, min(group + num_generations, len(turns)))
        spans = {i: turn_spans(tool_mask[i].tolist(), completion_mask[i].tolist()) for i in rows}
        usable = [i for i in rows if turns[i] is not None and len(turns[i]) == len(spans[i])]
        for i, credit in zip(usable, normalised([turns[i] for i in usable]), strict=True):
            to_go = 0.0
            for (start, end), reward in reversed(list(zip(spans[i], credit, strict=True))):
                to_go += reward
                out[i, start:end] += weight * to_go
    return out


def turns_per_episode(completions: list) -> float | None:
    """Mean assistant turns per episode of a generation batch's logged completions (TRL's ``completion`` column: an
    episode is a list of messages; plain text completions are left out); None without episodes.

    >>> turns_per_episode([[{"role": "assistant"}, {"role": "tool"}, {"role": "assistant"}], "text"])
    2.0
    """
    turns = [sum(m.get("role") == "assistant" for m in c) for c in completions if isinstance(c, list)]
    return sum(turns) / len(turns) if turns else None
