"""Groups whose rewards are all equal (``train.zero_signal_groups``), on TRL's own generation batches: the tiny
policy behind a ServerGRPOTrainer whose generation returns constructed completions (the first of each group
"Answer: 6", the second "Answer: 7", longer in later rounds), scored by a reward that is constant on "flat" prompts
and right/wrong on the others. Checked: which groups are kept, regenerated, skipped or replayed, batch sizes,
advantages, padding, the token count of the loss, the cap on rounds, the replay buffer's capacity and age limit, the
logprobs and importance weights of replayed groups, the metrics."""

import time

import pytest
import torch

from grpo_steps.config import validate_config
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation.server import ServerSettings
from grpo_steps.training.job import TrainJob, grpo_args
from grpo_steps.training.trainer import ServerGRPOTrainer
from grpo_steps.training.zero_signal import ReplayBuffer, importance_weights, mode_for, plan_replay, replay

GROUP = 2  # num_generations
BATCH = 4  # per_device_train_batch_size: two groups


def live_reward(prompts, completions, **_):
    """0 on every completion of a "flat" prompt (a group without signal); 1 for "Answer: 6" on the others."""
    return [0.0 if "flat" in p[-1]["content"] else float("Answer: 6" in c[-1]["content"])
            for p, c in zip(prompts, completions, strict=True)]


def _rows(names: list[str]) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{name}: calculate 2 * 3."}]} for name in names]


def _trainer(tiny_model_path, tmp_path, mode: str, dataset: list[str], rounds: int = 3, train: dict | None = None,
             generation: dict | None = None):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = validate_config({"generation": {"max_completion_tokens": 32, **(generation or {})},
                           "rewards": [{"name": "answer_accuracy"}], "eval": {"format_reward": None},
                           "train": {"per_device_train_batch_size": BATCH, "num_generations": GROUP,
                                     "zero_signal_groups": mode, "max_resample_rounds": rounds, **(train or {})}})
    args = grpo_args(TrainJob(config=cfg, model_path=tiny_model_path, train_file="unused", output_dir=str(tmp_path)))
    server = ServerSettings(client=VLLMClient("http://127.0.0.1:9"), gen=cfg.generation, max_model_len=1024,
                            transport=None, probe_ids=[1, 2], probe_tolerance=0.05)
    calls = []

    def generate(prompts, images=None, num_generations=1, profiler=None):
        calls.append([tokenizer.decode(p) for p in prompts])
        tail = " because" * (len(calls) - 1)  # later rounds write longer completions: the batch is re-padded
        texts = [("Answer: 6" if i % GROUP == 0 else "Answer: 7") + tail for i in range(len(prompts))]
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
        return prompts, ids, [[[-0.5]] * len(i) for i in ids], [[[t] for t in i] for i in ids]

    trainer = ServerGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                reward_funcs=[live_reward], args=args,
                                train_dataset=Dataset.from_list(_rows(dataset)),
                                processing_class=tokenizer, server=server, zero_signal=mode_for(cfg.train))
    trainer.vllm_generation.generate, trainer.vllm_generation.sync_weights = generate, lambda: None
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
    generate = trainer.vllm_generation.generate

    def slow_generate(*args, **kwargs):  # a generation of 0.3 s: TRL's step_time counts it, skipped or not
        time.sleep(0.3)
        return generate(*args, **kwargs)

    trainer.vllm_generation.generate = slow_generate
    loss = trainer.training_step(trainer.model, _batch(names), None)
    assert len(calls) == 1 and trainer._step == 1  # generated once; TRL's micro-batch counter moved on either way
    assert _metric(trainer, "step_time") >= 0.3
    assert any(forwards) is not skipped
    assert _metric(trainer, "zero_signal/skipped_share") == float(skipped)
    if skipped:
        assert float(loss) == 0.0 and all(p.grad is None for p in trainer.model.parameters())
    else:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer.model.parameters())


