"""The ``kubernetes`` generation-server provider (:class:`grpo_steps.servers.KubernetesServer`) against an
in-memory fake of the three client APIs it calls (no cluster is reachable here): rendered manifests,
readiness wait, cleanup on failure, the handle."""

import base64
import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from grpo_steps import servers
from grpo_steps.config import validate_config
from grpo_steps.servers import KubernetesServer, ServerStartError, k8s_manifests, kubernetes

RUN_ID = "argo-grpoflow-x7k2p"


@pytest.fixture(autouse=True)
def token_dir(tmp_path, monkeypatch):
    """The tokens this pod's clients keep, in a directory of the test's own."""
    from grpo_steps.servers import auth

    monkeypatch.setattr(auth, "TOKEN_DIR", tmp_path / "server-tokens")
    return tmp_path / "server-tokens"


def cluster_config(**generation):
    return validate_config({
        "model": {"name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "dtype": "bfloat16"},
        "generation": {"provider": "kubernetes", "weight_sync": "nccl",
                       "server": {"tensor_parallel_size": 2, "startup_timeout_s": 0.05}, **generation},
        "train": {"processes_per_node": 8, "per_device_train_batch_size": 1, "num_generations": 8},
        "resources": {"train": {"gpu": 8, "image": "registry.example/grpo:1"},
                      "vllm": {"gpu": 2, "image": "vllm/vllm-openai:v0.32.0"}, "namespace": "ml",
                      "shared_volume_claim": "grpo-shared"},
    })


def _matches(labels: dict, selector: str) -> bool:
    return all(labels.get(k) == v for k, v in (part.split("=") for part in selector.split(",")))


class FakeCluster:
    """The AppsV1Api + CoreV1Api + NetworkingV1Api methods the provider calls, over dicts; ready after
    ``ready_after`` reads. ``create_/list_/delete_namespaced_<kind>`` work on the store named in :data:`STORES`."""

    STORES = {"deployment": "deployments", "service": "services", "network_policy": "policies",
              "secret": "secrets", "config_map": "config_maps"}

    def __init__(self, ready_after: int | None = 0, never_ready: tuple[str, ...] = ()):
        self.deployments: dict[tuple, dict] = {}
        self.services: dict[tuple, dict] = {}
        self.policies: dict[tuple, dict] = {}
        self.secrets: dict[tuple, dict] = {}
        self.config_maps: dict[tuple, dict] = {}
        self.ready_after, self.reads, self.never_ready = ready_after, 0, never_ready
        self.secret_reads, self.may_read = 0, False

    def __getattr__(self, name):
        verb, _, kind = name.partition("_namespaced_")
        if kind not in self.STORES or verb not in ("create", "list", "delete"):
            raise AttributeError(name)
        store = getattr(self, self.STORES[kind])
        if verb == "create":
            return lambda namespace, body: store.__setitem__((namespace, body["metadata"]["name"]), body)
        if verb == "list":
            assert kind not in ("secret", "config_map"), "the flow's Role lists no Secrets, ConfigMaps (rbac.yaml)"
            return lambda namespace, label_selector: self._list(store, namespace, label_selector)
        return lambda name, namespace: self._delete(store, namespace, name)

    def read_namespaced_deployment_status(self, name, namespace):
        assert (namespace, name) in self.deployments
        self.reads += 1
        ready = self.ready_after is not None and self.reads > self.ready_after and name not in self.never_ready
        return NS(status=NS(ready_replicas=1 if ready else None))

    def read_namespaced_secret(self, name, namespace):
        """Refused as for the flow's account (infra/k8s/rbac.yaml grants no get on Secrets); ``may_read``: an account
        of the user's own that may (a run of the local runtime); the API returns base64 data, never stringData."""
        from kubernetes.client.exceptions import ApiException

        self.secret_reads += 1
        if not self.may_read:
            raise ApiException(status=403, reason="Forbidden")
        body = self.secrets[(namespace, name)]
        return NS(data={k: base64.b64encode(v.encode()).decode() for k, v in body["stringData"].items()})

    def list_namespaced_pod(self, namespace, label_selector):
        waiting = NS(reason="ImagePullBackOff", message="pull access denied")
        status = NS(phase="Pending", container_statuses=[NS(state=NS(waiting=waiting, terminated=None))])
        return NS(items=[NS(metadata=NS(name="vllm-abc-123"), status=status)])

    @staticmethod
    def _delete(store, namespace, name):
        from kubernetes.client.exceptions import ApiException

        if (namespace, name) not in store:
            raise ApiException(status=404, reason="Not Found")  # as the API answers a second delete
        del store[(namespace, name)]

    @staticmethod
    def _list(store, namespace, selector):
        return NS(items=[NS(metadata=NS(name=name)) for (ns, name), body in store.items()
                         if ns == namespace and _matches(body["metadata"]["labels"], selector)])


def test_rendered_deployment_requests_gpus_probes_health_and_carries_the_run_labels():
    deployment, service, _ = k8s_manifests.render_manifests(cluster_config(), RUN_ID, "Qwen/Qwen2.5-1.5B-Instruct")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    assert deployment["metadata"]["namespace"] == service["metadata"]["namespace"] == "ml"
    assert container["image"] == "vllm/vllm-openai:v0.32.0"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in container["env"]
    for obj in (deployment, service, deployment["spec"]["template"]):
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "grpo-pipeline"
        assert obj["metadata"]["labels"]["grpo-pipeline/run-id"] == RUN_ID
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": "grpo-shared"}} in pod["volumes"]
    assert {"name": "shared", "mountPath": "/shared"} in container["volumeMounts"]
    # /dev/shm holds a tensor-parallel server's one copy of the weights (s3 sync): as large as the memory limit
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": container["resources"]["limits"]["memory"]}


def test_stage_weights_copies_to_the_runs_folder_on_the_shared_volume(tmp_path):
    src = tmp_path / "final"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w1")
    for _ in range(2):  # a retried evaluate replaces the earlier copy
        dest = KubernetesServer("http://x", run_id=RUN_ID).stage_weights(str(src), "trained",
                                                                         root=str(tmp_path / "shared"))
    assert dest == str(tmp_path / "shared" / "grpo" / RUN_ID / "trained")
    assert (tmp_path / "shared" / "grpo" / RUN_ID / "trained" / "model.safetensors").read_bytes() == b"w1"


def test_the_runs_staged_evaluation_copies_are_removed_with_its_servers(tmp_path):
    from grpo_steps.servers.kubernetes import stop_run

    src, shared = tmp_path / "final", tmp_path / "shared"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"w1")
    for label in ("baseline", "trained"):
        KubernetesServer("http://x", run_id=RUN_ID).stage_weights(str(src), label, root=str(shared))
    other = shared / "grpo" / "argo-another-run"
    other.mkdir()
    fake = FakeCluster()
    stop_run("ml", RUN_ID, apps=fake, core=fake, networking=fake, staged_root=shared)
    assert not (shared / "grpo" / RUN_ID).exists() and other.is_dir()  # another run's copies stay
    (shared / "grpo" / RUN_ID).symlink_to(other)  # a link at the run's folder is not followed
    stop_run("ml", RUN_ID, apps=fake, core=fake, networking=fake, staged_root=shared)
    assert other.is_dir() and (shared / "grpo" / RUN_ID).is_symlink()


