import pytest

from rewards import guard
from rewards.math import gold_answer, math_accuracy, verify_many

MATH_CASES = [
    ("Answer: 42", "42", 1.0),  # plain number, exact
    ("Answer: 0.5", "1/2", 1.0),  # decimal vs fraction, fast path
    ("so \\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),  # LaTeX fraction, unreduced, via math-verify
    ("Answer: \\dfrac12", "0.5", 1.0),  # \dfrac shorthand vs decimal
    ("Answer: \\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", 1.0),  # symbolic equality
    ("Answer: 1 + x", "x+1", 1.0),  # expressions compare symbolically
    ("The final step.\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # GSM8K on both sides
    ("Answer: 73", "Natalia sold 48/2 = 24 clips.\n#### 72", 0.0),  # GSM8K gold, wrong answer
    ("I think it is 42", "42", 0.0),  # no answer marker: nothing stated
    ("", "42", 0.0),  # empty completion
    ("Answer: 41\nwait, no\nAnswer: 42", "42", 1.0),  # several answers: the last counts
    ("Answer: 42\nwait, no\nAnswer: 41", "42", 0.0),  # several answers: the last counts (wrong)
    ("Answer: 99999999999999999999", "99999999999999999998", 0.0),  # huge integers compare exactly
    ("Answer: 123456789012345678901234567890", "123456789012345678901234567890", 1.0),  # huge, equal
    ("Answer: ٤٢", "42", 1.0),  # Arabic-Indic digits: math-verify reads them as 42
    ("Answer: π", "\\pi", 1.0),  # unicode pi vs LaTeX pi
    ("Answer: \\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),  # sets, order free
    ("Answer: banana", "42", 0.0),  # not math at all
    ("Answer: 1,000", "1000", 1.0),  # thousands separator
    ("<think>6*7</think><answer>\\boxed{42}</answer>", "42", 1.0),  # boxed inside tags
]


@pytest.mark.parametrize(("completion", "answer", "expected"), MATH_CASES)
def test_math_accuracy(completion, answer, expected):
    assert math_accuracy([completion], answer=[answer]) == [expected]


def test_math_accuracy_batches_routes_missing_answers_and_reads_conversations():
    completions = ["Answer: \\frac{1}{3}", [{"role": "assistant", "content": "\\boxed{3}"}], "Answer: 5"]
    assert math_accuracy(completions, answer=["2/6", 3, None]) == [1.0, 1.0, None]
    assert math_accuracy(["Answer: 1"]) == [None]  # no answer column at all: not applicable


GOLD_CASES = [
    ("72", "72"),  # plain
    ("a = 1\n#### 72", "72"),  # GSM8K solution
    ("#### 1 #### 2", "2"),  # several markers: the last
    ("#### 1,000\nthat is all", "1000"),  # the marker's line only, read by gsm8k_answer
    ("a = 1\n#### ", ""),  # a marker without a value: nothing a completion can match
    (3.5, "3.5"),  # numeric column value
    (None, None),  # missing
]


@pytest.mark.parametrize(("answer", "expected"), GOLD_CASES)
def test_gold_answer(answer, expected):
    assert gold_answer(answer) == expected


def test_a_hung_verification_scores_zero_is_counted_and_the_next_batch_still_scores():
    before = guard.counters().get("rewards/math_accuracy/timeouts", 0)
    # 10^(10^10) makes sympy compute a 10-billion-digit integer in C, which no signal interrupts quickly
    scores = math_accuracy(["Answer: 10^{10^{10}}", "Answer: \\frac{1}{2}"], answer=["\\frac{3}{1}", "0.5"],
                           timeout_s=1.0)
    assert scores == [0.0, 1.0]
    assert guard.counters()["rewards/math_accuracy/timeouts"] == before + 1
    assert math_accuracy(["Answer: 1 + x"], answer=["x+1"]) == [1.0]  # needs the (new) pool


def test_verify_many_serial_and_pooled_agree():
    pairs = [("\\frac{1}{2}", "0.5"), ("x+1", "1+x"), ("2", "3")]
    assert verify_many(pairs, workers=1) == verify_many(pairs, workers=2) == ["equal", "equal", "different"]
