"""grpo_steps.tracking.TrackingQueue, the training side's path to MLflow (metrics, eval-during curves, completions
tables): each step and each table reaches the run once, a table the run holds already is not appended again, and a
tracking server that does not answer fills the backlog, which ``flush`` reports with what to do. A real tracking
server stopped mid-training and started again, under the whole flow: tests/integration/test_flow.py."""

import json
import socket

import pytest

from grpo_steps.processes import wait_until
from grpo_steps.tracking import TrackingBacklog, TrackingQueue


def _table(step: int) -> dict[str, list]:
    return {"completion": [f"step {step} a", f"step {step} b"], "reward": [1.0, 0.0]}


def test_every_step_and_table_once_and_a_held_table_not_appended_again(tmp_path, mlflow_db):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_db)
    run_id = client.create_run(client.create_experiment("q", artifact_location=str(tmp_path / "art"))).info.run_id
    queue = TrackingQueue(client, run_id, retry_s=0.1)
    for step in (1, 2):
        queue.log({"reward": float(step), "loss": -float(step)}, step)
    queue.log_table(_table(2), "completions/step_000002.json")
    assert queue.settle(timeout_s=60) and not queue.pending  # what a checkpoint save waits for: all sent
    queue.flush(timeout_s=60)
    queue.log({"reward": 3.0, "loss": -3.0}, 3)
    queue.log_table(_table(2), "completions/step_000002.json")  # as a resumed attempt would: the run holds it
    queue.log_table(_table(3), "completions/step_000003.json")
    queue.close(timeout_s=60)
    queue.log({"reward": 4.0}, 4)  # after close (a late callback): sent at once
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "reward")) == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [1, 2, 3]
    for step in (2, 3):
        table = json.loads((tmp_path / "art" / run_id / "artifacts" / f"completions/step_{step:06d}.json").read_text())
        assert [row[0] for row in table["data"]] == _table(step)["completion"], step  # its rows, once


def test_a_server_that_does_not_answer_fills_the_backlog_and_flush_says_what_to_do(monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = TrackingQueue(MlflowClient(tracking_uri=f"http://127.0.0.1:{port}"), "0" * 32, retry_s=0.2)
    for step in (4, 5, 6):  # each call only queues
        queue.log({"reward": float(step), "loss": -float(step)}, step)
    queue.log_table(_table(5), "completions/step_000005.json")
    assert wait_until(lambda: queue.failing_since is not None, timeout_s=60)  # the sender met the outage
    assert queue.settle(timeout_s=5) is False  # the points stay queued while the server fails
    with pytest.raises(TrackingBacklog) as err:
        queue.close(timeout_s=1)
    assert str(err.value).startswith("6 metric points (steps 4..6) and 1 tables did not reach the MLflow tracking "
                                     "server within tracking.outage_wait_s=1 s: start it again")
    assert "`resume`" in str(err.value)
    assert not queue.thread.is_alive() or wait_until(lambda: not queue.thread.is_alive(), timeout_s=10)


def test_a_refusal_for_good_is_dropped_not_retried_forever(tmp_path, mlflow_db):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_db)
    queue = TrackingQueue(client, "f" * 32, retry_s=0.1)  # a run the server does not have (HTTP 404)
    queue.log({"reward": 1.0}, 1)
    queue.close(timeout_s=30)  # on main: retried every 0.1 s until close gave up (TrackingBacklog)
    assert queue.dropped == 1 and queue.pending == []


def test_the_backlog_is_bounded(monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = TrackingQueue(MlflowClient(tracking_uri=f"http://127.0.0.1:{port}"), "0" * 32, retry_s=0.2, max_pending=10)
    for step in range(25):
        queue.log({"reward": float(step)}, step)
    queue.log_table(_table(25), "completions/step_000025.json")
    assert len(queue.pending) <= 10 and queue.dropped == 16  # the oldest points went; the table stays
    assert queue.pending[0].step == 16
    with pytest.raises(TrackingBacklog):
        queue.close(timeout_s=0.5)