def test_server_args_carry_trl_nccl_flags_only_with_nccl_sync():
    args = k8s_manifests.server_args(cluster_config(), "m")
    flag = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert json.loads(flag["--weight-transfer-config"]) == {"backend": "nccl"}
    assert flag["--logprobs-mode"] == "processed_logprobs"
    assert "--enable-scale-out" in args  # TRL's vllm-serve adds it for vLLM >= 0.30
    assert flag["--tensor-parallel-size"] == "2"
    assert (flag["--model"], flag["--served-model-name"], flag["--host"]) == ("m", "policy", "0.0.0.0")
    disk = k8s_manifests.server_args(cluster_config(weight_sync="disk", backend="hf"), "m")
    assert "--weight-transfer-config" not in disk


def test_each_replica_serves_its_own_name_first_then_the_common_one():
    """vLLM names each answer after the first served name: a completion says which replica sampled it."""
    cfg = cluster_config()
    for replica in (0, 2):
        (container,) = k8s_manifests.render_manifests(cfg, RUN_ID, "m", replica=replica)[0]["spec"]["template"][
            "spec"]["containers"]
        args = container["args"]
        at = args.index("--served-model-name")
        assert args[at + 1:at + 3] == [f"policy@r{replica}", "policy"] and args[at + 3].startswith("--")


