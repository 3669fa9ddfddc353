"""One function per flow step: the step bodies in ``flows/grpo_flow.py`` only move artifacts.

Heavy imports (torch, transformers, mlflow, vllm clients) happen inside these functions, so the
flow file imports fast and ``--help`` is instant.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpo_steps import tracking
from grpo_steps.config import PipelineConfig, validate_config
from grpo_steps.processes import scratch_dir  # noqa: F401  (the train step's working directory)
from grpo_steps.redaction import redact
from grpo_steps.report import card_components  # noqa: F401  (the evaluate step's card)


def config_of(config_value: Any) -> PipelineConfig:
    """The typed config from the flow's Metaflow ``Config`` value (already validated by the parser)."""
    return validate_config(dict(config_value.to_dict() if hasattr(config_value, "to_dict") else config_value))


def start(cfg: PipelineConfig, pathspec: str) -> str:
    """Check what can be checked before anything is written, then open the flow's MLflow run; returns its id.

    Raises:
        TrackingUnreachable: an ``http(s)`` tracking URI that does not answer (within seconds).
        FileNotFoundError: ``model.name_or_path`` is a local path that does not exist or holds no model (names what
            is missing: config, tokenizer files, weights).
        ConfigError: ``train.grpo`` keys the installed TRL does not have; ``train.peft.target_modules`` naming no
            linear layer of the model.
        CheckpointNotFound: ``train.resume_from`` names no usable checkpoint.
        SandboxUnavailable: ``code_execution`` is configured where only the weak sandbox mode works, without
            its ``allow_weak_isolation`` option.
        ToolError: ``model.chat_template`` names nothing, or cannot render a tool-calling exchange with tools or an
            environment configured; an environment without ``reset`` or with a tool that has no schema.
        ConfigError: (also) ``generation.server.replicas`` local servers and the trainer do not fit this machine.
    """
    from grpo_steps.training.job import check_grpo_keys

    tracking.check_reachable(cfg.tracking.tracking_uri)
    check_model(cfg.model.name_or_path)
    check_grpo_keys(cfg)
    check_sandbox(cfg)
    if cfg.tools or cfg.environment or cfg.model.chat_template:
        check_tools(cfg)
    if cfg.train.peft is not None:
        check_lora_targets(cfg)
    check_replicas(cfg)
    warning = shm_shortfall(cfg)
    if warning:
        print(f"[start] warning: {warning}", flush=True)
    if cfg.train.resume_from:
        from grpo_steps.checkpoints import check_reference

        print(f"[checkpoint] train.resume_from: {check_reference(cfg.train.resume_from, cfg.train.num_nodes)}",
              flush=True)
    return tracking.open_run(cfg, pathspec)


def check_model(name_or_path: str) -> None:
    """A local ``model.name_or_path`` exists and holds a model (:func:`grpo_steps.models.check_model_dir`); an
    embedded model (converted later, in ``prepare_data``) and a hub id are not checked here. Raises
    FileNotFoundError."""
    from grpo_steps.models import EMBEDDED_PREFIX, resolve_model

    if not name_or_path.startswith(EMBEDDED_PREFIX):
        resolve_model(name_or_path)


