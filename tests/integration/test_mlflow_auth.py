"""MLflow with authentication, as ``infra/k8s/mlflow.yaml`` runs it: the manifest's own start-up command writes the
basic-auth config (admin password from the environment), ``mlflow server --app-name basic-auth`` serves on
loopback; unauthenticated requests are refused, and the pipeline logs its run with credentials from the
environment only, none of which reaches the run."""

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import requests
import yaml

from grpo_steps.config import REPO_ROOT, validate_config

pytestmark = pytest.mark.slow

ADMIN_PASSWORD = "adm1n-Pa55word-for-tests"


def _manifest_command(db_dir) -> str:
    """The MLflow container's shell command from the manifest, pointed at sqlite files and loopback."""
    docs = list(yaml.safe_load_all((REPO_ROOT / "infra/k8s/mlflow.yaml").read_text()))
    (mlflow,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow"]
    container = mlflow["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "--app-name basic-auth" in container["args"][0] and env["MLFLOW_AUTH_CONFIG_PATH"]
    assert {"MLFLOW_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY", "POSTGRES_PASSWORD"} <= set(env)  # Secrets
    command = re.sub(r"pip install [^&]+&& ", "", container["args"][0])  # the packages are installed here
    command = command.replace("postgresql://mlflow:$POSTGRES_PASSWORD@mlflow-postgres:5432/mlflow_auth",
                              f"sqlite:///{db_dir}/auth.db")
    command = command.replace("postgresql://mlflow:$POSTGRES_PASSWORD@mlflow-postgres:5432/mlflow",
                              f"sqlite:///{db_dir}/mlflow.db")  # the store URI, from MLFLOW_BACKEND_STORE_URI
    command = command.replace("/tmp/basic_auth.ini", f"{db_dir}/basic_auth.ini")
    command = re.sub(r"--artifacts-destination \S+", f"--artifacts-destination {db_dir}/artifacts", command)
    return command.replace("--host 0.0.0.0", "--host 127.0.0.1")


@pytest.fixture
def auth_server(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = _manifest_command(tmp_path).replace("--port 5000", f"--port {port}")
    env = {**os.environ, "MLFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD, "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-csrf-key",
           "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "basic_auth.ini"),
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    log = open(tmp_path / "mlflow.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(["sh", "-c", command], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert proc.poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=30)
        log.close()


def test_mlflow_refuses_anonymous_requests_and_the_run_logs_with_environment_credentials(auth_server, monkeypatch):
    from grpo_steps import tracking

    search = f"{auth_server}/api/2.0/mlflow/experiments/search"
    assert requests.post(search, json={"max_results": 1}, timeout=10).status_code == 401
    assert requests.post(search, json={"max_results": 1}, auth=("admin", "wrong"), timeout=10).status_code == 401
    assert requests.post(search, json={"max_results": 1}, auth=("admin", ADMIN_PASSWORD), timeout=10).ok

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)
    cfg = validate_config({"tracking": {"tracking_uri": auth_server}})
    tracking.check_reachable(cfg.tracking.tracking_uri)  # /health answers without credentials
    run_id = tracking.open_run(cfg, "GRPOFlow/1/start/1")
    run = tracking.client(cfg).get_run(run_id)
    assert run.data.params["tracking.tracking_uri"] == auth_server
    assert ADMIN_PASSWORD not in repr(run.data.params) + repr(run.data.tags)
