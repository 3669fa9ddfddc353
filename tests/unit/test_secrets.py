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
from grpo_steps.redaction import credential_in, redact, redact_args, redact_report, redact_value, secret_name

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


def test_mlflow_params_and_tags_hold_no_secret_even_past_validation(tmp_path, mlflow_db):
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
    from grpo_steps.evaluation.report import version_description

    cfg = PipelineConfig(eval={"k": [1], "num_samples": 1, "format_reward": None})
    metrics = {"pass@1": 0.5, "accuracy": 0.5, "reward": 0.5}
    text = version_description(cfg, {"baseline": {"metrics": metrics}, "trained": {"metrics": metrics}},
                               run_url=f"https://u:{SECRET}@mlflow/#/runs/1", run_pathspec="GRPOFlow/1234",
                               gate_reason="held")
    assert SECRET not in text
    assert "card get 1234/evaluate --id eval" in text
    assert f"; {cfg.data.num_train} train / {cfg.data.num_eval} held-out prompts." in text  # the config's counts
    # what prepare_data kept (data.skip_seen: the rows new to the chain) and the version a models:/ start pinned
    cfg = PipelineConfig(model={"name_or_path": "models:/m@champion"}, eval={"k": [1], "num_samples": 1,
                                                                              "format_reward": None})
    text = version_description(cfg, {"baseline": {"metrics": metrics}, "trained": {"metrics": metrics}},
                               run_url="http://mlflow/#/runs/1", run_pathspec="GRPOFlow/1234", gate_reason="held",
                               splits=(27, 100), start_uri="models:/m/1")
    assert "; 27 train / 100 held-out prompts. **Base model**: `models:/m@champion` (`models:/m/1`);" in text


