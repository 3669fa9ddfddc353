"""infra/k8s/admission.yaml evaluated by a real CEL engine (cel-python, through :mod:`grpo_steps.dev.admission`) as the
API server evaluates it, for the flow's account grpo-flow:

- every object a run makes is admitted, as the provider makes and deletes it: the provider's own code
  (``servers.provision``, ``stop``) against test_kubernetes_server's fake API, which asks the policy before each
  create and delete, as the pod of the run's workflow that sends them; the train step's JobSet as Metaflow renders it
  (tests/unit/data/train-jobset.yaml, checked against the live render by tests/integration/test_argo_render.py),
  Argo's parameters filled as Argo fills them; an UPDATE of each by its own run;
- every attack of issue 70 (findings 1 and 2) is an object refused, and so are the earlier rules' refusals.
"""

import copy
import functools
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from grpo_steps import servers
from grpo_steps.config import REPO_ROOT, load_config, validate_config
from grpo_steps.dev import admission
from grpo_steps.servers import auth, k8s_manifests, kubernetes
from tests.unit.test_kubernetes_server import FakeCluster

POLICY = [d for d in yaml.safe_load_all((REPO_ROOT / "infra" / "k8s" / "admission.yaml").read_text()) if d]
FLOW = "system:serviceaccount:grpo:grpo-flow"
MINE, THEIRS = "grpo.user.alice.grpoflow-abc12", "grpo.user.alice.grpoflow-xyz34"
"""Two Argo workflows of the deployed flow (@project names them <project>.<branch>.<flow>-<suffix>: dotted)."""
POD = f"{MINE}-provision-vllm-1234567890"
"""A pod of workflow MINE (Argo names a workflow's pods <workflow>-<template>-<id>)."""
RECORDED_JOBSET = Path(__file__).parent / "data" / "train-jobset.yaml"
CLUSTER_CONFIGS = ("multinode.yaml", "gpu-1node.yaml")
REPLICAS = {"generation": {"weight_sync": "s3", "server": {"replicas": 3}},
            "resources": {"shared_volume_claim": "grpo-shared", "vllm": {"s3_secret_name": None}}}
"""tests/integration/test_argo_render.py's change of multinode.yaml: three replicas behind the router, s3 pushes, the
shared volume mounted."""


def decide(obj: dict, operation: str = "CREATE", pod: str = POD, old: dict | None = None) -> admission.Decision:
    """The policy's answer to grpo-flow's request from ``pod``, in the flow's namespace (Argo creates the JobSet,
    whose manifest names none, in the workflow's)."""
    return admission.admit(POLICY, obj, operation, FLOW, pod, old_object=old,
                           namespace=None if "namespace" in obj["metadata"] else "grpo")


