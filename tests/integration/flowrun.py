"""Helpers for tests that run the real flow as a user would: a subprocess in a scratch directory,
read line by line so a test can act (kill a process, stop a server) at a given point of the run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import yaml

from grpo_steps.checkpoints import checkpoint_name
from grpo_steps.config import REPO_ROOT

FLOW = REPO_ROOT / "flows" / "grpo_flow.py"
SAVING = re.compile(r"\[checkpoint\] saving step=(\d+) node=0 pid=(\d+)")
SAVED = re.compile(r"\[checkpoint\] saved step=(\d+) node=0 pid=(\d+)")
STEPS = {"start", "prepare_data", "provision_vllm", "train", "evaluate", "register", "end"}
SERVING = re.compile(r"\[vllm\] serving (\S+) supervisor_pid=(\d+)")


def flow_config(base: str = "test.yaml", **sections) -> dict:
    """configs/``base`` (default test.yaml) with the given sections updated (``train={"max_steps": 8}``, ...)."""
    config = yaml.safe_load((REPO_ROOT / "configs" / base).read_text())
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def on_server(config: dict, server) -> dict:
    """``config`` with its generation server replaced by ``server`` (the session's ``tiny_server``),
    reached as provider ``external``: for flow tests that are not about a server's own lifecycle."""
    generation = config.setdefault("generation", {})
    generation.update(provider="external", server={**generation.get("server", {}), "endpoint": server.endpoint})
    return config


def config_file(workdir, config: dict, name: str = "run.yaml"):
    """Write ``config`` to ``workdir/name``; returns the path."""
    path = workdir / name
    path.write_text(yaml.safe_dump(config))
    return path


def flow_env(**extra: str) -> dict[str, str]:
    """The environment of a flow run: this interpreter first on PATH (Metaflow's local @parallel starts
    the gang's other nodes with ``python`` from PATH), a Metaflow user, unbuffered output."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "METAFLOW_USER": "grpo-tests", "PYTHONUNBUFFERED": "1", **extra}


def run_flow(workdir, env: dict, args: list[str], on_line: Callable[[str], None] | None = None,
             timeout_s: float = 1500, started: Callable[[subprocess.Popen], None] | None = None,
             mlflow_store: bool = True) -> tuple[int, str]:
    """Run ``grpo_flow.py ARGS`` in ``workdir``; ``on_line`` sees each output line as it comes, ``started`` the
    runtime's process once it started. ``mlflow_store``: a ``run`` in a ``workdir`` without ``mlflow.db`` finds a
    copy of an empty MLflow store there (:func:`tests.conftest.empty_mlflow_store`: what ``start`` would create with
    MLflow's migrations, seconds of every flow run; off for a test that checks a refused run writes no store).
    Returns (exit code, whole output)."""
    if mlflow_store and args[-1] == "run" and not (Path(workdir) / "mlflow.db").exists():
        from tests.conftest import empty_mlflow_store

        shutil.copyfile(empty_mlflow_store(), Path(workdir) / "mlflow.db")
    proc = subprocess.Popen([sys.executable, str(FLOW), *args], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if started:
        started(proc)
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if on_line:
                on_line(line)
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if os.environ.get("GRPO_TEST_FLOW_LOGS"):  # where a slow test's time goes: each flow's output, kept
            kept = Path(os.environ["GRPO_TEST_FLOW_LOGS"]) / f"{time.strftime('%H%M%S')}-{os.getpid()}-{args[-1]}.log"
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.write_text("".join(log))
    return proc.returncode, "".join(log)


def run_config(workdir, env: dict, config: dict, on_line=None, mlflow_store: bool = True) -> tuple[int, str]:
    """``run`` the flow on ``config`` (written to ``workdir/run.yaml``); ``mlflow_store`` as :func:`run_flow`'s."""
    return run_flow(workdir, env, ["--config", "config", str(config_file(workdir, config)), "run"], on_line,
                    mlflow_store=mlflow_store)


def vllm_child(supervisor_pid: int) -> int:
    """PID of the vLLM server process run by our supervisor (its only child)."""
    import psutil

    (child,) = psutil.Process(supervisor_pid).children()
    return child.pid


def mlflow_runs(workdir) -> list:
    """MLflow runs of experiment ``grpo`` in ``workdir``'s store, oldest first."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "grpo"]
    return sorted(client.search_runs([experiment.experiment_id]), key=lambda r: r.info.start_time)


def metric_steps(workdir, metric: str, run_id: str | None = None) -> list[int]:
    """Steps of ``metric`` in MLflow run ``run_id`` (default: the only run) of ``workdir``'s store."""
    from mlflow import MlflowClient

    if run_id is None:
        (run,) = mlflow_runs(workdir)
        run_id = run.info.run_id
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    return [m.step for m in client.get_metric_history(run_id, metric)]


def model_versions(workdir, name: str) -> list:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db").search_model_versions(f"name = '{name}'")


def s3_keys(server) -> list[str]:
    """Every object key in the local S3 server's bucket."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                      aws_secret_access_key=server.secret_key, region_name="us-east-1")
    return [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=server.bucket)
            for o in page.get("Contents", [])]


def client_in_child(workdir, env: dict, code: str, timeout_s: float = 300):
    """Run Metaflow client ``code`` in a child process (the client takes the datastore from env and cwd,
    and caches the first one it finds); returns its last printed line, parsed as YAML."""
    out = subprocess.run([sys.executable, "-c", "from metaflow import Checkpoint, Flow, namespace; namespace(None)\n"
                          + code], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-3000:]
    return yaml.safe_load(out.stdout.strip().splitlines()[-1])


def checkpoint_steps(workdir, env: dict, run_id: str) -> list[int]:
    """Global steps of the training checkpoints the ``train`` task of ``GRPOFlow/run_id`` holds in the datastore (node
    0's; not the final policy's, :data:`grpo_steps.steps.POLICY_CHECKPOINT`)."""
    return client_in_child(workdir, env, f"t = Flow('GRPOFlow')['{run_id}']['train'].task\n"
                           "print(sorted(c['metadata']['global_step'] "
                           f"for c in Checkpoint().list(task=t, name='{checkpoint_name(0)}')))")


def checkpoint_files(workdir, env: dict, run_id: str, node: int) -> list[str]:
    """Relative paths of the files in node ``node``'s newest checkpoint of ``GRPOFlow/run_id`` (loaded from
    the datastore into a scratch directory)."""
    return client_in_child(workdir, env, f"""
import json, os, tempfile
saved = [c for t in Flow('GRPOFlow')['{run_id}']['train']
         for c in Checkpoint().list(task=t, name='{checkpoint_name(node)}') if c['metadata']['node_index'] == {node}]
newest = max(saved, key=lambda c: c['metadata']['global_step'])
d = tempfile.mkdtemp()
Checkpoint().load(newest, d)
print(json.dumps(sorted(os.path.relpath(os.path.join(r, f), d) for r, _, fs in os.walk(d) for f in fs)))
""")


RUN_ID = re.compile(r"\(run-id (\d+)\)")


def flow_run_id(output: str) -> str:
    """The Metaflow run id of a flow run's output (``Workflow starting (run-id N)``)."""
    return RUN_ID.search(output).group(1)


@contextmanager
def completed_run(workdir, config_path, **env: str):
    """Run the flow on ``config_path`` in ``workdir`` (it must succeed), with ``env`` added to its environment;
    yields ``(Run, output)``, the Metaflow ``Run`` read from ``workdir``'s local datastore."""
    code, out = run_flow(workdir, flow_env(**env), ["--config", "config", str(config_path), "run"])
    assert code == 0, f"flow failed:\n{out[-12000:]}"
    with flow_client(workdir) as runs:
        yield runs[flow_run_id(out)], out


@contextmanager
def flow_client(workdir):
    """Yields Metaflow's ``Flow("GRPOFlow")`` read from ``workdir``'s local datastore (index it by run id), in
    ``workdir`` as the current directory."""
    from metaflow import Flow, metadata, namespace

    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        # The client caches the local datastore it found first: point it at this run's, explicitly.
        metadata(f"local@{workdir}")
        namespace(None)
        yield Flow("GRPOFlow")
    finally:
        os.chdir(cwd)


def files_holding(root, values: list[str]) -> dict[str, list[str]]:
    """``{path: [values found]}`` over every file under ``root``, read as a security team would grep them:
    plain, and gzip members decompressed (Metaflow's local datastore stores artifacts gzipped)."""
    import gzip

    found = {}
    for path in Path(root).rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        hits = [value for value in values if value.encode() in data]
        if hits:
            found[str(path.relative_to(root))] = hits
    return found


class MlflowServer:
    """A real ``mlflow server`` on 127.0.0.1 (a free port, kept across restarts) over a sqlite store at
    ``workdir/mlflow.db``, artifacts proxied to ``workdir/mlartifacts`` (as a cluster's tracking server serves
    them); started, stopped and started again by the PID of its own process group (its workers go with it)."""

    def __init__(self, workdir) -> None:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.workdir, self.proc, self.log = Path(workdir), None, None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import requests

        from grpo_steps.processes import wait_until

        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.workdir}/mlflow.db",
               "--artifacts-destination", str(self.workdir / "mlartifacts"), "--workers", "1"]
        self.log = open(self.workdir / "mlflow-server.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

        def healthy() -> bool:
            assert self.proc.poll() is None, (self.workdir / "mlflow-server.log").read_text()[-3000:]
            try:
                return requests.get(f"{self.url}/health", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        assert wait_until(healthy, timeout_s=180, interval_s=1)

    def stop(self) -> None:
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        if self.log is not None:
            self.log.close()


def check_task_run(cfg, client, run) -> None:
    """What a whole run of a task config (configs/test-<task>.yaml) must leave, ``cfg`` being the config it ran on
    and ``client`` an MlflowClient of its store: the prepared rows carry the task's reward columns, each
    configured reward logged at every training step, the evaluation's metrics (correctness and format rewards as the
    config names them) for baseline and trained with the correctness reward on every sample, one registered version
    of the run."""
    train_rows = run["prepare_data"].task.data.train_rows
    if cfg.data.source == "humaneval":
        assert all(row["test"] and row["entry_point"] and row["answer"] is None for row in train_rows)
    else:
        assert all(row["answer"] for row in train_rows)
    mlflow_run = client.get_run(run.data.mlflow_run_id)
    for spec in cfg.rewards:  # each reward of the task logged at every training step
        metric = f"rewards/{spec.name}/mean"
        steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, metric)]
        assert steps == list(range(1, cfg.train.max_steps + 1)), metric
    expected = ["accuracy", "pass_at_1", "pass_at_2", "reward", f"reward/{cfg.eval.correctness_reward}"]
    expected += ["format_rate"] if cfg.eval.format_reward else []
    for label in ("baseline", "trained"):
        for metric in expected:
            assert f"eval/{label}/{metric}" in mlflow_run.data.metrics, metric
    report = run["evaluate"].task.data.eval_report
    for label in ("baseline", "trained"):  # the correctness reward applied to every eval completion
        assert all(sample[cfg.eval.correctness_reward] is not None for sample in report[label]["samples"])
    versions = client.search_model_versions(f"name = '{cfg.registry.model_name}'")
    assert len(versions) == 1 and versions[0].run_id == mlflow_run.info.run_id


def token_logprobs(model, ids: list[int]) -> list[float]:
    """Log-probabilities (float64) of ``ids[1:]`` each given the ids before it, under a transformers causal LM."""
    import torch

    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    return logps.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


def on_replicas(config: dict, replica_set) -> dict:
    """``config`` with its generation served by ``replica_set`` (a :class:`grpo_steps.servers.ReplicaSet` the test
    started), reached as provider ``external``: each replica's endpoint for the pushes, its router for requests."""
    generation = config.setdefault("generation", {})
    generation.update(provider="external", server={**generation.get("server", {}),
                                                   "endpoints": [m.endpoint for m in replica_set.members],
                                                   "router": {"endpoint": replica_set.endpoint}})
    return config
