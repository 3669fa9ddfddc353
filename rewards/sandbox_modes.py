"""The code sandbox's isolation modes (:mod:`rewards.sandbox`): the command that starts a harness (candidate or
judge) contained, and the probe that says whether a mode works on this machine.

Every mode's bounds hold for root:

- ``bwrap+audit``: bubblewrap with new user, PID, network, IPC, UTS and mount namespaces, uid ``nobody``, ``/usr``
  and the interpreter's standard library read-only, sized tmpfs mounts on ``/sandbox`` (the work directory),
  ``/tmp`` and ``/dev/shm``, ``/dev`` and an empty cover on ``site-packages`` read-only, nothing else of the host.
  Run by root, bubblewrap itself runs as ``nobody`` (root's ``RLIMIT_NPROC`` is never enforced; nobody's is, counted
  per user namespace: this run's processes only). An
  interpreter nobody cannot reach (under ``/root``) is bind-mounted first in a private mount namespace.
- ``netns+nobody+audit`` (root without bubblewrap): ``unshare`` of the network, mount, PID, IPC and UTS namespaces,
  sized tmpfs mounts on every world-writable directory (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``; the work
  directory lives in the private ``/tmp``), ``setpriv`` to a uid of the run's own (:func:`run_uid`, so that
  ``RLIMIT_NPROC`` counts this run's processes only). A root shell stays PID 1 of the namespace
  (the program cannot signal it): its end, or the kill of ``unshare``, ends every process of the run. World-readable
  files of the host stay readable.
- ``audit``: no containment outside the process (a Python audit hook only).

In the namespace modes a process ends with the namespace's PID 1: none outlives the verdict (``setsid``, a new
process group or ``_posixsubprocess.fork_exec`` change nothing). Exit codes of a signalled process come back as
``128 + signo`` (:func:`exit_code`).
"""

from __future__ import annotations

import functools
import grp
import itertools
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Literal

MINIMAL_PATH = "/usr/bin:/bin"
NOBODY = 65534
Isolation = Literal["bwrap+audit", "netns+nobody+audit", "audit"]
MODES: tuple[str, ...] = typing.get_args(Isolation)
NAMESPACE_MODES = ("bwrap+audit", "netns+nobody+audit")
"""Modes whose run lives in its own PID namespace (and user ``nobody``)."""
SANDBOX_DIR = "/sandbox"
"""The work directory inside ``bwrap+audit``."""
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""Directories nobody could write on a Debian host: each gets its own sized tmpfs in ``netns+nobody+audit``."""
REAPER_SOURCE = (Path(__file__).resolve().parent / "sandbox_reaper.py").read_text()
"""The ``audit`` mode's launcher, run as ``python -I -S -B -c`` (:mod:`rewards.sandbox_reaper`)."""
SITE_TMPFS_BYTES = 65536
"""Size of the empty, read-only tmpfs that hides the interpreter's ``site-packages`` in ``bwrap+audit``."""
_STAGES = ("/mnt", "/media", "/srv", "/opt")
"""Directories one of which a private mount namespace covers with its own tmpfs to stage the interpreter in."""


def _stage(home: str) -> str:
    """The first of :data:`_STAGES` that exists and does not hold the interpreter's ``home``."""
    return next((d for d in _STAGES if os.path.isdir(d) and not (home + "/").startswith(d + "/")), _STAGES[0])

_STAGE_PYTHON = ('set -e; mount -t tmpfs -o size=1m,mode=0755 tmpfs "$1"; mkdir "$1/python"; '
                 'mount --bind -o ro "$0" "$1/python"; shift; exec "$@"')
"""Root's shell before a ``nobody`` bubblewrap: the interpreter's home ($0) bound where nobody can reach it."""

_NETNS = ('set -e; size=$1; home=$2; stage=$3; uid=$4; shift 4; mount -t tmpfs -o size=1m,mode=0755 tmpfs "$stage"; '
          'mkdir "$stage/python"; mount --bind "$home" "$stage/python"; '
          f'for d in {" ".join(WORLD_WRITABLE)}; do if [ -d "$d" ]; then '
          'mount -t tmpfs -o "size=$size,mode=1777" tmpfs "$d"; fi; done; '
          'mkdir -p "$home"; mount --bind "$stage/python" "$home"; '  # an interpreter under /tmp stays visible
          'mkdir -m 0700 /tmp/sandbox; chown "$uid:$uid" /tmp/sandbox; cd /tmp/sandbox; set +e; '
          'env -u PWD -u OLDPWD "$@"; exit $?')  # not exec: this root shell stays PID 1; its end ends the namespace
