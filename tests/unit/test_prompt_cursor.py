"""The data cursor (:mod:`grpo_steps.training.cursor`): TRL's sampler order, resumed by the set of consumed prompt ids
on any gang; the elastic plan's refusals and RNG states (:mod:`grpo_steps.elastic`)."""

import pytest
import torch
from trl.trainer.utils import RepeatSampler

from grpo_steps.elastic import Gang, refusal, spread_rng_states
from grpo_steps.processes import wait_until
from grpo_steps.training.cursor import CursorSampler, PromptCursor, prompts_per_epoch
from grpo_steps.training.generation.prefetch import RolloutPrefetcher

ROWS, PROMPTS, GENERATIONS, REPEAT = 10, 2, 4, 1  # 10 prompts, 2 per generation batch (the last pair: whole)
IDS = [f"p{i}" for i in range(ROWS)]


def _trl(seed=7) -> RepeatSampler:
    return RepeatSampler(list(range(ROWS)), mini_repeat_count=GENERATIONS, batch_size=PROMPTS,
                         repeat_count=REPEAT, seed=seed)


def _batches(sequence: list[int]) -> list[list[int]]:
    """The distinct prompts of each generation batch of a sampler's sequence."""
    size = PROMPTS * GENERATIONS * REPEAT
    return [list(dict.fromkeys(sequence[i:i + size])) for i in range(0, len(sequence), size)]


def test_a_fresh_cursor_sampler_is_trls_order_epoch_after_epoch():
    trl, ours = _trl(), CursorSampler(_trl(), PromptCursor(IDS, prompts_per_epoch(ROWS, PROMPTS)), lambda: 0)
    for _ in range(3):  # TRL's generator moves on each epoch; ours draws epoch e's permutation from the seed
        assert list(ours) == list(trl)
    assert len(ours) == len(trl)


def test_a_resumed_epoch_skips_the_consumed_prompts_and_repeats_none():
    per_epoch = prompts_per_epoch(ROWS, PROMPTS)
    order = _batches(list(_trl()))  # the uninterrupted epoch 0
    cursor = PromptCursor(IDS, per_epoch)
    for batch in order[:2]:  # two generation batches trained before the checkpoint
        cursor.consume(IDS[i] for i in batch)
    resumed = PromptCursor(IDS, per_epoch, **cursor.state())
    skip = 2 * PROMPTS * GENERATIONS * REPEAT  # what transformers' Trainer skips by position
    sequence = list(CursorSampler(_trl(), resumed, lambda: skip))
    assert sequence == list(_trl())  # same prompts per batch: exactly TRL's sequence (bit-identical resume)
    trained = [i for b in _batches(sequence[skip:]) for i in b] + [i for b in order[:2] for i in b]
    assert sorted(trained) == list(range(ROWS))  # the epoch: each prompt once, none skipped


def test_consumed_prompts_out_of_order_are_not_trained_again():
    """A checkpoint whose consumed prompts are not the order's first batches (another number of prompts per
    generation batch before the resume): the rest of the epoch is cut anew from the prompts left."""
    consumed = {"p0", "p5", "p9"}
    resumed = PromptCursor(IDS, prompts_per_epoch(ROWS, PROMPTS), epoch=0, consumed=consumed)
    rest = list(CursorSampler(_trl(), resumed, lambda: 0))
    assert not {IDS[i] for i in rest} & consumed
    assert len(set(rest)) == 6  # 7 prompts left, 3 whole batches of 2: the last one is dropped as TRL drops it


def test_the_epoch_rolls_over_when_every_prompt_is_consumed():
    cursor = PromptCursor(IDS, prompts_per_epoch(ROWS, PROMPTS))
    cursor.consume(IDS)
    assert cursor.state() == {"epoch": 1, "consumed": []}


def test_a_stale_dropped_batch_does_not_pin_the_cursor():
    """trl #7274's case: a prefetched batch too stale to train is dropped; the trainer samples the same prompts
    again and consumes them once. The cursor moves past them: a resume neither replays the later prompts nor loses
    the dropped ones."""
    version = {"now": 0}
    prefetcher = RolloutPrefetcher(lambda prompts, n: prompts, lambda: version["now"], max_staleness=0, depth=2)
    cursor = PromptCursor(IDS, prompts_per_epoch(ROWS, PROMPTS))
    batches = [[IDS[0], IDS[1]], [IDS[2], IDS[3]], [IDS[4], IDS[5]]]
    prefetcher.fill([(k, [[ord(c) for c in b[0]]]) for k, b in enumerate(batches)], GENERATIONS, current_key=-1)
    # depth 2: batches 0 and 1 are sampled ahead, both by version 0
    assert wait_until(lambda: all(b.done for b in prefetcher.queue), timeout_s=10, interval_s=0.01)
    for key, batch in enumerate(batches):
        version["now"] = key  # one optimizer step per batch
        taken = prefetcher.take(key, [[ord(c) for c in batch[0]]], current_version=key)
        assert (taken is None) == (key > 0)  # batch 1: staleness 1 > 0, dropped; batch 2: never prefetched
        cursor.consume(batch)  # the trainer trains the batch (sampled again from the current weights if dropped)
    prefetcher.close()
    assert prefetcher.drain_stats().dropped == 1
    assert cursor.consumed == {f"p{i}" for i in range(6)}  # the dropped batch's prompts once, no gap
    resumed = PromptCursor(IDS, cursor.prompts_per_epoch, **cursor.state())
    rest = {IDS[i] for i in CursorSampler(_trl(), resumed, lambda: 0)}
    assert rest == {f"p{i}" for i in range(6, ROWS)}


