"""Rollouts from our vLLM server with ``disk`` weight sync, as TRL's ``GRPOTrainer`` asks for them: the stand-in
for TRL's ``VLLMGeneration`` (:class:`ServerGeneration`: ``sync_weights`` pushes and verifies the policy, ``generate``
samples every turn, the follow-up turns of TRL's tool loop included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from grpo_steps.config import GenerationConfig
from grpo_steps.servers.client import GenerationServerError, VLLMClient
from grpo_steps.training.async_rollouts import RolloutPrefetcher
from grpo_steps.training.sampling import policy_logprobs
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


@dataclass
class ServerGeneration:
    """Stands in for TRL's ``VLLMGeneration`` when rollouts come from our server with ``disk`` sync: TRL's
    ``GRPOTrainer`` calls ``sync_weights()`` whenever the optimizer step changed and ``generate()`` for every turn it
    samples (``_generate_single_turn``: the first turn of each group, and the follow-up turns of its tool loop).

    ``generate(prompts, num_generations)`` (every rank, its own share): token-id prompts to the server's
    ``/v1/completions`` with this run's sampling settings (``gen``); a first turn holds each prompt ``num_generations``
    times in a row (whole groups: one request with ``n``), a follow-up turn one prompt per rollout.

    ``sync_weights()`` (every rank, collective under ZeRO-3): gathers the policy's state dict, rank 0
    fingerprints (:func:`grpo_steps.training.weight_sync.weights_fingerprint`), writes and reloads it through ``push``
    (version = the optimizer step that produced it); with ``probe_policy`` every rank scores the probe with the
    policy; rank 0 asks the server for its label and its probe logprobs and checks them
    (:func:`grpo_steps.training.weight_sync.check_served_version`); the verdict is broadcast so that every rank
    raises together; it pushes every ``sync_every`` optimizer steps (``generation.weight_sync_every``), and with a
    producer (``generation.async``, :meth:`start_async`) waits for its request in flight first
    (``weight_sync/drain_seconds``) and lets none start until the push is verified. With a producer, the first turn
    of each generation batch comes from the batches it sampled ahead (:mod:`grpo_steps.training.async_rollouts`:
    ``async/*`` metrics), the version that sampled it in ``sampled_version``. Metrics (seconds, into the step's
    log): ``generation/wait_seconds`` (the trainer's wait for a generation batch's first turn),
    ``weight_sync/gather_seconds``,
    ``write_seconds``, ``reload_seconds``, ``verify_seconds``, ``seconds`` (total); ``weight_sync/version``;
    with ``probe_policy``, ``weight_sync/probe_logp_diff`` (mean |server - policy| on the probe, nats per token).

    Raises:
        GenerationServerError: the server failed a request or serves other weights than pushed.
    """

    trainer: object
    client: VLLMClient
    """This rank's client of the server; its ``model`` names the pushed LoRA adapter with ``train.peft.push: adapter``
    (rank 0's push points it there, the other ranks after each verified push)."""
    gen: GenerationConfig
    """The ``generation`` settings sampled with."""
    max_model_len: int
    """The server's context (``model.max_model_len``): a turn's new tokens are capped so prompt + completion fit."""
    push: DiskWeightPush | AdapterPush | None  # rank 0 only
    probe_ids: list[int]
    probe_tolerance: float
    history: list[ProbeRecord] = field(default_factory=list)
    probe_policy: bool = True
    """Score the probe with the policy too (set by :class:`ServerGRPOTrainer`: only when the first-batch check
    does not compare the server with the policy)."""
    pushed_version: int | None = None
    first_batch_pending: bool = False
    first_batch: list[tuple[list[int], list[int], list[float]]] | None = None
    """``(prompt_ids, completion_ids, logprobs)`` of the first turn sampled after the last push (the first-batch
    check's data)."""
    serves_adapter: bool = False
    """LoRA pushed as an adapter (``train.peft.push: adapter``): ``client.model`` follows each push."""
    merge_lora: bool = False
    """LoRA with ``train.peft.push: merged``: push base + adapter merged
    (:func:`grpo_steps.training.weight_sync.merged_state_dict`) as full weights."""
    sync_every: int = 1
    """``generation.weight_sync_every``: push at optimizer steps that are multiples of it (or when forced)."""
    prefetcher: RolloutPrefetcher | None = None
    """``generation.async``: the producer sampling the next generation batches (see :meth:`start_async`)."""
    upcoming: Callable[[int], list[tuple[int, list[list[int]]]]] | None = None
    """``generation.async``: ``upcoming(key)`` gives the ``(key, prompt ids)`` of the generation batches after the one
    at ``key`` (the trainer's micro-step), as many as the producer may sample ahead."""
    sampled_version: int = -1
    """The weight version that sampled the latest first turn (the pushed version, or a prefetched batch's)."""
    _served_key: int = -1
    _producer_client: VLLMClient | None = None

    def _log(self, name: str, value: float) -> None:
        # Always the training logs: a push serves the training's rollouts (the pipeline runs no TRL eval loop), and
        # the push made for the evaluation at step 0 (grpo_steps.eval_during) comes before Trainer puts the freshly
        # loaded model (eval mode) into train mode; TRL would drop eval-mode metrics of a training step.
        self.trainer._metrics["train"][f"weight_sync/{name}"].append(value)

    def sync_weights(self, force: bool = False) -> None:
        """Push the policy (every ``sync_every`` optimizer steps unless ``force``); with a producer, none of its
        requests is in flight meanwhile."""
        if not force and self.pushed_version is not None and self.trainer.state.global_step % self.sync_every:
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

        trainer, accelerator = self.trainer, self.trainer.accelerator
        version = trainer.state.global_step
        start = time.perf_counter()
        policy_model = accelerator.unwrap_model(trainer.model)
        if self.merge_lora:  # full weights under the base model's names (no ZeRO-3: config-checked)
            from grpo_steps.training.weight_sync import merged_state_dict

            state_dict = merged_state_dict(policy_model) if accelerator.is_main_process else {}
            policy_model = policy_model.get_base_model()
        else:  # as Trainer.save_model: under DeepSpeed the engine gathers (ZeRO-3: a collective, the dict on rank 0)
            source = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model
            state_dict = accelerator.get_state_dict(source)
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
        policy = policy_logprobs(trainer.model, self.probe_ids) if self.probe_policy else None
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
        if self.serves_adapter:
            from grpo_steps.lora import adapter_name

            self.client.model = adapter_name(self.client.base_model, version)
            if self._producer_client is not None:
                self._producer_client.model = self.client.model
        self._log("gather_seconds", gathered - start)
        self._log("write_seconds", parts["write_seconds"])
        self._log("reload_seconds", parts["reload_seconds"])
        self._log("verify_seconds", done - pushed)
        self._log("seconds", done - start)
        self._log("version", float(version))
        if gap is not None:
            self._log("probe_logp_diff", gap)

    def _verify(self, version: int, weights: tuple[float, ...], policy: list[float] | None) -> float | None:
        """Rank 0: check the server's label and probe (see :func:`check_served_version`); returns the probe's
        mean |server - policy| logp (None without a policy probe). Raises GenerationServerError."""
        record = ProbeRecord(version, weights, self.push.client.prompt_logprobs(self.probe_ids), policy)
        check_served_version(record, self.history, self.push.served_label(), self.probe_tolerance, step=version + 1)
        self.history = (self.history + [record])[-HISTORY:]
        return None if policy is None else mean_abs_diff(record.served, policy)

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
        key = self.trainer._step if self.trainer is not None else -1
        if self.prefetcher is not None and group > 1 and self.trainer.model.training and key != self._served_key:
            self._served_key = key  # the first turn of this generation batch (other calls: resample's extra rounds)
            samples, version = self._take(key, prompts, group)
        if samples is None:
            with profiler if profiler is not None else contextlib.nullcontext():
                samples = self._sample(self.client, prompts, group)
        if group > 1:  # a first turn: the generation batch's samples, sampled now or prefetched
            self.sampled_version = version
            if self.trainer is not None:
                self.trainer._metrics["train"]["generation/wait_seconds"].append(time.perf_counter() - waited)
        completion_ids = [s["completion_ids"] for group_samples in samples for s in group_samples]
        logprobs = [s["logprobs"] for group_samples in samples for s in group_samples]
        # the first turn after a push, sampled by the policy of now: what the first-batch check scores
        if self.first_batch is None and version == (self.trainer.state.global_step if self.trainer else version):
            self.first_batch = list(zip(prompts, completion_ids, logprobs, strict=True))
        return (prompts, completion_ids, [[[lp] for lp in seq] for seq in logprobs],
                [[[token] for token in seq] for seq in completion_ids])

    def _sample(self, client: VLLMClient, prompts: list[list[int]], group: int) -> list[list[dict]]:
        """One request for ``prompts`` (whole groups of ``group``): per distinct prompt, ``group`` samples
        ``{"completion_ids", "logprobs"}``. A follow-up turn's prompt holds the conversation so far: the new tokens
        are capped so that the longest prompt still fits the server's context, and a prompt that fills it gets an
        empty turn."""
        unique = prompts[::group]
        fits = [i for i, p in enumerate(unique) if len(p) < self.max_model_len]
        samples: list[list[dict]] = [[{"completion_ids": [], "logprobs": []}] * group for _ in unique]
        if fits:
            room = self.max_model_len - max(len(unique[i]) for i in fits)
            sampled = client.complete([unique[i] for i in fits], group,
                                      max_tokens=min(self.gen.max_completion_tokens, room),
                                      temperature=self.gen.temperature, request=self.gen.sampling_request())
            for i, group_samples in zip(fits, sampled, strict=True):
                samples[i] = group_samples
        return samples

    def start_async(self, max_staleness: int, depth: int,
                    upcoming: Callable[[int], list[tuple[int, list[list[int]]]]]) -> None:
        """``generation.async``: start the producer thread (its own client of the server), which samples up to
        ``depth`` generation batches ahead; a batch staler than ``max_staleness`` optimizer steps is dropped."""
        self._producer_client = dataclasses.replace(self.client)
        self._producer_client.model, self._producer_client.base_model = self.client.model, self.client.base_model
        self.upcoming = upcoming
        self.prefetcher = RolloutPrefetcher(lambda prompts, group: self._sample(self._producer_client, prompts, group),
                                            lambda: self.pushed_version, max_staleness=max_staleness, depth=depth)

    def _take(self, key: int, prompts: list[list[int]], group: int) -> tuple[list[list[dict]] | None, int | None]:
        """The prefetched samples of the generation batch at ``key`` and the version that sampled them, the next
        batches queued; ``(None, pushed_version)`` when it was not prefetched or is too stale (then sampled now)."""
        prefetcher = self.prefetcher
        step = self.trainer.state.global_step
        prefetcher.fill([(key, prompts)], group, current_key=key - 1)
        prefetcher.fill(self.upcoming(key), group, current_key=key)
        batch = prefetcher.take(key, prompts, current_version=step)
        stats = prefetcher.drain_stats()
        for name, value in (("staleness", step - batch.version if batch else 0.0),
                            ("trainer_wait_seconds", stats.trainer_wait_s),
                            ("producer_idle_seconds", stats.producer_idle_s),
                            ("dropped", stats.dropped), ("missed", stats.missed),
                            ("ready_ahead", stats.ready_ahead[-1] if stats.ready_ahead else 0),
                            ("queue_depth", prefetcher.queued())):
            self.trainer._metrics["train"][f"async/{name}"].append(float(value))
        if batch is None:
            return None, self.pushed_version
        return batch.result, batch.version

    def close(self) -> None:
        """Stop the producer (waiting for its request in flight), remove this run's sync directory (rank 0; the
        server keeps the weights in memory)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.push is not None:
            self.push.close()
            shutil.rmtree(self.push.root, ignore_errors=True)


def server_generation(client, tokenizer, probe_prompt, output_dir: str, probe_tolerance: float, *,
                      gen: GenerationConfig, max_model_len: int, sync_dir: str | None = None,
                      lora: str | None = None) -> ServerGeneration:
    """The :class:`ServerGeneration` of a training process: it samples through ``client`` with ``gen`` (the
    ``generation`` config) within ``max_model_len`` tokens; rank 0 pushes into a fresh :func:`sync_root`; the probe is
    ``probe_prompt`` (a dataset prompt, chat template applied) cut to ``PROBE_TOKENS`` tokens; ``probe_tolerance``
    in nats per token (``SyncCheckConfig.thresholds``). ``lora`` (``train.peft.push``): ``adapter``, push the
    adapter only (:class:`grpo_steps.training.weight_sync.AdapterPush`) and point ``client`` (the rollout client,
    ``client.base_model`` the served base model name) at it after each push; ``merged``, push base + adapter
    merged as full weights; None: full fine-tuning."""
    from accelerate.state import PartialState

    from grpo_steps.data import encode_prompt

    push = None
    if PartialState().is_main_process:
        root = sync_root(sync_dir, output_dir)
        push = (AdapterPush(client, root, base_model=client.base_model) if lora == "adapter"
                else DiskWeightPush(client, root))
    probe_ids = encode_prompt(tokenizer, probe_prompt)[:PROBE_TOKENS]
    return ServerGeneration(trainer=None, client=client, gen=gen, max_model_len=max_model_len, push=push,
                            probe_ids=probe_ids, probe_tolerance=probe_tolerance, serves_adapter=lora == "adapter",
                            merge_lora=lora == "merged")