def check_replicas(cfg: PipelineConfig) -> None:
    """Several ``local`` generation replicas fit this machine with the trainer: a core each, and memory
    (:func:`grpo_steps.servers.local.replicas_fit`). Raises ConfigError with the numbers."""
    if cfg.generation.provider != "local" or cfg.generation.server.replica_count == 1:
        return
    import psutil

    from grpo_steps.config import ConfigError
    from grpo_steps.models import resolve_model
    from grpo_steps.servers.local import replicas_fit
    from grpo_steps.weight_files import safetensors_params

    params = safetensors_params(resolve_model(cfg.model.name_or_path))
    why = replicas_fit(cfg, params or 0, psutil.virtual_memory().total, sorted(os.sched_getaffinity(0)))
    if why:
        raise ConfigError(why)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def shm_shortfall(cfg: PipelineConfig) -> str | None:
    """Why ``/dev/shm`` may be too small for this run, or None: it holds the train step's checkpoints before they
    reach the datastore and, unless ``generation.sync_dir`` moves them, the ``disk`` weight pushes; a run needs room
    for two of each (the push the server loads and the one rewritten next; the newest checkpoint and the one being
    saved). Sizes from the model's parameter count (its safetensors headers; a hub id not on disk is not checked):
    a push is the weights in ``model.dtype``, a checkpoint the weights plus AdamW's two float32 moments (LoRA: the
    adapter, neglected). Compared with ``resources.train.shared_memory_mib`` when the steps run on Kubernetes
    (``resources.train.image``; 64 MiB when null), else with this machine's ``/dev/shm``."""
    import shutil

    from grpo_steps.models import resolve_model
    from grpo_steps.weight_files import safetensors_params

    params = safetensors_params(resolve_model(cfg.model.name_or_path))
    if not params:
        return None
    gen, full = cfg.generation, cfg.train.peft is None or cfg.train.peft.push == "merged"
    weights = params * DTYPE_BYTES[cfg.model.dtype]
    pushes = weights if full and gen.backend == "vllm" and gen.weight_sync == "disk" and not gen.sync_dir else 0
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
    reward's options declare it trusted (``trust_test_code: true``). Raises SandboxUnavailable."""
    for spec in cfg.rewards:
        if spec.name == "code_execution":
            from rewards.sandbox import SandboxUnavailable, require_isolation

            mode = require_isolation(bool(spec.options.get("allow_weak_isolation", False)))
            print(f"[sandbox] code_execution isolation: {mode}", flush=True)
            sources = sorted({src.source for src in (cfg.data.mixture or [cfg.data])} - set(SHIPPED_TEST_SOURCES))
            if mode != "bwrap+audit" and sources and not spec.options.get("trust_test_code", False):
                raise SandboxUnavailable(
                    f"code_execution runs the dataset's test code (data.source {', '.join(sources)}) in the judge, "
                    f"which isolation {mode!r} cannot keep from reading the host's files: install bubblewrap "
                    "(`apt-get install bubblewrap`, where user namespaces are allowed), or, for test code you "
                    "trust, set `trust_test_code: true` in the code_execution reward's options")


def check_tools(cfg: PipelineConfig) -> None:
    """``model.chat_template`` loads; with tools or an environment, the environment's instances have ``reset`` and
    describable tools and the chat template renders a tool-calling exchange with the tools' schemas (the model is
    resolved: the embedded one is converted once). Raises ToolError."""
    from grpo_steps.models import load_tokenizer, resolve_model
    from grpo_steps.tools import check_tool_calling, prompt_tools

    tokenizer = load_tokenizer(resolve_model(cfg.model.name_or_path), cfg.model.chat_template)
    if cfg.tools or cfg.environment:
        tools = prompt_tools(cfg.tools, cfg.environment, cfg.generation.tool_timeout_s)
        check_tool_calling(tokenizer, tools, cfg.model.chat_template)


def check_lora_targets(cfg: PipelineConfig) -> None:
    """``train.peft.target_modules`` against the policy's architecture (a local or embedded model; a hub id is
    checked by PEFT when training starts). Raises ConfigError."""
    from grpo_steps.lora import check_target_modules
    from grpo_steps.models import resolve_model

    if cfg.train.peft.target_modules == "all-linear":  # fits every architecture: nothing to resolve yet
        return
    model_path = resolve_model(cfg.model.name_or_path)
    if Path(model_path).is_dir():
        check_target_modules(cfg.train.peft, model_path)


