"""Rollouts from our vLLM server with ``disk`` weight sync, as TRL's ``GRPOTrainer`` asks for them: the stand-in
for TRL's ``VLLMGeneration`` (:class:`ServerGeneration`), with its contract: ``sync_weights`` pushes and verifies the
policy (:class:`grpo_steps.training.generation.push.VerifiedPush`), ``generate`` samples every turn (the follow-up
turns of TRL's tool loop included; with ``generation.async`` the first turns come from the producer,
:mod:`grpo_steps.training.generation.prefetch`) and checks the first batch after a push
(:mod:`grpo_steps.training.generation.first_batch`), ``close`` stops it. Like TRL's ``VLLMGeneration``, it is built
whole from values (:class:`ServerSettings`, made by :func:`server_settings`) and from what it reads of the training
process (:class:`PolicyView`: the model, the accelerator, the step counters, a metric sink), never from the trainer
itself; the trainer calls it once more per round, for the replica of each row with several replicas
(:meth:`ServerGeneration.replica_rows`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from grpo_steps.config import GenerationConfig
from grpo_steps.servers.client import GenerationServerError, VLLMClient, session_id
from grpo_steps.training.generation.first_batch import FirstBatchCheck
from grpo_steps.training.generation.prefetch import RolloutPrefetcher
from grpo_steps.training.generation.push import VerifiedPush
from grpo_steps.training.generation.replica_rows import ReplicaLedger
from grpo_steps.training.generation.transport import WeightTransport, make_transport
from grpo_steps.weights.labels import label_version
from grpo_steps.weights.server_flags import TOKEN_GENERATE_ARGS, TOKEN_GENERATE_PATH, weight_transfer_args

PROBE_TOKENS = 16
"""Longest probe sequence, tokens: the policy scores it with one extra forward per push (0.1-0.5 s for
SmolLM2-135M on the 2 shared CPU cores), enough tokens to see any weight change in its logprobs."""


@dataclass(frozen=True)
class ServerSettings:
    """What a training process knows of its generation server before its trainer exists (:func:`server_settings`)."""

    client: VLLMClient
    """This rank's client of the server; its ``model`` names the pushed LoRA adapter with ``train.peft.push: adapter``
    (rank 0's push points it there, the other ranks after each verified push)."""
    gen: GenerationConfig
    """The ``generation`` settings sampled with."""
    max_model_len: int
    """The server's context (``model.max_model_len``): a turn's new tokens are capped so prompt + completion fit."""
    transport: WeightTransport | None
    """Rank 0's weight transport (:func:`~grpo_steps.training.generation.transport.make_transport`; None on the other
    ranks, and where nothing is pushed)."""
    probe_ids: list[int]
    """The probe sequence's token ids (at most ``PROBE_TOKENS``)."""
    probe_tolerance: float
    """Nats per token (``SyncCheckConfig.thresholds``): probe answers closer than this are the same weights."""
    max_logp_diff: float | None = None
    """The first-batch limit (``SyncCheckConfig.thresholds``; nats per token; None: unchecked)."""
    sync_every: int = 1
    """``generation.weight_sync_every``: push at optimizer steps that are multiples of it (or when forced)."""
    lora: str | None = None
    """``train.peft.push``: ``adapter`` (the adapter pushed, ``client.model`` follows each push), ``merged`` (base +
    adapter merged, :func:`grpo_steps.training.generation.disk.merged_state_dict`, pushed as full weights) or None."""
    max_staleness: int | None = None
    """``generation.async``'s ``max_staleness`` (None: synchronous generation)."""
    in_flight: bool | None = None
    """``generation.async.in_flight``: pushes that do not stop generation (None: where the server can)."""
    admission: str = "admit"
    """``generation.async.admission``: ``admit`` (batches start only within ``max_staleness``) or ``drop``."""

    @property
    def checks_first_batch(self) -> bool:
        """Whether the first batch after a push is scored by the policy: only with a limit, and not with structured
        outputs, which renormalise over the tokens a grammar allows (the policy cannot know them)."""
        return self.max_logp_diff is not None and self.gen.structured_outputs is None

    @property
    def probe_policy(self) -> bool:
        """Whether each push's probe is scored by the policy too: when the first-batch check cannot compare the
        server with the policy, and with ``generation.async`` (the batches trained were mostly sampled by earlier
        weights, so the first-batch check only runs on a batch sampled by the policy of the moment)."""
        return self.max_staleness is not None or not self.checks_first_batch


@dataclass(frozen=True)
class PolicyView:
    """What :class:`ServerGeneration` reads of the training process, as TRL's ``VLLMGeneration`` is given the model
    and the accelerator: values and callables, each read when used."""

    accelerator: object
    model: Callable[[], object]
    """The policy as the trainer holds it (wrapped by accelerate/DeepSpeed; forward passes go through it)."""
    state_dict: Callable[[], dict]
    """The policy's full state dict (collective under ZeRO-3: gathered on rank 0, as ``Trainer.save_model``)."""
    step: Callable[[], int]
    """The optimizer step: the version of the weights a push now sends."""
    micro_step: Callable[[], int]
    """Micro-steps of this attempt: keys the generation batches (one every ``steps_per_generation`` of them)."""
    log: Callable[[str, float], None]
    """Metric sink of the training step (``log(name, value)``)."""
    prompt_stream: Callable[[int, int], tuple[int, Callable[[int], list[tuple[int, list[list[int]]]]],
                                              Callable[[int], int]]] | None = None
    """``generation.async``: ``prompt_stream(max_staleness, sync_every) -> (depth, upcoming, step_of)``, called at
    the first generation of an attempt: how many generation batches the producer samples ahead, ``upcoming(key)``, the
    ``(key, prompt ids)`` of the generation batches after the one at micro-step ``key``
    (:class:`grpo_steps.training.generation.prefetch.PromptStream`, TRL's dataloader order), and ``step_of(key)``, the
    optimizer step that trains the batch at ``key`` (admission)."""


class ServerGeneration:
    """Stands in for TRL's ``VLLMGeneration`` when rollouts come from our server with ``disk`` sync: TRL's
    ``GRPOTrainer`` calls ``sync_weights()`` whenever the optimizer step changed and ``generate()`` for every turn it
    samples (``_generate_single_turn``: the first turn of each group, and the follow-up turns of its tool loop).

    ``generate(prompts, num_generations)`` (every rank, its own share): token-id prompts to the server's
    ``/v1/completions`` with this run's sampling settings (``settings.gen``); a first turn holds each prompt
    ``num_generations`` times in a row (whole groups: one request with ``n``), a follow-up turn one prompt per rollout.
    The first turn after a push sampled by the policy of the moment is checked (every rank, with
    ``settings.checks_first_batch``: :class:`~grpo_steps.training.generation.first_batch.FirstBatchCheck`). With
    ``generation.async`` the producer starts at the first training generation of an attempt and the first turn of
    each generation batch comes from the batches it sampled ahead (``async/*`` metrics), the version that sampled it
    in ``sampled_version``.

    ``sync_weights()`` (every rank, collective under ZeRO-3): a verified push
    (:class:`~grpo_steps.training.generation.push.VerifiedPush`; version = the optimizer step that produced it)
    every ``settings.sync_every`` optimizer steps; with a producer and pushes in flight (:meth:`_pushes_in_flight`)
    the server freezes the request in flight (``/pause?mode=keep``) and continues it with the new weights, else the
    push waits for it first (``weight_sync/drain_seconds``) and lets none start until the push is verified.

    Metrics (into the step's log): the push's (``weight_sync/*``), ``generation/wait_seconds`` (the trainer's wait for
    a generation batch's first turn), ``weight_sync/first_batch_logp_diff``, and with replicas whose answers say
    which one sampled each completion (:meth:`grpo_steps.servers.client.VLLMClient.replica_index`)
    ``generation/replica<i>/completions`` per generation round and ``weight_sync/replica<i>/first_batch_logp_diff``.

    ``policy`` None: sampling only (no push, no metrics; tests and benches).

    Raises:
        GenerationServerError: the server failed a request, serves other weights than pushed, or samples the first
            batch after a push from another distribution than the policy's.
    """

    def __init__(self, settings: ServerSettings, policy: PolicyView | None = None) -> None:
        self.settings, self.policy = settings, policy
        self.client, self.gen = settings.client, settings.gen
        """``client``: this rank's client of the server; its ``model`` follows each adapter push (what evaluation
        during training samples from)."""
        self.verified_push = None if policy is None else VerifiedPush(
            settings.transport, settings.probe_ids, settings.probe_tolerance, settings.probe_policy,
            merged_lora=settings.lora == "merged", log=policy.log)
        self.first_batch = FirstBatchCheck(settings.max_logp_diff, self.client.replicas) \
            if settings.checks_first_batch and policy is not None else None
        self.ledger = ReplicaLedger(len(self.client.replicas))
        self.pushed_version: int | None = None  # None until the first push, which sync_every does not space
        self.pushed_versions: set[int] = set()  # every version this process pushed: the only labels a span may carry
        self.sampled_version = -1
        """The weight version that sampled the latest first turn (the pushed version, or a prefetched batch's)."""
        self.prefetcher: RolloutPrefetcher | None = None
        """``generation.async``: the producer sampling the next generation batches (see :meth:`_start_async`)."""
        self._upcoming: Callable[[int], list[tuple[int, list[list[int]]]]] | None = None
        self._served_key = -1  # the generation batch last served from the producer (resample's extra rounds
        # at the same micro-step sample now)
        self._producer_client: VLLMClient | None = None  # the producer thread's own client (its own session)
        self.in_flight = False
        """Pushes update the server under the producer's requests (decided when the producer starts)."""
        self.token_versions: list[list[tuple[int, int, int]]] = []
        """With pushes in flight: per completion of the latest prefetched first turn, ``(version, start, end)``
        spans of its tokens (vLLM's ``weight_versions``; a version None where the label was not a push's)."""
        self._last_take: float | None = None  # when the trainer last took a prefetched batch (idle shares)
        self._episodes: list[list[int]] = []  # the first-turn prompts of the last generation round (their sessions)

    def sync_weights(self, force: bool = False) -> None:
        """Push the policy (every ``sync_every`` optimizer steps unless ``force``); with a producer, none of its
        requests is in flight meanwhile."""
        if not force and self.pushed_version is not None and self.policy.step() % self.settings.sync_every:
            return
        if self.prefetcher is None:
            self._push()
            return
        waited = time.perf_counter()
        with self.prefetcher.paused():  # in flight: waits for nothing; the push pauses the server with mode keep
            if not self.in_flight:
                self.policy.log("weight_sync/drain_seconds", time.perf_counter() - waited)  # the request in flight
            self._push()

    def _push(self) -> None:
        version = self.policy.step()
        self.verified_push(self.policy, version)
        self.pushed_version = version
        self.pushed_versions.add(version)
        if self.first_batch is not None:
            self.first_batch.armed()
        if self.settings.lora == "adapter":
            from grpo_steps.lora import adapter_name

            self.client.model = adapter_name(self.client.base_model, version)
            if self._producer_client is not None:
                self._producer_client.model = self.client.model

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        """Sample ``num_generations`` completions per distinct prompt (TRL's ``VLLMGeneration.generate`` contract).

        Args:
            prompts: B token-id prompts; with ``num_generations`` G > 1 every prompt G times in a row.
            images: must be None (text only).

        Returns:
            ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)``: B entries each; ``logprobs[i][t]`` is
            ``[logprob]`` of completion token t under the distribution the server sampled from (processed logprobs),
            ``logprob_token_ids[i][t]`` is ``[token id]``.

        Raises:
            ValueError: images, or prompts that are not whole groups of G.
            GenerationServerError: the server failed the request, or the first-batch check.
        """
        if images is not None and any(images):
            raise ValueError("the generation server path is text-only: no images")
        group = max(num_generations, 1)
        if len(prompts) % group or any(p != prompts[i - i % group] for i, p in enumerate(prompts)):
            raise ValueError(f"generate got {len(prompts)} prompts that are not whole groups of {group} equal prompts "
                             "in a row: each process's generation batch (train.per_device_train_batch_size x "
                             "steps_per_generation) must be a multiple of train.num_generations")
        samples, version, waited = None, self.pushed_version, time.perf_counter()
        training = self.policy is not None and group > 1 and self.policy.model().training
        key = self.policy.micro_step() if self.policy is not None else -1
        if group > 1:  # the first turns of the round: a follow-up turn's prompt starts with its episode's (sessions)
            self._episodes = prompts[::group]
        elif self.prefetcher is not None and self.policy is not None and self.policy.model().training:
            # a tool loop's follow-up turn, sampled now by the pushed weights; its episode's first turn was
            # prefetched (sampled_version): the episode crosses that many versions, each token's logprob its own
            self.policy.log("async/tool_turn_version_lag", float(self.pushed_version - self.sampled_version))
        if training and self.settings.max_staleness is not None and self.prefetcher is None:
            self._start_async()  # the first training generation of this attempt
        if training and self.prefetcher is not None and key != self._served_key:
            self._served_key = key  # the first turn of this generation batch (other calls: resample's extra rounds)
            samples, version = self._take(key, prompts, group)
        if samples is None:
            with profiler if profiler is not None else contextlib.nullcontext():
                samples = self._sample(self.client, prompts, group)
        completion_ids = [s["completion_ids"] for group_samples in samples for s in group_samples]
        logprobs = [s["logprobs"] for group_samples in samples for s in group_samples]
        if group > 1:  # a first turn: the generation batch's, sampled now or prefetched
            self.sampled_version = version
        if group > 1 and self.policy is not None:
            self.policy.log("generation/wait_seconds", time.perf_counter() - waited)
            replicas = [s.get("replica") for group_samples in samples for s in group_samples]
            self.ledger.record(key, prompts, replicas, self.policy.log)
            # the first turn after a push, sampled by the policy of now: what the first-batch check scores
            if self.first_batch is not None and version == self.policy.step() and \
                    self.first_batch.record(prompts, completion_ids, logprobs, replicas):
                self.first_batch.check(self.policy.model(), self.policy.accelerator, self.gen, version,
                                       self.policy.step(), self.policy.log)
        return (prompts, completion_ids, [[[lp] for lp in seq] for seq in logprobs],
                [[[token] for token in seq] for seq in completion_ids])

    def replica_rows(self, prompt_ids, prompt_mask):
        """The replica that sampled each row of the latest generation batch: ``prompt_ids`` / ``prompt_mask`` (B, P)
        (TRL's padded prompts) -> (B,) int64 on their device, -1 where not known
        (:meth:`~grpo_steps.training.generation.replica_rows.ReplicaLedger.rows`)."""
        return self.ledger.rows(prompt_ids, prompt_mask)

    def _sample(self, client: VLLMClient, prompts: list[list[int]], group: int,
                versions: bool = False) -> list[list[dict]]:
        """One request for ``prompts`` (whole groups of ``group``): per distinct prompt, ``group`` samples
        ``{"completion_ids", "logprobs"}`` (``versions``: and ``"versions"``, see
        :meth:`grpo_steps.servers.client.VLLMClient.complete`). A follow-up turn's prompt holds the conversation so
        far: the new tokens are capped so that the longest prompt still fits the server's context, and a prompt that
        fills it gets an empty turn."""
        unique = prompts[::group]
        fits = [i for i, p in enumerate(unique) if len(p) < self.settings.max_model_len]
        samples: list[list[dict]] = [[{"completion_ids": [], "logprobs": [], "versions": []}] * group for _ in unique]
        if fits:
            room = self.settings.max_model_len - max(len(unique[i]) for i in fits)
            sampled = client.complete([unique[i] for i in fits], group,
                                      max_tokens=min(self.gen.max_completion_tokens, room),
                                      temperature=self.gen.temperature, request=self.gen.sampling_request(),
                                      sessions=[self._session(unique[i]) for i in fits] if client.replicas else None,
                                      versions=versions)
            for i, group_samples in zip(fits, sampled, strict=True):
                samples[i] = group_samples
        return samples

    def _session(self, prompt: list[int]) -> str:
        """The router's session of ``prompt``: its episode's first turn (the longest first-turn prompt it starts
        with), so every turn of an episode is served by one replica (prefix cache) under ``consistent_hash``."""
        starts = [q for q in self._episodes if len(q) <= len(prompt) and prompt[:len(q)] == q]
        return session_id(max(starts, key=len) if starts else prompt)

    def _start_async(self) -> None:
        """``generation.async``: start the producer thread (its own client of the server), which samples up to
        ``depth`` generation batches ahead (``policy.prompt_stream``), each started only within
        ``settings.max_staleness`` optimizer steps (``admit``) or dropped when found staler (``drop``); with pushes in
        flight (:meth:`_pushes_in_flight`) through the route that labels each token with its weight version."""
        depth, self._upcoming, step_of = self.policy.prompt_stream(self.settings.max_staleness,
                                                                   self.settings.sync_every)
        self.in_flight = self._pushes_in_flight()
        if self.in_flight:
            self.client.pause_mode = "keep"  # the pushes this rank makes (rank 0) freeze the requests in flight
        self._producer_client = dataclasses.replace(self.client)
        self._producer_client.model, self._producer_client.base_model = self.client.model, self.client.base_model
        self.prefetcher = RolloutPrefetcher(
            lambda prompts, group: self._sample(self._producer_client, prompts, group, versions=self.in_flight),
            lambda: self.pushed_version, max_staleness=self.settings.max_staleness, depth=depth,
            step_of=step_of if self.settings.admission == "admit" else None,
            sampled_version=oldest_version if self.in_flight else None, in_flight=self.in_flight)

    def _pushes_in_flight(self) -> bool:
        """Whether pushes update the server under the producer's requests: ``settings.in_flight`` true or None, full
        weights (not an adapter: a request keeps the adapter it named), and a server (every replica) that loads
        through the pipeline's engine and labels each token's weight version.

        Raises:
            GenerationServerError: ``in_flight`` true and the server cannot.
        """
        if self.settings.in_flight is False or self.settings.lora == "adapter":
            return False
        why = None if self.client.serves_token_generate() else \
            f"the server does not answer {TOKEN_GENERATE_PATH} (start it with {' '.join(TOKEN_GENERATE_ARGS)})"
        if why is None and not self.client.has_weight_engine():
            why = "the server does not load through the pipeline's weight-transfer engine (" + \
                  " ".join(weight_transfer_args()) + ")"
        if why is None:
            return True
        if self.settings.in_flight:
            raise GenerationServerError(f"generation.async.in_flight is true but {why}: add those flags to the "
                                        "server's command line, or set in_flight: null (pushes then wait for the "
                                        "request in flight)")
        print(f"[async] pushes wait for the request in flight (not in flight): {why}", flush=True)
        return False

    def _take(self, key: int, prompts: list[list[int]], group: int) -> tuple[list[list[dict]] | None, int | None]:
        """The prefetched samples of the generation batch at ``key`` and the version that sampled them, the next
        batches queued; ``(None, pushed_version)`` when it was not prefetched or is too stale (then sampled now)."""
        prefetcher = self.prefetcher
        step = self.policy.step()
        prefetcher.fill([(key, prompts)], group, current_key=key - 1)
        prefetcher.fill(self._upcoming(key), group, current_key=key)
        batch = prefetcher.take(key, prompts, current_version=step)
        stats = prefetcher.drain_stats()
        now = time.perf_counter()
        wall, self._last_take = (now - self._last_take if self._last_take is not None else 0.0), now
        for name, value in (("staleness", step - batch.version if batch else 0.0),
                            ("trainer_wait_seconds", stats.trainer_wait_s),
                            ("producer_idle_seconds", stats.producer_idle_s),
                            ("admission_held_seconds", stats.held_s),
                            ("dropped", stats.dropped), ("missed", stats.missed),
                            ("ready_ahead", stats.ready_ahead[-1] if stats.ready_ahead else 0),
                            ("queue_depth", prefetcher.queued())):
            self.policy.log(f"async/{name}", float(value))
        in_flight, in_queue = prefetcher.ages(step)  # prime-rl's off_policy/{in_flight,in_queue}
        self.policy.log("async/off_policy_in_flight", float(max(in_flight, default=0)))
        self.policy.log("async/off_policy_in_queue", float(max(in_queue, default=0)))
        if wall > 0:  # shares of the time since the previous batch was taken
            self.policy.log("async/trainer_idle_share", min(stats.trainer_wait_s / wall, 1.0))
            self.policy.log("async/generation_idle_share", min(stats.producer_idle_s / wall, 1.0))
        if batch is None:
            return None, self.pushed_version
        if self.in_flight:
            # a span of any other label (a replica restarted mid-request serves "default", another run's step-N) was
            # sampled by weights this run did not push: the batch is dropped, counted, and sampled again now
            foreign = foreign_labels(batch.result, self.pushed_versions)
            self.policy.log("async/foreign_span_batches", float(bool(foreign)))
            if foreign:
                print(f"[async] dropped the prefetched batch of step {key}: tokens sampled by weights this run did "
                      f"not push ({', '.join(foreign[:3])}); sampling it again", flush=True)
                return None, self.pushed_version
            self._log_token_versions(batch.result, step)
        return batch.result, batch.version

    def _log_token_versions(self, samples: list[list[dict]], step: int) -> None:
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

    def close(self) -> None:
        """Stop the producer (waiting for its request in flight), remove this run's sync directory (rank 0; the
        server keeps the weights in memory)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.settings.transport is not None:
            self.settings.transport.close()


def foreign_labels(samples: list[list[dict]], pushed: set[int]) -> list[str]:
    """The weight labels of ``samples``' token spans that name no version in ``pushed`` (this run's pushes), sorted.

    >>> foreign_labels([[{"versions": [("step-3", 0, 4), ("default", 4, 9)]}], [{"versions": [("step-9", 0, 2)]}]],
    ...                {3, 4})
    ['default', 'step-9']
    """
    return sorted({label for group_samples in samples for s in group_samples for label, _, _ in s.get("versions", [])
                   if label_version(label) not in pushed})


def oldest_version(samples: list[list[dict]]) -> int | None:
    """The oldest push version (:func:`grpo_steps.weights.labels.label_version`) that sampled a token of ``samples``
    (``"versions"`` spans of :meth:`grpo_steps.servers.client.VLLMClient.complete`), None when no span names one.

    >>> oldest_version([[{"versions": [("step-3", 0, 4), ("step-4", 4, 9)]}], [{"versions": [("step-4", 0, 2)]}]])
    3
    """
    versions = [label_version(label) for group_samples in samples for s in group_samples
                for label, _, _ in s.get("versions", [])]
    return min((v for v in versions if v is not None), default=None)


def server_settings(cfg, client: VLLMClient, tokenizer, probe_prompt, output_dir: str,
                    weight_store: dict | None = None) -> ServerSettings:
    """The :class:`ServerSettings` of a training process for ``cfg`` (a :class:`grpo_steps.config.PipelineConfig`):
    it samples through ``client`` (this rank's client of the server; ``client.base_model`` the served base model
    name) with ``cfg.generation`` within ``cfg.model.max_model_len`` tokens. Rank 0 pushes: with ``weight_sync: s3``
    through the chain at ``weight_store`` (:class:`grpo_steps.training.generation.s3.ChainWeightPush`; the job's
    :attr:`~grpo_steps.training.job.TrainJob.weight_store`); else into a fresh
    :func:`grpo_steps.training.generation.disk.sync_root` (``generation.sync_dir``, else under ``output_dir``): the
    adapter alone with ``train.peft.push: adapter`` (:class:`grpo_steps.training.generation.disk.AdapterPush`), else
    full weights. The probe is ``probe_prompt`` (a dataset prompt, chat template applied) cut to ``PROBE_TOKENS``
    tokens; tolerances from ``generation.sync_check``.

    Raises:
        ValueError: ``weight_sync: s3`` without ``weight_store``.
    """
    from accelerate.state import PartialState

    from grpo_steps.data import encode_prompt

    gen, lora = cfg.generation, cfg.train.peft.push if cfg.train.peft else None
    transport = make_transport(cfg, client, output_dir, weight_store) if PartialState().is_main_process else None
    probe_tolerance, max_logp_diff = gen.sync_check.thresholds(cfg.model.dtype)
    return ServerSettings(client=client, gen=gen, max_model_len=cfg.model.max_model_len, transport=transport,
                          probe_ids=encode_prompt(tokenizer, probe_prompt)[:PROBE_TOKENS],
                          probe_tolerance=probe_tolerance, max_logp_diff=max_logp_diff,
                          sync_every=gen.weight_sync_every, lora=lora,
                          max_staleness=gen.async_.max_staleness if gen.async_ else None,
                          in_flight=gen.async_.in_flight if gen.async_ else None,
                          admission=gen.async_.admission if gen.async_ else "admit")
