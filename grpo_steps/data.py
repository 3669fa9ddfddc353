"""Dataset preparation: source rows -> conversational prompts with their reward columns,
deduplicated and split into train/eval sets that share no prompt.

A row of a prepared split is ``{"prompt": [{"role": ..., "content": ...}, ...], "answer": str | None,
**kept}`` (TRL's conversational prompt format); every key but ``prompt`` reaches the reward
functions as a keyword argument. ``kept`` holds the columns of :func:`grpo_steps.config.kept_columns`
(``test``/``entry_point`` for HumanEval, ``solution`` for GSM8K-format answers, ``data.columns``). A
``data.mixture`` adds a ``task`` column and gives every row every task's columns, None where a task
has none (a reward returns None on rows it does not apply to).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_steps.config import DataConfig, SourceConfig, kept_columns, split_counts
from grpo_steps.lineage import SeenRows
from grpo_steps.sources import DataError, answer_of, check_columns, load_source, row_positions

__all__ = ["DataError", "PreparedData", "RecordedCompletions", "encode_prompt", "load_rows", "prepare", "to_prompt"]


@dataclass(frozen=True)
class PreparedData:
    train: list[dict[str, Any]]
    eval: list[dict[str, Any]]
    stats: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    """``dropped/<reason>`` (``<task>/dropped/<reason>`` in a mixture) -> where the first dropped rows are,
    e.g. ``lines 2, 7`` (see :data:`DROP_REASONS`); only reasons that dropped rows."""

    def digest(self) -> str:
        """sha256 (first 16 hex chars) of both splits' canonical JSON: identifies the exact data."""
        blob = json.dumps({"train": self.train, "eval": self.eval}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def load_rows(src: SourceConfig, size: int, seed: int) -> list[dict[str, Any]]:
    """Rows of one source with every configured column present (see :func:`grpo_steps.sources.load_source`).

    Raises:
        DataError: missing file or package, unloadable source, no rows, missing columns.
    """
    rows = load_source(src, size, seed)
    check_columns(src, set(rows[0]))
    return rows


def to_prompt(question: str, system_prompt: str | None, few_shot=()) -> list[dict]:
    """Conversational prompt: optional system message, the ``few_shot`` examples (objects with ``question``,
    ``completion`` and optionally ``tool_call``, one call or a list) as user/assistant turns -- with tool calls, each
    call as an assistant turn followed by the tool's answer (TRL's message format) comes before its reply -- then
    the question as the user message.

    >>> from grpo_steps.config import FewShotExample
    >>> demo = FewShotExample(question="Calculate 2 * 3.", completion="Answer: 6",
    ...                       tool_call={"name": "calculator", "arguments": {"expression": "2 * 3"}, "result": "6"})
    >>> [m["role"] for m in to_prompt("Calculate 4 * 5.", None, [demo])]
    ['user', 'assistant', 'tool', 'assistant', 'user']
    >>> game = FewShotExample(question="Guess.", completion="I won.", tool_call=[
    ...     {"name": "move", "arguments": {"action": "[10]"}, "result": "higher"},
    ...     {"name": "move", "arguments": {"action": "[15]"}, "result": "solved"}])
    >>> [(m["role"], m.get("content")) for m in to_prompt("Guess.", None, [game])][1:5]
    [('assistant', ''), ('tool', 'higher'), ('assistant', ''), ('tool', 'solved')]
    """
    messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for example in few_shot:
        messages.append({"role": "user", "content": example.question})
        for call in example.tool_calls() if hasattr(example, "tool_calls") else []:  # one assistant turn each
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": call.name, "arguments": dict(call.arguments)}}]},
                         {"role": "tool", "name": call.name, "content": call.result}]
        messages.append({"role": "assistant", "content": example.completion})
    return messages + [{"role": "user", "content": question}]


