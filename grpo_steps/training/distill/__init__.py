"""On-policy distillation inside the pipeline's GRPO trainer (``teacher:``, docs/distillation.md): a frozen teacher
served by vLLM scores every token the policy sampled (:mod:`.scoring`), and ``kl_coef`` times the per-token log-ratio
to the sampler joins TRL's advantage (:mod:`.advantage`), which TRL 1.16's loss takes per token, (B, T), as
``train.turn_credit``'s. :class:`Distillation` is what the trainer holds: :meth:`~Distillation.start` when a
round's rollouts are sampled, :meth:`~Distillation.fold` when its advantages are computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo_steps.training.distill import advantage
from grpo_steps.training.distill.scoring import Pending, TeacherScorer, padded, privileged_prompt


@dataclass
class Distillation:
    """The run's distillation settings and its teacher's scorer.

    Args:
        scorer: the teacher's :class:`~.scoring.TeacherScorer`.
        kl_coef: lambda (``teacher.kl_coef``).
        mode: ``mixed``, ``pure`` or ``privileged`` (``teacher.mode``).
        answer_column: the rows' reference answer (``teacher.answer_column``), for ``privileged``.
        buckets: ``teacher.position_buckets``.
    """

    scorer: TeacherScorer
    kl_coef: float
    mode: str = "mixed"
    answer_column: str = "answer"
    buckets: list[int] = field(default_factory=lambda: [16, 64, 256])

    def start(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], rows: list[dict],
              tokenize: Callable[[list], list[list[int]]]) -> Pending:
        """Send the round's completions to the teacher (in the background).

        Args:
            prompt_ids, completion_ids: this process's rollouts, as TRL's ``_generate`` returns them.
            rows: the dataset rows they were sampled for (TRL's ``inputs``, one per completion).
            tokenize: TRL's prompt tokenization (:func:`grpo_steps.trl_hooks.tokenize_prompts` of the trainer), for
                ``privileged``'s prompts.

        Raises:
            KeyError: ``privileged`` and a row without ``answer_column`` (the data step keeps answer columns).
        """
        if self.mode == "privileged":
            prompt_ids = tokenize([privileged_prompt(row["prompt"], row[self.answer_column]) for row in rows])
        return self.scorer.start(prompt_ids, completion_ids)

    def fold(self, output: dict, pending: Pending) -> tuple[torch.Tensor, dict[str, float]]:
        """The round's per-token advantages (:mod:`.advantage`) and its ``distill/*`` metrics, from TRL's round
        ``output`` (``advantages`` (B,) or (B, T), ``completion_mask``, ``tool_mask`` when tools ran,
        ``sampling_per_token_logps``) and the teacher's answer.

        Raises:
            KeyError: ``output`` has no sampler logprobs (a backend without them; refused by the config).
            GenerationServerError: the teacher's request failed.
        """
        mask = output["completion_mask"]
        if "tool_mask" in output:  # tool and environment answers: scored as context, never as the policy's tokens
            mask = mask * output["tool_mask"]
        sampler = output["sampling_per_token_logps"]
        teacher = padded(pending.result(), mask.size(1), mask.device)
        term = advantage.teacher_term(teacher, sampler, mask, self.kl_coef)
        pure = self.mode == "pure"
        base = torch.zeros_like(output["advantages"]) if pure else output["advantages"]
        metrics = advantage.metrics(teacher, sampler, mask, base, term, self.buckets)
        metrics["distill/teacher_seconds"] = pending.scoring_s
        metrics["distill/teacher_wait_seconds"] = pending.waited_s
        return advantage.combine(output["advantages"], term, pure), metrics


def from_job(cfg, server: dict | None) -> Distillation | None:
    """The :class:`Distillation` of a run config with ``teacher:`` whose generation server's handle ``server`` holds
    the teacher's (:mod:`grpo_steps.servers.teacher`); None without ``teacher:``.

    Raises:
        ValueError: ``teacher:`` is set and the handle holds no teacher (provisioned by an older pipeline: provision
            the run's servers again).
    """
    if cfg.teacher is None:
        return None
    from grpo_steps.servers import teacher as teacher_server

    teacher = teacher_server.of(server)
    if teacher is None:
        raise ValueError("teacher: is set but the run's server handle holds no teacher server: start a new run")
    return Distillation(TeacherScorer(teacher.client()), cfg.teacher.kl_coef, cfg.teacher.mode,
                        cfg.teacher.answer_column, list(cfg.teacher.position_buckets))
