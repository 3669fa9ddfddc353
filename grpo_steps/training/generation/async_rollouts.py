"""The two ways the generation class samples a generation batch's first turn, chosen once per training process by
:func:`rollout_mode`: now, by the weights last pushed (:class:`SyncRollouts`), or ahead, by a producer thread while the
trainer trains (``generation.async``: :class:`AsyncRollouts`, around
:class:`~grpo_steps.training.generation.prefetch.RolloutPrefetcher`). The generation class
(:class:`grpo_steps.training.generation.server.RolloutBackend`) hands in how to sample (a :data:`Sample` callable)
and calls either through the same small interface (:class:`RolloutMode`): ``push_window`` around every push,
``pushed`` after it, ``first_turn`` for a first turn, ``follow_up_turn`` for a tool loop's follow-up turn, ``close``.

With pushes in flight (``updates_in_flight``, decided by :func:`updates_in_flight` when the producer starts) a push does
not wait for the producer's request: the server freezes it (vLLM's ``/pause?mode=keep``) and continues it with the new
weights, so a prefetched batch may hold tokens of several versions, each span labelled by vLLM's ``weight_versions``
(:func:`foreign_labels`, :func:`oldest_version`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from grpo_steps.servers.client import GenerationServerError, VLLMClient
from grpo_steps.training.generation.prefetch import PrefetchedBatch, PrefetchStats, RolloutPrefetcher
from grpo_steps.training.generation.settings import PolicyView, ServerSettings
from grpo_steps.weights.labels import label_version
from grpo_steps.weights.server_flags import TOKEN_GENERATE_ARGS, TOKEN_GENERATE_PATH, weight_transfer_args

Samples = list[list[dict]]
"""Per distinct prompt, its group of samples ``{"completion_ids", "logprobs"}`` (with ``"versions"`` spans when
sampled through the token route; :meth:`grpo_steps.servers.client.VLLMClient.complete`)."""
Sample = Callable[..., Samples]
"""``sample(client, prompts, group, versions=False) -> Samples``: one request through ``client`` for ``prompts``
(whole groups of ``group``); ``versions``: through the route that labels each token's weight version."""


class RolloutMode(Protocol):
    """How a generation batch's first turn is sampled (:func:`rollout_mode`)."""

    def push_window(self) -> contextlib.AbstractContextManager:
        """Entered around every push (the push happens inside)."""

    def pushed(self, version: int) -> None:
        """A push of ``version`` was verified (``settings.client.model`` names what it serves)."""

    def first_turn(self, key: int, prompts: list[list[int]], group: int) -> tuple[Samples, int] | None:
        """The samples of the first turn at micro-step ``key`` and the version that sampled them, or None: the caller
        samples it now."""

    def follow_up_turn(self, sampled_version: int) -> None:
        """A tool loop's follow-up turn of the episodes whose first turn ``sampled_version`` sampled is sampled now."""

    def close(self) -> None:
        """Stop what the mode started."""


