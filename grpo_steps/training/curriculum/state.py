"""The curriculum's state: each training prompt's running pass rate, its pool, and the draw of each generation batch.

Pure Python (no torch), the same on every process: every process applies the same gathered observations and draws
generation batch ``k`` with a generator seeded by ``(seed, k)``, so all ranks draw the same batch without talking.

Staleness. Batch ``k`` is drawn from the pass rates observed up to batch ``k - 1 - lag`` (:meth:`PassRates.draw`),
whatever moment the draw happens at: the dataloaders read ahead of training (transformers reads an optimizer step's
micro-batches before the first is generated, accelerate one batch more; ``generation.async``'s prompt stream reads
``depth`` batches ahead, :func:`grpo_steps.config.prefetch_depth`), so a pass rate is ``lag + 1`` generation batches
old at most when it decides a draw (:func:`lag_for`). A draw asked for before those observations can exist raises
instead of drawing from whatever arrived first, and observations newer than a draw's are held back (``pending``),
so an uninterrupted run and a resumed one draw the same batches.

The random state is the batch index itself (a counter-based generator: ``random.Random(f"{seed}:{k}")``), so the
state file (:data:`STATE_FILE`) holds no generator bytes: the seed, the pass rates, the observations held back and the
batches drawn ahead of training are all a resume needs to draw what the uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from grpo_steps.config.curriculum import POOLS

STATE_FILE = "curriculum.json"
"""The curriculum's state in a trainer checkpoint directory (:meth:`PassRates.state`)."""

HISTOGRAM_BINS = 10
"""Pass-rate bins of the per-step histogram (``[0, 0.1), ..., [0.9, 1]``) drawn at the end of training."""


def lag_for(prefetch_depth: int) -> int:
    """Generation batches between the last batch whose pass rates a draw reads and the drawn batch, less one:
    1 for the trainer's own read-ahead (an optimizer step's micro-batches are read before its generation batch is
    generated, and accelerate reads one batch more; with ``steps_per_generation >= gradient_accumulation_steps``, which
    ``start`` requires, that is the batch after the one being generated), plus ``generation.async``'s prompt stream
    depth (0 without it).

    >>> lag_for(0), lag_for(2)
    (1, 3)
    """
    return 1 + prefetch_depth


def pool_of(rate: float | None, hard: float, easy: float) -> str:
    """The pool of a pass rate: ``unseen`` (None), ``hard`` (<= ``hard``), ``easy`` (>= ``easy``), else ``learnable``.

    >>> [pool_of(r, 0.1, 0.9) for r in (None, 0.0, 0.1, 0.5, 0.9, 1.0)]
    ['unseen', 'hard', 'hard', 'learnable', 'easy', 'easy']
    """
    if rate is None:
        return "unseen"
    return "hard" if rate <= hard else "easy" if rate >= easy else "learnable"


def pool_shares(sizes: dict[str, int], weights: dict[str, float]) -> dict[str, float]:
    """The probability that a draw takes its prompt from each pool: the pools' weights over the pools that hold
    prompts (an empty pool's weight is shared out over the others in proportion to theirs); all 0 when no pool with
    weight holds a prompt.

    >>> shares = pool_shares({"unseen": 0, "hard": 4, "learnable": 2, "easy": 4},
    ...                      {"unseen": 1.0, "hard": 0.1, "learnable": 1.0, "easy": 0.1})
    >>> {pool: round(share, 4) for pool, share in shares.items()}  # unseen's 1.0 shared out: 0.1 / 1.2, 1.0 / 1.2
    {'unseen': 0.0, 'hard': 0.0833, 'learnable': 0.8333, 'easy': 0.0833}
    """
    total = sum(weights[pool] for pool in POOLS if sizes.get(pool))
    return {pool: (weights[pool] / total if total and sizes.get(pool) else 0.0) for pool in POOLS}


def level_priors(levels: Sequence[float | None]) -> list[float | None]:
    """Difficulty levels (higher is harder; None: no level) as initial pass rates by rank: the lowest level present
    1, the highest 0, the others evenly between; one level only: 0.5 for all.

    >>> level_priors([3, 1, None, 2, 1])
    [0.0, 1.0, None, 0.5, 1.0]
    """
    distinct = sorted({level for level in levels if level is not None})
    if len(distinct) == 1:
        return [None if level is None else 0.5 for level in levels]
    rank = {level: i / (len(distinct) - 1) for i, level in enumerate(distinct)}
    return [None if level is None else 1.0 - rank[level] for level in levels]


