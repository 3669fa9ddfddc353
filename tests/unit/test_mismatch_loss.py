"""TRL's mismatch correction reaches the loss through ``ServerGRPOTrainer``: one batch, constructed importance
ratios, the tiny policy (no server: nothing is generated). With on-policy ratios pi_theta/pi_old = 1 the DAPO
loss is -sum_i A_i * r_i * L_i / N (TRL 1.16 ``_compute_loss``; A: advantage, r: sequence ratio, L: completion
tokens, N: all completion tokens); without the correction every r_i is 1."""

import pytest
import torch

from grpo_steps.config import validate_config
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation.server import ServerSettings
from grpo_steps.training.job import TrainJob, grpo_args
from grpo_steps.training.trainer import ServerGRPOTrainer

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
        server = ServerSettings(client=VLLMClient("http://127.0.0.1:9"), gen=cfg.generation,
                                max_model_len=256, transport=None, probe_ids=[1, 2],
                                probe_tolerance=0.05)  # never called
        out[name] = ServerGRPOTrainer(**common, server=server)
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


def test_trls_prompt_rendering_is_the_pipelines(tiny_model_path, tmp_path):
    """On the server path TRL renders the prompts (``_tokenize_prompts``: chat template, tool schemas, the template
    arguments of ``generation.chat_template_kwargs``); data preparation and evaluation render them with
    ``encode_prompt``: the same token ids."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_steps.data import encode_prompt, to_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.chat_template = "{% if mood %}<|im_start|>system\nmood {{ mood }}<|im_end|>\n{% endif %}" + \
        tokenizer.chat_template
    cfg = validate_config({"generation": {"chat_template_kwargs": {"mood": "7 + 7"}},
                           "train": {"per_device_train_batch_size": 2, "num_generations": 2}})
    args = grpo_args(TrainJob(config=cfg, model_path=tiny_model_path, train_file="unused", output_dir=str(tmp_path)))
    server = ServerSettings(client=VLLMClient("http://127.0.0.1:9"), gen=cfg.generation,
                            max_model_len=256, transport=None, probe_ids=[1, 2], probe_tolerance=0.05)  # never called
    trainer = ServerGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                reward_funcs=[lambda completions, **_: [0.0] * len(completions)] * 2, args=args,
                                train_dataset=Dataset.from_list([{"prompt": "x"}] * 2), processing_class=tokenizer,
                                server=server)
    prompt = to_prompt("Calculate 2 + 3.", "Solve the problem.")
    (trl_ids,), _, _ = trainer._tokenize_prompts([prompt])
    assert list(trl_ids) == encode_prompt(tokenizer, prompt, cfg.generation.chat_template_kwargs)
    assert "mood 7 + 7" in tokenizer.decode(trl_ids)
