"""A checked chain of weight versions in S3: a full anchor every K versions and, in between, sparse deltas against the
last committed version, each version made visible by its manifest, written last.

Layout under the run's prefix ``s3://BUCKET/PREFIX/``::

    manifests/0000000007.json            version 7 exists iff this object exists (written after its data)
    data/0000000007-<id>/000.zst ...     its payload: each tensor's encoded bytes, one zstd frame per tensor, packed
                                         into objects of at most ``object_bytes`` (16 MB by default)

A manifest (JSON) holds the version, its publish ``id`` (a fresh token per publish: a version published again after a
crash is another version to readers), ``base`` (``{"version", "id", "sha256"}`` of the version the delta applies to,
``sha256`` the digest of that version's manifest bytes; null for an anchor), ``anchor`` (version of the anchor its
lineage starts from), ``depth`` (deltas since that anchor), ``anchor_every`` (the most versions from an anchor), the
byte count of each object, ``checksum`` (the algorithm, ``blake3``), and per tensor: dtype, shape, ``checksum`` of the
full tensor after apply, encoding (``zstd``: its
bytes; ``xor-zstd``: the XOR of its bit pattern with the base's; ``same``: bit-identical to the base, no bytes), key,
offset and length in that object. The XOR is taken on the weights as served, in the serving dtype: an element that
did not move has an all-zero XOR, which zstd packs to almost nothing; one that moved a little shares its sign, exponent
and high mantissa bits with the base, so its XOR has leading zeros too.

Encoding, measured on the 30 optimizer steps of a real run of SmolLM2-135M on ``configs/local.yaml``
(``bench/weight_delta.py``, docs/benchmarks.md, 2-core CPU box, 2026-11-27): in bf16 a median 1.4 % of the elements
change per step and a XOR+zstd delta is a median 2.4 % of the anchor's bytes (5.0 MB vs 210 MB; 10 % after the first
step, 0.5 % after the last); in fp32 99.6 % change and a delta is 57 % of the anchor (the XOR still drops the shared
high bits). Index/value pairs (int32 index + value) were 2x larger in bf16 (4.37 % of the raw bytes against 1.94 %) and
4x slower to make: XOR+zstd leaves the positions implicit in runs of zeros and needs no density threshold; zstd level 3
gained nothing over level 1.

Speed (docs/benchmarks.md, "The same push after the speed work"): tensors are encoded and decoded on ``threads`` threads
(numpy's XOR and count, zstd and blake3 release the GIL), data objects upload while the next tensors encode, and no
push takes fresh memory: a fresh page faults in slower than zstd runs on this VM, so the publisher's private copy goes
into a retired baseline's tensors, XORs into kept scratch buffers, and a reader decodes into its local copy's tensors,
XORing a delta in place (and out again when its checksum refuses it).

Only the trainer can choose the weights, though anyone who can write the bucket can write a manifest: the SHA-256 of
the wanted version's manifest bytes travels in the update request (which the run's token authenticates), each manifest
names its base's digest, and every per-tensor checksum is BLAKE3 (cryptographic: a writer cannot make other bytes
with the same checksum). So the lineage a late replica replays is checked link by link back to its anchor, and a
manifest swapped with a consistent forged payload is refused before a byte of its data is read (vLLM's
``/weight_checker`` hashes shards with SHA-256 for the same reason). What a manifest says is bounded before it is
trusted (:func:`check_manifest`): its format, version, links (a base strictly older, one deeper, at most
``anchor_every`` from the anchor: a forged self-reference cannot loop), keys under the version's own data prefix,
object sizes equal to what their tensors' frames add up to (and ``ContentLength`` equal to that), each frame at most
zstd's bound for its tensor, and every field a tag is made of typed.

Readers follow ``base`` links from the wanted version back to its anchor (or to the version their local copy holds)
and apply forward, checking every tensor's checksum after apply; a version whose manifest is absent does not exist, so a
publisher killed mid-version leaves nothing visible (its orphaned data is removed by :meth:`WeightChain.retain`).
The baseline advances only on :meth:`WeightChain.commit` (after every replica has loaded the version): a version that
was published but not committed is never a base.

Sources of the idea: SkyRL's delta weight sync through object storage (``weight_sync_backend=delta``, ``sync_dir:
s3://``), slime's per-tensor checksums and refusal of an out-of-order base (``--update-weight-mode delta``), NeMo-RL's
sparse S3 refit whose baseline advances only after a global commit (``refit_transport: vllm_s3_sparse``).

This module is the reader (:class:`WeightChain`: list, authenticate, fetch; it cannot publish) and the store both
halves use (:class:`ChainStore`); the trainer's writer, :class:`grpo_steps.weights.publisher.ChainPublisher`, holds a
reader. Pure: numpy, torch, zstandard, blake3 and boto3 (all but numpy imported lazily) and
:mod:`grpo_steps.weights.manifest`, so a vLLM worker extension can import it.
S3 calls go through one boto3 client with botocore's own bounded retries (``standard`` mode); there is no retry loop
here except one re-read of an object whose tensor failed its checksum.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from grpo_steps.weights.manifest import (
    MAX_MANIFEST_BYTES,
    ChainCorruptError,
    ChainError,
    ChainRefusedError,
    ChainStoreError,
    VersionNotFoundError,
    check_manifest,
    refuse,
    same_layout,
    tensor_bytes,
    tensor_checksum,
)

__all__ = ["ChainCorruptError", "ChainError", "ChainRefusedError", "ChainStoreError", "ChainStore", "LocalCopy",
           "Scratch", "VersionNotFoundError", "WeightChain", "chain_of", "in_order", "int_array", "make_client",
           "run_store", "tensor_checksum"]  # the errors live in grpo_steps.weights.manifest; readers catch them here

_MANIFEST = re.compile(r"manifests/(\d{10})\.json$")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def make_client(endpoint_url: str | None = None, *, max_attempts: int = 4, connect_timeout_s: float = 5.0,
                read_timeout_s: float = 60.0, region: str | None = None, access_key: str | None = None,
                secret_key: str | None = None):
    """A boto3 S3 client with botocore's ``standard`` retry mode bounded at ``max_attempts`` attempts per call
    (connection errors, 5xx and throttling are retried with jittered exponential backoff: 50 ms base, 20 s cap) and the
    given timeouts (seconds). Credentials: the arguments, else boto3's usual chain (``AWS_*`` environment, profile,
    instance role); pass them through the environment in a deployment, never on a command line."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": max_attempts}, connect_timeout=connect_timeout_s,
                    read_timeout=read_timeout_s, region_name=region or "us-east-1")
    return boto3.client("s3", endpoint_url=endpoint_url, aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key, config=config)


