"""Evaluation of a policy on the held-out split, with the training reward functions.

Both the baseline (base weights) and the trained policy go through the same generation server
(weights reloaded from disk, :func:`served_policy`) on the same prompts, so their numbers compare directly
(:func:`evaluate_baseline_and_trained`, the ``evaluate`` step); :func:`evaluate_policy` also serves the
evaluation during training.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import statistics
from contextlib import contextmanager
from math import comb
from pathlib import Path

from grpo_steps.config import PipelineConfig

CORRECTNESS_THRESHOLD = 1.0  # a completion is correct when the correctness reward reaches this


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with ``c`` correct among ``n`` samples.

    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", eq. 1).

    Raises:
        ValueError: ``k`` not in 1..n or ``c`` not in 0..n.

    >>> pass_at_k(4, 1, 1)
    0.25
    >>> pass_at_k(4, 1, 4)
    1.0
    >>> pass_at_k(4, 0, 2)
    0.0
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def prompt_key(prompt) -> str:
    """A short stable digest of one prompt (a string or a chat message list): which prompts two policies' scores
    share (the registry compares a version with the champion prompt by prompt, :mod:`grpo_steps.gate`).

    >>> prompt_key([{"role": "user", "content": "1 + 1?"}]) == prompt_key([{"role": "user", "content": "1 + 1?"}])
    True
    """
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean gain ``after - before`` over prompts scored by both policies, and the half-width of its 95 % interval:
    ``t(0.975, P-1) * sd(d) / sqrt(P)`` for the P per-prompt differences ``d`` (a paired interval: each prompt is
    its own control; Student's t rather than the normal 1.96, which is too narrow on a few prompts). When every
    difference is equal, ``sd(d)`` is 0 but the sample, not the policy, is degenerate (two prompts that both
    gained): the sd is then taken over ``d`` plus one prompt without a gain, so the interval never has width 0.
    The half-width is NaN with fewer than 2 prompts.

    Raises:
        ValueError: the lists differ in length or are empty.

    >>> paired_gain([0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0])
    (0.5, 0.918...)
    >>> paired_gain([0.0, 0.0], [1.0, 1.0])  # +1 on both prompts: wide, not +1 +- 0
    (1.0, 5.18...)
    """
    from scipy.stats import t as student_t

    if len(before) != len(after) or not before:
        raise ValueError(f"paired_gain needs two equally long, non-empty lists, got {len(before)} and {len(after)}")
    diffs = [b - a for a, b in zip(before, after, strict=True)]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, float("nan")
    sd = statistics.stdev(diffs) or statistics.stdev([*diffs, 0.0])  # degenerate sample: one more, no-gain prompt
    return mean, float(student_t.ppf(0.975, len(diffs) - 1)) * sd / len(diffs) ** 0.5


def score(cfg: PipelineConfig, rows: list[dict], completions: list[list[str | list[dict]]],
          completion_ids: list[list[list[int]]] | None = None) -> dict[str, list[list[float | None]]]:
    """Reward of each completion under each configured reward function (the training code path:
    :func:`rewards.build_reward`, options and guard included).

    Args:
        rows: P eval rows (``prompt``, ``answer``, ...).
        completions: P lists of completions: texts, or the messages of a multi-turn episode (what TRL passes the
            rewards in training).
        completion_ids: P lists of completion token ids, shaped like ``completions``, for rewards that
            need lengths in tokens; None: such rewards score None.

    Returns:
        reward name -> P lists of scores (None where the reward does not apply).
    """
    from rewards import build_reward

    flat_completions = [[{"role": "assistant", "content": c}] if isinstance(c, str) else c
                        for group in completions for c in group]
    columns: dict[str, list] = {}
    for key in rows[0]:
        if key != "prompt":
            columns[key] = [row[key] for row, texts in zip(rows, completions, strict=True) for _ in texts]
    prompts = [row["prompt"] for row, texts in zip(rows, completions, strict=True) for _ in texts]
    if completion_ids is not None:
        columns["completion_ids"] = [ids for group in completion_ids for ids in group]
    out = {}
    for spec in cfg.rewards:
        flat = build_reward(spec)(prompts=prompts, completions=flat_completions, **columns)
        it = iter(flat)
        out[spec.name] = [[next(it) for _ in texts] for texts in completions]
    return out


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return float(statistics.fmean(values)) if values else float("nan")


