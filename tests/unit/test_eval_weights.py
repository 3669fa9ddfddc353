"""How the ``evaluate`` step hands the baseline and the trained policy to the generation server: one mechanism for every
provider (:func:`grpo_steps.weights.staging.stage_update` -> :class:`grpo_steps.weights.update.WeightUpdate` ->
:meth:`grpo_steps.servers.client.VLLMClient.load_weights`): a directory the server reads (with its tensors' digest), or,
with ``weight_sync: s3``, a version published under the run's S3 prefix (no shared volume). No server runs here: the S3
cases use the project's real S3 server (marked ``s3``)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import pytest

from grpo_steps.config import validate_config
from grpo_steps.servers import GenerationServer, KubernetesServer, LocalServer, ReplicaSet
from grpo_steps.servers.client import VLLMClient
from grpo_steps.weights.staging import stage_update
from grpo_steps.weights.update import WeightUpdate

RUN_ID = "argo-grpoflow-x7k2p"


def _weights(tmp_path, name="final", value=1.0):
    import torch
    from safetensors.torch import save_file

    directory = tmp_path / name
    directory.mkdir()
    save_file({"model.embed_tokens.weight": torch.full((4, 3), value),
               "model.norm.weight": torch.arange(3, dtype=torch.bfloat16)}, directory / "model.safetensors")
    return directory


def test_without_a_store_the_server_reads_the_directory_where_it_stages_it(tmp_path, monkeypatch):
    """``disk`` and ``nccl`` sync: a local server (and replicas of it) reads the directory where it is; a Kubernetes
    server, from its copy on the shared volume."""
    from grpo_steps.weights.files import read_safetensors
    from grpo_steps.weights.manifest import tensors_digest

    weights = _weights(tmp_path)
    digest = tensors_digest(read_safetensors(weights))  # the tensors as this machine holds them
    assert stage_update(weights, "trained", GenerationServer("http://x").stage_weights) == \
        WeightUpdate(path=str(weights), tensors_sha256=digest)
    local = LocalServer("http://127.0.0.1:1").to_dict()
    replicas = ReplicaSet("http://127.0.0.1:2", replicas=(local, local))
    assert stage_update(weights, "baseline", replicas.stage_weights) == \
        WeightUpdate(path=str(weights), tensors_sha256=digest)
    shared = tmp_path / "shared"
    monkeypatch.setattr(KubernetesServer.stage_weights, "__defaults__", (str(shared),))  # /shared in a pod
    update = stage_update(weights, "trained", KubernetesServer("http://x", run_id=RUN_ID).stage_weights)
    # the copy on the shared volume, named with the digest of the tensors here: a copy swapped there is refused
    assert update == WeightUpdate(path=str(shared / "grpo" / RUN_ID / "trained"), tensors_sha256=digest)
    assert (shared / "grpo" / RUN_ID / "trained" / "model.safetensors").exists()


def test_a_hub_id_is_staged_from_its_snapshot(tmp_path, monkeypatch):
    """The baseline of a hub-id model (what the server pods start from without a shared volume) is staged from the
    files of its snapshot in this pod's Hugging Face cache, not from the id."""
    import huggingface_hub

    from grpo_steps.models import weights_dir

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, allow_patterns: asked.append((repo_id, allow_patterns)) or str(tmp_path))
    assert weights_dir("Qwen/Qwen2.5-0.5B-Instruct") == str(tmp_path)
    assert asked == [("Qwen/Qwen2.5-0.5B-Instruct", ["*.safetensors", "*.safetensors.index.json"])]
    assert weights_dir(str(tmp_path)) == str(tmp_path) and len(asked) == 1  # a directory is its own


@dataclass
class RecordingClient:
    """The part of :class:`VLLMClient` that :func:`served_policy` drives, recording each weight load."""

    base_model: str = "policy"
    model: str = "policy"
    loads: list = field(default_factory=list)

    def load_weights(self, update, label: str | None = None) -> float:
        self.loads.append((update, label))
        return 0.0


@dataclass(frozen=True)
class RecordingServer(GenerationServer):
    """A server handle without runtime LoRA."""

    runtime_lora = False


@pytest.fixture(autouse=True)
def recorded_staging(monkeypatch):
    """Evaluation's staging records what it was asked (the update it returns names the directory's files)."""
    from pathlib import Path

    from grpo_steps.evaluation import comparison

    def record(weights_dir, label, readable, store=None, dtype=None) -> dict:
        files = sorted(p.name for p in Path(weights_dir).iterdir())
        return {"staged": files, "label": label, "store": store, "dtype": dtype}

    monkeypatch.setattr(comparison, "stage_update", record)


