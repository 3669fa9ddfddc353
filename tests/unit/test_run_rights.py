"""One run's rights per run on Kubernetes: the flow's Role (infra/k8s/rbac.yaml), which reads no Secret or ConfigMap,
and the admission policy that ties what the flow's account creates and deletes to the run of the pod asking
(infra/k8s/admission.yaml), checked on the shipped objects and on a run's rendered objects. The policy's CEL runs in
the API server only; here each rule is mirrored in Python (:func:`admitted`) and the mirror is checked against the
policy's own text, rule by rule; RBAC is evaluated as its authorizer does (:func:`rbac_allows`)."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from grpo_steps.config import REPO_ROOT, validate_config
from grpo_steps.servers import k8s_manifests
from tests.unit.test_manifest_schemas import KUBERNETES_VERSION, _cluster_config

INFRA = REPO_ROOT / "infra" / "k8s"
FLOW = "system:serviceaccount:grpo:grpo-flow"
WORKFLOW_LABEL = k8s_manifests.ARGO_WORKFLOW_LABEL


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((INFRA / name).read_text()) if d]


def _role() -> dict:
    (role,) = [d for d in _docs("rbac.yaml") if d["kind"] == "Role"]
    return role


def _verbs(resource: str, group: str = "") -> set[str]:
    return {verb for rule in _role()["rules"] if resource in rule["resources"] and group in rule["apiGroups"]
            for verb in rule["verbs"]}


def test_the_role_grants_argos_executor_and_never_reads_or_changes_secrets():
    assert {"create", "patch"} <= _verbs("workflowtaskresults", "argoproj.io")  # Argo's executor (wait container)
    # made and deleted by name (admission ties both to the asking pod's run); no get, list, watch, update or patch
    assert _verbs("secrets") == _verbs("configmaps") == {"create", "delete"}
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
    assert rules == {"secrets", "deployments", "networkpolicies", "jobsets"}  # first of each: secrets, configmaps, ...
    assert all(set(r["operations"]) == {"CREATE", "UPDATE", "DELETE"}
               for r in policy["spec"]["matchConstraints"]["resourceRules"])


def _policy_text() -> str:
    return (INFRA / "admission.yaml").read_text()


def _run_of(obj: dict) -> str:
    """The policy's ``run`` variable: the object's run label, a JobSet's Argo workflow label."""
    labels = obj["metadata"].get("labels", {})
    if obj["kind"] == "JobSet":
        return "argo-" + labels[WORKFLOW_LABEL] if WORKFLOW_LABEL in labels else ""
    return labels.get(k8s_manifests.RUN_LABEL, "")


def _pods(obj: dict) -> list[dict]:
    if obj["kind"] == "Deployment":
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "JobSet":
        return [job["template"]["spec"]["template"]["spec"] for job in obj["spec"]["replicatedJobs"]]
    return []


def admitted(obj: dict, pod: str, operation: str = "CREATE") -> bool:
    """The policy's validations, mirrored: would a request of the flow's account from pod ``pod`` to create (or
    delete: ``obj`` is then the object deleted, whose pod specs are not checked) ``obj`` pass?"""
    run = _run_of(obj)
    workflow = run.removeprefix("argo-") if run.startswith("argo-") else ""
    if not (workflow and pod.startswith(workflow + "-")):
        return False
    name, kind, token = obj["metadata"]["name"], obj["kind"], f"vllm-{run}-token"
    dns1035 = "vllm-" + run.replace(".", "-")
    if kind != "JobSet" and not {"Secret": name == token, "ConfigMap": name == f"vllm-{run}-auth"}.get(
            kind, name.startswith(dns1035[:50])):
        return False
    env_from = {"grpo-s3-credentials", "grpo-mlflow-credentials", token} if kind == "JobSet" else {"grpo-s3-readonly"}
    for spec in _pods(obj) if operation != "DELETE" else []:
        if "serviceAccount" in spec or "initContainers" in spec or "ephemeralContainers" in spec:
            return False
        if kind == "JobSet" and spec.get("serviceAccountName") != "grpo-flow":
            return False
        if kind != "JobSet" and (spec.get("serviceAccountName", "default") != "default"
                                 or spec.get("automountServiceAccountToken") is not False):
            return False
        for c in spec["containers"]:
            refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", []) if "secretKeyRef" in
                    e.get("valueFrom", {})]
            if any(ref != token for ref in refs):
                return False
            if any(f["secretRef"]["name"] not in env_from for f in c.get("envFrom", []) if "secretRef" in f):
                return False
        if not all("emptyDir" in v or "persistentVolumeClaim" in v
                   or v.get("configMap", {}).get("name") == f"vllm-{run}-auth" for v in spec.get("volumes", [])):
            return False
    return True


