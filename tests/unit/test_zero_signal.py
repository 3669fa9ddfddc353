"""Groups whose rewards are all equal (``train.zero_signal_groups``), on TRL's own generation batches: the tiny
policy behind a ServerGRPOTrainer whose generation returns constructed completions (the first of each group
"Answer: 6", the second "Answer: 7", longer in later rounds), scored by a reward that is constant on "flat" prompts
and right/wrong on the others. Checked: which groups are kept, regenerated or skipped, batch sizes, advantages,
padding, the token count of the loss, the cap on rounds, the metrics."""

import pytest
import torch

from grpo_steps.config import validate_config
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation import ServerGeneration
from grpo_steps.training.job import TrainJob, grpo_args
from grpo_steps.training.trainer import ServerGRPOTrainer

GROUP = 2  # num_generations
BATCH = 4  # per_device_train_batch_size: two groups


def live_reward(prompts, completions, **_):
    """0 on every completion of a "flat" prompt (a group without signal); 1 for "Answer: 6" on the others."""
    return [0.0 if "flat" in p[-1]["content"] else float("Answer: 6" in c[-1]["content"])
            for p, c in zip(prompts, completions, strict=True)]


def _rows(names: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{name}: calculate 2 * 3."}]} for name in names]


def _trainer(tiny_model_path, tmp_path, mode: str, dataset: list[str], rounds: int = 3):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = validate_config({"generation": {"max_completion_tokens": 32},
                           "rewards": [{"name": "answer_accuracy"}], "eval": {"format_reward": None},
                           "train": {"per_device_train_batch_size": BATCH, "num_generations": GROUP,
                                     "zero_signal_groups": mode, "max_resample_rounds": rounds}})
    args = grpo_args(TrainJob(config=cfg, model_path=tiny_model_path, train_file="unused", output_dir=str(tmp_path)))
    sync = ServerGeneration(trainer=None, client=VLLMClient("http://127.0.0.1:9"), gen=cfg.generation,
                            max_model_len=1024, push=None, probe_ids=[1, 2], probe_tolerance=0.05)
    calls = []

    def generate(prompts, images=None, num_generations=1, profiler=None):
        calls.append([tokenizer.decode(p) for p in prompts])
        tail = " because" * (len(calls) - 1)  # later rounds write longer completions: the batch is re-padded
        texts = [("Answer: 6" if i % GROUP == 0 else "Answer: 7") + tail for i in range(len(prompts))]
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        return prompts, ids, [[[-0.5]] * len(i) for i in ids], [[[t] for t in i] for i in ids]

    sync.generate, sync.sync_weights = generate, lambda: None
    trainer = ServerGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                reward_funcs=[live_reward], args=args,
                                train_dataset=Dataset.from_list(_rows(dataset)),
                                processing_class=tokenizer, sync=sync, max_logp_diff=None,
                                zero_signal_groups=mode, max_resample_rounds=rounds)
    trainer._last_loaded_step = trainer.state.global_step
    trainer.model.train()
    return trainer, calls


def _batch(names: list[str]) -> list[dict]:
    return [row for row in _rows(names) for _ in range(GROUP)]


def _metric(trainer, name):
    return trainer._metrics["train"][name][-1]


def test_resample_replaces_a_group_without_signal_by_one_with_signal(tiny_model_path, tmp_path):
    trainer, calls = _trainer(tiny_model_path, tmp_path, "resample", dataset=["live 1", "live 2", "flat 3"])
    out = trainer._generate_and_score_completions(_batch(["flat 0", "live 0"]))
    assert out["completion_ids"].shape[0] == BATCH and out["prompt_ids"].shape[0] == BATCH
    groups = out["advantages"].view(-1, GROUP)
    assert (groups.abs().amax(dim=1) > 0).all()  # both places hold a group with signal
    assert torch.allclose(groups, groups[:1].expand_as(groups))  # right/wrong, scaled by the group: same advantages
    # the first round's live group is kept in its place, the flat one replaced from a later round
    assert "live 0" in trainer.processing_class.decode(out["prompt_ids"][0][out["prompt_mask"][0].bool()])
    later = [trainer.processing_class.decode(out["prompt_ids"][i][out["prompt_mask"][i].bool()]) for i in (2, 3)]
    assert all("live" in text and "live 0" not in text for text in later)
    # re-padded: the kept rows' completions are shorter than the later round's, their mask says so
    lengths = out["completion_mask"].sum(dim=1).tolist()
    assert lengths[0] < lengths[2] and out["completion_ids"].shape[1] == max(lengths)
    assert int(out["num_items_in_batch"]) == sum(lengths)
    assert len(calls) == int(_metric(trainer, "zero_signal/rounds")) >= 2
    assert _metric(trainer, "zero_signal/frac_before") == 0.5 and _metric(trainer, "zero_signal/frac_after") == 0.0
    assert _metric(trainer, "zero_signal/groups_generated") == 2 * len(calls)


