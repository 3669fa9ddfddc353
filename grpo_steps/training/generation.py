"""Rollouts from our vLLM server with ``disk`` weight sync, as TRL's ``GRPOTrainer`` asks for them: the stand-in
for TRL's ``VLLMGeneration`` (:class:`ServerGeneration`: ``sync_weights`` pushes and verifies the policy, ``generate``
samples every turn, the follow-up turns of TRL's tool loop included, ``check_first_batch`` compares the first batch
after a push with the policy). Like TRL's ``VLLMGeneration``, it is built whole from values (:class:`ServerSettings`,
made by :func:`server_settings`) and from what it reads of the training process (:class:`PolicyView`: the model,
the accelerator, the step counters, a metric sink), never from the trainer itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

from grpo_steps.config import GenerationConfig
from grpo_steps.servers.client import GenerationServerError, VLLMClient, session_id, version_label
from grpo_steps.training.async_rollouts import RolloutPrefetcher
from grpo_steps.training.sampling import policy_logprobs, processed_logprobs
from grpo_steps.training.weight_sync import (
    AdapterPush,
    DiskWeightPush,
    ProbeRecord,
    check_served_version,
    mean_abs_diff,
    sync_root,
    weights_fingerprint,
)

PROBE_TOKENS = 16
"""Longest probe sequence, tokens: the policy scores it with one extra forward per push (0.1-0.5 s for
SmolLM2-135M on the 2 shared CPU cores), enough tokens to see any weight change in its logprobs."""
HISTORY = 4
"""Verified pushes remembered to name the version a stale server serves."""
FIRST_BATCH_COMPLETIONS = 2
"""Completions of the first batch after a push that the policy scores again for the first-batch check, per replica
that sampled some (:func:`first_completions`; a no-grad forward per completion, per push and process: ~0.1 s for
SmolLM2-135M at 100 tokens, ~2 s with the 600-token prompts of configs/tools.yaml on 2 CPU cores)."""


def first_completions(batch: list[tuple], per_replica: int = FIRST_BATCH_COMPLETIONS) -> list[tuple]:
    """The first ``per_replica`` rows of ``batch`` (``(..., replica)`` tuples, in order) sampled by each replica,
    rows whose replica is not known (None) counting as one replica.

    >>> [row[0] for row in first_completions([("a", 0), ("b", 0), ("c", 0), ("d", 1)], per_replica=2)]
    ['a', 'b', 'd']
    """
    taken: dict[object, int] = {}
    rows = []
    for row in batch:
        if taken.get(row[-1], 0) < per_replica:
            taken[row[-1]] = taken.get(row[-1], 0) + 1
            rows.append(row)
    return rows


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
    push: DiskWeightPush | AdapterPush | None
    """Rank 0's weight push (None on the other ranks, and where nothing is pushed)."""
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
    adapter merged, :func:`grpo_steps.training.weight_sync.merged_state_dict`, pushed as full weights) or None."""
    max_staleness: int | None = None
    """``generation.async``'s ``max_staleness`` (None: synchronous generation)."""

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


