"""What a person reads after a run: charts logged as images of the MLflow run, the evaluate step's Metaflow card,
and the Markdown description of the registered model version (baseline vs trained, task, model, links)."""

from __future__ import annotations

import math

from grpo_steps import tracking
from grpo_steps.config import PipelineConfig
from grpo_steps.redaction import redact

HEADLINE = ("pass@1", "accuracy", "format_rate", "reward")
"""Metrics that lead the description's table and the eval chart (then every ``pass@k``)."""


def headline_metrics(cfg: PipelineConfig) -> list[str]:
    """The report's metric names in order: pass@1, every other configured pass@k, accuracy, format rate and
    accuracy among formatted answers (when a format reward is configured), mean reward; with tools or an environment,
    then the tool use of the sampled episodes (calls per episode, failed share of calls, assistant turns per
    episode) and the share of greedy episodes with a call."""
    names = ["pass@1"] + [f"pass@{k}" for k in cfg.eval.k if k != 1] + ["accuracy"]
    names += (["format_rate", "accuracy_formatted"] if cfg.eval.format_reward else []) + ["reward"]
    if cfg.tools or cfg.environment:
        names += ["tools/call_frequency", "tools/failure_frequency", "tools/turns_per_episode",
                  "greedy_tools_episodes_with_call"]
    return names


