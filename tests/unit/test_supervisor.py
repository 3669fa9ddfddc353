"""The orphan guard of the local server, with a stand-in command (no vLLM): real processes, real signals."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from grpo_steps.vllm_server import ServerHandle, ServerStartError, pick_port, stop, wait_gone


def _child_pids(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _start_supervisor(owner_pid: int, grace_s: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "grpo_steps.vllm_server", "supervise", "--owner-pid", str(owner_pid),
           "--grace-s", str(grace_s), "--", sys.executable, "-c", "import time; time.sleep(600)"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + 10
    while not _child_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc


def test_server_stops_itself_when_the_owner_process_is_gone():
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    supervisor = _start_supervisor(owner.pid, grace_s=1.0)
    (server_pid,) = _child_pids(supervisor.pid)
    try:
        owner.kill()
        owner.wait()
        assert wait_gone(server_pid, 20), "the server outlived its owner"
        assert supervisor.wait(timeout=20) is not None
    finally:
        stop(ServerHandle("http://127.0.0.1:1", supervisor.pid, None, "m"))


def test_stop_by_recorded_pid_stops_supervisor_and_server():
    supervisor = _start_supervisor(os.getpid(), grace_s=60)
    (server_pid,) = _child_pids(supervisor.pid)
    assert stop(ServerHandle("http://127.0.0.1:1", supervisor.pid, None, "m").to_dict()) is True
    assert wait_gone(supervisor.pid, 5) and wait_gone(server_pid, 20)


def test_stop_of_a_server_that_is_gone_is_harmless():
    supervisor = _start_supervisor(os.getpid(), grace_s=60)
    os.killpg(supervisor.pid, signal.SIGKILL)
    supervisor.wait()
    assert stop({"supervisor_pid": supervisor.pid}) is False
    assert stop(None) is False


def test_port_in_use_is_a_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port {port} on 127.0.0.1 is already in use"):
            pick_port("127.0.0.1", port)


def test_port_zero_picks_a_free_port():
    assert pick_port("127.0.0.1", 0) > 0


def test_stop_never_signals_a_pid_that_is_not_our_supervisor():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert stop({"supervisor_pid": other.pid}) is False  # e.g. a recycled PID from an old run
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()
