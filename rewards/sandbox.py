"""Run untrusted Python (a completion's program) against trusted unit tests, with a verdict the program cannot forge.

Two processes per run (:func:`run_tests`):

- the **candidate** (:mod:`rewards.sandbox_candidate`) runs the program, contained, and answers calls to its
  top-level functions with plain data (:mod:`rewards.sandbox_wire`: JSON, never pickle);
- the **judge** (:mod:`rewards.sandbox_judge`) runs the row's tests with the candidate's functions as proxies,
  compares in its own process and writes the verdict to a pipe only this process reads. Nothing in the
  program's reach (a pass token, the harness's globals, its audit hook, its exit code) decides the verdict.

Containment of the candidate, strongest available first (:func:`isolation`; the mode is an argument for tests):

- ``bwrap+audit``: bubblewrap (Debian ``bubblewrap``) with new user, PID, network, IPC and UTS namespaces, uid
  ``nobody``, a filesystem of ``/usr`` and the interpreter's standard library read-only plus its own work
  directory, a private ``/tmp`` and ``/proc``, no environment: the program sees no other process (the judge and
  the trainer included), no network, no project files, data or credentials.
- ``netns+nobody+audit`` (root without bubblewrap, or where it cannot create namespaces): ``unshare --net --mount``
  with empty private ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and ``setpriv`` to ``nobody``: no network, no access
  to other users' processes or root-owned files, nowhere to write but its work directory; the rest of the
  filesystem stays readable (world-readable files: installed packages, their data).
- ``audit``: a Python audit hook (PEP 578) alone, in-process and defeatable by the program: it cannot contain
  file or environment access. :func:`require_isolation` refuses it unless the caller allows it explicitly.

Always: ``python -I`` in a new session killed whole at the wall-clock limit, in a fresh work directory removed
afterwards, an environment of ``PATH`` only, and resource limits (``RLIMIT_CPU``, ``RLIMIT_AS``,
``RLIMIT_FSIZE``, ``RLIMIT_NPROC``, no core files) set before the exec.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

VIOLATION_EXIT = 86  # the audit hook stopped a forbidden operation
MEMORY_EXIT = 87  # MemoryError escaped the program (RLIMIT_AS reached)
MINIMAL_PATH = "/usr/bin:/bin"
NOBODY = 65534
MAX_REPLY_BYTES = 16 * 1024 * 1024
"""Longest reply line of the candidate the judge reads (a larger return value fails the test)."""

Status = Literal["passed", "failed", "timeout", "error"]
Isolation = Literal["bwrap+audit", "netns+nobody+audit", "audit"]
MODES: tuple[str, ...] = typing.get_args(Isolation)
WEAK_MODES = ("audit",)
"""Modes that cannot contain the program's file and environment access."""

_HERE = Path(__file__).resolve().parent
_WIRE_IMPORT = "from rewards.sandbox_wire import "


def _source(name: str) -> str:
    """A harness module's source with :mod:`rewards.sandbox_wire` inlined in place of its import."""
    text = (_HERE / f"{name}.py").read_text()
    line = next(line for line in text.splitlines() if line.startswith(_WIRE_IMPORT))
    return text.replace(line, (_HERE / "sandbox_wire.py").read_text(), 1)


CANDIDATE_SOURCE = _source("sandbox_candidate")
JUDGE_SOURCE = _source("sandbox_judge")


class SandboxUnavailable(RuntimeError):
    """Only a weak isolation mode is available (or the mode asked for is not): the message says how to fix it."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits of the sandbox."""

    timeout_s: float = 10.0
    """Wall-clock seconds before both processes are killed."""
    cpu_s: int = 10
    """CPU seconds (``RLIMIT_CPU``) of each process; the kernel sends SIGXCPU, then SIGKILL."""
    memory_mib: int = 1024
    """Address space (``RLIMIT_AS``) of each process, MiB."""
    file_mib: int = 16
    """Largest file the program may write (``RLIMIT_FSIZE``), MiB."""
    nproc: int = 64
    """Processes of the sandbox user (``RLIMIT_NPROC``)."""


@dataclass(frozen=True)
class RunResult:
    """Outcome of one sandboxed run: ``status`` passed (the judge's tests passed) / failed (a test failed, the
    program raised or did not define the function) / timeout (wall clock or CPU limit) / error (the candidate
    was killed by a limit or a blocked operation, or broke the protocol); ``returncode`` the candidate's;
    ``seconds`` wall clock; ``detail`` the judge's reason; ``stderr_tail`` the candidate's last stderr."""

    status: Status
    returncode: int | None
    seconds: float
    stderr_tail: str
    detail: str = ""


def _python_home() -> str:
    """The installation prefix of the interpreter (its standard library lives under it)."""
    return sys.base_prefix


