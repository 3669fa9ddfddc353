"""Weight files: a state dict or a model written as safetensors, as the generation server and
``from_pretrained`` read them. Used by the model cache (:mod:`grpo_steps.models`), the tiny test model
(:mod:`grpo_steps.dev.tiny_model`), the ``disk`` weight pushes (:mod:`grpo_steps.training.generation.disk`) and the
vLLM worker (:mod:`grpo_steps.vllm_worker`).

A push writes a new directory each time (vLLM issue #32718: reloading from the same directory can serve
stale weights), or rewrites an older push's file in place under a new directory name
(:func:`overwrite_safetensors`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path


class NoSpaceError(OSError):
    """A directory has no room for weights about to be written (``errno.ENOSPC``); the message names the directory,
    the bytes needed and free, and the config key that moves or enlarges it."""


def _mib(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.0f} MiB)"


def no_space(what: str, directory: str | Path, needed: int, key: str) -> NoSpaceError:
    """The :class:`NoSpaceError` for ``what`` needing ``needed`` bytes in ``directory`` (the free space now)."""
    free = shutil.disk_usage(_existing(Path(directory))).free
    return NoSpaceError(errno.ENOSPC, f"{what} needs {_mib(needed)} in {directory}, which has {_mib(free)} free: "
                                      f"free space there or change {key}")


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (what ``disk_usage`` can measure before a directory is made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def require_space(what: str, directory: str | Path, needed: int, key: str, reclaimed: int = 0) -> None:
    """Raise :class:`NoSpaceError` unless the file system of ``directory`` has ``needed`` bytes free, counting
    ``reclaimed`` bytes the write itself frees or reuses (an older file rewritten in place). ``key``: the config key
    the message tells the user to change. One ``statvfs`` call (``shutil.disk_usage``)."""
    if shutil.disk_usage(_existing(Path(directory))).free + reclaimed < needed:
        raise no_space(what, directory, needed - reclaimed, key)


def is_no_space(err: BaseException) -> bool:
    """Whether ``err`` is a full disk: an ``OSError`` with ``ENOSPC`` (or ``EDQUOT``, a quota), or safetensors'
    ``SafetensorError``, which carries the OS error only in its text (``... (os error 28)``)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return f"(os error {errno.ENOSPC})" in str(err) or f"(os error {errno.EDQUOT})" in str(err)


def safetensors_bytes(state_dict: dict) -> int:
    """Upper bound of the size of ``state_dict`` written as one safetensors file, in bytes: every tensor's bytes once
    (tied weights share memory and are written once), plus the JSON header (< 256 bytes per tensor)."""
    tensors = {(t.data_ptr(), t.numel(), t.element_size()): t for t in state_dict.values()}
    return sum(t.numel() * t.element_size() for t in tensors.values()) + 256 * len(state_dict) + 8


def checkpoint_state_dict(state_dict: dict, model=None) -> dict:
    """``state_dict`` as a checkpoint holds it, ready for safetensors: tied weights once (the name
    ``from_pretrained`` and vLLM expect), transformers' load-time weight conversions reverted, tensors
    contiguous. Without ``model`` only contiguity is ensured (then no two entries may share memory)."""
    if model is not None:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        state_dict = remove_tied_weights_from_state_dict(dict(state_dict), model)
        state_dict = revert_weight_conversion(model, state_dict)
    return {name: tensor.detach().contiguous() for name, tensor in state_dict.items()}


