"""The S3 policies the cluster's identities are given (infra/s3/, quoted by docs/deploy.md) cover what the shipped
cluster configs and Metaflow profile make each identity read: the server pods' read-only keys must reach the weight
versions where the configs put them, or the first push fails on the cluster (issue 69)."""

import json
import re

import pytest

from grpo_steps.config import REPO_ROOT, load_config

PROFILE = json.loads((REPO_ROOT / "infra/metaflow/config-k8s-argo.json").read_text())
CLUSTER_CONFIGS = ["configs/gpu-1node.yaml", "configs/multinode.yaml"]
READ_POLICY = REPO_ROOT / "infra/s3/weights-read-policy.json"
FLOW_POLICY = REPO_ROOT / "infra/s3/flow-policy.json"


def _statements(policy: dict) -> list[dict]:
    return policy["Statement"]


def granted_object_prefixes(policy: dict, action: str) -> list[str]:
    """``bucket/prefix`` of each ``arn:aws:s3:::bucket/prefix*`` the policy allows ``action`` on (``*`` dropped).

    >>> granted_object_prefixes({"Statement": [{"Effect": "Allow", "Action": "s3:GetObject",
    ...                          "Resource": "arn:aws:s3:::b/p/*"}]}, "s3:GetObject")
    ['b/p/']
    """
    out = []
    for statement in _statements(policy):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        if statement["Effect"] == "Allow" and action in actions:
            out += [r.removeprefix("arn:aws:s3:::").rstrip("*") for r in resources if "/" in r]
    return out


def _covered(path: str, prefixes: list[str]) -> bool:
    return any(path.startswith(prefix) for prefix in prefixes)


@pytest.mark.parametrize("config", CLUSTER_CONFIGS)
def test_the_server_pods_keys_read_where_the_cluster_configs_push(config):
    """The weight versions of a run land under ``<bucket>/<prefix>/<flow>/<run id>/`` with the prefix the config's
    ``generation.s3_sync`` resolves to under the shipped profile (null: ``weight-sync/`` under the datastore root);
    the read-only policy grants GetObject and ListBucket there, and nothing that writes."""
    cfg = load_config(REPO_ROOT / config)
    bucket, prefix = cfg.generation.s3_sync.location(PROFILE)
    run_object = f"{bucket}/{prefix}/GRPOFlow/argo-grpoflow-abc12/manifest-1.json"
    policy = json.loads(READ_POLICY.read_text())
    assert _covered(run_object, granted_object_prefixes(policy, "s3:GetObject")), (run_object, policy)
    (listing,) = [s for s in _statements(policy) if s["Action"] == "s3:ListBucket"]
    assert listing["Resource"] == f"arn:aws:s3:::{bucket}"
    assert all(re.fullmatch(r"s3:(GetObject|ListBucket)", a) for s in _statements(policy)
               for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"]))
    assert any(f"{prefix}/GRPOFlow/x".startswith(p.rstrip("*"))
               for p in listing["Condition"]["StringLike"]["s3:prefix"])


def test_the_flows_keys_write_the_datastore_the_data_root_and_the_weight_versions():
    """The flow's own identity writes the datastore root, the data root and every config's weight prefix."""
    policy = json.loads(FLOW_POLICY.read_text())
    writable = granted_object_prefixes(policy, "s3:PutObject")
    deletable = granted_object_prefixes(policy, "s3:DeleteObject")
    roots = [PROFILE[k].removeprefix("s3://") + "/x" for k in ("METAFLOW_DATASTORE_SYSROOT_S3",
                                                                "METAFLOW_DATATOOLS_S3ROOT")]
    weights = ["/".join(load_config(REPO_ROOT / c).generation.s3_sync.location(PROFILE)) + "/x"
               for c in CLUSTER_CONFIGS]
    for path in roots + weights:
        assert _covered(path, writable) and _covered(path, deletable), path


@pytest.mark.parametrize("policy", [READ_POLICY, FLOW_POLICY], ids=lambda p: p.name)
def test_deploy_md_quotes_the_shipped_policy(policy):
    """The page shows the policy a user applies, byte for byte the file the tests check."""
    page = (REPO_ROOT / "docs/deploy.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", page, re.S)
    assert any(json.loads(block) == json.loads(policy.read_text()) for block in blocks), policy.name
    assert f"infra/s3/{policy.name}" in page
