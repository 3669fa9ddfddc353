"""What the ``kubernetes`` provider creates in the cluster, as dicts ready for the client: pure functions of the run
config (no API call), so every object can be checked offline (tests/unit/test_manifest_schemas.py).

- the generation server: a Deployment + Service per server (:func:`render_manifests`, from
  ``infra/k8s/vllm-server.yaml``), ``-r0``, ``-r1``, ... per replica with ``generation.server.replicas`` > 1
  (:func:`replica_name`), and one NetworkPolicy over all of the run's server pods (:func:`network_policy_peers`);
- the run's token Secret and the ConfigMap with the token middleware (:func:`render_auth`);
- the router in front of several replicas: a ``vllm-router`` Deployment + Service + NetworkPolicy in the flow's
  image (:func:`render_router`, from ``infra/k8s/vllm-router.yaml``).

Every object carries the labels ``app.kubernetes.io/managed-by=grpo-pipeline`` and ``grpo-pipeline/run-id``, by which
:func:`grpo_steps.servers.kubernetes.stop_run` and the error exit hook find and delete a run's objects.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

import yaml

from grpo_steps.config import INFRA_DIR, SHARED_MOUNT, PipelineConfig
from grpo_steps.servers import auth
from grpo_steps.servers.client import served_model_names
from grpo_steps.weights.server_flags import LOGPROBS_MODE, TOKEN_GENERATE_ARGS, WORKER_EXTENSION, weight_transfer_args

TEMPLATE = INFRA_DIR / "k8s" / "vllm-server.yaml"
ROUTER_TEMPLATE = INFRA_DIR / "k8s" / "vllm-router.yaml"
MANAGED_BY = "grpo-pipeline"
RUN_LABEL = "grpo-pipeline/run-id"
REPLICA_LABEL = "grpo-pipeline/replica"
"""Label of a replica's pods (its index), which its Service selects: each replica is addressable for control calls."""
SERVER_APP, ROUTER_APP = "vllm-server", "vllm-router"
"""``app.kubernetes.io/name`` of the server pods and of the router pod."""
PORT = 8000
ROUTER_METRICS_PORT = 29000
"""Port of the router's Prometheus metrics (``vllm-router --prometheus-port``), on its Service too."""
AUTH_MOUNT = "/opt/grpo-auth"
"""Where the server pod mounts the ConfigMap with :mod:`grpo_steps.servers.auth` (on its ``PYTHONPATH``)."""


def k8s_name(run_id: str, prefix: str = "vllm") -> str:
    """A DNS-1035 name (lowercase, starts with a letter, at most 63 chars) for a run's objects.

    >>> k8s_name("argo-grpoflow.Prod_1")
    'vllm-argo-grpoflow-prod-1'
    """
    return f"{prefix}-{re.sub(r'[^a-z0-9-]+', '-', run_id.lower())}".strip("-")[:63].rstrip("-")


def suffixed(run_id: str, suffix: str) -> str:
    """``k8s_name(run_id)`` ending in ``suffix``, cut so the whole stays within 63 characters.

    >>> suffixed("x" * 80, "-r2")[-6:], len(suffixed("x" * 80, "-r2"))
    ('xxx-r2', 63)
    """
    return k8s_name(run_id)[:63 - len(suffix)].rstrip("-") + suffix


def replica_name(run_id: str, replica: int) -> str:
    """Name of replica ``replica``'s Deployment and Service (``generation.server.replicas`` > 1).

    >>> replica_name("argo-grpoflow-x7k2p", 2)
    'vllm-argo-grpoflow-x7k2p-r2'
    """
    return suffixed(run_id, f"-r{replica}")


def router_name(run_id: str) -> str:
    """Name of the router's Deployment, Service and NetworkPolicy."""
    return suffixed(run_id, "-router")


def run_selector(run_id: str) -> str:
    """The label selector of every object the pipeline created for ``run_id``."""
    return f"app.kubernetes.io/managed-by={MANAGED_BY},{RUN_LABEL}={label_value(run_id)}"


