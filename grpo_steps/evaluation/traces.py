"""Per-episode rollout traces in MLflow (MLflow Tracing, https://mlflow.org/docs/latest/genai/tracing/): one trace
per sampled episode, its root span the episode (the first prompt in, the outcome out), a span per turn with the
observation the policy read, the action it took (its text and tool calls), the turn's reward and its tokens.

Only a sample is traced, so that a long run stays small: the first ``eval.num_traces`` prompts' first sampled
episode of each evaluation (:func:`episode_traces` picks them, while the environments are alive;
:func:`log_traces` writes them). The traces are linked to the run and viewable in its Traces tab.
"""

from __future__ import annotations

import json
from typing import Any

from grpo_steps.config import PipelineConfig
from rewards.game import turn_moves

MAX_TEXT = 2000
"""Characters of an observation or an action kept in a span (the rest is cut)."""


def _text(value: Any) -> str:
    from grpo_steps.redaction import redact

    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return redact(text[:MAX_TEXT])


def _action(message: dict) -> str:
    calls = [c.get("function", c) for c in message.get("tool_calls") or []]
    return " ".join([str(message.get("content") or "")] + [
        f"{c.get('name')}({json.dumps(c.get('arguments') or {})})" for c in calls]).strip()


def episode_trace(row: dict, episode) -> dict:
    """The trace of one episode (:class:`grpo_steps.evaluation.episodes.Episode`) of ``row``, as plain data: ``prompt``
    (the last prompt message, the environment's reset observation appended where it has one, as the policy read it
    only when the reset returned none), ``outcome`` (the environment's ``outcome`` without its steps, or ``{}``) and
    ``turns``: per assistant turn ``observation`` (what the policy read before it: the prompt, then the tools'
    answers), ``action``, ``tokens`` (sampled) and ``reward`` (the sum of the game's rewards of the moves the turn
    made; None where the environment keeps no steps)."""
    outcome = getattr(episode.environment, "outcome", None)
    outcome = dict(outcome) if isinstance(outcome, dict) else {}
    steps = outcome.pop("steps", None) or []
    prompt = str(row["prompt"][-1].get("content") or "")
    turns, observation, tokens = [], prompt, iter(episode.turn_tokens)
    for message, answers, reward in turn_moves(episode.messages, steps):
        turns.append({"observation": observation, "action": _action(message), "tokens": next(tokens, 0),
                      "reward": reward})
        observation = "\n".join(f"{a.get('name')}: {a.get('content')}" for a in answers)
    return {"prompt": prompt, "outcome": outcome, "turns": turns}


def episode_traces(cfg: PipelineConfig, rows: list[dict], sampled: list[list]) -> list[dict]:
    """The traces of the sample: the first sampled episode of each of the first ``eval.num_traces`` rows."""
    return [episode_trace(row, group[0]) for row, group in zip(rows[: cfg.eval.num_traces], sampled, strict=False)]


def log_traces(cfg: PipelineConfig, run_id: str, label: str, traces: list[dict]) -> list[str]:
    """Write ``traces`` (:func:`episode_traces`) to MLflow, each linked to run ``run_id`` and tagged with the policy
    ``label`` (``baseline``, ``trained``). Returns the trace ids."""
    from grpo_steps import tracking

    client = tracking.client(cfg)
    experiment_id = client.get_run(run_id).info.experiment_id
    ids = []
    for index, trace in enumerate(traces):
        root = client.start_trace(f"episode {label} {index}", span_type="AGENT", inputs={"prompt": _text(
            trace["prompt"])}, tags={"grpo.policy": label, "grpo.prompt_index": str(index)},
            experiment_id=experiment_id, run_id=run_id)
        for turn_index, turn in enumerate(trace["turns"]):
            span = client.start_span(f"turn {turn_index + 1}", trace_id=root.trace_id, parent_id=root.span_id,
                                     span_type="CHAIN", inputs={"observation": _text(turn["observation"])},
                                     attributes={"tokens": turn["tokens"], "reward": turn["reward"]})
            client.end_span(root.trace_id, span.span_id, outputs={"action": _text(turn["action"])})
        client.end_trace(root.trace_id, outputs=trace["outcome"])
        ids.append(root.trace_id)
    import mlflow

    mlflow.flush_trace_async_logging()  # MLflow exports traces in a background queue: written before we return
    return ids