def s3_cluster_config(**vllm):
    """``weight_sync: s3`` on the cluster: no shared volume, the server image with grpo_steps installed."""
    return validate_config({
        "model": {"name_or_path": "Qwen/Qwen2.5-1.5B-Instruct", "dtype": "bfloat16"},
        "generation": {"provider": "kubernetes", "weight_sync": "s3",
                       "s3_sync": {"url": "s3://grpo-weights/sync", "endpoint_url": "http://minio.storage.svc:9000"},
                       "server": {"startup_timeout_s": 5}},
        "resources": {"train": {"image": "registry.example/grpo:1"}, "namespace": "ml",
                      "vllm": {"gpu": 1, "image": "registry.example/grpo-vllm:1", **vllm}},
    })


def test_s3_sync_servers_run_the_engine_and_take_the_named_secrets_keys():
    """The server pods load each version through the pipeline's transfer engine (its flags, as every server the pipeline
    starts on a machine) and read S3 with the keys of the Secret the config names, as environment variables: envFrom, so
    no key is written into the manifest, the arguments or a log. No shared volume is mounted."""
    from grpo_steps.weights.server_flags import weight_transfer_args

    deployment = k8s_manifests.render_manifests(s3_cluster_config(s3_secret_name="grpo-s3-readonly"), RUN_ID,
                                                "Qwen/Qwen2.5-1.5B-Instruct")[0]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    at = args.index("--worker-extension-cls")
    assert args[at:at + 4] == weight_transfer_args()
    assert json.loads(args[at + 3]) == {"backend": "grpo_steps"} and args.count("--weight-transfer-config") == 1
    assert "--enable-scale-out" in args  # vLLM's /inference/v1/generate: per-token weight versions, pushes in flight
    assert container["envFrom"] == [{"secretRef": {"name": "grpo-s3-readonly"}}]
    assert "AWS_" not in json.dumps(container["env"]) and "minio" not in json.dumps(deployment)  # endpoint: per request
    assert "shared" not in json.dumps(pod["volumes"]) and "/shared" not in json.dumps(container["volumeMounts"])
    # without a Secret the pods use their own identity (IRSA, an instance role): nothing is mounted
    container = k8s_manifests.render_manifests(s3_cluster_config(), RUN_ID, "m")[0]["spec"]["template"]["spec"][
        "containers"][0]
    assert "envFrom" not in container and "--worker-extension-cls" in container["args"]
    # nccl (and backend hf) servers load evaluation's weights from the shared volume: through the worker extension,
    # which checks them against the request's digest (a copy swapped on the volume is refused), with no S3 engine
    for cfg in (cluster_config(), cluster_config(weight_sync="disk", backend="hf")):
        args = k8s_manifests.server_args(cfg, "m")
        assert args[args.index("--worker-extension-cls") + 1] == "grpo_steps.vllm_worker.WorkerExtension"
        assert '{"backend": "grpo_steps"}' not in args


