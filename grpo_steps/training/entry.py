"""GRPO training entry point: ``python -m grpo_steps.training JOB.json`` (under ``accelerate launch``).

Runs TRL's ``GRPOTrainer`` on the prepared train split of a :class:`grpo_steps.training.job.TrainJob`. With the
``vllm`` backend, rollouts come from the provisioned server through TRL's own generation path onto
:class:`grpo_steps.training.generation.RolloutBackend`, with the pipeline's weight pushes (``disk`` or ``s3``),
verified, and TRL's mismatch correction (:mod:`grpo_steps.training.trainer`); with ``hf``, TRL generates with
transformers in-process; with ``recorded``, fixed completions come from a file
(:class:`grpo_steps.training.rollouts.RecordedRollout`). Metrics go to the MLflow run named by
``job.mlflow_run_id`` (each step once, across resumes); checkpoints are written every ``save_steps`` and, inside
a Metaflow task, saved to the datastore by :class:`grpo_steps.training.callbacks.DatastoreCheckpointCallback`.
Runs without Metaflow too, for debugging.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

from grpo_steps.config import PipelineConfig
from grpo_steps.training.job import SPLIT_RESULTS, TrainJob, grpo_args
from grpo_steps.training.rollouts import RecordedRollout


def reward_functions(cfg: PipelineConfig) -> list:
    """The configured rewards as TRL reward functions: options bound, each call guarded (timeout, errors ->
    None and counted), named as configured. Their ``rewards/<name>/timeouts|errors`` counts reach the
    trainer's logs through TRL's ``log_metric`` (see ``rewards/guard.py``)."""
    from rewards import build_reward

    return [build_reward(spec) for spec in cfg.rewards]


def run(job: TrainJob) -> str:
    """Train; returns the directory of the final policy (``{output_dir}/final``, safetensors + tokenizer; with
    ``train.peft`` the adapter only: ``adapter_model.safetensors``, ``adapter_config.json`` + tokenizer).

    Also writes the trainer's per-step log to ``{output_dir}/log_history.json``.
    """
    from grpo_steps import trl_hooks

    if not job.config.generation.trl_samples_with_vllm:
        trl_hooks.skip_trls_vllm_imports()  # before anything below imports TRL's trainer
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.models import load_tokenizer
    from grpo_steps.training.distributed import check_ranks_agree
    from grpo_steps.training.generation.server import RolloutBackend

    started = time.monotonic()
    cfg = job.config
    pin_cpu_cores(cfg.train.cpu_cores)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if cfg.train.deepspeed and not torch.cuda.is_available():
        import deepspeed  # ZeRO-3 on CPU: gloo must be up before GRPOConfig picks the backend

        # DeepSpeed would compile its shared-memory allreduce op (C++) when the process group starts on CPU: 1.5 to
        # 19 min of the 2-core box on the first run of each checkout (its build records the venv's paths), for
        # collectives gloo does. The op table is DeepSpeed's, kept for edits (deepspeed/ops/__init__.py).
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.comm.init_distributed(dist_backend="gloo")
    args = grpo_args(job)
    tokenizer = load_tokenizer(job.model_path, cfg.model.chat_template)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dtype = getattr(torch, cfg.model.dtype) if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(job.model_path, dtype=dtype)
    trainer = build_trainer(job, args, model, tokenizer, started)
    try:
        trainer.train(resume_from_checkpoint=job.resume_from)
    finally:  # stop the async producer, remove the push directory, on success and on failure alike
        try:
            if isinstance(getattr(trainer, "vllm_generation", None), RolloutBackend):  # TRL's vLLM paths only
                trainer.vllm_generation.close()
        finally:
            trainer.close_environments()  # the environments' worker processes
    check_ranks_agree(trainer.accelerator, trainer.model, trainer.is_deepspeed_enabled)
    final = Path(job.output_dir) / "final"
    trainer.save_model(str(final))
    if trainer.accelerator.is_main_process:
        tokenizer.save_pretrained(final)
        (Path(job.output_dir) / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    return str(final)


def build_trainer(job: TrainJob, args, model, tokenizer, started: float):
    """The trainer of ``job``: TRL's ``GRPOTrainer`` (:mod:`grpo_steps.training.trainer`) on the prepared train split,
    with the configured rewards, LoRA, tools or environment, zero-signal mode, the generation backend
    (:func:`backend`) and the pipeline's callbacks (:func:`callbacks`; ``started``: ``time.monotonic()`` at the
    start of the process, for the progress lines)."""
    from datasets import Dataset

    from grpo_steps.tools.environments import environment_factories, trl_environment_factory
    from grpo_steps.tools.functions import tool_functions
    from grpo_steps.training.curriculum.sampler import CurriculumCallback
    from grpo_steps.training.curriculum.sampler import build as build_curriculum
    from grpo_steps.training.distill import from_job as distill_from_job
    from grpo_steps.training.gang import GangManifestCallback, RepairUniversalLoad
    from grpo_steps.training.zero_signal import mode_for

    cfg = job.config
    rows = [json.loads(line) for line in Path(job.train_file).read_text().splitlines() if line.strip()]
    trainer_class, backend_kwargs = backend(job, tokenizer, rows)
    first, of_trainer = callbacks(job, tokenizer, started)
    cursor = prompt_cursor(job, args, rows)
    first.insert(0, GangManifestCallback(cfg, cursor))  # writes into each checkpoint before the datastore upload
    curriculum = build_curriculum(cfg, args, rows, job.resume_from)
    if curriculum is not None:  # its state too, before the upload
        first.insert(0, CurriculumCallback(curriculum.rates, job.mlflow_run_id, cfg.tracking.tracking_uri))
    if job.resume_universal:
        first.append(RepairUniversalLoad(job.resume_from))
    trainer = trainer_class(
        model=model,
        reward_funcs=reward_functions(cfg),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=first,
        peft_config=cfg.train.peft.lora_config() if cfg.train.peft else None,  # LoRA: TRL wraps the policy
        # multi-turn rollouts: TRL's own tool loop (grpo_steps.training.trainer), each call under tool_timeout_s
        tools=tool_functions(cfg.tools, cfg.generation.tool_timeout_s,
                             cfg.generation.max_tool_response_length) or None,
        environment_factory=trl_environment_factory(environment_factories(
            cfg.environment, cfg.generation.tool_timeout_s, cfg.generation.max_tool_response_length,
            cfg.generation.episode_timeout_s)),
        zero_signal=mode_for(cfg.train),
        turn_credit=cfg.train.turn_credit,
        distill=distill_from_job(cfg, job.server),  # teacher: on-policy distillation
        prompt_cursor=cursor,
        curriculum=curriculum,
        **backend_kwargs,
    )
    for make in of_trainer:  # callbacks that read the trainer itself
        trainer.add_callback(make(trainer))
    return trainer


def prompt_cursor(job: TrainJob, args, rows: list[dict]):
    """The run's :class:`grpo_steps.training.cursor.PromptCursor` over the train rows, at the cursor of
    ``job.resume_from`` when it holds one (``args``: the ``GRPOConfig``: prompts per generation batch)."""
    from grpo_steps.training.cursor import PromptCursor, prompt_id, prompts_per_epoch

    per_epoch = prompts_per_epoch(len(rows), args.generation_batch_size // args.num_generations)
    return PromptCursor.load([prompt_id(row["prompt"]) for row in rows], per_epoch, job.resume_from)


def backend(job: TrainJob, tokenizer, rows: list[dict]) -> tuple[type, dict]:
    """The trainer class and its backend arguments for ``generation``: our server with the pipeline's
    pushes (``disk`` or ``s3`` sync)
    (:class:`grpo_steps.training.trainer.ServerGRPOTrainer` with its
    :func:`grpo_steps.training.generation.server_settings`; the probe is the first training prompt), TRL's own
    colocated vLLM (GPU only), fixed completions from a file (``recorded``:
    :class:`grpo_steps.training.rollouts.RecordedRollout`), or TRL's own generation (``hf``, ``nccl``).

    Raises:
        ConfigError: colocate mode on a machine without CUDA.
    """
    from grpo_steps.training.trainer import PipelineGRPOTrainer

    cfg = job.config
    gen = cfg.generation
    if gen.backend == "vllm" and gen.mode == "colocate":
        import torch

        if not torch.cuda.is_available():  # a GPU config run on a CPU machine: see COLOCATE_NEEDS_GPU
            from grpo_steps.config import COLOCATE_NEEDS_GPU, ConfigError

            raise ConfigError(f"{COLOCATE_NEEDS_GPU} (this machine has no CUDA device)")
        colocate_variables(cfg)
    elif gen.pushes_to_server:
        import dataclasses

        from transformers import AutoConfig

        from grpo_steps.training.generation.server import server_settings
        from grpo_steps.training.trainer import ServerGRPOTrainer

        # sampled ids past the policy's vocabulary are a lying (or hijacked) server's: refused by the client
        vocab_size = getattr(AutoConfig.from_pretrained(job.model_path), "vocab_size", None)
        client = dataclasses.replace(job.generation_server().client(), vocab_size=vocab_size)
        return ServerGRPOTrainer, {"server": server_settings(cfg, client, tokenizer, rows[0]["prompt"],
                                                             job.output_dir, job.weight_store)}
    elif gen.backend == "recorded":
        return PipelineGRPOTrainer, {"rollout_func": RecordedRollout(gen.recorded_file, tokenizer, gen)}
    return PipelineGRPOTrainer, {}


def callbacks(job: TrainJob, tokenizer, started: float) -> tuple[list, list]:
    """The pipeline's callbacks: those given to the trainer's constructor (progress lines, the all-None stop,
    MLflow metrics with a tracked run, checkpoints to the Metaflow datastore inside a Metaflow task), and makers
    ``fn(trainer) -> callback`` of those that read the trainer (evaluation during training, ``eval.every_steps``;
    completions tables, ``train.log_completions_steps`` with a tracked run), added after it is built."""
    from grpo_steps.checkpoints import in_metaflow_task
    from grpo_steps.training.callbacks import (
        AllNoneStop,
        CompletionsTableCallback,
        DatastoreCheckpointCallback,
        MLflowMetricsCallback,
        ProgressCallback,
        engine_metrics,
    )

    cfg = job.config
    mlflow_cb = MLflowMetricsCallback(job.mlflow_run_id, cfg.tracking.tracking_uri,
                                      cfg.tracking.outage_wait_s) if job.mlflow_run_id else None
    first = [ProgressCallback(started), AllNoneStop(cfg.train.max_all_none_steps),
             *engine_metrics(job)] + ([mlflow_cb] if mlflow_cb else [])  # engine metrics join the logs before MLflow
    if in_metaflow_task():
        first.append(DatastoreCheckpointCallback(job.node_index, keep=cfg.train.save_total_limit,
                                                 log_metrics=mlflow_cb.log if mlflow_cb else None,
                                                 num_nodes=cfg.train.num_nodes))
    queue = mlflow_cb.queue if mlflow_cb else None  # metrics, curves and tables: one queue, drained at train end
    of_trainer = [partial(eval_during_callback, job, tokenizer=tokenizer, queue=queue)] if cfg.eval.every_steps else []
    if queue and cfg.train.log_completions_steps:
        of_trainer.append(partial(CompletionsTableCallback, queue=queue, every=cfg.train.log_completions_steps))
    return first, of_trainer


def eval_during_callback(job: TrainJob, trainer, tokenizer, queue=None):
    """The :class:`grpo_steps.training.eval_during.EvalDuringTraining` of this process: global rank 0 (on node 0)
    evaluates ``job.eval_file``'s rows and logs them on ``queue`` (the run's
    :class:`grpo_steps.tracking.TrackingQueue`; None: no tracked run); the other ranks only push.

    Raises:
        ValueError: node 0's job has no ``eval_file`` (the flow's train step writes it).
    """
    from grpo_steps.training.eval_during import EvalDuringTraining, logged_steps

    evaluator = trainer.accelerator.is_main_process and job.node_index == 0
    if evaluator and not job.eval_file:
        raise ValueError("eval.every_steps needs the eval prompts in node 0's train job (TrainJob.eval_file)")
    rows = [json.loads(line) for line in Path(job.eval_file).read_text().splitlines() if line.strip()] \
        if evaluator else []
    log, log_table, logged = None, None, set()
    if evaluator and queue is not None:
        logged = logged_steps(queue.client, job.mlflow_run_id)
        log, log_table = queue.log, queue.log_table  # a tracking outage delays the curve's points, never the step

    # step 0 and the last step also measure the evaluate step's baseline and trained policy
    split_rows = [json.loads(line) for line in Path(job.eval_split_file).read_text().splitlines() if line.strip()] \
        if evaluator and job.eval_split_file else None
    return EvalDuringTraining(job.config, trainer, trainer.vllm_generation.client if evaluator else None,
                              tokenizer, rows, log=log, log_table=log_table, logged_steps=logged, evaluator=evaluator,
                              split_rows=split_rows,
                              split_results={label: str(Path(job.output_dir) / name)
                                             for label, name in SPLIT_RESULTS.items()})


def pin_cpu_cores(cores: list[int] | None) -> None:
    """``train.cpu_cores``: run this process on those cores with as many torch threads (None: unchanged).

    Raises:
        ConfigError: a core this machine does not give the process.
    """
    if cores is None:
        return
    import torch

    from grpo_steps.config import ConfigError

    available = os.sched_getaffinity(0)
    missing = sorted(set(cores) - available)
    if missing:
        raise ConfigError(f"train.cpu_cores {cores}: cores {missing} are not available to the training process "
                          f"(it may use {sorted(available)}); pick among those, or null for all")
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def colocate_variables(cfg: PipelineConfig) -> None:
    """What TRL's colocate mode needs in the process variables (``os.environ``): vLLM's ``external_launcher`` reads
    the torch.distributed variables (set by ``accelerate launch``; a single process run directly gets rank 0 of 1),
    and the CPU backend its KV-cache size (GiB) and cores, as the local server gets them
    (``grpo_steps.servers.local``)."""
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
    from grpo_steps.training.distributed import shut_down_process_group

    distributed = shut_down_process_group()
    print(final, flush=True)
    if distributed:
        # Everything is written (final policy, checkpoints, logs) and the process group is destroyed; skip the
        # interpreter's finalization, where gloo's worker threads can still release tensors they held and abort the
        # process with SIGABRT ("terminate called without an active exception", pytorch/pytorch#179291): seen once
        # in ~10 runs of the 2-process ZeRO-3 test on the loaded 2-core machine, after training had finished.
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
