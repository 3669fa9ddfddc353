"""What the pipeline assumes of the installed TRL: the algorithm lists the config validates against without
importing trl, the ``GRPOConfig`` a config becomes, and the code paths ``ServerGRPOTrainer`` opens."""

import dataclasses
import inspect
import re

import pytest

from grpo_steps.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, MISMATCH_MODES, validate_config

trl = pytest.importorskip("trl")


def _help(field_name: str) -> str:
    (field,) = [f for f in dataclasses.fields(trl.GRPOConfig) if f.name == field_name]
    return field.metadata["help"]


def _quoted(text: str) -> list[str]:
    return re.findall(r"'(\w+)'", text)


def test_loss_types_are_trls():
    listed = _help("loss_type").split("Supported values are ")[1].split(".")[0]
    assert sorted(_quoted(listed)) == sorted(LOSS_TYPES)
    loss_code = inspect.getsource(trl.GRPOTrainer._compute_loss)
    for loss_type in LOSS_TYPES:  # every listed type has a branch of the loss
        assert f'"{loss_type}"' in loss_code, loss_type


def test_mismatch_modes_and_levels_are_trls():
    listed = _help("vllm_importance_sampling_mode").split("Supported options are: ")[1]
    assert set(_quoted(listed)) == set(MISMATCH_MODES)
    assert {"token", "sequence"} <= set(_quoted(_help("importance_sampling_level")))
    loss_code = inspect.getsource(trl.GRPOTrainer._compute_loss)
    for level in IMPORTANCE_SAMPLING_LEVELS:
        assert f'self.importance_sampling_level == "{level}"' in loss_code


def test_the_vllm_gates_that_server_trainer_opens_are_where_it_expects():
    generate = inspect.getsource(trl.GRPOTrainer._generate)
    assert "if self.use_vllm and self.state.global_step != self._last_loaded_step:" in generate
    assert "self.vllm_generation.sync_weights()" in generate
    assert generate.index("self.vllm_generation.sync_weights()") < generate.index("self.rollout_func(prompts, self)")
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert score.count("self.use_vllm and self.vllm_importance_sampling_correction") >= 3  # ratio, metrics, output
    assert "sampling/sampling_logp_difference/mean" in score
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in loss


def test_a_config_becomes_the_grpo_config_it_names(tmp_path):
    from grpo_steps.training.job import TrainJob, grpo_args

    cfg = validate_config({"train": {"loss_type": "grpo", "importance_sampling_level": "sequence",
                                     "off_policy_mask_threshold": 0.5},
                           "generation": {"importance_sampling": {"mode": "token_truncate", "clip_min": 0.2,
                                                                  "clip_max": 2.0}}})
    args = grpo_args(TrainJob(config=cfg, model_path="m", train_file="t", output_dir=str(tmp_path)))
    assert (args.loss_type, args.importance_sampling_level, args.off_policy_mask_threshold) == ("grpo", "sequence", 0.5)
    assert (args.vllm_importance_sampling_correction, args.vllm_importance_sampling_mode,
            args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max) == \
        (True, "token_truncate", 0.2, 2.0)
    assert args.use_vllm is False  # disk sync: our trainer, not TRL's vLLM client

    off = validate_config({"generation": {"importance_sampling": {"mode": "off"}}})
    assert grpo_args(TrainJob(config=off, model_path="m", train_file="t", output_dir=str(tmp_path))) \
        .vllm_importance_sampling_correction is False


def test_trls_tool_loop_samples_every_turn_through_the_generation_stand_in():
    """Tools on the server path rely on TRL's tool loop calling ``self.vllm_generation.generate`` for the first turn
    and each follow-up (our ServerGeneration answers it), masking tool tokens with ``tool_mask`` in the loss; and
    evaluation's episodes call ``_get_tool_suffix_ids`` unbound with ``(self, tool_messages)``."""
    single = inspect.getsource(trl.GRPOTrainer._generate_single_turn)
    assert "self.vllm_generation.generate(" in single and "num_generations=num_generations" in single
    loop = inspect.getsource(trl.GRPOTrainer._tool_call_loop)
    assert "self._generate_single_turn(" in loop and "self._get_tool_suffix_ids(" in loop
    assert "tool_mask[idx_with_tool] += [0] * tool_length + [1] * post_tool_length" in loop
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert "completion_mask * tool_mask" in score
    assert list(inspect.signature(trl.GRPOTrainer._get_tool_suffix_ids).parameters) == ["self", "tool_messages"]
    suffix = inspect.getsource(trl.GRPOTrainer._get_tool_suffix_ids)
    # the attributes episodes.py's stand-in for the trainer provides, and no other
    assert set(re.findall(r"self\.(\w+)", suffix)) <= {"processing_class", "_tokenizer", "chat_template",
                                                       "chat_template_kwargs", "_is_vlm"}


def test_the_training_step_that_zero_signal_skip_wraps():
    """``zero_signal_groups: skip`` prepares the micro-batch itself (TRL's ``_prepare_inputs``, which the Trainer's
    training_step calls first) and, when it skips, counts it as TRL's training_step does."""
    import transformers

    trainer_step = inspect.getsource(transformers.Trainer.training_step)
    assert "inputs = self._prepare_inputs(inputs)" in trainer_step
    assert trainer_step.index("model.train()") < trainer_step.index("inputs = self._prepare_inputs(inputs)")
    assert "_prepare_context_parallel_inputs" in trainer_step  # a no-op without context parallelism (not offered)
    grpo_step = inspect.getsource(trl.GRPOTrainer.training_step)
    assert "self._step += 1" in grpo_step and "self._current_train_step_time" in grpo_step
    assert "self._step % self.current_gradient_accumulation_steps == 0" in grpo_step
    prepare = inspect.getsource(trl.GRPOTrainer._prepare_inputs)
    assert "self._buffered_inputs[self._step % self.args.steps_per_generation]" in prepare
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert "advantages = rewards - mean_grouped_rewards" in score  # zero exactly when a group's rewards are equal


def test_what_zero_signal_replay_recomputes_for_a_replayed_group():
    """``zero_signal_groups: replay`` rescores replayed groups as TRL scores a fresh batch: the policy's logprobs
    through ``_get_per_token_logps_and_entropies`` without gradient checkpointing, and the mismatch weight of
    :func:`grpo_steps.training.zero_signal.importance_weights`, which repeats these lines; everything else of a
    batch that depends on the policy (``old_per_token_logps``, ``importance_sampling_ratio``) is listed here."""
    from trl.models.utils import disable_gradient_checkpointing

    assert list(inspect.signature(disable_gradient_checkpointing).parameters)[:2] == \
        ["model", "gradient_checkpointing_kwargs"]
    params = list(inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies).parameters)
    assert params[:6] == ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"]
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    for line in ("per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask",
                 "per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)",
                 'sequence_level_is = self.vllm_importance_sampling_mode in ["sequence_mask", "sequence_truncate"]',
                 "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
                 "vllm_importance_sampling_ratio = torch.exp(logps_diff)",
                 'if self.vllm_importance_sampling_mode in ["sequence_truncate", "token_truncate"]:',
                 "invalid_mis_mask, value=0.0"):
        assert line in score, line
    # the policy-dependent entries of the batch: the two recomputed, the reference's (fixed) and the sampler's (kept)
    assert set(re.findall(r'output\["(\w*per_token_logps|\w*ratio)"\] =', score)) == {
        "old_per_token_logps", "importance_sampling_ratio", "sampling_per_token_logps", "ref_per_token_logps"}
