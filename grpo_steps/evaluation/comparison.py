"""The ``evaluate`` step's comparison: the baseline (base weights) and the trained policy on the held-out split through
the same generation server, one after the other (weights reloaded, :func:`served_policy`), so that their numbers
compare directly; an evaluation made during training is taken when the weights reloaded give its probe again
(:func:`same_weights_as`)."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path

from grpo_steps.config import PipelineConfig
from grpo_steps.evaluation.policy import evaluate_policy
from grpo_steps.evaluation.stats import gain_metrics, prompt_key
from grpo_steps.weights.labels import adapter_name, eval_label
from grpo_steps.weights.staging import stage_update


def evaluate_baseline_and_trained(cfg: PipelineConfig, *, run_id: str, server: dict, base_model: str,
                                  trained_model: str, eval_rows: list[dict],
                                  measured: dict[str, dict] | None = None, weight_store: dict | None = None) -> dict:
    """Baseline (``base_model``) and trained policy (``trained_model``: full weights or a LoRA adapter) on
    ``eval_rows`` through the same generation server (``server``: a handle of :mod:`grpo_steps.servers`), one after
    the other (:func:`served_policy`); metrics (``eval/<label>/...``, ``eval/gain/...``) and sample tables
    (``eval/<label>_samples.json``) to the MLflow run ``run_id``. ``weight_store``: the run's S3 location with
    ``generation.weight_sync: s3`` (:func:`grpo_steps.steps.weight_store`), through which the server then gets both
    policies' weights; None: from files it reads.

    ``measured``: evaluations of ``eval_rows`` already made during training (:mod:`grpo_steps.training.eval_during`:
    ``"baseline"`` at step 0, ``"trained"`` at the last step; :func:`grpo_steps.steps.training_evaluations`), each
    taken when its weights, reloaded from disk, give its probe again (:func:`same_weights_as`); the others are
    measured here.

    Returns ``{"baseline": evaluate_policy(...), "trained": ..., "gain": gain_metrics(...)}``; each one's
    ``"measured"`` says where it was measured (``"training step N"`` or ``"evaluate"``), also the run's tags
    ``eval.baseline.measured`` and ``eval.trained.measured``.
    """
    from grpo_steps import servers, tracking
    from grpo_steps.models import load_tokenizer

    generation_server = servers.from_dict(server)
    client = _vocabulary_checked(generation_server.client(), base_model)
    tokenizer = load_tokenizer(base_model, cfg.model.chat_template)
    report = {}
    for label, weights in (("baseline", base_model), ("trained", trained_model)):
        with served_policy(cfg, generation_server, client, weights, label, weight_store):
            client.check_weight_version(eval_label(label))  # a replica restarted since the reload fails here
            report[label] = _measure(cfg, client, tokenizer, eval_rows, (measured or {}).get(label), label)
            client.check_weight_version(eval_label(label))  # ... or while it answered: its answers are not kept
        # once: after `resume` of a flow killed mid-evaluation the baseline's metrics are in the run already
        tracking.log_metrics_once(cfg, run_id, {f"eval/{label}/{k}": v for k, v in report[label]["metrics"].items()})
    report["gain"] = gain_metrics(report["baseline"]["per_prompt"], report["trained"]["per_prompt"])
    _record(cfg, run_id, report)
    return report


def _vocabulary_checked(client, base_model: str):
    """``client`` refusing sampled ids past the policy's vocabulary (``base_model``'s ``vocab_size``): a lying (or
    hijacked) server's."""
    from transformers import AutoConfig

    return dataclasses.replace(client, vocab_size=getattr(AutoConfig.from_pretrained(base_model), "vocab_size", None))


def _measure(cfg: PipelineConfig, client, tokenizer, rows: list[dict], earlier: dict | None, label: str) -> dict:
    """``label``'s evaluation of ``rows`` with the weights the server holds: ``earlier`` (made during training) when
    it evaluated the same weights (:func:`same_weights_as`), else measured now; ``"measured"`` says where."""
    if same_weights_as(cfg, client, tokenizer, rows, earlier, label):
        return {**earlier, "measured": f"training step {earlier['step']}"}
    return {**evaluate_policy(cfg, client, tokenizer, rows, label=label), "measured": "evaluate"}