def _bwrap_command(workdir: str) -> list[str]:
    python = os.path.realpath(sys.executable)
    home = _python_home()
    cmd = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH",
           MINIMAL_PATH, "--uid", str(NOBODY), "--gid", str(NOBODY), "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "sbin"):  # merged-/usr systems: symlinks into /usr
        target = Path("/") / top
        if target.is_symlink():
            cmd += ["--symlink", os.readlink(target), f"/{top}"]
    if not home.startswith("/usr/"):
        cmd += ["--ro-bind", home, home]
        site = Path(home) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        if site.is_dir():
            cmd += ["--tmpfs", str(site)]  # the standard library only: no installed packages or their data
    return cmd + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", workdir, "/sandbox",
                  "--chdir", "/sandbox", python, "-I", "-S", "-B", "-c", CANDIDATE_SOURCE]


_PRIVATE_TMP = ('for d in /tmp /var/tmp /dev/shm; do [ -d "$d" ] && mount -t tmpfs -o size=16m,mode=1777 tmpfs "$d"; '
                'done; exec env -u PWD "$@"')
"""Shell run in the new mount namespace of ``netns+nobody+audit``; the work directory stays the process's cwd."""


def _candidate_command(mode: str, workdir: str) -> list[str]:
    if mode == "bwrap+audit":
        return _bwrap_command(workdir)
    python = [sys.executable, "-I", "-B", "-c", CANDIDATE_SOURCE]
    if mode == "netns+nobody+audit":  # private, empty /tmp, /var/tmp, /dev/shm: nobody's writable places elsewhere
        return ["unshare", "--net", "--mount", "--propagation", "private", "sh", "-c", _PRIVATE_TMP, "sandbox",
                "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *python]
    return python


def _works(mode: str) -> bool:
    """Whether ``mode`` can start a process on this machine (a probe run of ``true``-like Python)."""
    if mode == "audit":
        return True
    if mode == "netns+nobody+audit" and (os.geteuid() != 0 or not (shutil.which("unshare") and
                                                                     shutil.which("setpriv"))):
        return False
    if mode == "bwrap+audit" and not shutil.which("bwrap"):
        return False
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-probe-") as workdir:
        os.chmod(workdir, 0o777)
        cmd = _candidate_command(mode, workdir)[:-1] + ["import sys; sys.exit(0)"]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=20, cwd=workdir).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


@functools.cache
def isolation() -> Isolation:
    """The strongest isolation mode that works here (see the module docstring), probed once per process.

    >>> isolation() in MODES
    True
    """
    return next(mode for mode in MODES if _works(mode))  # "audit" always works


def require_isolation(allow_weak: bool = False) -> Isolation:
    """:func:`isolation`, refusing a weak mode unless ``allow_weak``.

    Raises:
        SandboxUnavailable: only ``audit`` is available and ``allow_weak`` is false; names the fixes.
    """
    mode = isolation()
    if mode in WEAK_MODES and not allow_weak:
        raise SandboxUnavailable(
            f"the code sandbox can only use isolation {mode!r} here (a Python audit hook, which cannot contain a "
            "program's file and environment access): install bubblewrap (`apt-get install bubblewrap`) where user "
            "namespaces are allowed, or run as root with `unshare`/`setpriv`; to accept the weak mode, set "
            "`allow_weak_isolation: true` in the code_execution reward's options")
    return mode


def _set_limits(limits: Limits, nproc: bool = True) -> None:
    """Runs in the child between fork and exec (``preexec_fn``)."""
    mib = 1024 * 1024
    values = [(resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_mib * mib),
              (resource.RLIMIT_FSIZE, limits.file_mib * mib), (resource.RLIMIT_CORE, 0)]
    if nproc:
        values.append((resource.RLIMIT_NPROC, limits.nproc))
    for which, value in values:
        # CPU: SIGXCPU at the soft limit (the process ends with it: reported as a timeout), SIGKILL a second later as
        # the backstop; with soft == hard the kernel would SIGKILL at once, which reads as a crash when the CPU limit
        # comes before the wall-clock one (a loaded machine, a slow judge start)
        resource.setrlimit(which, (value, value + 1) if which == resource.RLIMIT_CPU else (value, value))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: children the program managed to start
    except ProcessLookupError:
        pass  # already gone with all its group
    proc.wait()


def _tail(file) -> str:
    file.seek(0)
    return file.read()[-2000:].decode(errors="replace")


def _verdict(out: bytes, returncode: int | None, judge_tail: str) -> dict:
    """The judge's verdict: exactly one JSON line from a judge that exited 0 (anything else, e.g. a line written
    into its pipe from outside and the judge killed, is no verdict)."""
    lines = out.decode(errors="replace").splitlines()
    try:
        verdict = json.loads(lines[0]) if len(lines) == 1 and returncode == 0 else None
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict) or verdict.get("status") not in ("passed", "failed", "crashed"):
        return {"status": "crashed", "detail": f"no verdict from the judge (exit {returncode}): {judge_tail[-500:]}"}
    return verdict


