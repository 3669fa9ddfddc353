"""The ``kubernetes`` provider of the generation server: a vLLM Deployment + Service per run, or per replica behind a
``vllm-router`` Deployment with ``generation.server.replicas`` > 1.

The objects are rendered by :mod:`grpo_steps.servers.k8s_manifests` (pure functions): a NetworkPolicy admits only the
run's pods to the servers, but a cluster without an enforcing network plugin ignores it, so each server also loads the
pipeline's token middleware (the run's Secret, holding a fresh per-run token, and a ConfigMap with the middleware's
module, which the server image lacks; the token reaches the server as ``GRPO_SERVER_TOKEN`` from the Secret, never in
argv; the flow's later steps take it from the same Secret through ``envFrom``, which the WorkflowTemplate names per
run, :meth:`KubernetesServer.keep_token`: the flow's account creates and deletes Secrets but never reads one).
:meth:`KubernetesServer.start` creates them with the official ``kubernetes`` client, waits until the Deployment has
a ready pod (its readiness probe is ``GET /health``) and returns a handle whose endpoint is the Service's cluster DNS
name; :meth:`KubernetesServer.start_replicas` does the same for each replica in parallel (one Secret, ConfigMap and
NetworkPolicy for all), :meth:`KubernetesServer.start_router` puts the router in front of them
(:class:`KubernetesRouter`). On a failure they raise with the pods' status and delete what they created;
:meth:`KubernetesServer.stop` deletes a server's (or the router's) own objects and, once no Deployment of the run is
left, the run's shared ones; :func:`stop_run` deletes every object of a run by its labels (the error exit hook). The
methods take the client APIs as ``apps``, ``core`` and ``networking`` (default: the cluster's), so tests pass a fake.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_steps.config import PipelineConfig
from grpo_steps.processes import ProcessRef, wait_until
from grpo_steps.servers import auth
from grpo_steps.servers.base import GenerationServer, ServerStartError
from grpo_steps.servers.k8s_manifests import (
    PORT,
    ROUTER_APP,
    ROUTER_METRICS_PORT,
    RUN_LABEL,
    SHARED_MOUNT,
    auth_names,
    label_value,
    render_auth,
    render_manifests,
    render_router,
    run_selector,
)


def _clients(apps: Any = None, core: Any = None, networking: Any = None) -> tuple[Any, Any, Any]:
    if apps is not None and core is not None and networking is not None:
        return apps, core, networking
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return apps or client.AppsV1Api(), core or client.CoreV1Api(), networking or client.NetworkingV1Api()


def pod_status(core: Any, namespace: str, selector: str) -> str:
    """One line per pod that ``selector`` (a label selector) selects: name, phase, container waiting/terminated
    reasons."""
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
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


KINDS = ("deployment", "service", "network_policy", "secret", "config_map")
"""What the provider creates, as the client names it (``create_/list_/delete_namespaced_<kind>``)."""


def _api(kind: str, apps: Any, core: Any, networking: Any) -> Any:
    return {"deployment": apps, "network_policy": networking}.get(kind, core)


def remove_staged(run_id: str, root: str | Path = SHARED_MOUNT) -> bool:
    """Remove the run's staged evaluation copies (``{root}/grpo/{run_id}``, :meth:`KubernetesServer.stage_weights`)
    where this pod mounts the shared volume; never through a link. Returns whether there was something to remove."""
    folder = Path(root) / "grpo" / label_value(run_id)
    if folder.is_symlink() or not folder.is_dir():
        return False
    shutil.rmtree(folder)
    return True


def stop_run(namespace: str, run_id: str, *, apps: Any = None, core: Any = None, networking: Any = None,
             staged_root: str | Path = SHARED_MOUNT) -> int:
    """Delete every Deployment, Service and NetworkPolicy labelled with this run (its servers or replicas, router),
    the run's token Secret and middleware ConfigMap, by their names (the flow's Role may neither read nor list
    Secrets and ConfigMaps, infra/k8s/rbac.yaml), and the run's staged evaluation copies on the shared volume
    (:func:`remove_staged`); returns how many objects were deleted."""
    remove_staged(run_id, staged_root)
    apps, core, networking = _clients(apps, core, networking)
    secret_name, config_map_name = auth_names(run_id)
    deleted = _delete(core, "secret", secret_name, namespace) + _delete(core, "config_map", config_map_name, namespace)
    for kind in KINDS:
        if kind in ("secret", "config_map"):
            continue  # by name, above
        api = _api(kind, apps, core, networking)
        for obj in getattr(api, f"list_namespaced_{kind}")(namespace, label_selector=run_selector(run_id)).items:
            deleted += _delete(api, kind, obj.metadata.name, namespace)
    return deleted


def _delete(api: Any, kind: str, name: str, namespace: str) -> bool:
    """Delete one object; False when it is not there (deleted already)."""
    from kubernetes.client.exceptions import ApiException

    try:
        getattr(api, f"delete_namespaced_{kind}")(name, namespace)
    except ApiException as err:
        if err.status == 404:
            return False
        raise
    return True


@dataclass(frozen=True)
class KubernetesServer(GenerationServer):
    """A run's vLLM Deployment + Service in the cluster (one per replica); the endpoint is the Service's DNS name."""

    model: str = ""
    """Hugging Face id or ``/shared`` path it serves."""
    namespace: str = "default"
    name: str = ""
    """Name of the Deployment and the Service (``-r<i>`` for replica i)."""
    run_id: str = ""
    """The Metaflow run whose labelled objects these are."""

    provider = "kubernetes"
    runtime_lora = False

    @classmethod
    def start(cls, cfg: PipelineConfig, model_path: str, *, owner: ProcessRef | None = None, run_id: str,
              apps: Any = None, core: Any = None, networking: Any = None, poll_s: float = 5.0) -> KubernetesServer:
        """Create the run's Deployment + Service and wait for a ready pod.

        Serves ``model_path`` when it lies on the shared volume (``/shared``), else ``model.name_or_path``
        (a hub id the pod downloads). ``owner`` is not used: the cluster keeps the objects until
        :meth:`stop` or the error exit hook deletes them.

        Raises:
            ServerStartError: not ready within ``generation.server.startup_timeout_s`` seconds; the
                message carries each pod's phase and waiting reason. The created objects are deleted first.
        """
        (server,) = cls._create(cfg, model_path, run_id, [None], apps, core, networking, poll_s)
        return server

    @classmethod
    def start_replicas(cls, cfg: PipelineConfig, model_path: str, *, owner: ProcessRef | None = None, run_id: str,
                       apps: Any = None, core: Any = None, networking: Any = None,
                       poll_s: float = 5.0) -> list[GenerationServer]:
        """``generation.server.replicas`` Deployments + Services (``-r0``, ``-r1``, ...), created and waited for in
        parallel, sharing the run's token Secret, middleware ConfigMap and NetworkPolicy; arguments as :meth:`start`.

        Raises:
            ServerStartError: a replica was not ready within ``generation.server.startup_timeout_s`` seconds (named,
                with its pods' status); every object of the run is deleted first.
        """
        replicas = list(range(cfg.generation.server.replica_count))
        return cls._create(cfg, model_path, run_id, replicas, apps, core, networking, poll_s)

    @classmethod
    def _create(cls, cfg: PipelineConfig, model_path: str, run_id: str, replicas: list[int | None], apps: Any,
                core: Any, networking: Any, poll_s: float) -> list[KubernetesServer]:
        """The run's Secret, ConfigMap and NetworkPolicy, then a server per entry of ``replicas`` (None: the run's
        only server), each waited for; on any failure every object of the run is deleted."""
        from grpo_steps.servers.base import start_all

        apps, core, networking = _clients(apps, core, networking)
        model = model_path if model_path.startswith(SHARED_MOUNT) else cfg.model.name_or_path
        namespace, timeout_s = cfg.resources.namespace, cfg.generation.server.startup_timeout_s
        # a step that replaces the run's server (ensure_server) keeps the run's token, which its pod and the gang's
        # other pods took from the run's Secret when they started (envFrom) and present before any saved token
        token, endpoints = os.environ.get(auth.TOKEN_ENV) or auth.new_token(), []

        def start_one(i: int) -> KubernetesServer:
            deployment, service, _ = render_manifests(cfg, run_id, model, replica=replicas[i])
            name = deployment["metadata"]["name"]
            server = cls(f"http://{name}.{namespace}.svc:{PORT}", model=model, namespace=namespace, name=name,
                         run_id=run_id)
            endpoints.append(server.endpoint)
            auth.save_token(server.endpoint, token)  # this pod's clients (grpo_steps.servers.auth.token_for)
            apps.create_namespaced_deployment(namespace, deployment)
            core.create_namespaced_service(namespace, service)
            if wait_until(lambda: server.is_ready(apps=apps), timeout_s, interval_s=poll_s):
                return server
            selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
            raise ServerStartError(
                f"vLLM Deployment {namespace}/{name} not ready after {timeout_s:.0f} s "
                f"(generation.server.startup_timeout_s). Pods:\n{pod_status(core, namespace, selector)}")

        try:
            secret, config_map = render_auth(cfg, run_id, token)
            core.create_namespaced_secret(namespace, secret)
            core.create_namespaced_config_map(namespace, config_map)
            policy = render_manifests(cfg, run_id, model)[2]
            networking.create_namespaced_network_policy(namespace, policy)  # before a server can answer
            if replicas == [None]:
                return [start_one(0)]
            return start_all(start_one, len(replicas))
        except BaseException:
            stop_run(namespace, run_id, apps=apps, core=core, networking=networking)
            for endpoint in endpoints:
                auth.forget_token(endpoint)
            raise

    @classmethod
    def start_router(cls, cfg: PipelineConfig, replicas: list[GenerationServer], *, owner: ProcessRef | None = None,
                     run_id: str, apps: Any = None, core: Any = None, networking: Any = None,
                     poll_s: float = 5.0) -> KubernetesRouter:
        """A ``vllm-router`` Deployment + Service + NetworkPolicy in front of ``replicas`` (their Service URLs), in the
        flow's image, waited for like a server; this pod's clients of its endpoint present the replicas' token.

        Raises:
            ServerStartError: not ready within ``generation.server.startup_timeout_s`` seconds (with its pods'
                status); the router's objects are deleted first (the replicas are the caller's).
        """
        apps, core, networking = _clients(apps, core, networking)
        deployment, service, policy = render_router(cfg, run_id, [replica.endpoint for replica in replicas])
        namespace, name = cfg.resources.namespace, deployment["metadata"]["name"]
        router = KubernetesRouter(f"http://{name}.{namespace}.svc:{PORT}", model="vllm-router", namespace=namespace,
                                  name=name, run_id=run_id,
                                  metrics_endpoint=f"http://{name}.{namespace}.svc:{ROUTER_METRICS_PORT}/metrics")
        timeout_s = cfg.generation.server.startup_timeout_s
        try:
            token = auth.token_for(replicas[0].endpoint)
            if token:
                auth.save_token(router.endpoint, token)  # the router passes the header on to the replicas
            networking.create_namespaced_network_policy(namespace, policy)
            apps.create_namespaced_deployment(namespace, deployment)
            core.create_namespaced_service(namespace, service)
            if wait_until(lambda: router.is_ready(apps=apps), timeout_s, interval_s=poll_s):
                return router
            selector = f"app.kubernetes.io/name={ROUTER_APP},{RUN_LABEL}={label_value(run_id)}"
            raise ServerStartError(
                f"vllm-router Deployment {namespace}/{name} not ready after {timeout_s:.0f} s "
                f"(generation.server.startup_timeout_s). Pods:\n{pod_status(core, namespace, selector)}")
        except BaseException:
            router.stop(apps=apps, core=core, networking=networking)
            raise

    def stop(self, *, apps: Any = None, core: Any = None, networking: Any = None) -> bool:
        """Delete this server's (or router's) Deployment, Service and own NetworkPolicy, then, when no Deployment of
        the run is left, the run's remaining objects (the shared NetworkPolicy, Secret, ConfigMap: :func:`stop_run`);
        True when there was something to delete."""
        apps, core, networking = _clients(apps, core, networking)
        auth.forget_token(self.endpoint)
        own = [_delete(_api(kind, apps, core, networking), kind, self.name, self.namespace)
               for kind in ("deployment", "service", "network_policy")]  # a replica has no policy of its own
        left = apps.list_namespaced_deployment(self.namespace, label_selector=run_selector(self.run_id)).items
        rest = 0 if left else stop_run(self.namespace, self.run_id, apps=apps, core=core, networking=networking)
        return any(own) or rest > 0

    def keep_token(self, *, core: Any = None) -> None:
        """Keep the run's token for this pod's clients (a file only this user reads,
        :func:`grpo_steps.servers.auth.save_token`): the train and evaluate steps run in pods of their own, which take
        it from the run's Secret as ``GRPO_SERVER_TOKEN`` (``envFrom`` of :data:`~.k8s_manifests.ARGO_TOKEN_SECRET`,
        added by :mod:`grpo_steps.deploy`). The flow's account may not read Secrets, so one run's code cannot read
        another run's token (infra/k8s/rbac.yaml); only a pod with neither that variable nor a kept token (a run of
        the local runtime, under an account of your own) asks the API.

        Raises:
            RuntimeError: the token is not in the pod and the account may not read the Secret (403); says how the
                token reaches a step.
        """
        token = os.environ.get(auth.TOKEN_ENV)
        if token:
            auth.save_token(self.endpoint, token)
            return
        if auth.token_for(self.endpoint) is not None:
            return  # this pod started the server (provision_vllm) and kept its token
        import base64

        from kubernetes.client.exceptions import ApiException

        name = auth_names(self.run_id)[0]
        try:
            data = (core if core is not None else _clients()[1]).read_namespaced_secret(name, self.namespace).data
        except ApiException as err:
            if err.status != 403:
                raise
            raise RuntimeError(
                f"the token of the run's server {self.endpoint} is not in this pod, and its account may not read the "
                f"run's Secret {name}: a step of an Argo run takes it as {auth.TOKEN_ENV} (envFrom, added to train "
                "and evaluate by grpo_steps.deploy at `argo-workflows create`: deploy the flow again with this "
                "version); under grpo-flow, run a kubernetes-provider flow on Argo (docs/deploy.md)") from None
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


@dataclass(frozen=True)
class KubernetesRouter(KubernetesServer):
    """The ``vllm-router`` Deployment + Service in front of a run's replicas (:meth:`KubernetesServer.start_router`);
    checked, kept and stopped like a server (the fields of :class:`KubernetesServer`)."""

    metrics_endpoint: str | None = None
    """Its Prometheus metrics, ``http://<service>.<namespace>.svc:29000/metrics``."""

    provider = "kubernetes-router"

    def __str__(self) -> str:
        return f"vllm-router {self.endpoint}"
