"""``generation.weight_sync: s3``: what the config accepts and refuses, where the versions go, and start's check of the
bucket (on the project's real S3 server)."""

from __future__ import annotations

import pytest

from grpo_steps.config import ConfigError, validate_config


def _cfg(**generation):
    return validate_config({"generation": {"weight_sync": "s3", **generation}})


def test_s3_sync_is_a_server_push_with_async_and_intervals():
    cfg = _cfg(**{"async": {"max_staleness": 2}, "weight_sync_every": 2,
                  "s3_sync": {"url": "s3://bucket/runs", "anchor_every": 5}})
    assert cfg.generation.pushes_to_server
    assert cfg.generation.s3_sync.location() == ("bucket", "runs")


@pytest.mark.parametrize(("config", "says"), [
    ({"generation": {"weight_sync": "s3", "backend": "hf"}}, "only applies to backend 'vllm'"),
    ({"generation": {"weight_sync": "s3", "mode": "colocate"}}, "mode 'colocate' loads the weights in memory"),
    ({"generation": {"weight_sync": "s3"}, "train": {"peft": {"r": 8, "alpha": 16}}}, "train.peft.push: merged"),
    ({"generation": {"weight_sync": "s3", "s3_sync": {"url": "/local/dir"}}}, "is not an s3://bucket/prefix URL"),
    ({"generation": {"weight_sync": "s3", "s3_sync": {"anchor_every": 0}}}, "greater than or equal to 1"),
    ({"generation": {"weight_sync": "s3", "provider": "kubernetes"}, "resources": {"shared_volume_claim": "rwx"}},
     "not available yet"),
])
def test_what_s3_sync_refuses_names_the_fix(config, says):
    with pytest.raises((ValueError, ConfigError), match=says):
        validate_config(config)


def test_the_location_defaults_to_the_metaflow_datastore_and_the_endpoint_to_metaflows():
    from grpo_steps.weight_chain import run_store

    s3_sync = _cfg().generation.s3_sync
    env = {"METAFLOW_DATASTORE_SYSROOT_S3": "s3://data/metaflow/", "METAFLOW_S3_ENDPOINT_URL": "http://127.0.0.1:1"}
    assert s3_sync.location(env) == ("data", "metaflow/weight-sync")
    assert s3_sync.endpoint(env) == "http://127.0.0.1:1"
    assert s3_sync.location({}) is None
    merged = _cfg(s3_sync={"url": "s3://bucket", "endpoint_url": "http://minio:9000"}).generation.s3_sync
    assert run_store(merged, "run-1") == {"bucket": "bucket", "prefix": "run-1", "endpoint_url": "http://minio:9000"}


def test_start_refuses_s3_sync_without_a_place(monkeypatch):
    from grpo_steps.preflight import check_weight_store

    monkeypatch.delenv("METAFLOW_DATASTORE_SYSROOT_S3", raising=False)
    with pytest.raises(ConfigError, match="generation.s3_sync.url"):
        check_weight_store(_cfg())


@pytest.mark.s3
def test_start_checks_the_bucket_answers(s3, monkeypatch):
    from grpo_steps.preflight import check_weight_store
    from grpo_steps.weight_chain import ChainStoreError

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    check_weight_store(_cfg())  # the Metaflow datastore's bucket
    # boto3's default session keeps the credentials it first resolved: a client with the wrong secret, explicitly
    from grpo_steps.weight_chain import WeightChain, make_client

    wrong = WeightChain(make_client(s3.endpoint, access_key=s3.access_key, secret_key="wrong", max_attempts=1),
                        s3.bucket, "weight-sync/x")
    with pytest.raises(ChainStoreError, match=f"s3://{s3.bucket}/weight-sync/x/access-check"):
        wrong.check_access()