# The battery: credentials in every shape a user's config has been seen to hold them. Each is refused in `start`
# (config validation) with a message that names where and which environment variable to use, never the value.
PLANTED = "Plnt9xQ7vW3kZr8Ls2"  # the part of each secret below that must appear nowhere
AKIA, ASIA = "AKIA" + "PLNT9XQ7VW3KZR8L", "ASIA" + "PLNT9XQ7VW3KZR8L"
JWT = f"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ{PLANTED}.{PLANTED}"
BATTERY = [
    ({"tracking": {"tracking_uri": f"https://mlflow.example.com/?token={PLANTED}"}}, "tracking"),  # query token
    ({"tracking": {"tracking_uri": f"https://mlflow.example.com/api?api_key={PLANTED}&x=1"}}, "tracking"),
    ({"tracking": {"tracking_uri": f"https://mlflow.example.com/#access_token={PLANTED}"}}, "tracking"),  # fragment
    ({"tracking": {"artifact_location": f"s3://b/p?X-Amz-Algorithm=AWS4&X-Amz-Credential={PLANTED}%2F2026"}},
     "tracking"),  # a presigned URL's credential
    ({"tracking": {"artifact_location": f"https://b.s3.amazonaws.com/k?X-Amz-Signature={PLANTED}"}}, "tracking"),
    ({"tracking": {"artifact_location": f"https://a.blob.core.windows.net/c?sv=2022-11-02&sig={PLANTED}"}},
     "tracking"),  # an Azure SAS signature
    ({"tracking": {"tracking_uri": f"https://mlflow.example.com/?password={PLANTED}"}}, "tracking"),
    ({"generation": {"provider": "external", "server": {"endpoint": f"http://127.0.0.1:8000/?key={PLANTED}"}}},
     "GRPO_SERVER_TOKEN"),  # a key in the endpoint
    ({"model": {"name_or_path": f"https://u:{PLANTED}@models.example.com/policy"}}, "model.name_or_path"),
    ({"data": {"source": "jsonl", "path": f"https://u:{PLANTED}@data.example.com/rows.jsonl"}}, "data.path"),
    ({"data": {"source": "jsonl", "path": f"https://data.example.com/rows.jsonl?sig={PLANTED}"}}, "data.path"),
    ({"train": {"grpo": {"hub_token": f"hf_{PLANTED}abcdef"}}}, "HF_TOKEN"),  # a hub token passthrough
    ({"train": {"grpo": {"hub_token": 1234567890}}}, "train.grpo.hub_token"),  # an int under a secret name
    ({"rewards": [{"name": "answer_accuracy", "options": {"apiKey": PLANTED}}]}, "rewards[0].options.apiKey"),
    ({"rewards": [{"name": "answer_accuracy", "options": {"secretAccessKey": PLANTED}}]}, "secretAccessKey"),
    ({"rewards": [{"name": "answer_accuracy", "options": {"SECRET_ACCESS_KEY": PLANTED}}]}, "SECRET_ACCESS_KEY"),
    ({"rewards": [{"name": "answer_accuracy", "options": {"secret-access-key": PLANTED}}]}, "secret-access-key"),
    ({"rewards": [{"name": "answer_accuracy", "options": {"judge": {"auth": {"password": PLANTED}}}}]},
     "options.judge.auth"),  # nested options
    ({"rewards": [{"name": "answer_accuracy", "options": {"keys": [{"x-api-key": 42}]}}]}, "x-api-key"),
    ({"data": {"task_options": {"access_token": PLANTED}}}, "data.task_options.access_token"),
    ({"data": {"task_options": {"seed_url": f"https://x/{AKIA}"}}}, "data.task_options.seed_url"),  # AWS key id
    ({"data": {"task_options": {"note": ASIA}}}, "data.task_options.note"),  # a temporary AWS key id
    ({"data": {"task_options": {"note": "ghp_" + PLANTED * 2}}}, "data.task_options.note"),  # GitHub
    ({"data": {"task_options": {"note": "github_pat_11" + PLANTED * 2}}}, "data.task_options.note"),
    ({"data": {"task_options": {"note": "xoxb-1234-" + PLANTED}}}, "data.task_options.note"),  # Slack
    ({"data": {"task_options": {"note": "sk-proj-" + PLANTED * 2}}}, "data.task_options.note"),  # OpenAI-style
    ({"data": {"system_prompt": f"Answer. {JWT}"}}, "data.system_prompt"),  # a JWT in free text
    ({"data": {"system_prompt": f"Bearer {PLANTED}"}}, "data.system_prompt"),  # a bearer credential
    ({"generation": {"server": {"extra_args": [f"hf_{PLANTED}abcdef"]}}}, "generation.server.extra_args"),
    ({"generation": {"server": {"extra_args": ["--hf-token", PLANTED]}}}, "generation.server.extra_args"),
    # secrets by other names and shapes (issue 49): accepted before
    ({"rewards": [{"name": "answer_accuracy", "options": {"openai_key": PLANTED}}]}, "options.openai_key"),  # <w>_key
    ({"data": {"task_options": {"AccountKey": PLANTED}}}, "data.task_options.AccountKey"),
    ({"data": {"task_options": {"db_pass": PLANTED}}}, "data.task_options.db_pass"),
    ({"data": {"task_options": {"user_pwd": PLANTED}}}, "data.task_options.user_pwd"),
    ({"data": {"task_options": {"webhook_url": f"https://example.com/hook/{PLANTED}"}}}, "webhook_url"),
    ({"data": {"task_options": {"sentry_dsn": f"proj-{PLANTED}"}}}, "data.task_options.sentry_dsn"),
    ({"data": {"task_options": {"jwt": PLANTED}}}, "data.task_options.jwt"),
    ({"data": {"task_options": {"bearer": PLANTED}}}, "data.task_options.bearer"),
    ({"data": {"task_options": {"user_session": PLANTED}}}, "data.task_options.user_session"),
    ({"data": {"system_prompt": f"connect with password={PLANTED} first"}}, "data.system_prompt"),  # a pair in text
    ({"data": {"task_options": {"conn": "DefaultEndpointsProtocol=https;AccountName=a;"
                                        f"AccountKey={PLANTED}==;EndpointSuffix=core.windows.net"}}},
     "data.task_options.conn"),  # an Azure connection string
    ({"data": {"task_options": {"conn": f"Server=db;User Id=me;Pwd={PLANTED};"}}}, "data.task_options.conn"),
    ({"tracking": {"tracking_uri": f"https://mlflow.example.com/api;token={PLANTED}"}}, "tracking"),  # ;token=
    ({"data": {"task_options": {"note": "npm_" + PLANTED * 2}}}, "data.task_options.note"),  # npm
    ({"data": {"task_options": {"note": "sk_live_" + PLANTED * 2}}}, "data.task_options.note"),  # Stripe
    ({"data": {"task_options": {"note": "rk_test_" + PLANTED * 2}}}, "data.task_options.note"),
    ({"data": {"task_options": {"note": f"https://hooks.slack.com/services/T0000000/B0000000/{PLANTED}"}}},
     "data.task_options.note"),  # a Slack webhook: the URL is the key
    ({"data": {"task_options": {"note": f"-----BEGIN RSA PRIVATE KEY-----\nMIIE{PLANTED}\n{PLANTED}==\n"
                                        "-----END RSA PRIVATE KEY-----"}}}, "data.task_options.note"),  # PEM
    ({"data": {"task_options": {"note": f"-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl{PLANTED}"}}},
     "data.task_options.note"),  # a PEM block cut short
    # issue 59: names and values still accepted before
    *[({"data": {"task_options": {name: PLANTED}}}, f"data.task_options.{name}")
      for name in ("pin", "sas", "connection_string", "private", "otp", "sas_token", "user_pin")],
    ({"data": {"task_options": {"note": f"https://api.telegram.org/bot123456789:AA{PLANTED}{PLANTED}/sendMessage"}}},
     "data.task_options.note"),  # a Telegram bot URL: the token is in the path
    ({"data": {"task_options": {"note": f"ya29.a0{PLANTED}{PLANTED}"}}}, "data.task_options.note"),  # Google OAuth
    ({"data": {"task_options": {"db": f"me:{PLANTED}@db.example.com:5432/app"}}}, "data.task_options.db"),  # DSN
    ({"data": {"task_options": {"db": f"postgresql+psycopg://me:{PLANTED}@db/app"}}}, "data.task_options.db"),
    ({"data": {"task_options": {"header": f"token: {PLANTED}"}}}, "data.task_options.header"),  # a whole pair
    ({"generation": {"server": {"extra_args": [f"api_key: {PLANTED}"]}}}, "generation.server.extra_args"),
]
BARE_KEYS = ["0123456789abcdef0123456789abcdef01234567",  # 40 hex digits: a Weights & Biases API key
             "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"]  # an AWS secret access key (AWS's documentation example)