def write_safetensors(state_dict: dict, directory: str | Path, model=None) -> Path:
    """Write ``state_dict`` (full, on CPU) as ``directory/model.safetensors``; nothing else is written.

    ``directory`` must not exist (a fresh directory per push, see the module doc). Tied weights are
    written once when ``model`` is given (see :func:`checkpoint_state_dict`). Returns ``directory``.

    Raises:
        FileExistsError: ``directory`` exists.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = checkpoint_state_dict(state_dict, model)
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


_SAFETENSORS_DTYPES = {"F64": "torch.float64", "F32": "torch.float32", "F16": "torch.float16",
                       "BF16": "torch.bfloat16", "I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16",
                       "I8": "torch.int8", "U8": "torch.uint8", "BOOL": "torch.bool"}


def _safetensors_layout(path: Path) -> tuple[int, dict]:
    """(offset of the data section in bytes, the header's tensor entries) of the safetensors file ``path``
    (format: 8-byte little-endian header length, JSON header, data; huggingface/safetensors README)."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def safetensors_params(model_dir: str | Path) -> int | None:
    """Parameters stored in the ``*.safetensors`` files of ``model_dir``, counted from their headers (nothing is
    loaded); None when it is not a directory holding any (a hub id not downloaded)."""
    import math

    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    counts = [math.prod(entry["shape"]) for file in files for entry in _safetensors_layout(file)[1].values()]
    return sum(counts) if files else None


def read_safetensors(model_dir: str | Path) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``model_dir`` (name -> CPU tensor, memory-mapped: a view of the
    file, which changes with it), as the generation server reads a weight directory (the vLLM worker reads through
    this function: the module imports nothing of the project).

    Raises:
        FileNotFoundError: ``model_dir`` holds no ``*.safetensors`` file.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors file")
    tensors = {}
    for path in files:
        with safe_open(path, "pt") as handle:
            tensors.update((name, handle.get_tensor(name)) for name in handle.keys())
    return tensors


def overwrite_safetensors(state_dict: dict, old: str | Path, directory: str | Path, model=None) -> Path | None:
    """Move the push directory ``old`` to ``directory`` and overwrite its ``model.safetensors`` in place with
    ``state_dict`` when the file holds exactly these tensors (names, dtypes, shapes): the bytes a fresh
    :func:`write_safetensors` would write, without allocating fresh RAM-disk pages (on the 2-core CPU,
    SmolLM2-135M: ~0.10 s instead of ~0.19 s, 2026-11-24). The server reads it under the new path only.

    Returns ``directory``, or None when the layout differs (then ``old`` is removed and nothing written).

    Raises:
        FileExistsError: ``directory`` exists.
        OSError: the file could not be written (``directory`` is then removed).
    """
    import torch

    old, directory = Path(old), Path(directory)
    if directory.exists():
        raise FileExistsError(directory)
    tensors = checkpoint_state_dict(state_dict, model)
    start, header = _safetensors_layout(old / "model.safetensors")
    if header.keys() != tensors.keys() or any(
            _SAFETENSORS_DTYPES.get(entry["dtype"]) != str(tensors[name].dtype)
            or list(entry["shape"]) != list(tensors[name].shape) for name, entry in header.items()):
        shutil.rmtree(old, ignore_errors=True)
        return None
    old.rename(directory)
    try:
        fd = os.open(directory / "model.safetensors", os.O_WRONLY)
        try:
            for name, entry in header.items():
                data = memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy())
                offset, end = start + entry["data_offsets"][0], start + entry["data_offsets"][1]
                if end - offset != len(data):
                    raise OSError(f"{name}: {len(data)} bytes do not fit the file's {end - offset}")
                while data:  # os.pwrite may write less than asked (at most ~2 GiB at once on Linux)
                    written = os.pwrite(fd, data, offset)
                    data, offset = data[written:], offset + written
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def save_weights(model, directory: str | Path, state_dict: dict | None = None) -> Path:
    """Write ``model``'s weights (or the given full ``state_dict``) as safetensors into ``directory``
    with ``save_pretrained`` (config and generation config too). Call on rank 0 only. Returns the dir."""
    directory = Path(directory)
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    return directory


def save_model_dir(model, tokenizer, target: Path) -> Path:
    """Save ``model`` (safetensors) and ``tokenizer`` into ``target`` atomically and return ``target``:
    written to ``<target>.partial`` and renamed, so a half-written cache entry is never used."""
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def weights_sha256(model_dir: str | Path) -> str:
    """Hex SHA-256 of the ``*.safetensors`` files of ``model_dir`` (names and bytes, in name order): the registered
    model's ``weights.sha256`` tag. Reads every byte once (about 1 s per GB)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()


def weights_fingerprint(state_dict: dict, samples: int = 256) -> tuple[float, ...]:
    """A cheap digest of a state dict: for each non-empty tensor, the float64 sum of about ``samples`` of its elements
    taken at an even stride (in ``state_dict`` order). Equal weights give equal digests; an optimizer step changes
    the digest (it moves nearly every element of each layer it updates). Tells whether two pushes carried different
    weights without keeping either; ~5 ms for SmolLM2-135M on the 2-core CPU."""
    import torch

    sums = [t.detach().reshape(-1)[:: max(1, t.numel() // samples)].double().sum()
            for t in state_dict.values() if t.numel()]
    return tuple(torch.stack(sums).tolist()) if sums else ()
