"""Asynchronous generation (``generation.async``) and ``generation.weight_sync_every`` against the session's real tiny
vLLM server: each batch trains one version behind the policy, every push is still verified, nothing of the producer
is left when the run ends; with pushes every other step, the steps between reuse the last pushed weights."""

import threading

import pytest

from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.entry import run
from tests.integration.trainjob import history, job

pytestmark = pytest.mark.slow


def test_async_trains_one_version_behind_with_verified_pushes(tmp_path, tiny_model_path, tiny_tokenizer,
                                                              tiny_server):
    run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 4},
            generation={"async": {"max_staleness": 1}}))
    steps = history(tmp_path)
    assert [h["step"] for h in steps] == [1, 2, 3, 4]
    # the first batch is sampled after the first push; each later one was sampled while the step before trained
    assert [h["async/staleness"] for h in steps] == [0, 1, 1, 1]
    assert [h["weight_sync/version"] for h in steps] == [0, 1, 2, 3]  # a push every step, each verified
    for h in steps:
        assert h["async/dropped"] == 0 and h["async/missed"] == 0  # the producer sampled the batches TRL asked for
        assert h["weight_sync/probe_logp_diff"] < 1e-3  # the policy's probe checks each push (the policy moves on)
        assert "sampling/importance_sampling_ratio/mean" in h  # the correction weighs the lag
    assert steps[0]["weight_sync/first_batch_logp_diff"] < 1e-3  # the one batch sampled by the policy of its step
    assert VLLMClient(tiny_server.endpoint).weight_version() == "step-3"
    assert not [t for t in threading.enumerate() if t.name == "rollout-producer"]
    assert list((tmp_path / "sync").iterdir()) == []


def test_weight_sync_every_two_steps_reuses_the_last_push(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 4},
            generation={"weight_sync_every": 2}))
    steps = history(tmp_path)
    assert [h.get("weight_sync/version") for h in steps] == [0, None, 2, None]  # pushed at steps 0 and 2 only
    assert VLLMClient(tiny_server.endpoint).weight_version() == "step-2"