def _merged(base: dict, changes: dict) -> dict:
    return {**base, **{k: _merged(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in changes.items()}}


def cluster_config(name: str = "multinode.yaml", changes: dict | None = None):
    """A shipped cluster config, with ``changes`` merged in; servers declared ready at once."""
    raw = _merged(yaml.safe_load((REPO_ROOT / "configs" / name).read_text()), changes or {})
    raw["generation"]["server"]["startup_timeout_s"] = 0.05
    return validate_config(raw)


class AdmittingCluster(FakeCluster):
    """test_kubernetes_server's fake API, asking the policy before each create and delete as the pod ``pod`` sends
    it; a refusal is the API's 403 with the policy's messages. ``asked``: (kind, name, operation, decision)."""

    def __init__(self, pod: str) -> None:
        super().__init__()
        self.pod, self.asked = pod, []

    def __getattr__(self, name):
        method = super().__getattr__(name)
        verb, _, kind = name.partition("_namespaced_")
        if verb == "create":
            return lambda namespace, body: (self._ask(body, "CREATE"), method(namespace, body))[1]
        if verb == "delete":
            def delete(name_, namespace):
                body = getattr(self, self.STORES[kind]).get((namespace, name_))
                if body is not None:  # the API answers 404 before admission for an object that is not there
                    self._ask(body, "DELETE")
                return method(name_, namespace)
            return delete
        return method

    def _ask(self, body: dict, operation: str) -> None:
        decision = decide(body, operation, self.pod)
        self.asked.append((body["kind"], body["metadata"]["name"], operation, decision))
        if not decision.allowed:
            raise ApiException(status=403, reason="; ".join(decision.messages))


@functools.cache
def run_objects(name: str = "multinode.yaml", replicas: bool = False,
                workflow: str = MINE) -> tuple[list[dict], tuple[tuple[str, str, str, admission.Decision], ...]]:
    """Every object the provider creates for the run of ``workflow`` with the shipped cluster config ``name`` (with
    :data:`REPLICAS`), provision_vllm's pod asking, then deletes by ``stop``, the end step's pod asking: (the objects,
    what was asked: kind, name, operation, decision). Made once per module; callers change copies only."""
    cluster = AdmittingCluster(f"{workflow}-provision-vllm-1234567890")
    with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as tokens:
        patch.setattr(kubernetes, "_clients", lambda apps=None, core=None, networking=None: (cluster,) * 3)
        patch.setattr(auth, "TOKEN_DIR", Path(tokens))  # the tokens this pod's clients keep
        handle = servers.provision(cluster_config(name, REPLICAS if replicas else None), "Qwen/Qwen2.5-1.5B-Instruct",
                                   owner=None, run_id=f"argo-{workflow}")
        made = [body for store in FakeCluster.STORES.values() for body in getattr(cluster, store).values()]
        cluster.pod = f"{workflow}-end-2345678901"
        assert servers.from_dict(handle.to_dict()).stop() is True
    return made, tuple(cluster.asked)


def trimmed(manifest: str) -> str:
    """A rendered JobSet manifest (Argo's ``{{...}}`` left in) without what varies per render and no rule reads:
    annotations, container commands and arguments, env entries with a plain value."""
    obj = yaml.safe_load(re.sub(r"(\{\{=[^}]*\}\})", r"'\1'", manifest))  # an Argo expression as a YAML string

    def walk(node):
        if isinstance(node, dict):
            for key in ("annotations", "command", "args"):
                node.pop(key, None)
            if isinstance(node.get("env"), list):
                node["env"] = [e for e in node["env"] if "value" not in e]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(obj)
    return yaml.safe_dump(obj, sort_keys=True)


def fill_argo(manifest: str, workflow: str, retries: int = 0, num_parallel: int = 4) -> dict:
    """``manifest`` with Argo's parameters filled as Argo fills the train template's (Metaflow 2.19's
    argo_workflows.py: jobset-name ``js-<task-id-entropy><retries>``, workerCount num-parallel - 1); a placeholder
    not known here fails the test."""
    entropy = "a1b2c3"  # Metaflow's uuid4().hex[:6]
    values = {"workflow.name": workflow, "inputs.parameters.retryCount": str(retries),
              "inputs.parameters.task-id-entropy": entropy, "inputs.parameters.jobset-name": f"js-{entropy}{retries}",
              "inputs.parameters.num-parallel": str(num_parallel),
              "inputs.parameters.input-paths": f"argo-{workflow}/provision_vllm/t-0"}
    text = re.sub(r"'?\{\{=asInt\(inputs\.parameters\.workerCount\)\}\}'?", str(num_parallel - 1), manifest)
    text = re.sub(r"\{\{([^}]*)\}\}", lambda m: values[m.group(1)], text)
    return yaml.safe_load(text)


def recorded_jobset(workflow: str = MINE) -> dict:
    return fill_argo(RECORDED_JOBSET.read_text(), workflow)


def changed(obj: dict, change) -> dict:
    """A deep copy of ``obj`` after ``change(copy)``."""
    copy_ = copy.deepcopy(obj)
    change(copy_)
    return copy_


def _pods(obj: dict) -> list[dict]:
    if obj["kind"] == "JobSet":
        return [job["template"]["spec"]["template"]["spec"] for job in obj["spec"]["replicatedJobs"]]
    return [obj["spec"]["template"]["spec"]]


# --- what a run makes: admitted -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "replicas"), [("multinode.yaml", False), ("gpu-1node.yaml", False),
                                                ("multinode.yaml", True)],
                         ids=["multinode", "gpu-1node", "multinode-3-replicas"])
