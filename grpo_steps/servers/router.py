"""The router in front of several generation replicas: vLLM's own ``vllm-router`` (PyPI; Rust), started by the
pipeline as a child process on this machine under the same supervisor as a ``local`` server (it stops itself when the
flow's process is gone), or the router you run (``generation.server.router.endpoint``).

Rollouts and evaluation reach the replicas through it (``/v1/completions``; the ``Authorization`` header is passed on
to the replica, whose middleware checks the run's token); the pipeline's control calls (weight reloads, labels, LoRA
adapters) go to each replica directly. Its Prometheus metrics (requests per replica,
``vllm_router_processed_requests_total{worker=...}``) are served on a second port of 127.0.0.1.

Its admin routes (``/add_worker``, ``/remove_worker``, ``/workers``) take no token, and it passes the client's token on
to every worker: whoever reaches it could add a worker and receive the token and every rollout, and loopback is not
private on a shared host. So the router the pipeline starts runs in a network namespace of its own, reached only
through :mod:`grpo_steps.servers.router_bridge` (the run's token required, admin routes refused);
``generation.server.router.private_network: false`` turns that off where no namespace can be made.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from grpo_steps.processes import PortInUseError, ProcessRef, log_tail, open_private, pick_port, private_dir, wait_until
from grpo_steps.servers import auth, router_bridge
from grpo_steps.servers.base import GenerationServer, ServerStartError, is_healthy
from grpo_steps.servers.local import LOG_DIR_NAME, LocalServer
from grpo_steps.servers.process_variables import allowed_variables

if TYPE_CHECKING:
    from grpo_steps.config import PipelineConfig


def router_command(worker_urls: list[str], host: str, port: int, *, policy: str, health_check_interval_s: int,
                   metrics_port: int, metrics_host: str = "127.0.0.1") -> list[str]:
    """The ``vllm-router`` command line (as a module of this interpreter: the console script's path differs between
    installs)."""
    return [sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--health-check-interval-secs", str(health_check_interval_s),
            "--health-failure-threshold", "2",  # a dead replica leaves the rotation after two failed checks
            "--prometheus-host", metrics_host, "--prometheus-port", str(metrics_port)]


def bridged_router_command(worker_urls: list[str], host: str, port: int, *, policy: str, health_check_interval_s: int,
                           metrics_port: int) -> list[str]:
    """The command of a router in a private network namespace behind :mod:`grpo_steps.servers.router_bridge`:
    clients reach it at ``host:port`` with the run's token (``GRPO_SERVER_TOKEN`` in the bridge's process variables),
    its metrics at ``127.0.0.1:metrics_port``."""
    inner = router_command(router_bridge.inside_urls(worker_urls), router_bridge.ROUTER_HOST, router_bridge.ROUTER_PORT,
                           policy=policy, health_check_interval_s=health_check_interval_s,
                           metrics_port=router_bridge.ROUTER_METRICS_PORT, metrics_host=router_bridge.ROUTER_HOST)
    workers = [arg for url in worker_urls for arg in ("--worker", url)]
    return [sys.executable, "-m", "grpo_steps.servers.router_bridge", "--host", host, "--port", str(port),
            "--metrics-port", str(metrics_port), *workers, "--", *inner]


@dataclass(frozen=True)
class LocalRouter(LocalServer):
    """A ``vllm-router`` process the pipeline runs on this machine under its supervisor (the fields of
    :class:`LocalServer`: supervisor, owner, log)."""

    metrics_endpoint: str | None = None
    """Its Prometheus metrics, e.g. ``http://127.0.0.1:29000/metrics``."""

    provider = "local-router"

    def summary(self) -> str:
        return f"{self.endpoint} supervisor_pid={self.supervisor_pid} log={self.log_path} (router)"

    def __str__(self) -> str:
        return f"vllm-router {self.endpoint}"


@dataclass(frozen=True)
class ExternalRouter(GenerationServer):
    """The router you run (``generation.server.router.endpoint``): health-checked, never stopped."""

    provider = "external-router"
    replaceable = False

    def __str__(self) -> str:
        return f"external router {self.endpoint}"


