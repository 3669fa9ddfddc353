"""What runs in the training process (``python -m grpo_steps.training JOB.json``, under ``accelerate launch``), and
nothing else.

- :mod:`.job`: the training job (:class:`~grpo_steps.training.job.TrainJob`, the config -> ``trl.GRPOConfig``
  mapping); importable without torch or TRL, and the only module of this package flow-side code imports.
- :mod:`.entry`: the entry point: builds TRL's ``GRPOTrainer`` and trains.
- :mod:`.rollouts`: rollout functions (completions from the generation server, or read from a file).
- :mod:`.trainer`: the ``GRPOTrainer`` subclass for server rollouts, with verified weight pushes.
- :mod:`.weight_sync`: the push side of ``disk`` weight sync (full weights and LoRA adapters) and its checks.
- :mod:`.callbacks`: datastore checkpoints, MLflow metrics, progress lines, the all-None stop.
- :mod:`.eval_during`: held-out evaluation during training.
"""
