"""The ``train.curriculum`` section: which training prompts the next generation batch draws, by each prompt's running
pass rate (:mod:`grpo_steps.training.curriculum`), and the combinations ``start`` refuses with it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_steps.config.base import _Section

POOLS = ("unseen", "hard", "learnable", "easy")
"""The curriculum's pools, in the order of the metrics and the state file."""


class CurriculumConfig(_Section):
    """A pass-rate curriculum (prime-rl's ``DifficultyPoolSampler``: pools by threshold, relative weights, unseen
    prompts reachable at once; here with one weight per pool and a running pass rate). Each training prompt keeps an
    exponential moving average of its groups' pass rates; the pools are set by the thresholds; each prompt of the next
    generation batch comes from a pool drawn by the pools' weights (empty pools' weight redistributed over the others),
    then uniformly from that pool, without repeats within a batch. Saved in every checkpoint and continued by
    ``resume``, ``train.resume_from`` and an elastic resume on another gang size. It replaces TRL's epoch order, so
    ``train.grpo.shuffle_dataset: false`` (the data's order) is refused with it; TRL's default (shuffled) is what it
    does anyway."""

    easy_threshold: float = Field(0.9, gt=0, le=1)
    """A prompt whose pass rate is at or above this (0..1) is in the ``easy`` pool (its groups rarely carry a
    signal)."""
    hard_threshold: float = Field(0.1, ge=0, lt=1)
    """A prompt whose pass rate is at or below this (0..1) is in the ``hard`` pool; between the two thresholds it is
    ``learnable``."""
    unseen_weight: float = Field(1.0, ge=0)
    """Relative weight of the prompts never sampled and without a prior (prime-rl's neutral 1.0)."""
    learnable_weight: float = Field(1.0, ge=0)
    """Relative weight of the ``learnable`` pool (the signal peaks near a 50 % pass rate)."""
    easy_weight: float = Field(0.1, ge=0)
    """Relative weight of the ``easy`` pool: low, not 0, so that an item that was learnt is still revisited (prime
    warns that narrow pools stall small-batch runs)."""
    hard_weight: float = Field(0.1, ge=0)
    """Relative weight of the ``hard`` pool: low, not 0, so that a hard item can become learnable."""
    ema: float = Field(0.5, gt=0, le=1)
    """Weight of a new group's pass rate in the prompt's running pass rate: ``rate <- (1 - ema) x rate + ema x
    passes / num_generations`` (the first group without a prior sets it). 1 keeps the latest group's only, as
    prime-rl's sampler does."""
    pass_reward: str | None = None
    """The reward (a ``rewards[].name``) whose value decides whether a completion passes; null: the weighted sum of
    every reward (the reward GRPO's advantage is computed from). A completion no reward scored fails."""
    pass_threshold: float = 0.5
    """A completion passes when that reward is above this (e.g. 0.5 for a 0/1 accuracy reward; an environment's
    outcome reward the same way)."""
    prior_column: str | None = None
    """A prepared row's column read as the prompt's initial pass-rate estimate (kept with ``data.columns``): its
    prompt starts in the pool that estimate puts it in instead of ``unseen``; a row where it is null stays unseen.
    Null: no prior."""
    prior: Literal["pass_rate", "level"] = "pass_rate"
    """How ``prior_column`` reads: ``pass_rate``, a number in 0..1 used as is; ``level``, a difficulty level (higher
    is harder, e.g. a reasoning-gym curriculum level) mapped by rank onto 1..0: the lowest level present 1, the
    highest 0, the others evenly between."""

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> CurriculumConfig:
        if self.hard_threshold >= self.easy_threshold:
            raise ValueError(f"train.curriculum.hard_threshold ({self.hard_threshold:g}) must be below easy_threshold "
                             f"({self.easy_threshold:g}): the learnable pool lies between them")
        return self

    @model_validator(mode="after")
    def _some_pool_weighs(self) -> CurriculumConfig:
        if not (self.unseen_weight and self.learnable_weight):
            raise ValueError("train.curriculum.unseen_weight and learnable_weight must be above 0: a run starts with "
                             "every prompt unseen, and the learnable pool is what the curriculum is for")
        return self

    def weights(self) -> dict[str, float]:
        """Pool -> relative weight, in :data:`POOLS` order."""
        return {pool: getattr(self, f"{pool}_weight") for pool in POOLS}


def curriculum_refusal(cfg) -> str | None:
    """Why ``cfg`` (a :class:`grpo_steps.config.PipelineConfig`) cannot run its ``train.curriculum``, with the fix;
    None when it can (or has none)."""
    cur, train = cfg.train.curriculum, cfg.train
    if cur is None:
        return None
    names = [spec.name for spec in cfg.rewards]
    if cur.pass_reward is not None and cur.pass_reward not in names:
        return (f"train.curriculum.pass_reward {cur.pass_reward!r} is not one of the configured rewards {names}: "
                "name one of them, or null for the weighted sum")
    if train.grpo.get("shuffle_dataset") is False:
        # TRL's RepeatSampler reads shuffle_dataset; the curriculum's sampler replaces it and always draws at random
        # (by the pools' weights, with train.seed), so the data's own order cannot be kept
        return ("train.grpo.shuffle_dataset: false asks for the training prompts in the data's order, but "
                "train.curriculum draws every generation batch at random by the prompts' pass rates: remove "
                "shuffle_dataset, or set train.curriculum: null to train in the data's order")
    steps = train.grpo.get("steps_per_generation")
    if isinstance(steps, int) and steps < train.gradient_accumulation_steps:
        # several generation batches per optimizer step: transformers reads all of the step's micro-batches before the
        # first is generated, so a batch would be drawn before the pass rates of the batch before it exist
        return (f"train.curriculum needs each generation batch to span at least one optimizer step, but "
                f"train.grpo.steps_per_generation ({steps}) < gradient_accumulation_steps "
                f"({train.gradient_accumulation_steps}): remove steps_per_generation, or raise it")
    if cur.prior_column is not None:
        from grpo_steps.config.data import kept_columns

        missing = [src.name for src in cfg.data.sources() if cur.prior_column not in kept_columns(src)]
        if missing:
            return (f"train.curriculum.prior_column {cur.prior_column!r} is not a column the data keeps for "
                    f"{missing}: add it to data.columns (of each mixture entry), or set prior_column: null")
    return None
