"""Groups without signal on the server path, against the session's real tiny vLLM server: both rewards weigh 0, so
every group's rewards are all equal (the random tiny policy does sometimes write "Answer: N"). ``resample`` generates
the most rounds it may and still trains a batch of the configured size; ``skip`` runs no training pass and leaves the
weights as they were."""

import pytest
from safetensors.torch import load_file

from grpo_steps.training.entry import run
from tests.integration.trainjob import history, job

pytestmark = pytest.mark.slow
FLAT = [{"name": "answer_accuracy", "weight": 0.0}, {"name": "answer_format", "weight": 0.0}]


def test_resample_generates_up_to_its_cap_on_flat_groups(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint,
            train={"max_steps": 2, "zero_signal_groups": "resample", "max_resample_rounds": 3}, rewards=FLAT))
    steps = history(tmp_path)
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert h["frac_reward_zero_std"] == 1.0 and h["zero_signal/frac_before"] == 1.0
        assert h["zero_signal/rounds"] == 3 and h["zero_signal/groups_generated"] == 3 * 2  # 2 groups a round
        assert h["zero_signal/frac_after"] == 1.0  # nothing found: the first round's groups fill the batch


def test_skip_trains_nothing_on_flat_groups(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    final = run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint,
                    train={"max_steps": 2, "zero_signal_groups": "skip"}, rewards=FLAT))
    assert [h["zero_signal/skipped_share"] for h in history(tmp_path)] == [1.0, 1.0]
    trained, base = load_file(f"{final}/model.safetensors"), load_file(f"{tiny_model_path}/model.safetensors")
    assert all((trained[name] == base[name]).all() for name in base)