def prepare_data(cfg: PipelineConfig, run_id: str) -> tuple[str, Any]:
    """Resolve the policy weights and prepare the splits; log the dataset and its stats to MLflow (rows dropped per
    reason as metrics ``data/dropped/<reason>``, where the first ones are as tags of the same names).

    Returns ``(model_path, PreparedData)``.
    """
    from grpo_steps.data import mlflow_datasets, prepare
    from grpo_steps.models import load_tokenizer, resolve_model
    from grpo_steps.tools import prompt_tools

    model_path = resolve_model(cfg.model.name_or_path)
    tokenizer = load_tokenizer(model_path, cfg.model.chat_template)
    tools = prompt_tools(cfg.tools, cfg.environment, cfg.generation.tool_timeout_s)
    data = prepare(cfg.data, tokenizer, cfg.generation.chat_template_kwargs, tools)
    if cfg.generation.backend == "replay":  # every train prompt needs its completions: fail before training
        from grpo_steps.data import ReplayFile

        replay = ReplayFile(cfg.generation.replay_file)
        for row in data.train:
            replay.completions_for(row["prompt"], cfg.train.num_generations)
    tracking.log_datasets(cfg, run_id, mlflow_datasets(cfg.data, data))
    tracking.log_metrics(cfg, run_id, {f"data/{k}": v for k, v in data.stats.items()})
    tracking.set_tags(cfg, run_id, {f"data/{k}": where for k, where in data.dropped.items()})  # the first lines
    return model_path, data


def provision(cfg: PipelineConfig, model_path: str) -> dict:
    """Start (or reach) the generation server of ``generation.provider`` for this run; returns its
    handle as a dict (see :mod:`grpo_steps.servers`). The server also serves evaluation, so every
    backend needs one. Raises ``ServerStartError``."""
    from grpo_steps import servers

    server = servers.provision(cfg, model_path, owner=run_owner(), run_id=metaflow_run_id())
    print(redact(f"[vllm] serving {server.summary()}"), flush=True)
    return server.to_dict()


def ensure_server(cfg: PipelineConfig, server: dict, model_path: str) -> dict:
    """``server`` if this run can go on using it (:meth:`~grpo_steps.servers.GenerationServer.serves`),
    else a newly provisioned one, once per run.

    After a ``resume`` a ``local`` server belongs to the earlier (dead) runtime and stops itself within
    ``orphan_grace_s``: it is stopped now and replaced. The nodes of a local ``@parallel`` gang all take
    the replacement the first of them started (a second server would get no weight pushes, and the join
    could not merge two ``server`` values). A ``kubernetes`` server is kept while its Deployment is ready.

    Raises:
        GenerationServerError: an ``external`` server is not answering (the pipeline cannot start it).
    """
    from grpo_steps import servers
    from grpo_steps.servers.client import GenerationServerError

    current, owner = servers.from_dict(server), run_owner()
    if current.serves(owner):
        return server
    if not current.replaceable:
        raise GenerationServerError(f"{current} is not answering: start it again, then `resume` the run")
    with _shared_replacement(f"{metaflow_run_id()}-{owner.pid}") as record:
        if record.exists():
            replacement = servers.from_dict(json.loads(record.read_text()))
            if replacement.serves(owner):
                return replacement.to_dict()
        current.stop()
        print(f"{current} belongs to an earlier run or is not answering: starting a new one", flush=True)
        replacement = provision(cfg, model_path)
        record.write_text(json.dumps(replacement))
        return replacement


