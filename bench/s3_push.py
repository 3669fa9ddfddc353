"""Benchmark: seconds per verified weight push, ``disk`` against ``s3`` (issue 47), on 1 or 2 local vLLM replicas.

Both arms load through vLLM's weight-update protocol (:class:`grpo_steps.vllm_worker.PipelineTransferEngine`) and are
verified as the trainer verifies (every replica's label and probe, :func:`check_served_version`), alternating push by
push so both see the same load:

- ``disk``: :class:`grpo_steps.training.generation.disk.DiskTransport` (safetensors in ``/dev/shm``);
- ``s3``: :class:`grpo_steps.training.generation.s3.ChainTransport` on a local SeaweedFS (an anchor every
  ``--anchor-every`` versions, XOR+zstd deltas in between), split into anchor and delta pushes.

    .venv/bin/python bench/s3_push.py [--replicas 1] [--pushes 8] [--anchor-every 4] [--dtype float32] [--changed F]
    .venv/bin/python bench/s3_push.py --digests    # the per-tensor checksum's cost per push, no server (issue 56)
    .venv/bin/python bench/s3_push.py --fetch-rss [--chain-file OLD.py]  # a replica's peak RSS fetching an anchor

Each push first moves every weight a little (``randn * 1e-4``, as an optimizer step moves them: in float32 nearly
every element changes, in bfloat16 ~15 % do); with ``--changed F`` only a random fraction ``F`` of the elements
moves, each by 2 ** -7 of itself (1-2 bfloat16 ulps): ``--changed 0.014`` is the median step of ``make run`` in
bfloat16 (bench/weight_delta.py, docs/benchmarks.md). Prints a Markdown table of medians (seconds; ``changed``: the
share of elements whose bits changed) for docs/benchmarks.md; the first push of each arm (warm-up) is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def digests(model_path: str, threads: int, repeats: int = 3) -> None:
    """Print the seconds one push spends on per-tensor checksums (the publisher's pass plus one replica's, each over
    every tensor on ``threads`` threads, as :meth:`grpo_steps.weights.publisher.ChainPublisher.publish` and ``fetch``
    run them), per algorithm, for the model in bfloat16 and float32 (median of ``repeats``)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    import blake3
    import torch
    import xxhash
    from transformers import AutoModelForCausalLM

    from grpo_steps.weights.manifest import tensor_bytes

    algorithms = {"xxh3_128": xxhash.xxh3_128, "blake3": blake3.blake3, "sha256": hashlib.sha256,
                  "blake2b": hashlib.blake2b}
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, {threads} threads, median of {repeats}\n")
    print("| dtype | MB | " + " | ".join(f"{a}, s/push" for a in algorithms) + " |")
    print("|---|---|" + "---|" * len(algorithms))
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        tensors = [t.detach().contiguous() for t in model.state_dict().values()]
        size = sum(t.numel() * t.element_size() for t in tensors)
        cells = []
        with ThreadPoolExecutor(threads) as pool:
            for fn in algorithms.values():
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(2):  # the publisher's pass and one replica's
                        list(pool.map(lambda t, fn=fn: fn(tensor_bytes(t)).hexdigest(), tensors))
                    times.append(time.perf_counter() - start)
                cells.append(f"{statistics.median(times):.3f}")
        print(f"| {str(dtype).removeprefix('torch.')} | {size / 1e6:.0f} | " + " | ".join(cells) + " |")


_FETCH = """
import importlib.util, resource, sys, time
path, endpoint, bucket, prefix, version, digest = sys.argv[1:7]
spec = importlib.util.spec_from_file_location("chain_under_test", path)
chain = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = chain  # dataclasses look their module up there
spec.loader.exec_module(chain)
import torch, zstandard, blake3, boto3  # imported before the baseline: what a server has loaded already
reader = chain.WeightChain(chain.make_client(endpoint), bucket, prefix)
reader.versions()  # the client's first request made, before the baseline
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
before = rss()
start = time.perf_counter()
copy = chain.LocalCopy()
kwargs = {"sha256": digest} if "sha256" in chain.WeightChain.fetch.__code__.co_varnames else {}
reader.fetch(int(version), copy, **kwargs)
# VmHWM: this process's own peak (ru_maxrss keeps the forking parent's across exec)
hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(before, hwm, rss(), time.perf_counter() - start)
"""