def test_the_mirror_follows_the_policys_rules():
    text = " ".join(_policy_text().split())  # the folded YAML scalars, one line
    for fragment in ("variables.pod.startsWith(variables.workflow + '-')",
                     "'argo-' + variables.obj.metadata.labels['workflows.argoproj.io/workflow']",
                     "variables.obj.metadata.labels['grpo-pipeline/run-id']",
                     "'vllm-' + variables.run.replace('.', '-')", "variables.dns1035.substring(0, 50)",
                     "request.kind.kind == 'Secret' ? variables.obj.metadata.name == variables.token",
                     "request.kind.kind == 'ConfigMap' ? variables.obj.metadata.name == 'vllm-' + variables.run + "
                     "'-auth'", "variables.obj.metadata.name.startsWith(variables.prefix)",
                     "!has(p.serviceAccount)", "p.serviceAccountName == 'grpo-flow'",
                     "p.automountServiceAccountToken == false",
                     "!has(p.initContainers) && !has(p.ephemeralContainers)",
                     "e.valueFrom.secretKeyRef.name == variables.token",
                     "['grpo-s3-credentials', 'grpo-mlflow-credentials', variables.token] : ['grpo-s3-readonly']",
                     "f.secretRef.name in variables.envFromSecrets",
                     "has(v.emptyDir) || has(v.persistentVolumeClaim)",
                     "v.configMap.name == 'vllm-' + variables.run + '-auth'",
                     "request.operation == 'DELETE' ? oldObject : object",
                     "request.operation == 'DELETE' ? []"):
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


MINE, THEIRS = "grpo.user.alice.grpoflow-abc12", "grpo.user.alice.grpoflow-xyz34"
"""Two Argo workflows of the deployed flow (@project names them <project>.<branch>.<flow>-<suffix>: dotted)."""
POD = f"{MINE}-provision-vllm-1234567890"
"""A pod of workflow MINE."""


