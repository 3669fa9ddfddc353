"""Benchmark: bytes per S3 weight push through the checked chain (:mod:`grpo_steps.weights.chain`), anchor vs sparse
delta, in fp32 (as served here) and the same weights cast to bf16, over consecutive optimizer steps of a real training
run; seconds per publish and per fetch+apply; and the encodings compared (XOR+zstd at two levels, index/value pairs).

    .venv/bin/python bench/weight_delta.py [--config configs/local.yaml] [--steps 30] [--states DIR]

1. Collect: the training entry (``python -m grpo_steps.training``'s ``run``) on ``--config`` with the generation
   server as ``make run`` starts it, for ``--steps`` steps; a callback writes the policy's weights as served (tied
   weights once, :func:`grpo_steps.weights.files.checkpoint_state_dict`) after every optimizer step into ``--states``
   (kept there; reused when it already holds them).
2. Measure: a local SeaweedFS S3 server (:mod:`grpo_steps.dev.local_s3`); per dtype, every state published in order
   (``anchor_every`` 10, each committed), a follower fetching each version into its local copy, and a late joiner
   fetching the last version from its anchor.

Prints Markdown tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def collect(config: str, steps: int, out: Path) -> list[Path]:
    """Run ``steps`` training steps and write ``out/step-NNN.safetensors`` (0: the weights before the first step)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, TrainerCallback

    from grpo_steps.config import load_config
    from grpo_steps.data import prepare
    from grpo_steps.models import resolve_model
    from grpo_steps.processes import ProcessRef
    from grpo_steps.servers.local import start_local
    from grpo_steps.training import entry
    from grpo_steps.training.job import TrainJob
    from grpo_steps.weights.files import checkpoint_state_dict

    class SaveWeights(TrainerCallback):
        def save_weights(self, step: int, model) -> None:
            save_file(checkpoint_state_dict(model.state_dict(), model), out / f"step-{step:03d}.safetensors")

        def on_train_begin(self, args, state, control, model=None, **_):
            self.save_weights(0, model)

        def on_step_end(self, args, state, control, model=None, **_):
            self.save_weights(state.global_step, model)

    base = load_config(config)
    cfg = base.model_validate({**base.model_dump(),
                               "train": {**base.train.model_dump(), "max_steps": steps, "save_steps": 10_000},
                               "eval": {**base.eval.model_dump(), "every_steps": 0}})
    model_path = resolve_model(cfg.model.name_or_path)
    rows = prepare(cfg.data, AutoTokenizer.from_pretrained(model_path)).train
    pipeline_callbacks = entry.callbacks

    def with_saver(*args, **kwargs):  # the pipeline's own callbacks, plus the one that keeps each step's weights
        first, of_trainer = pipeline_callbacks(*args, **kwargs)
        return [*first, SaveWeights()], of_trainer

    entry.callbacks = with_saver
    server = start_local(model_path, cfg.generation.server, max_model_len=cfg.model.max_model_len,
                         dtype=cfg.model.dtype, owner=ProcessRef.of(os.getpid()))
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-bench-") as work:
            train_file = Path(work) / "train.jsonl"
            train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
            entry.run(TrainJob(config=cfg, model_path=model_path, train_file=str(train_file), output_dir=work,
                               server={"provider": "external", "endpoint": server.endpoint}))
    finally:
        server.stop()
        entry.callbacks = pipeline_callbacks
    return sorted(out.glob("step-*.safetensors"))


def encodings(pairs: list[tuple[dict, dict]]) -> dict[str, list[float]]:
    """Bytes of each (previous, next) state pair's delta under each encoding, as a fraction of the raw tensor bytes
    (no S3)."""
    import torch
    import zstandard

    from grpo_steps.weights.chain import _int_view

    sizes: dict[str, list[float]] = {"xor+zstd-1": [], "xor+zstd-3": [], "index/value": [], "index/value+zstd-1": []}
    z1, z3 = zstandard.ZstdCompressor(level=1), zstandard.ZstdCompressor(level=3)
    for prev, cur in pairs:
        totals, raw = dict.fromkeys(sizes, 0), 0
        for name, t in cur.items():
            a, b = _int_view(prev[name].reshape(-1)), _int_view(t.reshape(-1))
            xor = torch.bitwise_xor(a, b)
            data = xor.view(torch.uint8).numpy().tobytes()
            totals["xor+zstd-1"] += len(z1.compress(data))
            totals["xor+zstd-3"] += len(z3.compress(data))
            where = torch.nonzero(xor).reshape(-1).to(torch.int32)  # int32 positions: tensors under 2**31 elements
            pairs = where.numpy().tobytes() + b[where.long()].view(torch.uint8).numpy().tobytes()
            totals["index/value"] += len(pairs)
            totals["index/value+zstd-1"] += len(z1.compress(pairs))
            raw += t.numel() * t.element_size()
        for k in sizes:
            sizes[k].append(totals[k] / raw)
    return sizes


