"""One policy's evaluation on held-out rows, through the generation server: sample (:func:`sample`), score
(:func:`grpo_steps.evaluation.scoring.score_evaluation`), summarise (:func:`summarise`). Serves the ``evaluate`` step
(:mod:`grpo_steps.evaluation.comparison`) and the evaluation during training
(:mod:`grpo_steps.training.eval_during`)."""

from __future__ import annotations

from grpo_steps.config import PipelineConfig
from grpo_steps.evaluation.scoring import Scores, score_evaluation
from grpo_steps.evaluation.stats import mean_scored, pass_at_k, prompt_key


def evaluate_policy(cfg: PipelineConfig, client, tokenizer, rows: list[dict], label: str = "eval",
                    head: int | None = None) -> dict:
    """Metrics of the weights the server holds now, on ``rows``: :func:`sample`, then score
    (:func:`grpo_steps.evaluation.scoring.score_evaluation`), then :func:`summarise`.

    Returns ``{"metrics": {name: float}, "samples": [row dicts], "probe_logprobs": [float], "per_prompt":
    {"accuracy", "pass@1": [float per prompt]}, "prompt_keys": [str per prompt]}`` (``metrics``: see
    :func:`summarise`; ``probe_logprobs``: greedy logprobs of the first prompt, a fingerprint of the served weights;
    ``per_prompt``: :func:`per_prompt`; ``prompt_keys``: :func:`grpo_steps.evaluation.stats.prompt_key` of each
    prompt); multi-turn, also ``"traces"`` (:func:`grpo_steps.evaluation.traces.episode_traces`). With ``head``,
    also ``"head_metrics"``: the same metrics over the first ``head`` prompts alone (from the same completions; the
    guard's counts stay those of the whole evaluation), so one evaluation serves a curve on a subset and a full
    baseline (:mod:`grpo_steps.training.eval_during` at step 0).
    """
    from grpo_steps.evaluation.episodes import EpisodeSampler, conversation

    sampler = EpisodeSampler(cfg, client, tokenizer)
    sampled, greedy = sample(cfg, sampler, rows, label)
    scores = score_evaluation(cfg, rows, sampled, greedy, sampler.multi_turn)
    lengths = [[e.model_tokens for e in group] for group in sampled]

    def summary(keep: list[int]) -> dict[str, float]:
        return summarise(cfg, rows, scores, lengths, keep, episodes=(sampled, greedy) if sampler.multi_turn else None)

    samples = [{"question": row["prompt"][-1]["content"], "answer": row.get("answer"),
                "completion": conversation(sampled[i][0].messages) if sampler.multi_turn else sampled[i][0].text,
                **{name: scores.sampled[name][i][0] for name in scores.sampled}}
               for i, row in enumerate(rows[: cfg.eval.num_table_rows])]
    result = {"metrics": summary(list(range(len(rows)))), "samples": samples,
              # a fingerprint of the weights the server holds: greedy logprobs of the first prompt's completion
              "probe_logprobs": greedy[0][0].first_logprobs,
              "per_prompt": per_prompt(cfg, scores, greedy if sampler.multi_turn else None),
              "prompt_keys": [prompt_key(row["prompt"]) for row in rows]}
    if sampler.multi_turn:  # a sample of episodes, turn by turn, for MLflow's traces (while the environments live)
        from grpo_steps.evaluation.traces import episode_traces

        result["traces"] = episode_traces(cfg, rows, sampled)
    if head is not None:
        result["head_metrics"] = summary(list(range(min(head, len(rows)))))
    return result