def test_every_object_a_run_makes_is_admitted_created_updated_and_deleted(name, replicas):
    made, asked = run_objects(name, replicas)
    kinds = sorted(kind for kind, _, operation, _ in asked if operation == "CREATE")
    assert set(kinds) == {"Secret", "ConfigMap", "NetworkPolicy", "Deployment", "Service"}
    assert all(d.allowed and d.applied for *_, d in asked), asked  # applied: the policy did look at each
    assert sorted(k for k, _, op, _ in asked if op == "DELETE") == kinds  # each deleted again, admitted
    if replicas:  # three replicas and the router: 4 Deployments, 4 Services, 2 NetworkPolicies
        assert (kinds.count("Deployment"), kinds.count("Service"), kinds.count("NetworkPolicy")) == (4, 4, 2)
    for obj in made:  # an UPDATE by its own run (the provider makes none; RBAC grants none but the JobSet's patch)
        update = decide(obj, "UPDATE", old=obj)
        assert update.allowed and update.applied, obj["metadata"]["name"]
        assert not decide(obj, "CREATE", f"{THEIRS}-provision-vllm-1").allowed  # no pod of another workflow


def test_the_train_steps_jobset_as_rendered_is_admitted_for_its_own_workflows_pod_only():
    jobset = recorded_jobset()
    assert jobset["metadata"]["name"] == "js-a1b2c30"
    creator = f"{MINE}-train-1234567890"  # Argo's resource-template pod, as grpo-flow
    for operation, old in (("CREATE", None), ("UPDATE", jobset), ("DELETE", None)):
        decision = decide(jobset, operation, creator, old)
        assert decision.allowed and decision.applied, (operation, decision.messages)
    retried = fill_argo(RECORDED_JOBSET.read_text(), MINE, retries=2)  # a retry's JobSet: js-<entropy>2
    assert retried["metadata"]["name"] == "js-a1b2c32" and decide(retried, pod=creator).allowed
    assert not decide(jobset, pod=f"{THEIRS}-train-1234567890").allowed
    assert not decide(recorded_jobset(THEIRS), pod=creator).allowed


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_the_shipped_cluster_configs_images_are_the_ones_the_policy_admits(name):
    images = admission.evaluate(next(v["expression"] for v in POLICY[0]["spec"]["variables"] if v["name"] == "images"),
                                {})
    cfg = load_config(REPO_ROOT / "configs" / name)
    assert {cfg.resources.train.image, cfg.resources.vllm.image} <= set(images)


def test_every_function_the_policy_calls_is_cel_or_provided():
    """cel-python's standard functions, the macros, and the Kubernetes library functions the evaluator adds: an
    expression calling anything else would fail only where it is evaluated."""
    from celpy.evaluation import base_functions

    known = set(base_functions) | set(admission.KUBERNETES_FUNCTIONS) | {"has", "all", "exists", "exists_one", "map",
                                                                          "filter"}
    spec = POLICY[0]["spec"]
    expressions = [e[key] for group in ("matchConditions", "variables", "validations") for e in spec[group]
                   for key in ("expression", "messageExpression") if key in e]
    for expression in expressions:
        assert admission.parse_error(expression) is None, expression
        assert admission.called_functions(expression) <= known, expression


