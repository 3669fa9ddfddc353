"""LoRA (``train.peft``) registration of the adapter alone with its base. The LoRA flow (killed, resumed, the adapter
pushed to every replica each step, the merged model registered) runs on the two LoRA-enabled replicas of
tests/integration/test_replicas.py (one server start fewer in ``make test``)."""

import pytest

from tests.integration.flowrun import token_logprobs

pytestmark = pytest.mark.slow


def test_registry_register_adapter_registers_the_adapter_alone_with_its_base(tmp_path, tiny_model_path):
    import mlflow
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_steps import tracking
    from grpo_steps.config import REPO_ROOT, load_config, validate_config
    from grpo_steps.register import register

    torch.manual_seed(0)
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                            LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # a trained-looking adapter (B = 0 would change nothing)
    policy.save_pretrained(tmp_path / "final")
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path / "final")
    data = load_config(REPO_ROOT / "configs" / "test.yaml").model_dump(mode="json")
    data["train"]["peft"], data["registry"]["register"] = {"r": 8}, "adapter"
    data["tracking"]["tracking_uri"] = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = validate_config(data)
    mlflow.set_tracking_uri(cfg.tracking.tracking_uri)
    run = tracking.client(cfg).create_run(mlflow.set_experiment("grpo").experiment_id)
    keys = ["p1", "p2", "p3", "p4"]
    report = {"baseline": {"metrics": {"pass@1": 0.1}, "per_prompt": {"pass@1": [0.0, 0.0, 0.5, 0.0]},
                           "prompt_keys": keys},
              "trained": {"metrics": {"pass@1": 0.2}, "per_prompt": {"pass@1": [0.0, 0.5, 0.5, 0.0]},
                          "prompt_keys": keys}}
    tags = {"metaflow.pathspec": "GRPOFlow/1/register/3", "config.sha256": "x", "dataset.digest": "d",
            "git.commit": "c"}
    out = register(cfg, run.info.run_id, str(tmp_path / "final"), report, tags)
    version = tracking.client(cfg).get_model_version(out["name"], out["version"])
    assert version.tags["base_model"] == "embedded:tiny-random-qwen2"
    assert version.tags["base_model.path"] == tiny_model_path and version.tags["lora.register"] == "adapter"
    loaded = mlflow.transformers.load_model(f"models:/{out['name']}/{out['version']}", return_type="components")
    assert type(loaded["model"]).__name__.startswith("PeftModel")  # the adapter, on its base loaded from the path
    ids = list(range(3, 40))
    expected, got = token_logprobs(policy, ids), token_logprobs(loaded["model"], ids)
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-5
