"""``argo-workflows create --only-json`` for configs/multinode.yaml with three generation replicas (one render): the
WorkflowTemplate Metaflow 2.19 renders (the train gang is a JobSet in a resource template) carries the config's node
sizes, image, retries, schedule and project, and validates against Argo's models. Rendering uploads the code package
to the S3 datastore, so a local S3 server (SeaweedFS, loopback) stands in for the bucket; nothing else is reached (the
profile's metadata service neither: ``--only-json`` does not ask it)."""

import io
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest
import yaml

from grpo_steps.config import REPO_ROOT, SHARED_MOUNT, load_config

pytestmark = pytest.mark.s3
CONFIG = REPO_ROOT / "configs" / "multinode.yaml"
START = "models:/grpo-policy@champion"
REPLICAS = {"model": {"name_or_path": START}, "data": {"skip_seen": True},
            "generation": {"weight_sync": "s3", "server": {"replicas": 3}},
            "train": {"grpo": {"steps_per_generation": 4}},
            "resources": {"shared_volume_claim": "grpo-shared", "vllm": {"s3_secret_name": None}}}
"""What the rendered config changes in multinode.yaml: three generation replicas behind the router (s3 pushes, as
multinode.yaml's own; disk is refused on Kubernetes), the shared volume mounted (infra/k8s/shared-volume.yaml's claim;
multinode.yaml mounts none), no server Secret, whole groups of 16 per training process (4 x 4) for the pipeline's
rollouts, and a continual start: the registry's champion, trained on rows its chain has not seen
(docs/continual.md)."""


def _merged(base: dict, changes: dict) -> dict:
    return {**base, **{k: _merged(base.get(k, {}), v) if isinstance(v, dict) else v for k, v in changes.items()}}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    """multinode.yaml with :data:`REPLICAS`."""
    path = tmp_path_factory.mktemp("config") / "multinode-replicas.yaml"
    path.write_text(yaml.safe_dump(_merged(yaml.safe_load(CONFIG.read_text()), REPLICAS)))
    return path


def _profile_env(s3) -> dict:
    """This process's environment with the shipped profile (infra/metaflow/config-k8s-argo.json) and the local S3."""
    profile = json.loads((REPO_ROOT / "infra" / "metaflow" / "config-k8s-argo.json").read_text())
    return {**os.environ, **{k: str(v) for k, v in profile.items()}, **s3.env(), "METAFLOW_USER": "ci"}


@pytest.fixture(scope="module")
def cfg(config_path):
    return load_config(config_path)