def test_skip_cuts_the_micro_batches_signal_first_and_the_step_equals_keeps(tiny_model_path, tmp_path, monkeypatch):
    """Two micro-batches of one group's size per generation batch (one flat group, one live): TRL shuffles the rows
    before cutting (here pinned to the shuffle that puts a live row in each micro-batch), so no micro-batch could be
    skipped; ``skip`` cuts them again with the live rows first, trains the first, skips the second, and the
    accumulated gradient is the one ``keep`` accumulates over TRL's cut (``dapo``: normalized over the batch)."""
    import trl.trainer.grpo_trainer as grpo_trainer

    def interleave(batch):  # rows 0, 1 (flat group), 2, 3 (live group) -> 0, 2 | 1, 3
        order = [0, 2, 1, 3]
        return {k: v if v is None or (isinstance(v, torch.Tensor) and v.ndim == 0)
                else v[order] if isinstance(v, torch.Tensor) else [v[i] for i in order] for k, v in batch.items()}

    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", interleave)
    grads = {}
    for mode in ("keep", "skip"):
        trainer, calls = _trainer(tiny_model_path, tmp_path / mode, mode, dataset=["unused"],
                                  train={"per_device_train_batch_size": GROUP, "gradient_accumulation_steps": 2,
                                         "loss_type": "dapo"})
        trainer.current_gradient_accumulation_steps = 2  # set by Trainer's training loop
        for _ in range(2):  # the Trainer's two micro-steps of one optimizer step: TRL generates at the first
            trainer.training_step(trainer.model, _batch(["flat 0", "live 0"]), None)
        assert len(calls) == 1
        grads[mode] = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    assert trainer._metrics["train"]["zero_signal/skipped_share"] == [0.0, 1.0]
    assert [all("live 0" in _prompt(trainer, part, i) for i in range(GROUP)) for part in trainer._buffered_inputs] \
        == [True, False]
    assert grads["skip"].keys() == grads["keep"].keys() and grads["keep"]
    for name, grad in grads["keep"].items():
        assert torch.allclose(grads["skip"][name], grad, rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("data, named", [
    ({"train": {"zero_signal_groups": "skip", "beta": 0.04}}, "their KL term still trains"),
    ({"train": {"zero_signal_groups": "skip", "deepspeed": True}}, "not available with train.deepspeed"),
    ({"train": {"zero_signal_groups": "resample", "per_device_train_batch_size": 6, "num_generations": 4}},
     "must be a multiple of train.num_generations"),
    ({"train": {"zero_signal_groups": "resample"}, "generation": {"backend": "recorded", "recorded_file": "f"}},
     "backend 'recorded' samples nothing"),
    ({"train": {"zero_signal_groups": "resample", "max_resample_rounds": 1}}, "greater than or equal to 2"),
    ({"train": {"zero_signal_groups": "sometimes"}}, "'keep', 'skip', 'resample' or 'replay'"),
    ({"train": {"zero_signal_groups": "replay", "per_device_train_batch_size": 6, "num_generations": 4}},
     "'replay' replaces whole groups"),
    ({"train": {"zero_signal_groups": "replay", "beta": 0.04, "grpo": {"sync_ref_model": True}}},
     "sync_ref_model makes stale"),
    ({"train": {"zero_signal_groups": "replay"}, "generation": {"importance_sampling": {"mode": "off"}}},
     "importance_sampling.mode 'off' has none"),
    ({"train": {"zero_signal_groups": "replay"}, "generation": {"backend": "hf"}}, "backend 'hf'"),
    ({"train": {"zero_signal_groups": "replay", "replay_buffer_size": 0}}, "greater than or equal to 1"),
    ({"train": {"zero_signal_groups": "replay", "replay_buffer_size": 10**9}}, "less than or equal to 4096"),
    ({"train": {"zero_signal_groups": "resample", "max_resample_rounds": 10**6}}, "less than or equal to 16"),
    ({"train": {"zero_signal_groups": "replay", "replay_max_age": 0}}, "greater than or equal to 1"),
])
def test_refused_by_the_config(data, named):
    from grpo_steps.config import ConfigError

    with pytest.raises(ConfigError, match=named):
        validate_config(data)


def _prompt(trainer, out, row: int) -> str:
    return trainer.processing_class.decode(out["prompt_ids"][row][out["prompt_mask"][row].bool()])


def test_replay_puts_buffered_groups_with_signal_in_the_places_without(tiny_model_path, tmp_path):
    trainer, calls = _trainer(tiny_model_path, tmp_path, "replay", dataset=["unused"])
    first = trainer._generate_and_score_completions(_batch(["flat 0", "live 0"]))
    assert first["completion_ids"].shape[0] == BATCH  # nothing buffered yet: the batch as generated
    assert _metric(trainer, "zero_signal/replayed") == 0 and _metric(trainer, "zero_signal/buffer_size") == 1
    assert _metric(trainer, "zero_signal/frac_before") == _metric(trainer, "zero_signal/frac_after") == 0.5
    assert not trainer._metrics["train"]["zero_signal/replay_age"]  # no point without a replayed group
    buffered = trainer.zero_signal.buffer.groups[0].batch  # "live 0", as TRL scored it at step 0

    trainer.state.global_step = 2
    out = trainer._generate_and_score_completions(_batch(["live 1", "flat 1"]))
    assert len(calls) == 2 and out["completion_ids"].shape[0] == BATCH  # one round; the batch keeps its size
    assert ["live 1" in _prompt(trainer, out, i) for i in range(BATCH)] == [True, True, False, False]
    assert all("live 0" in _prompt(trainer, out, i) for i in (2, 3))  # the flat group's place, not appended
    assert torch.equal(out["advantages"][2:], buffered["advantages"])  # advantages as generated (Axolotl)
    # re-padded: the replayed completions (round 1) are shorter than this round's; the loss counts their tokens
    lengths = out["completion_mask"].sum(dim=1).tolist()
    assert lengths[2] < lengths[0] and out["completion_ids"].shape[1] == max(lengths)
    assert int(out["num_items_in_batch"]) == sum(lengths)
    # the policy did not change: its logprobs and TRL's importance weights come out as TRL computed them at step 0
    width = buffered["completion_ids"].shape[1]
    mask = out["completion_mask"][2:, :width].bool()
    assert torch.allclose(out["old_per_token_logps"][2:, :width][mask], buffered["old_per_token_logps"][mask],
                          atol=1e-5)
    assert torch.allclose(out["importance_sampling_ratio"][2:], buffered["importance_sampling_ratio"], atol=1e-4)
    assert torch.equal(out["sampling_per_token_logps"][2:, :width], buffered["sampling_per_token_logps"])
    assert _metric(trainer, "zero_signal/frac_before") == 0.5 and _metric(trainer, "zero_signal/frac_after") == 0.0
    assert _metric(trainer, "zero_signal/replayed") == 1 and _metric(trainer, "zero_signal/replay_age") == 2
    assert _metric(trainer, "zero_signal/buffer_size") == 2  # live 0 stays (replayed, not consumed); live 1 joins

    trainer.state.global_step = 3
    out = trainer._generate_and_score_completions(_batch(["flat 2", "flat 3"]))
    # newest first, each at most once: live 1 (step 2) in the first place, live 0 (step 0) in the second
    assert "live 1" in _prompt(trainer, out, 0) and "live 0" in _prompt(trainer, out, 2)
    assert _metric(trainer, "zero_signal/replayed") == 2 and _metric(trainer, "zero_signal/replay_age") == 2.0
    assert _metric(trainer, "zero_signal/frac_before") == 1.0 and _metric(trainer, "zero_signal/frac_after") == 0.0


def test_replayed_groups_are_rescored_by_the_current_policy(tiny_model_path, tmp_path):
    trainer, _ = _trainer(tiny_model_path, tmp_path, "replay", dataset=["unused"],
                          generation={"importance_sampling": {"mode": "token_truncate", "clip_max": 3.0}})
    trainer._generate_and_score_completions(_batch(["live 0", "flat 0"]))
    buffered = trainer.zero_signal.buffer.groups[0].batch
    with torch.no_grad():  # an optimizer step's worth of change
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    trainer.state.global_step = 1
    out = trainer._generate_and_score_completions(_batch(["flat 1", "live 1"]))
    rows = slice(0, GROUP)  # the replayed group took the first place
    ids = torch.cat([out["prompt_ids"][rows], out["completion_ids"][rows]], dim=1)
    attention = torch.cat([out["prompt_mask"][rows], out["completion_mask"][rows]], dim=1)
    with torch.no_grad():
        policy, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention,
                                                                  out["completion_ids"].shape[1])
    mask = out["completion_mask"][rows]
    width = buffered["completion_ids"].shape[1]
    assert torch.allclose(out["old_per_token_logps"][rows] * mask, policy * mask, atol=1e-5)
    assert not torch.allclose(out["old_per_token_logps"][rows, :width] * mask[:, :width],
                              buffered["old_per_token_logps"] * mask[:, :width], atol=1e-3)
    # the weight against the sampler's logprobs (-0.5 a token, from the older policy), clipped at 3 as TRL does
    expected = torch.clamp(torch.exp((policy - out["sampling_per_token_logps"][rows]) * mask), max=3.0)
    assert torch.allclose(out["importance_sampling_ratio"][rows], expected, atol=1e-5)
    assert torch.equal(out["advantages"][rows], buffered["advantages"])
    assert _metric(trainer, "zero_signal/replay_is_weight") == pytest.approx(float(expected[mask.bool()].mean()),
                                                                           rel=1e-4)


