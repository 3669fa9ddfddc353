"""The weight update request: what ``/update_weights`` carries as ``update_info`` to the pipeline's weight-transfer
engine in every replica (:class:`grpo_steps.vllm_worker.PipelineTransferEngine` parses it back). One type for every
sender: the transports (``disk`` and ``s3`` pushes), the ``evaluate`` step's staging
(:func:`grpo_steps.weights.staging.stage_update`) and the HTTP client.

The request is authenticated by the run's token, so what it names is the trainer's choice: a directory comes with the
digest of its tensors (:func:`grpo_steps.weights.manifest.tensors_digest`, per-tensor BLAKE3 as the chain checksums
them), a chain version with its manifest's SHA-256. A file on a volume others can write (Kubernetes' shared volume),
or an object in a bucket others can write, swapped after the trainer named it, is refused on load: the server keeps
serving the weights it had. Imports nothing of the project at import time (the vLLM worker parses it).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class WeightUpdate:
    """``/update_weights``'s ``update_info``, one of two sources:

    - ``path``: a directory of safetensors the server reads, with ``tensors_sha256`` (the SHA-256 of its tensors'
      BLAKE3 checksums in name order, :func:`~grpo_steps.weights.manifest.tensors_digest`) and ``direct`` (the direct
      CPU load where it applies);
    - ``s3`` (``{"bucket", "prefix", "endpoint_url"}``; credentials from the server's environment, never in a
      request) with ``version`` (a committed-or-pending version of that chain) and ``sha256`` (its manifest's digest
      as the trainer published it).

    Build one with :meth:`of_directory` or :meth:`of_chain`; send :meth:`request`.

    Raises:
        ValueError: neither or both sources, or a digest that is not 64 lowercase hex digits (the message says which
            field and what it must be).
    """

    path: str | None = None
    direct: bool = True
    tensors_sha256: str | None = None
    s3: dict | None = None
    version: int | None = None
    sha256: str | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.s3 is None):
            raise ValueError("a weight update names either 'path' (a directory of safetensors) or 's3' and 'version' "
                             f"(a chain version), got path={self.path!r}, s3={self.s3!r}")
        if self.s3 is not None and not isinstance(self.version, int):
            raise ValueError(f"a weight update from S3 needs 'version' (an int), got {self.version!r}")
        field, digest = ("sha256", self.sha256) if self.s3 is not None else ("tensors_sha256", self.tensors_sha256)
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ValueError(f"weight update of {self.source()} has no {field} (64 lowercase hex digits): only the "
                             "trainer's request names the weights' digest; refusing to load unauthenticated weights")

    @classmethod
    def of_directory(cls, path: str | Path, *, direct: bool = True, tensors_sha256: str | None = None) -> WeightUpdate:
        """The update from the safetensors directory ``path``; ``tensors_sha256``: its digest as the sender wrote the
        tensors (None: computed here from the files, which reads each once).

        Raises:
            FileNotFoundError: ``tensors_sha256`` None and ``path`` holds no safetensors.
        """
        if tensors_sha256 is None:
            from grpo_steps.weights.files import read_safetensors
            from grpo_steps.weights.manifest import tensors_digest

            tensors_sha256 = tensors_digest(read_safetensors(path))
        return cls(path=str(path), direct=direct, tensors_sha256=tensors_sha256)

    @classmethod
    def of_chain(cls, store: dict, version: int, sha256: str) -> WeightUpdate:
        """The update from version ``version`` of the chain at ``store`` (:func:`grpo_steps.weights.chain.run_store`),
        whose manifest's digest is ``sha256`` (:attr:`grpo_steps.weights.publisher.PublishStats.sha256`)."""
        return cls(s3=dict(store), version=version, sha256=sha256)

    @classmethod
    def parse(cls, update_info: dict) -> WeightUpdate:
        """The update a request's ``update_info`` names (what the worker does with what it is sent).

        Raises:
            ValueError: an unknown field, or what the constructor refuses.
        """
        unknown = sorted(set(update_info) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"weight update has unknown fields {unknown}")
        return cls(**update_info)

    def request(self) -> dict:
        """``update_info`` as JSON: the fields that are set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def source(self) -> str:
        """Where the weights come from, for a message: ``the directory P`` or ``version N of s3://bucket/prefix``.

        >>> WeightUpdate(path="/dev/shm/v3", tensors_sha256="0" * 64).source()
        'the directory /dev/shm/v3'
        """
        if self.path is not None:
            return f"the directory {self.path}"
        return f"version {self.version} of s3://{self.s3.get('bucket')}/{self.s3.get('prefix')}"
