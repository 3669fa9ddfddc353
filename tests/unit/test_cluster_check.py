"""``make cluster-check`` (grpo_steps/cluster_check.py) against recorded answers of a cluster's API server: the
kubernetes client asks as it would ask a real one, and a stand-in for its HTTP pool (urllib3's) answers with the
recorded JSON bodies (tests/unit/data/cluster_check/healthy.json), which the client deserialises itself. The bucket is
a real S3 server (SeaweedFS) with the flow's identity and a read-only one, as infra/s3/ scopes them. A healthy cluster
and three broken ones: a Secret without one of its keys, a verb the Role does not grant, read-only keys that write."""

import copy
import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import urllib3

from grpo_steps import cluster_check
from grpo_steps.config import REPO_ROOT, load_config

RECORDED = json.loads((Path(__file__).parent / "data" / "cluster_check" / "healthy.json").read_text())
FLOW_KEYS = ("grpo-flow-key", "grpo-flow-secret-0123456789")
READER_KEYS = ("grpo-reader-key", "grpo-reader-secret-0123456789")
ACCOUNT = "system:serviceaccount:grpo:grpo-flow"


class RecordedApiServer:
    """urllib3's ``PoolManager.request`` as the kubernetes client calls it, answered from recorded bodies: a GET by its
    path (404 Status otherwise, as the API server says it), a SelfSubjectAccessReview allowed unless its
    ``(group, resource, verb)`` is in ``denied`` or it does not impersonate the flow's account. Nothing is written."""

    def __init__(self, recorded: dict):
        self.answers, self.denied = recorded["answers"], {tuple(d) for d in recorded["denied"]}
        self.requests: list[tuple[str, str]] = []

    def request(self, method, url, body=None, headers=None, **_):
        path = urlsplit(url).path
        self.requests.append((method, path))
        if method == "POST" and path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews":
            review = json.loads(body)
            attrs = review["spec"]["resourceAttributes"]
            resource = attrs["resource"] + (f"/{attrs['subresource']}" if attrs.get("subresource") else "")
            allowed = (headers or {}).get("Impersonate-User") == ACCOUNT and \
                (attrs.get("group", ""), resource, attrs["verb"]) not in self.denied
            return self._answer(201, {**review, "status": {"allowed": allowed}})
        if method == "GET" and path in self.answers:
            return self._answer(200, self.answers[path])
        name = path.rsplit("/", 1)[-1]
        return self._answer(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                  "message": f'"{name}" not found', "code": 404})

    @staticmethod
    def _answer(status: int, body: dict) -> urllib3.HTTPResponse:
        return urllib3.HTTPResponse(body=json.dumps(body).encode(), status=status, preload_content=True,
                                    headers={"Content-Type": "application/json"})


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """SeaweedFS with the flow's identity (every action) and the server pods' read-only one, bucket grpo-metaflow."""
    from grpo_steps.dev import local_s3

    server = local_s3.start(tmp_path_factory.mktemp("s3"), bucket="grpo-metaflow", access_key=FLOW_KEYS[0],
                            secret_key=FLOW_KEYS[1], readers={READER_KEYS[0]: READER_KEYS[1]})
    yield server
    local_s3.stop(server)


def _doctor(recorded: dict, endpoint: str, **data) -> tuple[int, list[str], RecordedApiServer]:
    """The checks' lines for the shipped multinode config (``data`` keys set) and profile (the S3 endpoint added)
    against ``recorded``."""
    from kubernetes import client as k8s

    api_client = k8s.ApiClient(k8s.Configuration(host="https://cluster.example:6443"))
    server = RecordedApiServer(recorded)
    api_client.rest_client.pool_manager = server
    profile = {**json.loads((REPO_ROOT / "infra/metaflow/config-k8s-argo.json").read_text()),
               "METAFLOW_S3_ENDPOINT_URL": endpoint}
    cfg = load_config(REPO_ROOT / "configs/multinode.yaml")
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update=data)})
    checks = cluster_check.run_checks(api_client, cfg, profile)
    lines = cluster_check.report(checks)
    print("\n".join(lines))  # as `make cluster-check` prints them (pytest -s shows them)
    assert lines[-1] == f"{len(checks) - sum(not c.ok for c in checks)} of {len(checks)} checks passed"
    return sum(not c.ok for c in checks), lines, server


def _failures(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("FAIL")]


def test_a_healthy_cluster_passes_every_check_and_nothing_is_written(bucket):
    failed, lines, server = _doctor(RECORDED, bucket.endpoint)
    assert failed == 0, _failures(lines)
    rules = cluster_check.role_rules()
    reviews = [r for r in server.requests if r[1].endswith("selfsubjectaccessreviews")]
    assert len(reviews) == len(rules) and ("jobset.x-k8s.io", "jobsets", "create") in rules
    assert {method for method, _ in server.requests} == {"GET", "POST"}  # reviews are the only POSTs: no change
    assert any("write s3://grpo-metaflow/metaflow/weight-sync/ with the server pods' keys: refused" in line
               for line in lines)
    assert not [line for line in lines if "grpo-flow-secret" in line or "grpo-reader-secret" in line]
    import boto3

    s3 = boto3.client("s3", endpoint_url=bucket.endpoint, aws_access_key_id=FLOW_KEYS[0],
                      aws_secret_access_key=FLOW_KEYS[1], region_name="us-east-1")
    assert s3.list_objects_v2(Bucket="grpo-metaflow").get("KeyCount", 0) == 0


