"""The files of ``disk`` weight sync (rank 0 of the training process): where a push is written and how the server
loads it.

Rank 0 writes the policy's weights as one safetensors file into a new directory per push under a run-owned
root (:func:`sync_root`; :func:`grpo_steps.weights.files.write_safetensors`, or
:func:`grpo_steps.weights.files.overwrite_safetensors` of an older push's file moved there), then has the server
load it (:meth:`grpo_steps.servers.client.VLLMClient.reload_weights`) and labels it ``step-N``
(:class:`DiskTransport`); with LoRA the adapter alone is written and loaded as a new served model
(:class:`AdapterTransport`), or base + adapter merged (:func:`merged_state_dict`) is pushed as full weights.
Verification is :mod:`grpo_steps.training.generation.push`'s.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpo_steps.processes import OWNER_FILE, ProcessRef, claim_dir, remove_orphan_dirs  # noqa: F401 (re-exported)
from grpo_steps.servers.client import GenerationServerError, VLLMClient
from grpo_steps.weights.files import (
    checkpoint_state_dict,
    is_no_space,
    no_space,
    overwrite_safetensors,
    require_space,
    safetensors_bytes,
    write_safetensors,
)
from grpo_steps.weights.labels import adapter_name, version_label
from grpo_steps.weights.manifest import tensors_digest


@dataclass
class DirectoryTransport:
    """Rank 0's half of ``disk`` sync, one push per weight version: write the weights into a fresh directory
    ``root/v{version}`` (vLLM issue #32718: never reload from a reused directory), have the server load them, then
    retire the previous push's directory. :class:`DiskTransport` (full weights) and :class:`AdapterTransport` (a LoRA
    adapter) say what is written and how the server loads it; ``root`` must be readable by the server.
    """

    client: VLLMClient
    root: Path
    current: Path | None = field(default=None, init=False)
    """The directory of the last push (the server's weights came from it)."""

    def push(self, state_dict: dict, version: int, model=None) -> dict[str, float]:
        """Write, load, retire. ``state_dict``: the policy's full state dict (on rank 0); ``model``: the unwrapped
        policy it came from. Returns ``{"write_seconds": s, "reload_seconds": s}``.

        Nothing is loaded unless the whole push is written: the free space of ``root`` is checked first, and a write
        that fails (a full disk included) removes the push's directory.

        Raises:
            GenerationServerError: the server failed a request.
            NoSpaceError: ``root`` cannot hold the push (checked before writing, or the disk filled while writing);
                names the directory, the bytes needed and ``generation.sync_dir``. The server was not asked to load.
        """
        start = time.perf_counter()
        directory = Path(self.root) / f"v{version}"
        if directory.exists():  # a retried push of the same step: never reload a reused directory
            shutil.rmtree(directory)
            self._forget(directory)
        what, needed = f"weight push v{version}", self._bytes_needed(state_dict)
        require_space(what, self.root, needed, self.space_key(), reclaimed=self._reclaimable())
        try:
            self._write(state_dict, directory, model)
        except BaseException as err:
            shutil.rmtree(directory, ignore_errors=True)  # a half-written push is never loaded, nor left behind
            self._forget(directory)
            if is_no_space(err):
                raise no_space(what, self.root, needed, self.space_key()) from err
            raise
        written = time.perf_counter()
        self._load(directory, version)
        loaded = time.perf_counter()
        previous, self.current = self.current, directory
        if previous is not None:
            self._retire(previous)
        return {"write_seconds": written - start, "reload_seconds": loaded - written}

    def _forget(self, directory: Path) -> None:
        """``directory`` was removed: drop every reference to it."""
        if self.current == directory:
            self.current = None

    def space_key(self) -> str:
        """The config keys that give the pushes more room, for a full-disk error."""
        shm = Path(self.root).resolve().is_relative_to("/dev/shm")
        return ("generation.sync_dir (a directory the server can read; null: /dev/shm"
                + (", sized by resources.train.shared_memory_mib on Kubernetes)" if shm else ")"))

    def _bytes_needed(self, state_dict: dict) -> int:
        """Bytes the push writes into ``root``."""
        return safetensors_bytes(state_dict)

    def _reclaimable(self) -> int:
        """Bytes already in ``root`` that the push rewrites in place or frees before writing."""
        return 0

    def _write(self, state_dict: dict, directory: Path, model) -> None:
        raise NotImplementedError

    def _load(self, directory: Path, version: int) -> None:
        raise NotImplementedError

    def _retire(self, previous: Path) -> None:
        """The push before this one is no longer served: by default its directory is removed."""
        shutil.rmtree(previous, ignore_errors=True)

    def committed(self, version: int) -> None:
        """Every replica serves ``version`` (verified): nothing to advance for a directory (the transport protocol,
        :class:`grpo_steps.training.generation.transport.WeightTransport`)."""

    def close(self) -> None:
        """Remove the last push's directory and the run's sync directory ``root`` (the server keeps its weights in
        memory)."""
        if self.current is not None:
            shutil.rmtree(self.current, ignore_errors=True)
            self.current = None
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class DiskTransport(DirectoryTransport):
    """Full weights: each push writes ``model.safetensors`` to ``root/v{version}``, reloads the server from it
    (:meth:`VLLMClient.reload_weights`) and labels the server's weights ``step-{version}``.

    From the third push on, the directory of the push before the previous one is renamed to ``v{version}`` and its
    file overwritten in place (:func:`overwrite_safetensors`): a new path per push, every byte rewritten, no fresh
    RAM-disk pages. So two pushes' files are kept (``current``, ``spare``); ``root`` should be RAM-backed
    (``/dev/shm``) with room for two copies of the weights.
    """

    direct: bool = True
    """Load through the direct CPU path where it applies (:meth:`VLLMClient.reload_weights`)."""
    spare: Path | None = field(default=None, init=False)
    """The push before ``current``, kept to be rewritten in place by the next push."""
    digest: str | None = field(default=None, init=False)
    """The last written push's :func:`~grpo_steps.weights.manifest.tensors_digest`, taken from the tensors in memory
    (not read back from the file, which a writer of a shared ``generation.sync_dir`` could have swapped): the update
    request names it and the server refuses other files."""

    def _forget(self, directory: Path) -> None:
        super()._forget(directory)
        if self.spare == directory:
            self.spare = None

    def _reclaimable(self) -> int:
        file = self.spare / "model.safetensors" if self.spare is not None else None
        return file.stat().st_size if file is not None and file.is_file() else 0

    def _write(self, state_dict: dict, directory: Path, model) -> None:
        spare, self.spare = self.spare, None
        tensors = checkpoint_state_dict(state_dict, model)  # as the file holds them: tied weights once, contiguous
        self.digest = tensors_digest(tensors)
        if spare is None or overwrite_safetensors(tensors, spare, directory) is None:
            write_safetensors(tensors, directory)

    def _load(self, directory: Path, version: int) -> None:
        self.client.reload_weights(directory, direct=self.direct, tensors_sha256=self.digest)
        self.client.set_weight_version(version_label(version))

    def _retire(self, previous: Path) -> None:
        self.spare = previous

    def served_label(self, client: VLLMClient | None = None) -> str:
        """The weight label of the server of ``client`` (default: this push's; a replica's client with several),
        ``step-N`` after a verified push of version N (``/weight_info``)."""
        return (client or self.client).weight_version()

    def close(self) -> None:
        """Remove the pushes' directories (the server keeps its weights in memory)."""
        super().close()
        if self.spare is not None:
            shutil.rmtree(self.spare, ignore_errors=True)
            self.spare = None


@dataclass
class AdapterTransport(DirectoryTransport):
    """A LoRA adapter: each push writes the adapter (``adapter_model.safetensors`` + ``adapter_config.json``) to
    ``root/v{version}``, loads it into the server as :func:`grpo_steps.lora.adapter_name` of the version (vLLM's
    runtime LoRA loading) and points ``client`` (the rollout client) at it, then unloads the previous push's adapter
    and removes its directory."""

    base_model: str = ""
    """The server's name of the base weights."""
    current_name: str | None = field(default=None, init=False)
    previous_name: str | None = field(default=None, init=False)

    def _bytes_needed(self, state_dict: dict) -> int:
        return safetensors_bytes({k: t for k, t in state_dict.items() if ".lora_" in k})  # what PEFT keeps

    def _write(self, state_dict: dict, directory: Path, model) -> None:
        # model: the unwrapped PeftModel; PEFT picks the adapter's entries of the full state dict
        model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)

    def _load(self, directory: Path, version: int) -> None:
        name = adapter_name(self.base_model, version)

        def load(client: VLLMClient) -> None:  # on each replica: one may hold it already and another not
            if name in client.served_adapters():  # left by an earlier attempt (a crash, a resume)
                client.unload_lora_adapter(name)
            client.load_lora_adapter(name, directory)

        self.client.each(load)
        self.client.model = name
        self.previous_name, self.current_name = self.current_name, name

    def _retire(self, previous: Path) -> None:
        if self.previous_name is not None and self.previous_name != self.current_name:
            self.client.unload_lora_adapter(self.previous_name)
        self.previous_name = None
        super()._retire(previous)

    def served_label(self, client: VLLMClient | None = None) -> str:
        """``step-N`` when the server of ``client`` (default: this push's) serves the last pushed adapter from its
        directory, else a description of what it serves (see :func:`check_served_version`)."""
        served = (client or self.client).served_adapters()
        if self.current_name is not None and served.get(self.current_name) == str(self.current):
            return version_label(int(self.current.name[1:]))
        return f"adapters {served}"

    def close(self) -> None:
        """Unload the last adapter and remove its directory. A server that no longer answers is reported on
        stderr, not raised (this runs in a ``finally`` and must not hide the error that ended training)."""
        if self.current_name is not None:
            try:
                self.client.unload_lora_adapter(self.current_name)
            except GenerationServerError as err:
                print(f"[weight-sync] could not unload adapter {self.current_name}: {err}", file=sys.stderr)
            self.current_name = None
        super().close()


