"""GRPO training entry point: ``python -m grpo_steps.train JOB.json`` (under ``accelerate launch``).

Runs TRL's ``GRPOTrainer`` on the prepared train split. With the ``vllm`` backend, rollouts come
from the provisioned server through :class:`VLLMRollout` (``rollout_func``) with ``disk`` weight
sync, verified pushes and TRL's mismatch correction (:mod:`grpo_steps.trainer`); with ``hf``, TRL
generates with transformers in-process; with ``replay``, fixed completions
come from a file (:class:`ReplayRollout`). Metrics go to the MLflow run named
by ``job.mlflow_run_id`` (each step once, across resumes); checkpoints are written every
``save_steps`` and, inside a Metaflow task, saved to the datastore by
:class:`grpo_steps.callbacks.DatastoreCheckpointCallback`.
Runs without Metaflow too, for debugging.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from grpo_steps.config import PipelineConfig
from grpo_steps.data import encode_prompt


class TrainJob(BaseModel):
    """Everything the training process needs, written as JSON by the flow's ``train`` step."""

    model_config = ConfigDict(extra="forbid")

    config: PipelineConfig
    model_path: str  # resolved weights directory or hub id
    train_file: str  # jsonl of the prepared train split
    output_dir: str  # trainer output: checkpoints and the final model (``final/``)
    endpoint: str | None = None  # vLLM server base URL (backend vllm)
    served_model: str = "policy"  # the model name the server serves the policy under
    resume_from: str | None = None  # a trainer checkpoint directory to continue from
    mlflow_run_id: str | None = None  # metrics go to this run
    node_index: int = 0  # machine rank in the gang
    eval_file: str | None = None  # jsonl of the eval prompts evaluated during training (eval.every_steps)


class VLLMRollout:
    """TRL ``rollout_func``: completions from a vLLM server.

    Called by ``GRPOTrainer`` with this process's prompts, each repeated ``num_generations`` times
    in a row; returns one completion per prompt entry: ``prompt_ids`` (list of B lists of token
    ids), ``completion_ids`` (B lists) and ``logprobs`` (B lists, natural log, one per completion
    token). The weights reach the server before (``grpo_steps.trainer.ServerGRPOTrainer``: pushed and
    verified after every optimizer step and before the first generation).
    """

    def __init__(self, client, tokenizer, gen_cfg) -> None:
        self.client, self.tokenizer, self.gen = client, tokenizer, gen_cfg

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        unique, group = prompt_groups(prompts, trainer)
        prompt_ids = [encode_prompt(self.tokenizer, p) for p in unique]
        samples = self.client.complete(prompt_ids, group, max_tokens=self.gen.max_completion_tokens,
                                       temperature=self.gen.temperature, top_p=self.gen.top_p)
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for ids, group_samples in zip(prompt_ids, samples, strict=True):
            for sample in group_samples:
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(sample["completion_ids"])
                out["logprobs"].append(sample["logprobs"])
        return out


def prompt_groups(prompts: list, trainer) -> tuple[list, int]:
    """The P distinct prompts of a ``rollout_func`` call and the group size G.

    TRL hands each process whole groups: every prompt G times in a row, B = P x G entries (G is the
    trainer's ``num_generations``, ``num_generations_eval`` in evaluation); the rollout returns G
    completions per distinct prompt, in that order.

    Raises:
        ValueError: ``prompts`` are not whole groups of G equal entries in a row, e.g. a group split
            across processes because a process's generation batch (``per_device_train_batch_size`` x
            ``steps_per_generation``) is not a multiple of G. The message gives what TRL passed.
    """
    training = trainer.model.training
    group = trainer.num_generations if training else trainer.num_generations_eval
    if len(prompts) % group == 0 and all(p == prompts[i - i % group] for i, p in enumerate(prompts)):
        return prompts[::group], group
    runs = [len(list(run)) for _, run in itertools.groupby(prompts)]  # lengths of runs of equal prompts
    shown = f"{runs[:16]}{' ...' if len(runs) > 16 else ''}"
    setting = "num_generations" if training else "num_generations_eval"
    raise ValueError(
        f"rollout_func got {len(prompts)} prompts from TRL in runs of equal prompts {shown}; expected whole "
        f"groups, each prompt {group} times in a row ({setting} = {group}). A group split across processes? "
        "Each process's generation batch (train.per_device_train_batch_size x steps_per_generation, default "
        "train.gradient_accumulation_steps) must be a multiple of train.num_generations."
    )