def _record(cfg: PipelineConfig, run_id: str, report: dict) -> None:
    """The comparison's gain metrics (``eval/gain/...``), tags, traces and sample tables on the MLflow run
    ``run_id``, each once (a retried or resumed step finds them there): where each evaluation was made
    (``eval.<label>.measured``), the episodes' traces (:func:`grpo_steps.evaluation.traces.log_traces`, tagged
    ``eval.traced.<label>``) and ``eval/<label>_samples.json`` (text cells redacted)."""
    from grpo_steps import tracking

    tracking.log_metrics_once(cfg, run_id, {f"eval/gain/{k}": v for k, v in report["gain"].items()})
    # where each evaluation was made: the numbers of one taken from training are its curve point's
    tracking.set_tags(cfg, run_id, {f"eval.{label}.measured": report[label]["measured"]
                                    for label in ("baseline", "trained")})
    traced = tracking.run_tags(cfg, run_id, "eval.traced.")
    for label in ("baseline", "trained"):
        if report[label].get("traces") and f"eval.traced.{label}" not in traced:  # once, also after a resume
            from grpo_steps.evaluation.traces import log_traces

            log_traces(cfg, run_id, label, report[label]["traces"])
            tracking.set_tags(cfg, run_id, {f"eval.traced.{label}": str(len(report[label]["traces"]))})
    mlflow_client = tracking.client(cfg)
    logged = {a.path for a in mlflow_client.list_artifacts(run_id, "eval")}
    for label in ("baseline", "trained"):
        samples, path = report[label]["samples"], f"eval/{label}_samples.json"
        if samples and path not in logged:  # MLflow appends to an existing table: a retried step logs it once
            table = {key: [s[key] for s in samples] for key in samples[0]}
            tracking.log_table(mlflow_client, run_id, table, path)  # text cells redacted


def same_weights_as(cfg: PipelineConfig, client, tokenizer, rows: list[dict], earlier: dict | None,
                    label: str) -> bool:
    """Whether ``earlier`` (an :func:`evaluate_policy` result with the training ``step`` it was made at, or None)
    evaluated ``rows`` with the weights the server holds now (``label``'s: ``baseline``, ``trained``): the same
    prompts, and the greedy completion of the first one (its probe) sampled again as long and with logprobs within
    ``generation.sync_check``'s probe tolerance (mean |difference|, nats per token).
    Prints which it is (``[eval <label>] ...``)."""
    from grpo_steps.evaluation.episodes import EpisodeSampler

    if earlier is None:
        return False
    at = f"the evaluation at training step {earlier['step']}"
    if earlier.get("prompt_keys") != [prompt_key(row["prompt"]) for row in rows]:
        print(f"[eval {label}] {at} has other prompts: measuring the {label} policy", flush=True)
        return False
    probe = EpisodeSampler(cfg, client, tokenizer).sample(rows[:1], 1, temperature=0.0, filters=False)[0][0]
    tolerance, _ = cfg.generation.sync_check.thresholds(cfg.model.dtype)
    before = earlier["probe_logprobs"]
    gap = (sum(abs(a - b) for a, b in zip(probe.first_logprobs, before, strict=True)) / max(len(before), 1)
           if len(probe.first_logprobs) == len(before) else float("inf"))
    same = gap <= tolerance
    print(f"[eval {label}] {'taken from' if same else 'not taken from'} {at} "
          f"({len(rows)} prompts): the {label} weights reloaded give its probe "
          f"{'again' if same else 'no longer'} (mean |logp difference| {gap:.2g} nats/token, tolerance {tolerance:g})",
          flush=True)
    return same


@contextmanager
def served_policy(cfg: PipelineConfig, generation_server, client, weights: str, label: str,
                  store: dict | None = None):
    """Make ``client`` sample from ``weights`` while the block runs: full weights are loaded into every replica from
    where :func:`~grpo_steps.weights.staging.stage_update` staged them (a directory the server reads; with ``store``,
    the run's S3 location under ``weight_sync: s3``, a version in S3), labelled
    :func:`~grpo_steps.weights.labels.eval_label`. A LoRA adapter (``train.peft``) is loaded beside the base weights as
    ``{served}-lora-final`` and requested by that name, then unloaded; a server without runtime LoRA (``runtime_lora``:
    ``kubernetes``), or a run that pushes merged weights (``train.peft.push: merged``, which ``s3`` sync requires), gets
    base + adapter merged, as full weights."""
    from grpo_steps.lora import is_adapter_dir, merge_adapter
    from grpo_steps.models import weights_dir
    from grpo_steps.processes import scratch_dir

    client.model = client.base_model
    if not is_adapter_dir(weights):
        update = stage_update(weights_dir(weights), label, generation_server.stage_weights, store, cfg.model.dtype)
        client.load_weights(update, eval_label(label))
        yield
        return
    base = json.loads((Path(weights) / "adapter_config.json").read_text())["base_model_name_or_path"]
    if not generation_server.runtime_lora or not cfg.serves_adapter or store is not None:
        with scratch_dir() as merged:
            update = stage_update(merge_adapter(base, weights, merged, cfg.model.dtype), label,
                                  generation_server.stage_weights, store, cfg.model.dtype)
            client.load_weights(update, eval_label(label))  # while the merged directory exists
        yield
        return
    # the adapter's base under it, from a directory (adapter pushes are disk sync's: no store)
    client.load_weights(stage_update(weights_dir(base), "baseline", generation_server.stage_weights), eval_label(label))
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