def test_an_s3_sync_server_starts_without_a_shared_volume(token_dir):
    fake = FakeCluster()
    cfg = s3_cluster_config(s3_secret_name="grpo-s3-readonly")
    server = KubernetesServer.start(cfg, "/cache/qwen", run_id=RUN_ID, apps=fake, core=fake, networking=fake, poll_s=0)
    assert server.model == "Qwen/Qwen2.5-1.5B-Instruct"  # the hub id: the pod cannot read this machine's path
    ((_, deployment),) = fake.deployments.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": "grpo-s3-readonly"}}]
    assert [name for _, name in fake.secrets] == [f"vllm-{RUN_ID}-token"]  # the S3 Secret is the user's: never made
    assert server.stop(apps=fake, core=fake, networking=fake) and not fake.secrets


def test_no_gpu_request_when_the_server_has_no_gpu():
    cfg = validate_config({"generation": {"provider": "kubernetes", "backend": "hf"},
                           "resources": {"train": {"image": "grpo:1"}, "vllm": {"gpu": 0}, "shared_volume_claim": "s"}})
    container = k8s_manifests.render_manifests(cfg, RUN_ID, "m")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["requests"]


NAMES = [
    # (run id, object name)
    ("1732345678901234", "vllm-1732345678901234"),  # local runtime ids are digits
    ("argo-grpo.prod.grpoflow-abc", "vllm-argo-grpo-prod-grpoflow-abc"),  # dots are not DNS-1035
    ("x" * 80, "vllm-" + "x" * 58),  # at most 63 characters
]


@pytest.mark.parametrize(("run_id", "name"), NAMES)
def test_object_names_are_dns_1035(run_id, name):
    assert k8s_manifests.k8s_name(run_id) == name


def test_start_waits_for_a_ready_replica_and_returns_the_service_endpoint():
    fake = FakeCluster(ready_after=2)
    # ready at the third read; the first one imports the kubernetes client, seconds on a loaded machine
    cfg = cluster_config(server={"tensor_parallel_size": 2, "startup_timeout_s": 120})
    server = KubernetesServer.start(cfg, "/cache/m", run_id=RUN_ID, apps=fake, core=fake, networking=fake, poll_s=0.001)
    assert fake.reads == 3
    assert server.endpoint == f"http://vllm-{RUN_ID}.ml.svc:8000"
    assert server.model == "Qwen/Qwen2.5-1.5B-Instruct"  # a local path is not on the pod: the hub id
    # the handle keeps namespace and name (nothing is parsed back from the URL) and is all a later step needs
    handle = server.to_dict()
    assert (handle["provider"], handle["namespace"], handle["name"], handle["run_id"]) == (
        "kubernetes", "ml", f"vllm-{RUN_ID}", RUN_ID)
    again = servers.from_dict(handle)
    assert again.is_ready(apps=fake)
    assert again.stop(apps=fake, core=fake, networking=fake) is True
    assert not fake.deployments and not fake.services and not fake.policies
    assert not fake.secrets and not fake.config_maps
    assert again.stop(apps=fake, core=fake, networking=fake) is False  # nothing left to delete


def test_start_timeout_reports_pod_status_and_deletes_what_it_created(token_dir):
    fake = FakeCluster(ready_after=None)
    with pytest.raises(ServerStartError) as err:
        KubernetesServer.start(cluster_config(), "m", run_id=RUN_ID, apps=fake, core=fake, networking=fake,
                               poll_s=0.001)
    assert "not ready after" in str(err.value)
    assert "ImagePullBackOff" in str(err.value)
    assert not fake.deployments and not fake.services and not fake.policies
    assert not fake.secrets and not fake.config_maps and not list(token_dir.glob("*"))


def test_the_flows_role_never_reads_secrets():
    import yaml

    from grpo_steps.config import REPO_ROOT

    docs = list(yaml.safe_load_all((REPO_ROOT / "infra" / "k8s" / "rbac.yaml").read_text()))
    (role,) = [doc for doc in docs if doc["kind"] == "Role"]
    secret_rules = [rule for rule in role["rules"] if "secrets" in rule["resources"]]
    assert secret_rules and all(set(rule["verbs"]) == {"create", "delete"} for rule in secret_rules)
    # only the middleware's ConfigMaps share its verbs (neither read: tests/unit/test_run_rights.py)
    assert all(set(rule["resources"]) <= {"secrets", "configmaps"} for rule in secret_rules)