@contextmanager
def _shared_replacement(key: str):
    """Exclusive lock for the server that replaces a stale one in a run (``key``: run id and the
    runtime's PID); yields the file that records the replacement. The nodes of a local gang run on this
    machine under one runtime, so they all compute the same key."""
    import fcntl

    folder = Path(tempfile.gettempdir()) / "grpo-vllm-servers"
    folder.mkdir(exist_ok=True)
    with open(folder / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield folder / f"{key}.json"


def train(cfg: PipelineConfig, *, run_id: str, model_path: str, train_rows: list[dict], server: dict,
          node_index: int, main_ip: str, output_dir: str, eval_rows: list[dict] | None = None) -> str:
    """Run this node's share of GRPO training in ``output_dir``; returns the final policy directory
    (node 0's is the one kept). Continues from :func:`grpo_steps.checkpoints.resume_checkpoint`
    when there is one (``@retry``, ``resume``). Call inside the flow's ``train`` step. With
    ``eval.every_steps``, node 0 evaluates the first ``eval.during_training_prompts`` of ``eval_rows``
    during training (:mod:`grpo_steps.training.eval_during`).
    """

    from grpo_steps.checkpoints import resume_checkpoint
    from grpo_steps.launch import launch
    from grpo_steps.monitor import system_metrics
    from grpo_steps.training.job import TrainJob

    tracking.wait_reachable(cfg, "train")  # a tracking outage: wait a bounded time, then fail saying `resume`
    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    output_dir = Path(output_dir)
    train_file = output_dir / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in train_rows))
    eval_file = split_file = None
    if cfg.eval.every_steps and node_index == 0:
        eval_file, split_file = output_dir / "eval_during.jsonl", output_dir / "eval_split.jsonl"
        eval_file.write_text("".join(json.dumps(row) + "\n" for row in (eval_rows or [])[
            : cfg.eval.during_training_prompts]))
        split_file.write_text("".join(json.dumps(row) + "\n" for row in eval_rows or []))
    from grpo_steps import servers

    generation_server = servers.from_dict(server)
    client = generation_server.client()
    job = TrainJob(config=cfg, model_path=model_path, train_file=str(train_file), output_dir=str(output_dir),
                   endpoint=server["endpoint"] if cfg.generation.backend == "vllm" else None,
                   served_model=server["served_model"], replicas=list(client.replicas),
                   replica_logs=list(client.replica_logs),
                   router_metrics=getattr(generation_server, "metrics_endpoint", None),
                   resume_from=resume_checkpoint(node_index, cfg.train.resume_from), mlflow_run_id=run_id,
                   node_index=node_index, eval_file=str(eval_file) if eval_file else None,
                   eval_split_file=str(split_file) if split_file else None)
    warm_up = _warm_up_server(server) if node_index == 0 else None
    with system_metrics(run_id, cfg.tracking.tracking_uri, node_id=f"node{node_index}" if node_index else None):
        launch(job, node_index=node_index, main_ip=main_ip)
    if warm_up is not None:
        warm_up.join()
    return str(output_dir / "final")


def training_evaluations(output_dir: str) -> dict[str, dict]:
    """The evaluations of the whole eval split that training made in ``output_dir`` (node 0's, with
    ``eval.every_steps``): ``{"baseline": the base weights' at step 0, "trained": the final policy's at the last
    step}``, each only where this attempt made it (not without evaluation during training, not the baseline after a
    resumed attempt that began past step 0, not the trained policy when the last step is no multiple of
    ``eval.every_steps``): the ``evaluate`` step measures the others itself."""
    from grpo_steps.training.job import SPLIT_RESULTS

    paths = {label: Path(output_dir) / name for label, name in SPLIT_RESULTS.items()}
    return {label: json.loads(path.read_text()) for label, path in paths.items() if path.exists()}


WARM_UP_IDS = list(range(100, 116))
"""Token ids of the warm-up requests (any ids of the vocabulary: what is computed is not used)."""


def _warm_up_server(server: dict):
    """Ask the generation server, in a background thread while the training process starts (imports and model load,
    ~30 s on 2 cores), what the first weight push asks first, and return the thread: its config (vLLM builds the
    answer's system part once, ``collect_env``: 5.5 s in make run on 2 cores, then cached by the server;
    :meth:`grpo_steps.servers.client.VLLMClient.has_worker_extension`), one prompt-logprobs request (the push's
    probe) and one short completion, the server's first requests of each kind being its slowest. A failure is printed,
    not raised: the training process asks again and fails there with the server's error."""
    import threading

    from grpo_steps import servers
    from grpo_steps.servers.client import GenerationServerError

    def ask() -> None:
        client = servers.from_dict(server).client()
        try:
            client.server_config()
            client.prompt_logprobs(WARM_UP_IDS)
            client.complete([WARM_UP_IDS], 2, max_tokens=8, temperature=1.0)
        except GenerationServerError as err:
            print(f"[vllm] warm-up request failed: {err}", flush=True)

    thread = threading.Thread(target=ask, name="server-warm-up", daemon=True)
    thread.start()
    return thread