@pytest.mark.parametrize("key", BARE_KEYS)
def test_a_bare_key_is_refused_in_start_without_echoing_it(key):
    with pytest.raises(ConfigError) as err:
        validate_config({"data": {"task_options": {"project": key}}})
    assert "data.task_options.project" in str(err.value) and key not in str(err.value)


def test_hashes_paths_and_model_names_are_not_bare_keys():
    sha = "0123456789abcdef0123456789abcdef01234567"
    validate_config({"model": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"},
                     "data": {"task_options": {"revision": sha, "commit": sha, "config_sha256": sha,
                                               "path": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}},
                     "train": {"grpo": {"dataloader_pin_memory": True}},
                     "generation": {"server": {"router": {"private_network": False}}}})


@pytest.mark.parametrize(("config", "named"), BATTERY)
def test_battery_every_credential_shape_is_refused_in_start_without_echoing_it(config, named):
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    message = str(err.value)
    assert named in message and "environment" in message
    assert PLANTED not in message and PLANTED.lower() not in message.lower()
    assert AKIA not in message and ASIA not in message


def test_battery_every_shape_is_redacted_from_text_and_values():
    import json

    for config, _ in BATTERY:
        assert PLANTED not in redact(json.dumps(config)), config  # as a JSON line in a log
        assert PLANTED not in redact(repr(config)), config  # as a Python repr in an error message
        assert PLANTED not in repr(redact_value(config)), config  # as a value (params, tables, artifacts)
        for text in _strings(config):  # a string that is a credential by its shape, without its key
            if credential_in(text):
                assert PLANTED not in redact(text) and AKIA not in redact(text), text


