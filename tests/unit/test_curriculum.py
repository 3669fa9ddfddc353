"""train.curriculum: pools and weights by hand, the running pass rate, the lag, and a kill/resume (on the same gang
and on another) that draws the same next generation batches as the uninterrupted run, through the checkpoint save of
the training process (grpo_steps.training.curriculum)."""

from types import SimpleNamespace

import pytest

from grpo_steps.config import REPO_ROOT, ConfigError, CurriculumConfig, load_config, validate_config
from grpo_steps.training.curriculum.state import STATE_FILE, PassRates, lag_for, pool_shares

WEIGHTS = {"unseen": 1.0, "hard": 0.1, "learnable": 1.0, "easy": 0.1}


def rates(n: int = 12, lag: int = 1, priors=None, **config) -> PassRates:
    return PassRates([f"p{i:02d}" for i in range(n)], CurriculumConfig(**config), seed=7, lag=lag, priors=priors)


def test_pools_follow_the_thresholds_and_the_prior():
    state = rates(6, priors=[None, 0.0, 0.1, 0.5, 0.9, 1.0])
    assert state.pools() == {"unseen": [0], "hard": [1, 2], "learnable": [3], "easy": [4, 5]}


def test_pool_shares_by_hand():
    # every pool holds prompts: the weights over their sum, 2.2
    assert pool_shares({"unseen": 1, "hard": 1, "learnable": 1, "easy": 1}, WEIGHTS) == pytest.approx(
        {"unseen": 1 / 2.2, "hard": 0.1 / 2.2, "learnable": 1 / 2.2, "easy": 0.1 / 2.2})
    # unseen and learnable empty: hard and easy share everything, half each, however large the pools
    assert pool_shares({"unseen": 0, "hard": 9, "learnable": 0, "easy": 1}, WEIGHTS) == {
        "unseen": 0.0, "hard": 0.5, "learnable": 0.0, "easy": 0.5}
    # a pool of weight 0 takes nothing even when it alone holds prompts
    assert pool_shares({"unseen": 0, "hard": 3, "learnable": 0, "easy": 0}, {**WEIGHTS, "hard": 0.0}) == {
        "unseen": 0.0, "hard": 0.0, "learnable": 0.0, "easy": 0.0}


def test_the_running_pass_rate_is_an_exponential_moving_average():
    state = rates(3, lag=0, priors=[0.5, None, None], ema=0.5)
    state.observe(0, step=1, groups=[("p00", 3, 4), ("p01", 1, 4)])
    state.draw(1, 1, current=1)  # batch 1 reads batch 0's groups (lag 0)
    assert state.rates == {"p00": 0.625, "p01": 0.25}  # 0.5 + 0.5 x (0.75 - 0.5); a first group sets the rate
    state.observe(1, step=2, groups=[("p01", 2, 4)])
    state.draw(2, 1, current=2)
    assert state.rates["p01"] == 0.375
    assert state.groups == {"p00": 1, "p01": 2}
    assert state.history == {1: [0, 0, 1, 0, 0, 0, 0, 1, 0, 0], 2: [0, 0, 0, 0, 0, 1, 0, 0, 0, 0]}


def test_the_draw_takes_each_pool_by_its_share_and_no_prompt_twice():
    # 2 learnable prompts, 10 easy: learnable's share 1 / 1.1, so the learnable ones are in nearly every batch
    state = rates(12, lag=0, priors=[0.5, 0.5] + [1.0] * 10)
    batches = [state.draw(k, 3, current=k) for k in range(400)]
    assert all(len(set(rows)) == 3 for rows in batches)
    learnable = sum(rows.count(0) + rows.count(1) for rows in batches)
    assert 0.95 * 800 < learnable <= 800  # each batch holds at most both; easy takes the third place
    assert state.plan_pools[0].count("easy") >= 1
    assert rates(12, lag=0).draw(5, 3, current=5) == rates(12, lag=0).draw(5, 3, current=5)  # (seed, batch) decide


