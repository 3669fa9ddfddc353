"""Solve rate of a game policy (``configs/game.yaml`` or ``--config``) on held-out rows, through a local vLLM server,
with every turn's feedback and limited to one move (``generation.max_tool_calling_iterations: 1``: the same episodes,
feedback withheld). Alone: the base policy's numbers, the first check of a game config (the policy must start above
zero). With a trained policy (``--run`` or ``--model``): the issue's three numbers on the same rows, the base policy,
the trained one and the trained one limited to one move, with paired 95 % intervals of the trained policy's gain over
each of the other two (:func:`grpo_steps.evaluation.stats.gain_metrics`, per prompt: greedy ``accuracy`` and the
share of samples solved, ``pass@1``).

    .venv/bin/python bench/game_base.py [--config configs/game.yaml] [--rows 64] [--samples 4]
        [--run GRPOFlow/<id> | --model PATH] [--out results.json]

``--run`` reads the final policy that run's ``train`` saved (its checkpoint ``policy``) from the Metaflow datastore of
the working directory, as the flow's ``evaluate`` does. All three policies are evaluated here, one after another on
the same rows with the same settings (the run's own evaluations ran beside its training).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import ExitStack
from datetime import date

from grpo_steps.config import load_config, validate_config


def with_overrides(cfg, section: str, **values):
    """``cfg`` with ``values`` set in its ``section`` (validated again, as a config file with them would be)."""
    data = cfg.model_dump(mode="json", exclude_unset=True)
    return validate_config({**data, section: {**getattr(cfg, section).model_dump(mode="json", exclude_unset=True),
                                              **values}})


def trained_policy(stack: ExitStack, run: str) -> str:
    """The directory of the final policy of the flow run ``run`` (``GRPOFlow/<id>``), copied out of the datastore."""
    from metaflow import Run, namespace

    from grpo_steps.steps import loaded_policy

    namespace(None)
    return stack.enter_context(loaded_policy(Run(run).data.policy))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/game.yaml")
    parser.add_argument("--rows", type=int, default=None, help="held-out rows (default: all)")
    parser.add_argument("--samples", type=int, default=None, help="eval.num_samples (default: the config's)")
    trained = parser.add_mutually_exclusive_group()
    trained.add_argument("--run", default=None, help="a GRPOFlow run (GRPOFlow/<id>) whose trained policy to evaluate")
    trained.add_argument("--model", default=None, help="the trained policy's weights directory")
    parser.add_argument("--out", default=None, help="write every metric and per-prompt score here (JSON)")
    args = parser.parse_args()
    from grpo_steps import servers
    from grpo_steps.data import prepare
    from grpo_steps.evaluation.policy import evaluate_policy
    from grpo_steps.evaluation.stats import gain_metrics
    from grpo_steps.models import load_tokenizer, resolve_model
    from grpo_steps.servers.lifecycle import run_owner
    from grpo_steps.tools.environments import prompt_tools

    cfg = load_config(args.config)
    if args.samples is not None:
        cfg = with_overrides(cfg, "eval", num_samples=args.samples, k=[1])
    one_move = with_overrides(cfg, "generation", max_tool_calling_iterations=1)
    base_path = resolve_model(cfg.model.name_or_path)
    tokenizer = load_tokenizer(base_path, cfg.model.chat_template)
    tools = prompt_tools(cfg.tools, cfg.environment, cfg.generation.tool_timeout_s)
    rows = prepare(cfg.data, tokenizer, cfg.generation.chat_template_kwargs, tools).eval[: args.rows]
    started, results = time.monotonic(), {}
    with ExitStack() as stack:
        trained_path = args.model or (trained_policy(stack, args.run) if args.run else None)
        # without a trained policy: the base policy, with feedback and limited to one move
        plan = [("base", base_path, cfg), ("trained", trained_path, cfg), ("trained, one move", trained_path, one_move)
                ] if trained_path else [("base", base_path, cfg), ("base, one move", base_path, one_move)]
        for path in dict.fromkeys(p for label, p, _ in plan if label not in results):
            server = servers.provision(cfg, path, owner=run_owner(), run_id=f"game-bench-{os.getpid()}")
            try:
                client = server.client()
                for label, _, run_cfg in (s for s in plan if s[1] == path and s[0] not in results):
                    t0 = time.monotonic()
                    results[label] = evaluate_policy(run_cfg, client, tokenizer, rows, label=label)
                    results[label]["wall_s"] = time.monotonic() - t0
            finally:
                server.stop()
    for label, _, _ in plan:
        print(f"[game] {label}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(results[label]["metrics"].items())
                                              if k.startswith(("game/", "accuracy", "pass@", "tools/"))) +
              (f" ({results[label]['wall_s']:.0f} s)" if "wall_s" in results[label] else " (the run's evaluation)"),
              flush=True)
    # the policy with feedback against each of the others, prompt by prompt
    pairs = ([("trained", "base"), ("trained", "trained, one move")] if trained_path else [("base", "base, one move")])
    gains = {f"{after} - {before}": gain_metrics(results[before]["per_prompt"], results[after]["per_prompt"])
             for after, before in pairs}
    for name, gain in gains.items():
        print(f"[game] gain {name}: " + ", ".join(f"{m} {gain[m]:+.3f} +- {gain[m + '_ci95']:.3f}"
                                                  for m in ("accuracy", "pass@1")), flush=True)
    wall_s = time.monotonic() - started
    print(f"{date.today()}, {os.cpu_count()} CPUs, {len(rows)} held-out rows, {wall_s:.0f} s with the servers' starts",
          flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"date": str(date.today()), "rows": len(rows), "samples": cfg.eval.num_samples, "wall_s": wall_s,
                       "policies": {label: {"metrics": r["metrics"], "per_prompt": r["per_prompt"]}
                                    for label, r in results.items()}, "gains": gains}, out, indent=1)


if __name__ == "__main__":
    main()