"""Root's shell as PID 1 of ``netns+nobody+audit``'s namespaces; $1 the tmpfs size, $2 the interpreter's home, $3
where to stage it (:func:`_stage`), $4 the run's uid (:func:`run_uid`)."""

RUN_UID_BASE = 1_900_000_000
"""``netns+nobody+audit`` runs each run as a uid of its own (:func:`run_uid`), from here to
``RUN_UID_BASE + 65536 * 1024 - 1`` (1,967,108,095): ``RLIMIT_NPROC`` counts every process of a uid on the host, so
with one shared ``nobody`` a fork bomb in one completion (or any process of ``nobody`` on the host) made the innocent
runs beside it fail to start theirs. A uid that the host names or uses is skipped (:func:`uid_in_use`); what is not
checked: files owned by such a uid outside the run's tmpfs mounts (none is made by the pipeline)."""
_run_counter = itertools.count()


@functools.cache
def _subordinate_ranges() -> tuple[tuple[int, int], ...]:
    """``(first, count)`` ranges that ``/etc/subuid`` and ``/etc/subgid`` delegate to users' user namespaces
    (subuid(5)): a container's processes run on the host as those ids."""
    ranges = []
    for path in ("/etc/subuid", "/etc/subgid"):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue  # no delegation configured
        for line in lines:
            parts = line.split(":")
            if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                ranges.append((int(parts[1]), int(parts[2])))
    return tuple(ranges)


def _process_uids() -> set[int]:
    """The uids of the host's running processes as ``/proc/<pid>`` shows them (the owner of the directory: the
    effective uid; root for a process that is not dumpable, e.g. one started from a setuid program): one ``stat``
    per process (reading each ``status`` file cost 12x more, ~17 ms a run on a loaded 2-core box)."""
    uids = set()
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                try:
                    uids.add(entry.stat(follow_symlinks=False).st_uid)
                except OSError:
                    continue  # ended while listed
    return uids


def uid_in_use(uid: int, process_uids: set[int] | None = None) -> str | None:
    """Why ``uid`` (used as uid and gid) is not free for a run: the user or group database names it (``pwd``/``grp``,
    NSS included), ``/etc/subuid``/``/etc/subgid`` delegate it, or a running process holds it (``process_uids``:
    :func:`_process_uids` already read, None: read now); None when it is free.

    >>> uid_in_use(0)
    'the user database names it (root)'
    """
    try:
        return f"the user database names it ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        pass  # no such user: as expected
    try:
        return f"the group database names it ({grp.getgrgid(uid).gr_name})"
    except KeyError:
        pass
    if any(first <= uid < first + count for first, count in _subordinate_ranges()):
        return "/etc/subuid or /etc/subgid delegates it to a user namespace"
    if uid in (process_uids if process_uids is not None else _process_uids()):
        return "a running process holds it"
    return None


def run_uid() -> int:
    """A uid for one ``netns+nobody+audit`` run: :data:`RUN_UID_BASE` + 1024 per process (by PID) + a counter, so no
    two runs on the host share one while fewer than 1024 of a process overlap; a uid in use (:func:`uid_in_use`:
    named by the host, delegated, or held by a running process, another run's included) is skipped.

    Raises:
        RuntimeError: all 1024 uids of this process's block are in use.

    >>> RUN_UID_BASE <= run_uid() < RUN_UID_BASE + 65536 * 1024
    True
    """
    block = RUN_UID_BASE + (os.getpid() % 65536) * 1024
    process_uids = _process_uids()
    for _ in range(1024):
        uid = block + next(_run_counter) % 1024
        if uid_in_use(uid, process_uids) is None:
            return uid
    raise RuntimeError(f"netns+nobody+audit: every uid from {block} to {block + 1023} is named by the host, delegated "
                       "to user namespaces or held by a running process: free that range, or install bubblewrap")


def python_home() -> str:
    """The installation prefix of the interpreter (its standard library lives under it)."""
    return sys.base_prefix


