"""Learned reward: a Hugging Face sequence-classification model scores prompt + completion.

The model (``AutoModelForSequenceClassification``) and its tokenizer are loaded once per process and
device and cached. The score is the logit of one label (``label_index``, default 0: the single label
of a reward model trained with ``num_labels=1``, as TRL's ``RewardTrainer`` produces).
"""

from __future__ import annotations

import functools
from typing import Any

from rewards.extract import completion_text


@functools.cache
def load_reward_model(model: str, device: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a hub id or local directory, in eval mode on ``device``; cached per process."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    net = AutoModelForSequenceClassification.from_pretrained(model).to(device).eval()
    if net.config.pad_token_id is None:
        net.config.pad_token_id = tokenizer.pad_token_id  # needed to find each sequence's last token
    return net, tokenizer


def _messages(prompt: Any, completion: Any) -> list[dict]:
    if isinstance(prompt, list):
        head = list(prompt)
    else:
        head = [{"role": "user", "content": str(prompt or "")}]
    return [*head, {"role": "assistant", "content": completion_text(completion)}]


def reward_text(prompt: Any, completion: Any, tokenizer: Any = None) -> str:
    """Text the reward model reads: prompt and completion through the tokenizer's chat template when it
    has one, else the prompt's text followed by the completion's.

    >>> reward_text("2+2?", " 4")
    '2+2? 4'
    >>> reward_text([{"role": "user", "content": "2+2?"}], [{"role": "assistant", "content": "4"}])
    '2+2?4'
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(_messages(prompt, completion), tokenize=False)
    head = prompt if isinstance(prompt, str) else "".join(str(m.get("content") or "") for m in prompt or [])
    return head + completion_text(completion)


def reward_model(
    completions: list,
    prompts: list | None = None,
    *,
    model: str,
    batch_size: int = 8,
    label_index: int = 0,
    max_length: int = 2048,
    device: str | None = None,
    **_columns,
) -> list[float]:
    """Logit of label ``label_index`` of the reward model ``model`` for each prompt + completion.

    Args:
        completions: N completions (strings or conversational message lists).
        prompts: N prompts (strings or message lists; GRPOTrainer passes them). None: empty prompts.
        model: hub id or local directory of an ``AutoModelForSequenceClassification``.
        batch_size: sequences per forward pass.
        label_index: which output logit is the score.
        max_length: longer inputs are truncated (right side), tokens.
        device: torch device; None: ``cuda`` when available, else ``cpu``.

    Raises:
        IndexError: ``label_index`` is not below the model's ``num_labels``.

    >>> reward_model([], model="unused")  # nothing to score loads nothing
    []
    """
    if not completions:
        return []
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net, tokenizer = load_reward_model(model, device)
    if not 0 <= label_index < net.config.num_labels:
        raise IndexError(f"label_index {label_index} but the model has {net.config.num_labels} labels")
    prompts = prompts if prompts is not None else [""] * len(completions)
    texts = [reward_text(p, c, tokenizer) for p, c in zip(prompts, completions, strict=True)]
    scores: list[float] = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True, truncation=True,
                          max_length=max_length, add_special_tokens=False).to(device)
        with torch.inference_mode():
            logits = net(**batch).logits  # (B, num_labels)
        scores.extend(logits[:, label_index].float().tolist())
    return scores
