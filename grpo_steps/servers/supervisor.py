"""The supervisor of a ``local`` generation server: ``python -m grpo_steps.servers.supervisor
--owner-pid PID --owner-started T --grace-s S -- COMMAND...``.

It runs COMMAND (the vLLM server) in its own process group and stops it when it is told to (SIGTERM,
SIGINT) or when the owner process (the Metaflow runtime, known by PID and create time) has been gone
for ``grace_s`` seconds, so a crashed or killed run leaves no server behind. A separate module: the
package's ``__init__`` does not import it, so ``python -m`` runs it cleanly.

With ``--cpu-cores 0,1`` the supervisor and the server (every process and thread it starts) run on those cores only
(:func:`os.sched_setaffinity`, inherited): a ``local`` server's ``generation.server.cpu_cores``.

With ``--log PATH`` the server's output goes through this process into PATH, rotated by size
(:class:`logging.handlers.RotatingFileHandler`): past :data:`LOG_MAX_BYTES` the file becomes ``PATH.1`` (the one
before is dropped) and a new PATH starts, so a server that runs for days holds at most twice that on disk.
"""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import signal
import subprocess
import sys
import threading
import time

from grpo_steps.processes import ProcessRef, wait_until

LOG_MAX_BYTES = 64 * 1024 * 1024
"""Size of a server log past which it is rotated (``--log-max-bytes``); one older file is kept."""


def _pump_log(stream, path: str, max_bytes: int) -> None:
    """Copy ``stream`` (the server's output) into ``path``, rotated past ``max_bytes``, line by line (a line is cut at
    64 KiB), until it ends."""
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=1, encoding="utf-8",
                                                   errors="replace")
    handler.terminator = ""  # each line keeps its own newline
    try:
        for line in iter(lambda: stream.readline(65536), b""):
            handler.emit(logging.makeLogRecord({"msg": line.decode(errors="replace")}))
    finally:
        handler.close()


def supervise(owner: ProcessRef, grace_s: float, cmd: list[str], log: str | None = None,
              log_max_bytes: int = LOG_MAX_BYTES) -> int:
    """Run ``cmd`` in its own process group until it exits, SIGTERM/SIGINT arrives, or ``owner`` is gone
    for ``grace_s`` seconds; then stop the group (SIGTERM, SIGKILL after 15 s). ``log``: the file its output goes
    to, rotated past ``log_max_bytes`` (None: its output is this process's). Returns the exit code."""
    stopping = []
    for signum in (signal.SIGTERM, signal.SIGINT):  # before the child exists: a stop never orphans it
        signal.signal(signum, lambda *_: stopping.append(True))
    child = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE if log else None,
                             stderr=subprocess.STDOUT if log else None)
    pump = threading.Thread(target=_pump_log, args=(child.stdout, log, log_max_bytes), daemon=True) if log else None
    if pump:
        pump.start()
    gone_since: list[float] = []

    def should_stop() -> bool:
        if child.poll() is not None or stopping:
            return True
        if owner.is_running():
            gone_since.clear()
        elif not gone_since:
            gone_since.append(time.monotonic())
        return bool(gone_since) and time.monotonic() - gone_since[0] >= grace_s

    wait_until(should_stop, timeout_s=float("inf"), interval_s=1.0)
    if child.poll() is None:
        if gone_since:
            print(f"[supervisor] owner process {owner.pid} is gone: stopping the vLLM server", flush=True)
        os.killpg(child.pid, signal.SIGTERM)  # the server leads its own group
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    if pump:
        pump.join(timeout=5)  # the rest of the server's output (a process it left may hold the pipe: not forever)
    return child.returncode or 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description="Supervise a generation server: ARGS -- COMMAND...")
    parser.add_argument("--owner-pid", type=int, required=True)
    parser.add_argument("--owner-started", type=float, required=True, help="the owner's create time (psutil)")
    parser.add_argument("--grace-s", type=float, default=60.0)
    parser.add_argument("--log", help="file the server's output goes to, rotated by size")
    parser.add_argument("--log-max-bytes", type=int, default=LOG_MAX_BYTES)
    parser.add_argument("--cpu-cores", help="comma-separated cores the server runs on (default: this process's)")
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1 :]
    if not cmd:
        parser.error("give the server command after --")
    if args.cpu_cores:  # before the server starts: it and all it starts inherit the affinity
        os.sched_setaffinity(0, {int(core) for core in args.cpu_cores.split(",")})
    sys.exit(supervise(ProcessRef(args.owner_pid, args.owner_started), args.grace_s, cmd, args.log,
                       args.log_max_bytes))


if __name__ == "__main__":
    main()