def label_value(run_id: str) -> str:
    """``run_id`` as a label value (alphanumerics, ``-_.``, at most 63 chars)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", run_id)[:63].strip("-_.")


def server_args(cfg: PipelineConfig, model: str, replica: int | None = None) -> list[str]:
    """Arguments of ``python -m vllm.entrypoints.openai.api_server`` in the server pod (``replica``: a replica's
    index, served first under its own name, :func:`grpo_steps.servers.client.served_model_names`).

    Flags for ``nccl`` weight sync are the ones TRL's ``vllm-serve`` wrapper passes (trl/scripts/vllm_serve.py,
    TRL 1.16, for vLLM >= 0.30): ``--enable-scale-out --weight-transfer-config '{"backend":"nccl"}'
    --logprobs-mode processed_logprobs --max-logprobs -1``, with ``VLLM_SERVER_DEV_MODE=1`` in the template. Without
    ``s3`` sync: the pipeline's worker extension (``--worker-extension-cls``), which checks evaluation's weights
    staged on the shared volume against their digest. With ``s3`` sync: the pipeline's weight-transfer engine
    (:func:`grpo_steps.weights.server_flags.weight_transfer_args`), which the image (``resources.vllm.image``) must
    have installed beside vLLM.
    """
    gen = cfg.generation
    args = ["--model", model, "--served-model-name", *served_model_names(replica), "--host", "0.0.0.0",
            "--port", str(PORT), "--dtype", cfg.model.dtype, "--max-model-len", str(cfg.model.max_model_len),
            "--seed", "0",
            "--tensor-parallel-size", str(gen.server.tensor_parallel_size), "--logprobs-mode", LOGPROBS_MODE]
    args += TOKEN_GENERATE_ARGS  # per-token weight versions (pushes in flight); also the nccl path's /update_weights
    if gen.trl_server_mode:
        args += ["--weight-transfer-config", json.dumps({"backend": "nccl"}), "--max-logprobs", "-1"]
    if gen.pushes_through_s3:  # each push (and evaluation's weights) a version of the S3 chain
        args += weight_transfer_args()
    else:
        # evaluation's weights are staged on the shared volume, which every run's pods can write: the worker extension
        # loads them (load_directory) only when they are the tensors the request's digest names. Not through S3 as
        # with s3 sync: vLLM takes one weight-transfer backend, TRL's nccl here, so a chain version has no route in
        args += ["--worker-extension-cls", WORKER_EXTENSION]
    if gen.server.enforce_eager:
        args.append("--enforce-eager")
    args += ["--middleware", auth.MIDDLEWARE]  # every route but GET /health needs the run's token
    return args + list(gen.server.extra_args)


ARGO_TOKEN_SECRET = "vllm-argo-{{workflow.name}}-token"
"""The run's token Secret as a WorkflowTemplate names it (Argo substitutes ``{{workflow.name}}`` in every field of a
template when it runs it): :func:`auth_names` of ``argo-<workflow>``. The steps that reach the server from pods of
their own take it through ``envFrom`` (:mod:`grpo_steps.deploy`), so the flow's account needs no ``get secrets``."""


def auth_names(run_id: str) -> tuple[str, str]:
    """Names of a run's token Secret and middleware ConfigMap, ``vllm-<run id>-token`` and ``vllm-<run id>-auth``:
    DNS subdomain names (lowercase alphanumerics, ``-`` and ``.``, at most 253 characters), the run id kept as it is
    where it is one, as an Argo run's ``argo-<workflow name>`` always is (:data:`ARGO_TOKEN_SECRET`, and the
    admission policy's exact names in infra/k8s/admission.yaml); other characters become ``-``.

    >>> auth_names("argo-grpo.user.alice.grpoflow-x7k2p")
    ('vllm-argo-grpo.user.alice.grpoflow-x7k2p-token', 'vllm-argo-grpo.user.alice.grpoflow-x7k2p-auth')
    >>> auth_names("Run_1..x")[0]
    'vllm-run-1.x-token'
    """
    name = re.sub(r"[^a-z0-9.-]+", "-", run_id.lower())
    name = re.sub(r"-*\.[-.]*", ".", name).strip("-.")  # each dot-separated part starts and ends alphanumeric
    name = f"vllm-{name}"[:246].rstrip("-.")  # room for "-token" within 253 characters
    return f"{name}-token", f"{name}-auth"


