"""The flow with a 2-node ``@parallel`` train gang under DeepSpeed ZeRO-3 on the local runtime (nodes
simulated as processes, one training process each, gloo) on the session's server, with the S3 datastore and MLflow's
artifacts on a local S3 server (as configs/multinode.yaml runs on a cluster): one gang, a checkpoint per
node holding that node's own ZeRO-3 partition, and the same per-step loss and
gradient norm as one plain process on the same completions (backend ``recorded``); after node 1's training
process is killed, ``resume`` restores each node's own partition from the bucket and the losses still match, the
next checkpoint's uploads waiting out an S3 outage. One flow run for both: each whole flow costs minutes in
``make test``."""

import json
import math
import os
import re
import signal
import threading
import time

import pytest

from grpo_steps.config import validate_config
from grpo_steps.data import prepare
from grpo_steps.launch import launch
from grpo_steps.processes import PortInUseError, wait_until
from grpo_steps.steps import POLICY_CHECKPOINT
from grpo_steps.training.job import TrainJob
from tests.integration.flowrun import (
    checkpoint_files,
    flow_config,
    flow_env,
    flow_run_id,
    metric_steps,
    mlflow_runs,
    model_versions,
    on_server,
    run_config,
    run_flow,
    s3_keys,
)

pytestmark = [pytest.mark.slow, pytest.mark.s3]
NODES = 2
MODEL_NAME = "grpo-gang-test"


def recorded_file(path, rows) -> str:
    """Four completions per train question with different rewards (right answer with and without the
    format line, a wrong answer, no answer), so every group has a non-zero advantage."""
    path.write_text("".join(json.dumps({"question": r["prompt"][-1]["content"], "completions": [
        f"Answer: {r['answer']}", str(r["answer"]), "Answer: 1000", "I do not know"]}) + "\n" for r in rows))
    return str(path)