@dataclass
class LocalCopy:
    """A receiver's weights and the version they are: ``tensors`` (name -> CPU tensor) equal version ``version``
    (publish ``id``) when ``version`` is set; None while a fetch is changing them or after a failed one (then the next
    fetch replays from the anchor)."""

    tensors: dict[str, Any] = field(default_factory=dict)
    version: int | None = None
    id: str | None = None
    sha256: str | None = None  # its manifest's digest, as the trainer sent it
    manifest: bytes | None = None  # that manifest's bytes (what the other workers of a server check: shared_copy.py)


def _zstd_into(frame, out: memoryview) -> None:
    """Decode the zstd frame ``frame`` into ``out`` (writable bytes, no allocation: a fresh buffer per tensor would
    page-fault its way in, which cost more than the decoding itself on this VM). Raises :class:`_Undecodable` when the
    frame is not valid zstd or does not decode to exactly ``len(out)`` bytes."""
    import zstandard

    try:
        reader, done = zstandard.ZstdDecompressor().stream_reader(frame), 0
        while done < len(out) and (got := reader.readinto(out[done:])):
            done += got
        extra = reader.read(1)
    except zstandard.ZstdError as err:
        raise _Undecodable(f"zstd could not decode it: {err}") from err
    if done != len(out) or extra:
        raise _Undecodable(f"{'more than ' if extra else ''}{done} bytes decoded for a tensor of {len(out)} bytes")

