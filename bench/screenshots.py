"""Screenshots of the MLflow UI after a tiny flow run, for the README (``make screenshots``).

Runs the flow on ``configs/test.yaml`` in a scratch directory (or uses ``--workdir`` holding a finished
run's ``mlflow.db``), serves ``mlflow ui`` on 127.0.0.1 and a free port, and saves with headless Chromium
(Debian's ``chromium`` package) into ``docs/images/``:

- ``mlflow-experiment.png``: the experiment's training-runs page (run, status, metrics);
- ``mlflow-run-metrics.png``: the run's model-metrics page (training curves, system metrics);
- ``mlflow-model-version.png``: the registered version's page (description, aliases, tags).

The UI server is stopped by its process group (started here, in a new session) at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "docs" / "images"
WINDOW = "1440,1000"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_tiny_flow(workdir: Path) -> None:
    from tests.integration.flowrun import flow_env, run_flow

    code, out = run_flow(workdir, flow_env(), ["--config", "config", str(REPO / "configs" / "test.yaml"), "run"])
    if code != 0:
        raise SystemExit(f"the tiny flow failed:\n{out[-4000:]}")


def pages(workdir: Path) -> dict[str, str]:
    """UI route of each screenshot, for the newest run and version in ``workdir``'s store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("grpo")
    run = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)[0]
    version = max(client.search_model_versions(f"run_id = '{run.info.run_id}'"), key=lambda v: int(v.version))
    return {
        "mlflow-experiment.png": f"#/experiments/{experiment.experiment_id}/runs",
        "mlflow-run-metrics.png": f"#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/model-metrics",
        "mlflow-model-version.png": f"#/models/{version.name}/versions/{version.version}",
    }


def serve_ui(workdir: Path, port: int) -> subprocess.Popen:
    mlflow = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen([str(mlflow), "ui", "--host", "127.0.0.1", "--port", str(port), "--backend-store-uri",
                             f"sqlite:///{workdir}/mlflow.db"], cwd=workdir, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"mlflow ui exited with {proc.returncode}") from None
            time.sleep(1)
    stop(proc)
    raise SystemExit("mlflow ui did not answer /health within 120 s")


def stop(proc: subprocess.Popen) -> None:
    """Stop the UI server and its workers: the process group this script created for it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def screenshot(chromium: str, url: str, path: Path, budget_ms: int) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={WINDOW}", f"--virtual-time-budget={budget_ms}",
                        f"--screenshot={path}", url], check=True, capture_output=True, timeout=180)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="directory of a finished run (mlflow.db); default: run the "
                        "tiny flow in a scratch directory")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--budget-ms", type=int, default=20000, help="page render time Chromium waits, ms")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        raise SystemExit("headless Chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="grpo-screens-") as scratch:
        workdir = args.workdir or Path(scratch)
        if args.workdir is None:
            run_tiny_flow(workdir)
        routes = pages(workdir.resolve())
        port = free_port()
        ui = serve_ui(workdir.resolve(), port)
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            for name, route in routes.items():
                screenshot(chromium, f"http://127.0.0.1:{port}/{route}", args.out / name, args.budget_ms)
                print(f"saved {args.out / name} ({route})", flush=True)
        finally:
            stop(ui)


if __name__ == "__main__":
    main()
