"""Math correctness with ``math-verify`` (Hugging Face): symbolic and numeric equivalence of LaTeX answers.

The stated answer comes from the completion's last ``Answer: X`` line, ``#### X`` or ``\\boxed{X}``
(:func:`rewards.extract.extract_answer`); the gold answer from the ``answer`` column (a number, a
GSM8K solution ending ``#### N`` read by :func:`rewards.extract.gsm8k_answer`, or LaTeX). Two plain
numbers compare exactly as fractions in this process; anything else goes to
``math_verify.parse``/``verify``, which time themselves out with ``signal.alarm`` and so only work on a
main thread: they run in a small pool of worker processes (``spawn``), created on first use and reused,
with our own per-completion limit on top. A verification that times out or crashes scores 0.0 and
counts into ``rewards/<name>/timeouts`` / ``errors``; the pool is then replaced.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import threading

from rewards import guard
from rewards.extract import GSM8K_MARKER, completion_text, extract_answer, gsm8k_answer, parse_number

_POOLS: dict[int, multiprocessing.pool.Pool] = {}
_POOL_LOCK = threading.Lock()  # one batch at a time per process: a timeout replaces the shared pool


def _latex(text: str) -> str:
    """Wrap a bare answer in ``$...$`` so math-verify's LaTeX extraction reads it."""
    text = text.strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def gold_answer(answer: object) -> str | None:
    """The reference answer string: the ``#### N`` value of a GSM8K solution (:func:`gsm8k_answer`;
    ``""`` when the marker has nothing after it, which no completion matches), else the whole value,
    stripped; None for None.

    >>> gold_answer("48 / 2 = 24 clips\\n#### 72")
    '72'
    >>> gold_answer(0.5), gold_answer(None)
    ('0.5', None)
    """
    if answer is None:
        return None
    text = str(answer)
    if GSM8K_MARKER not in text:
        return text.strip()
    return gsm8k_answer(text) or ""


def _warm(_: int = 0) -> int:
    import math_verify  # noqa: F401 - imported once per worker, before the first timed verification

    return os.getpid()


def _verify(gold: str, stated: str) -> tuple[str, bool]:
    """Worker: ("ok", equal) or ("error", False). Runs on the worker's main thread (signal.alarm works)."""
    from math_verify import parse, verify

    try:
        return "ok", bool(verify(parse(_latex(gold)), parse(_latex(stated))))
    except Exception as err:  # a math-verify or sympy bug on odd input: scored 0, counted by the caller
        return f"error: {err!r}", False


def _pool(workers: int) -> multiprocessing.pool.Pool:
    if workers not in _POOLS:
        pool = multiprocessing.get_context("spawn").Pool(workers)
        pool.map_async(_warm, range(workers)).get(timeout=300)  # imports done before the first timed verification
        _POOLS[workers] = pool
    return _POOLS[workers]


def _drop_pool(workers: int) -> None:
    pool = _POOLS.pop(workers, None)
    if pool is not None:
        pool.terminate()  # kills a worker stuck in C code that no alarm interrupts


@atexit.register
def _close_pools() -> None:
    for workers in list(_POOLS):
        _drop_pool(workers)


def verify_many(pairs: list[tuple[str, str]], timeout_s: float = 5.0, workers: int | None = None) -> list[str]:
    """Verify ``(gold, stated)`` pairs in the pool; one of ``"equal"``, ``"different"``, ``"timeout"``,
    ``"error"`` per pair. Each pair gets at least ``timeout_s`` seconds after the previous one returned;
    on a timeout the pool is killed and the pairs not yet done are resubmitted to a fresh one."""
    workers = workers or default_workers()
    out: list[str | None] = [None] * len(pairs)
    pending = list(range(len(pairs)))
    with _POOL_LOCK:
        while pending:
            pool = _pool(workers)
            handles = {i: pool.apply_async(_verify, pairs[i]) for i in pending}
            retry: list[int] = []
            for pos, i in enumerate(pending):
                try:
                    status, equal = handles[i].get(timeout=timeout_s)
                except multiprocessing.TimeoutError:
                    out[i] = "timeout"
                    rest = pending[pos + 1:]
                    for j in rest:
                        if handles[j].ready():
                            status, equal = handles[j].get()
                            out[j] = "error" if status != "ok" else ("equal" if equal else "different")
                    retry = [j for j in rest if out[j] is None]
                    _drop_pool(workers)
                    break
                out[i] = "error" if status != "ok" else ("equal" if equal else "different")
            pending = retry
    return [o or "error" for o in out]


def default_workers() -> int:
    """Verification processes by default: the CPU count, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


def math_accuracy(
    completions: list, answer: list | None = None, timeout_s: float = 5.0, workers: int | None = None, **_columns
) -> list[float | None]:
    """1.0 when the stated final answer is mathematically equal to the reference answer, else 0.0.

    Args:
        completions: N completions (strings or conversational message lists).
        answer: N reference answers (None: the row has none and scores None).
        timeout_s: seconds a single verification may take before it scores 0.0 (counted as a timeout).
        workers: verification processes (None: the CPU count, at most 4).

    A completion that states no final answer (no ``Answer:``, ``\\boxed{}`` or ``####``) scores 0.0.

    >>> math_accuracy(["Answer: 0.5", "so \\\\boxed{\\\\frac{2}{4}}", "#### 72", "it is 72"],
    ...               answer=["1/2", "\\\\frac{1}{2}", "#### 72", "72"])
    [1.0, 1.0, 1.0, 0.0]
    >>> math_accuracy(["Answer: \\\\sqrt{2}/2", "Answer: 2"], answer=["\\\\frac{\\\\sqrt{2}}{2}", None])
    [1.0, None]
    """
    golds = answer if answer is not None else [None] * len(completions)
    scores: list[float | None] = [None] * len(completions)
    slow: list[int] = []
    pairs: list[tuple[str, str]] = []
    for i, (completion, reference) in enumerate(zip(completions, golds, strict=True)):
        gold = gold_answer(reference)
        if gold is None:
            continue
        stated = extract_answer(completion_text(completion))
        if not stated or not gold:
            scores[i] = 0.0
            continue
        got, want = parse_number(stated), parse_number(gold)
        if got is not None and want is not None:
            scores[i] = float(got == want)  # exact, also for numbers too big for floats
            continue
        slow.append(i)
        pairs.append((gold, stated))
    outcomes = verify_many(pairs, timeout_s, workers) if pairs else []
    for i, outcome in zip(slow, outcomes, strict=True):
        scores[i] = 1.0 if outcome == "equal" else 0.0
    guard.record("timeouts", outcomes.count("timeout"), default="math_accuracy")
    guard.record("errors", outcomes.count("error"), default="math_accuracy")
    return scores
