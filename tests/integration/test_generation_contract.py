"""The generation settings do what they say on the server path, against the session's real tiny vLLM server
(``tiny_server``): sampling filters with the first-batch check on, a server sampling other settings caught, stop
strings, structured outputs, chat-template arguments, async rewards in training and evaluation, the completions
tables in MLflow. (An external server that returns raw logprobs: tests/integration/test_vllm_server.py.)"""

import json
import re
import sys

import pytest

from grpo_steps.config import GenerationConfig
from grpo_steps.data import encode_prompt, to_prompt
from grpo_steps.servers.client import GenerationServerError
from grpo_steps.training.entry import run
from grpo_steps.training.generation.server import RolloutBackend, ServerSettings
from tests.integration.trainjob import history, job

pytestmark = pytest.mark.slow

QUESTIONS = ["Calculate 2 + 3.", "Calculate 4 + 1.", "Calculate 7 + 2."]


def _rollout(server, tokenizer, group: int = 4, **generation) -> dict:
    """One first turn of ``group`` completions for each of QUESTIONS, sampled with ``generation`` by the training
    process's generation stand-in, as TRL's generation path calls it."""
    gen = GenerationConfig(max_completion_tokens=12, **generation)
    sampler = RolloutBackend(ServerSettings(client=server.client(), gen=gen, max_model_len=256, transport=None,
                                              probe_ids=[], probe_tolerance=1.0))
    prompts = [encode_prompt(tokenizer, to_prompt(q, "Solve the problem."), gen.chat_template_kwargs)
               for q in QUESTIONS for _ in range(group)]
    prompt_ids, completion_ids, logprobs, _ = sampler.generate(prompts, num_generations=group)
    assert prompt_ids == prompts and all(len(lp) == len(ids) for lp, ids in zip(logprobs, completion_ids, strict=True))
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids}


@pytest.mark.parametrize("generation, grpo", [
    ({"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.1}, {}),  # the correction weighed in the loss
    ({"temperature": 0.9, "top_p": 0.8, "min_p": 0.02, "importance_sampling": {"mode": "token_mask"}},
     {"num_iterations": 2}),  # TRL's own scoring pass (two iterations per batch)
])
def test_sampling_filters_train_with_the_first_batch_check_on_and_an_unbiased_correction(
        generation, grpo, tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    """Axolotl's quick start samples at 0.7; with filters too the server's logprobs are those of the filtered
    distribution (processed logprobs), and the policy scores the batch under the same filters: they agree. The
    mismatch correction compares the sampler's logprobs, put on the policy's support (trl #6789: without that its
    ratio is the kept mass S of each token, far below 1 here), with the policy's: ratio 1 and no logp difference
    beyond float32 noise, while the filters kept visibly less than all the mass."""
    run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint,
            train={"max_steps": 2, "grpo": grpo}, generation=generation))
    steps = history(tmp_path)
    assert [h["step"] for h in steps] == [1, 2][::grpo.get("num_iterations", 1)]  # the steps that sampled
    for h in steps:
        assert h["weight_sync/first_batch_logp_diff"] < 1e-3  # float32 kernel noise, as at temperature 1
        assert h["sampling/sampling_logp_difference/mean"] < 1e-3, h
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, h
        assert h["sampling/importance_sampling_ratio/min"] > 0.99, h  # no token's ratio is its kept mass
        assert h["sampling/support_log_mass/mean"] < -0.05, h  # the filters dropped > 5 % of the mass on average


def test_a_server_sampling_other_settings_is_caught(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server,
                                                    monkeypatch):
    """The config asks for top-k 3; the requests (patched) leave it out, so the server samples the full
    distribution: the first-batch check sees the policy's filtered distribution disagree and stops the run."""
    request = GenerationConfig.sampling_request
    monkeypatch.setattr(GenerationConfig, "sampling_request",
                        lambda self, filters=True: {**request(self, filters), **({"top_k": 0} if filters else {})})
    with pytest.raises(GenerationServerError, match="under the configured sampling settings"):
        run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 1},
                generation={"top_k": 3}))