def _metrics(cfg: PipelineConfig, n: int, scores: dict, greedy_scores: dict, lengths: list[list[int]],
             keep: list[int], weights: dict[str, float]) -> dict[str, float]:
    """The metrics of :func:`evaluate_policy` over the prompts whose indices are in ``keep`` (``weights``: reward
    name -> weight in the summed ``reward``)."""
    correctness = cfg.eval.correctness_reward
    correct = [[(s or 0.0) >= CORRECTNESS_THRESHOLD for s in scores[correctness][i]] for i in keep]
    metrics: dict[str, float] = {
        "accuracy": _mean(float((greedy_scores[correctness][i][0] or 0.0) >= CORRECTNESS_THRESHOLD) for i in keep),
        "completion_length": _mean(length for i in keep for length in lengths[i]),
    }
    for k in sorted({1, *cfg.eval.k}):  # pass@1 always: the quality gate's metric
        metrics[f"pass@{k}"] = _mean(pass_at_k(n, sum(c), k) for c in correct)
    if cfg.eval.format_reward:
        fmt = cfg.eval.format_reward
        metrics["format_rate"] = _mean(float(s == 1.0) for i in keep for s in scores[fmt][i])
        metrics["format_rate_greedy"] = _mean(float(greedy_scores[fmt][i][0] == 1.0) for i in keep)
        # correctness among the completions in the checked format: the gain that is not format
        metrics["accuracy_formatted"] = _mean(
            float((greedy_scores[correctness][i][0] or 0.0) >= CORRECTNESS_THRESHOLD)
            for i in keep if greedy_scores[fmt][i][0] == 1.0)
        metrics["pass@1_formatted"] = _mean(
            float((c or 0.0) >= CORRECTNESS_THRESHOLD)
            for i in keep for c, f in zip(scores[correctness][i], scores[fmt][i], strict=True) if f == 1.0)
    total = [0.0] * sum(len(scores[correctness][i]) for i in keep)
    for name, weight in weights.items():
        flat = [s for i in keep for s in scores[name][i]]
        metrics[f"reward/{name}"] = _mean(flat)
        total = [t + weight * (s or 0.0) for t, s in zip(total, flat, strict=True)]
    metrics["reward"] = _mean(total)
    return metrics


def environment_rewards(groups: list[list]) -> list[str]:
    """The names (class names, as TRL logs them) of the environments among ``groups`` of episodes that own a reward
    (``get_reward``)."""
    return sorted({type(e.environment).__name__ for group in groups for e in group
                   if e.environment is not None and callable(getattr(e.environment, "get_reward", None))})


def _environment_reward(episode, name: str) -> float | None:
    env = episode.environment
    if env is None or type(env).__name__ != name:
        return None
    value = env.get_reward()
    if inspect.isawaitable(value):
        import asyncio

        async def _value():
            return await value

        value = asyncio.run(_value())
    return None if value is None else float(value)


