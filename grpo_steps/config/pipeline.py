"""The whole run config (:class:`PipelineConfig`): the sections, the rules that span them, and loading (Metaflow's
``Config`` parser, YAML files)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from grpo_steps.config.base import COLOCATE_NEEDS_GPU, DEFAULT_CONFIG, ConfigError, _Section
from grpo_steps.config.credentials import credentials_error, find_credentials
from grpo_steps.config.curriculum import curriculum_refusal
from grpo_steps.config.data import DataConfig, kept_columns
from grpo_steps.config.generation import GenerationConfig, prefetch_depth
from grpo_steps.config.sections import (
    SHARED_MOUNT,
    EvalConfig,
    ModelConfig,
    RegistryConfig,
    ResourcesConfig,
    RewardSpec,
    ScheduleConfig,
    TrackingConfig,
    on_shared_volume,
)
from grpo_steps.config.teacher import TeacherConfig, teacher_refusal
from grpo_steps.config.training import TRANSFORMERS_GENERATION_KEYS, TRL_VLLM_ONLY_KEYS, TrainConfig
from grpo_steps.redaction import redact, redact_value


class PipelineConfig(_Section):
    """The whole run config. Every section has defaults; a YAML file overrides what it names."""

    module_dirs: list[str] = Field(default_factory=lambda: [os.getcwd()], json_schema_extra={
        "default_doc": "the config file's directory, then the working directory"})
    """Directories searched for the modules of dotted reward, tool and environment paths (``my_rewards:score``), in
    order, before the installed packages. Left unset: the config file's directory, then the working directory the
    run was started from (filled in when the file is read, absolute, so every step and ``resume`` search the same
    places). A relative entry is read from the config file's directory. On a cluster (``--with kubernetes``, Argo)
    the modules found there travel in Metaflow's code package (:mod:`grpo_steps.deploy`)."""
    model: ModelConfig = ModelConfig()
    """The policy: weights, dtype, context length."""
    data: DataConfig = DataConfig()
    """The prompts: source or mixture, splits, token budget."""
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="answer_accuracy"), RewardSpec(name="answer_format", weight=0.5)]
    )
    """The reward functions, in TRL's signature, with weights; training and evaluation call the same ones."""
    tools: list[str] = Field(default_factory=list)
    """Python functions the policy may call during a rollout, as dotted paths ``package.module:function`` (type hints
    and a Google-style docstring with ``Args:``: TRL's tool contract). Their schemas are rendered into the prompt by
    ``model.chat_template``; each call runs in the training process (and the evaluation's), its result or error
    goes back to the model, and tool tokens are masked out of the loss."""
    environment: str | dict[str, str] | None = None
    """A stateful environment per rollout (TRL's ``environment_factory``): the dotted path of a factory whose
    instances have ``reset(**row) -> str | None``, public methods as tools and optionally ``get_reward() -> float``
    (an extra reward, weight 1); ``gym:module:Class``, a gymnasium-style class (``reset(seed=) -> (obs, info)``,
    ``step(action) -> (obs, reward, terminated, truncated, info)``), or ``textarena:<id>``, a single-player TextArena
    game (e.g. ``textarena:GuessTheNumber-v0``), both adapted with one ``move(action)`` tool and seeded by the row's
    ``seed`` column (``grpo_steps.tools.games``); or ``{name: factory}``, each row naming its environment in an
    ``environment`` column (kept with ``data.columns``). Each instance runs in a worker process of its own. Null:
    none."""
    generation: GenerationConfig = GenerationConfig()
    """Rollouts: backend, server provider, weight sync, sampling."""
    train: TrainConfig = TrainConfig()
    """GRPO training: hyperparameters, nodes, checkpoints, LoRA, any other ``GRPOConfig`` field."""
    teacher: TeacherConfig | None = None
    """On-policy distillation: a teacher served by vLLM scores every sampled token, its log-ratio to the sampler added
    to the advantage (:class:`grpo_steps.config.teacher.TeacherConfig`, docs/distillation.md); null: GRPO alone."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation of baseline and trained policy (and during training)."""
    registry: RegistryConfig = RegistryConfig()
    """MLflow model registration and the quality gate."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow tracking store and experiment."""
    resources: ResourcesConfig = ResourcesConfig()
    """Kubernetes resources of the training nodes and the generation server."""
    schedule: ScheduleConfig = ScheduleConfig()
    """Cron schedule of the deployed flow."""
    project: str = Field("grpo", pattern=r"^[a-z0-9_]+$")
    """Metaflow ``@project`` name: deployments are named ``{project}.{branch}.GRPOFlow`` per branch
    (``--branch``, ``--production``), so branches never overwrite each other."""

    @field_validator("module_dirs")
    @classmethod
    def _modules_importable_from(cls, dirs: list[str]) -> list[str]:
        from rewards.locate import add_module_dirs

        add_module_dirs(dirs)  # before the rules below import the rewards, tools and environment the config names
        return dirs

    @model_validator(mode="after")
    def _no_credentials_in_the_tree(self) -> PipelineConfig:
        """Credentials anywhere in the tree are refused (:mod:`grpo_steps.config.credentials`)."""
        found = find_credentials(self.model_dump(mode="json"))
        if found:
            raise ValueError(credentials_error(found))
        return self

    @model_validator(mode="after")
    def _teacher_fits(self) -> PipelineConfig:
        refusal = teacher_refusal(self)
        if refusal:
            raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _gate_has_enough_prompts(self) -> PipelineConfig:
        if self.data.num_eval < self.registry.min_eval_prompts:
            raise ValueError(f"data.num_eval ({self.data.num_eval}) is below registry.min_eval_prompts "
                             f"({self.registry.min_eval_prompts}), the fewest held-out prompts the quality gate "
                             "decides on: raise data.num_eval, or lower registry.min_eval_prompts (at least 2)")
        return self

    @model_validator(mode="after")
    def _one_process_per_gpu(self) -> PipelineConfig:
        train, res = self.train, self.resources
        if res.train.gpu and train.processes_per_node != res.train.gpu:
            raise ValueError(f"train.processes_per_node ({train.processes_per_node}) must equal "
                             f"resources.train.gpu ({res.train.gpu}): one training process per GPU")
        return self

    @model_validator(mode="after")
    def _colocate_needs_gpu(self) -> PipelineConfig:
        if self.generation.mode == "colocate" and not self.resources.train.gpu:
            raise ValueError(COLOCATE_NEEDS_GPU)
        return self

    @model_validator(mode="after")
    def _nccl_needs_cuda_on_both_sides(self) -> PipelineConfig:
        gen, res = self.generation, self.resources
        if gen.weight_sync == "nccl" and not (res.train.gpu and (res.vllm.gpu or gen.provider == "external")):
            raise ValueError("generation.weight_sync 'nccl' needs CUDA on both sides: set resources.train.gpu "
                             "and resources.vllm.gpu > 0, or use weight_sync 'disk'")
        return self

    @model_validator(mode="after")
    def _nccl_needs_a_server_of_its_own(self) -> PipelineConfig:
        if self.generation.weight_sync == "nccl" and self.generation.provider == "local":
            raise ValueError("generation.weight_sync 'nccl' needs the server on its own GPUs: "
                             "use generation.provider 'kubernetes' or 'external'")
        return self

    @model_validator(mode="after")
    def _kubernetes_tensor_parallel_fits(self) -> PipelineConfig:
        gen, res = self.generation, self.resources
        if gen.provider == "kubernetes" and gen.server.tensor_parallel_size > max(res.vllm.gpu, 1):
            raise ValueError(f"generation.server.tensor_parallel_size ({gen.server.tensor_parallel_size}) "
                             f"needs as many GPUs: raise resources.vllm.gpu ({res.vllm.gpu})")
        return self

    @model_validator(mode="after")
    def _kubernetes_needs_a_shared_volume(self) -> PipelineConfig:
        """Without ``s3`` sync the server pods load evaluation's weights (and ``disk`` pushes) from files the flow's
        pods write: a volume both mount. With ``s3`` every weight they load comes through S3."""
        gen = self.generation
        if gen.provider == "kubernetes" and gen.weight_sync != "s3" and not self.resources.shared_volume_claim:
            raise ValueError(f"generation.provider 'kubernetes' with weight_sync {gen.weight_sync!r}: the server "
                             "reloads weights from paths the flow writes; set resources.shared_volume_claim to a "
                             "ReadWriteMany PVC, or use weight_sync 's3' (pushes and evaluation weights through S3)")
        return self

    @model_validator(mode="after")
    def _kubernetes_servers_start_from_what_they_read(self) -> PipelineConfig:
        """A server pod starts from ``model.name_or_path``: without the shared volume it cannot read this machine's
        files (the embedded model, converted on this machine; a relative path; a path under ``/shared``)."""
        name = self.model.name_or_path
        if self.generation.provider != "kubernetes" or self.resources.shared_volume_claim:
            return self
        if name.startswith(("embedded:", ".", "~")) or on_shared_volume(name):  # embedded: grpo_steps.models' prefix
            raise ValueError(f"generation.provider 'kubernetes' without resources.shared_volume_claim: the server pods "
                             f"start from model.name_or_path {name!r}, which they cannot read; use a Hugging Face id "
                             "(the pods download it) or set resources.shared_volume_claim and put the model under "
                             f"{SHARED_MOUNT}")
        return self

    @model_validator(mode="after")
    def _kubernetes_loads_only_checked_weights(self) -> PipelineConfig:
        """On Kubernetes every run's pods can write the shared volume, so no server loads an unchecked file from it.
        ``disk`` would: its pushes (``generation.sync_dir``) and evaluation's staged copies under ``/shared`` were
        read by the server pods through vLLM's own reload, with no digest. ``s3`` loads versions of the run's chain,
        checked against the manifest digest in each token-authenticated request; ``nccl`` pushes over NCCL, and its
        evaluation's weights (as backend ``hf``'s, which pushes nothing) are loaded through the pipeline's worker
        extension (:func:`grpo_steps.servers.k8s_manifests.server_args`), which checks them against the tensors' digest
        in the request."""
        gen = self.generation
        if gen.provider == "kubernetes" and gen.backend == "vllm" and gen.weight_sync == "disk":
            raise ValueError("generation.provider 'kubernetes' with weight_sync 'disk': the server pods would load "
                             "pushes and evaluation's weights from the shared volume, which every run's pods can "
                             "write, by path and unchecked; use weight_sync: s3 (every version checked against its "
                             "digest; docs/weight-sync.md, \"Weight versions through S3\")")
        return self

    @model_validator(mode="after")
    def _curriculum_can_run(self) -> PipelineConfig:
        refusal = curriculum_refusal(self)
        if refusal:
            raise ValueError(refusal)
        return self

    @model_validator(mode="after")
    def _kubernetes_needs_the_flow_on_the_cluster(self) -> PipelineConfig:
        if self.generation.provider == "kubernetes" and not self.resources.train.image:
            raise ValueError("generation.provider 'kubernetes' needs the flow on the cluster (the server is "
                             "reached by its Service name): set resources.train.image")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_needs_kubernetes(self) -> PipelineConfig:
        if self.generation.provider != "kubernetes" and self.generation.server.tensor_parallel_size > 1:
            raise ValueError("generation.server.tensor_parallel_size > 1 needs GPUs: use provider 'kubernetes'")
        return self

    @model_validator(mode="after")
    def _rollout_groups_whole(self) -> PipelineConfig:
        """The pipeline's rollout functions (backend ``vllm`` with ``disk`` sync, ``recorded``) sample whole
        groups, so each training process's generation batch must hold whole groups
        (:func:`grpo_steps.training.rollouts.prompt_groups`); TRL's own generation (``hf``, ``nccl``) splits groups
        fine."""
        gen, train = self.generation, self.train
        if gen.backend == "hf" or gen.weight_sync == "nccl":
            return self
        steps = train.grpo.get("steps_per_generation", train.gradient_accumulation_steps)
        what = "per_device_train_batch_size x steps_per_generation (default gradient_accumulation_steps)"
        per_process = train.per_device_train_batch_size * steps if isinstance(steps, int) else None
        if "generation_batch_size" in train.grpo:
            what, size = "train.grpo.generation_batch_size / world size", train.grpo["generation_batch_size"]
            per_process = size // train.world_size if isinstance(size, int) else None
        if per_process is None:  # not an integer: GRPOConfig rejects it at train time
            return self
        if per_process % train.num_generations:
            raise ValueError(
                f"train: with generation.backend {gen.backend!r} each training process samples whole prompt groups, "
                f"but its generation batch, {what} = {per_process}, is not a multiple of num_generations = "
                f"{train.num_generations}; change train.per_device_train_batch_size, train.gradient_accumulation_steps "
                "or train.grpo's steps_per_generation / generation_batch_size so it is"
            )
        return self

    @property
    def multi_turn(self) -> bool:
        """Rollouts of several turns (tools or an environment): an episode's turns should stay on one replica."""
        return bool(self.tools or self.environment)

    @property
    def serves_adapter(self) -> bool:
        """LoRA pushed as an adapter (``train.peft.push: adapter``): the server needs runtime LoRA loading."""
        return self.train.peft is not None and self.train.peft.push == "adapter"

    @model_validator(mode="after")
    def _peft_consistent(self) -> PipelineConfig:
        """LoRA (``train.peft``): ``registry.register: adapter`` needs it. With ``generation.weight_sync: nccl``
        (TRL's server mode) TRL supports LoRA by merging the adapter into the weights and pushing the merged
        weights every step (``trl/generation/vllm_generation.py``, ``_iter_named_params``; DDP and ZeRO-3):
        accepted, and the server needs no LoRA support; adapter-only pushes exist on the ``disk`` path only."""
        if self.registry.register_as == "adapter" and self.train.peft is None:
            raise ValueError("registry.register 'adapter' registers a LoRA adapter: set train.peft (r, alpha, ...) "
                             "or use registry.register: merged")
        return self

    @model_validator(mode="after")
    def _s3_secret_with_s3_on_kubernetes(self) -> PipelineConfig:
        """The Secret reaches only the server pods of ``s3`` sync on Kubernetes: anywhere else it would be ignored."""
        gen = self.generation
        if self.resources.vllm.s3_secret_name is not None and not (gen.weight_sync == "s3"
                                                                   and gen.provider == "kubernetes"):
            raise ValueError(f"resources.vllm.s3_secret_name gives the server pods S3 credentials for weight_sync 's3' "
                             f"with provider 'kubernetes' (got weight_sync {gen.weight_sync!r}, provider "
                             f"{gen.provider!r}): remove it")
        return self

    @model_validator(mode="after")
    def _s3_pushes_full_weights(self) -> PipelineConfig:
        peft = self.train.peft
        if self.generation.weight_sync == "s3" and peft is not None and peft.push == "adapter":
            raise ValueError("generation.weight_sync 's3' pushes full weights through the S3 chain; a LoRA adapter "
                             "push (train.peft.push: adapter) is loaded from a directory the server reads: set "
                             "train.peft.push: merged (base + adapter, as full weights) or weight_sync: disk")
        return self

    @model_validator(mode="after")
    def _eval_during_needs_server_pushes(self) -> PipelineConfig:
        gen, ev = self.generation, self.eval
        if ev.every_steps and not gen.pushes_to_server:
            raise ValueError(
                f"eval.every_steps evaluates during training through the generation server, right after the trainer "
                f"pushed a step's weights to it: that needs generation.backend 'vllm', mode 'server', weight_sync "
                f"'disk' or 's3' (got backend {gen.backend!r}, mode {gen.mode!r}, weight_sync {gen.weight_sync!r}); "
                "set eval.every_steps: 0 (the evaluate step still compares baseline and trained policy)"
            )
        return self

    @model_validator(mode="after")
    def _eval_during_prompts_in_the_eval_split(self) -> PipelineConfig:
        ev = self.eval
        if ev.every_steps and ev.during_training_prompts > self.data.num_eval:
            if "during_training_prompts" not in ev.model_fields_set:  # the default fits the split it is given
                return self._with_eval(during_training_prompts=self.data.num_eval)
            raise ValueError(f"eval.during_training_prompts ({ev.during_training_prompts}) is a subset of the eval "
                             f"split: lower it to at most data.num_eval ({self.data.num_eval})")
        return self

    def _with_eval(self, **defaults: Any) -> PipelineConfig:
        """Resolve ``eval`` defaults that depend on other sections, while the config is being validated (it is never
        changed after): the values are then those of a config that set them."""
        object.__setattr__(self, "eval", self.eval.model_copy(update=defaults))  # frozen: set once, here
        return self

    @model_validator(mode="after")
    def _grpo_keys_of_the_generation_path(self) -> PipelineConfig:
        """``train.grpo`` keys read by only one generation path are refused on the others."""
        gen, grpo = self.generation, self.train.grpo
        trl_vllm = gen.trl_samples_with_vllm
        idle = [(key, "TRL's own vLLM generation (generation.mode 'colocate' or weight_sync 'nccl')")
                for key in TRL_VLLM_ONLY_KEYS if key in grpo and not trl_vllm]
        idle += [(key, "TRL's transformers generation (generation.backend 'hf')")
                 for key in TRANSFORMERS_GENERATION_KEYS if key in grpo and gen.backend != "hf"]
        if "ds3_gather_for_generation" in grpo and not (gen.backend == "hf" or trl_vllm):
            idle.append(("ds3_gather_for_generation", "TRL's own generation (backend 'hf', mode 'colocate' or "
                                                      "weight_sync 'nccl'); the server rollouts gather for each push"))
        if idle:
            raise ValueError("; ".join(f"train.grpo.{key} only applies to {path}, not to generation.backend "
                                       f"{gen.backend!r} with mode {gen.mode!r} and weight_sync {gen.weight_sync!r}: "
                                       "remove it" for key, path in idle))
        return self

    @model_validator(mode="after")
    def _prompt_and_completion_fit_the_model(self) -> PipelineConfig:
        budget = self.data.max_prompt_tokens + self.generation.max_completion_tokens
        if budget > self.model.max_model_len:
            raise ValueError(
                f"data.max_prompt_tokens ({self.data.max_prompt_tokens}) + generation.max_completion_tokens "
                f"({self.generation.max_completion_tokens}) = {budget} tokens exceeds model.max_model_len "
                f"({self.model.max_model_len}), the longest sequence the generation server accepts: lower one of "
                "them or raise model.max_model_len")
        return self

    @model_validator(mode="after")
    def _vespo_token_level_correction(self) -> PipelineConfig:
        mode = self.generation.importance_sampling.mode
        if self.train.loss_type == "vespo" and self.generation.backend == "vllm" and mode.startswith("sequence"):
            raise ValueError(f"train.loss_type 'vespo' weights sequences itself and takes only token-level mismatch "
                             f"ratios (TRL raises otherwise): set generation.importance_sampling.mode to "
                             f"'token_truncate' or 'token_mask' (or 'off'), not {mode!r}")
        return self

    @model_validator(mode="after")
    def _tools_describable(self) -> PipelineConfig:
        """Each tool imports and has a schema (the environment's factory is probed in ``start``)."""
        if self.tools:
            from grpo_steps.tools.functions import tool_functions

            tool_functions(self.tools, self.generation.tool_timeout_s)  # raises ConfigError naming the tool
        if self.environment is not None:
            from grpo_steps.tools.functions import resolve_callable
            from grpo_steps.tools.games import adapter_factory

            named = {"": self.environment} if isinstance(self.environment, str) else self.environment
            for name, path in named.items():
                adapter_factory(path, resolve_callable, f"environment.{name}" if name else "environment")
        return self

    @model_validator(mode="after")
    def _resampling_samples(self) -> PipelineConfig:
        if self.train.zero_signal_groups == "resample" and self.generation.backend == "recorded":
            raise ValueError("train.zero_signal_groups 'resample' generates more groups, and backend 'recorded' "
                             "samples nothing (it trains fixed completions, to compare layouts on the same batches): "
                             "use zero_signal_groups keep or skip with recorded completions")
        return self

    @model_validator(mode="after")
    def _episode_clock_needs_an_environment(self) -> PipelineConfig:
        if self.generation.episode_timeout_s is not None and not self.environment:
            raise ValueError(f"generation.episode_timeout_s {self.generation.episode_timeout_s:g} limits an "
                             "environment's episodes, and this config has no environment: remove it (a tool call "
                             "is limited by generation.tool_timeout_s)")
        return self

    @model_validator(mode="after")
    def _turn_credit_needs_an_environment(self) -> PipelineConfig:
        if self.train.turn_credit is not None and not self.environment:
            raise ValueError(f"train.turn_credit {self.train.turn_credit:g} credits the moves of an environment's "
                             "game per turn, and this config has no environment: remove it")
        return self

    @model_validator(mode="after")
    def _in_flight_pushes_full_weights(self) -> PipelineConfig:
        gen = self.generation
        if gen.async_ is not None and gen.async_.in_flight and self.serves_adapter:
            raise ValueError("generation.async.in_flight true updates the weights under requests in flight, and "
                             "train.peft.push 'adapter' loads each version as a new adapter that only new requests "
                             "name (a request keeps its adapter to the end): set train.peft.push: merged (full "
                             "weights, updated in flight), or in_flight: false / null (pushes wait for the request in "
                             "flight)")
        return self

    @model_validator(mode="after")
    def _async_prefetches_a_batch(self) -> PipelineConfig:
        gen = self.generation
        if gen.async_ is None:
            return self
        steps = optimizer_steps_per_generation(self.train)
        if prefetch_depth(gen.async_.max_staleness, steps, gen.weight_sync_every) < 1:
            raise ValueError(f"generation.async.max_staleness {gen.async_.max_staleness} leaves no batch to sample "
                             f"ahead: a generation batch spans {steps:g} optimizer step(s) and pushes come every "
                             f"{gen.weight_sync_every} (generation.weight_sync_every), so a batch sampled one "
                             f"ahead is up to {steps + gen.weight_sync_every - 1:g} steps old when it trains: set "
                             f"max_staleness to at least that")
        return self

    @model_validator(mode="after")
    def _replay_is_importance_weighted(self) -> PipelineConfig:
        gen = self.generation
        mode = gen.importance_sampling.mode
        if self.train.zero_signal_groups == "replay" and (gen.backend != "vllm" or mode == "off"):
            raise ValueError(f"train.zero_signal_groups 'replay' trains groups an older policy sampled, which only the "
                             f"mismatch correction reweights (pi_policy / pi_sampler, from the sampler's logprobs); "
                             f"generation.backend {gen.backend!r} with generation.importance_sampling.mode {mode!r} "
                             "has none: use backend 'vllm' with an importance_sampling.mode other than 'off', or "
                             "zero_signal_groups: resample or keep")
        return self

    @model_validator(mode="after")
    def _tools_need_sampling(self) -> PipelineConfig:
        if (self.tools or self.environment) and self.generation.backend == "recorded":
            raise ValueError("tools and environment need sampled rollouts (the policy's tool calls run between its "
                             "turns); backend 'recorded' samples nothing: use backend 'vllm'")
        return self

    @model_validator(mode="after")
    def _routed_environments_have_their_column(self) -> PipelineConfig:
        if isinstance(self.environment, dict):
            columns = {name for src in self.data.sources() for name in kept_columns(src)}
            if "environment" not in columns:
                raise ValueError("environment maps names to factories, so every row names its environment in an "
                                 "'environment' column: keep it with data.columns: [environment] (or use one factory)")
        return self

    @model_validator(mode="after")
    def _few_shot_calls_known_tools(self) -> PipelineConfig:
        if self.environment is not None:  # an environment's tools are its methods, known once it is probed
            return self
        names = {path.replace(":", ".").rsplit(".", 1)[-1] for path in self.tools}
        for src in self.data.sources():
            for example in src.few_shot:
                for call in example.tool_calls():
                    if call.name not in names:
                        raise ValueError(f"data.few_shot shows a call of tool {call.name!r}, which is not one of the "
                                         f"tools ({sorted(names) or 'none'}): add it to tools or fix the name")
        return self

    @model_validator(mode="after")
    def _reward_names_unique(self) -> PipelineConfig:
        names = [spec.name for spec in self.rewards]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"rewards {repeated} are listed twice: each reward's metrics and table columns are named "
                             "after it (rewards/<name>/mean); give it one entry with the sum of the weights")
        return self

    @model_validator(mode="after")
    def _rewards_callable_on_the_data(self) -> PipelineConfig:
        from rewards import bind_options, check_signature, resolve_reward

        if not self.rewards:
            raise ValueError("rewards: name at least one reward function")
        columns = {"answer", *(["task"] if self.data.mixture else [])}
        columns.update(name for src in self.data.sources() for name in kept_columns(src))
        for spec in self.rewards:  # unknown name or option, a signature the call cannot fit: clear error
            fn = resolve_reward(spec.name)
            check_signature(fn, spec.name)
            check_signature(bind_options(fn, spec.options, spec.name), spec.name, columns)
        return self

    @model_validator(mode="after")
    def _eval_rewards_configured(self) -> PipelineConfig:
        names = [spec.name for spec in self.rewards]
        # defaults left unset follow the rewards: answer_accuracy / answer_format when configured, else the first
        # reward / no format rate
        fallback = {"correctness_reward": names[0], "format_reward": None}
        for key in ("correctness_reward", "format_reward"):
            value = getattr(self.eval, key)
            if value is not None and value not in names:
                if key not in self.eval.model_fields_set:
                    self._with_eval(**{key: fallback[key]})
                    continue
                raise ValueError(f"eval.{key} {value!r} is not one of the configured rewards {sorted(names)}")
        return self

    def sha256(self) -> str:
        """Hex digest of the canonical JSON of the redacted config (identifies a config across runs; a hash of a
        secret is itself a way to test guesses of it, so it is computed after :func:`redact_value`). ``module_dirs`` is
        left out: the same config run from another directory is the same config."""
        canonical = json.dumps(redact_value(self.model_dump(mode="json", exclude={"module_dirs"})), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def flat_params(self) -> dict[str, str]:
        """The config as dotted ``section.key -> str`` pairs, for MLflow params (values cut at 500 chars; credentials
        redacted by :func:`grpo_steps.redaction.redact_value`)."""
        out: dict[str, str] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and value:
                for key, sub in value.items():
                    walk(f"{prefix}.{key}" if prefix else str(key), sub)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                for i, sub in enumerate(value):
                    walk(f"{prefix}.{i}", sub)
            else:
                out[prefix] = str(value)[:500]

        walk("", redact_value(self.model_dump(mode="json")))  # defence in depth: the validators refuse secrets
        return out


def optimizer_steps_per_generation(train) -> float:
    """Optimizer steps one generation batch trains (TRL: ``steps_per_generation x num_iterations`` micro-batches,
    ``steps_per_generation`` defaulting to ``gradient_accumulation_steps``, over ``gradient_accumulation_steps``
    micro-batches per step).

    >>> from grpo_steps.config import TrainConfig
    >>> optimizer_steps_per_generation(TrainConfig())
    1.0
    >>> optimizer_steps_per_generation(TrainConfig(grpo={"num_iterations": 2}))
    2.0
    """
    accumulation = train.gradient_accumulation_steps
    per_generation = train.grpo.get("steps_per_generation") or accumulation
    return per_generation * train.grpo.get("num_iterations", 1) / accumulation


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid run config {source}:" if source else "invalid run config:"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - {where}: unknown key; remove it or check its spelling (see grpo_steps/config/)")
        elif e["type"] == "value_error":  # a validator's own message names the keys and the fix
            lines.append(f"  - {where}: {redact(e['msg'].removeprefix('Value error, '))}")  # a message may quote input
        else:
            lines.append(f"  - {where}: {e['msg']} (got {redact(repr(redact_value(e.get('input'))))})")
    return "\n".join(lines)


