"""TRL's trainer–inference mismatch correction weighed in the loss's own forward, when that forward scores the batch
with the weights TRL's separate scoring pass would use.

TRL 1.16 scores every batch that vLLM sampled with the policy before training on it
(``GRPOTrainer._generate_and_score_completions``: "When using vLLM, we always compute old_per_token_logps"): one
no-grad forward over the whole generation batch, for the weight rho = pi_policy / pi_sampler of each token (or
completion) and the ``sampling/*`` metrics. When the batch is trained whole within the optimizer step it was
sampled for (``gradient_accumulation_steps`` a multiple of ``steps_per_generation x num_iterations``: TRL's own
condition for skipping ``old_per_token_logps`` on its other backends, ``_compute_loss``: "old_per_token_logps ==
per_token_logps"), the loss's forward of each micro-batch runs the same weights on the same rows, so its logprobs,
detached, are the scoring pass's, up to float rounding of a different batch composition. Taking them from there
saves that pass: a fifth of a training step's compute on the 2-core box (docs/benchmarks.md, "Where a make run's time
goes"). The weight is :func:`grpo_steps.training.zero_signal.plan.importance_weights` (TRL's lines, pinned by the
contract test) and the metrics are TRL's, over the same tokens, gathered the same way, once per generation batch.

:class:`LossSideCorrection` is used by :class:`grpo_steps.training.trainer.ServerGRPOTrainer`, which turns TRL's pass
off for the generation round and hands each micro-batch's policy logprobs to :meth:`LossSideCorrection.weigh` before
TRL's loss reads ``importance_sampling_ratio``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_steps.training.zero_signal.plan import importance_weights


def applies(trainer) -> bool:
    """Whether ``trainer`` (a :class:`grpo_steps.training.trainer.ServerGRPOTrainer` after TRL's constructor) may
    weigh the correction in the loss: the correction is on, every generation batch is trained within one optimizer
    step (TRL's alignment condition), and its zero-signal mode trains every micro-batch as generated
    (:attr:`grpo_steps.training.zero_signal.ZeroSignalMode.correction_in_loss`)."""
    every = trainer.args.steps_per_generation * trainer.num_iterations  # micro-steps per generation batch
    return bool(trainer.vllm_importance_sampling_correction and trainer.args.gradient_accumulation_steps % every == 0
                and trainer.zero_signal.correction_in_loss)


def loss_mask(batch: dict) -> torch.Tensor:
    """The tokens of ``batch`` (a generation batch or micro-batch) the loss trains on, (B, T): ``completion_mask``,
    without tool answers (``tool_mask``: not the policy's tokens)."""
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if "tool_mask" in batch else mask


def on_policy_support(model, gen, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                      tool_mask: list[list[int]] | None, sampling_logps: list[list[float | None]], group: int,
                      grammar=None) -> tuple[list[list[float | None]], list[float]]:
    """The sampler's logprobs of a generation round put on the support TRL scores the policy on, for rollouts
    sampled with truncating or reshaping filters (``generation.top_k`` / ``top_p`` / ``min_p`` /
    ``repetition_penalty``, :attr:`grpo_steps.config.GenerationConfig.reshapes_sampling`) or under a grammar
    (``generation.structured_outputs``: ``grammar``, a :class:`grpo_steps.training.grammar.GrammarMask`, re-applied
    turn by turn: the tools' answers between turns are no policy tokens).

    vLLM returns each token's logprob under the distribution it sampled from (processed logprobs: renormalised over
    the tokens the filters keep), TRL the policy's over the whole vocabulary at the temperature, so without this the
    ratio exp(policy - sampler) carries the kept mass S of every position (its mean is S: trl #6789, 0.986 at top-k
    50 and 0.602 at top-p 0.8 in make run's task, docs/benchmarks.md). Each policy token's sampler logprob gets
    :func:`grpo_steps.training.sampling.support_shifts` added (log pi_T - log q_pi, the filters re-applied on the
    policy's logits), so the correction weighs q_pi / q_sampler, which is 1 where the sampler holds the policy's
    weights, and TRL's off-policy mask and ``sampling/*`` metrics read the same shifted values.

    Args:
        model: the policy (this process's; the weights TRL's correction scores the round with).
        gen: the :class:`grpo_steps.config.GenerationConfig` the round was sampled with.
        prompt_ids, completion_ids: B token lists each (TRL's ``_generate`` output; a completion holds its tool
            turns), in groups of ``group`` rows with one prompt (``num_generations``; TRL's order).
        tool_mask: B lists of C_i 0/1 (1: a policy token), or None (every token the policy's).
        sampling_logps: B lists of C_i sampler logprobs (None: a token vLLM could not score, kept None).

    Returns:
        ``(shifted, shifts)``: the B shifted lists, and the shift of every policy token (nats, <= 0 under pure
        truncation; for the ``sampling/support_log_mass`` metric).

    Raises:
        ValueError: B is not whole groups of ``group`` rows with one prompt.
    """
    from grpo_steps.training.sampling import support_shifts

    shifted, shifts = [], []
    for start in range(0, len(prompt_ids), group):  # fixed groups: every ZeRO-3 rank forwards as often
        prompts = prompt_ids[start:start + group]
        if len(prompts) != group or any(p != prompts[0] for p in prompts):
            raise ValueError(f"rows {start}..{start + len(prompts) - 1} of the generation round are not one group of "
                             f"{group} completions of one prompt")
        own = tool_mask[start:start + group] if tool_mask is not None else None
        group_shifts = support_shifts(model, prompts[0], completion_ids[start:start + group], gen, grammar, own)
        for i, shift in enumerate(group_shifts, start):
            mask = tool_mask[i] if tool_mask is not None else [1] * len(completion_ids[i])
            row = []
            for lp, own, d in zip(sampling_logps[i], mask, shift, strict=True):
                if own and lp is not None:
                    row.append(lp + d)
                    shifts.append(d)
                else:
                    row.append(lp)
            shifted.append(row)
    return shifted, shifts


def reapply_filters(model, gen, result: tuple, group: int, grammar, log: Callable[[str, float], None]) -> tuple:
    """TRL's ``_generate`` output ``result`` (prompt ids, completion ids, tool mask, ..., the sampler's logprobs
    fifth) with the sampler's logprobs put on the policy's support (:func:`on_policy_support`: the filters, and
    ``grammar``'s mask, re-applied on ``model``'s logits). Logs (``log(name, value)``) the mean shift
    ``sampling/support_log_mass/mean`` and, with a grammar, ``sampling/grammar_diverged_turns``: the turns its mask
    could not follow (a server with another grammar backend), counted since the last round."""
    prompt_ids, completion_ids, tool_mask, _, sampling_logps, *_ = result
    shifted, shifts = on_policy_support(model, gen, prompt_ids, completion_ids, tool_mask, sampling_logps, group,
                                        grammar)
    if shifts:
        log("sampling/support_log_mass/mean", sum(shifts) / len(shifts))
    if grammar is not None:
        log("sampling/grammar_diverged_turns", float(grammar.diverged))
        grammar.diverged = 0
    return (*result[:4], shifted, *result[5:])


REPLICA_ROWS = "sampling_replica"
"""Key of the generation batch's (B,) int64 tensor: the replica that sampled each row (-1: not known), set by
:class:`grpo_steps.training.trainer.ServerGRPOTrainer` with replicas; TRL's shuffle and split carry it with the rows."""


class ReplicaMismatch:
    """The trainer–inference mismatch per generation replica: ``sampling/replica<i>/sampling_logp_difference/mean``,
    the mean |policy - sampler| logp (nats per token) over the loss tokens of the completions replica i sampled, over
    every process (a token mean; TRL's overall ``sampling/sampling_logp_difference/mean`` averages the processes'
    means). A replica that serves other weights than the policy's shows here before it moves the overall mean.

    Args:
        replicas: how many replicas sample (``len(VLLMClient.replicas)``).
    """

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self._sums = torch.zeros(replicas, dtype=torch.float64)
        self._counts = torch.zeros(replicas, dtype=torch.float64)

    def add(self, batch: dict, policy_logps: torch.Tensor, rows: torch.Tensor) -> None:
        """Count |``policy_logps`` - the sampler's| ((B, T) each: ``batch["sampling_per_token_logps"]``) over the
        batch's loss tokens (:func:`loss_mask`) into the replica of each row (``rows`` (B,), -1: not known, left out);
        NaN differences (tokens vLLM could not score) are left out."""
        delta = torch.abs(policy_logps - batch["sampling_per_token_logps"])
        keep = loss_mask(batch).bool() & ~torch.isnan(delta)
        known = (rows >= 0).cpu()
        rows = rows.cpu()[known]
        self._sums.index_add_(0, rows, torch.where(keep, delta, 0.0).sum(-1).double().cpu()[known])
        self._counts.index_add_(0, rows, keep.sum(-1).double().cpu()[known])

    def metrics(self, accelerator) -> dict[str, float]:
        """The per-replica means since the last call (a collective: every process calls it at the same point), for
        each replica with loss tokens on some process."""
        local = torch.stack([self._sums, self._counts]).to(torch.float32).to(accelerator.device)  # (2, replicas)
        self._sums.zero_()
        self._counts.zero_()
        sums, counts = accelerator.gather(local.unsqueeze(0)).view(-1, 2, self.replicas).sum(dim=0).tolist()
        return {f"sampling/replica{i}/sampling_logp_difference/mean": sums[i] / counts[i]
                for i in range(self.replicas) if counts[i]}



def attribute_replicas(output: dict, rows: torch.Tensor, mismatch: ReplicaMismatch, carried: bool,
                       accelerator) -> dict[str, float]:
    """Which replica sampled each row of the generation batch ``output`` (``rows`` (B,) int64, -1: not known). With
    ``carried`` (the loss weighs the correction: :class:`LossSideCorrection`) the rows go with the batch into the loss
    under :data:`REPLICA_ROWS`, which weighs the mismatch per replica, and nothing is returned; on TRL's own path the
    per-replica mismatch of TRL's scoring pass is counted and returned now (:meth:`ReplicaMismatch.metrics`: a
    collective, every process calls it)."""
    if carried:
        output[REPLICA_ROWS] = rows
        return {}
    if "old_per_token_logps" not in output or "sampling_per_token_logps" not in output:
        return {}
    mismatch.add(output, output["old_per_token_logps"], rows)
    return mismatch.metrics(accelerator)

class LossSideCorrection:
    """The mismatch weights and TRL's ``sampling/*`` metrics of a generation batch, micro-batch by micro-batch.

    Args:
        mode: ``generation.importance_sampling.mode`` (TRL's ``vllm_importance_sampling_mode``).
        clip_min, clip_max: TRL's ``vllm_importance_sampling_clip_min`` / ``_max`` (None: no bound).
        micro_batches: micro-batches per generation batch (``steps_per_generation``); the metrics are complete after
            that many :meth:`weigh` calls.
        replicas: the per-replica mismatch (:class:`ReplicaMismatch`) of batches that carry :data:`REPLICA_ROWS`;
            None: one server.
    """

    def __init__(self, mode: str, clip_min: float | None, clip_max: float | None, micro_batches: int,
                 replicas: ReplicaMismatch | None = None) -> None:
        self.mode, self.clip_min, self.clip_max, self.micro_batches = mode, clip_min, clip_max, micro_batches
        self.replicas = replicas
        self._reset()

    def _reset(self) -> None:
        self._weighed = 0
        # this process's |policy - sampler| logp over loss tokens, and its weights (per token or per completion)
        self._delta_sum, self._delta_count, self._delta_max = 0.0, 0, 0.0
        self._ratio_sum, self._ratio_count, self._ratio_min, self._ratio_max = 0.0, 0, float("inf"), float("-inf")

    def weigh(self, inputs: dict, policy_logps: torch.Tensor) -> None:
        """Set ``inputs["importance_sampling_ratio"]`` ((B, T), or (B, 1) for the ``sequence_*`` modes) from the
        micro-batch's policy logprobs ``policy_logps`` ((B, T) float, detached) and the sampler's
        ``inputs["sampling_per_token_logps"]`` over the loss tokens (``completion_mask`` x ``tool_mask``), and count
        its tokens into the generation batch's metrics. Raises KeyError when the batch has no sampler logprobs."""
        sampling = inputs["sampling_per_token_logps"]
        mask = loss_mask(inputs)
        ratio = importance_weights(policy_logps, sampling, mask, self.mode, self.clip_min, self.clip_max)
        inputs["importance_sampling_ratio"] = ratio
        if self.replicas is not None and REPLICA_ROWS in inputs:
            self.replicas.add(inputs, policy_logps, inputs[REPLICA_ROWS])
        delta = torch.abs(policy_logps - sampling)
        delta = delta[mask.bool() & ~torch.isnan(delta)]  # tokens vLLM could not score (NaN) left out, as TRL does
        weights = ratio.flatten() if self.mode.startswith("sequence") else ratio[mask.bool()]
        if delta.numel():
            self._delta_sum += float(delta.double().sum())
            self._delta_count += delta.numel()
            self._delta_max = max(self._delta_max, float(delta.max()))
        if weights.numel():
            self._ratio_sum += float(weights.double().sum())
            self._ratio_count += weights.numel()
            self._ratio_min = min(self._ratio_min, float(weights.min()))
            self._ratio_max = max(self._ratio_max, float(weights.max()))
        self._weighed += 1

    def metrics(self, accelerator) -> dict[str, float] | None:
        """TRL's ``sampling/*`` metrics of the generation batch once its last micro-batch was weighed (else None),
        gathered over the processes as TRL gathers them: the mean |difference| averaged over processes, its max the
        largest, the weight's min/mean/max as nan-min/nan-mean/nan-max. A process without loss tokens contributes 0
        to each, as in TRL. Every process calls it at the same micro-step: the gather is a collective."""
        if self._weighed < self.micro_batches:
            return None
        local = torch.tensor([
            self._delta_sum / self._delta_count if self._delta_count else 0.0,
            self._delta_max,
            self._ratio_min if self._ratio_count else 0.0,
            self._ratio_sum / self._ratio_count if self._ratio_count else 0.0,
            self._ratio_max if self._ratio_count else 0.0,
        ], dtype=torch.float32, device=accelerator.device)
        self._reset()
        gathered = accelerator.gather(local).view(-1, 5)  # (processes, 5)
        per_replica = self.replicas.metrics(accelerator) if self.replicas is not None else {}
        return {**per_replica,
            "sampling/sampling_logp_difference/mean": gathered[:, 0].mean().item(),
            "sampling/sampling_logp_difference/max": gathered[:, 1].max().item(),
            "sampling/importance_sampling_ratio/min": _finite(gathered[:, 2]).min().item(),
            "sampling/importance_sampling_ratio/mean": gathered[:, 3].nanmean().item(),
            "sampling/importance_sampling_ratio/max": _finite(gathered[:, 4]).max().item(),
        }


def _finite(values: torch.Tensor) -> torch.Tensor:
    """``values`` without NaN (TRL's nanmin/nanmax), or one NaN when all are."""
    kept = values[~torch.isnan(values)]
    return kept if kept.numel() else values[:1]
