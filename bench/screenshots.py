"""Screenshots of the MLflow UI after two tiny flow runs in a row, for the README and docs/continual.md
(``make screenshots``).

Runs the flow on ``configs/test.yaml`` in a scratch directory, then again from the registry's champion
(``models:/<registry.model_name>@champion``, ``data.skip_seen``: docs/continual.md's loop), so the second version
names the first as its parent; or uses ``--workdir`` holding finished runs' ``mlflow.db``. Serves ``mlflow ui`` on
127.0.0.1 and a free port, and saves with headless Chromium (Debian's ``chromium`` package, driven over the DevTools
protocol on loopback) into ``docs/images/``, for the newest run that registered a version:

- ``mlflow-experiment.png``: the experiment's training-runs page (run, status, metrics);
- ``mlflow-run-overview.png``: the run's Overview, its description first (start, task, model, held-out gain, gate,
  links);
- ``mlflow-run-metrics.png``: the run's model-metrics page, charts filtered to the rewards;
- ``mlflow-model-version.png``: the registered version's page (its chain ``v1 <- v2`` first, description, aliases,
  tags);
- ``mlflow-registered-model.png``: the registered model's page (the table of pass@1 per version with its parent,
  the rows it added and its aliases; then the versions);
- ``mlflow-episode-trace.png``: one game episode's trace (:mod:`grpo_steps.evaluation.traces`: a span per turn with
  the observation, the action, the reward and the tokens), in the run's experiment. The episode is a real TextArena
  GuessTheNumber-v0 game (seed 7) played by a scripted binary search on the game's feedback, standing in for the
  policy (no model runs), traced as evaluation traces a sampled episode (:func:`log_episode_trace`).

``--trace-only`` takes the trace page alone, in a scratch store (no flow run).

The UI server is stopped by its process group (started here, in a new session) at the end.
"""

from __future__ import annotations

import argparse
import base64
import json
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_tiny_flow(workdir: Path, config: Path) -> None:
    from tests.integration.flowrun import flow_env, run_flow

    code, out = run_flow(workdir, flow_env(GRPO_CACHE_DIR=str(workdir / "cache")),
                         ["--config", "config", str(config.resolve()), "run"])
    if code != 0:
        raise SystemExit(f"the tiny flow failed:\n{out[-4000:]}")


def run_from_champion(workdir: Path, config: Path) -> None:
    """A second tiny run from ``models:/<registry.model_name>@champion`` on rows new to its chain. The gate cannot
    pass on a random tiny policy, so ``champion`` is first moved to the newest version as a reviewer would
    (docs/continual.md, step 1)."""
    import yaml
    from mlflow import MlflowClient

    settings = yaml.safe_load(config.read_text())
    name = settings.get("registry", {}).get("model_name", "grpo-policy")
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    if "champion" not in client.get_registered_model(name).aliases:
        newest = max(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
        client.set_registered_model_alias(name, "champion", str(newest))
        print(f"champion moved to version {newest} by hand (the gate held)", flush=True)
    settings["model"] = {**settings.get("model", {}), "name_or_path": f"models:/{name}@champion"}
    settings["data"] = {**settings.get("data", {}), "skip_seen": True}
    second = workdir / "from-champion.yaml"
    second.write_text(yaml.safe_dump(settings))
    run_tiny_flow(workdir, second)


TRACE_PNG = "mlflow-episode-trace.png"
TRACE_SPAN = "turn 2"
"""The span the trace screenshot shows: the policy's second move, read from the game's answer to its first."""


def newest_run(workdir: Path) -> str:
    """The id of the newest run of experiment ``grpo`` in ``workdir``'s store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("grpo")
    return client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"],
                              max_results=1)[0].info.run_id


def pages(workdir: Path) -> dict[str, str]:
    """UI route of each screenshot, for the newest run that registered a version in ``workdir``'s store (a later
    run of a chain may have ended with no new rows, registering nothing)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("grpo")
    for run in client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"]):
        versions = client.search_model_versions(f"run_id = '{run.info.run_id}'")
        if versions:
            break
    else:
        raise SystemExit(f"no run in {workdir}/mlflow.db registered a version")
    version = max(versions, key=lambda v: int(v.version))
    return {
        # MLflow 3.17's UI opens experiments in its GenAI or Model-training mode by a switch kept per browser
        # (default GenAI); the URL parameter picks Model training
        "mlflow-experiment.png": f"#/experiments/{experiment.experiment_id}?workflowType=machine_learning",
        # the run's Overview: its description (written at end), params, metrics, tags
        "mlflow-run-overview.png": f"#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"
                                   "?workflowType=machine_learning",
        "mlflow-run-metrics.png": f"#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}/model-metrics"
                                  "?workflowType=machine_learning",
        "mlflow-model-version.png": f"#/models/{version.name}/versions/{version.version}",
        "mlflow-registered-model.png": f"#/models/{version.name}",
    }