def test_stop_deletes_only_this_runs_objects():
    fake = FakeCluster()
    cfg = cluster_config(server={"tensor_parallel_size": 2, "startup_timeout_s": 5})
    mine = KubernetesServer.start(cfg, "m", run_id=RUN_ID, apps=fake, core=fake, networking=fake, poll_s=0)
    KubernetesServer.start(cfg, "m", run_id="other-run", apps=fake, core=fake, networking=fake, poll_s=0)
    assert mine.stop(apps=fake, core=fake, networking=fake) is True
    assert list(fake.deployments) == [("ml", "vllm-other-run")]
    assert list(fake.policies) == [("ml", "vllm-other-run")]
    assert [name for _, name in fake.secrets] == ["vllm-other-run-token"]  # its own Secret, by name


@pytest.mark.parametrize(("run_id", "run_pods"), [
    (RUN_ID, {"workflows.argoproj.io/workflow": "grpoflow-x7k2p"}),  # Argo: the run's workflow pods
    ("1764050000123456", {"app.kubernetes.io/name": "metaflow-task", "app.kubernetes.io/part-of": "metaflow"}),
])  # the local runtime on Kubernetes: Metaflow's task pods (its run id is an annotation, not a label)
def test_rendered_network_policy_admits_only_the_runs_pods_and_the_servers_own(run_id, run_pods):
    import yaml

    deployment, _, policy = k8s_manifests.render_manifests(cluster_config(), run_id, "m")
    policy = yaml.safe_load(yaml.safe_dump(policy))  # as the YAML the API server gets
    assert (policy["kind"], policy["apiVersion"]) == ("NetworkPolicy", "networking.k8s.io/v1")
    assert policy["metadata"]["namespace"] == "ml" and policy["spec"]["policyTypes"] == ["Ingress"]
    # it selects exactly the server's pods
    assert policy["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (rule,) = policy["spec"]["ingress"]
    assert "ports" not in rule and "ipBlock" not in repr(rule) and "namespaceSelector" not in repr(rule)
    peers = [peer["podSelector"]["matchLabels"] for peer in rule["from"]]
    assert peers == [run_pods, deployment["spec"]["selector"]["matchLabels"]]


def test_the_server_pod_takes_the_runs_token_from_its_secret_never_from_argv(token_dir, monkeypatch):
    """A NetworkPolicy is ignored by a cluster without an enforcing network plugin: the server checks the run's
    token itself (the pipeline's middleware, mounted from a ConfigMap since the vLLM image lacks the package)."""
    from grpo_steps.servers import auth

    fake = FakeCluster()
    cfg = cluster_config(server={"tensor_parallel_size": 2, "startup_timeout_s": 5})
    server = KubernetesServer.start(cfg, "m", run_id=RUN_ID, apps=fake, core=fake, networking=fake, poll_s=0)
    ((_, secret),) = fake.secrets.items()
    token = secret["stringData"][auth.TOKEN_ENV]
    assert len(token) >= 32 and secret["metadata"]["labels"]["grpo-pipeline/run-id"] == RUN_ID
    (deployment,) = fake.deployments.values()
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert token not in json.dumps(deployment)  # not in argv, not in any env value
    assert {"name": auth.TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret["metadata"]["name"],
                                                                   "key": auth.TOKEN_ENV}}} in container["env"]
    args = container["args"]
    assert args[args.index("--middleware") + 1] == auth.MIDDLEWARE
    ((_, config_map),) = fake.config_maps.items()
    (volume,) = [v for v in pod["volumes"] if v.get("configMap")]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert volume["configMap"]["items"] == [{"key": "auth.py", "path": "grpo_steps/servers/auth.py"}]
    assert config_map["data"]["auth.py"] == Path(auth.__file__).read_text()
    assert {"name": "PYTHONPATH", "value": k8s_manifests.AUTH_MOUNT} in container["env"]
    # the clients of this pod present it; a pod of a later step takes it from the Secret through its environment
    # (envFrom, grpo_steps.deploy), never from the API (the fake refuses a read)
    assert auth.token_for(server.endpoint) == token
    auth.forget_token(server.endpoint)
    later = servers.from_dict(server.to_dict())
    with pytest.raises(RuntimeError, match=f"may not read the run's Secret {secret['metadata']['name']}"):
        later.keep_token(core=fake)  # the flow's account: refused by RBAC; says how the token reaches a step
    monkeypatch.setenv(auth.TOKEN_ENV, token)
    assert later.keep_token(core=fake) is None and fake.secret_reads == 1  # from the environment, not the API
    monkeypatch.delenv(auth.TOKEN_ENV)
    assert auth.token_for(server.endpoint) == token  # kept for this pod's clients
    auth.forget_token(server.endpoint)
    fake.may_read = True  # a run of the local runtime under an account of the user's own that may read Secrets
    assert later.keep_token(core=fake) is None and auth.token_for(server.endpoint) == token