def start_router(cfg: PipelineConfig, worker_urls: list[str], *, owner: ProcessRef, token: str | None,
                 log_dir: str | Path | None = None) -> LocalRouter:
    """Start ``vllm-router`` on ``generation.server.host`` in front of ``worker_urls`` and wait until it answers
    ``/health``; clients of its endpoint present ``token`` (the replicas' token; None: none). With
    ``generation.server.router.private_network`` (the default) the router runs in a network namespace of its own
    behind :mod:`grpo_steps.servers.router_bridge`, which admits only clients that present ``token`` and refuses the
    admin routes.

    Raises:
        ServerStartError: port in use, the router exited, or no health within
            ``generation.server.startup_timeout_s`` seconds (also where no private network namespace can be made:
            the log tail says how to allow one); carries its log tail. Nothing is left running.
    """
    server_cfg, gen = cfg.generation.server, cfg.generation
    try:
        port = pick_port(server_cfg.host, server_cfg.router.port)
        metrics_port = pick_port("127.0.0.1", 0)
    except PortInUseError as err:
        raise ServerStartError(str(err).replace("generation.server.port", "generation.server.router.port")) from None
    log_path = Path(log_dir or private_dir(LOG_DIR_NAME)) / f"router-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = bridged_router_command if server_cfg.router.private_network else router_command
    cmd = command(worker_urls, server_cfg.host, port, policy=gen.router_policy(cfg.multi_turn),
                  health_check_interval_s=server_cfg.router.health_check_interval_s, metrics_port=metrics_port)
    supervisor = [sys.executable, "-m", "grpo_steps.servers.supervisor", "--owner-pid", str(owner.pid),
                  "--owner-started", repr(owner.started), "--grace-s", str(server_cfg.orphan_grace_s),
                  "--log", str(log_path), "--", *cmd]
    env = allowed_variables()  # the router reads no S3 and no Hub, and never sees the MLflow credentials
    if token:
        env[auth.TOKEN_ENV] = token  # the bridge admits the clients that present it (the router never sees it)
    with open_private(log_path, "ab") as log:  # never through a planted link
        proc = subprocess.Popen(supervisor, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    ref = ProcessRef.of(proc.pid)
    router = LocalRouter(f"http://{server_cfg.host}:{port}", model="vllm-router", supervisor_pid=ref.pid,
                         supervisor_started=ref.started, owner_pid=owner.pid, owner_started=owner.started,
                         log_path=str(log_path), metrics_endpoint=f"http://127.0.0.1:{metrics_port}/metrics")
    if token:
        auth.save_token(router.endpoint, token)  # the run's clients of the router present the replicas' token
    if wait_until(lambda: proc.poll() is not None or is_healthy(router.endpoint), server_cfg.startup_timeout_s,
                  interval_s=0.5) and proc.poll() is None:
        return router
    router.stop()
    raise ServerStartError(f"vllm-router did not become healthy (exit code {proc.poll()}); generation.server.router. "
                           f"Log {log_path}, last lines:\n{log_tail(log_path)}")


def reach_router(cfg: PipelineConfig) -> ExternalRouter:
    """The router you run at ``generation.server.router.endpoint``, once it answers ``/health``.

    Raises:
        ServerStartError: no ``/health`` within ``generation.server.startup_timeout_s`` seconds.
    """
    endpoint, timeout_s = cfg.generation.server.router.endpoint, cfg.generation.server.startup_timeout_s
    if not wait_until(lambda: is_healthy(endpoint), timeout_s, interval_s=1.0):
        raise ServerStartError(f"the router {endpoint} (generation.server.router.endpoint) did not answer GET /health "
                               f"within {timeout_s:.0f} s: start it, or correct the endpoint")
    return ExternalRouter(endpoint)


def requests_per_replica(metrics_endpoint: str | None, timeout_s: float = 5.0) -> dict[str, float]:
    """The router's count of requests each replica processed (``vllm_router_processed_requests_total``, by replica
    URL); {} when it has no metrics endpoint or does not answer."""
    if not metrics_endpoint:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = requests.get(metrics_endpoint, timeout=timeout_s).text
    except requests.RequestException:
        return {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm_router_processed_requests_total":
                counts[sample.labels["worker"]] = sample.value
    return counts