def _cell(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def comparison_table(cfg: PipelineConfig, report: dict) -> str:
    """Markdown table ``| metric | baseline | trained | change |`` over :func:`headline_metrics` (the change with
    its paired 95 % interval, ``± half-width``, where ``report["gain"]`` has one), then the
    reward guard's counts (timeouts, errors, None share per reward) of the trained policy's evaluation.

    >>> from grpo_steps.config import PipelineConfig
    >>> cfg = PipelineConfig(eval={"k": [1], "num_samples": 1, "format_reward": None})
    >>> m = {"pass@1": 0.25, "accuracy": 0.5, "reward": 0.75}
    >>> print(comparison_table(cfg, {"baseline": {"metrics": m}, "trained": {"metrics": {**m, "pass@1": 0.5}}}))
    | metric | baseline | trained | change |
    |---|---:|---:|---:|
    | pass@1 | 0.250 | 0.500 | +0.250 |
    | accuracy | 0.500 | 0.500 | +0.000 |
    | reward | 0.750 | 0.750 | +0.000 |
    >>> gain = {"pass@1": 0.25, "pass@1_ci95": 0.1}
    >>> print(comparison_table(cfg, {"baseline": {"metrics": m}, "trained": {"metrics": {**m, "pass@1": 0.5}},
    ...                              "gain": gain}).splitlines()[2])
    | pass@1 | 0.250 | 0.500 | +0.250 ± 0.100 |
    """
    base, trained = report["baseline"]["metrics"], report["trained"]["metrics"]
    gain = report.get("gain", {})  # paired 95 % half-widths (grpo_steps.steps.gain_metrics)
    lines = ["| metric | baseline | trained | change |", "|---|---:|---:|---:|"]
    for name in headline_metrics(cfg):
        b, t = base.get(name), trained.get(name)
        change = f"{t - b:+.3f}" if b is not None and t is not None and not math.isnan(t - b) else "n/a"
        half_width = gain.get(f"{name}_ci95")
        if half_width is not None and not math.isnan(half_width) and change != "n/a":
            change += f" ± {half_width:.3f}"
        lines.append(f"| {name} | {_cell(b)} | {_cell(t)} | {change} |")
    guard_rows = [name for name in trained if name.startswith("reward/") and name.count("/") == 2]
    if guard_rows:
        lines += ["", "| reward guard (trained eval) | value |", "|---|---:|"]
        lines += [f"| {name} | {_cell(trained[name])} |" for name in sorted(guard_rows)]
    return "\n".join(lines)


def version_description(cfg: PipelineConfig, report: dict, *, run_url: str, run_pathspec: str,
                        gate_reason: str, lineage: dict[str, str] | None = None,
                        splits: tuple[int, int] | None = None, start_uri: str | None = None) -> str:
    """Markdown of a registered version: task, base model, the baseline-vs-trained table, the quality
    gate's verdict, per-task pass@1 for mixtures, the weight lineage of an ``s3`` run (``lineage``: the ``version``,
    ``anchor``, ``deltas`` and ``sha256`` of the last chain version the servers loaded in training,
    :func:`grpo_steps.training.generation.s3.lineage_of`; None: not said), and where to look (MLflow run, Metaflow run
    and card: the printed ``card get <run id>/evaluate`` is the form Metaflow's CLI takes). ``splits``: the
    (train, held-out) prompts ``prepare_data`` kept (its ``data/train``, ``data/eval`` metrics: fewer than the config's
    counts with ``data.skip_seen`` or ``data.allow_smaller_split``; None: the config's); ``start_uri``: the pinned
    version a ``models:/`` start resolved to (the run tag ``start.model_uri``). Credentials are redacted."""
    data = cfg.data
    trained = report["trained"]["metrics"]
    num_train, num_eval = splits or (data.num_train, data.num_eval)
    base = f"`{cfg.model.name_or_path}`" + (f" (`{start_uri}`)" if start_uri and start_uri != cfg.model.name_or_path
                                           else "")
    lines = [
        f"GRPO-trained policy. **Task**: {task_text(cfg)}; {num_train} train / {num_eval} held-out prompts. "
        f"**Base model**: {base}; {cfg.train.max_steps} optimizer steps, "
        f"{cfg.train.num_generations} completions per prompt, rewards "
        + ", ".join(f"`{r.name}` x{r.weight:g}" for r in cfg.rewards) + ".",
        "",
        f"Held-out evaluation ({cfg.eval.num_samples} samples per prompt at temperature {cfg.eval.temperature:g}; "
        "accuracy is greedy):",
        "",
        comparison_table(cfg, report),
        "",
        f"**Quality gate**: {gate_reason}.",
    ]
    lines += _task_table(report["baseline"]["metrics"], trained)
    if lineage:
        lines += ["", f"**Weights through S3** (`generation.weight_sync: s3`): the servers last loaded version "
                  f"{lineage['version']} in training (anchor {lineage['anchor']} + {lineage['deltas']} deltas, "
                  f"SHA-256 digest of its tensors' {lineage.get('checksum', 'sha256')} checksums "
                  f"`{lineage['sha256']}`; tags `weight_lineage.*`)."]
    lines += [
        "",
        f"**MLflow run**: [{run_url}]({run_url}) (training curves, system metrics, charts under Artifacts -> "
        "`charts/`, sample completions under `eval/`).",
        f"**Metaflow run**: `{run_pathspec}`; evaluation card: "
        f"`python flows/grpo_flow.py card get {run_pathspec.split('/')[-1]}/evaluate --id eval card.html`.",
    ]
    return redact("\n".join(lines))



def _task_table(base: dict[str, float], trained: dict[str, float]) -> list[str]:
    """Markdown lines of a mixture's per-task pass@1 (``task/<name>/pass@1`` in the baseline's and the trained
    policy's metrics), after a blank line; none without per-task metrics."""
    tasks = sorted({key.split("/")[1] for key in trained if key.startswith("task/")})
    if not tasks:
        return []
    return ["", "| task | baseline pass@1 | trained pass@1 |", "|---|---:|---:|",
            *(f"| {t} | {_cell(base.get(f'task/{t}/pass@1'))} | {_cell(trained.get(f'task/{t}/pass@1'))} |"
              for t in tasks)]

def task_text(cfg: PipelineConfig) -> str:
    """The run's task in a few words: ``reasoning_gym:<task>``, ``<source> <path>``, or the mixture's parts."""
    data = cfg.data
    if data.mixture:
        return "mixture of " + ", ".join(f"{m.name} ({m.weight:g})" for m in data.mixture)
    if data.source == "reasoning_gym":
        return f"{data.source}:{data.task}"
    return f"{data.source} {data.path or ''}".strip()


def run_description(cfg: PipelineConfig, report: dict, model_version: dict, *, run_pathspec: str,
                    version_url: str) -> str:
    """Markdown of the flow's MLflow run (its Overview's description, MLflow's note): the task, the base model, the
    held-out pass@1 of the base and the trained policy with the paired gain and its 95 % interval
    (:func:`grpo_steps.evaluation.stats.gain_metrics`), the quality gate's verdict, and links to the registered
    version (``version_url``) and the evaluate step's Metaflow card. ``model_version``: what
    :func:`grpo_steps.register.register` returned. Credentials are redacted."""
    base, trained, gain = report["baseline"]["metrics"], report["trained"]["metrics"], report["gain"]
    prompts = len(report["trained"]["per_prompt"]["pass@1"])
    verdict = "passed" if model_version["gate_passed"] else "not passed"
    lines = [
        f"**GRPO** on {task_text(cfg)}: `{cfg.model.name_or_path}`, {cfg.train.max_steps} optimizer steps, "
        f"{cfg.train.num_generations} completions per prompt.",
        "",
        f"**Held-out pass@1** ({prompts} prompts, {cfg.eval.num_samples} samples each): base {_cell(base['pass@1'])} "
        f"→ trained {_cell(trained['pass@1'])}, gain {gain['pass@1']:+.3f} ± {gain['pass@1_ci95']:.3f} "
        "(paired 95 % interval).",
        "",
        f"**Quality gate**: {verdict}: {model_version['gate_reason']}.",
        "",
        f"**Registered**: [{model_version['name']} version {model_version['version']}]({version_url}) (aliases: "
        f"{', '.join(model_version['aliases']) or 'none'}).",
        "",
        f"**Metaflow**: run `{run_pathspec}`; evaluation card: "
        f"`python flows/grpo_flow.py card get {run_pathspec.split('/')[-1]}/evaluate --id eval card.html`.",
    ]
    if cfg.train.curriculum is not None:  # logged by the training process (grpo_steps.training.curriculum.picture)
        lines += ["", "**Curriculum**: pass rates of the trained groups per step: run artifact "
                      "`curriculum/pass_rate.png`."]
    return redact("\n".join(lines))


def reward_figure(curves: dict[str, list[dict]], ylabel: str = "mean reward", title: str = "Training reward"):
    """Matplotlib figure of training curves: ``{metric: [{"step", "value"}]}`` on one axis over the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    for name, points in curves.items():
        if points:
            ax.plot([p["step"] for p in points], [p["value"] for p in points], marker="o", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def eval_figure(cfg: PipelineConfig, report: dict):
    """Matplotlib bar chart of :func:`headline_metrics`, baseline beside trained."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = headline_metrics(cfg)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    width = 0.38
    for offset, label in ((-width / 2, "baseline"), (width / 2, "trained")):
        values = [report[label]["metrics"].get(name, float("nan")) for name in names]
        bars = ax.bar([i + offset for i in range(len(names))], [0 if math.isnan(v) else v for v in values],
                      width, label=label)
        ax.bar_label(bars, labels=[_cell(v) for v in values], fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_title(f"Held-out evaluation ({cfg.data.num_eval} prompts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def log_charts(cfg: PipelineConfig, run_id: str, report: dict) -> None:
    """The training reward curves and the baseline-vs-trained bars as images of the run (``charts/``)."""
    import matplotlib.pyplot as plt

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


def reward_curve(cfg: PipelineConfig, run_id: str, metric: str = "reward") -> list[dict]:
    """``[{"step", "value"}]`` of a training metric from the MLflow run (empty when not logged)."""
    history = tracking.client(cfg).get_metric_history(run_id, metric)
    return [{"step": m.step, "value": m.value} for m in sorted(history, key=lambda m: m.step)]


EVAL_DURING_CURVES = ("accuracy", "pass@1", "format_rate", "accuracy_formatted")
"""The ``eval_during/<metric>`` curves charted (card and ``charts/eval_during_training.png``)."""


def eval_during_curves(cfg: PipelineConfig, run_id: str) -> dict[str, list[dict]]:
    """``{"eval_during/<metric>": [{"step", "value"}]}`` of :data:`EVAL_DURING_CURVES` from the MLflow run
    (empty lists when ``eval.every_steps`` is off)."""
    return {f"eval_during/{name}": reward_curve(cfg, run_id, tracking.mlflow_name(f"eval_during/{name}"))
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
    (``eval.every_steps``), and a baseline-vs-trained table with where each was measured."""
    from metaflow.cards import Markdown, Table, VegaChart

    curve = reward_curve(cfg, run_id)
    names = list(report["trained"]["metrics"])
    rows = [[name, f"{report['baseline']['metrics'][name]:.4f}", f"{report['trained']['metrics'][name]:.4f}"]
            for name in names]
    where = {label: report[label]["measured"] for label in ("baseline", "trained")}
    components = [Markdown("## Held-out evaluation"),
                  Markdown(f"Measured: the baseline in {where['baseline']}, the trained policy in {where['trained']} "
                           "(an evaluation made during training is taken once its weights, reloaded from disk, give "
                           "its probe again)."),
                  Table(rows, headers=["metric", "baseline", "trained"])]
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