def test_the_middleware_loads_from_the_mounted_file_alone(tmp_path):
    """The module the ConfigMap mounts imports with nothing of the pipeline on the path (a namespace package;
    -S: no site-packages, where the editable install would find the repository)."""
    import subprocess
    import sys

    from grpo_steps.servers import auth

    (tmp_path / "grpo_steps" / "servers").mkdir(parents=True)
    (tmp_path / "grpo_steps" / "servers" / "auth.py").write_text(Path(auth.__file__).read_text())
    code = f"import grpo_steps.servers.auth as a; print(a.__file__, a.MIDDLEWARE == {auth.MIDDLEWARE!r})"
    out = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(tmp_path)}, check=True).stdout
    assert out.startswith(str(tmp_path)) and out.strip().endswith("True")


# several replicas (generation.server.replicas > 1): a Deployment + Service per replica behind a vllm-router
# Deployment; ReplicaSet and start_all stop servers without passing the client APIs, so the fake stands in for them

def replica_config(replicas: int = 3, **generation):
    """Kubernetes with ``replicas`` server pods; rollouts with backend ``hf`` (the replicas serve evaluation)."""
    return cluster_config(backend="hf", weight_sync="disk",
                          server={"replicas": replicas, "tensor_parallel_size": 2, "startup_timeout_s": 0.05},
                          **generation)


@pytest.fixture
def cluster(monkeypatch):
    """A fake cluster every API call of the provider reaches (``kubernetes._clients``)."""
    fake = FakeCluster()
    monkeypatch.setattr(kubernetes, "_clients", lambda apps=None, core=None, networking=None: (fake, fake, fake))
    return fake


def test_each_replica_gets_its_own_deployment_and_service_and_all_share_the_runs_secret_and_policy(cluster):
    from grpo_steps.servers import auth

    replicas = KubernetesServer.start_replicas(replica_config(), "m", run_id=RUN_ID)
    names = [f"vllm-{RUN_ID}-r{i}" for i in range(3)]
    assert [r.name for r in replicas] == names
    assert [r.endpoint for r in replicas] == [f"http://{name}.ml.svc:8000" for name in names]
    assert sorted(name for _, name in cluster.deployments) == sorted(name for _, name in cluster.services) == names
    assert len(cluster.secrets) == len(cluster.config_maps) == len(cluster.policies) == 1
    ((_, secret_name),) = cluster.secrets
    ((_, policy),) = cluster.policies.items()
    for i, name in enumerate(names):
        deployment, service = cluster.deployments[("ml", name)], cluster.services[("ml", name)]
        pod = deployment["spec"]["template"]
        # the Service reaches this replica's pods only (control calls go to each replica)
        assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        assert service["spec"]["selector"]["grpo-pipeline/replica"] == str(i)
        assert pod["metadata"]["labels"]["grpo-pipeline/replica"] == str(i)
        assert pod["metadata"]["labels"]["grpo-pipeline/run-id"] == RUN_ID  # stop_run and the exit hook find it
        env = pod["spec"]["containers"][0]["env"]
        assert {"name": auth.TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret_name,
                                                                       "key": auth.TOKEN_ENV}}} in env
        # the run's one NetworkPolicy covers every replica's pods
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert len({auth.token_for(r.endpoint) for r in replicas}) == 1
    assert [servers.from_dict(r.to_dict()) for r in replicas] == replicas