def encode_prompt(tokenizer, prompt: str | list[dict], chat_template_kwargs: dict | None = None,
                  tools: list | None = None) -> list[int]:
    """Token ids of a prompt as the policy sees it: chat template + generation prompt for a
    conversational prompt (``chat_template_kwargs``: the template's keyword arguments,
    ``generation.chat_template_kwargs``; ``tools``: the functions whose schemas it renders), plain tokens for a
    standard one."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                        **(chat_template_kwargs or {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # BatchEncoding in transformers 5


DROP_REASONS = ("empty_prompt", "missing_answer", "too_long")
"""Why a source row is unusable: no question text; no reference answer where ``data.answer_column`` is set; a
prompt over ``data.max_prompt_tokens``. Counted as ``dropped/<reason>`` in the stats (MLflow ``data/dropped/...``)."""

SHOWN_POSITIONS = 5
"""Line (or row) numbers of dropped rows shown per reason in the log, the error and the MLflow tag."""


def _text(value: Any) -> str:
    """A cell as stripped text; '' for None, NaN (a parquet/csv gap) and blanks."""
    if value is None or (isinstance(value, float) and value != value):  # NaN != NaN
        return ""
    return str(value).strip()


def where(unit: str, positions: list[int]) -> str:
    """The first :data:`SHOWN_POSITIONS` of ``positions`` (sorted), as a user looks them up.

    >>> where("line", [9, 2, 4, 7, 3, 12, 30])
    'lines 2, 3, 4, 7, 9 and 2 more'
    >>> where("row", [5])
    'row 5'
    """
    shown = sorted(positions)[:SHOWN_POSITIONS]
    more = f" and {len(positions) - len(shown)} more" if len(positions) > len(shown) else ""
    return f"{unit}{'s' if len(positions) > 1 else ''} {', '.join(map(str, shown))}{more}"


def _origin(src: SourceConfig) -> str:
    """What a source reads, for messages: its file or dataset id, reasoning-gym task, or packaged data set."""
    return src.path or (f"reasoning-gym task {src.task}" if src.source == "reasoning_gym" else src.source)


def _dropped_report(src: SourceConfig, cfg: DataConfig, unit: str, dropped: dict[str, list[int]]) -> dict[str, str]:
    """``reason -> where`` of the reasons that dropped rows, each also printed as one ``[data]`` log line."""
    why = {"empty_prompt": f"an empty prompt (data.prompt_column {src.prompt_column!r})",
           "missing_answer": f"no answer (data.answer_column {src.answer_column!r} null or empty)",
           "too_long": f"a prompt over data.max_prompt_tokens={cfg.max_prompt_tokens}"}
    report = {}
    for reason, positions in dropped.items():
        if positions:
            report[reason] = where(unit, positions)
            print(f"[data] {src.name}: dropped {len(positions)} rows with {why[reason]}: {report[reason]} of "
                  f"{_origin(src)}", flush=True)
    return report


def _prepare_source(src: SourceConfig, cfg: DataConfig, num_train: int, num_eval: int, tokenizer,
                    seen: set[str], chat_template_kwargs: dict | None, tools: list | None,
                    chain: SeenRows | None) -> tuple[list[dict], list[dict], dict[str, int], dict[str, str]]:
    """(train, eval, stats, dropped: reason -> where) of one source; ``seen`` holds the questions taken by earlier
    sources, ``chain`` (``data.skip_seen``) the rows the start version's chain has seen."""
    rows = load_rows(src, size=2 * (num_train + num_eval), seed=cfg.seed)  # head-room for duplicates, budget
    unit, positions = row_positions(src, len(rows))
    kept_map = kept_columns(src)
    dropped: dict[str, list[int]] = {reason: [] for reason in DROP_REASONS}
    needs_answer = src.answer_column is not None and src.source != "humaneval"  # HumanEval's tests are its answers
    unique, duplicates = [], 0
    seen |= {example.question.strip() for example in src.few_shot}  # an example is never a test item
    for position, row in zip(positions, rows, strict=True):
        question = _text(row.get(src.prompt_column))
        if not question:
            dropped["empty_prompt"].append(position)
        elif needs_answer and not _text(row.get(src.answer_column)):
            dropped["missing_answer"].append(position)  # before dedup: a later copy with an answer is kept
        elif question in seen:
            duplicates += 1
        else:
            seen.add(question)
            unique.append((position, {"question": question, "answer": answer_of(src, row),
                                      **{name: row.get(column) for name, column in kept_map.items()}}))
    random.Random(cfg.seed).shuffle(unique)

    kept = []
    for position, row in unique:  # every row is measured, not only the ones kept: the unusable share is exact
        prompt = to_prompt(row.pop("question"), src.system_prompt, src.few_shot)
        if len(encode_prompt(tokenizer, prompt, chat_template_kwargs, tools)) > cfg.max_prompt_tokens:
            dropped["too_long"].append(position)
        else:
            kept.append({"prompt": prompt, **row})
    left_out = 0
    if chain is not None:  # data.skip_seen: no row the chain trained on, and none of its held-out rows in training
        kept, left_out = chain.unseen(kept, num_eval)
    kept = kept[: num_eval + num_train]
    report = _dropped_report(src, cfg, unit, dropped)
    unusable, distinct = sum(map(len, dropped.values())), len(rows) - duplicates
    too_long = len(dropped["too_long"])
    if unusable > cfg.max_unusable_share * distinct:
        raise DataError(
            f"data source {src.name!r} ({_origin(src)}): {unusable} of its {distinct} distinct rows are "
            f"unusable ({unusable / distinct:.0%} > data.max_unusable_share={cfg.max_unusable_share}): "
            + "; ".join(f"{reason} at {text}" for reason, text in report.items())
            + ". Fix those rows or the column names (data.prompt_column, data.answer_column), raise "
            "data.max_prompt_tokens, or raise data.max_unusable_share to train on the rest."
        )
    if len(kept) < num_eval or (len(kept) == num_eval and chain is None):  # skip_seen: no new row ends the run
        raise DataError(
            f"only {len(kept)} usable prompts from {src.source} {src.path or src.task!r} ({len(rows)} rows, "
            f"{duplicates} duplicates, {too_long} over data.max_prompt_tokens={cfg.max_prompt_tokens}); need "
            f"more than data.num_eval={num_eval}. Lower num_eval, raise max_prompt_tokens or add data."
        )
    if len(kept) < num_train + num_eval and not cfg.allow_smaller_split and chain is None:
        raise DataError(
            f"data source {src.name!r}: {len(kept)} usable prompts ({len(rows)} rows, {duplicates} duplicates, "
            f"{too_long} over data.max_prompt_tokens={cfg.max_prompt_tokens}), fewer than num_train + num_eval = "
            f"{num_train} + {num_eval}. Lower data.num_train, raise data.max_prompt_tokens, add data, or set "
            f"data.allow_smaller_split: true to train on the {len(kept) - num_eval} there are."
        )
    stats = {"rows": len(rows), "duplicates": duplicates, "train": len(kept) - num_eval, "eval": num_eval,
             **({"seen_by_chain": left_out} if chain is not None else {}),
             **{f"dropped/{reason}": len(positions) for reason, positions in dropped.items()}}
    return kept[num_eval:], kept[:num_eval], stats, report


