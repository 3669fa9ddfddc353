"""The producer of ``generation.async`` (:class:`grpo_steps.training.generation.prefetch.RolloutPrefetcher`) with
constructed versions, and the config rules of ``generation.async`` / ``weight_sync_every`` / CPU cores."""

import threading
import time

import pytest

from grpo_steps.config import ConfigError, prefetch_depth, validate_config
from grpo_steps.training.generation.prefetch import RolloutPrefetcher


class Server:
    """What the producer calls: ``sample`` records each request with the version served when it started; a test can
    hold requests (``gate``) and change the version as a push would."""

    def __init__(self):
        self.version = 0
        self.requests: list[tuple[list, int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on: set[int] = set()

    def sample(self, prompts, num_generations):
        self.requests.append((prompts, self.version))
        self.gate.wait(10)
        if prompts[0][0] in self.fail_on:
            raise RuntimeError(f"server failed prompt {prompts[0][0]}")
        return [f"completions of {p[0]}" for p in prompts[::num_generations]]


def batch(n: int) -> list[list[int]]:
    return [[n, 1], [n, 1]]  # one group of 2


@pytest.fixture
def server():
    return Server()


def make(server, max_staleness=1, depth=1):
    return RolloutPrefetcher(server.sample, lambda: server.version, max_staleness=max_staleness, depth=depth)


def test_batches_carry_the_version_that_sampled_them(server):
    p = make(server, max_staleness=2, depth=2)
    p.fill([(0, batch(0)), (1, batch(1)), (2, batch(2))], 2, current_key=-1)  # 0 and 1: two ahead of the start
    first = p.take(0, batch(0), current_version=0)
    assert (first.result, first.version) == (["completions of 0"], 0)
    server.version = 1  # a push after step 1 (batch 1 may already be sampled by version 0)
    p.fill([(2, batch(2))], 2, current_key=0)
    second = p.take(1, batch(1), current_version=1)
    third = p.take(2, batch(2), current_version=2)
    assert second.version == 0 and third.version in (0, 1)
    assert [v for _, v in server.requests] == [0, 0, third.version]
    assert p.drain_stats().staleness == [0, 1, 2 - third.version]
    assert p.close()


def test_a_batch_older_than_max_staleness_never_trains(server):
    p = make(server, max_staleness=1, depth=1)
    p.fill([(0, batch(0)), (1, batch(1))], 2, current_key=-1)
    assert p.take(0, batch(0), current_version=0).version == 0
    p.fill([(1, batch(1))], 2, current_key=0)
    assert p.take(1, batch(1), current_version=2) is None  # sampled by version 0, the trainer is at 2: dropped
    stats = p.drain_stats()
    assert (stats.dropped, stats.staleness) == (1, [0])
    p.close()


def test_at_most_depth_batches_are_sampled_ahead(server):
    p = make(server, max_staleness=3, depth=2)
    added = p.fill([(k, batch(k)) for k in range(6)], 2, current_key=0)  # the trainer is at batch 0
    assert added == 2 and p.queued() == 2
    assert p.fill([(k, batch(k)) for k in range(6)], 2, current_key=0) == 0  # nothing queued twice
    p.take(1, batch(1), current_version=0)
    assert p.fill([(k, batch(k)) for k in range(6)], 2, current_key=1) == 1  # batch 3 joins 2
    p.close()
    assert {prompts[0][0] for prompts, _ in server.requests} <= {1, 2, 3}


def test_no_request_is_in_flight_during_a_push(server):
    p = make(server, max_staleness=1, depth=1)
    server.gate.clear()  # the request of batch 0 hangs until released
    p.fill([(0, batch(0))], 2, current_key=-1)
    while not server.requests:
        threading.Event().wait(0.01)
    entered = threading.Event()

    def push():
        with p.paused():
            entered.set()
            server.version = 1
            p.fill([(1, batch(1))], 2, current_key=0)  # queued during the push: must wait for the new weights

    pusher = threading.Thread(target=push)
    pusher.start()
    assert not entered.wait(0.3)  # the push waits for the request in flight
    server.gate.set()
    pusher.join(5)
    assert entered.is_set()
    assert p.take(0, batch(0), current_version=1).version == 0
    assert p.take(1, batch(1), current_version=1).version == 1  # started only after the push
    assert p.drain_stats().trainer_wait_s > 0.2
    p.close()


def test_unqueued_or_different_prompts_are_missed_not_trained(server):
    p = make(server)
    p.fill([(0, batch(0))], 2, current_key=-1)
    assert p.take(0, batch(9), current_version=0) is None  # the stream disagreed with the trainer: not used
    assert p.take(5, batch(5), current_version=0) is None
    assert p.drain_stats().missed == 2
    p.close()


def test_a_failed_request_is_raised_in_the_trainer(server):
    server.fail_on = {0}
    p = make(server)
    p.fill([(0, batch(0))], 2, current_key=-1)
    with pytest.raises(RuntimeError, match="server failed prompt 0"):
        p.take(0, batch(0), current_version=0)
    p.close()


def test_close_ends_the_thread_and_discards_the_queue(server):
    p = make(server, max_staleness=4, depth=4)
    server.gate.clear()
    p.fill([(k, batch(k)) for k in range(4)], 2, current_key=-1)
    server.gate.set()
    assert p.close() and not p.alive and p.queued() == 0
    assert len(server.requests) <= 1  # the one in flight at most; nothing started after the stop
    assert not [t for t in threading.enumerate() if t.name == "rollout-producer"]


def test_depth_follows_staleness_sync_interval_and_batch_span():
    assert prefetch_depth(1, 1, 1) == 1
    assert prefetch_depth(3, 1, 1) == 3
    assert prefetch_depth(3, 1, 2) == 2
    assert prefetch_depth(1, 2, 1) == 0


def _config(**generation):
    from grpo_steps.config import REPO_ROOT, load_config

    base = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump()
    base["generation"].update(generation)
    return base


@pytest.mark.parametrize("generation, train, message", [
    ({"async": True, "backend": "hf"}, {}, "generation.async applies to the server rollouts"),
    ({"weight_sync_every": 2, "mode": "colocate"}, {}, "generation.weight_sync_every applies to the server"),
    ({"async": True, "importance_sampling": {"mode": "off"}}, {}, "keep generation.importance_sampling on"),
    ({"async": {"max_staleness": 1}, "weight_sync_every": 2}, {}, "leaves no batch to sample ahead"),
    ({"async": {"max_staleness": 1}}, {"grpo": {"num_iterations": 2}}, "spans 2 optimizer step"),
    ({"server": {"cpu_cores": [0, 0]}}, {}, "must list distinct core numbers"),
    ({}, {"cpu_cores": []}, "must list distinct core numbers"),
])
def test_async_configs_that_cannot_work_are_refused(generation, train, message):
    base = _config(**generation)
    base["train"].update(train)
    with pytest.raises(ConfigError, match=message):
        validate_config(base)


class Counter:
    """An environment for the config check (an importable factory)."""

    def reset(self, **kwargs) -> str:
        return ""


def test_async_takes_tools_and_environments():
    """Tools and environments alike: the producer prefetches first turns (an environment reset ahead, its
    observation in the first prompt), the trainer's tool loop samples the follow-ups."""
    base = _config(**{"async": True})
    base["tools"] = ["grpo_steps.tools:calculator"]
    assert validate_config(base).generation.async_.max_staleness == 1
    del base["tools"]
    base["environment"] = f"{__name__}:Counter"
    assert validate_config(base).generation.async_.max_staleness == 1


def test_async_config_forms():
    assert validate_config(_config(**{"async": True})).generation.async_.max_staleness == 1
    cfg = validate_config(_config(**{"async": {"max_staleness": 2}, "weight_sync_every": 2}))
    assert (cfg.generation.async_.max_staleness, cfg.generation.weight_sync_every) == (2, 2)
    assert validate_config(_config(**{"async": False})).generation.async_ is None
    assert cfg.model_dump()["generation"]["async"] == {"max_staleness": 2, "in_flight": None,
                                                       "admission": "admit"}  # written back under its key


def _dies_at_its_first_request():
    def version() -> int:
        raise RuntimeError("weight version unreadable")  # in the producer thread, outside the sampled request

    return RolloutPrefetcher(lambda prompts, n: prompts, version, max_staleness=1, depth=2)


def test_a_dead_producer_raises_in_the_trainer_instead_of_blocking_it():
    from grpo_steps.training.generation.prefetch import ProducerDiedError

    prefetcher = _dies_at_its_first_request()
    prefetcher.fill([(0, [[1]]), (1, [[2]])], num_generations=1, current_key=-1)
    prefetcher._thread.join(5)  # the thread has died
    assert not prefetcher.alive
    started = time.monotonic()
    with pytest.raises(ProducerDiedError, match="weight version unreadable") as err:
        prefetcher.take(0, [[1]], current_version=0)
    assert time.monotonic() - started < 5  # within seconds (it waited forever before)
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_push_waiting_on_a_dead_producer_raises_too():
    from grpo_steps.training.generation.prefetch import ProducerDiedError

    prefetcher = _dies_at_its_first_request()  # it dies with its request marked in flight
    prefetcher.fill([(0, [[1]])], num_generations=1, current_key=-1)
    prefetcher._thread.join(5)
    with pytest.raises(ProducerDiedError), prefetcher.paused():
        pass


def test_closing_while_an_error_propagates_waits_briefly_for_a_hung_request(monkeypatch):
    from grpo_steps.training.generation import prefetch as async_rollouts

    monkeypatch.setattr(async_rollouts, "ERROR_STOP_TIMEOUT_S", 0.2)
    release = threading.Event()
    prefetcher = RolloutPrefetcher(lambda prompts, n: release.wait(60), lambda: 0, max_staleness=1, depth=1)
    prefetcher.fill([(0, [[1]])], num_generations=1, current_key=-1)
    while not prefetcher._request_running:  # the request hangs in flight
        time.sleep(0.01)
    started, closed = time.monotonic(), None
    with pytest.raises(ValueError):
        try:
            raise ValueError("a training step failed")
        finally:
            closed = prefetcher.close()  # as the training entry's finally does
    assert closed is False and time.monotonic() - started < 5  # not STOP_TIMEOUT_S (600 s)
    release.set()
    assert prefetcher.close() is True  # a clean close waits for the request, which now ends


def _trained_staleness(seed: int, admission: bool, in_flight: bool = False) -> tuple[list[int], int]:
    """A stand-in run over random timings: one generation batch per optimizer step, pushes every ``sync_every``
    steps, the producer allowed ``depth`` batches ahead, more than ``max_staleness`` would permit without admission;
    requests and training steps of random length; with ``in_flight`` a push lands while a request runs and the request
    reports the version it started on as its oldest token's. Returns the staleness of every batch trained and the
    number dropped."""
    import random

    rng = random.Random(seed)
    max_staleness = rng.choice([1, 2])
    sync_every, depth = rng.randint(1, max_staleness), max_staleness + 2
    served = {"version": 0}

    def sample(prompts, n):
        started = served["version"]
        time.sleep(rng.uniform(0, 0.004))
        return {"oldest": started}

    producer = RolloutPrefetcher(sample, lambda: served["version"], max_staleness=max_staleness, depth=depth,
                                 step_of=(lambda key: key) if admission else None,
                                 sampled_version=(lambda result: result["oldest"]) if in_flight else None,
                                 updates_in_flight=in_flight)
    trained = []
    try:
        for step in range(14):
            if step % sync_every == 0:
                with producer.paused():
                    time.sleep(rng.uniform(0, 0.002))  # the push
                    served["version"] = step
                producer.advanced()
            producer.fill([(k, batch(k)) for k in range(step, step + depth + 1)], num_generations=2,
                          current_key=step - 1)
            taken = producer.take(step, batch(step), current_version=step)
            if taken is not None:
                trained.append(step - taken.version)
            time.sleep(rng.uniform(0, 0.003))  # the training step
        return trained, producer.drain_stats().dropped
    finally:
        producer.close()


@pytest.mark.parametrize("in_flight", [False, True])
def test_admission_keeps_every_batch_within_max_staleness_over_random_timings(in_flight):
    """Property over 25 random timings: with admission no trained batch is older than max_staleness and none is
    dropped. The same timings without admission do drop batches (the bound is admission's doing, not the timings')."""
    dropped_without = 0
    for seed in range(25):
        import random

        bound = random.Random(seed).choice([1, 2])
        staleness, dropped = _trained_staleness(seed, admission=True, in_flight=in_flight)
        assert dropped == 0 and len(staleness) == 14, seed
        assert max(staleness) <= bound, (seed, staleness)
        dropped_without += _trained_staleness(seed, admission=False, in_flight=in_flight)[1]
    assert dropped_without > 0
