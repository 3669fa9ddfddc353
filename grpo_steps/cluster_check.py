"""``make cluster-check``: a doctor for the cluster a deployment goes to (docs/deploy.md), before the first deploy.

It asks the Kubernetes API of the current kube context through the ``kubernetes`` client (no kubectl), and S3 with
the keys of the flow's Secrets, and changes nothing (one test object that the server pods' read-only keys should not
have been able to write is removed again). One line per check, each failure naming its fix:

- the flow's namespace and service account (``resources.namespace``, the profile's
  ``METAFLOW_KUBERNETES_SERVICE_ACCOUNT``);
- every verb of infra/k8s/rbac.yaml's Role, for that service account: a SelfSubjectAccessReview impersonating it, as
  ``kubectl auth can-i --as=system:serviceaccount:<ns>:<account>`` asks (the flow's own rights and those Argo's
  executor needs; the kube context's user needs ``impersonate`` on service accounts, as a cluster admin has);
- the Secrets the profile, the config and deploy.md name, and their keys (names only; values are never printed);
- the bucket listed with the flow's keys, and a write under the weight versions' prefix refused to the server pods'
  read-only keys (infra/s3/), which must still list that prefix;
- Metaflow's metadata service, MLflow and Argo's workflow controller with a ready replica (their readiness probes ask
  ``/ping`` and ``/health``), the controller's default service account, and its release (its image's tag): one that
  runs the flow's routes (:func:`check_argo_release`);
- the image's tag: the checkout's project version.

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from grpo_steps.config import REPO_ROOT, PipelineConfig, load_config
from grpo_steps.dev.rehearsal import STRICT_TAGS_TEXT, resolves_tags_strictly

AWS_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
MLFLOW_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
STEPS = "docs/deploy.md step"


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``name`` (what was checked), ``detail`` (what was found), ``fix`` (what to do when not
    ``ok``)."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        """The check as the user reads it: ``ok``/``FAIL``, the name, what was found and, on failure, the fix."""
        return f"{'ok  ' if self.ok else 'FAIL'}  {self.name}: {self.detail}" + ("" if self.ok else f" -> {self.fix}")


@dataclass(frozen=True)
class SecretSpec:
    namespace: str
    name: str
    keys: tuple[str, ...]
    fix: str


def role_rules(rbac: Path = REPO_ROOT / "infra" / "k8s" / "rbac.yaml") -> list[tuple[str, str, str]]:
    """``(api group, resource, verb)`` of every rule of the Role in ``rbac``: what the flow's account must be
    allowed. A subresource (``pods/log``) is kept whole."""
    docs = [d for d in yaml.safe_load_all(rbac.read_text()) if d]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    return [(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]]


def secret_specs(cfg: PipelineConfig, profile: dict) -> list[SecretSpec]:
    """The Secrets a deployment of ``cfg`` with the Metaflow ``profile`` reads, and the keys each must hold: the
    profile's (every step's pod), the server pods' (``resources.vllm.s3_secret_name``), the metadata service's
    Postgres password, and MLflow's in the namespace of ``tracking.tracking_uri``'s Service."""
    ns = cfg.resources.namespace
    named = [*profile.get("METAFLOW_KUBERNETES_SECRETS", "").split(","),
             *profile.get("METAFLOW_ARGO_WORKFLOWS_KUBERNETES_SECRETS", "").split(",")]
    specs = []
    for name in dict.fromkeys(n.strip() for n in named if n.strip()):
        keys, step = (MLFLOW_KEYS, 4) if "mlflow" in name else (AWS_KEYS, 2)
        specs.append(SecretSpec(ns, name, keys, f"kubectl -n {ns} create secret generic {name} "
                                + " ".join(f"--from-literal={k}=..." for k in keys) + f" ({STEPS} {step})"))
    reader = cfg.resources.vllm.s3_secret_name
    if reader and cfg.generation.weight_sync == "s3":
        specs.append(SecretSpec(ns, reader, AWS_KEYS, f"kubectl -n {ns} create secret generic {reader} --from-literal="
                                "AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=... with the keys of "
                                f"infra/s3/weights-read-policy.json ({STEPS} 2)"))
    metadata_ns = metadata_namespace(profile)
    if metadata_ns:
        specs.append(SecretSpec(metadata_ns, "metaflow-postgres", ("password",),
                                f"kubectl -n {metadata_ns} create secret generic metaflow-postgres "
                                f"--from-literal=password=... ({STEPS} 5)"))
    mlflow_ns = mlflow_namespace(cfg)
    if mlflow_ns:
        for name, keys in (("mlflow-postgres", ("password",)), ("mlflow-s3-credentials", AWS_KEYS),
                           ("mlflow-admin", ("password", "flask-secret-key"))):
            specs.append(SecretSpec(mlflow_ns, name, keys, f"kubectl -n {mlflow_ns} create secret generic {name} "
                                    + " ".join(f"--from-literal={k}=..." for k in keys) + f" ({STEPS} 4)"))
    return specs


def service_namespace(url: str) -> str | None:
    """The namespace of a cluster Service's URL (``http://<svc>.<ns>.svc:port``), else None.

    >>> service_namespace("http://mlflow.grpo-mlflow.svc:5000"), service_namespace("http://127.0.0.1:5000")
    ('grpo-mlflow', None)
    """
    parts = (urlsplit(url).hostname or "").split(".")
    return parts[1] if len(parts) >= 3 and parts[2] == "svc" else None


def mlflow_namespace(cfg: PipelineConfig) -> str | None:
    """The namespace of ``tracking.tracking_uri``'s Service, None when it is not one."""
    return service_namespace(cfg.tracking.tracking_uri)


