"""A real ``mlflow server`` on loopback stopped mid-logging for longer than its client's HTTP retries, then started
again on the same store: the training side's metric queue (grpo_steps.tracking.MetricQueue, the path of
MLflowMetricsCallback) never blocks a step, reports the backlog clearly if the server stays away, and delivers every
step once the server is back."""

import os
import socket
import subprocess
import sys

import pytest
import requests

from grpo_steps.processes import wait_until
from grpo_steps.tracking import MetricQueue, TrackingBacklog

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    """``mlflow server`` on 127.0.0.1:``port`` over a sqlite store in ``workdir``, started and stopped by its PID
    (its own process group: the server's workers go with it)."""

    def __init__(self, workdir, port: int) -> None:
        self.workdir, self.port, self.proc = workdir, port, None
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.workdir}/mlflow.db",
               "--artifacts-destination", str(self.workdir / "artifacts"), "--workers", "1"]
        self.log = open(self.workdir / "mlflow.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

        def healthy() -> bool:
            assert self.proc.poll() is None, (self.workdir / "mlflow.log").read_text()[-3000:]
            try:
                return requests.get(f"{self.url}/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        assert wait_until(healthy, timeout_s=180, interval_s=1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=60)
        self.log.close()


@pytest.fixture
def mlflow_server(tmp_path):
    server = _Server(tmp_path, _free_port())
    server.start()
    yield server
    server.stop()


def test_metrics_logged_while_the_server_is_down_reach_the_run_after_it_restarts(mlflow_server, monkeypatch):
    from mlflow import MlflowClient

    # the client gives up on a request after one retry and 5 s (MLflow's defaults retry for minutes): the outage
    # below outlasts the client's own retries several times over
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    client = MlflowClient(tracking_uri=mlflow_server.url)
    run_id = client.create_run(client.create_experiment("outage")).info.run_id
    queue = MetricQueue(client, run_id, retry_s=0.5)
    for step in (1, 2, 3):
        queue.log({"reward": float(step), "loss": -float(step)}, step)
    queue.flush(timeout_s=60)

    mlflow_server.stop()
    for step in (4, 5, 6):  # training goes on: each call only queues
        queue.log({"reward": float(step), "loss": -float(step)}, step)
    assert wait_until(lambda: queue.failing_since is not None, timeout_s=120)  # the sender met the outage
    with pytest.raises(TrackingBacklog) as err:
        queue.flush(timeout_s=1)
    assert "6 metric points (steps 4..6) did not reach the MLflow tracking server within " \
           "tracking.outage_wait_s=1 s" in str(err.value)
    assert "`resume`" in str(err.value)

    mlflow_server.start()  # the same port and store, as a restarted deployment
    queue.close(timeout_s=120)
    for key in ("reward", "loss"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        sign = 1 if key == "reward" else -1
        assert history == [(step, sign * float(step)) for step in range(1, 7)], (key, history)  # each step once
