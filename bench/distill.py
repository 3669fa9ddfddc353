"""Benchmark: on-policy distillation (``teacher:``) against GRPO alone, from the same student at the same batch and
steps (issue 72's learning result), and the wall time of an OPD step against a GRPO step.

    .venv/bin/python bench/distill.py [--steps 5,10,20,30] [--arms grpo,distill,privileged]
        [--teacher models:/grpo-smollm2-arithmetic@champion] [--workdir bench-distill]

Arms (each a whole flow run per step count, in ``--workdir``, one after another: two vLLM servers and the trainer
fill a 2-core box):

- ``grpo``: ``configs/local.yaml`` (the embedded model, the default arithmetic task), ``train.max_steps`` = the count;
- ``distill``: the same with ``configs/distill.yaml``'s teacher (``--teacher``: the GRPO-trained policy ``make run``
  registers; run ``make run`` first, in ``--workdir``, or point ``tracking.tracking_uri`` at its registry);
- ``privileged``: the same with ``configs/distill-privileged.yaml``'s teacher (the student's own weights shown the
  answer; no second model).

Each run's ``evaluate`` step scores the base and the trained policy on the same held-out split (the data seed is
the config's), so the arms' per-prompt pass@1 (``eval_report[...]["per_prompt"]["pass@1"]``) pair by prompt. Printed
(Markdown, for docs/benchmarks.md): per arm and step count the held-out pass@1 with its 95 % Student-t interval, the
paired gain over ``grpo`` at the same count (:func:`grpo_steps.evaluation.stats.paired_gain`), the teacher's own
pass@1 (the baseline of a 1-step ``grpo`` run started from it, ``--teacher`` as ``model.name_or_path``), the first
step count where each arm reaches 90 % of the teacher's pass@1 (the issue's goal: ``distill`` in at most a third of
``grpo``'s steps), and the mean step time (TRL's ``step_time`` from MLflow) of ``distill`` against ``grpo`` (goal:
at most +30 %).

How long: a ``make run``-shaped run is ~6 min at 30 steps on a quiet 2-core box (train 4.5 min); a teacher adds a
second server start (~45 s) and its scoring. The default grid (3 arms x 4 counts, ~65 optimizer steps per arm, plus
the teacher's evaluation) is about 12 flow runs, 60-75 min on a quiet box; run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"grpo": "configs/local.yaml", "distill": "configs/distill.yaml",
           "privileged": "configs/distill-privileged.yaml"}


def arm_config(arm: str, steps: int, teacher: str, workdir: Path) -> Path:
    """The config file of one arm at ``steps`` optimizer steps (written into ``workdir``); ``teacher-eval``: a ``grpo``
    run started from the teacher, whose ``evaluate`` baseline is the teacher on the held-out split."""
    source = CONFIGS["grpo" if arm == "teacher-eval" else arm]
    cfg = yaml.safe_load((REPO / source).read_text())
    cfg["train"].update({"max_steps": steps, "save_steps": max(steps, 1)})
    cfg["eval"]["every_steps"] = 0  # the evaluate step measures the whole held-out split; no curve needed
    cfg["registry"]["model_name"] = f"bench-distill-{arm}"
    cfg["module_dirs"] = [str(REPO)]
    if arm == "distill":
        cfg["teacher"]["model"] = teacher
    if arm == "teacher-eval":
        cfg["model"]["name_or_path"] = teacher
    path = workdir / f"{arm}-{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_flow(config: Path, workdir: Path) -> str:
    """Run the flow on ``config`` in ``workdir``; returns the Metaflow run id. Raises ``CalledProcessError``."""
    subprocess.run([sys.executable, str(REPO / "flows" / "grpo_flow.py"), "--config", "config", str(config),
                    "run", "--run-id-file", str(config.with_suffix(".runid"))], cwd=workdir, check=True)
    return config.with_suffix(".runid").read_text().strip()


def run_result(run_id: str, workdir: Path) -> dict:
    """The run's held-out per-prompt pass@1 (base and trained) and its mean training step time (seconds)."""
    os.chdir(workdir)  # the local datastore and mlflow.db of the runs
    from metaflow import Flow, namespace

    namespace(None)
    run = Flow("GRPOFlow")[run_id]
    report = run["evaluate"].task.data.eval_report
    mlflow_run = run["start"].task.data.mlflow_run_id
    import mlflow

    client = mlflow.MlflowClient("sqlite:///mlflow.db")
    step_times = [m.value for m in client.get_metric_history(mlflow_run, "step_time")][1:]  # the first warms up
    return {"base": report["baseline"]["per_prompt"]["pass@1"], "trained": report["trained"]["per_prompt"]["pass@1"],
            "step_time": statistics.fmean(step_times) if step_times else float("nan")}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % Student-t interval."""
    from scipy import stats

    mean = statistics.fmean(values)
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 \
        else float("nan")
    return mean, half


def main(argv: list[str] | None = None) -> None:
    from grpo_steps.evaluation.stats import paired_gain

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="5,10,20,30")
    parser.add_argument("--arms", default="grpo,distill,privileged")
    parser.add_argument("--teacher", default="models:/grpo-smollm2-arithmetic@champion")
    parser.add_argument("--workdir", default="bench-distill")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    counts = [int(s) for s in args.steps.split(",")]
    results: dict[tuple[str, int], dict] = {}
    for arm in args.arms.split(","):
        for steps in counts:
            results[arm, steps] = run_result(run_flow(arm_config(arm, steps, args.teacher, workdir), workdir), workdir)
    teacher = run_result(run_flow(arm_config("teacher-eval", 1, args.teacher, workdir), workdir), workdir)["base"]
    goal = 0.9 * statistics.fmean(teacher)
    print("| arm | steps | held-out pass@1 | gain over grpo (paired 95 %) | step time (s) |\n|---|---|---|---|---|")
    for (arm, steps), result in results.items():
        mean, half = interval(result["trained"])
        grpo = results.get(("grpo", steps))
        gain = "" if grpo is None or arm == "grpo" else "{:+.3f} ± {:.3f}".format(
            *paired_gain(grpo["trained"], result["trained"]))
        print(f"| {arm} | {steps} | {mean:.3f} ± {half:.3f} | {gain} | {result['step_time']:.1f} |")
    print(f"\nteacher pass@1 {statistics.fmean(teacher):.3f}; 90 % of it: {goal:.3f}")
    for arm in args.arms.split(","):
        reached = [s for s in counts if statistics.fmean(results[arm, s]["trained"]) >= goal]
        print(f"{arm}: reaches 90 % of the teacher at {reached[0] if reached else 'none of'} {counts} steps")
    if ("distill", counts[-1]) in results and ("grpo", counts[-1]) in results:
        ratio = results["distill", counts[-1]]["step_time"] / results["grpo", counts[-1]]["step_time"]
        print(f"OPD step / GRPO step at {counts[-1]} steps: {ratio:.2f}x (goal <= 1.30)")
    print(json.dumps({f"{a}-{s}": r for (a, s), r in results.items()}))


if __name__ == "__main__":
    main()
