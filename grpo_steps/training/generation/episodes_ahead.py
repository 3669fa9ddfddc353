"""Environments reset ahead for ``generation.async`` (``environment:``): the producer samples a generation batch's
first turn before the trainer reaches it, and an episode's first prompt holds its environment's reset observation
(TRL's ``environment_factory`` contract: ``reset(**row)`` returns text appended to the last message of the row's
prompt). So each episode of a batch ahead is reset when the batch is read from the prompt stream
(:class:`~grpo_steps.training.generation.prefetch.PromptStream`, in the training thread), each in the worker process
its instance runs in (:class:`~grpo_steps.tools.environments.ProcessEnvironment`); the observation joins the prompt
as TRL joins it, so the prompt the producer samples is the one TRL builds for that batch (trl #6067 was an async
trainer that dropped it: the policy never saw the board).

The instances are kept by the batch's key (its micro-step, as the prefetched batches are keyed) and handed to the
trainer's round for that key (:meth:`EpisodesAhead.take`), whose ``reset`` with the same row plays the episode already
reset: the follow-up turns (TRL's tool loop) step the very instance whose observation the first prompt showed. A batch
the trainer moved past (:meth:`EpisodesAhead.discard_through`), and every batch left at the end
(:meth:`EpisodesAhead.close`), has its instances closed: their worker processes killed. A batch whose prefetched first
turn is dropped as too stale keeps its instances: no move was made, and its first turn is sampled again from the same
prompts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

EMPTY_PROMPT = [{"role": "user", "content": ""}]
"""TRL's prompt of a row without one, with an environment (the environment's reset supplies it)."""


def with_observation(prompt: list[dict], observation: Any) -> list[dict]:
    """``prompt`` (a conversation) with ``observation`` appended to its last message's content, as TRL's
    ``GRPOTrainer._generate_and_score_completions`` joins a reset observation (TRL 1.16; text to text, a list of
    content parts to a list; None: the prompt unchanged). The input is left untouched."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]


class EpisodesAhead:
    """The environment instances of the generation batches read ahead, by key.

    Args:
        factories: ``{name: factory}`` as TRL holds ``environment_factory`` (``None`` the one name of a single
            environment); each instance must have ``_reset_ahead(**row)`` and ``_close()``
            (:class:`grpo_steps.tools.environments.ProcessEnvironment`).
        routed: several environments, each row naming its own in its ``environment`` column (TRL's dict factory).
    """

    def __init__(self, factories: dict[str | None, Callable], routed: bool) -> None:
        self.factories, self.routed = factories, routed
        self.ahead: dict[int, list[tuple[str | None, Any]]] = {}
        """Per key, the batch's instances in row order, each with the name of the environment it was made for."""

    def names(self, rows: list[dict]) -> list[str | None]:
        """The environment of each row (TRL's ``_batch_environments``)."""
        return [row.get("environment") if self.routed else None for row in rows]

    def first_prompts(self, key: int, rows: list[dict]) -> list[list[dict]]:
        """The first prompts of the generation batch at ``key`` (TRL's rows ``rows``): each row's environment reset
        now, in a fresh instance kept for the trainer (:meth:`take`), its observation appended to the row's prompt.
        A row naming an environment that does not exist gets its prompt unchanged and the batch no instances (TRL
        raises its own error when it reaches the batch)."""
        names = self.names(rows)
        prompts = [copy.deepcopy(row.get("prompt", EMPTY_PROMPT)) for row in rows]
        if any(name not in self.factories for name in names):
            return prompts
        close_all([instance for _, instance in self.ahead.pop(key, [])])  # a key read again: its earlier ones go
        made: list[tuple[str | None, Any]] = []
        self.ahead[key] = made  # before the resets: one that raises leaves its predecessors closable
        for index, (name, row) in enumerate(zip(names, rows, strict=True)):
            made.append((name, self.factories[name]()))
            # the control column is not passed to reset in routed mode (TRL's reset_kwargs)
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.routed else row
            prompts[index] = with_observation(prompts[index], made[-1][1]._reset_ahead(**copy.deepcopy(kwargs)))
        return prompts

    def take(self, key: int) -> list[tuple[str | None, Any]] | None:
        """The instances reset ahead for the batch at ``key`` (row order, each with its environment's name), now the
        caller's to close; None when that batch was not read ahead."""
        return self.ahead.pop(key, None)

    def pools(self, made: list[tuple[str | None, Any]]) -> dict[str | None, list]:
        """:meth:`take`'s instances as TRL's environment pools, ``{name: instances in row order}``, each under the
        environment it was made for: TRL hands each row the next instance of its row's environment (a row whose
        environment has none left gets a new one, added to the pool)."""
        pools: dict[str | None, list] = {name: [] for name in self.factories}
        for name, instance in made:
            pools[name].append(instance)
        return pools

    def discard_through(self, key: int) -> None:
        """Close the instances of every batch at or before ``key`` (the trainer moved past them)."""
        for stale in [k for k in self.ahead if k <= key]:
            close_all([instance for _, instance in self.ahead.pop(stale)])

    def close(self) -> None:
        """Close every instance still kept."""
        self.discard_through(max(self.ahead, default=0))


def close_all(instances: list) -> None:
    """Close environment instances (kill their worker processes); one without ``_close`` is left to its owner."""
    for instance in instances:
        close = getattr(instance, "_close", None)
        if callable(close):
            close()
