"""What the server-mode generation class (:class:`grpo_steps.training.generation.server.RolloutBackend`) is built
from, as TRL's ``VLLMGeneration`` is built from values and the trainer's model and accelerator: the settings known
before the trainer exists (:class:`ServerSettings`) and what it reads of the training process (:class:`PolicyView`).
Both are read by the generation class, its push and the async half (:mod:`.async_rollouts`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from grpo_steps.config import GenerationConfig
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation.transport import WeightTransport


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
        outputs, which renormalise over the tokens a grammar allows (this check does not re-apply the grammar; the
        mismatch correction does, :mod:`grpo_steps.training.grammar`)."""
        return self.max_logp_diff is not None and self.gen.structured_outputs is None

    @property
    def probe_policy(self) -> bool:
        """Whether each push's probe is scored by the policy too: when the first-batch check cannot compare the
        server with the policy, and with ``generation.async`` (the batches trained were mostly sampled by earlier
        weights, so the first-batch check only runs on a batch sampled by the policy of the moment)."""
        return self.max_staleness is not None or not self.checks_first_batch


@dataclass(frozen=True)
class PolicyView:
    """What :class:`~grpo_steps.training.generation.server.RolloutBackend` reads of the training process, as TRL's
    ``VLLMGeneration`` is given the model and the accelerator: values and callables, each read when used."""

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
