"""Groups whose rewards are all equal (``train.zero_signal_groups``): their advantages are zero, so with ``beta: 0``
they add nothing to the gradient. ``keep`` trains on them (TRL's behaviour); ``skip`` runs no forward/backward for a
micro-batch whose advantages are all zero (exact: its loss and gradient are zero); ``resample`` is DAPO's dynamic
sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2): more groups are generated from other prompts until the
generation batch holds as many groups with non-zero reward variance as it has places, or until
``train.max_resample_rounds`` rounds; the batch keeps its size.

The functions here act on TRL's generation batch: the dict ``GRPOTrainer._generate_and_score_completions`` returns
(``prompt_ids``/``prompt_mask`` left-padded, ``completion_ids``/``completion_mask`` and every per-token tensor
right-padded, ``advantages`` one per completion, groups of ``num_generations`` consecutive rows).
"""

from __future__ import annotations

import torch

PROMPT_KEYS = ("prompt_ids", "prompt_mask")
"""Left-padded (B, P) tensors of a generation batch."""

SCALAR_KEYS = ("num_items_in_batch",)
"""Batch-level values, recomputed by :func:`select_groups`."""


def signal_groups(advantages: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Which groups carry a learning signal: (G,) bool, true where some completion's advantage is not zero.

    ``advantages``: (B,) with B = G x ``num_generations``, groups consecutive (TRL's order). A group's advantages are
    all zero exactly when its rewards are equal, whatever ``scale_rewards`` (TRL subtracts the group mean before
    scaling), or when every completion was unscorable (NaN rewards: TRL zeroes their advantages).

    >>> signal_groups(torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0]), 2).tolist()
    [False, True, False]
    """
    return advantages.reshape(-1, num_generations).abs().amax(dim=1) > 0


def has_signal(inputs: dict) -> bool:
    """Whether a micro-batch has any non-zero advantage (``skip`` trains it only then).

    >>> has_signal({"advantages": torch.zeros(4)}), has_signal({"advantages": torch.tensor([0.0, 0.5])})
    (False, True)
    """
    return bool(inputs["advantages"].abs().max() > 0)


def _pad(tensor: torch.Tensor, width: int, left: bool, value: float | int = 0) -> torch.Tensor:
    missing = width - tensor.size(1)
    if missing <= 0:
        return tensor
    fill = torch.full((tensor.size(0), missing, *tensor.shape[2:]), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([fill, tensor] if left else [tensor, fill], dim=1)


def select_groups(batches: list[dict], picks: list[list[int]], num_generations: int) -> dict:
    """One generation batch made of groups ``picks[i]`` (group indices) of ``batches[i]``, in that order.

    Prompt tensors are re-padded on the left and per-token tensors on the right to the widest batch; per-completion
    tensors are concatenated; ``num_items_in_batch`` (tokens the loss counts: ``completion_mask`` x ``tool_mask``)
    is recomputed for this process (the caller sums it over processes). Padding values: 0 for ids and masks, 1 for
    ``importance_sampling_ratio`` and ``tool_mask`` (TRL's own padding), 0 for logprobs (masked anyway).

    Raises:
        ValueError: a batch holds a key this does not know how to join (images: multimodal batches are refused
            by the config).

    >>> a = {"prompt_ids": torch.tensor([[0, 5], [0, 5]]), "prompt_mask": torch.tensor([[0, 1], [0, 1]]),
    ...      "completion_ids": torch.tensor([[7], [8]]), "completion_mask": torch.tensor([[1], [1]]),
    ...      "advantages": torch.tensor([1.0, -1.0]), "num_items_in_batch": torch.tensor(2)}
    >>> b = {"prompt_ids": torch.tensor([[6], [6]]), "prompt_mask": torch.tensor([[1], [1]]),
    ...      "completion_ids": torch.tensor([[7, 9], [8, 0]]), "completion_mask": torch.tensor([[1, 1], [1, 0]]),
    ...      "advantages": torch.tensor([0.5, -0.5]), "num_items_in_batch": torch.tensor(3)}
    >>> out = select_groups([a, b], [[0], [0]], 2)
    >>> out["prompt_ids"].tolist(), out["completion_ids"].tolist(), int(out["num_items_in_batch"])
    ([[0, 5], [0, 5], [0, 6], [0, 6]], [[7, 0], [8, 0], [7, 9], [8, 0]], 5)
    """
    keys = [k for k in batches[0] if k not in SCALAR_KEYS]
    unknown = [k for k in keys if not isinstance(batches[0][k], torch.Tensor)]
    if unknown:
        raise ValueError(f"cannot join generation batches holding {unknown} (zero_signal_groups: resample)")
    rows = [torch.tensor([g * num_generations + i for g in groups for i in range(num_generations)], dtype=torch.long)
            for groups in picks]
    out = {}
    for key in keys:
        parts = [batch[key].index_select(0, index.to(batch[key].device)) for batch, index in zip(batches, rows,
                                                                                                  strict=True)]
        if parts[0].dim() >= 2:
            width = max(p.size(1) for p in parts)
            value = 1 if key in ("importance_sampling_ratio", "tool_mask") else 0
            parts = [_pad(p, width, left=key in PROMPT_KEYS, value=value) for p in parts]
        out[key] = torch.cat(parts, dim=0)
    mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
    out["num_items_in_batch"] = mask.sum()
    return out


def plan_resample(signal: list[torch.Tensor], places: int) -> tuple[list[list[int]], int]:
    """Which groups fill the ``places`` of the batch: the groups with signal of each round in order (``signal[i]``:
    :func:`signal_groups` of round i), then, when fewer than ``places`` have signal, the first round's groups without
    it (the batch keeps its size). Returns (group indices per round, groups with signal used).

    >>> plan_resample([torch.tensor([False, True, False]), torch.tensor([True, True, False])], 3)
    ([[1], [0, 1]], 3)
    >>> plan_resample([torch.tensor([False, True, False]), torch.tensor([False, False, False])], 3)
    ([[1, 0, 2], []], 1)
    """
    picks: list[list[int]] = [[] for _ in signal]
    used = 0
    for i, groups in enumerate(signal):
        for g in torch.nonzero(groups).flatten().tolist():
            if used < places:
                picks[i].append(g)
                used += 1
    fill = [g for g in range(len(signal[0])) if not bool(signal[0][g])][: places - used]
    picks[0] += fill
    return picks, used
