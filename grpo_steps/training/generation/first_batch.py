"""The first-batch check: the first completions sampled after a push, scored again by the policy under the
distribution the server samples from, must match the server's logprobs (a stale or other server, other sampling
settings, or a server without ``--logprobs-mode processed_logprobs`` fails it)."""

from __future__ import annotations

from grpo_steps.servers.client import GenerationServerError
from grpo_steps.training.sampling import processed_logprobs
from grpo_steps.weights.labels import version_label

FIRST_BATCH_COMPLETIONS = 2
"""Completions of the first batch after a push that the policy scores again for the first-batch check, per replica
that sampled some (:func:`first_completions`; a no-grad forward per completion, per push and process: ~0.1 s for
SmolLM2-135M at 100 tokens, ~2 s with the 600-token prompts of configs/tools.yaml on 2 CPU cores)."""


def first_completions(batch: list[tuple], per_replica: int = FIRST_BATCH_COMPLETIONS) -> list[tuple]:
    """The first ``per_replica`` rows of ``batch`` (``(..., replica)`` tuples, in order) sampled by each replica,
    rows whose replica is not known (None) counting as one replica.

    >>> [row[0] for row in first_completions([("a", 0), ("b", 0), ("c", 0), ("d", 1)], per_replica=2)]
    ['a', 'b', 'd']
    """
    taken: dict[object, int] = {}
    rows = []
    for row in batch:
        if taken.get(row[-1], 0) < per_replica:
            taken[row[-1]] = taken.get(row[-1], 0) + 1
            rows.append(row)
    return rows


class FirstBatchCheck:
    """The check of one run (every rank): :meth:`armed` after each verified push, :meth:`record` with each first turn
    sampled, :meth:`check` when one was recorded.

    Args:
        max_logp_diff: the limit, nats per token (``SyncCheckConfig.thresholds``).
        endpoints: the replicas' base URLs (named in a failure; empty without replicas).
    """

    def __init__(self, max_logp_diff: float, endpoints: tuple[str, ...] = ()) -> None:
        self.max_logp_diff, self.endpoints = max_logp_diff, endpoints
        self.batch: list[tuple[list[int], list[int], list[float], int | None]] | None = None
        """``(prompt_ids, completion_ids, logprobs, replica)`` of the first turn sampled after the last push by the
        policy of the moment; None until then."""
        self.pending = False  # set by every push, cleared when the check has looked

    def armed(self) -> None:
        """A push was verified: the next first turn sampled by the policy of the moment is checked."""
        self.batch, self.pending = None, True

    def record(self, prompts: list[list[int]], completion_ids: list[list[int]], logprobs: list[list[float]],
               replicas: list[int | None]) -> bool:
        """Keep this first turn (B rows) when it is the first since the push; True when there is one to check."""
        if self.pending and self.batch is None:
            self.batch = list(zip(prompts, completion_ids, logprobs, replicas, strict=True))
        return self.pending and self.batch is not None

    def check(self, model, accelerator, gen, version: int, step: int, log) -> None:
        """Score the recorded batch's first completions with the policy ``model`` under the sampling settings ``gen``
        (:func:`grpo_steps.training.sampling.processed_logprobs`) and compare with the sampler's logprobs; the largest
        mean |difference| over the processes decides, so every rank raises together. Logs
        ``weight_sync/first_batch_logp_diff`` and per replica ``weight_sync/replica<i>/first_batch_logp_diff`` into
        ``log(name, value)``.

        Raises:
            GenerationServerError: the mean |sampling logp - policy logp| is above ``max_logp_diff``.
        """
        import torch

        self.pending = False
        diffs: list[float] = []
        by_replica: list[list[float]] = [[] for _ in self.endpoints]
        for prompt_ids, completion_ids, logprobs, replica in first_completions(self.batch):
            if completion_ids:
                policy = processed_logprobs(model, prompt_ids, completion_ids, gen)
                diffs += [abs(a - b) for a, b in zip(logprobs, policy, strict=True)]
                if replica is not None:
                    by_replica[replica] += diffs[-len(completion_ids):]
        # inf when the policy excludes a token the server sampled; NaN: a replica that sampled none of it here
        gaps = [sum(d) / len(d) if d else float("nan") for d in [diffs or [0.0], *by_replica]]
        gathered = accelerator.gather(torch.tensor([gaps], device=accelerator.device)).view(-1, len(gaps))
        gathered = torch.where(torch.isnan(gathered), torch.full_like(gathered, -1.0), gathered)
        value, *per_replica = gathered.max(dim=0).values.tolist()  # -1: no replica's completion on any process
        log("weight_sync/first_batch_logp_diff", value)
        for i, gap in enumerate(per_replica):
            if gap >= 0:
                log(f"weight_sync/replica{i}/first_batch_logp_diff", gap)
        if not value <= self.max_logp_diff:
            off = [f"replica {i + 1}/{len(self.endpoints)} {self.endpoints[i]}: {gap:.3g}"
                   for i, gap in enumerate(per_replica) if not gap <= self.max_logp_diff]
            raise GenerationServerError(
                f"step {step + 1}: the first batch sampled after pushing version {version} "
                f"({version_label(version)}) has mean |sampling logp - policy logp| = {value:.3g} nats per token "
                f"under the configured sampling settings, above generation.sync_check.max_logp_diff = "
                f"{self.max_logp_diff:g}"
                + (f" (sampled by {'; '.join(off)})" if off else "")
                + ": the server does not sample from the policy (stale or other weights, other sampling settings, "
                "or a server started without --logprobs-mode processed_logprobs)"
            )
