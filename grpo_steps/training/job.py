"""The training job: everything the training process needs, written as JSON by the flow's ``train`` step, and its
mapping to ``trl.GRPOConfig``.

This is the one module of :mod:`grpo_steps.training` that flow-side code imports (an import contract in
``pyproject.toml`` keeps it so): it imports neither torch nor TRL at module level, so the flow's tasks build
and launch a job without them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from grpo_steps.config import PipelineConfig

TRAINING_MODULE = "grpo_steps.training"
"""What ``python -m`` and ``accelerate launch --module`` run in the training process
(:mod:`grpo_steps.training.entry`)."""


class TrainJob(BaseModel):
    """Everything the training process needs, written as JSON by the flow's ``train`` step."""

    model_config = ConfigDict(extra="forbid")

    config: PipelineConfig
    model_path: str  # resolved weights directory or hub id
    train_file: str  # jsonl of the prepared train split
    output_dir: str  # trainer output: checkpoints and the final model (``final/``)
    server: dict[str, Any] | None = None
    """The generation server's handle, whole (:meth:`grpo_steps.servers.GenerationServer.to_dict`: its provider,
    endpoint, served model name and, with several replicas, each replica and the router); None: no server (backend
    ``hf``, ``recorded``). :meth:`generation_server` makes the server, whose ``client()`` samples and pushes."""
    resume_from: str | None = None  # a trainer checkpoint directory to continue from
    mlflow_run_id: str | None = None  # metrics go to this run
    node_index: int = 0  # machine rank in the gang
    eval_file: str | None = None  # jsonl of the eval prompts evaluated during training (eval.every_steps)
    eval_split_file: str | None = None  # jsonl of the whole eval split: evaluated at step 0 and at the last step
    # (eval.every_steps), once for the curve and the evaluate step; the results go to {output_dir}/SPLIT_RESULTS
    resume_universal: bool = False  # resume_from holds a DeepSpeed Universal Checkpoint to load (grpo_steps.elastic)
    weight_store: dict[str, Any] | None = None
    """``generation.weight_sync: s3``: the S3 location of this run's weight versions,
    ``{"bucket", "prefix", "endpoint_url"}`` (:func:`grpo_steps.weights.chain.run_store`; no credentials)."""

    @field_validator("server")
    @classmethod
    def _a_known_server_handle(cls, server: dict[str, Any] | None) -> dict[str, Any] | None:
        """The handle names a provider :func:`grpo_steps.servers.from_dict` reads (refused when the job is made,
        not in the middle of the training process)."""
        if server is not None:
            from grpo_steps.servers import from_dict

            from_dict(server)
        return server

    def generation_server(self):
        """The :class:`grpo_steps.servers.GenerationServer` of :attr:`server` (None without one)."""
        from grpo_steps.servers import from_dict

        return None if self.server is None else from_dict(self.server)


WEIGHT_LINEAGE = "weight_lineage.json"
"""With ``weight_sync: s3``: the lineage of the last version the servers loaded
(:func:`grpo_steps.training.generation.s3.lineage_of`), as JSON in the job's ``output_dir``; the flow's train step
puts it in the MLflow run's tags (``weight_lineage.*``), which the registered version copies."""

SPLIT_RESULTS = {"baseline": "baseline_eval.json", "trained": "trained_eval.json"}
"""The evaluations of the whole eval split made during training (:mod:`grpo_steps.training.eval_during`: the base
weights at step 0, the final policy at the last step), each an :func:`grpo_steps.evaluation.policy.evaluate_policy`
result with
its ``step`` as JSON, in the job's ``output_dir``; read by :func:`grpo_steps.steps.training_evaluations`."""


GRPO_DEFAULTS: dict[str, Any] = dict(dataloader_num_workers=0, disable_tqdm=True)
"""``trl.GRPOConfig`` fields the pipeline sets by default; ``train.grpo`` may change them."""