STATIC = [(path.name, doc) for path in sorted((REPO_ROOT / "infra" / "k8s").glob("*.yaml"))
          if path.name not in (k8s_manifests.TEMPLATE.name, k8s_manifests.ROUTER_TEMPLATE.name)
          for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize(("name", "doc"), STATIC, ids=[f"{n}:{d['kind']}" for n, d in STATIC])
def test_the_shipped_manifests_are_the_administrators_and_out_of_the_flows_reach(name, doc):
    """infra/k8s/ is applied once by an administrator (docs/deploy.md), whom the policy leaves to RBAC; the flow's
    account is refused each one of a kind the policy matches, even made in the flow's own namespace (MLflow's)."""
    admin = admission.admit(POLICY, doc, "CREATE", "kubernetes-admin", namespace=doc["metadata"].get("namespace"))
    assert admin.allowed and not admin.applied
    if doc["kind"] in ("ConfigMap", "Secret", "Service", "Deployment", "StatefulSet", "Job", "NetworkPolicy"):
        decision = decide(changed(doc, lambda d: d["metadata"].update(namespace="grpo")))
        assert decision.applied and not decision.allowed, name


def test_deploy_md_runs_the_local_runtime_under_an_account_the_policy_leaves_to_rbac():
    """docs/deploy.md's local-runtime `run`, every step in a pod: under grpo-flow the policy refuses its objects (no
    Argo workflow), so the page runs it under an account of its own, which the policy does not bind."""
    text = (REPO_ROOT / "docs" / "deploy.md").read_text()
    (account,) = re.findall(r"^METAFLOW_KUBERNETES_SERVICE_ACCOUNT=(\S+) python flows/grpo_flow.py .* run$", text,
                            re.MULTILINE)
    assert account != "grpo-flow" and f"create serviceaccount {account}" in text
    made = [*k8s_manifests.render_auth(cluster_config(), "1733561234567890", "t" * 43),  # a local run's id
            *k8s_manifests.render_manifests(cluster_config(), "1733561234567890", "m")]
    for obj in made:
        assert not decide(obj, pod="t-5f3a9c2e-provision-vllm-1").allowed, obj["kind"]
        own = admission.admit(POLICY, obj, "CREATE", f"system:serviceaccount:grpo:{account}", "t-5f3a9c2e-1")
        assert own.allowed and not own.applied


def test_the_policy_applies_to_the_flows_account_in_its_namespace_only():
    secret = k8s_manifests.render_auth(cluster_config(), f"argo-{THEIRS}", "t" * 43)[0]
    assert not decide(secret).allowed
    other = admission.admit(POLICY, secret, "CREATE", "system:serviceaccount:grpo:default", POD)
    assert other.allowed and not other.applied  # RBAC's to refuse, not this policy's
    elsewhere = admission.admit(POLICY, changed(secret, lambda o: o["metadata"].update(namespace="ml")), "CREATE",
                                FLOW, POD)
    assert elsewhere.allowed and not elsewhere.applied


# --- issue 70, finding 1: pod templates and selectors ---------------------------------------------------------------

@pytest.fixture(scope="module")
def mine() -> dict[str, dict]:
    """This run's objects (three replicas and the router), by kind and role."""
    made, _ = run_objects("multinode.yaml", replicas=True)
    server = k8s_manifests.replica_name(f"argo-{MINE}", 0)
    return {"deployment": next(o for o in made if o["kind"] == "Deployment" and o["metadata"]["name"] == server),
            "service": next(o for o in made if o["kind"] == "Service" and o["metadata"]["name"] == server),
            "policy": next(o for o in made if o["kind"] == "NetworkPolicy"),
            "config_map": next(o for o in made if o["kind"] == "ConfigMap"),
            "secret": next(o for o in made if o["kind"] == "Secret")}


def _their_labels(labels: dict) -> None:
    labels[k8s_manifests.RUN_LABEL] = f"argo-{THEIRS}"


def test_a_workload_whose_pods_wear_another_runs_labels_is_refused(mine):
    deployment = mine["deployment"]
    attacks = {
        "template and selector of another run": lambda d: (_their_labels(d["spec"]["template"]["metadata"]["labels"]),
                                                           _their_labels(d["spec"]["selector"]["matchLabels"])),
        "a selector without the run": lambda d: d["spec"]["selector"]["matchLabels"].pop(k8s_manifests.RUN_LABEL),
        "pods taken for another workflow's": lambda d: d["spec"]["template"]["metadata"]["labels"].update(
            {k8s_manifests.ARGO_WORKFLOW_LABEL: THEIRS}),
    }
    for what, change in attacks.items():
        decision = decide(changed(deployment, change))
        assert not decision.allowed, what
        assert any("must carry its own run's label" in m for m in decision.messages), (what, decision.messages)
    for kind, group in (("StatefulSet", "apps/v1"), ("Job", "batch/v1")):  # every workload the policy matches
        workload = changed(deployment, lambda d, k=kind, g=group: d.update(kind=k, apiVersion=g))
        if kind == "Job":  # the selector the API generates for a Job before admission
            workload["spec"]["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": "0c6a"}}
            chosen = changed(workload, lambda d: d["spec"].update(manualSelector=True))
            assert not decide(chosen).allowed  # a selector of its own choosing must pin the run
        decision = decide(workload)
        assert decision.allowed and decision.applied, (kind, decision.messages)
        moved = changed(workload, lambda d: _their_labels(d["spec"]["template"]["metadata"]["labels"]))
        assert not decide(moved).allowed, kind


