"""Benchmark: checkpoint save+upload time and resume time-to-first-step, local and S3 datastores.

    .venv/bin/python bench/checkpoint_resume.py [--config configs/local.yaml] [--datastores local s3]

For each datastore: runs the flow on the config (default model) for 4 steps with a checkpoint every
2 steps and a small evaluation, kills the training process with SIGKILL after checkpoint 2, then
runs ``resume`` and times it. The S3 datastore is a local SeaweedFS server on 127.0.0.1 (the same
code path as AWS S3, without the network). Prints a Markdown table for docs/benchmarks.md.

Columns: checkpoint size (the trainer's ``checkpoint-N`` directory: weights, optimizer, scheduler,
RNG, trainer state), ``save`` (wall seconds of ``Checkpoint.save`` into the datastore, mean over the
saves), ``resume -> first step`` (from launching ``resume`` to the first optimizer step of the resumed
training, which includes starting a new vLLM server, downloading the checkpoint and loading it).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.integration.flowrun import SAVED, flow_env, run_config, run_flow  # noqa: E402

SECONDS = re.compile(r"\[checkpoint\] saved step=\d+ node=0 pid=\d+ seconds=([\d.]+)")
FIRST_STEP = re.compile(r"\[train\] step (\d+)/")
RESUMED_AT = re.compile(r"resuming from step (\d+)")


def _config(path: str, **tracking) -> dict:
    config = yaml.safe_load(Path(path).read_text()) or {}
    config.setdefault("train", {}).update(max_steps=4, save_steps=2, save_total_limit=2, retries=0)
    config.setdefault("data", {}).update(num_eval=8)
    config.setdefault("eval", {}).update(num_samples=2, k=[1, 2])
    config.setdefault("tracking", {}).update(tracking)
    return config


def measure(config_path: str, datastore: str) -> dict:
    from grpo_steps.dev import local_s3

    with tempfile.TemporaryDirectory(prefix=f"grpo-bench-ckpt-{datastore}-") as tmp:
        workdir = Path(tmp)
        server = local_s3.start(workdir / "s3") if datastore == "s3" else None
        try:
            env = flow_env(**(server.env() if server else {}))
            tracking = {"artifact_location": f"s3://{server.bucket}/mlflow"} if server else {}
            killed, first_at = [], {}

            def kill_after_first_checkpoint(line: str) -> None:
                match = SAVED.search(line)
                if match and not killed:
                    os.kill(int(match.group(2)), signal.SIGKILL)
                    killed.append(line)

            code, first = run_config(workdir, env, _config(config_path, **tracking), kill_after_first_checkpoint)
            assert killed and code != 0, first[-4000:]
            started = time.monotonic()

            def first_step(line: str) -> None:
                if FIRST_STEP.search(line) and "t" not in first_at:
                    first_at["t"] = time.monotonic() - started

            code, resumed = run_flow(workdir, env, ["resume"], first_step)
            assert code == 0 and RESUMED_AT.search(resumed), resumed[-4000:]
            saves = [float(s) for s in SECONDS.findall(first + resumed)]
            return {"datastore": datastore, "save_s": statistics.fmean(saves), "saves": len(saves),
                    "resume_to_first_step_s": first_at["t"], "total_resume_s": time.monotonic() - started}
        finally:
            local_s3.stop(server)


def checkpoint_size_mb(config_path: str) -> float:
    """Size of one trainer checkpoint of the config's model: weights + AdamW state (2 x weights, fp32)."""
    from grpo_steps.config import load_config
    from grpo_steps.models import resolve_model

    model_dir = Path(resolve_model(load_config(config_path).model.name_or_path))
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return 3 * weights / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "local.yaml"))
    parser.add_argument("--datastores", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    args = parser.parse_args()
    rows = [measure(args.config, d) for d in args.datastores]
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, config {args.config}, "
          f"checkpoint ~{checkpoint_size_mb(args.config):.0f} MiB (weights + AdamW state, estimated)\n")
    print("| datastore | save + upload, s (mean of saves) | resume -> first step, s | whole resume, s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['datastore']} | {r['save_s']:.1f} ({r['saves']} saves) | {r['resume_to_first_step_s']:.1f} "
              f"| {r['total_resume_s']:.1f} |")


if __name__ == "__main__":
    main()
