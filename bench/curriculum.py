"""Benchmark: ``train.curriculum`` against TRL's uniform order at equal optimizer steps, over seeds (issue 73).

    .venv/bin/python bench/curriculum.py [--config configs/arithmetic2.yaml] [--seeds 7 42 1234] [--steps 24]
        [--workdir bench-curriculum] [--curriculum '{"pass_reward": "answer_accuracy"}']
        [--override '{"data": {"num_eval": 100}, "eval": {"every_steps": 2, "during_training_prompts": 100}}']
        [--report-only]
    smoke (the tiny model, a few minutes): --config configs/test.yaml --seeds 1 --steps 2

Each finished (seed, arm) is kept in ``WORKDIR/<arm>-seed<seed>/result.json``: the same command run again skips it,
and ``--report-only`` prints the tables over the seeds whose two arms finished (a benchmark stopped at a deadline).

Each (seed, arm) is the whole flow as a user runs it (``python flows/grpo_flow.py --config config RUN.yaml run`` in a
scratch directory of its own: its own Metaflow datastore and ``mlflow.db``), the arms differing only in
``train.curriculum`` (``train.seed`` = the seed; the data, the eval split and every other key as in ``--config``,
with ``--override``'s sections merged in, key by key, for both arms).
Prints, as Markdown for docs/benchmarks.md: per seed and arm the held-out pass@1 of the trained policy; the paired
gain curriculum - uniform over (seed, held-out prompt) pairs with its 95 % interval
(:func:`grpo_steps.evaluation.stats.paired_gain`); with ``eval.every_steps`` (the per-prompt tables of the evaluations
during training) the same per evaluated step, and the first step where the curriculum reaches uniform's pass@1 at the
last one; and per optimizer step the share of groups without signal (TRL's
``frac_reward_zero_std``), mean over seeds per arm, with the paired difference over seeds and its interval. The
issue's goal: the same held-out pass@1 in at most 70 % of the steps, or a higher one at equal steps with an
interval above zero. Run it alone on the machine: each flow run starts a generation server, and a 48-completion step
of arithmetic2 peaks at ~9 GiB in the trainer (``--override '{"train": {"per_device_train_batch_size": 8,
"gradient_accumulation_steps": 6}}'`` trains the same 48 per optimizer step in micro-batches of 8).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ARMS = ("uniform", "curriculum")

RESULTS = """
import json
from metaflow import Flow, namespace
namespace(None)
run = Flow("GRPOFlow").latest_successful_run
report = run["evaluate"].task.data.eval_report
print(json.dumps({"mlflow_run_id": run["start"].task.data.mlflow_run_id,
                  "pass@1": report["trained"]["per_prompt"]["pass@1"],
                  "baseline pass@1": report["baseline"]["per_prompt"]["pass@1"]}))
"""
"""Read in the run's directory (the Metaflow client finds the local datastore there): the trained policy's and the
base policy's held-out pass@1 per prompt (eval split order, the same for every arm) and the MLflow run."""


