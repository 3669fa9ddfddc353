"""The generation server behind rollouts and evaluation: one interface, three providers.

- ``local`` (:mod:`.local`): a child process on this machine under a supervisor; started and stopped
  by the pipeline, and it stops itself when the flow's process is gone. Weights: ``disk``, paths on
  this machine.
- ``kubernetes`` (:mod:`.kubernetes`): a Deployment + Service in the run's namespace (one per replica, behind a
  ``vllm-router`` Deployment, with several); started and stopped by the pipeline (on Argo also by the error exit
  hook). Weights: ``nccl`` in training, or ``disk`` pushes through the shared volume; evaluation weights staged on
  the shared volume.
- ``external`` (:mod:`.external`): a server you run at ``generation.server.endpoint``; never started
  or stopped by the pipeline, only health-checked. Weights: ``disk``, paths it can read (the same
  machine or the same mounts).

Each provider is a frozen dataclass subclassing :class:`GenerationServer`; its fields are the handle
the flow stores as the ``server`` artifact (:meth:`GenerationServer.to_dict`, :func:`from_dict`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_steps.processes import ProcessRef
from grpo_steps.servers.base import GenerationServer, ServerStartError, is_healthy
from grpo_steps.servers.client import SERVED_MODEL_NAME
from grpo_steps.servers.external import ExternalServer
from grpo_steps.servers.kubernetes import KubernetesRouter, KubernetesServer
from grpo_steps.servers.local import LocalServer
from grpo_steps.servers.replicas import ReplicaSet
from grpo_steps.servers.router import ExternalRouter, LocalRouter

__all__ = ["SERVED_MODEL_NAME", "ExternalServer", "GenerationServer", "KubernetesServer", "LocalServer",
           "PROVIDERS", "ReplicaSet", "ServerStartError", "from_dict", "is_healthy", "provision"]

PROVIDERS: dict[str, type[GenerationServer]] = {cls.provider: cls for cls in (LocalServer, KubernetesServer,
                                                                             ExternalServer)}
"""``generation.provider`` -> its class."""
HANDLES: dict[str, type[GenerationServer]] = {**PROVIDERS, **{cls.provider: cls for cls in (ReplicaSet, LocalRouter,
                                                                                           ExternalRouter,
                                                                                           KubernetesRouter)}}
"""A handle's ``provider`` -> the class that reads it (:func:`from_dict`)."""


def provision(cfg, model_path: str, *, owner: ProcessRef, run_id: str) -> GenerationServer:
    """Start (or reach) the server of ``generation.provider`` (see :meth:`GenerationServer.start`), or its replicas
    behind a router with ``generation.server.replicas`` > 1 (:meth:`ReplicaSet.start`).

    Raises:
        ServerStartError: as the provider's ``start``.
    """
    if cfg.generation.server.replica_count > 1:
        return ReplicaSet.start(cfg, model_path, owner=owner, run_id=run_id)
    return PROVIDERS[cfg.generation.provider].start(cfg, model_path, owner=owner, run_id=run_id)


def from_dict(handle: dict[str, Any]) -> GenerationServer:
    """The server of a handle written by :meth:`GenerationServer.to_dict` (keys a provider does not
    know, from another version of the pipeline, are ignored).

    Raises:
        ValueError: the handle names no known provider.
    """
    provider = handle.get("provider")
    if provider not in HANDLES:
        raise ValueError(f"server handle names provider {provider!r}; known: {sorted(HANDLES)}")
    cls = HANDLES[provider]
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in handle.items() if k in names})