def merged_state_dict(model) -> dict:
    """Base + active adapter merged, under the base model's parameter names, for a full-weights push
    (``train.peft.push: merged``): each adapted layer's weight plus PEFT's ``get_delta_weight`` (``B A * alpha /
    r``, fan-in/fan-out handled by PEFT); the adapter's own tensors left out. ``model``: the unwrapped
    ``PeftModel`` with full (not ZeRO-3-partitioned) parameters; it is not changed (no merge/unmerge round trip that
    would add rounding to the base weights every step). Returns new tensors on the model's device, detached.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    base = model.get_base_model()
    with torch.no_grad():
        deltas = {name: module.get_delta_weight(adapter) for name, module in base.named_modules()
                  if isinstance(module, LoraLayer) and adapter in module.lora_A}
        merged = {}
        for key, tensor in base.state_dict().items():
            if ".lora_" in key:
                continue
            owner, _, leaf = key.rpartition(".base_layer.")
            if owner:
                key = f"{owner}.{leaf}"
                if leaf == "weight" and owner in deltas:
                    tensor = tensor + deltas[owner].to(tensor.dtype)
            merged[key] = tensor.detach()
    return merged


SYNC_PREFIX = "grpo-sync-"


def sync_root(sync_dir: str | None, output_dir: str) -> Path:
    """A new directory for this run's pushes, owned by this process (:data:`OWNER_FILE`): under ``sync_dir``
    (``generation.sync_dir``) if set, else under ``/dev/shm`` (RAM-backed) when it exists, else under
    ``{output_dir}/weight-sync``. First removes the directories there that killed runs left
    (:func:`remove_orphan_sync_dirs`)."""
    if sync_dir:
        parent = Path(sync_dir)
    elif Path("/dev/shm").is_dir():
        parent = Path("/dev/shm")
    else:
        parent = Path(output_dir) / "weight-sync"
    parent.mkdir(parents=True, exist_ok=True)
    for orphan in remove_orphan_sync_dirs(parent):
        print(f"[weight-sync] removed {orphan}: left by a training process that no longer runs", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix=SYNC_PREFIX, dir=parent))
    claim_dir(root)
    return root


def remove_orphan_sync_dirs(parent: Path) -> list[Path]:
    """Remove the sync directories under ``parent`` whose owning training process has exited (a run killed with
    ``kill -9`` leaves up to two copies of the weights in ``/dev/shm``; see
    :func:`grpo_steps.processes.remove_orphan_dirs`). Returns the removed directories."""
    return remove_orphan_dirs(parent, SYNC_PREFIX)


