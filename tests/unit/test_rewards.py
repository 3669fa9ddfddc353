from fractions import Fraction

import pytest

from rewards import REGISTRY, UnknownRewardError, resolve_reward
from rewards.answers import answer_accuracy, answer_format
from rewards.extract import completion_text, extract_answer, gsm8k_answer, parse_number

EXTRACT_CASES = [
    ("2 + 2 = 4\nAnswer: 4", "4"),  # the requested format
    ("answer: 12", "12"),  # lower case
    ("The answer is: -3", "-3"),  # "is" before the colon
    ("Answer: 1\nwait\nAnswer: 2", "2"),  # several answers: the last one counts
    ("so \\boxed{42}.", "42"),  # LaTeX boxed
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
    ("\\boxed{3", None),  # unclosed box
    ("#### 1,000", "1000"),  # GSM8K marker: the value as gsm8k_answer reads it (separators dropped)
    ("Answer: 5\n#### 6", "5"),  # an Answer: line wins over the GSM8K marker
    ("#### 6\n\\boxed{7}", "6"),  # the GSM8K marker wins over \boxed
    ("#### **8**", "8"),  # markdown bold after the marker
    ("I think it is 4", None),  # a bare number is not an answer
    ("", None),  # empty completion
    ("Answer: **7**", "7"),  # markdown bold around the answer
    ("Answer:   ٣  ", "٣"),  # unicode digit is returned as written
]


@pytest.mark.parametrize(("text", "expected"), EXTRACT_CASES)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


GSM8K_ANSWERS = [
    # (text, final answer or None)
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),  # the GSM8K shape
    ("#### 5", "5"),  # marker only
    ("It costs $1,250 in total.\n#### 1,250", "1250"),  # thousands separator
    ("... so 2,000,000 people.\n#### 2,000,000", "2000000"),  # several separators
    ("Total: $18.\n#### $18", "18"),  # dollar sign
    ("He ends with 7.\n#### 7.", "7"),  # trailing period
    ("#### -3", "-3"),  # negative
    ("#### 2.5", "2.5"),  # decimal kept
    ("#### 10\n", "10"),  # trailing newline (TOML multi-line strings end with one)
    ("First #### 3 then a fix\n#### 4", "4"),  # the last marker wins
    ("#### 1 #### 2", "2"),  # several markers on one line: the last
    ("####   42   ", "42"),  # surrounding spaces
    ("####\n\n  9\n", "9"),  # the value on a later line: the first non-blank one
    ("#### 1/2", "1/2"),  # fraction kept as written (math-verify parses it)
    ("#### \\frac{1}{2}", "\\frac{1}{2}"),  # LaTeX kept as written
    ("#### 1,23", "1,23"),  # a comma that is not a thousands separator is kept
    ("#### 12\nextra commentary", "12"),  # only the marker's line
    ("The answer is 72.", None),  # no marker
    ("#### ", None),  # nothing after the marker
    ("####\n\n", None),  # only blank lines after it
    ("#### 5\n####", None),  # the last marker has no value: an earlier one does not count
    ("#### $.", None),  # only the dropped characters
    ("", None),  # empty text
]


@pytest.mark.parametrize(("text", "expected"), GSM8K_ANSWERS)
def test_gsm8k_answer(text, expected):
    assert gsm8k_answer(text) == expected


NUMBER_CASES = [
    ("4", Fraction(4)),
    ("-12", Fraction(-12)),
    ("+3", Fraction(3)),
    ("1,234", Fraction(1234)),
    ("0.5", Fraction(1, 2)),
    (".5", Fraction(1, 2)),
    ("3/4", Fraction(3, 4)),
    ("\\frac{3}{4}", Fraction(3, 4)),
    ("$5.", Fraction(5)),  # currency sign and trailing period dropped
    ("1e3", Fraction(1000)),
    ("123456789012345678901234567890", Fraction(123456789012345678901234567890)),  # huge, exact
    ("1/0", None),  # division by zero is not a number
    ("four", None),
    ("", None),
    (None, None),
    ("1,23", None),  # malformed thousands separator
    ("4 apples", None),
]


@pytest.mark.parametrize(("text", "expected"), NUMBER_CASES)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


ACCURACY_CASES = [
    ("Answer: 7", "7", 1.0),  # exact
    ("Answer: 7.0", "7", 1.0),  # same number, other spelling
    ("Answer: 0.5", "1/2", 1.0),  # decimal vs fraction
    ("Answer: 1,000", "1000", 1.0),  # thousands separator
    ("Answer: 8", "7", 0.0),  # wrong
    ("7", "7", 0.0),  # right number, no stated answer
    ("", "7", 0.0),  # empty completion
    ("Answer: seven", "7", 0.0),  # words are not numbers
    ("Answer: Paris", "paris", 1.0),  # non-numeric answers compare as text
    ("Answer: 7\nAnswer: 9", "7", 0.0),  # the last stated answer counts
    ("Answer: 99999999999999999999", "99999999999999999998", 0.0),  # huge numbers compare exactly
    ("<think>7</think>Answer: -7", "-7", 1.0),  # tags around reasoning
]


@pytest.mark.parametrize(("completion", "answer", "expected"), ACCURACY_CASES)
def test_answer_accuracy(completion, answer, expected):
    assert answer_accuracy([completion], [answer]) == [expected]


def test_answer_accuracy_reads_conversational_completions_and_skips_rows_without_answer():
    completions = [[{"role": "assistant", "content": "Answer: 3"}], [{"role": "assistant", "content": "Answer: 3"}]]
    assert answer_accuracy(completions, ["3", None]) == [1.0, None]


FORMAT_CASES = [
    ("3 + 4 = 7\nAnswer: 7", 1.0),  # reasoning then the final line
    ("Answer: 7", 1.0),  # just the line
    ("Answer: -7.5\n\n", 1.0),  # trailing blank lines are fine
    ("Answer: 7 and then more", 0.0),  # final line has extra words
    ("Answer: 7\nmore text", 0.0),  # not the last line
    ("7", 0.0),  # no marker
    ("", 0.0),  # empty
    ("Answer:", 0.0),  # marker without value
    ("Answer: x", 0.0),  # value is not a number
]


@pytest.mark.parametrize(("completion", "expected"), FORMAT_CASES)
def test_answer_format(completion, expected):
    assert answer_format([completion]) == [expected]


def test_completion_text_handles_empty_conversation():
    assert completion_text([]) == ""


def test_registry_and_dotted_paths_resolve():
    assert resolve_reward("answer_accuracy") is REGISTRY["answer_accuracy"]
    assert resolve_reward("rewards.answers:answer_format") is answer_format
    assert resolve_reward("rewards.answers.answer_format") is answer_format


@pytest.mark.parametrize(
    "name", ["no_such_reward", "no_such_module:fn", "rewards.answers:missing", "rewards.extract:re"]
)
def test_unknown_reward_names_are_rejected_with_the_known_list(name):
    with pytest.raises(UnknownRewardError, match="known rewards: answer_accuracy"):
        resolve_reward(name)
