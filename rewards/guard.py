"""A guard around every reward used in training and evaluation: a hung or crashing reward never stalls training.

:func:`guarded` wraps a reward function so that each call runs in its own daemon thread with a wall-clock
limit. On timeout or exception the call returns ``None`` for every completion (TRL turns None into NaN and
leaves that reward out of the row's sum) and never raises into the trainer; a reward that returns
the wrong shape or type is a bug and raises :class:`RewardReturnError`, naming it.

Counters, per reward name, cumulative in this process (:func:`counters`):
``rewards/<name>/timeouts`` and ``rewards/<name>/errors``. A reward may add its own per-completion
failures (the code sandbox's timeouts, a math verification that hung) with :func:`record`; they count
into the same two counters of the reward being called. When TRL passes ``log_metric`` (GRPOTrainer 1.16
does, to every reward function), the guard logs this call's counts under the same keys; TRL averages
them over the logging window and across processes, so the logged value is "failures per reward call".

Stopping with the deadline: at a call's deadline the guard sets the call's stop event (:func:`stop_event`, read by
the reward in the call's thread). A reward that asks for it and runs its work elsewhere (the code sandbox:
processes) passes it on, stops launching, kills what runs, and returns the scores it has (None for the rest); the
guard waits :data:`STOP_GRACE_S` seconds for that answer, and keeps those scores. A reward that ignores the event is
abandoned at the deadline at once: every completion of the call scores None.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

KINDS = ("timeouts", "errors")

_COUNTS: Counter[str] = Counter()
_SCORED: Counter[str] = Counter()  # reward name -> completions scored
_NONES: Counter[str] = Counter()  # reward name -> completions that scored None
_WARNED_NON_FINITE: set[str] = set()  # reward names already warned about NaN/inf scores
_LOCK = threading.Lock()
# Name and per-call tally of the reward running in this thread (set by the guard; read by record()).
_CURRENT: contextvars.ContextVar[tuple[str, Counter[str]] | None] = contextvars.ContextVar("reward", default=None)
# The stop event of the guarded call running in this thread (set by the guard at the call's deadline).
_STOP: contextvars.ContextVar[_Stop | None] = contextvars.ContextVar("reward_stop", default=None)
STOP_GRACE_S = 5.0
"""Seconds the guard waits, after a call's deadline and its stop event, for the reward's partial scores."""


def stop_event() -> threading.Event | None:
    """The stop event of the guarded reward call running in this thread (None: not under a guard): set when the call
    passes its ``timeout_s``. A reward that runs work in other threads or processes hands it on, launches nothing
    once it is set, ends what runs, and returns within :data:`STOP_GRACE_S` seconds the scores it has (None for the
    completions it gave up); the guard keeps them. A reward that never asks is abandoned at the deadline at once."""
    stop = _STOP.get()
    if stop is not None:
        stop.taken = True  # the guard waits for this reward's partial answer
    return stop


class _Stop(threading.Event):
    taken = False


def counter_key(name: str, kind: str) -> str:
    """Metric name of a counter: ``rewards/<name>/<kind>``, kind one of ``timeouts``/``errors``.

    >>> counter_key("code_execution", "timeouts")
    'rewards/code_execution/timeouts'
    """
    if kind not in KINDS:
        raise ValueError(f"counter kind must be one of {KINDS}, got {kind!r}")
    return f"rewards/{name}/{kind}"


def record(kind: str, n: int = 1, default: str | None = None, name: str | None = None) -> None:
    """Count ``n`` failures of ``kind`` (``timeouts``/``errors``) for the reward running now.

    Called by rewards for per-completion failures. The name counted is ``name`` when given, else the
    configured name of the guarded reward running in this thread, else ``default`` (a reward called
    without a guard); with none of them nothing is counted. ``n == 0`` is a no-op.
    """
    current = _CURRENT.get()
    target = name or (current[0] if current else default)
    if n <= 0 or target is None:
        return
    key = counter_key(target, kind)
    with _LOCK:
        _COUNTS[key] += n
        if current is not None and current[0] == target:
            current[1][key] += n


def counters() -> dict[str, int]:
    """Snapshot of all counters of this process, ``rewards/<name>/<kind> -> count``."""
    with _LOCK:
        return dict(_COUNTS)


def scored() -> dict[str, tuple[int, int]]:
    """Per reward name, ``(completions scored, of which None)`` by guarded calls in this process so far
    (None: the reward does not apply, failed or timed out)."""
    with _LOCK:
        return {name: (_SCORED[name], _NONES[name]) for name in _SCORED}


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _nones(completions: Any) -> list[None]:
    return [None] * len(completions)


class RewardReturnError(TypeError):
    """A reward returned something other than one float (or None) per completion: a bug in the reward,
    raised into the trainer (retrying would return the same)."""


def check_scores(name: str, result: Any, n: int) -> list[float | None]:
    """``result`` as a list of ``n`` scores (floats; ints are taken as floats; None where the reward does
    not apply).

    Raises:
        RewardReturnError: not a list/tuple of length ``n`` of numbers or None; names the reward and shows
            what it returned.

    >>> check_scores("r", [1, None, 0.5], 3)
    [1.0, None, 0.5]
    >>> check_scores("r", 1.0, 1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rewards.guard.RewardReturnError: reward 'r' returned 1.0 (float); a reward returns a list of 1 float or None, ...
    """
    contract = f"a reward returns a list of {n} float or None, one per completion"
    shown = repr(result)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    if not isinstance(result, list | tuple):
        raise RewardReturnError(f"reward {name!r} returned {shown} ({type(result).__name__}); {contract}")
    if len(result) != n:
        raise RewardReturnError(f"reward {name!r} returned {len(result)} scores for {n} completions: {shown}; "
                                f"{contract}")
    bad = [v for v in result if v is not None and (isinstance(v, bool) or not isinstance(v, int | float))]
    if bad:
        raise RewardReturnError(f"reward {name!r} returned {type(bad[0]).__name__} scores such as {bad[0]!r} in "
                                f"{shown}; {contract}")
    return [None if v is None else float(v) for v in result]


def _warn_non_finite(name: str, values: list[float], n: int) -> None:
    """Warn once per reward name and process that it returned NaN/inf (later calls only count)."""
    with _LOCK:
        if name in _WARNED_NON_FINITE:
            return
        _WARNED_NON_FINITE.add(name)
    log.warning("reward %s returned %d non-finite scores (%s) of %d; scoring them None and counting them as "
                "rewards/%s/errors (warned once per process)", name, len(values), ", ".join(map(str, values[:3])),
                n, name)


@dataclasses.dataclass
class Call:
    """How one call under the deadline ended (:func:`call_with_deadline`)."""

    box: dict[str, Any]
    """``result`` (what the reward returned, an awaitable awaited) or ``error`` (what it raised); neither when it
    timed out without a partial answer."""
    timed_out: bool
    """It passed ``timeout_s``."""
    partial: bool
    """It passed ``timeout_s`` and answered within :data:`STOP_GRACE_S` after its stop event (kept in ``result``)."""


def call_with_deadline(fn: Callable[..., Any], name: str, timeout_s: float, completions: list, kwargs: dict,
                       call_counts: Counter[str] | None = None) -> Call:
    """``fn(completions, **kwargs)`` in a daemon thread of its own, awaited when it returns an awaitable (an ``async
    def`` reward, on an event loop of that thread), waited for ``timeout_s`` seconds (then its stop event is set and
    a reward that took it has :data:`STOP_GRACE_S` more); what it raised is returned, never raised. The one call
    path of :func:`guarded` (training, evaluation) and of the reward probe before training (``prepare_data``).
    ``call_counts``: this call's tally of :func:`record` (``rewards/<name>/<kind> -> n``)."""
    box: dict[str, Any] = {}
    done, stop = threading.Event(), _Stop()
    counts: Counter[str] = Counter() if call_counts is None else call_counts

    def target() -> None:
        _CURRENT.set((name, counts))
        _STOP.set(stop)
        try:
            result = fn(completions, **kwargs)
            # an ``async def`` reward (an LLM judge, say; TRL awaits them): run it to the end on this thread's own
            # event loop, under the same wall-clock limit
            box["result"] = asyncio.run(_awaited(result)) if inspect.isawaitable(result) else result
        except BaseException as err:  # noqa: B036 - returned to the caller, which reports it
            box["error"] = err
        finally:
            done.set()

    threading.Thread(target=target, name=f"reward-{name}", daemon=True).start()
    if done.wait(timeout_s):
        return Call(box, timed_out=False, partial=False)
    stop.set()  # a reward that hands the event on stops its work and answers with what it has scored
    partial = bool(stop.taken and done.wait(STOP_GRACE_S) and "error" not in box)
    return Call(box if partial else {}, timed_out=True, partial=partial)


def guarded(fn: Callable[..., list], name: str, timeout_s: float = 60.0) -> Callable[..., list[float | None]]:
    """``fn`` wrapped with a per-call wall-clock limit; the wrapper's ``__name__`` is ``name``.

    Args:
        fn: a reward in TRL's contract ``fn(completions, **columns) -> list[float | None]``, or an ``async def``
            one (awaited in the call's thread, on an event loop of its own; the wrapper stays synchronous).
        name: the configured reward name (TRL logs ``rewards/<name>/mean``; counters use it too).
        timeout_s: seconds a call may take; after that the call returns Nones and the worker thread is
            abandoned (a daemon thread: it cannot be killed, so a reward that hangs forever keeps one
            thread; rewards that run untrusted work use processes and their own limits).

    A call that raises or times out scores None for every completion and counts one error or timeout. A NaN or
    inf score becomes None and counts one error per such completion (warned once per reward name), so a reward
    that returns only NaN leaves every completion unscored and the all-None stop applies.
    A call that returns anything but one float or None per completion is a bug in the reward: it raises
    :class:`RewardReturnError` (see :func:`check_scores`).

    >>> def boom(completions, **_):
    ...     raise RuntimeError("bug")
    >>> guarded(boom, "boom_doc", timeout_s=5)(["a", "b"])
    [None, None]
    >>> counters()["rewards/boom_doc/errors"]
    1
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")

    @functools.wraps(fn)
    def wrapper(completions: list, **kwargs: Any) -> list[float | None]:
        log_metric = kwargs.get("log_metric")
        call_counts: Counter[str] = Counter()
        call = call_with_deadline(fn, name, timeout_s, completions, kwargs, call_counts)
        timed_out, partial, box = call.timed_out, call.partial, call.box
        if timed_out:
            log.warning("reward %s timed out after %.1f s; %s", name, timeout_s,
                        "keeping the scores it had, None for the rest" if partial
                        else f"scoring None for {len(completions)} completions")
            record("timeouts", 1, name=name)
            call_counts[counter_key(name, "timeouts")] += 1
        if timed_out and not partial:
            result = _nones(completions)
        elif "error" in box:
            err = box["error"]
            log.warning("reward %s failed: %r; scoring None for %d completions", name, err, len(completions),
                        exc_info=err if isinstance(err, Exception) else None)
            record("errors", 1, name=name)
            call_counts[counter_key(name, "errors")] += 1
            result = _nones(completions)
        else:
            result = check_scores(name, box["result"], len(completions))
            non_finite = [v for v in result if v is not None and not math.isfinite(v)]
            if non_finite:  # NaN would be averaged away by TRL's nanmean, inf would swamp the advantages
                _warn_non_finite(name, non_finite, len(result))
                record("errors", len(non_finite), name=name)
                call_counts[counter_key(name, "errors")] += len(non_finite)
                result = [v if v is None or math.isfinite(v) else None for v in result]
        with _LOCK:
            _SCORED[name] += len(result)
            _NONES[name] += sum(v is None for v in result)
        if callable(log_metric):
            for kind in KINDS:
                key = counter_key(name, kind)
                log_metric(key, float(call_counts[key]))
        return result

    wrapper.__name__ = wrapper.__qualname__ = name
    return wrapper
