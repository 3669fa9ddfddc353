"""How the ``evaluate`` step stages a policy's full weights for the generation server: one chooser
(:func:`stage_update`) for every provider, beside the training process's transports
(:func:`grpo_steps.training.generation.transport.make_transport`), and building the same request they build
(:class:`~grpo_steps.weights.update.WeightUpdate`): a directory with its tensors' digest (as a ``disk`` push), or a
version of a chain with its manifest's digest (as an ``s3`` push).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from grpo_steps.weights.update import WeightUpdate


def eval_store(store: dict, label: str) -> dict:
    """Where the ``evaluate`` step publishes its ``label`` weights under a run's weight store (:func:`grpo_steps.
    weights.chain.run_store`): ``<prefix>/eval/<label>``, beside the training chain's ``manifests/`` and ``data/``, so
    that deleting the run's prefix deletes it too.

    >>> eval_store({"bucket": "b", "prefix": "weight-sync/run-1", "endpoint_url": None}, "trained")["prefix"]
    'weight-sync/run-1/eval/trained'
    """
    return {**store, "prefix": f"{store['prefix'].rstrip('/')}/eval/{label}"}


def stage_update(weights_dir: str | Path, label: str, readable: Callable[[str | Path, str], str],
                 store: dict | None = None, dtype: str | None = None) -> WeightUpdate:
    """The update from which every replica of a server loads the full weights in ``weights_dir`` (``label``:
    ``baseline``, ``trained``):

    - ``store`` None: the directory where the server reads it, ``readable(weights_dir, label)`` (the server's
      :meth:`~grpo_steps.servers.base.GenerationServer.stage_weights`: this machine's files, or a copy on the shared
      volume), with the digest of the tensors as they are here: a copy swapped on the volume is refused on load;
    - ``store`` (``weight_sync: s3``: the run's location, :func:`grpo_steps.weights.chain.run_store`): the directory's
      tensors published as version 0 (an anchor) of a chain of their own under ``<prefix>/eval/<label>``
      (:func:`eval_store`; what an earlier attempt left there is deleted first), with its manifest's digest: the
      server needs no file system shared with this machine, and the run's prefix, deleted by the flow's ``end``, holds
      it. ``dtype``: the serving dtype (``model.dtype``) the tensors are published in, as a training push is (a server
      refuses a version in another dtype); None: as the files hold them.

    Reads every tensor of ``weights_dir`` once (the digest, or the publish).

    Raises:
        grpo_steps.weights.chain.ChainStoreError: S3 failed after its retries (names the key).
        FileNotFoundError: ``weights_dir`` holds no safetensors.
    """
    from grpo_steps.weights.files import read_safetensors

    tensors = read_safetensors(weights_dir)
    if store is None:
        from grpo_steps.weights.manifest import tensors_digest

        digest = tensors_digest(tensors)  # before the copy: what the server reads must be these tensors
        return WeightUpdate.of_directory(readable(weights_dir, label), tensors_sha256=digest)
    import torch

    from grpo_steps.weights.publisher import publisher_of

    where = eval_store(store, label)
    chain = publisher_of(where, dtype=getattr(torch, dtype) if dtype else None)
    chain.delete_prefix()
    # as a training push: the manifest's digest in the authenticated request, so no writer of the bucket can make the
    # trained side score other weights
    return WeightUpdate.of_chain(where, 0, chain.publish(tensors, 0).sha256)
