"""``s3`` weight sync (rank 0 of the training process): each push a version of a checked chain in S3, loaded by every
replica through vLLM's weight-update protocol.

Rank 0 publishes the policy's weights, in the serving dtype and under the names a checkpoint file holds
(:func:`grpo_steps.weights.files.checkpoint_state_dict`), as version N of the run's
:class:`grpo_steps.weights.publisher.ChainPublisher` (a full anchor every ``generation.s3_sync.anchor_every`` versions,
XOR+zstd deltas against the last committed version in between; the manifest last). Every replica is told to prefetch it
(a background fetch while it still generates), then loads it: ``/start_weight_update`` -> ``/update_weights {"s3": ...,
"version": N, "sha256": ...}`` (:class:`grpo_steps.weights.update.WeightUpdate`) -> ``/finish_weight_update
{"weight_version": "step-N"}`` (:meth:`grpo_steps.servers.client.VLLMClient.update_weights`; the replica's
:class:`grpo_steps.vllm_worker.PipelineTransferEngine` fetches only the deltas after the version it holds, or replays
from the anchor when it holds none of them, and checks every tensor's checksum before loading anything).
:class:`grpo_steps.training.generation.push.VerifiedPush` then checks every replica's label and probe; only then is the
version committed (the base of the next delta) and the versions before its anchor deleted. The run's prefix is removed
when training ends (:meth:`ChainTransport.close`) and by the flow's ``end``
(:func:`grpo_steps.weights.publisher.remove_run_versions`).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpo_steps.servers.client import VLLMClient
from grpo_steps.weights.chain import ChainError
from grpo_steps.weights.labels import version_label
from grpo_steps.weights.manifest import checksums_digest
from grpo_steps.weights.publisher import ChainPublisher, PublishStats, publisher_of
from grpo_steps.weights.update import WeightUpdate


def lineage_of(manifest: dict) -> dict[str, str]:
    """What a registered model's tags say of the last version the servers loaded: its ``version``, the ``anchor`` its
    chain starts from, the ``deltas`` applied since, ``checksum`` (the manifest's per-tensor algorithm, e.g.
    ``blake3``) and ``sha256``, a SHA-256 digest of its per-tensor checksums (in name order; the same weights give
    the same digest whatever the chain). Every field comes from a manifest the trainer checked
    (:func:`grpo_steps.weights.chain.check_manifest`: ints and known names only)."""
    digest = checksums_digest({name: entry["checksum"] for name, entry in manifest["tensors"].items()})
    return {"version": str(manifest["version"]), "anchor": str(manifest["anchor"]), "deltas": str(manifest["depth"]),
            "checksum": manifest["checksum"], "sha256": digest}


@dataclass
class ChainTransport:
    """Rank 0's half of ``s3`` sync: :meth:`push` publishes and has every replica load, :meth:`committed` advances
    the baseline once the push is verified, :meth:`close` removes the run's versions.

    ``store``: :func:`grpo_steps.weights.chain.run_store`'s location; ``dtype``: the serving dtype (a
    ``torch.dtype``); ``anchor_every``: ``generation.s3_sync.anchor_every``. Anything a killed earlier attempt of the
    run left under the prefix is deleted first: this attempt's chain starts with an anchor.
    """

    client: VLLMClient
    store: dict
    dtype: object = None
    anchor_every: int = 10
    lineage_path: Path | None = None
    """Where the committed version's lineage is written (JSON, :func:`lineage_of`), for the registered model's tags."""
    chain: ChainPublisher = field(init=False)
    last: PublishStats | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.chain = publisher_of(self.store, anchor_every=self.anchor_every, dtype=self.dtype)
        removed = self.chain.delete_prefix()
        if removed:
            print(f"[weight-sync] removed {removed} objects under s3://{self.store['bucket']}/{self.store['prefix']}/ "
                  "left by an earlier attempt", file=sys.stderr)

    def push(self, state_dict: dict, version: int, model=None) -> dict[str, float]:
        """Publish ``state_dict`` (the policy's full state dict, rank 0; ``model`` the unwrapped policy it came from)
        as ``version`` and have every replica load it, labelled ``step-{version}``.

        Returns ``{"write_seconds", "reload_seconds"}`` (publish; prefetch + every replica's update, the slowest) and
        the chain's numbers: ``bytes`` (written to S3), ``raw_bytes``, ``density`` (fraction of elements changed),
        ``anchor`` (1.0 or 0.0), ``fetch_seconds`` and ``load_seconds`` (the slowest replica's, inside the update).

        Raises:
            grpo_steps.weights.chain.ChainStoreError: S3 failed after botocore's retries (names the key; nothing was
                loaded: the version is invisible without its manifest, or no replica was asked).
            GenerationServerError: a replica failed the update (e.g. a tensor refused twice by its checksum: that
                replica keeps the weights it served).
        """
        from grpo_steps.weights.files import checkpoint_state_dict

        start = time.perf_counter()
        self.last = self.chain.publish(checkpoint_state_dict(state_dict, model), version)
        published = time.perf_counter()
        # the manifest's digest rides in the request the run's token authenticates: a writer of the bucket cannot
        # swap the version the replicas load
        update = WeightUpdate.of_chain(self.store, version, self.last.sha256)
        replicas = self.client.replica_clients()
        for replica in replicas:  # each starts fetching while it may still be generating
            replica.prefetch_weights(update)
        self.client.each(lambda replica: replica.update_weights(update, version_label(version)))
        loaded = time.perf_counter()
        reports = [replica.update_report for replica in replicas]
        return {"write_seconds": published - start, "reload_seconds": loaded - published,
                "bytes": float(self.last.bytes), "raw_bytes": float(self.last.raw_bytes),
                "density": self.last.density, "anchor": float(self.last.anchor),
                "fetch_seconds": max(float(r.get("fetch_seconds", 0.0)) for r in reports),
                "load_seconds": max(float(r.get("load_seconds", 0.0)) for r in reports)}

    def committed(self, version: int) -> None:
        """Every replica serves ``version`` (verified): it becomes the next delta's base, and the versions it does not
        build on are deleted (S3 failures here are reported on stderr, not raised: the next retain deletes them)."""
        self.chain.commit(version)
        if self.lineage_path is not None:
            self.lineage_path.write_text(json.dumps(lineage_of(self.chain.reader.manifest(version, self.last.sha256))))
        try:
            self.chain.retain({version})
        except ChainError as err:
            print(f"[weight-sync] could not delete old weight versions: {err}", file=sys.stderr)

    def served_label(self, client: VLLMClient | None = None) -> str:
        """The weight label of the server of ``client`` (default: this push's; a replica's client with several),
        ``step-N`` after a loaded version N (``/weight_info``)."""
        return (client or self.client).weight_version()

    def close(self) -> None:
        """Delete the run's versions (the servers keep their weights in memory). An S3 failure is reported on stderr,
        not raised (this runs in a ``finally`` and must not hide the error that ended training; the flow's ``end``
        deletes the prefix again)."""
        try:
            self.chain.delete_prefix()
        except ChainError as err:
            print(f"[weight-sync] could not delete the run's weight versions: {err}", file=sys.stderr)