def fetch_rss(model_path: str, dtype_name: str, chain_file: str | None) -> None:
    """Publish the model as an anchor on a local SeaweedFS, then fetch it in a fresh process with the chain module at
    ``chain_file`` (default: this tree's) and print the fetch's peak extra resident memory against the model's
    serving size (the copy's own tensors included)."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.dev import local_s3
    from grpo_steps.weights import chain as weight_chain
    from grpo_steps.weights.files import checkpoint_state_dict

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype_name))
    scratch = Path(tempfile.mkdtemp(prefix="grpo-bench-rss-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    s3 = local_s3.start(scratch / "s3")
    try:
        env = {**os.environ, **s3.env()}
        for name, value in s3.env().items():
            if name.startswith("AWS_"):
                os.environ[name] = value
        from grpo_steps.weights.publisher import ChainPublisher

        writer = ChainPublisher(weight_chain.make_client(s3.endpoint), s3.bucket, "rss")
        stats = writer.publish(checkpoint_state_dict(model.state_dict(), model), 1)
        file = chain_file or weight_chain.__file__
        out = subprocess.run([sys.executable, "-c", _FETCH, file, s3.endpoint, s3.bucket, "rss", "1", stats.sha256],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"the fetch failed: {out.stderr[-2000:]}")
        out = out.stdout.split()
        before, peak, after, seconds = int(out[0]), int(out[1]), int(out[2]), float(out[3])
        print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, load average "
              f"{os.getloadavg()[0]:.1f}, {Path(file).name}: model {stats.raw_bytes / 1e6:.0f} MB in {dtype_name}, "
              f"anchor {stats.bytes / 1e6:.0f} MB; fetch {seconds:.2f} s; peak extra RSS "
              f"{(peak - before) / 1e6:.0f} MB = {(peak - before) / stats.raw_bytes:.2f}x the model; after "
              f"{(after - before) / 1e6:.0f} MB")
    finally:
        local_s3.stop(s3)
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_steps.config import ServerConfig
    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.dev import local_s3
    from grpo_steps.models import resolve_model
    from grpo_steps.processes import ProcessRef
    from grpo_steps.servers.client import VLLMClient
    from grpo_steps.servers.local import start_local
    from grpo_steps.training.generation.disk import DiskTransport
    from grpo_steps.training.generation.push import ProbeRecord, check_served_version
    from grpo_steps.training.generation.s3 import ChainTransport
    from grpo_steps.weights.files import weights_fingerprint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--pushes", type=int, default=8)
    parser.add_argument("--anchor-every", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--changed", type=float, default=None,
                        help="fraction of elements moved per push (default: all, by randn * 1e-4)")
    parser.add_argument("--digests", action="store_true",
                        help="only the per-tensor checksums' cost per push, per algorithm (no server)")
    parser.add_argument("--fetch-rss", action="store_true",
                        help="only a replica's peak RSS while it fetches an anchor (no server)")
    parser.add_argument("--chain-file", default=None, help="with --fetch-rss: another weights/chain.py to measure")
    args = parser.parse_args()
    if args.fetch_rss:
        fetch_rss(resolve_model(args.model), args.dtype, args.chain_file)
        return
    if args.digests:
        digests(resolve_model(args.model), threads=min(8, os.cpu_count() or 1))
        return
    if args.changed is not None and not 0 < args.changed <= 1:
        parser.error(f"--changed must be in (0, 1], got {args.changed}")
    model_path = resolve_model(args.model)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    probe = encode_prompt(tokenizer, to_prompt("Calculate 4 + 4.", "Solve the problem."))[:16]
    scratch = Path(tempfile.mkdtemp(prefix="grpo-bench-s3-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    s3 = local_s3.start(scratch / "s3")
    for name, value in s3.env().items():  # the servers fetch with these (their environment), and so does the trainer
        if name.startswith("AWS_"):
            os.environ[name] = value
    handles = []
    try:
        for _ in range(args.replicas):
            handles.append(start_local(model_path, ServerConfig(kv_cache_gib=1, startup_timeout_s=900),
                                       max_model_len=512, dtype=args.dtype, owner=ProcessRef.of(os.getpid())))
        endpoints = tuple(h.endpoint for h in handles)
        client = VLLMClient(endpoints[0], replicas=endpoints if len(endpoints) > 1 else ())
        store = {"bucket": s3.bucket, "prefix": "weight-sync/bench", "endpoint_url": s3.endpoint}
        arms = {"disk": DiskTransport(client, scratch / "disk"),
                "s3": ChainTransport(client, store, dtype=dtype, anchor_every=args.anchor_every)}
        rows: dict[str, dict[str, list[float]]] = {}
        history: dict[str, list[ProbeRecord]] = {}
        version = 0
        for push_index in range(args.pushes + 1):
            with torch.no_grad():
                for p in model.parameters():
                    if args.changed is None:
                        p.add_(torch.randn_like(p) * 1e-4)
                    else:
                        moved = torch.rand(p.shape) < args.changed
                        p.add_(torch.where(moved, p * torch.randn_like(p).sign() * 2 ** -7, 0))
            for arm, push in arms.items():
                start = time.perf_counter()
                state_dict = model.state_dict()
                weights = weights_fingerprint(state_dict)
                parts = push.push(state_dict, version, model=model)
                pushed = time.perf_counter()
                for replica in client.replica_clients():
                    record = ProbeRecord(version, weights, replica.prompt_logprobs(probe))
                    check_served_version(record, history.get(replica.endpoint, []), push.served_label(replica),
                                         0.05, step=version + 1)
                    history[replica.endpoint] = (history.get(replica.endpoint, []) + [record])[-4:]
                if hasattr(push, "committed"):
                    push.committed(version)
                done = time.perf_counter()
                version += 1
                if push_index == 0:
                    continue
                name = arm if arm == "disk" else f"s3 {'anchor' if parts['anchor'] else 'delta'}"
                row = rows.setdefault(name, {})
                for key, value in (("write", parts["write_seconds"]), ("load", parts["reload_seconds"]),
                                   ("verify", done - pushed), ("total", done - start),
                                   ("MB", parts.get("bytes", float("nan")) / 1e6),
                                   ("changed", parts.get("density", float("nan"))),
                                   ("fetch", parts.get("fetch_seconds", float("nan")))):
                    row.setdefault(key, []).append(value)
        arms["s3"].close()
        arms["disk"].close()
    finally:
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.stop()
        local_s3.stop(s3)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, model {args.model} in {args.dtype}, {args.replicas} replica(s), "
          f"{args.pushes} pushes per arm, anchor every {args.anchor_every}, "
          f"{'all elements moved' if args.changed is None else f'{args.changed:.1%} of elements moved'} (medians)\n")
    print("| push | n | written, MB | changed | publish / write, s | fetch (in load), s | load (all replicas), s | "
          "verify, s | total, s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        med = {k: statistics.median(v) for k, v in row.items()}
        print(f"| {name} | {len(row['total'])} | {med['MB']:.1f} | {med['changed']:.2%} | {med['write']:.3f} | "
              f"{med['fetch']:.3f} | "
              f"{med['load']:.3f} | {med['verify']:.3f} | {med['total']:.3f} |")
    disk = statistics.median(rows["disk"]["total"])
    for name in ("s3 anchor", "s3 delta"):
        if name in rows:
            print(f"\n{name} / disk (total): {statistics.median(rows[name]['total']) / disk:.2f}")


if __name__ == "__main__":
    main()
