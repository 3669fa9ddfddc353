"""Benchmark: GRPO step time with vLLM rollouts + disk weight sync against in-process HF generation,
at the same settings (model, prompts, batch, completion length), and the weight-sync time per step.

    .venv/bin/python bench/step_time.py [--config configs/local.yaml] [--steps 6] [--backends vllm,hf]
        [--completion-tokens N] [--system-prompt TEXT] [--correction off] [--scoring-pass loss,trl]

``--completion-tokens`` overrides ``generation.max_completion_tokens``; ``--system-prompt`` replaces the
config's (e.g. one that asks for worked steps, so completions run long: the default config's policy
answers in ~6 tokens, where generation speed hardly shows in the step time). ``--scoring-pass loss,trl`` runs the
``vllm`` backend twice: the mismatch correction weighed from the loss's own forward (``loss``, the pipeline's path,
:mod:`grpo_steps.training.correction`) and with TRL's extra no-grad scoring pass of each batch (``trl``).

Prints Markdown tables for docs/benchmarks.md: step time per backend, and for ``vllm`` the weight sync per
step in its parts (median) and the trainer–inference mismatch (TRL's ``sampling/*`` metrics, mean over steps).
The first step of each backend (warm-up) is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from grpo_steps.config import load_config
from grpo_steps.data import prepare
from grpo_steps.models import resolve_model
from grpo_steps.processes import ProcessRef
from grpo_steps.servers.local import start_local
from grpo_steps.training.entry import run
from grpo_steps.training.job import TrainJob


def _train(cfg, model_path: str, rows: list[dict], endpoint: str | None) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as out:
        train_file = Path(out) / "train.jsonl"
        train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        run(TrainJob(config=cfg, model_path=model_path, train_file=str(train_file), output_dir=out,
                     server={"provider": "external", "endpoint": endpoint}))
        return [h for h in json.loads((Path(out) / "log_history.json").read_text()) if "step_time" in h]


@contextlib.contextmanager
def _scoring_pass(name: str):
    """``trl``: the trainer keeps TRL's no-grad scoring pass (the in-process training sees the correction as not
    applicable); else the pipeline's choice."""
    from grpo_steps.training import correction

    applies = correction.applies
    if name == "trl":
        correction.applies = lambda trainer: False
    try:
        yield
    finally:
        correction.applies = applies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--backends", default="vllm,hf", help="comma-separated, of vllm and hf")
    parser.add_argument("--completion-tokens", type=int, help="generation.max_completion_tokens (default: config)")
    parser.add_argument("--system-prompt", help="data.system_prompt (default: config)")
    parser.add_argument("--correction", help="generation.importance_sampling.mode, e.g. off (default: config)")
    parser.add_argument("--scoring-pass", default="loss",
                        help="vllm backend: comma-separated, of loss (the correction from the loss's forward) and trl "
                             "(TRL's extra no-grad pass)")
    args = parser.parse_args()
    base = load_config(args.config)
    if args.completion_tokens or args.system_prompt:
        gen = {**base.generation.model_dump(), **({"max_completion_tokens": args.completion_tokens}
                                                  if args.completion_tokens else {})}
        data = {**base.data.model_dump(), **({"system_prompt": args.system_prompt} if args.system_prompt else {})}
        base = base.model_validate({**base.model_dump(), "generation": gen, "data": data})
    overrides = {"train": {**base.train.model_dump(), "max_steps": args.steps, "save_steps": 10_000},
                 "eval": {**base.eval.model_dump(), "every_steps": 0}}  # step time only: no evaluation during training
    model_path = resolve_model(base.model.name_or_path)
    from transformers import AutoTokenizer

    rows = prepare(base.data, AutoTokenizer.from_pretrained(model_path)).train
    results = {}
    arms = [(b, pass_) for b in args.backends.split(",")
            for pass_ in (args.scoring_pass.split(",") if b == "vllm" else ["-"])]
    for backend, scoring_pass in arms:
        gen = {**base.generation.model_dump(), "backend": backend}
        if args.correction:  # TRL's mismatch correction costs a no-grad forward over the batch per step
            gen["importance_sampling"] = {**gen["importance_sampling"], "mode": args.correction}
        cfg = base.model_validate({**base.model_dump(), **overrides, "generation": gen})
        server = None
        if backend == "vllm":
            server = start_local(model_path, cfg.generation.server, max_model_len=cfg.model.max_model_len,
                                 dtype=cfg.model.dtype, owner=ProcessRef.of(os.getpid()))
        try:
            start = time.perf_counter()
            with _scoring_pass(scoring_pass):
                history = _train(cfg, model_path, rows, server.endpoint if server else None)
            label = backend if scoring_pass in ("-", "loss") else f"{backend}, TRL's scoring pass"
            results[label] = (history[1:], time.perf_counter() - start)
        finally:
            if server:
                server.stop()
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, config {args.config}, "
          f"{args.steps} steps (first left out), max {base.generation.max_completion_tokens} completion tokens\n")
    print("| backend | step time, s (mean) | weight sync, s/step (mean) | completion length, tokens |")
    print("|---|---|---|---|")
    for backend, (history, _) in results.items():
        sync = [h["weight_sync/seconds"] for h in history if "weight_sync/seconds" in h]
        step = statistics.fmean(h["step_time"] for h in history)
        length = statistics.fmean(h["completions/mean_length"] for h in history)
        sync_text = f"{statistics.fmean(sync):.2f}" if sync else "-"
        print(f"| {backend} | {step:.2f} | {sync_text} | {length:.1f} |")
    if {"hf", "vllm"} <= results.keys():
        ratio = statistics.fmean(h["step_time"] for h in results["hf"][0]) / statistics.fmean(
            h["step_time"] for h in results["vllm"][0])
        print(f"\nhf / vllm step-time ratio: {ratio:.2f}")
    if {"vllm", "vllm, TRL's scoring pass"} <= results.keys():
        ratio = statistics.fmean(h["step_time"] for h in results["vllm"][0]) / statistics.fmean(
            h["step_time"] for h in results["vllm, TRL's scoring pass"][0])
        print(f"\nstep time, the correction from the loss's forward / with TRL's scoring pass: {ratio:.2f}")
    if "vllm" in results:
        history = results["vllm"][0]
        parts = ["gather", "write", "reload", "verify"]
        print("\n| weight sync per step (median of steps 2..), s | " + " | ".join(parts) + " | total |")
        print("|---|" + "---|" * (len(parts) + 1))
        keys = [f"weight_sync/{p}_seconds" for p in parts] + ["weight_sync/seconds"]
        medians = [statistics.median(h[k] for h in history) for k in keys]
        print("| vllm, disk | " + " | ".join(f"{m:.3f}" for m in medians) + " |")
        names = ["sampling_logp_difference/mean", "sampling_logp_difference/max", "importance_sampling_ratio/mean"]
        if all(f"sampling/{names[0]}" in h for h in history):  # --correction off: TRL logs no mismatch
            means = [statistics.fmean(h[f"sampling/{n}"] for h in history) for n in names]
            text = ", ".join(f"{n} {m:.2e}" for n, m in zip(names, means, strict=True))
            print(f"\nmismatch, mean over steps 2..: {text}")


if __name__ == "__main__":
    main()
