"""What the training processes of one run decide or check together: a value reduced over all of them, the DDP
ranks' weights compared, a skipped window's gradients averaged, and the process group left together. Each
function is collective: every process calls it, at the same point.
"""

from __future__ import annotations

import torch


def reduce_over_processes(accelerator, value: float, reduce: str) -> float:
    """``value`` reduced over the processes (``"max"`` or ``"sum"``).

    >>> from accelerate import Accelerator
    >>> reduce_over_processes(Accelerator(cpu=True), 3, "sum")
    3.0
    """
    gathered = accelerator.gather(torch.tensor([float(value)], device=accelerator.device))
    return float(gathered.max() if reduce == "max" else gathered.sum())


def average_accumulated_gradients(accelerator, model) -> None:
    """On the micro-batch that ends a gradient-accumulation window, DDP averages the window's gradients over the
    processes in its backward pass (the others run under ``no_sync``); when ``zero_signal_groups: skip`` drops that
    micro-batch on every process, average them here instead, or each process would step with its own gradients and
    the ranks would drift apart. Nothing to do for one process, or inside the window."""
    if accelerator.num_processes == 1 or not accelerator.sync_gradients:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # the same parameters on every process
    for grad in grads:  # (the same micro-batches ran everywhere: the skip decisions are shared)
        torch.distributed.all_reduce(grad)
        grad.div_(accelerator.num_processes)


def check_ranks_agree(accelerator, model, deepspeed: bool) -> None:
    """Raise unless every training process (rank) holds the same policy weights (a digest per tensor,
    :func:`grpo_steps.weights.files.weights_fingerprint`, gathered). Data parallelism keeps a full copy on each rank
    that must stay equal; ZeRO-3 (``deepspeed``: a partition per process) and a single process have nothing to check.

    Raises:
        RuntimeError: the ranks' weights differ (names the processes' digests' largest gap).
    """
    if accelerator.num_processes == 1 or deepspeed:
        return
    from grpo_steps.weights.files import weights_fingerprint

    digest = torch.tensor(weights_fingerprint(accelerator.unwrap_model(model).state_dict()),
                          dtype=torch.float64, device=accelerator.device)
    gathered = accelerator.gather(digest.unsqueeze(0))  # (processes, tensors)
    gap = float((gathered - gathered[0]).abs().max())
    if gap > 1e-9 * max(1.0, float(gathered.abs().max())):  # equal copies are equal bit for bit
        raise RuntimeError(f"the {accelerator.num_processes} training processes ended with different "
                           f"policy weights (largest digest gap {gap:.3g}): their gradients were not averaged "
                           "alike; the model saved would be process 0's alone")


def shut_down_process_group() -> bool:
    """Leave the distributed job together: a last barrier, then ``destroy_process_group``. Without it each
    rank tears its process group down in interpreter shutdown, in any order (PyTorch warns that this can
    hang), and a rank stuck there holds its node's torchelastic agent from the exit barrier. Returns whether
    there was a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        return True
    return False
