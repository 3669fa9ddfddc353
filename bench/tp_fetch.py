"""Benchmark: host memory and S3 bytes of one tensor-parallel server's workers fetching an anchor of the weight chain
(issue 56), each worker its own copy (``own``, as before grpo_steps/weights/shared_copy.py) against one copy shared by
the server (``shared``: rank 0 fetches into ``/dev/shm``, the others map it and check every tensor's BLAKE3).

    .venv/bin/python bench/tp_fetch.py [--ranks 2] [--dtype bfloat16] [--model embedded:SmolLM2-135M-Instruct]

The model is published as an anchor on a local SeaweedFS; ``--ranks`` fresh processes in a gloo group (as vLLM's
tensor-parallel workers are) then fetch it, once per mode, running the same functions the vLLM worker runs (the load
into vLLM itself is not part of it). Each worker samples its own ``/proc/self/status`` every 5 ms: private memory
(``RssAnon``) above what it held before, and the shared pages it maps (``RssShmem``). The host's extra memory is the
sum of the workers' private peaks plus the shared file once (a page of ``/dev/shm`` is one page however many map it).
Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path


def _status(field: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(f"{field}:"))


def _worker(rank: int, ranks: int, out: str, mode: str, store: dict, layout: dict) -> None:
    import torch.distributed as dist

    from grpo_steps.weights.chain import LocalCopy, WeightChain, make_client
    from grpo_steps.weights.shared_copy import share_setup, share_version

    dist.init_process_group("gloo", init_method=f"file://{out}/store-{mode}", rank=rank, world_size=ranks)
    group = dist.new_group(backend="gloo")
    chain = WeightChain(make_client(store["endpoint_url"]), store["bucket"], store["prefix"])
    chain.versions()  # the client's first request made, before the baseline
    shared = share_setup(group, layout)[0] if mode == "shared" else None
    copy = LocalCopy(tensors=dict(shared.tensors)) if shared is not None and rank == 0 else LocalCopy()
    dist.barrier(group)
    before, peaks, done = _status("RssAnon"), {"anon": 0, "shmem": 0}, threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peaks["anon"] = max(peaks["anon"], _status("RssAnon"))
            peaks["shmem"] = max(peaks["shmem"], _status("RssShmem"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()

    def fetch() -> bytes:
        chain.fetch(store["version"], copy, sha256=store["sha256"], layout=layout)
        return copy.manifest

    if shared is None:
        fetch()
    else:
        share_version(group, shared, fetch if rank == 0 else None, version=store["version"], sha256=store["sha256"],
                      prefix=chain.prefix, layout=layout)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peaks["anon"] = max(peaks["anon"], _status("RssAnon"))
    dist.barrier(group)  # every rank measured before any lets go of the shared copy
    with open(f"{out}/{mode}-{rank}.json", "w") as f:
        json.dump({"anon": peaks["anon"] - before, "shmem": peaks["shmem"], "seconds": seconds,
                   "bytes_read": chain.bytes_read if shared is None or rank == 0 else 0}, f)
    dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    from grpo_steps.dev import local_s3
    from grpo_steps.models import resolve_model
    from grpo_steps.weights.chain import make_client
    from grpo_steps.weights.files import checkpoint_state_dict
    from grpo_steps.weights.publisher import ChainPublisher

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=getattr(torch, args.dtype))
    state = checkpoint_state_dict(model.state_dict(), model)
    layout = {n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in state.items()}
    scratch = Path(tempfile.mkdtemp(prefix="grpo-bench-tp-", dir="/dev/shm"))
    s3 = local_s3.start(scratch / "s3")
    try:
        for name, value in s3.env().items():
            if name.startswith("AWS_"):
                os.environ[name] = value
        writer = ChainPublisher(make_client(s3.endpoint), s3.bucket, "tp")
        stats = writer.publish(state, 1)
        del model, state
        store = {"endpoint_url": s3.endpoint, "bucket": s3.bucket, "prefix": "tp", "version": 1,
                 "sha256": stats.sha256}
        rows = []
        for mode in ("own", "shared"):
            mp.start_processes(_worker, args=(args.ranks, str(scratch), mode, store, layout), nprocs=args.ranks,
                               start_method="spawn")
            seen = [json.loads((scratch / f"{mode}-{r}.json").read_text()) for r in range(args.ranks)]
            shared = stats.raw_bytes if mode == "shared" else 0  # the /dev/shm file, counted once
            host = sum(s["anon"] for s in seen) + shared

            def per_rank(key: str, seen=seen) -> str:
                return " / ".join(f"{s[key] / 1e6:.0f}" for s in seen)

            rows.append(f"| {mode} | {per_rank('anon')} | {per_rank('shmem')} | {shared / 1e6:.0f} | "
                        f"**{host / 1e6:.0f} MB ({host / stats.raw_bytes:.2f}x)** | {per_rank('bytes_read')} | "
                        f"{max(s['seconds'] for s in seen):.2f} |")
        print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, load average "
              f"{os.getloadavg()[0]:.1f}: {args.ranks} ranks, model {stats.raw_bytes / 1e6:.0f} MB in {args.dtype}, "
              f"anchor {stats.bytes / 1e6:.0f} MB\n")
        print("| copy | private peak extra per rank, MB | shared pages mapped per rank, MB | /dev/shm file, MB | "
              "host extra | S3 bytes read per rank, MB | fetch, s (slowest rank) |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    finally:
        local_s3.stop(s3)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
