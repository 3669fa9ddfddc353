from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from grpo_steps.config import (
    GRPO_ARGS_SET_BY,
    REPO_ROOT,
    ConfigError,
    load_config,
    parse_config,
    validate_config,
)

SHIPPED = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert {p.name for p in SHIPPED} >= {"local.yaml", "test.yaml", "gsm8k.yaml", "humaneval.yaml",
                                         "test-gsm8k.yaml", "test-humaneval.yaml"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_parses(path: Path):
    cfg = load_config(path)
    assert cfg.train.max_steps > 0
    assert parse_config(path.read_text())["model"]["name_or_path"] == cfg.model.name_or_path


def test_defaults_are_a_valid_config():
    cfg = validate_config({})
    assert cfg.generation.server.host == "127.0.0.1"  # loopback unless a config says otherwise
    assert len(cfg.sha256()) == 64


def test_flat_params_name_every_leaf():
    params = validate_config({}).flat_params()
    assert params["train.learning_rate"] == "1e-05"
    assert params["rewards.0.name"] == "answer_accuracy"
    assert params["generation.server.port"] == "0"


BAD_CONFIGS = [
    # (config, text the error must contain)
    ({"train": {"max_stepz": 3}}, "train.max_stepz: unknown key"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"train": {"max_steps": "many"}}, "train.max_steps"),
    ({"train": {"learning_rate": -1}}, "train.learning_rate"),
    ({"rewards": [{"name": "no_such_reward"}]}, "unknown reward 'no_such_reward'"),
    ({"rewards": []}, "name at least one reward"),
    ({"data": {"source": "jsonl"}}, "set data.path"),
    ({"train": {"per_device_train_batch_size": 6, "num_generations": 4}}, "not a multiple of num_generations"),
    ({"eval": {"num_samples": 2, "k": [1, 4]}}, "eval.k [4]"),
    ({"generation": {"provider": "ray"}}, "generation.provider"),
    ({"generation": {"provider": "kubernetes"}}, "set resources.shared_volume_claim"),
    # disk on Kubernetes: the server pods would reload files from a volume every run's pods can write, unchecked
    ({"generation": {"provider": "kubernetes"}, "resources": {"shared_volume_claim": "s"}}, "use weight_sync: s3"),
    ({"generation": {"provider": "kubernetes", "backend": "hf"}, "resources": {"shared_volume_claim": "s"}},
     "set resources.train.image"),
    ({"generation": {"provider": "kubernetes", "server": {"tensor_parallel_size": 4}},
      "resources": {"train": {"image": "i"}, "vllm": {"gpu": 2}}}, "raise resources.vllm.gpu (2)"),
    ({"generation": {"server": {"tensor_parallel_size": 2}}}, "tensor_parallel_size > 1 needs GPUs"),
    ({"generation": {"weight_sync": "nccl"}}, "needs CUDA on both sides"),
    ({"generation": {"weight_sync": "nccl"}, "train": {"processes_per_node": 8},
      "resources": {"train": {"gpu": 8}, "vllm": {"gpu": 1}}}, "use generation.provider 'kubernetes'"),
    ({"resources": {"train": {"gpu": 8}}}, "must equal resources.train.gpu (8)"),
    ({"schedule": {"cron": "0 3 * * ? *"}}, "must have 5 fields"),
    # a server (and the router the pipeline starts) on a non-loopback interface only when the config says it means it
    ({"generation": {"server": {"host": "0.0.0.0"}}}, "generation.server.host '0.0.0.0' is not a loopback address"),
    ({"project": "My Project"}, "project"),
    ({"train": {"retries": 11}}, "train.retries"),
    ({"generation": {"backend": "hf", "weight_sync": "nccl"}}, "only applies to backend 'vllm'"),
    ({"generation": {"backend": "recorded", "recorded_file": "r.jsonl", "weight_sync": "nccl"}},
     "use 'disk' with backend 'recorded'"),
    ({"generation": {"backend": "recorded"}}, "generation.recorded_file goes with backend 'recorded'"),
    # the old name of backend recorded, refused with the new one (replay is zero_signal_groups' buffer)
    ({"generation": {"backend": "replay", "replay_file": "r.jsonl"}}, "set backend: recorded and recorded_file"),
    ({"generation": {"replay_file": "r.jsonl"}}, "generation.backend 'replay' and generation.replay_file were renamed"),
    ({"generation": {"recorded_file": "r.jsonl"}}, "generation.recorded_file goes with backend 'recorded'"),
    ({"eval": {"correctness_reward": "answer_format2"}}, "not one of the configured rewards"),
    ({"generation": {"server": {"port": 70000}}}, "generation.server.port"),
    ({"data": {"source": "sqlite"}}, "data.source: Input should be 'reasoning_gym', 'gsm_symbolic', 'humaneval'"),
    ({"data": {"source": "csv"}}, "set data.path"),
    ({"data": {"columns": {"answer": "gold"}}}, "data.columns cannot name ['answer']"),
    ({"data": {"answer_format": "boxed"}}, "data.answer_format"),
    ({"data": {"task": "chain_sum", "mixture": [{"name": "a"}]}}, "move data.['task'] into each mixture entry"),
    ({"data": {"mixture": [{"name": "a"}, {"name": "a", "source": "humaneval"}]}}, "must be unique"),
    ({"data": {"num_eval": 2, "mixture": [{"name": "a", "weight": 9}, {"name": "b", "source": "humaneval"}]}},
     "entry 'b' gets 0 of data.num_eval=2"),
    ({"data": {"mixture": [{"source": "humaneval"}]}}, "data.mixture.0.name"),
    ({"data": {"mixture": [{"name": "a", "weight": 0}]}}, "data.mixture.0.weight"),
    ({"data": {"mixture": [{"name": "a", "source": "jsonl"}]}}, "set data.path"),
    ({"train": {"num_nodes": 2, "per_device_train_batch_size": 2, "num_generations": 4}},
     "its generation batch, per_device_train_batch_size x steps_per_generation (default "
     "gradient_accumulation_steps) = 2, is not a multiple of num_generations = 4"),  # a group split over 2 nodes
    ({"train": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 16,
                "grpo": {"steps_per_generation": 3}},
      "generation": {"backend": "recorded", "recorded_file": "r.jsonl"}},
     "with generation.backend 'recorded'"),  # 8 x 3 = 24 prompts a process: not whole groups of 16
    ({"eval": {"every_steps": 5}, "generation": {"backend": "hf"}},
     "eval.every_steps evaluates during training through the generation server"),  # hf: no pushes to a server
    ({"eval": {"every_steps": 5}, "generation": {"mode": "colocate"}, "resources": {"train": {"gpu": 1}}},
     "got backend 'vllm', mode 'colocate'"),
    ({"eval": {"every_steps": 5, "during_training_prompts": 101}}, "at most data.num_eval (100)"),
    ({"eval": {"every_steps": -1}}, "eval.every_steps"),
]


