"""Benchmark: the loss's training pass (forward + backward + AdamW step) of a GRPO batch with each distinct prompt
forwarded once (``grpo_steps.training.shared_prefix``) against TRL's whole-row forward, full fine-tuning and LoRA.

    .venv/bin/python bench/shared_prefix.py [--model embedded:SmolLM2-135M-Instruct] [--prompts 2]
        [--generations 8] [--prompt-tokens 59] [--completion-tokens 10,48,6/48] [--repeats 4]

The batch is ``make run``'s shape: 2 prompts x 8 completions, prompts of 59 tokens (configs/local.yaml's system
prompt and a problem), completions of 10 tokens (most steps) and 48 (the limit the first steps reach), and ``6/48``:
one completion of 48 tokens, the others of 6, right-padded to 48 (an early step where one completion ran to the
limit; there the shared prefix is measured with its rows in one group and in length groups,
``shared_prefix.length_groups``), random token ids, TRL's fused LM head on the model (as ``GRPOTrainer`` adds it).
Prints a Markdown table (medians after the first
repeat, seconds) and the largest |difference| of the two arms' log-probabilities, for docs/benchmarks.md.
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
    from trl.trainer.utils import add_fused_lm_head

    from grpo_steps.models import resolve_model
    from grpo_steps.training import shared_prefix

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:SmolLM2-135M-Instruct")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=59)
    parser.add_argument("--completion-tokens", default="10,48,6/48")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    path = resolve_model(args.model)
    rng = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 20000, (args.prompts, args.prompt_tokens), generator=rng)

    def whole_rows(model, ids, mask, keep):  # TRL 1.16's _get_per_token_logps_and_entropies, one chunk
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-keep] = -100
        return model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]

    def shared(model, ids, mask, keep):
        return shared_prefix.logps_and_entropies(model, ids, mask, keep)[0]

    def one_group(model, ids, mask, keep):  # every row padded to the longest completion
        saved, shared_prefix.MIN_PADDING_SAVED = shared_prefix.MIN_PADDING_SAVED, 2.0
        try:
            return shared(model, ids, mask, keep)
        finally:
            shared_prefix.MIN_PADDING_SAVED = saved

    rows = []
    for lora in (False, True):
        for spec in args.completion_tokens.split(","):
            short, _, long = spec.rpartition("/")
            length = int(long)
            completions = torch.randint(100, 20000, (args.prompts * args.generations, length), generator=rng)
            ids = torch.cat([prompts.repeat_interleave(args.generations, 0), completions], dim=1)
            mask = torch.ones_like(ids)
            arms = [("whole rows (TRL)", whole_rows), ("shared prefix", shared)]
            if short:  # every row but the first stops after `short` tokens
                mask[1:, args.prompt_tokens + int(short):] = 0
                arms = [arms[0], ("shared prefix, one group", one_group), ("shared prefix, length groups", shared)]
            results = {}
            for name, score in arms:
                model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
                add_fused_lm_head(model, outputs=("log_probs", "entropy"))
                if lora:
                    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
                model.train()
                optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
                seconds = []
                for repeat in range(args.repeats):
                    start = time.perf_counter()
                    logps = score(model, ids, mask, length)
                    (logps * mask[:, -length:]).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    seconds.append(time.perf_counter() - start)
                    if repeat == 0:
                        results[name] = logps.detach() * mask[:, -length:]
                rows.append(("LoRA r 16" if lora else "full", spec, name, statistics.median(seconds[1:])))
            gap = max((results["whole rows (TRL)"] - logps).abs().max().item() for logps in results.values())
            rows.append(("LoRA r 16" if lora else "full", spec, "max |logp difference|, nats", gap))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, {args.model}, {args.prompts} prompts x {args.generations} "
          f"completions, prompts of {args.prompt_tokens} tokens\n")
    print("| training | completion tokens | arm | forward + backward + AdamW, s |")
    print("|---|---:|---|---:|")
    for kind, length, arm, value in rows:
        print(f"| {kind} | {length} | {arm} | {value:.3g} |")


if __name__ == "__main__":
    main()
