"""Asynchronous generation (``generation.async``): a background producer samples the next generation batches from the
server while the trainer trains on the current one, each batch tagged with the weight version that sampled it.

The design is TRL's ``AsyncGRPOTrainer`` (experimental ``async_grpo``: a rollout worker thread, a bounded queue,
``max_staleness``) and the one-step-off pipelines of verl and AReaL, ported onto this pipeline's trainer: the
producer only sends prompts to the server (HTTP; no model, no collective); the prompts, the rewards, the advantages,
the logprobs and the pushes stay in the training thread. A push (:meth:`RolloutPrefetcher.paused`) waits for the
request in flight to end and starts no new one until the server holds the new weights, so every batch is sampled by
exactly one version (a drain). With pushes in flight (``generation.async.in_flight``) the push does not wait: the
server freezes the request and continues it with the new weights (vLLM's ``/pause?mode=keep``), so a batch may hold
tokens of several versions; its ``version`` is then its oldest token's (``sampled_version`` of the result).

Staleness of a batch = the trainer's optimizer step when it takes the batch - the version (the optimizer step whose
weights sampled its oldest token). Admission (``generation.async.admission: admit``, AReaL's and SkyRL's rule at the
granularity of a generation batch): the producer starts a batch only while ``step_of(key) - version() <=
max_staleness``, ``step_of(key)`` being the optimizer step that will train it, and the server's weights only get newer,
so no batch is ever too stale when taken. ``drop``: batches start when queued, and one with staleness above
``max_staleness`` is dropped (counted) and sampled again from the current weights. TRL's mismatch correction
(importance sampling against the sampler's per-token logprobs, each from the weights that sampled that token) absorbs
the lag of the others.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

STOP_TIMEOUT_S = 600.0
"""Longest wait, seconds, for the request in flight when the producer stops (the client's own timeout bounds it)."""
ERROR_STOP_TIMEOUT_S = 5.0
"""The same wait when the producer is stopped while an error propagates (training failed): ``@retry`` should not
wait for a request that may hang; the daemon thread dies with the process."""
LIVENESS_POLL_S = 1.0
"""Seconds between checks, while the trainer waits on the producer, that its thread is still alive."""


class ProducerDiedError(RuntimeError):
    """The producer thread ended while the trainer waited on it (the cause is chained)."""


@dataclass
class PrefetchedBatch:
    """One generation batch of the producer: ``prompts`` (B token-id lists, as ``RolloutBackend.generate`` gets
    them), the sampler's ``result`` once done (or the exception it raised), and ``version`` (the weight version the
    server held while sampling it; -1 until it started)."""

    key: int
    """Where the trainer asks for it (its micro-step counter when it generates)."""
    prompts: list[list[int]]
    num_generations: int
    version: int = -1
    """The weight version when its request started, then (with ``sampled_version``) that of its oldest token."""
    result: Any = None
    error: BaseException | None = None
    started: bool = False
    done: bool = False


@dataclass
class PrefetchStats:
    """Counters since the last :meth:`RolloutPrefetcher.drain_stats`: seconds the producer sampled nothing
    (``producer_idle_s``: nothing queued, or held by admission), seconds the trainer waited for a batch or for the
    request in flight before a push (``trainer_wait_s``), batches dropped as too stale (``dropped``), batches the
    trainer asked for that were not prefetched (``missed``: sampled directly), and per taken batch its staleness and
    the number of batches already sampled ahead of it (``staleness``, ``ready_ahead``)."""

    producer_idle_s: float = 0.0
    trainer_wait_s: float = 0.0
    held_s: float = 0.0
    """Of ``producer_idle_s``, seconds a queued batch waited for admission (newer weights)."""
    dropped: int = 0
    missed: int = 0
    staleness: list[int] = field(default_factory=list)
    ready_ahead: list[int] = field(default_factory=list)


class RolloutPrefetcher:
    """A background thread that samples queued generation batches, one at a time, in order.

    Args:
        sample: ``sample(prompts, num_generations) -> result``: one request to the server (called in the producer
            thread; it must not touch the model or any collective).
        version: ``version() -> int``: the weight version the server holds now (read when a request starts).
        max_staleness: the largest staleness (optimizer steps) of a batch the trainer takes.
        depth: batches kept queued or sampled ahead of the trainer (:meth:`fill` tops the queue up to it).
        step_of: ``step_of(key) -> int``, the optimizer step that trains the batch at ``key``: with it, admission
            (a batch starts only while ``step_of(key) - version() <= max_staleness``; call :meth:`advanced` after
            each push); None: ``drop`` (batches start when queued; a too stale one is dropped when taken).
        sampled_version: ``sampled_version(result) -> int | None``, the version of a result's oldest token when a
            request may span several (pushes in flight); None: the version when it started.
        updates_in_flight: pushes do not wait for the request in flight (:meth:`paused` waits for nothing: the
            server updates the weights under it).

    Raises:
        ValueError: ``max_staleness`` < 0 or ``depth`` < 1.

    >>> served = {"version": 0}
    >>> p = RolloutPrefetcher(lambda prompts, n: [len(x) for x in prompts], lambda: served["version"],
    ...                       max_staleness=1, depth=1)
    >>> p.fill([(0, [[1, 2], [1, 2]]), (1, [[3], [3]])], num_generations=2, current_key=-1)
    1
    >>> batch = p.take(0, [[1, 2], [1, 2]], current_version=1)
    >>> batch.result, batch.version
    ([2, 2], 0)
    >>> p.take(1, [[3], [3]], current_version=1) is None  # never queued (depth 1): the caller samples it directly
    True
    >>> p.close(), p.alive
    (True, False)
    """

    def __init__(self, sample: Callable[[list[list[int]], int], Any], version: Callable[[], int], *,
                 max_staleness: int, depth: int, step_of: Callable[[int], int] | None = None,
                 sampled_version: Callable[[Any], int | None] | None = None,
                 updates_in_flight: bool = False) -> None:
        if max_staleness < 0 or depth < 1:
            raise ValueError(f"max_staleness must be >= 0 and depth >= 1, got {max_staleness} and {depth}")
        self.sample, self.version, self.max_staleness, self.depth = sample, version, max_staleness, depth
        self.step_of, self.sampled_version, self.updates_in_flight = step_of, sampled_version, updates_in_flight
        self.queue: list[PrefetchedBatch] = []
        self.stats = PrefetchStats()
        self._cond = threading.Condition()
        self._paused = 0
        self._request_running = False  # a request of the producer is at the server
        self._stopping = False
        self._last_key = -1
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    # ---- producer thread ----
    def _admitted(self, job: PrefetchedBatch) -> bool:
        """Whether ``job`` may start now: no admission (``step_of`` None), or the weights the server holds are at most
        ``max_staleness`` optimizer steps older than the step that trains it."""
        return self.step_of is None or self.step_of(job.key) - self.version() <= self.max_staleness

    def _next_job(self) -> PrefetchedBatch | None:
        """Wait (idle) until a queued batch may start; None when stopping. Called with the condition held."""
        idle_from = time.perf_counter()
        held_from = None
        while not self._stopping:
            job = next((b for b in self.queue if not b.started), None)
            if job is not None and not self._paused and self._admitted(job):
                now = time.perf_counter()
                self.stats.producer_idle_s += now - idle_from
                self.stats.held_s += now - held_from if held_from is not None else 0.0
                job.started, self._request_running = True, True
                job.version = self.version()
                return job
            if job is not None and held_from is None and not self._paused:
                held_from = time.perf_counter()  # queued, held back until newer weights are pushed
            self._cond.wait()
        return None

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    job = self._next_job()
                if job is None:
                    return
                try:
                    job.result = self.sample(job.prompts, job.num_generations)
                    oldest = self.sampled_version(job.result) if self.sampled_version is not None else None
                    job.version = job.version if oldest is None else oldest
                except BaseException as err:  # noqa: BLE001  (handed to the trainer, which raises it)
                    job.error = err
                with self._cond:
                    job.done, self._request_running = True, False
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001  e.g. version() failed: the waiting trainer raises it (_wait_for)
            self._failure = err
        finally:
            with self._cond:
                self._cond.notify_all()

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (condition held) until ``ready()``, checking every :data:`LIVENESS_POLL_S` seconds that the producer
        thread lives. Raises :class:`ProducerDiedError` when it has ended and ``ready()`` cannot become true."""
        while not ready():
            if not self._thread.is_alive():
                raise ProducerDiedError(f"the rollout producer thread ended while the trainer waited for {what} "
                                        f"({self._failure!r}): training cannot go on") from self._failure
            self._cond.wait(LIVENESS_POLL_S)

    # ---- training thread ----
    def fill(self, upcoming: list[tuple[int, list[list[int]]]], num_generations: int, current_key: int) -> int:
        """Queue the batches of ``upcoming`` (``(key, prompts)``, keys increasing, in the order the trainer will ask
        for them) after ``current_key`` (the batch the trainer is at) and not queued before, until :attr:`depth`
        batches after ``current_key`` are queued or sampled; returns how many were queued."""
        added = 0
        with self._cond:
            for key, prompts in upcoming:
                if key <= max(self._last_key, current_key):
                    continue
                if sum(b.key > current_key for b in self.queue) >= self.depth:
                    break
                self.queue.append(PrefetchedBatch(key, prompts, num_generations))
                self._last_key = key
                added += 1
            self._cond.notify_all()
        return added

    def queued(self) -> int:
        """Batches queued, in flight or sampled and not yet taken."""
        with self._cond:
            return len(self.queue)

    def ages(self, current_version: int) -> tuple[list[int], list[int]]:
        """Staleness against ``current_version`` of the batches ahead of the trainer, by when each started (its
        oldest token may be newer): ``(sampling, sampled)``: being sampled (prime-rl's ``off_policy/in_flight``), and
        sampled but not taken yet (its ``in_queue``)."""
        with self._cond:
            return ([current_version - b.version for b in self.queue if b.started and not b.done],
                    [current_version - b.version for b in self.queue if b.done])

    def take(self, key: int, prompts: list[list[int]], current_version: int) -> PrefetchedBatch | None:
        """The prefetched batch ``key``, waiting for it if it is still being sampled; batches queued before it are
        discarded (the trainer moved past them). None (the caller samples directly, from the current weights) when
        it was never queued or holds other prompts than ``prompts`` (``missed``), or when its staleness
        ``current_version - version`` exceeds ``max_staleness`` (``dropped``: it never trains).

        Raises:
            what the producer's request raised for this batch (e.g. ``GenerationServerError``).
        """
        with self._cond:
            index = next((i for i, b in enumerate(self.queue) if b.key == key), None)
            batch = None if index is None else self.queue[index]
            if batch is None or batch.prompts != prompts:
                self.stats.missed += 1
                self.queue = [b for b in self.queue if b.key > key]
                return None
            self.queue = [b for b in self.queue if b.key >= key]
            waited_from = time.perf_counter()
            # the producer takes the queue's first batch not started: this one, or the one in flight before it
            self._wait_for(lambda: batch.done, f"generation batch {key}")
            self.queue = [b for b in self.queue if b.key > key]
            self.stats.trainer_wait_s += time.perf_counter() - waited_from
            self.stats.ready_ahead.append(sum(b.done for b in self.queue))
            self._cond.notify_all()
        if batch.error is not None:
            raise batch.error
        staleness = current_version - batch.version
        if staleness > self.max_staleness:
            self.stats.dropped += 1
            return None
        self.stats.staleness.append(staleness)
        return batch

    def advanced(self) -> None:
        """The server holds newer weights (a push was verified): batches held back by admission may start."""
        with self._cond:
            self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No request in flight while inside (a weight push): waits for the one in flight to end (counted as
        trainer wait), starts none until the block is left. With ``updates_in_flight`` it waits for nothing and stops
        nothing: the server freezes the request in flight itself and continues it with the new weights."""
        if self.updates_in_flight:
            try:
                yield
            finally:
                self.advanced()
            return
        with self._cond:
            self._paused += 1
            waited_from = time.perf_counter()
            try:
                self._wait_for(lambda: not self._request_running, "the request in flight before a weight push")
            except ProducerDiedError:
                self._paused -= 1
                raise
            self.stats.trainer_wait_s += time.perf_counter() - waited_from
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def drain_stats(self) -> PrefetchStats:
        """The counters since the last call, reset."""
        with self._cond:
            stats, self.stats = self.stats, PrefetchStats()
            return stats

    def close(self, timeout_s: float | None = None) -> bool:
        """Stop: nothing new starts, the queue is discarded, the request in flight (if any) is waited for up to
        ``timeout_s`` seconds (default :data:`STOP_TIMEOUT_S`, or :data:`ERROR_STOP_TIMEOUT_S` when called while an
        exception propagates, e.g. from a ``finally`` after a training error). Returns whether the thread has
        ended (a request still hanging after that leaves a daemon thread that dies with the process)."""
        if timeout_s is None:  # an exception on its way up (sys.exc_info sees it in a finally block too)
            timeout_s = ERROR_STOP_TIMEOUT_S if sys.exc_info()[0] is not None else STOP_TIMEOUT_S
        with self._cond:
            self._stopping = True
            self.queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Whether the producer thread is running."""
        return self._thread.is_alive()


class PromptStream:
    """The token-id prompts of the generation batches TRL will ask for next, read from a second training dataloader
    (``loader``: the trainer's ``get_train_dataloader()``, the same sampler, seed and sharding) from where this attempt
    starts: a resumed run skips the micro-batches its checkpoint trained (``start_step`` optimizer steps of
    ``accumulation`` micro-batches each), as ``Trainer`` does. Each generation batch is keyed by the micro-step at
    which TRL generates it (0 when the attempt starts; one batch every ``every`` micro-steps); ``tokenize(prompts,
    rows)`` gives a batch's prompt ids as TRL encodes them. With ``episodes``
    (:class:`~grpo_steps.training.generation.episodes_ahead.EpisodesAhead`, ``environment:``) each batch's
    environments are reset as it is read and their observations join its prompts; batches the trainer moved past
    have theirs closed. Read in the training thread (the dataloader may synchronise RNG states across processes). A
    stream that disagrees with TRL's costs speed, never correctness: the producer's batch then holds other prompts
    and is not used (``async/missed``)."""

    def __init__(self, loader, start_step: int, accumulation: int,
                 tokenize: Callable[[list, list[dict]], list[list[int]]], every: int, depth: int,
                 episodes=None) -> None:
        self.every, self.depth, self.tokenize, self.episodes = every, depth, tokenize, episodes
        self.start_step, self.accumulation = start_step, accumulation
        self.ahead: dict[int, list[list[int]]] = {}
        self.next_index = 0
        self.batches = self._micro_batches(loader, start_step, accumulation)

    @staticmethod
    def _micro_batches(loader, start_step: int, accumulation: int) -> Iterator[list[dict]]:
        per_epoch = max(len(loader) // accumulation + int(len(loader) % accumulation > 0), 1)  # optimizer steps
        epoch, skip = start_step // per_epoch, (start_step % per_epoch) * accumulation
        while True:
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            for index, rows in enumerate(loader):
                if index >= skip:
                    yield rows
            skip, epoch = 0, epoch + 1

    def step_of(self, key: int) -> int:
        """The optimizer step that trains the generation batch at micro-step ``key`` of this attempt (the trainer's
        ``global_step`` when TRL generates it: the optimizer steps done before)."""
        return self.start_step + key // self.accumulation

    def after(self, key: int) -> list[tuple[int, list[list[int]]]]:
        """``(key, prompt ids)`` of the next ``depth`` generation batches after the one at micro-step ``key``."""
        import copy

        wanted = [key + self.every * j for j in range(1, self.depth + 1)]
        for index in wanted:
            while self.next_index <= index:
                rows = next(self.batches)
                if self.next_index % self.every == 0 and self.next_index > key:
                    prompts = (self.episodes.first_prompts(self.next_index, rows) if self.episodes is not None else
                               copy.deepcopy([row["prompt"] for row in rows]))
                    self.ahead[self.next_index] = self.tokenize(prompts, rows)
                self.next_index += 1
        self.ahead = {k: v for k, v in self.ahead.items() if k > key}
        if self.episodes is not None:
            self.episodes.discard_through(key)  # the trainer took the batch at key's own before sampling it
        return [(k, self.ahead[k]) for k in wanted]


def prompt_stream(loader, start_step: int, accumulation: int, every: int, max_staleness: int, sync_every: int,
                  tokenize_prompts: Callable[[list, list[str] | None], list[list[int]]], episodes=None
                  ) -> tuple[int, Callable[[int], list], Callable[[int], int]]:
    """``generation.async``'s prompts, as the generation class asks for them at the first generation of an attempt
    (:attr:`grpo_steps.training.generation.settings.PolicyView.prompt_stream`): ``(depth, upcoming, step_of)``, the
    generation batches the producer samples ahead (:func:`grpo_steps.config.prefetch_depth`), the prompts of the
    batches TRL's dataloader will yield next (:meth:`PromptStream.after`, from ``loader``, a second training dataloader
    in the same order, from optimizer step ``start_step``) and the optimizer step that trains the batch at a
    micro-step (:meth:`PromptStream.step_of`, admission). ``every``: micro-steps per generation batch
    (``steps_per_generation x num_iterations``); ``accumulation``: ``gradient_accumulation_steps``;
    ``tokenize_prompts(prompts, environment names or None)``: TRL's encoding; ``episodes``: the environments reset
    ahead (``environment:``), or None."""
    from grpo_steps.config import prefetch_depth

    depth = prefetch_depth(max_staleness, every / accumulation, sync_every)

    def tokenize(prompts: list, rows: list[dict]) -> list[list[int]]:
        return tokenize_prompts(prompts, episodes.names(rows) if episodes is not None else None)

    stream = PromptStream(loader, start_step, accumulation, tokenize, every, depth, episodes=episodes)
    return depth, stream.after, stream.step_of
