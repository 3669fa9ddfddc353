"""The whole flow with a tool (configs/test-tools.yaml) on the session's real tiny vLLM server: TRL's tool loop runs
on the server path in training, evaluation runs the same multi-turn episodes for baseline and trained, tool metrics
and whole conversations reach MLflow, and the registered model renders prompts with the configured chat template.
A structured-outputs regex makes every turn a calculator call, so each episode is: call, the tool's answer, a second
call that the iteration bound (1) leaves unexecuted. Training runs with ``generation.async`` (as a user turns it on
with tools): the producer prefetches each batch's first turns (pushes in flight), the trainer's tool loop samples the
follow-up turns with the weights pushed by then."""

import json
import re
from pathlib import Path

import pytest

from grpo_steps.config import REPO_ROOT, load_config
from grpo_steps.tools.functions import calculator, chat_template_text
from tests.integration.flowrun import STEPS, completed_run, config_file, on_server

pytestmark = pytest.mark.slow
CONFIG = REPO_ROOT / "configs" / "test-tools.yaml"
CALL = re.compile(r'assistant: calculator\(\{"expression": "([1-9] \* [1-9])"\}\)')


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory, tiny_server):
    import yaml

    workdir = tmp_path_factory.mktemp("tools")
    config = on_server(yaml.safe_load(CONFIG.read_text()), tiny_server)
    config["generation"]["async"] = {"max_staleness": 1}
    path = config_file(workdir, config)
    with completed_run(workdir, path) as (run, _):
        yield workdir, run


def _episode_is_call_result_call(text: str) -> None:
    """A conversation as the tables show it (``assistant: calculator({...})``, ``tool calculator: <answer>``): the
    model's call, the tool's answer (the calculator's value of the expression the model wrote), the model's second
    call."""
    calls = CALL.findall(text)
    assert len(calls) == 2, text
    assert f"\ntool calculator: {calculator(calls[0])}\nassistant: " in text, text


def test_training_and_evaluation_run_the_tool_loop(tool_run):
    from mlflow import MlflowClient

    workdir, run = tool_run
    cfg = load_config(CONFIG)
    assert run.successful and {step.id for step in run} == STEPS
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    run_id = run.data.mlflow_run_id
    history = {key: [m.value for m in client.get_metric_history(run_id, key)]
               for key in ("tools/call_frequency", "tools/failure_frequency", "tools/turns_per_episode",
                           "async/staleness", "async/dropped", "async/missed", "async/tool_turn_version_lag",
                           "async/token_staleness_max")}
    # asynchronous with tools: first turns prefetched (step 1's sampled by the start weights, then within the bound),
    # none dropped; every step's follow-up turns sampled now, by weights at most the bound newer than the first's
    assert len(history["async/staleness"]) == cfg.train.max_steps and max(history["async/staleness"]) <= 1
    assert history["async/dropped"] == [0.0] * cfg.train.max_steps
    assert max(history["async/token_staleness_max"]) <= 1  # pushed in flight: per-token versions recorded
    assert len(history["async/tool_turn_version_lag"]) == cfg.train.max_steps
    assert all(0 <= lag <= 1 for lag in history["async/tool_turn_version_lag"])
    # every rollout: a call, its answer, a second call the bound leaves unexecuted -> 1 call executed, 2 turns
    assert history["tools/call_frequency"] == [1.0] * cfg.train.max_steps
    assert history["tools/failure_frequency"] == [0.0] * cfg.train.max_steps
    assert history["tools/turns_per_episode"] == [2.0] * cfg.train.max_steps

    # the per-step completions table holds whole conversations whose tool answers are the calculator's
    table = json.loads(open(client.download_artifacts(run_id, "completions/step_000001.json", str(workdir))).read())
    completions = [row[table["columns"].index("completion")] for row in table["data"]]
    assert len(completions) == cfg.train.per_device_train_batch_size
    for text in completions:
        _episode_is_call_result_call(text)

    metrics = client.get_run(run_id).data.metrics
    for label in ("baseline", "trained"):  # the same multi-turn episodes for both policies
        assert metrics[f"eval/{label}/tools/call_frequency"] == 1.0
        assert metrics[f"eval/{label}/tools/turns_per_episode"] == 2.0
        assert metrics[f"eval/{label}/greedy_tools_episodes_with_call"] == 1.0
    report = run["evaluate"].task.data.eval_report
    for label in ("baseline", "trained"):
        assert report[label]["per_prompt"]["tool_call"] == [1.0] * cfg.data.num_eval
        for sample in report[label]["samples"]:
            _episode_is_call_result_call(sample["completion"])


def test_the_registered_model_renders_with_the_configured_chat_template(tool_run):
    """The tokenizer saved with the registered model renders TRL's Qwen2.5 template (model.chat_template), the one
    training and evaluation used: a user of the model gets the tool-calling format it was trained in; the version's
    description shows tool use beside accuracy."""
    import mlflow
    from transformers import AutoTokenizer

    workdir, _ = tool_run
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    (version,) = mlflow.MlflowClient().search_model_versions("name = 'grpo-test-tools'")
    # its description compares tool use too (baseline and trained both call every turn: 1 call, 2 turns)
    assert "| tools/call_frequency | 1.000 | 1.000 | +0.000 |" in version.description
    assert "| tools/turns_per_episode | 2.000 | 2.000 | +0.000 |" in version.description
    local = mlflow.artifacts.download_artifacts(f"models:/grpo-test-tools/{version.version}",
                                                dst_path=str(workdir / "registered"))
    configs = list(Path(local).rglob("tokenizer_config.json"))  # the model's and MLflow's pipeline components
    assert configs and all(AutoTokenizer.from_pretrained(c.parent).chat_template == chat_template_text("qwen2_5")
                           for c in configs)
