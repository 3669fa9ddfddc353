import json

import pandas as pd
import pytest

from grpo_steps.config import DataConfig
from grpo_steps.data import DataError, prepare


def _cfg(**kw) -> DataConfig:
    base = {"num_train": 20, "num_eval": 10, "max_prompt_tokens": 200,
            "task_options": {"min_terms": 2, "max_terms": 2, "max_digits": 2}}
    return DataConfig(**{**base, **kw})


def _questions(rows):
    return [r["prompt"][-1]["content"] for r in rows]


def test_reasoning_gym_splits_share_no_prompt_and_keep_answers(tiny_tokenizer):
    data = prepare(_cfg(), tiny_tokenizer)
    assert len(data.train) == 20 and len(data.eval) == 10
    assert not set(_questions(data.train)) & set(_questions(data.eval))
    row = data.eval[0]
    assert row["prompt"][0]["role"] == "system" and row["prompt"][1]["role"] == "user"
    assert row["answer"] != ""


def test_same_seed_same_data_other_seed_other_data(tiny_tokenizer):
    assert prepare(_cfg(), tiny_tokenizer).digest() == prepare(_cfg(), tiny_tokenizer).digest()
    assert prepare(_cfg(), tiny_tokenizer).digest() != prepare(_cfg(seed=7), tiny_tokenizer).digest()


def test_jsonl_source_is_deduplicated_and_columns_mapped(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    rows = [{"q": f"What is {i} + 1?", "a": str(i + 1)} for i in range(30)]
    rows += rows[:10]  # duplicates
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare(_cfg(source="jsonl", path=str(path), prompt_column="q", answer_column="a", system_prompt=None),
                   tiny_tokenizer)
    assert data.stats["duplicates"] == 10
    assert len(data.train) == 20 and len(data.eval) == 10
    assert not set(_questions(data.train)) & set(_questions(data.eval))
    assert all(len(r["prompt"]) == 1 for r in data.train)  # no system message when system_prompt is null
    by_question = {r["q"]: r["a"] for r in rows}
    assert all(by_question[r["prompt"][-1]["content"]] == r["answer"] for r in data.train + data.eval)


def test_parquet_source(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.parquet"
    pd.DataFrame({"question": [f"Calculate {i} + 2." for i in range(40)],
                  "answer": [str(i + 2) for i in range(40)]}).to_parquet(path)
    data = prepare(_cfg(source="parquet", path=str(path)), tiny_tokenizer)
    assert len(data.train) == 20 and len(data.eval) == 10


def test_prompts_over_the_token_budget_are_dropped(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    rows = [{"question": f"Calculate {i} + 2.", "answer": str(i + 2)} for i in range(30)]
    rows += [{"question": "Calculate " + " + ".join(["1"] * 200) + ".", "answer": "200"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare(_cfg(source="jsonl", path=str(path), max_prompt_tokens=60), tiny_tokenizer)
    assert data.stats["too_long"] == 1
    assert all("1 + 1 + 1" not in q for q in _questions(data.train + data.eval))


def test_missing_file_is_a_clear_error(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError, match="does not exist"):
        prepare(_cfg(source="jsonl", path=str(tmp_path / "nope.jsonl")), tiny_tokenizer)


def test_missing_answer_column_names_the_columns(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(DataError, match=r"no column 'answer'.*\['question', 'solution'\]"):
        prepare(_cfg(source="jsonl", path=str(path)), tiny_tokenizer)


def test_too_few_rows_for_the_eval_split(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": "1"}) + "\n" for i in range(5)))
    with pytest.raises(DataError, match="need more than data.num_eval=10"):
        prepare(_cfg(source="jsonl", path=str(path)), tiny_tokenizer)


def test_unknown_reasoning_gym_task(tiny_tokenizer):
    with pytest.raises(DataError, match="no_such_task"):
        prepare(_cfg(task="no_such_task", task_options={}), tiny_tokenizer)
