"""The teacher's term of the advantage and its metrics (on-policy distillation, ``teacher:``).

The formula: for each completion token ``y_t`` sampled by the sampler ``mu`` (the generation server's policy of the
time; its logprob is kept by TRL as ``sampling_per_token_logps``),

    ``A_t = A_grpo + lambda * sg(log pi_T(y_t | y_<t) - log mu(y_t | y_<t))``

(stop-gradient: both logprobs are numbers read from the servers). ``-(log pi_T - log mu)`` is the single-sample
estimate of the per-token reverse KL ``KL(mu || pi_T)`` at ``y_t``, so maximising the advantage-weighted likelihood
descends the reverse KL to the teacher (Thinking Machines, "On-Policy Distillation", 2025; ms-swift
``teacher_kl_coef``; slime ``--opd-kl-coef``; Gu et al. 2024, "MiniLLM", arXiv 2306.08543). ``A_grpo`` is TRL's
advantage from the task rewards, one per completion (B,) or already per token (B, T) with ``train.turn_credit``;
``mode: pure`` sets it to 0. Tokens outside the loss mask (padding, tool and environment answers, NaN sampler
logprobs) get no teacher term.
"""

from __future__ import annotations

import torch


def teacher_term(teacher_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                 kl_coef: float) -> torch.Tensor:
    """``kl_coef * (teacher_logps - sampler_logps)`` where ``mask`` is 1 and the sampler's logprob is a number, else 0.

    Args:
        teacher_logps, sampler_logps: (B, T) float, natural log, the completion's tokens (padding: any value).
        mask: (B, T) 0/1: completion tokens the policy sampled (TRL's ``completion_mask`` times ``tool_mask``).
        kl_coef: lambda (``teacher.kl_coef``).

    Returns:
        (B, T) float32.

    >>> teacher_term(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, float("nan")]]), torch.tensor([[1, 1]]), 2.0)
    tensor([[1., 0.]])
    """
    usable = mask.bool() & ~torch.isnan(sampler_logps) & ~torch.isnan(teacher_logps)
    ratio = torch.where(usable, teacher_logps.float() - sampler_logps.float(), torch.zeros((), dtype=torch.float32))
    return kl_coef * ratio


def combine(advantages: torch.Tensor, term: torch.Tensor, pure: bool) -> torch.Tensor:
    """The per-token advantages: ``advantages`` (B,) or (B, T) broadcast over the tokens, plus ``term`` (B, T);
    ``pure``: ``term`` alone. Returns (B, T) on ``advantages``' device and dtype.

    >>> combine(torch.tensor([0.5, -0.5]), torch.tensor([[0.1, 0.0], [0.2, 0.3]]), pure=False)
    tensor([[ 0.6000,  0.5000],
            [-0.3000, -0.2000]])
    >>> combine(torch.tensor([0.5, -0.5]), torch.tensor([[0.1, 0.0], [0.2, 0.3]]), pure=True)
    tensor([[0.1000, 0.0000],
            [0.2000, 0.3000]])
    """
    term = term.to(device=advantages.device, dtype=advantages.dtype)
    if pure:
        return term.clone()
    base = advantages if advantages.dim() == 2 else advantages[:, None]
    return base + term


def bucket_names(bounds: list[int]) -> list[tuple[int, int | None, str]]:
    """``(start, end, metric name)`` of each completion-position bucket of ``bounds`` (``teacher.position_buckets``;
    end None: to the end).

    >>> [name for _, _, name in bucket_names([16, 64])]
    ['distill/reverse_kl_pos_0_16', 'distill/reverse_kl_pos_16_64', 'distill/reverse_kl_pos_64_end']
    >>> bucket_names([16])[1][:2]
    (16, None)
    """
    starts = [0, *bounds]
    ends: list[int | None] = [*bounds, None]
    return [(lo, hi, f"distill/reverse_kl_pos_{lo}_{'end' if hi is None else hi}")
            for lo, hi in zip(starts, ends, strict=True)]


def metrics(teacher_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, base: torch.Tensor,
            term: torch.Tensor, bounds: list[int]) -> dict[str, float]:
    """One generation batch's distillation metrics (this process's rows).

    - ``distill/reverse_kl``: mean over the scored tokens of ``log mu - log pi_T``, the per-token estimate of
      ``KL(mu || pi_T)`` (nats); ``distill/reverse_kl_pos_<lo>_<hi>``: the same over completion positions
      ``lo <= t < hi`` (buckets without tokens are left out).
    - ``distill/teacher_share``: ``sum |term| / (sum |A_grpo| + sum |term|)`` over those tokens: the share of the
      advantage's magnitude that comes from the teacher (1.0 with ``mode: pure``).

    Args:
        teacher_logps, sampler_logps, mask: as :func:`teacher_term`.
        base: GRPO's advantages, (B,) or (B, T) (zeros with ``mode: pure``).
        term: :func:`teacher_term`'s (B, T).
        bounds: ``teacher.position_buckets``.

    >>> m = metrics(torch.tensor([[-1.0, -3.0]]), torch.tensor([[-2.0, -1.0]]), torch.tensor([[1, 1]]),
    ...             torch.tensor([1.0]), torch.tensor([[1.0, -2.0]]), [1])
    >>> [round(v, 4) for v in m.values()]  # mean, position 0, positions 1+, teacher share
    [0.5, -1.0, 2.0, 0.6]
    """
    usable = mask.bool() & ~torch.isnan(sampler_logps) & ~torch.isnan(teacher_logps)
    if not usable.any():
        return {}
    kl = (sampler_logps.double() - teacher_logps.double())
    out = {"distill/reverse_kl": kl[usable].mean().item()}
    positions = torch.arange(mask.size(1), device=mask.device)[None, :].expand_as(mask)
    for lo, hi, name in bucket_names(bounds):
        inside = usable & (positions >= lo) & (positions < (hi if hi is not None else mask.size(1)))
        if inside.any():
            out[name] = kl[inside].mean().item()
    grpo = (base if base.dim() == 2 else base[:, None].expand_as(term)).double().abs()[usable].sum()
    teacher = term.double().abs()[usable].sum()
    total = (grpo + teacher).item()
    out["distill/teacher_share"] = teacher.item() / total if total > 0 else 0.0
    return out