def test_a_replica_that_never_becomes_ready_is_named_and_everything_of_the_run_is_deleted(cluster, token_dir):
    cluster.never_ready = (f"vllm-{RUN_ID}-r1",)
    with pytest.raises(ServerStartError) as err:
        KubernetesServer.start_replicas(replica_config(), "m", run_id=RUN_ID)
    assert f"generation replica 2/3: vLLM Deployment ml/vllm-{RUN_ID}-r1 not ready after" in str(err.value)
    assert "ImagePullBackOff" in str(err.value)
    assert not cluster.deployments and not cluster.services and not cluster.policies
    assert not cluster.secrets and not cluster.config_maps and not list(token_dir.glob("*"))


def test_stopping_one_replica_keeps_the_objects_the_others_need(cluster):
    first, *others = KubernetesServer.start_replicas(replica_config(), "m", run_id=RUN_ID)
    assert first.stop() is True
    assert ("ml", first.name) not in cluster.deployments and ("ml", first.name) not in cluster.services
    assert len(cluster.deployments) == 2 and cluster.secrets and cluster.config_maps and cluster.policies
    for replica in others:
        replica.stop()
    assert not cluster.deployments and not cluster.secrets and not cluster.config_maps and not cluster.policies


def _flags(args: list[str]) -> dict[str, list[str]]:
    """``--flag v1 v2 ...`` -> {"--flag": ["v1", "v2"]}."""
    out: dict[str, list[str]] = {}
    for arg in args:
        if arg.startswith("--"):
            key = arg
            out[key] = []
        else:
            out[key].append(arg)
    return out


@pytest.mark.parametrize(("tools", "routing"), [([], "round_robin"), (["my_tools:search"], "consistent_hash")],
                         ids=["single-turn", "multi-turn"])
