"""A rehearsal of a cluster run on one machine (``make rehearse``): the workflow docs/deploy.md deploys, rendered by
``argo-workflows create --only-json``, run pod by pod as processes, in the order of Argo's DAG; twice: a run killed in
its train step once every gang node saved a checkpoint (a lost node), then a run rendered and run in a second, empty
folder that continues it from its S3 location (``train.resume_from``, :mod:`grpo_steps.run_location`) to a registered
model.

    python -m grpo_steps.dev.rehearse --dir .rehearsal

What each pod gets (the spec: :mod:`grpo_steps.dev.rehearsal`):

- its command and arguments as rendered, Argo's tags filled (``{{workflow.name}}``, inputs, the outputs of earlier
  tasks read from the files its container wrote, ``/mnt/out/...``);
- the image's environment (infra/Dockerfile's ``ENV`` lines of the flow target, ``PATH`` leading to this checkout's
  virtual environment in place of ``/opt/venv``) and the Secrets it names, made from stand-ins as docs/deploy.md step 2
  documents them: ``grpo-s3-credentials`` holds keys with the rights of infra/s3/flow-policy.json (SeaweedFS
  identities, :mod:`grpo_steps.dev.s3_policy`), ``grpo-mlflow-credentials`` the flow's MLflow user;
- its own empty working directory, ``/tmp``, ``/mnt/out`` and ``/dev/shm`` (a mount namespace of its own: ``unshare
  --mount``, the manifest's emptyDir volumes bound there), and an ``/etc/hosts`` that resolves the JobSet's control node
  as the cluster's DNS would; the train step's JobSet runs its gang's nodes as processes side by side;
- the local S3 (SeaweedFS, bucket ``grpo-metaflow`` as the profile names it) and a real ``mlflow server`` (sqlite) on
  127.0.0.1.

Deviations, each forced by what cannot run here (docs/deploy.md "Rehearsal"): the metadata service is not on PyPI, so
the workflow is rendered with ``METAFLOW_DEFAULT_METADATA=local``; the generation server comes from the config's
override (no API server for provider ``kubernetes``); the model, data and sizes are configs/test.yaml's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from grpo_steps.config import REPO_ROOT
from grpo_steps.dev.s3_policy import identity
from grpo_steps.processes import ProcessRef, log_tail, pick_port, wait_until

PROFILE = REPO_ROOT / "infra" / "metaflow" / "config-k8s-argo.json"
DOCKERFILE = REPO_ROOT / "infra" / "Dockerfile"
POLICIES = REPO_ROOT / "infra" / "s3"
BUCKET = "grpo-metaflow"  # the profile's datastore bucket (infra/metaflow/config-k8s-argo.json)


def profile_env(s3_endpoint: str, credentials: dict[str, str], **overrides: str) -> dict[str, str]:
    """The deploying machine's environment: the shipped profile (every key as shipped but ``overrides``), the local
    S3's endpoint and the flow's keys."""
    profile = {k: str(v) for k, v in json.loads(PROFILE.read_text()).items()}
    return {**profile, "METAFLOW_S3_ENDPOINT_URL": s3_endpoint, "AWS_DEFAULT_REGION": "us-east-1", **credentials,
            "METAFLOW_USER": "rehearsal", **overrides}


def render(config_path: str | Path, env: dict[str, str], cwd: str | Path, timeout_s: float = 600) -> dict:
    """``argo-workflows create --only-json`` of the flow on ``config_path`` (it uploads the code package to the S3
    datastore ``env`` names): the WorkflowTemplate as a dict.

    Raises:
        RuntimeError: the command failed (its stderr's tail in the message).
    """
    cmd = [sys.executable, str(REPO_ROOT / "flows" / "grpo_flow.py"), "--no-pylint", "--config", "config",
           str(config_path), "argo-workflows", "create", "--only-json"]
    out = subprocess.run(cmd, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"argo-workflows create --only-json exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def image_env(dockerfile: str | Path = DOCKERFILE,
              venv_bin: str | Path = Path(sys.executable).parent) -> dict[str, str]:
    """The environment the flow's image gives every container: the ``ENV`` instructions of the Dockerfile's last
    stage (the flow target), ``$PATH`` expanded, with the image's ``/opt/venv`` standing for ``venv_bin``'s
    environment and ``/opt/grpo-pipeline`` for this checkout.

    >>> env = image_env()
    >>> env["PATH"].split(":")[0] == str(Path(sys.executable).parent) and env["GRPO_INFRA_DIR"].endswith("infra")
    True
    """
    stages = re.split(r"^FROM\s", Path(dockerfile).read_text(), flags=re.M)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    text = re.sub(r"\\\n\s*", " ", stages[-1])  # continuation lines joined
    for line in text.splitlines():
        if line.startswith("ENV "):
            for key, value in re.findall(r"(\w+)=(\S+)", line):
                env[key] = value.replace("$PATH", env.get("PATH", ""))
    venv = str(Path(venv_bin).parent)
    return {k: v.replace("/opt/venv", venv).replace("/opt/grpo-pipeline", str(REPO_ROOT)) for k, v in env.items()}


def rehearsal_config(model: str = "embedded:tiny-random-qwen2", *, nodes: int = 2, tracking_uri: str,
                     port: int = 0, resume_from: str | None = None) -> dict:
    """configs/multinode.yaml as shipped (project, resources, schedule, rewards, registry, retries, DeepSpeed) with
    configs/test.yaml's tiny model, data and sizes, ``nodes`` gang nodes of one CPU process each (a checkpoint after
    each of 2 steps), MLflow at ``tracking_uri``, and the generation backend ``hf`` in the training process: provider
    ``kubernetes`` needs an API server (the rendered provision step creates the server's Deployment through it), so
    the server pods and their read-only keys are not rehearsed here (docs/deploy.md "Rehearsal"). ``port``: the
    gang's rendezvous (``train.main_process_port``, the JobSet's ``MF_MASTER_PORT``; 0: the cluster's 29500): the
    rehearsal's pods share this machine's network. ``resume_from``: ``train.resume_from``, a checkpoint this
    pipeline saved itself (``train.trust_checkpoint``)."""
    import yaml

    base = yaml.safe_load((REPO_ROOT / "configs" / "multinode.yaml").read_text())
    test = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    resources = base["resources"]
    return {**base, "model": test["model"] | {"name_or_path": model}, "data": test["data"], "eval": test["eval"],
            "generation": {**base["generation"], **test["generation"], "backend": "hf", "weight_sync": "disk",
                           "provider": "local", "server": test["generation"]["server"]},
            "train": {**base["train"], **test["train"], "num_nodes": nodes, "processes_per_node": 1,
                      "per_device_train_batch_size": 4, "max_steps": 2, "save_steps": 1, "grpo": {},
                      "main_process_port": port, "resume_from": resume_from,
                      "trust_checkpoint": resume_from is not None},
            # one training process per GPU of the node size: the node size of one CPU process
            "resources": {**resources, "train": {**resources["train"], "gpu": 1},
                          "vllm": {**resources["vllm"], "s3_secret_name": None}},
            "tracking": {**base["tracking"], "tracking_uri": tracking_uri}}


def start_mlflow(root: Path, timeout_s: float = 300) -> tuple[ProcessRef, str]:
    """A real ``mlflow server`` on 127.0.0.1 (sqlite store under ``root``, artifacts proxied by the server into
    ``root/mlflow-artifacts``): (its process, its URI).

    Raises:
        RuntimeError: it did not answer ``/health`` within ``timeout_s`` (stopped then; its log's tail).
    """
    import requests

    port = pick_port("127.0.0.1", 0)
    log = root / "mlflow.log"
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
           "--artifacts-destination", str(root / "mlflow-artifacts")]
    # no job runner: its seven huey consumers serve MLflow's server-side jobs, which no step asks for (and took a
    # start past 120 s on the loaded 2-core box)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    ref, uri = ProcessRef.of(proc.pid), f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited {proc.returncode}:\n{log_tail(log)}")
        try:
            return requests.get(f"{uri}/health", timeout=2).ok
        except requests.ConnectionError:
            return False

    if not wait_until(healthy, timeout_s):
        ref.stop_group(10)
        raise RuntimeError(f"mlflow server not healthy after {timeout_s:.0f} s:\n{log_tail(log)}")
    return ref, uri


def checkpoints_of_every_node(client, run_id: str, nodes: int, step: int):
    """A condition: every node of run ``run_id``'s gang saved its checkpoint of ``step`` to the datastore (its record
    is written last, after the files: :mod:`grpo_steps.run_location`)."""
    from grpo_steps.run_location import checkpoint_records

    def saved() -> bool:
        records = checkpoint_records(client, f"s3://{BUCKET}/metaflow", "GRPOFlow", run_id)
        return {r["metadata"]["node_index"] for r in records if r["metadata"]["global_step"] >= step} == set(
            range(nodes))

    return saved


def rehearse_run(root: Path, config: dict, s3, flow_keys: dict[str, str], stand_ins: dict[str, dict[str, str]],
                 timeout_s: float, kill=None) -> tuple[str, bool]:
    """One run in ``root`` (empty): the workflow rendered there from ``config``, then every pod in Argo's order, one
    line per pod and one per task a condition leaves out (the flow's switch). Returns the run's Argo workflow name
    (its Metaflow run id is ``argo-<name>``) and whether it was killed. ``kill``: (task, condition of the run id),
    the task's pods killed once the condition holds (:func:`grpo_steps.dev.rehearse_pods.run_dag`).

    Raises:
        PodFailed, RenderError: as :func:`grpo_steps.dev.rehearse_pods.run_dag`.
        RuntimeError: the render failed.
    """
    import yaml

    from grpo_steps.dev import rehearsal, rehearse_pods

    began = time.monotonic()
    (root / "deploy").mkdir(parents=True)
    (root / "rehearsal.yaml").write_text(yaml.safe_dump(config))
    # the metadata service (netflixoss/metaflow_metadata_service) is not on PyPI: local metadata, per pod
    workflow = render(root / "rehearsal.yaml", profile_env(s3.endpoint, flow_keys, METAFLOW_DEFAULT_METADATA="local"),
                      root / "deploy")
    (root / "workflow.json").write_text(json.dumps(workflow, indent=1))
    name = f"{workflow['metadata']['name']}-{secrets.token_hex(3)[:5]}"  # Argo's generateName
    print(f"rendered {workflow['metadata']['name']} in {time.monotonic() - began:.0f} s: run argo-{name}", flush=True)
    values = {"workflow.name": name, "retries": "0",
              "workflow.creationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    base = image_env()

    def report(result) -> None:
        if isinstance(result, rehearsal.NotRun):  # a condition of the DAG is false (the flow's switch)
            print(f"{result.task:<36} {result.status.lower()}: {result.reason}", flush=True)
            return
        exit_ = "killed" if result.killed else f"exit {result.returncode}"
        print(f"{result.task:<36} {result.name:<56} {exit_:<8} {result.seconds:6.0f} s", flush=True)

    try:
        rehearse_pods.run_dag(workflow, None, values, lambda pod: rehearsal.resolve_env(pod, stand_ins, base), root,
                              timeout_s, report, (kill[0], kill[1](f"argo-{name}")) if kill else None)
    except rehearse_pods.PodsKilled:
        return name, True
    return name, False


def registered(tracking_uri: str, model_name: str) -> str:
    """The registered versions of ``model_name`` in the MLflow server, one line."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    versions = client.search_model_versions(f"name='{model_name}'")
    if not versions:
        return f"no version of {model_name} registered"
    # a search's versions come without their aliases (MLflow 3.17): the registered model holds them
    named: dict[str, list[str]] = {}
    for alias, version in sorted(client.get_registered_model(model_name).aliases.items()):
        named.setdefault(str(version), []).append(alias)
    return f"registered {model_name}: " + ", ".join(
        f"version {v.version} (run {v.run_id}, aliases {named.get(str(v.version), [])})" for v in versions)


def main(argv: list[str] | None = None) -> int:
    """``make rehearse``: a run killed in its train step once every gang node saved its first checkpoint, then a
    second run, rendered and run in a second, empty folder, resumed from the first run's S3 location
    (``train.resume_from``: no metadata service here) to a registered model. One line per pod (its exit and wall
    time); 0 when the second run's every pod exited 0. The first failing pod's command and log tail end the report
    otherwise."""
    import argparse

    from grpo_steps.dev import local_s3, rehearsal, rehearse_pods

    parser = argparse.ArgumentParser(description="Rehearse a cluster run: every pod of the rendered workflow as a "
                                                 "process on this machine (grpo_steps/dev/rehearse.py).")
    parser.add_argument("--dir", default=".rehearsal", help="the rehearsal's folder (emptied first)")
    parser.add_argument("--nodes", type=int, default=2, help="gang nodes of the train step")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per step")
    args = parser.parse_args(argv)
    root = Path(args.dir).resolve()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    began = time.monotonic()
    # fresh keys per rehearsal, each identity with its policy's rights alone (docs/deploy.md step 2)
    flow_keys = {"AWS_ACCESS_KEY_ID": f"flow-{secrets.token_hex(4)}", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16)}
    server_keys = {"AWS_ACCESS_KEY_ID": f"srv-{secrets.token_hex(4)}", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16)}
    s3 = local_s3.start(root / "s3", bucket=BUCKET, access_key=f"admin-{secrets.token_hex(4)}",
                        secret_key=secrets.token_hex(16), identities=[
                            identity("grpo-flow", *flow_keys.values(), POLICIES / "flow-policy.json"),
                            identity("vllm-server", *server_keys.values(), POLICIES / "weights-read-policy.json")])
    stand_ins = {"grpo-s3-credentials": flow_keys, "grpo-s3-readonly": server_keys,
                 "grpo-mlflow-credentials": {"MLFLOW_TRACKING_USERNAME": "grpo-flow",
                                             "MLFLOW_TRACKING_PASSWORD": secrets.token_hex(8)}}
    mlflow = None
    try:
        mlflow, tracking_uri = start_mlflow(root)
        port = pick_port("127.0.0.1", 0)  # the gangs' rendezvous: every pod shares this machine's network
        config = rehearsal_config(nodes=args.nodes, tracking_uri=tracking_uri, port=port)
        print("run 1: killed in its train step once every node saved step 1", flush=True)
        name, killed = rehearse_run(root / "killed", config, s3, flow_keys, stand_ins, args.timeout_s, (
            "train", lambda run_id: checkpoints_of_every_node(s3.client(), run_id, args.nodes, 1)))
        if not killed:
            raise RuntimeError("run 1 ended before every node saved step 1: nothing was killed")
        location = f"s3://{BUCKET}/metaflow/GRPOFlow/argo-{name}"
        print(f"run 2: in a second folder, train.resume_from {location}", flush=True)
        rehearse_run(root / "resumed", rehearsal_config(nodes=args.nodes, tracking_uri=tracking_uri, port=port,
                                                        resume_from=location), s3, flow_keys, stand_ins, args.timeout_s)
        for log in sorted((root / "resumed" / "pods").glob("*/log.txt")):
            for line in log.read_text(errors="replace").splitlines():
                if "[checkpoint]" in line:
                    print(f"{log.parent.name}: {line.strip()}", flush=True)
        print(registered(tracking_uri, config["registry"]["model_name"]), flush=True)
    except (rehearse_pods.PodFailed, rehearsal.RenderError, RuntimeError) as error:
        print(f"REHEARSAL STOPPED after {time.monotonic() - began:.0f} s: {error}", flush=True)
        return 1
    finally:
        if mlflow is not None:
            mlflow.stop_group(20)
        local_s3.stop(s3)
    print(f"rehearsal complete in {time.monotonic() - began:.0f} s; MLflow store {root / 'mlflow.db'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
