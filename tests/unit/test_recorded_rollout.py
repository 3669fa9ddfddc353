"""Backend ``recorded``: the rollout function hands each prompt group its fixed completions as token ids."""

import json
from types import SimpleNamespace

import pytest

from grpo_steps.config import GenerationConfig
from grpo_steps.data import DataError, encode_prompt
from grpo_steps.training.rollouts import RecordedRollout, prompt_groups

GEN = GenerationConfig(backend="recorded", recorded_file="unused", max_completion_tokens=6)


def trainer(num_generations: int = 2, training: bool = True) -> SimpleNamespace:
    """What the rollout function reads of TRL's GRPOTrainer."""
    return SimpleNamespace(num_generations=num_generations, num_generations_eval=1,
                           model=SimpleNamespace(training=training))


def prompt(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture
def recorded(tmp_path, tiny_tokenizer):
    path = tmp_path / "recorded.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "completions": ["Answer: 2", "2", "no"]}) + "\n\n"
                    + json.dumps({"question": "2+2?", "completions": ["Answer: 4 " * 10, "4"]}) + "\n")
    return RecordedRollout(path, tiny_tokenizer, GEN)


def test_each_group_gets_the_first_completions_of_its_question(recorded, tiny_tokenizer):
    out = recorded([prompt("1+1?")] * 2 + [prompt("2+2?")] * 2, trainer())
    assert out["logprobs"] is None  # nothing was sampled
    assert out["prompt_ids"] == [encode_prompt(tiny_tokenizer, prompt("1+1?"))] * 2 + \
        [encode_prompt(tiny_tokenizer, prompt("2+2?"))] * 2
    texts = tiny_tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
    assert texts[:2] == ["Answer: 2", "2"] and texts[3] == "4"
    assert out["completion_ids"][0][-1] == tiny_tokenizer.eos_token_id  # a finished completion
    assert len(out["completion_ids"][2]) == GEN.max_completion_tokens  # cut to the limit, no EOS
    assert out["completion_ids"][2][-1] != tiny_tokenizer.eos_token_id


def test_unknown_question_and_short_group_are_named(recorded):
    with pytest.raises(DataError, match="no completions for the question '3\\+3\\?'"):
        recorded([prompt("3+3?")] * 2, trainer())
    with pytest.raises(ValueError, match="lists 2 completions for '2\\+2\\?'; a group needs 3"):
        recorded([prompt("2+2?")] * 3, trainer(num_generations=3))


def test_missing_or_malformed_file_is_rejected(tmp_path, tiny_tokenizer):
    with pytest.raises(FileNotFoundError, match="generation.recorded_file .*missing.jsonl does not exist"):
        RecordedRollout(tmp_path / "missing.jsonl", tiny_tokenizer, GEN)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1?", "completions": ["2"]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: a row needs 'question'"):
        RecordedRollout(bad, tiny_tokenizer, GEN)


def test_prompt_groups_are_the_distinct_prompts_and_the_group_size():
    a, b = prompt("1+1?"), prompt("2+2?")
    assert prompt_groups([a, a, b, b], trainer()) == ([a, b], 2)
    assert prompt_groups([a, a, a, a], trainer()) == ([a, a], 2)  # the same prompt drawn twice: two groups
    assert prompt_groups([a, b, a], trainer(training=False)) == ([a, b, a], 1)  # evaluation: num_generations_eval


PROMPTS_NOT_IN_GROUPS = [
    # (prompt questions as TRL passes them, runs the message reports)
    (["1", "1", "2"], "[2, 1]"),  # not a multiple of the group size (a group split across processes)
    (["1", "2", "2", "3"], "[1, 2, 1]"),  # a multiple, but the groups are shifted by one
    (["1", "2", "1", "2"], "[1, 1, 1, 1]"),  # interleaved instead of in a row
    (["1", "1", "1", "2"], "[3, 1]"),  # a group of three and a group of one
]


@pytest.mark.parametrize(("questions", "runs"), PROMPTS_NOT_IN_GROUPS)
def test_prompts_not_in_whole_groups_are_an_error(questions, runs):
    with pytest.raises(ValueError) as err:
        prompt_groups([prompt(q) for q in questions], trainer(num_generations=2))
    message = str(err.value)
    assert f"got {len(questions)} prompts from TRL in runs of equal prompts {runs}" in message  # what TRL passed
    assert "each prompt 2 times in a row (num_generations = 2)" in message  # what was expected


def test_recorded_completions_of_a_split_group_are_an_error_not_identical_completions(recorded):
    with pytest.raises(ValueError, match="runs of equal prompts \\[1, 2\\]"):
        recorded([prompt("1+1?")] + [prompt("2+2?")] * 2, trainer())
