"""Processes the pipeline starts on this machine (the local vLLM server's supervisor, the development
S3 server): each is known by PID *and* create time (psutil), so a recycled PID is never signalled,
and one polling helper, :func:`wait_until`, serves every wait. Scratch directories a process owns carry an owner
record (:func:`claim_dir`), so the next run removes those a killed process left (:func:`remove_orphan_dirs`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil


class PortInUseError(RuntimeError):
    """A configured port is already taken on its host."""


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


def log_tail(path: str | Path | None, lines: int = 40) -> str:
    """Last ``lines`` lines of a log file ('' when there is none)."""
    if not path or not Path(path).exists():
        return ""
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


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
    (Path(directory) / OWNER_FILE).write_text(json.dumps({"pid": owner.pid, "started": owner.started,
                                                          "host": socket.gethostname()}))


def remove_orphan_dirs(parent: Path, prefix: str) -> list[Path]:
    """Remove the directories ``parent/prefix*`` whose owning process has exited: a process killed with ``kill -9``
    cannot clean up, and RAM-backed ``/dev/shm`` keeps what it left (weights: 1.1-1.6 GB for SmolLM2-135M).
    Directories whose owner still runs, whose owner ran on another host (a pod writing to the same shared volume:
    its processes cannot be seen from here), or without a readable owner record (another run's directory a moment
    before it writes one), are kept. Returns the removed directories."""
    removed = []
    for directory in sorted(Path(parent).glob(f"{prefix}*")):
        try:
            owner = json.loads((directory / OWNER_FILE).read_text())
            ref = ProcessRef(int(owner["pid"]), float(owner["started"]))
        except (OSError, ValueError, KeyError, TypeError):
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
