"""Benchmark: asynchronous GRPO (``generation.async``) against synchronous, each in a CPU layout (which cores the
server and the trainer get), at the same settings (model, prompts, batch, completion length).

    .venv/bin/python bench/async_step_time.py [--config configs/local.yaml] [--steps 11] [--completion-tokens 128]
        [--arms sync,async-split,async-shared] [--max-staleness 1] [--system-prompt TEXT]

Arms: ``sync`` (generation and training alternate, both on every core), ``sync-split`` (alternate, server on core 0
and trainer on core 1), ``async-split`` (overlapped, server on core 0, trainer on core 1: the layout of disaggregated
GPUs), ``async-shared`` (overlapped, both on every core); both async arms push in flight
(``generation.async.in_flight``, the default), and ``async-split-drain`` / ``async-shared-drain`` are the same with
``in_flight: false`` (each push waits for the producer's request in flight). Each arm starts its own server. The
first step (warm-up, and in async the batch nobody sampled ahead) is left out.

Prints a Markdown table for docs/benchmarks.md: step time (TRL's ``step_time``: generation, or the wait for it,
scoring, forward and backward of a step), wall time of the steps after the first, the trainer's wait per step
(``generation/wait_seconds``: sync, the whole generation; async, what of the batch was not sampled yet; plus
``weight_sync/drain_seconds``, async, the producer's request in flight before a push, and the push itself), mean
staleness, and the step-time ratio of each arm to ``sync``.

GPU version: the same script with ``--config`` a GPU config, ``--arms sync,async-shared`` (the core layouts are
CPU-only) and ``--endpoint`` the URL of a vLLM server you started on a GPU of its own (it must read this machine's
``generation.sync_dir``): trainer and generator on separate GPUs, with the same ``disk`` pushes.
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

from grpo_steps.config import load_config
from grpo_steps.data import prepare
from grpo_steps.models import resolve_model
from grpo_steps.processes import ProcessRef
from grpo_steps.servers.local import start_local
from grpo_steps.training.entry import run
from grpo_steps.training.job import TrainJob

WORKED_STEPS = ("Solve the problem. Think step by step and write out every intermediate result, then end your reply "
                "with a final line of the form 'Answer: <number>'.")
"""A system prompt under which SmolLM2 writes long completions (the default one gets ~6-token answers)."""

ARMS = {  # name: (async, server cores, trainer cores, pushes in flight)
    "sync": (False, None, None, False),
    "sync-split": (False, [0], [1], False),
    "async-split": (True, [0], [1], True),
    "async-shared": (True, None, None, True),
    "async-split-drain": (True, [0], [1], False),
    "async-shared-drain": (True, None, None, False),
}


def _train(cfg, model_path: str, rows: list[dict], endpoint: str) -> tuple[list[dict], float]:
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as out:
        train_file = Path(out) / "train.jsonl"
        train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        run(TrainJob(config=cfg, model_path=model_path, train_file=str(train_file), output_dir=out,
                     server={"provider": "external", "endpoint": endpoint}))
        logs = json.loads((Path(out) / "log_history.json").read_text())
        runtime = next(h["train_runtime"] for h in logs if "train_runtime" in h)
        return [h for h in logs if "step_time" in h], runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--completion-tokens", type=int, default=128)
    parser.add_argument("--arms", default="sync,async-split,async-shared", help=f"comma-separated, of {list(ARMS)}")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--system-prompt", default=WORKED_STEPS)
    parser.add_argument("--endpoint", help="a vLLM server you started (GPU): no local server, no core layout")
    args = parser.parse_args()
    base = load_config(args.config)
    model_path = resolve_model(base.model.name_or_path)
    from transformers import AutoTokenizer

    data = {**base.data.model_dump(), "system_prompt": args.system_prompt}
    base = base.model_validate({**base.model_dump(), "data": data})
    rows = prepare(base.data, AutoTokenizer.from_pretrained(model_path)).train
    results = {}
    for arm in args.arms.split(","):
        overlapped, server_cores, trainer_cores, in_flight = ARMS[arm]
        gen = base.generation.model_dump()
        gen.update(max_completion_tokens=args.completion_tokens,
                   server={**gen["server"], "cpu_cores": server_cores},
                   **{"async": {"max_staleness": args.max_staleness, "in_flight": in_flight} if overlapped else None})
        train = {**base.train.model_dump(), "max_steps": args.steps, "save_steps": 10_000, "cpu_cores": trainer_cores}
        cfg = base.model_validate({**base.model_dump(), "generation": gen, "train": train,
                                   "eval": {**base.eval.model_dump(), "every_steps": 0}})
        server = None if args.endpoint else start_local(
            model_path, cfg.generation.server, max_model_len=cfg.model.max_model_len, dtype=cfg.model.dtype,
            owner=ProcessRef.of(os.getpid()))
        try:
            started = time.perf_counter()
            history, runtime = _train(cfg, model_path, rows, args.endpoint or server.endpoint)
            results[arm] = (history, runtime, time.perf_counter() - started)
        finally:
            if server is not None:
                server.stop()
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, config {args.config}, "
          f"{args.steps} steps (first left out), max {args.completion_tokens} completion tokens, "
          f"max_staleness {args.max_staleness}\n")
    print("| arm | async | server cores | trainer cores | step time, s (mean of steps 2..) | trainer wait, s/step "
          "| wait share | staleness (mean, max) | token staleness mean | spanning share | generation idle share "
          "| completion length, tokens | train runtime, s | ratio to sync |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    reference = None
    for arm, (history, runtime, _) in results.items():
        overlapped, server_cores, trainer_cores, _ = ARMS[arm]
        later = history[1:]
        step = statistics.fmean(h["step_time"] for h in later)
        reference = reference or (step if arm == "sync" else None)
        # the trainer's wait: for the generation batch (sync: the whole request; async: what was not sampled yet),
        # for the producer's request in flight before a push (async), and the push itself
        wait = statistics.fmean(h["generation/wait_seconds"] + h.get("weight_sync/drain_seconds", 0.0)
                                + h.get("weight_sync/seconds", 0.0) for h in later)
        stale = [h.get("async/staleness", 0.0) for h in later]
        stale_text = f"{statistics.fmean(stale):.2f}, {max(stale):.0f}"
        length = statistics.fmean(h["completions/mean_length"] for h in later)
        ratio = f"{step / reference:.2f}" if reference else "-"

        def mean(name: str, fmt: str, later=later) -> str:
            values = [h[name] for h in later if name in h]
            return format(statistics.fmean(values), fmt) if values else "-"

        print(f"| {arm} | {'yes' if overlapped else 'no'} | {server_cores or 'all'} | {trainer_cores or 'all'} | "
              f"{step:.2f} | {wait:.2f} | {wait / step:.0%} | {stale_text} | "
              f"{mean('async/token_staleness_mean', '.2f')} | {mean('async/spanning_share', '.0%')} | "
              f"{mean('async/generation_idle_share', '.0%')} | {length:.1f} | {runtime:.0f} | {ratio} |")


if __name__ == "__main__":
    main()