def _strings(tree):
    if isinstance(tree, dict):
        return [s for v in tree.values() for s in _strings(v)]
    if isinstance(tree, list):
        return [s for v in tree for s in _strings(v)]
    return [tree] if isinstance(tree, str) else []


def test_ordinary_names_and_text_are_neither_refused_nor_redacted():
    text = ("max_completion_tokens=128 stop_token_ids=[2] answer_key: B sqlite:///mlflow.db "
            "https://mlflow.example.com:5000/#/experiments/1?x=2 Tokens: 12 tokenizer=/t")
    assert redact(text) == text
    validate_config({"data": {"system_prompt": "Think, then give the answer key: the final number."},
                     "generation": {"stop_token_ids": [2]}})


ALLOWED_NAMES = ["sort_key", "answer_key", "sortKey", "group-key", "pass@1", "pass_at_k", "session_id",
                 "max_completion_tokens", "stop_token_ids", "webhook_url_env", "hub_token_env", "key_column"]


@pytest.mark.parametrize("name", ALLOWED_NAMES)
def test_data_and_metric_names_are_not_secret_names(name):
    assert not secret_name(name)


def test_the_eval_report_is_redacted_keeping_every_figure():
    report = {"baseline": {"metrics": {"pass@1": 0.25, "accuracy": 0.5}},
              "trained": {"metrics": {"pass@1": 0.75}, "per_prompt": {"the password prompt": 1.0},
                          "samples": [{"completion": f"use password={PLANTED} and Bearer {PLANTED}",
                                       "api_key": PLANTED, "reward": 1.0, "tool": ["--api-key", PLANTED]}]},
              "gain": {"pass@1": {"mean": 0.5, "ci95": [0.1, 0.9]}}}
    redacted = redact_report(report)
    assert PLANTED not in repr(redacted)
    assert redacted["baseline"] == report["baseline"] and redacted["gain"] == report["gain"]
    assert redacted["trained"]["metrics"] == {"pass@1": 0.75}
    assert redacted["trained"]["per_prompt"] == {"the password prompt": 1.0}
    assert redacted["trained"]["samples"][0]["reward"] == 1.0


def test_unparsable_input_is_echoed_redacted_and_the_hash_covers_the_redacted_config():
    with pytest.raises(ConfigError) as err:
        validate_config({"train": {"max_steps": {"token": PLANTED}}})
    assert PLANTED not in str(err.value) and "max_steps" in str(err.value)
    cfg = _unvalidated_grpo({"hub_token": PLANTED})
    assert cfg.sha256() == _unvalidated_grpo({"hub_token": "other"}).sha256()


def _unvalidated_grpo(grpo: dict) -> PipelineConfig:
    from grpo_steps.config import TrainConfig

    return PipelineConfig.model_construct(train=TrainConfig.model_construct(**{**dict(TrainConfig()), "grpo": grpo}))


def test_the_local_datastore_and_mlflow_store_become_private(tmp_path, monkeypatch):
    monkeypatch.delenv("METAFLOW_DATASTORE_SYSROOT_LOCAL", raising=False)
    (tmp_path / ".metaflow").mkdir(mode=0o755)
    (tmp_path / "mlflow.db").write_text("")
    (tmp_path / "mlflow.db").chmod(0o644)
    (tmp_path / "elsewhere").mkdir(mode=0o755)
    (tmp_path / "mlartifacts").symlink_to(tmp_path / "elsewhere")  # a link: never followed
    cfg = validate_config({"tracking": {"artifact_location": "mlartifacts"}})
    assert sorted(tracking.restrict_local_stores(cfg, str(tmp_path))) == [str(tmp_path / ".metaflow"),
                                                                         str(tmp_path / "mlflow.db")]
    assert oct((tmp_path / ".metaflow").stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / "mlflow.db").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "elsewhere").stat().st_mode & 0o777) == "0o755"