def test_defaults_that_depend_on_the_data_and_the_rewards_follow_them():
    """A default the user never set adapts to the config it is in, instead of refusing it; a value the user set is
    kept (and refused where it cannot work, see BAD_CONFIGS)."""
    small = validate_config({"data": {"num_eval": 8}, "eval": {"every_steps": 5}})
    assert small.eval.during_training_prompts == 8
    assert validate_config({"eval": {"every_steps": 5}}).eval.during_training_prompts == 64  # 100 eval prompts
    only_code = validate_config({"rewards": [{"name": "code_execution"}], "data": {"source": "humaneval"}})
    assert (only_code.eval.correctness_reward, only_code.eval.format_reward) == ("code_execution", None)
    no_format = validate_config({"rewards": [{"name": "answer_accuracy"}]})
    assert (no_format.eval.correctness_reward, no_format.eval.format_reward) == ("answer_accuracy", None)
    assert validate_config({}).eval.format_reward == "answer_format"  # configured: the default holds
    # the resolved config validates to itself (what the flow stores and the training job reads back)
    assert validate_config(small.model_dump(mode="json")).sha256() == small.sha256()
    with pytest.raises(ConfigError, match="eval.format_reward 'answer_format' is not one of the configured"):
        validate_config({"rewards": [{"name": "answer_accuracy"}], "eval": {"format_reward": "answer_format"}})


