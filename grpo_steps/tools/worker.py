"""Tool calls in a killable worker process: one persistent process per tool (:func:`worker_command` of its
``module:function``), started at the first call, killed with its process group when a call passes its time limit
and started again at the next call. A tool that hangs, spins, holds the GIL (a catastrophic regex) or exits
cannot stop the trainer or leave a thread or process behind; whatever it raises (``SystemExit`` and
``KeyboardInterrupt`` included) comes back as the call's error; its answer is cut to a size before it leaves the
worker (:func:`cut_response`), so a huge answer is never sent, tokenized or logged whole.

Protocol: ``{"ready": true}`` on the worker's stdout once the tool is imported, then one JSON line per call on
its stdin (``{"args": [...], "kwargs": {...}}``) and one per answer on its stdout (``{"value": v}`` or
``{"error": "Type: message"}``); the tool's own prints go to stderr. A worker's start (an interpreter and the
tool's module) is not counted in a call's time limit, but a tool whose module imports slowly pays it again after
every timeout. Arguments and answers are JSON (the model writes the arguments as JSON; an answer that is not JSON
is sent as its ``str``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import importlib
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

TRUNCATED = "...(truncated)"
"""Appended to a cut answer (verl's marker for a tool response over ``max_tool_response_length``)."""


def cut_response(value: Any, max_chars: int) -> Any:
    """``value`` as is when its text (a string, or the JSON of anything else) has at most ``max_chars`` characters;
    else the first ``max_chars`` characters of that text followed by :data:`TRUNCATED`.

    >>> cut_response("abcdef", 3), cut_response("abc", 3), cut_response({"a": 1}, 100)
    ('abc...(truncated)', 'abc', {'a': 1})
    """
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return value if len(text) <= max_chars else text[:max_chars] + TRUNCATED


START_TIMEOUT_S = 120.0
"""Seconds a worker may take to start and import its tool (not counted in ``generation.tool_timeout_s``)."""
_WORKERS: weakref.WeakSet = weakref.WeakSet()
"""Every :class:`ToolProcess` alive, closed at interpreter exit (no orphan worker)."""


class ToolProcess:
    """The calls of one tool (``path``, ``module:function``) in a worker process of its own.

    Calls are serialized (one at a time per tool). :meth:`call` raises ``TimeoutError`` past ``timeout_s`` (the
    worker is killed), ``RuntimeError`` for what the tool raised or a worker that ended; :meth:`close` kills the
    worker (also at interpreter exit)."""

    def __init__(self, path: str, timeout_s: float, max_chars: int) -> None:
        self.path, self.timeout_s, self.max_chars = path, timeout_s, max_chars
        self.name = path.replace(":", ".").rpartition(".")[2]
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self._buffer = b""
        _WORKERS.add(self)

    def _start(self) -> subprocess.Popen:
        # a session of its own: a timeout kills the worker and whatever the tool started, in one group
        return subprocess.Popen(worker_command(self.path, self.max_chars), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, start_new_session=True)

    def close(self) -> None:
        """Kill the worker and its process group (nothing when none runs)."""
        proc, self.proc, self._buffer = self.proc, None, b""
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # ended by itself (a tool that exited)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            # a call's request may still sit in stdin's buffer: flushing it to the dead worker raises EPIPE, and
            # close() closes the pipe all the same
            with contextlib.suppress(BrokenPipeError):
                pipe.close()

    def _read_line(self, proc: subprocess.Popen, deadline: float) -> bytes | None:
        """The worker's next line, or None past ``deadline`` (monotonic seconds); b"" when the worker ended."""
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _started(self) -> subprocess.Popen:
        """The running worker, or a new one that has imported its tool (its start is not the call's time).

        Raises:
            RuntimeError: the worker ended or did not report ready within :data:`START_TIMEOUT_S`.
        """
        if self.proc is not None:
            return self.proc
        self.proc = proc = self._start()
        ready = self._read_line(proc, time.monotonic() + START_TIMEOUT_S)
        if ready != b'{"ready": true}':
            self.close()
            raise RuntimeError(f"tool {self.name!r}: its worker process did not start within {START_TIMEOUT_S:g} s "
                               f"(exit code {proc.returncode}; the tool's import error is on the trainer's stderr)")
        return proc

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """Run the tool on ``args``/``kwargs`` in the worker; see the class docstring for what it raises."""
        with self.lock:
            proc = self._started()
            deadline = time.monotonic() + self.timeout_s
            try:
                proc.stdin.write((json.dumps({"args": list(args), "kwargs": kwargs}, default=str) + "\n").encode())
                proc.stdin.flush()
            except BrokenPipeError:
                line = b""  # the worker died before the call (an import error is on its stderr)
            else:
                line = self._read_line(proc, deadline)
            if line is None:
                self.close()
                raise TimeoutError(f"tool {self.name!r} took longer than {self.timeout_s:g} s "
                                   "(generation.tool_timeout_s); its process was killed")
            if not line:
                code = proc.poll() if proc.poll() is not None else proc.wait(timeout=5)
                self.close()
                raise RuntimeError(f"tool {self.name!r} ended its process (exit code {code})")
            reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"tool {self.name!r} raised {reply['error']}")
        return reply["value"]


