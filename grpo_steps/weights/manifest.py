"""What a manifest of the weight chain (:mod:`grpo_steps.weights.chain`) may say, and the checks a reader makes before
it trusts one: the format, the per-tensor checksum algorithms it accepts (cryptographic only), the bounds on links,
keys, sizes, dtypes and shapes (:func:`check_manifest`), and the tensors compared with a layout (:func:`same_layout`).
Pure: imports nothing of the project (the vLLM worker extension reads the chain inside a server).
"""

from __future__ import annotations

import hashlib
import re

FORMAT = 3
"""Manifest format: 3 links each delta to its base's manifest digest and checksums tensors with a cryptographic hash;
readers refuse any other (2 and 1 had XXH3 or unlinked manifests: a run's chain never outlives its run)."""
CHECKSUM = "blake3"
"""The per-tensor checksum algorithm a publish writes (:func:`tensor_checksum`): BLAKE3, 256 bits. Measured on the
shared 2-core box (docs/benchmarks.md): BLAKE3 ~2.1 GB/s, XXH3-128 ~5.3, SHA-256 ~0.18 (no SHA extensions), BLAKE2b
~0.3."""
CHECKSUMS = {"blake3": 64, "sha256": 64}
"""The per-tensor algorithms a reader accepts (all cryptographic) and their hex digest lengths."""
MAX_MANIFEST_BYTES = 64 << 20
"""The largest manifest a reader reads (~300 bytes per tensor: 200k tensors)."""
MAX_TENSOR_BYTES = 16 << 30
"""The largest tensor a manifest may describe, in bytes (a 152k x 8k bf16 embedding is 2.5 GB)."""
MAX_ANCHOR_EVERY = 10_000
"""The longest lineage a manifest may claim (``anchor_every``); the config's own bound is far lower."""
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
          "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
"""The dtypes a manifest may name and their widths in bytes."""
ENCODINGS = ("zstd", "xor-zstd", "same")
_PUBLISH_ID = re.compile(r"[0-9a-f]{12}")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ChainError(RuntimeError):
    """Base of the errors of this module."""


class VersionNotFoundError(ChainError, LookupError):
    """The version has no manifest under the prefix (never published, still being written, or retired)."""


class ChainCorruptError(ChainError):
    """A tensor failed its checksum after apply (or its bytes could not be decoded) twice, the object re-read once in
    between; the message names the version, the tensor and the object key."""


class ChainRefusedError(ChainError):
    """A version's manifest breaks a bound (:func:`check_manifest`), is not the one the trainer published (its SHA-256
    differs from the update request's, or from the digest its child names), or names tensors other than the served
    model's. Nothing of it is applied: the replica keeps the weights it serves. The message names the version and what
    is wrong."""


class ChainStoreError(ChainError):
    """An S3 call failed after botocore's bounded retries; the message names the operation and the key (never
    credentials)."""


def tensor_bytes(t) -> memoryview:
    """The raw bytes of the contiguous tensor ``t`` (native byte order, no copy)."""
    import torch

    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def tensor_checksum(t, algorithm: str = CHECKSUM) -> str:
    """Hex digest of the bytes of ``t`` (contiguous CPU tensor) in its own dtype: the per-tensor checksum of a
    manifest. ``algorithm``: ``blake3`` (what :meth:`WeightChain.publish` writes: BLAKE3, 256 bits, the ``blake3``
    package, which hashes without the GIL) or ``sha256``. Both are cryptographic: no writer of the bucket can make
    other bytes with the same digest (XXH3, used before, catches corruption only).

    Raises:
        ChainRefusedError: an algorithm this reader does not accept (:data:`CHECKSUMS`).
    """
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(tensor_bytes(t)).hexdigest()
    if algorithm == "sha256":
        return hashlib.sha256(tensor_bytes(t)).hexdigest()
    raise ChainRefusedError(f"unknown checksum algorithm {algorithm!r} in a manifest (this reader accepts "
                            f"{', '.join(CHECKSUMS)}): update grpo_steps on the reader to the publisher's version")


def checksums_digest(checksums: dict[str, str]) -> str:
    """Hex SHA-256 of per-tensor checksums (``{name: hex}``), in name order: one digest of a whole set of weights,
    the same for the same tensors whichever way they travel (a manifest's entries, a directory's files).

    >>> checksums_digest({"b": "02", "a": "01"}) == hashlib.sha256(b"a:01;b:02;").hexdigest()
    True
    """
    return hashlib.sha256("".join(f"{name}:{checksums[name]};" for name in sorted(checksums)).encode()).hexdigest()