def render_auth(cfg: PipelineConfig, run_id: str, token: str) -> list[dict]:
    """``[Secret, ConfigMap]`` of a run's server: the Secret holds ``token`` under ``GRPO_SERVER_TOKEN``; the
    ConfigMap, the source of :mod:`grpo_steps.servers.auth` (stdlib only), mounted as that module by
    :func:`render_manifests`. Both carry the run's labels, so :func:`stop_run` deletes them."""
    secret_name, config_map_name = auth_names(run_id)
    labels = {"app.kubernetes.io/name": SERVER_APP, "app.kubernetes.io/managed-by": MANAGED_BY,
              RUN_LABEL: label_value(run_id)}
    meta = {"namespace": cfg.resources.namespace, "labels": labels}
    return [
        {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": secret_name, **meta},
         "stringData": {auth.TOKEN_ENV: token}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": config_map_name, **meta},
         "data": {"auth.py": Path(auth.__file__).read_text()}},
    ]


ARGO_WORKFLOW_LABEL = "workflows.argoproj.io/workflow"
"""Label Argo puts on every pod of a workflow; Metaflow's Argo run ids are ``argo-<workflow name>``."""


def run_pods(run_id: str) -> dict:
    """The ``podSelector`` peer of the run's own pods: the pods of the run's Argo workflow (``argo-<workflow>`` run
    ids), else the namespace's Metaflow task pods (a run of the local runtime on Kubernetes: Metaflow labels its pods
    by kind only, the run id is an annotation).

    >>> run_pods("argo-grpoflow-x7k2p")
    {'podSelector': {'matchLabels': {'workflows.argoproj.io/workflow': 'grpoflow-x7k2p'}}}
    """
    if run_id.startswith("argo-"):
        return {"podSelector": {"matchLabels": {ARGO_WORKFLOW_LABEL: label_value(run_id.removeprefix("argo-"))}}}
    return {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "metaflow-task",
                                            "app.kubernetes.io/part-of": "metaflow"}}}


def network_policy_peers(run_id: str, name: str, run_label: str, *, router: bool = False) -> list[dict]:
    """The ``ingress[].from`` peers of a run's servers: the run's pods (:func:`run_pods`), the servers' own pods
    (tensor-parallel and scale-out peers) and, with ``router`` (several replicas), the run's router pod.

    >>> network_policy_peers("argo-grpoflow-x7k2p", "vllm-x", "x", router=True)[2]
    {'podSelector': {'matchLabels': {'app.kubernetes.io/name': 'vllm-router', 'grpo-pipeline/run-id': 'x'}}}
    """
    own = {"app.kubernetes.io/name": SERVER_APP, RUN_LABEL: run_label}
    peers = [run_pods(run_id), {"podSelector": {"matchLabels": own}}]
    if router:
        peers.append({"podSelector": {"matchLabels": {"app.kubernetes.io/name": ROUTER_APP, RUN_LABEL: run_label}}})
    return peers