def _setpriv(uid: int = NOBODY) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _bwrap(program: list[str], tmpfs_bytes: int, info_fd: int | None) -> list[str]:
    home = python_home()
    root = os.geteuid() == 0
    stage = _stage(home)
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _STAGE_PYTHON, home, stage,
              *_setpriv()] if root else []
    size = ["--size", str(tmpfs_bytes)]
    # --info-fd: bubblewrap reports its namespace init's PID, which kill_run waits for (see launch)
    info = ["--info-fd", str(info_fd)] if info_fd is not None else []
    cmd = [*prefix, "bwrap", *info, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv", "--setenv",
           "PATH", MINIMAL_PATH, "--uid", str(NOBODY), "--gid", str(NOBODY), "--ro-bind", "/usr", "/usr"]
    for top in ("bin", "lib", "lib64", "sbin"):  # merged-/usr systems: symlinks into /usr
        target = Path("/") / top
        if target.is_symlink():
            cmd += ["--symlink", os.readlink(target), f"/{top}"]
    cmd += [*size, "--tmpfs", "/tmp"]  # before the interpreter's bind: an interpreter under /tmp stays visible
    if not home.startswith("/usr/"):
        cmd += ["--ro-bind", f"{stage}/python" if root else home, home]
        site = Path(home) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        if site.is_dir():  # the standard library only: no installed packages or their data; an empty read-only tmpfs
            cmd += ["--size", str(SITE_TMPFS_BYTES), "--tmpfs", str(site), "--remount-ro", str(site)]
    # /dev: bubblewrap's own tmpfs (unsized: 4 MiB were written there under a 1 MiB bound), read-only once /dev/shm
    # (sized) is mounted on it; its device nodes (/dev/null, /dev/urandom, ...) stay usable
    return cmd + ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev", *size,
                  "--tmpfs", SANDBOX_DIR, "--remount-ro", "/", "--chdir", SANDBOX_DIR, *program]  # (the root: unsized)


def command(mode: str, source: str, tmpfs_bytes: int, info_fd: int | None = None) -> list[str]:
    """The argv that runs Python ``source`` (``python -I -B -c source``) contained by ``mode``; each private
    tmpfs holds ``tmpfs_bytes`` at most. ``info_fd``: ``bwrap+audit`` only, the descriptor bubblewrap writes its
    ``--info-fd`` JSON to."""
    python = os.path.realpath(sys.executable)
    if mode == "bwrap+audit":
        return _bwrap([python, "-I", "-S", "-B", "-c", source], tmpfs_bytes, info_fd)
    if mode == "netns+nobody+audit":
        uid = run_uid()
        # --ipc: a SysV segment or semaphore ends with the run (it outlived it in the host's IPC namespace); --uts: a
        # hostname of its own
        return ["unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc",
                "--propagation", "private", "sh", "-c", _NETNS, "sandbox", str(tmpfs_bytes), python_home(),
                _stage(python_home()), str(uid), *_setpriv(uid), python, "-I", "-S", "-B", "-c", source]
    # audit: no namespace; a child subreaper parent clears what the program leaves (rewards/sandbox_reaper.py)
    return [sys.executable, "-I", "-S", "-B", "-c", REAPER_SOURCE, sys.executable, "-I", "-B", "-c", source]


def exit_code(returncode: int | None) -> int | None:
    """The contained process's exit code as :mod:`subprocess` reports one (a signal as its negative number): every
    mode's launcher reports a child's signal as ``128 + signo``."""
    if returncode is not None and returncode > 128:
        return -(returncode - 128)
    return returncode


