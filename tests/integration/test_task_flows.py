"""The whole flow on the tiny task configs (GSM8K math, HumanEval code): real vLLM server, real
Metaflow run, real MLflow store, the task's own rewards in training and evaluation. ~2-3 min each."""

import pytest

from grpo_steps.config import REPO_ROOT, load_config
from tests.integration.flowrun import STEPS, completed_run, config_file, on_server

pytestmark = pytest.mark.slow
TASK_CONFIGS = ["test-gsm8k.yaml", "test-humaneval.yaml"]


@pytest.fixture(scope="module", params=TASK_CONFIGS)
def task_run(request, tmp_path_factory, tiny_server):
    """Run the flow once per task config in a fresh working directory, on the session's generation
    server (provider ``external``); yields (config path, workdir, Run)."""
    import yaml

    config = REPO_ROOT / "configs" / request.param
    workdir = tmp_path_factory.mktemp(config.stem)
    path = config_file(workdir, on_server(yaml.safe_load(config.read_text()), tiny_server))
    with completed_run(workdir, path) as (run, _):
        yield config, workdir, run


def test_task_flow_end_to_end(task_run):
    from mlflow import MlflowClient

    config, workdir, run = task_run
    cfg = load_config(config)
    assert run.successful
    assert {step.id for step in run} == STEPS

    # the prepared rows carry the task's reward columns
    train_rows = run["prepare_data"].task.data.train_rows
    if cfg.data.source == "humaneval":
        assert all(row["test"] and row["entry_point"] and row["answer"] is None for row in train_rows)
    else:
        assert all(row["answer"] for row in train_rows)

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    mlflow_run = client.get_run(run.data.mlflow_run_id)
    for spec in cfg.rewards:  # each reward of the task logged at every training step
        metric = f"rewards/{spec.name}/mean"
        steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, metric)]
        assert steps == list(range(1, cfg.train.max_steps + 1)), metric
    if config.name == "test-humaneval.yaml":  # eval rewards left unset: they follow the configured rewards
        assert (cfg.eval.correctness_reward, cfg.eval.format_reward) == ("code_execution", None)
    expected = ["accuracy", "pass_at_1", "pass_at_2", "reward", f"reward/{cfg.eval.correctness_reward}"]
    expected += ["format_rate"] if cfg.eval.format_reward else []
    for label in ("baseline", "trained"):
        for metric in expected:
            assert f"eval/{label}/{metric}" in mlflow_run.data.metrics, metric
    report = run["evaluate"].task.data.eval_report
    for label in ("baseline", "trained"):  # the correctness reward applied to every eval completion
        assert all(sample[cfg.eval.correctness_reward] is not None for sample in report[label]["samples"])

    versions = client.search_model_versions(f"name = '{cfg.registry.model_name}'")
    assert len(versions) == 1 and versions[0].run_id == mlflow_run.info.run_id
