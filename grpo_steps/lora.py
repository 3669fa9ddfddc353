"""LoRA training (``train.peft``): target checks, adapter-only weight sync, merging for registration.

With ``train.peft`` TRL's ``GRPOTrainer`` wraps the policy in a ``peft.PeftModel`` (``peft_config=``); the
optimizer, the checkpoints (``adapter_model.safetensors`` + optimizer state) and the weight sync then hold the
adapter only. ``disk`` sync pushes the adapter through vLLM's runtime LoRA loading: rank 0 writes it into a fresh
directory, the server loads it under a new model name per push (:func:`adapter_name`), rollouts request that
name, and the previous adapter is unloaded. The server's base weights never change, so the baseline of the
evaluation is the served base model and the trained policy is base + the final adapter.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpo_steps.config import ConfigError, PeftConfig
from grpo_steps.weight_sync import GenerationServerError, VLLMClient, version_label


def adapter_name(served_model: str, version: int | str) -> str:
    """Model name the server serves the adapter of weight version ``version`` under.

    >>> adapter_name("policy", 3)
    'policy-lora-step-3'
    >>> adapter_name("policy", "final")
    'policy-lora-final'
    """
    label = version_label(version) if isinstance(version, int) else version
    return f"{served_model}-lora-{label}"


def linear_module_names(model_path: str) -> list[str]:
    """Sorted distinct last name parts of the ``torch.nn.Linear`` modules of the model in ``model_path`` (its
    ``config.json``), the LM head (output embeddings) excluded. Builds the model on the meta device: no weights
    are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})


def check_target_modules(peft_cfg: PeftConfig, model_path: str) -> None:
    """Raise unless every ``train.peft.target_modules`` entry names a linear layer of the model (LM head
    excluded) at ``model_path``; ``all-linear`` always passes.

    Raises:
        ConfigError: names the missing modules and the ones the architecture has.
    """
    if peft_cfg.target_modules == "all-linear":
        return
    available = linear_module_names(model_path)
    missing = [name for name in peft_cfg.target_modules if name not in available]
    if missing:
        raise ConfigError(f"train.peft.target_modules {missing} are not linear layers of the model {model_path}: "
                          f"choose among {available}, or use 'all-linear'")


@dataclass
class AdapterPush:
    """Rank 0's half of ``disk`` sync with LoRA: each push writes the adapter (``adapter_model.safetensors`` +
    ``adapter_config.json``) to ``root/v{version}``, loads it into the server as :func:`adapter_name` of the
    version, points ``client`` (the rollout client) at it, then unloads the previous push's adapter and removes its
    directory. Same interface as :class:`grpo_steps.weight_sync.DiskWeightPush`."""

    client: VLLMClient
    root: Path
    base_model: str  # the server's name of the base weights
    current: Path | None = field(default=None, init=False)
    current_name: str | None = field(default=None, init=False)

    def push(self, state_dict: dict, version: int, model=None) -> dict[str, float]:
        """Write and load the adapter of ``model`` (the unwrapped ``PeftModel``; ``state_dict``: the full state dict
        gathered from it, the adapter's entries are picked by PEFT). Returns ``{"write_seconds",
        "reload_seconds"}``.

        Raises:
            GenerationServerError: the server failed a request.
        """
        start = time.perf_counter()
        directory = Path(self.root) / f"v{version}"
        if directory.exists():  # a retried push of the same step: never reload a reused directory
            shutil.rmtree(directory)
        model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        written = time.perf_counter()
        name = adapter_name(self.base_model, version)
        if name in self.client.served_adapters():  # left by an earlier attempt (a crash, a resume)
            self.client.unload_lora_adapter(name)
        self.client.load_lora_adapter(name, directory)
        self.client.model = name
        loaded = time.perf_counter()
        previous, previous_name = self.current, self.current_name
        self.current, self.current_name = directory, name
        if previous_name is not None and previous_name != name:
            self.client.unload_lora_adapter(previous_name)
        if previous is not None and previous != directory:
            shutil.rmtree(previous, ignore_errors=True)
        return {"write_seconds": written - start, "reload_seconds": loaded - written}

    def served_label(self) -> str:
        """``step-N`` when the server serves the last pushed adapter from its directory, else a description of
        what it serves (see :func:`grpo_steps.weight_sync.check_served_version`)."""
        served = self.client.served_adapters()
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
        if self.current is not None:
            shutil.rmtree(self.current, ignore_errors=True)
            self.current = None


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


def is_adapter_dir(path: str | Path) -> bool:
    """True when ``path`` holds a PEFT adapter (``adapter_config.json``), not full weights."""
    return (Path(path) / "adapter_config.json").is_file()


def merge_adapter(base_model: str, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Base weights + adapter merged (W + alpha/r B A, ``PeftModel.merge_and_unload``) into a plain transformers
    model saved (safetensors, float32, with the tokenizer of ``adapter_dir``, else of ``base_model``) in ``out_dir``.
    Returns ``out_dir``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    tokenizer_source = adapter_dir if (Path(adapter_dir) / "tokenizer_config.json").is_file() else base_model
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(out_dir)
    return out_dir
