"""Run untrusted Python (a completion's program) against trusted unit tests, with a verdict the program cannot forge.

Two processes per run (:func:`run_tests`):

- the **candidate** (:mod:`rewards.sandbox_candidate`) runs the program, contained, and answers calls to its
  top-level functions with plain data (:mod:`rewards.sandbox_wire`: JSON, never pickle);
- the **judge** (:mod:`rewards.sandbox_judge`) runs the row's tests with the candidate's functions as proxies,
  compares in its own process and writes the verdict to a pipe only this process reads. Nothing in the
  program's reach (a pass token, the harness's globals, its audit hook, its exit code) decides the verdict.

Containment, strongest available first (:func:`isolation`; the mode is an argument for tests), the same for
the candidate and for the judge, each in a sandbox of its own (the judge runs the dataset's test code): see
:mod:`rewards.sandbox_modes`. ``bwrap+audit`` (bubblewrap: user, PID, network, mount namespaces, a filesystem of
``/usr`` and the standard library, sized tmpfs work directory, ``/tmp`` and ``/dev/shm``, uid ``nobody`` on the
host too) and ``netns+nobody+audit`` (root without bubblewrap: no network, own PID and IPC namespaces, a uid of its own,
sized tmpfs on every world-writable directory; world-readable host files stay readable) hold for root, and no
process of a run outlives its verdict. ``audit``: a Python audit hook (PEP 578) alone, in-process and defeatable
by the program: :func:`require_isolation` refuses it unless the caller allows it explicitly.

Always: ``python -I`` in a new session killed whole at the wall-clock limit (counted once both sandboxes are up),
an environment of ``PATH`` only, and resource limits (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
``RLIMIT_NPROC``, no core files). Where the host allows it, a memory cgroup per run bounds the run's processes
together (:mod:`rewards.sandbox_cgroup`, :attr:`Limits.memory_per_run_mib`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rewards.sandbox_cgroup import RunCgroup, memory_parent
from rewards.sandbox_modes import MINIMAL_PATH, MODES, NAMESPACE_MODES, Isolation, exit_code, kill_run, launch, works

__all__ = ["MODES", "WEAK_MODES", "Isolation", "Limits", "RunResult", "SandboxUnavailable", "default_workers",
           "isolation", "check_memory_bound", "require_isolation", "run_many", "run_python", "run_tests"]

VIOLATION_EXIT = 86  # the audit hook stopped a forbidden operation
MEMORY_EXIT = 87  # MemoryError escaped the program (RLIMIT_AS reached)
STARTUP_LIMIT_S = 60.0
"""Longest start-up of a run's two sandboxes (launch to the candidate's ``up``) before it counts as a timeout; the
run's own wall clock (:attr:`Limits.timeout_s`) starts after it."""
STARTUP_ALLOWANCE_S = 1.0
"""Start-up counted per run when ``start`` checks that a reward's guard can hold a batch (measured 0.16-0.22 s for
``bwrap+audit`` on the shared 2-core box, 2026-11-28; 1 s leaves room for a loaded host)."""
MAX_REPLY_BYTES = 16 * 1024 * 1024
"""Longest reply line of the candidate the judge reads (a larger return value fails the test)."""

