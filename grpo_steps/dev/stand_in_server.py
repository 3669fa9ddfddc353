"""A stand-in for the generation server where none can run: the unit tests of the trainer without a vLLM process,
and ``bench/gpu_zero3.py`` on a GPU machine without vLLM."""

from __future__ import annotations


class StandInServer:
    """What :class:`grpo_steps.training.generation.server.RolloutBackend` offers TRL's ``GRPOTrainer``
    (``settings``, ``sampled_version``, ``sync_weights``, ``replica_rows``, ``generate``), with the completion
    and the sampler logprobs of each prompt from :meth:`sample`, returned at once; pushes and checks do nothing.
    Put in place of a ``ServerGRPOTrainer``'s ``vllm_generation`` after its constructor.

    Args:
        settings: the trainer's :class:`grpo_steps.training.generation.settings.ServerSettings` (read by the trainer).
    """

    def __init__(self, settings) -> None:
        self.settings, self.sampled_version = settings, 0

    def sync_weights(self, force: bool = False) -> None:
        pass

    def replica_of(self, prompt: list[int]) -> int | None:
        """The replica that "sampled" ``prompt`` (None: not known, the default)."""
        return None

    def replica_rows(self, prompt_ids, prompt_mask):
        """``RolloutBackend.replica_rows``'s answer from :meth:`replica_of`: (B,) int64, -1 where not known."""
        import torch

        rows = [self.replica_of(ids[mask.bool()].tolist()) for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        return torch.tensor([-1 if r is None else r for r in rows], dtype=torch.int64, device=prompt_ids.device)

    def sample(self, prompt: list[int], index: int) -> tuple[list[int], list[float]]:
        """The completion token ids of ``prompt`` (the ``index``-th of its batch) and one sampler logprob per token
        (nats)."""
        raise NotImplementedError

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        """``RolloutBackend.generate``'s answer: (prompt ids, completion ids, logprobs and their token ids, each as
        a top-1 list per token)."""
        samples = [self.sample(prompt, i) for i, prompt in enumerate(prompts)]
        return (prompts, [ids for ids, _ in samples], [[[lp] for lp in lps] for _, lps in samples],
                [[[t] for t in ids] for ids, _ in samples])
