"""A server's log on disk: rotated by size by its supervisor, and read from its end only."""

import os
import subprocess
import sys

from grpo_steps.processes import ProcessRef, log_tail


def _bytes_read() -> int:
    """Bytes this process has read through read(2) so far (``rchar`` of /proc/self/io)."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


def test_the_supervisor_rotates_a_server_log_by_size(tmp_path):
    """A server that writes 3 MiB of lines into a log capped at 1 MiB: the log and one older file stay, each within the
    cap (plus a line), and the newest lines are in the log."""
    log = tmp_path / "vllm-1.log"
    program = "import sys\nfor i in range(30000):\n    sys.stdout.write(f'line {i:06d} ' + 'x' * 90 + '\\n')\n"
    done = subprocess.run([sys.executable, "-m", "grpo_steps.servers.supervisor", "--owner-pid", str(os.getpid()),
                           "--owner-started", repr(ProcessRef.of(os.getpid()).started), "--log", str(log),
                           "--log-max-bytes", str(1024 * 1024), "--", sys.executable, "-c", program],
                          timeout=120, capture_output=True)
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["vllm-1.log", "vllm-1.log.1"]
    assert all(p.stat().st_size <= 1024 * 1024 + 200 for p in tmp_path.iterdir())
    assert log_tail(log, 1).startswith("line 029999 ")


def test_log_tail_reads_the_end_of_a_large_log_only(tmp_path):
    log = tmp_path / "big.log"
    with open(log, "wb") as file:
        file.write((b"y" * 1023 + b"\n") * 64 * 1024)  # 64 MiB
        file.write(b"".join(b"last %d\n" % i for i in range(50)))
    before = _bytes_read()
    tail = log_tail(log, 40)
    assert _bytes_read() - before < 2 * 1024 * 1024  # the old log_tail read all 64 MiB
    assert tail.splitlines() == [f"last {i}" for i in range(10, 50)]
    assert log_tail(tmp_path / "none.log") == ""
