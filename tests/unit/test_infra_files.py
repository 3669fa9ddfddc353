"""Every shipped config, Kubernetes manifest and JSON file parses, so a stale key cannot break a deploy."""

import json
import string
from pathlib import Path

import pytest
import yaml

from grpo_steps.config import REPO_ROOT, load_config

CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))
MANIFESTS = sorted((REPO_ROOT / "infra" / "k8s").glob("*.yaml"))
JSONS = sorted((REPO_ROOT / "infra").rglob("*.json"))
API_VERSIONS = {  # kind -> apiVersion the manifests must use
    "Deployment": "apps/v1", "StatefulSet": "apps/v1", "Service": "v1", "ServiceAccount": "v1",
    "Role": "rbac.authorization.k8s.io/v1", "RoleBinding": "rbac.authorization.k8s.io/v1",
    "NetworkPolicy": "networking.k8s.io/v1", "Secret": "v1", "ConfigMap": "v1", "Namespace": "v1",
    "PersistentVolumeClaim": "v1",
    "ValidatingAdmissionPolicy": "admissionregistration.k8s.io/v1",
    "ValidatingAdmissionPolicyBinding": "admissionregistration.k8s.io/v1",
}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def test_the_cluster_files_are_shipped():
    names = {_rel(p) for p in CONFIGS + MANIFESTS + JSONS}
    assert names >= {"configs/gpu-1node.yaml", "configs/multinode.yaml", "infra/k8s/vllm-server.yaml",
                     "infra/k8s/vllm-router.yaml",
                     "infra/k8s/mlflow.yaml", "infra/k8s/rbac.yaml", "infra/metaflow/config-k8s-argo.json"}


@pytest.mark.parametrize("path", CONFIGS, ids=_rel)
def test_every_config_validates(path):
    cfg = load_config(path)
    assert cfg.train.world_size >= 1


def test_cluster_configs_target_gpus_and_kubernetes():
    single, multi = load_config(REPO_ROOT / "configs/gpu-1node.yaml"), load_config(REPO_ROOT / "configs/multinode.yaml")
    assert (single.train.num_nodes, single.resources.train.gpu, single.train.deepspeed) == (1, 8, True)
    assert (multi.train.num_nodes, multi.generation.provider, multi.generation.weight_sync) == (4, "kubernetes", "s3")


