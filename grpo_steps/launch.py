"""Launch the training process: ``accelerate launch ... -m grpo_steps.training JOB.json`` on one node.

Each node of the ``@parallel`` gang runs one launcher as machine ``node_index`` of
``num_nodes``; the job file carries the config and the run's inputs. A job of one process without
DeepSpeed needs no launcher (the Trainer's ``Accelerator`` is then a single process by itself):
it runs as ``python -m grpo_steps.training JOB.json``, which saves the launcher's start-up (~5 s of
imports on 2 CPU cores) in every run of the default configs.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from grpo_steps.config import INFRA_DIR
from grpo_steps.processes import run_watching_memory
from grpo_steps.training.job import TRAINING_MODULE, TrainJob


class TrainingFailed(RuntimeError):
    """The training process exited with a non-zero code or was killed (:func:`failure_message` says which)."""


def accelerate_command(job_file: str | Path, *, num_nodes: int, processes_per_node: int, node_index: int,
                       main_ip: str, main_port: int, deepspeed_config: str | None) -> list[str]:
    """The command line of one node's training: ``accelerate launch`` for several processes or DeepSpeed,
    the training module itself for one plain process.

    Several plain (DDP) processes go through ``--multi_gpu``, accelerate's ``torch.distributed.run`` launcher, on
    CPU machines too (the processes then join over gloo): its ``--cpu`` starts a single process per node (its
    multi-CPU mode needs MPI), and without a flag a node with one GPU would also run one process by itself, so
    the gang's nodes would each train alone."""
    if num_nodes * processes_per_node == 1 and not deepspeed_config:
        return [sys.executable, "-m", TRAINING_MODULE, str(job_file)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--num_machines", str(num_nodes), "--machine_rank", str(node_index),
           "--num_processes", str(num_nodes * processes_per_node),
           "--main_process_ip", main_ip, "--main_process_port", str(main_port),
           "--mixed_precision", "no", "--dynamo_backend", "no"]
    if deepspeed_config:  # accelerate refuses --cpu with it; the trainer sets use_cpu (grpo_steps.training.job)
        cmd += ["--use_deepspeed", "--deepspeed_config_file", deepspeed_config,
                "--deepspeed_multinode_launcher", "standard"]  # one launcher per node, no pdsh/ssh
    else:
        cmd.append("--multi_gpu")
    return cmd + ["--module", TRAINING_MODULE, str(job_file)]


CLUSTER_PORT = 29500
"""Node 0's rendezvous port on a cluster (accelerate's default), where each node is a pod with a network of its own."""


def cluster_port(configured: int) -> int:
    """The rendezvous port a JobSet declares for its control pod (``MF_MASTER_PORT``, :class:`grpo_steps.deploy.
    OnKubernetes`): ``train.main_process_port``, else :data:`CLUSTER_PORT`.

    >>> cluster_port(0), cluster_port(31000)
    (29500, 31000)
    """
    return configured or CLUSTER_PORT


def rendezvous_port(configured: int, run_key: str | None) -> int:
    """Port of node 0's rendezvous: ``train.main_process_port`` when set, else one derived from the run
    (every node of a gang computes the same, in 29500..49499), so simulated nodes of concurrent local
    runs on one machine do not collide. Without a run key: 29500 (accelerate's default).

    >>> rendezvous_port(1234, "r1"), rendezvous_port(0, None)
    (1234, 29500)
    """
    if configured:
        return configured
    if not run_key:
        return 29500
    return 29500 + int(hashlib.sha256(run_key.encode()).hexdigest(), 16) % 20000


