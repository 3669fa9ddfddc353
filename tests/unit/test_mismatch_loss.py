"""TRL's mismatch correction reaches the loss through ``ServerGRPOTrainer``: one batch, constructed importance
ratios, the tiny policy (no server: nothing is generated). With on-policy ratios pi_theta/pi_old = 1 the DAPO
loss is -sum_i A_i * r_i * L_i / N (TRL 1.16 ``_compute_loss``; A: advantage, r: sequence ratio, L: completion
tokens, N: all completion tokens); without the correction every r_i is 1."""

import pytest
import torch

from grpo_steps.config import validate_config
from grpo_steps.training.job import TrainJob, grpo_args
from grpo_steps.training.trainer import DiskSync, ServerGRPOTrainer

LENGTHS = [3, 5]  # completion tokens of the two sequences
ADVANTAGES = [1.0, -0.5]


@pytest.fixture(scope="module")
def trainers(tiny_model_path, tmp_path_factory):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    dataset = Dataset.from_list([{"prompt": "1 + 1", "answer": "2"}] * 4)
    out = {}
    for name, mode in (("on", "sequence_mask"), ("off", "off")):
        cfg = validate_config({"generation": {"importance_sampling": {"mode": mode}},
                               "train": {"per_device_train_batch_size": 2, "num_generations": 2}})
        args = grpo_args(TrainJob(config=cfg, model_path=tiny_model_path, train_file="unused",
                                  output_dir=str(tmp_path_factory.mktemp(name))))
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        reward = lambda completions, **_: [0.0] * len(completions)  # noqa: E731  (never called here)
        common = dict(model=model, reward_funcs=[reward, reward], args=args,
                      train_dataset=dataset, processing_class=tokenizer)
        sync = DiskSync(trainer=None, push=None, probe_ids=[1, 2], probe_tolerance=0.05)
        out[name] = ServerGRPOTrainer(**common, sync=sync, max_logp_diff=None)
        if name == "off":
            out["plain"] = GRPOTrainer(**common)
    for trainer in out.values():
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.training_step in a real step
    return out


def _batch(ratio: torch.Tensor | None) -> dict:
    prompt = torch.tensor([[5, 6, 7], [5, 6, 7]])
    completion = torch.tensor([[8, 9, 10, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[1] * n + [0] * (5 - n) for n in LENGTHS])
    batch = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
             "completion_mask": mask, "advantages": torch.tensor(ADVANTAGES),
             "num_items_in_batch": torch.tensor(float(sum(LENGTHS)))}
    if ratio is not None:
        batch["importance_sampling_ratio"] = ratio
    return batch


def expected_loss(ratios: list[float]) -> float:
    return -sum(a * r * n for a, r, n in zip(ADVANTAGES, ratios, LENGTHS, strict=True)) / sum(LENGTHS)


def test_correction_reweights_the_loss_by_the_ratio(trainers):
    ratio = torch.tensor([[0.5], [2.0]])  # sequence level (B, 1): the sampler over- and under-sampled
    on = trainers["on"].compute_loss(trainers["on"].model, _batch(ratio)).item()
    off = trainers["off"].compute_loss(trainers["off"].model, _batch(ratio)).item()
    assert off == pytest.approx(expected_loss([1.0, 1.0]), abs=1e-6)  # the ratio is ignored when off
    assert on == pytest.approx(expected_loss([0.5, 2.0]), abs=1e-6)
    # down-weighting the good completion and up-weighting the bad one raises the loss
    assert on > off


def test_a_masked_sequence_leaves_the_loss(trainers):
    ratio = torch.tensor([[1.0], [0.0]])  # sequence_mask: ratio outside [clip_min, clip_max] -> 0
    on = trainers["on"].compute_loss(trainers["on"].model, _batch(ratio)).item()
    assert on == pytest.approx(expected_loss([1.0, 0.0]), abs=1e-6)


def test_correction_off_is_trls_plain_trainer(trainers):
    plain = trainers["plain"].compute_loss(trainers["plain"].model, _batch(None)).item()
    off = trainers["off"].compute_loss(trainers["off"].model, _batch(None)).item()
    assert off == pytest.approx(plain, abs=1e-7)
    assert trainers["on"].use_vllm and not trainers["plain"].use_vllm