def test_the_router_fronts_each_replica_service_in_the_flows_image_and_only_the_run_reaches_it(cluster, tools,
                                                                                               routing):
    from grpo_steps.servers import auth

    # multi-turn rollouts (tools) keep an episode on one replica (router policy auto); tools only switch that here
    cfg = replica_config().model_copy(update={"tools": tools})
    replicas = KubernetesServer.start_replicas(cfg, "m", run_id=RUN_ID)
    router = KubernetesServer.start_router(cfg, replicas, run_id=RUN_ID)
    name = f"vllm-{RUN_ID}-router"
    assert (router.endpoint, router.metrics_endpoint) == (f"http://{name}.ml.svc:8000",
                                                          f"http://{name}.ml.svc:29000/metrics")
    deployment, service, policy = (store[("ml", name)] for store in (cluster.deployments, cluster.services,
                                                                       cluster.policies))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/grpo:1"  # resources.train.image: vllm-router is installed there
    # vllm-router on the pod's loopback behind the bridge, which admits only the run's token (the Secret's) and never
    # the admin routes: a pod a NetworkPolicy does not stop still cannot add a worker
    assert container["command"] == ["python", "-m", "grpo_steps.servers.router_bridge"]
    split = container["args"].index("--")
    bridge, (python, dash_m, module, *router_args) = _flags(container["args"][:split]), container["args"][split + 1:]
    assert "--pod" in bridge and (bridge["--host"], bridge["--port"]) == (["0.0.0.0"], ["8000"])
    assert (bridge["--metrics-host"], bridge["--metrics-port"]) == (["0.0.0.0"], ["29000"])
    assert container["env"] == [{"name": "GRPO_SERVER_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": f"vllm-{RUN_ID}-token", "key": "GRPO_SERVER_TOKEN"}}}]
    assert (python, dash_m, module) == ("python", "-m", "vllm_router.launch_router")
    flags = _flags(router_args)
    assert flags["--worker-urls"] == [r.endpoint for r in replicas]
    assert flags["--policy"] == [routing]
    assert flags["--health-check-interval-secs"] == ["5"]
    assert (flags["--host"], flags["--port"]) == (["127.2.0.1"], ["8000"])  # the pod's loopback only
    assert flags["--prometheus-host"] == ["127.2.0.1"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {p["port"] for p in service["spec"]["ports"]} == {8000, 29000}
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # the router: only the run's pods reach it (its admin routes take no token); the replicas admit the router
    assert policy["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert [peer["podSelector"]["matchLabels"] for peer in policy["spec"]["ingress"][0]["from"]] == [
        {"workflows.argoproj.io/workflow": "grpoflow-x7k2p"}]
    server_policy = cluster.policies[("ml", f"vllm-{RUN_ID}")]
    peers = [peer["podSelector"]["matchLabels"] for peer in server_policy["spec"]["ingress"][0]["from"]]
    assert deployment["spec"]["template"]["metadata"]["labels"].items() >= peers[-1].items()
    assert auth.token_for(router.endpoint) == auth.token_for(replicas[0].endpoint)  # passed on to the replicas


def test_a_replica_set_on_kubernetes_is_one_handle_the_flow_keeps_and_stop_deletes_all(cluster):
    cfg = replica_config()
    handle = servers.provision(cfg, "m", owner=None, run_id=RUN_ID)
    assert isinstance(handle, servers.ReplicaSet)
    again = servers.from_dict(handle.to_dict())  # as a later step reads the artifact
    assert [type(m) for m in again.members] == [KubernetesServer] * 3
    assert isinstance(again.router_server, kubernetes.KubernetesRouter)
    assert again.endpoint == f"http://vllm-{RUN_ID}-router.ml.svc:8000"
    assert again.metrics_endpoint == f"http://vllm-{RUN_ID}-router.ml.svc:29000/metrics"
    assert again.client().replicas == tuple(f"http://vllm-{RUN_ID}-r{i}.ml.svc:8000" for i in range(3))
    assert len(cluster.deployments) == len(cluster.services) == 4 and len(cluster.policies) == 2
    assert again.is_ready()
    assert again.stop() is True
    assert not cluster.deployments and not cluster.services and not cluster.policies
    assert not cluster.secrets and not cluster.config_maps
    assert again.stop() is False


def test_a_router_that_never_becomes_ready_is_named_and_nothing_of_the_run_is_left(cluster, token_dir):
    cluster.never_ready = (f"vllm-{RUN_ID}-router",)
    with pytest.raises(ServerStartError, match=f"vllm-router Deployment ml/vllm-{RUN_ID}-router not ready after"):
        servers.provision(replica_config(), "m", owner=None, run_id=RUN_ID)
    assert not cluster.deployments and not cluster.services and not cluster.policies
    assert not cluster.secrets and not cluster.config_maps and not list(token_dir.glob("*"))


def test_a_replacement_server_keeps_the_runs_token(monkeypatch):
    """A step that starts the run's server again (ensure_server, in a pod that took the run's token from its Secret
    at start, as the gang's other pods did) writes that token into the new Secret: every pod of the run still
    presents the server's token."""
    from grpo_steps.servers import auth

    monkeypatch.setenv(auth.TOKEN_ENV, "the-runs-token")
    fake = FakeCluster()
    KubernetesServer.start(cluster_config(server={"startup_timeout_s": 5}), "m", run_id=RUN_ID, apps=fake, core=fake,
                           networking=fake, poll_s=0)
    ((_, secret),) = fake.secrets.items()
    assert secret["stringData"] == {auth.TOKEN_ENV: "the-runs-token"}
