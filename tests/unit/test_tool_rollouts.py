"""Multi-turn rollouts on the server path, without a server: TRL's own tool loop runs over
:class:`RolloutBackend` whose ``generate`` returns a constructed episode (a tool call, then an answer after the
tool's result), on the tiny policy with TRL's Qwen2.5 chat template. What is checked is TRL's code as this pipeline
drives it: the tool runs in the training process, its answer's tokens join the completion and are masked out of the
loss and of the mismatch metrics, a raising or hanging tool becomes an error message and the step goes on, and the
iteration bound holds."""

import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from grpo_steps.config import validate_config
from grpo_steps.servers.client import VLLMClient
from grpo_steps.training.generation.server import ServerSettings
from grpo_steps.training.job import TrainJob, grpo_args
from grpo_steps.training.trainer import ServerGRPOTrainer

CALL = '<tool_call>\n{"name": "%s", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
GROUP = 2
SAMPLER_LOGP = -0.5  # the constructed sampler logprob of every model token


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "2 * 3".
    """
    from grpo_steps.tools.functions import calculator as shipped

    return shipped(expression)


def broken(expression: str) -> str:
    """Always fails.

    Args:
        expression: Ignored.
    """
    raise RuntimeError("the tool broke")


def hangs(expression: str) -> str:
    """Never answers in time.

    Args:
        expression: Ignored.
    """
    time.sleep(30)
    return "late"


def answer_reward(completions, **_):
    return [1.0 if "Answer: 6" in c[-1]["content"] else 0.0 for c in completions]


def with_timeout(fn: Callable, seconds: float) -> Callable:
    """``fn`` limited to ``seconds`` of wall clock per call, in this process (a tool that needs no worker process's
    start: TRL's tool loop is what these tests check); same name, signature and docstring, so it is described to
    the model as ``fn`` is. The call runs in a daemon thread (a tool that hangs keeps it). Raises ``TimeoutError``
    past the limit, ``RuntimeError`` for a ``SystemExit`` or ``KeyboardInterrupt`` of the tool, whatever ``fn``
    raises otherwise.

    >>> def slow(x: int) -> int:
    ...     time.sleep(x)
    ...     return x
    >>> with_timeout(slow, 0.05)(0)
    0
    >>> with_timeout(slow, 0.05)(1)
    Traceback (most recent call last):
    ...
    TimeoutError: tool 'slow' took longer than 0.05 s (generation.tool_timeout_s)
    """
    message = f"tool {fn.__name__!r} took longer than {seconds:g} s (generation.tool_timeout_s)"

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller below
                box["error"] = err

        thread = threading.Thread(target=target, name=f"tool-{fn.__name__}", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            raise TimeoutError(message)
        error = box.get("error")
        if isinstance(error, SystemExit | KeyboardInterrupt):  # the tool's, not a reason to stop the trainer
            raise RuntimeError(f"tool {fn.__name__!r} raised {type(error).__name__}: {error}")
        if error is not None:
            raise error
        return box["value"]

    return timed


def _trainer(tiny_model_path, tmp_path, turns: list[str], tool: str | None = "calculator", iterations: int = 3,
             environment=None, worker: bool = False):
    """A ServerGRPOTrainer with tool ``tool`` (and/or an ``environment`` factory) whose generation returns ``turns``
    in order (every rollout the same turn), token by token with logprob SAMPLER_LOGP; the push is a no-op. The
    prompts of each generation call are recorded with it."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from grpo_steps.models import load_tokenizer
    from grpo_steps.tools.environments import environment_factories, trl_environment_factory
    from grpo_steps.tools.functions import tool_functions

    tokenizer = load_tokenizer(tiny_model_path, "qwen2_5")
    # the tiny tokenizer spells the tool markup nearly byte by byte: room for a call, an answer and a reply
    cfg = validate_config({"generation": {"max_completion_tokens": 400, "max_tool_calling_iterations": iterations,
                                          "tool_timeout_s": 1},
                           "rewards": [{"name": "answer_accuracy"}], "eval": {"format_reward": None},
                           "train": {"per_device_train_batch_size": GROUP, "num_generations": GROUP}})
    args = grpo_args(TrainJob(config=cfg, model_path=tiny_model_path, train_file="unused", output_dir=str(tmp_path)))
    server = ServerSettings(client=VLLMClient("http://127.0.0.1:9"), gen=cfg.generation,
                            max_model_len=1024, transport=None, probe_ids=[1, 2], probe_tolerance=0.05)
    calls, seen = [], []

    def generate(prompts, images=None, num_generations=1, profiler=None):
        text = turns[min(len(calls), len(turns) - 1)]
        calls.append((len(prompts), num_generations))
        seen.append([tokenizer.decode(p) for p in prompts])
        ids = tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
        return (prompts, [list(ids) for _ in prompts], [[[SAMPLER_LOGP]] * len(ids) for _ in prompts],
                [[[t] for t in ids] for _ in prompts])

    tools = {"calculator": calculator, "broken": broken, "hangs": hangs}
    trainer = ServerGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(tiny_model_path),
                                reward_funcs=[answer_reward], args=args,
                                train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}]}] * 2),
                                processing_class=tokenizer, server=server,
                                tools=(tool_functions([f"rollout_tools:{tool}"], cfg.generation.tool_timeout_s)
                                       if worker else [with_timeout(tools[tool], cfg.generation.tool_timeout_s)]
                                       ) if tool else [],
                                environment_factory=trl_environment_factory(environment_factories(
                                    environment, cfg.generation.tool_timeout_s)))
    trainer.vllm_generation.generate, trainer.vllm_generation.sync_weights = generate, lambda: None
    trainer._last_loaded_step = trainer.state.global_step
    trainer.model.train()
    trainer.seen_prompts = seen
    return trainer, tokenizer, calls