def tensors_digest(tensors: dict, threads: int | None = None) -> str:
    """:func:`checksums_digest` of the :data:`CHECKSUM` (BLAKE3) checksum of each of ``tensors`` (name -> contiguous
    CPU tensor, in its own dtype): what a directory update request names (:class:`grpo_steps.weights.update.
    WeightUpdate`) and the server checks before loading. Hashed on ``threads`` threads (BLAKE3 releases the GIL; None:
    the machine's cores, at most 8): ~2.1 GB/s per core on the 2-core box."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(tensors)
    with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
        sums = pool.map(lambda name: tensor_checksum(tensors[name].contiguous()), names)
        return checksums_digest(dict(zip(names, sums, strict=True)))


def zstd_bound(size: int) -> int:
    """The most bytes zstd's frame of ``size`` input bytes can take (``ZSTD_COMPRESSBOUND``, zstd.h), plus a frame
    header's 18 bytes.

    >>> zstd_bound(0), zstd_bound(1 << 20)
    (82, 1052690)
    """
    margin = ((128 << 10) - size) >> 11 if size < (128 << 10) else 0
    return size + (size >> 8) + margin + 18


def refuse(version, what: str) -> ChainRefusedError:
    return ChainRefusedError(f"weight version {version} refused: {what}")


def check_manifest(manifest, version: int, prefix: str) -> dict:
    """Return ``manifest`` (a parsed manifest that claims to be ``version`` of the chain under ``prefix``, ending in
    ``/``) when every field has its type and stays within its bounds; the module doc says why each exists.

    Raises:
        ChainRefusedError: the first field that does not (named), e.g. a base that is not older than the version,
            a key outside ``<prefix>data/<version>-<id>/``, an object whose size is not what its frames add up to.
    """
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise refuse(version, what)

    def integer(value, low: int, high: int) -> bool:
        return type(value) is int and low <= value <= high

    need(isinstance(manifest, dict), "the manifest is not a JSON object")
    need(manifest.get("format") == FORMAT, f"manifest format {manifest.get('format')!r}, this reader reads {FORMAT}")
    need(manifest.get("version") == version and type(version) is int, f"the manifest says version "
         f"{manifest.get('version')!r}")
    need(isinstance(manifest.get("id"), str) and _PUBLISH_ID.fullmatch(manifest["id"]) is not None,
         "its publish id is not 12 hex digits")
    need(manifest.get("checksum") in CHECKSUMS, f"unknown checksum algorithm {manifest.get('checksum')!r} in a "
         f"manifest (this reader accepts {', '.join(CHECKSUMS)})")
    need(integer(manifest.get("anchor_every"), 1, MAX_ANCHOR_EVERY), f"anchor_every must be an int in 1.."
         f"{MAX_ANCHOR_EVERY}")
    need(integer(manifest.get("depth"), 0, manifest["anchor_every"] - 1), "depth must be an int below anchor_every")
    need(integer(manifest.get("anchor"), 0, version - manifest["depth"])
         and (manifest["depth"] > 0 or manifest["anchor"] == version), "its anchor is not at least depth versions back")
    base = manifest.get("base")
    if manifest["depth"] == 0:
        need(base is None, "an anchor (depth 0) names a base")
    else:
        need(isinstance(base, dict) and integer(base.get("version"), manifest["anchor"], version - 1)
             and isinstance(base.get("id"), str) and _PUBLISH_ID.fullmatch(base["id"]) is not None
             and isinstance(base.get("sha256"), str) and _HEX64.fullmatch(base["sha256"]) is not None,
             "a delta's base must be {version (older than this one, not before the anchor), id, sha256}")
    data = f"{prefix}data/{version:010d}-{manifest['id']}/"
    objects, tensors = manifest.get("objects"), manifest.get("tensors")
    need(isinstance(objects, dict) and isinstance(tensors, dict) and len(tensors) > 0, "objects or tensors missing")
    need(all(isinstance(k, str) and k.startswith(data) and "/" not in k[len(data):] and ".." not in k
             and integer(n, 1, 2 * MAX_TENSOR_BYTES) for k, n in objects.items()),
         f"an object's key is not under {data} or its size is not a positive int")
    filled = dict.fromkeys(objects, 0)
    digest_length = CHECKSUMS[manifest["checksum"]]
    for name, entry in tensors.items():
        need(isinstance(name, str) and isinstance(entry, dict), "a tensor entry is not an object")
        shape = entry.get("shape")
        need(entry.get("dtype") in DTYPES and isinstance(shape, list)
             and all(integer(d, 0, MAX_TENSOR_BYTES) for d in shape), f"tensor {name}: unknown dtype or bad shape")
        size = DTYPES[entry["dtype"]] * _product(shape)
        need(size <= MAX_TENSOR_BYTES, f"tensor {name}: {size} bytes, over the {MAX_TENSOR_BYTES} a reader takes")
        need(isinstance(entry.get("checksum"), str) and len(entry["checksum"]) == digest_length
             and all(c in "0123456789abcdef" for c in entry["checksum"]), f"tensor {name}: its checksum is not hex")
        need(entry.get("encoding") in ENCODINGS and (entry["encoding"] != "zstd" or base is None),
             f"tensor {name}: encoding {entry.get('encoding')!r}")
        if entry["encoding"] == "same":
            continue
        key, offset, length = entry.get("key"), entry.get("offset"), entry.get("length")
        need(key in filled and integer(length, 1, zstd_bound(size)) and integer(offset, 0, objects.get(key, 0)),
             f"tensor {name}: its key is not one of the version's objects, or its frame is out of bounds")
        need(offset == filled[key], f"tensor {name}: frames of object {key} are not packed one after the other")
        filled[key] += length
    need(filled == objects, "an object's size is not the sum of its frames' lengths")
    return manifest


def _product(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def same_layout(manifest: dict, layout: dict, what: str) -> None:
    """Refuse ``manifest`` unless its tensors are exactly ``layout``'s: ``{name: (dtype, shape)}`` (dtype as a
    manifest names it, shape a tuple). ``what`` names the layout's source in the message."""
    tensors = manifest["tensors"]
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    if missing or extra:
        raise refuse(manifest["version"], f"its tensors are not {what}'s: missing {missing[:3]}, "
                                           f"not in {what} {extra[:3]}")
    for name, (dtype, shape) in layout.items():
        entry = tensors[name]
        if tuple(entry["shape"]) != tuple(shape) or (dtype is not None and entry["dtype"] != dtype):
            raise refuse(manifest["version"], f"tensor {name} is {entry['dtype']} {tuple(entry['shape'])}, "
                                               f"{what} has {dtype} {tuple(shape)}")