def test_a_pool_of_weight_0_is_never_drawn_and_too_few_prompts_are_refused():
    state = rates(4, lag=0, priors=[0.0, 0.0, 0.5, 0.5], hard_weight=0.0)
    assert sorted(state.draw(0, 2, current=0)) == [2, 3]
    with pytest.raises(ValueError, match="only 2 are in pools with a weight above 0"):
        state.draw(1, 3, current=1)


def test_observations_newer_than_the_lag_do_not_change_a_draw_and_reading_too_far_ahead_is_refused():
    early, late = rates(lag=1), rates(lag=1)
    for state in (early, late):
        state.observe(0, step=1, groups=[(f"p{i:02d}", 4, 4) for i in range(6)])
    late.observe(1, step=2, groups=[(f"p{i:02d}", 0, 4) for i in range(6, 12)])  # batch 1: too new for batch 2
    assert early.draw(2, 4, current=1) == late.draw(2, 4, current=1)
    with pytest.raises(RuntimeError, match="more than the lag of 1 batches ahead"):
        early.draw(4, 4, current=2)
    assert lag_for(0) == 1 and lag_for(3) == 4


class Base:
    """TRL's RepeatSampler as the curriculum's sampler reads it."""

    def __init__(self, rows: int, chunk: int, mini: int, repeat: int) -> None:
        self.batch_size, self.mini_repeat_count, self.repeat_count = chunk, mini, repeat
        self.length = rows // chunk * chunk * mini * repeat

    def __len__(self) -> int:
        return self.length


def passes(prompt: str) -> int:
    """A prompt's passes out of 4, the same in every run: 0, 1, 2, 3 or 4 by its number."""
    return int(prompt[1:]) % 5


def train(states: list[PassRates], base: Base, batches: range, skip: int = 0,
          depth: int = 0) -> dict[int, list[int]]:
    """Train ``batches`` as the trainer reads them, on one sampler per process (``states``: each process's
    curriculum): each batch's positions and one more (accelerate reads one batch ahead), then the batch's groups,
    gathered, observed on every process. With ``depth``, a second sampler on each process's curriculum reads ``depth``
    batches further ahead (and one position more) before each batch is generated, as ``generation.async``'s prompt
    stream does. Returns batch -> rows, asserting that every process drew the same."""
    from grpo_steps.training.curriculum.sampler import CurriculumSampler

    current = {"batch": batches.start}
    samplers = [CurriculumSampler(base, s, lambda: current["batch"], lambda: skip) for s in states]

    def positions(sampler):
        while True:  # one iterator per epoch, as transformers' Trainer makes them
            yield from sampler

    streams = [positions(sampler) for sampler in samplers]
    per_batch = base.batch_size * base.mini_repeat_count * base.repeat_count
    prompt_streams = [positions(CurriculumSampler(base, s, lambda: current["batch"], lambda: skip))
                      for s in states] if depth else []
    read_ahead = [[next(stream) for _ in range(skip)] for stream in prompt_streams]
    for stream in streams:
        assert [next(stream) for _ in range(skip)] == [0] * skip  # placeholders the trainer skips
    ahead = [[next(stream)] for stream in streams]
    trained = {}
    for batch in batches:
        current["batch"] = batch
        wanted = skip + (batch + depth + 1 - batches.start) * per_batch + 1  # through batch + depth, one more
        for buffer, stream in zip(read_ahead, prompt_streams, strict=True):
            buffer.extend(next(stream) for _ in range(wanted - len(buffer)))
        for buffer, stream in zip(ahead, streams, strict=True):
            buffer.extend(next(stream) for _ in range(per_batch))  # the batch's positions, then the next one
        read = [buffer[:per_batch] for buffer in ahead]
        ahead = [buffer[per_batch:] for buffer in ahead]
        assert all(r == read[0] for r in read)  # every process draws the same batch
        rows = read[0][:base.batch_size * base.mini_repeat_count:base.mini_repeat_count]
        trained[batch] = rows
        ids = [states[0].ids[row] for row in rows]
        for state in states:
            state.observe(batch, step=batch + 1, groups=[(prompt, passes(prompt), 4) for prompt in ids])
    return trained


