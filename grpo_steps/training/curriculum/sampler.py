"""The trainer's side of ``train.curriculum``: the train sampler, the observation of each training round, the
checkpoint and picture callback, and :func:`build` (see :mod:`grpo_steps.training.curriculum`)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch
from transformers import TrainerCallback

from grpo_steps import trl_hooks
from grpo_steps.config import POOLS, optimizer_steps_per_generation, prefetch_depth
from grpo_steps.training.curriculum.state import PassRates, lag_for, level_priors
from grpo_steps.training.cursor import prompt_id


class CurriculumSampler(torch.utils.data.Sampler):
    """``RepeatSampler``'s shape (``base``: TRL's sampler) with each chunk drawn by ``rates`` when first reached.
    A resumed attempt's first ``skip_positions()`` indices (those transformers skips by position, trained before the
    checkpoint) are placeholders (row 0), and its first chunk is the checkpoint's next generation batch.
    ``current()``: the generation batch being trained (for the lag check)."""

    def __init__(self, base, rates: PassRates, current: Callable[[], int], skip_positions: Callable[[], int]) -> None:
        self.chunk, self.mini, self.repeat = base.batch_size, base.mini_repeat_count, base.repeat_count
        self.length, self.rates = len(base), rates
        self.current, self.skip_positions = current, skip_positions
        self.next_batch: int | None = None

    def __iter__(self):
        skip = 0
        if self.next_batch is None:  # this attempt's first epoch: the one it resumes
            skip, self.next_batch = self.skip_positions(), self.rates.resumed_batch
        yield from [0] * skip
        emitted = skip
        while emitted < self.length:
            rows = self.rates.draw(self.next_batch, self.chunk, self.current())
            self.next_batch += 1
            positions = [row for _ in range(self.repeat) for row in rows for _ in range(self.mini)]
            positions = positions[:self.length - emitted]
            emitted += len(positions)
            yield from positions

    def __len__(self) -> int:
        return self.length


class Curriculum:
    """The trainer's handle on the curriculum: ``rates`` (:class:`.state.PassRates`), the pass rule
    (``config.pass_reward``, ``config.pass_threshold``)."""

    def __init__(self, rates: PassRates, config) -> None:
        self.rates, self.config = rates, config

    def current(self, trainer) -> int:
        """The generation batch the trainer trains now (TRL generates one every ``steps_per_generation x
        num_iterations`` micro-steps)."""
        every = trainer.args.steps_per_generation * trainer.num_iterations
        return self.rates.resumed_batch + trl_hooks.micro_step(trainer) // every

    def sampler(self, trainer, base, skip_positions: Callable[[], int]) -> CurriculumSampler:
        """The train sampler of ``trainer`` in place of TRL's ``base``."""
        return CurriculumSampler(base, self.rates, lambda: self.current(trainer), skip_positions)

    def extra_rows(self, size: int, seed: int) -> list[int]:
        """At most ``size`` distinct rows (fewer when the pools with a weight hold fewer; the caller repeats them) for
        ``resample``'s extra rounds, by the pools' weights (:meth:`.state.PassRates.pick` with a
        generator seeded by ``seed``): the pass rates as applied when the round runs, which are the same in a
        resumed run (the dataloaders draw the same batches in the same order before it)."""
        weighted = sum(len(rows) for pool, rows in self.rates.pools().items() if self.rates.weights[pool])
        return self.rates.pick(min(size, weighted), random.Random(f"extra:{seed}"), "a resample round")[0]

    def round_rewards(self, trainer, rows: int) -> tuple[list[float], list[float]]:
        """The latest training round's ``rows`` completions (every process's, TRL's log of the round): the weighted
        sum of the rewards of each (GRPO's reward; NaN where no reward scored it) and the value the pass rule reads
        (``pass_reward``'s, or that sum).

        Raises:
            ValueError: ``pass_reward`` is not among the trainer's reward functions."""
        logged, names = trl_hooks.logged_batch(trainer)["rewards"], list(trainer.reward_func_names)
        columns = [list(logged[name])[-rows:] for name in names]
        weights = trainer.reward_weights.tolist()
        totals = [math.nan if all(math.isnan(v) for v in row) else
                  sum(w * v for w, v in zip(weights, row, strict=True) if not math.isnan(v))
                  for row in zip(*columns, strict=True)]
        if self.config.pass_reward is None:
            return totals, totals
        if self.config.pass_reward not in names:
            raise ValueError(f"train.curriculum.pass_reward {self.config.pass_reward!r} is not among the trainer's "
                             f"rewards {names}")
        return totals, columns[names.index(self.config.pass_reward)]

    def observe(self, trainer, inputs: list[dict]) -> None:
        """Record a training round of ``inputs`` (this process's rows; collective: every process calls) and log the
        ``curriculum/*`` metrics."""
        from accelerate.utils import gather_object

        ids = gather_object([prompt_id(x["prompt"]) for x in inputs])  # the global batch, in TRL's row order
        g, batch = trainer.num_generations, self.current(trainer)
        totals, values = self.round_rewards(trainer, len(ids))
        passed = [not math.isnan(v) and v > self.config.pass_threshold for v in values]
        groups = [(ids[start], sum(passed[start:start + g]), g) for start in range(0, len(ids), g)]
        drawn = self.rates.plan_pools.get(batch, [])
        self.rates.observe(batch, trainer.state.global_step + 1, groups)
        scored = [0.0 if math.isnan(v) else v for v in totals]  # TRL zeroes an unscorable completion's advantage
        flat = sum(max(scored[s:s + g]) - min(scored[s:s + g]) < 1e-6 for s in range(0, len(scored), g))
        metrics = {f"curriculum/pool/{pool}": len(rows) for pool, rows in self.rates.pools().items()}
        metrics |= {f"curriculum/drawn/{pool}": drawn.count(pool) / len(drawn) for pool in POOLS if drawn}
        metrics["curriculum/drawn_pass_rate"] = sum(p for _, p, _ in groups) / (g * len(groups))
        metrics["curriculum/zero_signal_share"] = flat / len(groups)
        for name, value in metrics.items():
            trl_hooks.log_metric(trainer, name, float(value))


