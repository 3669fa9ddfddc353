"""Rollouts from our vLLM server with the pipeline's weight pushes (``disk`` or ``s3``), as TRL's ``GRPOTrainer`` asks
for them: the stand-in for TRL's ``VLLMGeneration`` (:class:`RolloutBackend`), with its contract:
``sync_weights`` pushes and verifies the policy (:class:`grpo_steps.training.generation.push.VerifiedPush`),
``generate`` samples every turn (the follow-up turns of TRL's tool loop included; with ``generation.async`` the first
turns come from the producer, :mod:`grpo_steps.training.generation.async_rollouts`) and checks the first batch after a
push (:mod:`grpo_steps.training.generation.first_batch`), ``close`` stops it. Like TRL's ``VLLMGeneration``, it is built
whole from values (:class:`~grpo_steps.training.generation.settings.ServerSettings`, made by :func:`server_settings`)
and from what it reads of the training process (:class:`~grpo_steps.training.generation.settings.PolicyView`: the
model, the accelerator, the step counters, a metric sink), never from the trainer itself; the trainer calls it once
more per round, for the replica of each row with several replicas (:meth:`RolloutBackend.replica_rows`). How first
turns are sampled (now, or ahead by the ``generation.async`` producer) is a mode chosen once
(:func:`grpo_steps.training.generation.async_rollouts.rollout_mode`), not a branch in each method.
"""

from __future__ import annotations

import contextlib
import time

from grpo_steps.servers.client import VLLMClient, session_id
from grpo_steps.training.generation.async_rollouts import rollout_mode
from grpo_steps.training.generation.first_batch import FirstBatchCheck
from grpo_steps.training.generation.push import VerifiedPush
from grpo_steps.training.generation.replica_rows import ReplicaLedger
from grpo_steps.training.generation.settings import PolicyView, ServerSettings
from grpo_steps.training.generation.transport import make_transport

__all__ = ["PROBE_TOKENS", "PolicyView", "RolloutBackend", "ServerSettings", "server_settings"]

PROBE_TOKENS = 16
"""Longest probe sequence, tokens: the policy scores it with one extra forward per push (0.1-0.5 s for
SmolLM2-135M on the 2 shared CPU cores), enough tokens to see any weight change in its logprobs."""