def test_served_policy_loads_full_weights_from_what_the_server_staged(tmp_path):
    from grpo_steps.evaluation.comparison import served_policy

    cfg, client, weights = validate_config({}), RecordingClient(), _weights(tmp_path)
    store = {"bucket": "b", "prefix": "weight-sync/run-1", "endpoint_url": None}
    with served_policy(cfg, RecordingServer("http://x"), client, str(weights), "trained", store):
        assert client.model == "policy"
    assert client.loads == [({"staged": ["model.safetensors"], "label": "trained", "store": store,
                              "dtype": "float32"}, "eval-trained")]  # published in the serving dtype, model.dtype


def test_a_lora_adapter_under_s3_sync_is_evaluated_as_merged_full_weights(tmp_path, monkeypatch):
    """``s3`` sync pushes merged weights (``train.peft.push: merged``): evaluation publishes base + adapter merged, as
    full weights, through the run's store, and never asks the server to read an adapter directory."""
    from grpo_steps import lora
    from grpo_steps.evaluation.comparison import served_policy

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "base")}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")

    merged_in = []

    def merge(base, adapter_dir, out_dir, dtype=None):
        merged_in.append(dtype)
        return _weights(tmp_path, "merged", 2.0)

    monkeypatch.setattr(lora, "merge_adapter", merge)
    cfg = validate_config({"generation": {"weight_sync": "s3"}, "train": {"peft": {"r": 8, "alpha": 16,
                                                                                    "push": "merged"}}})
    client, store = RecordingClient(), {"bucket": "b", "prefix": "p", "endpoint_url": None}
    with served_policy(cfg, RecordingServer("http://x"), client, str(adapter), "trained", store):
        assert client.model == "policy"  # the base name: no adapter was loaded
    ((update, label),) = client.loads
    assert (update["store"], label) == (store, "eval-trained") and update["staged"] == ["model.safetensors"]
    assert merged_in == [update["dtype"]] == ["float32"]  # merged and published in the serving dtype (model.dtype)


def test_load_weights_takes_a_directory_or_a_chain_version_on_every_replica(monkeypatch):
    """A directory goes through ``reload_weights`` (which falls back to vLLM's own reload on a server without the
    pipeline's transfer engine), a chain version through the weight-update protocol; on each replica, in parallel."""
    calls = []

    def reload_weights(self, weights_dir, direct=True, label=None, tensors_sha256=None):
        calls.append(("path", self.endpoint, weights_dir, label, tensors_sha256))
        return 1.0

    def update_weights(self, update, label=None):
        calls.append(("s3", self.endpoint, update.version, label, update.sha256))
        return 2.0

    monkeypatch.setattr(VLLMClient, "reload_weights", reload_weights)
    monkeypatch.setattr(VLLMClient, "update_weights", update_weights)
    routed = VLLMClient("http://router", replicas=("http://r0", "http://r1"))
    a, b = "a" * 64, "b" * 64
    assert routed.load_weights(WeightUpdate(path="/shared/x", tensors_sha256=a), "eval-baseline") == 1.0
    assert routed.load_weights(WeightUpdate.of_chain({"bucket": "b", "prefix": "p"}, 0, b), "eval-trained") == 2.0
    assert sorted(calls) == [("path", "http://r0", "/shared/x", "eval-baseline", a),
                             ("path", "http://r1", "/shared/x", "eval-baseline", a),
                             ("s3", "http://r0", 0, "eval-trained", b), ("s3", "http://r1", 0, "eval-trained", b)]


@pytest.fixture
def store(s3, monkeypatch):
    """The run's weight store on the real S3 server (credentials in the environment, as a server pod gets them)."""
    from grpo_steps.weights.chain import run_store

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    cfg = validate_config({"generation": {"weight_sync": "s3", "s3_sync": {"url": f"s3://{s3.bucket}/weight-sync"}}})
    return run_store(cfg.generation.s3_sync, f"GRPOFlow/{uuid.uuid4().hex[:12]}")


def _keys(store) -> list[str]:
    from grpo_steps.weights.chain import make_client

    page = make_client(store["endpoint_url"]).list_objects_v2(Bucket=store["bucket"], Prefix=store["prefix"] + "/")
    return [o["Key"] for o in page.get("Contents", [])]


