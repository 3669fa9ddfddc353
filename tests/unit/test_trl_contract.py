"""What the pipeline assumes of the installed TRL: the algorithm lists the config validates against without
importing trl, the ``GRPOConfig`` a config becomes, and the code paths ``ServerGRPOTrainer`` opens."""

import dataclasses
import inspect
import re

import pytest
import torch

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
    # ServerGRPOTrainer._generate shifts the 5th of the round's 8 outputs, the sampler's logprobs, which TRL reads as
    # sampling_per_token_logps (on_policy_support): the unpacking it relies on
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert ("( prompt_ids_list, completion_ids_list, tool_mask_list, completions, sampling_per_token_logps_list, "
            "extra_fields, images, tool_images, ) = self._generate(prompts)") in " ".join(score.split())
    assert "if self.use_vllm and self.state.global_step != self._last_loaded_step:" in generate
    assert "self.vllm_generation.sync_weights()" in generate
    assert generate.index("self.vllm_generation.sync_weights()") < generate.index("self.rollout_func(prompts, self)")
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    assert score.count("self.use_vllm and self.vllm_importance_sampling_correction") >= 3  # ratio, metrics, output
    assert "sampling/sampling_logp_difference/mean" in score
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in loss
    # the loss-side correction (grpo_steps.training.correction): the same gate keeps TRL's scoring pass out of a
    # round; the loss scores the policy once, before it reads the weights the trainer's override set from that score
    assert "if self.args.gradient_accumulation_steps % generate_every != 0 or ( self.use_vllm and " \
           "self.vllm_importance_sampling_correction ): old_per_token_logps" in " ".join(score.split())
    assert loss.count("self._get_per_token_logps_and_entropies(") == 1
    scored, read = loss.index("self._get_per_token_logps_and_entropies("), 'inputs.get("importance_sampling_ratio")'
    assert scored < loss.index(read) < loss.index('inputs["importance_sampling_ratio"]')


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
    and each follow-up (our RolloutBackend answers it), masking tool tokens with ``tool_mask`` in the loss; and
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
    :func:`grpo_steps.training.zero_signal.plan.importance_weights`, which repeats these lines; everything else of a
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