class ServerGeneration:
    """Stands in for TRL's ``VLLMGeneration`` when rollouts come from our server with ``disk`` sync: TRL's
    ``GRPOTrainer`` calls ``sync_weights()`` whenever the optimizer step changed and ``generate()`` for every turn it
    samples (``_generate_single_turn``: the first turn of each group, and the follow-up turns of its tool loop).

    ``generate(prompts, num_generations)`` (every rank, its own share): token-id prompts to the server's
    ``/v1/completions`` with this run's sampling settings (``settings.gen``); a first turn holds each prompt
    ``num_generations`` times in a row (whole groups: one request with ``n``), a follow-up turn one prompt per rollout.

    ``sync_weights()`` (every rank, collective under ZeRO-3): gathers the policy's state dict, rank 0
    fingerprints (:func:`grpo_steps.training.weight_sync.weights_fingerprint`), writes and reloads it through
    ``settings.push`` (version = the optimizer step that produced it); with ``settings.probe_policy`` every rank
    scores the probe with the policy; rank 0 asks the server for its label and its probe logprobs and checks them
    (:func:`grpo_steps.training.weight_sync.check_served_version`); the verdict is broadcast so that every rank
    raises together; it pushes every ``settings.sync_every`` optimizer steps, and with a producer
    (``generation.async``, :meth:`start_async`) waits for its request in flight first (``weight_sync/drain_seconds``)
    and lets none start until the push is verified. With a producer, the first turn of each generation batch comes
    from the batches it sampled ahead (:mod:`grpo_steps.training.async_rollouts`: ``async/*`` metrics), the version
    that sampled it in ``sampled_version``.

    ``check_first_batch()`` (every rank, after a generation round): the first completions sampled after a push,
    scored by the policy (see :meth:`check_first_batch`).

    Metrics (seconds, into the step's log): ``generation/wait_seconds`` (the trainer's wait for a generation batch's
    first turn), ``weight_sync/gather_seconds``, ``write_seconds`` (fingerprint and files), ``reload_seconds``,
    ``verify_seconds``, ``seconds`` (total: the four parts); ``weight_sync/version``; with ``probe_policy``,
    ``weight_sync/probe_logp_diff`` (mean |server - policy| on the probe, nats per token);
    ``weight_sync/first_batch_logp_diff``. With replicas whose answers say which one sampled each completion
    (:meth:`grpo_steps.servers.client.VLLMClient.replica_index`): ``generation/replica<i>/completions`` per
    generation round and ``weight_sync/replica<i>/first_batch_logp_diff`` (the check's gap over replica i's
    completions; a failed check names the replicas above the limit).

    ``policy`` None: sampling only (no push, no metrics; tests and benches).

    Raises:
        GenerationServerError: the server failed a request, serves other weights than pushed, or samples the first
            batch after a push from another distribution than the policy's.
    """

    def __init__(self, settings: ServerSettings, policy: PolicyView | None = None) -> None:
        self.settings, self.policy = settings, policy
        self.client, self.gen, self.push = settings.client, settings.gen, settings.push
        self.history: dict[str, list[ProbeRecord]] = {}  # per replica (endpoint): the last HISTORY verified pushes
        self.pushed_version: int | None = None  # None until the first push, which sync_every does not space
        self.first_batch: list[tuple[list[int], list[int], list[float], int | None]] | None = None
        """``(prompt_ids, completion_ids, logprobs, replica)`` of the first turn sampled after the last push by the
        policy of the moment (the first-batch check's data); None until then."""
        self.first_batch_pending = False  # set by every push, cleared when check_first_batch has looked
        self.sampled_version = -1
        """The weight version that sampled the latest first turn (the pushed version, or a prefetched batch's)."""
        self.prefetcher: RolloutPrefetcher | None = None
        """``generation.async``: the producer sampling the next generation batches (see :meth:`start_async`)."""
        self._upcoming: Callable[[int], list[tuple[int, list[list[int]]]]] | None = None
        self._served_key = -1  # the generation batch last served from the producer (resample's extra rounds
        # at the same micro-step sample now)
        self._producer_client: VLLMClient | None = None  # the producer thread's own client (its own session)
        self._episodes: list[list[int]] = []  # the first-turn prompts of the last generation round (their sessions)
        self._prompt_replicas: dict[tuple[int, ...], int] = {}  # first-turn prompt -> the replica that sampled it

    def _log(self, name: str, value: float) -> None:
        # Always the training logs: a push serves the training's rollouts (the pipeline runs no TRL eval loop), and
        # the push made for the evaluation at step 0 (grpo_steps.training.eval_during) comes before Trainer puts the
        # freshly loaded model (eval mode) into train mode; TRL would drop eval-mode metrics of a training step.
        if self.policy is not None:
            self.policy.log(f"weight_sync/{name}", value)

    def sync_weights(self, force: bool = False) -> None:
        """Push the policy (every ``sync_every`` optimizer steps unless ``force``); with a producer, none of its
        requests is in flight meanwhile."""
        if not force and self.pushed_version is not None and self.policy.step() % self.settings.sync_every:
            return
        if self.prefetcher is None:
            self._push()
            return
        waited = time.perf_counter()
        with self.prefetcher.paused():
            self._log("drain_seconds", time.perf_counter() - waited)  # the producer's request in flight, waited for
            self._push()

    def _push(self) -> None:
        from accelerate.utils import broadcast_object_list

        accelerator, version = self.policy.accelerator, self.policy.step()
        start = time.perf_counter()
        policy_model = accelerator.unwrap_model(self.policy.model())
        if self.settings.lora == "merged":  # full weights under the base model's names (no ZeRO-3: config-checked)
            from grpo_steps.training.weight_sync import merged_state_dict

            state_dict = merged_state_dict(policy_model) if accelerator.is_main_process else {}
            policy_model = policy_model.get_base_model()
        else:  # as Trainer.save_model: under DeepSpeed the engine gathers (ZeRO-3: a collective, the dict on rank 0)
            state_dict = self.policy.state_dict()
        gathered = time.perf_counter()
        parts = {"write_seconds": 0.0, "reload_seconds": 0.0}
        error: BaseException | None = None  # rank 0's failure, re-raised on every rank after the broadcast
        weights: tuple[float, ...] = ()
        if accelerator.is_main_process:
            try:
                weights = weights_fingerprint(state_dict)
                parts = self.push.push(state_dict, version, model=policy_model)
            except Exception as err:  # noqa: BLE001  (not swallowed: raised on every rank below)
                error = err
        del state_dict
        pushed = time.perf_counter()
        # every rank: a collective forward under ZeRO-3
        policy = policy_logprobs(self.policy.model(), self.settings.probe_ids) if self.settings.probe_policy else None
        gap = None
        if accelerator.is_main_process and error is None:
            try:
                gap = self._verify(version, weights, policy)
            except Exception as err:  # noqa: BLE001  (not swallowed: raised on every rank below)
                error = err
        message = broadcast_object_list([None if error is None else f"{type(error).__name__}: {error}"])[0]
        if error is not None:
            raise error
        if message is not None:
            raise GenerationServerError(f"rank 0 failed the weight push of step {version}: {message}")
        done = time.perf_counter()
        self.pushed_version, self.first_batch_pending, self.first_batch = version, True, None
        if self.settings.lora == "adapter":
            from grpo_steps.lora import adapter_name

            self.client.model = adapter_name(self.client.base_model, version)
            if self._producer_client is not None:
                self._producer_client.model = self.client.model
        self._log("gather_seconds", gathered - start)
        # the fingerprint and the push's bookkeeping count as writing: the parts add up to the total
        self._log("write_seconds", (pushed - gathered) - parts["reload_seconds"])
        self._log("reload_seconds", parts["reload_seconds"])
        self._log("verify_seconds", done - pushed)
        self._log("seconds", done - start)
        self._log("version", float(version))
        if gap is not None:
            self._log("probe_logp_diff", gap)

    def _verify(self, version: int, weights: tuple[float, ...], policy: list[float] | None) -> float | None:
        """Rank 0: check every replica's label and probe, in parallel (see :func:`check_served_version`; each replica
        against its own earlier answers); returns the largest mean |server - policy| probe logp (None without a
        policy probe). With several replicas, one line names each replica's label. Raises GenerationServerError
        (naming the replica)."""
        def check(client: VLLMClient) -> tuple[ProbeRecord, str]:
            record = ProbeRecord(version, weights, client.prompt_logprobs(self.settings.probe_ids), policy)
            label = self.push.served_label(client)
            check_served_version(record, self.history.get(client.endpoint, []), label, self.settings.probe_tolerance,
                                 step=version + 1)
            return record, label

        client = self.push.client
        checked = client.each(check)
        for replica, (record, _) in zip(client.replica_clients(), checked, strict=True):
            self.history[replica.endpoint] = (self.history.get(replica.endpoint, []) + [record])[-HISTORY:]
        if client.replicas:
            self._log("replicas", float(len(checked)))
            print(f"[weight-sync] version {version} verified on {len(checked)} replicas: "
                  + ", ".join(f"{r.endpoint} {label}" for r, (_, label) in zip(client.replica_clients(), checked,
                                                                                strict=True)), flush=True)
        return None if policy is None else max(mean_abs_diff(record.served, policy) for record, _ in checked)

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
            GenerationServerError: the server failed the request.
        """
        if images is not None and any(images):
            raise ValueError("the generation server path is text-only: no images")
        group = max(num_generations, 1)
        if len(prompts) % group or any(p != prompts[i - i % group] for i, p in enumerate(prompts)):
            raise ValueError(f"generate got {len(prompts)} prompts that are not whole groups of {group} equal prompts "
                             "in a row: each process's generation batch (train.per_device_train_batch_size x "
                             "steps_per_generation) must be a multiple of train.num_generations")
        samples, version, waited = None, self.pushed_version, time.perf_counter()
        key = self.policy.micro_step() if self.policy is not None else -1
        if self.prefetcher is not None and group > 1 and self.policy.model().training and key != self._served_key:
            self._served_key = key  # the first turn of this generation batch (other calls: resample's extra rounds)
            samples, version = self._take(key, prompts, group)
        if samples is None:
            with profiler if profiler is not None else contextlib.nullcontext():
                samples = self._sample(self.client, prompts, group)
        if group > 1:  # a first turn: the generation batch's samples, sampled now or prefetched
            self.sampled_version = version
            if self.policy is not None:
                self.policy.log("generation/wait_seconds", time.perf_counter() - waited)
        completion_ids = [s["completion_ids"] for group_samples in samples for s in group_samples]
        logprobs = [s["logprobs"] for group_samples in samples for s in group_samples]
        replicas = [s.get("replica") for group_samples in samples for s in group_samples]
        if group > 1:
            self._log_replicas(replicas)
            self._prompt_replicas.update((tuple(p), r) for p, r in zip(prompts, replicas, strict=True) if r is not None)
        # the first turn after a push, sampled by the policy of now: what the first-batch check scores
        if self.first_batch is None and version == (self.policy.step() if self.policy else version):
            self.first_batch = list(zip(prompts, completion_ids, logprobs, replicas, strict=True))
        return (prompts, completion_ids, [[[lp] for lp in seq] for seq in logprobs],
                [[[token] for token in seq] for seq in completion_ids])

    def begin_generation_batch(self) -> None:
        """Forget which replica sampled the prompts of the previous generation batch (see :meth:`replica_rows`)."""
        self._prompt_replicas.clear()

    def replica_rows(self, prompt_ids, prompt_mask):
        """The replica that sampled each row of this generation batch: ``prompt_ids`` / ``prompt_mask`` (B, P)
        (TRL's padded prompts) -> (B,) int64 on their device, -1 where not known. A row's replica is the one that
        sampled its prompt's first turn (a group, and with ``consistent_hash`` a whole episode, is served by one)."""
        import torch

        rows = [self._prompt_replicas.get(tuple(ids[mask.bool()].tolist()), -1)
                for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        return torch.tensor(rows, dtype=torch.int64, device=prompt_ids.device)

    def _log_replicas(self, replicas: list[int | None]) -> None:
        """``generation/replica<i>/completions``: how many completions of this generation round (this process's
        share) replica i sampled, when the answers say (see :meth:`VLLMClient.replica_index`)."""
        if self.policy is None or not self.client.replicas or all(r is None for r in replicas):
            return
        for i in range(len(self.client.replicas)):
            self.policy.log(f"generation/replica{i}/completions", float(replicas.count(i)))

    def _sample(self, client: VLLMClient, prompts: list[list[int]], group: int) -> list[list[dict]]:
        """One request for ``prompts`` (whole groups of ``group``): per distinct prompt, ``group`` samples
        ``{"completion_ids", "logprobs"}``. A follow-up turn's prompt holds the conversation so far: the new tokens
        are capped so that the longest prompt still fits the server's context, and a prompt that fills it gets an
        empty turn."""
        unique = prompts[::group]
        fits = [i for i, p in enumerate(unique) if len(p) < self.settings.max_model_len]
        samples: list[list[dict]] = [[{"completion_ids": [], "logprobs": []}] * group for _ in unique]
        if group > 1:
            self._episodes = unique  # the first turns: a follow-up turn's prompt starts with its episode's
        if fits:
            room = self.settings.max_model_len - max(len(unique[i]) for i in fits)
            sampled = client.complete([unique[i] for i in fits], group,
                                      max_tokens=min(self.gen.max_completion_tokens, room),
                                      temperature=self.gen.temperature, request=self.gen.sampling_request(),
                                      sessions=[self._session(unique[i]) for i in fits] if client.replicas else None)
            for i, group_samples in zip(fits, sampled, strict=True):
                samples[i] = group_samples
        return samples

    def _session(self, prompt: list[int]) -> str:
        """The router's session of ``prompt``: its episode's first turn (the longest first-turn prompt it starts
        with), so every turn of an episode is served by one replica (prefix cache) under ``consistent_hash``."""
        starts = [q for q in self._episodes if len(q) <= len(prompt) and prompt[:len(q)] == q]
        return session_id(max(starts, key=len) if starts else prompt)

    def start_async(self, depth: int, upcoming: Callable[[int], list[tuple[int, list[list[int]]]]]) -> None:
        """``generation.async``: start the producer thread (its own client of the server), which samples up to
        ``depth`` generation batches ahead (``upcoming(key)``: the ``(key, prompt ids)`` of the generation batches
        after the one at micro-step ``key``, :class:`grpo_steps.training.async_rollouts.PromptStream`); a batch staler
        than ``settings.max_staleness`` optimizer steps is dropped."""
        self._producer_client = dataclasses.replace(self.client)
        self._producer_client.model, self._producer_client.base_model = self.client.model, self.client.base_model
        self._upcoming = upcoming
        self.prefetcher = RolloutPrefetcher(lambda prompts, group: self._sample(self._producer_client, prompts, group),
                                            lambda: self.pushed_version, max_staleness=self.settings.max_staleness,
                                            depth=depth)

    def _take(self, key: int, prompts: list[list[int]], group: int) -> tuple[list[list[dict]] | None, int | None]:
        """The prefetched samples of the generation batch at ``key`` and the version that sampled them, the next
        batches queued; ``(None, pushed_version)`` when it was not prefetched or is too stale (then sampled now)."""
        prefetcher = self.prefetcher
        step = self.policy.step()
        prefetcher.fill([(key, prompts)], group, current_key=key - 1)
        prefetcher.fill(self._upcoming(key), group, current_key=key)
        batch = prefetcher.take(key, prompts, current_version=step)
        stats = prefetcher.drain_stats()
        for name, value in (("staleness", step - batch.version if batch else 0.0),
                            ("trainer_wait_seconds", stats.trainer_wait_s),
                            ("producer_idle_seconds", stats.producer_idle_s),
                            ("dropped", stats.dropped), ("missed", stats.missed),
                            ("ready_ahead", stats.ready_ahead[-1] if stats.ready_ahead else 0),
                            ("queue_depth", prefetcher.queued())):
            self.policy.log(f"async/{name}", float(value))
        if batch is None:
            return None, self.pushed_version
        return batch.result, batch.version

    def check_first_batch(self) -> None:
        """After a generation round (every rank): when this is the first batch sampled after a push by the policy of
        the moment, score its first completions with the policy under the distribution the server samples from
        (:func:`grpo_steps.training.sampling.processed_logprobs`) and compare with the sampler's logprobs; the
        largest mean |difference| over the processes decides, so every rank raises together. Only with
        ``settings.checks_first_batch``.

        Raises:
            GenerationServerError: the mean |sampling logp - policy logp| is above ``settings.max_logp_diff``.
        """
        if not (self.first_batch_pending and self.first_batch is not None):
            return
        self.first_batch_pending = False
        if not self.settings.checks_first_batch:
            return
        import torch

        endpoints = self.client.replicas
        diffs: list[float] = []
        by_replica: list[list[float]] = [[] for _ in endpoints]
        for prompt_ids, completion_ids, logprobs, replica in first_completions(self.first_batch):
            if completion_ids:
                policy = processed_logprobs(self.policy.model(), prompt_ids, completion_ids, self.gen)
                diffs += [abs(a - b) for a, b in zip(logprobs, policy, strict=True)]
                if replica is not None:
                    by_replica[replica] += diffs[-len(completion_ids):]
        # inf when the policy excludes a token the server sampled; NaN: a replica that sampled none of it here
        gaps = [sum(d) / len(d) if d else float("nan") for d in [diffs or [0.0], *by_replica]]
        accelerator = self.policy.accelerator
        gathered = accelerator.gather(torch.tensor([gaps], device=accelerator.device)).view(-1, len(gaps))
        gathered = torch.where(torch.isnan(gathered), torch.full_like(gathered, -1.0), gathered)
        value, *per_replica = gathered.max(dim=0).values.tolist()  # -1: no replica's completion on any process
        self.policy.log("weight_sync/first_batch_logp_diff", value)
        for i, gap in enumerate(per_replica):
            if gap >= 0:
                self.policy.log(f"weight_sync/replica{i}/first_batch_logp_diff", gap)
        if not value <= self.settings.max_logp_diff:
            version = self.pushed_version
            off = [f"replica {i + 1}/{len(endpoints)} {endpoints[i]}: {gap:.3g}"
                   for i, gap in enumerate(per_replica) if not gap <= self.settings.max_logp_diff]
            raise GenerationServerError(
                f"step {self.policy.step() + 1}: the first batch sampled after pushing version {version} "
                f"({version_label(version)}) has mean |sampling logp - policy logp| = {value:.3g} nats per token "
                f"under the configured sampling settings, above generation.sync_check.max_logp_diff = "
                f"{self.settings.max_logp_diff:g}"
                + (f" (sampled by {'; '.join(off)})" if off else "")
                + ": the server does not sample from the policy (stale or other weights, other sampling settings, "
                "or a server started without --logprobs-mode processed_logprobs)"
            )

    def close(self) -> None:
        """Stop the producer (waiting for its request in flight), remove this run's sync directory (rank 0; the
        server keeps the weights in memory)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.push is not None:
            self.push.close()
            shutil.rmtree(self.push.root, ignore_errors=True)


def server_settings(cfg, client: VLLMClient, tokenizer, probe_prompt, output_dir: str) -> ServerSettings:
    """The :class:`ServerSettings` of a training process for ``cfg`` (a :class:`grpo_steps.config.PipelineConfig`):
    it samples through ``client`` (this rank's client of the server; ``client.base_model`` the served base model
    name) with ``cfg.generation`` within ``cfg.model.max_model_len`` tokens; rank 0 pushes into a fresh
    :func:`grpo_steps.training.weight_sync.sync_root` (``generation.sync_dir``, else under ``output_dir``): the
    adapter alone with ``train.peft.push: adapter``
    (:class:`grpo_steps.training.weight_sync.AdapterPush`), else full weights; the probe is ``probe_prompt`` (a
    dataset prompt, chat template applied) cut to ``PROBE_TOKENS`` tokens; tolerances from
    ``generation.sync_check``."""
    from accelerate.state import PartialState

    from grpo_steps.data import encode_prompt

    gen, lora = cfg.generation, cfg.train.peft.push if cfg.train.peft else None
    push = None
    if PartialState().is_main_process:
        root = sync_root(gen.sync_dir, output_dir)
        push = AdapterPush(client, root, base_model=client.base_model) if lora == "adapter" \
            else DiskWeightPush(client, root)
    probe_tolerance, max_logp_diff = gen.sync_check.thresholds(cfg.model.dtype)
    return ServerSettings(client=client, gen=gen, max_model_len=cfg.model.max_model_len, push=push,
                          probe_ids=encode_prompt(tokenizer, probe_prompt)[:PROBE_TOKENS],
                          probe_tolerance=probe_tolerance, max_logp_diff=max_logp_diff,
                          sync_every=gen.weight_sync_every, lora=lora,
                          max_staleness=gen.async_.max_staleness if gen.async_ else None)
