"""Benchmark: three continual runs in a row on the embedded model, from the registry's champion (issue 71).

    .venv/bin/python bench/continual.py [--config configs/continual.yaml] [--workdir bench-continual]
        [--base embedded:SmolLM2-135M-Instruct] [--override '{"train": {"max_steps": 4}}']
    smoke (the tiny model, minutes): --base embedded:tiny-random-qwen2 --override '{"train": {"max_steps": 2},
        "data": {"num_eval": 8}, "eval": {"num_samples": 1}}'

The loop of docs/continual.md as a user runs it, in one folder (one Metaflow datastore, one ``mlflow.db``):

1. ``--config`` with ``model.name_or_path`` set to ``--base`` (the first version, docs/continual.md step 1);
2. ``--config`` as shipped: from ``models:/<name>@champion``, ``data.skip_seen``;
3. the same again: with no rows new to the chain it ends after ``prepare_data``.

Between runs, when a run's gate did not move ``champion`` to its version, the script moves it there, as a reviewer
would, and prints that it did (the gate's verdict is in the table either way). Prints, as Markdown for
docs/benchmarks.md: per run its exit code, wall time, start version, the baseline's and the trained policy's held-out
pass@1 (the same held-out prompts in every run), rows trained, the version registered with its parent, and the gate's
verdict. Run it alone on the machine: each run starts a generation server.
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


def run_flow(config: dict, workdir: Path, label: str) -> tuple[int, float, str]:
    """``python flows/grpo_flow.py --config config <label>.yaml run`` in ``workdir``: (exit code, seconds, output)."""
    path = workdir / f"{label}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "METAFLOW_USER": "grpo-bench", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    began = time.monotonic()
    out = subprocess.run([sys.executable, str(REPO / "flows" / "grpo_flow.py"), "--config", "config", path.name,
                          "run"], cwd=workdir, env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    (workdir / f"{label}.log").write_text(text)
    return out.returncode, time.monotonic() - began, text


def newest_run(client):
    """The newest MLflow run of the store (every run of the benchmark logs to the config's experiment)."""
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "continual.yaml"))
    parser.add_argument("--workdir", default="bench-continual")
    parser.add_argument("--base", default="embedded:SmolLM2-135M-Instruct", help="the first run's model")
    parser.add_argument("--override", default="{}", help="JSON: sections merged key by key into every run's config")
    args = parser.parse_args(argv)
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    config = yaml.safe_load(Path(args.config).read_text())
    for section, values in json.loads(args.override).items():
        config.setdefault(section, {}).update(values)
    name = config["registry"]["model_name"]
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=False)  # a fresh registry: run 1 must register version 1
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    began, rows = time.monotonic(), []
    for index in (1, 2, 3):
        run_config = json.loads(json.dumps(config))
        if index == 1:
            run_config["model"]["name_or_path"] = args.base
        code, seconds, out = run_flow(run_config, workdir, f"run{index}")
        print(f"run {index}: exit {code} in {seconds:.0f} s", flush=True)
        if code != 0:
            print(out[-4000:])
            return 1
        run = newest_run(client)
        tags, metrics = run.data.tags, run.data.metrics
        versions = [v for v in client.search_model_versions(f"name = '{name}'") if v.run_id == run.info.run_id]
        ended_early = [line for line in out.splitlines() if "nothing to train; the run ends here" in line]
        row = {"run": index, "exit": code, "seconds": round(seconds), "start": tags.get("start.model_uri", args.base),
               "baseline pass@1": metrics.get("eval/baseline/pass_at_1"),
               "trained pass@1": metrics.get("eval/trained/pass_at_1"),
               "ended early": ended_early[0].split("] ", 1)[-1] if ended_early else ""}
        if versions:
            (version,) = versions
            row.update({"version": version.version, "parent": version.tags.get("lineage.parent_version", ""),
                        "rows added": version.tags.get("lineage.rows_added"),
                        "gate passed": version.tags.get("gate.passed"), "gate reason": version.tags.get("gate.reason")})
            try:
                champion = client.get_model_version_by_alias(name, "champion").version
            except MlflowException:
                champion = None
            if str(champion) != str(version.version):
                print(f"run {index}: the gate left champion at {champion}; moving it to version {version.version} "
                      "by hand, as a reviewer would", flush=True)
                client.set_registered_model_alias(name, "champion", version.version)
                row["champion moved by hand"] = True
        rows.append(row)
        print(json.dumps(row), flush=True)
    (workdir / "result.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()} ({os.cpu_count()} cores), "
          f"{time.monotonic() - began:.0f} s for three runs:\n")
    keys = ["run", "exit", "seconds", "start", "baseline pass@1", "trained pass@1", "version", "parent", "rows added",
            "gate passed", "champion moved by hand", "ended early"]
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join("" if row.get(k) is None else str(row.get(k, "")) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