def prepare(cfg: DataConfig, tokenizer, chat_template_kwargs: dict | None = None,
            tools: list | None = None, chain: SeenRows | None = None) -> PreparedData:
    """Prepared train and eval splits of the configured source or mixture.

    Per source: drops rows with an empty prompt or (with ``answer_column`` set) no answer, deduplicates on the
    question text, shuffles with ``cfg.seed``, drops prompts longer than ``cfg.max_prompt_tokens`` (with the chat
    template applied by ``tokenizer``, with ``chat_template_kwargs``: ``generation.chat_template_kwargs``;
    ``tools``: the schemas rendered with it), then takes its eval rows and up to its train rows (a mixture splits
    ``num_train``/``num_eval`` by weight, see :func:`grpo_steps.config.split_counts`). No prompt is in both splits,
    nor in two sources. Each reason that dropped rows prints one ``[data]`` line with the first line numbers.
    ``chain`` (``data.skip_seen``): the rows a start version's chain has seen, left out as
    :meth:`grpo_steps.lineage.SeenRows.unseen` says; then a short train split (even an empty one) is no error: the
    caller decides (``prepare_data`` ends the run early with too few new rows).

    Raises:
        DataError: as :func:`load_rows`; more than ``cfg.max_unusable_share`` of a source's distinct rows dropped
            (:data:`DROP_REASONS`; the message names the reasons and the first lines); fewer usable rows in a source
            than its train + eval counts (unless ``cfg.allow_smaller_split``: then fewer than its eval split plus
            one train row).
    """
    sources = cfg.sources()
    weights = [s.weight for s in sources]
    seen: set[str] = set()
    train, evals, stats, dropped = [], [], {}, {}
    for src, n_train, n_eval in zip(sources, split_counts(cfg.num_train, weights),
                                    split_counts(cfg.num_eval, weights), strict=True):
        src_train, src_eval, src_stats, src_dropped = _prepare_source(src, cfg, n_train, n_eval, tokenizer, seen,
                                                                      chat_template_kwargs, tools, chain)
        prefix = f"{src.name}/" if cfg.mixture else ""
        dropped.update({f"{prefix}dropped/{reason}": text for reason, text in src_dropped.items()})
        if cfg.mixture:
            for row in src_train + src_eval:
                row["task"] = src.name
            stats.update({f"{src.name}/{key}": value for key, value in src_stats.items()})
        for key, value in src_stats.items():
            stats[key] = stats.get(key, 0) + value
        train += src_train
        evals += src_eval
    if cfg.mixture:
        train, evals = _same_columns(train), _same_columns(evals)
        random.Random(cfg.seed).shuffle(train)  # interleave the tasks within each batch
    return PreparedData(train=train, eval=evals, stats=stats, dropped=dropped)