class ReplayRollout:
    """TRL ``rollout_func`` that replays fixed completions instead of sampling (backend ``replay``).

    Every layout (nodes, processes, ZeRO stage) then trains on the same completions of the same
    prompts, so per-step losses and gradient norms are comparable. A prompt's group of G entries gets
    the first G completions listed for its question, tokenized without special tokens, cut to
    ``max_completion_tokens`` and ended with EOS when it fits. Returns ``prompt_ids``,
    ``completion_ids`` (B lists of token ids) and ``logprobs`` None (no sampling distribution).

    Raises:
        FileNotFoundError: ``replay_file`` does not exist.
        ValueError: a row without ``question``/``completions``, or a question with fewer completions than a group
            needs.
        KeyError: a prompt whose question has no row in the file.
    """

    def __init__(self, path: str | Path, tokenizer, gen_cfg) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"generation.replay_file {path} does not exist (JSONL of "
                                    '{"question": ..., "completions": [...]} rows)')
        self.tokenizer, self.gen, self.completions = tokenizer, gen_cfg, {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("question"), str) or not isinstance(row.get("completions"), list):
                raise ValueError(f"{path}:{number}: a row needs 'question' (str) and 'completions' (list of str)")
            self.completions[row["question"]] = row["completions"]

    def _completion_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.gen.max_completion_tokens]
        if len(ids) < self.gen.max_completion_tokens:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    def completions_for(self, prompt: str | list[dict], group: int) -> list[str]:
        """The first ``group`` completions of ``prompt``'s question (its last message).

        Raises:
            KeyError: the file has no row for the question.
            ValueError: the row lists fewer than ``group`` completions.
        """
        question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        if question not in self.completions:
            raise KeyError(f"generation.replay_file has no completions for the question {question!r}")
        texts = self.completions[question]
        if len(texts) < group:
            raise ValueError(f"generation.replay_file lists {len(texts)} completions for {question!r}; "
                             f"a group needs {group} (train.num_generations)")
        return texts[:group]

    def __call__(self, prompts: list, trainer) -> dict[str, list | None]:
        unique, group = prompt_groups(prompts, trainer)
        out: dict[str, list | None] = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        for prompt in unique:
            texts = self.completions_for(prompt, group)
            ids = encode_prompt(self.tokenizer, prompt)
            for text in texts:
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(self._completion_ids(text))
        return out


def reward_functions(cfg: PipelineConfig) -> list:
    """The configured rewards as TRL reward functions: options bound, each call guarded (timeout, errors ->
    None and counted), named as configured. Their ``rewards/<name>/timeouts|errors`` counts reach the
    trainer's logs through TRL's ``log_metric`` (see ``rewards/guard.py``)."""
    from rewards import build_reward

    return [build_reward(spec) for spec in cfg.rewards]


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
        report_to=[],  # metrics: grpo_steps.callbacks.MLflowMetricsCallback
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
    if gen.weight_sync == "nccl":  # TRL's own server mode: generation + NCCL weight transfer (GPUs only)
        kwargs.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=job.endpoint)
    if train.deepspeed:
        from grpo_steps.config import INFRA_DIR

        kwargs["deepspeed"] = str(INFRA_DIR / "deepspeed_zero3.json")
    return kwargs


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


