"""The reward contract, checked on a few prepared rows before any server starts (:func:`probe_rewards`).

Each configured reward is called as TRL's ``GRPOTrainer._calculate_rewards`` calls it (trl 1.16): keyword arguments
``prompts`` (the rows' conversational prompts), ``completions`` (conversational: a list of one assistant message per
completion), ``completion_ids`` (the completions' token ids), every dataset column of the rows (``answer`` and those
``data.columns`` keeps), ``trainer_state``, ``log_extra`` and ``log_metric``, with the reward's ``options`` bound, and
through the guard training calls it through (:func:`rewards.guard.call_with_deadline`): its ``timeout_s``, an
``async def`` reward awaited.
Two completions per probed row: the row's reference answer written as the task's format asks (the first of
:data:`REFERENCE_FORMATS` the format reward scores 1, else the one the correctness reward scores highest), and a
wrong answer in the same format. A reward is refused (:class:`RewardContractError`, naming the function, the row and
the fix) when it

- raises, or returns something other than a list of one value per completion;
- gives no answer within its ``timeout_s`` (the refusal names its file and line; the probe stops at the first);
- returns anything but numbers or None;
- is ``eval.correctness_reward`` and gives a reference answer less than ``eval.correct_at`` (held-out accuracy,
  pass@k and the registry's gate would never count a completion correct), or a wrong answer as much as the reference.

Verl checks its reward functions on a sample before training (``verl.utils.reward_score`` sanity checks) in the same
spirit; the calling convention is TRL's (docs: GRPOTrainer, "Using a custom reward function").
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from grpo_steps.config import ConfigError, PipelineConfig
from rewards.guard import Call, call_with_deadline

PROBE_ROWS = 3
"""Prepared rows each reward is called on (two completions each)."""

REFERENCE_FORMATS = (
    "Answer: {answer}",  # the default system prompt's format (answer_format)
    "<think>\nI worked it out.\n</think>\n<answer>\n{answer}\n</answer>",  # think_answer_format
    "The answer is $\\boxed{{answer}}$.",  # math_accuracy's LaTeX
    "{answer}",
)
"""Ways of writing a reference answer, tried in order (the first the format reward scores 1 is used)."""

NOT_PROBED = {"reward_model": "it loads a reward model", "code_execution": "it runs the sandbox"}
"""Registered rewards whose contract is known and whose call is expensive: not called by the probe."""


class RewardContractError(ConfigError):
    """A reward that breaks TRL's reward contract or the config's definition of a correct answer."""


def written(template: str, answer: str) -> str:
    """``template`` with ``answer`` in place of ``{answer}`` (other braces are kept as they are).

    >>> written('{"answer": "{answer}"}', "42"), written("{{answer}}", "7")
    ('{"answer": "42"}', '{7}')
    """
    return template.replace("{answer}", answer)


def wrong_answer(answer: str) -> str:
    """An answer that differs from ``answer``: the number plus one, or another word.

    >>> wrong_answer("41"), wrong_answer("1/2"), wrong_answer("Paris")
    ('42', '3/2', 'not Paris')
    """
    from rewards.extract import parse_number

    number = parse_number(answer)
    if number is None:
        return f"not {answer}"
    value = number + 1
    return str(value.numerator) if value.denominator == 1 else str(Fraction(value))


class _Reward:
    """A configured reward as the probe calls it: its name, its callable (options bound) and its ``timeout_s``."""

    def __init__(self, name: str, fn: Callable, timeout_s: float) -> None:
        self.name, self.fn, self.timeout_s = name, fn, timeout_s

    def where(self) -> str:
        """``file:line`` of the reward's definition ('' when Python cannot tell, e.g. a builtin)."""
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        fn = inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def _call(reward: _Reward, rows: list[dict], texts: list[str], tokenizer, what: str) -> Call:
    """The reward called as TRL calls it on ``rows`` with one completion ``texts[i]`` each, through the guard training
    calls it through (:func:`rewards.guard.call_with_deadline`: its ``timeout_s``, an ``async def`` reward awaited).
    Raises RewardContractError when it passes its ``timeout_s``: the probe waits for no second timeout."""
    completions = [[{"role": "assistant", "content": text}] for text in texts]
    columns = {key: [row.get(key) for row in rows] for key in dict.fromkeys(k for row in rows for k in row)
               if key != "prompt"}
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    logged: list = []
    kwargs = {"prompts": [row["prompt"] for row in rows], "completion_ids": ids, "trainer_state": None,
              "log_extra": lambda *a, **k: logged.append((a, k)), "log_metric": lambda *a, **k: logged.append((a, k)),
              **columns}
    call = call_with_deadline(reward.fn, reward.name, reward.timeout_s, completions, kwargs)
    if call.timed_out and not call.partial:
        where = f" ({reward.where()})" if reward.where() else ""
        raise RewardContractError(
            f"reward {reward.name!r}{where} gave no answer within its timeout_s ({reward.timeout_s:g} s) when probed "
            f"on row 0 ({_question(rows[0])!r}) with the {what}: in training every such call scores None for all "
            f"its completions. Make it return sooner (it is called once per batch of completions: no network wait or "
            f"sleep without a limit of its own), or raise this reward's timeout_s in the config's rewards list")
    return call