def run_tests(code: str, test: str, entry_point: str | None, limits: Limits = Limits(),
              mode: Isolation | None = None, prelude: str | None = None) -> RunResult:
    """Run ``code`` (the candidate's program) contained, and ``test`` (trusted; defines ``check(candidate)``)
    in the judge against its ``entry_point`` function (None: no tests, the program only has to load).

    ``prelude``: the row's own code (HumanEval's prompt: imports and helpers such as ``poly``), run before the
    program in the candidate and, separately, in the judge, where the tests see it, their own names and the
    entry point, nothing else of the program's (a program redefining ``range``, ``abs`` or ``poly`` changes
    nothing the tests call).

    ``mode``: the candidate's isolation (None: :func:`isolation`). Returns a :class:`RunResult`.

    >>> run_tests("def f(x): return x * 2", "def check(c): assert c(2) == 4", "f").status
    'passed'
    >>> run_tests("def f(x): return x + 2", "def check(c): assert c(3) == 6", "f").status
    'failed'
    """
    mode = mode or isolation()
    workdir = tempfile.mkdtemp(prefix="grpo-sandbox-")
    start = time.perf_counter()
    to_candidate, from_candidate = os.pipe(), os.pipe()  # (read, write) each
    with tempfile.TemporaryFile() as cand_err, tempfile.TemporaryFile() as judge_err:
        try:
            if mode == "netns+nobody+audit":
                os.chown(workdir, NOBODY, NOBODY)  # (bwrap maps its nobody to this user: the directory is its own)
            candidate = subprocess.Popen(
                _candidate_command(mode, workdir), cwd=workdir, env={"PATH": MINIMAL_PATH}, stdin=to_candidate[0],
                stdout=from_candidate[1], stderr=cand_err, start_new_session=True,
                preexec_fn=functools.partial(_set_limits, limits))
            job = {"code": code, "prelude": prelude, "test": test, "entry_point": entry_point,
                   "nproc": limits.nproc, "to_candidate": to_candidate[1],
                   "from_candidate": from_candidate[0], "max_reply_bytes": MAX_REPLY_BYTES,
                   "violation_exit": VIOLATION_EXIT, "memory_exit": MEMORY_EXIT}
            judge = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", JUDGE_SOURCE], env={"PATH": MINIMAL_PATH}, cwd=workdir,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=judge_err, start_new_session=True,
                pass_fds=(to_candidate[1], from_candidate[0]),
                preexec_fn=functools.partial(_set_limits, limits, False))
        finally:
            for fd in (*to_candidate, *from_candidate):
                os.close(fd)  # the two processes hold their ends; an end left here would hide an exit
        try:
            out, _ = judge.communicate(json.dumps(job).encode(), timeout=limits.timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            out, timed_out = b"", True
        try:
            returncode = candidate.wait(timeout=1.0)  # after a verdict it ends by itself; after a crash it has
        except subprocess.TimeoutExpired:
            returncode = None
        _kill_group(judge)
        _kill_group(candidate)
        shutil.rmtree(workdir, ignore_errors=True)
        seconds, tail = time.perf_counter() - start, _tail(cand_err)
        judge_tail = _tail(judge_err)
    if mode == "bwrap+audit" and returncode is not None and returncode > 128:
        returncode = -(returncode - 128)  # bwrap reports a child's signal as 128 + signo
    verdict = _verdict(out, judge.returncode, judge_tail)
    status: Status
    if timed_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        status = "timeout"
    elif verdict["status"] == "passed":
        status = "passed"
    elif returncode in (VIOLATION_EXIT, MEMORY_EXIT) or (returncode is not None and returncode < 0):
        status = "error"
    elif verdict["status"] == "crashed":
        status = "error"
    else:
        status = "failed"
    return RunResult(status, returncode, seconds, tail, verdict.get("detail", ""))


def run_python(program: str, limits: Limits = Limits(), mode: Isolation | None = None) -> RunResult:
    """Run ``program`` contained; ``passed`` when it loads (runs to its end) without raising. This verdict is only
    as good as the program's word (a program can answer the judge as if it had loaded): score untrusted code
    with tests through :func:`run_tests`.

    >>> run_python("assert 1 + 1 == 2").status
    'passed'
    >>> run_python("assert 1 + 1 == 3").status
    'failed'
    """
    return run_tests(program, "", None, limits, mode)


def default_workers() -> int:
    """Parallel sandboxes by default: the CPU count, at most 8."""
    return max(1, min(8, os.cpu_count() or 1))


def run_many(jobs: list[tuple[str, str, str | None, str | None]], limits: Limits = Limits(),
             workers: int | None = None, mode: Isolation | None = None) -> list[RunResult]:
    """:func:`run_tests` over ``jobs`` (``(code, test, entry_point, prelude)`` each) with ``workers`` runs at a
    time (threads launching processes). Returns one :class:`RunResult` per job, in order."""
    if not jobs:
        return []
    workers = workers or default_workers()

    def one(job):
        code, test, entry_point, prelude = job
        return run_tests(code, test, entry_point, limits, mode, prelude)

    if workers == 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, jobs))
