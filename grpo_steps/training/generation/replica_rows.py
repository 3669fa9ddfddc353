"""Which replica sampled which row of a generation batch: the ledger a generation round fills from the answers
(:meth:`grpo_steps.servers.client.VLLMClient.replica_index`) and the loss reads, so that the mismatch correction is
weighed per replica."""

from __future__ import annotations


class ReplicaLedger:
    """First-turn prompt -> the replica that sampled it, for the generation batch at one micro-step (a group, and with
    ``consistent_hash`` a whole episode, is served by one replica)."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self._by_prompt: dict[tuple[int, ...], int] = {}
        self._key: int | None = None  # the micro-step whose generation batch is recorded

    def record(self, key: int, prompts: list[list[int]], replicas: list[int | None], log) -> None:
        """A first turn of the generation batch at micro-step ``key`` (B prompts, the replica of each or None): an
        earlier batch is forgotten, and ``generation/replica<i>/completions`` (completions replica i sampled, this
        process's share) goes to ``log(name, value)`` when the answers say."""
        if key != self._key:  # resample's extra rounds share their batch's micro-step: they add to it
            self._by_prompt.clear()
            self._key = key
        self._by_prompt.update((tuple(p), r) for p, r in zip(prompts, replicas, strict=True) if r is not None)
        if self.replicas and any(r is not None for r in replicas):
            for i in range(self.replicas):
                log(f"generation/replica{i}/completions", float(replicas.count(i)))

    def rows(self, prompt_ids, prompt_mask):
        """``prompt_ids`` / ``prompt_mask`` (B, P) (TRL's padded prompts) -> (B,) int64 on their device: the replica
        that sampled each row's prompt, -1 where not known."""
        import torch

        rows = [self._by_prompt.get(tuple(ids[mask.bool()].tolist()), -1)
                for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        return torch.tensor(rows, dtype=torch.int64, device=prompt_ids.device)
