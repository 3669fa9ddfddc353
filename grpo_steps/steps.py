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
from grpo_steps.redaction import redact


def config_of(config_value: Any) -> PipelineConfig:
    """The typed config from the flow's Metaflow ``Config`` value (already validated by the parser)."""
    return validate_config(dict(config_value.to_dict() if hasattr(config_value, "to_dict") else config_value))


def start(cfg: PipelineConfig, pathspec: str) -> str:
    """Check what can be checked before anything is written, then open the flow's MLflow run; returns its id.

    Raises:
        TrackingUnreachable: an ``http(s)`` tracking URI that does not answer (within seconds).
        ConfigError: ``train.peft.target_modules`` names no linear layer of the model.
        CheckpointNotFound: ``train.resume_from`` names no usable checkpoint.
        SandboxUnavailable: ``code_execution`` is configured where only the weak sandbox mode works, without
            its ``allow_weak_isolation`` option.
    """
    tracking.check_reachable(cfg.tracking.tracking_uri)
    check_sandbox(cfg)
    if cfg.train.peft is not None:
        check_lora_targets(cfg)
    if cfg.train.resume_from:
        from grpo_steps.checkpoints import check_reference

        print(f"[checkpoint] train.resume_from: {check_reference(cfg.train.resume_from, cfg.train.num_nodes)}",
              flush=True)
    return tracking.open_run(cfg, pathspec)


def check_sandbox(cfg: PipelineConfig) -> None:
    """The code reward's sandbox can contain programs here, or the config accepts the weak mode explicitly
    (:func:`rewards.sandbox.require_isolation`). Raises SandboxUnavailable."""
    for spec in cfg.rewards:
        if spec.name == "code_execution":
            from rewards.sandbox import require_isolation

            mode = require_isolation(bool(spec.options.get("allow_weak_isolation", False)))
            print(f"[sandbox] code_execution isolation: {mode}", flush=True)


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
    """Resolve the policy weights and prepare the splits; log the dataset and its stats to MLflow.

    Returns ``(model_path, PreparedData)``.
    """
    from mlflow.tracking.fluent import _create_dataset_input
    from transformers import AutoTokenizer

    from grpo_steps.data import mlflow_datasets, prepare
    from grpo_steps.models import resolve_model

    model_path = resolve_model(cfg.model.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = prepare(cfg.data, tokenizer)
    if cfg.generation.backend == "replay":  # every train prompt needs its completions: fail before training
        from grpo_steps.train import ReplayRollout

        replay = ReplayRollout(cfg.generation.replay_file, tokenizer, cfg.generation)
        for row in data.train:
            replay.completions_for(row["prompt"], cfg.train.num_generations)
    # through the client: the fluent ``with mlflow.start_run()`` would end the run FINISHED on exit
    tracking.client(cfg).log_inputs(run_id, datasets=[_create_dataset_input(dataset, context)
                                                      for dataset, context in mlflow_datasets(cfg.data, data)])
    tracking.log_metrics(cfg, run_id, {f"data/{k}": v for k, v in data.stats.items()})
    return model_path, data


def provision(cfg: PipelineConfig, model_path: str) -> dict:
    """Start (or reach) the generation server of ``generation.provider`` for this run; returns its
    handle as a dict (see :mod:`grpo_steps.servers`). The server also serves evaluation, so every
    backend needs one. Raises ``ServerStartError``."""
    from grpo_steps import servers

    server = servers.provision(cfg, model_path, owner=run_owner(), run_id=metaflow_run_id())
    print(redact(f"[vllm] serving {server.summary()}"), flush=True)
    return server.to_dict()


@contextmanager
def scratch_dir():
    """A RAM-backed (``/dev/shm`` when present) temporary directory, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="grpo-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        yield d


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
    from grpo_steps.weight_sync import GenerationServerError

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
    during training (:mod:`grpo_steps.eval_during`).
    """

    from grpo_steps.checkpoints import resume_checkpoint
    from grpo_steps.launch import launch
    from grpo_steps.monitor import system_metrics
    from grpo_steps.train import TrainJob

    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    output_dir = Path(output_dir)
    train_file = output_dir / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in train_rows))
    eval_file = None
    if cfg.eval.every_steps and node_index == 0:
        eval_file = output_dir / "eval_during.jsonl"
        eval_file.write_text("".join(json.dumps(row) + "\n" for row in (eval_rows or [])[
            : cfg.eval.during_training_prompts]))
    job = TrainJob(config=cfg, model_path=model_path, train_file=str(train_file), output_dir=str(output_dir),
                   endpoint=server["endpoint"] if cfg.generation.backend == "vllm" else None,
                   served_model=server["served_model"],
                   resume_from=resume_checkpoint(node_index, cfg.train.resume_from), mlflow_run_id=run_id,
                   node_index=node_index, eval_file=str(eval_file) if eval_file else None)
    with system_metrics(run_id, cfg.tracking.tracking_uri, node_id=f"node{node_index}" if node_index else None):
        launch(job, node_index=node_index, main_ip=main_ip)
    return str(output_dir / "final")


