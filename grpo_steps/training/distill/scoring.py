"""The teacher's scoring of a generation round (on-policy distillation, ``teacher:``): each completion is sent to the
teacher's vLLM server as prompt ids + completion ids with ``max_tokens=1`` and ``prompt_logprobs`` (TRL 1.16's
``AsyncDistillationTrainer`` request shape, ``trl/experimental/async_distillation/async_rollout_worker.py``), the
round's completions batched in one request; the answer's entry ``i`` scores sequence token ``i`` given the tokens
before it, so the completion's tokens are read from the prompt's length on.

The request runs in a background thread from the moment the round's rollouts are sampled (:meth:`TeacherScorer.start`,
called from the trainer's ``_generate``), beside TRL's reward functions and its scoring pass of the policy; the
trainer waits for it only when it folds the advantages (:meth:`Pending.result`). The teacher is frozen, so a
completion sampled by several policy versions (``generation.async.in_flight``) is scored as it is: its sampler
logprobs (TRL's ``sampling_per_token_logps``) are those of whichever version sampled each token.

``mode: privileged``: the teacher sees the row's prompt with its reference answer added (:func:`privileged_prompt`).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

PRIVILEGED_NOTE = ("\n\n(For the grader only: the reference answer is {answer}. Solve the problem as asked; your "
                   "reasoning must lead to this answer.)")
"""Added to the last user message of a row's prompt for the privileged teacher (``teacher.mode: privileged``)."""


def privileged_prompt(prompt, answer) -> list[dict] | str:
    """``prompt`` (TRL's: a list of chat messages or a plain string) with ``answer`` shown in its last user message
    (:data:`PRIVILEGED_NOTE`), the context SDFT's and prime-rl's ``opsd`` teacher gets.

    >>> privileged_prompt([{"role": "user", "content": "2+2?"}], 4)[0]["content"][:54]
    '2+2?\\n\\n(For the grader only: the reference answer is 4.'
    >>> privileged_prompt("2+2?", "4").endswith("lead to this answer.)")
    True
    """
    note = PRIVILEGED_NOTE.format(answer=answer)
    if isinstance(prompt, str):
        return prompt + note
    last = max(i for i, message in enumerate(prompt) if message.get("role") == "user")
    return [{**m, "content": m["content"] + note} if i == last else m for i, m in enumerate(prompt)]


@dataclass
class Pending:
    """A round's teacher scoring in flight: :meth:`result` waits for it."""

    future: Future | None = None
    """The request's future (:meth:`TeacherScorer.start` sets it)."""
    scoring_s: float = 0.0
    """Seconds the teacher's request took (set when it is answered)."""
    waited_s: float = 0.0
    """Seconds the trainer waited for the answer in :meth:`result` (the part of the scoring not overlapped)."""

    def result(self) -> list[list[float]]:
        """Per completion, the teacher's logprob of each of its tokens (natural log).

        Raises:
            GenerationServerError: the teacher's request failed.
        """
        began = time.monotonic()
        try:
            return self.future.result()
        finally:
            self.waited_s = time.monotonic() - began


class TeacherScorer:
    """Scores completions under the frozen teacher (module docstring).

    Args:
        client: a :class:`grpo_steps.servers.client.VLLMClient` of the teacher's server.
    """

    def __init__(self, client):
        self.client = client
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="teacher")

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Per completion, the teacher's logprob of each completion token given the prompt and the completion before
        it; ``len(out[i]) == len(completion_ids[i])``.

        Raises:
            GenerationServerError: the teacher's request failed.
        """
        sequences = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
        scored = self.client.sequence_logprobs(sequences)  # entry j scores sequence token j + 1
        return [row[len(p) - 1:] for p, row in zip(prompt_ids, scored, strict=True)]

    def start(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> Pending:
        """:meth:`score` in the background; returns at once."""
        def timed() -> list[list[float]]:
            began = time.monotonic()
            try:
                return self.score(prompt_ids, completion_ids)
            finally:
                pending.scoring_s = time.monotonic() - began

        pending = Pending()
        pending.future = self._pool.submit(timed)
        return pending

    def close(self) -> None:
        """Wait for a request in flight and stop the thread."""
        self._pool.shutdown(wait=True)


def padded(rows: list[list[float]], width: int, device) -> torch.Tensor:
    """``rows`` right-padded with NaN (no score) and cut to ``width``: (B, width) float32, TRL's completion layout.

    >>> padded([[-1.0], [-2.0, -3.0, -4.0]], 2, "cpu")
    tensor([[-1., nan],
            [-2., -3.]])
    """
    out = torch.full((len(rows), width), float("nan"), dtype=torch.float32)
    for i, row in enumerate(rows):
        values = torch.tensor(row[:width], dtype=torch.float32)
        out[i, : len(values)] = values
    return out.to(device)
