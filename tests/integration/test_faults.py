"""Faults during training: the generation server killed (here), the S3 server stopped during a checkpoint
upload (tests/integration/test_resume.py, with the S3 datastore's kill and resume). The run completes
with nothing lost: one continuous training history up to max_steps."""

import os
import re
import signal

import pytest

from grpo_steps.processes import ProcessRef
from tests.integration.flowrun import (
    SAVED,
    SAVING,
    SERVING,
    flow_config,
    flow_env,
    metric_steps,
    mlflow_runs,
    model_versions,
    run_config,
    vllm_child,
)

MODEL_NAME = "grpo-fault-test"


@pytest.mark.slow
def test_generation_server_killed_during_training_is_replaced_and_training_continues(tmp_path, tiny_model_path):
    """The ``local`` provider's whole lifecycle in a flow, on two generation replicas behind vLLM's router:
    ``provision_vllm`` starts both and the router; kill -9 of one replica after checkpoint 4 fails the train step
    naming that replica (its push, or a rollout routed to it), ``@retry`` runs it again on a new set of replicas from
    its newest checkpoint (every push verified on both); that attempt's training process is then SIGKILLed from
    outside while it saves checkpoint 6 (as the OOM killer would): the attempt fails saying so, and the next ``@retry``
    continues from the newest checkpoint whose save completed (the rollouts come from a server whose sampler moved on,
    so its losses are not compared here: ``test_multinode_local`` compares them on replayed completions). The run
    finishes and registers, and ``end`` stops the replacement set (no replica or router left behind)."""
    config = flow_config(train={"max_steps": 8, "save_steps": 2, "retries": 2}, registry={"model_name": MODEL_NAME},
                         generation={"server": {"kv_cache_gib": 1, "startup_timeout_s": 300, "replicas": 2}})
    servers, supervisors, killed, trainer_killed, saved = [], [], [], [], set()

    def faults(line: str) -> None:
        if SERVING.search(line):  # the router's supervisor, then each replica's
            pids = [int(pid) for pid in re.findall(r"supervisor_pid=(\d+)", line)]
            servers.append(pids)
            supervisors.extend(ProcessRef.of(pid) for pid in pids)  # alive now: record their create times
        match = SAVED.search(line)
        if match:
            saved.add((int(match.group(2)), int(match.group(1))))  # (training pid, step) of a completed save
        if match and int(match.group(1)) == 4 and not killed:
            child = vllm_child(servers[0][2])  # the second replica
            os.killpg(child, signal.SIGKILL)  # the vLLM server leads its own process group
            killed.append(child)
        match = SAVING.search(line)
        if match and int(match.group(1)) == 6 and killed and not trainer_killed:
            os.kill(int(match.group(2)), signal.SIGKILL)  # the training process, mid-save of checkpoint 6
            trainer_killed.append(int(match.group(2)))

    code, out = run_config(tmp_path, flow_env(), config, faults)
    assert killed and trainer_killed, out[-5000:]
    assert code == 0, out[-8000:]
    assert "is not answering: starting a new one" in out
    assert [len(pids) for pids in servers] == [3, 3], servers  # router + 2 replicas, then their replacement
    assert "generation replica 2/2 http://127.0.0.1:" in out  # the failure names the killed replica
    verified = re.findall(r"\[weight-sync\] version (\d+) verified on 2 replicas: \S+ (\S+), \S+ (\S+)", out)
    assert verified and all(a == b == f"step-{v}" for v, a, b in verified)  # every push verified on both
    assert "resuming from this task's step 4 (retry)" in out  # the newest checkpoint of node 0
    assert "was killed (signal 9), likely out of memory: peak resident memory" in out
    # the kill raced the upload of checkpoint 6: the third attempt starts from 6 if that save completed, else from 4
    newest = 6 if (trainer_killed[0], 6) in saved else 4
    assert out.rsplit("resuming from this task's step", 1)[1].startswith(f" {newest} (retry)"), out[-8000:]
    assert metric_steps(tmp_path, "reward") == list(range(1, 9))  # continuous: none repeated, none missing
    assert metric_steps(tmp_path, "train_runtime") == [8]
    assert len(model_versions(tmp_path, MODEL_NAME)) == 1
    assert not any(s.is_running() for s in supervisors), "a server outlived the run"
    # both replicas served rollouts (the router's counts) and reported their engine metrics, step by step, in MLflow
    from mlflow import MlflowClient

    (run,) = mlflow_runs(tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    for i in (0, 1):
        requests = client.get_metric_history(run.info.run_id, f"router/replica{i}/requests")
        assert sum(m.value for m in requests) > 0, (i, requests)
        assert client.get_metric_history(run.info.run_id, f"engine/replica{i}/requests_running")