@pytest.mark.s3
@pytest.mark.parametrize("server", [KubernetesServer("http://x", run_id=RUN_ID), LocalServer("http://127.0.0.1:1")],
                         ids=["kubernetes", "local"])
def test_with_a_store_the_weights_are_a_version_under_the_runs_eval_prefix(store, server, tmp_path):
    """``weight_sync: s3``: whatever the provider, the directory's tensors become version 0 of a chain under
    ``<run prefix>/eval/<label>``, bit-exact as a server fetches them; a retried step replaces it; the flow's ``end``
    (deleting the run's prefix) deletes it."""
    import torch
    from safetensors.torch import load_file

    from grpo_steps.weights.chain import ChainRefusedError, chain_of
    from grpo_steps.weights.publisher import remove_run_versions

    update = stage_update(_weights(tmp_path, value=1.0), "trained", server.stage_weights, store)
    where = {**store, "prefix": f"{store['prefix']}/eval/trained"}
    assert update == WeightUpdate.of_chain(where, 0, update.sha256)
    json.dumps(update.request())  # a request body: no credentials, nothing but JSON
    again = stage_update(_weights(tmp_path, "retry", value=3.0), "trained", server.stage_weights, store)  # a retry
    assert again.s3 == update.s3 and again.sha256 != update.sha256  # other weights, another digest
    assert chain_of(where).versions() == [0]
    with pytest.raises(ChainRefusedError, match="not the one the trainer published"):  # the first staging's digest
        chain_of(where).fetch(0, sha256=update.sha256)
    fetched = chain_of(where).fetch(0, sha256=again.sha256)
    expected = load_file(tmp_path / "retry" / "model.safetensors")
    assert fetched.keys() == expected.keys()
    for name, tensor in expected.items():  # the dtypes the files hold (bf16 stays bf16), bits as written
        assert fetched[name].dtype == tensor.dtype and torch.equal(fetched[name], tensor)
    # in the serving dtype (the evaluate step passes model.dtype): a server refuses another dtype (vllm_worker)
    served = stage_update(_weights(tmp_path, "cast", value=3.0), "trained", server.stage_weights, store, "float32")
    cast = chain_of(where).fetch(0, sha256=served.sha256)
    assert {t.dtype for t in cast.values()} == {torch.float32}
    assert torch.equal(cast["model.norm.weight"], expected["model.norm.weight"].float())
    stage_update(_weights(tmp_path, "base"), "baseline", server.stage_weights, store)
    assert {key.split("/eval/")[1].split("/")[0] for key in _keys(store)} == {"baseline", "trained"}
    assert remove_run_versions(store) > 0 and _keys(store) == []


def test_on_kubernetes_evaluation_stages_through_s3_or_the_checked_extension():
    """The staging choice on Kubernetes, where every run's pods can write the shared volume: ``s3`` sync stages
    through the run's chain (a store, the manifest's digest in the request); ``nccl`` has no chain route into the
    server (its one weight-transfer backend is TRL's nccl), so it stages on the volume and its server loads through the
    worker extension, which checks the tensors' digest; ``disk`` is refused at ``start``."""
    from grpo_steps.config import ConfigError
    from grpo_steps.servers import k8s_manifests
    from grpo_steps.steps import weight_store

    cluster = {"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"},
               "train": {"processes_per_node": 8, "per_device_train_batch_size": 8, "num_generations": 8},
               "resources": {"train": {"gpu": 8, "image": "i"}, "vllm": {"gpu": 1}, "shared_volume_claim": "s"}}
    s3 = validate_config({**cluster, "generation": {"provider": "kubernetes", "weight_sync": "s3",
                                                    "s3_sync": {"url": "s3://grpo-bucket/weights"}}})
    assert weight_store(s3, RUN_ID)["prefix"].startswith("weights/")  # stage_update publishes under <prefix>/eval/
    assert "--worker-extension-cls" in k8s_manifests.server_args(s3, "m")  # with the s3 transfer engine
    nccl = validate_config({**cluster, "generation": {"provider": "kubernetes", "weight_sync": "nccl"}})
    assert weight_store(nccl, RUN_ID) is None  # a directory on the volume, with its tensors' digest
    args = k8s_manifests.server_args(nccl, "m")
    assert args[args.index("--worker-extension-cls") + 1] == "grpo_steps.vllm_worker.WorkerExtension"
    with pytest.raises(ConfigError, match="use weight_sync: s3"):
        validate_config({**cluster, "generation": {"provider": "kubernetes", "weight_sync": "disk",
                                                   "sync_dir": "/shared/grpo-sync"}})
