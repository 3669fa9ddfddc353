"""Model registration in the MLflow registry, with the ``candidate``/``champion`` aliases.

Idempotent: a flow run registers at most one version (found again by its MLflow run id), so a
resumed or retried ``register`` step never creates a second one, and its gate decision (version tags
``gate.passed``, ``gate.reason``) is made once. ``champion`` moves by :mod:`grpo_steps.gate` (paired interval,
compare-and-set). A version is only created after
its model artifact is fully logged, so a failure leaves no half-registered model.
"""

from __future__ import annotations

from pathlib import Path

from grpo_steps import tracking
from grpo_steps.config import PipelineConfig
from grpo_steps.evaluation.report import version_description
from grpo_steps.gate import (
    COMPARED_TAG,
    GATE_METRIC,
    PASSED_TAG,
    REASON_TAG,
    champion_scores,
    gate,
    save_per_prompt,
    settle_champion,
)
from grpo_steps.lineage import chain, chain_text, versions_table
from grpo_steps.lora import is_adapter_dir
from grpo_steps.versions import DIGEST_TAG, model_sha256

CANDIDATE, CHAMPION = "candidate", "champion"
DESCRIPTION_LIMIT = 5000
"""Characters of a model version's description MLflow's SQL stores keep (``String(5000)``; PostgreSQL refuses more)."""
CUT_NOTE = "\n\n(cut at MLflow's 5000 characters: the whole evaluation is in the MLflow run)"


def _requirements(*extra: str) -> list[str]:
    # explicit: MLflow's inference of requirements wants torchvision, absent on CPU installs
    return [f"{pkg}=={ver}" for pkg, ver in tracking.package_versions().items()
            if pkg in ("torch", "transformers", *extra)]


def _log_model(model_dir, run_id: str, **kwargs):
    import mlflow

    return mlflow.transformers.log_model(
        transformers_model=model_dir, name="model", task="text-generation",
        run_id=run_id,  # not ``with mlflow.start_run()``: its exit would end the flow's run FINISHED
        pip_requirements=_requirements(*(("peft",) if "base_model_path" in kwargs else ())), **kwargs)


def _log_lora_model(cfg: PipelineConfig, client, run_id: str, adapter_dir: str) -> tuple[object, dict[str, str]]:
    """Log a LoRA policy (``registry.register``): ``merged``, base + adapter merged into a plain transformers model,
    with the adapter (``adapter_model.safetensors``, ``adapter_config.json``: its ``LoraConfig``) as run artifacts
    under ``lora_adapter/``; ``adapter``, the adapter alone through MLflow's PEFT support (the base model referenced
    by its local path, ``base_model_path``). Returns the model info and the version tags naming the base model."""
    import json
    import tempfile

    from grpo_steps.lora import merge_adapter

    base_path = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]
    tags = {"base_model": cfg.model.name_or_path, "base_model.path": base_path,
            "lora.register": cfg.registry.register_as}
    if cfg.registry.register_as == "adapter":
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        policy = PeftModel.from_pretrained(base, adapter_dir)
        components = {"model": policy, "tokenizer": AutoTokenizer.from_pretrained(adapter_dir)}
        return _log_model(components, run_id, base_model_path=base_path), tags
    client.log_artifacts(run_id, adapter_dir, artifact_path="lora_adapter")
    with tempfile.TemporaryDirectory(prefix="grpo-merged-") as merged:
        merged_dir = str(merge_adapter(base_path, adapter_dir, merged))
        return _log_model(merged_dir, run_id), {**tags, DIGEST_TAG: model_sha256(merged_dir)}


