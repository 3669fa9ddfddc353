"""TRL's ``GRPOTrainer`` with rollouts from our vLLM server: TRL's own mismatch correction, verified weight pushes.

TRL 1.16 applies its trainer–inference mismatch correction (importance sampling against the sampler's
logprobs, the ``sampling/sampling_logp_difference/*`` and ``sampling/importance_sampling_ratio/*``
metrics, ``importance_sampling_ratio`` in the loss) only when ``self.use_vllm`` is true
(``grpo_trainer.py``: ``_generate_and_score_completions`` and ``_compute_loss``). With a
``rollout_func`` and ``use_vllm=True``, ``GRPOTrainer._generate`` calls ``self.vllm_generation.sync_weights()``
whenever the optimizer step changed and then the ``rollout_func``; TRL's own vLLM client is not used
on that path (``_generate_single_turn`` and the tool loop are not reached without tools).

:class:`ServerGRPOTrainer` therefore only (1) turns ``use_vllm`` on after TRL's constructor ran with it
off (so TRL builds no vLLM client of its own), and (2) sets ``vllm_generation`` to :class:`DiskSync`, whose
``sync_weights()`` is our ``disk`` push followed by its verification. The correction (its settings come
through ``GRPOConfig.vllm_importance_sampling_*``), its metrics and the loss stay TRL's code. It also
checks the first batch after each push (``generation.sync_check.max_logp_diff``); only when that check
cannot run (importance sampling off, or no limit) does the push's verification score a probe with the
policy as well (one extra forward, ~0.1 s for SmolLM2-135M on 2 CPU cores).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field

import torch
from trl import GRPOTrainer

from grpo_steps.servers.client import GenerationServerError, VLLMClient, version_label
from grpo_steps.training.sampling import policy_logprobs, processed_logprobs
from grpo_steps.training.weight_sync import (
    AdapterPush,
    DiskWeightPush,
    ProbeRecord,
    check_served_version,
    mean_abs_diff,
    sync_root,
    weights_fingerprint,
)

PROBE_TOKENS = 16
"""Longest probe sequence, tokens: the policy scores it with one extra forward per push (0.1-0.5 s for
SmolLM2-135M on the 2 shared CPU cores), enough tokens to see any weight change in its logprobs."""
HISTORY = 4
"""Verified pushes remembered to name the version a stale server serves."""
FIRST_BATCH_COMPLETIONS = 4
"""Completions of the first batch after a push that the policy scores again for the first-batch check (one forward
of up to this many sequences per push and process)."""


@dataclass
class DiskSync:
    """Stands in for TRL's ``VLLMGeneration`` (only ``sync_weights`` is called with a ``rollout_func``).

    ``sync_weights()`` (every rank, collective under ZeRO-3): gathers the policy's state dict, rank 0
    fingerprints (:func:`grpo_steps.training.weight_sync.weights_fingerprint`), writes and reloads it through ``push``
    (version = the optimizer step that produced it); with ``probe_policy`` every rank scores the probe with the
    policy; rank 0 asks the server for its label and its probe logprobs and checks them
    (:func:`grpo_steps.training.weight_sync.check_served_version`); the verdict is broadcast so that every rank
    raises together. Metrics (seconds, into the step's log): ``weight_sync/gather_seconds``,
    ``write_seconds``, ``reload_seconds``, ``verify_seconds``, ``seconds`` (total); ``weight_sync/version``;
    with ``probe_policy``, ``weight_sync/probe_logp_diff`` (mean |server - policy| on the probe, nats per token).

    Raises:
        GenerationServerError: the server failed a request or serves other weights than pushed.
    """

    trainer: object
    push: DiskWeightPush | AdapterPush | None  # rank 0 only
    probe_ids: list[int]
    probe_tolerance: float
    history: list[ProbeRecord] = field(default_factory=list)
    probe_policy: bool = True
    """Score the probe with the policy too (set by :class:`ServerGRPOTrainer`: only when the first-batch check
    does not compare the server with the policy)."""
    pushed_version: int | None = None
    first_batch_pending: bool = False
    rollout_client: VLLMClient | None = None
    """LoRA (:class:`grpo_steps.training.weight_sync.AdapterPush`): every rank's rollout client, pointed at the
    pushed adapter's model name after each verified push (rank 0's push does it for its own)."""
    merge_lora: bool = False
    """LoRA with ``train.peft.push: merged``: push base + adapter merged
    (:func:`grpo_steps.training.weight_sync.merged_state_dict`) as full weights."""

    def _log(self, name: str, value: float) -> None:
        # Always the training logs: a push serves the training's rollouts (the pipeline runs no TRL eval loop), and
        # the push made for the evaluation at step 0 (grpo_steps.eval_during) comes before Trainer puts the freshly
        # loaded model (eval mode) into train mode; TRL would drop eval-mode metrics of a training step.
        self.trainer._metrics["train"][f"weight_sync/{name}"].append(value)

    def sync_weights(self) -> None:
        from accelerate.utils import broadcast_object_list

        trainer, accelerator = self.trainer, self.trainer.accelerator
        version = trainer.state.global_step
        start = time.perf_counter()
        policy_model = accelerator.unwrap_model(trainer.model)
        if self.merge_lora:  # full weights under the base model's names (no ZeRO-3: config-checked)
            from grpo_steps.training.weight_sync import merged_state_dict

            state_dict = merged_state_dict(policy_model) if accelerator.is_main_process else {}
            policy_model = policy_model.get_base_model()
        else:  # as Trainer.save_model: under DeepSpeed the engine gathers (ZeRO-3: a collective, the dict on rank 0)
            source = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model
            state_dict = accelerator.get_state_dict(source)
        gathered = time.perf_counter()
        parts = {"write_seconds": 0.0, "reload_seconds": 0.0}
        error: BaseException | None = None  # rank 0's failure, re-raised on every rank after the broadcast
        weights: tuple[float, ...] = ()
        if accelerator.is_main_process:
            try:
                weights = weights_fingerprint(state_dict)
                parts = self.push.push(state_dict, version, model=policy_model)
            except Exception as err:  # noqa: BLE001  (not swallowed: raised on every rank below)
                error = err
        del state_dict
        pushed = time.perf_counter()
        # every rank: a collective forward under ZeRO-3
        policy = policy_logprobs(trainer.model, self.probe_ids) if self.probe_policy else None
        gap = None
        if accelerator.is_main_process and error is None:
            try:
                gap = self._verify(version, weights, policy)
            except Exception as err:  # noqa: BLE001  (not swallowed: raised on every rank below)
                error = err
        message = broadcast_object_list([None if error is None else f"{type(error).__name__}: {error}"])[0]
        if error is not None:
            raise error
        if message is not None:
            raise GenerationServerError(f"rank 0 failed the weight push of step {version}: {message}")
        done = time.perf_counter()
        self.pushed_version, self.first_batch_pending = version, True
        if self.rollout_client is not None:
            from grpo_steps.lora import adapter_name

            self.rollout_client.model = adapter_name(self.rollout_client.base_model, version)
        self._log("gather_seconds", gathered - start)
        self._log("write_seconds", parts["write_seconds"])
        self._log("reload_seconds", parts["reload_seconds"])
        self._log("verify_seconds", done - pushed)
        self._log("seconds", done - start)
        self._log("version", float(version))
        if gap is not None:
            self._log("probe_logp_diff", gap)

    def _verify(self, version: int, weights: tuple[float, ...], policy: list[float] | None) -> float | None:
        """Rank 0: check the server's label and probe (see :func:`check_served_version`); returns the probe's
        mean |server - policy| logp (None without a policy probe). Raises GenerationServerError."""
        record = ProbeRecord(version, weights, self.push.client.prompt_logprobs(self.probe_ids), policy)
        check_served_version(record, self.history, self.push.served_label(), self.probe_tolerance, step=version + 1)
        self.history = (self.history + [record])[-HISTORY:]
        return None if policy is None else mean_abs_diff(record.served, policy)

    def close(self) -> None:
        """Remove this run's sync directory (rank 0; the server keeps the weights in memory)."""
        if self.push is not None:
            self.push.close()
            shutil.rmtree(self.push.root, ignore_errors=True)