def test_a_stop_string_ends_completions(tiny_server, tiny_tokenizer):
    """The tiny model writes spaces: with stop " " a completion ends with the token that wrote the first one (its
    ids keep that token, vLLM's text leaves the string out), nothing is sampled after it."""
    gen = GenerationConfig(stop=[" "])
    prompts = [encode_prompt(tiny_tokenizer, to_prompt(q, "Solve the problem.")) for q in QUESTIONS]
    groups = tiny_server.client().complete(prompts, 4, max_tokens=12, temperature=1.0, request=gen.sampling_request())
    samples = [s for group in groups for s in group]
    stopped = [s for s in samples if s["finish_reason"] == "stop"]
    assert len(stopped) >= len(samples) // 2, [s["text"] for s in samples]
    for s in stopped:
        assert " " not in s["text"]
        if s["completion_ids"][-1] == tiny_tokenizer.eos_token_id:
            continue  # the end-of-text token sampled before any space also ends with "stop" (it did once in CI)
        assert " " in tiny_tokenizer.decode(s["completion_ids"])  # the token that wrote it closes the completion
        assert " " not in tiny_tokenizer.decode(s["completion_ids"][:-1])


def test_a_regex_constrains_every_completion(tiny_server, tiny_tokenizer):
    pattern = "[0-9]{1,2} (apples|pears)"
    out = _rollout(tiny_server, tiny_tokenizer, structured_outputs={"regex": pattern})
    texts = [tiny_tokenizer.decode(ids, skip_special_tokens=True) for ids in out["completion_ids"]]
    assert all(re.fullmatch(pattern, text) for text in texts), texts


@pytest.mark.parametrize("structured", [{"choice": ["Answer: 5", "Answer: 6", "5", "6"]},
                                        {"regex": "Answer: [0-9]{1,2}"}])
def test_training_with_structured_outputs_checks_the_push_by_its_probe_and_reapplies_the_grammar(
        structured, tmp_path, tiny_model_path, tiny_tokenizer, tiny_server):
    """The grammar renormalises what the server samples over the tokens it allows: the batch is not compared, the
    push's probe is scored by the policy instead (and agrees). The mismatch correction re-applies the grammar on
    the policy's logits (grpo_steps.training.grammar): its ratio is 1, where without that it was the allowed mass
    of every token (configs/game.yaml: a mean of 1.5e-5, nothing trained), and the mask followed every turn the
    real server sampled (xgrammar, as vLLM's backend compiles it)."""
    run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 1},
            generation={"structured_outputs": structured}))
    (h,) = history(tmp_path)
    assert "weight_sync/first_batch_logp_diff" not in h
    assert h["weight_sync/probe_logp_diff"] < 1e-3
    assert h["sampling/grammar_diverged_turns"] == 0
    assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, h
    assert h["sampling/importance_sampling_ratio/min"] > 0.99, h
    assert h["sampling/support_log_mass/mean"] < -0.5, h  # the grammar allowed far less than the policy's mass


def test_a_chat_template_argument_appears_in_the_rendered_prompt(tiny_server, tiny_tokenizer):
    tokenizer = type(tiny_tokenizer).from_pretrained(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = ("{% if mood %}<|im_start|>system\nmood {{ mood }}<|im_end|>\n{% endif %}"
                               + tiny_tokenizer.chat_template)
    out = _rollout(tiny_server, tokenizer, group=2, chat_template_kwargs={"mood": "7 + 7"})
    assert all("mood 7 + 7" in tokenizer.decode(ids) for ids in out["prompt_ids"])
    plain = _rollout(tiny_server, tokenizer, group=2)
    assert not any("mood" in tokenizer.decode(ids) for ids in plain["prompt_ids"])


ASYNC_REWARDS = '''
import asyncio


async def judge(completions, **kwargs):
    await asyncio.sleep(0.01)  # an LLM judge would await its client here
    return [1.0 if "Answer" in c[0]["content"] else 0.0 for c in completions]
'''


def test_an_async_reward_runs_in_training_and_evaluation(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server,
                                                         monkeypatch):
    from grpo_steps.evaluation.policy import evaluate_policy

    (tmp_path / "my_async_rewards.py").write_text(ASYNC_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "my_async_rewards:judge"
    train_job = job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 1},
                    rewards=[{"name": name}, {"name": "answer_accuracy"}],
                    eval={"correctness_reward": "answer_accuracy", "format_reward": name, "num_samples": 2, "k": [1]})
    run(train_job)
    (h,) = history(tmp_path)
    assert 0.0 <= h[f"rewards/{name}/mean"] <= 1.0  # a float per completion, not a coroutine
    rows = [json.loads(line) for line in open(train_job.train_file)][:4]
    metrics = evaluate_policy(train_job.config, tiny_server.client(), tiny_tokenizer, rows)["metrics"]
    assert 0.0 <= metrics[f"reward/{name}"] <= 1.0 and metrics[f"reward/{name}/errors"] == 0
    assert "my_async_rewards" in sys.modules


