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
    ({"generation": {"weight_sync": "s3", "s3_sync": {"anchor_every": 1001}}}, "less than or equal to 1000"),
])
def test_what_s3_sync_refuses_names_the_fix(config, says):
    with pytest.raises((ValueError, ConfigError), match=says):
        validate_config(config)


def _on_kubernetes(weight_sync: str = "s3", model: str = "Qwen/Qwen2.5-0.5B-Instruct", **vllm) -> dict:
    return {"model": {"name_or_path": model}, "generation": {"provider": "kubernetes", "weight_sync": weight_sync},
            "resources": {"train": {"image": "registry.example/grpo:1"}, "vllm": vllm}}


def test_s3_sync_on_kubernetes_needs_no_shared_volume():
    """Pushes and evaluation's weights reach the server pods through S3: no ReadWriteMany volume, and the pods read
    S3 with the named Secret's keys (or their own identity when none is named)."""
    cfg = validate_config(_on_kubernetes(s3_secret_name="grpo-s3-readonly"))
    assert cfg.resources.shared_volume_claim is None
    assert cfg.resources.vllm.s3_secret_name == "grpo-s3-readonly"
    assert cfg.flat_params()["resources.vllm.s3_secret_name"] == "grpo-s3-readonly"  # a name, not redacted
    assert validate_config(_on_kubernetes()).resources.vllm.s3_secret_name is None  # IRSA, instance role


@pytest.mark.parametrize(("config", "says"), [
    # disk and nccl still load evaluation's weights (and disk its pushes) from the shared volume
    (_on_kubernetes("disk"), "weight_sync 'disk': the server reloads weights from paths the flow writes; set "
                             "resources.shared_volume_claim"),
    (_on_kubernetes("disk"), "or use weight_sync 's3' \\(pushes and evaluation weights through S3\\)"),
    # without the volume the server pods start from model.name_or_path, which must be something they can read
    (_on_kubernetes(model="embedded:SmolLM2-135M-Instruct"), "use a Hugging Face id"),
    (_on_kubernetes(model="/shared/models/qwen"), "cannot read"),
    # the Secret is named, never given: a key pasted there is refused without being echoed
    (_on_kubernetes(s3_secret_name="Grpo_S3"), "not a Kubernetes Secret name"),
    ({"resources": {"vllm": {"s3_secret_name": "grpo-s3"}}},
     "s3_secret_name gives the server pods S3 credentials .* \\(got weight_sync 'disk'"),
    ({"generation": {"weight_sync": "s3"}, "resources": {"vllm": {"s3_secret_name": "grpo-s3"}}},
     "provider 'local'\\): remove it"),
])
def test_what_s3_sync_on_kubernetes_refuses_names_the_fix(config, says):
    with pytest.raises(ConfigError, match=says):
        validate_config(config)


def test_a_key_given_as_the_secret_name_is_not_echoed():
    key = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    with pytest.raises(ConfigError, match="never the keys themselves") as refused:
        validate_config(_on_kubernetes(s3_secret_name=key))
    assert key not in str(refused.value)


def test_the_location_defaults_to_the_metaflow_datastore_and_the_endpoint_to_metaflows():
    from grpo_steps.weights.chain import run_store

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
    from grpo_steps.weights.chain import ChainStoreError

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    check_weight_store(_cfg())  # the Metaflow datastore's bucket
    # boto3's default session keeps the credentials it first resolved: a client with the wrong secret, explicitly
    from grpo_steps.weights.chain import make_client
    from grpo_steps.weights.publisher import ChainPublisher

    wrong = ChainPublisher(make_client(s3.endpoint, access_key=s3.access_key, secret_key="wrong", max_attempts=1),
                           s3.bucket, "weight-sync/x")
    with pytest.raises(ChainStoreError, match=f"s3://{s3.bucket}/weight-sync/x/access-check"):
        wrong.check_access()


def test_pushes_in_flight_are_refused_where_the_servers_cannot_take_them():
    """``generation.async.in_flight: true`` needs full-weight pushes through the pipeline's transfer engine: refused in
    ``start`` with adapter pushes (by default, null, they drain instead); on Kubernetes only ``s3`` pushes at all, and
    takes it."""
    adapter = {"generation": {"async": {"in_flight": True}}, "train": {"peft": {"r": 8, "alpha": 16}}}
    with pytest.raises((ValueError, ConfigError), match="train.peft.push 'adapter'"):
        validate_config(adapter)
    adapter["generation"]["async"] = True  # in_flight null: accepted, pushes drain where they cannot be in flight
    assert validate_config(adapter).generation.async_.in_flight is None
    # on Kubernetes only s3 takes pushes at all (disk is refused there, nccl takes no async): in flight or not
    kube_disk = _on_kubernetes("disk")
    kube_disk["resources"]["shared_volume_claim"] = "grpo-shared"
    kube_disk["generation"].update({"sync_dir": "/shared/grpo-sync", "async": {"in_flight": True}})
    with pytest.raises(ConfigError, match="use weight_sync: s3"):
        validate_config(kube_disk)
    kube_s3 = _on_kubernetes()
    kube_s3["generation"]["async"] = {"in_flight": True}
    assert validate_config(kube_s3).generation.async_.in_flight is True


def test_start_refuses_the_flows_own_secret_for_the_server_pods(monkeypatch):
    """The flow's Secrets (Metaflow's METAFLOW_KUBERNETES_SECRETS, METAFLOW_ARGO_WORKFLOWS_KUBERNETES_SECRETS, as
    infra/metaflow/config-k8s-argo.json sets them) write the datastore and the chain: refused for the server pods, which
    get a read-only Secret of their own (the shipped cluster configs' grpo-s3-readonly) or their own identity."""
    from metaflow import metaflow_config

    from grpo_steps.config import load_config
    from grpo_steps.config.base import REPO_ROOT
    from grpo_steps.preflight import check_server_secret, flow_secrets

    monkeypatch.setattr(metaflow_config, "KUBERNETES_SECRETS", "grpo-s3-credentials,grpo-mlflow-credentials")
    monkeypatch.setattr(metaflow_config, "ARGO_WORKFLOWS_KUBERNETES_SECRETS", " grpo-argo-s3 ,")
    assert flow_secrets() == {"grpo-s3-credentials", "grpo-mlflow-credentials", "grpo-argo-s3"}
    for flows_own in ("grpo-s3-credentials", "grpo-argo-s3"):
        with pytest.raises(ConfigError, match=f"s3_secret_name '{flows_own}' is a Secret of the flow's own pods.*"
                                              "read-only access to generation.s3_sync.url's prefix"):
            check_server_secret(validate_config(_on_kubernetes(s3_secret_name=flows_own)).resources.vllm.s3_secret_name)
    for shipped in ("multinode.yaml", "gpu-1node.yaml"):  # the documented default passes
        check_server_secret(load_config(REPO_ROOT / "configs" / shipped).resources.vllm.s3_secret_name)
    check_server_secret(None)  # the pods' own identity (IRSA)
    monkeypatch.setattr(metaflow_config, "KUBERNETES_SECRETS", "")
    monkeypatch.setattr(metaflow_config, "ARGO_WORKFLOWS_KUBERNETES_SECRETS", "")
    check_server_secret("grpo-s3-credentials")  # no flow Secret configured (a local run): nothing to compare
