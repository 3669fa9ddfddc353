"""On-policy distillation (``teacher:``): the per-token advantage computed by hand on the tiny model, the refusals of
the config, and the start-time tokenizer check (grpo_steps.training.distill, grpo_steps.config.teacher,
grpo_steps.preflight.check_teacher)."""

import shutil
from concurrent.futures import Future

import pytest
import torch

from grpo_steps.config import ConfigError, validate_config
from grpo_steps.training.distill import Distillation
from grpo_steps.training.distill.scoring import Pending


def hf_logprobs(model, sequence: list[int], start: int) -> list[float]:
    """log p(token t | tokens < t) for t >= start, float64, by hand from the logits."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].double()  # (T, V)
    logps = torch.log_softmax(logits, dim=-1)
    return [logps[t - 1, sequence[t]].item() for t in range(start, len(sequence))]


def flat(rows: list[list[float]]) -> list[float]:
    return [value for row in rows for value in row]


class AnsweredScorer:
    """The teacher's answer given (the HF forward pass), so that the fold alone is under test."""

    def __init__(self, rows):
        self.rows = rows

    def start(self, prompt_ids, completion_ids):
        future = Future()
        future.set_result(self.rows)
        return Pending(future, scoring_s=0.25)


def test_reverse_kl_advantage_by_hand_on_the_tiny_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():  # a student that differs from its teacher
        for p in student.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prompts = [[5, 6, 7], [8, 9]]
    completions = [[10, 11, 12, 13], [14, 15]]  # row 1 is padded to T = 4
    teacher_rows = [hf_logprobs(teacher, p + c, len(p)) for p, c in zip(prompts, completions, strict=True)]
    sampler_rows = [hf_logprobs(student, p + c, len(p)) for p, c in zip(prompts, completions, strict=True)]
    sampler = torch.zeros(2, 4)
    sampler[0, :4], sampler[1, :2] = torch.tensor(sampler_rows[0]), torch.tensor(sampler_rows[1])
    output = {"advantages": torch.tensor([0.7, -0.7]), "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
              "tool_mask": torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]),  # token 1 of row 0: a tool's answer
              "sampling_per_token_logps": sampler}
    kl_coef = 0.5
    distill = Distillation(AnsweredScorer(teacher_rows), kl_coef, "mixed", buckets=[2])
    pending = distill.start(prompts, completions, [{}, {}], tokenize=None)
    advantages, metrics = distill.fold(output, pending)

    # A_t = A_grpo + lambda (log pi_T(y_t) - log mu(y_t)) on the policy's tokens; A_grpo alone elsewhere
    expected = [[0.7 + kl_coef * (teacher_rows[0][t] - sampler_rows[0][t]) if t != 1 else 0.7 for t in range(4)],
                [-0.7 + kl_coef * (teacher_rows[1][0] - sampler_rows[1][0]),
                 -0.7 + kl_coef * (teacher_rows[1][1] - sampler_rows[1][1]), -0.7, -0.7]]
    assert advantages.shape == (2, 4)
    assert flat(advantages.tolist()) == pytest.approx(flat(expected), abs=1e-5)  # float32 of float64 values
    assert any(abs(a - 0.7) > 1e-3 for a in advantages[0].tolist())  # the teacher moved it
    scored = [(0, 0), (0, 2), (0, 3), (1, 0), (1, 1)]  # (row, position) of the policy's tokens
    kl = {rt: sampler_rows[rt[0]][rt[1]] - teacher_rows[rt[0]][rt[1]] for rt in scored}
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(kl.values()) / 5, abs=1e-5)
    assert metrics["distill/reverse_kl_pos_0_2"] == pytest.approx((kl[0, 0] + kl[1, 0] + kl[1, 1]) / 3, abs=1e-5)
    assert metrics["distill/reverse_kl_pos_2_end"] == pytest.approx((kl[0, 2] + kl[0, 3]) / 2, abs=1e-5)
    term = sum(abs(kl_coef * v) for v in kl.values())
    assert metrics["distill/teacher_share"] == pytest.approx(term / (term + 5 * 0.7), abs=1e-5)
    assert metrics["distill/teacher_seconds"] == 0.25

    pure, pure_metrics = Distillation(AnsweredScorer(teacher_rows), kl_coef, "pure").fold(output, pending)
    teacher_only = [[a - 0.7 if t != 1 else 0.0 for t, a in enumerate(expected[0])],
                    [expected[1][0] + 0.7, expected[1][1] + 0.7, 0.0, 0.0]]
    assert flat(pure.tolist()) == pytest.approx(flat(teacher_only), abs=1e-5)
    assert pure_metrics["distill/teacher_share"] == 1.0


