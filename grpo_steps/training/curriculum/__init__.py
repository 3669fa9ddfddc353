"""``train.curriculum``: the next generation batches drawn by each training prompt's running pass rate (pools
and weights: :mod:`.state`; the trainer's side: :mod:`.sampler`), in place of TRL's shuffled epochs, and kept in every
checkpoint.

How it plugs in. TRL's ``GRPOTrainer`` reads its prompts through ``_get_train_sampler`` (a ``RepeatSampler``:
chunks of ``generation_batch_size / num_generations`` prompts, each prompt ``num_generations`` times in a row, each
chunk ``num_iterations x steps_per_generation`` times); the trainer's override returns
:class:`.sampler.CurriculumSampler` instead (the same shape, each chunk drawn by :meth:`.state.PassRates.draw` when
the dataloader reaches it), where the prompt cursor's :class:`grpo_steps.training.cursor.CursorSampler` goes without
a curriculum. After every training generation round (the first one, and ``resample``'s extra rounds, whose prompts
are drawn by the pools' weights too: :meth:`.sampler.Curriculum.extra_rows`) the trainer calls
:meth:`.sampler.Curriculum.observe`: the round's prompt ids and rewards, gathered from every process, become per-group
passes. ``replay`` and ``skip`` change what trains, not what was sampled: the sampled groups are observed.

A pass: the ``pass_reward``'s value (else the weighted sum of the rewards, as GRPO's advantage reads them) above
``pass_threshold``; a completion no reward scored fails. With ``environment:`` the game's rewards are the rewards.

Metrics (every process computes the same, from gathered values): ``curriculum/pool/<pool>`` (prompts in each pool as
the next draw sees them), ``curriculum/drawn/<pool>`` (share of the batch drawn from each pool),
``curriculum/drawn_pass_rate`` (mean pass rate the batch's groups scored), ``curriculum/zero_signal_share`` (share of
its groups whose rewards are all equal). At train end the pass rates per step are drawn as a heat map
(:mod:`.picture`), logged to the MLflow run as ``curriculum/pass_rate.png``.
"""
