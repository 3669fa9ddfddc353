"""Cost of a tool call in its worker process (:mod:`grpo_steps.tools.worker`) against an in-process thread with a
time limit (the tools' former way, a ``concurrent.futures`` thread here): the shipped ``calculator``, ``--calls`` calls
each; prints the worker's start and the mean seconds per call of each.

    .venv/bin/python bench/tool_call.py [--calls 200]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date

from grpo_steps.tools.functions import calculator, tool_functions


def per_call(fn, calls: int) -> float:
    """Mean wall seconds of ``calls`` calls of ``fn`` on one expression."""
    start = time.perf_counter()
    for _ in range(calls):
        fn("964 * 59")
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per variant")
    args = parser.parse_args()
    [worker] = tool_functions(["grpo_steps.tools:calculator"], timeout_s=10)
    start = time.perf_counter()
    worker("1 + 1")  # starts the worker
    started = time.perf_counter() - start
    with ThreadPoolExecutor(1) as pool:
        process = per_call(worker, args.calls)
        thread = per_call(lambda expression: pool.submit(calculator, expression).result(timeout=10), args.calls)
    worker.worker.close()
    print(f"{date.today()}, {os.cpu_count()} CPUs: worker start {started:.2f} s; per call: worker process "
          f"{process * 1e3:.2f} ms, thread {thread * 1e3:.2f} ms ({args.calls} calls each)")


if __name__ == "__main__":
    main()
