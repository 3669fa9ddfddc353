"""One weight transport per ``generation.weight_sync``, behind one protocol (:class:`WeightTransport`), chosen once by
:func:`make_transport`, as TRL's ``trl/generation/`` puts one file per transport behind one client contract. Rank 0's
:class:`~grpo_steps.training.generation.push.VerifiedPush` drives whichever it is given: publish a version and have
every replica load it (``push``), read what a replica serves (``served_label``), advance the baseline once every
replica is verified (``committed``), clean up (``close``). Nothing else in the training process branches on the mode.

- ``disk``: :class:`~grpo_steps.training.generation.disk.DiskTransport` (full weights) or
  :class:`~grpo_steps.training.generation.disk.AdapterTransport` (``train.peft.push: adapter``);
- ``s3``: :class:`~grpo_steps.training.generation.s3.ChainTransport`;
- ``nccl`` is TRL's own server mode (generation and NCCL transfer inside TRL's trainer, chosen in
  :func:`grpo_steps.training.job.grpo_args` by :attr:`grpo_steps.config.GenerationConfig.trl_server_mode`), not a
  transport of this protocol: TRL's ``VLLMGeneration.sync_weights`` pushes, so an object here would do nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation.disk import AdapterTransport, DiskTransport, sync_root
from grpo_steps.training.generation.s3 import ChainTransport
from grpo_steps.training.job import WEIGHT_LINEAGE


class WeightTransport(Protocol):
    """How rank 0's pushes reach every replica of ``client``'s server."""

    client: VLLMClient

    def push(self, state_dict: dict, version: int, model=None) -> dict[str, float]:
        """Publish ``state_dict`` (the policy's full state dict; ``model`` the unwrapped policy) as ``version`` and
        have every replica load it, labelled ``step-{version}``. Returns ``write_seconds``, ``reload_seconds`` and
        the transport's own numbers (logged as ``weight_sync/<name>``). Raises GenerationServerError (a replica
        failed; it keeps the weights it served) or the transport's own error."""

    def served_label(self, client: VLLMClient | None = None) -> str:
        """The label of what the server of ``client`` (default: this transport's) serves now."""

    def committed(self, version: int) -> None:
        """Every replica serves ``version`` (label and probe verified)."""

    def close(self) -> None:
        """Remove what the pushes left (the servers keep their weights); never raises for a store or server that is
        gone (it runs in a ``finally``)."""


def make_transport(cfg, client: VLLMClient, output_dir: str, weight_store: dict | None = None) -> WeightTransport:
    """The transport of ``cfg`` (a :class:`grpo_steps.config.PipelineConfig` with ``generation.weight_sync`` ``disk``
    or ``s3``) for rank 0: the chain at ``weight_store`` (``s3``; its committed lineage written to
    ``output_dir/weight_lineage.json``), else a fresh :func:`~grpo_steps.training.generation.disk.sync_root`
    (``generation.sync_dir``, else under ``output_dir``): the adapter alone with ``train.peft.push: adapter``, else
    full weights.

    Raises:
        ValueError: ``s3`` without ``weight_store``, or a mode that is not a transport of this protocol (``nccl``).
    """
    gen = cfg.generation
    if not gen.pushes_to_server:  # nccl: TRL's own server mode, whose trainer pushes (GenerationConfig.trl_server_mode)
        raise ValueError(f"generation.weight_sync {gen.weight_sync!r} has no pipeline transport with backend "
                         f"{gen.backend!r} and mode {gen.mode!r} (nccl is TRL's own server mode: its trainer pushes)")
    if gen.pushes_through_s3:
        import torch

        if weight_store is None:
            raise ValueError("generation.weight_sync 's3' needs the run's S3 location (TrainJob.weight_store)")
        return ChainTransport(client, weight_store, dtype=getattr(torch, cfg.model.dtype),
                               anchor_every=gen.s3_sync.anchor_every, lineage_path=Path(output_dir) / WEIGHT_LINEAGE)
    root = sync_root(gen.sync_dir, output_dir)
    if cfg.train.peft is not None and cfg.train.peft.push == "adapter":
        return AdapterTransport(client, root, base_model=client.base_model)
    return DiskTransport(client, root)