class CurriculumCallback(TrainerCallback):
    """Writes the curriculum's state into each checkpoint (local main process of each node; place it before the
    datastore upload), and at train end draws the pass rates per step (:func:`.picture.pass_rate_heatmap`) into
    ``output_dir`` and, with a tracked run (``mlflow_run_id``, ``tracking_uri``), onto the MLflow run."""

    def __init__(self, rates: PassRates, mlflow_run_id: str | None = None, tracking_uri: str | None = None) -> None:
        self.rates, self.run_id, self.tracking_uri = rates, mlflow_run_id, tracking_uri

    def on_save(self, args, state, control, **kwargs):
        if state.is_local_process_zero:
            self.rates.save(f"{args.output_dir}/checkpoint-{state.global_step}")
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not self.rates.history:
            return control
        from grpo_steps.training.curriculum.picture import log_heatmap

        log_heatmap(self.rates.history, args.output_dir, self.run_id, self.tracking_uri)
        return control


def build(cfg, args, rows: list[dict], resume_from: str | None) -> Curriculum | None:
    """The run's curriculum over the train ``rows`` (None without ``train.curriculum``), continued from
    ``resume_from``'s state when it holds one; ``args``: the ``GRPOConfig`` (its seed).

    Raises:
        ValueError: a ``prior_column`` value that is not a number, or a pass-rate prior outside 0..1.
    """
    config = cfg.train.curriculum
    if config is None:
        return None
    depth = 0
    if cfg.generation.async_ is not None:
        depth = prefetch_depth(cfg.generation.async_.max_staleness, optimizer_steps_per_generation(cfg.train),
                               cfg.generation.weight_sync_every)
    priors = None
    if config.prior_column is not None:
        values = [row.get(config.prior_column) for row in rows]
        bad = [v for v in values if v is not None and (not isinstance(v, int | float) or (
            config.prior == "pass_rate" and not 0 <= v <= 1))]
        if bad:
            within = " in 0..1 (prior: pass_rate)" if config.prior == "pass_rate" else ""
            raise ValueError(f"train.curriculum.prior_column {config.prior_column!r}: values must be numbers{within}, "
                             f"not {bad[0]!r} ({len(bad)} rows): fix the column, or set prior: level for levels")
        priors = level_priors(values) if config.prior == "level" else values
    rates = PassRates([prompt_id(row["prompt"]) for row in rows], config, args.seed, lag_for(depth), priors)
    return Curriculum(rates.load(resume_from), config)
