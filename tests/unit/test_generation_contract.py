"""Every generation and training option does what it says on every path, or the config refuses it before anything
runs: the refusals (one row each, with the key the message must name), the vLLM request a config sends, the
``trl.GRPOConfig`` it becomes on TRL's own generation paths, and the policy's copy of vLLM's sampling filters."""

import pytest
import torch

from grpo_steps.config import ConfigError, GenerationConfig, validate_config

COLOCATE = {"generation": {"mode": "colocate"}, "resources": {"train": {"gpu": 1}}}


@pytest.mark.parametrize("data, named", [
    # training at temperature 0: every completion of a group the same, and TRL divides the logits by it
    ({"generation": {"temperature": 0}}, "generation.temperature"),
    # transformers generation: no tokenizer for stop strings, no stop ids beyond EOS, no constrained decoding
    ({"generation": {"backend": "hf", "stop": ["\n"]}}, "generation.stop cannot be honoured by backend 'hf'"),
    ({"generation": {"backend": "hf", "stop_token_ids": [3]}}, "generation.stop_token_ids cannot be honoured"),
    ({"generation": {"backend": "hf", "structured_outputs": {"regex": "[0-9]+"}}}, "generation.structured_outputs"),
    # recorded completions: nothing is sampled, so a sampling setting would do nothing
    ({"generation": {"backend": "recorded", "recorded_file": "f", "top_k": 5}}, "generation.top_k set with backend "
                                                                               "'recorded'"),
    ({"generation": {"backend": "recorded", "recorded_file": "f", "temperature": 0.7}}, "generation.temperature set"),
    # structured outputs: exactly one kind, a regex that compiles, non-empty choices
    ({"generation": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "exactly one of regex, json_schema"),
    ({"generation": {"structured_outputs": {}}}, "exactly one of regex, json_schema"),
    ({"generation": {"structured_outputs": {"regex": "(["}}}, "does not compile"),
    ({"generation": {"structured_outputs": {"choice": []}}}, "at least one non-empty string"),
    ({"generation": {"stop": [""]}}, "empty string"),
    ({"generation": {"stop_token_ids": [-1]}}, "must be token ids"),
    # TRL's own vLLM paths compare vLLM's filtered logprobs with the policy's unfiltered ones (trl #6789)
    ({**COLOCATE, "generation": {**COLOCATE["generation"], "top_p": 0.9}}, "every ratio carries the kept mass"),
    ({"generation": {"weight_sync": "nccl", "min_p": 0.05}, "resources": {"train": {"gpu": 1}}},
     "Use mode 'server' with weight_sync 'disk' or 's3'"),
    ({**COLOCATE, "generation": {**COLOCATE["generation"], "structured_outputs": {"regex": "[0-9]+"}}},
     "or that structured_outputs allows"),  # the grammar's allowed mass, which only the server path replays
    # sampling keys belong to generation, not to train.grpo
    ({"train": {"grpo": {"top_k": 5}}}, "train.grpo.top_k is set by generation.top_k"),
    ({"train": {"grpo": {"min_p": 0.1}}}, "train.grpo.min_p is set by generation.min_p"),
    ({"train": {"grpo": {"repetition_penalty": 1.1}}}, "set by generation.repetition_penalty"),
    ({"train": {"grpo": {"generation_kwargs": {"stop": ["x"]}}}}, "generation.stop, generation.stop_token_ids"),
    ({"train": {"grpo": {"chat_template_kwargs": {"enable_thinking": False}}}}, "generation.chat_template_kwargs"),
    ({"train": {"grpo": {"vllm_structured_outputs_regex": "x"}}}, "generation.structured_outputs"),
    # names the reference docs use that TRL 1.16 removed or renamed
    ({"train": {"grpo": {"max_prompt_length": 256}}}, "use data.max_prompt_tokens"),
    ({"train": {"grpo": {"vllm_guided_decoding_regex": "x"}}}, "use generation.structured_outputs.regex"),
    ({"train": {"grpo": {"use_liger_loss": True}}}, "TRL 1.16 removed it"),
    ({"train": {"grpo": {"warmup_ratio": 0.1}}}, "train.grpo.warmup_steps"),
    # keys with no effect in this pipeline
    ({"train": {"grpo": {"eval_strategy": "steps"}}}, "TRL's own evaluation loop never runs"),
    ({"train": {"grpo": {"num_train_epochs": 3}}}, "train.max_steps sets the length"),
    ({"train": {"grpo": {"log_completions": True}}}, "train.log_completions_steps"),
    # keys of one generation path on another
    ({"train": {"grpo": {"vllm_gpu_memory_utilization": 0.5}}}, "only applies to TRL's own vLLM generation"),
    ({"train": {"grpo": {"cache_implementation": "static"}}}, "only applies to TRL's transformers generation"),
    ({"train": {"grpo": {"ds3_gather_for_generation": False}}}, "the server rollouts gather for each push"),
    # a prompt and its completion must fit the server's context
    ({"data": {"max_prompt_tokens": 1000}}, "exceeds model.max_model_len"),
    # evaluation: greedy requests take n = 1 only (vLLM's rule), and the samples would be identical anyway
    ({"eval": {"temperature": 0.0}}, "eval.temperature 0 samples greedily"),
    # registration, MLflow's naming rules: checked here, not after training
    ({"registry": {"model_name": "team/policy"}}, "no '/' or ':'"),
    ({"registry": {"model_name": "policy:v1"}}, "no '/' or ':'"),
    ({"data": {"mixture": [{"name": "sums (easy)"}, {"name": "b", "task": "chain_sum"}]}}, "MLflow metric names"),
    ({"rewards": [{"name": "answer_accuracy"}, {"name": "answer_accuracy", "weight": 0.5}]}, "listed twice"),
])
def test_refused_before_anything_runs(data, named):
    with pytest.raises(ConfigError) as err:
        validate_config(data)
    assert named in str(err.value)


@pytest.mark.parametrize("data", [
    {"generation": {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
                    "stop": ["\n\n"], "stop_token_ids": [7], "structured_outputs": {"json_schema": {"type": "object"}},
                    "chat_template_kwargs": {"enable_thinking": False}}},
    {"generation": {"backend": "hf", "top_k": 20, "min_p": 0.1, "chat_template_kwargs": {"x": 1}}},
    {"eval": {"temperature": 0.0, "num_samples": 1, "k": [1]}},
    {"eval": {"k": [2], "num_samples": 2}},  # pass@1 is reported anyway (the gate's metric)
    {**COLOCATE, "train": {"grpo": {"vllm_gpu_memory_utilization": 0.5, "ds3_gather_for_generation": False}}},
    {**COLOCATE, "generation": {**COLOCATE["generation"], "top_k": 20, "importance_sampling": {"mode": "off"}}},
    {"generation": {"backend": "hf"}, "train": {"grpo": {"cache_implementation": "static"}}},
    {"data": {"mixture": [{"name": "sums v1.2"}, {"name": "chain-sum_2", "task": "chain_sum"}]}},
])
def test_accepted(data):
    validate_config(data)


def test_the_request_sends_every_filter_and_the_constraints():
    gen = GenerationConfig(temperature=0.7, top_k=20, stop=["\n"], stop_token_ids=[5],
                           structured_outputs={"regex": "[0-9]+"})
    assert gen.sampling_request() == {"top_p": 1.0, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.0,
                                      "stop": ["\n"], "stop_token_ids": [5], "structured_outputs": {"regex": "[0-9]+"}}
    # greedy requests (evaluation's accuracy) keep the constraints, not the filters
    assert gen.sampling_request(filters=False) == {"stop": ["\n"], "stop_token_ids": [5],
                                                   "structured_outputs": {"regex": "[0-9]+"}}
    assert GenerationConfig(structured_outputs={"json_schema": {"type": "object"}}).sampling_request(
        filters=False) == {"structured_outputs": {"json": {"type": "object"}}}


def test_trls_own_generation_gets_every_setting():
    from grpo_steps.training.job import TrainJob, config_grpo_kwargs

    cfg = validate_config({**COLOCATE, "generation": {**COLOCATE["generation"], "temperature": 0.7, "top_k": 20,
                                                      "min_p": 0.05, "repetition_penalty": 1.1, "stop": ["\n\n"],
                                                      "importance_sampling": {"mode": "off"},
                                                      "structured_outputs": {"choice": ["yes", "no"]},
                                                      "chat_template_kwargs": {"enable_thinking": False}}})
    kwargs = config_grpo_kwargs(TrainJob(config=cfg, model_path="m", train_file="t", output_dir="o"), on_cpu=False)
    assert (kwargs["temperature"], kwargs["top_k"], kwargs["min_p"], kwargs["repetition_penalty"]) == (0.7, 20, 0.05,
                                                                                                        1.1)
    # TRL's vLLM generation: SamplingParams(**generation_kwargs), the structured outputs dict made into its params
    assert kwargs["generation_kwargs"] == {"stop": ["\n\n"], "structured_outputs": {"choice": ["yes", "no"]}}
    assert kwargs["chat_template_kwargs"] == {"enable_thinking": False}


def test_a_train_grpo_key_trl_does_not_have_is_refused_with_the_closest_field():
    from grpo_steps.training.job import check_grpo_keys

    check_grpo_keys(validate_config({"train": {"grpo": {"num_iterations": 2}}}))
    with pytest.raises(ConfigError, match=r"num_iteration \(did you mean num_iterations( or \w+)?\?\)"):
        check_grpo_keys(validate_config({"train": {"grpo": {"num_iteration": 2}}}))


@pytest.mark.parametrize("settings", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 3},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.3},
    {"temperature": 0.5, "repetition_penalty": 1.5},
    {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.2},
])
def test_the_filters_give_a_distribution_on_the_kept_tokens(settings):
    """Every filter keeps at least one token; what it keeps is a distribution (sums to 1), and with no filter it is
    the temperature-scaled softmax."""
    from grpo_steps.training.sampling import filter_logits

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    seen = torch.rand(6, 50) < 0.2
    kept = filter_logits(logits, seen=seen, **settings).log_softmax(-1).exp()
    assert torch.allclose(kept.sum(-1), torch.ones(6))
    assert ((kept > 0).sum(-1) >= 1).all()
    if settings.get("top_k"):
        assert ((kept > 0).sum(-1) <= settings["top_k"]).all()
    if len(settings) == 1:
        assert torch.allclose(kept, (logits / settings["temperature"]).softmax(-1))


def test_the_trainer_calls_the_generation_class_through_trls_contract():
    """TRL's trainer calls its ``VLLMGeneration`` twice a round (``sync_weights``, ``generate``); ours adds one
    question with several replicas (which replica sampled each row) and reads the version that sampled the batch;
    the first-batch check, the replica ledger and the async producer run inside ``generate``."""
    import inspect
    import re

    from grpo_steps.training import trainer

    used = set(re.findall(r"vllm_generation\.(\w+)", inspect.getsource(trainer.ServerGRPOTrainer)))
    # (sync_weights and generate are named in comments: TRL's own calls)
    assert used <= {"sync_weights", "generate", "replica_rows", "sampled_version"}, used

