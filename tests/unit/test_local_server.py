"""The ``local`` provider's process handling, with a stand-in command instead of vLLM (real processes,
real signals): the orphan guard of the supervisor, stop by recorded PID and create time, ports."""

import os
import socket
import subprocess
import sys

import psutil
import pytest

from grpo_steps.processes import ProcessRef, pick_port, wait_until
from grpo_steps.servers import LocalServer, ServerStartError
from grpo_steps.servers.local import start_local


def _start_supervisor(owner: ProcessRef, grace_s: float) -> tuple[subprocess.Popen, LocalServer]:
    cmd = [sys.executable, "-m", "grpo_steps.servers.supervisor", "--owner-pid", str(owner.pid),
           "--owner-started", repr(owner.started), "--grace-s", str(grace_s), "--",
           sys.executable, "-c", "import time; time.sleep(600)"]
    proc = subprocess.Popen(cmd, start_new_session=True)
    assert wait_until(lambda: psutil.Process(proc.pid).children(), timeout_s=10, interval_s=0.1)
    ref = ProcessRef.of(proc.pid)
    return proc, LocalServer("http://127.0.0.1:1", supervisor_pid=ref.pid, supervisor_started=ref.started)


def _server_process(supervisor: subprocess.Popen) -> ProcessRef:
    (child,) = psutil.Process(supervisor.pid).children()
    return ProcessRef(child.pid, child.create_time())


def test_server_stops_itself_when_the_owner_process_is_gone():
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    supervisor, server = _start_supervisor(ProcessRef.of(owner.pid), grace_s=1.0)
    child = _server_process(supervisor)
    try:
        owner.kill()
        owner.wait()
        assert child.wait_gone(20), "the server outlived its owner"
        assert supervisor.wait(timeout=20) is not None
    finally:
        server.stop()


def test_an_owner_pid_recycled_by_another_process_counts_as_gone():
    # the owner's PID is alive, but with another create time: a different process that reuses the PID
    me = ProcessRef.of(os.getpid())
    supervisor, server = _start_supervisor(ProcessRef(me.pid, me.started - 100.0), grace_s=0.5)
    child = _server_process(supervisor)
    try:
        assert child.wait_gone(20), "the server outlived an owner whose PID another process now holds"
        assert supervisor.wait(timeout=20) is not None
    finally:
        server.stop()


def test_stop_by_recorded_pid_stops_supervisor_and_server():
    supervisor, server = _start_supervisor(ProcessRef.of(os.getpid()), grace_s=60)
    child = _server_process(supervisor)
    assert server.stop() is True
    assert server.supervisor.wait_gone(5) and child.wait_gone(20)
    assert server.stop() is False  # stopping twice is harmless


def test_stop_never_signals_a_pid_that_now_belongs_to_another_process():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = psutil.Process(other.pid).create_time()
        stale = LocalServer("http://127.0.0.1:1", supervisor_pid=other.pid, supervisor_started=started - 50.0)
        assert stale.stop() is False  # e.g. a PID recycled since an old run recorded it
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_port_in_use_is_a_clear_error(tmp_path):
    from grpo_steps.config import ServerConfig

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_local("model", ServerConfig(port=port), max_model_len=64, dtype="float32",
                        owner=ProcessRef.of(os.getpid()), log_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing started, no log written


def test_port_zero_picks_a_free_port():
    assert pick_port("127.0.0.1", 0) > 0