def check_environments(rows: list[dict[str, Any]], environment: str | dict[str, str] | None) -> None:
    """Refuse rows that name an environment no factory of ``environment`` (the config's ``environment:``) has: with
    several named factories each row's ``environment`` column picks one, and an unknown name crashed training at
    that row's first rollout. One factory (a string) or none: nothing to check.

    >>> check_environments([{"environment": "maze"}], {"maze": "envs:Maze"})
    >>> check_environments([{"environment": "maze"}, {"environment": "chess"}], {"maze": "envs:Maze"})
    Traceback (most recent call last):
    ...
    grpo_steps.sources.DataError: 1 row(s) name an environment that no factory of environment: has ('chess' ...

    Raises:
        DataError: naming the first such rows (their split position and name) and the configured names.
    """
    if not isinstance(environment, dict):
        return
    unknown = [(i, row.get("environment")) for i, row in enumerate(rows) if row.get("environment") not in environment]
    if unknown:
        shown = ", ".join(f"{name!r} at row {i}" for i, name in unknown[:5])
        raise DataError(f"{len(unknown)} row(s) name an environment that no factory of environment: has ({shown}): "
                        f"name one of {sorted(environment)} in each row's environment column, or add a factory")


def _same_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with the union of all rows' keys, None where a row has none (one table schema)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return [{key: row.get(key) for key in keys} for row in rows]


def table(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Column -> values of prepared rows for logging: ``question`` (the user message) then every other
    column; lists and dicts as JSON text, None kept.

    >>> table([{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2", "meta": {"a": 1}}])
    {'question': ['1+1?'], 'answer': ['2'], 'meta': ['{"a": 1}']}
    """
    keys = [key for key in dict.fromkeys(k for row in rows for k in row) if key != "prompt"]
    out: dict[str, list] = {"question": [row["prompt"][-1]["content"] for row in rows]}
    for key in keys:
        out[key] = [json.dumps(v) if isinstance(v, list | dict) else v for v in (row.get(key) for row in rows)]
    return out


def mlflow_datasets(cfg: DataConfig, data: PreparedData) -> list[tuple[Any, str]]:
    """``(mlflow.data dataset, context)`` for the train and eval splits, with a source MLflow can record:
    the file for ``jsonl``/``parquet``/``csv``, the hub id for ``hf``, else a code source whose tag
    ``source`` names the generator or package (``reasoning_gym:chain_sum``, ``humaneval``, ``mixture:a+b``).
    """
    import mlflow.data
    import pandas as pd
    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    if cfg.mixture:
        name, source = "mixture", CodeDatasetSource(tags={"source": "mixture:" + "+".join(m.name for m in cfg.mixture)})
    elif cfg.source == "hf":
        name, source = cfg.path, HuggingFaceDatasetSource(path=cfg.path, config_name=cfg.subset, split=cfg.split)
    elif cfg.source in ("jsonl", "parquet", "csv"):
        name, source = cfg.sources()[0].name, str(cfg.path)
    else:
        name = cfg.sources()[0].name
        source = CodeDatasetSource(tags={"source": f"{cfg.source}:{name}" if cfg.source == "reasoning_gym" else name})
    return [(mlflow.data.from_pandas(pd.DataFrame(table(rows)), source=source, name=f"{name}-{split}"), context)
            for split, rows, context in (("train", data.train, "training"), ("eval", data.eval, "evaluation"))]


class RecordedCompletions:
    """The fixed completions of backend ``recorded`` (``generation.recorded_file``): a JSONL file, one row per prompt,
    ``{"question": str, "completions": [str, ...]}``, ``question`` being the prompt's last message. Read by the
    training process's :class:`grpo_steps.training.rollouts.RecordedRollout` and checked against the train split in
    ``prepare_data``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        DataError: a row without ``question``/``completions``.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"generation.recorded_file {path} does not exist (JSONL of "
                                    '{"question": ..., "completions": [...]} rows)')
        self.completions: dict[str, list[str]] = {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("question"), str) or not isinstance(row.get("completions"), list):
                raise DataError(f"{path}:{number}: a row needs 'question' (str) and 'completions' (list of str)")
            self.completions[row["question"]] = row["completions"]

    def completions_for(self, prompt: str | list[dict], group: int) -> list[str]:
        """The first ``group`` completions of ``prompt``'s question (its last message).

        Raises:
            DataError: the file has no row for the question, or the row lists fewer than ``group`` completions.
        """
        question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        if question not in self.completions:
            raise DataError(f"generation.recorded_file has no completions for the question {question!r}")
        texts = self.completions[question]
        if len(texts) < group:
            raise DataError(f"generation.recorded_file lists {len(texts)} completions for {question!r}; "
                             f"a group needs {group} (train.num_generations)")
        return texts[:group]