def test_a_service_or_network_policy_reaching_another_runs_pods_or_outside_is_refused(mine):
    service, policy = mine["service"], mine["policy"]
    for what, change in {"another run's pods": lambda s: _their_labels(s["spec"]["selector"]),
                         "no run in its selector": lambda s: s["spec"]["selector"].pop(k8s_manifests.RUN_LABEL),
                         "NodePort": lambda s: s["spec"].update(type="NodePort"),
                         "LoadBalancer": lambda s: s["spec"].update(type="LoadBalancer"),
                         "externalIPs": lambda s: s["spec"].update(externalIPs=["203.0.113.7"])}.items():
        assert not decide(changed(service, change)).allowed, what
    defaulted = decide(changed(service, lambda s: s["spec"].update(type="ClusterIP")))  # as the API defaults it
    assert defaulted.allowed and defaulted.applied
    # a policy of this run that opens another run's servers to every pod
    opened = changed(policy, lambda p: (_their_labels(p["spec"]["podSelector"]["matchLabels"]),
                                        p["spec"].update(ingress=[{}])))
    assert not decide(opened).allowed


# --- issue 70, finding 2: JobSets, updates, host access, images ------------------------------------------------------

def test_a_jobset_that_could_pass_for_another_workflows_pods_is_refused():
    creator = f"{MINE}-train-1234567890"
    named_after_theirs = changed(recorded_jobset(), lambda j: j["metadata"].update(name=f"{THEIRS}-train-999"))
    assert not decide(named_after_theirs, pod=creator).allowed
    their_pods = changed(recorded_jobset(), lambda j: j["spec"]["replicatedJobs"][1]["template"]["spec"]["template"][
        "metadata"]["labels"].update({k8s_manifests.ARGO_WORKFLOW_LABEL: THEIRS}))
    assert not decide(their_pods, pod=creator).allowed
    subdomain = changed(recorded_jobset(), lambda j: j["spec"].update(network={"subdomain": "vllm-argo-x"}))
    assert not decide(subdomain, pod=creator).allowed
    # a JobSet's pods (named js-...) create and delete nothing, not even for a run named after them
    secret = k8s_manifests.render_auth(cluster_config(), "argo-js-a1b2c30", "t" * 43)[0]
    assert not decide(secret, pod="js-a1b2c30-control-0-0-x7k2p").allowed


def test_an_update_may_not_move_an_object_between_runs(mine):
    theirs, _ = run_objects(workflow=THEIRS)
    their_config_map = next(o for o in theirs if o["kind"] == "ConfigMap")
    relabelled = changed(their_config_map, lambda o: o["metadata"]["labels"].update(
        {k8s_manifests.RUN_LABEL: f"argo-{MINE}"}))
    decision = decide(relabelled, "UPDATE", old=their_config_map)  # B's middleware, taken as this run's
    assert not decision.allowed and any("may not move" in m for m in decision.messages), decision.messages
    assert not decide(their_config_map, "UPDATE", old=their_config_map).allowed
    own = mine["deployment"]
    given_away = changed(own, lambda o: _their_labels(o["metadata"]["labels"]))
    assert not decide(given_away, "UPDATE", old=own).allowed
    assert not decide(given_away, "UPDATE", pod=f"{THEIRS}-provision-vllm-1", old=own).allowed