class SyncRollouts:
    """Every first turn sampled now, by the weights last pushed (no ``generation.async``, or sampling only)."""

    def push_window(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def pushed(self, version: int) -> None:
        pass

    def first_turn(self, key: int, prompts: list[list[int]], group: int) -> None:
        return None

    def follow_up_turn(self, sampled_version: int) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncRollouts:
    """``generation.async``: the first turns of the next generation batches sampled ahead by a producer thread with
    its own client of the server (its own session), started at the first training generation of an attempt.

    Args:
        settings: ``max_staleness``, ``sync_every``, ``admission``, ``in_flight`` and ``lora`` are read; ``client``
            is the training thread's client (the producer's is a copy).
        policy: ``prompt_stream`` (the batches ahead), ``step``, ``model`` (training or not) and ``log``.
        sample: how to sample (:data:`Sample`), called in the producer thread with the producer's client.
        pushed_version: ``pushed_version() -> int | None``, the version the server holds now (the last push).

    Metrics (``policy.log``): ``async/*`` per batch taken, ``weight_sync/drain_seconds`` per push that waited for the
    producer's request, and with pushes in flight the per-token ones (:meth:`_log_token_versions`).
    """

    def __init__(self, settings: ServerSettings, policy: PolicyView, sample: Sample,
                 pushed_version: Callable[[], int | None]) -> None:
        self.settings, self.policy, self.sample, self.pushed_version = settings, policy, sample, pushed_version
        self.pushed_versions: set[int] = set()  # every version this process pushed: the only labels a span may carry
        self.prefetcher: RolloutPrefetcher | None = None
        """The producer (:meth:`_start`); None until the first training generation."""
        self.updates_in_flight = False
        """Pushes update the server under the producer's requests (:func:`updates_in_flight`, when it starts)."""
        self.token_versions: list[list[tuple[int | None, int, int]]] = []
        """With pushes in flight: per completion of the latest prefetched first turn, ``(version, start, end)``
        spans of its tokens (vLLM's ``weight_versions``; a version None where the label was not a push's)."""
        self._producer_client: VLLMClient | None = None
        self._upcoming: Callable[[int], list[tuple[int, list[list[int]]]]] | None = None
        self._served_key = -1  # the generation batch last served (resample's extra rounds at that key sample now)
        self._last_take: float | None = None  # when the trainer last took a prefetched batch (idle shares)

    @contextlib.contextmanager
    def push_window(self) -> Iterator[None]:
        """Around a push: none of the producer's requests runs meanwhile (``weight_sync/drain_seconds``, the wait for
        the one running), or with pushes in flight nothing waits (the push pauses the server with mode ``keep``)."""
        if self.prefetcher is None:  # not started yet: nothing to wait for
            yield
            return
        waited = time.perf_counter()
        with self.prefetcher.paused():
            if not self.updates_in_flight:
                self.policy.log("weight_sync/drain_seconds", time.perf_counter() - waited)
            yield

    def pushed(self, version: int) -> None:
        """Record the verified push of ``version``; the producer samples what the training thread's client names
        (an adapter push renames it)."""
        self.pushed_versions.add(version)
        if self._producer_client is not None:
            self._producer_client.model = self.settings.client.model

    def first_turn(self, key: int, prompts: list[list[int]], group: int) -> tuple[Samples, int] | None:
        """The prefetched first turn of the generation batch at micro-step ``key`` and the version that sampled it
        (starting the producer at the first one); None, sampled now by the caller: outside training (the policy in
        eval mode), at a key already served (resample's extra rounds), or not prefetched, too stale or sampled by
        weights this run did not push (:meth:`_take`)."""
        if not self.policy.model().training:
            return None
        if self.prefetcher is None:
            self._start()
        if key == self._served_key:
            return None
        self._served_key = key
        return self._take(key, prompts, group)

    def follow_up_turn(self, sampled_version: int) -> None:
        """A tool loop's follow-up turn is sampled now by the pushed weights while its episode's first turn was
        prefetched: ``async/tool_turn_version_lag``, the versions the episode crosses (each token's logprob its own)."""
        if self.prefetcher is not None and self.policy.model().training:
            self.policy.log("async/tool_turn_version_lag", float(self.pushed_version() - sampled_version))

    def close(self) -> None:
        """Stop the producer (waiting for its request in flight)."""
        if self.prefetcher is not None:
            self.prefetcher.close()

    def _start(self) -> None:
        """Start the producer thread (its own client of the server), which samples up to ``depth`` generation batches
        ahead (``policy.prompt_stream``), each started only within ``settings.max_staleness`` optimizer steps
        (``admit``) or dropped when found staler (``drop``); with pushes in flight through the route that labels
        each token with its weight version."""
        settings = self.settings
        depth, self._upcoming, step_of = self.policy.prompt_stream(settings.max_staleness, settings.sync_every)
        self.updates_in_flight = updates_in_flight(settings)
        if self.updates_in_flight:
            settings.client.pause_mode = "keep"  # the pushes this rank makes (rank 0) freeze the requests in flight
        producer = self._producer_client = dataclasses.replace(settings.client)
        producer.model, producer.base_model = settings.client.model, settings.client.base_model
        self.prefetcher = RolloutPrefetcher(
            lambda prompts, group: self.sample(producer, prompts, group, versions=self.updates_in_flight),
            self.pushed_version, max_staleness=settings.max_staleness, depth=depth,
            step_of=step_of if settings.admission == "admit" else None,
            sampled_version=oldest_version if self.updates_in_flight else None,
            updates_in_flight=self.updates_in_flight)

    def _take(self, key: int, prompts: list[list[int]], group: int) -> tuple[Samples, int] | None:
        """The prefetched samples of the generation batch at ``key`` and the version that sampled them, the next
        batches queued; None when it was not prefetched, is too stale, or holds spans of weights this run did not
        push (then sampled now)."""
        step = self.policy.step()
        self.prefetcher.fill([(key, prompts)], group, current_key=key - 1)
        self.prefetcher.fill(self._upcoming(key), group, current_key=key)
        batch = self.prefetcher.take(key, prompts, current_version=step)
        self._log_queue(self.prefetcher.drain_stats(), batch, step)
        if batch is None or (self.updates_in_flight and not self._spans_pushed(batch, key, step)):
            return None
        return batch.result, batch.version

    def _log_queue(self, stats: PrefetchStats, batch: PrefetchedBatch | None, step: int) -> None:
        """The ``async/*`` metrics of one taken batch (None: not prefetched or dropped) at optimizer step ``step``."""
        now = time.perf_counter()
        wall, self._last_take = (now - self._last_take if self._last_take is not None else 0.0), now
        for name, value in (("staleness", step - batch.version if batch else 0.0),
                            ("trainer_wait_seconds", stats.trainer_wait_s),
                            ("producer_idle_seconds", stats.producer_idle_s),
                            ("admission_held_seconds", stats.held_s),
                            ("dropped", stats.dropped), ("missed", stats.missed),
                            ("ready_ahead", stats.ready_ahead[-1] if stats.ready_ahead else 0),
                            ("queue_depth", self.prefetcher.queued())):
            self.policy.log(f"async/{name}", float(value))
        sampling, sampled = self.prefetcher.ages(step)  # prime-rl's off_policy/{in_flight,in_queue}
        self.policy.log("async/off_policy_in_flight", float(max(sampling, default=0)))
        self.policy.log("async/off_policy_in_queue", float(max(sampled, default=0)))
        if wall > 0:  # shares of the time since the previous batch was taken
            self.policy.log("async/trainer_idle_share", min(stats.trainer_wait_s / wall, 1.0))
            self.policy.log("async/generation_idle_share", min(stats.producer_idle_s / wall, 1.0))

    def _spans_pushed(self, batch: PrefetchedBatch, key: int, step: int) -> bool:
        """Whether every token span of ``batch`` (sampled with pushes in flight) names a push of this run
        (``async/foreign_span_batches``); its per-token staleness logged when it does."""
        # a span of any other label (a replica restarted mid-request serves "default", another run's step-N) was
        # sampled by weights this run did not push: the batch is dropped, counted, and sampled again now
        foreign = foreign_labels(batch.result, self.pushed_versions)
        self.policy.log("async/foreign_span_batches", float(bool(foreign)))
        if foreign:
            print(f"[async] dropped the prefetched batch of step {key}: tokens sampled by weights this run did "
                  f"not push ({', '.join(foreign[:3])}); sampling it again", flush=True)
            return False
        self._log_token_versions(batch.result, step)
        return True

    def _log_token_versions(self, samples: Samples, step: int) -> None:
        """Per-token staleness of a prefetched batch sampled with pushes in flight (``step`` - the version that
        sampled each token): ``async/token_staleness_mean`` and ``_max`` over its completion tokens,
        ``async/spanning_share`` (completions whose tokens come from 2 or more versions); :attr:`token_versions`."""
        self.token_versions = [[(label_version(label), start, end) for label, start, end in s.get("versions", [])]
                               for group_samples in samples for s in group_samples]
        ages = [(step - v) * (end - start) for spans in self.token_versions for v, start, end in spans
                if v is not None]
        tokens = sum(end - start for spans in self.token_versions for v, start, end in spans if v is not None)
        oldest = [step - v for spans in self.token_versions for v, _, _ in spans if v is not None]
        self.policy.log("async/token_staleness_mean", sum(ages) / tokens if tokens else 0.0)
        self.policy.log("async/token_staleness_max", float(max(oldest, default=0)))
        spanning = sum(len({v for v, _, _ in spans}) > 1 for spans in self.token_versions)
        self.policy.log("async/spanning_share", spanning / max(len(self.token_versions), 1))


def rollout_mode(settings: ServerSettings, policy: PolicyView | None, sample: Sample,
                 pushed_version: Callable[[], int | None]) -> RolloutMode:
    """The rollout mode of a generation class: :class:`AsyncRollouts` with ``generation.async`` (``max_staleness``
    set) and a policy that trains, else :class:`SyncRollouts`."""
    if settings.max_staleness is None or policy is None:
        return SyncRollouts()
    return AsyncRollouts(settings, policy, sample, pushed_version)


def updates_in_flight(settings: ServerSettings) -> bool:
    """Whether pushes update the server under the producer's requests: ``settings.in_flight`` true or None, full
    weights (not an adapter: a request keeps the adapter it named), and a server (every replica) that loads through
    the pipeline's weight-transfer engine and labels each token's weight version (the capabilities its handle
    recorded at provisioning, :attr:`grpo_steps.servers.client.VLLMClient.capabilities`).

    Raises:
        GenerationServerError: ``in_flight`` true and the server cannot.
    """
    if settings.in_flight is False or settings.lora == "adapter":
        return False
    client = settings.client
    why = None if client.serves_token_generate() else \
        f"the server does not answer {TOKEN_GENERATE_PATH} (start it with {' '.join(TOKEN_GENERATE_ARGS)})"
    if why is None and not client.has_transfer_engine():
        why = "the server does not load through the pipeline's weight-transfer engine (" + \
              " ".join(weight_transfer_args()) + ")"
    if why is None:
        return True
    if settings.in_flight:
        raise GenerationServerError(f"generation.async.in_flight is true but {why}: add those flags to the "
                                    "server's command line, or set in_flight: null (pushes then wait for the "
                                    "request in flight)")
    print(f"[async] pushes wait for the request in flight (not in flight): {why}", flush=True)
    return False


def foreign_labels(samples: Samples, pushed: set[int]) -> list[str]:
    """The weight labels of ``samples``' token spans that name no version in ``pushed`` (this run's pushes), sorted.

    >>> foreign_labels([[{"versions": [("step-3", 0, 4), ("default", 4, 9)]}], [{"versions": [("step-9", 0, 2)]}]],
    ...                {3, 4})
    ['default', 'step-9']
    """
    return sorted({label for group_samples in samples for s in group_samples for label, _, _ in s.get("versions", [])
                   if label_version(label) not in pushed})


def oldest_version(samples: Samples) -> int | None:
    """The oldest push version (:func:`grpo_steps.weights.labels.label_version`) that sampled a token of ``samples``
    (``"versions"`` spans of :meth:`grpo_steps.servers.client.VLLMClient.complete`), None when no span names one.

    >>> oldest_version([[{"versions": [("step-3", 0, 4), ("step-4", 4, 9)]}], [{"versions": [("step-4", 0, 2)]}]])
    3
    """
    versions = [label_version(label) for group_samples in samples for s in group_samples
                for label, _, _ in s.get("versions", [])]
    return min((v for v in versions if v is not None), default=None)
