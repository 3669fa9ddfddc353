"""The ``kubernetes`` provider of the generation server: a vLLM Deployment + Service per run.

The manifests come from ``infra/k8s/vllm-server.yaml`` (rendered by :func:`render_manifests`, a
pure function; a NetworkPolicy admits only the run's pods to the server, :func:`network_policy_peers`, but a cluster
without an enforcing network plugin ignores it, so the server also loads the pipeline's token middleware:
:func:`render_auth` renders the run's Secret, holding a fresh per-run token, and a ConfigMap with the middleware's
module, which the server image lacks; the token reaches the server as ``GRPO_SERVER_TOKEN`` from the Secret, never in
argv, and the flow's pods read the Secret through the API, :meth:`KubernetesServer.keep_token`, because Metaflow
fixes a step pod's secrets when the flow is deployed, before the run's Secret exists);
:meth:`KubernetesServer.start` creates them with the official ``kubernetes`` client,
waits until the Deployment has a ready replica (its readiness probe is ``GET /health``) and returns a
handle whose endpoint is the Service's cluster DNS name. On a timeout it raises with the pods' status
and deletes what it created; :meth:`KubernetesServer.stop` and :func:`stop_run` delete a run's objects
by their labels (``end``, the error exit hook). The methods take the client APIs as ``apps``, ``core`` and
``networking`` (default: the cluster's), so tests pass a fake.

Flags for ``nccl`` weight sync are the ones TRL's ``vllm-serve`` wrapper passes (trl/scripts/vllm_serve.py,
TRL 1.16, for vLLM >= 0.30): ``--enable-scale-out --weight-transfer-config '{"backend":"nccl"}'
--logprobs-mode processed_logprobs --max-logprobs -1``, with ``VLLM_SERVER_DEV_MODE=1`` in the template.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grpo_steps.config import INFRA_DIR, PipelineConfig
from grpo_steps.processes import ProcessRef, wait_until
from grpo_steps.servers import auth
from grpo_steps.servers.base import GenerationServer, ServerStartError
from grpo_steps.servers.client import LOGPROBS_MODE, SERVED_MODEL_NAME

TEMPLATE = INFRA_DIR / "k8s" / "vllm-server.yaml"
MANAGED_BY = "grpo-pipeline"
RUN_LABEL = "grpo-pipeline/run-id"
PORT = 8000
SHARED_MOUNT = "/shared"
AUTH_MOUNT = "/opt/grpo-auth"
"""Where the server pod mounts the ConfigMap with :mod:`grpo_steps.servers.auth` (on its ``PYTHONPATH``)."""


def k8s_name(run_id: str, prefix: str = "vllm") -> str:
    """A DNS-1035 name (lowercase, starts with a letter, at most 63 chars) for a run's objects.

    >>> k8s_name("argo-grpoflow.Prod_1")
    'vllm-argo-grpoflow-prod-1'
    """
    return f"{prefix}-{re.sub(r'[^a-z0-9-]+', '-', run_id.lower())}".strip("-")[:63].rstrip("-")


def label_value(run_id: str) -> str:
    """``run_id`` as a label value (alphanumerics, ``-_.``, at most 63 chars)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", run_id)[:63].strip("-_.")


def server_args(cfg: PipelineConfig, model: str) -> list[str]:
    """Arguments of ``python -m vllm.entrypoints.openai.api_server`` in the server pod."""
    gen = cfg.generation
    args = ["--model", model, "--served-model-name", SERVED_MODEL_NAME, "--host", "0.0.0.0", "--port", str(PORT),
            "--dtype", cfg.model.dtype, "--max-model-len", str(cfg.model.max_model_len), "--seed", "0",
            "--tensor-parallel-size", str(gen.server.tensor_parallel_size), "--logprobs-mode", LOGPROBS_MODE]
    if gen.weight_sync == "nccl":
        args += ["--enable-scale-out", "--weight-transfer-config", json.dumps({"backend": "nccl"}),
                 "--max-logprobs", "-1"]
    if gen.server.enforce_eager:
        args.append("--enforce-eager")
    args += ["--middleware", auth.MIDDLEWARE]  # every route but GET /health needs the run's token
    return args + list(gen.server.extra_args)


def auth_names(run_id: str) -> tuple[str, str]:
    """Names of a run's token Secret and middleware ConfigMap."""
    name = k8s_name(run_id)[:57].rstrip("-")  # room for the suffixes within 63 characters
    return f"{name}-token", f"{name}-auth"


