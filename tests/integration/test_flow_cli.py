"""The flow's command line rejects bad configs before any step runs (seconds, no server)."""

import os
import subprocess
import sys

import pytest
import yaml

from grpo_steps.config import REPO_ROOT

FLOW = REPO_ROOT / "flows" / "grpo_flow.py"


def _run_flow(tmp_path, config: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "METAFLOW_USER": "grpo-tests"}
    return subprocess.run([sys.executable, str(FLOW), "--config", "config", str(path), "run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("config", "message"), [
    ({"train": {"max_stepz": 3}}, "train.max_stepz: unknown key"),
    ({"train": {"max_steps": "ten"}}, "train.max_steps"),
    ({"rewards": [{"name": "no_such_reward"}]}, "unknown reward 'no_such_reward'"),
])
def test_bad_config_stops_the_flow_with_the_reason(tmp_path, config, message):
    proc = _run_flow(tmp_path, config)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
    assert not (tmp_path / "mlflow.db").exists()  # nothing ran, nothing was written


@pytest.mark.slow
def test_a_recorded_file_without_a_train_question_stops_the_flow_before_the_server(tmp_path, tiny_model_path):
    (tmp_path / "recorded.jsonl").write_text('{"question": "not a train question", "completions": ["a", "b"]}\n')
    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["generation"].update(backend="recorded", recorded_file=str(tmp_path / "recorded.jsonl"))
    proc = _run_flow(tmp_path, config)
    assert proc.returncode != 0
    assert "generation.recorded_file has no completions for the question" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr  # a refusal prints its message alone
    assert "provision_vllm" not in proc.stdout + proc.stderr  # failed in prepare_data: no server was started


@pytest.mark.slow
def test_run_from_flows_as_root_without_a_user_name_reaches_start_and_names_a_model_without_weights(tmp_path):
    """``python grpo_flow.py run`` from ``flows/``, as a container runs it: root, no METAFLOW_USER. Metaflow gets the
    flow's default user name (it would stop with "could not determine your user name"), and ``start`` refuses a
    model directory that holds no model, naming what is missing."""
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "README.md").write_text("weights come later\n")
    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["model"]["name_or_path"] = str(model)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("METAFLOW_USER", "SUDO_USER", "USERNAME")}
    env["USER"] = "root"
    proc = subprocess.run([sys.executable, "grpo_flow.py", "--config", "config", str(path), "run"],
                          cwd=FLOW.parent, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "could not determine your user name" not in out
    assert "Step start" in out or "start" in out.split("Workflow starting")[-1]  # the run began: a user was found
    assert f"model.name_or_path {str(model)!r} holds no usable model: missing config.json; tokenizer files" in out
    assert "weights (" in out and "safetensors or pytorch_model" in out  # Metaflow's log drops the asterisks
    assert "prepare_data" not in out  # refused in start, before any data or server
