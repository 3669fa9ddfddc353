"""The ``external`` provider: a vLLM server you already run, at ``generation.server.endpoint``.

The pipeline never starts or stops it: :meth:`ExternalServer.start` waits for its ``/health``
(up to ``generation.server.startup_timeout_s``), checks that it can take weight reloads (vLLM's dev
routes, ``VLLM_SERVER_DEV_MODE=1``) and reads the name it serves the model under. Weights reach it
like a local server's: ``reload_weights`` from directories this machine writes, so the server must
read the same paths (the same machine, or the same shared mount). Start one, e.g.::

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model PATH --port 8000

After a run it holds the weights evaluation loaded last: the run's trained policy.

Several servers behind a router (``generation.server.endpoints``): requests carry the first model name every replica
serves; start each replica with a name of its own first (``--served-model-name policy@a policy``) and the pipeline
knows which replica sampled each completion (:meth:`grpo_steps.servers.client.VLLMClient.replica_index`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import requests

from grpo_steps.processes import wait_until
from grpo_steps.servers.auth import auth_headers
from grpo_steps.servers.base import GenerationServer, ServerStartError, is_healthy, start_all
from grpo_steps.weights.server_flags import LOGPROBS_MODE, WEIGHT_TRANSFER_BACKEND, weight_transfer_args

if TYPE_CHECKING:
    from grpo_steps.config import PipelineConfig
    from grpo_steps.processes import ProcessRef


@dataclass(frozen=True)
class ExternalServer(GenerationServer):
    """A server the user runs; health-checked and fed weights, never stopped by the pipeline."""

    served_names: tuple[str, ...] = ()
    """The base model names it answers to (``/v1/models``), in its command line's order."""

    provider = "external"
    replaceable = False

    @classmethod
    def start(cls, cfg: PipelineConfig, model_path: str = "", *, owner: ProcessRef | None = None,
              run_id: str = "") -> ExternalServer:
        """Reach the server at ``generation.server.endpoint`` (``model_path``, ``owner`` and ``run_id``
        are not used: the server already serves its model).

        Raises:
            ServerStartError: no ``/health`` within ``generation.server.startup_timeout_s`` seconds, no
                dev routes (started without ``VLLM_SERVER_DEV_MODE=1``), no model served, or, when rollouts come
                from it (backend ``vllm``), logprobs of another kind than the sampled distribution's (started
                without ``--logprobs-mode processed_logprobs``).
        """
        return cls.reach(cfg, cfg.generation.server.endpoint)

    @classmethod
    def start_replicas(cls, cfg: PipelineConfig, model_path: str = "", *, owner: ProcessRef | None = None,
                       run_id: str = "") -> list[GenerationServer]:
        """Reach each server of ``generation.server.endpoints`` (in parallel; checks as :meth:`start`).

        Each replica's ``served_model`` becomes the first name all of them serve (requests through the router carry it).

        Raises:
            ServerStartError: as :meth:`start`, naming the replica; or the replicas serve no common model name.
        """
        endpoints = cfg.generation.server.endpoints or []
        members = start_all(lambda i: cls.reach(cfg, endpoints[i]), len(endpoints))
        common = [name for name in members[0].served_names if all(name in m.served_names for m in members)]
        if not common:
            listed = "; ".join(f"{m.endpoint}: {', '.join(m.served_names)}" for m in members)
            raise ServerStartError(f"the generation servers of generation.server.endpoints serve no common model name "
                                   f"({listed}): start each with --served-model-name <its own name> <common name>, "
                                   "e.g. policy@a policy")
        return [dataclasses.replace(member, served_model=common[0]) for member in members]

    @classmethod
    def start_router(cls, cfg: PipelineConfig, replicas: list[GenerationServer], *, owner: ProcessRef | None = None,
                     run_id: str = "") -> GenerationServer | None:
        """The router you run (``generation.server.router.endpoint``), else None: a ``vllm-router`` process the
        pipeline starts on this machine."""
        if cfg.generation.server.router.endpoint:
            from grpo_steps.servers.router import reach_router

            return reach_router(cfg)
        return None

    @classmethod
    def reach(cls, cfg: PipelineConfig, endpoint: str) -> ExternalServer:
        """The server at ``endpoint`` once it passes the checks of :meth:`start`."""
        timeout_s = cfg.generation.server.startup_timeout_s
        if not wait_until(lambda: is_healthy(endpoint), timeout_s, interval_s=1.0):
            raise ServerStartError(
                f"the external generation server {endpoint} (generation.server.endpoint) did not answer "
                f"GET /health within {timeout_s:.0f} s (generation.server.startup_timeout_s): start it, or "
                "correct the endpoint")
        try:
            headers = auth_headers(endpoint)  # the server's token from the environment, when it has one
            # vLLM answers its first /server_info after running collect_env: 5 s on an idle 2-core box, over 10 s
            # on a loaded one (a 10-s limit failed provision_vllm there); the health check above says it is up
            info = requests.get(f"{endpoint}/server_info", params={"config_format": "json"}, timeout=120,
                                headers=headers)
            models = requests.get(f"{endpoint}/v1/models", timeout=30, headers=headers)
        except requests.RequestException as err:
            raise ServerStartError(f"the external generation server {endpoint} stopped answering: {err}") from err
        if info.status_code == 401:
            raise ServerStartError(
                f"the external generation server {endpoint} refused the run's token (HTTP 401): set GRPO_SERVER_TOKEN "
                "(or VLLM_API_KEY) in the flow's environment to the value the server was started with")
        if info.status_code == 404:
            raise ServerStartError(
                f"the external generation server {endpoint} has no dev routes, so it cannot reload weights: "
                "start it with VLLM_SERVER_DEV_MODE=1 in its environment")
        served = [m["id"] for m in models.json().get("data", []) if m.get("parent") is None] if models.ok else []
        if not served:
            raise ServerStartError(f"the external generation server {endpoint} lists no model on GET /v1/models "
                                   f"(HTTP {models.status_code})")
        config = info.json().get("vllm_config") or {}
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if cfg.generation.async_ is not None and cfg.generation.async_.in_flight:
            from grpo_steps.servers.client import VLLMClient
            from grpo_steps.weights.server_flags import TOKEN_GENERATE_ARGS, TOKEN_GENERATE_PATH

            if backend != WEIGHT_TRANSFER_BACKEND or not VLLMClient(endpoint, served[0]).serves_token_generate():
                raise ServerStartError(
                    f"generation.async.in_flight is true, and the external generation server {endpoint} cannot update "
                    f"weights under requests in flight (it needs {TOKEN_GENERATE_PATH}, per-token weight versions, and "
                    "the pipeline's transfer engine): restart it with "
                    f"{' '.join(TOKEN_GENERATE_ARGS + weight_transfer_args())}"
                    ", or set generation.async.in_flight: null (pushes then wait for the request in flight)")
        model_config = config.get("model_config") or {}
        mode = model_config.get("logprobs_mode", "raw_logprobs")
        if cfg.generation.backend == "vllm" and mode != LOGPROBS_MODE:
            raise ServerStartError(
                f"the external generation server {endpoint} returns {mode} (its --logprobs-mode): rollouts need the "
                f"logprobs of the distribution it samples from (TRL's mismatch correction, the first-batch check); "
                f"restart it with --logprobs-mode {LOGPROBS_MODE}")
        if cfg.generation.pushes_through_s3 and backend != WEIGHT_TRANSFER_BACKEND:
            raise ServerStartError(
                f"the external generation server {endpoint} cannot load s3 weight pushes (its weight-transfer backend "
                f"is {backend!r}): restart it with {' '.join(weight_transfer_args())} (grpo_steps installed beside "
                "vLLM) and S3 credentials in its environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
        check_open(endpoint, cfg.generation.server.allow_unauthenticated)
        return cls(endpoint, served_model=served[0], served_names=tuple(served))

    def __str__(self) -> str:
        return f"external generation server {self.endpoint} (model {self.served_model!r})"


def check_open(endpoint: str, allowed: bool) -> bool:
    """Refuse a server at ``endpoint`` that answers a control route (``/server_info``) without the run's token:
    whoever reaches it can then load weights into it and choose the answers evaluation scores; with ``allowed``
    (``generation.server.allow_unauthenticated: true``) say so loudly (stderr) instead. Returns whether it is open.

    Raises:
        ServerStartError: the server is open and ``allowed`` is false; says how to close it.
    """
    import sys

    try:
        status = requests.get(f"{endpoint}/server_info", params={"config_format": "json"}, timeout=120).status_code
    except requests.RequestException:
        return False  # unreachable now: the next request says so
    if status != 200:
        return False
    fix = ("Start it with --middleware grpo_steps.servers.auth.RunTokenMiddleware and GRPO_SERVER_TOKEN in its "
           "environment (and the flow's)")
    if not allowed:
        raise ServerStartError(
            f"the external generation server {endpoint} answers without a token: anyone who reaches it can load "
            f"weights into it and choose the answers evaluation scores. {fix}; or, for a server nobody else can "
            "reach, set generation.server.allow_unauthenticated: true")
    print(f"[security] WARNING: the generation server {endpoint} answers without a token "
          f"(generation.server.allow_unauthenticated: true): anyone who reaches it can load weights into it and "
          f"choose the answers evaluation scores. {fix}", file=sys.stderr, flush=True)
    return True
