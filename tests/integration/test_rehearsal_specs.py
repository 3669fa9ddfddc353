"""The rehearsal's rendered WorkflowTemplate (configs/multinode.yaml at the tiny model's size:
grpo_steps/dev/rehearse.py) read as the pods' processes (grpo_steps/dev/rehearsal.py): the DAG's order, each
container's argv and environment with Argo's tags filled, its Secrets and volumes, and the train step's JobSet as one
process per gang node with the environment the JobSet gives it; then the run's first pod, start, run as the
rehearsal runs it. Rendered once, as deploy.md renders it (the shipped profile, the flow's keys scoped as
infra/s3/flow-policy.json on the local S3), with the rehearsal's local metadata."""

import json
import subprocess
from types import SimpleNamespace

import pytest

from grpo_steps.config import REPO_ROOT
from grpo_steps.dev import local_s3, rehearsal
from grpo_steps.dev.rehearsal import RenderError
from grpo_steps.dev.rehearse import BUCKET, image_env, profile_env, rehearsal_config, render, start_mlflow
from grpo_steps.dev.rehearse_pods import outputs_of, run_pods
from grpo_steps.dev.s3_policy import identity
from grpo_steps.processes import pick_port

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # the module's workflow: argo-workflows create, ~20 s
WORKFLOW = {"workflow.name": "grpo.user.rehearsal.grpoflow-x7k2q", "workflow.creationTimestamp": "2026-12-07T09:00:00Z",
            "retries": "0"}
"""What Argo fills in for every template of one submitted workflow (its name from the template's generateName)."""


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory):
    """The rendered workflow (``workflow``) and what its pods need: the local S3 with the flow's scoped identity, a
    real MLflow server, the Secrets' stand-ins, the gang's rendezvous ``port``."""
    import yaml

    root = tmp_path_factory.mktemp("rehearsal")
    keys = {"AWS_ACCESS_KEY_ID": "flow-key", "AWS_SECRET_ACCESS_KEY": "flow-secret"}
    server = local_s3.start(root / "s3", bucket=BUCKET, identities=[
        identity("flow", *keys.values(), REPO_ROOT / "infra" / "s3" / "flow-policy.json")])
    mlflow = None
    try:
        mlflow, tracking_uri = start_mlflow(root)
        port = pick_port("127.0.0.1", 0)
        (root / "rehearsal.yaml").write_text(yaml.safe_dump(rehearsal_config(tracking_uri=tracking_uri, port=port)))
        (root / "deploy").mkdir()
        env = profile_env(server.endpoint, keys, METAFLOW_DEFAULT_METADATA="local")
        workflow = render(root / "rehearsal.yaml", env, root / "deploy")
        yield SimpleNamespace(workflow=workflow, root=root, s3=server, tracking_uri=tracking_uri, port=port,
                              secrets={"grpo-s3-credentials": keys,
                                       "grpo-mlflow-credentials": {"MLFLOW_TRACKING_USERNAME": "grpo-flow",
                                                                   "MLFLOW_TRACKING_PASSWORD": "stand-in"}})
    finally:
        if mlflow is not None:
            mlflow.stop_group(20)
        local_s3.stop(server)


@pytest.fixture(scope="module")
def workflow(rehearsed):
    return rehearsed.workflow


def test_the_dag_runs_each_step_after_the_one_it_depends_on(workflow):
    tasks = rehearsal.dag_tasks(workflow)
    assert [t.name for t in tasks] == ["start", "prepare-data", "provision-vllm", "provision-vllm-foreach-parallel",
                                       "evaluate", "register", "end"]
    assert all(set(t.depends) <= {s.name for s in tasks[:i]} for i, t in enumerate(tasks))
    fan_out = tasks[3]
    assert fan_out.with_param == "{{tasks.provision-vllm.outputs.parameters.num-splits}}"
    assert [t.template for t in rehearsal.dag_tasks(workflow, fan_out.template)] == ["train"]


