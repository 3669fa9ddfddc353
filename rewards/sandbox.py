"""Run untrusted Python (model-written code + unit tests) in a contained child process.

Layers, outermost first (:func:`isolation` says which are active on this machine):

1. A separate process, ``sys.executable -I -B`` (isolated mode: no ``PYTHON*`` variables, no user site,
   no script directory on ``sys.path``), in a new session (its own process group, killed whole with
   SIGKILL at the wall-clock limit), in a fresh temporary working directory removed afterwards, with an
   environment holding only ``PATH`` (no secrets) and stdin closed after the program is read.
2. Resource limits set in ``preexec_fn``: ``RLIMIT_CPU`` (seconds), ``RLIMIT_AS`` (memory, MiB),
   ``RLIMIT_FSIZE`` (largest file written, MiB), ``RLIMIT_NPROC`` (processes of the user), no core files.
3. When this process is root and ``unshare`` works: a new network namespace (``unshare --net``: no
   interface but a down loopback, so every connection fails) and the user ``nobody`` (``setpriv``), so the
   child cannot read other processes' ``/proc/<pid>/environ``, write to root-owned paths, or signal them.
4. Always, inside the child before the untrusted code runs: a Python audit hook (PEP 578) that ends the
   process with exit code :data:`VIOLATION_EXIT` on process creation (fork, exec, ``os.system``,
   ``subprocess``), sockets, ``ctypes``, signals to other processes, and writes/renames/removals outside
   the working directory. The hook is defence in depth, not a boundary: in-process code can reach the
   harness through introspection; layers 1-3 are what contain it.

A run passes only when the harness prints a random per-run token after the tests return, so
``sys.exit(0)`` or ``os._exit(0)`` in the completion does not pass.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

VIOLATION_EXIT = 86  # the audit hook stopped a forbidden operation
MEMORY_EXIT = 87  # MemoryError escaped the program (RLIMIT_AS reached)
MINIMAL_PATH = "/usr/bin:/bin"
NOBODY = 65534

Status = Literal["passed", "failed", "timeout", "error"]

_HARNESS = r"""
import os, sys, json
job = json.loads(sys.stdin.read()); sys.stdin.close()
root = os.path.realpath(os.getcwd()) + os.sep
def _inside(p):
    if isinstance(p, int): return True
    try: p = os.fsdecode(p)
    except TypeError: return False
    return (os.path.realpath(p) + os.sep).startswith(root)
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_DENY = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
         "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
         "ctypes.dlopen", "ctypes.dlsym", "os.kill", "os.killpg", "signal.pthread_kill", "os.setuid", "os.chroot")
_PATHS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
          "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move")
def _hook(event, args, _exit=os._exit, _write=os.write, _code=job["violation_exit"]):
    bad = event in _DENY
    if event == "open" and len(args) >= 3:
        path, mode, flags = args[0], args[1], args[2] or 0
        writes = (flags & _WRITE) or (isinstance(mode, str) and any(c in mode for c in "wax+"))
        bad = bool(writes) and not _inside(path)
    elif event in _PATHS:
        bad = not all(_inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike)))
    if bad:
        _write(2, ("sandbox: blocked " + event + "\n").encode()); _exit(_code)
sys.addaudithook(_hook)
try:
    exec(compile(job["program"], "<solution>", "exec"), {"__name__": "__main__"})
except MemoryError:
    os._exit(job["memory_exit"])
os.write(1, job["token"].encode())
"""


@dataclass(frozen=True)
class Limits:
    """Per-run limits of the sandbox."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the process group is killed."""
    cpu_s: int = 10
    """CPU seconds (``RLIMIT_CPU``); the kernel sends SIGXCPU, then SIGKILL."""
    memory_mib: int = 1024
    """Address space (``RLIMIT_AS``), MiB."""
    file_mib: int = 16
    """Largest file the program may write (``RLIMIT_FSIZE``), MiB."""
    nproc: int = 64
    """Processes of the sandbox user (``RLIMIT_NPROC``); not enforced for root, hence the ``nobody`` drop."""


@dataclass(frozen=True)
class RunResult:
    """Outcome of one sandboxed run: ``status`` passed / failed (tests failed or raised) / timeout / error
    (killed by a signal or a limit, a blocked operation, MemoryError); ``seconds`` wall clock."""

    status: Status
    returncode: int | None
    seconds: float
    stderr_tail: str


@functools.cache
def isolation() -> str:
    """Isolation layers available here: ``"netns+nobody+audit"`` (root with working ``unshare``) or ``"audit"``.

    >>> isolation() in ("netns+nobody+audit", "audit")
    True
    """
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        return "audit"
    probe = subprocess.run(["unshare", "--net", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                            "--clear-groups", "true"], capture_output=True, timeout=10)
    return "netns+nobody+audit" if probe.returncode == 0 else "audit"


def _set_limits(limits: Limits) -> None:
    """Runs in the child between fork and exec (``preexec_fn``)."""
    mib = 1024 * 1024
    for which, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_mib * mib),
                         (resource.RLIMIT_FSIZE, limits.file_mib * mib), (resource.RLIMIT_NPROC, limits.nproc),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))


def _command() -> list[str]:
    python = [sys.executable, "-I", "-B", "-c", _HARNESS]
    if isolation().startswith("netns"):
        return ["unshare", "--net", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *python]
    return python


def run_python(program: str, limits: Limits = Limits()) -> RunResult:
    """Run ``program`` (Python source) in the sandbox; ``passed`` when it runs to its end without raising.

    >>> run_python("assert 1 + 1 == 2").status
    'passed'
    >>> run_python("assert 1 + 1 == 3").status
    'failed'
    """
    token = secrets.token_hex(16)
    job = {"program": program, "token": token, "violation_exit": VIOLATION_EXIT, "memory_exit": MEMORY_EXIT}
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    start = time.perf_counter()
    try:
        if isolation().startswith("netns"):
            os.chown(workdir, NOBODY, NOBODY)
        proc = subprocess.Popen(
            _command(), cwd=workdir, env={"PATH": MINIMAL_PATH}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=functools.partial(_set_limits, limits),
        )
        try:
            out, err = proc.communicate(json.dumps(job).encode(), limits.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: children the program managed to start
            except ProcessLookupError:
                pass  # already gone with all its group
        if timed_out:
            out, err = proc.communicate()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.perf_counter() - start
    rc = proc.returncode
    tail = err.decode(errors="replace")[-2000:]
    if timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
        status: Status = "timeout"
    elif rc == 0 and token.encode() in out:
        status = "passed"
    elif rc in (VIOLATION_EXIT, MEMORY_EXIT) or rc < 0:
        status = "error"
    else:
        status = "failed"
    return RunResult(status, rc, seconds, tail)


def default_workers() -> int:
    """Parallel sandboxes by default: the CPU count, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def run_many(programs: list[str], limits: Limits = Limits(), workers: int | None = None) -> list[RunResult]:
    """:func:`run_python` over ``programs`` with ``workers`` runs at a time (threads launching processes).

    Returns one :class:`RunResult` per program, in order.
    """
    if not programs:
        return []
    workers = workers or default_workers()
    if workers == 1:
        return [run_python(p, limits) for p in programs]
    with ThreadPoolExecutor(max_workers=min(workers, len(programs)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda p: run_python(p, limits), programs))
