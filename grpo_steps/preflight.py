"""Everything ``start`` checks before anything is written (:func:`check`): the tracking server answers, the model
resolves (once, handed to every check that reads it), TRL knows the ``train.grpo`` keys, the code sandbox, tools and
chat template, LoRA targets, local replicas that fit this machine, the S3 bucket of ``weight_sync: s3`` and the server
pods' read-only Secret for it, ``/dev/shm`` room and ``train.resume_from``.

A refusal is printed as its message alone (:func:`refusals`): Metaflow prints a ``MetaflowException`` as a block
without the traceback that an ordinary exception gets ("Internal error" and 30 lines ending in the message).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from grpo_steps.config import PipelineConfig


def check(cfg: PipelineConfig) -> str:
    """Check ``cfg`` against this machine and the services it names; returns the resolved ``model.name_or_path``
    (:func:`grpo_steps.models.resolve_model`: a local directory, the embedded model converted once, a registered
    version fetched once and checked by digest, or a hub id).

    Raises:
        TrackingUnreachable: an ``http(s)`` tracking URI that does not answer (within seconds).
        FileNotFoundError: ``model.name_or_path`` is a local path that does not exist or holds no model (names what
            is missing: config, tokenizer files, weights).
        VersionError: a ``models:/`` start that names no version (names what exists), a revoked version, or files
            that fail their digest.
        ConfigError: ``train.grpo`` keys the installed TRL does not have; ``train.peft.target_modules`` naming no
            linear layer of the model; ``generation.server.replicas`` local servers and the trainer do not fit this
            machine; ``resources.vllm.s3_secret_name`` naming the flow's own Secret (:func:`check_server_secret`);
            a sourced ``.s3/env`` whose ``make s3`` no longer serves its endpoint
            (:func:`grpo_steps.dev.local_s3.check_env`).
        CheckpointNotFound: ``train.resume_from`` names no usable checkpoint.
        ConfigError: a ``models:/`` start served by Kubernetes pods, fetched outside the shared volume
            (:func:`check_registry_start`).
        SandboxUnavailable: ``code_execution`` is configured where only the weak sandbox mode works, without
            its ``allow_weak_isolation`` option.
        ConfigError: a teacher (``teacher:``) whose tokenizer differs from the policy's (:func:`check_teacher`).
        ServerStartError: an ``external`` teacher that does not answer.
        ToolError: ``model.chat_template`` names nothing, or cannot render a tool-calling exchange with tools or an
            environment configured; an environment without ``reset`` or with a tool that has no schema.
    """
    from grpo_steps import tracking
    from grpo_steps.dev import local_s3
    from grpo_steps.models import resolve_model
    from grpo_steps.servers import gpus
    from grpo_steps.training.job import check_grpo_keys

    tracking.check_reachable(cfg.tracking.tracking_uri)
    local_s3.check_env(os.environ)  # a sourced .s3/env whose `make s3` is gone: refused before a key is sent on
    model_path = resolve_model(cfg.model.name_or_path, cfg.tracking.tracking_uri)
    check_registry_start(cfg, model_path)
    check_grpo_keys(cfg)
    check_sandbox(cfg)
    check_code_reward_deadline(cfg)
    if cfg.tools or cfg.environment or cfg.model.chat_template:
        check_tools(cfg, model_path)
    if cfg.train.peft is not None:
        check_lora_targets(cfg, model_path)
    check_replicas(cfg, model_path)
    if cfg.teacher is not None:
        check_teacher(cfg, model_path)
    gpus.check_this_machine(cfg, model_path)  # the server's and the trainer's GPUs (docs/gpu.md)
    check_weight_store(cfg)
    check_server_secret(cfg.resources.vllm.s3_secret_name)
    warning = shm_shortfall(cfg, model_path)
    if warning:
        print(f"[start] warning: {warning}", flush=True)
    if cfg.train.resume_from:
        from grpo_steps.checkpoints import check_reference

        print(f"[checkpoint] train.resume_from: {check_reference(cfg.train.resume_from, cfg.train.num_nodes)}",
              flush=True)
    return model_path


def check_teacher(cfg: PipelineConfig, model_path: str) -> str:
    """The teacher of ``teacher:`` can score the policy's tokens: its tokenizer is the policy's (vocabulary, token to
    id map, special tokens: :func:`grpo_steps.servers.teacher.tokenizer_mismatch`), and an ``external`` teacher
    answers. Returns the teacher's resolved weights.

    Raises:
        ConfigError: the tokenizers differ (naming what differs).
        ServerStartError: an ``external`` teacher that does not answer ``/health`` or lists no model.
        FileNotFoundError, VersionError: ``teacher.model`` names nothing (as ``model.name_or_path``).
    """
    from transformers import AutoTokenizer

    from grpo_steps.config import ConfigError
    from grpo_steps.models import resolve_teacher
    from grpo_steps.servers import teacher as teacher_server

    teacher_path = resolve_teacher(cfg, model_path)
    mismatch = teacher_server.tokenizer_mismatch(AutoTokenizer.from_pretrained(model_path),
                                                 AutoTokenizer.from_pretrained(teacher_path))
    if mismatch:
        raise ConfigError(f"teacher.model {cfg.teacher.model!r} cannot score the policy's tokens: {mismatch}. The "
                          "teacher reads the policy's token ids as they are: choose a teacher of the same tokenizer "
                          f"as model.name_or_path {cfg.model.name_or_path!r} (the same model family)")
    if cfg.teacher.provider == "external":
        settings = cfg.teacher.server_settings(cfg.generation.server)
        teacher_server.reach(settings.endpoint, settings.startup_timeout_s)
    return teacher_path


def check_registry_start(cfg: PipelineConfig, model_path: str) -> None:
    """A ``models:/`` start served by ``generation.provider: kubernetes``: the server pods load ``model_path`` itself,
    so the fetched version must lie on the shared volume (``GRPO_CACHE_DIR`` under ``/shared``); a server pod cannot
    load a ``models:/`` URI.

    Raises:
        ConfigError: the fetched version lies elsewhere.
    """
    from grpo_steps.config import ConfigError, on_shared_volume

    if cfg.model.name_or_path.startswith("models:/") and cfg.generation.provider == "kubernetes" and not (
            on_shared_volume(model_path)):
        raise ConfigError(f"model.name_or_path {cfg.model.name_or_path!r} with generation.provider kubernetes: the "
                          f"server pods load the fetched version ({model_path}), which only the shared volume gives "
                          "them: set GRPO_CACHE_DIR to a folder under /shared (resources.shared_volume_claim)")


def refusal_types() -> tuple[type[BaseException], ...]:
    """The errors that refuse a run for a reason its message says (bad config, data, model, or an unreachable
    service), as opposed to a bug: those :func:`refusals` prints without a traceback."""
    from grpo_steps.checkpoints import CheckpointNotFound
    from grpo_steps.config import ConfigError
    from grpo_steps.sources import DataError
    from grpo_steps.tools.functions import ToolError
    from grpo_steps.tracking import TrackingUnreachable
    from grpo_steps.versions import VersionError
    from grpo_steps.weights.chain import ChainStoreError
    from rewards.sandbox import SandboxUnavailable

    return ConfigError, DataError, ToolError, TrackingUnreachable, CheckpointNotFound, SandboxUnavailable, \
        FileNotFoundError, ChainStoreError, VersionError


@contextmanager
def refusals(headline: str):
    """Re-raise a refusal (:func:`refusal_types`) raised in the block as a ``MetaflowException`` headed
    ``headline``, which Metaflow prints as that line and the message, with no traceback; other errors pass unchanged
    (a bug keeps its traceback)."""
    from metaflow.exception import MetaflowException

    try:
        yield
    except refusal_types() as err:
        refused = type("Refused", (MetaflowException,), {"headline": headline})  # the block's first line
        raise refused(f"{type(err).__name__}: {err}") from None


def check_weight_store(cfg: PipelineConfig) -> None:
    """With ``generation.weight_sync: s3``: the versions have a place (``generation.s3_sync.url`` or the Metaflow S3
    datastore) where this process's credentials write (one small object written and deleted, within botocore's
    retries).

    Raises:
        ConfigError: no location: names the two ways to give one.
        ChainStoreError: S3 does not answer or refuses these credentials (names the key).
    """
    if not cfg.generation.pushes_through_s3:
        return
    from grpo_steps.config import ConfigError
    from grpo_steps.weights.chain import run_store
    from grpo_steps.weights.publisher import publisher_of

    store = run_store(cfg.generation.s3_sync, "preflight")
    if store is None:
        raise ConfigError("generation.weight_sync 's3' needs a place for the weight versions: set "
                          "generation.s3_sync.url (s3://bucket/prefix), or run with the Metaflow S3 datastore "
                          "(METAFLOW_DATASTORE_SYSROOT_S3; e.g. the environment `make s3` prints)")
    publisher_of(store).check_access()


def flow_secrets() -> set[str]:
    """The Kubernetes Secrets the flow's own pods get as environment variables: Metaflow's
    ``METAFLOW_KUBERNETES_SECRETS`` and ``METAFLOW_ARGO_WORKFLOWS_KUBERNETES_SECRETS`` (comma-separated names, from the
    environment or the Metaflow profile; infra/metaflow/config-k8s-argo.json sets both; Metaflow passes the second into
    every pod of an Argo run)."""
    from metaflow import metaflow_config

    lists = (metaflow_config.KUBERNETES_SECRETS, metaflow_config.ARGO_WORKFLOWS_KUBERNETES_SECRETS)
    return {name.strip() for names in lists for name in (names or "").split(",") if name.strip()}


def check_server_secret(name: str | None, flow: set[str] | None = None) -> None:
    """The generation server pods' S3 Secret (``resources.vllm.s3_secret_name``) is not one of the flow's own
    (``flow``, default :func:`flow_secrets`): the flow's keys write the datastore and the weight chain, and a server pod
    runs third-party code (vLLM, the model's code) that only reads the chain. Checked in ``start`` and where a run or a
    deployment to Kubernetes is launched (:class:`grpo_steps.deploy.OnKubernetes`).

    Raises:
        ConfigError: ``name`` is one of the flow's Secrets; says how to make a read-only one (docs/deploy.md).
    """
    if name is None or name not in (flow_secrets() if flow is None else flow):
        return
    from grpo_steps.config import ConfigError

    raise ConfigError(
        f"resources.vllm.s3_secret_name {name!r} is a Secret of the flow's own pods (METAFLOW_KUBERNETES_SECRETS / "
        "METAFLOW_ARGO_WORKFLOWS_KUBERNETES_SECRETS), whose keys write the datastore and the weight chain: the server "
        "pods only read the chain. Give them a Secret of their own with read-only access to generation.s3_sync.url's "
        "prefix (docs/deploy.md, 'Weight versions through S3': grpo-s3-readonly and its bucket policy), or null to use "
        "the pods' own identity")


def check_replicas(cfg: PipelineConfig, model_path: str) -> None:
    """Several ``local`` generation replicas fit this machine with the trainer: a core each, and memory
    (:func:`grpo_steps.servers.local.replicas_fit`). Raises ConfigError with the numbers."""
    if cfg.generation.provider != "local" or cfg.generation.server.replica_count == 1:
        return
    import psutil

    from grpo_steps.config import ConfigError
    from grpo_steps.servers.local import replicas_fit
    from grpo_steps.weights.files import safetensors_params

    params = safetensors_params(model_path)
    why = replicas_fit(cfg, params or 0, psutil.virtual_memory().total, sorted(os.sched_getaffinity(0)))
    if why:
        raise ConfigError(why)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def shm_shortfall(cfg: PipelineConfig, model_path: str) -> str | None:
    """Why ``/dev/shm`` may be too small for this run, or None: it holds the train step's checkpoints before they
    reach the datastore and, unless ``generation.sync_dir`` moves them, the ``disk`` weight pushes; a run needs room
    for two of each (the push the server loads and the one rewritten next; the newest checkpoint and the one being
    saved). Sizes from the model's parameter count (its safetensors headers; a hub id not on disk is not checked):
    a push is the weights in ``model.dtype``, a checkpoint the weights plus AdamW's two float32 moments (LoRA: the
    adapter, neglected). Compared with ``resources.train.shared_memory_mib`` when the steps run on Kubernetes
    (``resources.train.image``; 64 MiB when null), else with this machine's ``/dev/shm``."""
    import shutil

    from grpo_steps.weights.files import safetensors_params

    params = safetensors_params(model_path)
    if not params:
        return None
    gen, full = cfg.generation, cfg.train.peft is None or cfg.train.peft.push == "merged"
    weights = params * DTYPE_BYTES[cfg.model.dtype]
    pushes = weights if full and gen.pushes_into_scratch else 0
    checkpoint = weights + 2 * 4 * params if cfg.train.peft is None else 0
    needed = 2 * pushes + 2 * checkpoint
    if cfg.resources.train.image:
        size, where = (cfg.resources.train.shared_memory_mib or 64) * 2**20, "resources.train.shared_memory_mib"
    elif Path("/dev/shm").is_dir():
        size, where = shutil.disk_usage("/dev/shm").total, "/dev/shm on this machine"
    else:
        return None
    if size >= needed:
        return None
    mib = 2**20
    return (f"/dev/shm ({where}) is {size / mib:.0f} MiB, less than the {needed / mib:.0f} MiB two weight pushes "
            f"(2 x {pushes / mib:.0f} MiB) and two checkpoints (2 x {checkpoint / mib:.0f} MiB) of "
            f"{cfg.model.name_or_path} take: a push or a checkpoint save may stop on a full disk. Enlarge /dev/shm "
            "(docker --shm-size, resources.train.shared_memory_mib on Kubernetes) or set generation.sync_dir to a "
            "directory the server can read")


