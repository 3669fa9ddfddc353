"""Benchmark: completions scored per second by ``math_accuracy`` and ``code_execution``, one worker
(serial) against the default worker pool, on generated completions.

    .venv/bin/python bench/reward_throughput.py [--n 200] [--repeats 2]

Math completions all need math-verify (LaTeX, so none takes the in-process exact-number path); a
quarter are wrong. Code completions are small HumanEval-style functions with a ``check`` test, a
quarter wrong. Pools are started before timing (one untimed warm-up call each). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from datetime import date

from rewards.code import code_execution
from rewards.math import default_workers as math_default_workers
from rewards.math import math_accuracy
from rewards.sandbox import default_workers as code_default_workers
from rewards.sandbox import isolation


def math_batch(n: int) -> tuple[list[str], list[str]]:
    completions, answers = [], []
    for i in range(n):
        a, b = i % 17 + 1, i % 13 + 2
        stated = f"\\frac{{{2 * a}}}{{{2 * b}}}" if i % 4 else f"\\frac{{{a + 1}}}{{{b}}}"
        completions.append(f"Reasoning about step {i}...\nSo the result is \\boxed{{{stated} + \\sqrt{{{b}}}}}")
        answers.append(f"\\frac{{{a}}}{{{b}}} + \\sqrt{{{b}}}")
    return completions, answers


def code_batch(n: int) -> tuple[list[str], list[str], list[str]]:
    completions, tests = [], []
    for i in range(n):
        op = "+" if i % 4 else "-"
        completions.append(f"```python\ndef f(x):\n    total = 0\n    for k in range(x):\n        total {op}= k\n"
                           f"    return total\n```")
        tests.append(f"def check(candidate):\n    assert candidate({i % 50}) == {sum(range(i % 50))}\n"
                     f"    assert candidate(0) == 0\n")
    return completions, tests, ["f"] * n


def rate(fn, n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return n / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="completions per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats; the best is reported")
    args = parser.parse_args()
    n = args.n
    mc, ma = math_batch(n)
    cc, ct, ce = code_batch(n)
    rows = []
    for label, workers in (("serial (1 worker)", 1), (f"pool ({math_default_workers()} workers)", None)):
        math_accuracy(mc[:4], answer=ma[:4], workers=workers)  # warm-up: starts the pool
        scores = math_accuracy(mc, answer=ma, workers=workers)
        assert sum(scores) == n - len(range(0, n, 4)), "math benchmark batch scored unexpectedly"
        rows.append(("math_accuracy", label, rate(lambda w=workers: math_accuracy(mc, answer=ma, workers=w), n,
                                                  args.repeats)))
    for label, workers in (("serial (1 worker)", 1), (f"pool ({code_default_workers()} workers)", None)):
        scores = code_execution(cc, test=ct, entry_point=ce, workers=workers)
        assert sum(scores) == n - len(range(0, n, 4)) + sum(1 for i in range(0, n, 4) if i % 50 < 2), scores
        rows.append(("code_execution", label, rate(
            lambda w=workers: code_execution(cc, test=ct, entry_point=ce, workers=w), n, args.repeats)))
    print(f"{date.today()}, {os.cpu_count()} CPUs, {platform.python_version()}, sandbox isolation: {isolation()}, "
          f"n={n}, best of {args.repeats}\n")
    print("| reward | workers | completions / s |\n|---|---|---|")
    for reward, label, value in rows:
        print(f"| {reward} | {label} | {value:.1f} |")


if __name__ == "__main__":
    main()