class RolloutBackend:
    """Stands in for TRL's ``VLLMGeneration`` when rollouts come from our server with the pipeline's pushes: TRL's
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
    every ``settings.sync_every`` optimizer steps; with a producer and pushes in flight
    (:func:`~grpo_steps.training.generation.async_rollouts.updates_in_flight`)
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
        self.sampled_version = -1
        """The weight version that sampled the latest first turn (the pushed version, or a prefetched batch's)."""
        self.rollouts = rollout_mode(settings, policy, self._sample, lambda: self.pushed_version)
        """How first turns are sampled, chosen once: now, or ahead by the ``generation.async`` producer
        (:mod:`grpo_steps.training.generation.async_rollouts`)."""
        self._episodes: list[list[int]] = []  # the first-turn prompts of the last generation round (their sessions)

    def sync_weights(self, force: bool = False) -> None:
        """Push the policy (every ``sync_every`` optimizer steps unless ``force``); with a producer, none of its
        requests is in flight meanwhile unless pushes go in flight."""
        if not force and self.pushed_version is not None and self.policy.step() % self.settings.sync_every:
            return
        version = self.policy.step()
        with self.rollouts.push_window():
            self.verified_push(self.policy, version)
            self.pushed_version = version
            if self.settings.lora == "adapter":
                from grpo_steps.weights.labels import adapter_name

                self.client.model = adapter_name(self.client.base_model, version)
            self.rollouts.pushed(version)
        if self.first_batch is not None:
            self.first_batch.armed()

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
        group = whole_groups(prompts, images, num_generations)
        samples = self._first_turn(prompts, group, profiler) if group > 1 else self._follow_up_turn(prompts, profiler)
        completion_ids, logprobs = columns(samples)
        return (prompts, completion_ids, [[[lp] for lp in seq] for seq in logprobs],
                [[[token] for token in seq] for seq in completion_ids])

    def _first_turn(self, prompts: list[list[int]], group: int, profiler) -> list[list[dict]]:
        """The first turns of a generation round (whole groups of ``group``): prefetched, or sampled now; the version
        that sampled them becomes :attr:`sampled_version`, and with a policy they are recorded and checked
        (:meth:`_record`)."""
        waited = time.perf_counter()
        self._episodes = prompts[::group]  # a follow-up turn's prompt starts with its episode's (sessions)
        key = self.policy.micro_step() if self.policy is not None else -1
        ahead = self.rollouts.first_turn(key, prompts, group)
        samples, self.sampled_version = ahead or (self._sample_now(prompts, group, profiler), self.pushed_version)
        if self.policy is not None:
            self.policy.log("generation/wait_seconds", time.perf_counter() - waited)
            self._record(key, prompts, samples)
        return samples

    def _follow_up_turn(self, prompts: list[list[int]], profiler) -> list[list[dict]]:
        """A tool loop's follow-up turn (one prompt per rollout: the conversation so far), sampled now."""
        self.rollouts.follow_up_turn(self.sampled_version)
        return self._sample_now(prompts, 1, profiler)

    def _sample_now(self, prompts: list[list[int]], group: int, profiler) -> list[list[dict]]:
        with profiler if profiler is not None else contextlib.nullcontext():
            return self._sample(self.client, prompts, group)

    def _record(self, key: int, prompts: list[list[int]], samples: list[list[dict]]) -> None:
        """The replica of each row (the ledger), and the first turn after a push sampled by the policy of now: what
        the first-batch check scores."""
        replicas = [s.get("replica") for group_samples in samples for s in group_samples]
        self.ledger.record(key, prompts, replicas, self.policy.log)
        if self.first_batch is not None and self.sampled_version == self.policy.step() and \
                self.first_batch.record(prompts, *columns(samples), replicas):
            self.first_batch.check(self.policy.model(), self.policy.accelerator, self.gen, self.sampled_version,
                                   self.policy.step(), self.policy.log)

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

    def close(self) -> None:
        """Stop the producer (waiting for its request in flight), remove this run's sync directory (rank 0; the
        server keeps the weights in memory)."""
        self.rollouts.close()
        if self.settings.transport is not None:
            self.settings.transport.close()


def whole_groups(prompts: list[list[int]], images, num_generations: int) -> int:
    """The group size G of ``generate``'s ``prompts`` (``num_generations``, at least 1).

    Raises:
        ValueError: images, or prompts that are not whole groups of G equal prompts in a row.
    """
    if images is not None and any(images):
        raise ValueError("the generation server path is text-only: no images")
    group = max(num_generations, 1)
    if len(prompts) % group or any(p != prompts[i - i % group] for i, p in enumerate(prompts)):
        raise ValueError(f"generate got {len(prompts)} prompts that are not whole groups of {group} equal prompts "
                         "in a row: each process's generation batch (train.per_device_train_batch_size x "
                         "steps_per_generation) must be a multiple of train.num_generations")
    return group


def columns(samples: list[list[dict]]) -> tuple[list[list[int]], list[list[float]]]:
    """``(completion_ids, logprobs)`` of ``samples`` (per distinct prompt, its group), one row per completion."""
    return ([s["completion_ids"] for group_samples in samples for s in group_samples],
            [s["logprobs"] for group_samples in samples for s in group_samples])


def server_settings(cfg, client: VLLMClient, tokenizer, probe_prompt, output_dir: str,
                    weight_store: dict | None = None) -> ServerSettings:
    """The :class:`ServerSettings` of a training process for ``cfg`` (a :class:`grpo_steps.config.PipelineConfig`):
    it samples through ``client`` (this rank's client of the server; ``client.base_model`` the served base model
    name) with ``cfg.generation`` within ``cfg.model.max_model_len`` tokens. Rank 0 pushes: with ``weight_sync: s3``
    through the chain at ``weight_store`` (:class:`grpo_steps.training.generation.s3.ChainTransport`; the job's
    :attr:`~grpo_steps.training.job.TrainJob.weight_store`); else into a fresh
    :func:`grpo_steps.training.generation.disk.sync_root` (``generation.sync_dir``, else under ``output_dir``): the
    adapter alone with ``train.peft.push: adapter`` (:class:`grpo_steps.training.generation.disk.AdapterTransport`),
    else full weights. The probe is ``probe_prompt`` (a dataset prompt, chat template applied) cut to ``PROBE_TOKENS``
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