def run_arm(config: dict, workdir: Path) -> dict:
    """Run the flow on ``config`` in ``workdir``; returns the held-out pass@1 per prompt and the per-step
    ``frac_reward_zero_std`` (optimizer step -> share), also kept in ``workdir/result.json``: an arm whose file
    exists (and whose config is the same) is not run again, so a stopped benchmark continues, and
    ``--report-only`` reports the pairs that finished."""
    from mlflow import MlflowClient

    saved = workdir / "result.json"
    if saved.exists() and yaml.safe_load((workdir / "run.yaml").read_text()) == config:
        return json.loads(saved.read_text())
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "METAFLOW_USER": "grpo-bench", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    started = time.monotonic()
    with open(workdir / "flow.log", "w") as log:
        subprocess.run([sys.executable, str(REPO / "flows" / "grpo_flow.py"), "--config", "config", "run.yaml", "run"],
                       cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    result = json.loads(subprocess.run([sys.executable, "-c", RESULTS], cwd=workdir, env=env, check=True,
                                       capture_output=True, text=True).stdout.strip().splitlines()[-1])
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    history = client.get_metric_history(result["mlflow_run_id"], "frac_reward_zero_std")
    result["zero_signal"] = {m.step: m.value for m in history}
    result["curve"] = {}  # with eval.every_steps: held-out pass@1 per prompt at each evaluated step
    for artifact in client.list_artifacts(result["mlflow_run_id"], "eval_during/per_prompt"):
        table = json.loads(Path(client.download_artifacts(result["mlflow_run_id"], artifact.path,
                                                          str(workdir / "tables"))).read_text())
        column = table["columns"].index("pass@1")
        result["curve"][int(Path(artifact.path).stem.removeprefix("step_"))] = [row[column] for row in table["data"]]
    result["seconds"] = time.monotonic() - started
    saved.write_text(json.dumps(result))
    return json.loads(saved.read_text())  # optimizer steps as the JSON keys they are when read back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "arithmetic2.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 42, 1234])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--workdir", default="bench-curriculum")
    parser.add_argument("--curriculum", default='{"pass_reward": "answer_accuracy"}',
                        help="train.curriculum of the curriculum arm, as JSON")
    parser.add_argument("--override", default="{}",
                        help="config keys set in both arms, as JSON merged into --config section by section")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: report the (seed, arm) runs of --workdir that finished")
    args = parser.parse_args()
    base = yaml.safe_load(Path(args.config).read_text())
    for section, keys in json.loads(args.override).items():
        base.setdefault(section, {}).update(keys)
    base.setdefault("module_dirs", [str(Path(args.config).resolve().parent)])  # rewards beside the config
    arms = dict(zip(ARMS, (None, json.loads(args.curriculum)), strict=True))
    results: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:
        for arm, curriculum in arms.items():
            workdir = Path(args.workdir).resolve() / f"{arm}-seed{seed}"
            if args.report_only:
                if (workdir / "result.json").exists():
                    results[arm, seed] = json.loads((workdir / "result.json").read_text())
                continue
            config = json.loads(json.dumps(base))
            config.setdefault("train", {}).update(seed=seed, max_steps=args.steps, curriculum=curriculum)
            config["train"]["save_steps"] = min(config["train"].get("save_steps", args.steps), args.steps)
            result = results[arm, seed] = run_arm(config, workdir)
            print(f"[bench] {arm} seed {seed}: pass@1 {statistics.fmean(result['pass@1']):.3f} "
                  f"({result['seconds']:.0f} s)", flush=True)
    report(results, [seed for seed in args.seeds if all((arm, seed) in results for arm in arms)], args)


def report(results: dict[tuple[str, int], dict], seeds: list[int], args) -> None:
    """Print the Markdown tables over the seeds whose two arms finished."""
    from grpo_steps.evaluation.stats import paired_gain

    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"{Path(args.config).name}, {args.steps} steps, seeds finished {seeds} of {args.seeds}, "
          f"override {args.override}, curriculum {args.curriculum}\n")
    if not seeds:
        return
    print("| seed | base pass@1 | uniform pass@1 | curriculum pass@1 | zero-signal share, uniform (mean over steps) "
          "| curriculum | wall time, uniform / curriculum |")
    print("|---|---|---|---|---|---|---|")
    for seed in seeds:
        uniform, curriculum = results["uniform", seed], results["curriculum", seed]
        print(f"| {seed} | {statistics.fmean(uniform['baseline pass@1']):.3f} "
              f"| {statistics.fmean(uniform['pass@1']):.3f} | {statistics.fmean(curriculum['pass@1']):.3f} "
              f"| {statistics.fmean(uniform['zero_signal'].values()):.3f} "
              f"| {statistics.fmean(curriculum['zero_signal'].values()):.3f} "
              f"| {uniform['seconds'] / 60:.1f} / {curriculum['seconds'] / 60:.1f} min |")
    before = [p for seed in seeds for p in results["uniform", seed]["pass@1"]]
    after = [p for seed in seeds for p in results["curriculum", seed]["pass@1"]]
    gain, half = paired_gain(before, after)
    print(f"\nheld-out pass@1, curriculum - uniform (paired over {len(before)} seed x prompt pairs): "
          f"{gain:+.3f} ± {half:.3f} (95 %)")
    means = {arm: [statistics.fmean(results[arm, seed]["zero_signal"].values()) for seed in seeds] for arm in ARMS}
    diff, width = paired_gain(means["uniform"], means["curriculum"])
    print(f"zero-signal share over all steps, curriculum - uniform (paired over {len(seeds)} seeds): "
          f"{diff:+.3f} ± {width:.3f} (95 %)\n")
    curve_report(results, seeds)
    print("| step | zero-signal share, uniform | curriculum | curriculum - uniform (paired over seeds, 95 %) |")
    print("|---|---|---|---|")
    steps = sorted(set.intersection(*[set(results[arm, seed]["zero_signal"]) for arm in ARMS
                                      for seed in seeds]), key=int)
    for step in steps:
        shares = {arm: [results[arm, seed]["zero_signal"][step] for seed in seeds] for arm in ARMS}
        diff, width = paired_gain(shares["uniform"], shares["curriculum"])
        print(f"| {step} | {statistics.fmean(shares['uniform']):.3f} | {statistics.fmean(shares['curriculum']):.3f} "
              f"| {diff:+.3f} ± {width:.3f} |")


def curve_report(results: dict[tuple[str, int], dict], seeds: list[int]) -> None:
    """With evaluations during training (``eval.every_steps``, the per-prompt tables ``eval_during/per_prompt``):
    held-out pass@1 per evaluated step and arm over the seeds, the paired gain at each step, and the first step where
    the curriculum reaches uniform's pass@1 at its last step (the issue's goal: at most 70 % of the steps)."""
    from grpo_steps.evaluation.stats import paired_gain

    curves = {key: {int(step): values for step, values in result.get("curve", {}).items()}
              for key, result in results.items()}
    steps = sorted(set.intersection(*[set(curves[arm, seed]) for arm in ARMS for seed in seeds]))
    if not steps:
        return

    def pooled(arm: str, step: int) -> list[float]:
        return [p for seed in seeds for p in curves[arm, seed][step]]

    print("| step | held-out pass@1, uniform | curriculum | curriculum - uniform (paired over seed x prompt, 95 %) |")
    print("|---|---|---|---|")
    for step in steps:
        diff, width = paired_gain(pooled("uniform", step), pooled("curriculum", step))
        print(f"| {step} | {statistics.fmean(pooled('uniform', step)):.3f} "
              f"| {statistics.fmean(pooled('curriculum', step)):.3f} | {diff:+.3f} ± {width:.3f} |")
    target = statistics.fmean(pooled("uniform", steps[-1]))
    reached = [step for step in steps if statistics.fmean(pooled("curriculum", step)) >= target]
    print(f"\nthe curriculum reaches uniform's pass@1 at step {steps[-1]} ({target:.3f}) at step "
          f"{reached[0] if reached else 'none'} ({reached[0] / steps[-1]:.0%} of the steps)\n" if reached else
          f"\nthe curriculum does not reach uniform's pass@1 at step {steps[-1]} ({target:.3f})\n")


if __name__ == "__main__":
    main()
