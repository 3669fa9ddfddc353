"""Scoring of an evaluation's completions with the training reward functions (the same code path: options and the
reward guard included), and the guard's counts of that evaluation, as one unit (:func:`score_evaluation`)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from grpo_steps.config import PipelineConfig


def score(cfg: PipelineConfig, rows: list[dict], completions: list[list[str | list[dict]]],
          completion_ids: list[list[list[int]]] | None = None,
          environments: list[list] | None = None) -> dict[str, list[list[float | None]]]:
    """Reward of each completion under each configured reward function (the training code path:
    :func:`rewards.build_reward`, options and guard included).

    Args:
        rows: P eval rows (``prompt``, ``answer``, ...).
        completions: P lists of completions: texts, or the messages of a multi-turn episode (what TRL passes the
            rewards in training).
        completion_ids: P lists of completion token ids, shaped like ``completions``, for rewards that
            need lengths in tokens; None: such rewards score None.
        environments: P lists of the episodes' environment instances, shaped like ``completions``, passed to the
            rewards as ``environments`` (as TRL passes them in training); None: not passed.

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
    if environments is not None:
        columns["environments"] = [env for group in environments for env in group]
    out = {}
    for spec in cfg.rewards:
        flat = build_reward(spec)(prompts=prompts, completions=flat_completions, **columns)
        it = iter(flat)
        out[spec.name] = [[next(it) for _ in texts] for texts in completions]
    return out


def environment_rewards(groups: list[list]) -> list[str]:
    """The names (class names, as TRL logs them) of the environments among ``groups`` of episodes that own a reward
    (``get_reward``)."""
    return sorted({type(e.environment).__name__ for group in groups for e in group
                   if e.environment is not None and callable(getattr(e.environment, "get_reward", None))})


def environment_reward(episode, name: str) -> float | None:
    """The reward of environment class ``name`` for one episode (its ``get_reward()``, awaited when a coroutine), or
    None when the episode's environment is another one or has none."""
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


@dataclass(frozen=True)
class Scores:
    """The rewards of one evaluation: P prompts, N sampled and 1 greedy completion each."""

    sampled: dict[str, list[list[float | None]]]
    """Reward name -> P lists of N scores (None where the reward does not apply)."""
    greedy: dict[str, list[list[float | None]]]
    """Reward name -> P lists of 1 score, for the greedy completions."""
    weights: dict[str, float]
    """Reward name -> its weight in the summed ``reward`` (an environment's own reward: 1, as in TRL)."""
    guard: dict[str, float]
    """The reward guard's counts of this evaluation: ``reward/<name>/timeouts`` and ``reward/<name>/errors`` (calls)
    and ``reward/<name>/none_share`` (share of completions scored None, 0..1; NaN when none was scored)."""


def score_evaluation(cfg: PipelineConfig, rows: list[dict], sampled: list[list], greedy: list[list],
                     multi_turn: bool) -> Scores:
    """Score the P groups of ``sampled`` and of ``greedy`` episodes (:class:`grpo_steps.evaluation.episodes.Episode`)
    of ``rows`` with every configured reward (a single turn's text, or with ``multi_turn`` the episode's messages, as
    TRL passes them in training) and every environment reward, counting what the reward guard saw meanwhile."""
    from rewards import guard

    def completions_of(groups: list[list]) -> list[list]:
        return [[e.messages if multi_turn else e.text for e in group] for group in groups]

    counts_before, scored_before = guard.counters(), guard.scored()
    def environments_of(groups: list[list]) -> list[list] | None:
        return [[e.environment for e in group] for group in groups] if multi_turn else None

    sampled_scores = score(cfg, rows, completions_of(sampled), [[e.completion_ids for e in g] for g in sampled],
                           environments_of(sampled))
    greedy_scores = score(cfg, rows, completions_of(greedy), [[e.completion_ids for e in g] for g in greedy],
                          environments_of(greedy))
    counts, scored = guard.counters(), guard.scored()
    guard_counts = {}
    for spec in cfg.rewards:
        for kind in guard.KINDS:
            key = guard.counter_key(spec.name, kind)
            guard_counts[f"reward/{spec.name}/{kind}"] = float(counts.get(key, 0) - counts_before.get(key, 0))
        (total, nones), (total_before, nones_before) = scored[spec.name], scored_before.get(spec.name, (0, 0))
        total, nones = total - total_before, nones - nones_before
        guard_counts[f"reward/{spec.name}/none_share"] = nones / total if total else float("nan")
    weights = {spec.name: spec.weight for spec in cfg.rewards}
    for name in environment_rewards(sampled + greedy):  # an environment's get_reward: weight 1, as in TRL
        weights[name] = 1.0
        sampled_scores[name] = [[environment_reward(e, name) for e in group] for group in sampled]
        greedy_scores[name] = [[environment_reward(e, name) for e in group] for group in greedy]
    return Scores(sampled_scores, greedy_scores, weights, guard_counts)
