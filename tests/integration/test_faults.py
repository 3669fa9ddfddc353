"""Faults during training: the generation server killed (here), the S3 server stopped during a checkpoint
upload (tests/integration/test_resume.py, with the S3 datastore's kill and resume). The run completes
with nothing lost: one continuous training history up to max_steps."""

import os
import signal

import pytest

from grpo_steps.processes import ProcessRef
from tests.integration.flowrun import (
    SAVED,
    SERVING,
    flow_config,
    flow_env,
    metric_steps,
    model_versions,
    run_config,
    vllm_child,
)

MODEL_NAME = "grpo-fault-test"


@pytest.mark.slow
def test_generation_server_killed_during_training_is_replaced_and_training_continues(tmp_path, tiny_model_path):
    """The ``local`` provider's whole lifecycle in a flow: ``provision_vllm`` starts a server; kill -9 of it
    after checkpoint 4 fails the train step, ``@retry`` runs it again on a new server from its newest
    checkpoint, the run finishes, and ``end`` stops the replacement (no server left behind)."""
    config = flow_config(train={"max_steps": 8, "save_steps": 2, "retries": 1}, registry={"model_name": MODEL_NAME})
    servers, supervisors, killed = [], [], []

    def kill_server_after_checkpoint(line: str) -> None:
        if match := SERVING.search(line):
            servers.append(int(match.group(2)))
            supervisors.append(ProcessRef.of(int(match.group(2))))  # alive now: record its create time
        match = SAVED.search(line)
        if match and int(match.group(1)) == 4 and not killed:
            child = vllm_child(servers[0])
            os.killpg(child, signal.SIGKILL)  # the vLLM server leads its own process group
            killed.append(child)

    code, out = run_config(tmp_path, flow_env(), config, kill_server_after_checkpoint)
    assert killed, out[-5000:]
    assert code == 0, out[-8000:]
    assert "is not answering: starting a new one" in out
    assert len(servers) == 2, servers  # the first server, then its replacement
    assert "resuming from this task's step 4 (retry)" in out  # the newest checkpoint of node 0
    assert metric_steps(tmp_path, "reward") == list(range(1, 9))  # continuous: none repeated, none missing
    assert metric_steps(tmp_path, "train_runtime") == [8]
    assert len(model_versions(tmp_path, MODEL_NAME)) == 1
    assert not any(s.is_running() for s in supervisors), "a server outlived the run"
