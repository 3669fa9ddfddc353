"""The generation server's settings (``generation.server``) and the router in front of its replicas
(``generation.server.router``): where the servers listen, who may reach them, the cores and GPUs they run on, and the
checks that keep a server's URL, arguments and interface free of credentials and open ports."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpo_steps.config.base import _Section, distinct_cores
from grpo_steps.redaction import credential_in, is_secret_flag, redact

RouterPolicy = Literal["consistent_hash", "round_robin", "power_of_two", "cache_aware"]


class RouterConfig(_Section):
    """The router in front of several generation replicas (``generation.server.replicas`` > 1): vLLM's own
    ``vllm-router`` (PyPI), started next to the replicas by the provider, or yours (``endpoint``). Rollouts and
    evaluation requests go through it; weight pushes go to every replica directly."""

    policy: RouterPolicy | Literal["auto"] = "auto"
    """``vllm-router --policy``: ``consistent_hash`` keeps every request of an episode (one ``X-Session-ID`` per group)
    on one replica, so multi-turn rollouts reuse its prefix cache; ``round_robin`` spreads requests evenly;
    ``power_of_two`` and ``cache_aware`` are the router's load- and cache-aware policies. ``auto``:
    ``consistent_hash`` with tools or an environment (multi-turn), else ``round_robin``."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the router the pipeline starts (on ``generation.server.host``); 0 picks a free one."""
    endpoint: str | None = None
    """Provider ``external``: base URL of the router you run in front of ``generation.server.endpoints``; null: the
    pipeline starts a ``vllm-router`` on 127.0.0.1 in front of them."""
    health_check_interval_s: int = Field(5, ge=1)
    """Seconds between the router's health checks of each replica (``--health-check-interval-secs``): a replica
    that stops answering ``/health`` gets no new requests after a few failed checks."""
    private_network: bool = True
    """The router the pipeline starts on this machine runs in a network namespace of its own, reached only through a
    bridge that requires the run's token and refuses the router's admin routes (``/add_worker``: whoever adds a worker
    receives the token and every rollout; loopback is not private on a shared host). Needs root or unprivileged user
    namespaces; false: the router listens on ``generation.server.host`` itself, open to every user of the host."""

    @field_validator("endpoint")
    @classmethod
    def _router_url(cls, value: str | None) -> str | None:
        return _base_url(value, "generation.server.router.endpoint")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback interface.

    >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, True, False)
    """
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback  # an IPv6 host may come bracketed, as in a URL
    except ValueError:
        return False


def _base_url(value: str | None, key: str) -> str | None:
    """A server's base URL without a trailing slash; raises ValueError naming ``key`` for credentials in the URL or
    another scheme than http(s)."""
    if value is None:
        return None
    if credential_in(value):
        raise ValueError(f"{key} {redact(value)!r} holds credentials ({credential_in(value)}): remove them; the "
                         "pipeline presents the server's token from the environment (GRPO_SERVER_TOKEN, or "
                         "VLLM_API_KEY for a server started with vLLM's --api-key)")
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{key} {value!r} must be a base URL such as http://127.0.0.1:8000")
    return value.rstrip("/")  # routes are appended as "/v1/..."


class ServerConfig(_Section):
    endpoint: str | None = None
    """Provider ``external``: base URL of the vLLM server you run, e.g. ``http://127.0.0.1:8000``
    (started with ``VLLM_SERVER_DEV_MODE=1``; it must read the weight directories this machine writes). With
    several replicas use ``endpoints`` instead."""
    replicas: int = Field(1, ge=1)
    """Generation replicas (vLLM servers) behind a router (``router``): ``local`` starts this many processes,
    ``kubernetes`` this many server pods; ``external`` takes them from ``endpoints``. Rollouts and evaluation spread
    over them; every weight push goes to each replica and is verified on each. 1: one server, no router."""
    endpoints: list[str] | None = None
    """Provider ``external`` with several replicas: the base URL of each vLLM server you run (weight pushes reach
    each directly; requests go through ``router.endpoint``, or a router the pipeline starts)."""
    router: RouterConfig = RouterConfig()
    """The router in front of the replicas (``replicas`` > 1 or ``endpoints``)."""
    host: str = "127.0.0.1"
    """Interface the local vLLM server (and the router the pipeline starts) binds to. Keep loopback unless the trainer
    runs elsewhere; another address needs ``remote_access: true``."""
    remote_access: bool = False
    """Declare that a non-loopback ``host`` is meant: the servers then answer every machine that reaches that
    interface (the run's token still guards each route but ``/health``, and travels in plain HTTP)."""
    allow_unauthenticated: bool = False
    """Provider ``external``: accept a server (or replica) that answers its control routes without the run's token.
    Refused by default: whoever reaches such a server can load weights into it and choose the answers evaluation
    scores. Start it with ``--middleware grpo_steps.servers.auth.RunTokenMiddleware`` and ``GRPO_SERVER_TOKEN``
    instead; set this only for a server nobody else can reach."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the local server; 0 picks a free one."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Seconds to wait for ``/health`` before failing (with the server's log tail for ``local``)."""
    kv_cache_gib: int = Field(2, ge=1)
    """KV-cache size of the CPU backend (``VLLM_CPU_KVCACHE_SPACE``), GiB."""
    enforce_eager: bool = True
    """Start with ``-O0`` (no compilation): 36-66 s instead of minutes on CPU."""
    extra_args: list[str] = Field(default_factory=list)
    """More ``vllm serve`` arguments, passed as is."""
    orphan_grace_s: float = Field(60.0, gt=0)
    """The server stops itself this many seconds after the flow process that owns it is gone."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one vLLM replica shards the model over (``--tensor-parallel-size``); 1 on CPU."""
    gpus: list[int] | None = None
    """Provider ``local`` on a GPU machine (docs/gpu.md): the GPU indices (``nvidia-smi``'s) the server runs on, its
    ``CUDA_VISIBLE_DEVICES``; the training processes get the machine's other GPUs, or share these when none is left
    (one GPU: set ``gpu_memory_utilization``). null: vLLM's default device, the trainer's own choice. ``start``
    refuses it without a GPU."""
    gpu_memory_utilization: float | None = Field(None, gt=0, lt=1)
    """Provider ``local`` on a GPU machine: the fraction of each of the server's GPUs it takes for weights,
    activations and KV cache (``--gpu-memory-utilization``); null: vLLM's 0.9. On a GPU it shares with training,
    ``start`` checks that the trainer fits in the rest (docs/gpu.md)."""
    cpu_cores: list[int] | list[list[int]] | None = None
    """Provider ``local`` on CPU: the cores the server runs on (its supervisor sets the affinity of the whole server,
    every process and thread of it, a thread per core), e.g. ``[0]``; with several replicas a list per replica
    (``[[0], [1]]``) or one list split evenly among them; null: every core of the flow's process (split evenly among
    the replicas). With ``generation.async``, give the server and the trainer (``train.cpu_cores``) cores of their
    own, as disaggregated GPUs are: see docs/benchmarks.md "Asynchronous GRPO" for the layouts measured."""

    @field_validator("cpu_cores")
    @classmethod
    def _cores_distinct(cls, value: list[int] | list[list[int]] | None) -> list[int] | list[list[int]] | None:
        if value and isinstance(value[0], list):  # a list per replica: no core shared between two replicas
            distinct_cores([c for cores in value for c in cores], "generation.server.cpu_cores")
            if any(not cores for cores in value):
                raise ValueError(f"generation.server.cpu_cores {value}: every replica needs at least one core")
            return value
        return distinct_cores(value, "generation.server.cpu_cores")

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_urls(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        urls = [_base_url(url, f"generation.server.endpoints[{i}]") for i, url in enumerate(value)]
        if len(urls) < 2 or len(set(urls)) != len(urls):
            raise ValueError(f"generation.server.endpoints {urls} must list two or more distinct servers (one "
                             "server: generation.server.endpoint)")
        return urls

    @model_validator(mode="after")
    def _loopback_unless_declared(self) -> ServerConfig:
        if not is_loopback(self.host) and not self.remote_access:
            raise ValueError(f"generation.server.host {self.host!r} is not a loopback address: the local servers would "
                             "answer every machine that reaches it, and the run's token would cross the network in "
                             "plain HTTP; keep 127.0.0.1, or set generation.server.remote_access: true to mean it")
        return self

    @model_validator(mode="after")
    def _replicas_agree(self) -> ServerConfig:
        if self.endpoints is not None and self.replicas not in (1, len(self.endpoints)):
            raise ValueError(f"generation.server.replicas ({self.replicas}) differs from the "
                             f"{len(self.endpoints)} generation.server.endpoints: remove replicas (it is taken from "
                             "the list) or list as many endpoints")
        if self.endpoint is not None and self.endpoints is not None:
            raise ValueError("generation.server.endpoint and generation.server.endpoints both set: one server takes "
                             "endpoint; several take endpoints (and router.endpoint for a router you run)")
        if isinstance(self.cpu_cores, list) and self.cpu_cores and isinstance(self.cpu_cores[0], list) \
                and len(self.cpu_cores) != self.replica_count:
            raise ValueError(f"generation.server.cpu_cores lists cores for {len(self.cpu_cores)} replicas, not "
                             f"{self.replica_count} (generation.server.replicas): one list per replica, or one flat "
                             "list split evenly")
        return self

    @property
    def replica_count(self) -> int:
        """How many generation replicas the run has (``endpoints`` when given, else ``replicas``)."""
        return len(self.endpoints) if self.endpoints is not None else self.replicas

    def replica_cores(self, available: list[int]) -> list[list[int] | None]:
        """The cores of each replica: ``cpu_cores`` per replica, or that list (else ``available``, this process's
        cores) split into ``replica_count`` contiguous, near-equal parts; ``[None]`` for one replica without
        ``cpu_cores`` (every core of the flow's process).

        >>> ServerConfig(replicas=2).replica_cores([0, 1, 2])
        [[0, 1], [2]]
        >>> ServerConfig(replicas=2, cpu_cores=[[1], [0]]).replica_cores([0, 1])
        [[1], [0]]

        Raises:
            ValueError: fewer cores than replicas (names the numbers and the keys to change).
        """
        cores = self.cpu_cores
        if cores and isinstance(cores[0], list):
            return [list(c) for c in cores]
        n = self.replica_count
        if n == 1:
            return [list(cores) if cores else None]
        pool = list(cores) if cores else sorted(available)
        if len(pool) < n:
            where = "generation.server.cpu_cores" if cores else "this machine's cores available to the flow"
            raise ValueError(f"generation.server.replicas {n} needs at least one core per replica, but {where} "
                             f"give {len(pool)} ({pool}): lower generation.server.replicas or give more cores")
        size, extra = divmod(len(pool), n)  # the first `extra` replicas get one core more
        out, start = [], 0
        for i in range(n):
            end = start + size + (1 if i < extra else 0)
            out.append(pool[start:end])
            start = end
        return out

    @field_validator("endpoint")
    @classmethod
    def _endpoint_has_no_credentials(cls, value: str | None) -> str | None:
        if value is not None and credential_in(value):
            raise ValueError(f"generation.server.endpoint {redact(value)!r} holds credentials "
                             f"({credential_in(value)}): remove them; the pipeline presents the server's token "
                             "from the environment (GRPO_SERVER_TOKEN, or VLLM_API_KEY for a server started with "
                             "vLLM's --api-key)")
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args_hold_no_secret(cls, value: list[str]) -> list[str]:
        secret = [arg.split("=", 1)[0] if is_secret_flag(arg) else f"argument {i} ({credential_in(arg)})"
                  for i, arg in enumerate(value) if is_secret_flag(arg) or credential_in(arg)]  # never the value
        if secret:
            raise ValueError(f"generation.server.extra_args passes a secret inline ({', '.join(secret)}): "
                             "command lines reach logs and MLflow; give vLLM its key as VLLM_API_KEY in the "
                             "environment instead (a local server keeps the flow's VLLM_* variables)")
        return value

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"generation.server.endpoint {value!r} must be a base URL such as http://127.0.0.1:8000")
        return value.rstrip("/") if value else value
