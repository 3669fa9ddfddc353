"""``zero_signal_groups: skip``: no forward/backward for a micro-batch in which no process has a non-zero advantage
(with ``beta: 0`` its loss and gradient are exactly zero). The micro-batch is prepared before TRL's training step
(TRL generates when a generation batch is due and slices its buffer), so that the decision can be made; a skipped
micro-batch is counted as TRL's training step counts one. Refused with DeepSpeed (its engine counts micro-batches
in backward) by the config.
"""

from __future__ import annotations

import time

import torch

from grpo_steps import trl_hooks
from grpo_steps.training.distributed import average_accumulated_gradients, reduce_over_processes
from grpo_steps.training.zero_signal import ZeroSignalMode
from grpo_steps.training.zero_signal.plan import has_signal, signal_first


class Skip(ZeroSignalMode):
    """Skips micro-batches without signal; metric ``zero_signal/skipped_share`` (share of micro-batches skipped)."""

    correction_in_loss = False  # micro-batches without signal never reach the loss

    def __init__(self) -> None:
        self._prepared: dict | None = None  # the micro-batch prepared by training_step, handed to TRL's step

    def prepare_inputs(self, trainer, generation_batch) -> dict:
        if self._prepared is not None:
            prepared, self._prepared = self._prepared, None
            return prepared
        return super().prepare_inputs(trainer, generation_batch)

    def training_step(self, trainer, model, inputs, num_items_in_batch):
        model.train()  # as Trainer.training_step does before preparing: TRL buffers and logs "train" only then
        if callable(getattr(trainer.optimizer, "train", None)):
            trainer.optimizer.train()
        started, buffered = time.perf_counter(), trl_hooks.buffered_batches(trainer)
        prepared = trainer.trl_prepare_inputs(inputs)
        if trl_hooks.buffered_batches(trainer) is not buffered and recut_signal_first(trainer):  # a new batch
            batches = signal_first(trl_hooks.buffered_batches(trainer))
            trl_hooks.set_buffered_batches(trainer, batches)
            prepared = batches[trl_hooks.micro_step(trainer) % trainer.args.steps_per_generation]
        signal = reduce_over_processes(trainer.accelerator, has_signal(prepared), "max")  # all processes skip
        trl_hooks.log_metric(trainer, "zero_signal/skipped_share", 1.0 - signal)  # together (DDP syncs in backward)
        trl_hooks.add_step_time(trainer, time.perf_counter() - started)  # TRL's step_time counts the generation too
        if signal:
            self._prepared = prepared
            return super().training_step(trainer, model, inputs, num_items_in_batch)
        # zero advantages and beta 0: the loss and its gradient are zero; count the micro-batch as TRL's
        # training_step does, so that the next one is the right slice of the buffer
        average_accumulated_gradients(trainer.accelerator, model)
        if trl_hooks.count_micro_step(trainer) % trainer.current_gradient_accumulation_steps == 0:
            trl_hooks.end_step_time(trainer)
        return torch.zeros((), device=trainer.args.device)


def recut_signal_first(trainer) -> bool:
    """Whether ``skip`` may cut a generation batch's micro-batches with the rows with signal first
    (:func:`grpo_steps.training.zero_signal.plan.signal_first`) without changing the optimizer step: the generation
    batch is one accumulation window, and neither the loss's normalization (``bnpo``: by the micro-batch's tokens)
    nor an entropy mask (``top_entropy_quantile`` < 1: a quantile per micro-batch) depends on the cut."""
    return (trainer.args.steps_per_generation == trainer.args.gradient_accumulation_steps > 1
            and trainer.loss_type != "bnpo" and trainer.top_entropy_quantile == 1.0)
