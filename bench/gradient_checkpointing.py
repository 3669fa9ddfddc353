"""Benchmark: one training pass (forward + backward + AdamW step) of the policy with and without gradient
checkpointing, full fine-tuning and LoRA, on a fixed batch of random token ids (no TRL, no generation).

    .venv/bin/python bench/gradient_checkpointing.py [--model embedded:SmolLM2-135M-Instruct] [--batch 16]
        [--tokens 90] [--repeats 4]

TRL's ``GRPOConfig`` turns gradient checkpointing on by default (GPU memory); this measures what it costs where
memory is no constraint. Prints a Markdown table (medians after the first repeat, seconds) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time


def main() -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_steps.models import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=90)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    path = resolve_model(args.model)
    ids = torch.randint(100, 20000, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    rows = []
    for lora in (False, True):
        for checkpointing in (True, False):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if lora:
                model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
                if checkpointing:
                    model.enable_input_require_grads()
            model.train()
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                seconds.append(time.perf_counter() - start)
            rows.append(("LoRA r 16" if lora else "full", checkpointing, statistics.median(seconds[1:])))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, {args.model}, batch {args.batch} x {args.tokens} tokens\n")
    print("| training | gradient checkpointing | forward + backward + AdamW, s |")
    print("|---|---|---|")
    for kind, checkpointing, value in rows:
        print(f"| {kind} | {'on (TRL default)' if checkpointing else 'off'} | {value:.2f} |")


if __name__ == "__main__":
    main()
