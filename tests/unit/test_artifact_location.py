"""``tracking.artifact_location`` applies when the experiment is created; once the experiment exists with another
location, MLflow keeps the old one and would store the run's models there without a word. ``start`` refuses it
(issue 69), against a real MLflow store (sqlite)."""

import pytest

from grpo_steps import tracking
from grpo_steps.config import ConfigError


@pytest.fixture
def client(mlflow_db):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=mlflow_db)


def test_another_artifact_location_of_an_existing_experiment_is_refused(client, tmp_path):
    first = tracking.get_or_create_experiment(client, "grpo", "s3://grpo/mlflow")
    assert client.get_experiment(first).artifact_location == "s3://grpo/mlflow"
    assert tracking.get_or_create_experiment(client, "grpo", "s3://grpo/mlflow/") == first  # the same place
    assert tracking.get_or_create_experiment(client, "grpo", None) == first  # no wish: the experiment's own
    with pytest.raises(ConfigError, match=r"artifact_location 's3://other/mlflow': the experiment 'grpo' keeps its "
                                          r"artifacts at 's3://grpo/mlflow'.*new tracking.experiment_name"):
        tracking.get_or_create_experiment(client, "grpo", "s3://other/mlflow")
    local = tracking.get_or_create_experiment(client, "local", str(tmp_path / "artifacts"))
    assert tracking.get_or_create_experiment(client, "local", (tmp_path / "artifacts").as_uri()) == local
    with pytest.raises(ConfigError, match="experiment 'local' keeps its artifacts at"):
        tracking.get_or_create_experiment(client, "local", str(tmp_path / "elsewhere"))