def test_a_cursor_of_other_data_is_refused(tmp_path):
    PromptCursor(IDS, 10, consumed={"p1", "elsewhere"}).save(tmp_path)
    with pytest.raises(ValueError, match="1 consumed prompts are not in this run's training set"):
        PromptCursor.load(IDS, 10, tmp_path)


GANG = Gang(2, 1, 3, "m", None, "adamw_torch", 2)


@pytest.mark.parametrize(("new", "reason"), [
    (Gang(1, 2, 3, "m", None, "adamw_torch", 2), None),  # another layout of the same work: resumable
    (Gang(1, 1, 3, "other", None, "adamw_torch", 2), "trained model 'm', this run trains 'other'"),
    (Gang(1, 1, 3, "m", {"r": 8, "alpha": 16, "target_modules": "all-linear"}, "adamw_torch", 2), "holds LoRA none"),
    (Gang(1, 1, 3, "m", None, "sgd", 2), "optimizer state is 'adamw_torch'"),
    (Gang(1, 1, 0, "m", None, "adamw_torch", 2), "saved with DeepSpeed ZeRO, this run trains without"),
    (Gang(1, 1, 3, "m", None, "adamw_torch", 4), "trained 2 prompts per optimizer step, this run 4"),
])
def test_what_cannot_be_resumed_is_refused_with_the_reason(new, reason):
    found = refusal(GANG, new)
    assert found is None if reason is None else reason in found


LORA = {"r": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize(("peft", "reason"), [
    (LORA, None),  # the same adapter on another gang: resumable (its ZeRO-3 partitions converted)
    ({**LORA, "r": 16}, "holds LoRA {'r': 8, 'alpha': 16.0, 'target_modules': ['q_proj', 'v_proj']}, this run's "
                        "train.peft is {'r': 16"),
    ({**LORA, "target_modules": ["q_proj"]}, "this run's train.peft is {'r': 8, 'alpha': 16.0, 'target_modules': "
                                             "['q_proj']}"),
    (None, "this run's train.peft is none"),
])
def test_a_lora_zero3_checkpoint_continues_only_with_its_adapter_shape(peft, reason):
    found = refusal(Gang(1, 2, 3, "m", LORA, "adamw_torch", 2), Gang(1, 1, 3, "m", peft, "adamw_torch", 2))
    assert found is None if reason is None else reason in found, found


def test_each_new_process_gets_process_0s_rng_state(tmp_path):
    torch.save({"cpu": torch.random.get_rng_state()}, tmp_path / "rng_state_0.pth")
    torch.save({"cpu": torch.zeros(1)}, tmp_path / "rng_state_1.pth")
    spread_rng_states(tmp_path, 1)  # 2 -> 1: the single process's file is process 0's
    assert (tmp_path / "rng_state.pth").read_bytes() == (tmp_path / "rng_state_0.pth").read_bytes()
    spread_rng_states(tmp_path, 3)  # -> 3: process 2 has no saved stream: process 0's; 1 keeps its own
    assert (tmp_path / "rng_state_2.pth").read_bytes() == (tmp_path / "rng_state_0.pth").read_bytes()
    assert (tmp_path / "rng_state_1.pth").read_bytes() != (tmp_path / "rng_state_0.pth").read_bytes()


def test_a_checkpoint_without_its_gang_resumes_only_on_its_own_size(tmp_path):
    from grpo_steps.elastic import ResumeRefused, prepare_resume

    (tmp_path / "trainer_state.json").write_text('{"global_step": 2}')
    for i in (0, 1):  # saved by two processes before checkpoints recorded their gang
        (tmp_path / f"rng_state_{i}.pth").write_bytes(b"")
    assert prepare_resume(tmp_path, Gang(1, 2, 0, "m", None, "adamw_torch", 2)) is None  # as before: resumed as is
    with pytest.raises(ResumeRefused, match="saved by 2 processes before checkpoints recorded their gang"):
        prepare_resume(tmp_path, Gang(1, 1, 0, "m", None, "adamw_torch", 2))
    assert prepare_resume(tmp_path, Gang(2, 2, 0, "m", None, "adamw_torch", 2)) is None  # a node's share of 2 x 2