@pytest.fixture(scope="module")
def rendered(s3, tmp_path_factory, config_path):
    """(WorkflowTemplate dict, train JobSet dict with Argo ``{{...}}`` expressions replaced by ARGO)."""
    env = _profile_env(s3)
    cmd = [sys.executable, str(REPO_ROOT / "flows" / "grpo_flow.py"), "--no-pylint", "--config", "config",
           str(config_path), "argo-workflows", "create", "--only-json"]
    out = subprocess.run(cmd, env=env, cwd=tmp_path_factory.mktemp("cwd"), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    template = json.loads(out.stdout)
    train = next(t for t in template["spec"]["templates"] if t["name"] == "train")
    jobset = yaml.safe_load(re.sub(r"\{\{[^}]*\}\}", "ARGO", train["resource"]["manifest"]))
    return template, train, jobset


def test_train_gang_is_a_jobset_with_the_configured_node_size(rendered, cfg):
    _, train, jobset = rendered
    assert jobset["kind"] == "JobSet"
    jobs = {job["name"]: job for job in jobset["spec"]["replicatedJobs"]}
    assert set(jobs) == {"control", "worker"} and jobs["control"]["replicas"] == 1
    for job in jobs.values():
        pod = job["template"]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["image"] == cfg.resources.train.image
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(cfg.resources.train.gpu)
        assert float(container["resources"]["requests"]["memory"].rstrip("M")) == cfg.resources.train.memory_mib
        assert float(container["resources"]["requests"]["cpu"]) == cfg.resources.train.cpu
        shm = next(v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory")
        assert shm["emptyDir"]["sizeLimit"] == f"{cfg.resources.train.shared_memory_mib}Mi"
        assert {"mountPath": "/dev/shm", "name": shm["name"]} in container["volumeMounts"]
        assert pod["serviceAccountName"] == "grpo-flow"  # ensure_server reads the server's Deployment
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [cfg.resources.shared_volume_claim]
        shared = next(v["name"] for v in pod["volumes"] if "persistentVolumeClaim" in v)
        # mounted where the server pods mount it too (a model under /shared, nccl's evaluation copies)
        assert {"mountPath": SHARED_MOUNT, "name": shared} in container["volumeMounts"]
        # the gang's rendezvous, declared (it rendered "None" without the train step's @kubernetes port)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["MF_MASTER_PORT"] == "29500" and container["ports"] == [{"containerPort": 29500}]
    assert train["retryStrategy"]["limit"] == cfg.train.retries


def test_worker_count_is_num_parallel_minus_one_from_the_deployed_config(rendered, s3, cfg):
    import boto3

    template, train, jobset = rendered
    gang = next(t for t in template["spec"]["templates"] if t["name"].endswith("-foreach-parallel"))
    args = {p["name"]: p["value"] for p in gang["dag"]["tasks"][0]["arguments"]["parameters"]}
    assert "sub(sprig.int(inputs.parameters['num-parallel']),1)" in args["workerCount"]
    # num-parallel is what provision_vllm passes (config.train.num_nodes) in the config baked into the package
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    url = next(e["value"] for e in container["env"] if e["name"] == "METAFLOW_CODE_URL")
    bucket, key = url.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                          aws_secret_access_key=s3.secret_key, region_name="us-east-1")
    blob = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        baked = json.load(tar.extractfile(".mf_meta/CONFIG"))
    deployed = baked["user_configs"]["config"][0]
    assert (deployed["model"]["name_or_path"], deployed["data"]["skip_seen"]) == (START, True)
    assert deployed["train"]["num_nodes"] == cfg.train.num_nodes == 4
    assert deployed["generation"]["server"]["replicas"] == cfg.generation.server.replica_count == 3


def test_schedule_and_project_come_from_the_config(rendered, cfg):
    template, _, _ = rendered
    cron = json.loads(template["metadata"]["annotations"]["metaflow/cron"])
    assert cron == {"schedule": cfg.schedule.cron, "tz": cfg.schedule.timezone}
    assert template["metadata"]["name"].startswith(f"{cfg.project}.user.ci.")
    assert template["metadata"]["namespace"] == cfg.resources.namespace
    for step in ("start", "prepare-data", "evaluate", "register", "end"):
        spec = next(t for t in template["spec"]["templates"] if t["name"] == step)
        assert spec["container"]["image"] == cfg.resources.train.image


def test_a_run_without_new_rows_goes_from_prepare_data_to_end_in_the_deployed_workflow(rendered):
    """The flow's switch after ``prepare_data`` (route ``train`` or ``no_new_rows``) as Argo runs it: the DAG starts
    provision_vllm and end each on a condition of prepare_data's output, so a scheduled run with nothing new ends
    cleanly instead of failing. The DAG is the one recorded for the unit tests that walk both routes
    (tests/unit/data/grpoflow-dag.yaml, tests/unit/test_rehearsal_dag.py)."""
    from tests.unit.test_rehearsal_dag import RECORDED_DAG, trimmed

    template, _, _ = rendered
    assert trimmed(template) == yaml.safe_load(RECORDED_DAG.read_text()), "rewrite the recorded DAG from trimmed()"
    tasks = [task for t in template["spec"]["templates"] if "dag" in t for task in t["dag"]["tasks"]]
    when = {task["name"]: task.get("when", "") for task in tasks}
    assert "switch-step" in when["provision-vllm"] and "== 'provision_vllm'" in when["provision-vllm"], when
    # end: after register as before, or straight after prepare_data when it routed the run there
    assert "{{tasks.register.status}}==Succeeded" in when["end"] and "== 'end'" in when["end"], when


def test_a_failed_workflow_runs_the_server_teardown_hook_as_the_flows_service_account(rendered, cfg):
    template, _, _ = rendered
    hook = template["spec"]["hooks"]["error-teardown-server"]
    assert "Failed" in hook["expression"]
    spec = next(t for t in template["spec"]["templates"] if t["name"] == hook["template"])
    assert "exit_hook_script grpo_flow.py teardown_server" in spec["container"]["command"][-1]
    assert spec["container"]["image"] == cfg.resources.train.image
    start = next(t for t in template["spec"]["templates"] if t["name"] == "start")
    assert start["serviceAccountName"] == "grpo-flow"  # infra/k8s/rbac.yaml lets it manage the server


def _key_paths(value, prefix: str = "") -> set[str]:
    """Every key path in a JSON value (``a.b[].c``) whose value is not null, lists folded."""
    if isinstance(value, dict):
        return set().union(set(), *({f"{prefix}.{k}"} | _key_paths(v, f"{prefix}.{k}")
                                    for k, v in value.items() if v is not None))
    if isinstance(value, list):
        return set().union(set(), *(_key_paths(v, f"{prefix}[]") for v in value))
    return set()


def test_the_workflow_template_is_one_argo_accepts(rendered):
    """The WorkflowTemplate validates against Argo Workflows' own spec (hera's generated models of Argo's OpenAPI
    schema): every value has the type Argo declares, and no field is one Argo does not know (the models keep only
    known fields, so a field lost between the template and its validated copy would be an unknown one)."""
    from hera.workflows.models import WorkflowTemplate

    template, _, _ = rendered
    model = WorkflowTemplate.model_validate(template)
    known = _key_paths(model.model_dump(by_alias=True, exclude_none=True, mode="json"))
    assert _key_paths(template) - known == set()
    assert model.kind == "WorkflowTemplate" and model.spec.templates
    broken = json.loads(json.dumps(template))
    broken["spec"]["templates"][0]["retryStrategyy"] = {"limit": 1}  # a misspelt field is caught
    assert _key_paths(broken) - _key_paths(WorkflowTemplate.model_validate(broken).model_dump(
        by_alias=True, exclude_none=True, mode="json")) == {".spec.templates[].retryStrategyy",
                                                            ".spec.templates[].retryStrategyy.limit"}


def test_every_pod_of_the_workflow_runs_as_the_flows_service_account(rendered):
    """infra/k8s/rbac.yaml grants its rights to grpo-flow: each template that starts a pod names it (the steps, the
    JobSet's pods, the exit hook), and so does the template that creates the JobSet, whose pod Argo runs as the
    workflow's service account (docs/deploy.md, one-time step: Argo's workflowDefaults)."""
    template, train, jobset = rendered
    pods = [t for t in template["spec"]["templates"] if "container" in t or "script" in t]
    assert pods and {t.get("serviceAccountName") for t in pods} == {"grpo-flow"}, [t["name"] for t in pods]
    for job in jobset["spec"]["replicatedJobs"]:
        assert job["template"]["spec"]["template"]["spec"]["serviceAccountName"] == "grpo-flow"
    assert "resource" in train
    creator = train.get("serviceAccountName") or template["spec"].get("serviceAccountName")
    if creator is None:  # Metaflow 2.19 leaves it to Argo's default: deploy.md's one-time steps must set that
        steps = (REPO_ROOT / "docs" / "deploy.md").read_text()
        assert "workflowDefaults" in steps and "serviceAccountName: grpo-flow" in steps
    else:
        assert creator == "grpo-flow"


def test_only_train_and_evaluate_take_the_runs_token_and_the_jobset_passes_the_admission_policy(rendered):
    """The run's token reaches the steps that reach the server from pods of their own through the kubelet (envFrom of
    the run's Secret, named per run by Argo's {{workflow.name}}: grpo_steps.deploy), never through the API; the
    JobSet that Argo creates as the flow's account, its parameters filled as Argo fills them, passes
    infra/k8s/admission.yaml (evaluated by a real CEL engine, tests/unit/test_admission.py) for its own workflow's
    pods, and not for another run's; it is the JobSet recorded for the unit tests (tests/unit/data/train-jobset.yaml,
    trimmed of what varies per render)."""
    from grpo_steps.servers.k8s_manifests import ARGO_TOKEN_SECRET, auth_names
    from tests.unit.test_admission import RECORDED_JOBSET, decide, fill_argo, trimmed

    template, train, _ = rendered
    for spec in template["spec"]["templates"]:
        if "container" in spec:
            refs = [f["secretRef"]["name"] for f in spec["container"].get("envFrom") or [] if f.get("secretRef")]
            assert (ARGO_TOKEN_SECRET in refs) == (spec["name"] == "evaluate"), spec["name"]
    workflow = "grpo.user.ci.grpoflow-x7k2p"
    manifest = train["resource"]["manifest"]
    recorded = RECORDED_JOBSET.read_text()
    assert trimmed(manifest) == recorded[recorded.index("apiVersion:"):], "rewrite the recorded JobSet from trimmed()"
    jobset = fill_argo(manifest, workflow)
    for job in jobset["spec"]["replicatedJobs"]:
        refs = [f["secretRef"]["name"] for f in job["template"]["spec"]["template"]["spec"]["containers"][0]["envFrom"]]
        assert auth_names(f"argo-{workflow}")[0] in refs
    for operation in ("CREATE", "DELETE"):
        decision = decide(jobset, operation, f"{workflow}-train-1234567890")
        assert decision.allowed and decision.applied, decision.messages
    assert not decide(jobset, pod="grpo.user.ci.grpoflow-other-train-1234567890").allowed
    assert not decide(fill_argo(manifest, "grpo.user.ci.grpoflow-other"), pod=f"{workflow}-train-1234567890").allowed


def test_every_pod_records_its_run_in_the_metadata_service(rendered):
    """Every pod records the run in the profile's metadata service, at its Service (METAFLOW_SERVICE_INTERNAL_URL;
    this machine's METAFLOW_SERVICE_URL is a port-forward), so a run made in pods is found again from a laptop and
    from a later pod."""
    template, _, jobset = rendered
    profile = json.loads((REPO_ROOT / "infra" / "metaflow" / "config-k8s-argo.json").read_text())
    containers = [t["container"] for t in template["spec"]["templates"] if "container" in t]
    containers += [job["template"]["spec"]["template"]["spec"]["containers"][0]
                   for job in jobset["spec"]["replicatedJobs"]]
    for container in containers:
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("METAFLOW_DEFAULT_METADATA") == "service", container.get("name")
        assert env.get("METAFLOW_SERVICE_URL") == profile["METAFLOW_SERVICE_INTERNAL_URL"], container.get("name")


def test_a_deployment_giving_the_server_pods_the_flows_own_secret_is_refused(s3, tmp_path):
    """multinode.yaml as shipped gives the server pods the read-only grpo-s3-readonly; naming the flow's own
    grpo-s3-credentials (in infra/metaflow/config-k8s-argo.json's Secrets) is refused where the deployment is made."""
    metaflow_config = json.loads((REPO_ROOT / "infra" / "metaflow" / "config-k8s-argo.json").read_text())
    assert "grpo-s3-credentials" in metaflow_config["METAFLOW_KUBERNETES_SECRETS"].split(",")
    path = tmp_path / "flows-secret.yaml"
    path.write_text(yaml.safe_dump(_merged(yaml.safe_load(CONFIG.read_text()),
                                           {"resources": {"vllm": {"s3_secret_name": "grpo-s3-credentials"}}})))
    env = _profile_env(s3)
    out = subprocess.run([sys.executable, str(REPO_ROOT / "flows" / "grpo_flow.py"), "--no-pylint", "--config",
                          "config", str(path), "argo-workflows", "create", "--only-json"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "Run refused: the server pods' S3 Secret" in out.stderr
    assert "s3_secret_name 'grpo-s3-credentials' is a Secret of the flow's own pods" in out.stderr
    assert not out.stdout.strip()  # no WorkflowTemplate
