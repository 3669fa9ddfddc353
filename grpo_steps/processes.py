"""Processes the pipeline starts on this machine (the local vLLM server's supervisor, the development
S3 server): each is known by PID *and* create time (psutil), so a recycled PID is never signalled,
and one polling helper, :func:`wait_until`, serves every wait. Scratch directories a process owns carry an owner
record (:func:`claim_dir`), so the next run removes those a killed process left (:func:`remove_orphan_dirs`).

A fixed name in a shared directory (the temporary directory, ``/dev/shm``) is a place another user of the host can
create first: every such name is per user (:func:`private_dir`: ``<name>-<uid>``, mode 0700, owner checked, never a
link), and files there are opened without following links (:func:`open_private`, :func:`read_private`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil


class PortInUseError(RuntimeError):
    """A configured port is already taken on its host."""


class UnsafePathError(RuntimeError):
    """A path this pipeline uses in a shared directory is not this user's own: a symbolic link, another file type
    than expected, or owned by another user (someone created it first)."""


def private_dir(name: str, parent: str | Path | None = None) -> Path:
    """This user's own directory ``parent/<name>-<uid>`` (default parent: the temporary directory), created with mode
    0700 when missing. Per-user names let two users' runs share a host (user B's run used to fail with
    PermissionError on the directory user A's run had created).

    Raises:
        UnsafePathError: the name exists as a symbolic link or a file, or as a directory of another user (planted:
            remove it as root, or point ``TMPDIR`` to a directory of your own).
    """
    path = Path(parent or tempfile.gettempdir()) / f"{name}-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)  # lstat: a planted link to another directory is refused, not followed
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise UnsafePathError(f"{path} is {kind}: the pipeline keeps its files there only in a directory of its own; "
                              "remove it, or point TMPDIR to a directory of your own")
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): another user "
                              "created it first; remove it (as root), or point TMPDIR to a directory of your own")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700, follow_symlinks=False)  # ours: made private again (a umask or an older run widened it)
    return path


def open_private(path: str | Path, mode: str = "ab"):
    """Open ``path`` (``mode``: ``"ab"``, ``"wb"``, ``"a"`` or ``"w"``) as a file object, created with mode 0600 when
    missing, never through a symbolic link (``O_NOFOLLOW``): a link planted at a log's or a lock's name would make
    this process append to, or truncate, the file it points to. ``w`` truncates only after the checks.

    Raises:
        UnsafePathError: ``path`` is a link, not a regular file, or another user's file.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO cannot hang
    if mode.startswith("a"):
        flags |= os.O_APPEND
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO):  # a link (O_NOFOLLOW), a FIFO without a reader
            raise UnsafePathError(f"{path} is a symbolic link or a FIFO, not a file of this pipeline: "
                                  "remove it") from None
        raise
    try:
        _check_own_file(fd, path)
        os.set_blocking(fd, True)
        if mode.startswith("w"):
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def _check_own_file(fd: int, path: str | Path) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{path} is not a regular file: remove it")
    if st.st_uid != os.getuid():
        raise UnsafePathError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): remove it")