def metadata_namespace(profile: dict) -> str | None:
    """The namespace of the metadata service the profile's pods record runs in (METAFLOW_SERVICE_INTERNAL_URL)."""
    if profile.get("METAFLOW_DEFAULT_METADATA") != "service":
        return None
    return service_namespace(profile.get("METAFLOW_SERVICE_INTERNAL_URL") or profile.get("METAFLOW_SERVICE_URL", ""))


def check_namespace(core, ns: str, account: str) -> list[Check]:
    from kubernetes.client.exceptions import ApiException

    out = []
    for name, read, fix in (
            (f"namespace {ns}", lambda: core.read_namespace(ns), f"kubectl create namespace {ns} ({STEPS} 2)"),
            (f"service account {ns}/{account}", lambda: core.read_namespaced_service_account(account, ns),
             f"kubectl apply -f infra/k8s/rbac.yaml ({STEPS} 3)")):
        try:
            read()
            out.append(Check(name, True, "exists"))
        except ApiException as err:
            out.append(Check(name, False, _api_error(err), fix))
    return out


def check_verbs(authz, ns: str, account: str, rules: list[tuple[str, str, str]]) -> list[Check]:
    """One SelfSubjectAccessReview per rule, as ``account`` (impersonated), one line per resource."""
    from kubernetes.client import V1ResourceAttributes, V1SelfSubjectAccessReview, V1SelfSubjectAccessReviewSpec
    from kubernetes.client.exceptions import ApiException

    user = f"system:serviceaccount:{ns}:{account}"
    headers = {"Impersonate-User": user}
    denied: dict[str, list[str]] = {}
    for group, resource, verb in rules:
        resource_name, _, sub = resource.partition("/")
        review = V1SelfSubjectAccessReview(spec=V1SelfSubjectAccessReviewSpec(resource_attributes=V1ResourceAttributes(
            namespace=ns, group=group, resource=resource_name, subresource=sub or None, verb=verb)))
        try:
            answer = authz.create_self_subject_access_review(review, _headers=headers)
        except ApiException as err:
            return [Check(f"rights of {user}", False, _api_error(err),
                          "run it as a user who may impersonate service accounts (kubectl auth can-i impersonate "
                          "serviceaccounts), e.g. a cluster admin")]
        key = _key(group, resource)
        denied.setdefault(key, [])
        if not answer.status.allowed:
            denied[key].append(verb)
    return [Check(f"{user} may {','.join(v for g, r, v in rules if _key(g, r) == key)} {key}", not verbs,
                  "allowed" if not verbs else f"denied: {', '.join(verbs)}",
                  f"kubectl apply -f infra/k8s/rbac.yaml ({STEPS} 3); check "
                  f"kubectl auth can-i {verbs[0] if verbs else ''} {key} -n {ns} --as={user}")
            for key, verbs in denied.items()]


