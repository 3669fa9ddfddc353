"""Kill -9 the training process after its second checkpoint, then `resume`: training continues at the
checkpoint's step on a re-provisioned server, one continuous MLflow history, one registered version.
Once with the local datastore, once with the S3 datastore on a local S3 server (marker ``s3``)."""

import os
import re
import signal
import subprocess
import sys

import pytest
import yaml

from grpo_steps.config import REPO_ROOT

FLOW = REPO_ROOT / "flows" / "grpo_flow.py"
SAVED = re.compile(r"\[checkpoint\] saved step=(\d+) node=0 pid=(\d+)")
MAX_STEPS, SAVE_STEPS, KILL_AFTER = 8, 2, 4
MODEL_NAME = "grpo-resume-test"


@pytest.fixture
def local_s3(tmp_path):
    from grpo_steps import local_s3

    server = local_s3.start(tmp_path / "s3")
    yield server
    local_s3.stop(server)


def _kill_and_resume(workdir, env: dict, config: dict) -> str:
    """Run the flow, kill its training process after checkpoint KILL_AFTER, resume; returns resume's output."""
    (workdir / "resume.yaml").write_text(yaml.safe_dump(config))
    first = subprocess.Popen([sys.executable, str(FLOW), "--config", "config", "resume.yaml", "run"], cwd=workdir,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, log = False, []
    for line in first.stdout:
        log.append(line)
        match = SAVED.search(line)
        if match and int(match.group(1)) == KILL_AFTER:
            os.kill(int(match.group(2)), signal.SIGKILL)  # the training process, by the PID it reported
            killed = True
            break
    log.append(first.communicate(timeout=600)[0])
    assert killed, "".join(log)[-5000:]
    assert first.returncode != 0, "the run should fail when its training process is killed"

    second = subprocess.run([sys.executable, str(FLOW), "resume"], cwd=workdir, env=env, capture_output=True,
                            text=True, timeout=1200)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-6000:]
    return out


def _assert_resumed(workdir, out: str) -> None:
    from mlflow import MlflowClient

    assert f"resuming from step {KILL_AFTER}" in out
    assert "belongs to an earlier run or is not answering: starting a new one" in out
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "grpo"]
    (run,) = client.search_runs([experiment.experiment_id])  # resume reopened the same run
    for metric in ("reward", "loss"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, metric)]
        assert steps == list(range(1, MAX_STEPS + 1)), (metric, steps)  # continuous: no gap, no duplicate
    # training ended at max_steps; had it restarted at 0, steps 1..KILL_AFTER would appear twice above
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_runtime")] == [MAX_STEPS]
    assert "eval/trained/pass_at_1" in run.data.metrics
    assert len(client.search_model_versions(f"name = '{MODEL_NAME}'")) == 1


def _config(**tracking) -> dict:
    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["train"].update(max_steps=MAX_STEPS, save_steps=SAVE_STEPS)
    config["registry"]["model_name"] = MODEL_NAME
    config.setdefault("tracking", {}).update(tracking)
    return config


@pytest.mark.slow
def test_kill_then_resume_on_the_local_datastore(tmp_path, tiny_model_path):
    env = {**os.environ, "METAFLOW_USER": "grpo-tests", "PYTHONUNBUFFERED": "1"}
    out = _kill_and_resume(tmp_path, env, _config())
    _assert_resumed(tmp_path, out)
    assert list((tmp_path / ".metaflow" / "mf.checkpoints").rglob("*")), "checkpoints in the local datastore"


@pytest.mark.slow
@pytest.mark.s3
def test_kill_then_resume_on_the_s3_datastore(tmp_path, tiny_model_path, local_s3):
    import boto3

    env = {**os.environ, "METAFLOW_USER": "grpo-tests", "PYTHONUNBUFFERED": "1", **local_s3.env()}
    out = _kill_and_resume(tmp_path, env, _config(artifact_location=f"s3://{local_s3.bucket}/mlflow"))
    _assert_resumed(tmp_path, out)
    s3 = boto3.client("s3", endpoint_url=local_s3.endpoint, aws_access_key_id=local_s3.access_key,
                      aws_secret_access_key=local_s3.secret_key, region_name="us-east-1")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=local_s3.bucket)
            for o in page.get("Contents", [])]
    assert any(k.startswith("metaflow/mf.checkpoints/") for k in keys), "checkpoints in the bucket"
    assert any(k.startswith("metaflow/mf.models/") for k in keys), "the final policy in the bucket"
    assert any(k.startswith("metaflow/GRPOFlow/") for k in keys), "step artifacts in the bucket"
    assert any(k.startswith("mlflow/") and k.endswith("model.safetensors") for k in keys), "registered model"
    assert not (tmp_path / ".metaflow" / "mf.checkpoints").exists(), "nothing checkpointed locally"
