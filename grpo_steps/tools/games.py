"""Games for ``environment:`` beyond TRL's own contract, adapted so the user writes no wrapper.

``environment:`` names a factory in TRL's ``environment_factory`` contract (``reset(**row)``, public methods that are
the tools, optionally ``get_reward()``), or one of two other interfaces, adapted here:

- ``gym:module:Class``: a gymnasium-style class, ``reset(seed=...) -> (observation, info)`` and
  ``step(action) -> (observation, reward, terminated, truncated, info)`` (Gymnasium's ``Env`` API;
  https://gymnasium.farama.org/api/env/). Adapted by :class:`GymGame`: the episode's return is its reward.
- ``textarena:<env id>``: a single-player TextArena game (``textarena.make(id)``, e.g. ``GuessTheNumber-v0``;
  https://github.com/LeonGuertler/TextArena). Adapted by :class:`TextArenaGame`.

Both give the policy one tool, ``move(action)``, whose answer is what the game says back (the board or the feedback
of that move); ``reset(**row)`` starts the game seeded by the row's ``seed`` column and returns its first
observation, which TRL appends to the question. ``outcome`` (a property: TRL exposes methods only) tells the rewards
of :mod:`rewards.game` whether the episode was solved and how many moves were invalid.

The adapter prefix of a spec is read here only: :func:`adapter_factory` builds, :func:`module_of` names the module a
spec imports (for the code package, :mod:`grpo_steps.deploy`, and the worker processes' fork server,
:mod:`grpo_steps.tools.environments`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

GYM = "gym:"
TEXTARENA = "textarena:"
INVALID_MOVE = "invalid move"


def module_of(spec: str) -> str:
    """The dotted module an ``environment:`` spec imports: ``textarena`` for ``textarena:<id>``, ``module`` for
    ``gym:module:Class`` and for a factory ``module:factory`` (or ``module.factory``).

    >>> module_of("textarena:GuessTheNumber-v0"), module_of("gym:pkg.games:Maze"), module_of("my_envs:Abacus")
    ('textarena', 'pkg.games', 'my_envs')
    """
    if spec.startswith(TEXTARENA):
        return "textarena"
    module, _, _ = spec.removeprefix(GYM).replace(":", ".").rpartition(".")
    return module


def adapter_factory(spec: str, resolve: Callable[[str, str], Callable], key: str) -> Callable:
    """The factory ``spec`` names: ``gym:module:Class`` and ``textarena:<id>`` adapted (:class:`GymGame`,
    :class:`TextArenaGame`), else ``resolve(spec, key)`` (a factory in TRL's contract)."""
    if spec.startswith(TEXTARENA):
        import importlib.util

        if importlib.util.find_spec("textarena") is None:
            raise ValueError(f"{key} {spec!r} names a TextArena game, and textarena is not installed "
                              "(pip install textarena)")
        return functools.partial(TextArenaGame, spec[len(TEXTARENA):])
    if spec.startswith(GYM):
        return functools.partial(GymGame, resolve(spec[len(GYM):], key))
    return resolve(spec, key)


class _Game:
    """What both adapters share: the move log, ``outcome`` and the end of the episode."""

    def _start(self) -> None:
        self._done, self._solved, self._invalid, self._return = False, False, 0, 0.0
        self._steps: list[dict] = []

    def _record(self, action: str, observation: str, reward: float, invalid: bool) -> str:
        self._invalid += invalid
        self._return += reward
        self._steps.append({"action": action, "observation": observation, "reward": reward, "invalid": invalid})
        return observation

    def _refuse_after_end(self) -> None:
        if self._done:
            raise ValueError("the game is over: make no more moves")

    @property
    def outcome(self) -> dict:
        """``solved`` (bool), ``moves`` (moves made), ``invalid_moves``, ``return`` (sum of the game's rewards) and
        ``steps`` (per move: ``action``, ``observation``, ``reward``, ``invalid``)."""
        return {"solved": self._solved, "moves": len(self._steps), "invalid_moves": self._invalid,
                "return": self._return, "steps": list(self._steps)}


class TextArenaGame(_Game):
    """A single-player TextArena game in TRL's contract. ``move``'s answer is the text the game added to the player's
    observation since the last move (the feedback; with ``LLMObservationWrapper``, TextArena's default, the
    observation is the whole history). Solved: the game ended with reward 1 (TextArena's win). Invalid: the moves
    TextArena refused (its ``error_allowance``; past it the game ends lost)."""

    def __init__(self, env_id: str) -> None:
        self._name = env_id
        self._env = self._make()
        self._seen = 0
        self._start()

    def _make(self) -> Any:
        import textarena

        return textarena.make(self._name)

    def _new_text(self) -> str:
        _, observation = self._env.get_observation()
        text, self._seen = observation[self._seen:], len(observation)
        return text.strip()

    def reset(self, seed: int | None = None, **row: Any) -> str:
        # a new env per episode: TextArena 0.7.4's LLMObservationWrapper keeps every earlier game's messages across
        # reset, so a reused instance's observation began with the last episode's history (the prompts of one group
        # then differed, and the policy read another game's moves). textarena.make takes ~0.01 ms.
        self._env = self._make()
        self._env.reset(num_players=1, seed=seed)
        self._seen = 0
        self._start()
        return "\n" + self._new_text()

    def move(self, action: str) -> str:
        """Make one move in the game and read what the game answers.

        Args:
            action: The move, written as the game's rules say.
        """
        self._refuse_after_end()
        done, _ = self._env.step(str(action))
        state = _unwrapped(self._env).state
        # TextArena counts a refused move in error_count until the next valid move (SinglePlayerState.step)
        invalid = bool(getattr(state, "error_count", 0)) and not done
        reward = 0.0
        if done:
            rewards, info = self._env.close()
            reward = float((rewards or {}).get(0, 0.0))
            invalid = invalid or bool((info or {}).get(0, {}).get("invalid_move"))
            self._done, self._solved = True, reward == 1.0
        text = self._new_text() if not done else _reason(self._env) or ("solved" if self._solved else "game over")
        return self._record(str(action), text, reward, invalid)


def _unwrapped(env: Any) -> Any:
    while hasattr(env, "env"):
        env = env.env
    return env


def _reason(env: Any) -> str:
    info = getattr(_unwrapped(env).state, "game_info", {}) or {}
    return str(info.get(0, {}).get("reason") or "")


class GymGame(_Game):
    """A gymnasium-style class (``reset(seed=) -> (obs, info)``, ``step(action) -> (obs, reward, terminated,
    truncated, info)``) in TRL's contract; ``get_reward`` is the episode's return. Observations go to the policy as
    text (``str``). With a discrete ``action_space`` (one with ``n``), the action is read as an integer. Solved:
    ``info["solved"]`` when the game says, else terminated with a positive last reward. Invalid: a move
    ``info["invalid_move"]`` marks, or one the game (or the integer reading) raised ``ValueError`` for."""

    def __init__(self, cls: Callable) -> None:
        self._env = cls()
        self._name = getattr(cls, "__name__", "GymGame")
        self._start()

    def reset(self, seed: int | None = None, **row: Any) -> str:
        observation, _ = self._env.reset(seed=seed)
        self._start()
        return "\n" + str(observation)

    def move(self, action: str) -> str:
        """Make one move in the game and read what the game answers.

        Args:
            action: The move, written as the game's rules say.
        """
        self._refuse_after_end()
        try:
            chosen: Any = int(action) if hasattr(getattr(self._env, "action_space", None), "n") else action
            observation, reward, terminated, truncated, info = self._env.step(chosen)
        except ValueError as err:
            return self._record(str(action), f"{INVALID_MOVE}: {err}", 0.0, True)
        info = info or {}
        self._done = bool(terminated or truncated)
        self._solved = bool(info.get("solved", terminated and reward > 0))
        return self._record(str(action), str(observation), float(reward), bool(info.get("invalid_move")))

    def get_reward(self) -> float:
        return self._return