HOST_ACCESS = {
    "privileged": lambda p: p["containers"][0].update(securityContext={"privileged": True}),
    "hostPID": lambda p: p.update(hostPID=True),
    "hostNetwork": lambda p: p.update(hostNetwork=True),
    "hostIPC": lambda p: p.update(hostIPC=True),
    "hostPort": lambda p: p["containers"][0].setdefault("ports", []).append({"containerPort": 22, "hostPort": 22}),
    "capabilities add": lambda p: p["containers"][0].update(securityContext={"capabilities": {"add": ["SYS_ADMIN"]}}),
    "nodeName": lambda p: p.update(nodeName="gpu-node-1"),
    "a foreign image": lambda p: p["containers"][0].update(image="docker.io/attacker/miner:latest"),
}


@pytest.mark.parametrize("attack", HOST_ACCESS, ids=list(HOST_ACCESS))
def test_host_access_and_foreign_images_are_refused_in_every_workload(attack, mine):
    for obj, pod in ((mine["deployment"], POD), (recorded_jobset(), f"{MINE}-train-1234567890")):
        attacked = changed(obj, lambda o: HOST_ACCESS[attack](_pods(o)[-1]))
        decision = decide(attacked, pod=pod)
        assert not decision.allowed, (attack, obj["kind"])
        assert len(decision.messages) == 1, decision.messages  # refused by its own rule, named in the message
    dropped = changed(mine["deployment"], lambda o: _pods(o)[0]["containers"][0].update(
        securityContext={"capabilities": {"drop": ["ALL"]}, "privileged": False}))
    assert decide(dropped).allowed and decide(dropped).applied  # what baseline allows stays allowed


# --- the earlier rules ------------------------------------------------------------------------------------------------

def test_another_runs_objects_and_secrets_stay_out_of_reach(mine):
    theirs, _ = run_objects(workflow=THEIRS)
    for obj in theirs:  # neither created first nor deleted
        assert not decide(obj).allowed and not decide(obj, "DELETE").allowed, obj["metadata"]["name"]
        stolen = changed(obj, lambda o: o["metadata"]["labels"].update({k8s_manifests.RUN_LABEL: f"argo-{MINE}"}))
        assert not decide(stolen).allowed, obj["metadata"]["name"]  # relabelled, the name stays the other run's
    their_token = {"name": "X", "valueFrom": {"secretKeyRef": {
        "name": k8s_manifests.auth_names(f"argo-{THEIRS}")[0], "key": "T"}}}
    for what, change in {
            "another run's token": lambda p: p["containers"][0]["env"].append(their_token),
            "a Secret volume": lambda p: p["volumes"].append({"name": "s", "secret": {"secretName": "x"}}),
            "the flow's account": lambda p: p.update(serviceAccountName="grpo-flow"),
            "the old serviceAccount alias": lambda p: p.update(serviceAccount="grpo-flow"),
            "an API token": lambda p: p.pop("automountServiceAccountToken"),
            "an init container": lambda p: p.update(initContainers=[{"name": "i", "image": "x"}]),
            "an ephemeral container": lambda p: p.update(ephemeralContainers=[{"name": "e", "image": "x"}]),
            "the flow's S3 Secret": lambda p: p["containers"][0].update(
                envFrom=[{"secretRef": {"name": "grpo-s3-credentials"}}])}.items():
        assert not decide(changed(mine["deployment"], lambda o, c=change: c(_pods(o)[0]))).allowed, what
    assert not decide(mine["secret"], pod="t-local-runtime-pod").allowed  # no Argo workflow: refused
    unlabelled = changed(recorded_jobset(), lambda j: j["metadata"].pop("labels"))
    assert not decide(unlabelled, pod=f"{MINE}-train-1").allowed
    other_account = changed(recorded_jobset(), lambda j: _pods(j)[1].update(serviceAccountName="argo"))
    assert not decide(other_account, pod=f"{MINE}-train-1").allowed
    for secret in (k8s_manifests.auth_names(f"argo-{THEIRS}")[0], "grpo-mlflow-admin"):  # any other Secret
        foreign = changed(recorded_jobset(), lambda j, s=secret: _pods(j)[0]["containers"][0]["envFrom"].append(
            {"secretRef": {"name": s}}))
        assert not decide(foreign, pod=f"{MINE}-train-1").allowed, secret