class PassRates:
    """The curriculum of one run (the same object on every process, and for every dataloader of a process).

    Args:
        ids: the prompt id of each row of the training set, in its order (unique: the prepared split holds each
            prompt once).
        config: the run's :class:`grpo_steps.config.CurriculumConfig`.
        seed: ``train.seed``; lag: :func:`lag_for`.
        priors: per row, an initial pass rate in 0..1 or None (``train.curriculum.prior_column``).
    """

    def __init__(self, ids: list[str], config, seed: int, lag: int,
                 priors: Sequence[float | None] | None = None) -> None:
        self.ids, self.config, self.seed, self.lag = ids, config, seed, lag
        self.weights = config.weights()
        self.rates: dict[str, float] = {i: min(max(float(p), 0.0), 1.0)
                                        for i, p in zip(ids, priors or [], strict=False) if p is not None}
        self.groups: dict[str, int] = {}
        """Groups observed per prompt id."""
        self.pending: dict[int, list[list]] = {}
        """Generation batch -> its observed groups ``[id, passes, num_generations]``, not yet in ``rates``."""
        self.applied_through = -1
        """The last generation batch whose observations are in ``rates``."""
        self.plan: dict[int, list[int]] = {}
        """Generation batch -> the rows drawn for it, kept until it is trained (shared by every dataloader)."""
        self.plan_pools: dict[int, list[str]] = {}
        """Generation batch -> the pool each drawn row came from."""
        self.history: dict[int, list[int]] = {}
        """Optimizer step -> histogram (:data:`HISTOGRAM_BINS` counts) of the pass rates of the groups it trained."""
        self.resumed_batch = 0
        """The generation batch this attempt trains first (a checkpoint's :attr:`next_batch`)."""
        self.next_batch = 0
        """Generation batches trained so far (the index of the next one)."""

    def pools(self) -> dict[str, list[int]]:
        """Pool -> the rows in it (ascending), from the pass rates applied so far."""
        members: dict[str, list[int]] = {pool: [] for pool in POOLS}
        for row, prompt in enumerate(self.ids):
            members[pool_of(self.rates.get(prompt), self.config.hard_threshold, self.config.easy_threshold)].append(row)
        return members

    def draw(self, batch: int, size: int, current: int) -> list[int]:
        """The rows (``size`` distinct ones) of generation batch ``batch``, drawn once (:meth:`pick`, seeded by the
        seed and ``batch``) and kept. ``current``: the generation batch being trained now (its observations may be
        incomplete).

        Raises:
            RuntimeError: ``batch`` is read more than ``lag`` batches ahead of ``current`` (its pass rates do not
                exist yet), or after later batches were drawn (the kept draw was dropped).
            ValueError: fewer rows with a weight than ``size``.
        """
        if batch in self.plan:
            return self.plan[batch]
        through = batch - 1 - self.lag
        if batch > current + self.lag:
            raise RuntimeError(f"curriculum: generation batch {batch} was read while batch {current} trains, more "
                               f"than the lag of {self.lag} batches ahead: its pass rates do not exist yet (a "
                               "dataloader reads further ahead than grpo_steps.training.curriculum.state.lag_for says)")
        if max(through, -1) < self.applied_through:
            raise RuntimeError(f"curriculum: generation batch {batch} is drawn after batch "
                               f"{self.applied_through + 1 + self.lag}, whose pass rates are newer")
        self._apply_through(through)
        rows, pools = self.pick(size, random.Random(f"{self.seed}:{batch}"), f"generation batch {batch}")
        self.plan[batch], self.plan_pools[batch] = rows, pools
        return rows

    def pick(self, size: int, rng: random.Random, what: str) -> tuple[list[int], list[str]]:
        """``size`` distinct rows and the pool of each, from the pass rates applied so far: each place takes a pool by
        :func:`pool_shares` (recomputed as pools empty), then a row of it uniformly (``rng``'s draws; ``what`` names
        the batch in the error).

        Raises:
            ValueError: fewer rows in pools with a weight than ``size``.
        """
        members = self.pools()
        rows, pools = [], []
        for _ in range(size):
            shares = pool_shares({pool: len(m) for pool, m in members.items()}, self.weights)
            if not any(shares.values()):
                raise ValueError(f"curriculum: {what} needs {size} prompts, but only {len(rows)} are in pools with a "
                                 "weight above 0: raise train.curriculum's easy_weight or hard_weight, or use more "
                                 "training prompts")
            live = [pool for pool in POOLS if shares[pool]]
            pick, cumulative, pool = rng.random(), 0.0, live[-1]  # the last live pool takes rounding leftovers
            for candidate in live:
                cumulative += shares[candidate]
                if pick < cumulative:
                    pool = candidate
                    break
            rows.append(members[pool].pop(rng.randrange(len(members[pool]))))
            pools.append(pool)
        return rows, pools

    def _apply_through(self, batch: int) -> None:
        for index in sorted(k for k in self.pending if k <= batch):
            for prompt, passes, num_generations in self.pending.pop(index):
                observed = passes / num_generations
                before = self.rates.get(prompt)
                self.rates[prompt] = observed if before is None else before + self.config.ema * (observed - before)
                self.groups[prompt] = self.groups.get(prompt, 0) + 1
        self.applied_through = max(self.applied_through, batch)

    def observe(self, batch: int, step: int, groups: Iterable[tuple[str, int, int]]) -> None:
        """Record generation batch ``batch``'s groups ``(prompt id, passes, num_generations)`` (every process's,
        gathered), trained at optimizer step ``step``; they reach the pass rates when a batch ``lag + 1`` later is
        drawn. Drops the kept draws of batches before ``batch``."""
        groups = [[prompt, int(passes), int(n)] for prompt, passes, n in groups]
        self.pending.setdefault(batch, []).extend(groups)
        self.next_batch = max(self.next_batch, batch + 1)
        histogram = self.history.setdefault(step, [0] * HISTOGRAM_BINS)
        for _, passes, n in groups:
            histogram[min(int(passes / n * HISTOGRAM_BINS), HISTOGRAM_BINS - 1)] += 1
        for old in [k for k in self.plan if k < batch]:
            del self.plan[old], self.plan_pools[old]

    def state(self) -> dict:
        """Everything a resume needs, as JSON-able values."""
        return {"seed": self.seed, "lag": self.lag, "next_batch": self.next_batch, "rates": self.rates,
                "groups": self.groups, "applied_through": self.applied_through,
                "pending": {str(k): v for k, v in self.pending.items()},
                "plan": {str(k): v for k, v in self.plan.items()},
                "plan_pools": {str(k): v for k, v in self.plan_pools.items()},
                "history": {str(k): v for k, v in self.history.items()}}

    def save(self, checkpoint: str | os.PathLike) -> None:
        """Write the state into a trainer checkpoint directory."""
        (Path(checkpoint) / STATE_FILE).write_text(json.dumps(self.state()))

    def load(self, checkpoint: str | os.PathLike | None) -> PassRates:
        """Continue from the state saved in ``checkpoint`` (None, or a checkpoint saved without a curriculum: a
        fresh curriculum, the priors kept). The saved lag is kept unless this run's is larger (another
        ``generation.async``), so that a resume draws what the uninterrupted run would have. Returns ``self``.

        Raises:
            ValueError: the checkpoint's pass rates name prompts this run's training set does not hold (another data
                set or split).
        """
        path = Path(checkpoint) / STATE_FILE if checkpoint else None
        if path is None or not path.exists():
            return self
        saved = json.loads(path.read_text())
        named = set(saved["rates"]) | {prompt for groups in saved["pending"].values() for prompt, _, _ in groups}
        unknown = named - set(self.ids)
        if unknown:
            raise ValueError(f"{path}: {len(unknown)} prompts of the curriculum are not in this run's training set: "
                             "the checkpoint trained other data (data.* must be the checkpoint's)")
        self.rates, self.groups = saved["rates"], saved["groups"]
        self.lag, self.applied_through = max(self.lag, saved["lag"]), saved["applied_through"]
        self.pending = {int(k): v for k, v in saved["pending"].items()}
        self.plan = {int(k): v for k, v in saved["plan"].items()}
        self.plan_pools = {int(k): v for k, v in saved["plan_pools"].items()}
        self.history = {int(k): v for k, v in saved["history"].items()}
        self.resumed_batch = self.next_batch = saved["next_batch"]
        return self
