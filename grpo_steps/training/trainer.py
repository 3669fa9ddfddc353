"""TRL's ``GRPOTrainer`` as this pipeline runs it: the weight version of each batch recorded, and on the server path
TRL's own vLLM code paths opened onto our server, verified weight pushes and the first-batch check.

TRL 1.16 samples through ``self.vllm_generation`` and applies its trainer–inference mismatch correction
(importance sampling against the sampler's logprobs, the ``sampling/sampling_logp_difference/*`` and
``sampling/importance_sampling_ratio/*`` metrics, ``importance_sampling_ratio`` in the loss) only when
``self.use_vllm`` is true (``grpo_trainer.py``: ``_generate_single_turn``, ``_generate_and_score_completions``,
``_compute_loss``). ``_generate_single_turn`` calls ``vllm_generation.sync_weights()`` whenever the optimizer step
changed, then ``vllm_generation.generate()`` -- for the first turn of every group and for each follow-up turn of its
tool loop (``tools``, ``environment_factory``), which therefore runs unchanged on our server.

:class:`ServerGRPOTrainer` therefore only (1) turns ``use_vllm`` on after TRL's constructor ran with it off (so TRL
builds no vLLM client of its own), and (2) sets ``vllm_generation`` to
:class:`grpo_steps.training.generation.ServerGeneration`. The prompts (chat template, tool schemas), the tool loop,
the correction, its metrics and the loss stay TRL's code. It also checks the first batch after each push
(``generation.sync_check.max_logp_diff``); only when that check cannot run (no limit, or structured outputs) does
the push's verification score a probe with the policy as well (one extra forward, ~0.1 s for SmolLM2-135M on 2
CPU cores). With ``generation.async`` (``max_staleness``), the first turns come from a producer that samples the
next generation batches while this one trains (:mod:`grpo_steps.training.async_rollouts`; the prompts from
:class:`PromptStream`); every push is then verified with the policy's probe, and the first-batch check runs only on
a batch sampled by the policy of the moment.
"""

from __future__ import annotations

import time

import torch
from trl import GRPOTrainer

from grpo_steps.servers.client import GenerationServerError, version_label
from grpo_steps.training.generation import ServerGeneration
from grpo_steps.training.sampling import processed_logprobs

FIRST_BATCH_COMPLETIONS = 2
"""Completions of the first batch after a push that the policy scores again for the first-batch check (a no-grad
forward per completion, per push and process: ~0.1 s for SmolLM2-135M at 100 tokens, ~2 s with the 600-token prompts
of configs/tools.yaml on 2 CPU cores)."""


class PipelineGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` as every backend runs it here; it records which policy version sampled the latest
    generation batch (``sampled_version``: the optimizer step whose weights generated it), for the completions
    tables. TRL generates from the current policy (``hf``, colocate) or syncs it first (``nccl``).

    Groups whose rewards are all equal (:mod:`grpo_steps.training.zero_signal`): ``zero_signal_groups`` ``keep``
    (TRL's behaviour), ``skip`` (no forward/backward for a micro-batch without a non-zero advantage, decided by all
    processes together) or ``resample`` (DAPO's dynamic sampling, at most ``max_resample_rounds`` generation rounds
    per generation batch; the extra prompts are drawn from the training set by a generator seeded with the seed, the
    step, the round and the process, so a resumed run draws the same ones) or ``replay`` (Axolotl's replay buffer,
    :meth:`_replay`: each process keeps its own :class:`grpo_steps.training.zero_signal.ReplayBuffer` of its own
    groups with signal, at most ``replay_buffer_size`` groups none older than ``replay_max_age`` optimizer steps, and
    puts them in the places of its groups without signal; empty again after a resume). Metrics:
    ``zero_signal/frac_before`` and ``zero_signal/frac_after`` (share of groups without signal in the first round and
    in the batch trained on), ``zero_signal/groups_generated`` and ``zero_signal/rounds`` per generation batch (all
    processes), ``zero_signal/skipped_share`` (share of micro-batches skipped), ``zero_signal/replayed`` (groups
    replayed per generation batch, all processes), ``zero_signal/buffer_size`` (groups in the buffers of all
    processes after the batch), and when some group was replayed ``zero_signal/replay_age`` (their mean age, optimizer
    steps) and ``zero_signal/replay_is_weight`` (mean importance weight of their loss tokens, or completions with the
    ``sequence_*`` modes; 0 where the correction masks them).
    """

    sampled_version: int = -1

    def __init__(self, *args, zero_signal_groups: str = "keep", max_resample_rounds: int = 4,
                 replay_buffer_size: int = 64, replay_max_age: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.zero_signal_groups = zero_signal_groups
        self.max_resample_rounds = max_resample_rounds
        if zero_signal_groups == "replay":
            from grpo_steps.training.zero_signal import ReplayBuffer

            self.replay_buffer = ReplayBuffer(replay_buffer_size, replay_max_age)

    def _sampled_version(self) -> int:
        return self.state.global_step

    def _generate_and_score_completions(self, inputs):
        if self.zero_signal_groups == "resample" and self.model.training:
            output = self._resample(inputs)
        elif self.zero_signal_groups == "replay" and self.model.training:
            output = self._replay(inputs)
        else:
            output = self._generate_round(inputs)
        self.sampled_version = self._sampled_version()
        return output

    def _generate_round(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.tools:  # TRL logs calls and failures per episode; the assistant turns too (as evaluation does)
            episodes = [c for c in self._logs["completion"] if isinstance(c, list)]
            turns = [sum(m.get("role") == "assistant" for m in c) for c in episodes]
            if turns:
                self._metrics["train"]["tools/turns_per_episode"].append(sum(turns) / len(turns))
        return output

    def _all(self, value: float, reduce: str) -> float:
        """``value`` reduced over the processes (``max`` or ``sum``); every process calls."""
        gathered = self.accelerator.gather(torch.tensor([float(value)], device=self.accelerator.device))
        return float(gathered.max() if reduce == "max" else gathered.sum())

    def _extra_rows(self, groups: int, round_index: int) -> list[dict]:
        """``groups`` other prompts of the training set, each repeated ``num_generations`` times (TRL's order)."""
        seed = ((self.args.seed * 1_000_003 + self.state.global_step) * 101 + round_index) * 1009 \
            + self.accelerator.process_index
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randperm(len(self.train_dataset), generator=generator)[:groups].tolist()
        picks += [picks[i % len(picks)] for i in range(groups - len(picks))]  # a training set smaller than a batch
        return [self.train_dataset[i] for i in picks for _ in range(self.num_generations)]

    def _resample(self, inputs):
        from grpo_steps.training.zero_signal import plan_resample, select_groups, signal_groups

        g = self.num_generations
        batches = [self._generate_round(inputs)]
        signal = [signal_groups(batches[0]["advantages"], g)]
        places = len(signal[0])
        while len(batches) < self.max_resample_rounds:
            short = sum(int(s.sum()) for s in signal) < places
            if not self._all(short, "max"):  # every process agrees: rounds are collective (gathers, ZeRO-3)
                break
            batches.append(self._generate_round(self._extra_rows(places, len(batches))))
            signal.append(signal_groups(batches[-1]["advantages"], g))
        picks, used = plan_resample(signal, places)
        output = batches[0]
        if len(batches) > 1:  # TRL's num_items_in_batch counts the loss's tokens of all processes
            output = select_groups(batches, picks, g)
            output["num_items_in_batch"] = torch.tensor(self._all(output["num_items_in_batch"], "sum"),
                                                        device=output["num_items_in_batch"].device)
        metrics = self._metrics["train"]
        total = self._all(places, "sum")
        metrics["zero_signal/frac_before"].append(1 - self._all(int(signal[0].sum()), "sum") / total)
        metrics["zero_signal/frac_after"].append(1 - self._all(used, "sum") / total)
        metrics["zero_signal/groups_generated"].append(self._all(places * len(batches), "sum"))
        metrics["zero_signal/rounds"].append(float(len(batches)))
        return output

    def _replay(self, inputs):
        """One generation round whose groups without signal are replaced by buffered groups with signal of earlier
        rounds (newest first, each once per batch; :func:`grpo_steps.training.zero_signal.plan_replay`); then this
        round's groups with signal join the buffer. Replayed groups keep the advantages they were generated with (as
        Axolotl's buffer does); what TRL computed with the policy of their time is recomputed by
        :meth:`_rescore_replayed`. Local to each process but for the collective token count and metrics."""
        from grpo_steps.training.zero_signal import fill_from_buffer, plan_replay, replayed_rows, signal_groups

        g, step = self.num_generations, self.state.global_step
        fresh = self._generate_round(inputs)
        signal = signal_groups(fresh["advantages"], g)
        recent = self.replay_buffer.newest_first(step)
        sources = plan_replay(signal, len(recent))
        used = [recent[k] for k in sources if k >= 0]
        output = fill_from_buffer(fresh, sources, [group.batch for group in recent], g) if used else fresh
        rows = replayed_rows(sources, g).to(output["advantages"].device)
        # the policy's forward is collective under ZeRO-3 (parameters gathered layer by layer): every process scores
        # as many rows as the process with the most, or none when no process replays
        most = int(self._all(len(rows), "max"))
        weight = self._rescore_replayed(output, rows, most) if most else (0.0, 0)
        self.replay_buffer.add(fresh, signal, g, step)  # after planning: a batch never replays its own groups
        # TRL's num_items_in_batch counts the loss's tokens of all processes; every process calls (collective)
        local = output["completion_mask"] * output.get("tool_mask", 1)
        output["num_items_in_batch"] = torch.tensor(self._all(local.sum(), "sum"), device=local.device)
        metrics = self._metrics["train"]
        total, replayed = self._all(len(signal), "sum"), self._all(len(used), "sum")
        with_signal = self._all(int(signal.sum()), "sum")
        metrics["zero_signal/frac_before"].append(1 - with_signal / total)
        metrics["zero_signal/frac_after"].append(1 - (with_signal + replayed) / total)
        metrics["zero_signal/replayed"].append(replayed)
        metrics["zero_signal/buffer_size"].append(self._all(len(self.replay_buffer), "sum"))
        age = self._all(sum(step - group.step for group in used), "sum")
        weight_sum, weight_count = self._all(weight[0], "sum"), self._all(weight[1], "sum")
        if replayed:  # every process agrees (reduced values): no metric point when nothing was replayed
            metrics["zero_signal/replay_age"].append(age / replayed)
            if weight_count:
                metrics["zero_signal/replay_is_weight"].append(weight_sum / weight_count)
        return output

    def _rescore_replayed(self, output: dict, rows: torch.Tensor, scored: int) -> tuple[float, int]:
        """Recompute in ``output``, for ``rows`` ((R,) long), what TRL's ``_generate_and_score_completions`` computed
        with the policy at generation time: ``old_per_token_logps`` (the current policy's, no grad, as TRL scores
        them) and ``importance_sampling_ratio`` (:func:`grpo_steps.training.zero_signal.importance_weights` of the
        current policy against the buffered sampler's logprobs: the older policy that generated the group). The
        reference model does not change (``train.grpo.sync_ref_model`` is refused with replay), so buffered
        ``ref_per_token_logps`` stay right. Returns (sum, count) of the new weights over loss tokens (per completion
        with the ``sequence_*`` modes), for the metric. ``scored`` (>= R, the same on every process) rows go through
        the policy: ``rows`` padded with row 0 of the batch, whose logprobs are dropped, so that every process makes
        the same forward calls (ZeRO-3 gathers parameters collectively in each one)."""
        from trl.models.utils import disable_gradient_checkpointing

        from grpo_steps.training.zero_signal import importance_weights

        padded = torch.cat([rows, rows.new_zeros(scored - len(rows))])  # (scored,)
        completion_ids = output["completion_ids"][padded]
        ids = torch.cat([output["prompt_ids"][padded], completion_ids], dim=1)  # (scored, P+C)
        attention_mask = torch.cat([output["prompt_mask"][padded], output["completion_mask"][padded]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model, ids, attention_mask, completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size)
        if not len(rows):
            return 0.0, 0
        logps, completion_mask = logps[:len(rows)], output["completion_mask"][rows]  # (R, C)
        if "old_per_token_logps" in output:
            output["old_per_token_logps"][rows] = logps
        if "importance_sampling_ratio" not in output:
            return 0.0, 0
        mask = completion_mask * output["tool_mask"][rows] if "tool_mask" in output else completion_mask
        ratio = importance_weights(logps, output["sampling_per_token_logps"][rows], mask,
                                   self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
                                   self.vllm_importance_sampling_clip_max)
        output["importance_sampling_ratio"][rows] = ratio
        weights = ratio if self.vllm_importance_sampling_mode.startswith("sequence") else ratio[mask.bool()]
        return float(weights.sum()), weights.numel()

    _prepared: dict | None = None

    def _prepare_inputs(self, generation_batch):
        if self._prepared is not None:  # prepared by training_step (zero_signal_groups: skip)
            prepared, self._prepared = self._prepared, None
            return prepared
        return super()._prepare_inputs(generation_batch)

    def training_step(self, model, inputs, num_items_in_batch):
        """TRL's training step; with ``zero_signal_groups: skip`` the micro-batch is prepared first (TRL generates
        when due and slices its buffer) and skipped when no process has a non-zero advantage in its part."""
        if self.zero_signal_groups != "skip":
            return super().training_step(model, inputs, num_items_in_batch)
        from grpo_steps.training.zero_signal import has_signal, signal_first

        model.train()  # as Trainer.training_step does before preparing: TRL buffers and logs "train" only then
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        started, buffered = time.perf_counter(), self._buffered_inputs
        prepared = super()._prepare_inputs(inputs)
        if self._buffered_inputs is not buffered and self._recut_signal_first:  # a new generation batch
            self._buffered_inputs = signal_first(self._buffered_inputs)
            prepared = self._buffered_inputs[self._step % self.args.steps_per_generation]
        signal = self._all(has_signal(prepared), "max")  # all processes skip together (DDP syncs in backward)
        self._metrics["train"]["zero_signal/skipped_share"].append(1.0 - signal)
        self._current_train_step_time += time.perf_counter() - started  # TRL's step_time counts the generation too
        if signal:
            self._prepared = prepared
            return super().training_step(model, inputs, num_items_in_batch)
        # zero advantages and beta 0: the loss and its gradient are zero; count the micro-batch as TRL's
        # training_step does, so that the next one is the right slice of the buffer
        self._average_accumulated_gradients(model)
        self._step += 1
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return torch.zeros((), device=self.args.device)

    @property
    def _recut_signal_first(self) -> bool:
        """Whether ``skip`` may cut a generation batch's micro-batches with the rows with signal first
        (:func:`grpo_steps.training.zero_signal.signal_first`) without changing the optimizer step: the generation
        batch is one accumulation window, and neither the loss's normalization (``bnpo``: by the micro-batch's
        tokens) nor an entropy mask (``top_entropy_quantile`` < 1: a quantile per micro-batch) depends on the cut."""
        return (self.args.steps_per_generation == self.args.gradient_accumulation_steps > 1
                and self.loss_type != "bnpo" and self.top_entropy_quantile == 1.0)

    def _average_accumulated_gradients(self, model) -> None:
        """On the micro-batch that ends a gradient-accumulation window, DDP averages the window's gradients over the
        processes in its backward pass (the others run under ``no_sync``); when ``skip`` drops that micro-batch on
        every process, average them here instead, or each process would step with its own gradients and the
        replicas would drift apart. Nothing to do for one process, or inside the window."""
        if self.accelerator.num_processes == 1 or not self.accelerator.sync_gradients:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]  # the same parameters on every process
        for grad in grads:  # (the same micro-batches ran everywhere: the skip decisions are shared)
            torch.distributed.all_reduce(grad)
            grad.div_(self.accelerator.num_processes)

    def check_replicas_agree(self) -> None:
        """Raise unless every training process holds the same policy weights (a digest per tensor,
        :func:`grpo_steps.training.weight_sync.weights_fingerprint`, gathered). Data parallelism keeps full
        replicas that must stay equal; ZeRO-3 (a partition per process) and a single process have nothing to check.

        Raises:
            RuntimeError: the replicas differ (names the processes' digests' largest gap).
        """
        if self.accelerator.num_processes == 1 or self.is_deepspeed_enabled:
            return
        from grpo_steps.training.weight_sync import weights_fingerprint

        digest = torch.tensor(weights_fingerprint(self.accelerator.unwrap_model(self.model).state_dict()),
                              dtype=torch.float64, device=self.accelerator.device)
        gathered = self.accelerator.gather(digest.unsqueeze(0))  # (processes, tensors)
        gap = float((gathered - gathered[0]).abs().max())
        if gap > 1e-9 * max(1.0, float(gathered.abs().max())):  # equal replicas are equal bit for bit
            raise RuntimeError(f"the {self.accelerator.num_processes} training processes ended with different "
                               f"policy weights (largest digest gap {gap:.3g}): their gradients were not averaged "
                               "alike; the model saved would be process 0's alone")


class ServerGRPOTrainer(PipelineGRPOTrainer):
    """``GRPOTrainer`` for rollouts from our vLLM server with ``disk`` weight sync (:class:`ServerGeneration`).

    Args (besides ``GRPOTrainer``'s):
        args: a ``GRPOConfig`` with ``use_vllm=False`` and the correction in its
            ``vllm_importance_sampling_*`` fields (see :func:`grpo_steps.training.job.grpo_args`).
        sync: a :class:`ServerGeneration` without its trainer; pushes and verifies before sampling, samples.
        max_logp_diff: the first-batch limit (``SyncCheckConfig.thresholds``; nats per token; None: unchecked).

    Raises:
        ValueError: ``args.use_vllm`` is set (TRL would start its own vLLM client).
        GenerationServerError: from the push, or when the first completions sampled after a push have a mean
            |sampling logp - policy logp| above ``max_logp_diff`` (the policy's logprobs taken under the configured
            sampling settings; not with structured outputs, whose grammar only the server knows: then the push's
            probe is compared with the policy instead).
    """

    def __init__(self, *args, sync: ServerGeneration, max_logp_diff: float | None, max_staleness: int | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.use_vllm:
            raise ValueError("ServerGRPOTrainer brings its own generation: build it with GRPOConfig(use_vllm=False)")
        # TRL's gate of the vLLM paths (grpo_trainer.py: _generate -> vllm_generation.sync_weights(), the
        # correction in _generate_and_score_completions and _compute_loss), opened after TRL's constructor
        # so that it built no vLLM client; vllm_importance_sampling_* were set by it from GRPOConfig.
        self.use_vllm = True
        self.vllm_mode = "server"
        sync.trainer = self
        self.max_logp_diff = max_logp_diff
        self.vllm_generation = sync
        self.max_staleness = max_staleness
        # asynchronous: the batches trained were mostly sampled by earlier weights, which the policy no longer is;
        # every push is then checked with the policy's probe, the first-batch check only runs on a batch sampled by
        # the policy of the moment (the first one)
        sync.probe_policy = max_staleness is not None or not self._checks_first_batch()
        self._last_loaded_step = -1  # push before the first generation (the server may hold stale weights)
        self._prompt_stream: PromptStream | None = None

    def _checks_first_batch(self) -> bool:
        # structured outputs renormalise over the tokens a grammar allows, which the policy cannot know: then the
        # push's probe is scored by the policy instead
        return self.max_logp_diff is not None and self.vllm_generation.gen.structured_outputs is None

    def _sampled_version(self) -> int:
        return self.vllm_generation.sampled_version  # a verified push; with async, the one that sampled the batch

    def _generate_and_score_completions(self, inputs):
        sync: ServerGeneration = self.vllm_generation
        if self.max_staleness is not None and sync.prefetcher is None and self.model.training:
            self._start_async()
        output = super()._generate_and_score_completions(inputs)
        if sync.first_batch_pending and sync.first_batch is not None:
            sync.first_batch_pending = False
            self._check_first_batch(sync.pushed_version)
        return output

    def _start_async(self) -> None:
        """Start the producer of ``generation.async`` at the first generation of this attempt: it samples ahead the
        prompts of the batches TRL's dataloader will yield next (:class:`PromptStream`, a second dataloader in the
        same order, from where a resumed run starts)."""
        from grpo_steps.config import prefetch_depth

        accumulation = self.args.gradient_accumulation_steps
        every = self.args.steps_per_generation * self.num_iterations  # micro-steps per generation batch
        depth = prefetch_depth(self.max_staleness, every / accumulation, self.vllm_generation.sync_every)
        self._prompt_stream = PromptStream(self, every, depth)
        self.vllm_generation.start_async(self.max_staleness, depth, self._prompt_stream.after)

    def _check_first_batch(self, version: int) -> None:
        """Score the first completions of the batch just sampled with the policy, under the distribution the server
        samples from (:func:`grpo_steps.training.sampling.processed_logprobs`), and compare with the sampler's
        logprobs; the largest mean |difference| over the processes decides, so every rank raises together."""
        if not self._checks_first_batch():
            return
        diffs: list[float] = []
        for prompt_ids, completion_ids, logprobs in (self.vllm_generation.first_batch or [])[:FIRST_BATCH_COMPLETIONS]:
            if completion_ids:
                policy = processed_logprobs(self.model, prompt_ids, completion_ids, self.vllm_generation.gen)
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


class PromptStream:
    """The token-id prompts of the generation batches TRL will ask for next, read from a second training dataloader
    (the same sampler, seed and sharding as the trainer's) from where this attempt starts: a resumed run skips the
    micro-batches its checkpoint trained, as ``Trainer`` does. Each generation batch is keyed by the micro-step at
    which TRL generates it (``GRPOTrainer._step``, 0 when the attempt starts; one batch every ``every`` micro-steps).
    Read in the training thread (the dataloader may synchronise RNG states across processes). A stream that
    disagrees with TRL's costs speed, never correctness: the producer's batch then holds other prompts and is not
    used (``async/missed``)."""

    def __init__(self, trainer: PipelineGRPOTrainer, every: int, depth: int) -> None:
        self.trainer, self.every, self.depth = trainer, every, depth
        self.ahead: dict[int, list[list[int]]] = {}
        self.next_index = 0
        self.batches = self._micro_batches()

    def _micro_batches(self):
        trainer = self.trainer
        loader = trainer.get_train_dataloader()
        accumulation = trainer.args.gradient_accumulation_steps
        per_epoch = max(len(loader) // accumulation + int(len(loader) % accumulation > 0), 1)
        epoch = trainer.state.global_step // per_epoch
        skip = (trainer.state.global_step % per_epoch) * accumulation
        while True:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            for index, rows in enumerate(loader):
                if index >= skip:
                    yield rows
            skip, epoch = 0, epoch + 1

    def _prompt_ids(self, rows: list[dict]) -> list[list[int]]:
        import copy

        prompt_ids, _, _ = self.trainer._tokenize_prompts(copy.deepcopy([row["prompt"] for row in rows]))
        return prompt_ids

    def after(self, key: int) -> list[tuple[int, list[list[int]]]]:
        """``(key, prompt ids)`` of the next ``depth`` generation batches after the one at micro-step ``key``."""
        wanted = [key + self.every * j for j in range(1, self.depth + 1)]
        for index in wanted:
            while self.next_index <= index:
                rows = next(self.batches)
                if self.next_index % self.every == 0 and self.next_index > key:
                    self.ahead[self.next_index] = self._prompt_ids(rows)
                self.next_index += 1
        self.ahead = {k: v for k, v in self.ahead.items() if k > key}
        return [(k, self.ahead[k]) for k in wanted]