def test_the_longest_workflow_names_keep_their_objects():
    """The longest names Metaflow gives a workflow (45 characters and "-" + 5): the cut names are still the run's."""
    _, asked = run_objects(replicas=True, workflow="grpo.user.a-very-long-user-name.grpoflow-12345-x7k2p")
    assert asked and all(d.allowed and d.applied for *_, d in asked), asked


# --- the evaluator itself ---------------------------------------------------------------------------------------------

def test_the_evaluator_follows_kubernetes_semantics():
    """Variables lazily (an erring one unused costs nothing), messageExpression over message, an error under
    failurePolicy Fail refuses, matchConditions false skip the policy."""
    policy = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
              "metadata": {"name": "p"}, "spec": {
                  "failurePolicy": "Fail",
                  "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"],
                                                          "operations": ["CREATE"], "resources": ["configmaps"]}]},
                  "matchConditions": [{"name": "named", "expression": "has(object.metadata.name)"}],
                  "variables": [{"name": "broken", "expression": "object.nothing.here"},
                                {"name": "size", "expression": "object.data.size()"}],
                  "validations": [
                      {"expression": "variables.size < 2", "messageExpression": "'too big: ' + string(variables.size)",
                       "message": "unused"},
                      {"expression": "!('x' in object.data) || variables.broken == 1"}]}}
    binding = {"kind": "ValidatingAdmissionPolicyBinding", "spec": {"policyName": "p", "validationActions": ["Deny"]}}
    docs = [policy, binding]

    def config_map(**data):
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "n"}, "data": data}

    assert admission.admit(docs, config_map(a="1"), "CREATE", "u").allowed
    assert admission.admit(docs, config_map(a="1", b="2"), "CREATE", "u").messages == ("too big: 2",)
    refused = admission.admit(docs, config_map(x="1"), "CREATE", "u")
    assert not refused.allowed and "resulted in error" in refused.messages[0]
    assert admission.admit(docs, config_map(a="1", b="2", c="3"), "DELETE", "u").applied is False  # not matched
    with pytest.raises(ValueError, match="UPDATE needs old_object"):
        admission.admit(docs, config_map(), "UPDATE", "u")
    with pytest.raises(ValueError, match="no ValidatingAdmissionPolicyBinding"):
        admission.admit([policy], config_map(), "CREATE", "u")


@pytest.mark.parametrize(("expression", "value"), [
    ("'vllm-argo-a.b'.replace('.', '-')", "vllm-argo-a-b"),
    ("'a.b.c'.replace('.', '', 1)", "ab.c"),
    ("'argo-wf'.substring(5)", "wf"),
    ("'argo-wf'.substring(0, 4)", "argo"),
    ("'a,b,c'.split(',')", ["a", "b", "c"]),
    ("'a,b,c'.split(',', 2)", ["a", "b,c"]),
    ("['x', 'y'].join(', ')", "x, y"),
    ("'ÀB'.lowerAscii()", "Àb"),
    ("'  x '.trim()", "x"),
    ("'abcb'.indexOf('b')", 1),
    ("'abcb'.lastIndexOf('b')", 3),
    ("'abc'.charAt(1)", "b"),
])
def test_the_kubernetes_string_extensions_answer_as_cel_go_does(expression, value):
    """cel-go ext.Strings, the library Kubernetes loads, case by case (its own documented examples' shapes)."""
    assert admission.evaluate(expression, {}) == value


def test_a_string_extension_out_of_range_is_an_error():
    assert isinstance(admission.evaluate("'abc'.substring(2, 5)", {}), Exception)

