"""Held-out evaluation during training (``eval.every_steps``) in a real flow run: configs/test.yaml
(tiny model, 4 steps) evaluating every 2 optimizer steps on the session's vLLM server."""

from pathlib import Path

import pytest

from grpo_steps.config import load_config
from tests.integration.flowrun import completed_run, config_file, flow_config, on_server

pytestmark = pytest.mark.slow
EVERY = 2


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory, tiny_server):
    """One flow run evaluating every 2 steps on all 8 eval prompts; yields (workdir, metaflow Run, MlflowClient)."""
    from mlflow import MlflowClient

    workdir = tmp_path_factory.mktemp("evalduring")
    config = on_server(flow_config(eval={"every_steps": EVERY, "during_training_prompts": 8}), tiny_server)
    with completed_run(workdir, config_file(workdir, config)) as (run, _):
        yield workdir, run, MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")


def _history(client, run, metric: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.data.mlflow_run_id, metric))


def test_eval_during_curves_are_logged_at_step_0_and_every_n_steps(flow_run):
    workdir, run, client = flow_run
    cfg = load_config(workdir / "run.yaml")
    expected = list(range(0, cfg.train.max_steps + 1, EVERY))  # 0, 2, 4
    for metric in ("accuracy", "pass_at_1", "pass_at_2", "format_rate", "accuracy_formatted", "pass_at_1_formatted",
                   "reward", "reward/answer_accuracy", "completion_length", "probe_logprob", "seconds"):
        assert [step for step, _ in _history(client, run, f"eval_during/{metric}")] == expected, metric
    for metric in ("accuracy", "pass_at_1", "format_rate"):
        assert all(0 <= value <= 1 for _, value in _history(client, run, f"eval_during/{metric}")), metric


def test_each_point_measured_the_weights_of_its_step(flow_run):
    """The server's weight label at each evaluation is the step's push (``step-N``, base weights at 0), and
    the probe (greedy logprobs of the first eval prompt's completion) at step 0 is the baseline's, at the
    last step the trained policy's, as the evaluate step measured them after reloading each from disk."""
    _, run, client = flow_run
    versions = _history(client, run, "eval_during/weight_version")
    assert [value for _, value in versions] == [float(step) for step, _ in versions]
    probes = dict(_history(client, run, "eval_during/probe_logprob"))
    report = run["evaluate"].task.data.eval_report
    first, last = min(probes), max(probes)
    assert probes[first] == pytest.approx(sum(report["baseline"]["probe_logprobs"]), abs=1e-3)
    assert probes[last] == pytest.approx(sum(report["trained"]["probe_logprobs"]), abs=1e-3)
    assert probes[first] != pytest.approx(probes[last], abs=1e-3)  # training changed the served weights


def test_no_extra_reload_during_training(flow_run):
    """The evaluations reuse the trainer's pushes: each step's log still holds the one push made before its
    generation, of the previous step's weights (version = step - 1), as without evaluation; the progress
    lines name the served version at each evaluation."""
    workdir, run, client = flow_run
    cfg = load_config(workdir / "run.yaml")
    pushes = _history(client, run, "weight_sync/version")
    assert pushes == [(step, float(step - 1)) for step in range(1, cfg.train.max_steps + 1)]
    log = run["train"].task.stdout
    for step in (0, 2, 4):
        assert f"[eval_during] step {step} (step-{step}):" in log


def test_chart_and_card_show_the_curves(flow_run):
    workdir, run, client = flow_run
    run_id = run.data.mlflow_run_id
    artifacts = {a.path for a in client.list_artifacts(run_id, "charts")}
    assert "charts/eval_during_training.png" in artifacts
    png = Path(client.download_artifacts(run_id, "charts/eval_during_training.png", str(workdir)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from metaflow.cards import get_cards

    (card,) = [c for c in get_cards(run["evaluate"].task) if c.id == "eval"]
    text = _card_text(card.get())
    assert "Held-out evaluation during training" in text and "Training reward" in text


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
