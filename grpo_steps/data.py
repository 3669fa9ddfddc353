"""Dataset preparation: source rows -> conversational prompts with their answers, deduplicated and
split into train/eval sets that share no prompt.

A row of a prepared split is ``{"prompt": [{"role": ..., "content": ...}, ...], "answer": str}``
(TRL's conversational prompt format); the ``answer`` column reaches the reward functions.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_steps.config import DataConfig


class DataError(ValueError):
    """A data source that cannot be used; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class PreparedData:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    stats: dict[str, int] = field(default_factory=dict)

    def digest(self) -> str:
        """sha256 (first 16 hex chars) of both splits' canonical JSON: identifies the exact data."""
        blob = json.dumps({"train": self.train, "eval": self.eval}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _reasoning_gym_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    import reasoning_gym

    size = 2 * (cfg.num_train + cfg.num_eval)  # head-room for duplicates and the token budget
    try:
        dataset = reasoning_gym.create_dataset(cfg.task, size=size, seed=cfg.seed, **cfg.task_options)
    except (KeyError, ValueError, TypeError) as err:
        raise DataError(f"reasoning-gym task {cfg.task!r} with options {cfg.task_options}: {err}") from None
    return [{"question": row["question"], "answer": row["answer"]} for row in dataset]


def _file_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    import datasets

    if cfg.source == "hf":
        try:
            return list(datasets.load_dataset(cfg.path, split=cfg.split))
        except Exception as err:  # the hub client raises many types; report with the fix
            raise DataError(
                f"could not load Hugging Face dataset {cfg.path!r} split {cfg.split!r}: {err}. "
                "Check the id and the network, or download it and use source 'jsonl'/'parquet'."
            ) from err
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise DataError(f"data.path {str(path)!r} does not exist or is not a file; point it at a .{cfg.source} file")
    builder = {"jsonl": "json", "parquet": "parquet"}[cfg.source]
    return list(datasets.load_dataset(builder, data_files=str(path), split="train"))


def load_rows(cfg: DataConfig) -> list[dict[str, Any]]:
    """Rows of the configured source, each with at least ``cfg.prompt_column`` and ``cfg.answer_column``.

    Raises:
        DataError: missing file, unloadable source, missing columns.
    """
    rows = _reasoning_gym_rows(cfg) if cfg.source == "reasoning_gym" else _file_rows(cfg)
    if not rows:
        raise DataError(f"data source {cfg.source} {cfg.path or cfg.task!r} has no rows")
    columns = set(rows[0])
    for column, key in ((cfg.prompt_column, "prompt_column"), (cfg.answer_column, "answer_column")):
        if column not in columns:
            raise DataError(
                f"data source has no column {column!r} (data.{key}); its columns are {sorted(columns)}. "
                f"Set data.{key} to the right one."
            )
    return rows


def to_prompt(question: str, system_prompt: str | None) -> list[dict[str, str]]:
    """Conversational prompt: optional system message, then the question as the user message."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": question}]


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """Token ids of a prompt as the policy sees it: chat template + generation prompt for a
    conversational prompt, plain tokens for a standard one."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding in transformers 5


def prepare(cfg: DataConfig, tokenizer) -> PreparedData:
    """Prepared train and eval splits of the configured source.

    Deduplicates on the question text, shuffles with ``cfg.seed``, drops prompts longer than
    ``cfg.max_prompt_tokens`` (with the chat template applied by ``tokenizer``), then takes
    ``num_eval`` eval rows and up to ``num_train`` train rows. No prompt is in both splits.

    Raises:
        DataError: as :func:`load_rows`, or too few usable rows for the eval split plus one train row.
    """
    rows = load_rows(cfg)
    seen: set[str] = set()
    unique = []
    for row in rows:
        question = str(row[cfg.prompt_column]).strip()
        if question and question not in seen:
            seen.add(question)
            unique.append({"question": question, "answer": str(row[cfg.answer_column]).strip()})
    random.Random(cfg.seed).shuffle(unique)

    kept, too_long = [], 0
    for row in unique:
        prompt = to_prompt(row["question"], cfg.system_prompt)
        if len(encode_prompt(tokenizer, prompt)) > cfg.max_prompt_tokens:
            too_long += 1
            continue
        kept.append({"prompt": prompt, "answer": row["answer"]})
        if len(kept) == cfg.num_eval + cfg.num_train:
            break
    if len(kept) <= cfg.num_eval:
        raise DataError(
            f"only {len(kept)} usable prompts ({len(rows)} rows, {len(rows) - len(unique)} duplicates, "
            f"{too_long} over data.max_prompt_tokens={cfg.max_prompt_tokens}); need more than "
            f"data.num_eval={cfg.num_eval}. Lower num_eval, raise max_prompt_tokens or add data."
        )
    stats = {
        "rows": len(rows),
        "duplicates": len(rows) - len(unique),
        "too_long": too_long,
        "train": len(kept) - cfg.num_eval,
        "eval": cfg.num_eval,
    }
    return PreparedData(train=kept[cfg.num_eval :], eval=kept[: cfg.num_eval], stats=stats)