SHIPPED_TEST_SOURCES = ("humaneval",)
"""Sources whose test code ships with an installed package (trusted without a declaration)."""


def check_sandbox(cfg: PipelineConfig) -> None:
    """The code reward's sandbox can contain programs here, or the config accepts the weak mode explicitly
    (:func:`rewards.sandbox.require_isolation`); where the judge cannot be walled off from the host's files
    (any mode but ``bwrap+audit``), test code from sources other than the shipped ones runs only when the
    reward's options declare it trusted (``trust_test_code: true``); with ``require_memory_bound: true`` the host
    allows a memory cgroup per run (:func:`rewards.sandbox.check_memory_bound`). Prints the isolation mode and the
    per-run memory bound (or that it is off). Raises SandboxUnavailable."""
    from rewards import resolve_reward
    from rewards.code import code_execution

    for spec in cfg.rewards:
        if resolve_reward(spec.name) is code_execution:  # by registry name or dotted path alike
            from rewards.sandbox import Limits, SandboxUnavailable, check_memory_bound, require_isolation
            from rewards.sandbox_cgroup import memory_parent

            mode = require_isolation(bool(spec.options.get("allow_weak_isolation", False)))
            print(f"[sandbox] code_execution isolation: {mode}", flush=True)
            if spec.options.get("require_memory_bound", False):
                check_memory_bound()
            if parent := memory_parent():
                limits = Limits(memory_mib=spec.options.get("memory_mib", Limits.memory_mib),
                                memory_per_run_mib=spec.options.get("memory_per_run_mib"))
                print(f"[sandbox] memory bound per run: {limits.run_memory_mib} MiB (cgroup v{parent.version} under "
                      f"{parent.path})", flush=True)
            sources = sorted({src.source for src in (cfg.data.mixture or [cfg.data])} - set(SHIPPED_TEST_SOURCES))
            if mode != "bwrap+audit" and sources and not spec.options.get("trust_test_code", False):
                raise SandboxUnavailable(
                    f"code_execution runs the dataset's test code (data.source {', '.join(sources)}) in the judge, "
                    f"which isolation {mode!r} cannot keep from reading the host's files: install bubblewrap "
                    "(`apt-get install bubblewrap`, where user namespaces are allowed), or, for test code you "
                    "trust, set `trust_test_code: true` in the code_execution reward's options")


