"""Environments of the tests, in a module of their own: an environment's module is imported in the worker processes'
fork server (grpo_steps/tools/environments.py), and a test module would bring torch and TRL there."""

import time


class Abacus:
    """A stateful environment in TRL's contract: ``reset`` sees the row, its public method is the tool, and
    ``get_reward`` scores what happened during the episode."""

    def __init__(self):
        self.row, self.calls = None, []

    def reset(self, **row) -> str:
        self.row, self.calls = row, []
        return f"Use the abacus; the target is {row['target']}."

    def abacus(self, expression: str) -> str:
        """Evaluate an arithmetic expression on the abacus.

        Args:
            expression: The expression, e.g. "2 * 3".
        """
        from grpo_steps.tools import calculator as shipped

        self.calls.append(expression)
        return shipped(expression)

    def get_reward(self) -> float:
        return 2.0 if self.calls and self.row["target"] == "6" else 0.0


class Countdown:
    """A gymnasium-style game (``reset(seed=) -> (obs, info)``, ``step(action) -> 5-tuple``), no TRL in sight:
    guess the seed's number in 1..4."""

    def reset(self, seed=None, options=None):
        self.target = seed % 4 + 1
        return f"Guess a number from 1 to 4 (game {seed}).", {}

    def step(self, action):
        if action == self.target:
            return "right", 1.0, True, False, {}
        return ("higher" if action < self.target else "lower"), -0.25, False, False, {"invalid_move": action > 4}


Countdown.action_space = type("Discrete", (), {"n": 4})()  # gymnasium.spaces.Discrete's one attribute read


class Stuck:
    """A gymnasium-style game whose move ``"wait"`` never returns; any other move wins."""

    def reset(self, seed=None, options=None):
        return "Say anything.", {}

    def step(self, action):
        if action == "wait":
            time.sleep(600)
        return "won", 1.0, True, False, {}


class Board:
    """An environment in TRL's contract whose every answer says which game it plays and how many times it was reset:
    what the async test checks (the follow-up turns step the instance whose reset observation the first prompt
    showed, reset once)."""

    def __init__(self):
        self.seed, self.resets = None, 0

    def reset(self, seed=None, **row) -> str:
        self.seed, self.resets, self.moved = seed, self.resets + 1, False
        return f" The board of game {seed} is ready."

    def move(self, action: str) -> str:
        """Make one move on the board.

        Args:
            action: The move.
        """
        self.moved = True
        return f"game {self.seed}, reset {self.resets} time(s)"

    @property
    def outcome(self) -> dict:
        """Solved: a move made in an episode reset once (what rewards.game reads)."""
        return {"solved": bool(getattr(self, "moved", False)) and self.resets == 1, "invalid_moves": 0}


class Loud:
    """An environment in TRL's contract whose tools exit or answer at length."""

    def reset(self, **row) -> None:
        return None

    def leave(self, code: int) -> int:
        """Exit.

        Args:
            code: exit code.
        """
        raise SystemExit(code)

    def huge(self, n: int) -> str:
        """Long answer.

        Args:
            n: characters.
        """
        return "y" * n
