"""Benchmark: the trainer–inference mismatch at other sampling settings than temperature 1 (issue 24).

    .venv/bin/python bench/sampling_mismatch.py [--config configs/local.yaml] [--steps 30]
        [--settings "temperature=1.0" "temperature=0.7" "temperature=0.7,top_k=50"]

Trains ``--steps`` GRPO steps per setting on the config (default: the embedded SmolLM2-135M task of ``make run``),
each from the base weights, against one local vLLM server (started as the pipeline starts it:
``--logprobs-mode processed_logprobs``), and prints a Markdown table of TRL's mismatch metrics, mean over the steps:
``sampling/sampling_logp_difference/mean`` (|sampler logp - policy logp| per token; the policy's logprobs at the
sampling temperature, without filters), the first-batch check's value (the policy scored under the same filters as
the sampler) and the importance-sampling ratio, the mean shift that put the sampler's logprobs on the policy's
support (``sampling/support_log_mass/mean``, log of the kept mass; set only with filters) and TRL's ``step_time``
(seconds per step, the shift's forwards included). Evaluation during training is turned off.
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

METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "weight_sync/first_batch_logp_diff", "sampling/importance_sampling_ratio/mean",
           "sampling/importance_sampling_ratio/min", "sampling/support_log_mass/mean", "reward", "step_time")


def _setting(text: str) -> dict:
    """``temperature=0.7,top_k=50`` -> ``{"temperature": 0.7, "top_k": 50}``."""
    out = {}
    for part in text.split(","):
        key, value = part.split("=")
        out[key.strip()] = json.loads(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/local.yaml")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--settings", nargs="+", default=["temperature=1.0", "temperature=0.7"])
    args = parser.parse_args()
    base = load_config(args.config)
    model_path = resolve_model(base.model.name_or_path)
    from transformers import AutoTokenizer

    rows = prepare(base.data, AutoTokenizer.from_pretrained(model_path), base.generation.chat_template_kwargs).train
    server = start_local(model_path, base.generation.server, max_model_len=base.model.max_model_len,
                         dtype=base.model.dtype, owner=ProcessRef.of(os.getpid()))
    results = {}
    try:
        for text in args.settings:
            cfg = base.model_validate({
                **base.model_dump(), "generation": {**base.generation.model_dump(), **_setting(text)},
                "train": {**base.train.model_dump(), "max_steps": args.steps, "save_steps": 10_000},
                "eval": {**base.eval.model_dump(), "every_steps": 0}})
            with tempfile.TemporaryDirectory(prefix="grpo-bench-") as out:
                train_file = Path(out) / "train.jsonl"
                train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
                started = time.perf_counter()
                run(TrainJob(config=cfg, model_path=model_path, train_file=str(train_file), output_dir=out,
                             server=server.to_dict()))
                history = [h for h in json.loads((Path(out) / "log_history.json").read_text()) if "reward" in h]
            results[text] = (history, time.perf_counter() - started)
    finally:
        server.stop()
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, {os.cpu_count()} cores, config {args.config}, "
          f"{args.steps} steps per setting, mean over the steps\n")
    print("| setting | " + " | ".join(f"`{m}`" for m in METRICS) + " | wall, s |")
    print("|---|" + "---|" * (len(METRICS) + 1))
    for text, (history, seconds) in results.items():
        cells = []
        for metric in METRICS:
            values = [h[metric] for h in history if h.get(metric) is not None]
            cells.append(f"{statistics.fmean(values):.3g}" if values else "-")
        print(f"| {text} | " + " | ".join(cells) + f" | {seconds:.0f} |")


if __name__ == "__main__":
    main()
