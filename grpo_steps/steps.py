"""One function per flow step: the step bodies in ``flows/grpo_flow.py`` only move artifacts, and these only chain the
stages (:mod:`grpo_steps.preflight`, :mod:`grpo_steps.data`, :mod:`grpo_steps.servers.lifecycle`,
:mod:`grpo_steps.launch`, :mod:`grpo_steps.evaluation`, :mod:`grpo_steps.register`).

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
from grpo_steps.evaluation.report import card_components  # noqa: F401  (the evaluate step's card)
from grpo_steps.lineage import (
    PARENT_MODEL_TAG,
    PARENT_TAG,
    ROWS_ADDED_TAG,
    ROWS_ARTIFACT_TAG,
    SEEN_ARTIFACT,
    SeenRows,
    load_seen,
    save_seen,
)
from grpo_steps.models import resolve_model, resolve_teacher
from grpo_steps.preflight import refusals
from grpo_steps.processes import scratch_dir  # noqa: F401  (the train step's working directory)
from grpo_steps.redaction import redact_report
from grpo_steps.servers import lifecycle
from grpo_steps.servers import teacher as teacher_server
from grpo_steps.servers.lifecycle import teardown_failed_run  # noqa: F401  (the failed run's exit hook)
from grpo_steps.versions import is_model_uri, parse_model_uri, start_tags

POLICY_CHECKPOINT = "policy"
"""Name of the checkpoint that holds the final policy in the ``train`` task (node 0's), beside the training
checkpoints of each node (:func:`grpo_steps.checkpoints.checkpoint_name`)."""


def config_of(config_value: Any) -> PipelineConfig:
    """The typed config from the flow's Metaflow ``Config`` value (already validated by the parser)."""
    return validate_config(dict(config_value.to_dict() if hasattr(config_value, "to_dict") else config_value))


def start(cfg: PipelineConfig, pathspec: str) -> tuple[str, str]:
    """Check what can be checked before anything is written (:func:`grpo_steps.preflight.check`; a refusal is printed
    as its message alone), then open the flow's MLflow run. Returns ``(MLflow run id, resolved model path)``."""
    from grpo_steps import preflight

    with refusals("Run refused by start's checks"):
        model_path = preflight.check(cfg)
    run_id = tracking.open_run(cfg, pathspec)
    tracking.restrict_local_stores(cfg)  # after open_run, which creates mlflow.db: this user's alone, as .metaflow
    if is_model_uri(cfg.model.name_or_path):  # the version it resolved to, pinned for every later step
        tags = start_tags(cfg.model.name_or_path, model_path)
        tracking.set_tags(cfg, run_id, {**tags, PARENT_TAG: tags["start.model_version"],
                                        PARENT_MODEL_TAG: parse_model_uri(tags["start.model_uri"])[0]})
        print(f"[start] {cfg.model.name_or_path} is {tags['start.model_uri']} (sha256 "
              f"{tags['start.model_sha256'][:16]}...)", flush=True)
    if cfg.teacher is not None:
        tracking.set_tags(cfg, run_id, teacher_tags(cfg, resolve_teacher(cfg, model_path)))
    return run_id, model_path


def teacher_tags(cfg: PipelineConfig, teacher_path: str) -> dict[str, str]:
    """The MLflow run tags naming the run's teacher (``teacher.*``): its mode, lambda, what the config names, and for
    a registered version the version it resolved to (:func:`grpo_steps.versions.start_tags`)."""
    tags = {"teacher.mode": cfg.teacher.mode, "teacher.kl_coef": f"{cfg.teacher.kl_coef:g}",
            "teacher.model": cfg.teacher.model or f"{cfg.model.name_or_path} (the policy's starting weights)"}
    if cfg.teacher.model and is_model_uri(cfg.teacher.model):
        pinned = start_tags(cfg.teacher.model, teacher_path)
        tags.update({"teacher.model_uri": pinned["start.model_uri"], "teacher.model_version": pinned[
            "start.model_version"], "teacher.model_sha256": pinned["start.model_sha256"]})
    return tags


def teacher_line(tags: dict[str, str]) -> str:
    """The run description's line naming the teacher from its :func:`teacher_tags` ('' without one).

    >>> teacher_line({"teacher.mode": "mixed", "teacher.kl_coef": "1", "teacher.model": "models:/p@champion",
    ...               "teacher.model_uri": "models:/p/3", "teacher.model_version": "3"}).split(": ", 1)[1]
    '`models:/p@champion`, registered version 3 (`models:/p/3`).'
    """
    if not tags:
        return ""
    version = (f", registered version {tags['teacher.model_version']} (`{tags['teacher.model_uri']}`)"
               if "teacher.model_version" in tags else "")
    return (f"\n\n**Teacher** (on-policy distillation, mode {tags['teacher.mode']}, lambda {tags['teacher.kl_coef']}): "
            f"`{tags['teacher.model']}`{version}.")


def provision(cfg: PipelineConfig, run_id: str, model_path: str) -> dict:
    """The run's generation server (:func:`grpo_steps.servers.lifecycle.provision`) and, with ``teacher:``, the
    teacher's server in its handle (:func:`grpo_steps.servers.lifecycle.ensure_teacher`, weights of
    :func:`pinned_teacher`)."""
    handle = lifecycle.provision(cfg, model_path)
    return lifecycle.ensure_teacher(cfg, handle, None, lambda: pinned_teacher(cfg, run_id, model_path))


def ensure_server(cfg: PipelineConfig, run_id: str, server: dict, model_path: str, *, teacher: bool = True) -> dict:
    """``server`` while this run can go on using it, else a replacement
    (:func:`grpo_steps.servers.lifecycle.ensure_server`); the teacher's server likewise, unless ``teacher`` is False
    (a step that scores nothing with it: its entry is kept as it is, for the ``end`` step to stop)."""
    handle = lifecycle.ensure_server(cfg, server, model_path)
    if not teacher:  # a run resumed at evaluate would otherwise start a teacher only for end to stop it
        return teacher_server.attach(handle, teacher_server.of(server))
    return lifecycle.ensure_teacher(cfg, handle, server, lambda: pinned_teacher(cfg, run_id, model_path))


def pinned_teacher(cfg: PipelineConfig, run_id: str, model_path: str) -> str:
    """The teacher's weights for a server (re)started in any step: for a ``models:/`` teacher the version ``start``
    resolved (run tag ``teacher.model_uri``, ``models:/<name>/<version>``), so a resume or a replaced server after
    the alias moved still scores with the run's teacher; else :func:`grpo_steps.models.resolve_teacher`.

    Raises:
        FileNotFoundError, ValueError: as :func:`grpo_steps.models.resolve_model`.
    """
    pinned = tracking.run_tags(cfg, run_id, "teacher.model_uri").get("teacher.model_uri")
    return resolve_model(pinned, cfg.tracking.tracking_uri) if pinned else resolve_teacher(cfg, model_path)


def local_model(cfg: PipelineConfig, run_id: str, model_path: str) -> str:
    """``model_path`` (what ``start`` resolved) when this machine has it, else resolved again here: a step in another
    pod (Kubernetes) lacks the directory an earlier pod built (an embedded model in that pod's cache, a fetched
    version; found by ``make rehearse``, each pod its own ~/.cache), so it resolves the version ``start`` pinned for a
    ``models:/`` start (run tag ``start.model_uri``), else ``model.name_or_path`` (the embedded model, a hub id).

    Raises:
        FileNotFoundError: as :func:`grpo_steps.models.resolve_model`.
    """
    if Path(model_path).exists():
        return model_path
    pinned = tracking.run_tags(cfg, run_id, "start.model_uri").get("start.model_uri")
    return resolve_model(pinned or cfg.model.name_or_path, cfg.tracking.tracking_uri)


def chain_seen(cfg: PipelineConfig, run_id: str) -> SeenRows | None:
    """The rows the start version's chain has seen (:mod:`grpo_steps.lineage`): nothing for a start that is no
    registered version; None for a version whose run kept no record (registered before lineage was kept)."""
    run = tracking.run_tags(cfg, run_id, "start.model_run_id").get("start.model_run_id")
    return load_seen(tracking.client(cfg), run) if run else SeenRows()


def prepare_data(cfg: PipelineConfig, run_id: str, model_path: str) -> tuple[str, Any, str]:
    """Prepare the splits with the tokenizer of ``model_path`` (what ``start`` resolved); log the dataset and its stats
    to MLflow (rows dropped per reason as metrics ``data/dropped/<reason>``, where the first ones are as tags of the
    same names). Before any server starts, each reward is called on a few prepared rows and checked against TRL's
    contract and ``eval.correct_at`` (:func:`grpo_steps.reward_probe.probe_rewards`). A refusal (bad rows, a missing
    file, a reward that breaks its contract) is printed as its message alone (:func:`grpo_steps.preflight.refusals`).

    The rows the start version's chain has seen, with this run's splits added, are kept as the run's
    :data:`grpo_steps.lineage.SEEN_ARTIFACT`; with ``data.skip_seen`` only rows new to the chain are trained on, and
    fewer of them than one optimizer step takes route the run to ``end`` (route ``no_new_rows``, one line printed).

    Returns ``(model_path, PreparedData, route)``: the weights as this step's machine reads them; ``train`` or
    ``no_new_rows``.
    """
    from grpo_steps.data import check_environments, mlflow_datasets, prepare
    from grpo_steps.models import load_tokenizer
    from grpo_steps.reward_probe import probe_rewards
    from grpo_steps.sources import DataError
    from grpo_steps.tools.environments import prompt_tools

    model_path = local_model(cfg, run_id, model_path)  # a step in another pod (Kubernetes) resolves it there again
    tokenizer = load_tokenizer(model_path, cfg.model.chat_template)
    tools = prompt_tools(cfg.tools, cfg.environment, cfg.generation.tool_timeout_s)
    chain = chain_seen(cfg, run_id)
    with refusals("Run refused by prepare_data (the data)"):
        if cfg.data.skip_seen and chain is None:
            raise DataError(f"data.skip_seen: the start {cfg.model.name_or_path} kept no record of the rows it "
                            f"trained on ({SEEN_ARTIFACT}: registered before lineage was kept); set data.skip_seen: "
                            "false for this run, whose version will keep one")
        data = prepare(cfg.data, tokenizer, cfg.generation.chat_template_kwargs, tools,
                       chain=chain if cfg.data.skip_seen else None)
        check_environments(data.train + data.eval, cfg.environment)  # a row naming no factory: refused, not a crash
        if cfg.generation.backend == "recorded":  # every train prompt needs its completions: fail before training
            from grpo_steps.data import RecordedCompletions

            recorded = RecordedCompletions(cfg.generation.recorded_file)
            for row in data.train:
                recorded.completions_for(row["prompt"], cfg.train.num_generations)
    chain = chain or SeenRows()
    save_seen(tracking.client(cfg), run_id, chain.after(data.train, data.eval))
    tracking.set_tags(cfg, run_id, {ROWS_ADDED_TAG: str(chain.new_rows(data.train)), ROWS_ARTIFACT_TAG: SEEN_ARTIFACT})
    per_step = (cfg.train.per_device_train_batch_size * cfg.train.gradient_accumulation_steps
                * cfg.train.world_size // cfg.train.num_generations)
    if cfg.data.skip_seen and len(data.train) < per_step:
        print(f"[data] {len(data.train)} rows new to the chain of {cfg.model.name_or_path}, fewer than the {per_step} "
              "prompts one optimizer step takes: nothing to train; the run ends here (data.skip_seen)", flush=True)
        return model_path, data, "no_new_rows"
    # the reward contract on a few prepared rows, before any server starts (the rows exist from here on)
    with refusals("Run refused: a reward breaks TRL's reward contract (checked on prepared rows)"):
        for line in probe_rewards(cfg, data.train, tokenizer):
            print(line, flush=True)
    tracking.log_datasets(cfg, run_id, mlflow_datasets(cfg.data, data))
    tracking.log_metrics(cfg, run_id, {f"data/{k}": v for k, v in data.stats.items()})
    tracking.set_tags(cfg, run_id, {f"data/{k}": where for k, where in data.dropped.items()})  # the first lines
    return model_path, data, "train"


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
    from grpo_steps.training.job import WEIGHT_LINEAGE, TrainJob

    tracking.wait_reachable(cfg, "train")  # a tracking outage: wait a bounded time, then fail saying `resume`
    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    model_path = local_model(cfg, run_id, model_path)  # a node in another pod fetches the pinned start itself
    output_dir = Path(output_dir)
    train_file = output_dir / "train.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in train_rows))
    eval_file = split_file = None
    if cfg.eval.every_steps and node_index == 0:
        eval_file, split_file = output_dir / "eval_during.jsonl", output_dir / "eval_split.jsonl"
        eval_file.write_text("".join(json.dumps(row) + "\n" for row in (eval_rows or [])[
            : cfg.eval.during_training_prompts]))
        split_file.write_text("".join(json.dumps(row) + "\n" for row in eval_rows or []))
    job = TrainJob(config=cfg, model_path=model_path, train_file=str(train_file), output_dir=str(output_dir),
                   server=server,
                   resume_from=resume_checkpoint(node_index, cfg.train.resume_from), mlflow_run_id=run_id,
                   node_index=node_index, eval_file=str(eval_file) if eval_file else None,
                   eval_split_file=str(split_file) if split_file else None, weight_store=weight_store(cfg, run_id))
    warm_up = lifecycle.warm_up(server) if node_index == 0 else None
    with system_metrics(run_id, cfg.tracking.tracking_uri, node_id=f"node{node_index}" if node_index else None):
        # a JobSet's pod: the port its manifest declares for the control node (grpo_steps.deploy); else per run
        launch(job, node_index=node_index, main_ip=main_ip, main_port=int(os.environ.get("MF_MASTER_PORT") or 0))
    lineage = output_dir / WEIGHT_LINEAGE
    if node_index == 0 and lineage.is_file():  # s3 sync: what the servers last loaded, for the registered version
        tracking.set_tags(cfg, run_id, {f"weight_lineage.{k}": v for k, v in json.loads(lineage.read_text()).items()})
    if warm_up is not None:
        warm_up.join()
    return str(output_dir / "final")


def weight_store(cfg: PipelineConfig, run_id: str) -> dict | None:
    """The S3 location of the run's weight versions with ``generation.weight_sync: s3`` (keyed by the MLflow run id,
    which every step of the run knows), else None."""
    from grpo_steps.weights.chain import run_store

    return run_store(cfg.generation.s3_sync, run_id) if cfg.generation.pushes_through_s3 else None


def training_evaluations(output_dir: str) -> dict[str, dict]:
    """The evaluations of the whole eval split that training made in ``output_dir`` (node 0's, with
    ``eval.every_steps``): ``{"baseline": the base weights' at step 0, "trained": the final policy's at the last
    step}``, each only where this attempt made it (not without evaluation during training, not the baseline after a
    resumed attempt that began past step 0, not the trained policy when the last step is no multiple of
    ``eval.every_steps``): the ``evaluate`` step measures the others itself."""
    from grpo_steps.training.job import SPLIT_RESULTS

    paths = {label: Path(output_dir) / name for label, name in SPLIT_RESULTS.items()}
    return {label: json.loads(path.read_text()) for label, path in paths.items() if path.exists()}


def evaluate(cfg: PipelineConfig, *, run_id: str, server: dict, base_model: str, trained_model: str,
             eval_rows: list[dict], measured: dict[str, dict] | None = None) -> dict:
    """Baseline and trained policy on the eval split through the same server; metrics, samples, system
    metrics (while it runs) and the charts (``charts/*.png``) to MLflow.

    ``measured``: the evaluations of the eval split made during training (:func:`training_evaluations`), each used
    when it still matches (see :func:`grpo_steps.evaluation.comparison.evaluate_baseline_and_trained`).

    Returns ``{"baseline": {"metrics", "samples", "per_prompt", ...}, "trained": {...}, "gain": {...}}``
    (``gain``: trained minus baseline with paired 95 % intervals, :func:`grpo_steps.evaluation.stats.gain_metrics`;
    MLflow ``eval/gain/...``).
    """
    from grpo_steps.evaluation.comparison import evaluate_baseline_and_trained
    from grpo_steps.evaluation.report import log_charts
    from grpo_steps.monitor import system_metrics

    tracking.wait_reachable(cfg, "evaluate")  # a tracking outage: wait a bounded time, then fail saying `resume`
    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    base_model = local_model(cfg, run_id, base_model)  # the baseline is the start: a registered version's weights
    with system_metrics(run_id, cfg.tracking.tracking_uri):
        report = evaluate_baseline_and_trained(cfg, run_id=run_id, server=server, base_model=base_model,
                                               trained_model=trained_model, eval_rows=eval_rows, measured=measured,
                                               weight_store=weight_store(cfg, run_id))
    log_charts(cfg, run_id, report)
    return redact_report(report)  # the eval_report artifact, redacted as the MLflow tables are (numbers kept)


@contextmanager
def loaded_policy(reference: dict):
    """The final policy ``train`` saved (``reference``: what its ``current.checkpoint.save(name=POLICY_CHECKPOINT)``
    returned), copied from the Metaflow datastore into a directory of this process that is removed on exit; yields its
    path. metaflow-checkpoint's ``load_model``, which loads checkpoints as it loads ``@model``'s models, without
    ``@model``: its card costs each step card processes (two synchronous ones at the end of the task, ~6 s of CPU on
    the 2-core box, for a card listing one loaded model; five in ``train``).

    Raises:
        metaflow-checkpoint's errors for a reference the datastore does not hold.
    """
    from metaflow import load_model

    with scratch_dir(tempfile.gettempdir()) as directory:  # on disk, as @model's temporary directories: not /dev/shm
        load_model(reference, directory)
        yield directory


def register(cfg: PipelineConfig, *, run_id: str, model_dir: str, report: dict, pathspec: str,
             dataset_digest: str) -> dict:
    """Register the trained policy (see :func:`grpo_steps.register.register`), its version tagged with the SHA-256 of
    its weight files (``weights.sha256``) and, with ``weight_sync: s3``, the lineage of the last version the servers
    loaded (``weight_lineage.*``: version, anchor, deltas, digest of its tensors' checksums), and its lineage
    (``lineage.*``: the parent version it started from, the rows it added, :mod:`grpo_steps.lineage`)."""
    from grpo_steps.register import register as register_version

    tracking.wait_reachable(cfg, "register")  # a tracking outage: wait a bounded time, then fail saying `resume`
    tracking.reopen_run(cfg, run_id)  # RUNNING again on ``resume`` after a failure
    from grpo_steps.weights.files import weights_sha256

    tags = {"metaflow.pathspec": pathspec, "config.sha256": cfg.sha256(), "dataset.digest": dataset_digest,
            "git.commit": tracking.git_commit(), "weights.sha256": weights_sha256(model_dir),
            **tracking.run_tags(cfg, run_id, prefix="weight_lineage."), **tracking.run_tags(cfg, run_id, "lineage.")}
    return register_version(cfg, run_id, model_dir, report, tags)


def finish(cfg: PipelineConfig, run_id: str, server: dict | None, *, report: dict | None,
           model_version: dict | None, pathspec: str) -> None:
    """Stop the server this run started (an ``external`` one keeps running), delete the run's weight versions in S3
    (``weight_sync: s3``), write the run's description (what a
    reviewer reads first on its MLflow page, :func:`grpo_steps.evaluation.report.run_description`) and close the
    MLflow run. A run that ended after ``prepare_data`` (``report`` None: no rows new to its chain) says so."""
    from grpo_steps.evaluation.report import run_description
    from grpo_steps.weights.publisher import remove_run_versions

    if server is not None:
        lifecycle.stop(server)
    remove_run_versions(weight_store(cfg, run_id))  # what a failed and retried train attempt may have left
    tracking.wait_reachable(cfg, "end")  # the run must not stay RUNNING: wait for the server, or fail for `resume`
    start = tracking.run_tags(cfg, run_id, "start.")
    if report is None or model_version is None:
        description = (f"**Ended after prepare_data**: no rows new to the chain of `{cfg.model.name_or_path}` "
                       f"(data.skip_seen); nothing trained or registered. Metaflow run `{pathspec.rsplit('/', 2)[0]}`.")
    else:
        route = f"#/models/{model_version['name']}/versions/{model_version['version']}"
        description = run_description(cfg, report, model_version, run_pathspec=pathspec.rsplit("/", 2)[0],
                                      version_url=tracking.ui_url(cfg, route))
    if start:  # the baseline is the start version; the gate compared with it and with the champion
        description += (f"\n\n**Start**: `{start['start.model_uri']}` (`{cfg.model.name_or_path}` when the run began), "
                        "the baseline of this run's evaluation and of its gate; the gate's reason above says how the "
                        "trained policy compared with it and with the champion of the time.")
    description += teacher_line(tracking.run_tags(cfg, run_id, "teacher."))
    tracking.set_tags(cfg, run_id, {tracking.DESCRIPTION_TAG: description})
    tracking.close_run(cfg, run_id)