def int_view(t):
    """``t`` (contiguous, flat) viewed as the signed integer type of its element width: the domain of the XOR.

    An element that moved by one unit in the last place differs from its base in the low bits only:

    >>> import torch
    >>> base = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    >>> moved = torch.tensor([1.0, 2.015625], dtype=torch.bfloat16)  # 2.0 plus one bf16 ulp (2 ** -6)
    >>> torch.bitwise_xor(int_view(base), int_view(moved)).tolist()
    [0, 1]
    """
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


def int_array(t):
    """The contiguous CPU tensor ``t`` as a flat numpy array of its element width's integer type (no copy, writable:
    numpy's XOR and count run single-threaded and without the GIL, in the caller's thread; bfloat16 has no numpy
    type)."""
    return int_view(t.reshape(-1)).numpy()


def in_order(pool, fn, items: list, window: int):
    """``(item, fn(item))`` for each of ``items``, computed on ``pool``, in order, at most ``window`` submitted ahead
    (bounds the memory of results waiting for an earlier, slower one)."""
    futures = [pool.submit(fn, item) for item in items[:window]]
    for i in range(len(items)):
        if i + window < len(items):
            futures.append(pool.submit(fn, items[i + window]))
        yield items[i], futures[i].result()
        futures[i] = None  # drop the result once consumed


