"""What a GRPO step's compute costs against the padded completion length, on the default policy (SmolLM2-135M).

    .venv/bin/python bench/padded_step.py [--reps 3]

TRL pads a generation batch's completions to its longest one, so a step costs what its longest completion costs: in
the first steps of `make run` one completion of 16 reaches `generation.max_completion_tokens` (48) while the mean is
10-23 tokens. This times, alternating the lengths so that a busy machine slows both alike, what the training process
computes per step on 16 sequences of a 59-token prompt (configs/local.yaml's, chat template applied) plus C
completion tokens: TRL's no-grad forward for the importance-sampling correction, then the loss's forward and backward.
Prints the median seconds per length and their ratio to the shortest.
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPT_TOKENS = 59
BATCH = 16


def step_seconds(model, completion_tokens: int) -> float:
    """One no-grad forward plus one forward+backward of BATCH x (PROMPT_TOKENS + completion_tokens) tokens, seconds."""
    import torch

    ids = torch.randint(100, 40000, (BATCH, PROMPT_TOKENS + completion_tokens))
    start = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids)
    model(input_ids=ids).logits[:, PROMPT_TOKENS:].float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[9, 19, 48])
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.models import prepare_embedded

    model = AutoModelForCausalLM.from_pretrained(str(prepare_embedded("SmolLM2-135M-Instruct")), dtype=torch.float32)
    model.train()
    step_seconds(model, args.lengths[0])  # allocator and kernels warmed up once, outside the timings
    times: dict[int, list[float]] = {n: [] for n in args.lengths}
    for _ in range(args.reps):
        for n in args.lengths:
            times[n].append(step_seconds(model, n))
    base = statistics.median(times[args.lengths[0]])
    print(f"torch threads {torch.get_num_threads()}, {BATCH} x ({PROMPT_TOKENS} + C) tokens, {args.reps} reps")
    for n in args.lengths:
        median = statistics.median(times[n])
        print(f"C={n:3d}: {median:.2f} s (x{median / base:.2f}), all {[round(t, 2) for t in times[n]]}")


if __name__ == "__main__":
    main()