def run(job: TrainJob) -> str:
    """Train; returns the directory of the final policy (``{output_dir}/final``, safetensors + tokenizer; with
    ``train.peft`` the adapter only: ``adapter_model.safetensors``, ``adapter_config.json`` + tokenizer).

    Also writes the trainer's per-step log to ``{output_dir}/log_history.json``.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    started = time.monotonic()
    cfg = job.config
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if cfg.train.deepspeed and not torch.cuda.is_available():
        import deepspeed  # ZeRO-3 on CPU: gloo must be up before GRPOConfig picks the backend

        deepspeed.comm.init_distributed(dist_backend="gloo")
    args = grpo_args(job)
    tokenizer = AutoTokenizer.from_pretrained(job.model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = getattr(torch, cfg.model.dtype) if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=dtype)
    rows = [json.loads(line) for line in Path(job.train_file).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(rows)

    rollout, trainer_class, server_kwargs = None, GRPOTrainer, {}
    if cfg.generation.backend == "vllm" and cfg.generation.mode == "colocate":
        if not torch.cuda.is_available():  # a GPU config run on a CPU machine: see COLOCATE_NEEDS_GPU
            from grpo_steps.config import COLOCATE_NEEDS_GPU, ConfigError

            raise ConfigError(f"{COLOCATE_NEEDS_GPU} (this machine has no CUDA device)")
        colocate_environment(cfg)
    elif cfg.generation.backend == "vllm" and cfg.generation.weight_sync == "disk":
        from grpo_steps.trainer import ServerGRPOTrainer, disk_sync
        from grpo_steps.weight_sync import VLLMClient

        client = VLLMClient(job.endpoint, model=job.served_model)
        rollout = VLLMRollout(client, tokenizer, cfg.generation)
        trainer_class = ServerGRPOTrainer
        probe_tolerance, max_logp_diff = cfg.generation.sync_check.thresholds(cfg.model.dtype)
        lora_push = cfg.train.peft.push if cfg.train.peft else None
        server_kwargs = dict(sync=disk_sync(client, tokenizer, rows[0]["prompt"], job.output_dir, probe_tolerance,
                                            cfg.generation.sync_dir, lora=lora_push),
                             max_logp_diff=max_logp_diff)
    elif cfg.generation.backend == "replay":
        rollout = ReplayRollout(cfg.generation.replay_file, tokenizer, cfg.generation)
    from grpo_steps.callbacks import AllNoneStop, DatastoreCheckpointCallback, MLflowMetricsCallback, ProgressCallback
    from grpo_steps.checkpoints import in_metaflow_task

    mlflow_cb = MLflowMetricsCallback(job.mlflow_run_id, cfg.tracking.tracking_uri) if job.mlflow_run_id else None
    callbacks = [ProgressCallback(started), AllNoneStop(cfg.train.max_all_none_steps)]
    callbacks += [mlflow_cb] if mlflow_cb else []
    if in_metaflow_task():
        callbacks.append(DatastoreCheckpointCallback(job.node_index, keep=cfg.train.save_total_limit,
                                                     log_metrics=mlflow_cb.log if mlflow_cb else None))
    trainer = trainer_class(
        model=model,
        reward_funcs=reward_functions(cfg),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
        callbacks=callbacks,
        peft_config=cfg.train.peft.lora_config() if cfg.train.peft else None,  # LoRA: TRL wraps the policy
        **server_kwargs,
    )
    if cfg.eval.every_steps:
        trainer.add_callback(eval_during_callback(job, trainer, tokenizer))
    try:
        trainer.train(resume_from_checkpoint=job.resume_from)
    finally:
        if "sync" in server_kwargs:
            server_kwargs["sync"].close()
    final = Path(job.output_dir) / "final"
    trainer.save_model(str(final))
    if trainer.accelerator.is_main_process:
        tokenizer.save_pretrained(final)
        (Path(job.output_dir) / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    return str(final)


def eval_during_callback(job: TrainJob, trainer, tokenizer):
    """The :class:`grpo_steps.eval_during.EvalDuringTraining` of this process: global rank 0 (on node 0)
    evaluates ``job.eval_file``'s rows and logs to ``job.mlflow_run_id``; the other ranks only push.

    Raises:
        ValueError: node 0's job has no ``eval_file`` (the flow's train step writes it).
    """
    from grpo_steps.eval_during import EvalDuringTraining, logged_steps

    evaluator = trainer.accelerator.is_main_process and job.node_index == 0
    if evaluator and not job.eval_file:
        raise ValueError("eval.every_steps needs the eval prompts in node 0's train job (TrainJob.eval_file)")
    rows = [json.loads(line) for line in Path(job.eval_file).read_text().splitlines() if line.strip()] \
        if evaluator else []
    log, logged = None, set()
    if evaluator and job.mlflow_run_id:
        from mlflow import MlflowClient

        from grpo_steps.tracking import log_metrics_with

        mlflow_client = MlflowClient(tracking_uri=job.config.tracking.tracking_uri)
        logged = logged_steps(mlflow_client, job.mlflow_run_id)

        def log(metrics, step):
            log_metrics_with(mlflow_client, job.mlflow_run_id, metrics, step)

    return EvalDuringTraining(job.config, trainer, trainer.vllm_generation.push.client if evaluator else None,
                              tokenizer, rows, log=log, logged_steps=logged, evaluator=evaluator)


def colocate_environment(cfg: PipelineConfig) -> None:
    """What TRL's colocate mode needs in the environment: vLLM's ``external_launcher`` reads the torch.distributed
    variables (set by ``accelerate launch``; a single process run directly gets rank 0 of 1), and the CPU
    backend its KV-cache size (GiB) and cores, as the local server gets them (``grpo_steps.vllm_server``)."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(29500 + os.getpid() % 1000),
                       "VLLM_CPU_KVCACHE_SPACE": str(cfg.generation.server.kv_cache_gib),
                       "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                       "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))}.items():
        os.environ.setdefault(key, value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="GRPO training on a prepared dataset (one job file).")
    parser.add_argument("job", help="JSON file of a TrainJob (written by the flow's train step)")
    args = parser.parse_args(argv)
    job = TrainJob.model_validate_json(Path(args.job).read_text())
    final = run(job)
    shut_down_process_group()
    print(final)


def shut_down_process_group() -> None:
    """Leave the distributed job together: a last barrier, then ``destroy_process_group``. Without it each
    rank tears its process group down in interpreter shutdown, in any order (PyTorch warns that this can
    hang), and a rank stuck there holds its node's torchelastic agent from the exit barrier."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