class Scratch:
    """Scratch numpy buffers for XORs, kept between calls: a fresh buffer per tensor would page-fault its way in,
    which cost more than the XOR itself on this VM. Used from several threads at once (one buffer each)."""

    def __init__(self) -> None:
        self._buffers: list = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def like(self, like):
        """A scratch numpy array of ``like``'s dtype and size, from the kept buffers (the smallest that fits)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._buffers) if b.nbytes >= like.nbytes]
            buffer = (self._buffers.pop(min(fits, key=lambda i: self._buffers[i].nbytes)) if fits
                      else np.empty(like.nbytes, np.uint8))
        try:
            yield buffer[:like.nbytes].view(like.dtype)
        finally:
            with self._lock:
                self._buffers.append(buffer)

    def trim(self) -> None:
        """Keep one buffer, the largest (a reader's next fetch reuses it for the largest tensor): the others, one per
        thread that XORed at once, are freed."""
        with self._lock:
            self._buffers = sorted(self._buffers, key=lambda b: b.nbytes)[-1:]


class ChainStore:
    """The S3 objects under one chain's prefix ``s3://bucket/prefix/``, every call named by its key when it fails:
    what a :class:`WeightChain` reads and a :class:`~grpo_steps.weights.publisher.ChainPublisher` also writes.
    ``client``: a boto3 S3 client (:func:`make_client`)."""

    def __init__(self, client, bucket: str, prefix: str) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix.strip("/") + "/"
        self._lock = threading.Lock()
        self.bytes_read = 0
        """Bytes of data objects read by :meth:`get` since the last reset (the reader's fetch resets it)."""


    def call(self, op: str, key: str, *, missing: Exception | None = None, size: tuple[int, int] | None = None,
              **kwargs):
        """``client.<op>`` on ``key`` (``get_object``: returns the body's bytes, at most ``size[1]``, and refuses an
        object whose ``ContentLength`` is not ``size[0]`` (-1: any up to ``size[1]``) before reading it). A failure
        after botocore's retries raises :class:`ChainStoreError` naming the key; a missing key raises ``missing`` when
        given."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            if op == "list_objects_v2":
                return self.client.list_objects_v2(Bucket=self.bucket, **kwargs)
            if op == "delete_objects":
                return self.client.delete_objects(Bucket=self.bucket, **kwargs)
            answer = getattr(self.client, op)(Bucket=self.bucket, Key=key, **kwargs)
            if op != "get_object":
                return answer
            expected, cap = size if size is not None else (-1, MAX_MANIFEST_BYTES)
            length = answer.get("ContentLength")
            if (expected >= 0 and length != expected) or (length is not None and length > cap):
                answer["Body"].close()
                raise ChainCorruptError(f"object s3://{self.bucket}/{key} has {length} bytes, the manifest says "
                                        f"{expected if expected >= 0 else f'at most {cap}'} (truncated or replaced)")
            body = answer["Body"].read(cap + 1)  # bounded: a store that sends more than it announced is cut off
            if (expected >= 0 and len(body) != expected) or len(body) > cap:
                raise ChainCorruptError(f"object s3://{self.bucket}/{key}: {len(body)} bytes read, the manifest says "
                                        f"{expected if expected >= 0 else f'at most {cap}'} (truncated or replaced)")
            return body  # the body's read fails inside the try
        except ClientError as err:
            if missing is not None and err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise missing from None
            raise ChainStoreError(f"S3 {op} of s3://{self.bucket}/{key} failed after botocore's retries: "
                                  f"{type(err).__name__}: {err}") from err
        except BotoCoreError as err:
            raise ChainStoreError(f"S3 {op} of s3://{self.bucket}/{key} failed after botocore's retries: "
                                  f"{type(err).__name__}: {err}") from err

    def get(self, key: str, size: int) -> bytes:
        """The data object ``key``, refused unless it has exactly ``size`` bytes (counted in :attr:`bytes_read`)."""
        blob = self.call("get_object", key, size=(size, size))
        with self._lock:  # reads run on several threads
            self.bytes_read += len(blob)
        return blob

    def keys(self, under: str) -> list[str]:
        """Every key under ``prefix + under``."""
        keys, token = [], None
        while True:
            page = self.call("list_objects_v2", self.prefix + under, Prefix=self.prefix + under,
                              **({"ContinuationToken": token} if token else {}))
            keys += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return keys
            token = page["NextContinuationToken"]

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (a store that lists a key it could not delete raises :class:`ChainStoreError`)."""
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[i:i + 1000]
            answer = self.call("delete_objects", batch[0], Delete={"Objects": [{"Key": k} for k in batch],
                                                                     "Quiet": True})
            if answer.get("Errors"):  # DeleteObjects answers 200 and lists the keys it could not delete
                error = answer["Errors"][0]
                raise ChainStoreError(f"S3 delete_objects of s3://{self.bucket}/{error['Key']} failed: "
                                      f"{error.get('Code')}: {error.get('Message')}")

    def check_access(self) -> None:
        """Write and delete one small object under the prefix, as a publisher must be able to (a ``HeadBucket`` alone
        was answered for wrong credentials by SeaweedFS).

        Raises:
            ChainStoreError: S3 refused or did not answer (names the key).
        """
        key = f"{self.prefix}access-check"
        self.put(key, b"")
        self.delete([key])

    def put(self, key: str, body: bytes) -> None:
        """Write ``body`` as the object ``key``."""
        self.call("put_object", key, Body=body)

    def manifest_key(self, version: int) -> str:
        """The key of ``version``'s manifest (its existence is the version's)."""
        return f"{self.prefix}manifests/{version:010d}.json"

class WeightChain:
    """The reader of the chain of weight versions under ``s3://bucket/prefix/``: it lists, authenticates and fetches
    versions, and cannot publish one (the trainer's :class:`~grpo_steps.weights.publisher.ChainPublisher` holds a
    reader and writes through its :attr:`store`).

    ``client``: a boto3 S3 client (:func:`make_client`). ``threads``: threads that read and decode tensors at once;
    None: the machine's cores, at most 8.
    """

    def __init__(self, client, bucket: str, prefix: str, *, threads: int | None = None):
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 (or None for the machine's cores), got {threads}")
        self.store = ChainStore(client, bucket, prefix)
        self.client, self.bucket, self.prefix = client, bucket, self.store.prefix
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.scratch = Scratch()

    @property
    def bytes_read(self) -> int:
        """Bytes of data objects read from S3 by the last :meth:`fetch` that applied a version (manifests not
        counted)."""
        return self.store.bytes_read



    def versions(self) -> list[int]:
        """The visible versions (those with a manifest), ascending."""
        return sorted(int(m.group(1)) for k in self.store.keys("manifests/") if (m := _MANIFEST.search(k)))

    def latest_version(self) -> int | None:
        """The newest visible version, or None when there is none."""
        found = self.versions()
        return found[-1] if found else None

    def manifest(self, version: int, sha256: str | None = None) -> dict:
        """The manifest of ``version`` (see the module doc), checked against its bounds (:func:`check_manifest`) and,
        when ``sha256`` is given, against that digest of its bytes.

        Raises:
            VersionNotFoundError: it has none.
            ChainRefusedError: it breaks a bound, or its digest is not ``sha256``.
            ChainStoreError: S3 failed otherwise.
        """
        return self._manifest(version, sha256)[0]

    def _manifest(self, version: int, sha256: str | None) -> tuple[dict, str, bytes]:
        """(the checked manifest of ``version``, the SHA-256 of its bytes, its bytes)."""
        body, digest = self._manifest_bytes(version)
        if sha256 is not None and digest != sha256:
            raise refuse(version, f"its manifest s3://{self.bucket}/{self.store.manifest_key(version)} is not the one "
                                   f"the trainer published (SHA-256 {digest[:16]}..., the trainer's {sha256[:16]}...)")
        return self._parse(version, body), digest, body

    def _manifest_bytes(self, version: int) -> tuple[bytes, str]:
        """(the raw bytes of ``version``'s manifest, their SHA-256), nothing parsed yet."""
        key = self.store.manifest_key(version)
        missing = VersionNotFoundError(f"weight version {version} does not exist (no s3://{self.bucket}/{key})")
        body = self.store.call("get_object", key, missing=missing)  # at most MAX_MANIFEST_BYTES
        return body, hashlib.sha256(body).hexdigest()

    def _parse(self, version: int, body: bytes) -> dict:
        """``body`` as a manifest of ``version``, checked against its bounds (:func:`check_manifest`)."""
        try:
            manifest = json.loads(body)
        except ValueError as err:
            raise refuse(version, f"its manifest is not JSON: {err}") from None
        return check_manifest(manifest, version, self.prefix)

    def lineage(self, version: int, have: LocalCopy | None = None, sha256: str | None = None) -> list[dict]:
        """The manifests to apply, oldest first, to reach ``version``: from its anchor, or from the version after
        ``have``'s when ``have`` holds a version of this lineage (same version, publish id and manifest digest).

        With ``sha256`` (the digest the trainer sent) the whole lineage is authenticated: the wanted manifest by it,
        each base by the digest its child names. Without it (the publisher's own retention) only the bounds hold. The
        walk is bounded either way: each base is strictly older and exactly one shallower, at most ``anchor_every``
        links.

        Raises:
            VersionNotFoundError: ``version`` or a version it builds on has no manifest (retired too early).
            ChainRefusedError: a manifest breaks a bound, a digest, or its base's depth and anchor.
        """
        return self._lineage(version, have, sha256)[0]

    def _lineage(self, version: int, have: LocalCopy | None, sha256: str | None) -> tuple[list[dict], bytes]:
        """(:meth:`lineage`, the bytes of ``version``'s manifest)."""
        manifest, _, body = self._manifest(version, sha256)
        chain = [manifest]
        while chain[-1]["base"] is not None:
            child, base = chain[-1], chain[-1]["base"]
            if (have is not None and have.version == base["version"] and have.id == base["id"]
                    and have.sha256 == base["sha256"]):
                same_layout(child, {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape))
                                     for n, t in have.tensors.items()}, "the local copy")
                break
            body_of_base, digest = self._manifest_bytes(base["version"])
            # the raw bytes' digest first: a base that is not the one its child names is never parsed
            if digest != base["sha256"]:
                raise refuse(child["version"], f"its base, version {base['version']}, is not the manifest it was "
                                                f"built on (SHA-256 {digest[:16]}..., it names "
                                                f"{base['sha256'][:16]}...): a rewritten lineage, or the base "
                                                f"published again after this delta was written")
            manifest = self._parse(base["version"], body_of_base)
            if manifest["id"] != base["id"]:  # the bytes its child names, under another id: a writer's inconsistency
                raise refuse(child["version"], f"its base, version {base['version']}, has id {manifest['id']}, "
                                                f"it names id {base['id']}")
            if (manifest["depth"] + 1 != child["depth"] or manifest["anchor"] != child["anchor"]
                    or manifest["anchor_every"] != child["anchor_every"]):
                raise refuse(child["version"], f"its base, version {base['version']}, has depth "
                                                f"{manifest['depth']} and anchor {manifest['anchor']}, it has depth "
                                                f"{child['depth']} and anchor {child['anchor']}")
            same_layout(child, {n: (e["dtype"], e["shape"]) for n, e in manifest["tensors"].items()},
                         f"its base version {base['version']}")
            chain.append(manifest)
        return chain[::-1], body

    def fetch(self, version: int, into: LocalCopy | None = None, *, sha256: str, layout: dict | None = None) -> dict:
        """Bring ``into`` (a new :class:`LocalCopy` when None) to ``version`` and return its tensors (name -> CPU
        tensor in the serving dtype, shapes as published). Applies only the deltas after the copy's version when it
        is in the lineage, else replays from the anchor; checks each tensor's checksum after apply. A tensor that fails
        has its object read once more; failing again raises. While it runs, and after it raises, ``into.version`` is
        None: a copy is never half one version and labelled as another. The tensors are the copy's own: the next
        fetch into the same copy changes them in place.

        Args:
            sha256: the SHA-256 of ``version``'s manifest bytes, as the trainer published it
                (:attr:`PublishStats.sha256`, sent in the update request): the lineage is checked against it.
            layout: ``{name: (dtype or None, shape)}`` of the served model: every manifest must name exactly these
                tensors (dtype None: any), or the version is refused before anything is read.

        Raises:
            VersionNotFoundError: ``version`` (or a version it builds on) does not exist.
            ChainRefusedError: a manifest breaks a bound, is not the trainer's, or names other tensors than ``layout``.
            ChainCorruptError: a tensor failed its checksum twice (names the tensor and the key), or an object's size
                is not the manifest's.
            ChainStoreError: an S3 call failed after botocore's retries (names the key).
            ValueError: ``sha256`` is missing or not a SHA-256 (a fetch is never unauthenticated).
        """
        if not isinstance(sha256, str) or _HEX64.fullmatch(sha256) is None:
            # the digest is what makes the chain the trainer's: without it any writer of the bucket chooses the weights
            raise ValueError(f"fetch of weight version {version} needs sha256, the SHA-256 of its manifest as the "
                             f"trainer published it (64 lowercase hex digits, the update request's), not {sha256!r}")
        copy = into if into is not None else LocalCopy()
        if copy.version == version and copy.sha256 == sha256:
            return copy.tensors
        self.store.bytes_read = 0
        chain, body = self._lineage(version, copy, sha256)
        if layout is not None:
            for manifest in chain:
                same_layout(manifest, layout, "the served model")
        copy.version = copy.id = copy.sha256 = copy.manifest = None  # until the last tensor checks, it is no version
        if chain[0]["base"] is None:
            # an anchor is decoded into the copy's own tensors of its dtype and shape (a shared copy's stay shared)
            copy.tensors = {n: t for n, t in copy.tensors.items() if n in chain[0]["tensors"]}
        try:
            for manifest in chain:
                self._apply(manifest, copy.tensors)
        finally:
            self.scratch.trim()
        copy.version, copy.id, copy.sha256, copy.manifest = version, chain[-1]["id"], sha256, body
        return copy.tensors

    def _apply(self, manifest: dict, tensors: dict) -> None:
        """Apply one version's ``manifest`` to ``tensors`` (name -> tensor, changed in place): its objects read in
        order, at most ``threads`` reads ahead of the one being decoded, each object's tensors decoded on ``threads``
        threads as soon as it arrives and the object dropped once they are applied. Host memory beyond the copy itself
        stays at about ``(threads + 1) * object_bytes`` whatever the model's size (all objects were held at once
        before)."""
        from concurrent.futures import ThreadPoolExecutor

        algorithm, by_key, same = manifest["checksum"], {}, []
        for name, entry in manifest["tensors"].items():
            (same if entry["encoding"] == "same" else by_key.setdefault(entry["key"], [])).append((name, entry))
        reads, decodes = ThreadPoolExecutor(self.threads), ThreadPoolExecutor(self.threads)
        try:
            checks = [decodes.submit(self._apply_tensor, manifest, n, e, b"", tensors, algorithm) for n, e in same]
            for key, blob in in_order(reads, lambda k: self.store.get(k, manifest["objects"][k]), list(by_key),
                                      self.threads):
                for job in [decodes.submit(self._apply_tensor, manifest, n, e, blob, tensors, algorithm)
                            for n, e in by_key[key]]:
                    job.result()
                del blob  # applied: the object's bytes go before the next but one is read
            for job in checks:
                job.result()
        finally:
            reads.shutdown(cancel_futures=True)
            decodes.shutdown(cancel_futures=True)

    def _apply_tensor(self, manifest: dict, name: str, entry: dict, blob: bytes, tensors: dict, algorithm: str):
        expected = entry["checksum"]
        if entry["encoding"] == "same":
            if tensor_checksum(tensors[name], algorithm) != expected:
                raise ChainCorruptError(f"weight version {manifest['version']}: tensor {name} is marked unchanged "
                                        f"but the local copy's differs from its checksum (wrong base)")
            return
        key = entry["key"]
        for attempt in range(2):
            try:
                with self._decode(manifest, name, entry, blob, tensors) as undo:
                    if tensor_checksum(tensors[name], algorithm) == expected:
                        return
                    undo()  # a delta XORed in place is XORed out again: the base is intact for the second try
                problem = f"its {algorithm} checksum after apply differs from the manifest's"
            except _Undecodable as err:
                problem = str(err)
            if attempt:
                raise ChainCorruptError(f"weight version {manifest['version']}: tensor {name} refused twice, "
                                        f"object s3://{self.bucket}/{key} read again in between: {problem}")
            # once more: a transient corruption on the way gets a second chance
            blob = self.store.get(key, manifest["objects"][key])

    @contextlib.contextmanager
    def _decode(self, manifest: dict, name: str, entry: dict, blob: bytes, tensors: dict):
        """Put tensor ``name`` of ``manifest`` into ``tensors`` from its bytes in the object ``blob``: an anchor's
        decoded into the copy's tensor of that dtype and shape (a new one when there is none), a delta's XORed into
        the copy's tensor in place. Yields a function that undoes a delta (XOR is its own inverse)."""
        import torch

        dtype = getattr(torch, entry["dtype"])
        frame = memoryview(blob)[entry["offset"]:entry["offset"] + entry["length"]]
        old, shape = tensors.get(name), tuple(entry["shape"])
        if entry["encoding"] == "zstd":
            if old is None or old.dtype != dtype or tuple(old.shape) != shape:
                old = torch.empty(shape, dtype=dtype)
            _zstd_into(frame, tensor_bytes(old))
            tensors[name] = old
            yield lambda: None
            return
        if entry["encoding"] != "xor-zstd":
            raise _Undecodable(f"unknown encoding {entry['encoding']!r} (this reader knows zstd, xor-zstd, same)")
        if old is None or old.dtype != dtype or tuple(old.shape) != shape:
            raise _Undecodable("the local copy has no tensor of this dtype and shape to apply the delta to")
        target = int_array(old)
        with self.scratch.like(target) as xor:
            _zstd_into(frame, memoryview(xor.view(np.uint8)))
            np.bitwise_xor(target, xor, out=target)
            yield lambda: np.bitwise_xor(target, xor, out=target)

class _Undecodable(Exception):
    """An object's bytes for one tensor could not be turned into the tensor (internal: retried, then reported)."""


# --- a run's location (the flow's steps and the trainer share it) ---


def run_store(s3_sync, run_key: str) -> dict | None:
    """The S3 location of one run's weight versions: ``{"bucket", "prefix", "endpoint_url"}`` (what a server's
    ``update_info`` names; no credentials) for ``s3_sync`` (a :class:`grpo_steps.config.S3SyncConfig`) and
    ``run_key`` (e.g. ``GRPOFlow/1764000000000000``), or None when neither ``s3_sync.url`` nor the Metaflow S3 datastore
    gives a location."""
    where = s3_sync.location()
    if where is None:
        return None
    bucket, prefix = where
    return {"bucket": bucket, "prefix": "/".join(p for p in (prefix, run_key.strip("/")) if p),
            "endpoint_url": s3_sync.endpoint()}


def chain_of(store: dict, **kwargs) -> WeightChain:
    """The :class:`WeightChain` of ``store`` (:func:`run_store`), through a client with botocore's bounded retries
    (credentials from the environment)."""
    return WeightChain(make_client(store.get("endpoint_url")), store["bucket"], store["prefix"], **kwargs)
