"""Credentials never leave the process: the config refuses them inline (naming the environment variable to use),
and one redaction covers what still reaches MLflow, logs and the registered version's description."""

import sqlite3

import pytest

from grpo_steps import tracking
from grpo_steps.config import (
    ConfigError,
    GenerationConfig,
    PipelineConfig,
    ServerConfig,
    TrackingConfig,
    validate_config,
)
from grpo_steps.redaction import redact, redact_args, redact_value

SECRET = "hunter2-s3cr3t"

REFUSED = [
    ({"tracking": {"tracking_uri": f"https://alice:{SECRET}@mlflow.example.com"}}, "tracking.tracking_uri",
     "MLFLOW_TRACKING_PASSWORD"),  # password in the tracking URI
    ({"tracking": {"tracking_uri": f"postgresql://mlflow:{SECRET}@db:5432/mlflow"}}, "tracking.tracking_uri",
     "mlflow server"),  # a database store's password
    ({"tracking": {"artifact_location": f"s3://AKIA:{SECRET}@bucket/mlflow"}}, "tracking.artifact_location",
     "AWS_SECRET_ACCESS_KEY"),  # keys in the artifact location
    ({"generation": {"provider": "external", "server": {"endpoint": f"http://u:{SECRET}@127.0.0.1:8000"}}},
     "generation.server.endpoint", "GRPO_SERVER_TOKEN"),  # credentials in the endpoint
    ({"generation": {"server": {"extra_args": ["--api-key", SECRET]}}}, "generation.server.extra_args",
     "VLLM_API_KEY"),  # vLLM's --api-key as two arguments
    ({"generation": {"server": {"extra_args": [f"--api_key={SECRET}"]}}}, "generation.server.extra_args",
     "VLLM_API_KEY"),  # ... as one
    ({"generation": {"server": {"extra_args": ["--hf-token", SECRET]}}}, "generation.server.extra_args",
     "environment"),  # any key-like flag
]


@pytest.mark.parametrize(("config", "key", "fix"), REFUSED)
def test_inline_credentials_are_refused_naming_the_key_and_the_environment_variable(config, key, fix):
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert key in str(err.value) and fix in str(err.value)
    assert SECRET not in str(err.value)


def test_ordinary_values_are_accepted():
    cfg = validate_config({"generation": {"server": {"extra_args": ["--max-num-seqs", "8", "--tokenizer", "/t"]}},
                           "tracking": {"tracking_uri": "http://127.0.0.1:5000"}})
    assert cfg.generation.server.extra_args == ["--max-num-seqs", "8", "--tokenizer", "/t"]


REDACT_CASES = [
    (f"https://alice:{SECRET}@h:5000/", "https://***@h:5000/"),  # URL userinfo, user included
    (f"https://{SECRET}@github.com/x", "https://***@github.com/x"),  # a token as the user
    (f"--api-key {SECRET} --port 8000", "--api-key *** --port 8000"),  # flag and value
    (f"--api-key={SECRET}", "--api-key=***"),  # flag=value
    (f"Authorization: Bearer {SECRET}", "Authorization: Bearer ***"),  # a bearer header
    (f"?token={SECRET}&page=2", "?token=***&page=2"),  # a query parameter
    ("hf_abcdefghijklmnopqrstuvwxyz123", "***"),  # a Hugging Face token's shape
    ("max_completion_tokens=128 --tokenizer /t --max-model-len 512", None),  # not secrets: unchanged
]


@pytest.mark.parametrize(("text", "expected"), REDACT_CASES)
def test_redact(text, expected):
    assert redact(text) == (text if expected is None else expected)


def test_redact_args_and_values():
    assert redact_args(["--api-key", SECRET, "-O0"]) == ["--api-key", "***", "-O0"]
    dumped = redact_value({"server": {"extra_args": ["--api-key", SECRET], "endpoint": f"http://a:{SECRET}@h"},
                           "password": SECRET, "n": 3})
    assert SECRET not in repr(dumped) and dumped["n"] == 3


def _unvalidated(tmp_path) -> PipelineConfig:
    """A config whose secrets slipped past validation (built without it): the redaction is the second line."""
    server = ServerConfig.model_construct(endpoint=f"http://u:{SECRET}@127.0.0.1:8000",
                                          extra_args=["--api-key", SECRET])
    return PipelineConfig.model_construct(
        generation=GenerationConfig.model_construct(server=server, provider="external"),
        tracking=TrackingConfig.model_construct(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                experiment_name="grpo", artifact_location=None))


def test_mlflow_params_and_tags_hold_no_secret_even_past_validation(tmp_path):
    cfg = _unvalidated(tmp_path)
    assert SECRET not in repr(cfg.flat_params())
    run_id = tracking.open_run(cfg, "GRPOFlow/1/start/1")
    run = tracking.client(cfg).get_run(run_id)
    assert SECRET not in repr(run.data.params) + repr(run.data.tags)
    assert run.data.params["generation.server.extra_args"] == "['--api-key', '***']"
    with sqlite3.connect(tmp_path / "mlflow.db") as db:  # the whole store, every table
        tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for table in tables:
            assert SECRET not in repr(db.execute(f"SELECT * FROM {table}").fetchall()), table  # noqa: S608


def test_version_description_is_redacted_and_its_card_command_takes_the_run_id():
    from grpo_steps.report import version_description

    cfg = PipelineConfig(eval={"k": [1], "num_samples": 1, "format_reward": None})
    metrics = {"pass@1": 0.5, "accuracy": 0.5, "reward": 0.5}
    text = version_description(cfg, {"baseline": {"metrics": metrics}, "trained": {"metrics": metrics}},
                               run_url=f"https://u:{SECRET}@mlflow/#/runs/1", run_pathspec="GRPOFlow/1234",
                               gate_reason="held")
    assert SECRET not in text
    assert "card get 1234/evaluate --id eval" in text