def validate_config(data: dict[str, Any] | None, source: str = "") -> PipelineConfig:
    """Validate a config mapping.

    Raises:
        ConfigError: unknown keys, wrong types, impossible combinations, unknown reward names.
    """
    try:
        return PipelineConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def parse_config(text: str) -> dict[str, Any]:
    """Metaflow ``Config`` parser: YAML text -> validated, fully resolved dict (defaults filled in).

    Raises:
        metaflow.exception.MetaflowException: as :func:`validate_config` (ConfigError), or YAML that is not
            a mapping or does not parse; Metaflow prints its message without a traceback.
    """
    from metaflow.exception import MetaflowException

    class InvalidRunConfig(MetaflowException, ConfigError):  # printed by Metaflow as a block, no traceback
        headline = "Invalid run config (--config config FILE)"

    try:
        data = yaml.safe_load(text)
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"run config must be a YAML mapping, got {type(data).__name__}")
        return validate_config(with_module_dirs(data, config_file_of_command())).model_dump(mode="json")
    except yaml.YAMLError as err:
        raise InvalidRunConfig(f"not valid YAML: {err}") from None
    except ConfigError as err:
        raise InvalidRunConfig(str(err).removeprefix("invalid run config:\n")) from None


def load_config(path: str | Path) -> PipelineConfig:
    """Read and validate a YAML or JSON config file (``module_dirs`` left unset: its directory, then the working
    directory). Raises ConfigError, FileNotFoundError."""
    path = Path(path)
    return validate_config(with_module_dirs(yaml.safe_load(path.read_text()), path), source=str(path))


def config_file_of_command(argv: list[str] | None = None) -> Path:
    """The config file the flow's command line names (``--config config FILE``, Metaflow's option before the
    command), else the flow's default, :data:`DEFAULT_CONFIG`. Metaflow hands its ``Config`` parser the file's text
    only: the module directories need the file's place."""
    argv = sys.argv if argv is None else argv
    for i, arg in enumerate(argv[:-2]):
        if arg == "--config" and argv[i + 1] == "config":
            return Path(argv[i + 2]).resolve()
    return DEFAULT_CONFIG


def with_module_dirs(data: dict[str, Any] | None, config_file: Path) -> dict[str, Any]:
    """``data`` with ``module_dirs`` absolute: left unset, ``config_file``'s directory then the working directory;
    relative entries read from ``config_file``'s directory."""
    data = dict(data or {})
    base = Path(config_file).resolve().parent
    dirs = data.get("module_dirs")
    if dirs is None:
        dirs = [str(base)] + ([os.getcwd()] if Path(os.getcwd()).resolve() != base else [])
    elif isinstance(dirs, list):
        dirs = [str((base / d).resolve()) if isinstance(d, str) else d for d in dirs]
    return {**data, "module_dirs": dirs}
