"""A rehearsal of a cluster run on one machine (``make rehearse``): the workflow docs/deploy.md deploys, rendered by
``argo-workflows create --only-json``, run pod by pod as processes, in the order of Argo's DAG.

    python -m grpo_steps.dev.rehearse --dir .rehearsal

What each pod gets (the spec: :mod:`grpo_steps.dev.rehearsal`):

- its command and arguments as rendered, Argo's tags filled (``{{workflow.name}}``, inputs, the outputs of earlier
  tasks read from the files its container wrote, ``/mnt/out/...``);
- the image's environment (infra/Dockerfile's ``ENV`` lines of the flow target, ``PATH`` leading to this checkout's
  virtual environment in place of ``/opt/venv``) and the Secrets it names, made from stand-ins as docs/deploy.md step 2
  documents them: ``grpo-s3-credentials`` holds keys with the rights of infra/s3/flow-policy.json (SeaweedFS
  identities, :mod:`grpo_steps.dev.s3_policy`), ``grpo-mlflow-credentials`` the flow's MLflow user;
- its own empty working directory, ``/tmp``, ``/mnt/out`` and ``/dev/shm`` (a mount namespace of its own: ``unshare
  --mount``, the manifest's emptyDir volumes bound there), and an ``/etc/hosts`` that resolves the JobSet's control node
  as the cluster's DNS would; the train step's JobSet runs its gang's nodes as processes side by side;
- the local S3 (SeaweedFS, bucket ``grpo-metaflow`` as the profile names it) and a real ``mlflow server`` (sqlite) on
  127.0.0.1.

Deviations, each forced by what cannot run here (docs/deploy.md "Rehearsal"): the metadata service is not on PyPI, so
the workflow is rendered with ``METAFLOW_DEFAULT_METADATA=local``; the generation server comes from the config's
override (no API server for provider ``kubernetes``); the model, data and sizes are configs/test.yaml's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from grpo_steps.config import REPO_ROOT

PROFILE = REPO_ROOT / "infra" / "metaflow" / "config-k8s-argo.json"
DOCKERFILE = REPO_ROOT / "infra" / "Dockerfile"
BUCKET = "grpo-metaflow"  # the profile's datastore bucket (infra/metaflow/config-k8s-argo.json)


def profile_env(s3_endpoint: str, credentials: dict[str, str], **overrides: str) -> dict[str, str]:
    """The deploying machine's environment: the shipped profile (every key as shipped but ``overrides``), the local
    S3's endpoint and the flow's keys."""
    profile = {k: str(v) for k, v in json.loads(PROFILE.read_text()).items()}
    return {**profile, "METAFLOW_S3_ENDPOINT_URL": s3_endpoint, "AWS_DEFAULT_REGION": "us-east-1", **credentials,
            "METAFLOW_USER": "rehearsal", **overrides}


def render(config_path: str | Path, env: dict[str, str], cwd: str | Path, timeout_s: float = 600) -> dict:
    """``argo-workflows create --only-json`` of the flow on ``config_path`` (it uploads the code package to the S3
    datastore ``env`` names): the WorkflowTemplate as a dict.

    Raises:
        RuntimeError: the command failed (its stderr's tail in the message).
    """
    cmd = [sys.executable, str(REPO_ROOT / "flows" / "grpo_flow.py"), "--no-pylint", "--config", "config",
           str(config_path), "argo-workflows", "create", "--only-json"]
    out = subprocess.run(cmd, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"argo-workflows create --only-json exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def image_env(dockerfile: str | Path = DOCKERFILE,
              venv_bin: str | Path = Path(sys.executable).parent) -> dict[str, str]:
    """The environment the flow's image gives every container: the ``ENV`` instructions of the Dockerfile's last
    stage (the flow target), ``$PATH`` expanded, with the image's ``/opt/venv`` standing for ``venv_bin``'s
    environment and ``/opt/grpo-pipeline`` for this checkout.

    >>> env = image_env()
    >>> env["PATH"].split(":")[0] == str(Path(sys.executable).parent) and env["GRPO_INFRA_DIR"].endswith("infra")
    True
    """
    stages = re.split(r"^FROM\s", Path(dockerfile).read_text(), flags=re.M)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    text = re.sub(r"\\\n\s*", " ", stages[-1])  # continuation lines joined
    for line in text.splitlines():
        if line.startswith("ENV "):
            for key, value in re.findall(r"(\w+)=(\S+)", line):
                env[key] = value.replace("$PATH", env.get("PATH", ""))
    venv = str(Path(venv_bin).parent)
    return {k: v.replace("/opt/venv", venv).replace("/opt/grpo-pipeline", str(REPO_ROOT)) for k, v in env.items()}
