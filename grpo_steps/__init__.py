"""GRPO pipeline steps: one module per concern (config, data, models, servers, weight_sync,
train, launch, evaluate, register, tracking, checkpoints); ``steps`` glues them to the flow."""

METAFLOW_PACKAGE_POLICY = "include"