Status = Literal["passed", "failed", "timeout", "error", "cancelled"]
POLL_S = 0.1
"""Seconds between looks at a stop event while a run starts up or runs."""
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
    """Wall-clock seconds of the run before both processes are killed, counted from the moment both sandboxes are
    up and the candidate is about to run the row's and the program's code (their start-up, which slows with the
    host's load, has its own bound, :data:`STARTUP_LIMIT_S`)."""
    cpu_s: int = 10
    """CPU seconds (``RLIMIT_CPU``) of each process; the kernel sends SIGXCPU, then SIGKILL."""
    memory_mib: int = 1024
    """Address space (``RLIMIT_AS``) of each process, MiB."""
    file_mib: int = 16
    """Largest file the program may write (``RLIMIT_FSIZE``), MiB."""
    nproc: int = 64
    """Processes of the run (``RLIMIT_NPROC``; counted per run: under bubblewrap per user namespace, in
    ``netns+nobody+audit`` per the run's own uid, :func:`rewards.sandbox_modes.run_uid`)."""
    tmpfs_mib: int = 32
    """Size of each private tmpfs of a namespace mode (the work directory, ``/tmp``, ``/dev/shm``), MiB: what a
    program can write at all."""
    memory_per_run_mib: int | None = None
    """Memory of the whole run (candidate, judge and every process they start: resident pages, page cache, tmpfs
    pages), MiB, where the host allows a memory cgroup per run (:mod:`rewards.sandbox_cgroup`). None: twice
    ``memory_mib`` (:attr:`run_memory_mib`)."""

    @property
    def run_memory_mib(self) -> int:
        """The per-run bound in MiB: ``memory_per_run_mib``, else ``2 * memory_mib`` (the run's two harness processes
        each at their ``RLIMIT_AS``: a run that stays within its per-process limits and starts no process is never
        stopped by it, and ``workers`` runs at once hold at most ``workers * 2 * memory_mib``)."""
        return self.memory_per_run_mib if self.memory_per_run_mib is not None else 2 * self.memory_mib


@dataclass(frozen=True)
class RunResult:
    """Outcome of one sandboxed run: ``status`` passed (the judge's tests passed) / failed (a test failed, the
    program raised or did not define the function) / timeout (wall clock or CPU limit) / error (the candidate
    was killed by a limit or a blocked operation, or broke the protocol) / cancelled (its caller gave up: the stop
    event was set before or while it ran, and its processes were killed; no verdict); ``returncode`` the candidate's;
    ``seconds`` wall clock; ``detail`` the judge's reason; ``stderr_tail`` the candidate's last stderr."""

    status: Status
    returncode: int | None
    seconds: float
    stderr_tail: str
    detail: str = ""


@functools.cache
def isolation() -> Isolation:
    """The strongest isolation mode that works here (see the module docstring), probed once per process.

    >>> isolation() in MODES
    True
    """
    return next(mode for mode in MODES if works(mode))  # "audit" always works


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


def check_memory_bound() -> None:
    """Refuse to go on where the host allows no memory cgroup per run (:func:`rewards.sandbox_cgroup.memory_parent`).

    Raises:
        SandboxUnavailable: no memory cgroup can be made here; names the fixes.
    """
    if memory_parent() is None:
        raise SandboxUnavailable(
            "code_execution: `require_memory_bound: true`, but this host allows no memory cgroup per run (the reason "
            "is in the `[sandbox] memory bound per run: off` line above): run as root on a host with the cgroup v1 "
            "memory controller or cgroup v2, in a delegated cgroup v2 subtree (systemd `Delegate=yes`), or drop "
            "`require_memory_bound` to run with the per-process RLIMIT_AS only")


def _set_limits(limits: Limits, nproc: bool = True, cgroup: RunCgroup | None = None) -> None:
    """Runs in the child between fork and exec (``preexec_fn``): joins the run's memory cgroup, if any, before
    anything of the run runs, then sets the resource limits."""
    if cgroup is not None:
        cgroup.join()
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


def _run_cgroup(limits: Limits) -> RunCgroup | None:
    """A memory cgroup for one run, limited to :attr:`Limits.run_memory_mib`, or None where the host allows none."""
    parent = memory_parent()
    if parent is None:
        return None
    try:
        return RunCgroup(parent, limits.run_memory_mib * 1024 * 1024)
    except OSError as err:
        raise SandboxUnavailable(f"the run's memory cgroup cannot be created under {parent.path}: {err}") from err


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