def test_a_secret_without_a_key_is_named_with_the_command_that_makes_it(bucket):
    recorded = copy.deepcopy(RECORDED)
    secret = recorded["answers"]["/api/v1/namespaces/grpo/secrets/grpo-mlflow-credentials"]
    del secret["data"]["MLFLOW_TRACKING_PASSWORD"]
    failed, lines, _ = _doctor(recorded, bucket.endpoint)
    assert failed == 1
    (line,) = _failures(lines)
    assert line.startswith("FAIL  secret grpo/grpo-mlflow-credentials: no key MLFLOW_TRACKING_PASSWORD "
                           "(has MLFLOW_TRACKING_USERNAME) -> kubectl -n grpo create secret generic "
                           "grpo-mlflow-credentials --from-literal=MLFLOW_TRACKING_USERNAME=...")


def test_a_denied_verb_names_the_role_to_apply(bucket):
    recorded = copy.deepcopy(RECORDED)
    recorded["denied"] = [["argoproj.io", "workflowtaskresults", "patch"]]
    failed, lines, _ = _doctor(recorded, bucket.endpoint)
    assert failed == 1
    (line,) = _failures(lines)
    assert line.startswith(f"FAIL  {ACCOUNT} may create,patch workflowtaskresults.argoproj.io: denied: patch -> "
                           "kubectl apply -f infra/k8s/rbac.yaml")


def test_read_only_keys_that_write_fail_and_the_object_is_removed(bucket):
    recorded = copy.deepcopy(RECORDED)
    reader = recorded["answers"]["/api/v1/namespaces/grpo/secrets/grpo-s3-readonly"]
    reader["data"] = recorded["answers"]["/api/v1/namespaces/grpo/secrets/grpo-s3-credentials"]["data"]
    failed, lines, _ = _doctor(recorded, bucket.endpoint)
    assert failed == 1
    (line,) = _failures(lines)
    assert line.startswith("FAIL  write s3://grpo-metaflow/metaflow/weight-sync/ with the server pods' keys: ALLOWED "
                           "(the test object was deleted again) -> the Secret grpo-s3-readonly must hold read-only")
    import boto3

    s3 = boto3.client("s3", endpoint_url=bucket.endpoint, aws_access_key_id=FLOW_KEYS[0],
                      aws_secret_access_key=FLOW_KEYS[1], region_name="us-east-1")
    assert s3.list_objects_v2(Bucket="grpo-metaflow").get("KeyCount", 0) == 0


CONTROLLER = "/apis/apps/v1/namespaces/argo/deployments/workflow-controller"


@pytest.mark.parametrize(("tag", "skip_seen", "failed", "detail"), [
    ("v3.7.10", True, 0, "ok    Argo release: v3.7.10"),
    ("v4.0.1", True, 0, "ok    Argo release: v4.0.1"),
    ("v3.7.11", False, 0, "ok    Argo release: v3.7.11 (here a run with no new rows (data.skip_seen: the "
                          "no_new_rows route) would hang in end)"),
    ("v3.7.11", True, 1, "FAIL  Argo release: v3.7.11 (here a run with no new rows"),
    ("v4.0.2", True, 1, "FAIL  Argo release: v4.0.2 (here a run with no new rows"),
    ("v4.1.4", True, 1, "FAIL  Argo release: v4.1.4 (here a run with no new rows"),
    ("v3.4.17", False, 1, "FAIL  Argo release: v3.4.17 -> install Argo Workflows 3.5 or newer"),
    ("latest", True, 1, "FAIL  Argo release: not read from the image quay.io/argoproj/workflow-controller:latest"),
])
def test_argos_release_is_read_from_the_controllers_image(bucket, tag, skip_seen, failed, detail):
    """From v3.7.11 and v4.0.2 Argo never starts ``end`` on the no_new_rows route (tests/unit/test_rehearsal_dag.py):
    a config that can take it (``data.skip_seen``) fails there, naming the releases and the workflow timeout."""
    recorded = copy.deepcopy(RECORDED)
    recorded["answers"][CONTROLLER]["spec"]["template"]["spec"]["containers"][0]["image"] = \
        f"quay.io/argoproj/workflow-controller:{tag}"
    got, lines, _ = _doctor(recorded, bucket.endpoint, skip_seen=skip_seen)
    assert got == failed, _failures(lines)
    (line,) = [line for line in lines if "Argo release" in line]
    assert line.startswith(detail), line
    if failed and tag != "v3.4.17":
        assert line.endswith(" run Argo v3.7.10 or v4.0.1 (Netflix/metaflow#3043), or deploy with `argo-workflows "
                             "create --workflow-timeout <seconds>` so such a run fails instead (docs/deploy.md "
                             "\"Argo's release\")"), line


def test_without_a_kube_context_it_says_how_to_name_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    assert cluster_check.main(["--profile", str(tmp_path / "none.json")]) == 1
    out = capsys.readouterr().out
    assert "checking against infra/metaflow/config-k8s-argo.json" in out
    assert "FAIL  kube context:" in out and "-> point KUBECONFIG at the cluster's kubeconfig, or pass --context" in out