@pytest.mark.parametrize("names, own", [(["flat 1", "live 1"], 1), (["live 1", "live 2"], 0)],
                         ids=["fewer-than-another", "none"])
def test_replay_scores_as_many_rows_as_the_process_that_replays_most(tiny_model_path, tmp_path, names, own,
                                                                      monkeypatch):
    """Under ZeRO-3 every forward of the policy is collective: a process that replays fewer groups than another
    process (here one, or none, against three) still runs the policy on as many rows, in as many calls, and only
    its own replayed rows take the new logprobs."""
    trainer, _ = _trainer(tiny_model_path, tmp_path, "replay", dataset=["unused"])
    trainer._generate_and_score_completions(_batch(["live 0", "flat 0"]))
    peer_rows, reduce_locally = 3 * GROUP, replay.reduce_over_processes
    monkeypatch.setattr(replay, "reduce_over_processes", lambda accelerator, value, reduce: max(value, peer_rows)
                        if reduce == "max" else reduce_locally(accelerator, value, reduce))
    scored, score = [], trainer._get_per_token_logps_and_entropies

    def recording(model, ids, *args, **kwargs):
        scored.append((ids.shape[0], kwargs.get("batch_size")))
        return score(model, ids, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = recording
    trainer.state.global_step = 1
    out = trainer._generate_and_score_completions(_batch(names))
    assert scored[-1] == (peer_rows, BATCH)  # the rescoring pass, padded to the other process's rows
    assert _metric(trainer, "zero_signal/replayed") == own
    assert ["live 0" in _prompt(trainer, out, i) for i in range(BATCH)] == [own > 0] * GROUP + [False] * GROUP
    if own:  # the replayed rows hold the current policy's logprobs, not the padding's
        ids = torch.cat([out["prompt_ids"][:GROUP], out["completion_ids"][:GROUP]], dim=1)
        attention = torch.cat([out["prompt_mask"][:GROUP], out["completion_mask"][:GROUP]], dim=1)
        with torch.no_grad():
            policy, _, _ = score(trainer.model, ids, attention, out["completion_ids"].shape[1])
        mask = out["completion_mask"][:GROUP]
        assert torch.allclose(out["old_per_token_logps"][:GROUP] * mask, policy * mask, atol=1e-5)


@pytest.mark.parametrize("train, step, replayed", [
    ({"replay_buffer_size": 1}, 1, 1),  # capacity 1: only the newer of the two live groups is left
    ({"replay_max_age": 1}, 1, 2),  # one step old: both replayed
    ({"replay_max_age": 1}, 2, 0),  # two steps old: evicted, nothing replayed
])
def test_replay_buffer_capacity_and_age(tiny_model_path, tmp_path, train, step, replayed):
    trainer, _ = _trainer(tiny_model_path, tmp_path, "replay", dataset=["unused"], train=train)
    trainer._generate_and_score_completions(_batch(["live 0", "live 1"]))
    trainer.state.global_step = step
    out = trainer._generate_and_score_completions(_batch(["flat 0", "flat 1"]))
    assert out["completion_ids"].shape[0] == BATCH and _metric(trainer, "zero_signal/replayed") == replayed
    assert _metric(trainer, "zero_signal/frac_after") == 1 - replayed / 2
    if replayed:
        assert "live 1" in _prompt(trainer, out, 0)  # the newest first
    # what is left in the buffer is what could be replayed
    assert _metric(trainer, "zero_signal/buffer_size") == len(trainer.zero_signal.buffer) == replayed


@pytest.mark.parametrize("signal, buffered, sources", [
    ([False, True, False], 5, [0, -1, 1]),  # places without signal in order, newest buffered group first
    ([False, False, False], 2, [0, 1, -1]),  # buffer runs out: the last place keeps its own group
    ([True, True], 3, [-1, -1]),  # every group has signal: nothing replayed
    ([False], 0, [-1]),  # empty buffer
])
def test_plan_replay(signal, buffered, sources):
    assert plan_replay(torch.tensor(signal), buffered) == sources


def test_replay_buffer_keeps_detached_single_groups():
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.5, -0.5], requires_grad=True) * 1
    batch = {"prompt_ids": torch.arange(6).view(6, 1), "prompt_mask": torch.ones(6, 1, dtype=torch.long),
             "completion_ids": torch.arange(12).view(6, 2), "completion_mask": torch.ones(6, 2, dtype=torch.long),
             "advantages": advantages, "num_items_in_batch": torch.tensor(12)}
    buffer = ReplayBuffer(capacity=4)
    buffer.add(batch, torch.tensor([True, False, True]), 2, step=7)
    groups = buffer.newest_first(step=7)
    assert [g.batch["prompt_ids"].flatten().tolist() for g in groups] == [[4, 5], [0, 1]]
    assert [int(g.batch["num_items_in_batch"]) for g in groups] == [4, 4] and {g.step for g in groups} == {7}
    assert not any(g.batch["advantages"].requires_grad for g in groups)


@pytest.mark.parametrize("mode, clip_min, clip_max, expected", [
    ("token_truncate", 0.5, 2.0, [[2.0, 0.5, 1.0]]),  # exp(+1) and exp(-1) clipped; the masked token: exp(0)
    ("token_mask", 0.5, 2.0, [[0.0, 0.0, 1.0]]),  # outside the bounds: 0
    ("sequence_truncate", None, 3.0, [[1.0]]),  # exp(1 - 1): the product over the completion's tokens
    ("sequence_mask", 1.5, None, [[0.0]]),  # below clip_min: masked
])
def test_importance_weights_follow_trls_modes(mode, clip_min, clip_max, expected):
    policy, sampling = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert torch.allclose(importance_weights(policy, sampling, mask, mode, clip_min, clip_max), torch.tensor(expected))
