"""LoRA (``train.peft``) config: bad combinations rejected before anything runs, naming the key; the target-module
check against the architecture; what the local server and TRL get."""

import pytest

from grpo_steps.config import REPO_ROOT, ConfigError, load_config, validate_config
from grpo_steps.lora import check_target_modules, linear_module_names
from grpo_steps.servers.local import vllm_command

PEFT = {"r": 8, "alpha": 16}
GPU_NCCL = {"generation": {"weight_sync": "nccl", "provider": "external",
                           "server": {"endpoint": "http://127.0.0.1:8000"}},
            "resources": {"train": {"gpu": 1}}}

BAD = [
    ({"train": {"peft": {"r": 0}}}, "train.peft.r"),  # a rank must be positive
    ({"train": {"peft": {"r": 1024}}}, "train.peft.r"),  # vLLM serves ranks up to 512
    ({"train": {"peft": {"alpha": 0}}}, "train.peft.alpha"),
    ({"train": {"peft": {"dropout": 1.0}}}, "train.peft.dropout"),  # dropout of everything
    ({"train": {"peft": {"target_modules": []}}}, "train.peft.target_modules is empty"),
    ({"train": {"peft": {"target_modules": ["q_proj", "lm_head"]}}}, "cannot hold 'lm_head'"),  # TRL refuses it
    ({"train": {"peft": {"target_modules": "all"}}}, "train.peft.target_modules"),  # only 'all-linear' as a string
    ({"train": {"peft": {"rank": 8}}}, "train.peft.rank: unknown key"),  # a typo
    ({"registry": {"register": "adapter"}}, "registry.register 'adapter' registers a LoRA adapter"),  # no peft
    ({"registry": {"register": "lora"}, "train": {"peft": PEFT}}, "registry.register"),  # not merged|adapter
    ({"train": {"peft": PEFT, "grpo": {"sync_ref_model": True}}}, "sync_ref_model is not supported with train.peft"),
    ({"train": {"peft": {**PEFT, "push": "weights"}}}, "train.peft.push"),  # adapter | merged
    ({"train": {"peft": {**PEFT, "push": "merged"}, "deepspeed": True}},  # ZeRO-3 partitions the weights to merge
     "train.peft.push 'merged' merges the adapter from one process's full weights"),
]


@pytest.mark.parametrize(("data", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_lora_configs_are_rejected_naming_the_key(data, message):
    with pytest.raises(ConfigError) as err:
        validate_config(data)
    assert message in str(err.value)


def test_target_modules_are_checked_against_the_architecture(tiny_model_path):
    names = linear_module_names(tiny_model_path)
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= set(names)
    assert "lm_head" not in names
    check_target_modules(validate_config({"train": {"peft": {"target_modules": ["q_proj", "v_proj"]}}}).train.peft,
                         tiny_model_path)
    check_target_modules(validate_config({"train": {"peft": {}}}).train.peft, tiny_model_path)  # all-linear
    bad = validate_config({"train": {"peft": {"target_modules": ["q_proj", "query_key_value"]}}}).train.peft
    with pytest.raises(ConfigError) as err:
        check_target_modules(bad, tiny_model_path)
    assert "train.peft.target_modules ['query_key_value']" in str(err.value)
    assert "q_proj" in str(err.value)  # lists what the architecture has


@pytest.mark.parametrize(("r", "max_rank"), [(1, 1), (4, 8), (8, 8), (12, 16), (300, 320), (512, 512)])
def test_the_server_rank_limit_is_vllms_next_allowed_rank(r, max_rank):
    assert validate_config({"train": {"peft": {"r": r}}}).train.peft.max_lora_rank == max_rank


def test_lora_server_command_enables_runtime_adapters():
    cmd = vllm_command("/m", "127.0.0.1", 8000, max_model_len=256, dtype="float32", enforce_eager=True,
                       extra_args=[], max_lora_rank=16)
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16" and "--enable-lora" in cmd
    plain = vllm_command("/m", "127.0.0.1", 8000, max_model_len=256, dtype="float32", enforce_eager=True,
                         extra_args=[])
    assert "--enable-lora" not in plain


def test_a_cpu_servers_kv_block_size_is_the_pipelines_unless_the_config_gives_one():
    from grpo_steps.servers.local import CPU_BLOCK_SIZE

    cmd = vllm_command("/m", "127.0.0.1", 8000, max_model_len=256, dtype="float32", enforce_eager=True,
                       extra_args=[], block_size=CPU_BLOCK_SIZE)
    assert cmd[cmd.index("--block-size") + 1] == "32"
    mine = vllm_command("/m", "127.0.0.1", 8000, max_model_len=256, dtype="float32", enforce_eager=True,
                        extra_args=["--block-size", "64"], block_size=CPU_BLOCK_SIZE)
    assert mine[len(mine) - 1 - mine[::-1].index("--block-size") + 1] == "64"  # the last one given: vLLM's parser
    assert "--block-size" not in vllm_command("/m", "127.0.0.1", 8000, max_model_len=256, dtype="float32",
                                              enforce_eager=True, extra_args=[])  # GPU: vLLM's own default


def test_peft_with_trl_server_mode_is_accepted_merged_weights_are_pushed():
    # TRL's nccl server mode merges the adapter and pushes merged weights (no runtime LoRA on that server)
    cfg = validate_config({**GPU_NCCL, "train": {"peft": PEFT}})
    assert cfg.train.peft.r == 8


def test_lora_config_reaches_trl_as_a_peft_lora_config():
    peft = validate_config({"train": {"peft": {"r": 4, "alpha": 8, "dropout": 0.1}}}).train.peft.lora_config()
    assert (peft.r, peft.lora_alpha, peft.lora_dropout, peft.target_modules) == (4, 8, 0.1, "all-linear")
    assert peft.task_type == "CAUSAL_LM"


def test_registry_register_round_trips_under_its_own_name():
    cfg = validate_config({"train": {"peft": PEFT}, "registry": {"register": "adapter"}})
    assert cfg.registry.register_as == "adapter"
    assert cfg.model_dump(mode="json")["registry"]["register"] == "adapter"
    assert validate_config(cfg.model_dump(mode="json")) == cfg


def test_shipped_lora_config_trains_an_adapter():
    cfg = load_config(REPO_ROOT / "configs" / "lora.yaml")
    assert cfg.train.peft is not None and cfg.model.name_or_path == "embedded:SmolLM2-135M-Instruct"


def test_merged_push_starts_no_lora_server_adapter_push_does():
    merged = validate_config({"train": {"peft": {**PEFT, "push": "merged"}}})
    assert not merged.serves_adapter and validate_config({"train": {"peft": PEFT}}).serves_adapter
    assert not validate_config({}).serves_adapter  # full fine-tuning


def test_merged_state_dict_is_base_plus_adapter_under_base_names(tiny_model_path):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_steps.training.generation.disk import merged_state_dict

    torch.manual_seed(0)
    base_names = set(AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict())
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                            validate_config({"train": {"peft": PEFT}}).train.peft.lora_config())
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # B starts at 0 (a no-op adapter): give it a value so the merge shows
            torch.nn.init.normal_(param, std=0.05)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = merged_state_dict(policy)
    assert set(merged) == base_names  # the base model's names, no lora_ entries
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())  # the policy is not changed
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    plain.load_state_dict(merged)
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
    policy.eval()
    with torch.no_grad():
        expected, got = policy(input_ids=ids).logits, plain(input_ids=ids).logits
        unadapted = AutoModelForCausalLM.from_pretrained(tiny_model_path)(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, unadapted, atol=1e-3)  # the adapter did change the weights