def test_every_trl_hook_does_what_it_names_on_a_real_trainer(tiny_model_path, tmp_path):
    """``grpo_steps/trl_hooks.py``, function by function, on a real ``GRPOTrainer``: each reads or writes
    the private attribute TRL itself uses for that purpose (checked by TRL's own code where TRL reads it back)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_steps import trl_hooks
    from grpo_steps.training.job import TrainJob, grpo_args

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    cfg = validate_config({"train": {"per_device_train_batch_size": 2, "num_generations": 2}})
    args = grpo_args(TrainJob(config=cfg, model_path=tiny_model_path, train_file="unused", output_dir=str(tmp_path)))
    trainer = trl.GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
                              reward_funcs=[lambda completions, **_: [0.0] * len(completions)] * 2, args=args,
                              train_dataset=Dataset.from_list([{"prompt": "1 + 1"}] * 2), processing_class=tokenizer)

    trl_hooks.log_metric(trainer, "probe/x", 2.0)
    trl_hooks.log_metric(trainer, "probe/x", 4.0)
    assert trl_hooks.last_metric(trainer, "probe/x") == 4.0
    trainer.model.train()
    trainer.log({})  # TRL averages its metric lists into the log: the hook wrote where TRL reads
    assert trainer.state.log_history[-1]["probe/x"] == 3.0

    assert set(trl_hooks.logged_batch(trainer)) >= {"prompt", "completion", "rewards", "advantages"}
    assert trl_hooks.micro_step(trainer) == 0 and trl_hooks.count_micro_step(trainer) == 1
    assert trl_hooks.micro_step(trainer) == 1

    batches = [{"advantages": torch.zeros(2)}]
    trl_hooks.set_buffered_batches(trainer, batches)
    assert trl_hooks.buffered_batches(trainer) is batches
    trl_hooks.add_step_time(trainer, 0.25)
    trl_hooks.add_step_time(trainer, 0.5)
    trl_hooks.end_step_time(trainer)
    assert trl_hooks.last_metric(trainer, "step_time") == 0.75
    trl_hooks.add_step_time(trainer, 0.1)  # the timer started again from zero
    trl_hooks.end_step_time(trainer)
    assert trl_hooks.last_metric(trainer, "step_time") == pytest.approx(0.1)

    trl_hooks.mark_pushed(trainer, 7)
    assert trl_hooks.pushed_step(trainer) == 7

    (ids,) = trl_hooks.tokenize_prompts(trainer, ["1 + 1"])
    assert list(ids) == tokenizer("1 + 1")["input_ids"]  # a plain-text prompt: TRL's ids are the tokenizer's

    input_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    logps = trl_hooks.policy_logps(trainer, trainer.model, input_ids, torch.ones_like(input_ids), 2, batch_size=2)
    assert logps.shape == (2, 2) and bool((logps <= 0).all())
    with torch.no_grad():
        full = torch.log_softmax(trainer.model(input_ids).logits[:, :-1].float(), dim=-1)
    expected = full.gather(-1, input_ids[:, 1:, None]).squeeze(-1)[:, -2:]
    assert torch.allclose(logps, expected, atol=1e-5)


def test_the_generation_round_and_micro_batch_the_hooks_reach_are_trls():
    from grpo_steps import trl_hooks
    from grpo_steps.training.trainer import PipelineGRPOTrainer

    class Probe(PipelineGRPOTrainer):
        def __init__(self):  # no TRL constructor: only which method the hook reaches is checked
            pass

    reached = []
    originals = trl.GRPOTrainer._generate_and_score_completions, trl.GRPOTrainer._prepare_inputs
    trl.GRPOTrainer._generate_and_score_completions = lambda self, inputs: reached.append("round") or {}
    trl.GRPOTrainer._prepare_inputs = lambda self, batch: reached.append("prepare") or {}
    try:
        trl_hooks.generate_and_score(PipelineGRPOTrainer, Probe(), [])
        trl_hooks.prepare_inputs(PipelineGRPOTrainer, Probe(), [])
    finally:
        trl.GRPOTrainer._generate_and_score_completions, trl.GRPOTrainer._prepare_inputs = originals
    assert reached == ["round", "prepare"]  # TRL's own, past the pipeline's overrides


def test_trls_vllm_imports_wait_on_the_gate_the_hook_closes():
    """``trl_hooks.skip_trls_vllm_imports`` answers False for ``trl.import_utils.is_vllm_available``: that keeps vLLM
    out of a training process only while each vLLM import of TRL's generation modules (GRPOTrainer imports them on
    every path) runs under that function's answer: in an ``if`` on it at module level (or on a flag it set), or
    inside a function (TRL's own vLLM paths)."""
    import importlib.util
    from pathlib import Path

    for module in ("trl.generation", "trl.generation.vllm_generation", "trl.generation.vllm_client"):
        lines = Path(importlib.util.find_spec(module).origin).read_text().splitlines()
        assert any(line.startswith("from ..import_utils import") and "is_vllm_available" in line for line in lines)
        flags = {line.split("=")[0].strip() for line in lines
                 if re.match(r"\w+ = is_vllm_available\(", line)}  # module-level flags set from the gate
        block = ""
        for line in lines:
            if line and not line[0].isspace() and not line.startswith(("#", ")", "]")):
                block = line  # the module-level statement an indented line belongs to
            if re.match(r"\s*(from vllm\b|import vllm\b)", line):
                gate = re.match(r"(el)?if (\w+)", block)
                assert line[0].isspace() and (block.startswith(("def ", "class ", "async def ")) or (
                    gate and (gate.group(2) == "is_vllm_available" or gate.group(2) in flags))), (module, line, block)


@pytest.mark.slow
def test_a_training_process_off_trls_vllm_paths_imports_no_vllm():
    """The trainer's modules imported after the hook bring no vLLM module and no version warning of TRL's (the
    training process of every path but colocate and nccl, :func:`grpo_steps.training.entry.run`)."""
    import subprocess
    import sys

    code = ("from grpo_steps import trl_hooks; trl_hooks.skip_trls_vllm_imports(); "
            "from grpo_steps.training.trainer import ServerGRPOTrainer; from grpo_steps.training import entry; "
            "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
    assert "TRL currently supports vLLM" not in done.stderr


def test_the_environment_round_that_async_resets_ahead_for_is_trls():
    """What :mod:`grpo_steps.training.generation.episodes_ahead` and ``ServerGRPOTrainer`` rely on: TRL hands each row
    the next instance of its environment's pool (``_environment_pool``, replaced for a round by the instances reset
    ahead), calls its ``reset(**row)`` and joins the observation to the prompt's last message as ``with_observation``
    does; its prompt encoding reads each row's environment from ``_batch_environments``."""
    score = " ".join(inspect.getsource(trl.GRPOTrainer._generate_and_score_completions).split())
    assert "pool = self._environment_pool[name]" in score and "self.environments.append(pool[index])" in score
    assert "observation = environment.reset(**reset_kwargs)" in score
    assert 'prompts[i] = prompt[:-1] + [{**prompt[-1], "content": content + observation}]' in score
    assert 'x.get("prompt", [{"role": "user", "content": ""}])' in score  # EMPTY_PROMPT
    tokenize = inspect.getsource(trl.GRPOTrainer._tokenize_prompts)
    assert "zip(prompts, self._batch_environments, strict=True)" in tokenize