def why_not(mode: str) -> str | None:
    """Why ``mode`` cannot start a process on this machine (a probe run), or None when it works."""
    if mode == "audit":
        return None
    tools = {"bwrap+audit": ["bwrap"], "netns+nobody+audit": ["unshare", "setpriv"]}[mode]
    if mode == "bwrap+audit" and os.geteuid() == 0:
        tools += ["unshare", "setpriv"]
    missing = [tool for tool in tools if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed"
    if mode == "netns+nobody+audit" and os.geteuid() != 0:
        return "needs root"
    try:
        done = subprocess.run(command(mode, "import sys; sys.exit(0)", 1 << 20), capture_output=True, timeout=20,
                              cwd="/", env={"PATH": MINIMAL_PATH})
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"the probe failed: {err}"
    return None if done.returncode == 0 else f"the probe exited {done.returncode}: {done.stderr.decode()[-300:]}"


def works(mode: str) -> bool:
    """Whether ``mode`` can start a process on this machine (:func:`why_not` is None)."""
    return why_not(mode) is None


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []  # gone (or a kernel without the children file: then there is nothing to wait for here)


def _namespace_init(pid: int) -> int | None:
    """The host PID of the PID-namespace init below a sandbox's launcher ``pid`` (the first descendant in another
    PID namespace than this process), or None (the run already ended, or the mode has no PID namespace)."""
    try:
        ours = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    todo = [pid]
    for _ in range(4):  # launcher -> (bubblewrap's monitor) -> init: a few levels at most
        todo = [child for parent in todo for child in _children(parent)]
        for child in todo:
            try:
                if os.readlink(f"/proc/{child}/ns/pid") != ours:
                    return child
            except OSError:
                continue  # ended while looked at
    return None


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def launch(mode: str, source: str, tmpfs_bytes: int, *, pass_fds: tuple[int, ...] = (),
           **popen) -> tuple[subprocess.Popen, int | None]:
    """Start Python ``source`` contained by ``mode`` (:func:`command`; ``popen``: more :class:`subprocess.Popen`
    arguments). Returns the launcher and, for ``bwrap+audit``, the read end of a pipe holding bubblewrap's
    ``--info-fd`` report; hand both to :func:`kill_run`, which closes it.

    Why the report: bubblewrap's monitor (the launcher) exits as soon as the program does, while the kernel is
    still killing the rest of the namespace (its init passes the exit code up through an eventfd and only then
    exits), so after the launcher's end nothing links it to the init any more; the report names the init's PID."""
    if mode != "bwrap+audit":
        return subprocess.Popen(command(mode, source, tmpfs_bytes), pass_fds=pass_fds, **popen), None
    read, write = os.pipe()
    try:
        proc = subprocess.Popen(command(mode, source, tmpfs_bytes, info_fd=write), pass_fds=(*pass_fds, write),
                                **popen)
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)  # bubblewrap holds its own end
    return proc, read


def _reported_init(info: int) -> int | None:
    """The namespace init's host PID from bubblewrap's ``--info-fd`` report on pipe ``info`` (``{"child-pid": N,
    ...}``), or None when none was written (bubblewrap failed, or has not got that far)."""
    os.set_blocking(info, False)  # written once at the start; the namespace's processes may hold the write end
    try:
        return int(json.loads(os.read(info, 65536))["child-pid"])
    except (BlockingIOError, ValueError, KeyError, TypeError):
        return None


def kill_run(proc: subprocess.Popen, info: int | None = None, wait_s: float = 10.0) -> None:
    """SIGKILL a sandbox's launcher ``proc`` and its process group, and wait until its PID namespace (if any) is
    gone: an init's exit is complete only after the kernel has killed and reaped every process of its namespace,
    so no process of the run is left when this returns. The init is the one bubblewrap reported on ``info``
    (:func:`launch`; closed here), else the first descendant of the launcher in another PID namespace; it is
    killed by PID only while the launcher, its parent, is alive (after that it may be reaped and the PID reused;
    the launcher's death sends it SIGKILL anyway: ``--die-with-parent``, ``unshare --kill-child``). The ``audit``
    mode's launcher (a subreaper) gets SIGTERM first, and ``wait_s`` to clear what it holds. ``wait_s``: the most
    seconds to wait for either."""
    try:
        init = (_reported_init(info) if info is not None else None) or _namespace_init(proc.pid)
    finally:
        if info is not None:
            os.close(info)
    if init is not None and proc.poll() is None:
        try:
            os.kill(init, signal.SIGKILL)  # the launcher is its parent and alive: not reaped, so the PID is the init's
        except ProcessLookupError:
            pass  # the init exited and its launcher reaped it between the two checks (make test, 2026-12-06)
    if init is None and proc.poll() is None:
        proc.terminate()  # the reaper (or a namespace launcher that already lost its init) clears its children
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass  # killed below
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the launcher and what stayed in its group
    except ProcessLookupError:
        pass  # already gone with all its group
    proc.wait()
    deadline = time.monotonic() + wait_s
    while init is not None and not _ended(init) and time.monotonic() < deadline:
        time.sleep(0.01)