def save(state: PassRates, output_dir, step: int) -> str:
    """The checkpoint save of the training process: the curriculum's callback on a trainer save."""
    from grpo_steps.training.curriculum.sampler import CurriculumCallback

    checkpoint = output_dir / f"checkpoint-{step}"
    checkpoint.mkdir(parents=True)
    CurriculumCallback(state).on_save(SimpleNamespace(output_dir=str(output_dir)),
                                      SimpleNamespace(global_step=step, is_local_process_zero=True), None)
    assert (checkpoint / STATE_FILE).exists()
    return str(checkpoint)


@pytest.mark.parametrize(("processes", "repeat"), [(1, 2), (2, 1), (3, 4)])
def test_a_kill_and_resume_draws_the_same_next_batches_as_the_uninterrupted_run(tmp_path, processes, repeat):
    # 12 prompts, 3 per generation batch: 4 batches an epoch; killed after batch 5 (step 6), in the second epoch.
    # (1, 2): the same gang; (2, 1) and (3, 4): another gang size, whose gradient accumulation (the chunk's repeats)
    # differs while the prompts per step stay the same, as an elastic resume requires
    uninterrupted = rates()
    whole = train([uninterrupted], Base(12, 3, 4, 2), range(12))
    killed = rates()
    before = train([killed], Base(12, 3, 4, 2), range(6))
    assert before == {k: whole[k] for k in range(6)}
    checkpoint = save(killed, tmp_path, 6)
    resumed = [rates().load(checkpoint) for _ in range(processes)]
    assert all(s.resumed_batch == 6 for s in resumed)
    per_batch = 3 * 4 * repeat
    after = train(resumed, Base(12, 3, 4, repeat), range(6, 12), skip=2 * per_batch)  # 2 batches into epoch 1
    assert after == {k: whole[k] for k in range(6, 12)}
    # the curriculum steered: batches after the first epoch draw the prompts whose pass rate is learnable (1-3 of 4)
    learnable = sum(1 <= passes(f"p{row:02d}") <= 3 for k in range(8, 12) for row in whole[k])
    assert learnable >= 9  # of 12 places; uniform order would give 12 x 3/5 on average
    assert resumed[0].history == uninterrupted.history


def test_a_checkpoint_of_other_data_is_refused_and_one_without_a_curriculum_starts_fresh(tmp_path):
    state = rates()
    state.observe(0, step=1, groups=[("p03", 2, 4)])
    checkpoint = save(state, tmp_path, 1)
    with pytest.raises(ValueError, match="not in this run's training set"):
        PassRates(["q"], CurriculumConfig(), seed=7, lag=1).load(checkpoint)
    (tmp_path / "checkpoint-2").mkdir()
    assert rates().load(tmp_path / "checkpoint-2").resumed_batch == 0


def test_start_refuses_what_cannot_work():
    base = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()

    def with_curriculum(curriculum: dict, **train) -> dict:
        return {**base, "train": {**base["train"], "curriculum": curriculum, **train}}

    for curriculum, train, message in (
            ({"pass_reward": "accuracy"}, {}, "is not one of the configured rewards"),
            ({}, {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 4,
                  "grpo": {"steps_per_generation": 1}}, "remove steps_per_generation"),
            ({"prior_column": "level"}, {}, "add it to data.columns"),
            ({}, {"grpo": {"shuffle_dataset": False}}, "remove shuffle_dataset, or set train.curriculum: null"),
            ({"hard_threshold": 0.6, "easy_threshold": 0.5}, {}, "must be below easy_threshold"),
            ({"learnable_weight": 0}, {}, "must be above 0")):
        with pytest.raises(ConfigError, match=message):
            validate_config(with_curriculum(curriculum, **train))
    assert validate_config(with_curriculum({"pass_reward": "answer_accuracy"})).train.curriculum.ema == 0.5
    # shuffled draws are what the curriculum does anyway (at random within the pools)
    assert validate_config(with_curriculum({}, grpo={"shuffle_dataset": True})).train.curriculum is not None