def _wait(judge: subprocess.Popen, started: int, seconds: float, stop: threading.Event | None) -> tuple[bytes, str]:
    """Wait for the run's two sandboxes to be up (``started`` readable, at most :data:`STARTUP_LIMIT_S`), then for the
    judge's verdict for ``seconds``; looks at ``stop`` every :data:`POLL_S`. Returns ``(judge's stdout, how)``, how
    one of ``done``, ``timeout``, ``cancelled``."""
    deadline = time.monotonic() + STARTUP_LIMIT_S
    while not select.select([started], [], [], POLL_S if stop else STARTUP_LIMIT_S)[0]:
        if stop is not None and stop.is_set():
            return b"", "cancelled"
        if time.monotonic() >= deadline:
            seconds = 0.0  # not up in time: counts as a timeout (the judge gets no time of its own)
            break
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        try:
            out, _ = judge.communicate(timeout=max(0.0, min(left, POLL_S) if stop else left))
            return out, "done"
        except subprocess.TimeoutExpired:  # retrying communicate() loses no output (its documentation)
            if stop is not None and stop.is_set():
                return b"", "cancelled"
            if left <= 0:
                return b"", "timeout"


def _cancelled(start: float) -> RunResult:
    return RunResult("cancelled", None, time.perf_counter() - start, "", "given up by its caller (the reward's guard)")


