"""Every Kubernetes object the project ships or renders is one a cluster accepts: validated, strictly (no unknown
field), against the Kubernetes API schemas of a recent release by kubernetes-validate, offline. The Argo
WorkflowTemplate that ``argo-workflows create --only-json`` renders is checked against Argo's own models in
tests/integration/test_argo_render.py."""

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from grpo_steps.config import REPO_ROOT, validate_config
from grpo_steps.servers import k8s_manifests

KUBERNETES_VERSION = "1.33.0"
"""The API version validated against (a release every managed Kubernetes offers as of 2026-11)."""
TEMPLATES = {k8s_manifests.TEMPLATE.name, k8s_manifests.ROUTER_TEMPLATE.name}
STATIC = [p for p in sorted((REPO_ROOT / "infra" / "k8s").glob("*.yaml")) if p.name not in TEMPLATES]


def _docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _valid(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", STATIC, ids=lambda p: p.name)
def test_every_shipped_manifest_validates(path):
    docs = _docs(path)
    assert docs
    for doc in docs:
        _valid(doc)


def _cluster_config(**generation) -> dict:
    return {"model": {"name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "dtype": "bfloat16"},
            "generation": {"provider": "kubernetes", "weight_sync": "nccl", "server": {"tensor_parallel_size": 2},
                           **generation},
            "train": {"processes_per_node": 8, "per_device_train_batch_size": 1, "num_generations": 8},
            "resources": {"train": {"gpu": 8, "image": "registry.example/grpo:1"},
                          "vllm": {"gpu": 2, "image": "vllm/vllm-openai:v0.32.0"}, "namespace": "ml",
                          "shared_volume_claim": "grpo-shared"}}


@pytest.mark.parametrize("generation", [{}, {"server": {"tensor_parallel_size": 1, "extra_args": ["--enforce-eager"]}}],
                         ids=["tp2", "tp1-extra-args"])
def test_the_rendered_server_objects_validate(generation):
    config = _cluster_config()
    config["generation"].update(generation)
    rendered = k8s_manifests.render_manifests(validate_config(config), "argo-grpoflow-abc12",
                                              "Qwen/Qwen2.5-1.5B-Instruct")
    assert {doc["kind"] for doc in rendered} >= {"Deployment", "Service", "NetworkPolicy"}
    for doc in rendered:
        _valid(doc)


def test_a_broken_object_is_refused():
    """The validation is not blind: a field the API does not have, and a port that is not a number, fail it."""
    (deployment, *_) = k8s_manifests.render_manifests(validate_config(_cluster_config()), "argo-grpoflow-abc12", "m")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicyy"):
        _valid(deployment)
    (_, service, _) = k8s_manifests.render_manifests(validate_config(_cluster_config()), "argo-grpoflow-abc12", "m")
    service["spec"]["ports"][0]["port"] = "${port}"
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        _valid(service)


def test_every_object_of_a_run_with_three_replicas_validates():
    """``generation.server.replicas: 3`` (s3 pushes, the shared volume mounted): three server Deployments and
    Services, the run's NetworkPolicy, token Secret and middleware ConfigMap, and the router's Deployment, Service and
    NetworkPolicy, as the provider creates them (grpo_steps/servers/kubernetes.py)."""
    config = _cluster_config(weight_sync="s3")
    config["generation"]["server"]["replicas"] = 3
    config["train"]["gradient_accumulation_steps"] = 8  # the pipeline's rollouts sample whole groups of 8 per process
    cfg, run_id = validate_config(config), "argo-grpoflow-abc12"
    servers = [k8s_manifests.render_manifests(cfg, run_id, "/shared/m", replica=i)[:2] for i in range(3)]
    rendered = [*k8s_manifests.render_auth(cfg, run_id, "t" * 43), k8s_manifests.render_manifests(cfg, run_id, "m")[2],
                *(obj for pair in servers for obj in pair),
                *k8s_manifests.render_router(cfg, run_id, [f"http://{d['metadata']['name']}.ml.svc:8000"
                                                           for d, _ in servers])]
    kinds = [doc["kind"] for doc in rendered]
    assert (kinds.count("Deployment"), kinds.count("Service"), kinds.count("NetworkPolicy")) == (4, 4, 2)
    assert {"Secret", "ConfigMap"} <= set(kinds)
    assert len({(doc["kind"], doc["metadata"]["name"]) for doc in rendered}) == len(rendered)  # no name clash
    for doc in rendered:
        _valid(doc)


@pytest.mark.parametrize("secret", ["grpo-s3-readonly", None], ids=["secret", "pod-identity"])
def test_every_object_of_an_s3_sync_run_validates(secret):
    """``weight_sync: s3`` without a shared volume: the servers run the pipeline's transfer engine and, with
    ``resources.vllm.s3_secret_name``, take that Secret's keys through ``envFrom``; with two replicas and the router."""
    config = _cluster_config(weight_sync="s3", s3_sync={"url": "s3://grpo-weights/sync"})
    config["generation"]["server"]["replicas"] = 2
    config["train"]["gradient_accumulation_steps"] = 8  # the pipeline's rollouts sample whole groups of 8 per process
    del config["resources"]["shared_volume_claim"]
    config["resources"]["vllm"].update(image="registry.example/grpo-vllm:1", s3_secret_name=secret)
    cfg, run_id = validate_config(config), "argo-grpoflow-abc12"
    servers = [k8s_manifests.render_manifests(cfg, run_id, "Qwen/Qwen2.5-1.5B-Instruct", replica=i)[:2]
               for i in range(2)]
    rendered = [*k8s_manifests.render_auth(cfg, run_id, "t" * 43), k8s_manifests.render_manifests(cfg, run_id, "m")[2],
                *(obj for pair in servers for obj in pair),
                *k8s_manifests.render_router(cfg, run_id, [f"http://{d['metadata']['name']}.ml.svc:8000"
                                                           for d, _ in servers])]
    for deployment, _ in servers:
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert "--worker-extension-cls" in container["args"]
        assert container.get("envFrom") == ([{"secretRef": {"name": secret}}] if secret else None)
    for doc in rendered:
        _valid(doc)