def _checked(reward: _Reward, rows: list[dict], texts: list[str], tokenizer, what: str) -> list:
    """The scores of the reward on one completion per row; raises RewardContractError for a broken contract."""
    name = reward.name
    probe = f"reward {name!r} probed on row 0 ({_question(rows[0])!r}) with the {what}"
    call = _call(reward, rows, texts, tokenizer, what)
    if "error" in call.box:
        err = call.box["error"]
        raise RewardContractError(
            f"{probe} raised {type(err).__name__}: {err}. TRL passes completions as conversational message lists "
            f"([{{'role': 'assistant', 'content': ...}}]), not strings: read the text with "
            f"rewards.extract.completion_text(completion), and take the dataset columns (answer, ...) and the other "
            f"arguments as keyword arguments (docs/your-task.md)") from None
    scores = call.box["result"]
    if not isinstance(scores, list | tuple) or len(scores) != len(texts):
        got = f"{len(scores)} values" if isinstance(scores, list | tuple) else type(scores).__name__
        raise RewardContractError(f"{probe} returned {got} for {len(texts)} completions: return a list with one "
                                  "score per completion, in their order")
    for i, score in enumerate(scores):
        if score is not None and (isinstance(score, bool) or not isinstance(score, int | float)
                                  or math.isnan(score)):
            raise RewardContractError(
                f"reward {name!r} gave row {i} ({_question(rows[i])!r}) the {what} {score!r} "
                f"({type(score).__name__}): return a float per completion, or None where the reward does not apply")
    return list(scores)


def _question(row: dict) -> str:
    prompt = row.get("prompt")
    text = prompt[-1]["content"] if isinstance(prompt, list) and prompt else str(prompt)
    return text if len(text) <= 80 else text[:77] + "..."


def reference_format(cfg: PipelineConfig, rewards: dict[str, _Reward], rows: list[dict], answers: list[str],
                     tokenizer) -> str:
    """The format the task asks for: ``eval.reference_format`` when set, else see the module docstring."""
    if cfg.eval.reference_format:
        return cfg.eval.reference_format
    judge = cfg.eval.format_reward if cfg.eval.format_reward in rewards else None
    if judge is None and cfg.eval.correctness_reward not in rewards:
        return REFERENCE_FORMATS[0]
    best, best_score = REFERENCE_FORMATS[0], -math.inf
    for template in REFERENCE_FORMATS:
        texts = [written(template, a) for a in answers]
        name = judge or cfg.eval.correctness_reward
        box = _call(rewards[name], rows, texts, tokenizer, "reference answer").box  # a timeout: refused here
        scores = box.get("result")
        if not isinstance(scores, list | tuple):  # raised or returned no list: judged by _checked, with its message
            return REFERENCE_FORMATS[0]
        total = sum(float(s) for s in scores if isinstance(s, int | float))
        if judge and all(s == 1.0 for s in scores):
            return template
        if total > best_score:
            best, best_score = template, total
    return best