def measure(files: list[Path], dtype, s3) -> dict:
    """Publish every state into a fresh prefix, a follower fetching each; returns per-push stats and timings."""
    import torch
    from safetensors.torch import load_file

    from grpo_steps.weights.chain import LocalCopy, WeightChain, make_client
    from grpo_steps.weights.publisher import ChainPublisher

    client = make_client(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key)
    prefix = f"bench/{str(dtype).removeprefix('torch.')}-{time.time_ns()}"
    writer = ChainPublisher(client, s3.bucket, prefix, anchor_every=10, dtype=dtype)
    reader, follower = WeightChain(client, s3.bucket, prefix), LocalCopy()
    pushes = []
    for version, path in enumerate(files, start=1):
        state = load_file(path)
        stats = writer.publish(state, version)
        writer.commit(version)
        start = time.perf_counter()
        got = reader.fetch(version, into=follower)
        fetch_s = time.perf_counter() - start
        assert all(torch.equal(got[k], v.to(dtype)) for k, v in state.items())
        pushes.append((stats, fetch_s))
    start = time.perf_counter()
    reader.fetch(len(files))  # a late joiner: replays from the newest anchor
    late_s, depth = time.perf_counter() - start, len(reader.lineage(len(files)))
    writer.delete_prefix()
    return {"pushes": pushes, "late_s": late_s, "late_depth": depth}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--states", default="/tmp/grpo-weight-delta-states", help="where the steps' weights are kept")
    parser.add_argument("--encoding-every", type=int, default=3,
                        help="compare the encodings on every Nth step's delta (fp32 index/value pairs are slow)")
    args = parser.parse_args()
    import torch
    from safetensors.torch import load_file

    from grpo_steps.dev import local_s3

    out = Path(args.states)
    files = sorted(out.glob("step-*.safetensors"))
    if len(files) < args.steps + 1:
        out.mkdir(parents=True, exist_ok=True)
        collect_start = time.perf_counter()
        files = collect(args.config, args.steps, out)
        print(f"collected {len(files)} states in {time.perf_counter() - collect_start:.0f} s")
    files = files[: args.steps + 1]
    results, shares = {}, {}
    with tempfile.TemporaryDirectory(prefix="grpo-bench-s3-") as data:
        s3 = local_s3.start(data)
        try:
            for dtype in (torch.float32, torch.bfloat16):
                results[dtype] = measure(files, dtype, s3)
        finally:
            local_s3.stop(s3)
    first = load_file(files[0])
    params = sum(t.numel() for t in first.values())
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, config {args.config}, "
          f"{len(files) - 1} optimizer steps (+ the weights before the first), {params / 1e6:.1f} M parameters, "
          f"anchor every 10 versions, zstd level 1\n")
    print("| dtype | raw, MB | anchor, MB (mean) | delta, MB (median / max) | delta / anchor (median / max) | "
          "changed elements (median) | publish anchor / delta, s | fetch+apply delta, s | late join (versions), s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype, r in results.items():
        anchors = [s for s, _ in r["pushes"] if s.anchor]
        deltas = [(s, f) for s, f in r["pushes"] if not s.anchor]
        anchor_mb = statistics.fmean(s.bytes for s in anchors) / 1e6
        delta_mb = [s.bytes / 1e6 for s, _ in deltas]
        ratio = [m / anchor_mb for m in delta_mb]
        print(f"| {str(dtype).removeprefix('torch.')} | {anchors[0].raw_bytes / 1e6:.1f} | {anchor_mb:.1f} | "
              f"{statistics.median(delta_mb):.2f} / {max(delta_mb):.2f} | "
              f"{100 * statistics.median(ratio):.1f} % / {100 * max(ratio):.1f} % | "
              f"{100 * statistics.median(s.density for s, _ in deltas):.2f} % | "
              f"{statistics.median(s.seconds for s in anchors):.2f} / "
              f"{statistics.median(s.seconds for s, _ in deltas):.2f} | "
              f"{statistics.median(f for _, f in deltas):.2f} | {r['late_s']:.2f} ({r['late_depth']}) |")
    for dtype, r in results.items():
        print(f"\n{str(dtype).removeprefix('torch.')}, MB per push in order (A: anchor): "
              + ", ".join(f"{'A ' if s.anchor else ''}{s.bytes / 1e6:.2f}" for s, _ in r["pushes"]))
    for dtype in (torch.float32, torch.bfloat16):
        steps = range(1, len(files), args.encoding_every)
        shares[dtype] = encodings([tuple({k: v.to(dtype) for k, v in load_file(files[i + d]).items()} for d in (-1, 0))
                                   for i in steps])
    print(f"\nencodings on the deltas of steps {list(steps)}:")
    print("\n| dtype | delta bytes / raw bytes (median over steps): " + " | ".join(shares[torch.float32]) + " |")
    print("|---|" + "---|" * len(shares[torch.float32]))
    for dtype, sizes in shares.items():
        print(f"| {str(dtype).removeprefix('torch.')} | "
              + " | ".join(f"{100 * statistics.median(v):.2f} %" for v in sizes.values()) + " |")


if __name__ == "__main__":
    main()
