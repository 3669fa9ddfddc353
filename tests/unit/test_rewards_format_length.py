import pytest

from rewards.format import think_answer_format
from rewards.length import soft_overlong_punishment

FORMAT_CASES = [
    ("<think>2+2=4</think><answer>4</answer>", 1.0),  # the format, compact
    ("<think>\n2+2=4\n</think>\n<answer>\n4\n</answer>\n", 1.0),  # newlines around blocks and at the end
    ("<think></think><answer>4</answer>", 1.0),  # empty reasoning is allowed
    ("<think>x</think><answer> </answer>", 0.0),  # blank answer
    ("<answer>4</answer>", 0.0),  # no think block
    ("<think>x</think>", 0.0),  # no answer block
    ("<answer>4</answer><think>x</think>", 0.0),  # wrong order
    ("<think>x</think><answer>4</answer> extra", 0.0),  # text after the answer
    ("preamble <think>x</think><answer>4</answer>", 0.0),  # text before the think block
    ("<think>x</think> between <answer>4</answer>", 0.0),  # text between the blocks
    ("<think>a<think>b</think></think><answer>4</answer>", 0.0),  # nested think tags
    ("<think>x</think><answer><answer>4</answer></answer>", 0.0),  # nested answer tags
    ("<think>x</think><answer>4</answer><answer>5</answer>", 0.0),  # duplicated answer
    ("<think>x<answer>4</answer>", 0.0),  # missing </think>
    ("<think>x</think><answer>4", 0.0),  # missing </answer> (cut at the token limit)
    ("<Think>x</Think><answer>4</answer>", 0.0),  # tags are case-sensitive
    ("", 0.0),  # empty completion
    ("<think>数学 🤔</think><answer>四十二</answer>", 1.0),  # unicode content
    ("<think>x</think><answer>4</answer>\n<|im_end|>", 0.0),  # a leaked special token counts as text after
]


@pytest.mark.parametrize(("completion", "expected"), FORMAT_CASES)
def test_think_answer_format(completion, expected):
    assert think_answer_format([completion]) == [expected]


def test_think_answer_format_reads_conversational_completions():
    assert think_answer_format([[{"role": "assistant", "content": "<think>a</think><answer>b</answer>"}]]) == [1.0]


LENGTH_CASES = [
    (0, 100, 20, 0.0),  # empty completion: no penalty
    (1, 100, 20, 0.0),  # short
    (80, 100, 20, 0.0),  # exactly at the start of the soft zone
    (81, 100, 20, -0.05),  # first token into the soft zone
    (90, 100, 20, -0.5),  # middle of the soft zone (TRL docstring example)
    (99, 100, 20, -0.95),  # last token before the limit
    (100, 100, 20, -1.0),  # exactly at the limit: still the linear part, reaching -1
    (101, 100, 20, -1.0),  # over the limit
    (10**6, 100, 20, -1.0),  # huge length
    (100, 100, 0, 0.0),  # no soft zone: at the limit no penalty
    (101, 100, 0, -1.0),  # no soft zone: hard -1 above the limit
    (1, 100, 100, -0.01),  # soft zone covers everything
    (50, 100, 100, -0.5),  # half of an all-soft range
    (5, 8, 4, -0.25),  # small numbers
    (4, 8, 4, 0.0),  # small numbers, boundary
]


@pytest.mark.parametrize(("length", "max_len", "cache", "expected"), LENGTH_CASES)
def test_soft_overlong_punishment(length, max_len, cache, expected):
    got = soft_overlong_punishment(["x"], [[7] * length], max_completion_len=max_len, soft_punish_cache=cache)
    assert got == [pytest.approx(expected)]


def test_soft_overlong_punishment_matches_trl():
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in (0, 70, 80, 81, 95, 100, 101, 400)]
    trl_reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert soft_overlong_punishment(["x"] * len(ids), ids, max_completion_len=100, soft_punish_cache=20) == trl_reward(
        ids)


def test_soft_overlong_punishment_without_token_ids_does_not_apply():
    assert soft_overlong_punishment(["a", "b"], None, max_completion_len=10, soft_punish_cache=2) == [None, None]


@pytest.mark.parametrize(("max_len", "cache"), [(0, 0), (10, 11), (10, -1)])  # no budget, cache too big, negative
def test_soft_overlong_punishment_rejects_bad_limits(max_len, cache):
    with pytest.raises(ValueError, match="soft_punish_cache"):
        soft_overlong_punishment(["a"], [[1]], max_completion_len=max_len, soft_punish_cache=cache)