TRACE_SEED = 7
"""The GuessTheNumber-v0 game of the trace screenshot."""


def log_episode_trace(workdir: Path, run_id: str | None = None) -> dict[str, str]:
    """Play one TextArena GuessTheNumber-v0 game (:data:`TRACE_SEED`) by binary search on its feedback, in the
    pipeline's environment worker, and log its trace with :mod:`grpo_steps.evaluation.traces` into ``workdir``'s
    store, linked to ``run_id`` (default: a new run ``episode-trace`` of experiment ``grpo``). Returns the trace
    page's route."""
    from mlflow import MlflowClient
    from transformers import AutoTokenizer

    from grpo_steps.config import validate_config
    from grpo_steps.dev.tiny_model import TINY
    from grpo_steps.evaluation.episodes import Episode
    from grpo_steps.evaluation.traces import episode_traces, log_traces
    from grpo_steps.models import prepare_embedded
    from grpo_steps.tools.environments import environment_factories
    from grpo_steps.tools.games import TEXTARENA

    uri = f"sqlite:///{workdir}/mlflow.db"
    cfg = validate_config({"tracking": {"tracking_uri": uri}, "eval": {"num_traces": 1}})
    client = MlflowClient(tracking_uri=uri)
    if run_id is None:
        experiment = client.get_experiment_by_name("grpo")
        experiment_id = experiment.experiment_id if experiment else client.create_experiment("grpo")
        run_id = client.create_run(experiment_id, run_name="episode-trace").info.run_id
        client.set_terminated(run_id)
    tokenizer = AutoTokenizer.from_pretrained(prepare_embedded(TINY))  # token counts of the turns (a local build)
    (factory,) = environment_factories(TEXTARENA + "GuessTheNumber-v0", 30.0, 400).values()
    game = factory()
    try:
        observation = game.reset(seed=TRACE_SEED)
        row = {"prompt": [{"role": "user", "content": f"Game {TRACE_SEED}: play Guess The Number with the move "
                                                      f"tool.{observation}"}]}
        messages, tokens, low, high = [], [], 1, 20
        while not game.outcome["solved"] and len(tokens) < 10:
            guess = (low + high) // 2
            call = {"type": "function", "function": {"name": "move", "arguments": {"action": f"[{guess}]"}}}
            answer = game.move(f"[{guess}]")
            messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "name": "move", "content": answer}]
            tokens.append(len(tokenizer(json.dumps(call["function"]))["input_ids"]))
            low, high = (guess + 1, high) if "higher" in answer else (low, guess - 1) if "lower" in answer else \
                (low, high)
        messages.append({"role": "assistant", "content": "I won."})
        tokens.append(len(tokenizer("I won.")["input_ids"]))
        episode = Episode(messages=messages, turns=len(tokens), turn_tokens=tokens, environment=game)
        (trace_id,) = log_traces(cfg, run_id, "baseline", episode_traces(cfg, [row], [[episode]]))
    finally:
        game._close()
    experiment_id = client.get_run(run_id).info.experiment_id
    return f"#/experiments/{experiment_id}/traces?selectedEvaluationId={trace_id}"


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