def test_cluster_configs_push_through_s3_unless_they_name_a_readwritemany_claim():
    """A cluster config pushes the weights the way that needs no ReadWriteMany volume (`s3`); one that pushes
    `nccl` or `disk` names its claim, and the shipped claim manifest is the one it names."""
    claim = next(d for d in _docs("shared-volume.yaml") if d["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for path in CONFIGS:
        cfg = load_config(path)
        if cfg.generation.provider != "kubernetes":
            continue
        if cfg.resources.shared_volume_claim is None:
            assert cfg.generation.weight_sync == "s3", _rel(path)
        else:
            assert cfg.resources.shared_volume_claim == claim["metadata"]["name"], _rel(path)


@pytest.mark.parametrize("path", MANIFESTS, ids=_rel)
def test_every_manifest_has_a_known_kind_and_api_version(path):
    text = path.read_text()
    if "${" in text:  # a template of grpo_steps.servers.kubernetes: every placeholder must be filled
        text = string.Template(text).substitute({k: "1" for k in ("name", "namespace", "run_id", "image", "port",
                                                                   "cpu", "memory_mib", "gpu", "metrics_port")})
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    assert docs
    for doc in docs:
        assert API_VERSIONS[doc["kind"]] == doc["apiVersion"], doc["kind"]
        assert doc["metadata"]["name"]


@pytest.mark.parametrize("path", JSONS, ids=_rel)
def test_every_json_parses(path):
    assert isinstance(json.loads(path.read_text()), dict)


def test_metaflow_config_points_at_s3_and_kubernetes():
    mf = json.loads((REPO_ROOT / "infra/metaflow/config-k8s-argo.json").read_text())
    assert mf["METAFLOW_DEFAULT_DATASTORE"] == "s3" and mf["METAFLOW_DATASTORE_SYSROOT_S3"].startswith("s3://")
    assert mf["METAFLOW_KUBERNETES_NAMESPACE"] == load_config(REPO_ROOT / "configs/multinode.yaml").resources.namespace


def test_the_profile_records_runs_in_the_shipped_metadata_service():
    """With local metadata a run made in pods is invisible to ``Flow(...)``, ``card get``, ``resume`` and
    ``train.resume_from`` elsewhere: the profile names Metaflow's metadata service, the pods reach it at the Service
    of infra/k8s/metaflow-metadata.yaml (Metaflow hands METAFLOW_SERVICE_INTERNAL_URL to the pods), and a laptop at
    the port-forward of docs/deploy.md. Its Postgres password lives in a namespace of its own, out of the flow's
    account's reach (as MLflow's), and the service answers the flow's namespace."""
    mf = json.loads((REPO_ROOT / "infra/metaflow/config-k8s-argo.json").read_text())
    assert mf["METAFLOW_DEFAULT_METADATA"] == "service"
    docs = _docs("metaflow-metadata.yaml")
    (service,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "metaflow-metadata"]
    (port,) = service["spec"]["ports"]
    namespace = service["metadata"]["namespace"]
    flow_ns = mf["METAFLOW_KUBERNETES_NAMESPACE"]
    assert namespace != flow_ns and {d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"} == {namespace}
    assert {d["metadata"]["namespace"] for d in _docs("rbac.yaml")} == {flow_ns}
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "metaflow-metadata"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": flow_ns}}}]
    assert mf["METAFLOW_SERVICE_INTERNAL_URL"] == f"http://metaflow-metadata.{namespace}.svc:{port['port']}"
    assert mf["METAFLOW_SERVICE_URL"] == f"http://127.0.0.1:{port['port']}"
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    images = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert len(images) == 1 and images.pop().startswith("netflixoss/metaflow_metadata_service:v")
    (database,) = [d for d in docs if d["kind"] == "StatefulSet"]
    db_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert db_env["MF_METADATA_DB_HOST"] == database["spec"]["serviceName"]
    page = (REPO_ROOT / "docs/deploy.md").read_text()
    assert "kubectl apply -f infra/k8s/metaflow-metadata.yaml" in page
    assert f"kubectl -n {namespace} port-forward svc/metaflow-metadata 8080:8080" in page


def test_the_mlflow_server_gets_its_passwords_from_the_environment_and_installs_nothing():
    """Kubernetes writes a ``$(VAR)`` reference into the container's argv (visible in the pod spec and ``ps``):
    the passwords are expanded by the shell at run time and reach mlflow through its environment. The pod installs
    nothing at start (its image holds MLflow and its packages: it needs no package index), and its artifact bucket is
    the ConfigMap value docs/deploy.md has the user set."""
    import re

    import yaml

    docs = list(yaml.safe_load_all((REPO_ROOT / "infra" / "k8s" / "mlflow.yaml").read_text()))
    (mlflow,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow"]
    (container,) = mlflow["spec"]["template"]["spec"]["containers"]
    script = " ".join(container["args"])
    secret_env = {e["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert "POSTGRES_PASSWORD" in secret_env and "MLFLOW_ADMIN_PASSWORD" in secret_env
    assert not [name for name in secret_env if f"$({name})" in script]  # no Kubernetes expansion into argv
    assert "--backend-store-uri" not in script and "export MLFLOW_BACKEND_STORE_URI=" in script
    assert not re.search(r"\b(pip|uv|conda)\b", script), script
    (setting,) = [e["valueFrom"]["configMapKeyRef"] for e in container["env"]
                  if e["name"] == "MLFLOW_ARTIFACTS_DESTINATION"]
    assert '--artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION"' in script and "s3://" not in script
    page = (REPO_ROOT / "docs/deploy.md").read_text()
    assert re.search(rf"kubectl -n grpo-mlflow create configmap {setting['name']} \\\n? *--from-literal="
                     rf"{setting['key']}=s3://", page), setting


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((REPO_ROOT / "infra" / "k8s" / name).read_text()) if d is not None]


def test_mlflows_secrets_live_where_the_flows_account_has_no_rights():
    """The flow's Role gets Secrets of its namespace by name (the run's token), and RBAC matches whole names only:
    MLflow, its Postgres and every Secret they read are in a namespace of their own, which no RoleBinding of the
    flow's account reaches (nor any ClusterRole); MLflow still answers the flow's namespace, at the configs' URI."""
    flow_ns = load_config(REPO_ROOT / "configs/multinode.yaml").resources.namespace
    mlflow = _docs("mlflow.yaml")
    (namespace,) = [d["metadata"]["name"] for d in mlflow if d["kind"] == "Namespace"]
    assert namespace != flow_ns
    assert {d["metadata"].get("namespace") for d in mlflow if d["kind"] != "Namespace"} == {namespace}
    secrets = json.dumps(mlflow)
    for name in ("mlflow-postgres", "mlflow-admin", "mlflow-s3-credentials"):
        assert f'"name": "{name}"' in secrets  # read by MLflow's pods, so created in its namespace
    rbac = _docs("rbac.yaml")
    assert not [d for d in rbac if d["kind"].startswith("Cluster")]
    assert {d["metadata"]["namespace"] for d in rbac} == {flow_ns}
    (policy,) = [d for d in mlflow if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "mlflow"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": flow_ns}}}]
    for config in ("configs/multinode.yaml", "configs/gpu-1node.yaml"):
        assert load_config(REPO_ROOT / config).tracking.tracking_uri == f"http://mlflow.{namespace}.svc:5000"


def _locked_versions() -> dict[str, str]:
    """``{normalized name: version}`` of uv.lock's packages that have one version (the CPU/GPU forks of torch aside).
    """
    import tomllib

    seen: dict[str, set[str]] = {}
    for package in tomllib.loads((REPO_ROOT / "uv.lock").read_text())["package"]:
        seen.setdefault(package["name"], set()).add(package["version"])
    return {name: versions.pop() for name, versions in seen.items() if len(versions) == 1}


def _normalized(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def _run_lines(dockerfile: str) -> list[str]:
    """The shell commands of a Dockerfile's RUN instructions, continuation lines joined.

    >>> _run_lines("FROM x\\nRUN apt-get update \\\\\\n && apt-get install -y git\\nCOPY a b\\nRUN uv sync --frozen\\n")
    ['apt-get update   && apt-get install -y git', 'uv sync --frozen']
    """
    import re

    joined = re.sub(r"\\\n", " ", dockerfile)
    return [line.split(None, 1)[1].strip() for line in joined.splitlines() if line.startswith("RUN ")]


def _images() -> dict[str, str]:
    """Every Dockerfile the project ships or its pages tell a user to write: ``{where: text}``."""
    import re

    images = {_rel(p): p.read_text() for p in sorted((REPO_ROOT / "infra").glob("Dockerfile*"))}
    for page in sorted((REPO_ROOT / "docs").glob("*.md")) + [REPO_ROOT / "README.md"]:
        for i, block in enumerate(re.findall(r"```dockerfile\n(.*?)```", page.read_text(), re.S)):
            images[f"{_rel(page)}#{i}"] = block
    return images


def test_no_image_lists_its_own_packages():
    """An image installs the project from uv.lock with its extras (`uv sync --frozen`) and names no Python package
    itself: a hand-written list forgets the next dependency (deploy.md's server image missed xxhash)."""
    import re

    images = _images()
    assert "infra/Dockerfile" in images
    for where, text in images.items():
        runs = _run_lines(text)
        own = [run for run in runs if re.search(r"\b(pip|pip3|conda|mamba|pipx)\b.*\binstall\b|\buv (add|pip)\b", run)]
        assert not own, f"{where} installs packages of its own: {own}"
        syncs = [run for run in runs if re.search(r"\buv sync\b", run)]
        assert syncs and all("--frozen" in s and ("--extra gpu" in s or "--only-group mlflow-server" in s)
                             for s in syncs), (where, syncs)


def test_the_images_uv_and_mlflow_follow_the_lock():
    """The images' uv is the lock's (it reads the lock's format); MLflow's server is infra/Dockerfile's ``mlflow``
    target, uv.lock's ``mlflow-server`` group (the client's MLflow, one version of each package in the lock), named
    in mlflow.yaml at the project's version; ``docker build`` without a target still builds the flow's image."""
    import re
    import tomllib

    locked = _locked_versions()
    (uv_tag,) = re.findall(r"ghcr\.io/astral-sh/uv:(\S+)", (REPO_ROOT / "infra" / "Dockerfile").read_text())
    assert uv_tag == locked["uv"]
    dockerfile = (REPO_ROOT / "infra" / "Dockerfile").read_text()
    assert re.search(r"^FROM \S+ AS mlflow$", dockerfile, re.M)
    assert re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M)[-1] == "flow"  # docker build's default: the flow's
    group = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["dependency-groups"]["mlflow-server"]
    names = {_normalized(re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]) for spec in group}
    assert {"mlflow", "psycopg2-binary", "boto3", "flask-wtf"} <= names <= set(locked)  # one version each: the client's
    (mlflow,) = [d for d in _docs("mlflow.yaml") if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow"]
    (container,) = mlflow["spec"]["template"]["spec"]["containers"]
    version = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert re.fullmatch(rf"\S+/grpo-mlflow:{re.escape(version)}", container["image"]), container["image"]
    assert f"--target mlflow -t {container['image']}" in (REPO_ROOT / "docs/deploy.md").read_text()


def test_the_cluster_runs_one_image_built_from_the_lock():
    """The server pods run the steps' image: it holds vLLM's CUDA wheel at the trainer's version, grpo_steps' weight
    engine and its dependencies, so no second image can drift from the first."""
    for config in ("configs/gpu-1node.yaml", "configs/multinode.yaml"):
        resources = load_config(REPO_ROOT / config).resources
        assert resources.vllm.image == resources.train.image, config
