"""Benchmark (GPU): our training module against a plain TRL script, one GPU, DeepSpeed ZeRO-3,
transformers generation, on a random-init model of a real architecture (Qwen2.5-0.5B shape).

    python bench/gpu_zero3.py [--steps 8] [--completion-tokens 256] [--shape qwen2.5-0.5b|tiny]
    python bench/gpu_zero3.py --shape smollm2 --no-zero3 --steps 10   # the CPU comparison of issue 11
    python bench/gpu_zero3.py --arms server-trl server --steps 12     # TRL's scoring pass vs the loss's forward
    python bench/gpu_zero3.py --arms ours --lora --no-zero3 --steps 4 # LoRA r=16 (train.peft), bench/gpu_check.py

Each arm runs in its own process on the same settings (``grpo_steps.training.job.grpo_args`` of one job:
batch, group size, completion length, ZeRO-3 config from ``infra/``):

- ``ours``: ``grpo_steps.training.entry.run`` (the flow's training module: guarded rewards, callbacks, checkpoint
  saves to local disk);
- ``trl``: ``GRPOTrainer`` with the same ``GRPOConfig``, the config's reward functions called directly
  (no guard) and nothing else;
- ``server`` and ``server-trl`` (the GPU machine has no vLLM): the trainer of the ``vllm`` backend
  (``ServerGRPOTrainer``, with the mismatch correction on) sampling from a stand-in for the server
  (:func:`stand_in_server`), which returns completions of exactly the length limit and sampler logprobs at once, so
  that the step is the trainer's part alone: ``server`` weighs the correction in the loss's own forward
  (:mod:`grpo_steps.training.correction`, the pipeline's path), ``server-trl`` keeps TRL's no-grad scoring pass of
  each batch. Both see the same batches; their first step's ``sampling/*`` metrics and loss are printed side by side
  (same weights, same rows: equal up to the precision of the forward).

``--shape smollm2``: the real SmolLM2-135M-Instruct (embedded) on ``configs/local.yaml`` (its data,
rewards, batch, group size and completion length; ``--completion-tokens`` overrides the last), for
the CPU comparison with ``--no-zero3``; completions then end at EOS, so the arms' step times are only
comparable because both train the same policy on the same seed (their completion lengths are printed).

Prints a Markdown table for docs/benchmarks.md: mean step time (TRL's ``step_time``, first step left
out), tokens/s (prompt + completion tokens per second of step time), peak GPU memory
(``torch.cuda.max_memory_allocated``, GiB), and the ours/trl step-time ratio. The random model's
completions run to the length limit (few EOS), so every step does the same work. Needs torch,
transformers, trl, accelerate, deepspeed (the ``gpu`` extra); no network. ``--shape tiny`` runs the
same code on CPU in a minute (a smoke check, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # Qwen/Qwen2.5-0.5B-Instruct config.json, random init
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=True),
    "smollm2": None,  # the embedded SmolLM2-135M-Instruct itself, on configs/local.yaml
}
ARMS = ["ours", "trl", "server", "server-trl"]
FIRST_STEP = ["loss", "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
              "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
              "sampling/importance_sampling_ratio/max"]


def build_model(shape: str, target: Path) -> Path:
    """A random-init Qwen2 of ``shape`` saved in ``target`` with the tiny model's tokenizer (ids the
    tokenizer does not know decode to nothing); for ``smollm2`` the embedded model's directory."""
    if SHAPES[shape] is None:
        from grpo_steps.models import resolve_model

        return Path(resolve_model("embedded:SmolLM2-135M-Instruct"))
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from grpo_steps.dev.tiny_model import TINY
    from grpo_steps.models import prepare_embedded

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(prepare_embedded(TINY))
    config = Qwen2Config(**SHAPES[shape], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def job_for(args, arm: str, model_path: Path, workdir: Path):
    import torch
    from transformers import AutoTokenizer

    from grpo_steps.config import REPO_ROOT, load_config, validate_config
    from grpo_steps.data import prepare
    from grpo_steps.training.job import TrainJob

    real = SHAPES[args.shape] is None
    base = load_config(REPO_ROOT / "configs" / ("local.yaml" if real else "test.yaml")).model_dump()
    base["model"].update(name_or_path=str(model_path), dtype="bfloat16" if torch.cuda.is_available() else "float32",
                         max_model_len=1024)
    base["generation"].update(backend="vllm" if arm.startswith("server") else "hf",
                              max_completion_tokens=args.completion_tokens
                              or base["generation"]["max_completion_tokens"])
    if not real:
        base["data"].update(num_train=64)
        base["train"].update(num_generations=8, per_device_train_batch_size=16)
    base["train"].update(max_steps=args.steps, save_steps=args.steps, deepspeed=args.zero3, logging_steps=1)
    if args.lora:  # configs/lora.yaml's adapter
        base["train"].update(peft={"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"})
    base["eval"].update(every_steps=0)  # step time only: no held-out evaluation during training
    cfg = validate_config(base)
    rows = prepare(cfg.data, AutoTokenizer.from_pretrained(model_path)).train
    train_file = workdir / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return TrainJob(config=cfg, model_path=str(model_path), train_file=str(train_file), output_dir=str(workdir / "out"))


def stand_in_server(settings, length: int, ids: range, vocab: int):
    """A :class:`grpo_steps.dev.stand_in_server.StandInServer`: for each prompt, ``length`` token ids drawn from ``ids``
    seeded by the prompt (never EOS: every completion runs to the limit), with sampler logprobs of a uniform
    distribution over ``vocab`` plus noise of 0.1 nats (a random-init policy is close to uniform)."""
    import math

    import torch

    from grpo_steps.dev.stand_in_server import StandInServer

    class Uniform(StandInServer):
        def sample(self, prompt, index):
            rng = torch.Generator().manual_seed(sum(prompt) * 31 + index)
            completion = torch.randint(ids.start, ids.stop, (length,), generator=rng).tolist()
            return completion, (-math.log(vocab) + 0.1 * torch.randn(length, generator=rng,
                                                                     dtype=torch.float64)).tolist()

    return Uniform(settings)


def server_trainer(arm: str, job, rows: list[dict], reward_funcs: list):
    """``ServerGRPOTrainer`` on ``job`` sampling from :func:`stand_in_server`; ``server-trl``: TRL's scoring pass."""
    from datasets import Dataset
    from transformers import AutoConfig, AutoTokenizer

    from grpo_steps.servers.client import VLLMClient
    from grpo_steps.training.generation.server import ServerSettings
    from grpo_steps.training.job import grpo_args
    from grpo_steps.training.trainer import ServerGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(job.model_path)
    settings = ServerSettings(client=VLLMClient("http://127.0.0.1:9"), gen=job.config.generation,  # never called
                              max_model_len=job.config.model.max_model_len, transport=None, probe_ids=[1, 2],
                              probe_tolerance=0.05)
    trainer = ServerGRPOTrainer(model=job.model_path, reward_funcs=reward_funcs, args=grpo_args(job),
                                train_dataset=Dataset.from_list(rows), processing_class=tokenizer, server=settings)
    assert trainer.loss_side_correction is not None, "the job must let the loss weigh the correction"
    if arm == "server-trl":
        trainer.loss_side_correction = None  # TRL's own scoring pass
    special = max(tokenizer.all_special_ids) + 1
    trainer.vllm_generation = stand_in_server(settings, job.config.generation.max_completion_tokens,
                                              range(special, special + 1000),
                                              AutoConfig.from_pretrained(job.model_path).vocab_size)
    return trainer


def run_arm(arm: str, args, model_path: Path, workdir: Path) -> dict:
    """Train one arm in this process; returns its per-step logs and peak GPU memory."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", TRL_EXPERIMENTAL_SILENCE="1")
    job = job_for(args, arm, model_path, workdir)
    if arm == "ours":
        from grpo_steps.training.entry import run

        run(job)
        history = json.loads((Path(job.output_dir) / "log_history.json").read_text())
    else:
        from datasets import Dataset
        from trl import GRPOTrainer

        from grpo_steps.training.job import grpo_args
        from rewards import bind_options, resolve_reward

        if args.zero3 and not torch.cuda.is_available():
            import deepspeed

            deepspeed.comm.init_distributed(dist_backend="gloo")
        rows = [json.loads(line) for line in Path(job.train_file).read_text().splitlines()]
        if arm.startswith("server"):
            # a reward of the stand-in's random ids in place of each of the config's (which give them all 0: no
            # advantage, no gradient)
            ids_reward = lambda completion_ids, **_: [float(sum(c) % 7) for c in completion_ids]  # noqa: E731
            trainer = server_trainer(arm, job, rows, [ids_reward] * len(job.config.rewards))
        else:
            reward_funcs = [bind_options(resolve_reward(spec.name), spec.options) for spec in job.config.rewards]
            trainer = GRPOTrainer(model=job.model_path, reward_funcs=reward_funcs, args=grpo_args(job),
                                  train_dataset=Dataset.from_list(rows))
        trainer.train()
        history = trainer.state.log_history
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    return {"history": [h for h in history if "step_time" in h], "peak_gib": peak}


def summary(result: dict) -> dict:
    steps = result["history"][1:]  # first step: warm-up
    step_time = statistics.fmean(h["step_time"] for h in steps)
    tokens = steps[-1]["num_tokens"] - result["history"][0]["num_tokens"]
    return {"step_time": step_time, "tokens_per_s": tokens / sum(h["step_time"] for h in steps),
            "peak_gib": result["peak_gib"], "length": statistics.fmean(h["completions/mean_length"] for h in steps),
            "first_step": {k: result["history"][0].get(k, float("nan")) for k in FIRST_STEP}}


def repo_first_path() -> str:
    """``PYTHONPATH`` for an arm's process: this repository, then what the bench was given (carried wheels)."""
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]
    return os.pathsep.join(p for p in paths if p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=None,
                        help="completion length limit (default: 256; smollm2: the config's)")
    parser.add_argument("--zero3", action=argparse.BooleanOptionalAction, default=True,
                        help="DeepSpeed ZeRO-3 in both arms (default on)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (r=16, all linear layers)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=["ours", "trl"],
                        help="the arms, in the order they run (the first pays the machine's first-run warm-up)")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, in a child
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.completion_tokens is None and SHAPES[args.shape] is not None:
        args.completion_tokens = 256
    if args.arm:
        result = run_arm(args.arm, args, Path(args.model), Path(args.workdir) / args.arm)
        (Path(args.workdir) / f"{args.arm}.json").write_text(json.dumps(result))
        return
    import torch

    with tempfile.TemporaryDirectory(prefix="grpo-gpu-bench-") as workdir:
        model = build_model(args.shape, Path(workdir) / "model")
        results = {}
        for arm in args.arms:
            (Path(workdir) / arm).mkdir()
            subprocess.run([sys.executable, __file__, "--arm", arm, "--workdir", workdir, "--model", str(model),
                            "--steps", str(args.steps), "--shape", args.shape,
                            "--zero3" if args.zero3 else "--no-zero3", *(["--lora"] if args.lora else [])]
                           + (["--completion-tokens", str(args.completion_tokens)] if args.completion_tokens else []),
                           check=True, env={**os.environ, "PYTHONPATH": repo_first_path()})
            results[arm] = summary(json.loads((Path(workdir) / f"{arm}.json").read_text()))
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    limit = args.completion_tokens or "the config's"
    print(f"\n{time.strftime('%Y-%m-%d')}, {platform.node()}, {device}, shape {args.shape}, {args.steps} steps "
          f"(first left out), completions of at most {limit} tokens, "
          f"{'ZeRO-3' if args.zero3 else 'no DeepSpeed'}{', LoRA r=16' if args.lora else ''}, 1 process\n")
    print("| arm | step time, s | tokens/s | completion length, tokens | peak GPU memory, GiB |")
    print("|---|---|---|---|---|")
    for arm, r in results.items():
        print(f"| {arm} | {r['step_time']:.2f} | {r['tokens_per_s']:.0f} | {r['length']:.1f} | {r['peak_gib']:.2f} |")
    if {"ours", "trl"} <= set(results):
        print(f"\nours / trl step-time ratio: {results['ours']['step_time'] / results['trl']['step_time']:.2f}")
    if {"server", "server-trl"} <= set(results):
        print(f"\nserver / server-trl step-time ratio (the correction from the loss's forward / TRL's scoring pass): "
              f"{results['server']['step_time'] / results['server-trl']['step_time']:.2f}\n")
        print("| first step | server | server-trl |\n|---|---|---|")
        for key in FIRST_STEP:
            ours, theirs = results["server"]["first_step"][key], results["server-trl"]["first_step"][key]
            print(f"| {key} | {ours:.6g} | {theirs:.6g} |")


if __name__ == "__main__":
    main()