def register(cfg: PipelineConfig, run_id: str, model_dir: str, report: dict, tags: dict[str, str]) -> dict:
    """Log ``model_dir`` to the run (a LoRA adapter directory: see :func:`_log_lora_model`), register it as a
    version with alias ``candidate``, move
    ``champion`` when :func:`gate` passes, and describe the version
    (:func:`grpo_steps.evaluation.report.version_description`, headed by its lineage: the chain of versions it
    descends from with their pass@1, :func:`grpo_steps.lineage.chain`).

    Args:
        report: the evaluate step's ``{"baseline": {"metrics", "per_prompt"}, "trained": {"metrics", "per_prompt",
            "prompt_keys"}}``.
        tags: version tags (``metaflow.pathspec`` of the register task, config hash, dataset digest, git commit;
            ``weight_lineage.*`` with ``s3`` sync, also told in the description; ``lineage.*``: the parent version
            and the rows added). ``model.sha256`` (:func:`grpo_steps.versions.model_sha256`) is added here.

    Returns:
        ``{"name", "version", "aliases", "gate_passed", "gate_reason"}``.
    """
    import mlflow

    name = cfg.registry.model_name
    client = tracking.client(cfg)
    existing = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
    if existing:
        version = existing[0]
    else:
        # the logged model goes to the run's experiment (and its artifact location, e.g. S3); without an
        # active run MLflow would put it in the default experiment under ./mlruns
        mlflow.set_experiment(experiment_id=client.get_run(run_id).info.experiment_id)
        if is_adapter_dir(model_dir):
            info, lora_tags = _log_lora_model(cfg, client, run_id, model_dir)
        else:  # MLflow copies the directory as it is: the digest of what a models:/ start fetches (grpo_steps.versions)
            info, lora_tags = _log_model(model_dir, run_id), {DIGEST_TAG: model_sha256(model_dir)}
        trained = report["trained"]["metrics"]
        save_per_prompt(client, run_id, report["trained"].get("prompt_keys") or [],
                        report["trained"]["per_prompt"][GATE_METRIC])
        version_tags = {**tags, **lora_tags,
                        **{tracking.mlflow_name(f"eval.{k}"): f"{v:.6g}" for k, v in trained.items()}}
        version = mlflow.register_model(info.model_uri, name, tags=version_tags)
    version_id = str(version.version)
    client.set_registered_model_alias(name, CANDIDATE, version_id)
    passed, reason, champion = _decide(cfg, client, name, version_id, report)
    if passed:
        reason += (f"; champion moved to version {champion}" if champion == version_id else
                   f"; champion is version {champion} (a better version registered at the same time, or one "
                   "chosen by hand meanwhile)")
    else:
        reason += f"; champion {'stays version ' + champion if champion else 'not set'}"
    run = client.get_run(run_id).data  # what prepare_data kept and where start began: the version says the same
    splits = (int(run.metrics["data/train"]), int(run.metrics["data/eval"])) if "data/train" in run.metrics else None
    description = version_description(cfg, report, run_url=tracking.run_url(cfg, run_id),
                                      splits=splits, start_uri=run.tags.get("start.model_uri"),
                                      run_pathspec=tags["metaflow.pathspec"].rsplit("/", 2)[0], gate_reason=reason,
                                      lineage={k.removeprefix("weight_lineage."): v for k, v in tags.items()
                                               if k.startswith("weight_lineage.")})
    description = chain_text(chain(client, name, version_id)) + "\n\n" + description  # v1 <- v2 <- ... this one
    if len(description) > DESCRIPTION_LIMIT:  # a long mixture's table: keep the head, say where the rest is
        description = description[: DESCRIPTION_LIMIT - len(CUT_NOTE)] + CUT_NOTE
    client.update_model_version(name, version_id, description=description)
    # the registered model's page: pass@1 per version, with the lineage (after the aliases moved)
    client.update_registered_model(name, description=versions_table(client.search_model_versions(f"name = '{name}'"),
                                                                    client.get_registered_model(name).aliases))
    aliases = sorted(client.get_model_version(name, version_id).aliases)
    return {"name": name, "version": version_id, "aliases": aliases, "gate_passed": passed, "gate_reason": reason}


def _decide(cfg: PipelineConfig, client, name: str, version_id: str, report: dict) -> tuple[bool, str, str | None]:
    """The gate decision of a version (made once, kept in its tags) and, when it passed, ``champion`` settled by
    compare-and-set (:func:`grpo_steps.gate.settle_champion`). Returns ``(passed, reason, champion version)``."""
    from mlflow.exceptions import MlflowException

    tags = client.get_model_version(name, version_id).tags
    if PASSED_TAG in tags:  # decided by an earlier attempt of this step
        passed, reason = tags[PASSED_TAG] == "true", tags.get(REASON_TAG, "")
        compared = tags.get(COMPARED_TAG) or None
    else:
        keys = report["trained"].get("prompt_keys") or []
        compared, scores, note = champion_scores(client, name, keys)
        if compared == version_id:
            compared, scores, note = None, None, ""
        passed, reason = gate(report["trained"]["per_prompt"][GATE_METRIC],
                              report["baseline"]["per_prompt"][GATE_METRIC], scores, cfg.registry.min_improvement,
                              note, cfg.registry.min_eval_prompts)
        for key, value in ((REASON_TAG, reason[:5000]), (COMPARED_TAG, compared or ""),
                           (PASSED_TAG, "true" if passed else "false")):  # passed last: it makes a contender
            client.set_model_version_tag(name, version_id, key, value)
    if passed:
        return passed, reason, settle_champion(client, name, version_id, compared)
    try:
        champion = str(client.get_model_version_by_alias(name, CHAMPION).version)
    except MlflowException:
        champion = None
    return passed, reason, champion
