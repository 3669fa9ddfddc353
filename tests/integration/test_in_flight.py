"""A weight push in flight (``generation.async.in_flight``) on the session's real tiny vLLM server: a completion in
progress when the push lands finishes with tokens of both versions, vLLM says which, and each token's sampler logprob
is the one its own version gives it, so TRL's importance weight of every token equals a hand computation from the two
versions' logprobs."""

import threading
import time

import pytest
import requests
import torch

from grpo_steps.config import GenerationConfig
from grpo_steps.data import encode_prompt, to_prompt
from grpo_steps.servers.engine_metrics import parse_engine_metrics
from grpo_steps.training.sampling import processed_logprobs
from grpo_steps.training.zero_signal.plan import importance_weights
from grpo_steps.weights.files import save_weights
from grpo_steps.weights.labels import version_label
from grpo_steps.weights.update import WeightUpdate

pytestmark = pytest.mark.slow

LONG = 900
"""Tokens of the completion in flight: long enough (seconds on the tiny model) for the push to land inside it, within
the session server's 1024-token context. 300 was too short on an idle 2-core box (2026-12-07): the request finished
before the push landed, one version for the whole completion."""


def _engine(client) -> dict[str, float]:
    metrics = requests.get(f"{client.endpoint}/metrics", headers=dict(client._http.headers), timeout=10).text
    return parse_engine_metrics(metrics)


def test_a_push_in_flight_splits_a_completion_between_two_versions(tiny_server, tiny_model_path, tiny_tokenizer,
                                                                   tmp_path):
    from transformers import AutoModelForCausalLM

    client = tiny_server.client()
    old = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    client.update_weights(WeightUpdate.of_directory(save_weights(old, tmp_path / "old")), version_label(0))
    new_dir = str(save_weights(new, tmp_path / "new"))
    assert client.serves_token_generate()
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 2 + 3.", None))
    gen = GenerationConfig(max_completion_tokens=LONG, temperature=1.0)

    sampled: dict = {}

    def sample():
        sampled["group"] = client.complete([ids], 1, max_tokens=LONG, temperature=1.0, versions=True,
                                           request={"ignore_eos": True})[0]

    produced = _engine(client).get("generation_tokens", 0.0)
    producer = threading.Thread(target=sample)
    producer.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # the request is in the engine's batch and has sampled a few tokens
        now = _engine(client)
        if now.get("requests_running", 0.0) >= 1 and now.get("generation_tokens", 0.0) >= produced + 4:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the long request never started sampling within 300 s")
    client.pause_mode = "keep"
    try:
        client.update_weights(WeightUpdate.of_directory(new_dir), version_label(1))
    finally:
        client.pause_mode = "wait"
    producer.join(120)
    (sample,) = sampled["group"]
    completion = sample["completion_ids"]
    assert len(completion) == LONG
    (first, start0, cut), (second, cut1, end) = sample["versions"]  # exactly two spans, in order
    assert (first, second, start0, end) == ("step-0", "step-1", 0, LONG) and cut == cut1
    assert 0 < cut < LONG  # the push landed inside the completion: tokens of both versions
    assert client.weight_version() == "step-1"

    # each token's sampler logprob is its own version's (the frozen request's KV recomputed by the new weights)
    server = torch.tensor(sample["logprobs"], dtype=torch.float64)
    by_old = torch.tensor(processed_logprobs(old, ids, completion, gen), dtype=torch.float64)
    by_new = torch.tensor(processed_logprobs(new, ids, completion, gen), dtype=torch.float64)
    assert torch.allclose(server[:cut], by_old[:cut], atol=2e-3)
    assert torch.allclose(server[cut:], by_new[cut:], atol=2e-3)
    assert not torch.allclose(server[cut:], by_old[cut:], atol=2e-3)  # the versions differ where it matters

    # TRL's importance weight of each token against a third policy: the hand computation from the two versions
    policy = by_new + 0.01 * torch.randn(LONG, dtype=torch.float64)
    mask = torch.ones(1, LONG)
    weights = importance_weights(policy[None], server[None], mask, "token_truncate", None, 10.0)[0]
    by_hand = torch.cat([torch.exp(policy[:cut] - by_old[:cut]), torch.exp(policy[cut:] - by_new[cut:])])
    assert torch.allclose(weights.double(), by_hand.clamp(max=10.0), rtol=5e-3)
    client.reload_weights(tiny_model_path)  # the shared server back on the tiny model's weights
