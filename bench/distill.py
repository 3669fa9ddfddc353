"""Benchmark: on-policy distillation (``teacher:``) against GRPO alone, from the same student at the same batch and
steps (issue 72's learning result), and the wall time of an OPD step against a GRPO step.

    make run   # in WORKDIR: registers the teacher, models:/grpo-smollm2-arithmetic@champion, in WORKDIR/mlflow.db
    .venv/bin/python bench/distill.py [--steps 30] [--every 5] [--arms grpo,distill,privileged] [--seeds 42 7 1234]
        [--teacher models:/grpo-smollm2-arithmetic@champion] [--teacher-run RUN_ID] [--workdir bench-distill]

Arms (one whole flow run each, in ``--workdir``, one after another: two vLLM servers and the trainer fill a 2-core
box):

- ``grpo``: ``configs/local.yaml`` (the embedded model, the default arithmetic task);
- ``distill``: the same with ``configs/distill.yaml``'s teacher (``--teacher``: the GRPO-trained policy ``make run``
  registers; run ``make run`` in ``--workdir`` first, so that its ``mlflow.db`` holds the registry);
- ``privileged``: the same with ``configs/distill-privileged.yaml``'s teacher (the student's own weights shown the
  answer; no second model).

Each arm runs ``--steps`` optimizer steps and evaluates the whole held-out split every ``--every`` steps during
training (``eval.every_steps``, ``eval.during_training_prompts`` = the split), each point's per-prompt pass@1 logged
as the MLflow table ``eval_during/per_prompt/step_<N>.json``: the same prompts at every step and in every arm (the
data seed is the config's), so the arms pair by prompt at each step count, on one trajectory per arm rather than one
run per count. The teacher's own pass@1 on the split is the baseline of a 1-step ``grpo`` run started from it
(``--teacher`` as ``model.name_or_path``), or with ``--teacher-run`` the trained policy's evaluation of the ``make
run`` that registered it (the same weights, split and evaluation settings).

Printed (Markdown, for docs/benchmarks.md): per step count and arm the held-out pass@1 with its 95 % Student-t
interval and the paired gain over ``grpo`` at that count (:func:`grpo_steps.evaluation.stats.paired_gain`); the
teacher's pass@1; the first step count where each arm reaches 90 % of it (the issue's goal: ``distill`` in at most a
third of ``grpo``'s steps); and the mean step time (TRL's ``step_time``: generation, the teacher's scoring and the
optimizer step; evaluations excluded) and the part of it that waited for the teacher (goal: at most +30 %). Each
finished run is kept in ``WORKDIR/<arm>-seed<seed>.json``: the same command run again skips it. With several
``--seeds`` (``train.seed``; the sampler draws differently in each run anyway, vLLM taking no per-request seed here)
the arms pool and pair by seed and prompt.

How long on a quiet 2-core box: ``make run`` ~7 min; each arm ~6-8 min at 30 steps (a teacher adds a second server
start, ~45 s, and its scoring; the 7 evaluations of 100 prompts ~3 min); the teacher's evaluation ~3 min.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"grpo": "configs/local.yaml", "distill": "configs/distill.yaml",
           "privileged": "configs/distill-privileged.yaml"}


def arm_config(arm: str, seed: int, steps: int, every: int, teacher: str, workdir: Path) -> Path:
    """The config file of one arm at training seed ``seed`` (written into ``workdir``); ``teacher-eval``: a 1-step
    ``grpo`` run started from the teacher, whose ``evaluate`` baseline is the teacher on the held-out split."""
    cfg = yaml.safe_load((REPO / CONFIGS["grpo" if arm == "teacher-eval" else arm]).read_text())
    cfg["train"].update({"max_steps": steps, "save_steps": steps, "seed": seed})  # the data (and split) seed stays
    # the whole split at every point: the arms' curves pair by prompt (eval_during/per_prompt tables)
    cfg["eval"].update({"every_steps": every, "during_training_prompts": cfg["data"]["num_eval"]})
    cfg["registry"]["model_name"] = f"bench-distill-{arm}"
    cfg["module_dirs"] = [str(REPO)]
    if arm == "distill":
        cfg["teacher"]["model"] = teacher
    if arm == "teacher-eval":
        cfg["model"]["name_or_path"] = teacher
        cfg["train"].update({"max_steps": 1, "save_steps": 1})
        cfg["eval"]["every_steps"] = 0  # the evaluate step measures the teacher as the baseline
    path = workdir / f"{arm}-seed{seed}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_flow(config: Path, workdir: Path) -> str:
    """Run the flow on ``config`` in ``workdir`` (its output in ``<config>.log``); returns the Metaflow run id.
    Raises ``CalledProcessError``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(config.with_suffix(".log"), "w") as log:
        subprocess.run([sys.executable, str(REPO / "flows" / "grpo_flow.py"), "--config", "config", str(config),
                        "run", "--run-id-file", str(config.with_suffix(".runid"))], cwd=workdir, env=env,
                       stdout=log, stderr=subprocess.STDOUT, check=True)
    return config.with_suffix(".runid").read_text().strip()