def single_process_history(workdir, config: dict, model_path: str, rows) -> list[dict]:
    """Per-step logs of the same training on one plain process (no DeepSpeed, no Metaflow)."""
    batch = config["train"]["per_device_train_batch_size"] * NODES  # the same global batch
    single = {**config, "train": {**config["train"], "num_nodes": 1, "deepspeed": False,
                                  "per_device_train_batch_size": batch}}
    workdir.mkdir()
    (workdir / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    launch(TrainJob(config=validate_config(single), model_path=model_path, train_file=str(workdir / "train.jsonl"),
                    output_dir=str(workdir)))
    return [h for h in json.loads((workdir / "log_history.json").read_text()) if "loss" in h]


def gang_config(workdir, tokenizer, server, **train) -> tuple[dict, list[dict]]:
    """configs/test.yaml as a ZeRO-3 gang of NODES nodes on recorded completions, evaluated on ``server``; and the
    train rows."""
    config = on_server(flow_config(train={"num_nodes": NODES, "deepspeed": True,
                                          "per_device_train_batch_size": 8 // NODES, **train}), server)
    rows = prepare(validate_config(config).data, tokenizer).train
    config["generation"].update(backend="recorded", recorded_file=recorded_file(workdir / "recorded.jsonl", rows))
    return config, rows


def logged(workdir, metric: str) -> list[float]:
    """Values of ``metric`` in the flow's MLflow run, by step."""
    from mlflow import MlflowClient

    (run,) = mlflow_runs(workdir)
    history = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db").get_metric_history(run.info.run_id, metric)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def assert_same_steps(gang: dict[str, list[float]], single: list[dict]) -> None:
    assert len(single) == len(gang["loss"]) == len(gang["grad_norm"])
    assert single[0]["grad_norm"] > 0 and single[0]["loss"] != 0  # a real gradient, not a zero-advantage batch
    for step, ref in enumerate(single):  # later steps also compare the updates before them
        assert math.isclose(gang["loss"][step], ref["loss"], rel_tol=1e-4, abs_tol=1e-6), (step, gang, single)
        assert math.isclose(gang["grad_norm"][step], ref["grad_norm"], rel_tol=1e-4), (step, gang, single)


class S3Outage:
    """Stops the local S3 server at the resumed run's step-3 line and starts it again, on the same port and data, 10 s
    after the first node began uploading checkpoint 4 (so both nodes' uploads have to wait it out)."""

    def __init__(self, data_dir):
        from grpo_steps.dev import local_s3

        self.data_dir, self.server, self.events = data_dir, local_s3.start(data_dir), {}

    def __call__(self, line: str) -> None:
        from grpo_steps.dev import local_s3

        if "[train] step 3/" in line and "down" not in self.events:
            local_s3.stop(self.server)
            self.events["down"] = time.monotonic()
        if "[checkpoint] saving step=4 " in line and "down" in self.events and "restart" not in self.events:
            self.events["restart"] = threading.Timer(10.0, self._restart)
            self.events["restart"].start()

    def _restart(self) -> None:
        port = int(self.server.endpoint.rsplit(":", 1)[1])
        assert wait_until(lambda: self._try_start(port), timeout_s=60, interval_s=1.0), "S3 did not come back"
        self.events["up"] = time.monotonic()

    def _try_start(self, port: int) -> bool:
        from grpo_steps.dev import local_s3

        try:  # the port can stay busy for a moment after the stop
            self.server = local_s3.start(self.data_dir, port=port)
        except (local_s3.S3StartError, PortInUseError):
            return False
        return True


def test_zero3_gang_matches_one_process_and_a_killed_node_resumes_from_its_own_partition(
        tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    """A 2-node ZeRO-3 gang checkpointing every 2 steps to the S3 datastore. Node 1's training process is killed
    after the step-2 checkpoint; ``resume`` continues both nodes at step 2, each from its own saved partition, and
    S3 stops at step 3 until 10 s into the step-4 uploads. Each node's newest checkpoint holds only its own
    partition, the losses and gradient norms of steps 1-4 (before and after the kill) match one plain process on the
    same completions, and the checkpoints, the step artifacts and the registered model are in the bucket. On the
    session's server (evaluation): the ``local`` provider's replacement of a dead server on ``resume`` is
    test_resume.py's, for one node (a gang's own local server here cost two vLLM starts, ~80 s of a worker)."""
    from grpo_steps.dev import local_s3

    config, rows = gang_config(tmp_path, tiny_tokenizer, tiny_server, max_steps=4, save_steps=2, retries=0)
    outage = S3Outage(tmp_path / "s3")
    config.setdefault("tracking", {})["artifact_location"] = f"s3://{outage.server.bucket}/mlflow"
    config.setdefault("registry", {})["model_name"] = MODEL_NAME
    saved_node1 = re.compile(r"\[checkpoint\] saved step=2 node=1 pid=(\d+)")
    killed = []

    def kill_node1_after_checkpoint(line: str) -> None:
        match = saved_node1.search(line)
        if match and not killed:
            os.kill(int(match.group(1)), signal.SIGKILL)  # node 1's training process, by the PID it reported
            killed.append(int(match.group(1)))

    statuses = []  # the MLflow run's status while the resumed run trains

    def outage_and_status(line: str) -> None:
        outage(line)
        if "[train] step 3/" in line and not statuses:
            statuses.append(mlflow_runs(tmp_path)[0].info.status)

    env = flow_env(**outage.server.env())
    try:
        code, out = run_config(tmp_path, env, config, kill_node1_after_checkpoint)
        assert killed, out[-5000:]
        assert code != 0, "the gang should fail when a node's training process is killed"
        assert all(f"saved step=2 node={node}" in out for node in range(NODES))
        assert mlflow_runs(tmp_path)[0].info.status == "FAILED"  # the exit hook ended it: train failed
        code, resumed = run_flow(tmp_path, env, ["resume"], outage_and_status)
        assert code == 0, resumed[-8000:]
        assert "restart" in outage.events, outage.events  # the outage met the step-4 uploads
        outage.events["restart"].join()
        keys = s3_keys(outage.server)
        origin, run_id = flow_run_id(out), flow_run_id(resumed)
        # each node found its own checkpoint of the killed run in the bucket, and both trained on to the end, their
        # step-4 uploads waiting out the outage
        assert outage.events["up"] - outage.events["down"] >= 10, outage.events
        assert len(re.findall(rf"resuming from step 2 of run {origin}\b", resumed)) == NODES, resumed[-5000:]
        assert all(f"saved step=4 node={node}" in resumed for node in range(NODES))
        for node in range(NODES):
            # ZeRO-3: each node's checkpoint holds its own partition of the parameters and optimizer state
            files = checkpoint_files(tmp_path, env, run_id, node)
            assert any(f.startswith(f"global_step4/zero_pp_rank_{node}_") for f in files), files
            others = [f"zero_pp_rank_{other}_" for other in range(NODES) if other != node]
            assert not any(o in f for o in others for f in files), files
    finally:
        if "restart" in outage.events:  # its timer starts a server: never one after the stop below
            outage.events["restart"].join()
        local_s3.stop(outage.server)
    assert statuses == ["RUNNING"]  # resume set the reopened MLflow run back to RUNNING
    (run,) = mlflow_runs(tmp_path)
    assert run.info.status == "FINISHED"
    assert metric_steps(tmp_path, "loss") == [1, 2, 3, 4]  # one continuous history in the reopened run
    (version,) = model_versions(tmp_path, MODEL_NAME)
    assert version.run_id == run.info.run_id
    assert any(k.startswith("metaflow/mf.checkpoints/") for k in keys), "checkpoints in the bucket"
    assert any(k.startswith("metaflow/mf.checkpoints/") and f".{POLICY_CHECKPOINT}." in k for k in keys), \
        "the final policy in the bucket"
    assert any(k.startswith("metaflow/GRPOFlow/") for k in keys), "step artifacts in the bucket"
    assert any(k.startswith("mlflow/") and k.endswith("model.safetensors") for k in keys), "registered model"
    assert not (tmp_path / ".metaflow" / "mf.checkpoints").exists(), "nothing checkpointed locally"
    single = single_process_history(tmp_path / "single", config, tiny_model_path, rows)
    assert len(single) == 4
    assert_same_steps({metric: logged(tmp_path, metric) for metric in ("loss", "grad_norm")}, single)
