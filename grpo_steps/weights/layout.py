"""What the pipeline's weight-transfer engine checks of a received set of tensors before it loads them (inside the
vLLM worker): exactly the served model's tensors (:func:`served_layout`, :func:`check_layout`) and, for a directory,
exactly the tensors the update request names (:func:`check_digest`). Nothing is loaded when a check fails: the server
keeps the weights it serves.
"""

from __future__ import annotations

import sys

from grpo_steps.weights.manifest import ChainRefusedError, tensors_digest


def read_directory(path: str, tensors_sha256: str, layout: dict | None, file_dtypes: dict | None,
                   into: dict) -> dict:
    """The tensors of the safetensors directory ``path`` (name -> CPU tensor) copied into ``into`` (name -> tensor,
    changed in place and returned: a tensor of the same dtype and shape is written over, any other made anew), checked:
    exactly the served model's (:func:`check_layout`) and exactly the ones the update request names
    (:func:`check_digest`).

    Copied, not used where they lie: the files are memory-mapped, and a writer of a shared volume could change them
    between the check and the load. Into kept tensors: fresh memory page-faults in slower than the copy itself on the
    2-core box (the chain's reader keeps its copy for the same reason), so a server keeps one copy of the weights
    between directory updates.

    Raises:
        FileNotFoundError: ``path`` holds no safetensors.
        ValueError: other tensors than the served model's.
        ChainRefusedError: other tensors than the request's.
    """
    from grpo_steps.weights.files import read_safetensors

    files = read_safetensors(path)
    for name in set(into) - set(files):
        del into[name]
    for name, t in files.items():
        kept = into.get(name)
        if kept is None or kept.dtype != t.dtype or kept.shape != t.shape:
            into[name] = t.clone()
        else:
            kept.copy_(t)
    del files
    check_layout(into, layout, path, file_dtypes)
    check_digest(into, tensors_sha256, path)
    return into


def check_digest(tensors: dict, tensors_sha256: str, source: str) -> None:
    """Refuse ``tensors`` (name -> tensor, read from ``source``) unless their digest
    (:func:`~grpo_steps.weights.manifest.tensors_digest`, per-tensor BLAKE3) is ``tensors_sha256``, the one the
    token-authenticated update request names: a file on a shared volume swapped after the trainer (or the
    ``evaluate`` step) wrote it is not loaded.

    Raises:
        ChainRefusedError: another digest (both named, shortened).
    """
    digest = tensors_digest(tensors)
    if digest != tensors_sha256:
        raise ChainRefusedError(f"the weights in {source} are not the ones the update request names (tensors SHA-256 "
                                f"{digest[:16]}..., the request's {tensors_sha256[:16]}...): changed after they were "
                                "written; refused, the server keeps the weights it serves")


def served_layout(vllm_config) -> tuple[dict | None, dict | None]:
    """``({name: (dtype, shape)}, {name: file dtype})`` of the served model's checkpoint tensors, read from the
    safetensors headers of its directory (``model_config.model``, or its snapshot in the Hugging Face cache); nothing
    is loaded. A floating-point tensor's dtype is the serving dtype (``--dtype``, ``model_config.dtype``: vLLM cast the
    files to it at start-up, and every publisher of a version casts to it: ``model.dtype``); any other keeps the file's.
    The file dtypes are kept too: a directory may hold the checkpoint's own (:func:`check_layout`). ``(None, None)``,
    with a line on stderr, when no such file is found (then a version's tensors are not checked against the model)."""
    import glob
    import os

    from safetensors import safe_open

    model = str(vllm_config.model_config.model)
    directory = model if os.path.isdir(model) else None
    if directory is None:
        try:
            from huggingface_hub import snapshot_download

            directory = snapshot_download(model, revision=vllm_config.model_config.revision, local_files_only=True,
                                          allow_patterns=["*.safetensors"])
        except Exception as err:  # noqa: BLE001  (reported below: the check is skipped, not the server)
            print(f"[grpo_steps.weights.layout] no local checkpoint of {model} to check pushed tensors against: {err}",
                  file=sys.stderr)
            return None, None
    serving = dtype_name(vllm_config.model_config.dtype)
    layout, file_dtypes = {}, {}
    for path in sorted(glob.glob(f"{directory}/*.safetensors")):
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                file_dtypes[name] = SAFETENSORS_DTYPE_NAMES.get(tensor.get_dtype(), tensor.get_dtype())
                floating = tensor.get_dtype() in FLOAT_CODES
                layout[name] = (serving if floating else file_dtypes[name], tuple(tensor.get_shape()))
    return (layout, file_dtypes) if layout else (None, None)


SAFETENSORS_DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                           "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
"""A safetensors header's dtype code -> the dtype's name as a manifest and ``torch`` name it (huggingface/safetensors
README, "Format")."""
FLOAT_CODES = ("F64", "F32", "F16", "BF16")
"""The codes of the floating-point dtypes vLLM casts to the serving dtype at start-up (not the float8 of a quantized
checkpoint, which it keeps)."""


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a manifest's name of a dtype).

    >>> import torch
    >>> dtype_name(torch.bfloat16), dtype_name(torch.float32)
    ('bfloat16', 'float32')
    """
    return str(dtype).removeprefix("torch.")


def check_layout(tensors: dict, layout: dict | None, source: str, file_dtypes: dict | None = None) -> None:
    """Refuse ``tensors`` (a directory's, name -> tensor) unless they are exactly ``layout``'s names and shapes, each in
    the layout's dtype (the serving dtype) or in the dtype the served checkpoint's file holds (``file_dtypes``: the
    ``evaluate`` step's baseline is those very files, which vLLM cast at start-up).

    Raises:
        ValueError: a tensor is missing, left over, of another shape or of another dtype (names three at most).
    """
    if layout is None:
        return
    missing, extra = sorted(set(layout) - set(tensors)), sorted(set(tensors) - set(layout))
    both = layout.keys() & tensors.keys()
    wrong = [n for n in both if tuple(tensors[n].shape) != tuple(layout[n][1])]
    dtypes = [f"{n} {dtype_name(tensors[n].dtype)} (served {layout[n][0]})" for n in sorted(both)
              if dtype_name(tensors[n].dtype) not in (layout[n][0], (file_dtypes or {}).get(n))]
    if missing or extra or wrong or dtypes:
        raise ValueError(f"the weights in {source} are not the served model's tensors: missing {missing[:3]}, not in "
                         f"the model {extra[:3]}, other shape {sorted(wrong)[:3]}, other dtype {dtypes[:3]}; refused, "
                         "the server keeps the weights it serves (publish in model.dtype, the serving dtype)")