def test_completions_tables_and_engine_metrics_reach_mlflow_at_their_steps(tmp_path, tiny_model_path, tiny_tokenizer,
                                                                          tiny_server):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("tables")).info.run_id
    run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, mlflow_run_id=run_id,
            train={"max_steps": 4, "log_completions_steps": 2}, tracking={"tracking_uri": uri}))
    files = sorted(a.path for a in client.list_artifacts(run_id, "completions"))
    assert files == ["completions/step_000002.json", "completions/step_000004.json"]
    for step, path in ((2, files[0]), (4, files[1])):
        table = json.loads(open(client.download_artifacts(run_id, path, str(tmp_path))).read())
        columns, rows = table["columns"], table["data"]
        assert columns == ["prompt", "completion", "answer_accuracy", "answer_format", "advantage", "weight_version"]
        assert len(rows) == 8  # the step's generation batch: 2 prompts x 4 completions
        assert {row[-1] for row in rows} == {step - 1}  # sampled by the weights pushed before the step
        assert all(row[0].startswith("Calculate") for row in rows)
    # the server's engine metrics (tracking.engine_metrics, on by default) at every step, with the trainer's loss
    steps = [m.step for m in client.get_metric_history(run_id, "loss")]
    assert sorted(steps) == [1, 2, 3, 4]
    for name in ("requests_running", "requests_waiting", "kv_cache_usage", "preemptions", "prefix_cache_hit_rate",
                 "generation_tokens_per_s", "replicas_scraped"):
        assert sorted(m.step for m in client.get_metric_history(run_id, f"engine/{name}")) == steps, name
    assert all(m.value > 0 for m in client.get_metric_history(run_id, "engine/generation_tokens_per_s"))


def test_an_evaluation_has_every_chunks_requests_at_the_server_at_once(tiny_server, tiny_tokenizer, monkeypatch,
                                                                        capsys):
    """20 prompts go in 3 chunks (of 8): their 6 first-turn requests (sampled and greedy each) are at the server
    together, none sent before all are (a barrier of 6: chunk after chunk, the first would wait in vain), and a
    line says so before the progress line of each chunk."""
    import threading

    from grpo_steps.config import REPO_ROOT, load_config
    from grpo_steps.evaluation.policy import evaluate_policy
    from grpo_steps.servers.client import VLLMClient

    cfg = load_config(REPO_ROOT / "configs" / "test.yaml")
    rows = [{"prompt": to_prompt(f"Calculate {i} + 1.", "Solve the problem."), "answer": str(i + 1)}
            for i in range(20)]
    all_sent = threading.Barrier(6, timeout=60)
    complete = VLLMClient.complete

    def complete_when_all_are_sent(self, *args, **kwargs):
        all_sent.wait()
        return complete(self, *args, **kwargs)

    monkeypatch.setattr(VLLMClient, "complete", complete_when_all_are_sent)
    report = evaluate_policy(cfg, tiny_server.client(), tiny_tokenizer, rows, label="chunks")
    assert len(report["prompt_keys"]) == 20 and len(report["per_prompt"]["pass@1"]) == 20
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[eval chunks]")]
    assert len(lines) == 4 and "20 prompts x 2 sampled + 1 greedy completions requested at once" in lines[0], lines
    assert "20/20 prompts" in lines[-1]