def run_result(run_id: str, workdir: Path) -> dict:
    """The run's held-out per-prompt pass@1 at each evaluated step (``{"curve": {step: [pass@1 per prompt]}}``; the
    evaluate step's baseline as ``"base"``), and its mean training step time (seconds, the first step excluded)."""
    os.chdir(workdir)  # the local datastore and mlflow.db of the runs
    import mlflow
    from metaflow import Flow, namespace

    namespace(None)
    run = Flow("GRPOFlow")[run_id]
    report = run["evaluate"].task.data.eval_report
    mlflow_run = run["start"].task.data.mlflow_run_id
    client = mlflow.MlflowClient("sqlite:///mlflow.db")
    curve = {}
    for artifact in client.list_artifacts(mlflow_run, "eval_during/per_prompt"):
        path = client.download_artifacts(mlflow_run, artifact.path, str(workdir / "tables"))
        table = json.loads(Path(path).read_text())
        column = table["columns"].index("pass@1")
        curve[int(Path(artifact.path).stem.removeprefix("step_"))] = [row[column] for row in table["data"]]
    def mean(metric: str) -> float:  # over the steps after the first (it warms up)
        values = [m.value for m in sorted(client.get_metric_history(mlflow_run, metric), key=lambda m: m.step)][1:]
        return statistics.fmean(values) if values else float("nan")

    return {"base": report["baseline"]["per_prompt"]["pass@1"], "trained": report["trained"]["per_prompt"]["pass@1"],
            "curve": curve, "step_time": mean("step_time"), "teacher_wait": mean("distill/teacher_wait_seconds"),
            "teacher_seconds": mean("distill/teacher_seconds")}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % Student-t interval."""
    from scipy import stats

    mean = statistics.fmean(values)
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 \
        else float("nan")
    return mean, half


def arm_result(arm: str, seed: int, args, workdir: Path) -> dict:
    """One arm's :func:`run_result` at training seed ``seed``, run unless ``workdir/<arm>-seed<seed>.json`` holds it."""
    saved = workdir / f"{arm}-seed{seed}.json"
    if not saved.exists():
        started = time.monotonic()
        config = arm_config(arm, seed, args.steps, args.every, args.teacher, workdir)
        result = run_result(run_flow(config, workdir), workdir)
        saved.write_text(json.dumps({**result, "seconds": time.monotonic() - started}))
        print(f"[bench] {arm} seed {seed}: {(time.monotonic() - started) / 60:.1f} min", flush=True)
    result = json.loads(saved.read_text())
    result["curve"] = {int(step): values for step, values in result["curve"].items()}  # JSON keys are strings
    return result


def main(argv: list[str] | None = None) -> None:
    from grpo_steps.evaluation.stats import paired_gain

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--arms", default="grpo,distill,privileged")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42], help="train.seed of each run (the data seed, "
                        "and with it the held-out split, stays the config's); the arms pair by seed and prompt")
    parser.add_argument("--teacher", default="models:/grpo-smollm2-arithmetic@champion")
    parser.add_argument("--workdir", default="bench-distill")
    parser.add_argument("--teacher-run", help="the Metaflow run id (in --workdir) of the run that registered the "
                        "teacher: its evaluate step's trained policy is the teacher on the same split, so no teacher "
                        "run is made")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    results = {(arm, seed): arm_result(arm, seed, args, workdir) for seed in args.seeds for arm in arms}
    teacher = run_result(args.teacher_run, workdir)["trained"] if args.teacher_run else \
        arm_result("teacher-eval", args.seeds[0], args, workdir)["base"]
    goal = 0.9 * statistics.fmean(teacher)
    steps = sorted(set.intersection(*(set(r["curve"]) for r in results.values())))

    def pooled(arm: str, step: int) -> list[float]:  # per-prompt pass@1 over the seeds, seed by seed
        return [p for seed in args.seeds for p in results[arm, seed]["curve"][step]]

    print(f"| step | arm | held-out pass@1 over {len(args.seeds)} seed(s) (95 %) | per seed | gain over grpo (paired "
          "by seed and prompt, 95 %) |\n|---|---|---|---|---|")
    for step in steps:
        for arm in arms:
            mean, half = interval(pooled(arm, step))
            seeds = " / ".join(f"{statistics.fmean(results[arm, seed]['curve'][step]):.3f}" for seed in args.seeds)
            gain = "" if arm == "grpo" or "grpo" not in arms else "{:+.3f} ± {:.3f}".format(
                *paired_gain(pooled("grpo", step), pooled(arm, step)))
            print(f"| {step} | {arm} | {mean:.3f} ± {half:.3f} | {seeds} | {gain} |")
    mean, half = interval(teacher)
    print(f"\nteacher pass@1 {mean:.3f} ± {half:.3f}; 90 % of it: {goal:.3f} ({len(teacher)} held-out prompts)")
    for arm in arms:
        for seed in args.seeds:
            result = results[arm, seed]
            reached = [s for s in steps if statistics.fmean(result["curve"][s]) >= goal]
            print(f"{arm} seed {seed}: reaches 90 % of the teacher at step "
                  f"{reached[0] if reached else f'none of {steps}'}; mean step time {result['step_time']:.1f} s; "
                  f"whole run {result['seconds'] / 60:.1f} min")
            wait = result.get("teacher_wait", float("nan"))
            if wait == wait:  # the teacher's part of the step, within the run (the arms may see different loads)
                print(f"  the step waited {wait:.2f} s for the teacher (its request {result['teacher_seconds']:.2f} "
                      f"s): +{wait / (result['step_time'] - wait):.0%} over the step without it")


if __name__ == "__main__":
    main()
