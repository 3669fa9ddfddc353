"""One run's rights per run on Kubernetes: the flow's Role (infra/k8s/rbac.yaml) and the admission policy that ties
what the flow's account creates and deletes to the run of the pod asking (infra/k8s/admission.yaml), checked on the
shipped objects and on a run's rendered objects. The policy's CEL runs in the API server only; here each rule is
mirrored in Python (:func:`admitted`) and the mirror is checked against the policy's own text, rule by rule."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from grpo_steps.config import REPO_ROOT, validate_config
from grpo_steps.servers import k8s_manifests
from tests.unit.test_manifest_schemas import KUBERNETES_VERSION, _cluster_config

INFRA = REPO_ROOT / "infra" / "k8s"
FLOW = "system:serviceaccount:grpo:grpo-flow"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((INFRA / name).read_text()) if d]


def _role() -> dict:
    (role,) = [d for d in _docs("rbac.yaml") if d["kind"] == "Role"]
    return role


def _verbs(resource: str, group: str = "") -> set[str]:
    return {verb for rule in _role()["rules"] if resource in rule["resources"] and group in rule["apiGroups"]
            for verb in rule["verbs"]}


def test_the_role_grants_argos_executor_and_never_lists_or_changes_secrets():
    assert {"create", "patch"} <= _verbs("workflowtaskresults", "argoproj.io")  # Argo's executor (wait container)
    assert _verbs("secrets") == {"create", "get", "delete"}  # by name: no list, watch, update or patch
    assert not {"update", "patch"} & _verbs("configmaps")  # a ConfigMap is replaced only by delete + create
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in _role()["rules"])


def test_the_admission_policy_validates_and_binds_the_flows_account():
    docs = _docs("admission.yaml")
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    policy, binding = docs
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert FLOW in policy["spec"]["matchConditions"][0]["expression"]
    rules = {r["resources"][0] for r in policy["spec"]["matchConstraints"]["resourceRules"]}
    assert rules == {"secrets", "deployments", "networkpolicies"}  # first of each group: secrets, configmaps, services
    assert all(set(r["operations"]) == {"CREATE", "UPDATE", "DELETE"}
               for r in policy["spec"]["matchConstraints"]["resourceRules"])


def _policy_text() -> str:
    return (INFRA / "admission.yaml").read_text()


def admitted(obj: dict, pod: str, s3_secret: str = "grpo-s3-readonly") -> bool:
    """The policy's validations, mirrored: would a request of the flow's account from pod ``pod`` to create (or
    delete) ``obj`` pass?"""
    run = obj["metadata"].get("labels", {}).get(k8s_manifests.RUN_LABEL, "")
    workflow = run.removeprefix("argo-") if run.startswith("argo-") else ""
    if not (workflow and pod.startswith(workflow + "-")) or not obj["metadata"]["name"].startswith(f"vllm-{run}"):
        return False
    if obj["kind"] != "Deployment":
        return True
    spec = obj["spec"]["template"]["spec"]
    if spec.get("serviceAccountName", "default") != "default" or spec.get("automountServiceAccountToken") is not False:
        return False
    for c in spec["containers"]:
        refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", []) if "secretKeyRef" in
                e.get("valueFrom", {})]
        if any(name != f"vllm-{run}-token" for name in refs):
            return False
        if any(f["secretRef"]["name"] != s3_secret for f in c.get("envFrom", []) if "secretRef" in f):
            return False
    return all("emptyDir" in v or "persistentVolumeClaim" in v
               or v.get("configMap", {}).get("name") == f"vllm-{run}-auth" for v in spec.get("volumes", []))


def test_the_mirror_follows_the_policys_rules():
    text = _policy_text()
    for fragment in ("variables.pod.startsWith(variables.workflow + '-')", "startsWith('vllm-' + variables.run)",
                     "variables.spec.automountServiceAccountToken == false",
                     "e.valueFrom.secretKeyRef.name == 'vllm-' + variables.run + '-token'",
                     "f.secretRef.name == 'grpo-s3-readonly'", "has(v.emptyDir) || has(v.persistentVolumeClaim)",
                     "v.configMap.name == 'vllm-' + variables.run + '-auth'",
                     "request.operation == 'DELETE' ? oldObject : object"):
        assert fragment in text, fragment


def _run_objects(run_id: str) -> list[dict]:
    config = _cluster_config(weight_sync="s3", s3_sync={"url": "s3://grpo-weights/sync"})
    config["generation"]["server"]["replicas"] = 2
    config["train"]["gradient_accumulation_steps"] = 8
    del config["resources"]["shared_volume_claim"]
    config["resources"]["vllm"].update(image="registry.example/grpo-vllm:1", s3_secret_name="grpo-s3-readonly")
    cfg = validate_config(config)
    servers = [k8s_manifests.render_manifests(cfg, run_id, "m", replica=i)[:2] for i in range(2)]
    return [*k8s_manifests.render_auth(cfg, run_id, "t" * 43), k8s_manifests.render_manifests(cfg, run_id, "m")[2],
            *(obj for pair in servers for obj in pair),
            *k8s_manifests.render_router(cfg, run_id, [f"http://{d['metadata']['name']}.ml.svc:8000"
                                                       for d, _ in servers])]


def test_a_run_creates_its_own_objects_and_cannot_touch_another_runs():
    mine, theirs = _run_objects("argo-grpoflow-abc12"), _run_objects("argo-grpoflow-xyz34")
    pod = "grpoflow-abc12-provision-vllm-1234567890"  # a pod of workflow grpoflow-abc12
    for obj in mine:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert admitted(obj, pod), obj["metadata"]["name"]
    # another run's Secret and ConfigMap: neither deleted nor created anew (replaced) by this run's pods
    secret, config_map = theirs[0], theirs[1]
    assert (secret["kind"], config_map["kind"]) == ("Secret", "ConfigMap")
    assert not admitted(secret, pod) and not admitted(config_map, pod)
    # nor relabelled as this run's: the name stays the other run's
    stolen = {**config_map, "metadata": {**config_map["metadata"], "labels": {
        **config_map["metadata"]["labels"], k8s_manifests.RUN_LABEL: "argo-grpoflow-abc12"}}}
    assert not admitted(stolen, pod)
    # a Deployment of this run that reads the other run's token, or mounts a Secret, is refused
    deployment = next(o for o in mine if o["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    reads = yaml.safe_load(yaml.safe_dump(deployment))
    reads["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "GRPO_SERVER_TOKEN"}}})
    mounts = yaml.safe_load(yaml.safe_dump(deployment))
    mounts["spec"]["template"]["spec"].setdefault("volumes", []).append({"name": "s", "secret": {"secretName": "x"}})
    other_account = yaml.safe_load(yaml.safe_dump(deployment))
    other_account["spec"]["template"]["spec"]["serviceAccountName"] = "grpo-flow"
    writes = yaml.safe_load(yaml.safe_dump(deployment))  # the flow's own S3 Secret, which writes the chain
    writes["spec"]["template"]["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "grpo-s3-credentials"}}]
    assert spec["containers"][0]["envFrom"] == [{"secretRef": {"name": "grpo-s3-readonly"}}]
    assert spec["automountServiceAccountToken"] is False
    assert not admitted(reads, pod) and not admitted(mounts, pod) and not admitted(other_account, pod)
    assert not admitted(writes, pod)
    assert not admitted(mine[0], "t-local-runtime-pod")  # no Argo workflow: refused


@pytest.mark.parametrize("name", ["vllm-server.yaml", "vllm-router.yaml"])
def test_server_pods_carry_no_api_token(name):
    assert "automountServiceAccountToken: false" in Path(INFRA / name).read_text()