def render_manifests(cfg: PipelineConfig, run_id: str, model: str, template: Path = TEMPLATE,
                     replica: int | None = None) -> list[dict]:
    """``[Deployment, Service, NetworkPolicy]`` of a run's generation server, as dicts ready for the client.

    ``model`` is a Hugging Face id or a path under ``/shared``, where ``resources.shared_volume_claim`` is
    mounted. No GPU request is written when ``resources.vllm.gpu`` is 0. ``replica``: the Deployment and Service of
    that replica (:func:`replica_name`; its pods carry :data:`REPLICA_LABEL`, which its Service selects); the
    NetworkPolicy is the run's one, over every server pod of the run, admitting the router when
    ``generation.server.replicas`` > 1. With ``generation.weight_sync: s3`` and ``resources.vllm.s3_secret_name``,
    the server container takes that Secret's keys as its process variables (``envFrom``: the S3 credentials reach no
    manifest, argument or log; the container's own ``env`` entries win over a key of the same name).
    """
    res = cfg.resources.vllm
    text = string.Template(template.read_text()).substitute(
        name=k8s_name(run_id), namespace=cfg.resources.namespace, run_id=label_value(run_id), image=res.image,
        port=PORT, cpu=res.cpu, memory_mib=res.memory_mib, gpu=res.gpu)
    deployment, service, policy = yaml.safe_load_all(text)
    policy["spec"]["ingress"] = [{"from": network_policy_peers(run_id, k8s_name(run_id), label_value(run_id),
                                                               router=cfg.generation.server.replica_count > 1)}]
    if replica is not None:
        _as_replica(deployment, service, replica_name(run_id, replica), str(replica))
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["args"] = server_args(cfg, model, replica)
    if not res.gpu:
        for section in container["resources"].values():
            section.pop("nvidia.com/gpu")
    secret_name, config_map_name = auth_names(run_id)
    container["env"] += [
        {"name": auth.TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": auth.TOKEN_ENV}}},
        {"name": "PYTHONPATH", "value": AUTH_MOUNT}]  # grpo_steps.servers.auth as a namespace package
    # (an image with grpo_steps installed, as s3 sync needs, imports the installed package instead: a regular package
    # wins over a namespace portion wherever it stands on sys.path)
    container["volumeMounts"].append({"name": "grpo-auth", "mountPath": AUTH_MOUNT, "readOnly": True})
    if res.s3_secret_name:  # s3 sync's AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY for the engine; null: pod identity
        container["envFrom"] = [{"secretRef": {"name": res.s3_secret_name}}]
    pod["volumes"].append({"name": "grpo-auth", "configMap": {
        "name": config_map_name, "items": [{"key": "auth.py", "path": "grpo_steps/servers/auth.py"}]}})
    claim = cfg.resources.shared_volume_claim
    if claim:
        pod["volumes"].append({"name": "shared", "persistentVolumeClaim": {"claimName": claim}})
        container["volumeMounts"].append({"name": "shared", "mountPath": SHARED_MOUNT})
    return [deployment, service, policy]


def _as_replica(deployment: dict, service: dict, name: str, replica: str) -> None:
    """Rename a server's Deployment and Service to ``name`` and narrow their selectors to the replica's pods."""
    for obj in (deployment, service):
        obj["metadata"]["name"] = name
    template = deployment["spec"]["template"]
    template["metadata"]["labels"] = {**template["metadata"]["labels"], REPLICA_LABEL: replica}  # a YAML alias: copy
    deployment["spec"]["selector"]["matchLabels"][REPLICA_LABEL] = replica
    service["spec"]["selector"][REPLICA_LABEL] = replica


def router_args(cfg: PipelineConfig, worker_urls: list[str]) -> list[str]:
    """Arguments of ``python -m grpo_steps.servers.router_bridge --pod`` in the router pod: the bridge on every
    interface (``PORT``, metrics on ``ROUTER_METRICS_PORT``), admitting only clients with the run's token, in front
    of ``vllm-router`` on the pod's loopback with the flags of the router the pipeline runs on a machine
    (:func:`grpo_steps.servers.router.router_command`): its admin routes (``/add_worker``) are out of reach even of a
    pod the NetworkPolicy does not stop (a network plugin that does not enforce NetworkPolicies)."""
    from grpo_steps.servers import router_bridge
    from grpo_steps.servers.router import router_command

    server = cfg.generation.server
    inner = router_command(worker_urls, router_bridge.ROUTER_HOST, router_bridge.ROUTER_PORT,
                           policy=cfg.generation.router_policy(cfg.multi_turn),
                           health_check_interval_s=server.router.health_check_interval_s,
                           metrics_port=router_bridge.ROUTER_METRICS_PORT, metrics_host=router_bridge.ROUTER_HOST)
    return ["--pod", "--host", "0.0.0.0", "--port", str(PORT), "--metrics-host", "0.0.0.0", "--metrics-port",
            str(ROUTER_METRICS_PORT), "--", "python", *inner[1:]]  # the image's python


def render_router(cfg: PipelineConfig, run_id: str, worker_urls: list[str],
                  template: Path = ROUTER_TEMPLATE) -> list[dict]:
    """``[Deployment, Service, NetworkPolicy]`` of the ``vllm-router`` in front of a run's replicas (``worker_urls``:
    each replica's Service URL), in the flow's image (``resources.train.image``, where vllm-router is installed),
    behind :mod:`grpo_steps.servers.router_bridge` (:func:`router_args`); only the run's pods reach it (the
    NetworkPolicy), and only with the run's token (the bridge)."""
    name = router_name(run_id)
    text = string.Template(template.read_text()).substitute(
        name=name, namespace=cfg.resources.namespace, run_id=label_value(run_id), image=cfg.resources.train.image,
        port=PORT, metrics_port=ROUTER_METRICS_PORT)
    deployment, service, policy = yaml.safe_load_all(text)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["args"] = router_args(cfg, worker_urls)
    container["env"] = [{"name": auth.TOKEN_ENV, "valueFrom": {"secretKeyRef": {  # the bridge admits its holders
        "name": auth_names(run_id)[0], "key": auth.TOKEN_ENV}}}]
    policy["spec"]["ingress"] = [{"from": [run_pods(run_id)]}]
    return [deployment, service, policy]
