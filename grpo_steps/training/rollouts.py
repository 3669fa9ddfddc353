"""The rollout function of backend ``recorded`` (TRL's ``rollout_func``): completions read from a file, not sampled.

TRL hands each training process whole prompt groups (every prompt ``num_generations`` times in a row,
:func:`prompt_groups`); the rollout function returns one completion per entry as token ids. (Rollouts from the
generation server go through TRL's own generation path: :mod:`grpo_steps.training.generation.server`.)
"""

from __future__ import annotations

import itertools
from pathlib import Path

from grpo_steps.data import RecordedCompletions, encode_prompt


def prompt_groups(prompts: list, trainer) -> tuple[list, int]:
    """The P distinct prompts of a ``rollout_func`` call and the group size G.

    TRL hands each process whole groups: every prompt G times in a row, B = P x G entries (G is the
    trainer's ``num_generations``, ``num_generations_eval`` in evaluation); the rollout returns G
    completions per distinct prompt, in that order.

    Raises:
        ValueError: ``prompts`` are not whole groups of G equal entries in a row, e.g. a group split
            across processes because a process's generation batch (``per_device_train_batch_size`` x
            ``steps_per_generation``) is not a multiple of G. The message gives what TRL passed.
    """
    training = trainer.model.training
    group = trainer.num_generations if training else trainer.num_generations_eval
    if len(prompts) % group == 0 and all(p == prompts[i - i % group] for i, p in enumerate(prompts)):
        return prompts[::group], group
    runs = [len(list(run)) for _, run in itertools.groupby(prompts)]  # lengths of runs of equal prompts
    shown = f"{runs[:16]}{' ...' if len(runs) > 16 else ''}"
    setting = "num_generations" if training else "num_generations_eval"
    raise ValueError(
        f"rollout_func got {len(prompts)} prompts from TRL in runs of equal prompts {shown}; expected whole "
        f"groups, each prompt {group} times in a row ({setting} = {group}). A group split across processes? "
        "Each process's generation batch (train.per_device_train_batch_size x steps_per_generation, default "
        "train.gradient_accumulation_steps) must be a multiple of train.num_generations."
    )


class RecordedRollout:
    """TRL ``rollout_func`` that hands out fixed completions instead of sampling (backend ``recorded``).

    Every layout (nodes, processes, ZeRO stage) then trains on the same completions of the same
    prompts, so per-step losses and gradient norms are comparable. A prompt's group of G entries gets
    the first G completions listed for its question (:class:`grpo_steps.data.RecordedCompletions`), tokenized without
    special tokens, cut to ``max_completion_tokens`` and ended with EOS when it fits. Returns ``prompt_ids``,
    ``completion_ids`` (B lists of token ids) and ``logprobs`` None (no sampling distribution).

    Raises:
        FileNotFoundError, ValueError: as :class:`grpo_steps.data.RecordedCompletions`.
        DataError: a prompt whose question has no row in the file.
    """

    def __init__(self, path: str | Path, tokenizer, gen_cfg) -> None:
        self.tokenizer, self.gen, self.file = tokenizer, gen_cfg, RecordedCompletions(path)

    def _completion_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.gen.max_completion_tokens]
        if len(ids) < self.gen.max_completion_tokens:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def __call__(self, prompts: list, trainer) -> dict[str, list | None]:
        unique, group = prompt_groups(prompts, trainer)
        out: dict[str, list | None] = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        for prompt in unique:
            texts = self.file.completions_for(prompt, group)
            ids = encode_prompt(self.tokenizer, prompt, self.gen.chat_template_kwargs)
            for text in texts:
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(self._completion_ids(text))
        return out