def test_kubernetes_refuses_disk_sync_and_names_s3():
    cluster = {"resources": {"train": {"image": "i"}, "shared_volume_claim": "s"}}
    # every shape disk took on the cluster before: pushes to the shared volume, several replicas, one replica
    for generation in ({"sync_dir": "/shared/grpo-sync", "server": {"replicas": 3}}, {"sync_dir": "/shared/grpo-sync"},
                       {}):
        with pytest.raises(ConfigError, match="weight_sync 'disk'.*every run's pods can write") as err:
            validate_config({**cluster, "generation": {"provider": "kubernetes", **generation}})
        assert "use weight_sync: s3" in str(err.value)
    s3 = validate_config({"resources": {"train": {"image": "i"}}, "model": {"name_or_path": "Qwen/Qwen2.5-0.5B"},
                          "generation": {"provider": "kubernetes", "weight_sync": "s3", "server": {"replicas": 3},
                                         "s3_sync": {"url": "s3://grpo-bucket/weights"}}})
    assert (s3.generation.weight_sync, s3.generation.server.replica_count) == ("s3", 3)
    local = validate_config({"generation": {"sync_dir": "/tmp/grpo-sync"}})  # disk stays the local default
    assert local.generation.weight_sync == "disk"


def test_split_groups_are_fine_when_trl_generates():
    split = {"num_nodes": 2, "per_device_train_batch_size": 2, "num_generations": 4}  # a group over 2 nodes
    assert validate_config({"train": split, "generation": {"backend": "hf"}}).train.num_nodes == 2


@pytest.mark.parametrize(("data", "message"), BAD_CONFIGS)
def test_bad_configs_are_rejected_with_a_clear_message(data, message):
    with pytest.raises(ConfigError) as err:
        validate_config(data)
    assert message in str(err.value)


def test_yaml_that_is_not_a_mapping_is_rejected():
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        parse_config("- a\n- b\n")


def test_a_non_loopback_server_host_passes_when_declared():
    assert validate_config({"generation": {"server": {"host": "0.0.0.0", "remote_access": True}}})
    assert validate_config({"generation": {"server": {"host": "localhost"}}})


def test_config_is_immutable():
    cfg = validate_config({})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.max_steps = 5


def test_load_config_reports_the_file(tmp_path):
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump({"model": {"nme": "x"}}))
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)


def test_a_resolved_mixture_config_round_trips():
    data = {"data": {"mixture": [{"name": "math"}, {"name": "code", "source": "humaneval"}]}}
    resolved = parse_config(yaml.safe_dump(data))  # what the flow's Config stores: every default written out
    assert validate_config(resolved).data.mixture[1].source == "humaneval"


# --- train.grpo may not set what the config sets ----------------------------------------------------------

GRPO_OWNED = [
    # (train.grpo, text the error must contain)
    ({"num_generations": 4}, "train.grpo.num_generations is set by train.num_generations: set it there"),
    ({"max_completion_length": 99}, "train.grpo.max_completion_length is set by generation.max_completion_tokens"),
    ({"reward_weights": [1.0]}, "train.grpo.reward_weights is set by rewards[].weight: set it there"),
    ({"data_seed": 1}, "train.grpo.data_seed is set by train.seed"),  # one config key sets two fields
    ({"output_dir": "/tmp/x"}, "train.grpo.output_dir is set by the pipeline (each node's scratch directory): "
                               "remove it"),  # no config key: the pipeline decides
    ({"use_vllm": True}, "train.grpo.use_vllm is set by generation.weight_sync"),  # set only with nccl, still owned
    ({"deepspeed": "ds.json"}, "train.grpo.deepspeed is set by train.deepspeed"),
    ({"num_iterations": 2, "beta": 0.1, "seed": 3},
     "train.grpo.beta is set by train.beta: set it there; train.grpo.seed is set by train.seed"),  # every one named
]