def read_private(path: str | Path, limit_bytes: int = 1 << 20) -> str:
    """The text of ``path``, a regular file of this user, read without following a link and without blocking on a
    FIFO (a FIFO planted at a record's name hung every later step), at most ``limit_bytes`` bytes.

    Raises:
        FileNotFoundError: no such file.
        UnsafePathError: a link, a FIFO or another non-regular file, another user's file, or longer than
            ``limit_bytes``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link, not a file of this pipeline: remove it") from None
        raise
    with os.fdopen(fd, "rb") as file:
        _check_own_file(fd, path)
        data = file.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise UnsafePathError(f"{path} is longer than {limit_bytes} bytes: not a record of this pipeline")
    return data.decode(errors="replace")


@contextmanager
def locked_record(folder: str | Path, key: str):
    """An exclusive lock (``flock``) on ``folder/<key>.lock``, held inside the ``with``; yields the path of the record
    it guards, ``folder/<key>.json`` (read it with :func:`read_private`, write it with :func:`open_private`). Give a
    :func:`private_dir` as ``folder``. The lock file is opened without truncation and without following a link.

    Raises:
        UnsafePathError: the lock is a link, a FIFO or another user's file.
    """
    import fcntl

    with open_private(Path(folder) / f"{key}.lock", "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield Path(folder) / f"{key}.json"


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.5) -> bool:
    """Call ``predicate`` every ``interval_s`` seconds until it returns true or ``timeout_s`` seconds
    have passed (it is called once more at the deadline). Returns whether it became true.

    >>> wait_until(lambda: True, timeout_s=0)
    True
    >>> wait_until(lambda: False, timeout_s=0.05, interval_s=0.01)
    False
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(interval_s, left))