def config_grpo_kwargs(job: TrainJob, on_cpu: bool) -> dict[str, Any]:
    """The ``trl.GRPOConfig`` fields derived from the config, for a job on CPU (``on_cpu``) or CUDA.

    Its keys are those of :data:`grpo_steps.config.GRPO_ARGS_SET_BY` (``use_vllm``, ``vllm_mode``,
    ``vllm_server_base_url`` with ``nccl`` weight sync, ``deepspeed`` with ``train.deepspeed``), which
    ``train.grpo`` may not set. Pure: imports neither torch nor trl.
    """
    cfg, train, gen = job.config, job.config.train, job.config.generation
    kwargs: dict[str, Any] = dict(
        output_dir=job.output_dir,
        max_steps=train.max_steps,
        learning_rate=train.learning_rate,
        per_device_train_batch_size=train.per_device_train_batch_size,
        gradient_accumulation_steps=train.gradient_accumulation_steps,
        num_generations=train.num_generations,
        beta=train.beta,
        loss_type=train.loss_type,
        importance_sampling_level=train.importance_sampling_level,
        off_policy_mask_threshold=train.off_policy_mask_threshold,
        scale_rewards=train.scale_rewards,
        max_completion_length=gen.max_completion_tokens,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k,
        min_p=gen.min_p or None,
        repetition_penalty=gen.repetition_penalty,
        # stop strings/ids and structured outputs reach TRL's own vLLM generation (colocate, nccl) as request fields;
        # our server rollouts send them themselves, backend hf refuses them (config), recorded samples nothing
        generation_kwargs=gen.sampling_request(filters=False) or None,
        vllm_structured_outputs_regex=None,  # in generation_kwargs["structured_outputs"], with json and choice
        chat_template_kwargs=dict(gen.chat_template_kwargs) or None,
        max_tool_calling_iterations=gen.max_tool_calling_iterations,
        reward_weights=[r.weight for r in cfg.rewards],
        save_strategy="steps",
        save_steps=train.save_steps,
        save_total_limit=train.save_total_limit,
        # every node trains in its own scratch directory: each needs the full trainer state beside its
        # ZeRO-3 partition to resume (HF writes trainer_state.json, scheduler, RNG of rank 0 only otherwise)
        save_on_each_node=train.num_nodes > 1,
        logging_steps=train.logging_steps,
        seed=train.seed,
        data_seed=train.seed,
        report_to=[],  # metrics: grpo_steps.training.callbacks.MLflowMetricsCallback
        use_cpu=on_cpu,
        bf16=(not on_cpu) and cfg.model.dtype == "bfloat16",
        fp16=False,
    )
    if gen.backend == "vllm":  # TRL's mismatch correction (on TRL's vLLM path and on ours, ServerGRPOTrainer)
        kwargs.update(vllm_importance_sampling_correction=gen.importance_sampling.enabled,
                      vllm_importance_sampling_clip_max=gen.importance_sampling.clip_max,
                      vllm_importance_sampling_clip_min=gen.importance_sampling.clip_min)
        if gen.importance_sampling.enabled:
            kwargs["vllm_importance_sampling_mode"] = gen.importance_sampling.mode
    if gen.backend == "vllm" and gen.mode == "colocate":  # TRL's colocate mode: vLLM in this process
        kwargs.update(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=cfg.model.max_model_len)
    if gen.trl_server_mode:  # generation + NCCL weight transfer inside TRL (GPUs only)
        kwargs.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=job.generation_server().endpoint)
    if train.deepspeed:
        kwargs["deepspeed"] = deepspeed_config(job)
    return kwargs


def deepspeed_config(job: TrainJob) -> str | dict[str, Any]:
    """The DeepSpeed config of a job with ``train.deepspeed``: the ZeRO-3 file in ``infra/`` (its path), or, when the
    job resumes a Universal Checkpoint (``resume_universal``, a resize: :mod:`grpo_steps.elastic`), its contents with
    ``checkpoint.load_universal`` on (DeepSpeed then reads ``latest_universal``: every parameter whole, re-partitioned
    over this job's processes)."""
    import json

    from grpo_steps.config import INFRA_DIR

    path = INFRA_DIR / "deepspeed_zero3.json"
    if not job.resume_universal:
        return str(path)
    return {**json.loads(path.read_text()), "checkpoint": {"load_universal": True}}


def check_grpo_keys(cfg: PipelineConfig) -> None:
    """``train.grpo`` against the installed TRL's ``GRPOConfig`` (imports TRL: ~11 s of CPU on the 2-core box, so only
    when there are keys to check), in ``start``, before any data is prepared or server started; the names TRL removed
    or renamed, the keys the config owns and those without effect were refused when the config was parsed.

    Raises:
        ConfigError: keys that are not ``GRPOConfig`` fields, with the closest field names.
    """
    if not cfg.train.grpo:  # nothing to check: `start` need not import TRL (and with it torch and transformers)
        return
    import dataclasses
    import difflib

    from trl import GRPOConfig

    from grpo_steps.config import ConfigError

    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(cfg.train.grpo) - known)
    if unknown:
        hints = {key: difflib.get_close_matches(key, known, n=2) for key in unknown}
        shown = "; ".join(f"{key}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
                          for key, close in hints.items())
        raise ConfigError(f"train.grpo keys that are not fields of the installed TRL's GRPOConfig: {shown}. The "
                          "fields are listed in TRL's GRPOConfig docs; pipeline settings have config keys of their "
                          "own (grpo_steps/config/)")


def grpo_args(job: TrainJob) -> Any:
    """``trl.GRPOConfig`` for a job: the fields derived from the config (:func:`config_grpo_kwargs`),
    :data:`GRPO_DEFAULTS`, and ``train.grpo`` (which overrides the defaults only: config validation
    rejects the derived fields there).

    Raises:
        ValueError: a ``train.grpo`` key that ``GRPOConfig`` does not have.
    """
    import dataclasses

    import torch
    from trl import GRPOConfig

    extra = job.config.train.grpo
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"train.grpo keys {unknown} are not GRPOConfig fields (trl docs list them)")
    derived = config_grpo_kwargs(job, on_cpu=not torch.cuda.is_available())
    return GRPOConfig(**derived, **{**GRPO_DEFAULTS, **extra})  # a key in both: TypeError, never a silent override


