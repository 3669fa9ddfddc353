"""The pure functions of the zero-signal modes (:mod:`grpo_steps.training.zero_signal`) and the replay buffer: which
groups carry a learning signal, how ``skip`` cuts micro-batches (:func:`signal_first`), how ``resample`` picks groups
over rounds (:func:`plan_resample`, :func:`select_groups`), how ``replay`` fills places from its buffer
(:class:`ReplayBuffer`, :func:`plan_replay`, :func:`fill_from_buffer`) and reweights them (:func:`importance_weights`).

They act on TRL's generation batch: the dict ``GRPOTrainer._generate_and_score_completions`` returns
(``prompt_ids``/``prompt_mask`` left-padded, ``completion_ids``/``completion_mask`` and every per-token tensor
right-padded, ``advantages`` one per completion, groups of ``num_generations`` consecutive rows).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

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


def signal_first(micro_batches: list[dict]) -> list[dict]:
    """The micro-batches of one generation batch cut again, same count and size, with the rows that have a non-zero
    advantage first (each part in its given order): TRL shuffles a generation batch's rows before cutting it, which
    spreads the rows without signal over every micro-batch, so ``skip`` would find few micro-batches to drop; cut
    this way, all but at most one of the micro-batches holding rows without signal hold nothing else.

    Exact when the micro-batches of a generation batch make one optimizer step and the loss does not depend on how
    its rows are cut (the caller checks: every TRL loss type but ``bnpo``, no entropy mask). Tensors of 0 dims are
    shared by every micro-batch, as TRL's ``split_tensor_dict`` leaves them; lists are cut like tensors; a batch
    with any other value that is not one per row (image patches) is returned as it is.

    >>> parts = [{"advantages": torch.tensor([0.0, 1.0]), "n": torch.tensor(7)},
    ...          {"advantages": torch.tensor([0.0, -1.0]), "n": torch.tensor(7)}]
    >>> [(p["advantages"].tolist(), int(p["n"])) for p in signal_first(parts)]
    [([1.0, -1.0], 7), ([0.0, 0.0], 7)]
    """
    from trl.trainer.utils import split_tensor_dict

    signal = torch.cat([batch["advantages"] for batch in micro_batches]) != 0  # (B,)
    order = torch.cat([torch.nonzero(signal).flatten(), torch.nonzero(~signal).flatten()]).tolist()
    whole = {}
    for key, first in micro_batches[0].items():
        if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
            whole[key] = first  # shared by every micro-batch
            continue
        tensor = isinstance(first, torch.Tensor)
        rows = torch.cat([b[key] for b in micro_batches]) if tensor else [x for b in micro_batches for x in b[key]]
        if len(rows) != len(order):
            return micro_batches  # not one value per row (image patches): TRL's cut stays
        whole[key] = rows[order] if tensor else [rows[i] for i in order]
    return split_tensor_dict(whole, len(micro_batches))


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
        raise ValueError(f"cannot join generation batches holding {unknown} (zero_signal_groups: resample, replay)")
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


@dataclass(frozen=True)
class BufferedGroup:
    """One group of a past generation batch: ``batch`` is :func:`select_groups` of that group alone (``num_generations``
    rows, detached, on CPU), ``step`` the optimizer step (``state.global_step``) whose policy it was generated at."""

    batch: dict
    step: int


class ReplayBuffer:
    """The groups with signal of the latest generation batches of this process, newest last; at most ``capacity``
    groups (the oldest leave first) and, with ``max_age``, none generated more than ``max_age`` optimizer steps ago.
    Lives in memory only: a resumed run starts with it empty.

    >>> batch = {"prompt_ids": torch.tensor([[5], [5], [6], [6]]), "prompt_mask": torch.ones(4, 1),
    ...          "completion_ids": torch.tensor([[7], [8], [7], [8]]), "completion_mask": torch.ones(4, 1),
    ...          "advantages": torch.tensor([1.0, -1.0, 0.0, 0.0])}
    >>> buffer = ReplayBuffer(capacity=2, max_age=3)
    >>> buffer.add(batch, signal_groups(batch["advantages"], 2), 2, step=0)
    >>> buffer.add(batch, signal_groups(batch["advantages"], 2), 2, step=1)
    >>> buffer.add(batch, signal_groups(batch["advantages"], 2), 2, step=2)  # capacity 2: step 0's group leaves
    >>> [g.step for g in buffer.newest_first(step=4)], [g.step for g in buffer.newest_first(step=5)]  # age > 3 leaves
    ([2, 1], [2])
    >>> buffer.newest_first(step=5)[0].batch["prompt_ids"].tolist()
    [[5], [5]]
    """

    def __init__(self, capacity: int, max_age: int | None = None):
        self.groups: deque[BufferedGroup] = deque(maxlen=capacity)
        self.max_age = max_age

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, batch: dict, signal: torch.Tensor, num_generations: int, step: int) -> None:
        """Keep the groups of ``batch`` where ``signal`` ((G,) bool, :func:`signal_groups`) is true, in batch order."""
        for g in torch.nonzero(signal).flatten().tolist():
            group = select_groups([batch], [[g]], num_generations)
            detached = {k: v.detach().to("cpu") for k, v in group.items()}  # off the accelerator: it can wait there
            self.groups.append(BufferedGroup(detached, step))

    def newest_first(self, step: int) -> list[BufferedGroup]:
        """The groups that may be replayed at optimizer step ``step``, newest first, after dropping those older than
        ``max_age`` steps."""
        if self.max_age is not None:
            while self.groups and step - self.groups[0].step > self.max_age:
                self.groups.popleft()
        return list(reversed(self.groups))


def plan_replay(signal: torch.Tensor, buffered: int) -> list[int]:
    """Which group fills each place of the batch: -1 keeps the place's own group, k >= 0 puts the k-th newest buffered
    group there. The places without signal (``signal``: (G,) bool) are filled in order with the ``buffered`` groups,
    newest first, each at most once per batch; places left when the buffer runs out keep their own group.

    >>> plan_replay(torch.tensor([False, True, False, False]), 2)
    [0, -1, 1, -1]
    >>> plan_replay(torch.tensor([True, False]), 0)
    [-1, -1]
    """
    sources, used = [], 0
    for has in signal.tolist():
        if not has and used < buffered:
            sources.append(used)
            used += 1
        else:
            sources.append(-1)
    return sources


def fill_from_buffer(batch: dict, sources: list[int], groups: list[dict], num_generations: int) -> dict:
    """The generation batch with ``groups[k]`` (one-group batches, e.g. :attr:`BufferedGroup.batch`) in each place
    whose ``sources`` entry is k >= 0 (:func:`plan_replay`), on ``batch``'s device; same number of rows (B = G x
    ``num_generations``), each place's group where it was, padding and the local ``num_items_in_batch`` as in
    :func:`select_groups`. Every row keeps the values it was generated with (advantages included): the caller
    recomputes what depends on the current policy.

    >>> ones = torch.ones(4, 1, dtype=torch.long)
    >>> batch = {"prompt_ids": torch.tensor([[5], [5], [6], [6]]), "prompt_mask": ones,
    ...          "completion_ids": torch.tensor([[7], [8], [7], [8]]), "completion_mask": ones,
    ...          "advantages": torch.tensor([0.0, 0.0, 1.0, -1.0])}
    >>> old = {"prompt_ids": torch.tensor([[0, 9], [0, 9]]), "prompt_mask": torch.tensor([[0, 1], [0, 1]]),
    ...        "completion_ids": torch.tensor([[3, 4], [3, 0]]), "completion_mask": torch.tensor([[1, 1], [1, 0]]),
    ...        "advantages": torch.tensor([0.5, -0.5])}
    >>> out = fill_from_buffer(batch, [0, -1], [old], 2)
    >>> out["prompt_ids"].tolist(), out["advantages"].tolist(), int(out["num_items_in_batch"])
    ([[0, 9], [0, 9], [0, 6], [0, 6]], [0.5, -0.5, 1.0, -1.0], 5)
    """
    device = batch["advantages"].device
    batches, picks = [], []
    for place, source in enumerate(sources):
        if source < 0:
            batches.append(batch)
            picks.append([place])
        else:
            batches.append({k: v.to(device) for k, v in groups[source].items()})
            picks.append([0])
    return select_groups(batches, picks, num_generations)


def replayed_rows(sources: list[int], num_generations: int) -> torch.Tensor:
    """(R,) long: the rows of the batch that :func:`fill_from_buffer` took from the buffer.

    >>> replayed_rows([0, -1, 1], 2).tolist()
    [0, 1, 4, 5]
    """
    return torch.tensor([place * num_generations + i for place, source in enumerate(sources) if source >= 0
                         for i in range(num_generations)], dtype=torch.long)


def importance_weights(policy_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                       clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's trainer–inference mismatch weight rho = pi_policy / pi_sampler (TRL 1.16
    ``GRPOTrainer._generate_and_score_completions``, the ``vllm_importance_sampling_*`` correction, same steps; a test
    pins TRL's lines): per token, or per completion (product over its tokens) for the ``sequence_*`` modes, then
    clipped into [``clip_min``, ``clip_max``] (``*_truncate``) or set to 0 outside (``*_mask``). For a replayed group
    the sampler is the older policy that generated it, so rho is its off-policy weight against the current policy.

    ``policy_logps``, ``sampling_logps``, ``mask`` (loss tokens: completion mask x tool mask): (B, T). Sampling
    logprobs vLLM could not give (NaN) count as rho = 1. Returns (B, T) for ``token_*`` modes, (B, 1) for
    ``sequence_*``. Raises ValueError for another mode.

    >>> lp, sp, m = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-2.0, float("nan")]]), torch.ones(1, 2)
    >>> importance_weights(lp, sp, m, "token_truncate", None, 2.0).tolist()
    [[2.0, 1.0]]
    >>> importance_weights(lp, sp, m, "sequence_mask", None, 2.0).tolist()
    [[0.0]]
    """
    level, _, action = mode.partition("_")
    if level not in ("token", "sequence") or action not in ("truncate", "mask"):
        raise ValueError(f"unknown importance sampling mode {mode!r}")
    diff = torch.nan_to_num((policy_logps - sampling_logps) * mask, nan=0.0)
    if level == "sequence":
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if action == "truncate":
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
