"""The whole flow on the tiny HumanEval config (code): real vLLM server, real Metaflow run, real MLflow store, the
task's own rewards in training and evaluation. ~2-3 min. The GSM8K config (math) runs in tests/integration/
test_flow.py, whose one flow run carries these same checks (each whole flow costs minutes in ``make test``)."""

import pytest

from grpo_steps.config import REPO_ROOT, load_config
from tests.integration.flowrun import STEPS, check_task_run, completed_run, config_file, on_server

pytestmark = pytest.mark.slow
TASK_CONFIGS = ["test-humaneval.yaml"]


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

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    check_task_run(cfg, client, run)
    if config.name == "test-humaneval.yaml":  # eval rewards left unset: they follow the configured rewards
        assert (cfg.eval.correctness_reward, cfg.eval.format_reward) == ("code_execution", None)
