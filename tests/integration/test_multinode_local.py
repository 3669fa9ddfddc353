"""The flow with a 2-node ``@parallel`` train gang on the local runtime (nodes simulated as processes):
one DDP gang over gloo, one generation server kept by both nodes, the join merges cleanly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo_steps.config import REPO_ROOT

pytestmark = pytest.mark.slow
FLOW = REPO_ROOT / "flows" / "grpo_flow.py"


def test_two_simulated_nodes_train_as_one_gang(tmp_path, tiny_model_path):
    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["generation"]["backend"] = "hf"  # rollouts in the trainer; the server serves evaluation
    config["train"].update(num_nodes=2, per_device_train_batch_size=4, max_steps=2, save_steps=2)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    # Metaflow starts the other nodes with `python` from PATH: put this interpreter's first
    env = {**os.environ, "METAFLOW_USER": "grpo-tests", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, str(FLOW), "--config", "config", "cfg.yaml", "run"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "belongs to an earlier run" not in log  # node 1 kept node 0's server
    assert "saved step=2 node=0" in log and "saved step=2 node=1" in log
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        from metaflow import Flow, namespace

        namespace(None)
        run = Flow("GRPOFlow").latest_run
        assert run.successful
        assert len(list(run["train"])) == 2  # a task per node
    finally:
        os.chdir(cwd)