def _key(group: str, resource: str) -> str:
    return resource + (f".{group}" if group else "")


def check_secrets(core, specs: list[SecretSpec]) -> tuple[list[Check], dict[str, dict[str, str]]]:
    """Each Secret of ``specs`` exists with its keys. Returns the checks and the AWS keys of the Secrets holding
    them (``{name: {key: value}}``, for the bucket's checks; kept in memory, never printed)."""
    from kubernetes.client.exceptions import ApiException

    out, keys = [], {}
    for spec in specs:
        name = f"secret {spec.namespace}/{spec.name}"
        try:
            secret = core.read_namespaced_secret(spec.name, spec.namespace)
        except ApiException as err:
            out.append(Check(name, False, _api_error(err), spec.fix))
            continue
        data = secret.data or {}
        missing = [k for k in spec.keys if k not in data]
        out.append(Check(name, not missing, f"keys {', '.join(spec.keys)}" if not missing
                         else f"no key {', '.join(missing)} (has {', '.join(sorted(data)) or 'none'})", spec.fix))
        if spec.keys == AWS_KEYS and not missing:
            keys[spec.name] = {k: base64.b64decode(data[k]).decode() for k in AWS_KEYS}
    return out, keys


def check_bucket(cfg: PipelineConfig, profile: dict, flow_keys: dict | None, reader_keys: dict | None) -> list[Check]:
    """The datastore's bucket listed with the flow's keys; under the weight versions' prefix, a listing allowed and
    a write refused to the server pods' read-only keys (an object written all the same is deleted again)."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    root = profile.get("METAFLOW_DATASTORE_SYSROOT_S3", "")
    bucket, _, datastore = root.removeprefix("s3://").partition("/")
    endpoint = cfg.generation.s3_sync.endpoint(profile)
    location = cfg.generation.s3_sync.location(profile)

    def client(keys):
        return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=keys["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=keys["AWS_SECRET_ACCESS_KEY"])

    out = []
    if flow_keys is None:
        return [Check(f"bucket {bucket}", False, "not checked: the flow's S3 Secret is missing", "see its line")]
    try:
        client(flow_keys).list_objects_v2(Bucket=bucket, Prefix=f"{datastore}/", MaxKeys=1)
        out.append(Check(f"bucket s3://{bucket}/{datastore} with the flow's keys", True, "listed"))
    except (ClientError, BotoCoreError) as err:
        out.append(Check(f"bucket s3://{bucket}/{datastore} with the flow's keys", False, _s3_error(err),
                         f"give the flow's identity infra/s3/flow-policy.json on bucket {bucket} ({STEPS} 2)"))
    if location is None or reader_keys is None or cfg.generation.weight_sync != "s3":
        return out
    weights_bucket, prefix = location
    reader, name = client(reader_keys), f"s3://{weights_bucket}/{prefix}/ with the server pods' keys"
    try:
        reader.list_objects_v2(Bucket=weights_bucket, Prefix=f"{prefix}/", MaxKeys=1)
        out.append(Check(f"list {name}", True, "listed"))
    except (ClientError, BotoCoreError) as err:
        out.append(Check(f"list {name}", False, _s3_error(err), "give the server pods' identity "
                         f"infra/s3/weights-read-policy.json for this prefix ({STEPS} 2)"))
    probe = f"{prefix}/cluster-check-{uuid.uuid4().hex}"
    try:
        reader.put_object(Bucket=weights_bucket, Key=probe, Body=b"")
    except ClientError as err:
        refused = err.response.get("Error", {}).get("Code") in ("AccessDenied", "Forbidden", "403")
        out.append(Check(f"write {name}", refused, "refused" if refused else _s3_error(err),
                         "check the endpoint and the bucket"))
        return out
    client(flow_keys).delete_object(Bucket=weights_bucket, Key=probe)  # the only change: undone at once
    out.append(Check(f"write {name}", False, "ALLOWED (the test object was deleted again)",
                     f"the Secret {cfg.resources.vllm.s3_secret_name} must hold read-only keys: an identity with "
                     f"infra/s3/weights-read-policy.json alone ({STEPS} 2)"))
    return out


def check_deployments(apps, core, cfg: PipelineConfig, profile: dict, argo_ns: str) -> list[Check]:
    """Metaflow's metadata service, MLflow and Argo's controller each with a ready replica; the controller's default
    service account."""
    from kubernetes.client.exceptions import ApiException

    wanted = []
    if metadata_namespace(profile):
        wanted.append((metadata_namespace(profile), "metaflow-metadata",
                       f"kubectl apply -f infra/k8s/metaflow-metadata.yaml ({STEPS} 5)"))
    if mlflow_namespace(cfg):
        wanted.append((mlflow_namespace(cfg), "mlflow", f"kubectl apply -f infra/k8s/mlflow.yaml ({STEPS} 4)"))
    wanted.append((argo_ns, "workflow-controller", "install Argo Workflows (3.5 or newer) in namespace "
                   f"{argo_ns}, or pass --argo-namespace"))
    out = []
    for namespace, name, fix in wanted:
        try:
            deployment = apps.read_namespaced_deployment(name, namespace)
        except ApiException as err:
            out.append(Check(f"deployment {namespace}/{name}", False, _api_error(err), fix))
            continue
        ready = deployment.status.ready_replicas or 0
        out.append(Check(f"deployment {namespace}/{name}", ready > 0, f"{ready} ready replica(s)",
                         f"kubectl -n {namespace} describe deploy/{name} and its pods' logs"))
        if name == "workflow-controller":
            out.append(check_argo_release(deployment.spec.template.spec.containers[0].image, cfg))
    account = profile.get("METAFLOW_KUBERNETES_SERVICE_ACCOUNT", "grpo-flow")
    try:
        data = core.read_namespaced_config_map("workflow-controller-configmap", argo_ns).data or {}
        defaults = yaml.safe_load(data.get("workflowDefaults") or "{}") or {}
        found = (defaults.get("spec") or {}).get("serviceAccountName")
        detail = f"workflowDefaults serviceAccountName {found}"
    except ApiException as err:
        found, detail = None, _api_error(err)
    out.append(Check("Argo's default service account", found == account, detail,
                     f"kubectl -n {argo_ns} patch configmap workflow-controller-configmap --type merge -p "
                     f"'{{\"data\": {{\"workflowDefaults\": \"spec:\\n  serviceAccountName: {account}\\n\"}}}}' "
                     f"({STEPS} 3)"))
    return out


def check_argo_release(image: str, cfg: PipelineConfig) -> Check:
    """Argo's release, read from the controller's image tag (``...workflow-controller:v3.7.10``): 3.5 or newer
    (Metaflow's Argo templates); with ``data.skip_seen``, one that runs the flow's ``no_new_rows`` route. There, ``end``
    names ``register``, which did not run: Argo from 3.7.11 and 4.0.2 requeues ``end`` for ever and the run stays
    Running (Netflix/metaflow#3043), which a CronWorkflow with ``concurrencyPolicy: Forbid`` then waits on
    (:func:`grpo_steps.dev.rehearsal.resolves_tags_strictly`)."""
    tag = image.rpartition(":")[2].split("@")[0].lstrip("v")
    try:
        version = tuple(int(part) for part in tag.split("-")[0].split(".")[:3])
        if len(version) != 3:
            raise ValueError(tag)
    except ValueError:
        version = None
    route = "a run with no new rows (data.skip_seen: the no_new_rows route) would hang in end"
    fix = ("run Argo v3.7.10 or v4.0.1 (Netflix/metaflow#3043), or deploy with `argo-workflows create "
           "--workflow-timeout <seconds>` so such a run fails instead (docs/deploy.md \"Argo's release\")")
    if version is None:
        return Check("Argo release", not cfg.data.skip_seen, f"not read from the image {image}",
                     f"check it is not from {STRICT_TAGS_TEXT} on, where {route}: {fix}")
    strict = resolves_tags_strictly(version)
    if version < (3, 5, 0):
        return Check("Argo release", False, f"v{'.'.join(map(str, version))}",
                     "install Argo Workflows 3.5 or newer (Metaflow's Argo templates)")
    detail = f"v{'.'.join(map(str, version))}" + (f" (here {route})" if strict else "")
    return Check("Argo release", not (strict and cfg.data.skip_seen), detail, fix)


def check_image(cfg: PipelineConfig, profile: dict) -> Check:
    """The steps' image tag is the checkout's project version, and the server pods and the profile name the same."""
    version = metadata.version("grpo-pipeline")
    images = {cfg.resources.train.image, cfg.resources.vllm.image, profile.get("METAFLOW_KUBERNETES_CONTAINER_IMAGE")}
    images.discard(None)
    tags = {image.rpartition(":")[2] for image in images}
    ok = len(images) == 1 and tags == {version}
    return Check("image", ok, f"{', '.join(sorted(images))} (checkout: {version})",
                 f"build and push the checkout's image as <registry>/grpo-pipeline:{version} ({STEPS} 1) and name it "
                 "in resources.train.image, resources.vllm.image and the profile's METAFLOW_KUBERNETES_CONTAINER_IMAGE")


def run_checks(api_client, cfg: PipelineConfig, profile: dict, argo_ns: str = "argo") -> list[Check]:
    """Every check, in the order of docs/deploy.md, against the cluster ``api_client`` reaches."""
    from kubernetes import client as k8s

    core, ns = k8s.CoreV1Api(api_client), cfg.resources.namespace
    account = profile.get("METAFLOW_KUBERNETES_SERVICE_ACCOUNT", "grpo-flow")
    checks = [check_image(cfg, profile), *check_namespace(core, ns, account),
              *check_verbs(k8s.AuthorizationV1Api(api_client), ns, account, role_rules())]
    secret_checks, keys = check_secrets(core, secret_specs(cfg, profile))
    flow_secret = next((n.strip() for n in profile.get("METAFLOW_KUBERNETES_SECRETS", "").split(",")
                        if n.strip() in keys), None)
    checks += secret_checks
    checks += check_bucket(cfg, profile, keys.get(flow_secret), keys.get(cfg.resources.vllm.s3_secret_name or ""))
    checks += check_deployments(k8s.AppsV1Api(api_client), core, cfg, profile, argo_ns)
    return checks


def _api_error(err) -> str:
    reason = ""
    try:
        reason = json.loads(err.body).get("message", "")
    except (TypeError, ValueError):
        reason = err.reason or ""
    return f"{err.status} {reason}".strip()


def _s3_error(err) -> str:
    error = getattr(err, "response", {}).get("Error", {}) if hasattr(err, "response") else {}
    return f"{error.get('Code', type(err).__name__)}: {error.get('Message', str(err))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_steps.cluster_check", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "multinode.yaml"),
                        help="the cluster config to deploy (default configs/multinode.yaml)")
    parser.add_argument("--profile", default=str(Path.home() / ".metaflowconfig" / "config_k8s.json"),
                        help="the Metaflow profile (default ~/.metaflowconfig/config_k8s.json, deploy.md step 6)")
    parser.add_argument("--argo-namespace", default="argo", help="where Argo Workflows' controller runs")
    parser.add_argument("--context", default=None, help="kube context (default: the current one)")
    args = parser.parse_args(argv)
    from kubernetes import client as k8s
    from kubernetes import config as kube_config

    profile_path = Path(args.profile)
    if not profile_path.exists():
        profile_path = REPO_ROOT / "infra" / "metaflow" / "config-k8s-argo.json"
        print(f"note: no {args.profile}: checking against {profile_path.relative_to(REPO_ROOT)}")
    try:
        kube_config.load_kube_config(context=args.context)
    except kube_config.ConfigException as err:
        print(f"FAIL  kube context: {err} -> point KUBECONFIG at the cluster's kubeconfig, or pass --context")
        return 1
    checks = run_checks(k8s.ApiClient(), load_config(args.config), json.loads(profile_path.read_text()),
                        args.argo_namespace)
    print("\n".join(report(checks)))
    return 1 if any(not c.ok for c in checks) else 0


def report(checks: list[Check]) -> list[str]:
    """What ``make cluster-check`` prints: a line per check, then how many passed."""
    failed = sum(not c.ok for c in checks)
    return [check.line() for check in checks] + [f"{len(checks) - failed} of {len(checks)} checks passed"]


if __name__ == "__main__":
    sys.exit(main())