def test_a_level_column_is_the_prior_and_a_bad_one_is_refused():
    from grpo_steps.training.curriculum.sampler import build

    base = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()
    base["data"]["columns"] = {"level": "level"}
    base["train"]["curriculum"] = {"prior_column": "level", "prior": "level"}
    cfg = validate_config(base)
    rows = [{"prompt": [{"role": "user", "content": str(i)}], "level": level} for i, level in enumerate([1, 3, 2])]
    curriculum = build(cfg, SimpleNamespace(seed=1), rows, None)
    assert list(curriculum.rates.rates.values()) == [1.0, 0.0, 0.5]
    assert curriculum.rates.pools() == {"unseen": [], "hard": [1], "learnable": [2], "easy": [0]}
    rows[1]["level"] = "hard"
    with pytest.raises(ValueError, match="values must be numbers"):
        build(cfg, SimpleNamespace(seed=1), rows, None)


def test_the_picture_is_a_png(tmp_path):
    from grpo_steps.training.curriculum.picture import pass_rate_heatmap

    path = pass_rate_heatmap({1: [3, 0, 0, 0, 0, 1, 0, 0, 0, 0], 3: [0] * 9 + [2]}, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resamples_extra_prompts_come_from_the_pools_by_their_weights():
    from grpo_steps.training.curriculum.sampler import Curriculum
    from grpo_steps.training.zero_signal.resample import extra_rows

    state = rates(8, priors=[0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0], hard_weight=0.0, easy_weight=0.0)
    trainer = SimpleNamespace(args=SimpleNamespace(seed=3), state=SimpleNamespace(global_step=5),
                              accelerator=SimpleNamespace(process_index=0), num_generations=2,
                              train_dataset=[{"row": i} for i in range(8)], curriculum=Curriculum(state, state.config))
    rows = extra_rows(trainer, 4, 1)
    assert len(rows) == 8 and rows[0] == rows[1]  # 4 groups of 2, each prompt twice in a row
    assert {r["row"] for r in rows} == {2, 3, 4}  # only the learnable pool weighs: its 3 prompts, the 4th repeated
    assert rows == extra_rows(trainer, 4, 1)  # seeded by the seed, the step, the round and the process


def test_a_prompt_stream_reading_ahead_draws_the_same_batches_within_its_lag():
    # generation.async's stream reads 2 batches ahead of the trainer: lag 3 (lag_for(2)) holds its reads, and the
    # batches are those of a run drawing with the same lag and no stream; lag 1 refuses the stream's read
    with_stream = train([rates(lag=lag_for(2))], Base(12, 3, 4, 1), range(10), depth=2)
    assert with_stream == train([rates(lag=lag_for(2))], Base(12, 3, 4, 1), range(10))
    with pytest.raises(RuntimeError, match="more than the lag of 1 batches ahead"):
        train([rates(lag=1)], Base(12, 3, 4, 1), range(10), depth=2)


def test_the_runs_description_names_the_picture_with_a_curriculum():
    from grpo_steps.evaluation.report import run_description

    base = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()
    report = {"baseline": {"metrics": {"pass@1": 0.1}}, "gain": {"pass@1": 0.1, "pass@1_ci95": 0.05},
              "trained": {"metrics": {"pass@1": 0.2}, "per_prompt": {"pass@1": [0.2, 0.2]}}}
    version = {"gate_passed": True, "gate_reason": "gain above 0", "name": "m", "version": 1, "aliases": []}
    texts = [run_description(validate_config({**base, "train": {**base["train"], "curriculum": curriculum}}), report,
                             version, run_pathspec="GRPOFlow/1", version_url="#/models/m/versions/1")
             for curriculum in (None, {})]
    assert "curriculum/pass_rate.png" not in texts[0] and "run artifact `curriculum/pass_rate.png`" in texts[1]