def probe_rewards(cfg: PipelineConfig, rows: list[dict], tokenizer) -> list[str]:
    """Call every configured reward on the first :data:`PROBE_ROWS` of ``rows`` that have a reference answer (or the
    first ones, when none has) and check the contract (module docstring). Returns one line per reward saying what it
    gave each probe.

    Raises:
        RewardContractError: names the reward, the row and the fix.
    """
    from rewards import bind_options, resolve_reward
    from rewards.math import gold_answer

    started = time.monotonic()
    with_answer = [row for row in rows if gold_answer(row.get("answer")) is not None]
    probed = (with_answer or rows)[:PROBE_ROWS]
    if not probed:
        return []
    answers = [gold_answer(row.get("answer")) or "" for row in probed]
    rewards = {spec.name: _Reward(spec.name, bind_options(resolve_reward(spec.name), spec.options, spec.name),
                                  spec.timeout_s) for spec in cfg.rewards if spec.name not in NOT_PROBED}
    template = reference_format(cfg, rewards, probed, answers, tokenizer) if rewards else REFERENCE_FORMATS[0]
    reference = [written(template, a) for a in answers]
    wrong = [written(template, wrong_answer(a)) for a in answers]
    lines, refusals = [], []
    for spec in cfg.rewards:
        if spec.name in NOT_PROBED:
            lines.append(f"[rewards] {spec.name}: not probed ({NOT_PROBED[spec.name]})")
            continue
        reward = rewards[spec.name]
        try:  # every reward probed: one refusal names each broken one
            good = _checked(reward, probed, reference, tokenizer, "reference answer")
            bad = _checked(reward, probed, wrong, tokenizer, "wrong answer")
            if spec.name == cfg.eval.correctness_reward and with_answer:
                _check_correctness(cfg, spec.name, probed, good, bad, reference[0])
        except RewardContractError as err:
            refusals.append(str(err))
            continue
        shown = ", ".join(f"{_fmt(g)}/{_fmt(b)}" for g, b in zip(good, bad, strict=True))
        lines.append(f"[rewards] {spec.name}: reference/wrong answer per probed row {shown}")
    if refusals:
        raise RewardContractError(f"{len(refusals)} of the rewards cannot be trained with as they are "
                                  "(docs/your-task.md):\n" + "\n".join(f"- {message}" for message in refusals))
    lines.append(f"[rewards] probed {len(cfg.rewards)} reward(s) on {len(probed)} rows, reference written as "
                 f"{template.splitlines()[0]!r}... ({time.monotonic() - started:.2f} s)")
    return lines


def _check_correctness(cfg: PipelineConfig, name: str, rows: list[dict], good: list, bad: list, shown: str) -> None:
    at = cfg.eval.correct_at
    for i, (g, b) in enumerate(zip(good, bad, strict=True)):
        where = f"row {i} ({_question(rows[i])!r}, answer {rows[i].get('answer')!r})"
        if g is None or g < at:
            raise RewardContractError(
                f"eval.correctness_reward {name!r} gave the reference answer of {where}, written as {shown!r}, "
                f"{_fmt(g)}: less than eval.correct_at ({at:g}), the score from which held-out accuracy, pass@k "
                f"and the registry's gate count a completion correct. Return {at:g} for a correct answer, or set "
                f"eval.correct_at to the score your reward gives one (eval.reference_format: how your task writes an "
                f"answer, when it is none of these)")
        if b is not None and b >= g:
            raise RewardContractError(
                f"eval.correctness_reward {name!r} gave a wrong answer of {where} {_fmt(b)}, as much as the "
                f"reference answer ({_fmt(g)}): it cannot tell right from wrong. Compare the completion's final "
                "answer with the row's answer column (rewards.extract.extract_answer, rewards.answers.answer_accuracy)")


def _fmt(score: Any) -> str:
    return "None" if score is None else f"{score:g}"