def test_privileged_teacher_sees_the_reference_answer(tiny_tokenizer):
    sent = {}

    class Recording(AnsweredScorer):
        def start(self, prompt_ids, completion_ids):
            sent["prompts"] = prompt_ids
            return super().start(prompt_ids, completion_ids)

    def tokenize(prompts):
        return [tiny_tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True) for p in prompts]

    rows = [{"prompt": [{"role": "user", "content": "Calculate 2 + 3."}], "answer": "5"}]
    Distillation(Recording([[-1.0]]), 1.0, "privileged").start([[1, 2]], [[3]], rows, tokenize)
    assert "the reference answer is 5" in tiny_tokenizer.decode(sent["prompts"][0])


@pytest.mark.parametrize(("settings", "message"), [
    ({"teacher": {"model": "x"}, "train": {"zero_signal_groups": "skip"}}, "reads one per completion"),
    ({"teacher": {"model": "x"}, "train": {"loss_type": "vespo"}}, "reads one per completion"),
    ({"teacher": {"model": "x"}, "generation": {"temperature": 0.8}}, "set generation.temperature: 1"),
    ({"teacher": {"model": "x"}, "generation": {"top_k": 5}}, "leave top_k"),
    ({"teacher": {"model": "x"}, "generation": {"backend": "hf"}}, "sampler's logprobs"),
    ({"teacher": {"model": "x"}, "train": {"num_nodes": 2, "per_device_train_batch_size": 4}}, "provider: external"),
    ({"teacher": {"mode": "privileged", "model": "x"}}, "remove teacher.model"),
    ({"teacher": {"mode": "pure"}}, "needs teacher.model"),
    ({"teacher": {"model": "x", "provider": "external"}}, "needs teacher.server.endpoint"),
    ({"teacher": {"model": "x"}, "generation": {"server": {"gpus": [0]}}}, "policy server's GPUs"),
    ({"teacher": {"model": "x", "provider": "external", "server": {"endpoint": "http://127.0.0.1:8000/"}},
      "generation": {"provider": "external", "server": {"endpoint": "http://127.0.0.1:8000"}}}, "would not be frozen"),
])
def test_config_refuses_what_distillation_cannot_run_with(settings, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(settings)


def test_the_teacher_server_reuses_the_policy_servers_settings():
    cfg = validate_config({"teacher": {"model": "x"}, "generation": {"server": {
        "replicas": 2, "cpu_cores": [[0], [1]], "port": 8000, "kv_cache_gib": 3}}})
    settings = cfg.teacher.server_settings(cfg.generation.server)
    assert (settings.replicas, settings.port, settings.cpu_cores, settings.kv_cache_gib) == (1, 0, [0, 1], 3)


def test_start_refuses_a_teacher_whose_tokenizer_differs(tiny_model_path, tmp_path):
    from transformers import AutoTokenizer

    from grpo_steps.preflight import check_teacher

    other = tmp_path / "other-teacher"
    shutil.copytree(tiny_model_path, other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<teacher-only>"])
    tokenizer.save_pretrained(other)
    cfg = validate_config({"model": {"name_or_path": tiny_model_path}, "teacher": {"model": str(other)}})
    with pytest.raises(ConfigError, match=r"cannot score the policy's tokens: the vocabulary sizes differ"):
        check_teacher(cfg, tiny_model_path)
    same = validate_config({"model": {"name_or_path": tiny_model_path}, "teacher": {"model": tiny_model_path}})
    assert check_teacher(same, tiny_model_path) == str(tiny_model_path)
