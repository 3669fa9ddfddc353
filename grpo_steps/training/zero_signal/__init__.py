"""Groups whose rewards are all equal (``train.zero_signal_groups``): their advantages are zero, so with ``beta: 0``
they add nothing to the gradient. One mode per file behind one small interface, :class:`ZeroSignalMode`, whose
methods the trainer's overrides delegate to (:mod:`grpo_steps.training.trainer`):

- ``keep`` (:class:`ZeroSignalMode` itself): TRL's behaviour, trains on them.
- ``skip`` (:mod:`.skip`): no forward/backward for a micro-batch whose advantages are all zero (exact: its loss and
  gradient are zero), after cutting the generation batch's micro-batches with the rows with signal first.
- ``resample`` (:mod:`.resample`): DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2): more
  groups from other prompts until the generation batch holds as many groups with non-zero reward variance as it has
  places, or until ``train.max_resample_rounds`` rounds; the batch keeps its size.
- ``replay`` (:mod:`.replay`): Axolotl's replay buffer (Axolotl GRPO docs, "Replay buffer"): groups with signal of
  recent generation batches take the places of the groups without signal; their importance weights against the
  current policy are recomputed.

The pure functions they share are in :mod:`.plan`. Metrics (all processes): ``zero_signal/frac_before`` and
``zero_signal/frac_after`` (share of groups without signal in the first round and in the batch trained on),
``zero_signal/groups_generated`` and ``zero_signal/rounds`` (resample), ``zero_signal/skipped_share`` (skip),
``zero_signal/replayed``, ``zero_signal/buffer_size``, ``zero_signal/replay_age``, ``zero_signal/replay_is_weight``
(replay).
"""

from __future__ import annotations

from grpo_steps.training.zero_signal.plan import (
    ReplayBuffer,
    fill_from_buffer,
    has_signal,
    importance_weights,
    plan_replay,
    plan_resample,
    replayed_rows,
    select_groups,
    signal_first,
    signal_groups,
)

__all__ = ["ReplayBuffer", "ZeroSignalMode", "fill_from_buffer", "has_signal", "importance_weights", "mode_for",
           "plan_replay", "plan_resample", "replayed_rows", "select_groups", "signal_first", "signal_groups"]


class ZeroSignalMode:
    """``keep``, and the interface of every mode: the trainer (a
    :class:`grpo_steps.training.trainer.PipelineGRPOTrainer`) delegates its generation round while training, its
    micro-batch preparation and its training step to the configured mode; each method's default is TRL's own path."""

    correction_in_loss: bool = True
    """Whether the mismatch correction may be weighed in the loss's forward (:mod:`grpo_steps.training.correction`):
    every micro-batch of a generation batch reaches the loss once, with its rows as generated."""

    def generate(self, trainer, inputs: list[dict]) -> dict:
        """The generation batch trained on for ``inputs`` (TRL's rows: each prompt ``num_generations`` times)."""
        return trainer.generate_round(inputs)

    def prepare_inputs(self, trainer, generation_batch) -> dict:
        """The micro-batch TRL's training step trains on (TRL generates when a generation batch is due)."""
        return trainer.trl_prepare_inputs(generation_batch)

    def training_step(self, trainer, model, inputs, num_items_in_batch):
        """One micro-step: TRL's forward/backward; returns the loss (a 0-dim tensor)."""
        return trainer.trl_training_step(model, inputs, num_items_in_batch)


def mode_for(train) -> ZeroSignalMode:
    """The mode that ``train`` (a :class:`grpo_steps.config.TrainConfig`) configures."""
    if train.zero_signal_groups == "skip":
        from grpo_steps.training.zero_signal.skip import Skip

        return Skip()
    if train.zero_signal_groups == "resample":
        from grpo_steps.training.zero_signal.resample import Resample

        return Resample(train.max_resample_rounds)
    if train.zero_signal_groups == "replay":
        from grpo_steps.training.zero_signal.replay import Replay

        return Replay(ReplayBuffer(train.replay_buffer_size, train.replay_max_age))
    return ZeroSignalMode()
