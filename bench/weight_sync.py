"""Benchmark: one ``disk`` weight push on one local vLLM server, three arms alternating so all see the same load:

- ``save_pretrained``: the first design, ``save_pretrained`` into one reused directory + vLLM's ``reload_weights``;
- ``vllm reload``: safetensors into a new ``/dev/shm`` directory (from the third push an older push's file rewritten
  in place) + vLLM's ``reload_weights`` + the tied-head handle rebuild (``load_tensors(direct=False)``);
- ``direct``: the same files, each CPU GEMM handle made straight from the file (``load_tensors``, the default).

Each push is followed by the trainer's check (version label + the server's probe, :func:`check_served_version`); the
policy's own probe, which runs only when TRL's first-batch check cannot, is timed separately.

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
    from grpo_steps.servers.client import VLLMClient
    from grpo_steps.servers.local import start_local
    from grpo_steps.training.generation.disk import DiskTransport
    from grpo_steps.training.generation.push import (
        ProbeRecord,
        check_served_version,
        mean_abs_diff,
    )
    from grpo_steps.training.sampling import policy_logprobs
    from grpo_steps.weights.files import save_weights, weights_fingerprint

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
    arms = {"vllm reload": DiskTransport(client, scratch / "vllm", direct=False),
            "direct": DiskTransport(client, scratch / "direct")}
    rows: dict[str, dict[str, list[float]]] = {name: {} for name in ["save_pretrained", *arms]}
    policy_probe: list[float] = []
    probe_diff: list[float] = []
    history: list[ProbeRecord] = []
    version = 0

    def add(arm: str, **seconds: float) -> None:
        for key, value in seconds.items():
            rows[arm].setdefault(key, []).append(value)

    try:
        for push_index in range(args.pushes + 1):
            warm = push_index > 0
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-4)
            start = time.perf_counter()
            save_weights(model, scratch / "before")
            written = time.perf_counter()
            client.reload_weights(scratch / "before", direct=False)
            if warm:
                add("save_pretrained", write=written - start, reload=time.perf_counter() - written)
            for arm, push in arms.items():
                start = time.perf_counter()
                state_dict = model.state_dict()
                weights = weights_fingerprint(state_dict)
                parts = push.push(state_dict, version, model=model)
                pushed = time.perf_counter()
                record = ProbeRecord(version, weights, client.prompt_logprobs(probe))
                check_served_version(record, history, client.weight_version(), 0.05, step=version + 1)
                history = (history + [record])[-4:]
                done = time.perf_counter()
                version += 1
                if warm:
                    add(arm, write=parts["write_seconds"], reload=parts["reload_seconds"], verify=done - pushed,
                        total=done - start)
                if push.direct:  # the policy probe: only when the first-batch check is off
                    probe_start = time.perf_counter()
                    policy = policy_logprobs(model, probe)
                    if warm:
                        policy_probe.append(time.perf_counter() - probe_start)
                        probe_diff.append(mean_abs_diff(record.served, policy))
    finally:
        handle.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    med = {arm: {k: statistics.median(v) for k, v in parts.items()} for arm, parts in rows.items()}
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, model {args.model}, {args.pushes} pushes per arm (medians, s)\n")
    print("| path | write | reload | verify (label + server probe) | total |")
    print("|---|---|---|---|---|")
    for arm, m in med.items():
        total = m.get("total", m["write"] + m["reload"])
        print(f"| {arm} | {m['write']:.3f} | {m['reload']:.3f} | {m.get('verify', float('nan')):.3f} | {total:.3f} |")
    print(f"\npolicy probe (only with the first-batch check off): {statistics.median(policy_probe):.3f} s; "
          f"probe mean |server - policy| logp after a direct push: {statistics.median(probe_diff):.2e} nats/token")


if __name__ == "__main__":
    main()