@dataclass(frozen=True)
class ProcessRef:
    """A process identified by ``pid`` and ``started``, its create time (seconds since the epoch, as
    psutil reports it): the pair stays unique when the kernel recycles the PID."""

    pid: int
    started: float

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        """The running process ``pid``. Raises ``psutil.NoSuchProcess`` when there is none."""
        return cls(pid, psutil.Process(pid).create_time())

    def process(self) -> psutil.Process | None:
        """The live process, or None when it has exited (a zombie counts as exited) or its PID now
        belongs to another process."""
        try:
            proc = psutil.Process(self.pid)
            if proc.create_time() != self.started or proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except psutil.NoSuchProcess:
            return None
        return proc

    def is_running(self) -> bool:
        return self.process() is not None

    def wait_gone(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the process to exit (reaped when it is our child).
        Returns True when it is gone."""
        proc = self.process()
        if proc is None:
            return True
        try:
            proc.wait(timeout_s)
        except psutil.TimeoutExpired:
            return not self.is_running()
        except psutil.NoSuchProcess:
            pass
        return True

    def stop_group(self, timeout_s: float = 30.0) -> bool:
        """Stop a process that leads its own session (started with ``start_new_session=True``):
        SIGTERM to it, then SIGKILL to its whole process group after ``timeout_s`` seconds.
        Returns True when it was running."""
        proc = self.process()
        if proc is None:
            return False
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            return False
        if not self.wait_gone(timeout_s):
            try:
                os.killpg(self.pid, signal.SIGKILL)  # its own session and group: ours to kill
            except ProcessLookupError:
                pass
            self.wait_gone(10.0)
        return True


def pick_port(host: str, port: int) -> int:
    """``port`` if it is free on ``host`` (a free one when 0).

    Raises:
        PortInUseError: ``port`` is already in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers do: connections of a stopped server in TIME_WAIT do not make the port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise PortInUseError(
                f"port {port} on {host} is already in use ({err.strerror}); set generation.server.port "
                "to a free port, or to 0 to pick one"
            ) from None
        return sock.getsockname()[1]


def log_tail(path: str | Path | None, lines: int = 40, max_bytes: int = 1024 * 1024) -> str:
    """Last ``lines`` lines of a log file ('' when there is none), reading at most its last ``max_bytes`` bytes
    (a server's log can be large: only the tail is read, never the whole file)."""
    if not path or not Path(path).exists():
        return ""
    with open(path, "rb") as file:
        size = file.seek(0, os.SEEK_END)
        window = 8192
        while True:  # widen the window from the end until it holds `lines` whole lines, or max_bytes
            start = max(0, size - min(window, max_bytes))
            file.seek(start)
            data = file.read(size - start)
            if start == 0 or data.count(b"\n") > lines or window >= max_bytes:
                break
            window *= 4
    text = data.decode(errors="replace").splitlines()
    return "\n".join(text[1:][-lines:] if start > 0 else text[-lines:])  # the first line may be cut: dropped


def run_watching_memory(cmd: list[str], env: dict[str, str] | None = None,
                        interval_s: float = 0.5) -> tuple[int, int]:
    """Run ``cmd`` to its end (output inherited) while sampling the resident memory of its whole process tree every
    ``interval_s`` seconds. Returns ``(exit code, peak bytes)``: the code as ``subprocess`` reports it (``-N``: killed
    by signal N); the peak is the largest sum of RSS over the process and its descendants seen by a sample (a spike
    shorter than ``interval_s`` can be missed). Interrupted while waiting, it kills the child first (as
    ``subprocess.run`` does)."""
    import subprocess
    import threading

    proc = subprocess.Popen(cmd, env=env)
    peak, done = [0], threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:  # the process has exited
                return
            rss = 0
            for member in tree:
                try:
                    rss += member.memory_info().rss
                except psutil.Error:  # a child exited between the listing and the read
                    continue
            peak[0] = max(peak[0], rss)
            done.wait(interval_s)

    sampler = threading.Thread(target=sample, name="memory-sampler", daemon=True)
    sampler.start()
    try:
        code = proc.wait()
    except BaseException:  # interrupted (Ctrl+C, the task stopped): take the child along, as subprocess.run does
        proc.kill()
        proc.wait()
        raise
    finally:
        done.set()
        sampler.join()
    return code, peak[0]


OWNER_FILE = "owner.json"
"""In a directory a process owns: ``{"pid": int, "started": float, "host": str}`` of that process."""


def claim_dir(directory: str | Path, pid: int | None = None) -> None:
    """Record process ``pid`` (default: this one) as the owner of ``directory`` (:data:`OWNER_FILE`)."""
    owner = ProcessRef.of(pid or os.getpid())
    with open_private(Path(directory) / OWNER_FILE, "w") as record:
        record.write(json.dumps({"pid": owner.pid, "started": owner.started, "host": socket.gethostname()}))


def remove_orphan_dirs(parent: Path, prefix: str) -> list[Path]:
    """Remove the directories ``parent/prefix*`` whose owning process has exited: a process killed with ``kill -9``
    cannot clean up, and RAM-backed ``/dev/shm`` keeps what it left (weights: 1.1-1.6 GB for SmolLM2-135M).
    Directories whose owner still runs, whose owner ran on another host (a pod writing to the same shared volume:
    its processes cannot be seen from here), or without a readable owner record (another run's directory a moment
    before it writes one), are kept. Only directories of this user are looked at (never a link, another user's
    directory, or a record that is not a small regular file of this user: a FIFO there hung every later step).
    Returns the removed directories."""
    removed = []
    for directory in sorted(Path(parent).glob(f"{prefix}*")):
        try:
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue  # a link, a file, or another user's directory: not ours to read or remove
            owner = json.loads(read_private(directory / OWNER_FILE, limit_bytes=4096))
            ref = ProcessRef(int(owner["pid"]), float(owner["started"]))
        except (OSError, ValueError, KeyError, TypeError, UnsafePathError):
            continue
        if owner.get("host", socket.gethostname()) != socket.gethostname():
            continue  # records written before hosts were recorded are this machine's
        if not ref.is_running():
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


SCRATCH_PREFIX = "grpo-scratch-"


@contextmanager
def scratch_dir(parent: str | Path | None = None):
    """A temporary directory owned by this process (:func:`claim_dir`) in ``parent`` (default: RAM-backed
    ``/dev/shm`` when present, else the temporary directory), removed on exit. First removes the scratch directories
    there whose owner has exited (a step killed with ``kill -9`` leaves its checkpoints behind:
    :func:`remove_orphan_dirs`)."""
    if parent is None:
        parent = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    for orphan in remove_orphan_dirs(parent, SCRATCH_PREFIX):
        print(f"[scratch] removed {orphan}: left by a process that no longer runs", flush=True)
    with tempfile.TemporaryDirectory(prefix=SCRATCH_PREFIX, dir=parent) as d:
        claim_dir(d)
        yield d
