"""Solve rate of a policy on the game of ``configs/game.yaml`` (or ``--config``), on held-out rows, through a local
vLLM server, with every turn's feedback and limited to one move (``generation.max_tool_calling_iterations: 1``:
the same episodes, feedback withheld): the base policy's numbers of the issue's measurement, and the first check of
a game config (the policy must start above zero).

    .venv/bin/python bench/game_base.py [--config configs/game.yaml] [--rows 32] [--model PATH]
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import date

from grpo_steps.config import load_config, validate_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/game.yaml")
    parser.add_argument("--rows", type=int, default=32, help="held-out rows evaluated")
    parser.add_argument("--samples", type=int, default=None, help="eval.num_samples (default: the config's)")
    parser.add_argument("--model", default=None, help="weights to serve (default: the config's model)")
    args = parser.parse_args()
    from grpo_steps import servers
    from grpo_steps.data import prepare
    from grpo_steps.evaluation.policy import evaluate_policy
    from grpo_steps.models import load_tokenizer, resolve_model
    from grpo_steps.servers.lifecycle import run_owner
    from grpo_steps.tools import prompt_tools

    cfg = load_config(args.config)
    if args.samples is not None:
        cfg = validate_config({**cfg.model_dump(mode="json", exclude_unset=True), "eval": {
            **cfg.eval.model_dump(mode="json", exclude_unset=True), "num_samples": args.samples, "k": [1]}})
    model_path = args.model or resolve_model(cfg.model.name_or_path)
    tokenizer = load_tokenizer(model_path, cfg.model.chat_template)
    tools = prompt_tools(cfg.tools, cfg.environment, cfg.generation.tool_timeout_s)
    rows = prepare(cfg.data, tokenizer, cfg.generation.chat_template_kwargs, tools).eval[: args.rows]
    one_move = validate_config({**cfg.model_dump(mode="json", exclude_unset=True), "generation": {
        **cfg.generation.model_dump(mode="json", exclude_unset=True), "max_tool_calling_iterations": 1}})
    started = time.monotonic()
    server = servers.provision(cfg, model_path, owner=run_owner(), run_id=f"game-base-{os.getpid()}")
    try:
        client = server.client()
        for label, run_cfg in (("feedback", cfg), ("one move", one_move)):
            t0 = time.monotonic()
            metrics = evaluate_policy(run_cfg, client, tokenizer, rows, label=label)["metrics"]
            print(f"[game] {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items())
                                                  if k.startswith(("game/", "accuracy", "pass@", "tools/"))) +
                  f" ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        server.stop()
    print(f"{date.today()}, {os.cpu_count()} CPUs, {len(rows)} held-out rows, {time.monotonic() - started:.0f} s "
          "with the server's start", flush=True)


if __name__ == "__main__":
    main()