def test_resample_stops_at_the_cap_and_keeps_the_batch_size(tiny_model_path, tmp_path):
    trainer, calls = _trainer(tiny_model_path, tmp_path, "resample", dataset=["flat 1", "flat 2"], rounds=3)
    out = trainer._generate_and_score_completions(_batch(["flat 0", "live 0"]))
    assert len(calls) == 3 and _metric(trainer, "zero_signal/rounds") == 3
    assert out["completion_ids"].shape[0] == BATCH
    groups = out["advantages"].view(-1, GROUP).abs().amax(dim=1)
    assert groups.tolist()[0] > 0 and groups.tolist()[1] == 0  # the live group, then the first round's flat one
    assert _metric(trainer, "zero_signal/frac_after") == 0.5 and _metric(trainer, "zero_signal/groups_generated") == 6


def test_resample_generates_once_when_every_group_has_signal(tiny_model_path, tmp_path):
    trainer, calls = _trainer(tiny_model_path, tmp_path, "resample", dataset=["live 1"])
    trainer._generate_and_score_completions(_batch(["live 0", "live 1"]))
    assert len(calls) == 1 and _metric(trainer, "zero_signal/rounds") == 1


@pytest.mark.parametrize("names, skipped", [(["flat 0", "flat 1"], True), (["flat 0", "live 0"], False)])
def test_skip_runs_no_forward_for_a_micro_batch_without_signal(tiny_model_path, tmp_path, names, skipped):
    """TRL's training step as the Trainer calls it (on the dataset's rows: TRL generates inside): a micro-batch with
    only flat groups runs no training forward and leaves no gradient; one with a live group trains."""
    trainer, calls = _trainer(tiny_model_path, tmp_path, "skip", dataset=names)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
    trainer.model.eval()  # as from_pretrained leaves it: the step must train it before TRL prepares the batch
    forwards = []  # forwards with gradients (the scoring of old logprobs runs without)
    trainer.model.register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    loss = trainer.training_step(trainer.model, _batch(names), None)
    assert len(calls) == 1 and trainer._step == 1  # generated once; TRL's micro-batch counter moved on either way
    assert any(forwards) is not skipped
    assert _metric(trainer, "zero_signal/skipped_share") == float(skipped)
    if skipped:
        assert float(loss) == 0.0 and all(p.grad is None for p in trainer.model.parameters())
    else:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())


@pytest.mark.parametrize("data, named", [
    ({"train": {"zero_signal_groups": "skip", "beta": 0.04}}, "their KL term still trains"),
    ({"train": {"zero_signal_groups": "skip", "deepspeed": True}}, "not available with train.deepspeed"),
    ({"train": {"zero_signal_groups": "resample", "per_device_train_batch_size": 6, "num_generations": 4}},
     "must be a multiple of train.num_generations"),
    ({"train": {"zero_signal_groups": "resample"}, "generation": {"backend": "replay", "replay_file": "f"}},
     "backend 'replay' samples nothing"),
    ({"train": {"zero_signal_groups": "resample", "max_resample_rounds": 1}}, "greater than or equal to 2"),
    ({"train": {"zero_signal_groups": "replay"}}, "'keep', 'skip' or 'resample'"),
])
def test_refused_by_the_config(data, named):
    from grpo_steps.config import ConfigError

    with pytest.raises(ConfigError, match=named):
        validate_config(data)
