"""The interface every generation-server provider implements (see :mod:`grpo_steps.servers`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import requests

from grpo_steps.servers.capabilities import ServerCapabilities
from grpo_steps.servers.client import SERVED_MODEL_NAME, VLLMClient

if TYPE_CHECKING:
    from grpo_steps.config import PipelineConfig
    from grpo_steps.processes import ProcessRef


class ServerStartError(RuntimeError):
    """The generation server could not be started or reached; the message says why (for a local
    server: the tail of its log) and which config key to change."""


def is_healthy(endpoint: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET {endpoint}/health`` answers 200 within ``timeout_s`` seconds."""
    try:
        return requests.get(f"{endpoint}/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


@dataclass(frozen=True)
class GenerationServer:
    """A vLLM OpenAI-compatible server that serves rollouts and evaluation for one run.

    The dataclass fields are the handle the flow keeps as its ``server`` artifact (:meth:`to_dict`,
    :func:`grpo_steps.servers.from_dict`); a provider adds the fields it needs to stop or check it.
    """

    endpoint: str
    """Base URL, e.g. ``http://127.0.0.1:8000`` (no trailing slash)."""
    served_model: str = SERVED_MODEL_NAME
    """The model name requests carry (``--served-model-name``)."""
    capabilities: ServerCapabilities | None = None
    """What the server can do, asked once when it is provisioned (:func:`grpo_steps.servers.lifecycle.provision`,
    :meth:`~grpo_steps.servers.client.VLLMClient.probe_capabilities`) and read by every client of the handle. None on
    a handle recorded before it existed: a client then asks when it needs to. :meth:`to_dict` writes it as a dict,
    read back here."""

    def __post_init__(self) -> None:
        # a handle read back from its dict (from_dict) holds the record as a dict
        object.__setattr__(self, "capabilities", ServerCapabilities.from_record(self.capabilities))

    provider: ClassVar[str] = ""
    """``generation.provider`` value of this class."""
    replaceable: ClassVar[bool] = True
    """Whether the pipeline may start a new server when this one is gone (not for ``external``)."""
    runtime_lora: ClassVar[bool] = True
    """Whether LoRA adapters are loaded into it at run time (``/v1/load_lora_adapter``); otherwise the
    evaluation of a LoRA policy reloads base + adapter merged (``kubernetes``: started for NCCL sync)."""

    @classmethod
    def start(cls, cfg: PipelineConfig, model_path: str, *, owner: ProcessRef, run_id: str) -> GenerationServer:
        """Start (or, for ``external``, reach) the server and wait until it is ready.

        Args:
            model_path: local directory of the weights to serve first.
            owner: the process the run's servers belong to (the Metaflow runtime).
            run_id: the Metaflow run id (labels cluster objects).

        Raises:
            ServerStartError: not ready within ``generation.server.startup_timeout_s`` seconds.
        """
        raise NotImplementedError

    @classmethod
    def start_replicas(cls, cfg: PipelineConfig, model_path: str, *, owner: ProcessRef,
                       run_id: str) -> list[GenerationServer]:
        """Start (or reach) the ``generation.server.replica_count`` replicas of a :class:`ReplicaSet
        <grpo_steps.servers.replicas.ReplicaSet>`, each ready; arguments as :meth:`start`.

        Raises:
            ServerStartError: a replica did not start (those that did are stopped).
        """
        raise ServerStartError(f"generation.provider {cls.provider!r} does not run several replicas: set "
                               "generation.server.replicas to 1")

    @classmethod
    def start_router(cls, cfg: PipelineConfig, replicas: list[GenerationServer], *, owner: ProcessRef,
                     run_id: str) -> GenerationServer | None:
        """The router in front of ``replicas`` where the provider has its own way to run or reach one; None: a
        ``vllm-router`` process on this machine (:func:`grpo_steps.servers.router.start_router`).

        Raises:
            ServerStartError: the router did not start.
        """
        return None

    def stop(self) -> bool:
        """Stop the server if the pipeline started it; True when something was stopped."""
        return False

    def is_ready(self) -> bool:
        """True when the server answers its health check now."""
        return is_healthy(self.endpoint)

    def serves(self, owner: ProcessRef) -> bool:
        """Whether the run whose servers belong to ``owner`` can go on using this server (after
        ``@retry`` or ``resume``): by default, whether it is ready."""
        return self.is_ready()

    def stage_weights(self, weights_dir: str | Path, label: str) -> str:
        """A path of ``weights_dir`` the server can read for ``reload_weights`` (``label``: e.g.
        ``baseline``, ``trained``; :func:`grpo_steps.weights.staging.stage_update` chooses how evaluation stages a
        policy). Servers on this machine read it where it is."""
        return str(weights_dir)

    @property
    def metrics_endpoint(self) -> str | None:
        """The Prometheus metrics URL of the router in front of the replicas, where the pipeline started one (the
        replicas' own ``/metrics`` are at their endpoints); None otherwise."""
        return None

    def client(self, timeout_s: float = 600.0) -> VLLMClient:
        """A client for completions and weight reloads (``timeout_s`` per request, seconds)."""
        return VLLMClient(self.endpoint, model=self.served_model, timeout_s=timeout_s,
                          capabilities=self.capabilities)

    def to_dict(self) -> dict[str, Any]:
        """The handle as a plain dict (a Metaflow artifact), ``provider`` included."""
        return {"provider": self.provider, **dataclasses.asdict(self)}

    def summary(self) -> str:
        """One line for the log: the endpoint, what identifies the server, the provider."""
        return f"{self.endpoint} ({self.provider})"

    def __str__(self) -> str:
        return f"{self.provider} generation server {self.endpoint}"


def start_all(start_one: Callable[[int], GenerationServer], n: int) -> list[GenerationServer]:
    """``start_one(i)`` for i in 0..n-1 in parallel (the replicas of a
    :class:`~grpo_steps.servers.replicas.ReplicaSet`); returns the servers in order.

    Raises:
        ServerStartError: one or more failed (each failure listed); those that started are stopped first.
    """
    with ThreadPoolExecutor(n, thread_name_prefix="replica-start") as pool:
        futures = [pool.submit(start_one, i) for i in range(n)]
        errors = [f.exception() for f in futures]
    started = [f.result() for f, err in zip(futures, errors, strict=True) if err is None]
    failed = [(i, err) for i, err in enumerate(errors) if err is not None]
    if not failed:
        return started
    for server in started:
        server.stop()
    if any(not isinstance(err, ServerStartError) for _, err in failed):
        raise next(err for _, err in failed if not isinstance(err, ServerStartError))
    raise ServerStartError("; ".join(f"generation replica {i + 1}/{n}: {err}" for i, err in failed))