@pytest.mark.parametrize(("grpo", "message"), GRPO_OWNED)
def test_train_grpo_cannot_override_what_the_config_sets(grpo, message):
    with pytest.raises(ConfigError) as err:
        validate_config({"train": {"grpo": grpo}})
    assert message in str(err.value)


def test_every_owned_grpo_key_is_rejected_and_other_fields_pass():
    for key in GRPO_ARGS_SET_BY:
        with pytest.raises(ConfigError, match=f"train.grpo.{key} is set by"):
            validate_config({"train": {"grpo": {key: None}}})
    grpo = {"num_iterations": 2, "epsilon_high": 0.28, "disable_tqdm": False}  # GRPOConfig fields the config leaves
    assert validate_config({"train": {"grpo": grpo}}).train.grpo == grpo


NCCL_DEEPSPEED = {"generation": {"weight_sync": "nccl", "provider": "kubernetes"}, "train": {"deepspeed": True},
                  "resources": {"train": {"gpu": 1, "image": "i"}, "vllm": {"gpu": 1}, "shared_volume_claim": "s"}}


def test_the_owned_keys_are_exactly_what_grpo_args_derives():
    import dataclasses

    from trl import GRPOConfig

    from grpo_steps.training.job import GRPO_DEFAULTS, TrainJob, config_grpo_kwargs

    derived: set[str] = set()
    colocate = {"generation": {"mode": "colocate"}, "resources": {"train": {"gpu": 1}}}
    for data in ({}, NCCL_DEEPSPEED, colocate):  # the default path, and those that set every optional field
        job = TrainJob(config=validate_config(data), model_path="m", train_file="t", output_dir="o",
                       server={"provider": "external", "endpoint": "http://127.0.0.1:9"})
        for on_cpu in (True, False):
            derived |= set(config_grpo_kwargs(job, on_cpu=on_cpu))
    assert derived == set(GRPO_ARGS_SET_BY)
    assert not set(GRPO_DEFAULTS) & derived  # defaults stay overridable
    assert derived | set(GRPO_DEFAULTS) <= {f.name for f in dataclasses.fields(GRPOConfig)}  # real fields


def test_every_config_field_is_documented():
    """Each field of every config section has a docstring under it (the reference page's description of it)."""
    import inspect

    import pydantic

    import grpo_steps.config as config_module
    from grpo_steps.config.reference import attribute_docstrings

    sections = [cls for cls in vars(config_module).values() if inspect.isclass(cls)
                and issubclass(cls, pydantic.BaseModel) and cls.__module__.startswith(config_module.__name__)]
    assert len(sections) > 10
    undocumented = [f"{cls.__name__}.{name}" for cls in sections for name, field in cls.model_fields.items()
                    if not (field.description or attribute_docstrings(cls).get(name, "")).strip()]
    assert undocumented == [], f"add a docstring under each of {undocumented} in grpo_steps/config/"


def test_a_local_model_directory_is_checked_for_config_tokenizer_and_weights(tmp_path, tiny_model_path):
    from grpo_steps.models import check_model_dir

    check_model_dir(Path(tiny_model_path))  # what save_pretrained writes passes
    (tmp_path / "README.md").write_text("later")
    with pytest.raises(FileNotFoundError) as err:
        check_model_dir(tmp_path)
    assert "missing config.json; tokenizer files" in str(err.value) and "weights (*.safetensors" in str(err.value)
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"missing weights \(\*\.safetensors or pytorch_model\*\.bin\)\. Point"):
        check_model_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_model_dir(tmp_path)
