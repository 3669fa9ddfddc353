"""The weight sync's settings in ``generation``: where ``weight_sync: s3`` writes the versions
(``generation.s3_sync``), how each push is verified to serve the weights just pushed (``generation.sync_check``), and
the trainer–inference mismatch correction that weighs what the sampler's weights and kernels leave
(``generation.importance_sampling``, TRL's importance sampling)."""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from grpo_steps.config.base import _Section

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
    the policy itself and ``recorded`` has no sampling distribution, so neither is corrected."""

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
    """How the trainer verifies, after each weight push (``disk`` or ``s3`` sync), that the server serves the new
    weights.

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
        exact = dtype == "float32"  # 16-bit weights round every logit: the noise between two kernels is larger
        probe = (1e-3 if exact else 0.05) if self.probe_tolerance == "auto" else self.probe_tolerance
        first = (1e-3 if exact else 0.5) if self.max_logp_diff == "auto" else self.max_logp_diff
        return float(probe), None if first is None else float(first)


class S3SyncConfig(_Section):
    """Where and how ``weight_sync: s3`` publishes the weight versions: a chain of full anchors and checked sparse
    deltas in S3 (:mod:`grpo_steps.weights.chain`), which every replica fetches and loads through vLLM's weight-update
    protocol (:class:`grpo_steps.vllm_worker.PipelineTransferEngine`). Credentials come from the environment (``AWS_*``,
    as boto3 reads it; on Kubernetes a Secret, ``resources.vllm.s3_secret_name``), never from this file."""

    url: str | None = None
    """``s3://bucket/prefix`` under which each run writes its versions (``<url>/<flow>/<run id>/``, removed when the
    train step ends). Null: ``weight-sync/`` under the Metaflow S3 datastore's root (``METAFLOW_DATASTORE_SYSROOT_S3``,
    which the flow then needs)."""
    endpoint_url: str | None = None
    """The S3 API's URL for an S3-compatible store (SeaweedFS, MinIO); null: ``METAFLOW_S3_ENDPOINT_URL`` when set,
    else boto3's default (AWS, or ``AWS_ENDPOINT_URL_S3``). The trainer and every server reach it at this URL."""
    anchor_every: int = Field(10, ge=1, le=1000)
    """A full anchor at least every this many versions, sparse deltas against the previous version in between (a
    replica that joins late applies at most this many versions, so at most 1000: a longer lineage costs a late
    replica more reads than a new anchor costs the trainer; the manifests' own bound,
    ``grpo_steps.weights.manifest.MAX_ANCHOR_EVERY``, is ten times that)."""

    def location(self, environ: dict | None = None) -> tuple[str, str] | None:
        """``(bucket, prefix)`` of :attr:`url`, or of the Metaflow datastore's root + ``/weight-sync`` when null; None
        when neither is set. ``environ``: default ``os.environ``."""
        import os

        url = self.url
        if url is None:
            root = (os.environ if environ is None else environ).get("METAFLOW_DATASTORE_SYSROOT_S3")
            url = root.rstrip("/") + "/weight-sync" if root else None
        if url is None:
            return None
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return bucket, prefix.strip("/")

    def endpoint(self, environ: dict | None = None) -> str | None:
        """:attr:`endpoint_url`, else ``METAFLOW_S3_ENDPOINT_URL``, else None (boto3's own resolution)."""
        import os

        return self.endpoint_url or (os.environ if environ is None else environ).get("METAFLOW_S3_ENDPOINT_URL")

    @field_validator("url")
    @classmethod
    def _s3_url(cls, value: str | None) -> str | None:
        # S3's bucket naming rules: 3-63 lowercase letters, digits, dots and hyphens, a letter or digit at each end
        if value is not None and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?", value):
            raise ValueError(f"{value!r} is not an s3://bucket/prefix URL")
        return value