def evaluate(cfg: PipelineConfig, *, run_id: str, server: dict, base_model: str, trained_model: str,
             eval_rows: list[dict]) -> dict:
    """Baseline and trained policy on the eval split through the same server; metrics, samples, system
    metrics (while it runs) and the charts (``charts/*.png``) to MLflow.

    Returns ``{"baseline": {"metrics", "samples", "per_prompt", ...}, "trained": {...}, "gain": {...}}``
    (``gain``: trained minus baseline with paired 95 % intervals, :func:`gain_metrics`; MLflow ``eval/gain/...``).
    """
    from grpo_steps.monitor import system_metrics

    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    with system_metrics(run_id, cfg.tracking.tracking_uri):
        report = _evaluate(cfg, run_id=run_id, server=server, base_model=base_model, trained_model=trained_model,
                           eval_rows=eval_rows)
    log_charts(cfg, run_id, report)
    return report


def log_charts(cfg: PipelineConfig, run_id: str, report: dict) -> None:
    """The training reward curves and the baseline-vs-trained bars as images of the run (``charts/``)."""
    import matplotlib.pyplot as plt

    from grpo_steps.report import eval_figure, reward_figure

    mlflow_client = tracking.client(cfg)
    curves = {"reward": reward_curve(cfg, run_id)}
    curves.update({f"rewards/{r.name}/mean": reward_curve(cfg, run_id, f"rewards/{r.name}/mean") for r in cfg.rewards})
    figures = [(reward_figure(curves), "charts/reward_curve.png"),
               (eval_figure(cfg, report), "charts/eval_baseline_vs_trained.png")]
    during = eval_during_curves(cfg, run_id)
    if any(during.values()):
        figures.append((reward_figure(during, ylabel="share of held-out prompts",
                                      title=f"Held-out evaluation during training ({cfg.eval.during_training_prompts} "
                                            "prompts)"), "charts/eval_during_training.png"))
    for figure, path in figures:
        mlflow_client.log_figure(run_id, figure, path)
        plt.close(figure)


def gain_metrics(baseline: dict[str, list[float]], trained: dict[str, list[float]]) -> dict[str, float]:
    """Trained minus baseline on the same prompts, per metric of ``per_prompt`` (see
    :func:`grpo_steps.evaluate.evaluate_policy`): ``<metric>`` (mean gain) and ``<metric>_ci95`` (half-width of
    its paired 95 % interval, :func:`grpo_steps.evaluate.paired_gain`)."""
    from grpo_steps.evaluate import paired_gain

    out = {}
    for name in baseline:
        out[name], out[f"{name}_ci95"] = paired_gain(baseline[name], trained[name])
    return out


def _evaluate(cfg: PipelineConfig, *, run_id: str, server: dict, base_model: str, trained_model: str,
              eval_rows: list[dict]) -> dict:
    from transformers import AutoTokenizer

    from grpo_steps import servers
    from grpo_steps.evaluate import evaluate_policy

    generation_server = servers.from_dict(server)
    client = generation_server.client()
    tokenizer = AutoTokenizer.from_pretrained(base_model)
    report = {}
    for label, weights in (("baseline", base_model), ("trained", trained_model)):
        with _served_policy(cfg, generation_server, client, weights, label):
            report[label] = evaluate_policy(cfg, client, tokenizer, eval_rows, label=label)
        tracking.log_metrics(cfg, run_id, {f"eval/{label}/{k}": v for k, v in report[label]["metrics"].items()})
    report["gain"] = gain_metrics(report["baseline"]["per_prompt"], report["trained"]["per_prompt"])
    tracking.log_metrics(cfg, run_id, {f"eval/gain/{k}": v for k, v in report["gain"].items()})
    mlflow_client = tracking.client(cfg)
    for label in ("baseline", "trained"):
        samples = report[label]["samples"]
        if samples:
            table = {key: [s[key] for s in samples] for key in samples[0]}
            mlflow_client.log_table(run_id, data=table, artifact_file=f"eval/{label}_samples.json")
    return report


