"""The policy learns: a short GRPO run on the tiny model, rollouts from the real tiny vLLM server, against a reward it
can learn in a few steps, and the reward goes up (prime-rl's integration tests check the same of their runs).

The reward is DAPO's soft overlong punishment with its soft zone over nearly the whole completion budget (0 for at
most 2 tokens, then down to -1 at 16): the policy earns more by ending its completions sooner, something the tiny
model can learn in a handful of steps at a high learning rate.

Checked once by hand on the 2-core CI machine (2026-11-25): with the advantages negated (a monkeypatch of
``ServerGRPOTrainer._generate_and_score_completions`` returning ``-advantages``) this test fails: the reward went
-0.43 -> -1.0 over the 6 steps, the mean completion length 8.1 -> 16.0 tokens (the budget). So a sign error
anywhere between the reward and the update fails it. (Backend ``hf``, 10 steps: -0.34 -> -0.07, length 6.8 -> 3.0.)

Sized against its noise (2026-11-26, the 2-core box): at 6 steps of 16 completions with a decaying learning rate
the gain of the last two steps over the first ranged 0.10-0.37 over 9 runs, and one CI run failed the 0.1 margin
(-0.29 -> -0.19). Now 10 steps of 32 completions at a constant learning rate: over 8 runs the last three steps'
mean beat the first step by 0.28-0.43 (most runs end at 0.0, completions of 1-2 tokens); with the advantages
negated 2 of 2 runs went to -1.0 by step 3.
"""

import json

import pytest

from grpo_steps.config import REPO_ROOT, load_config, validate_config
from grpo_steps.data import prepare
from grpo_steps.training.entry import run
from grpo_steps.training.job import TrainJob

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
STEPS = 10
MARGIN = 0.15
"""The mean reward of the last three steps must beat the first step's by this much (measured: 0.28-0.43)."""


def test_the_reward_goes_up(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    base = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()
    base["generation"].update(max_completion_tokens=MAX_TOKENS, sync_dir=str(tmp_path / "sync"))
    base["rewards"] = [{"name": "soft_overlong_punishment",
                        "options": {"max_completion_len": MAX_TOKENS, "soft_punish_cache": MAX_TOKENS - 2}}]
    base["eval"].update(correctness_reward="soft_overlong_punishment", format_reward=None)
    base["train"].update(max_steps=STEPS, save_steps=100, learning_rate=1e-3, per_device_train_batch_size=32,
                         grpo={"lr_scheduler_type": "constant"})  # a decayed rate stalled some runs short of the margin
    cfg = validate_config(base)
    train_file = tmp_path / "train.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in prepare(cfg.data, tiny_tokenizer).train))
    run(TrainJob(config=cfg, model_path=tiny_model_path, train_file=str(train_file), output_dir=str(tmp_path / "out"),
                 server=tiny_server.to_dict()))

    history = [h for h in json.loads((tmp_path / "out" / "log_history.json").read_text()) if "reward" in h]
    rewards = [h["reward"] for h in history]
    lengths = [h["completions/mean_length"] for h in history]
    assert len(rewards) == STEPS
    assert sum(rewards[-3:]) / 3 > rewards[0] + MARGIN, (rewards, lengths)
    assert sum(lengths[-3:]) / 3 < lengths[0], (rewards, lengths)  # by ending sooner
