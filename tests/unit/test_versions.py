"""A registered version as a run's start (grpo_steps/versions.py), on a real MLflow store: what a ``models:/`` URI
resolves to, every refusal naming what exists, and the digest that refuses files changed in the artifact store.

The versions here are registered from plain run artifacts laid out as the transformers flavour lays out a logged
directory (``model/model/<files>``): the fetch and its digest read files, not a model."""

import json
from pathlib import Path

import pytest

from grpo_steps.config import REPO_ROOT
from grpo_steps.versions import (
    DIGEST_TAG,
    VersionError,
    fetch_version,
    model_sha256,
    parse_model_uri,
    resolve_version,
    start_tags,
)

FILES = {"config.json": '{"model_type": "qwen2"}', "model.safetensors": "weights-v{n}", "tokenizer.json": "{}"}


@pytest.fixture
def registry(tmp_path, mlflow_db, monkeypatch):
    """``(client, tracking URI, register(n, digest=True) -> version)``: a store whose artifacts lie in ``tmp_path``."""
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # the sqlite store's artifacts go to ./mlruns
    client = MlflowClient(mlflow_db)
    client.create_registered_model("policy")

    def register(n: int, digest: bool = True) -> str:
        folder = tmp_path / f"v{n}" / "model"
        folder.mkdir(parents=True)
        for name, text in FILES.items():
            (folder / name).write_text(text.replace("{n}", str(n)))
        run = client.create_run("0")
        client.log_artifacts(run.info.run_id, str(folder.parent), "model")
        tags = {DIGEST_TAG: model_sha256(folder)} if digest else {}
        return str(client.create_model_version("policy", f"runs:/{run.info.run_id}/model", run.info.run_id,
                                               tags=tags).version)

    return client, mlflow_db, register


def test_a_uri_resolves_to_one_version_and_every_refusal_names_what_exists(registry):
    client, _, register = registry
    assert (register(1), register(2)) == ("1", "2")
    client.set_registered_model_alias("policy", "champion", "1")
    assert resolve_version(client, "models:/policy@champion").version == 1
    assert resolve_version(client, "models:/policy/2").version == 2
    with pytest.raises(VersionError, match=r"models:/<name>@<alias>.*models:/<name>/<version>"):
        parse_model_uri("models:/policy")
    with pytest.raises(VersionError, match=r"no registered model 'polcy'.*registered models: policy"):
        resolve_version(client, "models:/polcy@champion")
    with pytest.raises(VersionError, match=r"alias 'best' does not exist; 'policy' has versions 1, 2 and aliases "
                                           r"champion -> 1"):
        resolve_version(client, "models:/policy@best")
    with pytest.raises(VersionError, match=r"version 7 does not exist; 'policy' has versions 1, 2"):
        resolve_version(client, "models:/policy/7")
    client.set_model_version_tag("policy", "1", "gate.revoked", "true")
    with pytest.raises(VersionError, match=r"version 1 is tagged gate.revoked=true"):
        resolve_version(client, "models:/policy@champion")


def test_a_fetch_is_checked_by_digest_and_pinned_in_the_start_tags(registry, tmp_path):
    client, uri, register = registry
    version = register(1)
    client.set_registered_model_alias("policy", "champion", version)
    local, resolved = fetch_version("models:/policy@champion", uri, tmp_path / "cache")
    digest = client.get_model_version("policy", version).tags[DIGEST_TAG]
    assert local == tmp_path / "cache" / "registry" / "policy" / f"1-{digest[:16]}"
    assert {p.name: p.read_text() for p in local.iterdir()} == {k: v.replace("{n}", "1") for k, v in FILES.items()}
    tags = start_tags("models:/policy@champion", local)
    assert tags == {"start.model_uri": "models:/policy/1", "start.model_version": "1",
                    "start.model_run_id": resolved.run_id, "start.model_sha256": model_sha256(local)}
    again, _ = fetch_version("models:/policy/1", uri, tmp_path / "cache")  # once per machine: the cached copy
    assert again == local and json.loads(local.with_suffix(".json").read_text())["version"] == "1"


def test_a_version_whose_files_changed_in_the_store_is_refused(registry, tmp_path):
    client, uri, register = registry
    version = register(1)
    stored = Path(client.get_run(client.get_model_version("policy", version).run_id).info.artifact_uri)
    (stored / "model" / "model" / "model.safetensors").write_text("weights-tampered")
    with pytest.raises(VersionError, match=r"do not match the digest taken at registration.*register the model "
                                           r"again"):
        fetch_version("models:/policy/1", uri, tmp_path / "cache")
    assert [p.suffix for p in (tmp_path / "cache" / "registry" / "policy").iterdir()] == [".lock"]  # nothing to load
    register(2, digest=False)
    with pytest.raises(VersionError, match=r"version 2 of 'policy' has no digest tag \(model.sha256\)"):
        fetch_version("models:/policy/2", uri, tmp_path / "cache")


def test_a_kubernetes_served_registry_start_must_be_fetched_onto_the_shared_volume():
    from grpo_steps.config import ConfigError, load_config
    from grpo_steps.config.pipeline import validate_config
    from grpo_steps.preflight import check_registry_start

    base = load_config(REPO_ROOT / "configs" / "multinode.yaml").model_dump(mode="json", by_alias=True)
    cfg = validate_config({**base, "model": {**base["model"], "name_or_path": "models:/grpo-policy@champion"}})
    with pytest.raises(ConfigError, match=r"set GRPO_CACHE_DIR to a folder under /shared"):
        check_registry_start(cfg, "/root/.cache/grpo-pipeline/registry/grpo-policy/3-0123456789abcdef")
    check_registry_start(cfg, "/shared/cache/registry/grpo-policy/3-0123456789abcdef")  # the server pods see it
    check_registry_start(load_config(REPO_ROOT / "configs" / "multinode.yaml"), "/root/.cache/x")  # no registry


def test_a_registered_teacher_stays_the_version_start_resolved_after_its_alias_moves(registry, tmp_path, monkeypatch):
    from grpo_steps.config import validate_config
    from grpo_steps.models import resolve_teacher
    from grpo_steps.steps import pinned_teacher, teacher_tags

    client, uri, register = registry
    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path / "cache"))
    register(1), register(2)
    client.set_registered_model_alias("policy", "champion", "1")
    cfg = validate_config({"teacher": {"model": "models:/policy@champion"}, "tracking": {"tracking_uri": uri}})
    run_id = client.create_run("0").info.run_id
    for name, value in teacher_tags(cfg, resolve_teacher(cfg, "unused")).items():  # what start tags
        client.set_tag(run_id, name, value)
    client.set_registered_model_alias("policy", "champion", "2")  # moved while the run goes on
    assert Path(resolve_teacher(cfg, "unused")).name.startswith("2-")  # the alias, read again: the new version
    resumed = Path(pinned_teacher(cfg, run_id, "unused"))  # a server (re)started in a later step or a resume
    assert resumed.name.startswith("1-")
    assert (resumed / "model.safetensors").read_text() == "weights-v1"