def test_a_steps_pod_has_its_command_environment_secrets_and_output_files_filled(workflow):
    start, prepare = rehearsal.dag_tasks(workflow)[:2]
    pod = rehearsal.container_pod(workflow, "start", rehearsal.task_inputs(start, WORKFLOW), "start-pod")
    assert pod.argv[:2] == ["bash", "-c"] and "{{" not in json.dumps(pod.argv) + json.dumps(pod.env)
    assert "step start --run-id argo-grpo.user.rehearsal.grpoflow-x7k2q " in pod.argv[2]
    assert "download_file(\"grpo-metaflow\", \"metaflow/GRPOFlow/data/" in pod.argv[2]  # the code package, from S3
    assert pod.env["METAFLOW_RUN_ID"] == "argo-grpo.user.rehearsal.grpoflow-x7k2q"
    assert pod.env["METAFLOW_KUBERNETES_POD_NAME"] == "start-pod"  # a fieldRef, as the kubelet fills it
    assert pod.env["METAFLOW_KUBERNETES_SERVICE_ACCOUNT_NAME"] == "grpo-flow"
    assert set(pod.env_from) == {"grpo-s3-credentials", "grpo-mlflow-credentials"}  # the profile's Secrets
    assert "AWS_SECRET_ACCESS_KEY" not in pod.env  # keys only through the Secret
    assert pod.outputs == {"task-id": "/mnt/out/task_id"} and pod.mounts == {"/mnt/out": {"emptyDir": {}}}
    # the next step's input paths are the first one's output, as Argo passes it
    values = {**WORKFLOW, "tasks.start.outputs.parameters.task-id": "t-1234"}
    assert rehearsal.task_inputs(prepare, values)["inputs.parameters.input-paths"] == (
        "argo-grpo.user.rehearsal.grpoflow-x7k2q/start/t-1234")
    with pytest.raises(RenderError, match=r"tasks\.start\.outputs\.parameters\.task-id"):
        rehearsal.task_inputs(prepare, WORKFLOW)  # before start has run


def test_the_train_jobset_is_one_process_per_gang_node_with_the_jobsets_environment(workflow, rehearsed):
    fan_out = rehearsal.dag_tasks(workflow)[3]
    (train,) = rehearsal.dag_tasks(workflow, fan_out.template)
    outer = rehearsal.task_inputs(fan_out, {**WORKFLOW, "item": "0", **{
        f"tasks.provision-vllm.outputs.parameters.{k}": v for k, v in
        {"task-id": "t-9", "num-parallel": "4", "task-id-entropy": "e1f2a3"}.items()}})
    values = rehearsal.task_inputs(train, outer)
    assert values["inputs.parameters.workerCount"] == "3"  # sprig arithmetic on num-parallel, as Argo evaluates it
    pods = rehearsal.jobset_pods(workflow, "train", values)
    assert [p.name for p in pods] == ["js-e1f2a30-control-0-0", *(f"js-e1f2a30-worker-{i}-0" for i in range(3))]
    control = pods[0].hosts[0]
    assert control == "js-e1f2a30-control-0-0.js-e1f2a30.grpo.svc.cluster.local"
    for node, pod in enumerate(pods):
        assert pod.env["MF_MASTER_ADDR"] == control and pod.env["MF_WORLD_SIZE"] == "4"
        # the rendezvous port the JobSet declares (train.main_process_port), which steps.train hands to accelerate
        assert pod.env["MF_MASTER_PORT"] == str(rehearsed.port)
        assert pod.env["MF_PARALLEL_CONTROL_TASK_ID"] == "control-e1f2a3-0"
        assert pod.env["UBF_CONTEXT"] == ("ubf_control" if node == 0 else "ubf_task")
        assert pod.env["TASK_ID_PREFIX"] == ("control" if node == 0 else "worker")
        # the job index annotation: the worker's split index is it + 1 (--split-index in the command)
        assert pod.env["TASK_ID_SUFFIX"] == pod.env["MF_WORKER_REPLICA_INDEX"] == str(max(node - 1, 0))
        assert "--split-index ${MF_CONTROL_INDEX:-$((MF_WORKER_REPLICA_INDEX + 1))}" in pod.argv[2]
        assert pod.mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
        assert "grpo-s3-credentials" in pod.env_from