def test_evaluation_requests_its_sampled_and_greedy_completions_at_once(tiny_server, tiny_tokenizer, monkeypatch):
    """``EpisodeSampler.sample_together`` has both first-turn requests at the server at the same time (each waits at a
    barrier for the other before it is sent: one after the other, the first would wait in vain), and returns what
    :meth:`~grpo_steps.evaluation.episodes.EpisodeSampler.sample` returns for each (greedy: the same completions)."""
    import threading

    from grpo_steps.config import REPO_ROOT, load_config
    from grpo_steps.evaluation.episodes import EpisodeSampler
    from grpo_steps.servers.client import VLLMClient

    cfg = load_config(REPO_ROOT / "configs" / "test.yaml")
    rows = [{"prompt": to_prompt(q, "Solve the problem.")} for q in QUESTIONS]
    sampler = EpisodeSampler(cfg, tiny_server.client(), tiny_tokenizer)
    alone = sampler.sample(rows, 1, temperature=0.0, filters=False)
    both_sent = threading.Barrier(2, timeout=60)
    complete = VLLMClient.complete

    def complete_when_both_are_sent(self, *args, **kwargs):
        both_sent.wait()  # raises BrokenBarrierError when the other request does not come meanwhile
        return complete(self, *args, **kwargs)

    monkeypatch.setattr(VLLMClient, "complete", complete_when_both_are_sent)
    sampled, greedy = sampler.sample_together([(rows, 3, 1.0, True), (rows, 1, 0.0, False)])
    assert [len(group) for group in sampled] == [3] * len(rows) and [len(group) for group in greedy] == [1] * len(rows)
    assert all(len(e.first_logprobs) == e.model_tokens > 0 for group in sampled for e in group)
    assert [[e.completion_ids for e in group] for group in greedy] == [[e.completion_ids for e in group]
                                                                      for group in alone]


def test_an_evaluation_with_an_environment_plays_its_chunks_one_after_another(tiny_server, tiny_model_path,
                                                                             monkeypatch):
    """Multi-turn evaluation resets a chunk's environments only once the chunk before has played its last turn, so an
    episode's wall clock (``generation.episode_timeout_s``, from its reset) counts its own chunk's turns: all at once,
    configs/game.yaml's 320 episodes took 792 s and 192 of 256 ran past their 300 s (scored failed, 2026-12-06)."""
    import time

    from grpo_steps.config import validate_config
    from grpo_steps.evaluation.episodes import EpisodeSampler
    from grpo_steps.evaluation.policy import sample
    from grpo_steps.models import load_tokenizer

    move = '<tool_call>\n{"name": "move", "arguments": {"action": "1"}}\n</tool_call>'
    cfg = validate_config({
        "model": {"name_or_path": "embedded:tiny-random-qwen2", "dtype": "float32", "max_model_len": 1024,
                  "chat_template": "qwen2_5"},
        "data": {"source": "jsonl", "path": "games.jsonl", "answer_column": None, "columns": ["seed"]},
        "environment": "tests.unit.toy_games:Board", "rewards": [{"name": "game_solved"}],
        "eval": {"format_reward": None, "correctness_reward": "game_solved", "num_samples": 1, "k": [1]},
        "generation": {"max_completion_tokens": 240, "max_tool_calling_iterations": 2, "episode_timeout_s": 120,
                       "structured_outputs": {"regex": move.replace("{", r"\{").replace("}", r"\}")}}})
    tokenizer = load_tokenizer(tiny_model_path, "qwen2_5")
    rows = [{"prompt": [{"role": "user", "content": f"Game {seed}: play."}], "seed": seed} for seed in range(16)]
    rounds: list[tuple[float, set[int]]] = []  # when each tool round ended, and the episodes it played
    tool_round = EpisodeSampler._tool_round

    def recorded(self, open_episodes, *args):
        still_open = tool_round(self, open_episodes, *args)
        rounds.append((time.monotonic(), {id(e) for e, _, _ in open_episodes}))
        return still_open

    monkeypatch.setattr(EpisodeSampler, "_tool_round", recorded)
    sampled, greedy = sample(cfg, EpisodeSampler(cfg, tiny_server.client(), tokenizer), rows, "chunks")
    assert all(e.environment.outcome["solved"] for group in sampled + greedy for e in group)  # each moved, reset once
    first, second = ([e for group in sampled[a:b] + greedy[a:b] for e in group] for a, b in ((0, 8), (8, 16)))
    assert {i for _, played in rounds for i in played} == {id(e) for e in first + second}  # 16 rows: 2 chunks of 8
    last_round_of_first = max(t for t, played in rounds if played & {id(e) for e in first})
    assert min(e.environment._started for e in second) > last_round_of_first  # reset after the first chunk ended
