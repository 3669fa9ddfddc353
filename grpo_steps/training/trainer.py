"""TRL's ``GRPOTrainer`` as this pipeline runs it: the overrides of TRL's methods, each delegating to the module that
owns the behaviour. Together with :mod:`grpo_steps.trl_hooks` this is the only place that names TRL's private
methods and attributes (pinned by ``tests/unit/test_trl_contract.py``).

- Every backend (:class:`PipelineGRPOTrainer`): the weight version of each generation batch (``sampled_version``, for
  the completions tables), the tool-turn metric, the zero-signal mode (:mod:`grpo_steps.training.zero_signal`):
  its generation round while training, its micro-batch preparation, its training step; and every scoring of the
  policy or reference model with each distinct prompt forwarded once (:mod:`grpo_steps.training.shared_prefix`);
  with ``train.turn_credit``, per-token advantages from each turn's move rewards (:mod:`.turn_credit`); with
  ``teacher:``, the teacher's scoring of each round, sent when its rollouts are sampled (``_generate``) and folded
  into per-token advantages after TRL's rewards and scoring pass (:mod:`.distill`).
- Rollouts from our vLLM server, the pipeline's weight pushes (:class:`ServerGRPOTrainer`): TRL 1.16 samples through
  ``self.vllm_generation`` and applies its trainer–inference mismatch correction (importance sampling against the
  sampler's logprobs, the ``sampling/*`` metrics, ``importance_sampling_ratio`` in the loss) only when
  ``self.use_vllm`` is true (``grpo_trainer.py``: ``_generate_single_turn``, ``_generate_and_score_completions``,
  ``_compute_loss``); ``_generate_single_turn`` calls ``vllm_generation.sync_weights()`` whenever the optimizer step
  changed, then ``vllm_generation.generate()`` for the first turn of every group and for each follow-up turn of its
  tool loop. So the trainer turns ``use_vllm`` on after TRL's constructor ran with it off (TRL builds no vLLM client of
  its own) and sets ``vllm_generation`` to :class:`grpo_steps.training.generation.server.RolloutBackend`; the prompts,
  the tool loop, the correction, its metrics and the loss stay TRL's code. Where the loss's own forward scores the
  batch with the weights TRL's separate scoring pass would use (:func:`grpo_steps.training.correction.applies`), the
  trainer skips that pass for training rounds and weighs the correction from the loss's logprobs
  (:class:`grpo_steps.training.correction.LossSideCorrection`, overrides of ``_compute_loss`` and
  ``_get_per_token_logps_and_entropies``). With sampling filters that reshape what vLLM samples (``top_k``, ``top_p``,
  ``min_p``, ``repetition_penalty``), the override of ``_generate`` puts the round's sampler logprobs on the policy's
  support before TRL reads them (:func:`grpo_steps.training.correction.on_policy_support`). With
  ``generation.async`` and an environment, a batch's round plays the instances reset ahead for its first prompts
  (:mod:`grpo_steps.training.generation.episodes_ahead`, swapped in for TRL's pools), then closes them.
"""

from __future__ import annotations

from functools import partial

from trl import GRPOTrainer

from grpo_steps import trl_hooks
from grpo_steps.training import correction, shared_prefix, turn_credit
from grpo_steps.training.cursor import CursorSampler, PromptCursor, record_prompts, resume_skip_positions
from grpo_steps.training.distill import Distillation
from grpo_steps.training.generation.episodes_ahead import EpisodesAhead, close_all
from grpo_steps.training.generation.prefetch import prompt_stream
from grpo_steps.training.generation.server import PolicyView, RolloutBackend, ServerSettings
from grpo_steps.training.grammar import GrammarMask
from grpo_steps.training.zero_signal import ZeroSignalMode


class PipelineGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` as every backend runs it here.

    Args (besides ``GRPOTrainer``'s):
        zero_signal: the mode for groups whose rewards are all equal (``train.zero_signal_groups``,
            :func:`grpo_steps.training.zero_signal.mode_for`); None: ``keep``.
    """

    sampled_version: int = -1
    """The optimizer step whose weights generated the latest generation batch. TRL generates from the current policy
    (``hf``, colocate) or syncs it first (``nccl``)."""

    def __init__(self, *args, zero_signal: ZeroSignalMode | None = None, prompt_cursor: PromptCursor | None = None,
                 turn_credit: float | None = None, curriculum=None, distill: Distillation | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.curriculum = curriculum  # train.curriculum: grpo_steps.training.curriculum.sampler.Curriculum
        self.zero_signal = zero_signal or ZeroSignalMode()
        self.prompt_cursor = prompt_cursor
        self.turn_credit = turn_credit
        self._turn_rewards: list | None = None  # per rollout of the round being generated (turn_credit)
        self.distill = distill  # teacher: on-policy distillation (grpo_steps.training.distill)
        self._round_rows: list[dict] | None = None  # the rows of the round being generated (the privileged teacher)
        self._teacher_pending = None  # the round's teacher scoring in flight (distill.scoring.Pending)

    def _sampled_version(self) -> int:
        return self.state.global_step

    def _get_train_sampler(self, dataset=None):
        base = super()._get_train_sampler(dataset)
        if dataset is not None and dataset is not self.train_dataset:
            return base
        skip = partial(resume_skip_positions, len(base), self.args.generation_batch_size,  # read at each resume
                       self.args.gradient_accumulation_steps)
        if self.curriculum is not None:  # train.curriculum draws the order
            return self.curriculum.sampler(self, base, lambda: skip(self.state.global_step))
        return base if self.prompt_cursor is None else CursorSampler(base, self.prompt_cursor,
                                                                     lambda: skip(self.state.global_step))

    def _generate_and_score_completions(self, inputs):
        if self.prompt_cursor is not None and self.model.training:  # collective: every process's prompts gathered
            record_prompts(self.prompt_cursor, inputs, self.args.output_dir, self.state.global_step + 1,
                           self.accelerator.is_main_process)
        # the zero-signal modes act on training batches only: an evaluation round is TRL's own
        output = self.zero_signal.generate(self, inputs) if self.model.training else self.generate_round(inputs)
        self.sampled_version = self._sampled_version()
        return output

    def _prepare_inputs(self, generation_batch):
        return self.zero_signal.prepare_inputs(self, generation_batch)

    def training_step(self, model, inputs, num_items_in_batch):
        return self.zero_signal.training_step(self, model, inputs, num_items_in_batch)

    def generate_round(self, inputs: list[dict]) -> dict:
        """TRL's generation round for ``inputs`` (sample, score, advantages), plus the tool-turn metric; with
        ``train.turn_credit``, a training round's advantages per token (:func:`.turn_credit.fold`); with ``teacher:``,
        the teacher's term added per token (:meth:`grpo_steps.training.distill.Distillation.fold`)."""
        self._turn_rewards, self._round_rows, self._teacher_pending = None, inputs, None
        output = trl_hooks.generate_and_score(PipelineGRPOTrainer, self, inputs)
        if self.curriculum is not None and self.model.training:
            self.curriculum.observe(self, inputs)
        if self.turn_credit and self.model.training and self._turn_rewards is not None and "tool_mask" in output:
            output["advantages"] = turn_credit.fold(output["advantages"], output["tool_mask"],
                                                    output["completion_mask"], self._turn_rewards,
                                                    self.num_generations, self.turn_credit)
        if self._teacher_pending is not None:  # sent in _generate; TRL's rewards and scoring pass ran meanwhile
            output["advantages"], metrics = self.distill.fold(output, self._teacher_pending)
            self._teacher_pending = None
            for name, value in metrics.items():
                trl_hooks.log_metric(self, name, value)
        turns = turn_credit.turns_per_episode(trl_hooks.logged_batch(self)["completion"]) if self.tools else None
        if turns is not None:  # TRL logs calls and failures per episode; the assistant turns too (as evaluation does)
            trl_hooks.log_metric(self, "tools/turns_per_episode", turns)
        return output

    def _generate(self, prompts):
        result = super()._generate(prompts)  # TRL's round: the first turns and the tool loop's
        if self.distill is not None and self.model.training:  # [0], [1]: prompt and completion ids of each rollout
            self._teacher_pending = self.distill.start(result[0], result[1], self._round_rows,
                                                       partial(trl_hooks.tokenize_prompts, self))
        if self.turn_credit and self.model.training and self.environments:
            # the game's reward of each turn, read while the round's environments hold their episodes
            from rewards.game import turn_rewards

            self._turn_rewards = [turn_rewards(messages, getattr(environment, "outcome", None))
                                  for messages, environment in zip(result[3], self.environments, strict=True)]
        return result

    def close_environments(self) -> None:
        """Close every environment instance of TRL's pools (their worker processes killed); nothing without
        ``environment:``."""
        close_all(trl_hooks.environment_pool_instances(self))

    def trl_prepare_inputs(self, generation_batch) -> dict:
        """TRL's ``_prepare_inputs``: generates when a generation batch is due; returns the current micro-batch."""
        return trl_hooks.prepare_inputs(PipelineGRPOTrainer, self, generation_batch)

    def trl_training_step(self, model, inputs, num_items_in_batch):
        """TRL's training step (prepare, forward, backward); returns the loss."""
        return super().training_step(model, inputs, num_items_in_batch)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **extra_inputs):
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        if not shared_prefix.applies(self.accelerator.unwrap_model(model), input_ids.size(1) - logits_to_keep,
                                     {"compute_aux_loss": compute_aux_loss, **extra_inputs}, zero3=zero3):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra_inputs)
        return (*shared_prefix.chunked_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                           batch_size, compute_entropy), None)


class ServerGRPOTrainer(PipelineGRPOTrainer):
    """``GRPOTrainer`` for rollouts from our vLLM server with the pipeline's weight pushes, ``disk`` or ``s3``
    (:class:`RolloutBackend`, built here from ``server`` and what it reads of this trainer).

    Args (besides :class:`PipelineGRPOTrainer`'s):
        args: a ``GRPOConfig`` with ``use_vllm=False`` and the correction in its
            ``vllm_importance_sampling_*`` fields (see :func:`grpo_steps.training.job.grpo_args`).
        server: :func:`grpo_steps.training.generation.server_settings`.

    Raises:
        ValueError: ``args.use_vllm`` is set (TRL would start its own vLLM client).
        GenerationServerError: from the push, or from the first-batch check
            (:meth:`grpo_steps.training.generation.first_batch.FirstBatchCheck.check`).
    """

    def __init__(self, *args, server: ServerSettings, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.use_vllm:
            raise ValueError("ServerGRPOTrainer brings its own generation: build it with GRPOConfig(use_vllm=False)")
        # TRL's gate of the vLLM paths (grpo_trainer.py: _generate -> vllm_generation.sync_weights(), the
        # correction in _generate_and_score_completions and _compute_loss), opened after TRL's constructor
        # so that it built no vLLM client; vllm_importance_sampling_* were set by it from GRPOConfig.
        self.use_vllm = True
        self.vllm_mode = "server"
        self.vllm_generation = RolloutBackend(server, PolicyView(
            accelerator=self.accelerator,
            model=lambda: self.model,
            # as Trainer.save_model: under DeepSpeed the engine gathers (ZeRO-3: a collective, the dict on rank 0)
            state_dict=lambda: self.accelerator.get_state_dict(
                self.model_wrapped if self.is_deepspeed_enabled else self.model),
            step=lambda: self.state.global_step,
            micro_step=partial(trl_hooks.micro_step, self),
            log=partial(trl_hooks.log_metric, self),
            prompt_stream=self._prompt_stream))
        trl_hooks.mark_pushed(self, -1)  # push before the first generation (the server may hold stale weights)
        # several replicas: the mismatch per replica that sampled (sampling/replica<i>/...)
        self.replica_mismatch = correction.ReplicaMismatch(len(server.client.replicas)) \
            if server.client.replicas else None
        # set: training rounds skip TRL's scoring pass and the loss weighs the correction
        # (grpo_steps.training.correction); None: TRL's own path
        self.loss_side_correction = correction.LossSideCorrection(
            self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max, self.args.steps_per_generation, self.replica_mismatch) \
            if correction.applies(self) else None
        self._weighing: dict | None = None  # the micro-batch whose loss is being computed, while it is weighed
        # filters that reshape what vLLM samples: the sampler's logprobs go on the policy's support before TRL's
        # correction (or its off-policy mask) reads them (grpo_steps.training.correction.on_policy_support)
        self.sampling_settings = server.gen
        self.episodes_ahead: EpisodesAhead | None = None
        """``generation.async`` with ``environment:``: the environments reset ahead (:meth:`_prompt_stream`)."""
        self.reapplies_sampling = server.gen.filters_logits and (
            self.vllm_importance_sampling_correction or self.off_policy_mask_threshold is not None)
        # structured outputs: the grammar's mask re-applied on the policy's logits, turn by turn (training.grammar)
        self.grammar = GrammarMask(self.processing_class, self.model.config.vocab_size, server.gen,
                                   getattr(self.model, "generation_config", None)) \
            if self.reapplies_sampling and server.gen.structured_outputs is not None else None

    def _sampled_version(self) -> int:
        return self.vllm_generation.sampled_version  # a verified push; with async, the one that sampled the batch

    def _generate(self, prompts):
        result = super()._generate(prompts)  # TRL's round: the first turns and the tool loop's
        if not (self.reapplies_sampling and self.model.training and result[4] is not None):  # [4]: sampler logprobs
            return result
        return correction.reapply_filters(self.model, self.sampling_settings, result, self.num_generations,
                                          self.grammar, partial(trl_hooks.log_metric, self))

    def _generate_and_score_completions(self, inputs):
        ahead = self.episodes_ahead.take(trl_hooks.micro_step(self)) \
            if self.episodes_ahead is not None and self.model.training else None
        if ahead is None:
            return self._score_round(inputs)
        # generation.async with an environment: the rows' environments were reset ahead, their observations in the
        # first prompts the producer sampled; TRL's round plays those instances (its reset with the same row returns
        # the observation without resetting again), then they are closed with their worker processes
        with trl_hooks.environment_pools(self, self.episodes_ahead.pools(ahead)) as pools:
            try:
                return self._score_round(inputs)
            finally:
                close_all([instance for pool in pools.values() for instance in pool])

    def _score_round(self, inputs):
        if self.loss_side_correction is not None and self.model.training:
            # TRL's gate of its scoring pass, its weights and their metrics (pinned by the contract test): off for
            # this round; the loss's forward weighs each micro-batch instead (_compute_loss below)
            self.vllm_importance_sampling_correction = False
            try:
                output = super()._generate_and_score_completions(inputs)
            finally:
                self.vllm_importance_sampling_correction = True
        else:
            output = super()._generate_and_score_completions(inputs)
        if self.replica_mismatch is not None and self.model.training:  # which replica sampled each row
            rows = self.vllm_generation.replica_rows(output["prompt_ids"], output["prompt_mask"])
            for name, value in correction.attribute_replicas(output, rows, self.replica_mismatch,
                                                             self.loss_side_correction is not None,
                                                             self.accelerator).items():
                trl_hooks.log_metric(self, name, value)
        return output

    def _compute_loss(self, model, inputs):
        if self.loss_side_correction is not None and self.model.training and "importance_sampling_ratio" not in inputs:
            self._weighing = inputs  # read by the first scoring below: TRL's forward of the loss
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._weighing = None
        if self.loss_side_correction is not None:
            for name, value in (self.loss_side_correction.metrics(self.accelerator) or {}).items():
                trl_hooks.log_metric(self, name, value)
        return loss

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        inputs, self._weighing = self._weighing, None
        if inputs is not None:  # before TRL's loss reads importance_sampling_ratio
            self.loss_side_correction.weigh(inputs, result[0].detach())
        return result

    def _prompt_stream(self, max_staleness: int, sync_every: int):
        """``generation.async``'s prompts, asked for by the generation class at the first generation of this attempt:
        :func:`grpo_steps.training.generation.prefetch.prompt_stream` over a second dataloader in TRL's order, from
        where a resumed run starts."""
        if self.environment_factories is not None:  # each batch's environments reset as the stream reads it
            self.episodes_ahead = EpisodesAhead(self.environment_factories, routed=self._multi_environment)
        return prompt_stream(self.get_train_dataloader(), self.state.global_step, self.args.gradient_accumulation_steps,
                             self.args.steps_per_generation * self.num_iterations,  # micro-steps per generation batch
                             max_staleness, sync_every, partial(trl_hooks.tokenize_prompts, self), self.episodes_ahead)

    def close_environments(self) -> None:
        """Close every environment instance: those reset ahead (``generation.async``), and TRL's pools."""
        if self.episodes_ahead is not None:
            self.episodes_ahead.close()
        super().close_environments()