def test_the_end_pod_reads_its_conditional_input_paths_as_argo_encodes_them(workflow):
    """end joins the switch (prepare_data's no-new-rows branch) and register: Argo hands it both input paths
    base64-encoded (``toBase64``, expr-lang's), and Metaflow's own decoder picks the branch that ran."""
    import base64
    import re

    from metaflow.plugins.argo.conditional_input_paths import generate_input_paths
    from metaflow.util import decompress_list

    end = rehearsal.dag_tasks(workflow)[-1]
    values = {**WORKFLOW, **{f"tasks.{t}.outputs.parameters.task-id": f"t-{t}" for t in ("prepare-data", "register")}}
    pod = rehearsal.container_pod(workflow, end.template, rehearsal.task_inputs(end, values), "end-pod")
    (encoded,) = re.findall(r"export INPUT_PATHS=(\S+)", pod.argv[2])
    run = "argo-grpo.user.rehearsal.grpoflow-x7k2q"
    assert decompress_list(base64.b64decode(encoded).decode()) == [f"{run}/prepare_data/t-prepare-data",
                                                                   f"{run}/register/t-register"]
    # the pod's command hands them to Metaflow's decoder with the steps that may not have run, latest first
    (skippable,) = re.findall(r"conditional_input_paths \$\(echo \$INPUT_PATHS\) (\S+)\)", pod.argv[2])
    assert generate_input_paths(encoded, skippable.split(",")) == f"{run}/register/t-register", skippable


def test_the_environment_is_built_as_kubernetes_builds_it(workflow):
    start = rehearsal.dag_tasks(workflow)[0]
    pod = rehearsal.container_pod(workflow, "start", rehearsal.task_inputs(start, WORKFLOW), "start-pod")
    secrets = {"grpo-s3-credentials": {"AWS_ACCESS_KEY_ID": "k", "USER": "from-secret"},
               "grpo-mlflow-credentials": {"MLFLOW_TRACKING_USERNAME": "grpo-flow"}}
    env = rehearsal.resolve_env(pod, secrets, {"PATH": "/venv/bin", "AWS_ACCESS_KEY_ID": "image"})
    assert env["PATH"] == "/venv/bin" and env["AWS_ACCESS_KEY_ID"] == "k"  # a Secret over the image
    assert env["USER"] == pod.env["USER"] == "rehearsal"  # the container's env over a Secret
    assert env["MLFLOW_TRACKING_USERNAME"] == "grpo-flow"
    with pytest.raises(RenderError, match="grpo-mlflow-credentials do not exist"):
        rehearsal.resolve_env(pod, {"grpo-s3-credentials": {}}, {})


def _unshare_allowed() -> bool:
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


# a real step: 751 s on the 2-core box under load 15-30 (the tiny model trained in the empty cache)
@pytest.mark.skipif(not _unshare_allowed(), reason="needs mount namespaces (root; CI runs as root)")
def test_the_first_pod_runs_as_rendered_with_the_flows_scoped_keys(rehearsed):
    """start, in a pod of its own (an empty working directory, ~/.cache and /tmp), from the rendered command: the code
    package fetched from S3, the config's checks (the embedded model built in the pod's own cache), the run opened on
    the MLflow server and its task id written where Argo reads it, all with the keys of infra/s3/flow-policy.json.
    The later pods run in ``make rehearse`` (minutes each on 2 cores: not in the suite)."""
    from mlflow import MlflowClient

    workflow, base = rehearsed.workflow, image_env()
    start = rehearsal.dag_tasks(workflow)[0]
    pod = rehearsal.container_pod(workflow, start.template, rehearsal.task_inputs(start, WORKFLOW),
                                  f"{WORKFLOW['workflow.name']}-start")
    (result,) = run_pods([pod], start.name, lambda pod: rehearsal.resolve_env(pod, rehearsed.secrets, base),
                         rehearsed.root, 1200)
    assert result.returncode == 0
    run_id, task_id = f"argo-{WORKFLOW['workflow.name']}", outputs_of(pod, result.folders)["task-id"]
    listed = rehearsed.s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"metaflow/GRPOFlow/{run_id}/start/")
    assert any(o["Key"].endswith(f"/{task_id}/0.DONE.lock") for o in listed.get("Contents", []))
    client = MlflowClient(tracking_uri=rehearsed.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("grpo-gsm").experiment_id])
    assert [r.data.tags["metaflow.pathspec"] for r in runs] == [f"GRPOFlow/{run_id}"]
    log = result.log.read_text()
    assert "AccessDenied" not in log and "pip install" not in log
