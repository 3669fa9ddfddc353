"""Faults during training: the generation server killed, the S3 server stopped during a checkpoint upload.
In both the run completes with nothing lost: one continuous training history up to max_steps."""

import os
import signal
import threading
import time

import pytest

from grpo_steps.processes import ProcessRef
from grpo_steps.servers import ServerStartError
from tests.integration.flowrun import (
    SAVED,
    SAVING,
    SERVING,
    checkpoint_steps,
    flow_config,
    flow_env,
    flow_run_id,
    metric_steps,
    model_versions,
    on_server,
    run_config,
    s3_keys,
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


@pytest.mark.slow
@pytest.mark.s3
def test_s3_stopped_during_a_checkpoint_upload(tmp_path, tiny_server):
    """The S3 server is down from checkpoint 2 until 10 s after the upload of checkpoint 4 began:
    the upload waits it out (client retries), and every checkpoint reaches the bucket."""
    from grpo_steps.dev import local_s3

    server = local_s3.start(tmp_path / "s3")
    port = int(server.endpoint.rsplit(":", 1)[1])
    holder, events = {"server": server}, {}

    def restart() -> None:
        deadline = time.monotonic() + 60
        while True:  # the port can stay busy for a moment after the stop
            try:
                holder["server"] = local_s3.start(tmp_path / "s3", port=port)
                events["up"] = time.monotonic()
                return
            except (local_s3.S3StartError, ServerStartError):  # ServerStartError: port still busy
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

    def outage(line: str) -> None:
        match = SAVED.search(line)
        if match and int(match.group(1)) == 2 and "down" not in events:
            local_s3.stop(holder["server"])
            events["down"] = time.monotonic()
        match = SAVING.search(line)
        if match and int(match.group(1)) == 4 and "down" in events and "restart" not in events:
            events["restart"] = threading.Timer(10.0, restart)
            events["restart"].start()

    config = on_server(flow_config(train={"max_steps": 6, "save_steps": 2, "save_total_limit": 10, "retries": 0},
                                   registry={"model_name": MODEL_NAME},
                                   tracking={"artifact_location": f"s3://{server.bucket}/mlflow"}), tiny_server)
    env = flow_env(**server.env())
    try:
        code, out = run_config(tmp_path, env, config, outage)
        events["restart"].join()
        assert "up" in events and events["up"] - events["down"] >= 10, events
        assert code == 0, out[-8000:]
        assert metric_steps(tmp_path, "reward") == list(range(1, 7))
        assert len(model_versions(tmp_path, MODEL_NAME)) == 1
        # nothing lost: every checkpoint, the one uploaded across the outage too, is in the bucket
        assert checkpoint_steps(tmp_path, env, flow_run_id(out)) == [2, 4, 6]
        assert any(k.startswith("metaflow/mf.models/") for k in s3_keys(holder["server"])), "final policy"
    finally:
        local_s3.stop(holder["server"])
        local_s3.stop(server)
