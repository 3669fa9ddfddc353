"""GRPO pipeline: one module per concern on the flow side (config, sources, data, models, evaluate,
report, register, tracking, checkpoints, launch, lora, monitor, processes, deploy); ``steps`` holds the step bodies
the flow calls; ``weights`` the weight path's files, S3 chain, labels and server flags; ``servers`` the generation
server and its client; ``training`` what runs in the training process
(reached from the flow side only through ``training.job``)."""

METAFLOW_PACKAGE_POLICY = "include"