@atexit.register
def _close_all() -> None:
    for worker in list(_WORKERS):
        worker.close()


def process_tool(fn: Callable, path: str, timeout_s: float, max_chars: int) -> Callable:
    """A stand-in for tool ``fn`` (``path`` names it) that runs each call in a :class:`ToolProcess`: same name,
    signature and docstring, so it is described to the model as ``fn`` is."""
    worker = ToolProcess(path, timeout_s, max_chars)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def call_async(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(worker.call, *args, **kwargs)  # the thread ends with the call

        call_async.worker = worker  # type: ignore[attr-defined]
        return call_async

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return worker.call(*args, **kwargs)

    call.worker = worker  # type: ignore[attr-defined]  # for close() and tests
    return call


CODE_ROOT = str(Path(__file__).resolve().parents[2])
"""The directory holding ``grpo_steps`` (the checkout, or the code package a Metaflow task unpacked)."""


def worker_command(path: str, max_chars: int) -> list[str]:
    """The worker's command line. ``python -P``: the working directory is not put first on ``sys.path`` (``-m``
    would put it there, so a ``json.py`` a tool wrote there would shadow the standard library in every later
    worker); :data:`CODE_ROOT`, the config's module directories (:func:`rewards.locate.module_dirs`: where a tool's
    own module lives) and the working directory come last instead, after the standard library and the installed
    packages."""
    from rewards.locate import module_dirs

    boot = (f"import os, sys; sys.path += [{CODE_ROOT!r}, *{module_dirs()!r}, os.getcwd()]; "
            f"from grpo_steps.tools.worker import _serve; _serve({path!r}, {int(max_chars)})")
    return [sys.executable, "-P", "-c", boot]


def _serve(path: str, max_chars: int) -> None:
    """The worker's loop (see the module docstring); ends at the end of its input."""
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # the tool's prints go to stderr, never into the protocol
    module, _, name = path.replace(":", ".").rpartition(".")  # checked by the config (grpo_steps.tools.functions)
    fn = getattr(importlib.import_module(module), name)
    replies.write('{"ready": true}\n')  # the parent's clock for a call starts after this
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            value = fn(*request["args"], **request["kwargs"])
            if inspect.iscoroutine(value):  # an async tool: its own event loop, in this process
                value = asyncio.run(value)
        except BaseException as err:  # noqa: BLE001 - SystemExit, KeyboardInterrupt too: the call's error
            reply = {"error": f"{type(err).__name__}: {err}"[:2000]}
        else:
            try:
                json.dumps(value)
            except (TypeError, ValueError):  # an answer that is not JSON: its text
                value = str(value)
            reply = {"value": cut_response(value, max_chars)}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]))
