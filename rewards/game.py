"""Rewards of a game episode (``environment:``), read from each episode's environment: ``outcome``, which the
game adapters of :mod:`grpo_steps.tools.games` keep (``solved``, ``invalid_moves``, ``moves``, ``timed_out``).

TRL passes every reward function the rollouts' environment instances as ``environments`` (one per completion,
``GRPOTrainer._calculate_rewards``); the evaluation does the same (:mod:`grpo_steps.evaluation.scoring`). An
episode without an environment, or one whose environment keeps no ``outcome``, scores None (left out of the sum, as
TRL does with None).
"""

from __future__ import annotations


def _outcomes(completions: list, environments: list | None) -> list[dict | None]:
    if environments is None:
        return [None] * len(completions)
    return [getattr(env, "outcome", None) if env is not None else None for env in environments]


def game_solved(completions: list, environments: list | None = None, log_metric=None,
                **_columns) -> list[float | None]:
    """1.0 when the episode solved its game, else 0.0 (an episode ended by a time limit is not solved): the binary
    success reward of multi-turn game RL (RAGEN's Sokoban/FrozenLake success, TextArena's win). With TRL's
    ``log_metric``, also logs ``game/timed_out``: the episodes of the call that ``generation.episode_timeout_s``
    ended (a count per reward call, which TRL averages over its logging window).

    >>> class Env:
    ...     def __init__(self, solved): self.outcome = {"solved": solved, "invalid_moves": 0}
    >>> game_solved(["", "", ""], environments=[Env(True), Env(False), None])
    [1.0, 0.0, None]
    """
    outcomes = _outcomes(completions, environments)
    if callable(log_metric) and any(o is not None for o in outcomes):
        log_metric("game/timed_out", float(sum(bool(o and o.get("timed_out")) for o in outcomes)))
    return [None if o is None or "solved" not in o else float(bool(o["solved"])) for o in outcomes]


def game_invalid_moves(completions: list, environments: list | None = None, **_columns) -> list[float | None]:
    """Minus the number of moves the game refused in the episode (0.0 for none): the shaping that penalises
    invalid actions, as RAGEN's format penalty does; its weight in ``rewards`` sets the penalty per move (e.g.
    0.1 against a solved game's 1).

    >>> class Env:
    ...     def __init__(self, invalid): self.outcome = {"solved": False, "invalid_moves": invalid}
    >>> game_invalid_moves(["", ""], environments=[Env(2), Env(0)])
    [-2.0, 0.0]
    """
    return [None if o is None or "invalid_moves" not in o else -float(o["invalid_moves"]) or 0.0
            for o in _outcomes(completions, environments)]


def turn_rewards(messages: list[dict], outcome: dict | None) -> list[float | None] | None:
    """The game's reward of each assistant turn of an episode (``messages``: TRL's completion, the assistant's turns
    and the tools' answers): the sum of the rewards of the moves the turn made, in order from the environment's
    ``outcome["steps"]`` (one per move the game took; a tool answer that is an error made none); None for a turn
    that made no move. None when the environment keeps no per-move rewards (no ``steps``).

    >>> steps = [{"reward": -0.25}, {"reward": 1.0}]
    >>> call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "move"}}]}
    >>> turn_rewards([call, {"role": "tool", "content": "higher"}, call, {"role": "tool", "content": "right"},
    ...               {"role": "assistant", "content": "done"}], {"steps": steps})
    [-0.25, 1.0, None]
    """
    if not isinstance(outcome, dict) or not outcome.get("steps"):
        return None
    return [reward for _, _, reward in turn_moves(messages, outcome["steps"])]


def turn_moves(messages: list[dict], steps: list[dict]) -> list[tuple[dict, list[dict], float | None]]:
    """Each assistant turn of ``messages`` with the tools' answers to it and the summed reward of the moves it made:
    ``(message, answers, reward)``, the reward None where it made none. ``steps`` are the environment's moves in order
    (``{"reward": ...}``); a turn's calls take them in order, except a call TRL answered with an error
    (``{'error': ...}``: it raised, the game made no move)."""
    moves, turns = iter(steps), []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        answers = []
        for later in messages[i + 1:]:
            if later.get("role") != "tool":
                break
            answers.append(later)
        # TRL's answer for a call that raised (grpo_trainer.py, the tool loop): {'error': ...}; the game made no move
        made = [next(moves, None) for answer in answers if not str(answer.get("content")).startswith("{'error'")]
        rewards = [float(step["reward"]) for step in made if step is not None]
        turns.append((message, answers, sum(rewards) if rewards else None))
    return turns