@contextmanager
def _served_policy(cfg: PipelineConfig, generation_server, client, weights: str, label: str):
    """Make ``client`` sample from ``weights`` while the block runs: full weights are reloaded into the server;
    a LoRA adapter (``train.peft``) is loaded beside the base weights as ``{served}-lora-final`` and requested by
    that name, then unloaded. A server without runtime LoRA (``runtime_lora``: ``kubernetes``), or a run that pushes
    merged weights (``train.peft.push: merged``), gets base + adapter merged."""
    from grpo_steps.lora import adapter_name, is_adapter_dir, merge_adapter

    client.model = client.base_model
    if not is_adapter_dir(weights):
        client.reload_weights(generation_server.stage_weights(weights, label))
        yield
        return
    base = json.loads((Path(weights) / "adapter_config.json").read_text())["base_model_name_or_path"]
    if not generation_server.runtime_lora or not cfg.serves_adapter:
        with scratch_dir() as merged:
            client.reload_weights(generation_server.stage_weights(merge_adapter(base, weights, merged), label))
        yield
        return
    client.reload_weights(generation_server.stage_weights(base, "baseline"))  # the adapter's base under it
    name = adapter_name(client.base_model, "final")
    if name in client.served_adapters():  # left by an earlier attempt of this step
        client.unload_lora_adapter(name)
    client.load_lora_adapter(name, generation_server.stage_weights(weights, label))
    client.model = name
    try:
        yield
    finally:
        client.model = client.base_model
        client.unload_lora_adapter(name)


def reward_curve(cfg: PipelineConfig, run_id: str, metric: str = "reward") -> list[dict]:
    """``[{"step", "value"}]`` of a training metric from the MLflow run (empty when not logged)."""
    history = tracking.client(cfg).get_metric_history(run_id, metric)
    return [{"step": m.step, "value": m.value} for m in sorted(history, key=lambda m: m.step)]


EVAL_DURING_CURVES = ("accuracy", "pass@1", "format_rate", "accuracy_formatted")
"""The ``eval_during/<metric>`` curves charted (card and ``charts/eval_during_training.png``)."""


def eval_during_curves(cfg: PipelineConfig, run_id: str) -> dict[str, list[dict]]:
    """``{"eval_during/<metric>": [{"step", "value"}]}`` of :data:`EVAL_DURING_CURVES` from the MLflow run
    (empty lists when ``eval.every_steps`` is off)."""
    from grpo_steps.tracking import mlflow_name

    return {f"eval_during/{name}": reward_curve(cfg, run_id, mlflow_name(f"eval_during/{name}"))
            for name in EVAL_DURING_CURVES}


def _line_chart(points: list[dict], y_title: str, color: str | None = None) -> dict:
    """Vega-Lite spec of ``[{"step", "value", ("series")}]`` over the optimizer step."""
    encoding = {"x": {"field": "step", "type": "quantitative", "title": "optimizer step"},
                "y": {"field": "value", "type": "quantitative", "title": y_title}}
    if color:
        encoding["color"] = {"field": color, "type": "nominal"}
    return {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "data": {"values": points},
            "mark": {"type": "line", "point": True}, "width": 500, "height": 250, "encoding": encoding}


def card_components(cfg: PipelineConfig, run_id: str, report: dict) -> list:
    """Metaflow card: the training reward curve (from MLflow), beside it the held-out curves during training
    (``eval.every_steps``), and a baseline-vs-trained table."""
    from metaflow.cards import Markdown, Table, VegaChart

    curve = reward_curve(cfg, run_id)
    names = list(report["trained"]["metrics"])
    rows = [[name, f"{report['baseline']['metrics'][name]:.4f}", f"{report['trained']['metrics'][name]:.4f}"]
            for name in names]
    components = [Markdown("## Held-out evaluation"), Table(rows, headers=["metric", "baseline", "trained"])]
    during = [{**point, "metric": name.removeprefix("eval_during/")}
              for name, points in eval_during_curves(cfg, run_id).items() for point in points
              if point["value"] == point["value"]]  # NaN (no formatted answer) is not JSON
    if during:
        components = [Markdown(f"## Held-out evaluation during training ({cfg.eval.during_training_prompts} prompts, "
                               f"every {cfg.eval.every_steps} steps)"),
                      VegaChart(_line_chart(during, "share of prompts", color="metric"))] + components
    if curve:
        components = [Markdown("## Training reward"), VegaChart(_line_chart(curve, "mean reward"))] + components
    return components


def register(cfg: PipelineConfig, *, run_id: str, model_dir: str, report: dict, pathspec: str,
             dataset_digest: str) -> dict:
    """Register the trained policy (see :func:`grpo_steps.register.register`)."""
    from grpo_steps.register import register as register_version

    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    tags = {"metaflow.pathspec": pathspec, "config.sha256": cfg.sha256(), "dataset.digest": dataset_digest,
            "git.commit": tracking.git_commit()}
    return register_version(cfg, run_id, model_dir, report, tags)


def finish(cfg: PipelineConfig, run_id: str, server: dict | None) -> None:
    """Stop the server this run started (an ``external`` one keeps running) and close the MLflow run."""
    from grpo_steps import servers

    if server:
        servers.from_dict(server).stop()
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
