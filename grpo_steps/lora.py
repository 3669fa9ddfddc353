"""LoRA (``train.peft``) on the flow side: target checks, the served adapter's name, merging for evaluation and
registration.

With ``train.peft`` TRL's ``GRPOTrainer`` wraps the policy in a ``peft.PeftModel`` (``peft_config=``); the
optimizer, the checkpoints (``adapter_model.safetensors`` + optimizer state) and the weight sync then hold the adapter
only. ``disk`` sync pushes the adapter through vLLM's runtime LoRA loading
(:class:`grpo_steps.training.generation.disk.AdapterTransport`): the server loads it under a new model name per push
(:func:`grpo_steps.weights.labels.adapter_name`), rollouts request that name, and the previous adapter is unloaded. The
server's base weights never change, so the baseline of the evaluation is the served base model and the trained policy is
base + the final adapter.
"""

from __future__ import annotations

from pathlib import Path

from grpo_steps.config import ConfigError, PeftConfig


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


def is_adapter_dir(path: str | Path) -> bool:
    """True when ``path`` holds a PEFT adapter (``adapter_config.json``), not full weights."""
    return (Path(path) / "adapter_config.json").is_file()


def merge_adapter(base_model: str, adapter_dir: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Base weights + adapter merged (W + alpha/r B A, ``PeftModel.merge_and_unload``) into a plain transformers
    model saved (safetensors, with the tokenizer of ``adapter_dir``, else of ``base_model``) in ``out_dir``: merged in
    float32, saved in ``dtype`` (the serving dtype for a server to load: it refuses another; None: float32).
    Returns ``out_dir``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    if dtype is not None:
        merged = merged.to(getattr(torch, dtype))
    merged.save_pretrained(out_dir, safe_serialization=True)
    tokenizer_source = adapter_dir if (Path(adapter_dir) / "tokenizer_config.json").is_file() else base_model
    AutoTokenizer.from_pretrained(str(tokenizer_source)).save_pretrained(out_dir)
    return out_dir