def disk_sync(client, tokenizer, probe_prompt, output_dir: str, probe_tolerance: float,
              sync_dir: str | None = None, lora: str | None = None) -> DiskSync:
    """The :class:`DiskSync` of a training process: rank 0 pushes into a fresh :func:`sync_root`; the probe is
    ``probe_prompt`` (a dataset prompt, chat template applied) cut to ``PROBE_TOKENS`` tokens; ``probe_tolerance``
    in nats per token (``SyncCheckConfig.thresholds``). ``lora`` (``train.peft.push``): ``adapter``, push the
    adapter only (:class:`grpo_steps.training.weight_sync.AdapterPush`) and point ``client`` (the rollout client,
    ``client.base_model`` the served base model name) at it after each push; ``merged``, push base + adapter
    merged as full weights; None: full fine-tuning."""
    from accelerate.state import PartialState

    from grpo_steps.data import encode_prompt

    push = None
    if PartialState().is_main_process:
        root = sync_root(sync_dir, output_dir)
        push = (AdapterPush(client, root, base_model=client.base_model) if lora == "adapter"
                else DiskWeightPush(client, root))
    probe_ids = encode_prompt(tokenizer, probe_prompt)[:PROBE_TOKENS]
    return DiskSync(trainer=None, push=push, probe_ids=probe_ids, probe_tolerance=probe_tolerance,
                    rollout_client=client if lora == "adapter" else None, merge_lora=lora == "merged")


class PipelineGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` as every backend runs it here; it records which policy version sampled the latest
    generation batch (``sampled_version``: the optimizer step whose weights generated it), for the completions
    tables. TRL generates from the current policy (``hf``, colocate) or syncs it first (``nccl``)."""

    sampled_version: int = -1

    def _sampled_version(self) -> int:
        return self.state.global_step

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.sampled_version = self._sampled_version()
        return output


class ServerGRPOTrainer(PipelineGRPOTrainer):
    """``GRPOTrainer`` for rollouts from our vLLM server (``rollout_func``) with ``disk`` weight sync.

    Args (besides ``GRPOTrainer``'s):
        args: a ``GRPOConfig`` with ``use_vllm=False`` and the correction in its
            ``vllm_importance_sampling_*`` fields (see :func:`grpo_steps.training.job.grpo_args`).
        sync: a :class:`DiskSync` without its trainer; pushes and verifies before sampling.
        max_logp_diff: the first-batch limit (``SyncCheckConfig.thresholds``; nats per token; None: unchecked).
        rollout_func: a :class:`grpo_steps.training.rollouts.VLLMRollout` (its ``last_batch`` is checked).

    Raises:
        ValueError: ``args.use_vllm`` is set (TRL would start its own vLLM client).
        GenerationServerError: from the push, or when the first completions sampled after a push have a mean
            |sampling logp - policy logp| above ``max_logp_diff`` (the policy's logprobs taken under the configured
            sampling settings; not with structured outputs, whose grammar only the server knows: then the push's
            probe is compared with the policy instead).
    """

    def __init__(self, *args, sync: DiskSync, max_logp_diff: float | None, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout = kwargs.get("rollout_func")  # a VLLMRollout: its last batch is what the first-batch check scores
        if self.args.use_vllm:
            raise ValueError("ServerGRPOTrainer brings its own generation: build it with GRPOConfig(use_vllm=False)")
        # TRL's gate of the vLLM paths (grpo_trainer.py: _generate -> vllm_generation.sync_weights(), the
        # correction in _generate_and_score_completions and _compute_loss), opened after TRL's constructor
        # so that it built no vLLM client; vllm_importance_sampling_* were set by it from GRPOConfig.
        self.use_vllm = True
        self.vllm_mode = "server"
        sync.trainer = self
        self.max_logp_diff = max_logp_diff
        sync.probe_policy = not self._checks_first_batch()
        self.vllm_generation = sync
        self._last_loaded_step = -1  # push before the first generation (the server may hold stale weights)

    def _checks_first_batch(self) -> bool:
        # structured outputs renormalise over the tokens a grammar allows, which the policy cannot know: then the
        # push's probe is scored by the policy instead
        return (self.max_logp_diff is not None and self.rollout is not None
                and self.rollout.gen.structured_outputs is None)

    def _sampled_version(self) -> int:
        return self.vllm_generation.pushed_version  # the push verified before this batch was sampled

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        sync: DiskSync = self.vllm_generation
        if sync.first_batch_pending:
            sync.first_batch_pending = False
            self._check_first_batch(sync.pushed_version)
        return output

    def _check_first_batch(self, version: int) -> None:
        """Score the first completions of the batch just sampled with the policy, under the distribution the server
        samples from (:func:`grpo_steps.training.sampling.processed_logprobs`), and compare with the sampler's
        logprobs; the largest mean |difference| over the processes decides, so every rank raises together."""
        if not self._checks_first_batch():
            return
        diffs: list[float] = []
        for prompt_ids, completion_ids, logprobs in self.rollout.last_batch[:FIRST_BATCH_COMPLETIONS]:
            if completion_ids:
                policy = processed_logprobs(self.model, prompt_ids, completion_ids, self.rollout.gen)
                diffs += [abs(a - b) for a, b in zip(logprobs, policy, strict=True)]
        gap = sum(diffs) / max(len(diffs), 1)  # inf when the policy excludes a token the server sampled
        value = float(self.accelerator.gather(torch.tensor([gap], device=self.accelerator.device)).max())
        self._metrics["train"]["weight_sync/first_batch_logp_diff"].append(value)
        if not value <= self.max_logp_diff:
            raise GenerationServerError(
                f"step {self.state.global_step + 1}: the first batch sampled after pushing version {version} "
                f"({version_label(version)}) has mean |sampling logp - policy logp| = {value:.3g} nats per token "
                f"under the configured sampling settings, above generation.sync_check.max_logp_diff = "
                f"{self.max_logp_diff:g}: the server does not sample from the policy (stale or other weights, other "
                "sampling settings, or a server started without --logprobs-mode processed_logprobs)"
            )
