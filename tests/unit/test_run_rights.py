"""One run's rights per run on Kubernetes: the flow's Role (infra/k8s/rbac.yaml), which reads no Secret or ConfigMap,
and the admission policy that ties what the flow's account creates and deletes to the run of the pod asking
(infra/k8s/admission.yaml, evaluated by a real CEL engine: tests/unit/test_admission.py holds its own tests), checked
together on a run's objects; RBAC is evaluated as its authorizer does (:func:`rbac_allows`)."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from grpo_steps.config import REPO_ROOT
from grpo_steps.servers import k8s_manifests
from tests.unit.test_admission import MINE, THEIRS, decide, run_objects
from tests.unit.test_manifest_schemas import KUBERNETES_VERSION

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


def test_the_role_grants_argos_executor_and_never_reads_or_changes_secrets():
    assert {"create", "patch"} <= _verbs("workflowtaskresults", "argoproj.io")  # Argo's executor (wait container)
    # made and deleted by name (admission ties both to the asking pod's run); no get, list, watch, update or patch
    assert _verbs("secrets") == _verbs("configmaps") == {"create", "delete"}
    assert not any("*" in rule["verbs"] or "*" in rule["resources"] for rule in _role()["rules"])
    # no logs: RBAC cannot scope pods/log to a run, so a run could read every other run's server and step logs
    assert _verbs("pods/log") == set() and _verbs("pods") == {"get", "list"}


def test_the_admission_policy_validates_and_binds_the_flows_account():
    docs = _docs("admission.yaml")
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    policy, binding = docs
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert FLOW in policy["spec"]["matchConditions"][0]["expression"]
    rules = {r["resources"][0] for r in policy["spec"]["matchConstraints"]["resourceRules"]}
    assert rules == {"secrets", "deployments", "jobs", "networkpolicies", "jobsets"}  # first of each
    assert all(set(r["operations"]) == {"CREATE", "UPDATE", "DELETE"}
               for r in policy["spec"]["matchConstraints"]["resourceRules"])


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
    theirs, _ = run_objects(workflow=THEIRS)
    secret, config_map = (next(o for o in theirs if o["kind"] == kind) for kind in ("Secret", "ConfigMap"))
    for obj, resource in ((secret, "secrets"), (config_map, "configmaps")):
        name = obj["metadata"]["name"]
        for verb in ("get", "list", "watch", "update", "patch", "deletecollection"):
            assert not rbac_allows(FLOW, verb, resource, name), (verb, resource)
        for verb in ("create", "delete"):  # granted by RBAC, refused by admission for another run's object
            assert rbac_allows(FLOW, verb, resource, name)
            assert not decide(obj, verb.upper()).allowed
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