def _jobset(workflow: str, secrets: list[str]) -> dict:
    """The train step's JobSet as Metaflow renders it (tests/integration/test_argo_render.py), Argo's
    ``{{workflow.name}}`` substituted: the fields the policy reads."""
    pod = {"serviceAccountName": "grpo-flow", "containers": [{
        "name": "train", "image": "registry.example/grpo:1", "envFrom": [{"secretRef": {"name": s}} for s in secrets],
        "env": [{"name": "MF_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    {"name": "shared", "persistentVolumeClaim": {"claimName": "grpo-shared"}}]}
    job = {"name": "control", "template": {"spec": {"template": {"spec": pod}}}}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": "js-abc", "labels": {WORKFLOW_LABEL: workflow}},
            "spec": {"replicatedJobs": [job, {**job, "name": "worker"}]}}


def test_a_run_creates_its_own_objects_and_cannot_touch_another_runs():
    mine, theirs = _run_objects(f"argo-{MINE}"), _run_objects(f"argo-{THEIRS}")
    for obj in mine:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert admitted(obj, POD), obj["metadata"]["name"]
        assert admitted(obj, POD, "DELETE")
    for obj in theirs:  # another run's objects: neither deleted nor created (taken before that run makes them)
        assert not admitted(obj, POD) and not admitted(obj, POD, "DELETE"), obj["metadata"]["name"]
    secret, config_map = theirs[0], theirs[1]
    assert (secret["kind"], config_map["kind"]) == ("Secret", "ConfigMap")
    # nor relabelled as this run's: the name stays the other run's
    for obj in (secret, config_map, theirs[2]):
        stolen = {**obj, "metadata": {**obj["metadata"], "labels": {
            **obj["metadata"]["labels"], k8s_manifests.RUN_LABEL: f"argo-{MINE}"}}}
        assert not admitted(stolen, POD), obj["metadata"]["name"]
    # a Deployment of this run that reads the other run's token, or mounts a Secret, is refused
    deployment = next(o for o in mine if o["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["containers"][0]["envFrom"] == [{"secretRef": {"name": "grpo-s3-readonly"}}]

    def changed(obj: dict, change) -> dict:
        copy = yaml.safe_load(yaml.safe_dump(obj))
        change(_pods(copy)[0])
        return copy

    theirs_token = {"name": "X", "valueFrom": {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "T"}}}
    for change in (lambda p: p["containers"][0]["env"].append(theirs_token),
                   lambda p: p["volumes"].append({"name": "s", "secret": {"secretName": "x"}}),
                   lambda p: p.update(serviceAccountName="grpo-flow"),
                   lambda p: p.update(serviceAccount="grpo-flow"),  # the old alias of serviceAccountName
                   lambda p: p.update(initContainers=[{"name": "i", "image": "x", "env": [theirs_token]}]),
                   # the flow's own S3 Secret, which writes the chain
                   lambda p: p["containers"][0].update(envFrom=[{"secretRef": {"name": "grpo-s3-credentials"}}])):
        assert not admitted(changed(deployment, change), POD)
    assert not admitted(mine[0], "t-local-runtime-pod")  # no Argo workflow: refused
    # the longest names Metaflow gives a workflow (45 characters and "-" + 5): the cut names are still the run's
    longest = "grpo.user.a-very-long-user-name.grpoflow-12345-x7k2p"
    assert all(admitted(obj, f"{longest}-train-1") for obj in _run_objects(f"argo-{longest}"))


def test_the_train_steps_jobset_reads_only_its_own_runs_secrets():
    """Argo creates the train gang's JobSet as the flow's account: its pods may take the run's own token (envFrom,
    grpo_steps.deploy) and Metaflow's Secrets, no other run's token, and run as grpo-flow only."""
    metaflow = ["grpo-s3-credentials", "grpo-mlflow-credentials"]
    own = _jobset(MINE, [*metaflow, k8s_manifests.auth_names(f"argo-{MINE}")[0]])
    assert admitted(own, POD) and admitted(own, POD, "DELETE")
    assert not admitted(_jobset(MINE, [*metaflow, k8s_manifests.auth_names(f"argo-{THEIRS}")[0]]), POD)
    assert not admitted(_jobset(MINE, ["grpo-mlflow-admin"]), POD)  # any other Secret of the namespace
    assert not admitted(_jobset(THEIRS, metaflow), POD) and not admitted(_jobset(THEIRS, metaflow), POD, "DELETE")
    unlabelled = _jobset(MINE, metaflow)
    del unlabelled["metadata"]["labels"]
    assert not admitted(unlabelled, POD)
    other_account = _jobset(MINE, metaflow)
    other_account["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"]["serviceAccountName"] = "argo"
    assert not admitted(other_account, POD)


def _bindings() -> list[tuple[dict, dict]]:
    """(RoleBinding, Role) of the shipped RBAC objects."""
    docs = _docs("rbac.yaml")
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Role"}
    return [(d, roles[d["roleRef"]["name"]]) for d in docs if d["kind"] == "RoleBinding"]


def rbac_allows(user: str, verb: str, resource: str, name: str = "", group: str = "") -> bool:
    """Kubernetes' RBAC authorizer over the shipped Role and RoleBinding (rbac/v1 semantics): a rule grants a request
    when its apiGroups, resources and verbs hold the request's (or ``*``) and, where it names resourceNames, the
    object's name is one of them (a request without a name, a list, matches no rule with resourceNames)."""
    for binding, role in _bindings():
        subjects = {f"system:serviceaccount:{s['namespace']}:{s['name']}" for s in binding["subjects"]
                    if s["kind"] == "ServiceAccount"}
        if user not in subjects:
            continue
        for rule in role["rules"]:
            if ({group, "*"} & set(rule["apiGroups"]) and {resource, "*"} & set(rule["resources"])
                    and {verb, "*"} & set(rule["verbs"])
                    and ("resourceNames" not in rule or (name and name in rule["resourceNames"]))):
                return True
    return False


def test_no_run_can_read_or_change_another_runs_token_or_middleware():
    """RBAC (nothing reads a Secret or ConfigMap) and admission (create and delete only the asking pod's run's)
    together: run A's identity can neither read nor replace run B's token Secret or middleware ConfigMap."""
    assert rbac_allows(FLOW, "create", "deployments", group="apps")  # the evaluator is not blind
    assert not rbac_allows("system:serviceaccount:grpo:default", "create", "deployments", group="apps")
    secret, config_map = _run_objects(f"argo-{THEIRS}")[:2]
    for obj, resource in ((secret, "secrets"), (config_map, "configmaps")):
        name = obj["metadata"]["name"]
        for verb in ("get", "list", "watch", "update", "patch", "deletecollection"):
            assert not rbac_allows(FLOW, verb, resource, name), (verb, resource)
        for verb in ("create", "delete"):  # granted by RBAC, refused by admission for another run's object
            assert rbac_allows(FLOW, verb, resource, name)
            assert not admitted(obj, POD, verb.upper())
    # the token reaches a run's later steps by its WorkflowTemplate, per run: each workflow names its own Secret only
    for workflow in (MINE, THEIRS, "grpoflow-x7k2p"):
        named = k8s_manifests.ARGO_TOKEN_SECRET.replace("{{workflow.name}}", workflow)
        assert named == k8s_manifests.auth_names(f"argo-{workflow}")[0] == f"vllm-argo-{workflow}-token"
    assert secret["metadata"]["name"] != k8s_manifests.ARGO_TOKEN_SECRET.replace("{{workflow.name}}", MINE)


@pytest.mark.parametrize("name", ["vllm-server.yaml", "vllm-router.yaml"])
def test_server_pods_carry_no_api_token(name):
    assert "automountServiceAccountToken: false" in Path(INFRA / name).read_text()


def test_only_the_steps_that_reach_the_server_from_their_own_pods_take_the_runs_token():
    """grpo_steps.deploy adds the run's token Secret (envFrom) to train and evaluate at `argo-workflows create` of a
    kubernetes-provider flow; not before provision_vllm (Metaflow's envFrom is not optional: the pod would wait for
    a Secret not made yet), not to a local run (no Argo substitution), nor for another provider."""
    from grpo_steps import deploy

    create = ["flows/grpo_flow.py", "--config", "config", "c.yaml", "argo-workflows", "create"]
    assert deploy.run_token_secrets("kubernetes", create) == [k8s_manifests.ARGO_TOKEN_SECRET]
    assert deploy.run_token_secrets("kubernetes", ["flows/grpo_flow.py", "run"]) == []
    assert deploy.run_token_secrets("external", create) == []
    assert deploy.TOKEN_STEPS == ("train", "evaluate")
