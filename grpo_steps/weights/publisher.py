"""The trainer's writer of the weight chain (:class:`ChainPublisher`): publish a version (an anchor or a XOR+zstd
delta against the committed baseline, the manifest last, its SHA-256 returned for the update request), commit it once
every replica serves it, and retention. It holds a reader (:class:`grpo_steps.weights.chain.WeightChain`, which cannot
publish) for the lineages retention walks, and writes through that reader's store. The layout, the encoding and the
measured reasons are in :mod:`grpo_steps.weights.chain`'s docstring.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpo_steps.weights.chain import Scratch, WeightChain, chain_of, in_order, int_array
from grpo_steps.weights.manifest import CHECKSUM, FORMAT, tensor_bytes, tensor_checksum

UPLOADS_QUEUED = 4
"""Data objects a publish holds at most while their PUTs are in flight or queued (2 uploader threads)."""


@dataclass(frozen=True)
class PublishStats:
    """What one :meth:`ChainPublisher.publish` wrote."""

    version: int
    sha256: str  # hex SHA-256 of the manifest's bytes: what an update request names (only the trainer knows it)
    anchor: bool  # a full anchor (else a delta against ``base``)
    base: int | None
    bytes: int  # bytes written to S3: data objects + manifest
    raw_bytes: int  # bytes of the tensors themselves in the serving dtype (what a full uncompressed push would be)
    density: float  # fraction of elements whose bits differ from the base (1.0 for an anchor)
    seconds: float  # wall time of the publish (encode + upload + manifest)


@dataclass
class _Baseline:
    version: int
    id: str
    anchor: int
    depth: int
    tensors: dict[str, Any]  # name -> contiguous CPU tensor in the serving dtype (a private copy)
    sha256: str = ""  # its manifest's digest



class ChainPublisher:
    """The publisher of the chain of weight versions under ``s3://bucket/prefix/``: :meth:`publish`, :meth:`commit`,
    :meth:`retain`, :meth:`delete_prefix`; :attr:`reader` is its :class:`~grpo_steps.weights.chain.WeightChain`.

    ``client``: a boto3 S3 client (:func:`~grpo_steps.weights.chain.make_client`). ``anchor_every``: K, a full anchor
    at least every K versions (the first publish of this object is always an anchor). ``dtype``: the serving dtype (a
    ``torch.dtype``) that tensors are cast to before encoding; None keeps them as given. ``level``: zstd level.
    ``object_bytes``: the most encoded bytes packed into one data object. ``threads``: threads that encode tensors at
    once; None: the machine's cores, at most 8.
    """

    def __init__(self, client, bucket: str, prefix: str, *, anchor_every: int = 10, dtype=None, level: int = 1,
                 object_bytes: int = 16 << 20, threads: int | None = None):
        if anchor_every < 1:
            raise ValueError(f"anchor_every must be >= 1, got {anchor_every}")
        self.reader = WeightChain(client, bucket, prefix, threads=threads)
        self.store, self.prefix, self.threads = self.reader.store, self.reader.prefix, self.reader.threads
        self.anchor_every, self.dtype, self.level, self.object_bytes = anchor_every, dtype, level, object_bytes
        self._committed: _Baseline | None = None
        self._pending: _Baseline | None = None
        self._spare: dict[str, Any] = {}  # a retired baseline's tensors: memory for the next private copy
        self._scratch = Scratch()  # XOR buffers kept between calls

    def check_access(self) -> None:
        """Write and delete one small object under the prefix, as a publisher must be able to (a ``HeadBucket`` alone
        was answered for wrong credentials by SeaweedFS).

        Raises:
            ChainStoreError: S3 refused or did not answer (names the key).
        """
        self.store.check_access()

    def publish(self, state_dict: dict, version: int) -> PublishStats:
        """Write version ``version`` of the weights ``state_dict`` (name -> tensor, any device): an anchor when there
        is no committed baseline or the baseline is K-1 deltas from its anchor, else a sparse delta against the
        committed baseline; the manifest last. The version is pending until :meth:`commit`; publishing again before
        that replaces it (the delta is again against the committed baseline, and the replaced version can no longer
        be committed).

        Tensors are encoded on ``threads`` threads (the copy, the XOR, zstd and the checksum all run without the GIL)
        and each data object is uploaded as soon as it is full, while the next tensors are encoded.

        Raises:
            ValueError: ``version`` is not above the committed baseline's, or the names/shapes/dtypes differ from it.
            ChainStoreError: an S3 call failed (the version is not visible: its manifest is not written).
        """
        from concurrent.futures import ThreadPoolExecutor

        import torch

        start = time.perf_counter()
        base = self._committed
        if base is not None and version <= base.version:
            raise ValueError(f"version {version} is not after the committed version {base.version}")
        anchor = base is None or base.depth + 1 >= self.anchor_every
        if not anchor and (state_dict.keys() != base.tensors.keys() or any(
                tuple(t.shape) != tuple(base.tensors[n].shape) or (self.dtype or t.dtype) != base.tensors[n].dtype
                for n, t in state_dict.items())):
            raise ValueError("the state dict's names, shapes or dtypes differ from the committed version's")
        # the private copy (the next delta's base must not move with the trainer's parameters) goes into the memory
        # of a retired baseline when one fits: fresh memory page-faults in at ~1 GB/s on this VM, a copy runs at ~5
        recycled = {**self._spare, **(self._pending.tensors if self._pending else {})}
        self._spare, self._pending = {}, None  # a version published again replaces the pending one

        def private(name: str, t):
            dtype, own = self.dtype or t.dtype, recycled.get(name)
            if own is None or own.dtype != dtype or own.shape != t.shape:
                own = torch.empty(t.shape, dtype=dtype)
            return own

        tensors = {name: private(name, t) for name, t in state_dict.items()}
        publish_id, algorithm = secrets.token_hex(6), CHECKSUM
        data = f"{self.prefix}data/{version:010d}-{publish_id}/"
        entries, objects, parts, puts, changed, numel, raw = {}, {}, [], [], 0, 0, 0
        pool, uploads = ThreadPoolExecutor(self.threads), ThreadPoolExecutor(2)

        def encode(name: str) -> tuple[dict, bytes, int]:
            return self._encode(state_dict[name], tensors[name], None if anchor else base.tensors[name], algorithm)

        def flush() -> None:
            key, body = f"{data}{len(objects):03d}.zst", b"".join(parts)
            objects[key] = len(body)
            # bounded: at most UPLOADS_QUEUED objects wait for their PUT (each up to object_bytes); the encoder
            # waits for the oldest beyond that, so a slow store holds back encoding, not memory
            waiting = [p for p in puts if not p.done()]
            if len(waiting) >= UPLOADS_QUEUED:
                waiting[0].result()
            puts.append(uploads.submit(self.store.put, key, body))
            parts.clear()

        try:
            size = 0
            for name, (entry, payload, moved) in in_order(pool, encode, list(tensors), 4 * self.threads):
                numel, changed = numel + tensors[name].numel(), changed + moved
                raw += len(tensor_bytes(tensors[name]))
                if payload:
                    if size and size + len(payload) > self.object_bytes:
                        flush()
                        size = 0
                    entry.update(key=f"{data}{len(objects):03d}.zst", offset=size, length=len(payload))
                    parts.append(payload)
                    size += len(payload)
                entries[name] = entry
                if any(p.done() and p.exception() for p in puts):
                    break  # an upload failed: raised below, without encoding the rest
            if parts:
                flush()
            for put in puts:
                put.result()
        finally:
            pool.shutdown(cancel_futures=True)
            uploads.shutdown(cancel_futures=True)
        manifest = {"format": FORMAT, "version": version, "id": publish_id, "checksum": algorithm,
                    "base": None if anchor else {"version": base.version, "id": base.id, "sha256": base.sha256},
                    "anchor": version if anchor else base.anchor, "depth": 0 if anchor else base.depth + 1,
                    "anchor_every": self.anchor_every, "created": time.time(), "objects": objects,
                    "tensors": entries}
        body = json.dumps(manifest).encode()
        digest = hashlib.sha256(body).hexdigest()
        self.store.put(self.store.manifest_key(version), body)  # last: from here on the version exists
        self._pending = _Baseline(version, publish_id, manifest["anchor"], manifest["depth"], tensors, digest)
        return PublishStats(version, digest, anchor, None if anchor else base.version,
                            sum(objects.values()) + len(body), raw, changed / max(numel, 1),
                            time.perf_counter() - start)

    def _encode(self, source, own, old, algorithm: str) -> tuple[dict, bytes, int]:
        """One tensor of a publish (on a pool thread): ``source`` copied into ``own`` (its private copy, the serving
        dtype), its checksum, and its payload: zstd of its bytes (``old`` None: an anchor) or of its XOR with ``old``
        (empty when nothing moved). Returns (manifest entry, payload, elements that moved)."""
        import torch
        import zstandard

        with torch.no_grad():
            own.copy_(source.detach())
        entry = {"dtype": str(own.dtype).removeprefix("torch."), "shape": list(own.shape),
                 "checksum": tensor_checksum(own, algorithm)}
        compressor = zstandard.ZstdCompressor(level=self.level)
        if old is None:
            entry["encoding"] = "zstd"
            return entry, compressor.compress(tensor_bytes(own)), own.numel()
        new = int_array(own)
        with self._scratch.like(new) as xor:
            np.bitwise_xor(new, int_array(old), out=xor)
            moved = int(np.count_nonzero(xor))
            entry["encoding"] = "xor-zstd" if moved else "same"
            return entry, compressor.compress(memoryview(xor.view(np.uint8))) if moved else b"", moved

    def commit(self, version: int) -> None:
        """Make the pending version ``version`` the baseline of the next delta (call when every replica serves it:
        NeMo-RL's commit-then-advance).

        Raises:
            ValueError: ``version`` is not the pending version.
        """
        if self._pending is None or self._pending.version != version:
            pending = self._pending.version if self._pending else None
            raise ValueError(f"version {version} is not the pending version (pending: {pending})")
        if self._committed is not None:  # its memory takes the next publish's private copy
            self._spare = self._committed.tensors
        self._committed, self._pending = self._pending, None

    # --- retention ---

    def retain(self, keep_versions) -> list[int]:
        """Delete every version not in ``keep_versions`` and not needed to rebuild one of them (their bases back to
        the anchor) nor the publisher's committed and pending versions; also every object under the prefix that no
        kept manifest names (orphans of a killed publish). Manifests go first, so a version disappears before its
        data. Call from the publisher between publishes. Returns the versions deleted. The lineages walked are
        bounded
        (:meth:`grpo_steps.weights.chain.WeightChain.lineage`), and authenticated for the publisher's own versions.

        Raises:
            ChainStoreError: an S3 call failed.
            ChainRefusedError: a kept version's lineage breaks a bound or a digest.
        """
        own = {b.version: b.sha256 for b in (self._committed, self._pending) if b}
        keep = {int(v) for v in keep_versions} | set(own)
        visible = self.reader.versions()
        needed, manifests = set(), {}
        for version in sorted(keep & set(visible)):
            for manifest in self.reader.lineage(version, sha256=own.get(version)):  # bounded; authenticated when own
                needed.add(manifest["version"])
                manifests[manifest["version"]] = manifest
        gone = [v for v in visible if v not in needed]
        self.store.delete([self.store.manifest_key(v) for v in gone])
        named = {key for m in manifests.values() for key in m["objects"]}
        self.store.delete([k for k in self.store.keys("data/") if k not in named])
        return gone

    def delete_prefix(self) -> int:
        """Delete every object under the prefix (the run's end); returns how many. The publisher forgets its
        baseline: the next publish is an anchor.

        Raises:
            ChainStoreError: an S3 call failed.
        """
        keys = self.store.keys("manifests/")
        self.store.delete(keys)  # manifests first: no version stays visible without its data
        rest = self.store.keys("")
        self.store.delete(rest)
        self._committed = self._pending = None
        self._spare = {}
        return len(keys) + len(rest)


def publisher_of(store: dict, **kwargs) -> ChainPublisher:
    """The :class:`ChainPublisher` of ``store`` (:func:`grpo_steps.weights.chain.run_store`), through a client with
    botocore's bounded retries (credentials from the environment); ``kwargs`` as :class:`ChainPublisher` takes them."""
    reader = chain_of(store)
    return ChainPublisher(reader.client, reader.bucket, reader.prefix, **kwargs)


def remove_run_versions(store: dict | None) -> int:
    """Delete every object under a run's prefix (``store``: :func:`grpo_steps.weights.chain.run_store`'s; None:
    nothing). Returns how many.

    Raises:
        grpo_steps.weights.chain.ChainStoreError: S3 failed after its retries (names the key).
    """
    return 0 if store is None else publisher_of(store).delete_prefix()
