"""Kill -9 the training process after its second checkpoint, then `resume`: training continues at the
checkpoint's step on a re-provisioned server, one continuous MLflow history, one registered version."""

import os
import re
import signal
import subprocess
import sys

import pytest
import yaml

from grpo_steps.config import REPO_ROOT

pytestmark = pytest.mark.slow
FLOW = REPO_ROOT / "flows" / "grpo_flow.py"
SAVED = re.compile(r"\[checkpoint\] saved step=(\d+) node=0 pid=(\d+)")
MAX_STEPS, SAVE_STEPS, KILL_AFTER = 8, 2, 4


def test_kill_then_resume_continues_from_the_checkpoint(tmp_path, tiny_model_path):
    from metaflow import Flow, namespace
    from mlflow import MlflowClient

    config = yaml.safe_load((REPO_ROOT / "configs" / "test.yaml").read_text())
    config["train"].update(max_steps=MAX_STEPS, save_steps=SAVE_STEPS)
    config["registry"]["model_name"] = "grpo-resume-test"
    (tmp_path / "resume.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "METAFLOW_USER": "grpo-tests", "PYTHONUNBUFFERED": "1"}

    first = subprocess.Popen([sys.executable, str(FLOW), "--config", "config", "resume.yaml", "run"], cwd=tmp_path,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed_step, log = None, []
    for line in first.stdout:
        log.append(line)
        match = SAVED.search(line)
        if match and int(match.group(1)) == KILL_AFTER:
            os.kill(int(match.group(2)), signal.SIGKILL)  # the training process, by the PID it reported
            killed_step = KILL_AFTER
            break
    log.append(first.communicate(timeout=600)[0])
    assert killed_step == KILL_AFTER, "".join(log)[-5000:]
    assert first.returncode != 0, "the run should fail when its training process is killed"

    second = subprocess.run([sys.executable, str(FLOW), "resume"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=1200)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-6000:]
    assert f"resuming from step {KILL_AFTER}" in out
    assert "belongs to an earlier run or is not answering: starting a new one" in out

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        namespace(None)
        run = Flow("GRPOFlow").latest_run
        assert run.successful and run.data.eval_report["trained"]["metrics"]
        mlflow_run_id = run.data.mlflow_run_id
    finally:
        os.chdir(cwd)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    for metric in ("reward", "loss"):
        steps = [m.step for m in client.get_metric_history(mlflow_run_id, metric)]
        assert steps == list(range(1, MAX_STEPS + 1)), (metric, steps)  # continuous: no gap, no duplicate
    # the resumed trainer ran only the steps after the checkpoint
    assert [m.step for m in client.get_metric_history(mlflow_run_id, "train_runtime")] == [MAX_STEPS]
    assert len(client.search_model_versions("name = 'grpo-resume-test'")) == 1
