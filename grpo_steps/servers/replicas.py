"""Several generation replicas behind one router (``generation.server.replicas`` > 1, or ``endpoints``).

:class:`ReplicaSet` is the handle the flow keeps: its ``endpoint`` is the router's (rollouts and evaluation requests
go there, :mod:`grpo_steps.servers.router`), ``replicas`` the handle of each replica (each a server of the configured
provider, stopped, checked and staged as that provider does), ``router`` the router's. Its client
(:meth:`ReplicaSet.client`) sends every control call (weight reloads, labels, LoRA adapters) to each replica directly
and in parallel (:meth:`grpo_steps.servers.client.VLLMClient.each`), so a push is complete only when every replica
serves it.

A replica that dies mid-run: the router stops sending it requests after two failed health checks
(``generation.server.router.health_check_interval_s``), and the next weight push fails on it, naming it with its log's
last lines: the train step's attempt fails, and ``@retry`` (or ``resume``) replaces the whole set
(:func:`grpo_steps.steps.ensure_server`) and continues from the newest checkpoint; every replica of the new set gets
the current weights from the first push, before any rollout is sampled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from grpo_steps.servers.auth import token_for
from grpo_steps.servers.base import GenerationServer
from grpo_steps.servers.client import VLLMClient
from grpo_steps.servers.router import start_router

if TYPE_CHECKING:
    from grpo_steps.config import PipelineConfig
    from grpo_steps.processes import ProcessRef


@dataclass(frozen=True)
class ReplicaSet(GenerationServer):
    """Generation replicas behind a router; ``endpoint`` is the router's."""

    replicas: tuple[dict[str, Any], ...] = ()
    """Each replica's handle (:meth:`GenerationServer.to_dict` of its provider's class)."""
    router: dict[str, Any] | None = None
    """The router's handle (:class:`grpo_steps.servers.router.LocalRouter`, or the one you run)."""
    policy: str = ""
    """The router's policy (``vllm-router --policy``)."""

    provider = "replicas"

    @property
    def members(self) -> list[GenerationServer]:
        """The replicas, in order."""
        from grpo_steps.servers import from_dict

        return [from_dict(dict(handle)) for handle in self.replicas]

    @property
    def router_server(self) -> GenerationServer:
        from grpo_steps.servers import from_dict

        return from_dict(dict(self.router or {}))

    replaceable = True
    """A set that no longer serves is provisioned again: what the pipeline runs is started anew, the servers (and the
    router) you run are reached again (failing, naming the one that does not answer)."""

    @property
    def runtime_lora(self) -> bool:  # type: ignore[override]
        return all(member.runtime_lora for member in self.members)

    @property
    def metrics_endpoint(self) -> str | None:
        """The router's Prometheus metrics URL, where the pipeline started the router."""
        return (self.router or {}).get("metrics_endpoint")

    @classmethod
    def start(cls, cfg: PipelineConfig, model_path: str, *, owner: ProcessRef, run_id: str) -> ReplicaSet:
        """Start (or reach) ``generation.server.replica_count`` replicas of ``generation.provider`` (in parallel),
        then the router in front of them (:meth:`GenerationServer.start_replicas`, ``start_router``).

        Raises:
            ServerStartError: a replica or the router did not start; nothing the pipeline started is left running.
        """
        from grpo_steps.servers import PROVIDERS

        provider = PROVIDERS[cfg.generation.provider]
        members = provider.start_replicas(cfg, model_path, owner=owner, run_id=run_id)
        try:
            router = provider.start_router(cfg, members, owner=owner, run_id=run_id) or start_router(
                cfg, [member.endpoint for member in members], owner=owner, token=token_for(members[0].endpoint))
        except BaseException:
            for member in members:
                member.stop()
            raise
        return cls(router.endpoint, served_model=members[0].served_model,
                   replicas=tuple(member.to_dict() for member in members), router=router.to_dict(),
                   policy=cfg.generation.router_policy(cfg.multi_turn))

    def stop(self) -> bool:
        """Stop the router, then every replica the pipeline started; True when something was stopped."""
        stopped = self.router_server.stop()
        for member in self.members:
            stopped = member.stop() or stopped
        return stopped

    def is_ready(self) -> bool:
        return self.router_server.is_ready() and all(member.is_ready() for member in self.members)

    def serves(self, owner: ProcessRef) -> bool:
        """The router and every replica can go on serving the run of ``owner`` (see :meth:`GenerationServer.serves`)."""
        return self.router_server.serves(owner) and all(member.serves(owner) for member in self.members)

    def stage_weights(self, weights_dir, label: str) -> str:
        """Where every replica reads ``weights_dir`` (the replicas share one provider, so one place serves all)."""
        return self.members[0].stage_weights(weights_dir, label)

    def client(self, timeout_s: float = 600.0) -> VLLMClient:
        """A client of the router whose control calls reach every replica (see :class:`VLLMClient`)."""
        members = self.members
        return VLLMClient(self.endpoint, model=self.served_model, timeout_s=timeout_s,
                          replicas=tuple(member.endpoint for member in members),
                          replica_logs=tuple(getattr(member, "log_path", None) for member in members),
                          capabilities=self.capabilities)

    def to_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def summary(self) -> str:
        members = "; ".join(member.summary() for member in self.members)
        return f"{self.router_server.summary()} policy {self.policy} -> {len(self.replicas)} replicas: {members}"

    def __str__(self) -> str:
        return f"{len(self.replicas)} generation replicas behind {self.router_server}"
