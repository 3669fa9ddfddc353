"""Benchmark: ``train.curriculum`` against TRL's uniform order at equal optimizer steps, over seeds (issue 73).

    .venv/bin/python bench/curriculum.py [--config configs/arithmetic2.yaml] [--seeds 7 42 1234] [--steps 24]
        [--workdir bench-curriculum] [--curriculum '{"pass_reward": "answer_accuracy"}']
    smoke (the tiny model, a few minutes): --config configs/test.yaml --seeds 1 --steps 2

Each (seed, arm) is the whole flow as a user runs it (``python flows/grpo_flow.py --config config RUN.yaml run`` in a
scratch directory of its own: its own Metaflow datastore and ``mlflow.db``), the arms differing only in
``train.curriculum`` (``train.seed`` = the seed; the data, the eval split and every other key as in ``--config``).
Prints, as Markdown for docs/benchmarks.md: per seed and arm the held-out pass@1 of the trained policy; the paired
gain curriculum - uniform over (seed, held-out prompt) pairs with its 95 % interval
(:func:`grpo_steps.evaluation.stats.paired_gain`); and per optimizer step the share of groups without signal (TRL's
``frac_reward_zero_std``), mean over seeds per arm, with the paired difference over seeds and its interval. The
issue's goal: the same held-out pass@1 in at most 70 % of the steps, or a higher one at equal steps with an
interval above zero. Run it alone on the machine: each flow run starts a generation server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

RESULTS = """
import json
from metaflow import Flow, namespace
namespace(None)
run = Flow("GRPOFlow").latest_successful_run
report = run["evaluate"].task.data.eval_report
print(json.dumps({"mlflow_run_id": run["start"].task.data.mlflow_run_id,
                  "pass@1": report["trained"]["per_prompt"]["pass@1"]}))
"""
"""Read in the run's directory (the Metaflow client finds the local datastore there): the trained policy's held-out
pass@1 per prompt (eval split order, the same for every arm) and the MLflow run."""


def run_arm(config: dict, workdir: Path) -> dict:
    """Run the flow on ``config`` in ``workdir``; returns the held-out pass@1 per prompt and the per-step
    ``frac_reward_zero_std`` (optimizer step -> share)."""
    from mlflow import MlflowClient

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
    result["seconds"] = time.monotonic() - started
    return result


def main() -> None:
    from grpo_steps.evaluation.stats import paired_gain

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "arithmetic2.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 42, 1234])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--workdir", default="bench-curriculum")
    parser.add_argument("--curriculum", default='{"pass_reward": "answer_accuracy"}',
                        help="train.curriculum of the curriculum arm, as JSON")
    args = parser.parse_args()
    base = yaml.safe_load(Path(args.config).read_text())
    base.setdefault("module_dirs", [str(Path(args.config).resolve().parent)])  # rewards beside the config
    arms = {"uniform": None, "curriculum": json.loads(args.curriculum)}
    results: dict[tuple[str, int], dict] = {}
    for seed in args.seeds:
        for arm, curriculum in arms.items():
            config = json.loads(json.dumps(base))
            config.setdefault("train", {}).update(seed=seed, max_steps=args.steps, curriculum=curriculum)
            config["train"]["save_steps"] = min(config["train"].get("save_steps", args.steps), args.steps)
            result = results[arm, seed] = run_arm(config, Path(args.workdir).resolve() / f"{arm}-seed{seed}")
            print(f"[bench] {arm} seed {seed}: pass@1 {sum(result['pass@1']) / len(result['pass@1']):.3f} "
                  f"({result['seconds']:.0f} s)", flush=True)

    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"{Path(args.config).name}, {args.steps} steps, seeds {args.seeds}\n")
    print("| seed | uniform pass@1 | curriculum pass@1 |")
    print("|---|---|---|")
    for seed in args.seeds:
        cells = [sum(results[arm, seed]["pass@1"]) / len(results[arm, seed]["pass@1"]) for arm in arms]
        print(f"| {seed} | {cells[0]:.3f} | {cells[1]:.3f} |")
    before = [p for seed in args.seeds for p in results["uniform", seed]["pass@1"]]
    after = [p for seed in args.seeds for p in results["curriculum", seed]["pass@1"]]
    gain, half = paired_gain(before, after)
    print(f"\nheld-out pass@1, curriculum - uniform (paired over {len(before)} seed x prompt pairs): "
          f"{gain:+.3f} ± {half:.3f} (95 %)\n")
    print("| step | zero-signal share, uniform | curriculum | curriculum - uniform (paired over seeds, 95 %) |")
    print("|---|---|---|---|")
    steps = sorted(set.intersection(*[set(r["zero_signal"]) for r in results.values()]))
    for step in steps:
        shares = {arm: [results[arm, seed]["zero_signal"][step] for seed in args.seeds] for arm in arms}
        diff, width = paired_gain(shares["uniform"], shares["curriculum"])
        print(f"| {step} | {sum(shares['uniform']) / len(args.seeds):.3f} | "
              f"{sum(shares['curriculum']) / len(args.seeds):.3f} | {diff:+.3f} ± {width:.3f} |")


if __name__ == "__main__":
    main()
