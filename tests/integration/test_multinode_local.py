"""The flow with a 2-node ``@parallel`` train gang under DeepSpeed ZeRO-3 on the local runtime (nodes
simulated as processes, one training process each, gloo) on the session's server: one gang, a checkpoint per
node holding that node's own ZeRO-3 partition, and the same per-step loss and
gradient norm as one plain process on the same completions (backend ``recorded``); after node 1's training
process is killed, ``resume`` restores each node's own partition and the losses still match."""

import json
import math
import os
import re
import signal

import pytest

from grpo_steps.config import validate_config
from grpo_steps.data import prepare
from grpo_steps.launch import launch
from grpo_steps.training.job import TrainJob
from tests.integration.flowrun import (
    checkpoint_files,
    flow_config,
    flow_env,
    flow_run_id,
    metric_steps,
    mlflow_runs,
    on_server,
    run_config,
    run_flow,
)

pytestmark = pytest.mark.slow
NODES = 2


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


def test_zero3_gang_matches_one_process_and_a_killed_node_resumes_from_its_own_partition(
        tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    """A 2-node ZeRO-3 gang checkpointing every 2 steps. Node 1's training process is killed after the step-2
    checkpoint; ``resume`` continues both nodes at step 2, each from its own saved partition. Each node's newest
    checkpoint holds only its own partition, and the losses and gradient norms of steps 1-4 (before and after the
    kill) match one plain process on the same completions. On the session's server (evaluation): the ``local``
    provider's replacement of a dead server on ``resume`` is test_resume.py's, for one node (a gang's own local
    server here cost two vLLM starts, ~80 s of a worker)."""
    config, rows = gang_config(tmp_path, tiny_tokenizer, tiny_server, max_steps=4, save_steps=2, retries=0)
    saved_node1 = re.compile(r"\[checkpoint\] saved step=2 node=1 pid=(\d+)")
    killed = []

    def kill_node1_after_checkpoint(line: str) -> None:
        match = saved_node1.search(line)
        if match and not killed:
            os.kill(int(match.group(1)), signal.SIGKILL)  # node 1's training process, by the PID it reported
            killed.append(int(match.group(1)))

    env = flow_env()
    code, out = run_config(tmp_path, env, config, kill_node1_after_checkpoint)
    assert killed, out[-5000:]
    assert code != 0, "the gang should fail when a node's training process is killed"
    assert all(f"saved step=2 node={node}" in out for node in range(NODES))
    code, resumed = run_flow(tmp_path, env, ["resume"])
    assert code == 0, resumed[-8000:]
    origin, run_id = flow_run_id(out), flow_run_id(resumed)
    # each node found its own checkpoint of the killed run, and both trained on to the end
    assert len(re.findall(rf"resuming from step 2 of run {origin}\b", resumed)) == NODES, resumed[-5000:]
    assert all(f"saved step=4 node={node}" in resumed for node in range(NODES))
    for node in range(NODES):
        # ZeRO-3: each node's checkpoint holds its own partition of the parameters and optimizer state
        files = checkpoint_files(tmp_path, env, run_id, node)
        assert any(f.startswith(f"global_step4/zero_pp_rank_{node}_") for f in files), files
        others = [f"zero_pp_rank_{other}_" for other in range(NODES) if other != node]
        assert not any(o in f for o in others for f in files), files
    assert metric_steps(tmp_path, "loss") == [1, 2, 3, 4]  # one continuous history in the reopened run
    single = single_process_history(tmp_path / "single", config, tiny_model_path, rows)
    assert len(single) == 4
    assert_same_steps({metric: logged(tmp_path, metric) for metric in ("loss", "grad_norm")}, single)
