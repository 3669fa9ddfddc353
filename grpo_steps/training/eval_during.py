"""Held-out evaluation during training (``eval.every_steps``): a validation curve, as TRL's
``eval_strategy``/``eval_steps`` and verl's ``test_freq`` log one.

At step 0 and every ``eval.every_steps`` optimizer steps, node 0 evaluates the policy on a fixed subset
of the eval split (its first ``eval.during_training_prompts`` prompts) with
:func:`grpo_steps.evaluation.policy.evaluate_policy` (the rewards and metrics of the ``evaluate`` step), through
the generation server, and logs each metric as ``eval_during/<metric>`` at the optimizer step.

The server holds the step's weights without an extra reload: after optimizer step N, TRL pushes the
policy to the server before the first generation of step N+1 (``ServerGRPOTrainer``: ``RolloutBackend``
writes, reloads and verifies version ``step-N``). :class:`EvalDuringTraining` makes that same push at the
beginning of step N+1 (``on_step_begin``, before its generation) and marks it done for TRL
(:func:`grpo_steps.trl_hooks.mark_pushed`), then evaluates; step N+1's rollouts then sample from the same
weights. At step 0 this is the push of the base weights TRL makes before the first generation; only the last
step, when it is a multiple of ``every_steps``, costs a push that training alone would not make (in ``on_train_end``).
The server's weight label at evaluation is logged as ``eval_during/weight_version`` (the step number),
so a curve point says which weights it measured. Each point's per-prompt results are logged too, as the MLflow table
``eval_during/per_prompt/step_<N>.json`` (:data:`PER_PROMPT`), so two points, or two runs on the same eval split, pair
by prompt (:func:`grpo_steps.evaluation.stats.paired_gain`).
At step 0 the server holds the base weights that the ``evaluate`` step's baseline measures, and at the last step the
final policy that it measures as the trained one: given the whole eval split, these two evaluate it once for both
(the curve's point is its first ``eval.during_training_prompts`` prompts).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from transformers import TrainerCallback

from grpo_steps import trl_hooks
from grpo_steps.config import PipelineConfig
from grpo_steps.tracking import with_glance
from grpo_steps.weights.labels import label_version

PREFIX = "eval_during"
"""MLflow name prefix of the during-training metrics: ``eval_during/<metric>`` (``pass@k`` is logged as
``pass_at_k``, see :func:`grpo_steps.tracking.mlflow_name`)."""


PER_PROMPT = PREFIX + "/per_prompt/step_{step:05d}.json"
"""MLflow table of one evaluation's per-prompt results (columns ``prompt_key``, ``accuracy``, ``pass@1``; one row per
prompt of the curve, in eval split order), formatted with the optimizer step."""


class EvalDuringTraining(TrainerCallback):
    """Evaluates the policy the server holds at steps 0, N, 2N, ... (N = ``eval.every_steps``), the last
    step included when it is a multiple of N.

    Every rank runs the weight push (a collective under ZeRO-3); only the evaluator (global rank 0, which
    is on node 0) generates, scores and logs, the other ranks wait for it at the next collective. Steps
    an earlier attempt of a resumed run already logged are not evaluated again.

    Args:
        cfg: the run config (``eval``: prompts, samples, temperature; ``rewards``).
        trainer: a :class:`grpo_steps.training.trainer.ServerGRPOTrainer` (its ``vllm_generation`` is the push).
        client: the generation server's :class:`grpo_steps.servers.client.VLLMClient` (evaluator only).
        tokenizer: the policy's tokenizer (chat template).
        rows: the eval rows evaluated each time (``prompt``, ``answer``, ...).
        log: ``log(metrics, step)`` into the run's MLflow run (evaluator only; None: not logged).
        log_table: ``log_table(columns, artifact_file)`` into the run's MLflow run: each evaluation's per-prompt
            results as :data:`PER_PROMPT` (evaluator only; None: not logged).
        logged_steps: steps whose ``eval_during`` metrics the run already holds.
        evaluator: whether this process evaluates (global rank 0).
        split_rows: the whole eval split, whose first ``len(rows)`` prompts are ``rows``: evaluated at step 0 and
            at the last step (``on_train_end``) instead of ``rows`` alone (the curve's point is the same metrics over
            ``rows``), each result written as JSON, with its ``step``, to ``split_results["baseline"]`` and
            ``split_results["trained"]``: the ``evaluate`` step's baseline and trained policy, measured once
            (:func:`grpo_steps.evaluation.comparison.evaluate_baseline_and_trained`). None: every step evaluates
            ``rows``.

    Per evaluation it also logs ``eval_during/seconds`` (wall time of the evaluation, push excluded) and
    ``eval_during/probe_logprob`` (sum of the greedy logprobs of the first prompt's completion, nats: the
    fingerprint of the served weights that ``evaluate`` returns as ``probe_logprobs``).
    Raises what :func:`~grpo_steps.evaluation.policy.evaluate_policy` and the push raise
    (``GenerationServerError``).
    """

    def __init__(self, cfg: PipelineConfig, trainer, client, tokenizer, rows: list[dict], *, log=None, log_table=None,
                 logged_steps: set[int] = frozenset(), evaluator: bool, split_rows: list[dict] | None = None,
                 split_results: dict[str, str] | None = None) -> None:
        self.cfg, self.trainer, self.client, self.tokenizer, self.rows = cfg, trainer, client, tokenizer, rows
        self.log, self.log_table, self.logged_steps, self.evaluator = log, log_table, set(logged_steps), evaluator
        self.every = cfg.eval.every_steps
        # step 0 and the last step evaluate the whole eval split once, for the curve (its first len(rows) prompts) and
        # as the evaluate step's baseline and trained policy (the same weights); only when the curve's prompts are its
        # first ones
        same_head = split_rows is not None and [r["prompt"] for r in split_rows[:len(rows)]] == \
            [r["prompt"] for r in rows]
        self.split_rows, self.split_results = (split_rows, split_results or {}) if same_head else (None, {})

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.evaluate_at(state.global_step, "baseline" if state.global_step == 0 else None)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:  # the last step (never begun by on_step_begin): the final policy
            self.evaluate_at(state.global_step, "trained")
        return control

    def evaluate_at(self, step: int, split_label: str | None = None) -> dict[str, float] | None:
        """Push step ``step``'s weights unless the server has them (every rank), then evaluate (evaluator
        only, unless already logged); returns the metrics logged, or None on the other ranks. ``split_label``
        (``baseline``, ``trained``): the evaluation that also measures the whole eval split for the ``evaluate``
        step, where there is one."""
        trainer = self.trainer
        if trl_hooks.pushed_step(trainer) != step:  # the push TRL makes before the next generation, made now
            pushed = time.perf_counter()
            trainer.vllm_generation.sync_weights(force=True)  # also between generation.weight_sync_every pushes
            trl_hooks.mark_pushed(trainer, step)
            if self.evaluator:  # the first push also waits for the server's first answers (seconds on 2 cores)
                print(f"[{PREFIX}] step {step}: weights pushed in {time.perf_counter() - pushed:.1f}s", flush=True)
        if not self.evaluator or step in self.logged_steps:
            return None
        from grpo_steps.evaluation.policy import evaluate_policy

        started = time.perf_counter()
        version = self.client.weight_version()
        if self.split_rows is not None and split_label in self.split_results:
            result = evaluate_policy(self.cfg, self.client, self.tokenizer, self.split_rows,
                                     label=f"{PREFIX} step {step} + {split_label}", head=len(self.rows))
            Path(self.split_results[split_label]).write_text(json.dumps(
                {**{k: v for k, v in result.items() if k != "head_metrics"}, "step": step}))
            result = {**result, "metrics": result["head_metrics"]}
        else:
            result = evaluate_policy(self.cfg, self.client, self.tokenizer, self.rows, label=f"{PREFIX} step {step}")
        metrics = {f"{PREFIX}/{name}": value for name, value in result["metrics"].items()}
        step_served = label_version(version)
        metrics[f"{PREFIX}/weight_version"] = float("nan") if step_served is None else float(step_served)
        metrics[f"{PREFIX}/probe_logprob"] = sum(result["probe_logprobs"])
        metrics[f"{PREFIX}/seconds"] = time.perf_counter() - started
        if self.log is not None:
            self.log(with_glance(metrics), step)  # the held-out curves lead the run's charts too
        if self.log_table is not None:  # the curve's prompts (a split evaluation's head): every point the same ones
            head = len(self.rows)
            self.log_table({"prompt_key": result["prompt_keys"][:head],
                            **{name: values[:head] for name, values in result["per_prompt"].items()}},
                           PER_PROMPT.format(step=step))
        self.logged_steps.add(step)
        shown = ", ".join(f"{k}={result['metrics'][k]:.3f}" for k in ("accuracy", "pass@1", "format_rate")
                          if k in result["metrics"])
        print(f"[{PREFIX}] step {step} ({version}): {shown} in {metrics[f'{PREFIX}/seconds']:.1f}s", flush=True)
        return metrics


def logged_steps(mlflow_client, run_id: str) -> set[int]:
    """Steps at which the MLflow run already holds ``eval_during`` metrics (an earlier attempt of a resumed run)."""
    return {int(m.step) for m in mlflow_client.get_metric_history(run_id, f"{PREFIX}/weight_version")}
