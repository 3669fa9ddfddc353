"""Asynchronous generation (``generation.async``) and ``generation.weight_sync_every`` against the session's real tiny
vLLM server: each batch trains within max_staleness of the policy, every push is still verified, nothing of the
producer is left when the run ends; with pushes every other step, the steps between reuse the last pushed weights."""

import threading

import pytest

from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.entry import run
from tests.integration.trainjob import history, job

pytestmark = pytest.mark.slow


def test_async_trains_within_max_staleness_with_verified_pushes(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                 tiny_server):
    """max_staleness 2 with a push every other step (weight_sync_every 2): one batch is sampled ahead, by the weights
    of the last push, so a batch is 0, 1, 2, 1 steps older than the policy that trains on it."""
    run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 4},
            generation={"async": {"max_staleness": 2}, "weight_sync_every": 2}))
    steps = history(tmp_path)
    assert [h["step"] for h in steps] == [1, 2, 3, 4]
    # step 1 trains the batch sampled after the first push; step 2 the one sampled while step 1 trained (version 0);
    # step 3's batch was sampled during step 2, still by version 0; step 4's after the push of version 2
    assert [h["async/staleness"] for h in steps] == [0, 1, 2, 1]
    assert [h.get("weight_sync/version") for h in steps] == [0, None, 2, None]  # pushed at steps 0 and 2 only
    for h in steps:
        assert h["async/dropped"] == 0 and h["async/missed"] == 0  # the producer sampled the batches TRL asked for
        assert "sampling/importance_sampling_ratio/mean" in h  # the correction weighs the lag
        # pushes in flight (the default on this server): none waits for the request in flight; staleness per token
        assert "weight_sync/drain_seconds" not in h
        assert h["async/token_staleness_max"] <= 2 and h["async/token_staleness_mean"] <= h["async/staleness"]
        assert h["async/off_policy_in_flight"] <= 2 and h["async/off_policy_in_queue"] <= 2  # admission's bound
    assert [h["async/token_staleness_max"] for h in steps] == [h["async/staleness"] for h in steps]  # oldest token
    for h in (steps[0], steps[2]):
        assert h["weight_sync/probe_logp_diff"] < 1e-3  # the policy's probe checks each push (the policy moves on)
    assert steps[0]["weight_sync/first_batch_logp_diff"] < 1e-3  # the one batch sampled by the policy of its step
    assert VLLMClient(tiny_server.endpoint).weight_version() == "step-2"
    assert not [t for t in threading.enumerate() if t.name == "rollout-producer"]  # nothing left running
    assert list((tmp_path / "sync").iterdir()) == []
