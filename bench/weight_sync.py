"""Benchmark: one ``disk`` weight push, before (``save_pretrained`` into one reused directory + reload) and after
(safetensors into a new ``/dev/shm`` directory, from the third push an older push's file rewritten in place + reload +
CPU GEMM refresh of a tied head + version label + probe check), alternating on one local vLLM server so both see the
same machine load.

    .venv/bin/python bench/weight_sync.py [--model embedded:SmolLM2-135M-Instruct] [--pushes 8]

Each push first moves the policy's weights a little (as an optimizer step does). Prints a Markdown table of
medians (seconds) for docs/benchmarks.md; the first push of each arm (warm-up) is left out.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_steps.config import ServerConfig
    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.models import resolve_model
    from grpo_steps.processes import ProcessRef
    from grpo_steps.servers.local import start_local
    from grpo_steps.trainer import policy_logprobs
    from grpo_steps.weight_sync import (
        DiskWeightPush,
        ProbeRecord,
        VLLMClient,
        check_served_version,
        save_weights,
    )

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--pushes", type=int, default=8)
    args = parser.parse_args()
    model_path = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    probe = encode_prompt(tokenizer, to_prompt("Calculate 4 + 4.", "Solve the problem."))[:16]
    handle = start_local(model_path, ServerConfig(kv_cache_gib=1, startup_timeout_s=600), max_model_len=512,
                         dtype="float32", owner=ProcessRef.of(os.getpid()))
    client = VLLMClient(handle.endpoint)
    scratch = Path(tempfile.mkdtemp(prefix="grpo-bench-sync-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    push = DiskWeightPush(client, scratch / "after")
    rows: dict[str, list[float]] = {k: [] for k in ("before_write", "before_reload", "before_total", "after_write",
                                                    "after_reload", "after_verify", "after_total", "probe_diff")}
    history: list[ProbeRecord] = []
    try:
        for version in range(args.pushes + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-4)
            start = time.perf_counter()
            save_weights(model, scratch / "before")  # the old path: one directory, save_pretrained extras
            written = time.perf_counter()
            client.reload_weights(scratch / "before")
            done = time.perf_counter()
            if version:
                rows["before_write"].append(written - start)
                rows["before_reload"].append(done - written)
                rows["before_total"].append(done - start)
            start = time.perf_counter()
            parts = push.push(model.state_dict(), version, model=model)
            pushed = time.perf_counter()
            record = ProbeRecord(version, policy_logprobs(model, probe), client.prompt_logprobs(probe))
            check_served_version(record, history, client.weight_version(), 0.05, step=version + 1)
            history = (history + [record])[-4:]
            done = time.perf_counter()
            if version:
                rows["after_write"].append(parts["write_seconds"])
                rows["after_reload"].append(parts["reload_seconds"])
                rows["after_verify"].append(done - pushed)
                rows["after_total"].append(done - start)
                gap = sum(abs(a - b) for a, b in zip(record.served, record.policy, strict=True))
                rows["probe_diff"].append(gap / len(record.policy))
    finally:
        handle.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, model {args.model}, {args.pushes} pushes per arm (medians, s)\n")
    print("| path | write | reload | verify | total |")
    print("|---|---|---|---|---|")
    print(f"| before: `save_pretrained` + reload | {med['before_write']:.2f} | {med['before_reload']:.2f} | - | "
          f"{med['before_total']:.2f} |")
    print(f"| after: new dir (older push rewritten in place) + reload + check | {med['after_write']:.2f} | "
          f"{med['after_reload']:.2f} | {med['after_verify']:.2f} | {med['after_total']:.2f} |")
    print(f"\nprobe mean |server - policy| logp after a push: {med['probe_diff']:.2e} nats/token")


if __name__ == "__main__":
    main()
