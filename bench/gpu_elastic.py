"""Elastic resume on GPUs: a ZeRO-3 run on N GPUs, its step-K checkpoint continued on M GPUs, the resumed steps
compared with the uninterrupted run (the N->M check of ``tests/integration/test_elastic_resume.py``, which runs on CPU
over gloo, for whoever has GPUs; not run on the project's CPU machine).

    python bench/gpu_elastic.py --from 2 --to 1 [--steps 4] [--kill-at 2] [--tolerance 1e-4]
    python bench/gpu_elastic.py --from 1 --to 1 --force-universal   # one GPU: the universal load path alone

The policy is the embedded tiny random Qwen2 (``grpo_steps.dev.tiny_model``, built locally, no network) on
configs/test.yaml with recorded completions (backend ``recorded``: the same completions whatever the gang), so the
comparison is number for number. The global batch is kept (``per_device_train_batch_size`` = 8 / GPUs). Prints the
resume line, the conversion time, a table of loss / grad norm / reward per resumed step for both runs with the
largest relative gap, and exits 1 when a gap exceeds ``--tolerance`` (default 1e-4: bf16 is off, float32 throughout;
CUDA reductions over another number of GPUs change the summation order, ~1e-6 relative per step on CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ROWS_PER_STEP = 8  # completions per optimizer step over all GPUs: 2 prompts x 4 generations


def job(workdir: Path, model_path: str, rows: list[dict], recorded: str, gpus: int, steps: int, kill_at: int,
        resume_from: str | None = None, weight_decay: float = 1.0):
    import yaml

    from grpo_steps.config import validate_config
    from grpo_steps.training.job import TrainJob

    config = yaml.safe_load((REPO / "configs" / "test.yaml").read_text())
    config["train"].update(max_steps=steps, save_steps=kill_at, processes_per_node=gpus, deepspeed=True,
                           trust_checkpoint=True, per_device_train_batch_size=ROWS_PER_STEP // gpus,
                           grpo={"weight_decay": weight_decay})
    config["generation"].update(backend="recorded", recorded_file=recorded)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return TrainJob(config=validate_config(config), model_path=model_path, train_file=str(workdir / "train.jsonl"),
                    output_dir=str(workdir / "out"), resume_from=resume_from)


def steps_of(workdir: Path) -> dict[int, dict]:
    logs = json.loads((workdir / "out" / "log_history.json").read_text())
    return {h["step"]: h for h in logs if "loss" in h}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=int, default=2, help="GPUs of the uninterrupted run")
    parser.add_argument("--to", dest="target", type=int, default=1, help="GPUs of the resumed run")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=2, help="the step whose checkpoint is resumed")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=1.0,
                        help="large, so that each parameter group's own settings matter (DeepSpeed 0.19.8's universal "
                             "load gave every group group 0's: grpo_steps.training.gang.restore_group_settings)")
    parser.add_argument("--force-universal", action="store_true",
                        help="convert and load the Universal Checkpoint even when --from equals --to")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from grpo_steps.config import validate_config
    from grpo_steps.data import prepare
    from grpo_steps.dev.tiny_model import TINY
    from grpo_steps.elastic import to_universal
    from grpo_steps.launch import launch
    from grpo_steps.models import prepare_embedded

    model_path = str(prepare_embedded(TINY))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    import yaml

    rows = prepare(validate_config(yaml.safe_load((REPO / "configs" / "test.yaml").read_text())).data,
                   tokenizer).train
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # four completions per question with different rewards: every group has signal
        recorded = root / "recorded.jsonl"
        recorded.write_text("".join(json.dumps({"question": r["prompt"][-1]["content"], "completions": [
            f"Answer: {r['answer']}", str(r["answer"]), "Answer: 1000", "I do not know"]}) + "\n" for r in rows))
        launch(job(root / "reference", model_path, rows, str(recorded), args.source, args.steps, args.kill_at,
                   weight_decay=args.weight_decay))
        checkpoint = root / f"checkpoint-{args.kill_at}"
        shutil.copytree(root / "reference" / "out" / f"checkpoint-{args.kill_at}", checkpoint)
        resumed = job(root / "resumed", model_path, rows, str(recorded), args.target, args.steps, args.kill_at,
                      resume_from=str(checkpoint), weight_decay=args.weight_decay)
        if args.force_universal and args.source == args.target:
            print(f"[bench] universal conversion {to_universal(checkpoint):.1f} s (forced)", flush=True)
            resumed = resumed.model_copy(update={"resume_universal": True})
        launch(resumed)
        reference, got = steps_of(root / "reference"), steps_of(root / "resumed")
    gaps = []
    print(f"| step | metric | {args.source} GPU(s), uninterrupted | {args.target} GPU(s), resumed | rel. gap |")
    print("|---|---|---|---|---|")
    for step in range(args.kill_at + 1, args.steps + 1):
        for metric in ("loss", "grad_norm", "reward"):
            a, b = reference[step][metric], got[step][metric]
            gap = abs(a - b) / max(abs(a), 1e-12)
            gaps.append(gap)
            print(f"| {step} | {metric} | {a:.9g} | {b:.9g} | {gap:.2e} |")
    worst = max(gaps)
    print(f"largest relative gap {worst:.2e} (tolerance {args.tolerance:g})")
    return 0 if math.isfinite(worst) and worst <= args.tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
