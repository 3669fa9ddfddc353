"""The generation class's rollout modes (:mod:`grpo_steps.training.generation.async_rollouts`) through their own
interface, with the sampling handed in: what a prefetched first turn is, which one is refused, and what the producer
samples with. The sampler stands in for the server (its answers are scripted: the labels a restarted replica gives
cannot be had from a live server on demand); the prefetcher thread and the client are the real ones."""

from types import SimpleNamespace

from grpo_steps.config import GenerationConfig
from grpo_steps.servers.capabilities import ServerCapabilities
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation.async_rollouts import AsyncRollouts, SyncRollouts, rollout_mode
from grpo_steps.training.generation.settings import PolicyView, ServerSettings

GROUP = 2


def _policy(logged: list, step: dict) -> PolicyView:
    """A training policy at optimizer step ``step["now"]``: one generation batch per micro-step key, trained at the
    optimizer step of its key; its metrics appended to ``logged``."""
    return PolicyView(accelerator=None, model=lambda: SimpleNamespace(training=True), state_dict=dict,
                      step=lambda: step["now"], micro_step=lambda: step["now"],
                      log=lambda name, value: logged.append((name, value)),
                      prompt_stream=lambda max_staleness, sync_every: (
                          1, lambda key: [(key + 1, [[key + 1]] * GROUP)], lambda key: key))


def _settings(**async_settings) -> ServerSettings:
    # the capabilities the server's handle recorded at provisioning: no request asks them again
    client = VLLMClient("http://127.0.0.1:9", "base", capabilities=ServerCapabilities(transfer_engine=True,
                                                                                       token_route=True))
    return ServerSettings(client=client, gen=GenerationConfig(), max_model_len=256, transport=None, probe_ids=[1],
                          probe_tolerance=1e-3, **async_settings)


def test_a_prefetched_batch_with_a_span_this_run_did_not_push_is_sampled_again():
    """Pushes in flight: the first turn of key 0 (every token from this run's step-0) is served from the producer,
    with its per-token staleness; key 1's holds a span labelled ``default`` (a replica restarted mid-request) and is
    refused (counted, sampled now by the caller); a second call at the same key (resample's extra rounds) is sampled
    now too."""
    logged, step, asked = [], {"now": 0}, []

    def sample(client, prompts, group, versions=False):
        asked.append((client, versions))
        label = "default" if prompts[0] == [1] else "step-0"
        return [[{"completion_ids": [7, 8], "logprobs": [-1.0, -2.0], "versions": [(label, 0, 2)]}] * group
                for _ in prompts[::group]]

    settings = _settings(max_staleness=1, in_flight=None)
    rollouts = rollout_mode(settings, _policy(logged, step), sample, lambda: 0)
    assert isinstance(rollouts, AsyncRollouts)
    rollouts.pushed(0)
    try:
        samples, version = rollouts.first_turn(0, [[0]] * GROUP, GROUP)
        assert version == 0 and samples[0][0]["completion_ids"] == [7, 8]
        assert rollouts.updates_in_flight and settings.client.pause_mode == "keep"
        assert rollouts.token_versions == [[(0, 0, 2)]] * GROUP
        step["now"] = 1
        assert rollouts.first_turn(1, [[1]] * GROUP, GROUP) is None
        assert rollouts.first_turn(1, [[1]] * GROUP, GROUP) is None
    finally:
        rollouts.close()
    metrics = dict(logged)
    assert ("async/foreign_span_batches", 0.0) in logged and metrics["async/foreign_span_batches"] == 1.0
    assert ("async/token_staleness_max", 0.0) in logged and ("async/staleness", 0.0) in logged
    # the producer sampled through its own client (its own session), each token labelled by its weight version
    assert asked and all(client is not settings.client and versions for client, versions in asked)


def test_without_async_every_first_turn_is_sampled_now_and_an_adapter_push_renames_the_producers_model():
    """No ``generation.async`` (or no policy): the sync mode, which prefetches nothing. With an adapter push the
    producer drains instead of going in flight and samples the adapter the last push named."""
    logged, step = [], {"now": 0}
    assert isinstance(rollout_mode(_settings(), _policy(logged, step), None, lambda: 0), SyncRollouts)
    assert isinstance(rollout_mode(_settings(max_staleness=1), None, None, lambda: 0), SyncRollouts)
    assert SyncRollouts().first_turn(0, [[0]], 1) is None

    models = []

    def sample(client, prompts, group, versions=False):
        models.append((client.model, versions))
        return [[{"completion_ids": [7], "logprobs": [-1.0]}] * group for _ in prompts[::group]]

    settings = _settings(max_staleness=1, lora="adapter", in_flight=None)
    rollouts = rollout_mode(settings, _policy(logged, step), sample, lambda: step["now"])
    try:
        assert rollouts.first_turn(0, [[0]] * GROUP, GROUP)[1] == 0
        assert not rollouts.updates_in_flight
        with rollouts.push_window():  # the producer's request for key 1 ends before the push
            settings.client.model = "base-adapter-step-1"
            step["now"] = 1
            rollouts.pushed(1)
        assert rollouts.first_turn(1, [[1]] * GROUP, GROUP) is not None
        assert rollouts.first_turn(2, [[2]] * GROUP, GROUP) is not None
    finally:
        rollouts.close()
    assert models[-1] == ("base-adapter-step-1", False)
    assert any(name == "weight_sync/drain_seconds" for name, _ in logged)
