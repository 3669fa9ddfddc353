"""A step's first MLflow request waits for an ``http(s)`` tracking server within ``tracking.outage_wait_s``: a server
that comes back in time is waited for; one that does not fails the step with a message naming ``resume``. Real HTTP
on loopback (a ``/health`` responder standing in for the server's health route), no MLflow server needed."""

import http.server
import socket
import threading
import time

import pytest

from grpo_steps import tracking
from grpo_steps.config import validate_config


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):  # keep the test output clean
        pass


def _cfg(port: int, wait_s: float):
    return validate_config({"tracking": {"tracking_uri": f"http://127.0.0.1:{port}", "outage_wait_s": wait_s}})


def test_a_server_that_does_not_come_back_fails_the_step_naming_resume(capsys):
    port = _free_port()  # nothing listens
    with pytest.raises(tracking.TrackingUnreachable) as err:
        tracking.wait_reachable(_cfg(port, 1.5), "register", interval_s=0.2)
    assert (f"MLflow tracking server http://127.0.0.1:{port} did not answer for 1.5 s (tracking.outage_wait_s) "
            "before register: start it again, then `python flows/grpo_flow.py resume` continues from register"
            ) in str(err.value)
    assert "waiting up to 1.5 s (tracking.outage_wait_s)" in capsys.readouterr().out  # said once, at the start


def test_a_server_that_comes_back_within_the_wait_is_waited_for(capsys):
    port, servers = _free_port(), []

    def come_back_later() -> None:
        time.sleep(1.0)  # refused connections until then: nothing listens on the port
        servers.append(http.server.HTTPServer(("127.0.0.1", port), _Health))
        servers[0].serve_forever()

    threading.Thread(target=come_back_later, daemon=True).start()
    try:
        tracking.wait_reachable(_cfg(port, 60), "end", interval_s=0.2)
    finally:
        if servers:
            servers[0].shutdown()
            servers[0].server_close()
    assert "does not answer" in capsys.readouterr().out  # it was down at first, and waited for


def test_a_failed_run_whose_tracking_server_is_away_is_reported_not_raised(capsys):
    """The exit hook of a failed flow run (grpo_steps.tracking.on_flow_error) with the tracking server away past
    ``tracking.outage_wait_s``: it says the MLflow run stays RUNNING until ``resume``, and raises nothing (its own
    traceback would bury the step's failure)."""
    port = _free_port()  # nothing listens
    started = time.monotonic()
    assert tracking.end_failed_run(_cfg(port, 1.0), "run123", "FAILED", ["GRPOFlow/1/train/4"]) is False
    assert time.monotonic() - started < 30  # the configured wait, not MLflow's minutes of retries
    assert (f"[mlflow] run run123 could not be ended FAILED: the tracking server http://127.0.0.1:{port} did not "
            "answer for 1 s (tracking.outage_wait_s); the run shows RUNNING until `python flows/grpo_flow.py resume` "
            "ends it") in capsys.readouterr().out


def test_a_failed_run_is_ended_with_its_status_and_the_failed_tasks(tmp_path, capsys, mlflow_db):
    from mlflow import MlflowClient

    cfg = validate_config({"tracking": {"tracking_uri": mlflow_db}})
    client = MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    run_id = client.create_run(client.create_experiment("failed")).info.run_id
    assert tracking.end_failed_run(cfg, run_id, "FAILED", ["GRPOFlow/1/train/4"]) is True
    assert client.get_run(run_id).info.status == "FAILED"
    assert f"[mlflow] run {run_id} ended FAILED (failed: GRPOFlow/1/train/4)" in capsys.readouterr().out


def test_a_local_store_is_not_waited_for():
    tracking.wait_reachable(validate_config({"tracking": {"tracking_uri": "sqlite:///x.db", "outage_wait_s": 1}}),
                            "end")


def test_metrics_of_a_step_run_again_are_logged_once(tmp_path, mlflow_db):
    """``evaluate`` run again by ``resume`` (the flow killed mid-evaluation) logs each eval metric once."""
    cfg = validate_config({"tracking": {"tracking_uri": mlflow_db}})
    run_id = tracking.open_run(cfg, "GRPOFlow/1/start/1")
    assert tracking.log_metrics_once(cfg, run_id, {"eval/baseline/pass@1": 0.25}) == {"eval/baseline/pass@1": 0.25}
    again = {"eval/baseline/pass@1": 0.25, "eval/trained/pass@1": 0.5}  # the second attempt got further
    assert tracking.log_metrics_once(cfg, run_id, again) == {"eval/trained/pass@1": 0.5}
    history = tracking.client(cfg).get_metric_history(run_id, "eval/baseline/pass_at_1")
    assert [(m.step, m.value) for m in history] == [(0, 0.25)]
