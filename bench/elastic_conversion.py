"""Benchmark: DeepSpeed Universal Checkpoint conversion (``grpo_steps.elastic.to_universal``, run once when a ZeRO-3
checkpoint is resumed on another number of processes): wall time and peak resident memory against checkpoint size.

    .venv/bin/python bench/elastic_conversion.py [--shapes tiny small smollm2] [--processes 2]

For each shape: a random Qwen2 policy of that shape is trained one optimizer step by ``--processes`` processes under
ZeRO-3 on CPU (gloo, torch AdamW, as the training entry runs it) and saved with DeepSpeed's ``save_checkpoint``; then
a fresh process converts the saved ``global_step1/`` with :func:`grpo_steps.elastic.to_universal` while its process
tree's resident memory is sampled (``grpo_steps.processes.run_watching_memory``, every 0.1 s: ds_to_universal extracts
each rank's partition in worker processes). Prints a Markdown table for docs/benchmarks.md: parameters, checkpoint
size (the ZeRO files: fp32 weights + 2 Adam moments + the module's 16/32-bit partitions), conversion seconds, peak
RSS of the conversion (GiB) and its ratio to the checkpoint size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SHAPES = {  # random Qwen2 policies; smollm2: SmolLM2-135M's shape (hidden 576, 30 layers, 49152 tokens)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=16384),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152),
}


def save_one_step(shape: str, out: str) -> None:
    """In each of the launched processes: one ZeRO-3 step of the random policy, saved to ``out`` (collective)."""
    import deepspeed
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the training entry: gloo, no C++ build
    deepspeed.comm.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape], tie_word_embeddings=True))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3}, "steps_per_print": 10**6}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                      config=config)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (1, 16))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")


def measure(shape: str, processes: int, root: Path) -> dict:
    from grpo_steps.processes import run_watching_memory

    out = root / shape
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                           "--master_port", str(29700 + len(shape)), __file__, "--save", shape, str(out)],
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"saving {shape} failed:\n{done.stderr[-3000:]}")
    save_s = time.perf_counter() - started
    size = sum(f.stat().st_size for f in (out / "global_step1").rglob("*") if f.is_file())
    (out / "latest").write_text("global_step1")
    seconds_file = root / f"{shape}.json"
    code, peak = run_watching_memory(
        [sys.executable, "-c", "import json, sys; from grpo_steps.elastic import to_universal; "
         f"json.dump(to_universal({str(out)!r}), open({str(seconds_file)!r}, 'w'))"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, interval_s=0.1)
    if code:
        raise RuntimeError(f"converting {shape} failed with exit code {code}")
    import torch

    fp32 = [torch.load(p / "fp32.pt", weights_only=False) for p in (out / "global_step1_universal" / "zero").iterdir()
            if p.is_dir()]  # a tensor, or {"param": tensor, ...} (ds_to_universal writes either)
    model_params = sum((t["param"] if isinstance(t, dict) else t).numel() for t in fp32)
    return {"shape": shape, "params": model_params, "size": size, "save_s": save_s,
            "convert_s": json.loads(seconds_file.read_text()), "peak": peak}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--save":
        save_one_step(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--processes", type=int, default=2, help="processes that save the ZeRO-3 checkpoint")
    args = parser.parse_args()
    gib = 1024**3
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {now}")
    print("| shape | parameters | ZeRO-3 checkpoint | ranks | conversion, s | peak RSS, GiB | peak / size |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            r = measure(shape, args.processes, Path(tmp))
            print(f"| {shape} | {r['params'] / 1e6:.1f} M | {r['size'] / gib:.3f} GiB | {args.processes} | "
                  f"{r['convert_s']:.1f} | {r['peak'] / gib:.2f} | {r['peak'] / r['size']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
