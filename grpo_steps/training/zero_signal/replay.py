"""``zero_signal_groups: replay``: Axolotl's replay buffer (Axolotl GRPO docs, "Replay buffer"). Each process keeps
its own :class:`grpo_steps.training.zero_signal.plan.ReplayBuffer` of its own groups with signal (at most
``replay_buffer_size`` groups, none older than ``replay_max_age`` optimizer steps; empty again after a resume) and
puts them in the places of its groups without signal. Replayed groups keep the advantages they were generated with
(as Axolotl's buffer does); what TRL computed with the policy of their time is recomputed (:func:`rescore_rows`).
"""

from __future__ import annotations

import torch

from grpo_steps import trl_hooks
from grpo_steps.training.distributed import reduce_over_processes
from grpo_steps.training.zero_signal import ZeroSignalMode
from grpo_steps.training.zero_signal.plan import (
    ReplayBuffer,
    fill_from_buffer,
    importance_weights,
    plan_replay,
    replayed_rows,
    signal_groups,
)


class Replay(ZeroSignalMode):
    """One generation round whose groups without signal are replaced by buffered groups with signal of earlier rounds
    (newest first, each once per batch; :func:`grpo_steps.training.zero_signal.plan.plan_replay`); then this round's
    groups with signal join the buffer. Local to each process but for the collective token count, the rescoring
    forward and the metrics: ``zero_signal/frac_before``, ``frac_after``, ``replayed`` (groups replayed per generation
    batch), ``buffer_size`` (groups in the buffers of all processes after the batch), and when some group was
    replayed ``replay_age`` (their mean age, optimizer steps) and ``replay_is_weight`` (mean importance weight of
    their loss tokens, or completions with the ``sequence_*`` modes; 0 where the correction masks them)."""

    correction_in_loss = False  # replayed rows are re-weighed at generation, for zero_signal/replay_is_weight

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer

    def generate(self, trainer, inputs: list[dict]) -> dict:
        g, step, accelerator = trainer.num_generations, trainer.state.global_step, trainer.accelerator

        def total(value: float, reduce: str = "sum") -> float:
            return reduce_over_processes(accelerator, value, reduce)

        fresh = trainer.generate_round(inputs)
        signal = signal_groups(fresh["advantages"], g)
        recent = self.buffer.newest_first(step)
        sources = plan_replay(signal, len(recent))
        used = [recent[k] for k in sources if k >= 0]
        output = fill_from_buffer(fresh, sources, [group.batch for group in recent], g) if used else fresh
        rows = replayed_rows(sources, g).to(output["advantages"].device)
        # the policy's forward is collective under ZeRO-3 (parameters gathered layer by layer): every process scores
        # as many rows as the process with the most, or none when no process replays
        most = int(total(len(rows), "max"))
        weight = rescore_rows(trainer, output, rows, most) if most else (0.0, 0)
        self.buffer.add(fresh, signal, g, step)  # after planning: a batch never replays its own groups
        # TRL's num_items_in_batch counts the loss's tokens of all processes; every process calls (collective)
        local = output["completion_mask"] * output.get("tool_mask", 1)
        output["num_items_in_batch"] = torch.tensor(total(local.sum()), device=local.device)
        places, replayed, with_signal = total(len(signal)), total(len(used)), total(int(signal.sum()))
        buffered, age = total(len(self.buffer)), total(sum(step - group.step for group in used))
        weight_sum, weight_count = total(weight[0]), total(weight[1])
        trl_hooks.log_metric(trainer, "zero_signal/frac_before", 1 - with_signal / places)
        trl_hooks.log_metric(trainer, "zero_signal/frac_after", 1 - (with_signal + replayed) / places)
        trl_hooks.log_metric(trainer, "zero_signal/replayed", replayed)
        trl_hooks.log_metric(trainer, "zero_signal/buffer_size", buffered)
        if replayed:  # every process agrees (reduced values): no metric point when nothing was replayed
            trl_hooks.log_metric(trainer, "zero_signal/replay_age", age / replayed)
            if weight_count:
                trl_hooks.log_metric(trainer, "zero_signal/replay_is_weight", weight_sum / weight_count)
        return output


def rescore_rows(trainer, output: dict, rows: torch.Tensor, scored: int) -> tuple[float, int]:
    """Recompute in ``output``, for ``rows`` ((R,) long), what TRL's generation round computed with the policy at
    generation time: ``old_per_token_logps`` (the current policy's, no grad, as TRL scores them) and
    ``importance_sampling_ratio`` (:func:`grpo_steps.training.zero_signal.plan.importance_weights` of the current
    policy against the buffered sampler's logprobs: the older policy that generated the group). The reference model
    does not change (``train.grpo.sync_ref_model`` is refused with replay), so buffered ``ref_per_token_logps`` stay
    right. Returns (sum, count) of the new weights over loss tokens (per completion with the ``sequence_*`` modes),
    for the metric. ``scored`` (>= R, the same on every process) rows go through the policy: ``rows`` padded with row
    0 of the batch, whose logprobs are dropped, so that every process makes the same forward calls (ZeRO-3 gathers
    parameters collectively in each one)."""
    from trl.models.utils import disable_gradient_checkpointing

    padded = torch.cat([rows, rows.new_zeros(scored - len(rows))])  # (scored,)
    completion_ids = output["completion_ids"][padded]
    ids = torch.cat([output["prompt_ids"][padded], completion_ids], dim=1)  # (scored, P+C)
    attention_mask = torch.cat([output["prompt_mask"][padded], output["completion_mask"][padded]], dim=1)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        logps = trl_hooks.policy_logps(trainer, trainer.model, ids, attention_mask, completion_ids.size(1),
                                       batch_size=trainer.args.per_device_train_batch_size)
    if not len(rows):
        return 0.0, 0
    logps, completion_mask = logps[:len(rows)], output["completion_mask"][rows]  # (R, C)
    if "old_per_token_logps" in output:
        output["old_per_token_logps"][rows] = logps
    if "importance_sampling_ratio" not in output:
        return 0.0, 0
    mask = completion_mask * output["tool_mask"][rows] if "tool_mask" in output else completion_mask
    ratio = importance_weights(logps, output["sampling_per_token_logps"][rows], mask,
                               trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min,
                               trainer.vllm_importance_sampling_clip_max)
    output["importance_sampling_ratio"][rows] = ratio
    weights = ratio if trainer.vllm_importance_sampling_mode.startswith("sequence") else ratio[mask.bool()]
    return float(weights.sum()), weights.numel()
