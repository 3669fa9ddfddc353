"""Benchmark: generation throughput of several replicas behind vLLM's router, the router's overhead, and the push
fan-out (issue 35). Generation only (no trainer), SmolLM2-135M-Instruct, completions of exactly ``--tokens`` tokens
(``ignore_eos``), ``--prompts`` prompts x ``--n`` samples per arm, one request per prompt (as the routed client sends
them), all in flight together:

- ``1 replica, 1 core``; ``2 replicas, 2 cores`` (one core each, behind ``vllm-router``); ``1 replica, 2 cores``;
- ``1 replica direct`` vs ``1 replica through the router`` (the same server, the same per-prompt requests);
- the push: a verified ``disk`` push (write, reload, label, probe on each replica) to one replica vs to two.

    .venv/bin/python bench/replicas.py [--prompts 16] [--n 4] [--tokens 128] [--rounds 2]
    .venv/bin/python bench/replicas.py --endpoints http://gpu-0:8000 http://gpu-1:8000   # servers you run

With ``--endpoints`` (servers started with ``VLLM_SERVER_DEV_MODE=1`` and the same model, e.g. on GPUs) the bench
compares the first server alone with all of them behind a router it starts on this machine (throughput only).
Prints a Markdown table for docs/benchmarks.md (tokens/s: completion tokens per second of wall time, the best of
``--rounds`` rounds after a warm-up round; push: median seconds of 4 pushes after a warm-up push). Each arm's servers
are stopped before the next arm starts.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import yaml


def throughput(client, prompts: list[list[int]], n: int, tokens: int, rounds: int) -> float:
    """Best completion tokens/s over ``rounds`` rounds of all prompts (after one warm-up round)."""
    request = {"ignore_eos": True, "min_tokens": tokens}
    client.complete(prompts[:2], n, max_tokens=tokens, temperature=1.0, request=request)  # warm-up
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        out = client.complete(prompts, n, max_tokens=tokens, temperature=1.0, request=request)
        seconds = time.perf_counter() - start
        best = max(best, sum(len(s["completion_ids"]) for group in out for s in group) / seconds)
    return best


def push_seconds(client, model, probe: list[int], pushes: int = 5) -> float:
    """Median seconds of a verified ``disk`` push (write + reload on every replica + label and probe on each)."""
    import torch

    from grpo_steps.training.generation.disk import DiskTransport
    from grpo_steps.weights.labels import version_label

    root = Path(tempfile.mkdtemp(prefix="grpo-bench-replicas-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    push, times = DiskTransport(client, root), []
    for version in range(pushes):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 1e-4)  # as an optimizer step moves them
        start = time.perf_counter()
        push.push(model.state_dict(), version, model=model)
        labels = client.each(lambda c: (c.weight_version(), c.prompt_logprobs(probe)))
        times.append(time.perf_counter() - start)
        assert all(label == version_label(version) for label, _ in labels), labels
    push.close()  # removes its directory (root) with the last version
    assert not root.exists(), root
    return statistics.median(times[1:])


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_steps import servers
    from grpo_steps.config import REPO_ROOT, validate_config
    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.models import resolve_model
    from grpo_steps.processes import ProcessRef
    from grpo_steps.servers.auth import token_for
    from grpo_steps.servers.client import VLLMClient
    from grpo_steps.servers.router import start_router

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--endpoints", nargs="*", default=None, help="servers you run (skips starting any)")
    args = parser.parse_args()
    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [encode_prompt(tokenizer, to_prompt(f"Calculate {i} + {i + 3}.", "Solve the problem."))
               for i in range(args.prompts)]
    base = yaml.safe_load((REPO_ROOT / "configs" / "local.yaml").read_text())
    base["model"]["name_or_path"] = model_path
    owner = ProcessRef.of(os.getpid())

    def config(**server):
        return validate_config({**base, "generation": {**base.get("generation", {}), "server": {
            "kv_cache_gib": 1, "startup_timeout_s": 900, **server}}})

    def measure(label: str, handle, *, push_model=None) -> dict:
        try:
            client = handle.client()
            row = {"arm": label, "tokens_per_s": throughput(client, prompts, args.n, args.tokens, args.rounds)}
            if push_model is not None:
                row["push_s"] = push_seconds(client, push_model, prompts[0][:16])
            print(row, flush=True)
            return row
        finally:
            handle.stop()

    rows = []
    if args.endpoints:
        cfg = validate_config({**base, "generation": {"provider": "external", "server": {"endpoints": args.endpoints}}})
        direct = servers.ExternalServer(args.endpoints[0])
        rows.append(measure("1 replica (first endpoint)", direct))
        members = [servers.ExternalServer(e) for e in args.endpoints]
        router = start_router(cfg, args.endpoints, owner=owner, token=None)
        rows.append(measure(f"{len(members)} replicas behind the router",
                            servers.ReplicaSet(router.endpoint, replicas=tuple(m.to_dict() for m in members),
                                               router=router.to_dict(), policy="round_robin")))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path)
        one = servers.provision(config(cpu_cores=[0]), model_path, owner=owner, run_id="bench")
        rows.append(measure("1 replica, 1 core", one, push_model=model))
        two = servers.provision(config(replicas=2, cpu_cores=[[0], [1]]), model_path, owner=owner, run_id="bench")
        rows.append(measure("2 replicas, 2 cores, router", two, push_model=model))
        wide = servers.provision(config(cpu_cores=[0, 1]), model_path, owner=owner, run_id="bench")
        try:
            router = start_router(config(replicas=2), [wide.endpoint], owner=owner, token=token_for(wide.endpoint))
            through = servers.ReplicaSet(router.endpoint, replicas=(wide.to_dict(),), router=router.to_dict(),
                                         policy="round_robin")
            direct = VLLMClient(wide.endpoint, replicas=(wide.endpoint,))  # the same per-prompt requests, no router
            rows.append({"arm": "1 replica, 2 cores, direct",
                         "tokens_per_s": throughput(direct, prompts, args.n, args.tokens, args.rounds)})
            print(rows[-1], flush=True)
            rows.append({"arm": "1 replica, 2 cores, through the router",
                         "tokens_per_s": throughput(through.client(), prompts, args.n, args.tokens, args.rounds)})
            print(rows[-1], flush=True)
            router.stop()
        finally:
            wide.stop()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()} ({os.cpu_count()} cores), "
          f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens\n")
    print("| arm | completion tokens/s | verified push, s |\n|---|---|---|")
    for row in rows:
        push = f"{row['push_s']:.2f}" if "push_s" in row else ""
        print(f"| {row['arm']} | {row['tokens_per_s']:.0f} | {push} |")


if __name__ == "__main__":
    main()