def render_auth(cfg: PipelineConfig, run_id: str, token: str) -> list[dict]:
    """``[Secret, ConfigMap]`` of a run's server: the Secret holds ``token`` under ``GRPO_SERVER_TOKEN``; the
    ConfigMap, the source of :mod:`grpo_steps.servers.auth` (stdlib only), mounted as that module by
    :func:`render_manifests`. Both carry the run's labels, so :func:`stop_run` deletes them."""
    secret_name, config_map_name = auth_names(run_id)
    labels = {"app.kubernetes.io/name": "vllm-server", "app.kubernetes.io/managed-by": MANAGED_BY,
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


def network_policy_peers(run_id: str, name: str, run_label: str) -> list[dict]:
    """The ``ingress[].from`` peers of a run's server: the pods of the run's Argo workflow (``argo-<workflow>``
    run ids), else the namespace's Metaflow task pods (a run of the local runtime on Kubernetes: Metaflow labels
    its pods by kind only, the run id is an annotation), and the server's own pods.

    >>> network_policy_peers("argo-grpoflow-x7k2p", "vllm-x", "x")[0]
    {'podSelector': {'matchLabels': {'workflows.argoproj.io/workflow': 'grpoflow-x7k2p'}}}
    """
    if run_id.startswith("argo-"):
        run_pods = {ARGO_WORKFLOW_LABEL: label_value(run_id.removeprefix("argo-"))}
    else:
        run_pods = {"app.kubernetes.io/name": "metaflow-task", "app.kubernetes.io/part-of": "metaflow"}
    own = {"app.kubernetes.io/name": "vllm-server", RUN_LABEL: run_label}
    return [{"podSelector": {"matchLabels": run_pods}}, {"podSelector": {"matchLabels": own}}]


def render_manifests(cfg: PipelineConfig, run_id: str, model: str, template: Path = TEMPLATE) -> list[dict]:
    """``[Deployment, Service, NetworkPolicy]`` of a run's generation server, as dicts ready for the client.

    ``model`` is a Hugging Face id or a path under ``/shared``, where ``resources.shared_volume_claim`` is
    mounted. No GPU request is written when ``resources.vllm.gpu`` is 0.
    """
    res = cfg.resources.vllm
    text = string.Template(template.read_text()).substitute(
        name=k8s_name(run_id), namespace=cfg.resources.namespace, run_id=label_value(run_id), image=res.image,
        port=PORT, cpu=res.cpu, memory_mib=res.memory_mib, gpu=res.gpu)
    deployment, service, policy = yaml.safe_load_all(text)
    policy["spec"]["ingress"] = [{"from": network_policy_peers(run_id, k8s_name(run_id), label_value(run_id))}]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["args"] = server_args(cfg, model)
    if not res.gpu:
        for section in container["resources"].values():
            section.pop("nvidia.com/gpu")
    secret_name, config_map_name = auth_names(run_id)
    container["env"] += [
        {"name": auth.TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": auth.TOKEN_ENV}}},
        {"name": "PYTHONPATH", "value": AUTH_MOUNT}]  # grpo_steps.servers.auth as a namespace package
    container["volumeMounts"].append({"name": "grpo-auth", "mountPath": AUTH_MOUNT, "readOnly": True})
    pod["volumes"].append({"name": "grpo-auth", "configMap": {
        "name": config_map_name, "items": [{"key": "auth.py", "path": "grpo_steps/servers/auth.py"}]}})
    claim = cfg.resources.shared_volume_claim
    if claim:
        pod["volumes"].append({"name": "shared", "persistentVolumeClaim": {"claimName": claim}})
        container["volumeMounts"].append({"name": "shared", "mountPath": SHARED_MOUNT})
    return [deployment, service, policy]


def _clients(apps: Any = None, core: Any = None, networking: Any = None) -> tuple[Any, Any, Any]:
    if apps is not None and core is not None and networking is not None:
        return apps, core, networking
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return apps or client.AppsV1Api(), core or client.CoreV1Api(), networking or client.NetworkingV1Api()


def pod_status(core: Any, namespace: str, run_id: str) -> str:
    """One line per pod of a run's server: name, phase, container waiting/terminated reasons."""
    pods = core.list_namespaced_pod(namespace, label_selector=f"{RUN_LABEL}={label_value(run_id)}").items
    lines = []
    for pod in pods:
        reasons = []
        for cs in pod.status.container_statuses or []:
            state = cs.state
            for kind in ("waiting", "terminated"):
                detail = getattr(state, kind, None) if state else None
                if detail is not None:
                    reasons.append(f"{kind}: {detail.reason} {detail.message or ''}".strip())
        lines.append(f"{pod.metadata.name}: {pod.status.phase} {'; '.join(reasons)}".rstrip())
    return "\n".join(lines) or "(no pods)"


def stop_run(namespace: str, run_id: str, *, apps: Any = None, core: Any = None, networking: Any = None) -> int:
    """Delete every Deployment, Service, NetworkPolicy, Secret and ConfigMap labelled with this run; returns how many
    were deleted."""
    apps, core, networking = _clients(apps, core, networking)
    selector = f"app.kubernetes.io/managed-by={MANAGED_BY},{RUN_LABEL}={label_value(run_id)}"
    kinds = [(apps, "deployment"), (core, "service"), (networking, "network_policy"), (core, "secret"),
             (core, "config_map")]
    deleted = 0
    for api, kind in kinds:  # the client's list_namespaced_<kind> / delete_namespaced_<kind> pairs
        for obj in getattr(api, f"list_namespaced_{kind}")(namespace, label_selector=selector).items:
            getattr(api, f"delete_namespaced_{kind}")(obj.metadata.name, namespace)
            deleted += 1
    return deleted


@dataclass(frozen=True)
class KubernetesServer(GenerationServer):
    """A run's vLLM Deployment + Service in the cluster; the endpoint is the Service's DNS name."""

    model: str = ""
    """Hugging Face id or ``/shared`` path it serves."""
    namespace: str = "default"
    name: str = ""
    """Name of the Deployment and the Service."""
    run_id: str = ""
    """The Metaflow run whose labelled objects these are."""

    provider = "kubernetes"
    runtime_lora = False

    @classmethod
    def start(cls, cfg: PipelineConfig, model_path: str, *, owner: ProcessRef | None = None, run_id: str,
              apps: Any = None, core: Any = None, networking: Any = None, poll_s: float = 5.0) -> KubernetesServer:
        """Create the run's Deployment + Service and wait for a ready replica.

        Serves ``model_path`` when it lies on the shared volume (``/shared``), else ``model.name_or_path``
        (a hub id the pod downloads). ``owner`` is not used: the cluster keeps the objects until
        :meth:`stop` or the error exit hook deletes them.

        Raises:
            ServerStartError: not ready within ``generation.server.startup_timeout_s`` seconds; the
                message carries each pod's phase and waiting reason. The created objects are deleted first.
        """
        apps, core, networking = _clients(apps, core, networking)
        model = model_path if model_path.startswith(SHARED_MOUNT) else cfg.model.name_or_path
        deployment, service, policy = render_manifests(cfg, run_id, model)
        namespace, name = cfg.resources.namespace, deployment["metadata"]["name"]
        server = cls(f"http://{name}.{namespace}.svc:{PORT}", model=model, namespace=namespace, name=name,
                     run_id=run_id)
        timeout_s = cfg.generation.server.startup_timeout_s
        token = auth.new_token()
        try:
            secret, config_map = render_auth(cfg, run_id, token)
            core.create_namespaced_secret(namespace, secret)
            core.create_namespaced_config_map(namespace, config_map)
            auth.save_token(server.endpoint, token)  # this pod's clients (grpo_steps.servers.auth.token_for)
            networking.create_namespaced_network_policy(namespace, policy)  # before the server can answer
            apps.create_namespaced_deployment(namespace, deployment)
            core.create_namespaced_service(namespace, service)
            if wait_until(lambda: server.is_ready(apps=apps), timeout_s, interval_s=poll_s):
                return server
            raise ServerStartError(
                f"vLLM Deployment {namespace}/{name} not ready after {timeout_s:.0f} s "
                f"(generation.server.startup_timeout_s). Pods:\n{pod_status(core, namespace, run_id)}"
            )
        except BaseException:
            stop_run(namespace, run_id, apps=apps, core=core, networking=networking)
            auth.forget_token(server.endpoint)
            raise

    def stop(self, *, apps: Any = None, core: Any = None, networking: Any = None) -> bool:
        """Delete the run's Deployment, Service, NetworkPolicy, Secret and ConfigMap; True when there was
        something to delete."""
        auth.forget_token(self.endpoint)
        return stop_run(self.namespace, self.run_id, apps=apps, core=core, networking=networking) > 0

    def keep_token(self, *, core: Any = None) -> None:
        """Read the run's token from its Secret and keep it for this pod's clients (a file only this user reads,
        :func:`grpo_steps.servers.auth.save_token`): the train and evaluate steps run in pods of their own."""
        core = core if core is not None else _clients()[1]
        data = core.read_namespaced_secret(auth_names(self.run_id)[0], self.namespace).data
        auth.save_token(self.endpoint, base64.b64decode(data[auth.TOKEN_ENV]).decode())

    def is_ready(self, *, apps: Any = None) -> bool:
        """True when the Deployment exists and has a ready replica."""
        from kubernetes.client.exceptions import ApiException

        apps = apps if apps is not None else _clients()[0]
        try:
            status = apps.read_namespaced_deployment_status(self.name, self.namespace).status
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return (status.ready_replicas or 0) >= 1

    def serves(self, owner: ProcessRef) -> bool:
        """Kept while its Deployment is ready, across ``@retry`` and ``resume`` (it belongs to the run); when it
        is, this pod's clients get the run's token (:meth:`keep_token`)."""
        if not self.is_ready():
            return False
        self.keep_token()
        return True

    def stage_weights(self, weights_dir: str | Path, label: str, root: str = SHARED_MOUNT) -> str:
        """Copy ``weights_dir`` to ``{root}/grpo/{run_id}/{label}`` on the shared volume, where the
        server pod can read it; returns that path (replaced when it exists)."""
        dest = Path(root) / "grpo" / label_value(self.run_id) / label
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(weights_dir, dest)
        return str(dest)
