"""``zero_signal_groups: resample``: DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2). After
the first generation round, while some process has fewer groups with signal than places, every process generates
another round from other prompts of the training set (rounds are collective: gathers, ZeRO-3 forwards), at most
``max_resample_rounds`` rounds; the batch keeps its size, filled with the first rounds' groups with signal
(:func:`grpo_steps.training.zero_signal.plan.plan_resample`).
"""

from __future__ import annotations

import torch

from grpo_steps import trl_hooks
from grpo_steps.training.distributed import reduce_over_processes
from grpo_steps.training.zero_signal import ZeroSignalMode
from grpo_steps.training.zero_signal.plan import plan_resample, select_groups, signal_groups


class Resample(ZeroSignalMode):
    """Metrics: ``zero_signal/frac_before``, ``frac_after``, ``groups_generated`` and ``rounds`` per generation
    batch (all processes)."""

    def __init__(self, max_rounds: int) -> None:
        self.max_rounds = max_rounds

    def generate(self, trainer, inputs: list[dict]) -> dict:
        g, accelerator = trainer.num_generations, trainer.accelerator
        batches = [trainer.generate_round(inputs)]
        signal = [signal_groups(batches[0]["advantages"], g)]
        places = len(signal[0])
        while len(batches) < self.max_rounds:
            short = sum(int(s.sum()) for s in signal) < places
            if not reduce_over_processes(accelerator, short, "max"):  # every process agrees: rounds are collective
                break
            batches.append(trainer.generate_round(extra_rows(trainer, places, len(batches))))
            signal.append(signal_groups(batches[-1]["advantages"], g))
        picks, used = plan_resample(signal, places)
        output = batches[0]
        if len(batches) > 1:  # TRL's num_items_in_batch counts the loss's tokens of all processes
            output = select_groups(batches, picks, g)
            tokens = reduce_over_processes(accelerator, output["num_items_in_batch"], "sum")
            output["num_items_in_batch"] = torch.tensor(tokens, device=output["num_items_in_batch"].device)
        total = reduce_over_processes(accelerator, places, "sum")
        for name, value in (
                ("frac_before", 1 - reduce_over_processes(accelerator, int(signal[0].sum()), "sum") / total),
                ("frac_after", 1 - reduce_over_processes(accelerator, used, "sum") / total),
                ("groups_generated", reduce_over_processes(accelerator, places * len(batches), "sum")),
                ("rounds", float(len(batches)))):
            trl_hooks.log_metric(trainer, f"zero_signal/{name}", value)
        return output


def extra_rows(trainer, groups: int, round_index: int) -> list[dict]:
    """``groups`` other prompts of the training set, each repeated ``num_generations`` times (TRL's order), drawn by
    a generator seeded with the seed, the optimizer step, the round and the process: a resumed run draws the same.
    Uniformly; with ``train.curriculum``, by its pools' weights (:meth:`grpo_steps.training.curriculum.sampler.
    Curriculum.extra_rows`)."""
    seed = ((trainer.args.seed * 1_000_003 + trainer.state.global_step) * 101 + round_index) * 1009 \
        + trainer.accelerator.process_index
    curriculum = getattr(trainer, "curriculum", None)  # train.curriculum: the extra prompts by the pools' weights too
    picks = curriculum.extra_rows(groups, seed) if curriculum is not None else []
    if not picks:
        generator = torch.Generator().manual_seed(seed)
        picks = torch.randperm(len(trainer.train_dataset), generator=generator)[:groups].tolist()
    picks += [picks[i % len(picks)] for i in range(groups - len(picks))]  # a training set smaller than a batch
    return [trainer.train_dataset[i] for i in picks for _ in range(trainer.num_generations)]