CLOSE_ASSISTANT = """(() => {
  const close = [...document.querySelectorAll('button[aria-label="Close"]')].find(
    b => b.parentElement && b.parentElement.querySelector('button[aria-label="New Chat"]'));
  if (!close) return 'no assistant panel';
  close.click();
  return 'closed';
})()"""
"""The MLflow Assistant side panel opens by itself on a first visit from localhost: close it (the choice
is kept in the browser profile's local storage)."""

SEARCH_CHARTS = """(() => {
  const input = document.querySelector('input[placeholder^="Search metric"]');
  if (!input) return 'no search box';
  Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set.call(input, '%s');
  input.dispatchEvent(new Event('input', {bubbles: true}));
  return 'filtered';
})()"""


SELECT_SPAN = """(() => {
  const span = [...document.querySelectorAll('span, div')].find(e => e.children.length === 0 && e.textContent === '%s');
  if (!span) return 'no span %s';
  span.click();
  return 'selected %s';
})()"""
"""A trace page opens on its root span: select a turn's span, whose observation and action then show."""


class Browser:
    """Headless Chromium driven over the DevTools protocol (``websocket-client``): navigate, run a script,
    capture a PNG. Started here with its own profile; stopped by its PID."""

    def __init__(self, chromium: str, width: int = 1440, height: int = 1000) -> None:
        import websocket

        self.profile = tempfile.mkdtemp(prefix="grpo-chromium-")
        self.proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                      "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                                      f"--user-data-dir={self.profile}", f"--window-size={width},{height}",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise SystemExit("chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, script: str):
        return self.call("Runtime.evaluate", expression=script, returnByValue=True)["result"].get("value")

    def open(self, url: str, settle_s: float) -> None:
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 60
        while self.evaluate("document.readyState") != "complete" and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(settle_s)  # the UI fetches runs, metrics and charts after the document loads

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


def take(browser: Browser, base: str, routes: dict[str, str], out: Path, settle_s: float,
         charts: str = "rewards/") -> None:
    """Open each route, close the assistant panel, filter the metric charts to names holding ``charts``, save the
    PNG."""
    for name, route in routes.items():
        browser.open(f"{base}/{route}", settle_s)
        print(f"assistant panel: {browser.evaluate(CLOSE_ASSISTANT)}", flush=True)
        if "/traces" in route:
            print(f"trace span: {browser.evaluate(SELECT_SPAN % ((TRACE_SPAN,) * 3))}", flush=True)
            time.sleep(settle_s / 4)
        if "/model-metrics" in route:
            print(f"metric charts: {browser.evaluate(SEARCH_CHARTS % charts)}", flush=True)  # training curves
            time.sleep(settle_s)
        browser.screenshot(out / name)
        print(f"saved {out / name} ({route}; landed on {browser.evaluate('location.hash')})", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="directory of finished runs (mlflow.db); default: run the "
                        "tiny flow twice in a row (the second from the first's champion) in a scratch directory")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--settle-s", type=float, default=20.0, help="seconds each page gets to render")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "test.yaml",
                        help="the run config of the tiny flow (without --workdir)")
    parser.add_argument("--charts", default="rewards/", help="the metric charts shown: names holding this text")
    parser.add_argument("--trace-only", action="store_true", help="only the episode trace's page, from a scratch "
                        "store (no flow run)")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        raise SystemExit("headless Chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="grpo-screens-") as scratch:
        workdir = args.workdir or Path(scratch)
        if args.trace_only:
            routes = {TRACE_PNG: log_episode_trace(workdir.resolve())}
        else:
            if args.workdir is None:
                run_tiny_flow(workdir, args.config)
                run_from_champion(workdir, args.config)
            routes = pages(workdir.resolve())
            routes[TRACE_PNG] = log_episode_trace(workdir.resolve(), run_id=newest_run(workdir.resolve()))
        port = free_port()
        ui = serve_ui(workdir.resolve(), port)
        browser = None
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            browser = Browser(chromium)
            take(browser, f"http://127.0.0.1:{port}", routes, args.out, args.settle_s, args.charts)
        finally:
            if browser is not None:
                browser.close()
            stop(ui)


if __name__ == "__main__":
    main()
