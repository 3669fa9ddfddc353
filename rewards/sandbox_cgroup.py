"""A memory bound per sandboxed run (:mod:`rewards.sandbox`): the candidate and the judge of one run, and every
process they start, in a memory cgroup of the run's own, created under this process's own cgroup and removed when
the run ends.

``RLIMIT_AS`` bounds each process's address space; it does not bound a run: a program that turns its audit hook off
forks children, each under the limit, and pages written to the sandbox's tmpfs mounts count against no process. The
run's cgroup bounds what the run holds resident, page cache and tmpfs pages included (the kernel charges a page to
the cgroup of the process that touched it first). At the bound the kernel reclaims, then its OOM killer kills
inside the run's cgroup only, never a process of the host or of another run; the run then scores 0 whichever of its
processes was killed (:meth:`RunCgroup.oom_kills`).

Where the host allows it (:func:`memory_parent`):

- cgroup v2 (the unified hierarchy): this process's cgroup has the ``memory`` controller in its
  ``cgroup.subtree_control``, or can be given it (it has no process of its own, or is the root); limits
  ``memory.max``, ``memory.swap.max`` 0 and ``memory.oom.group`` 1 (the OOM killer ends the whole run);
- cgroup v1: the ``memory`` hierarchy is mounted and this process's cgroup in it is writable (root, or a delegated
  directory); limits ``memory.limit_in_bytes`` and, with swap accounting, ``memory.memsw.limit_in_bytes``.

Sources: the kernel's Documentation/admin-guide/cgroup-v2.rst ("Memory", "No Internal Process Constraint",
"Delegation") and Documentation/admin-guide/cgroup-v1/memory.rst.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupParent", "RunCgroup", "forget_probe", "memory_parent", "probe"]

log = logging.getLogger(__name__)

PREFIX = "grpo-sandbox-"
"""Name of each run's cgroup: ``<PREFIX><pid>-<n>`` (this process's PID, a counter)."""
_counter = itertools.count()


@dataclass(frozen=True)
class CgroupParent:
    """Where the runs' cgroups are created: ``path`` (this process's own memory cgroup), ``version`` 1 or 2."""

    path: str
    version: int


def _own_cgroups(proc_cgroup: str = "/proc/self/cgroup") -> dict[str, str]:
    """This process's cgroup per hierarchy: ``{"": path}`` for v2, ``{"memory": path}`` (and other controllers) for
    v1, from ``/proc/self/cgroup`` (lines ``id:controllers:path``)."""
    own = {}
    for line in Path(proc_cgroup).read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    return own


def _mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, str, set[str]]]:
    """Cgroup mounts as ``(fstype, mount point, root inside the hierarchy, super options)`` (proc(5) mountinfo)."""
    found = []
    for line in Path(mountinfo).read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        fstype, options = fields[sep + 1], set(fields[sep + 3].split(","))
        if fstype in ("cgroup", "cgroup2"):
            found.append((fstype, fields[4].replace("\\040", " "), fields[3], options))
    return found


def _under(mount: str, root: str, path: str) -> str | None:
    """The directory of cgroup ``path`` under a hierarchy mounted at ``mount`` whose mount shows ``root``."""
    if root != "/" and not (path + "/").startswith(root.rstrip("/") + "/"):
        return None  # the mount shows another part of the hierarchy
    return os.path.normpath(os.path.join(mount, path[len(root.rstrip("/")):].lstrip("/")))


def candidates(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> list[CgroupParent]:
    """This process's own memory cgroup in each hierarchy that could hold one: v2 first, then v1's ``memory``
    (``proc_cgroup``, ``mountinfo``: the files read)."""
    own, found = _own_cgroups(proc_cgroup), []
    for fstype, mount, root, options in _mounts(mountinfo):
        if fstype == "cgroup2" and "" in own and (path := _under(mount, root, own[""])):
            found.insert(0, CgroupParent(path, 2))
        elif fstype == "cgroup" and "memory" in options and "memory" in own and \
                (path := _under(mount, root, own["memory"])):
            found.append(CgroupParent(path, 1))
    return found


def probe(parent: CgroupParent) -> str | None:
    """Why no run cgroup can be made under ``parent`` (a trial one is created with a limit and removed), or None
    when it can."""
    base = Path(parent.path)
    if parent.version == 2:
        controllers = _read(base / "cgroup.controllers")
        if controllers is None or "memory" not in controllers.split():
            return f"cgroup v2 at {base}: the memory controller is not available there (cgroup.controllers)"
        if "memory" not in (_read(base / "cgroup.subtree_control") or "").split():
            try:
                (base / "cgroup.subtree_control").write_text("+memory")
            except OSError as err:
                why = ("it has processes of its own, and a non-root cgroup with processes cannot hand a controller to "
                       "children (start the pipeline in a delegated cgroup, its processes in a leaf below it)"
                       if err.errno == errno.EBUSY else err.strerror)  # else EACCES (not delegated), EROFS, ...
                return f"cgroup v2 at {base}: cannot enable the memory controller for child cgroups: {why}"
        if not os.access(base / "cgroup.procs", os.W_OK):
            return f"cgroup v2 at {base}: cgroup.procs is not writable by this user (no delegated subtree)"
    try:
        RunCgroup(parent, 64 << 20).close()
    except OSError as err:
        return f"cgroup v{parent.version} at {base}: cannot create a limited child cgroup ({err})"
    return None


_PROBE_LOCK = threading.Lock()


def memory_parent() -> CgroupParent | None:
    """The first of :func:`candidates` where run cgroups can be made (:func:`probe`), probed once per process (the
    sandbox's worker threads wait for the first probe); None where the host allows none, with one warning line that
    says the per-run bound is off and why."""
    with _PROBE_LOCK:
        return _memory_parent()


def forget_probe() -> None:
    """Make the next :func:`memory_parent` probe the host again (and warn again where the bound is off)."""
    with _PROBE_LOCK:
        _memory_parent.cache_clear()


@functools.cache
def _memory_parent() -> CgroupParent | None:
    reasons = []
    try:
        found = candidates()
    except (OSError, ValueError, IndexError) as err:
        found, reasons = [], [f"cannot read this process's cgroups: {err}"]
    for parent in found:
        reason = probe(parent)
        if reason is None:
            return parent
        reasons.append(reason)
    log.warning("[sandbox] memory bound per run: off (%s); each sandboxed process keeps its own RLIMIT_AS only",
                "; ".join(reasons) or "no cgroup hierarchy with a memory controller is mounted")
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


class RunCgroup:
    """One run's memory cgroup under ``parent``, limited to ``limit_bytes`` (resident memory, page cache and tmpfs
    pages; swap too where the host accounts it). Start each of the run's processes with :meth:`join` as (or in) its
    ``preexec_fn``; :meth:`close` when the run ends.

    Raises:
        OSError: the cgroup cannot be created or limited (it is removed again).
    """

    def __init__(self, parent: CgroupParent, limit_bytes: int):
        self.version = parent.version
        self.path = Path(parent.path) / f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.path.mkdir(mode=0o755)
        try:
            if self.version == 2:
                self._write("memory.max", limit_bytes)
                self._write("memory.swap.max", 0, optional=True)  # absent without swap accounting
                self._write("memory.oom.group", 1, optional=True)  # kernels before 4.19: the biggest process only
            else:
                self._write("memory.limit_in_bytes", limit_bytes)
                self._write("memory.memsw.limit_in_bytes", limit_bytes, optional=True)  # memory + swap
        except OSError:
            self.path.rmdir()
            raise
        # written between fork and exec: a path string ready now (nothing to build in the child)
        self._procs = os.fsencode(self.path / "cgroup.procs")

    def __enter__(self) -> RunCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        file = self.path / name
        if optional and not file.exists():
            return
        if not file.exists():  # a plain directory, not a cgroup (or no memory controller there)
            raise FileNotFoundError(f"{file} does not exist: {self.path.parent} is not a memory cgroup")
        file.write_text(str(value))

    def join(self) -> None:
        """Move the calling process into this cgroup (``0``: the writer itself); run in the child between fork and
        exec, before any of the run's code."""
        fd = os.open(self._procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    def oom_kills(self) -> int:
        """Processes of the run the kernel's OOM killer ended at the bound (``oom_kill`` in ``memory.events`` (v2) or
        ``memory.oom_control`` (v1, Linux 4.13+)); 0 after :meth:`close`."""
        text = _read(self.path / ("memory.events" if self.version == 2 else "memory.oom_control")) or ""
        return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0)

    def pids(self) -> list[int]:
        """PIDs of the processes in the cgroup now."""
        return [int(pid) for pid in (_read(self.path / "cgroup.procs") or "").split()]

    def close(self, wait_s: float = 5.0) -> None:
        """Kill what is left in the cgroup (:func:`rewards.sandbox_modes.kill_run` has ended the run's processes; a
        process still here is killed: none outlives its run) and remove it, waiting up to ``wait_s`` seconds for
        exiting processes to leave.

        Raises:
            OSError: the cgroup could not be removed within ``wait_s`` (a process stuck in the kernel)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
            if (self.path / "cgroup.kill").exists():
                (self.path / "cgroup.kill").write_text("1")  # v2, Linux 5.14+: the kernel kills the whole cgroup
            else:
                for pid in self.pids():  # only processes of this run's cgroup are listed here
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass  # already gone
            time.sleep(0.005)