def run_tests(code: str, test: str, entry_point: str | None, limits: Limits = Limits(),
              mode: Isolation | None = None, prelude: str | None = None,
              stop: threading.Event | None = None) -> RunResult:
    """Run ``code`` (the candidate's program) contained, and ``test`` (trusted; defines ``check(candidate)``)
    in the judge against its ``entry_point`` function (None: no tests, the program only has to load).

    ``prelude``: the row's own code (HumanEval's prompt: imports and helpers such as ``poly``), run before the
    program in the candidate and, separately, in the judge, where the tests see it, their own names and the
    entry point, nothing else of the program's (a program redefining ``range``, ``abs`` or ``poly`` changes
    nothing the tests call).

    ``stop``: once set, nothing is launched and a run in flight is killed (status ``cancelled``): the reward's guard
    sets it at its deadline (:func:`rewards.guard.stop_event`).

    ``mode``: the candidate's isolation (None: :func:`isolation`). Returns a :class:`RunResult`: ``error`` too when
    the run reached its memory bound (:attr:`Limits.run_memory_mib`) and the kernel killed one of its processes.

    Raises:
        SandboxUnavailable: the run's memory cgroup cannot be created where the host allowed one at the probe.

    >>> run_tests("def f(x): return x * 2", "def check(c): assert c(2) == 4", "f").status
    'passed'
    >>> run_tests("def f(x): return x + 2", "def check(c): assert c(3) == 6", "f").status
    'failed'
    """
    if stop is not None and stop.is_set():
        return _cancelled(time.perf_counter())
    mode = mode or isolation()
    contained = mode in NAMESPACE_MODES
    # the namespace modes write into their own sized tmpfs; only the audit mode needs a directory of the host
    workdir = "/" if contained else tempfile.mkdtemp(prefix="grpo-sandbox-")
    tmpfs = limits.tmpfs_mib * 1024 * 1024
    cgroup = _run_cgroup(limits)
    # bubblewrap counts RLIMIT_NPROC per run: the harness sets it inside (a limit set here would count every
    # process of the host user nobody); the other modes set it before the exec
    limited = functools.partial(_set_limits, limits, mode != "bwrap+audit", cgroup)
    start = time.perf_counter()
    to_candidate, from_candidate, started = os.pipe(), os.pipe(), os.pipe()  # (read, write) each
    with cgroup or contextlib.nullcontext(), tempfile.TemporaryFile() as cand_err, \
            tempfile.TemporaryFile() as judge_err, tempfile.TemporaryFile() as job_file:
        try:
            candidate, candidate_info = launch(
                mode, CANDIDATE_SOURCE, tmpfs, cwd=workdir, env={"PATH": MINIMAL_PATH},
                stdin=to_candidate[0], stdout=from_candidate[1], stderr=cand_err, start_new_session=True,
                preexec_fn=limited)
            job = {"code": code, "prelude": prelude, "test": test, "entry_point": entry_point,
                   "nproc": limits.nproc, "to_candidate": to_candidate[1],
                   "from_candidate": from_candidate[0], "started": started[1], "max_reply_bytes": MAX_REPLY_BYTES,
                   "violation_exit": VIOLATION_EXIT, "memory_exit": MEMORY_EXIT}
            job_file.write(json.dumps(job).encode())  # a file, not a pipe: nothing to feed while the clock waits
            job_file.seek(0)
            # the judge runs the row's tests (a dataset's code) in a sandbox of its own, apart from the program's
            judge, judge_info = launch(
                mode, JUDGE_SOURCE, tmpfs, env={"PATH": MINIMAL_PATH}, cwd=workdir,
                stdin=job_file, stdout=subprocess.PIPE, stderr=judge_err, start_new_session=True,
                pass_fds=(to_candidate[1], from_candidate[0], started[1]), preexec_fn=limited)
        finally:
            for fd in (*to_candidate, *from_candidate, started[1]):
                os.close(fd)  # the two processes hold their ends; an end left here would hide an exit
        # the wall clock starts when both sandboxes are up (the judge's byte on `started`, or its end), not at their
        # launch: start-up (namespaces, mounts, two interpreters) slows with the host's load, the program does not
        try:
            out, how = _wait(judge, started[0], limits.timeout_s, stop)
        finally:
            os.close(started[0])
        timed_out = how != "done"
        if timed_out:
            returncode = candidate.poll()  # still running, most likely: its limit is what ended the run
        else:
            try:
                returncode = candidate.wait(timeout=1.0)  # after a verdict it ends by itself; after a crash it has
            except subprocess.TimeoutExpired:
                returncode = None
        kill_run(judge, judge_info)
        kill_run(candidate, candidate_info)
        oom_kills = cgroup.oom_kills() if cgroup else 0  # then removed as the `with` ends
        if not contained:
            shutil.rmtree(workdir, ignore_errors=True)
        seconds, tail = time.perf_counter() - start, _tail(cand_err)
        judge_tail = _tail(judge_err)
    if how == "cancelled":
        return _cancelled(start)
    returncode = exit_code(returncode)
    verdict = _verdict(out, judge.returncode, judge_tail)
    status: Status
    if oom_kills:  # whichever process the kernel chose (a child of the program, or the judge), the run is void
        status = "error"
        verdict = {"detail": f"the run reached its memory bound ({limits.run_memory_mib} MiB): the kernel killed "
                             f"{oom_kills} of its process(es)"}
    elif returncode in (VIOLATION_EXIT, MEMORY_EXIT):  # the candidate's own report of why it ended comes first
        status = "error"
    elif timed_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        status = "timeout"
    elif verdict["status"] == "passed":
        status = "passed"
    elif returncode is not None and returncode < 0:
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
             workers: int | None = None, mode: Isolation | None = None,
             stop: threading.Event | None = None) -> list[RunResult]:
    """:func:`run_tests` over ``jobs`` (``(code, test, entry_point, prelude)`` each) with ``workers`` runs at a
    time (threads launching processes). Returns one :class:`RunResult` per job, in order. ``stop`` (the reward
    guard's, :func:`rewards.guard.stop_event`): once set, the runs not yet launched are not, the runs in flight are
    killed (both ``cancelled``), and the call returns within about :data:`POLL_S` seconds plus a kill; the runs that
    ended before keep their results."""
    if not jobs:
        return []
    workers = workers or default_workers()

    def one(job):
        code, test, entry_point, prelude = job
        return run_tests(code, test, entry_point, limits, mode, prelude, stop)

    if workers == 1:
        return [one(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs)), thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, jobs))