def _episode(trainer, **row):
    inputs = [{"prompt": [{"role": "user", "content": "Calculate 2 * 3."}], **row}] * GROUP
    out = trainer._generate_and_score_completions(inputs)
    return out, list(trainer._logs["completion"])[-GROUP:]


def test_a_tool_call_runs_and_its_answer_is_masked(tiny_model_path, tmp_path):
    trainer, tokenizer, calls = _trainer(tiny_model_path, tmp_path, [CALL % "calculator", "Answer: 6"])
    out, completions = _episode(trainer)
    assert calls == [(GROUP, GROUP), (GROUP, 1)]  # the first turn of the group, then one follow-up per rollout
    messages = completions[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant"]
    assert messages[0]["tool_calls"][0]["function"] == {"name": "calculator", "arguments": {"expression": "2 * 3"}}
    assert messages[1]["content"] == "6" and messages[2]["content"] == "Answer: 6"
    assert out["advantages"].abs().sum() == 0  # both rollouts equal: same reward
    first = tokenizer(CALL % "calculator" + "<|im_end|>", add_special_tokens=False)["input_ids"]
    last = tokenizer("Answer: 6<|im_end|>", add_special_tokens=False)["input_ids"]
    mask, ids = out["tool_mask"][0].tolist(), out["completion_ids"][0].tolist()
    suffix = len(ids) - len(first) - len(last) - (len(ids) - int(out["completion_mask"][0].sum()))
    assert mask[: len(first)] == [1] * len(first)  # the model's call: trained on
    assert mask[len(first) : len(first) + suffix] == [0] * suffix and suffix > 0  # the tool's answer: masked
    assert "6" in tokenizer.decode(ids[len(first) : len(first) + suffix])
    assert mask[len(first) + suffix : len(first) + suffix + len(last)] == [1] * len(last)
    # the mismatch metrics count the model's tokens only: the tool tokens' "sampler logprob" (0) is left out
    sampling = out["sampling_per_token_logps"][0]
    model_tokens = (out["completion_mask"][0] * out["tool_mask"][0]).bool()
    assert torch.allclose(sampling[model_tokens], torch.full((int(model_tokens.sum()),), SAMPLER_LOGP))
    assert trainer._metrics["train"]["tools/call_frequency"][-1] == 1.0
    assert trainer._metrics["train"]["tools/turns_per_episode"][-1] == 2.0


@pytest.mark.parametrize("worker", [False, True], ids=["thread", "worker-process"])  # with_timeout / tools
@pytest.mark.parametrize("tool, error", [("broken", "the tool broke"), ("hangs", "took longer than 1 s")])
def test_a_failing_tool_answers_with_its_error_and_the_step_goes_on(tiny_model_path, tmp_path, monkeypatch, tool,
                                                                    error, worker):
    if worker:  # the tools in a module of their own (this one imports torch: seconds per worker start)
        (tmp_path / "rollout_tools.py").write_text("import time\n\n\n" + inspect.getsource(broken) + "\n\n"
                                                   + inspect.getsource(hangs))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    trainer, _, calls = _trainer(tiny_model_path, tmp_path, [CALL % tool, "Answer: 6"], tool=tool, worker=worker)
    started = time.monotonic()
    out, completions = _episode(trainer)
    assert time.monotonic() - started < 20  # the hanging tool was cut at tool_timeout_s
    assert error in completions[0][1]["content"] and completions[0][1]["role"] == "tool"
    assert completions[0][-1]["content"] == "Answer: 6"  # the model's next turn came
    assert trainer._metrics["train"]["tools/failure_frequency"][-1] == 1.0
    assert out["completion_ids"].shape[0] == GROUP


def test_the_iteration_bound_ends_the_episode(tiny_model_path, tmp_path):
    """A model that calls the tool every turn stops after max_tool_calling_iterations rounds."""
    trainer, _, calls = _trainer(tiny_model_path, tmp_path, [CALL % "calculator"], iterations=2)
    _, completions = _episode(trainer)
    assert calls == [(GROUP, GROUP), (GROUP, 1), (GROUP, 1)]
    assert [m["role"] for m in completions[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]


def test_an_environment_is_reset_with_its_row_and_its_reward_scores_the_episode(tiny_model_path, tmp_path):
    """One environment per rollout: ``reset(**row)`` gets the row (its string joins the question the model sees), the
    call goes to that rollout's instance (in its worker process: the reward of 2 needs the call and the row held by
    the same instance), and ``get_reward`` is an extra reward of weight 1 (TRL's contract)."""
    trainer, _, calls = _trainer(tiny_model_path, tmp_path, [CALL % "abacus", "Answer: 6"], tool=None,
                                 environment="tests.unit.toy_games:Abacus")
    out, completions = _episode(trainer, target="6")
    assert "Use the abacus; the target is 6." in trainer.seen_prompts[0][0]
    assert '"name": "abacus"' in trainer.seen_prompts[0][0]  # its method is rendered as a tool
    assert completions[0][1] == {"role": "tool", "name": "abacus", "content": "6"}
    assert trainer._metrics["train"]["rewards/Abacus/mean"][-1] == 2.0
    assert trainer._metrics["train"]["reward"][-1] == 2.0 + 1.0  # answer_reward 1 + the environment's 2


MOVE = '<tool_call>\n{"name": "move", "arguments": {"action": "%s"}}\n</tool_call>'


def test_a_gymnasium_style_environment_plays_through_trl_without_a_wrapper(tiny_model_path, tmp_path):
    """``environment: gym:module:Class``: TRL resets it with the row's seed (its observation joins the first prompt),
    the policy's ``move`` calls reach ``step`` with the action read as an integer (a discrete action space), the
    game's observation comes back as the tool's answer, and the episode's return is the environment's reward."""
    trainer, _, calls = _trainer(tiny_model_path, tmp_path, [MOVE % "2", MOVE % "3", "done"], tool=None,
                                 environment="gym:tests.unit.toy_games:Countdown")
    out, completions = _episode(trainer, seed=2)  # target 3
    assert "Guess a number from 1 to 4 (game 2)." in trainer.seen_prompts[0][0]
    assert '"name": "move"' in trainer.seen_prompts[0][0]
    assert [m.get("content") for m in completions[0] if m["role"] == "tool"] == ["higher", "right"]
    assert trainer._metrics["train"]["rewards/Countdown/mean"][-1] == 0.75  # -0.25 then +1


def test_an_environment_reset_ahead_is_the_one_the_round_plays_then_closed(tiny_model_path, tmp_path):
    """``generation.async`` with an environment (:mod:`grpo_steps.training.generation.episodes_ahead`): the prompt
    stream resets a batch's environments ahead and the producer's first prompts are TRL's own for that batch, the
    observation joined as TRL joins it (the prefetched batch is used, not missed); TRL's round at that key plays
    those instances (reset once: its reset with the same row does not reset again), then they are closed."""
    import psutil

    from grpo_steps import trl_hooks
    from grpo_steps.training.generation.episodes_ahead import EpisodesAhead

    trainer, tokenizer, calls = _trainer(tiny_model_path, tmp_path, [MOVE % "go", "done"] * 2, tool=None,
                                         environment="tests.unit.toy_games:Board")
    trainer.episodes_ahead = episodes = EpisodesAhead(trainer.environment_factories, routed=False)
    rows = [{"prompt": [{"role": "user", "content": "Play."}], "seed": 5}] * GROUP
    key = trl_hooks.micro_step(trainer)
    ahead = trl_hooks.tokenize_prompts(trainer, episodes.first_prompts(key, rows), episodes.names(rows))
    instances = [instance for _, instance in episodes.ahead[key]]
    pids = [instance._process.proc.pid for instance in instances]
    episodes.first_prompts(key + 1, rows)  # the next batch, read ahead from rows TRL will not give it
    later = [instance._process.proc.pid for _, instance in episodes.ahead[key + 1]]
    out = trainer._generate_and_score_completions(rows)
    completions = list(trainer._logs["completion"])[-GROUP:]
    assert [tokenizer.decode(ids) for ids in ahead] == trainer.seen_prompts[0]  # the producer's prompts are TRL's
    assert "Play. The board of game 5 is ready." in trainer.seen_prompts[0][0]
    assert [m.get("content") for m in completions[0] if m["role"] == "tool"] == ["game 5, reset 1 time(s)"]
    assert key not in episodes.ahead and all(instance._process.proc is None for instance in instances)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    assert out["completion_ids"].shape[0] == GROUP
    # the stream read other rows than TRL's for the next batch: TRL's reset of its row resets the instance again
    assert trl_hooks.count_micro_step(trainer) == key + 1
    trainer._generate_and_score_completions([{**row, "seed": 7} for row in rows])
    completions = list(trainer._logs["completion"])[-GROUP:]
    assert [m.get("content") for m in completions[0] if m["role"] == "tool"] == ["game 7, reset 2 time(s)"]
    assert not episodes.ahead
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in later)


def test_per_turn_credit_gives_each_turn_the_moves_rewards_from_it_on(tiny_model_path, tmp_path):
    """``train.turn_credit`` (:mod:`grpo_steps.training.turn_credit`): a gymnasium game's move rewards (-0.25 for a
    wrong guess, +1 for the right one) become per-token advantages: each turn's tokens get the episode's advantage
    (0 here: both rollouts of the group are the same episode) plus the group-normalised rewards of its moves and the
    later ones (DeepSeekMath's process-supervision GRPO); the tool answers and the final turn, which made no move,
    get none."""
    trainer, tokenizer, calls = _trainer(tiny_model_path, tmp_path, [MOVE % "2", MOVE % "3", "done"], tool=None,
                                         environment="gym:tests.unit.toy_games:Countdown")
    trainer.turn_credit = 1.0
    out, completions = _episode(trainer, seed=2)  # target 3: "higher" (-0.25), then "right" (+1)
    assert [m.get("content") for m in completions[0] if m["role"] == "tool"] == ["higher", "right"]
    advantages = out["advantages"]
    assert advantages.shape == out["completion_ids"].shape  # (B, T): TRL's loss takes them per token
    rewards = torch.tensor([-0.25, 1.0, -0.25, 1.0], dtype=torch.float64)  # every turn reward of the group
    later = ((1.0 - rewards.mean()) / (rewards.std() + 1e-4)).item()  # the second move's, normalised
    for row in range(GROUP):
        model = out["tool_mask"][row].bool() & out["completion_mask"][row].bool()
        spans, start = [], None
        for t, on in enumerate(model.tolist() + [False]):
            if on and start is None:
                start = t
            elif not on and start is not None:
                spans.append((start, t))
                start = None
        assert len(spans) == 3  # three turns: two moves, then the answer
        first, second, last = (advantages[row, a:b] for a, b in spans)
        assert torch.allclose(first, torch.zeros_like(first), atol=1e-4)  # -0.866 + 0.866: the moves to go
        assert torch.allclose(second, torch.full_like(second, later), atol=1e-4) and later > 0.8
        assert torch.allclose(last, torch.zeros_like(last))
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
    loss = trainer._compute_loss(trainer.model, out)  # TRL's loss over (B, T) advantages
    assert loss.ndim == 0 and torch.isfinite(loss)