def evaluate(cfg: PipelineConfig, *, run_id: str, server: dict, base_model: str, trained_model: str,
             eval_rows: list[dict], measured: dict[str, dict] | None = None) -> dict:
    """Baseline and trained policy on the eval split through the same server; metrics, samples, system
    metrics (while it runs) and the charts (``charts/*.png``) to MLflow.

    ``measured``: the evaluations of the eval split made during training (:func:`training_evaluations`), each used
    when it still matches (see :func:`grpo_steps.evaluate.evaluate_baseline_and_trained`).

    Returns ``{"baseline": {"metrics", "samples", "per_prompt", ...}, "trained": {...}, "gain": {...}}``
    (``gain``: trained minus baseline with paired 95 % intervals, :func:`grpo_steps.evaluate.gain_metrics`; MLflow
    ``eval/gain/...``).
    """
    from grpo_steps.evaluate import evaluate_baseline_and_trained
    from grpo_steps.monitor import system_metrics
    from grpo_steps.report import log_charts

    tracking.wait_reachable(cfg, "evaluate")  # a tracking outage: wait a bounded time, then fail saying `resume`
    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    with system_metrics(run_id, cfg.tracking.tracking_uri):
        report = evaluate_baseline_and_trained(cfg, run_id=run_id, server=server, base_model=base_model,
                                               trained_model=trained_model, eval_rows=eval_rows, measured=measured)
    log_charts(cfg, run_id, report)
    return report


@contextmanager
def loaded_policy(reference: dict):
    """The final policy ``train`` saved (``reference``: what its ``current.model.save`` returned), copied from the
    Metaflow datastore into a directory of this process that is removed on exit; yields its path. metaflow-checkpoint's
    ``load_model``: the datastore ``@model(load=...)`` reads (both resolve it through the same artifact-store context),
    without ``@model``'s card, which Metaflow renders at the end of each task in two synchronous ``card create``
    processes (~6 s of CPU and as much of the step's time on the 2-core box, for a card listing one loaded model).

    Raises:
        metaflow-checkpoint's errors for a reference the datastore does not hold.
    """
    from metaflow import load_model

    with scratch_dir(tempfile.gettempdir()) as directory:  # on disk, as @model's temporary directories: not /dev/shm
        load_model(reference, directory)
        yield directory


def register(cfg: PipelineConfig, *, run_id: str, model_dir: str, report: dict, pathspec: str,
             dataset_digest: str) -> dict:
    """Register the trained policy (see :func:`grpo_steps.register.register`)."""
    from grpo_steps.register import register as register_version

    tracking.wait_reachable(cfg, "register")  # a tracking outage: wait a bounded time, then fail saying `resume`
    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    tags = {"metaflow.pathspec": pathspec, "config.sha256": cfg.sha256(), "dataset.digest": dataset_digest,
            "git.commit": tracking.git_commit()}
    return register_version(cfg, run_id, model_dir, report, tags)


def finish(cfg: PipelineConfig, run_id: str, server: dict | None) -> None:
    """Stop the server this run started (an ``external`` one keeps running) and close the MLflow run."""
    from grpo_steps import servers

    if server:
        servers.from_dict(server).stop()
    tracking.wait_reachable(cfg, "end")  # the run must not stay RUNNING: wait for the server, or fail for `resume`
    tracking.close_run(cfg, run_id)


def teardown_failed_run(run: Any) -> None:
    """``@exit_hook(on_error=...)`` on Argo: stop the server of a failed run, if it had one."""
    from grpo_steps import servers

    if run is None or "provision_vllm" not in run:
        return
    server = servers.from_dict(run["provision_vllm"].task.data.server)
    print(f"stopped {server}: {server.stop()}")


def metaflow_run_id() -> str:
    """The current Metaflow run id (labels the run's Kubernetes objects); ``local`` outside a flow."""
    from metaflow import current

    return str(current.run_id) if current.is_running_flow else "local"


def run_owner():
    """The process that owns the run's servers: the Metaflow runtime, the parent of this task.

    On the local runtime the other nodes of a ``@parallel`` gang are children of node 0's task
    (``MF_PARALLEL_NODE_INDEX`` > 0): their owner is the grandparent, so they keep node 0's server.
    Returns a :class:`grpo_steps.processes.ProcessRef`.
    """
    import psutil

    from grpo_steps.processes import ProcessRef

    parent = psutil.Process().parent()
    if os.environ.get("MF_PARALLEL_NODE_INDEX", "0") != "0":
        parent = parent.parent()
    return ProcessRef(parent.pid, parent.create_time())