def evaluate_policy(cfg: PipelineConfig, client, tokenizer, rows: list[dict], label: str = "eval",
                    head: int | None = None) -> dict:
    """Metrics of the weights the server holds now, on ``rows``.

    Samples ``eval.num_samples`` completions per prompt at ``eval.temperature`` plus one greedy
    completion, every request at the server at once (:meth:`grpo_steps.episodes.Rollouts.sample_together`), in
    chunks of prompts with a progress line (``[eval <label>] done/total prompts rate eta``) as each chunk is
    answered. Returns ``{"metrics": {name: float}, "samples": [row dicts], "probe_logprobs": [float],
    "per_prompt": {"accuracy", "pass@1": [float per prompt]}, "prompt_keys": [str per prompt]}``
    (``probe_logprobs``: greedy logprobs of the first prompt, a fingerprint of the served weights;
    ``prompt_keys``: :func:`prompt_key` of each prompt), where metrics are:
    ``accuracy`` (greedy, 0..1), ``pass@k`` for each configured k (unbiased, 0..1), ``format_rate``
    (share of samples the format reward scores 1, when configured) and with it ``format_rate_greedy``
    (the same over the greedy completions), ``accuracy_formatted`` (greedy accuracy among the greedy
    completions in the format; NaN when none is) and ``pass@1_formatted`` (share correct among the
    formatted samples): correctness apart from format, ``reward/<name>`` (mean per
    reward function over samples), ``reward`` (weighted sum, as in training), ``completion_length``
    (mean tokens per sample); the reward guard's counts of this evaluation, ``reward/<name>/timeouts``
    and ``reward/<name>/errors`` (calls) and ``reward/<name>/none_share`` (share of completions scored
    None, 0..1); with a ``task`` column (data mixtures), each metric above also per task as
    ``task/<task>/<metric>``. With ``head``, also ``"head_metrics"``: the same metrics over the first ``head``
    prompts alone (from the same completions; the guard's counts stay those of the whole evaluation), so one
    evaluation serves a curve on a subset and a full baseline (:mod:`grpo_steps.training.eval_during` at step 0).
    """
    from grpo_steps.episodes import Rollouts, conversation, episode_metrics
    from grpo_steps.monitor import Progress
    from rewards import guard

    n = cfg.eval.num_samples
    rollouts = Rollouts(cfg, client, tokenizer)
    progress = Progress(f"eval {label}", len(rows), "prompts")
    batch = max(8, -(-len(rows) // 10))  # about ten progress lines
    chunks = [rows[i : i + batch] for i in range(0, len(rows), batch)]
    # Every chunk's sampled and greedy requests at the server at once, so that its batch stays full: chunk after chunk,
    # each waited for its longest completion with the server's batch emptying (make run's step-0 evaluation, 100
    # prompts x 5 completions of up to 48 tokens, 2 cores: 65 s in chunks of 10 prompts, 29 s all at once).
    # A chunk's progress line comes when both its requests have answered.
    pending = [2] * len(chunks)

    def answered(index: int) -> None:
        pending[index // 2] -= 1
        if not pending[index // 2]:
            progress.update(len(chunks[index // 2]))

    print(f"[eval {label}] {len(rows)} prompts x {n} sampled + 1 greedy completions requested at once, in "
          f"{len(chunks)} chunks: a line as each chunk is answered", flush=True)
    results = rollouts.sample_together([request for chunk in chunks for request in (
        (chunk, n, cfg.eval.temperature, True), (chunk, 1, 0.0, False))], on_first_turn=answered)
    sampled = [group for result in results[0::2] for group in result]
    greedy = [group for result in results[1::2] for group in result]

    def completions_of(groups: list[list]) -> list[list]:  # a single turn's text, or an episode's messages
        return [[e.messages if rollouts.multi_turn else e.text for e in group] for group in groups]

    counts_before, scored_before = guard.counters(), guard.scored()
    scores = score(cfg, rows, completions_of(sampled), [[e.completion_ids for e in group] for group in sampled])
    greedy_scores = score(cfg, rows, completions_of(greedy), [[e.completion_ids for e in group] for group in greedy])
    lengths = [[e.model_tokens for e in group] for group in sampled]
    weights = {spec.name: spec.weight for spec in cfg.rewards}
    for env_reward in environment_rewards(sampled + greedy):  # an environment's get_reward: weight 1, as in TRL
        weights[env_reward] = 1.0
        scores[env_reward] = [[_environment_reward(e, env_reward) for e in group] for group in sampled]
        greedy_scores[env_reward] = [[_environment_reward(e, env_reward) for e in group] for group in greedy]
    texts = [[e.text for e in group] for group in sampled]

    counts, scored = guard.counters(), guard.scored()
    guard_metrics = {}  # the reward guard's counts of this evaluation (all its prompts)
    for spec in cfg.rewards:
        for kind in guard.KINDS:
            key = guard.counter_key(spec.name, kind)
            guard_metrics[f"reward/{spec.name}/{kind}"] = float(counts.get(key, 0) - counts_before.get(key, 0))
        total = scored[spec.name][0] - scored_before.get(spec.name, (0, 0))[0]
        nones = scored[spec.name][1] - scored_before.get(spec.name, (0, 0))[1]
        guard_metrics[f"reward/{spec.name}/none_share"] = nones / total if total else float("nan")

    def summary(keep: list[int]) -> dict[str, float]:  # the metrics over the prompts of ``keep``
        metrics = _metrics(cfg, n, scores, greedy_scores, lengths, keep, weights)
        if rollouts.multi_turn:
            metrics.update(episode_metrics([e for i in keep for e in sampled[i]]))
            metrics.update({f"greedy_{k.replace('/', '_')}": v for k, v in
                            episode_metrics([greedy[i][0] for i in keep]).items() if "episodes_with_call" in k})
        metrics.update(guard_metrics)
        for task in sorted({rows[i]["task"] for i in keep if rows[i].get("task") is not None}):
            task_keep = [i for i in keep if rows[i].get("task") == task]
            metrics.update({f"task/{task}/{k}": v for k, v in
                            _metrics(cfg, n, scores, greedy_scores, lengths, task_keep, weights).items()})
        return metrics

    correctness = cfg.eval.correctness_reward
    per_prompt = {  # for paired intervals between two policies on the same prompts (see paired_gain)
        "accuracy": [float((g[0] or 0.0) >= CORRECTNESS_THRESHOLD) for g in greedy_scores[correctness]],
        "pass@1": [_mean(float((s or 0.0) >= CORRECTNESS_THRESHOLD) for s in group) for group in scores[correctness]],
    }
    if rollouts.multi_turn:  # whether the greedy episode called a tool: splits an accuracy gain by tool use
        per_prompt["tool_call"] = [float(group[0].tool_calls > 0) for group in greedy]

    samples = []
    for i, row in enumerate(rows[: cfg.eval.num_table_rows]):
        samples.append({
            "question": row["prompt"][-1]["content"],
            "answer": row.get("answer"),
            "completion": texts[i][0] if not rollouts.multi_turn else conversation(sampled[i][0].messages),
            **{name: scores[name][i][0] for name in scores},
        })
    # Fingerprint of the weights the server holds: greedy logprobs of the first prompt's completion.
    result = {"metrics": summary(list(range(len(rows)))), "samples": samples,
              "probe_logprobs": greedy[0][0].first_logprobs, "per_prompt": per_prompt,
              "prompt_keys": [prompt_key(row["prompt"]) for row in rows]}
    if head is not None:
        result["head_metrics"] = summary(list(range(min(head, len(rows)))))
    return result


def gain_metrics(baseline: dict[str, list[float]], trained: dict[str, list[float]]) -> dict[str, float]:
    """Trained minus baseline on the same prompts, per metric of ``per_prompt`` (see
    :func:`evaluate_policy`): ``<metric>`` (mean gain) and ``<metric>_ci95`` (half-width of
    its paired 95 % interval, :func:`grpo_steps.evaluate.paired_gain`). With tools (a ``tool_call`` entry):
    ``accuracy_from_tool_calls``, the part of the accuracy gain made on prompts whose trained greedy episode called
    a tool (the rest of ``accuracy`` was made without a call).

    >>> gain = gain_metrics({"accuracy": [0, 0, 1], "tool_call": [0, 0, 0]},
    ...                     {"accuracy": [1, 1, 1], "tool_call": [1, 0, 1]})
    >>> gain["accuracy"], gain["accuracy_from_tool_calls"]
    (0.6666666666666666, 0.3333333333333333)
    """
    out = {}
    for name in baseline:
        out[name], out[f"{name}_ci95"] = paired_gain(baseline[name], trained[name])
    if "tool_call" in trained and "accuracy" in trained:
        deltas = [(t - b) * call for b, t, call in zip(baseline["accuracy"], trained["accuracy"],
                                                       trained["tool_call"], strict=True)]
        out["accuracy_from_tool_calls"] = sum(deltas) / max(len(deltas), 1)
    return out


def evaluate_baseline_and_trained(cfg: PipelineConfig, *, run_id: str, server: dict, base_model: str,
                                  trained_model: str, eval_rows: list[dict],
                                  measured: dict[str, dict] | None = None) -> dict:
    """Baseline (``base_model``) and trained policy (``trained_model``: full weights or a LoRA adapter) on
    ``eval_rows`` through the same generation server (``server``: a handle of :mod:`grpo_steps.servers`), one after
    the other (:func:`served_policy`); metrics (``eval/<label>/...``, ``eval/gain/...``) and sample tables
    (``eval/<label>_samples.json``) to the MLflow run ``run_id``.

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
    client = generation_server.client()
    tokenizer = load_tokenizer(base_model, cfg.model.chat_template)
    report = {}
    for label, weights in (("baseline", base_model), ("trained", trained_model)):
        with served_policy(cfg, generation_server, client, weights, label):
            earlier = (measured or {}).get(label)
            if same_weights_as(cfg, client, tokenizer, eval_rows, earlier, label):
                report[label] = {**earlier, "measured": f"training step {earlier['step']}"}
            else:
                report[label] = {**evaluate_policy(cfg, client, tokenizer, eval_rows, label=label),
                                 "measured": "evaluate"}
        # once: after `resume` of a flow killed mid-evaluation the baseline's metrics are in the run already
        tracking.log_metrics_once(cfg, run_id, {f"eval/{label}/{k}": v for k, v in report[label]["metrics"].items()})
    report["gain"] = gain_metrics(report["baseline"]["per_prompt"], report["trained"]["per_prompt"])
    tracking.log_metrics_once(cfg, run_id, {f"eval/gain/{k}": v for k, v in report["gain"].items()})
    # where each evaluation was made: the numbers of one taken from training are its curve point's
    tracking.set_tags(cfg, run_id, {f"eval.{label}.measured": report[label]["measured"]
                                    for label in ("baseline", "trained")})
    mlflow_client = tracking.client(cfg)
    logged = {a.path for a in mlflow_client.list_artifacts(run_id, "eval")}
    for label in ("baseline", "trained"):
        samples, path = report[label]["samples"], f"eval/{label}_samples.json"
        if samples and path not in logged:  # MLflow appends to an existing table: a retried step logs it once
            table = {key: [s[key] for s in samples] for key in samples[0]}
            tracking.log_table(mlflow_client, run_id, table, path)  # text cells redacted
    return report


def same_weights_as(cfg: PipelineConfig, client, tokenizer, rows: list[dict], earlier: dict | None,
                    label: str) -> bool:
    """Whether ``earlier`` (an :func:`evaluate_policy` result with the training ``step`` it was made at, or None)
    evaluated ``rows`` with the weights the server holds now (``label``'s: ``baseline``, ``trained``): the same
    prompts, and the greedy completion of the first one (its probe) sampled again as long and with logprobs within
    ``generation.sync_check``'s probe tolerance (mean |difference|, nats per token).
    Prints which it is (``[eval <label>] ...``)."""
    from grpo_steps.episodes import Rollouts

    if earlier is None:
        return False
    at = f"the evaluation at training step {earlier['step']}"
    if earlier.get("prompt_keys") != [prompt_key(row["prompt"]) for row in rows]:
        print(f"[eval {label}] {at} has other prompts: measuring the {label} policy", flush=True)
        return False
    probe = Rollouts(cfg, client, tokenizer).sample(rows[:1], 1, temperature=0.0, filters=False)[0][0]
    tolerance, _ = cfg.generation.sync_check.thresholds(cfg.model.dtype)
    before = earlier["probe_logprobs"]
    gap = (sum(abs(a - b) for a, b in zip(probe.first_logprobs, before, strict=True)) / max(len(before), 1)
           if len(probe.first_logprobs) == len(before) else float("inf"))
    same = gap <= tolerance
    print(f"[eval {label}] {'taken from' if same else 'not taken from'} {at} "
          f"({len(rows)} prompts): the {label} weights reloaded from disk give its probe "
          f"{'again' if same else 'no longer'} (mean |logp difference| {gap:.2g} nats/token, tolerance {tolerance:g})",
          flush=True)
    return same


@contextmanager
def served_policy(cfg: PipelineConfig, generation_server, client, weights: str, label: str):
    """Make ``client`` sample from ``weights`` while the block runs: full weights are reloaded into the server;
    a LoRA adapter (``train.peft``) is loaded beside the base weights as ``{served}-lora-final`` and requested by
    that name, then unloaded. A server without runtime LoRA (``runtime_lora``: ``kubernetes``), or a run that pushes
    merged weights (``train.peft.push: merged``), gets base + adapter merged."""
    from grpo_steps.lora import adapter_name, is_adapter_dir, merge_adapter
    from grpo_steps.processes import scratch_dir

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