def sample(cfg: PipelineConfig, sampler, rows: list[dict], label: str) -> tuple[list[list], list[list]]:
    """``eval.num_samples`` episodes per row at ``eval.temperature`` and one greedy episode per row from ``sampler`` (an
    :class:`~grpo_steps.evaluation.episodes.EpisodeSampler`), in chunks of rows with a progress line (``[eval <label>]
    done/total prompts rate eta``) as each chunk is answered. Single-turn: every request at the server at once
    (:meth:`~grpo_steps.evaluation.episodes.EpisodeSampler.sample_together`). Multi-turn: chunk after chunk, each
    chunk's episodes reset, played to their end and closed before the next chunk's start, so an episode's wall clock
    (``generation.episode_timeout_s``, from its reset) counts its own turns, not the turns of every other episode of
    the evaluation (all at once, configs/game.yaml's 320 episodes took 792 s and 192 of the 256 sampled ones ran past
    their 300 s: scored failed, 2026-12-06). Returns ``(sampled, greedy)``: P lists of N episodes, P lists of 1."""
    from grpo_steps.monitor import Progress

    n = cfg.eval.num_samples
    progress = Progress(f"eval {label}", len(rows), "prompts")
    batch = max(8, -(-len(rows) // 10))  # about ten progress lines
    chunks = [rows[i : i + batch] for i in range(0, len(rows), batch)]
    # Every chunk's sampled and greedy requests at the server at once, so that its batch stays full: chunk after chunk,
    # each waited for its longest completion with the server's batch emptying (make run's step-0 evaluation, 100
    # prompts x 5 completions of up to 48 tokens, 2 cores: 65 s in chunks of 10 prompts, 29 s all at once).
    pending = [2] * len(chunks)  # a chunk's progress line comes when both its requests have answered

    def answered(index: int) -> None:
        pending[index // 2] -= 1
        if not pending[index // 2]:
            progress.update(len(chunks[index // 2]))

    requests = [request for chunk in chunks for request in (
        (chunk, n, cfg.eval.temperature, True), (chunk, 1, 0.0, False))]
    if sampler.multi_turn:
        print(f"[eval {label}] {len(rows)} prompts x {n} sampled + 1 greedy episodes, in {len(chunks)} chunks played "
              "one after another: a line as each chunk ends", flush=True)
        results = []
        for i in range(len(chunks)):
            results += sampler.sample_together(requests[2 * i:2 * i + 2])
            progress.update(len(chunks[i]))
    else:
        print(f"[eval {label}] {len(rows)} prompts x {n} sampled + 1 greedy completions requested at once, in "
              f"{len(chunks)} chunks: a line as each chunk is answered", flush=True)
        results = sampler.sample_together(requests, on_first_turn=answered)
    return ([group for result in results[0::2] for group in result],
            [group for result in results[1::2] for group in result])


def summarise(cfg: PipelineConfig, rows: list[dict], scores: Scores, lengths: list[list[int]], keep: list[int],
              episodes: tuple[list[list], list[list]] | None = None) -> dict[str, float]:
    """The metrics of :func:`evaluate_policy` over the rows whose indices are in ``keep``: :func:`prompt_metrics`;
    with multi-turn ``episodes`` (``(sampled, greedy)``) their tool-use metrics
    (:func:`grpo_steps.evaluation.episodes.episode_metrics`); the reward guard's counts of the whole evaluation,
    ``reward/<name>/timeouts`` and ``reward/<name>/errors`` (calls) and ``reward/<name>/none_share`` (share of
    completions scored None, 0..1); with a ``task`` column (data mixtures), each metric of :func:`prompt_metrics`
    per task as ``task/<task>/<metric>``."""
    from grpo_steps.evaluation.episodes import episode_metrics

    n = cfg.eval.num_samples
    metrics = prompt_metrics(cfg, n, scores, lengths, keep)
    if episodes is not None:
        sampled, greedy = episodes
        metrics.update(episode_metrics([e for i in keep for e in sampled[i]]))
        metrics.update({f"greedy_{k.replace('/', '_')}": v for k, v in
                        episode_metrics([greedy[i][0] for i in keep]).items() if "episodes_with_call" in k})
    metrics.update(scores.guard)
    for task in sorted({rows[i]["task"] for i in keep if rows[i].get("task") is not None}):
        task_keep = [i for i in keep if rows[i].get("task") == task]
        metrics.update({f"task/{task}/{k}": v for k, v in prompt_metrics(cfg, n, scores, lengths, task_keep).items()})
    return metrics


def per_prompt(cfg: PipelineConfig, scores: Scores, greedy: list[list] | None = None) -> dict[str, list[float]]:
    """Per prompt, for paired intervals between two policies on the same prompts
    (:func:`grpo_steps.evaluation.stats.paired_gain`): ``accuracy`` (greedy, 0/1), ``pass@1`` (share of the samples
    correct), and with multi-turn ``greedy`` episodes ``tool_call`` (whether the greedy episode called a tool: splits
    an accuracy gain by tool use)."""
    correctness, at = cfg.eval.correctness_reward, cfg.eval.correct_at
    out = {"accuracy": [float((g[0] or 0.0) >= at) for g in scores.greedy[correctness]],
           "pass@1": [mean_scored(float((s or 0.0) >= at) for s in group)
                      for group in scores.sampled[correctness]]}
    if greedy is not None:
        out["tool_call"] = [float(group[0].tool_calls > 0) for group in greedy]
    return out


def prompt_metrics(cfg: PipelineConfig, n: int, scores: Scores, lengths: list[list[int]],
                   keep: list[int]) -> dict[str, float]:
    """Over the prompts whose indices are in ``keep`` (``n`` sampled completions each, ``lengths[i]`` their model
    tokens): ``accuracy`` (greedy, 0..1), ``pass@k`` for each configured k (unbiased, 0..1), ``format_rate``
    (share of samples the format reward scores 1, when configured) and with it ``format_rate_greedy``
    (the same over the greedy completions), ``accuracy_formatted`` (greedy accuracy among the greedy
    completions in the format; NaN when none is) and ``pass@1_formatted`` (share correct among the
    formatted samples): correctness apart from format, ``reward/<name>`` (mean per reward function over samples),
    ``reward`` (weighted sum, as in training), ``completion_length`` (mean tokens per sample)."""
    greedy_scores, weights = scores.greedy, scores.weights
    correctness, at = cfg.eval.correctness_reward, cfg.eval.correct_at  # correct: a score of at least eval.correct_at
    correct = [[(s or 0.0) >= at for s in scores.sampled[correctness][i]] for i in keep]
    metrics: dict[str, float] = {
        "accuracy": mean_scored(float((greedy_scores[correctness][i][0] or 0.0) >= at)
                                for i in keep),
        "completion_length": mean_scored(length for i in keep for length in lengths[i]),
    }
    for k in sorted({1, *cfg.eval.k}):  # pass@1 always: the quality gate's metric
        metrics[f"pass@{k}"] = mean_scored(pass_at_k(n, sum(c), k) for c in correct)
    if cfg.eval.format_reward:
        fmt = cfg.eval.format_reward
        metrics["format_rate"] = mean_scored(float(s == 1.0) for i in keep for s in scores.sampled[fmt][i])
        metrics["format_rate_greedy"] = mean_scored(float(greedy_scores[fmt][i][0] == 1.0) for i in keep)
        # correctness among the completions in the checked format: the gain that is not format
        metrics["accuracy_formatted"] = mean_scored(
            float((greedy_scores[correctness][i][0] or 0.0) >= at)
            for i in keep if greedy_scores[fmt][i][0] == 1.0)
        metrics["pass@1_formatted"] = mean_scored(
            float((c or 0.0) >= at)
            for i in keep for c, f in zip(scores.sampled[correctness][i], scores.sampled[fmt][i], strict=True)
            if f == 1.0)
    total = [0.0] * sum(len(scores.sampled[correctness][i]) for i in keep)
    for name, weight in weights.items():
        flat = [s for i in keep for s in scores.sampled[name][i]]
        metrics[f"reward/{name}"] = mean_scored(flat)
        total = [t + weight * (s or 0.0) for t, s in zip(total, flat, strict=True)]
    metrics["reward"] = mean_scored(total)
    return metrics