def launch(job: TrainJob, *, node_index: int = 0, main_ip: str = "127.0.0.1", main_port: int | None = None,
           env: dict[str, str] | None = None) -> None:
    """Write the job file into ``job.output_dir`` and run this node's training process to the end.

    ``main_port`` defaults to :func:`rendezvous_port` of the config and the MLflow run id (shared by the gang).

    Raises:
        ResumeRefused: ``job.resume_from`` cannot be continued by this job (:func:`resume_on_this_gang`), before any
            training process starts.
        TrainingFailed: the process exited non-zero or was killed (its output went to this process's stdout); the
            message gives the signal and the peak resident memory of its process tree (:func:`failure_message`).
    """
    train = job.config.train
    job = resume_on_this_gang(job, node_index)
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    job_file = out / f"job-node{node_index}.json"
    job_file.write_text(job.model_dump_json(indent=2))
    main_port = main_port or rendezvous_port(train.main_process_port, job.mlflow_run_id)
    deepspeed_config = str(INFRA_DIR / "deepspeed_zero3.json") if train.deepspeed else None
    cmd = accelerate_command(job_file, num_nodes=train.num_nodes, processes_per_node=train.processes_per_node,
                             node_index=node_index, main_ip=main_ip, main_port=main_port,
                             deepspeed_config=deepspeed_config)
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    from grpo_steps.servers.gpus import places_gpus, trainer_devices, visible_gpus

    gpus = visible_gpus() if job.config.generation.provider == "local" else []
    if gpus and places_gpus(job.config, gpus):
        # one GPU box: the GPUs the server leaves, or its own when it has them all (docs/gpu.md)
        full_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in trainer_devices(job.config, gpus))
        full_env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # the indices are nvidia-smi's, as the server's are
    code, peak = run_watching_memory(cmd, env=full_env)
    if code != 0:
        raise TrainingFailed(failure_message(node_index, code, peak))


def failure_message(node_index: int, code: int, peak_bytes: int) -> str:
    """Why the training process of ``node_index`` ended with exit ``code`` (``-N``: signal N; 137 = 128 + 9, as a
    shell or container reports a SIGKILL), with the peak resident memory its process tree reached.

    A SIGKILL that the pipeline did not send is almost always the kernel's OOM killer (or a container's memory
    limit): said so, with the machine's memory and the keys that lower the training process's peak.

    >>> failure_message(0, 1, 2**30)
    'training process on node 0 exited with code 1 (peak resident memory 1.00 GiB); see the log above'
    """
    import signal

    import psutil

    peak = f"peak resident memory {peak_bytes / 2**30:.2f} GiB"
    number = -code if code < 0 else code - 128 if code in (128 + signal.SIGKILL,) else None
    if number == signal.SIGKILL:
        memory = psutil.virtual_memory()
        return (f"training process on node {node_index} was killed (signal 9), likely out of memory: {peak} "
                f"(its process tree, sampled every 0.5 s), this machine {memory.total / 2**30:.1f} GiB with "
                f"{memory.available / 2**30:.1f} GiB available now. Lower train.per_device_train_batch_size or "
                "generation.max_completion_tokens, set train.grpo.gradient_checkpointing: true, or raise "
                "resources.train.memory_mib; @retry and `resume` continue from the newest complete checkpoint")
    if number is not None:
        return (f"training process on node {node_index} was killed by signal {number} "
                f"({signal.Signals(number).name}) ({peak}); see the log above")
    return f"training process on node {node_index} exited with code {code} ({peak}); see the log above"


def resume_on_this_gang(job: TrainJob, node_index: int = 0) -> TrainJob:
    """``job``, ready to continue ``job.resume_from`` on its own gang (:func:`grpo_steps.elastic.prepare_resume`):
    refused with the reason when it cannot; converted once to a Universal Checkpoint when a ZeRO checkpoint was saved
    by another number of processes (the job then loads that); the resize logged and, on node 0, tagged on the job's
    MLflow run (``resume/*``).

    Raises:
        ResumeRefused: another model, LoRA shape, optimizer, ZeRO use or number of prompts per optimizer step.
    """
    if not job.resume_from:
        return job
    from grpo_steps.elastic import gang_of, prepare_resume

    plan = prepare_resume(job.resume_from, gang_of(job.config))
    if plan is None:
        return job
    print(plan.line(), flush=True)
    if job.mlflow_run_id and node_index == 0:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=job.config.tracking.tracking_uri)
        for key, value in plan.tags().items():
            client.set_tag(job.mlflow_run_id, key, value)
    return job.model_copy(update={"resume_universal": plan.universal})