def check_code_reward_deadline(cfg: PipelineConfig) -> None:
    """Each code reward's guard (``rewards[].timeout_s``) can hold one training batch of sandbox runs:
    ``ceil(completions / workers) x (sandbox timeout_s + start-up)``, completions being a training process's
    generation batch (``per_device_train_batch_size x steps_per_generation``, or ``generation_batch_size / world
    size``), start-up :data:`rewards.sandbox.STARTUP_ALLOWANCE_S`. A shorter guard gives up on batches whose
    programs all loop, scoring their unfinished completions None. Raises ConfigError naming the numbers."""
    import math

    from grpo_steps.config import ConfigError
    from rewards import resolve_reward
    from rewards.code import code_execution

    train = cfg.train
    steps = train.grpo.get("steps_per_generation", train.gradient_accumulation_steps)
    completions = train.per_device_train_batch_size * steps if isinstance(steps, int) else None
    if isinstance(train.grpo.get("generation_batch_size"), int):
        completions = train.grpo["generation_batch_size"] // train.world_size
    for spec in cfg.rewards:
        if completions is None or resolve_reward(spec.name) is not code_execution:
            continue
        from rewards.sandbox import STARTUP_ALLOWANCE_S, default_workers

        workers = spec.options.get("workers") or default_workers()
        sandbox_s = float(spec.options.get("timeout_s", 10.0))
        needed = math.ceil(completions / workers) * (sandbox_s + STARTUP_ALLOWANCE_S)
        if spec.timeout_s < needed:
            raise ConfigError(
                f"rewards: {spec.name}'s timeout_s is {spec.timeout_s:g} s, but one batch of {completions} completions "
                f"on {workers} sandbox workers can take ceil({completions}/{workers}) x ({sandbox_s:g} s sandbox "
                f"timeout_s + {STARTUP_ALLOWANCE_S:g} s start-up) = {needed:g} s: set the reward's timeout_s to "
                f"{math.ceil(needed)} or more, or raise options.workers, or lower options.timeout_s")


def check_tools(cfg: PipelineConfig, model_path: str) -> None:
    """``model.chat_template`` loads; with tools or an environment, the environment's instances have ``reset`` and
    describable tools and the chat template renders a tool-calling exchange with the tools' schemas.

    Raises:
        ToolError: as :func:`grpo_steps.tools.functions.check_tool_calling`."""
    from grpo_steps.models import load_tokenizer
    from grpo_steps.tools.environments import prompt_tools
    from grpo_steps.tools.functions import check_tool_calling

    tokenizer = load_tokenizer(model_path, cfg.model.chat_template)
    if cfg.tools or cfg.environment:
        tools = prompt_tools(cfg.tools, cfg.environment, cfg.generation.tool_timeout_s)
        check_tool_calling(tokenizer, tools, cfg.model.chat_template)


def check_lora_targets(cfg: PipelineConfig, model_path: str) -> None:
    """``train.peft.target_modules`` against the policy's architecture (a local or embedded model; a hub id is
    checked by PEFT when training starts). Raises ConfigError."""
    from grpo_steps.lora import check_target_modules

    if cfg.train.peft.target_modules == "all-linear":  # fits every architecture
        return
    if Path(model_path).is_dir():
        check_target_modules(cfg.train.peft, model_path)
